"""kvferry.sglang with an ``sglang`` package importable: it must take
SGLang's own KVPoll, KVArgs, StateType, KVTransferMetric, KVTransferError
and DisaggregationMode and subclass its abstract Base classes completely;
and the package the integration patch adds
(integrations/sglang/*.patch: sglang/srt/disaggregation/kvferry/) must
import and export the same classes.  Twice: against the base classes of
0094505da741 and against the newest ones (send's num_kv_tokens,
enable_deferred_decode_kv_release, KVArgs.num_draft_entries = 0, the
newest StateType).

The ``sglang`` here is a stub written for this test (the names and
signatures kvferry.sglang imports, as docs/SGLANG.md lists them), not
SGLang's code: SGLang is not installed on the machines that run this.
"""
import glob
import os
import subprocess
import sys
import tempfile
import textwrap
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))

STUB = {
    "sglang/__init__.py": "",
    "sglang/srt/__init__.py": "",
    "sglang/srt/disaggregation/__init__.py": "",
    "sglang/srt/disaggregation/base/__init__.py":
        "from sglang.srt.disaggregation.base.conn import *\n",
    "sglang/srt/disaggregation/base/conn.py": '''
        import abc, dataclasses, enum
        from typing import Optional

        class StateType(str, enum.Enum):
            MAMBA = "mamba"
            SWA = "swa"

        @dataclasses.dataclass
        class KVTransferMetric:
            transfer_latency_s: Optional[float] = None
            alloc_latency_s: Optional[float] = None
            transfer_total_bytes: Optional[int] = None

        class KVArgs:
            page_size: int

        class KVPoll:
            Failed = 0
            Bootstrapping = 1
            WaitingForInput = 2
            Transferring = 3
            Success = 4

        class BaseKVManager(abc.ABC):
            @abc.abstractmethod
            def __init__(self, args, disaggregation_mode, server_args,
                         is_mla_backend=False): ...
            @abc.abstractmethod
            def register_to_bootstrap(self): ...

        class BaseKVSender(abc.ABC):
            @abc.abstractmethod
            def __init__(self, mgr, bootstrap_addr, bootstrap_room, dest_tp_ranks,
                         pp_rank, req_has_disagg_prefill_dp_rank=False): ...
            @abc.abstractmethod
            def init(self, num_kv_indices, aux_index=None): ...
            @abc.abstractmethod
            def send(self, kv_indices, state_indices=None): ...
            @abc.abstractmethod
            def poll(self): ...
            @abc.abstractmethod
            def failure_exception(self): ...
            def should_send_kv_chunk(self, num_pages, last_chunk):
                return num_pages > 0
            def clear(self): ...
            def abort(self): ...

        class BaseKVReceiver(abc.ABC):
            @abc.abstractmethod
            def __init__(self, mgr, bootstrap_addr, bootstrap_room=None): ...
            @abc.abstractmethod
            def init(self, prefill_dp_rank): ...
            @abc.abstractmethod
            def send_metadata(self, kv_indices, aux_index=None, state_indices=None,
                              decode_prefix_len=None): ...
            @abc.abstractmethod
            def poll(self): ...
            @abc.abstractmethod
            def failure_exception(self): ...
            def clear(self): ...
            def abort(self): ...

        class BaseKVBootstrapServer(abc.ABC):
            @abc.abstractmethod
            def __init__(self, host, port): ...
        ''',
    "sglang/srt/disaggregation/common/__init__.py": "",
    "sglang/srt/disaggregation/common/conn.py": '''
        class KVTransferError(Exception):
            def __init__(self, bootstrap_room, failure_reason,
                         is_from_another_rank=False):
                super().__init__(failure_reason)
                self.bootstrap_room = bootstrap_room
                self.failure_reason = failure_reason
                self.is_from_another_rank = is_from_another_rank
        ''',
    "sglang/srt/disaggregation/utils.py": '''
        from enum import Enum
        class DisaggregationMode(Enum):
            NULL = "null"
            PREFILL = "prefill"
            DECODE = "decode"
        ''',
}

CHECK = r'''
import ctypes, types
import kvferry.sglang as S
from sglang.srt.disaggregation.base import conn as base
from sglang.srt.disaggregation.common.conn import KVTransferError
from sglang.srt.disaggregation.utils import DisaggregationMode
import sglang.srt.disaggregation.kvferry as plugin

assert S.HAVE_SGLANG
assert S.KVPoll is base.KVPoll and S.KVArgs is base.KVArgs
assert S.StateType is base.StateType and S.KVTransferMetric is base.KVTransferMetric
assert S.KVTransferError is KVTransferError and S.DisaggregationMode is DisaggregationMode
for ours, theirs in ((S.KVFerryKVManager, base.BaseKVManager),
                     (S.KVFerryKVSender, base.BaseKVSender),
                     (S.KVFerryKVReceiver, base.BaseKVReceiver),
                     (S.KVFerryKVBootstrapServer, base.BaseKVBootstrapServer)):
    assert issubclass(ours, theirs), ours
    assert not getattr(ours, "__abstractmethods__", None), (ours, ours.__abstractmethods__)
for name in ("KVFerryKVManager", "KVFerryKVSender", "KVFerryKVReceiver",
             "KVFerryKVBootstrapServer"):
    assert getattr(plugin, name) is getattr(S, name), name

a = base.KVArgs()
bufs = [ctypes.create_string_buffer(4096) for _ in range(4)]
a.kv_data_ptrs = [ctypes.addressof(b) for b in bufs]
a.kv_data_lens = [4096] * 4
a.kv_item_lens = [256] * 4
a.aux_data_ptrs, a.aux_data_lens, a.aux_item_lens = [], [], []
a.page_size, a.engine_rank, a.pp_rank, a.system_dp_rank = 4, 0, 0, 0
sa = types.SimpleNamespace(host="127.0.0.1", disaggregation_bootstrap_port=1,
                           tp_size=1, dp_size=1, pp_size=1, device="cpu")
mgr = S.KVFerryKVManager(a, DisaggregationMode.DECODE, sa, False)
rx = S.KVFerryKVReceiver(mgr, "127.0.0.1:1", 5)
assert rx.poll() == base.KVPoll.Bootstrapping
rx.abort()
assert rx.poll() == base.KVPoll.Failed
try:
    rx.failure_exception()
except KVTransferError as e:
    assert (e.bootstrap_room, e.failure_reason, e.is_from_another_rank) == \
        (5, S.ABORT_REASON, False), vars(e)
else:
    raise AssertionError("no KVTransferError")
assert isinstance(rx.get_transfer_metric(), base.KVTransferMetric)
mgr.teardown()
# What the newest schedulers call beyond the base class, on any SGLang.
assert S.KVFerryKVSender.get_max_transfer_tokens(None) is None
assert callable(S.KVFerryKVSender.mark_prefill_complete)
assert S.KVFerryKVManager.enable_deferred_decode_kv_release is False
print("OK")
'''


# The newest base/conn.py differs in these places (docs/SGLANG.md).
NEWEST = {
    'class StateType(str, enum.Enum):\n    MAMBA = "mamba"\n    SWA = "swa"\n':
        'class StateType(str, enum.Enum):\n    MAMBA = "mamba"\n'
        '    QSA_PENDING = "qsa_pending"\n    QSA_COMPRESSED = "qsa_compressed"\n'
        '    SWA = "swa"\n    DSA = "dsa"\n    DSA_TAIL = "dsa_tail"\n'
        '    MINIMAX_INDEX_K = "minimax_index_k"\n    SWA_RING = "swa_ring"\n'
        '    DSV4_REQUEST_STATE = "c128_state"\n    BLOCK_SCALE = "block_scale"\n'
        '    BLOCK_SCALE_SWA = "block_scale_swa"\n',
    "class KVArgs:\n    page_size: int\n":
        "class KVArgs:\n    page_size: int\n    kv_layer_ids: list\n"
        "    rust_http_port: Optional[int]\n    num_draft_entries: int = 0\n",
    "class BaseKVManager(abc.ABC):\n":
        "class BaseKVManager(abc.ABC):\n    enable_deferred_decode_kv_release = False\n",
    "def send(self, kv_indices, state_indices=None): ...":
        "def send(self, kv_indices, state_indices=None, num_kv_tokens=None): ...",
}


def _stub(newest):
    """{path: text} of the stub package, of the old or the newest SGLang."""
    out = {k: textwrap.dedent(v) for k, v in STUB.items()}
    if newest:
        conn = "sglang/srt/disaggregation/base/conn.py"
        for old, new in NEWEST.items():
            assert old in out[conn], old
            out[conn] = out[conn].replace(old, new)
    return out


def _patch_new_files(patch):
    """{path: text} of the files the patch creates (from /dev/null)."""
    out, path, new = {}, None, False
    with open(patch) as f:
        text = f.read()
    for line in text.split("\n"):
        if line.startswith("diff --git"):
            path, new = None, False
        elif line == "--- /dev/null":
            new = True
        elif line.startswith("+++ b/") and new:
            path = line[len("+++ b/"):]
            out[path] = ""
        elif path is not None and line.startswith("+"):
            out[path] += line[1:] + "\n"
    return out


sys.path.insert(0, os.path.dirname(HERE))
from kvferry import _lib  # noqa: E402
from kvferry.sglang import _NEEDS  # noqa: E402

MISSING = [n for n in _NEEDS if not _lib.has(n)]


@unittest.skipIf(MISSING, "libkvferry lacks %s" % ", ".join(MISSING))
class WithSGLang(unittest.TestCase):

    def test_takes_sglangs_types_and_the_patch_imports(self):
        for newest in (False, True):
            with self.subTest(newest=newest):
                self._check(newest)

    def _check(self, newest):
        patches = glob.glob(os.path.join(REPO, "integrations", "sglang", "*.patch"))
        self.assertEqual(len(patches), 1, patches)
        with tempfile.TemporaryDirectory() as tmp:
            for rel, text in _stub(newest).items():
                path = os.path.join(tmp, rel)
                os.makedirs(os.path.dirname(path), exist_ok=True)
                with open(path, "w") as f:
                    f.write(text)
            created = _patch_new_files(patches[0])
            self.assertIn("python/sglang/srt/disaggregation/kvferry/conn.py", created)
            for rel, text in created.items():
                path = os.path.join(tmp, rel[len("python/"):])
                os.makedirs(os.path.dirname(path), exist_ok=True)
                with open(path, "w") as f:
                    f.write(text)
            env = dict(os.environ)
            env["PYTHONPATH"] = os.pathsep.join([tmp, os.path.join(REPO, "python")])
            r = subprocess.run([sys.executable, "-c", CHECK], env=env, timeout=60,
                               capture_output=True, text=True)
            self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
            self.assertIn("OK", r.stdout)


if __name__ == "__main__":
    unittest.main()
