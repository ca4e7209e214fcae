/*
 * Model and dtype tables, and the per-rank head split.
 *
 * The split follows SGLang: with tp <= kv_heads each rank holds
 * kv_heads / tp consecutive heads; with tp > kv_heads (GQA replication)
 * each rank holds one head, rank r head r * kv_heads / tp, so groups of
 * tp / kv_heads ranks share a head.  MLA ranks all hold the full latent.
 */
#include "models.h"

#include <string.h>
#include <strings.h>

static const kvt_model_t kvt_models[] = {
    { "llama3-8b",   KVF_ATTN_MHA, 32, 8, 128, "32 layers, 8 KV heads x 128 (GQA), K and V buffers" },
    { "qwen2.5-7b",  KVF_ATTN_MHA, 28, 4, 128, "28 layers, 4 KV heads x 128 (GQA), K and V buffers" },
    { "deepseek-v3", KVF_ATTN_MLA, 61, 1, 576, "61 layers, MLA latent of 576 values, one buffer per layer" },
    { "tiny",        KVF_ATTN_MHA,  2, 2,  16, "2 layers, 2 KV heads x 16: for fast tests" },
};

static const kvt_dtype_t kvt_dtypes[] = {
    { "bfloat16", 2 },
    { "float16",  2 },
    { "float32",  4 },
    { "fp8_e4m3", 1 },
};

#define KVT_COUNT(a) (sizeof(a) / sizeof((a)[0]))

const kvt_model_t *kvt_model_find(const char *name)
{
    for (size_t i = 0; i < KVT_COUNT(kvt_models); i++)
        if (strcmp(kvt_models[i].name, name) == 0)
            return &kvt_models[i];
    return NULL;
}

const kvt_dtype_t *kvt_dtype_find(const char *name)
{
    for (size_t i = 0; i < KVT_COUNT(kvt_dtypes); i++)
        if (strcmp(kvt_dtypes[i].name, name) == 0)
            return &kvt_dtypes[i];
    return NULL;
}

void kvt_models_print(FILE *out)
{
    fprintf(out, "Models (--model):\n");
    for (size_t i = 0; i < KVT_COUNT(kvt_models); i++)
        fprintf(out, "  %-12s %s\n", kvt_models[i].name, kvt_models[i].note);
    fprintf(out, "KV dtypes (--kv-dtype):");
    for (size_t i = 0; i < KVT_COUNT(kvt_dtypes); i++)
        fprintf(out, " %s (%u B)", kvt_dtypes[i].name, kvt_dtypes[i].bytes);
    fprintf(out, "\n");
}

int kvt_tp_check(const kvt_model_t *model, uint32_t tp_size,
                 const char *option, char *err, size_t errlen)
{
    if (tp_size == 0) {
        snprintf(err, errlen, "%s must be at least 1", option);
        return -1;
    }
    if (model->attn == KVF_ATTN_MLA)
        return 0;               /* every rank holds the whole latent */
    uint32_t h = model->kv_heads;
    if (tp_size <= h ? h % tp_size != 0 : tp_size % h != 0) {
        snprintf(err, errlen,
                 "%s %u cannot split the %u KV heads of %s: use a TP size "
                 "that divides %u or is a multiple of it",
                 option, tp_size, h, model->name, h);
        return -1;
    }
    return 0;
}

int kvt_kv_order_find(const char *name, kvf_kv_order_t *order_p)
{
    if (name != NULL && strcasecmp(name, "nhd") == 0)
        *order_p = KVF_KV_NHD;
    else if (name != NULL && strcasecmp(name, "hnd") == 0)
        *order_p = KVF_KV_HND;
    else
        return -1;
    return 0;
}

void kvt_geom_init(kvt_geom_t *g, const kvt_model_t *model,
                   const kvt_dtype_t *dtype, uint32_t tp_size,
                   uint32_t tp_rank, uint32_t page_size)
{
    memset(g, 0, sizeof(*g));
    g->model = model;
    g->dtype = dtype;
    g->tp_size = tp_size;
    g->tp_rank = tp_rank;
    g->page_size = page_size;
    g->bytes_per_head = model->head_dim * dtype->bytes;
    if (model->attn == KVF_ATTN_MLA) {
        g->buffers_per_layer = 1;
        g->total_heads = 1;
        g->heads_per_rank = 1;
        g->head_first = 0;
    } else {
        g->buffers_per_layer = 2;
        g->total_heads = model->kv_heads;
        if (tp_size <= model->kv_heads) {
            g->heads_per_rank = model->kv_heads / tp_size;
            g->head_first = tp_rank * g->heads_per_rank;
        } else {
            g->heads_per_rank = 1;
            g->head_first = (uint32_t)((uint64_t)tp_rank * model->kv_heads / tp_size);
        }
    }
    g->num_layers = model->num_layers;
    g->num_buffers = g->buffers_per_layer * model->num_layers;
    g->token_bytes = (size_t)g->heads_per_rank * g->bytes_per_head;
    g->page_bytes = (size_t)page_size * g->token_bytes;
}

void kvt_stage_layers(uint32_t num_layers, uint32_t pp_size, uint32_t pp_rank,
                      uint32_t *first_p, uint32_t *count_p)
{
    uint64_t first = (uint64_t)pp_rank * num_layers / pp_size;
    uint64_t end = (uint64_t)(pp_rank + 1) * num_layers / pp_size;
    *first_p = (uint32_t)first;
    *count_p = (uint32_t)(end - first);
}

void kvt_geom_set_stage(kvt_geom_t *g, uint32_t pp_size, uint32_t pp_rank)
{
    kvt_stage_layers(g->model->num_layers, pp_size, pp_rank, &g->first_layer,
                     &g->num_layers);
    g->num_buffers = g->buffers_per_layer * g->num_layers;
    g->buf0 = g->buffers_per_layer * g->first_layer;
}
