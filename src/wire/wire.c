/*
 * The control-protocol codec.  wire.h describes the frame, and
 * docs/PROTOCOL.md every message's byte layout.
 *
 * Two ideas keep the encoder and the decoder from drifting apart:
 *
 *  - Every rule about values (limits, enum ranges, paired array counts, DATA
 *    segment sums) lives in one place, kvf_wire_check(), which the encoder
 *    runs before writing and the decoder after parsing.  The parser itself
 *    only proves that each field lies inside the body.
 *  - The encoder walks a message twice with the same writer: once without a
 *    destination to size the body, once to write it.  The length in the
 *    header therefore cannot disagree with the bytes that follow it.
 *
 * The parser keeps its first error and turns every later read into a no-op
 * returning zero, so the per-message decoders read straight down the layout
 * without a check after every field.
 *
 * Each message type is one row of kvf_wire_msgs (after the decoder): its
 * name, the frame flags it may carry, whether its body opens with the
 * frozen version prefix, and its value rules, writer and reader.  Adding a
 * message type is a row and those three functions; check, encode and
 * decode only dispatch through the table.
 */
#include "wire/wire.h"

#include <assert.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <string.h>

struct kvf_wire_wr;
struct kvf_wire_rd;

/* One message type: a row of kvf_wire_msgs. */
typedef struct kvf_wire_msg_ops {
    const char *name;
    uint8_t     frame_flags;   /* header flags a frame of it may carry */
    uint8_t     prefix_len;    /* frozen magic+version prefix: 0 or 6 */
    /* the value rules; DATA and DATA_REF count pieces into *pieces_p */
    bool (*check)(const kvf_msg_t *m, uint32_t *pieces_p, char *err,
                  size_t errlen);
    void (*wr)(struct kvf_wire_wr *w, const kvf_msg_t *m);
    void (*rd)(struct kvf_wire_rd *rd, kvf_msg_t *m);
} kvf_wire_msg_ops_t;

#define KVF_WIRE_NTYPES (KVF_MSG_JOIN + 1)
static const kvf_wire_msg_ops_t kvf_wire_msgs[KVF_WIRE_NTYPES];

static bool kvf_wire_type_valid(unsigned type)
{
    return type >= KVF_MSG_HELLO && type < KVF_WIRE_NTYPES;
}

const char *kvf_wire_type_name(uint8_t type)
{
    return kvf_wire_type_valid(type) ? kvf_wire_msgs[type].name : "UNKNOWN";
}

__attribute__((format(printf, 3, 4)))
static void kvf_wire_errf(char *err, size_t errlen, const char *fmt, ...)
{
    if (err == NULL || errlen == 0)
        return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, errlen, fmt, ap);
    va_end(ap);
}

/* ------------------------------------------------------------------------ */
/* Array and segment accessors                                              */
/* ------------------------------------------------------------------------ */

uint32_t kvf_wire_arr32_at(const kvf_wire_arr32_t *a, uint32_t i)
{
    assert(i < a->count);
    if (i >= a->count)
        return 0;
    if (a->native != NULL)
        return a->native[i];
    return a->raw != NULL ? kvf_get_u32(a->raw + (size_t)i * 4) : 0;
}

uint64_t kvf_wire_arr64_at(const kvf_wire_arr64_t *a, uint32_t i)
{
    assert(i < a->count);
    if (i >= a->count)
        return 0;
    if (a->native != NULL)
        return a->native[i];
    return a->raw != NULL ? kvf_get_u64(a->raw + (size_t)i * 8) : 0;
}

void kvf_wire_seg_at(const kvf_msg_data_t *d, uint32_t i, kvf_wire_seg_t *seg_p)
{
    assert(i < d->nseg);
    if (i >= d->nseg || (d->segs == NULL && d->raw_segs == NULL)) {
        memset(seg_p, 0, sizeof(*seg_p));
        return;
    }
    if (d->segs != NULL) {
        *seg_p = d->segs[i];
        return;
    }
    const uint8_t *p = d->raw_segs +
                       (size_t)i * (d->strided ? KVF_WIRE_SSEG_LEN : KVF_WIRE_SEG_LEN);
    seg_p->kind   = p[0];
    seg_p->buf    = kvf_get_u32(p + 1);
    seg_p->offset = kvf_get_u64(p + 5);
    seg_p->len    = kvf_get_u32(p + 13);
    if (d->strided) {
        seg_p->count      = kvf_get_u32(p + 17);
        seg_p->dst_stride = kvf_get_u64(p + 21);
        seg_p->src_stride = kvf_get_u64(p + 29);
    } else {
        seg_p->count = 1;
        seg_p->dst_stride = seg_p->src_stride = 0;
    }
}

/* ------------------------------------------------------------------------ */
/* Value rules, shared by encoder and decoder                               */
/* ------------------------------------------------------------------------ */

static bool kvf_wire_check_str(const kvf_wire_str_t *s, const char *what,
                               const char *field, char *err, size_t errlen)
{
    if (s->len > KVF_WIRE_MAX_STR) {
        kvf_wire_errf(err, errlen, "%s: %s length %u exceeds limit %u", what,
                      field, s->len, KVF_WIRE_MAX_STR);
        return false;
    }
    if (s->len != 0 && s->ptr == NULL) {
        kvf_wire_errf(err, errlen, "%s: %s has length %u but no bytes", what,
                      field, s->len);
        return false;
    }
    return true;
}

static bool kvf_wire_check_arr(uint32_t count, bool has_items, uint32_t max,
                               const char *what, const char *field, char *err,
                               size_t errlen)
{
    if (count > max) {
        kvf_wire_errf(err, errlen, "%s: %s count %u exceeds limit %u", what,
                      field, count, max);
        return false;
    }
    if (count != 0 && !has_items) {
        kvf_wire_errf(err, errlen, "%s: %s count %u but no items", what, field,
                      count);
        return false;
    }
    return true;
}

#define KVF_WIRE_CHECK_ARR(a, max, field)                                      \
    kvf_wire_check_arr((a)->count, (a)->native != NULL || (a)->raw != NULL,   \
                       (max), what, (field), err, errlen)

static bool kvf_wire_check_layout(const kvf_wire_layout_t *l, char *err,
                                  size_t errlen)
{
    const char *what = "HELLO";
    const struct {
        const kvf_wire_arr64_t *bytes, *items;
        const char *bytes_name, *items_name, *family;
    } fam[] = {
        { &l->kv_item_bytes, &l->kv_items, "kv_item_bytes", "kv_items", "KV" },
        { &l->aux_item_bytes, &l->aux_items, "aux_item_bytes", "aux_items",
          "aux" },
        { &l->state_item_bytes, &l->state_items, "state_item_bytes",
          "state_items", "state" },
    };

    if (l->attn > 1 || l->mem_kind > 1 || l->kv_order > 1) {
        kvf_wire_errf(err, errlen, "HELLO: layout has unknown %s %u",
                      l->attn > 1 ? "attention kind" : l->mem_kind > 1 ? "memory kind"
                                                                       : "KV page order",
                      l->attn > 1 ? l->attn : l->mem_kind > 1 ? l->mem_kind : l->kv_order);
        return false;
    }
    if (!kvf_wire_check_str(&l->kv_dtype, what, "kv_dtype", err, errlen))
        return false;
    for (size_t i = 0; i < sizeof(fam) / sizeof(fam[0]); i++) {
        if (!KVF_WIRE_CHECK_ARR(fam[i].bytes, KVF_WIRE_MAX_BUFS,
                                fam[i].bytes_name) ||
            !KVF_WIRE_CHECK_ARR(fam[i].items, KVF_WIRE_MAX_BUFS,
                                fam[i].items_name))
            return false;
        /* paired arrays: a receiver indexes both by the same buffer index */
        if (fam[i].bytes->count != fam[i].items->count) {
            kvf_wire_errf(err, errlen, "HELLO: layout lists %u %s item sizes "
                          "but %u %s item counts", fam[i].bytes->count,
                          fam[i].family, fam[i].items->count, fam[i].family);
            return false;
        }
    }
    if (!KVF_WIRE_CHECK_ARR(&l->state_groups, KVF_WIRE_MAX_BUFS, "state_groups") ||
        !KVF_WIRE_CHECK_ARR(&l->kv_tags, KVF_WIRE_MAX_BUFS, "kv_tags") ||
        !kvf_wire_check_str(&l->state_types, what, "state_types", err, errlen))
        return false;
    uint64_t in_groups = 0;
    for (uint32_t g = 0; g < l->state_groups.count; g++)
        in_groups += kvf_wire_arr32_at(&l->state_groups, g);
    if (in_groups != l->state_item_bytes.count ||
        (l->kv_tags.count != 0 && l->kv_tags.count != l->kv_item_bytes.count)) {
        kvf_wire_errf(err, errlen, "HELLO: layout has %llu state buffers in groups for "
                      "%u state buffers, %u KV tags for %u KV buffers",
                      (unsigned long long)in_groups, l->state_item_bytes.count,
                      l->kv_tags.count, l->kv_item_bytes.count);
        return false;
    }
    return true;
}

static bool kvf_wire_check_hello(const kvf_msg_t *m, uint32_t *pieces_p,
                                 char *err, size_t errlen)
{
    const kvf_msg_hello_t *h = &m->u.hello;

    if (h->magic != KVF_WIRE_MAGIC || h->version != KVF_WIRE_VERSION) {
        kvf_wire_errf(err, errlen, "HELLO: magic 0x%08x version %u, expected "
                      "0x%08x version %u", h->magic, h->version,
                      KVF_WIRE_MAGIC, KVF_WIRE_VERSION);
        return false;
    }
    if (h->role > 1) {
        kvf_wire_errf(err, errlen, "HELLO: role %u is neither prefill (0) nor "
                      "decode (1)", h->role);
        return false;
    }
    if (h->flags & ~KVF_HELLO_F_CHECKSUM) {
        kvf_wire_errf(err, errlen, "HELLO: unknown flags 0x%02x",
                      h->flags & ~KVF_HELLO_F_CHECKSUM);
        return false;
    }
    return kvf_wire_check_str(&h->addr, "HELLO", "addr", err, errlen) &&
           kvf_wire_check_layout(&h->layout, err, errlen);
}

/* One segment's rules; `i` names it in the error.  DATA_REF: its source
 * address (src_addrs[i], already paired with the segments) is checked too. */
static bool kvf_wire_check_seg(const kvf_msg_data_t *d, uint32_t i,
                               const kvf_wire_seg_t *s, char *err, size_t errlen)
{
    uint64_t span;

    if (s->kind > KVF_BUF_STATE) {
        kvf_wire_errf(err, errlen, "DATA segment %u: unknown buffer kind %u", i,
                      s->kind);
        return false;
    }
    if (s->len == 0) {
        kvf_wire_errf(err, errlen, "DATA segment %u: length 0", i);
        return false;
    }
    if (!d->strided && s->count > 1) {
        kvf_wire_errf(err, errlen, "DATA segment %u: %u pieces in a frame without "
                      "strided segments", i, s->count);
        return false;
    }
    if (d->strided && s->count == 0) {
        kvf_wire_errf(err, errlen, "DATA segment %u: piece count 0", i);
        return false;
    }
    if (s->count > 1 && (s->dst_stride < s->len || s->src_stride < s->len)) {
        kvf_wire_errf(err, errlen, "DATA segment %u: strides %llu (destination) and "
                      "%llu (source) are shorter than its %u-byte pieces, which would "
                      "overlap", i, (unsigned long long)s->dst_stride,
                      (unsigned long long)s->src_stride, s->len);
        return false;
    }
    if (!kvf_wire_seg_span(s, 0, &span) || s->offset > UINT64_MAX - span) {
        if (kvf_wire_seg_pieces(s) == 1)
            kvf_wire_errf(err, errlen, "DATA segment %u: offset %llu + length %u "
                          "overflows", i, (unsigned long long)s->offset, s->len);
        else
            kvf_wire_errf(err, errlen, "DATA segment %u: offset %llu + %u pieces of %u "
                          "bytes %llu apart overflows", i, (unsigned long long)s->offset,
                          kvf_wire_seg_pieces(s), s->len,
                          (unsigned long long)s->dst_stride);
        return false;
    }
    if (!kvf_wire_seg_span(s, 1, &span) ||
        (i < d->src_addrs.count && kvf_wire_arr64_at(&d->src_addrs, i) > UINT64_MAX - span)) {
        kvf_wire_errf(err, errlen, "DATA segment %u: source + %u pieces of %u bytes "
                      "%llu apart overflows", i, kvf_wire_seg_pieces(s), s->len,
                      (unsigned long long)s->src_stride);
        return false;
    }
    return true;
}

static bool kvf_wire_check_data(const kvf_msg_t *m, uint32_t *pieces_p,
                                char *err, size_t errlen)
{
    const kvf_msg_data_t *d = &m->u.data;

    if (d->nseg < 1 || d->nseg > KVF_WIRE_MAX_SEGS) {
        kvf_wire_errf(err, errlen, "DATA: segment count %u outside 1..%u",
                      d->nseg, KVF_WIRE_MAX_SEGS);
        return false;
    }
    if (d->segs == NULL && d->raw_segs == NULL) {
        kvf_wire_errf(err, errlen, "DATA: segment count %u but no segments",
                      d->nseg);
        return false;
    }
    uint64_t sum = 0, pieces = 0;
    for (uint32_t i = 0; i < d->nseg; i++) {
        kvf_wire_seg_t s;
        kvf_wire_seg_at(d, i, &s);
        if (!kvf_wire_check_seg(d, i, &s, err, errlen))
            return false;
        pieces += kvf_wire_seg_pieces(&s);
        /* The bound on what one frame costs the receiver: per piece it
         * resolves a target, and (pulled) issues a read. */
        if (pieces > KVF_WIRE_MAX_PIECES) {
            kvf_wire_errf(err, errlen, "DATA: more than %u pieces (segment %u)",
                          KVF_WIRE_MAX_PIECES, i);
            return false;
        }
        /* At most KVF_WIRE_MAX_PIECES * 2^32 in all: cannot overflow. */
        sum += kvf_wire_seg_bytes(&s);
    }
    if (sum != d->payload_len) {
        kvf_wire_errf(err, errlen, "DATA: segment lengths sum to %llu but "
                      "payload_len is %llu", (unsigned long long)sum,
                      (unsigned long long)d->payload_len);
        return false;
    }
    if (pieces_p != NULL)
        *pieces_p = (uint32_t)pieces;
    return true;
}

/* ROOM_REQ: the per-group counts add up to the indices given. */
static bool kvf_wire_check_state_idx(const kvf_msg_room_req_t *r, char *err, size_t errlen)
{
    uint64_t sum = 0;
    for (uint32_t g = 0; g < r->state_counts.count; g++)
        sum += kvf_wire_arr32_at(&r->state_counts, g);
    if (sum != r->state_idx.count) {
        kvf_wire_errf(err, errlen, "ROOM_REQ: state groups count %llu indices, %u given",
                      (unsigned long long)sum, r->state_idx.count);
        return false;
    }
    if (r->flags & ~KVF_REQ_WATCH) {
        kvf_wire_errf(err, errlen, "ROOM_REQ: unknown flags 0x%08x", r->flags & ~KVF_REQ_WATCH);
        return false;
    }
    if ((r->flags & KVF_REQ_WATCH) && (r->pages.count != 0 || r->state_counts.count != 0)) {
        kvf_wire_errf(err, errlen, "ROOM_REQ: a watch names %u pages and %u state groups",
                      r->pages.count, r->state_counts.count);
        return false;
    }
    return true;
}

static bool kvf_wire_check_room_req(const kvf_msg_t *m, uint32_t *pieces_p,
                                    char *err, size_t errlen)
{
    const char *what = "ROOM_REQ";

    return KVF_WIRE_CHECK_ARR(&m->u.room_req.pages, UINT32_MAX, "page") &&
           KVF_WIRE_CHECK_ARR(&m->u.room_req.state_counts, KVF_WIRE_MAX_BUFS,
                              "state group") &&
           KVF_WIRE_CHECK_ARR(&m->u.room_req.state_idx, UINT32_MAX, "state index") &&
           kvf_wire_check_state_idx(&m->u.room_req, err, errlen);
}

/* DATA_REF: DATA's rules, with one source address per segment. */
static bool kvf_wire_check_data_ref(const kvf_msg_t *m, uint32_t *pieces_p,
                                    char *err, size_t errlen)
{
    if (m->u.data.src_addrs.count != m->u.data.nseg) {
        kvf_wire_errf(err, errlen, "DATA_REF: %u source addresses for %u segments",
                      m->u.data.src_addrs.count, m->u.data.nseg);
        return false;
    }
    return kvf_wire_check_data(m, pieces_p, err, errlen);
}

static bool kvf_wire_check_xport(const kvf_msg_t *m, uint32_t *pieces_p,
                                 char *err, size_t errlen)
{
    if (m->u.xport.count > KVF_WIRE_MAX_XPORTS) {
        kvf_wire_errf(err, errlen, "XPORT: %u transports, at most %u",
                      m->u.xport.count, KVF_WIRE_MAX_XPORTS);
        return false;
    }
    for (uint32_t i = 0; i < m->u.xport.count; i++) {
        const kvf_wire_xport_t *x = &m->u.xport.x[i];
        if (!kvf_wire_check_str(&x->name, "XPORT", "name", err, errlen))
            return false;
        if (x->blob_len > KVF_WIRE_MAX_BLOB || (x->blob_len && x->blob == NULL)) {
            kvf_wire_errf(err, errlen, "XPORT: blob of %u bytes (limit %u)",
                          x->blob_len, KVF_WIRE_MAX_BLOB);
            return false;
        }
    }
    return true;
}

static bool kvf_wire_check_done(const kvf_msg_t *m, uint32_t *pieces_p,
                                char *err, size_t errlen)
{
    if (m->u.done.has_checksum > 1) {
        kvf_wire_errf(err, errlen, "DONE: has_checksum is %u, not 0 or 1",
                      m->u.done.has_checksum);
        return false;
    }
    if (m->u.done.streams > KVF_WIRE_MAX_STREAMS ||
        (m->u.done.streams > 0 && m->u.done.stream >= m->u.done.streams)) {
        kvf_wire_errf(err, errlen, "DONE: stream %u of %u (at most %u streams)",
                      m->u.done.stream, m->u.done.streams, KVF_WIRE_MAX_STREAMS);
        return false;
    }
    return true;
}

static bool kvf_wire_check_join(const kvf_msg_t *m, uint32_t *pieces_p,
                                char *err, size_t errlen)
{
    if (m->u.join.stream == 0 || m->u.join.stream >= KVF_WIRE_MAX_STREAMS) {
        kvf_wire_errf(err, errlen, "JOIN: stream %u, not 1..%u", m->u.join.stream,
                      KVF_WIRE_MAX_STREAMS - 1);
        return false;
    }
    return true;
}

static bool kvf_wire_check_done_ack(const kvf_msg_t *m, uint32_t *pieces_p,
                                    char *err, size_t errlen)
{
    if (m->u.done_ack.status > 0) {
        kvf_wire_errf(err, errlen, "DONE_ACK: status %d is positive",
                      (int)m->u.done_ack.status);
        return false;
    }
    return true;
}

/* FAIL and ABORT share a body; `what` names which one in the error. */
static bool kvf_wire_check_fail(const kvf_msg_t *m, uint32_t *pieces_p,
                                char *err, size_t errlen)
{
    const char *what = kvf_wire_type_name((uint8_t)m->type);

    if (m->u.fail.status >= 0) {
        kvf_wire_errf(err, errlen, "%s: status %d is not an error", what,
                      (int)m->u.fail.status);
        return false;
    }
    if (m->u.fail.sides & ~KVF_SIDES_ALL) {
        kvf_wire_errf(err, errlen, "%s: sides 0x%02x name neither prefill nor decode",
                      what, m->u.fail.sides);
        return false;
    }
    if (m->u.fail.origin_side > 1) {
        kvf_wire_errf(err, errlen, "%s: origin side %u is neither prefill "
                      "(0) nor decode (1)", what, m->u.fail.origin_side);
        return false;
    }
    return kvf_wire_check_str(&m->u.fail.origin_addr, what, "origin_addr",
                              err, errlen) &&
           kvf_wire_check_str(&m->u.fail.reason, what, "reason", err,
                              errlen);
}

static bool kvf_wire_check_auth(const kvf_msg_t *m, uint32_t *pieces_p,
                                char *err, size_t errlen)
{
    if (m->u.auth.magic != KVF_WIRE_MAGIC || m->u.auth.version != KVF_WIRE_VERSION) {
        kvf_wire_errf(err, errlen, "AUTH: magic 0x%08x version %u, expected "
                      "0x%08x version %u", m->u.auth.magic, m->u.auth.version,
                      KVF_WIRE_MAGIC, KVF_WIRE_VERSION);
        return false;
    }
    if (m->u.auth.role > 1) {
        kvf_wire_errf(err, errlen, "AUTH: role %u is neither prefill (0) nor "
                      "decode (1)", m->u.auth.role);
        return false;
    }
    if (m->u.auth.flags & ~(KVF_AUTH_F_TOKEN | KVF_AUTH_F_JOIN)) {
        kvf_wire_errf(err, errlen, "AUTH: unknown flags 0x%02x",
                      m->u.auth.flags & ~(KVF_AUTH_F_TOKEN | KVF_AUTH_F_JOIN));
        return false;
    }
    return true;
}

/* HEARTBEAT and AUTH_PROOF: every value of their fixed fields is valid. */
static bool kvf_wire_check_any(const kvf_msg_t *m, uint32_t *pieces_p,
                               char *err, size_t errlen)
{
    return true;
}

static bool kvf_wire_check(const kvf_msg_t *m, uint32_t *pieces_p, char *err,
                           size_t errlen)
{
    if (!kvf_wire_type_valid(m->type)) {
        kvf_wire_errf(err, errlen, "unknown message type %d", (int)m->type);
        return false;
    }
    return kvf_wire_msgs[m->type].check(m, pieces_p, err, errlen);
}

/* ------------------------------------------------------------------------ */
/* Encoder                                                                  */
/* ------------------------------------------------------------------------ */

/* With p == NULL the writer only counts. */
typedef struct kvf_wire_wr {
    uint8_t *p;
    uint64_t n;
} kvf_wire_wr_t;

static void kvf_wire_wr_u8(kvf_wire_wr_t *w, uint8_t v)
{
    if (w->p)
        w->p[w->n] = v;
    w->n += 1;
}

static void kvf_wire_wr_u16(kvf_wire_wr_t *w, uint16_t v)
{
    if (w->p)
        kvf_put_u16(w->p + w->n, v);
    w->n += 2;
}

static void kvf_wire_wr_u32(kvf_wire_wr_t *w, uint32_t v)
{
    if (w->p)
        kvf_put_u32(w->p + w->n, v);
    w->n += 4;
}

static void kvf_wire_wr_u64(kvf_wire_wr_t *w, uint64_t v)
{
    if (w->p)
        kvf_put_u64(w->p + w->n, v);
    w->n += 8;
}

static void kvf_wire_wr_str(kvf_wire_wr_t *w, const kvf_wire_str_t *s)
{
    kvf_wire_wr_u32(w, s->len);
    if (w->p && s->len)
        memcpy(w->p + w->n, s->ptr, s->len);
    w->n += s->len;
}

static void kvf_wire_wr_bytes(kvf_wire_wr_t *w, const uint8_t *p, uint32_t n)
{
    if (w->p != NULL && n > 0)
        memcpy(w->p + w->n, p, n);
    w->n += n;
}

static void kvf_wire_wr_arr32(kvf_wire_wr_t *w, const kvf_wire_arr32_t *a)
{
    kvf_wire_wr_u32(w, a->count);
    if (w->p == NULL) {
        w->n += (uint64_t)a->count * 4;
        return;
    }
    for (uint32_t i = 0; i < a->count; i++)
        kvf_wire_wr_u32(w, kvf_wire_arr32_at(a, i));
}

static void kvf_wire_wr_arr64(kvf_wire_wr_t *w, const kvf_wire_arr64_t *a)
{
    kvf_wire_wr_u32(w, a->count);
    if (w->p == NULL) {
        w->n += (uint64_t)a->count * 8;
        return;
    }
    for (uint32_t i = 0; i < a->count; i++)
        kvf_wire_wr_u64(w, kvf_wire_arr64_at(a, i));
}

static void kvf_wire_wr_hello(kvf_wire_wr_t *w, const kvf_msg_t *m)
{
    const kvf_msg_hello_t *h = &m->u.hello;
    const kvf_wire_layout_t *l = &h->layout;

    kvf_wire_wr_u32(w, h->magic);
    kvf_wire_wr_u16(w, h->version);
    kvf_wire_wr_u8(w, h->role);
    kvf_wire_wr_u8(w, h->flags);
    kvf_wire_wr_u64(w, h->instance_id);
    kvf_wire_wr_u32(w, h->tp_rank);
    kvf_wire_wr_u32(w, h->tp_size);
    kvf_wire_wr_u32(w, h->pp_rank);
    kvf_wire_wr_u32(w, h->pp_size);
    kvf_wire_wr_u32(w, h->dp_rank);
    kvf_wire_wr_u32(w, h->dp_size);
    kvf_wire_wr_str(w, &h->addr);
    kvf_wire_wr_u32(w, l->page_size);
    kvf_wire_wr_str(w, &l->kv_dtype);
    kvf_wire_wr_u8(w, l->attn);
    kvf_wire_wr_u8(w, l->mem_kind);
    kvf_wire_wr_u32(w, l->num_layers);
    kvf_wire_wr_u32(w, l->first_layer);
    kvf_wire_wr_u32(w, l->heads_per_rank);
    kvf_wire_wr_u32(w, l->total_heads);
    kvf_wire_wr_u32(w, l->bytes_per_head);
    kvf_wire_wr_arr64(w, &l->kv_item_bytes);
    kvf_wire_wr_arr64(w, &l->kv_items);
    kvf_wire_wr_arr64(w, &l->aux_item_bytes);
    kvf_wire_wr_arr64(w, &l->aux_items);
    kvf_wire_wr_arr64(w, &l->state_item_bytes);
    kvf_wire_wr_arr64(w, &l->state_items);
    kvf_wire_wr_arr32(w, &l->state_groups);
    kvf_wire_wr_str(w, &l->state_types);
    kvf_wire_wr_arr64(w, &l->kv_tags);
    kvf_wire_wr_u8(w, l->kv_order);
}

static void kvf_wire_wr_data(kvf_wire_wr_t *w, const kvf_msg_t *m)
{
    const kvf_msg_data_t *d = &m->u.data;

    kvf_wire_wr_u64(w, d->room);
    kvf_wire_wr_u64(w, d->instance);
    kvf_wire_wr_u32(w, d->src_rank);
    kvf_wire_wr_u64(w, d->payload_len);
    kvf_wire_wr_u32(w, d->nseg);
    if (w->p == NULL) {
        w->n += (uint64_t)d->nseg * (d->strided ? KVF_WIRE_SSEG_LEN : KVF_WIRE_SEG_LEN);
        return;
    }
    for (uint32_t i = 0; i < d->nseg; i++) {
        kvf_wire_seg_t s;
        kvf_wire_seg_at(d, i, &s);
        kvf_wire_wr_u8(w, s.kind);
        kvf_wire_wr_u32(w, s.buf);
        kvf_wire_wr_u64(w, s.offset);
        kvf_wire_wr_u32(w, s.len);
        if (d->strided) {
            kvf_wire_wr_u32(w, s.count);
            kvf_wire_wr_u64(w, s.dst_stride);
            kvf_wire_wr_u64(w, s.src_stride);
        }
    }
}

/* DATA_REF: a DATA body without payload, then the source addresses. */
static void kvf_wire_wr_data_ref(kvf_wire_wr_t *w, const kvf_msg_t *m)
{
    kvf_wire_wr_data(w, m);
    kvf_wire_wr_arr64(w, &m->u.data.src_addrs);
}

static void kvf_wire_wr_room_req(kvf_wire_wr_t *w, const kvf_msg_t *m)
{
    kvf_wire_wr_u64(w, m->u.room_req.room);
    kvf_wire_wr_u64(w, m->u.room_req.instance);
    kvf_wire_wr_u32(w, m->u.room_req.dst_rank);
    kvf_wire_wr_u32(w, m->u.room_req.expected_receivers);
    kvf_wire_wr_u32(w, m->u.room_req.aux_slot);
    kvf_wire_wr_arr32(w, &m->u.room_req.pages);
    kvf_wire_wr_arr32(w, &m->u.room_req.state_counts);
    kvf_wire_wr_arr32(w, &m->u.room_req.state_idx);
    kvf_wire_wr_u32(w, m->u.room_req.attempt);
    kvf_wire_wr_u32(w, m->u.room_req.decode_prefix_len);
    kvf_wire_wr_u64(w, m->u.room_req.sender_instance);
    kvf_wire_wr_u32(w, m->u.room_req.flags);
}

static void kvf_wire_wr_xport(kvf_wire_wr_t *w, const kvf_msg_t *m)
{
    kvf_wire_wr_u32(w, m->u.xport.count);
    for (uint32_t i = 0; i < m->u.xport.count; i++) {
        const kvf_wire_xport_t *x = &m->u.xport.x[i];
        kvf_wire_wr_str(w, &x->name);
        kvf_wire_wr_u32(w, x->blob_len);
        kvf_wire_wr_bytes(w, x->blob, x->blob_len);
    }
}

static void kvf_wire_wr_done(kvf_wire_wr_t *w, const kvf_msg_t *m)
{
    kvf_wire_wr_u64(w, m->u.done.room);
    kvf_wire_wr_u64(w, m->u.done.instance);
    kvf_wire_wr_u32(w, m->u.done.src_rank);
    kvf_wire_wr_u64(w, m->u.done.bytes);
    kvf_wire_wr_u8(w, m->u.done.has_checksum);
    kvf_wire_wr_u64(w, m->u.done.checksum);
    if (m->u.done.streams > 0) {
        kvf_wire_wr_u32(w, m->u.done.stream);
        kvf_wire_wr_u32(w, m->u.done.streams);
    }
}

static void kvf_wire_wr_done_ack(kvf_wire_wr_t *w, const kvf_msg_t *m)
{
    kvf_wire_wr_u64(w, m->u.done_ack.room);
    kvf_wire_wr_u64(w, m->u.done_ack.instance);
    kvf_wire_wr_u32(w, (uint32_t)m->u.done_ack.status);
    kvf_wire_wr_u64(w, m->u.done_ack.bytes);
}

/* FAIL and ABORT share this body. */
static void kvf_wire_wr_fail(kvf_wire_wr_t *w, const kvf_msg_t *m)
{
    kvf_wire_wr_u64(w, m->u.fail.room);
    kvf_wire_wr_u64(w, m->u.fail.instance);
    kvf_wire_wr_u32(w, (uint32_t)m->u.fail.status);
    kvf_wire_wr_u8(w, m->u.fail.origin_side);
    kvf_wire_wr_u32(w, m->u.fail.origin_rank);
    kvf_wire_wr_str(w, &m->u.fail.origin_addr);
    kvf_wire_wr_str(w, &m->u.fail.reason);
    kvf_wire_wr_u64(w, m->u.fail.sender_instance);
    kvf_wire_wr_u8(w, m->u.fail.sides);
}

static void kvf_wire_wr_heartbeat(kvf_wire_wr_t *w, const kvf_msg_t *m)
{
    kvf_wire_wr_u64(w, m->u.heartbeat.seq);
    kvf_wire_wr_u64(w, m->u.heartbeat.time_ns);
}

static void kvf_wire_wr_auth(kvf_wire_wr_t *w, const kvf_msg_t *m)
{
    kvf_wire_wr_u32(w, m->u.auth.magic);
    kvf_wire_wr_u16(w, m->u.auth.version);
    kvf_wire_wr_u8(w, m->u.auth.role);
    kvf_wire_wr_u8(w, m->u.auth.flags);
    kvf_wire_wr_u64(w, m->u.auth.instance_id);
    kvf_wire_wr_u32(w, m->u.auth.pid);
    kvf_wire_wr_bytes(w, m->u.auth.nonce, KVF_WIRE_NONCE_LEN);
}

static void kvf_wire_wr_proof(kvf_wire_wr_t *w, const kvf_msg_t *m)
{
    kvf_wire_wr_bytes(w, m->u.proof.mac, KVF_WIRE_MAC_LEN);
}

static void kvf_wire_wr_join(kvf_wire_wr_t *w, const kvf_msg_t *m)
{
    kvf_wire_wr_bytes(w, m->u.join.cookie, KVF_WIRE_COOKIE_LEN);
    kvf_wire_wr_u32(w, m->u.join.stream);
}

/* Only after kvf_wire_check() passed: the type is valid. */
static void kvf_wire_wr_body(kvf_wire_wr_t *w, const kvf_msg_t *m)
{
    kvf_wire_msgs[m->type].wr(w, m);
}

kvf_status_t kvf_wire_encode(kvf_buf_t *out, const kvf_msg_t *msg)
{
    char err[256];

    if (out == NULL || msg == NULL || !kvf_wire_check(msg, NULL, err, sizeof(err)))
        return KVF_ERR_INVALID_PARAM;

    kvf_wire_wr_t w = { NULL, 0 };
    kvf_wire_wr_body(&w, msg);
    if (w.n > KVF_WIRE_MAX_BODY)
        return KVF_ERR_INVALID_PARAM;

    uint32_t length = (uint32_t)w.n;
    kvf_status_t st = kvf_buf_reserve(out, (size_t)KVF_WIRE_HDR_LEN + length);
    if (st != KVF_OK)
        return st;

    uint8_t *p = out->data + out->len;
    kvf_put_u32(p, length);
    p[4] = (uint8_t)msg->type;
    p[5] = (kvf_wire_msgs[msg->type].frame_flags & KVF_WIRE_F_STRIDED) &&
           msg->u.data.strided ? KVF_WIRE_F_STRIDED : 0;
    kvf_put_u16(p + 6, 0);
    w = (kvf_wire_wr_t){ p + KVF_WIRE_HDR_LEN, 0 };
    kvf_wire_wr_body(&w, msg);
    assert(w.n == length);
    out->len += (size_t)KVF_WIRE_HDR_LEN + length;
    return KVF_OK;
}

/* ------------------------------------------------------------------------ */
/* Decoder                                                                  */
/* ------------------------------------------------------------------------ */

kvf_status_t kvf_wire_parse_header(const uint8_t *p, kvf_wire_hdr_t *hdr_p,
                                   char *err, size_t errlen)
{
    uint32_t length = kvf_get_u32(p);
    uint8_t type = p[4], flags = p[5];
    uint16_t reserved = kvf_get_u16(p + 6);

    if (!kvf_wire_type_valid(type)) {
        if (!memcmp(p, "GET ", 4) || !memcmp(p, "PUT ", 4) ||
            !memcmp(p, "POST", 4) || !memcmp(p, "HTTP", 4))
            kvf_wire_errf(err, errlen, "frame header: received HTTP, not a "
                          "kvferry frame (is this the bootstrap registry port "
                          "instead of an engine's control port?)");
        else
            kvf_wire_errf(err, errlen, "frame header: unknown message type "
                          "%u (the peer is not a kvferry engine, or the stream "
                          "lost sync)", type);
        return KVF_ERR_PROTOCOL;
    }
    uint8_t allowed = kvf_wire_msgs[type].frame_flags;
    if ((flags & ~allowed) != 0 || reserved != 0) {
        kvf_wire_errf(err, errlen, "frame header: %s frame has non-zero "
                      "reserved bits (flags 0x%02x, reserved 0x%04x)",
                      kvf_wire_type_name(type), flags, reserved);
        return KVF_ERR_PROTOCOL;
    }
    if (length > KVF_WIRE_MAX_BODY) {
        kvf_wire_errf(err, errlen, "frame header: %s body length %u exceeds "
                      "limit %u", kvf_wire_type_name(type), length,
                      KVF_WIRE_MAX_BODY);
        return KVF_ERR_PROTOCOL;
    }
    hdr_p->length = length;
    hdr_p->type = type;
    hdr_p->flags = flags;
    return KVF_OK;
}

/*
 * Reads a body.  After the first error `bad` is set, `err` holds the reason
 * and every further read returns zero without touching memory.
 */
typedef struct kvf_wire_rd {
    const uint8_t *p;
    size_t         left;
    const char    *what;   /* message type name: prefixes every error */
    char          *err;
    size_t         errlen;
    bool           bad;
} kvf_wire_rd_t;

__attribute__((format(printf, 2, 3)))
static void kvf_wire_rd_fail(kvf_wire_rd_t *rd, const char *fmt, ...)
{
    char detail[256];

    if (rd->bad)
        return;
    rd->bad = true;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(detail, sizeof(detail), fmt, ap);
    va_end(ap);
    kvf_wire_errf(rd->err, rd->errlen, "%s: %s", rd->what, detail);
}

/* Returns the next n bytes, or NULL (and fails) if the body is shorter. */
static const uint8_t *kvf_wire_rd_take(kvf_wire_rd_t *rd, size_t n,
                                       const char *field)
{
    if (rd->bad)
        return NULL;
    if (rd->left < n) {
        kvf_wire_rd_fail(rd, "truncated at %s (needs %zu bytes, %zu left)",
                         field, n, rd->left);
        return NULL;
    }
    const uint8_t *p = rd->p;
    rd->p += n;
    rd->left -= n;
    return p;
}

static uint8_t kvf_wire_rd_u8(kvf_wire_rd_t *rd, const char *field)
{
    const uint8_t *p = kvf_wire_rd_take(rd, 1, field);
    return p ? p[0] : 0;
}

static uint16_t kvf_wire_rd_u16(kvf_wire_rd_t *rd, const char *field)
{
    const uint8_t *p = kvf_wire_rd_take(rd, 2, field);
    return p ? kvf_get_u16(p) : 0;
}

static uint32_t kvf_wire_rd_u32(kvf_wire_rd_t *rd, const char *field)
{
    const uint8_t *p = kvf_wire_rd_take(rd, 4, field);
    return p ? kvf_get_u32(p) : 0;
}

static uint64_t kvf_wire_rd_u64(kvf_wire_rd_t *rd, const char *field)
{
    const uint8_t *p = kvf_wire_rd_take(rd, 8, field);
    return p ? kvf_get_u64(p) : 0;
}

static void kvf_wire_rd_str(kvf_wire_rd_t *rd, kvf_wire_str_t *s,
                            const char *field)
{
    if (rd->bad)
        return;
    if (rd->left < 4) {
        kvf_wire_rd_fail(rd, "truncated at %s length (needs 4 bytes, %zu "
                         "left)", field, rd->left);
        return;
    }
    uint32_t len = kvf_get_u32(rd->p);
    rd->p += 4;
    rd->left -= 4;
    if (len > KVF_WIRE_MAX_STR) {
        kvf_wire_rd_fail(rd, "%s length %u exceeds limit %u", field, len,
                         KVF_WIRE_MAX_STR);
        return;
    }
    if (len > rd->left) {
        kvf_wire_rd_fail(rd, "%s length %u exceeds body (%zu bytes left)",
                         field, len, rd->left);
        return;
    }
    s->ptr = (const char *)rd->p;
    s->len = len;
    rd->p += len;
    rd->left -= len;
}

/* A u32 count, then count items of `size` bytes; returns the raw items. */
static const uint8_t *kvf_wire_rd_items(kvf_wire_rd_t *rd, size_t size,
                                        uint32_t max, const char *field,
                                        uint32_t *count_p)
{
    if (rd->bad)
        return NULL;
    if (rd->left < 4) {
        kvf_wire_rd_fail(rd, "truncated at %s count (needs 4 bytes, %zu "
                         "left)", field, rd->left);
        return NULL;
    }
    uint32_t count = kvf_get_u32(rd->p);
    rd->p += 4;
    rd->left -= 4;
    if (count > max) {
        kvf_wire_rd_fail(rd, "%s count %u exceeds limit %u", field, count, max);
        return NULL;
    }
    /* Divide rather than multiply: count * size may not fit a size_t. */
    if (count > rd->left / size) {
        kvf_wire_rd_fail(rd, "%s count %u exceeds body (%zu bytes left)",
                         field, count, rd->left);
        return NULL;
    }
    const uint8_t *items = rd->p;
    rd->p += (size_t)count * size;
    rd->left -= (size_t)count * size;
    *count_p = count;
    return items;
}

static void kvf_wire_rd_arr32(kvf_wire_rd_t *rd, kvf_wire_arr32_t *a,
                              uint32_t max, const char *field)
{
    a->raw = kvf_wire_rd_items(rd, 4, max, field, &a->count);
}

/* 64-bit arrays appear only in the layout: at most one per buffer. */
static void kvf_wire_rd_arr64(kvf_wire_rd_t *rd, kvf_wire_arr64_t *a,
                              const char *field)
{
    a->raw = kvf_wire_rd_items(rd, 8, KVF_WIRE_MAX_BUFS, field, &a->count);
}

static void kvf_wire_rd_hello(kvf_wire_rd_t *rd, kvf_msg_t *m)
{
    kvf_msg_hello_t *h = &m->u.hello;
    kvf_wire_layout_t *l = &h->layout;

    h->magic       = kvf_wire_rd_u32(rd, "magic");
    h->version     = kvf_wire_rd_u16(rd, "version");
    h->role        = kvf_wire_rd_u8(rd, "role");
    h->flags       = kvf_wire_rd_u8(rd, "flags");
    h->instance_id = kvf_wire_rd_u64(rd, "instance_id");
    h->tp_rank     = kvf_wire_rd_u32(rd, "tp_rank");
    h->tp_size     = kvf_wire_rd_u32(rd, "tp_size");
    h->pp_rank     = kvf_wire_rd_u32(rd, "pp_rank");
    h->pp_size     = kvf_wire_rd_u32(rd, "pp_size");
    h->dp_rank     = kvf_wire_rd_u32(rd, "dp_rank");
    h->dp_size     = kvf_wire_rd_u32(rd, "dp_size");
    kvf_wire_rd_str(rd, &h->addr, "addr");
    l->page_size   = kvf_wire_rd_u32(rd, "page_size");
    kvf_wire_rd_str(rd, &l->kv_dtype, "kv_dtype");
    l->attn        = kvf_wire_rd_u8(rd, "attn");
    l->mem_kind    = kvf_wire_rd_u8(rd, "mem_kind");
    l->num_layers  = kvf_wire_rd_u32(rd, "num_layers");
    l->first_layer = kvf_wire_rd_u32(rd, "first_layer");
    l->heads_per_rank = kvf_wire_rd_u32(rd, "heads_per_rank");
    l->total_heads    = kvf_wire_rd_u32(rd, "total_heads");
    l->bytes_per_head = kvf_wire_rd_u32(rd, "bytes_per_head");
    kvf_wire_rd_arr64(rd, &l->kv_item_bytes, "kv_item_bytes");
    kvf_wire_rd_arr64(rd, &l->kv_items, "kv_items");
    kvf_wire_rd_arr64(rd, &l->aux_item_bytes, "aux_item_bytes");
    kvf_wire_rd_arr64(rd, &l->aux_items, "aux_items");
    kvf_wire_rd_arr64(rd, &l->state_item_bytes, "state_item_bytes");
    kvf_wire_rd_arr64(rd, &l->state_items, "state_items");
    kvf_wire_rd_arr32(rd, &l->state_groups, KVF_WIRE_MAX_BUFS, "state_groups");
    kvf_wire_rd_str(rd, &l->state_types, "state_types");
    kvf_wire_rd_arr64(rd, &l->kv_tags, "kv_tags");
    l->kv_order = kvf_wire_rd_u8(rd, "kv_order");
}

static void kvf_wire_rd_room_req(kvf_wire_rd_t *rd, kvf_msg_t *m)
{
    kvf_msg_room_req_t *r = &m->u.room_req;
    r->room               = kvf_wire_rd_u64(rd, "room");
    r->instance           = kvf_wire_rd_u64(rd, "instance");
    r->dst_rank           = kvf_wire_rd_u32(rd, "dst_rank");
    r->expected_receivers = kvf_wire_rd_u32(rd, "expected_receivers");
    r->aux_slot           = kvf_wire_rd_u32(rd, "aux_slot");
    kvf_wire_rd_arr32(rd, &r->pages, UINT32_MAX, "page");
    kvf_wire_rd_arr32(rd, &r->state_counts, KVF_WIRE_MAX_BUFS, "state group");
    kvf_wire_rd_arr32(rd, &r->state_idx, UINT32_MAX, "state index");
    r->attempt            = kvf_wire_rd_u32(rd, "attempt");
    r->decode_prefix_len  = kvf_wire_rd_u32(rd, "decode_prefix_len");
    r->sender_instance    = kvf_wire_rd_u64(rd, "sender_instance");
    r->flags              = kvf_wire_rd_u32(rd, "flags");
}

/* d->strided is already set from the frame header. */
static void kvf_wire_rd_data(kvf_wire_rd_t *rd, kvf_msg_t *m)
{
    kvf_msg_data_t *d = &m->u.data;
    d->room        = kvf_wire_rd_u64(rd, "room");
    d->instance    = kvf_wire_rd_u64(rd, "instance");
    d->src_rank    = kvf_wire_rd_u32(rd, "src_rank");
    d->payload_len = kvf_wire_rd_u64(rd, "payload_len");
    d->raw_segs    = kvf_wire_rd_items(rd, d->strided ? KVF_WIRE_SSEG_LEN
                                                      : KVF_WIRE_SEG_LEN,
                                       KVF_WIRE_MAX_SEGS, "segment",
                                       &d->nseg);
}

static void kvf_wire_rd_data_ref(kvf_wire_rd_t *rd, kvf_msg_t *m)
{
    kvf_msg_data_t *d = &m->u.data;
    kvf_wire_rd_data(rd, m);
    d->src_addrs.raw = kvf_wire_rd_items(rd, 8, KVF_WIRE_MAX_SEGS,
                                         "source address",
                                         &d->src_addrs.count);
}

static void kvf_wire_rd_xport(kvf_wire_rd_t *rd, kvf_msg_t *m)
{
    kvf_msg_xport_t *x = &m->u.xport;
    x->count = kvf_wire_rd_u32(rd, "count");
    if (x->count > KVF_WIRE_MAX_XPORTS) {
        kvf_wire_rd_fail(rd, "%u transports, at most %u", x->count,
                         KVF_WIRE_MAX_XPORTS);
        return;
    }
    for (uint32_t i = 0; i < x->count && !rd->bad; i++) {
        kvf_wire_rd_str(rd, &x->x[i].name, "name");
        x->x[i].blob = kvf_wire_rd_items(rd, 1, KVF_WIRE_MAX_BLOB, "blob",
                                         &x->x[i].blob_len);
    }
}

static void kvf_wire_rd_done(kvf_wire_rd_t *rd, kvf_msg_t *m)
{
    m->u.done.room         = kvf_wire_rd_u64(rd, "room");
    m->u.done.instance     = kvf_wire_rd_u64(rd, "instance");
    m->u.done.src_rank     = kvf_wire_rd_u32(rd, "src_rank");
    m->u.done.bytes        = kvf_wire_rd_u64(rd, "bytes");
    m->u.done.has_checksum = kvf_wire_rd_u8(rd, "has_checksum");
    m->u.done.checksum     = kvf_wire_rd_u64(rd, "checksum");
    if (rd->left == 8) {      /* the optional stream fields; else trailing */
        m->u.done.stream   = kvf_wire_rd_u32(rd, "stream");
        m->u.done.streams  = kvf_wire_rd_u32(rd, "streams");
        if (m->u.done.streams == 0)
            kvf_wire_rd_fail(rd, "streams is 0 (omit both fields instead)");
    }
}

static void kvf_wire_rd_done_ack(kvf_wire_rd_t *rd, kvf_msg_t *m)
{
    m->u.done_ack.room   = kvf_wire_rd_u64(rd, "room");
    m->u.done_ack.instance = kvf_wire_rd_u64(rd, "instance");
    m->u.done_ack.status = (int32_t)kvf_wire_rd_u32(rd, "status");
    m->u.done_ack.bytes  = kvf_wire_rd_u64(rd, "bytes");
}

/* FAIL and ABORT share this body. */
static void kvf_wire_rd_fail_msg(kvf_wire_rd_t *rd, kvf_msg_t *m)
{
    m->u.fail.room        = kvf_wire_rd_u64(rd, "room");
    m->u.fail.instance    = kvf_wire_rd_u64(rd, "instance");
    m->u.fail.status      = (int32_t)kvf_wire_rd_u32(rd, "status");
    m->u.fail.origin_side = kvf_wire_rd_u8(rd, "origin_side");
    m->u.fail.origin_rank = kvf_wire_rd_u32(rd, "origin_rank");
    kvf_wire_rd_str(rd, &m->u.fail.origin_addr, "origin_addr");
    kvf_wire_rd_str(rd, &m->u.fail.reason, "reason");
    m->u.fail.sender_instance = kvf_wire_rd_u64(rd, "sender_instance");
    m->u.fail.sides       = kvf_wire_rd_u8(rd, "sides");
}

static void kvf_wire_rd_heartbeat(kvf_wire_rd_t *rd, kvf_msg_t *m)
{
    m->u.heartbeat.seq     = kvf_wire_rd_u64(rd, "seq");
    m->u.heartbeat.time_ns = kvf_wire_rd_u64(rd, "time_ns");
}

static void kvf_wire_rd_auth(kvf_wire_rd_t *rd, kvf_msg_t *m)
{
    kvf_msg_auth_t *a = &m->u.auth;
    a->magic       = kvf_wire_rd_u32(rd, "magic");
    a->version     = kvf_wire_rd_u16(rd, "version");
    a->role        = kvf_wire_rd_u8(rd, "role");
    a->flags       = kvf_wire_rd_u8(rd, "flags");
    a->instance_id = kvf_wire_rd_u64(rd, "instance_id");
    a->pid         = kvf_wire_rd_u32(rd, "pid");
    const uint8_t *n = kvf_wire_rd_take(rd, KVF_WIRE_NONCE_LEN, "nonce");
    if (n != NULL)
        memcpy(a->nonce, n, KVF_WIRE_NONCE_LEN);
}

static void kvf_wire_rd_proof(kvf_wire_rd_t *rd, kvf_msg_t *m)
{
    const uint8_t *mac = kvf_wire_rd_take(rd, KVF_WIRE_MAC_LEN, "mac");
    if (mac != NULL)
        memcpy(m->u.proof.mac, mac, KVF_WIRE_MAC_LEN);
}

static void kvf_wire_rd_join(kvf_wire_rd_t *rd, kvf_msg_t *m)
{
    const uint8_t *c = kvf_wire_rd_take(rd, KVF_WIRE_COOKIE_LEN, "cookie");
    if (c != NULL)
        memcpy(m->u.join.cookie, c, KVF_WIRE_COOKIE_LEN);
    m->u.join.stream = kvf_wire_rd_u32(rd, "stream");
}

/* ------------------------------------------------------------------------ */
/* The message table                                                        */
/* ------------------------------------------------------------------------ */

static const kvf_wire_msg_ops_t kvf_wire_msgs[KVF_WIRE_NTYPES] = {
#define KVF_WIRE_MSG(t, n, flags, prefix, chk, w, r)                           \
    [t] = { n, flags, prefix, chk, w, r }
    KVF_WIRE_MSG(KVF_MSG_HELLO, "HELLO", 0, KVF_WIRE_PREFIX_LEN,
                 kvf_wire_check_hello, kvf_wire_wr_hello, kvf_wire_rd_hello),
    KVF_WIRE_MSG(KVF_MSG_ROOM_REQ, "ROOM_REQ", 0, 0, kvf_wire_check_room_req,
                 kvf_wire_wr_room_req, kvf_wire_rd_room_req),
    KVF_WIRE_MSG(KVF_MSG_DATA, "DATA", KVF_WIRE_F_STRIDED, 0,
                 kvf_wire_check_data, kvf_wire_wr_data, kvf_wire_rd_data),
    KVF_WIRE_MSG(KVF_MSG_DONE, "DONE", 0, 0, kvf_wire_check_done,
                 kvf_wire_wr_done, kvf_wire_rd_done),
    KVF_WIRE_MSG(KVF_MSG_DONE_ACK, "DONE_ACK", 0, 0, kvf_wire_check_done_ack,
                 kvf_wire_wr_done_ack, kvf_wire_rd_done_ack),
    KVF_WIRE_MSG(KVF_MSG_FAIL, "FAIL", 0, 0, kvf_wire_check_fail,
                 kvf_wire_wr_fail, kvf_wire_rd_fail_msg),
    KVF_WIRE_MSG(KVF_MSG_ABORT, "ABORT", 0, 0, kvf_wire_check_fail,
                 kvf_wire_wr_fail, kvf_wire_rd_fail_msg),
    KVF_WIRE_MSG(KVF_MSG_HEARTBEAT, "HEARTBEAT", 0, 0, kvf_wire_check_any,
                 kvf_wire_wr_heartbeat, kvf_wire_rd_heartbeat),
    KVF_WIRE_MSG(KVF_MSG_XPORT, "XPORT", 0, 0, kvf_wire_check_xport,
                 kvf_wire_wr_xport, kvf_wire_rd_xport),
    KVF_WIRE_MSG(KVF_MSG_DATA_REF, "DATA_REF", KVF_WIRE_F_STRIDED, 0,
                 kvf_wire_check_data_ref, kvf_wire_wr_data_ref,
                 kvf_wire_rd_data_ref),
    KVF_WIRE_MSG(KVF_MSG_AUTH, "AUTH", 0, KVF_WIRE_PREFIX_LEN,
                 kvf_wire_check_auth, kvf_wire_wr_auth, kvf_wire_rd_auth),
    KVF_WIRE_MSG(KVF_MSG_AUTH_PROOF, "AUTH_PROOF", 0, 0, kvf_wire_check_any,
                 kvf_wire_wr_proof, kvf_wire_rd_proof),
    KVF_WIRE_MSG(KVF_MSG_JOIN, "JOIN", 0, 0, kvf_wire_check_join,
                 kvf_wire_wr_join, kvf_wire_rd_join),
#undef KVF_WIRE_MSG
};

/* Only for a valid type: kvf_wire_decode() checked the header. */
static void kvf_wire_rd_body(kvf_wire_rd_t *rd, kvf_msg_t *m)
{
    kvf_wire_msgs[m->type].rd(rd, m);
}

/*
 * The first six bytes of HELLO and AUTH (magic, version) are frozen across
 * protocol versions: they are checked before anything else, so that a peer
 * whose first frame has another shape is still reported as a version
 * mismatch.  A version-1 peer leads with HELLO, a version-2 one with AUTH.
 */
static kvf_status_t kvf_wire_check_version(const char *what, const uint8_t *body,
                                           uint32_t len, char *err, size_t errlen)
{
    if (len < 4) {
        kvf_wire_errf(err, errlen, "%s: body of %u bytes is too short for "
                      "the magic number", what, len);
        return KVF_ERR_PROTOCOL;
    }
    uint32_t magic = kvf_get_u32(body);
    if (magic != KVF_WIRE_MAGIC) {
        kvf_wire_errf(err, errlen, "%s: magic 0x%08x is not kvferry's "
                      "0x%08x: the peer is not a kvferry engine", what, magic,
                      KVF_WIRE_MAGIC);
        return KVF_ERR_VERSION;
    }
    if (len < 6) {
        kvf_wire_errf(err, errlen, "%s: body of %u bytes is too short for "
                      "the protocol version", what, len);
        return KVF_ERR_PROTOCOL;
    }
    uint16_t version = kvf_get_u16(body + 4);
    if (version != KVF_WIRE_VERSION) {
        kvf_wire_errf(err, errlen, "%s: peer speaks kvferry wire protocol "
                      "version %u, this build speaks version %u. Prefill and "
                      "decode must run kvferry builds with the same wire "
                      "protocol version.", what, version, KVF_WIRE_VERSION);
        return KVF_ERR_VERSION;
    }
    return KVF_OK;
}

uint32_t kvf_wire_prefix_len(uint8_t type)
{
    return kvf_wire_type_valid(type) ? kvf_wire_msgs[type].prefix_len : 0;
}

kvf_status_t kvf_wire_check_prefix(uint8_t type, const uint8_t *body, uint32_t len,
                                   char *err, size_t errlen)
{
    if (kvf_wire_prefix_len(type) == 0)
        return KVF_OK;
    return kvf_wire_check_version(kvf_wire_type_name(type), body, len, err, errlen);
}

kvf_status_t kvf_wire_decode(const kvf_wire_hdr_t *hdr, const uint8_t *body,
                             kvf_msg_t *msg_p, char *err, size_t errlen)
{
    if (hdr == NULL || msg_p == NULL || (body == NULL && hdr->length != 0)) {
        kvf_wire_errf(err, errlen, "kvf_wire_decode: NULL argument");
        return KVF_ERR_INVALID_PARAM;
    }
    if (!kvf_wire_type_valid(hdr->type)) {
        kvf_wire_errf(err, errlen, "unknown message type %u", hdr->type);
        return KVF_ERR_PROTOCOL;
    }
    if (hdr->length > KVF_WIRE_MAX_BODY) {
        kvf_wire_errf(err, errlen, "%s: body length %u exceeds limit %u",
                      kvf_wire_type_name(hdr->type), hdr->length,
                      KVF_WIRE_MAX_BODY);
        return KVF_ERR_PROTOCOL;
    }
    kvf_status_t vst = kvf_wire_check_prefix(hdr->type, body, hdr->length, err, errlen);
    if (vst != KVF_OK)
        return vst;

    uint8_t allowed = kvf_wire_msgs[hdr->type].frame_flags;
    if ((hdr->flags & ~allowed) != 0) {
        kvf_wire_errf(err, errlen, "%s: unknown frame flags 0x%02x",
                      kvf_wire_type_name(hdr->type), hdr->flags);
        return KVF_ERR_PROTOCOL;
    }

    kvf_msg_t m;
    memset(&m, 0, sizeof(m));
    m.type = (kvf_msg_type_t)hdr->type;
    if (allowed)
        m.u.data.strided = (hdr->flags & KVF_WIRE_F_STRIDED) != 0;
    kvf_wire_rd_t rd = {
        .p = body, .left = hdr->length, .what = kvf_wire_type_name(hdr->type),
        .err = err, .errlen = errlen, .bad = false,
    };
    kvf_wire_rd_body(&rd, &m);
    if (!rd.bad && rd.left != 0)
        kvf_wire_rd_fail(&rd, "%zu trailing bytes after the message", rd.left);
    uint32_t pieces = 0;
    if (rd.bad || !kvf_wire_check(&m, &pieces, err, errlen))
        return KVF_ERR_PROTOCOL;
    if (allowed)
        m.u.data.npieces = pieces;
    *msg_p = m;
    return KVF_OK;
}
