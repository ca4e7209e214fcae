"""Bad arguments raise TypeError/ValueError (or a KVFerryError subclass) with
a message, never crash the interpreter; handles are destroyed exactly once
in any order; a missing library is a clear ImportError."""
import array
import gc
import os
import subprocess
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _util import POOL_PAGES, AUX_SLOTS, KVPoll, kvferry, make_args  # noqa: E402

BOOT = "127.0.0.1:1"      # never contacted: rooms here stay Bootstrapping


class Indices(unittest.TestCase):
    """Index conversion, through KVReceiver.init and KVSender.send."""

    @classmethod
    def setUpClass(cls):
        cls.dec = kvferry.KVManager(make_args(4, bootstrap_timeout_ms=60000), "decode")
        cls.pre = kvferry.KVManager(make_args(4, host_bootstrap=True,
                                              bootstrap_addr="127.0.0.1:0"), "prefill")

    @classmethod
    def tearDownClass(cls):
        cls.dec.close()
        cls.pre.close()

    def setUp(self):
        self.rx = kvferry.KVReceiver(self.dec, BOOT, 1)
        self.tx = kvferry.KVSender(self.pre, BOOT, 1)

    def tearDown(self):
        self.rx.close()
        self.tx.close()

    def assertRefused(self, exc, fn, *args, contains=None, **kw):
        with self.assertRaises(exc) as cm:
            fn(*args, **kw)
        msg = str(cm.exception)
        self.assertTrue(msg, "exception without a message")
        if contains:
            self.assertIn(contains, msg)
        return cm.exception

    def test_wrong_types(self):
        for bad, where in [("1,2", "str"), (b"\x01\x02", "bytes"), (None, "NoneType"),
                           (3, "int"), ({1: 2}, "dict"), (1.5, "float")]:
            self.assertRefused(TypeError, self.rx.init, bad, 0, contains="kv_indices")
        self.assertRefused(TypeError, self.rx.init, [1, 2.0], 0,
                           contains="kv_indices[1]")
        self.assertRefused(TypeError, self.rx.init, [1, "2"], 0, contains="kv_indices[1]")
        self.assertRefused(TypeError, self.rx.init, [True], 0)
        self.assertRefused(TypeError, self.rx.init, array.array("d", [1.0]), 0,
                           contains="typecode 'd'")
        self.assertRefused(TypeError, self.rx.init,
                           memoryview(array.array("f", [1.0])), 0, contains="format")
        self.assertRefused(TypeError, self.rx.init, [1], "0", contains="aux_index")
        self.assertRefused(TypeError, self.rx.init, [1], 0, state_indices="x")

    def test_out_of_range(self):
        e = self.assertRefused(ValueError, self.rx.init, [0, -1], 0,
                               contains="kv_indices[1] = -1 is negative")
        self.assertIsInstance(e, ValueError)
        self.assertRefused(ValueError, self.rx.init, array.array("q", [2**32]), 0,
                           contains="32 bits")
        self.assertRefused(ValueError, self.rx.init, [1, POOL_PAGES], 0,
                           contains="kv_indices[1] = %d is outside" % POOL_PAGES)
        self.assertRefused(ValueError, self.rx.init,
                           memoryview(array.array("i", [3, -7])), 0, contains="-7")
        self.assertRefused(ValueError, self.rx.init, [1], AUX_SLOTS, contains="aux_index")
        self.assertRefused(ValueError, self.rx.init, [1], -1, contains="aux_index")
        self.assertRefused(ValueError, self.rx.init, [], 0, contains="empty")
        self.assertRefused(ValueError, self.rx.init, [5, 6, 5], 0,
                           contains="kv_indices[2] = 5 appears twice")
        self.assertRefused(ValueError, self.rx.init, [1], None, contains="aux_index")
        # init(0) is a zero-page room (a full prefix hit), not a mistake:
        # test_sglang sends one.
        self.assertRefused(ValueError, self.tx.init, -3, 0)
        self.assertRefused(TypeError, self.tx.init, "3", 0)
        self.assertRefused(ValueError, self.tx.init, 2**32, 0)
        # Nothing was refused halfway: a correct init still works.
        self.rx.init(range(3), 0)

    def test_accepted_kinds(self):
        class Tensorish:        # torch-like: only tolist()
            def tolist(self):
                return [9, 8]
        for i, v in enumerate([[1, 2], (1, 2), range(1, 3), array.array("H", [1, 2]),
                               array.array("I", [1, 2]), memoryview(array.array("l", [1])),
                               Tensorish()]):
            with kvferry.KVReceiver(self.dec, BOOT, 100 + i) as rx:
                rx.init(v, 0)
                rx.poll()

    def test_numpy_if_present(self):
        try:
            import numpy as np
        except ImportError:
            self.skipTest("numpy not installed (optional)")
        with kvferry.KVReceiver(self.dec, BOOT, 200) as rx:
            self.assertRaises(TypeError, rx.init, np.array([1.0]), 0)
            self.assertRaises(ValueError, rx.init, np.array([1, -1], np.int32), 0)
            rx.init(np.array([[1, 2], [3, 4]], dtype=np.int64), 0)

    def test_sender_calls(self):
        self.assertRefused(kvferry.KVFerryStateError, self.tx.send, [1],
                           contains="init() first")
        self.tx.init(3, 0)
        self.assertRefused(ValueError, self.tx.send, [1, 2, 3, 4], contains="declared")
        self.assertRefused(TypeError, self.tx.send, [1], is_last=1)
        self.assertRefused(ValueError, self.tx.send, [-1])
        # Not yet WaitingForInput: the library refuses (KVF_ERR_STATE).
        e = self.assertRefused(RuntimeError, self.tx.send, [1, 2, 3],
                               contains="KVF_ERR_STATE")
        self.assertEqual(e.status, "KVF_ERR_STATE")
        self.assertEqual(e.status_str, "call not allowed in the current state")
        e = self.assertRefused(kvferry.KVFerryStateError, self.tx.init, 3, 0)
        self.assertIsInstance(e, RuntimeError)
        self.assertEqual(self.tx.curr_idx, 0)

    def test_state_errors(self):
        self.rx.init([1], 0)
        self.assertFalse(self.rx.pages_released())      # live room: pages in use
        self.assertRefused(RuntimeError, self.rx.init, [2], 0, contains="KVF_ERR_STATE")
        self.assertRefused(kvferry.KVFerryStateError, self.rx.failure_exception,
                           contains="has not failed")
        e = self.assertRefused(RuntimeError, kvferry.KVReceiver, self.dec, BOOT, 1)
        self.assertEqual(e.status, "KVF_ERR_ROOM_IN_USE")


class Construction(unittest.TestCase):

    def test_bad_args(self):
        bad = [
            (TypeError, dict(kv_data_ptrs=[b"\0" * 128]), "read-only"),
            (TypeError, dict(kv_data_ptrs=["abc"]), "kv_data_ptrs[0]"),
            (ValueError, dict(kv_data_ptrs=[12345]), "kv_data_lens"),
            (ValueError, dict(kv_data_ptrs=[bytearray(100)]), "multiple"),
            (ValueError, dict(kv_item_lens=[128, 128]), "kv_item_lens"),
            (ValueError, dict(page_size=0), "page_size"),
            (ValueError, dict(page_size=-4), "page_size"),
            (ValueError, dict(attention="sparse"), "attention"),
            (ValueError, dict(kv_data_ptrs=[]), "kv_data_ptrs"),
            (ValueError, dict(bytes_per_head=8), "bytes per page"),
            (TypeError, dict(host=5), "host"),
            (ValueError, dict(port=70000), "port"),
            (ValueError, dict(bootstrap_addr="nohost"), "host:port"),
        ]
        for exc, change, text in bad:
            a = make_args(4)
            for k, v in change.items():
                setattr(a, k, v)
            if "kv_data_ptrs" in change:
                a.kv_item_lens = [128]
            with self.assertRaises(exc, msg=change) as cm:
                kvferry.KVManager(a, "decode")
            self.assertIn(text, str(cm.exception), change)
        self.assertRaises(TypeError, kvferry.KVManager, {"page_size": 4}, "decode")
        self.assertRaises(ValueError, kvferry.KVManager, make_args(4), "router")

    def test_library_refusals_map_to_builtin_exceptions(self):
        # engine_rank >= tp_size: kvf_engine_create says KVF_ERR_INVALID_PARAM.
        with self.assertRaises(ValueError) as cm:
            kvferry.KVManager(make_args(4, engine_rank=2, tp_size=2), "decode")
        self.assertIsInstance(cm.exception, kvferry.KVFerryValueError)
        self.assertEqual(cm.exception.status, "KVF_ERR_INVALID_PARAM")
        self.assertIn("invalid parameter", str(cm.exception))
        # Busy polling: at most a second.
        with self.assertRaises(ValueError) as cm:
            kvferry.KVManager(make_args(4, busy_poll_us=1000001), "decode")
        self.assertEqual(cm.exception.status, "KVF_ERR_INVALID_PARAM")
        with kvferry.KVManager(make_args(4, busy_poll_us=200), "decode"):
            pass

    def test_room_args(self):
        with kvferry.KVManager(make_args(4), "decode") as dec:
            self.assertRaises(TypeError, kvferry.KVReceiver, None, BOOT, 1)
            self.assertRaises(TypeError, kvferry.KVReceiver, dec, BOOT, "1")
            self.assertRaises(ValueError, kvferry.KVReceiver, dec, BOOT, -1)
            self.assertRaises(ValueError, kvferry.KVReceiver, dec, BOOT, 2**64)
            self.assertRaises(TypeError, kvferry.KVReceiver, dec, 1234, 1)
            self.assertRaises(ValueError, kvferry.KVReceiver, dec, "nohost", 1)
            self.assertRaises(ValueError, kvferry.KVReceiver, dec, BOOT, 1, -2)
            with self.assertRaises(ValueError) as cm:
                kvferry.KVSender(dec, BOOT, 1)
            self.assertIn("prefill KVManager", str(cm.exception))
            with kvferry.KVReceiver(dec, BOOT, 2**64 - 1) as rx:
                self.assertEqual(rx.bootstrap_room, 2**64 - 1)

    def test_bootstrap_server(self):
        with kvferry.BootstrapServer("127.0.0.1", 0) as b:
            self.assertGreater(b.port, 0)
            self.assertEqual(b.addr, "127.0.0.1:%d" % b.port)
            self.assertIn(b.access, ("token", "protected"))
        b.close()                           # idempotent
        self.assertRaises(ValueError, kvferry.BootstrapServer, "127.0.0.1", -1)
        self.assertRaises(TypeError, kvferry.BootstrapServer, None, 0)

    def test_bootstrap_server_token_from_environment(self):
        """The registry reads the cluster token where it starts; without one
        it refuses a non-loopback host (a child process: the environment is
        its own)."""
        code = ("import sys; sys.path.insert(0, %r)\n"
                "from _util import kvferry\n"
                "with kvferry.BootstrapServer('0.0.0.0', 0) as b:\n"
                "    print(b.access, flush=True)\n"
                % os.path.dirname(os.path.abspath(__file__)))
        env = {k: v for k, v in os.environ.items()
               if k not in ("KVF_AUTH_TOKEN", "KVF_AUTH_TOKEN_FILE", "KVF_AUTH",
                            "SGLANG_DISAGGREGATION_BOOTSTRAP_AUTH_TOKEN")}
        out = subprocess.run([sys.executable, "-c", code], capture_output=True,
                             text=True, env=env, timeout=60)
        self.assertNotEqual(out.returncode, 0)
        self.assertIn("KVF_AUTH_TOKEN", out.stderr)
        env["SGLANG_DISAGGREGATION_BOOTSTRAP_AUTH_TOKEN"] = "sglang-shared-token-0123456789"
        out = subprocess.run([sys.executable, "-c", code], capture_output=True,
                             text=True, env=env, timeout=60)
        self.assertEqual((out.returncode, out.stdout.strip()), (0, "token"), out.stderr)


class Lifetime(unittest.TestCase):

    def test_close_in_any_order(self):
        mgr = kvferry.KVManager(make_args(4), "decode")
        rx = kvferry.KVReceiver(mgr, BOOT, 5)
        rx2 = kvferry.KVReceiver(mgr, BOOT, 6)
        rx2.close()
        rx2.close()
        mgr.close()                         # destroys rx first
        mgr.close()
        self.assertTrue(mgr.closed)
        self.assertEqual(rx.poll(), KVPoll.Failed)
        self.assertRaises(kvferry.KVFerryStateError, rx.init, [1], 0)
        self.assertRaises(kvferry.KVFerryStateError, rx.abort)
        self.assertRaises(kvferry.KVFerryStateError, kvferry.KVReceiver, mgr, BOOT, 7)
        self.assertRaises(kvferry.KVFerryStateError, lambda: mgr.address)
        rx.close()

    def test_garbage_collection(self):
        mgr = kvferry.KVManager(make_args(4), "decode")
        rooms = [kvferry.KVReceiver(mgr, BOOT, i) for i in range(10)]
        del mgr                             # rooms keep it alive
        gc.collect()
        self.assertFalse(rooms[0].mgr.closed)
        rooms[0].init([1, 2], 0)
        del rooms
        gc.collect()

    def test_exit_with_live_rooms_in_child(self):
        """Interpreter exit with rooms still open: destroys happen once, in order."""
        code = ("import sys; sys.path.insert(0, %r)\n"
                "from _util import kvferry, make_args\n"
                "m = kvferry.KVManager(make_args(4, host_bootstrap=True, "
                "bootstrap_addr='127.0.0.1:0'), 'prefill')\n"
                "s = [kvferry.KVSender(m, None, i) for i in range(5)]\n"
                "print('ok', flush=True)\n" % os.path.dirname(os.path.abspath(__file__)))
        out = subprocess.run([sys.executable, "-c", code], capture_output=True,
                             text=True, timeout=60)
        self.assertEqual((out.returncode, out.stdout.strip()), (0, "ok"), out.stderr)


class Library(unittest.TestCase):

    def test_missing_library_is_a_clear_import_error(self):
        env = dict(os.environ, KVFERRY_LIBRARY="/nonexistent/libkvferry.so")
        code = ("import sys; sys.path.insert(0, %r)\n"
                "try:\n    import kvferry\nexcept ImportError as e:\n    print(e)\n"
                % os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        out = subprocess.run([sys.executable, "-c", code], capture_output=True,
                             text=True, env=env, timeout=60)
        self.assertIn("/nonexistent/libkvferry.so", out.stdout)
        self.assertIn("KVFERRY_LIBRARY", out.stdout)
        self.assertIn("make build", out.stdout)

    def test_version_and_log_level(self):
        self.assertRegex(kvferry.library_version(), r"^\d+\.\d+\.\d+")
        kvferry.set_log_level("warn")
        self.assertRaises(ValueError, kvferry.set_log_level, "loud")
        self.assertEqual([int(p) for p in kvferry.KVPoll], [0, 1, 2, 3, 4])
        self.assertEqual(min(kvferry.KVPoll.Success, kvferry.KVPoll.Failed),
                         kvferry.KVPoll.Failed)

    def test_transfer_error_pickles(self):
        import pickle
        e = kvferry.KVTransferError(3, "boom", True, "decode", 1, "h:1", -40)
        f = pickle.loads(pickle.dumps(e))
        self.assertEqual((f.bootstrap_room, f.failure_reason, f.is_from_another_rank,
                          f.origin_side, f.status), (3, "boom", True, "decode",
                                                     "KVF_ERR_CONN_RESET"))
        self.assertIsInstance(f, kvferry.KVFerryError)


if __name__ == "__main__":
    unittest.main()
