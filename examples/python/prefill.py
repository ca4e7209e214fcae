#!/usr/bin/env python3
"""The prefill side: host a bootstrap registry, serve rooms, report.

    python3 examples/python/prefill.py --rooms 8 --tokens 1024 [--port-file F]

Prints ``bootstrap 127.0.0.1:PORT`` once the registry listens; start
decode.py with that address.  For each room it waits for the decode side's
destination (WaitingForInput), "computes" the KV (writes a known pattern
into the room's pages), sends it in chunks (chunked prefill) and polls
until Success or Failed.  Exit status 0 when every room succeeded.
"""
import argparse
import os
import sys
import time

from common import (aux_record, kvferry, make_args, page_bytes, pattern,
                    room_pages)
from kvferry import KVPoll, KVSender, KVTransferError


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--bootstrap-port", type=int, default=0, help="0: any free port")
    ap.add_argument("--host-bootstrap", action="store_true",
                    help="let the engine run the registry (default: a BootstrapServer)")
    ap.add_argument("--rooms", type=int, default=8)
    ap.add_argument("--room-base", type=int, default=1000)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--chunk-pages", type=int, default=16)
    ap.add_argument("--timeout", type=float, default=60.0)
    ap.add_argument("--port-file", help="also write the bootstrap address here")
    o = ap.parse_args()

    registry = None
    if o.host_bootstrap:
        args = make_args(o.page_size, host=o.host, host_bootstrap=True,
                         bootstrap_addr="%s:%d" % (o.host, o.bootstrap_port))
    else:
        registry = kvferry.BootstrapServer(o.host, o.bootstrap_port)
        args = make_args(o.page_size, host=o.host, bootstrap_addr=registry.addr)
    with kvferry.KVManager(args, "prefill") as mgr:
        addr = mgr.bootstrap_addr if o.host_bootstrap else registry.addr
        print("bootstrap", addr, flush=True)
        if o.port_file:
            with open(o.port_file + ".tmp", "w") as f:
                f.write(addr)
            os.replace(o.port_file + ".tmp", o.port_file)
        ok = serve(mgr, addr, o)
    if registry:
        registry.close()
    return 0 if ok else 1


def serve(mgr, addr, o):
    n = room_pages(o.tokens, o.page_size)
    pb = page_bytes(o.page_size)
    kv = mgr.args.kv_data_ptrs
    aux = mgr.args.aux_data_ptrs[0]
    senders = {}
    for r in range(o.rooms):
        room = o.room_base + r
        src = list(range(r * n, (r + 1) * n))      # this room's prefill pages
        senders[room] = (KVSender(mgr, addr, room), src, r)
    pending, ok = dict(senders), True
    deadline = time.monotonic() + o.timeout
    while pending and time.monotonic() < deadline:
        for room, (s, src, r) in list(pending.items()):
            state = s.poll()
            if state == KVPoll.WaitingForInput and s.num_kv_indices is None:
                for b, buf in enumerate(kv):        # "run the forward pass"
                    for i, p in enumerate(src):
                        buf[p * pb:(p + 1) * pb] = pattern(room, b, i, pb)
                aux[r * 64:(r + 1) * 64] = aux_record(room)
                s.init(len(src), aux_index=r)
                for c in range(0, len(src), o.chunk_pages):
                    s.send(src[c:c + o.chunk_pages])   # is_last when all sent
            elif state == KVPoll.Success:
                print("room %d: Success" % room, flush=True)
                del pending[room]
            elif state == KVPoll.Failed:
                try:
                    s.failure_exception()
                except KVTransferError as e:
                    print("room %d: Failed: %s" % (room, e), flush=True)
                ok = False
                del pending[room]
        time.sleep(0.001)
    for room in pending:
        print("room %d: still %s after %.0fs" % (room, pending[room][0].poll().name,
                                                 o.timeout), flush=True)
    for s, _, _ in senders.values():
        s.close()
    return ok and not pending


if __name__ == "__main__":
    sys.exit(main())
