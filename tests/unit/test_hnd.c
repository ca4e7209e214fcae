/*
 * Head-major KV pages (kvf_layout_t.kv_order = KVF_KV_HND, vLLM's "HND"):
 * a page is [heads][tokens][bytes], so the heads one TP rank sends another
 * are one contiguous piece of each page.
 *
 *   - Real engines over tcp and shm, prefill and decode at different TP
 *     sizes with GQA heads (and GQA replication): every byte of every
 *     destination page is checked per (buffer, head, token), and every
 *     other page is still zero.  NHD runs the same pairs as the control.
 *   - A prefill and a decode whose orders differ are refused on both
 *     sides with a message naming both (MLA, which has no heads to cut,
 *     ignores the order).
 *   - A real HND prefill feeding a hand-written decode rank: one strided
 *     segment per run with a piece per page, or a plain segment per page
 *     for a rank that did not accept strided segments.
 *   - Hand-written HND prefill ranks sending a real decode engine what no
 *     sender would: another rank's head, more than its heads, a page twice.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>

#include "bootstrap/bootstrap.h"
#include "core/room.h"
#include "kvferry/kvferry.h"
#include "unit/kvf_rooms.h"
#include "unit/kvf_test.h"
#include "unit/kvf_wire_peer.h"
#include "wire/wire.h"

#include <xxhash.h>

#define LAYERS 2
#define NKV    (2 * LAYERS)       /* K and V per layer */
#define PAGE   4                  /* tokens per page */
#define PAGES  32
#define HEAD_B 16                 /* bytes per head per token */
#define AUX_B  16
#define SLOTS  8
#define MAXTP  4

/* ---- the logical KV and where a page order puts it -------------------- */

/* Byte j of global head `gh` of slot s of (prefill) page `page` of KV
 * buffer b: a function of those coordinates only, so that replicas of a
 * head (GQA) agree and any misplaced piece shows. */
static uint8_t kv_byte(uint32_t b, uint32_t gh, uint32_t page, uint32_t s, uint32_t j)
{
    uint32_t x = b * 0x9E3779B1u ^ (gh + 1) * 0x85EBCA77u ^ (page + 1) * 0xC2B2AE3Du ^
                 (s + 1) * 0x27D4EB2Fu ^ (j + 1) * 0x165667B1u;
    x ^= x >> 15;
    x *= 0x2C1B3C6Du;
    x ^= x >> 12;
    return (uint8_t)(x ^ (x >> 8));
}

/* Where byte j of local head h of slot s of `page` lies in a buffer of
 * `hpr` heads per page, in `order`. */
static size_t kv_at(kvf_kv_order_t order, uint32_t hpr, uint32_t page, uint32_t h,
                    uint32_t s, uint32_t j)
{
    size_t in_page = order == KVF_KV_HND ? ((size_t)h * PAGE + s) * HEAD_B
                                         : ((size_t)s * hpr + h) * HEAD_B;
    return (size_t)page * PAGE * hpr * HEAD_B + in_page + j;
}

/* The heads of TP rank r of t, of H: [first, first + count). */
static void rank_heads(uint32_t H, int t, int r, uint32_t *first, uint32_t *count)
{
    if ((uint32_t)t <= H) {
        *count = H / (uint32_t)t;
        *first = (uint32_t)r * *count;
    } else {
        *count = 1;
        *first = (uint32_t)((uint64_t)r * H / (uint32_t)t);
    }
}

/* ---- real engines -------------------------------------------------------- */

typedef struct side {
    kvf_engine_t *eng;
    uint8_t      *kv[NKV];
    uint8_t      *aux;
    uint32_t      hpr, head0;       /* heads per rank, the first's global index */
} side_t;

static char bs_addr[64];

/* A rank of TP `tp` with `H` heads in `order` (attn MHA), or MLA (H 0):
 * a prefill fills its pages with kv_byte, a decode leaves them zero.  The
 * first prefill rank hosts the registry (bs_addr). */
static void side_init(side_t *s, kvf_role_t role, int rank, int tp, uint32_t H,
                      kvf_kv_order_t order, const char *transport)
{
    kvf_engine_params_t p;
    kvf_engine_params_init(&p);
    p.role = role;
    p.tp_rank = rank;
    p.tp_size = tp;
    int host = role == KVF_ROLE_PREFILL && rank == 0;
    p.bootstrap_addr = role == KVF_ROLE_DECODE ? NULL : host ? "127.0.0.1:0" : bs_addr;
    p.host_bootstrap = host;
    p.transport = transport;
    p.checksum = 1;
    p.bootstrap_timeout_ms = 5000;
    p.transfer_timeout_ms = 5000;
    memset(s, 0, sizeof(*s));
    CHECK_EQ_INT(kvf_engine_create(&p, &s->eng), KVF_OK);
    if (host)
        CHECK_EQ_INT(kvf_engine_bootstrap_addr(s->eng, bs_addr, sizeof(bs_addr)), KVF_OK);

    int mla = H == 0;
    if (mla) {
        s->hpr = 1;    /* one latent vector per token: HEAD_B bytes */
    } else {
        rank_heads(H, tp, rank, &s->head0, &s->hpr);
    }
    size_t page_b = (size_t)PAGE * s->hpr * HEAD_B;
    uint32_t nkv = mla ? LAYERS : NKV;
    kvf_buffer_t kv[NKV], aux;
    for (uint32_t b = 0; b < nkv; b++) {
        s->kv[b] = calloc(PAGES, page_b);
        kv[b] = (kvf_buffer_t){s->kv[b], PAGES * page_b, page_b};
        for (uint32_t pg = 0; role == KVF_ROLE_PREFILL && pg < PAGES; pg++)
            for (uint32_t h = 0; h < s->hpr; h++)
                for (uint32_t t = 0; t < PAGE; t++)
                    for (uint32_t j = 0; j < HEAD_B; j++)
                        s->kv[b][kv_at(order, s->hpr, pg, h, t, j)] =
                            kv_byte(b, s->head0 + h, pg, t, j);
    }
    s->aux = calloc(SLOTS, AUX_B);
    for (size_t i = 0; role == KVF_ROLE_PREFILL && i < SLOTS * AUX_B; i++)
        s->aux[i] = (uint8_t)(i * 13 + 5);
    aux = (kvf_buffer_t){s->aux, SLOTS * AUX_B, AUX_B};
    kvf_layout_t l;
    kvf_layout_init(&l);
    l.page_size = PAGE;
    l.kv_dtype = "bfloat16";
    l.attn = mla ? KVF_ATTN_MLA : KVF_ATTN_MHA;
    l.num_layers = LAYERS;
    if (!mla) {
        l.heads_per_rank = s->hpr;
        l.total_heads = H;
        l.bytes_per_head = HEAD_B;
    }
    l.num_kv = nkv;
    l.kv = kv;
    l.num_aux = 1;
    l.aux = &aux;
    l.kv_order = order;
    CHECK_EQ_INT(kvf_engine_register_layout(s->eng, &l), KVF_OK);
}

static void side_fini(side_t *s)
{
    kvf_engine_destroy(s->eng);
    for (int b = 0; b < NKV; b++)
        free(s->kv[b]);
    free(s->aux);
}

/* Source and destination pages of the room: runs of 3, 2 and 1 on the
 * prefill side, cut differently on the decode side. */
#define NPAGES 6
static const uint32_t src_pages[NPAGES] = {3, 4, 5, 10, 11, 20};
static const uint32_t dst_pages[NPAGES] = {7, 8, 9, 2, 30, 31};

/* Does decode rank d hold, in every page of the room, exactly the heads it
 * owns of the prefill's pages, and nothing anywhere else?  @return the
 * number of wrong bytes (the first few are printed). */
static size_t check_decode(const side_t *d, kvf_kv_order_t order, uint32_t nkv)
{
    size_t bad = 0, page_b = (size_t)PAGE * d->hpr * HEAD_B;
    for (uint32_t b = 0; b < nkv; b++) {
        uint8_t *want = calloc(PAGES, page_b);
        for (uint32_t i = 0; i < NPAGES; i++)
            for (uint32_t h = 0; h < d->hpr; h++)
                for (uint32_t t = 0; t < PAGE; t++)
                    for (uint32_t j = 0; j < HEAD_B; j++)
                        want[kv_at(order, d->hpr, dst_pages[i], h, t, j)] =
                            kv_byte(b, d->head0 + h, src_pages[i], t, j);
        for (size_t k = 0; k < PAGES * page_b; k++) {
            if (d->kv[b][k] == want[k])
                continue;
            if (bad++ < 3)
                fprintf(stderr, "  buffer %u byte %zu (page %zu): 0x%02x, want 0x%02x\n",
                        b, k, k / page_b, d->kv[b][k], want[k]);
        }
        free(want);
    }
    return bad;
}

/* One room from P prefill ranks to D decode ranks, H heads (0: MLA), each
 * side in its own order, over `transport`, in two chunks.  want_ok: the
 * room must succeed on every rank with every byte in place; otherwise
 * every rank must fail with KVF_ERR_INCOMPATIBLE and `why` in its reason. */
static void tp_room(int P, int D, uint32_t H, kvf_kv_order_t pre_order,
                    kvf_kv_order_t dec_order, const char *transport, int want_ok,
                    const char *why)
{
    static uint64_t next_room = 1000;
    uint64_t room = next_room++;
    side_t pre[MAXTP], dec[MAXTP];
    kvf_sender_t *s[MAXTP];
    kvf_receiver_t *r[MAXTP];
    kvf_failure_t f;
    kvf_failure_init(&f);

    for (int p = 0; p < P; p++)
        side_init(&pre[p], KVF_ROLE_PREFILL, p, P, H, pre_order, transport);
    for (int d = 0; d < D; d++)
        side_init(&dec[d], KVF_ROLE_DECODE, d, D, H, dec_order, transport);
    for (int p = 0; p < P; p++)
        CHECK_EQ_INT(kvf_sender_create(pre[p].eng, bs_addr, room, &s[p]), KVF_OK);
    for (int d = 0; d < D; d++) {
        CHECK_EQ_INT(kvf_receiver_create(dec[d].eng, bs_addr, room, -1, &r[d]), KVF_OK);
        CHECK_EQ_INT(kvf_receiver_init(r[d], dst_pages, NPAGES, 5, NULL, 0), KVF_OK);
    }
    for (int p = 0; p < P; p++) {
        if (wait_sender(s[p], KVF_POLL_WAITING_FOR_INPUT) != KVF_POLL_WAITING_FOR_INPUT)
            continue;
        CHECK_EQ_INT(kvf_sender_init(s[p], NPAGES, 3), KVF_OK);
        CHECK_EQ_INT(kvf_sender_send(s[p], src_pages, 4, 0), KVF_OK);
        CHECK_EQ_INT(kvf_sender_send(s[p], src_pages + 4, NPAGES - 4, 1), KVF_OK);
    }
    for (int p = 0; p < P; p++) {
        kvf_poll_t st = wait_sender(s[p], KVF_POLL_SUCCESS);
        CHECK_EQ_INT(st, want_ok ? KVF_POLL_SUCCESS : KVF_POLL_FAILED);
        if (!want_ok && kvf_sender_failure(s[p], &f) == KVF_OK) {
            CHECK_EQ_INT(f.status, KVF_ERR_INCOMPATIBLE);
            CHECK_STR_CONTAINS(f.reason, why);
        }
    }
    for (int d = 0; d < D; d++) {
        kvf_poll_t st = wait_receiver(r[d], KVF_POLL_SUCCESS);
        CHECK_EQ_INT(st, want_ok ? KVF_POLL_SUCCESS : KVF_POLL_FAILED);
        if (want_ok) {
            CHECK_EQ_INT(check_decode(&dec[d], dec_order, H ? NKV : LAYERS), 0);
            CHECK(memcmp(dec[d].aux + 5 * AUX_B, pre[0].aux + 3 * AUX_B, AUX_B) == 0);
        } else if (kvf_receiver_failure(r[d], &f) == KVF_OK) {
            CHECK_EQ_INT(f.status, KVF_ERR_INCOMPATIBLE);
            CHECK_STR_CONTAINS(f.reason, why);
        } else {
            CHECK(!"the decode rank has no failure record");
        }
    }
    if (kvf_test_failures_)
        fprintf(stderr, "  in: TP %d -> %d, %u heads, %s -> %s, over %s\n", P, D, H,
                pre_order == KVF_KV_HND ? "HND" : "NHD",
                dec_order == KVF_KV_HND ? "HND" : "NHD", transport);
    for (int p = 0; p < P; p++)
        kvf_sender_destroy(s[p]);
    for (int d = 0; d < D; d++) {
        kvf_receiver_destroy(r[d]);
        side_fini(&dec[d]);
    }
    for (int p = P - 1; p >= 0; p--)
        side_fini(&pre[p]);
}

/* TP pairings with GQA heads: 4 heads split and gathered, and 2 heads
 * replicated over 4 ranks (1 -> 4 slices a page's heads, 4 -> 1 takes
 * one of each pair of replicas). */
static const struct { int P, D; uint32_t H; } pairs[] = {
    {1, 2, 4}, {2, 1, 4}, {2, 4, 4}, {4, 2, 4}, {1, 4, 2}, {4, 1, 2},
};
#define NPAIRS (sizeof(pairs) / sizeof(pairs[0]))

static void test_hnd_tp_pairs_tcp(void)
{
    for (size_t i = 0; i < NPAIRS; i++)
        tp_room(pairs[i].P, pairs[i].D, pairs[i].H, KVF_KV_HND, KVF_KV_HND, "tcp", 1, NULL);
}

static void test_hnd_tp_pairs_shm(void)
{
    for (size_t i = 0; i < NPAIRS; i++)
        tp_room(pairs[i].P, pairs[i].D, pairs[i].H, KVF_KV_HND, KVF_KV_HND, "shm", 1, NULL);
}

/* The same pairs token-major: the check itself is not order-blind. */
static void test_nhd_tp_pairs_control(void)
{
    for (size_t i = 0; i < NPAIRS; i++)
        tp_room(pairs[i].P, pairs[i].D, pairs[i].H, KVF_KV_NHD, KVF_KV_NHD, "tcp", 1, NULL);
}

/* Equal TP and equal order: whole pages, in either order. */
static void test_hnd_equal_tp_whole_pages(void)
{
    tp_room(1, 1, 4, KVF_KV_HND, KVF_KV_HND, "tcp", 1, NULL);
    tp_room(2, 2, 4, KVF_KV_HND, KVF_KV_HND, "shm", 1, NULL);
}

static void test_mixed_orders_refused(void)
{
    tp_room(1, 1, 4, KVF_KV_HND, KVF_KV_NHD, "tcp", 0,
            "KV page order mismatch: prefill KV pages are HND (head-major), but decode "
            "KV pages are NHD (token-major). kvferry does not transpose pages: register "
            "both servers with the same kv_order.");
    tp_room(1, 2, 4, KVF_KV_NHD, KVF_KV_HND, "tcp", 0,
            "prefill KV pages are NHD (token-major), but decode KV pages are HND "
            "(head-major)");
    /* MLA: no heads to cut, the order means nothing. */
    tp_room(1, 2, 0, KVF_KV_HND, KVF_KV_NHD, "tcp", 1, NULL);
}

/* An order that is neither is refused at registration, naming the field. */
static void test_unknown_order_refused(void)
{
    kvf_engine_params_t p;
    kvf_engine_t *eng;
    kvf_engine_params_init(&p);
    p.role = KVF_ROLE_DECODE;
    p.transport = "tcp";
    CHECK_EQ_INT(kvf_engine_create(&p, &eng), KVF_OK);
    uint8_t *mem = calloc(PAGES, PAGE * HEAD_B);
    kvf_buffer_t kv = {mem, PAGES * PAGE * HEAD_B, PAGE * HEAD_B};
    kvf_layout_t l;
    kvf_layout_init(&l);
    l.page_size = PAGE;
    l.kv_dtype = "bfloat16";
    l.num_layers = 1;
    l.heads_per_rank = l.total_heads = 1;
    l.bytes_per_head = HEAD_B;
    l.num_kv = 1;
    l.kv = &kv;
    l.kv_order = (kvf_kv_order_t)2;
    CHECK_EQ_INT(kvf_engine_register_layout(eng, &l), KVF_ERR_INVALID_PARAM);
    CHECK_STR_CONTAINS(kvf_last_error(), "unknown kv_order 2");
    l.kv_order = KVF_KV_HND;
    CHECK_EQ_INT(kvf_engine_register_layout(eng, &l), KVF_OK);
    kvf_engine_destroy(eng);
    free(mem);
}

/* ---- hand-written peers -------------------------------------------------- */

typedef struct fake {
    wp_peer_t p;
    uint64_t  sum;                   /* XXH3 of the last DATA's payload */
} fake_t;

/* An HND layout of NKV buffers, one head of 2, as rank `rank` of TP 2. */
static void fake_init(fake_t *f, int rank)
{
    f->p.lay = (wp_layout_t){.page = PAGE, .pages = PAGES, .layers = LAYERS, .num_kv = NKV,
                             .hpr = 1, .total_heads = 2, .head_b = HEAD_B, .aux_b = AUX_B,
                             .slots = SLOTS, .tp_rank = (uint32_t)rank, .tp_size = 2,
                             .kv_order = KVF_KV_HND};
}

/* What a hand-written decode rank saw of one room. */
typedef struct fake_rx {
    int      frames, strided_frames;
    uint32_t kv_segs, max_count, min_len;
    uint64_t bytes;
    uint8_t  payload[NKV * NPAGES * PAGE * 2 * HEAD_B];
} fake_rx_t;

/*
 * A real HND prefill (TP 1, 2 heads) feeds a hand-written decode rank 1
 * of TP 2 (its second head), which accepts strided segments or (accept 0)
 * answers as a build without them.  The room's pages are src_pages ->
 * dst_pages; every DATA frame's KV segments and payload are recorded.
 */
static void fake_decode_room(side_t *pre, uint64_t room, uint32_t accept, fake_rx_t *rx)
{
    fake_t *f = calloc(1, sizeof(*f));
    kvf_msg_t m;
    kvf_sender_t *s;

    memset(rx, 0, sizeof(*rx));
    rx->min_len = UINT32_MAX;
    kvf_msg_hello_t theirs;
    fake_init(f, 1);
    wp_connect_hello(&f->p, pre->eng, &theirs);
    CHECK_EQ_INT(theirs.layout.kv_order, KVF_KV_HND);
    CHECK(wp_peer_expect(&f->p, KVF_MSG_XPORT, &m));
    wp_xport(&f->p, accept);
    kvf_msg_t req = {.type = KVF_MSG_ROOM_REQ};
    req.u.room_req.room = room;
    req.u.room_req.instance = 0x1257a9ce0000ull + room;
    req.u.room_req.dst_rank = 1;
    req.u.room_req.expected_receivers = 1;
    req.u.room_req.aux_slot = KVF_NO_SLOT;
    req.u.room_req.pages = (kvf_wire_arr32_t){NPAGES, dst_pages, NULL};
    CHECK(wp_send(f->p.fd, &req, NULL, 0));

    CHECK_EQ_INT(kvf_sender_create(pre->eng, bs_addr, room, &s), KVF_OK);
    CHECK_EQ_INT(wait_sender(s, KVF_POLL_WAITING_FOR_INPUT), KVF_POLL_WAITING_FOR_INPUT);
    CHECK_EQ_INT(kvf_sender_init(s, NPAGES, 0), KVF_OK);
    CHECK_EQ_INT(kvf_sender_send(s, src_pages, NPAGES, 1), KVF_OK);
    for (;;) {
        uint8_t h[KVF_WIRE_HDR_LEN];
        kvf_wire_hdr_t hdr;
        char err[256];
        if (!wp_read(f->p.fd, h, sizeof(h), 5000) ||
            kvf_wire_parse_header(h, &hdr, err, sizeof(err)) != KVF_OK ||
            hdr.length > sizeof(f->p.body) || !wp_read(f->p.fd, f->p.body, hdr.length, 5000) ||
            kvf_wire_decode(&hdr, f->p.body, &m, err, sizeof(err)) != KVF_OK) {
            CHECK(!"the prefill engine's stream ended before DONE");
            break;
        }
        if (m.type == KVF_MSG_DONE) {
            CHECK(m.u.done.bytes == rx->bytes);
            break;
        }
        if (m.type != KVF_MSG_DATA)
            continue;
        rx->frames++;
        rx->strided_frames += (hdr.flags & KVF_WIRE_F_STRIDED) != 0;
        for (uint32_t i = 0; i < m.u.data.nseg; i++) {
            kvf_wire_seg_t sg;
            kvf_wire_seg_at(&m.u.data, i, &sg);
            CHECK_EQ_INT(sg.kind, KVF_BUF_KV);
            rx->kv_segs++;
            rx->max_count = sg.count > rx->max_count ? sg.count : rx->max_count;
            rx->min_len = sg.len < rx->min_len ? sg.len : rx->min_len;
            /* Every piece: this rank's one head of one of its pages. */
            for (uint32_t k = 0; k < kvf_wire_seg_pieces(&sg); k++)
                CHECK((sg.offset + (uint64_t)k * sg.dst_stride) % (PAGE * HEAD_B) == 0);
        }
        CHECK(rx->bytes + m.u.data.payload_len <= sizeof(rx->payload));
        CHECK(wp_read(f->p.fd, rx->payload + rx->bytes, m.u.data.payload_len, 5000));
        rx->bytes += m.u.data.payload_len;
    }
    kvf_msg_t ack = {.type = KVF_MSG_DONE_ACK};
    ack.u.done_ack.room = room;
    ack.u.done_ack.instance = 0x1257a9ce0000ull + room;
    ack.u.done_ack.bytes = rx->bytes;
    CHECK(wp_send(f->p.fd, &ack, NULL, 0));
    CHECK_EQ_INT(wait_sender(s, KVF_POLL_SUCCESS), KVF_POLL_SUCCESS);
    kvf_sender_destroy(s);
    wp_close(&f->p);
    free(f);
}

/*
 * A decode rank that accepted strided segments gets one per run of pages
 * and KV buffer, a piece per page; one that did not gets a plain segment
 * per page.  Either way the payload is head 1 of every token of each page,
 * page after page.
 */
static void test_hnd_segments_per_page(void)
{
    side_t pre;
    static fake_rx_t plain, strided;

    side_init(&pre, KVF_ROLE_PREFILL, 0, 1, 2, KVF_KV_HND, "tcp");
    fake_decode_room(&pre, 301, 0, &plain);
    fake_decode_room(&pre, 302, KVF_CAP_STRIDED, &strided);

    CHECK(plain.frames > 0 && plain.strided_frames == 0);
    CHECK_EQ_INT(plain.kv_segs, NKV * NPAGES);
    CHECK_EQ_INT(plain.max_count, 1);
    CHECK_EQ_INT(plain.min_len, PAGE * HEAD_B);
    CHECK(strided.frames > 0 && strided.strided_frames == strided.frames);
    /* Runs (both sides consecutive): 3->7..9, 4..5 no: 10->2, 11->30, 20->31. */
    CHECK_EQ_INT(strided.kv_segs, NKV * 4);
    CHECK_EQ_INT(strided.max_count, 3);
    CHECK_EQ_INT(strided.min_len, PAGE * HEAD_B);
    CHECK(plain.bytes == strided.bytes && plain.bytes == NKV * NPAGES * PAGE * HEAD_B);
    CHECK(memcmp(plain.payload, strided.payload, plain.bytes) == 0);
    size_t bad = 0;
    for (uint32_t b = 0; b < NKV; b++)
        for (uint32_t i = 0; i < NPAGES; i++)
            for (uint32_t t = 0; t < PAGE; t++)
                for (uint32_t j = 0; j < HEAD_B; j++)
                    bad += strided.payload[((b * NPAGES + i) * PAGE + t) * HEAD_B + j] !=
                           kv_byte(b, 1, src_pages[i], t, j);
    CHECK_EQ_INT(bad, 0);
    side_fini(&pre);
}

/* A hand-written prefill rank `rank` of TP 2 (one head of 2), listening
 * and registered in the registry at bs. */
static void fake_prefill_listen(fake_t *f, int rank, const char *bs)
{
    fake_init(f, rank);
    wp_listen(&f->p);
    wp_register(&f->p, bs);
}

/* Take the decode engine's connection; handshake, offering strided segments. */
static void fake_prefill_accept(fake_t *f)
{
    kvf_msg_t m;
    kvf_msg_hello_t theirs;
    wp_accept_hello(&f->p, &theirs);
    CHECK_EQ_INT(theirs.layout.kv_order, KVF_KV_HND);
    wp_xport(&f->p, KVF_CAP_STRIDED);
    CHECK(wp_peer_expect(&f->p, KVF_MSG_XPORT, &m));
}

/* DATA for `room` from f: the segments, and as many payload bytes, each a
 * function of its position and `salt` (f->sum their checksum). */
static void fake_data(fake_t *f, uint64_t room, const kvf_wire_seg_t *segs, uint32_t n,
                      int salt)
{
    static uint8_t payload[NKV * NPAGES * PAGE * 2 * HEAD_B + 4096];
    uint64_t bytes = 0;
    for (uint32_t i = 0; i < n; i++)
        bytes += kvf_wire_seg_bytes(&segs[i]);
    CHECK(bytes <= sizeof(payload));
    for (size_t i = 0; i < bytes && i < sizeof(payload); i++)
        payload[i] = (uint8_t)(i * 31 + 7 + salt * 101);
    kvf_msg_t m = {.type = KVF_MSG_DATA};
    m.u.data.room = room;
    m.u.data.instance = f->p.inst[room % 256];
    m.u.data.src_rank = (uint32_t)f->p.lay.tp_rank;
    m.u.data.payload_len = bytes;
    m.u.data.nseg = n;
    m.u.data.segs = segs;
    m.u.data.strided = 1;
    f->sum = XXH3_64bits(payload, bytes);
    CHECK(wp_send(f->p.fd, &m, payload, bytes));
}

/* DONE after one DATA frame: its bytes and checksum. */
static void fake_done(fake_t *f, uint64_t room, uint64_t bytes)
{
    kvf_msg_t m = {.type = KVF_MSG_DONE};
    m.u.done.room = room;
    m.u.done.instance = f->p.inst[room % 256];
    m.u.done.src_rank = (uint32_t)f->p.lay.tp_rank;
    m.u.done.bytes = bytes;
    m.u.done.has_checksum = 1;
    m.u.done.checksum = f->sum;
    CHECK(wp_send(f->p.fd, &m, NULL, 0));
}

#define SEG(buf, off, len, count, dstr, sstr) \
    ((kvf_wire_seg_t){KVF_BUF_KV, (buf), (off), (len), (count), (dstr), (sstr)})

/*
 * A real HND decode engine (TP 1, 2 heads) fed by two hand-written HND
 * prefill ranks (TP 2, a head each).  Good pieces (each rank's head of
 * each page, as strided segments) land where they must; a piece at the
 * other rank's head, a piece of both heads, or a page sent twice fails its
 * room with the reason, and nothing of that frame is placed.
 */
static void test_hostile_hnd_segments(void)
{
    enum { R_GOOD, R_HEAD, R_LONG, R_TWICE, NR };
    static const uint32_t page[NR][2] = {{5, 6}, {9, 10}, {13, 14}, {17, 18}};
    const uint64_t pb = 2 * PAGE * HEAD_B, hb = PAGE * HEAD_B;   /* page, one head */
    kvf_bootstrap_t *bs;
    fake_t *f[2];
    side_t dec;
    kvf_receiver_t *r[NR];
    kvf_msg_t m;
    char addr[64];

    CHECK_EQ_INT(kvf_bootstrap_create("127.0.0.1", 0, &bs), KVF_OK);
    snprintf(addr, sizeof(addr), "127.0.0.1:%d", kvf_bootstrap_port(bs));
    for (int k = 0; k < 2; k++) {
        f[k] = calloc(1, sizeof(fake_t));
        fake_prefill_listen(f[k], k, addr);
    }
    side_init(&dec, KVF_ROLE_DECODE, 0, 1, 2, KVF_KV_HND, "tcp");
    for (int i = 0; i < NR; i++) {
        CHECK_EQ_INT(kvf_receiver_create(dec.eng, addr, 40 + (uint64_t)i, -1, &r[i]),
                     KVF_OK);
        CHECK_EQ_INT(kvf_receiver_init(r[i], page[i], 2, (uint32_t)i, NULL, 0), KVF_OK);
    }
    for (int k = 0; k < 2; k++)
        fake_prefill_accept(f[k]);
    for (int k = 0; k < 2; k++)
        for (int i = 0; i < NR; i++)
            CHECK(wp_peer_expect(&f[k]->p, KVF_MSG_ROOM_REQ, &m));

    /* Good: rank k's head of both pages of every buffer, a strided segment
     * each (a piece per page), plus aux from the rank asked for it. */
    uint64_t link_bytes[2] = {0, 0};
    for (int k = 0; k < 2; k++) {
        kvf_wire_seg_t good[NKV + 1];
        uint32_t n = 0;
        for (uint32_t b = 0; b < NKV; b++)
            good[n++] = SEG(b, page[R_GOOD][0] * pb + (uint64_t)k * hb, (uint32_t)hb, 2, pb,
                            hb);
        if (f[k]->p.aux_slot[40 + R_GOOD] != KVF_NO_SLOT)
            good[n++] = (kvf_wire_seg_t){KVF_BUF_AUX, 0,
                                         f[k]->p.aux_slot[40 + R_GOOD] * (uint64_t)AUX_B,
                                         AUX_B, 1, 0, 0};
        fake_data(f[k], 40 + R_GOOD, good, n, k);
        for (uint32_t i = 0; i < n; i++)
            link_bytes[k] += kvf_wire_seg_bytes(&good[i]);
        fake_done(f[k], 40 + R_GOOD, link_bytes[k]);
    }
    CHECK_EQ_INT(wait_receiver(r[R_GOOD], KVF_POLL_SUCCESS), KVF_POLL_SUCCESS);
    /* Rank k's payload: buffer after buffer, page after page, its head's
     * PAGE tokens each, at head k of the page. */
    size_t bad = 0;
    for (int k = 0; k < 2; k++)
        for (uint32_t b = 0; b < NKV; b++)
            for (uint32_t i = 0; i < 2; i++)
                for (uint64_t x = 0; x < hb; x++) {
                    size_t at = ((size_t)b * 2 + i) * hb + x;
                    bad += dec.kv[b][page[R_GOOD][i] * pb + (uint64_t)k * hb + x] !=
                           (uint8_t)(at * 31 + 7 + (size_t)k * 101);
                }
    CHECK_EQ_INT(bad, 0);

    /* Rank 1 sends its bytes at head 0 of the page: rank 0's. */
    kvf_wire_seg_t head = SEG(0, page[R_HEAD][0] * pb, (uint32_t)hb, 2, pb, hb);
    fake_data(f[1], 40 + R_HEAD, &head, 1, 1);
    check_recv_failed(r[R_HEAD], KVF_ERR_PROTOCOL, "segment 0: bytes [",
                  "of KV buffer 0 are not this peer's heads of one page (HND pages)");
    CHECK(all_zero(dec.kv[0] + page[R_HEAD][0] * pb, 2 * pb));

    /* Rank 0 sends both heads of a page (the whole page): more than its head. */
    kvf_wire_seg_t lng[2] = {SEG(1, page[R_LONG][0] * pb, (uint32_t)hb, 1, 0, 0),
                             SEG(0, page[R_LONG][0] * pb, (uint32_t)pb, 1, 0, 0)};
    fake_data(f[0], 40 + R_LONG, lng, 2, 0);
    check_recv_failed(r[R_LONG], KVF_ERR_PROTOCOL, "segment 1: bytes [",
                  "are not this peer's heads of one page");
    CHECK(all_zero(dec.kv[0] + page[R_LONG][0] * pb, 2 * pb));
    CHECK(all_zero(dec.kv[1] + page[R_LONG][0] * pb, 2 * pb));

    /* Rank 1 sends its head of a page, then the same again. */
    kvf_wire_seg_t once = SEG(2, page[R_TWICE][1] * pb + hb, (uint32_t)hb, 1, 0, 0);
    fake_data(f[1], 40 + R_TWICE, &once, 1, 1);
    kvf_wire_seg_t twice[2] = {SEG(3, page[R_TWICE][0] * pb + hb, (uint32_t)hb, 1, 0, 0),
                               SEG(2, page[R_TWICE][0] * pb + hb, (uint32_t)hb, 2, pb, hb)};
    fake_data(f[1], 40 + R_TWICE, twice, 2, 2);
    check_recv_failed(r[R_TWICE], KVF_ERR_PROTOCOL, "token 0 of page 18 of KV buffer 2 (this "
                  "peer's heads of the page: bytes", "is written a second time");
    CHECK(all_zero(dec.kv[3] + page[R_TWICE][0] * pb, 2 * pb));
    CHECK(all_zero(dec.kv[2] + page[R_TWICE][0] * pb, pb));

    for (int i = 0; i < NR; i++)
        kvf_receiver_destroy(r[i]);
    side_fini(&dec);
    for (int k = 0; k < 2; k++) {
        wp_close(&f[k]->p);
        free(f[k]);
    }
    kvf_bootstrap_destroy(bs);
}

KVF_TEST_MAIN(KVF_CASE(test_hnd_tp_pairs_tcp), KVF_CASE(test_hnd_tp_pairs_shm),
              KVF_CASE(test_nhd_tp_pairs_control), KVF_CASE(test_hnd_equal_tp_whole_pages),
              KVF_CASE(test_mixed_orders_refused), KVF_CASE(test_unknown_order_refused),
              KVF_CASE(test_hnd_segments_per_page), KVF_CASE(test_hostile_hnd_segments))
