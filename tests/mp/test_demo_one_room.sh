#!/usr/bin/env bash
# kvferry demo, tiny model, one room: the smallest end-to-end transfer,
# every byte and the aux tag verified on decode.
set -euo pipefail
KVFERRY=${KVFERRY:-build/kvferry}

out=$(timeout 120 "$KVFERRY" demo --json --model tiny --requests 1 --timeout 60)
python3 -c '
import json, sys
d = json.loads(sys.argv[1])
assert d["rooms"] == 1, d["rooms"]
assert d["succeeded"] == 1 and d["failed"] == 0 and d["unresolved"] == 0, d
assert d["verified"] is True, d
assert d["bytes"] > 0 and d["seconds"] > 0, d
assert d["failures"] == [], d["failures"]
print("ok: tiny, 1 room succeeded, %d bytes verified, %.3f s" % (d["bytes"], d["seconds"]))
' "$out"
