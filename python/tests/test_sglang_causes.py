"""Every rank of a request names its root cause (docs/FAILURES.md, "Every
rank of the request names the cause"), with kvferry.sglang driven as
SGLang's schedulers drive it (``_sglang_cluster.py``): prefill TP 2 into
decode TP 2, the pairs P0-D0 and P1-D1 joined by nothing but the room.
For each root cause (an abort on either side, a destination the adapter
refuses, a checksum mismatch, a deadline, a rank killed or stopped, a link
cut), every rank still alive raises a KVTransferError with its reason, its
origin and is_from_another_rank, never SGLang's "unknown reason"; and
failure_exception(), which waits up to RELAY_WAIT_S for a cause still on
its way, returned because it came.  ``KVF_SHOW_WAITS=1`` prints how long
each rank waited.
"""
import os
import signal
import sys
import unittest

from _sglang_cluster import (D0, D1, HAVE_NUMPY, MISSING, P0, P1, ROOM, WHY_NUMPY,
                             Cluster, Netns, S)


def show_waits(room, res):
    """With KVF_SHOW_WAITS set: how long each rank's failure_exception()
    waited, and what its own room was then."""
    if os.environ.get("KVF_SHOW_WAITS"):
        sys.stderr.write("room %d: %s\n" % (room, ", ".join(
            "%s%d %s %.4fs" % (k[0][0], k[1], r.get("own"), r.get("waited_s", -1))
            for k, r in sorted((k, v[room]) for k, v in res.items()))))


def check_cause(tc, res, addrs, room, causes, says, status=None):
    """Every rank in ``res`` failed ``room`` with one root cause.  A rank that
    saw the cause itself (from_another_rank False) is one of ``causes`` and
    names itself as the origin; every other rank learned it from another
    rank, with the reason, status and origin of a rank that saw it (or, for
    a cause rank not in ``res``, that rank's address).  ``says``: {cause:
    [texts its reason contains]}.  No rank says "unknown reason", and each
    rank's failure_exception() returned because the cause was there, not
    because its wait for it ran out."""
    show_waits(room, res)
    own = {}
    for rank in sorted(res):
        r = res[rank][room]
        ctx = (rank, r)
        tc.assertEqual((r["state"], r["type"]), ("Failed", "KVTransferError"), ctx)
        # Not "unknown": failure_exception() returned because the cause came,
        # not because its wait for it (RELAY_WAIT_S) ran out.
        tc.assertNotIn(S.UNKNOWN_REASON, r["reason"], ctx)
        tc.assertIsNotNone(r["origin"], ctx)
        origin = tuple(r["origin"][:2])
        tc.assertIn(origin, causes, ctx)
        tc.assertEqual(r["origin"][2], addrs[origin], ctx)
        for text in says[origin]:
            tc.assertIn(text, r["reason"], ctx)
        if status is not None:
            tc.assertEqual(r["status"], status, ctx)
        if not r["from_another_rank"]:
            tc.assertEqual(origin, rank, ctx)
            own[rank] = r
    if any(c in res for c in causes):
        tc.assertTrue(own, res)
    for rank in res:
        r = res[rank][room]
        first = own.get(tuple(r["origin"][:2]))
        if first is not None:
            tc.assertEqual((r["reason"], r["status"]), (first["reason"], first["status"]),
                           (rank, r))


CONTROL, ABORT_P, ABORT_P_RUN, ABORT_D, REFUSED, CHECKSUM, DEADLINE = \
    range(ROOM + 20, ROOM + 27)


@unittest.skipUnless(HAVE_NUMPY, WHY_NUMPY)
@unittest.skipIf(MISSING, "libkvferry lacks %s" % ", ".join(MISSING))
class EveryRankNamesTheCause(unittest.TestCase):
    """Prefill TP 2 into decode TP 2 (the pairs P0-D0 and P1-D1, nothing but
    the room between them): for each root cause, every rank of both sides
    fails the room with it.  One cluster, one room per cause, each cause
    confined to its room: the corrupted byte (checksums on) is in the only
    room past 2048 bytes, prefill rank 0's 2 s waiting deadline ends only
    the room its scheduler never sends, the aborts and the refused
    destination name their room.  A control room succeeds."""

    @classmethod
    def setUpClass(cls):
        reqs = [{"room": CONTROL, "tokens": 12},
                {"room": ABORT_P, "tokens": 8, "abort": "prefill-bootstrap",
                 "after": CONTROL, "starve": True},
                {"room": ABORT_P_RUN, "tokens": 16, "abort": "prefill-running"},
                {"room": ABORT_D, "tokens": 12, "abort": "decode"},
                {"room": REFUSED, "tokens": 12, "refuse": 1},
                {"room": CHECKSUM, "tokens": 40},
                {"room": DEADLINE, "tokens": 12, "skip": 0}]
        cls.cluster = Cluster(reqs, chunk=8, env={"KVF_CHECKSUM": "1"},
                              prefill_env={0: {"KVF_FAULTS": "corrupt@2048",
                                               "KVF_WAITING_TIMEOUT_MS": "2000"}})
        try:
            cls.res = cls.cluster.results()
        except BaseException:
            cls.cluster.close()
            raise
        cls.addrs = cls.cluster.addrs

    @classmethod
    def tearDownClass(cls):
        cls.cluster.close()

    def test_control_room_succeeds(self):
        for rank in (P0, P1, D0, D1):
            r = self.res[rank][CONTROL]
            self.assertEqual(r["state"], "Success", (rank, r))
            if rank[0] == "decode":
                self.assertEqual(r["bad"], [], rank)

    def test_abort_on_prefill(self):
        """AbortReq on prefill while the request waits in the bootstrap
        queue (the decode server has no pages for it yet): both prefill
        ranks abort (one may hear its sibling's abort first), both decode
        ranks learn it."""
        check_cause(self, self.res, self.addrs, ABORT_P, (P0, P1),
                    {P0: [S.ABORT_REASON], P1: [S.ABORT_REASON]}, "KVF_ERR_ABORTED")
        for rank in (D0, D1):
            self.assertTrue(self.res[rank][ABORT_P]["from_another_rank"], rank)

    def test_abort_on_prefill_mid_prefill(self):
        """AbortReq on prefill after the first chunk: SGLang aborts and
        clears the senders and raises nothing there; both decode ranks
        name the abort, not the sender's destruction."""
        for rank in (P0, P1):
            self.assertEqual(self.res[rank][ABORT_P_RUN]["state"], "Aborted", rank)
        decode = {k: v for k, v in self.res.items() if k[0] == "decode"}
        check_cause(self, decode, self.addrs, ABORT_P_RUN, (P0, P1),
                    {P0: [S.ABORT_REASON], P1: [S.ABORT_REASON]}, "KVF_ERR_ABORTED")

    def test_abort_on_decode(self):
        """AbortReq on decode while the room waits for pages."""
        check_cause(self, self.res, self.addrs, ABORT_D, (D0, D1),
                    {D0: [S.ABORT_REASON], D1: [S.ABORT_REASON]}, "KVF_ERR_ABORTED")
        for rank in (P0, P1):
            self.assertTrue(self.res[rank][ABORT_D]["from_another_rank"], rank)

    def test_refused_destination(self):
        """Decode rank 1 is handed a page past its pool: kvferry.sglang
        refuses it before the library sees it, and its own words reach
        every rank, prefill rank 0 (which never fed it) and decode rank 0
        (linked to it by nothing but the room) included."""
        check_cause(self, self.res, self.addrs, REFUSED, (D1,),
                    {D1: ["send_metadata(3 pages, aux_index", "refused on decode rank 1",
                          "kv_indices[2] = 71 is outside the registered KV pages"]},
                    "KVF_ERR_BAD_INDICES")

    def test_checksum_mismatch(self):
        """A byte corrupted on prefill rank 0 (checksums on): decode rank 0
        sees the mismatch; the rank-1 pair, whose own bytes all moved,
        names it too."""
        check_cause(self, self.res, self.addrs, CHECKSUM, (D0,),
                    {D0: ["checksum mismatch", "from prefill rank 0 (%s)"
                          % self.addrs[P0]]}, "KVF_ERR_CHECKSUM")
        self.assertIn("KVTransferError(bootstrap_room=%d)" % CHECKSUM,
                      self.res[D0][CHECKSUM]["str"])

    def test_deadline(self):
        """Prefill rank 0's scheduler never sends the request's chunks: its
        waiting deadline ends the room there, and every rank says so."""
        check_cause(self, self.res, self.addrs, DEADLINE, (P0,),
                    {P0: ["room %d made no progress in" % DEADLINE,
                          "the scheduler did not call kvf_sender_send"]},
                    "KVF_ERR_TIMED_OUT")


HELD = ROOM + 30


@unittest.skipUnless(HAVE_NUMPY, WHY_NUMPY)
@unittest.skipIf(MISSING, "libkvferry lacks %s" % ", ".join(MISSING))
class LostRank(unittest.TestCase):
    """A rank killed, stopped or cut off mid-transfer, after the first chunk
    landed on both decode ranks (prefill rank 0 holds there until the test
    acted): every rank still alive names it, the dead rank's siblings
    included, never "unknown".  The driver's all-reduce outlives a dead or
    stopped sibling (_sglang_rank.py)."""

    def setUp(self):
        self.cluster = self.netns = None

    def tearDown(self):
        if self.cluster is not None:
            self.cluster.close()
        if self.netns is not None:
            self.netns.close()

    def start_held(self, netns=None):
        """The room in flight, prefill rank 0 held after its first chunk."""
        self.cluster = c = Cluster([{"room": HELD, "tokens": 40, "hold": 0}], chunk=8,
                                   netns=netns)
        c.until(lambda: c.saw("held", "prefill", 0) and c.saw("landed", "decode", 0)
                and c.saw("landed", "decode", 1),
                "prefill rank 0 to hold, the first chunk on both decode ranks")
        return c

    def test_prefill_rank_killed(self):
        c = self.start_held()
        c.signal(P0, signal.SIGKILL)
        res = c.results()
        self.assertNotIn(P0, res)
        says = ["prefill rank 0 (%s)" % c.addrs[P0], "connection lost"]
        check_cause(self, res, c.addrs, HELD, (D0, D1), {D0: says, D1: says})

    def test_decode_rank_killed(self):
        c = self.start_held()
        c.signal(D0, signal.SIGKILL)
        c.send(P0, "go")
        res = c.results()
        self.assertNotIn(D0, res)
        check_cause(self, res, c.addrs, HELD, (P0,),
                    {P0: ["decode rank 0 (%s)" % c.addrs[D0], "connection lost"]},
                    "KVF_ERR_CONN_RESET")

    def test_prefill_rank_stopped(self):
        """SIGSTOP on prefill rank 0 (its sibling's all-reduce waits, as
        gloo's would); SIGCONT once both decode ranks have failed the room:
        prefill rank 0 then reads why."""
        c = self.start_held()
        c.signal(P0, signal.SIGSTOP)
        c.send(P0, "go")
        c.until(lambda: D0 in c.out and D1 in c.out, "both decode ranks' results")
        c.signal(P0, signal.SIGCONT)
        res = c.results()
        says = ["prefill rank 0 (%s)" % c.addrs[P0], "sent nothing for"]
        check_cause(self, res, c.addrs, HELD, (D0, D1), {D0: says, D1: says},
                    "KVF_ERR_PEER_TIMEOUT")
        self.assertTrue(res[P0][HELD]["from_another_rank"])

    def test_link_cut(self):
        """The link between prefill rank 0 and decode rank 0 goes down (no
        FIN, no RST); each still reaches every other rank."""
        why = Netns.unavailable()
        if why:
            self.skipTest("cannot make network namespaces here (root and iproute2 "
                          "needed): %s" % why)
        self.netns = Netns()
        c = self.start_held(self.netns)
        self.netns.cut()
        c.send(P0, "go")
        res = c.results()
        check_cause(self, res, c.addrs, HELD, (P0, D0),
                    {P0: ["decode rank 0 (%s)" % c.addrs[D0], "sent nothing for"],
                     D0: ["prefill rank 0 (%s)" % c.addrs[P0], "sent nothing for"]},
                    "KVF_ERR_PEER_TIMEOUT")


if __name__ == "__main__":
    unittest.main()
