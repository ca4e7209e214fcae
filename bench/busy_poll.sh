#!/usr/bin/env bash
# Busy polling (kvf_engine_params_t.busy_poll_us, KVF_BUSY_POLL_US) off and
# on, measured in one run: every case with B = 0 and B = BUSY_US in turn
# each round, beside its baseline of the same round, medians of REPEATS
# rounds (docs/BENCHMARKS.md, "Busy polling"):
#   calls       kvferry bench --call-latency --rooms 1000, under 64 small
#               rooms in flight and under two 1 GiB rooms: each call's p50,
#               and its p99 and p99.9 as a multiple of the null call's
#   room4k      one 4 KiB room at a time, the ranks polling (--spin): the
#               last send -> decode SUCCESS p50, beside sockperf's 4 KiB hop
#   throughput  tcp and shm llama3-8b contiguous, small tcp rooms (64 in
#               flight), beside iperf3 (one stream, 5 s); tcp once more with
#               busy polling on the decode engines alone
#
# Usage: make build && bash bench/busy_poll.sh     (about 3 minutes a round, 127.0.0.1 only)
#   REPEATS=5 BUSY_US=100 KVFERRY=build/kvferry bash bench/busy_poll.sh
set -euo pipefail

cd "$(dirname "$0")/.."
KVFERRY=${KVFERRY:-build/kvferry}
REPEATS=${REPEATS:-3}
BUSY_US=${BUSY_US:-200}
. bench/lib.sh
[ -x "$KVFERRY" ] || { echo "busy_poll.sh: $KVFERRY not found; run 'make build' first" >&2; exit 1; }
for tool in sockperf iperf3 python3; do need "$tool" "run 'make deps'"; done

LLAMA=(--model llama3-8b --page-size 64 --tokens 8192 --pattern contiguous --concurrency 2)
for i in $(seq "$REPEATS"); do
    note "round $i/$REPEATS"
    sockperf_pp "$i" 4096 sockperf
    port=$(free_port)
    iperf3 -s -p "$port" >/dev/null 2>&1 &     # the probe's connection is not a test
    PIDS+=($!)
    server_up "$port"
    iperf3 -c 127.0.0.1 -p "$port" -t 5 -J > "$TMP/iperf3.$i.json"
    kill "${PIDS[-1]}"; wait "${PIDS[-1]}" 2>/dev/null || true
    for b in 0 "$BUSY_US"; do
        export KVF_BUSY_POLL_US=$b
        "$KVFERRY" bench --call-latency --rooms 1000 --load-rooms 64 --transport tcp \
            > "$TMP/calls64.$b.$i.json" 2>/dev/null
        "$KVFERRY" bench --call-latency --rooms 1000 --load-mib 1024 --transport tcp \
            > "$TMP/calls1g.$b.$i.json" 2>/dev/null
        "$KVFERRY" bench --json --transport tcp --model tiny --tokens 16 --page-size 16 \
            --concurrency 1 --requests 2000 --spin > "$TMP/room4k.$b.$i.json" 2>/dev/null
        "$KVFERRY" bench --json --transport tcp "${LLAMA[@]}" --requests 12 \
            > "$TMP/tcp.$b.$i.json" 2>/dev/null
        "$KVFERRY" bench --json --transport shm "${LLAMA[@]}" --requests 64 \
            > "$TMP/shm.$b.$i.json" 2>/dev/null
        "$KVFERRY" bench --json --transport tcp --model tiny --tokens 16 --page-size 16 \
            --concurrency 64 --requests 30000 > "$TMP/small.$b.$i.json" 2>/dev/null
    done
    unset KVF_BUSY_POLL_US
    "$KVFERRY" bench --json --transport tcp "${LLAMA[@]}" --requests 12 --busy-poll 0 \
        --decode-busy-poll "$BUSY_US" > "$TMP/tcp.decode.$i.json" 2>/dev/null
done

python3 - "$TMP" "$REPEATS" "$BUSY_US" "$(git rev-parse --short HEAD 2>/dev/null || echo unknown)" <<'PY'
import json, os, statistics, sys
tmp, reps, busy, commit = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
R = range(1, reps + 1)
med = statistics.median
load = lambda n: json.load(open(os.path.join(tmp, n)))
cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
print(f"machine: {os.cpu_count()} CPUs, {cpu}; commit {commit}; medians of {reps} rounds; "
      f"busy polling 0 and {busy} us")
calls = ("receiver_create", "receiver_init", "sender_create", "sender_init", "sender_send",
         "poll", "receiver_failure", "sender_metric", "sender_destroy", "receiver_destroy",
         "sender_abort", "receiver_abort", "sender_create_held", "receiver_create_remote",
         "sender_prefix_len")
for case, what in (("calls64", "64 rooms in flight"), ("calls1g", "two 1 GiB rooms")):
    print(f"\ncalls under {what}: p50 us / p99 / p99.9 as a multiple of the null call's")
    for b in (0, busy):
        d = [load(f"{case}.{b}.{i}.json") for i in R]
        assert all(x["busy_poll_us"] == b for x in d), "the engines did not take KVF_BUSY_POLL_US"
        print(f"  busy {b:>6} us: worst p99 {min(x['worst_p99_vs_null'] for x in d):.0f}-"
              f"{max(x['worst_p99_vs_null'] for x in d):.0f}x, worst p99.9 "
              f"{min(x['worst_p999_vs_null'] for x in d):.0f}-"
              f"{max(x['worst_p999_vs_null'] for x in d):.0f}x")
        for c in calls:
            p50 = med(x["load"][c]["p50_ms"] * 1e3 for x in d)
            r99 = med(x["load_vs_null"][c]["p99"] for x in d)
            r999 = med(x["load_vs_null"][c]["p999"] for x in d)
            print(f"    {c:<22} {p50:5.1f} / {r99:4.0f}x / {r999:4.0f}x")
hop = [float(open(f"{tmp}/sockperf.{i}.txt").read().split("percentile 50.000 =")[1].split()[0])
       for i in R]
print(f"\none 4 KiB room, --spin: last send -> SUCCESS p50, sockperf 4 KiB hop {med(hop):.1f} us")
for b in (0, busy):
    v = [load(f"room4k.{b}.{i}.json")["p50_ms"] * 1e3 for i in R]
    print(f"  busy {b:>6} us: {med(v):.1f} us ({min(v):.1f}-{max(v):.1f}) = "
          f"{med(v) / med(hop):.2f}x the hop")
ip = []
for i in R:
    e = load(f"iperf3.{i}.json")["end"]["sum_received"]
    ip.append(e["bytes"] / e["seconds"] / 1e9)
print(f"\nthroughput (iperf3 {med(ip):.2f} GB/s, {min(ip):.2f}-{max(ip):.2f})")
for case, what in (("tcp", "tcp llama3-8b contiguous"), ("shm", "shm llama3-8b contiguous"),
                   ("small", "tcp tiny, 64 in flight")):
    for b in (0, busy) + (("decode",) if case == "tcp" else ()):
        d = [load(f"{case}.{b}.{i}.json") for i in R]
        bad = [x for x in d if not x.get("ok") or x.get("failed")]
        if case == "small":
            v = [x["rooms_per_s"] for x in d]
            fig = f"{med(v):,.0f} rooms/s ({min(v):,.0f}-{max(v):,.0f})"
        else:
            v = [x["gbps"] for x in d]
            fig = f"{med(v):.2f} GB/s ({min(v):.2f}-{max(v):.2f})"
        how = f"{b:>6} us" if b != "decode" else f"{busy} us, decode engines only"
        print(f"  {what:<26} busy {how}: {fig}, "
              f"{med(x['cpu_s_per_gb'] for x in d):.3f} CPU s/GB"
              + (f"; {len(bad)} runs with failed rooms" if bad else ""))
PY
