#!/usr/bin/env bash
# A network cut between one pair of ranks: every rank in a network
# namespace of its own, all joined by a bridge in a hub namespace, and the
# link between prefill rank 0 and decode rank 0 alone cut while the first
# room is mid-transfer (a blackhole route to each other in both: no FIN,
# no RST, packets just vanish), every other pair and sibling link up.
# Each parallel shape (TP 1 -> 1, TP 2 -> 2, TP 4 -> 4, PP 2, prefill DP 2)
# runs once (netns_cut.py): every room ends on every rank of both sides
# as one, FAILED naming the cut pair (the rank that saw its peer go
# silent, or the one that told it), within 5 s of the cut; with DP 2 the
# other group's rooms succeed; once the route is back (a first batch may
# still meet an end that had not timed out its dead connection, and fail
# naming that silence), fresh rooms succeed.  Needs root (CAP_SYS_ADMIN,
# CAP_NET_ADMIN): skipped otherwise.
set -euo pipefail
KVFERRY=$(realpath "${KVFERRY:-build/kvferry}")
here=$(cd "$(dirname "$0")" && pwd)

probe=kvfprobe$$
if ! ip netns add "$probe" 2>/dev/null; then
    echo "SKIP: cannot create network namespaces here (ip netns add needs root)"
    exit 0
fi
ip netns del "$probe"

# The largest shape: 4 prefill and 4 decode ranks, one namespace each, on
# 10.213.71.0/24 (prefill rank i at .10+i, decode rank j at .50+j, the hub
# at .254); the addresses exist only inside these namespaces.
hub=kvc$$h
ranks=(p0 p1 p2 p3 d0 d1 d2 d3)
cleanup() {
    for r in "${ranks[@]}"; do ip netns del "kvc$$$r" 2>/dev/null || true; done
    ip netns del "$hub" 2>/dev/null || true
}
trap cleanup EXIT

ip netns add "$hub"
ip -n "$hub" link add br0 type bridge
ip -n "$hub" addr add 10.213.71.254/24 dev br0
ip -n "$hub" link set br0 up
ip -n "$hub" link set lo up
for r in "${ranks[@]}"; do
    ns=kvc$$$r
    case $r in p*) ip=10.213.71.$((10 + ${r#p})) ;; d*) ip=10.213.71.$((50 + ${r#d})) ;; esac
    ip netns add "$ns"
    ip -n "$hub" link add "$r" type veth peer name eth0 netns "$ns"
    ip -n "$hub" link set "$r" master br0
    ip -n "$hub" link set "$r" up
    ip -n "$ns" addr add "$ip/24" dev eth0
    ip -n "$ns" link set eth0 up
    ip -n "$ns" link set lo up
done

# The ranks listen on addresses other than loopback, so they need a
# cluster token (protected mode refuses them otherwise): one for this run.
export KVF_AUTH_TOKEN="${KVF_AUTH_TOKEN:-$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')}"

# The driver runs in the hub: the registry is its child there; each rank
# is started in its own namespace.
timeout 250 ip netns exec "$hub" python3 "$here/netns_cut.py" "$KVFERRY" "kvc$$" \
    10.213.71.254
