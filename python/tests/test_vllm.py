"""kvferry.vllm.KVFerryConnector, without vLLM.

In process: the module imports without vLLM, the scheduler side's answers
(params validation, the ids P hands off, never a None metadata), and the
layouts register_kv_caches accepts or refuses.

Across processes: a prefill instance and a decode instance, each a
``_vllm_instance.py`` process (a scheduler-side connector plus one
worker-side connector per TP rank, stepped as vLLM steps them), and this
test as the proxy (vLLM's toy_proxy_server: the request to P with
do_remote_decode, P's kv_transfer_params to D).  Every byte is checked
with numpy, per layer, K and V, every head of every token.
"""
import os
import subprocess
import sys
import types
import unittest

import numpy as np

from _util import Peer, descriptor, kvferry
from kvferry import vllm as V

TIMEOUT = 60.0


def config(role="kv_both", extra=None, tp=1, block_size=4):
    return types.SimpleNamespace(
        kv_transfer_config=types.SimpleNamespace(
            kv_role=role, engine_id="e-%s" % role, kv_connector_extra_config=extra or {}),
        parallel_config=types.SimpleNamespace(tensor_parallel_size=tp),
        cache_config=types.SimpleNamespace(block_size=block_size))


def request(rid, tokens, params, status="FINISHED_LENGTH_CAPPED"):
    return types.SimpleNamespace(request_id=rid, prompt_token_ids=list(range(tokens)),
                                 kv_transfer_params=params,
                                 status=types.SimpleNamespace(name=status))


class _Blocks:
    def __init__(self, ids):
        self.ids = ids

    def get_unhashed_block_ids(self):
        return list(self.ids)


class ImportTest(unittest.TestCase):
    def test_imports_without_vllm(self):
        # A fresh interpreter: importing the module creates no engine, binds
        # no port and starts no thread.
        code = ("import threading, kvferry.vllm as v; "
                "assert not v.HAVE_VLLM; assert threading.active_count() == 1; "
                "print(v.KVFerryConnector.__mro__[1].__name__)")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=60, env=dict(os.environ))
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertEqual(out.stdout.strip(), "KVConnectorBase_V1")


class SchedulerTest(unittest.TestCase):
    def setUp(self):
        self.c = V.KVFerryConnector(config(), V.KVConnectorRole.SCHEDULER)
        self.c.set_xfer_handshake_metadata(
            {0: V.KVFerryHandshakeMetadata(tp_rank=0, descriptor=descriptor())})

    def test_prefill_hands_off(self):
        r = request("p-1", 10, {"do_remote_decode": True, "do_remote_prefill": False})
        self.assertEqual(self.c.get_num_new_matched_tokens(r, 0), (0, False))
        self.c.update_state_after_alloc(r, _Blocks([3, 4, 5]), 0)
        delay, params = self.c.request_finished(r, [3, 4, 5])
        self.assertTrue(delay)
        self.assertEqual(params["remote_block_ids"], [3, 4, 5])
        self.assertEqual(params["remote_request_id"], "p-1")
        self.assertEqual(params["kvferry_descriptors"], [descriptor()])
        self.assertEqual(params["tp_size"], 1)
        self.assertTrue(params["do_remote_prefill"])
        self.assertIsNone(V.check_params(params, 10, 4))
        meta = self.c.build_connector_meta(None)
        self.assertEqual(list(meta.reqs_to_hold), ["p-1"])
        self.assertEqual((meta.reqs_to_hold["p-1"].room, meta.reqs_to_hold["p-1"].instance),
                         kvferry.room_key("p-1"))
        self.assertEqual(self.c.build_connector_meta(None).reqs_to_hold, {})

    def test_aborted_prefill_frees_at_once(self):
        r = request("p-2", 10, {"do_remote_decode": True}, status="FINISHED_ABORTED")
        self.assertEqual(self.c.request_finished(r, [1, 2, 3]), (False, None))
        self.assertEqual(self.c.build_connector_meta(None).reqs_to_hold, {})

    def test_no_descriptors_no_handoff(self):
        c = V.KVFerryConnector(config(tp=2), V.KVConnectorRole.SCHEDULER)
        c.set_xfer_handshake_metadata(
            {0: V.KVFerryHandshakeMetadata(tp_rank=0, descriptor=descriptor(0, 2))})  # no 1
        r = request("p-3", 4, {"do_remote_decode": True})
        self.assertEqual(c.request_finished(r, [1]), (False, None))

    def params(self, **change):
        p = {"do_remote_prefill": True, "do_remote_decode": False,
             "remote_block_ids": [7, 8, 9], "remote_engine_id": "P",
             "remote_request_id": "p-1-abcd", "tp_size": 1,
             "kvferry_descriptors": [descriptor()]}
        p.update(change)
        return p

    def test_decode_reads(self):
        r = request("d-1", 10, self.params())
        self.assertEqual(self.c.get_num_new_matched_tokens(r, 4), (6, True))
        self.assertEqual(self.c.get_num_new_matched_tokens(r, 4), (6, True))  # no side effect
        self.c.update_state_after_alloc(r, _Blocks([20, 21]), 6)
        self.assertFalse(r.kv_transfer_params["do_remote_prefill"])
        self.c.update_state_after_alloc(r, _Blocks([19, 20, 21]), 0)          # second call
        meta = self.c.build_connector_meta(None)
        rm = meta.reqs_to_recv["d-1"]
        self.assertEqual((rm.local_block_ids, rm.remote_block_ids), ([20, 21], [7, 8, 9]))
        self.assertEqual((rm.room, rm.instance), kvferry.room_key("p-1-abcd"))
        self.assertEqual(self.c.request_finished(r, [19, 20, 21]), (False, None))
        self.assertEqual(self.c.build_connector_meta(None).reqs_to_recv, {})

    def test_invalid_params_refused(self):
        # Each refused with one warning naming the field; every method the
        # params reach goes on (no exception), and the request reads nothing.
        long_id = "p" * (V.ID_MAX_BYTES + 1)
        bad = {
            "remote_block_ids must be the non-empty list": self.params(remote_block_ids=[]),
            "remote_block_ids[1] = -2 is not a block id": self.params(
                remote_block_ids=[1, -2, 3]),
            "remote_block_ids[0] = a 73-bit integer": self.params(
                remote_block_ids=[2 ** 72, 1, 2]),
            "remote_block_ids[2] is a float": self.params(remote_block_ids=[1, 2, 3.0]),
            "remote_block_ids[0] is a bool": self.params(remote_block_ids=[True, 2, 3]),
            "has 2 blocks but the prompt needs 3": self.params(remote_block_ids=[1, 2]),
            "remote_request_id (P's request id) is a int": self.params(remote_request_id=17),
            "remote_request_id (P's request id) is empty": self.params(remote_request_id=""),
            "holds a lone surrogate U+D800 at position 0": self.params(
                remote_request_id="\ud800"),
            "holds the control character U+0000 at position 3": self.params(
                remote_request_id="p-1\x00x"),
            "holds the control character U+000A": self.params(remote_engine_id="P\nforged"),
            "is longer than %d bytes" % V.ID_MAX_BYTES: self.params(remote_request_id=long_id),
            "remote_engine_id (P's engine id) is missing": self.params(remote_engine_id=None),
            "kvferry_descriptors must be the list": self.params(
                kvferry_descriptors=descriptor()),
            "kvferry_descriptors[0]: field tp='1/1' is not valid": self.params(
                kvferry_descriptors=[descriptor(tp="1/1")]),
            "kvferry_descriptors[0]: character U+D800": self.params(
                kvferry_descriptors=[descriptor() + "\ud800"]),
            "kvferry_descriptors[0]: a descriptor must be a str": self.params(
                kvferry_descriptors=[["kvf1"]]),
            "descriptor 0 is a decode engine's": self.params(
                kvferry_descriptors=[descriptor(role="decode")]),
            "1 descriptors for a prefill server of TP 2 x PP 1": self.params(
                kvferry_descriptors=[descriptor(0, 2)]),
            "descriptors 0 and 1 both name prefill rank tp 0": self.params(
                kvferry_descriptors=[descriptor(), descriptor(id="%016x" % 9)], tp_size=2),
            "tp_size must be the number of descriptors, 1; got 2": self.params(tp_size=2),
            "tp_size must be the number of descriptors, 1; got a str": self.params(
                tp_size="1"),
            "do_remote_prefill must be true or false, got a str": self.params(
                do_remote_prefill="yes"),
            "kv_transfer_params must be a JSON object (a dict), got a list": [1, 2],
        }
        for i, (why, p) in enumerate(bad.items()):
            with self.subTest(why):
                self.c._scheduler.quota._start = None      # a new quota window
                r = request("d-bad-%d" % i, 10, p)
                with self.assertLogs("kvferry.vllm", "WARNING") as logs:
                    self.assertEqual(self.c.get_num_new_matched_tokens(r, 0), (0, False))
                    self.assertEqual(self.c.get_num_new_matched_tokens(r, 0), (0, False))
                    self.c.update_state_after_alloc(r, _Blocks([1, 2, 3]), 0)
                    self.assertEqual(self.c.request_finished(r, [1, 2, 3]), (False, None))
                self.assertEqual(len(logs.output), 1, logs.output)    # once per request
                self.assertIn(why, logs.output[0])
                self.assertIn("prefilled here", logs.output[0])
        self.assertEqual(self.c.build_connector_meta(None).reqs_to_recv, {})
        s = self.c._scheduler
        self.assertEqual((s.judged, s.refused), ({}, set()))

    def test_the_prompts_blocks_are_read(self):
        # P may hold blocks past the prompt's (10 tokens: 3 blocks of 4).
        r = request("d-more", 10, self.params(remote_block_ids=[7, 8, 9, 10, 11]))
        self.assertEqual(self.c.get_num_new_matched_tokens(r, 0), (10, True))
        self.c.update_state_after_alloc(r, _Blocks([20, 21, 22]), 10)
        rm = self.c.build_connector_meta(None).reqs_to_recv["d-more"]
        self.assertEqual((rm.local_block_ids, rm.remote_block_ids), ([20, 21, 22], [7, 8, 9]))

    def test_prefill_id_refused(self):
        # P's request id names its room, and D names it back: one the
        # library cannot take is not handed off, and vLLM frees its blocks.
        for rid in ("p-\ud800", "p-\x00", "p" * (V.ID_MAX_BYTES + 1)):
            r = request(rid, 10, {"do_remote_decode": True})
            with self.assertLogs("kvferry.vllm", "WARNING") as logs:
                self.assertEqual(self.c.request_finished(r, [1, 2, 3]), (False, None))
            self.assertIn("its KV is not handed to a decoder: its request id", logs.output[0])
            self.assertNotIn(rid, logs.output[0])                 # escaped in the log
        r = request("p-flag", 10, {"do_remote_decode": "yes"})
        with self.assertLogs("kvferry.vllm", "WARNING") as logs:
            self.assertEqual(self.c.request_finished(r, [1, 2, 3]), (False, None))
        self.assertIn("do_remote_decode must be true or false", logs.output[0])
        self.assertEqual(self.c.build_connector_meta(None).reqs_to_hold, {})

    def test_refusals_logged_within_a_quota(self):
        now = [0.0]
        q = self.c._scheduler.quota
        q._clock = lambda: now[0]
        q._start = None
        with self.assertLogs("kvferry.vllm", "WARNING") as logs:
            for i in range(q.burst + 5):
                r = request("d-flood-%d" % i, 10, self.params(remote_request_id=""))
                self.c.get_num_new_matched_tokens(r, 0)
                self.c.request_finished(r, [])
            now[0] += q.window_s
            r = request("d-flood-last", 10, self.params(remote_request_id=""))
            self.c.get_num_new_matched_tokens(r, 0)
        self.assertEqual(len(logs.output), q.burst + 1, logs.output)
        self.assertIn("and 5 more like it", logs.output[-1])
        self.assertIn("d-flood-last", logs.output[-1])

    def test_descriptors_a_decoder_refuses_are_not_handed_off(self):
        c = V.KVFerryConnector(config(), V.KVConnectorRole.SCHEDULER)
        with self.assertLogs("kvferry.vllm", "ERROR") as logs:
            c.set_xfer_handshake_metadata(
                {0: V.KVFerryHandshakeMetadata(tp_rank=0, descriptor="kvf1 stand-in")})
        self.assertIn("cannot hand KV to decoders", logs.output[0])
        self.assertEqual(c.request_finished(request("p-4", 4, {"do_remote_decode": True}),
                                            [1]), (False, None))

    def test_a_bug_never_reaches_vllm(self):
        # What the connector cannot foresee is logged with its traceback,
        # and the request goes on without KV transfer.
        class Broken:
            request_id = "d-broken"
            prompt_token_ids = list(range(10))

            @property
            def kv_transfer_params(self):
                raise RuntimeError("a broken request")
        with self.assertLogs("kvferry.vllm", "ERROR") as logs:
            self.assertEqual(self.c.get_num_new_matched_tokens(Broken(), 0), (0, False))
            self.c.update_state_after_alloc(Broken(), _Blocks([1]), 0)
            self.assertEqual(self.c.request_finished(Broken(), [1]), (False, None))
        self.assertIn("RuntimeError: a broken request", "\n".join(logs.output))
        s = self.c._scheduler
        self.assertEqual((s.judged, s.recvs, s.holds), ({}, {}, {}))

    def test_a_bug_after_the_promise_reports_the_blocks(self):
        # Once get_num_new_matched_tokens promised a load, vLLM waits for it:
        # a bug setting up the read must still end it, with every block
        # reported invalid (vLLM recomputes them or fails the request).
        r = request("d-late", 10, self.params())
        self.assertEqual(self.c.get_num_new_matched_tokens(r, 0), (10, True))
        s = self.c._scheduler

        def broken(*args, **kwargs):
            raise RuntimeError("a bug")
        s._recv_meta = broken
        with self.assertLogs("kvferry.vllm", "ERROR"):
            self.c.update_state_after_alloc(r, _Blocks([4, 5, 6]), 10)
        rm = self.c.build_connector_meta(None).reqs_to_recv["d-late"]
        self.assertEqual((rm.local_block_ids, rm.report), ([4, 5, 6], True))
        self.assertIn("RuntimeError: a bug", rm.refused)
        w = V.KVFerryConnector(config(extra={"tp_rank": 0}), V.KVConnectorRole.WORKER)
        self.addCleanup(w.shutdown)
        meta = V.KVFerryConnectorMetadata()
        meta.reqs_to_recv = {"d-late": rm}
        w.bind_connector_metadata(meta)
        w.start_load_kv(None)
        with self.assertLogs("kvferry.vllm", "WARNING"):
            self.assertEqual(w.get_finished(set()), (set(), {"d-late"}))
        self.assertEqual(w.get_block_ids_with_load_errors(), {4, 5, 6})

    def test_decode_aborted_before_alloc_releases_p(self):
        r = request("d-2", 10, self.params(), status="FINISHED_ABORTED")
        self.assertEqual(self.c.request_finished(r, []), (False, None))
        rm = self.c.build_connector_meta(None).reqs_to_recv["d-2"]
        self.assertEqual(rm.local_block_ids, [])
        self.assertFalse(rm.report)

    def test_metadata_never_none(self):
        self.assertIsInstance(self.c.build_connector_meta(None), V.KVFerryConnectorMetadata)

    def test_lease_config(self):
        c = V.KVFerryConnector(config(extra={"lease_s": 2.5}), V.KVConnectorRole.SCHEDULER)
        self.assertEqual(c._cfg.lease_s, 2.5)
        self.assertEqual(V.KVFerryConnector(config(), V.KVConnectorRole.SCHEDULER)
                         ._cfg.lease_s, float(os.environ.get(
                             "VLLM_NIXL_ABORT_REQUEST_TIMEOUT", 480)))
        with self.assertRaises(ValueError):
            V.KVFerryConnector(config(extra={"lease_s": 0}), V.KVConnectorRole.SCHEDULER)
        with self.assertRaises(ValueError):
            V.KVFerryConnector(config(extra={"kvferry": {"colour": 1}}),
                               V.KVConnectorRole.SCHEDULER)


class _TorchLike:
    """What register_kv_caches reads of a torch tensor, over a numpy array:
    data_ptr(), stride() in elements, element_size(), shape, dtype, device."""

    def __init__(self, a, device_type="cpu", index=None):
        self.a, self.shape, self.dtype = a, a.shape, "torch.bfloat16"
        self.device = types.SimpleNamespace(type=device_type, index=index)

    def data_ptr(self):
        return self.a.ctypes.data

    def stride(self):
        return tuple(s // self.a.itemsize for s in self.a.strides)

    def element_size(self):
        return self.a.itemsize


class LayoutTest(unittest.TestCase):
    def test_torch_tensors(self):
        a = np.zeros((2, 8, 2, 4, 16), np.uint16).transpose(0, 1, 3, 2, 4)
        lay = V.kv_cache_layout({"l0": _TorchLike(a)})
        self.assertEqual((lay["kv_order"], lay["kv_dtype"], lay["bytes_per_head"]),
                         ("HND", "bfloat16", 32))
        # A CUDA tensor is registered as memory of its device: here, with no
        # CUDA driver, the library refuses it and says so.
        w = V.KVFerryConnector(config(extra={"tp_rank": 0}), V.KVConnectorRole.WORKER)
        self.addCleanup(w.shutdown)
        gpu = _TorchLike(np.zeros((2, 8, 4, 2, 16), np.uint16), "cuda", 1)
        self.assertEqual(V.kv_cache_layout({"l0": gpu})["device"], ("cuda", 1))
        with self.assertRaisesRegex(kvferry.KVFerryError, "CUDA"):
            w.register_kv_caches({"l0": gpu})

    def test_flash_attn_nhd(self):
        a = np.zeros((2, 8, 4, 2, 16), np.float16)
        lay = V.kv_cache_layout({"l0": a, "l1": np.zeros_like(a)}, tp_size=2)
        self.assertEqual(lay["kv_order"], "NHD")
        self.assertEqual((lay["num_blocks"], lay["page_size"], lay["heads"],
                          lay["total_heads"], lay["bytes_per_head"]), (8, 4, 2, 4, 32))
        self.assertEqual(lay["tags"], [(0, 0, 0), (0, 1, 0), (1, 0, 0), (1, 1, 0)])
        self.assertEqual(lay["regions"][1].data_ptr() - lay["regions"][0].data_ptr(),
                         a.nbytes // 2)
        self.assertEqual(lay["kv_dtype"], "float16")

    def test_flash_attn_hnd_view(self):
        a = np.zeros((2, 8, 2, 4, 16), np.uint16).transpose(0, 1, 3, 2, 4)
        self.assertEqual(V.kv_cache_layout({"l0": a})["kv_order"], "HND")

    def test_mla(self):
        lay = V.kv_cache_layout({"l0": np.zeros((8, 4, 36), np.uint16)})
        self.assertEqual((lay["attention"], lay["tags"]), ("mla", [(0, 2, 0)]))

    def test_refused(self):
        cases = {
            "blocks-first": np.zeros((8, 2, 4, 2, 16), np.uint16),
            "cross-layer": np.zeros((8, 2, 4, 2, 16), np.uint16).transpose(1, 0, 2, 3, 4),
            "strided heads": np.zeros((2, 8, 4, 4, 16), np.uint16)[:, :, :, ::2],
            "4-d": np.zeros((2, 8, 4, 16), np.uint16),
        }
        for what, a in cases.items():
            with self.subTest(what), self.assertRaises(ValueError):
                V.kv_cache_layout({"model.layers.0.self_attn.attn": a})
        with self.assertRaises(ValueError):                   # layers disagree
            V.kv_cache_layout({"a": np.zeros((2, 8, 4, 2, 16), np.uint16),
                               "b": np.zeros((2, 8, 4, 1, 16), np.uint16)})

    def test_replicated_heads_from_the_model(self):
        # TP 4 over a model of 2 KV heads: vLLM gives each rank one head (a
        # replica); the model's count comes from its config, not heads x TP.
        a = np.zeros((2, 8, 4, 1, 16), np.uint16)
        self.assertEqual(V.kv_cache_layout({"l0": a}, 4)["total_heads"], 4)
        self.assertEqual(V.kv_cache_layout({"l0": a}, 4, 2)["total_heads"], 2)
        cfg = config(extra={"tp_rank": 3, "tp_size": 4})
        cfg.model_config = types.SimpleNamespace(get_total_num_kv_heads=lambda: 2)
        w = V.KVFerryConnector(cfg, V.KVConnectorRole.WORKER)
        self.addCleanup(w.shutdown)
        w.register_kv_caches({"l0": a})
        self.assertEqual(w._worker.layout["total_heads"], 2)

    def test_hnd_registered(self):
        w = V.KVFerryConnector(config(extra={"tp_rank": 0}), V.KVConnectorRole.WORKER)
        self.addCleanup(w.shutdown)
        a = np.zeros((2, 8, 2, 4, 16), np.uint16).transpose(0, 1, 3, 2, 4)
        mla = types.SimpleNamespace(model_config=types.SimpleNamespace(use_mla=True))
        self.assertIsNone(V.KVFerryConnector.get_required_kvcache_layout(mla))
        self.assertEqual(V.KVFerryConnector.get_required_kvcache_layout(config()), "HND")
        # Push mode needs save_kv_layer in every forward: no full CUDA graphs.
        self.assertTrue(V.KVFerryConnector.requires_piecewise_for_cudagraph(
            {"transfer_mode": "push"}))
        for extra in ({}, {"transfer_mode": "pull"}, None):
            self.assertFalse(V.KVFerryConnector.requires_piecewise_for_cudagraph(extra))
        w.register_kv_caches({"l0": a})
        self.assertEqual(w._worker.prefill.args.kv_order, "HND")


class Instances:
    """A prefill and a decode instance, and the proxy between them."""

    def __init__(self, p_tp, d_tp, layout="NHD", p_extra=None, d_extra=None, mla=False):
        self.p = self.d = None
        fast = {"heartbeat_interval_ms": 200, "heartbeat_timeout_ms": 2000}
        self.p = Peer(dict({"role": "prefill", "tp": p_tp, "layout": layout, "mla": mla,
                            "kvferry": fast}, **(p_extra or {})),
                      timeout=240, script="_vllm_instance.py")
        self.d = Peer(dict({"role": "decode", "tp": d_tp, "layout": layout, "mla": mla,
                            "kvferry": fast}, **(d_extra or {})),
                      timeout=240, script="_vllm_instance.py")
        ready = self.p.expect(lambda e: e["event"] == "ready", TIMEOUT, "P ready")
        self.p_addrs, self.p_descriptors = ready["addrs"], ready["descriptors"]
        self.d_addrs = self.d.expect(lambda e: e["event"] == "ready", TIMEOUT,
                                     "D ready")["decode_addrs"]

    def prefill(self, ext_id, tokens, transfer_id=None, **cmd):
        """The proxy's request to P (do_remote_decode, max_tokens=1; push
        mode: with the proxy's transfer_id): P's kv_transfer_params."""
        params = {"do_remote_decode": True, "do_remote_prefill": False,
                  "remote_engine_id": None, "remote_block_ids": None}
        if transfer_id is not None:
            params["transfer_id"] = transfer_id
        self.p.send(cmd="prefill", id=ext_id, tokens=tokens, params=params, **cmd)
        ev = self.p.expect(lambda e: e["event"] == "params" and e["id"] == ext_id, TIMEOUT,
                           "params of %s" % ext_id)
        assert ev["delay"] and ev["params"], ev
        return ev["params"]

    def decode(self, ext_id, tokens, params, prefix_blocks=0, abort=False):
        self.d.send(cmd="decode", id=ext_id, tokens=tokens, params=params,
                    prefix_blocks=prefix_blocks, abort=abort)

    def recv(self, ext_id):
        return self.d.expect(lambda e: e["event"] == "recv" and e["id"] == ext_id, TIMEOUT,
                             "recv of %s" % ext_id)

    def freed(self, ext_id, timeout=TIMEOUT):
        return self.p.expect(lambda e: e["event"] == "freed" and e["id"] == ext_id, timeout,
                             "P freed %s" % ext_id)

    def logs(self, peer, text):
        return [e["msg"] for e in peer.seen if e["event"] == "log" and text in e["msg"]]

    def no_violation(self, tc):
        for peer in (self.p, self.d):
            if peer is not None:
                tc.assertEqual([e for e in peer.seen if e["event"] == "violation"], [])

    def all_read(self, tc, rids):
        """Each of rids loaded on D with every byte right, its blocks freed
        on P as read (no lease end); nothing logged on either side."""
        for rid in rids:
            ev = self.recv(rid)
            tc.assertTrue(ev["loaded"], ev)
            tc.assertEqual(ev["invalid"], [], ev)
            tc.assertEqual(ev["bad"], [], ev)
            self.freed(rid)
        tc.assertEqual(self.logs(self.p, "req-"), [])
        tc.assertEqual(self.logs(self.d, "req-"), [])
        self.no_violation(tc)

    def close(self):
        for peer in (self.d, self.p):
            if peer is not None:
                peer.close()


class TransferTest(unittest.TestCase):
    """P holds, D reads: every byte, TP 1->1, 1->2, 2->1."""

    def run_pair(self, p_tp, d_tp, layout="NHD", mla=False, kvferry=None):
        extra = {"kvferry": dict(kvferry, heartbeat_interval_ms=200,
                                 heartbeat_timeout_ms=2000)} if kvferry else None
        inst = Instances(p_tp, d_tp, layout, mla=mla, p_extra=extra, d_extra=extra)
        self.addCleanup(inst.close)
        lengths = {"a": 13, "b": 4, "c": 31}      # a partial last block, one block, many
        params = {k: inst.prefill("req-%s" % k, n) for k, n in lengths.items()}
        self.assertEqual(params["a"]["tp_size"], p_tp)
        self.assertEqual(len(params["a"]["kvferry_descriptors"]), p_tp)
        for k, n in lengths.items():
            inst.decode("req-%s" % k, n, params[k])
        inst.all_read(self, ["req-%s" % k for k in lengths])

    def test_tp_1_to_1(self):
        self.run_pair(1, 1)

    def test_tp_1_to_2(self):
        self.run_pair(1, 2)

    def test_tp_2_to_1(self):
        self.run_pair(2, 1)

    def test_tp_1_to_2_busy_polling(self):
        # The engine key reaches both sides' engines; bytes move as ever.
        self.run_pair(1, 2, kvferry={"busy_poll_us": 200})

    def test_hnd_tp_1_to_1(self):
        self.run_pair(1, 1, "HND")

    def test_hnd_tp_1_to_2(self):
        self.run_pair(1, 2, "HND")

    def test_hnd_tp_2_to_1(self):
        self.run_pair(2, 1, "HND")

    def test_hnd_prefill_nhd_decode_refused(self):
        # The layouts disagree (VLLM_KV_CACHE_LAYOUT set on one side only):
        # kvferry refuses the pair, D reports every block invalid, and says why.
        inst = Instances(1, 1, p_extra={"layout": "HND"}, d_extra={"layout": "NHD"})
        self.addCleanup(inst.close)
        params = inst.prefill("req-order", 9)
        inst.decode("req-order", 9, params)
        ev = inst.recv("req-order")
        self.assertEqual(ev["invalid"], sorted(ev["blocks"]), ev)
        self.assertTrue(ev["zero"], ev)
        why = inst.logs(inst.d, "req-order")
        self.assertTrue(why and "HND" in why[0] and "NHD" in why[0], why)
        inst.no_violation(self)

    def test_mla_tp_2_to_1(self):
        # Every P rank holds the whole latent: D reads one, the other P rank
        # feeds nobody and must still free its blocks (not at lease end).
        self.run_pair(2, 1, mla=True)

    def test_mla_tp_1_to_2(self):
        self.run_pair(1, 2, mla=True)

    def test_decode_prefix_hit(self):
        inst = Instances(1, 2)
        self.addCleanup(inst.close)
        params = inst.prefill("req-prefix", 22)             # 6 blocks
        inst.decode("req-prefix", 22, params, prefix_blocks=2)
        ev = inst.recv("req-prefix")
        self.assertEqual((ev["invalid"], ev["bad"]), ([], []), ev)
        inst.freed("req-prefix")
        inst.no_violation(self)


PUSH = {"mode": "push", "chunk": 6}     # P computes a prompt 6 tokens a step


class PushTest(unittest.TestCase):
    """Push mode (kv_connector_extra_config.transfer_mode "push"): the proxy
    gives D the transfer_id and P's descriptors (known from an earlier
    response of P) before P computes; P, prefilling in chunks of 6 tokens,
    sends each chunk's blocks of each layer from save_kv_layer, and ends
    the room in wait_for_save of its last chunk."""

    def push_params(self, inst, tid):
        return {"do_remote_prefill": True, "do_remote_decode": False, "transfer_id": tid,
                "remote_engine_id": "prefill-engine", "tp_size": len(inst.p_descriptors),
                "kvferry_descriptors": inst.p_descriptors}

    def run_push(self, p_tp, d_tp, mla=False):
        inst = Instances(p_tp, d_tp, mla=mla, p_extra=PUSH, d_extra={"mode": "push"})
        self.addCleanup(inst.close)
        lengths = {"a": 13, "b": 4, "c": 31}      # a partial last block, one block, many
        for k, n in lengths.items():                # D first: it waits for the layers
            inst.decode("req-%s" % k, n, self.push_params(inst, "xfer-%s" % k))
            params = inst.prefill("req-%s" % k, n, "xfer-%s" % k)
            self.assertEqual((params["transfer_mode"], params["kvferry_descriptors"]),
                             ("push", inst.p_descriptors), params)
        # A proxy that waits for P hands D P's params as they are.
        late = inst.prefill("req-late", 9, "xfer-late")
        inst.decode("req-late", 9, late)
        inst.all_read(self, ["req-%s" % k for k in list(lengths) + ["late"]])

    def test_push_tp_1_to_1(self):
        self.run_push(1, 1)

    def test_push_tp_1_to_2(self):
        self.run_push(1, 2)

    def test_push_tp_2_to_1(self):
        self.run_push(2, 1)

    def test_push_mla_tp_2_to_1(self):
        self.run_push(2, 1, mla=True)

    def test_push_prefill_stops_after_a_layer(self):
        # P's last chunk computes layer 0 and stops (its forward raised;
        # vLLM still calls wait_for_save): the room's last send leaves
        # layers 1 and 2 short, and every rank fails it naming them.  D
        # reports every block invalid; P frees its blocks.
        inst = Instances(2, 1, p_extra=PUSH, d_extra={"mode": "push"})
        self.addCleanup(inst.close)
        inst.decode("req-stop", 17, self.push_params(inst, "xfer-stop"))
        inst.prefill("req-stop", 17, "xfer-stop", stop_after_layer=1)
        ev = inst.recv("req-stop")
        self.assertEqual(ev["invalid"], sorted(ev["blocks"]), ev)
        inst.freed("req-stop")
        why = inst.logs(inst.d, "req-stop")
        self.assertEqual(len(why), 1, why)
        for text in ("KVF_ERR_INCOMPLETE", "layer 1"):
            self.assertIn(text, why[0])
        inst.no_violation(self)


class FailureTest(unittest.TestCase):
    def test_prefill_killed_before_read(self):
        inst = Instances(2, 1)
        self.addCleanup(inst.close)
        params = inst.prefill("req-dead", 17)
        inst.p.kill()
        inst.p.proc.wait(timeout=30)
        inst.decode("req-dead", 17, params)
        ev = inst.recv("req-dead")
        self.assertTrue(ev["loaded"])
        self.assertEqual(ev["invalid"], sorted(ev["blocks"]), ev)
        why = inst.logs(inst.d, "req-dead")
        self.assertTrue(why, inst.d.seen)
        self.assertTrue(any(a in why[0] for a in inst.p_addrs), (why, inst.p_addrs))
        inst.no_violation(self)

    def test_one_pair_fails_tp_2_to_2(self):
        # A byte of P rank 0's share corrupted (checksums on): the D worker
        # that reads it (TP rank 0) reports its blocks invalid and logs the
        # true cause, the checksum mismatch it saw itself, with its origin;
        # P's TP rank 0 logs the same cause, learned from it.  The rank-1
        # pair moved every byte: neither of its workers logs a failure.
        kv = {"heartbeat_interval_ms": 200, "heartbeat_timeout_ms": 2000, "checksum": True}
        inst = Instances(2, 2, p_extra={"kvferry": kv,
                                        "rank_kvferry": {"0": {"faults": "corrupt@100"}}},
                         d_extra={"kvferry": kv})
        self.addCleanup(inst.close)
        params = inst.prefill("req-flip", 13)
        inst.decode("req-flip", 13, params)
        ev = inst.recv("req-flip")
        self.assertEqual(ev["invalid"], sorted(ev["blocks"]), ev)
        inst.freed("req-flip")
        origin = "origin decode rank 0 at %s" % inst.d_addrs[0]
        for peer, learned in ((inst.d, False), (inst.p, True)):
            why = inst.logs(peer, "req-flip")
            self.assertEqual(len(why), 1, why)
            for text in ("TP rank 0: request", "checksum mismatch on the",
                         "from prefill rank 0 (%s)" % inst.p_addrs[0], "KVF_ERR_CHECKSUM",
                         origin):
                self.assertIn(text, why[0])
            self.assertEqual("learned from another rank" in why[0], learned, why)
        inst.no_violation(self)

    def test_unread_prefill_freed_on_lease(self):
        inst = Instances(2, 1, p_extra={"lease_s": 0.5})
        self.addCleanup(inst.close)
        inst.prefill("req-unread", 9)
        inst.freed("req-unread")
        why = inst.logs(inst.p, "req-unread")
        self.assertEqual(len(why), 2, why)                  # one per P TP rank
        self.assertTrue(all("KVF_ERR_LEASE_EXPIRED" in w for w in why), why)
        inst.no_violation(self)

    def test_decode_aborted_before_alloc_frees_prefill(self):
        # D's request ends before its blocks were allocated: it reads nothing
        # but asks P's room with no pages, so P frees now, not at lease end.
        inst = Instances(2, 2)
        self.addCleanup(inst.close)
        params = inst.prefill("req-gone", 10)
        inst.decode("req-gone", 10, params, abort=True)
        ev = inst.recv("req-gone")
        self.assertEqual((ev["loaded"], ev["finished"]), (False, [False, None]), ev)
        inst.freed("req-gone")
        self.assertEqual(inst.logs(inst.p, "req-gone"), [])   # no lease expiry
        inst.no_violation(self)

    def test_unknown_request_fails(self):
        # A remote_request_id that P never held (tampered, or P forgot it):
        # P answers at its bootstrap deadline, D reports every block invalid.
        inst = Instances(1, 1, p_extra={"kvferry": {"bootstrap_timeout_ms": 500}})
        self.addCleanup(inst.close)
        params = inst.prefill("req-real", 8)
        inst.decode("req-made-up", 8, dict(params, remote_request_id="made-up-id"))
        ev = inst.recv("req-made-up")
        self.assertEqual(ev["invalid"], sorted(ev["blocks"]), ev)
        self.assertTrue(ev["zero"], ev)
        why = inst.logs(inst.d, "req-made-up")
        self.assertTrue(why and "KVF_ERR_TIMED_OUT" in why[0], why)
        inst.decode("req-real", 8, params)                  # the real one still reads
        ev = inst.recv("req-real")
        self.assertEqual((ev["invalid"], ev["bad"]), ([], []), ev)
        inst.freed("req-real")
        inst.no_violation(self)

    def test_stranger_refused(self):
        # A forged remote_request_id whose room collides with a real request's
        # (room_key patched in D: the same room, another instance) is refused;
        # the real request then reads its own bytes.
        inst = Instances(1, 1, d_extra={"collide": {}})
        self.addCleanup(inst.close)
        params = inst.prefill("req-owner", 12)
        inst.d.close()
        inst.d = Peer({"role": "decode", "tp": 1, "kvferry": {"heartbeat_interval_ms": 200},
                       "collide": {"forged": params["remote_request_id"]}},
                      timeout=240, script="_vllm_instance.py")
        inst.d.expect(lambda e: e["event"] == "ready", TIMEOUT, "D ready")
        forged = dict(params, remote_request_id="forged")
        inst.decode("req-stranger", 12, forged)
        ev = inst.recv("req-stranger")
        self.assertEqual(ev["invalid"], sorted(ev["blocks"]), ev)
        self.assertTrue(ev["zero"], ev)                     # nothing landed
        why = inst.logs(inst.d, "req-stranger")
        self.assertTrue(any("KVF_ERR_ROOM_CONFLICT" in w for w in why), why)
        inst.decode("req-owner", 12, params)
        ev = inst.recv("req-owner")
        self.assertEqual((ev["invalid"], ev["bad"]), ([], []), ev)
        inst.freed("req-owner")
        inst.no_violation(self)


if __name__ == "__main__":
    unittest.main()
