/*
 * Room trust: peers that hold the cluster token but are wrong (a stale
 * retry, a buggy or hostile rank).  Real engines beside hand-written peers
 * that authenticate and speak the real protocol (kvf_wire_peer.h): a
 * room's messages count only from the peer it is bound to and only when
 * they name the room's instance; a second request for a bound room is
 * refused and its sender told; a room id reused right after a failure
 * gets the new room's bytes, never the old room's bytes or failure.
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
#include "util/time.h"
#include "wire/wire.h"

#define PAGES 64
#include "unit/kvf_sides.h"

/* Room messages an engine dropped as not its rooms' (room.c). */
static uint64_t dropped(kvf_engine_t *eng) { return engine_stats(eng).room_msgs_dropped; }


/* What an engine's stash (room messages before their room) holds. */
typedef struct stash_arg {
    kvf_engine_t *eng;
    uint64_t      id;
    size_t        n;
} stash_arg_t;

static int stash_holds_any(const void *arg)
{
    kvf_engine_t *eng = (kvf_engine_t *)arg;
    kvf__lock(eng);
    size_t n = eng->stash.count;
    kvf__unlock(eng);
    return n > 0;
}

/* The stash kept or dropped n messages. */
static int stash_took(const void *arg)
{
    const stash_arg_t *a = arg;
    kvf__lock(a->eng);
    size_t count = a->eng->stash_count;
    kvf__unlock(a->eng);
    return count + engine_stats(a->eng).stash_dropped >= a->n;
}

static int stash_has_room(const void *arg)
{
    const stash_arg_t *a = arg;
    kvf__lock(a->eng);
    int there = kvf_map_get(&a->eng->stash, a->id) != NULL;
    kvf__unlock(a->eng);
    return there;
}

/* ---- a hand-written engine on a plain socket -------------------------- */

typedef wp_peer_t fake_t;

/* A prefill rank with the layout side_init registers (rank 0 of TP 1). */
static void fake_init(fake_t *f)
{
    f->lay = (wp_layout_t){.page = PAGE, .pages = PAGES, .layers = LAYERS, .num_kv = NKV,
                           .hpr = HEADS, .total_heads = HEADS, .head_b = HEAD_B,
                           .aux_b = AUX_B, .slots = SLOTS, .tp_size = 1};
}

/* A fake prefill rank listening, registered in a fresh registry; *bs_p
 * the registry, its address in bs. */
static void fake_prefill_listen(fake_t *f, kvf_bootstrap_t **bs_p, char *bs, size_t len)
{
    fake_init(f);
    wp_listen(f);
    CHECK_EQ_INT(kvf_bootstrap_create("127.0.0.1", 0, bs_p), KVF_OK);
    snprintf(bs, len, "127.0.0.1:%d", kvf_bootstrap_port(*bs_p));
    wp_register(f, bs);
}

/* A fake decode rank connected to a real prefill engine, handshake done. */
static void fake_decode_connect(fake_t *f, kvf_engine_t *pre)
{
    fake_init(f);
    wp_connect_prefill(f, pre);
}

/* One page per KV buffer and the aux slot, as a sender of `pattern` writes
 * them: DATA (NKV + 1 segments and their payload), then DONE. */
#define ROOM_BYTES (NKV * PAGE_B + AUX_B)

static uint8_t pat(int pattern, size_t i) { return (uint8_t)(i * 31 + 7 + pattern * 101); }

static void fake_room_data(fake_t *f, uint64_t room, uint64_t inst, uint32_t page,
                           uint32_t slot, int pattern, int with_done)
{
    static uint8_t payload[ROOM_BYTES];
    kvf_wire_seg_t segs[NKV + 1];
    for (int b = 0; b < NKV; b++)
        segs[b] = (kvf_wire_seg_t){KVF_BUF_KV, (uint32_t)b, (uint64_t)page * PAGE_B, PAGE_B,
                                   1, 0, 0};
    segs[NKV] = (kvf_wire_seg_t){KVF_BUF_AUX, 0, (uint64_t)slot * AUX_B, AUX_B, 1, 0, 0};
    for (size_t i = 0; i < ROOM_BYTES; i++)
        payload[i] = pat(pattern, i);
    kvf_msg_t m = {.type = KVF_MSG_DATA};
    m.u.data.room = room;
    m.u.data.instance = inst;
    m.u.data.payload_len = ROOM_BYTES;
    m.u.data.nseg = NKV + 1;
    m.u.data.segs = segs;
    wp_peer_send(f, &m, payload, ROOM_BYTES);
    if (!with_done)
        return;
    kvf_msg_t d = {.type = KVF_MSG_DONE};
    d.u.done.room = room;
    d.u.done.instance = inst;
    d.u.done.bytes = ROOM_BYTES;
    wp_peer_send(f, &d, NULL, 0);
}

/* Did the receiver's page and slot get exactly pattern's bytes? */
static int room_bytes_are(const side_t *dec, uint32_t page, uint32_t slot, int pattern)
{
    for (int b = 0; b < NKV; b++)
        for (size_t i = 0; i < PAGE_B; i++)
            if (dec->kv[b][(size_t)page * PAGE_B + i] != pat(pattern, (size_t)b * PAGE_B + i))
                return 0;
    for (size_t i = 0; i < AUX_B; i++)
        if (dec->aux[(size_t)slot * AUX_B + i] != pat(pattern, NKV * PAGE_B + i))
            return 0;
    return 1;
}

static int page_is_zero(const side_t *dec, uint32_t page)
{
    for (int b = 0; b < NKV; b++)
        for (size_t i = 0; i < PAGE_B; i++)
            if (dec->kv[b][(size_t)page * PAGE_B + i] != 0)
                return 0;
    return 1;
}

static kvf_msg_t fail_msg(uint64_t room, uint64_t inst, const char *reason)
{
    kvf_msg_t m = {.type = KVF_MSG_FAIL};
    m.u.fail.room = room;
    m.u.fail.instance = inst;
    m.u.fail.status = KVF_ERR_TIMED_OUT;
    m.u.fail.origin_side = KVF_ROLE_PREFILL;
    m.u.fail.origin_addr = (kvf_wire_str_t){"x:1", 3};
    m.u.fail.reason = (kvf_wire_str_t){reason, (uint32_t)strlen(reason)};
    return m;
}

/*
 * Decode side.  Room 1 is asked of prefill A, room 2 of prefill B (two
 * registries).  B, bound only to room 2, sends room 1 DATA, DONE,
 * DONE_ACK and FAIL naming room 1's real instance; A sends room 1 frames
 * naming another instance: every one is dropped, room 1 stays live and
 * untouched, and then succeeds byte for byte on A's right frames.
 */
static void test_receiver_takes_only_its_peer_and_instance(void)
{
    fake_t *a = calloc(1, sizeof(*a)), *b = calloc(1, sizeof(*b));
    kvf_bootstrap_t *bsa, *bsb;
    char addr_a[64], addr_b[64];
    side_t dec;
    kvf_msg_t m;
    kvf_receiver_t *r1, *r2;
    uint32_t p1 = 5, p2 = 9;

    fake_prefill_listen(a, &bsa, addr_a, sizeof(addr_a));
    fake_prefill_listen(b, &bsb, addr_b, sizeof(addr_b));
    side_init(&dec, KVF_ROLE_DECODE, addr_a, NULL);
    CHECK_EQ_INT(kvf_receiver_create(dec.eng, addr_a, 1, -1, &r1), KVF_OK);
    CHECK_EQ_INT(kvf_receiver_init(r1, &p1, 1, 1, NULL, 0), KVF_OK);
    wp_accept_decode(a, 0);
    CHECK(wp_peer_expect(a, KVF_MSG_ROOM_REQ, &m) && m.u.room_req.room == 1);
    uint64_t inst1 = m.u.room_req.instance;
    CHECK(inst1 != 0);
    CHECK_EQ_INT(kvf_receiver_create(dec.eng, addr_b, 2, -1, &r2), KVF_OK);
    CHECK_EQ_INT(kvf_receiver_init(r2, &p2, 1, 2, NULL, 0), KVF_OK);
    wp_accept_decode(b, 0);
    CHECK(wp_peer_expect(b, KVF_MSG_ROOM_REQ, &m) && m.u.room_req.room == 2);
    CHECK(m.u.room_req.instance != 0 && m.u.room_req.instance != inst1);
    CHECK_EQ_INT(wait_receiver(r1, KVF_POLL_WAITING_FOR_INPUT), KVF_POLL_WAITING_FOR_INPUT);

    /* B is not room 1's peer, whatever instance it names. */
    uint64_t before = dropped(dec.eng);
    fake_room_data(b, 1, inst1, p1, 1, 9, 1);
    kvf_msg_t ack = {.type = KVF_MSG_DONE_ACK};
    ack.u.done_ack.room = 1;
    ack.u.done_ack.instance = inst1;
    wp_peer_send(b, &ack, NULL, 0);
    kvf_msg_t fail = fail_msg(1, inst1, "a hostile rank says room 1 failed");
    wp_peer_send(b, &fail, NULL, 0);
    /* A, room 1's peer, naming another instance of room 1. */
    fake_room_data(a, 1, inst1 ^ 1, p1, 1, 8, 1);
    fail = fail_msg(1, inst1 + 1, "an earlier room 1 failed");
    wp_peer_send(a, &fail, NULL, 0);
    /* Room 2's own frames from B, after all of that: B is room 2's peer. */
    fake_room_data(b, 2, m.u.room_req.instance, p2, 2, 2, 1);
    CHECK_EQ_INT(wait_receiver(r2, KVF_POLL_SUCCESS), KVF_POLL_SUCCESS);
    CHECK(room_bytes_are(&dec, p2, 2, 2));
    CHECK(wait_dropped(dec.eng, before + 7, 5000));
    CHECK_EQ_INT(kvf_receiver_poll(r1), KVF_POLL_WAITING_FOR_INPUT);
    CHECK(page_is_zero(&dec, p1));

    /* And room 1 gets its own bytes from its own peer. */
    fake_room_data(a, 1, inst1, p1, 1, 1, 1);
    CHECK_EQ_INT(wait_receiver(r1, KVF_POLL_SUCCESS), KVF_POLL_SUCCESS);
    CHECK(room_bytes_are(&dec, p1, 1, 1));
    CHECK(wp_peer_expect(a, KVF_MSG_DONE_ACK, &m) && m.u.done_ack.room == 1 &&
          m.u.done_ack.instance == inst1 && m.u.done_ack.status == KVF_OK);

    kvf_receiver_destroy(r1);
    kvf_receiver_destroy(r2);
    side_fini(&dec);
    wp_close(a);
    wp_close(b);
    free(a);
    free(b);
    kvf_bootstrap_destroy(bsa);
    kvf_bootstrap_destroy(bsb);
}

/*
 * A room id reused right after a failure, while the old room's frames are
 * still in flight: room 7 fails (aborted here), a new receiver for room 7
 * asks again with a fresh instance, and the old room's DATA, DONE and FAIL
 * arrive only then, followed by the new room's.  The new room gets the new
 * bytes, byte for byte, and neither the old bytes nor the old failure.
 */
static void test_reused_id_gets_only_its_own_frames(void)
{
    fake_t *a = calloc(1, sizeof(*a));
    kvf_bootstrap_t *bs;
    char addr[64];
    side_t dec;
    kvf_msg_t m;
    kvf_receiver_t *r;
    uint32_t page = 12;
    kvf_failure_t f;
    kvf_failure_init(&f);

    fake_prefill_listen(a, &bs, addr, sizeof(addr));
    side_init(&dec, KVF_ROLE_DECODE, addr, NULL);
    CHECK_EQ_INT(kvf_receiver_create(dec.eng, addr, 7, -1, &r), KVF_OK);
    CHECK_EQ_INT(kvf_receiver_init(r, &page, 1, 3, NULL, 0), KVF_OK);
    wp_accept_decode(a, 0);
    CHECK(wp_peer_expect(a, KVF_MSG_ROOM_REQ, &m) && m.u.room_req.room == 7);
    uint64_t old = m.u.room_req.instance;
    kvf_receiver_abort(r);
    CHECK(wp_peer_expect(a, KVF_MSG_ABORT, &m) && m.u.fail.room == 7 &&
          m.u.fail.instance == old);
    CHECK_EQ_INT(kvf_receiver_poll(r), KVF_POLL_FAILED);
    kvf_receiver_destroy(r);

    CHECK_EQ_INT(kvf_receiver_create(dec.eng, addr, 7, -1, &r), KVF_OK);
    CHECK_EQ_INT(kvf_receiver_init(r, &page, 1, 3, NULL, 0), KVF_OK);
    CHECK(wp_peer_expect(a, KVF_MSG_ROOM_REQ, &m) && m.u.room_req.room == 7);
    uint64_t fresh = m.u.room_req.instance;
    CHECK(fresh != 0 && fresh != old);
    CHECK_EQ_INT(m.u.room_req.attempt, 0);

    /* The old room's frames, still in flight, then the new room's. */
    fake_room_data(a, 7, old, page, 3, 6, 1);
    kvf_msg_t fail = fail_msg(7, old, "the old room 7 timed out");
    wp_peer_send(a, &fail, NULL, 0);
    fake_room_data(a, 7, fresh, page, 3, 1, 1);
    CHECK_EQ_INT(wait_receiver(r, KVF_POLL_SUCCESS), KVF_POLL_SUCCESS);
    CHECK(room_bytes_are(&dec, page, 3, 1));
    CHECK_EQ_INT(kvf_receiver_failure(r, &f), KVF_ERR_AGAIN);
    kvf_engine_stats_t st;
    kvf_engine_stats_init(&st);
    kvf_engine_stats(dec.eng, &st);
    CHECK(st.bytes_received == ROOM_BYTES);

    kvf_receiver_destroy(r);
    side_fini(&dec);
    wp_close(a);
    free(a);
    kvf_bootstrap_destroy(bs);
}

/*
 * The same with real engines over the fault transport: every put of the
 * prefill engine is held (delay), so the first room's chunk is still in
 * flight when the room fails on both sides; the application destroys
 * both and asks again at once with the same id, the decode side first
 * (its request reaches the prefill engine before the new sender exists,
 * right after the old one was destroyed failed).  The new room succeeds
 * byte for byte with the new source pages.
 */
static void puts_held(kvf_engine_params_t *p) { p->faults = "delay@0:300"; }

static void test_reused_id_real_engines(void)
{
    side_t pre, dec;
    char bs[64];
    kvf_sender_t *s;
    kvf_receiver_t *r;
    uint32_t dst = 20, src1 = 3, src2 = 4;
    kvf_failure_t f;
    kvf_failure_init(&f);

    side_tune = puts_held;
    side_init(&pre, KVF_ROLE_PREFILL, "127.0.0.1:0", NULL);
    side_tune = NULL;
    CHECK_EQ_INT(kvf_engine_bootstrap_addr(pre.eng, bs, sizeof(bs)), KVF_OK);
    side_init(&dec, KVF_ROLE_DECODE, NULL, NULL);
    for (int b = 0; b < NKV; b++)
        for (size_t i = 0; i < PAGE_B; i++) {
            pre.kv[b][src1 * PAGE_B + i] = 0xee;
            pre.kv[b][src2 * PAGE_B + i] = (uint8_t)(i * 5 + b + 1);
        }
    memset(pre.aux + 1 * AUX_B, 0xee, AUX_B);
    memcpy(pre.aux + 2 * AUX_B, "the-second-room!", AUX_B);

    CHECK_EQ_INT(kvf_sender_create(pre.eng, bs, 77, &s), KVF_OK);
    CHECK_EQ_INT(kvf_receiver_create(dec.eng, bs, 77, -1, &r), KVF_OK);
    CHECK_EQ_INT(kvf_receiver_init(r, &dst, 1, 0, NULL, 0), KVF_OK);
    CHECK_EQ_INT(wait_sender(s, KVF_POLL_WAITING_FOR_INPUT), KVF_POLL_WAITING_FOR_INPUT);
    CHECK_EQ_INT(kvf_sender_init(s, 1, 1), KVF_OK);
    CHECK_EQ_INT(kvf_sender_send(s, &src1, 1, 1), KVF_OK);   /* held 300 ms */
    kvf_sender_abort(s);
    CHECK_EQ_INT(wait_receiver(r, KVF_POLL_SUCCESS), KVF_POLL_FAILED);
    CHECK_EQ_INT(kvf_sender_poll(s), KVF_POLL_FAILED);
    kvf_sender_destroy(s);
    kvf_receiver_destroy(r);

    CHECK_EQ_INT(kvf_receiver_create(dec.eng, bs, 77, -1, &r), KVF_OK);
    CHECK_EQ_INT(kvf_receiver_init(r, &dst, 1, 0, NULL, 0), KVF_OK);
    CHECK_EQ_INT(wait_receiver(r, KVF_POLL_WAITING_FOR_INPUT), KVF_POLL_WAITING_FOR_INPUT);
    /* Its request is at the prefill engine before the sender exists. */
    wait_until(stash_holds_any, pre.eng, 5000);
    CHECK_EQ_INT(kvf_receiver_poll(r), KVF_POLL_WAITING_FOR_INPUT);
    CHECK_EQ_INT(kvf_sender_create(pre.eng, bs, 77, &s), KVF_OK);
    CHECK_EQ_INT(wait_sender(s, KVF_POLL_WAITING_FOR_INPUT), KVF_POLL_WAITING_FOR_INPUT);
    CHECK_EQ_INT(kvf_sender_init(s, 1, 2), KVF_OK);
    CHECK_EQ_INT(kvf_sender_send(s, &src2, 1, 1), KVF_OK);
    CHECK_EQ_INT(wait_receiver(r, KVF_POLL_SUCCESS), KVF_POLL_SUCCESS);
    CHECK_EQ_INT(wait_sender(s, KVF_POLL_SUCCESS), KVF_POLL_SUCCESS);
    for (int b = 0; b < NKV; b++)
        CHECK(memcmp(dec.kv[b] + dst * PAGE_B, pre.kv[b] + src2 * PAGE_B, PAGE_B) == 0);
    CHECK(memcmp(dec.aux, "the-second-room!", AUX_B) == 0);
    CHECK_EQ_INT(kvf_receiver_failure(r, &f), KVF_ERR_AGAIN);
    kvf_sender_destroy(s);
    kvf_receiver_destroy(r);
    side_fini(&dec);
    side_fini(&pre);
}

/* DATA for `room` with the given segments and pattern-0 payload. */
static void fake_segs(fake_t *f, uint64_t room, uint64_t inst, const kvf_wire_seg_t *segs,
                      uint32_t n, int strided)
{
    static uint8_t payload[4 * ROOM_BYTES];
    uint64_t bytes = 0;
    for (uint32_t i = 0; i < n; i++)
        bytes += kvf_wire_seg_bytes(&segs[i]);
    CHECK(bytes <= sizeof(payload));
    for (size_t i = 0; i < bytes; i++)
        payload[i] = pat(0, i);
    kvf_msg_t m = {.type = KVF_MSG_DATA};
    m.u.data.room = room;
    m.u.data.instance = inst;
    m.u.data.payload_len = bytes;
    m.u.data.nseg = n;
    m.u.data.segs = segs;
    m.u.data.strided = (uint8_t)strided;
    wp_peer_send(f, &m, payload, bytes);
}

static void fake_done(fake_t *f, uint64_t room, uint64_t inst, uint64_t bytes)
{
    kvf_msg_t d = {.type = KVF_MSG_DONE};
    d.u.done.room = room;
    d.u.done.instance = inst;
    d.u.done.bytes = bytes;
    wp_peer_send(f, &d, NULL, 0);
}

#define KV(b, off, len, cnt, str) \
    ((kvf_wire_seg_t){KVF_BUF_KV, (b), (off), (len), (cnt), (str), (str)})

/*
 * Exact coverage.  A peer bound to the room sends the right total of
 * bytes but places some destination bytes twice and leaves others out:
 * room 300 gets page 20 of every KV buffer twice and page 21 never; room
 * 301 gets token 2 of page 30 in buffer 1 twice (a strided segment, then a
 * plain one) and token 3 never; room 302 a piece that is not whole tokens.
 * Each fails with KVF_ERR_PROTOCOL and a reason naming what was repeated,
 * before DONE could call it complete; nothing of the offending frame is
 * placed.  Room 303, sent right, succeeds byte for byte.
 */
static void test_each_byte_counts_once(void)
{
    enum { NR = 4 };
    static const uint32_t pages[NR][2] = {{20, 21}, {30, 0}, {40, 0}, {50, 51}};
    static const uint32_t npages[NR] = {2, 1, 1, 2};
    const uint64_t tok = PAGE_B / PAGE;
    fake_t *a = calloc(1, sizeof(*a));
    kvf_bootstrap_t *bs;
    char addr[64];
    side_t dec;
    kvf_msg_t m;
    kvf_receiver_t *r[NR];
    uint64_t inst[NR] = {0};
    kvf_failure_t f;
    kvf_failure_init(&f);

    fake_prefill_listen(a, &bs, addr, sizeof(addr));
    side_init(&dec, KVF_ROLE_DECODE, addr, NULL);
    for (int i = 0; i < NR; i++) {
        CHECK_EQ_INT(kvf_receiver_create(dec.eng, addr, 300 + (uint64_t)i, -1, &r[i]),
                     KVF_OK);
        CHECK_EQ_INT(kvf_receiver_init(r[i], pages[i], npages[i], (uint32_t)i, NULL, 0),
                     KVF_OK);
    }
    wp_accept_decode(a, KVF_CAP_STRIDED);
    for (int i = 0; i < NR; i++) {
        CHECK(wp_peer_expect(a, KVF_MSG_ROOM_REQ, &m) && m.u.room_req.room - 300 < NR);
        inst[(m.u.room_req.room - 300) % NR] = m.u.room_req.instance;
    }

    /* Room 300: page 20 twice per buffer, page 21 never; the total is right. */
    kvf_wire_seg_t s1[2 * NKV + 1];
    for (int b = 0; b < NKV; b++) {
        s1[2 * b] = KV((uint32_t)b, 20 * (uint64_t)PAGE_B, PAGE_B, 1, 0);
        s1[2 * b + 1] = KV((uint32_t)b, 20 * (uint64_t)PAGE_B, PAGE_B, 1, 0);
    }
    s1[2 * NKV] = (kvf_wire_seg_t){KVF_BUF_AUX, 0, 0 * AUX_B, AUX_B, 1, 0, 0};
    fake_segs(a, 300, inst[0], s1, 2 * NKV + 1, 0);
    fake_done(a, 300, inst[0], 2 * NKV * PAGE_B + AUX_B);
    CHECK_EQ_INT(wait_receiver(r[0], KVF_POLL_SUCCESS), KVF_POLL_FAILED);
    CHECK_EQ_INT(kvf_receiver_failure(r[0], &f), KVF_OK);
    CHECK_EQ_INT(f.status, KVF_ERR_PROTOCOL);
    CHECK_STR_CONTAINS(f.reason, "segment 1: token 0 of page 20 of KV buffer 0");
    CHECK_STR_CONTAINS(f.reason, "written a second time");
    CHECK(page_is_zero(&dec, 20) && page_is_zero(&dec, 21));

    /* Room 301, strided: buffer 1's tokens 0..2, then token 2 again. */
    kvf_wire_seg_t s2[NKV + 2];
    for (int b = 0; b < NKV; b++)
        s2[b] = b == 1 ? KV(1, 30 * (uint64_t)PAGE_B, (uint32_t)tok, 3, tok)
                       : KV((uint32_t)b, 30 * (uint64_t)PAGE_B, (uint32_t)tok, PAGE, tok);
    s2[NKV] = KV(1, 30 * (uint64_t)PAGE_B + 2 * tok, (uint32_t)tok, 1, 0);
    s2[NKV + 1] = (kvf_wire_seg_t){KVF_BUF_AUX, 0, 1 * AUX_B, AUX_B, 1, 0, 0};
    fake_segs(a, 301, inst[1], s2, NKV + 2, 1);
    fake_done(a, 301, inst[1], NKV * PAGE_B + AUX_B);
    CHECK_EQ_INT(wait_receiver(r[1], KVF_POLL_SUCCESS), KVF_POLL_FAILED);
    CHECK_EQ_INT(kvf_receiver_failure(r[1], &f), KVF_OK);
    CHECK_EQ_INT(f.status, KVF_ERR_PROTOCOL);
    CHECK_STR_CONTAINS(f.reason, "token 2 of page 30 of KV buffer 1");
    CHECK(page_is_zero(&dec, 30));

    /* Room 302: half a token. */
    kvf_wire_seg_t s3 = KV(0, 40 * (uint64_t)PAGE_B + tok / 2, (uint32_t)tok, 1, 0);
    fake_segs(a, 302, inst[2], &s3, 1, 0);
    CHECK_EQ_INT(wait_receiver(r[2], KVF_POLL_SUCCESS), KVF_POLL_FAILED);
    CHECK_EQ_INT(kvf_receiver_failure(r[2], &f), KVF_OK);
    CHECK_EQ_INT(f.status, KVF_ERR_PROTOCOL);
    CHECK_STR_CONTAINS(f.reason, "are not whole tokens");

    /* Room 303, right: two pages in one segment per buffer, and aux. */
    kvf_wire_seg_t s4[NKV + 1];
    for (int b = 0; b < NKV; b++)
        s4[b] = KV((uint32_t)b, 50 * (uint64_t)PAGE_B, 2 * PAGE_B, 1, 0);
    s4[NKV] = (kvf_wire_seg_t){KVF_BUF_AUX, 0, 3 * AUX_B, AUX_B, 1, 0, 0};
    fake_segs(a, 303, inst[3], s4, NKV + 1, 0);
    fake_done(a, 303, inst[3], 2 * NKV * PAGE_B + AUX_B);
    CHECK_EQ_INT(wait_receiver(r[3], KVF_POLL_SUCCESS), KVF_POLL_SUCCESS);
    int same = 1;
    for (int b = 0; b < NKV; b++)
        for (size_t i = 0; i < 2 * PAGE_B; i++)
            same &= dec.kv[b][50 * PAGE_B + i] == pat(0, (size_t)b * 2 * PAGE_B + i);
    CHECK(same);

    for (int i = 0; i < NR; i++)
        kvf_receiver_destroy(r[i]);
    side_fini(&dec);
    wp_close(a);
    free(a);
    kvf_bootstrap_destroy(bs);
}

/* A real sender for room `id`, one page from src, aux slot 1. */
static kvf_sender_t *sender(side_t *pre, uint64_t id)
{
    kvf_sender_t *s;
    char bs[64];
    CHECK_EQ_INT(kvf_engine_bootstrap_addr(pre->eng, bs, sizeof(bs)), KVF_OK);
    CHECK_EQ_INT(kvf_sender_create(pre->eng, bs, id, &s), KVF_OK);
    return s;
}

static kvf_msg_t room_req(uint64_t room, uint64_t inst, const uint32_t *page)
{
    kvf_msg_t m = {.type = KVF_MSG_ROOM_REQ};
    m.u.room_req.room = room;
    m.u.room_req.instance = inst;
    m.u.room_req.expected_receivers = 1;
    m.u.room_req.aux_slot = 1;
    m.u.room_req.pages = (kvf_wire_arr32_t){1, page, NULL};
    return m;
}

/*
 * Prefill side, a verdict said again (docs/PROTOCOL.md, "A verdict lost
 * with its connection").  Decode rank D binds room 11 (instance A) and is
 * sent every byte and the DONE; its connection closes before it answers.
 * E, another decode engine, then sends the answer naming A with every
 * byte: not taken (it is told the room is gone for it).  D2, a new
 * connection of D's engine, sends it counting a byte less: not taken
 * either.  With the right count the room is SUCCESS, and D2 has the
 * confirmation.
 */
static void test_sender_takes_a_verdict_said_again(void)
{
    side_t pre;
    fake_t *d = calloc(1, sizeof(*d)), *d2 = calloc(1, sizeof(*d2));
    fake_t *e = calloc(1, sizeof(*e));
    kvf_msg_t m;
    uint32_t dpage = 6, spage = 8;
    const uint64_t A = 0xa11ce00000000011ull;

    side_init(&pre, KVF_ROLE_PREFILL, "127.0.0.1:0", NULL);
    kvf_sender_t *s = sender(&pre, 11);
    fake_init(d);
    d->lay.instance_id = 0xd0d0d0d0ull;
    wp_connect_prefill(d, pre.eng);
    kvf_msg_t req = room_req(11, A, &dpage);
    wp_peer_send(d, &req, NULL, 0);
    CHECK_EQ_INT(wait_sender(s, KVF_POLL_WAITING_FOR_INPUT), KVF_POLL_WAITING_FOR_INPUT);
    CHECK_EQ_INT(kvf_sender_init(s, 1, 1), KVF_OK);
    CHECK_EQ_INT(kvf_sender_send(s, &spage, 1, 1), KVF_OK);
    CHECK(wp_peer_expect(d, KVF_MSG_DONE, &m) && m.u.done.room == 11 &&
          m.u.done.bytes == ROOM_BYTES);
    wp_close(d);

    fake_init(e);
    e->lay.instance_id = 0xe0e0e0e0ull;
    wp_connect_prefill(e, pre.eng);
    fake_init(d2);
    d2->lay.instance_id = d->lay.instance_id;
    wp_connect_prefill(d2, pre.eng);
    kvf_msg_t ack = {.type = KVF_MSG_DONE_ACK}, got;
    ack.u.done_ack.room = 11;
    ack.u.done_ack.instance = A;
    ack.u.done_ack.bytes = ROOM_BYTES;
    wp_peer_send(e, &ack, NULL, 0);
    CHECK(wp_peer_expect(e, KVF_MSG_ABORT, &got) && got.u.fail.room == 11);
    ack.u.done_ack.bytes = ROOM_BYTES - 1;
    wp_peer_send(d2, &ack, NULL, 0);
    CHECK(wp_peer_expect(d2, KVF_MSG_ABORT, &got) && got.u.fail.room == 11);
    CHECK_EQ_INT(kvf_sender_poll(s), KVF_POLL_TRANSFERRING);

    ack.u.done_ack.bytes = ROOM_BYTES;
    wp_peer_send(d2, &ack, NULL, 0);
    CHECK(wp_peer_expect(d2, KVF_MSG_DONE_ACK, &got) && got.u.done_ack.room == 11 &&
          got.u.done_ack.instance == A && got.u.done_ack.bytes == ROOM_BYTES &&
          got.u.done_ack.status == KVF_OK);
    CHECK_EQ_INT(wait_sender(s, KVF_POLL_SUCCESS), KVF_POLL_SUCCESS);
    /* Said once more (its confirmation lost too): confirmed again. */
    wp_peer_send(d2, &ack, NULL, 0);
    CHECK(wp_peer_expect(d2, KVF_MSG_DONE_ACK, &got) && got.u.done_ack.room == 11);
    CHECK_EQ_INT(kvf_sender_poll(s), KVF_POLL_SUCCESS);
    kvf_sender_destroy(s);

    wp_close(d2);
    wp_close(e);
    free(d);
    free(d2);
    free(e);
    side_fini(&pre);
}

/*
 * Prefill side.  Decode rank D binds room 9 (instance A).  Then E, another
 * authenticated decode engine, sends room 9 a FAIL, an ABORT and a
 * DONE_ACK naming A, and a second ROOM_REQ for the same decode rank (its
 * own instance): the request is refused (E is told, ROOM_CONFLICT, with a
 * reason) and the rest dropped.  D itself sends a FAIL naming another
 * instance: dropped.  The room goes on and succeeds with D.  For room 10,
 * E binds first: D's request, arriving second, is told at once.
 */
static void test_sender_takes_only_its_peer_and_instance(void)
{
    side_t pre;
    fake_t *d = calloc(1, sizeof(*d)), *e = calloc(1, sizeof(*e));
    kvf_msg_t m;
    uint32_t dpage = 6, spage = 8;
    const uint64_t A = 0xa11ce00000000001ull, B = 0xb0b0000000000002ull;

    side_init(&pre, KVF_ROLE_PREFILL, "127.0.0.1:0", NULL);
    for (int b = 0; b < NKV; b++)
        for (size_t i = 0; i < PAGE_B; i++)
            pre.kv[b][spage * PAGE_B + i] = (uint8_t)(i + 3 * b);
    kvf_sender_t *s = sender(&pre, 9);
    fake_decode_connect(d, pre.eng);
    fake_decode_connect(e, pre.eng);
    kvf_msg_t req = room_req(9, A, &dpage);
    wp_peer_send(d, &req, NULL, 0);
    CHECK_EQ_INT(wait_sender(s, KVF_POLL_WAITING_FOR_INPUT), KVF_POLL_WAITING_FOR_INPUT);

    uint64_t before = dropped(pre.eng);
    kvf_msg_t bad = fail_msg(9, A, "a hostile rank says room 9 failed");
    wp_peer_send(e, &bad, NULL, 0);
    bad.type = KVF_MSG_ABORT;
    wp_peer_send(e, &bad, NULL, 0);
    kvf_msg_t ack = {.type = KVF_MSG_DONE_ACK};
    ack.u.done_ack.room = 9;
    ack.u.done_ack.instance = A;
    wp_peer_send(e, &ack, NULL, 0);
    req = room_req(9, B, &dpage);
    wp_peer_send(e, &req, NULL, 0);
    /* E is told its request was refused, naming its instance. */
    kvf_msg_t got;
    int told = 0;
    for (int i = 0; i < 3 && !told; i++) {
        CHECK(wp_peer_expect(e, KVF_MSG_FAIL, &got));
        told = got.u.fail.room == 9 && got.u.fail.instance == B &&
               got.u.fail.status == KVF_ERR_ROOM_CONFLICT;
    }
    CHECK(told);
    if (told) {
        char reason[KVF_REASON_MAX];
        snprintf(reason, sizeof(reason), "%.*s", (int)got.u.fail.reason.len,
                 got.u.fail.reason.ptr);
        CHECK_STR_CONTAINS(reason, "this request was refused");
    }
    bad = fail_msg(9, A ^ 0xff, "an earlier room 9 failed");
    wp_peer_send(d, &bad, NULL, 0);
    CHECK(wait_dropped(pre.eng, before + 5, 5000));
    CHECK_EQ_INT(kvf_sender_poll(s), KVF_POLL_WAITING_FOR_INPUT);

    /* The room is D's: its bytes go to D, naming A, and D's ack ends it. */
    CHECK_EQ_INT(kvf_sender_init(s, 1, 1), KVF_OK);
    CHECK_EQ_INT(kvf_sender_send(s, &spage, 1, 1), KVF_OK);
    CHECK(wp_peer_expect(d, KVF_MSG_DONE, &m) && m.u.done.room == 9 && m.u.done.instance == A);
    CHECK(m.u.done.bytes == ROOM_BYTES);
    ack.u.done_ack.bytes = ROOM_BYTES;
    wp_peer_send(d, &ack, NULL, 0);
    CHECK_EQ_INT(wait_sender(s, KVF_POLL_SUCCESS), KVF_POLL_SUCCESS);
    kvf_sender_destroy(s);

    /* Room 10: E binds first; D, the legitimate one, is told at once. */
    s = sender(&pre, 10);
    req = room_req(10, B, &dpage);
    wp_peer_send(e, &req, NULL, 0);
    CHECK_EQ_INT(wait_sender(s, KVF_POLL_WAITING_FOR_INPUT), KVF_POLL_WAITING_FOR_INPUT);
    req = room_req(10, A, &dpage);
    wp_peer_send(d, &req, NULL, 0);
    CHECK(wp_peer_expect(d, KVF_MSG_FAIL, &got) && got.u.fail.room == 10 &&
          got.u.fail.instance == A && got.u.fail.status == KVF_ERR_ROOM_CONFLICT);
    CHECK_EQ_INT(kvf_sender_poll(s), KVF_POLL_WAITING_FOR_INPUT);
    kvf_sender_destroy(s);

    wp_close(d);
    wp_close(e);
    free(d);
    free(e);
    side_fini(&pre);
}

static kvf_msg_t watch_req(uint64_t room, uint64_t inst, uint32_t rank)
{
    kvf_msg_t m = {.type = KVF_MSG_ROOM_REQ};
    m.u.room_req.room = room;
    m.u.room_req.instance = inst;
    m.u.room_req.dst_rank = rank;
    m.u.room_req.aux_slot = UINT32_MAX;
    m.u.room_req.flags = KVF_REQ_WATCH;
    return m;
}

typedef struct watches_arg {
    kvf_engine_t *eng;
    uint64_t      id;
    uint32_t      n;
} watches_arg_t;

static int has_watches(const void *arg)
{
    const watches_arg_t *w = arg;
    kvf__lock(w->eng);
    const kvf_room_t *r = kvf_map_get(&w->eng->rooms_by_id, w->id);
    uint32_t have = r != NULL ? r->nwatch : 0;
    kvf__unlock(w->eng);
    return have == w->n;
}

/* Until room `id` of eng holds n watches (5 s at most). */
static int wait_watches(kvf_engine_t *eng, uint64_t id, uint32_t n)
{
    watches_arg_t w = {eng, id, n};
    return wait_until(has_watches, &w, 5000);
}

/* E's next FAIL for `room` names `inst` with `st`. */
static int told_fail(fake_t *e, uint64_t room, uint64_t inst, kvf_status_t st)
{
    kvf_msg_t got;
    return wp_peer_expect(e, KVF_MSG_FAIL, &got) && got.u.fail.room == room &&
           got.u.fail.instance == inst && got.u.fail.status == st;
}

/*
 * A watch (a sibling's ROOM_REQ, docs/PROTOCOL.md) binds like a
 * destination, so a token holder cannot fail a bound room through one.
 * Room 11: D binds decode rank 0; E's watch for that rank is refused
 * (ROOM_CONFLICT, told), as is one naming a rank that is not E's own, and
 * E's FAIL naming its watch is dropped.  Room 12: E watches first, as rank
 * 0; D's destination for rank 0 takes its place, and E's FAIL is dropped.
 * Both rooms succeed with D.
 */
static void test_watch_binds_like_a_destination(void)
{
    side_t pre;
    fake_t *d = calloc(1, sizeof(*d)), *e = calloc(1, sizeof(*e));
    kvf_msg_t m;
    uint32_t dpage = 6, spage = 8;
    const uint64_t A = 0xa11ce00000000011ull, B = 0xb0b0000000000012ull;

    side_init(&pre, KVF_ROLE_PREFILL, "127.0.0.1:0", NULL);
    fake_decode_connect(d, pre.eng);
    fake_decode_connect(e, pre.eng);
    for (uint64_t room = 11; room <= 12; room++) {
        kvf_sender_t *s = sender(&pre, room);
        uint64_t before = dropped(pre.eng);
        kvf_msg_t req = room_req(room, A, &dpage), w = watch_req(room, B, 0);
        if (room == 11) {
            wp_peer_send(d, &req, NULL, 0);
            CHECK_EQ_INT(wait_sender(s, KVF_POLL_WAITING_FOR_INPUT),
                         KVF_POLL_WAITING_FOR_INPUT);
            wp_peer_send(e, &w, NULL, 0);
            CHECK(told_fail(e, room, B, KVF_ERR_ROOM_CONFLICT));
            w = watch_req(room, B + 1, 3);       /* not E's own rank */
            wp_peer_send(e, &w, NULL, 0);
            CHECK(told_fail(e, room, B + 1, KVF_ERR_ROOM_CONFLICT));
        } else {
            wp_peer_send(e, &w, NULL, 0);
            CHECK(wait_watches(pre.eng, room, 1));  /* taken */
            wp_peer_send(d, &req, NULL, 0);
            CHECK_EQ_INT(wait_sender(s, KVF_POLL_WAITING_FOR_INPUT),
                         KVF_POLL_WAITING_FOR_INPUT);
        }
        kvf_msg_t bad = fail_msg(room, B, "a hostile watch says the room failed");
        wp_peer_send(e, &bad, NULL, 0);
        CHECK(wait_dropped(pre.eng, before + 2, 5000));
        CHECK_EQ_INT(kvf_sender_poll(s), KVF_POLL_WAITING_FOR_INPUT);
        CHECK_EQ_INT(kvf_sender_init(s, 1, 1), KVF_OK);
        CHECK_EQ_INT(kvf_sender_send(s, &spage, 1, 1), KVF_OK);
        CHECK(wp_peer_expect(d, KVF_MSG_DONE, &m) && m.u.done.room == room &&
              m.u.done.instance == A);
        kvf_msg_t ack = {.type = KVF_MSG_DONE_ACK};
        ack.u.done_ack.room = room;
        ack.u.done_ack.instance = A;
        ack.u.done_ack.bytes = ROOM_BYTES;
        wp_peer_send(d, &ack, NULL, 0);
        CHECK_EQ_INT(wait_sender(s, KVF_POLL_SUCCESS), KVF_POLL_SUCCESS);
        kvf_sender_destroy(s);
    }
    wp_close(d);
    wp_close(e);
    free(d);
    free(e);
    side_fini(&pre);
}

/*
 * The decode engine's side of a refusal: a real receiver whose request
 * conflicts with the one a prefill rank bound first fails at once with
 * ROOM_CONFLICT and the prefill rank's reason, long before any deadline.
 */
static void test_refused_receiver_fails_at_once(void)
{
    side_t pre, dec;
    fake_t *e = calloc(1, sizeof(*e));
    char bs[64];
    uint32_t dpage = 6;
    kvf_receiver_t *r;
    kvf_failure_t f;
    kvf_failure_init(&f);

    side_init(&pre, KVF_ROLE_PREFILL, "127.0.0.1:0", NULL);
    CHECK_EQ_INT(kvf_engine_bootstrap_addr(pre.eng, bs, sizeof(bs)), KVF_OK);
    side_init(&dec, KVF_ROLE_DECODE, NULL, NULL);
    kvf_sender_t *s = sender(&pre, 11);
    fake_decode_connect(e, pre.eng);
    kvf_msg_t req = room_req(11, 0xbadull, &dpage);
    wp_peer_send(e, &req, NULL, 0);
    CHECK_EQ_INT(wait_sender(s, KVF_POLL_WAITING_FOR_INPUT), KVF_POLL_WAITING_FOR_INPUT);
    uint64_t t0 = kvf_now_ms();
    CHECK_EQ_INT(kvf_receiver_create(dec.eng, bs, 11, -1, &r), KVF_OK);
    CHECK_EQ_INT(kvf_receiver_init(r, &dpage, 1, 1, NULL, 0), KVF_OK);
    CHECK_EQ_INT(wait_receiver(r, KVF_POLL_SUCCESS), KVF_POLL_FAILED);
    CHECK(kvf_now_ms() - t0 < 2000);       /* the bootstrap deadline is 5 s */
    CHECK_EQ_INT(kvf_receiver_failure(r, &f), KVF_OK);
    CHECK_EQ_INT(f.status, KVF_ERR_ROOM_CONFLICT);
    CHECK_STR_CONTAINS(f.reason, "this request was refused");
    CHECK_EQ_INT(f.from_another_rank, 1);
    CHECK_EQ_INT(kvf_sender_poll(s), KVF_POLL_WAITING_FOR_INPUT);
    kvf_receiver_destroy(r);
    kvf_sender_destroy(s);
    wp_close(e);
    free(e);
    side_fini(&dec);
    side_fini(&pre);
}

/*
 * 200,000 ABORTs for room ids no sender will ever have, from an
 * authenticated decode engine (it once grew a prefill engine by ~160 MiB
 * for the bootstrap deadline): the prefill engine keeps at most
 * KVF_STASH_MAX of them and KVF_STASH_BYTES, drops the oldest and counts
 * them; a room asked for after the flood still binds and succeeds.
 */
static void test_stashes_are_bounded(void)
{
    enum { N = 200000 };
    side_t pre;
    fake_t *d = calloc(1, sizeof(*d));
    kvf_buf_t b;
    kvf_msg_t m;
    uint32_t dpage = 2, spage = 3;

    side_init(&pre, KVF_ROLE_PREFILL, "127.0.0.1:0", NULL);
    fake_decode_connect(d, pre.eng);
    kvf_buf_init(&b);
    for (uint32_t i = 0; i < N; i++) {
        kvf_msg_t a = fail_msg(1000000 + i, 0x100 + i, "nobody creates this room");
        a.type = KVF_MSG_ABORT;
        a.u.fail.status = KVF_ERR_ABORTED;
        CHECK_EQ_INT(kvf_wire_encode(&b, &a), KVF_OK);
        if (b.len >= (1u << 20) || i == N - 1) {
            for (size_t off = 0; off < b.len;) {
                ssize_t n = send(d->fd, b.data + off, b.len - off, MSG_NOSIGNAL);
                CHECK(n > 0);
                if (n <= 0)
                    break;
                off += (size_t)n;
            }
            b.len = 0;
        }
    }
    kvf_buf_free(&b);
    size_t count = 0, bytes = 0;
    stash_arg_t sa = {pre.eng, 0, N};
    wait_until(stash_took, &sa, 60000);
    kvf__lock(pre.eng);
    count = pre.eng->stash_count;
    bytes = pre.eng->stash_bytes;
    kvf__unlock(pre.eng);
    CHECK(count + engine_stats(pre.eng).stash_dropped == N);
    CHECK(count <= KVF_STASH_MAX);
    CHECK(bytes <= KVF_STASH_BYTES);
    CHECK(engine_stats(pre.eng).stash_dropped >= N - KVF_STASH_MAX);

    /* A room's request after the flood, then its sender: bound, served. */
    for (int b2 = 0; b2 < NKV; b2++)
        memset(pre.kv[b2] + spage * PAGE_B, 0x40 + b2, PAGE_B);
    kvf_msg_t req = room_req(5, 0x5555, &dpage);
    wp_peer_send(d, &req, NULL, 0);
    sa.id = 5;
    wait_until(stash_has_room, &sa, 5000);
    kvf_sender_t *s = sender(&pre, 5);
    CHECK_EQ_INT(wait_sender(s, KVF_POLL_WAITING_FOR_INPUT), KVF_POLL_WAITING_FOR_INPUT);
    CHECK_EQ_INT(kvf_sender_init(s, 1, 1), KVF_OK);
    CHECK_EQ_INT(kvf_sender_send(s, &spage, 1, 1), KVF_OK);
    CHECK(wp_peer_expect(d, KVF_MSG_DONE, &m) && m.u.done.room == 5 &&
          m.u.done.instance == 0x5555 && m.u.done.bytes == ROOM_BYTES);
    kvf_msg_t ack = {.type = KVF_MSG_DONE_ACK};
    ack.u.done_ack.room = 5;
    ack.u.done_ack.instance = 0x5555;
    ack.u.done_ack.bytes = ROOM_BYTES;
    wp_peer_send(d, &ack, NULL, 0);
    CHECK_EQ_INT(wait_sender(s, KVF_POLL_SUCCESS), KVF_POLL_SUCCESS);
    kvf_sender_destroy(s);
    wp_close(d);
    free(d);
    side_fini(&pre);
}

/* A fake sends `msg`, of a type the engine's rooms never take; the room
 * it names (s or r) must fail, the fake be told and its connection close. */
typedef struct unexpected {
    fake_t         *f;
    kvf_msg_t       msg;
    kvf_sender_t   *s;
    kvf_receiver_t *r;
    uint64_t        room;
    int             told, closed;
} unexpected_t;

static void send_unexpected(void *arg)
{
    unexpected_t *u = arg;
    kvf_msg_t got;
    wp_peer_send(u->f, &u->msg, NULL, 0);
    if (u->s != NULL)
        CHECK_EQ_INT(wait_sender(u->s, KVF_POLL_SUCCESS), KVF_POLL_FAILED);
    else
        CHECK_EQ_INT(wait_receiver(u->r, KVF_POLL_SUCCESS), KVF_POLL_FAILED);
    u->told = wp_peer_expect(u->f, KVF_MSG_FAIL, &got) && got.u.fail.room == u->room &&
              got.u.fail.status == KVF_ERR_PROTOCOL;
    u->closed = wp_closed(u->f->fd, 5000);
}

/* The room's failure after send_unexpected: PROTOCOL, naming the message. */
static void check_unexpected(const unexpected_t *u, const char *what)
{
    kvf_failure_t f;
    kvf_failure_init(&f);
    CHECK_EQ_INT(u->s != NULL ? kvf_sender_failure(u->s, &f) : kvf_receiver_failure(u->r, &f),
                 KVF_OK);
    CHECK_EQ_INT(f.status, KVF_ERR_PROTOCOL);
    CHECK_STR_CONTAINS(f.reason, what);
    CHECK(u->told);
    CHECK(u->closed);
}

/*
 * A message of a type this engine's rooms never take is its sender's
 * protocol error: the room's side says so in its verdict (room.c,
 * kvf__room_unexpected) and the peer, once that call has returned, fails
 * with every room on it.  Prefill: decode rank D, bound to room 13, sends
 * a DONE (only a decode engine takes one).  Decode: prefill rank A, which
 * room 14 asked, sends a ROOM_REQ (only a prefill engine takes one).  Each
 * room fails with PROTOCOL naming the message, the fake is sent the room's
 * FAIL and then its connection closes, and the engine logs it once.
 */
static void test_unexpected_message_fails_its_peer(void)
{
    side_t pre, dec;
    fake_t *d = calloc(1, sizeof(*d)), *a = calloc(1, sizeof(*a));
    kvf_bootstrap_t *bsa;
    char addr_a[64];
    uint32_t dpage = 6;
    kvf_msg_t m;

    side_init(&pre, KVF_ROLE_PREFILL, "127.0.0.1:0", NULL);
    unexpected_t u = {.f = d, .s = sender(&pre, 13), .room = 13};
    fake_decode_connect(d, pre.eng);
    kvf_msg_t req = room_req(13, 0x1313, &dpage);
    wp_peer_send(d, &req, NULL, 0);
    CHECK_EQ_INT(wait_sender(u.s, KVF_POLL_WAITING_FOR_INPUT), KVF_POLL_WAITING_FOR_INPUT);
    u.msg = (kvf_msg_t){.type = KVF_MSG_DONE};
    u.msg.u.done.room = 13;
    u.msg.u.done.instance = 0x1313;
    CHECK_EQ_INT(log_lines_during(send_unexpected, &u,
                                  "unexpected DONE message from a decode engine"), 1);
    check_unexpected(&u, "unexpected DONE message from a decode engine");
    kvf_sender_destroy(u.s);

    fake_prefill_listen(a, &bsa, addr_a, sizeof(addr_a));
    side_init(&dec, KVF_ROLE_DECODE, addr_a, NULL);
    u = (unexpected_t){.f = a, .room = 14};
    CHECK_EQ_INT(kvf_receiver_create(dec.eng, addr_a, 14, -1, &u.r), KVF_OK);
    CHECK_EQ_INT(kvf_receiver_init(u.r, &dpage, 1, 1, NULL, 0), KVF_OK);
    wp_accept_decode(a, 0);
    CHECK(wp_peer_expect(a, KVF_MSG_ROOM_REQ, &m) && m.u.room_req.room == 14);
    CHECK_EQ_INT(wait_receiver(u.r, KVF_POLL_WAITING_FOR_INPUT), KVF_POLL_WAITING_FOR_INPUT);
    u.msg = room_req(14, m.u.room_req.instance, &dpage);
    CHECK_EQ_INT(log_lines_during(send_unexpected, &u,
                                  "unexpected ROOM_REQ message from a prefill engine"), 1);
    check_unexpected(&u, "unexpected ROOM_REQ message from a prefill engine");
    kvf_receiver_destroy(u.r);

    side_fini(&dec);
    side_fini(&pre);
    wp_close(a);
    wp_close(d);
    free(a);
    free(d);
    kvf_bootstrap_destroy(bsa);
}

/* Each side's ops table fills every op core calls without a NULL test
 * (room.c, kvf__room_ops_missing), and the check sees one left out. */
static void test_room_ops_are_whole(void)
{
    CHECK(kvf__room_ops_missing(&kvf_sender_room_ops) == NULL);
    CHECK(kvf__room_ops_missing(&kvf_receiver_room_ops) == NULL);
    kvf_room_ops_t o = kvf_receiver_room_ops;
    o.on_data_end = NULL;
    CHECK_STR_CONTAINS(kvf__room_ops_missing(&o), "on_data_end");
    o = kvf_sender_room_ops;          /* a prefill table needs no decode op */
    CHECK(o.on_data == NULL && kvf__room_ops_missing(&o) == NULL);
    o.tick = NULL;
    CHECK_STR_CONTAINS(kvf__room_ops_missing(&o), "tick");
    o = kvf_sender_room_ops;
    o.destroyed = NULL;               /* may be NULL */
    CHECK(kvf__room_ops_missing(&o) == NULL);
    o.size = 0;
    CHECK_STR_CONTAINS(kvf__room_ops_missing(&o), "size");
}

static int cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

/* Receivers' instances (room.c, kvf__room_new_instance): never 0, none
 * the same on an engine or across two (as random draws: 2^-64 a pair),
 * and no draw its predecessor plus one; a receiver created takes one. */
static void test_instances_are_distinct(void)
{
    enum { DRAWS = 100000 };
    side_t a, b;
    side_init(&a, KVF_ROLE_DECODE, NULL, NULL);
    side_init(&b, KVF_ROLE_DECODE, NULL, NULL);
    uint64_t *v = malloc(2 * DRAWS * sizeof(uint64_t));
    CHECK(v != NULL);
    int steps = 0;
    for (int i = 0; i < DRAWS; i++) {
        v[i] = kvf__room_new_instance(a.eng);
        v[DRAWS + i] = kvf__room_new_instance(b.eng);
        steps += i > 0 && v[i] == v[i - 1] + 1;
    }
    CHECK_EQ_INT(steps, 0);
    kvf_receiver_t *r1, *r2;
    CHECK_EQ_INT(kvf_receiver_create(a.eng, "127.0.0.1:1", 1, -1, &r1), KVF_OK);
    CHECK_EQ_INT(kvf_receiver_create(a.eng, "127.0.0.1:1", 2, -1, &r2), KVF_OK);
    CHECK(r1->room.instance != r2->room.instance);
    qsort(v, 2 * DRAWS, sizeof(uint64_t), cmp_u64);
    int same = v[0] == 0;
    for (int i = 0; i < 2 * DRAWS; i++)
        same += (i > 0 && v[i] == v[i - 1]) || v[i] == r1->room.instance ||
                v[i] == r2->room.instance;
    CHECK_EQ_INT(same, 0);
    kvf_receiver_destroy(r1);
    kvf_receiver_destroy(r2);
    free(v);
    side_fini(&b);
    side_fini(&a);
}

KVF_TEST_MAIN(KVF_CASE(test_room_ops_are_whole),
              KVF_CASE(test_instances_are_distinct),
              KVF_CASE(test_receiver_takes_only_its_peer_and_instance),
              KVF_CASE(test_reused_id_gets_only_its_own_frames),
              KVF_CASE(test_reused_id_real_engines),
              KVF_CASE(test_sender_takes_only_its_peer_and_instance),
              KVF_CASE(test_sender_takes_a_verdict_said_again),
              KVF_CASE(test_watch_binds_like_a_destination),
              KVF_CASE(test_refused_receiver_fails_at_once),
              KVF_CASE(test_stashes_are_bounded),
              KVF_CASE(test_each_byte_counts_once),
              KVF_CASE(test_unexpected_message_fails_its_peer))
