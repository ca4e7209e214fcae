# Shared by tests/mp/test_siblings_*.sh (sourced, not a test itself): the
# demo's faults on one parallel shape, judged by fault_check.py, whose
# sibling rules (siblings.py) ask that every rank of a room, on both
# sides, end in the room's one state and name its one root cause.
#
# The demo's ranks keep each room until every rank of it is final and
# then wait for the cause where their own room had not failed (rank.c),
# as a scheduler does: so a rank whose own pair moved every byte must
# still report FAILED, naming the rank that failed the request.
#
# Each shape runs every fault kind once, at the phase and over the
# transport its script picks: the shapes together cover each kind at
# bootstrap, mid and last, over tcp and shm.

source "$(dirname "${BASH_SOURCE[0]}")/fault_lib.sh"

# sibling_matrix TRANSPORT "SHAPE OPTIONS" SPEC...
sibling_matrix() {
    local transport=$1 shape=$2 failed=0
    shift 2
    for spec in "$@"; do
        # shellcheck disable=SC2086
        FAULT_WANT=$transport fault_run "$spec" --transport "$transport" $shape || failed=1
    done
    return $failed
}
