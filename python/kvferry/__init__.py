"""kvferry: move LLM KV cache from prefill to decode servers, room by room.

A thin ctypes binding over ``libkvferry`` shaped like SGLang's
disaggregation interfaces (``KVManager``, ``KVSender``, ``KVReceiver``,
``KVPoll``, ``KVArgs``, ``KVTransferError``).  Standard library only.
See docs/PYTHON.md; ``kvferry.sglang`` holds SGLang's transfer-backend
classes over it (docs/SGLANG.md), ``kvferry.vllm`` vLLM's KV connector
(docs/VLLM.md).

The shared library is looked up in ``$KVFERRY_LIBRARY``, next to this
package, then in the repository's ``build/`` directory.
"""
from ._lib import lib as _clib
from .args import KVArgs, KVPoll, StateGroup
from .errors import (KVFerryError, KVFerryRuntimeError, KVFerryStateError,
                     KVFerryValueError, KVTransferError)
from .manager import BootstrapServer, KVManager, room_key
from .room import KVReceiver, KVSender
from ._lib import path as library_path

__all__ = ["KVArgs", "KVPoll", "StateGroup", "KVManager", "KVSender", "KVReceiver",
           "BootstrapServer", "room_key", "KVTransferError", "KVFerryError",
           "KVFerryValueError", "KVFerryStateError", "KVFerryRuntimeError",
           "library_version", "library_path", "set_log_level"]

__version__ = "0.1.0"

_LEVELS = {"error": 0, "warn": 1, "warning": 1, "info": 2, "debug": 3}


def library_version():
    """The C library's version string (``kvf_version()``)."""
    return _clib.kvf_version().decode()


def set_log_level(level):
    """Set the C library's stderr log level: ``"error"``, ``"warn"``,
    ``"info"`` or ``"debug"`` (default from ``$KVF_LOG``, else warn)."""
    try:
        _clib.kvf_log_set_level(_LEVELS[str(level).lower()])
    except KeyError:
        raise ValueError("level must be one of error, warn, info, debug; got %r"
                         % (level,)) from None
