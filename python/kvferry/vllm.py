"""kvferry as a vLLM v1 KV connector (``KVFerryConnector``), NIXL-style.

Load it with::

    --kv-transfer-config '{"kv_connector": "KVFerryConnector",
                           "kv_connector_module_path": "kvferry.vllm",
                           "kv_role": "kv_both"}'

The one idea: the prefill instance (P) *holds* a finished request's KV
blocks in a kvferry held room, and the decode instance (D) *reads* it,
named by P's request id.  ``request_finished`` on P returns
``kv_transfer_params`` that carry P's block ids, P's request id and the
descriptor of every P TP rank's kvferry engine; the proxy hands them to D.
Each P worker holds room ``room_key(P's request id)`` with its blocks as
pages; each D worker creates a receiver for that room from the
descriptors, with its unhashed local blocks as destination.  kvferry picks
the P ranks each D rank reads (TP P != D included), checks every byte, and
ends every room on every rank in SUCCESS or FAILED with the root cause:

* P reports the request in ``finished_sending`` once its held room is
  final: every reader has its bytes, or the lease ended (vLLM's
  ``VLLM_NIXL_ABORT_REQUEST_TIMEOUT``, 480 s by default) -- either way the
  blocks may be freed;
* D reports the request in ``finished_recving`` once its room is final;
  a failed room reports all its local blocks in
  ``get_block_ids_with_load_errors()`` (kvferry never lands part of a room),
  and the reason is logged.

Push mode (``kv_connector_extra_config`` ``transfer_mode: "push"``): the
proxy names the room by a ``transfer_id`` it gives P and D; P opens a held
room on a request's first chunk and sends each chunk's blocks of each layer
from ``save_kv_layer`` (``send_layers``), ending the room in
``wait_for_save`` of its last chunk, while D waits with its blocks.

``kv_transfer_params`` come from the client's request, and the scheduler
side runs in vLLM's engine core: they are judged once per request, in one
place (``parse_params``), and a request whose params kvferry cannot use
is prefilled locally, with one logged reason.

The call sequence, invariants and NIXL behaviour this follows are in
docs/VLLM.md.  The module imports without vLLM (it then defines small
stand-ins for vLLM's base classes, with the same names and signatures) and
does no work at import: vLLM imports it in its API server, engine core and
every worker process; engines are created in ``register_kv_caches``.
"""
import enum
import functools
import logging
import os
import queue
import sys
import threading
import uuid
from dataclasses import dataclass

from ._convert import U32_MAX, num_text, text_problem
from ._descriptor import check_prefill_server, parse_descriptor
from ._logquota import LogQuota

try:  # pragma: no cover - vLLM is not installed where the tests run
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole)
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.base import (
            KVConnectorHandshakeMetadata)
    except ImportError:
        class KVConnectorHandshakeMetadata:  # noqa: D401 - older vLLM
            """vLLM before handshake metadata: a plain base."""
    from vllm.logger import init_logger
    logger = init_logger(__name__)
    HAVE_VLLM = True
except ImportError:
    HAVE_VLLM = False
    logger = logging.getLogger(__name__)

    class KVConnectorRole(enum.Enum):
        """vLLM's ``KVConnectorRole``."""
        SCHEDULER = 0
        WORKER = 1

    class KVConnectorMetadata:
        """vLLM's ``KVConnectorMetadata``: scheduler -> workers, per step."""

    class KVConnectorHandshakeMetadata:
        """vLLM's ``KVConnectorHandshakeMetadata``: worker -> scheduler, once."""

    class KVConnectorBase_V1:
        """The part of vLLM's ``KVConnectorBase_V1`` this connector relies on
        (base.py @ 003df296): the constructor, the metadata binding and the
        defaults of the optional hooks."""

        def __init__(self, vllm_config, role, kv_cache_config=None):
            self._connector_metadata = None
            self._vllm_config = vllm_config
            if getattr(vllm_config, "kv_transfer_config", None) is None:
                raise ValueError("kv_transfer_config must be set for KVConnectorBase_V1")
            self._kv_transfer_config = vllm_config.kv_transfer_config
            self._kv_cache_config = kv_cache_config
            self._role = role

        @property
        def role(self):
            return self._role

        def bind_connector_metadata(self, connector_metadata):
            self._connector_metadata = connector_metadata

        def clear_connector_metadata(self):
            self._connector_metadata = None

        def _get_connector_metadata(self):
            assert self._connector_metadata is not None
            return self._connector_metadata

        def has_connector_metadata(self):
            return self._connector_metadata is not None

        def get_finished(self, finished_req_ids):
            return None, None

        def get_block_ids_with_load_errors(self):
            return set()

        def request_finished(self, request, block_ids):
            return False, None

        def get_handshake_metadata(self):
            return None

        def set_xfer_handshake_metadata(self, metadata):
            return None

        def get_finished_count(self):
            return None

        def update_connector_output(self, connector_output):
            return None

        def take_events(self):
            return ()

        def shutdown(self):
            return None

        @classmethod
        def get_required_kvcache_layout(cls, vllm_config):
            return None

        @classmethod
        def requires_piecewise_for_cudagraph(cls, extra_config):
            return False

__all__ = ["KVFerryConnector", "KVFerryConnectorMetadata", "KVFerryHandshakeMetadata",
           "HoldMeta", "RecvMeta", "RemotePrefill", "ParamsRefused", "parse_params",
           "check_params", "kv_cache_layout"]

# vLLM's default for how long P keeps unread blocks (VLLM_NIXL_ABORT_REQUEST_TIMEOUT).
DEFAULT_LEASE_S = 480
# P requests that ended with one of these hand their KV to a decoder (a
# prefill request has max_tokens=1: LENGTH_CAPPED; EOS as first token: STOPPED).
_HANDED_OFF = ("FINISHED_LENGTH_CAPPED", "FINISHED_STOPPED")
# kv_connector_extra_config["kvferry"]: KVArgs engine fields a deployment may set.
_ENGINE_KEYS = ("host", "port", "transport", "checksum", "streams", "bootstrap_timeout_ms",
                "waiting_timeout_ms", "transfer_timeout_ms", "heartbeat_interval_ms",
                "heartbeat_timeout_ms", "faults", "metrics_addr", "trace", "busy_poll_us")


# ---------------------------------------------------------------------------
# Stats: what vLLM's /metrics and its "KV Transfer metrics" log line show
# ---------------------------------------------------------------------------

try:  # pragma: no cover - vLLM is not installed where the tests run
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics, KVConnectorStats)
except ImportError:
    @dataclass
    class KVConnectorStats:
        """vLLM's ``KVConnectorStats``: a serializable ``data`` dict."""
        data: dict = None

        def __post_init__(self):
            if self.data is None:
                self.data = {}

    class KVConnectorPromMetrics:
        """vLLM's ``KVConnectorPromMetrics``: the metric classes by kind
        (``metric_types``: vLLM's Gauge, Counter, Histogram -> the classes
        to create), the label names, and each engine's label values."""

        def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
            kinds = {getattr(k, "__name__", str(k)): v for k, v in metric_types.items()}
            self._gauge_cls = kinds.get("Gauge")
            self._counter_cls = kinds.get("Counter")
            self._histogram_cls = kinds.get("Histogram")
            self._labelnames = labelnames
            self.per_engine_labelvalues = per_engine_labelvalues


# Keys of KVFerryConnectorStats.data: per room that succeeded on a worker,
# its transfer seconds and bytes; per room that failed, its status name and
# where its root cause was seen ("local": this rank; "another_rank").
_STATS_KEYS = ("transfer_duration", "bytes_transferred", "failed_status", "failed_origin")


@dataclass
class KVFerryConnectorStats(KVConnectorStats):
    """kvferry's transfers as vLLM collects connector stats (NIXL's
    ``NixlKVConnectorStats`` is the model): each worker records the rooms it
    saw end since it was last asked (``get_kv_connector_stats``), vLLM
    aggregates the workers' and the steps' (``aggregate``: the lists are
    pooled, every TP rank's rooms counted), logs ``reduce()`` and feeds
    ``KVFerryPromMetrics``.  A room is one request on one worker: a P worker
    records its held room when every reader has its bytes, a D worker its
    read.  Failures carry their status and origin, so a dashboard tells one
    sick rank (failures learned from another rank) from local trouble."""

    def __post_init__(self):
        if not self.data:
            self.reset()

    def reset(self):
        self.data = {k: [] for k in _STATS_KEYS}

    def record_transfer(self, seconds, nbytes):
        self.data["transfer_duration"].append(float(seconds))
        self.data["bytes_transferred"].append(int(nbytes))

    def record_failure(self, status, from_another_rank):
        self.data["failed_status"].append(str(status))
        self.data["failed_origin"].append("another_rank" if from_another_rank else "local")

    def clone_and_reset(self):
        old = KVFerryConnectorStats(data={k: list(v) for k, v in self.data.items()})
        self.reset()
        return old

    def is_empty(self):
        return not self.data["transfer_duration"] and not self.data["failed_status"]

    def aggregate(self, other):
        if other is not None and not other.is_empty():
            for k in _STATS_KEYS:
                self.data.setdefault(k, []).extend(other.data.get(k, []))
        return self

    def reduce(self):
        d = sorted(self.data["transfer_duration"])
        n = len(d)
        total = sum(self.data["bytes_transferred"])
        secs = sum(d)
        learned = self.data["failed_origin"].count("another_rank")
        return {
            "Num successful transfers": n,
            "Avg xfer time (ms)": round(secs / n * 1e3, 3) if n else 0,
            "P90 xfer time (ms)": round(d[min(n - 1, (9 * n) // 10)] * 1e3, 3) if n else 0,
            "Avg MB per transfer": round(total / n / 2**20, 3) if n else 0,
            "Throughput (MB/s)": round(total / 2**20 / secs, 3) if secs > 0 else 0,
            "Num failed transfers": len(self.data["failed_status"]),
            "Num failed, cause on another rank": learned,
        }


class KVFerryPromMetrics(KVConnectorPromMetrics):
    """kvferry's transfers in vLLM's /metrics: histograms of each room's
    transfer seconds and bytes, and failed rooms by status and origin."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        seconds = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                   10.0, 30.0]
        self.xfer_time = self._per_engine(self._histogram_cls(
            name="vllm:kvferry_xfer_time_seconds",
            documentation="Seconds from the moment a kvferry room's pages were known until "
                          "it succeeded, per room and worker.",
            buckets=seconds, labelnames=labelnames))
        self.xfer_bytes = self._per_engine(self._histogram_cls(
            name="vllm:kvferry_bytes_transferred",
            documentation="Bytes a kvferry room moved (P: sent, D: placed), per room and "
                          "worker.",
            buckets=[2 ** (10 + i) for i in range(1, 25, 2)], labelnames=labelnames))
        self.failed = self._counter_cls(
            name="vllm:kvferry_num_failed_transfers",
            documentation="kvferry rooms that failed, per worker, by status and by where "
                          "the root cause was seen: local, or another_rank.",
            labelnames=list(labelnames) + ["status", "origin"])

    def _per_engine(self, metric):
        return {idx: metric.labels(*values)
                for idx, values in self.per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data, engine_idx=0):
        d = transfer_stats_data
        for v in d.get("transfer_duration", []):
            self.xfer_time[engine_idx].observe(v)
        for v in d.get("bytes_transferred", []):
            self.xfer_bytes[engine_idx].observe(v)
        values = list(self.per_engine_labelvalues[engine_idx])
        for status, origin in zip(d.get("failed_status", []), d.get("failed_origin", [])):
            self.failed.labels(*(values + [status, origin])).inc(1)


# ---------------------------------------------------------------------------
# Metadata
# ---------------------------------------------------------------------------

@dataclass
class HoldMeta:
    """P: hold these blocks for the decoder (room from P's request id)."""
    block_ids: list
    room: int
    instance: int


@dataclass
class RecvMeta:
    """D: read P's held room into these local blocks."""
    local_block_ids: list           # unhashed local blocks, in order (may be empty)
    remote_block_ids: list          # P's blocks, the whole prompt
    remote_request_id: str
    remote_engine_id: str
    descriptors: list               # one per P TP rank
    room: int
    instance: int
    report: bool = True             # False: only tells P it may free (no async load)
    refused: str = ""               # why nothing can be read: its blocks are reported invalid
    prompt_blocks: int = None       # push: the prompt's blocks (P's are not named)


@dataclass
class PushMeta:
    """P, push mode: this step's chunk of a request whose prefill sends
    each layer as it is computed (room from the proxy's transfer_id)."""
    room: int
    instance: int
    num_pages: int                  # the prompt's blocks: the room's pages
    block_ids: list                 # this step's chunk: pages [first_page, +len)
    first_page: int
    last: bool = False              # the prompt's last chunk: end the room after it
    abort: str = ""                 # why the request ended before its prefill did


class KVFerryConnectorMetadata(KVConnectorMetadata):
    """What the scheduler-side connector tells every worker, each step."""

    def __init__(self):
        self.reqs_to_hold = {}      # req_id -> HoldMeta
        self.reqs_to_recv = {}      # req_id -> RecvMeta
        self.reqs_to_push = {}      # req_id -> PushMeta (push mode)

    def __repr__(self):
        return "<KVFerryConnectorMetadata hold=%s recv=%s push=%s>" % (
            sorted(self.reqs_to_hold), sorted(self.reqs_to_recv),
            sorted(getattr(self, "reqs_to_push", {})))


@dataclass
class KVFerryHandshakeMetadata(KVConnectorHandshakeMetadata):
    """A worker's kvferry prefill engine, for the scheduler's params."""
    tp_rank: int
    descriptor: str
    engine_id: str = ""


@dataclass
class _Push:
    """The scheduler's view of a P request that pushes its layers."""
    transfer_id: str
    room: int
    instance: int
    num_tokens: int                 # the prompt's
    num_pages: int                  # the prompt's blocks
    blocks: list = None             # the request's blocks so far, in order
    sent: int = 0                   # pages given to the room so far
    started: bool = False           # the workers have its room
    done: bool = False              # its last chunk went

    def __post_init__(self):
        if self.blocks is None:
            self.blocks = []

    def meta(self, block_ids=(), first_page=0, last=False, abort=""):
        return PushMeta(room=self.room, instance=self.instance, num_pages=self.num_pages,
                        block_ids=list(block_ids), first_page=first_page, last=last,
                        abort=abort)


def _room_key(request_id):
    from . import room_key
    return room_key(request_id)


# ---------------------------------------------------------------------------
# Configuration
# ---------------------------------------------------------------------------

def _lib_status_name(code):
    """``KVF_ERR_TIMED_OUT`` and so on, for a failure's code."""
    from kvferry import _lib
    return _lib.status_name(code) if code is not None else "unknown"


def _status_name(status):
    return getattr(status, "name", str(status))


class _Config:
    """What both halves read from vLLM's config, once."""

    def __init__(self, vllm_config, tp_rank=None):
        ktc = vllm_config.kv_transfer_config
        role = getattr(ktc, "kv_role", None) or "kv_both"
        if role not in ("kv_producer", "kv_consumer", "kv_both"):
            raise ValueError("KVFerryConnector: kv_role must be kv_producer, kv_consumer or "
                             "kv_both, got %r" % (role,))
        self.kv_role = role
        self.producer = role in ("kv_producer", "kv_both")
        self.consumer = role in ("kv_consumer", "kv_both")
        self.engine_id = getattr(ktc, "engine_id", None) or str(uuid.uuid4())
        why = text_problem(self.engine_id, ID_MAX_BYTES)
        if why is not None:
            raise ValueError("KVFerryConnector: kv_transfer_config.engine_id %s; decoders "
                             "refuse such a remote_engine_id" % why)
        extra = dict(getattr(ktc, "kv_connector_extra_config", None) or {})
        self.extra = extra
        lease = extra.get("lease_s")
        if lease is None:
            lease = os.environ.get("VLLM_NIXL_ABORT_REQUEST_TIMEOUT", DEFAULT_LEASE_S)
        try:
            lease = float(lease)
        except (TypeError, ValueError):
            lease = -1
        if not lease > 0:
            raise ValueError("KVFerryConnector: lease_s (kv_connector_extra_config) or "
                             "VLLM_NIXL_ABORT_REQUEST_TIMEOUT must be a positive number of "
                             "seconds, got %r" % (extra.get("lease_s"),))
        self.lease_s = lease
        # "pull" (NIXL's order: D reads P's finished request) or "push" (P
        # sends each layer as its forward pass computes it: save_kv_layer).
        self.mode = extra.get("transfer_mode") or "pull"
        if self.mode not in ("pull", "push"):
            raise ValueError("KVFerryConnector: kv_connector_extra_config.transfer_mode must "
                             "be \"pull\" (the default) or \"push\", got %r" % (self.mode,))
        par = getattr(vllm_config, "parallel_config", None)
        self.tp_size = int(extra.get("tp_size") or getattr(par, "tensor_parallel_size", 1) or 1)
        if tp_rank is None:
            tp_rank = extra.get("tp_rank")
        self.tp_rank = None if tp_rank is None else int(tp_rank)
        cache = getattr(vllm_config, "cache_config", None)
        self.block_size = getattr(cache, "block_size", None)
        # The model's KV heads: with TP above them vLLM replicates a head
        # per rank, and heads x TP would overstate them.
        model = getattr(vllm_config, "model_config", None)
        heads = getattr(model, "get_total_num_kv_heads", None)
        self.total_kv_heads = int(heads()) if callable(heads) else None
        engine = dict(extra.get("kvferry") or {})
        unknown = sorted(set(engine) - set(_ENGINE_KEYS))
        if unknown:
            raise ValueError("KVFerryConnector: kv_connector_extra_config.kvferry has unknown "
                             "keys %s; known: %s" % (unknown, ", ".join(_ENGINE_KEYS)))
        self.engine = engine

    def worker_tp_rank(self):
        if self.tp_rank is not None:
            return self.tp_rank
        if HAVE_VLLM:  # pragma: no cover
            from vllm.distributed.parallel_state import (
                get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size)
            self.tp_size = get_tensor_model_parallel_world_size()
            return get_tensor_model_parallel_rank()
        return 0


# ---------------------------------------------------------------------------
# kv_transfer_params: what a client hands D, checked in one place
# ---------------------------------------------------------------------------

# The longest request or engine id taken, in UTF-8 bytes: room for any id
# vLLM makes (the client's id and vLLM's suffix), short enough for a log line.
ID_MAX_BYTES = 1024
# The most block ids taken: one prompt's blocks on P.  A million blocks is
# 16M tokens at 16 tokens a block, past any model's context.
MAX_BLOCK_IDS = 1 << 20
# The most descriptors taken: one per rank of P, at most the library's TP.
MAX_DESCRIPTORS = 4096
_PREFILLED_HERE = "it is prefilled here, without KV transfer"


class ParamsRefused(ValueError):
    """``kv_transfer_params`` kvferry cannot use; the message names the
    field and what is wrong with it."""


@dataclass(frozen=True)
class RemotePrefill:
    """What D reads, from ``kv_transfer_params`` that ``parse_params`` took."""
    block_ids: tuple                # P's blocks of the prompt, in order
    request_id: str                 # P's request id: the room
    engine_id: str                  # P's engine id, for log lines
    descriptors: tuple              # P's kvferry engine descriptors
    room: int
    instance: int


def _kind(v):
    return "null" if v is None else type(v).__name__


def _shown(text, limit=200):
    """A client's text for a log line: as it is when it is plain and short,
    else escaped (``ascii``) and cut."""
    if isinstance(text, str) and len(text) <= limit and text_problem(text, limit) is None:
        return text
    cut = text[:limit] if isinstance(text, str) else text
    return ascii(cut) + ("..." if isinstance(text, str) and len(text) > limit else "")


def _attr(obj, name):
    """``obj.name``, or None when reading it fails."""
    try:
        return getattr(obj, name, None)
    except Exception:
        return None


def _flag(params, key):
    """A flag of ``params``: absent and null are false; else true or false."""
    v = params.get(key)
    if v is None or v is False:
        return False
    if v is True:
        return True
    raise ParamsRefused("%s must be true or false, got a %s" % (key, _kind(v)))


def _name(params, key, what):
    v = params.get(key)
    why = text_problem(v, ID_MAX_BYTES) if v is not None else "is missing (or null)"
    if why is not None:
        raise ParamsRefused("%s (%s) %s" % (key, what, why))
    return v


def _block_ids(params, need):
    v = params.get("remote_block_ids")
    if type(v) not in (list, tuple) or not v:
        raise ParamsRefused("remote_block_ids must be the non-empty list of P's block ids, "
                            "got %s" % ("an empty list" if type(v) in (list, tuple)
                                        else "a %s" % _kind(v)))
    if len(v) > MAX_BLOCK_IDS:
        raise ParamsRefused("remote_block_ids has %d entries, more than %d"
                            % (len(v), MAX_BLOCK_IDS))
    for i, b in enumerate(v):
        if type(b) is not int:
            raise ParamsRefused("remote_block_ids[%d] is a %s, not a block id (an integer)"
                                % (i, _kind(b)))
        if not 0 <= b <= U32_MAX:
            raise ParamsRefused("remote_block_ids[%d] = %s is not a block id (0..%d)"
                                % (i, num_text(b), U32_MAX))
    if need is None:
        return tuple(v)
    if len(v) < need:
        raise ParamsRefused("remote_block_ids has %d blocks but the prompt needs %d"
                            % (len(v), need))
    # P may hold blocks past the prompt's: D reads the prompt's.
    return tuple(v[:need])


def _descriptors(params):
    v = params.get("kvferry_descriptors")
    if type(v) not in (list, tuple) or not 0 < len(v) <= MAX_DESCRIPTORS:
        raise ParamsRefused(
            "kvferry_descriptors must be the list of P's kvferry engine descriptors, one per "
            "rank, at most %d (did P run KVFerryConnector?); got %s" % (
                MAX_DESCRIPTORS, "%d of them" % len(v) if type(v) in (list, tuple)
                else "a %s" % _kind(v)))
    parsed = []
    for i, d in enumerate(v):
        try:
            parsed.append(parse_descriptor(d))
        except (TypeError, ValueError) as e:
            raise ParamsRefused("kvferry_descriptors[%d]: %s" % (i, e)) from None
    try:
        check_prefill_server(parsed)
    except ValueError as e:
        raise ParamsRefused("kvferry_descriptors: %s" % e) from None
    tp = params.get("tp_size")
    if type(tp) is not int or tp != len(v):
        raise ParamsRefused("tp_size must be the number of descriptors, %d; got %s"
                            % (len(v), num_text(tp) if type(tp) is int else "a %s" % _kind(tp)))
    return tuple(v)


def parse_params(params, num_prompt_tokens=None, block_size=None, mode="pull"):
    """What D reads from ``kv_transfer_params`` (a ``RemotePrefill``), or
    ``ParamsRefused`` saying which field is wrong and how.  The one place
    that reads P's fields (docs/VLLM.md lists the rules): each must be
    there with its type, ids are text the library takes (UTF-8, no control
    characters, at most ``ID_MAX_BYTES``), block ids fit 32 bits and cover
    the prompt (given its tokens and ``block_size``; only the prompt's are
    kept), and the descriptors are one prefill server's, every rank once,
    each as the library reads it.  Nothing else of ``params`` is read.
    ``mode`` "push": the room is named by ``transfer_id`` (the proxy's,
    given to P and D alike) and P's blocks are not read (none are named:
    D's blocks reach P inside kvferry's room)."""
    if not isinstance(params, dict):
        raise ParamsRefused("kv_transfer_params must be a JSON object (a dict), got a %s"
                            % _kind(params))
    if mode == "push":
        blocks = ()
        rid = _name(params, "transfer_id", "the proxy's id of the transfer, the same on P "
                    "and D")
    else:
        need = None
        if num_prompt_tokens is not None and block_size:
            need = -(-num_prompt_tokens // block_size)
        blocks = _block_ids(params, need)
        rid = _name(params, "remote_request_id", "P's request id")
    eid = _name(params, "remote_engine_id", "P's engine id")
    descs = _descriptors(params)
    room, instance = _room_key(rid)
    return RemotePrefill(block_ids=blocks, request_id=rid, engine_id=eid, descriptors=descs,
                         room=room, instance=instance)


def check_params(params, num_prompt_tokens=None, block_size=None, mode="pull"):
    """Why D cannot read from these ``kv_transfer_params`` (a str), or None
    when they are usable (``parse_params``)."""
    try:
        parse_params(params, num_prompt_tokens, block_size, mode)
    except ParamsRefused as e:
        return str(e)
    return None


# ---------------------------------------------------------------------------
# Scheduler side
# ---------------------------------------------------------------------------

class _Scheduler:
    """Runs in vLLM's engine core: decides what the workers hold and read.
    A client's ``kv_transfer_params`` are judged once per request
    (``_remote``); nothing read from them can raise into the engine core."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.descriptors = None         # P TP rank -> descriptor, once workers told
        self.holds = {}                 # req_id -> HoldMeta, for the next step
        self.recvs = {}                 # req_id -> RecvMeta, for the next step
        self.pushing = {}               # req_id -> _Push: P requests sending layer by layer
        self.push_aborts = {}           # req_id -> PushMeta (abort), for the next step
        self.judged = {}                # req_id -> (params, RemotePrefill or None)
        self.refused = set()            # req_ids whose refusal was logged
        self.quota = LogQuota(logger)   # clients can repeat refusals at will
        self.errors = LogQuota(logger)

    def _refuse(self, request, why):
        """Log why a request's params were refused: once per request, within
        the quota."""
        rid = request.request_id
        if rid not in self.refused:
            self.refused.add(rid)
            self.quota.log(logging.WARNING, "KVFerryConnector: request %s: %s", _shown(rid),
                           why)

    def _num_prompt(self, request):
        return len(getattr(request, "prompt_token_ids", None) or [])

    def _remote(self, request):
        """``(asked, remote)``: whether the request's params ask D to read
        P's KV (``do_remote_prefill``), and what to read, None when they are
        refused (logged once).  The verdict holds until ``_done``."""
        params = getattr(request, "kv_transfer_params", None)
        if params is None:
            return False, None
        rid = request.request_id
        seen = self.judged.get(rid)
        if seen is not None and seen[0] is params:
            return True, seen[1]
        try:
            if not isinstance(params, dict):
                raise ParamsRefused("kv_transfer_params must be a JSON object (a dict), got "
                                    "a %s" % _kind(params))
            if not _flag(params, "do_remote_prefill"):
                return False, None
            # The proxy's transfer_id names a pushed room (push mode's params).
            mode = "push" if "transfer_id" in params else "pull"
            remote = parse_params(params, self._num_prompt(request), self.cfg.block_size, mode)
        except ParamsRefused as e:
            self._refuse(request, "kv_transfer_params refused: %s; %s" % (e, _PREFILLED_HERE))
            remote = None
        self.judged[rid] = (params, remote)
        return True, remote

    def _done(self, request):
        """One transfer per request (NIXL does the same): the flag goes
        down, so a second call and request_finished read nothing."""
        params = request.kv_transfer_params
        if isinstance(params, dict) and "do_remote_prefill" in params:
            params["do_remote_prefill"] = False
        self.judged.pop(request.request_id, None)

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        if not self.cfg.consumer:
            return 0, False
        _, remote = self._remote(request)
        if remote is None:
            return 0, False
        count = self._num_prompt(request) - num_computed_tokens
        if count > 0:
            return count, True
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        if self.cfg.producer and self.cfg.mode == "push":
            self._push_begin(request)
        if not self.cfg.consumer:
            return
        asked, remote = self._remote(request)
        if not asked:
            return
        self._done(request)
        if remote is None:
            return                      # refused, and logged
        local = list(blocks.get_unhashed_block_ids()) if num_external_tokens > 0 else []
        self.recvs[request.request_id] = self._recv_meta(
            remote, local, report=bool(local), prompt_blocks=self._prompt_blocks(request))

    def _prompt_blocks(self, request):
        """The prompt's blocks (a pushed room's params do not name P's)."""
        if not self.cfg.block_size:
            return None
        return -(-self._num_prompt(request) // self.cfg.block_size)

    @staticmethod
    def _recv_meta(remote, local, report, prompt_blocks=None):
        return RecvMeta(local_block_ids=local, remote_block_ids=list(remote.block_ids),
                        remote_request_id=remote.request_id,
                        remote_engine_id=remote.engine_id,
                        descriptors=list(remote.descriptors), room=remote.room,
                        instance=remote.instance, report=report, prompt_blocks=prompt_blocks)

    def build_connector_meta(self, scheduler_output):
        meta = KVFerryConnectorMetadata()
        meta.reqs_to_hold, self.holds = self.holds, {}
        meta.reqs_to_recv, self.recvs = self.recvs, {}
        meta.reqs_to_push, self.push_aborts = self.push_aborts, {}
        if self.pushing:
            self._push_chunks(meta, scheduler_output)
        return meta

    # -- push mode, P: each step's new blocks are a chunk of the room -------

    def _push_begin(self, request):
        """A P request that asks for push (``do_remote_decode`` and the
        proxy's ``transfer_id``): its layers go to the room
        ``room_key(transfer_id)`` as the forward computes them.  A second
        call for a request already started means vLLM preempted it (its
        blocks were freed, it is scheduled again): its room is aborted."""
        rid = request.request_id
        params = getattr(request, "kv_transfer_params", None)
        old = self.pushing.pop(rid, None)
        if old is not None:
            if old.started:
                self.push_aborts[rid] = old.meta(abort="vLLM preempted the request during "
                                                 "its prefill and freed its KV blocks")
            return
        try:
            if not isinstance(params, dict) or "transfer_id" not in params \
                    or not _flag(params, "do_remote_decode"):
                return                  # pulled (NIXL's order), as without push
            tid = _name(params, "transfer_id", "the proxy's id of the transfer, the same on "
                        "P and D")
        except ParamsRefused as e:
            self._refuse(request, "kv_transfer_params refused: %s; its KV is not pushed to a "
                         "decoder" % e)
            return
        room, instance = _room_key(tid)
        ntok = self._num_prompt(request)
        self.pushing[rid] = _Push(transfer_id=tid, room=room, instance=instance,
                                  num_tokens=ntok, num_pages=-(-ntok // self.cfg.block_size))

    def _push_chunks(self, meta, out):
        """This step's chunk of each pushing request, from vLLM's
        SchedulerOutput (as vllm-ascend's layerwise connector reads it):
        the blocks given to the request so far, and its tokens computed
        by the end of this step.  Full blocks go as soon as they are
        computed; the prompt's last, partial one with the last chunk."""
        computed, added = {}, {}
        for r in getattr(out, "scheduled_new_reqs", None) or ():
            computed[r.req_id], added[r.req_id] = r.num_computed_tokens, r.block_ids
        cached = getattr(out, "scheduled_cached_reqs", None)
        if cached is not None:
            for i, rid in enumerate(cached.req_ids):
                computed[rid], added[rid] = cached.num_computed_tokens[i], cached.new_block_ids[i]
        tokens = getattr(out, "num_scheduled_tokens", None) or {}
        for rid, p in self.pushing.items():
            if rid not in tokens or rid not in computed or p.done:
                continue
            if added.get(rid):
                p.blocks.extend(added[rid][0])
            upto = computed[rid] + tokens[rid]
            last = upto >= p.num_tokens
            pages = p.num_pages if last else min(upto // self.cfg.block_size, p.num_pages)
            meta.reqs_to_push[rid] = p.meta(block_ids=p.blocks[p.sent:pages],
                                            first_page=p.sent, last=last)
            p.sent, p.started, p.done = pages, True, last

    def _push_finished(self, request, p):
        """``request_finished`` of a pushing P request: a whole prefill hands
        its room to the decoder (vLLM keeps the blocks until the room is
        final); an aborted one aborts its room, and vLLM keeps the blocks
        until no byte of them can still move."""
        rid = request.request_id
        status = _status_name(getattr(request, "status", None))
        if status in _HANDED_OFF and p.done:
            params = {"do_remote_prefill": True, "do_remote_decode": False,
                      "transfer_id": p.transfer_id, "remote_engine_id": self.cfg.engine_id,
                      "transfer_mode": "push"}
            if self.descriptors is not None:
                params.update(tp_size=len(self.descriptors),
                              kvferry_descriptors=list(self.descriptors))
            return True, params
        if not p.started:
            return False, None
        self.push_aborts[rid] = p.meta(abort="the prefill request ended (%s) before its last "
                                       "chunk was computed" % status)
        return True, None

    def request_finished(self, request, block_ids):
        rid = request.request_id
        try:
            return self._finished(request, block_ids)
        finally:
            self.judged.pop(rid, None)
            self.refused.discard(rid)

    def _finished(self, request, block_ids):
        params = getattr(request, "kv_transfer_params", None)
        rid = request.request_id
        if params is None:
            return False, None
        if self.cfg.consumer:
            asked, remote = self._remote(request)
            if asked:
                # D request that ended before its blocks were allocated: read
                # nothing, but ask P's room with no pages, so that P frees now
                # instead of at the end of its lease.
                self._done(request)
                if remote is not None:
                    self.recvs[rid] = self._recv_meta(remote, [], report=False)
                return False, None
        if not self.cfg.producer:
            return False, None
        push = self.pushing.pop(rid, None)
        if push is not None:
            return self._push_finished(request, push)
        try:
            if not isinstance(params, dict):
                raise ParamsRefused("kv_transfer_params must be a JSON object (a dict), got "
                                    "a %s" % _kind(params))
            if not _flag(params, "do_remote_decode"):
                return False, None
        except ParamsRefused as e:
            self._refuse(request, "kv_transfer_params refused: %s; its KV is not handed to a "
                         "decoder" % e)
            return False, None
        if _status_name(getattr(request, "status", None)) not in _HANDED_OFF:
            return False, None          # aborted (or failed): vLLM frees now
        if not block_ids:
            return False, None
        if self.descriptors is None:
            logger.error("KVFerryConnector: request %s: the workers' kvferry descriptors "
                         "never reached the scheduler (set_xfer_handshake_metadata); its KV "
                         "is not handed to a decoder", _shown(rid))
            return False, None
        why = text_problem(rid, ID_MAX_BYTES)
        if why is not None:
            # The id names P's room, and D names it back (remote_request_id).
            self._refuse(request, "its KV is not handed to a decoder: its request id %s" % why)
            return False, None
        room, instance = _room_key(rid)
        self.holds[rid] = HoldMeta(block_ids=list(block_ids), room=room, instance=instance)
        return True, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": list(block_ids),
            "remote_engine_id": self.cfg.engine_id,
            "remote_request_id": rid,
            "tp_size": len(self.descriptors),
            "kvferry_descriptors": list(self.descriptors),
        }

    def set_xfer_handshake_metadata(self, metadata):
        descs = {}
        for rank, md in (metadata or {}).items():
            if isinstance(md, KVFerryHandshakeMetadata) and md.descriptor:
                descs[int(getattr(md, "tp_rank", rank))] = md.descriptor
        want = list(range(self.cfg.tp_size))
        if sorted(descs) != want:
            logger.error("KVFerryConnector: kvferry descriptors came from TP ranks %s, "
                         "expected %s: this instance cannot hand KV to decoders",
                         sorted(descs), want)
            return
        # What a decoder's parse_params will check: refused here, no
        # decoder could read this instance's KV.
        try:
            check_prefill_server([parse_descriptor(descs[r]) for r in want])
        except (TypeError, ValueError) as e:
            logger.error("KVFerryConnector: the workers' kvferry descriptors %s are not one "
                         "prefill server's as a decoder reads them (%s): this instance "
                         "cannot hand KV to decoders", [descs[r] for r in want], e)
            return
        self.descriptors = [descs[r] for r in want]

    def internal_error(self, request, where, final=False):
        """A bug met while handling ``request`` in ``where``: logged with its
        traceback (within the quota), and the request reads and hands off
        nothing; ``final``: vLLM is done with it (request_finished)."""
        rid, params = _attr(request, "request_id"), _attr(request, "kv_transfer_params")
        self.errors.log(logging.ERROR, "KVFerryConnector: request %s: %s failed; the request "
                        "goes on without KV transfer", _shown(rid), where, exc_info=True)
        if not isinstance(rid, str):
            return                      # no state is kept under it
        self.holds.pop(rid, None)
        self.recvs.pop(rid, None)
        self.pushing.pop(rid, None)
        if final:
            self.judged.pop(rid, None)
            self.refused.discard(rid)
        else:
            self.judged[rid] = (params, None)


# ---------------------------------------------------------------------------
# Worker side
# ---------------------------------------------------------------------------

class _Region:
    """One K or V (or MLA) region of a layer, as ``KVArgs`` takes buffers:
    ``data_ptr()``, ``nbytes`` and the tensor's ``device``; keeps the tensor."""

    def __init__(self, addr, nbytes, device, owner):
        self._addr = addr
        self.nbytes = nbytes
        self.device = device
        self.owner = owner

    def data_ptr(self):
        return self._addr


def _tensor_info(name, t):
    """(address, shape, strides in bytes, itemsize, dtype name, device) of a
    torch tensor or numpy array, without importing either."""
    np = sys.modules.get("numpy")
    if np is not None and isinstance(t, np.ndarray):
        if not t.flags.writeable:
            raise ValueError("kv_caches[%r] is a read-only numpy array" % name)
        return (t.ctypes.data, tuple(t.shape), tuple(t.strides), t.itemsize, t.dtype.name,
                None)
    if hasattr(t, "data_ptr") and hasattr(t, "stride") and hasattr(t, "element_size"):
        it = int(t.element_size())
        return (int(t.data_ptr()), tuple(t.shape), tuple(int(s) * it for s in t.stride()), it,
                str(t.dtype).replace("torch.", ""), getattr(t, "device", None))
    raise TypeError("kv_caches[%r] must be a torch tensor or a numpy array, got %s"
                    % (name, type(t).__name__))


def _block_order(name, shape, st, it):
    """"NHD" or "HND" for blocks of (block_size, heads, head_size) with these
    byte strides, each block one contiguous run; else ValueError."""
    bs, h, d = shape
    if st[2] != it and d > 1:
        raise ValueError("kv_caches[%r]: head_size elements are not contiguous (strides %s "
                         "bytes)" % (name, st))
    if (bs == 1 or st[0] == h * d * it) and (h == 1 or st[1] == d * it):
        return "NHD"
    if (h == 1 or st[1] == bs * d * it) and (bs == 1 or st[0] == d * it):
        return "HND"
    raise ValueError("kv_caches[%r]: a block's (block_size, num_kv_heads, head_size) = %s "
                     "has byte strides %s: neither token-major (NHD) nor head-major (HND) "
                     "contiguous blocks" % (name, shape, st))


def kv_cache_layout(kv_caches, tp_size=1, total_heads=None):
    """What ``register_kv_caches`` registers, read from vLLM's per-layer
    tensors (or numpy arrays of the same shapes, possibly permuted views):
    a dict with ``regions`` (one ``_Region`` per layer per K/V, MLA: per
    layer), ``tags`` ((layer, role, 0) each), ``num_blocks``, ``page_size``,
    ``heads``, ``total_heads``, ``bytes_per_head``, ``block_bytes``,
    ``kv_dtype``, ``attention`` ("mha"/"mla"), ``kv_order`` ("NHD"/"HND")
    and ``device``; ``total_heads`` is the model's (vLLM's model config),
    else heads x ``tp_size``.  Raises ValueError/TypeError, naming the
    layer, for a layout kvferry cannot move."""
    if not kv_caches:
        raise ValueError("register_kv_caches: no KV cache tensors")
    out = None
    regions, tags = [], []
    for layer, (name, t) in enumerate(kv_caches.items()):
        addr, shape, st, it, dtype, dev = _tensor_info(name, t)
        if len(shape) == 5 and shape[0] == 2 and st[0] > st[1]:
            # FlashAttention: (2, num_blocks, block_size, heads, head_size).
            nb, bs, h, d = shape[1:]
            order = _block_order(name, shape[2:], st[2:], it)
            block = bs * h * d * it
            if st[1] != block or st[0] < nb * block:
                raise ValueError(
                    "kv_caches[%r]: shape %s, byte strides %s: K and V must each be one "
                    "contiguous region of num_blocks blocks (block stride %d bytes, K to V "
                    "at least %d bytes); a cross-layer or interleaved cache is not "
                    "supported" % (name, shape, st, block, nb * block))
            parts = [(addr, 0), (addr + st[0], 1)]
            attn = "mha"
        elif len(shape) == 5 and shape[1] == 2:
            raise ValueError(
                "kv_caches[%r]: shape %s is a blocks-first cache (FlashInfer / Triton: "
                "(num_blocks, 2, block_size, num_kv_heads, head_size)), whose K and V "
                "interleave per block; kvferry moves split K/V caches: use the "
                "FLASH_ATTN backend (VLLM_ATTENTION_BACKEND=FLASH_ATTN)" % (name, shape))
        elif len(shape) == 3:
            # MLA: (num_blocks, block_size, head_size), one latent "head".
            nb, bs, d = shape
            h = 1
            order = _block_order(name, (bs, 1, d), (st[1], st[1] * bs, st[2]), it)
            block = bs * d * it
            if st[0] != block:
                raise ValueError("kv_caches[%r]: MLA shape %s, byte strides %s: blocks must "
                                 "be contiguous" % (name, shape, st))
            parts = [(addr, 2)]
            attn = "mla"
        else:
            raise ValueError("kv_caches[%r]: shape %s is not a split-K/V cache (2, num_blocks, "
                             "block_size, num_kv_heads, head_size) nor an MLA cache "
                             "(num_blocks, block_size, head_size)" % (name, shape))
        mine = dict(num_blocks=nb, page_size=bs, heads=h, bytes_per_head=d * it,
                    block_bytes=block, kv_dtype=dtype, attention=attn, kv_order=order,
                    device=(getattr(dev, "type", "cpu"), getattr(dev, "index", None)))
        if out is None:
            out = mine
        elif mine != out:
            diff = sorted(k for k in mine if mine[k] != out[k])
            raise ValueError("kv_caches[%r] differs from the first layer in %s (%s vs %s)"
                             % (name, ", ".join(diff), [mine[k] for k in diff],
                                [out[k] for k in diff]))
        for base, role in parts:
            regions.append(_Region(base, nb * block, dev, t))
            tags.append((layer, role, 0))
    if out["attention"] == "mla":
        total_heads = out["heads"]
    elif total_heads is None:
        total_heads = out["heads"] * tp_size
    out.update(regions=regions, tags=tags, num_layers=len(kv_caches), total_heads=total_heads)
    return out


class _AfterKernels:
    """Runs a room call once the KV it names is written.  vLLM calls
    ``save_kv_layer`` from the attention layer right after it *enqueued*
    the kernel that writes the layer's cache on the current CUDA stream,
    so the bytes may not be there yet: as MoRIIO's connector does, an
    event is recorded on that stream, and one thread per worker waits
    for it before the call, in call order (each layer's chunks stay in
    page order, and a room's last send comes after its layers).  Host
    tensors are written when the call comes: the call runs at once.
    ``lock`` serialises room calls with closing a room (a handle must not
    be used during or after its destroy)."""

    _STOP = object()

    def __init__(self):
        self.lock = threading.Lock()
        self._queue = None
        self._thread = None

    def run(self, tensor, fn):
        dev = getattr(getattr(tensor, "device", None), "type", None)
        if dev == "cuda":
            import torch
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(tensor.device))
            self._start()
        elif self._queue is None:
            with self.lock:
                fn()
            return
        else:
            event = None                # behind the queued calls it must follow
        self._queue.put((event, fn))

    def _start(self):
        if self._thread is None:
            self._queue = queue.SimpleQueue()
            self._thread = threading.Thread(target=self._loop, name="kvferry-push",
                                            daemon=True)
            self._thread.start()

    def _loop(self):
        while True:
            event, fn = self._queue.get()
            if event is self._STOP:
                return
            if event is not None:
                event.synchronize()
            with self.lock:
                fn()

    def stop(self):
        if self._thread is not None:
            self._queue.put((self._STOP, None))
            self._thread.join()
            self._thread = None


class _Worker:
    """Runs in each vLLM worker (one TP rank): its kvferry engines and rooms."""

    def __init__(self, cfg, tp_rank):
        self.cfg = cfg
        self.tp_rank = tp_rank
        self.prefill = None             # KVManager, kv_producer / kv_both
        self.decode = None              # KVManager, kv_consumer / kv_both
        self.layout = None
        self.sending = {}               # req_id -> KVSender (held), or a failure text
        self.recving = {}               # req_id -> (KVReceiver or failure text, RecvMeta)
        self.invalid = set()
        self.stats = KVFerryConnectorStats()    # rooms ended since vLLM last asked
        self.layer_index = {}           # layer name -> its index (the KV buffers' tags)
        self.step_push = {}             # req_id -> (KVSender, PushMeta): this step's chunks
        self.unannounced = set()        # pushed req_ids vLLM has not finished yet
        self.after = _AfterKernels()
        self.unknown_layers = set()     # layer names save_kv_layer met unregistered

    # -- registration -----------------------------------------------------

    def register_kv_caches(self, kv_caches):
        import kvferry
        lay = kv_cache_layout(kv_caches, self.cfg.tp_size, self.cfg.total_kv_heads)
        bs = self.cfg.block_size
        if bs is not None and bs != lay["page_size"]:
            raise ValueError("KVFerryConnector: the KV cache tensors hold blocks of %d tokens "
                             "but --block-size is %d: a kernel block size other than the "
                             "scheduler's is not supported" % (lay["page_size"], bs))
        self.block_size = lay["page_size"]
        # kv_cache_layout tags layers in the dict's order: a layer name's
        # index is its position, as MoRIIO's connector numbers its sessions.
        self.layer_index = {name: i for i, name in enumerate(kv_caches)}
        args = kvferry.KVArgs(
            kv_data_ptrs=lay["regions"], kv_item_lens=[lay["block_bytes"]],
            kv_tags=lay["tags"], num_layers=lay["num_layers"], page_size=lay["page_size"],
            kv_dtype=lay["kv_dtype"], attention=lay["attention"], kv_head_num=lay["heads"],
            total_kv_head_num=lay["total_heads"], bytes_per_head=lay["bytes_per_head"],
            kv_order=lay["kv_order"], engine_rank=self.tp_rank, tp_size=self.cfg.tp_size,
            **self.cfg.engine)
        self.layout = lay
        try:
            if self.cfg.producer:
                self.prefill = kvferry.KVManager(args, "prefill")
            if self.cfg.consumer:
                self.decode = kvferry.KVManager(args, "decode")
        except BaseException:
            self.shutdown()
            raise
        logger.info("KVFerryConnector: TP rank %d/%d registered %d layers (%s, %s, %d blocks "
                    "of %d tokens, %s)%s", self.tp_rank, self.cfg.tp_size, lay["num_layers"],
                    lay["attention"], lay["kv_order"], lay["num_blocks"], lay["page_size"],
                    lay["kv_dtype"],
                    "; prefill engine %s" % self.prefill.address if self.prefill else "")

    def get_handshake_metadata(self):
        if self.prefill is None:
            return None
        return KVFerryHandshakeMetadata(tp_rank=self.tp_rank,
                                        descriptor=self.prefill.descriptor(),
                                        engine_id=self.cfg.engine_id)

    # -- per step ---------------------------------------------------------

    def start(self, meta):
        self._each(meta.reqs_to_hold, self._hold, "holding its blocks",
                   lambda rid, m, e: self.sending.setdefault(
                       rid, "cannot hold its blocks: %s" % e))
        self._each(meta.reqs_to_recv, self._recv, "reading its KV",
                   lambda rid, m, e: self.recving.setdefault(rid, (e, m)))
        self.step_push = {}
        self._each(getattr(meta, "reqs_to_push", {}), self._push, "pushing its KV",
                   lambda rid, m, e: self.sending.setdefault(
                       rid, "cannot push its KV: %s" % e))

    @staticmethod
    def _each(reqs, step, what, failed):
        """step(rid, meta) for each request of this step.  A bug met with
        one request fails that request (failed(rid, meta, "Type: why")),
        not the worker."""
        for rid, m in reqs.items():
            try:
                step(rid, m)
            except Exception as e:
                logger.exception("KVFerryConnector: request %s: %s failed", _shown(rid), what)
                failed(rid, m, "%s: %s" % (type(e).__name__, e))

    # -- push mode, P: a held room that takes each layer as it is computed --

    def _push(self, rid, pm):
        """Open the request's room on its first chunk (a held room: it takes
        pages before the decoder asked, and they move once it has), keep
        this step's chunk for save_kv_layer, or abort the room."""
        import kvferry
        s = self.sending.get(rid)
        if pm.abort:
            if s is not None and not isinstance(s, str):
                self.after.run(None, functools.partial(self._fail_push, s, pm.abort))
            return
        if s is None:
            self.unannounced.add(rid)
            if self.prefill is None:
                s = "this worker has no prefill engine (register_kv_caches)"
            else:
                try:
                    s = kvferry.KVSender.held(self.prefill, pm.room, pm.instance,
                                              lease_s=self.cfg.lease_s)
                    s.init(pm.num_pages)
                except (kvferry.KVFerryError, ValueError, TypeError) as e:
                    if not isinstance(s, str) and s is not None:
                        s.close()
                    s = "cannot open its room: %s" % e
            self.sending[rid] = s
        if not isinstance(s, str):
            self.step_push[rid] = (s, pm)

    def _fail_push(self, s, why):
        """Fail a pushed room with the application's reason (no-op once final)."""
        import kvferry
        try:
            s.fail(why)
        except kvferry.KVFerryError:
            pass                        # closed: it was final already

    def _push_call(self, s, what, call):
        """A room call of the push path: one refused fails the room with
        the reason (a room already final refuses it, and keeps its end)."""
        import kvferry
        try:
            call()
        except (kvferry.KVFerryError, ValueError, TypeError) as e:
            self._fail_push(s, "the prefill could not give its room %s: %s" % (what, e))

    def save_layer(self, layer_name, kv_layer):
        if not self.step_push:
            return
        layer = self.layer_index.get(layer_name)
        if layer is None:
            if layer_name not in self.unknown_layers:
                self.unknown_layers.add(layer_name)
                logger.error("KVFerryConnector: TP rank %d: save_kv_layer(%r): not a layer "
                             "register_kv_caches registered; its KV is not pushed, and the "
                             "rooms that need it fail", self.tp_rank, layer_name)
            return
        for s, pm in self.step_push.values():
            if pm.block_ids:
                what = "layer %d, pages %d..%d" % (layer, pm.first_page,
                                                   pm.first_page + len(pm.block_ids) - 1)
                self.after.run(kv_layer, functools.partial(
                    self._push_call, s, what, functools.partial(
                        s.send_layers, pm.block_ids, pm.first_page, layer, layer + 1)))

    def wait_for_save(self):
        """The forward pass is over: end the rooms whose last chunk it
        computed.  A layer whose save never came leaves the room short,
        and the library fails it naming that layer."""
        for s, pm in self.step_push.values():
            if pm.last:
                self.after.run(None, functools.partial(
                    self._push_call, s, "its end", functools.partial(s.send, [],
                                                                      is_last=True)))
        self.step_push = {}

    def _hold(self, rid, hold):
        import kvferry
        if rid in self.sending:
            logger.error("KVFerryConnector: request %s is held already; ignoring a second "
                         "hold", _shown(rid))
            return
        if self.prefill is None:
            self.sending[rid] = "this worker has no prefill engine (register_kv_caches)"
            return
        try:
            s = kvferry.KVSender.held(self.prefill, hold.room, hold.instance,
                                      lease_s=self.cfg.lease_s)
        except (kvferry.KVFerryError, ValueError, TypeError) as e:
            self.sending[rid] = "cannot hold its blocks: %s" % e
            return
        try:
            s.init(len(hold.block_ids))
            s.send(hold.block_ids, is_last=True)
        except (kvferry.KVFerryError, ValueError, TypeError) as e:
            s.close()
            self.sending[rid] = "cannot hold its blocks: %s" % e
            return
        self.sending[rid] = s

    def _recv(self, rid, rm):
        import kvferry
        if rid in self.recving:
            logger.error("KVFerryConnector: request %s is being read already; ignoring a "
                         "second read", _shown(rid))
            return
        local, remote = rm.local_block_ids, rm.remote_block_ids
        if rm.refused:
            self.recving[rid] = (rm.refused, rm)
            return
        if self.decode is None:
            self.recving[rid] = ("this worker has no decode engine (register_kv_caches)", rm)
            return
        if rm.prompt_blocks is None and len(local) > len(remote):
            self.recving[rid] = ("%d local blocks to fill but P holds %d"
                                 % (len(local), len(remote)), rm)
            return
        # D holds the first blocks already (its prefix cache): read P's tail,
        # NIXL's remote_block_ids[-len(local):].  A pushed room's params do
        # not name P's blocks: the prompt's count.
        total = len(remote) if rm.prompt_blocks is None else rm.prompt_blocks
        prefix = (total - len(local)) * self.block_size
        try:
            r = kvferry.KVReceiver.remote(self.decode, rm.room, rm.descriptors, rm.instance)
        except (kvferry.KVFerryError, ValueError, TypeError) as e:
            self.recving[rid] = ("cannot reach P's room: %s" % e, rm)
            return
        try:
            r.set_dest(local, decode_prefix_len=prefix)
        except (kvferry.KVFerryError, ValueError, TypeError) as e:
            r.close()
            self.recving[rid] = ("bad destination: %s" % e, rm)
            return
        self.recving[rid] = (r, rm)

    def _reason(self, h):
        """Why a room failed (it is recorded in the stats too)."""
        import kvferry
        try:
            h.failure_exception()
        except kvferry.KVTransferError as e:
            self.stats.record_failure(_lib_status_name(e.code), e.is_from_another_rank)
            return str(e)
        self.stats.record_failure("unknown", False)     # pragma: no cover
        return "failed"                 # pragma: no cover - poll said Failed

    def _succeeded(self, h):
        m = h.metric()
        if m is not None:
            self.stats.record_transfer(m["transfer_s"], m["bytes"])

    def get_finished(self, finished_req_ids=()):
        from kvferry import KVPoll
        sending, recving = set(), set()
        # A pushed room may end before vLLM finished its request: it is
        # reported once vLLM did (finished_req_ids), never before.
        self.unannounced -= set(finished_req_ids or ())
        for rid, s in list(self.sending.items()):
            if rid in self.unannounced:
                continue
            if isinstance(s, str):
                logger.error("KVFerryConnector: TP rank %d: request %s: %s; its blocks are "
                             "freed", self.tp_rank, _shown(rid), s)
            else:
                st = s.poll()
                if st not in (KVPoll.Success, KVPoll.Failed):
                    continue
                if st == KVPoll.Failed:
                    logger.warning("KVFerryConnector: TP rank %d: request %s: releasing the KV "
                                   "blocks held for the decoder, which did not get them: %s",
                                   self.tp_rank, _shown(rid), self._reason(s))
                else:
                    self._succeeded(s)
                with self.after.lock:
                    s.close()
            del self.sending[rid]
            sending.add(rid)
        for rid, (r, rm) in list(self.recving.items()):
            if isinstance(r, str):
                why = r
            else:
                st = r.poll()
                if st not in (KVPoll.Success, KVPoll.Failed):
                    continue
                why = self._reason(r) if st == KVPoll.Failed else None
                if why is None:
                    self._succeeded(r)
                r.close()
            del self.recving[rid]
            if not rm.report:
                continue                # only told P to free; vLLM waits for nothing
            if why is not None:
                logger.warning("KVFerryConnector: TP rank %d: request %s: loading its KV from "
                               "%s request %s failed, its %d blocks are reported invalid: %s",
                               self.tp_rank, _shown(rid), rm.remote_engine_id,
                               rm.remote_request_id, len(rm.local_block_ids), why)
                self.invalid.update(rm.local_block_ids)
            recving.add(rid)
        return sending, recving

    def get_block_ids_with_load_errors(self):
        out, self.invalid = self.invalid, set()
        return out

    def get_kv_connector_stats(self):
        if self.stats.is_empty():
            return None
        return self.stats.clone_and_reset()

    def shutdown(self):
        self.after.stop()
        for s in self.sending.values():
            if not isinstance(s, str):
                s.close()
        for r, _ in self.recving.values():
            if not isinstance(r, str):
                r.close()
        self.sending, self.recving = {}, {}
        for m in (self.prefill, self.decode):
            if m is not None:
                m.close()
        self.prefill = self.decode = None


# ---------------------------------------------------------------------------
# The connector
# ---------------------------------------------------------------------------

class KVFerryConnector(KVConnectorBase_V1):
    """vLLM v1 KV connector over kvferry held rooms (module docstring,
    docs/VLLM.md).  ``kv_connector_extra_config`` keys: ``lease_s`` (how
    long P holds unread blocks; default ``$VLLM_NIXL_ABORT_REQUEST_TIMEOUT``,
    else 480), ``transfer_mode`` ("pull", the default, or "push": layers
    sent as computed), ``kvferry`` (engine settings: host, port, transport,
    checksum, streams, the ``*_timeout_ms`` deadlines, heartbeat, metrics_addr,
    trace, busy_poll_us), and, for
    tests without vLLM, ``tp_rank`` / ``tp_size`` (also the ``tp_rank``
    keyword)."""

    def __init__(self, vllm_config, role, kv_cache_config=None, *, tp_rank=None):
        try:
            super().__init__(vllm_config, role, kv_cache_config)
        except TypeError:  # pragma: no cover - a vLLM whose base takes (config, role)
            super().__init__(vllm_config, role)
        self._cfg = _Config(vllm_config, tp_rank)
        self._scheduler = None
        self._worker = None
        if _status_name(role) == "SCHEDULER":
            self._scheduler = _Scheduler(self._cfg)
        else:
            self._worker = _Worker(self._cfg, self._cfg.worker_tp_rank())

    def _sched(self):
        assert self._scheduler is not None, "a scheduler-side method called on a worker"
        return self._scheduler

    def _work(self):
        assert self._worker is not None, "a worker-side method called on the scheduler"
        return self._worker

    # -- scheduler side ---------------------------------------------------

    # What a client's kv_transfer_params reach is checked first
    # (parse_params); a bug met anyway is logged, and the request goes on
    # without KV transfer instead of raising into vLLM's engine core.

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        s = self._sched()
        try:
            return s.get_num_new_matched_tokens(request, num_computed_tokens)
        except Exception:
            s.internal_error(request, "get_num_new_matched_tokens")
            return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        s = self._sched()
        try:
            return s.update_state_after_alloc(request, blocks, num_external_tokens)
        except Exception as e:
            s.internal_error(request, "update_state_after_alloc")
            if num_external_tokens > 0:
                # vLLM now waits for this request's load: the workers report
                # its blocks invalid, so vLLM recomputes them (or fails it,
                # by kv_load_failure_policy) instead of waiting forever.
                s.recvs[request.request_id] = RecvMeta(
                    local_block_ids=list(blocks.get_unhashed_block_ids()),
                    remote_block_ids=[], remote_request_id="?", remote_engine_id="P",
                    descriptors=[], room=0, instance=0,
                    refused="kvferry failed to set up its read (%s: %s)"
                    % (type(e).__name__, e))

    def build_connector_meta(self, scheduler_output):
        return self._sched().build_connector_meta(scheduler_output)

    def request_finished(self, request, block_ids):
        s = self._sched()
        try:
            return s.request_finished(request, block_ids)
        except Exception:
            s.internal_error(request, "request_finished", final=True)
            return False, None

    def set_xfer_handshake_metadata(self, metadata):
        return self._sched().set_xfer_handshake_metadata(metadata)

    def get_finished_count(self):
        return None                     # every worker reports every id

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config):
        """"HND" (head-major blocks: a TP slice of a block is one contiguous
        run, as NIXL asks), except for MLA: None, the backend's default."""
        model = getattr(vllm_config, "model_config", None)
        if getattr(model, "use_mla", False):
            return None
        return "HND"

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config):
        """Push mode: True.  vLLM replays a full CUDA graph without running
        ``save_kv_layer``, which push mode needs for every layer (a room
        left short fails); PIECEWISE graphs run it between their pieces,
        as MoRIIO asks too.  Pull mode does nothing per layer: False."""
        return (extra_config or {}).get("transfer_mode") == "push"

    # -- worker side ------------------------------------------------------

    def register_kv_caches(self, kv_caches):
        self._work().register_kv_caches(kv_caches)

    def get_handshake_metadata(self):
        return self._work().get_handshake_metadata()

    def start_load_kv(self, forward_context, **kwargs):
        self._work().start(self._get_connector_metadata())

    def wait_for_layer_load(self, layer_name):
        pass                            # loads complete between steps (async)

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        """Push mode: this step's chunk of each pushing request, for this
        layer, to its room (pull mode: nothing, D reads P's blocks where
        they are).  Called in the forward pass: a bug is logged, never
        raised (a room it leaves short fails at its last send)."""
        try:
            self._work().save_layer(layer_name, kv_layer)
        except Exception:
            logger.exception("KVFerryConnector: save_kv_layer(%r) failed", layer_name)

    def wait_for_save(self):
        try:
            self._work().wait_for_save()
        except Exception:
            logger.exception("KVFerryConnector: wait_for_save failed")

    def get_finished(self, finished_req_ids):
        return self._work().get_finished(finished_req_ids)

    def get_block_ids_with_load_errors(self):
        return self._work().get_block_ids_with_load_errors()

    # -- metrics (vLLM's /metrics and its log line) -----------------------

    def get_kv_connector_stats(self):
        """The rooms this worker saw end since the last call
        (``KVFerryConnectorStats``), or None (none, or the scheduler side)."""
        if self._worker is None:
            return None
        return self._worker.get_kv_connector_stats()

    @classmethod
    def build_kv_connector_stats(cls, data=None):
        """Stats from the ``data`` dict vLLM shipped between processes."""
        return KVFerryConnectorStats(data=data) if data is not None \
            else KVFerryConnectorStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames,
                           per_engine_labelvalues):
        """kvferry's Prometheus metrics in vLLM's registry (vLLM asks every
        connector that returns stats for these)."""
        return KVFerryPromMetrics(vllm_config, metric_types, labelnames,
                                  per_engine_labelvalues)

    def shutdown(self):
        if self._worker is not None:
            self._worker.shutdown()
