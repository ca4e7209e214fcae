/*
 * Model KV layouts for the kvferry tool.
 *
 * A model is named by its KV geometry only: layers, KV heads, values per
 * head (MHA/GQA) or values per token (MLA).  kvt_geom_t is one rank's view
 * of it for a given TP size, dtype and page size: how many KV buffers, which
 * GLOBAL heads this rank holds, and the byte layout of a page, which is the
 * same on prefill and decode, in one of two orders (kvf_kv_order_t):
 *
 *   NHD: offset = ((page * page_size + slot) * heads_per_rank + h_local)
 *                 * bytes_per_head + byte
 *   HND: offset = page * page_bytes
 *                 + (h_local * page_size + slot) * bytes_per_head + byte
 *
 * Data is defined over global heads and global layers' buffers (see
 * pattern.h), so a decode rank can verify the heads and layers it holds
 * whatever the prefill TP and PP sizes were.
 */
#ifndef KVT_MODELS_H
#define KVT_MODELS_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "kvferry/kvferry.h"

typedef struct kvt_model {
    const char     *name;
    kvf_attn_kind_t attn;
    uint32_t        num_layers;
    uint32_t        kv_heads;   /**< MHA: KV heads of the model; MLA: 1 */
    uint32_t        head_dim;   /**< MHA: values per head; MLA: values per token */
    const char     *note;       /**< one line for the usage text */
} kvt_model_t;

typedef struct kvt_dtype {
    const char *name;
    uint32_t    bytes;
} kvt_dtype_t;

/** One rank's layout of a model. */
typedef struct kvt_geom {
    const kvt_model_t *model;
    const kvt_dtype_t *dtype;
    uint32_t tp_size;
    uint32_t tp_rank;
    uint32_t page_size;       /**< tokens per page */
    uint32_t num_buffers;     /**< KV buffers this rank holds: 2 per layer (MHA) or 1 (MLA) */
    uint32_t buffers_per_layer;
    uint32_t first_layer;     /**< GLOBAL index of this rank's first layer (PP stage) */
    uint32_t num_layers;      /**< layers this rank holds */
    uint32_t buf0;            /**< GLOBAL buffer index of local buffer 0 */
    uint32_t total_heads;     /**< logical heads: kv_heads (MHA) or 1 (MLA) */
    uint32_t heads_per_rank;
    uint32_t head_first;      /**< GLOBAL index of this rank's first head */
    uint32_t bytes_per_head;  /**< bytes of one head of one token */
    size_t   token_bytes;     /**< heads_per_rank * bytes_per_head */
    size_t   page_bytes;      /**< page_size * token_bytes: one page of one buffer */
    kvf_kv_order_t kv_order;  /**< how a page orders heads and tokens; kvt_geom_init: NHD */
} kvt_geom_t;

/** Where head `h` (local) of token slot `slot` starts inside a page of `g`. */
static inline size_t kvt_head_offset(const kvt_geom_t *g, uint32_t slot, uint32_t h)
{
    if (g->kv_order == KVF_KV_HND)
        return ((size_t)h * g->page_size + slot) * g->bytes_per_head;
    return (size_t)slot * g->token_bytes + (size_t)h * g->bytes_per_head;
}

/** "nhd" / "hnd" (any case) -> *order_p; -1 for another name. */
int kvt_kv_order_find(const char *name, kvf_kv_order_t *order_p);

/** Bytes of the aux slot that carries a room's tag (pattern.h). */
#define KVT_AUX_SLOT_BYTES 64

const kvt_model_t *kvt_model_find(const char *name);
const kvt_dtype_t *kvt_dtype_find(const char *name);

/** Print the known models and dtypes, one per line, indented. */
void kvt_models_print(FILE *out);

/**
 * Check that `tp_size` can split `model`'s KV heads: it must divide them, or
 * be a multiple of them (GQA replication).  On error writes a message that
 * names `option` (e.g. "--decode-tp") into err and returns -1.
 */
int kvt_tp_check(const kvt_model_t *model, uint32_t tp_size,
                 const char *option, char *err, size_t errlen);

/** Fill `g` for one rank.  Arguments must have passed kvt_tp_check(). */
void kvt_geom_init(kvt_geom_t *g, const kvt_model_t *model,
                   const kvt_dtype_t *dtype, uint32_t tp_size,
                   uint32_t tp_rank, uint32_t page_size);

/**
 * The layers pipeline stage `pp_rank` of `pp_size` holds of a model's
 * `num_layers`: first = s*L/S, count = (s+1)*L/S - first (integer
 * division, so later stages get the extra layer: 61 layers in 2 stages
 * are 0..29 and 30..60).  pp_size must be at most num_layers.
 */
void kvt_stage_layers(uint32_t num_layers, uint32_t pp_size, uint32_t pp_rank,
                      uint32_t *first_p, uint32_t *count_p);

/**
 * Restrict `g` (from kvt_geom_init, all layers) to one pipeline stage's
 * layers: num_buffers, first_layer, num_layers and buf0 change.
 */
void kvt_geom_set_stage(kvt_geom_t *g, uint32_t pp_size, uint32_t pp_rank);

/** Pages a room of `tokens` tokens needs (the last may be partly used). */
static inline uint32_t kvt_pages_for(uint32_t tokens, uint32_t page_size)
{
    return (tokens + page_size - 1) / page_size;
}

#endif /* KVT_MODELS_H */
