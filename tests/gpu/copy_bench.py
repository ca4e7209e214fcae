"""The physical limits beside kvferry, in the same run (tests/gpu/run.sh):
cudaMemcpy device-to-device, device-to-host and host-to-device (pinned) of
the same bytes kvferry moves, as torch issues them (one cudaMemcpyAsync per
call), whole and in segments of `seg` bytes.  One JSON line per figure.

    copy_bench.py --bytes 268435456 --seg 65536
"""
import argparse
import json

import torch


def timed(fn, reps=5):
    fn()
    torch.cuda.synchronize()
    best = None
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        s = a.elapsed_time(b) / 1000.0
        best = s if best is None or s < best else best
    return best


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bytes", type=int, default=256 << 20)
    ap.add_argument("--seg", type=int, default=65536)
    o = ap.parse_args()
    n = o.bytes
    d0 = torch.empty(n, dtype=torch.uint8, device="cuda")
    d1 = torch.empty(n, dtype=torch.uint8, device="cuda")
    h = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    nseg = n // o.seg
    dv0, dv1, hv = (t[: nseg * o.seg].view(nseg, o.seg) for t in (d0, d1, h))
    # Every other segment, as a scattered room's pages are.
    idx = torch.arange(0, nseg, 2, device="cuda")
    figs = {
        "d2d": lambda: d1.copy_(d0, non_blocking=True),
        "d2h": lambda: h.copy_(d0, non_blocking=True),
        "h2d": lambda: d0.copy_(h, non_blocking=True),
        "d2d_gather_seg": lambda: dv1.index_copy_(0, idx, dv0.index_select(0, idx)),
    }
    for name, fn in figs.items():
        s = timed(fn)
        moved = n if "seg" not in name else (nseg // 2) * o.seg
        print(json.dumps({"copy": name, "seg": o.seg, "bytes": moved, "s": s,
                          "GBps": moved / s / 1e9}), flush=True)


if __name__ == "__main__":
    main()
