"""kvferry as an SGLang KV-transfer backend: the classes SGLang's scheduler
drives, unchanged (``--disaggregation-transfer-backend kvferry``).

SGLang's prefill and decode schedulers (``disaggregation/prefill.py`` and
``decode.py``) talk to a backend through four classes that
``get_kv_class`` returns: a manager per rank, a sender per request on
prefill, a receiver per request on decode, and the bootstrap server the
prefill's HTTP process runs.  This module implements them over the
``kvferry`` binding, with exactly the signatures, attributes and call
order those schedulers use (docs/SGLANG.md maps each one):

* prefill: ``Sender(mgr, bootstrap_addr, room, dest_tp_ranks, pp_rank)``;
  poll() is Bootstrapping until every decode rank it feeds gave its pages;
  then ``pop_decode_prefix_len()``, ``init(num_pages, aux_index)`` (a PAGE
  count, 0 on a full prefix hit) and ``send(pages, state_indices)`` per
  chunk, the call reaching the declared count being the last;
* decode: ``Receiver(mgr, bootstrap_addr, room)``, ``init(prefill_dp_rank)``
  (the C receiver is created: registry lookup and connection run on the
  engine's threads), poll() WaitingForInput once resolved and connected,
  then ``send_metadata(pages, aux_index, state_indices, decode_prefix_len)``.

Two versions of that contract (SGLang 0094505da741's and the newest), told
apart by what SGLang's objects have, never by a version string: the newest
adds ``get_max_transfer_tokens()``, ``mark_prefill_complete()`` and the
decode allocation policy (readiness through the registry, _readiness.py),
optimistic prefill (held rooms), new ``KVArgs`` fields and ``StateType``s.

The one idea that makes the SGLang contract hold: a room's failure never
makes a call raise.  A refused ``init``/``send``/``send_metadata`` fails the
room (its reason kept), and every failure surfaces through ``poll()`` and
``failure_exception()``, which raises SGLang's ``KVTransferError``.  States
latch in ``conclude_state`` so that ``poll()`` after ``clear()`` still
answers, as SGLang's schedulers need.

SGLang's own ``KVPoll``, ``KVArgs``, ``StateType``, ``DisaggregationMode``,
``KVTransferMetric`` and ``KVTransferError`` are used when ``sglang`` is
importable; otherwise fallbacks with the same names, values and
constructor signatures (so the classes are testable without SGLang).
"""
import array
import dataclasses
import enum
import json
import logging
import os
import threading
import types
import time
import urllib.error
import urllib.request
from typing import List, Optional

from . import _lib
from ._convert import addr_problem, text_problem, to_u32_array, to_uint
from ._logquota import LogQuota
from ._sglang_layers import LayerwiseSender
from .args import KVArgs as _FerryArgs
from .args import KVPoll as _Poll
from .args import StateGroup
from .errors import KVFerryError, KVFerryStateError
from .errors import KVTransferError as _FerryTransferError
from .manager import BootstrapServer, KVManager
from .room import KVReceiver, KVSender
from ._readiness import QUERY_INTERVAL_S, ReadinessBoard

logger = logging.getLogger(__name__)
# What a request's bootstrap_host can make this process log, kept to a quota.
_quota = LogQuota(logger)

__all__ = ["KVFerryKVManager", "KVFerryKVSender", "KVFerryKVReceiver",
           "KVFerryKVBootstrapServer", "KVPoll", "KVArgs", "StateType",
           "DisaggregationMode", "KVTransferMetric", "KVTransferError",
           "PrefillServerInfo", "HAVE_SGLANG"]

# ---------------------------------------------------------------------------
# SGLang's vocabulary, or equivalents
# ---------------------------------------------------------------------------

try:                                                    # pragma: no cover
    from sglang.srt.disaggregation.base.conn import (BaseKVBootstrapServer,
                                                     BaseKVManager, BaseKVReceiver,
                                                     BaseKVSender, KVArgs, KVPoll)
    HAVE_SGLANG = True
except ImportError:
    HAVE_SGLANG = False
    BaseKVManager = BaseKVSender = BaseKVReceiver = BaseKVBootstrapServer = object
    KVPoll = _Poll

    class KVArgs:
        """SGLang's newest ``KVArgs``: annotations only; the scheduler sets
        what it has, and an unset field does not exist on the instance.
        ``num_draft_entries`` (SGLang's class default 0) is left unset here,
        so that arguments filled the older way, whose draft buffers follow
        the model's unannounced, keep working.  The fields older SGLang had
        and the newest lost (``ib_traffic_class``, ``swa_page_size``,
        ``total_kv_layers``, ``dcp_size``/``dcp_rank``) are read when a
        scheduler sets them."""
        engine_rank: int
        kv_data_ptrs: List[int]
        kv_data_lens: List[int]
        kv_item_lens: List[int]
        kv_layer_ids: List[int]
        kv_cache_dtype_str: str
        aux_data_ptrs: List[int]
        aux_data_lens: List[int]
        aux_item_lens: List[int]
        state_types: list
        state_data_ptrs: List[List[int]]
        state_data_lens: List[List[int]]
        state_item_lens: List[List[int]]
        state_layer_ids: List[List[int]]
        state_dim_per_tensor: List[List[int]]
        state_slice_outer_counts: List[List[int]]
        is_hybrid_mla_backend: bool
        state_conv_shard_groups: list
        ib_device: str
        gpu_id: int
        kv_head_num: int
        total_kv_head_num: int
        page_size: int
        system_dp_rank: int
        rust_http_port: Optional[int]
        pp_rank: int
        prefill_start_layer: int
        prefill_end_layer: Optional[int]
        mla_compression_ratios: Optional[List[int]]
        kv_buf_groups: int
        hidden_kv_layers: int
        draft_kv_layers: int
        num_draft_entries: int

try:                                                    # pragma: no cover
    from sglang.srt.disaggregation.base.conn import StateType
except ImportError:
    class StateType(str, enum.Enum):
        """SGLang's newest ``StateType``.  ``C128_STATE`` (its name before
        ``DSV4_REQUEST_STATE``, same value) stays an alias, so that code of
        either SGLang names it."""
        MAMBA = "mamba"
        QSA_PENDING = "qsa_pending"
        QSA_COMPRESSED = "qsa_compressed"
        SWA = "swa"
        DSA = "dsa"
        DSA_TAIL = "dsa_tail"
        MINIMAX_INDEX_K = "minimax_index_k"
        SWA_RING = "swa_ring"
        DSV4_REQUEST_STATE = "c128_state"
        C128_STATE = "c128_state"
        BLOCK_SCALE = "block_scale"
        BLOCK_SCALE_SWA = "block_scale_swa"

try:                                                    # pragma: no cover
    from sglang.srt.disaggregation.base.conn import KVTransferMetric
except ImportError:
    @dataclasses.dataclass
    class KVTransferMetric:
        """SGLang's ``KVTransferMetric``."""
        transfer_latency_s: Optional[float] = None
        alloc_latency_s: Optional[float] = None
        transfer_total_bytes: Optional[int] = None

try:                                                    # pragma: no cover
    from sglang.srt.disaggregation.common.conn import KVTransferError
except ImportError:
    # kvferry's own: SGLang's three positional arguments and str(), plus the
    # origin of the root cause.
    KVTransferError = _FerryTransferError

try:                                                    # pragma: no cover
    from sglang.srt.disaggregation.utils import DisaggregationMode
except ImportError:
    class DisaggregationMode(enum.Enum):
        """SGLang's ``DisaggregationMode``."""
        NULL = "null"
        PREFILL = "prefill"
        DECODE = "decode"


@dataclasses.dataclass
class PrefillServerInfo:
    """What the prefill registry's ``GET /route`` (all ranks -1) answers:
    the fields SGLang's decode scheduler reads from
    ``kv_manager.prefill_info_table[addr]``."""
    attn_tp_size: int = 1
    attn_cp_size: int = 1
    dp_size: int = 1
    pp_size: int = 1
    page_size: Optional[int] = None
    kv_cache_dtype: Optional[str] = None
    follow_bootstrap_room: bool = True
    enable_dsa_cache_layer_split: bool = False
    prefill_http_port: Optional[int] = None
    decode_allocation_policy: Optional[str] = None      # newer SGLang

    @classmethod
    def from_json(cls, d):
        """The info of a registry's answer; ValueError naming the field when
        it is not what a registry answers (SGLang's scheduler computes with
        these fields).  Keys it does not know are skipped."""
        if not isinstance(d, dict):
            raise ValueError("the answer is a %s, not a JSON object" % type(d).__name__)
        out = {}
        for f in dataclasses.fields(cls):
            if f.name in d:
                why = _INFO_RULES[f.name](d[f.name])
                if why is not None:
                    raise ValueError("%s %s" % (f.name, why))
                out[f.name] = d[f.name]
        return cls(**out)


def _whole(lo, hi, null=False):
    """A rule for an integer field in lo..hi (or null)."""
    def rule(v):
        if v is None and null:
            return None
        if type(v) is not int or not lo <= v <= hi:
            return "must be an integer in %d..%d%s, got %s" % (
                lo, hi, " or null" if null else "",
                v if type(v) is int and abs(v) < 10 ** 18 else "a %s" % type(v).__name__)
        return None
    return rule


def _flag(v):
    return None if type(v) is bool else "must be true or false, got a %s" % type(v).__name__


def _dtype_name(v):
    return None if v is None else text_problem(v, 64)


# The registry's answer, field by field (the ranges its C side accepts).
_INFO_RULES = {
    "attn_tp_size": _whole(1, 4096), "attn_cp_size": _whole(1, 4096),
    "dp_size": _whole(1, 65536), "pp_size": _whole(1, 1024),
    "page_size": _whole(1, 0xFFFFFFFF, null=True), "kv_cache_dtype": _dtype_name,
    "follow_bootstrap_room": _flag, "enable_dsa_cache_layer_split": _flag,
    "prefill_http_port": _whole(1, 65535, null=True),
    "decode_allocation_policy": _dtype_name,     # a short name, or null
}


UNKNOWN_REASON = "Failed due to an unknown reason from another rank"
# How long failure_exception() waits for another rank's cause to arrive
# when this rank's own room has not failed (docs/SGLANG.md): it comes
# within milliseconds; the wait covers a scheduler's all-reduce that won
# the race by far.
RELAY_WAIT_S = 1.0
# What SGLang's call order needs of the library beyond 0.1.0: the
# destination after WaitingForInput, typed state, the decode prefix.
_NEEDS = ("kvf_receiver_set_dest", "kvf_sender_set_states",
          "kvf_sender_decode_prefix_len")
ABORT_REASON = "Aborted by AbortReq."
_FINAL = (_Poll.Success, _Poll.Failed)


def _mode(m):
    v = str(getattr(m, "value", m)).lower()
    if v not in ("prefill", "decode"):
        raise ValueError("disaggregation_mode must be DisaggregationMode.PREFILL or "
                         "DECODE, got %r" % (m,))
    return v


def _get(obj, name, default=None):
    v = getattr(obj, name, default)
    return default if v is None else v


# ---------------------------------------------------------------------------
# Parallel coordinates and SGLang's KVArgs -> kvferry's layout
# ---------------------------------------------------------------------------

def _parallel(server_args, kv_args, mode):
    """attn TP/CP/DP sizes and ranks of this rank.  From SGLang's
    ``get_parallel()`` when it is there, else derived from ``server_args``
    as SGLang derives them (attn_tp = tp / dp with DP attention, / cp)."""
    try:                                                # pragma: no cover
        from sglang.srt.runtime_context import get_parallel
        p = get_parallel()
        return {k: int(getattr(p, k)) for k in (
            "attn_tp_size", "attn_tp_rank", "attn_cp_size", "attn_cp_rank",
            "attn_dp_size", "attn_dp_rank")}
    except Exception:
        pass
    tp = int(_get(server_args, "tp_size", 1))
    dp = int(_get(server_args, "dp_size", 1))
    cp = int(_get(server_args, "attn_cp_size", 1))
    dp_attn = bool(_get(server_args, "enable_dp_attention", False))
    attn_tp = max(tp // (dp if dp_attn else 1) // cp, 1)
    rank = int(_get(kv_args, "engine_rank", 0))
    tp_rank = rank % attn_tp
    return {"attn_tp_size": attn_tp, "attn_tp_rank": tp_rank,
            "attn_cp_size": cp, "attn_cp_rank": (rank // attn_tp) % cp,
            "attn_dp_size": dp if dp_attn else 1,
            "attn_dp_rank": rank // (attn_tp * cp) if dp_attn else 0}


class _DeviceBuffer:
    """One of SGLang's pool pointers (an integer) declared as memory of a
    CUDA device, the way ``kvferry.KVArgs`` takes device buffers (what
    kvferry.vllm passes for a torch tensor): ``data_ptr()``, ``nbytes``,
    ``device``.  The library then asks the CUDA driver, and refuses a
    pointer that is not that device's memory."""

    def __init__(self, ptr, nbytes, ordinal):
        self._ptr = int(ptr)
        self.nbytes = int(nbytes)
        self.device = types.SimpleNamespace(type="cuda", index=int(ordinal))

    def data_ptr(self):
        return self._ptr


def _pool_device(kv_args, server_args, mode):
    """The CUDA ordinal of SGLang's KV and state pools, or None for host
    memory: what ``--device`` says, with ``kv_args.gpu_id`` (one rule for
    both adapters: the framework says where its pools are, the library
    checks it with the driver).  Aux buffers (``MetadataBuffers``) are host
    memory either way."""
    device = str(_get(server_args, "device", "cpu")).lower()
    if device in ("cpu", ""):
        return None
    if device.split(":")[0] == "cuda":
        return int(_get(kv_args, "gpu_id", 0))
    raise RuntimeError(
        "kvferry: the %s server's KV cache is on device=%r, but kvferry registers "
        "host and CUDA memory only.  Use --device cuda or cpu, or another "
        "--disaggregation-transfer-backend for this device." % (mode, device))


def _on_device(ptrs, lens, ordinal, what):
    """``ptrs`` as device buffers of ``ordinal`` (each with its length)."""
    if ordinal is None:
        return list(ptrs)
    if len(lens) != len(ptrs):
        raise ValueError("kvferry: %s_data_lens has %d entries for %d pointers"
                         % (what, len(lens), len(ptrs)))
    return [_DeviceBuffer(p, n, ordinal) for p, n in zip(ptrs, lens)]


def _target_entries(kv_args, server_args, mode, per_layer, n):
    """How many of the ``n`` KV buffers are the model's own (the rest are a
    draft model's, appended after them by SGLang)."""
    extra = getattr(kv_args, "num_draft_entries", None)     # newer SGLang
    if extra is not None:
        return n - int(extra)
    start = getattr(kv_args, "prefill_start_layer", None)
    end = getattr(kv_args, "prefill_end_layer", None)
    if mode == "prefill" and start is not None and end is not None:
        return min(n, per_layer * (int(end) - int(start)))
    if not _get(server_args, "speculative_algorithm", None):
        return n
    hf = getattr(server_args, "get_hf_config", None)
    layers = getattr(hf(), "num_hidden_layers", None) if callable(hf) else None
    if layers is not None and int(_get(server_args, "pp_size", 1)) == 1:
        return min(n, per_layer * int(layers))
    raise ValueError(
        "kvferry: this %s server has a draft model (--speculative-algorithm %s), but "
        "its KVArgs do not say which of its %d KV buffers are the draft's "
        "(num_draft_entries, or prefill_start_layer/prefill_end_layer on prefill) and "
        "the model's layer count is unknown (server_args.get_hf_config())"
        % (mode, _get(server_args, "speculative_algorithm"), n))


def _kv_tags(kv_args, server_args, mode, mla, n):
    """One (layer, role, group) per KV buffer, in SGLang's order: the model's
    K of every layer then V of every layer (MLA: one buffer per layer) from
    its first layer, then the draft model's the same way (group 1).  With
    ``kv_layer_ids`` (one global layer id per buffer) the ids are used and
    the role is the id's occurrence: K, V, then further buffers."""
    per_layer = 1 if mla else 2
    first_role = _lib.KV_KV if mla else _lib.KV_K
    ids = list(getattr(kv_args, "kv_layer_ids", None) or [])
    if ids:
        if len(ids) != n:
            raise ValueError("kvferry: kv_layer_ids has %d entries for %d KV buffers"
                             % (len(ids), n))
        seen, tags = {}, []
        for lid in ids:
            k = seen.get(lid, 0)
            seen[lid] = k + 1
            tags.append((int(lid), first_role + k, 0))
        return tags
    t = _target_entries(kv_args, server_args, mode, per_layer, n)
    start = int(_get(kv_args, "prefill_start_layer", 0)) if mode == "prefill" else 0
    tags = []
    for group, (lo, hi, first) in enumerate(((0, t, start), (t, n, 0))):
        count = hi - lo
        if count == 0:
            continue
        if count % per_layer:
            raise ValueError("kvferry: %d KV buffers of %s cannot be K and V per layer"
                             % (count, "the model" if group == 0 else "the draft model"))
        layers = count // per_layer
        for j in range(count):
            tags.append((first + j % layers, first_role + j // layers, group))
    return tags


# State whose "indices" are not rows: SGLang's DSA_TAIL passes a descriptor
# ([req_pool_idx, start_phys, first_n, 0, second_n, tail_size]) that each
# backend decodes into byte blocks.  Copied index for index it would write
# the wrong bytes, so it is refused.
_NOT_ROWS = {"dsa_tail": "its indices are a descriptor of byte blocks "
                         "([req_pool_idx, start_phys, first_n, 0, second_n, "
                         "tail_size]), not rows, and kvferry copies state row "
                         "for row"}


def _state_groups(kv_args, ordinal):
    """SGLang's ``state_types`` with their nested ptrs/lens/item lens, one
    kvferry state group each, named by the type's value.  Every type whose
    indices are rows is copied index for index, known or not (the BLOCK_SCALE
    scales of mxfp8 KV included): a ``None`` index list for a type (what
    SGLang's schedulers pass for types they build no indices for) moves
    nothing for it.  ``state_layer_ids`` (newer SGLang), when set, must be
    parallel to the buffers."""
    kinds = list(getattr(kv_args, "state_types", None) or [])
    layer_ids = getattr(kv_args, "state_layer_ids", None)
    if layer_ids is not None and len(layer_ids) not in (0, len(kinds)):
        raise ValueError("kvferry: state_layer_ids has %d entries for %d state_types"
                         % (len(layer_ids), len(kinds)))
    groups = []
    for i, t in enumerate(kinds):
        ptrs = list(kv_args.state_data_ptrs[i])
        lens = list(kv_args.state_data_lens[i])
        items = list(kv_args.state_item_lens[i])
        name = str(getattr(t, "value", t))
        if name in _NOT_ROWS:
            raise RuntimeError("kvferry: state type %r (state_types[%d]) is not "
                               "supported: %s.  Run this model with another "
                               "--disaggregation-transfer-backend."
                               % (name, i, _NOT_ROWS[name]))
        if not ptrs:
            raise ValueError("kvferry: state type %r (state_types[%d]) has no buffers"
                             % (name, i))
        if layer_ids and layer_ids[i] is not None and len(layer_ids[i]) != len(ptrs):
            raise ValueError("kvferry: state_layer_ids[%d] has %d entries for the %d "
                             "buffers of state type %r"
                             % (i, len(layer_ids[i]), len(ptrs), name))
        groups.append(StateGroup(type=name, data_ptrs=_on_device(ptrs, lens, ordinal,
                                                                  "state"),
                                 data_lens=lens, item_lens=items))
    return groups


def _registered_dtype(kv_args, server_args):
    """SGLang's KV cache dtype string: ``kv_args.kv_cache_dtype_str`` (newer
    SGLang: the pool's own), else ``--kv-cache-dtype``."""
    own = getattr(kv_args, "kv_cache_dtype_str", None)
    if own:
        return str(own)
    return str(_get(server_args, "kv_cache_dtype", "auto"))


def _checksum_requested(server_args):
    """SGLang's ``--disaggregation-enable-kv-checksum``: SGLang digests the
    KV itself into an extra metadata buffer (one more aux buffer, copied as
    any other); kvferry then checks every byte it moves as well."""
    return bool(_get(server_args, "disaggregation_enable_kv_checksum", False))


def ferry_args(kv_args, mode, server_args, is_mla_backend, par):
    """A ``kvferry.KVArgs`` from SGLang's ``KVArgs`` and ``ServerArgs``."""
    n = len(kv_args.kv_data_ptrs)
    mla = bool(is_mla_backend)
    tags = _kv_tags(kv_args, server_args, mode, mla, n)
    main = [t[0] for t in tags if t[2] == 0]
    # SGLang's --kv-cache-dtype; "auto" is the model's dtype (--dtype), so
    # that "auto" on one side and the same dtype named on the other agree.
    registered = _registered_dtype(kv_args, server_args)
    dtype = registered
    if dtype == "auto":
        dtype = str(_get(server_args, "dtype", "auto"))
    ordinal = _pool_device(kv_args, server_args, mode)
    a = _FerryArgs(
        kv_data_ptrs=_on_device(kv_args.kv_data_ptrs, kv_args.kv_data_lens, ordinal,
                                "kv"),
        kv_data_lens=list(kv_args.kv_data_lens),
        kv_item_lens=list(kv_args.kv_item_lens), kv_tags=tags,
        aux_data_ptrs=list(getattr(kv_args, "aux_data_ptrs", []) or []),
        aux_data_lens=list(getattr(kv_args, "aux_data_lens", []) or []),
        aux_item_lens=list(getattr(kv_args, "aux_item_lens", []) or []),
        state_groups=_state_groups(kv_args, ordinal) or None,
        page_size=int(kv_args.page_size), kv_dtype=dtype,
        attention="mla" if mla else "mha", num_layers=len(set(main)),
        first_layer=min(main),
        engine_rank=par["attn_tp_rank"], tp_size=par["attn_tp_size"],
        pp_rank=int(_get(kv_args, "pp_rank", 0)),
        pp_size=int(_get(server_args, "pp_size", 1)),
        system_dp_rank=par["attn_dp_rank"] if par["attn_dp_size"] > 1
        else int(_get(kv_args, "system_dp_rank", 0)),
        dp_size=int(_get(server_args, "dp_size", 1)),
        cp_rank=par["attn_cp_rank"], cp_size=par["attn_cp_size"],
        dp_attention=par["attn_dp_size"] > 1,
        kv_cache_dtype=registered,
        load_balance_method=_get(server_args, "load_balance_method", None),
        prefill_http_port=_get(server_args, "port", None),
        dsa_cache_layer_split=bool(_get(server_args, "enable_dsa_cache_layer_split",
                                        False)))
    if not mla:
        heads = getattr(kv_args, "kv_head_num", None)
        if heads:                       # prefill; SGLang's decode leaves them out
            a.kv_head_num = int(heads)
            total = getattr(kv_args, "total_kv_head_num", None)
            a.total_kv_head_num = int(total) if total else None
        else:
            a.kv_head_num = 0           # taken from the prefill peer
    for var, field in (("SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT", "bootstrap_timeout_ms"),
                       ("SGLANG_DISAGGREGATION_WAITING_TIMEOUT", "waiting_timeout_ms")):
        ms = _env_seconds_ms(var)
        if ms is not None:
            setattr(a, field, ms)
    if _checksum_requested(server_args):
        a.checksum = True
    # The cluster token's last source, as SGLang orders its own (the
    # library decides: kvf_auth_token_resolve).
    a.api_key = _get(server_args, "api_key", None) or None
    host = _advertise_host(server_args)
    if host is not None:
        a.host = host
    if mode == "prefill":
        a.bootstrap_addr = bootstrap_addr(server_args)
        a.decode_allocation_policy = _get(server_args,
                                          "disaggregation_decode_allocation_policy",
                                          None)
    return a


def _env_seconds_ms(var):
    """SGLang's deadline variables (seconds) as kvferry's milliseconds, when
    set; kvferry's own KVF_*_MS variables are the library's defaults."""
    v = os.environ.get(var)
    if not v:
        return None
    try:
        return max(int(float(v) * 1000), 1)
    except ValueError:
        raise ValueError("%s=%r is not a number of seconds" % (var, v)) from None


def _advertise_host(server_args):
    """The address this rank's engine binds and tells its peers:
    $KVF_HOST (the library's default) wins; else SGLang's host when it is
    a specific address; else SGLang's own guess of the local IP."""
    if os.environ.get("KVF_HOST"):
        return None
    host = _get(server_args, "host", "")
    if host and host not in ("0.0.0.0", "::", "localhost"):
        return host
    try:                                                # pragma: no cover
        from sglang.srt.utils import get_local_ip_auto
        return get_local_ip_auto()
    except Exception:
        return None


def _optimistic(server_args):
    """Whether this prefill server may compute a room before the decode's
    destination is known (SGLang's optimistic prefill: --optimistic-prefill-
    attempts, older --optimistic-prefill-retries, or implied by the
    prefill_complete allocation policy).  Its senders are then held rooms:
    the bootstrap deadline, which would count the prefill's compute, gives
    way to the lease (KVF_LEASE_MS)."""
    policy = _get(server_args, "disaggregation_decode_allocation_policy", None)
    tries = max(int(_get(server_args, "optimistic_prefill_attempts", 0) or 0),
                int(_get(server_args, "optimistic_prefill_retries", 0) or 0))
    return policy == "prefill_complete" or tries > 0


def _check_rust_listener(kv_args, mode, par, policy):
    """Newer SGLang's ``kv_args.rust_http_port``: this prefill rank owns an
    embedded Rust /route listener, SGLang's own registry (it serves every
    backend; kvferry's registry class is then not used).  kvferry's engines
    register with the bootstrap address, which is that registry; refused
    where that is not enough: with attention DP SGLang copies every DP
    rank's /route rows into each listener over its process group, which
    kvferry's engines do not join, and prefill_complete needs kvferry's
    readiness routes, which the Rust registry lacks."""
    port = getattr(kv_args, "rust_http_port", None)
    if port is None or mode != "prefill":
        return
    if par["attn_dp_size"] > 1:
        raise RuntimeError(
            "kvferry: rust_http_port=%s: this prefill rank serves /route from SGLang's "
            "embedded Rust listener, and with attention DP (dp_size=%d) SGLang copies "
            "every DP rank's /route rows into each listener through its process group; "
            "kvferry's engines register with the bootstrap address only, so decode "
            "servers that use another listener would not find them.  Run the prefill "
            "server without the Rust server (SGLANG_RUST_SERVER) or without attention DP."
            % (port, par["attn_dp_size"]))
    if policy == "prefill_complete":
        raise RuntimeError(
            "kvferry: rust_http_port=%s with --disaggregation-decode-allocation-policy "
            "prefill_complete: decode servers learn that a room is computed from "
            "kvferry's bootstrap registry (POST /room_ready), which SGLang's embedded "
            "Rust registry does not serve.  Run without the Rust server or with the "
            "early policy." % port)


def bootstrap_addr(server_args):
    """``host:port`` of the prefill server's registry, as SGLang's
    ``register_to_bootstrap`` computes it (dist_init_addr's host, else
    ``--host``; 0.0.0.0 reads as 127.0.0.1)."""
    dist = _get(server_args, "dist_init_addr", None)
    host = dist.rsplit(":", 1)[0] if dist else _get(server_args, "host", "127.0.0.1")
    if host in ("0.0.0.0", "::", ""):
        host = "127.0.0.1"
    if ":" in host and not host.startswith("["):
        host = "[%s]" % host
    return "%s:%d" % (host, int(_get(server_args, "disaggregation_bootstrap_port", 8998)))


def _auth_headers(api_key=None):
    """The bearer header of a registry write, with the token the library's
    rules give (``kvf_auth_token_resolve``: the same token the engines use,
    from the same sources in the same order, the token file's permission
    check included)."""
    tok, _ = _lib.auth_token(api_key)
    return {"Authorization": "Bearer %s" % tok} if tok else {}


# The longest registry answer read: its parallel info is a few hundred bytes.
_HTTP_BODY_MAX = 64 * 1024


def _http(method, url, body=None, timeout=5.0, auth=None):
    """One registry request; ``auth``: the headers of a write."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method,
                                 headers=dict({"Content-Type": "application/json"},
                                              **(auth or {})))
    with urllib.request.urlopen(req, timeout=timeout) as r:
        out = r.read(_HTTP_BODY_MAX + 1)
        if len(out) > _HTTP_BODY_MAX:
            raise ValueError("the answer is longer than %d bytes" % _HTTP_BODY_MAX)
        return r.status, out


# ---------------------------------------------------------------------------
# Manager
# ---------------------------------------------------------------------------

class KVFerryKVManager(BaseKVManager):
    """One rank's kvferry engine (SGLang's ``BaseKVManager``).

    ``KVFerryKVManager(args, disaggregation_mode, server_args,
    is_mla_backend=False)``: ``args`` is SGLang's ``KVArgs`` as its prefill
    or decode scheduler fills it.  Creates the engine, registers the layout
    (KV buffers tagged by layer, K/V and model/draft; aux; typed state) and,
    on prefill, registers with the bootstrap registry at
    ``server_args.host:disaggregation_bootstrap_port`` in the background.
    """

    supports_dcp_transfer = False
    enable_deferred_decode_kv_release = False

    def __init__(self, args, disaggregation_mode, server_args, is_mla_backend=False):
        self.kv_args = args
        self.disaggregation_mode = disaggregation_mode
        self.mode = _mode(disaggregation_mode)
        self.server_args = server_args
        self.is_mla_backend = bool(is_mla_backend)
        self.is_hybrid_mla_backend = bool(getattr(args, "is_hybrid_mla_backend", False))
        par = _parallel(server_args, args, self.mode)
        self.__dict__.update(par)
        self.dp_size = int(_get(server_args, "dp_size", 1))
        self.pp_size = int(_get(server_args, "pp_size", 1))
        self.pp_rank = int(_get(args, "pp_rank", 0))
        self.bootstrap_host = _get(server_args, "host", "127.0.0.1")
        self.bootstrap_port = int(_get(server_args, "disaggregation_bootstrap_port", 8998))
        self.load_balance_method = _get(server_args, "load_balance_method", None)
        # Older SGLang's KVArgs carry dcp_size; the newest keeps it in its
        # server arguments.
        self.dcp_size = int(_get(args, "dcp_size", None) or _get(server_args, "dcp_size", 1))
        if self.dcp_size > 1:
            raise RuntimeError("kvferry: decode context parallelism (dcp_size=%d) is not "
                               "supported by the kvferry backend yet" % self.dcp_size)
        # Newer SGLang: prefill_complete makes decode servers allocate a
        # room's pages only once the prefill computed it (readiness goes
        # through the registry, _readiness.py); older SGLang has no policy.
        self.decode_allocation_policy = _get(
            server_args, "disaggregation_decode_allocation_policy", None) or "early"
        self.optimistic = self.mode == "prefill" and _optimistic(server_args)
        _check_rust_listener(args, self.mode, par, self.decode_allocation_policy)
        self._api_key = _get(server_args, "api_key", None) or None
        self._board = None
        self.req_to_decode_prefix_len = {}      # room -> tokens the decode holds
        self.prefill_info_table = {}            # bootstrap addr -> PrefillServerInfo
        self.transfer_infos = {}                # SGLang's staging prefetch reads it
        self.enable_staging = False
        self.failure_records = {}               # room -> reason, rooms failed here
        self._lock = threading.Lock()
        self._pending_info = {}                 # addr -> thread fetching /route
        self._dp_jobs = None
        # Prefill CP ranks other than 0 move nothing (kvferry's decode
        # engines take KV from CP rank 0): their senders conclude locally,
        # as SGLang's dummy CP ranks do.
        self.is_dummy_cp_rank = self.mode == "prefill" and self.attn_cp_rank != 0
        for fn in _NEEDS:
            _lib.require(fn, "kvferry as SGLang's transfer backend")
        if self.optimistic:
            _lib.require("kvf_sender_create_held", "SGLang's optimistic prefill")
        # Every rank registers (the registry is ready once dp x cp x tp x pp
        # did); kvferry's decode engines take KV from CP rank 0 only.
        self.ferry_args = ferry_args(args, self.mode, server_args, is_mla_backend, par)
        self.engine = KVManager(self.ferry_args, self.mode)

    # -- what SGLang's schedulers call ---------------------------------------

    def register_to_bootstrap(self):
        """SGLang's hook; the engine registered itself when it was created
        (from its own thread, with retries), so this does nothing."""

    def try_ensure_parallel_info(self, bootstrap_addr):
        """True once the prefill registry at ``bootstrap_addr`` answered its
        parallel info (``prefill_info_table[addr]``).  Never blocks: the
        first call starts the lookup on a thread and returns False; SGLang's
        decode scheduler calls again on later steps."""
        if bootstrap_addr in self.prefill_info_table:
            return True
        why = addr_problem(bootstrap_addr) if isinstance(bootstrap_addr, str) else \
            "is a %s, not a str" % type(bootstrap_addr).__name__
        if why is not None:
            # SGLang gives up on the address after its retries.
            _quota.log(logging.WARNING, "kvferry: prefill registry address %s %s; a request's "
                       "bootstrap_host and port name it", _shown_arg(bootstrap_addr), why)
            return False
        with self._lock:
            th = self._pending_info.get(bootstrap_addr)
            if th is None or not th.is_alive():
                th = threading.Thread(target=self._fetch_info, args=(bootstrap_addr,),
                                      name="kvferry-route", daemon=True)
                self._pending_info[bootstrap_addr] = th
                th.start()
        return bootstrap_addr in self.prefill_info_table

    def _fetch_info(self, addr):
        url = ("http://%s/route?prefill_dp_rank=-1&prefill_cp_rank=-1&"
               "target_tp_rank=-1&target_pp_rank=-1" % addr)
        try:
            status, body = _http("GET", url)
        except (OSError, ValueError) as e:
            logger.debug("kvferry: %s not ready: %s", url, e)
            return
        if status != 200:
            return
        try:
            self.prefill_info_table[addr] = PrefillServerInfo.from_json(json.loads(body))
        except (ValueError, RecursionError) as e:
            _quota.log(logging.WARNING, "kvferry: the prefill registry at %s answered "
                       "parallel info SGLang cannot use (%s); asked again later", addr, e)

    def _register_dp_rank(self, room):
        """POST /register_dp_rank, as SGLang's CommonKVSender does for
        DP > 1 without follow_bootstrap_room; on a thread (never blocks)."""
        with self._lock:
            if self._dp_jobs is None:
                import queue
                self._dp_jobs = queue.Queue()
                threading.Thread(target=self._dp_worker, name="kvferry-dp",
                                 daemon=True).start()
        self._dp_jobs.put(room)

    def _dp_worker(self):
        url = "http://%s/register_dp_rank" % bootstrap_addr(self.server_args)
        while True:
            room = self._dp_jobs.get()
            try:
                _http("POST", url, {"bootstrap_room": room,
                                    "dp_rank": self.ferry_args.system_dp_rank},
                      auth=_auth_headers(self._api_key))
            except (OSError, ValueError, RuntimeError) as e:
                logger.error("kvferry: room %d: POST %s failed: %s", room, url, e)

    # -- room readiness (prefill_complete) -----------------------------------

    def readiness(self):
        """The board of room readiness (made on first use)."""
        with self._lock:
            if self._board is None:
                self._board = ReadinessBoard(lambda: _auth_headers(self._api_key))
            return self._board

    def _post_ready(self, room, status, reason=None):
        """Prefill, prefill_complete: tell decode servers, through this
        server's registry, that a room was computed or failed before."""
        if self.mode == "prefill" and self.decode_allocation_policy == "prefill_complete":
            self.readiness().post(bootstrap_addr(self.server_args), room, status, reason)

    def get_session_id(self):
        return self.engine.address if self.engine is not None else None

    def teardown(self):
        """Destroy the engine (and every room still open on it)."""
        board, self._board = self._board, None
        if board is not None:
            board.close()
        if self.engine is not None:
            self.engine.close()

    close = teardown

    def __repr__(self):
        return "<KVFerryKVManager %s attn_tp %d/%d %s>" % (
            self.mode, self.attn_tp_rank, self.attn_tp_size,
            self.engine.address if self.engine is not None else "dummy CP rank")


# ---------------------------------------------------------------------------
# Senders and receivers
# ---------------------------------------------------------------------------

class _Room:
    """What SGLang's sender and receiver share: the latched
    ``conclude_state``, failures kept instead of raised, ``clear()``."""

    def _setup(self, mgr, bootstrap_room):
        self.kv_mgr = mgr
        self.bootstrap_room, self._room_why = _room_number(bootstrap_room)
        self.conclude_state = None
        self.init_time = time.time()
        self._h = None                   # the kvferry KVSender / KVReceiver
        self._local_reason = None        # a failure this object decided
        self._local_from_another = False  # ... or learned through the registry
        self._error = None               # the KVTransferError raised, once made
        self._record = None              # the library's failure record, once read
        self._metric = None
        self._stage = "bootstrap"        # "transfer" once it waited for input

    def _fail_here(self, reason, level=logging.ERROR, code=_lib.KVF_ERR_ABORTED,
                   from_another=False):
        """Fail the room from this rank with ``reason``: the library's room
        fails with it as its cause (status ``code``), so that every rank of
        the request, on both sides, names it; never raises.  ``from_another``:
        the reason came from another rank by another way (the prefill's
        failure posted to the registry).  Also after Success: SGLang's
        backends fail an aborted room whatever its state, and the scheduler
        then aborts the request."""
        if self._h is not None and self.conclude_state is None and \
                self._h.poll() == _Poll.Failed:
            self.conclude_state = _Poll.Failed      # the first root cause wins
        if self._local_reason is None and self.conclude_state != _Poll.Failed:
            self._local_reason = reason
            self._local_from_another = from_another
            self.kv_mgr.failure_records[self.bootstrap_room] = reason
        logger.log(level, "kvferry: room %s failed: %s", self.bootstrap_room, reason)
        if self._h is not None:
            try:
                if _lib.has("kvf_sender_fail"):
                    self._h.fail(reason, code)
                else:
                    self._h.abort()
            except KVFerryError:
                pass
        self.conclude_state = _Poll.Failed

    def _poll_handle(self):
        s = self._h.poll()
        if s in (_Poll.WaitingForInput, _Poll.Transferring):
            self._stage = "transfer"
        if s in _FINAL:
            self.conclude_state = s
            self._snapshot()
        return s

    def _snapshot(self):
        if self._h is not None and self._metric is None:
            try:
                self._metric = self._h.metric()
            except KVFerryError:
                self._metric = None

    def failure_exception(self):
        """Raise the room's ``KVTransferError`` (SGLang calls it on every
        rank once the all-reduced poll is Failed).  A rank that saw the root
        cause raises it with ``is_from_another_rank=False``; one that learned
        it from a peer raises the peer's reason with True.  A rank whose own
        room has not failed yet (the scheduler's all-reduce told it another
        rank did) waits up to ``RELAY_WAIT_S`` for that rank's cause, which
        reaches every rank of the request (docs/FAILURES.md), and raises it
        with True (a decode rank waiting for a prefill_complete room also
        waits for the prefill's failure posted to the registry); only if
        none comes does it fail its room and raise
        SGLang's "unknown reason from another rank", saying what it waited
        for.  Also clears the room, as SGLang's backends do."""
        if self._error is None:
            self._error = self._make_error()
        self.conclude_state = _Poll.Failed
        self.clear()
        raise self._error

    def _make_error(self):
        self.kv_mgr.failure_records.pop(self.bootstrap_room, None)
        # This rank's room may not have failed yet: another rank of the
        # request did (the scheduler's all-reduce says so), and its cause is
        # on its way here; the all-reduce can win that race.
        deadline = time.monotonic() + RELAY_WAIT_S
        while self._local_reason is None and self._library_record() is None and \
                self._await_cause(deadline):
            pass
        if self._local_reason is not None:
            first = self._library_record()
            if first is not None and first.is_from_another_rank:
                # Another rank's cause failed the room a moment before this
                # object's own (both ranks aborted): the first cause wins,
                # as on every other rank.
                return _error(self.bootstrap_room, first.failure_reason, True, first)
            if self._local_from_another:
                # The cause came by another way (the registry): the library's
                # record names this rank, which only passed it on.
                return _error(self.bootstrap_room, self._local_reason, True)
            return _error(self.bootstrap_room, self._local_reason, False, first)
        err = self._library_error()
        if err is not None:
            _count_timeout(self.kv_mgr, err, self._stage)
            return err
        if self._h is not None:
            state = self._h.poll()
            reason = ("%s (this rank's room was %s; its scheduler's all-reduce said "
                      "another rank failed the request, and no cause reached this rank "
                      "within %.1f s; look for it in the other ranks' KVTransferError)"
                      % (UNKNOWN_REASON, state.name, RELAY_WAIT_S))
            try:
                self._h.fail(reason) if _lib.has("kvf_sender_fail") else self._h.abort()
            except KVFerryError:
                pass
            return _error(self.bootstrap_room, reason, True)
        # No room here (a receiver before init(): SGLang fails a request
        # still waiting for the prefill's parallel info with the others):
        # no cause can reach this rank.
        return _error(self.bootstrap_room, "%s (this rank had not opened its room yet, so "
                      "no cause could reach it; its scheduler's all-reduce said another rank "
                      "failed the request: look for it in the other ranks' KVTransferError)"
                      % UNKNOWN_REASON, True)

    def _await_cause(self, deadline):
        """Wait until ``deadline`` for the room's cause to reach this rank:
        True once something came (the loop in _make_error looks again),
        False when nothing did."""
        left = deadline - time.monotonic()
        return self._h is not None and left > 0 and self._h.await_failure(left)

    def _library_record(self):
        """The library's record of the room's failure (for a failure this
        object decided, its own: origin this rank), or None.  Read once: the
        library hands a record out once."""
        if self._record is None and self._h is not None:
            try:
                self._h.failure_exception()
            except _FerryTransferError as e:
                self._record = e
            except KVFerryError:
                pass
        return self._record

    def _library_error(self):
        """The library room's record as SGLang's error, or None when the
        room has not failed."""
        first = self._library_record()
        if first is None:
            return None
        return _error(self.bootstrap_room, first.failure_reason, first.is_from_another_rank,
                      first)

    def abort(self):
        """Fail the room here and on its peers ("Aborted by AbortReq.");
        the next poll() is Failed.  Never raises."""
        self._fail_here(ABORT_REASON, logging.INFO)

    def clear(self):
        """Release the room (SGLang calls it on every terminal path).
        Idempotent; poll() keeps answering the concluded state."""
        h = self._h
        if h is not None:
            if self.conclude_state is None:
                s = h.poll()
                self.conclude_state = s if s in _FINAL else _Poll.Failed
            self._snapshot()
            self._h = None
            h.close()
        self.kv_mgr.req_to_decode_prefix_len.pop(self.bootstrap_room, None)

    def _metric_of(self):
        m = self._metric
        if m is None and self._h is not None:
            m = self._h.metric()
        if not m:
            return KVTransferMetric()
        return KVTransferMetric(transfer_latency_s=m["transfer_s"],
                                alloc_latency_s=m["alloc_s"],
                                transfer_total_bytes=m["bytes"])


def _count_timeout(mgr, err, stage):
    """A deadline this rank saw itself, in SGLang's
    ``sglang:kv_transfer_timeouts_total{stage}`` (its shared KV protocol's
    counter: bootstrap, or transfer once the room waited for input), when
    SGLang has it and its metrics are on.  A timeout learned from another
    rank is that rank's observation, not this one's."""
    if getattr(err, "status", None) != "KVF_ERR_TIMED_OUT" or \
            getattr(err, "is_from_another_rank", True):
        return
    try:
        from sglang.srt.observability.kv_transfer_metrics import (
            get_kv_transfer_timeout_counter)
    except ImportError:
        return
    counter = get_kv_transfer_timeout_counter(
        enabled=bool(_get(mgr.server_args, "enable_metrics", False)))
    if counter is not None:
        counter.labels(stage=stage).inc()


def _error(room, reason, from_another, ferry=None):
    if KVTransferError is _FerryTransferError and ferry is not None:
        return _FerryTransferError(room, reason, from_another, ferry.origin_side,
                                   ferry.origin_rank, ferry.origin_addr, ferry.code)
    e = KVTransferError(room, reason, is_from_another_rank=from_another)
    if ferry is not None and KVTransferError is not _FerryTransferError:
        e.origin_side, e.origin_rank = ferry.origin_side, ferry.origin_rank
        e.origin_addr, e.status = ferry.origin_addr, ferry.status
    return e


def _refused(e):
    return "%s: %s" % (type(e).__name__, e)


def _room_number(v):
    """``(room, why)``: SGLang's ``bootstrap_room`` as a room number, or
    None and why it cannot be one (the room then fails with that reason)."""
    if v is None:
        return None, None           # the binding names what is missing
    try:
        return to_uint("bootstrap_room", v, 64), None
    except (TypeError, ValueError) as e:
        return None, str(e)


def _shown_arg(v):
    """A scheduler's argument for a failure reason: short, one line."""
    try:
        return ascii(v)[:40]
    except Exception:
        return "a %s" % type(v).__name__


def _state_lists(v):
    """SGLang's ``state_indices`` (one entry per state type) as a list."""
    if isinstance(v, (str, bytes)) or not hasattr(v, "__iter__"):
        raise TypeError("state_indices must be one entry per state type (a list of index "
                        "lists or None), got a %s" % type(v).__name__)
    return list(v)


def _length(v):
    """``len(v)`` (0 for None), or None for an object without one."""
    if v is None:
        return 0
    try:
        return len(v)
    except Exception:
        return None


class KVFerryKVSender(LayerwiseSender, _Room, BaseKVSender):
    """The prefill side of one request (SGLang's ``BaseKVSender``); the
    layer-pipelined methods of SGLang's open PRs come from LayerwiseSender
    (_sglang_layers.py)."""

    def __init__(self, mgr, bootstrap_addr, bootstrap_room, dest_tp_ranks=None,
                 pp_rank=None, req_has_disagg_prefill_dp_rank=False):
        self._setup(mgr, bootstrap_room)
        self.bootstrap_server_url = bootstrap_addr
        self.dest_tp_ranks = dest_tp_ranks
        self.pp_rank = pp_rank
        self.aux_index = None
        self.num_kv_indices = None
        self.curr_idx = 0
        self._prefix_popped = False
        self._dummy = mgr.is_dummy_cp_rank
        self._held = mgr.optimistic
        self._pad = 0                   # held: leading pages the decode holds, unsent
        self._lead = 0                  # ... how many lead the room
        self._failure_posted = False
        self._layers_setup()
        if self._dummy:
            return
        if self._room_why is not None:
            self._fail_here("kvferry cannot open a room on prefill rank %d: %s"
                            % (mgr.attn_tp_rank, self._room_why))
            return
        try:
            # Optimistic prefill computes before the decode's destination is
            # known: a held room waits for its readers within the lease,
            # with no bootstrap deadline counting the compute.
            self._h = KVSender.held(mgr.engine, self.bootstrap_room) if self._held \
                else KVSender(mgr.engine, bootstrap_addr, self.bootstrap_room)
        except (KVFerryError, ValueError, TypeError) as e:
            self._fail_here("kvferry cannot open room %s on prefill rank %d: %s"
                            % (bootstrap_room, mgr.attn_tp_rank, _refused(e)))
            return
        if mgr.dp_size > 1 and not req_has_disagg_prefill_dp_rank and \
                mgr.load_balance_method != "follow_bootstrap_room":
            mgr._register_dp_rank(self.bootstrap_room)

    def poll(self):
        """The room's KVPoll; Bootstrapping until every decode rank this rank
        feeds gave its destination, then WaitingForInput."""
        if self.conclude_state is not None:
            return self.conclude_state
        if self._dummy:
            return _Poll.WaitingForInput
        if self._queued:
            self._flush_layers(False)   # layers whose kernels finished since
        s = self._poll_handle()
        if s == _Poll.WaitingForInput and not self._prefix_popped and \
                self.bootstrap_room not in self.kv_mgr.req_to_decode_prefix_len:
            n = self._h.decode_prefix_len() if _lib.has(
                "kvf_sender_decode_prefix_len") else 0
            if n is not None:
                self.kv_mgr.req_to_decode_prefix_len[self.bootstrap_room] = n
        if s == _Poll.Failed:
            self._post_failure()
        return s

    def _post_failure(self, reason=None):
        """prefill_complete: decode ranks waiting for this room to be
        computed learn, through the registry, that it never will be, and
        why.  Once."""
        if self._failure_posted or self.kv_mgr.decode_allocation_policy != \
                "prefill_complete":
            return
        self._failure_posted = True
        if reason is None:
            if self._error is None:
                self._error = self._make_error()
            reason = self._error.failure_reason
        self.kv_mgr._post_ready(self.bootstrap_room, "failed",
                                "prefill rank %d: %s" % (self.kv_mgr.attn_tp_rank, reason))

    def _fail_here(self, reason, level=logging.ERROR, code=_lib.KVF_ERR_ABORTED,
                   from_another=False):
        super()._fail_here(reason, level, code, from_another)
        # The root cause: this call's reason, or the library's when the room
        # had failed before (then _make_error reads it).
        self._post_failure(self._local_reason)

    def clear(self):
        live = self._h is not None and self.conclude_state is None and \
            self._h.poll() not in _FINAL
        super().clear()
        if live:        # released unfinished: the library aborted it
            self._post_failure("the prefill server released room %s before it was "
                               "transferred" % self.bootstrap_room)

    def mark_prefill_complete(self):
        """Newer SGLang calls it once the prefill has computed the room.
        With --disaggregation-decode-allocation-policy prefill_complete the
        decode servers allocate the room's pages only now: the room is
        posted ready to this server's registry (from a thread)."""
        if self.conclude_state is None and not self._dummy:
            self.kv_mgr._post_ready(self.bootstrap_room, "ready")

    def get_max_transfer_tokens(self):
        """Newer SGLang asks before each send whether to cut the final range
        into pieces (its staging buffers' size): None, kvferry takes any
        size in one send (it cuts and streams the pages itself)."""
        return None

    def pop_decode_prefix_len(self):
        """Tokens the decode side already holds (SGLang then sends only the
        rest); 0 when none or already popped."""
        if self._prefix_popped:
            return 0
        self._prefix_popped = True
        n = self.kv_mgr.req_to_decode_prefix_len.pop(self.bootstrap_room, None)
        if n is None and self._h is not None and _lib.has("kvf_sender_decode_prefix_len"):
            try:
                n = self._h.decode_prefix_len()
            except KVFerryError:
                n = None
        return n or 0

    def init(self, num_kv_indices, aux_index=None):
        """``num_kv_indices``: the PAGE count to send (0 on a full prefix
        hit); ``aux_index``: the metadata row."""
        self.aux_index = aux_index
        try:
            self.num_kv_indices = to_uint("num_kv_indices", num_kv_indices, 32)
        except (TypeError, ValueError) as e:
            if self.conclude_state is None:
                self._fail_here("KVSender.init refused on prefill rank %d: %s"
                                % (self.kv_mgr.attn_tp_rank, _refused(e)))
            return
        if self._h is None or self.conclude_state is not None:
            return
        try:
            if self._held:
                # A held room's reader takes the sender's pages from its
                # prefix's page on, while SGLang gives only the pages after
                # the prefix: the pages the decode holds lead the room as
                # placeholders that no reader takes.
                prefix = self._h.decode_prefix_len() or 0
                self._pad = self._lead = prefix // int(self.kv_mgr.ferry_args.page_size)
            self._h.init(self._pad + self.num_kv_indices, aux_index)
        except (KVFerryError, ValueError, TypeError) as e:
            self._fail_here("KVSender.init(%s, %s) refused on prefill rank %d: %s"
                            % (self.num_kv_indices, _shown_arg(aux_index),
                               self.kv_mgr.attn_tp_rank, _refused(e)),
                            code=_lib.KVF_ERR_BAD_INDICES)

    def should_send_kv_chunk(self, num_pages, last_chunk):
        """SGLang asks before each chunk: pages to send, or the last chunk
        (even with no pages: aux and state go with it)."""
        return num_pages > 0 or bool(last_chunk)

    def send(self, kv_indices, state_indices=None, *args, **kwargs):
        """One prefill chunk of page indices; the call that reaches the count
        given to ``init`` is the last (``state_indices``, one entry per
        ``kv_args.state_types``, go with it).  Extra arguments of other
        SGLang versions (``token_position_offset``, ``num_kv_tokens`` of a
        range cut by ``get_max_transfer_tokens``, ``producer_event``) are
        accepted and unused.  Never raises for a failed room."""
        n = _length(kv_indices)
        if n is None:
            if self._h is not None and self.conclude_state is None:
                self._fail_here("KVSender.send refused on prefill rank %d: kv_indices is a "
                                "%s, not page indices" % (self.kv_mgr.attn_tp_rank,
                                                          type(kv_indices).__name__))
            return
        if self._ended and n == 0:
            return      # the final metadata ended a layer-wise room already
        last = self.num_kv_indices is not None and self.curr_idx + n >= self.num_kv_indices
        self.curr_idx += n
        if self._dummy:
            if last:
                self.conclude_state = _Poll.Success
            return
        if self._h is None or self.conclude_state is not None:
            return
        if self._h.poll() == _Poll.Failed:
            return          # chunks scheduled before it failed: poll() says it
        if self.num_kv_indices is None:
            self._fail_here("KVSender.send before init on prefill rank %d"
                            % self.kv_mgr.attn_tp_rank)
            return
        pages = [] if kv_indices is None else kv_indices
        if self._queued:
            self._flush_layers(True)    # a layer-wise chunk's layers go first
            if self.conclude_state is not None:
                return
        try:
            states = self._last_states(state_indices) if last else None
            if self._pad:
                pages = _after_placeholders(pages, self._pad)
                self._pad = 0
            self._h.send(pages, states, is_last=last)
        except (KVFerryError, ValueError, TypeError) as e:
            if self._h.poll() == _Poll.Failed:
                return                  # the failure surfaces through poll()
            self._fail_here("KVSender.send(%d pages%s) refused on prefill rank %d: %s"
                            % (n, ", last" if last else "", self.kv_mgr.attn_tp_rank,
                               _refused(e)), code=_lib.KVF_ERR_BAD_INDICES)

    def _last_states(self, state_indices):
        """The last chunk's state indices as the room takes them (one entry
        per state type), or None when none or nothing is registered."""
        if state_indices is None or not self.kv_mgr.engine.state_group_items:
            return None
        return _state_lists(state_indices)

    def get_transfer_metric(self):
        """SGLang's ``KVTransferMetric`` of this room: bytes this rank sent,
        seconds until the decode pages were known, seconds of transfer."""
        return self._metric_of()


def _after_placeholders(pages, n):
    """``pages`` after ``n`` placeholder pages (a held room's pages that the
    decode holds: no reader takes them, so any registered page does)."""
    arr = to_u32_array("kv_indices", pages, allow_empty=True)
    return array.array("I", [arr[0] if len(arr) else 0] * n) + arr


class KVFerryKVReceiver(_Room, BaseKVReceiver):
    """The decode side of one request (SGLang's ``BaseKVReceiver``)."""

    def __init__(self, mgr, bootstrap_addr, bootstrap_room=None, prefill_dp_rank=None):
        self._setup(mgr, bootstrap_room)
        self.bootstrap_addr = bootstrap_addr
        self.require_staging = False
        self.abort_notified = False
        self.prefill_dp_rank = None
        self._dest_given = False
        # prefill_complete: Bootstrapping until the prefill computed the room
        self._await_ready = mgr.decode_allocation_policy == "prefill_complete"
        if prefill_dp_rank is not None:         # SGLang before init(prefill_dp_rank)
            self.init(prefill_dp_rank)

    def init(self, prefill_dp_rank=None):
        """Start the room for the prefill DP group ``prefill_dp_rank``: the
        registry lookup and connection run on the engine's threads."""
        if self._h is not None or self.conclude_state is not None:
            return
        self.prefill_dp_rank = prefill_dp_rank
        if self._room_why is not None:
            self._fail_here("kvferry cannot open a room on decode rank %d: %s"
                            % (self.kv_mgr.attn_tp_rank, self._room_why))
            return
        mismatch = self._policy_mismatch()
        if mismatch:
            self._fail_here(mismatch)
            return
        try:
            self._h = KVReceiver(self.kv_mgr.engine, self.bootstrap_addr,
                                 self.bootstrap_room, prefill_dp_rank)
        except (KVFerryError, ValueError, TypeError) as e:
            self._fail_here("kvferry cannot open room %s on decode rank %d: %s"
                            % (self.bootstrap_room, self.kv_mgr.attn_tp_rank,
                               _refused(e)))
            return
        if self._await_ready:
            self.kv_mgr.readiness().watch(self.bootstrap_addr, self.bootstrap_room)

    def _policy_mismatch(self):
        """The two servers' decode allocation policies, when they differ
        (newer SGLang: the prefill's comes with its parallel info; an older
        prefill registers none, which is "early")."""
        info = self.kv_mgr.prefill_info_table.get(self.bootstrap_addr)
        if info is None:
            return None
        theirs = getattr(info, "decode_allocation_policy", None) or "early"
        mine = self.kv_mgr.decode_allocation_policy
        if theirs == mine:
            return None
        return ("Decode allocation policy mismatch: prefill server %s has "
                "--disaggregation-decode-allocation-policy %s, but decode server has %s. "
                "Both servers must use the same value." % (self.bootstrap_addr, theirs,
                                                            mine))

    def _gate(self, s):
        """prefill_complete: the state SGLang sees while the prefill has not
        computed the room yet (Bootstrapping), or Failed with the prefill's
        reason when it never will."""
        got = self.kv_mgr.readiness().state(self.bootstrap_room)
        if got is None:
            return min(s, _Poll.Bootstrapping)
        self.kv_mgr.readiness().forget(self.bootstrap_room)
        self._await_ready = False
        if got[0] == "ready":
            return s
        if got[0] == "failed":
            self._fail_here("the prefill server at %s failed room %s before the room "
                            "was ready for this decode server: %s"
                            % (self.bootstrap_addr, self.bootstrap_room,
                               got[1] or "(no reason given)"), from_another=True)
        else:
            self._fail_here(got[1])
        return _Poll.Failed

    def _await_cause(self, deadline):
        """prefill_complete, before the prefill said the room was computed:
        the prefill's failure comes through the registry (_gate), and that
        may be the one way here: this rank has sent no destination, so no
        prefill rank knows it (a held room takes no watches), and before
        init() it has no room at all.  Waits for either way."""
        if not self._await_ready:
            return super()._await_cause(deadline)
        board = self.kv_mgr.readiness()
        board.watch(self.bootstrap_addr, self.bootstrap_room)
        while board.state(self.bootstrap_room) is None:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            if self._h is None:
                if board.wait(self.bootstrap_room, left) is None:
                    return False            # timed out, or the manager's teardown
            # The board learns no sooner than its next query: wait on the
            # library's event for that long, then look at the board again.
            elif self._h.await_failure(min(left, QUERY_INTERVAL_S)):
                return True
        self._gate(_Poll.WaitingForInput)
        return True

    def send_metadata(self, kv_indices, aux_index=None, state_indices=None,
                      decode_prefix_len=None, *args, **kwargs):
        """The room's destination, once: decode page indices (those after the
        decode prefix; none on a full prefix hit), the metadata row,
        ``state_indices`` (one entry per ``kv_args.state_types``, None for
        nothing) and ``decode_prefix_len`` (tokens this decode holds)."""
        if self._h is None or self.conclude_state is not None:
            return
        self._dest_given = True
        self.init_time = time.time()
        try:
            states = _state_lists(state_indices) if state_indices is not None and \
                self.kv_mgr.engine.state_group_items else None
            self._h.set_dest([] if kv_indices is None else kv_indices, aux_index, states,
                             decode_prefix_len or 0)
        except (KVFerryError, ValueError, TypeError, RuntimeError) as e:
            n = _length(kv_indices)
            self._fail_here("send_metadata(%s pages, aux_index %s) refused on decode rank %d: "
                            "%s" % ("?" if n is None else n, _shown_arg(aux_index),
                                    self.kv_mgr.attn_tp_rank, _refused(e)),
                            code=_lib.KVF_ERR_BAD_INDICES)

    def poll(self):
        """Bootstrapping before ``init`` and until the prefill ranks are
        resolved and connected; WaitingForInput then (and never more before
        ``send_metadata``: SGLang's decode scheduler rejects that)."""
        if self.conclude_state is not None:
            return self.conclude_state
        if self._h is None:
            return _Poll.Bootstrapping
        s = self._poll_handle()
        if self._await_ready and s != _Poll.Failed:
            s = self._gate(s)
        if not self._dest_given and s > _Poll.WaitingForInput:
            return _Poll.WaitingForInput
        return s

    def get_transfer_metric(self):
        return self._metric_of()

    def abort(self):
        super().abort()
        self.abort_notified = True

    def clear(self):
        if self._await_ready:
            self.kv_mgr.readiness().forget(self.bootstrap_room)
        super().clear()


class KVFerryKVBootstrapServer(BaseKVBootstrapServer):
    """The prefill server's bootstrap registry (SGLang's
    ``BaseKVBootstrapServer``), kvferry's C registry on its own thread:
    SGLang's routes (``PUT/GET /route``, ``/health``, ``/register_dp_rank``,
    ``/query_dp_ranks``), kvferry's room readiness (``/room_ready``,
    ``/query_room_ready``) and ``/metrics``.  ``host``/``port`` as SGLang
    passes them (``--host``, ``--disaggregation-bootstrap-port``); who may
    register follows the cluster token (docs/SECURITY.md), whose last
    source is SGLang's ``--api-key`` (``api_key``/``auth_token``, else
    SGLang's serving context when it has one).

    ``thread``: newer SGLang runs the bootstrap server in a process of its
    own and waits on ``thread.is_alive()`` and ``thread.join()``; this one
    lives until ``close()``."""

    def __init__(self, host="127.0.0.1", port=8998, dp_size=1, auth_token=None,
                 api_key=None, **_):
        self.host = host
        key = api_key or auth_token or _serving_api_key()
        self._server = BootstrapServer(host, int(port), api_key=key)
        self.port = self._server.port
        self._closed = threading.Event()
        self.thread = threading.Thread(target=self._closed.wait,
                                       name="kvferry-registry", daemon=True)
        self.thread.start()

    def run(self):
        """SGLang's name for starting: the registry runs from construction."""

    def close(self):
        self._server.close()
        self._closed.set()


def _serving_api_key():
    """SGLang's --api-key from its serving context (newer SGLang), or None."""
    try:                                                # pragma: no cover
        from sglang.srt.runtime_context import get_serving
        return get_serving().api_key or None
    except Exception:
        return None
