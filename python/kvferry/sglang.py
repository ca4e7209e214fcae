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
import ctypes
import dataclasses
import enum
import json
import logging
import os
import threading
import time
import urllib.error
import urllib.request
from typing import List, Optional

from . import _lib
from ._convert import addr_problem, text_problem, to_uint
from ._logquota import LogQuota
from .args import KVArgs as _FerryArgs
from .args import KVPoll as _Poll
from .args import StateGroup
from .errors import KVFerryError, KVFerryStateError
from .errors import KVTransferError as _FerryTransferError
from .manager import BootstrapServer, KVManager
from .room import KVReceiver, KVSender

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
        """SGLang's ``KVArgs``: annotations only; the scheduler sets what it
        has, and an unset field does not exist on the instance."""
        engine_rank: int
        kv_data_ptrs: List[int]
        kv_data_lens: List[int]
        kv_item_lens: List[int]
        aux_data_ptrs: List[int]
        aux_data_lens: List[int]
        aux_item_lens: List[int]
        state_types: list
        state_data_ptrs: List[List[int]]
        state_data_lens: List[List[int]]
        state_item_lens: List[List[int]]
        state_dim_per_tensor: List[List[int]]
        is_hybrid_mla_backend: bool
        ib_device: str
        ib_traffic_class: str
        gpu_id: int
        kv_head_num: int
        total_kv_head_num: int
        page_size: int
        swa_page_size: Optional[int] = None
        system_dp_rank: int
        pp_rank: int
        prefill_start_layer: int
        prefill_end_layer: Optional[int]
        dcp_size: int = 1
        dcp_rank: int = 0

try:                                                    # pragma: no cover
    from sglang.srt.disaggregation.base.conn import StateType
except ImportError:
    class StateType(str, enum.Enum):
        """SGLang's ``StateType`` (at 0094505da741)."""
        MAMBA = "mamba"
        SWA = "swa"
        DSA = "dsa"
        MINIMAX_INDEX_K = "minimax_index_k"
        SWA_RING = "swa_ring"
        C128_STATE = "c128_state"

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


def _device_pointer(ptr):
    """True when ``ptr`` is CUDA device memory: asks the CUDA driver, when
    the process has it loaded already (never loads it)."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1", mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
    except OSError:
        return False
    kind = ctypes.c_uint(0)
    # CU_POINTER_ATTRIBUTE_MEMORY_TYPE = 2; CU_MEMORYTYPE_DEVICE = 2
    rc = cuda.cuPointerGetAttribute(ctypes.byref(kind), 2, ctypes.c_uint64(ptr))
    return rc == 0 and kind.value == 2


def _check_host_memory(kv_args, server_args, mode):
    device = str(_get(server_args, "device", "cpu")).lower()
    gpu = getattr(kv_args, "gpu_id", None)
    first = (list(getattr(kv_args, "kv_data_ptrs", []) or []) or [0])[0]
    on_device = device not in ("cpu", "") or \
        (isinstance(first, int) and first and _device_pointer(first))
    if on_device:
        raise RuntimeError(
            "kvferry: the %s server's KV cache is in %s memory (device=%r, gpu_id=%s), "
            "but this libkvferry moves host memory only: GPU memory registration "
            "(KVF_MEM_CUDA) is not supported yet.  Run SGLang with --device cpu, or "
            "use another --disaggregation-transfer-backend (mooncake, nixl) for GPU "
            "KV pools." % (mode, "GPU" if device != "cpu" else "device", device, gpu))


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


def _state_groups(kv_args):
    """SGLang's ``state_types`` with their nested ptrs/lens/item lens, one
    kvferry state group each, named by the type's value.  Every type is
    copied index for index, known or not: a ``None`` index list for a type
    (what SGLang's schedulers pass for types they do not build indices for)
    moves nothing for it."""
    types = list(getattr(kv_args, "state_types", None) or [])
    groups = []
    for i, t in enumerate(types):
        ptrs = list(kv_args.state_data_ptrs[i])
        lens = list(kv_args.state_data_lens[i])
        items = list(kv_args.state_item_lens[i])
        name = str(getattr(t, "value", t))
        if not ptrs:
            raise ValueError("kvferry: state type %r (state_types[%d]) has no buffers"
                             % (name, i))
        groups.append(StateGroup(type=name, data_ptrs=ptrs, data_lens=lens,
                                 item_lens=items))
    return groups


def ferry_args(kv_args, mode, server_args, is_mla_backend, par):
    """A ``kvferry.KVArgs`` from SGLang's ``KVArgs`` and ``ServerArgs``."""
    n = len(kv_args.kv_data_ptrs)
    mla = bool(is_mla_backend)
    tags = _kv_tags(kv_args, server_args, mode, mla, n)
    main = [t[0] for t in tags if t[2] == 0]
    # SGLang's --kv-cache-dtype; "auto" is the model's dtype (--dtype), so
    # that "auto" on one side and the same dtype named on the other agree.
    dtype = str(_get(server_args, "kv_cache_dtype", "auto"))
    if dtype == "auto":
        dtype = str(_get(server_args, "dtype", "auto"))
    a = _FerryArgs(
        kv_data_ptrs=list(kv_args.kv_data_ptrs), kv_data_lens=list(kv_args.kv_data_lens),
        kv_item_lens=list(kv_args.kv_item_lens), kv_tags=tags,
        aux_data_ptrs=list(getattr(kv_args, "aux_data_ptrs", []) or []),
        aux_data_lens=list(getattr(kv_args, "aux_data_lens", []) or []),
        aux_item_lens=list(getattr(kv_args, "aux_item_lens", []) or []),
        state_groups=_state_groups(kv_args) or None,
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
        kv_cache_dtype=str(_get(server_args, "kv_cache_dtype", "auto")),
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
    host = _advertise_host(server_args)
    if host is not None:
        a.host = host
    if mode == "prefill":
        a.bootstrap_addr = bootstrap_addr(server_args)
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


def _auth_headers():
    for var in ("KVF_AUTH_TOKEN", "SGLANG_DISAGGREGATION_BOOTSTRAP_AUTH_TOKEN"):
        tok = os.environ.get(var)
        if tok:
            return {"Authorization": "Bearer %s" % tok}
    path = os.environ.get("KVF_AUTH_TOKEN_FILE")
    if path:
        try:
            with open(path) as f:
                return {"Authorization": "Bearer %s" % f.read().strip()}
        except OSError:
            pass
    return {}


# The longest registry answer read: its parallel info is a few hundred bytes.
_HTTP_BODY_MAX = 64 * 1024


def _http(method, url, body=None, timeout=5.0):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method,
                                 headers=dict({"Content-Type": "application/json"},
                                              **(_auth_headers() if method != "GET"
                                                 else {})))
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
        self.dcp_size = int(_get(args, "dcp_size", 1))
        if self.dcp_size > 1:
            raise RuntimeError("kvferry: decode context parallelism (dcp_size=%d) is not "
                               "supported by the kvferry backend yet" % self.dcp_size)
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
        _check_host_memory(args, server_args, self.mode)
        for fn in _NEEDS:
            _lib.require(fn, "kvferry as SGLang's transfer backend")
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
                                    "dp_rank": self.ferry_args.system_dp_rank})
            except (OSError, ValueError) as e:
                logger.error("kvferry: room %d: POST %s failed: %s", room, url, e)

    def get_session_id(self):
        return self.engine.address if self.engine is not None else None

    def teardown(self):
        """Destroy the engine (and every room still open on it)."""
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
        self._error = None               # the KVTransferError raised, once made
        self._metric = None
        self._stage = "bootstrap"        # "transfer" once it waited for input

    def _fail_here(self, reason, level=logging.ERROR, code=_lib.KVF_ERR_ABORTED):
        """Fail the room from this rank with ``reason``: the library's room
        fails with it as its cause (status ``code``), so that every rank of
        the request, on both sides, names it; never raises.  Also after
        Success: SGLang's backends fail an aborted room whatever its state,
        and the scheduler then aborts the request."""
        if self._h is not None and self.conclude_state is None and \
                self._h.poll() == _Poll.Failed:
            self.conclude_state = _Poll.Failed      # the first root cause wins
        if self._local_reason is None and self.conclude_state != _Poll.Failed:
            self._local_reason = reason
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
        with True; only if none comes does it fail its room and raise
        SGLang's "unknown reason from another rank", saying what it waited
        for.  Also clears the room, as SGLang's backends do."""
        if self._error is None:
            self._error = self._make_error()
        self.conclude_state = _Poll.Failed
        self.clear()
        raise self._error

    def _make_error(self):
        self.kv_mgr.failure_records.pop(self.bootstrap_room, None)
        if self._local_reason is not None:
            return _error(self.bootstrap_room, self._local_reason, False)
        if self._h is not None:
            # This rank's room may not have failed yet: another rank of the
            # request did (the scheduler's all-reduce says so), and its cause
            # is on its way here; the all-reduce can win that race.
            err = self._library_error()
            if err is None and self._h.await_failure(RELAY_WAIT_S):
                err = self._library_error()
            if err is not None:
                _count_timeout(self.kv_mgr, err, self._stage)
                return err
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
        return _error(self.bootstrap_room, UNKNOWN_REASON, True)

    def _library_error(self):
        """The library room's record as SGLang's error, or None when the
        room has not failed."""
        try:
            self._h.failure_exception()
        except _FerryTransferError as e:
            return _error(self.bootstrap_room, e.failure_reason, e.is_from_another_rank, e)
        except KVFerryStateError:
            pass
        return None

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


class KVFerryKVSender(_Room, BaseKVSender):
    """The prefill side of one request (SGLang's ``BaseKVSender``)."""

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
        if self._dummy:
            return
        if self._room_why is not None:
            self._fail_here("kvferry cannot open a room on prefill rank %d: %s"
                            % (mgr.attn_tp_rank, self._room_why))
            return
        try:
            self._h = KVSender(mgr.engine, bootstrap_addr, self.bootstrap_room)
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
        s = self._poll_handle()
        if s == _Poll.WaitingForInput and not self._prefix_popped and \
                self.bootstrap_room not in self.kv_mgr.req_to_decode_prefix_len:
            n = self._h.decode_prefix_len() if _lib.has(
                "kvf_sender_decode_prefix_len") else 0
            if n is not None:
                self.kv_mgr.req_to_decode_prefix_len[self.bootstrap_room] = n
        return s

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
            self._h.init(self.num_kv_indices, aux_index)
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
        ``kv_args.state_types``, go with it).  Extra arguments of newer
        SGLang (``token_position_offset``, ``num_kv_tokens``) are accepted
        and unused.  Never raises for a failed room."""
        n = _length(kv_indices)
        if n is None:
            if self._h is not None and self.conclude_state is None:
                self._fail_here("KVSender.send refused on prefill rank %d: kv_indices is a "
                                "%s, not page indices" % (self.kv_mgr.attn_tp_rank,
                                                          type(kv_indices).__name__))
            return
        last = self.num_kv_indices is not None and self.curr_idx + n >= self.num_kv_indices
        self.curr_idx += n
        if self._dummy:
            if last:
                self.conclude_state = _Poll.Success
            return
        if self._h is None or self.conclude_state is not None:
            return
        if self.num_kv_indices is None:
            self._fail_here("KVSender.send before init on prefill rank %d"
                            % self.kv_mgr.attn_tp_rank)
            return
        try:
            states = None
            if last and state_indices is not None and self.kv_mgr.engine.state_group_items:
                states = _state_lists(state_indices)
            self._h.send([] if kv_indices is None else kv_indices, states, is_last=last)
        except (KVFerryError, ValueError, TypeError) as e:
            if self._h.poll() == _Poll.Failed:
                return                  # the failure surfaces through poll()
            self._fail_here("KVSender.send(%d pages%s) refused on prefill rank %d: %s"
                            % (n, ", last" if last else "", self.kv_mgr.attn_tp_rank,
                               _refused(e)), code=_lib.KVF_ERR_BAD_INDICES)

    def get_transfer_metric(self):
        """SGLang's ``KVTransferMetric`` of this room: bytes this rank sent,
        seconds until the decode pages were known, seconds of transfer."""
        return self._metric_of()


class KVFerryKVReceiver(_Room, BaseKVReceiver):
    """The decode side of one request (SGLang's ``BaseKVReceiver``)."""

    def __init__(self, mgr, bootstrap_addr, bootstrap_room=None, prefill_dp_rank=None):
        self._setup(mgr, bootstrap_room)
        self.bootstrap_addr = bootstrap_addr
        self.require_staging = False
        self.abort_notified = False
        self.prefill_dp_rank = None
        self._dest_given = False
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
        try:
            self._h = KVReceiver(self.kv_mgr.engine, self.bootstrap_addr,
                                 self.bootstrap_room, prefill_dp_rank)
        except (KVFerryError, ValueError, TypeError) as e:
            self._fail_here("kvferry cannot open room %s on decode rank %d: %s"
                            % (self.bootstrap_room, self.kv_mgr.attn_tp_rank,
                               _refused(e)))

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
        if not self._dest_given and s > _Poll.WaitingForInput:
            return _Poll.WaitingForInput
        return s

    def get_transfer_metric(self):
        return self._metric_of()

    def abort(self):
        super().abort()
        self.abort_notified = True


class KVFerryKVBootstrapServer(BaseKVBootstrapServer):
    """The prefill server's bootstrap registry (SGLang's
    ``BaseKVBootstrapServer``), kvferry's C registry on its own thread:
    SGLang's routes (``PUT/GET /route``, ``/health``, ``/register_dp_rank``,
    ``/query_dp_ranks``) plus ``/metrics``.  ``host``/``port`` as SGLang
    passes them (``--host``, ``--disaggregation-bootstrap-port``); who may
    register follows the cluster token (docs/SECURITY.md)."""

    def __init__(self, host="127.0.0.1", port=8998, dp_size=1, auth_token=None, **_):
        if auth_token and not os.environ.get("SGLANG_DISAGGREGATION_BOOTSTRAP_AUTH_TOKEN"):
            os.environ["SGLANG_DISAGGREGATION_BOOTSTRAP_AUTH_TOKEN"] = auth_token
        self.host = host
        self._server = BootstrapServer(host, int(port))
        self.port = self._server.port

    def run(self):
        """SGLang's name for starting: the registry runs from construction."""

    def close(self):
        self._server.close()
