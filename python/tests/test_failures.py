"""Failed rooms surface as KVTransferError with the root cause, on both sides.

Page-size mismatch (SGLang's message on both sides), a peer SIGKILLed
mid-room (the survivor fails within seconds, as the origin), and an abort
propagated to the other side (which learns it from another rank).
"""
import os
import signal
import sys
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _util import FINAL, KVPoll, Peer, kvferry, make_args, wait_state  # noqa: E402

HEARTBEAT = [100, 600]          # interval, timeout (ms): a dead peer in < 1 s
SURVIVOR_DEADLINE = 5.0         # seconds the survivor may take to fail the room


def catch(h):
    """The KVTransferError ``h.failure_exception()`` raises."""
    try:
        h.failure_exception()
    except kvferry.KVTransferError as e:
        return e
    raise AssertionError("failure_exception() did not raise")


class Failures(unittest.TestCase):

    def setUp(self):
        self.peer = self.mgr = None

    def tearDown(self):
        if self.mgr is not None:
            self.mgr.close()
        if self.peer is not None:
            self.peer.close()

    def _prefill_child(self, page_size=4, mode="run", pages=(1, 2, 3)):
        self.peer = Peer({"role": "prefill", "page_size": page_size, "mode": mode,
                          "heartbeat": HEARTBEAT,
                          "rooms": [{"room": 9, "pages": list(pages), "aux": 1}]})
        return self.peer.expect(lambda e: e["event"] == "ready")

    def test_page_size_mismatch_fails_both_sides(self):
        ready = self._prefill_child(page_size=4)
        self.mgr = kvferry.KVManager(make_args(8), "decode")
        rx = kvferry.KVReceiver(self.mgr, ready["bootstrap"], 9)
        rx.init([4, 5, 6], 0)
        self.assertEqual(wait_state(rx, FINAL), KVPoll.Failed)
        here = catch(rx)
        there = self.peer.room_event(9, ("Failed", "Success"))["failure"]
        msg = ("Page size mismatch: prefill server has page_size=4, but decode "
               "server has page_size=8.")
        for f in (here.failure_reason, there["reason"]):
            self.assertIn(msg, f)
        self.assertEqual(here.bootstrap_room, 9)
        self.assertEqual(here.status, "KVF_ERR_INCOMPATIBLE")
        self.assertIn("KVTransferError(bootstrap_room=9): Page size mismatch", str(here))
        # Exactly one side saw the root cause; the other learned it from it,
        # and both name the same origin.
        self.assertNotEqual(here.is_from_another_rank, there["from_another_rank"])
        origin = (here.origin_side, here.origin_rank, here.origin_addr)
        self.assertEqual(origin, (there["origin_side"], there["origin_rank"],
                                  there["origin_addr"]))
        seer = "decode" if not here.is_from_another_rank else "prefill"
        self.assertEqual(here.origin_side, seer)
        self.assertEqual(here.origin_addr, self.mgr.address if seer == "decode"
                         else ready["addr"])
        # Consumed once; the second call says so.
        again = catch(rx)
        self.assertTrue(again.already_consumed)
        self.assertIn("already consumed", again.failure_reason)
        self.assertIn(msg, again.failure_reason)

    def _killed_decode(self, partial):
        args = make_args(4, host_bootstrap=True, bootstrap_addr="127.0.0.1:0",
                         heartbeat_interval_ms=HEARTBEAT[0],
                         heartbeat_timeout_ms=HEARTBEAT[1])
        self.mgr = kvferry.KVManager(args, "prefill")
        boot = self.mgr.bootstrap_addr
        tx = kvferry.KVSender(self.mgr, boot, 31)
        self.peer = Peer({"role": "decode", "page_size": 4, "bootstrap": boot,
                          "mode": "hold", "heartbeat": HEARTBEAT,
                          "rooms": [{"room": 31, "pages": [7, 8, 9, 10], "aux": 3}]})
        self.assertEqual(wait_state(tx, (KVPoll.WaitingForInput, KVPoll.Failed)),
                         KVPoll.WaitingForInput)
        if partial:
            tx.init(4, 0)
            tx.send([0, 1], is_last=False)
            # Transferring once the engine took the chunk in (its next pass).
            self.assertEqual(wait_state(tx, (KVPoll.Transferring, KVPoll.Failed)),
                             KVPoll.Transferring)
        self.peer.kill()
        t0 = time.monotonic()
        self.assertEqual(wait_state(tx, FINAL, SURVIVOR_DEADLINE + 5), KVPoll.Failed)
        self.assertLess(time.monotonic() - t0, SURVIVOR_DEADLINE)
        e = catch(tx)
        self.assertFalse(e.is_from_another_rank, e)      # this rank saw it
        self.assertEqual((e.origin_side, e.origin_rank, e.origin_addr),
                         ("prefill", 0, self.mgr.address))
        self.assertIn(e.status, ("KVF_ERR_CONN_RESET", "KVF_ERR_PEER_TIMEOUT"), e)
        # The reason names the dead peer by its control address.
        dead = self.peer.expect(lambda ev: ev["event"] == "ready")["addr"]
        self.assertIn(dead, e.failure_reason)
        # The manager stays usable after losing a peer.
        with kvferry.KVSender(self.mgr, boot, 32) as tx2:
            self.assertEqual(tx2.poll(), KVPoll.Bootstrapping)

    def test_decode_killed_while_sender_waits_for_input(self):
        self._killed_decode(partial=False)

    def test_decode_killed_while_sender_transfers(self):
        self._killed_decode(partial=True)

    def test_prefill_killed_while_receiver_waits(self):
        self._killed_prefill("partial")

    def test_prefill_killed_between_layers(self):
        # It sent layer 0 of its first page (send_layers), then died: the
        # decode fails the room with the dead peer as the cause.
        self._killed_prefill("partial_layers")

    def test_prefill_stopped_between_layers(self):
        # The same, stopped (SIGSTOP): its heartbeats end, and the decode
        # fails the room naming it (close() kills it).
        self._killed_prefill("partial_layers", signal.SIGSTOP)

    def _killed_prefill(self, mode, sig=signal.SIGKILL):
        ready = self._prefill_child(mode=mode)
        args = make_args(4, heartbeat_interval_ms=HEARTBEAT[0],
                         heartbeat_timeout_ms=HEARTBEAT[1])
        self.mgr = kvferry.KVManager(args, "decode")
        rx = kvferry.KVReceiver(self.mgr, ready["bootstrap"], 9)
        rx.init([11, 12, 13], 2)
        self.peer.room_event(9, ("Transferring",))
        self.peer.kill(sig)
        t0 = time.monotonic()
        self.assertEqual(wait_state(rx, FINAL, SURVIVOR_DEADLINE + 5), KVPoll.Failed)
        self.assertLess(time.monotonic() - t0, SURVIVOR_DEADLINE)
        e = catch(rx)
        self.assertFalse(e.is_from_another_rank, e)
        self.assertEqual((e.origin_side, e.origin_rank, e.origin_addr),
                         ("decode", 0, self.mgr.address))
        self.assertIn(ready["addr"], e.failure_reason)
        if sig == signal.SIGSTOP:       # alive, silent: its heartbeats stopped
            self.assertEqual(e.status, "KVF_ERR_PEER_TIMEOUT", e)
        # The destination pages are handed back once no write can land.
        deadline = time.monotonic() + SURVIVOR_DEADLINE
        while not rx.pages_released() and time.monotonic() < deadline:
            time.sleep(0.01)
        self.assertTrue(rx.pages_released())

    def test_abort_reaches_the_other_side_with_its_origin(self):
        ready = self._prefill_child(mode="hold")
        self.mgr = kvferry.KVManager(make_args(4), "decode")
        rx = kvferry.KVReceiver(self.mgr, ready["bootstrap"], 9)
        rx.init([1, 2, 3], 0)
        self.peer.room_event(9, ("WaitingForInput",))
        rx.abort()
        # Failed once the engine's thread took the abort in (its next pass).
        self.assertEqual(wait_state(rx, FINAL, SURVIVOR_DEADLINE), KVPoll.Failed)
        mine = catch(rx)
        self.assertFalse(mine.is_from_another_rank)
        self.assertEqual(mine.status, "KVF_ERR_ABORTED")
        there = self.peer.room_event(9, ("Failed",))["failure"]
        self.assertTrue(there["from_another_rank"], there)
        self.assertEqual((there["origin_side"], there["origin_rank"],
                          there["origin_addr"]), ("decode", 0, self.mgr.address))
        self.assertEqual(there["reason"], mine.failure_reason)   # not "unknown reason"


if __name__ == "__main__":
    unittest.main()
