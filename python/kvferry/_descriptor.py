"""Reading kvferry engine descriptors in Python, by the library's rules.

A descriptor (``KVManager.descriptor()``) is one line of printable ASCII:

    kvf1 id=<16 hex> addr=<ip:port> role=prefill|decode tp=<rank>/<size>
         pp=<rank>/<size> dp=<rank>/<size> page=<tokens> dtype=<name>
         attn=mha|mla heads=<model's KV heads>

A decode engine parses the descriptors it is handed when it creates a
receiver (``kvf_receiver_create_remote``); an application that carries
them in a client's request (vLLM's ``kv_transfer_params``) reads them here
first, so that a bad one is refused where the request can still take
another path.  The one idea: the rules are the library's own
(src/core/descriptor.c, src/core/receiver.c), field for field, so that
what this module accepts the library accepts too.  It is stricter in
two places that no engine's descriptor reaches: the whole line must be
printable ASCII (the library reads any byte but NUL), and a server's
descriptors must name each of its ranks once (the library reads a
subset).  Nothing here is trusted beyond that: the library parses each
descriptor again, and the handshake checks the peer it names.
"""
import re
import socket

from ._lib import ADDR_MAX, DESCRIPTOR_MAX

__all__ = ["parse_descriptor", "check_prefill_server"]

MAX_CHARS = DESCRIPTOR_MAX - 1              # the library's buffer holds the NUL
_FIELDS = ("id", "addr", "role", "tp", "pp", "dp", "page", "dtype", "attn", "heads")
_COORD_MAX = {"tp": 4096, "pp": 1024, "dp": 65536}
_WORDS = {"role": ("prefill", "decode"), "attn": ("mha", "mla")}
_U32_MAX = 0xFFFFFFFF
_HEADS_MAX = 65536
_PRINTABLE = re.compile(r"[\x20-\x7e]*\Z")
_ID = re.compile(r"[0-9a-f]{16}\Z")
_COORD = re.compile(r"([0-9]+)/([0-9]+)\Z")
_UINT = re.compile(r"[0-9]+\Z")
_DTYPE = re.compile(r"[A-Za-z0-9_.-]{1,63}\Z")
_ADDR_CHARS = re.compile(r"[0-9a-fA-F.:\[\]]+\Z")


def _split_addr(v):
    """(host, port text) as kvf__split_addr splits it, or None."""
    if v.startswith("["):
        close = v.find("]", 1)
        if close < 0 or v[close + 1:close + 2] != ":":
            return None
        host, port = v[1:close], v[close + 2:]
    else:
        colon = v.find(":")
        # A second colon: an IPv6 address without brackets, whose port
        # cannot be told apart.
        if colon < 0 or ":" in v[colon + 1:]:
            return None
        host, port = v[:colon], v[colon + 1:]
    if not host or len(host) >= ADDR_MAX or not 0 < len(port) <= 5 or not _UINT.match(port):
        return None
    return host, port


def _numeric_host(host):
    """The address's bytes (libc's inet_pton, IPv4 first), or None."""
    for family in (socket.AF_INET, socket.AF_INET6):
        try:
            return socket.inet_pton(family, host)
        except (OSError, ValueError):
            continue
    return None


def _unusable_v4(a):
    """As descriptor.c's unusable_v4: an IPv4 address no engine is dialled at."""
    return a >> 24 == 0 or a >> 28 == 0xE or a == 0xFFFFFFFF


def _unusable(raw):
    """As descriptor.c's unusable_host: the wildcard in any spelling, the
    rest of 0.0.0.0/8, multicast, broadcast, IPv4-compatible and link-local
    IPv6; an IPv4-mapped address is judged by its IPv4 part."""
    if len(raw) == 4:
        return _unusable_v4(int.from_bytes(raw, "big"))
    head, v4 = raw[:12], int.from_bytes(raw[12:], "big")
    if not any(raw):
        return True                                     # ::
    if head == bytes(10) + b"\xff\xff":
        return _unusable_v4(v4)                         # ::ffff:a.b.c.d
    if head == bytes(12) and v4 > 1:
        return True                                     # ::a.b.c.d (not ::1)
    return raw[0] == 0xFF or (raw[0] == 0xFE and raw[1] & 0xC0 == 0x80)


def _addr(v):
    if len(v) >= ADDR_MAX or not _ADDR_CHARS.match(v):
        return None
    parts = _split_addr(v)
    if parts is None:
        return None
    host, port = parts
    raw = _numeric_host(host)
    if raw is None or _unusable(raw) or not 0 < int(port) <= 65535:
        return None                     # a name, no dialable address, port 0 or past 65535
    return v


def _coord(v, limit):
    m = _COORD.match(v)
    if m is None:
        return None
    rank, size = int(m.group(1)), int(m.group(2))
    if not 1 <= size <= limit or rank >= size:
        return None
    return rank, size


def _uint(v, limit):
    if not _UINT.match(v) or int(v) > limit:
        return None
    return int(v)


def _field(name, v):
    """The value of one known field, or None when the library refuses it."""
    if name == "id":
        if not _ID.match(v):
            return None
        return int(v, 16) or None       # 0 names no instance
    if name == "addr":
        return _addr(v)
    if name in _WORDS:
        return v if v in _WORDS[name] else None
    if name in _COORD_MAX:
        return _coord(v, _COORD_MAX[name])
    if name == "page":
        page = _uint(v, _U32_MAX)
        return page or None
    if name == "dtype":
        return v if _DTYPE.match(v) else None
    return _uint(v, _HEADS_MAX)         # heads, 0 allowed


def parse_descriptor(text):
    """The known fields of descriptor ``text`` as a dict (``id`` an int,
    ``tp``/``pp``/``dp`` ``(rank, size)`` pairs, ``page`` and ``heads``
    ints, the rest str).  Raises ``TypeError`` for a non-str and
    ``ValueError`` saying what is wrong, where the library would refuse it
    (and for non-printable-ASCII text).  Fields it does not know are
    skipped, as the library skips a later version's fields."""
    if type(text) is not str:
        raise TypeError("a descriptor must be a str, got %s" % type(text).__name__)
    if len(text) > MAX_CHARS:
        raise ValueError("%d characters long, more than a descriptor's %d"
                         % (len(text), MAX_CHARS))
    if not _PRINTABLE.match(text):
        pos = next(i for i, c in enumerate(text) if not " " <= c <= "~")
        raise ValueError("character U+%04X at position %d: a descriptor is printable "
                         "ASCII" % (ord(text[pos]), pos))
    if not text.startswith("kvf1 "):
        raise ValueError("not a kvferry descriptor (it starts %r, not 'kvf1 ')" % text[:8])
    out = {}
    for tok in text[5:].split(" "):
        if not tok:
            raise ValueError("an empty field: fields are separated by one space")
        name, eq, value = tok.partition("=")
        if not eq:
            raise ValueError("field %r has no '='" % tok[:32])
        if name not in _FIELDS:
            continue                    # a later version's field
        if name in out:
            raise ValueError("field %s given twice" % name)
        v = _field(name, value)
        if v is None:
            raise ValueError("field %s=%r is not valid" % (name, value[:64]))
        out[name] = v
    for name in _FIELDS:
        if name not in out:
            raise ValueError("field %s is missing" % name)
    return out


# What every rank of one prefill server has alike.
_SERVER = ("page", "dtype", "attn", "heads")


def check_prefill_server(descriptors):
    """Check that ``descriptors`` (a list of ``parse_descriptor`` dicts)
    are one prefill server's, every rank once: each a prefill engine's,
    all of the same TP and PP sizes, DP group and layout summary, and as
    many as TP x PP.  Raises ``ValueError`` naming the first one at fault
    by its position."""
    first = descriptors[0]
    seen = {}
    for i, d in enumerate(descriptors):
        if d["role"] != "prefill":
            raise ValueError("descriptor %d is a decode engine's (role=decode)" % i)
        for key in ("tp", "pp", "dp"):
            # TP and PP ranks differ, their sizes do not; the DP group is one.
            mine, theirs = (d[key], first[key]) if key == "dp" else (d[key][1], first[key][1])
            if mine != theirs:
                raise ValueError("descriptor %d has %s=%d/%d but descriptor 0 has %s=%d/%d: "
                                 "not one prefill server" % (i, key, d[key][0], d[key][1], key,
                                                             first[key][0], first[key][1]))
        for key in _SERVER:
            if d[key] != first[key]:
                raise ValueError("descriptor %d has %s=%s but descriptor 0 has %s=%s: not one "
                                 "prefill server" % (i, key, d[key], key, first[key]))
        rank = (d["tp"][0], d["pp"][0])
        if rank in seen:
            raise ValueError("descriptors %d and %d both name prefill rank tp %d pp %d"
                             % (seen[rank], i, rank[0], rank[1]))
        seen[rank] = i
    want = first["tp"][1] * first["pp"][1]
    if len(descriptors) != want:
        raise ValueError("%d descriptors for a prefill server of TP %d x PP %d: it needs one "
                         "per rank, %d" % (len(descriptors), first["tp"][1], first["pp"][1],
                                           want))
