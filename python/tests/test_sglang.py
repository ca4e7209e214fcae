"""kvferry.sglang driven as SGLang's schedulers drive it: two prefill TP
ranks and two decode TP ranks in four processes (``_sglang_rank.py``), the
bootstrap registry here, each side's polls MIN-reduced between its ranks
over a socket pair, every byte checked on decode with numpy.

Cases: plain rooms with chunked prefill; a decode prefix (only the rest
sent) and a full prefix hit (init(0), zero pages); typed state (a
mamba-like slot and a swa-like page list); a draft model's KV; one rank
failing a room (a corrupted byte under checksums, on prefill rank 0): every
rank raises KVTransferError, with the true reason where the rank could
know it and the right is_from_another_rank; an abort on decode.  Beyond
the 2 + 2 ranks: prefill TP 2 into decode TP 1 and TP 1 into TP 2, and the
failing room with TP 2 into TP 1, where the library links every rank to
the one that saw the root cause, so every rank raises the true reason.
"""
import json
import os
import queue
import socket
import subprocess
import sys
import threading
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

try:
    import numpy  # noqa: F401
    HAVE_NUMPY = True
except ImportError:
    HAVE_NUMPY = False

from kvferry import _lib  # noqa: E402
from kvferry import sglang as S  # noqa: E402

NEEDS = ("kvf_receiver_set_dest", "kvf_sender_set_states",
         "kvf_sender_decode_prefix_len", "kvf_sender_metric")
MISSING = [n for n in NEEDS if not _lib.has(n)]
TIMEOUT = 120                          # seconds for one case, every process

ROOM = 2 ** 63 + 11                    # ids past 2^63 on purpose


class Cluster:
    """A registry, two prefill ranks and two decode ranks."""

    def __init__(self, requests, chunk=8, env=None, prefill_env=None, tp=(2, 2),
                 **layout):
        self.boot = S.KVFerryKVBootstrapServer(host="127.0.0.1", port=0)
        self.addr = "127.0.0.1:%d" % self.boot.port
        self.procs, self.events = [], queue.Queue()
        pairs = [socket.socketpair() if n == 2 else None for n in tp]
        penv = dict(os.environ)
        penv["PYTHONPATH"] = os.pathsep.join(
            [os.path.dirname(HERE)] + [p for p in penv.get("PYTHONPATH", "").split(
                os.pathsep) if p])
        try:
            for side, pair, size in zip(("prefill", "decode"), pairs, tp):
                for rank in range(size):
                    e = dict(env or {})
                    if side == "prefill":
                        e.update((prefill_env or {}).get(rank, {}))
                    cfg = dict(layout, role=side, tp_rank=rank, tp_size=size,
                               bootstrap=self.addr, requests=requests, chunk=chunk,
                               env=e)
                    fd = pair[rank].fileno() if pair is not None else -1
                    p = subprocess.Popen(
                        [sys.executable, os.path.join(HERE, "_sglang_rank.py"),
                         json.dumps(cfg), str(fd)], pass_fds=(fd,) if fd >= 0 else (),
                        env=penv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                        text=True)
                    self.procs.append(p)
                    threading.Thread(target=self._read, args=(p,), daemon=True).start()
        finally:
            for pair in pairs:
                for sock in pair or ():
                    sock.close()
        self.ranks = sum(tp)

    def _read(self, p):
        for line in p.stdout:
            try:
                self.events.put(json.loads(line))
            except ValueError:
                self.events.put({"event": "garbage", "line": line})
        self.events.put({"event": "eof", "rc": p.wait()})

    def results(self):
        """{(role, tp_rank): {room: result}} once every rank reported."""
        out, deadline = {}, time.monotonic() + TIMEOUT
        while len(out) < self.ranks:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError("ranks did not finish in %ds; have %s"
                                     % (TIMEOUT, sorted(out)))
            try:
                ev = self.events.get(timeout=left)
            except queue.Empty:
                continue
            if ev["event"] == "result":
                out[(ev["role"], ev["tp_rank"])] = {int(k): v for k, v in
                                                    ev["rooms"].items()}
            elif ev["event"] in ("error", "eof", "garbage"):
                raise AssertionError("a rank failed: %s" % ev)
        for p in self.procs:
            p.stdin.write("exit\n")
            p.stdin.flush()
        for p in self.procs:
            p.wait(timeout=30)
        return out

    def close(self):
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=30)
            for f in (p.stdin, p.stdout):
                try:
                    f.close()
                except OSError:
                    pass
        self.boot.close()


RANKS = [(side, r) for side in ("prefill", "decode") for r in range(2)]


@unittest.skipUnless(HAVE_NUMPY, "numpy is needed to check every byte "
                     "(Debian: python3-numpy; `make deps`)")
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

    def test_one_rank_fails_a_room(self):
        """Prefill rank 0 corrupts a byte of the big room (checksums on):
        decode rank 0 sees the mismatch, and every other rank of both
        sides names it; the small room succeeds everywhere."""
        big, small = ROOM, ROOM + 1
        reqs = [{"room": big, "tokens": 40}, {"room": small, "tokens": 2}]
        res = self.run_cluster(reqs, chunk=16, env={"KVF_CHECKSUM": "1"},
                               prefill_env={0: {"KVF_FAULTS": "corrupt@2048"}})
        self.assertAllSucceeded(res, [small])
        for rank in RANKS:
            r = res[rank][big]
            self.assertEqual(r["state"], "Failed", (rank, r))
            self.assertEqual(r["type"], "KVTransferError", (rank, r))
        root = res[("decode", 0)][big]
        self.assertIn("checksum mismatch", root["reason"])
        self.assertFalse(root["from_another_rank"])
        self.assertIn("KVTransferError(bootstrap_room=%d)" % big, root["str"])
        # Every other rank names the same cause, learned from another rank:
        # prefill rank 0 from its pair, the rank-1 pair (whose own bytes all
        # moved) through the room's sibling links.
        for rank in RANKS:
            if rank == ("decode", 0):
                continue
            r = res[rank][big]
            self.assertEqual(r["reason"], root["reason"], (rank, r))
            self.assertTrue(r["from_another_rank"], (rank, r))
            self.assertNotIn(S.UNKNOWN_REASON, r["reason"], (rank, r))

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
        prefill ranks and tells both the root cause.  Prefill rank 1 gets
        it unless its own share was acknowledged before (its room is then
        final, Success, and only its scheduler's all-reduce fails it)."""
        big = ROOM
        res = self.run_cluster([{"room": big, "tokens": 40}], chunk=16, tp=(2, 1),
                               env={"KVF_CHECKSUM": "1"},
                               prefill_env={0: {"KVF_FAULTS": "corrupt@2048"}})
        root = res[("decode", 0)][big]
        self.assertEqual(root["state"], "Failed", root)
        self.assertIn("checksum mismatch", root["reason"])
        self.assertFalse(root["from_another_rank"])
        r = res[("prefill", 0)][big]
        self.assertEqual((r["state"], r["reason"], r["from_another_rank"]),
                         ("Failed", root["reason"], True), r)
        r = res[("prefill", 1)][big]
        self.assertEqual((r["state"], r["from_another_rank"]), ("Failed", True), r)
        if r["reason"] != root["reason"]:
            self.assertIn(S.UNKNOWN_REASON, r["reason"])
            self.assertIn("this rank's room was Success", r["reason"])

    def test_abort_in_prealloc_queue(self):
        """AbortReq on decode while the room waits for pages: both decode
        ranks fail it as aborted (each got the AbortReq; the one that heard
        its sibling's abort first says it learned it from another rank),
        both prefill ranks from another rank; the other room succeeds."""
        reqs = [{"room": ROOM, "tokens": 12, "abort": True},
                {"room": ROOM + 1, "tokens": 12}]
        res = self.run_cluster(reqs, chunk=8)
        self.assertAllSucceeded(res, [ROOM + 1])
        own = 0
        for rank in (("decode", 0), ("decode", 1)):
            r = res[rank][ROOM]
            self.assertEqual((r["state"], r["reason"]), ("Failed", S.ABORT_REASON),
                             (rank, r))
            own += not r["from_another_rank"]
        self.assertGreaterEqual(own, 1, res)
        for rank in (("prefill", 0), ("prefill", 1)):
            r = res[rank][ROOM]
            self.assertEqual(r["state"], "Failed", (rank, r))
            self.assertTrue(r["from_another_rank"], (rank, r))


if __name__ == "__main__":
    unittest.main()
