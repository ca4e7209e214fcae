#!/usr/bin/env bash
# The room trace across rank processes: a TP 2 -> 2 demo whose prefill
# rank 0 corrupts a byte of the first room in its middle (checksums on),
# every rank tracing into one shared file (KVF_TRACE).  `kvferry trace`
# on that room must put the root cause first, on the rank that saw it
# (the decode rank whose checksum did not match, as the demo's own
# failure records name it), every other rank that failed the room failing
# later and saying it learned it from another rank; and a room that succeeded
# must show every rank reaching Success with no failure.
set -euo pipefail
KVFERRY=${KVFERRY:-build/kvferry}
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

rc=0
KVF_TRACE="$TMP/trace.jsonl" timeout 120 "$KVFERRY" demo --json --model tiny --tokens 2048 \
    --chunk 256 --requests 4 --concurrency 1 --checksum --prefill-tp 2 --decode-tp 2 \
    --fault corrupt@mid --after-fault-requests 1 --timeout 90 >"$TMP/demo.json" \
    2>"$TMP/demo.log" || rc=$?
[ "$rc" = 0 ] || { tail -n 30 "$TMP/demo.log"; echo "FAIL: the demo exited $rc"; exit 1; }

failed=$(python3 - "$TMP/demo.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
assert d["failed"] == 1, (d["failed"], d["problems"])
print(d["failures"][0]["room"])
PY
)
"$KVFERRY" trace "$failed" "$TMP/trace.jsonl" --json >"$TMP/failed.json"
"$KVFERRY" trace "$failed" "$TMP/trace.jsonl" >"$TMP/failed.txt"
python3 - "$TMP/demo.json" "$TMP/failed.json" "$TMP/failed.txt" <<'PY'
import json, sys
demo, t, text = json.load(open(sys.argv[1])), json.load(open(sys.argv[2])), open(sys.argv[3]).read()
f = demo["failures"][0]
rc = t["root_cause"]
assert rc is not None, "no root cause in the trace"
# The rank that saw it, as the demo's records name the origin.
assert rc["side"] == f["origin_side"] and rc["tp"] == f["origin_rank"], (rc, f)
assert rc["status"] == f["status"] == "KVF_ERR_CHECKSUM", (rc["status"], f["status"])
assert rc["from_another_rank"] == 0 and rc["addr"] == f["origin_addr"], rc
failed = [e for e in t["events"] if e["event"] == "failed"]
# The corrupted pair's two ranks at least; the other pair's when the
# failure reached them before their room, finished, was destroyed.
assert len(failed) >= 2, [(e["rank"], e["t_ms"]) for e in failed]
assert failed[0]["engine"] == rc["engine"] and failed[0]["t_ms"] == rc["t_ms"], failed[0]
for e in failed[1:]:
    assert e["from_another_rank"] == 1 and e["t_ms"] >= rc["t_ms"], e
    assert (e["origin_side"], e["origin_rank"]) == (rc["side"], rc["tp"]), e
assert {r["rank"] for r in t["ranks"]} == {"prefill rank 0", "prefill rank 1",
                                           "decode rank 0", "decode rank 1"}, t["ranks"]
assert all(r["final"] in ("Failed", "Success") for r in t["ranks"]), t["ranks"]
assert "the failure started on %s rank %d" % (rc["side"], rc["tp"]) in text, text[-600:]
assert "%d other rank" % (len(failed) - 1) in text, text[-600:]
print("ok: the trace of failed room %s starts the failure on %s (%s); %d other ranks "
      "learned it later" % (t["room"], rc["rank"], rc["status"], len(failed) - 1))
PY

# A room that succeeded: every rank Success, no failure, no root cause.
good=$(python3 - "$TMP/trace.jsonl" "$failed" <<'PY'
import json, sys
rooms = {}
for line in open(sys.argv[1]):
    r = json.loads(line)
    rooms.setdefault(r["room"], set()).add(r["event"])
print(next(k for k, ev in rooms.items() if k != sys.argv[2] and "failed" not in ev))
PY
)
"$KVFERRY" trace "$good" "$TMP/trace.jsonl" --json >"$TMP/good.json"
python3 - "$TMP/good.json" <<'PY'
import json, sys
t = json.load(open(sys.argv[1]))
assert t["root_cause"] is None, t["root_cause"]
assert len(t["ranks"]) == 4 and all(r["final"] == "Success" for r in t["ranks"]), t["ranks"]
print("ok: the trace of room %s shows its 4 ranks reach Success" % t["room"])
PY

# Usage: a room with no line is an error, a bad room id is bad usage.
rc=0; "$KVFERRY" trace 12345 "$TMP/trace.jsonl" >/dev/null 2>&1 || rc=$?
[ "$rc" = 1 ] || { echo "FAIL: kvferry trace of an unknown room exited $rc, not 1"; exit 1; }
rc=0; "$KVFERRY" trace room-x "$TMP/trace.jsonl" >/dev/null 2>&1 || rc=$?
[ "$rc" = 2 ] || { echo "FAIL: kvferry trace with a bad room id exited $rc, not 2"; exit 1; }
echo "ok: kvferry trace refuses an unknown room (1) and a bad room id (2)"
