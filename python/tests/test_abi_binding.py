"""The binding's hand-written mirror of the C header, held to the C side.

``kvferry._lib`` declares the header's structs as ctypes classes, and its
status codes, limits and enum values as constants; nothing but this test
ties them to ``include/kvferry/kvferry.h``.  The C side comes from the
compiler: ``tests/unit/abi_layout.c`` (built as ``kvf_abi_layout``, path in
``$KVF_ABI_LAYOUT``) prints every public struct's size and each field's
offset and size, the status table and the constants, as JSON.

- every ctypes Structure in the package names its C struct first in its
  docstring, and that struct has the same fields, in the same order, at
  the same offsets and sizes, and the same size;
- abi_layout.c lists every struct the header declares, every field of it
  in declaration order (read from the header's text), so a field added to
  the header and not to the binding fails here too;
- the binding's status codes are status.h's, both ways, and the library
  names each of them;
- one version: CMakeLists.txt's project() version is what the header's
  generated macros, kvf_version(), ``kvferry.__version__`` and the
  packaging metadata all say.
"""
import ctypes
import importlib
import importlib.util
import json
import os
import pkgutil
import re
import subprocess
import sys
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
PYROOT = os.path.dirname(HERE)
REPO = os.path.dirname(PYROOT)
sys.path.insert(0, PYROOT)

import kvferry  # noqa: E402
from kvferry import _lib  # noqa: E402

HEADER = os.path.join(REPO, "include", "kvferry", "kvferry.h")


def c_side():
    """The JSON that kvf_abi_layout prints."""
    exe = os.environ.get("KVF_ABI_LAYOUT") or os.path.join(
        REPO, "build", "tests", "kvf_abi_layout")
    if not os.path.exists(exe):
        raise RuntimeError("%s: no such file; build the repository (`make build`) "
                           "or set KVF_ABI_LAYOUT" % exe)
    out = subprocess.run([exe], stdout=subprocess.PIPE, check=True, timeout=60)
    return json.loads(out.stdout)


def header_structs(text):
    """``{"kvf_x_t": [field, ...]}`` in declaration order, from the header's
    text: every ``typedef struct kvf_x { ... } kvf_x_t;`` with a body."""
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    structs = {}
    for m in re.finditer(r"typedef struct \w+ \{(.*?)\}\s*(kvf_\w+_t)\s*;", text, re.S):
        decls = [d.strip() for d in m.group(1).split(";") if d.strip()]
        structs[m.group(2)] = [re.search(r"(\w+)\s*(\[[^\]]*\])?$", d).group(1)
                               for d in decls]
    return structs


def binding_structs():
    """``{"kvf_x_t": cls}`` for every ctypes Structure the package defines,
    in whichever module, keyed by the C struct its docstring names first."""
    for mod in pkgutil.iter_modules(kvferry.__path__):
        importlib.import_module("kvferry." + mod.name)
    found, pending = {}, list(ctypes.Structure.__subclasses__())
    while pending:
        cls = pending.pop()
        pending.extend(cls.__subclasses__())
        if not cls.__module__.startswith("kvferry"):
            continue
        m = re.match(r"``(kvf_\w+_t)``", (cls.__doc__ or "").strip())
        if m is None:
            raise AssertionError(
                "%s.%s: its docstring must begin with the C struct it mirrors, "
                "as ``kvf_x_t``" % (cls.__module__, cls.__name__))
        found[m.group(1)] = cls
    return found


def layout_problems(cname, cls, c):
    """What differs between ctypes class ``cls`` and C struct ``c`` (the
    JSON entry): one line per field, naming the struct and the field."""
    ours = [(f[0], getattr(cls, f[0])) for f in cls._fields_]
    theirs = list(c["fields"].items())
    where = "%s (%s.%s)" % (cname, cls.__module__, cls.__name__)
    problems = []
    for i in range(max(len(ours), len(theirs))):
        if i >= len(theirs):
            problems.append("%s: field %r is in the binding, not in C"
                            % (where, ours[i][0]))
            continue
        if i >= len(ours):
            problems.append("%s: C field %r is missing in the binding"
                            % (where, theirs[i][0]))
            continue
        (name, desc), (cfield, (coff, csize)) = ours[i], theirs[i]
        if name != cfield:
            problems.append("%s: field %d is %r in C, %r in the binding"
                            % (where, i, cfield, name))
        elif (desc.offset, desc.size) != (coff, csize):
            problems.append("%s: field %r is at offset %d, %d bytes in C; at "
                            "offset %d, %d bytes in the binding"
                            % (where, name, coff, csize, desc.offset, desc.size))
    if ctypes.sizeof(cls) != c["size"]:
        problems.append("%s: sizeof is %d in C, %d in the binding"
                        % (where, c["size"], ctypes.sizeof(cls)))
    return problems


class Structs(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        cls.c = c_side()

    def test_helper_lists_every_header_field(self):
        with open(HEADER) as f:
            header = header_structs(f.read())
        self.assertGreater(len(header), 10, "the header parse found too few structs")
        dumped = {name: list(s["fields"]) for name, s in self.c["structs"].items()}
        self.assertEqual(sorted(header), sorted(dumped),
                         "tests/unit/abi_layout.c must dump every struct of "
                         "kvferry.h")
        for name, fields in header.items():
            self.assertEqual(fields, dumped[name],
                             "%s: kvferry.h declares these fields; list each in "
                             "tests/unit/abi_layout.c, in this order" % name)

    def test_every_binding_struct_matches_c(self):
        ours = binding_structs()
        self.assertGreater(len(ours), 10, "too few ctypes structs found")
        for cname, cls in sorted(ours.items()):
            with self.subTest(struct=cname):
                self.assertIn(cname, self.c["structs"],
                              "%s mirrors %s, which tests/unit/abi_layout.c "
                              "does not dump" % (cls.__name__, cname))
                problems = layout_problems(cname, cls, self.c["structs"][cname])
                if problems:
                    self.fail("\n".join(problems))

    def test_a_mismatch_is_named(self):
        """The comparison itself: a field moved, resized, missing or extra
        is reported with the struct's and the field's names."""
        c = {"size": 16, "fields": {"a": [0, 4], "b": [4, 4], "c": [8, 8]}}

        def struct(fields):
            return type("T", (ctypes.Structure,), {"_fields_": fields})

        i, q = ctypes.c_int32, ctypes.c_int64
        self.assertEqual(layout_problems("t", struct([("a", i), ("b", i), ("c", q)]), c), [])
        cases = [([("b", i), ("a", i), ("c", q)], "field 0 is 'a' in C, 'b'"),
                 ([("a", i), ("b", i), ("c", i)], "field 'c' is at offset 8, 8 bytes"),
                 ([("a", i), ("b", i)], "C field 'c' is missing"),
                 ([("a", i), ("b", i), ("c", q), ("d", i)], "field 'd' is in the binding")]
        for fields, want in cases:
            got = "\n".join(layout_problems("t", struct(fields), c))
            self.assertIn(want, got)
            self.assertIn("t (", got)


class Records(unittest.TestCase):
    """The records the library fills carry the binding's size."""

    def test_sized_by_the_library(self):
        self.assertEqual(_lib.new_failure().size, ctypes.sizeof(_lib.Failure))
        self.assertEqual(_lib.new_stats().size, ctypes.sizeof(_lib.EngineStats))

    def test_transport_names(self):
        names = _lib.transport_names()
        self.assertEqual(names, ["tcp", "cuda", "shm", "ucx"])
        self.assertLessEqual(len(names), _lib.PATHS_MAX)


class Statuses(unittest.TestCase):

    def test_same_codes_both_ways(self):
        c = c_side()["statuses"]
        ours = _lib.statuses()
        self.assertEqual(sorted(set(c) - set(ours)), [],
                         "status.h codes missing in python/kvferry/_lib.py")
        self.assertEqual(sorted(set(ours) - set(c)), [],
                         "python/kvferry/_lib.py codes not in status.h")
        for name, value in c.items():
            self.assertEqual(ours[name], value, name)
            self.assertEqual(_lib.status_name(value), name, "kvf_status_name(%d)" % value)

    def test_constants(self):
        """The header's limits and enum values the binding names, as
        KVF_<its name>; TOKEN_MAX is util/token.h's."""
        c = c_side()["constants"]
        ours = {k: v for k, v in vars(_lib).items()
                if re.fullmatch(r"[A-Z][A-Z0-9_]*", k) and type(v) is int
                and k not in _lib.statuses()}
        self.assertGreater(len(ours), 10)
        for name, value in sorted(ours.items()):
            self.assertIn("KVF_" + name, c, "_lib.%s has no C counterpart in "
                          "tests/unit/abi_layout.c" % name)
            self.assertEqual(value, c["KVF_" + name], "_lib.%s" % name)


class Version(unittest.TestCase):

    def test_one_version(self):
        with open(os.path.join(REPO, "CMakeLists.txt")) as f:
            cmake = re.search(r"project\(kvferry VERSION (\S+)", f.read()).group(1)
        spec = importlib.util.spec_from_file_location(
            "kvferry_build", os.path.join(PYROOT, "_build", "kvferry_build.py"))
        build = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(build)
        self.assertEqual(c_side()["version"], cmake, "KVF_VERSION_* (version.h)")
        self.assertEqual(kvferry.library_version(), cmake, "kvf_version()")
        self.assertEqual(kvferry.__version__, cmake,
                         "python/kvferry/__init__.py's __version__ must be "
                         "CMakeLists.txt's project() version")
        self.assertEqual(build._version(), cmake, "the wheel's version")
        self.assertIn("\nVersion: %s\n" % cmake, build._metadata())


if __name__ == "__main__":
    unittest.main()
