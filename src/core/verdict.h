/*
 * A verdict on a peer: what code a peer calls into (its rooms, its
 * handshake) says back to it, instead of acting on the peer itself.  The
 * peer acts on it once the call has returned (kvf__peer_heed, peer.h), so
 * no call re-enters the peer's code while its own call is on the stack.
 *
 * This header stands below engine.h and peer.h and names neither, so
 * that a header beneath them (auth.h) can name a verdict too.
 */
#ifndef KVF_CORE_VERDICT_H
#define KVF_CORE_VERDICT_H

#include "kvferry/kvferry.h"

/*
 * KVF_OK, the peer goes on; any other status, the peer is broken, and
 * fails with st and `why`.  A room never fails its peer itself (room.h,
 * kvf_room_ops_t): that fails every room on the peer, which would re-enter
 * room code while the room's own call is still on the stack.
 */
typedef struct kvf_verdict {
    kvf_status_t st;
    char         why[KVF_REASON_MAX];
} kvf_verdict_t;

/* The peer goes on (only st and the reason's end are written: this is
 * said once per frame). */
static inline kvf_verdict_t kvf__verdict_ok(void)
{
    kvf_verdict_t v;
    v.st = KVF_OK;
    v.why[0] = '\0';
    return v;
}

#endif /* KVF_CORE_VERDICT_H */
