#!/usr/bin/env bash
# Fault matrix, corrupt: prefill rank 0's engine flips one payload byte on
# the wire (KVF_FAULTS corrupt@BYTES) at the start of the first room, in
# its middle and in its last chunk.  With --checksum the receiver must
# catch it: the room FAILS with "checksum mismatch", never SUCCESS, and
# the rooms after it and the fresh batch succeed.  Without --checksum
# nothing in the engine can see it, and the demo's own byte-for-byte check
# must turn the SUCCESS into a hard failure (exit 1).
set -euo pipefail
source "$(dirname "$0")/fault_lib.sh"
fault_matrix corrupt

rc=0
timeout 120 "$KVFERRY" demo --json --model tiny --tokens 2048 --chunk 256 \
    --requests 4 --concurrency 1 --after-fault-requests 2 --timeout 90 \
    --fault corrupt@mid >"$FAULT_TMP/nock.json" 2>"$FAULT_TMP/nock.log" || rc=$?
python3 - "$rc" "$FAULT_TMP/nock.json" <<'EOF'
import json, sys
rc, d = int(sys.argv[1]), json.load(open(sys.argv[2]))
probs = d["problems"]
assert rc == 1 and d["ok"] is False, (rc, d["ok"], probs)
assert d["verified"] is False, "the corrupted room was not caught by the demo"
assert any("did not verify" in p for p in probs), probs
print("ok: corrupt@mid without --checksum: SUCCESS with a flipped byte is a "
      "hard failure of the demo (exit 1): %s" % probs[0][:120])
EOF
