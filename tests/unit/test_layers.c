/*
 * Layer-wise sends (kvf_sender_send_layers), between real engines over
 * loopback:
 *   - every layout pair kvferry moves (equal TP, TP-sliced NHD and HND
 *     pages, MLA, pipeline stages, a draft model's group), over tcp and
 *     shm, with checksums, one stream or two: each prefill rank sends a
 *     room's chunks layer range by layer range in a random interleaving
 *     (each layer's chunks in page order), and the decode must hold, byte
 *     for byte, what the same pages sent whole place in another room; no
 *     other page is touched;
 *   - a layer never sent fails the room on both sides with a reason
 *     naming the layer and the prefill rank;
 *   - what the call refuses (a layer sent twice, a chunk skipped, another
 *     source page for a position, a layer this rank does not hold, a
 *     whole send while the layers are at different pages), after which
 *     the room still completes;
 *   - a prefill that stops between layers: both sides' deadlines name
 *     the layers that did not come.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define LAYERS 4
#define HEADS  4
#include "unit/kvf_sides.h"

#define NP     6                  /* pages of a room */
#define MAXR   2                  /* ranks of a side */
static const uint32_t src_pages[NP] = {3, 4, 5, 10, 11, 20};
static const uint32_t dst_whole[NP] = {7, 8, 9, 2, 30, 31};
static const uint32_t dst_layers[NP] = {12, 13, 14, 15, 1, 0};

/* One layout pair and how it moves. */
typedef struct config {
    const char *name;
    const char *transport;
    int         np, nd;           /* prefill and decode TP sizes */
    int         stages;           /* prefill pipeline stages (decode: one) */
    int         hnd, mla, draft;
    unsigned    streams;
} config_t;

static const config_t *cfg;
static const char *prefill_faults;      /* the next prefill engine's (tune) */

/* A draft model's layer beside the model's first three (kvf_kv_tag_t). */
static const kvf_kv_tag_t draft_tags[NKV] = {
    {0, KVF_KV_K, 0}, {0, KVF_KV_V, 0}, {1, KVF_KV_K, 0}, {1, KVF_KV_V, 0},
    {2, KVF_KV_K, 0}, {2, KVF_KV_V, 0}, {0, KVF_KV_K, 1}, {0, KVF_KV_V, 1}};

/* The KV buffers a side of this config registers. */
static int kv_count(const side_t *s)
{
    return cfg->mla ? s->nkv / 2 : s->nkv;
}

static void shape(side_t *s, kvf_layout_t *l)
{
    if (cfg->hnd)
        l->kv_order = KVF_KV_HND;
    if (cfg->mla) {
        l->attn = KVF_ATTN_MLA;
        l->heads_per_rank = l->total_heads = l->bytes_per_head = 0;
        l->num_kv = (uint32_t)kv_count(s);
    }
    if (cfg->draft) {
        l->kv_tags = draft_tags;
        l->num_layers = LAYERS - 1;
    }
}

static void tune(kvf_engine_params_t *p)
{
    p->checksum = 1;
    p->streams = cfg->streams;
    if (p->role == KVF_ROLE_PREFILL)
        p->faults = prefill_faults;
}

/* A rank of this config: MLA pages are the same on every rank (never cut
 * by heads), so an MLA side is given HEADS per rank whatever its TP. */
static void config_side(side_t *s, kvf_role_t role, side_rank_t at, const char *bs)
{
    side_rank = at;
    side_heads = cfg->mla ? (uint32_t)(HEADS * (at.tp_size ? at.tp_size : 1)) : 0;
    side_init(s, role, bs, NULL);
    side_rank = (side_rank_t){0};
    side_heads = 0;
}

/* The prefill ranks (TP np, or `stages` pipeline stages of TP 1) and the
 * decode ranks (TP nd) of cfg, around prefill rank 0's registry. */
static int config_up(side_t *pre, side_t *dec, char *bs, size_t bslen)
{
    int np = cfg->stages > 1 ? cfg->stages : cfg->np;
    side_transport = cfg->transport;
    side_shape = shape;
    side_tune = tune;
    for (int k = 0; k < np; k++) {
        side_rank_t at = cfg->stages > 1 ? (side_rank_t){.pp = k, .pp_size = cfg->stages}
                                         : (side_rank_t){.tp = k, .tp_size = cfg->np};
        config_side(&pre[k], KVF_ROLE_PREFILL, at, k == 0 ? "127.0.0.1:0" : bs);
        if (k == 0)
            CHECK_EQ_INT(kvf_engine_bootstrap_addr(pre[0].eng, bs, bslen), KVF_OK);
    }
    for (int j = 0; j < cfg->nd; j++)
        config_side(&dec[j], KVF_ROLE_DECODE, (side_rank_t){.tp = j, .tp_size = cfg->nd},
                    NULL);
    return np;
}

static void config_down(side_t *pre, int np, side_t *dec)
{
    side_ranks_fini(pre, np, dec, cfg->nd);
    side_transport = "tcp";
    side_shape = NULL;
    side_tune = NULL;
}

/* ---- a random interleaving of layer ranges and chunks -------------------- */

static uint32_t rng = 1;

static uint32_t rnd(uint32_t n)
{
    rng ^= rng << 13;
    rng ^= rng >> 17;
    rng ^= rng << 5;
    return rng % n;
}

/* One per-layer send: pages [cut[chunk], cut[chunk + 1]) of layers
 * [lb, le) of group `group`. */
typedef struct item {
    int      chunk, done;
    uint32_t group, lb, le;
} item_t;

/* The groups of layers a prefill rank holds: [lo, hi) of group g. */
typedef struct layers {
    uint32_t group, lo, hi;
} layers_t;

static int rank_layers(const side_t *s, layers_t *g)
{
    uint32_t n = cfg->draft ? LAYERS - 1 : LAYERS / (uint32_t)s->pp_size;
    g[0] = (layers_t){0, (uint32_t)s->pp_rank * n, (uint32_t)(s->pp_rank + 1) * n};
    if (!cfg->draft)
        return 1;
    g[1] = (layers_t){1, 0, 1};
    return 2;
}

/* Is every layer of it at its chunk (cur: per group, per layer)? */
static int ready(const item_t *it, int cur[2][LAYERS], const layers_t *g)
{
    for (uint32_t l = it->lb; l < it->le; l++)
        if (cur[it->group][l - g[it->group].lo] != it->chunk)
            return 0;
    return 1;
}

/*
 * Send the room's pages from one prefill rank: `nchunks` chunks cut at
 * cut[], each cut into random layer ranges per group, sent in a random
 * order in which each layer's chunks come in page order; the last chunk
 * whole (kvf_sender_send) when plain_tail, else a last send of no pages.
 */
static void send_layerwise(kvf_sender_t *s, const side_t *pre, int nchunks, const uint32_t *cut,
                           int plain_tail)
{
    layers_t g[2];
    int ng = rank_layers(pre, g), n = 0, cur[2][LAYERS] = {{0}};
    item_t items[64];
    for (int c = 0; c < nchunks - plain_tail; c++)
        for (int k = 0; k < ng; k++)
            for (uint32_t at = g[k].lo, len; at < g[k].hi; at += len) {
                len = 1 + rnd(g[k].hi - at);
                items[n++] = (item_t){c, 0, g[k].group, at, at + len};
            }
    for (int left = n; left > 0; left--) {
        int nready = 0, i = 0;
        for (int k = 0; k < n; k++)
            nready += !items[k].done && ready(&items[k], cur, g);
        CHECK(nready > 0);
        for (int pick = (int)rnd((uint32_t)nready);; i++)
            if (!items[i].done && ready(&items[i], cur, g) && pick-- == 0)
                break;
        item_t *it = &items[i];
        CHECK_EQ_INT(kvf_sender_send_layers(s, src_pages + cut[it->chunk],
                                            cut[it->chunk + 1] - cut[it->chunk],
                                            cut[it->chunk], it->group, it->lb, it->le),
                     KVF_OK);
        it->done = 1;
        for (uint32_t l = it->lb; l < it->le; l++)
            cur[it->group][l - g[it->group].lo]++;
    }
    if (plain_tail)
        CHECK_EQ_INT(kvf_sender_send(s, src_pages + cut[nchunks - 1], NP - cut[nchunks - 1],
                                     1), KVF_OK);
    else
        CHECK_EQ_INT(kvf_sender_send(s, NULL, 0, 1), KVF_OK);
}

/* ---- rooms, whole and layer by layer, checked against each other --------- */

/* Does decode rank d hold, in the pages the layer-wise room named, what
 * the whole room placed in its own, page for page and buffer for buffer
 * (the aux slot too), something in each, and nothing in any other page?
 * @return the number of pages that are wrong. */
static int check_decode(const side_t *d)
{
    int bad = 0;
    for (int b = 0; b < kv_count(d); b++) {
        for (uint32_t p = 0; p < PAGES; p++) {
            const uint8_t *at = d->kv[b] + p * d->page_b;
            int i = 0;
            while (i < NP && dst_layers[i] != p)
                i++;
            int whole = 0;
            for (int k = 0; k < NP; k++)
                whole |= dst_whole[k] == p;
            int ok = i < NP ? memcmp(at, d->kv[b] + dst_whole[i] * d->page_b,
                                     d->page_b) == 0 && !all_zero(at, d->page_b)
                            : whole || all_zero(at, d->page_b);
            if (!ok && bad++ < 3)
                fprintf(stderr, "  %s: decode rank %d, KV buffer %d, page %u is wrong\n",
                        cfg->name, d->tp_rank, b, p);
        }
    }
    if (memcmp(d->aux + 3 * AUX_B, d->aux + 2 * AUX_B, AUX_B) != 0 ||
        all_zero(d->aux + 2 * AUX_B, AUX_B)) {
        fprintf(stderr, "  %s: decode rank %d, aux slot 3 is wrong\n", cfg->name, d->tp_rank);
        bad++;
    }
    return bad;
}

/* Random cuts of the room's pages into 1 to 3 chunks: cut[0] = 0 ... NP. */
static int random_cuts(uint32_t *cut)
{
    int n = 1 + (int)rnd(3);
    cut[0] = 0;
    for (int c = 1; c < n; c++)
        cut[c] = cut[c - 1] + 1 + rnd(NP - cut[c - 1] - (uint32_t)(n - c));
    cut[n] = NP;
    return n;
}

/* Two rooms from every prefill rank to every decode rank: `whole` sent
 * with one kvf_sender_send, `room` layer by layer; both succeed. */
static void two_rooms(side_t *pre, int np, side_t *dec, const char *bs, uint64_t whole,
                      uint64_t room, int plain_tail)
{
    kvf_sender_t *s[2 * MAXR];
    kvf_receiver_t *r[2 * MAXR];
    for (int k = 0; k < np; k++) {
        memcpy(pre[k].aux + AUX_B, "layer-wise room!", AUX_B);
        CHECK_EQ_INT(kvf_sender_create(pre[k].eng, bs, whole, &s[2 * k]), KVF_OK);
        CHECK_EQ_INT(kvf_sender_create(pre[k].eng, bs, room, &s[2 * k + 1]), KVF_OK);
    }
    for (int j = 0; j < cfg->nd; j++) {
        CHECK_EQ_INT(kvf_receiver_create(dec[j].eng, bs, whole, -1, &r[2 * j]), KVF_OK);
        CHECK_EQ_INT(kvf_receiver_init(r[2 * j], dst_whole, NP, 2, NULL, 0), KVF_OK);
        CHECK_EQ_INT(kvf_receiver_create(dec[j].eng, bs, room, -1, &r[2 * j + 1]), KVF_OK);
        CHECK_EQ_INT(kvf_receiver_init(r[2 * j + 1], dst_layers, NP, 3, NULL, 0), KVF_OK);
    }
    for (int k = 0; k < 2 * np; k++) {
        CHECK_EQ_INT(wait_sender(s[k], KVF_POLL_WAITING_FOR_INPUT), KVF_POLL_WAITING_FOR_INPUT);
        CHECK_EQ_INT(kvf_sender_init(s[k], NP, 1), KVF_OK);
    }
    for (int k = 0; k < np; k++) {
        uint32_t cut[4];
        int n = random_cuts(cut);
        CHECK_EQ_INT(kvf_sender_send(s[2 * k], src_pages, NP, 1), KVF_OK);
        send_layerwise(s[2 * k + 1], &pre[k], n, cut, plain_tail && n > 1);
    }
    wait_all_final(s, 2 * np, r, 2 * cfg->nd);
    for (int k = 0; k < 2 * np; k++) {
        CHECK_EQ_INT(kvf_sender_poll(s[k]), KVF_POLL_SUCCESS);
        kvf_sender_destroy(s[k]);
    }
    for (int j = 0; j < 2 * cfg->nd; j++) {
        CHECK_EQ_INT(kvf_receiver_poll(r[j]), KVF_POLL_SUCCESS);
        kvf_receiver_destroy(r[j]);
    }
}

static const config_t configs[] = {
    {"tcp, TP 1 to 1", "tcp", 1, 1, 1, 0, 0, 0, 1},
    {"tcp, TP 1 to 2, NHD", "tcp", 1, 2, 1, 0, 0, 0, 1},
    {"tcp, TP 2 to 1, NHD, two streams", "tcp", 2, 1, 1, 0, 0, 0, 2},
    {"tcp, TP 1 to 2, HND", "tcp", 1, 2, 1, 1, 0, 0, 1},
    {"tcp, TP 2 to 1, HND, two streams", "tcp", 2, 1, 1, 1, 0, 0, 2},
    {"tcp, MLA, TP 2 to 1", "tcp", 2, 1, 1, 0, 1, 0, 1},
    {"tcp, two pipeline stages to one", "tcp", 1, 1, 2, 0, 0, 0, 1},
    {"tcp, a draft model's group", "tcp", 1, 1, 1, 0, 0, 1, 2},
    {"shm, TP 1 to 2, NHD", "shm", 1, 2, 1, 0, 0, 0, 1},
    {"shm, a draft model's group, TP 2 to 2", "shm", 2, 2, 1, 0, 0, 1, 1},
#ifdef KVF_HAVE_UCX
    /* Under UCX_TLS=tcp, with reads moved in software allowed (test_ucx). */
    {"ucx, TP 1 to 2, HND", "ucx", 1, 2, 1, 1, 0, 0, 1},
#endif
};

/* A ucx config's UCX: tcp, reads in software allowed; read when an
 * engine creates its UCX context. */
static void ucx_env(int on)
{
    if (on) {
        setenv("UCX_TLS", "tcp", 1);
        setenv("KVF_UCX_SOFTWARE_RMA", "allow", 1);
    } else {
        unsetenv("UCX_TLS");
        unsetenv("KVF_UCX_SOFTWARE_RMA");
    }
}

/* Each config, rounds of rooms with fresh random orders: every byte of
 * every decode rank checked after each round. */
static void test_every_layout_pair(void)
{
    uint64_t id = 100;
    for (size_t c = 0; c < sizeof(configs) / sizeof(configs[0]); c++) {
        side_t pre[MAXR], dec[MAXR];
        char bs[64];
        cfg = &configs[c];
        rng = 0x9E3779B9u ^ (uint32_t)c;
        ucx_env(strcmp(cfg->transport, "ucx") == 0);
        int np = config_up(pre, dec, bs, sizeof(bs));
        CHECK(strcmp(kvf_engine_transport(dec[0].eng), cfg->transport) == 0);
        for (int round = 0; round < 6; round++, id += 2) {
            for (int j = 0; j < cfg->nd; j++) {
                for (int b = 0; b < dec[j].nkv; b++)
                    memset(dec[j].kv[b], 0, PAGES * dec[j].page_b);
                memset(dec[j].aux, 0, SLOTS * AUX_B);
            }
            two_rooms(pre, np, dec, bs, id, id + 1, round & 1);
            for (int j = 0; j < cfg->nd; j++)
                CHECK_EQ_INT(check_decode(&dec[j]), 0);
        }
        config_down(pre, np, dec);
        ucx_env(0);
    }
}

/* ---- failures and refusals ---------------------------------------------- */

static const config_t plain = {"tcp, TP 1 to 1", "tcp", 1, 1, 1, 0, 0, 0, 1};
static const config_t drafted = {"tcp, a draft model's group", "tcp", 1, 1, 1, 0, 0, 1, 1};

/* Room id between pre[0] and dec[0], the sender initialised (NP pages,
 * aux slot 1), the receiver's destination dst_layers. */
static void open_room(side_t *pre, side_t *dec, const char *bs, uint64_t id,
                      kvf_sender_t **s, kvf_receiver_t **r)
{
    CHECK_EQ_INT(kvf_sender_create(pre->eng, bs, id, s), KVF_OK);
    CHECK_EQ_INT(kvf_receiver_create(dec->eng, bs, id, -1, r), KVF_OK);
    CHECK_EQ_INT(kvf_receiver_init(*r, dst_layers, NP, 3, NULL, 0), KVF_OK);
    CHECK_EQ_INT(wait_sender(*s, KVF_POLL_WAITING_FOR_INPUT), KVF_POLL_WAITING_FOR_INPUT);
    CHECK_EQ_INT(kvf_sender_init(*s, NP, 1), KVF_OK);
}

/* The ranks of cfg (one each) and room id between them (open_room). */
static void one_room(side_t *pre, side_t *dec, char *bs, uint64_t id, kvf_sender_t **s,
                     kvf_receiver_t **r)
{
    config_up(pre, dec, bs, 64);
    open_room(pre, dec, bs, id, s, r);
}

/* Both sides failed with `status`, their reasons naming `what` and `who`. */
static void check_both_failed(kvf_sender_t *s, kvf_receiver_t *r, kvf_status_t status,
                              const char *what, const char *who)
{
    kvf_failure_t f;
    kvf_failure_init(&f);
    CHECK_EQ_INT(wait_sender(s, KVF_POLL_SUCCESS), KVF_POLL_FAILED);
    CHECK_EQ_INT(kvf_sender_failure(s, &f), KVF_OK);
    CHECK_EQ_INT(f.status, status);
    CHECK_STR_CONTAINS(f.reason, what);
    CHECK_STR_CONTAINS(f.reason, who);
    check_recv_failed(r, status, what, who);
}

/* The last send comes with a layer never sent: the call says so, and the
 * room fails on both sides naming the layer, its pages and the rank. */
static void test_layer_never_sent(void)
{
    side_t pre[1], dec[1];
    char bs[64];
    kvf_sender_t *s;
    kvf_receiver_t *r;

    cfg = &plain;
    one_room(pre, dec, bs, 1, &s, &r);
    CHECK_EQ_INT(kvf_sender_send_layers(s, src_pages, NP, 0, 0, 0, 2), KVF_OK);
    CHECK_EQ_INT(kvf_sender_send_layers(s, src_pages, 4, 0, 0, 3, 4), KVF_OK);
    CHECK_EQ_INT(kvf_sender_send(s, NULL, 0, 1), KVF_ERR_INVALID_PARAM);
    CHECK_STR_CONTAINS(kvf_last_error(), "layers 2-3 without every one of the 6 pages");
    check_both_failed(s, r, KVF_ERR_INCOMPLETE, "the last send left layers 2-3 without "
                      "every one of the 6 pages kvf_sender_init declared (layer 2 had 0)",
                      "on prefill rank 0: a layer never sent");
    kvf_sender_destroy(s);
    kvf_receiver_destroy(r);
    config_down(pre, 1, dec);

    /* A draft model's layer is a layer too. */
    cfg = &drafted;
    one_room(pre, dec, bs, 2, &s, &r);
    CHECK_EQ_INT(kvf_sender_send_layers(s, src_pages, NP, 0, 0, 0, 3), KVF_OK);
    CHECK_EQ_INT(kvf_sender_send_layers(s, src_pages, 2, 0, 1, 0, 1), KVF_OK);
    CHECK_EQ_INT(kvf_sender_send(s, NULL, 0, 1), KVF_ERR_INVALID_PARAM);
    check_both_failed(s, r, KVF_ERR_INCOMPLETE, "left layer 0 of group 1 without every one "
                      "of the 6 pages", "(layer 0 of group 1 had 2) on prefill rank 0");
    kvf_sender_destroy(s);
    kvf_receiver_destroy(r);
    config_down(pre, 1, dec);
}

/* A refused call sends nothing and says why; the room goes on. */
static void check_refused(kvf_status_t got, kvf_status_t want, const char *why)
{
    CHECK_EQ_INT(got, want);
    CHECK_STR_CONTAINS(kvf_last_error(), why);
}

static void test_refusals(void)
{
    side_t pre[1], dec[1];
    char bs[64];
    kvf_sender_t *s;
    kvf_receiver_t *r;
    uint32_t other[3] = {3, 9, 5};

    cfg = &plain;
    one_room(pre, dec, bs, 3, &s, &r);
    CHECK_EQ_INT(kvf_sender_send_layers(s, src_pages, 3, 0, 0, 0, 2), KVF_OK);
    check_refused(kvf_sender_send_layers(s, src_pages, 3, 0, 0, 1, 3), KVF_ERR_INVALID_PARAM,
                  "layer 1 already has pages [0, 3): a layer's pages are sent once");
    check_refused(kvf_sender_send_layers(s, src_pages + 3, 3, 3, 0, 2, 3),
                  KVF_ERR_INVALID_PARAM, "layer 2 has pages [0, 0) only: pages [0, 3) come "
                  "first");
    check_refused(kvf_sender_send_layers(s, other, 3, 0, 0, 2, 4), KVF_ERR_INVALID_PARAM,
                  "page 1 of the room was sent as source page 4, and is named 9 now");
    check_refused(kvf_sender_send_layers(s, src_pages, 3, 0, 0, 3, 5), KVF_ERR_OUT_OF_RANGE,
                  "layer 4 of group 0: no KV buffer of this rank holds it");
    check_refused(kvf_sender_send_layers(s, src_pages, 3, 0, 1, 0, 1), KVF_ERR_OUT_OF_RANGE,
                  "layer 0 of group 1: no KV buffer");
    check_refused(kvf_sender_send_layers(s, src_pages, 3, 0, 0, 2, 2), KVF_ERR_INVALID_PARAM,
                  "layers [2, 2) of group 0: no layer");
    check_refused(kvf_sender_send_layers(s, src_pages, 0, 0, 0, 2, 3), KVF_ERR_INVALID_PARAM,
                  "no pages");
    check_refused(kvf_sender_send_layers(s, src_pages, 3, 4, 0, 0, 2), KVF_ERR_OUT_OF_RANGE,
                  "pages [4, 7) are past the 6 kvf_sender_init declared");
    check_refused(kvf_sender_send(s, src_pages + 3, 3, 1), KVF_ERR_INVALID_PARAM,
                  "its layers are at different pages (layer 0 has 3, layer 2 0)");
    /* What was refused left nothing behind: the room completes. */
    CHECK_EQ_INT(kvf_sender_send_layers(s, src_pages, 3, 0, 0, 2, 4), KVF_OK);
    CHECK_EQ_INT(kvf_sender_send(s, src_pages + 3, 3, 1), KVF_OK);
    wait_final(s, r);
    CHECK_EQ_INT(kvf_sender_poll(s), KVF_POLL_SUCCESS);
    CHECK_EQ_INT(kvf_receiver_poll(r), KVF_POLL_SUCCESS);
    for (int b = 0; b < NKV; b++)
        for (int i = 0; i < NP; i++)
            for (size_t j = 0; j < PAGE_B; j++)
                CHECK(dec->kv[b][dst_layers[i] * PAGE_B + j] ==
                      side_kv_byte(b, src_pages[i] * PAGE_B + j));
    check_refused(kvf_sender_send_layers(s, src_pages, 3, 0, 0, 0, 1), KVF_ERR_STATE,
                  "the last chunk was already sent");
    kvf_sender_destroy(s);
    kvf_receiver_destroy(r);
    config_down(pre, 1, dec);
}

/*
 * A prefill whose application stops between layers (its process stuck,
 * say): the side whose transfer deadline expires first names the layers
 * that did not come, and the other side fails with that cause.
 */
static void test_stopped_between_layers(void)
{
    side_t pre[1], dec[1];
    char bs[64];
    kvf_sender_t *s;
    kvf_receiver_t *r;

    cfg = &plain;
    for (int decode_first = 0; decode_first < 2; decode_first++) {
        side_rank = (side_rank_t){0};
        side_transport = "tcp";
        side_shape = shape;
        side_tune = tune;
        side_transfer_ms = decode_first ? 20000 : 800;
        side_init(&pre[0], KVF_ROLE_PREFILL, "127.0.0.1:0", NULL);
        CHECK_EQ_INT(kvf_engine_bootstrap_addr(pre[0].eng, bs, sizeof(bs)), KVF_OK);
        side_transfer_ms = decode_first ? 800 : 20000;
        side_init(&dec[0], KVF_ROLE_DECODE, NULL, NULL);
        side_transfer_ms = 5000;
        open_room(pre, dec, bs, 4, &s, &r);
        CHECK_EQ_INT(kvf_sender_send_layers(s, src_pages, NP, 0, 0, 0, 2), KVF_OK);
        CHECK_EQ_INT(kvf_sender_send_layers(s, src_pages, 2, 0, 0, 2, 3), KVF_OK);
        if (decode_first)
            check_both_failed(s, r, KVF_ERR_TIMED_OUT, "no bytes placed since; from prefill "
                              "rank 0", "layer 2 K has 8 of 24 of its tokens from it (and 3 "
                              "more KV buffers are short)");
        else
            check_both_failed(s, r, KVF_ERR_TIMED_OUT, "the application sent layers 2-3 "
                              "fewer than the 6 pages declared (layer 2: 2)", "room 4");
        kvf_sender_destroy(s);
        kvf_receiver_destroy(r);
        config_down(pre, 1, dec);
    }
}

/*
 * The connection resets while the layers are at different pages: the
 * decode rank reconnects, and the resumed link gets every layer's pages
 * sent so far again, each its own, then the rest; every byte checked.
 */
static void reset_room(void *arg)
{
    side_t pre[1], dec[1];
    char bs[64];
    kvf_sender_t *s;
    kvf_receiver_t *r;
    (void)arg;

    cfg = &plain;
    prefill_faults = "reset@4096";        /* within the first layer send */
    one_room(pre, dec, bs, 5, &s, &r);
    prefill_faults = NULL;
    CHECK_EQ_INT(kvf_sender_send_layers(s, src_pages, NP, 0, 0, 0, 2), KVF_OK);
    CHECK_EQ_INT(kvf_sender_send_layers(s, src_pages, 2, 0, 0, 2, 4), KVF_OK);
    CHECK_EQ_INT(wait_receiver(r, KVF_POLL_TRANSFERRING), KVF_POLL_TRANSFERRING);
    CHECK_EQ_INT(kvf_sender_send_layers(s, src_pages + 2, 4, 2, 0, 2, 4), KVF_OK);
    CHECK_EQ_INT(kvf_sender_send(s, NULL, 0, 1), KVF_OK);
    wait_final(s, r);
    CHECK_EQ_INT(kvf_sender_poll(s), KVF_POLL_SUCCESS);
    CHECK_EQ_INT(kvf_receiver_poll(r), KVF_POLL_SUCCESS);
    for (int b = 0; b < NKV; b++)
        for (int i = 0; i < NP; i++)
            CHECK(memcmp(dec->kv[b] + dst_layers[i] * PAGE_B,
                         pre->kv[b] + src_pages[i] * PAGE_B, PAGE_B) == 0);
    kvf_sender_destroy(s);
    kvf_receiver_destroy(r);
    config_down(pre, 1, dec);
}

static void test_reset_resumes_layers(void)
{
    kvf_log_set_level(KVF_LOG_INFO);
    CHECK(log_lines_during(reset_room, NULL, "resumed room 5") >= 1);
    kvf_log_set_level(KVF_LOG_WARN);
}

KVF_TEST_MAIN(KVF_CASE(test_every_layout_pair), KVF_CASE(test_layer_never_sent),
              KVF_CASE(test_refusals), KVF_CASE(test_stopped_between_layers),
              KVF_CASE(test_reset_resumes_layers))
