#!/usr/bin/env bash
# Head-major KV pages (--kv-order hnd, vLLM's HND) at different TP sizes,
# over tcp, shm (and ucx when built): each decode rank must hold exactly its heads, every
# byte verified by the demo against the logical KV (the pattern is a
# function of layer, K/V, global head and token, so a head or a token out
# of place fails the check).  Then a pair whose orders differ: every room
# fails on both sides with the message naming both orders.
set -euo pipefail
KVFERRY=${KVFERRY:-build/kvferry}

run() {   # model prefill_tp decode_tp transport
    local out
    out=$(timeout 120 "$KVFERRY" demo --json --model "$1" --prefill-tp "$2" \
          --decode-tp "$3" --transport "$4" --kv-order hnd --requests 3 --tokens 96 \
          --chunk 32 --concurrency 2 --timeout 90 2>/dev/null) || true
    python3 -c '
import json, sys
d = json.loads(sys.argv[1])
what = " ".join(sys.argv[2:])
assert d["kv_order"] == "hnd" and d["decode_kv_order"] == "hnd", (what, d)
assert d["succeeded"] == 3 and d["failed"] == 0 and d["unresolved"] == 0, (what, d["failures"][:2], d.get("problems"))
assert d["verified"] is True, (what, d.get("problems"))
assert sys.argv[4] in d["transport"].split("+"), (what, "payload over", d["transport"])
print("ok: %s: 3 HND rooms verified over %s" % (what, d["transport"]))
' "$out" "$1" "TP $2 -> $3" "$4"
}

transports="tcp shm"
if "$KVFERRY" version | grep -q '^transports:.*ucx'; then
    transports="tcp shm ucx"
    export UCX_TLS=${UCX_TLS:-tcp}
    # UCX's tcp moves reads in software, which a prefill engine refuses to
    # offer unless told: allowed here, every process on loopback.
    export KVF_UCX_SOFTWARE_RMA=${KVF_UCX_SOFTWARE_RMA:-allow}
fi
for t in $transports; do
    for pair in "1 2" "2 1" "2 4" "4 2"; do
        set -- $pair
        run llama3-8b "$1" "$2" "$t"      # 8 KV heads: slices of pages
    done
    run qwen2.5-7b 1 8 "$t"               # 4 KV heads, each on two decode ranks
    run deepseek-v3 2 1 "$t"              # MLA: the order does not matter
done

rc=0
out=$(timeout 120 "$KVFERRY" demo --json --model llama3-8b --requests 2 --tokens 64 \
      --kv-order hnd --decode-kv-order nhd --timeout 60 2>/dev/null) || rc=$?
[ "$rc" -ne 0 ] || { echo "FAIL: exit status 0 despite the KV page order mismatch"; exit 1; }
[ "$rc" -ne 124 ] || { echo "FAIL: the demo hung (timeout)"; exit 1; }
python3 -c '
import json, sys
d = json.loads(sys.argv[1])
assert d["rooms"] == 2 and d["failed"] == 2 and d["succeeded"] == 0, d
msg = ("KV page order mismatch: prefill KV pages are HND (head-major), but decode KV "
       "pages are NHD (token-major).")
for i in range(2):
    for side in ("prefill", "decode"):
        assert any(f["index"] == i and f["side"] == side and msg in f["reason"]
                   for f in d["failures"]), (i, side, d["failures"])
print("ok: exit %s, 2/2 rooms failed on both sides: %s" % (sys.argv[2], d["failures"][0]["reason"]))
' "$out" "$rc"
