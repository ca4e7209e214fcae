#!/usr/bin/env bash
# The live progress line of `kvferry demo` and `kvferry bench`: drawn on
# a terminal (a pseudo-terminal here), with rooms done, GB/s and failures,
# and erased before the report; never drawn under --json, nor when stdout
# and stderr are pipes.  The registry child's lines (its access rule, the
# signal that stops it) stay out of the output either way.  Then `bench
# --plot` writes a PNG (gnuplot).
set -euo pipefail
KVFERRY=${KVFERRY:-build/kvferry}
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

python3 - "$KVFERRY" "$TMP" <<'PY'
import os, pty, select, subprocess, sys, time

kvf, tmp = sys.argv[1], sys.argv[2]
DEMO = [kvf, "demo", "--model", "tiny", "--tokens", "2048", "--chunk", "256",
        "--requests", "16", "--concurrency", "2", "--timeout", "90"]
BENCH = [kvf, "bench", "--model", "tiny", "--tokens", "2048", "--requests", "200",
         "--timeout", "90"]

def on_pty(argv):
    """Run argv with stdout and stderr on a pseudo-terminal: (exit, output)."""
    pid, fd = pty.fork()
    if pid == 0:
        os.execv(argv[0], argv)
    out, end = b"", time.monotonic() + 120
    while time.monotonic() < end:
        r, _, _ = select.select([fd], [], [], 1.0)
        if not r:
            continue
        try:
            chunk = os.read(fd, 65536)
        except OSError:          # EIO: the child closed the terminal
            break
        if not chunk:
            break
        out += chunk
    _, status = os.waitpid(pid, 0)
    os.close(fd)
    return os.waitstatus_to_exitcode(status), out.decode(errors="replace")

def piped(argv):
    p = subprocess.run(argv, capture_output=True, timeout=120)
    return p.returncode, (p.stdout + p.stderr).decode(errors="replace")

def quiet_registry(cmd, out):
    assert "kvferry bootstrap:" not in out, (cmd, out[-800:])

for cmd, argv in (("demo", DEMO), ("bench", BENCH)):
    rc, out = on_pty(argv)
    assert rc == 0, (cmd, rc, out[-1500:])
    line = "\rkvferry %s: " % cmd
    assert line in out, (cmd, "no progress line on a terminal", out[-1500:])
    drawn = [l for l in out.split("\r") if l.startswith("kvferry %s: " % cmd) and " rooms " in l]
    assert drawn and all("GB/s" in l and "failed" in l for l in drawn), drawn[-3:]
    assert "\r\x1b[K" in out, (cmd, "the line was not erased before the report")
    report = out.rsplit("\r\x1b[K", 1)[1]
    assert "kvferry %s" % cmd in report or "result" in report, report[:400]
    quiet_registry(cmd, out)
    print("ok: %s draws %d progress lines on a terminal, e.g. %r" % (cmd, len(drawn), drawn[-1].strip()[:90]))

    rc, out = on_pty(argv + ["--json"])
    assert rc == 0, (cmd, rc, out[-1500:])
    assert line not in out and "\x1b[K" not in out, (cmd, "progress under --json", out[-800:])
    quiet_registry(cmd, out)
    rc, out = piped(argv)
    assert rc == 0, (cmd, rc, out[-1500:])
    assert "\r" not in out and "\x1b[" not in out, (cmd, "progress on a pipe", out[-800:])
    quiet_registry(cmd, out)
    print("ok: %s draws nothing under --json on a terminal, nor on pipes" % cmd)
PY

# bench --plot: a PNG, named in the figures.
"$KVFERRY" bench --model tiny --tokens 2048 --requests 100 --timeout 90 --json \
    --plot "$TMP/bench.png" >"$TMP/bench.json"
python3 - "$TMP/bench.json" "$TMP/bench.png" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
assert d["ok"] and d["plot"] == sys.argv[2], (d.get("ok"), d.get("plot"), d.get("error"))
head = open(sys.argv[2], "rb").read(8)
assert head == b"\x89PNG\r\n\x1a\n", head
print("ok: bench --plot wrote a PNG of %d rooms at %.2f GB/s" % (d["rooms"], d["gbps"]))
PY
# An unwritable file: the bench says so and fails.
rc=0
"$KVFERRY" bench --model tiny --tokens 2048 --requests 20 --timeout 90 --json \
    --plot /nonexistent-dir/x.png >"$TMP/bad.json" 2>"$TMP/bad.log" || rc=$?
[ "$rc" = 1 ] && grep -q "plot /nonexistent-dir/x.png" "$TMP/bad.log" \
    || { cat "$TMP/bad.log"; echo "FAIL: bench --plot to an unwritable file exited $rc"; exit 1; }
echo "ok: bench --plot to an unwritable file fails (exit 1) and says why"
