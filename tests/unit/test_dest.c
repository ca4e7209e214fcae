/*
 * What SGLang's scheduler needs of rooms, between real engines over
 * loopback TCP: a receiver that is WAITING_FOR_INPUT before it has pages
 * and then takes its whole destination in one call (kvf_receiver_set_dest),
 * the decode's cached prefix told to the sender, rooms of no pages, typed
 * state groups, KV buffers matched by tag (any order, a draft model's
 * group, a pipeline stage's layers), decode layouts that leave the heads
 * to the prefill, and the per-room metric.  Every byte is checked.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kvferry/kvferry.h"
#include "unit/kvf_sides.h"

#define MAXBUF 16

typedef struct dest_side {
    kvf_engine_t *eng;
    uint8_t      *kv[MAXBUF];
    size_t        kv_page[MAXBUF];     /* bytes per page */
    uint8_t      *aux;
    uint8_t      *st[MAXBUF];
    size_t        st_item[MAXBUF];
    int           nkv, nst;
} dest_side_t;

/* The registry of the last prefill engine that hosts one. */
static char bs_addr[64];

static void tune(kvf_engine_params_t *p)
{
    p->checksum = 1;
}

/* The harness's engine (side_try), with checksums and the library's
 * transfer deadline, at TP rank tp_rank of tp_size and pipeline stage
 * pp_rank of pp_size; one that hosts the registry (bs "127.0.0.1:0")
 * records its address in bs_addr.  Its layout is the test's own: the
 * shapes registered here are what this file checks. */
static kvf_engine_t *engine(kvf_role_t role, int tp_rank, int tp_size, int pp_rank,
                            int pp_size, const char *bs)
{
    side_t e;
    side_rank = (side_rank_t){.tp = tp_rank, .tp_size = tp_size, .pp = pp_rank,
                              .pp_size = pp_size};
    side_transfer_ms = 0;
    side_tune = tune;
    CHECK_EQ_INT(side_try(&e, role, bs, NULL, NULL), KVF_OK);
    side_rank = (side_rank_t){0};
    if (bs != NULL && strcmp(bs, "127.0.0.1:0") == 0)
        CHECK_EQ_INT(kvf_engine_bootstrap_addr(e.eng, bs_addr, sizeof(bs_addr)), KVF_OK);
    return e.eng;
}

/* Byte i of prefill KV buffer b: distinct per buffer and position. */
static uint8_t pat(int b, size_t i)
{
    return (uint8_t)(i * 7 + (size_t)b * 31 + 1);
}

/* Add a KV buffer of `page_b` bytes per page; a prefill side fills it. */
static kvf_buffer_t kv_buf(dest_side_t *s, size_t page_b, int fill)
{
    int b = s->nkv++;
    s->kv[b] = calloc(PAGES, page_b);
    s->kv_page[b] = page_b;
    for (size_t i = 0; fill && i < PAGES * page_b; i++)
        s->kv[b][i] = pat(b, i);
    return (kvf_buffer_t){s->kv[b], PAGES * page_b, page_b};
}

static kvf_buffer_t st_buf(dest_side_t *s, size_t item, int fill)
{
    int b = s->nst++;
    s->st[b] = calloc(PAGES, item);
    s->st_item[b] = item;
    for (size_t i = 0; fill && i < PAGES * item; i++)
        s->st[b][i] = pat(100 + b, i);
    return (kvf_buffer_t){s->st[b], PAGES * item, item};
}

static kvf_buffer_t aux_buf(dest_side_t *s, int fill)
{
    s->aux = calloc(SLOTS, AUX_B);
    for (size_t i = 0; fill && i < SLOTS * AUX_B; i++)
        s->aux[i] = pat(200, i);
    return (kvf_buffer_t){s->aux, SLOTS * AUX_B, AUX_B};
}

static void side_free(dest_side_t *s)
{
    kvf_engine_destroy(s->eng);
    for (int i = 0; i < s->nkv; i++)
        free(s->kv[i]);
    for (int i = 0; i < s->nst; i++)
        free(s->st[i]);
    free(s->aux);
    memset(s, 0, sizeof(*s));
}

/* An MHA layout of `heads` heads per rank of `total`, every KV buffer
 * HEAD_B per head, one aux buffer; the caller adds the rest. */
static kvf_layout_t mha(uint32_t layers, uint32_t heads, uint32_t total)
{
    kvf_layout_t l;
    kvf_layout_init(&l);
    l.page_size = PAGE;
    l.kv_dtype = "bfloat16";
    l.num_layers = layers;
    l.heads_per_rank = heads;
    l.total_heads = total;
    l.bytes_per_head = heads ? HEAD_B : 0;
    return l;
}

/* Register a plain layout: `layers` layers of K and V, interleaved (the
 * 0.1.0 order), one aux buffer and one plain state buffer of 8 bytes. */
static void plain_side(dest_side_t *s, kvf_role_t role, const char *bs, int fill)
{
    kvf_buffer_t kv[4], aux, st;
    s->eng = engine(role, 0, 1, 0, 1, bs);
    for (int i = 0; i < 4; i++)
        kv[i] = kv_buf(s, PAGE * 2 * HEAD_B, fill);
    aux = aux_buf(s, fill);
    st = st_buf(s, 8, fill);
    kvf_layout_t l = mha(2, 2, 2);
    l.num_kv = 4;
    l.kv = kv;
    l.num_aux = 1;
    l.aux = &aux;
    l.num_state = 1;
    l.state = &st;
    CHECK_EQ_INT(kvf_engine_register_layout(s->eng, &l), KVF_OK);
}

static void test_waiting_before_pages_and_prefix(void)
{
    dest_side_t pre = {0}, dec = {0};
    plain_side(&pre, KVF_ROLE_PREFILL, "127.0.0.1:0", 1);
    plain_side(&dec, KVF_ROLE_DECODE, NULL, 0);

    kvf_sender_t *s;
    kvf_receiver_t *r;
    uint32_t tokens = 99;
    CHECK_EQ_INT(kvf_sender_create(pre.eng, bs_addr, 7, &s), KVF_OK);
    CHECK_EQ_INT(kvf_receiver_create(dec.eng, bs_addr, 7, -1, &r), KVF_OK);
    /* Resolved and connected, no pages yet: SGLang allocates only now. */
    CHECK_EQ_INT(wait_receiver(r, KVF_POLL_WAITING_FOR_INPUT), KVF_POLL_WAITING_FOR_INPUT);
    CHECK_EQ_INT(kvf_sender_poll(s), KVF_POLL_BOOTSTRAPPING);
    CHECK_EQ_INT(kvf_sender_decode_prefix_len(s, &tokens), KVF_ERR_AGAIN);
    CHECK_EQ_INT(tokens, 99);

    uint32_t dst[3] = {9, 3, 30}, src[3] = {1, 2, 20}, st_dst = 4, st_src = 6;
    kvf_indices_t st = {&st_dst, 1};
    kvf_dest_t d;
    kvf_dest_init(&d);
    d.pages = dst;
    d.num_pages = 3;
    d.aux_slot = 2;
    d.states = &st;
    d.num_states = 1;
    d.decode_prefix_len = 8;
    kvf_dest_t small = d;
    small.size = 4;
    CHECK_EQ_INT(kvf_receiver_set_dest(r, &small), KVF_ERR_INVALID_PARAM);
    CHECK_EQ_INT(kvf_receiver_set_dest(r, &d), KVF_OK);
    CHECK_EQ_INT(kvf_receiver_set_dest(r, &d), KVF_ERR_STATE);
    CHECK_EQ_INT(wait_sender(s, KVF_POLL_WAITING_FOR_INPUT), KVF_POLL_WAITING_FOR_INPUT);
    CHECK_EQ_INT(kvf_sender_decode_prefix_len(s, &tokens), KVF_OK);
    CHECK_EQ_INT(tokens, 8);
    CHECK_EQ_INT(kvf_receiver_poll(r), KVF_POLL_WAITING_FOR_INPUT);

    CHECK_EQ_INT(kvf_sender_init(s, 3, 5), KVF_OK);
    CHECK_EQ_INT(kvf_sender_set_state(s, &st_src, 1), KVF_OK);
    CHECK_EQ_INT(kvf_sender_send(s, src, 3, 1), KVF_OK);
    wait_all_final(&s, 1, &r, 1);
    CHECK_EQ_INT(kvf_sender_poll(s), KVF_POLL_SUCCESS);
    CHECK_EQ_INT(kvf_receiver_poll(r), KVF_POLL_SUCCESS);
    size_t pb = pre.kv_page[0];
    for (int b = 0; b < 4; b++)
        for (int i = 0; i < 3; i++)
            CHECK(memcmp(dec.kv[b] + dst[i] * pb, pre.kv[b] + src[i] * pb, pb) == 0);
    CHECK(memcmp(dec.aux + 2 * AUX_B, pre.aux + 5 * AUX_B, AUX_B) == 0);
    CHECK(memcmp(dec.st[0] + 4 * 8, pre.st[0] + 6 * 8, 8) == 0);

    uint64_t want = 3 * 4 * pb + AUX_B + 8;
    kvf_room_metric_t m = {.size = sizeof(m)};
    CHECK_EQ_INT(kvf_sender_metric(s, &m), KVF_OK);
    CHECK(m.bytes == want && m.alloc_s >= 0 && m.transfer_s >= 0);
    memset(&m, 0, sizeof(m));
    m.size = sizeof(m);
    CHECK_EQ_INT(kvf_receiver_metric(r, &m), KVF_OK);
    CHECK(m.bytes == want);
    m.size = 8;
    CHECK_EQ_INT(kvf_receiver_metric(r, &m), KVF_ERR_INVALID_PARAM);
    kvf_sender_destroy(s);
    kvf_receiver_destroy(r);
    side_free(&dec);
    side_free(&pre);
}

/* A full prefix hit: no pages, aux and state only. */
static void test_zero_page_room(void)
{
    dest_side_t pre = {0}, dec = {0};
    plain_side(&pre, KVF_ROLE_PREFILL, "127.0.0.1:0", 1);
    plain_side(&dec, KVF_ROLE_DECODE, NULL, 0);

    kvf_sender_t *s;
    kvf_receiver_t *r;
    uint32_t st_dst = 3, st_src = 7;
    CHECK_EQ_INT(kvf_sender_create(pre.eng, bs_addr, 11, &s), KVF_OK);
    CHECK_EQ_INT(kvf_receiver_create(dec.eng, bs_addr, 11, -1, &r), KVF_OK);
    CHECK_EQ_INT(kvf_receiver_init(r, NULL, 0, 1, &st_dst, 1), KVF_OK);
    CHECK_EQ_INT(wait_sender(s, KVF_POLL_WAITING_FOR_INPUT), KVF_POLL_WAITING_FOR_INPUT);
    CHECK_EQ_INT(kvf_sender_init(s, 0, 4), KVF_OK);
    CHECK_EQ_INT(kvf_sender_set_state(s, &st_src, 1), KVF_OK);
    CHECK_EQ_INT(kvf_sender_send(s, NULL, 0, 0), KVF_ERR_INVALID_PARAM);
    CHECK_EQ_INT(kvf_sender_send(s, NULL, 0, 1), KVF_OK);
    wait_all_final(&s, 1, &r, 1);
    CHECK_EQ_INT(kvf_sender_poll(s), KVF_POLL_SUCCESS);
    CHECK_EQ_INT(kvf_receiver_poll(r), KVF_POLL_SUCCESS);
    CHECK(memcmp(dec.aux + 1 * AUX_B, pre.aux + 4 * AUX_B, AUX_B) == 0);
    CHECK(memcmp(dec.st[0] + 3 * 8, pre.st[0] + 7 * 8, 8) == 0);
    int untouched = 1;
    for (int b = 0; b < 4; b++)
        for (size_t i = 0; i < PAGES * dec.kv_page[b]; i++)
            untouched &= dec.kv[b][i] == 0;
    CHECK(untouched);
    kvf_sender_destroy(s);
    kvf_receiver_destroy(r);
    side_free(&dec);
    side_free(&pre);
}

/* Nothing to move at all (no pages, no aux buffers, no state): both
 * sides count the link done; no DONE is owed, none is awaited. */
static void test_room_that_owes_nothing(void)
{
    dest_side_t pre = {0}, dec = {0};
    kvf_buffer_t kv[2];
    dest_side_t *sides[2] = {&pre, &dec};
    for (int k = 0; k < 2; k++) {
        sides[k]->eng = engine(k ? KVF_ROLE_DECODE : KVF_ROLE_PREFILL, 0, 1, 0, 1,
                               k ? NULL : "127.0.0.1:0");
        kv[0] = kv_buf(sides[k], PAGE * 2 * HEAD_B, !k);
        kv[1] = kv_buf(sides[k], PAGE * 2 * HEAD_B, !k);
        kvf_layout_t l = mha(1, 2, 2);
        l.num_kv = 2;
        l.kv = kv;
        CHECK_EQ_INT(kvf_engine_register_layout(sides[k]->eng, &l), KVF_OK);
    }
    kvf_sender_t *s;
    kvf_receiver_t *r;
    CHECK_EQ_INT(kvf_sender_create(pre.eng, bs_addr, 70, &s), KVF_OK);
    CHECK_EQ_INT(kvf_receiver_create(dec.eng, bs_addr, 70, -1, &r), KVF_OK);
    CHECK_EQ_INT(kvf_receiver_init(r, NULL, 0, 0, NULL, 0), KVF_OK);
    CHECK_EQ_INT(wait_receiver(r, KVF_POLL_SUCCESS), KVF_POLL_SUCCESS);
    CHECK_EQ_INT(wait_sender(s, KVF_POLL_WAITING_FOR_INPUT), KVF_POLL_WAITING_FOR_INPUT);
    CHECK_EQ_INT(kvf_sender_init(s, 0, 0), KVF_OK);
    CHECK_EQ_INT(kvf_sender_send(s, NULL, 0, 1), KVF_OK);
    CHECK_EQ_INT(wait_sender(s, KVF_POLL_SUCCESS), KVF_POLL_SUCCESS);
    kvf_sender_destroy(s);
    kvf_receiver_destroy(r);
    side_free(&dec);
    side_free(&pre);
}

/* Two typed groups: "mamba" (two buffers, one slot) and "swa" (one
 * buffer, a list of pages). */
static void typed_side(dest_side_t *s, kvf_role_t role, const char *bs, int fill,
                       const char *t0, const char *t1)
{
    kvf_buffer_t kv[2], aux, mamba[2], swa;
    s->eng = engine(role, 0, 1, 0, 1, bs);
    for (int i = 0; i < 2; i++)
        kv[i] = kv_buf(s, PAGE * 2 * HEAD_B, fill);
    aux = aux_buf(s, fill);
    mamba[0] = st_buf(s, 24, fill);
    mamba[1] = st_buf(s, 40, fill);
    swa = st_buf(s, 64, fill);
    kvf_state_group_t g[2] = {{t0, 2, mamba}, {t1, 1, &swa}};
    if (strcmp(t0, "swa") == 0) {      /* the same pools, the other way round */
        g[0] = (kvf_state_group_t){t0, 1, &swa};
        g[1] = (kvf_state_group_t){t1, 2, mamba};
    }
    kvf_layout_t l = mha(1, 2, 2);
    l.num_kv = 2;
    l.kv = kv;
    l.num_aux = 1;
    l.aux = &aux;
    l.num_state_groups = 2;
    l.state_groups = g;
    CHECK_EQ_INT(kvf_engine_register_layout(s->eng, &l), KVF_OK);
}

static void test_typed_state_groups(void)
{
    dest_side_t pre = {0}, dec = {0};
    typed_side(&pre, KVF_ROLE_PREFILL, "127.0.0.1:0", 1, "mamba", "swa");
    typed_side(&dec, KVF_ROLE_DECODE, NULL, 0, "mamba", "swa");

    uint32_t page_d = 5, page_s = 6;
    uint32_t m_d = 3, m_s = 1, w_d[4] = {10, 11, 12, 20}, w_s[4] = {1, 2, 3, 9};
    kvf_indices_t sd[2] = {{&m_d, 1}, {w_d, 4}}, ss[2] = {{&m_s, 1}, {w_s, 4}};
    kvf_sender_t *s;
    kvf_receiver_t *r;
    kvf_dest_t d;
    kvf_dest_init(&d);
    d.pages = &page_d;
    d.num_pages = 1;
    d.states = sd;
    d.num_states = 2;

    /* A state index twice is refused before anything is sent. */
    uint32_t dup[2] = {4, 4};
    kvf_indices_t sdup[2] = {{&m_d, 1}, {dup, 2}};
    CHECK_EQ_INT(kvf_receiver_create(dec.eng, bs_addr, 20, -1, &r), KVF_OK);
    kvf_dest_t bad = d;
    bad.states = sdup;
    CHECK_EQ_INT(kvf_receiver_set_dest(r, &bad), KVF_ERR_INVALID_PARAM);
    uint32_t far = PAGES;
    kvf_indices_t sfar[2] = {{&far, 1}, {w_d, 4}};
    bad.states = sfar;
    CHECK_EQ_INT(kvf_receiver_set_dest(r, &bad), KVF_ERR_OUT_OF_RANGE);

    CHECK_EQ_INT(kvf_sender_create(pre.eng, bs_addr, 20, &s), KVF_OK);
    CHECK_EQ_INT(kvf_receiver_set_dest(r, &d), KVF_OK);
    CHECK_EQ_INT(wait_sender(s, KVF_POLL_WAITING_FOR_INPUT), KVF_POLL_WAITING_FOR_INPUT);
    CHECK_EQ_INT(kvf_sender_init(s, 1, 0), KVF_OK);
    CHECK_EQ_INT(kvf_sender_set_states(s, ss, 1), KVF_ERR_INVALID_PARAM);
    CHECK_EQ_INT(kvf_sender_set_states(s, ss, 2), KVF_OK);
    CHECK_EQ_INT(kvf_sender_set_states(s, ss, 2), KVF_ERR_STATE);
    CHECK_EQ_INT(kvf_sender_send(s, &page_s, 1, 1), KVF_OK);
    wait_all_final(&s, 1, &r, 1);
    CHECK_EQ_INT(kvf_sender_poll(s), KVF_POLL_SUCCESS);
    CHECK_EQ_INT(kvf_receiver_poll(r), KVF_POLL_SUCCESS);
    for (int b = 0; b < 2; b++)   /* mamba: slot 1 -> 3 in both buffers */
        CHECK(memcmp(dec.st[b] + m_d * dec.st_item[b], pre.st[b] + m_s * pre.st_item[b],
                     pre.st_item[b]) == 0);
    for (int k = 0; k < 4; k++)   /* swa: each page to its own */
        CHECK(memcmp(dec.st[2] + w_d[k] * 64, pre.st[2] + w_s[k] * 64, 64) == 0);
    CHECK_EQ_INT(dec.st[2][13 * 64], 0);
    CHECK(memcmp(dec.kv[1] + page_d * dec.kv_page[1], pre.kv[1] + page_s * pre.kv_page[1],
                 pre.kv_page[1]) == 0);
    kvf_sender_destroy(s);
    kvf_receiver_destroy(r);

    /* The prefill gives 3 sliding-window pages, the decode wants 4: no
     * partial state; both sides fail with the reason. */
    kvf_failure_t fs, fr;
    kvf_failure_init(&fs);
    kvf_failure_init(&fr);
    CHECK_EQ_INT(kvf_sender_create(pre.eng, bs_addr, 21, &s), KVF_OK);
    CHECK_EQ_INT(kvf_receiver_create(dec.eng, bs_addr, 21, -1, &r), KVF_OK);
    CHECK_EQ_INT(kvf_receiver_set_dest(r, &d), KVF_OK);
    CHECK_EQ_INT(wait_sender(s, KVF_POLL_WAITING_FOR_INPUT), KVF_POLL_WAITING_FOR_INPUT);
    CHECK_EQ_INT(kvf_sender_init(s, 1, 0), KVF_OK);
    ss[1].n = 3;
    CHECK_EQ_INT(kvf_sender_set_states(s, ss, 2), KVF_OK);
    CHECK_EQ_INT(kvf_sender_send(s, &page_s, 1, 1), KVF_OK);
    wait_all_final(&s, 1, &r, 1);
    check_failed_with(kvf_sender_poll(s), kvf_sender_failure(s, &fs), KVF_ERR_BAD_INDICES,
                      &fs, "state group 1 (swa): the prefill gave 3 indices");
    check_failed_with(kvf_receiver_poll(r), kvf_receiver_failure(r, &fr), KVF_ERR_BAD_INDICES,
                      &fr, "state group 1 (swa): the prefill gave 3 indices");
    CHECK_EQ_INT(fr.from_another_rank, 1);
    kvf_sender_destroy(s);
    kvf_receiver_destroy(r);
    side_free(&dec);

    /* A decode with the same pools in another order is another model. */
    typed_side(&dec, KVF_ROLE_DECODE, NULL, 0, "swa", "mamba");
    CHECK_EQ_INT(kvf_receiver_create(dec.eng, bs_addr, 22, -1, &r), KVF_OK);
    check_recv_failed(r, KVF_ERR_INCOMPATIBLE,
                      "State type mismatch: prefill server registered state "
                      "[mamba,swa]", NULL);
    kvf_receiver_destroy(r);
    side_free(&dec);
    side_free(&pre);
}

/*
 * KV buffers by tag: the prefill registers SGLang's order (K of every
 * layer, then V of every layer) and a draft model's K and V with a head
 * half as large; the decode registers the model interleaved and the
 * draft's V before its K.  Each decode buffer must get its own.
 */
static void tagged_side(dest_side_t *s, kvf_role_t role, const char *bs, int fill,
                        const kvf_kv_tag_t *tags, int ntags)
{
    kvf_buffer_t kv[MAXBUF], aux;
    s->eng = engine(role, 0, 1, 0, 1, bs);
    for (int i = 0; i < ntags; i++)
        kv[i] = kv_buf(s, PAGE * 2 * (tags[i].group ? HEAD_B / 2 : HEAD_B), fill);
    aux = aux_buf(s, fill);
    kvf_layout_t l = mha(2, 2, 2);
    l.num_kv = (uint32_t)ntags;
    l.kv = kv;
    l.kv_tags = tags;
    l.num_aux = 1;
    l.aux = &aux;
    CHECK_EQ_INT(kvf_engine_register_layout(s->eng, &l), KVF_OK);
}

static int same_tag(const kvf_kv_tag_t *a, const kvf_kv_tag_t *b)
{
    return a->layer == b->layer && a->role == b->role && a->group == b->group;
}

static void test_tagged_buffers_and_draft(void)
{
    static const kvf_kv_tag_t ptags[6] = {
        {0, KVF_KV_K, 0}, {1, KVF_KV_K, 0}, {0, KVF_KV_V, 0}, {1, KVF_KV_V, 0},
        {0, KVF_KV_K, 1}, {0, KVF_KV_V, 1}};
    static const kvf_kv_tag_t dtags[6] = {
        {0, KVF_KV_K, 0}, {0, KVF_KV_V, 0}, {1, KVF_KV_K, 0}, {1, KVF_KV_V, 0},
        {0, KVF_KV_V, 1}, {0, KVF_KV_K, 1}};
    dest_side_t pre = {0}, dec = {0};
    tagged_side(&pre, KVF_ROLE_PREFILL, "127.0.0.1:0", 1, ptags, 6);
    tagged_side(&dec, KVF_ROLE_DECODE, NULL, 0, dtags, 6);

    uint32_t src[2] = {3, 4}, dst[2] = {17, 2};
    kvf_sender_t *s;
    kvf_receiver_t *r;
    CHECK_EQ_INT(kvf_sender_create(pre.eng, bs_addr, 30, &s), KVF_OK);
    CHECK_EQ_INT(kvf_receiver_create(dec.eng, bs_addr, 30, -1, &r), KVF_OK);
    CHECK_EQ_INT(kvf_receiver_init(r, dst, 2, 0, NULL, 0), KVF_OK);
    CHECK_EQ_INT(wait_sender(s, KVF_POLL_WAITING_FOR_INPUT), KVF_POLL_WAITING_FOR_INPUT);
    CHECK_EQ_INT(kvf_sender_init(s, 2, 0), KVF_OK);
    CHECK_EQ_INT(kvf_sender_send(s, src, 2, 1), KVF_OK);
    wait_all_final(&s, 1, &r, 1);
    CHECK_EQ_INT(kvf_receiver_poll(r), KVF_POLL_SUCCESS);
    for (int j = 0; j < 6; j++) {
        int i = 0;
        while (!same_tag(&ptags[i], &dtags[j]))
            i++;
        size_t pb = pre.kv_page[i];
        CHECK_EQ_INT(dec.kv_page[j], pb);
        for (int k = 0; k < 2; k++)
            CHECK(memcmp(dec.kv[j] + dst[k] * pb, pre.kv[i] + src[k] * pb, pb) == 0);
    }
    kvf_sender_destroy(s);
    kvf_receiver_destroy(r);
    side_free(&dec);

    /* A decode without the draft model cannot take this prefill's KV. */
    tagged_side(&dec, KVF_ROLE_DECODE, NULL, 0, dtags, 4);
    CHECK_EQ_INT(kvf_receiver_create(dec.eng, bs_addr, 31, -1, &r), KVF_OK);
    check_recv_failed(r, KVF_ERR_INCOMPATIBLE,
                      "prefill KV buffer 4 holds layer 0 K of group 1, which no "
                      "decode KV buffer holds", NULL);
    kvf_receiver_destroy(r);
    side_free(&dec);
    side_free(&pre);

    /* Nor can a decode with a draft model take a prefill's without one:
     * its draft pages would never be written. */
    tagged_side(&pre, KVF_ROLE_PREFILL, "127.0.0.1:0", 1, ptags, 4);
    tagged_side(&dec, KVF_ROLE_DECODE, NULL, 0, dtags, 6);
    CHECK_EQ_INT(kvf_receiver_create(dec.eng, bs_addr, 32, -1, &r), KVF_OK);
    check_recv_failed(r, KVF_ERR_INCOMPATIBLE,
                      "decode KV buffer 4 holds layer 0 V of group 1, which no "
                      "prefill KV buffer holds", NULL);
    kvf_receiver_destroy(r);
    side_free(&dec);
    side_free(&pre);

    /* Two buffers with one tag are refused at registration. */
    static const kvf_kv_tag_t twice[4] = {
        {0, KVF_KV_K, 0}, {1, KVF_KV_K, 0}, {0, KVF_KV_V, 0}, {1, KVF_KV_K, 0}};
    kvf_buffer_t kv[4];
    dest_side_t x = {0};
    x.eng = engine(KVF_ROLE_DECODE, 0, 1, 0, 1, NULL);
    for (int i = 0; i < 4; i++)
        kv[i] = kv_buf(&x, PAGE * 2 * HEAD_B, 0);
    kvf_layout_t l = mha(2, 2, 2);
    l.num_kv = 4;
    l.kv = kv;
    l.kv_tags = twice;
    CHECK_EQ_INT(kvf_engine_register_layout(x.eng, &l), KVF_ERR_INVALID_PARAM);
    CHECK_STR_CONTAINS(kvf_last_error(), "KV buffers 1 and 3 have the same tag (layer 1 K)");
    side_free(&x);
}

/*
 * A pipeline of two prefill stages (layers 0-1 and 2-3, each registering
 * its K then its V) into one decode engine holding all four layers in
 * SGLang's order: each stage's layers land in the decode's buffers of
 * those layers.
 */
static void stage_side(dest_side_t *s, kvf_role_t role, int pp_rank, int pp_size,
                       uint32_t first, uint32_t layers, const char *bs)
{
    kvf_kv_tag_t tags[8];
    kvf_buffer_t kv[8], aux;
    s->eng = engine(role, 0, 1, pp_rank, pp_size, bs);
    for (uint32_t i = 0; i < 2 * layers; i++) {
        tags[i] = (kvf_kv_tag_t){first + i % layers, i < layers ? KVF_KV_K : KVF_KV_V, 0};
        kv[i] = kv_buf(s, PAGE * 2 * HEAD_B, role == KVF_ROLE_PREFILL);
        /* Distinct bytes per layer and role across the stages. */
        for (size_t k = 0; role == KVF_ROLE_PREFILL && k < PAGES * s->kv_page[i]; k++)
            s->kv[i][k] = pat((int)(tags[i].layer * 2 + tags[i].role), k);
    }
    aux = aux_buf(s, role == KVF_ROLE_PREFILL);
    kvf_layout_t l = mha(layers, 2, 2);
    l.first_layer = first;
    l.num_kv = 2 * layers;
    l.kv = kv;
    l.kv_tags = tags;
    l.num_aux = 1;
    l.aux = &aux;
    CHECK_EQ_INT(kvf_engine_register_layout(s->eng, &l), KVF_OK);
}

static void test_pipeline_stages_by_tag(void)
{
    dest_side_t p0 = {0}, p1 = {0}, dec = {0};
    stage_side(&p0, KVF_ROLE_PREFILL, 0, 2, 0, 2, "127.0.0.1:0");
    stage_side(&p1, KVF_ROLE_PREFILL, 1, 2, 2, 2, bs_addr);
    stage_side(&dec, KVF_ROLE_DECODE, 0, 1, 0, 4, NULL);

    uint32_t src[2] = {8, 9}, dst[2] = {1, 25};
    kvf_sender_t *s[2];
    kvf_receiver_t *r;
    CHECK_EQ_INT(kvf_sender_create(p0.eng, bs_addr, 40, &s[0]), KVF_OK);
    CHECK_EQ_INT(kvf_sender_create(p1.eng, bs_addr, 40, &s[1]), KVF_OK);
    CHECK_EQ_INT(kvf_receiver_create(dec.eng, bs_addr, 40, -1, &r), KVF_OK);
    CHECK_EQ_INT(kvf_receiver_init(r, dst, 2, 6, NULL, 0), KVF_OK);
    for (int k = 0; k < 2; k++) {
        CHECK_EQ_INT(wait_sender(s[k], KVF_POLL_WAITING_FOR_INPUT),
                     KVF_POLL_WAITING_FOR_INPUT);
        CHECK_EQ_INT(kvf_sender_init(s[k], 2, 3), KVF_OK);
        CHECK_EQ_INT(kvf_sender_send(s[k], src, 2, 1), KVF_OK);
    }
    wait_all_final(s, 2, &r, 1);
    CHECK_EQ_INT(kvf_receiver_poll(r), KVF_POLL_SUCCESS);
    /* Decode buffer j holds layer j % 4, K for j < 4. */
    for (int j = 0; j < 8; j++) {
        int id = (j % 4) * 2 + (j < 4 ? KVF_KV_K : KVF_KV_V);
        size_t pb = dec.kv_page[j];
        for (int k = 0; k < 2; k++)
            for (size_t i = 0; i < pb; i++)
                if (dec.kv[j][dst[k] * pb + i] != pat(id, src[k] * pb + i)) {
                    CHECK(!"decode buffer holds another layer's bytes");
                    k = 2;
                    break;
                }
    }
    /* Aux comes from the last stage only. */
    CHECK(memcmp(dec.aux + 6 * AUX_B, p1.aux + 3 * AUX_B, AUX_B) == 0);
    kvf_sender_destroy(s[0]);
    kvf_sender_destroy(s[1]);
    kvf_receiver_destroy(r);
    side_free(&dec);
    side_free(&p1);
    side_free(&p0);
}

/*
 * SGLang's decode side knows no head counts: two decode ranks (TP 2)
 * register their buffers with the heads left 0, and take each its head of
 * the prefill's two (TP 1) from the prefill's layout.
 */
static void test_decode_heads_from_prefill(void)
{
    dest_side_t pre = {0}, dec[2] = {{0}};
    kvf_buffer_t kv[2], aux;

    /* A prefill must say its heads. */
    dest_side_t x = {0};
    x.eng = engine(KVF_ROLE_PREFILL, 0, 1, 0, 1, "127.0.0.1:0");
    kv[0] = kv_buf(&x, PAGE * 2 * HEAD_B, 0);
    kvf_layout_t l = mha(1, 0, 0);
    l.num_kv = 1;
    l.kv = kv;
    CHECK_EQ_INT(kvf_engine_register_layout(x.eng, &l), KVF_ERR_INVALID_PARAM);
    side_free(&x);

    pre.eng = engine(KVF_ROLE_PREFILL, 0, 1, 0, 1, "127.0.0.1:0");
    kv[0] = kv_buf(&pre, PAGE * 2 * HEAD_B, 1);
    kv[1] = kv_buf(&pre, PAGE * 2 * HEAD_B, 1);
    aux = aux_buf(&pre, 1);
    l = mha(1, 2, 2);
    l.num_kv = 2;
    l.kv = kv;
    l.num_aux = 1;
    l.aux = &aux;
    CHECK_EQ_INT(kvf_engine_register_layout(pre.eng, &l), KVF_OK);
    for (int d = 0; d < 2; d++) {
        dec[d].eng = engine(KVF_ROLE_DECODE, d, 2, 0, 1, NULL);
        kv[0] = kv_buf(&dec[d], PAGE * 1 * HEAD_B, 0);
        kv[1] = kv_buf(&dec[d], PAGE * 1 * HEAD_B, 0);
        aux = aux_buf(&dec[d], 0);
        l = mha(1, 0, 0);
        l.num_kv = 2;
        l.kv = kv;
        l.num_aux = 1;
        l.aux = &aux;
        CHECK_EQ_INT(kvf_engine_register_layout(dec[d].eng, &l), KVF_OK);
    }
    uint32_t src = 12, dst[2] = {4, 30};
    kvf_sender_t *s;
    kvf_receiver_t *r[2];
    CHECK_EQ_INT(kvf_sender_create(pre.eng, bs_addr, 50, &s), KVF_OK);
    for (int d = 0; d < 2; d++) {
        CHECK_EQ_INT(kvf_receiver_create(dec[d].eng, bs_addr, 50, -1, &r[d]), KVF_OK);
        CHECK_EQ_INT(kvf_receiver_init(r[d], &dst[d], 1, 1, NULL, 0), KVF_OK);
    }
    CHECK_EQ_INT(wait_sender(s, KVF_POLL_WAITING_FOR_INPUT), KVF_POLL_WAITING_FOR_INPUT);
    CHECK_EQ_INT(kvf_sender_init(s, 1, 2), KVF_OK);
    CHECK_EQ_INT(kvf_sender_send(s, &src, 1, 1), KVF_OK);
    wait_all_final(&s, 1, r, 2);
    CHECK_EQ_INT(kvf_sender_poll(s), KVF_POLL_SUCCESS);
    for (int d = 0; d < 2; d++) {
        CHECK_EQ_INT(kvf_receiver_poll(r[d]), KVF_POLL_SUCCESS);
        for (int b = 0; b < 2; b++)
            for (int t = 0; t < PAGE; t++)   /* token t: head d of the prefill's two */
                CHECK(memcmp(dec[d].kv[b] + dst[d] * PAGE * HEAD_B + t * HEAD_B,
                             pre.kv[b] + src * PAGE * 2 * HEAD_B + (t * 2 + d) * HEAD_B,
                             HEAD_B) == 0);
    }
    CHECK(memcmp(dec[0].aux + AUX_B, pre.aux + 2 * AUX_B, AUX_B) == 0);
    kvf_sender_destroy(s);
    for (int d = 0; d < 2; d++) {
        kvf_receiver_destroy(r[d]);
        side_free(&dec[d]);
    }
    side_free(&pre);
}

/*
 * Four prefill ranks (TP 4, a head each) into two decode ranks (TP 2, two
 * heads each) that left their heads to the prefill: before a HELLO tells
 * the heads, each decode rank must already link the two prefill ranks that
 * hold its heads (the resolver's guess), and each token's heads come one
 * from each of them.
 */
static void test_decode_heads_guessed_before_hello(void)
{
    enum { P = 4, D = 2, H = 4 };
    dest_side_t pre[P], dec[D];
    kvf_buffer_t kv[2], aux;
    kvf_layout_t l;
    memset(pre, 0, sizeof(pre));
    memset(dec, 0, sizeof(dec));
    for (int p = 0; p < P; p++) {
        pre[p].eng = engine(KVF_ROLE_PREFILL, p, P, 0, 1, p ? bs_addr : "127.0.0.1:0");
        for (int b = 0; b < 2; b++) {
            kv[b] = kv_buf(&pre[p], PAGE * (H / P) * HEAD_B, 1);
            for (size_t i = 0; i < PAGES * pre[p].kv_page[b]; i++)
                pre[p].kv[b][i] = pat(10 * p + b, i);   /* differ between ranks */
        }
        aux = aux_buf(&pre[p], 1);
        l = mha(1, H / P, H);
        l.num_kv = 2;
        l.kv = kv;
        l.num_aux = 1;
        l.aux = &aux;
        CHECK_EQ_INT(kvf_engine_register_layout(pre[p].eng, &l), KVF_OK);
    }
    for (int d = 0; d < D; d++) {
        dec[d].eng = engine(KVF_ROLE_DECODE, d, D, 0, 1, NULL);
        kv[0] = kv_buf(&dec[d], PAGE * (H / D) * HEAD_B, 0);
        kv[1] = kv_buf(&dec[d], PAGE * (H / D) * HEAD_B, 0);
        aux = aux_buf(&dec[d], 0);
        l = mha(1, 0, 0);
        l.num_kv = 2;
        l.kv = kv;
        l.num_aux = 1;
        l.aux = &aux;
        CHECK_EQ_INT(kvf_engine_register_layout(dec[d].eng, &l), KVF_OK);
    }
    uint32_t src = 5, dst = 17;
    kvf_sender_t *s[P];
    kvf_receiver_t *r[D];
    for (int p = 0; p < P; p++)
        CHECK_EQ_INT(kvf_sender_create(pre[p].eng, bs_addr, 60, &s[p]), KVF_OK);
    for (int d = 0; d < D; d++) {
        CHECK_EQ_INT(kvf_receiver_create(dec[d].eng, bs_addr, 60, -1, &r[d]), KVF_OK);
        CHECK_EQ_INT(kvf_receiver_init(r[d], &dst, 1, 3, NULL, 0), KVF_OK);
    }
    for (int p = 0; p < P; p++) {
        CHECK_EQ_INT(wait_sender(s[p], KVF_POLL_WAITING_FOR_INPUT),
                     KVF_POLL_WAITING_FOR_INPUT);
        CHECK_EQ_INT(kvf_sender_init(s[p], 1, 0), KVF_OK);
        CHECK_EQ_INT(kvf_sender_send(s[p], &src, 1, 1), KVF_OK);
    }
    wait_all_final(s, P, r, D);
    for (int d = 0; d < D; d++) {
        CHECK_EQ_INT(kvf_receiver_poll(r[d]), KVF_POLL_SUCCESS);
        for (int b = 0; b < 2; b++)
            for (int t = 0; t < PAGE; t++)
                for (int h = 0; h < H / D; h++) {  /* its head h: prefill rank 2d + h's */
                    int p = d * (H / D) + h;
                    CHECK(memcmp(dec[d].kv[b] + (dst * PAGE + t) * (H / D) * HEAD_B +
                                     h * HEAD_B,
                                 pre[p].kv[b] + (src * PAGE + t) * HEAD_B, HEAD_B) == 0);
                }
    }
    for (int p = 0; p < P; p++)
        kvf_sender_destroy(s[p]);
    for (int d = 0; d < D; d++) {
        kvf_receiver_destroy(r[d]);
        side_free(&dec[d]);
    }
    for (int p = P - 1; p >= 0; p--)
        side_free(&pre[p]);
}

KVF_TEST_MAIN(KVF_CASE(test_waiting_before_pages_and_prefix),
              KVF_CASE(test_zero_page_room),
              KVF_CASE(test_room_that_owes_nothing),
              KVF_CASE(test_typed_state_groups),
              KVF_CASE(test_tagged_buffers_and_draft),
              KVF_CASE(test_pipeline_stages_by_tag),
              KVF_CASE(test_decode_heads_from_prefill),
              KVF_CASE(test_decode_heads_guessed_before_hello))
