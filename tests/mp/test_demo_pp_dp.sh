#!/usr/bin/env bash
# Pipeline stages and prefill DP groups in `kvferry demo`: decode PP equal
# to prefill PP (stage to stage) and decode PP 1 (every stage's layers into
# one decode rank), alone and with a TP mismatch, for MHA/GQA and MLA;
# prefill DP 2 (each room served by the group room % 2 only); and one
# refused pairing (prefill PP 2 -> decode PP 4), where every room must fail
# on both sides with the engine's reason.  Every byte is verified by the
# demo against the logical KV, keyed by global layer.
set -euo pipefail
KVFERRY=${KVFERRY:-build/kvferry}
REQUESTS=8

demo() {   # demo options...
    timeout 60 "$KVFERRY" demo --json --requests "$REQUESTS" --tokens 96 \
        --chunk 32 --concurrency 2 --timeout 45 "$@" 2>/dev/null || true
}

# Every room succeeded and verified, and every rank holds what its
# coordinates say: its stage's layers, its DP group's rooms.
check_ok() {   # json what
    python3 -c '
import json, sys
d = json.loads(sys.argv[1]); what = sys.argv[2]; n = d["rooms"]
assert d["succeeded"] == n and d["failed"] == 0 and d["unresolved"] == 0, (what, d["failures"][:2], d.get("problems"))
assert d["verified"] is True and d["ok"] is True, (what, d.get("problems"))
model_layers = {"llama3-8b": 32, "qwen2.5-7b": 28, "deepseek-v3": 61}[d["model"]]
sides = {"prefill": (d["prefill_pp"], d["prefill_tp"], d["dp"]),
         "decode": (d["decode_pp"], d["decode_tp"], 1)}
ranks = d["ranks"]
for side, (pp, tp, dp) in sides.items():
    mine = [r for r in ranks if r["side"] == side]
    assert len(mine) == pp * tp * dp, (what, side, len(mine))
    coords = sorted((r["dp_rank"], r["pp_rank"], r["tp_rank"]) for r in mine)
    assert coords == [(a, b, c) for a in range(dp) for b in range(pp) for c in range(tp)], (what, coords)
    for r in mine:
        s = r["pp_rank"]
        first = s * model_layers // pp
        assert (r["first_layer"], r["num_layers"]) == (first, (s + 1) * model_layers // pp - first), (what, r)
    for b in range(pp):
        for c in range(tp):
            group = [r["rooms"] for r in mine if (r["pp_rank"], r["tp_rank"]) == (b, c)]
            # each room is run by exactly one DP group, and both groups get some
            assert sum(group) == n and (dp == 1 or min(group) > 0), (what, side, group)
print("ok: %s: %d rooms verified over %s" % (what, n, d["transport"]))
' "$1" "$2"
}

ok() {   # model prefill_pp decode_pp prefill_tp decode_tp dp [transport]
    local t=${7:-auto}
    check_ok "$(demo --model "$1" --prefill-pp "$2" --decode-pp "$3" \
                --prefill-tp "$4" --decode-tp "$5" --dp "$6" --transport "$t")" \
             "$1 PP $2 -> $3, TP $4 -> $5, DP $6, $t"
}

ok llama3-8b   2 2 1 1 1
ok llama3-8b   2 1 1 1 1
ok llama3-8b   2 1 2 1 1 tcp
ok deepseek-v3 2 2 1 1 1
ok deepseek-v3 2 1 1 1 1
ok deepseek-v3 2 2 2 1 1
ok llama3-8b   1 1 1 1 2
ok qwen2.5-7b  1 1 1 1 2
ok qwen2.5-7b  1 1 2 1 2 tcp
ok llama3-8b   2 1 1 1 2

# Refused: decode PP 4 is neither prefill PP 2 nor 1.
out=$(demo --model llama3-8b --prefill-pp 2 --decode-pp 4)
python3 -c '
import json, sys
d = json.loads(sys.argv[1]); n = d["rooms"]
assert d["ok"] is False and d["succeeded"] == 0 and d["failed"] == n and d["unresolved"] == 0, (d["failures"][:2], d.get("problems"))
fs = d["failures"]
assert fs and all("Pipeline parallel mismatch" in f["reason"] for f in fs), [f["reason"] for f in fs][:3]
for side in ("prefill", "decode"):
    rooms = {f["index"] for f in fs if f["side"] == side}
    assert rooms == set(range(n)), (side, sorted(rooms))
print("ok: PP 2 -> 4 refused: %d rooms failed on both sides with %r" % (n, fs[0]["reason"][:60]))
' "$out"
