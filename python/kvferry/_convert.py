"""Turning Python values into what the C API takes.

Indices (pages, slots) become a ``uint32`` ctypes array; buffers become a
``(base, length)`` pair plus the object that keeps the memory alive.  Every
check raises ``TypeError`` (wrong kind of object) or ``ValueError`` (a value
that cannot be a ``uint32`` index) naming the argument and the offending
element, so no bad value ever reaches the library.
"""
import array
import ctypes
import operator
import sys

U32_MAX = 0xFFFFFFFF
U64_MAX = 0xFFFFFFFFFFFFFFFF

_INT_FORMATS = set("bBhHiIlLqQnN")
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


def _raise_range(name, pos, value):
    if value < 0:
        raise ValueError("%s[%d] = %d is negative: page and slot indices are "
                         "unsigned" % (name, pos, value))
    raise ValueError("%s[%d] = %d does not fit in 32 bits (at most %d)"
                     % (name, pos, value, U32_MAX))


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
            raise TypeError("%s[%d] is %r (%s): indices must be integers"
                            % (name, pos, v, _describe(v))) from None
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


def check_range(name, arr, limit, what):
    """ValueError if an index of ``arr`` is ``>= limit`` (``limit`` items registered)."""
    if len(arr) and max(arr) >= limit:
        pos = next(i for i, v in enumerate(arr) if v >= limit)
        raise ValueError("%s[%d] = %d is outside the registered %s (%d items: "
                         "valid indices are 0..%d)"
                         % (name, pos, arr[pos], what, limit, limit - 1))


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
        raise ValueError("%s = %d is outside 0..%d" % (name, v, (1 << bits) - 1))
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
