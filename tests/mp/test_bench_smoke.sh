#!/usr/bin/env bash
# kvferry bench, briefly: tiny model, a few rooms in separate processes,
# --json.  Checks the report's shape (every figure present and a number)
# and that no room failed; no timing assertion (benchmarks are not tests).
set -euo pipefail
KVFERRY=${KVFERRY:-build/kvferry}

check() {   # json, expected rooms
    python3 -c '
import json, numbers, sys
d = json.loads(sys.argv[1])
want = int(sys.argv[2])
for k in ("gbps", "rooms_per_s", "p50_ms", "p99_ms", "cpu_s_per_gb", "peak_rss_mb",
          "rooms", "failed", "bytes", "seconds"):
    assert isinstance(d.get(k), numbers.Number) and not isinstance(d[k], bool), (k, d.get(k))
for side in ("prefill", "decode"):
    for k in ("cpu_s", "cpu_s_per_gb", "peak_rss_mb", "kv_pool_mb"):
        assert isinstance(d[side][k], numbers.Number), (side, k, d[side])
assert d["failed"] == 0 and d["ok"] is True, d
assert (d["rooms"] == want) if want else d["rooms"] > 0, d["rooms"]
assert d["gbps"] > 0 and d["rooms_per_s"] > 0 and d["peak_rss_mb"] > 0, d
assert 0 <= d["p50_ms"] <= d["p99_ms"], d
assert len(d["ranks"]) == 2 and d["config"]["model"] == "tiny", d
print("ok: %d rooms, %.3f GB/s, p99 %.3f ms" % (d["rooms"], d["gbps"], d["p99_ms"]))
' "$1" "$2"
}

# A fixed count, scattered pages, chunked sends, decode verifying every byte.
out=$(timeout 120 "$KVFERRY" bench --json --model tiny --tokens 256 --page-size 16 \
      --chunk 64 --pattern scattered --requests 20 --concurrency 4 --verify --timeout 60)
check "$out" 20

# --spin: one room at a time, the ranks polling without sleeping; the
# decode engines busy polling (the prefill ones at their default).
out=$(timeout 120 "$KVFERRY" bench --json --model tiny --tokens 16 --page-size 16 \
      --concurrency 1 --requests 50 --spin --decode-busy-poll 200 --transport tcp --timeout 60)
check "$out" 50
python3 -c '
import json, sys
c = json.loads(sys.argv[1])["config"]
assert c["spin"] is True and c["decode_busy_poll_us"] == 200, c
assert c["prefill_busy_poll_us"] is None, c
' "$out"
if "$KVFERRY" bench --busy-poll 1000001 --requests 1 2>/dev/null; then
    echo "--busy-poll 1000001 was accepted" >&2; exit 1
fi

# --duration: both sides agree on the rooms they ran.
out=$(timeout 120 "$KVFERRY" bench --json --model tiny --tokens 16 --page-size 16 \
      --concurrency 8 --duration 1 --timeout 60)
check "$out" 0

# --relay, TP 4 -> 4: prefill rank 0 aborts every room after its first
# chunk; every rank of every room, its pair's and the three others', must
# fail it naming that abort (a room whose relay was lost fails the run).
# The first window starts while every connection is still being made.
out=$(timeout 120 "$KVFERRY" bench --json --relay --model tiny --tokens 64 --page-size 16 \
      --prefill-tp 4 --decode-tp 4 --requests 40 --concurrency 4 --transport tcp --timeout 60)
python3 -c '
import json, numbers, sys
d = json.loads(sys.argv[1])
assert d["ok"] is True and d["rooms"] == 40 and d["relayed"] == 40, d
assert not d["failures"] and d["ranks"] == 8, d
for k in ("relay_p50_ms", "relay_p99_ms", "relay_max_ms", "first_p50_ms", "first_p99_ms"):
    assert isinstance(d[k], numbers.Number) and d[k] >= 0, (k, d)
print("ok: --relay, TP 4 -> 4: %d/%d rooms relayed to every rank, p99 %.3f ms"
      % (d["relayed"], d["rooms"], d["relay_p99_ms"]))
' "$out"

# --call-latency, briefly: every call timed idle and under load, each beside
# the null call, and their ratios to it reported (figures, not a target),
# with the wake call's (an eventfd write waking a sleeping thread).
# The load either two rooms streaming or, with --load-rooms, many small ones.
for load in "--load-mib 8" "--load-rooms 8"; do
out=$(timeout 120 "$KVFERRY" bench --call-latency --rooms 50 $load --transport tcp)
python3 -c '
import json, numbers, sys
d = json.loads(sys.argv[1])
assert d["load_in_flight"] == (8 if sys.argv[2] == "--load-rooms 8" else 2), d["load_in_flight"]
assert d["load_mib"] == (0 if sys.argv[2] == "--load-rooms 8" else 8), d["load_mib"]
calls = ("receiver_create", "receiver_init", "sender_create", "sender_init", "sender_send",
         "poll", "receiver_failure", "sender_metric", "sender_destroy", "receiver_destroy",
         "sender_abort", "receiver_abort", "sender_create_held", "receiver_create_remote",
         "sender_prefix_len")
for phase in ("idle", "load"):
    assert d[phase]["null_call"]["n"] >= 12 * 50, (phase, d[phase]["null_call"])
    for c in calls + ("null_call", "wake_call"):
        e = d[phase][c]
        n = 25 if c.endswith("_abort") else 50      # a room aborted per room, each side in turn
        assert e["n"] >= n, (phase, c, e)
        assert 0 <= e["p50_ms"] <= e["p99_ms"] <= e["p999_ms"] <= e["max_ms"], (phase, c, e)
    for c in calls:
        r = d[phase + "_vs_null"][c]
        assert isinstance(r["p99"], numbers.Number) and r["p99"] > 0, (phase, c, r)
assert d["worst_p99_vs_null"] == max(d["load_vs_null"][c]["p99"] for c in calls), d
for phase in ("idle", "load"):
    r = d["wake_vs_null"][phase]
    assert r["p99"] > 0 and r["p999"] > 0, (phase, r)
print("ok: --call-latency %s: worst p99 under load %.0fx the null call, a wake %.0fx"
      % (sys.argv[2], d["worst_p99_vs_null"], d["wake_vs_null"]["load"]["p99"]))
' "$out" "$load"
done

# --layerwise, briefly: layer-wise against whole-chunk sending of the same
# rooms (every room's bytes compared by the tool); the report's shape.
out=$(timeout 120 "$KVFERRY" bench --layerwise --json --model tiny --tokens 256 --page-size 16 \
      --compute-us-per-token 20 --repeats 3 --transport tcp)
python3 -c '
import json, numbers, sys
d = json.loads(sys.argv[1])
assert d["model"] == "tiny" and d["layers"] == 2 and d["repeats"] == 3, d
for mode in ("whole", "layerwise"):
    for k in ("tail_ms", "total_ms", "gbps"):
        e = d[mode][k]
        assert 0 < e["min"] <= e["p50"] <= e["max"], (mode, k, e)
for k in ("tail_ratio", "throughput_ratio"):
    assert isinstance(d[k], numbers.Number) and d[k] > 0, (k, d)
print("ok: --layerwise: tail ratio %.3f, throughput ratio %.3f"
      % (d["tail_ratio"], d["throughput_ratio"]))
' "$out"
