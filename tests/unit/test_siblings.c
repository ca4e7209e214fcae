/*
 * Siblings: when a room fails on one rank, every rank of both sides that
 * takes part in it fails it too and names the root cause and its origin,
 * also a rank whose own pair moved every byte (equal TP: prefill rank k
 * feeds decode rank k only).  Real engines in one process, TP 2 -> 2
 * around one registry, the causes the application and the engines see;
 * the process faults (kill, stop, cut) are the multi-process tests'.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/engine.h"
#include "kvferry/kvferry.h"
#define SLOTS 4
#include "unit/kvf_sides.h"

#define MAXR   4
#define NPAGES 2                    /* pages of every room here */

/* One prefill and one decode server: np and nd ranks (TP), or, with dp 2,
 * two prefill DP groups of np / 2 ranks each. */
typedef struct cluster {
    side_t pre[MAXR], dec[MAXR];
    int    np, nd, dp;
    char   bs[64];
} cluster_t;

typedef struct engine_opts {
    const char *faults;             /* KVF_FAULTS of prefill rank 0 */
    const char *decode_faults;      /* ... and of decode rank 0 */
    unsigned    waiting_timeout_ms; /* of prefill rank 0 (0: default) */
    unsigned    transfer_timeout_ms;
    int         checksum;
} engine_opts_t;

/* The settings of the next cluster's first ranks. */
static engine_opts_t next;

/* Every rank over tcp, 10 s deadlines; the first rank of each side (TP,
 * DP and pipeline rank 0) takes its settings from `next`. */
static void tune(kvf_engine_params_t *p)
{
    p->bootstrap_timeout_ms = 10000;
    p->transfer_timeout_ms = 10000;
    if (p->tp_rank != 0 || p->dp_rank != 0 || p->pp_rank != 0)
        return;
    if (p->role == KVF_ROLE_DECODE) {
        p->faults = next.decode_faults;
        return;
    }
    p->faults = next.faults;
    p->checksum = next.checksum;
    if (next.waiting_timeout_ms)
        p->waiting_timeout_ms = next.waiting_timeout_ms;
    if (next.transfer_timeout_ms)
        p->transfer_timeout_ms = next.transfer_timeout_ms;
}

/* Prefill rank 0 hosts the registry; o (may be NULL) is its settings. */
static void cluster_init(cluster_t *c, int np, int nd, int dp, const engine_opts_t *o)
{
    memset(c, 0, sizeof(*c));
    c->np = np;
    c->nd = nd;
    c->dp = dp;
    next = o != NULL ? *o : (engine_opts_t){0};
    side_tune = tune;
    side_ranks(c->pre, np, dp, c->dec, nd, c->bs, sizeof(c->bs));
}

static void cluster_fini(cluster_t *c)
{
    side_ranks_fini(c->pre, c->np, c->dec, c->nd);
}

/* One room: a sender on every prefill rank of its DP group (the first
 * `nsend` of them: pre[first..]), a receiver on every decode rank. */
typedef struct room {
    uint64_t        id;
    int             first, nsend;
    kvf_sender_t   *s[MAXR];
    kvf_receiver_t *r[MAXR];
} room_t;

static const uint32_t room_src[NPAGES] = {3, 4}, room_dst[NPAGES] = {11, 7};

/* Open room `id` on every rank and give every receiver but the ranks in
 * `skip_init` (a bit per decode rank) its destination. */
static void room_open(cluster_t *c, room_t *rm, uint64_t id, unsigned skip_init)
{
    memset(rm, 0, sizeof(*rm));
    rm->id = id;
    rm->nsend = c->np / c->dp;
    rm->first = (int)(id % (uint64_t)c->dp) * rm->nsend;
    for (int k = 0; k < rm->nsend; k++)
        CHECK_EQ_INT(kvf_sender_create(c->pre[rm->first + k].eng, c->bs, id, &rm->s[k]),
                     KVF_OK);
    for (int j = 0; j < c->nd; j++)
        CHECK_EQ_INT(kvf_receiver_create(c->dec[j].eng, c->bs, id, -1, &rm->r[j]), KVF_OK);
    for (int j = 0; j < c->nd; j++) {
        CHECK_EQ_INT(wait_receiver(rm->r[j], KVF_POLL_WAITING_FOR_INPUT),
                     KVF_POLL_WAITING_FOR_INPUT);
        if (!(skip_init & (1u << j)))
            CHECK_EQ_INT(kvf_receiver_init(rm->r[j], room_dst, NPAGES, 1, NULL, 0), KVF_OK);
    }
}

/* Sender k: init, then `chunks` of the room's two one-page chunks. */
static void room_send(room_t *rm, int k, int chunks)
{
    if (kvf_sender_poll(rm->s[k]) == KVF_POLL_BOOTSTRAPPING ||
        kvf_sender_poll(rm->s[k]) == KVF_POLL_WAITING_FOR_INPUT) {
        CHECK_EQ_INT(wait_sender(rm->s[k], KVF_POLL_WAITING_FOR_INPUT),
                     KVF_POLL_WAITING_FOR_INPUT);
        CHECK_EQ_INT(kvf_sender_init(rm->s[k], NPAGES, 2), KVF_OK);
    }
    for (int i = 0; i < chunks; i++)
        CHECK_EQ_INT(kvf_sender_send(rm->s[k], &room_src[i], 1, i == NPAGES - 1), KVF_OK);
}

/* Every sender and receiver of the room has failed (the room's `nd`:
 * its receivers). */
typedef struct room_nd {
    const room_t *rm;
    int           nd;
} room_nd_t;

static int all_failed(const void *arg)
{
    const room_nd_t *a = arg;
    int all = 1;
    for (int k = 0; k < a->rm->nsend; k++)
        all &= kvf_sender_poll(a->rm->s[k]) == KVF_POLL_FAILED;
    for (int j = 0; j < a->nd; j++)
        all &= kvf_receiver_poll(a->rm->r[j]) == KVF_POLL_FAILED;
    return all;
}

/* Until every sender and receiver of the room has failed (or 20 s). */
static int room_all_failed(const room_t *rm, int nd)
{
    room_nd_t a = {rm, nd};
    return wait_until(all_failed, &a, KVF_TEST_WAIT_MS);
}

/*
 * Every rank's record names the root cause: its status, its origin (side
 * and rank), and words from its reason; learned from another rank on
 * every rank but the origin.
 */
static void check_records(const room_t *rm, int nd, kvf_status_t st, kvf_role_t side,
                          int rank, const char *words)
{
    kvf_failure_t f;
    kvf_failure_init(&f);
    for (int i = 0; i < rm->nsend + nd; i++) {
        int pre = i < rm->nsend, k = pre ? i : i - rm->nsend;
        kvf_status_t got = pre ? kvf_sender_failure(rm->s[k], &f)
                               : kvf_receiver_failure(rm->r[k], &f);
        CHECK_EQ_INT(got, KVF_OK);
        if (got != KVF_OK)
            continue;
        int origin = (pre ? KVF_ROLE_PREFILL : KVF_ROLE_DECODE) == side &&
                     (pre ? rm->first + k : k) == rank;
        if (f.status != st || (int)f.origin_side != (int)side || f.origin_rank != rank % 2 ||
            f.from_another_rank != !origin || strstr(f.reason, words) == NULL)
            fprintf(stderr, "  %s rank %d: %s from %s rank %d (from another: %d): %s\n",
                    pre ? "prefill" : "decode", k, kvf_status_name(f.status),
                    kvf_role_name(f.origin_side), f.origin_rank, f.from_another_rank,
                    f.reason);
        CHECK_EQ_INT(f.status, st);
        CHECK_EQ_INT(f.origin_side, side);
        CHECK_EQ_INT(f.origin_rank, rank % 2);
        CHECK_EQ_INT(f.from_another_rank, !origin);
        CHECK_STR_CONTAINS(f.reason, words);
        CHECK(strstr(f.reason, "unknown") == NULL);
    }
}

static void room_close(room_t *rm, int nd)
{
    for (int k = 0; k < rm->nsend; k++)
        kvf_sender_destroy(rm->s[k]);
    for (int j = 0; j < nd; j++)
        kvf_receiver_destroy(rm->r[j]);
}

/* Pair 1 moves every byte; both its ranks succeed. */
static void pair1_succeeds(room_t *rm)
{
    room_send(rm, 1, NPAGES);
    CHECK_EQ_INT(wait_receiver(rm->r[1], KVF_POLL_SUCCESS), KVF_POLL_SUCCESS);
    CHECK_EQ_INT(wait_sender(rm->s[1], KVF_POLL_SUCCESS), KVF_POLL_SUCCESS);
}

/*
 * Prefill rank 0 aborts after its first chunk, once pair 1 has finished:
 * the two ranks of pair 1 fail the room they had finished (the request
 * failed as a whole) and, with decode rank 0, name the abort.
 */
static void test_abort_reaches_every_rank(void)
{
    cluster_t c;
    room_t rm;
    cluster_init(&c, 2, 2, 1, NULL);
    room_open(&c, &rm, 1001, 0);
    pair1_succeeds(&rm);
    room_send(&rm, 0, 1);
    kvf_sender_abort(rm.s[0]);
    CHECK(room_all_failed(&rm, 2));
    check_records(&rm, 2, KVF_ERR_ABORTED, KVF_ROLE_PREFILL, 0,
                  "aborted by the application on prefill rank 0");
    room_close(&rm, 2);
    cluster_fini(&c);
}

/* The same from the decode side: decode rank 1 aborts. */
static void test_decode_abort_reaches_every_rank(void)
{
    cluster_t c;
    room_t rm;
    cluster_init(&c, 2, 2, 1, NULL);
    room_open(&c, &rm, 1002, 0);
    room_send(&rm, 0, NPAGES);
    CHECK_EQ_INT(wait_receiver(rm.r[0], KVF_POLL_SUCCESS), KVF_POLL_SUCCESS);
    kvf_receiver_abort(rm.r[1]);
    CHECK(room_all_failed(&rm, 2));
    check_records(&rm, 2, KVF_ERR_ABORTED, KVF_ROLE_DECODE, 1,
                  "aborted by the application on decode rank 1");
    room_close(&rm, 2);
    cluster_fini(&c);
}

/*
 * Decode rank 0's application refuses the room's destination before the
 * library sees it (an index past its pool, as an adapter finds): its own
 * words reach every rank, linked to it or not.
 */
static void test_refusal_reaches_every_rank(void)
{
    cluster_t c;
    room_t rm;
    cluster_init(&c, 2, 2, 1, NULL);
    room_open(&c, &rm, 1003, 1u << 0);
    const char *why = "send_metadata(2 pages, aux 1) refused on decode rank 0: kv_indices[1] "
                      "= 999 is outside the registered KV pages";
    pair1_succeeds(&rm);
    CHECK_EQ_INT(kvf_receiver_fail(rm.r[0], 1, why), KVF_ERR_INVALID_PARAM);
    CHECK_EQ_INT(kvf_receiver_fail(rm.r[0], KVF_ERR_BAD_INDICES, why), KVF_OK);
    CHECK(room_all_failed(&rm, 2));
    check_records(&rm, 2, KVF_ERR_BAD_INDICES, KVF_ROLE_DECODE, 0, "999 is outside");
    room_close(&rm, 2);
    cluster_fini(&c);
}

/* A checksum mismatch on pair 0 (a byte flipped on its way). */
static void test_checksum_mismatch_reaches_every_rank(void)
{
    cluster_t c;
    room_t rm;
    engine_opts_t o = {.faults = "corrupt@100", .checksum = 1};
    cluster_init(&c, 2, 2, 1, &o);
    room_open(&c, &rm, 1004, 0);
    pair1_succeeds(&rm);
    room_send(&rm, 0, NPAGES);
    CHECK(room_all_failed(&rm, 2));
    check_records(&rm, 2, KVF_ERR_CHECKSUM, KVF_ROLE_DECODE, 0, "checksum mismatch");
    room_close(&rm, 2);
    cluster_fini(&c);
}

/* A deadline on one pair: prefill rank 0's scheduler never sends. */
static void test_deadline_reaches_every_rank(void)
{
    cluster_t c;
    room_t rm;
    engine_opts_t o = {.waiting_timeout_ms = 500};
    cluster_init(&c, 2, 2, 1, &o);
    room_open(&c, &rm, 1005, 0);
    pair1_succeeds(&rm);
    CHECK(room_all_failed(&rm, 2));
    check_records(&rm, 2, KVF_ERR_TIMED_OUT, KVF_ROLE_PREFILL, 0,
                  "the scheduler did not call kvf_sender_send");
    room_close(&rm, 2);
    cluster_fini(&c);
}

/*
 * Prefill TP 2 into decode TP 1: the decode rank reads from both prefill
 * ranks and is the one link between them.  Prefill rank 1's share was
 * acknowledged (its room SUCCESS) before the checksum mismatch on prefill
 * rank 0's: prefill rank 1 must hear through the decode rank that its
 * side failed (the decode rank's FAIL says so, as it never acknowledged
 * rank 0's share; and rank 0, failing its side, sends the news back to
 * the decode rank it came from) and fail its room with the cause.
 */
static void test_tp_2_to_1_every_prefill_rank_names_it(void)
{
    cluster_t c;
    room_t rm;
    engine_opts_t o = {.faults = "corrupt@100", .checksum = 1};
    cluster_init(&c, 2, 1, 1, &o);
    room_open(&c, &rm, 1008, 0);
    room_send(&rm, 1, NPAGES);
    CHECK_EQ_INT(wait_sender(rm.s[1], KVF_POLL_SUCCESS), KVF_POLL_SUCCESS);
    room_send(&rm, 0, NPAGES);
    CHECK(room_all_failed(&rm, 1));
    check_records(&rm, 1, KVF_ERR_CHECKSUM, KVF_ROLE_DECODE, 0, "checksum mismatch");
    room_close(&rm, 1);
    cluster_fini(&c);
}

/*
 * Prefill rank 0's scheduler never sends (its deadline), and no relay can
 * help: prefill rank 1 let its room go once it succeeded, and prefill
 * rank 0's is destroyed the moment it fails, as a scheduler clears a room
 * once it raised.  Decode rank 1, whose pair had succeeded, fails all the
 * same, from prefill rank 0's FAIL itself: a sender that was never given
 * its last chunk says that the decode side failed with it.
 */
static void test_a_failure_that_dooms_the_other_side_says_so(void)
{
    cluster_t c;
    room_t rm;
    engine_opts_t o = {.waiting_timeout_ms = 500};
    kvf_failure_t f;
    kvf_failure_init(&f);
    cluster_init(&c, 2, 2, 1, &o);
    room_open(&c, &rm, 1009, 0);
    pair1_succeeds(&rm);
    kvf_sender_destroy(rm.s[1]);
    CHECK_EQ_INT(kvf_sender_await_failure(rm.s[0], KVF_TEST_WAIT_MS), KVF_OK);
    kvf_sender_destroy(rm.s[0]);
    for (int j = 0; j < 2; j++) {
        CHECK_EQ_INT(kvf_receiver_await_failure(rm.r[j], KVF_TEST_WAIT_MS), KVF_OK);
        CHECK_EQ_INT(kvf_receiver_failure(rm.r[j], &f), KVF_OK);
        CHECK_EQ_INT(f.status, KVF_ERR_TIMED_OUT);
        CHECK_EQ_INT(f.origin_side, KVF_ROLE_PREFILL);
        CHECK_EQ_INT(f.origin_rank, 0);
        CHECK_EQ_INT(f.from_another_rank, 1);
        kvf_receiver_destroy(rm.r[j]);
    }
    cluster_fini(&c);
}

/*
 * A failure on one side after the other side had every byte: prefill
 * rank 0 never hears its decode's acknowledgement (its transfer deadline
 * ends it).  The prefill server failed the request, both its ranks say
 * why; the decode server has the whole KV, and its rooms stay SUCCESS.
 */
static void test_one_side_failure_keeps_the_other_sides_success(void)
{
    cluster_t c;
    room_t rm;
    engine_opts_t o = {.decode_faults = "drop-ack", .transfer_timeout_ms = 500};
    kvf_failure_t f;
    kvf_failure_init(&f);
    cluster_init(&c, 2, 2, 1, &o);
    room_open(&c, &rm, 1006, 0);
    pair1_succeeds(&rm);
    room_send(&rm, 0, NPAGES);
    CHECK_EQ_INT(wait_receiver(rm.r[0], KVF_POLL_SUCCESS), KVF_POLL_SUCCESS);
    CHECK_EQ_INT(wait_sender(rm.s[0], KVF_POLL_SUCCESS), KVF_POLL_FAILED);
    CHECK_EQ_INT(kvf_sender_await_failure(rm.s[1], KVF_TEST_WAIT_MS), KVF_OK);
    for (int k = 0; k < 2; k++) {
        CHECK_EQ_INT(kvf_sender_failure(rm.s[k], &f), KVF_OK);
        CHECK_EQ_INT(f.status, KVF_ERR_TIMED_OUT);
        CHECK_EQ_INT(f.origin_side, KVF_ROLE_PREFILL);
        CHECK_EQ_INT(f.origin_rank, 0);
        CHECK_EQ_INT(f.from_another_rank, k);
    }
    /* Told (prefill rank 1 learned it through them), the decode ranks
     * keep their success: their side did not fail. */
    for (int j = 0; j < 2; j++) {
        CHECK_EQ_INT(kvf_receiver_poll(rm.r[j]), KVF_POLL_SUCCESS);
        CHECK_EQ_INT(kvf_receiver_failure(rm.r[j], &f), KVF_ERR_AGAIN);
    }
    room_close(&rm, 2);
    cluster_fini(&c);
}

/*
 * Decode rank 0 fails the room after pair 1 has finished, and decode
 * rank 1 has already let its room go (its scheduler saw it final): the
 * news that the prefill side failed (prefill rank 0's) has no decode rank
 * left to travel through to prefill rank 1, which keeps its success and
 * the cause it heard from decode rank 0.  Its scheduler's all-reduce says
 * the request failed on the prefill side; told so (await_failure), it
 * fails at once with that cause, never "unknown reason".
 */
static void test_success_takes_the_kept_cause_when_its_side_failed(void)
{
    cluster_t c;
    room_t rm;
    kvf_failure_t f;
    kvf_failure_init(&f);
    const char *why = "decode rank 0 refused the room: no pages left";
    cluster_init(&c, 2, 2, 1, NULL);
    room_open(&c, &rm, 1008, 0);
    pair1_succeeds(&rm);
    kvf_receiver_destroy(rm.r[1]);
    CHECK_EQ_INT(kvf_receiver_fail(rm.r[0], KVF_ERR_ABORTED, why), KVF_OK);
    CHECK_EQ_INT(wait_sender(rm.s[0], KVF_POLL_SUCCESS), KVF_POLL_FAILED);
    CHECK_EQ_INT(kvf_sender_await_failure(rm.s[1], KVF_TEST_WAIT_MS), KVF_OK);
    for (int k = 0; k < 2; k++) {
        CHECK_EQ_INT(kvf_sender_failure(rm.s[k], &f), KVF_OK);
        CHECK_EQ_INT(f.status, KVF_ERR_ABORTED);
        CHECK_EQ_INT(f.origin_side, KVF_ROLE_DECODE);
        CHECK_EQ_INT(f.origin_rank, 0);
        CHECK_EQ_INT(f.from_another_rank, 1);
        CHECK_STR_CONTAINS(f.reason, "no pages left");
    }
    rm.r[1] = NULL;
    room_close(&rm, 2);
    cluster_fini(&c);
}

/*
 * Decode rank 1's application fails a room right after creating it,
 * before the engine found its prefill ranks in the registry or connected
 * to them.  Both prefill ranks wait for decode destinations; they learn of
 * the failure as soon as the links are up, and name decode rank 1's cause
 * rather than their own bootstrap deadline.
 */
static void test_fail_before_linked_reaches_prefill(void)
{
    cluster_t c;
    kvf_sender_t *s[2];
    kvf_receiver_t *rcv;
    kvf_failure_t f;
    kvf_failure_init(&f);
    cluster_init(&c, 2, 2, 1, NULL);
    for (int k = 0; k < 2; k++)
        CHECK_EQ_INT(kvf_sender_create(c.pre[k].eng, c.bs, 1010, &s[k]), KVF_OK);
    CHECK_EQ_INT(kvf_receiver_create(c.dec[1].eng, c.bs, 1010, -1, &rcv), KVF_OK);
    CHECK_EQ_INT(kvf_receiver_fail(rcv, KVF_ERR_BAD_INDICES, "decode rank 1 has no pages"),
                 KVF_OK);
    for (int k = 0; k < 2; k++) {
        CHECK_EQ_INT(wait_sender(s[k], KVF_POLL_SUCCESS), KVF_POLL_FAILED);
        CHECK_EQ_INT(kvf_sender_failure(s[k], &f), KVF_OK);
        CHECK_EQ_INT(f.status, KVF_ERR_BAD_INDICES);
        CHECK_EQ_INT(f.origin_side, KVF_ROLE_DECODE);
        CHECK_EQ_INT(f.origin_rank, 1);
        CHECK_EQ_INT(f.from_another_rank, 1);
        CHECK_STR_CONTAINS(f.reason, "has no pages");
        kvf_sender_destroy(s[k]);
    }
    kvf_receiver_destroy(rcv);
    cluster_fini(&c);
}

/*
 * Decode rank 1 fails a room (prefill rank 0 aborted it; decode rank 1
 * hears it on its sibling link) while its own connection to prefill rank
 * 1, the rank it reads from, is still being made, and its scheduler
 * destroys the room at once (it is final).  Prefill rank 1, whose sender
 * waits for decode rank 1's destination, still learns of the abort as
 * soon as the connection is up, rather than fail at its bootstrap
 * deadline naming that.  Prefill rank 1 is held (its engine lock) until
 * then, so that the connection cannot be up before.
 */
static void test_fail_before_connected_reaches_prefill(void)
{
    cluster_t c;
    kvf_sender_t *s[2];
    kvf_receiver_t *warm, *rcv;
    kvf_failure_t f;
    kvf_failure_init(&f);
    cluster_init(&c, 2, 2, 1, NULL);
    /* Both prefill ranks are in the registry once a room resolves. */
    CHECK_EQ_INT(kvf_receiver_create(c.dec[0].eng, c.bs, 999, -1, &warm), KVF_OK);
    CHECK_EQ_INT(wait_receiver(warm, KVF_POLL_WAITING_FOR_INPUT), KVF_POLL_WAITING_FOR_INPUT);
    kvf_receiver_destroy(warm);
    for (int k = 0; k < 2; k++)
        CHECK_EQ_INT(kvf_sender_create(c.pre[k].eng, c.bs, 1011, &s[k]), KVF_OK);
    kvf_sender_abort(s[0]);
    kvf__lock(c.pre[1].eng);
    CHECK_EQ_INT(kvf_receiver_create(c.dec[1].eng, c.bs, 1011, -1, &rcv), KVF_OK);
    CHECK_EQ_INT(wait_receiver(rcv, KVF_POLL_SUCCESS), KVF_POLL_FAILED);
    kvf_receiver_destroy(rcv);
    kvf__unlock(c.pre[1].eng);
    CHECK_EQ_INT(wait_sender(s[1], KVF_POLL_SUCCESS), KVF_POLL_FAILED);
    CHECK_EQ_INT(kvf_sender_failure(s[1], &f), KVF_OK);
    CHECK_EQ_INT(f.status, KVF_ERR_ABORTED);
    CHECK_EQ_INT(f.origin_side, KVF_ROLE_PREFILL);
    CHECK_EQ_INT(f.origin_rank, 0);
    CHECK_EQ_INT(f.from_another_rank, 1);
    for (int k = 0; k < 2; k++)
        kvf_sender_destroy(s[k]);
    cluster_fini(&c);
}

/* Prefill and decode with two pipeline stages each (TP 1): stage s feeds
 * stage s, and each decode stage watches the other prefill stage. */
static void cluster_init_pp(cluster_t *c)
{
    memset(c, 0, sizeof(*c));
    c->np = c->nd = 2;
    c->dp = 1;
    next = (engine_opts_t){0};
    side_tune = tune;
    for (int stage = 0; stage < 2; stage++) {
        side_rank = (side_rank_t){.pp = stage, .pp_size = 2};
        side_init(&c->pre[stage], KVF_ROLE_PREFILL, stage ? c->bs : "127.0.0.1:0", NULL);
        if (stage == 0)
            CHECK_EQ_INT(kvf_engine_bootstrap_addr(c->pre[0].eng, c->bs, sizeof(c->bs)),
                         KVF_OK);
    }
    for (int stage = 0; stage < 2; stage++) {
        side_rank = (side_rank_t){.pp = stage, .pp_size = 2};
        side_init(&c->dec[stage], KVF_ROLE_DECODE, NULL, NULL);
    }
    side_rank = (side_rank_t){0};
}

/* Prefill stage 0 aborts a room after stage 1's pair finished it. */
static void pp_abort(void *arg)
{
    room_t *rm = arg;
    cluster_t c;
    cluster_init_pp(&c);
    room_open(&c, rm, 1009, 0);
    pair1_succeeds(rm);
    room_send(rm, 0, 1);
    kvf_sender_abort(rm->s[0]);
    CHECK(room_all_failed(rm, 2));
    check_records(rm, 2, KVF_ERR_ABORTED, KVF_ROLE_PREFILL, 0,
                  "aborted by the application on prefill rank 0 of stage 0");
    room_close(rm, 2);
    cluster_fini(&c);
}

/*
 * Two pipeline stages on both sides: the abort on prefill stage 0 reaches
 * both stages of both sides (the decode stages watch the other prefill
 * stage), and those cross-stage links, whose layers differ by design, log
 * no configuration error.
 */
static void test_pp_stages_hear_each_other(void)
{
    room_t rm;
    CHECK_EQ_INT(log_lines_during(pp_abort, &rm, "Pipeline stage mismatch"), 0);
}

/*
 * Two prefill DP groups: a room of group 0 fails; the room of group 1
 * beside it succeeds byte for byte, and the reason names the DP group.
 */
static void test_dp_groups_stay_apart(void)
{
    cluster_t c;
    room_t bad, good;
    cluster_init(&c, 2, 1, 2, NULL);
    room_open(&c, &bad, 2000, 0);           /* 2000 % 2: group 0 (prefill rank 0) */
    room_open(&c, &good, 2001, 0);          /* group 1 (pre[1]) */
    CHECK(bad.first == 0 && good.first == 1);
    room_send(&bad, 0, 1);
    kvf_sender_abort(bad.s[0]);
    room_send(&good, 0, NPAGES);
    CHECK(room_all_failed(&bad, 1));
    kvf_failure_t f;
    kvf_failure_init(&f);
    CHECK_EQ_INT(kvf_receiver_failure(bad.r[0], &f), KVF_OK);
    CHECK_STR_CONTAINS(f.reason, "prefill rank 0 of DP group 0");
    CHECK_EQ_INT(wait_receiver(good.r[0], KVF_POLL_SUCCESS), KVF_POLL_SUCCESS);
    CHECK_EQ_INT(wait_sender(good.s[0], KVF_POLL_SUCCESS), KVF_POLL_SUCCESS);
    CHECK_EQ_INT(kvf_receiver_await_failure(good.r[0], 200), KVF_ERR_AGAIN);
    for (int b = 0; b < NKV; b++)
        for (int i = 0; i < NPAGES; i++)
            CHECK(memcmp(c.dec[0].kv[b] + room_dst[i] * c.dec[0].page_b,
                         c.pre[1].kv[b] + room_src[i] * c.pre[1].page_b,
                         c.dec[0].page_b) == 0);
    room_close(&bad, 1);
    room_close(&good, 1);
    cluster_fini(&c);
}

/* TP 2 -> 2 with nothing wrong: every byte, and no rank hears a failure. */
static void test_every_rank_succeeds(void)
{
    cluster_t c;
    room_t rm;
    cluster_init(&c, 2, 2, 1, NULL);
    room_open(&c, &rm, 1007, 0);
    room_send(&rm, 0, NPAGES);
    pair1_succeeds(&rm);
    CHECK_EQ_INT(wait_receiver(rm.r[0], KVF_POLL_SUCCESS), KVF_POLL_SUCCESS);
    CHECK_EQ_INT(wait_sender(rm.s[0], KVF_POLL_SUCCESS), KVF_POLL_SUCCESS);
    CHECK_EQ_INT(kvf_receiver_await_failure(rm.r[0], 100), KVF_ERR_AGAIN);
    for (int j = 0; j < 2; j++)
        for (int b = 0; b < NKV; b++)
            for (int i = 0; i < NPAGES; i++)
                CHECK(memcmp(c.dec[j].kv[b] + room_dst[i] * c.dec[j].page_b,
                             c.pre[j].kv[b] + room_src[i] * c.pre[j].page_b,
                             c.dec[j].page_b) == 0);
    room_close(&rm, 2);
    cluster_fini(&c);
}

KVF_TEST_MAIN(KVF_CASE(test_every_rank_succeeds),
              KVF_CASE(test_abort_reaches_every_rank),
              KVF_CASE(test_decode_abort_reaches_every_rank),
              KVF_CASE(test_refusal_reaches_every_rank),
              KVF_CASE(test_checksum_mismatch_reaches_every_rank),
              KVF_CASE(test_deadline_reaches_every_rank),
              KVF_CASE(test_tp_2_to_1_every_prefill_rank_names_it),
              KVF_CASE(test_a_failure_that_dooms_the_other_side_says_so),
              KVF_CASE(test_one_side_failure_keeps_the_other_sides_success),
              KVF_CASE(test_success_takes_the_kept_cause_when_its_side_failed),
              KVF_CASE(test_dp_groups_stay_apart),
              KVF_CASE(test_pp_stages_hear_each_other),
              KVF_CASE(test_fail_before_linked_reaches_prefill),
              KVF_CASE(test_fail_before_connected_reaches_prefill))
