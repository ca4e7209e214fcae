"""``KVSender`` (prefill side of a room) and ``KVReceiver`` (decode side).

Both follow SGLang's ``BaseKVSender``/``BaseKVReceiver``: created per
request, ``init`` once, ``poll()`` every scheduler step (one atomic load
in C), and on ``KVPoll.Failed`` ``failure_exception()`` raises the room's
``KVTransferError``.  Every call is non-blocking.  A handle is released by
``close()`` (also on garbage collection or when its manager closes);
closing a live room aborts it on every rank.
"""
import array
import ctypes
import weakref

from . import _lib
from ._convert import (addr_problem, as_c_u32, check_index, check_range, to_u32_array,
                       to_uint)
from ._lib import lib
from .args import KVPoll
from .errors import KVFerryStateError, KVTransferError, check
from .manager import KVManager, _Closing

__all__ = ["KVSender", "KVReceiver"]

_POLL = tuple(KVPoll)


def _destroy_room(destroy, ptr, engine, key):
    destroy(ptr)
    engine.untrack(key)


class _Room(_Closing):
    """What senders and receivers share: the handle, poll, failure, close."""

    _kind = None        # "sender" / "receiver"
    _role = None        # required manager role

    def _open(self, mgr, bootstrap_room, create):
        if not isinstance(mgr, KVManager):
            raise TypeError("mgr must be a kvferry.KVManager, got %s"
                            % type(mgr).__name__)
        if mgr.role != self._role:
            raise ValueError("a %s needs a %s KVManager, got a %s one"
                             % (type(self).__name__, _lib.role_name(self._role), mgr.mode))
        self.bootstrap_room = to_uint("bootstrap_room", bootstrap_room, 64)
        self.mgr = mgr
        self._engine = mgr._engine
        self._failure = None
        ptr = ctypes.c_void_p()
        check(create(self._engine.live(), ptr), "%s for room %d"
              % ("kvf_%s_create" % self._kind, self.bootstrap_room))
        self._ptr = ptr.value
        destroy = getattr(lib, "kvf_%s_destroy" % self._kind)
        key = self._engine.key()
        self._fin = weakref.finalize(self, _destroy_room, destroy, ptr.value,
                                     self._engine, key)
        self._engine.track(key, self._fin)
        self._poll_fn = getattr(lib, "kvf_%s_poll" % self._kind)

    def _live(self):
        if not self._fin.alive:
            raise KVFerryStateError("%s of room %d is closed%s"
                                    % (type(self).__name__, self.bootstrap_room,
                                       " (its KVManager was closed)"
                                       if self._engine.ptr is None else ""))
        return self._ptr

    def _aux(self, aux_index):
        if aux_index is None:
            if self.mgr.num_aux_slots:
                raise ValueError("aux_index is required: this manager registered "
                                 "aux buffers")
            return 0
        aux = to_uint("aux_index", aux_index, 32)
        if self.mgr.num_aux_slots:
            check_index("aux_index", aux, self.mgr.num_aux_slots, "aux slots")
        return aux

    def poll(self):
        """The room's ``KVPoll`` state.  Cheap: call it every step.  A closed
        handle polls ``Failed``."""
        if not self._fin.alive:
            return KVPoll.Failed
        return _POLL[self._poll_fn(self._ptr)]

    def abort(self):
        """Fail the room here and on all its peers (no-op once final)."""
        getattr(lib, "kvf_%s_abort" % self._kind)(self._live())

    def fail(self, reason, code=_lib.KVF_ERR_ABORTED):
        """Fail the room here with the application's own root cause:
        ``reason`` (text) and ``code`` (a negative kvferry status, e.g.
        ``kvferry.errors`` ``KVF_ERR_BAD_INDICES`` for a refused index).
        Every rank of the room, on both sides, names it as the cause
        (no-op once final)."""
        name = "kvf_%s_fail" % self._kind
        _lib.require(name, "%s.fail" % type(self).__name__)
        text = str(reason).encode("utf-8", "backslashreplace")
        check(getattr(lib, name)(self._live(), int(code), text), name)

    def await_failure(self, timeout):
        """Wait up to ``timeout`` seconds for the room to fail: for a rank
        told by its scheduler that the request failed on another rank of
        its side, before that rank's cause has reached this one (it does
        within milliseconds).  The call says this side failed: a room that
        succeeded here fails at once with a cause it kept from the other
        side.  Waits on an event.  Returns True when the room has failed
        (``failure_exception()`` then raises its cause)."""
        name = "kvf_%s_await_failure" % self._kind
        if not _lib.has(name):
            return self.poll() == KVPoll.Failed
        ms = max(0, min(int(float(timeout) * 1000), 3600 * 1000))
        return getattr(lib, name)(self._live(), ms) == _lib.KVF_OK

    def failure_exception(self):
        """Raise the room's ``KVTransferError`` (call after ``poll()`` returned
        ``KVPoll.Failed``).

        The first call consumes the room's failure record and raises it;
        later calls raise a ``KVTransferError`` that says the record was
        already consumed and repeats what it said (``already_consumed``
        is True).  Raises ``KVFerryStateError`` when the room has not failed.
        """
        if self._failure is not None:
            f = self._failure
            raise KVTransferError(
                self.bootstrap_room,
                "the failure record of room %d was already consumed by an earlier "
                "failure_exception() call; it said: %s"
                % (self.bootstrap_room, f.failure_reason),
                f.is_from_another_rank, f.origin_side, f.origin_rank, f.origin_addr,
                f.code, already_consumed=True)
        rec = _lib.new_failure()
        st = getattr(lib, "kvf_%s_failure" % self._kind)(self._live(), ctypes.byref(rec))
        if st == _lib.KVF_OK:
            self._failure = KVTransferError._from_record(self.bootstrap_room, rec)
            raise self._failure
        if st == _lib.KVF_ERR_NOT_FOUND:
            raise KVTransferError(self.bootstrap_room,
                                  "the failure record of room %d was already consumed"
                                  % self.bootstrap_room, code=st, already_consumed=True)
        if st == _lib.KVF_ERR_AGAIN:
            raise KVFerryStateError(
                "room %d has not failed (poll() is %s): call failure_exception() "
                "only after poll() returned KVPoll.Failed"
                % (self.bootstrap_room, self.poll().name), st)
        check(st, "kvf_%s_failure" % self._kind)

    def close(self):
        """Release the handle (aborting the room if it is still live).
        Idempotent; also done on garbage collection and by the manager's
        ``close()``."""
        self._fin()

    def __repr__(self):
        return "<kvferry.%s room %d %s>" % (type(self).__name__, self.bootstrap_room,
                                            self.poll().name)


class KVSender(_Room):
    """The prefill side of one room (SGLang's ``BaseKVSender``).

    ``KVSender(mgr, bootstrap_addr, bootstrap_room, dest_tp_ranks=None,
    pp_rank=None)``: ``mgr`` is a prefill ``KVManager``; ``bootstrap_addr``
    is informational (the engine's registry is used); ``dest_tp_ranks`` and
    ``pp_rank`` are accepted for SGLang compatibility and ignored (kvferry
    learns its destinations from the decode ranks).  Bootstrapping until
    every decode rank this rank feeds has sent its destination, then
    WaitingForInput: call ``init`` then ``send`` per chunk.
    """

    _kind = "sender"
    _role = _lib.ROLE_PREFILL

    def __init__(self, mgr, bootstrap_addr, bootstrap_room, dest_tp_ranks=None,
                 pp_rank=None):
        addr = None
        if bootstrap_addr is not None:
            addr = _bootstrap_addr(bootstrap_addr).encode()
        self.bootstrap_addr = bootstrap_addr
        self.num_kv_indices = None
        self.curr_idx = 0
        self._layered = False
        self._open(mgr, bootstrap_room,
                   lambda eng, p: lib.kvf_sender_create(
                       eng, addr, self.bootstrap_room, ctypes.byref(p)))

    @classmethod
    def held(cls, mgr, bootstrap_room, instance=0, lease_s=None):
        """A sender that holds its pages for readers that come later
        (``kvf_sender_create_held``; vLLM's flow: the prefill computes first,
        the decode reads afterwards).  ``init`` and ``send`` are accepted at
        once, while ``poll()`` still shows Bootstrapping: the pages move once
        every decode rank that reads the room asked
        (``KVReceiver.remote``).  ``instance``: the instance a reader must
        name (``room_key()``'s second value; 0: any reader).  ``lease_s``:
        seconds within which every reader must have asked, else the room
        fails with status ``KVF_ERR_LEASE_EXPIRED`` and its pages may be
        reused; None: ``$KVF_LEASE_MS``, else 480 s (vLLM's abort timeout).
        Either way, once ``poll()`` is final the pages may be freed."""
        _lib.require("kvf_sender_create_held", "KVSender.held")
        h = _lib.new_hold()
        h.instance = to_uint("instance", instance, 64)
        if lease_s is not None:
            if isinstance(lease_s, bool) or not isinstance(lease_s, (int, float)) \
                    or not lease_s > 0:
                raise ValueError("lease_s must be a positive number of seconds, got %r"
                                 % (lease_s,))
            ms = int(-(-lease_s * 1000 // 1))          # ceil: never shorter
            h.lease_ms = to_uint("lease_s (in ms)", ms, 32)
        self = cls.__new__(cls)
        self.bootstrap_addr = None
        self.num_kv_indices = None
        self.curr_idx = 0
        self._layered = False
        self.instance = h.instance
        self._open(mgr, bootstrap_room,
                   lambda eng, p: lib.kvf_sender_create_held(
                       eng, self.bootstrap_room, ctypes.byref(h), ctypes.byref(p)))
        return self

    def init(self, num_kv_indices, aux_index=None):
        """Declare the room: ``num_kv_indices`` KV pages in total and the
        source ``aux_index`` slot (may be None only when no aux buffers are
        registered).  Once.  ``num_kv_indices`` may be 0 (the decode side
        holds the whole prompt: aux and state move on a last ``send([])``)."""
        n = to_uint("num_kv_indices", num_kv_indices, 32)
        aux = self._aux(aux_index)
        check(lib.kvf_sender_init(self._live(), n, aux),
              "KVSender.init(room %d)" % self.bootstrap_room,
              "init is allowed once per room")
        self.num_kv_indices = n

    def send(self, kv_indices, state_indices=None, *, is_last=None):
        """Send one prefill chunk: the next ``len(kv_indices)`` pages of the
        room, by source page index.  Non-blocking; the pages must stay
        unchanged until the room is final.

        ``is_last`` (keyword): whether this is the last chunk; by default
        (None) it is when the pages sent reach ``num_kv_indices``, as in
        SGLang.  ``state_indices``: source state slots (one per registered
        state buffer), given with or before the last chunk.
        Raises ValueError/TypeError for bad indices, KVFerryStateError when
        the room is not WaitingForInput/Transferring, is not initialised,
        or already sent its last chunk.
        """
        ptr = self._live()
        if self.num_kv_indices is None:
            raise KVFerryStateError("KVSender.send(room %d): call init() first"
                                    % self.bootstrap_room)
        pages = to_u32_array("kv_indices", kv_indices, allow_empty=True)
        check_range("kv_indices", pages, self.mgr.num_pages, "KV pages")
        if self._layered and is_last is None:
            raise ValueError("KVSender.send(room %d) after send_layers: say is_last "
                             "(the library checks the pages of every layer)"
                             % self.bootstrap_room)
        if not self._layered and self.curr_idx + len(pages) > self.num_kv_indices:
            raise ValueError("kv_indices: %d pages sent plus %d more exceeds the "
                             "%d declared in init()"
                             % (self.curr_idx, len(pages), self.num_kv_indices))
        if is_last is None:
            is_last = self.curr_idx + len(pages) == self.num_kv_indices
        elif not isinstance(is_last, bool):
            raise TypeError("is_last must be a bool, got %s" % type(is_last).__name__)
        if state_indices is not None:
            self.set_states(state_indices)
        check(lib.kvf_sender_send(ptr, as_c_u32(pages), len(pages), int(is_last)),
              "KVSender.send(room %d)" % self.bootstrap_room,
              "send is allowed after init(), once poll() reached WaitingForInput, "
              "until the last chunk")
        self.curr_idx += len(pages)


    def send_layers(self, kv_indices, first_page, layer_begin, layer_end, group=0):
        """Send pages ``[first_page, first_page + len(kv_indices))`` of the
        room for layers ``[layer_begin, layer_end)`` of ``group`` only, as soon
        as they are computed (``kvf_sender_send_layers``; docs/GUIDE.md,
        "Layer-wise sends").  Layers are the model's (group 0; a pipeline
        stage names its own) or a draft model's (group 1, ...).  Each layer's
        pages in page order, each once; a page position names the same
        source page for every layer.  End the room with
        ``send(rest, is_last=True)``: ``rest`` the last pages of every layer,
        or empty when the layer sends gave them all; one that leaves a layer
        short fails the room, naming it.  Raises ValueError/TypeError for bad
        indices, KVFerryStateError as ``send`` does."""
        _lib.require("kvf_sender_send_layers", "KVSender.send_layers")
        ptr = self._live()
        if self.num_kv_indices is None:
            raise KVFerryStateError("KVSender.send_layers(room %d): call init() first"
                                    % self.bootstrap_room)
        pages = to_u32_array("kv_indices", kv_indices)
        check_range("kv_indices", pages, self.mgr.num_pages, "KV pages")
        args = [to_uint(name, v, 32) for name, v in (
            ("first_page", first_page), ("group", group), ("layer_begin", layer_begin),
            ("layer_end", layer_end))]
        check(lib.kvf_sender_send_layers(ptr, as_c_u32(pages), len(pages), *args),
              "KVSender.send_layers(room %d)" % self.bootstrap_room,
              "each layer's pages once, in page order, after init(), until the last send")
        self._layered = True

    def set_states(self, state_indices):
        """Source state indices, written with the last chunk.  With
        ``KVArgs.state_groups``: one entry per group, each a list of indices
        (None or empty: nothing for that group); index k goes to the decode's
        index k of the same group.  With ``state_data_ptrs``: one slot per
        state buffer.  Once, before the last chunk."""
        ptr = self._live()
        if self.mgr.state_group_items:
            arr, keep = _state_indices(self.mgr, state_indices)
            _lib.require("kvf_sender_set_states", "KVSender.set_states (state groups)")
            check(lib.kvf_sender_set_states(ptr, arr, len(keep)),
                  "KVSender.set_states(room %d)" % self.bootstrap_room,
                  "give one index list per state group, before the last chunk")
            return
        slots = to_u32_array("state_indices", state_indices, allow_empty=True)
        check_range("state_indices", slots, self.mgr.num_state_slots or 1,
                    "state slots")
        check(lib.kvf_sender_set_state(ptr, as_c_u32(slots), len(slots)),
              "KVSender.send(room %d): state_indices" % self.bootstrap_room,
              "give one slot per registered state buffer, before the last chunk")

    def decode_prefix_len(self):
        """Tokens of the request the decode side already holds (its prefix
        cache), or None while not every decode rank's destination arrived
        (``kvf_sender_decode_prefix_len``).  The prefill sends only the rest."""
        _lib.require("kvf_sender_decode_prefix_len", "KVSender.decode_prefix_len")
        v = ctypes.c_uint32()
        st = lib.kvf_sender_decode_prefix_len(self._live(), ctypes.byref(v))
        if st == _lib.KVF_ERR_AGAIN:
            return None
        check(st, "KVSender.decode_prefix_len(room %d)" % self.bootstrap_room)
        return v.value

    def metric(self):
        """What the room cost so far: ``{"bytes", "alloc_s", "transfer_s"}``
        (``kvf_sender_metric``); None when the library has no metrics."""
        return _metric(self, "kvf_sender_metric")


def _metric(room, fn):
    if not _lib.has(fn) or not room._fin.alive:
        return None
    m = _lib.RoomMetric()
    m.size = ctypes.sizeof(m)
    check(getattr(lib, fn)(room._ptr, ctypes.byref(m)), fn)
    return {"bytes": m.bytes, "alloc_s": m.alloc_s, "transfer_s": m.transfer_s}


def _state_indices(mgr, state_indices):
    """``kvf_indices_t[]`` for a manager with state groups: one entry per
    group (None or empty: nothing); returns the array and the index arrays
    it points into (keep them alive for the call)."""
    groups = mgr.state_group_items
    lists = list(state_indices) if state_indices is not None else []
    if len(lists) != len(groups):
        raise ValueError("state_indices has %d entries but this manager registered "
                         "%d state groups: give one index list (or None) per group"
                         % (len(lists), len(groups)))
    arr = (_lib.Indices * max(len(groups), 1))()
    keep = []
    for g, v in enumerate(lists):
        a = to_u32_array("state_indices[%d]" % g, [] if v is None else v,
                         allow_empty=True)
        check_range("state_indices[%d]" % g, a, groups[g], "indices of state group %d" % g)
        arr[g].idx, arr[g].n = as_c_u32(a), len(a)
        keep.append(a)
    return arr, keep


class KVReceiver(_Room):
    """The decode side of one room (SGLang's ``BaseKVReceiver``).

    ``KVReceiver(mgr, bootstrap_addr, bootstrap_room, prefill_dp_rank=None)``:
    ``mgr`` is a decode ``KVManager``; ``bootstrap_addr`` the prefill
    server's registry ``"host:port"``; ``prefill_dp_rank`` the prefill DP
    group (None: the registry's choice, ``room % dp_size``).  The registry
    lookup and connection run on the engine's threads.
    """

    _kind = "receiver"
    _role = _lib.ROLE_DECODE

    def __init__(self, mgr, bootstrap_addr, bootstrap_room, prefill_dp_rank=None):
        _bootstrap_addr(bootstrap_addr)
        dp = -1 if prefill_dp_rank is None else to_uint("prefill_dp_rank",
                                                        prefill_dp_rank, 31)
        self.bootstrap_addr = bootstrap_addr
        self._open(mgr, bootstrap_room,
                   lambda eng, p: lib.kvf_receiver_create(
                       eng, bootstrap_addr.encode(), self.bootstrap_room, dp,
                       ctypes.byref(p)))

    @classmethod
    def remote(cls, mgr, bootstrap_room, descriptors, instance=0):
        """The receiver of a room that prefill ranks hold
        (``KVSender.held``), reached by their ``descriptors``
        (``KVManager.descriptor()`` of each, any order: every TP rank of the
        prefill server, or at least those this rank reads), without a
        registry (``kvf_receiver_create_remote``).  The engine picks the
        ranks it reads; ``instance`` is the one the room is held under
        (``room_key()``'s; 0: any).  Then ``set_dest`` as usual, whose
        ``decode_prefix_len`` (a whole number of pages) skips the held
        pages this decode already holds."""
        if isinstance(descriptors, (str, bytes)):
            raise TypeError("descriptors must be a list of descriptor strings, got a "
                            "single %s" % type(descriptors).__name__)
        try:
            descs = list(descriptors)
        except TypeError:
            raise TypeError("descriptors must be a list of str, got %s"
                            % type(descriptors).__name__) from None
        if not descs:
            raise ValueError("descriptors is empty: give the descriptor of every "
                             "prefill rank that holds the room")
        raw = []
        for i, d in enumerate(descs):
            if not isinstance(d, str):
                raise TypeError("descriptors[%d] must be a str, got %s"
                                % (i, type(d).__name__))
            if "\0" in d or len(d) >= _lib.DESCRIPTOR_MAX or not d.isascii():
                raise ValueError("descriptors[%d] is not a kvferry descriptor (a NUL, a "
                                 "non-ASCII character, or longer than %d characters)"
                                 % (i, _lib.DESCRIPTOR_MAX - 1))
            raw.append(d.encode())
        _lib.require("kvf_receiver_create_remote", "KVReceiver.remote")
        rm = _lib.new_remote()
        arr = (ctypes.c_char_p * len(raw))(*raw)
        rm.instance = to_uint("instance", instance, 64)
        rm.descriptors, rm.num_descriptors = arr, len(raw)
        self = cls.__new__(cls)
        self.bootstrap_addr = None
        self.descriptors = descs
        self.instance = rm.instance

        def create(eng, p):
            rm.room = self.bootstrap_room
            return lib.kvf_receiver_create_remote(eng, ctypes.byref(rm), ctypes.byref(p))
        self._open(mgr, bootstrap_room, create)
        return self

    def pages_released(self):
        """True once the room is final and no write into its destination
        pages can still land: only then give the pages to another request
        (``kvf_receiver_pages_released``).  A closed receiver's pages are
        released (destroy waits for in-flight writes)."""
        if not self._fin.alive:
            return True
        return bool(lib.kvf_receiver_pages_released(self._ptr))

    def set_dest(self, kv_indices, aux_index=None, state_indices=None,
                 decode_prefix_len=0):
        """Give the room its destination, once (``kvf_receiver_set_dest``):
        decode page indices (one per page the prefill sends, in order, no
        duplicates; may be empty on a full prefix hit), the ``aux_index``
        slot, ``state_indices`` (with state groups: one index list or None
        per group; else one slot per state buffer) and ``decode_prefix_len``,
        the tokens this decode already holds (the prefill sends only the
        rest, and ``kv_indices`` are the rest's pages).  Allowed in any state
        before final; SGLang gives it once ``poll()`` showed WaitingForInput."""
        ptr = self._live()
        pages = to_u32_array("kv_indices", kv_indices, allow_empty=True)
        check_range("kv_indices", pages, self.mgr.num_pages, "KV pages")
        _check_distinct(pages)
        aux = self._aux(aux_index)
        prefix = to_uint("decode_prefix_len", decode_prefix_len or 0, 32)
        if not _lib.has("kvf_receiver_set_dest"):
            if prefix or not pages or self.mgr.state_group_items:
                _lib.require("kvf_receiver_set_dest",
                             "KVReceiver.set_dest with a decode prefix, no pages or "
                             "state groups")
            return self.init(pages, aux_index, state_indices)
        d = _lib.new_dest()
        d.pages, d.num_pages = as_c_u32(pages), len(pages)
        d.aux_slot = aux
        d.decode_prefix_len = prefix
        keep = None
        if self.mgr.state_group_items:
            arr, keep = _state_indices(self.mgr, state_indices)
            d.states, d.num_states = arr, len(keep)
        elif state_indices is not None:
            # Legacy state buffers: one slot each, as one index per entry.
            slots = to_u32_array("state_indices", state_indices, allow_empty=True)
            if self.mgr.num_state_slots:
                check_range("state_indices", slots, self.mgr.num_state_slots,
                            "state slots")
            keep = [array.array("I", [v]) for v in slots]
            arr = (_lib.Indices * max(len(keep), 1))()
            for i, one in enumerate(keep):
                arr[i].idx, arr[i].n = as_c_u32(one), 1
            d.states, d.num_states = arr, len(keep)
        check(lib.kvf_receiver_set_dest(ptr, ctypes.byref(d)),
              "KVReceiver.set_dest(room %d)" % self.bootstrap_room,
              "the destination is given once per room, before it is final")
        del keep

    def metric(self):
        """What the room cost so far: ``{"bytes", "alloc_s", "transfer_s"}``
        (``kvf_receiver_metric``); None when the library has no metrics."""
        return _metric(self, "kvf_receiver_metric")

    def init(self, kv_indices, aux_index=None, state_indices=None):
        """Declare the destination: decode page indices (one per prefill page,
        in order, no duplicates), the ``aux_index`` slot (None only without
        aux buffers) and optional ``state_indices`` (one per state buffer).
        Once."""
        ptr = self._live()
        pages = to_u32_array("kv_indices", kv_indices)
        check_range("kv_indices", pages, self.mgr.num_pages, "KV pages")
        _check_distinct(pages)
        aux = self._aux(aux_index)
        slots = to_u32_array("state_indices", [] if state_indices is None
                             else state_indices, allow_empty=True)
        if self.mgr.num_state_slots:
            check_range("state_indices", slots, self.mgr.num_state_slots, "state slots")
        check(lib.kvf_receiver_init(ptr, as_c_u32(pages), len(pages), aux,
                                    as_c_u32(slots), len(slots)),
              "KVReceiver.init(room %d)" % self.bootstrap_room,
              "init is allowed once per room, with one state slot per state buffer")


def _bootstrap_addr(v):
    """``v`` when it is a registry address the library takes, else TypeError
    (not a str) or ValueError saying what is wrong with it."""
    if not isinstance(v, str):
        raise TypeError("bootstrap_addr must be a str 'host:port', got %s" % type(v).__name__)
    why = addr_problem(v)
    if why is not None:
        raise ValueError("bootstrap_addr %s (%r)" % (why, v[:80]))
    return v


def _check_distinct(pages):
    if len(set(pages)) != len(pages):
        first = {}
        pos = next(i for i, v in enumerate(pages) if first.setdefault(v, i) != i)
        raise ValueError("kv_indices[%d] = %d appears twice (kv_indices[%d] too): decode "
                         "pages must be distinct" % (pos, pages[pos], first[pages[pos]]))
