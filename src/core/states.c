/*
 * A room's state indices (room.h, kvf_states_t): the per-group index
 * arrays a sender copies from its application and a destination brings in
 * its ROOM_REQ.  Plain arrays, made and freed here with no engine state,
 * so that whoever holds one (a link, a stashed destination) frees it
 * without calling room.c.
 */
#include <stdlib.h>
#include <string.h>

#include "core/room.h"

kvf_status_t kvf__states_set(kvf_states_t *s, const kvf_indices_t *in, size_t n)
{
    uint64_t total = 0;

    memset(s, 0, sizeof(*s));
    for (size_t g = 0; g < n; g++)
        total += in[g].n;
    if (n == 0)
        return KVF_OK;
    s->count = malloc(n * sizeof(uint32_t));
    s->idx = malloc((total ? total : 1) * sizeof(uint32_t));
    if (s->count == NULL || s->idx == NULL) {
        kvf__states_free(s);
        return KVF_ERR_NO_MEMORY;
    }
    s->ngroups = (uint32_t)n;
    for (size_t g = 0; g < n; g++) {
        s->count[g] = (uint32_t)in[g].n;
        if (in[g].n > 0)
            memcpy(s->idx + s->total, in[g].idx, in[g].n * sizeof(uint32_t));
        s->total += (uint32_t)in[g].n;
    }
    return KVF_OK;
}

kvf_status_t kvf__states_from_wire(kvf_states_t *s, const kvf_wire_arr32_t *counts,
                                   const kvf_wire_arr32_t *idx)
{
    memset(s, 0, sizeof(*s));
    if (counts->count == 0)
        return KVF_OK;
    s->count = malloc(counts->count * sizeof(uint32_t));
    s->idx = malloc((idx->count ? idx->count : 1) * sizeof(uint32_t));
    if (s->count == NULL || s->idx == NULL) {
        kvf__states_free(s);
        return KVF_ERR_NO_MEMORY;
    }
    s->ngroups = counts->count;
    s->total = idx->count;
    for (uint32_t g = 0; g < counts->count; g++)
        s->count[g] = kvf_wire_arr32_at(counts, g);
    for (uint32_t i = 0; i < idx->count; i++)
        s->idx[i] = kvf_wire_arr32_at(idx, i);
    return KVF_OK;
}

void kvf__states_free(kvf_states_t *s)
{
    free(s->count);
    free(s->idx);
    memset(s, 0, sizeof(*s));
}
