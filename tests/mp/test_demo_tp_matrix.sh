#!/usr/bin/env bash
# Prefill and decode at different TP sizes, for every model layout, over
# every transport built in: each decode rank must hold exactly its heads (MHA/GQA, GQA
# replication) or the whole latent (MLA), every byte verified by the demo
# against the logical KV.
set -euo pipefail
KVFERRY=${KVFERRY:-build/kvferry}

run() {   # model prefill_tp decode_tp transport
    local out
    out=$(timeout 120 "$KVFERRY" demo --json --model "$1" --prefill-tp "$2" \
          --decode-tp "$3" --transport "$4" --requests 3 --tokens 96 --chunk 32 \
          --concurrency 2 --timeout 90 2>/dev/null) || true
    python3 -c '
import json, sys
d = json.loads(sys.argv[1])
what = " ".join(sys.argv[2:])
assert d["succeeded"] == 3 and d["failed"] == 0 and d["unresolved"] == 0, (what, d["failures"][:2], d.get("problems"))
assert d["verified"] is True, (what, d.get("problems"))
assert sys.argv[4] in d["transport"].split("+"), (what, "payload over", d["transport"])
print("ok: %s: 3 rooms verified over %s" % (what, d["transport"]))
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
    for pair in "1 1" "2 1" "4 1" "1 2" "1 4" "4 2" "2 4"; do
        set -- $pair
        run llama3-8b "$1" "$2" "$t"
        run deepseek-v3 "$1" "$2" "$t"
    done
    # qwen2.5-7b has 4 KV heads: TP 8 replicates each head on two ranks.
    run qwen2.5-7b 8 2 "$t"
    run qwen2.5-7b 1 8 "$t"
    run qwen2.5-7b 2 8 "$t"
done
