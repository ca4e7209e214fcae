"""``KVPoll`` and ``KVArgs``: the vocabulary shared with SGLang.

``KVArgs`` mirrors SGLang's ``sglang.srt.disaggregation.base.conn.KVArgs``
(``kv_data_ptrs``, ``kv_data_lens``, ``kv_item_lens``, ``aux_*``,
``state_*``, ``engine_rank``, ``kv_head_num``, ``total_kv_head_num``,
``page_size``, ``pp_rank``, ``system_dp_rank``) and adds what SGLang takes
from ``ServerArgs`` (ports, bootstrap address, dtype, TP size) and what
kvferry knows beyond it (attention kind, timeouts, checksums).
"""
import dataclasses
import enum
from dataclasses import dataclass, field
from typing import Any, List, Optional

__all__ = ["KVPoll", "KVArgs", "StateGroup"]


class KVPoll(enum.IntEnum):
    """A room's poll state; the values are SGLang's ``KVPoll`` and kvferry's
    ``kvf_poll_t``.  Ordered: ``min()`` over TP ranks gives the state every
    rank agrees on (Failed wins)."""
    Failed = 0
    Bootstrapping = 1
    WaitingForInput = 2
    Transferring = 3
    Success = 4


@dataclass
class StateGroup:
    """Typed state buffers (SGLang's ``StateType``; ``kvf_state_group_t``).

    ``type`` names the kind ("mamba", "swa", ...): prefill and decode must
    register the same types in the same order.  A room names the group by
    one list of indices, the same indices in each of its buffers (a Mamba
    group: one slot; a sliding-window group: the window's pages in its own
    pool).  ``data_ptrs``/``data_lens``/``item_lens`` as for ``KVArgs``'
    buffers, ``item_lens`` in bytes per index.
    """
    type: str
    data_ptrs: List[Any] = field(default_factory=list)
    data_lens: Optional[List[int]] = None
    item_lens: List[int] = field(default_factory=list)


@dataclass
class KVArgs:
    """What one rank registers (its layout) and how its engine runs.

    Buffers (``kv_data_ptrs``, ``aux_data_ptrs``, ``state_data_ptrs``)
    may be integer addresses, objects with ``data_ptr()`` (torch tensors)
    or writable objects with the buffer protocol (bytearray, mmap, numpy
    arrays).  The matching ``*_data_lens`` entry is required for integer
    addresses and defaults to the object's size otherwise; ``*_item_lens``
    are bytes per page (KV) or per slot (aux, state).  The manager keeps a
    reference to every buffer object until it is closed.

    Layout fields (prefill and decode must agree; a mismatch fails every
    room with a message saying which setting differs):

    * ``page_size`` — tokens per page (required).
    * ``kv_dtype`` — dtype name, e.g. ``"bfloat16"``.
    * ``attention`` — ``"mha"`` (MHA/GQA: a slice of KV heads per rank) or
      ``"mla"`` (every rank holds the full latent vector).
    * ``num_layers`` — model layers on this rank; default: one KV buffer per
      layer for MLA, two (K and V) for MHA.
    * ``first_layer`` — global index of this rank's first layer (a pipeline
      stage's offset; SGLang's ``prefill_start_layer``), default 0.
    * ``kv_head_num`` (per rank), ``total_kv_head_num`` (model),
      ``bytes_per_head`` (per head per token) — MHA only;
      ``total_kv_head_num`` defaults to ``kv_head_num * tp_size``,
      ``bytes_per_head`` to ``kv_item_lens[0] // (page_size * kv_head_num)``.
      A decode engine may set ``kv_head_num=0``: the three are then taken
      from its first prefill peer (SGLang's decode side does not know them).
    * ``kv_tags`` — optional, one ``(layer, role, group)`` per KV buffer:
      the layer's global index, ``0``/``1`` for K/V (``2`` for MLA's one
      buffer; larger values for further per-layer buffers) and ``0`` for the
      model, ``1`` for a draft model sharing its pages.  With tags the
      buffers may come in any order (SGLang's: every K, then every V, then
      the draft's); without, they are K, V layer by layer from
      ``first_layer`` (MLA: one per layer).
    * ``state_groups`` — optional typed state, a list of ``StateGroup``
      (instead of ``state_data_ptrs``, not both).
    * ``kv_order`` — how a KV page orders its bytes: ``"NHD"`` (default,
      token-major: ``[page_size tokens][kv_head_num heads][bytes_per_head]``,
      SGLang's layout) or ``"HND"`` (head-major: ``[heads][tokens][bytes]``,
      vLLM's, which makes a TP slice of a page one contiguous piece).  Both
      sides must register the same order (MHA/GQA; MLA ignores it): kvferry
      does not transpose pages, and refuses a pair whose orders differ.

    Engine fields: ``engine_rank`` (the tp rank; SGLang's name), ``tp_size``,
    ``pp_rank``/``pp_size``, ``system_dp_rank``/``dp_size``, ``host`` and
    ``port`` of the control endpoint (port 0: any free port),
    ``bootstrap_addr`` ("host:port" of the prefill server's registry;
    prefill only), ``host_bootstrap`` (prefill: run the registry
    in-process on ``bootstrap_addr``, whose port may be 0), ``transport``,
    ``checksum``, the deadlines in milliseconds and ``faults`` (a fault
    injection spec for testing failure handling, as ``KVF_FAULTS``),
    ``auth_token`` (the cluster token every engine of the deployment holds;
    ``None`` takes ``KVF_AUTH_TOKEN``, ``KVF_AUTH_TOKEN_FILE`` or
    ``SGLANG_DISAGGREGATION_BOOTSTRAP_AUTH_TOKEN``, then ``api_key``, see
    docs/SECURITY.md), ``api_key`` (the token's last source: SGLang's
    ``--api-key``, in SGLang's order),
    ``streams`` (tcp connections and progress threads per peer pair, 1..8,
    see docs/GUIDE.md), ``metrics_addr`` (``"host:port"``: serve the
    engine's Prometheus metrics there, GET /metrics; ``None`` takes
    ``KVF_METRICS_ADDR``, else none) and ``trace`` (a file path, or
    ``"fd:N"``: write the room trace there; ``None`` takes ``KVF_TRACE``,
    else off), see docs/OPERATIONS.md, and ``busy_poll_us`` (how long the
    progress threads poll on after work before they sleep, 0..1000000;
    ``None`` takes ``KVF_BUSY_POLL_US``, else 0: see docs/GUIDE.md, "Busy
    polling").

    Registration fields (prefill; what SGLang's decode servers and routers
    read from the registry): ``cp_rank``/``cp_size`` (attention context
    parallelism), ``dp_attention`` (the DP group is an attention-DP group),
    ``kv_cache_dtype`` (SGLang's ``--kv-cache-dtype`` string, default the
    layout's ``kv_dtype``), ``load_balance_method`` (default
    ``"follow_bootstrap_room"``), ``prefill_http_port`` (SGLang's ``--port``),
    ``dsa_cache_layer_split``, ``decode_allocation_policy`` (SGLang's
    ``--disaggregation-decode-allocation-policy``; None: not registered).
    They need a library that has them (set to
    non-defaults on an older one, the engine is refused).  ``None`` keeps the
    library default, which honours the ``KVF_*`` environment variables
    (``KVF_HEARTBEAT_TIMEOUT_MS`` and so on; see docs/GUIDE.md).
    """
    kv_data_ptrs: List[Any] = field(default_factory=list)
    kv_data_lens: Optional[List[int]] = None
    kv_item_lens: List[int] = field(default_factory=list)
    aux_data_ptrs: List[Any] = field(default_factory=list)
    aux_data_lens: Optional[List[int]] = None
    aux_item_lens: List[int] = field(default_factory=list)
    state_data_ptrs: List[Any] = field(default_factory=list)
    state_data_lens: Optional[List[int]] = None
    state_item_lens: List[int] = field(default_factory=list)
    state_groups: Optional[List[StateGroup]] = None
    kv_tags: Optional[List[Any]] = None

    page_size: int = 0
    kv_dtype: str = "bfloat16"
    attention: str = "mha"
    num_layers: Optional[int] = None
    first_layer: int = 0
    kv_head_num: int = 1
    total_kv_head_num: Optional[int] = None
    bytes_per_head: Optional[int] = None
    kv_order: str = "NHD"

    engine_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    system_dp_rank: int = 0
    dp_size: int = 1
    host: Optional[str] = None
    port: int = 0
    bootstrap_addr: Optional[str] = None
    host_bootstrap: bool = False
    transport: Optional[str] = None
    checksum: Optional[bool] = None
    bootstrap_timeout_ms: Optional[int] = None
    waiting_timeout_ms: Optional[int] = None
    transfer_timeout_ms: Optional[int] = None
    heartbeat_interval_ms: Optional[int] = None
    heartbeat_timeout_ms: Optional[int] = None
    faults: Optional[str] = None
    auth_token: Optional[str] = field(default=None, repr=False)
    api_key: Optional[str] = field(default=None, repr=False)
    # What a prefill engine tells its registry beyond its coordinates
    # (SGLang's PUT /route fields; decode engines ignore them).
    cp_rank: int = 0
    cp_size: int = 1
    dp_attention: bool = False
    kv_cache_dtype: Optional[str] = None
    load_balance_method: Optional[str] = None
    prefill_http_port: Optional[int] = None
    dsa_cache_layer_split: bool = False
    decode_allocation_policy: Optional[str] = None
    streams: Optional[int] = None
    metrics_addr: Optional[str] = None
    trace: Optional[str] = None
    busy_poll_us: Optional[int] = None

    def replace(self, **changes):
        """A copy with some fields changed (``dataclasses.replace``)."""
        return dataclasses.replace(self, **changes)
