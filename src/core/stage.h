/*
 * Staging: device memory over the tcp stream, through pinned host bounce
 * buffers and the engine's copier (transport/copier.h).
 *
 * Prefill: kvf__stage_put wraps a chunk's put.  It pulls the chunk's
 * segments ahead of the connection into a ring of bounce slots, each at
 * most one DATA frame (4 MiB, 1023 segments, 8192 pieces), starts the
 * device-to-host copy of every filled slot, and yields a slot's segments
 * to the connection once its copy has ended, pointing into the bounce
 * buffer; it ends the frame at the slot's end (KVF_PUT_WAIT) and takes
 * the slot back when the connection says the frame is written (sent).  So
 * the copy of slot k+1..k+3 runs while slot k is on the wire.  Segments
 * of host memory (SGLang's aux) go as they are.  A room that fails stops
 * the put at the next segment, once no copy still reads its pages.
 *
 * Decode: receiver.c points a DATA frame's device pieces into a bounce
 * buffer, and when the frame is in, starts the host-to-device copy as a
 * read (counted, and its pages held, exactly like a mover's) while the
 * stream goes on with the next frame.
 */
#ifndef KVF_CORE_STAGE_H
#define KVF_CORE_STAGE_H

#include <stddef.h>
#include <stdint.h>

#include "kvferry/kvferry.h"
#include "transport/transport.h"

/* Is a segment of buffer kind `kind` (KVF_BUF_*) in device memory here? */
int kvf__seg_on_device(const kvf_engine_t *eng, uint8_t kind);

/* What a staged put tells the owner of the put it wraps. */
typedef struct kvf_stage_cbs {
    /* Each yielded piece's bytes, in payload order (the bounce copy). */
    void (*hash)(kvf_put_t *inner, const void *p, size_t n);
    /* A copy failed: why (before the put completes with the status). */
    void (*fail)(kvf_put_t *inner, kvf_status_t st, const char *why);
} kvf_stage_cbs_t;

/*
 * Wrap `inner` (a put whose source may be device memory) into a staged
 * put.  Completing the wrapper completes inner, once no copy of it is in
 * flight.  @return the wrapper, or NULL (no memory: the caller fails the
 * chunk).
 */
kvf_put_t *kvf__stage_put(kvf_engine_t *eng, kvf_put_t *inner, const kvf_stage_cbs_t *cbs);

/* Pinned bounce buffers, pooled per engine: at least len bytes (*cap_p
 * gets the real size), or NULL.  Progress thread, engine lock held. */
void *kvf__bounce_get(kvf_engine_t *eng, size_t len, size_t *cap_p);
void  kvf__bounce_put(kvf_engine_t *eng, void *p, size_t cap);
/* Free the pool (engine destroy, after the copier handed everything back). */
void  kvf__bounce_free_all_unlocked(kvf_engine_t *eng);

/* Serve the copier: hand back finished copies, then take in the reads
 * among them (receiver.c). */
void kvf__engine_progress_copier(kvf_engine_t *eng);

#endif /* KVF_CORE_STAGE_H */
