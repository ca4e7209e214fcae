/*
 * Deterministic KV data for the demo, and the aux record (room tag).
 *
 * The one idea: every byte is a function of LOGICAL coordinates only —
 * (room, GLOBAL buffer, token, GLOBAL head, byte) — never of where it sits
 * in a rank's memory.  The global buffer is the model's: a pipeline stage's
 * local buffer b is global buffer g->buf0 + b, so stage-to-stage and
 * stage-to-all-layers transfers verify alike.  Prefill fills its pages from those coordinates; decode
 * recomputes them for the pages and heads it holds and compares.  So the
 * check is independent of page indices, page scattering and TP slicing: a
 * decode rank of any TP size verifies exactly the heads it owns.
 *
 * Cost: one 64-bit seed per (room, buffer, token, head), then one cheap
 * mix per 8 bytes; no per-byte hashing.
 */
#ifndef KVT_PATTERN_H
#define KVT_PATTERN_H

#include <stddef.h>
#include <stdint.h>

#include "models.h"

#define KVT_GOLDEN 0x9E3779B97F4A7C15ull
#define KVT_AUX_MAGIC 0x4B564652u   /* "KVFR" */

/** The splitmix64 finaliser: a bijective 64-bit mix. */
static inline uint64_t kvt_mix64(uint64_t z)
{
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/** splitmix64: advance *state and return the next value. */
static inline uint64_t kvt_splitmix64(uint64_t *state)
{
    *state += KVT_GOLDEN;
    return kvt_mix64(*state);
}

/**
 * Room id of request `index` for `seed`: identical in every process, 63
 * bits (fits a JSON integer), distinct for distinct indices (a bijection).
 */
uint64_t kvt_room_id(uint64_t seed, uint32_t index);

/** Where verification found the first wrong byte. */
typedef struct kvt_mismatch {
    uint32_t buffer;    /**< GLOBAL buffer */
    uint32_t token;     /**< logical token of the room */
    uint32_t head;      /**< GLOBAL head */
    uint32_t byte;      /**< byte within the head */
    uint8_t  expected;
    uint8_t  got;
} kvt_mismatch_t;

/**
 * Fill `ntokens` token slots of one page of one KV buffer, starting at slot
 * 0 whose logical token is `first_token`, for the heads rank `g` holds.
 * `buffer` is the GLOBAL buffer index (g->buf0 + the rank's local index).
 * `page` points at the page's first byte.
 */
void kvt_pattern_fill(uint8_t *page, const kvt_geom_t *g, uint64_t room,
                      uint32_t buffer, uint32_t first_token, uint32_t ntokens);

/**
 * Verify what kvt_pattern_fill() would have written.
 * @return 0 if every byte matches; -1 and *mm set to the first mismatch.
 */
int kvt_pattern_verify(const uint8_t *page, const kvt_geom_t *g, uint64_t room,
                       uint32_t buffer, uint32_t first_token, uint32_t ntokens,
                       kvt_mismatch_t *mm);

/**
 * The aux slot (KVT_AUX_SLOT_BYTES): {u64 room, u32 first_token, u32 magic}
 * then pattern bytes derived from the room, so a slot written for another
 * room, or not written at all, never checks out.
 */
void kvt_aux_fill(uint8_t *slot, uint64_t room);

/** The first output token the aux record carries for `room`. */
uint32_t kvt_aux_first_token(uint64_t room);

/** @return 0 if the slot holds room's record; -1 and a reason in why. */
int kvt_aux_check(const uint8_t *slot, uint64_t room, char *why, size_t len);

#endif /* KVT_PATTERN_H */
