# What the scripts of bench/ share (sourced, after `cd` to the tree's
# root): a scratch directory $TMP and the pids of the servers they start
# ($PIDS), both cleaned up on exit; free_port, server_up, note, need and
# sockperf_pp.
TMP=$(mktemp -d "/tmp/kvferry-$(basename "$0" .sh).XXXXXX")
PIDS=()
bench_cleanup() {
    for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
    rm -rf "$TMP"
}
trap bench_cleanup EXIT

free_port() {
    python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'
}
note() { echo "== $*" >&2; }
need() {   # command, what to do without it
    command -v "$1" >/dev/null || { echo "$(basename "$0"): $1 not found; $2" >&2; exit 1; }
}

server_up() {   # port: wait until something accepts on it (5 s at most)
    python3 - "$1" <<'PY'
import socket, sys, time
end = time.time() + 5
while time.time() < end:
    try:
        socket.create_connection(("127.0.0.1", int(sys.argv[1])), 0.1).close()
        sys.exit(0)
    except OSError:
        time.sleep(0.02)
sys.exit(1)
PY
}

sockperf_pp() {   # round [bytes [file]]: sockperf's TCP ping-pong over loopback
                  # into $TMP/file.round.txt, 64-byte messages by default; its
                  # "latency" is half the round trip: one hop
    local port; port=$(free_port)
    sockperf server --tcp -i 127.0.0.1 -p "$port" >/dev/null 2>&1 &
    PIDS+=($!)
    server_up "$port"
    sockperf ping-pong --tcp -i 127.0.0.1 -p "$port" -t 5 -m "${2:-64}" \
        > "$TMP/${3:-sockperf}.$1.txt" 2>&1 || true
    kill "${PIDS[-1]}" 2>/dev/null || true
    wait "${PIDS[-1]}" 2>/dev/null || true
}
