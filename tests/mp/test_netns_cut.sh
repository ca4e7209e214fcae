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

source "$here/netns_lib.sh"
if ! netns_pair_up; then
    echo "SKIP: $NETNS_WHY"
    exit 0
fi

# The ranks listen on addresses other than loopback, so they need a
# cluster token (protected mode refuses them otherwise): one for this run.
export KVF_AUTH_TOKEN="${KVF_AUTH_TOKEN:-$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')}"

# The driver runs inside the prefill namespace: the registry and the
# prefill rank are its children there; the decode rank is started in the
# other namespace, and the cut is the prefill side's link going down.
timeout 150 ip netns exec "$NETNS_PRE" python3 "$here/netns_cut.py" "$KVFERRY" \
    "$NETNS_PRE_LINK" "$NETNS_DEC" "$NETNS_PRE_IP" "$NETNS_DEC_IP"
