/*
 * Setup of one `kvferry _rank` process (see rank.c): the KV memory shaped
 * like the model's (this rank's heads, and its pipeline stage's layers),
 * the page pools, the engine with its parallel coordinates, and the layout
 * it registers.
 */
#include <inttypes.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvferry/kvferry.h"
#include "pattern.h"
#include "pool.h"
#include "rank.h"

int kvt_rank_setup_memory(kvt_rank_t *r)
{
    uint32_t conc = r->o.concurrency;
    /* The bench needs no spare pages where it needs no scattering. */
    int spare = !(r->o.bench && (r->prefill || r->o.contiguous));
    uint64_t pool = (spare ? 2ull : 1ull) * conc * r->room_pages;
    uint64_t total = pool * r->g.page_bytes * r->g.num_buffers;
    if (pool > UINT32_MAX) {
        kvt_fatal(r, "a pool of %" PRIu64 " pages is too large: lower "
                  "--concurrency or --tokens", pool);
        return -1;
    }
    r->buf_len = pool * r->g.page_bytes;
    r->kv_len = total;
    /* kvf_mem_alloc: memory a same-host decode engine can map (shm reads
     * become one memcpy).  It is populated up front, as a real KV pool is
     * before serving: first-touch faults would otherwise be measured as
     * transfer time. */
    void *kv = NULL;
    if (kvf_mem_alloc(total, &kv) != KVF_OK) {
        kvt_fatal(r, "cannot allocate %.2f GiB of KV buffers (%u buffers x %"
                  PRIu64 " pages x %zu B); lower --concurrency or --tokens",
                  (double)total / (1 << 30), r->g.num_buffers, pool, r->g.page_bytes);
        return -1;
    }
    r->kv = kv;
    r->aux_slots = 2 * conc;
    r->aux = calloc(r->aux_slots, KVT_AUX_SLOT_BYTES);
    if (!r->aux ||
        kvt_pool_init(&r->pages, (uint32_t)pool, !r->prefill && !r->o.contiguous,
                      kvt_mix64(r->o.seed ^ (0xD0ull << 32 | r->o.rank))) ||
        kvt_pool_init(&r->slots, r->aux_slots, 0, 0)) {
        kvt_fatal(r, "out of memory");
        return -1;
    }
    return 0;
}

int kvt_rank_setup_engine(kvt_rank_t *r)
{
    kvf_engine_params_t p;
    kvf_engine_params_init(&p);
    p.role = r->prefill ? KVF_ROLE_PREFILL : KVF_ROLE_DECODE;
    p.tp_rank = (int)r->at.tp;
    p.tp_size = (int)r->g.tp_size;
    p.pp_rank = (int)r->at.pp;
    p.pp_size = (int)(r->prefill ? r->o.prefill_pp : r->o.decode_pp);
    p.dp_rank = (int)r->at.dp;
    p.dp_size = (int)(r->prefill ? r->o.dp : 1);
    /* p.host: KVF_HOST, else 127.0.0.1 (kvf_engine_params_init); the
     * network-namespace test runs ranks on two hosts' addresses. */
    p.port = 0;
    p.bootstrap_addr = r->prefill ? r->o.registry : NULL;
    if (r->o.transport)
        p.transport = r->o.transport;
    if (r->o.checksum)
        p.checksum = 1;
    p.streams = r->o.streams;
    unsigned us;
    if (kvt_opts_busy_poll(&r->o, r->prefill, &us) > 0)
        p.busy_poll_us = us;
    if (r->o.faults)
        p.faults = r->o.faults;   /* the demo's --fault reset|corrupt|badaddr */
    kvf_status_t st = kvf_engine_create(&p, &r->eng);
    if (st != KVF_OK) {
        kvt_fatal(r, "kvf_engine_create failed: %s (%s); see the engine's "
                  "log line above", kvf_status_str(st), kvf_status_name(st));
        return -1;
    }
    if (kvf_engine_address(r->eng, r->addr, sizeof(r->addr)) != KVF_OK)
        snprintf(r->addr, sizeof(r->addr), "?");

    kvf_buffer_t *kv = calloc(r->g.num_buffers, sizeof(*kv));
    if (!kv) {
        kvt_fatal(r, "out of memory");
        return -1;
    }
    for (uint32_t b = 0; b < r->g.num_buffers; b++) {
        kv[b].base = r->kv + (size_t)b * r->buf_len;
        kv[b].length = r->buf_len;
        kv[b].item_bytes = r->g.page_bytes;
    }
    kvf_buffer_t aux = { r->aux, (size_t)r->aux_slots * KVT_AUX_SLOT_BYTES,
                         KVT_AUX_SLOT_BYTES };
    kvf_layout_t l;
    kvf_layout_init(&l);
    l.page_size = r->g.page_size;
    l.kv_dtype = r->g.dtype->name;
    l.attn = r->g.model->attn;
    l.num_layers = r->g.num_layers;
    l.first_layer = r->g.first_layer;
    l.heads_per_rank = r->g.heads_per_rank;
    l.total_heads = r->g.total_heads;
    l.bytes_per_head = r->g.bytes_per_head;
    l.num_kv = r->g.num_buffers;
    l.kv = kv;
    l.num_aux = 1;
    l.aux = &aux;
    l.kv_order = r->g.kv_order;
    st = kvf_engine_register_layout(r->eng, &l);
    free(kv);   /* the engine copies the arrays */
    if (st != KVF_OK) {
        kvt_fatal(r, "kvf_engine_register_layout failed: %s (%s); see the "
                  "engine's log line above", kvf_status_str(st),
                  kvf_status_name(st));
        return -1;
    }
    return 0;
}

/* Where this rank sits: its parallel coordinates and its layers. */
json_t *kvt_rank_coord_json(const kvt_rank_t *r)
{
    return json_pack("{s:i, s:i, s:i, s:i, s:i}", "dp_rank", (int)r->at.dp,
                     "pp_rank", (int)r->at.pp, "tp_rank", (int)r->at.tp,
                     "first_layer", (int)r->g.first_layer,
                     "num_layers", (int)r->g.num_layers);
}
