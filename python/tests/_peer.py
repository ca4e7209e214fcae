"""The other side of a room, in its own process, for the tests.

``python3 _peer.py '<json config>'``:

    role        "prefill" (hosts the registry, prints its address) or "decode"
    page_size   tokens per page
    state       register a state buffer and send/receive slot 0..
    bootstrap   decode: the registry "host:port"
    rooms       [{"room": id, "pages": [...], "aux": slot, "state": slot?}]
    mode        "run"     complete every room (prefill sends the pattern in
                          chunks of 3 pages; decode verifies every byte)
                "layers"  prefill: as "run", each chunk layer by layer, the
                          last layer first (send_layers), then an empty last
                          send with the state
                "partial" prefill: send one non-last chunk, then hold
                "partial_layers"  prefill: send layer 0 of the first page
                          (send_layers), then hold
                "hold"    only create (and on decode init) the rooms, then hold
                "abort"   decode: abort each room once WaitingForInput
    heartbeat   [interval_ms, timeout_ms]

Events, one JSON object per line: {"event": "ready", "addr", "bootstrap"},
{"event": "state", "room", "state", "failure"?, "bad"?} on every change, and
{"event": "done"} once every room is final (the process then exits, unless
mode is "hold" or "partial"(_layers), where it waits to be killed).
"""
import json
import sys
import time

from _util import (fill_room, failure_dict, kvferry, make_args, verify_room,
                   FINAL, KVPoll, LAYERS)


def emit(**ev):
    print(json.dumps(ev), flush=True)


def main():
    c = json.loads(sys.argv[1])
    eng = {}
    if "heartbeat" in c:
        eng.update(heartbeat_interval_ms=c["heartbeat"][0],
                   heartbeat_timeout_ms=c["heartbeat"][1])
    prefill = c["role"] == "prefill"
    if prefill:
        eng.update(host_bootstrap=True, bootstrap_addr="127.0.0.1:0")
    mgr = kvferry.KVManager(make_args(c["page_size"], c.get("state", False), **eng),
                            c["role"])
    boot = mgr.bootstrap_addr if prefill else c["bootstrap"]
    emit(event="ready", addr=mgr.address, bootstrap=boot)
    mode = c.get("mode", "run")
    rooms = {}
    for r in c["rooms"]:
        if prefill:
            h = kvferry.KVSender(mgr, boot, r["room"])
        else:
            h = kvferry.KVReceiver(mgr, boot, r["room"])
            h.init(r["pages"], r["aux"], [r["state"]] if "state" in r else None)
        rooms[r["room"]] = [h, r, None]
    deadline = time.monotonic() + 100
    while time.monotonic() < deadline:
        for room, slot in rooms.items():
            h, r, seen = slot
            s = h.poll()
            if s == seen:
                continue
            slot[2] = s
            ev = {"event": "state", "room": room, "state": s.name}
            if s == KVPoll.Failed:
                try:
                    h.failure_exception()
                except kvferry.KVTransferError as e:
                    ev["failure"] = failure_dict(e)
            elif s == KVPoll.Success and not prefill:
                ev["bad"] = verify_room(mgr, room, r["pages"], r["aux"], r.get("state"))
            emit(**ev)
            if s == KVPoll.WaitingForInput and prefill and mode in (
                    "run", "partial", "layers", "partial_layers"):
                fill_room(mgr, room, r["pages"], r["aux"], r.get("state"))
                h.init(len(r["pages"]), r["aux"])
                if mode == "partial":
                    h.send(r["pages"][:1], is_last=False)
                    continue
                if mode == "partial_layers":
                    h.send_layers(r["pages"][:1], 0, 0, 1)
                    continue
                if mode == "layers":
                    for i in range(0, len(r["pages"]), 3):
                        for layer in reversed(range(LAYERS)):
                            h.send_layers(r["pages"][i:i + 3], i, layer, layer + 1)
                    h.send([], [r["state"]] if "state" in r else None, is_last=True)
                    continue
                for i in range(0, len(r["pages"]), 3):
                    st = [r["state"]] if "state" in r and i + 3 >= len(r["pages"]) \
                        else None
                    h.send(r["pages"][i:i + 3], st)
            if s == KVPoll.WaitingForInput and not prefill and mode == "abort":
                h.abort()
        if all(slot[2] in FINAL for slot in rooms.values()) and mode not in (
                "hold", "partial", "partial_layers"):
            break
        time.sleep(0.002)
    emit(event="done")
    for h, _, _ in rooms.values():
        h.close()
    mgr.close()


if __name__ == "__main__":
    try:
        main()
    except Exception as e:          # report, so the test fails with the reason
        emit(event="error", message="%s: %s" % (type(e).__name__, e))
        raise
