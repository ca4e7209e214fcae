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

# Prefill TP 1 -> decode TP 2: each decode rank gets one of the tiny
# model's two heads (32 bytes a token) as strided segments, a piece per
# token, 64 bytes apart on prefill.  Payload byte 37 of a room is byte 5
# of its second piece: mapped through the strides it is that token's own
# head, so the room's checksum must catch it.  Mapped as if the payload
# were contiguous it would be the other head's byte, which the other
# decode rank receives as it is hashed: no checksum sees it (the room
# succeeds, or the demo finds decode's bytes wrong).
for transport in $FAULT_TRANSPORTS; do
    rc=0
    KVF_FAULTS=corrupt@37 timeout 120 "$KVFERRY" demo --json --model tiny --tokens 2048 \
        --chunk 256 --requests 3 --concurrency 1 --checksum --prefill-tp 1 --decode-tp 2 \
        --transport "$transport" --timeout 90 >"$FAULT_TMP/tp12.json" \
        2>"$FAULT_TMP/tp12.log" || rc=$?
    python3 - "$rc" "$FAULT_TMP/tp12.json" "$transport" <<'EOF'
import json, sys
rc, d, t = int(sys.argv[1]), json.load(open(sys.argv[2])), sys.argv[3]
reasons = [f.get("reason", "") for f in d["failures"]]
assert d["failed"] == 1 and d["succeeded"] == 2 and d["unresolved"] == 0, (t, rc, reasons, d["problems"])
assert all("checksum mismatch" in r for r in reasons), (t, reasons)
assert d["verified"] is True, (t, d["problems"])
print("ok: corrupt@37, TP 1 -> 2 over %s: the strided piece's byte was caught by "
      "the checksum (%s)" % (t, reasons[0][:60]))
EOF
done
