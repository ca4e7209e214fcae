#!/usr/bin/env python3
"""Drive a prefill rank and a decode rank in two network namespaces through
a link cut (test_netns_cut.sh sets the namespaces up and runs this inside
the prefill one).

The ranks are `kvferry _rank` processes, spoken to in their own line
protocol (rank.c): "go", "resume", "batch FIRST COUNT", "exit" on stdin,
JSON events on stdout.  The prefill rank holds after its first "mid" event;
the link goes down right then, so the first room is cut mid-transfer and
the other rooms in flight with it.  A cut link sends neither FIN nor RST:
only heartbeats and deadlines can resolve those rooms.

Usage: netns_cut.py KVFERRY PREFILL_NS_LINK DECODE_NS PREFILL_IP DECODE_IP
"""
import secrets
import json
import os
import select
import subprocess
import sys
import time
import urllib.request

ROOMS, FRESH = 4, 4
RESOLVE_LIMIT_S = 5.0
# tcp: both namespaces share one kernel, and shm would carry the payload
# past the cut link.
COMMON = ["--model", "tiny", "--tokens", "2048", "--chunk", "256", "--transport", "tcp",
          "--concurrency", str(ROOMS), "--requests", str(ROOMS)]


def die(msg):
    print("FAIL netns cut: " + msg)
    sys.exit(1)


class Rank:
    def __init__(self, name, argv, env):
        self.name = name
        self.p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  env=env, text=True)
        self.buf = b""         # raw reads: select() must see every line
        self.events = []
        self.rooms = {}        # index -> final "room" event
        self.results = 0
        self.ready = None

    def send(self, line):
        self.p.stdin.write(line + "\n")
        self.p.stdin.flush()

    def take(self, line):
        ev = json.loads(line)
        ev["t"] = time.time()
        self.events.append(ev)
        kind = ev.get("event")
        if kind == "ready":
            self.ready = ev
        elif kind == "room":
            self.rooms[ev["index"]] = ev
        elif kind == "result":
            self.results += 1
        elif kind == "error":
            die("%s: %s" % (self.name, ev.get("message")))


def pump(ranks, until, timeout, what):
    """Read events until until() is true, or fail after timeout seconds."""
    end = time.time() + timeout
    while not until():
        left = end - time.time()
        if left <= 0:
            die("timed out after %.0f s waiting for %s" % (timeout, what))
        fds = {r.p.stdout.fileno(): r for r in ranks}
        ready, _, _ = select.select(list(fds), [], [], min(left, 0.2))
        for fd in ready:
            r = fds[fd]
            data = os.read(fd, 65536)
            if not data:
                die("%s exited (status %s) while waiting for %s"
                    % (r.name, r.p.wait(), what))
            r.buf += data
            while b"\n" in r.buf:
                line, r.buf = r.buf.split(b"\n", 1)
                r.take(line.decode())


def main():
    exe, link, dec_ns, pre_ip, dec_ip = sys.argv[1:6]
    # The registry listens on the veth address, not loopback: it needs a
    # cluster token, which every rank shares through the environment.
    env = dict(os.environ, KVF_BOOTSTRAP_TIMEOUT_MS="3000",
               KVF_WAITING_TIMEOUT_MS="3000", KVF_TRANSFER_TIMEOUT_MS="3000",
               KVF_AUTH_TOKEN=os.environ.get("KVF_AUTH_TOKEN")
               or secrets.token_hex(24))
    reg = subprocess.Popen([exe, "bootstrap", "--host", pre_ip, "--port", "0"],
                           stdout=subprocess.PIPE, text=True, env=env)
    line = reg.stdout.readline()
    if "listening on " not in line:
        die("the registry did not start: %r" % line)
    registry = line.split("listening on ")[1].strip()
    ranks = []
    try:
        pre = Rank("prefill[0]", [exe, "_rank", "--role", "prefill", "--rank", "0",
                                  "--registry", registry, "--hold=mid"] + COMMON,
                   dict(env, KVF_HOST=pre_ip))
        dec = Rank("decode[0]", ["ip", "netns", "exec", dec_ns, exe, "_rank", "--role",
                                 "decode", "--rank", "0", "--registry", registry] + COMMON,
                   dict(env, KVF_HOST=dec_ip))
        ranks = [pre, dec]
        pump(ranks, lambda: pre.ready and dec.ready, 30, "both ranks to be ready")
        end = time.time() + 15
        while True:   # the prefill rank registers in the background
            try:
                urllib.request.urlopen("http://%s/route?prefill_dp_rank=-1&prefill_cp_rank=-1"
                                       "&target_tp_rank=-1&target_pp_rank=-1" % registry,
                                       timeout=1)
                break
            except OSError:
                if time.time() > end:
                    die("the prefill rank never registered with %s" % registry)
                time.sleep(0.05)

        for r in ranks:
            r.send("go")
        pump(ranks, lambda: any(e.get("phase") == "mid" for e in pre.events), 15,
             "the first room to reach mid")
        subprocess.run(["ip", "link", "set", link, "down"], check=True)
        t_cut = time.time()
        pre.send("resume")
        pump(ranks, lambda: pre.results and dec.results, 20, "every room to resolve after the cut")
        check_cut(pre, dec, t_cut)

        subprocess.run(["ip", "link", "set", link, "up"], check=True)
        for r in ranks:
            r.send("batch %d %d" % (ROOMS, FRESH))
        pump(ranks, lambda: pre.results == 2 and dec.results == 2, 30, "the fresh batch")
        check_fresh(pre, dec)
        for r in ranks:
            r.send("exit")
        for r in ranks:
            if r.p.wait(timeout=10) != 0:
                die("%s exited with status %d" % (r.name, r.p.returncode))
    finally:
        for r in ranks:
            if r.p.poll() is None:
                r.p.kill()
        reg.terminate()
        reg.wait()


def check_cut(pre, dec, t_cut):
    worst = 0.0
    for r, peer in ((pre, "decode"), (dec, "prefill")):
        if sorted(r.rooms) != list(range(ROOMS)):
            die("%s reported rooms %s, not all %d" % (r.name, sorted(r.rooms), ROOMS))
        for i, ev in r.rooms.items():
            if ev["state"] == "Success":
                continue   # finished before the cut took effect: allowed
            f = ev.get("failure") or {}
            why = f.get("reason", "")
            if not why or not f.get("origin_addr"):
                die("%s room %d failed without a reason or origin: %s" % (r.name, i, f))
            if not f.get("from_another_rank") and peer not in why:
                die("%s room %d: the reason does not name the %s peer: %r"
                    % (r.name, i, peer, why))
            worst = max(worst, ev["end"] - t_cut)
    failed = sum(ev["state"] == "Failed" for ev in dec.rooms.values())
    if failed == 0:
        die("no room failed although the link went down mid-transfer")
    if worst > RESOLVE_LIMIT_S:
        die("rooms took %.2f s after the cut to resolve (limit %.1f s)"
            % (worst, RESOLVE_LIMIT_S))
    bad = [i for i, ev in dec.rooms.items() if ev["state"] == "Success" and not ev["verified"]]
    if bad:
        die("decode reported SUCCESS with wrong data for rooms %s" % bad)
    reasons = sorted({ev["failure"]["reason"] for ev in dec.rooms.values() if ev.get("failure")})
    print("ok: link cut mid-transfer: %d/%d rooms failed on decode, all resolved "
          "within %.2f s of the cut; decode says: %s" % (failed, ROOMS, worst, reasons[0][:160]))


def check_fresh(pre, dec):
    for r in (pre, dec):
        fresh = [r.rooms.get(i) for i in range(ROOMS, ROOMS + FRESH)]
        bad = [(i + ROOMS, ev and ev["state"]) for i, ev in enumerate(fresh)
               if not ev or ev["state"] != "Success" or ev.get("verified") is False]
        if bad:
            die("%s: fresh rooms after the link came back did not succeed: %s; "
                "failures: %s" % (r.name, bad, [ev.get("failure", {}).get("reason")
                                                 for ev in fresh if ev]))
    print("ok: after the link came back, %d/%d fresh rooms succeeded and verified"
          % (FRESH, FRESH))


if __name__ == "__main__":
    main()
