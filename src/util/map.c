#include "util/map.h"

#include <stdlib.h>

static size_t slot_of(const kvf_map_t *m, uint64_t key)
{
    key ^= key >> 33;
    key *= 0xff51afd7ed558ccdull;
    key ^= key >> 33;
    return (size_t)key & (m->cap - 1);
}

void kvf_map_init(kvf_map_t *m)
{
    m->slots = NULL;
    m->cap = m->count = 0;
}

void kvf_map_free(kvf_map_t *m)
{
    free(m->slots);
    kvf_map_init(m);
}

void *kvf_map_get(const kvf_map_t *m, uint64_t key)
{
    if (m->cap == 0)
        return NULL;
    for (size_t i = slot_of(m, key);; i = (i + 1) & (m->cap - 1)) {
        if (m->slots[i].val == NULL)
            return NULL;
        if (m->slots[i].key == key)
            return m->slots[i].val;
    }
}

static kvf_status_t grow(kvf_map_t *m)
{
    size_t cap = m->cap ? m->cap * 2 : 64;
    kvf_map_t n = {.slots = calloc(cap, sizeof(kvf_map_slot_t)), .cap = cap};
    if (n.slots == NULL)
        return KVF_ERR_NO_MEMORY;
    for (size_t i = 0; i < m->cap; i++)
        if (m->slots[i].val != NULL)
            kvf_map_put(&n, m->slots[i].key, m->slots[i].val);
    free(m->slots);
    *m = n;
    return KVF_OK;
}

kvf_status_t kvf_map_put(kvf_map_t *m, uint64_t key, void *val)
{
    /* Replacing a value never allocates (callers rely on it). */
    for (size_t i = m->cap ? slot_of(m, key) : 0; m->cap && m->slots[i].val != NULL;
         i = (i + 1) & (m->cap - 1)) {
        if (m->slots[i].key == key) {
            m->slots[i].val = val;
            return KVF_OK;
        }
    }
    if ((m->count + 1) * 4 > m->cap * 3 && grow(m) != KVF_OK)
        return KVF_ERR_NO_MEMORY;
    for (size_t i = slot_of(m, key);; i = (i + 1) & (m->cap - 1)) {
        if (m->slots[i].val == NULL) {
            m->slots[i].key = key;
            m->slots[i].val = val;
            m->count++;
            return KVF_OK;
        }
        if (m->slots[i].key == key) {
            m->slots[i].val = val;
            return KVF_OK;
        }
    }
}

void *kvf_map_del(kvf_map_t *m, uint64_t key)
{
    if (m->cap == 0)
        return NULL;
    size_t mask = m->cap - 1, i = slot_of(m, key);
    while (m->slots[i].val != NULL && m->slots[i].key != key)
        i = (i + 1) & mask;
    void *val = m->slots[i].val;
    if (val == NULL)
        return NULL;
    /* Backward shift: pull later entries of the probe run into the hole. */
    for (size_t j = (i + 1) & mask; m->slots[j].val != NULL; j = (j + 1) & mask) {
        size_t home = slot_of(m, m->slots[j].key);
        if (((j - home) & mask) >= ((j - i) & mask)) {
            m->slots[i] = m->slots[j];
            i = j;
        }
    }
    m->slots[i].val = NULL;
    m->count--;
    return val;
}

void *kvf_map_next(const kvf_map_t *m, size_t *pos)
{
    for (; *pos < m->cap; (*pos)++)
        if (m->slots[*pos].val != NULL)
            return m->slots[(*pos)++].val;
    return NULL;
}
