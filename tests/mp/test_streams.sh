#!/usr/bin/env bash
# Streams across processes: `kvferry demo` over loopback tcp with
# --streams 2 (two connections and two progress threads per peer pair).
#   1. rooms succeed byte for byte (the demo verifies every page) and the
#      decode rank says its payload moved over two streams;
#   2. SIGKILL of the prefill rank mid-room: every room of the batch fails
#      on the decode side with the true reason (the prefill rank's
#      connection lost, on whichever stream saw it first), within 5 s, and
#      the survivors then serve fresh rooms (fault_check.py); the same for
#      a killed decode rank, whose rooms fail on the prefill side naming it;
#   3. a reset injected into the payload mid-room: the room resumes over
#      new streams, or fails with the reset as its reason.
set -euo pipefail
source "$(dirname "$0")/fault_lib.sh"

out=$FAULT_TMP/streams.json
KVF_LOG=info timeout 120 "$KVFERRY" demo --json --model tiny --tokens 4096 --chunk 512 \
    --requests 8 --concurrency 2 --checksum --transport tcp --streams 2 \
    --timeout 90 >"$out" 2>"$FAULT_TMP/streams.log"
python3 - "$out" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
if not (d["ok"] and d["verified"] and d["succeeded"] == d["rooms"] == 8):
    sys.exit("FAIL: rooms over two streams: %s" % json.dumps(d)[:2000])
print("ok: 8/8 rooms over two streams verified")
PY
if ! grep -q "payload over 2 tcp streams" "$FAULT_TMP/streams.log"; then
    echo "FAIL: the decode rank did not use two streams; its log:"
    tail -n 40 "$FAULT_TMP/streams.log"
    exit 1
fi

fault_run kill-prefill@mid --transport tcp --streams 2
python3 - "$FAULT_TMP/out.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
dec = [f for f in d["failures"] if f["side"] == "decode"]
if not dec:
    sys.exit("FAIL: no room failed on the decode side after the prefill was killed")
for f in dec:
    r = f["reason"]
    if "prefill rank 0" not in r or "connection lost" not in r:
        sys.exit("FAIL: decode failure without the true reason: %r" % r)
print("ok: %d decode-side failures name the lost prefill connection" % len(dec))
PY

fault_run kill-decode@mid --transport tcp --streams 2
python3 - "$FAULT_TMP/out.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
pre = [f for f in d["failures"] if f["side"] == "prefill" and not f.get("from_another_rank")]
# A room the killed rank had not asked for yet is not linked to it: it
# fails at its bootstrap deadline, saying that no decode rank asked.
unasked = [f for f in pre if "decode ranks sent their destination" in f["reason"]]
named = [f for f in pre if f not in unasked]
if not named:
    sys.exit("FAIL: no room failed first-hand on the prefill side naming the killed decode")
for f in named:
    r = f["reason"]
    if "decode rank 0" not in r:
        sys.exit("FAIL: prefill failure without the true reason: %r" % r)
print("ok: %d prefill-side failures name the lost decode rank (%d more were never "
      "asked for)" % (len(named), len(unasked)))
PY

fault_run reset@mid --transport tcp --streams 2
