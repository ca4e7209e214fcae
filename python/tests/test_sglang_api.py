"""kvferry.sglang's classes one call at a time, in one process: the names,
values and signatures SGLang uses, KVArgs -> layout (tags for SGLang's
buffer order, MLA, draft, kv_layer_ids, typed state), and the rules
SGLang's schedulers rely on: poll() never past WaitingForInput before
send_metadata, Bootstrapping before init, send() on a failed room never
raises, clear() idempotent, failure_exception() raises KVTransferError,
metrics survive clear()."""
import ctypes
import inspect
import os
import subprocess
import sys
import textwrap
import time
import types
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _util import kvferry  # noqa: E402
from kvferry import _lib  # noqa: E402
from kvferry import sglang as S  # noqa: E402

PS, L, H, D = 4, 2, 2, 8
PAGES = 16
ROW = H * D * 2                      # bytes per token row
NEW_API = all(_lib.has(n) for n in ("kvf_receiver_set_dest", "kvf_sender_set_states",
                                     "kvf_sender_decode_prefix_len"))


def kv_args(mode, draft=False, mla=False, state=False, layer_ids=None):
    """SGLang's KVArgs over ctypes buffers, as its schedulers fill them."""
    a = S.KVArgs()
    row = (576 * 2) if mla else ROW
    n = L if mla else 2 * L
    bufs = [ctypes.create_string_buffer(PAGES * PS * row) for _ in range(n)]
    items = [PS * row] * n
    if draft:
        extra = 1 if mla else 2
        bufs += [ctypes.create_string_buffer(PAGES * PS * row // 2)
                 for _ in range(extra)]
        items += [PS * row // 2] * extra
    a._keep = bufs
    a.kv_data_ptrs = [ctypes.addressof(b) for b in bufs]
    a.kv_data_lens = [ctypes.sizeof(b) for b in bufs]
    a.kv_item_lens = items
    aux = [ctypes.create_string_buffer(8 * 64), ctypes.create_string_buffer(8 * 8)]
    a._aux = aux
    a.aux_data_ptrs = [ctypes.addressof(b) for b in aux]
    a.aux_data_lens = [ctypes.sizeof(b) for b in aux]
    a.aux_item_lens = [64, 8]
    a.state_types = []
    if state:
        st = [ctypes.create_string_buffer(4 * 32), ctypes.create_string_buffer(4 * 16)]
        a._st = st
        a.state_types = [S.StateType.MAMBA]
        a.state_data_ptrs = [[ctypes.addressof(b) for b in st]]
        a.state_data_lens = [[ctypes.sizeof(b) for b in st]]
        a.state_item_lens = [[32, 16]]
    if layer_ids is not None:
        a.kv_layer_ids = layer_ids
    a.page_size = PS
    a.engine_rank = 0
    a.pp_rank = 0
    a.system_dp_rank = 0
    a.gpu_id = 0
    if mode == "prefill":
        if not mla:
            a.kv_head_num = H
            a.total_kv_head_num = H
        a.prefill_start_layer = 0
        a.prefill_end_layer = L
    return a


def server_args(port=1, **kw):
    d = dict(host="127.0.0.1", port=30001, disaggregation_bootstrap_port=port,
             tp_size=1, dp_size=1,
             pp_size=1, kv_cache_dtype="auto", dtype="bfloat16", device="cpu",
             load_balance_method="round_robin", speculative_algorithm=None)
    d.update(kw)
    return types.SimpleNamespace(**d)


def tags(mode, **kw):
    a = kv_args(mode, **{k: v for k, v in kw.items() if k in ("draft", "mla",
                                                              "layer_ids")})
    par = S._parallel(server_args(), a, mode)
    sa = server_args(**{k: v for k, v in kw.items() if k in ("speculative_algorithm",)})
    if "layers" in kw:
        sa.get_hf_config = lambda: types.SimpleNamespace(num_hidden_layers=kw["layers"])
    return S.ferry_args(a, mode, sa, kw.get("mla", False), par).kv_tags


class Vocabulary(unittest.TestCase):
    """The fallbacks have SGLang's names, values and signatures."""

    def test_kvpoll_values(self):
        self.assertEqual([S.KVPoll.Failed, S.KVPoll.Bootstrapping,
                          S.KVPoll.WaitingForInput, S.KVPoll.Transferring,
                          S.KVPoll.Success], [0, 1, 2, 3, 4])

    def test_state_type_and_mode(self):
        self.assertEqual(S.StateType("mamba"), S.StateType.MAMBA)
        # SGLang's newest StateType, in its order; C128_STATE, the older
        # name of DSV4_REQUEST_STATE, kept as an alias of the same value.
        self.assertEqual([t.value for t in S.StateType],
                         ["mamba", "qsa_pending", "qsa_compressed", "swa", "dsa",
                          "dsa_tail", "minimax_index_k", "swa_ring", "c128_state",
                          "block_scale", "block_scale_swa"])
        self.assertIs(S.StateType.C128_STATE, S.StateType.DSV4_REQUEST_STATE)
        self.assertEqual(S.DisaggregationMode("decode"), S.DisaggregationMode.DECODE)

    def test_base_class_defaults(self):
        """What SGLang's base classes give their backends by default, and
        newer schedulers call, kvferry's classes have themselves (without
        SGLang they subclass nothing)."""
        self.assertIs(S.KVFerryKVManager.enable_deferred_decode_kv_release, False)
        for name in ("get_max_transfer_tokens", "mark_prefill_complete",
                     "pop_decode_prefix_len", "should_send_kv_chunk", "clear", "abort",
                     "get_transfer_metric", "failure_exception", "poll", "init", "send"):
            self.assertTrue(callable(getattr(S.KVFerryKVSender, name, None)), name)
        for name in ("init", "send_metadata", "poll", "failure_exception", "clear",
                     "abort", "get_transfer_metric"):
            self.assertTrue(callable(getattr(S.KVFerryKVReceiver, name, None)), name)
        self.assertIn("num_kv_tokens", S.KVFerryKVSender.send.__doc__)

    def test_transfer_error_and_metric(self):
        e = S.KVTransferError(7, "boom", is_from_another_rank=True)
        self.assertEqual((e.bootstrap_room, e.failure_reason, e.is_from_another_rank),
                         (7, "boom", True))
        self.assertTrue(str(e).startswith("KVTransferError(bootstrap_room=7): boom"))
        m = S.KVTransferMetric()
        self.assertEqual((m.transfer_latency_s, m.alloc_latency_s,
                          m.transfer_total_bytes), (None, None, None))
        self.assertEqual(S.KVTransferMetric(1.0, 2.0, 3).transfer_total_bytes, 3)

    def test_signatures(self):
        def params(f):
            return list(inspect.signature(f).parameters)[1:]
        self.assertEqual(params(S.KVFerryKVManager.__init__)[:4],
                         ["args", "disaggregation_mode", "server_args", "is_mla_backend"])
        self.assertEqual(params(S.KVFerryKVSender.__init__)[:6],
                         ["mgr", "bootstrap_addr", "bootstrap_room", "dest_tp_ranks",
                          "pp_rank", "req_has_disagg_prefill_dp_rank"])
        self.assertEqual(params(S.KVFerryKVReceiver.__init__)[:3],
                         ["mgr", "bootstrap_addr", "bootstrap_room"])
        self.assertEqual(params(S.KVFerryKVReceiver.send_metadata)[:4],
                         ["kv_indices", "aux_index", "state_indices",
                          "decode_prefix_len"])
        self.assertEqual(params(S.KVFerryKVSender.init), ["num_kv_indices", "aux_index"])
        self.assertEqual(params(S.KVFerryKVBootstrapServer.__init__)[:2], ["host", "port"])


class Layout(unittest.TestCase):
    """SGLang's buffer order becomes tags; the binding needs no reordering."""

    def test_mha_every_k_then_every_v(self):
        self.assertEqual(tags("prefill"), [(0, 0, 0), (1, 0, 0), (0, 1, 0), (1, 1, 0)])
        self.assertEqual(tags("decode"), tags("prefill"))

    def test_mla_one_buffer_per_layer(self):
        self.assertEqual(tags("prefill", mla=True), [(0, 2, 0), (1, 2, 0)])

    def test_draft_appended_as_group_1(self):
        want = [(0, 0, 0), (1, 0, 0), (0, 1, 0), (1, 1, 0), (0, 0, 1), (0, 1, 1)]
        self.assertEqual(tags("prefill", draft=True, speculative_algorithm="EAGLE"),
                         want)
        # Decode has no prefill_end_layer: the model's layer count splits them.
        self.assertEqual(tags("decode", draft=True, speculative_algorithm="EAGLE",
                              layers=L), want)
        with self.assertRaises(ValueError) as cm:
            tags("decode", draft=True, speculative_algorithm="EAGLE")
        self.assertIn("draft", str(cm.exception))

    def test_kv_layer_ids(self):
        self.assertEqual(tags("decode", layer_ids=[3, 7, 3, 7]),
                         [(3, 0, 0), (7, 0, 0), (3, 1, 0), (7, 1, 0)])

    def test_state_types_become_groups(self):
        a = kv_args("prefill", state=True)
        f = S.ferry_args(a, "prefill", server_args(), False,
                         S._parallel(server_args(), a, "prefill"))
        self.assertEqual([(g.type, g.item_lens) for g in f.state_groups],
                         [("mamba", [32, 16])])

    def test_dtype_auto_is_the_model_dtype(self):
        a = kv_args("prefill")
        f = S.ferry_args(a, "prefill", server_args(), False,
                         S._parallel(server_args(), a, "prefill"))
        self.assertEqual(f.kv_dtype, "bfloat16")

    def test_sglang_deadlines(self):
        a = kv_args("prefill")
        env = {"SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "12",
               "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "0.5"}
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            f = S.ferry_args(a, "prefill", server_args(), False,
                             S._parallel(server_args(), a, "prefill"))
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        self.assertEqual((f.bootstrap_timeout_ms, f.waiting_timeout_ms), (12000, 500))

    def test_device_memory_is_registered_as_cuda(self):
        """--device cuda: KV and state are CUDA memory of gpu_id (aux stays
        host memory), and the library checks that with the CUDA driver; here
        there is none, so the library refuses and says so.  Another device
        is refused naming it."""
        a = kv_args("decode", state=True)
        a.gpu_id = 1
        f = S.ferry_args(a, "decode", server_args(device="cuda"), False,
                         S._parallel(server_args(), a, "decode"))
        self.assertEqual({(b.device.type, b.device.index) for b in f.kv_data_ptrs},
                         {("cuda", 1)})
        self.assertEqual([b.data_ptr() for b in f.kv_data_ptrs], a.kv_data_ptrs)
        self.assertEqual({b.device.index for g in f.state_groups for b in g.data_ptrs},
                         {1})
        self.assertEqual(f.aux_data_ptrs, a.aux_data_ptrs)
        with self.assertRaises(kvferry.KVFerryError) as cm:
            S.KVFerryKVManager(kv_args("decode"), S.DisaggregationMode.DECODE,
                               server_args(device="cuda"))
        self.assertIn("CUDA", str(cm.exception))
        with self.assertRaises(RuntimeError) as cm:
            S.KVFerryKVManager(kv_args("decode"), S.DisaggregationMode.DECODE,
                               server_args(device="npu"))
        self.assertIn("device='npu'", str(cm.exception))

    @unittest.skipUnless(os.environ.get("KVF_FAKE_CUDA"),
                         "KVF_FAKE_CUDA (the fake CUDA driver the build makes) is not set")
    def test_device_memory_with_a_driver(self):
        """With a CUDA driver that calls the pools device memory (the fake
        one), the manager registers them: in a process of its own, since a
        process loads its driver once."""
        code = textwrap.dedent("""
            import ctypes, os, sys
            sys.path.insert(0, %r)
            import test_sglang_api as T
            fake = ctypes.CDLL(os.environ["KVF_CUDA_DRIVER"])
            a = T.kv_args("decode", state=True)
            for p, n in zip(a.kv_data_ptrs + sum(a.state_data_ptrs, []),
                            a.kv_data_lens + sum(a.state_data_lens, [])):
                fake.fake_cuda_add(ctypes.c_void_p(p), ctypes.c_size_t(n), 0)
            m = T.S.KVFerryKVManager(a, T.S.DisaggregationMode.DECODE,
                                     T.server_args(device="cuda"))
            m.teardown()
            print("OK")
        """ % os.path.dirname(os.path.abspath(__file__)))
        env = dict(os.environ, KVF_CUDA_DRIVER=os.environ["KVF_FAKE_CUDA"])
        r = subprocess.run([sys.executable, "-c", code], env=env, timeout=60,
                           capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        self.assertIn("OK", r.stdout)

    def test_newer_kv_args_fields(self):
        """Each field newer SGLang added is honoured or refused by name."""
        par = S._parallel(server_args(), kv_args("prefill"), "prefill")
        a = kv_args("prefill", state=True)
        a.kv_cache_dtype_str = "fp8_e4m3"
        a.state_layer_ids = [[0, 1]]
        a.state_slice_outer_counts = [[1, 1]]
        a.rust_http_port = None
        f = S.ferry_args(a, "prefill", server_args(kv_cache_dtype="auto"), False, par)
        self.assertEqual((f.kv_cache_dtype, f.kv_dtype), ("fp8_e4m3", "fp8_e4m3"))
        a.state_layer_ids = [[0]]
        with self.assertRaisesRegex(ValueError, "state_layer_ids"):
            S.ferry_args(a, "prefill", server_args(), False, par)
        a.state_layer_ids = [[0, 1], [2]]
        with self.assertRaisesRegex(ValueError, "state_layer_ids"):
            S.ferry_args(a, "prefill", server_args(), False, par)
        # rust_http_port: SGLang's own Rust registry; with attention DP it
        # copies rows between listeners, which kvferry's engines do not join.
        b = kv_args("prefill")
        b.rust_http_port = 8000
        with self.assertRaisesRegex(RuntimeError, "rust_http_port=8000"):
            S.KVFerryKVManager(b, S.DisaggregationMode.PREFILL,
                               server_args(tp_size=2, dp_size=2,
                                           enable_dp_attention=True))
        with self.assertRaisesRegex(RuntimeError, "rust_http_port=8000.*prefill_complete"):
            S.KVFerryKVManager(b, S.DisaggregationMode.PREFILL, server_args(
                disaggregation_decode_allocation_policy="prefill_complete"))
        # dcp moved from KVArgs to the server arguments: refused either way.
        with self.assertRaisesRegex(RuntimeError, "dcp_size=2"):
            S.KVFerryKVManager(kv_args("decode"), S.DisaggregationMode.DECODE,
                               server_args(dcp_size=2))

    def test_dsa_tail_is_refused(self):
        a = kv_args("prefill", state=True)
        a.state_types = [S.StateType.DSA_TAIL]
        with self.assertRaisesRegex(RuntimeError, "'dsa_tail'.*descriptor"):
            S.ferry_args(a, "prefill", server_args(), False,
                         S._parallel(server_args(), a, "prefill"))

    def test_checksum_policy_and_api_key(self):
        """SGLang's --disaggregation-enable-kv-checksum turns kvferry's own
        checksum on; the prefill registers its decode allocation policy;
        --api-key is the token's last source."""
        a = kv_args("prefill")
        par = S._parallel(server_args(), a, "prefill")
        f = S.ferry_args(a, "prefill", server_args(), False, par)
        self.assertIsNone(f.checksum)
        self.assertIsNone(f.decode_allocation_policy)
        f = S.ferry_args(a, "prefill", server_args(
            disaggregation_enable_kv_checksum=True, api_key="k" * 32,
            disaggregation_decode_allocation_policy="prefill_complete"), False, par)
        self.assertTrue(f.checksum)
        self.assertEqual(f.decode_allocation_policy, "prefill_complete")
        self.assertEqual(f.api_key, "k" * 32)


@unittest.skipUnless(NEW_API, "libkvferry lacks the two-phase receiver API")
class Rooms(unittest.TestCase):
    """One prefill and one decode manager in this process."""

    @classmethod
    def setUpClass(cls):
        cls.boot = S.KVFerryKVBootstrapServer(host="127.0.0.1", port=0)
        cls.addr = "127.0.0.1:%d" % cls.boot.port
        sa = server_args(cls.boot.port)
        cls.pa, cls.da = kv_args("prefill", state=True), kv_args("decode", state=True)
        cls.pm = S.KVFerryKVManager(cls.pa, S.DisaggregationMode.PREFILL, sa, False)
        cls.dm = S.KVFerryKVManager(cls.da, S.DisaggregationMode.DECODE, sa, False)
        cls.room = 1000

    @classmethod
    def tearDownClass(cls):
        cls.pm.teardown()
        cls.dm.teardown()
        cls.boot.close()

    def next_room(self):
        type(self).room += 1
        return self.room

    def wait(self, h, states, timeout=20):
        deadline = time.monotonic() + timeout
        while h.poll() not in states and time.monotonic() < deadline:
            time.sleep(0.002)
        return h.poll()

    def test_registry_info_and_order_of_states(self):
        deadline = time.monotonic() + 20
        while not self.dm.try_ensure_parallel_info(self.addr):
            self.assertLess(time.monotonic(), deadline, "no parallel info")
            time.sleep(0.01)
        info = self.dm.prefill_info_table[self.addr]
        self.assertEqual((info.dp_size, info.attn_tp_size, info.page_size), (1, 1, PS))
        # Registered from the server's real configuration: SGLang's own
        # --kv-cache-dtype string, --load-balance-method and --port.
        self.assertEqual((info.kv_cache_dtype, info.follow_bootstrap_room,
                          info.prefill_http_port), ("auto", False, 30001))
        room = self.next_room()
        rx = S.KVFerryKVReceiver(self.dm, self.addr, room)
        tx = S.KVFerryKVSender(self.pm, self.addr, room, [0], 0)
        self.assertEqual(rx.poll(), S.KVPoll.Bootstrapping)     # before init
        rx.init(0)
        self.assertEqual(self.wait(rx, (S.KVPoll.WaitingForInput, S.KVPoll.Failed)),
                         S.KVPoll.WaitingForInput)
        self.assertEqual(tx.poll(), S.KVPoll.Bootstrapping)     # no pages yet
        rx.send_metadata([3, 4], 1, [[2]], decode_prefix_len=0)
        self.assertEqual(self.wait(tx, (S.KVPoll.WaitingForInput, S.KVPoll.Failed)),
                         S.KVPoll.WaitingForInput)
        self.assertEqual(tx.pop_decode_prefix_len(), 0)
        self.assertEqual(tx.pop_decode_prefix_len(), 0)         # popped: 0 again
        tx.init(2, 0)
        self.assertFalse(tx.should_send_kv_chunk(0, False))
        self.assertTrue(tx.should_send_kv_chunk(0, True))
        tx.send([5], None, 0)                       # extra positional: tolerated
        tx.send([6], [[1]], num_kv_tokens=8)        # last: reaches the count
        self.assertEqual(self.wait(rx, (S.KVPoll.Success, S.KVPoll.Failed)),
                         S.KVPoll.Success)
        self.assertEqual(self.wait(tx, (S.KVPoll.Success, S.KVPoll.Failed)),
                         S.KVPoll.Success)
        tx.clear()
        tx.clear()
        rx.clear()
        self.assertEqual((tx.poll(), rx.poll()), (S.KVPoll.Success, S.KVPoll.Success))
        m = tx.get_transfer_metric()                # after clear, as SGLang asks
        self.assertEqual(m.transfer_total_bytes, 2 * 4 * PS * ROW + 64 + 8 + 32 + 16)
        self.assertIsNotNone(m.alloc_latency_s)

    def test_abort_after_success_fails_the_room(self):
        """SGLang's AbortReq on a room already done still aborts it."""
        room = self.next_room()
        rx = S.KVFerryKVReceiver(self.dm, self.addr, room)
        tx = S.KVFerryKVSender(self.pm, self.addr, room, [0], 0)
        rx.init(0)
        self.wait(rx, (S.KVPoll.WaitingForInput, S.KVPoll.Failed))
        rx.send_metadata([], 2, [None], decode_prefix_len=8)      # full prefix hit
        self.assertEqual(self.wait(tx, (S.KVPoll.WaitingForInput, S.KVPoll.Failed)),
                         S.KVPoll.WaitingForInput)
        self.assertEqual(tx.pop_decode_prefix_len(), 8)
        tx.init(0, 1)
        tx.send([], [None])
        self.assertEqual(self.wait(rx, (S.KVPoll.Success, S.KVPoll.Failed)),
                         S.KVPoll.Success)
        rx.abort()
        self.assertEqual(rx.poll(), S.KVPoll.Failed)
        with self.assertRaises(S.KVTransferError) as cm:
            rx.failure_exception()
        self.assertEqual(cm.exception.failure_reason, S.ABORT_REASON)
        self.assertEqual(self.wait(tx, (S.KVPoll.Success, S.KVPoll.Failed)),
                         S.KVPoll.Success)
        tx.clear()

    def test_failed_room_send_never_raises(self):
        room = self.next_room()
        tx = S.KVFerryKVSender(self.pm, self.addr, room, [0], 0)
        tx.abort()
        self.assertEqual(tx.poll(), S.KVPoll.Failed)
        tx.init(3, 0)
        tx.send([1, 2, 3], [[0]])                   # no exception
        with self.assertRaises(S.KVTransferError) as cm:
            tx.failure_exception()
        self.assertEqual((cm.exception.failure_reason, cm.exception.is_from_another_rank),
                         (S.ABORT_REASON, False))
        with self.assertRaises(S.KVTransferError):
            tx.failure_exception()                  # again: the same error
        tx.clear()
        self.assertEqual(tx.poll(), S.KVPoll.Failed)

    def test_refused_metadata_fails_the_room(self):
        room = self.next_room()
        rx = S.KVFerryKVReceiver(self.dm, self.addr, room)
        rx.send_metadata([1], 0)                    # before init: ignored
        rx.init(0)
        self.wait(rx, (S.KVPoll.WaitingForInput, S.KVPoll.Failed))
        rx.send_metadata([1, 1], 0, [[0]])          # a page twice
        self.assertEqual(rx.poll(), S.KVPoll.Failed)
        with self.assertRaises(S.KVTransferError) as cm:
            rx.failure_exception()
        self.assertIn("appears twice", cm.exception.failure_reason)
        self.assertFalse(cm.exception.is_from_another_rank)
        rx.clear()

    def test_allocation_policy(self):
        """prefill_complete on both sides: the decode's room stays
        Bootstrapping (connected) until the prefill marks it computed; a
        decode whose policy differs from the prefill's fails the room
        naming both."""
        boot = S.KVFerryKVBootstrapServer(host="127.0.0.1", port=0)
        addr = "127.0.0.1:%d" % boot.port
        sa = server_args(boot.port,
                         disaggregation_decode_allocation_policy="prefill_complete")
        pm = S.KVFerryKVManager(kv_args("prefill"), S.DisaggregationMode.PREFILL, sa)
        dm = S.KVFerryKVManager(kv_args("decode"), S.DisaggregationMode.DECODE, sa)
        early = S.KVFerryKVManager(kv_args("decode"), S.DisaggregationMode.DECODE,
                                   server_args(boot.port))
        try:
            deadline = time.monotonic() + 20
            while not (dm.try_ensure_parallel_info(addr) and
                       early.try_ensure_parallel_info(addr)):
                self.assertLess(time.monotonic(), deadline, "no parallel info")
                time.sleep(0.01)
            self.assertEqual(dm.prefill_info_table[addr].decode_allocation_policy,
                             "prefill_complete")
            room = self.next_room()
            tx = S.KVFerryKVSender(pm, addr, room, [0], 0)
            rx = S.KVFerryKVReceiver(dm, addr, room)
            rx.init(0)
            while rx._h.poll() < S.KVPoll.WaitingForInput:       # connected
                self.assertLess(time.monotonic(), deadline, "not connected")
                time.sleep(0.005)
            self.assertEqual(rx.poll(), S.KVPoll.Bootstrapping)
            tx.mark_prefill_complete()
            self.assertEqual(self.wait(rx, (S.KVPoll.WaitingForInput, S.KVPoll.Failed)),
                             S.KVPoll.WaitingForInput)
            other = S.KVFerryKVReceiver(early, addr, self.next_room())
            other.init(0)
            self.assertEqual(other.poll(), S.KVPoll.Failed)
            with self.assertRaises(S.KVTransferError) as cm:
                other.failure_exception()
            self.assertIn("Decode allocation policy mismatch: prefill server %s has "
                          "--disaggregation-decode-allocation-policy prefill_complete, "
                          "but decode server has early" % addr,
                          cm.exception.failure_reason)
            for h in (rx, tx):
                h.abort()
                h.clear()
        finally:
            for m in (pm, dm, early):
                m.teardown()
            boot.close()

    def test_prefill_failure_reaches_a_waiting_decode(self):
        """prefill_complete: a room the prefill aborts before it was ready
        fails on a decode rank whose sibling's scheduler failed it first
        (the all-reduce), with the prefill's reason, though this rank's
        library room never hears of it (no destination sent, so no
        prefill rank knows it) or does not exist yet (before init): its
        failure_exception() waits for the registry's word too."""
        boot = S.KVFerryKVBootstrapServer(host="127.0.0.1", port=0)
        addr = "127.0.0.1:%d" % boot.port
        sa = server_args(boot.port,
                         disaggregation_decode_allocation_policy="prefill_complete")
        pm = S.KVFerryKVManager(kv_args("prefill"), S.DisaggregationMode.PREFILL, sa)
        dm = S.KVFerryKVManager(kv_args("decode"), S.DisaggregationMode.DECODE, sa)
        try:
            deadline = time.monotonic() + 20
            while not dm.try_ensure_parallel_info(addr):
                self.assertLess(time.monotonic(), deadline, "no parallel info")
                time.sleep(0.01)
            room = self.next_room()
            tx = S.KVFerryKVSender(pm, addr, room, [0], 0)
            opened = S.KVFerryKVReceiver(dm, addr, room)
            opened.init(0)
            while opened._h.poll() < S.KVPoll.WaitingForInput:     # connected
                self.assertLess(time.monotonic(), deadline, "not connected")
                time.sleep(0.005)
            unopened = S.KVFerryKVReceiver(dm, addr, room)          # before init
            tx.abort()
            with self.assertRaises(S.KVTransferError):
                tx.failure_exception()
            # The prefill's post is on the registry before either rank asks.
            board = pm.readiness()
            board.watch(addr, room)
            self.assertEqual(board.wait(room, 20), ("failed", "prefill rank 0: " +
                                                    S.ABORT_REASON))
            board.forget(room)
            self.assertNotEqual(opened._h.poll(), S.KVPoll.Failed)
            for rx in (opened, unopened):
                with self.assertRaises(S.KVTransferError) as cm:
                    rx.failure_exception()
                e = cm.exception
                self.assertTrue(e.is_from_another_rank)
                self.assertIn("the prefill server at %s failed room %d before the room was "
                              "ready for this decode server: prefill rank 0: %s"
                              % (addr, room, S.ABORT_REASON), e.failure_reason)
                self.assertEqual(rx.poll(), S.KVPoll.Failed)
        finally:
            for m in (pm, dm):
                m.teardown()
            boot.close()

    def test_bootstrap_server_thread_and_api_key(self):
        """Newer SGLang runs the bootstrap server in a process of its own and
        waits on its thread; with only SGLang's --api-key the registry takes
        it as its token."""
        saved = {k: os.environ.pop(k, None) for k in (
            "KVF_AUTH_TOKEN", "KVF_AUTH_TOKEN_FILE",
            "SGLANG_DISAGGREGATION_BOOTSTRAP_AUTH_TOKEN")}
        try:
            b = S.KVFerryKVBootstrapServer(host="127.0.0.1", port=0,
                                           api_key="api-key-0123456789abcdef")
            self.assertEqual(b._server.access, "token")
            self.assertTrue(b.thread.is_alive())
            self.assertEqual(S._auth_headers("api-key-0123456789abcdef"),
                             {"Authorization": "Bearer api-key-0123456789abcdef"})
            b.close()
            b.thread.join(timeout=10)
            self.assertFalse(b.thread.is_alive())
        finally:
            os.environ.update({k: v for k, v in saved.items() if v is not None})

    def test_abort_before_init(self):
        rx = S.KVFerryKVReceiver(self.dm, self.addr, self.next_room())
        rx.abort()
        self.assertEqual(rx.poll(), S.KVPoll.Failed)
        rx.init(0)                                  # nothing to start
        with self.assertRaises(S.KVTransferError) as cm:
            rx.failure_exception()
        self.assertEqual(cm.exception.failure_reason, S.ABORT_REASON)


@unittest.skipUnless(NEW_API, "libkvferry lacks the two-phase receiver API")
class HostileInputs(unittest.TestCase):
    """What a request (bootstrap_host, bootstrap_port, bootstrap_room,
    data_parallel_rank) and the scheduler (page indices, counts) hand the
    backend, hostile: no call raises into SGLang's scheduler, the room
    fails, and its KVTransferError says which argument and why."""

    @classmethod
    def setUpClass(cls):
        cls.boot = S.KVFerryKVBootstrapServer(host="127.0.0.1", port=0)
        cls.addr = "127.0.0.1:%d" % cls.boot.port
        sa = server_args(cls.boot.port)
        cls.pa, cls.da = kv_args("prefill", state=True), kv_args("decode", state=True)
        cls.pm = S.KVFerryKVManager(cls.pa, S.DisaggregationMode.PREFILL, sa, False)
        cls.dm = S.KVFerryKVManager(cls.da, S.DisaggregationMode.DECODE, sa, False)
        cls.room = 5000

    @classmethod
    def tearDownClass(cls):
        cls.pm.teardown()
        cls.dm.teardown()
        cls.boot.close()

    def next_room(self):
        type(self).room += 1
        return self.room

    def reason(self, h):
        self.assertEqual(h.poll(), S.KVPoll.Failed)
        with self.assertRaises(S.KVTransferError) as cm:
            h.failure_exception()
        return cm.exception.failure_reason

    def ready_receiver(self):
        rx = S.KVFerryKVReceiver(self.dm, self.addr, self.next_room())
        rx.init(0)
        deadline = time.monotonic() + 20
        while rx.poll() == S.KVPoll.Bootstrapping and time.monotonic() < deadline:
            time.sleep(0.002)
        self.assertEqual(rx.poll(), S.KVPoll.WaitingForInput)
        return rx

    def test_room_numbers(self):
        cases = [("abc", "must be an integer, got str"), (-1, "bootstrap_room = -1 is outside"),
                 (2 ** 64, "is outside 0..18446744073709551615"), (1.5, "got 1.5"),
                 (float("nan"), "got nan"), (True, "got True"), ([1], "got list"),
                 ("\ud800", "got str")]
        for room, why in cases:
            with self.subTest(room=ascii(room)):
                rx = S.KVFerryKVReceiver(self.dm, self.addr, room)
                self.assertEqual(rx.poll(), S.KVPoll.Bootstrapping)
                rx.init(0)
                self.assertIn(why, self.reason(rx))
                tx = S.KVFerryKVSender(self.pm, self.addr, room, [0], 0)
                tx.init(1, 0)
                tx.send([1])
                self.assertIn(why, self.reason(tx))

    def test_registry_addresses(self):
        cases = {"\ud800:8998": "lone surrogate U+D800", "10.0.0.1\x00:8998": "U+0000",
                 "evil.example/x?y=:8998": "neither a host name", "host": "is not 'host:port'",
                 "::1:8998": "IPv6 address goes in brackets", "h:0": "port '0'",
                 "h:99999": "port '99999'", "h:8998\n": "U+000A", "h:٣": "port '٣'",
                 "[::1:8998": "is not '[IPv6 address]:port'", "": "is empty",
                 "a" * 300 + ":1": "longer than"}
        for addr, why in cases.items():
            with self.subTest(addr=ascii(addr)):
                rx = S.KVFerryKVReceiver(self.dm, addr, self.next_room(), prefill_dp_rank=0)
                self.assertIn(why, self.reason(rx))
                tx = S.KVFerryKVSender(self.pm, addr, self.next_room(), [0], 0)
                self.assertIn(why, self.reason(tx))
                with self.assertLogs("kvferry.sglang", "WARNING") as logs:
                    S._quota._start = None                  # a new quota window
                    self.assertFalse(self.dm.try_ensure_parallel_info(addr))
                self.assertIn(why, logs.output[0])
                self.assertNotIn(addr, self.dm.prefill_info_table)

    def test_failed_before_init(self):
        # SGLang's all-reduce can fail a request on a decode rank that has
        # not called init() yet (the prefill's parallel info still on its
        # way): no room, so no cause can reach it, and it says so.
        rx = S.KVFerryKVReceiver(self.dm, self.addr, self.next_room())
        with self.assertRaises(S.KVTransferError) as cm:
            rx.failure_exception()
        self.assertTrue(cm.exception.is_from_another_rank)
        self.assertIn("this rank had not opened its room yet", cm.exception.failure_reason)
        self.assertEqual(rx.poll(), S.KVPoll.Failed)

    def test_prefill_dp_ranks(self):
        for dp, why in {-1: "prefill_dp_rank = -1", 2 ** 40: "is outside 0..2147483647",
                        "0": "got str", 0.5: "got 0.5"}.items():
            with self.subTest(dp=dp):
                rx = S.KVFerryKVReceiver(self.dm, self.addr, self.next_room())
                rx.init(dp)
                self.assertIn(why, self.reason(rx))

    def test_destinations(self):
        # A page past the pool, and other bad destinations, refused in the
        # binding before the library: the room fails, with the index named.
        cases = [
            (([1, PAGES], 0), "kv_indices[1] = %d is outside the registered KV pages "
             "(%d KV pages: valid indices are 0..%d)" % (PAGES, PAGES, PAGES - 1)),
            (([2 ** 32], 0), "kv_indices[0] = 4294967296 does not fit in 32 bits"),
            (([-1], 0), "kv_indices[0] = -1 is negative"),
            (([1.0], 0), "kv_indices[0] is 1.0 (float)"),
            (([[1]], 0), "kv_indices[0] is [1] (list)"),
            (("1", 0), "kv_indices must be"),
            ((5, 0), "kv_indices must be"),
            (([1], 8), "aux_index = 8 is outside the registered aux slots (8 aux slots: "
             "valid indices are 0..7)"),
            (([1], -1), "aux_index = -1 is outside"),
            (([1], None), "aux_index is required"),
            (([1], 0, 7), "state_indices must be one entry per state type"),
            (([1], 0, [[0]], -4), "decode_prefix_len = -4 is outside"),
            (([1], 0, [[0]], float("nan")), "decode_prefix_len must be an integer"),
        ]
        for args, why in cases:
            with self.subTest(args=ascii(args)):
                rx = self.ready_receiver()
                rx.send_metadata(*args)
                self.assertEqual(rx.poll(), S.KVPoll.Failed)
                with self.assertRaises(S.KVTransferError) as cm:
                    rx.failure_exception()
                e = cm.exception
                self.assertIn(why, e.failure_reason)
                self.assertIn("refused on decode rank 0", e.failure_reason)
                # The refusal is this rank's own cause, and it says so.
                self.assertFalse(e.is_from_another_rank)
                self.assertEqual((e.origin_side, e.origin_rank, e.origin_addr, e.status),
                                 ("decode", 0, self.dm.engine.address,
                                  "KVF_ERR_BAD_INDICES"))
                rx.clear()

    def test_sender_calls(self):
        for call, why in [(lambda tx: tx.init("3", 0), "num_kv_indices must be an integer"),
                          (lambda tx: tx.init(-1, 0), "num_kv_indices = -1 is outside"),
                          (lambda tx: tx.init(float("inf"), 0), "got inf"),
                          (lambda tx: (tx.init(2, 0), tx.send(7)), "kv_indices is a int"),
                          (lambda tx: (tx.init(1, 0), tx.send([1], 5)), "KVSender.send"),
                          (lambda tx: (tx.init(1, 0), tx.send([PAGES])), "outside the "
                           "registered KV pages")]:
            with self.subTest(why):
                tx = S.KVFerryKVSender(self.pm, self.addr, self.next_room(), [0], 0)
                call(tx)
                self.assertIn(why, self.reason(tx))
                tx.clear()

    def test_registry_answers(self):
        good = {"attn_tp_size": 2, "attn_cp_size": 1, "dp_size": 1, "pp_size": 1,
                "page_size": 16, "kv_cache_dtype": "auto", "follow_bootstrap_room": True,
                "prefill_http_port": None, "later": [1]}
        self.assertEqual(S.PrefillServerInfo.from_json(good).attn_tp_size, 2)
        for change, why in [({"dp_size": 0}, "dp_size must be an integer in 1..65536, got 0"),
                            ({"attn_tp_size": "2"}, "got a str"),
                            ({"pp_size": True}, "got a bool"),
                            ({"page_size": 2 ** 40}, "page_size must be"),
                            ({"kv_cache_dtype": "\ud800"}, "lone surrogate"),
                            ({"follow_bootstrap_room": 1}, "must be true or false"),
                            ({"prefill_http_port": 70000}, "1..65535 or null")]:
            with self.subTest(why), self.assertRaisesRegex(ValueError, why):
                S.PrefillServerInfo.from_json(dict(good, **change))
        for junk in ([1, 2], "x", None, 3):
            with self.assertRaisesRegex(ValueError, "not a JSON object"):
                S.PrefillServerInfo.from_json(junk)

    def test_seeded_hostile_arguments(self):
        """Hostile values (``_junk``) for every argument the scheduler hands a
        room: nothing raises, and a refused room fails with a reason."""
        import random
        from _junk import Junk
        seed = int(os.environ.get("KVF_FUZZ_SEED") or random.SystemRandom().randrange(2 ** 32))
        rng = random.Random(seed)
        junk = Junk(rng, python=True)       # what a scheduler could hand over
        deadline = time.monotonic() + 10
        for i in range(150):
            if time.monotonic() > deadline:
                break
            where = "KVF_FUZZ_SEED=%d case %d" % (seed, i)
            rx = self.ready_receiver()
            args = [junk.value() if rng.random() < 0.5 else v
                    for v in ([1, 2], 0, [[0]], 0)]
            try:
                rx.send_metadata(*args)
                state = rx.poll()
            except Exception as e:              # never into SGLang's scheduler
                self.fail("%s: send_metadata raised %r" % (where, e))
            if state == S.KVPoll.Failed:
                self.assertIn("refused on decode rank 0", self.reason(rx), where)
            rx.abort()
            rx.clear()
            tx = S.KVFerryKVSender(self.pm, self.addr, self.next_room(), [0], 0)
            try:
                tx.init(junk.value() if rng.random() < 0.5 else 2, junk.value())
                tx.send(junk.value(), junk.value())
                tx.poll()
            except Exception as e:
                self.fail("%s: a sender call raised %r" % (where, e))
            tx.abort()
            tx.clear()


if __name__ == "__main__":
    unittest.main()
