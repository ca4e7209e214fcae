/*
 * A layout as HELLO carries it (wire.h, kvf_wire_layout_t): this engine's
 * encoded for its HELLO, and a peer's decoded from one into the same
 * internal form (layout.h) that the pair's plans are made from.  Pure
 * conversions: no engine, no peer, no lock.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/layout.h"
#include "wire/wire.h"

kvf_status_t kvf__layout_to_wire(const kvf_layout_int_t *l, kvf_wire_layout_t *w)
{
    uint32_t nk = l->num_kv, na = l->num_aux, ns = l->num_state, ng = l->num_groups;
    /* One block for the 64-bit arrays, kv_item_bytes first (what
     * kvf__layout_wire_free frees), one for the groups. */
    uint64_t *v = calloc(3 * nk + 2 * (na + ns) + 1, sizeof(uint64_t));
    uint32_t *gs = calloc(ng + 1, sizeof(uint32_t));
    if (v == NULL || gs == NULL) {
        free(v);
        free(gs);
        return KVF_ERR_NO_MEMORY;
    }
    uint64_t *kb = v, *ki = kb + nk, *ab = ki + nk, *ai = ab + na, *sb = ai + na,
             *si = sb + ns, *kt = si + ns;
    for (uint32_t i = 0; i < nk; i++)
        kt[i] = kvf_wire_tag(l->tags[i].layer, l->tags[i].role, l->tags[i].group);
    for (uint32_t g = 0; g < ng; g++)
        gs[g] = l->group_first[g + 1] - l->group_first[g];
    for (uint32_t i = 0; i < nk; i++) {
        kb[i] = l->kv[i].item_bytes;
        ki[i] = l->kv[i].length / l->kv[i].item_bytes;
    }
    for (uint32_t i = 0; i < na; i++) {
        ab[i] = l->aux[i].item_bytes;
        ai[i] = l->aux[i].length / l->aux[i].item_bytes;
    }
    for (uint32_t i = 0; i < ns; i++) {
        sb[i] = l->state[i].item_bytes;
        si[i] = l->state[i].length / l->state[i].item_bytes;
    }
    w->page_size = l->page_size;
    w->kv_dtype = (kvf_wire_str_t){l->kv_dtype, (uint32_t)strlen(l->kv_dtype)};
    w->attn = (uint8_t)l->attn;
    w->mem_kind = (uint8_t)l->mem_kind;
    w->num_layers = l->num_layers;
    w->first_layer = l->first_layer;
    w->heads_per_rank = l->heads_per_rank;
    w->total_heads = l->total_heads;
    w->bytes_per_head = l->bytes_per_head;
    w->kv_item_bytes = (kvf_wire_arr64_t){nk, kb, NULL};
    w->kv_items = (kvf_wire_arr64_t){nk, ki, NULL};
    w->aux_item_bytes = (kvf_wire_arr64_t){na, ab, NULL};
    w->aux_items = (kvf_wire_arr64_t){na, ai, NULL};
    w->state_item_bytes = (kvf_wire_arr64_t){ns, sb, NULL};
    w->state_items = (kvf_wire_arr64_t){ns, si, NULL};
    w->state_groups = (kvf_wire_arr32_t){ng, gs, NULL};
    w->state_types = (kvf_wire_str_t){l->state_types, (uint32_t)strlen(l->state_types)};
    w->kv_tags = (kvf_wire_arr64_t){nk, kt, NULL};
    w->kv_order = (uint8_t)l->kv_order;
    return KVF_OK;
}

void kvf__layout_wire_free(kvf_wire_layout_t *w)
{
    free((void *)w->kv_item_bytes.native);
    free((void *)w->state_groups.native);
}

kvf_status_t kvf__layout_from_wire(kvf_layout_int_t *l, const kvf_wire_layout_t *w, char *err,
                                   size_t errlen)
{
    memset(l, 0, sizeof(*l));
    if (w->kv_dtype.len >= sizeof(l->kv_dtype) || w->kv_items.count != w->kv_item_bytes.count ||
        w->aux_items.count != w->aux_item_bytes.count ||
        w->state_items.count != w->state_item_bytes.count || w->attn > KVF_ATTN_MLA ||
        w->num_layers == 0 || w->kv_items.count == 0 || w->page_size == 0 ||
        w->kv_tags.count != w->kv_items.count) {
        snprintf(err, errlen, "malformed layout descriptor in HELLO");
        return KVF_ERR_PROTOCOL;
    }
    l->page_size = w->page_size;
    memcpy(l->kv_dtype, w->kv_dtype.ptr, w->kv_dtype.len);
    l->attn = (kvf_attn_kind_t)w->attn;
    l->mem_kind = (kvf_mem_kind_t)w->mem_kind;
    l->kv_order = (kvf_kv_order_t)w->kv_order;   /* the wire checked it */
    l->num_layers = w->num_layers;
    l->first_layer = w->first_layer;
    l->heads_per_rank = w->heads_per_rank;
    l->total_heads = w->total_heads;
    l->bytes_per_head = w->bytes_per_head;
    l->num_kv = w->kv_items.count;
    l->num_aux = w->aux_items.count;
    l->num_state = w->state_items.count;
    const kvf_wire_arr64_t *bytes[3] = {&w->kv_item_bytes, &w->aux_item_bytes,
                                        &w->state_item_bytes};
    const kvf_wire_arr64_t *items[3] = {&w->kv_items, &w->aux_items, &w->state_items};
    kvf_buffer_t **dst[3] = {&l->kv, &l->aux, &l->state};
    for (int k = 0; k < 3; k++) {
        uint32_t n = bytes[k]->count;
        if (n == 0)
            continue;
        *dst[k] = calloc(n, sizeof(kvf_buffer_t));
        if (*dst[k] == NULL) {
            kvf__layout_free(l);
            return KVF_ERR_NO_MEMORY;
        }
        for (uint32_t i = 0; i < n; i++) {
            uint64_t b = kvf_wire_arr64_at(bytes[k], i), c = kvf_wire_arr64_at(items[k], i);
            if (b == 0 || b > UINT32_MAX || c > (UINT64_MAX / b)) {
                snprintf(err, errlen, "malformed buffer sizes in HELLO");
                kvf__layout_free(l);
                return KVF_ERR_PROTOCOL;
            }
            (*dst[k])[i].item_bytes = b;
            (*dst[k])[i].length = b * c;
        }
    }
    /* Tags and state groups (the wire checked that the groups hold every
     * state buffer). */
    uint32_t ng = w->state_groups.count;
    l->tags = malloc(l->num_kv * sizeof(kvf_kv_tag_t));
    l->group_first = malloc((ng + 1) * sizeof(uint32_t));
    l->state_types = malloc(w->state_types.len + 1);
    if (l->tags == NULL || l->group_first == NULL || l->state_types == NULL) {
        kvf__layout_free(l);
        return KVF_ERR_NO_MEMORY;
    }
    for (uint32_t i = 0; i < l->num_kv; i++) {
        uint64_t t = kvf_wire_arr64_at(&w->kv_tags, i);
        l->tags[i] = (kvf_kv_tag_t){(uint32_t)t, (uint32_t)(t >> 32) & 0xffff,
                                    (uint32_t)(t >> 48)};
    }
    l->num_groups = ng;
    l->group_first[0] = 0;
    for (uint32_t g = 0; g < ng; g++)
        l->group_first[g + 1] = l->group_first[g] + kvf_wire_arr32_at(&w->state_groups, g);
    memcpy(l->state_types, w->state_types.ptr, w->state_types.len);
    l->state_types[w->state_types.len] = '\0';
    return KVF_OK;
}
