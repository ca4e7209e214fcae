"""Finding libkvferry and declaring its C API for ctypes.

This is the only module that knows the C header: the struct layouts
mirror ``include/kvferry/kvferry.h`` field for field (each class's docstring
names its C struct first), the status codes and constants are the header's,
and python/tests/test_abi_binding.py holds all of them to what the C
compiler sees (offset and size of every field, by name).  Every function
gets its ``argtypes``/``restype`` here so that a wrong Python value is a
``ctypes.ArgumentError`` instead of a corrupted call.  The parameter structs
follow the header's growth rules: the binding passes its own struct size to
``kvf_engine_params_init_sized``/``kvf_layout_init_sized``, and the library
reads and writes only that many bytes: a library newer than this file
gives the fields this file lacks their defaults, and one older than it
refuses a field it lacks only when the binding sets that field.

Search order for the shared library (first hit wins):

1. ``$KVFERRY_LIBRARY`` — an explicit path (must exist);
2. ``libkvferry.so`` next to this file (what ``pip install`` bundles);
3. ``<repo>/build/libkvferry.so`` — the development tree's build.
"""
import ctypes
import os
from ctypes import (POINTER, Structure, c_char, c_char_p, c_int, c_size_t,
                    c_uint, c_uint32, c_uint64, c_void_p)

LIBRARY_ENV = "KVFERRY_LIBRARY"
LIBRARY_NAME = "libkvferry.so"

# Sizes fixed by the header.
REASON_MAX = 512
ADDR_MAX = 64
PATHS_MAX = 8               # KVF_PATHS_MAX: peers_by_path slots

# Status codes: the whole table of include/kvferry/status.h.
# python/tests/test_abi_binding.py holds this list to the header both ways,
# and _declare() refuses a library that gives one of these values another
# name.
KVF_OK = 0
KVF_ERR_INVALID_PARAM = -1
KVF_ERR_NO_MEMORY = -2
KVF_ERR_STATE = -3
KVF_ERR_OUT_OF_RANGE = -4
KVF_ERR_ROOM_IN_USE = -5
KVF_ERR_IO = -6
KVF_ERR_NOT_FOUND = -7
KVF_ERR_UNSUPPORTED = -8
KVF_ERR_AGAIN = -9
KVF_ERR_TIMED_OUT = -20
KVF_ERR_ABORTED = -21
KVF_ERR_BAD_INDICES = -22
KVF_ERR_INCOMPLETE = -23
KVF_ERR_CHECKSUM = -24
KVF_ERR_ROOM_CONFLICT = -25
KVF_ERR_BOOTSTRAP = -26
KVF_ERR_LEASE_EXPIRED = -27
KVF_ERR_CONN_RESET = -40
KVF_ERR_UNREACHABLE = -41
KVF_ERR_PEER_TIMEOUT = -42
KVF_ERR_PROTOCOL = -43
KVF_ERR_INCOMPATIBLE = -44
KVF_ERR_VERSION = -45
KVF_ERR_PEER_RESTARTED = -46
KVF_ERR_AUTH = -47

DESCRIPTOR_MAX = 512        # KVF_DESCRIPTOR_MAX, the NUL included
TOKEN_MAX = 512             # KVF_TOKEN_MAX (util/token.h), without the NUL

ROLE_PREFILL = 0
ROLE_DECODE = 1
ATTN_MHA = 0
ATTN_MLA = 1
MEM_HOST = 0
MEM_CUDA = 1
KV_K = 0
KV_V = 1
KV_KV = 2
KV_NHD = 0
KV_HND = 1


class EngineParams(Structure):
    """``kvf_engine_params_t``."""
    _fields_ = [
        ("size", c_size_t),
        ("role", c_int),
        ("tp_rank", c_int),
        ("tp_size", c_int),
        ("pp_rank", c_int),
        ("pp_size", c_int),
        ("dp_rank", c_int),
        ("dp_size", c_int),
        ("host", c_char_p),
        ("port", c_int),
        ("bootstrap_addr", c_char_p),
        ("host_bootstrap", c_int),
        ("transport", c_char_p),
        ("checksum", c_int),
        ("bootstrap_timeout_ms", c_uint),
        ("waiting_timeout_ms", c_uint),
        ("transfer_timeout_ms", c_uint),
        ("heartbeat_interval_ms", c_uint),
        ("heartbeat_timeout_ms", c_uint),
        ("faults", c_char_p),
        ("handshake_timeout_ms", c_uint),
        ("auth_token", c_char_p),
        # registration fields (SGLang's PUT /route), added after the token
        ("cp_rank", c_int),
        ("cp_size", c_int),
        ("dp_attention", c_int),
        ("kv_cache_dtype", c_char_p),
        ("load_balance_method", c_char_p),
        ("prefill_http_port", c_int),
        ("dsa_cache_layer_split", c_int),
        ("streams", c_uint),
        # newer SGLang: --api-key as the token's last source, and the
        # decode allocation policy a prefill registers
        ("api_key", c_char_p),
        ("decode_allocation_policy", c_char_p),
        ("metrics_addr", c_char_p),
        ("trace", c_char_p),
        ("busy_poll_us", c_uint),
    ]


class Buffer(Structure):
    """``kvf_buffer_t``."""
    _fields_ = [
        ("base", c_void_p),
        ("length", c_size_t),
        ("item_bytes", c_size_t),
    ]


class Layout(Structure):
    """``kvf_layout_t``."""
    _fields_ = [
        ("size", c_size_t),
        ("page_size", c_uint32),
        ("kv_dtype", c_char_p),
        ("attn", c_int),
        ("num_layers", c_uint32),
        ("heads_per_rank", c_uint32),
        ("total_heads", c_uint32),
        ("bytes_per_head", c_uint32),
        ("mem_kind", c_int),
        ("num_kv", c_uint32),
        ("kv", POINTER(Buffer)),
        ("num_aux", c_uint32),
        ("aux", POINTER(Buffer)),
        ("num_state", c_uint32),
        ("state", POINTER(Buffer)),
        ("first_layer", c_uint32),
        # added after 0.1.0: zero (the default) on an older library
        ("kv_tags", c_void_p),              # const kvf_kv_tag_t *
        ("num_state_groups", c_uint32),
        ("state_groups", c_void_p),         # const kvf_state_group_t *
        ("aux_mem_kind", c_int),
        ("state_mem_kind", c_int),
        ("cuda_device", c_int),
        ("kv_order", c_int),                # kvf_kv_order_t
    ]


class KVTag(Structure):
    """``kvf_kv_tag_t``: what a KV buffer holds (layer, role, group)."""
    _fields_ = [
        ("layer", c_uint32),
        ("role", c_uint32),
        ("group", c_uint32),
    ]


class StateGroup(Structure):
    """``kvf_state_group_t``: typed state (SGLang's StateType) buffers."""
    _fields_ = [
        ("type", c_char_p),
        ("num_buffers", c_uint32),
        ("buffers", POINTER(Buffer)),
    ]


class Indices(Structure):
    """``kvf_indices_t``: indices into every buffer of one state group."""
    _fields_ = [
        ("idx", POINTER(c_uint32)),
        ("n", c_size_t),
    ]


class Dest(Structure):
    """``kvf_dest_t``: a receiver's destination, given in one call."""
    _fields_ = [
        ("size", c_size_t),
        ("pages", POINTER(c_uint32)),
        ("num_pages", c_size_t),
        ("aux_slot", c_uint32),
        ("states", POINTER(Indices)),
        ("num_states", c_size_t),
        ("decode_prefix_len", c_uint32),
    ]


class RoomMetric(Structure):
    """``kvf_room_metric_t``: what a room cost (SGLang's KVTransferMetric)."""
    _fields_ = [
        ("size", c_size_t),
        ("bytes", c_uint64),
        ("alloc_s", ctypes.c_double),
        ("transfer_s", ctypes.c_double),
    ]


class Failure(Structure):
    """``kvf_failure_t``: make one with ``new_failure()`` (its size set)."""
    _fields_ = [
        ("size", c_size_t),
        ("status", c_int),
        ("origin_side", c_int),
        ("origin_rank", c_int),
        ("origin_addr", c_char * ADDR_MAX),
        ("from_another_rank", c_int),
        ("reason", c_char * REASON_MAX),
    ]


class EngineStats(Structure):
    """``kvf_engine_stats_t``: make one with ``new_stats()`` (its size set)."""
    _fields_ = [
        ("size", c_size_t),
        ("rooms_by_state", c_uint64 * 5),
        ("rooms_succeeded", c_uint64),
        ("rooms_failed", c_uint64),
        ("failures_room", c_uint64),
        ("failures_peer", c_uint64),
        ("failures_other", c_uint64),
        ("bytes_sent", c_uint64),
        ("bytes_received", c_uint64),
        ("peers_connected", c_uint64),
        ("peers_by_path", c_uint64 * PATHS_MAX),
        ("auth_refused", c_uint64),
        ("room_msgs_dropped", c_uint64),
        ("stash_dropped", c_uint64),
    ]


class RoomKey(Structure):
    """``kvf_room_key_t``: a request id's room and instance."""
    _fields_ = [
        ("room", c_uint64),
        ("instance", c_uint64),
    ]


class Hold(Structure):
    """``kvf_hold_t``: how a held sender keeps its pages for later readers."""
    _fields_ = [
        ("size", c_size_t),
        ("lease_ms", c_uint),
        ("instance", c_uint64),
    ]


class Remote(Structure):
    """``kvf_remote_t``: a held room and the descriptors of its prefill ranks."""
    _fields_ = [
        ("size", c_size_t),
        ("room", c_uint64),
        ("instance", c_uint64),
        ("descriptors", POINTER(c_char_p)),
        ("num_descriptors", c_size_t),
    ]


_u32p = POINTER(c_uint32)

# name: (restype, argtypes)
_PROTOTYPES = {
    "kvf_version": (c_char_p, []),
    "kvf_status_name": (c_char_p, [c_int]),
    "kvf_status_str": (c_char_p, [c_int]),
    "kvf_role_name": (c_char_p, [c_int]),
    "kvf_poll_name": (c_char_p, [c_int]),
    "kvf_engine_params_init_sized": (None, [POINTER(EngineParams), c_size_t]),
    "kvf_engine_create": (c_int, [POINTER(EngineParams), POINTER(c_void_p)]),
    "kvf_engine_destroy": (None, [c_void_p]),
    "kvf_engine_address": (c_int, [c_void_p, c_char_p, c_size_t]),
    "kvf_engine_bootstrap_addr": (c_int, [c_void_p, c_char_p, c_size_t]),
    "kvf_engine_transport": (c_char_p, [c_void_p]),
    "kvf_engine_instance_id": (c_uint64, [c_void_p]),
    "kvf_layout_init_sized": (None, [POINTER(Layout), c_size_t]),
    "kvf_engine_register_layout": (c_int, [c_void_p, POINTER(Layout)]),
    "kvf_sender_create": (c_int, [c_void_p, c_char_p, c_uint64, POINTER(c_void_p)]),
    "kvf_sender_init": (c_int, [c_void_p, c_uint32, c_uint32]),
    "kvf_sender_set_state": (c_int, [c_void_p, _u32p, c_size_t]),
    "kvf_sender_send": (c_int, [c_void_p, _u32p, c_size_t, c_int]),
    "kvf_sender_poll": (c_int, [c_void_p]),
    "kvf_failure_init_sized": (None, [POINTER(Failure), c_size_t]),
    "kvf_sender_failure": (c_int, [c_void_p, POINTER(Failure)]),
    "kvf_sender_abort": (None, [c_void_p]),
    "kvf_sender_destroy": (None, [c_void_p]),
    "kvf_sender_room": (c_uint64, [c_void_p]),
    "kvf_receiver_create": (c_int, [c_void_p, c_char_p, c_uint64, c_int,
                                    POINTER(c_void_p)]),
    "kvf_receiver_init": (c_int, [c_void_p, _u32p, c_size_t, c_uint32, _u32p,
                                  c_size_t]),
    "kvf_receiver_poll": (c_int, [c_void_p]),
    "kvf_receiver_failure": (c_int, [c_void_p, POINTER(Failure)]),
    "kvf_receiver_abort": (None, [c_void_p]),
    "kvf_receiver_pages_released": (c_int, [c_void_p]),
    "kvf_receiver_destroy": (None, [c_void_p]),
    "kvf_receiver_room": (c_uint64, [c_void_p]),
    "kvf_engine_stats_init_sized": (None, [POINTER(EngineStats), c_size_t]),
    "kvf_engine_stats": (c_int, [c_void_p, POINTER(EngineStats)]),
    "kvf_transport_name": (c_char_p, [c_uint]),
    "kvf_bootstrap_create": (c_int, [c_char_p, c_int, POINTER(c_void_p)]),
    "kvf_bootstrap_port": (c_int, [c_void_p]),
    "kvf_bootstrap_access": (c_char_p, [c_void_p]),
    "kvf_bootstrap_destroy": (None, [c_void_p]),
    "kvf_log_set_level": (None, [c_int]),
    "kvf_last_error": (c_char_p, []),
}


# Functions added after 0.1.0.  The package imports without them; the
# feature that needs one checks ``has(name)`` and says which library it
# needs (``require``).
_OPTIONAL = {
    "kvf_receiver_set_dest": (c_int, [c_void_p, POINTER(Dest)]),
    "kvf_dest_init_sized": (None, [POINTER(Dest), c_size_t]),
    "kvf_sender_set_states": (c_int, [c_void_p, POINTER(Indices), c_size_t]),
    "kvf_sender_decode_prefix_len": (c_int, [c_void_p, POINTER(c_uint32)]),
    "kvf_sender_send_layers": (c_int, [c_void_p, _u32p, c_size_t, c_uint32, c_uint32,
                                       c_uint32, c_uint32]),
    "kvf_sender_metric": (c_int, [c_void_p, POINTER(RoomMetric)]),
    "kvf_receiver_metric": (c_int, [c_void_p, POINTER(RoomMetric)]),
    # held rooms, descriptors and room keys (vLLM's flow)
    "kvf_room_key": (RoomKey, [c_char_p, c_size_t]),
    "kvf_engine_descriptor": (c_int, [c_void_p, c_char_p, c_size_t]),
    "kvf_hold_init_sized": (None, [POINTER(Hold), c_size_t]),
    "kvf_sender_create_held": (c_int, [c_void_p, c_uint64, POINTER(Hold),
                                       POINTER(c_void_p)]),
    "kvf_remote_init_sized": (None, [POINTER(Remote), c_size_t]),
    "kvf_receiver_create_remote": (c_int, [c_void_p, POINTER(Remote),
                                           POINTER(c_void_p)]),
    # a failure with the application's own cause, and waiting for one
    "kvf_sender_fail": (c_int, [c_void_p, c_int, c_char_p]),
    "kvf_receiver_fail": (c_int, [c_void_p, c_int, c_char_p]),
    "kvf_sender_await_failure": (c_int, [c_void_p, c_uint]),
    "kvf_receiver_await_failure": (c_int, [c_void_p, c_uint]),
    # the cluster token's rules, asked of the library (SGLang's --api-key)
    "kvf_auth_token_resolve": (c_int, [c_char_p, c_char_p, c_size_t, c_char_p,
                                       c_size_t]),
    "kvf_bootstrap_create_keyed": (c_int, [c_char_p, c_int, c_char_p,
                                           POINTER(c_void_p)]),
    # metrics (Prometheus text) and the endpoint's address
    "kvf_engine_metrics": (c_int, [c_void_p, c_char_p, c_size_t, POINTER(c_size_t)]),
    "kvf_engine_metrics_addr": (c_int, [c_void_p, c_char_p, c_size_t]),
}


def _candidates():
    """Yield (path, where) pairs in search order."""
    env = os.environ.get(LIBRARY_ENV)
    if env:
        yield env, "$" + LIBRARY_ENV
        return
    here = os.path.dirname(os.path.abspath(__file__))
    yield os.path.join(here, LIBRARY_NAME), "the kvferry package directory"
    repo = os.path.dirname(os.path.dirname(here))
    yield os.path.join(repo, "build", LIBRARY_NAME), "the repository's build/ directory"


def _load():
    tried = []
    for path, where in _candidates():
        if not os.path.exists(path):
            tried.append("%s (%s): no such file" % (path, where))
            continue
        try:
            lib = ctypes.CDLL(path)
        except OSError as e:
            raise ImportError(
                "kvferry: found %s (%s) but cannot load it: %s. Install the "
                "libraries it links against (libmicrohttpd, libcurl, libjansson, "
                "libxxhash: `make deps` in the kvferry repository) or point %s "
                "at a working build." % (path, where, e, LIBRARY_ENV)) from e
        return lib, path
    raise ImportError(
        "kvferry: cannot find the C library %s. Looked in:\n  %s\nBuild it "
        "with `make build` in the kvferry repository (it produces "
        "build/libkvferry.so) and set %s=/path/to/libkvferry.so, or reinstall "
        "the package after building so that pip bundles it."
        % (LIBRARY_NAME, "\n  ".join(tried), LIBRARY_ENV))


def _declare(lib, path):
    for name, (restype, argtypes) in _PROTOTYPES.items():
        try:
            fn = getattr(lib, name)
        except AttributeError:
            raise ImportError("kvferry: %s does not export %s: it is older than "
                              "this binding; rebuild it (`make build`)"
                              % (path, name)) from None
        fn.restype = restype
        fn.argtypes = argtypes
    for name, (restype, argtypes) in _OPTIONAL.items():
        fn = getattr(lib, name, None)
        if fn is not None:
            fn.restype = restype
            fn.argtypes = argtypes
    for name, value in statuses().items():
        known = lib.kvf_status_name(value).decode()
        if known not in (name, "KVF_ERR_UNKNOWN"):     # unknown: an older library
            raise ImportError(
                "kvferry: %s names status %d %s, this binding names it %s; use "
                "the binding and the library of the same kvferry version"
                % (path, value, known, name))
    # Sizes say nothing of a field inserted mid-struct; the documented
    # defaults of kvf_engine_params_init() catch a shifted params layout.
    p = new_params()
    if (p.tp_size, p.pp_size, p.dp_size) != (1, 1, 1) or not p.host or \
            not p.transport or not p.heartbeat_timeout_ms:
        raise ImportError(
            "kvferry: %s does not lay out kvf_engine_params_t as this binding "
            "does (its defaults read back wrong); use the binding and the "
            "library of the same kvferry version" % path)


def statuses():
    """``{"KVF_OK": 0, "KVF_ERR_...": code, ...}``: the codes above."""
    return {name: value for name, value in globals().items()
            if name == "KVF_OK" or name.startswith("KVF_ERR_")}


def _new(init, struct):
    """A ``struct`` of the binding's size, initialised by the C ``init``."""
    obj = struct()
    init(ctypes.byref(obj), ctypes.sizeof(struct))
    return obj


def new_params():
    """``kvf_engine_params_t`` with every default set by the library."""
    return _new(lib.kvf_engine_params_init_sized, EngineParams)


def has(name):
    """Whether the loaded library exports ``name`` (a function added after
    0.1.0, see ``_OPTIONAL``)."""
    return getattr(lib, name, None) is not None


def require(name, what):
    """Raise ``RuntimeError`` naming the function that ``what`` needs, when
    the loaded library lacks it."""
    if not has(name):
        raise RuntimeError(
            "%s needs %s, which %s does not export: it is older than this "
            "binding; rebuild libkvferry (`make build`) from the same kvferry "
            "version" % (what, name, path))


def auth_token(api_key=None):
    """``(token, source)`` the library's engines and registries would use
    (``kvf_auth_token_resolve``): KVF_AUTH_TOKEN, KVF_AUTH_TOKEN_FILE,
    SGLANG_DISAGGREGATION_BOOTSTRAP_AUTH_TOKEN, then ``api_key`` (SGLang's
    --api-key).  ``("", "")`` when none.  Raises ``ValueError`` with the
    library's reason for a token source it refuses (a malformed token, a
    token file others may read)."""
    require("kvf_auth_token_resolve", "kvferry.auth_token")
    key = None
    if api_key:
        if not isinstance(api_key, str) or "\0" in api_key:
            raise ValueError("api_key must be a str without NUL characters")
        key = api_key.encode()
    tok = ctypes.create_string_buffer(TOKEN_MAX + 1)
    src = ctypes.create_string_buffer(160)
    st = lib.kvf_auth_token_resolve(key, tok, len(tok), src, len(src))
    if st != KVF_OK:
        raise ValueError((lib.kvf_last_error() or b"the cluster token cannot be "
                          b"read").decode(errors="replace"))
    return tok.value.decode(), src.value.decode()


def new_dest():
    """``kvf_dest_t`` zeroed and sized by the library."""
    return _new(lib.kvf_dest_init_sized, Dest)


def new_hold():
    """``kvf_hold_t`` zeroed and sized by the library."""
    return _new(lib.kvf_hold_init_sized, Hold)


def new_remote():
    """``kvf_remote_t`` zeroed and sized by the library."""
    return _new(lib.kvf_remote_init_sized, Remote)


def new_layout():
    """``kvf_layout_t`` zeroed and sized by the library."""
    return _new(lib.kvf_layout_init_sized, Layout)


def new_failure():
    """``kvf_failure_t`` zeroed and sized by the library, for
    ``kvf_sender_failure``/``kvf_receiver_failure`` to fill."""
    return _new(lib.kvf_failure_init_sized, Failure)


def new_stats():
    """``kvf_engine_stats_t`` zeroed and sized by the library, for
    ``kvf_engine_stats`` to fill."""
    return _new(lib.kvf_engine_stats_init_sized, EngineStats)


def transport_names():
    """The payload paths by their index in ``peers_by_path``:
    ``["tcp", "cuda", "shm", "ucx"]`` (``kvf_transport_name``), whether or not
    the library was built with each."""
    names = []
    while True:
        name = lib.kvf_transport_name(len(names))
        if name is None:
            return names
        names.append(name.decode())


lib, path = _load()
_declare(lib, path)


def status_name(st):
    """``kvf_status_name``: e.g. ``"KVF_ERR_TIMED_OUT"``."""
    return (lib.kvf_status_name(st) or b"KVF_ERR_UNKNOWN(%d)" % st).decode()


def status_str(st):
    """``kvf_status_str``: a one-line description of a status."""
    return (lib.kvf_status_str(st) or b"unknown status %d" % st).decode()


def role_name(role):
    """``kvf_role_name``: ``"prefill"`` or ``"decode"``."""
    return (lib.kvf_role_name(role) or b"?").decode()
