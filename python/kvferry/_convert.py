"""Turning Python values into what the C API takes.

Indices (pages, slots) become a ``uint32`` ctypes array; buffers become a
``(base, length)`` pair plus the object that keeps the memory alive; names
(request ids, addresses) are checked as text the library can take.  Every
check raises ``TypeError`` (wrong kind of object) or ``ValueError`` (a value
that cannot be a ``uint32`` index, a name with a control character) naming
the argument and the offending element, so no bad value ever reaches the
library.
"""
import array
import ctypes
import operator
import re
import sys

U32_MAX = 0xFFFFFFFF
U64_MAX = 0xFFFFFFFFFFFFFFFF

_INT_FORMATS = set("bBhHiIlLqQnN")
# Characters no name the library takes may hold: C0 and C1 controls (NUL
# ends a C string, a newline forges a log line) and lone surrogates
# (not text: they have no UTF-8 form).
_BAD_CHARS = re.compile("[\x00-\x1f\x7f-\x9f\ud800-\udfff]")
# A registry address: a host name (at most 253 characters, the DNS limit)
# or a numeric address, and a port.
_HOSTNAME = re.compile(r"[A-Za-z0-9._-]{1,253}\Z")
_IPV6 = re.compile(r"[0-9A-Fa-f:.]{2,45}\Z")
_PORT = re.compile(r"[0-9]{1,5}\Z")
ADDR_TEXT_MAX = 262                 # "[" IPv6 "]:" port, or a 253-character name and port
_KINDS = ("a list or tuple of ints, an array.array or memoryview of integers, "
          "or a numpy integer array")


def _describe(obj):
    return type(obj).__module__ + "." + type(obj).__qualname__ \
        if type(obj).__module__ != "builtins" else type(obj).__name__


def _from_numpy(name, obj):
    np = sys.modules.get("numpy")
    if np is None or not isinstance(obj, np.ndarray):
        return None
    if obj.dtype.kind not in "iu":
        raise TypeError("%s must hold integers, got a numpy array of dtype %s"
                        % (name, obj.dtype))
    if obj.ndim != 1:
        obj = obj.reshape(-1)
    if obj.size:
        lo, hi = int(obj.min()), int(obj.max())
        if lo < 0 or hi > U32_MAX:
            bad = lo if lo < 0 else hi
            pos = int((obj == bad).nonzero()[0][0])
            _raise_range(name, pos, bad)
    return array.array("I", obj.astype(np.uint32).tobytes())


def num_text(v):
    """An int for a message: in full when short; Python cannot print one
    past its digit limit at all."""
    return str(v) if -10 ** 18 < v < 10 ** 18 else "a %d-bit integer" % v.bit_length()


def _short(v):
    """A value for a message: its repr, cut; its type when that fails."""
    try:
        text = repr(v)
    except Exception:
        return "a %s" % _describe(v)
    return text if len(text) <= 40 else text[:37] + "..."


def _raise_range(name, pos, value):
    if value < 0:
        raise ValueError("%s[%d] = %s is negative: page and slot indices are "
                         "unsigned" % (name, pos, num_text(value)))
    raise ValueError("%s[%d] = %s does not fit in 32 bits (at most %d)"
                     % (name, pos, num_text(value), U32_MAX))


def _from_sequence(name, seq):
    try:
        if not any(type(v) is bool for v in seq):
            return array.array("I", seq)
    except (OverflowError, TypeError):
        pass
    # Find the element at fault, for the message.
    for pos, v in enumerate(seq):
        if isinstance(v, bool) or isinstance(v, float):
            raise TypeError("%s[%d] is %r (%s): indices must be integers"
                            % (name, pos, v, type(v).__name__))
        try:
            v = operator.index(v)
        except TypeError:
            raise TypeError("%s[%d] is %s (%s): indices must be integers"
                            % (name, pos, _short(v), _describe(v))) from None
        if v < 0 or v > U32_MAX:
            _raise_range(name, pos, v)
    # array('I') refuses numpy integer scalars: go through int().
    return array.array("I", [operator.index(v) for v in seq])


def to_u32_array(name, obj, allow_empty=False):
    """Convert ``obj`` to an ``array.array('I')`` of uint32 indices.

    Accepts a list/tuple/range of ints, an ``array.array`` or ``memoryview``
    with an integer format, a numpy integer array (when numpy is imported),
    or any object with ``tolist()`` returning such a list (e.g. a torch
    tensor).  ``name`` appears in error messages.
    """
    if isinstance(obj, (str, bytes, bytearray)) or obj is None:
        raise TypeError("%s must be %s; got %s" % (name, _KINDS, _describe(obj)))
    out = _from_numpy(name, obj)
    if out is None:
        if isinstance(obj, array.array):
            if obj.typecode not in _INT_FORMATS:
                raise TypeError("%s must hold integers, got an array.array of "
                                "typecode %r" % (name, obj.typecode))
            out = obj if obj.typecode == "I" and obj.itemsize == 4 else \
                _from_sequence(name, obj)
        elif isinstance(obj, memoryview):
            fmt = obj.format.lstrip("@=<>!")
            if fmt not in _INT_FORMATS:
                raise TypeError("%s must hold integers, got a memoryview of "
                                "format %r" % (name, obj.format))
            flat = obj if obj.ndim == 1 else obj.cast("B").cast(obj.format)
            out = _from_sequence(name, flat.tolist())
        elif isinstance(obj, (list, tuple, range)):
            out = _from_sequence(name, obj)
        elif hasattr(obj, "tolist") and callable(obj.tolist):
            lst = obj.tolist()
            if not isinstance(lst, list):
                raise TypeError("%s must be %s; %s.tolist() returned %s"
                                % (name, _KINDS, _describe(obj), _describe(lst)))
            out = _from_sequence(name, lst)
        else:
            raise TypeError("%s must be %s; got %s" % (name, _KINDS, _describe(obj)))
    if not allow_empty and len(out) == 0:
        raise ValueError("%s is empty: a room needs at least one index" % name)
    return out


def as_c_u32(arr):
    """A ``uint32_t *`` view of an ``array.array('I')`` (keep ``arr`` alive)."""
    if len(arr) == 0:
        return None
    return ctypes.cast((ctypes.c_uint32 * len(arr)).from_buffer(arr),
                       ctypes.POINTER(ctypes.c_uint32))


def _registered(limit, what):
    return "(%d %s: %s)" % (limit, what, "valid indices are 0..%d" % (limit - 1)
                            if limit else "there are none")


def check_range(name, arr, limit, what):
    """ValueError if an index of ``arr`` is ``>= limit`` (``limit`` ``what``
    registered, e.g. 64 "KV pages"), naming the first such index."""
    if len(arr) and max(arr) >= limit:
        pos = next(i for i, v in enumerate(arr) if v >= limit)
        raise ValueError("%s[%d] = %d is outside the registered %s %s"
                         % (name, pos, arr[pos], what, _registered(limit, what)))


def check_index(name, value, limit, what):
    """ValueError if the single index ``value`` is ``>= limit``."""
    if value >= limit:
        raise ValueError("%s = %d is outside the registered %s %s"
                         % (name, value, what, _registered(limit, what)))


def text_problem(value, max_bytes):
    """Why ``value`` cannot be a name the library takes (a request id, an
    address), as a phrase ("is empty"), or None when it can: a non-empty
    ``str`` of at most ``max_bytes`` UTF-8 bytes, without control
    characters or lone surrogates.  A subclass of str is not taken: its
    methods are its own."""
    if type(value) is not str:
        return "is a %s, not a str" % _describe(value)
    if not value:
        return "is empty"
    bad = _BAD_CHARS.search(value)
    if bad is not None:
        c = ord(bad.group())
        return "holds %s U+%04X at position %d" % (
            "a lone surrogate" if c >= 0xD800 else "the control character", c, bad.start())
    # No more characters than bytes: a huge string is refused unencoded.
    if len(value) > max_bytes or len(value.encode("utf-8")) > max_bytes:
        return "is longer than %d bytes (UTF-8)" % max_bytes
    return None


def addr_problem(value):
    """Why ``value`` cannot be a registry address ``"host:port"`` (a phrase),
    or None: the host a name of letters, digits, '.', '-' and '_' or a
    numeric address (IPv6 in brackets), the port 1..65535, as the library
    splits it (kvf__split_addr).  Nothing else reaches the URL it builds."""
    why = text_problem(value, ADDR_TEXT_MAX)
    if why is not None:
        return why
    if value.startswith("["):
        close = value.find("]")
        if close < 0 or value[close + 1:close + 2] != ":":
            return "is not '[IPv6 address]:port'"
        host, port, ok = value[1:close], value[close + 2:], _IPV6.match(value[1:close])
    else:
        host, sep, port = value.partition(":")
        if not sep or ":" in port:
            return "is not 'host:port' (an IPv6 address goes in brackets: '[addr]:port')"
        ok = _HOSTNAME.match(host)
    if not ok:
        return "has host %r, neither a host name nor a numeric address" % host[:64]
    if not _PORT.match(port) or not 0 < int(port) <= 65535:
        return "has port %r, not 1..65535" % port[:16]
    return None


def to_uint(name, value, bits=32):
    """Check that ``value`` is an int in ``[0, 2**bits)``; return it as int."""
    if isinstance(value, (bool, float)):
        raise TypeError("%s must be an integer, got %r" % (name, value))
    try:
        v = operator.index(value)
    except TypeError:
        raise TypeError("%s must be an integer, got %s" % (name, _describe(value))) \
            from None
    if v < 0 or v >= (1 << bits):
        raise ValueError("%s = %s is outside 0..%d" % (name, num_text(v), (1 << bits) - 1))
    return v


def buffer_memory(obj):
    """``("cuda", ordinal)`` for device memory, ``("host", None)`` otherwise.

    Device memory is what says so: a ``.device`` of type ``cuda`` (torch
    tensors; the ordinal is its index) or a ``__cuda_array_interface__``
    (CuPy, Numba; ordinal from ``.device`` when it has one, else 0).  An
    integer address says nothing: it is declared host memory, and the
    library refuses it at registration if the CUDA driver says otherwise,
    without ever reading it.
    """
    dev = getattr(obj, "device", None)
    if getattr(dev, "type", None) == "cuda":
        idx = getattr(dev, "index", None)
        return "cuda", 0 if idx is None else int(idx)
    if hasattr(obj, "__cuda_array_interface__"):
        idx = getattr(dev, "id", getattr(dev, "index", None))
        return "cuda", 0 if idx is None else int(idx)
    return "host", None


def buffer_address(name, obj, length=None, lens_name="*_data_lens"):
    """Resolve a buffer to ``(address, length, keepalive)``.

    ``obj`` may be an integer address (``length`` required), an object with
    ``data_ptr()`` (torch tensors; the length comes from ``nbytes`` or
    ``numel() * element_size()`` when not given) or a writable object with
    the buffer protocol (bytearray, mmap, numpy array, array.array, ...).
    ``keepalive`` must stay referenced as long as the library may use the
    memory.
    """
    if isinstance(obj, bool) or isinstance(obj, float):
        raise TypeError("%s must be an address, an object with data_ptr() or a "
                        "writable buffer; got %r" % (name, obj))
    if isinstance(obj, int):
        if obj <= 0 or obj > U64_MAX:
            raise ValueError("%s = %#x is not a valid address" % (name, obj))
        if length is None:
            raise ValueError("%s is an integer address: give its length in %s"
                         % (name, lens_name))
        return obj, length, None
    cai = getattr(obj, "__cuda_array_interface__", None)
    if cai is not None and not (hasattr(obj, "data_ptr") and callable(obj.data_ptr)):
        addr = int(cai["data"][0])
        if length is None:
            n = 1
            for d in cai["shape"]:
                n *= int(d)
            length = n * int(cai["typestr"][2:])
        return addr, length, obj
    if hasattr(obj, "data_ptr") and callable(obj.data_ptr):
        addr = obj.data_ptr()
        if length is None:
            if hasattr(obj, "nbytes"):
                length = int(obj.nbytes)
            elif hasattr(obj, "numel") and hasattr(obj, "element_size"):
                length = int(obj.numel()) * int(obj.element_size())
            else:
                raise ValueError("%s: cannot tell the length of %s; give it in %s"
                                 % (name, _describe(obj), lens_name))
        return addr, length, obj
    try:
        mv = memoryview(obj)
    except TypeError:
        raise TypeError("%s must be an integer address, an object with "
                        "data_ptr() or a writable buffer (bytearray, mmap, "
                        "numpy array, ...); got %s" % (name, _describe(obj))) from None
    if mv.readonly:
        raise TypeError("%s is a read-only buffer (%s): register writable memory "
                        "(bytearray, mmap, numpy array)" % (name, _describe(obj)))
    if not mv.c_contiguous:
        raise ValueError("%s is not C-contiguous: register contiguous memory" % name)
    nbytes = mv.nbytes
    if nbytes == 0:
        raise ValueError("%s is an empty buffer" % name)
    carr = (ctypes.c_char * nbytes).from_buffer(mv.cast("B") if mv.ndim else mv)
    addr = ctypes.addressof(carr)
    if length is None:
        length = nbytes
    elif length > nbytes:
        raise ValueError("%s: length %d is larger than the buffer (%d bytes)"
                         % (name, length, nbytes))
    return addr, length, (obj, mv, carr)
