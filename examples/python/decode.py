#!/usr/bin/env python3
"""The decode side: receive rooms into scattered pages and verify every byte.

    python3 examples/python/decode.py --bootstrap 127.0.0.1:PORT --rooms 8 --tokens 1024

Use the same --rooms/--room-base/--tokens/--page-size as prefill.py.  Each
room's destination pages are scattered over the pool (as a decode server's
allocator leaves them).  Exit status 0 when every room succeeded and every
byte of every page, and the aux record, is what prefill wrote.
"""
import argparse
import random
import sys
import time

from common import (POOL_PAGES, aux_record, kvferry, make_args, page_bytes,
                    pattern, room_pages)
from kvferry import KVPoll, KVReceiver, KVTransferError


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bootstrap", required=True, help="prefill registry host:port")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--rooms", type=int, default=8)
    ap.add_argument("--room-base", type=int, default=1000)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--timeout", type=float, default=60.0)
    o = ap.parse_args()

    n = room_pages(o.tokens, o.page_size)
    if n * o.rooms > POOL_PAGES:
        ap.error("--rooms x pages per room exceeds the %d-page pool" % POOL_PAGES)
    pool = random.Random(7).sample(range(POOL_PAGES), n * o.rooms)
    with kvferry.KVManager(make_args(o.page_size, host=o.host), "decode") as mgr:
        recv = {}
        for r in range(o.rooms):
            room = o.room_base + r
            dst = pool[r * n:(r + 1) * n]
            rx = KVReceiver(mgr, o.bootstrap, room)
            rx.init(dst, aux_index=r)
            recv[room] = (rx, dst, r)
        ok = wait_and_verify(mgr, recv, o)
        for rx, _, _ in recv.values():
            rx.close()
    return 0 if ok else 1


def wait_and_verify(mgr, recv, o):
    pb = page_bytes(o.page_size)
    kv = mgr.args.kv_data_ptrs
    aux = mgr.args.aux_data_ptrs[0]
    pending, ok, nbytes = dict(recv), True, 0
    deadline = time.monotonic() + o.timeout
    while pending and time.monotonic() < deadline:
        for room, (rx, dst, r) in list(pending.items()):
            state = rx.poll()
            if state == KVPoll.Success:
                bad = [(b, i) for b, buf in enumerate(kv) for i, p in enumerate(dst)
                       if buf[p * pb:(p + 1) * pb] != pattern(room, b, i, pb)]
                if aux[r * 64:(r + 1) * 64] != aux_record(room):
                    bad.append(("aux", r))
                nbytes += len(kv) * len(dst) * pb
                print("room %d: Success, %s" % (room, "verified" if not bad else
                                                 "MISMATCH at %s" % bad[:4]), flush=True)
                ok = ok and not bad
                del pending[room]
            elif state == KVPoll.Failed:
                try:
                    rx.failure_exception()
                except KVTransferError as e:
                    print("room %d: Failed: %s" % (room, e), flush=True)
                ok = False
                del pending[room]
        time.sleep(0.001)
    for room in pending:
        print("room %d: still %s after %.0fs" % (room, pending[room][0].poll().name,
                                                 o.timeout), flush=True)
    print("%d rooms, %d bytes verified, %s" % (len(recv), nbytes,
                                               "ok" if ok and not pending else "FAILED"))
    return ok and not pending


if __name__ == "__main__":
    sys.exit(main())
