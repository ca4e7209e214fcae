#include "core/parallel.h"

#include <stdio.h>

void kvf__rank_heads(uint32_t H, int T, int r, uint32_t *first_p, uint32_t *count_p)
{
    if ((uint32_t)T <= H) {
        uint32_t per = H / (uint32_t)T;
        *first_p = (uint32_t)r * per;
        *count_p = per;
    } else {
        *first_p = (uint32_t)r / ((uint32_t)T / H);
        *count_p = 1;
    }
}

kvf_status_t kvf__check_tp(const char *side, uint32_t H, int T, uint32_t heads_per_rank,
                           char *err, size_t errlen)
{
    uint32_t t = (uint32_t)T;
    if (T < 1 || H == 0 || (t <= H && H % t != 0) || (t > H && t % H != 0)) {
        snprintf(err, errlen, "KV heads not divisible: the model's %u KV heads cannot be "
                 "split over the %s server's tp_size=%d; use a TP size that divides %u "
                 "or is a multiple of it.", H, side, T, H);
        return KVF_ERR_INCOMPATIBLE;
    }
    uint32_t want = t <= H ? H / t : 1;
    if (heads_per_rank != want) {
        snprintf(err, errlen, "The %s server registered %u KV heads per rank, but %u KV "
                 "heads over tp_size=%d give %u per rank. Check the head count and "
                 "--tp-size of the %s server.", side, heads_per_rank, H, T, want, side);
        return KVF_ERR_INCOMPATIBLE;
    }
    return KVF_OK;
}

static int head_source(uint32_t H, int P, int d, uint32_t h)
{
    if ((uint32_t)P <= H)
        return (int)(h / (H / (uint32_t)P));
    uint32_t rep = (uint32_t)P / H;
    return (int)(h * rep + (uint32_t)d % rep);
}

int kvf__sources(kvf_attn_kind_t attn, uint32_t H, int P, int D, int d, int *ranks)
{
    if (attn == KVF_ATTN_MLA || H == 0) {
        ranks[0] = d % P;
        return 1;
    }
    uint32_t first, count;
    int n = 0;
    kvf__rank_heads(H, D, d, &first, &count);
    for (uint32_t h = first; h < first + count && n < KVF_MAX_SOURCES; h++) {
        int p = head_source(H, P, d, h);
        if (n == 0 || ranks[n - 1] != p)
            ranks[n++] = p;
    }
    return n;
}

static int feeds_someone(kvf_attn_kind_t attn, uint32_t H, int P, int D, int p)
{
    int src[KVF_MAX_SOURCES];
    for (int d = 0; d < D; d++) {
        int n = kvf__sources(attn, H, P, D, d, src);
        for (int i = 0; i < n; i++)
            if (src[i] == p)
                return 1;
    }
    return 0;
}

int kvf__idle_sources(kvf_attn_kind_t attn, uint32_t H, int P, int D, int d, int *ranks)
{
    int n = 0;
    for (int p = d; p < P && n < KVF_MAX_SOURCES; p += D)
        if (!feeds_someone(attn, H, P, D, p))
            ranks[n++] = p;
    return n;
}

kvf_status_t kvf__check_pp(const kvf_par_t *pre, const kvf_par_t *dec, char *err,
                           size_t errlen)
{
    if (dec->pp_size == pre->pp_size) {
        if (pre->first_layer != dec->first_layer || pre->num_layers != dec->num_layers) {
            snprintf(err, errlen, "Pipeline stage mismatch: prefill stage %d holds layers "
                     "%u..%u, but decode stage %d holds layers %u..%u. Both servers must "
                     "split the layers the same way.", pre->pp_rank, pre->first_layer,
                     pre->first_layer + pre->num_layers - 1, dec->pp_rank,
                     dec->first_layer, dec->first_layer + dec->num_layers - 1);
            return KVF_ERR_INCOMPATIBLE;
        }
        return KVF_OK;
    }
    if (dec->pp_size != 1) {
        snprintf(err, errlen, "Pipeline parallel mismatch: prefill server has pp_size=%d, "
                 "but decode server has pp_size=%d. The decode server must use the same "
                 "--pp-size as the prefill server, or 1.", pre->pp_size, dec->pp_size);
        return KVF_ERR_INCOMPATIBLE;
    }
    if (pre->first_layer + pre->num_layers > dec->num_layers) {
        snprintf(err, errlen, "Layer count mismatch: prefill stage %d holds layers %u..%u, "
                 "but the decode server has only %u layers. Both servers must serve the "
                 "same model.", pre->pp_rank, pre->first_layer,
                 pre->first_layer + pre->num_layers - 1, dec->num_layers);
        return KVF_ERR_INCOMPATIBLE;
    }
    return KVF_OK;
}

kvf_status_t kvf__plan_slice(const kvf_par_t *pre, const kvf_par_t *dec,
                             kvf_slice_t *s, char *err, size_t errlen)
{
    kvf_status_t st = kvf__check_pp(pre, dec, err, errlen);
    if (st != KVF_OK)
        return st;
    s->sliced = 0;
    s->nheads = s->src_head = s->dst_head = 0;

    int src[KVF_MAX_SOURCES];
    int n = kvf__sources(pre->attn, dec->total_heads, pre->tp_size, dec->tp_size,
                         dec->tp_rank, src);
    int found = 0;
    for (int i = 0; i < n; i++)
        found |= src[i] == pre->tp_rank;
    if (!found)
        return KVF_ERR_NOT_FOUND;
    if (pre->attn == KVF_ATTN_MLA)
        return KVF_OK;

    uint32_t H = dec->total_heads, pf, pc, df, dc, lo = UINT32_MAX, hi = 0;
    kvf__rank_heads(H, pre->tp_size, pre->tp_rank, &pf, &pc);
    kvf__rank_heads(H, dec->tp_size, dec->tp_rank, &df, &dc);
    for (uint32_t h = df; h < df + dc; h++) {
        if (head_source(H, pre->tp_size, dec->tp_rank, h) != pre->tp_rank)
            continue;
        lo = h < lo ? h : lo;
        hi = h + 1 > hi ? h + 1 : hi;
    }
    if (pc == dc && lo == df && hi == df + dc)
        return KVF_OK;   /* the decode rank's heads are exactly the prefill rank's */
    s->sliced = 1;
    s->nheads = hi - lo;
    s->src_head = lo - pf;
    s->dst_head = lo - df;
    return KVF_OK;
}

const char *kvf__rank_name(kvf_role_t role, int tp_rank, int pp_rank, int pp_size,
                           int dp_rank, int dp_size, char *buf, size_t len)
{
    int n = snprintf(buf, len, "%s rank %d", kvf_role_name(role), tp_rank);
    if (pp_size > 1 && n >= 0 && (size_t)n < len)
        n += snprintf(buf + n, len - (size_t)n, " of stage %d", pp_rank);
    if (dp_size > 1 && n >= 0 && (size_t)n < len)
        snprintf(buf + n, len - (size_t)n, " of DP group %d", dp_rank);
    return buf;
}
