#!/usr/bin/env bash
# shm with three copier threads: one room's frames are copied in parallel
# and may finish out of order, but the mover hands them back in the order
# they were started, so the per-link checksum (hashed as reads are handed
# back) and the byte-for-byte check both hold.  Rooms of 16 MiB (llama3-8b,
# 128 tokens), 4 in flight: many frames of each room in flight at once.
set -euo pipefail
KVFERRY=${KVFERRY:-build/kvferry}

out=$(KVF_SHM_COPIERS=3 timeout 240 "$KVFERRY" demo --json --model llama3-8b \
      --transport shm --checksum --requests 8 --concurrency 4 --tokens 128 \
      --timeout 200)
python3 -c '
import json, sys
d = json.loads(sys.argv[1])
assert d["transport"] == "shm", d["transport"]
assert d["succeeded"] == 8 and d["failed"] == 0 and d["unresolved"] == 0, d
assert d["verified"] is True and d["checksum"] is True, d
print("ok: shm, 3 copiers, 8 rooms of %d bytes, checksums and bytes verified"
      % (d["bytes"] // 8))
' "$out"
