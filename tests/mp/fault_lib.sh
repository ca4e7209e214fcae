# Shared by tests/mp/test_fault_*.sh (sourced, not a test itself): run
# `kvferry demo --fault KIND@WHEN` and judge its JSON with fault_check.py.
#
# Rooms are the tiny model's unless fault_big is called first (below).
# Process faults (kill, stop, registry-down) run 4 rooms, all in flight at
# once: every room is touched, and each resolves within the engines'
# heartbeat timeout or the demo's 3 s room deadlines.  Engine faults
# (reset, corrupt) run 8 rooms, 2 in flight, so that rooms after the fault
# must still succeed.  Every run ends with 4 fresh rooms that must succeed.
# Each KIND@WHEN runs over every transport in FAULT_TRANSPORTS (tcp: the
# payload on the socket; shm: the decode side pulls it from the prefill
# process's memory).

KVFERRY=${KVFERRY:-build/kvferry}
FAULT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
FAULT_TMP=$(mktemp -d)
trap 'rm -rf "$FAULT_TMP"' EXIT
FAULT_AFTER=4
FAULT_SIZE=(--model tiny --tokens 2048 --chunk 256)
FAULT_PROCESS_ROOMS=(--requests 4 --concurrency 4)
FAULT_ENGINE_ROOMS=(--requests 8 --concurrency 2)
FAULT_TIMEOUT=90
# ucx too when built (over UCX's tcp: its shared memory refuses the peer
# failure handling kvferry needs; tcp moves reads in software, which a
# prefill engine offers only when told: allowed here, all on loopback).
if "$KVFERRY" version | grep -q '^transports:.*ucx'; then
    FAULT_TRANSPORTS=${FAULT_TRANSPORTS:-tcp shm ucx}
    export UCX_TLS=${UCX_TLS:-tcp}
    export KVF_UCX_SOFTWARE_RMA=${KVF_UCX_SOFTWARE_RMA:-allow}
fi
FAULT_TRANSPORTS=${FAULT_TRANSPORTS:-tcp shm}

# fault_big: from here on, rooms of a real model's size.  The tiny model
# never has more than a few KiB in flight; a llama3-8b room of 2048 tokens
# is 256 MiB, sent in two chunks of 128 MiB, so at "mid" a whole chunk is
# on its way: 8 times the 16 MiB of pulled reads a decode rank keeps in
# flight per peer (KVF_READ_WINDOW), so that its stream is held, with
# more queued behind it, when the fault strikes.  Two rooms in flight, two
# fresh ones after; about 1 GiB of KV memory per rank.
fault_big() {
    FAULT_SIZE=(--model llama3-8b --tokens 2048 --chunk 1024)
    FAULT_PROCESS_ROOMS=(--requests 2 --concurrency 2)
    FAULT_ENGINE_ROOMS=(--requests 2 --concurrency 2)
    FAULT_AFTER=2
    # A hang shows as rooms unresolved at the timeout: no need to wait
    # for it the tiny runs' 90 s.
    FAULT_TIMEOUT=40
    # Pulled (shm, ucx), a room's bytes are read by the decode side after
    # the prefill side has named them all, and the prefill side's
    # Transferring deadline counts from then: on a loaded 2-CPU host the
    # decode can take more than the demo's 3 s to read two 256 MiB rooms,
    # and the prefill fails rooms that are moving.  These faults resolve
    # by heartbeats and lost connections (2.5 s), not by that deadline.
    export KVF_TRANSFER_TIMEOUT_MS=${KVF_TRANSFER_TIMEOUT_MS:-10000}
    # The same for WaitingForInput, which counts from a decode rank's
    # request to the prefill rank's first send: the demo's prefill rank
    # "computes" (fills) each 128 MiB chunk before it sends it, one chunk
    # of one room per turn, and on a loaded host that takes more than 3 s
    # for the second room.  Its rooms then failed by that deadline, rightly
    # ("the scheduler did not call kvf_sender_send", or the decode rank's
    # "no data from the prefill side yet" before the stopped prefill's
    # heartbeat timeout): the demo's pace, not the fault's.
    export KVF_WAITING_TIMEOUT_MS=${KVF_WAITING_TIMEOUT_MS:-10000}
}

# fault_big_gate: the big rooms in the release build only.  Instrumented,
# a run moves and checks its 1 GiB several times slower, and under TSan
# every byte touched costs 4 bytes of shadow memory; the sanitizers watch
# the same code paths in the tiny runs and in test_chaos.sh.  Exits the
# test (with a SKIP line) in a sanitizer build.
fault_big_gate() {
    if [ "${KVF_TEST_SANITIZER:-none}" != none ]; then
        echo "SKIP: the real-size fault runs are for the release build (this one: -fsanitize=$KVF_TEST_SANITIZER)"
        exit 0
    fi
}

# fault_run SPEC [demo options...]
fault_run() {
    local spec=$1 rc=0
    shift
    local kind=${spec%@*} rooms=("${FAULT_PROCESS_ROOMS[@]}")
    case $kind in
        reset|corrupt|badaddr) rooms=("${FAULT_ENGINE_ROOMS[@]}" --checksum) ;;
    esac
    timeout $((FAULT_TIMEOUT + 30)) "$KVFERRY" demo --json "${FAULT_SIZE[@]}" \
        "${rooms[@]}" --after-fault-requests "$FAULT_AFTER" --timeout "$FAULT_TIMEOUT" \
        --fault "$spec" "$@" >"$FAULT_TMP/out.json" 2>"$FAULT_TMP/err.log" || rc=$?
    if ! python3 "$FAULT_DIR/fault_check.py" "$spec" "$rc" "$FAULT_AFTER" \
            "$FAULT_TMP/out.json" "${FAULT_WANT:-}"; then
        echo "--- last lines of the demo's log (exit $rc):"
        tail -n 40 "$FAULT_TMP/err.log"
        return 1
    fi
}

# UCX before 1.14 can abort the surviving process when its peer dies while
# UCX still sets up the connection (openucx/ucx#8175): no kill over it.
ucx_survives_kill() {
    "$KVFERRY" version | grep -q 'ucx(1\.\(1[0-3]\|[0-9]\)\.' && return 1
    return 0
}

# fault_matrix KIND [WHEN...]: each WHEN (default: bootstrap, mid and
# last) for one KIND, over every transport.
fault_matrix() {
    local kind=$1 failed=0
    shift
    local whens=("$@")
    [ ${#whens[@]} -gt 0 ] || whens=(bootstrap mid last)
    for transport in $FAULT_TRANSPORTS; do
        if [ "$transport" = ucx ] && [ "${kind%%-*}" = kill ] && ! ucx_survives_kill; then
            echo "SKIP: $kind over ucx: this UCX can abort the surviving process when its peer dies during connection setup (openucx/ucx#8175, fixed in UCX 1.14)"
            continue
        fi
        for when in "${whens[@]}"; do
            FAULT_WANT=$transport fault_run "$kind@$when" --transport "$transport" || failed=1
        done
    done
    return $failed
}
