"""Exceptions of the kvferry binding.

Two families, kept apart on purpose:

* A **refused call** (bad argument, wrong state) raises a ``KVFerryError``
  subclass at the call site, before anything happened.  Each one is also a
  built-in exception, so ordinary ``except ValueError`` code works:

  ==========================  ===============================  ==============
  class                       C statuses                       also a
  ==========================  ===============================  ==============
  ``KVFerryValueError``       INVALID_PARAM, OUT_OF_RANGE      ``ValueError``
  ``KVFerryStateError``       STATE, ROOM_IN_USE, NOT_FOUND,   ``RuntimeError``
                              AGAIN, LEASE_EXPIRED; use after
                              ``close()``
  ``KVFerryRuntimeError``     everything else (IO, NO_MEMORY,  ``RuntimeError``
                              UNSUPPORTED, ...)
  ==========================  ===============================  ==============

  Wrong Python types raise plain ``TypeError`` and values the binding can
  reject itself (a negative page index) plain ``ValueError``.

* A **failed room** never makes a call fail: ``poll()`` returns
  ``KVPoll.Failed`` and ``failure_exception()`` raises ``KVTransferError``
  with the room's failure record (SGLang's exception, plus the origin).
  A held room (``KVSender.held``) nobody read in time fails with
  ``status == "KVF_ERR_LEASE_EXPIRED"`` (``lease_expired`` is True); a
  reader that named another request's instance, with
  ``"KVF_ERR_ROOM_CONFLICT"``.
"""
from . import _lib

__all__ = ["KVFerryError", "KVFerryValueError", "KVFerryStateError",
           "KVFerryRuntimeError", "KVTransferError"]


class KVFerryError(Exception):
    """Base class of every kvferry exception.

    ``status`` is the C status name (``"KVF_ERR_STATE"``), ``code`` its
    integer value, ``status_str`` its one-line description.
    """

    def __init__(self, message, code=None):
        super().__init__(message)
        self.code = code
        self.status = _lib.status_name(code) if code is not None else None
        self.status_str = _lib.status_str(code) if code is not None else None


class KVFerryValueError(KVFerryError, ValueError):
    """The library refused an argument (KVF_ERR_INVALID_PARAM / OUT_OF_RANGE)."""


class KVFerryStateError(KVFerryError, RuntimeError):
    """The call is not allowed now (KVF_ERR_STATE, ROOM_IN_USE, ...)."""


class KVFerryRuntimeError(KVFerryError, RuntimeError):
    """Any other refusal: I/O (bind failed), out of memory, unsupported."""


_BY_CODE = {
    _lib.KVF_ERR_INVALID_PARAM: KVFerryValueError,
    _lib.KVF_ERR_OUT_OF_RANGE: KVFerryValueError,
    _lib.KVF_ERR_STATE: KVFerryStateError,
    _lib.KVF_ERR_ROOM_IN_USE: KVFerryStateError,
    _lib.KVF_ERR_NOT_FOUND: KVFerryStateError,
    _lib.KVF_ERR_AGAIN: KVFerryStateError,
    _lib.KVF_ERR_LEASE_EXPIRED: KVFerryStateError,
}


def check(code, what, hint=None):
    """Raise the exception for a non-zero C status of call ``what``.

    The message reads ``"<what>: <kvf_status_str> (<KVF_ERR_NAME>): <the
    library's own reason, kvf_last_error()>[. hint]"``.
    """
    if code == _lib.KVF_OK:
        return
    msg = "%s: %s (%s)" % (what, _lib.status_str(code), _lib.status_name(code))
    # Refusals of these kinds always say why (kvf_last_error); AGAIN and
    # NOT_FOUND are answers, not refusals, and say nothing new.
    if code not in (_lib.KVF_ERR_AGAIN, _lib.KVF_ERR_NOT_FOUND):
        detail = (_lib.lib.kvf_last_error() or b"").decode(errors="replace")
        if detail:
            msg += ": " + detail
    if hint:
        msg += ". " + hint
    raise _BY_CODE.get(code, KVFerryRuntimeError)(msg, code)


class KVTransferError(KVFerryError):
    """A room failed (SGLang's ``KVTransferError``, with kvferry's extras).

    Attributes:
        bootstrap_room: the room id.
        failure_reason: the root cause, as text.  For a failure learned from
            a peer it is the peer's original reason, not "unknown reason".
        is_from_another_rank: True when this rank only learned of the
            failure from another rank (the root cause is elsewhere).
        origin_side: ``"prefill"`` or ``"decode"``: side of the rank that saw
            the root cause.
        origin_rank: its tp rank.
        origin_addr: its control address ``host:port``.
        status: the C status name of the root cause (``kvf_status_name``),
            e.g. ``"KVF_ERR_PEER_TIMEOUT"``; ``code`` is its integer.
        already_consumed: True when this exception reports a second
            ``failure_exception()`` call on the same room (the record is
            consumed by the first one; the fields repeat what it said).
    """

    def __init__(self, bootstrap_room, failure_reason, is_from_another_rank=False,
                 origin_side=None, origin_rank=None, origin_addr=None, code=None,
                 already_consumed=False):
        self.bootstrap_room = bootstrap_room
        self.failure_reason = failure_reason
        self.is_from_another_rank = bool(is_from_another_rank)
        self.origin_side = origin_side
        self.origin_rank = origin_rank
        self.origin_addr = origin_addr
        self.already_consumed = already_consumed
        KVFerryError.__init__(self, failure_reason, code)
        self.args = (bootstrap_room, failure_reason)

    @property
    def lease_expired(self):
        """True when a held room failed because its lease ended before every
        reader came (``KVF_ERR_LEASE_EXPIRED``): its pages may be freed."""
        return self.code == _lib.KVF_ERR_LEASE_EXPIRED

    def __reduce__(self):
        # Picklable (multiprocessing schedulers pass exceptions around).
        return (self.__class__, (self.bootstrap_room, self.failure_reason,
                                 self.is_from_another_rank, self.origin_side,
                                 self.origin_rank, self.origin_addr, self.code,
                                 self.already_consumed))

    def __str__(self):
        s = "KVTransferError(bootstrap_room=%s): %s" % (self.bootstrap_room,
                                                        self.failure_reason)
        extra = []
        if self.status:
            extra.append(self.status)
        if self.origin_side is not None:
            extra.append("origin %s rank %s at %s" % (self.origin_side, self.origin_rank,
                                                      self.origin_addr or "?"))
        if self.is_from_another_rank:
            extra.append("learned from another rank")
        return s + (" [%s]" % ", ".join(extra) if extra else "")

    @classmethod
    def _from_record(cls, room, rec):
        return cls(room, rec.reason.decode(errors="replace"),
                   rec.from_another_rank != 0, _lib.role_name(rec.origin_side),
                   rec.origin_rank, rec.origin_addr.decode(errors="replace"),
                   rec.status)
