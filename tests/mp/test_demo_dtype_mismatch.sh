#!/usr/bin/env bash
# kvferry demo with --decode-kv-dtype != --kv-dtype (same element size, so
# only the dtype differs): every room fails on both sides naming the dtype.
set -euo pipefail
KVFERRY=${KVFERRY:-build/kvferry}

rc=0
out=$(timeout 120 "$KVFERRY" demo --json --model tiny --requests 4 \
      --kv-dtype bfloat16 --decode-kv-dtype float16 --timeout 60) || rc=$?
[ "$rc" -ne 0 ] || { echo "FAIL: exit status 0 despite the mismatch"; exit 1; }
[ "$rc" -ne 124 ] || { echo "FAIL: the demo hung (timeout)"; exit 1; }
python3 -c '
import json, sys
d = json.loads(sys.argv[1])
assert d["rooms"] == 4 and d["failed"] == 4, d
assert d["succeeded"] == 0 and d["unresolved"] == 0, d
def is_dtype(f):
    r = f["reason"]
    return "dtype" in r and "mismatch" in r and "bfloat16" in r and "float16" in r
sides = {f["side"] for f in d["failures"] if is_dtype(f)}
assert sides == {"prefill", "decode"}, d["failures"]
print("ok: exit %s, 4/4 rooms failed on both sides: %s" % (sys.argv[2], d["failures"][0]["reason"]))
' "$out" "$rc"
