"""Held rooms from Python (vLLM's flow): ``room_key``, ``KVManager.descriptor``,
``KVSender.held`` and ``KVReceiver.remote``, between two engines of this
process over loopback, with a prefill manager that has no registry."""
import time
import unittest

from _util import FINAL, kvferry, make_args, wait_state
from kvferry import KVPoll


class RoomKeyTest(unittest.TestCase):
    def test_stable_and_distinct(self):
        k = kvferry.room_key("cmpl-1-0-abcdef12")
        self.assertEqual(k, kvferry.room_key(b"cmpl-1-0-abcdef12"))
        self.assertNotEqual(k, kvferry.room_key("cmpl-1-0-abcdef13"))
        room, inst = kvferry.room_key("")
        self.assertNotEqual(inst, 0)            # 0 means "any": never a key's
        self.assertEqual(kvferry.room_key("é"), kvferry.room_key("é".encode()))

    def test_refuses_other_types(self):
        with self.assertRaises(TypeError):
            kvferry.room_key(17)


class HeldTest(unittest.TestCase):
    def setUp(self):
        # A prefill manager without a bootstrap address: reached by descriptor.
        self.pre = kvferry.KVManager(make_args(heartbeat_timeout_ms=2000), "prefill")
        self.dec = kvferry.KVManager(make_args(), "decode")

    def tearDown(self):
        self.dec.close()
        self.pre.close()

    def fill(self, pages):
        pb = self.pre.args.kv_item_lens[0]
        for b, buf in enumerate(self.pre.args.kv_data_ptrs):
            for p in pages:
                buf[p * pb:(p + 1) * pb] = bytes([(b * 37 + p * 11 + i) % 251
                                                  for i in range(pb)])

    def test_descriptor(self):
        d = self.pre.descriptor()
        self.assertIsInstance(d, str)
        self.assertLess(len(d), 512)
        self.assertNotIn('"', d)
        self.assertIn(self.pre.address, d)

    def test_hold_then_read_with_prefix(self):
        src = [9, 3, 20, 5]
        self.fill(src)
        room, inst = kvferry.room_key("req-A")
        s = kvferry.KVSender.held(self.pre, room, inst, lease_s=30)
        s.init(len(src), 0)
        s.send(src)                                # before any reader asked
        self.assertEqual(s.poll(), KVPoll.Bootstrapping)
        r = kvferry.KVReceiver.remote(self.dec, room, [self.pre.descriptor()], inst)
        # The decode holds the first page already: it reads the other three.
        dst = [40, 41, 7]
        r.set_dest(dst, 1, decode_prefix_len=self.pre.args.page_size)
        self.assertEqual(wait_state(r, FINAL), KVPoll.Success)
        self.assertEqual(wait_state(s, FINAL), KVPoll.Success)
        pb = self.pre.args.kv_item_lens[0]
        for sb, db in zip(self.pre.args.kv_data_ptrs, self.dec.args.kv_data_ptrs):
            for p, q in zip(src[1:], dst):
                self.assertEqual(db[q * pb:(q + 1) * pb], sb[p * pb:(p + 1) * pb])
        s.close()
        r.close()

    def test_lease_expires(self):
        room, inst = kvferry.room_key("never-read")
        s = kvferry.KVSender.held(self.pre, room, inst, lease_s=0.2)
        s.init(2, 0)
        s.send([1, 2])
        t0 = time.monotonic()
        self.assertEqual(wait_state(s, FINAL, timeout=10), KVPoll.Failed)
        self.assertGreaterEqual(time.monotonic() - t0, 0.15)
        with self.assertRaises(kvferry.KVTransferError) as cm:
            s.failure_exception()
        self.assertEqual(cm.exception.status, "KVF_ERR_LEASE_EXPIRED")
        self.assertTrue(cm.exception.lease_expired)
        s.close()

    def test_wrong_instance_refused(self):
        self.fill([1])
        room, inst = kvferry.room_key("owner")
        s = kvferry.KVSender.held(self.pre, room, inst, lease_s=30)
        s.init(1, 0)
        s.send([1])
        r = kvferry.KVReceiver.remote(self.dec, room, [self.pre.descriptor()], inst ^ 1)
        r.set_dest([3], 1)
        self.assertEqual(wait_state(r, FINAL), KVPoll.Failed)
        with self.assertRaises(kvferry.KVTransferError) as cm:
            r.failure_exception()
        self.assertEqual(cm.exception.status, "KVF_ERR_ROOM_CONFLICT")
        pb = self.dec.args.kv_item_lens[0]
        for db in self.dec.args.kv_data_ptrs:
            self.assertEqual(bytes(db[3 * pb:4 * pb]), bytes(pb))
        r.close()
        # The owner still reads it.
        r2 = kvferry.KVReceiver.remote(self.dec, room, [self.pre.descriptor()], inst)
        r2.set_dest([4], 2)
        self.assertEqual(wait_state(r2, FINAL), KVPoll.Success)
        self.assertEqual(wait_state(s, FINAL), KVPoll.Success)
        r2.close()
        s.close()

    def test_bad_arguments(self):
        with self.assertRaises(ValueError):
            kvferry.KVSender.held(self.pre, 1, 0, lease_s=0)
        with self.assertRaises(TypeError):
            kvferry.KVReceiver.remote(self.dec, 1, self.pre.descriptor())
        with self.assertRaises(ValueError):
            kvferry.KVReceiver.remote(self.dec, 1, [])
        with self.assertRaises(kvferry.KVFerryValueError):
            kvferry.KVReceiver.remote(self.dec, 1, ["not a descriptor"])
        with self.assertRaises(ValueError):        # a decode manager holds nothing
            kvferry.KVSender.held(self.dec, 1)


if __name__ == "__main__":
    unittest.main()
