#!/usr/bin/env bash
# A network cut: a prefill rank in one network namespace, a decode rank in
# another, joined by a veth pair.  The link goes down while the first room
# is mid-transfer: no FIN, no RST, packets just vanish.  Every room must
# still end on both sides, FAILED with a reason naming the peer, within
# 5 s of the cut (heartbeats); once the link is back, fresh rooms succeed.
# Needs root (CAP_SYS_ADMIN, CAP_NET_ADMIN): skipped otherwise.
set -euo pipefail
KVFERRY=$(realpath "${KVFERRY:-build/kvferry}")
here=$(cd "$(dirname "$0")" && pwd)

probe=kvfprobe$$
if ! ip netns add "$probe" 2>/dev/null; then
    echo "SKIP: cannot create network namespaces here (ip netns add needs root)"
    exit 0
fi
ip netns del "$probe"

# Interface names are at most 15 characters; the addresses exist only
# inside the two namespaces.
nsp=kvfpre$$ nsd=kvfdec$$ vp=kvvp$$ vd=kvvd$$
pre_ip=10.213.71.1 dec_ip=10.213.71.2
cleanup() {
    ip netns del "$nsp" 2>/dev/null || true
    ip netns del "$nsd" 2>/dev/null || true
    ip link del "$vp" 2>/dev/null || true
}
trap cleanup EXIT

ip netns add "$nsp"
ip netns add "$nsd"
ip link add "$vp" type veth peer name "$vd"
ip link set "$vp" netns "$nsp"
ip link set "$vd" netns "$nsd"
ip -n "$nsp" addr add "$pre_ip/24" dev "$vp"
ip -n "$nsd" addr add "$dec_ip/24" dev "$vd"
for ns in "$nsp" "$nsd"; do ip -n "$ns" link set lo up; done
ip -n "$nsp" link set "$vp" up
ip -n "$nsd" link set "$vd" up

# The ranks listen on addresses other than loopback, so they need a
# cluster token (protected mode refuses them otherwise): one for this run.
export KVF_AUTH_TOKEN="${KVF_AUTH_TOKEN:-$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')}"

# The driver runs inside the prefill namespace: the registry and the
# prefill rank are its children there; the decode rank is started in the
# other namespace, and the cut is the prefill side's link going down.
timeout 150 ip netns exec "$nsp" python3 "$here/netns_cut.py" "$KVFERRY" \
    "$vp" "$nsd" "$pre_ip" "$dec_ip"
