/*
 * A free list of page (or slot) indices, as a scheduler's KV allocator.
 *
 * Scattered mode takes each index uniformly at random from what is free,
 * so a room's pages are neither consecutive nor ordered: the worst case for
 * the engine's segment coalescing, and what a busy decode server looks like.
 * Contiguous mode is a LIFO stack that starts in ascending order, so a
 * fresh pool hands out consecutive runs.
 */
#ifndef KVT_POOL_H
#define KVT_POOL_H

#include <stdint.h>

typedef struct kvt_pool {
    uint32_t *free;     /* indices available */
    uint32_t  nfree;
    uint32_t  cap;
    int       scatter;
    uint64_t  rng;      /* splitmix64 state */
} kvt_pool_t;

/** Pool of indices [0, n).  @return 0, or -1 when out of memory. */
int kvt_pool_init(kvt_pool_t *p, uint32_t n, int scatter, uint64_t seed);
void kvt_pool_fini(kvt_pool_t *p);

/** Take n indices into out[].  @return 0, or -1 (fewer than n free). */
int kvt_pool_take(kvt_pool_t *p, uint32_t n, uint32_t *out);

/** Return n indices taken earlier. */
void kvt_pool_give(kvt_pool_t *p, const uint32_t *idx, uint32_t n);

#endif /* KVT_POOL_H */
