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
from ._convert import buffer_address, buffer_memory, to_uint
from ._lib import lib
from .args import KVArgs, StateGroup
from .errors import KVFerryStateError, check

__all__ = ["KVManager", "BootstrapServer", "room_key"]


def room_key(request_id):
    """``(room, instance)`` of an application's request id
    (``kvf_room_key``): XXH3-128 of its UTF-8 bytes, the same on every host.
    A prefill holds the room under the instance (``KVSender.held``) and a
    decode names both (``KVReceiver.remote``): two ids whose rooms collide
    differ in their instance, and the stranger is refused.  Raises
    ``TypeError`` for another type and ``ValueError`` for a str without a
    UTF-8 form (a lone surrogate)."""
    if isinstance(request_id, str):
        try:
            b = request_id.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError("request_id holds a lone surrogate U+%04X at position %d: it "
                             "has no UTF-8 form" % (ord(request_id[e.start]), e.start)) \
                from None
    elif isinstance(request_id, (bytes, bytearray)):
        b = bytes(request_id)
    else:
        raise TypeError("request_id must be a str (or bytes), got %s"
                        % type(request_id).__name__)
    _lib.require("kvf_room_key", "kvferry.room_key")
    k = lib.kvf_room_key(b, len(b))
    return k.room, k.instance


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
    mems = set()
    for i, p in enumerate(ptrs):
        name = "%s_data_ptrs[%d]" % (kind, i)
        mems.add(buffer_memory(p))
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
    if len(mems) > 1:
        raise ValueError("%s_data_ptrs mixes memories (%s): every buffer of a family "
                         "must be host memory, or memory of one CUDA device"
                         % (kind, ", ".join(sorted("%s:%s" % m for m in mems))))
    return arr, len(ptrs), keep, n_items, (mems.pop() if mems else ("host", None))


def _tags(tags, nkv):
    """``kvf_kv_tag_t[]`` from ``KVArgs.kv_tags`` (None: none), and the
    indices of the model's own (group 0) buffers."""
    if tags is None:
        return None, list(range(nkv))
    tags = list(tags)
    if len(tags) != nkv:
        raise ValueError("kv_tags has %d entries but kv_data_ptrs has %d: give one "
                         "(layer, role, group) per KV buffer" % (len(tags), nkv))
    arr = (_lib.KVTag * nkv)()
    seen = {}
    for i, t in enumerate(tags):
        try:
            layer, role, group = t
        except (TypeError, ValueError):
            raise TypeError("kv_tags[%d] must be a (layer, role, group) triple, got %r"
                            % (i, t)) from None
        key = (to_uint("kv_tags[%d] layer" % i, layer, 32),
               to_uint("kv_tags[%d] role" % i, role, 16),
               to_uint("kv_tags[%d] group" % i, group, 16))
        if key in seen:
            raise ValueError("kv_tags[%d] = %r names the same buffer as kv_tags[%d]"
                             % (i, key, seen[key]))
        seen[key] = i
        arr[i].layer, arr[i].role, arr[i].group = key
    main = [i for i in range(nkv) if arr[i].group == 0]
    if not main:
        raise ValueError("kv_tags: no buffer of group 0 (the model's own KV)")
    return arr, main


def _state_groups(groups):
    """``kvf_state_group_t[]`` from a list of ``StateGroup``; also the number
    of indices each group holds, what to keep alive, and the groups' memory
    (one kind for all of them, as for any family)."""
    arr = (_lib.StateGroup * len(groups))()
    items, keep, mems = [], [], set()
    for g, sg in enumerate(groups):
        if not isinstance(sg, StateGroup):
            raise TypeError("state_groups[%d] must be a kvferry.StateGroup, got %s"
                            % (g, type(sg).__name__))
        name = _str("state_groups[%d].type" % g, str(getattr(sg.type, "value", sg.type)))
        bufs, n, k, nitems, mem = _buffers("state_groups[%d]" % g, sg.data_ptrs,
                                           sg.data_lens, sg.item_lens)
        mems.add(mem)
        if n == 0:
            raise ValueError("state_groups[%d] (%s) has no buffers" % (g, name.decode()))
        arr[g].type, arr[g].num_buffers, arr[g].buffers = name, n, bufs
        items.append(nitems)
        keep.append((name, bufs, k))
    if len(mems) > 1:
        raise ValueError("state_groups mix memories (%s): every state buffer must be host "
                         "memory, or memory of one CUDA device"
                         % ", ".join(sorted("%s:%s" % m for m in mems)))
    return arr, items, keep, (mems.pop() if mems else ("host", None))


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
        if a.api_key:
            _lib.require("kvf_auth_token_resolve", "KVArgs.api_key")
            p.api_key = _str("api_key", a.api_key)
        p.cp_rank = _int("cp_rank", a.cp_rank)
        if a.cp_size != 1:
            p.cp_size = _int("cp_size", a.cp_size)
        p.dp_attention = 1 if a.dp_attention else 0
        if a.kv_cache_dtype is not None:
            p.kv_cache_dtype = _str("kv_cache_dtype", a.kv_cache_dtype)
        if a.load_balance_method is not None:
            p.load_balance_method = _str("load_balance_method", a.load_balance_method)
        if a.prefill_http_port is not None:
            p.prefill_http_port = to_uint("prefill_http_port", a.prefill_http_port, 16)
        p.dsa_cache_layer_split = 1 if a.dsa_cache_layer_split else 0
        if a.decode_allocation_policy is not None:
            _lib.require("kvf_auth_token_resolve", "KVArgs.decode_allocation_policy")
            p.decode_allocation_policy = _str("decode_allocation_policy",
                                              a.decode_allocation_policy)
        if a.streams is not None:
            p.streams = _u32("streams", a.streams)
        if a.metrics_addr is not None:
            p.metrics_addr = _addr("metrics_addr", a.metrics_addr)
        if a.trace is not None:
            p.trace = _str("trace", a.trace)
        if a.busy_poll_us is not None:
            p.busy_poll_us = _u32("busy_poll_us", a.busy_poll_us)
        for f in ("bootstrap_timeout_ms", "waiting_timeout_ms", "transfer_timeout_ms",
                  "heartbeat_interval_ms", "heartbeat_timeout_ms"):
            v = getattr(a, f)
            if v is not None:
                setattr(p, f, _u32(f, v))
        return p

    def _layout(self, a):
        l = _lib.new_layout()
        kv, nkv, keep_kv, npages, kv_mem = _buffers("kv", a.kv_data_ptrs, a.kv_data_lens,
                                                    a.kv_item_lens)
        aux, naux, keep_aux, nslots, aux_mem = _buffers("aux", a.aux_data_ptrs,
                                                        a.aux_data_lens, a.aux_item_lens)
        st, nst, keep_st, nstate, st_mem = _buffers("state", a.state_data_ptrs,
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
        tags, main = _tags(a.kv_tags, nkv)
        per_layer = 1 if attn == _lib.ATTN_MLA else 2
        if a.num_layers is not None:
            layers = a.num_layers
        elif tags is not None:
            layers = len({tags[i].layer for i in main})
        else:
            layers = max(nkv // per_layer, 1)
        l.num_layers = _u32("num_layers", layers)
        l.first_layer = _u32("first_layer", a.first_layer)
        if attn == _lib.ATTN_MHA:
            heads = _u32("kv_head_num", a.kv_head_num or 0)
            if heads == 0:
                if self.role != _lib.ROLE_DECODE:
                    raise ValueError("kv_head_num must be positive for MHA/GQA on a "
                                     "prefill engine (only a decode engine may leave "
                                     "it 0, to take it from its prefill peer)")
                l.heads_per_rank = l.total_heads = l.bytes_per_head = 0
            else:
                total = a.total_kv_head_num if a.total_kv_head_num is not None \
                    else heads * max(a.tp_size, 1)
                first = kv[main[0]].item_bytes
                bph = a.bytes_per_head if a.bytes_per_head is not None \
                    else first // (page_size * heads)
                l.heads_per_rank, l.total_heads = heads, _u32("total_kv_head_num", total)
                l.bytes_per_head = _u32("bytes_per_head", bph)
                want = page_size * heads * l.bytes_per_head
                for i in main:
                    if kv[i].item_bytes != want:
                        raise ValueError(
                            "kv_item_lens[%d] = %d bytes per page, but page_size %d x "
                            "kv_head_num %d x bytes_per_head %d = %d"
                            % (i, kv[i].item_bytes, page_size, heads,
                               l.bytes_per_head, want))
        group_keep = None
        groups = []
        if a.state_groups:
            if nst:
                raise ValueError("give state buffers either as state_data_ptrs or as "
                                 "state_groups, not both")
            garr, groups, gkeep, st_mem = _state_groups(a.state_groups)
            l.num_state_groups = len(groups)
            l.state_groups = ctypes.cast(garr, ctypes.c_void_p)
            group_keep = (garr, gkeep)
        self.state_group_items = groups
        # Each family's memory, as its buffers say (buffer_memory); one GPU.
        kinds = {"host": _lib.MEM_HOST, "cuda": _lib.MEM_CUDA}
        l.mem_kind = kinds[kv_mem[0]]
        l.aux_mem_kind = kinds[aux_mem[0]]
        l.state_mem_kind = kinds[st_mem[0]]
        ordinals = {m[1] for m in (kv_mem, aux_mem, st_mem) if m[0] == "cuda"}
        if len(ordinals) > 1:
            raise ValueError("the buffers are on CUDA devices %s: one engine registers the "
                             "memory of one GPU" % sorted(ordinals))
        l.cuda_device = ordinals.pop() if ordinals else 0
        order = {"NHD": _lib.KV_NHD, "HND": _lib.KV_HND}.get(
            a.kv_order.upper() if isinstance(a.kv_order, str) else None)
        if order is None:
            raise ValueError("kv_order must be 'NHD' (token-major pages) or 'HND' "
                             "(head-major pages), got %r" % (a.kv_order,))
        l.kv_order = order
        l.num_kv, l.kv = nkv, kv
        l.num_aux, l.aux = naux, aux
        l.num_state, l.state = nst, st
        keep = [keep_kv, keep_aux, keep_st, group_keep]
        if tags is not None:
            l.kv_tags = ctypes.cast(tags, ctypes.c_void_p)
            keep.append(tags)
        # The arrays are copied by the library; the memory they point to is not.
        return l, tuple(keep), (npages, nslots, nstate)

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

    def descriptor(self):
        """This engine's descriptor (``kvf_engine_descriptor``): one line of
        printable ASCII, at most 511 characters, that a decode engine needs
        to reach this prefill engine without a registry
        (``KVReceiver.remote``).  It names the engine's instance, control
        address, coordinates and layout summary; it is JSON-safe (no quotes,
        no backslashes), so it travels in vLLM's ``kv_transfer_params``.
        Opaque: the handshake checks it again."""
        _lib.require("kvf_engine_descriptor", "KVManager.descriptor")
        buf = ctypes.create_string_buffer(_lib.DESCRIPTOR_MAX)
        check(lib.kvf_engine_descriptor(self._ptr(), buf, len(buf)),
              "kvf_engine_descriptor")
        return buf.value.decode()

    def metrics(self):
        """The engine's metrics as Prometheus text (``kvf_engine_metrics``):
        what its endpoint serves (``metrics_addr``), for an application that
        serves its own ``/metrics``; ``kvferry.metrics.parse`` reads it.
        Every metric is named in docs/OPERATIONS.md.  Any thread."""
        _lib.require("kvf_engine_metrics", "KVManager.metrics")
        need = ctypes.c_size_t(0)
        size = 16384
        for _ in range(4):
            buf = ctypes.create_string_buffer(size)
            st = lib.kvf_engine_metrics(self._ptr(), buf, size, ctypes.byref(need))
            if st == _lib.KVF_OK:
                return buf.value.decode()
            if st != _lib.KVF_ERR_AGAIN:
                check(st, "kvf_engine_metrics")
            size = need.value + need.value // 4     # it may grow meanwhile
        raise KVFerryStateError("kvf_engine_metrics: the text kept growing past %d bytes"
                                % size)

    @property
    def metrics_addr(self):
        """``"host:port"`` of the engine's metrics endpoint, or None when it
        serves none (``KVArgs.metrics_addr``, ``KVF_METRICS_ADDR``)."""
        if not _lib.has("kvf_engine_metrics_addr"):
            return None
        buf = ctypes.create_string_buffer(_lib.ADDR_MAX)
        if lib.kvf_engine_metrics_addr(self._ptr(), buf, len(buf)) != _lib.KVF_OK:
            return None
        return buf.value.decode()

    def stats(self):
        """A snapshot of the engine's counters (``kvf_engine_stats_t``), as a
        dict: ``rooms_by_state`` a list indexed by poll state,
        ``peers_by_path`` a dict by transport name (``"tcp"``, ``"cuda"``,
        ``"shm"``, ``"ucx"``), the other counters by their field names."""
        s = _lib.new_stats()
        check(lib.kvf_engine_stats(self._ptr(), ctypes.byref(s)), "kvf_engine_stats")
        d = {f: getattr(s, f) for f, _ in _lib.EngineStats._fields_
             if f not in ("size", "rooms_by_state", "peers_by_path")}
        d["rooms_by_state"] = list(s.rooms_by_state)
        d["peers_by_path"] = {name: s.peers_by_path[i]
                              for i, name in enumerate(_lib.transport_names())}
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

    ``BootstrapServer(host="127.0.0.1", port=0, api_key=None)``; ``.port``
    is the port it listens on, ``.addr`` ``"host:port"``, ``.access`` who
    may register: ``"token"`` (the cluster token from ``KVF_AUTH_TOKEN``,
    ``KVF_AUTH_TOKEN_FILE`` or ``SGLANG_DISAGGREGATION_BOOTSTRAP_AUTH_TOKEN``
    in the environment, else ``api_key``, SGLang's ``--api-key``),
    ``"protected"`` (no token: clients on this host only; a non-loopback
    host is refused) or ``"open"`` (``KVF_AUTH=none``).  Context manager,
    ``close()``.
    """

    def __init__(self, host="127.0.0.1", port=0, api_key=None):
        self.host = host
        ptr = ctypes.c_void_p()
        if api_key:
            _lib.require("kvf_bootstrap_create_keyed", "BootstrapServer(api_key=...)")
            st = lib.kvf_bootstrap_create_keyed(_str("host", host),
                                                to_uint("port", port, 16),
                                                _str("api_key", api_key),
                                                ctypes.byref(ptr))
        else:
            st = lib.kvf_bootstrap_create(_str("host", host), to_uint("port", port, 16),
                                          ctypes.byref(ptr))
        check(st, "kvf_bootstrap_create(%s, %s)" % (host, port))
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
    try:
        return v.encode()
    except UnicodeEncodeError as e:
        raise ValueError("%s holds a lone surrogate at position %d: it has no UTF-8 form"
                         % (name, e.start)) from None


def _addr(name, v):
    b = _str(name, v)
    host, sep, port = v.rpartition(":")
    if not sep or not host or not (port.isascii() and port.isdigit()) \
            or int(port) > 65535:
        raise ValueError("%s must be 'host:port', got %r" % (name, v))
    return b


def _read_addr(fn, ptr, what, hint=None):
    buf = ctypes.create_string_buffer(_lib.ADDR_MAX)
    check(fn(ptr, buf, len(buf)), what, hint)
    return buf.value.decode()
