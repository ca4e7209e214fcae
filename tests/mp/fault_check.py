#!/usr/bin/env python3
"""Judge one `kvferry demo --json --fault KIND@WHEN` run (fault_lib.sh).

Usage: fault_check.py SPEC EXIT_STATUS AFTER_ROOMS JSON_FILE [TRANSPORT]

The demo already judges itself (exit status, "ok", "problems"); this checks
the failure model's promises again from the raw JSON, so that a demo bug
cannot hide an engine bug:
  - the fault fired, and every room of the first batch is final;
  - every failure record has a status, a reason and an origin;
  - a surviving rank that saw the fault itself names the faulty side;
  - rooms resolved within 5 s of the fault (a stopped rank's own rooms:
    within 5 s of its SIGCONT, since it cannot act before; rooms resumed
    after a reset take what their transfer takes);
  - no room reported SUCCESS with data that did not verify;
  - no page was written after its room was final (the demo finds such a
    page dirty when it gives it to the next room: STALE_WRITE);
  - corrupt: the corruption was caught by a checksum failure, on every
    transport;
  - badaddr: the read outside the sender's memory was refused, and only
    the room it named failed (the demo's own check: untouched rooms
    succeed);
  - every room of the fresh batch after the fault succeeded and verified;
  - the payload went over TRANSPORT, when given (a pair that quietly fell
    back to tcp would test tcp twice);
  - siblings (siblings.py): every rank of a room, both sides, ends in the
    same state (but a side that had every byte when the other failed for
    a cause of its own), and all of a room's failure records name one rank
    in common; with a process or engine fault on a rank at mid or last,
    the records of the room that reached that phase name that rank (its
    control address); and with several prefill DP groups every room of a
    group the fault did not touch (another than prefill rank 0's)
    succeeded.  Only that room is sure to have linked every rank when the
    fault struck: another one may still be bootstrapping on a rank, whose
    peers then fail it at their own deadline, the one cause every rank
    names.
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import siblings  # noqa: E402

MAX_RESOLVE_S = 5.0


def fail(spec, msg, d=None):
    print("FAIL %s%s: %s" % (spec, " over " + d["transport"] if d else "", msg))
    if d is not None:
        print("  problems: %s" % json.dumps(d.get("problems"), indent=None)[:2000])
        print("  fault_detail: %s" % json.dumps(d.get("fault_detail"))[:2000])
    sys.exit(1)


def check_records(spec, records, victim_side, d):
    for f in records:
        where = "room %s on %s[%s]" % (f.get("index"), f.get("side"), f.get("rank"))
        if not f.get("reason"):
            fail(spec, "%s failed without a reason: %s" % (where, f), d)
        if not f.get("status"):
            fail(spec, "%s failed without a status: %s" % (where, f), d)
        if f.get("status") == "STALE_WRITE":
            fail(spec, "%s: a write landed in pages after their room was final: %s"
                 % (where, f["reason"]), d)
        if f.get("origin_side") not in ("prefill", "decode") or not f.get("origin_addr"):
            fail(spec, "%s failed without an origin (side, addr): %s" % (where, f), d)
        # A rank of the other side that saw the fault first-hand must say
        # which side failed it (its peer), not only that something did.
        if (victim_side and f["side"] != victim_side and not f.get("from_another_rank")
                and f.get("status") != "KILLED_BY_FAULT"
                and victim_side not in f["reason"]):
            fail(spec, "%s: the reason does not name the %s peer: %r"
                 % (where, victim_side, f["reason"]), d)


def check_siblings(spec, d, rooms, target_addr):
    """The rules of siblings.py over each room that did not succeed."""
    records = {}
    for f in d["failures"] + d["after_fault"]["failures"]:
        records[(f["index"], f["side"], f["rank"])] = f
    kind = spec.split("@")[0]
    stopped = kind.split("-")[1] if kind.startswith("stop-") else None
    for room in rooms:
        ranks = [dict(r, failure=records.get((room["index"], r["side"], r["rank"])),
                      stopped=r["side"] == stopped and r["rank"] == 0)
                 for r in room["ranks"]]
        why = siblings.one_state(ranks)
        common, why2 = siblings.one_cause(ranks)
        if kind == "registry-down" and why2 and "no rank in common" in why2:
            # The sides never linked: each names the failure it saw
            # (docs/FAILURES.md, Known limits); one_cause's other rules hold.
            why2 = None
        if why or why2:
            fail(spec, "room %d: %s" % (room["index"], why or why2), d)
        # The ranks that failed and lived name the rank the fault acted on
        # (a decode rank that had every byte of a prefill rank killed at
        # its last chunk may succeed: nothing to name).
        if target_addr and room["index"] == d["fault_detail"].get("room") \
                and any(r["state"] == "Failed" and not r.get("killed") for r in ranks) \
                and target_addr not in common:
            fail(spec, "room %d: its failure records do not all name the rank the fault acted "
                 "on (%s); they share %s" % (room["index"], target_addr, sorted(common)), d)
    if d.get("dp", 1) > 1 and spec.split("@")[0] not in ("kill-decode", "stop-decode",
                                                          "registry-down"):
        other = [r["index"] for r in rooms if r["index"] < d["rooms"] and (r["room"] % 2**64) % d["dp"] != 0]
        if other:
            fail(spec, "rooms %s of another DP group than prefill rank 0's did not succeed"
                 % other, d)


def main():
    spec, rc, after_rooms, path = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    try:
        with open(path) as fh:
            d = json.load(fh)
    except (OSError, ValueError) as e:
        fail(spec, "no JSON summary from the demo (%s); see its log above" % e)
    kind = spec.split("@")[0]
    victim_side = kind.split("-")[1] if kind.startswith(("kill-", "stop-")) else None

    want = sys.argv[5] if len(sys.argv) > 5 else None
    if want and want not in d["transport"].split("+"):
        fail(spec, "asked for %s, but the payload went over %s" % (want, d["transport"]), d)
    if d.get("fault") != spec or not (d.get("fault_detail") or {}).get("injected"):
        fail(spec, "the fault was not injected", d)
    if d["unresolved"] != 0:
        fail(spec, "%d room(s) unresolved: %s" % (d["unresolved"], d["unresolved_rooms"]), d)
    after = d["after_fault"]
    check_records(spec, d["failures"], victim_side, d)
    check_records(spec, after["failures"], None, d)
    target = (d.get("fault_detail") or {}).get("target_addr")
    check_siblings(spec, d, d["failed_rooms"] + after["failed_rooms"],
                   target if kind != "registry-down" and not spec.endswith("@bootstrap")
                   else None)
    if d["succeeded"] + d["failed"] != d["rooms"]:
        fail(spec, "rooms do not add up: %s" % d, d)
    res = d["max_resolve_seconds"]
    # A reset is resumed: the rooms it hit move all their bytes again, in
    # the time their transfer takes (seconds for two 256 MiB rooms on a
    # loaded host), and succeed; one that does not resume fails or stays
    # unresolved, which the checks above and below catch.
    if res is None or (res > MAX_RESOLVE_S and kind != "reset"):
        fail(spec, "max_resolve_seconds = %s, above %.1f s" % (res, MAX_RESOLVE_S), d)
    if not d["verified"] or not after["verified"]:
        fail(spec, "a room reported SUCCESS with data that did not verify", d)
    caught = {"corrupt": "checksum mismatch",
              "badaddr": "outside every region it registered"}.get(kind)
    if caught:
        if not d["checksum"]:
            fail(spec, "%s must run with --checksum" % kind, d)
        if not any(caught in f["reason"] for f in d["failures"]):
            fail(spec, "the fault was not caught: no failure says %r (failures: %s)"
                 % (caught, [f["reason"] for f in d["failures"]]), d)
        # One room's bytes were wrong: every failure is of that one room.
        rooms = {f["index"] for f in d["failures"]}
        if len(rooms) != 1:
            fail(spec, "%s hit one room, but rooms %s failed" % (kind, sorted(rooms)), d)
    if after["rooms"] != after_rooms or after["succeeded"] != after_rooms:
        fail(spec, "after the fault %d of %d fresh rooms succeeded (want %d): %s"
             % (after["succeeded"], after["rooms"], after_rooms,
                [f["reason"] for f in after["failures"]][:4]), d)
    if rc != 0 or d["ok"] is not True:
        fail(spec, "the demo failed (exit %d, ok=%s)" % (rc, d["ok"]), d)
    print("ok: %-24s %-4s %d/%d first-batch rooms succeeded, %d failed with "
          "reasons, resolved within %.2f s, %d/%d fresh rooms succeeded"
          % (spec, d["transport"], d["succeeded"], d["rooms"], d["failed"], res,
             after["succeeded"], after["rooms"]))


if __name__ == "__main__":
    main()
