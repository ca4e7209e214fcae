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
"""
import unittest

from _sglang_cluster import HAVE_NUMPY, MISSING, ROOM, WHY_NUMPY, Cluster


@unittest.skipUnless(HAVE_NUMPY, WHY_NUMPY)
@unittest.skipIf(MISSING, "libkvferry lacks %s" % ", ".join(MISSING))
class SGLangScheduler(unittest.TestCase):

    def setUp(self):
        self.cluster = None

    def tearDown(self):
        if self.cluster is not None:
            self.cluster.close()

    def run_cluster(self, requests, **kw):
        self.cluster = Cluster(requests, **kw)
        return self.cluster.results()

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

if __name__ == "__main__":
    unittest.main()
