/*
 * The transport contract: how payload moves from registered local memory
 * into registered remote memory.
 *
 * A transfer is described by a kvf_put_t: an iterator over segments
 * (source pointer, destination buffer kind/index/offset, length) that the
 * transport pulls from as fast as it can move bytes.  Segments are produced
 * lazily because a scattered room can have hundreds of thousands of them
 * (one per page run per layer buffer): nothing proportional to that is ever
 * materialised.
 *
 * Completion contract: put->complete() is called once, on the progress
 * thread, when every segment is either placed in the peer's memory or
 * ordered before any control message the engine queues to that peer
 * afterwards (TCP: the last byte is in the ordered stream; UCX: after a
 * flush).  Either way, a DONE sent after completion reaches the receiver
 * after the data.  A put whose room fails stops at the next segment
 * boundary it can stop at and completes with the room's status.
 *
 * Threads: every op is called on the engine's progress thread with the
 * engine lock held, and calls back the same way.
 */
#ifndef KVF_TRANSPORT_TRANSPORT_H
#define KVF_TRANSPORT_TRANSPORT_H

#include <stdint.h>
#include <sys/uio.h>

#include "kvferry/status.h"
#include "wire/wire.h"

typedef struct kvf_put kvf_put_t;

struct kvf_put {
    /*
     * Produce the next segment: its destination in *seg and its source in
     * *src.  @return 1 when a segment was produced, 0 at the end, or a
     * negative kvf_status_t when the put must stop (its room failed).
     */
    int  (*next)(kvf_put_t *put, kvf_wire_seg_t *seg, const void **src);
    /* Called once, as described above. */
    void (*complete)(kvf_put_t *put, kvf_status_t status);
    uint64_t   room;
    uint32_t   src_rank;
    kvf_put_t *qnext;      /* transport-owned queue link */
};

/*
 * Where an inbound DATA segment goes.  The engine resolves each segment of
 * a frame to a destination (already bounds-checked against what the room
 * declared) or to NULL: discard those bytes.
 */
typedef struct kvf_rx_target {
    uint8_t *dst;
    uint32_t len;
} kvf_rx_target_t;

#endif /* KVF_TRANSPORT_TRANSPORT_H */
