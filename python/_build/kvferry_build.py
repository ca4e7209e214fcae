"""A PEP 517 build backend for the kvferry binding, standard library only.

Why not setuptools: building a wheel with setuptools needs the ``wheel``
package as well (setuptools < 70.1), which a fresh Python often lacks and
which ``pip install`` would then try to download.  The binding is a handful
of .py files plus, optionally, the C library, so writing the wheel (a zip
with a dist-info directory, PEP 427) takes less code than working around
that.  ``requires = []`` in pyproject.toml: installing needs no network,
with or without build isolation.

The wheel bundles ``libkvferry.so`` when one is found: ``$KVFERRY_LIBRARY``
at build time, else ``../build/libkvferry.so`` (the repository's build).
Such a wheel is tagged for this platform; without the library it is pure
Python and the library is found at run time through ``$KVFERRY_LIBRARY``.
Editable installs (``pip install -e``) add a .pth entry for this directory.
"""
import base64
import hashlib
import io
import os
import re
import sysconfig
import tarfile
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PKG = "kvferry"
LIB = "libkvferry.so"


def _version():
    with open(os.path.join(ROOT, PKG, "__init__.py")) as f:
        return re.search(r'^__version__ = "([^"]+)"', f.read(), re.M).group(1)


def _metadata():
    return ("Metadata-Version: 2.1\nName: %s\nVersion: %s\n"
            "Summary: Python binding of kvferry: move LLM KV cache from prefill to "
            "decode servers, room by room (SGLang-style)\n"
            "License: Apache-2.0\nRequires-Python: >=3.8\n" % (PKG, _version()))


def _library():
    env = os.environ.get("KVFERRY_LIBRARY")
    if env:
        if not os.path.isfile(env):
            raise RuntimeError("KVFERRY_LIBRARY=%s: no such file" % env)
        return env
    built = os.path.join(os.path.dirname(ROOT), "build", LIB)
    return built if os.path.isfile(built) else None


def _sources():
    for name in sorted(os.listdir(os.path.join(ROOT, PKG))):
        if name.endswith(".py"):
            yield os.path.join(ROOT, PKG, name), "%s/%s" % (PKG, name)


class _Wheel:
    def __init__(self, path):
        self.zip = zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED)
        self.record = []

    def add(self, arcname, data, mode=0o644):
        info = zipfile.ZipInfo(arcname, date_time=(2020, 1, 1, 0, 0, 0))
        info.external_attr = (0o100000 | mode) << 16
        info.compress_type = zipfile.ZIP_DEFLATED
        self.zip.writestr(info, data)
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
        self.record.append("%s,sha256=%s,%d" % (arcname, digest.decode(), len(data)))

    def close(self, distinfo):
        self.record.append("%s/RECORD,," % distinfo)
        info = zipfile.ZipInfo("%s/RECORD" % distinfo, date_time=(2020, 1, 1, 0, 0, 0))
        self.zip.writestr(info, "\n".join(self.record) + "\n")
        self.zip.close()


def _build(wheel_directory, editable):
    version = _version()
    lib = None if editable else _library()
    tag = "py3-none-" + (re.sub(r"[-.]", "_", sysconfig.get_platform()) if lib
                         else "any")
    name = "%s-%s-%s.whl" % (PKG, version, tag)
    distinfo = "%s-%s.dist-info" % (PKG, version)
    w = _Wheel(os.path.join(wheel_directory, name))
    if editable:
        w.add("%s_editable.pth" % PKG, (ROOT + "\n").encode())
    else:
        for path, arc in _sources():
            with open(path, "rb") as f:
                w.add(arc, f.read())
        if lib:
            with open(lib, "rb") as f:
                w.add("%s/%s" % (PKG, LIB), f.read(), 0o755)
    w.add("%s/METADATA" % distinfo, _metadata().encode())
    w.add("%s/WHEEL" % distinfo, ("Wheel-Version: 1.0\nGenerator: kvferry_build\n"
                                  "Root-Is-Purelib: %s\nTag: %s\n"
                                  % ("false" if lib else "true", tag)).encode())
    w.add("%s/top_level.txt" % distinfo, (PKG + "\n").encode())
    w.close(distinfo)
    return name


# -- PEP 517 / PEP 660 hooks ----------------------------------------------

def get_requires_for_build_wheel(config_settings=None):
    return []


def get_requires_for_build_sdist(config_settings=None):
    return []


def get_requires_for_build_editable(config_settings=None):
    return []


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    return _build(wheel_directory, editable=False)


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    return _build(wheel_directory, editable=True)


def build_sdist(sdist_directory, config_settings=None):
    base = "%s-%s" % (PKG, _version())
    name = base + ".tar.gz"
    with tarfile.open(os.path.join(sdist_directory, name), "w:gz") as tar:
        files = [(p, a) for p, a in _sources()]
        files += [(os.path.join(ROOT, "pyproject.toml"), "pyproject.toml"),
                  (os.path.abspath(__file__), "_build/kvferry_build.py")]
        for path, arc in files:
            tar.add(path, "%s/%s" % (base, arc))
        data = _metadata().encode()
        info = tarfile.TarInfo("%s/PKG-INFO" % base)
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    return name
