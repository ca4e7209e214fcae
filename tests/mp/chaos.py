#!/usr/bin/env python3
"""Chaos: real prefill and decode ranks over every transport, with faults
at random (seeded) times, in cycles, for a bounded time.

Why a Python driver of `kvferry _rank` processes (as netns_cut.py drives
them) and not a `kvferry chaos` subcommand on the demo's orchestrator:
the demo's orchestrator (tools/orch.c, fault.c) is built around one
deployment and one fault per run, and everything this test adds lives
outside the ranks: a seeded plan of many faults, link cuts in network
namespaces, and /proc accounting of memory and CPU per process and per
thread.  The ranks themselves are the demo's: they move rooms of a real
model's layout through the library and verify every byte, and each keeps
a room that is final there until the driver releases it, once every live
rank of the room is final ("release INDEX STATE", as a scheduler's
all-reduce over its ranks; Deployment.release_due).

The one idea: every cycle is [rooms flow + one fault] -> [recovery] ->
[fresh rooms] -> [a quiet window], and each phase has a property that
can be checked from outside:
  - flow + fault: every room of the batch reaches a final state on every
    live rank; a FAILED room has a status, a reason and an origin, and
    resolved within its deadline plus SLACK_S of the fault (the ranks run
    with the demo fault runs' 3 s room deadlines, BUILDS; the engines'
    heartbeat timeout is 2.5 s); no SUCCESS has a wrong byte (the decode ranks verify every
    byte, and find pages written after their room was final); rooms of
    deployments the fault did not touch all succeed;
  - recovery: a stopped rank is continued, a killed one restarted (its
    peers find it through the registry), a cut link restored;
  - fresh rooms: every one succeeds on every rank (the survivors
    recovered);
  - quiet window: no rooms for QUIET_S; every live process uses at most
    10% of one CPU (BUILDS; a spinning thread uses all of one); over it,
    the test names the threads that used it, with their stacks;
  and all the time, no process's resident memory goes over its bound:
  the KV memory it registered (plus, for a shm decode, the prefill
  memory it maps: twice each prefill rank's, since a killed one's stays
  mapped until its last room is gone) plus the build's margin (BUILDS).

Deployments, each with its own registry, all at once:
  tcp     --transport tcp, prefill TP 2 -> decode TP 1 (two peers feed
          one decode rank), qwen2.5-7b, checksums on
  tcp-s2  --transport tcp --streams 2, prefill TP 1 -> decode TP 2
          (TP-sliced), llama3-8b
  shm     --transport shm, llama3-8b rooms of up to 64 MiB (pulled reads
          well past the decode's 16 MiB read window)
  ucx     --transport ucx over UCX's tcp (UCX_TLS=tcp), deepseek-v3
          (MLA), head-major pages; only in builds with UCX
With network namespaces (test_chaos.sh), the tcp and ucx deployments run
their prefill ranks and registry in one namespace and their decode
ranks in another, joined by a veth pair: a "cut" takes that link down
(no FIN, no RST: packets vanish), for all of them at once.

Faults, one per cycle, at a random room and phase of the batch plus a
random delay (all drawn from the seed, cycle by cycle, so a failure
replays with KVF_CHAOS_SEED): SIGSTOP of a rank for 0.3-4.5 s then
SIGCONT; SIGKILL of a rank, restarted once the survivors are done;
a connection reset by a prefill engine's fault transport (KVF_FAULTS
reset@BYTES/ROOM, armed at the rank's start for the rooms the plan
chose); a link cut of 0.5-4.5 s.  Kills never hit the ucx deployment
with a UCX older than 1.14 (openucx/ucx#8175, as fault_lib.sh).

Usage: chaos.py --kvferry EXE --seconds N [--seed S] [--scale F]
       [--netns DECODE_NS PRE_LINK DEC_LINK PRE_IP DEC_IP]
Prints one summary line at the end; "FAIL chaos: ..." and exit 1 on the
first broken promise, with the seed to replay it.
"""
import argparse
import ctypes
import json
import os
import random
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.request

SLACK_S = 2.0          # past a room's deadline, as fault_check.py (3 s + 2 s)
HEARTBEAT_S = 2.5      # the engines' default heartbeat timeout
QUIET_S = 1.0          # the quiet window
STRIDE = 64            # request indices per cycle: batch, then fresh rooms
FRESH_AT = 40          # the fresh rooms' first index within a cycle
MAX_ARMED = 16         # faults one engine takes (src/transport/fault)

# Per build (KVF_TEST_SANITIZER): the rooms' deadlines (the demo's fault
# runs' 3 s; under TSan the ranks' own work, filling and checking every
# byte, runs so much slower that a prefill rank's next room could wait
# more than 3 s for the decode rank to ask for it, so 6 s there), how
# much slower a batch may be, how much memory a process may hold beyond
# what it registered (ASan: its quarantine and shadow; TSan: 4 shadow
# bytes per byte of memory touched, so a share of the registered memory
# too), and the CPU a process may use in the quiet window (an idle engine
# wakes every 50 ms; instrumented, its tick costs more).
BUILDS = {
    "none":    {"deadline_s": 3, "watchdog_s": 60, "margin_mb": 192, "shadow": 0,
                "quiet_cpu": 0.10},
    "address": {"deadline_s": 3, "watchdog_s": 120, "margin_mb": 768, "shadow": 0,
                "quiet_cpu": 0.20},
    "thread":  {"deadline_s": 6, "watchdog_s": 180, "margin_mb": 768, "shadow": 4,
                "quiet_cpu": 0.30},
}

DEPLOYMENTS = [
    dict(name="tcp", transport="tcp", streams=1, prefill_tp=2, decode_tp=1,
         model="qwen2.5-7b", page=16, tokens=512, conc=3, crosslink=True,
         extra=["--checksum"]),
    dict(name="tcp-s2", transport="tcp", streams=2, prefill_tp=1, decode_tp=2,
         model="llama3-8b", page=16, tokens=256, conc=3, crosslink=True, extra=[]),
    dict(name="shm", transport="shm", streams=0, prefill_tp=1, decode_tp=1,
         model="llama3-8b", page=16, tokens=512, conc=3, crosslink=False, extra=[]),
    dict(name="ucx", transport="ucx", streams=0, prefill_tp=1, decode_tp=1,
         model="deepseek-v3", page=32, tokens=256, conc=3, crosslink=True,
         extra=["--kv-order", "hnd"]),
]

FAULT_WEIGHTS = {"stop": 3, "kill": 3, "reset": 3, "cut": 2}


class Failure(Exception):
    pass


def fail(msg):
    raise Failure(msg)


def log(msg):
    print("chaos: " + msg, flush=True)


# ------------------------------------------------------------------------
# Room ids, as tools/pattern.c derives them from (seed, index)
# ------------------------------------------------------------------------

M64 = (1 << 64) - 1
M63 = (1 << 63) - 1


def mix64(z):
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def room_id(seed, index):
    x = (mix64(seed) + index) & M63
    x = (x * 0xBF58476D1CE4E5B9) & M63
    x ^= x >> 29
    x = (x * 0x94D049BB133111EB) & M63
    x ^= x >> 32
    return x


# ------------------------------------------------------------------------
# /proc
# ------------------------------------------------------------------------

CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(path):
    """utime + stime of /proc/PID/stat or /proc/PID/task/TID/stat."""
    try:
        with open(path) as f:
            s = f.read()
    except OSError:
        return None
    fields = s[s.rindex(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def thread_cpu(pid):
    out = {}
    try:
        tids = os.listdir("/proc/%d/task" % pid)
    except OSError:
        return out
    for tid in tids:
        c = cpu_seconds("/proc/%d/task/%s/stat" % (pid, tid))
        if c is not None:
            out[int(tid)] = c
    return out


def thread_sched(pid):
    """Per thread: (ns on a CPU, ns waiting for one, time slices, voluntary
    and involuntary context switches), from schedstat and status: whether
    a hot thread ran long once (one big operation, or a vCPU the host took
    away while it ran) or woke often."""
    out = {}
    try:
        tids = os.listdir("/proc/%d/task" % pid)
    except OSError:
        return out
    for tid in tids:
        base = "/proc/%d/task/%s/" % (pid, tid)
        try:
            with open(base + "schedstat") as f:
                run, wait, slices = (int(x) for x in f.read().split()[:3])
            sw = {}
            with open(base + "status") as f:
                for line in f:
                    k, _, v = line.partition(":")
                    if k.endswith("ctxt_switches"):
                        sw[k] = int(v)
        except (OSError, ValueError):
            continue
        out[int(tid)] = (run, wait, slices, sw.get("voluntary_ctxt_switches", 0),
                         sw.get("nonvoluntary_ctxt_switches", 0))
    return out


def memory_kb(pid):
    out = {}
    try:
        with open("/proc/%d/status" % pid) as f:
            for line in f:
                k, _, v = line.partition(":")
                if k in ("VmRSS", "RssAnon", "RssFile", "RssShmem"):
                    out[k] = int(v.split()[0])
    except OSError:
        pass
    return out


def big_mappings(pid, floor_kb=16 * 1024):
    """'/memfd:kvferry-kv (deleted) 384 MiB, 384 resident' for each mapping
    with more than floor_kb resident: what holds a process's memory."""
    out, cur = [], None
    try:
        with open("/proc/%d/smaps" % pid) as f:
            for line in f:
                head = line.split()
                if "-" in head[0] and not head[0].endswith(":"):
                    lo, hi = (int(x, 16) for x in head[0].split("-"))
                    cur = [" ".join(head[5:]) or "[anon]", (hi - lo) // 1024, 0]
                    out.append(cur)
                elif head[0] == "Rss:" and cur is not None:
                    cur[2] = int(head[1])
    except OSError:
        return "(smaps: unreadable)"
    return "; ".join("%s %d MiB, %d resident" % (n, size >> 10, rss >> 10)
                     for n, size, rss in out if rss > floor_kb) or "none over 16 MiB"


def read_small(path):
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError as e:
        return "(%s)" % e.strerror


def stacks(pid):
    """Every thread's stack, for a report (gdb if there is one)."""
    if not shutil.which("gdb"):
        return "(no gdb: no stacks)"
    try:
        r = subprocess.run(["gdb", "-batch", "-nx", "-p", str(pid), "-ex",
                            "thread apply all bt 30"], capture_output=True, text=True,
                           timeout=60)
        lines = [ln for ln in r.stdout.splitlines()
                 if ln.startswith(("Thread ", "#"))]
        return "\n".join(lines[:400])
    except (OSError, subprocess.TimeoutExpired) as e:
        return "(gdb failed: %s)" % e


def pdeathsig():
    """Children die with the driver, whatever kills it."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG


# ------------------------------------------------------------------------
# Processes
# ------------------------------------------------------------------------

class Proc:
    """One child: a registry or a rank, its event pipe and its log file."""
    serial = 0

    def __init__(self, run, name, argv, env, dep=None, key=None):
        Proc.serial += 1
        self.run, self.name, self.dep, self.key = run, name, dep, key
        self.log_path = os.path.join(run.tmp, "%03d-%s.log" % (
            Proc.serial, re.sub(r"[^A-Za-z0-9.-]", "_", name)))
        self.argv, self.env = argv, env
        with open(self.log_path, "w") as errf:
            self.p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=errf, env=env, preexec_fn=pdeathsig)
        self.pid = self.p.pid
        self.buf = b""
        self.state = "running"      # running, stopped, killed, gone
        self.ready = None
        self.results = 0
        self.lines = []             # a registry's stdout
        self.cpu0 = None
        run.procs.append(self)

    def fd(self):
        return self.p.stdout.fileno()

    def send(self, line):
        if self.state in ("killed", "gone"):
            return
        try:
            self.p.stdin.write((line + "\n").encode())
            self.p.stdin.flush()
        except BrokenPipeError:
            pass

    def signal(self, sig):
        os.kill(self.pid, sig)
        if sig == signal.SIGSTOP:
            self.state = "stopped"
        elif sig == signal.SIGCONT and self.state == "stopped":
            self.state = "running"
        elif sig == signal.SIGKILL:
            self.state = "killed"

    def live(self):
        return self.state in ("running", "stopped")

    def log_tail(self, n=30):
        try:
            with open(self.log_path, errors="replace") as f:
                lines = f.readlines()
        except OSError:
            return ""
        return "".join("    | " + ln for ln in lines[-n:])

    def on_readable(self):
        data = os.read(self.fd(), 1 << 20)
        if not data:
            self.on_eof()
            return
        self.buf += data
        while b"\n" in self.buf:
            line, self.buf = self.buf.split(b"\n", 1)
            self.on_line(line.decode(errors="replace"))

    def on_eof(self):
        self.run.unwatch(self)
        rc = self.p.wait()
        if self.state == "killed":
            self.state = "gone"
            return
        self.state = "gone"
        if not self.run.ending:
            fail("%s (pid %d) exited by itself (status %s) in the middle of the run; "
                 "its log ends:\n%s" % (self.name, self.pid, rc, self.log_tail()))

    def on_line(self, line):
        if self.dep is None or self.key is None:
            self.lines.append(line)
            return
        try:
            ev = json.loads(line)
        except ValueError:
            fail("%s printed a line that is not a JSON event: %.200s" % (self.name, line))
        ev["t"] = time.time()
        kind = ev.get("event")
        if kind == "error":
            fail("%s: %s" % (self.name, ev.get("message")))
        if kind == "ready":
            self.ready = ev
            self.dep.registered[self.key] = ev.get("memory_bytes", 0)
        elif kind == "result":
            self.results += 1
        self.dep.on_event(self, ev)


# ------------------------------------------------------------------------
# One deployment: a registry, its prefill and decode ranks
# ------------------------------------------------------------------------

class Deployment:
    def __init__(self, run, index, cfg):
        self.run, self.cfg, self.name = run, cfg, cfg["name"]
        self.seed = (run.seed * 1000003 + index * 7919 + 1) & 0xFFFFFFFF
        self.cross = bool(cfg["crosslink"] and run.netns)
        self.tokens = max(cfg["page"], int(cfg["tokens"] * run.scale) // cfg["page"] * cfg["page"])
        self.registry = None
        self.ranks = {}             # ("prefill"|"decode", rank) -> live Proc
        self.pre_page_bytes = None  # one page of one KV buffer on a prefill rank
        self.pre_buffers = None
        self.batch = None
        self.registered = {}        # (side, rank) -> KV bytes it registers

    def keys(self):
        return [("prefill", r) for r in range(self.cfg["prefill_tp"])] + \
               [("decode", r) for r in range(self.cfg["decode_tp"])]

    def common(self):
        c = self.cfg
        argv = ["--model", c["model"], "--tokens", str(self.tokens), "--page-size",
                str(c["page"]), "--concurrency", str(c["conc"]), "--seed", str(self.seed),
                "--prefill-tp", str(c["prefill_tp"]), "--decode-tp", str(c["decode_tp"]),
                "--transport", c["transport"]] + c["extra"]
        if c["streams"]:
            argv += ["--streams", str(c["streams"])]
        return argv

    def host(self, side):
        if not self.cross:
            return "127.0.0.1"
        return self.run.netns["pre_ip"] if side == "prefill" else self.run.netns["dec_ip"]

    def env(self, side):
        env = dict(self.run.env, KVF_HOST=self.host(side))
        if self.cross and self.cfg["transport"] == "ucx":
            # UCX over tcp on the veth alone: its loopback is another
            # namespace's.
            env["UCX_NET_DEVICES"] = self.run.netns["pre_link" if side == "prefill"
                                                    else "dec_link"]
        return env

    def argv(self, side, rank, faults=None):
        argv = [self.run.exe, "_rank", "--role", side, "--rank", str(rank),
                "--registry", self.registry_addr] + self.common()
        if faults:
            argv.append("--faults=" + faults)
        if side == "decode" and self.cross:
            argv = ["ip", "netns", "exec", self.run.netns["dec_ns"]] + argv
        return argv

    def start_registry(self):
        host = self.host("prefill")
        self.registry = Proc(self.run, "%s registry" % self.name,
                             [self.run.exe, "bootstrap", "--host", host, "--port", "0"],
                             self.run.env, self)
        self.run.watch(self.registry)
        self.run.pump(lambda: any("listening on " in ln for ln in self.registry.lines), 30,
                      "the %s registry to listen" % self.name)
        line = next(ln for ln in self.registry.lines if "listening on " in ln)
        self.registry_addr = line.split("listening on ")[1].strip()

    def probe(self):
        """A prefill rank's KV geometry, which the resets' byte counts need
        before any real rank starts (its engine faults are set at create)."""
        argv = [self.run.exe, "_rank", "--role", "prefill", "--rank", "0",
                "--registry", "127.0.0.1:9"] + self.common()
        i = argv.index("--tokens")
        argv[i + 1] = str(self.cfg["page"])
        i = argv.index("--concurrency")
        argv[i + 1] = "1"
        p = Proc(self.run, "%s probe" % self.name, argv, dict(self.run.env, KVF_HOST="127.0.0.1"),
                 self, ("probe", 0))
        self.run.watch(p)
        self.run.pump(lambda: p.ready is not None, 60, "the %s probe rank to be ready" % self.name)
        self.pre_page_bytes = p.ready["page_bytes"]
        self.pre_buffers = p.ready["buffers"]
        p.send("exit")
        p.state = "killed"          # its exit is expected
        p.p.wait(timeout=30)

    def room_bytes(self, tokens):
        """A room's payload on one prefill rank (what reset@BYTES counts)."""
        pages = -(-tokens // self.cfg["page"])
        return pages * self.pre_page_bytes * self.pre_buffers

    def start_rank(self, side, rank, first_cycle):
        faults = self.run.plan.armed(self, side, rank, first_cycle) if side == "prefill" else ""
        incarnation = sum(1 for p in self.run.procs if p.dep is self and p.key == (side, rank))
        name = "%s %s[%d]%s" % (self.name, side, rank,
                                "#%d" % (incarnation + 1) if incarnation else "")
        p = Proc(self.run, name, self.argv(side, rank, faults), self.env(side), self,
                 (side, rank))
        p.faults = faults
        self.ranks[(side, rank)] = p
        self.run.watch(p)
        return p

    def route_ok(self):
        """Does the registry list every prefill rank at its current address?"""
        host, port = self.registry_addr.rsplit(":", 1)
        for r in range(self.cfg["prefill_tp"]):
            p = self.ranks.get(("prefill", r))
            if p is None or p.ready is None:
                return False
            url = ("http://%s/route?prefill_dp_rank=0&prefill_cp_rank=0&target_tp_rank=%d"
                   "&target_pp_rank=0" % (self.registry_addr, r))
            try:
                with urllib.request.urlopen(url, timeout=1) as resp:
                    d = json.loads(resp.read().decode())
            except (OSError, ValueError):
                return False
            if "%s:%s" % (d.get("rank_ip"), d.get("rank_port")) != p.ready["addr"]:
                return False
        return True

    # -- batches ---------------------------------------------------------

    def begin_batch(self, first, sizes, what):
        live = {k: p for k, p in self.ranks.items() if p.live()}
        self.batch = dict(first=first, sizes=sizes, what=what, t0=time.time(),
                          waiting={k: p.results for k, p in live.items()},
                          rooms={k: {} for k in live}, phases={}, lost=set(),
                          procs=live, finals={}, released=set())
        line = "batch %d %d %s" % (first, len(sizes), ",".join("%d:%d" % s for s in sizes))
        for p in live.values():
            p.send(line)

    def batch_done(self):
        b = self.batch
        return all(p.results > b["waiting"][k] or not p.live()
                   for k, p in self.ranks.items() if k in b["waiting"])

    def on_event(self, proc, ev):
        b = self.batch
        if b is None or proc.key not in b["rooms"] or self.ranks.get(proc.key) is not proc:
            return
        kind = ev.get("event")
        idx = ev.get("index")
        if kind not in ("phase", "final", "room") or not isinstance(idx, int):
            return
        if not b["first"] <= idx < b["first"] + len(b["sizes"]):
            return
        if kind == "final":
            b["finals"].setdefault(idx, {})[proc.key] = ev.get("state")
            self.release_due()
        elif kind == "phase":
            b["phases"].setdefault((idx, proc.key[0], ev["phase"]), ev["t"])
            self.run.on_phase(self, proc, idx, ev["phase"])
        else:
            b["rooms"][proc.key][idx] = ev
            self.run.on_phase(self, proc, idx, "final")

    def release_due(self):
        """A rank keeps a room that is final there until every rank of it is
        (a scheduler's all-reduce): "release INDEX STATE", with the MIN of
        their states, to each once all the batch's live ranks are final in
        it.  A killed rank's rooms count as final (it reports none)."""
        b = self.batch
        if b is None:
            return
        for idx, finals in b["finals"].items():
            if idx in b["released"]:
                continue
            live = [(k, p) for k, p in b["procs"].items() if p.live()]
            if any(k not in finals for k, _ in live):
                continue
            b["released"].add(idx)
            lost = any(k not in finals for k, p in b["procs"].items() if not p.live())
            state = "Failed" if lost or "Failed" in finals.values() else "Success"
            for _, p in live:
                p.send("release %d %s" % (idx, state))

    def pending(self):
        """'decode[0]: rooms 3 (last phase: waiting), 5 (...)' for each
        live rank that has not reported every room of the batch."""
        b, out = self.batch, []
        for k, p in self.ranks.items():
            if k not in b["rooms"] or not p.live():
                continue
            missing = [i for i in range(b["first"], b["first"] + len(b["sizes"]))
                       if i not in b["rooms"][k]]
            if missing:
                descr = []
                for i in missing[:8]:
                    seen = sorted((t, ph) for (j, side, ph), t in b["phases"].items()
                                  if j == i and side == k[0])
                    descr.append("%d (%s)" % (i, "last phase: " + seen[-1][1] if seen
                                              else "no phase yet"))
                out.append("%s pid %d [%s]: rooms %s" % (p.name, p.pid, p.state,
                                                         ", ".join(descr)))
        return out


# ------------------------------------------------------------------------
# The plan: one fault per cycle, drawn from (seed, cycle) alone
# ------------------------------------------------------------------------

class Plan:
    def __init__(self, run, cycles):
        self.run = run
        self.cycles = []
        lifetime = {}   # (dep, rank) of a prefill rank -> resets armed since its start
        for c in range(cycles):
            rng = random.Random("%d/%d" % (run.seed, c))
            cyc = {"sizes": {}, "fresh": {}}
            for d in run.deps:
                n = rng.randint(d.cfg["conc"], 2 * d.cfg["conc"])
                cyc["sizes"][d.name] = [self.size(rng, d) for _ in range(n)]
                cyc["fresh"][d.name] = [self.size(rng, d) for _ in range(d.cfg["conc"])]
            cyc["fault"] = self.fault(rng, c, cyc, lifetime)
            self.cycles.append(cyc)

    @staticmethod
    def size(rng, d):
        page = d.cfg["page"]
        tokens = rng.randint(page, d.tokens)
        if rng.random() < 0.3:
            chunk = 0
        else:
            chunk = rng.randint(1, max(1, tokens // page)) * page
        return (tokens, chunk)

    def fault(self, rng, c, cyc, lifetime):
        run = self.run
        while True:
            kinds = [k for k in FAULT_WEIGHTS if k != "cut" or run.cut_ok()]
            kind = rng.choices(kinds, [FAULT_WEIGHTS[k] for k in kinds])[0]
            deps = [d for d in run.deps if (kind != "cut" or d.cross) and
                    (kind != "kill" or d.cfg["transport"] != "ucx" or run.ucx_kill_ok)]
            d = rng.choice(deps)
            sizes = cyc["sizes"][d.name]
            j = rng.randrange(len(sizes))
            tokens, chunk = sizes[j]
            pages = -(-tokens // d.cfg["page"])
            chunks = 1 if chunk == 0 else -(-pages // (chunk // d.cfg["page"]))
            f = {"kind": kind, "dep": d.name, "room": j, "delay": rng.uniform(0, 0.25)}
            if kind == "reset":
                rank = rng.randrange(d.cfg["prefill_tp"])
                if lifetime.get((d.name, rank), 0) >= MAX_ARMED:
                    continue    # that engine is full: draw again
                lifetime[(d.name, rank)] = lifetime.get((d.name, rank), 0) + 1
                f.update(target=("prefill", rank),
                         bytes=rng.randrange(d.room_bytes(tokens)),
                         room_id=room_id(d.seed, c * STRIDE + j))
                return f
            phases = [("prefill", "bootstrap"), ("prefill", "waiting"), ("prefill", "last"),
                      ("decode", "bootstrap")] + ([("prefill", "mid")] if chunks > 1 else [])
            f["phase"] = rng.choice(phases)
            if kind in ("stop", "kill"):
                f["target"] = rng.choice(d.keys())
            if kind == "kill" and f["target"][0] == "prefill":
                lifetime[(d.name, f["target"][1])] = 0   # its successor starts empty
            if kind in ("stop", "cut"):
                f["duration"] = rng.uniform(0.3 if kind == "stop" else 0.5, 4.5)
            return f

    def armed(self, d, side, rank, first_cycle):
        """The KVF_FAULTS spec of a prefill rank that starts before cycle
        first_cycle: the plan's resets on it until it is next killed."""
        specs = []
        for c in range(first_cycle, len(self.cycles)):
            f = self.cycles[c]["fault"]
            if f["dep"] != d.name or f.get("target") != (side, rank):
                continue
            if f["kind"] == "kill":
                break
            if f["kind"] == "reset":
                specs.append("reset@%d/%d" % (f["bytes"], f["room_id"]))
        return ",".join(specs[:MAX_ARMED])


# ------------------------------------------------------------------------
# The run
# ------------------------------------------------------------------------

class Run:
    def __init__(self, args):
        self.exe = args.kvferry
        self.seed = args.seed
        self.seconds = args.seconds
        self.scale = args.scale
        self.build = BUILDS[os.environ.get("KVF_TEST_SANITIZER", "none")]
        self.netns = None
        if args.netns:
            keys = ("dec_ns", "pre_link", "dec_link", "pre_ip", "dec_ip")
            self.netns = dict(zip(keys, args.netns))
        self.tmp = tempfile.mkdtemp(prefix="kvf-chaos-")
        self.procs, self.fds = [], {}
        self.timers = []
        self.ending = False
        ms = str(self.build["deadline_s"] * 1000)
        self.env = dict(os.environ, UCX_TLS=os.environ.get("UCX_TLS", "tcp"),
                        KVF_BOOTSTRAP_TIMEOUT_MS=ms, KVF_WAITING_TIMEOUT_MS=ms,
                        KVF_TRANSFER_TIMEOUT_MS=ms)
        self.resolve_s = self.build["deadline_s"] + SLACK_S
        self.env.setdefault("KVF_AUTH_TOKEN", "%032x" % random.getrandbits(128))
        self.env.setdefault("KVF_LOG", "info")   # the logs are shown on failure only
        version = subprocess.run([self.exe, "version"], capture_output=True, text=True).stdout
        transports = re.search(r"^transports:(.*)$", version, re.M)
        transports = transports.group(1).split() if transports else []
        have_ucx = any(t.startswith("ucx") for t in transports)
        m = re.search(r"ucx\((\d+)\.(\d+)", version)
        self.ucx_kill_ok = bool(m and (int(m.group(1)), int(m.group(2))) >= (1, 14))
        self.deps = [Deployment(self, i, c) for i, c in enumerate(DEPLOYMENTS)
                     if c["transport"] != "ucx" or have_ucx]
        self.notes = []
        if not have_ucx:
            self.notes.append("no ucx deployment: this build has no UCX")
        elif not self.ucx_kill_ok:
            self.notes.append("no kills over ucx: UCX before 1.14 can abort the surviving "
                              "process when its peer dies during connection setup "
                              "(openucx/ucx#8175)")
        self.stats = {"cycles": 0, "rooms": 0, "finals": {}, "lost": 0,
                      "faults": {k: 0 for k in FAULT_WEIGHTS}, "failures": {},
                      "quiet_cpu": 0.0, "mem_peak": (0.0, "", 0, 0)}
        self.fault = None
        self.reasons = {}

    def cut_ok(self):
        return any(d.cross for d in self.deps)

    # -- the event loop --------------------------------------------------

    def watch(self, p):
        self.fds[p.fd()] = p

    def unwatch(self, p):
        self.fds.pop(p.fd(), None)

    def at(self, delay, fn):
        self.timers.append((time.time() + delay, fn))

    def pump(self, until, timeout, what, diagnose=None):
        """Handle events and timers until until() holds; fail after timeout s."""
        end = time.time() + timeout
        next_mem = 0
        while not until():
            now = time.time()
            if now >= next_mem:
                self.check_memory()
                next_mem = now + 0.5
            for d in self.deps:
                d.release_due()         # a killed rank's rooms are final
            due = [t for t in self.timers if t[0] <= now]
            if due:
                self.timers = [t for t in self.timers if t[0] > now]
                for _, fn in due:
                    fn()
                continue
            if now >= end:
                fail("waited %.0f s for %s%s" % (timeout, what,
                                                  diagnose() if diagnose else ""))
            wait = min([end - now, 0.1] + [t[0] - now for t in self.timers])
            ready, _, _ = select.select(list(self.fds), [], [], max(wait, 0))
            for fd in ready:
                p = self.fds.get(fd)
                if p is not None:
                    p.on_readable()

    # -- memory and CPU --------------------------------------------------

    def bound_kb(self, p):
        """Resident memory a process may hold: the KV memory it registered,
        and for a shm decode its prefill peers' (it maps it), plus the
        build's margin and, under TSan, the shadow of all that."""
        reg = (p.ready or {}).get("memory_bytes", 0)
        if p.key and p.key[0] == "decode" and p.dep.cfg["transport"] == "shm":
            # Each prefill rank's, twice: a killed one's stays mapped until
            # the last room that read it is gone, beside its successor's.
            reg += 2 * sum(n for k, n in p.dep.registered.items() if k[0] == "prefill")
        return (reg * (1 + self.build["shadow"])) // 1024 + self.build["margin_mb"] * 1024

    def check_memory(self):
        for p in self.procs:
            if not p.live() or (p.key and p.ready is None) or p.key == ("probe", 0):
                continue
            m = memory_kb(p.pid)
            if not m:
                continue
            bound = self.bound_kb(p)
            share = m.get("VmRSS", 0) / bound
            if share > self.stats["mem_peak"][0]:
                self.stats["mem_peak"] = (share, p.name, m.get("VmRSS", 0) >> 10, bound >> 10)
            if m.get("VmRSS", 0) > bound:
                fail("%s (pid %d) holds %.0f MiB resident (anon %.0f, file %.0f, shmem %.0f "
                     "MiB), above its bound of %.0f MiB (registered memory + %d MiB); its "
                     "large mappings: %s"
                     % (p.name, p.pid, m["VmRSS"] / 1024, m.get("RssAnon", 0) / 1024,
                        m.get("RssFile", 0) / 1024, m.get("RssShmem", 0) / 1024,
                        bound / 1024, self.build["margin_mb"], big_mappings(p.pid)))

    def quiet_window(self, c):
        """No rooms for QUIET_S: every live process must be (almost) idle."""
        live = [p for p in self.procs if p.live() and p.key != ("probe", 0)]
        before = {p: (cpu_seconds("/proc/%d/stat" % p.pid), thread_cpu(p.pid),
                      thread_sched(p.pid)) for p in live}
        t0 = time.time()
        self.pump(lambda: time.time() - t0 >= QUIET_S, QUIET_S + 5, "the quiet window")
        dt = time.time() - t0
        worst = 0.0
        for p in live:
            c1 = cpu_seconds("/proc/%d/stat" % p.pid)
            if c1 is None or before[p][0] is None:
                continue
            used = c1 - before[p][0]
            worst = max(worst, used / dt)
            if used <= self.build["quiet_cpu"] * dt:
                continue
            threads = thread_cpu(p.pid)
            hot = sorted(((threads[t] - before[p][1].get(t, 0.0), t) for t in threads),
                         reverse=True)
            sched = thread_sched(p.pid)

            def ran(tid):
                a, b = before[p][2].get(tid), sched.get(tid)
                if a is None or b is None:
                    return ""
                d = [y - x for x, y in zip(a, b)]
                return (", on a CPU %.1f ms in %d slices (waited %.1f ms), %d voluntary "
                        "and %d involuntary switches" % (d[0] / 1e6, d[2], d[1] / 1e6,
                                                         d[3], d[4]))
            rows = ["    thread %d: %.2f s of CPU%s, wchan %s, syscall %s" % (
                tid, u, ran(tid), read_small("/proc/%d/task/%d/wchan" % (p.pid, tid)),
                read_small("/proc/%d/task/%d/syscall" % (p.pid, tid)).split(" ")[0])
                for u, tid in hot[:6]]
            rows.append("    load average %s" % read_small("/proc/loadavg"))
            fail("cycle %d: %s (pid %d) used %.2f s of CPU in a %.2f s quiet window with "
                 "no rooms (bound %.2f s: an idle engine only ticks); by thread:\n%s\n"
                 "  stacks:\n%s" % (c, p.name, p.pid, used, dt, self.build["quiet_cpu"] * dt,
                                    "\n".join(rows), stacks(p.pid)))
        self.stats["quiet_cpu"] = max(self.stats["quiet_cpu"], worst)

    # -- faults ----------------------------------------------------------

    def on_phase(self, d, proc, idx, phase):
        f = self.fault
        if f is None or f["fired"] or f["armed_at"] is not None or d.name != f["dep"]:
            return
        if idx != d.batch["first"] + f["room"]:
            return
        if f["kind"] == "reset":
            # Fires inside the engine, somewhere in this room's payload: by
            # the room's first final state at the latest.
            if phase == "final":
                f["fired"], f["t0"] = True, time.time()
                f["t1"] = f["t0"]
            return
        if phase == "final" or (proc.key[0], phase) == tuple(f["phase"]):
            f["armed_at"] = time.time()
            self.at(f["delay"], self.fire)

    def fire(self):
        f = self.fault
        if f["fired"]:
            return
        f["fired"], f["t0"] = True, time.time()
        f["t1"] = f["t0"]
        d = next(x for x in self.deps if x.name == f["dep"])
        if f["kind"] in ("stop", "kill"):
            p = d.ranks[tuple(f["target"])]
            f["victim"] = p
            p.signal(signal.SIGSTOP if f["kind"] == "stop" else signal.SIGKILL)
            log("  %s %s (pid %d)" % ("SIGSTOP" if f["kind"] == "stop" else "SIGKILL",
                                      p.name, p.pid))
            if f["kind"] == "stop":
                self.at(f["duration"], self.resume)
        elif f["kind"] == "cut":
            subprocess.run(["ip", "link", "set", self.netns["pre_link"], "down"], check=True)
            log("  link %s down" % self.netns["pre_link"])
            self.at(f["duration"], self.restore)

    def resume(self):
        f = self.fault
        f["victim"].signal(signal.SIGCONT)
        f["t1"] = time.time()
        log("  SIGCONT %s after %.2f s" % (f["victim"].name, f["t1"] - f["t0"]))

    def restore(self):
        subprocess.run(["ip", "link", "set", self.netns["pre_link"], "up"], check=True)
        self.fault["t1"] = time.time()
        log("  link %s up after %.2f s" % (self.netns["pre_link"],
                                            self.fault["t1"] - self.fault["t0"]))

    def fault_over(self):
        f = self.fault
        return f["fired"] and f["t1"] is not None and (
            f["kind"] not in ("stop", "cut") or f["t1"] > f["t0"] or f["duration"] == 0)

    def touched(self, d):
        f = self.fault
        return d.name == f["dep"] or (f["kind"] == "cut" and d.cross)

    # -- a cycle ---------------------------------------------------------

    def cycle(self, c):
        cyc = self.plan.cycles[c]
        f = dict(cyc["fault"], fired=False, armed_at=None, t0=None, t1=None, victim=None)
        self.fault = f
        self.stats["faults"][f["kind"]] += 1
        descr = "%s on %s" % (f["kind"], f["dep"])
        if "target" in f:
            descr += " %s[%d]" % tuple(f["target"])
        if f["kind"] == "reset":
            descr += " at byte %d of request %d" % (f["bytes"], c * STRIDE + f["room"])
        else:
            descr += " at %s %s of request %d + %.0f ms" % (
                f["phase"][0], f["phase"][1], c * STRIDE + f["room"], f["delay"] * 1000)
        if "duration" in f:
            descr += " for %.2f s" % f["duration"]
        log("cycle %d: %s" % (c, descr))
        first = c * STRIDE
        t_cycle = time.time()
        self.reasons = {}
        for d in self.deps:
            d.begin_batch(first, cyc["sizes"][d.name], "batch")
        wd = self.build["watchdog_s"]
        self.pump(lambda: all(d.batch_done() for d in self.deps), wd + 10,
                  "cycle %d's rooms to be final on every rank" % c, self.diagnose)
        if not f["fired"]:
            # The trigger room ended before its phase showed: fault now.
            log("  the trigger never showed; the fault goes in between batches")
            if f["kind"] == "reset":
                f["fired"], f["t0"], f["t1"] = True, time.time(), time.time()
            else:
                self.fire()
        self.pump(self.fault_over, 30, "the fault to end")
        self.pump(lambda: all(d.batch_done() for d in self.deps), wd,
                  "cycle %d's rooms to be final on every rank" % c, self.diagnose)
        for d in self.deps:
            self.check_batch(c, d, fresh=False)
        self.recover(c)
        for d in self.deps:
            d.begin_batch(first + FRESH_AT, cyc["fresh"][d.name], "fresh rooms")
        self.pump(lambda: all(d.batch_done() for d in self.deps), wd,
                  "cycle %d's fresh rooms to be final on every rank" % c, self.diagnose)
        for d in self.deps:
            self.check_batch(c, d, fresh=True)
        self.quiet_window(c)
        self.stats["cycles"] += 1
        for st, why in sorted(self.reasons.items()):
            log("  %s, e.g. %s" % (st, why[:300]))
        log("  cycle %d ok in %.1f s" % (c, time.time() - t_cycle))

    def recover(self, c):
        """Restart a killed rank and wait until its peers can find it.
        After a cut, wait one heartbeat timeout past the link's return: a
        connection that lived through the cut may still be silent in TCP's
        retransmission backoff, and the engines tell only by the heartbeat
        whether it comes back or is dead (its rooms then fail, rightly)."""
        f = self.fault
        if f["kind"] == "cut":
            settled = f["t1"] + HEARTBEAT_S + 0.5
            self.pump(lambda: time.time() >= settled, HEARTBEAT_S + 5,
                      "the connections across the link to settle")
        if f["kind"] != "kill":
            return
        d = next(x for x in self.deps if x.name == f["dep"])
        side, rank = f["target"]
        p = d.start_rank(side, rank, c + 1)
        log("  restarted %s (pid %d)" % (p.name, p.pid))
        self.pump(lambda: p.ready is not None, 60, "%s to be ready" % p.name)
        self.pump(d.route_ok, 30, "the %s registry to list every prefill rank at its "
                  "current address" % d.name)

    def anchor(self, d, key, ev):
        """When the fault could first fail rooms on this rank: a stopped
        rank acts once continued; a stop or cut shorter than the heartbeat
        timeout fails nothing until it is over.  A room that had succeeded
        here and failed later (a sibling's failure overrode it) is seen to
        fail only when the rank reports it (tools/rank.c), once every rank
        of the room is final: with a rank of this deployment stopped, not
        before that rank runs again."""
        f = self.fault
        overridden = ev.get("final_state") == "Success" and ev.get("state") == "Failed"
        if f["kind"] == "stop" and (f["victim"].key == key and f["victim"].dep is d
                                    or f["t1"] - f["t0"] < HEARTBEAT_S
                                    or overridden and f["victim"].dep is d):
            return f["t1"]
        if f["kind"] == "cut" and f["t1"] - f["t0"] < HEARTBEAT_S:
            return f["t1"]
        return f["t0"]

    def check_batch(self, c, d, fresh):
        b = d.batch
        f = self.fault
        what = "cycle %d %s %s" % (c, d.name, b["what"])
        self.stats["rooms"] += len(b["sizes"])
        for key, rooms in b["rooms"].items():
            p = d.ranks.get(key)
            killed = f["kind"] == "kill" and f["victim"] is not None and \
                f["victim"].dep is d and f["victim"].key == key and not fresh
            if killed:
                p = f["victim"]
            for i in range(b["first"], b["first"] + len(b["sizes"])):
                ev = rooms.get(i)
                if ev is None:
                    if killed:
                        self.stats["lost"] += 1
                        continue
                    fail("%s: %s never reported request %d" % (what, p.name, i))
                self.check_room(what, d, p, key, i, ev, fresh)

    def check_room(self, what, d, p, key, i, ev, fresh):
        state = ev.get("state")
        finals = self.stats["finals"]
        finals[state] = finals.get(state, 0) + 1
        where = "%s: request %d (room %s) on %s" % (what, i, ev.get("room"), p.name)
        if state == "Success":
            if key[0] == "decode" and ev.get("verified") is not True:
                fail("%s reported SUCCESS with data that did not verify: %s"
                     % (where, ev.get("failure")))
            return
        if state != "Failed":
            fail("%s ended in %r, neither Success nor Failed" % (where, state))
        fr = ev.get("failure") or {}
        st = fr.get("status")
        self.stats["failures"][st] = self.stats["failures"].get(st, 0) + 1
        self.reasons.setdefault(st, "%s: %s" % (p.name, fr.get("reason")))
        if st in ("VERIFY_FAILED", "STALE_WRITE"):
            fail("%s: %s" % (where, fr.get("reason")))
        if not fr.get("reason") or not st:
            fail("%s failed without a status or reason: %s" % (where, fr))
        if fr.get("origin_side") not in ("prefill", "decode") or not fr.get("origin_addr"):
            fail("%s failed without an origin (side, addr): %s" % (where, fr))
        if not fresh and self.touched(d) and self.fault["kind"] != "reset" and \
                ev["end"] < self.fault["t0"] - 0.05:
            fail("%s failed %.2f s before the fault: %s: %s"
                 % (where, self.fault["t0"] - ev["end"], st, fr.get("reason")))
        if not fresh and self.touched(d) and self.fault["kind"] == "reset":
            fail("%s failed after one connection reset, which the decode side must "
                 "reconnect and resume from (docs/FAILURES.md, Transient faults): %s: %s"
                 % (where, st, fr.get("reason")))
        if fresh or not self.touched(d):
            fail("%s failed, but no fault touched %s%s: %s: %s" % (
                where, "these fresh rooms (the survivors did not recover)" if fresh
                else "this deployment", "", st, fr.get("reason")))
        late = ev["end"] - max(ev["start"], self.anchor(d, key, ev))
        if late > self.resolve_s:
            fail("%s failed %.2f s after the fault (or after its own start, if later), "
                 "past the %.1f s its deadlines allow: %s: %s"
                 % (where, late, self.resolve_s, st, fr.get("reason")))

    def diagnose(self):
        """What a stuck batch looks like: rooms pending per rank, and the
        threads of the processes that hold them."""
        out = []
        for d in self.deps:
            for line in d.pending():
                out.append("  %s %s" % (d.name, line))
        procs = [p for d in self.deps for p in d.ranks.values()
                 if p.live() and any(p.name in ln for ln in out)]
        for p in procs[:3]:
            t0 = thread_cpu(p.pid)
            time.sleep(0.5)
            t1 = thread_cpu(p.pid)
            busy = ", ".join("%d: %.0f%%" % (t, 200 * (t1[t] - t0.get(t, 0))) for t in t1)
            out.append("  %s (pid %d) threads' CPU over 0.5 s: %s\n  stacks:\n%s\n  log:\n%s"
                       % (p.name, p.pid, busy, stacks(p.pid), p.log_tail(15)))
        return ":\n" + "\n".join(out)

    # -- start and end ---------------------------------------------------

    def start(self):
        for d in self.deps:
            d.start_registry()
            d.probe()
        # Enough cycles for the run at one per two seconds, the fastest
        # a cycle with a fault, a fresh batch and a quiet window can go.
        self.plan = Plan(self, self.seconds // 2 + 4)
        for d in self.deps:
            for side, rank in d.keys():
                d.start_rank(side, rank, 0)
        self.pump(lambda: all(p.ready for d in self.deps for p in d.ranks.values()), 120,
                  "every rank to be ready")
        self.pump(lambda: all(d.route_ok() for d in self.deps), 30,
                  "every registry to list its prefill ranks")

    def finish(self):
        self.ending = True
        for p in self.procs:
            if p.state == "stopped":
                p.signal(signal.SIGCONT)
        for d in self.deps:
            for p in d.ranks.values():
                p.send("exit")
        for d in self.deps:
            for p in d.ranks.values():
                if p.state in ("killed", "gone"):
                    continue
                try:
                    rc = p.p.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    fail("%s (pid %d) did not exit within 60 s of 'exit'" % (p.name, p.pid))
                if rc != 0:
                    fail("%s (pid %d) exited with status %d; its log ends:\n%s"
                         % (p.name, p.pid, rc, p.log_tail()))

    def cleanup(self):
        self.ending = True
        for p in self.procs:
            if p.p.poll() is None:
                try:
                    os.kill(p.pid, signal.SIGCONT)
                    os.kill(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.p.wait()
        if self.netns:
            subprocess.run(["ip", "link", "set", self.netns["pre_link"], "up"])

    def summary(self, elapsed):
        s = self.stats
        finals = ", ".join("%s %d" % kv for kv in sorted(s["finals"].items()))
        faults = ", ".join("%s %d" % kv for kv in s["faults"].items())
        fails = ", ".join("%s %d" % kv for kv in sorted(s["failures"].items())) or "none"
        return ("%d cycles in %.0f s, %d rooms over %s; room finals on every rank: %s, "
                "%d lost with killed ranks; faults: %s; failures by status: %s; "
                "quiet-window CPU at most %.1f%% of a CPU; memory at most %.0f%% of a bound "
                "(%s: %d of %d MiB); seed %d"
                % (s["cycles"], elapsed, s["rooms"], "+".join(d.name for d in self.deps),
                   finals, s["lost"], faults, fails, 100 * s["quiet_cpu"],
                   100 * s["mem_peak"][0], s["mem_peak"][1], s["mem_peak"][2],
                   s["mem_peak"][3], self.seed))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kvferry", required=True)
    ap.add_argument("--seconds", type=int, default=120)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--scale", type=float, default=1.0,
                    help="room sizes, as a share of the deployments' own")
    ap.add_argument("--netns", nargs=5, metavar=("DECODE_NS", "PRE_LINK", "DEC_LINK",
                                                 "PRE_IP", "DEC_IP"))
    args = ap.parse_args()
    if args.seed is None:
        args.seed = random.SystemRandom().randrange(1 << 31)
    run = Run(args)
    log("seed %d (replay: KVF_CHAOS_SEED=%d), %d s, deployments %s%s"
        % (run.seed, run.seed, run.seconds, ", ".join(d.name for d in run.deps),
           "".join("; " + n for n in run.notes)))
    t0 = time.time()
    try:
        run.start()
        c = 0
        while (c == 0 or time.time() - t0 < run.seconds) and c < len(run.plan.cycles):
            run.cycle(c)
            c += 1
        run.finish()
    except (Failure, Exception) as e:
        if not isinstance(e, Failure):     # the driver's own error: say where
            e = "the test driver failed: %s" % traceback.format_exc()
        print("FAIL chaos (seed %d, replay with KVF_CHAOS_SEED=%d): %s"
              % (run.seed, run.seed, e), flush=True)
        print("chaos: after %s" % run.summary(time.time() - t0), flush=True)
        run.cleanup()
        print("chaos: logs in %s" % run.tmp)
        sys.exit(1)
    run.cleanup()
    shutil.rmtree(run.tmp, ignore_errors=True)
    print("chaos: ok: " + run.summary(time.time() - t0), flush=True)


if __name__ == "__main__":
    main()
