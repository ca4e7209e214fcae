/*
 * A growable byte buffer, and little-endian load/store helpers.
 *
 * The wire codec appends encoded messages to a kvf_buf_t; connections keep
 * one per direction.  Growth doubles, so appending n bytes is amortised O(n).
 */
#ifndef KVF_UTIL_BUF_H
#define KVF_UTIL_BUF_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "kvferry/status.h"

typedef struct kvf_buf {
    uint8_t *data;
    size_t   len;   /* bytes in use */
    size_t   cap;   /* bytes allocated */
} kvf_buf_t;

void         kvf_buf_init(kvf_buf_t *b);
void         kvf_buf_free(kvf_buf_t *b);
/* Make room for `extra` more bytes; KVF_ERR_NO_MEMORY leaves b unchanged. */
kvf_status_t kvf_buf_reserve(kvf_buf_t *b, size_t extra);
kvf_status_t kvf_buf_append(kvf_buf_t *b, const void *p, size_t n);
/* Drop the first n bytes (n <= len). */
void         kvf_buf_consume(kvf_buf_t *b, size_t n);

static inline void kvf_put_u16(uint8_t *p, uint16_t v)
{
    p[0] = (uint8_t)v; p[1] = (uint8_t)(v >> 8);
}
static inline void kvf_put_u32(uint8_t *p, uint32_t v)
{
    for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static inline void kvf_put_u64(uint8_t *p, uint64_t v)
{
    for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static inline uint16_t kvf_get_u16(const uint8_t *p)
{
    return (uint16_t)(p[0] | (p[1] << 8));
}
static inline uint32_t kvf_get_u32(const uint8_t *p)
{
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) |
           ((uint32_t)p[3] << 24);
}
static inline uint64_t kvf_get_u64(const uint8_t *p)
{
    return (uint64_t)kvf_get_u32(p) | ((uint64_t)kvf_get_u32(p + 4) << 32);
}

#endif /* KVF_UTIL_BUF_H */
