/*
 * Layouts: validating what an application registers, and deciding whether
 * a prefill layout can feed a decode layout.  The messages follow SGLang's
 * ("Page size mismatch: prefill server has page_size=64, but decode server
 * has page_size=1. ...") and always say which setting to change.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/engine.h"

static kvf_status_t copy_bufs(kvf_buffer_t **dst, const kvf_buffer_t *src,
                              uint32_t n, const char *what, int need_items,
                              char *err, size_t errlen)
{
    *dst = NULL;
    if (n == 0)
        return KVF_OK;
    if (src == NULL) {
        snprintf(err, errlen, "%u %s buffers declared but the array is NULL", n, what);
        return KVF_ERR_INVALID_PARAM;
    }
    for (uint32_t i = 0; i < n; i++) {
        const kvf_buffer_t *b = &src[i];
        if (b->base == NULL || b->item_bytes == 0 || b->length < b->item_bytes ||
            (need_items && b->length % b->item_bytes != 0)) {
            snprintf(err, errlen,
                     "%s buffer %u: base %p, length %zu, item_bytes %zu: need a "
                     "non-NULL base and a length that is a positive multiple of "
                     "item_bytes", what, i, b->base, b->length, b->item_bytes);
            return KVF_ERR_INVALID_PARAM;
        }
        if (b->item_bytes > UINT32_MAX) {
            snprintf(err, errlen, "%s buffer %u: item_bytes %zu over 4 GiB", what, i,
                     b->item_bytes);
            return KVF_ERR_INVALID_PARAM;
        }
    }
    *dst = malloc(n * sizeof(**dst));
    if (*dst == NULL)
        return KVF_ERR_NO_MEMORY;
    memcpy(*dst, src, n * sizeof(**dst));
    return KVF_OK;
}

kvf_status_t kvf__layout_copy(kvf_layout_int_t *l, const kvf_layout_t *caller,
                              char *err, size_t errlen)
{
    kvf_layout_t full;
    const kvf_layout_t *src = &full;   /* never the caller's: it may be shorter */

    memset(l, 0, sizeof(*l));
    kvf_status_t st = kvf__layout_import(&full, caller, "kvf_engine_register_layout",
                                         err, errlen);
    if (st != KVF_OK)
        return st;
    if (src->page_size == 0 || src->num_layers == 0 || src->num_kv == 0) {
        snprintf(err, errlen, "page_size, num_layers and num_kv must be positive "
                 "(got %u, %u, %u)", src->page_size, src->num_layers, src->num_kv);
        return KVF_ERR_INVALID_PARAM;
    }
    if (src->num_kv % src->num_layers != 0) {
        snprintf(err, errlen, "num_kv (%u) must be a multiple of num_layers (%u): the same "
                 "number of KV buffers for every layer", src->num_kv, src->num_layers);
        return KVF_ERR_INVALID_PARAM;
    }
    if (src->kv_dtype == NULL || src->kv_dtype[0] == '\0' ||
        strlen(src->kv_dtype) >= sizeof(l->kv_dtype)) {
        snprintf(err, errlen, "kv_dtype must be a name such as \"bfloat16\"");
        return KVF_ERR_INVALID_PARAM;
    }
    if (src->attn != KVF_ATTN_MHA && src->attn != KVF_ATTN_MLA) {
        snprintf(err, errlen, "unknown attention kind %d", (int)src->attn);
        return KVF_ERR_INVALID_PARAM;
    }
    if (src->attn == KVF_ATTN_MHA &&
        (src->heads_per_rank == 0 || src->total_heads == 0 || src->bytes_per_head == 0)) {
        snprintf(err, errlen, "MHA/GQA layouts need heads_per_rank, total_heads "
                 "and bytes_per_head");
        return KVF_ERR_INVALID_PARAM;
    }
    if (src->mem_kind != KVF_MEM_HOST && src->mem_kind != KVF_MEM_CUDA) {
        snprintf(err, errlen, "unknown memory kind %d", (int)src->mem_kind);
        return KVF_ERR_INVALID_PARAM;
    }
    if (src->num_kv > 4096 || src->num_aux > 4096 || src->num_state > 4096) {
        snprintf(err, errlen, "at most 4096 buffers of each kind");
        return KVF_ERR_INVALID_PARAM;
    }
    l->page_size = src->page_size;
    strcpy(l->kv_dtype, src->kv_dtype);
    l->attn = src->attn;
    l->mem_kind = src->mem_kind;
    l->num_layers = src->num_layers;
    l->first_layer = src->first_layer;
    l->heads_per_rank = src->heads_per_rank;
    l->total_heads = src->total_heads;
    l->bytes_per_head = src->bytes_per_head;
    l->num_kv = src->num_kv;
    l->num_aux = src->num_aux;
    l->num_state = src->num_state;
    if ((st = copy_bufs(&l->kv, src->kv, src->num_kv, "KV", 1, err, errlen)) ||
        (st = copy_bufs(&l->aux, src->aux, src->num_aux, "aux", 1, err, errlen)) ||
        (st = copy_bufs(&l->state, src->state, src->num_state, "state", 1, err, errlen))) {
        kvf__layout_free(l);
        return st;
    }
    if (l->attn == KVF_ATTN_MHA) {
        uint64_t per_token = (uint64_t)l->heads_per_rank * l->bytes_per_head;
        for (uint32_t i = 0; i < l->num_kv; i++) {
            if (l->kv[i].item_bytes != per_token * l->page_size) {
                snprintf(err, errlen,
                         "KV buffer %u has %zu bytes per page, but page_size %u x "
                         "heads_per_rank %u x bytes_per_head %u = %llu", i,
                         l->kv[i].item_bytes, l->page_size, l->heads_per_rank,
                         l->bytes_per_head,
                         (unsigned long long)(per_token * l->page_size));
                kvf__layout_free(l);
                return KVF_ERR_INVALID_PARAM;
            }
        }
    }
    return KVF_OK;
}

void kvf__layout_free(kvf_layout_int_t *l)
{
    free(l->kv);
    free(l->aux);
    free(l->state);
    l->kv = l->aux = l->state = NULL;
}

static const char *attn_name(kvf_attn_kind_t a)
{
    return a == KVF_ATTN_MLA ? "MLA" : "MHA/GQA";
}

void kvf__par_fill(kvf_par_t *par, int tp_rank, int tp_size, int pp_rank, int pp_size,
                   const kvf_layout_int_t *l)
{
    par->tp_rank = tp_rank;
    par->tp_size = tp_size;
    par->pp_rank = pp_rank;
    par->pp_size = pp_size;
    par->attn = l->attn;
    par->total_heads = l->total_heads;
    par->heads_per_rank = l->heads_per_rank;
    par->num_layers = l->num_layers;
    par->first_layer = l->first_layer;
    par->num_kv = l->num_kv;
}

/*
 * The pair as a whole: same model and settings (page size, dtype,
 * attention, heads, aux and state buffers), TP sizes the heads allow, a
 * supported pipeline pairing, and, for the buffers this prefill rank writes
 * whole pages of into this decode rank, equal page sizes.
 */
kvf_status_t kvf__pair_check(const kvf_layout_int_t *pl, const kvf_par_t *pp,
                             const kvf_layout_int_t *dl, const kvf_par_t *dp,
                             char *err, size_t errlen)
{
    kvf_status_t st = kvf__layout_check(pl, dl, err, errlen);
    if (st != KVF_OK)
        return st;
    if (pl->attn == KVF_ATTN_MHA &&
        ((st = kvf__check_tp("prefill", pl->total_heads, pp->tp_size, pl->heads_per_rank,
                             err, errlen)) != KVF_OK ||
         (st = kvf__check_tp("decode", dl->total_heads, dp->tp_size, dl->heads_per_rank,
                             err, errlen)) != KVF_OK))
        return st;
    kvf_slice_t s;
    st = kvf__plan_slice(pp, dp, &s, err, errlen);
    if (st == KVF_ERR_NOT_FOUND)
        return KVF_OK;
    if (st != KVF_OK || s.sliced)
        return st;
    for (uint32_t i = 0; i < pl->num_kv; i++) {
        const kvf_buffer_t *d = &dl->kv[i + s.dst_buf0];
        if (pl->kv[i].item_bytes != d->item_bytes) {
            snprintf(err, errlen,
                     "KV bytes-per-page mismatch on buffer %u: prefill server has %zu "
                     "bytes per page, but decode server has %zu. Check --page-size, the "
                     "KV head count per rank (--tp-size) and the head dimension on both "
                     "servers.", i, pl->kv[i].item_bytes, d->item_bytes);
            return KVF_ERR_INCOMPATIBLE;
        }
    }
    return KVF_OK;
}

kvf_status_t kvf__layout_check(const kvf_layout_int_t *p, const kvf_layout_int_t *d,
                               char *err, size_t errlen)
{
    if (p->page_size != d->page_size) {
        snprintf(err, errlen,
                 "Page size mismatch: prefill server has page_size=%u, but decode "
                 "server has page_size=%u. Both servers must use the same "
                 "--page-size value.", p->page_size, d->page_size);
        return KVF_ERR_INCOMPATIBLE;
    }
    if (strcmp(p->kv_dtype, d->kv_dtype) != 0) {
        snprintf(err, errlen,
                 "KV cache dtype mismatch: prefill server has kv_cache_dtype=%s, but "
                 "decode server has kv_cache_dtype=%s. Both servers must use the same "
                 "--kv-cache-dtype value.", p->kv_dtype, d->kv_dtype);
        return KVF_ERR_INCOMPATIBLE;
    }
    if (p->attn != d->attn) {
        snprintf(err, errlen,
                 "Attention kind mismatch: prefill server uses %s, but decode server "
                 "uses %s. Both servers must serve the same model.",
                 attn_name(p->attn), attn_name(d->attn));
        return KVF_ERR_INCOMPATIBLE;
    }
    if (p->attn == KVF_ATTN_MHA &&
        (p->total_heads != d->total_heads || p->bytes_per_head != d->bytes_per_head)) {
        snprintf(err, errlen,
                 "KV head mismatch: prefill server has %u KV heads of %u bytes, but "
                 "decode server has %u KV heads of %u bytes. Both servers must serve "
                 "the same model.", p->total_heads, p->bytes_per_head, d->total_heads,
                 d->bytes_per_head);
        return KVF_ERR_INCOMPATIBLE;
    }
    if (p->num_aux != d->num_aux) {
        snprintf(err, errlen,
                 "Aux buffer mismatch: prefill server registered %u aux buffers, but "
                 "decode server registered %u.", p->num_aux, d->num_aux);
        return KVF_ERR_INCOMPATIBLE;
    }
    for (uint32_t i = 0; i < p->num_aux; i++) {
        if (p->aux[i].item_bytes != d->aux[i].item_bytes) {
            snprintf(err, errlen,
                     "Aux buffer %u mismatch: prefill server has %zu bytes per slot, "
                     "but decode server has %zu.", i, p->aux[i].item_bytes,
                     d->aux[i].item_bytes);
            return KVF_ERR_INCOMPATIBLE;
        }
    }
    if (p->num_state != d->num_state) {
        snprintf(err, errlen,
                 "State buffer mismatch: prefill server registered %u state buffers, "
                 "but decode server registered %u.", p->num_state, d->num_state);
        return KVF_ERR_INCOMPATIBLE;
    }
    for (uint32_t i = 0; i < p->num_state; i++) {
        if (p->state[i].item_bytes != d->state[i].item_bytes) {
            snprintf(err, errlen,
                     "State buffer %u mismatch: prefill server has %zu bytes per slot, "
                     "but decode server has %zu.", i, p->state[i].item_bytes,
                     d->state[i].item_bytes);
            return KVF_ERR_INCOMPATIBLE;
        }
    }
    return KVF_OK;
}
