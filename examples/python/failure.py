#!/usr/bin/env python3
"""Handling a failed room with KVTransferError, the way a scheduler does.

    python3 examples/python/failure.py --scenario page-size
    python3 examples/python/failure.py --scenario killed-peer

page-size: prefill.py runs as a child with page_size=16 (it hosts the
registry); this process is a decode server with page_size=32.  The
handshake refuses the pair: the room fails on both sides with SGLang's
"Page size mismatch: ..." message.

killed-peer: this process is the prefill server (its engine hosts the
registry); decode.py runs as a child and is SIGKILLed once the room is
WaitingForInput.  The heartbeat notices within about a second and the room
fails here, with this rank as the origin (is_from_another_rank=False).

Either way the scheduler fails that one request and carries on: the
manager stays usable for the next rooms.  Exit status 0 when the expected
KVTransferError was raised.
"""
import argparse
import os
import signal
import subprocess
import sys
import time

from common import kvferry, make_args
from kvferry import KVPoll, KVReceiver, KVSender, KVTransferError

HERE = os.path.dirname(os.path.abspath(__file__))


def handle(room, handle_obj):
    """What a scheduler does with a Failed room: raise, catch, log, move on."""
    try:
        handle_obj.failure_exception()
    except KVTransferError as e:
        print("request of room %d failed:\n  reason: %s\n  status: %s\n  origin: %s "
              "rank %s at %s\n  is_from_another_rank: %s"
              % (e.bootstrap_room, e.failure_reason, e.status, e.origin_side,
                 e.origin_rank, e.origin_addr, e.is_from_another_rank), flush=True)
        return e
    return None


def wait_final(h, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = h.poll()
        if s in (KVPoll.Success, KVPoll.Failed):
            return s
        time.sleep(0.01)
    return h.poll()


def page_size_mismatch():
    child = subprocess.Popen([sys.executable, os.path.join(HERE, "prefill.py"),
                              "--rooms", "1", "--page-size", "16", "--timeout", "20"],
                             stdout=subprocess.PIPE, text=True)
    try:
        addr = child.stdout.readline().split()[1]       # "bootstrap host:port"
        with kvferry.KVManager(make_args(32), "decode") as mgr:
            rx = KVReceiver(mgr, addr, 1000)
            rx.init(list(range(4)), aux_index=0)
            state = wait_final(rx, 20)
            print("decode room 1000:", state.name)
            e = handle(1000, rx) if state == KVPoll.Failed else None
        print("prefill child says:", child.communicate(timeout=30)[0].strip())
        return e is not None and "Page size mismatch" in e.failure_reason
    finally:
        child.kill()
        child.wait()


def killed_peer():
    args = make_args(16, host_bootstrap=True, bootstrap_addr="127.0.0.1:0",
                     heartbeat_interval_ms=200, heartbeat_timeout_ms=1000)
    with kvferry.KVManager(args, "prefill") as mgr:
        addr = mgr.bootstrap_addr
        tx = KVSender(mgr, addr, 1000)
        child = subprocess.Popen([sys.executable, os.path.join(HERE, "decode.py"),
                                  "--bootstrap", addr, "--rooms", "1", "--timeout", "20"],
                                 stdout=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 20
            while tx.poll() == KVPoll.Bootstrapping and time.monotonic() < deadline:
                time.sleep(0.01)
            print("prefill room 1000:", tx.poll().name, "- killing the decode process")
            child.send_signal(signal.SIGKILL)
            t0 = time.monotonic()
            state = wait_final(tx, 20)
            print("prefill room 1000: %s after %.1fs" % (state.name, time.monotonic() - t0))
            e = handle(1000, tx) if state == KVPoll.Failed else None
            return e is not None and not e.is_from_another_rank
        finally:
            child.kill()
            child.wait()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenario", choices=["page-size", "killed-peer"],
                    default="page-size")
    o = ap.parse_args()
    ok = page_size_mismatch() if o.scenario == "page-size" else killed_peer()
    print("expected KVTransferError handled" if ok else "UNEXPECTED outcome")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
