"""kvferry.sglang's layer-pipelined sends driven as SGLang's open PR #34905
drives a sender (``_sglang_rank.py``'s run_layered): the middle chunks
through send(), the last one with prepare_layer_pipelined_transfer, then
send_layers for each layer with a CUDA event that completes only after
the call (the layer's bytes are written then), the draft model's layers,
and send_final_metadata.  Prefill and decode ranks are real processes
(``_sglang_cluster.py``); decode checks every byte.  A layer never sent
fails the room on every rank, its reason naming the layer.
"""
import unittest

import test_sglang_causes as causes
from _sglang_cluster import (D0, D1, HAVE_NUMPY, MISSING, P0, P1, ROOM, WHY_NUMPY,
                             ClusterCase, S)


@unittest.skipUnless(HAVE_NUMPY, WHY_NUMPY)
@unittest.skipIf(MISSING + [n for n in ("kvf_sender_send_layers",) if not S._lib.has(n)],
                 "libkvferry lacks layer-wise sends")
class LayerPipelined(ClusterCase):

    def cluster_results(self, reqs, **kw):
        return self.run_cluster(reqs, chunk=8, layered=True, **kw)

    def test_rooms_layer_by_layer(self):
        """A room of one chunk, rooms with middle chunks sent whole before
        the last one goes layer by layer, a decode prefix (only the rest
        sent), with typed state and a draft model (TP 2 into 2), and MLA
        (TP 2 into 1): every byte of every layer in place."""
        reqs = [{"room": ROOM + i, "tokens": t} for i, t in enumerate([5, 13, 36])]
        reqs.append({"room": ROOM + 3, "tokens": 22, "prefix": 8})
        rooms = [r["room"] for r in reqs]
        for kw in (dict(state=True, draft=True), dict(mla=True, tp=(2, 1))):
            with self.subTest(**kw):
                res = self.cluster_results(reqs, **kw)
                self.assertEqual(len(res), sum(kw.get("tp", (2, 2))))
                for rank in res:
                    for room in rooms:
                        r = res[rank][room]
                        self.assertEqual(r["state"], "Success", (rank, room, r))
                        if rank[0] == "decode":
                            self.assertEqual(r["bad"], [], (rank, room))
                self.cluster.close()
                self.cluster = None

    def test_layer_never_sent_fails_the_room(self):
        """Prefill rank 0 never sends layer 1 of the last chunk: its final
        metadata fails the room there, and every rank of both sides raises
        that reason, naming the layer and the rank; another room is not
        touched."""
        short, control = ROOM, ROOM + 1
        res = self.cluster_results([{"room": short, "tokens": 20, "drop_layer": [0, 1]},
                                     {"room": control, "tokens": 12}])
        causes.check_cause(self, res, self.cluster.addrs, short, (P0,),
                           {P0: ["the last send left layer 1 without every one of the",
                                 "prefill rank 0"]}, "KVF_ERR_INCOMPLETE")
        self.assertFalse(res[P0][short]["from_another_rank"])
        for rank in (P1, D0, D1):
            self.assertTrue(res[rank][short]["from_another_rank"], rank)
            self.assertEqual(res[rank][control]["state"], "Success", rank)


if __name__ == "__main__":
    unittest.main()
