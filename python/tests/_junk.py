"""Hostile values for the input fuzzers (test_vllm_fuzz, test_sglang_api).

``Junk(rng)`` draws, from a seeded ``random.Random``, what a client can put
in a request: every JSON value Python's ``json`` module decodes (with NaN
and Infinity, lone surrogates from ``"\\ud800"`` escapes, ints of up to
4300 digits, deep nesting), edge values of the sizes kvferry checks, and,
with ``python=True``, objects no JSON decoder makes (bytes, sets, tuples)
for the in-process APIs, and with ``raising=True`` also subclasses of
str/int/list/dict and objects whose methods raise.  ``mutate_text``
damages a descriptor line the way a fuzzer does: characters inserted,
dropped and replaced, fields dropped, doubled, swapped or given edge
values.
"""
import math

EDGE_INTS = [0, 1, 2, 7, -1, -2, 2 ** 31 - 1, 2 ** 31, 2 ** 32 - 1, 2 ** 32, 2 ** 63 - 1,
             2 ** 63, 2 ** 64 - 1, 2 ** 64, -2 ** 63, -2 ** 64, 10 ** 30, -10 ** 30,
             10 ** 4000, -10 ** 4000]
EDGE_FLOATS = [math.nan, math.inf, -math.inf, -0.0, 0.0, 0.5, 1.0, 3.0, 1e308, -1e-308]
EDGE_STRS = ["", " ", "\ud800", "a\udfffb", "\udc80" * 3, "\x00", "p-1\x00evil", "\n",
             "x\r\nFORGED LOG LINE", "\x1b[31mred", "\x7f", "\x85", "\u202eevil", "\u2028",
             "\ufeff", "é", "日本語", "\U0001F600", "%s%s%n%d", "{}", "null", "true", "0",
             "-1", "1e9", "NaN", "kvf1 ", "kvf1", "127.0.0.1:1", "[::1]:0", "a" * 1024,
             "é" * 513, "a" * 1025, "a" * 70000, "\t" * 10, "A" * 4096 + "\ud800"]
EDGE_KEYS = ["do_remote_prefill", "do_remote_decode", "remote_block_ids", "remote_engine_id",
             "remote_request_id", "tp_size", "kvferry_descriptors", "remote_host",
             "remote_port", "", "\ud800", "\x00", "_remote_blocks_processed"]


class Raises:
    """Every method a validator might call raises."""

    def _boom(self, *args, **kwargs):
        raise RuntimeError("a hostile object was used")

    __eq__ = __hash__ = __bool__ = __len__ = __iter__ = __index__ = __int__ = _boom
    __float__ = __str__ = __repr__ = __getitem__ = __contains__ = __lt__ = _boom


class HostileStr(str):
    def encode(self, *args, **kwargs):
        raise RuntimeError("HostileStr.encode")


class HostileInt(int):
    def __index__(self):
        raise RuntimeError("HostileInt.__index__")


class HostileList(list):
    def __len__(self):
        raise RuntimeError("HostileList.__len__")


class HostileDict(dict):
    def get(self, *args):
        raise RuntimeError("HostileDict.get")


class Junk:
    """Draws hostile values from ``rng`` (``random.Random``)."""

    def __init__(self, rng, python=False, raising=False):
        self.rng = rng
        self.python = python
        self.raising = raising

    def text(self):
        r = self.rng
        pick = r.random()
        if pick < 0.5:
            return r.choice(EDGE_STRS)
        alphabet = ["a", "Z", "0", "9", ":", ".", "[", "]", "=", "/", " ", "\x00", "\t",
                    "\n", "\x7f", "\x9f", "\ud800", "\udfff", "é", "\u202e", "\U0001F600"]
        return "".join(r.choice(alphabet) for _ in range(r.choice([1, 2, 5, 17, 300])))

    def number(self):
        r = self.rng
        if r.random() < 0.7:
            return r.choice(EDGE_INTS + [r.randrange(-2 ** 70, 2 ** 70)])
        return r.choice(EDGE_FLOATS)

    def json(self, depth=0):
        """A value a JSON decoder can give."""
        r = self.rng
        kind = r.randrange(8 if depth < 4 else 6)
        if kind == 0:
            return None
        if kind == 1:
            return r.choice([True, False])
        if kind in (2, 3):
            return self.number()
        if kind in (4, 5):
            return self.text()
        if kind == 6:
            return [self.json(depth + 1) for _ in range(r.choice([0, 1, 3, 40]))]
        return {r.choice(EDGE_KEYS + [self.text()]): self.json(depth + 1)
                for _ in range(r.choice([0, 1, 3]))}

    def hostile(self):
        """An object no JSON decoder makes."""
        r = self.rng
        plain = [lambda: b"kvf1 id=1", lambda: bytearray(b"\x00"), lambda: {1, 2},
                 lambda: (1, 2, 3), lambda: (), lambda: object(), lambda: 3 + 4j,
                 lambda: range(5), lambda: type]
        raising = [lambda: Raises(), lambda: HostileStr("p-1"), lambda: HostileInt(3),
                   lambda: HostileList([1, 2]), lambda: HostileDict(do_remote_prefill=True)]
        return r.choice(plain + (raising if self.raising else []))()

    def value(self):
        if self.python and self.rng.random() < 0.25:
            return self.hostile()
        return self.json()


# Values a descriptor field may be given, valid and not, by the library's rules.
FIELD_EDGES = {
    "id": ["0000000000000000", "00000000000000001", "000000000000001", "ABCDEF0123456789",
           "ffffffffffffffff", "0x00000000000001", "-000000000000001", "g000000000000001"],
    "addr": ["0.0.0.0:1", "[::]:1", "127.0.0.1:0", "127.0.0.1:65535", "127.0.0.1:65536",
             "127.0.0.1:099999", "localhost:80", "[::1]:80", "::1:80", "127.0.0.01:80",
             "[127.0.0.1]:80", "127.0.0.1", "127.0.0.1:", ":80", "[::1]80", "[::1:80",
             "1.2.3.4:5", "[fe80::1]:9", "[::ffff:127.0.0.1]:9", "255.255.255.255:1",
             "1" * 70 + ":1", "[" + "1:" * 30 + "]:1", "127.0.0.1:+80", "127.0.0.1:8 0"],
    "role": ["prefill", "decode", "Prefill", "", "prefil"],
    "tp": ["0/1", "1/1", "0/0", "-0/1", "+0/1", "0/+1", "0/4096", "4095/4096", "0/4097",
           "0/01", "00/1", "1", "/1", "0/", "0/1/2", "99999999999999999999/1", "0x0/1"],
    "pp": ["0/1", "0/1024", "0/1025", "1/1"],
    "dp": ["0/1", "65535/65536", "0/65537", "0/0"],
    "page": ["0", "1", "4", "4294967295", "4294967296", "-4", "+4", "04", "4.0", ""],
    "dtype": ["bfloat16", "fp8_e4m3", "a" * 63, "a" * 64, "", "bf 16", "bf/16", "é"],
    "attn": ["mha", "mla", "gqa", "MHA", ""],
    "heads": ["0", "65536", "65537", "-1", "4294967296", "2"],
}


def mutate_text(rng, text):
    """``text`` (a descriptor line) damaged once."""
    toks = text.split(" ")
    what = rng.randrange(9)
    if what == 0:                       # insert a character
        i = rng.randrange(len(text) + 1)
        return text[:i] + rng.choice(" =:/\x00\t\n\x7fé\ud800A0") + text[i:]
    if what == 1 and text:              # drop a character
        i = rng.randrange(len(text))
        return text[:i] + text[i + 1:]
    if what == 2 and text:              # replace a character
        i = rng.randrange(len(text))
        return text[:i] + chr(rng.randrange(0x20, 0x7f)) + text[i + 1:]
    if what == 3 and len(toks) > 1:     # drop a field
        del toks[rng.randrange(1, len(toks))]
    elif what == 4 and len(toks) > 1:   # a field twice
        toks.insert(rng.randrange(1, len(toks) + 1), rng.choice(toks[1:]))
    elif what == 5 and len(toks) > 2:   # two fields swapped
        i, j = rng.sample(range(1, len(toks)), 2)
        toks[i], toks[j] = toks[j], toks[i]
    elif what == 6:                     # a field given an edge value
        name = rng.choice(sorted(FIELD_EDGES))
        toks = [t for t in toks if not t.startswith(name + "=")]
        toks.insert(rng.randrange(1, len(toks) + 1),
                    "%s=%s" % (name, rng.choice(FIELD_EDGES[name])))
    elif what == 7:                     # a field of a later version, or a broken one
        toks.insert(rng.randrange(1, len(toks) + 1),
                    rng.choice(["future=1", "x=", "=y", "noequals", "", "crc=ab cd"]))
    else:                               # another prefix, or the length limit
        return rng.choice(["kvf2" + text[4:], "KVF1" + text[4:], " " + text,
                           text + " ", text + " pad=" + "p" * 600, text[:5]])
    return " ".join(toks)
