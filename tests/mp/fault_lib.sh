# Shared by tests/mp/test_fault_*.sh (sourced, not a test itself): run
# `kvferry demo --fault KIND@WHEN` on the tiny model and judge its JSON
# with fault_check.py.
#
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
# ucx too when built (over UCX's tcp: its shared memory refuses the peer
# failure handling kvferry needs; tcp moves reads in software, which a
# prefill engine offers only when told: allowed here, all on loopback).
if "$KVFERRY" version | grep -q '^transports:.*ucx'; then
    FAULT_TRANSPORTS=${FAULT_TRANSPORTS:-tcp shm ucx}
    export UCX_TLS=${UCX_TLS:-tcp}
    export KVF_UCX_SOFTWARE_RMA=${KVF_UCX_SOFTWARE_RMA:-allow}
fi
FAULT_TRANSPORTS=${FAULT_TRANSPORTS:-tcp shm}

# fault_run SPEC [demo options...]
fault_run() {
    local spec=$1 rc=0
    shift
    local kind=${spec%@*} rooms=(--requests 4 --concurrency 4)
    case $kind in
        reset|corrupt|badaddr) rooms=(--requests 8 --concurrency 2 --checksum) ;;
    esac
    timeout 120 "$KVFERRY" demo --json --model tiny --tokens 2048 --chunk 256 \
        "${rooms[@]}" --after-fault-requests "$FAULT_AFTER" --timeout 90 \
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

# fault_matrix KIND: every WHEN for one KIND, over every transport.
fault_matrix() {
    local failed=0
    for transport in $FAULT_TRANSPORTS; do
        if [ "$transport" = ucx ] && [ "${1%%-*}" = kill ] && ! ucx_survives_kill; then
            echo "SKIP: $1 over ucx: this UCX can abort the surviving process when its peer dies during connection setup (openucx/ucx#8175, fixed in UCX 1.14)"
            continue
        fi
        for when in bootstrap mid last; do
            FAULT_WANT=$transport fault_run "$1@$when" --transport "$transport" || failed=1
        done
    done
    return $failed
}
