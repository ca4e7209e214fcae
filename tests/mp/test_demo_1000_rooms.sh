#!/usr/bin/env bash
# kvferry demo, tiny model, 1000 rooms of 16 tokens with 32 rooms in flight
# per rank: room bookkeeping at scale, every room verified.
set -euo pipefail
KVFERRY=${KVFERRY:-build/kvferry}

out=$(timeout 240 "$KVFERRY" demo --json --model tiny --requests 1000 \
      --tokens 16 --concurrency 32 --timeout 200)
python3 -c '
import json, sys
d = json.loads(sys.argv[1])
assert d["rooms"] == 1000, d["rooms"]
assert d["succeeded"] == 1000, (d["succeeded"], d["failures"][:3])
assert d["failed"] == 0 and d["unresolved"] == 0 and d["verified"] is True, d
print("ok: 1000 rooms succeeded and verified in %.3f s" % d["seconds"])
' "$out"
