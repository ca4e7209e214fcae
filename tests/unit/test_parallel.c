/*
 * The parallel-layout planner: for every TP pairing a model allows, the
 * slices the prefill ranks send cover each decode rank's heads exactly
 * once, and every prefill rank either feeds a decode rank or is told about
 * the room by exactly one.
 */
#include <string.h>

#include "core/parallel.h"
#include "unit/kvf_test.h"

static kvf_par_t par(int tp_rank, int tp_size, kvf_attn_kind_t attn, uint32_t H)
{
    kvf_par_t p = {.tp_rank = tp_rank, .tp_size = tp_size, .pp_rank = 0, .pp_size = 1,
                   .attn = attn, .total_heads = H, .num_layers = 4, .first_layer = 0,
                   .num_kv = 8};
    p.heads_per_rank = attn == KVF_ATTN_MLA ? 0
                     : (uint32_t)tp_size <= H ? H / (uint32_t)tp_size : 1;
    return p;
}

/* Check one (H, P, D) pairing; @return the number of problems. */
static int check_pairing(kvf_attn_kind_t attn, uint32_t H, int P, int D)
{
    int bad = 0;
    int told[64] = {0}, fed[64] = {0};
    char err[256];

    for (int d = 0; d < D; d++) {
        kvf_par_t dec = par(d, D, attn, H);
        uint32_t df = 0, dc = 1;
        if (attn == KVF_ATTN_MHA)
            kvf__rank_heads(H, D, d, &df, &dc);
        int covered[64] = {0};
        int nsrc = 0;
        for (int p = 0; p < P; p++) {
            kvf_par_t pre = par(p, P, attn, H);
            kvf_slice_t s;
            kvf_status_t st = kvf__plan_slice(&pre, &dec, &s, err, sizeof(err));
            if (st == KVF_ERR_NOT_FOUND)
                continue;
            bad += st != KVF_OK;
            nsrc++;
            fed[p] = 1;
            if (attn == KVF_ATTN_MLA) {
                covered[0]++;
                continue;
            }
            uint32_t pf, pc;
            kvf__rank_heads(H, P, p, &pf, &pc);
            uint32_t n = s.sliced ? s.nheads : dc, sh = s.sliced ? s.src_head : 0,
                     dh = s.sliced ? s.dst_head : 0;
            for (uint32_t i = 0; i < n; i++) {
                bad += pf + sh + i != df + dh + i;   /* same global head */
                bad += sh + i >= pc || dh + i >= dc;
                covered[dh + i]++;
            }
        }
        int src[KVF_MAX_SOURCES];
        bad += kvf__sources(attn, H, P, D, d, src) != nsrc;
        for (uint32_t i = 0; i < (attn == KVF_ATTN_MLA ? 1 : dc); i++)
            bad += covered[i] != 1;
        int idle[KVF_MAX_SOURCES];
        int ni = kvf__idle_sources(attn, H, P, D, d, idle);
        for (int i = 0; i < ni; i++)
            told[idle[i]]++;
    }
    for (int p = 0; p < P; p++)
        bad += fed[p] ? told[p] != 0 : told[p] != 1;
    if (bad)
        fprintf(stderr, "  pairing attn=%d H=%u P=%d D=%d: %d problems\n", attn, H, P, D,
                bad);
    return bad;
}

static void test_every_pairing_covers_heads_once(void)
{
    static const uint32_t heads[] = {1, 2, 4, 8};
    static const int tps[] = {1, 2, 4, 8, 16};
    for (size_t h = 0; h < 4; h++)
        for (size_t a = 0; a < 5; a++)
            for (size_t b = 0; b < 5; b++) {
                CHECK_EQ_INT(check_pairing(KVF_ATTN_MHA, heads[h], tps[a], tps[b]), 0);
                CHECK_EQ_INT(check_pairing(KVF_ATTN_MLA, 0, tps[a], tps[b]), 0);
            }
}

static void test_slices(void)
{
    char err[256];
    kvf_slice_t s;
    /* qwen2.5-7b: 4 heads, prefill TP 1 -> decode TP 2: rank 1 gets heads 2..3 */
    kvf_par_t pre = par(0, 1, KVF_ATTN_MHA, 4), dec = par(1, 2, KVF_ATTN_MHA, 4);
    CHECK_EQ_INT(kvf__plan_slice(&pre, &dec, &s, err, sizeof(err)), KVF_OK);
    CHECK_EQ_INT(s.sliced, 1);
    CHECK_EQ_INT(s.nheads, 2);
    CHECK_EQ_INT(s.src_head, 2);
    CHECK_EQ_INT(s.dst_head, 0);
    /* equal TP: whole pages */
    pre = par(1, 2, KVF_ATTN_MHA, 4);
    CHECK_EQ_INT(kvf__plan_slice(&pre, &dec, &s, err, sizeof(err)), KVF_OK);
    CHECK_EQ_INT(s.sliced, 0);
    /* prefill TP 4 -> decode TP 2: prefill rank 1 feeds decode rank 0's second head */
    pre = par(1, 4, KVF_ATTN_MHA, 4);
    dec = par(0, 2, KVF_ATTN_MHA, 4);
    CHECK_EQ_INT(kvf__plan_slice(&pre, &dec, &s, err, sizeof(err)), KVF_OK);
    CHECK_EQ_INT(s.nheads, 1);
    CHECK_EQ_INT(s.src_head, 0);
    CHECK_EQ_INT(s.dst_head, 1);
    dec = par(1, 2, KVF_ATTN_MHA, 4);
    CHECK_EQ_INT(kvf__plan_slice(&pre, &dec, &s, err, sizeof(err)), KVF_ERR_NOT_FOUND);
    /* MLA, prefill TP 4 -> decode TP 1: only prefill rank 0 sends */
    dec = par(0, 1, KVF_ATTN_MLA, 0);
    pre = par(0, 4, KVF_ATTN_MLA, 0);
    CHECK_EQ_INT(kvf__plan_slice(&pre, &dec, &s, err, sizeof(err)), KVF_OK);
    pre = par(3, 4, KVF_ATTN_MLA, 0);
    CHECK_EQ_INT(kvf__plan_slice(&pre, &dec, &s, err, sizeof(err)), KVF_ERR_NOT_FOUND);
    int idle[KVF_MAX_SOURCES];
    CHECK_EQ_INT(kvf__idle_sources(KVF_ATTN_MLA, 0, 4, 1, 0, idle), 3);
}

static void test_pipeline(void)
{
    char err[256];
    kvf_slice_t s;
    kvf_par_t pre = par(0, 1, KVF_ATTN_MHA, 8), dec = par(0, 1, KVF_ATTN_MHA, 8);
    /* prefill stage 1 of 2 (layers 16..31) into a decode PP 1 (32 layers) */
    pre.pp_size = 2;
    pre.pp_rank = 1;
    pre.num_layers = 16;
    pre.first_layer = 16;
    pre.num_kv = 32;
    dec.num_layers = 32;
    dec.num_kv = 64;
    CHECK_EQ_INT(kvf__plan_slice(&pre, &dec, &s, err, sizeof(err)), KVF_OK);
    CHECK_EQ_INT(s.sliced, 0);
    /* decode PP 4 against prefill PP 2 is refused */
    dec.pp_size = 4;
    CHECK_EQ_INT(kvf__plan_slice(&pre, &dec, &s, err, sizeof(err)), KVF_ERR_INCOMPATIBLE);
    CHECK_STR_CONTAINS(err, "decode server must use the same --pp-size");
    /* stage to stage with different splits is refused */
    dec = pre;
    dec.first_layer = 15;
    CHECK_EQ_INT(kvf__plan_slice(&pre, &dec, &s, err, sizeof(err)), KVF_ERR_INCOMPATIBLE);
    CHECK_STR_CONTAINS(err, "split the layers the same way");
}

static void test_check_tp(void)
{
    char err[256];
    CHECK_EQ_INT(kvf__check_tp("decode", 4, 8, 1, err, sizeof(err)), KVF_OK);
    CHECK_EQ_INT(kvf__check_tp("decode", 4, 3, 1, err, sizeof(err)), KVF_ERR_INCOMPATIBLE);
    CHECK_STR_CONTAINS(err, "cannot be split over the decode server's tp_size=3");
    CHECK_EQ_INT(kvf__check_tp("prefill", 8, 2, 8, err, sizeof(err)), KVF_ERR_INCOMPATIBLE);
    CHECK_STR_CONTAINS(err, "registered 8 KV heads per rank");
}

KVF_TEST_MAIN(KVF_CASE(test_every_pairing_covers_heads_once), KVF_CASE(test_slices),
              KVF_CASE(test_pipeline), KVF_CASE(test_check_tp))
