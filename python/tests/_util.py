"""Helpers for the binding's tests: a small layout, a byte pattern, and a
child process (``_peer.py``) that plays the other side of a room.

Every child is started with a deadline and killed by ``Peer.close()``
(call it from ``tearDown``/``finally``); every wait has a timeout.
"""
import hashlib
import json
import os
import queue
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))       # the package, from the tree

import kvferry  # noqa: E402
from kvferry import KVPoll  # noqa: E402

LAYERS = 2
HEADS = 2
HEAD_BYTES = 16
POOL_PAGES = 64
AUX_SLOTS = 8
AUX_BYTES = 32
STATE_SLOTS = 4
STATE_BYTES = 48
FINAL = (KVPoll.Success, KVPoll.Failed)


def make_args(page_size=4, state=False, **engine):
    """KVArgs over bytearrays: 2 layers x (K, V), 64 pages each, 8 aux slots."""
    pb = page_size * HEADS * HEAD_BYTES
    a = kvferry.KVArgs(
        kv_data_ptrs=[bytearray(POOL_PAGES * pb) for _ in range(2 * LAYERS)],
        kv_item_lens=[pb], page_size=page_size, kv_head_num=HEADS,
        bytes_per_head=HEAD_BYTES, num_layers=LAYERS, kv_dtype="bfloat16",
        aux_data_ptrs=[bytearray(AUX_SLOTS * AUX_BYTES)], aux_item_lens=[AUX_BYTES],
        **engine)
    if state:
        a.state_data_ptrs = [bytearray(STATE_SLOTS * STATE_BYTES)]
        a.state_item_lens = [STATE_BYTES]
    return a


DESCRIPTOR_FIELDS = ("id", "addr", "role", "tp", "pp", "dp", "page", "dtype", "attn",
                     "heads")


def descriptor(rank=0, size=1, port=None, **change):
    """A prefill engine's descriptor as kvf_engine_descriptor writes it (TP
    rank ``rank`` of ``size``, on 127.0.0.1), with ``change`` replacing
    fields (None drops one)."""
    f = {"id": "%016x" % (0xC0FFEE00 + rank),
         "addr": "127.0.0.1:%d" % (port or 41000 + rank), "role": "prefill",
         "tp": "%d/%d" % (rank, size), "pp": "0/1", "dp": "0/1", "page": "4",
         "dtype": "bfloat16", "attn": "mha", "heads": "2"}
    f.update(change)
    return "kvf1 " + " ".join("%s=%s" % kv for kv in f.items() if kv[1] is not None)


def pattern(room, buf, i, n):
    """Bytes of page ``i`` of ``room`` in KV buffer ``buf`` (``buf`` "aux"/"state"
    for those records)."""
    d = hashlib.sha256(("%s/%s/%s" % (room, buf, i)).encode()).digest()
    return (d * (n // len(d) + 1))[:n]


def fill_room(mgr, room, pages, aux_slot, state_slot=None):
    """Write the room's pattern into its prefill pages, aux and state slot."""
    a = mgr.args
    for b, buf in enumerate(a.kv_data_ptrs):
        pb = a.kv_item_lens[0]
        for i, p in enumerate(pages):
            buf[p * pb:(p + 1) * pb] = pattern(room, b, i, pb)
    a.aux_data_ptrs[0][aux_slot * AUX_BYTES:(aux_slot + 1) * AUX_BYTES] = \
        pattern(room, "aux", 0, AUX_BYTES)
    if state_slot is not None:
        a.state_data_ptrs[0][state_slot * STATE_BYTES:(state_slot + 1) * STATE_BYTES] = \
            pattern(room, "state", 0, STATE_BYTES)


def verify_room(mgr, room, pages, aux_slot, state_slot=None):
    """The list of mismatches between the decode pages and the pattern."""
    a = mgr.args
    bad = []
    for b, buf in enumerate(a.kv_data_ptrs):
        pb = a.kv_item_lens[0]
        for i, p in enumerate(pages):
            if bytes(buf[p * pb:(p + 1) * pb]) != pattern(room, b, i, pb):
                bad.append(("kv", b, i, p))
    if bytes(a.aux_data_ptrs[0][aux_slot * AUX_BYTES:(aux_slot + 1) * AUX_BYTES]) != \
            pattern(room, "aux", 0, AUX_BYTES):
        bad.append(("aux", aux_slot))
    if state_slot is not None and bytes(
            a.state_data_ptrs[0][state_slot * STATE_BYTES:(state_slot + 1) * STATE_BYTES]) \
            != pattern(room, "state", 0, STATE_BYTES):
        bad.append(("state", state_slot))
    return bad


def failure_dict(e):
    return {"room": e.bootstrap_room, "reason": e.failure_reason,
            "from_another_rank": e.is_from_another_rank, "origin_side": e.origin_side,
            "origin_rank": e.origin_rank, "origin_addr": e.origin_addr,
            "status": e.status}


def wait_state(h, states, timeout=20.0):
    """Poll ``h`` until its state is in ``states``; return the state."""
    deadline = time.monotonic() + timeout
    while True:
        s = h.poll()
        if s in states or time.monotonic() > deadline:
            return s
        time.sleep(0.005)


class Peer:
    """A ``_peer.py`` child (or ``script``): ``config`` on argv, JSON events on
    stdout, JSON commands on stdin (``send``)."""

    def __init__(self, config, timeout=120, script="_peer.py"):
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            [os.path.dirname(HERE)] + [p for p in env.get("PYTHONPATH", "").split(
                os.pathsep) if p])
        self.proc = subprocess.Popen(
            [sys.executable, os.path.join(HERE, script), json.dumps(config)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True)
        self.events = queue.Queue()
        self.seen = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self._deadline = time.monotonic() + timeout

    def _read(self):
        for line in self.proc.stdout:
            try:
                self.events.put(json.loads(line))
            except ValueError:
                self.events.put({"event": "garbage", "line": line})
        self.events.put({"event": "eof", "rc": self.proc.wait()})

    def expect(self, pred, timeout=30.0, what="event"):
        """The first event for which ``pred(ev)`` is true (AssertionError on
        timeout, child exit or an "error" event)."""
        for ev in self.seen:
            if pred(ev):
                return ev
        deadline = min(time.monotonic() + timeout, self._deadline)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError("peer: no %s within %.0fs; saw %s"
                                     % (what, timeout, self.seen))
            try:
                ev = self.events.get(timeout=left)
            except queue.Empty:
                continue
            self.seen.append(ev)
            if pred(ev):
                return ev
            if ev["event"] in ("eof", "error"):
                raise AssertionError("peer ended waiting for %s: %s" % (what, self.seen))

    def room_event(self, room, states, timeout=30.0):
        return self.expect(lambda e: e["event"] == "state" and e["room"] == room
                           and e["state"] in states, timeout,
                           "room %d in %s" % (room, states))

    def send(self, **cmd):
        """One JSON command line to the child's stdin."""
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def kill(self, sig=9):
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def close(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass
