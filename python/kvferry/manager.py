"""``KVManager`` (one engine per rank) and ``BootstrapServer``.

Lifetime is the one subtle part.  Every C handle is released by a
``weakref.finalize`` object, which runs at most once whichever comes
first: ``close()``, garbage collection, or interpreter exit.  A manager's
``_Engine`` holder knows the finalizers of its live senders and receivers
and runs them before ``kvf_engine_destroy``, so the C rule "destroy rooms
before their engine" holds even when a scheduler drops the manager first
or the interpreter exits with rooms alive.  Senders and receivers hold the
holder, never the other way round (no reference cycles), and the holder
keeps the registered buffers referenced until the engine is gone.
"""
import ctypes
import threading
import weakref

from . import _lib
from ._convert import buffer_address, to_uint
from ._lib import lib
from .args import KVArgs
from .errors import KVFerryStateError, check

__all__ = ["KVManager", "BootstrapServer"]


class _Closing:
    """``close()`` runs the object's finalizer (``self._fin``); a context
    manager closes on exit."""

    def close(self):
        """Release what the object holds (blocks until done).  Idempotent."""
        self._fin()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class _Engine:
    """Owns one ``kvf_engine_t *``: its room finalizers and buffer keepalives."""

    def __init__(self, ptr, keepalive):
        self.ptr = ptr
        self.keepalive = keepalive
        self.rooms = {}             # key -> weakref.finalize of a live room
        self.next_key = 0
        self.lock = threading.Lock()

    def key(self):
        with self.lock:
            self.next_key += 1
            return self.next_key

    def track(self, key, fin):
        with self.lock:
            closed = self.ptr is None
            if not closed:
                self.rooms[key] = fin
        if closed:
            fin()
            raise KVFerryStateError("the KVManager is closed")

    def untrack(self, key):
        with self.lock:
            self.rooms.pop(key, None)

    def live(self):
        if self.ptr is None:
            raise KVFerryStateError("the KVManager is closed")
        return self.ptr


def _destroy_engine(holder):
    with holder.lock:
        rooms, holder.rooms = list(holder.rooms.values()), {}
    for fin in rooms:
        fin()
    with holder.lock:
        ptr, holder.ptr = holder.ptr, None
    if ptr is not None:
        lib.kvf_engine_destroy(ptr)
    holder.keepalive = None


def _role(mode):
    """Accept "prefill"/"decode", 0/1 or an enum (SGLang's DisaggregationMode)."""
    v = getattr(mode, "value", mode)
    if isinstance(v, str):
        v = v.lower()
        if v in ("prefill", "decode"):
            return _lib.ROLE_PREFILL if v == "prefill" else _lib.ROLE_DECODE
    elif v in (_lib.ROLE_PREFILL, _lib.ROLE_DECODE) and not isinstance(v, bool):
        return v
    raise ValueError("mode must be 'prefill' or 'decode' (or SGLang's "
                     "DisaggregationMode.PREFILL/DECODE), got %r" % (mode,))


def _buffers(kind, ptrs, lens, items):
    """Build a ``kvf_buffer_t[]`` from one ``KVArgs`` buffer group."""
    ptrs = list(ptrs or [])
    items = list(items or [])
    if lens is not None:
        lens = list(lens)
        if len(lens) != len(ptrs):
            raise ValueError("%s_data_lens has %d entries but %s_data_ptrs has %d"
                             % (kind, len(lens), kind, len(ptrs)))
    if len(items) == 1 and len(ptrs) > 1:
        items = items * len(ptrs)
    if len(items) != len(ptrs):
        raise ValueError("%s_item_lens has %d entries but %s_data_ptrs has %d "
                         "(give one per buffer, or one for all)"
                         % (kind, len(items), kind, len(ptrs)))
    arr = (_lib.Buffer * max(len(ptrs), 1))()
    keep = []
    for i, p in enumerate(ptrs):
        name = "%s_data_ptrs[%d]" % (kind, i)
        ln = None if lens is None else to_uint("%s_data_lens[%d]" % (kind, i),
                                                lens[i], 64)
        addr, length, k = buffer_address(name, p, ln, "%s_data_lens[%d]" % (kind, i))
        item = to_uint("%s_item_lens[%d]" % (kind, i), items[i], 32)
        if item == 0 or length < item or length % item:
            raise ValueError("%s: %d bytes is not a positive multiple of its "
                             "item length %d (%s_item_lens[%d])"
                             % (name, length, item, kind, i))
        arr[i].base, arr[i].length, arr[i].item_bytes = addr, length, item
        keep.append(k)
    n_items = min((b.length // b.item_bytes for b in arr[:len(ptrs)]), default=0)
    return arr, len(ptrs), keep, n_items


def _u32(name, v):
    return to_uint(name, v, 32)


def _int(name, v):
    """A non-negative value for a C ``int`` field."""
    return to_uint(name, v, 31)


class KVManager(_Closing):
    """One kvferry engine: a rank's registered KV memory and its connections.

    ``KVManager(args, mode)`` creates the engine (binds its control port,
    starts its threads) and registers ``args``' layout; a prefill manager
    then registers itself with its bootstrap registry in the background.
    ``mode`` is ``"prefill"`` or ``"decode"`` (or SGLang's
    ``DisaggregationMode``).  Use as a context manager or call
    ``close()``; closing destroys every sender and receiver still open on
    it first.  Raises ``ValueError``/``TypeError`` for a bad ``KVArgs``
    and ``KVFerryError`` subclasses when the library refuses.
    """

    def __init__(self, args, mode="prefill"):
        if not isinstance(args, KVArgs):
            raise TypeError("args must be a kvferry.KVArgs, got %s" % type(args).__name__)
        self.args = args
        self.role = _role(mode)
        self.mode = _lib.role_name(self.role)
        layout, keep, limits = self._layout(args)
        params = self._params(args)
        params.role = self.role
        ptr = ctypes.c_void_p()
        check(lib.kvf_engine_create(ctypes.byref(params), ctypes.byref(ptr)),
              "kvf_engine_create (%s rank %d)" % (self.mode, args.engine_rank),
              "see the kvferry log on stderr for which parameter")
        self._engine = _Engine(ptr.value, keep)
        self._fin = weakref.finalize(self, _destroy_engine, self._engine)
        self.num_pages, self.num_aux_slots, self.num_state_slots = limits
        try:
            check(lib.kvf_engine_register_layout(ptr, ctypes.byref(layout)),
                  "kvf_engine_register_layout",
                  "see the kvferry log on stderr for which field")
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _params(a):
        """``kvf_engine_params_t``: the library's defaults, then ``a``'s fields."""
        p = _lib.new_params()
        p.tp_rank = _int("engine_rank", a.engine_rank)
        p.tp_size = _int("tp_size", a.tp_size)
        p.pp_rank = _int("pp_rank", a.pp_rank)
        p.pp_size = _int("pp_size", a.pp_size)
        p.dp_rank = _int("system_dp_rank", a.system_dp_rank)
        p.dp_size = _int("dp_size", a.dp_size)
        p.port = to_uint("port", a.port, 16)
        if a.host is not None:
            p.host = _str("host", a.host)
        if a.bootstrap_addr is not None:
            p.bootstrap_addr = _addr("bootstrap_addr", a.bootstrap_addr)
        p.host_bootstrap = 1 if a.host_bootstrap else 0
        if a.transport is not None:
            p.transport = _str("transport", a.transport)
        if a.checksum is not None:
            p.checksum = 1 if a.checksum else 0
        if a.faults is not None:
            p.faults = _str("faults", a.faults)
        if a.auth_token is not None:
            p.auth_token = _str("auth_token", a.auth_token)
        if a.streams is not None:
            p.streams = _u32("streams", a.streams)
        for f in ("bootstrap_timeout_ms", "waiting_timeout_ms", "transfer_timeout_ms",
                  "heartbeat_interval_ms", "heartbeat_timeout_ms"):
            v = getattr(a, f)
            if v is not None:
                setattr(p, f, _u32(f, v))
        return p

    def _layout(self, a):
        l = _lib.new_layout()
        kv, nkv, keep_kv, npages = _buffers("kv", a.kv_data_ptrs, a.kv_data_lens,
                                            a.kv_item_lens)
        aux, naux, keep_aux, nslots = _buffers("aux", a.aux_data_ptrs, a.aux_data_lens,
                                               a.aux_item_lens)
        st, nst, keep_st, nstate = _buffers("state", a.state_data_ptrs,
                                            a.state_data_lens, a.state_item_lens)
        if nkv == 0:
            raise ValueError("kv_data_ptrs is empty: register at least one KV buffer")
        page_size = _u32("page_size", a.page_size)
        if page_size == 0:
            raise ValueError("page_size must be a positive number of tokens per page")
        attn = {"mha": _lib.ATTN_MHA, "gqa": _lib.ATTN_MHA,
                "mla": _lib.ATTN_MLA}.get(str(a.attention).lower())
        if attn is None:
            raise ValueError("attention must be 'mha' (MHA/GQA) or 'mla', got %r"
                             % (a.attention,))
        if not isinstance(a.kv_dtype, str) or not a.kv_dtype:
            raise TypeError("kv_dtype must be a dtype name such as 'bfloat16'")
        self._dtype = a.kv_dtype.encode()
        l.page_size = page_size
        l.kv_dtype = self._dtype
        l.attn = attn
        per_layer = 1 if attn == _lib.ATTN_MLA else 2
        layers = a.num_layers if a.num_layers is not None else max(nkv // per_layer, 1)
        l.num_layers = _u32("num_layers", layers)
        l.first_layer = _u32("first_layer", a.first_layer)
        if attn == _lib.ATTN_MHA:
            heads = _u32("kv_head_num", a.kv_head_num)
            if heads == 0:
                raise ValueError("kv_head_num must be positive for MHA/GQA")
            total = a.total_kv_head_num if a.total_kv_head_num is not None \
                else heads * max(a.tp_size, 1)
            bph = a.bytes_per_head if a.bytes_per_head is not None \
                else kv[0].item_bytes // (page_size * heads)
            l.heads_per_rank, l.total_heads = heads, _u32("total_kv_head_num", total)
            l.bytes_per_head = _u32("bytes_per_head", bph)
            want = page_size * heads * l.bytes_per_head
            for i in range(nkv):
                if kv[i].item_bytes != want:
                    raise ValueError(
                        "kv_item_lens[%d] = %d bytes per page, but page_size %d x "
                        "kv_head_num %d x bytes_per_head %d = %d"
                        % (i, kv[i].item_bytes, page_size, heads, l.bytes_per_head, want))
        l.mem_kind = _lib.MEM_HOST
        l.num_kv, l.kv = nkv, kv
        l.num_aux, l.aux = naux, aux
        l.num_state, l.state = nst, st
        # The arrays are copied by the library; the memory they point to is not.
        return l, (keep_kv, keep_aux, keep_st), (npages, nslots, nstate)

    # -- properties -------------------------------------------------------

    def _ptr(self):
        return self._engine.live()

    @property
    def closed(self):
        return self._engine.ptr is None

    @property
    def address(self):
        """This engine's control address ``"host:port"``."""
        return _read_addr(lib.kvf_engine_address, self._ptr(), "kvf_engine_address")

    @property
    def bootstrap_addr(self):
        """The in-process registry's ``"host:port"`` (``host_bootstrap`` only)."""
        return _read_addr(lib.kvf_engine_bootstrap_addr, self._ptr(),
                          "kvf_engine_bootstrap_addr",
                          "this manager hosts no registry (host_bootstrap=False)")

    @property
    def transport(self):
        """The transport moving payload, e.g. ``"tcp"``."""
        return lib.kvf_engine_transport(self._ptr()).decode()

    @property
    def instance_id(self):
        """The engine's random 64-bit instance id."""
        return lib.kvf_engine_instance_id(self._ptr())

    def stats(self):
        """A snapshot of the engine's counters, as a dict."""
        s = _lib.EngineStats()
        lib.kvf_engine_stats(self._ptr(), ctypes.byref(s))
        d = {f: getattr(s, f) for f, _ in _lib.EngineStats._fields_[1:]}
        d["rooms_by_state"] = list(s.rooms_by_state)
        return d

    def close(self):
        """Destroy every open sender/receiver of this manager, then the engine.
        Blocks until the engine's threads stopped.  Idempotent."""
        self._fin()

    def __repr__(self):
        state = "closed" if self.closed else self.address
        return "<kvferry.KVManager %s rank %d %s>" % (self.mode, self.args.engine_rank,
                                                      state)


class BootstrapServer(_Closing):
    """A bootstrap registry (SGLang's HTTP routes) served from its own thread.

    ``BootstrapServer(host="127.0.0.1", port=0)``; ``.port`` is the port it
    listens on, ``.addr`` ``"host:port"``, ``.access`` who may register:
    ``"token"`` (the cluster token from ``KVF_AUTH_TOKEN``,
    ``KVF_AUTH_TOKEN_FILE`` or ``SGLANG_DISAGGREGATION_BOOTSTRAP_AUTH_TOKEN``
    in the environment), ``"protected"`` (no token: clients on this host
    only; a non-loopback host is refused) or ``"open"`` (``KVF_AUTH=none``).
    Context manager, ``close()``.
    """

    def __init__(self, host="127.0.0.1", port=0):
        self.host = host
        ptr = ctypes.c_void_p()
        check(lib.kvf_bootstrap_create(_str("host", host), to_uint("port", port, 16),
                                       ctypes.byref(ptr)),
              "kvf_bootstrap_create(%s, %s)" % (host, port))
        self._ptr = ptr.value
        self.port = lib.kvf_bootstrap_port(ptr)
        self.access = lib.kvf_bootstrap_access(ptr).decode()
        self.addr = "%s:%d" % (host, self.port)
        self._fin = weakref.finalize(self, lib.kvf_bootstrap_destroy, ptr.value)

    def close(self):
        """Stop the registry (blocks until its thread stopped).  Idempotent."""
        self._fin()

    def __repr__(self):
        return "<kvferry.BootstrapServer %s%s>" % (self.addr,
                                                   "" if self._fin.alive else " closed")


def _str(name, v):
    if not isinstance(v, str):
        raise TypeError("%s must be a str, got %s" % (name, type(v).__name__))
    if "\0" in v:
        raise ValueError("%s contains a NUL character" % name)
    return v.encode()


def _addr(name, v):
    b = _str(name, v)
    host, sep, port = v.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ValueError("%s must be 'host:port', got %r" % (name, v))
    return b


def _read_addr(fn, ptr, what, hint=None):
    buf = ctypes.create_string_buffer(_lib.ADDR_MAX)
    check(fn(ptr, buf, len(buf)), what, hint)
    return buf.value.decode()
