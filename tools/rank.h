/*
 * One rank process of `kvferry demo` / `kvferry bench` (rank.c), as the
 * bench loop (bench_rank.c) sees it: the engine, the KV memory shaped like
 * the model's, the page pools, and the event channel to the orchestrator.
 * The demo's room window (kvt_room_t) stays private to rank.c.
 */
#ifndef KVT_RANK_H
#define KVT_RANK_H

#include <jansson.h>
#include <stddef.h>
#include <stdint.h>

#include "kvferry/kvferry.h"
#include "cmdin.h"
#include "models.h"
#include "opts.h"
#include "pool.h"

typedef struct kvt_room kvt_room_t;

typedef struct kvt_rank {
    kvt_opts_t      o;
    kvt_coord_t     at;            /* dp/pp/tp of this process (o.rank is its index) */
    int             prefill;
    const char     *side;
    kvt_geom_t      g;
    kvf_engine_t   *eng;
    char            addr[KVF_ADDR_MAX];
    uint8_t        *kv;            /* num_buffers * buf_len bytes */
    size_t          kv_len;
    size_t          buf_len;       /* one buffer: pool_pages * page_bytes */
    uint8_t        *aux;
    uint32_t        aux_slots;
    kvt_pool_t      pages;
    kvt_pool_t      slots;
    uint32_t        room_pages;
    uint32_t        chunk_pages;
    kvt_room_t     *win;           /* concurrency slots */
    uint32_t       *page_store;
    json_t         *rooms;
    json_t         *failures;
    uint64_t        bytes;
    double          first_start;
    double          last_end;
    kvt_cmdin_t     cmd;           /* the orchestrator's command lines */
} kvt_rank_t;

/** Write one event line to the orchestrator, stealing `ev`. */
void kvt_emit(kvt_rank_t *r, const char *event, json_t *ev);

/** A fatal setup error: logged and sent as an "error" event. */
void kvt_fatal(kvt_rank_t *r, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

/** First byte of `page` in KV buffer `buffer`. */
uint8_t *kvt_page(kvt_rank_t *r, uint32_t buffer, uint32_t page);

/** First byte of aux slot `slot`. */
uint8_t *kvt_aux(kvt_rank_t *r, uint32_t slot);

/**
 * Setup (rank_setup.c).  Memory: the KV buffers, aux slots and page pools
 * (not the room window, which is rank.c's).  Engine: create it with this
 * rank's dp/pp/tp and register its layout (its stage's layers at
 * first_layer).  @return 0, or -1 after kvt_fatal().
 */
int kvt_rank_setup_memory(kvt_rank_t *r);
int kvt_rank_setup_engine(kvt_rank_t *r);

/** {dp_rank, pp_rank, tp_rank, first_layer, num_layers} of this rank. */
json_t *kvt_rank_coord_json(const kvt_rank_t *r);

/**
 * Bench mode (bench_rank.c).  Prepare runs before "ready": it fills the
 * prefill pages once, so no pattern generation is timed.  Run replaces the
 * demo's room loop after "go" and ends with the bench's "result" event.
 */
int kvt_bench_rank_prepare(kvt_rank_t *r);
void kvt_bench_rank_run(kvt_rank_t *r);

#endif /* KVT_RANK_H */
