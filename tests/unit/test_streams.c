/*
 * Streams (docs/PROTOCOL.md, JOIN; docs/ARCHITECTURE.md, lanes): rooms
 * move over two tcp streams per peer pair, byte for byte, with checksums,
 * and both streams carry payload; a pair whose engines differ uses the
 * smaller setting; and connections that try to join a peer without the
 * right to are closed, alone, while the peer's rooms go on.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>

#include "kvferry/kvferry.h"
#include "util/time.h"
#include "wire/wire.h"

#define HEAD_B  64
#define PAGE    16
#define PAGES   256
#define STATE_B 24
#include "unit/kvf_sides.h"

/* Engine settings of the next side (a case changes them). */
static const char *next_faults;
static unsigned next_transfer_ms = 5000, next_hb_interval_ms = 500, next_hb_timeout_ms = 2500;
static unsigned next_streams, next_handshake_ms;

static void tune(kvf_engine_params_t *p)
{
    p->transfer_timeout_ms = next_transfer_ms;
    p->heartbeat_interval_ms = next_hb_interval_ms;
    p->heartbeat_timeout_ms = next_hb_timeout_ms;
    p->faults = next_faults;
    p->handshake_timeout_ms = next_handshake_ms;
    p->checksum = 1;
    p->streams = next_streams;
}

/* A side with the settings above, `streams` streams per peer, and a
 * state buffer of STATE_B items. */
static void stream_side(side_t *s, kvf_role_t role, const char *bs, unsigned streams,
                        unsigned handshake_ms)
{
    next_streams = streams;
    next_handshake_ms = handshake_ms;
    side_tune = tune;
    side_state_b = STATE_B;
    side_init(s, role, bs, NULL);
    CHECK_EQ_INT(kvf_engine_streams(s->eng), streams);
}

/*
 * Room `room`: src[i] -> dst[i] for i < n, sent in `chunks` sends, with
 * aux slot 3 -> 5 and state slot 2 -> 6.  @return 1 when both sides
 * succeed and every byte is in place.
 */
static int room(side_t *pre, side_t *dec, const char *bs, uint64_t id, const uint32_t *src,
                const uint32_t *dst, uint32_t n, uint32_t chunks)
{
    kvf_sender_t *s;
    kvf_receiver_t *r;
    uint32_t sslot = 2, dslot = 6;
    for (int i = 0; i < AUX_B; i++)
        pre->aux[3 * AUX_B + i] = (uint8_t)(id + (uint64_t)i);
    for (int i = 0; i < STATE_B; i++)
        pre->state[2 * STATE_B + i] = (uint8_t)(id * 3 + (uint64_t)i);
    CHECK_EQ_INT(kvf_sender_create(pre->eng, bs, id, &s), KVF_OK);
    CHECK_EQ_INT(kvf_receiver_create(dec->eng, bs, id, -1, &r), KVF_OK);
    CHECK_EQ_INT(kvf_receiver_init(r, dst, n, 5, &dslot, 1), KVF_OK);
    CHECK_EQ_INT(wait_sender(s, KVF_POLL_WAITING_FOR_INPUT), KVF_POLL_WAITING_FOR_INPUT);
    CHECK_EQ_INT(kvf_sender_init(s, n, 3), KVF_OK);
    CHECK_EQ_INT(kvf_sender_set_state(s, &sslot, 1), KVF_OK);
    for (uint32_t c = 0, at = 0; c < chunks; c++) {
        uint32_t len = c + 1 == chunks ? n - at : n / chunks;
        CHECK_EQ_INT(kvf_sender_send(s, src + at, len, c + 1 == chunks), KVF_OK);
        at += len;
    }
    int ok = wait_sender(s, KVF_POLL_SUCCESS) == KVF_POLL_SUCCESS &&
             wait_receiver(r, KVF_POLL_SUCCESS) == KVF_POLL_SUCCESS;
    if (!ok) {
        kvf_failure_t f;
        kvf_failure_init(&f);
        if (kvf_receiver_failure(r, &f) == KVF_OK)
            fprintf(stderr, "  room %llu failed on decode: %s\n", (unsigned long long)id,
                    f.reason);
    }
    for (int b = 0; b < NKV; b++)
        for (uint32_t i = 0; i < n; i++)
            ok &= memcmp(dec->kv[b] + (size_t)dst[i] * PAGE_B,
                         pre->kv[b] + (size_t)src[i] * PAGE_B, PAGE_B) == 0;
    ok &= memcmp(dec->aux + 5 * AUX_B, pre->aux + 3 * AUX_B, AUX_B) == 0;
    ok &= memcmp(dec->state + 6 * STATE_B, pre->state + 2 * STATE_B, STATE_B) == 0;
    kvf_sender_destroy(s);
    kvf_receiver_destroy(r);
    return ok;
}

static uint64_t stream_sum(kvf_engine_t *eng)
{
    uint64_t n = 0;
    for (unsigned k = 0; k < 8; k++)
        n += kvf_engine_stream_bytes(eng, k);
    return n;
}

/* Contiguous, scattered, chunked and one-page rooms over two streams. */
static void test_two_streams(void)
{
    side_t pre, dec;
    char bs[64];
    uint32_t src[PAGES], dst[PAGES];

    stream_side(&pre, KVF_ROLE_PREFILL, "127.0.0.1:0", 2, 0);
    CHECK_EQ_INT(kvf_engine_bootstrap_addr(pre.eng, bs, sizeof(bs)), KVF_OK);
    stream_side(&dec, KVF_ROLE_DECODE, NULL, 2, 0);
    for (uint32_t i = 0; i < PAGES; i++)
        src[i] = dst[i] = i;
    /* One run per buffer: cut in two, half a room per stream. */
    CHECK(room(&pre, &dec, bs, 1, src, dst, PAGES, 1));
    uint64_t s0 = kvf_engine_stream_bytes(dec.eng, 0), s1 = kvf_engine_stream_bytes(dec.eng, 1);
    CHECK(s0 > 0 && s1 > 0);
    CHECK(s1 >= (uint64_t)NKV * PAGES * PAGE_B / 2 - (uint64_t)NKV * PAGE_B);
    CHECK(s0 + s1 == (uint64_t)NKV * PAGES * PAGE_B + AUX_B + STATE_B);
    /* Scattered (a permutation), in three chunks. */
    for (uint32_t i = 0; i < PAGES; i++)
        dst[i] = (i * 37 + 11) % PAGES;
    CHECK(room(&pre, &dec, bs, 2, src, dst, PAGES / 2, 3));
    /* One page: one stream has nothing to carry but its DONE. */
    CHECK(room(&pre, &dec, bs, 3, src + 7, dst + 9, 1, 1));
    /* Many rooms back to back on the same streams. */
    for (uint64_t id = 10; id < 30; id++)
        CHECK(room(&pre, &dec, bs, id, src + id, dst + 2 * id, 40, 2));
    CHECK(kvf_engine_stream_bytes(pre.eng, 1) > s1);
    CHECK_EQ_INT(kvf_engine_stream_bytes(pre.eng, 2), 0);
    CHECK(stream_sum(pre.eng) == stream_sum(dec.eng));
    kvf_engine_stats_t st;
    kvf_engine_stats_init(&st);
    kvf_engine_stats(dec.eng, &st);
    CHECK_EQ_INT((int)st.peers_connected, 1);    /* streams are not peers */
    CHECK_EQ_INT((int)st.rooms_failed, 0);
    side_fini(&dec);
    side_fini(&pre);
}

/* A pair uses the smaller of its engines' settings. */
static void test_smaller_setting_wins(void)
{
    unsigned cases[][2] = {{2, 1}, {1, 3}, {4, 2}};
    uint32_t src[PAGES], dst[PAGES];
    for (uint32_t i = 0; i < PAGES; i++)
        src[i] = dst[i] = i;
    for (size_t c = 0; c < sizeof(cases) / sizeof(cases[0]); c++) {
        side_t pre, dec;
        char bs[64];
        stream_side(&pre, KVF_ROLE_PREFILL, "127.0.0.1:0", cases[c][0], 0);
        CHECK_EQ_INT(kvf_engine_bootstrap_addr(pre.eng, bs, sizeof(bs)), KVF_OK);
        stream_side(&dec, KVF_ROLE_DECODE, NULL, cases[c][1], 0);
        CHECK(room(&pre, &dec, bs, 100 + c, src, dst, PAGES, 2));
        unsigned want = cases[c][0] < cases[c][1] ? cases[c][0] : cases[c][1];
        for (unsigned k = 0; k < 4; k++) {
            CHECK((kvf_engine_stream_bytes(dec.eng, k) > 0) == (k < want));
            CHECK((kvf_engine_stream_bytes(pre.eng, k) > 0) == (k < want));
        }
        side_fini(&dec);
        side_fini(&pre);
    }
}

/*
 * One stream stops sending mid-room (stall, longer than every deadline):
 * whichever stream it is, the room fails on both sides well before the
 * stall ends.  The first stream stalled: its heartbeats stop, and the
 * peer is dead; another: the first one's heartbeats go on, and the
 * room's transfer deadline catches the silence of the one that owes data.
 */
static void test_stalled_stream_fails_the_room(void)
{
    side_t pre, dec;
    char bs[64];
    uint32_t pages[PAGES];
    for (int round = 0; round < 2; round++) {
        next_faults = round == 0 ? "stall@40000:10000" : "stall@300000:10000";
        next_transfer_ms = 1500;
        next_hb_interval_ms = 100;
        next_hb_timeout_ms = 600;
        stream_side(&pre, KVF_ROLE_PREFILL, "127.0.0.1:0", 2, 0);
        next_faults = NULL;
        CHECK_EQ_INT(kvf_engine_bootstrap_addr(pre.eng, bs, sizeof(bs)), KVF_OK);
        stream_side(&dec, KVF_ROLE_DECODE, NULL, 2, 0);
        next_transfer_ms = 5000;
        next_hb_interval_ms = 500;
        next_hb_timeout_ms = 2500;
        for (uint32_t i = 0; i < PAGES; i++)
            pages[i] = i;
        kvf_sender_t *s;
        kvf_receiver_t *r;
        uint32_t slot = 0;
        CHECK_EQ_INT(kvf_sender_create(pre.eng, bs, 500, &s), KVF_OK);
        CHECK_EQ_INT(kvf_receiver_create(dec.eng, bs, 500, -1, &r), KVF_OK);
        CHECK_EQ_INT(kvf_receiver_init(r, pages, PAGES, 1, &slot, 1), KVF_OK);
        CHECK_EQ_INT(wait_sender(s, KVF_POLL_WAITING_FOR_INPUT), KVF_POLL_WAITING_FOR_INPUT);
        CHECK_EQ_INT(kvf_sender_init(s, PAGES, 1), KVF_OK);
        CHECK_EQ_INT(kvf_sender_set_state(s, &slot, 1), KVF_OK);
        uint64_t t0 = kvf_now_ms();
        CHECK_EQ_INT(kvf_sender_send(s, pages, PAGES, 1), KVF_OK);
        CHECK_EQ_INT(wait_receiver(r, KVF_POLL_SUCCESS), KVF_POLL_FAILED);
        CHECK_EQ_INT(wait_sender(s, KVF_POLL_SUCCESS), KVF_POLL_FAILED);
        CHECK(kvf_now_ms() - t0 < 6000);           /* the stall lasts 10 s */
        kvf_failure_t f;
        kvf_failure_init(&f);
        CHECK_EQ_INT(kvf_receiver_failure(r, &f), KVF_OK);
        fprintf(stderr, "  stalled stream, round %d: %s: %s\n", round,
                kvf_status_name(f.status), f.reason);
        CHECK(f.status == KVF_ERR_PEER_TIMEOUT || f.status == KVF_ERR_TIMED_OUT);
        if (f.status == KVF_ERR_PEER_TIMEOUT)
            CHECK_STR_CONTAINS(f.reason, "heartbeat timeout");
        kvf_sender_destroy(s);
        kvf_receiver_destroy(r);
        side_fini(&dec);
        side_fini(&pre);
    }
}

/* ---- joins that must be refused ---------------------------------------- */

/* Still open after ms: no EOF or reset (heartbeats may have come). */
static int still_open(int fd, int ms)
{
    uint8_t b;
    sleep_ms(ms);
    ssize_t n = recv(fd, &b, 1, MSG_PEEK | MSG_DONTWAIT);
    return n > 0 || (n < 0 && errno == EAGAIN);
}

static kvf_msg_t join_msg(const uint8_t *cookie, uint32_t stream)
{
    kvf_msg_t m = {.type = KVF_MSG_JOIN};
    memcpy(m.u.join.cookie, cookie, KVF_WIRE_COOKIE_LEN);
    m.u.join.stream = stream;
    return m;
}

/* A stream connection of the hand-played decode engine: authenticated
 * with KVF_AUTH_F_JOIN, then `join` sent.  @return the fd, or -1. */
static int join_as(int port, const kvf_msg_t *join)
{
    int fd = dial(port);
    if (fd < 0 || !wp_authenticate_flags(fd, wp_engine_token(), KVF_ROLE_DECODE, 1,
                                         KVF_AUTH_F_JOIN, NULL) ||
        !wp_send(fd, join, NULL, 0)) {
        if (fd >= 0)
            close(fd);
        return -1;
    }
    return fd;
}

/*
 * The test plays a decode engine that agreed on two streams with the
 * prefill (its HELLO is the prefill's own, as a decode rank's), beside a
 * real decode engine whose room waits to be sent.  Refused, each closing
 * only its own connection: a JOIN before authentication, a wrong cookie,
 * a JOIN on a first connection, the index taken or beyond the agreed
 * count, and a stream that never sends its JOIN (the handshake deadline).
 * Then the real room succeeds and the played peer's streams are still up.
 */
static void test_joins_refused(void)
{
    static uint8_t body[1 << 20];
    side_t pre, dec;
    char bs[64];
    uint8_t cookie[KVF_WIRE_COOKIE_LEN], wrong[KVF_WIRE_COOKIE_LEN];
    uint32_t src[PAGES], dst[PAGES];
    kvf_msg_t m;

    stream_side(&pre, KVF_ROLE_PREFILL, "127.0.0.1:0", 2, 1000);
    CHECK_EQ_INT(kvf_engine_bootstrap_addr(pre.eng, bs, sizeof(bs)), KVF_OK);
    stream_side(&dec, KVF_ROLE_DECODE, NULL, 2, 0);
    int port = port_of(pre.eng);

    /* The played decode engine: authenticated, HELLO, two streams agreed. */
    int fd0 = dial(port);
    CHECK(fd0 >= 0);
    CHECK(wp_authenticate(fd0, wp_engine_token(), KVF_ROLE_DECODE, 1, NULL));
    CHECK_EQ_INT(wp_recv(fd0, &m, body, sizeof(body), 5000), KVF_MSG_HELLO);
    kvf_msg_t hello = m;
    hello.u.hello.role = KVF_ROLE_DECODE;
    hello.u.hello.instance_id = wp_auth_msg(KVF_ROLE_DECODE, "").u.auth.instance_id;
    uint8_t hello_frame[1 << 16];
    kvf_buf_t hb;
    kvf_buf_init(&hb);
    CHECK_EQ_INT(kvf_wire_encode(&hb, &hello), KVF_OK);
    CHECK(hb.len <= sizeof(hello_frame));
    memcpy(hello_frame, hb.data, hb.len);
    CHECK(send(fd0, hello_frame, hb.len, MSG_NOSIGNAL) == (ssize_t)hb.len);
    kvf_buf_free(&hb);
    CHECK_EQ_INT(wp_recv(fd0, &m, body, sizeof(body), 5000), KVF_MSG_XPORT);
    int offered = 0;
    for (uint32_t i = 0; i < m.u.xport.count; i++) {
        const kvf_wire_xport_t *x = &m.u.xport.x[i];
        if (x->name.len == strlen(KVF_WIRE_STREAMS_NAME) &&
            memcmp(x->name.ptr, KVF_WIRE_STREAMS_NAME, x->name.len) == 0 &&
            x->blob_len == KVF_WIRE_STREAMS_OFFER) {
            CHECK_EQ_INT(kvf_get_u32(x->blob), 2);
            memcpy(cookie, x->blob + 4, KVF_WIRE_COOKIE_LEN);
            offered = 1;
        }
    }
    CHECK(offered);
    uint8_t two[4];
    kvf_put_u32(two, 2);
    kvf_msg_t answer = {.type = KVF_MSG_XPORT};
    answer.u.xport.count = 1;
    answer.u.xport.x[0] = (kvf_wire_xport_t){
        {KVF_WIRE_STREAMS_NAME, (uint32_t)strlen(KVF_WIRE_STREAMS_NAME)}, two, 4};
    CHECK(wp_send(fd0, &answer, NULL, 0));

    /* The real pair's room, bootstrapped and waiting while strangers try. */
    for (uint32_t i = 0; i < PAGES; i++)
        src[i] = dst[i] = i;
    kvf_sender_t *s;
    kvf_receiver_t *r;
    CHECK_EQ_INT(kvf_sender_create(pre.eng, bs, 42, &s), KVF_OK);
    CHECK_EQ_INT(kvf_receiver_create(dec.eng, bs, 42, -1, &r), KVF_OK);
    uint32_t dslot = 1;
    CHECK_EQ_INT(kvf_receiver_init(r, dst, PAGES, 1, &dslot, 1), KVF_OK);
    CHECK_EQ_INT(wait_sender(s, KVF_POLL_WAITING_FOR_INPUT), KVF_POLL_WAITING_FOR_INPUT);
    uint64_t refused = engine_stats(pre.eng).auth_refused;

    /* A JOIN before authenticating: refused as any stranger is. */
    int fd = dial(port);
    CHECK(fd >= 0);
    CHECK_EQ_INT(wp_recv(fd, &m, body, sizeof(body), 5000), KVF_MSG_AUTH);
    kvf_msg_t j1 = join_msg(cookie, 1);
    CHECK(wp_send(fd, &j1, NULL, 0));
    CHECK(wp_closed(fd, 5000));
    close(fd);
    CHECK_EQ_INT(engine_stats(pre.eng).auth_refused, refused + 1);

    /* A wrong cookie. */
    memcpy(wrong, cookie, sizeof(wrong));
    wrong[5] ^= 0x40;
    kvf_msg_t jw = join_msg(wrong, 1);
    fd = join_as(port, &jw);
    CHECK(fd >= 0);
    CHECK(wp_closed(fd, 5000));
    close(fd);

    /* A JOIN on a connection that did not announce one (a first stream). */
    fd = dial(port);
    CHECK(wp_authenticate(fd, wp_engine_token(), KVF_ROLE_DECODE, 1, NULL));
    CHECK_EQ_INT(wp_recv(fd, &m, body, sizeof(body), 5000), KVF_MSG_HELLO);
    CHECK(wp_send(fd, &j1, NULL, 0));
    int closed = 0;
    for (int i = 0; i < 4 && !closed; i++) {    /* after its XPORT offer */
        int t = wp_recv(fd, &m, body, sizeof(body), 5000);
        closed = t == 0;
    }
    CHECK(closed);
    close(fd);

    /* The right cookie: attached, and answered with the same JOIN. */
    int fd1 = join_as(port, &j1);
    CHECK(fd1 >= 0);
    CHECK_EQ_INT(wp_recv(fd1, &m, body, sizeof(body), 5000), KVF_MSG_JOIN);
    CHECK_EQ_INT(m.u.join.stream, 1);
    CHECK(memcmp(m.u.join.cookie, cookie, KVF_WIRE_COOKIE_LEN) == 0);

    /* The index taken, and one beyond the two agreed. */
    fd = join_as(port, &j1);
    CHECK(fd >= 0);
    CHECK(wp_closed(fd, 5000));
    close(fd);
    kvf_msg_t j2 = join_msg(cookie, 2);
    fd = join_as(port, &j2);
    CHECK(fd >= 0);
    CHECK(wp_closed(fd, 5000));
    close(fd);

    /* Announced a JOIN, never sent it: closed at the handshake deadline. */
    fd = dial(port);
    CHECK(wp_authenticate_flags(fd, wp_engine_token(), KVF_ROLE_DECODE, 1, KVF_AUTH_F_JOIN,
                                NULL));
    CHECK(wp_closed(fd, 5000));
    close(fd);

    /* None of it touched the played peer or the real room. */
    CHECK(still_open(fd0, 100));
    CHECK(still_open(fd1, 100));
    CHECK_EQ_INT(kvf_sender_poll(s), KVF_POLL_WAITING_FOR_INPUT);
    uint32_t sslot = 4;
    CHECK_EQ_INT(kvf_sender_init(s, PAGES, 0), KVF_OK);
    CHECK_EQ_INT(kvf_sender_set_state(s, &sslot, 1), KVF_OK);
    CHECK_EQ_INT(kvf_sender_send(s, src, PAGES, 1), KVF_OK);
    CHECK_EQ_INT(wait_sender(s, KVF_POLL_SUCCESS), KVF_POLL_SUCCESS);
    CHECK_EQ_INT(wait_receiver(r, KVF_POLL_SUCCESS), KVF_POLL_SUCCESS);
    for (int b = 0; b < NKV; b++)
        CHECK(memcmp(dec.kv[b], pre.kv[b], (size_t)PAGES * PAGE_B) == 0);
    CHECK(kvf_engine_stream_bytes(dec.eng, 1) > 0);
    kvf_sender_destroy(s);
    kvf_receiver_destroy(r);
    close(fd1);
    close(fd0);
    side_fini(&dec);
    side_fini(&pre);
}

KVF_TEST_MAIN(
    KVF_CASE(test_two_streams),
    KVF_CASE(test_smaller_setting_wins),
    KVF_CASE(test_stalled_stream_fails_the_room),
    KVF_CASE(test_joins_refused)
)
