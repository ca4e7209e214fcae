/*
 * The room trace: every rank of a TP 2 -> 2 room writes its own lines
 * (one file per engine), and a room that fails on one pair (a byte
 * corrupted on its way, checksums on) shows the root cause first, and
 * once, on the rank that saw it: every other rank's "failed" line is
 * later and says it learned it from another rank, naming that origin.
 * Also: every line parses, each rank's clock only moves forward, the
 * story has its steps (created ... destroyed, watches), and the trace
 * specs ("fd:N", a path that cannot be opened).
 */
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <jansson.h>

#include "kvferry/kvferry.h"
#define SLOTS 4
#include "unit/kvf_sides.h"

#define NPAGES 2

static char dir[64];

/* Where the rank of `role` and TP rank tp writes its trace. */
static const char *trace_of(kvf_role_t role, int tp)
{
    static char path[2][2][256];
    int pre = role == KVF_ROLE_PREFILL;
    snprintf(path[pre][tp], sizeof(path[pre][tp]), "%s/%s%d.jsonl", dir,
             pre ? "prefill" : "decode", tp);
    return path[pre][tp];
}

/* Every rank writes its trace, checks its bytes, keeps the library's
 * deadlines; prefill rank 0 corrupts a byte on its way. */
static void tune(kvf_engine_params_t *p)
{
    p->checksum = 1;
    p->trace = trace_of(p->role, p->tp_rank);
    if (p->role == KVF_ROLE_PREFILL && p->tp_rank == 0)
        p->faults = "corrupt@100";
}

/* ---- reading the trace ------------------------------------------------------ */

typedef struct rec {
    json_t     *j;
    const char *event;
    const char *side;
    int         tp;
    long long   wall, mono;
} rec_t;

/* Every line of `path` naming room `room`, appended to recs. */
static void load(const char *path, const char *room, rec_t *recs, int *n, int max)
{
    FILE *f = fopen(path, "r");
    char line[4096];
    long long last_mono = 0;
    CHECK(f != NULL);
    while (f != NULL && fgets(line, sizeof(line), f) != NULL) {
        json_error_t err;
        json_t *j = json_loads(line, 0, &err);
        CHECK(json_is_object(j));
        if (!json_is_object(j))
            continue;
        long long mono = json_integer_value(json_object_get(j, "mono_ns"));
        CHECK(mono >= last_mono);            /* one rank's clock moves forward */
        CHECK(json_integer_value(json_object_get(j, "wall_ns")) > 1600000000000000000LL);
        last_mono = mono;
        if (strcmp(json_string_value(json_object_get(j, "room")), room) != 0 || *n == max) {
            json_decref(j);
            continue;
        }
        rec_t *r = &recs[(*n)++];
        r->j = j;
        r->event = json_string_value(json_object_get(j, "event"));
        r->side = json_string_value(json_object_get(j, "side"));
        r->tp = (int)json_integer_value(json_object_get(j, "tp"));
        r->wall = json_integer_value(json_object_get(j, "wall_ns"));
        r->mono = mono;
    }
    if (f != NULL)
        fclose(f);
}

static int by_wall(const void *a, const void *b)
{
    const rec_t *x = a, *y = b;
    return x->wall < y->wall ? -1 : x->wall > y->wall;
}

static int has(const rec_t *recs, int n, const char *side, int tp, const char *event)
{
    for (int i = 0; i < n; i++)
        if (strcmp(recs[i].side, side) == 0 && recs[i].tp == tp &&
            strcmp(recs[i].event, event) == 0)
            return 1;
    fprintf(stderr, "  no %s on %s rank %d\n", event, side, tp);
    return 0;
}

/* ---- the room ---------------------------------------------------------------- */

static const uint32_t src_pages[NPAGES] = {3, 4}, dst_pages[NPAGES] = {11, 7};

static void sender_go(kvf_sender_t *s)
{
    CHECK_EQ_INT(wait_sender(s, KVF_POLL_WAITING_FOR_INPUT), KVF_POLL_WAITING_FOR_INPUT);
    CHECK_EQ_INT(kvf_sender_init(s, NPAGES, 2), KVF_OK);
    CHECK_EQ_INT(kvf_sender_send(s, src_pages, 1, 0), KVF_OK);
    /* Taken in alone (TRANSFERRING), so that each chunk has its event: two
     * sends the engine takes in at once are queued as one. */
    CHECK(wait_sender(s, KVF_POLL_TRANSFERRING) >= KVF_POLL_TRANSFERRING);
    CHECK_EQ_INT(kvf_sender_send(s, src_pages + 1, 1, 1), KVF_OK);
}

static void test_root_cause_first_on_its_rank(void)
{
    side_t pre[2], dec[2];
    char bs[64];
    const uint64_t id = 4242;
    snprintf(dir, sizeof(dir), "/tmp/kvf-trace-XXXXXX");
    CHECK(mkdtemp(dir) != NULL);
    side_bootstrap_ms = side_transfer_ms = 0;
    side_tune = tune;
    side_ranks(pre, 2, 1, dec, 2, bs, sizeof(bs));

    kvf_sender_t *s[2];
    kvf_receiver_t *r[2];
    for (int k = 0; k < 2; k++)
        CHECK_EQ_INT(kvf_sender_create(pre[k].eng, bs, id, &s[k]), KVF_OK);
    for (int j = 0; j < 2; j++) {
        CHECK_EQ_INT(kvf_receiver_create(dec[j].eng, bs, id, -1, &r[j]), KVF_OK);
        CHECK_EQ_INT(wait_receiver(r[j], KVF_POLL_WAITING_FOR_INPUT),
                     KVF_POLL_WAITING_FOR_INPUT);
        CHECK_EQ_INT(kvf_receiver_init(r[j], dst_pages, NPAGES, 1, NULL, 0), KVF_OK);
    }
    /* Pair 1 moves every byte first; then pair 0's byte is corrupted. */
    sender_go(s[1]);
    CHECK_EQ_INT(wait_receiver(r[1], KVF_POLL_SUCCESS), KVF_POLL_SUCCESS);
    CHECK_EQ_INT(wait_sender(s[1], KVF_POLL_SUCCESS), KVF_POLL_SUCCESS);
    sender_go(s[0]);
    for (int k = 0; k < 2; k++) {
        CHECK_EQ_INT(kvf_sender_await_failure(s[k], KVF_TEST_WAIT_MS), KVF_OK);
        CHECK_EQ_INT(kvf_receiver_await_failure(r[k], KVF_TEST_WAIT_MS), KVF_OK);
    }
    for (int k = 0; k < 2; k++) {
        kvf_sender_destroy(s[k]);
        kvf_receiver_destroy(r[k]);
    }
    side_ranks_fini(pre, 2, dec, 2);

    rec_t recs[512];
    int n = 0;
    for (int i = 0; i < 4; i++)
        load(trace_of(i < 2 ? KVF_ROLE_PREFILL : KVF_ROLE_DECODE, i % 2), "4242", recs, &n,
             512);
    qsort(recs, (size_t)n, sizeof(recs[0]), by_wall);

    /* The first "failed" is the root cause, on decode rank 0 (its
     * checksum did not match); each rank has one, and every other one is
     * learned, later, naming that origin. */
    int failed = 0, first = -1;
    for (int i = 0; i < n; i++) {
        if (strcmp(recs[i].event, "failed") != 0)
            continue;
        json_t *j = recs[i].j;
        int learned = (int)json_integer_value(json_object_get(j, "from_another_rank"));
        CHECK_STR_CONTAINS(json_string_value(json_object_get(j, "status")),
                           "KVF_ERR_CHECKSUM");
        CHECK_STR_CONTAINS(json_string_value(json_object_get(j, "origin_side")), "decode");
        CHECK_EQ_INT(json_integer_value(json_object_get(j, "origin_rank")), 0);
        CHECK_STR_CONTAINS(json_string_value(json_object_get(j, "reason")),
                           "checksum mismatch");
        if (first < 0) {
            first = i;
            CHECK_EQ_INT(learned, 0);
            CHECK_STR_CONTAINS(recs[i].side, "decode");
            CHECK_EQ_INT(recs[i].tp, 0);
        } else {
            CHECK_EQ_INT(learned, 1);
            CHECK(json_string_value(json_object_get(j, "via")) != NULL);
        }
        failed++;
    }
    CHECK_EQ_INT(failed, 4);
    /* Pair 1 had succeeded: its two ranks say the failure came after. */
    for (int i = 0; i < n; i++)
        if (strcmp(recs[i].event, "failed") == 0 && recs[i].tp == 1)
            CHECK_EQ_INT(json_integer_value(json_object_get(recs[i].j, "after_success")), 1);
    /* The story on each rank. */
    static const char *const every[] = {"created", "state", "failed", "destroyed"};
    for (int i = 0; i < 4; i++)
        for (size_t e = 0; e < sizeof(every) / sizeof(every[0]); e++)
            CHECK(has(recs, n, i < 2 ? "prefill" : "decode", i % 2, every[e]));
    for (int k = 0; k < 2; k++) {
        CHECK(has(recs, n, "prefill", k, "dest_received"));
        CHECK(has(recs, n, "prefill", k, "chunk_queued"));
        CHECK(has(recs, n, "prefill", k, "last_chunk_queued"));
        CHECK(has(recs, n, "prefill", k, "chunk_done"));
        CHECK(has(recs, n, "prefill", k, "done_sent"));
        CHECK(has(recs, n, "decode", k, "resolved"));
        CHECK(has(recs, n, "decode", k, "connected"));
        CHECK(has(recs, n, "decode", k, "dest_set"));
        CHECK(has(recs, n, "decode", k, "request_sent"));
        CHECK(has(recs, n, "decode", k, "watch_sent"));
        CHECK(has(recs, n, "prefill", k, "watch_received"));
    }
    CHECK(has(recs, n, "decode", 1, "ack_sent"));
    CHECK(has(recs, n, "prefill", 1, "ack_received"));
    for (int i = 0; i < n; i++)
        json_decref(recs[i].j);
    for (int i = 0; i < 4; i++)
        unlink(trace_of(i < 2 ? KVF_ROLE_PREFILL : KVF_ROLE_DECODE, i % 2));
    rmdir(dir);
}

/* "fd:N" writes to the application's descriptor; a bad spec is refused. */
static void test_trace_specs(void)
{
    kvf_engine_params_t p;
    kvf_engine_t *eng = NULL;
    char path[] = "/tmp/kvf-trace-fd-XXXXXX";
    int fd = mkstemp(path);
    char spec[32];
    CHECK(fd >= 0);
    snprintf(spec, sizeof(spec), "fd:%d", fd);
    kvf_engine_params_init(&p);
    p.trace = spec;
    CHECK_EQ_INT(kvf_engine_create(&p, &eng), KVF_OK);
    kvf_engine_destroy(eng);
    CHECK(fcntl(fd, F_GETFD) >= 0);          /* the application's: left open */
    close(fd);
    unlink(path);

    p.trace = "fd:notanumber";
    CHECK_EQ_INT(kvf_engine_create(&p, &eng), KVF_ERR_INVALID_PARAM);
    p.trace = "/nonexistent-dir/trace.jsonl";
    CHECK_EQ_INT(kvf_engine_create(&p, &eng), KVF_ERR_INVALID_PARAM);
    CHECK_STR_CONTAINS(kvf_last_error(), "cannot open it for appending");
    /* From the environment when the parameter is not set. */
    p.trace = NULL;
    CHECK_EQ_INT(setenv("KVF_TRACE", "/nonexistent-dir/trace.jsonl", 1), 0);
    CHECK_EQ_INT(kvf_engine_create(&p, &eng), KVF_ERR_INVALID_PARAM);
    unsetenv("KVF_TRACE");
    CHECK_EQ_INT(kvf_engine_create(&p, &eng), KVF_OK);
    kvf_engine_destroy(eng);
}

KVF_TEST_MAIN(KVF_CASE(test_root_cause_first_on_its_rank),
              KVF_CASE(test_trace_specs))
