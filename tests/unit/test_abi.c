/*
 * The growth contract of the parameter structs and the records
 * (kvferry.h): a caller states its struct's size, and the library neither
 * reads nor writes past it.
 * Callers are simulated by buffers of exactly the size a header would give
 * them: the first version's (KVF_*_SIZE_V0), less than that, or more (a
 * newer header with fields this library lacks).  Engines are real: a
 * decode engine needs no registry.
 */
#include <limits.h>
#include <stdalign.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvferry/kvferry.h"
#include "unit/kvf_test.h"

#define CANARY 0xAA
#define EXTRA  32      /* bytes a "newer header" adds */
#define PAGE   4
#define HEAD_B 16
#define PAGES  8

/* A buffer with room for any size tried here, plus canaries after it. */
typedef struct {
    alignas(max_align_t) unsigned char b[sizeof(kvf_engine_params_t) +
                                         sizeof(kvf_layout_t) + 2 * EXTRA];
} scratch_t;

static char sizebuf[32];

static const char *zu(size_t n)
{
    snprintf(sizebuf, sizeof(sizebuf), "%zu", n);
    return sizebuf;
}

/* Is every byte of b[from..to) still a canary? */
static int canaries_intact_at(const unsigned char *b, size_t from, size_t to)
{
    for (size_t i = from; i < to; i++)
        if (b[i] != CANARY)
            return 0;
    return 1;
}

static int canaries_intact(const scratch_t *s, size_t from)
{
    return canaries_intact_at(s->b, from, sizeof(s->b));
}

static size_t stored_size(const scratch_t *s)
{
    size_t v;
    memcpy(&v, s->b, sizeof(v));
    return v;
}

/* Decode params in the caller's struct p (of any size >= V0). */
static void decode_params(kvf_engine_params_t *p)
{
    p->role = KVF_ROLE_DECODE;
    p->transport = "tcp";
}

static kvf_status_t create_destroy(const kvf_engine_params_t *p)
{
    kvf_engine_t *eng = NULL;
    kvf_status_t st = kvf_engine_create(p, &eng);
    if (st == KVF_OK) {
        CHECK(eng != NULL);
        kvf_engine_destroy(eng);
    }
    return st;
}

/* (d) Init writes exactly `size` bytes, whatever the size. */
static void test_init_writes_only_size(void)
{
    const size_t pv0 = KVF_ENGINE_PARAMS_SIZE_V0, lv0 = KVF_LAYOUT_SIZE_V0;
    const size_t psizes[] = {0, 4, pv0 - 8, pv0, sizeof(kvf_engine_params_t),
                             sizeof(kvf_engine_params_t) + EXTRA};
    const size_t lsizes[] = {0, 4, lv0 - 4, lv0, sizeof(kvf_layout_t),
                             sizeof(kvf_layout_t) + EXTRA};
    scratch_t s;

    for (size_t i = 0; i < sizeof(psizes) / sizeof(psizes[0]); i++) {
        memset(s.b, CANARY, sizeof(s.b));
        kvf_engine_params_init_sized((kvf_engine_params_t *)s.b, psizes[i]);
        CHECK(canaries_intact(&s, psizes[i]));
        if (psizes[i] >= sizeof(size_t))
            CHECK_EQ_INT(stored_size(&s), psizes[i]);
        if (psizes[i] >= pv0) {
            kvf_engine_params_t *p = (kvf_engine_params_t *)s.b;
            CHECK_EQ_INT(p->tp_size, 1);
            CHECK(p->host != NULL);
            CHECK(p->heartbeat_timeout_ms > p->heartbeat_interval_ms);
        }
        /* A field added after 0.1.0 gets its default when the size holds
         * it; past the fields the library knows: zeroed, never garbage. */
        const size_t known = KVF_FIELD_END(kvf_engine_params_t, trace);
        const kvf_engine_params_t *ip = (const kvf_engine_params_t *)s.b;
        if (psizes[i] >= KVF_FIELD_END(kvf_engine_params_t, handshake_timeout_ms))
            CHECK_EQ_INT(ip->handshake_timeout_ms, 5000);
        if (psizes[i] >= KVF_FIELD_END(kvf_engine_params_t, auth_token))
            CHECK(ip->auth_token == NULL);
        /* The registration fields default to 0/NULL ("the default"). */
        if (psizes[i] >= known) {
            CHECK_EQ_INT(ip->cp_rank, 0);
            CHECK_EQ_INT(ip->cp_size, 0);
            CHECK_EQ_INT(ip->dp_attention, 0);
            CHECK(ip->kv_cache_dtype == NULL);
            CHECK(ip->load_balance_method == NULL);
            CHECK_EQ_INT(ip->prefill_http_port, 0);
            CHECK_EQ_INT(ip->dsa_cache_layer_split, 0);
            CHECK_EQ_INT(ip->streams, 0);
            CHECK(ip->api_key == NULL);
            CHECK(ip->decode_allocation_policy == NULL);
            CHECK(ip->metrics_addr == NULL);
            CHECK(ip->trace == NULL);
        }
        for (size_t j = known; j < psizes[i]; j++)
            CHECK_EQ_INT(s.b[j], 0);
    }
    for (size_t i = 0; i < sizeof(lsizes) / sizeof(lsizes[0]); i++) {
        memset(s.b, CANARY, sizeof(s.b));
        kvf_layout_init_sized((kvf_layout_t *)s.b, lsizes[i]);
        CHECK(canaries_intact(&s, lsizes[i]));
        if (lsizes[i] >= sizeof(size_t))
            CHECK_EQ_INT(stored_size(&s), lsizes[i]);
        for (size_t j = sizeof(size_t); j < lsizes[i]; j++)
            CHECK_EQ_INT(s.b[j], 0);
    }

    /* The exported functions, for callers built against 0.1.0: V0 bytes. */
    memset(s.b, CANARY, sizeof(s.b));
    (kvf_engine_params_init)((kvf_engine_params_t *)s.b);
    CHECK(canaries_intact(&s, pv0));
    CHECK_EQ_INT(stored_size(&s), pv0);
    memset(s.b, CANARY, sizeof(s.b));
    (kvf_layout_init)((kvf_layout_t *)s.b);
    CHECK(canaries_intact(&s, lv0));
    CHECK_EQ_INT(stored_size(&s), lv0);

    /* The macros pass this header's sizeof. */
    kvf_engine_params_t p;
    kvf_layout_t l;
    kvf_engine_params_init(&p);
    kvf_layout_init(&l);
    CHECK_EQ_INT(p.size, sizeof(p));
    CHECK_EQ_INT(l.size, sizeof(l));
}

/*
 * (b) A caller whose struct is exactly the first version's size.  What
 * follows it in memory is garbage (canaries) that the library must not
 * take for fields.
 */
static void test_v0_params_create(void)
{
    /* Fields added after 0.1.0 (handshake_timeout_ms) lie in the garbage:
     * the engine must take their defaults, not the canaries. */
    CHECK(KVF_ENGINE_PARAMS_SIZE_V0 <= offsetof(kvf_engine_params_t, handshake_timeout_ms));
    CHECK(KVF_ENGINE_PARAMS_SIZE_V0 <= offsetof(kvf_engine_params_t, auth_token));
    CHECK(KVF_ENGINE_PARAMS_SIZE_V0 <= offsetof(kvf_engine_params_t, cp_rank));
    scratch_t *g = malloc(sizeof(*g));
    kvf_engine_params_t *p = (kvf_engine_params_t *)g->b;

    memset(g, CANARY, sizeof(*g));
    kvf_engine_params_init_sized(p, KVF_ENGINE_PARAMS_SIZE_V0);
    decode_params(p);
    CHECK_EQ_INT(create_destroy(p), KVF_OK);

    memset(g, CANARY, sizeof(*g));
    (kvf_engine_params_init)(p);     /* what a 0.1.0 binary calls */
    decode_params(p);
    CHECK_EQ_INT(create_destroy(p), KVF_OK);
    free(g);
}

/* (c) A size below the first version is refused, by name and size. */
static void test_below_v0_refused(void)
{
    const size_t small = KVF_ENGINE_PARAMS_SIZE_V0 - sizeof(const char *);
    scratch_t s;
    kvf_engine_params_t *p = (kvf_engine_params_t *)s.b;

    memset(s.b, 0, sizeof(s.b));
    kvf_engine_params_init_sized(p, small);
    CHECK_STR_CONTAINS(kvf_last_error(), "kvf_engine_params_init_sized");
    CHECK_STR_CONTAINS(kvf_last_error(), zu(small));
    p->size = small;
    decode_params(p);
    CHECK_EQ_INT(create_destroy(p), KVF_ERR_INVALID_PARAM);
    CHECK_STR_CONTAINS(kvf_last_error(), "kvf_engine_create");
    CHECK_STR_CONTAINS(kvf_last_error(), "kvf_engine_params_t size");
    CHECK_STR_CONTAINS(kvf_last_error(), zu(small));
    CHECK_STR_CONTAINS(kvf_last_error(), zu(KVF_ENGINE_PARAMS_SIZE_V0));

    /* Never initialised: 0, or garbage far past any version. */
    p->size = 0;
    CHECK_EQ_INT(create_destroy(p), KVF_ERR_INVALID_PARAM);
    CHECK_STR_CONTAINS(kvf_last_error(), "kvf_engine_params_init()");
    p->size = (size_t)1 << 40;
    CHECK_EQ_INT(create_destroy(p), KVF_ERR_INVALID_PARAM);
    CHECK_STR_CONTAINS(kvf_last_error(), "far past");
    CHECK_EQ_INT(kvf_engine_create(NULL, &(kvf_engine_t *){NULL}), KVF_ERR_INVALID_PARAM);
}

/* (a) A newer header's larger struct: fine while its extra bytes are 0. */
static void test_larger_params(void)
{
    struct newer {
        kvf_engine_params_t p;
        uint32_t            extra[EXTRA / 4];
    } *n = malloc(sizeof(*n));
    memset(n, CANARY, sizeof(*n));
    kvf_engine_params_init_sized(&n->p, sizeof(*n));
    CHECK_EQ_INT(n->p.size, sizeof(*n));
    CHECK_EQ_INT(n->extra[EXTRA / 4 - 1], 0);
    decode_params(&n->p);
    CHECK_EQ_INT(create_destroy(&n->p), KVF_OK);

    n->extra[1] = 7;      /* a field this library does not have */
    CHECK_EQ_INT(create_destroy(&n->p), KVF_ERR_INVALID_PARAM);
    CHECK_STR_CONTAINS(kvf_last_error(), "kvf_engine_create");
    CHECK_STR_CONTAINS(kvf_last_error(), zu(sizeof(*n)));
    CHECK_STR_CONTAINS(kvf_last_error(), "nonzero");
    n->extra[1] = 0;
    CHECK_EQ_INT(create_destroy(&n->p), KVF_OK);
    free(n);
}

/* A real decode engine to register layouts on. */
static kvf_engine_t *decode_engine(void)
{
    kvf_engine_params_t p;
    kvf_engine_t *eng = NULL;
    kvf_engine_params_init(&p);
    decode_params(&p);
    CHECK_EQ_INT(kvf_engine_create(&p, &eng), KVF_OK);
    return eng;
}

/* Fill the V0 fields of a layout of any size >= V0. */
static void fill_layout(kvf_layout_t *l, kvf_buffer_t *kv)
{
    l->page_size = PAGE;
    l->kv_dtype = "bfloat16";
    l->num_layers = 1;
    l->heads_per_rank = l->total_heads = 1;
    l->bytes_per_head = HEAD_B;
    l->num_kv = 1;
    l->kv = kv;
}

/* (a), (b), (c) for kvf_layout_t, through kvf_engine_register_layout. */
static void test_layout_sizes(void)
{
    void *mem = calloc(PAGES, PAGE * HEAD_B);
    kvf_buffer_t kv = {mem, PAGES * PAGE * HEAD_B, PAGE * HEAD_B};
    kvf_engine_t *eng;

    /* Exactly V0 (shorter than sizeof(kvf_layout_t), by its padding), and
     * garbage after it that the library must not take for fields. */
    struct v0_then_garbage {
        kvf_layout_t  l;
        unsigned char after[EXTRA];
    } *g = malloc(sizeof(*g));
    kvf_layout_t *l0 = &g->l;
    memset(g, CANARY, sizeof(*g));
    kvf_layout_init_sized(l0, KVF_LAYOUT_SIZE_V0);
    CHECK(canaries_intact_at((unsigned char *)g, KVF_LAYOUT_SIZE_V0, sizeof(*g)));
    fill_layout(l0, &kv);
    if ((eng = decode_engine()) != NULL) {
        CHECK_EQ_INT(kvf_engine_register_layout(eng, l0), KVF_OK);
        kvf_engine_destroy(eng);
    }

    /* Below V0. */
    l0->size = KVF_LAYOUT_SIZE_V0 - 4;
    if ((eng = decode_engine()) != NULL) {
        CHECK_EQ_INT(kvf_engine_register_layout(eng, l0), KVF_ERR_INVALID_PARAM);
        CHECK_STR_CONTAINS(kvf_last_error(), "kvf_engine_register_layout");
        CHECK_STR_CONTAINS(kvf_last_error(), "kvf_layout_t size");
        CHECK_STR_CONTAINS(kvf_last_error(), zu(KVF_LAYOUT_SIZE_V0 - 4));
        CHECK_STR_CONTAINS(kvf_last_error(), "kvf_layout_init()");
        kvf_engine_destroy(eng);
    }

    /* A caller from before kv_order, the last field (its size ends at
     * cuda_device): the garbage where kv_order lies is not read, or it
     * would be refused as an unknown order.  The same bytes inside the
     * caller's size are read, and refused by name. */
    const size_t before_order = KVF_FIELD_END(kvf_layout_t, cuda_device);
    CHECK_EQ_INT(offsetof(kvf_layout_t, kv_order), before_order);
    CHECK_EQ_INT(KVF_FIELD_END(kvf_layout_t, kv_order), sizeof(kvf_layout_t));
    memset(g, CANARY, sizeof(*g));
    kvf_layout_init_sized(l0, before_order);
    CHECK(canaries_intact_at((unsigned char *)g, before_order, sizeof(*g)));
    fill_layout(l0, &kv);
    if ((eng = decode_engine()) != NULL) {
        CHECK_EQ_INT(kvf_engine_register_layout(eng, l0), KVF_OK);
        kvf_engine_destroy(eng);
    }
    l0->size = sizeof(kvf_layout_t);
    if ((eng = decode_engine()) != NULL) {
        CHECK_EQ_INT(kvf_engine_register_layout(eng, l0), KVF_ERR_INVALID_PARAM);
        CHECK_STR_CONTAINS(kvf_last_error(), "unknown kv_order");
        l0->kv_order = KVF_KV_HND;
        CHECK_EQ_INT(kvf_engine_register_layout(eng, l0), KVF_OK);
        kvf_engine_destroy(eng);
    }
    free(g);

    /* A newer header's larger layout. */
    struct newer {
        kvf_layout_t l;
        uint64_t     extra[EXTRA / 8];
    } *n = malloc(sizeof(*n));
    memset(n, CANARY, sizeof(*n));
    kvf_layout_init_sized(&n->l, sizeof(*n));
    fill_layout(&n->l, &kv);
    n->extra[2] = 1;
    if ((eng = decode_engine()) != NULL) {
        CHECK_EQ_INT(kvf_engine_register_layout(eng, &n->l), KVF_ERR_INVALID_PARAM);
        CHECK_STR_CONTAINS(kvf_last_error(), "nonzero");
        CHECK_STR_CONTAINS(kvf_last_error(), zu(sizeof(*n)));
        n->extra[2] = 0;
        CHECK_EQ_INT(kvf_engine_register_layout(eng, &n->l), KVF_OK);
        kvf_engine_destroy(eng);
    }
    free(n);
    free(mem);
}

/*
 * The structs of held rooms, kvf_hold_t and kvf_remote_t: init writes
 * exactly the caller's size, a size below the first version is refused by
 * name, and a newer header's larger struct is taken while its extra bytes
 * are 0.
 */
static void test_hold_remote_sizes(void)
{
    void *mem = calloc(PAGES, PAGE * HEAD_B);
    kvf_buffer_t kv = {mem, PAGES * PAGE * HEAD_B, PAGE * HEAD_B};
    kvf_engine_params_t p;
    kvf_engine_t *pre = NULL, *dec = decode_engine();
    kvf_layout_t l;
    kvf_sender_t *s = NULL;
    kvf_receiver_t *r = NULL;
    char desc[KVF_DESCRIPTOR_MAX];

    kvf_engine_params_init(&p);
    p.transport = "tcp";
    CHECK_EQ_INT(kvf_engine_create(&p, &pre), KVF_OK);
    kvf_layout_init(&l);
    fill_layout(&l, &kv);
    CHECK_EQ_INT(kvf_engine_register_layout(pre, &l), KVF_OK);
    CHECK_EQ_INT(kvf_engine_descriptor(pre, desc, sizeof(desc)), KVF_OK);
    if (dec != NULL)
        CHECK_EQ_INT(kvf_engine_register_layout(dec, &l), KVF_OK);

    struct hold_newer {
        kvf_hold_t    h;
        unsigned char extra[EXTRA];
    } *h = malloc(sizeof(*h));
    memset(h, CANARY, sizeof(*h));
    kvf_hold_init_sized(&h->h, KVF_HOLD_SIZE_V0);
    CHECK(canaries_intact_at((unsigned char *)h, KVF_HOLD_SIZE_V0, sizeof(*h)));
    CHECK_EQ_INT(kvf_sender_create_held(pre, 1, &h->h, &s), KVF_OK);
    kvf_sender_destroy(s);
    h->h.size = KVF_HOLD_SIZE_V0 - 4;
    CHECK_EQ_INT(kvf_sender_create_held(pre, 2, &h->h, &s), KVF_ERR_INVALID_PARAM);
    CHECK_STR_CONTAINS(kvf_last_error(), "kvf_hold_t size");
    kvf_hold_init_sized(&h->h, sizeof(*h));
    CHECK_EQ_INT(kvf_sender_create_held(pre, 3, &h->h, &s), KVF_OK);
    kvf_sender_destroy(s);
    h->extra[EXTRA - 1] = 1;
    CHECK_EQ_INT(kvf_sender_create_held(pre, 4, &h->h, &s), KVF_ERR_INVALID_PARAM);
    CHECK_STR_CONTAINS(kvf_last_error(), "nonzero");
    free(h);

    struct remote_newer {
        kvf_remote_t  rm;
        unsigned char extra[EXTRA];
    } *rm = malloc(sizeof(*rm));
    const char *descs[1] = {desc};
    memset(rm, CANARY, sizeof(*rm));
    kvf_remote_init_sized(&rm->rm, KVF_REMOTE_SIZE_V0);
    CHECK(canaries_intact_at((unsigned char *)rm, KVF_REMOTE_SIZE_V0, sizeof(*rm)));
    rm->rm.room = 5;
    rm->rm.descriptors = descs;
    rm->rm.num_descriptors = 1;
    if (dec != NULL) {
        CHECK_EQ_INT(kvf_receiver_create_remote(dec, &rm->rm, &r), KVF_OK);
        kvf_receiver_destroy(r);
        rm->rm.size = KVF_REMOTE_SIZE_V0 - 8;
        CHECK_EQ_INT(kvf_receiver_create_remote(dec, &rm->rm, &r), KVF_ERR_INVALID_PARAM);
        CHECK_STR_CONTAINS(kvf_last_error(), "kvf_remote_t size");
        rm->rm.size = sizeof(*rm);
        memset(rm->extra, 0, EXTRA);
        CHECK_EQ_INT(kvf_receiver_create_remote(dec, &rm->rm, &r), KVF_OK);
        kvf_receiver_destroy(r);
        rm->extra[0] = 1;
        CHECK_EQ_INT(kvf_receiver_create_remote(dec, &rm->rm, &r), KVF_ERR_INVALID_PARAM);
        CHECK_STR_CONTAINS(kvf_last_error(), "nonzero");
        kvf_engine_destroy(dec);
    }
    free(rm);
    kvf_engine_destroy(pre);
    free(mem);
}

/*
 * The records the library fills: kvf_engine_stats_t.  It writes exactly
 * the caller's size (at V0, none of the counters added since), writes 0
 * over a newer header's extra bytes, and refuses a size below the first
 * version, or garbage, by name, writing nothing.
 */
static void test_stats_sizes(void)
{
    struct {
        alignas(max_align_t) unsigned char b[sizeof(kvf_engine_stats_t) + 2 * EXTRA];
    } g;
    kvf_engine_stats_t *st = (kvf_engine_stats_t *)g.b;
    const size_t v0 = KVF_ENGINE_STATS_SIZE_V0, full = sizeof(kvf_engine_stats_t);
    const size_t head = sizeof(size_t);
    kvf_engine_t *eng = decode_engine();

    if (eng == NULL)
        return;
    CHECK(v0 < KVF_FIELD_END(kvf_engine_stats_t, auth_refused));
    /* V0: the counters, over what the caller's struct held before (a
     * fresh engine's are all 0), and not a byte after them. */
    memset(g.b, CANARY, sizeof(g.b));
    kvf_engine_stats_init_sized(st, v0);
    CHECK_EQ_INT(st->size, v0);
    CHECK(canaries_intact_at(g.b, v0, sizeof(g.b)));
    memset(g.b + head, CANARY, v0 - head);
    CHECK_EQ_INT(kvf_engine_stats(eng, st), KVF_OK);
    CHECK_EQ_INT(st->size, v0);
    CHECK(all_zero(g.b + head, v0 - head));
    CHECK(canaries_intact_at(g.b, v0, sizeof(g.b)));

    /* A newer header's larger struct: every byte of it written. */
    memset(g.b, CANARY, sizeof(g.b));
    st->size = full + EXTRA;
    CHECK_EQ_INT(kvf_engine_stats(eng, st), KVF_OK);
    CHECK_EQ_INT(st->size, full + EXTRA);
    CHECK(all_zero(g.b + head, full + EXTRA - head));
    CHECK(canaries_intact_at(g.b, full + EXTRA, sizeof(g.b)));

    /* Below V0, never initialised, or NULL: refused, nothing written. */
    memset(g.b, CANARY, sizeof(g.b));
    st->size = v0 - 8;
    CHECK_EQ_INT(kvf_engine_stats(eng, st), KVF_ERR_INVALID_PARAM);
    CHECK_STR_CONTAINS(kvf_last_error(), "kvf_engine_stats: kvf_engine_stats_t size");
    CHECK_STR_CONTAINS(kvf_last_error(), zu(v0 - 8));
    CHECK_STR_CONTAINS(kvf_last_error(), "kvf_engine_stats_init()");
    CHECK(canaries_intact_at(g.b, head, sizeof(g.b)));
    st->size = (size_t)1 << 40;
    CHECK_EQ_INT(kvf_engine_stats(eng, st), KVF_ERR_INVALID_PARAM);
    CHECK_STR_CONTAINS(kvf_last_error(), "far past");
    CHECK(canaries_intact_at(g.b, head, sizeof(g.b)));
    CHECK_EQ_INT(kvf_engine_stats(eng, NULL), KVF_ERR_INVALID_PARAM);
    CHECK_EQ_INT(kvf_engine_stats(NULL, st), KVF_ERR_INVALID_PARAM);
    kvf_engine_stats_init_sized(st, v0 - 8);
    CHECK_STR_CONTAINS(kvf_last_error(), "kvf_engine_stats_init_sized: size");
    kvf_engine_destroy(eng);
}

/* A held room on prefill engine `pre` failed by the application with
 * KVF_ERR_TIMED_OUT, "the application's cause". */
static kvf_sender_t *failed_sender(kvf_engine_t *pre, uint64_t room)
{
    kvf_hold_t h;
    kvf_sender_t *s = NULL;
    kvf_hold_init(&h);
    CHECK_EQ_INT(kvf_sender_create_held(pre, room, &h, &s), KVF_OK);
    CHECK_EQ_INT(kvf_sender_fail(s, KVF_ERR_TIMED_OUT, "the application's cause"), KVF_OK);
    CHECK_EQ_INT(kvf_sender_poll(s), KVF_POLL_FAILED);
    return s;
}

/*
 * kvf_failure_t, through kvf_sender_failure: as kvf_engine_stats_t, and a
 * record refused for its size is not consumed.
 */
static void test_failure_sizes(void)
{
    void *mem = calloc(PAGES, PAGE * HEAD_B);
    kvf_buffer_t kv = {mem, PAGES * PAGE * HEAD_B, PAGE * HEAD_B};
    struct {
        alignas(max_align_t) unsigned char b[sizeof(kvf_failure_t) + 2 * EXTRA];
    } g;
    kvf_failure_t *f = (kvf_failure_t *)g.b;
    const size_t v0 = KVF_FAILURE_SIZE_V0, full = sizeof(kvf_failure_t);
    const size_t known = KVF_FIELD_END(kvf_failure_t, reason), head = sizeof(size_t);
    kvf_engine_params_t p;
    kvf_engine_t *pre = NULL;
    kvf_layout_t l;

    kvf_engine_params_init(&p);
    p.transport = "tcp";
    CHECK_EQ_INT(kvf_engine_create(&p, &pre), KVF_OK);
    kvf_layout_init(&l);
    fill_layout(&l, &kv);
    CHECK_EQ_INT(kvf_engine_register_layout(pre, &l), KVF_OK);
    kvf_sender_t *s = failed_sender(pre, 1);

    /* Below V0, or NULL: refused by name, nothing written, the record kept. */
    memset(g.b, CANARY, sizeof(g.b));
    f->size = v0 - 4;
    CHECK_EQ_INT(kvf_sender_failure(s, f), KVF_ERR_INVALID_PARAM);
    CHECK_STR_CONTAINS(kvf_last_error(), "kvf_sender_failure: kvf_failure_t size");
    CHECK_STR_CONTAINS(kvf_last_error(), zu(v0 - 4));
    CHECK_STR_CONTAINS(kvf_last_error(), "kvf_failure_init()");
    CHECK(canaries_intact_at(g.b, head, sizeof(g.b)));
    CHECK_EQ_INT(kvf_sender_failure(s, NULL), KVF_ERR_INVALID_PARAM);

    /* Exactly V0: the record, and not a byte after it. */
    memset(g.b, CANARY, sizeof(g.b));
    kvf_failure_init_sized(f, v0);
    CHECK_EQ_INT(f->size, v0);
    CHECK(canaries_intact_at(g.b, v0, sizeof(g.b)));
    CHECK_EQ_INT(kvf_sender_failure(s, f), KVF_OK);
    CHECK_EQ_INT(f->size, v0);
    CHECK_EQ_INT(f->status, KVF_ERR_TIMED_OUT);
    CHECK_STR_CONTAINS(f->reason, "the application's cause");
    CHECK(canaries_intact_at(g.b, v0, sizeof(g.b)));
    CHECK_EQ_INT(kvf_sender_failure(s, f), KVF_ERR_NOT_FOUND);    /* consumed, once */
    kvf_sender_destroy(s);

    /* A newer header's larger record: its extra bytes written 0, nothing
     * past its size. */
    s = failed_sender(pre, 2);
    memset(g.b, CANARY, sizeof(g.b));
    f->size = full + EXTRA;
    CHECK_EQ_INT(kvf_sender_failure(s, f), KVF_OK);
    CHECK_EQ_INT(f->size, full + EXTRA);
    CHECK_EQ_INT(f->status, KVF_ERR_TIMED_OUT);
    CHECK(all_zero(g.b + known, full + EXTRA - known));
    CHECK(canaries_intact_at(g.b, full + EXTRA, sizeof(g.b)));
    kvf_sender_destroy(s);
    kvf_failure_init_sized(f, v0 - 4);
    CHECK_STR_CONTAINS(kvf_last_error(), "kvf_failure_init_sized: size");
    kvf_engine_destroy(pre);
    free(mem);
}

/* Payload paths by a fixed index: the names the `transport` parameter
 * takes, each one this build has accepted, the others refused as not
 * built, and no name past the last. */
static void test_transport_names(void)
{
    static const char *const want[] = {"tcp", "cuda", "shm", "ucx"};
    const unsigned n = sizeof(want) / sizeof(want[0]);

    for (unsigned i = 0; i < n; i++) {
        const char *name = kvf_transport_name(i);
        CHECK(name != NULL && strcmp(name, want[i]) == 0);
        if (name == NULL)
            continue;
        kvf_engine_params_t p;
        kvf_engine_params_init(&p);
        decode_params(&p);
        p.transport = name;
        CHECK_EQ_INT(create_destroy(&p),
                     strstr(kvf_transports(), name) != NULL ? KVF_OK : KVF_ERR_UNSUPPORTED);
    }
    CHECK(n <= KVF_PATHS_MAX);
    for (unsigned i = n; i <= KVF_PATHS_MAX; i++)
        CHECK(kvf_transport_name(i) == NULL);
    CHECK(kvf_transport_name(UINT_MAX) == NULL);
}

KVF_TEST_MAIN(KVF_CASE(test_init_writes_only_size), KVF_CASE(test_v0_params_create),
              KVF_CASE(test_below_v0_refused), KVF_CASE(test_larger_params),
              KVF_CASE(test_layout_sizes), KVF_CASE(test_hold_remote_sizes),
              KVF_CASE(test_stats_sizes), KVF_CASE(test_failure_sizes),
              KVF_CASE(test_transport_names))
