#!/usr/bin/env bash
# kvferry demo with --decode-page-size != --page-size: every room must fail,
# on both sides, with the page size mismatch message; exit status non-zero.
set -euo pipefail
KVFERRY=${KVFERRY:-build/kvferry}

rc=0
out=$(timeout 120 "$KVFERRY" demo --json --model tiny --requests 4 \
      --page-size 16 --decode-page-size 32 --timeout 60) || rc=$?
[ "$rc" -ne 0 ] || { echo "FAIL: exit status 0 despite the mismatch"; exit 1; }
[ "$rc" -ne 124 ] || { echo "FAIL: the demo hung (timeout)"; exit 1; }
python3 -c '
import json, sys
d = json.loads(sys.argv[1])
assert d["rooms"] == 4 and d["failed"] == 4, d
assert d["succeeded"] == 0 and d["unresolved"] == 0, d
msg = "Page size mismatch: prefill server has page_size="
sides = {f["side"] for f in d["failures"] if msg in f["reason"]}
assert sides == {"prefill", "decode"}, d["failures"]
for i in range(4):
    for side in ("prefill", "decode"):
        assert any(f["index"] == i and f["side"] == side and msg in f["reason"]
                   for f in d["failures"]), (i, side, d["failures"])
print("ok: exit %s, 4/4 rooms failed on both sides: %s" % (sys.argv[2], d["failures"][0]["reason"]))
' "$out" "$rc"
