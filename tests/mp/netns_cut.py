#!/usr/bin/env python3
"""Cut the link between prefill rank 0 and decode rank 0 alone, each rank in
its own network namespace (test_netns_cut.sh builds them), once per
parallel shape.

The driver is the orchestrator (run in the hub namespace, beside the
registry): it speaks the ranks' line protocol (rank.c) itself, "go",
"resume", "release INDEX STATE", "batch FIRST COUNT", "exit" on stdin and
JSON events on stdout, and keeps every room until all its ranks are final,
as `kvferry demo` does, then tells each rank the MIN of their states.
Prefill rank 0 holds after its first "mid" event; the cut comes right
then: a blackhole route to the peer in both namespaces, so nothing of the
pair's packets arrives and nobody is told (only heartbeats can find it),
while every other link of the room stays up.

The rooms resolve as soon as one end of the cut finds its peer silent
(its siblings relay the cause), so the other end may still hold the dead
connection when the route comes back, until its own heartbeat timeout:
a first fresh batch may fail there, naming the cut pair's silence, and
settles it; a second fresh batch must then succeed on every rank.

Usage: netns_cut.py KVFERRY NS_PREFIX HUB_IP
"""
import json
import os
import select
import signal
import subprocess
import sys
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import siblings  # noqa: E402

ROOMS, FRESH = 4, 4
RESOLVE_LIMIT_S = 5.0
# tcp: the namespaces share one kernel, and shm would carry the payload
# past the cut (its sockets are per namespace besides).
COMMON = ["--model", "tiny", "--tokens", "2048", "--chunk", "256", "--transport", "tcp",
          "--concurrency", str(ROOMS), "--requests", str(ROOMS)]
SHAPES = [
    ("TP 1 -> 1", dict(prefill_tp=1, decode_tp=1)),
    ("TP 2 -> 2", dict(prefill_tp=2, decode_tp=2)),
    ("TP 4 -> 4", dict(prefill_tp=4, decode_tp=4)),
    ("PP 2 -> 2", dict(prefill_pp=2, decode_pp=2)),
    # Seed 4: rooms 0 and 1 are DP group 0's (prefill rank 0's), 2 and 3 group 1's.
    ("DP 2, TP 2 -> 2", dict(dp=2, prefill_tp=2, decode_tp=2, seed=4)),
]
M64, M63 = (1 << 64) - 1, (1 << 63) - 1


def die(msg):
    print("FAIL netns cut: " + msg)
    sys.exit(1)


def mix64(z):
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def room_id(seed, index):
    """tools/pattern.c, kvt_room_id: which DP group a room goes to."""
    x = (mix64(seed) + index) & M63
    x = (x * 0xBF58476D1CE4E5B9) & M63
    x ^= x >> 29
    x = (x * 0x94D049BB133111EB) & M63
    return x ^ (x >> 32)


class Rank:
    def __init__(self, side, index, ip, argv, env):
        self.side, self.index, self.ip = side, index, ip
        self.name = "%s[%d]" % (side, index)
        self.p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  env=dict(env, KVF_HOST=ip), text=True)
        self.buf = b""         # raw reads: select() must see every line
        self.ready = None
        self.results = 0
        self.mid = False
        self.final = {}        # index -> state first reported final
        self.rooms = {}        # index -> "room" event (released)

    def send(self, line):
        self.p.stdin.write(line + "\n")
        self.p.stdin.flush()


class Run:
    """One shape: its ranks, their rooms, the release of each room."""

    def __init__(self, exe, prefix, hub_ip, shape):
        self.shape = shape
        self.dp = shape.get("dp", 1)
        self.seed = shape.get("seed", 1)
        self.ranks_per_group = shape.get("prefill_pp", 1) * shape.get("prefill_tp", 1)
        self.np = self.dp * self.ranks_per_group
        self.nd = shape.get("decode_pp", 1) * shape.get("decode_tp", 1)
        self.env = dict(os.environ, KVF_BOOTSTRAP_TIMEOUT_MS="3000",
                        KVF_WAITING_TIMEOUT_MS="3000", KVF_TRANSFER_TIMEOUT_MS="3000")
        self.exe, self.prefix = exe, prefix
        self.released = set()
        self.reg = subprocess.Popen([exe, "bootstrap", "--host", hub_ip, "--port", "0"],
                                    stdout=subprocess.PIPE, text=True, env=self.env)
        line = self.reg.stdout.readline()
        if "listening on " not in line:
            die("the registry did not start: %r" % line)
        self.registry = line.split("listening on ")[1].strip()
        opts = []
        for k, v in shape.items():
            opts += ["--" + k.replace("_", "-"), str(v)]
        self.ranks = []
        for side, n, base in (("prefill", self.np, 10), ("decode", self.nd, 50)):
            for i in range(n):
                argv = ["ip", "netns", "exec", "%s%s%d" % (prefix, side[0], i), exe, "_rank",
                        "--role", side, "--rank", str(i), "--registry", self.registry]
                argv += COMMON + opts + (["--hold=mid"] if side == "prefill" and i == 0 else [])
                self.ranks.append(Rank(side, i, "10.213.71.%d" % (base + i), argv, self.env))
        self.p0, self.d0 = self.ranks[0], self.ranks[self.np]

    def close(self):
        for r in self.ranks:
            if r.p.poll() is None:
                r.p.kill()
                r.p.wait()
        self.reg.terminate()
        self.reg.wait()

    def involved(self, r, index):
        return r.side == "decode" or self.dp == 1 or \
            room_id(self.seed, index) % self.dp == r.index // self.ranks_per_group

    def take(self, r, line):
        ev = json.loads(line)
        kind = ev.get("event")
        if kind == "ready":
            r.ready = ev
        elif kind == "phase" and ev.get("phase") == "mid":
            r.mid = True
        elif kind == "final":
            r.final.setdefault(ev["index"], ev["state"])
            self.release(ev["index"])
        elif kind == "room":
            r.rooms[ev["index"]] = ev
        elif kind == "result":
            r.results += 1
        elif kind == "error":
            die("%s: %s" % (r.name, ev.get("message")))

    def release(self, index):
        """Once every rank of the room is final: the MIN to each of them."""
        ranks = [r for r in self.ranks if self.involved(r, index)]
        if index in self.released or any(index not in r.final for r in ranks):
            return
        self.released.add(index)
        state = "Failed" if any(r.final[index] == "Failed" for r in ranks) else "Success"
        for r in ranks:
            r.send("release %d %s" % (index, state))

    def pump(self, until, timeout, what):
        end = time.time() + timeout
        while not until():
            left = end - time.time()
            if left <= 0:
                die("%s: timed out after %.0f s waiting for %s" % (self.label, timeout, what))
            fds = {r.p.stdout.fileno(): r for r in self.ranks}
            ready, _, _ = select.select(list(fds), [], [], min(left, 0.2))
            for fd in ready:
                r = fds[fd]
                data = os.read(fd, 65536)
                if not data:
                    die("%s: %s exited (status %s) while waiting for %s"
                        % (self.label, r.name, r.p.wait(), what))
                r.buf += data
                while b"\n" in r.buf:
                    line, r.buf = r.buf.split(b"\n", 1)
                    self.take(r, line.decode())

    def registered(self):
        try:
            urllib.request.urlopen("http://%s/route?prefill_dp_rank=-1&prefill_cp_rank=-1"
                                   "&target_tp_rank=-1&target_pp_rank=-1" % self.registry,
                                   timeout=1)
            return True
        except OSError:
            return False

    def route(self, op):
        """Blackhole (op "add") or restore ("del") the pair's routes."""
        for a, b in ((self.p0, self.d0), (self.d0, self.p0)):
            ns = "%s%s%d" % (self.prefix, a.side[0], a.index)
            subprocess.run(["ip", "-n", ns, "route", op, "blackhole", b.ip + "/32"], check=True)


def check_cut(run, t_cut):
    cut = {run.p0.ready["addr"], run.d0.ready["addr"]}
    failed, worst = 0, 0.0
    for i in range(ROOMS):
        ranks = [r for r in run.ranks if run.involved(r, i)]
        for r in ranks:
            if i not in r.rooms:
                die("%s: %s did not report room %d" % (run.label, r.name, i))
        view = [dict(side=r.side, rank=r.index, state=r.rooms[i]["state"],
                     failure=r.rooms[i].get("failure")) for r in ranks]
        why = siblings.one_state(view)
        common, why2 = siblings.one_cause(view)
        if why or why2:
            die("%s: room %d: %s" % (run.label, i, why or why2))
        bad = [r.name for r in ranks if r.rooms[i]["state"] == "Success"
               and r.rooms[i].get("verified") is False]
        if bad:
            die("%s: room %d: SUCCESS with wrong data on %s" % (run.label, i, bad))
        if all(v["state"] == "Success" for v in view):
            continue   # finished before the cut took effect: allowed
        if run.dp > 1 and room_id(run.seed, i) % run.dp != 0:
            die("%s: room %d of DP group 1, which the cut does not touch, failed"
                % (run.label, i))
        if not common & cut:
            die("%s: room %d: its records share %s, not the cut pair %s"
                % (run.label, i, sorted(common), sorted(cut)))
        failed += 1
        worst = max([worst] + [r.rooms[i]["end"] - t_cut for r in ranks])
    if failed == 0:
        die("%s: no room failed although the pair's link was cut mid-transfer" % run.label)
    if worst > RESOLVE_LIMIT_S:
        die("%s: rooms took %.2f s after the cut to resolve on every rank (limit %.1f s)"
            % (run.label, worst, RESOLVE_LIMIT_S))
    why = run.d0.rooms[min(i for i in range(ROOMS) if run.d0.rooms[i]["state"] == "Failed")]
    print("ok: %-16s cut prefill[0] <-> decode[0] mid-transfer: %d/%d rooms failed on every "
          "rank of both sides, one cause each, within %.2f s; decode[0] says: %s"
          % (run.label, failed, ROOMS, worst, why["failure"]["reason"][:110]))


def check_settle(run, first):
    """The first batch after the route came back: final on every rank, one
    state and one cause each, and any failure about the cut pair's silence
    (an end that had not timed out its dead connection yet)."""
    cut = {run.p0.ready["addr"], run.d0.ready["addr"]}
    failed = 0
    for i in range(first, first + FRESH):
        ranks = [r for r in run.ranks if run.involved(r, i)]
        view = [dict(side=r.side, rank=r.index, state=r.rooms[i]["state"],
                     failure=r.rooms[i].get("failure")) for r in ranks if i in r.rooms]
        if len(view) != len(ranks):
            die("%s: room %d was not reported by every rank" % (run.label, i))
        why = siblings.one_state(view)
        common, why2 = siblings.one_cause(view)
        if why or why2:
            die("%s: room %d after the route came back: %s" % (run.label, i, why or why2))
        if all(v["state"] == "Success" for v in view):
            continue
        reasons = {(v["failure"] or {}).get("reason", "") for v in view if v["state"] == "Failed"}
        if not common & cut or not all("sent nothing" in why for why in reasons):
            die("%s: room %d after the route came back failed for another cause than the "
                "cut pair's silence: %s" % (run.label, i, sorted(reasons)))
        failed += 1
    return failed


def check_fresh(run, first):
    for r in run.ranks:
        mine = [i for i in range(first, first + FRESH) if run.involved(r, i)]
        bad = [(i, r.rooms.get(i, {}).get("state")) for i in mine
               if r.rooms.get(i, {}).get("state") != "Success"
               or r.rooms[i].get("verified") is False]
        if bad:
            die("%s: %s: fresh rooms after the route came back did not succeed: %s; %s"
                % (run.label, r.name, bad, [r.rooms.get(i, {}).get("failure") for i, _ in bad]))


def run_shape(exe, prefix, hub_ip, label, shape):
    run = Run(exe, prefix, hub_ip, shape)
    run.label = label
    try:
        run.pump(lambda: all(r.ready for r in run.ranks), 60, "every rank to be ready")
        end = time.time() + 15
        while not run.registered():   # the prefill ranks register in the background
            if time.time() > end:
                die("%s: the prefill ranks never all registered with %s" % (label, run.registry))
            time.sleep(0.05)
        for r in run.ranks:
            r.send("go")
        run.pump(lambda: run.p0.mid, 20, "prefill[0]'s first room to reach mid")
        run.route("add")
        t_cut = time.time()
        run.p0.send("resume")
        run.pump(lambda: all(r.results == 1 for r in run.ranks), 30,
                 "every room to resolve after the cut")
        check_cut(run, t_cut)
        run.route("del")
        for r in run.ranks:
            r.send("batch %d %d" % (ROOMS, FRESH))
        run.pump(lambda: all(r.results == 2 for r in run.ranks), 40, "the first fresh batch")
        settled = check_settle(run, ROOMS)
        for r in run.ranks:
            r.send("batch %d %d" % (ROOMS + FRESH, FRESH))
        run.pump(lambda: all(r.results == 3 for r in run.ranks), 40, "the second fresh batch")
        check_fresh(run, ROOMS + FRESH)
        for r in run.ranks:
            r.send("exit")
        for r in run.ranks:
            if r.p.wait(timeout=20) != 0:
                die("%s: %s exited with status %d" % (label, r.name, r.p.returncode))
    finally:
        run.close()
    print("ok: %-16s after the route came back, %d/%d fresh rooms succeeded on every rank%s"
          % (label, FRESH, FRESH, "" if not settled else " (%d room(s) before them failed "
             "on the cut pair's silence, found late by one end)" % settled))


def main():
    # timeout(1)'s SIGTERM: unwind, so that every process started is ended.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("FAIL netns cut: terminated"))
    exe, prefix, hub_ip = sys.argv[1:4]
    for label, shape in SHAPES:
        run_shape(exe, prefix, hub_ip, label, shape)


if __name__ == "__main__":
    main()
