/*
 * The control-protocol codec: every message type round-trips, golden bytes
 * pin the layout that docs/PROTOCOL.md documents, and every malformed input
 * (truncation at each byte, trailing bytes, each limit, bad values, another
 * protocol version) is refused with a precise reason.  Bodies under test
 * live in exactly-sized heap copies so that AddressSanitizer catches any
 * read past the end.
 */
#include "wire/wire.h"

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvf_test.h"

#define BIG32 0x89abcdefu
#define BIG64 0x0123456789abcdefull

static kvf_wire_str_t str_of(const char *s)
{
    return (kvf_wire_str_t){ s, (uint32_t)strlen(s) };
}

static bool str_eq(kvf_wire_str_t a, const char *s)
{
    return a.len == strlen(s) && (a.len == 0 || memcmp(a.ptr, s, a.len) == 0);
}

/* Test-owned sample data. */
static const uint64_t kv_bytes[]  = { 65536, 65536, 65536, 65536 };
static const uint64_t kv_items[]  = { 5000000000ull, 5000000000ull, 4096, 7 };
static const uint64_t aux_bytes[] = { 4096 };
static const uint64_t aux_items[] = { 1ull << 40 };
static const uint64_t st_bytes[]  = { 1ull << 33, 12 };
static const uint64_t st_items[]  = { 3, BIG64 };
static const uint32_t pages[]     = { 0, 7, 8, 9, BIG32, 42 };
static const uint32_t slots[]     = { 3, BIG32 };
static const uint32_t st_counts[] = { 1, 1 };            /* two state groups */
static const uint32_t groups[]    = { 2 };               /* one group of 2 buffers */
static const uint64_t tags[]      = { 0x0000000000000007ull, 0x0000000100000007ull,
                                      0x0001000200000000ull, 0xffffffff00000009ull };
/* What HELLO's layout carries after state_items: state_groups (1), the
 * types ("mamba") and kv_tags (4), each with its count, and kv_order. */
#define HELLO_TAIL ((4 + 4) + (4 + 5) + (4 + 4 * 8) + 1)
static const kvf_wire_seg_t segs[] = {
    { KVF_BUF_KV, 0, 0, 4096, 1, 0, 0 },
    { KVF_BUF_KV, 77, 6000000000ull, 1u << 31, 1, 0, 0 },
    { KVF_BUF_AUX, 0, 8192, 100, 1, 0, 0 },
    { KVF_BUF_STATE, 1, UINT64_MAX - 5, 5, 1, 0, 0 },
};

static kvf_msg_t sample_hello(void)
{
    kvf_msg_t m;
    memset(&m, 0, sizeof(m));
    m.type = KVF_MSG_HELLO;
    kvf_msg_hello_t *h = &m.u.hello;
    h->magic = KVF_WIRE_MAGIC;
    h->version = KVF_WIRE_VERSION;
    h->role = 1;
    h->flags = KVF_HELLO_F_CHECKSUM;
    h->instance_id = BIG64;
    h->tp_rank = 3; h->tp_size = 8;
    h->pp_rank = 1; h->pp_size = 2;
    h->dp_rank = 5; h->dp_size = BIG32;
    h->addr = str_of("10.0.0.17:51234");
    h->layout.page_size = 64;
    h->layout.kv_dtype = str_of("bfloat16");
    h->layout.attn = 1;
    h->layout.mem_kind = 1;
    h->layout.num_layers = 61;
    h->layout.first_layer = 7;
    h->layout.heads_per_rank = 4;
    h->layout.total_heads = 32;
    h->layout.bytes_per_head = 256;
    h->layout.kv_item_bytes = (kvf_wire_arr64_t){ 4, kv_bytes, NULL };
    h->layout.kv_items = (kvf_wire_arr64_t){ 4, kv_items, NULL };
    h->layout.aux_item_bytes = (kvf_wire_arr64_t){ 1, aux_bytes, NULL };
    h->layout.aux_items = (kvf_wire_arr64_t){ 1, aux_items, NULL };
    h->layout.state_item_bytes = (kvf_wire_arr64_t){ 2, st_bytes, NULL };
    h->layout.state_items = (kvf_wire_arr64_t){ 2, st_items, NULL };
    h->layout.state_groups = (kvf_wire_arr32_t){ 1, groups, NULL };
    h->layout.state_types = str_of("mamba");
    h->layout.kv_tags = (kvf_wire_arr64_t){ 4, tags, NULL };
    return m;
}

static kvf_msg_t sample_room_req(void)
{
    kvf_msg_t m;
    memset(&m, 0, sizeof(m));
    m.type = KVF_MSG_ROOM_REQ;
    m.u.room_req.room = BIG64;
    m.u.room_req.instance = 0xa1a2a3a4a5a6a7a8ull;
    m.u.room_req.dst_rank = 2;
    m.u.room_req.expected_receivers = 4;
    m.u.room_req.aux_slot = BIG32;
    m.u.room_req.pages = (kvf_wire_arr32_t){ 6, pages, NULL };
    m.u.room_req.state_counts = (kvf_wire_arr32_t){ 2, st_counts, NULL };
    m.u.room_req.state_idx = (kvf_wire_arr32_t){ 2, slots, NULL };
    m.u.room_req.attempt = 3;
    m.u.room_req.decode_prefix_len = 77;
    m.u.room_req.sender_instance = 0x1122334455667788ull;
    m.u.room_req.flags = 0;
    return m;
}

static kvf_msg_t sample_data(void)
{
    kvf_msg_t m;
    memset(&m, 0, sizeof(m));
    m.type = KVF_MSG_DATA;
    m.u.data.room = BIG64;
    m.u.data.instance = 0xb1b2b3b4b5b6b7b8ull;
    m.u.data.src_rank = 7;
    m.u.data.payload_len = 4096 + (1ull << 31) + 100 + 5;
    m.u.data.nseg = 4;
    m.u.data.segs = segs;
    return m;
}

static kvf_msg_t sample_done(void)
{
    kvf_msg_t m;
    memset(&m, 0, sizeof(m));
    m.type = KVF_MSG_DONE;
    m.u.done.room = BIG64;
    m.u.done.instance = 0xc1c2c3c4c5c6c7c8ull;
    m.u.done.src_rank = 1;
    m.u.done.bytes = 1ull << 36;
    m.u.done.has_checksum = 1;
    m.u.done.checksum = 0xfedcba9876543210ull;
    return m;
}

static kvf_msg_t sample_done_ack(void)
{
    kvf_msg_t m;
    memset(&m, 0, sizeof(m));
    m.type = KVF_MSG_DONE_ACK;
    m.u.done_ack.room = BIG64;
    m.u.done_ack.instance = 0xd1d2d3d4d5d6d7d8ull;
    m.u.done_ack.status = KVF_ERR_INCOMPLETE;
    m.u.done_ack.bytes = 1ull << 36;
    return m;
}

static kvf_msg_t sample_fail(kvf_msg_type_t type)
{
    kvf_msg_t m;
    memset(&m, 0, sizeof(m));
    m.type = type;
    m.u.fail.room = BIG64;
    m.u.fail.instance = 0xe1e2e3e4e5e6e7e8ull;
    m.u.fail.status = type == KVF_MSG_ABORT ? KVF_ERR_ABORTED
                                            : KVF_ERR_BAD_INDICES;
    m.u.fail.origin_side = 1;
    m.u.fail.origin_rank = 6;
    m.u.fail.origin_addr = str_of("decode-3:7000");
    m.u.fail.reason = str_of("DATA segment 2 writes past page 17");
    m.u.fail.sender_instance = 0x0102030405060708ull;
    m.u.fail.sides = KVF_SIDES_ALL;
    return m;
}

static kvf_msg_t sample_heartbeat(void)
{
    kvf_msg_t m;
    memset(&m, 0, sizeof(m));
    m.type = KVF_MSG_HEARTBEAT;
    m.u.heartbeat.seq = 1ull << 35;
    m.u.heartbeat.time_ns = BIG64;
    return m;
}

static kvf_msg_t sample_auth(void)
{
    kvf_msg_t m;
    memset(&m, 0, sizeof(m));
    m.type = KVF_MSG_AUTH;
    m.u.auth.magic = KVF_WIRE_MAGIC;
    m.u.auth.version = KVF_WIRE_VERSION;
    m.u.auth.role = 1;
    m.u.auth.flags = KVF_AUTH_F_TOKEN;
    m.u.auth.instance_id = BIG64;
    m.u.auth.pid = 0x01020304;
    for (int i = 0; i < KVF_WIRE_NONCE_LEN; i++)
        m.u.auth.nonce[i] = (uint8_t)(0xa0 + i);
    return m;
}

static kvf_msg_t sample_proof(void)
{
    kvf_msg_t m;
    memset(&m, 0, sizeof(m));
    m.type = KVF_MSG_AUTH_PROOF;
    for (int i = 0; i < KVF_WIRE_MAC_LEN; i++)
        m.u.proof.mac[i] = (uint8_t)(0x10 + i);
    return m;
}

#define NSAMPLES 10
static kvf_msg_t sample(int i)
{
    switch (i) {
    case 8: return sample_auth();
    case 9: return sample_proof();
    case 0: return sample_hello();
    case 1: return sample_room_req();
    case 2: return sample_data();
    case 3: return sample_done();
    case 4: return sample_done_ack();
    case 5: return sample_fail(KVF_MSG_FAIL);
    case 6: return sample_fail(KVF_MSG_ABORT);
    default: return sample_heartbeat();
    }
}

/* Decode `len` body bytes from an exactly-sized heap copy. */
static kvf_status_t decode_copy(uint8_t type, const uint8_t *body, size_t len,
                                kvf_msg_t *m, char *err, size_t errlen)
{
    uint8_t *copy = malloc(len ? len : 1);
    if (len)
        memcpy(copy, body, len);
    kvf_wire_hdr_t hdr = { (uint32_t)len, type, 0 };
    err[0] = '\0';
    kvf_status_t st = kvf_wire_decode(&hdr, copy, m, err, errlen);
    free(copy);
    return st;
}

/* Encode m, check its header, decode it; *out keeps the frame. */
static kvf_status_t encode_decode(const kvf_msg_t *m, kvf_buf_t *out,
                                  kvf_msg_t *dec, char *err, size_t errlen)
{
    kvf_buf_init(out);
    kvf_status_t st = kvf_wire_encode(out, m);
    if (st != KVF_OK)
        return st;
    kvf_wire_hdr_t hdr;
    st = kvf_wire_parse_header(out->data, &hdr, err, errlen);
    if (st != KVF_OK)
        return st;
    CHECK_EQ_INT(hdr.type, m->type);
    CHECK_EQ_INT(hdr.length, out->len - KVF_WIRE_HDR_LEN);
    err[0] = '\0';
    return kvf_wire_decode(&hdr, out->data + KVF_WIRE_HDR_LEN, dec, err, errlen);
}

static void check_arr64(const kvf_wire_arr64_t *got, const kvf_wire_arr64_t *want)
{
    CHECK_EQ_INT(got->count, want->count);
    CHECK(got->native == NULL);
    for (uint32_t i = 0; i < got->count && i < want->count; i++)
        CHECK(kvf_wire_arr64_at(got, i) == kvf_wire_arr64_at(want, i));
}

static void check_arr32(const kvf_wire_arr32_t *got, const kvf_wire_arr32_t *want)
{
    CHECK_EQ_INT(got->count, want->count);
    for (uint32_t i = 0; i < got->count && i < want->count; i++)
        CHECK_EQ_INT(kvf_wire_arr32_at(got, i), kvf_wire_arr32_at(want, i));
}

/* ------------------------------------------------------------------------ */

static void test_roundtrip_hello(void)
{
    kvf_msg_t m = sample_hello(), d;
    kvf_buf_t b;
    char err[256];
    CHECK_EQ_INT(encode_decode(&m, &b, &d, err, sizeof(err)), KVF_OK);
    CHECK_EQ_INT(d.type, KVF_MSG_HELLO);
    const kvf_msg_hello_t *h = &d.u.hello;
    CHECK(h->magic == KVF_WIRE_MAGIC);
    CHECK_EQ_INT(h->version, KVF_WIRE_VERSION);
    CHECK_EQ_INT(h->role, 1);
    CHECK_EQ_INT(h->flags, KVF_HELLO_F_CHECKSUM);
    CHECK(h->instance_id == BIG64);
    CHECK_EQ_INT(h->tp_rank, 3);
    CHECK_EQ_INT(h->tp_size, 8);
    CHECK_EQ_INT(h->pp_rank, 1);
    CHECK_EQ_INT(h->pp_size, 2);
    CHECK_EQ_INT(h->dp_rank, 5);
    CHECK(h->dp_size == BIG32);
    CHECK(str_eq(h->addr, "10.0.0.17:51234"));
    CHECK_EQ_INT(h->layout.page_size, 64);
    CHECK(str_eq(h->layout.kv_dtype, "bfloat16"));
    CHECK_EQ_INT(h->layout.attn, 1);
    CHECK_EQ_INT(h->layout.mem_kind, 1);
    CHECK_EQ_INT(h->layout.num_layers, 61);
    CHECK_EQ_INT(h->layout.first_layer, 7);
    CHECK_EQ_INT(h->layout.heads_per_rank, 4);
    CHECK_EQ_INT(h->layout.total_heads, 32);
    CHECK_EQ_INT(h->layout.bytes_per_head, 256);
    check_arr64(&h->layout.kv_item_bytes, &m.u.hello.layout.kv_item_bytes);
    check_arr64(&h->layout.kv_items, &m.u.hello.layout.kv_items);
    check_arr64(&h->layout.aux_item_bytes, &m.u.hello.layout.aux_item_bytes);
    check_arr64(&h->layout.aux_items, &m.u.hello.layout.aux_items);
    check_arr64(&h->layout.state_item_bytes, &m.u.hello.layout.state_item_bytes);
    check_arr64(&h->layout.state_items, &m.u.hello.layout.state_items);
    check_arr32(&h->layout.state_groups, &m.u.hello.layout.state_groups);
    CHECK(h->layout.state_types.len == 5 &&
          memcmp(h->layout.state_types.ptr, "mamba", 5) == 0);
    check_arr64(&h->layout.kv_tags, &m.u.hello.layout.kv_tags);
    /* decoded strings point into the body: no copy */
    CHECK(h->addr.ptr > (const char *)b.data &&
          h->addr.ptr < (const char *)b.data + b.len);
    kvf_buf_free(&b);
}

/* HELLO's KV page order: the body's last byte, 0 NHD or 1 HND. */
static void test_hello_kv_order(void)
{
    kvf_msg_t m = sample_hello(), d;
    kvf_buf_t nhd, hnd;
    char err[256];

    CHECK_EQ_INT(encode_decode(&m, &nhd, &d, err, sizeof(err)), KVF_OK);
    CHECK_EQ_INT(d.u.hello.layout.kv_order, 0);
    m.u.hello.layout.kv_order = 1;               /* KVF_KV_HND */
    CHECK_EQ_INT(encode_decode(&m, &hnd, &d, err, sizeof(err)), KVF_OK);
    CHECK_EQ_INT(d.u.hello.layout.kv_order, 1);
    /* The same bytes but the last: the order. */
    CHECK_EQ_INT(hnd.len, nhd.len);
    CHECK(memcmp(hnd.data, nhd.data, nhd.len - 1) == 0);
    CHECK_EQ_INT(nhd.data[nhd.len - 1], 0);
    CHECK_EQ_INT(hnd.data[hnd.len - 1], 1);

    uint8_t *body = hnd.data + KVF_WIRE_HDR_LEN;
    size_t len = hnd.len - KVF_WIRE_HDR_LEN;
    body[len - 1] = 2;
    CHECK_EQ_INT(decode_copy(KVF_MSG_HELLO, body, len, &d, err, sizeof(err)), KVF_ERR_PROTOCOL);
    CHECK_STR_CONTAINS(err, "HELLO: layout has unknown KV page order 2");
    /* Without it, the body is short. */
    CHECK_EQ_INT(decode_copy(KVF_MSG_HELLO, body, len - 1, &d, err, sizeof(err)),
                 KVF_ERR_PROTOCOL);
    kvf_buf_free(&hnd);
    kvf_buf_free(&nhd);

    m.u.hello.layout.kv_order = 2;               /* would not decode */
    kvf_buf_init(&hnd);
    CHECK_EQ_INT(kvf_wire_encode(&hnd, &m), KVF_ERR_INVALID_PARAM);
    kvf_buf_free(&hnd);
}

static void test_roundtrip_room_req(void)
{
    kvf_msg_t m = sample_room_req(), d;
    kvf_buf_t b;
    char err[256];
    CHECK_EQ_INT(encode_decode(&m, &b, &d, err, sizeof(err)), KVF_OK);
    CHECK_EQ_INT(d.type, KVF_MSG_ROOM_REQ);
    CHECK(d.u.room_req.room == BIG64);
    CHECK_EQ_INT(d.u.room_req.dst_rank, 2);
    CHECK_EQ_INT(d.u.room_req.expected_receivers, 4);
    CHECK(d.u.room_req.aux_slot == BIG32);
    check_arr32(&d.u.room_req.pages, &m.u.room_req.pages);
    check_arr32(&d.u.room_req.state_counts, &m.u.room_req.state_counts);
    check_arr32(&d.u.room_req.state_idx, &m.u.room_req.state_idx);
    CHECK_EQ_INT(d.u.room_req.attempt, 3);
    CHECK_EQ_INT(d.u.room_req.decode_prefix_len, 77);
    CHECK_EQ_INT(d.u.room_req.sender_instance == 0x1122334455667788ull, 1);
    CHECK(d.u.room_req.instance == 0xa1a2a3a4a5a6a7a8ull);
    kvf_buf_free(&b);

    /* empty arrays */
    m.u.room_req.pages = (kvf_wire_arr32_t){ 0, NULL, NULL };
    m.u.room_req.state_counts = (kvf_wire_arr32_t){ 0, NULL, NULL };
    m.u.room_req.state_idx = (kvf_wire_arr32_t){ 0, NULL, NULL };
    CHECK_EQ_INT(encode_decode(&m, &b, &d, err, sizeof(err)), KVF_OK);
    CHECK_EQ_INT(d.u.room_req.pages.count, 0);
    CHECK_EQ_INT(d.u.room_req.state_counts.count, 0);
    kvf_buf_free(&b);

    /* group counts that do not add up to the indices given */
    m = sample_room_req();
    static const uint32_t three[] = { 1, 2 };
    m.u.room_req.state_counts = (kvf_wire_arr32_t){ 2, three, NULL };
    CHECK_EQ_INT(encode_decode(&m, &b, &d, err, sizeof(err)), KVF_ERR_INVALID_PARAM);
    kvf_buf_free(&b);

    /* A watch: flags, and nothing to place. */
    m = sample_room_req();
    m.u.room_req.flags = KVF_REQ_WATCH;
    m.u.room_req.pages = (kvf_wire_arr32_t){ 0, NULL, NULL };
    m.u.room_req.state_counts = (kvf_wire_arr32_t){ 0, NULL, NULL };
    m.u.room_req.state_idx = (kvf_wire_arr32_t){ 0, NULL, NULL };
    CHECK_EQ_INT(encode_decode(&m, &b, &d, err, sizeof(err)), KVF_OK);
    CHECK_EQ_INT(d.u.room_req.flags, KVF_REQ_WATCH);
    kvf_buf_free(&b);
    /* ... that names pages, or flags no build knows: refused. */
    m.u.room_req.pages = (kvf_wire_arr32_t){ 6, pages, NULL };
    CHECK_EQ_INT(encode_decode(&m, &b, &d, err, sizeof(err)), KVF_ERR_INVALID_PARAM);
    kvf_buf_free(&b);
    m.u.room_req.pages = (kvf_wire_arr32_t){ 0, NULL, NULL };
    m.u.room_req.flags = 0x4;
    CHECK_EQ_INT(encode_decode(&m, &b, &d, err, sizeof(err)), KVF_ERR_INVALID_PARAM);
    kvf_buf_free(&b);
}

static void test_roundtrip_data(void)
{
    kvf_msg_t m = sample_data(), d;
    kvf_buf_t b;
    char err[256];
    CHECK_EQ_INT(encode_decode(&m, &b, &d, err, sizeof(err)), KVF_OK);
    CHECK_EQ_INT(d.type, KVF_MSG_DATA);
    CHECK(d.u.data.room == BIG64);
    CHECK_EQ_INT(d.u.data.src_rank, 7);
    CHECK(d.u.data.instance == 0xb1b2b3b4b5b6b7b8ull);
    CHECK(d.u.data.payload_len == m.u.data.payload_len);
    CHECK_EQ_INT(d.u.data.nseg, 4);
    CHECK(d.u.data.segs == NULL && d.u.data.raw_segs != NULL);
    CHECK_EQ_INT(b.len, KVF_WIRE_HDR_LEN + 32 + 4 * KVF_WIRE_SEG_LEN);
    for (uint32_t i = 0; i < 4; i++) {
        kvf_wire_seg_t s;
        kvf_wire_seg_at(&d.u.data, i, &s);
        CHECK_EQ_INT(s.kind, segs[i].kind);
        CHECK_EQ_INT(s.buf, segs[i].buf);
        CHECK(s.offset == segs[i].offset);
        CHECK_EQ_INT(s.len, segs[i].len);
    }
    kvf_buf_free(&b);
}

static void test_roundtrip_small(void)
{
    kvf_msg_t m, d;
    kvf_buf_t b;
    char err[256];

    m = sample_done();
    CHECK_EQ_INT(encode_decode(&m, &b, &d, err, sizeof(err)), KVF_OK);
    CHECK(d.u.done.room == BIG64);
    CHECK_EQ_INT(d.u.done.src_rank, 1);
    CHECK(d.u.done.instance == 0xc1c2c3c4c5c6c7c8ull);
    CHECK(d.u.done.bytes == 1ull << 36);
    CHECK_EQ_INT(d.u.done.has_checksum, 1);
    CHECK(d.u.done.checksum == 0xfedcba9876543210ull);
    CHECK_EQ_INT(b.len, KVF_WIRE_HDR_LEN + 37);
    kvf_buf_free(&b);

    m = sample_done_ack();
    CHECK_EQ_INT(encode_decode(&m, &b, &d, err, sizeof(err)), KVF_OK);
    CHECK(d.u.done_ack.room == BIG64);
    CHECK_EQ_INT(d.u.done_ack.status, KVF_ERR_INCOMPLETE);
    CHECK(d.u.done_ack.instance == 0xd1d2d3d4d5d6d7d8ull);
    CHECK(d.u.done_ack.bytes == 1ull << 36);
    kvf_buf_free(&b);

    m = sample_heartbeat();
    CHECK_EQ_INT(encode_decode(&m, &b, &d, err, sizeof(err)), KVF_OK);
    CHECK(d.u.heartbeat.seq == 1ull << 35);
    CHECK(d.u.heartbeat.time_ns == BIG64);
    kvf_buf_free(&b);
}

static void test_roundtrip_fail_abort(void)
{
    kvf_msg_type_t types[] = { KVF_MSG_FAIL, KVF_MSG_ABORT };
    for (int i = 0; i < 2; i++) {
        kvf_msg_t m = sample_fail(types[i]), d;
        kvf_buf_t b;
        char err[256];
        CHECK_EQ_INT(encode_decode(&m, &b, &d, err, sizeof(err)), KVF_OK);
        CHECK_EQ_INT(d.type, types[i]);
        CHECK_EQ_INT(b.data[4], types[i]);
        CHECK(d.u.fail.room == BIG64);
        CHECK_EQ_INT(d.u.fail.status, m.u.fail.status);
        CHECK(d.u.fail.instance == 0xe1e2e3e4e5e6e7e8ull);
        CHECK(d.u.fail.sender_instance == 0x0102030405060708ull);
        CHECK_EQ_INT(d.u.fail.sides, KVF_SIDES_ALL);
        CHECK_EQ_INT(d.u.fail.origin_side, 1);
        CHECK_EQ_INT(d.u.fail.origin_rank, 6);
        CHECK(str_eq(d.u.fail.origin_addr, "decode-3:7000"));
        CHECK(str_eq(d.u.fail.reason, "DATA segment 2 writes past page 17"));
        kvf_buf_free(&b);
    }
}

/* Golden bytes: the layout docs/PROTOCOL.md documents. */
static void test_golden_bytes(void)
{
    kvf_msg_t m;
    kvf_buf_t b;

    memset(&m, 0, sizeof(m));
    m.type = KVF_MSG_HEARTBEAT;
    m.u.heartbeat.seq = 0x0102030405060708ull;
    m.u.heartbeat.time_ns = 0x1112131415161718ull;
    kvf_buf_init(&b);
    CHECK_EQ_INT(kvf_wire_encode(&b, &m), KVF_OK);
    static const uint8_t hb[] = {
        16, 0, 0, 0, 8, 0, 0, 0,
        8, 7, 6, 5, 4, 3, 2, 1, 0x18, 0x17, 0x16, 0x15, 0x14, 0x13, 0x12, 0x11,
    };
    CHECK_EQ_INT(b.len, sizeof(hb));
    CHECK(b.len == sizeof(hb) && memcmp(b.data, hb, sizeof(hb)) == 0);

    /* encode appends: a DATA frame after the heartbeat */
    kvf_wire_seg_t s = { KVF_BUF_AUX, 0x21222324u, 0x3132333435363738ull, 0x41424344u,
                         1, 0, 0 };
    memset(&m, 0, sizeof(m));
    m.type = KVF_MSG_DATA;
    m.u.data.room = 0x99;
    m.u.data.instance = 0x5152535455565758ull;
    m.u.data.src_rank = 2;
    m.u.data.payload_len = 0x41424344u;
    m.u.data.nseg = 1;
    m.u.data.segs = &s;
    CHECK_EQ_INT(kvf_wire_encode(&b, &m), KVF_OK);
    static const uint8_t data[] = {
        49, 0, 0, 0, 3, 0, 0, 0,
        0x99, 0, 0, 0, 0, 0, 0, 0,   0x58, 0x57, 0x56, 0x55, 0x54, 0x53, 0x52, 0x51,
        2, 0, 0, 0,
        0x44, 0x43, 0x42, 0x41, 0, 0, 0, 0,   1, 0, 0, 0,
        1, 0x24, 0x23, 0x22, 0x21, 0x38, 0x37, 0x36, 0x35, 0x34, 0x33, 0x32,
        0x31, 0x44, 0x43, 0x42, 0x41,
    };
    CHECK_EQ_INT(b.len, sizeof(hb) + sizeof(data));
    CHECK(b.len == sizeof(hb) + sizeof(data) &&
          memcmp(b.data + sizeof(hb), data, sizeof(data)) == 0);
    kvf_buf_free(&b);

    /* AUTH: magic, version, role, flags, instance, pid, nonce (52 bytes) */
    m = sample_auth();
    kvf_buf_init(&b);
    CHECK_EQ_INT(kvf_wire_encode(&b, &m), KVF_OK);
    static const uint8_t auth_head[] = {
        52, 0, 0, 0, KVF_MSG_AUTH, 0, 0, 0,
        'K', 'V', 'F', 'Y', KVF_WIRE_VERSION, 0, 1, KVF_AUTH_F_TOKEN,
    };
    CHECK_EQ_INT(b.len, KVF_WIRE_HDR_LEN + KVF_WIRE_AUTH_LEN);
    CHECK(memcmp(b.data, auth_head, sizeof(auth_head)) == 0);
    CHECK(kvf_get_u64(b.data + 16) == BIG64);
    CHECK_EQ_INT(kvf_get_u32(b.data + 24), 0x01020304);
    CHECK_EQ_INT(b.data[28], 0xa0);
    CHECK_EQ_INT(b.data[28 + 31], 0xa0 + 31);
    kvf_buf_free(&b);
    /* AUTH_PROOF: the 32-byte MAC, nothing else */
    m = sample_proof();
    kvf_buf_init(&b);
    CHECK_EQ_INT(kvf_wire_encode(&b, &m), KVF_OK);
    CHECK_EQ_INT(b.len, KVF_WIRE_HDR_LEN + 32);
    CHECK_EQ_INT(kvf_get_u32(b.data), 32);
    CHECK_EQ_INT(b.data[4], KVF_MSG_AUTH_PROOF);
    CHECK_EQ_INT(b.data[8], 0x10);
    kvf_buf_free(&b);

    /* HELLO opens with magic "KVFY", then version, role, flags */
    m = sample_hello();
    kvf_buf_init(&b);
    CHECK_EQ_INT(kvf_wire_encode(&b, &m), KVF_OK);
    CHECK(memcmp(b.data + 8, "KVFY", 4) == 0);
    CHECK_EQ_INT(kvf_get_u16(b.data + 12), KVF_WIRE_VERSION);
    CHECK_EQ_INT(b.data[14], 1);
    CHECK_EQ_INT(b.data[15], KVF_HELLO_F_CHECKSUM);
    CHECK(kvf_get_u64(b.data + 16) == BIG64);
    CHECK_EQ_INT(kvf_get_u32(b.data + 48), strlen("10.0.0.17:51234"));
    kvf_buf_free(&b);
}

static void test_type_names(void)
{
    CHECK(strcmp(kvf_wire_type_name(KVF_MSG_HELLO), "HELLO") == 0);
    CHECK(strcmp(kvf_wire_type_name(KVF_MSG_ROOM_REQ), "ROOM_REQ") == 0);
    CHECK(strcmp(kvf_wire_type_name(KVF_MSG_DATA), "DATA") == 0);
    CHECK(strcmp(kvf_wire_type_name(KVF_MSG_DONE), "DONE") == 0);
    CHECK(strcmp(kvf_wire_type_name(KVF_MSG_DONE_ACK), "DONE_ACK") == 0);
    CHECK(strcmp(kvf_wire_type_name(KVF_MSG_FAIL), "FAIL") == 0);
    CHECK(strcmp(kvf_wire_type_name(KVF_MSG_ABORT), "ABORT") == 0);
    CHECK(strcmp(kvf_wire_type_name(KVF_MSG_HEARTBEAT), "HEARTBEAT") == 0);
    CHECK(strcmp(kvf_wire_type_name(0), "UNKNOWN") == 0);
    CHECK(strcmp(kvf_wire_type_name(KVF_MSG_XPORT), "XPORT") == 0);
    CHECK(strcmp(kvf_wire_type_name(KVF_MSG_DATA_REF), "DATA_REF") == 0);
    CHECK(strcmp(kvf_wire_type_name(KVF_MSG_AUTH), "AUTH") == 0);
    CHECK(strcmp(kvf_wire_type_name(KVF_MSG_AUTH_PROOF), "AUTH_PROOF") == 0);
    CHECK(strcmp(kvf_wire_type_name(KVF_MSG_JOIN), "JOIN") == 0);
    CHECK(strcmp(kvf_wire_type_name(14), "UNKNOWN") == 0);
    CHECK(strcmp(kvf_wire_type_name(255), "UNKNOWN") == 0);
}

/* A stream's end marker: DONE with the optional stream fields, and JOIN. */
static void test_streams(void)
{
    kvf_msg_t m = sample_done(), d;
    kvf_buf_t b;
    char err[256];

    /* Without the fields: the 37-byte body, decoded as streams 0. */
    CHECK_EQ_INT(encode_decode(&m, &b, &d, err, sizeof(err)), KVF_OK);
    CHECK_EQ_INT(b.len, KVF_WIRE_HDR_LEN + 37);
    CHECK_EQ_INT(d.u.done.streams, 0);
    kvf_buf_free(&b);
    /* With them: u32 stream, u32 streams after the checksum. */
    m.u.done.stream = 1;
    m.u.done.streams = 2;
    CHECK_EQ_INT(encode_decode(&m, &b, &d, err, sizeof(err)), KVF_OK);
    CHECK_EQ_INT(b.len, KVF_WIRE_HDR_LEN + 45);
    CHECK_EQ_INT(kvf_get_u32(b.data), 45);
    CHECK_EQ_INT(kvf_get_u32(b.data + KVF_WIRE_HDR_LEN + 37), 1);
    CHECK_EQ_INT(kvf_get_u32(b.data + KVF_WIRE_HDR_LEN + 41), 2);
    CHECK_EQ_INT(d.u.done.stream, 1);
    CHECK_EQ_INT(d.u.done.streams, 2);
    CHECK(d.u.done.checksum == 0xfedcba9876543210ull);
    /* Cut inside the fields: refused (trailing bytes), never half-read. */
    for (size_t cut = 38; cut < 45; cut++)
        CHECK_EQ_INT(decode_copy(KVF_MSG_DONE, b.data + KVF_WIRE_HDR_LEN, cut, &d, err,
                                 sizeof(err)), KVF_ERR_PROTOCOL);
    /* streams 0 with the fields present, a stream past the count, too many. */
    uint32_t bad[][2] = {{0, 0}, {2, 2}, {0, KVF_WIRE_MAX_STREAMS + 1}};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        kvf_put_u32(b.data + KVF_WIRE_HDR_LEN + 37, bad[i][0]);
        kvf_put_u32(b.data + KVF_WIRE_HDR_LEN + 41, bad[i][1]);
        CHECK_EQ_INT(decode_copy(KVF_MSG_DONE, b.data + KVF_WIRE_HDR_LEN, 45, &d, err,
                                 sizeof(err)), KVF_ERR_PROTOCOL);
        CHECK_STR_CONTAINS(err, "DONE: stream");
    }
    m.u.done.stream = 2;
    kvf_buf_free(&b);
    kvf_buf_init(&b);
    CHECK_EQ_INT(kvf_wire_encode(&b, &m), KVF_ERR_INVALID_PARAM);
    kvf_buf_free(&b);

    /* JOIN: the 32-byte cookie, then u32 stream (1..7). */
    kvf_msg_t j = {.type = KVF_MSG_JOIN};
    for (int i = 0; i < KVF_WIRE_COOKIE_LEN; i++)
        j.u.join.cookie[i] = (uint8_t)(0x40 + i);
    j.u.join.stream = 3;
    CHECK_EQ_INT(encode_decode(&j, &b, &d, err, sizeof(err)), KVF_OK);
    CHECK_EQ_INT(b.len, KVF_WIRE_HDR_LEN + 36);
    CHECK_EQ_INT(b.data[4], KVF_MSG_JOIN);
    CHECK_EQ_INT(b.data[KVF_WIRE_HDR_LEN], 0x40);
    CHECK_EQ_INT(kvf_get_u32(b.data + KVF_WIRE_HDR_LEN + 32), 3);
    CHECK(memcmp(d.u.join.cookie, j.u.join.cookie, KVF_WIRE_COOKIE_LEN) == 0);
    CHECK_EQ_INT(d.u.join.stream, 3);
    uint32_t bad_idx[] = {0, KVF_WIRE_MAX_STREAMS};
    for (size_t i = 0; i < 2; i++) {
        kvf_put_u32(b.data + KVF_WIRE_HDR_LEN + 32, bad_idx[i]);
        CHECK_EQ_INT(decode_copy(KVF_MSG_JOIN, b.data + KVF_WIRE_HDR_LEN, 36, &d, err,
                                 sizeof(err)), KVF_ERR_PROTOCOL);
        CHECK_STR_CONTAINS(err, "JOIN: stream");
    }
    CHECK_EQ_INT(decode_copy(KVF_MSG_JOIN, b.data + KVF_WIRE_HDR_LEN, 35, &d, err,
                             sizeof(err)), KVF_ERR_PROTOCOL);
    kvf_buf_free(&b);
}

static void test_header_errors(void)
{
    kvf_wire_hdr_t hdr = { 12345, 99, 0 };
    char err[256];
    uint8_t h[8];

    kvf_put_u32(h, 16); h[4] = KVF_MSG_HEARTBEAT; h[5] = 0; kvf_put_u16(h + 6, 0);
    CHECK_EQ_INT(kvf_wire_parse_header(h, &hdr, err, sizeof(err)), KVF_OK);
    CHECK_EQ_INT(hdr.length, 16);
    CHECK_EQ_INT(hdr.type, KVF_MSG_HEARTBEAT);

    kvf_put_u32(h, KVF_WIRE_MAX_BODY);
    CHECK_EQ_INT(kvf_wire_parse_header(h, &hdr, err, sizeof(err)), KVF_OK);

    hdr.length = 777;
    h[4] = 0;
    CHECK_EQ_INT(kvf_wire_parse_header(h, &hdr, err, sizeof(err)), KVF_ERR_PROTOCOL);
    CHECK_STR_CONTAINS(err, "unknown message type 0");
    CHECK_EQ_INT(hdr.length, 777);   /* untouched on error */
    h[4] = 14;
    CHECK_EQ_INT(kvf_wire_parse_header(h, &hdr, err, sizeof(err)), KVF_ERR_PROTOCOL);
    CHECK_STR_CONTAINS(err, "unknown message type 14");

    /* The strided flag, on DATA and DATA_REF only. */
    h[4] = KVF_MSG_DATA; h[5] = KVF_WIRE_F_STRIDED;
    CHECK_EQ_INT(kvf_wire_parse_header(h, &hdr, err, sizeof(err)), KVF_OK);
    CHECK_EQ_INT(hdr.flags, KVF_WIRE_F_STRIDED);
    h[4] = KVF_MSG_DATA_REF;
    CHECK_EQ_INT(kvf_wire_parse_header(h, &hdr, err, sizeof(err)), KVF_OK);
    h[4] = KVF_MSG_HEARTBEAT;
    CHECK_EQ_INT(kvf_wire_parse_header(h, &hdr, err, sizeof(err)), KVF_ERR_PROTOCOL);
    CHECK_STR_CONTAINS(err, "HEARTBEAT frame has non-zero reserved bits (flags 0x01");
    h[4] = KVF_MSG_DATA; h[5] = 2;
    CHECK_EQ_INT(kvf_wire_parse_header(h, &hdr, err, sizeof(err)), KVF_ERR_PROTOCOL);
    CHECK_STR_CONTAINS(err, "DATA frame has non-zero reserved bits (flags 0x02");
    h[5] = 0; kvf_put_u16(h + 6, 0x100);
    CHECK_EQ_INT(kvf_wire_parse_header(h, &hdr, err, sizeof(err)), KVF_ERR_PROTOCOL);
    CHECK_STR_CONTAINS(err, "reserved 0x0100");
    kvf_put_u16(h + 6, 0);

    kvf_put_u32(h, KVF_WIRE_MAX_BODY + 1);
    CHECK_EQ_INT(kvf_wire_parse_header(h, &hdr, err, sizeof(err)), KVF_ERR_PROTOCOL);
    CHECK_STR_CONTAINS(err, "DATA body length 16777217 exceeds limit 16777216");

    memcpy(h, "GET /route HTTP/1.1", 8);
    CHECK_EQ_INT(kvf_wire_parse_header(h, &hdr, err, sizeof(err)), KVF_ERR_PROTOCOL);
    CHECK_STR_CONTAINS(err, "received HTTP");

    /* a tiny or absent error buffer is fine */
    char tiny[4];
    CHECK_EQ_INT(kvf_wire_parse_header(h, &hdr, tiny, sizeof(tiny)), KVF_ERR_PROTOCOL);
    CHECK_EQ_INT(strlen(tiny), 3);
    CHECK_EQ_INT(kvf_wire_parse_header(h, &hdr, NULL, 0), KVF_ERR_PROTOCOL);
}

static void test_decode_rejects_bad_header_values(void)
{
    kvf_msg_t d;
    char err[256];
    uint8_t body[16] = { 0 };
    kvf_wire_hdr_t hdr = { 16, 0, 0 };
    CHECK_EQ_INT(kvf_wire_decode(&hdr, body, &d, err, sizeof(err)), KVF_ERR_PROTOCOL);
    CHECK_STR_CONTAINS(err, "unknown message type 0");
    hdr = (kvf_wire_hdr_t){ KVF_WIRE_MAX_BODY + 1, KVF_MSG_HEARTBEAT, 0 };
    CHECK_EQ_INT(kvf_wire_decode(&hdr, body, &d, err, sizeof(err)), KVF_ERR_PROTOCOL);
    CHECK_STR_CONTAINS(err, "exceeds limit");
    hdr = (kvf_wire_hdr_t){ 0, KVF_MSG_HEARTBEAT, 0 };
    CHECK_EQ_INT(kvf_wire_decode(&hdr, NULL, &d, err, sizeof(err)), KVF_ERR_PROTOCOL);
    CHECK_STR_CONTAINS(err, "HEARTBEAT: truncated at seq (needs 8 bytes, 0 left)");
    hdr = (kvf_wire_hdr_t){ 0, KVF_MSG_HELLO, 0 };
    CHECK_EQ_INT(kvf_wire_decode(&hdr, NULL, &d, err, sizeof(err)), KVF_ERR_PROTOCOL);
    CHECK_STR_CONTAINS(err, "HELLO: body of 0 bytes");
}

/* Every proper prefix of every message's body must fail cleanly. */
static void test_truncation_every_offset(void)
{
    for (int i = 0; i < NSAMPLES; i++) {
        kvf_msg_t m = sample(i), d;
        kvf_buf_t b;
        kvf_buf_init(&b);
        CHECK_EQ_INT(kvf_wire_encode(&b, &m), KVF_OK);
        const uint8_t *body = b.data + KVF_WIRE_HDR_LEN;
        size_t len = b.len - KVF_WIRE_HDR_LEN;
        for (size_t cut = 0; cut < len; cut++) {
            char err[256];
            kvf_status_t st = decode_copy((uint8_t)m.type, body, cut, &d, err,
                                          sizeof(err));
            CHECK_EQ_INT(st, KVF_ERR_PROTOCOL);
            CHECK(err[0] != '\0');
            CHECK_STR_CONTAINS(err, kvf_wire_type_name((uint8_t)m.type));
        }
        char err[256];
        CHECK_EQ_INT(decode_copy((uint8_t)m.type, body, len, &d, err,
                                 sizeof(err)), KVF_OK);
        kvf_buf_free(&b);
    }
}

static void test_trailing_bytes(void)
{
    for (int i = 0; i < NSAMPLES; i++) {
        kvf_msg_t m = sample(i), d;
        kvf_buf_t b;
        kvf_buf_init(&b);
        CHECK_EQ_INT(kvf_wire_encode(&b, &m), KVF_OK);
        uint8_t extra[3] = { 0, 0, 0 };
        CHECK_EQ_INT(kvf_buf_append(&b, extra, sizeof(extra)), KVF_OK);
        char err[256];
        CHECK_EQ_INT(decode_copy((uint8_t)m.type, b.data + KVF_WIRE_HDR_LEN,
                                 b.len - KVF_WIRE_HDR_LEN, &d, err, sizeof(err)),
                     KVF_ERR_PROTOCOL);
        CHECK_STR_CONTAINS(err, "3 trailing bytes after the message");
        kvf_buf_free(&b);
    }
}

/* Small byte builder for bodies the encoder refuses to produce. */
typedef struct { uint8_t b[1 << 16]; size_t n; } bld_t;
static void b8(bld_t *w, uint8_t v) { w->b[w->n++] = v; }
static void b16(bld_t *w, uint16_t v) { kvf_put_u16(w->b + w->n, v); w->n += 2; }
static void b32(bld_t *w, uint32_t v) { kvf_put_u32(w->b + w->n, v); w->n += 4; }
static void b64(bld_t *w, uint64_t v) { kvf_put_u64(w->b + w->n, v); w->n += 8; }
static void bfill(bld_t *w, size_t n) { memset(w->b + w->n, 'x', n); w->n += n; }

static kvf_status_t decode_bld(uint8_t type, const bld_t *w, char *err,
                               size_t errlen)
{
    kvf_msg_t d;
    return decode_copy(type, w->b, w->n, &d, err, errlen);
}

static void fail_body(bld_t *w, int32_t status, uint8_t side, uint32_t reason_len)
{
    w->n = 0;
    b64(w, 1); b64(w, 0x1d); b32(w, (uint32_t)status); b8(w, side); b32(w, 0);
    b32(w, 4); bfill(w, 4);
    b32(w, reason_len); bfill(w, reason_len);
    b64(w, 0);                                        /* sender_instance */
    b8(w, KVF_SIDE_BIT(side < 2 ? side : 0));         /* sides */
}

static void test_limits_rejected(void)
{
    static bld_t w;
    char err[256];

    fail_body(&w, KVF_ERR_TIMED_OUT, 0, KVF_WIRE_MAX_STR);
    CHECK_EQ_INT(decode_bld(KVF_MSG_FAIL, &w, err, sizeof(err)), KVF_OK);
    fail_body(&w, KVF_ERR_TIMED_OUT, 0, KVF_WIRE_MAX_STR + 1);
    CHECK_EQ_INT(decode_bld(KVF_MSG_FAIL, &w, err, sizeof(err)), KVF_ERR_PROTOCOL);
    CHECK_STR_CONTAINS(err, "FAIL: reason length 1025 exceeds limit 1024");

    /* string length beyond the body */
    fail_body(&w, KVF_ERR_TIMED_OUT, 0, 10);
    kvf_put_u32(w.b + w.n - 9 - 14, 20);      /* past the reason, sender_instance, sides */
    CHECK_EQ_INT(decode_bld(KVF_MSG_FAIL, &w, err, sizeof(err)), KVF_ERR_PROTOCOL);
    CHECK_STR_CONTAINS(err, "FAIL: reason length 20 exceeds body (19 bytes left)");

    /* ROOM_REQ: a page count the body cannot hold, and one that overflows */
    uint32_t counts[] = { 4000000, 0x40000001u, UINT32_MAX };
    for (int i = 0; i < 3; i++) {
        w.n = 0;
        b64(&w, 1); b64(&w, 0x1d); b32(&w, 0); b32(&w, 1); b32(&w, 0);
        b32(&w, counts[i]); b32(&w, 1); b32(&w, 2); b32(&w, 0);
        CHECK_EQ_INT(decode_bld(KVF_MSG_ROOM_REQ, &w, err, sizeof(err)), KVF_ERR_PROTOCOL);
        CHECK_STR_CONTAINS(err, "ROOM_REQ: page count");
        CHECK_STR_CONTAINS(err, "exceeds body (12 bytes left)");
    }

    /* ROOM_REQ: too many state groups */
    w.n = 0;
    b64(&w, 1); b64(&w, 0x1d); b32(&w, 0); b32(&w, 1); b32(&w, 0);
    b32(&w, 0); b32(&w, KVF_WIRE_MAX_BUFS + 1); bfill(&w, 4 * (KVF_WIRE_MAX_BUFS + 1));
    CHECK_EQ_INT(decode_bld(KVF_MSG_ROOM_REQ, &w, err, sizeof(err)), KVF_ERR_PROTOCOL);
    CHECK_STR_CONTAINS(err, "ROOM_REQ: state group count 4097 exceeds limit 4096");

    /* DATA: too many segments */
    w.n = 0;
    b64(&w, 1); b64(&w, 0x1d); b32(&w, 0); b64(&w, 0); b32(&w, KVF_WIRE_MAX_SEGS + 1);
    CHECK_EQ_INT(decode_bld(KVF_MSG_DATA, &w, err, sizeof(err)), KVF_ERR_PROTOCOL);
    CHECK_STR_CONTAINS(err, "DATA: segment count 8193 exceeds limit 8192");

    /* HELLO: a layout array over the limit */
    kvf_msg_t m = sample_hello();
    kvf_buf_t b;
    kvf_buf_init(&b);
    CHECK_EQ_INT(kvf_wire_encode(&b, &m), KVF_OK);
    /* kv_tags comes last but kv_order: 4 items (32 bytes) preceded by its count */
    size_t off = b.len - 1 - 32 - 4;
    kvf_put_u32(b.data + off, KVF_WIRE_MAX_BUFS + 1);
    CHECK_EQ_INT(decode_copy(KVF_MSG_HELLO, b.data + 8, b.len - 8, &m, err,
                             sizeof(err)), KVF_ERR_PROTOCOL);
    CHECK_STR_CONTAINS(err, "HELLO: kv_tags count 4097 exceeds limit 4096");
    kvf_put_u32(b.data + off, 5);
    CHECK_EQ_INT(decode_copy(KVF_MSG_HELLO, b.data + 8, b.len - 8, &m, err,
                             sizeof(err)), KVF_ERR_PROTOCOL);
    CHECK_STR_CONTAINS(err, "HELLO: kv_tags count 5 exceeds body (33 bytes left)");
    kvf_buf_free(&b);
}

static void data_body(bld_t *w, uint64_t payload, uint32_t nseg,
                      const kvf_wire_seg_t *s)
{
    w->n = 0;
    b64(w, 5); b64(w, 0x1d); b32(w, 1); b64(w, payload); b32(w, nseg);
    for (uint32_t i = 0; i < nseg; i++) {
        b8(w, s[i].kind); b32(w, s[i].buf); b64(w, s[i].offset); b32(w, s[i].len);
    }
}

static void test_data_rules(void)
{
    static bld_t w;
    char err[256];
    kvf_wire_seg_t s[4] = {
        { 0, 0, 0, 10, 1, 0, 0 }, { 1, 0, 0, 20, 1, 0, 0 },
        { 2, 0, 0, 30, 1, 0, 0 }, { 0, 1, 64, 40, 1, 0, 0 },
    };

    data_body(&w, 100, 4, s);
    CHECK_EQ_INT(decode_bld(KVF_MSG_DATA, &w, err, sizeof(err)), KVF_OK);

    data_body(&w, 101, 4, s);
    CHECK_EQ_INT(decode_bld(KVF_MSG_DATA, &w, err, sizeof(err)), KVF_ERR_PROTOCOL);
    CHECK_STR_CONTAINS(err, "DATA: segment lengths sum to 100 but payload_len is 101");

    s[3].len = 0;
    data_body(&w, 60, 4, s);
    CHECK_EQ_INT(decode_bld(KVF_MSG_DATA, &w, err, sizeof(err)), KVF_ERR_PROTOCOL);
    CHECK_STR_CONTAINS(err, "DATA segment 3: length 0");
    s[3].len = 40;

    s[2].kind = 3;
    data_body(&w, 100, 4, s);
    CHECK_EQ_INT(decode_bld(KVF_MSG_DATA, &w, err, sizeof(err)), KVF_ERR_PROTOCOL);
    CHECK_STR_CONTAINS(err, "DATA segment 2: unknown buffer kind 3");
    s[2].kind = 2;

    s[1].offset = UINT64_MAX - 19;
    data_body(&w, 100, 4, s);
    CHECK_EQ_INT(decode_bld(KVF_MSG_DATA, &w, err, sizeof(err)), KVF_ERR_PROTOCOL);
    CHECK_STR_CONTAINS(err, "DATA segment 1: offset 18446744073709551596 + length 20 overflows");
    s[1].offset = UINT64_MAX - 20;
    data_body(&w, 100, 4, s);
    CHECK_EQ_INT(decode_bld(KVF_MSG_DATA, &w, err, sizeof(err)), KVF_OK);

    data_body(&w, 0, 0, s);
    CHECK_EQ_INT(decode_bld(KVF_MSG_DATA, &w, err, sizeof(err)), KVF_ERR_PROTOCOL);
    CHECK_STR_CONTAINS(err, "DATA: segment count 0 outside 1..8192");

    /* count promising more segments than the body holds */
    data_body(&w, 100, 4, s);
    kvf_put_u32(w.b + 28, 5);
    CHECK_EQ_INT(decode_bld(KVF_MSG_DATA, &w, err, sizeof(err)), KVF_ERR_PROTOCOL);
    CHECK_STR_CONTAINS(err, "DATA: segment count 5 exceeds body (68 bytes left)");

    /* the largest sum: MAX_SEGS segments of 2^32-1 bytes */
    static kvf_wire_seg_t many[KVF_WIRE_MAX_SEGS];
    for (int i = 0; i < KVF_WIRE_MAX_SEGS; i++)
        many[i] = (kvf_wire_seg_t){ 0, 0, (uint64_t)i << 32, UINT32_MAX, 1, 0, 0 };
    kvf_msg_t m;
    memset(&m, 0, sizeof(m));
    m.type = KVF_MSG_DATA;
    m.u.data.nseg = KVF_WIRE_MAX_SEGS;
    m.u.data.segs = many;
    m.u.data.payload_len = (uint64_t)KVF_WIRE_MAX_SEGS * UINT32_MAX;
    kvf_buf_t b;
    kvf_msg_t d;
    CHECK_EQ_INT(encode_decode(&m, &b, &d, err, sizeof(err)), KVF_OK);
    CHECK_EQ_INT(d.u.data.nseg, KVF_WIRE_MAX_SEGS);
    kvf_buf_free(&b);
}

/* A strided frame's body: 37-byte segments. */
static void sdata_body(bld_t *w, uint64_t payload, uint32_t nseg,
                       const kvf_wire_seg_t *s)
{
    w->n = 0;
    b64(w, 5); b64(w, 0x1d); b32(w, 1); b64(w, payload); b32(w, nseg);
    for (uint32_t i = 0; i < nseg; i++) {
        b8(w, s[i].kind); b32(w, s[i].buf); b64(w, s[i].offset); b32(w, s[i].len);
        b32(w, s[i].count); b64(w, s[i].dst_stride); b64(w, s[i].src_stride);
    }
}

static kvf_status_t decode_strided(uint8_t type, const bld_t *w, kvf_msg_t *m,
                                   char *err, size_t errlen)
{
    uint8_t *copy = malloc(w->n ? w->n : 1);
    memcpy(copy, w->b, w->n);
    kvf_wire_hdr_t hdr = { (uint32_t)w->n, type, KVF_WIRE_F_STRIDED };
    err[0] = '\0';
    kvf_status_t st = kvf_wire_decode(&hdr, copy, m, err, errlen);
    free(copy);
    return st;
}

/* A TP slice: 64 tokens of 512 bytes, 1024 apart on prefill, 512 on decode. */
static void test_strided_roundtrip(void)
{
    kvf_wire_seg_t segs2[3] = {
        { KVF_BUF_KV, 3, 65536, 512, 64, 512, 1024 },
        { KVF_BUF_KV, 4, 1ull << 40, 0x10203, 2, 0x1020304050ull, 0x60708090a0ull },
        { KVF_BUF_AUX, 0, 64, 16, 0, 0, 0 },          /* plain: count 0 = 1 */
    };
    uint64_t addrs[3] = { 0x7f0000001000ull, 0x7f0000100000ull, 0x7f0000200000ull };
    kvf_msg_t m, d;
    kvf_buf_t b;
    char err[256];

    memset(&m, 0, sizeof(m));
    m.type = KVF_MSG_DATA;
    m.u.data.room = BIG64;
    m.u.data.src_rank = 3;
    m.u.data.payload_len = 64 * 512 + 2 * 0x10203 + 16;
    m.u.data.nseg = 3;
    m.u.data.segs = segs2;
    m.u.data.strided = 1;
    /* count 0 is a plain segment's only outside a strided frame */
    CHECK_EQ_INT(encode_decode(&m, &b, &d, err, sizeof(err)), KVF_ERR_INVALID_PARAM);
    kvf_buf_free(&b);
    segs2[2].count = 1;
    CHECK_EQ_INT(encode_decode(&m, &b, &d, err, sizeof(err)), KVF_OK);
    CHECK_EQ_INT(b.data[5], KVF_WIRE_F_STRIDED);
    CHECK_EQ_INT(b.len, KVF_WIRE_HDR_LEN + 32 + 3 * KVF_WIRE_SSEG_LEN);
    /* segment 0's tail: count, dst_stride, src_stride */
    const uint8_t *p = b.data + KVF_WIRE_HDR_LEN + 32;
    CHECK_EQ_INT(kvf_get_u32(p + 17), 64);
    CHECK(kvf_get_u64(p + 21) == 512 && kvf_get_u64(p + 29) == 1024);
    CHECK(d.u.data.strided == 1 && d.u.data.nseg == 3);
    CHECK_EQ_INT(d.u.data.npieces, 64 + 2 + 1);
    for (uint32_t i = 0; i < 3; i++) {
        kvf_wire_seg_t t;
        kvf_wire_seg_at(&d.u.data, i, &t);
        CHECK(t.kind == segs2[i].kind && t.buf == segs2[i].buf &&
              t.offset == segs2[i].offset && t.len == segs2[i].len &&
              t.count == segs2[i].count && t.dst_stride == segs2[i].dst_stride &&
              t.src_stride == segs2[i].src_stride);
    }
    kvf_buf_free(&b);

    /* the same as DATA_REF, with the sources */
    m.type = KVF_MSG_DATA_REF;
    m.u.data.src_addrs = (kvf_wire_arr64_t){ 3, addrs, NULL };
    CHECK_EQ_INT(encode_decode(&m, &b, &d, err, sizeof(err)), KVF_OK);
    CHECK_EQ_INT(b.data[5], KVF_WIRE_F_STRIDED);
    CHECK_EQ_INT(d.u.data.npieces, 67);
    CHECK(kvf_wire_arr64_at(&d.u.data.src_addrs, 1) == addrs[1]);
    kvf_buf_free(&b);

    /* a plain frame is as before: no flag, 17-byte segments, count 1 out */
    m = sample_data();
    CHECK_EQ_INT(encode_decode(&m, &b, &d, err, sizeof(err)), KVF_OK);
    CHECK_EQ_INT(b.data[5], 0);
    CHECK_EQ_INT(b.len, KVF_WIRE_HDR_LEN + 32 + 4 * KVF_WIRE_SEG_LEN);
    CHECK(d.u.data.strided == 0 && d.u.data.npieces == 4);
    kvf_wire_seg_t t;
    kvf_wire_seg_at(&d.u.data, 0, &t);
    CHECK(t.count == 1 && t.dst_stride == 0 && t.src_stride == 0);
    kvf_buf_free(&b);

    /* a plain frame cannot carry pieces */
    m = sample_data();
    kvf_wire_seg_t one = { KVF_BUF_KV, 0, 0, 8, 2, 8, 8 };
    m.u.data.nseg = 1;
    m.u.data.segs = &one;
    m.u.data.payload_len = 16;
    CHECK_EQ_INT(encode_decode(&m, &b, &d, err, sizeof(err)), KVF_ERR_INVALID_PARAM);
    kvf_buf_free(&b);
    m.u.data.strided = 1;
    CHECK_EQ_INT(encode_decode(&m, &b, &d, err, sizeof(err)), KVF_OK);
    kvf_buf_free(&b);
}

/* Every hostile strided form is refused, with the field named. */
static void test_strided_rules(void)
{
    static bld_t w;
    char err[256];
    kvf_msg_t d;
    kvf_wire_seg_t s[2] = {
        { KVF_BUF_KV, 0, 4096, 512, 8, 512, 1024 },
        { KVF_BUF_STATE, 0, 0, 30, 1, 0, 0 },
    };

    sdata_body(&w, 8 * 512 + 30, 2, s);
    CHECK_EQ_INT(decode_strided(KVF_MSG_DATA, &w, &d, err, sizeof(err)), KVF_OK);
    CHECK_EQ_INT(d.u.data.npieces, 9);
    /* the same bytes without the flag are not a plain frame */
    CHECK_EQ_INT(decode_bld(KVF_MSG_DATA, &w, err, sizeof(err)), KVF_ERR_PROTOCOL);

    /* payload_len is the sum of the pieces */
    sdata_body(&w, 512 + 30, 2, s);
    CHECK_EQ_INT(decode_strided(KVF_MSG_DATA, &w, &d, err, sizeof(err)), KVF_ERR_PROTOCOL);
    CHECK_STR_CONTAINS(err, "DATA: segment lengths sum to 4126 but payload_len is 542");

    s[0].count = 0;
    sdata_body(&w, 30, 2, s);
    CHECK_EQ_INT(decode_strided(KVF_MSG_DATA, &w, &d, err, sizeof(err)), KVF_ERR_PROTOCOL);
    CHECK_STR_CONTAINS(err, "DATA segment 0: piece count 0");
    s[0].count = 8;

    s[0].len = 0;
    sdata_body(&w, 30, 2, s);
    CHECK_EQ_INT(decode_strided(KVF_MSG_DATA, &w, &d, err, sizeof(err)), KVF_ERR_PROTOCOL);
    CHECK_STR_CONTAINS(err, "DATA segment 0: length 0");
    s[0].len = 512;

    /* overlapping pieces, either side */
    s[0].dst_stride = 511;
    sdata_body(&w, 8 * 512 + 30, 2, s);
    CHECK_EQ_INT(decode_strided(KVF_MSG_DATA, &w, &d, err, sizeof(err)), KVF_ERR_PROTOCOL);
    CHECK_STR_CONTAINS(err, "DATA segment 0: strides 511 (destination) and 1024 (source) "
                       "are shorter than its 512-byte pieces");
    s[0].dst_stride = 512;
    s[0].src_stride = 0;
    sdata_body(&w, 8 * 512 + 30, 2, s);
    CHECK_EQ_INT(decode_strided(KVF_MSG_DATA, &w, &d, err, sizeof(err)), KVF_ERR_PROTOCOL);
    CHECK_STR_CONTAINS(err, "are shorter than its 512-byte pieces");
    s[0].src_stride = 1024;

    /* wrap-around: the stride product, then the sum with the offset */
    s[0].dst_stride = UINT64_MAX / 4;
    sdata_body(&w, 8 * 512 + 30, 2, s);
    CHECK_EQ_INT(decode_strided(KVF_MSG_DATA, &w, &d, err, sizeof(err)), KVF_ERR_PROTOCOL);
    CHECK_STR_CONTAINS(err, "DATA segment 0: offset 4096 + 8 pieces of 512 bytes "
                       "4611686018427387903 apart overflows");
    s[0].dst_stride = 1ull << 60;        /* 7 x 2^60 + 512 fits; + offset does not */
    s[0].offset = UINT64_MAX - 7 * (1ull << 60) - 511;
    sdata_body(&w, 8 * 512 + 30, 2, s);
    CHECK_EQ_INT(decode_strided(KVF_MSG_DATA, &w, &d, err, sizeof(err)), KVF_ERR_PROTOCOL);
    CHECK_STR_CONTAINS(err, "apart overflows");
    s[0].offset--;                       /* the last byte is UINT64_MAX - 1: fine */
    sdata_body(&w, 8 * 512 + 30, 2, s);
    CHECK_EQ_INT(decode_strided(KVF_MSG_DATA, &w, &d, err, sizeof(err)), KVF_OK);
    s[0].offset = 4096;
    s[0].dst_stride = 512;
    s[0].src_stride = UINT64_MAX / 7;
    sdata_body(&w, 8 * 512 + 30, 2, s);
    CHECK_EQ_INT(decode_strided(KVF_MSG_DATA, &w, &d, err, sizeof(err)), KVF_ERR_PROTOCOL);
    CHECK_STR_CONTAINS(err, "DATA segment 0: source + 8 pieces of 512 bytes "
                       "2635249153387078802 apart overflows");
    s[0].src_stride = 1024;

    /* DATA_REF: the source address + the source span */
    sdata_body(&w, 8 * 512 + 30, 2, s);
    b32(&w, 2); b64(&w, UINT64_MAX - 7 * 1024 - 512); b64(&w, 0x1000);
    CHECK_EQ_INT(decode_strided(KVF_MSG_DATA_REF, &w, &d, err, sizeof(err)), KVF_OK);
    kvf_put_u64(w.b + w.n - 16, UINT64_MAX - 7 * 1024 - 511);
    CHECK_EQ_INT(decode_strided(KVF_MSG_DATA_REF, &w, &d, err, sizeof(err)),
                 KVF_ERR_PROTOCOL);
    CHECK_STR_CONTAINS(err, "DATA segment 0: source + 8 pieces of 512 bytes 1024 apart "
                       "overflows");

    /* the pieces of a frame: at most KVF_WIRE_MAX_PIECES, one segment or several */
    s[0].count = KVF_WIRE_MAX_PIECES;
    sdata_body(&w, (uint64_t)KVF_WIRE_MAX_PIECES * 512 + 30, 2, s);
    CHECK_EQ_INT(decode_strided(KVF_MSG_DATA, &w, &d, err, sizeof(err)), KVF_ERR_PROTOCOL);
    CHECK_STR_CONTAINS(err, "DATA: more than 8192 pieces (segment 1)");
    sdata_body(&w, (uint64_t)KVF_WIRE_MAX_PIECES * 512, 1, s);
    CHECK_EQ_INT(decode_strided(KVF_MSG_DATA, &w, &d, err, sizeof(err)), KVF_OK);
    CHECK_EQ_INT(d.u.data.npieces, KVF_WIRE_MAX_PIECES);
    s[0].count = UINT32_MAX;
    sdata_body(&w, (uint64_t)UINT32_MAX * 512, 1, s);
    CHECK_EQ_INT(decode_strided(KVF_MSG_DATA, &w, &d, err, sizeof(err)), KVF_ERR_PROTOCOL);
    CHECK_STR_CONTAINS(err, "DATA: more than 8192 pieces (segment 0)");
    s[0].count = 8;

    /* truncated: a strided segment is 37 bytes */
    sdata_body(&w, 8 * 512 + 30, 2, s);
    w.n -= 1;
    CHECK_EQ_INT(decode_strided(KVF_MSG_DATA, &w, &d, err, sizeof(err)), KVF_ERR_PROTOCOL);
    CHECK_STR_CONTAINS(err, "DATA: segment count 2 exceeds body (73 bytes left)");

    /* the flag means nothing on other messages */
    w.n = 0;
    b64(&w, 1); b64(&w, 2);
    CHECK_EQ_INT(decode_strided(KVF_MSG_HEARTBEAT, &w, &d, err, sizeof(err)),
                 KVF_ERR_PROTOCOL);
    CHECK_STR_CONTAINS(err, "HEARTBEAT: unknown frame flags 0x01");
}

static void test_value_rules(void)
{
    static bld_t w;
    char err[256];

    fail_body(&w, 0, 0, 3);
    CHECK_EQ_INT(decode_bld(KVF_MSG_FAIL, &w, err, sizeof(err)), KVF_ERR_PROTOCOL);
    CHECK_STR_CONTAINS(err, "FAIL: status 0 is not an error");
    fail_body(&w, KVF_ERR_ABORTED, 0, 3);
    w.b[w.n - 1] = 0x4;                               /* a side no build knows */
    CHECK_EQ_INT(decode_bld(KVF_MSG_FAIL, &w, err, sizeof(err)), KVF_ERR_PROTOCOL);
    CHECK_STR_CONTAINS(err, "FAIL: sides 0x04 name neither prefill nor decode");
    fail_body(&w, 5, 0, 3);
    CHECK_EQ_INT(decode_bld(KVF_MSG_ABORT, &w, err, sizeof(err)), KVF_ERR_PROTOCOL);
    CHECK_STR_CONTAINS(err, "ABORT: status 5 is not an error");
    fail_body(&w, KVF_ERR_ABORTED, 2, 3);
    CHECK_EQ_INT(decode_bld(KVF_MSG_ABORT, &w, err, sizeof(err)), KVF_ERR_PROTOCOL);
    CHECK_STR_CONTAINS(err, "ABORT: origin side 2");

    w.n = 0;
    b64(&w, 1); b64(&w, 0x1d); b32(&w, 1); b64(&w, 1); b8(&w, 2); b64(&w, 0);
    CHECK_EQ_INT(decode_bld(KVF_MSG_DONE, &w, err, sizeof(err)), KVF_ERR_PROTOCOL);
    CHECK_STR_CONTAINS(err, "DONE: has_checksum is 2");

    w.n = 0;
    b64(&w, 1); b64(&w, 0x1d); b32(&w, 1); b64(&w, 1);
    CHECK_EQ_INT(decode_bld(KVF_MSG_DONE_ACK, &w, err, sizeof(err)), KVF_ERR_PROTOCOL);
    CHECK_STR_CONTAINS(err, "DONE_ACK: status 1 is positive");

    /* HELLO value rules, by patching a valid encoding */
    kvf_msg_t m = sample_hello(), d;
    kvf_buf_t b;
    kvf_buf_init(&b);
    CHECK_EQ_INT(kvf_wire_encode(&b, &m), KVF_OK);
    uint8_t *body = b.data + KVF_WIRE_HDR_LEN;
    size_t len = b.len - KVF_WIRE_HDR_LEN;

    body[6] = 2;
    CHECK_EQ_INT(decode_copy(KVF_MSG_HELLO, body, len, &d, err, sizeof(err)), KVF_ERR_PROTOCOL);
    CHECK_STR_CONTAINS(err, "HELLO: role 2 is neither prefill (0) nor decode (1)");
    body[6] = 0;
    body[7] = 0x80;
    CHECK_EQ_INT(decode_copy(KVF_MSG_HELLO, body, len, &d, err, sizeof(err)), KVF_ERR_PROTOCOL);
    CHECK_STR_CONTAINS(err, "HELLO: unknown flags 0x80");
    body[7] = 0;
    CHECK_EQ_INT(decode_copy(KVF_MSG_HELLO, body, len, &d, err, sizeof(err)), KVF_OK);
    CHECK_EQ_INT(d.u.hello.role, 0);
    kvf_buf_free(&b);

    m.u.hello.layout.aux_items.count = 0;
    CHECK_EQ_INT(kvf_wire_encode(&b, &m), KVF_ERR_INVALID_PARAM);
    /* same message encoded by hand: decoder refuses the unpaired arrays */
    m.u.hello.layout.aux_items.count = 1;
    kvf_buf_init(&b);
    CHECK_EQ_INT(kvf_wire_encode(&b, &m), KVF_OK);
    /* aux_items (1 item) sits before state_item_bytes (2) and state_items (2) */
    size_t aux_off = b.len - HELLO_TAIL - (4 + 16) * 2 - (4 + 8);
    CHECK_EQ_INT(kvf_get_u32(b.data + aux_off), 1);
    static uint8_t patched[4096];
    memcpy(patched, b.data, aux_off);
    kvf_put_u32(patched + aux_off, 0);
    memcpy(patched + aux_off + 4, b.data + aux_off + 12, b.len - aux_off - 12);
    CHECK_EQ_INT(decode_copy(KVF_MSG_HELLO, patched + 8, b.len - 8 - 8, &d, err,
                             sizeof(err)), KVF_ERR_PROTOCOL);
    CHECK_STR_CONTAINS(err, "HELLO: layout lists 1 aux item sizes but 0 aux item counts");
    kvf_buf_free(&b);
}

static void test_version_mismatch(void)
{
    static bld_t w;
    char err[256];
    kvf_msg_t m = sample_hello(), d;
    kvf_buf_t b;
    kvf_buf_init(&b);
    CHECK_EQ_INT(kvf_wire_encode(&b, &m), KVF_OK);
    uint8_t *body = b.data + KVF_WIRE_HDR_LEN;
    size_t len = b.len - KVF_WIRE_HDR_LEN;

    /* A version-1 peer leads with HELLO: named as such. */
    kvf_put_u16(body + 4, 1);
    CHECK_EQ_INT(decode_copy(KVF_MSG_HELLO, body, len, &d, err, sizeof(err)), KVF_ERR_VERSION);
    CHECK_STR_CONTAINS(err, "HELLO: peer speaks kvferry wire protocol version 1, this "
                            "build speaks version 5");
    kvf_put_u16(body + 4, 0);
    CHECK_EQ_INT(decode_copy(KVF_MSG_HELLO, body, len, &d, err, sizeof(err)), KVF_ERR_VERSION);
    CHECK_STR_CONTAINS(err, "version 0, this build speaks version 5");
    kvf_put_u16(body + 4, KVF_WIRE_VERSION);

    /* A future version with a different body is still a version mismatch. */
    w.n = 0;
    b32(&w, KVF_WIRE_MAGIC); b16(&w, 7); bfill(&w, 3);
    CHECK_EQ_INT(decode_bld(KVF_MSG_HELLO, &w, err, sizeof(err)), KVF_ERR_VERSION);
    CHECK_STR_CONTAINS(err, "version 7, this build speaks version 5");
    w.n = 6;
    CHECK_EQ_INT(decode_bld(KVF_MSG_HELLO, &w, err, sizeof(err)), KVF_ERR_VERSION);
    w.n = 5;
    CHECK_EQ_INT(decode_bld(KVF_MSG_HELLO, &w, err, sizeof(err)), KVF_ERR_PROTOCOL);
    CHECK_STR_CONTAINS(err, "too short for the protocol version");

    /* wrong magic */
    body[0] ^= 0xff;
    CHECK_EQ_INT(decode_copy(KVF_MSG_HELLO, body, len, &d, err, sizeof(err)), KVF_ERR_VERSION);
    CHECK_STR_CONTAINS(err, "magic 0x594656b4 is not kvferry's 0x5946564b");
    CHECK_STR_CONTAINS(err, "not a kvferry engine");
    w.n = 4;
    kvf_put_u32(w.b, 0xdeadbeef);
    CHECK_EQ_INT(decode_bld(KVF_MSG_HELLO, &w, err, sizeof(err)), KVF_ERR_VERSION);
    CHECK_STR_CONTAINS(err, "magic 0xdeadbeef");
    kvf_buf_free(&b);

    /* AUTH, the first frame since version 2, has the same frozen prefix. */
    m = sample_auth();
    kvf_buf_init(&b);
    CHECK_EQ_INT(kvf_wire_encode(&b, &m), KVF_OK);
    body = b.data + KVF_WIRE_HDR_LEN;
    len = b.len - KVF_WIRE_HDR_LEN;
    kvf_put_u16(body + 4, 4);
    CHECK_EQ_INT(decode_copy(KVF_MSG_AUTH, body, len, &d, err, sizeof(err)), KVF_ERR_VERSION);
    CHECK_STR_CONTAINS(err, "AUTH: peer speaks kvferry wire protocol version 4, this "
                            "build speaks version 5");
    w.n = 0;
    b32(&w, KVF_WIRE_MAGIC); b16(&w, 9);
    CHECK_EQ_INT(decode_bld(KVF_MSG_AUTH, &w, err, sizeof(err)), KVF_ERR_VERSION);
    CHECK_STR_CONTAINS(err, "version 9, this build speaks version 5");
    kvf_buf_free(&b);
}

static void test_encode_refuses(void)
{
    kvf_msg_t m;
    kvf_buf_t b;
    kvf_buf_init(&b);
    static char longstr[KVF_WIRE_MAX_STR + 1];
    memset(longstr, 'r', sizeof(longstr));

#define REFUSE(msg)                                                            \
    do {                                                                       \
        size_t len_ = b.len;                                                   \
        CHECK_EQ_INT(kvf_wire_encode(&b, &(msg)), KVF_ERR_INVALID_PARAM);      \
        CHECK_EQ_INT(b.len, len_);                                             \
    } while (0)

    CHECK_EQ_INT(kvf_wire_encode(&b, NULL), KVF_ERR_INVALID_PARAM);
    m = sample_heartbeat(); m.type = (kvf_msg_type_t)14; REFUSE(m);
    m = sample_auth(); m.u.auth.version = 1; REFUSE(m);
    m = sample_auth(); m.u.auth.role = 2; REFUSE(m);
    m = sample_auth(); m.u.auth.flags = 4; REFUSE(m);
    m = sample_heartbeat(); m.type = (kvf_msg_type_t)0; REFUSE(m);

    m = sample_fail(KVF_MSG_FAIL);
    m.u.fail.reason = (kvf_wire_str_t){ longstr, KVF_WIRE_MAX_STR + 1 }; REFUSE(m);
    m.u.fail.reason.len = KVF_WIRE_MAX_STR;
    CHECK_EQ_INT(kvf_wire_encode(&b, &m), KVF_OK);
    m = sample_fail(KVF_MSG_ABORT); m.u.fail.status = 0; REFUSE(m);
    m = sample_fail(KVF_MSG_FAIL); m.u.fail.origin_side = 2; REFUSE(m);
    m = sample_fail(KVF_MSG_FAIL); m.u.fail.origin_addr.ptr = NULL; REFUSE(m);

    m = sample_hello(); m.u.hello.version = 1; REFUSE(m);
    m = sample_hello(); m.u.hello.magic = 0; REFUSE(m);
    m = sample_hello(); m.u.hello.role = 2; REFUSE(m);
    m = sample_hello(); m.u.hello.flags = 0x40; REFUSE(m);
    m = sample_hello(); m.u.hello.layout.attn = 2; REFUSE(m);
    m = sample_hello(); m.u.hello.layout.mem_kind = 9; REFUSE(m);
    m = sample_hello();
    m.u.hello.addr = (kvf_wire_str_t){ longstr, KVF_WIRE_MAX_STR + 1 }; REFUSE(m);
    static uint64_t many64[KVF_WIRE_MAX_BUFS + 1];
    m = sample_hello();
    m.u.hello.layout.kv_items = (kvf_wire_arr64_t){ KVF_WIRE_MAX_BUFS + 1, many64, NULL };
    m.u.hello.layout.kv_item_bytes = m.u.hello.layout.kv_items;
    REFUSE(m);
    m.u.hello.layout.kv_items.count = m.u.hello.layout.kv_item_bytes.count = KVF_WIRE_MAX_BUFS;
    m.u.hello.layout.kv_tags = (kvf_wire_arr64_t){ KVF_WIRE_MAX_BUFS, many64, NULL };
    CHECK_EQ_INT(kvf_wire_encode(&b, &m), KVF_OK);
    m = sample_hello(); m.u.hello.layout.kv_tags.count = 3; REFUSE(m);
    m = sample_hello(); m.u.hello.layout.state_groups.count = 0; REFUSE(m);
    m = sample_hello(); m.u.hello.layout.kv_items.count = 3; REFUSE(m);
    m = sample_hello(); m.u.hello.layout.aux_items.native = NULL; REFUSE(m);

    m = sample_data(); m.u.data.nseg = 0; REFUSE(m);
    m = sample_data(); m.u.data.payload_len++; REFUSE(m);
    m = sample_data(); m.u.data.segs = NULL; REFUSE(m);
    kvf_wire_seg_t bad[2] = { { 0, 0, 0, 8, 1, 0, 0 }, { 0, 0, 8, 0, 1, 0, 0 } };
    m = sample_data(); m.u.data.nseg = 2; m.u.data.segs = bad;
    m.u.data.payload_len = 8; REFUSE(m);
    bad[1] = (kvf_wire_seg_t){ 3, 0, 8, 8, 1, 0, 0 }; m.u.data.payload_len = 16; REFUSE(m);
    static kvf_wire_seg_t manysegs[KVF_WIRE_MAX_SEGS + 1];
    for (int i = 0; i <= KVF_WIRE_MAX_SEGS; i++)
        manysegs[i] = (kvf_wire_seg_t){ 0, 0, 0, 1, 1, 0, 0 };
    m = sample_data(); m.u.data.segs = manysegs;
    m.u.data.nseg = KVF_WIRE_MAX_SEGS + 1; m.u.data.payload_len = KVF_WIRE_MAX_SEGS + 1;
    REFUSE(m);

    m = sample_done(); m.u.done.has_checksum = 2; REFUSE(m);
    m = sample_done_ack(); m.u.done_ack.status = 1; REFUSE(m);

    static uint32_t many32[KVF_WIRE_MAX_BUFS + 1];
    m = sample_room_req();
    m.u.room_req.state_counts = (kvf_wire_arr32_t){ KVF_WIRE_MAX_BUFS + 1, many32, NULL };
    m.u.room_req.state_idx.count = 0;
    REFUSE(m);

    /* a page list that would make the body exceed KVF_WIRE_MAX_BODY */
    uint32_t fit = (KVF_WIRE_MAX_BODY - 60) / 4;   /* 60: ROOM_REQ's fixed fields */
    uint32_t *big = calloc((size_t)fit + 1, sizeof(uint32_t));
    m = sample_room_req();
    m.u.room_req.state_counts.count = 0;
    m.u.room_req.state_idx.count = 0;
    m.u.room_req.pages = (kvf_wire_arr32_t){ fit + 1, big, NULL };
    REFUSE(m);
    m.u.room_req.pages.count = UINT32_MAX;   /* never read: size refused first */
    REFUSE(m);
    m.u.room_req.pages.count = fit;
    kvf_buf_free(&b);
    kvf_buf_init(&b);
    CHECK_EQ_INT(kvf_wire_encode(&b, &m), KVF_OK);
    CHECK_EQ_INT(b.len, KVF_WIRE_HDR_LEN + KVF_WIRE_MAX_BODY);
    kvf_wire_hdr_t hdr;
    kvf_msg_t d;
    char err[256];
    CHECK_EQ_INT(kvf_wire_parse_header(b.data, &hdr, err, sizeof(err)), KVF_OK);
    CHECK_EQ_INT(kvf_wire_decode(&hdr, b.data + 8, &d, err, sizeof(err)), KVF_OK);
    CHECK_EQ_INT(d.u.room_req.pages.count, fit);
    free(big);
    kvf_buf_free(&b);
#undef REFUSE
}

/* Re-encoding a decoded message (raw arrays and segments) is byte-exact. */
static void test_reencode_decoded(void)
{
    for (int i = 0; i < NSAMPLES; i++) {
        kvf_msg_t m = sample(i), d;
        kvf_buf_t b, b2;
        char err[256];
        CHECK_EQ_INT(encode_decode(&m, &b, &d, err, sizeof(err)), KVF_OK);
        kvf_buf_init(&b2);
        CHECK_EQ_INT(kvf_wire_encode(&b2, &d), KVF_OK);
        CHECK(b.len == b2.len && memcmp(b.data, b2.data, b.len) == 0);
        kvf_buf_free(&b);
        kvf_buf_free(&b2);
    }
}

/* The decoder writes its output only on success. */
static void test_output_untouched_on_error(void)
{
    kvf_msg_t m = sample_done(), d;
    kvf_buf_t b;
    kvf_buf_init(&b);
    CHECK_EQ_INT(kvf_wire_encode(&b, &m), KVF_OK);
    memset(&d, 0xa5, sizeof(d));
    kvf_msg_t before;
    memcpy(&before, &d, sizeof(d));
    char err[256];
    b.data[8 + 28] = 7;   /* has_checksum */
    CHECK_EQ_INT(decode_copy(KVF_MSG_DONE, b.data + 8, b.len - 8, &d, err,
                             sizeof(err)), KVF_ERR_PROTOCOL);
    CHECK(memcmp(&d, &before, sizeof(d)) == 0);
    kvf_buf_free(&b);
}

/* XPORT and DATA_REF: the transport offer and a pull-mode DATA frame. */
static void test_roundtrip_xport_data_ref(void)
{
    kvf_buf_t b;
    kvf_buf_init(&b);
    kvf_msg_t m, d;
    kvf_wire_hdr_t hdr;
    char err[256];
    static const uint8_t blob[] = {1, 2, 3, 4, 5};

    memset(&m, 0, sizeof(m));
    m.type = KVF_MSG_XPORT;
    m.u.xport.count = 2;
    m.u.xport.x[0] = (kvf_wire_xport_t){{"shm", 3}, blob, sizeof(blob)};
    m.u.xport.x[1] = (kvf_wire_xport_t){{"ucx", 3}, NULL, 0};
    CHECK_EQ_INT(kvf_wire_encode(&b, &m), KVF_OK);
    CHECK_EQ_INT(kvf_wire_parse_header(b.data, &hdr, err, sizeof(err)), KVF_OK);
    CHECK_EQ_INT(kvf_wire_decode(&hdr, b.data + KVF_WIRE_HDR_LEN, &d, err, sizeof(err)),
                 KVF_OK);
    CHECK_EQ_INT(d.u.xport.count, 2);
    CHECK(d.u.xport.x[0].name.len == 3 && memcmp(d.u.xport.x[0].name.ptr, "shm", 3) == 0);
    CHECK(d.u.xport.x[0].blob_len == 5 && memcmp(d.u.xport.x[0].blob, blob, 5) == 0);
    CHECK_EQ_INT(d.u.xport.x[1].blob_len, 0);
    m.u.xport.count = KVF_WIRE_MAX_XPORTS + 1;
    b.len = 0;
    CHECK_EQ_INT(kvf_wire_encode(&b, &m), KVF_ERR_INVALID_PARAM);

    kvf_wire_seg_t rsegs[2] = {{ KVF_BUF_KV, 3, 4096, 100, 1, 0, 0 }, { KVF_BUF_AUX, 0, 64, 8, 1, 0, 0 }};
    uint64_t addrs[2] = {0x7f0000001000ull, 0x7f0000002000ull};
    memset(&m, 0, sizeof(m));
    m.type = KVF_MSG_DATA_REF;
    m.u.data.room = 5;
    m.u.data.payload_len = 108;
    m.u.data.nseg = 2;
    m.u.data.segs = rsegs;
    m.u.data.src_addrs = (kvf_wire_arr64_t){2, addrs, NULL};
    b.len = 0;
    CHECK_EQ_INT(kvf_wire_encode(&b, &m), KVF_OK);
    CHECK_EQ_INT(kvf_wire_parse_header(b.data, &hdr, err, sizeof(err)), KVF_OK);
    CHECK_EQ_INT(hdr.type, KVF_MSG_DATA_REF);
    CHECK_EQ_INT(kvf_wire_decode(&hdr, b.data + KVF_WIRE_HDR_LEN, &d, err, sizeof(err)),
                 KVF_OK);
    CHECK_EQ_INT(d.u.data.nseg, 2);
    CHECK(kvf_wire_arr64_at(&d.u.data.src_addrs, 1) == addrs[1]);
    m.u.data.src_addrs.count = 1;
    b.len = 0;
    CHECK_EQ_INT(kvf_wire_encode(&b, &m), KVF_ERR_INVALID_PARAM);
    kvf_buf_free(&b);
}

/* One frame of every message type and shape (strided DATA, DONE with its
 * stream fields), with the length and FNV-1a hash of its exact bytes as
 * the encoder wrote them when the table was taken: a change to any
 * message's layout shows here, byte for byte, whatever the decoder
 * thinks of it. */
static uint64_t fnv1a(const uint8_t *p, size_t n)
{
    uint64_t h = 0xcbf29ce484222325ull;
    for (size_t i = 0; i < n; i++)
        h = (h ^ p[i]) * 0x100000001b3ull;
    return h;
}

static kvf_msg_t golden_sample(int i)
{
    static const uint8_t blob[] = {1, 2, 3, 4, 5};
    static const kvf_wire_seg_t ssegs[] = {
        { KVF_BUF_KV, 3, 4096, 100, 4, 1000, 2000 },
        { KVF_BUF_AUX, 0, 64, 8, 1, 0, 0 },
    };
    static const uint64_t addrs[] = {0x7f0000001000ull, 0x7f0000002000ull};
    kvf_msg_t m;

    if (i < NSAMPLES)
        return sample(i);
    memset(&m, 0, sizeof(m));
    switch (i) {
    case NSAMPLES:
        m.type = KVF_MSG_XPORT;
        m.u.xport.count = 2;
        m.u.xport.x[0] = (kvf_wire_xport_t){{"shm", 3}, blob, sizeof(blob)};
        m.u.xport.x[1] = (kvf_wire_xport_t){{"ucx", 3}, NULL, 0};
        break;
    case NSAMPLES + 1:
    case NSAMPLES + 2:
        m.type = i == NSAMPLES + 1 ? KVF_MSG_DATA_REF : KVF_MSG_DATA;
        m.u.data.room = BIG64;
        m.u.data.instance = 0x5152535455565758ull;
        m.u.data.src_rank = 2;
        m.u.data.payload_len = 408;
        m.u.data.nseg = 2;
        m.u.data.segs = ssegs;
        m.u.data.strided = 1;
        if (m.type == KVF_MSG_DATA_REF)
            m.u.data.src_addrs = (kvf_wire_arr64_t){2, addrs, NULL};
        break;
    case NSAMPLES + 3:
        m = sample_done();
        m.u.done.stream = 2;
        m.u.done.streams = 4;
        break;
    default:
        m.type = KVF_MSG_JOIN;
        for (int k = 0; k < KVF_WIRE_COOKIE_LEN; k++)
            m.u.join.cookie[k] = (uint8_t)(0x40 + k);
        m.u.join.stream = 3;
        break;
    }
    return m;
}

static void test_golden_every_type(void)
{
    static const struct { size_t len; uint64_t hash; } want[] = {
                {295, 0xd8664522a847b3b1ull},   /* HELLO */
        {108, 0x1f1f8a93f3073762ull},   /* ROOM_REQ */
        {108, 0x23e5a937e416a9b1ull},   /* DATA */
        {45, 0xbda62833d38462a4ull},   /* DONE */
        {36, 0x6569dedb56fd244eull},   /* DONE_ACK */
        {97, 0x89e11da763eea125ull},   /* FAIL */
        {97, 0xf04b5e21720ef75dull},   /* ABORT */
        {24, 0xa8c382ce95f6e8a5ull},   /* HEARTBEAT */
        {60, 0x17c1a3d32dfa0dddull},   /* AUTH */
        {40, 0xcfa456083cf88809ull},   /* AUTH_PROOF */
        {39, 0x54550242207fd7edull},   /* XPORT */
        {134, 0xb3d13269fdf88bb0ull},   /* DATA_REF */
        {114, 0x69a21189227e2543ull},   /* DATA */
        {53, 0x8d78013129de590aull},   /* DONE */
        {44, 0xc1f5f70f78a9400full},   /* JOIN */

    };
    bool seen[KVF_MSG_JOIN + 1] = {false};

    for (int i = 0; i < (int)(sizeof(want) / sizeof(want[0])); i++) {
        kvf_msg_t m = golden_sample(i), d;
        kvf_buf_t b, b2;
        char err[256];
        CHECK_EQ_INT(encode_decode(&m, &b, &d, err, sizeof(err)), KVF_OK);
        if (getenv("KVF_WIRE_GOLDEN_PRINT") != NULL)
            printf("        {%zu, 0x%016llxull},   /* %s */\n", b.len,
                   (unsigned long long)fnv1a(b.data, b.len),
                   kvf_wire_type_name((uint8_t)m.type));
        CHECK_EQ_INT(b.len, want[i].len);
        CHECK(fnv1a(b.data, b.len) == want[i].hash);
        /* what the decoder read re-encodes to the same bytes */
        kvf_buf_init(&b2);
        CHECK_EQ_INT(kvf_wire_encode(&b2, &d), KVF_OK);
        CHECK(b.len == b2.len && memcmp(b.data, b2.data, b.len) == 0);
        seen[m.type] = true;
        kvf_buf_free(&b);
        kvf_buf_free(&b2);
    }
    for (int t = KVF_MSG_HELLO; t <= KVF_MSG_JOIN; t++)
        CHECK(seen[t]);
}

KVF_TEST_MAIN(
    KVF_CASE(test_roundtrip_xport_data_ref),
    KVF_CASE(test_roundtrip_hello),
    KVF_CASE(test_hello_kv_order),
    KVF_CASE(test_roundtrip_room_req),
    KVF_CASE(test_roundtrip_data),
    KVF_CASE(test_roundtrip_small),
    KVF_CASE(test_roundtrip_fail_abort),
    KVF_CASE(test_golden_bytes),
    KVF_CASE(test_golden_every_type),
    KVF_CASE(test_type_names),
    KVF_CASE(test_streams),
    KVF_CASE(test_header_errors),
    KVF_CASE(test_decode_rejects_bad_header_values),
    KVF_CASE(test_truncation_every_offset),
    KVF_CASE(test_trailing_bytes),
    KVF_CASE(test_limits_rejected),
    KVF_CASE(test_data_rules),
    KVF_CASE(test_strided_roundtrip),
    KVF_CASE(test_strided_rules),
    KVF_CASE(test_value_rules),
    KVF_CASE(test_version_mismatch),
    KVF_CASE(test_encode_refuses),
    KVF_CASE(test_reencode_decoded),
    KVF_CASE(test_output_untouched_on_error)
)
