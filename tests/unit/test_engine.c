/*
 * Engine tests in one process: a prefill engine (hosting the registry) and
 * a decode engine talking over real loopback TCP.  The multi-process tests
 * (tests/mp) cover separate processes; these pin down the API contract.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <pthread.h>

#include <arpa/inet.h>
#include <dirent.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>

#include "bootstrap/bootstrap.h"
#include "core/engine.h"
#include "core/peer.h"
#include "core/room.h"
#include "kvferry/kvferry.h"
#include "transport/transport.h"
#define PAGES 64
#include "unit/kvf_sides.h"
#include "util/time.h"
#include "wire/wire.h"

/* A sanitizer's allocator reserves far more address space than it uses. */
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define KVF_TEST_SANITIZED 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#define KVF_TEST_SANITIZED 1
#endif
#endif

/* Engine settings of the next side (tests change them); every case runs
 * over tcp, then shm (side_transport). */
static const char *next_faults;
static int next_checksum;
static unsigned next_transfer_ms = 5000, next_hb_interval_ms = 500, next_hb_timeout_ms = 2500;
static unsigned next_busy_poll_us;

static void tune(kvf_engine_params_t *p)
{
    p->busy_poll_us = next_busy_poll_us;
    p->transfer_timeout_ms = next_transfer_ms;
    p->heartbeat_interval_ms = next_hb_interval_ms;
    p->heartbeat_timeout_ms = next_hb_timeout_ms;
    p->faults = next_faults;
    p->checksum = next_checksum;
}

/* A side with the settings above, with a state buffer of 8-byte items
 * (with_state) or none. */
static void eside(side_t *s, kvf_role_t role, const char *bs, int with_state)
{
    side_tune = tune;
    side_state_b = with_state ? 8 : 0;
    side_init(s, role, bs, NULL);
}

static void pair_up(side_t *pre, side_t *dec, uint32_t dec_page, const char *dec_dtype,
                    char *bs, size_t bslen)
{
    eside(pre, KVF_ROLE_PREFILL, "127.0.0.1:0", 1);
    CHECK_EQ_INT(kvf_engine_bootstrap_addr(pre->eng, bs, bslen), KVF_OK);
    side_page = dec_page;
    side_dtype = dec_dtype;
    eside(dec, KVF_ROLE_DECODE, NULL, 1);
    side_page = 0;
    side_dtype = NULL;
}

static void test_one_room(void)
{
    side_t pre, dec;
    char bs[64];
    pair_up(&pre, &dec, PAGE, "bfloat16", bs, sizeof(bs));

    for (int b = 0; b < NKV; b++)
        for (size_t i = 0; i < (size_t)PAGES * PAGE_B; i++)
            pre.kv[b][i] = (uint8_t)(i * 7 + b * 13 + 1);
    memcpy(pre.aux + 3 * AUX_B, "room-42-tag-0001", AUX_B);
    pre.state[5 * 8] = 0x5a;

    kvf_sender_t *s;
    kvf_receiver_t *r;
    uint32_t src[6] = {10, 11, 12, 30, 31, 2};
    uint32_t dst[6] = {40, 41, 7, 8, 9, 63};
    uint32_t sst = 5, dst_state = 1;
    CHECK_EQ_INT(kvf_sender_create(pre.eng, bs, 42, &s), KVF_OK);
    CHECK_EQ_INT(kvf_receiver_create(dec.eng, bs, 42, -1, &r), KVF_OK);
    CHECK_EQ_INT(kvf_receiver_init(r, dst, 6, 2, &dst_state, 1), KVF_OK);
    CHECK_EQ_INT(kvf_receiver_init(r, dst, 6, 2, &dst_state, 1), KVF_ERR_STATE);
    wait_sender(s, KVF_POLL_WAITING_FOR_INPUT);
    CHECK_EQ_INT(kvf_sender_poll(s), KVF_POLL_WAITING_FOR_INPUT);
    CHECK_EQ_INT(kvf_sender_init(s, 6, 3), KVF_OK);
    CHECK_EQ_INT(kvf_sender_init(s, 6, 3), KVF_ERR_STATE);
    CHECK_EQ_INT(kvf_sender_set_state(s, &sst, 1), KVF_OK);
    uint32_t bad = PAGES;
    CHECK_EQ_INT(kvf_sender_send(s, &bad, 1, 0), KVF_ERR_OUT_OF_RANGE);
    CHECK_EQ_INT(kvf_sender_send(s, src, 4, 0), KVF_OK);
    CHECK_EQ_INT(kvf_sender_send(s, src + 4, 1, 1), KVF_ERR_INVALID_PARAM);
    CHECK_EQ_INT(kvf_sender_send(s, src + 4, 2, 1), KVF_OK);
    CHECK_EQ_INT(kvf_sender_send(s, src, 1, 1), KVF_ERR_STATE);
    wait_final(s, r);
    CHECK_EQ_INT(kvf_sender_poll(s), KVF_POLL_SUCCESS);
    CHECK_EQ_INT(kvf_receiver_poll(r), KVF_POLL_SUCCESS);
    for (int b = 0; b < NKV; b++)
        for (int i = 0; i < 6; i++)
            CHECK(memcmp(dec.kv[b] + (size_t)dst[i] * PAGE_B,
                         pre.kv[b] + (size_t)src[i] * PAGE_B, PAGE_B) == 0);
    CHECK(memcmp(dec.aux + 2 * AUX_B, "room-42-tag-0001", AUX_B) == 0);
    CHECK_EQ_INT(dec.state[1 * 8], 0x5a);
    /* Nothing outside the destination was touched. */
    CHECK_EQ_INT(dec.kv[0][0], 0);
    CHECK_EQ_INT(dec.aux[0], 0);
    kvf_failure_t f;
    kvf_failure_init(&f);
    CHECK_EQ_INT(kvf_receiver_failure(r, &f), KVF_ERR_AGAIN);
    kvf_sender_destroy(s);
    kvf_receiver_destroy(r);

    kvf_engine_stats_t st;
    kvf_engine_stats_init(&st);
    kvf_engine_stats(dec.eng, &st);
    CHECK_EQ_INT(st.rooms_succeeded, 1);
    CHECK(strcmp(kvf_engine_transport(dec.eng), side_transport) == 0);
    CHECK(strcmp(kvf_engine_transport(pre.eng), side_transport) == 0);
    CHECK(st.bytes_received == 6ull * PAGE_B * NKV + AUX_B + 8);
    side_fini(&dec);
    side_fini(&pre);
}

/*
 * Creates, kvf_sender_send, kvf_sender_init and kvf_receiver_init publish
 * without the engine lock and the lanes take them in (room.c,
 * kvf__room_submit): application threads each drive their own rooms one
 * page per call, with no wait between calls, so that calls arrive while a
 * lane is taking others in and several are taken in at once; every byte
 * lands where its page was sent.  Each thread then destroys its final
 * rooms (which only marks them for the lanes) and at once creates rooms of
 * the same ids again, which must be allowed and must move every byte
 * again.  A room destroyed right after a call, still listed for the
 * lanes, is taken off the list first (a sanitizer build sees a freed room
 * read otherwise).
 */
#define PUB_THREADS 4
#define PUB_PAGES   8   /* per room: the threads' pages fill PAGES (64) */

typedef struct {
    side_t     *pre, *dec;
    const char *bs;
    unsigned    t;
    kvf_sender_t   *s;
    kvf_receiver_t *r;
} pub_arg_t;

static uint32_t pub_src(unsigned t, unsigned i) { return t * PUB_PAGES + i; }
static uint32_t pub_dst(unsigned t, unsigned i) { return PAGES - 1 - (t * PUB_PAGES + i); }

/* Every page of thread t's room in place (dec's pages, as pre sent them). */
static int pub_landed(const side_t *pre, const side_t *dec, unsigned t)
{
    for (int b = 0; b < NKV; b++)
        for (unsigned i = 0; i < PUB_PAGES; i++)
            if (memcmp(dec->kv[b] + (size_t)pub_dst(t, i) * PAGE_B,
                       pre->kv[b] + (size_t)pub_src(t, i) * PAGE_B, PAGE_B) != 0)
                return 0;
    return 1;
}

static void pub_room(pub_arg_t *a)
{
    uint64_t room = 700 + a->t;
    uint32_t dst[PUB_PAGES];
    for (unsigned i = 0; i < PUB_PAGES; i++)
        dst[i] = pub_dst(a->t, i);
    CHECK_EQ_INT(kvf_sender_create(a->pre->eng, a->bs, room, &a->s), KVF_OK);
    CHECK_EQ_INT(kvf_receiver_create(a->dec->eng, a->bs, room, -1, &a->r), KVF_OK);
    CHECK_EQ_INT(kvf_receiver_init(a->r, dst, PUB_PAGES, a->t, NULL, 0), KVF_OK);
    CHECK_EQ_INT(wait_sender(a->s, KVF_POLL_WAITING_FOR_INPUT), KVF_POLL_WAITING_FOR_INPUT);
    CHECK_EQ_INT(kvf_sender_init(a->s, PUB_PAGES, a->t), KVF_OK);
    for (unsigned i = 0; i < PUB_PAGES; i++) {
        uint32_t page = pub_src(a->t, i);
        CHECK_EQ_INT(kvf_sender_send(a->s, &page, 1, i + 1 == PUB_PAGES), KVF_OK);
    }
}

static void *pub_thread(void *arg)
{
    pub_arg_t *a = arg;
    pub_room(a);
    wait_final(a->s, a->r);
    CHECK_EQ_INT(kvf_receiver_poll(a->r), KVF_POLL_SUCCESS);
    CHECK(pub_landed(a->pre, a->dec, a->t));
    for (int b = 0; b < NKV; b++)          /* the pages are ours again */
        for (unsigned i = 0; i < PUB_PAGES; i++)
            memset(a->dec->kv[b] + (size_t)pub_dst(a->t, i) * PAGE_B, 0, PAGE_B);
    kvf_sender_destroy(a->s);
    kvf_receiver_destroy(a->r);
    pub_room(a);                           /* the same ids, at once */
    return NULL;
}

static void test_sends_published_from_threads(void)
{
    side_t pre, dec;
    char bs[64];
    pair_up(&pre, &dec, PAGE, "bfloat16", bs, sizeof(bs));
    for (int b = 0; b < NKV; b++)
        for (size_t i = 0; i < (size_t)PAGES * PAGE_B; i++)
            pre.kv[b][i] = (uint8_t)(i * 5 + b * 11 + 3);

    /* Sent, then destroyed at once: listed for the lanes when destroyed. */
    kvf_sender_t *gone;
    kvf_receiver_t *gone_r;
    uint32_t one = 0, one_dst = 0;   /* the threads' rooms' pages later */
    CHECK_EQ_INT(kvf_sender_create(pre.eng, bs, 699, &gone), KVF_OK);
    CHECK_EQ_INT(kvf_receiver_create(dec.eng, bs, 699, -1, &gone_r), KVF_OK);
    CHECK_EQ_INT(kvf_receiver_init(gone_r, &one_dst, 1, 7, NULL, 0), KVF_OK);
    CHECK_EQ_INT(wait_sender(gone, KVF_POLL_WAITING_FOR_INPUT), KVF_POLL_WAITING_FOR_INPUT);
    CHECK_EQ_INT(kvf_sender_init(gone, 1, 7), KVF_OK);
    CHECK_EQ_INT(kvf_sender_send(gone, &one, 1, 0), KVF_OK);   /* not the last */
    kvf_sender_destroy(gone);
    CHECK_EQ_INT(wait_receiver(gone_r, KVF_POLL_SUCCESS), KVF_POLL_FAILED);
    kvf_receiver_destroy(gone_r);
    /* A destination given (a second one refused before a lane took the
     * first in, as after), then destroyed at once. */
    CHECK_EQ_INT(kvf_receiver_create(dec.eng, bs, 698, -1, &gone_r), KVF_OK);
    CHECK_EQ_INT(kvf_receiver_init(gone_r, &one_dst, 1, 7, NULL, 0), KVF_OK);
    CHECK_EQ_INT(kvf_receiver_init(gone_r, &one_dst, 1, 7, NULL, 0), KVF_ERR_STATE);
    kvf_receiver_destroy(gone_r);
    /* Created and destroyed before a lane took it in. */
    CHECK_EQ_INT(kvf_sender_create(pre.eng, bs, 697, &gone), KVF_OK);
    kvf_sender_destroy(gone);

    pthread_t th[PUB_THREADS];
    pub_arg_t args[PUB_THREADS];
    for (unsigned t = 0; t < PUB_THREADS; t++) {
        args[t] = (pub_arg_t){&pre, &dec, bs, t, NULL, NULL};
        CHECK_EQ_INT(pthread_create(&th[t], NULL, pub_thread, &args[t]), 0);
    }
    for (unsigned t = 0; t < PUB_THREADS; t++)
        pthread_join(th[t], NULL);
    for (unsigned t = 0; t < PUB_THREADS; t++) {
        wait_final(args[t].s, args[t].r);
        CHECK_EQ_INT(kvf_sender_poll(args[t].s), KVF_POLL_SUCCESS);
        CHECK_EQ_INT(kvf_receiver_poll(args[t].r), KVF_POLL_SUCCESS);
        CHECK(pub_landed(&pre, &dec, t));
        kvf_sender_destroy(args[t].s);
        kvf_receiver_destroy(args[t].r);
    }
    /* Destroyed rooms are gone from the engine's count at once. */
    kvf_engine_stats_t st;
    kvf_engine_stats_init(&st);
    CHECK_EQ_INT(kvf_engine_stats(dec.eng, &st), KVF_OK);
    for (int k = 0; k <= KVF_POLL_SUCCESS; k++)
        CHECK_EQ_INT(st.rooms_by_state[k], 0);
    CHECK_EQ_INT(st.rooms_succeeded, 2 * PUB_THREADS);
    side_fini(&dec);
    side_fini(&pre);
}

/*
 * Two threads create rooms of the same ids at once (no engine lock: the
 * ids' own map): of each id's two creates exactly one is the room's, the
 * other is refused KVF_ERR_ROOM_IN_USE.
 */
#define RACE_IDS 200

typedef struct {
    kvf_engine_t  *eng;
    const char    *bs;
    kvf_sender_t  *s[RACE_IDS];
} race_arg_t;

static void *race_thread(void *arg)
{
    race_arg_t *a = arg;
    for (unsigned i = 0; i < RACE_IDS; i++) {
        kvf_status_t st = kvf_sender_create(a->eng, a->bs, 5000 + i, &a->s[i]);
        CHECK(st == KVF_OK || st == KVF_ERR_ROOM_IN_USE);
        if (st != KVF_OK)
            a->s[i] = NULL;
    }
    return NULL;
}

static void test_creates_race_for_an_id(void)
{
    side_t pre, dec;
    char bs[64];
    pair_up(&pre, &dec, PAGE, "bfloat16", bs, sizeof(bs));
    pthread_t th[2];
    race_arg_t args[2] = {{pre.eng, bs, {0}}, {pre.eng, bs, {0}}};
    for (int t = 0; t < 2; t++)
        CHECK_EQ_INT(pthread_create(&th[t], NULL, race_thread, &args[t]), 0);
    for (int t = 0; t < 2; t++)
        pthread_join(th[t], NULL);
    for (unsigned i = 0; i < RACE_IDS; i++) {
        CHECK_EQ_INT((args[0].s[i] != NULL) + (args[1].s[i] != NULL), 1);
        kvf_sender_destroy(args[0].s[i] ? args[0].s[i] : args[1].s[i]);
    }
    kvf_engine_stats_t st;
    kvf_engine_stats_init(&st);
    CHECK_EQ_INT(kvf_engine_stats(pre.eng, &st), KVF_OK);
    CHECK_EQ_INT(st.rooms_by_state[KVF_POLL_BOOTSTRAPPING], 0);
    CHECK_EQ_INT(st.rooms_failed, RACE_IDS);      /* destroyed unfinished */
    side_fini(&dec);
    side_fini(&pre);
}

static void test_page_size_mismatch(void)
{
    side_t pre, dec;
    char bs[64];
    pair_up(&pre, &dec, 1, "bfloat16", bs, sizeof(bs));
    kvf_sender_t *s;
    kvf_receiver_t *r;
    uint32_t dst[2] = {1, 2};
    CHECK_EQ_INT(kvf_sender_create(pre.eng, bs, 7, &s), KVF_OK);
    CHECK_EQ_INT(kvf_receiver_create(dec.eng, bs, 7, -1, &r), KVF_OK);
    CHECK_EQ_INT(kvf_receiver_init(r, dst, 2, 0, NULL, 0), KVF_OK);
    wait_final(s, r);
    CHECK_EQ_INT(kvf_receiver_poll(r), KVF_POLL_FAILED);
    CHECK_EQ_INT(kvf_sender_poll(s), KVF_POLL_FAILED);
    kvf_failure_t f;
    kvf_failure_init(&f);
    CHECK_EQ_INT(kvf_receiver_failure(r, &f), KVF_OK);
    CHECK_EQ_INT(f.status, KVF_ERR_INCOMPATIBLE);
    CHECK_STR_CONTAINS(f.reason, "Page size mismatch: prefill server has page_size=4, "
                                 "but decode server has page_size=1.");
    CHECK_EQ_INT(kvf_receiver_failure(r, &f), KVF_ERR_NOT_FOUND);
    CHECK_EQ_INT(kvf_sender_failure(s, &f), KVF_OK);
    CHECK_STR_CONTAINS(f.reason, "Page size mismatch");
    CHECK_EQ_INT(f.from_another_rank, 1);
    CHECK_EQ_INT(f.origin_side, KVF_ROLE_DECODE);
    kvf_sender_destroy(s);
    kvf_receiver_destroy(r);
    side_fini(&dec);
    side_fini(&pre);
}

/* What a failed receiver's application calls, on another thread. */
typedef struct {
    kvf_receiver_t   *r;
    kvf_failure_t     f;
    kvf_room_metric_t m;
    kvf_status_t      fail_st, failure_st, metric_st, await_st;
} failed_reads_t;

static void read_failed(void *arg)
{
    failed_reads_t *a = arg;
    kvf_receiver_abort(a->r);                /* no-ops on a final room */
    a->fail_st = kvf_receiver_fail(a->r, KVF_ERR_BAD_INDICES, "too late");
    a->failure_st = kvf_receiver_failure(a->r, &a->f);
    a->metric_st = kvf_receiver_metric(a->r, &a->m);
    a->await_st = kvf_receiver_await_failure(a->r, 0);
}

/* On a failed room, abort and fail (no-ops), the record, the metric and
 * the wait for its failure run without the engine lock: they return while
 * the lock is held (here by this thread, as a lane's pass would). */
static void check_failed_reads_lock_free(kvf_engine_t *eng, kvf_receiver_t *r)
{
    failed_reads_t a = {.r = r, .m = {.size = sizeof(a.m)}};
    kvf_failure_init(&a.f);
    CHECK_EQ_INT(call_while_locked(eng, read_failed, &a), 0);
    CHECK_EQ_INT(a.fail_st, KVF_OK);
    CHECK_EQ_INT(a.failure_st, KVF_OK);
    CHECK_EQ_INT(a.f.status, KVF_ERR_ABORTED);      /* the first cause stays */
    CHECK_EQ_INT(a.f.from_another_rank, 0);
    CHECK_EQ_INT(kvf_receiver_failure(r, &a.f), KVF_ERR_NOT_FOUND);   /* once */
    CHECK_EQ_INT(a.metric_st, KVF_OK);
    CHECK(a.m.bytes == 0 && a.m.alloc_s < 60 && a.m.transfer_s < 60);
    kvf_room_metric_t again = {.size = sizeof(again)};
    CHECK_EQ_INT(kvf_receiver_metric(r, &again), KVF_OK);
    CHECK(again.transfer_s == a.m.transfer_s);           /* final: its end is fixed */
    CHECK_EQ_INT(a.await_st, KVF_OK);
}

/* One side's abort (receiver) or fail (sender) of a live room, on another
 * thread, and what that thread sees when it returns. */
typedef struct {
    kvf_sender_t   *s;
    kvf_receiver_t *r;
    kvf_poll_t      seen;
    int             released;
    kvf_failure_t   f;
    kvf_status_t    fail_st, failure_st, prefix_st;
    uint32_t        prefix;
} live_fail_t;

static void fail_live(void *arg)
{
    live_fail_t *a = arg;
    if (a->r != NULL) {
        kvf_receiver_abort(a->r);
        a->seen = kvf_receiver_poll(a->r);
        a->released = kvf_receiver_pages_released(a->r);
        a->failure_st = kvf_receiver_failure(a->r, &a->f);
    } else {
        /* What SGLang's prefill asks of a room WAITING_FOR_INPUT, first. */
        a->prefix_st = kvf_sender_decode_prefix_len(a->s, &a->prefix);
        a->fail_st = kvf_sender_fail(a->s, KVF_ERR_BAD_INDICES, "refused by its scheduler");
        a->seen = kvf_sender_poll(a->s);
        a->failure_st = kvf_sender_failure(a->s, &a->f);
    }
}

/*
 * kvf_*_abort and kvf_*_fail on a live room publish without the engine
 * lock, and kvf_sender_decode_prefix_len reads without it: they return
 * while a lane would hold it.  The room is FAILED with
 * the application's record at once; a receiver's poll shows its state
 * before, and its pages stay unreleased, until a lane took the abort in
 * (a lane checked the room live before, and may be placing bytes); the
 * peers hear it then.
 */
static void test_abort_of_live_room_without_lock(void)
{
    side_t pre, dec;
    char bs[64];
    uint32_t dst[2] = {1, 2};
    pair_up(&pre, &dec, PAGE, "bfloat16", bs, sizeof(bs));
    for (int side = 0; side < 2; side++) {
        kvf_sender_t *s;
        kvf_receiver_t *r;
        uint64_t room = 31 + (uint64_t)side;
        CHECK_EQ_INT(kvf_sender_create(pre.eng, bs, room, &s), KVF_OK);
        CHECK_EQ_INT(kvf_receiver_create(dec.eng, bs, room, -1, &r), KVF_OK);
        CHECK_EQ_INT(kvf_receiver_init(r, dst, 2, 0, NULL, 0), KVF_OK);
        CHECK_EQ_INT(wait_sender(s, KVF_POLL_WAITING_FOR_INPUT), KVF_POLL_WAITING_FOR_INPUT);
        CHECK_EQ_INT(wait_receiver(r, KVF_POLL_WAITING_FOR_INPUT),
                     KVF_POLL_WAITING_FOR_INPUT);
        live_fail_t a = {.s = side ? s : NULL, .r = side ? NULL : r};
        kvf_failure_init(&a.f);
        CHECK_EQ_INT(call_while_locked(side ? pre.eng : dec.eng, fail_live, &a), 0);
        CHECK_EQ_INT(a.failure_st, KVF_OK);
        CHECK_EQ_INT(a.f.from_another_rank, 0);
        kvf_failure_t there;
        kvf_failure_init(&there);
        if (side == 0) {
            CHECK_EQ_INT(a.seen, KVF_POLL_WAITING_FOR_INPUT);
            CHECK_EQ_INT(a.released, 0);
            CHECK_EQ_INT(a.f.status, KVF_ERR_ABORTED);
            CHECK_EQ_INT(a.f.origin_side, KVF_ROLE_DECODE);
            CHECK_EQ_INT(wait_receiver(r, KVF_POLL_SUCCESS), KVF_POLL_FAILED);
            CHECK(kvf_receiver_pages_released(r));
            CHECK_EQ_INT(wait_sender(s, KVF_POLL_SUCCESS), KVF_POLL_FAILED);
            CHECK_EQ_INT(kvf_sender_failure(s, &there), KVF_OK);
            CHECK_EQ_INT(there.status, KVF_ERR_ABORTED);
        } else {
            CHECK_EQ_INT(a.prefix_st, KVF_OK);
            CHECK_EQ_INT(a.prefix, 0);
            CHECK_EQ_INT(a.fail_st, KVF_OK);
            CHECK_EQ_INT(a.seen, KVF_POLL_FAILED);
            CHECK_EQ_INT(a.f.status, KVF_ERR_BAD_INDICES);
            CHECK_STR_CONTAINS(a.f.reason, "refused by its scheduler");
            CHECK_EQ_INT(wait_receiver(r, KVF_POLL_SUCCESS), KVF_POLL_FAILED);
            CHECK_EQ_INT(kvf_receiver_failure(r, &there), KVF_OK);
            CHECK_EQ_INT(there.status, KVF_ERR_BAD_INDICES);
        }
        CHECK_EQ_INT(there.from_another_rank, 1);
        kvf_sender_destroy(s);
        kvf_receiver_destroy(r);
    }
    side_fini(&dec);
    side_fini(&pre);
}

/*
 * An abort races the lanes finishing the room: around the last chunk, one
 * side or the other aborts.  Whichever turn comes first wins on that side:
 * a receiver that succeeded holds every byte, one that failed did so by
 * this abort or by the sender's; a sender fails with the abort (its own,
 * or heard from the decode side) unless it succeeded first, and it
 * succeeds only if the receiver did, or had answered the last bytes when
 * its own abort came.  Destroyed at once, then the next room.
 */
#define RACE_ROOMS 200

static void race_one(side_t *pre, side_t *dec, const char *bs, uint64_t room, int rx_aborts)
{
    kvf_sender_t *s;
    kvf_receiver_t *r;
    uint32_t src[2] = {room % 8, 8 + room % 8}, dst[2] = {40 + room % 8, 50 + room % 8};
    kvf_failure_t f;
    CHECK_EQ_INT(kvf_sender_create(pre->eng, bs, room, &s), KVF_OK);
    CHECK_EQ_INT(kvf_receiver_create(dec->eng, bs, room, -1, &r), KVF_OK);
    CHECK_EQ_INT(kvf_receiver_init(r, dst, 2, 0, NULL, 0), KVF_OK);
    CHECK_EQ_INT(wait_sender(s, KVF_POLL_WAITING_FOR_INPUT), KVF_POLL_WAITING_FOR_INPUT);
    CHECK_EQ_INT(kvf_sender_init(s, 2, 0), KVF_OK);
    CHECK_EQ_INT(kvf_sender_send(s, src, 2, 1), KVF_OK);
    /* At once, or while the bytes move, or as they end: spread, not waited on. */
    for (volatile unsigned spin = 0; spin < (unsigned)(room % 16) * 20000; spin++)
        ;
    if (rx_aborts)
        kvf_receiver_abort(r);
    else
        kvf_sender_abort(s);
    kvf_poll_t rs = wait_receiver(r, KVF_POLL_SUCCESS);
    kvf_poll_t ss = wait_sender(s, KVF_POLL_SUCCESS);
    CHECK(rs == KVF_POLL_SUCCESS || rs == KVF_POLL_FAILED);
    CHECK(ss == KVF_POLL_SUCCESS || ss == KVF_POLL_FAILED);
    if (rs == KVF_POLL_SUCCESS) {
        for (int b = 0; b < NKV; b++)
            for (int i = 0; i < 2; i++)
                CHECK(memcmp(dec->kv[b] + (size_t)dst[i] * PAGE_B,
                             pre->kv[b] + (size_t)src[i] * PAGE_B, PAGE_B) == 0);
    } else {
        kvf_failure_init(&f);
        CHECK_EQ_INT(kvf_receiver_failure(r, &f), KVF_OK);
        CHECK_EQ_INT(f.status, KVF_ERR_ABORTED);
        CHECK_EQ_INT(f.from_another_rank, !rx_aborts);
    }
    if (ss == KVF_POLL_FAILED) {
        kvf_failure_init(&f);
        CHECK_EQ_INT(kvf_sender_failure(s, &f), KVF_OK);
        CHECK_EQ_INT(f.status, KVF_ERR_ABORTED);
        CHECK_EQ_INT(f.from_another_rank, rx_aborts);
    } else {
        /* A sender aborted first fails.  One that succeeded keeps its
         * success when the receiver's abort came as the room ended (the
         * receiver had answered the last bytes: the abort is not the
         * prefill side's failure), and learns its record all the same. */
        CHECK(rs == KVF_POLL_SUCCESS || rx_aborts);
    }
    kvf_sender_destroy(s);
    kvf_receiver_destroy(r);
}

static void test_abort_races_the_lanes(void)
{
    side_t pre, dec;
    char bs[64];
    pair_up(&pre, &dec, PAGE, "bfloat16", bs, sizeof(bs));
    for (uint64_t k = 0; k < RACE_ROOMS; k++)
        race_one(&pre, &dec, bs, 1000 + k, (int)(k & 1));
    side_fini(&dec);
    side_fini(&pre);
}

/* A receiver that failed before its destination was given, then given one:
 * its metric says it never had one (no time from a destination given
 * after the end). */
static void test_metric_of_room_failed_first(void)
{
    side_t pre, dec;
    char bs[64];
    pair_up(&pre, &dec, PAGE, "bfloat16", bs, sizeof(bs));
    kvf_receiver_t *r;
    uint32_t dst[2] = {1, 2};
    CHECK_EQ_INT(kvf_receiver_create(dec.eng, bs, 12, -1, &r), KVF_OK);
    kvf_receiver_abort(r);
    /* FAILED once a lane took the abort in: no byte can land from then. */
    CHECK_EQ_INT(wait_receiver(r, KVF_POLL_SUCCESS), KVF_POLL_FAILED);
    CHECK_EQ_INT(kvf_receiver_init(r, dst, 2, 0, NULL, 0), KVF_OK);
    kvf__lock(dec.eng);
    kvf__rooms_take_submitted(dec.eng);      /* as a lane's next pass */
    kvf__unlock(dec.eng);
    kvf_room_metric_t m = {.size = sizeof(m)};
    CHECK_EQ_INT(kvf_receiver_metric(r, &m), KVF_OK);
    CHECK(m.bytes == 0 && m.alloc_s == 0 && m.transfer_s == 0);
    kvf_receiver_destroy(r);
    side_fini(&dec);
    side_fini(&pre);
}

static void test_abort_propagates(void)
{
    side_t pre, dec;
    char bs[64];
    pair_up(&pre, &dec, PAGE, "bfloat16", bs, sizeof(bs));
    kvf_sender_t *s;
    kvf_receiver_t *r;
    uint32_t dst[2] = {1, 2};
    CHECK_EQ_INT(kvf_sender_create(pre.eng, bs, 9, &s), KVF_OK);
    CHECK_EQ_INT(kvf_sender_create(pre.eng, bs, 9, &s), KVF_ERR_ROOM_IN_USE);
    CHECK_EQ_INT(kvf_receiver_create(dec.eng, bs, 9, -1, &r), KVF_OK);
    CHECK_EQ_INT(kvf_receiver_init(r, dst, 2, 0, NULL, 0), KVF_OK);
    wait_sender(s, KVF_POLL_WAITING_FOR_INPUT);
    CHECK_EQ_INT(kvf_receiver_pages_released(r), 0);
    kvf_receiver_abort(r);
    wait_final(s, r);
    CHECK_EQ_INT(kvf_receiver_pages_released(r), 1);
    kvf_failure_t f;
    kvf_failure_init(&f);
    CHECK_EQ_INT(kvf_sender_failure(s, &f), KVF_OK);
    CHECK_EQ_INT(f.status, KVF_ERR_ABORTED);
    CHECK_EQ_INT(f.from_another_rank, 1);
    CHECK_STR_CONTAINS(f.reason, "aborted by the application on decode rank 0");
    check_failed_reads_lock_free(dec.eng, r);
    kvf_sender_destroy(s);
    kvf_receiver_destroy(r);
    side_fini(&dec);
    side_fini(&pre);
}

/* Lanes of `eng` counted awake (sync.h): 0 once every one sleeps. */
static int lanes_awake(kvf_engine_t *eng)
{
    return atomic_load(&kvf__sync(eng)->awake);
}

/* Wait up to 5 s for every lane of both engines to sleep.  @return 1 if
 * they did. */
static int lanes_sleep(side_t *a, side_t *b)
{
    for (int i = 0; i < 5000; i++) {
        if (lanes_awake(a->eng) == 0 && lanes_awake(b->eng) == 0)
            return 1;
        struct timespec ts = {0, 1000000};
        nanosleep(&ts, NULL);
    }
    return 0;
}

/*
 * Busy polling (kvf_engine_params_t.busy_poll_us): rooms move with it as
 * without (the published-from-threads case runs with it on: calls that
 * find a lane awake and wake none); after their work the lanes stay
 * counted awake through the window, which is what spares a publishing
 * call its wake; and once the engine has no rooms and the window has
 * passed they sleep again, so an idle engine spins no CPU.  Out of
 * range, it is refused, from the parameter or from KVF_BUSY_POLL_US.
 */
static void test_busy_poll(void)
{
    kvf_engine_params_t p;
    setenv("KVF_BUSY_POLL_US", "250", 1);
    kvf_engine_params_init(&p);
    CHECK_EQ_INT(p.busy_poll_us, 250);
    setenv("KVF_BUSY_POLL_US", "1000001", 1);    /* over the bound: the default */
    kvf_engine_params_init(&p);
    CHECK_EQ_INT(p.busy_poll_us, 0);
    unsetenv("KVF_BUSY_POLL_US");
    kvf_engine_t *eng = NULL;
    p.busy_poll_us = 1000001;
    CHECK_EQ_INT(kvf_engine_create(&p, &eng), KVF_ERR_INVALID_PARAM);
    CHECK(eng == NULL);

    next_busy_poll_us = 1000000;                 /* a second: no hiccup ends it */
    test_sends_published_from_threads();
    side_t pre, dec;
    char bs[64];
    pair_up(&pre, &dec, PAGE, "bfloat16", bs, sizeof(bs));
    next_busy_poll_us = 0;
    kvf_sender_t *s;
    kvf_receiver_t *r;
    uint32_t page = 3;
    CHECK_EQ_INT(kvf_sender_create(pre.eng, bs, 9, &s), KVF_OK);
    CHECK_EQ_INT(kvf_receiver_create(dec.eng, bs, 9, -1, &r), KVF_OK);
    CHECK_EQ_INT(kvf_receiver_init(r, &page, 1, 0, NULL, 0), KVF_OK);
    wait_sender(s, KVF_POLL_WAITING_FOR_INPUT);
    CHECK_EQ_INT(kvf_sender_init(s, 1, 0), KVF_OK);
    CHECK_EQ_INT(kvf_sender_send(s, &page, 1, 1), KVF_OK);
    wait_final(s, r);
    CHECK_EQ_INT(kvf_receiver_poll(r), KVF_POLL_SUCCESS);
    /* Idle for a tenth of the window: without busy polling every lane
     * would be asleep by now (but for a tick's pass, microseconds in
     * 50 ms). */
    struct timespec tenth = {0, 100000000};
    nanosleep(&tenth, NULL);
    CHECK(lanes_awake(pre.eng) > 0);
    CHECK(lanes_awake(dec.eng) > 0);
    /* Without rooms, neither ticks nor heartbeats (every 500 ms, events
     * on the lanes) open the window again. */
    kvf_sender_destroy(s);
    kvf_receiver_destroy(r);
    CHECK(lanes_sleep(&pre, &dec));
    side_fini(&dec);
    side_fini(&pre);
}

static void test_bad_calls(void)
{
    side_t pre, dec;
    char bs[64];
    pair_up(&pre, &dec, PAGE, "bfloat16", bs, sizeof(bs));
    kvf_receiver_t *r;
    uint32_t dup[2] = {3, 3}, big[1] = {PAGES};
    CHECK_EQ_INT(kvf_receiver_create(dec.eng, "no-port", 1, -1, &r), KVF_ERR_INVALID_PARAM);
    CHECK_EQ_INT(kvf_receiver_create(dec.eng, bs, 1, -1, &r), KVF_OK);
    CHECK_EQ_INT(kvf_receiver_init(r, big, 1, 0, NULL, 0), KVF_ERR_OUT_OF_RANGE);
    CHECK_EQ_INT(kvf_receiver_init(r, dup, 2, 0, NULL, 0), KVF_ERR_INVALID_PARAM);
    CHECK_EQ_INT(kvf_receiver_init(r, dup, 1, SLOTS, NULL, 0), KVF_ERR_OUT_OF_RANGE);
    kvf_receiver_destroy(r);
    kvf_sender_t *s;
    CHECK_EQ_INT(kvf_sender_create(pre.eng, bs, 2, &s), KVF_OK);
    CHECK_EQ_INT(kvf_sender_send(s, dup, 1, 0), KVF_ERR_STATE);
    kvf_sender_destroy(s);
    CHECK_EQ_INT(kvf_sender_create(dec.eng, bs, 3, &s), KVF_ERR_STATE);
    side_fini(&dec);
    side_fini(&pre);
}

/* A prefill engine with faults pre_faults (hosting the registry, its
 * address in bs[64]) and a decode engine with dec_faults; the prefill's KV
 * holds a pattern, src[PAGES] its pages in order, dst[PAGES] a scattered
 * permutation of the decode's. */
static void faulty_pair(const char *pre_faults, const char *dec_faults, int checksum,
                        side_t *pre, side_t *dec, char *bs, uint32_t *src, uint32_t *dst)
{
    next_checksum = checksum;
    next_faults = pre_faults;
    eside(pre, KVF_ROLE_PREFILL, "127.0.0.1:0", 0);
    CHECK_EQ_INT(kvf_engine_bootstrap_addr(pre->eng, bs, 64), KVF_OK);
    next_faults = dec_faults;
    eside(dec, KVF_ROLE_DECODE, NULL, 0);
    next_faults = NULL;
    next_checksum = 0;
    for (int b = 0; b < NKV; b++)
        for (size_t i = 0; i < (size_t)PAGES * PAGE_B; i++)
            pre->kv[b][i] = (uint8_t)(i * 31 + b * 7 + 3);
    for (int i = 0; i < PAGES; i++) {
        src[i] = (uint32_t)i;
        dst[i] = (uint32_t)((i * 37) % PAGES);   /* scattered, a permutation */
    }
}

/*
 * One whole room (all 64 pages, 64 KiB of KV) from prefill to decode with
 * faults injected: `pre_faults` on the prefill engine, `dec_faults` on the
 * decode engine.  Fills the failure records of both sides.
 */
static void faulty_room(const char *pre_faults, const char *dec_faults, int checksum,
                        kvf_poll_t *ps, kvf_poll_t *ds, kvf_failure_t *pf,
                        kvf_failure_t *df, int *bytes_ok)
{
    side_t pre, dec;
    char bs[64];
    uint32_t src[PAGES], dst[PAGES];

    faulty_pair(pre_faults, dec_faults, checksum, &pre, &dec, bs, src, dst);
    kvf_sender_t *s;
    kvf_receiver_t *r;
    CHECK_EQ_INT(kvf_sender_create(pre.eng, bs, 77, &s), KVF_OK);
    CHECK_EQ_INT(kvf_receiver_create(dec.eng, bs, 77, -1, &r), KVF_OK);
    CHECK_EQ_INT(kvf_receiver_init(r, dst, PAGES, 1, NULL, 0), KVF_OK);
    wait_sender(s, KVF_POLL_WAITING_FOR_INPUT);
    CHECK_EQ_INT(kvf_sender_init(s, PAGES, 1), KVF_OK);
    CHECK_EQ_INT(kvf_sender_send(s, src, PAGES / 2, 0), KVF_OK);
    /* A fault in the first chunk may already have failed the room. */
    kvf_status_t st2 = kvf_sender_send(s, src + PAGES / 2, PAGES / 2, 1);
    CHECK(st2 == KVF_OK || (st2 == KVF_ERR_STATE && kvf_sender_poll(s) == KVF_POLL_FAILED));
    wait_final(s, r);
    *ps = kvf_sender_poll(s);
    *ds = kvf_receiver_poll(r);
    kvf_failure_init(pf);
    kvf_failure_init(df);
    kvf_sender_failure(s, pf);
    kvf_receiver_failure(r, df);
    int ok = 1;
    for (int b = 0; b < NKV; b++)
        for (int i = 0; i < PAGES; i++)
            ok &= memcmp(dec.kv[b] + (size_t)dst[i] * PAGE_B,
                         pre.kv[b] + (size_t)src[i] * PAGE_B, PAGE_B) == 0;
    *bytes_ok = ok;
    /* Whatever a fault did to the room, the sender's memory is as it was
     * (a corrupt byte is put back once its reader is done with it). */
    for (int b = 0; b < NKV; b++)
        for (size_t i = 0; i < (size_t)PAGES * PAGE_B; i++)
            if (pre.kv[b][i] != (uint8_t)(i * 31 + b * 7 + 3)) {
                fprintf(stderr, "  prefill KV buffer %d byte %zu changed by the fault\n",
                        b, i);
                CHECK(pre.kv[b][i] == (uint8_t)(i * 31 + b * 7 + 3));
                break;
            }
    kvf_sender_destroy(s);
    kvf_receiver_destroy(r);
    side_fini(&dec);
    side_fini(&pre);
}

/*
 * Two rooms one after the other over one pair of engines with faults
 * (pre_faults at the prefill, dec_faults at the decode): room `hit` (0,
 * the first, or 1) fails with `want` and a reason containing `why` on the
 * decode side (and the same status, as another rank's record, on the
 * prefill side); the other succeeds byte for byte over the same
 * connection, which stays up.
 */
static void room_fails_alone(const char *pre_faults, const char *dec_faults, uint64_t room,
                             int hit, kvf_status_t want, const char *why)
{
    side_t pre, dec;
    char bs[64];
    uint32_t pages[PAGES];
    kvf_sender_t *s[2];
    kvf_receiver_t *r[2];

    next_checksum = 1;
    next_faults = pre_faults;
    eside(&pre, KVF_ROLE_PREFILL, "127.0.0.1:0", 0);
    CHECK_EQ_INT(kvf_engine_bootstrap_addr(pre.eng, bs, sizeof(bs)), KVF_OK);
    next_faults = dec_faults;
    eside(&dec, KVF_ROLE_DECODE, NULL, 0);
    next_faults = NULL;
    next_checksum = 0;
    for (int b = 0; b < NKV; b++)
        for (size_t i = 0; i < (size_t)PAGES * PAGE_B; i++)
            pre.kv[b][i] = (uint8_t)(i * 13 + b + 1);
    for (int i = 0; i < PAGES; i++)
        pages[i] = (uint32_t)i;
    for (int k = 0; k < 2; k++) {   /* one after the other: the fault hits the first */
        CHECK_EQ_INT(kvf_sender_create(pre.eng, bs, room + (uint64_t)k, &s[k]), KVF_OK);
        CHECK_EQ_INT(kvf_receiver_create(dec.eng, bs, room + (uint64_t)k, -1, &r[k]),
                     KVF_OK);
        CHECK_EQ_INT(kvf_receiver_init(r[k], pages, PAGES, 1, NULL, 0), KVF_OK);
        wait_sender(s[k], KVF_POLL_WAITING_FOR_INPUT);
        CHECK_EQ_INT(kvf_sender_init(s[k], PAGES, 1), KVF_OK);
        kvf_status_t st = kvf_sender_send(s[k], pages, PAGES, 1);
        CHECK(st == KVF_OK || (k == hit && st == KVF_ERR_STATE));
        wait_final(s[k], r[k]);
        /* Both rooms use the same pages: check the good one's bytes now. */
        for (int b = 0; b < NKV && k != hit; b++)
            CHECK(memcmp(dec.kv[b], pre.kv[b], (size_t)PAGES * PAGE_B) == 0);
    }
    kvf_failure_t df, pf;
    kvf_failure_init(&df);
    kvf_failure_init(&pf);
    CHECK_EQ_INT(kvf_receiver_poll(r[hit]), KVF_POLL_FAILED);
    CHECK_EQ_INT(kvf_sender_poll(s[hit]), KVF_POLL_FAILED);
    CHECK_EQ_INT(kvf_receiver_failure(r[hit], &df), KVF_OK);
    CHECK_EQ_INT(kvf_sender_failure(s[hit], &pf), KVF_OK);
    CHECK_EQ_INT(df.status, want);
    CHECK_STR_CONTAINS(df.reason, why);
    CHECK_EQ_INT(pf.status, want);
    CHECK_EQ_INT(pf.from_another_rank, 1);
    CHECK_EQ_INT(kvf_receiver_poll(r[1 - hit]), KVF_POLL_SUCCESS);
    CHECK_EQ_INT(kvf_sender_poll(s[1 - hit]), KVF_POLL_SUCCESS);
    kvf_engine_stats_t st;
    kvf_engine_stats_init(&st);
    kvf_engine_stats(dec.eng, &st);
    CHECK_EQ_INT((int)st.peers_connected, 1);   /* the peer was not failed */
    for (int k = 0; k < 2; k++) {
        kvf_sender_destroy(s[k]);
        kvf_receiver_destroy(r[k]);
    }
    side_fini(&dec);
    side_fini(&pre);
}

static void first_room_fails_alone(const char *pre_faults, const char *dec_faults,
                                   uint64_t room, kvf_status_t want, const char *why)
{
    room_fails_alone(pre_faults, dec_faults, room, 0, want, why);
}

/*
 * A pulling receiver refuses a segment whose source is outside what the
 * sender registered (KVF_FAULTS=badaddr), and only that room fails
 * (docs/FAILURES.md).
 */
static void test_bad_source_fails_the_room_only(void)
{
    first_room_fails_alone("badaddr@0", NULL, 90, KVF_ERR_BAD_INDICES,
                           "outside every region it registered");
}

/*
 * A fault kept to one room (KIND@BYTES/ROOM) lets the rooms before it go
 * by, whatever their bytes, and fires inside its own: the chaos test arms
 * its resets so at start-up, one per chosen room.
 */
static void test_fault_kept_to_one_room(void)
{
    room_fails_alone("corrupt@100/86", NULL, 85, 1, KVF_ERR_CHECKSUM, "checksum mismatch");
}

/*
 * Pulled bytes: room A's DONE came while A's read was still going (held
 * back by readstall) when the connection broke, reset inside room B's
 * bytes.  That DONE is void: the read that ends as the connection goes
 * (its endpoint lets go of it) counts for nothing and is not judged
 * against it, the decode side reconnects, is sent both rooms again, and
 * both succeed byte for byte (docs/FAILURES.md, Transient faults).
 */
static void test_reset_while_done_waits_for_reads(void)
{
    side_t pre, dec;
    char bs[64];
    kvf_sender_t *s[2];
    kvf_receiver_t *r[2];
    uint32_t src[2][4] = {{0, 1, 2, 3}, {8, 9, 10, 11}};
    uint32_t dst[2][4] = {{20, 5, 33, 7}, {40, 41, 50, 60}};

    next_faults = "reset@0/72";                 /* room B's first byte */
    eside(&pre, KVF_ROLE_PREFILL, "127.0.0.1:0", 0);
    CHECK_EQ_INT(kvf_engine_bootstrap_addr(pre.eng, bs, sizeof(bs)), KVF_OK);
    next_faults = "readstall@0:20000";          /* room A's read, until it is let go */
    eside(&dec, KVF_ROLE_DECODE, NULL, 0);
    next_faults = NULL;
    for (int b = 0; b < NKV; b++)
        for (size_t i = 0; i < (size_t)PAGES * PAGE_B; i++)
            pre.kv[b][i] = (uint8_t)(i * 11 + b * 5 + 9);
    for (int k = 0; k < 2; k++) {
        CHECK_EQ_INT(kvf_sender_create(pre.eng, bs, 71 + (uint64_t)k, &s[k]), KVF_OK);
        CHECK_EQ_INT(kvf_receiver_create(dec.eng, bs, 71 + (uint64_t)k, -1, &r[k]), KVF_OK);
        CHECK_EQ_INT(kvf_receiver_init(r[k], dst[k], 4, 1 + (uint32_t)k, NULL, 0), KVF_OK);
        wait_sender(s[k], KVF_POLL_WAITING_FOR_INPUT);
        CHECK_EQ_INT(kvf_sender_init(s[k], 4, 1 + (uint32_t)k), KVF_OK);
    }
    /* A: all of it and its DONE, in one go; its read is held. */
    CHECK_EQ_INT(kvf_sender_send(s[0], src[0], 4, 1), KVF_OK);
    CHECK_EQ_INT(wait_receiver(r[0], KVF_POLL_TRANSFERRING), KVF_POLL_TRANSFERRING);
    /* B: its first byte resets the connection. */
    CHECK_EQ_INT(kvf_sender_send(s[1], src[1], 4, 1), KVF_OK);
    for (int k = 0; k < 2; k++) {
        wait_final(s[k], r[k]);
        kvf_failure_t f;
        kvf_failure_init(&f);
        if (kvf_receiver_failure(r[k], &f) == KVF_OK)
            fprintf(stderr, "  room %d failed on decode: %s\n", 71 + k, f.reason);
        CHECK_EQ_INT(kvf_receiver_poll(r[k]), KVF_POLL_SUCCESS);
        CHECK_EQ_INT(kvf_sender_poll(s[k]), KVF_POLL_SUCCESS);
        for (int b = 0; b < NKV; b++)
            for (int i = 0; i < 4; i++)
                CHECK(memcmp(dec.kv[b] + (size_t)dst[k][i] * PAGE_B,
                             pre.kv[b] + (size_t)src[k][i] * PAGE_B, PAGE_B) == 0);
    }
    for (int k = 0; k < 2; k++) {
        kvf_sender_destroy(s[k]);
        kvf_receiver_destroy(r[k]);
    }
    side_fini(&dec);
    side_fini(&pre);
}

/*
 * Pulled bytes: room A was read and its DONE checked, and the decode side
 * waits for the prefill side to confirm (its DONE_ACK is dropped, so it
 * waits on), when the connection breaks inside room B's bytes.  The
 * resumed stream sends A's DONE again, which is A's DONE now, not "a
 * second DONE": A ends at its deadline, waiting for the confirmation
 * that cannot come, not as a protocol violation.
 */
static void test_reset_while_link_confirms(void)
{
    side_t pre, dec;
    char bs[64];
    kvf_sender_t *s[2];
    kvf_receiver_t *r[2];
    kvf_failure_t f;
    kvf_failure_init(&f);
    uint32_t src[2][4] = {{0, 1, 2, 3}, {8, 9, 10, 11}};
    uint32_t dst[2][4] = {{20, 5, 33, 7}, {40, 41, 50, 60}};

    next_transfer_ms = 1500;
    next_faults = "reset@0/82";                 /* room B's first byte */
    eside(&pre, KVF_ROLE_PREFILL, "127.0.0.1:0", 0);
    CHECK_EQ_INT(kvf_engine_bootstrap_addr(pre.eng, bs, sizeof(bs)), KVF_OK);
    next_faults = "drop-ack";
    eside(&dec, KVF_ROLE_DECODE, NULL, 0);
    next_faults = NULL;
    next_transfer_ms = 5000;
    for (int k = 0; k < 2; k++) {
        CHECK_EQ_INT(kvf_sender_create(pre.eng, bs, 81 + (uint64_t)k, &s[k]), KVF_OK);
        CHECK_EQ_INT(kvf_receiver_create(dec.eng, bs, 81 + (uint64_t)k, -1, &r[k]), KVF_OK);
        CHECK_EQ_INT(kvf_receiver_init(r[k], dst[k], 4, 1 + (uint32_t)k, NULL, 0), KVF_OK);
        wait_sender(s[k], KVF_POLL_WAITING_FOR_INPUT);
        CHECK_EQ_INT(kvf_sender_init(s[k], 4, 1 + (uint32_t)k), KVF_OK);
    }
    /* A: once its bytes count, its DONE has been checked (the same step). */
    CHECK_EQ_INT(kvf_sender_send(s[0], src[0], 4, 1), KVF_OK);
    kvf_engine_stats_t st;
    kvf_engine_stats_init(&st);
    uint64_t until = kvf_now_ms() + 5000;
    do {
        sleep_ms(1);
        kvf_engine_stats(dec.eng, &st);
    } while (st.bytes_received < 4 * NKV * PAGE_B && kvf_now_ms() < until);
    CHECK(st.bytes_received >= 4 * NKV * PAGE_B);
    CHECK_EQ_INT(kvf_sender_send(s[1], src[1], 4, 1), KVF_OK);
    wait_final(s[0], r[0]);
    CHECK_EQ_INT(kvf_receiver_poll(r[0]), KVF_POLL_FAILED);
    CHECK_EQ_INT(kvf_receiver_failure(r[0], &f), KVF_OK);
    CHECK_EQ_INT(f.status, KVF_ERR_TIMED_OUT);
    if (!f.from_another_rank)
        CHECK_STR_CONTAINS(f.reason, "confirm");
    for (int k = 0; k < 2; k++) {
        wait_final(s[k], r[k]);
        kvf_sender_destroy(s[k]);
        kvf_receiver_destroy(r[k]);
    }
    side_fini(&dec);
    side_fini(&pre);
}

/*
 * Room A's destination reached the prefill engine before A's sender, and
 * the connection it came on reset (inside room C's bytes) before the
 * sender was created: the decode rank reconnects and asks again, as for
 * any reset, and A goes on, whether its sender comes before that request
 * (resume_first 0: it waits for the decode rank, as a live link would) or
 * after it (1: the request waits for the sender, beside the first).
 */
static void reset_before_sender(int resume_first)
{
    side_t pre, dec;
    char bs[64];
    kvf_sender_t *s[2] = {NULL, NULL};
    kvf_receiver_t *r[2];
    kvf_engine_stats_t st;
    kvf_engine_stats_init(&st);
    uint32_t src[2][4] = {{0, 1, 2, 3}, {8, 9, 10, 11}};
    uint32_t dst[2][4] = {{20, 5, 33, 7}, {40, 41, 50, 60}};
    const uint64_t room_c = 91, room_a = 92;

    next_faults = "reset@0/91";                 /* room C's first byte */
    eside(&pre, KVF_ROLE_PREFILL, "127.0.0.1:0", 0);
    CHECK_EQ_INT(kvf_engine_bootstrap_addr(pre.eng, bs, sizeof(bs)), KVF_OK);
    next_faults = NULL;
    eside(&dec, KVF_ROLE_DECODE, NULL, 0);
    for (int b = 0; b < NKV; b++)
        for (size_t i = 0; i < (size_t)PAGES * PAGE_B; i++)
            pre.kv[b][i] = (uint8_t)(i * 3 + b * 17 + 5);
    for (int k = 0; k < 2; k++) {
        CHECK_EQ_INT(kvf_receiver_create(dec.eng, bs, room_c + (uint64_t)k, -1, &r[k]),
                     KVF_OK);
        CHECK_EQ_INT(kvf_receiver_init(r[k], dst[k], 4, 1 + (uint32_t)k, NULL, 0), KVF_OK);
    }
    /* C has its sender; A's destination waits for one. */
    CHECK_EQ_INT(kvf_sender_create(pre.eng, bs, room_c, &s[0]), KVF_OK);
    wait_sender(s[0], KVF_POLL_WAITING_FOR_INPUT);
    CHECK_EQ_INT(wait_receiver(r[1], KVF_POLL_WAITING_FOR_INPUT), KVF_POLL_WAITING_FOR_INPUT);
    CHECK_EQ_INT(kvf_sender_init(s[0], 4, 1), KVF_OK);
    CHECK_EQ_INT(kvf_sender_send(s[0], src[0], 4, 1), KVF_OK);
    /* The reset: the prefill engine has no peer for a moment. */
    uint64_t until = kvf_now_ms() + 5000;
    do {
        kvf_engine_stats(pre.eng, &st);
    } while (st.peers_connected != 0 && kvf_now_ms() < until);
    CHECK_EQ_INT((int)st.peers_connected, 0);
    if (resume_first)    /* C goes on once the decode rank is back, and asks again */
        wait_final(s[0], r[0]);
    CHECK_EQ_INT(kvf_sender_create(pre.eng, bs, room_a, &s[1]), KVF_OK);
    wait_sender(s[1], KVF_POLL_WAITING_FOR_INPUT);
    CHECK_EQ_INT(kvf_sender_init(s[1], 4, 2), KVF_OK);
    CHECK_EQ_INT(kvf_sender_send(s[1], src[1], 4, 1), KVF_OK);
    for (int k = 0; k < 2; k++) {
        wait_final(s[k], r[k]);
        kvf_failure_t f;
        kvf_failure_init(&f);
        if (kvf_sender_failure(s[k], &f) == KVF_OK)
            fprintf(stderr, "  room %d failed on prefill: %s\n", (int)room_c + k, f.reason);
        CHECK_EQ_INT(kvf_sender_poll(s[k]), KVF_POLL_SUCCESS);
        CHECK_EQ_INT(kvf_receiver_poll(r[k]), KVF_POLL_SUCCESS);
        int same = 1;
        for (int b = 0; b < NKV; b++)
            for (int i = 0; i < 4; i++)
                same &= memcmp(dec.kv[b] + (size_t)dst[k][i] * PAGE_B,
                               pre.kv[b] + (size_t)src[k][i] * PAGE_B, PAGE_B) == 0;
        CHECK(same);
        kvf_sender_destroy(s[k]);
        kvf_receiver_destroy(r[k]);
    }
    side_fini(&dec);
    side_fini(&pre);
}

static void test_reset_before_sender(void)
{
    reset_before_sender(0);
    reset_before_sender(1);
}

/* A fault that counts no room's payload cannot be kept to one. */
static void test_fault_spec_room(void)
{
    kvf_faults_t *fs = NULL;
    char err[256];
    CHECK_EQ_INT(kvf_transport_faults_parse("reset@5/123,corrupt/7,stall@1:200/9", &fs,
                                            err, sizeof(err)), KVF_OK);
    kvf_transport_faults_free(fs);
    CHECK_EQ_INT(kvf_transport_faults_parse("delay:100/5", &fs, err, sizeof(err)),
                 KVF_ERR_INVALID_PARAM);
    CHECK_STR_CONTAINS(err, "cannot be kept to one room");
    CHECK_EQ_INT(kvf_transport_faults_parse("reset@5/", &fs, err, sizeof(err)),
                 KVF_ERR_INVALID_PARAM);
    CHECK_STR_CONTAINS(err, "KIND/ROOM");
    CHECK_EQ_INT(kvf_transport_faults_parse("reset@5x/1", &fs, err, sizeof(err)),
                 KVF_ERR_INVALID_PARAM);
}

/*
 * Out of memory while parsing a spec: err says what ran out, since the
 * caller prints it.  The memory runs out for real, in a child whose
 * address space is capped a little above what it uses, asked to parse a
 * 64 MiB spec (the parser copies it first).
 */
static void test_fault_spec_out_of_memory(void)
{
#ifdef KVF_TEST_SANITIZED
    printf("SKIP test_fault_spec_out_of_memory: a sanitizer's allocator needs the "
           "address space this test caps\n");
#else
    size_t big = 64u << 20;
    char *spec = malloc(big + 1);
    CHECK(spec != NULL);
    if (spec == NULL)
        return;
    memset(spec, 'x', big);
    spec[big] = '\0';
    fflush(NULL);
    pid_t child = fork();
    if (child == 0) {
        kvf_faults_t *fs = NULL;
        char err[256] = "";
        unsigned long pages = 0;
        struct rlimit rl;
        FILE *f = fopen("/proc/self/statm", "r");
        if (f == NULL || fscanf(f, "%lu", &pages) != 1 || getrlimit(RLIMIT_AS, &rl) != 0)
            _exit(10);
        fclose(f);
        rl.rlim_cur = pages * (unsigned long)sysconf(_SC_PAGESIZE) + (16u << 20);
        if (setrlimit(RLIMIT_AS, &rl) != 0)
            _exit(11);
        kvf_status_t st = kvf_transport_faults_parse(spec, &fs, err, sizeof(err));
        if (st != KVF_ERR_NO_MEMORY)
            _exit(12);
        _exit(strstr(err, "out of memory") != NULL ? 0 : 13);
    }
    int status = -1;
    CHECK(child > 0 && waitpid(child, &status, 0) == child);
    /* 12: no allocation failed; 13: it did, and err was left empty. */
    CHECK(WIFEXITED(status));
    CHECK_EQ_INT(WEXITSTATUS(status), 0);
    free(spec);
#endif
}

/*
 * kvf_mem_alloc's KVF_ERR_IO, as kvferry.h documents it: a memfd it cannot
 * make read-only for peers.  A child whose descriptor limit leaves one
 * free gets its memfd, but not the read-only reopening; kvf_last_error()
 * says which step failed.
 */
static void test_mem_alloc_io_error(void)
{
    fflush(NULL);
    pid_t child = fork();
    if (child == 0) {
        struct rlimit rl;
        void *p = NULL;
        int lowest = dup(0);           /* every descriptor below it is taken */
        if (lowest < 0 || close(lowest) != 0 || getrlimit(RLIMIT_NOFILE, &rl) != 0)
            _exit(10);
        rl.rlim_cur = (rlim_t)lowest + 1;
        if (setrlimit(RLIMIT_NOFILE, &rl) != 0)
            _exit(11);
        kvf_status_t st = kvf_mem_alloc(1 << 20, &p);
        if (st != KVF_ERR_IO || p != NULL)
            _exit(12);
        _exit(strstr(kvf_last_error(), "read-only") != NULL ? 0 : 13);
    }
    int status = -1;
    CHECK(child > 0 && waitpid(child, &status, 0) == child);
    CHECK(WIFEXITED(status));
    CHECK_EQ_INT(WEXITSTATUS(status), 0);
}

/*
 * A mover read that fails (KVF_FAULTS=readfail at the decode engine, the
 * fault mover wrapping the real endpoint) fails its room alone, with the
 * read's reason: the endpoint and the peer stay.
 */
static void test_failed_read_fails_the_room_only(void)
{
    first_room_fails_alone(NULL, "readfail@100", 95, KVF_ERR_IO,
                           "failed: injected fault (KVF_FAULTS): read failed");
}

/*
 * A room aborted while a read into its pages is in flight (held back by
 * KVF_FAULTS=readstall) is failed at once, but shows TRANSFERRING and
 * keeps its pages until the read is over: a scheduler that sees FAILED may
 * give the pages away, so FAILED must mean no byte can still land.
 */
static void test_failed_room_keeps_pages_until_reads_end(void)
{
    side_t pre, dec;
    char bs[64];
    uint32_t pages[PAGES];
    kvf_sender_t *s;
    kvf_receiver_t *r;
    kvf_failure_t df;
    kvf_failure_init(&df);

    eside(&pre, KVF_ROLE_PREFILL, "127.0.0.1:0", 0);
    CHECK_EQ_INT(kvf_engine_bootstrap_addr(pre.eng, bs, sizeof(bs)), KVF_OK);
    next_faults = "readstall@0:2000";
    eside(&dec, KVF_ROLE_DECODE, NULL, 0);
    next_faults = NULL;
    for (int i = 0; i < PAGES; i++)
        pages[i] = (uint32_t)i;
    CHECK_EQ_INT(kvf_sender_create(pre.eng, bs, 97, &s), KVF_OK);
    CHECK_EQ_INT(kvf_receiver_create(dec.eng, bs, 97, -1, &r), KVF_OK);
    CHECK_EQ_INT(kvf_receiver_init(r, pages, PAGES, 1, NULL, 0), KVF_OK);
    wait_sender(s, KVF_POLL_WAITING_FOR_INPUT);
    CHECK_EQ_INT(kvf_sender_init(s, PAGES, 1), KVF_OK);
    CHECK_EQ_INT(kvf_sender_send(s, pages, PAGES, 1), KVF_OK);
    /* The first DATA_REF makes the room TRANSFERRING, and its read is held. */
    uint64_t until = kvf_now_ms() + 5000;
    while (kvf_receiver_poll(r) != KVF_POLL_TRANSFERRING && kvf_now_ms() < until)
        sleep_ms(1);
    CHECK_EQ_INT(kvf_receiver_poll(r), KVF_POLL_TRANSFERRING);
    kvf_receiver_abort(r);
    /* Failed (the record is there at once), but not shown final. */
    CHECK_EQ_INT(kvf_receiver_failure(r, &df), KVF_OK);
    CHECK_EQ_INT(df.status, KVF_ERR_ABORTED);
    CHECK_EQ_INT(kvf_receiver_poll(r), KVF_POLL_TRANSFERRING);
    CHECK_EQ_INT(kvf_receiver_pages_released(r), 0);
    /* Once the read is handed back: FAILED, and the pages are free. */
    until = kvf_now_ms() + 10000;
    while (kvf_receiver_poll(r) != KVF_POLL_FAILED && kvf_now_ms() < until)
        sleep_ms(1);
    CHECK_EQ_INT(kvf_receiver_poll(r), KVF_POLL_FAILED);
    CHECK_EQ_INT(kvf_receiver_pages_released(r), 1);
    wait_final(s, NULL);
    CHECK_EQ_INT(kvf_sender_poll(s), KVF_POLL_FAILED);
    kvf_sender_destroy(s);
    kvf_receiver_destroy(r);
    side_fini(&dec);
    side_fini(&pre);
}

/*
 * A connection that trickles its handshake (a byte now and then, so it is
 * never silent long enough for the heartbeat timeout) is closed at the
 * handshake deadline, and the engine goes on serving.
 */
static void test_trickling_handshake_is_closed(void)
{
    side_t pre;
    char bs[64], addr[64];

    setenv("KVF_HANDSHAKE_TIMEOUT_MS", "500", 1);
    next_hb_timeout_ms = 10000;       /* far past the handshake deadline */
    eside(&pre, KVF_ROLE_PREFILL, "127.0.0.1:0", 0);
    next_hb_timeout_ms = 2500;
    unsetenv("KVF_HANDSHAKE_TIMEOUT_MS");
    CHECK_EQ_INT(kvf_engine_bootstrap_addr(pre.eng, bs, sizeof(bs)), KVF_OK);
    CHECK_EQ_INT(kvf_engine_address(pre.eng, addr, sizeof(addr)), KVF_OK);

    /* A real frame, sent one byte at a time. */
    kvf_buf_t frame;
    kvf_buf_init(&frame);
    kvf_msg_t m = {.type = KVF_MSG_HEARTBEAT};
    CHECK_EQ_INT(kvf_wire_encode(&frame, &m), KVF_OK);
    int fd = dial(port_of(pre.eng));
    CHECK(fd >= 0);
    uint64_t t0 = kvf_now_ms();
    int closed = 0;
    for (size_t i = 0; !closed && kvf_now_ms() - t0 < 4000; i++) {
        if (i < frame.len - 1 && send(fd, frame.data + i, 1, MSG_NOSIGNAL) != 1)
            break;                    /* the engine closed it under us */
        struct pollfd pfd = {fd, POLLIN, 0};
        while (!closed && poll(&pfd, 1, 100) > 0) {
            char junk[4096];          /* its AUTH, then EOF */
            ssize_t n = recv(fd, junk, sizeof(junk), 0);
            closed = n == 0 || (n < 0 && errno != EINTR && errno != EAGAIN);
        }
    }
    uint64_t took = kvf_now_ms() - t0;
    CHECK(closed);
    if (took >= 3000)
        fprintf(stderr, "  closed after %llu ms, not at the 500 ms handshake deadline\n",
                (unsigned long long)took);
    CHECK(took < 3000);
    close(fd);
    kvf_buf_free(&frame);
    side_fini(&pre);
}

/*
 * A hand-written prefill rank, to send a real decode engine what no
 * kvferry sender would: it registers in a registry, answers the decode
 * engine's connection on a plain socket and speaks the wire protocol
 * through the codec.
 */
typedef wp_peer_t fake_peer_t;

/* The layout side_init registers, with `heads` of the HEADS per rank, as
 * rank 0 of TP HEADS / heads. */
static void fake_init(fake_peer_t *f, uint32_t heads)
{
    f->lay = (wp_layout_t){.page = PAGE, .pages = PAGES, .layers = LAYERS, .num_kv = NKV,
                           .hpr = heads, .total_heads = HEADS, .head_b = HEAD_B,
                           .aux_b = AUX_B, .slots = SLOTS, .state_slots = SLOTS,
                           .tp_size = HEADS / heads, .instance_id = 0x5eed};
}

/* Exactly n bytes, or 0 after 5 s (or at EOF). */
static int fake_read(int fd, uint8_t *p, size_t n)
{
    return wp_read(fd, p, n, 5000);
}

/* DATA for `room`: segments, then as many payload bytes as they hold. */
static void fake_data(fake_peer_t *f, uint64_t room, const kvf_wire_seg_t *segs, uint32_t n)
{
    static uint8_t payload[NKV * PAGE_B + 4096];
    kvf_msg_t m = {.type = KVF_MSG_DATA};
    uint64_t bytes = 0;
    for (uint32_t i = 0; i < n; i++)
        bytes += kvf_wire_seg_bytes(&segs[i]);
    CHECK(bytes <= sizeof(payload));
    for (size_t i = 0; i < bytes; i++)
        payload[i] = (uint8_t)(i * 31 + 7);
    m.u.data.room = room;
    m.u.data.instance = f->inst[room % 256];
    m.u.data.payload_len = bytes;
    m.u.data.nseg = n;
    m.u.data.segs = segs;
    m.u.data.strided = 1;
    wp_peer_send(f, &m, payload, bytes);
}

#define SEG(kind, buf, off, len, count, dstr, sstr) \
    ((kvf_wire_seg_t){(kind), (buf), (off), (len), (count), (dstr), (sstr)})

/*
 * Strided segments from a peer: a good one lands piece by piece; one piece
 * past its page, into another room's page, or far off by its stride fails
 * its room with KVF_ERR_BAD_INDICES and places nothing of the frame; a
 * stride that wraps 64 bits is a protocol violation that takes the peer.
 */
static void test_hostile_strided_segments(void)
{
    enum { R_GOOD, R_PAST, R_INTO, R_OTHER, R_FAR, R_AUX, NR };
    static const uint32_t page[NR] = {5, 7, 9, 10, 11, 12};
    const uint64_t tok = HEADS * HEAD_B;   /* a token's bytes on both sides */
    kvf_bootstrap_t *bs;
    kvf_receiver_t *r[NR];
    fake_peer_t *f = calloc(1, sizeof(*f));
    char addr[64];
    side_t dec;
    kvf_msg_t m;

    side_transport = "tcp";
    CHECK_EQ_INT(kvf_bootstrap_create("127.0.0.1", 0, &bs), KVF_OK);
    snprintf(addr, sizeof(addr), "127.0.0.1:%d", kvf_bootstrap_port(bs));
    fake_init(f, HEADS);
    wp_listen(f);
    wp_register(f, addr);
    eside(&dec, KVF_ROLE_DECODE, addr, 1);
    for (int i = 0; i < NR; i++) {
        uint32_t state = (uint32_t)i;
        CHECK_EQ_INT(kvf_receiver_create(dec.eng, addr, 100 + (uint64_t)i, -1, &r[i]),
                     KVF_OK);
        CHECK_EQ_INT(kvf_receiver_init(r[i], &page[i], 1, (uint32_t)i, &state, 1), KVF_OK);
    }

    wp_accept_hello(f, NULL);
    wp_xport(f, KVF_CAP_STRIDED);
    /* The decode engine takes the stream and accepts strided segments. */
    CHECK(wp_peer_expect(f, KVF_MSG_XPORT, &m));
    CHECK(m.u.xport.count == 1 && m.u.xport.x[0].name.len == 4 &&
          memcmp(m.u.xport.x[0].name.ptr, "caps", 4) == 0 &&
          m.u.xport.x[0].blob_len == 4 &&
          kvf_get_u32(m.u.xport.x[0].blob) == KVF_CAP_STRIDED);
    for (int i = 0; i < NR; i++)
        CHECK(wp_peer_expect(f, KVF_MSG_ROOM_REQ, &m));

    /* Good: every KV buffer's page as PAGE pieces of a token, then aux and
     * state; the payload is the pieces in order. */
    kvf_wire_seg_t good[NKV + 2];
    for (int b = 0; b < NKV; b++)
        good[b] = SEG(KVF_BUF_KV, (uint32_t)b, page[R_GOOD] * (uint64_t)PAGE_B,
                      (uint32_t)tok, PAGE, tok, 2 * tok);
    good[NKV] = SEG(KVF_BUF_AUX, 0, R_GOOD * AUX_B, AUX_B, 1, 0, 0);
    good[NKV + 1] = SEG(KVF_BUF_STATE, 0, R_GOOD * 8, 8, 1, 0, 0);
    fake_data(f, 100 + R_GOOD, good, NKV + 2);
    kvf_msg_t done = {.type = KVF_MSG_DONE};
    done.u.done.room = 100 + R_GOOD;
    done.u.done.instance = f->inst[100 + R_GOOD];
    done.u.done.bytes = NKV * PAGE_B + AUX_B + 8;
    wp_peer_send(f, &done, NULL, 0);
    CHECK_EQ_INT(wait_receiver(r[R_GOOD], KVF_POLL_SUCCESS), KVF_POLL_SUCCESS);
    for (int b = 0; b < NKV; b++)
        for (size_t i = 0; i < PAGE_B; i++)
            if (dec.kv[b][page[R_GOOD] * PAGE_B + i] != (uint8_t)((b * PAGE_B + i) * 31 + 7)) {
                CHECK(!"a strided piece landed in the wrong place");
                b = NKV;
                break;
            }

    /* One piece past the page (into page 8, which no room declared). */
    kvf_wire_seg_t past = SEG(KVF_BUF_KV, 0, page[R_PAST] * (uint64_t)PAGE_B,
                              (uint32_t)tok, PAGE + 1, tok, tok);
    fake_data(f, 100 + R_PAST, &past, 1);
    check_recv_failed(r[R_PAST], KVF_ERR_BAD_INDICES, "outside the pages the room declared", NULL);

    /* A good segment, then one whose last piece reaches into page 10, which
     * room R_OTHER declared: nothing of the frame is placed. */
    kvf_wire_seg_t into[2] = {
        SEG(KVF_BUF_KV, 1, page[R_INTO] * (uint64_t)PAGE_B, (uint32_t)tok, PAGE, tok, tok),
        SEG(KVF_BUF_KV, 0, page[R_INTO] * (uint64_t)PAGE_B + tok, HEAD_B, PAGE, tok, tok),
    };
    fake_data(f, 100 + R_INTO, into, 2);
    check_recv_failed(r[R_INTO], KVF_ERR_BAD_INDICES, "segment 1: bytes", NULL);
    CHECK(all_zero(dec.kv[1] + page[R_INTO] * PAGE_B, PAGE_B));
    CHECK(all_zero(dec.kv[0] + page[R_INTO] * PAGE_B, 2 * PAGE_B));
    CHECK(kvf_receiver_poll(r[R_OTHER]) == KVF_POLL_WAITING_FOR_INPUT);

    /* Pieces 2^40 bytes apart: the second is far outside the buffer. */
    kvf_wire_seg_t far = SEG(KVF_BUF_KV, 0, page[R_FAR] * (uint64_t)PAGE_B, (uint32_t)tok,
                             2, 1ull << 40, tok);
    fake_data(f, 100 + R_FAR, &far, 1);
    check_recv_failed(r[R_FAR], KVF_ERR_BAD_INDICES, "outside the pages the room declared", NULL);

    /* Aux: three 8-byte pieces from the slot's start run past its 16 bytes. */
    kvf_wire_seg_t aux = SEG(KVF_BUF_AUX, 0, R_AUX * AUX_B, 8, 3, 8, 8);
    fake_data(f, 100 + R_AUX, &aux, 1);
    check_recv_failed(r[R_AUX], KVF_ERR_BAD_INDICES, "outside the room's slot", NULL);
    CHECK(all_zero(dec.aux + (R_AUX + 1) * AUX_B, AUX_B));

    /* Still untouched, still live; then a stride that wraps around 64 bits,
     * which the codec refuses: the connection goes, and the room with it. */
    CHECK(all_zero(dec.kv[0] + page[R_OTHER] * PAGE_B, PAGE_B));
    kvf_msg_t wrap = {.type = KVF_MSG_DATA};
    kvf_wire_seg_t ws = SEG(KVF_BUF_KV, 0, page[R_OTHER] * (uint64_t)PAGE_B, 8, 3,
                            UINT64_MAX / 2, 8);
    wrap.u.data.room = 100 + R_OTHER;
    wrap.u.data.instance = f->inst[100 + R_OTHER];
    wrap.u.data.payload_len = 24;
    wrap.u.data.nseg = 1;
    wrap.u.data.segs = &ws;
    wrap.u.data.strided = 1;
    kvf_buf_t b;
    kvf_buf_init(&b);
    CHECK_EQ_INT(kvf_wire_encode(&b, &wrap), KVF_ERR_INVALID_PARAM);   /* not from us */
    ws.dst_stride = 8;
    CHECK_EQ_INT(kvf_wire_encode(&b, &wrap), KVF_OK);
    kvf_put_u64(b.data + KVF_WIRE_HDR_LEN + 32 + 21, UINT64_MAX / 2);  /* dst_stride */
    CHECK(send(f->fd, b.data, b.len, MSG_NOSIGNAL) == (ssize_t)b.len);
    kvf_buf_free(&b);
    check_recv_failed(r[R_OTHER], KVF_ERR_PROTOCOL, "overflows", NULL);
    CHECK(all_zero(dec.kv[0] + page[R_OTHER] * PAGE_B, PAGE_B));

    for (int i = 0; i < NR; i++)
        kvf_receiver_destroy(r[i]);
    side_fini(&dec);
    wp_close(f);
    free(f);
    kvf_bootstrap_destroy(bs);
}

/* What a fake decode rank saw of one room's payload. */
typedef struct fake_rx {
    int      frames, strided_frames;
    uint32_t kv_segs, max_count;
    uint64_t bytes;
    uint8_t  payload[NKV * PAGE_B];
} fake_rx_t;

/*
 * One room from a real prefill engine (TP 1) to a hand-written decode
 * rank 0 of TP 2 (one head of the two: a TP slice), which answers the
 * offer as a build without capabilities does (accept 0: it names no caps
 * entry) or accepts strided segments.  Every DATA frame is recorded.
 */
/* A hand-written decode rank 0 of TP 2 connected to `pre`, through the
 * handshake (answering its offer with `accept`), which asks for `room`:
 * one page (3), aux slot 1, one state (2). */
static fake_peer_t *fake_decode_connect(side_t *pre, uint64_t room, uint32_t accept)
{
    fake_peer_t *f = calloc(1, sizeof(*f));
    kvf_msg_t m;

    fake_init(f, 1);
    wp_connect_hello(f, pre->eng, NULL);
    CHECK(wp_peer_expect(f, KVF_MSG_XPORT, &m));
    int offered = 0;
    for (uint32_t i = 0; i < m.u.xport.count; i++)
        offered |= m.u.xport.x[i].name.len == 4 &&
                   memcmp(m.u.xport.x[i].name.ptr, "caps", 4) == 0 &&
                   m.u.xport.x[i].blob_len == 4 &&
                   (kvf_get_u32(m.u.xport.x[i].blob) & KVF_CAP_STRIDED) != 0;
    CHECK(offered);
    wp_xport(f, accept);
    uint32_t dpage = 3, dstate = 2;
    kvf_msg_t req = {.type = KVF_MSG_ROOM_REQ};
    req.u.room_req.room = room;
    req.u.room_req.instance = 0x1257a9ce0000ull + room;
    req.u.room_req.expected_receivers = 1;
    req.u.room_req.aux_slot = 1;
    req.u.room_req.pages = (kvf_wire_arr32_t){1, &dpage, NULL};
    uint32_t one_state = 1;
    req.u.room_req.state_counts = (kvf_wire_arr32_t){1, &one_state, NULL};
    req.u.room_req.state_idx = (kvf_wire_arr32_t){1, &dstate, NULL};
    wp_peer_send(f, &req, NULL, 0);
    return f;
}

static void fake_decode_room(side_t *pre, const char *bs, uint64_t room, uint32_t accept,
                             fake_rx_t *rx)
{
    char err[256];
    kvf_msg_t m;
    kvf_sender_t *s;

    memset(rx, 0, sizeof(*rx));
    fake_peer_t *f = fake_decode_connect(pre, room, accept);
    uint32_t spage = 20, sstate = 4;
    CHECK_EQ_INT(kvf_sender_create(pre->eng, bs, room, &s), KVF_OK);
    wait_sender(s, KVF_POLL_WAITING_FOR_INPUT);
    CHECK_EQ_INT(kvf_sender_init(s, 1, 6), KVF_OK);
    CHECK_EQ_INT(kvf_sender_set_state(s, &sstate, 1), KVF_OK);
    CHECK_EQ_INT(kvf_sender_send(s, &spage, 1, 1), KVF_OK);

    /* DATA frames (and their payload) until DONE. */
    for (;;) {
        uint8_t h[KVF_WIRE_HDR_LEN];
        kvf_wire_hdr_t hdr;
        if (!fake_read(f->fd, h, sizeof(h)) ||
            kvf_wire_parse_header(h, &hdr, err, sizeof(err)) != KVF_OK ||
            hdr.length > sizeof(f->body) || !fake_read(f->fd, f->body, hdr.length) ||
            kvf_wire_decode(&hdr, f->body, &m, err, sizeof(err)) != KVF_OK) {
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
        uint64_t kv = 0;
        for (uint32_t i = 0; i < m.u.data.nseg; i++) {
            kvf_wire_seg_t sg;
            kvf_wire_seg_at(&m.u.data, i, &sg);
            if (sg.kind != KVF_BUF_KV)
                continue;
            rx->kv_segs++;
            rx->max_count = sg.count > rx->max_count ? sg.count : rx->max_count;
            kv += kvf_wire_seg_bytes(&sg);
        }
        /* KV pieces come first in a frame: keep them, skip the rest. */
        CHECK(rx->bytes + kv <= sizeof(rx->payload));
        CHECK(fake_read(f->fd, rx->payload + rx->bytes, kv));
        uint8_t rest[64];
        CHECK(m.u.data.payload_len - kv <= sizeof(rest));
        CHECK(fake_read(f->fd, rest, m.u.data.payload_len - kv));
        rx->bytes += m.u.data.payload_len;
    }
    kvf_msg_t ack = {.type = KVF_MSG_DONE_ACK};
    ack.u.done_ack.room = room;
    ack.u.done_ack.instance = 0x1257a9ce0000ull + room;
    ack.u.done_ack.bytes = rx->bytes;
    wp_peer_send(f, &ack, NULL, 0);
    wait_final(s, NULL);
    CHECK_EQ_INT(kvf_sender_poll(s), KVF_POLL_SUCCESS);
    kvf_sender_destroy(s);
    wp_close(f);
    free(f);
}

/*
 * A prefill room whose decode peer's connection broke waits one heartbeat
 * timeout for it to come back; when the room's own deadline (Transferring,
 * counted from its last byte) expires first, the broken connection is
 * still its cause: the reason names the decode rank and the loss, not
 * only "no progress".
 */
static void test_deadline_while_peer_lost(void)
{
    side_t pre;
    char bs[64];
    kvf_sender_t *s;
    kvf_failure_t pf;
    kvf_failure_init(&pf);
    uint32_t spage = 20, sstate = 4;

    side_transport = "tcp";
    next_transfer_ms = 600;            /* well inside the 2.5 s wait for the peer */
    eside(&pre, KVF_ROLE_PREFILL, "127.0.0.1:0", 1);
    next_transfer_ms = 5000;
    CHECK_EQ_INT(kvf_engine_bootstrap_addr(pre.eng, bs, sizeof(bs)), KVF_OK);
    fake_peer_t *f = fake_decode_connect(&pre, 61, 0);
    CHECK_EQ_INT(kvf_sender_create(pre.eng, bs, 61, &s), KVF_OK);
    wait_sender(s, KVF_POLL_WAITING_FOR_INPUT);
    CHECK_EQ_INT(kvf_sender_init(s, 1, 6), KVF_OK);
    CHECK_EQ_INT(kvf_sender_set_state(s, &sstate, 1), KVF_OK);
    CHECK_EQ_INT(kvf_sender_send(s, &spage, 1, 1), KVF_OK);
    /* Every byte goes into the socket; no acknowledgement comes.  Then
     * the decode rank's connection resets. */
    kvf_msg_t m;
    CHECK(wp_expect(f->fd, KVF_MSG_DONE, &m, f->body, sizeof(f->body), 5000));
    struct linger lg = {1, 0};
    setsockopt(f->fd, SOL_SOCKET, SO_LINGER, &lg, sizeof(lg));
    close(f->fd);
    wait_final(s, NULL);
    CHECK_EQ_INT(kvf_sender_poll(s), KVF_POLL_FAILED);
    CHECK_EQ_INT(kvf_sender_failure(s, &pf), KVF_OK);
    CHECK_EQ_INT(pf.status, KVF_ERR_CONN_RESET);
    CHECK_STR_CONTAINS(pf.reason, "decode rank 0");
    CHECK_STR_CONTAINS(pf.reason, "connection lost");
    CHECK_STR_CONTAINS(pf.reason, "Transferring deadline expired");
    kvf_sender_destroy(s);
    free(f);
    side_fini(&pre);
}

/*
 * A reset that reaches the prefill engine while the scheduler's first
 * send of a room waits in the peer's outbox (queued from the caller's
 * thread, for the connection's thread to hand over): the connection's
 * loss decides for the room (a decode rank may reconnect and resume), not
 * that put's completion with a bare "connection to peer lost".  The
 * engine lock is held across the reset, so that the send comes before
 * the engine sees it.
 */
static void test_reset_with_puts_queued(void)
{
    side_t pre;
    char bs[64];
    kvf_sender_t *s;
    kvf_failure_t pf;
    kvf_failure_init(&pf);
    uint32_t spage = 20, sstate = 4;

    side_transport = "tcp";
    eside(&pre, KVF_ROLE_PREFILL, "127.0.0.1:0", 1);
    CHECK_EQ_INT(kvf_engine_bootstrap_addr(pre.eng, bs, sizeof(bs)), KVF_OK);
    fake_peer_t *f = fake_decode_connect(&pre, 62, 0);
    CHECK_EQ_INT(kvf_sender_create(pre.eng, bs, 62, &s), KVF_OK);
    wait_sender(s, KVF_POLL_WAITING_FOR_INPUT);
    CHECK_EQ_INT(kvf_sender_init(s, 1, 6), KVF_OK);
    CHECK_EQ_INT(kvf_sender_set_state(s, &sstate, 1), KVF_OK);
    kvf__lock(pre.eng);
    struct linger lg = {1, 0};
    setsockopt(f->fd, SOL_SOCKET, SO_LINGER, &lg, sizeof(lg));
    close(f->fd);
    kvf__unlock(pre.eng);
    CHECK_EQ_INT(kvf_sender_send(s, &spage, 1, 1), KVF_OK);
    wait_final(s, NULL);
    CHECK_EQ_INT(kvf_sender_poll(s), KVF_POLL_FAILED);
    CHECK_EQ_INT(kvf_sender_failure(s, &pf), KVF_OK);
    CHECK_EQ_INT(pf.status, KVF_ERR_CONN_RESET);
    CHECK_STR_CONTAINS(pf.reason, "connection lost");
    CHECK_STR_CONTAINS(pf.reason, "did not reconnect");
    kvf_sender_destroy(s);
    free(f);
    side_fini(&pre);
}

/* Unread bytes in a TCP socket of this host whose local port is `port`
 * (/proc/net/tcp's rx_queue): what a peer sent that was not read yet. */
static unsigned long unread_at_port(int port)
{
    FILE *f = fopen("/proc/net/tcp", "r");
    char line[512];
    unsigned long most = 0;
    if (f == NULL)
        return 0;
    while (fgets(line, sizeof(line), f)) {
        unsigned lport, st;
        unsigned long txq, rxq;
        if (sscanf(line, " %*d: %*x:%x %*x:%*x %x %lx:%lx", &lport, &st, &txq, &rxq) == 4 &&
            (int)lport == port && rxq > most)
            most = rxq;
    }
    fclose(f);
    return most;
}

/*
 * A decode rank's request that the prefill engine never read (its
 * connection reset with it unread), then the decode rank's resume of it,
 * before the room's sender exists: no sender served that room instance,
 * so the resume waits for the sender like any request, and the room goes
 * on once it comes.
 */
static void test_resume_of_unread_request(void)
{
    side_t pre, dec;
    char bs[64], addr[64];
    kvf_sender_t *s[2];
    kvf_receiver_t *r[2];
    uint32_t src[2][4] = {{0, 1, 2, 3}, {8, 9, 10, 11}};
    uint32_t dst[2][4] = {{20, 5, 33, 7}, {40, 41, 50, 60}};

    side_transport = "tcp";
    pair_up(&pre, &dec, PAGE, "bfloat16", bs, sizeof(bs));
    CHECK_EQ_INT(kvf_engine_address(pre.eng, addr, sizeof(addr)), KVF_OK);
    int port = atoi(strrchr(addr, ':') + 1);
    /* Room C connects the pair and moves its bytes. */
    CHECK_EQ_INT(kvf_sender_create(pre.eng, bs, 93, &s[0]), KVF_OK);
    CHECK_EQ_INT(kvf_receiver_create(dec.eng, bs, 93, -1, &r[0]), KVF_OK);
    CHECK_EQ_INT(kvf_receiver_init(r[0], dst[0], 4, 1, NULL, 0), KVF_OK);
    wait_sender(s[0], KVF_POLL_WAITING_FOR_INPUT);
    CHECK_EQ_INT(kvf_sender_init(s[0], 4, 1), KVF_OK);
    CHECK_EQ_INT(kvf_sender_send(s[0], src[0], 4, 1), KVF_OK);
    wait_final(s[0], r[0]);
    CHECK_EQ_INT(kvf_sender_poll(s[0]), KVF_POLL_SUCCESS);
    /* Room A's request reaches the prefill engine, which does not read
     * it (its lock is held here) before its connection resets. */
    kvf__lock(pre.eng);
    CHECK_EQ_INT(kvf_receiver_create(dec.eng, bs, 94, -1, &r[1]), KVF_OK);
    CHECK_EQ_INT(kvf_receiver_init(r[1], dst[1], 4, 2, NULL, 0), KVF_OK);
    /* Those calls took and let go the decode engine's lock on this thread,
     * and the debug record of the lock held names one engine per thread:
     * it names the prefill engine's again, still held. */
    kvf__lock_held = pre.eng;
    uint64_t until = kvf_now_ms() + 5000;
    while (unread_at_port(port) == 0 && kvf_now_ms() < until)
        sleep_ms(1);
    CHECK(unread_at_port(port) > 0);
    /* Failed here, closed by its lane (only a connection's lane calls its
     * ops: this thread would close the socket under a lane's recv), which
     * no longer reads it; closed with the request unread, the kernel
     * resets the connection. */
    kvf_peer_t *p = pre.eng->peers;
    CHECK(p != NULL && p->conn != NULL);
    if (p != NULL && p->conn != NULL)
        kvf__peer_fail(p, KVF_ERR_CONN_RESET, "reset by the test with a request unread");
    kvf__unlock(pre.eng);
    /* The decode rank reconnects and asks again; then the sender comes. */
    until = kvf_now_ms() + 5000;
    kvf_engine_stats_t st;
    kvf_engine_stats_init(&st);
    do {
        sleep_ms(1);
        kvf_engine_stats(pre.eng, &st);
    } while (st.peers_connected == 0 && kvf_now_ms() < until);
    CHECK_EQ_INT(kvf_sender_create(pre.eng, bs, 94, &s[1]), KVF_OK);
    wait_sender(s[1], KVF_POLL_WAITING_FOR_INPUT);
    CHECK_EQ_INT(kvf_sender_init(s[1], 4, 2), KVF_OK);
    CHECK_EQ_INT(kvf_sender_send(s[1], src[1], 4, 1), KVF_OK);
    wait_final(s[1], r[1]);
    kvf_failure_t f;
    kvf_failure_init(&f);
    if (kvf_receiver_failure(r[1], &f) == KVF_OK)
        fprintf(stderr, "  room 94 failed on decode: %s\n", f.reason);
    CHECK_EQ_INT(kvf_receiver_poll(r[1]), KVF_POLL_SUCCESS);
    CHECK_EQ_INT(kvf_sender_poll(s[1]), KVF_POLL_SUCCESS);
    int same = 1;
    for (int b = 0; b < NKV; b++)
        for (int i = 0; i < 4; i++)
            same &= memcmp(dec.kv[b] + (size_t)dst[1][i] * PAGE_B,
                           pre.kv[b] + (size_t)src[1][i] * PAGE_B, PAGE_B) == 0;
    CHECK(same);
    for (int k = 0; k < 2; k++) {
        kvf_sender_destroy(s[k]);
        kvf_receiver_destroy(r[k]);
    }
    side_fini(&dec);
    side_fini(&pre);
}

/*
 * A decode rank that did not accept strided segments (an older build)
 * gets a plain segment per token of a TP slice; one that did gets one
 * strided segment per KV buffer.  The payload is the same bytes in the
 * same order either way.
 */
static void test_strided_only_when_accepted(void)
{
    side_t pre;
    char bs[64];
    static fake_rx_t plain, strided;

    side_transport = "tcp";
    eside(&pre, KVF_ROLE_PREFILL, "127.0.0.1:0", 1);
    CHECK_EQ_INT(kvf_engine_bootstrap_addr(pre.eng, bs, sizeof(bs)), KVF_OK);
    for (int b = 0; b < NKV; b++)
        for (size_t i = 0; i < (size_t)PAGES * PAGE_B; i++)
            pre.kv[b][i] = (uint8_t)(i * 5 + b * 11 + 3);

    fake_decode_room(&pre, bs, 201, 0, &plain);
    CHECK(plain.frames > 0 && plain.strided_frames == 0);
    CHECK_EQ_INT(plain.kv_segs, NKV * PAGE);        /* a token's head, each */
    CHECK_EQ_INT(plain.max_count, 1);

    fake_decode_room(&pre, bs, 202, KVF_CAP_STRIDED, &strided);
    CHECK(strided.frames > 0 && strided.strided_frames == strided.frames);
    CHECK_EQ_INT(strided.kv_segs, NKV);             /* the page's tokens, each */
    CHECK_EQ_INT(strided.max_count, PAGE);

    CHECK(plain.bytes == strided.bytes && plain.bytes == NKV * PAGE_B / 2 + AUX_B + 8);
    CHECK(memcmp(plain.payload, strided.payload, NKV * PAGE_B / 2) == 0);
    /* Head 0 of token 1 of prefill page 20, buffer 0: the second piece. */
    CHECK_EQ_INT(strided.payload[HEAD_B], pre.kv[0][20 * PAGE_B + HEADS * HEAD_B]);
    side_fini(&pre);
}

static void test_reset_resumes(void)
{
    kvf_poll_t ps, ds;
    kvf_failure_t pf, df;
    kvf_failure_init(&pf);
    kvf_failure_init(&df);
    int ok;
    faulty_room("reset@20000", NULL, 1, &ps, &ds, &pf, &df, &ok);
    CHECK_EQ_INT(ps, KVF_POLL_SUCCESS);
    CHECK_EQ_INT(ds, KVF_POLL_SUCCESS);
    CHECK(ok);
    faulty_room("truncate@30000", NULL, 0, &ps, &ds, &pf, &df, &ok);
    CHECK_EQ_INT(ds, KVF_POLL_SUCCESS);
    CHECK(ok);
}

/*
 * A reset while the application keeps sending: eight rooms, each in eight
 * chunks handed over one after the other from this thread, so puts wait
 * in the peer's outbox when the connection goes.  The closing connection
 * fails those puts; the rooms must first hear that their connection was
 * reset (they wait for the reconnect), and all resume and succeed.
 */
static void test_reset_with_sends_queued(void)
{
    enum { ROOMS = 8, ROOM_PAGES = PAGES / ROOMS, CHUNK = 1 };
    side_t pre, dec;
    char bs[64];
    kvf_sender_t *s[ROOMS];
    kvf_receiver_t *r[ROOMS];
    uint32_t src[PAGES], dst[PAGES];

    next_faults = "reset@4096";         /* half a room's bytes */
    eside(&pre, KVF_ROLE_PREFILL, "127.0.0.1:0", 0);
    next_faults = NULL;
    CHECK_EQ_INT(kvf_engine_bootstrap_addr(pre.eng, bs, sizeof(bs)), KVF_OK);
    eside(&dec, KVF_ROLE_DECODE, NULL, 0);
    for (int b = 0; b < NKV; b++)
        for (size_t i = 0; i < (size_t)PAGES * PAGE_B; i++)
            pre.kv[b][i] = (uint8_t)(i * 13 + b * 5 + 1);
    for (int i = 0; i < PAGES; i++) {
        src[i] = (uint32_t)i;
        dst[i] = (uint32_t)((i * 37) % PAGES);
    }
    for (int k = 0; k < ROOMS; k++) {
        CHECK_EQ_INT(kvf_sender_create(pre.eng, bs, 500 + (uint64_t)k, &s[k]), KVF_OK);
        CHECK_EQ_INT(kvf_receiver_create(dec.eng, bs, 500 + (uint64_t)k, -1, &r[k]), KVF_OK);
        CHECK_EQ_INT(kvf_receiver_init(r[k], dst + k * ROOM_PAGES, ROOM_PAGES, (uint32_t)k,
                                       NULL, 0), KVF_OK);
    }
    for (int k = 0; k < ROOMS; k++) {
        CHECK_EQ_INT(wait_sender(s[k], KVF_POLL_WAITING_FOR_INPUT), KVF_POLL_WAITING_FOR_INPUT);
        CHECK_EQ_INT(kvf_sender_init(s[k], ROOM_PAGES, (uint32_t)k), KVF_OK);
    }
    for (int c = 0; c < ROOM_PAGES; c += CHUNK)
        for (int k = 0; k < ROOMS; k++)
            CHECK_EQ_INT(kvf_sender_send(s[k], src + k * ROOM_PAGES + c, CHUNK,
                                         c + CHUNK == ROOM_PAGES), KVF_OK);
    for (int k = 0; k < ROOMS; k++) {
        wait_final(s[k], r[k]);
        CHECK_EQ_INT(kvf_sender_poll(s[k]), KVF_POLL_SUCCESS);
        CHECK_EQ_INT(kvf_receiver_poll(r[k]), KVF_POLL_SUCCESS);
        kvf_sender_destroy(s[k]);
        kvf_receiver_destroy(r[k]);
    }
    for (int b = 0; b < NKV; b++)
        for (int i = 0; i < PAGES; i++)
            CHECK(memcmp(dec.kv[b] + (size_t)dst[i] * PAGE_B,
                         pre.kv[b] + (size_t)src[i] * PAGE_B, PAGE_B) == 0);
    side_fini(&dec);
    side_fini(&pre);
}

static void test_repeated_resets_give_up(void)
{
    kvf_poll_t ps, ds;
    kvf_failure_t pf, df;
    kvf_failure_init(&pf);
    kvf_failure_init(&df);
    int ok;
    faulty_room("reset@10000,reset@20000,reset@30000,reset@40000,reset@50000", NULL, 0,
                &ps, &ds, &pf, &df, &ok);
    CHECK_EQ_INT(ps, KVF_POLL_FAILED);
    CHECK_EQ_INT(ds, KVF_POLL_FAILED);
    CHECK_EQ_INT(df.status, KVF_ERR_CONN_RESET);
    CHECK_STR_CONTAINS(df.reason, "prefill rank 0");
    CHECK_STR_CONTAINS(df.reason, "gave up after 3 reconnects");
    CHECK(pf.reason[0] != '\0');
}

static void test_corrupt_fails_with_checksum(void)
{
    kvf_poll_t ps, ds;
    kvf_failure_t pf, df;
    kvf_failure_init(&pf);
    kvf_failure_init(&df);
    int ok;
    faulty_room("corrupt@12345", NULL, 1, &ps, &ds, &pf, &df, &ok);
    CHECK_EQ_INT(ds, KVF_POLL_FAILED);
    CHECK_EQ_INT(ps, KVF_POLL_FAILED);
    CHECK_EQ_INT(df.status, KVF_ERR_CHECKSUM);
    CHECK_STR_CONTAINS(df.reason, "checksum mismatch");
    CHECK_EQ_INT(df.from_another_rank, 0);
    CHECK_EQ_INT(pf.status, KVF_ERR_CHECKSUM);
    CHECK_EQ_INT(pf.from_another_rank, 1);
    CHECK_EQ_INT(pf.origin_side, KVF_ROLE_DECODE);
}

static void test_dropped_ack_times_out(void)
{
    kvf_poll_t ps, ds;
    kvf_failure_t pf, df;
    kvf_failure_init(&pf);
    kvf_failure_init(&df);
    int ok;
    next_transfer_ms = 1000;
    faulty_room(NULL, "drop-ack", 0, &ps, &ds, &pf, &df, &ok);
    next_transfer_ms = 5000;
    if (strcmp(side_transport, "tcp") == 0) {
        CHECK_EQ_INT(ds, KVF_POLL_SUCCESS);   /* the bytes came in the stream */
        CHECK(ok);
    } else {
        /* Pulled bytes count only once the sender confirms, which needs
         * the acknowledgement that was dropped. */
        CHECK_EQ_INT(ds, KVF_POLL_FAILED);
        CHECK_EQ_INT(df.status, KVF_ERR_TIMED_OUT);   /* its own, or the sender's */
        if (!df.from_another_rank)
            CHECK_STR_CONTAINS(df.reason, "confirm");
    }
    CHECK_EQ_INT(ps, KVF_POLL_FAILED);
    CHECK_EQ_INT(pf.status, KVF_ERR_TIMED_OUT);
    CHECK_STR_CONTAINS(pf.reason, "Transferring");
}

/*
 * The decode rank's answer to the last DONE is lost with its connection
 * (lose-ack: not sent, then a reset), and its room is destroyed as soon
 * as it is SUCCESS.  Pushed bytes (tcp) are all there, so the decode side
 * is SUCCESS at once; the prefill side waits one heartbeat timeout for a
 * reconnect, and the decode engine says the answer again on a new
 * connection within it.  Pulled bytes (shm) count only once confirmed:
 * the decode rank reconnects and resumes.  Either way both sides end in
 * SUCCESS with every byte, and no deadline could have ended the room.
 */
static void test_lost_ack_is_said_again(void)
{
    side_t pre, dec;
    char bs[64];
    uint32_t src[PAGES], dst[PAGES];
    kvf_sender_t *s;
    kvf_receiver_t *r;

    next_transfer_ms = 60000;
    faulty_pair(NULL, "lose-ack", 0, &pre, &dec, bs, src, dst);
    next_transfer_ms = 5000;
    CHECK_EQ_INT(kvf_sender_create(pre.eng, bs, 91, &s), KVF_OK);
    CHECK_EQ_INT(kvf_receiver_create(dec.eng, bs, 91, -1, &r), KVF_OK);
    CHECK_EQ_INT(kvf_receiver_init(r, dst, PAGES, 1, NULL, 0), KVF_OK);
    wait_sender(s, KVF_POLL_WAITING_FOR_INPUT);
    CHECK_EQ_INT(kvf_sender_init(s, PAGES, 1), KVF_OK);
    CHECK_EQ_INT(kvf_sender_send(s, src, PAGES, 1), KVF_OK);
    uint64_t until = kvf_now_ms() + 20000;
    kvf_poll_t ds;
    while ((ds = kvf_receiver_poll(r)) != KVF_POLL_SUCCESS && ds != KVF_POLL_FAILED &&
           kvf_now_ms() < until)
        sleep_ms(1);
    CHECK_EQ_INT(ds, KVF_POLL_SUCCESS);
    for (int b = 0; b < NKV; b++)
        for (int i = 0; i < PAGES; i++)
            CHECK(memcmp(dec.kv[b] + (size_t)dst[i] * PAGE_B,
                         pre.kv[b] + (size_t)src[i] * PAGE_B, PAGE_B) == 0);
    kvf_receiver_destroy(r);
    kvf_poll_t ps;
    while ((ps = kvf_sender_poll(s)) != KVF_POLL_SUCCESS && ps != KVF_POLL_FAILED &&
           kvf_now_ms() < until)
        sleep_ms(1);
    kvf_failure_t pf;
    kvf_failure_init(&pf);
    kvf_sender_failure(s, &pf);
    if (ps != KVF_POLL_SUCCESS)
        fprintf(stderr, "  prefill side: %s\n", pf.reason);
    CHECK_EQ_INT(ps, KVF_POLL_SUCCESS);
    /* The decode engine counts what it said again: over tcp (a push link)
     * the lost DONE_ACK; a pulled room's link confirms it another way. */
    char text[32768];
    static const char name[] = "\nkvferry_engine_acks_repeated_total ";
    CHECK_EQ_INT(kvf_engine_metrics(dec.eng, text, sizeof(text), NULL), KVF_OK);
    const char *line = strstr(text, name);
    CHECK(line != NULL);
    if (line != NULL && strcmp(side_transport, "tcp") == 0)
        CHECK(strtoull(line + strlen(name), NULL, 10) >= 1);
    kvf_sender_destroy(s);
    side_fini(&dec);
    side_fini(&pre);
}

static void test_stall_is_a_dead_peer(void)
{
    kvf_poll_t ps, ds;
    kvf_failure_t pf, df;
    kvf_failure_init(&pf);
    kvf_failure_init(&df);
    int ok;
    next_hb_interval_ms = 100;
    next_hb_timeout_ms = 600;
    faulty_room("stall@20000:3000", NULL, 0, &ps, &ds, &pf, &df, &ok);
    next_hb_interval_ms = 500;
    next_hb_timeout_ms = 2500;
    CHECK_EQ_INT(ds, KVF_POLL_FAILED);
    CHECK_EQ_INT(df.status, KVF_ERR_PEER_TIMEOUT);
    CHECK_STR_CONTAINS(df.reason, "prefill rank 0");
    CHECK_STR_CONTAINS(df.reason, "heartbeat timeout");
    CHECK_EQ_INT(ps, KVF_POLL_FAILED);
}

/* Device memory that is not (a host buffer declared CUDA), or that no
 * driver can vouch for, is refused at registration with the reason, not
 * per room (test_memkind has each case). */
static void test_device_memory_refused(void)
{
    kvf_engine_params_t p;
    kvf_engine_t *eng;
    static uint8_t buf[4096];
    kvf_buffer_t kv = {buf, sizeof(buf), 1024};
    kvf_layout_t l;

    kvf_engine_params_init(&p);
    p.role = KVF_ROLE_DECODE;
    CHECK_EQ_INT(kvf_engine_create(&p, &eng), KVF_OK);
    kvf_layout_init(&l);
    l.page_size = 4;
    l.kv_dtype = "bfloat16";
    l.attn = KVF_ATTN_MLA;
    l.num_layers = 1;
    l.num_kv = 1;
    l.kv = &kv;
    l.mem_kind = KVF_MEM_CUDA;
    CHECK(kvf_engine_register_layout(eng, &l) != KVF_OK);
    CHECK_STR_CONTAINS(kvf_last_error(), "CUDA");
    l.mem_kind = KVF_MEM_HOST;        /* and the engine is still usable */
    CHECK_EQ_INT(kvf_engine_register_layout(eng, &l), KVF_OK);
    kvf_engine_destroy(eng);
}

/* Descriptors this process has open (the directory's own included). */
static int open_fds(void)
{
    int n = 0;
    DIR *d = opendir("/proc/self/fd");
    if (d == NULL)
        return -1;
    for (struct dirent *e; (e = readdir(d)) != NULL;)
        n += e->d_name[0] != '.';
    closedir(d);
    return n;
}

/*
 * An engine create that runs out of descriptors at any step (its
 * listener, lane 0's epoll set or eventfd, a later lane's) closes what it
 * had opened.  A child allows one more descriptor at a time until the
 * create of a four-lane engine succeeds, and counts its own after each
 * failure.  (Lane threads that fail to start cannot be made to here:
 * RLIMIT_NPROC does not bind root, and counts all of a user's processes.)
 */
static void test_failed_create_closes_its_descriptors(void)
{
    fflush(NULL);
    pid_t child = fork();
    if (child == 0) {
        kvf_engine_params_t p;
        kvf_engine_t *eng;
        struct rlimit old, rl;
        kvf_engine_params_init(&p);
        p.role = KVF_ROLE_DECODE;
        p.transport = "tcp";
        p.streams = 4;
        /* Whatever a first engine opens for the process's life is in the base. */
        if (kvf_engine_create(&p, &eng) != KVF_OK)
            _exit(10);
        kvf_engine_destroy(eng);
        int base = open_fds(), lowest = dup(0);
        if (base < 0 || lowest < 0 || close(lowest) != 0 || getrlimit(RLIMIT_NOFILE, &old) != 0)
            _exit(11);
        for (int extra = 1; extra < 64; extra++) {
            rl = old;
            rl.rlim_cur = (rlim_t)(lowest + extra);
            if (setrlimit(RLIMIT_NOFILE, &rl) != 0)
                _exit(12);
            kvf_status_t st = kvf_engine_create(&p, &eng);
            setrlimit(RLIMIT_NOFILE, &old);
            if (st == KVF_OK) {
                unsigned lanes = kvf_engine_streams(eng);
                kvf_engine_destroy(eng);
                /* 13: a leak by a create that succeeded; 14: nothing failed */
                _exit(open_fds() != base ? 13 : extra == 1 || lanes != 4 ? 14 : 0);
            }
            if (open_fds() != base)
                _exit(20 + extra);     /* which step leaked */
        }
        _exit(15);
    }
    int status = -1;
    CHECK(child > 0 && waitpid(child, &status, 0) == child);
    CHECK(WIFEXITED(status));
    CHECK_EQ_INT(WEXITSTATUS(status), 0);
}

static void test_status_strings(void)
{
    CHECK(strcmp(kvf_status_name(KVF_ERR_TIMED_OUT), "KVF_ERR_TIMED_OUT") == 0);
    CHECK(strcmp(kvf_status_str(KVF_OK), "success") == 0);
    CHECK(strcmp(kvf_status_str((kvf_status_t)-999), "unknown status") == 0);
    CHECK(strcmp(kvf_poll_name(KVF_POLL_WAITING_FOR_INPUT), "WaitingForInput") == 0);
    CHECK(KVF_POLL_FAILED < KVF_POLL_BOOTSTRAPPING &&
          KVF_POLL_TRANSFERRING < KVF_POLL_SUCCESS);
}

/* The same cases again with payload pulled over shm. */
static void test_one_room_shm(void) { side_transport = "shm"; test_one_room(); }
/* Prefill memory from kvf_mem_alloc: the decode side maps it (memcpy). */
static void test_one_room_shm_mapped(void)
{
    side_transport = "shm";
    side_mem_alloc = 1;
    test_one_room();
    test_reset_resumes();
    side_mem_alloc = 0;
}
static void test_page_size_mismatch_shm(void) { side_transport = "shm"; test_page_size_mismatch(); }
static void test_reset_resumes_shm(void) { side_transport = "shm"; test_reset_resumes(); }
static void test_repeated_resets_give_up_shm(void)
{
    side_transport = "shm";
    test_repeated_resets_give_up();
}
static void test_corrupt_fails_with_checksum_shm(void)
{
    side_transport = "shm";
    test_corrupt_fails_with_checksum();
}
static void test_read_faults_shm(void)
{
    side_transport = "shm";
    test_failed_read_fails_the_room_only();
    test_failed_room_keeps_pages_until_reads_end();
}
static void test_bad_source_fails_the_room_only_shm(void)
{
    side_transport = "shm";
    test_bad_source_fails_the_room_only();
}
static void test_reset_while_done_waits_for_reads_shm(void)
{
    side_transport = "shm";
    test_reset_while_done_waits_for_reads();
}
static void test_reset_while_link_confirms_shm(void)
{
    side_transport = "shm";
    test_reset_while_link_confirms();
}
static void test_reset_before_sender_shm(void)
{
    side_transport = "shm";
    test_reset_before_sender();
}
static void test_fault_kept_to_one_room_shm(void)
{
    side_transport = "shm";
    test_fault_kept_to_one_room();
}
static void test_dropped_ack_times_out_shm(void)
{
    side_transport = "shm";
    test_dropped_ack_times_out();
}
static void test_lost_ack_is_said_again_shm(void)
{
    side_transport = "shm";
    test_lost_ack_is_said_again();
}

/* And over UCX (its tcp transport here, which moves reads in software:
 * allowed on loopback with KVF_UCX_SOFTWARE_RMA; RDMA on a cluster). */
static void test_over_ucx(void)
{
#ifdef KVF_HAVE_UCX
    setenv("UCX_TLS", "tcp", 1);
    setenv("KVF_UCX_SOFTWARE_RMA", "allow", 1);
    side_transport = "ucx";
    test_one_room();
    test_page_size_mismatch();
    test_reset_resumes();
    test_dropped_ack_times_out();
    test_corrupt_fails_with_checksum();   /* the same on every transport */
    test_bad_source_fails_the_room_only();
    test_failed_read_fails_the_room_only();
    test_failed_room_keeps_pages_until_reads_end();
    test_reset_while_done_waits_for_reads();
#else
    printf("SKIP test_over_ucx: built without UCX\n");
#endif
}

KVF_TEST_MAIN(KVF_CASE(test_status_strings), KVF_CASE(test_one_room),
              KVF_CASE(test_sends_published_from_threads), KVF_CASE(test_busy_poll),
              KVF_CASE(test_creates_race_for_an_id),
              KVF_CASE(test_trickling_handshake_is_closed),
              KVF_CASE(test_hostile_strided_segments),
              KVF_CASE(test_strided_only_when_accepted),
              KVF_CASE(test_page_size_mismatch), KVF_CASE(test_abort_propagates),
              KVF_CASE(test_metric_of_room_failed_first),
              KVF_CASE(test_abort_of_live_room_without_lock),
              KVF_CASE(test_abort_races_the_lanes),
              KVF_CASE(test_bad_calls), KVF_CASE(test_reset_resumes),
              KVF_CASE(test_reset_with_sends_queued),
              KVF_CASE(test_repeated_resets_give_up),
              KVF_CASE(test_corrupt_fails_with_checksum),
              KVF_CASE(test_fault_kept_to_one_room), KVF_CASE(test_fault_spec_room),
              KVF_CASE(test_fault_spec_out_of_memory),
              KVF_CASE(test_mem_alloc_io_error),
              KVF_CASE(test_failed_create_closes_its_descriptors),
              KVF_CASE(test_deadline_while_peer_lost), KVF_CASE(test_reset_before_sender),
              KVF_CASE(test_reset_with_puts_queued), KVF_CASE(test_resume_of_unread_request),
              KVF_CASE(test_dropped_ack_times_out), KVF_CASE(test_lost_ack_is_said_again),
              KVF_CASE(test_stall_is_a_dead_peer),
              KVF_CASE(test_one_room_shm), KVF_CASE(test_one_room_shm_mapped),
              KVF_CASE(test_page_size_mismatch_shm),
              KVF_CASE(test_reset_resumes_shm), KVF_CASE(test_repeated_resets_give_up_shm),
              KVF_CASE(test_corrupt_fails_with_checksum_shm),
              KVF_CASE(test_bad_source_fails_the_room_only_shm),
              KVF_CASE(test_fault_kept_to_one_room_shm),
              KVF_CASE(test_reset_while_done_waits_for_reads_shm),
              KVF_CASE(test_reset_while_link_confirms_shm),
              KVF_CASE(test_reset_before_sender_shm),
              KVF_CASE(test_read_faults_shm),
              KVF_CASE(test_dropped_ack_times_out_shm), KVF_CASE(test_lost_ack_is_said_again_shm),
              KVF_CASE(test_over_ucx),
              KVF_CASE(test_device_memory_refused))
