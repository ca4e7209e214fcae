"""The harness of test_sglang and test_sglang_causes: a bootstrap registry
and the TP ranks of a prefill and a decode server, each rank a
``_sglang_rank.py`` process driving kvferry.sglang as SGLang's scheduler
does, each side's polls MIN-reduced between its ranks over a socket pair;
and, for a link cut between one pair, network namespaces to run them in.
"""
import json
import os
import queue
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
import unittest
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

try:
    import numpy  # noqa: F401 (the ranks need it)
    HAVE_NUMPY = True
except ImportError:
    HAVE_NUMPY = False

from kvferry import _lib  # noqa: E402
from kvferry import sglang as S  # noqa: E402

NEEDS = ("kvf_receiver_set_dest", "kvf_sender_set_states",
         "kvf_sender_decode_prefix_len", "kvf_sender_metric")
MISSING = [n for n in NEEDS if not _lib.has(n)]
WHY_NUMPY = "numpy is needed to check every byte (Debian: python3-numpy; `make deps`)"
TIMEOUT = 120                          # seconds for one case, every process

ROOM = 2 ** 63 + 11                    # ids past 2^63 on purpose


class Cluster:
    """A registry, the prefill ranks and the decode ranks (two and two by
    default), each rank a process; ``netns`` (a Netns) runs each in its
    namespace, the registry too.  ``start``: the sides to start now;
    start_side() starts another later (a decode server that comes after
    the prefill computed).  Other keywords go into every rank's config
    (_sglang_rank.py)."""

    def __init__(self, requests, chunk=8, env=None, prefill_env=None, decode_env=None,
                 tp=(2, 2), netns=None, start=("prefill", "decode"), **layout):
        self.procs, self.events = {}, queue.Queue()
        self.out, self.addrs, self.seen, self.gone = {}, {}, [], set()
        self.boot, self.netns = None, netns
        self.penv = dict(os.environ, **(netns.env if netns else {}))
        self.penv["PYTHONPATH"] = os.pathsep.join(
            [os.path.dirname(HERE)] + [p for p in self.penv.get("PYTHONPATH", "").split(
                os.pathsep) if p])
        self.spec = dict(requests=requests, chunk=chunk, env=env or {}, layout=layout,
                         side_env={"prefill": prefill_env or {},
                                   "decode": decode_env or {}},
                         tp=dict(zip(("prefill", "decode"), tp)))
        self.ranks = 0                  # ranks started
        try:
            self._start_registry()
            for side in start:
                self.start_side(side)
        except BaseException:
            self.close()
            raise

    def _start_registry(self):
        netns = self.netns
        if netns is None:
            self.boot = S.KVFerryKVBootstrapServer(host="127.0.0.1", port=0)
            self.addr = "127.0.0.1:%d" % self.boot.port
        else:
            self._start("registry", {"role": "registry", "host": netns.registry_host})
            ev = self.expect(lambda e: e["event"] == "registry", TIMEOUT, "the registry")
            self.addr = "%s:%d" % (netns.registry_host, ev["port"])

    def start_side(self, side):
        """Start every rank of ``side``, joined by a socket pair when two."""
        spec, size = self.spec, self.spec["tp"][side]
        pair = socket.socketpair() if size == 2 else None
        try:
            for rank in range(size):
                e = dict(spec["env"])
                e.update(spec["side_env"][side].get(rank, {}))
                if self.netns is not None:
                    e["KVF_HOST"] = self.netns.host[(side, rank)]
                cfg = dict(spec["layout"], role=side, tp_rank=rank, tp_size=size,
                           bootstrap=self.addr, requests=spec["requests"],
                           chunk=spec["chunk"], env=e)
                self._start((side, rank), cfg, pair[rank] if pair else None)
                self.ranks += 1
        finally:
            for sock in pair or ():
                sock.close()

    def side(self, side):
        return [key for key in self.procs if key != "registry" and key[0] == side]

    def _start(self, key, cfg, sock=None):
        fd = sock.fileno() if sock is not None else -1
        argv = [sys.executable, os.path.join(HERE, "_sglang_rank.py"), json.dumps(cfg),
                str(fd)]
        if self.netns is not None:
            argv = self.netns.prefix(key) + argv
        p = subprocess.Popen(argv, pass_fds=(fd,) if fd >= 0 else (), env=self.penv,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.procs[key] = p
        threading.Thread(target=self._read, args=(key, p), daemon=True).start()

    def _read(self, key, p):
        for line in p.stdout:
            try:
                self.events.put(json.loads(line))
            except ValueError:
                self.events.put({"event": "garbage", "line": line})
        self.events.put({"event": "eof", "rc": p.wait(), "key": key})

    def expect(self, pred, timeout, what):
        """The first event (from now on) that ``pred`` accepts; results,
        addresses and everything seen are kept on the way."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError("%s did not come in %ds; events: %s" % (
                    what, timeout, [(e["event"], e.get("role"), e.get("tp_rank"))
                                    for e in self.seen]))
            try:
                ev = self.events.get(timeout=left)
            except queue.Empty:
                continue
            self.seen.append(ev)
            key = (ev.get("role"), ev.get("tp_rank"))
            if ev["event"] == "ready":
                self.addrs[key] = ev["addr"]
            elif ev["event"] == "result":
                self.out[key] = {int(k): v for k, v in ev["rooms"].items()}
            elif ev["event"] == "eof" and tuple(ev["key"]) in self.gone:
                continue
            elif ev["event"] in ("error", "eof", "garbage"):
                raise AssertionError("a rank failed: %s" % ev)
            if pred(ev):
                return ev

    def until(self, cond, what):
        """Read events until ``cond()`` holds (it may already)."""
        if not cond():
            self.expect(lambda e: cond(), TIMEOUT, what)

    def wait_events(self, kind, n, room=None):
        """Until ``n`` events of ``kind`` (of ``room`` when given) came."""
        def count():
            return sum(1 for e in self.seen
                       if e["event"] == kind and room in (None, e.get("room")))
        self.until(lambda: count() >= n, "%d %r events" % (n, kind))

    def wait_registered(self):
        """Until the registry answers its parallel info: every prefill rank
        has registered (GET /route with every rank -1 answers 200)."""
        url = ("http://%s/route?prefill_dp_rank=-1&prefill_cp_rank=-1&"
               "target_tp_rank=-1&target_pp_rank=-1" % self.addr)
        deadline = time.monotonic() + TIMEOUT
        while True:
            try:
                with urllib.request.urlopen(url, timeout=5) as r:
                    if r.status == 200:
                        return
            except (OSError, ValueError):
                pass
            if time.monotonic() > deadline:
                raise AssertionError("the prefill ranks did not register in %ds"
                                     % TIMEOUT)
            time.sleep(0.02)

    def saw(self, event, role, tp_rank):
        return any((e["event"], e.get("role"), e.get("tp_rank")) == (event, role, tp_rank)
                   for e in self.seen)

    def results(self):
        """{(role, tp_rank): {room: result}} once every rank still alive
        reported."""
        live = self.ranks - len(self.gone)
        self.until(lambda: len(self.out) >= live, "every rank's result")
        for key, p in self.procs.items():
            if key not in self.gone and key != "registry":
                self.send(key, "exit")
        for key, p in self.procs.items():
            if key not in self.gone and key != "registry":
                p.wait(timeout=30)
        return dict(self.out)

    def send(self, key, line):
        self.procs[key].stdin.write(line + "\n")
        self.procs[key].stdin.flush()

    def tell(self, side, line):
        for key in self.side(side):
            self.send(key, line)

    def kill_side(self, side):
        for key in self.side(side):
            self.signal(key, signal.SIGKILL)

    def signal(self, key, sig):
        self.procs[key].send_signal(sig)
        if sig == signal.SIGKILL:
            self.gone.add(key)
            self.procs[key].wait(timeout=30)

    def close(self):
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
            p.wait(timeout=30)
            for f in (p.stdin, p.stdout):
                try:
                    f.close()
                except OSError:
                    pass
        if self.boot is not None:
            self.boot.close()


P0, P1, D0, D1 = RANKS = [(side, r) for side in ("prefill", "decode") for r in range(2)]


class ClusterCase(unittest.TestCase):
    """A test case whose tests run one Cluster at a time (self.cluster),
    closed after each test."""

    def setUp(self):
        self.cluster = None

    def tearDown(self):
        if self.cluster is not None:
            self.cluster.close()

    def run_cluster(self, requests, **kw):
        self.cluster = Cluster(requests, **kw)
        return self.cluster.results()


class Netns:
    """Network namespaces for a cut between one pair: a hub whose bridge
    carries the registry, prefill rank 1 and decode rank 1, and one
    namespace each for prefill rank 0 and decode rank 0, on the bridge by a
    veth pair each.  cut() adds a blackhole route each way between P0 and
    D0 inside their namespaces: their packets to each other vanish (no FIN,
    no RST), and each still reaches every other rank."""

    NET = "10.213.80."
    made = 0

    def __init__(self):
        Netns.made += 1
        tag = "%d_%d" % (os.getpid() % 100000, Netns.made)   # names of 15 at most
        self.hub, self.p0, self.d0 = "kvfh" + tag, "kvfp" + tag, "kvfd" + tag
        self.host = {P0: self.NET + "1", D0: self.NET + "2",
                     P1: self.NET + "11", D1: self.NET + "12"}
        self.registry_host = self.NET + "254"
        self.ns = {P0: self.p0, D0: self.d0}
        # Ranks on addresses other than loopback need a cluster token; tcp,
        # as shm would carry the bytes past the cut.
        self.env = {"KVF_AUTH_TOKEN": secrets.token_hex(24), "KVF_TRANSPORT": "tcp"}
        self.spaces = []
        try:
            self._build(tag)
        except BaseException:
            self.close()
            raise

    @staticmethod
    def ip(*args):
        subprocess.run(("ip",) + args, check=True, capture_output=True, timeout=30)

    @staticmethod
    def unavailable():
        probe = "kvfprobe%d" % os.getpid()
        try:
            Netns.ip("netns", "add", probe)
        except (OSError, subprocess.SubprocessError) as e:
            return (getattr(e, "stderr", b"") or b"").decode().strip() or str(e)
        try:
            Netns.ip("netns", "exec", probe, "true")
        except (OSError, subprocess.SubprocessError) as e:
            return (getattr(e, "stderr", b"") or b"").decode().strip() or str(e)
        finally:
            Netns.ip("netns", "del", probe)
        return None

    def _build(self, tag):
        for ns in (self.hub, self.p0, self.d0):
            self.ip("netns", "add", ns)
            self.spaces.append(ns)
            self.ip("-n", ns, "link", "set", "lo", "up")
        br = "kvb" + tag
        self.ip("-n", self.hub, "link", "add", br, "type", "bridge")
        self.ip("-n", self.hub, "link", "set", br, "up")
        for host in (self.registry_host, self.host[P1], self.host[D1]):
            self.ip("-n", self.hub, "addr", "add", host + "/24", "dev", br)
        for key, end in ((P0, "p"), (D0, "d")):
            ns, outer, inner = self.ns[key], "kvh%s%s" % (end, tag), "kvn%s%s" % (end, tag)
            self.ip("-n", self.hub, "link", "add", outer, "type", "veth", "peer", "name",
                    inner, "netns", ns)
            self.ip("-n", self.hub, "link", "set", outer, "master", br, "up")
            self.ip("-n", ns, "addr", "add", self.host[key] + "/24", "dev", inner)
            self.ip("-n", ns, "link", "set", inner, "up")

    def prefix(self, key):
        return ["ip", "netns", "exec", self.ns.get(key, self.hub)]

    def cut(self):
        self.ip("-n", self.p0, "route", "add", "blackhole", self.host[D0] + "/32")
        self.ip("-n", self.d0, "route", "add", "blackhole", self.host[P0] + "/32")

    def close(self):
        for ns in self.spaces:
            try:
                self.ip("netns", "del", ns)
            except (OSError, subprocess.SubprocessError):
                pass
        self.spaces = []
