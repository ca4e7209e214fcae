/*
 * Room -> small integer map, bounded: once it holds `max` rooms, putting a
 * new one forgets the oldest.  The registry keeps two: the DP rank of POST
 * /register_dp_rank, and the readiness of POST /room_ready (with a note,
 * the reason a room failed).
 *
 * A linear-probing hash table (backward-shift deletion, no tombstones)
 * plus a FIFO ring of rooms in insertion order in which every live room
 * appears exactly once, so eviction is O(1).  Not thread-safe: the
 * registry calls it under its lock.
 */
#ifndef KVF_BOOTSTRAP_ROOMS_H
#define KVF_BOOTSTRAP_ROOMS_H

#include <stddef.h>
#include <stdint.h>

typedef struct kvf_bs_room_slot {
    uint64_t room;
    int32_t  dp_rank;         /* the value */
    uint32_t used;
    char    *note;            /* owned; NULL: none */
} kvf_bs_room_slot_t;

typedef struct kvf_bs_rooms {
    kvf_bs_room_slot_t *slots;
    size_t              slot_mask;
    uint64_t           *fifo;
    size_t              fifo_cap, fifo_head;
    size_t              count, max;
} kvf_bs_rooms_t;

void kvf__bs_rooms_init(kvf_bs_rooms_t *m, size_t max);
void kvf__bs_rooms_free(kvf_bs_rooms_t *m);
/* Insert or update.  @return 0, or -1 when out of memory (m unchanged). */
int  kvf__bs_rooms_put(kvf_bs_rooms_t *m, uint64_t room, int dp_rank);
/* As put, with a note (copied; NULL: none) replacing the room's old one. */
int  kvf__bs_rooms_put_note(kvf_bs_rooms_t *m, uint64_t room, int value,
                            const char *note);
/* @return the room's value (DP rank), or -1 when unknown. */
int  kvf__bs_rooms_get(const kvf_bs_rooms_t *m, uint64_t room);
/* @return the room's note, valid until the map changes; NULL: none. */
const char *kvf__bs_rooms_note(const kvf_bs_rooms_t *m, uint64_t room);

#endif /* KVF_BOOTSTRAP_ROOMS_H */
