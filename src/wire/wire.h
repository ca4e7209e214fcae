/*
 * The engine-to-engine control protocol: message structs and a
 * bounds-checked codec.  docs/PROTOCOL.md is the normative description.
 *
 * Every message is a frame: an 8-byte header, then `length` bytes of body,
 * all integers little-endian whatever the host:
 *
 *     u32 length    body bytes that follow the header (<= KVF_WIRE_MAX_BODY)
 *     u8  type      kvf_msg_type_t
 *     u8  flags     0, or KVF_WIRE_F_STRIDED on DATA / DATA_REF (below);
 *                   receivers reject any other bit
 *     u16 reserved  0 (receivers reject non-zero)
 *
 * A DATA frame is followed by `payload_len` raw payload bytes that are not
 * part of the body: the receiver scatters them straight into registered
 * memory.  The protocol version travels in the first frame each side
 * sends (AUTH since version 2, HELLO in version 1: both begin with the
 * magic and the version); a peer with another version is refused with
 * KVF_ERR_VERSION.
 *
 * Authentication.  Each side's first frame is AUTH: who it is and a fresh
 * nonce.  Each then proves it holds the cluster token with AUTH_PROOF, an
 * HMAC-SHA256 under the token over both AUTHs and a label naming the
 * direction (core/auth.c builds it).  Nothing else is sent or read before
 * the peer's proof has been checked.
 *
 * Decoding never copies: strings and arrays in a decoded message point into
 * the caller's body buffer, which must outlive the message.  Arrays are read
 * through the kvf_wire_*_at() accessors, which work for encoded input
 * (native arrays) and decoded output (raw little-endian bytes) alike.
 *
 * Strided segments.  A segment normally names one byte range.  A DATA or
 * DATA_REF frame whose header carries KVF_WIRE_F_STRIDED has wider
 * segments (KVF_WIRE_SSEG_LEN bytes) that each name `count` pieces of
 * `len` bytes: piece k lands at offset + k * dst_stride and comes from
 * (DATA_REF: the source address) + k * src_stride.  That is the shape of
 * a TP slice, a few heads out of every token, which would otherwise cost
 * one segment per token.  The plain frame is unchanged, and a sender uses
 * the strided one only with a peer that accepted KVF_CAP_STRIDED in the
 * XPORT exchange (KVF_WIRE_CAPS_NAME), so older peers never see it.
 */
#ifndef KVF_WIRE_WIRE_H
#define KVF_WIRE_WIRE_H

#include <stddef.h>
#include <stdint.h>

#include "kvferry/status.h"
#include "util/buf.h"

#define KVF_WIRE_MAGIC      0x5946564bu /* "KVFY" as little-endian bytes */
#define KVF_WIRE_VERSION    5          /* 2: AUTH / AUTH_PROOF first; 3: typed
                                          state, KV tags, decode prefix, JOIN;
                                          4: the held room's instance in ROOM_REQ,
                                          the KV page order in HELLO; 5: ROOM_REQ
                                          flags (a watch) */
#define KVF_WIRE_NONCE_LEN  32
#define KVF_WIRE_MAC_LEN    32         /* HMAC-SHA256 */
#define KVF_WIRE_AUTH_LEN   (4 + 2 + 1 + 1 + 8 + 4 + KVF_WIRE_NONCE_LEN)
/* The largest body a peer may send before it has authenticated (AUTH's;
 * AUTH_PROOF's is KVF_WIRE_MAC_LEN): a frame header claiming more is
 * refused before any of its body is read (core/auth.c). */
#define KVF_WIRE_MAX_AUTH_BODY KVF_WIRE_AUTH_LEN
/* HELLO and AUTH lead with the magic (u32) and the version (u16). */
#define KVF_WIRE_PREFIX_LEN 6
#define KVF_WIRE_HDR_LEN    8
#define KVF_WIRE_MAX_BODY   (16u << 20)
#define KVF_WIRE_MAX_SEGS   8192
#define KVF_WIRE_MAX_STR    1024       /* strings: addresses, dtype, reasons */
#define KVF_WIRE_MAX_BUFS   4096       /* kv/aux/state buffers in a layout */
#define KVF_WIRE_SEG_LEN    17         /* encoded size of one DATA segment */
#define KVF_WIRE_SSEG_LEN   37         /* ... of one in a strided frame */
#define KVF_WIRE_MAX_PIECES KVF_WIRE_MAX_SEGS  /* pieces in one frame */
#define KVF_WIRE_F_STRIDED  0x1u       /* header flag: strided segments */
#define KVF_WIRE_MAX_XPORTS 8          /* transports in one XPORT message */
#define KVF_WIRE_MAX_BLOB   (1u << 20) /* bytes of one transport's blob */

typedef enum kvf_msg_type {
    KVF_MSG_HELLO     = 1,
    KVF_MSG_ROOM_REQ  = 2,
    KVF_MSG_DATA      = 3,    /* also the body of DATA_REF, see below */
    KVF_MSG_DONE      = 4,
    KVF_MSG_DONE_ACK  = 5,
    KVF_MSG_FAIL      = 6,
    KVF_MSG_ABORT     = 7,
    KVF_MSG_HEARTBEAT = 8,
    KVF_MSG_XPORT     = 9,    /* transport offers (prefill) / choice (decode) */
    KVF_MSG_DATA_REF  = 10,   /* DATA without payload: source addresses to pull */
    KVF_MSG_AUTH      = 11,   /* first frame: identity and a fresh nonce */
    KVF_MSG_AUTH_PROOF = 12,  /* HMAC proving the sender holds the token */
    KVF_MSG_JOIN      = 13    /* an extra stream names the peer it joins */
} kvf_msg_type_t;

/* Which registered buffer family a DATA segment targets. */
typedef enum kvf_buf_kind {
    KVF_BUF_KV    = 0,
    KVF_BUF_AUX   = 1,
    KVF_BUF_STATE = 2
} kvf_buf_kind_t;

/* A string: not NUL-terminated; len <= KVF_WIRE_MAX_STR. */
typedef struct kvf_wire_str {
    const char *ptr;
    uint32_t    len;
} kvf_wire_str_t;

/* Arrays: `native` is set for encoding, `raw` (LE bytes) after decoding. */
typedef struct kvf_wire_arr32 {
    uint32_t        count;
    const uint32_t *native;
    const uint8_t  *raw;
} kvf_wire_arr32_t;

typedef struct kvf_wire_arr64 {
    uint32_t        count;
    const uint64_t *native;
    const uint8_t  *raw;
} kvf_wire_arr64_t;

uint32_t kvf_wire_arr32_at(const kvf_wire_arr32_t *a, uint32_t i);
uint64_t kvf_wire_arr64_at(const kvf_wire_arr64_t *a, uint32_t i);

/* Layout descriptor, exchanged in HELLO. */
typedef struct kvf_wire_layout {
    uint32_t         page_size;
    kvf_wire_str_t   kv_dtype;
    uint8_t          attn;            /* kvf_attn_kind_t */
    uint8_t          mem_kind;        /* kvf_mem_kind_t */
    uint32_t         num_layers;
    uint32_t         first_layer;     /* global index of the first layer (PP) */
    uint32_t         heads_per_rank;
    uint32_t         total_heads;
    uint32_t         bytes_per_head;
    kvf_wire_arr64_t kv_item_bytes;   /* bytes per page, per KV buffer */
    kvf_wire_arr64_t kv_items;        /* pages per KV buffer */
    kvf_wire_arr64_t aux_item_bytes;  /* bytes per slot, per aux buffer */
    kvf_wire_arr64_t aux_items;       /* slots per aux buffer */
    kvf_wire_arr64_t state_item_bytes;
    kvf_wire_arr64_t state_items;
    /* Typed state: buffers per group, in order (their sum is the number of
     * state buffers), and the groups' types joined by ','. */
    kvf_wire_arr32_t state_groups;
    kvf_wire_str_t   state_types;
    /* One tag per KV buffer (kvf_wire_tag()): what it holds. */
    kvf_wire_arr64_t kv_tags;
    uint8_t          kv_order;        /* kvf_kv_order_t of the KV pages */
} kvf_wire_layout_t;

/* A KV buffer's tag as HELLO carries it: layer, role and group (kvferry.h
 * kvf_kv_tag_t); role and group below 2^16. */
static inline uint64_t kvf_wire_tag(uint32_t layer, uint32_t role, uint32_t group)
{
    return (uint64_t)layer | (uint64_t)(role & 0xffffu) << 32 |
           (uint64_t)(group & 0xffffu) << 48;
}

#define KVF_HELLO_F_CHECKSUM 0x1u      /* sender computes XXH3 checksums */

/*
 * Capabilities: optional forms a sender may use only once its peer has
 * accepted them.  A prefill rank lists what it can send as an XPORT entry
 * named KVF_WIRE_CAPS_NAME whose blob is a u32 of KVF_CAP_* bits (older
 * decode ranks skip an entry they do not know); a decode rank that knows
 * the entry answers with one of the same name holding the bits it accepts.
 */
#define KVF_WIRE_CAPS_NAME  "caps"
#define KVF_WIRE_CAPS_LEN   4
#define KVF_CAP_STRIDED     0x1u       /* DATA / DATA_REF with strided segments */
#define KVF_CAPS_KNOWN      KVF_CAP_STRIDED

/*
 * Streams: a pair may move payload over several connections.  The prefill
 * rank's XPORT offer holds an entry named KVF_WIRE_STREAMS_NAME whose blob
 * is u32 the most streams it takes, then the peer's join cookie
 * (KVF_WIRE_COOKIE_LEN random bytes); a decode rank that wants n >= 2 of
 * them answers with an entry of the same name holding u32 n, then opens
 * streams 1..n-1, each authenticated and then naming the peer by its
 * cookie in a JOIN.  Older decode ranks skip the entry: one stream.
 */
#define KVF_WIRE_STREAMS_NAME  "streams"
#define KVF_WIRE_COOKIE_LEN    32
#define KVF_WIRE_STREAMS_OFFER (4 + KVF_WIRE_COOKIE_LEN)
#define KVF_WIRE_STREAMS_ANSWER 4
#define KVF_WIRE_MAX_STREAMS   8

typedef struct kvf_msg_hello {
    uint32_t          magic;          /* KVF_WIRE_MAGIC */
    uint16_t          version;        /* KVF_WIRE_VERSION */
    uint8_t           role;           /* kvf_role_t */
    uint8_t           flags;          /* KVF_HELLO_F_* */
    uint64_t          instance_id;
    uint32_t          tp_rank, tp_size;
    uint32_t          pp_rank, pp_size;
    uint32_t          dp_rank, dp_size;
    kvf_wire_str_t    addr;           /* advertised control address host:port */
    kvf_wire_layout_t layout;
} kvf_msg_hello_t;

/* Decode -> prefill: the room's destination on one decode rank. */
/*
 * Room instances.  Every room message names, beside the room id, the
 * instance of the room it is about: a fresh random non-zero u64 the
 * receiver draws when it is created and sends in its ROOM_REQ (a resume
 * keeps it).  The sender names it in everything it sends for that
 * receiver; both sides drop a frame whose instance is not the room's, so
 * a room id reused right after a failure never sees the old room's bytes
 * or failure.  0 means "no instance known" (a FAIL answering a request
 * that could not be parsed far enough; never matches a live room).
 */
typedef struct kvf_msg_room_req {
    uint64_t         room;
    uint64_t         instance;            /* the receiver's room instance */
    uint32_t         dst_rank;            /* decode tp rank */
    uint32_t         expected_receivers;  /* decode ranks this sender feeds */
    uint32_t         aux_slot;
    kvf_wire_arr32_t pages;               /* decode page indices, in order */
    /* State indices: state_counts[g] of them for state group g, all groups'
     * in order in state_idx (no groups: nothing for state). */
    kvf_wire_arr32_t state_counts;
    kvf_wire_arr32_t state_idx;
    uint32_t         attempt;             /* 0; n: resumed after n reconnects */
    uint32_t         decode_prefix_len;   /* tokens the decode holds already */
    /* The held room's instance this reader wants (kvf_hold_t.instance,
     * from kvf_remote_t): a sender holding the room under another one
     * refuses it.  0: the reader takes the room's sender, whatever it is. */
    uint64_t         sender_instance;
    uint32_t         flags;               /* KVF_REQ_* */
} kvf_msg_room_req_t;

/*
 * A watch: a decode rank that reads a room from other prefill ranks of
 * the same DP group tells this one about the room, so that a failure of
 * the room on either reaches the other (its siblings').  No pages, no
 * aux, no state; not one of the sender's expected receivers; it binds the
 * decode rank's room instance to the sender for FAIL and ABORT only.
 */
#define KVF_REQ_WATCH 0x1u

typedef struct kvf_wire_seg {
    uint8_t  kind;       /* kvf_buf_kind_t */
    uint32_t buf;        /* buffer index within its kind */
    uint64_t offset;     /* byte offset of the first piece inside that buffer */
    uint32_t len;        /* bytes per piece, > 0 */
    /* count pieces, piece k at offset + k * dst_stride and read from the
     * source + k * src_stride; with count > 1 (strided frames only) both
     * strides are >= len, so pieces never overlap.  A plain segment has
     * count 1, or 0 in an encoder's input outside a strided frame; decoding
     * gives count >= 1 (1 and strides 0 for every segment of a plain frame). */
    uint32_t count;
    uint64_t dst_stride;
    uint64_t src_stride;
} kvf_wire_seg_t;

/* Pieces of a segment: count, where 0 (a plain segment's) means 1. */
static inline uint32_t kvf_wire_seg_pieces(const kvf_wire_seg_t *s)
{
    return s->count > 1 ? s->count : 1;
}

/* Payload bytes of a segment: pieces x len (cannot overflow 64 bits). */
static inline uint64_t kvf_wire_seg_bytes(const kvf_wire_seg_t *s)
{
    return (uint64_t)kvf_wire_seg_pieces(s) * s->len;
}

/*
 * Bytes from the first piece's start to the last piece's end, in the
 * destination (src = 0) or the source (src = 1): every byte a segment
 * touches lies in [offset, offset + span).  @return 0 if that sum
 * overflows 64 bits (the codec refuses such a segment).
 */
static inline int kvf_wire_seg_span(const kvf_wire_seg_t *s, int src, uint64_t *span_p)
{
    uint64_t n = kvf_wire_seg_pieces(s) - 1, stride = src ? s->src_stride : s->dst_stride;
    if (n != 0 && stride > (UINT64_MAX - s->len) / n)
        return 0;
    *span_p = n * stride + s->len;
    return 1;
}

/*
 * Prefill -> decode: segments, then payload_len payload bytes (DATA), or
 * segments and the address each one's bytes are to be read from, with no
 * payload (DATA_REF: the receiver pulls them itself, see XPORT).
 */
typedef struct kvf_msg_data {
    uint64_t              room;
    uint64_t              instance;      /* the receiver's room instance */
    uint32_t              src_rank;
    uint64_t              payload_len;   /* == sum of segment bytes */
    uint32_t              nseg;          /* 1..KVF_WIRE_MAX_SEGS */
    uint8_t               strided;       /* KVF_WIRE_F_STRIDED frame: segments
                                            may have count > 1 */
    uint32_t              npieces;       /* decode: sum of the segments' pieces,
                                            <= KVF_WIRE_MAX_PIECES (encode: ignored) */
    const kvf_wire_seg_t *segs;          /* encode: input array */
    const uint8_t        *raw_segs;      /* decode: nseg segments as on the wire */
    kvf_wire_arr64_t      src_addrs;     /* DATA_REF: nseg source addresses */
} kvf_msg_data_t;

void kvf_wire_seg_at(const kvf_msg_data_t *d, uint32_t i, kvf_wire_seg_t *seg_p);

/*
 * Transports beside the control stream.  A prefill engine sends one XPORT
 * after its HELLO, listing what a decode engine may use to pull payload
 * from it (name and an opaque blob: process id, memory keys, ...); the
 * decode engine answers with one XPORT naming its choice (no blob), or
 * none (count 0: payload stays in DATA frames), before any ROOM_REQ.
 */
typedef struct kvf_wire_xport {
    kvf_wire_str_t name;
    const uint8_t *blob;
    uint32_t       blob_len;   /* <= KVF_WIRE_MAX_BLOB */
} kvf_wire_xport_t;

typedef struct kvf_msg_xport {
    uint32_t         count;    /* 0..KVF_WIRE_MAX_XPORTS */
    kvf_wire_xport_t x[KVF_WIRE_MAX_XPORTS];
} kvf_msg_xport_t;

/* Prefill -> decode: this rank's part of the room is complete. */
typedef struct kvf_msg_done {
    uint64_t room;
    uint64_t instance;     /* the receiver's room instance */
    uint32_t src_rank;
    uint64_t bytes;        /* payload bytes this sender wrote for the room */
    uint8_t  has_checksum;
    uint64_t checksum;     /* XXH3-64 over those bytes, in write order */
    /* A pair with several streams: this DONE ends stream `stream` of
     * `streams`, and bytes and checksum are that stream's.  streams 0:
     * the fields are absent (one stream; the 37-byte body). */
    uint32_t stream;
    uint32_t streams;
} kvf_msg_done_t;

/* Decode -> prefill: the data is in decode memory (status KVF_OK) or not. */
typedef struct kvf_msg_done_ack {
    uint64_t room;
    uint64_t instance;     /* the receiver's room instance */
    int32_t  status;
    uint64_t bytes;
} kvf_msg_done_ack_t;

/* Either way: the room failed (FAIL) or was aborted (ABORT) at origin. */
typedef struct kvf_msg_fail {
    uint64_t       room;
    uint64_t       instance;       /* the receiver's room instance */
    int32_t        status;         /* kvf_status_t, negative */
    uint8_t        origin_side;    /* kvf_role_t */
    uint32_t       origin_rank;
    kvf_wire_str_t origin_addr;
    kvf_wire_str_t reason;
    /* From a decode rank: the request key of the held room it was to read
     * (ROOM_REQ's sender_instance), so that a held room it never bound
     * may take the failure; 0 otherwise. */
    uint64_t       sender_instance;
    /* The sides on which a rank is known to have failed the room, a bit
     * each (KVF_SIDE_BIT): a rank whose room succeeded fails it too only
     * when its own side is among them (core/siblings.c). */
    uint8_t        sides;
} kvf_msg_fail_t;

#define KVF_SIDE_BIT(role) ((uint8_t)(1u << (role)))   /* kvf_role_t */
#define KVF_SIDES_ALL      0x3u

/*
 * The first frame each side sends (both at once).  The first six bytes,
 * magic and version, have the place HELLO gave them in version 1, so a
 * peer of another version is named as such whichever frame it led with.
 */
#define KVF_AUTH_F_TOKEN 0x1u          /* the sender has a token configured */
#define KVF_AUTH_F_JOIN  0x2u          /* connector: this connection is an extra
                                          stream, a JOIN follows the proofs */

typedef struct kvf_msg_auth {
    uint32_t magic;                    /* KVF_WIRE_MAGIC */
    uint16_t version;                  /* KVF_WIRE_VERSION */
    uint8_t  role;                     /* kvf_role_t */
    uint8_t  flags;                    /* KVF_AUTH_F_*: advisory, unauthenticated */
    uint64_t instance_id;
    uint32_t pid;                      /* the sender's process id (shm checks it) */
    uint8_t  nonce[KVF_WIRE_NONCE_LEN]; /* fresh from getrandom() */
} kvf_msg_auth_t;

typedef struct kvf_msg_auth_proof {
    uint8_t mac[KVF_WIRE_MAC_LEN];
} kvf_msg_auth_proof_t;

/* Decode -> prefill on a new, authenticated connection: attach it as
 * stream `stream` of the peer this cookie was given to.  Prefill ->
 * decode, the same frame: attached. */
typedef struct kvf_msg_join {
    uint8_t  cookie[KVF_WIRE_COOKIE_LEN];
    uint32_t stream;       /* 1 .. KVF_WIRE_MAX_STREAMS - 1 */
} kvf_msg_join_t;

typedef struct kvf_msg_heartbeat {
    uint64_t seq;
    uint64_t time_ns;
} kvf_msg_heartbeat_t;

typedef struct kvf_msg {
    kvf_msg_type_t type;
    union {
        kvf_msg_hello_t     hello;
        kvf_msg_room_req_t  room_req;
        kvf_msg_data_t      data;
        kvf_msg_done_t      done;
        kvf_msg_done_ack_t  done_ack;
        kvf_msg_fail_t      fail;      /* FAIL and ABORT */
        kvf_msg_heartbeat_t heartbeat;
        kvf_msg_xport_t     xport;
        kvf_msg_auth_t      auth;
        kvf_msg_auth_proof_t proof;
        kvf_msg_join_t      join;
    } u;
} kvf_msg_t;

typedef struct kvf_wire_hdr {
    uint32_t length;
    uint8_t  type;
    uint8_t  flags;      /* KVF_WIRE_F_STRIDED or 0 */
} kvf_wire_hdr_t;

/*
 * Append one encoded frame (header and body; for DATA not the payload) to
 * `out`.  @return KVF_OK, KVF_ERR_INVALID_PARAM (a field over its limit:
 * the message would not decode), KVF_ERR_NO_MEMORY.
 */
kvf_status_t kvf_wire_encode(kvf_buf_t *out, const kvf_msg_t *msg);

/*
 * Parse a frame header (exactly KVF_WIRE_HDR_LEN bytes at p).
 * @return KVF_OK; KVF_ERR_PROTOCOL with `err` set (unknown type, a flag
 * other than KVF_WIRE_F_STRIDED on DATA / DATA_REF, non-zero reserved
 * bits, length over KVF_WIRE_MAX_BODY).
 */
kvf_status_t kvf_wire_parse_header(const uint8_t *p, kvf_wire_hdr_t *hdr_p,
                                   char *err, size_t errlen);

/*
 * Decode a body of hdr->length bytes.  Every length and count is checked
 * against the body and against the limits above; trailing bytes are an
 * error.  @return KVF_OK; KVF_ERR_PROTOCOL or, for a HELLO or AUTH of
 * another version or magic, KVF_ERR_VERSION, with a reason in `err`.
 */
kvf_status_t kvf_wire_decode(const kvf_wire_hdr_t *hdr, const uint8_t *body,
                             kvf_msg_t *msg_p, char *err, size_t errlen);

/*
 * The protocol version of a frame refused before its body was read (a
 * connection's receive limit, transport.h).  HELLO and AUTH lead with the
 * magic and the version, frozen across versions, so that the refusal of
 * another version's first frame can still say so.
 * kvf_wire_prefix_len: how many leading body bytes tell (KVF_WIRE_PREFIX_LEN
 * for HELLO and AUTH, 0 for a type that has no prefix).
 * kvf_wire_check_prefix: `body` holds the body's first `len` bytes.
 * @return KVF_OK (this version, or a type without prefix), KVF_ERR_VERSION
 * (another version, or not kvferry: `err` says which) or KVF_ERR_PROTOCOL
 * (too short to tell).
 */
uint32_t     kvf_wire_prefix_len(uint8_t type);
kvf_status_t kvf_wire_check_prefix(uint8_t type, const uint8_t *body, uint32_t len,
                                   char *err, size_t errlen);

/* "HELLO", "DATA", ... (static). */
const char *kvf_wire_type_name(uint8_t type);

#endif /* KVF_WIRE_WIRE_H */
