/*
 * `kvferry bench --layerwise`: what sending each layer as it is computed
 * (kvf_sender_send_layers) saves against sending the chunk once its whole
 * forward pass is done (kvf_sender_send), in one run.
 *
 *   kvferry bench --layerwise [--model M] [--tokens N] [--page-size P]
 *                 [--compute-us-per-token U] [--layers-per-send K] [--repeats R]
 *                 [--transport T] [--json]
 *
 * A prefill and a decode engine in this process, over `--transport`
 * (default tcp), each with M's KV buffers.  Each room is one chunk of N
 * tokens.  The prefill's forward pass is emulated: layer i's compute ends
 * at t0 + (i + 1) * N * U / layers (an absolute sleep, so a late wake-up
 * does not push the later layers), as a GPU's kernels leave the host's
 * CPUs to the transfer; a CPU matmul of the layer's size would take one of
 * this host's two CPUs from the very engines it measures.
 *
 * Whole-chunk: after the last layer, kvf_sender_send of every page, last.
 * Layer-wise: kvf_sender_send_layers of each K layers (default 1) as their
 * compute ends, then the last kvf_sender_send (no pages).  The tail is the time from the
 * last layer's compute end to the decode's SUCCESS; tail_ratio is the
 * median layer-wise tail over the median whole-chunk tail.  Throughput is
 * measured apart, without compute (every layer sent at once): bytes over
 * the time from the first send to SUCCESS, layer-wise against whole-chunk
 * (throughput_ratio).  The two modes alternate within each repeat, and
 * which goes first alternates across repeats, so the host's noise falls on
 * both.  How late the emulated compute woke (sleep_late_ms) tells that
 * noise apart from the transfer's own time.  Every room's bytes are
 * compared with the prefill's after it (not timed).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bench_micro.h"

enum { KVT_WHOLE, KVT_LAYERED, KVT_MODES };
static const char *const kvt_mode_names[KVT_MODES] = {"whole", "layerwise"};

typedef struct kvt_lw {
    kvt_geom_t  g;
    kvt_side_t  pre, dec;
    char        reg[KVF_ADDR_MAX];
    uint32_t    npages, tokens, repeats;
    uint32_t    per_send;     /* layers per kvf_sender_send_layers */
    double      layer_s;      /* emulated compute per layer */
    uint32_t   *pages;        /* 0 .. npages - 1, both sides */
    uint64_t    next_room;
    /* per mode, per repeat */
    double     *tail[KVT_MODES], *total[KVT_MODES], *gbps[KVT_MODES];
    double     *late;         /* per layer computed, how late its wake-up was */
    size_t      nlate;
} kvt_lw_t;

static void kvt_sleep_until(double t)
{
    struct timespec ts = {(time_t)t, (long)((t - (double)(time_t)t) * 1e9)};
    while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) != 0)
        ;
}

/* Wait for the receiver's final state, polling every 20 us (a sleeping
 * poller leaves the CPUs to the engines).  @return SUCCESS or FAILED,
 * FAILED after 60 s. */
static kvf_poll_t kvt_await_final(kvf_sender_t *s, kvf_receiver_t *r)
{
    double until = kvt_now_s() + 60;
    kvf_poll_t st;
    while ((st = r ? kvf_receiver_poll(r) : kvf_sender_poll(s)) != KVF_POLL_SUCCESS &&
           st != KVF_POLL_FAILED && kvt_now_s() < until) {
        struct timespec ts = {0, 20000};
        nanosleep(&ts, NULL);
    }
    return st == KVF_POLL_SUCCESS ? st : KVF_POLL_FAILED;
}

/* A room up to the prefill's first send: receiver and sender created and
 * initialised.  @return 0, or -1 (said on stderr). */
static int kvt_room_open(kvt_lw_t *b, kvf_sender_t **s_p, kvf_receiver_t **r_p)
{
    uint64_t id = b->next_room++;
    uint32_t aux = 0;
    double until = kvt_now_s() + 30;
    memset(b->dec.kv, 0, b->dec.kv_len);
    if (kvf_receiver_create(b->dec.eng, b->reg, id, -1, r_p) != KVF_OK ||
        kvf_receiver_init(*r_p, b->pages, b->npages, aux, NULL, 0) != KVF_OK ||
        kvf_sender_create(b->pre.eng, b->reg, id, s_p) != KVF_OK) {
        fprintf(stderr, "kvferry bench --layerwise: room %llu: %s\n",
                (unsigned long long)id, kvf_last_error());
        return -1;
    }
    while (kvf_sender_poll(*s_p) == KVF_POLL_BOOTSTRAPPING && kvt_now_s() < until) {
        struct timespec ts = {0, 100000};
        nanosleep(&ts, NULL);
    }
    if (kvf_sender_poll(*s_p) != KVF_POLL_WAITING_FOR_INPUT ||
        kvf_sender_init(*s_p, b->npages, aux) != KVF_OK) {
        fprintf(stderr, "kvferry bench --layerwise: room %llu did not reach "
                "WaitingForInput: %s\n", (unsigned long long)id, kvf_last_error());
        return -1;
    }
    return 0;
}

/* The emulated forward pass of one chunk, sending each group of per_send
 * layers as its compute ends when `layered`.  @return the last layer's
 * compute end, or a negative time: a send failed. */
static double kvt_forward(kvt_lw_t *b, kvf_sender_t *s, int layered, double layer_s)
{
    double t0 = kvt_now_s(), end = t0;
    for (uint32_t i = 0; i < b->g.num_layers; i++) {
        if (layer_s > 0) {
            double due = t0 + (i + 1) * layer_s;
            kvt_sleep_until(due);
            end = kvt_now_s();
            b->late[b->nlate++] = (end - due) * 1e3;
        }
        uint32_t n = i + 1, from = (i / b->per_send) * b->per_send;
        if (layered && (n % b->per_send == 0 || n == b->g.num_layers) &&
            kvf_sender_send_layers(s, b->pages, b->npages, 0, 0, from, n) != KVF_OK)
            return -1;
    }
    return end;
}

/* One room in one mode: its tail (from the last layer's compute end, or
 * from the first send without compute) and total time, in ms.
 * @return 0, or -1 (said on stderr). */
static int kvt_room(kvt_lw_t *b, int mode, double layer_s, double *tail_ms, double *total_ms)
{
    kvf_sender_t *s = NULL;
    kvf_receiver_t *r = NULL;
    int rc = -1;
    if (kvt_room_open(b, &s, &r) != 0)
        goto out;
    double t0 = kvt_now_s();
    double end = kvt_forward(b, s, mode == KVT_LAYERED, layer_s);
    uint32_t rest = mode == KVT_LAYERED ? 0 : b->npages;   /* the layers had them */
    if (end < 0 || kvf_sender_send(s, rest ? b->pages : NULL, rest, 1) != KVF_OK) {
        fprintf(stderr, "kvferry bench --layerwise: a send was refused: %s\n",
                kvf_last_error());
        goto out;
    }
    kvf_poll_t st = kvt_await_final(NULL, r);
    double done = kvt_now_s();
    if (st != KVF_POLL_SUCCESS || kvt_await_final(s, NULL) != KVF_POLL_SUCCESS) {
        kvf_failure_t f;
        kvf_failure_init(&f);
        if (st != KVF_POLL_SUCCESS)
            kvf_receiver_failure(r, &f);
        else
            kvf_sender_failure(s, &f);
        fprintf(stderr, "kvferry bench --layerwise: a %s room failed: %s\n",
                kvt_mode_names[mode], f.reason);
        goto out;
    }
    if (memcmp(b->pre.kv, b->dec.kv, b->pre.kv_len) != 0) {
        fprintf(stderr, "kvferry bench --layerwise: a %s room's bytes differ from the "
                "prefill's\n", kvt_mode_names[mode]);
        goto out;
    }
    *tail_ms = (done - (layer_s > 0 ? end : t0)) * 1e3;
    *total_ms = (done - t0) * 1e3;
    rc = 0;
out:
    if (s)
        kvf_sender_destroy(s);
    if (r)
        kvf_receiver_destroy(r);
    return rc;
}

/* Repeat i: each mode with compute, then each without, the first mode
 * alternating. */
static int kvt_repeat(kvt_lw_t *b, uint32_t i)
{
    double bytes = (double)b->pre.kv_len, t, unused;
    for (int k = 0; k < KVT_MODES; k++) {
        int mode = (int)((k + i) % KVT_MODES);
        if (kvt_room(b, mode, b->layer_s, &b->tail[mode][i], &b->total[mode][i]) != 0)
            return -1;
    }
    for (int k = 0; k < KVT_MODES; k++) {
        int mode = (int)((k + i) % KVT_MODES);
        if (kvt_room(b, mode, 0, &t, &unused) != 0)
            return -1;
        b->gbps[mode][i] = bytes / (t * 1e-3) / 1e9;
    }
    return 0;
}

static double kvt_median(double *v, size_t n)
{
    qsort(v, n, sizeof(*v), kvt_cmp_d);
    return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

/* "name":{"p50":..,"min":..,"max":..} of n values (sorted in place). */
static double kvt_print_spread(const char *name, double *v, size_t n, int comma)
{
    double m = kvt_median(v, n);
    printf("%s\"%s\":{\"p50\":%.3f,\"min\":%.3f,\"max\":%.3f}", comma ? "," : "", name, m,
           v[0], v[n - 1]);
    return m;
}

static void kvt_report_json(kvt_lw_t *b, const char *transport)
{
    double tail[KVT_MODES], gbps[KVT_MODES];
    printf("{\"model\":\"%s\",\"tokens\":%u,\"page_size\":%u,\"layers\":%u,"
           "\"transport\":\"%s\",\"bytes\":%zu,\"compute_ms\":%.3f,\"repeats\":%u,"
           "\"layers_per_send\":%u", b->g.model->name, b->tokens, b->g.page_size,
           b->g.num_layers, transport, b->pre.kv_len, b->layer_s * b->g.num_layers * 1e3,
           b->repeats, b->per_send);
    for (int m = 0; m < KVT_MODES; m++) {
        printf(",\"%s\":{", kvt_mode_names[m]);
        tail[m] = kvt_print_spread("tail_ms", b->tail[m], b->repeats, 0);
        kvt_print_spread("total_ms", b->total[m], b->repeats, 1);
        gbps[m] = kvt_print_spread("gbps", b->gbps[m], b->repeats, 1);
        printf("}");
    }
    kvt_print_spread("sleep_late_ms", b->late, b->nlate, 1);
    printf(",\"tail_ratio\":%.4f,\"throughput_ratio\":%.4f}\n",
           tail[KVT_WHOLE] > 0 ? tail[KVT_LAYERED] / tail[KVT_WHOLE] : 0,
           gbps[KVT_WHOLE] > 0 ? gbps[KVT_LAYERED] / gbps[KVT_WHOLE] : 0);
}

static void kvt_report_text(kvt_lw_t *b, const char *transport)
{
    double tail[KVT_MODES], total[KVT_MODES], gbps[KVT_MODES];
    for (int m = 0; m < KVT_MODES; m++) {
        tail[m] = kvt_median(b->tail[m], b->repeats);
        total[m] = kvt_median(b->total[m], b->repeats);
        gbps[m] = kvt_median(b->gbps[m], b->repeats);
    }
    printf("kvferry bench --layerwise: %s, %u tokens (%zu MiB), page %u, %u layers, "
           "transport %s,\nemulated compute %.1f ms per chunk, %u layers per send; "
           "medians of %u repeats\n", b->g.model->name, b->tokens, b->pre.kv_len >> 20,
           b->g.page_size, b->g.num_layers, transport, b->layer_s * b->g.num_layers * 1e3,
           b->per_send, b->repeats);
    for (int m = 0; m < KVT_MODES; m++)
        printf("  %-10s tail %8.2f ms   compute + tail %8.2f ms   %6.2f GB/s without "
               "compute\n", kvt_mode_names[m], tail[m], total[m], gbps[m]);
    printf("  tail ratio %.3f, throughput ratio %.3f; emulated compute woke %.3f ms late "
           "(median)\n", tail[KVT_WHOLE] > 0 ? tail[KVT_LAYERED] / tail[KVT_WHOLE] : 0,
           gbps[KVT_WHOLE] > 0 ? gbps[KVT_LAYERED] / gbps[KVT_WHOLE] : 0,
           kvt_median(b->late, b->nlate));
}

static int kvt_lw_setup(kvt_lw_t *b, int argc, char **argv, const char *transport)
{
    const char *model = kvt_arg_str(argc, argv, "--model");
    uint32_t page = 64, us_per_token = 40;
    b->tokens = 4096;
    b->repeats = 5;
    b->per_send = 1;
    if (kvt_arg_u32(argc, argv, "--tokens", &b->tokens) ||
        kvt_arg_u32(argc, argv, "--page-size", &page) ||
        kvt_arg_u32(argc, argv, "--repeats", &b->repeats) ||
        kvt_arg_u32(argc, argv, "--compute-us-per-token", &us_per_token) ||
        kvt_arg_u32(argc, argv, "--layers-per-send", &b->per_send))
        return 2;
    const kvt_model_t *m = kvt_model_find(model ? model : "llama3-8b");
    if (m == NULL) {
        fprintf(stderr, "kvferry bench --layerwise: unknown model %s; models:\n", model);
        kvt_models_print(stderr);
        return 2;
    }
    kvt_geom_init(&b->g, m, kvt_dtype_find("bfloat16"), 1, 0, page);
    b->npages = kvt_pages_for(b->tokens, page);
    b->layer_s = (double)b->tokens * us_per_token * 1e-6 / m->num_layers;
    b->next_room = 1;
    b->pages = malloc(b->npages * sizeof(uint32_t));
    b->late = malloc((size_t)b->repeats * KVT_MODES * m->num_layers * sizeof(double));
    int ok = b->pages != NULL && b->late != NULL;
    for (int k = 0; k < KVT_MODES; k++) {
        b->tail[k] = malloc(b->repeats * sizeof(double));
        b->total[k] = malloc(b->repeats * sizeof(double));
        b->gbps[k] = malloc(b->repeats * sizeof(double));
        ok = ok && b->tail[k] && b->total[k] && b->gbps[k];
    }
    if (!ok) {
        fprintf(stderr, "kvferry bench --layerwise: out of memory\n");
        return 1;
    }
    for (uint32_t p = 0; p < b->npages; p++)
        b->pages[p] = p;
    if (kvt_side_make(&b->pre, KVF_ROLE_PREFILL, &b->g, b->npages, transport, "127.0.0.1:0") ||
        kvf_engine_bootstrap_addr(b->pre.eng, b->reg, sizeof(b->reg)) != KVF_OK ||
        kvt_side_make(&b->dec, KVF_ROLE_DECODE, &b->g, b->npages, transport, NULL))
        return 1;
    uint64_t x = 0x9e3779b97f4a7c15ull;      /* bytes to compare, every one distinct */
    for (size_t i = 0; i + 8 <= b->pre.kv_len; i += 8) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        memcpy(b->pre.kv + i, &x, 8);
    }
    return 0;
}

static void kvt_lw_free(kvt_lw_t *b)
{
    if (b->dec.eng)
        kvf_engine_destroy(b->dec.eng);
    if (b->pre.eng)
        kvf_engine_destroy(b->pre.eng);
    free(b->pre.kv), free(b->pre.aux), free(b->dec.kv), free(b->dec.aux);
    for (int k = 0; k < KVT_MODES; k++)
        free(b->tail[k]), free(b->total[k]), free(b->gbps[k]);
    free(b->pages);
    free(b->late);
}

int kvt_bench_layers_main(int argc, char **argv)
{
    static kvt_lw_t b;
    const char *transport = kvt_arg_str(argc, argv, "--transport");
    int json = 0, rc;
    for (int i = 2; i < argc; i++)
        json |= strcmp(argv[i], "--json") == 0;
    memset(&b, 0, sizeof(b));
    if ((rc = kvt_lw_setup(&b, argc, argv, transport ? transport : "tcp")) != 0)
        goto out;
    double t, unused;                  /* a warm-up room: connection, pages */
    rc = 1;
    if (kvt_room(&b, KVT_WHOLE, 0, &t, &unused) != 0)
        goto out;
    for (uint32_t i = 0; i < b.repeats; i++)
        if (kvt_repeat(&b, i) != 0)
            goto out;
    if (json)
        kvt_report_json(&b, kvf_engine_transport(b.pre.eng));
    else
        kvt_report_text(&b, kvf_engine_transport(b.pre.eng));
    rc = 0;
out:
    kvt_lw_free(&b);
    return rc;
}
