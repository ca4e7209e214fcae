#!/usr/bin/env bash
# kvferry against the physical limits of this host, measured in one run:
# every performance target of issues 4, 5, 6 and 11 as a ratio of a baseline
# measured in the same run, medians of REPEATS rounds.
#
# One round runs every case once, baselines and kvferry interleaved, so a
# disturbance of this (shared, noisy) host lands on both sides of a ratio:
#   baselines  memcpy 1 GiB single-threaded (`kvferry bench --memcpy`);
#              iperf3 one TCP stream over loopback (GB/s and CPU s/GB);
#              ucx_perftest ucp_get and ucp_put_bw, UCX_TLS=tcp, -e, 4 MiB
#   issue 6    TCP llama3-8b contiguous page 64 / scattered page 1; small
#              rooms (tiny, 64 in flight); 10,000 rooms in flight
#   issue 4    qwen2.5-7b prefill TP 1 -> decode TP 2 vs TP 1 -> 1 (tcp, shm),
#              and TP 1 -> 2 with head-major pages (--kv-order hnd, issue 15)
#   issue 5    shm contiguous vs memcpy (and with two copier threads);
#              ucx (UCX_TLS=tcp) vs ucp_get
#   issue 11   the same targets tightened, plus every application call's
#              latency idle and while 1 GiB rooms stream (--call-latency);
#              TCP contiguous over --streams N vs iperf3 -P N (N = STREAMS)
# then (PROFILE=1, the default when perf works) a short perf profile of the
# rank processes of a TCP and a shm contiguous run.
#
# Usage: make build && bash bench/baselines.sh     (about 5 minutes, 127.0.0.1 only)
#   REPEATS=5 PROFILE=0 KVFERRY=build/kvferry OUT=/tmp/bench.json bash bench/baselines.sh
#   ONLY=streams bash bench/baselines.sh   (just the N-stream case and its iperf3 -P N)
#   ONLY=relay bash bench/baselines.sh     (just the failure relay, TP 2->2 and 4->4)
#   ONLY=room4k bash bench/baselines.sh    (just one 4 KiB room at a time, beside sockperf)
#   ONLY=layerwise bash bench/baselines.sh (just layer-wise against whole-chunk sends)
# Installs nothing: `make deps` installs iperf3, python3 and ucx-utils.
set -euo pipefail

cd "$(dirname "$0")/.."
KVFERRY=${KVFERRY:-build/kvferry}
REPEATS=${REPEATS:-3}
IPERF_SECONDS=${IPERF_SECONDS:-5}
UCX_MSG=${UCX_MSG:-4194304}    # kvferry's get size: segments are at most 4 MiB
PROFILE=${PROFILE:-1}
STREAMS=${STREAMS:-2}          # the N of --streams N and iperf3 -P N
ONLY=${ONLY:-}                 # "streams", "relay", "room4k" or "layerwise": that case alone
OUT=${OUT:-}
. bench/lib.sh
[ -x "$KVFERRY" ] || { echo "baselines.sh: $KVFERRY not found; run 'make build' first" >&2; exit 1; }
need python3 "run 'make deps' (installs python3, iperf3 and ucx-utils)"
need iperf3 "run 'make deps' (installs python3, iperf3 and ucx-utils)"
need sockperf "run 'make deps' (installs sockperf)"

python3 - "$TMP/machine.json" "$(git rev-parse HEAD 2>/dev/null || echo unknown)" \
    "$(git status --porcelain -- src include 2>/dev/null | wc -l)" <<'PY'
import json, os, platform, sys
model = "unknown"
for line in open("/proc/cpuinfo"):
    if line.startswith("model name"):
        model = line.split(":", 1)[1].strip(); break
mem = int(open("/proc/meminfo").readline().split()[1]) // 1048576
json.dump({"nproc": os.cpu_count(), "cpu": model, "kernel": platform.release(),
           "mem_gib": mem, "commit": sys.argv[2], "engine_dirty_files": int(sys.argv[3])},
          open(sys.argv[1], "w"))
PY

UCX=0
if command -v ucx_perftest >/dev/null; then UCX=1; else
    note "ucx_perftest not found (Debian package ucx-utils): UCX cases skipped"
fi

iperf() {   # round [parallel streams]
    local port; port=$(free_port)
    local par=${2:-1} out="$TMP/iperf3.$1.json"
    [ "$par" = 1 ] || out="$TMP/iperf3p.$1.json"
    iperf3 -s -1 -B 127.0.0.1 -p "$port" >/dev/null 2>&1 &
    PIDS+=($!)
    sleep 0.5   # until it listens (a probe connection would be its one test)
    iperf3 -c 127.0.0.1 -p "$port" -t "$IPERF_SECONDS" -P "$par" -J > "$out"
    wait "${PIDS[-1]}" 2>/dev/null || true
}
perftest() {   # test, round.  -e: endpoints with peer error handling, as kvferry's
    local port; port=$(free_port)
    UCX_TLS=tcp timeout 60 ucx_perftest -p "$port" -e >/dev/null 2>&1 &
    PIDS+=($!)
    sleep 0.5
    UCX_TLS=tcp timeout 60 ucx_perftest 127.0.0.1 -p "$port" -e -t "$1" -s "$UCX_MSG" \
        -n 100 -w 5 > "$TMP/ucx.$1.$2.txt" 2>&1 || true
    wait "${PIDS[-1]}" 2>/dev/null || true
}
kvf() {   # name, round, kvferry bench options
    local name=$1 i=$2; shift 2
    note "kvferry bench $name ($i/$REPEATS): $*"
    "$KVFERRY" bench --json "$@" > "$TMP/kvf.$name.$i.json" 2> "$TMP/kvf.$name.$i.err" ||
        note "  $name: exit status $? (rooms failed; see the report)"
}

LLAMA=(--model llama3-8b --page-size 64 --tokens 8192)
QWEN=(--model qwen2.5-7b --page-size 64 --tokens 8192 --concurrency 2 --requests 16)
relay() {   # round: prefill rank 0 aborts each room after its first chunk; every
            # rank of the room (its pair's and the others') times its FAILED;
            # beside it, one hop of a 64-byte message (sockperf)
    note "sockperf ping-pong, TCP, 64 B, 5 s ($1/$REPEATS)"
    sockperf_pp "$1"
    for tp in 2 4; do
        kvf "relay$tp" "$1" --relay --transport tcp --model tiny --tokens 64 --page-size 16 \
            --prefill-tp "$tp" --decode-tp "$tp" --requests 2000 --concurrency 8
    done
}
room4k() {   # round: one 4 KiB room at a time, the last send to the decode's
             # SUCCESS, beside one hop of a 4 KiB message; the ranks poll
             # without sleeping (--spin), then with the engines busy polling
             # too, then with the bench's back-off, whose sleeps the room
             # waits out
    note "sockperf ping-pong, TCP, 4 KiB, 5 s ($1/$REPEATS)"
    sockperf_pp "$1" 4096 sockperf4k
    kvf room4k "$1" --transport tcp --model tiny --tokens 16 --page-size 16 --concurrency 1 \
        --requests 2000 --spin --busy-poll 0
    kvf room4k_busy "$1" --transport tcp --model tiny --tokens 16 --page-size 16 \
        --concurrency 1 --requests 2000 --spin --busy-poll 200
    kvf room4k_backoff "$1" --transport tcp --model tiny --tokens 16 --page-size 16 \
        --concurrency 1 --requests 2000 --busy-poll 0
}
layerwise() {   # round: each layer sent as its emulated compute ends, against the
                # chunk sent once its last layer is computed (kvferry bench --layerwise)
    note "kvferry bench --layerwise --repeats 5 ($1/$REPEATS)"
    "$KVFERRY" bench --layerwise --json --repeats 5 --transport tcp \
        > "$TMP/kvf.layerwise.$1.json" || note "  layerwise: exit status $?"
}
for i in $(seq "$REPEATS"); do
    if [ "$ONLY" = relay ]; then relay "$i"; continue; fi
    if [ "$ONLY" = layerwise ]; then layerwise "$i"; continue; fi
    if [ "$ONLY" = room4k ]; then room4k "$i"; continue; fi
    # issue 11: N streams per pair against N iperf3 streams, side by side
    note "round $i/$REPEATS: iperf3 -P $STREAMS ${IPERF_SECONDS}s, kvferry --streams $STREAMS"
    iperf "$i" "$STREAMS"
    kvf streams "$i" --transport tcp "${LLAMA[@]}" --pattern contiguous --concurrency 2 \
        --requests 12 --streams "$STREAMS"
    [ "$ONLY" = streams ] && continue
    note "round $i/$REPEATS: memcpy 1 GiB (median of 5), iperf3 ${IPERF_SECONDS}s"
    "$KVFERRY" bench --memcpy --mib 1024 --repeats 5 > "$TMP/memcpy.$i.json"
    iperf "$i"
    # issue 6: TCP
    kvf contiguous "$i" --transport tcp "${LLAMA[@]}" --pattern contiguous --concurrency 2 --requests 12
    kvf scattered "$i" --transport tcp "${LLAMA[@]}" --pattern scattered --page-size 1 \
        --concurrency 2 --requests 6
    kvf small "$i" --transport tcp --model tiny --tokens 16 --page-size 16 --concurrency 64 \
        --requests 30000
    room4k "$i"
    note "kvferry bench --rooms-in-flight 10000 ($i/$REPEATS)"
    "$KVFERRY" bench --rooms-in-flight 10000 --transport tcp > "$TMP/kvf.inflight.$i.json"
    # issue 11: application call latency, idle and while 1 GiB rooms stream
    note "kvferry bench --call-latency --rooms 1000 --load-mib 1024 ($i/$REPEATS)"
    "$KVFERRY" bench --call-latency --rooms 1000 --load-mib 1024 --transport tcp \
        > "$TMP/kvf.calls.$i.json" || note "  call-latency: exit status $?"
    # ... and while 64 one-page rooms are in flight
    note "kvferry bench --call-latency --rooms 1000 --load-rooms 64 ($i/$REPEATS)"
    "$KVFERRY" bench --call-latency --rooms 1000 --load-rooms 64 --transport tcp \
        > "$TMP/kvf.calls64.$i.json" || note "  call-latency (64 rooms): exit status $?"
    # issue 4: TP-sliced vs equal TP, same model and bytes
    for t in tcp shm; do
        kvf "tp11_$t" "$i" --transport "$t" "${QWEN[@]}" --prefill-tp 1 --decode-tp 1
        kvf "tp12_$t" "$i" --transport "$t" "${QWEN[@]}" --prefill-tp 1 --decode-tp 2
        kvf "tp12h_$t" "$i" --transport "$t" "${QWEN[@]}" --prefill-tp 1 --decode-tp 2 \
            --kv-order hnd
    done
    # siblings: how fast one rank's failure reaches every rank of the room
    relay "$i"
    # issue 5: shm vs memcpy; ucx vs ucx_perftest (UCX_TLS=tcp: see docs/BENCHMARKS.md)
    kvf shm "$i" --transport shm "${LLAMA[@]}" --pattern contiguous --concurrency 4 --requests 16
    # the same with two copier threads (the default is one per two CPUs)
    KVF_SHM_COPIERS=2 kvf shm2 "$i" --transport shm "${LLAMA[@]}" --pattern contiguous \
        --concurrency 4 --requests 16
    if [ "$UCX" = 1 ]; then
        note "ucx_perftest ucp_get / ucp_put_bw, UCX_TLS=tcp -e -s $UCX_MSG ($i/$REPEATS)"
        perftest ucp_get "$i"
        perftest ucp_put_bw "$i"
        # One room in flight, as ucx_perftest runs one stream of gets.  UCX's
        # tcp moves reads in software: offered only when allowed.
        UCX_TLS=tcp KVF_UCX_SOFTWARE_RMA=allow kvf ucx "$i" --transport ucx "${LLAMA[@]}" --pattern contiguous \
            --concurrency 1 --requests 4
    fi
done

# --- profile ---------------------------------------------------------------
profile() {   # name, seconds to wait (pool population, first rooms), kvferry bench options
    local name=$1 warm=$2; shift 2
    # Its own session: nothing it signals can reach this script.
    setsid "$KVFERRY" bench --json "$@" > /dev/null 2>&1 &
    local b=$! pre="" dec=""
    PIDS+=($b)
    for _ in $(seq 100); do
        pre=$(pgrep -P "$b" -f -- "--role prefill" || true)
        dec=$(pgrep -P "$b" -f -- "--role decode" || true)
        [ -n "$pre" ] && [ -n "$dec" ] && break
        sleep 0.1
    done
    sleep "$warm"   # past registration and the pools' first touch
    note "perf record -g, 3 s, on $name prefill ($pre) and decode ($dec)"
    perf record -q -g -p "$pre" -o "$TMP/perf.$name.prefill" -- sleep 3 >/dev/null 2>&1 &
    perf record -q -g -p "$dec" -o "$TMP/perf.$name.decode" -- sleep 3 >/dev/null 2>&1
    wait $! 2>/dev/null || true
    wait "$b" 2>/dev/null || true
    for side in prefill decode; do
        echo "--- $name, $side: perf report --no-children --sort dso,sym (top 8)"
        perf report -q -i "$TMP/perf.$name.$side" --no-children --sort dso,sym -g none \
            --percent-limit 1 2>/dev/null | sed '/^$/d' | head -8
    done > "$TMP/profile.$name.txt"
}
if [ -n "$ONLY" ]; then
    :
elif [ "$PROFILE" = 1 ] && command -v perf >/dev/null &&
   perf record -q -o /dev/null -- true >/dev/null 2>&1; then
    # A profile that goes wrong must not cost the figures: report without it.
    ( profile tcp 2 --transport tcp "${LLAMA[@]}" --pattern contiguous --concurrency 2 --requests 16 ) ||
        note "tcp profile failed; the figures stand without it"
    ( profile shm 4 --transport shm "${LLAMA[@]}" --pattern contiguous --concurrency 2 --requests 64 ) ||
        note "shm profile failed; the figures stand without it"
elif [ "$PROFILE" = 1 ]; then
    note "perf missing or not permitted (kernel.perf_event_paranoid): profile skipped"
fi

# --- report ----------------------------------------------------------------
python3 - "$TMP" "$REPEATS" "$UCX" "$OUT" "$UCX_MSG" "$STREAMS" "$ONLY" <<'PY'
import glob, json, os, statistics, sys
tmp, reps, ucx, out, ucx_msg = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1", sys.argv[4], int(sys.argv[5])
nstreams, only = int(sys.argv[6]), sys.argv[7]
med = statistics.median
load = lambda p: json.load(open(p))
machine = load(f"{tmp}/machine.json")
R = range(1, reps + 1)
fig = {}      # name -> list per round (None when missing)
problems = []

def put(name, vals):
    fig[name] = vals

def iperf3(name):
    g, c = [], []
    for i in R:
        e = load(f"{tmp}/{name}.{i}.json")["end"]
        r = e["sum_received"]; u = e["cpu_utilization_percent"]
        # client (host) + server (remote) CPU, percent of one CPU over the run
        g.append(r["bytes"] / r["seconds"] / 1e9)
        c.append((u["host_total"] + u["remote_total"]) / 100.0 * r["seconds"] / (r["bytes"] / 1e9))
    return g, c
def sockperf(name="sockperf"):
    """One hop: sockperf ping-pong's median latency (half the round trip), ms."""
    v = []
    for i in R:
        try:
            txt = open(f"{tmp}/{name}.{i}.txt").read()
            v.append(float(txt.split("percentile 50.000 =")[1].split()[0]) / 1000.0)
        except (OSError, IndexError, ValueError):
            problems.append(f"{name} round {i}: no figure")
            v.append(None)
    put(f"{name}_p50", v)

def relay(name):
    """kvferry bench --relay runs: every room must have reached every rank."""
    v = []
    for i in R:
        try: d = load(f"{tmp}/kvf.{name}.{i}.json")
        except Exception: d = None
        if d is None or not d.get("ok") or d.get("relayed") != d.get("rooms"):
            problems.append(f"{name} round {i}: " + ("no result" if d is None else
                            f"{d.get('relayed')} of {d.get('rooms')} rooms relayed"))
        if d and d.get("config", {}).get("transport") != "tcp":
            problems.append(f"{name} round {i}: transport {d.get('config', {}).get('transport')}")
        v.append(d)
    runs[name] = v
    for k in ("p50", "p99", "max"):
        put(f"{name}_{k}", [d[f"relay_{k}_ms"] if d else None for d in v])
    return v

runs = {}
def only_done():
    """The end of a run of one case (ONLY=...): its problems, its JSON."""
    for p in problems:
        print("problem: " + p)
    if out:
        json.dump({"machine": machine, "figures": fig, "runs": runs, "problems": problems},
                  open(out, "w"), indent=1)
    sys.exit(1 if problems else 0)

if only == "relay":   # that case alone: its rows
    sockperf()
    for tp in (2, 4):
        relay(f"relay{tp}")
    rv = lambda k: [x for x in fig.get(k, []) if x is not None]
    print(f"machine: {machine['nproc']} CPUs, {machine['cpu']}, Linux {machine['kernel']}; "
          f"commit {machine['commit'][:12]}; medians of {reps} rounds")
    hop = rv("sockperf_p50")
    if hop:
        print(f"one hop (sockperf ping-pong, TCP, 64 B): p50 {statistics.median(hop) * 1000:.1f} us "
              f"({min(hop) * 1000:.1f}-{max(hop) * 1000:.1f})")
    for tp in (2, 4):
        p50, p99, mx = (rv(f"relay{tp}_{k}") for k in ("p50", "p99", "max"))
        ratio = [a / b for a, b in zip(fig[f"relay{tp}_p50"], fig["sockperf_p50"])
                 if a is not None and b]
        if p99:
            print(f"siblings relay TP {tp}->{tp} (abort -> the last rank's FAILED, 2,000 rooms): "
                  f"p50 {statistics.median(p50):.3f} ms"
                  + (f" = {statistics.median(ratio):.1f}x one hop ({min(ratio):.1f}-{max(ratio):.1f})"
                     if ratio else "") +
                  f", p99 {statistics.median(p99):.3f} ms "
                  f"({min(p99):.3f}-{max(p99):.3f}), max {statistics.median(mx):.3f} ms; "
                  f"goal p99 < 100 ms: {'met' if statistics.median(p99) < 100 else 'MISSED'}")
    only_done()
def layerwise():
    """kvferry bench --layerwise runs: each a ratio of two modes in one run."""
    v = []
    for i in R:
        try: d = load(f"{tmp}/kvf.layerwise.{i}.json")
        except Exception: d = None
        if d is None:
            problems.append(f"layerwise round {i}: no result")
        elif d.get("transport") != "tcp":
            problems.append(f"layerwise round {i}: transport {d.get('transport')}")
        v.append(d)
    runs["layerwise"] = v
    for k in ("tail_ratio", "throughput_ratio"):
        put(f"layerwise_{k}", [d[k] if d else None for d in v])
    return [d for d in v if d]
if only == "layerwise":   # that case alone: its rows
    got = layerwise()
    print(f"machine: {machine['nproc']} CPUs, {machine['cpu']}, Linux {machine['kernel']}; "
          f"commit {machine['commit'][:12]}; medians of {reps} rounds of 5 repeats")
    if got:
        tr, th = (sorted(d[k] for d in got) for k in ("tail_ratio", "throughput_ratio"))
        tail = {m: med(d[m]["tail_ms"]["p50"] for d in got) for m in ("whole", "layerwise")}
        print(f"layer-wise sends ({got[0]['model']}, {got[0]['tokens']} tokens, tcp, "
              f"{got[0]['compute_ms']:.0f} ms of emulated compute): last layer -> SUCCESS "
              f"{tail['layerwise']:.2f} ms against {tail['whole']:.2f} ms sent whole = "
              f"{med(tr):.3f}x ({tr[0]:.3f}-{tr[-1]:.3f}); goal <= 0.15x: "
              f"{'met' if med(tr) <= 0.15 else 'MISSED'}")
        print(f"throughput without compute, layer-wise / whole: {med(th):.3f}x "
              f"({th[0]:.3f}-{th[-1]:.3f})")
    only_done()
if only != "room4k":
    put("iperf3_p", iperf3("iperf3p")[0])
if not only:
    put("memcpy", [load(f"{tmp}/memcpy.{i}.json")["memcpy_gbps"] for i in R])
    ipg, ipc = iperf3("iperf3")
    put("iperf3", ipg); put("iperf3_cpu", ipc)

def perftest(t):
    v = []
    for i in R:
        x = None
        p = f"{tmp}/ucx.{t}.{i}.txt"
        for line in open(p) if os.path.exists(p) else []:
            if line.startswith("Final:"):   # overall bandwidth, MB/s with MB = 2^20
                x = float(line.split()[6]) * 1048576 / 1e9
        if x is None: problems.append(f"ucx_perftest {t} round {i}: no result")
        v.append(x)
    return v
if ucx and not only:
    put("ucp_get", perftest("ucp_get")); put("ucp_put_bw", perftest("ucp_put_bw"))

def kvf(name, transport=None):
    v = []
    for i in R:
        p = f"{tmp}/kvf.{name}.{i}.json"
        try: d = load(p)
        except Exception: d = None
        if d is None:
            problems.append(f"{name} round {i}: no result"); v.append(None); continue
        if d.get("failed", 1) or not d.get("ok", True):
            problems.append(f"{name} round {i}: {d.get('failed')} of {d.get('rooms')} rooms failed"
                            + (f" ({d['failures'][0]['reason'][:90]})" if d.get("failures") else ""))
        got = d.get("config", {}).get("transport")
        if transport and got != transport:
            problems.append(f"{name} round {i}: transport {got}, not {transport}")
        v.append(d)
    runs[name] = v
    return v
def col(name, f, transport=None):
    return [f(d) if d else None for d in kvf(name, transport)]

def room4k():
    put("room4k_p50", [d["p50_ms"] if d else None for d in kvf("room4k", "tcp")])
    put("room4k_busy_p50", [d["p50_ms"] if d else None for d in kvf("room4k_busy", "tcp")])
    put("room4k_backoff_p50", [d["p50_ms"] if d else None for d in kvf("room4k_backoff", "tcp")])
    sockperf("sockperf4k")
    for d in runs["room4k"]:
        if d and not d.get("config", {}).get("spin"):
            problems.append("room4k: ran without --spin")
if only == "room4k":   # that case alone: its rows
    room4k()
    print(f"machine: {machine['nproc']} CPUs, {machine['cpu']}, Linux {machine['kernel']}; "
          f"commit {machine['commit'][:12]}; medians of {reps} rounds")
    hop = [x for x in fig["sockperf4k_p50"] if x is not None]
    if hop:
        print(f"one hop of 4 KiB (sockperf ping-pong, TCP): p50 {med(hop) * 1000:.1f} us "
              f"({min(hop) * 1000:.1f}-{max(hop) * 1000:.1f})")
    for name, how in (("room4k", "polls spinning (--spin)"),
                      ("room4k_busy", "polls spinning, engines busy polling 200 us"),
                      ("room4k_backoff", "polls backing off")):
        ratio = [a / b for a, b in zip(fig[f"{name}_p50"], fig["sockperf4k_p50"])
                 if a is not None and b]
        v = [x for x in fig[f"{name}_p50"] if x is not None]
        if v and ratio:
            print(f"one 4 KiB room, {how}: last send -> SUCCESS p50 {med(v) * 1000:.1f} us "
                  f"({min(v) * 1000:.1f}-{max(v) * 1000:.1f}) = {med(ratio):.2f}x one hop "
                  f"({min(ratio):.2f}-{max(ratio):.2f})"
                  + (f"; goal <= 1.5x: {'met' if med(ratio) <= 1.5 else 'MISSED'}"
                     if name == "room4k" else ""))
    only_done()

put("streams", col("streams", lambda d: d["gbps"], "tcp"))
for d in runs["streams"]:
    if d and d.get("config", {}).get("streams") != nstreams:
        problems.append(f"streams: ran with --streams {d.get('config', {}).get('streams')}")
if only:   # that case alone: its row, and nothing of the cases that did not run
    pairs = [(x, y) for x, y in zip(fig["streams"], fig["iperf3_p"]) if x is not None and y]
    x, y = med(v for v, _ in pairs), med(v for _, v in pairs)
    rs = [a / b for a, b in pairs]
    print(f"machine: {machine['nproc']} CPUs, {machine['cpu']}, Linux {machine['kernel']}; "
          f"commit {machine['commit'][:12]}; medians of {reps} rounds")
    print(f"11 TCP contiguous --streams {nstreams} / iperf3 -P {nstreams}: kvferry {x:.4g} GB/s, "
          f"iperf3 {y:.4g} GB/s, ratio {x / y:.3f} (per round {min(rs):.2f}-{max(rs):.2f}), "
          f"goal >= 0.9x: {'met' if x / y >= 0.9 else 'MISSED'}")
    only_done()
put("contiguous", col("contiguous", lambda d: d["gbps"], "tcp"))
put("contiguous_cpu", [d["cpu_s_per_gb"] if d else None for d in runs["contiguous"]])
put("scattered", col("scattered", lambda d: d["gbps"], "tcp"))
put("small_rps", col("small", lambda d: d["rooms_per_s"], "tcp"))
put("small_p99", [d["p99_ms"] if d else None for d in runs["small"]])
room4k()
infl = [load(f"{tmp}/kvf.inflight.{i}.json") for i in R]
put("inflight_bytes", [d["per_room_bytes"] for d in infl])
put("inflight_poll", [d["poll_pass_ms"] for d in infl])
def call_runs(name, what):
    """--call-latency results of every round that has one."""
    v = []
    for i in R:
        try:
            v.append(load(f"{tmp}/kvf.{name}.{i}.json"))
        except (OSError, ValueError):
            problems.append(f"round {i}: no call-latency result{what}")
    return v
calls = call_runs("calls", "")
put("calls_ratio", [d["worst_p99_ratio"] for d in calls])
put("calls_max", [d["worst_max_ms_under_load"] for d in calls])
put("calls_null99", [d["worst_p99_vs_null"] for d in calls])
put("calls_null999", [d["worst_p999_vs_null"] for d in calls])
calls64 = call_runs("calls64", " with 64 rooms in flight")
put("calls64_null99", [d["worst_p99_vs_null"] for d in calls64])
put("calls64_null999", [d["worst_p999_vs_null"] for d in calls64])
for t in ("tcp", "shm"):
    put(f"tp11_{t}", col(f"tp11_{t}", lambda d: d["gbps"], t))
    put(f"tp12_{t}", col(f"tp12_{t}", lambda d: d["gbps"], t))
    put(f"tp12h_{t}", col(f"tp12h_{t}", lambda d: d["gbps"], t))
put("shm", col("shm", lambda d: d["gbps"], "shm"))
put("shm2", col("shm2", lambda d: d["gbps"], "shm"))
if ucx:
    put("ucx", col("ucx", lambda d: d["gbps"], "ucx"))

def m(name):
    v = [x for x in fig.get(name, []) if x is not None]
    return med(v) if v else None
def spread(name):
    v = [x for x in fig.get(name, []) if x is not None]
    return f"{min(v):.4g}-{max(v):.4g}" if v else "-"
def paired(a, b):   # per-round ratios: the spread of the ratio itself
    v = [x / y for x, y in zip(fig.get(a, []), fig.get(b, [])) if x is not None and y]
    return f"{min(v):.2f}-{max(v):.2f}" if v else "-"

rows = []   # issue, target, kvferry, baseline, ratio, goal, met, spread
def ratio_row(issue, what, a, b, goal, lo=None, hi=None):
    x, y = m(a), m(b)
    if x is None or y is None:
        rows.append((issue, what, x, y, None, goal, None, "-")); return
    r = x / y
    ok = (lo is None or r >= lo) and (hi is None or r <= hi)
    rows.append((issue, what, x, y, r, goal, ok, paired(a, b)))
def abs_row(issue, what, a, limit, goal, below):
    x = m(a)
    ok = None if x is None else (x < limit if below == "<" else x <= limit if below == "<=" else x >= limit)
    rows.append((issue, what, x, limit, None if x is None else x / limit, goal, ok, spread(a)))

ratio_row(6, "TCP llama3-8b contiguous p64: GB/s / iperf3", "contiguous", "iperf3", ">= 0.9x", lo=0.9)
ratio_row(11, "TCP scattered p1: GB/s / contiguous", "scattered", "contiguous", ">= 0.7x", lo=0.7)
ratio_row(11, f"TCP contiguous --streams {nstreams} / iperf3 -P {nstreams}", "streams", "iperf3_p",
          ">= 0.9x", lo=0.9)
abs_row(11, "small rooms (tiny, 64 in flight): rooms/s", "small_rps", 40000, ">= 40000", ">=")
abs_row(11, "small rooms: p99 ms", "small_p99", 2.0, "< 2 ms", "<")
abs_row(6, "10k in flight: bytes per room (worse side)", "inflight_bytes", 2048, "<= 2048 B", "<=")
abs_row(6, "10k in flight: one poll pass, ms", "inflight_poll", 1.0, "< 1 ms", "<")
ratio_row(6, "CPU s/GB both sides (contiguous) / iperf3", "contiguous_cpu", "iperf3_cpu", "<= 1.2x", hi=1.2)
ratio_row(11, "qwen2.5-7b TP 1->2 / TP 1->1, tcp", "tp12_tcp", "tp11_tcp", ">= 0.6x", lo=0.6)
ratio_row(11, "qwen2.5-7b TP 1->2 / TP 1->1, shm", "tp12_shm", "tp11_shm", ">= 0.6x", lo=0.6)
ratio_row(15, "qwen2.5-7b TP 1->2 HND / TP 1->1, tcp", "tp12h_tcp", "tp11_tcp", "(HND pages)")
ratio_row(15, "qwen2.5-7b TP 1->2 HND / TP 1->1, shm", "tp12h_shm", "tp11_shm", "(HND pages)")
sockperf(); relay("relay2"); relay("relay4")
abs_row("S", "siblings relay TP 2->2: p99 ms, abort -> last rank", "relay2_p99", 100, "< 100 ms", "<")
abs_row("S", "siblings relay TP 4->4: p99 ms, abort -> last rank", "relay4_p99", 100, "< 100 ms", "<")
abs_row(11, "calls under load: worst p99 / idle p99", "calls_ratio", 3.0, "<= 3x", "<=")
abs_row(11, "calls under load: worst max, ms", "calls_max", 1.0, "<= 1 ms", "<=")
abs_row(23, "calls under load: worst p99 / null call p99", "calls_null99", 2.0, "<= 2x", "<=")
abs_row(23, "calls under load: worst p99.9 / null call p99.9", "calls_null999", 4.0, "<= 4x", "<=")
abs_row(23, "calls, 64 rooms in flight: worst p99 / null call p99", "calls64_null99", 2.0,
        "<= 2x", "<=")
abs_row(23, "calls, 64 rooms in flight: worst p99.9 / null call p99.9", "calls64_null999", 4.0,
        "<= 4x", "<=")
ratio_row(23, "one 4 KiB room: last send -> SUCCESS p50 / sockperf 4 KiB hop p50", "room4k_p50",
          "sockperf4k_p50", "<= 1.5x", hi=1.5)
ratio_row(23, "the same, engines busy polling 200 us / sockperf 4 KiB hop p50",
          "room4k_busy_p50", "sockperf4k_p50", "(busy_poll_us)")
ratio_row(23, "the same, polls backing off (no --spin) / sockperf 4 KiB hop p50",
          "room4k_backoff_p50", "sockperf4k_p50", "(the poll's sleeps)")
ratio_row(5, "shm contiguous (4 in flight) / memcpy", "shm", "memcpy", ">= 0.8x", lo=0.8)
ratio_row(11, "shm, 2 copier threads / memcpy", "shm2", "memcpy", "(2 cores)")
if ucx:
    ratio_row(5, "ucx (UCX_TLS=tcp) / ucx_perftest ucp_get", "ucx", "ucp_get", ">= 0.9x", lo=0.9)
    ratio_row(5, "ucx (UCX_TLS=tcp) / ucx_perftest ucp_put_bw", "ucx", "ucp_put_bw", "(issue's name)")

print()
print(f"machine: {machine['nproc']} CPUs, {machine['cpu']}, {machine['mem_gib']} GiB, "
      f"Linux {machine['kernel']}; commit {machine['commit'][:12]}"
      + (f" (+{machine['engine_dirty_files']} changed files in src/ include/)" if machine['engine_dirty_files'] else "")
      + f"; medians of {reps} rounds")
b = [f"memcpy {m('memcpy'):.2f} GB/s ({spread('memcpy')})",
     f"iperf3 {m('iperf3'):.3f} GB/s ({spread('iperf3')}) at {m('iperf3_cpu'):.3f} CPU s/GB",
     f"iperf3 -P {nstreams} {m('iperf3_p'):.3f} GB/s ({spread('iperf3_p')})"]
if ucx:
    b.append(f"ucp_get {m('ucp_get') or 0:.3f} GB/s ({spread('ucp_get')}), "
             f"ucp_put_bw {m('ucp_put_bw') or 0:.3f} GB/s ({spread('ucp_put_bw')}), "
             f"UCX_TLS=tcp -e, {ucx_msg >> 20} MiB")
print("baselines: " + "; ".join(b))
print()
fmt = lambda v: "-" if v is None else f"{v:.4g}"
print(f"{'#':2} {'target':46} {'kvferry':>9} {'baseline':>9} {'ratio':>6}  {'goal':14} {'verdict':7} spread")
for issue, what, x, y, r, goal, ok, sp in rows:
    verdict = "n/a" if ok is None else "met" if ok else "MISSED"
    if goal.startswith("("): verdict = "info"
    print(f"{issue:<2} {what:46} {fmt(x):>9} {fmt(y):>9} {fmt(r):>6}  {goal:14} {verdict:7} {sp}")
print("(spread: per-round ratio min-max for ratios, figure min-max otherwise)")
print()
def sd(name, side, k="cpu_s_per_gb"):
    v = [d[side][k] for d in runs.get(name, []) if d]
    return med(v) if v else 0
def key(name, k):
    v = [d[k] for d in runs.get(name, []) if d]
    return med(v) if v else 0
print("also (medians):")
for name in ["contiguous", "streams", "scattered", "small", "tp11_tcp", "tp12_tcp", "tp12h_tcp", "tp11_shm", "tp12_shm", "tp12h_shm", "shm", "shm2"] + (["ucx"] if ucx else []):
    if not runs.get(name): continue
    print(f"  {name:10} {key(name, 'gbps'):7.3f} GB/s ({spread(name) if name in fig else '-'}), "
          f"{key(name, 'rooms_per_s'):9.1f} rooms/s, p50 {key(name, 'p50_ms'):8.2f} ms, p99 {key(name, 'p99_ms'):8.2f} ms, "
          f"CPU s/GB {key(name, 'cpu_s_per_gb'):.3f} (prefill {sd(name, 'prefill'):.3f}, decode {sd(name, 'decode'):.3f}), "
          f"peak RSS {key(name, 'peak_rss_mb'):.0f} MB")
print(f"  shm / memcpy per round: {paired('shm', 'memcpy')}; contiguous / memcpy {m('contiguous') / m('memcpy'):.3f}")
print(f"  10k in flight, per side: " + ", ".join(f"{k} {med([d.get(k, 0) for d in infl]):.4g}"
      for k in sorted(infl[0]) if isinstance(infl[0][k], (int, float))))
for p in sorted(glob.glob(f"{tmp}/profile.*.txt")):
    print(); print(open(p).read().rstrip())
if problems:
    print(); print("problems:"); [print("  " + p) for p in problems]
if out:
    json.dump({"machine": machine, "figures": fig, "runs": runs, "inflight": infl,
               "problems": problems,
               "targets": [dict(zip(("issue", "target", "kvferry", "baseline", "ratio", "goal", "met", "spread"), r))
                           for r in rows]}, open(out, "w"), indent=1)
PY
