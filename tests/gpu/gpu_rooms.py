"""One side of a GPU room pair, for the device check (tests/gpu/run.sh).

    gpu_rooms.py prefill --mode ipc --port-file F [--seg 65536 --pages 4096 --rooms 4]
    gpu_rooms.py decode  --mode ipc --bootstrap HOST:PORT [same sizes]

Modes: ipc (both sides CUDA memory, transport cuda), staged (both CUDA,
transport tcp: bounce buffers on both sides), gpu2host, host2gpu (one side
CUDA, tcp), host (pinned host memory both sides over tcp: the baseline the
staged figure is held to).  KV is 2 buffers (one layer, K and V) of `pages` pages of
`seg` bytes; every room takes scattered pages, so each page is one segment.
The prefill writes a pattern computed on the device from (room, buffer,
page); the decode recomputes it where its pages are and compares there
(torch.equal on the device): byte for byte, nothing copied to the host to
check.  The decode prints one JSON line: the mode, the bytes, the seconds
from its first destination to the last room's Success, and GB/s.
"""
import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                "python"))
import kvferry  # noqa: E402
from kvferry import KVPoll, KVReceiver, KVSender  # noqa: E402

AUX_B = 64


def sides(mode):
    """(prefill on cuda, decode on cuda, transport)."""
    return {"ipc": (True, True, "cuda"), "staged": (True, True, "tcp"),
            "gpu2host": (True, False, "tcp"), "host2gpu": (False, True, "tcp"),
            "host": (False, False, "tcp")}[mode]


def make_args(o, cuda, **engine):
    dev = "cuda" if cuda else "cpu"
    pin = not cuda
    kv = [torch.zeros(o.pages * o.seg, dtype=torch.uint8, device=dev,
                      pin_memory=pin) for _ in range(2)]
    aux = [bytearray(o.rooms * AUX_B)]
    heads = 1
    return kvferry.KVArgs(
        kv_data_ptrs=kv, kv_item_lens=[o.seg] * 2, aux_data_ptrs=aux,
        aux_item_lens=[AUX_B], page_size=16, kv_dtype="bfloat16", attention="mha",
        num_layers=1, kv_head_num=heads, bytes_per_head=o.seg // 16,
        checksum=False, transfer_timeout_ms=60000, **engine)


def pattern(room, buf, pages, seg, device):
    """The room's bytes, page by page, computed where they are checked."""
    p = torch.as_tensor(pages, device=device, dtype=torch.int64).view(-1, 1)
    i = torch.arange(seg, device=device, dtype=torch.int64).view(1, -1)
    return ((i * 131 + p * 7 + room * 13 + buf * 29) % 251).to(torch.uint8)


def room_pages(o, r, scatter):
    """Room r's pages: every other page of a room-sized window (so no two
    pages of a room are adjacent: one segment each), reversed on decode."""
    n = o.pages // (2 * o.rooms)
    base = r * 2 * n
    src = [base + 2 * k for k in range(n)]
    return list(reversed(src)) if scatter else src


def prefill(o):
    cuda, _, transport = sides(o.mode)
    a = make_args(o, cuda, host="127.0.0.1", host_bootstrap=True,
                  bootstrap_addr="127.0.0.1:0", transport=transport)
    with kvferry.KVManager(a, "prefill") as mgr:
        with open(o.port_file + ".tmp", "w") as f:
            f.write(mgr.bootstrap_addr)
        os.replace(o.port_file + ".tmp", o.port_file)
        kv = mgr.args.kv_data_ptrs
        todo = {}
        for r in range(o.rooms):
            src = room_pages(o, r, False)
            for b in range(2):
                view = kv[b].view(o.pages, o.seg)
                view[src] = pattern(r, b, list(range(len(src))), o.seg,
                                    view.device)
            todo[r] = (KVSender(mgr, mgr.bootstrap_addr, 100 + r), src)
        if cuda:
            torch.cuda.synchronize()
        deadline = time.monotonic() + o.timeout
        while todo and time.monotonic() < deadline:
            for r, (s, src) in list(todo.items()):
                st = s.poll()
                if st == KVPoll.WaitingForInput and s.num_kv_indices is None:
                    s.init(len(src), aux_index=r)
                    s.send(src)
                elif st in (KVPoll.Success, KVPoll.Failed):
                    if st == KVPoll.Failed:
                        print("prefill room %d failed: %s" % (r, s.failure_exception()),
                              file=sys.stderr)
                        return 1
                    s.close()
                    del todo[r]
            time.sleep(0.0002)
        return 0 if not todo else 1


def decode(o):
    _, cuda, transport = sides(o.mode)
    a = make_args(o, cuda, host="127.0.0.1", transport=transport)
    with kvferry.KVManager(a, "decode") as mgr:
        kv = mgr.args.kv_data_ptrs
        rx = {}
        t0 = time.monotonic()
        for r in range(o.rooms):
            dst = room_pages(o, r, True)
            x = KVReceiver(mgr, o.bootstrap, 100 + r)
            x.init(dst, aux_index=r)
            rx[r] = (x, dst)
        left = dict(rx)
        deadline = time.monotonic() + o.timeout
        while left and time.monotonic() < deadline:
            for r, (x, _) in list(left.items()):
                st = x.poll()
                if st == KVPoll.Failed:
                    print("decode room %d failed: %s" % (r, x.failure_exception()),
                          file=sys.stderr)
                    return 1
                if st == KVPoll.Success:
                    del left[r]
            time.sleep(0.0002)
        secs = time.monotonic() - t0
        if left:
            print("decode: %d rooms not done after %.0f s" % (len(left), o.timeout),
                  file=sys.stderr)
            return 1
        bad = 0
        for r, (x, dst) in rx.items():
            for b in range(2):
                view = kv[b].view(o.pages, o.seg)
                want = pattern(r, b, list(range(len(dst))), o.seg, view.device)
                if not torch.equal(view[dst], want):
                    bad += 1
            x.close()
        nbytes = 2 * o.rooms * len(rx[0][1]) * o.seg
        print(json.dumps({"mode": o.mode, "seg": o.seg, "bytes": nbytes, "s": secs,
                          "GBps": nbytes / secs / 1e9, "bad_rooms": bad,
                          "transport": transport}), flush=True)
        return 0 if bad == 0 else 1


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("role", choices=["prefill", "decode"])
    ap.add_argument("--mode", default="ipc", choices=["ipc", "staged", "gpu2host",
                                                      "host2gpu", "host"])
    ap.add_argument("--seg", type=int, default=65536, help="bytes per page (segment)")
    ap.add_argument("--pages", type=int, default=4096)
    ap.add_argument("--rooms", type=int, default=4)
    ap.add_argument("--port-file")
    ap.add_argument("--bootstrap")
    ap.add_argument("--timeout", type=float, default=60.0)
    o = ap.parse_args()
    return prefill(o) if o.role == "prefill" else decode(o)


if __name__ == "__main__":
    sys.exit(main())
