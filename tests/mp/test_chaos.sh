#!/usr/bin/env bash
# Chaos: prefill and decode rank processes over tcp (one stream and two),
# shm and ucx, with rooms of random sizes flowing while faults hit at
# random, seeded times: SIGSTOP/SIGCONT, SIGKILL and restart, connection
# resets (KVF_FAULTS), link cuts (network namespaces).  Every room must
# end on every rank within its deadline, no SUCCESS may carry a wrong
# byte, no process may grow past its memory bound or spin, and after
# each fault fresh rooms must succeed.  chaos.py says how, and why.
#
#   KVF_CHAOS_SECONDS   how long to run (default: 120 s; 45 s in the
#                       sanitizer builds, whose rooms are also 4 times
#                       smaller)
#   KVF_CHAOS_SEED      replay a run (its first line prints the seed)
#
# Link cuts need root (network namespaces); without, the rest runs on
# loopback and a SKIP line says so.
set -euo pipefail
KVFERRY=$(realpath "${KVFERRY:-build/kvferry}")
here=$(cd "$(dirname "$0")" && pwd)

case ${KVF_TEST_SANITIZER:-none} in
    none) seconds=120 scale=1 ;;
    *)    seconds=45 scale=0.25 ;;
esac
seconds=${KVF_CHAOS_SECONDS:-$seconds}
args=(--kvferry "$KVFERRY" --seconds "$seconds" --scale "${KVF_CHAOS_SCALE:-$scale}")
[ -n "${KVF_CHAOS_SEED:-}" ] && args+=(--seed "$KVF_CHAOS_SEED")
# Past the run itself: start-up, the last cycle, and a stuck batch's
# watchdog with its report.
limit=$((seconds + 420))

source "$here/netns_lib.sh"
if netns_pair_up; then
    # The driver runs in the prefill namespace, where the registries and
    # the prefill ranks run too; decode ranks of the tcp and ucx
    # deployments run in the other, across the link.
    export KVF_AUTH_TOKEN="${KVF_AUTH_TOKEN:-$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')}"
    timeout "$limit" ip netns exec "$NETNS_PRE" python3 "$here/chaos.py" "${args[@]}" \
        --netns "$NETNS_DEC" "$NETNS_PRE_LINK" "$NETNS_DEC_LINK" "$NETNS_PRE_IP" "$NETNS_DEC_IP"
else
    echo "SKIP: link cuts: $NETNS_WHY; the other faults run on loopback"
    timeout "$limit" python3 "$here/chaos.py" "${args[@]}"
fi
