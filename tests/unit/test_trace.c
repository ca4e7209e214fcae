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
#include "unit/kvf_rooms.h"
#include "unit/kvf_test.h"

#define LAYERS 2
#define NKV    (2 * LAYERS)
#define HEADS  2
#define HEAD_B 32
#define PAGE   4
#define PAGES  32
#define AUX_B  16
#define SLOTS  4
#define NPAGES 2

typedef struct rank {
    kvf_engine_t *eng;
    uint8_t      *kv[NKV];
    uint8_t      *aux;
    char          trace[256];
} rank_t;

static char dir[64];

static void rank_init(rank_t *r, kvf_role_t role, int tp, const char *bs, int host_bs,
                      const char *faults)
{
    kvf_engine_params_t p;
    kvf_engine_params_init(&p);
    snprintf(r->trace, sizeof(r->trace), "%s/%s%d.jsonl", dir,
             role == KVF_ROLE_PREFILL ? "prefill" : "decode", tp);
    p.role = role;
    p.tp_rank = tp;
    p.tp_size = 2;
    p.bootstrap_addr = bs;
    p.host_bootstrap = host_bs;
    p.transport = "tcp";
    p.checksum = 1;
    p.faults = faults;
    p.trace = r->trace;
    CHECK_EQ_INT(kvf_engine_create(&p, &r->eng), KVF_OK);
    size_t page_b = (size_t)PAGE * (HEADS / 2) * HEAD_B;
    kvf_buffer_t kv[NKV], aux;
    for (int i = 0; i < NKV; i++) {
        r->kv[i] = calloc(PAGES, page_b);
        for (size_t j = 0; role == KVF_ROLE_PREFILL && j < PAGES * page_b; j++)
            r->kv[i][j] = (uint8_t)(j * 7 + (size_t)i * 13 + (size_t)tp * 31 + 1);
        kv[i] = (kvf_buffer_t){r->kv[i], PAGES * page_b, page_b};
    }
    r->aux = calloc(SLOTS, AUX_B);
    aux = (kvf_buffer_t){r->aux, SLOTS * AUX_B, AUX_B};
    kvf_layout_t l;
    kvf_layout_init(&l);
    l.page_size = PAGE;
    l.kv_dtype = "bfloat16";
    l.num_layers = LAYERS;
    l.heads_per_rank = HEADS / 2;
    l.total_heads = HEADS;
    l.bytes_per_head = HEAD_B;
    l.num_kv = NKV;
    l.kv = kv;
    l.num_aux = 1;
    l.aux = &aux;
    CHECK_EQ_INT(kvf_engine_register_layout(r->eng, &l), KVF_OK);
}

static void rank_fini(rank_t *r)
{
    kvf_engine_destroy(r->eng);
    for (int i = 0; i < NKV; i++)
        free(r->kv[i]);
    free(r->aux);
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
    CHECK_EQ_INT(kvf_sender_send(s, src_pages + 1, 1, 1), KVF_OK);
}

static void test_root_cause_first_on_its_rank(void)
{
    rank_t pre[2], dec[2];
    char bs[64];
    const uint64_t id = 4242;
    snprintf(dir, sizeof(dir), "/tmp/kvf-trace-XXXXXX");
    CHECK(mkdtemp(dir) != NULL);
    rank_init(&pre[0], KVF_ROLE_PREFILL, 0, "127.0.0.1:0", 1, "corrupt@100");
    CHECK_EQ_INT(kvf_engine_bootstrap_addr(pre[0].eng, bs, sizeof(bs)), KVF_OK);
    rank_init(&pre[1], KVF_ROLE_PREFILL, 1, bs, 0, NULL);
    for (int j = 0; j < 2; j++)
        rank_init(&dec[j], KVF_ROLE_DECODE, j, NULL, 0, NULL);

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
    for (int j = 0; j < 2; j++)
        rank_fini(&dec[j]);
    rank_fini(&pre[1]);
    rank_fini(&pre[0]);

    rec_t recs[512];
    int n = 0;
    const rank_t *all[4] = {&pre[0], &pre[1], &dec[0], &dec[1]};
    for (int i = 0; i < 4; i++)
        load(all[i]->trace, "4242", recs, &n, 512);
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
        unlink(all[i]->trace);
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
