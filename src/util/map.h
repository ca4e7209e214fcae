/*
 * A hash map from 64-bit keys to pointers: open addressing, linear probing,
 * backward-shift deletion (no tombstones), so lookups stay short however
 * many rooms come and go.  Not thread-safe: the owner locks.
 */
#ifndef KVF_UTIL_MAP_H
#define KVF_UTIL_MAP_H

#include <stddef.h>
#include <stdint.h>

#include "kvferry/status.h"

typedef struct kvf_map_slot {
    uint64_t key;
    void    *val;     /* NULL: empty slot */
} kvf_map_slot_t;

typedef struct kvf_map {
    kvf_map_slot_t *slots;
    size_t          cap;    /* power of two, or 0 */
    size_t          count;
} kvf_map_t;

void         kvf_map_init(kvf_map_t *m);
void         kvf_map_free(kvf_map_t *m);
void        *kvf_map_get(const kvf_map_t *m, uint64_t key);
/* Insert or replace; val must not be NULL.  Replacing never allocates (never
 * fails). */
kvf_status_t kvf_map_put(kvf_map_t *m, uint64_t key, void *val);
/* @return the removed value, or NULL. */
void        *kvf_map_del(kvf_map_t *m, uint64_t key);
/* The values one by one, in no order: start with *pos = 0; @return NULL
 * after the last.  The map may not change meanwhile. */
void        *kvf_map_next(const kvf_map_t *m, size_t *pos);

#endif /* KVF_UTIL_MAP_H */
