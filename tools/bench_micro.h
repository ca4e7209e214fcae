/*
 * What the in-process benchmarks of `kvferry bench` share (bench_micro.c,
 * bench_layers.c): a prefill or decode engine with a model's KV buffers in
 * this process, the clock, and their options.
 */
#ifndef KVT_BENCH_MICRO_H
#define KVT_BENCH_MICRO_H

#include <stddef.h>
#include <stdint.h>

#include "kvferry/kvferry.h"
#include "models.h"

/* One side: an engine and its KV buffers (one per layer and role, each
 * `npages` pages of the geometry's page_bytes, in kv) and one aux slot
 * per page. */
typedef struct kvt_side {
    kvf_engine_t *eng;
    uint8_t      *kv;
    uint8_t      *aux;
    size_t        kv_len;
    uint32_t      npages;
} kvt_side_t;

/* Create s's engine (a prefill hosts its registry at `registry`) and
 * register g's layout over `pages` pages.  @return 0, or -1 (said on
 * stderr). */
int kvt_side_make(kvt_side_t *s, kvf_role_t role, const kvt_geom_t *g, uint32_t pages,
                  const char *transport, const char *registry);

/* Monotonic seconds. */
double kvt_now_s(void);
/* qsort's comparison of doubles. */
int kvt_cmp_d(const void *a, const void *b);

/* `--name N` or `--name=N` among argv[2..]: a positive integer into *v
 * (left alone when absent).  @return 0, or -1 (said on stderr). */
int kvt_arg_u32(int argc, char **argv, const char *name, uint32_t *v);
/* `--name S` or `--name=S` among argv[2..], or NULL. */
const char *kvt_arg_str(int argc, char **argv, const char *name);

/* The hidden micro-benchmarks: --memcpy, --rooms-in-flight,
 * --call-latency (bench_micro.c). */
int kvt_bench_micro_main(int argc, char **argv);
/* `kvferry bench --layerwise` (bench_layers.c). */
int kvt_bench_layers_main(int argc, char **argv);

#endif /* KVT_BENCH_MICRO_H */
