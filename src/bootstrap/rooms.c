/*
 * Room -> DP rank map (see rooms.h): a linear-probing table plus a FIFO of
 * insertion order for oldest-first eviction.  Both grow on demand (the
 * table doubles at half load, the FIFO up to `max`), so an idle registry
 * holds a few kilobytes and a full one about 40 bytes per room.
 */
#include "bootstrap/rooms.h"

#include <stdlib.h>
#include <string.h>

static size_t room_hash(uint64_t x)
{
    x ^= x >> 30; x *= 0xbf58476d1ce4e5b9ull;
    x ^= x >> 27; x *= 0x94d049bb133111ebull;
    x ^= x >> 31;
    return (size_t)x;
}

static kvf_bs_room_slot_t *room_find(const kvf_bs_rooms_t *m, uint64_t room)
{
    if (m->slots == NULL)
        return NULL;
    for (size_t i = room_hash(room) & m->slot_mask;;
         i = (i + 1) & m->slot_mask) {
        if (!m->slots[i].used)
            return NULL;
        if (m->slots[i].room == room)
            return &m->slots[i];
    }
}

static void room_place(kvf_bs_room_slot_t *slots, size_t mask, uint64_t room,
                       int32_t dp_rank, char *note)
{
    size_t i = room_hash(room) & mask;
    while (slots[i].used)
        i = (i + 1) & mask;
    slots[i] = (kvf_bs_room_slot_t){.room = room, .dp_rank = dp_rank,
                                    .used = 1, .note = note};
}

/* Pull each later member of the probe chain back into the hole unless its
 * home slot lies cyclically in (hole, j]: then it is reachable already. */
static void room_delete(kvf_bs_rooms_t *m, kvf_bs_room_slot_t *s)
{
    size_t mask = m->slot_mask, i = (size_t)(s - m->slots), j = i;

    free(s->note);
    s->note = NULL;
    for (;;) {
        j = (j + 1) & mask;
        if (!m->slots[j].used)
            break;
        size_t k = room_hash(m->slots[j].room) & mask;
        if (i <= j ? (i < k && k <= j) : (i < k || k <= j))
            continue;
        m->slots[i] = m->slots[j];
        i = j;
    }
    m->slots[i].used = 0;
    m->slots[i].note = NULL;
}

/* Make room for one more entry in both the table and the FIFO. */
static int room_reserve(kvf_bs_rooms_t *m)
{
    /* At max, the eviction frees a slot before the insertion takes one. */
    if (m->slots == NULL ||
        (m->count < m->max && (m->count + 1) * 2 > m->slot_mask + 1)) {
        size_t ncap = m->slots ? (m->slot_mask + 1) * 2 : 1024;
        kvf_bs_room_slot_t *ns = calloc(ncap, sizeof(*ns));
        if (ns == NULL)
            return -1;
        for (size_t i = 0; m->slots != NULL && i <= m->slot_mask; i++)
            if (m->slots[i].used)
                room_place(ns, ncap - 1, m->slots[i].room,
                           m->slots[i].dp_rank, m->slots[i].note);
        free(m->slots);
        m->slots = ns;
        m->slot_mask = ncap - 1;
    }
    if (m->count == m->fifo_cap && m->fifo_cap < m->max) {
        size_t ncap = m->fifo_cap ? m->fifo_cap * 2 : 1024;
        if (ncap > m->max)
            ncap = m->max;
        uint64_t *nf = malloc(ncap * sizeof(*nf));
        if (nf == NULL)
            return -1;
        for (size_t i = 0; i < m->count; i++)
            nf[i] = m->fifo[(m->fifo_head + i) % m->fifo_cap];
        free(m->fifo);
        m->fifo = nf;
        m->fifo_cap = ncap;
        m->fifo_head = 0;
    }
    return 0;
}

void kvf__bs_rooms_init(kvf_bs_rooms_t *m, size_t max)
{
    *m = (kvf_bs_rooms_t){.max = max ? max : 1};
}

void kvf__bs_rooms_free(kvf_bs_rooms_t *m)
{
    for (size_t i = 0; m->slots != NULL && i <= m->slot_mask; i++)
        free(m->slots[i].note);
    free(m->slots);
    free(m->fifo);
    kvf__bs_rooms_init(m, m->max);
}

int kvf__bs_rooms_put(kvf_bs_rooms_t *m, uint64_t room, int dp_rank)
{
    return kvf__bs_rooms_put_note(m, room, dp_rank, NULL);
}

int kvf__bs_rooms_put_note(kvf_bs_rooms_t *m, uint64_t room, int dp_rank,
                           const char *note)
{
    kvf_bs_room_slot_t *s = room_find(m, room);
    char *copy = note ? strdup(note) : NULL;

    if (note != NULL && copy == NULL)
        return -1;
    if (s != NULL) {
        s->dp_rank = dp_rank;
        free(s->note);
        s->note = copy;
        return 0;
    }
    if (room_reserve(m) != 0) {
        free(copy);
        return -1;
    }
    if (m->count == m->max) {
        kvf_bs_room_slot_t *old = room_find(m, m->fifo[m->fifo_head]);
        if (old != NULL)
            room_delete(m, old);
        m->fifo_head = (m->fifo_head + 1) % m->fifo_cap;
        m->count--;
    }
    room_place(m->slots, m->slot_mask, room, dp_rank, copy);
    m->fifo[(m->fifo_head + m->count) % m->fifo_cap] = room;
    m->count++;
    return 0;
}

int kvf__bs_rooms_get(const kvf_bs_rooms_t *m, uint64_t room)
{
    const kvf_bs_room_slot_t *s = room_find(m, room);
    return s ? s->dp_rank : -1;
}

const char *kvf__bs_rooms_note(const kvf_bs_rooms_t *m, uint64_t room)
{
    const kvf_bs_room_slot_t *s = room_find(m, room);
    return s ? s->note : NULL;
}
