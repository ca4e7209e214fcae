/*
 * Fuzz target for the control-protocol codec.  The input is a byte stream
 * as a peer would send it: frames, each DATA frame followed by its payload.
 * Besides "never crash, never read out of bounds", it checks that decode
 * and encode agree: every message the decoder accepts must re-encode to
 * exactly the bytes it came from, and decode again to the same fields.
 */
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "wire/wire.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static bool fz_str_eq(kvf_wire_str_t a, kvf_wire_str_t b)
{
    return a.len == b.len && (a.len == 0 || memcmp(a.ptr, b.ptr, a.len) == 0);
}

static bool fz_arr32_eq(const kvf_wire_arr32_t *a, const kvf_wire_arr32_t *b)
{
    if (a->count != b->count)
        return false;
    for (uint32_t i = 0; i < a->count; i++)
        if (kvf_wire_arr32_at(a, i) != kvf_wire_arr32_at(b, i))
            return false;
    return true;
}

static bool fz_arr64_eq(const kvf_wire_arr64_t *a, const kvf_wire_arr64_t *b)
{
    if (a->count != b->count)
        return false;
    for (uint32_t i = 0; i < a->count; i++)
        if (kvf_wire_arr64_at(a, i) != kvf_wire_arr64_at(b, i))
            return false;
    return true;
}

static bool fz_hello_eq(const kvf_msg_hello_t *a, const kvf_msg_hello_t *b)
{
    const kvf_wire_layout_t *x = &a->layout, *y = &b->layout;
    return a->magic == b->magic && a->version == b->version &&
           a->role == b->role && a->flags == b->flags &&
           a->instance_id == b->instance_id && a->tp_rank == b->tp_rank &&
           a->tp_size == b->tp_size && a->pp_rank == b->pp_rank &&
           a->pp_size == b->pp_size && a->dp_rank == b->dp_rank &&
           a->dp_size == b->dp_size && fz_str_eq(a->addr, b->addr) &&
           x->page_size == y->page_size && fz_str_eq(x->kv_dtype, y->kv_dtype) &&
           x->attn == y->attn && x->mem_kind == y->mem_kind &&
           x->num_layers == y->num_layers &&
           x->first_layer == y->first_layer &&
           x->heads_per_rank == y->heads_per_rank &&
           x->total_heads == y->total_heads &&
           x->bytes_per_head == y->bytes_per_head &&
           fz_arr64_eq(&x->kv_item_bytes, &y->kv_item_bytes) &&
           fz_arr64_eq(&x->kv_items, &y->kv_items) &&
           fz_arr64_eq(&x->aux_item_bytes, &y->aux_item_bytes) &&
           fz_arr64_eq(&x->aux_items, &y->aux_items) &&
           fz_arr64_eq(&x->state_item_bytes, &y->state_item_bytes) &&
           fz_arr64_eq(&x->state_items, &y->state_items) &&
           fz_arr32_eq(&x->state_groups, &y->state_groups) &&
           fz_str_eq(x->state_types, y->state_types) &&
           fz_arr64_eq(&x->kv_tags, &y->kv_tags) && x->kv_order == y->kv_order;
}

static bool fz_data_eq(const kvf_msg_data_t *a, const kvf_msg_data_t *b)
{
    if (a->room != b->room || a->instance != b->instance || a->src_rank != b->src_rank ||
        a->payload_len != b->payload_len || a->nseg != b->nseg ||
        a->strided != b->strided || a->npieces != b->npieces)
        return false;
    uint64_t pieces = 0;
    for (uint32_t i = 0; i < a->nseg; i++) {
        kvf_wire_seg_t s, t;
        kvf_wire_seg_at(a, i, &s);
        kvf_wire_seg_at(b, i, &t);
        if (s.kind != t.kind || s.buf != t.buf || s.offset != t.offset ||
            s.len != t.len || s.count != t.count || s.dst_stride != t.dst_stride ||
            s.src_stride != t.src_stride)
            return false;
        /* What the receiver relies on: no piece wraps, none overlaps. */
        uint64_t span;
        if (s.count == 0 || !kvf_wire_seg_span(&s, 0, &span) ||
            s.offset > UINT64_MAX - span ||
            (s.count > 1 && (s.dst_stride < s.len || s.src_stride < s.len)))
            abort();
        pieces += s.count;
    }
    if (pieces != a->npieces || pieces > KVF_WIRE_MAX_PIECES)
        abort();
    return true;
}

static bool fz_msg_eq(const kvf_msg_t *a, const kvf_msg_t *b)
{
    if (a->type != b->type)
        return false;
    switch (a->type) {
    case KVF_MSG_HELLO:
        return fz_hello_eq(&a->u.hello, &b->u.hello);
    case KVF_MSG_ROOM_REQ:
        return a->u.room_req.room == b->u.room_req.room &&
               a->u.room_req.instance == b->u.room_req.instance &&
               a->u.room_req.dst_rank == b->u.room_req.dst_rank &&
               a->u.room_req.expected_receivers ==
                   b->u.room_req.expected_receivers &&
               a->u.room_req.aux_slot == b->u.room_req.aux_slot &&
               fz_arr32_eq(&a->u.room_req.pages, &b->u.room_req.pages) &&
               fz_arr32_eq(&a->u.room_req.state_counts,
                           &b->u.room_req.state_counts) &&
               fz_arr32_eq(&a->u.room_req.state_idx, &b->u.room_req.state_idx) &&
               a->u.room_req.attempt == b->u.room_req.attempt &&
               a->u.room_req.decode_prefix_len == b->u.room_req.decode_prefix_len &&
               a->u.room_req.sender_instance == b->u.room_req.sender_instance &&
               a->u.room_req.flags == b->u.room_req.flags;
    case KVF_MSG_DATA:
        return fz_data_eq(&a->u.data, &b->u.data);
    case KVF_MSG_DONE:
        return a->u.done.room == b->u.done.room &&
               a->u.done.instance == b->u.done.instance &&
               a->u.done.src_rank == b->u.done.src_rank &&
               a->u.done.bytes == b->u.done.bytes &&
               a->u.done.has_checksum == b->u.done.has_checksum &&
               a->u.done.checksum == b->u.done.checksum &&
               a->u.done.stream == b->u.done.stream &&
               a->u.done.streams == b->u.done.streams;
    case KVF_MSG_DONE_ACK:
        return a->u.done_ack.room == b->u.done_ack.room &&
               a->u.done_ack.instance == b->u.done_ack.instance &&
               a->u.done_ack.status == b->u.done_ack.status &&
               a->u.done_ack.bytes == b->u.done_ack.bytes;
    case KVF_MSG_FAIL:
    case KVF_MSG_ABORT:
        return a->u.fail.room == b->u.fail.room &&
               a->u.fail.instance == b->u.fail.instance &&
               a->u.fail.status == b->u.fail.status &&
               a->u.fail.origin_side == b->u.fail.origin_side &&
               a->u.fail.origin_rank == b->u.fail.origin_rank &&
               fz_str_eq(a->u.fail.origin_addr, b->u.fail.origin_addr) &&
               fz_str_eq(a->u.fail.reason, b->u.fail.reason) &&
               a->u.fail.sender_instance == b->u.fail.sender_instance &&
               a->u.fail.sides == b->u.fail.sides;
    case KVF_MSG_HEARTBEAT:
        return a->u.heartbeat.seq == b->u.heartbeat.seq &&
               a->u.heartbeat.time_ns == b->u.heartbeat.time_ns;
    case KVF_MSG_AUTH:
        return a->u.auth.magic == b->u.auth.magic &&
               a->u.auth.version == b->u.auth.version &&
               a->u.auth.role == b->u.auth.role &&
               a->u.auth.flags == b->u.auth.flags &&
               a->u.auth.instance_id == b->u.auth.instance_id &&
               a->u.auth.pid == b->u.auth.pid &&
               memcmp(a->u.auth.nonce, b->u.auth.nonce, KVF_WIRE_NONCE_LEN) == 0;
    case KVF_MSG_AUTH_PROOF:
        return memcmp(a->u.proof.mac, b->u.proof.mac, KVF_WIRE_MAC_LEN) == 0;
    case KVF_MSG_JOIN:
        return memcmp(a->u.join.cookie, b->u.join.cookie, KVF_WIRE_COOKIE_LEN) == 0 &&
               a->u.join.stream == b->u.join.stream;
    case KVF_MSG_DATA_REF:
        if (!fz_data_eq(&a->u.data, &b->u.data) ||
            a->u.data.src_addrs.count != b->u.data.src_addrs.count)
            return false;
        for (uint32_t i = 0; i < a->u.data.src_addrs.count; i++)
            if (kvf_wire_arr64_at(&a->u.data.src_addrs, i) !=
                kvf_wire_arr64_at(&b->u.data.src_addrs, i))
                return false;
        return true;
    case KVF_MSG_XPORT:
        if (a->u.xport.count != b->u.xport.count)
            return false;
        for (uint32_t i = 0; i < a->u.xport.count; i++) {
            const kvf_wire_xport_t *x = &a->u.xport.x[i], *y = &b->u.xport.x[i];
            if (!fz_str_eq(x->name, y->name) || x->blob_len != y->blob_len ||
                (x->blob_len && memcmp(x->blob, y->blob, x->blob_len) != 0))
                return false;
        }
        return true;
    }
    return false;
}

static void fz_roundtrip(const uint8_t *frame, const kvf_wire_hdr_t *hdr,
                         const kvf_msg_t *msg)
{
    kvf_buf_t out;
    kvf_wire_hdr_t hdr2;
    kvf_msg_t msg2;
    char err[256];

    kvf_buf_init(&out);
    if (kvf_wire_encode(&out, msg) != KVF_OK)
        abort();   /* the encoder refused what the decoder accepted */
    if (out.len != (size_t)KVF_WIRE_HDR_LEN + hdr->length ||
        memcmp(out.data, frame, out.len) != 0)
        abort();
    if (kvf_wire_parse_header(out.data, &hdr2, err, sizeof(err)) != KVF_OK ||
        hdr2.length != hdr->length || hdr2.type != hdr->type ||
        hdr2.flags != hdr->flags)
        abort();
    if (kvf_wire_decode(&hdr2, out.data + KVF_WIRE_HDR_LEN, &msg2, err,
                        sizeof(err)) != KVF_OK ||
        !fz_msg_eq(msg, &msg2))
        abort();
    kvf_buf_free(&out);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char err[256];

    while (size >= KVF_WIRE_HDR_LEN) {
        kvf_wire_hdr_t hdr;
        if (kvf_wire_parse_header(data, &hdr, err, sizeof(err)) != KVF_OK)
            break;
        if (size - KVF_WIRE_HDR_LEN < hdr.length)
            break;
        /* An exact-size copy lets AddressSanitizer see any overread. */
        uint8_t *body = malloc(hdr.length ? hdr.length : 1);
        if (body == NULL)
            abort();
        memcpy(body, data + KVF_WIRE_HDR_LEN, hdr.length);
        kvf_msg_t msg;
        err[0] = '\0';
        kvf_status_t st = kvf_wire_decode(&hdr, body, &msg, err, sizeof(err));
        if (st == KVF_OK) {
            fz_roundtrip(data, &hdr, &msg);
        } else if (err[0] == '\0' ||
                   (st != KVF_ERR_PROTOCOL && st != KVF_ERR_VERSION)) {
            abort();   /* every refusal must say why */
        }
        free(body);
        if (st != KVF_OK)
            break;

        size_t used = (size_t)KVF_WIRE_HDR_LEN + hdr.length;
        if (msg.type == KVF_MSG_DATA)
            used += msg.u.data.payload_len < size - used
                        ? (size_t)msg.u.data.payload_len
                        : size - used;
        data += used;
        size -= used;
    }
    return 0;
}
