"""A room end to end between two Python processes, every byte verified."""
import array
import os
import random
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _util import (FINAL, KVPoll, Peer, fill_room, kvferry, make_args, verify_room,
                   wait_state, POOL_PAGES)


class RoomEndToEnd(unittest.TestCase):

    def setUp(self):
        self.peer = None
        self.mgr = None

    def tearDown(self):
        if self.mgr is not None:
            self.mgr.close()
        if self.peer is not None:
            self.peer.close()

    def test_decode_here_prefill_in_child(self):
        """Rooms of 1..10 pages into scattered decode pages (lists, arrays,
        memoryviews, numpy when present), with a state slot; every KV, aux and
        state byte verified here; pages outside the rooms stay untouched."""
        rng = random.Random(1)
        sizes = [1, 10, 7, 3]
        src = rng.sample(range(POOL_PAGES), sum(sizes))
        dst = rng.sample(range(POOL_PAGES), sum(sizes))
        rooms, off = [], 0
        for k, n in enumerate(sizes):
            rooms.append({"room": 2**63 + k, "pages": src[off:off + n], "aux": k,
                          "state": k, "dst": dst[off:off + n]})
            off += n
        self.peer = Peer({"role": "prefill", "page_size": 4, "state": True,
                          "rooms": [{k: r[k] for k in ("room", "pages", "aux", "state")}
                                    for r in rooms]})
        boot = self.peer.expect(lambda e: e["event"] == "ready")["bootstrap"]
        self.mgr = kvferry.KVManager(make_args(4, state=True), "decode")
        kinds = [list, lambda v: array.array("i", v),
                 lambda v: memoryview(array.array("q", v)), tuple]
        if "numpy" in sys.modules or _have_numpy():
            import numpy as np
            kinds[3] = lambda v: np.asarray(v, dtype=np.int64)
        rxs = []
        for r, kind in zip(rooms, kinds):
            rx = kvferry.KVReceiver(self.mgr, boot, r["room"])
            rx.init(kind(r["dst"]), r["aux"], kind([r["state"]]))
            rxs.append(rx)
        for r, rx in zip(rooms, rxs):
            state = wait_state(rx, FINAL, 30)
            self.assertEqual(state, KVPoll.Success, self._why(rx))
            self.assertTrue(rx.pages_released())
            self.assertEqual(verify_room(self.mgr, r["room"], r["dst"], r["aux"],
                                         r["state"]), [])
            ev = self.peer.room_event(r["room"], ("Success", "Failed"))
            self.assertEqual(ev["state"], "Success", ev)
        # Nothing written outside the declared pages and slots.
        used = set(dst)
        for buf in self.mgr.args.kv_data_ptrs:
            pb = self.mgr.args.kv_item_lens[0]
            for p in set(range(POOL_PAGES)) - used:
                self.assertEqual(buf[p * pb:(p + 1) * pb], bytes(pb), "page %d" % p)
        stats = self.mgr.stats()
        self.assertEqual(stats["rooms_succeeded"], len(rooms))
        # The one peer, counted under the transport its payload took (one
        # of those the engine used: "tcp+shm" when bytes went both ways),
        # or by now in none: the child exits once its rooms are final, and
        # a peer counts while it is connected (test_metrics.c counts live
        # pairs by path).
        paths = stats["peers_by_path"]
        self.assertEqual(list(paths), ["tcp", "cuda", "shm", "ucx"])
        self.assertLessEqual(sum(paths.values()), 1, paths)
        for name in (n for n, c in paths.items() if c):
            self.assertIn(name, self.mgr.transport.split("+"))
        self.assertEqual(stats["bytes_received"],
                         sum(sizes) * 4 * len(self.mgr.args.kv_data_ptrs) * 32
                         + len(rooms) * (32 + 48))

    def test_layer_by_layer(self):
        """A prefill that sends each chunk layer by layer (send_layers, the
        last layer first) and ends with an empty last send carrying the
        state: every byte arrives; and the refusals say why."""
        rooms = [{"room": 11, "pages": [5, 6, 7, 8, 9], "aux": 1, "state": 2,
                  "dst": [40, 3, 4, 50, 51]},
                 {"room": 12, "pages": [20], "aux": 2, "state": 3, "dst": [1]}]
        self.peer = Peer({"role": "prefill", "page_size": 4, "state": True,
                          "mode": "layers",
                          "rooms": [{k: r[k] for k in ("room", "pages", "aux", "state")}
                                    for r in rooms]})
        boot = self.peer.expect(lambda e: e["event"] == "ready")["bootstrap"]
        self.mgr = kvferry.KVManager(make_args(4, state=True), "decode")
        rxs = []
        for r in rooms:
            rx = kvferry.KVReceiver(self.mgr, boot, r["room"])
            rx.init(r["dst"], r["aux"], [r["state"]])
            rxs.append(rx)
        for r, rx in zip(rooms, rxs):
            self.assertEqual(wait_state(rx, FINAL, 30), KVPoll.Success, self._why(rx))
            self.assertEqual(verify_room(self.mgr, r["room"], r["dst"], r["aux"],
                                         r["state"]), [])
            ev = self.peer.room_event(r["room"], ("Success", "Failed"))
            self.assertEqual(ev["state"], "Success", ev)

    def test_send_layers_refusals(self):
        """What send_layers refuses, before and in the library."""
        self.mgr = kvferry.KVManager(make_args(4, host_bootstrap=True,
                                               bootstrap_addr="127.0.0.1:0"), "prefill")
        tx = kvferry.KVSender(self.mgr, self.mgr.bootstrap_addr, 13)
        with self.assertRaises(kvferry.KVFerryStateError):
            tx.send_layers([1], 0, 0, 1)             # before init
        tx.close()
        tx = kvferry.KVSender.held(self.mgr, 14)
        tx.init(2, 0)
        with self.assertRaises(ValueError):
            tx.send_layers([1, 99999], 0, 0, 1)       # outside the pool
        with self.assertRaises(ValueError):
            tx.send_layers([1], -1, 0, 1)
        tx.send_layers([1, 2], 0, 0, 1)
        with self.assertRaises(kvferry.KVFerryError) as cm:
            tx.send_layers([1, 2], 0, 0, 1)           # layer 0 a second time
        self.assertIn("layer 0 already has pages [0, 2)", str(cm.exception))
        with self.assertRaises(ValueError):
            tx.send([])                               # is_last must be said
        tx.close()

    def test_prefill_here_decode_in_child(self):
        """The other direction: senders here, chunked sends with explicit
        is_last, the child verifies every byte."""
        args = make_args(4, host_bootstrap=True, bootstrap_addr="127.0.0.1:0")
        self.mgr = kvferry.KVManager(args, "prefill")
        boot = self.mgr.bootstrap_addr
        src, dst = list(range(8, 20)), list(range(63, 51, -1))
        tx = kvferry.KVSender(self.mgr, boot, 77)
        self.peer = Peer({"role": "decode", "page_size": 4, "bootstrap": boot,
                          "rooms": [{"room": 77, "pages": dst, "aux": 5}]})
        self.assertEqual(wait_state(tx, (KVPoll.WaitingForInput, KVPoll.Failed)),
                         KVPoll.WaitingForInput, self._why(tx))
        fill_room(self.mgr, 77, src, 2)
        tx.init(len(src), 2)
        tx.send(src[:5], is_last=False)
        tx.send(array.array("I", src[5:11]), is_last=False)
        # Transferring once the engine took the chunks in (its next pass).
        self.assertIn(wait_state(tx, (KVPoll.Transferring, KVPoll.Success, KVPoll.Failed)),
                      (KVPoll.Transferring, KVPoll.Success))
        tx.send(src[11:], is_last=True)
        self.assertEqual(wait_state(tx, FINAL), KVPoll.Success, self._why(tx))
        ev = self.peer.room_event(77, ("Success", "Failed"))
        self.assertEqual((ev["state"], ev.get("bad")), ("Success", []), ev)
        with self.assertRaises(kvferry.KVFerryStateError):
            tx.failure_exception()          # a successful room has no failure

    def test_auth_token_in_engine_args(self):
        """The token travels in the engine arguments: a decode engine with
        another one fails its room with the reason; one with the same gets
        every byte."""
        self.mgr = kvferry.KVManager(make_args(4, host_bootstrap=True,
                                               bootstrap_addr="127.0.0.1:0",
                                               auth_token="py-alpha"), "prefill")
        boot = self.mgr.bootstrap_addr
        wrong = kvferry.KVManager(make_args(4, auth_token="py-beta"), "decode")
        good = kvferry.KVManager(make_args(4, auth_token="py-alpha"), "decode")
        try:
            self.assertNotIn("py-alpha", repr(self.mgr.args))
            rx = kvferry.KVReceiver(wrong, boot, 5)
            self.assertEqual(wait_state(rx, FINAL), KVPoll.Failed)
            with self.assertRaises(kvferry.KVTransferError) as cm:
                rx.failure_exception()
            self.assertIn("authentication failed", str(cm.exception))
            tx = kvferry.KVSender(self.mgr, boot, 6)
            rx = kvferry.KVReceiver(good, boot, 6)
            rx.init([7, 8], 1)
            self.assertEqual(wait_state(tx, (KVPoll.WaitingForInput, KVPoll.Failed)),
                             KVPoll.WaitingForInput, self._why(tx))
            fill_room(self.mgr, 6, [3, 4], 2)
            tx.init(2, 2)
            tx.send([3, 4], is_last=True)
            self.assertEqual(wait_state(tx, FINAL), KVPoll.Success, self._why(tx))
            self.assertEqual(wait_state(rx, FINAL), KVPoll.Success, self._why(rx))
        finally:
            wrong.close()
            good.close()

    def test_streams_in_engine_args(self):
        """streams= reaches the engine: two streams per pair move a room
        byte for byte; a count the engine does not take is refused."""
        self.mgr = kvferry.KVManager(make_args(4, host_bootstrap=True,
                                               bootstrap_addr="127.0.0.1:0", streams=2,
                                               checksum=True), "prefill")
        boot = self.mgr.bootstrap_addr
        dec = kvferry.KVManager(make_args(4, streams=2), "decode")
        try:
            tx = kvferry.KVSender(self.mgr, boot, 9)
            rx = kvferry.KVReceiver(dec, boot, 9)
            rx.init([5, 6, 7, 8], 1)
            self.assertEqual(wait_state(tx, (KVPoll.WaitingForInput, KVPoll.Failed)),
                             KVPoll.WaitingForInput, self._why(tx))
            fill_room(self.mgr, 9, [1, 2, 3, 4], 2)
            tx.init(4, 2)
            tx.send([1, 2, 3, 4], is_last=True)
            self.assertEqual(wait_state(tx, FINAL), KVPoll.Success, self._why(tx))
            self.assertEqual(wait_state(rx, FINAL), KVPoll.Success, self._why(rx))
            self.assertEqual(verify_room(dec, 9, [5, 6, 7, 8], 1), [])
        finally:
            dec.close()
        with self.assertRaises(kvferry.KVFerryError):
            kvferry.KVManager(make_args(4, streams=9), "decode")

    @staticmethod
    def _why(h):
        if h.poll() != KVPoll.Failed:
            return "state %s" % h.poll().name
        try:
            h.failure_exception()
        except kvferry.KVTransferError as e:
            return str(e)


def _have_numpy():
    import importlib.util
    return importlib.util.find_spec("numpy") is not None


if __name__ == "__main__":
    unittest.main()
