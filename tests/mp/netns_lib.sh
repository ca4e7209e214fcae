# Shared by the tests that cut a network link (sourced, not a test
# itself): two network namespaces, "prefill" and "decode", joined by a
# veth pair, with an address on each end and loopback up in both; removed
# when the test exits.  Needs root (CAP_SYS_ADMIN, CAP_NET_ADMIN).
#
#   netns_pair_up || { echo "SKIP: $NETNS_WHY"; ...; }
#
# sets NETNS_PRE, NETNS_DEC (namespace names), NETNS_PRE_LINK,
# NETNS_DEC_LINK (the veth ends, one in each), NETNS_PRE_IP, NETNS_DEC_IP.
# Cutting the link: ip -n "$NETNS_PRE" link set "$NETNS_PRE_LINK" down.

netns_cleanup() {
    ip netns del "$NETNS_PRE" 2>/dev/null || true
    ip netns del "$NETNS_DEC" 2>/dev/null || true
    ip link del "$NETNS_PRE_LINK" 2>/dev/null || true
}

netns_pair_up() {
    local probe=kvfprobe$$
    if ! ip netns add "$probe" 2>/dev/null; then
        NETNS_WHY="cannot create network namespaces here (ip netns add needs root)"
        return 1
    fi
    ip netns del "$probe"
    # Interface names are at most 15 characters; the addresses exist only
    # inside the two namespaces.
    NETNS_PRE=kvfpre$$ NETNS_DEC=kvfdec$$ NETNS_PRE_LINK=kvvp$$ NETNS_DEC_LINK=kvvd$$
    NETNS_PRE_IP=10.213.71.1 NETNS_DEC_IP=10.213.71.2
    trap netns_cleanup EXIT
    ip netns add "$NETNS_PRE"
    ip netns add "$NETNS_DEC"
    ip link add "$NETNS_PRE_LINK" type veth peer name "$NETNS_DEC_LINK"
    ip link set "$NETNS_PRE_LINK" netns "$NETNS_PRE"
    ip link set "$NETNS_DEC_LINK" netns "$NETNS_DEC"
    ip -n "$NETNS_PRE" addr add "$NETNS_PRE_IP/24" dev "$NETNS_PRE_LINK"
    ip -n "$NETNS_DEC" addr add "$NETNS_DEC_IP/24" dev "$NETNS_DEC_LINK"
    for ns in "$NETNS_PRE" "$NETNS_DEC"; do ip -n "$ns" link set lo up; done
    ip -n "$NETNS_PRE" link set "$NETNS_PRE_LINK" up
    ip -n "$NETNS_DEC" link set "$NETNS_DEC_LINK" up
}
