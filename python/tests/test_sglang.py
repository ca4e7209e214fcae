"""kvferry.sglang driven as SGLang's schedulers drive it: two prefill TP
ranks and two decode TP ranks in four processes (``_sglang_rank.py``, run
by ``_sglang_cluster.py``), the bootstrap registry here, each side's polls
MIN-reduced between its ranks over a socket pair, every byte checked on
decode with numpy.

Cases: plain rooms with chunked prefill; a decode prefix (only the rest
sent) and a full prefix hit (init(0), zero pages); typed state (a
mamba-like slot and a swa-like page list); a draft model's KV; MLA.
Beyond the 2 + 2 ranks: prefill TP 2 into decode TP 1 and TP 1 into TP 2,
and a failing room with TP 2 into TP 1, where the library links every rank
to the one that saw the root cause, so every rank raises the true reason.
Failures with TP 2 into TP 2, one root cause at a time, are
test_sglang_causes.

Those cases drive the scheduler of SGLang 0094505da741 (SGLangScheduler);
NewestScheduler drives the newest one: num_kv_tokens on send, the newest
KVArgs and state types (BLOCK_SCALE's scales byte for byte), the KV
checksum flag (SGLang's digest intact; a corrupted byte fails the room),
optimistic prefill over held rooms (decode arrives later; never arrives:
the lease; arrives after the prefill died), the prefill_complete policy
(no WaitingForInput before the prefill marked the room) and --device cuda
over the fake CUDA driver.
"""
import os
import unittest

from _sglang_cluster import (HAVE_NUMPY, MISSING, RANKS, ROOM, WHY_NUMPY, Cluster,
                             ClusterCase, S)


@unittest.skipUnless(HAVE_NUMPY, WHY_NUMPY)
@unittest.skipIf(MISSING, "libkvferry lacks %s" % ", ".join(MISSING))
class SGLangScheduler(ClusterCase):

    def assertAllSucceeded(self, res, rooms):
        for rank in res:
            for room in rooms:
                r = res[rank][room]
                self.assertEqual(r["state"], "Success", (rank, room, r))
                if rank[0] == "decode":
                    self.assertEqual(r["bad"], [], (rank, room))

    def test_plain_rooms_chunked_prefill(self):
        """Rooms of 1 token to 9 pages, sent in chunks of 2 pages (partial
        last pages included), into scattered decode pages."""
        reqs = [{"room": ROOM + i, "tokens": t} for i, t in
                enumerate([1, 4, 13, 36])]
        res = self.run_cluster(reqs, chunk=8)
        self.assertAllSucceeded(res, [r["room"] for r in reqs])
        for r in reqs:
            m = res[("prefill", 0)][r["room"]]["metric"]
            self.assertGreater(m[0], 0)           # transfer_total_bytes
            self.assertIsNotNone(m[2])            # transfer_latency_s

    def test_decode_prefix_and_full_prefix_hit(self):
        """decode_prefix_len > 0: the prefill sends only the rest; a full
        prefix hit: init(0), one send of no pages, aux only."""
        reqs = [{"room": ROOM, "tokens": 22, "prefix": 8},
                {"room": ROOM + 1, "tokens": 16, "prefix": 16},
                {"room": ROOM + 2, "tokens": 9}]
        res = self.run_cluster(reqs, chunk=4)
        self.assertAllSucceeded(res, [r["room"] for r in reqs])
        for rank in (("prefill", 0), ("prefill", 1)):
            got = {r["room"]: res[rank][r["room"]]["decode_prefix_len"] for r in reqs}
            self.assertEqual(got, {ROOM: 8, ROOM + 1: 16, ROOM + 2: 0})
        # The prefill sent 4 KV pages (not 6) for the first room and none for
        # the second: their bytes per rank compared with the third's 3 pages.
        m = {r["room"]: res[("prefill", 0)][r["room"]]["metric"][0] for r in reqs}
        aux = m[ROOM + 1]
        self.assertGreater(aux, 0)
        self.assertEqual((m[ROOM] - aux) * 3, (m[ROOM + 2] - aux) * 4)

    def test_typed_state(self):
        """A mamba-like group (one slot, two buffers) and a swa-like group
        (the window's pages in its own pool) go with the last chunk."""
        reqs = [{"room": ROOM + i, "tokens": t} for i, t in enumerate([5, 16, 27])]
        res = self.run_cluster(reqs, chunk=8, state=True)
        self.assertAllSucceeded(res, [r["room"] for r in reqs])

    def test_draft_model_buffers(self):
        """A draft model's K/V (its own head size) appended after the
        model's, sharing its pages, on both sides."""
        reqs = [{"room": ROOM + i, "tokens": t} for i, t in enumerate([6, 19])]
        res = self.run_cluster(reqs, chunk=8, draft=True)
        self.assertAllSucceeded(res, [r["room"] for r in reqs])

    def test_different_tp_sizes(self):
        """Prefill TP 2 into decode TP 1 (each prefill rank's heads into one
        decode rank's pages, which learnt its head count from the prefill
        side) and TP 1 into TP 2 (one prefill rank's heads cut per decode
        rank)."""
        reqs = [{"room": ROOM + i, "tokens": t} for i, t in enumerate([3, 21])]
        for tp in ((2, 1), (1, 2)):
            with self.subTest(tp=tp):
                res = self.run_cluster(reqs, chunk=8, tp=tp)
                self.assertEqual(len(res), sum(tp))
                self.assertAllSucceeded(res, [r["room"] for r in reqs])
                self.cluster.close()
                self.cluster = None

    def test_mla(self):
        """MLA (is_mla_backend): one latent buffer per layer, the whole of it
        on every rank, for TP 2 into 2, 2 into 1 and 1 into 2."""
        reqs = [{"room": ROOM + i, "tokens": t} for i, t in enumerate([7, 18])]
        for tp in ((2, 2), (2, 1), (1, 2)):
            with self.subTest(tp=tp):
                res = self.run_cluster(reqs, chunk=8, tp=tp, mla=True)
                self.assertEqual(len(res), sum(tp))
                self.assertAllSucceeded(res, [r["room"] for r in reqs])
                self.cluster.close()
                self.cluster = None

    def test_one_rank_fails_a_room_all_linked(self):
        """Prefill TP 2 into decode TP 1: the decode rank is linked to both
        prefill ranks and tells both the root cause, also prefill rank 1
        when its own share was acknowledged before (its room Success): it
        hears, through the decode rank, that its side failed."""
        big = ROOM
        res = self.run_cluster([{"room": big, "tokens": 40}], chunk=16, tp=(2, 1),
                               env={"KVF_CHECKSUM": "1"},
                               prefill_env={0: {"KVF_FAULTS": "corrupt@2048"}})
        root = res[("decode", 0)][big]
        self.assertEqual(root["state"], "Failed", root)
        self.assertIn("checksum mismatch", root["reason"])
        self.assertFalse(root["from_another_rank"])
        for rank in (("prefill", 0), ("prefill", 1)):
            r = res[rank][big]
            self.assertEqual((r["state"], r["reason"], r["from_another_rank"]),
                             ("Failed", root["reason"], True), (rank, r))


@unittest.skipUnless(HAVE_NUMPY, WHY_NUMPY)
@unittest.skipIf(MISSING, "libkvferry lacks %s" % ", ".join(MISSING))
class NewestScheduler(unittest.TestCase):
    """The same four processes driven as the newest SGLang's schedulers
    drive a backend: num_kv_tokens on send after get_max_transfer_tokens(),
    the newest KVArgs and StateTypes, the KV checksum flag, optimistic
    prefill (held rooms) and the prefill_complete allocation policy."""

    def setUp(self):
        self.cluster = None

    def tearDown(self):
        if self.cluster is not None:
            self.cluster.close()

    def cluster_of(self, requests, **kw):
        self.cluster = Cluster(requests, contract="new", **kw)
        return self.cluster

    def assertAllSucceeded(self, res, rooms):
        SGLangScheduler.assertAllSucceeded(self, res, rooms)

    def test_chunks_prefix_and_newest_state(self):
        """Chunked prefill with a decode prefix and a full prefix hit; then
        the newest row-addressed state types (an mxfp8 KV's BLOCK_SCALE and
        BLOCK_SCALE_SWA scales, DSV4_REQUEST_STATE, QSA_PENDING, mamba),
        every byte checked on decode."""
        reqs = [{"room": ROOM, "tokens": 22, "prefix": 8},
                {"room": ROOM + 1, "tokens": 16, "prefix": 16},
                {"room": ROOM + 2, "tokens": 9}]
        res = self.cluster_of(reqs, chunk=4).results()
        self.assertAllSucceeded(res, [r["room"] for r in reqs])
        self.assertEqual(res[("prefill", 0)][ROOM]["decode_prefix_len"], 8)
        self.cluster.close()
        reqs = [{"room": ROOM + i, "tokens": t} for i, t in enumerate([5, 16, 27])]
        res = self.cluster_of(reqs, chunk=8, state="new").results()
        self.assertAllSucceeded(res, [r["room"] for r in reqs])

    def test_checksum_flag(self):
        """--disaggregation-enable-kv-checksum: SGLang's own digest travels in
        its extra metadata buffer and arrives intact (the decode recomputes
        it over what landed), and kvferry's checksum is on: a byte
        corrupted on its way fails the room on every rank, never Success."""
        big, small = ROOM, ROOM + 1
        reqs = [{"room": big, "tokens": 40}, {"room": small, "tokens": 6, "prefix": 4}]
        res = self.cluster_of(reqs, chunk=16, checksum=True,
                              prefill_env={0: {"KVF_FAULTS": "corrupt@2048"}}).results()
        self.assertAllSucceeded(res, [small])
        for rank in RANKS:
            r = res[rank][big]
            self.assertEqual(r["state"], "Failed", (rank, r))
        self.assertIn("checksum mismatch", res[("decode", 0)][big]["reason"])
        self.cluster.close()
        res = self.cluster_of(reqs, chunk=16, checksum=True).results()
        self.assertAllSucceeded(res, [big, small])

    def test_optimistic_prefill_decode_arrives_later(self):
        """The prefill computes every room and holds it before any decode
        rank exists; the decode ranks start afterwards (one with a prefix:
        the held pages it holds are skipped) and every byte arrives."""
        reqs = [{"room": ROOM, "tokens": 13}, {"room": ROOM + 1, "tokens": 20,
                                                "prefix": 8}]
        c = self.cluster_of(reqs, chunk=8, optimistic=True, start=("prefill",))
        c.wait_events("computed", 2 * len(reqs))
        c.start_side("decode")
        res = c.results()
        self.assertAllSucceeded(res, [r["room"] for r in reqs])
        self.assertEqual(res[("prefill", 1)][ROOM + 1]["decode_prefix_len"], 8)

    def test_optimistic_prefill_decode_never_arrives(self):
        """A computed room no decode rank ever asks for fails at the end of
        its lease (its pages free), with the reason."""
        reqs = [{"room": ROOM, "tokens": 9}]
        lease = {"KVF_LEASE_MS": "1500"}
        res = self.cluster_of(reqs, optimistic=True, start=("prefill",),
                              prefill_env={0: lease, 1: lease}).results()
        self.assertEqual(sorted(res), [("prefill", 0), ("prefill", 1)])
        # Each rank's lease ends on its own clock: the first to see it names
        # it; the other may learn the failure from its scheduler's
        # all-reduce first, which carries no reason.
        reasons = []
        for rank, rooms in res.items():
            r = rooms[ROOM]
            self.assertEqual(r["state"], "Failed", (rank, r))
            self.assertTrue("lease" in r["reason"] or S.UNKNOWN_REASON in r["reason"],
                            (rank, r))
            reasons.append(r["reason"])
        self.assertTrue(any("lease ended" in r for r in reasons), reasons)

    def test_optimistic_prefill_decode_after_prefill_died(self):
        """The prefill computed and held the rooms, then died; a decode that
        comes afterwards fails each room naming the prefill it cannot
        reach, on every rank, within the deadlines."""
        reqs = [{"room": ROOM, "tokens": 9}]
        c = self.cluster_of(reqs, optimistic=True, start=("prefill",))
        c.wait_events("computed", 2)
        c.wait_registered()
        c.kill_side("prefill")
        c.start_side("decode")
        res = c.results()
        self.assertEqual(sorted(res), [("decode", 0), ("decode", 1)])
        for rank, rooms in res.items():
            r = rooms[ROOM]
            self.assertEqual((r["state"], r["type"]), ("Failed", "KVTransferError"),
                             (rank, r))
            # A rank whose own room had not failed yet when its scheduler's
            # all-reduce said Failed learns no reason from it.
            self.assertTrue("prefill rank" in r["reason"] or
                            S.UNKNOWN_REASON in r["reason"], (rank, r))
        self.assertTrue(any("connect failed" in rooms[ROOM]["reason"]
                            for rooms in res.values()), res)

    def test_prefill_complete(self):
        """--disaggregation-decode-allocation-policy prefill_complete: the
        decode ranks are connected but report Bootstrapping (no pages
        allocated) until the prefill marks the room computed; a room the
        prefill gives up before that fails on decode with the prefill's
        reason, from another rank (through the room's own links, or the
        registry's readiness, whichever comes first)."""
        ok, gone = ROOM, ROOM + 1
        reqs = [{"room": ok, "tokens": 14}, {"room": gone, "tokens": 5,
                                              "abort": "prefill-computed"}]
        c = self.cluster_of(reqs, optimistic=True, policy="prefill_complete",
                            hold_mark=True)
        # Both decode ranks connected to the room the prefill still computes
        # and kept it Bootstrapping; only then may the prefill mark it.
        c.wait_events("gated", 2, room=ok)
        c.tell("decode", "go")
        c.wait_events("go-seen", 2)
        c.tell("prefill", "go")
        res = c.results()
        self.assertAllSucceeded(res, [ok])
        for rank in (("decode", 0), ("decode", 1)):
            self.assertFalse(res[rank][ok]["early"], rank)
            r = res[rank][gone]
            self.assertEqual((r["state"], r["from_another_rank"]), ("Failed", True),
                             (rank, r))
            # The prefill's abort itself: through the room's links, or the
            # registry's readiness (whichever came first).
            self.assertIn(S.ABORT_REASON, r["reason"], (rank, r))
            self.assertNotIn(S.UNKNOWN_REASON, r["reason"], (rank, r))

    def test_device_memory(self):
        """--device cuda: the pools are registered as CUDA memory (the fake
        driver says they are; tcp stages them through pinned memory) and
        every byte arrives."""
        if not os.environ.get("KVF_FAKE_CUDA"):
            self.skipTest("KVF_FAKE_CUDA (the fake CUDA driver) is not set")
        reqs = [{"room": ROOM + i, "tokens": t} for i, t in enumerate([6, 17])]
        res = self.cluster_of(reqs, gpu=True, state=True,
                              env={"KVF_CUDA_DRIVER": os.environ["KVF_FAKE_CUDA"],
                                   "KVF_TRANSPORT": "tcp"}).results()
        self.assertAllSucceeded(res, [r["room"] for r in reqs])


if __name__ == "__main__":
    unittest.main()
