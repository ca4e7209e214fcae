/*
 * Layouts: validating what an application registers, and deciding whether
 * a prefill layout can feed a decode layout.  The messages follow SGLang's
 * ("Page size mismatch: prefill server has page_size=64, but decode server
 * has page_size=1. ...") and always say which setting to change.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/layout.h"
#include "core/sized.h"
#include "util/cudrv.h"

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

static int tag_cmp(const kvf_kv_tag_t *a, const kvf_kv_tag_t *b)
{
    if (a->group != b->group)
        return a->group < b->group ? -1 : 1;
    if (a->layer != b->layer)
        return a->layer < b->layer ? -1 : 1;
    return a->role < b->role ? -1 : a->role > b->role;
}

/* A buffer's tag with its index, to sort (duplicates, lookups). */
typedef struct tagged {
    kvf_kv_tag_t t;
    uint32_t     i;
} tagged_t;

static int by_tag(const void *a, const void *b)
{
    return tag_cmp(&((const tagged_t *)a)->t, &((const tagged_t *)b)->t);
}

static tagged_t *sorted_by_tag(const kvf_kv_tag_t *tags, uint32_t n)
{
    tagged_t *v = malloc((n ? n : 1) * sizeof(tagged_t));
    if (v == NULL)
        return NULL;
    for (uint32_t i = 0; i < n; i++)
        v[i] = (tagged_t){tags[i], i};
    qsort(v, n, sizeof(tagged_t), by_tag);
    return v;
}

static const char *role_name(uint32_t role, char *buf, size_t len)
{
    static const char *names[] = {"K", "V", "KV"};
    if (role < 3)
        return names[role];
    snprintf(buf, len, "role %u", role);
    return buf;
}

/* "layer 3 V" or "layer 0 K of group 1" */
const char *kvf__tag_name(const kvf_kv_tag_t *t, char *buf, size_t len)
{
    char rb[24];
    const char *r = role_name(t->role, rb, sizeof(rb));
    if (t->group == 0)
        snprintf(buf, len, "layer %u %s", t->layer, r);
    else
        snprintf(buf, len, "layer %u %s of group %u", t->layer, r, t->group);
    return buf;
}

/* The layer slots of l's tags (layout.h), from its buffers sorted by
 * tag: group, then layer, then role. */
static kvf_status_t make_slots(kvf_layout_int_t *l)
{
    tagged_t *v = sorted_by_tag(l->tags, l->num_kv);
    l->slots = malloc((l->num_kv ? l->num_kv : 1) * sizeof(kvf_kv_tag_t));
    l->kv_slot = malloc((l->num_kv ? l->num_kv : 1) * sizeof(uint32_t));
    if (v == NULL || l->slots == NULL || l->kv_slot == NULL) {
        free(v);
        return KVF_ERR_NO_MEMORY;
    }
    l->num_slots = 0;
    for (uint32_t k = 0; k < l->num_kv; k++) {
        const kvf_kv_tag_t *t = &v[k].t;
        if (l->num_slots == 0 || l->slots[l->num_slots - 1].group != t->group ||
            l->slots[l->num_slots - 1].layer != t->layer)
            l->slots[l->num_slots++] = (kvf_kv_tag_t){.layer = t->layer, .group = t->group};
        l->kv_slot[v[k].i] = l->num_slots - 1;
    }
    free(v);
    return KVF_OK;
}

uint32_t kvf__slot_of(const kvf_layout_int_t *l, uint32_t group, uint32_t layer)
{
    kvf_kv_tag_t want = {.layer = layer, .group = group};
    uint32_t lo = 0, hi = l->num_slots;
    while (lo < hi) {
        uint32_t mid = lo + (hi - lo) / 2;
        if (tag_cmp(&l->slots[mid], &want) < 0)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo < l->num_slots && tag_cmp(&l->slots[lo], &want) == 0 ? lo : UINT32_MAX;
}

/* The tags: the caller's, checked, or those of the 0.1.0 order. */
static kvf_status_t copy_tags(kvf_layout_int_t *l, const kvf_kv_tag_t *tags, char *err,
                              size_t errlen)
{
    l->tags = malloc(l->num_kv * sizeof(kvf_kv_tag_t));
    if (l->tags == NULL)
        return KVF_ERR_NO_MEMORY;
    if (tags == NULL) {
        uint32_t per_layer = l->num_kv / l->num_layers;
        for (uint32_t i = 0; i < l->num_kv; i++)
            l->tags[i] = (kvf_kv_tag_t){
                .layer = l->first_layer + i / per_layer,
                .role = per_layer == 1 ? KVF_KV_KV : i % per_layer, .group = 0};
        return KVF_OK;
    }
    memcpy(l->tags, tags, l->num_kv * sizeof(kvf_kv_tag_t));
    for (uint32_t i = 0; i < l->num_kv; i++) {
        if (tags[i].role > 0xffff || tags[i].group > 0xffff) {
            snprintf(err, errlen, "KV buffer %u: role %u, group %u: both must be below "
                     "65536", i, tags[i].role, tags[i].group);
            return KVF_ERR_INVALID_PARAM;
        }
    }
    tagged_t *v = sorted_by_tag(l->tags, l->num_kv);
    if (v == NULL)
        return KVF_ERR_NO_MEMORY;
    for (uint32_t k = 1; k < l->num_kv; k++) {
        if (tag_cmp(&v[k - 1].t, &v[k].t) == 0) {
            char tb[64];
            uint32_t a = v[k - 1].i, b = v[k].i;
            snprintf(err, errlen, "KV buffers %u and %u have the same tag (%s): each "
                     "buffer must hold a different layer, role or group",
                     a < b ? a : b, a < b ? b : a, kvf__tag_name(&v[k].t, tb, sizeof(tb)));
            free(v);
            return KVF_ERR_INVALID_PARAM;
        }
    }
    free(v);
    return KVF_OK;
}

/* Flatten the state groups (or the plain state buffers, a group each). */
static kvf_status_t copy_groups(kvf_layout_int_t *l, const kvf_layout_t *src, char *err,
                                size_t errlen)
{
    uint32_t ng = src->num_state_groups ? src->num_state_groups : src->num_state;
    size_t types_len = 1;

    if (src->num_state_groups && src->num_state) {
        snprintf(err, errlen, "give state buffers either as state groups or as plain "
                 "state buffers (num_state), not both");
        return KVF_ERR_INVALID_PARAM;
    }
    if (src->num_state_groups && src->state_groups == NULL) {
        snprintf(err, errlen, "%u state groups declared but the array is NULL",
                 src->num_state_groups);
        return KVF_ERR_INVALID_PARAM;
    }
    uint64_t total = src->num_state;
    for (uint32_t g = 0; g < src->num_state_groups; g++) {
        const kvf_state_group_t *sg = &src->state_groups[g];
        if (sg->type == NULL || sg->type[0] == '\0' || strlen(sg->type) > 63 ||
            strchr(sg->type, ',') != NULL || sg->num_buffers == 0 || sg->buffers == NULL) {
            snprintf(err, errlen, "state group %u: needs a type name (1..63 characters, "
                     "no ',') and at least one buffer", g);
            return KVF_ERR_INVALID_PARAM;
        }
        total += sg->num_buffers;
        types_len += strlen(sg->type) + 1;
    }
    if (total > 4096) {
        snprintf(err, errlen, "at most 4096 state buffers");
        return KVF_ERR_INVALID_PARAM;
    }
    l->num_state = (uint32_t)total;
    l->num_groups = ng;
    l->group_first = malloc((ng + 1) * sizeof(uint32_t));
    l->state_types = malloc(types_len + ng);
    if (l->group_first == NULL || l->state_types == NULL)
        return KVF_ERR_NO_MEMORY;
    l->state_types[0] = '\0';
    if (src->num_state_groups == 0) {
        for (uint32_t g = 0; g <= ng; g++)
            l->group_first[g] = g;
        memset(l->state_types, ',', ng ? ng - 1 : 0);
        l->state_types[ng ? ng - 1 : 0] = '\0';
        return copy_bufs(&l->state, src->state, src->num_state, "state", 1, err, errlen);
    }
    if (total > 0 && (l->state = malloc(total * sizeof(kvf_buffer_t))) == NULL)
        return KVF_ERR_NO_MEMORY;
    uint32_t k = 0;
    for (uint32_t g = 0; g < ng; g++) {
        const kvf_state_group_t *sg = &src->state_groups[g];
        kvf_buffer_t *part;
        char what[96];
        snprintf(what, sizeof(what), "state group %u (%s)", g, sg->type);
        kvf_status_t st = copy_bufs(&part, sg->buffers, sg->num_buffers, what, 1, err, errlen);
        if (st != KVF_OK)
            return st;
        memcpy(l->state + k, part, sg->num_buffers * sizeof(kvf_buffer_t));
        free(part);
        l->group_first[g] = k;
        k += sg->num_buffers;
        if (g > 0)
            strcat(l->state_types, ",");
        strcat(l->state_types, sg->type);
    }
    l->group_first[ng] = k;
    return KVF_OK;
}

void kvf__group_type(const kvf_layout_int_t *l, uint32_t g, char *buf, size_t len)
{
    const char *p = l->state_types ? l->state_types : "";
    for (uint32_t i = 0; i < g && p != NULL; i++)
        if ((p = strchr(p, ',')) != NULL)
            p++;
    size_t n = p == NULL ? 0 : strcspn(p, ",");
    snprintf(buf, len, "%.*s", (int)n, p ? p : "");
}

/* Each buffer holds whole tokens of heads_per_rank heads; group 0's of
 * bytes_per_head bytes each. */
static kvf_status_t check_heads(const kvf_layout_int_t *l, char *err, size_t errlen)
{
    uint64_t per_token = (uint64_t)l->heads_per_rank * l->bytes_per_head;
    for (uint32_t i = 0; i < l->num_kv; i++) {
        uint64_t ib = l->kv[i].item_bytes;
        if (l->tags[i].group == 0 ? ib != per_token * l->page_size
                                  : ib % ((uint64_t)l->heads_per_rank * l->page_size) != 0) {
            char tb[64];
            snprintf(err, errlen,
                     "KV buffer %u (%s) has %llu bytes per page, but page_size %u x "
                     "heads_per_rank %u x bytes_per_head %u = %llu%s", i,
                     kvf__tag_name(&l->tags[i], tb, sizeof(tb)), (unsigned long long)ib,
                     l->page_size, l->heads_per_rank, l->bytes_per_head,
                     (unsigned long long)(per_token * l->page_size),
                     l->tags[i].group == 0 ? ""
                         : " (another group may have another head size, but the same "
                           "heads)");
            return KVF_ERR_INVALID_PARAM;
        }
    }
    return KVF_OK;
}

/* The caller's shape: sizes, dtype, attention kind and heads, before any
 * of it is copied.  dtype_cap is the room kvf_layout_int_t has for the name. */
static kvf_status_t check_shape(const kvf_layout_t *src, int may_omit_heads,
                                size_t dtype_cap, char *err, size_t errlen)
{
    if (src->page_size == 0 || src->num_layers == 0 || src->num_kv == 0) {
        snprintf(err, errlen, "page_size, num_layers and num_kv must be positive "
                 "(got %u, %u, %u)", src->page_size, src->num_layers, src->num_kv);
        return KVF_ERR_INVALID_PARAM;
    }
    if (src->kv_tags == NULL && src->num_kv % src->num_layers != 0) {
        snprintf(err, errlen, "num_kv (%u) must be a multiple of num_layers (%u): the same "
                 "number of KV buffers for every layer", src->num_kv, src->num_layers);
        return KVF_ERR_INVALID_PARAM;
    }
    if (src->kv_dtype == NULL || src->kv_dtype[0] == '\0' ||
        strlen(src->kv_dtype) >= dtype_cap) {
        snprintf(err, errlen, "kv_dtype must be a name such as \"bfloat16\"");
        return KVF_ERR_INVALID_PARAM;
    }
    if (src->attn != KVF_ATTN_MHA && src->attn != KVF_ATTN_MLA) {
        snprintf(err, errlen, "unknown attention kind %d", (int)src->attn);
        return KVF_ERR_INVALID_PARAM;
    }
    int omitted = src->heads_per_rank == 0 && src->total_heads == 0 &&
                  src->bytes_per_head == 0;
    if (src->attn == KVF_ATTN_MHA && !(may_omit_heads && omitted) &&
        (src->heads_per_rank == 0 || src->total_heads == 0 || src->bytes_per_head == 0)) {
        snprintf(err, errlen, "MHA/GQA layouts need heads_per_rank, total_heads "
                 "and bytes_per_head%s", may_omit_heads ? " (or all three 0 on a decode "
                 "engine: taken from the prefill)" : "");
        return KVF_ERR_INVALID_PARAM;
    }
    return KVF_OK;
}

/* The enumerations and counts: each family's memory kind, the device, the
 * page order, and the bound on how many buffers of each kind. */
static kvf_status_t check_kinds(const kvf_layout_t *src, char *err, size_t errlen)
{
    const kvf_mem_kind_t kinds[3] = {src->mem_kind, src->aux_mem_kind, src->state_mem_kind};
    for (int f = 0; f < 3; f++) {
        if (kinds[f] != KVF_MEM_HOST && kinds[f] != KVF_MEM_CUDA) {
            snprintf(err, errlen, "unknown memory kind %d for the %s buffers", (int)kinds[f],
                     kvf__family_name(f));
            return KVF_ERR_INVALID_PARAM;
        }
    }
    if (src->cuda_device < 0) {
        snprintf(err, errlen, "cuda_device %d: a CUDA device ordinal is 0 or more",
                 src->cuda_device);
        return KVF_ERR_INVALID_PARAM;
    }
    if (src->kv_order != KVF_KV_NHD && src->kv_order != KVF_KV_HND) {
        snprintf(err, errlen, "unknown kv_order %d: KVF_KV_NHD (0, token-major pages) or "
                 "KVF_KV_HND (1, head-major pages)", (int)src->kv_order);
        return KVF_ERR_INVALID_PARAM;
    }
    if (src->num_kv > 4096 || src->num_aux > 4096 || src->num_state > 4096 ||
        src->num_state_groups > 4096) {
        snprintf(err, errlen, "at most 4096 buffers of each kind");
        return KVF_ERR_INVALID_PARAM;
    }
    return KVF_OK;
}

/* The scalar fields, once checked; the buffers follow (copy_bufs...). */
static void copy_scalars(kvf_layout_int_t *l, const kvf_layout_t *src)
{
    l->page_size = src->page_size;
    strcpy(l->kv_dtype, src->kv_dtype);
    l->attn = src->attn;
    l->mem_kind = src->mem_kind;
    l->aux_mem = src->aux_mem_kind;
    l->state_mem = src->state_mem_kind;
    l->cuda_device = src->cuda_device;
    l->kv_order = src->kv_order;
    l->num_layers = src->num_layers;
    l->first_layer = src->first_layer;
    l->heads_per_rank = src->heads_per_rank;
    l->total_heads = src->total_heads;
    l->bytes_per_head = src->bytes_per_head;
    l->num_kv = src->num_kv;
    l->num_aux = src->num_aux;
}

kvf_status_t kvf__layout_copy(kvf_layout_int_t *l, const kvf_layout_t *caller,
                              int may_omit_heads, char *err, size_t errlen)
{
    kvf_layout_t full;
    const kvf_layout_t *src = &full;   /* never the caller's: it may be shorter */

    memset(l, 0, sizeof(*l));
    kvf_status_t st = kvf__layout_import(&full, caller, "kvf_engine_register_layout",
                                         err, errlen);
    if (st != KVF_OK)
        return st;
    if ((st = check_shape(src, may_omit_heads, sizeof(l->kv_dtype), err, errlen)) != KVF_OK)
        return st;
    /* A caller from before the per-family kinds declared one for all. */
    if (caller->size < KVF_FIELD_END(kvf_layout_t, aux_mem_kind))
        full.aux_mem_kind = full.mem_kind;
    if (caller->size < KVF_FIELD_END(kvf_layout_t, state_mem_kind))
        full.state_mem_kind = full.mem_kind;
    if ((st = check_kinds(src, err, errlen)) != KVF_OK)
        return st;
    copy_scalars(l, src);
    if ((st = copy_bufs(&l->kv, src->kv, src->num_kv, "KV", 1, err, errlen)) ||
        (st = copy_bufs(&l->aux, src->aux, src->num_aux, "aux", 1, err, errlen)) ||
        (st = copy_groups(l, src, err, errlen)) ||
        (st = copy_tags(l, src->kv_tags, err, errlen)) || (st = make_slots(l)) ||
        (l->attn == KVF_ATTN_MHA && l->heads_per_rank != 0 &&
         (st = check_heads(l, err, errlen)))) {
        kvf__layout_free(l);
        return st;
    }
    for (uint32_t i = 0; l->heads_per_rank == 0 && i < l->num_kv; i++) {
        if (l->kv[i].item_bytes % l->page_size != 0) {
            snprintf(err, errlen, "KV buffer %u has %zu bytes per page, not a multiple of "
                     "page_size %u", i, l->kv[i].item_bytes, l->page_size);
            kvf__layout_free(l);
            return KVF_ERR_INVALID_PARAM;
        }
    }
    return KVF_OK;
}

const char *kvf__family_name(int family)
{
    static const char *names[] = {"KV", "aux", "state"};
    return family >= 0 && family < 3 ? names[family] : "?";
}

kvf_mem_kind_t kvf__family_mem(const kvf_layout_int_t *l, int family)
{
    return family == KVF_FAMILY_KV ? l->mem_kind : family == KVF_FAMILY_AUX ? l->aux_mem
                                                                           : l->state_mem;
}

int kvf__layout_on_device(const kvf_layout_int_t *l)
{
    return l->mem_kind == KVF_MEM_CUDA || l->aux_mem == KVF_MEM_CUDA ||
           l->state_mem == KVF_MEM_CUDA;
}

/* "KV buffer 3 (layer 1 V)", "aux buffer 0", "state buffer 2 (mamba)" */
static const char *buffer_name(const kvf_layout_int_t *l, int family, uint32_t i, char *buf,
                               size_t len)
{
    char tb[64] = "";
    if (family == KVF_FAMILY_KV) {
        snprintf(buf, len, "KV buffer %u (%s)", i, kvf__tag_name(&l->tags[i], tb, sizeof(tb)));
        return buf;
    }
    if (family == KVF_FAMILY_STATE)
        kvf__group_type(l, kvf__group_of(l, i), tb, sizeof(tb));
    snprintf(buf, len, "%s buffer %u%s%s%s", kvf__family_name(family), i, tb[0] ? " (" : "",
             tb, tb[0] ? ")" : "");
    return buf;
}

/*
 * Is every buffer what its family declares?  A CUDA-declared buffer needs
 * the driver to say it is device memory of cuda_device; a host-declared
 * one is asked about only when a driver is installed (a device pointer
 * declared as host would be dereferenced by the host paths).
 */
kvf_status_t kvf__layout_check_memory(const kvf_layout_int_t *l, char *err, size_t errlen)
{
    const kvf_buffer_t *bufs[3] = {l->kv, l->aux, l->state};
    const uint32_t n[3] = {l->num_kv, l->num_aux, l->num_state};
    char name[128], why[256];
    int any_cuda = l->mem_kind == KVF_MEM_CUDA || l->aux_mem == KVF_MEM_CUDA ||
                   l->state_mem == KVF_MEM_CUDA;
    int driver = kvf_cudrv(why, sizeof(why)) != NULL;

    if (any_cuda && !driver) {
        snprintf(err, errlen, "the layout declares CUDA device memory, but there is no "
                 "usable CUDA driver in this process (%s): run where the NVIDIA driver is "
                 "installed, or register host memory", why);
        return KVF_ERR_UNSUPPORTED;
    }
    for (int f = 0; driver && f < 3; f++) {
        kvf_mem_kind_t want = kvf__family_mem(l, f);
        for (uint32_t i = 0; i < n[f]; i++) {
            const kvf_buffer_t *b = &bufs[f][i];
            kvf_ptr_kind_t kind;
            int ord;
            if (kvf_cudrv_ptr_kind(b->base, b->length, &kind, &ord, why, sizeof(why)) !=
                KVF_OK) {
                snprintf(err, errlen, "cannot tell what memory %s is: %s",
                         buffer_name(l, f, i, name, sizeof(name)), why);
                return KVF_ERR_UNSUPPORTED;
            }
            buffer_name(l, f, i, name, sizeof(name));
            if (kind == KVF_PTR_MIXED) {
                snprintf(err, errlen, "%s at %p (%zu bytes) spans different memory: its "
                         "first and last bytes are not in one allocation", name, b->base,
                         b->length);
                return KVF_ERR_INVALID_PARAM;
            }
            if (want == KVF_MEM_CUDA && kind == KVF_PTR_HOST) {
                snprintf(err, errlen, "%s at %p is host memory, but the layout says CUDA "
                         "device %d", name, b->base, l->cuda_device);
                return KVF_ERR_INVALID_PARAM;
            }
            if (want == KVF_MEM_CUDA && ord != l->cuda_device) {
                snprintf(err, errlen, "%s at %p is memory of CUDA device %d, but the "
                         "layout says CUDA device %d (cuda_device)", name, b->base, ord,
                         l->cuda_device);
                return KVF_ERR_INVALID_PARAM;
            }
            if (want == KVF_MEM_HOST && kind == KVF_PTR_DEVICE) {
                snprintf(err, errlen, "%s at %p is memory of CUDA device %d, but the "
                         "layout says host memory: declare its family KVF_MEM_CUDA "
                         "(%s) and cuda_device %d", name, b->base, ord,
                         f == KVF_FAMILY_KV ? "mem_kind" : f == KVF_FAMILY_AUX
                             ? "aux_mem_kind" : "state_mem_kind", ord);
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
    free(l->tags);
    free(l->slots);
    free(l->kv_slot);
    free(l->group_first);
    free(l->state_types);
    l->kv = l->aux = l->state = NULL;
    l->tags = NULL;
    l->slots = NULL;
    l->kv_slot = NULL;
    l->group_first = NULL;
    l->state_types = NULL;
}

kvf_status_t kvf__layout_adopt_heads(kvf_layout_int_t *l, int tp_size,
                                     const kvf_layout_int_t *from, char *err,
                                     size_t errlen)
{
    if (l->attn != KVF_ATTN_MHA || l->heads_per_rank != 0 || from->attn != KVF_ATTN_MHA ||
        from->total_heads == 0)
        return KVF_OK;
    kvf_layout_int_t t = *l;
    t.total_heads = from->total_heads;
    t.bytes_per_head = from->bytes_per_head;
    t.heads_per_rank = (uint32_t)tp_size > t.total_heads ? 1 : t.total_heads / (uint32_t)tp_size;
    char why[KVF_REASON_MAX - 160];
    if (check_heads(&t, why, sizeof(why)) != KVF_OK) {
        snprintf(err, errlen, "KV head mismatch: the prefill server has %u KV heads of %u "
                 "bytes, which makes %u per decode rank at TP size %d, but the decode "
                 "buffers do not hold that: %s", t.total_heads, t.bytes_per_head,
                 t.heads_per_rank, tp_size, why);
        return KVF_ERR_INCOMPATIBLE;
    }
    l->total_heads = t.total_heads;
    l->bytes_per_head = t.bytes_per_head;
    l->heads_per_rank = t.heads_per_rank;
    return KVF_OK;
}

kvf_status_t kvf__kv_map(const kvf_layout_int_t *pl, const kvf_layout_int_t *dl,
                         uint32_t *dst_of, char *err, size_t errlen)
{
    tagged_t *v = sorted_by_tag(dl->tags, dl->num_kv);
    if (v == NULL)
        return KVF_ERR_NO_MEMORY;
    for (uint32_t i = 0; i < pl->num_kv; i++) {
        size_t lo = 0, hi = dl->num_kv;
        while (lo < hi) {
            size_t mid = (lo + hi) / 2;
            if (tag_cmp(&v[mid].t, &pl->tags[i]) < 0)
                lo = mid + 1;
            else
                hi = mid;
        }
        if (lo == dl->num_kv || tag_cmp(&v[lo].t, &pl->tags[i]) != 0) {
            char tb[64];
            snprintf(err, errlen, "KV buffer mismatch: prefill KV buffer %u holds %s, "
                     "which no decode KV buffer holds. Both servers must serve the same "
                     "model (and the same draft model, if any).", i,
                     kvf__tag_name(&pl->tags[i], tb, sizeof(tb)));
            free(v);
            return KVF_ERR_INCOMPATIBLE;
        }
        dst_of[i] = v[lo].i;
    }
    free(v);
    return KVF_OK;
}

static const char *attn_name(kvf_attn_kind_t a)
{
    return a == KVF_ATTN_MLA ? "MLA" : "MHA/GQA";
}

static const char *order_name(kvf_kv_order_t o)
{
    return o == KVF_KV_HND ? "HND (head-major)" : "NHD (token-major)";
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
                             uint32_t *dst_of, char *err, size_t errlen)
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
    if (st == KVF_ERR_NOT_FOUND)     /* it feeds nothing here: no sizes to compare */
        return kvf__kv_map(pl, dl, dst_of, err, errlen);
    if (st != KVF_OK)
        return st;
    st = kvf__kv_map(pl, dl, dst_of, err, errlen);
    for (uint32_t i = 0; st == KVF_OK && i < pl->num_kv; i++) {
        const kvf_buffer_t *d = &dl->kv[dst_of[i]];
        /* Whole pages must be the same size; head slices, the same heads. */
        int same = s.sliced ? kvf__head_bytes(pl, i) == kvf__head_bytes(dl, dst_of[i])
                            : pl->kv[i].item_bytes == d->item_bytes;
        if (!same) {
            char tb[64];
            snprintf(err, errlen,
                     "KV bytes-per-page mismatch on %s: prefill server has %zu "
                     "bytes per page, but decode server has %zu. Check --page-size, the "
                     "KV head count per rank (--tp-size) and the head dimension on both "
                     "servers.", kvf__tag_name(&pl->tags[i], tb, sizeof(tb)),
                     pl->kv[i].item_bytes, d->item_bytes);
            st = KVF_ERR_INCOMPATIBLE;
        }
    }
    /* Stage to stage, the prefill's buffers must be all of the decode's:
     * a decode buffer no prefill buffer goes to would stay unwritten (a
     * draft model only one side has). */
    if (st == KVF_OK && pp->pp_size == dp->pp_size) {
        uint8_t *hit = calloc(dl->num_kv ? dl->num_kv : 1, 1);
        if (hit == NULL)
            st = KVF_ERR_NO_MEMORY;
        for (uint32_t i = 0; hit != NULL && i < pl->num_kv; i++)
            hit[dst_of[i]] = 1;
        for (uint32_t j = 0; hit != NULL && st == KVF_OK && j < dl->num_kv; j++) {
            if (!hit[j]) {
                char tb[64];
                snprintf(err, errlen, "KV buffer mismatch: decode KV buffer %u holds %s, "
                         "which no prefill KV buffer holds. Both servers must serve the "
                         "same model (and the same draft model, if any).", j,
                         kvf__tag_name(&dl->tags[j], tb, sizeof(tb)));
                st = KVF_ERR_INCOMPATIBLE;
            }
        }
        free(hit);
    }
    return st;
}

/* What every page must agree on: size, dtype, attention kind, heads and
 * page order. */
static kvf_status_t check_pages(const kvf_layout_int_t *p, const kvf_layout_int_t *d,
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
    /* MLA pages are one latent vector per token, never cut by heads: the
     * order means nothing there. */
    if (p->attn == KVF_ATTN_MHA && p->kv_order != d->kv_order) {
        snprintf(err, errlen,
                 "KV page order mismatch: prefill KV pages are %s, but decode KV pages "
                 "are %s. kvferry does not transpose pages: register both servers with "
                 "the same kv_order.", order_name(p->kv_order), order_name(d->kv_order));
        return KVF_ERR_INCOMPATIBLE;
    }
    return KVF_OK;
}

/* The aux buffers: as many, each slot the same size. */
static kvf_status_t check_aux(const kvf_layout_int_t *p, const kvf_layout_int_t *d,
                              char *err, size_t errlen)
{
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
    return KVF_OK;
}

/* The state pools: the same types in the same groups, each group as many
 * buffers, each slot the same size. */
static kvf_status_t check_state(const kvf_layout_int_t *p, const kvf_layout_int_t *d,
                                char *err, size_t errlen)
{
    if (strcmp(p->state_types, d->state_types) != 0 || p->num_groups != d->num_groups) {
        snprintf(err, errlen,
                 "State type mismatch: prefill server registered state [%s] (%u groups), "
                 "but decode server registered [%s] (%u groups). Both servers must serve "
                 "the same model with the same state pools.", p->state_types,
                 p->num_groups, d->state_types, d->num_groups);
        return KVF_ERR_INCOMPATIBLE;
    }
    for (uint32_t g = 0; g < p->num_groups; g++) {
        if (p->group_first[g + 1] != d->group_first[g + 1]) {
            char t[64];
            kvf__group_type(p, g, t, sizeof(t));
            snprintf(err, errlen,
                     "State buffer mismatch: prefill server registered %u buffers of "
                     "state group %u (%s), but decode server registered %u.",
                     p->group_first[g + 1] - p->group_first[g], g, t,
                     d->group_first[g + 1] - d->group_first[g]);
            return KVF_ERR_INCOMPATIBLE;
        }
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

kvf_status_t kvf__layout_check(const kvf_layout_int_t *p, const kvf_layout_int_t *d,
                               char *err, size_t errlen)
{
    kvf_status_t st;
    if ((st = check_pages(p, d, err, errlen)) != KVF_OK ||
        (st = check_aux(p, d, err, errlen)) != KVF_OK)
        return st;
    return check_state(p, d, err, errlen);
}
