/*
 * Pattern generation and verification (see pattern.h for the idea).
 *
 * Seeds are chained: room -> buffer -> token -> head, one mix per level,
 * so a page costs one mix per token and one per head.  Where a head of a
 * token sits in the page is the geometry's page order (kvt_head_offset):
 * the bytes are the same, a decode of the other order would not find them.  The bytes of a head
 * are the splitmix64 stream of its seed, 8 bytes per step, in host byte
 * order (prefill and decode of one demo run on one host).  Verification
 * XORs expected and actual words into an accumulator and only looks at
 * single bytes when a head's accumulator is non-zero.
 */
#include "pattern.h"

#include <stdio.h>
#include <string.h>

uint64_t kvt_room_id(uint64_t seed, uint32_t index)
{
    const uint64_t m63 = (1ull << 63) - 1;
    /* Each step is a bijection of 63-bit words: add, odd multiply and
     * xorshift-right, so distinct indices give distinct rooms. */
    uint64_t x = (kvt_mix64(seed) + index) & m63;
    x = (x * 0xBF58476D1CE4E5B9ull) & m63;
    x ^= x >> 29;
    x = (x * 0x94D049BB133111EBull) & m63;
    x ^= x >> 32;
    return x;
}

static inline uint64_t kvt_buffer_seed(uint64_t room, uint32_t buffer)
{
    return kvt_mix64(kvt_mix64(room + KVT_GOLDEN) + (buffer + 1ull) * KVT_GOLDEN);
}

static inline uint64_t kvt_next_seed(uint64_t parent, uint32_t child)
{
    return kvt_mix64(parent + (child + 1ull) * KVT_GOLDEN);
}

/* One head of one token: bytes_per_head bytes of the seed's stream. */
static void kvt_fill_head(uint8_t *dst, uint64_t seed, uint32_t nbytes)
{
    uint64_t state = seed;
    uint32_t j = 0;
    for (; j + 8 <= nbytes; j += 8) {
        uint64_t w = kvt_splitmix64(&state);
        memcpy(dst + j, &w, 8);
    }
    if (j < nbytes) {
        uint64_t w = kvt_splitmix64(&state);
        memcpy(dst + j, &w, nbytes - j);
    }
}

/* @return 0 if equal, else the index of the first differing byte + 1. */
static uint32_t kvt_check_head(const uint8_t *src, uint64_t seed,
                               uint32_t nbytes, uint8_t *exp_p, uint8_t *got_p)
{
    uint64_t state = seed, acc = 0;
    uint32_t j = 0;
    for (; j + 8 <= nbytes; j += 8) {
        uint64_t w, e = kvt_splitmix64(&state);
        memcpy(&w, src + j, 8);
        acc |= w ^ e;
    }
    if (j < nbytes) {
        uint64_t w = 0, e = kvt_splitmix64(&state), em = 0;
        memcpy(&w, src + j, nbytes - j);
        memcpy(&em, &e, nbytes - j);
        acc |= w ^ em;
    }
    if (acc == 0)
        return 0;
    /* Slow path, once per failed head: find the byte. */
    uint8_t expect[8];
    state = seed;
    for (j = 0; j < nbytes; j += 8) {
        uint64_t e = kvt_splitmix64(&state);
        memcpy(expect, &e, 8);
        for (uint32_t k = 0; k < 8 && j + k < nbytes; k++) {
            if (src[j + k] != expect[k]) {
                *exp_p = expect[k];
                *got_p = src[j + k];
                return j + k + 1;
            }
        }
    }
    return 0;
}

void kvt_pattern_fill(uint8_t *page, const kvt_geom_t *g, uint64_t room,
                      uint32_t buffer, uint32_t first_token, uint32_t ntokens)
{
    uint64_t bseed = kvt_buffer_seed(room, buffer);
    for (uint32_t s = 0; s < ntokens; s++) {
        uint64_t tseed = kvt_next_seed(bseed, first_token + s);
        for (uint32_t h = 0; h < g->heads_per_rank; h++)
            kvt_fill_head(page + kvt_head_offset(g, s, h),
                          kvt_next_seed(tseed, g->head_first + h),
                          g->bytes_per_head);
    }
}

int kvt_pattern_verify(const uint8_t *page, const kvt_geom_t *g, uint64_t room,
                       uint32_t buffer, uint32_t first_token, uint32_t ntokens,
                       kvt_mismatch_t *mm)
{
    uint64_t bseed = kvt_buffer_seed(room, buffer);
    for (uint32_t s = 0; s < ntokens; s++) {
        uint64_t tseed = kvt_next_seed(bseed, first_token + s);
        for (uint32_t h = 0; h < g->heads_per_rank; h++) {
            uint8_t e = 0, got = 0;
            uint32_t at = kvt_check_head(page + kvt_head_offset(g, s, h),
                                         kvt_next_seed(tseed, g->head_first + h),
                                         g->bytes_per_head, &e, &got);
            if (at) {
                mm->buffer = buffer;
                mm->token = first_token + s;
                mm->head = g->head_first + h;
                mm->byte = at - 1;
                mm->expected = e;
                mm->got = got;
                return -1;
            }
        }
    }
    return 0;
}

/* ------------------------------------------------------------------------ */
/* Aux record                                                               */
/* ------------------------------------------------------------------------ */

#define KVT_AUX_HEADER 16
#define KVT_AUX_KEY 0xA0C5A0C5A0C5A0C5ull

uint32_t kvt_aux_first_token(uint64_t room)
{
    return (uint32_t)(kvt_mix64(room ^ 0x70C3E2ull) % 128256u);
}

static void kvt_aux_expected(uint8_t *slot, uint64_t room)
{
    uint32_t first = kvt_aux_first_token(room), magic = KVT_AUX_MAGIC;
    memcpy(slot, &room, 8);
    memcpy(slot + 8, &first, 4);
    memcpy(slot + 12, &magic, 4);
    kvt_fill_head(slot + KVT_AUX_HEADER, kvt_mix64(room ^ KVT_AUX_KEY),
                  KVT_AUX_SLOT_BYTES - KVT_AUX_HEADER);
}

void kvt_aux_fill(uint8_t *slot, uint64_t room)
{
    kvt_aux_expected(slot, room);
}

int kvt_aux_check(const uint8_t *slot, uint64_t room, char *why, size_t len)
{
    uint8_t want[KVT_AUX_SLOT_BYTES];
    kvt_aux_expected(want, room);
    if (memcmp(want, slot, sizeof(want)) == 0)
        return 0;
    uint64_t got_room;
    uint32_t got_first, got_magic;
    memcpy(&got_room, slot, 8);
    memcpy(&got_first, slot + 8, 4);
    memcpy(&got_magic, slot + 12, 4);
    if (got_magic != KVT_AUX_MAGIC)
        snprintf(why, len, "aux record not written: magic 0x%08x, expected "
                 "0x%08x (the aux slot of room %llu was never filled)",
                 got_magic, KVT_AUX_MAGIC, (unsigned long long)room);
    else if (got_room != room)
        snprintf(why, len, "aux record carries room %llu, expected room %llu "
                 "(aux data of another request landed in this slot)",
                 (unsigned long long)got_room, (unsigned long long)room);
    else if (got_first != kvt_aux_first_token(room))
        snprintf(why, len, "aux first_token %u, expected %u", got_first,
                 kvt_aux_first_token(room));
    else {
        size_t j = KVT_AUX_HEADER;
        while (j < sizeof(want) && want[j] == slot[j])
            j++;
        snprintf(why, len, "aux record byte %zu is 0x%02x, expected 0x%02x",
                 j, slot[j], want[j]);
    }
    return -1;
}
