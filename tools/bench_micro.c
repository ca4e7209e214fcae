/*
 * Hidden micro-benchmarks of `kvferry bench` (used by bench/baselines.sh):
 *
 *   --memcpy [--mib N] [--repeats N]
 *       single-threaded memcpy bandwidth of large buffers: the memory
 *       limit any transfer on this host runs against.
 *   --rooms-in-flight N [--transport NAME]
 *       N rooms at once between a prefill and a decode engine in this one
 *       process: the memory each room costs beyond its page indices (RSS
 *       delta / N, per side) and the time of one poll pass over all of
 *       them (what a scheduler spends per step), then the rooms complete.
 *
 *   --call-latency [--rooms N] [--load-mib M | --load-rooms K] [--transport NAME]
 *       the latency of every application call (create, init, send, poll,
 *       failure, metric, destroy, both sides) over N one-page rooms, with
 *       the engines idle and then under load: two M MiB rooms streaming
 *       between them at a time, or with --load-rooms, K one-page rooms in
 *       flight at a time (below); each call beside a null call
 *       (kvf_null_call) timed at the same moments, and after each room a
 *       wake call (an eventfd write that wakes a sleeping thread).  The
 *       engines take their busy polling from KVF_BUSY_POLL_US (0: none),
 *       which the JSON states as busy_poll_us.
 *
 * The one idea of the second: per-room cost only shows at scale, and one
 * process holding both sides makes the RSS of each phase attributable: the
 * receivers first (decode), then the senders (prefill), measured after
 * each side's rooms reached WAITING_FOR_INPUT, i.e. after every per-room
 * structure on both engines exists.  Both print one JSON object on stdout.
 */
#include <errno.h>
#include <pthread.h>
#include <semaphore.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "kvferry/kvferry.h"
#include "bench_micro.h"
#include "models.h"
#include "tool.h"

double kvt_now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

int kvt_cmp_d(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static long kvt_vm_rss_kb(void)
{
    FILE *f = fopen("/proc/self/status", "r");
    char line[256];
    long kb = 0;
    while (f && fgets(line, sizeof(line), f))
        if (sscanf(line, "VmRSS: %ld kB", &kb) == 1)
            break;
    if (f)
        fclose(f);
    return kb;
}

int kvt_arg_u32(int argc, char **argv, const char *name, uint32_t *v)
{
    size_t len = strlen(name);
    for (int i = 2; i < argc; i++) {
        const char *val = NULL;
        if (strcmp(argv[i], name) == 0 && i + 1 < argc)
            val = argv[i + 1];
        else if (strncmp(argv[i], name, len) == 0 && argv[i][len] == '=')
            val = argv[i] + len + 1;
        if (!val)
            continue;
        char *end;
        unsigned long x = strtoul(val, &end, 10);
        if (*end || x == 0 || x > 10000000) {
            fprintf(stderr, "kvferry bench: %s %s: expected a positive integer\n",
                    name, val);
            return -1;
        }
        *v = (uint32_t)x;
    }
    return 0;
}

const char *kvt_arg_str(int argc, char **argv, const char *name)
{
    size_t len = strlen(name);
    for (int i = 2; i < argc; i++) {
        if (strcmp(argv[i], name) == 0 && i + 1 < argc)
            return argv[i + 1];
        if (strncmp(argv[i], name, len) == 0 && argv[i][len] == '=')
            return argv[i] + len + 1;
    }
    return NULL;
}

/* ------------------------------------------------------------------------ */
/* memcpy                                                                   */
/* ------------------------------------------------------------------------ */

static int kvt_bench_memcpy(uint32_t mib, uint32_t repeats)
{
    size_t len = (size_t)mib << 20;
    uint8_t *src = mmap(NULL, len, PROT_READ | PROT_WRITE,
                        MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
    uint8_t *dst = mmap(NULL, len, PROT_READ | PROT_WRITE,
                        MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
    double *gbps = calloc(repeats, sizeof(double));
    if (src == MAP_FAILED || dst == MAP_FAILED || !gbps) {
        fprintf(stderr, "kvferry bench --memcpy: cannot map 2 x %u MiB: %s; "
                "use a smaller --mib\n", mib, strerror(errno));
        return 1;
    }
    memset(src, 0x5a, len);
    memset(dst, 0, len);
    memcpy(dst, src, len);   /* warm: TLB, page tables, caches */
    unsigned sink = 0;
    for (uint32_t i = 0; i < repeats; i++) {
        double t = kvt_now_s();
        memcpy(dst, src, len);
        t = kvt_now_s() - t;
        sink += dst[(i * 4099u) % len];
        gbps[i] = (double)len / t / 1e9;
    }
    qsort(gbps, repeats, sizeof(double), kvt_cmp_d);
    printf("{\"memcpy_gbps\":%.4f,\"min_gbps\":%.4f,\"max_gbps\":%.4f,"
           "\"mib\":%u,\"repeats\":%u,\"sink\":%u}\n", gbps[repeats / 2],
           gbps[0], gbps[repeats - 1], mib, repeats, sink & 1);
    free(gbps);
    munmap(src, len);
    munmap(dst, len);
    return 0;
}

/* ------------------------------------------------------------------------ */
/* Rooms in flight                                                          */
/* ------------------------------------------------------------------------ */

int kvt_side_make(kvt_side_t *s, kvf_role_t role, const kvt_geom_t *g, uint32_t pages,
                  const char *transport, const char *registry)
{
    kvf_engine_params_t p;
    kvf_engine_params_init(&p);
    p.role = role;
    p.host = "127.0.0.1";
    if (transport)
        p.transport = transport;
    if (role == KVF_ROLE_PREFILL) {
        p.bootstrap_addr = registry;
        p.host_bootstrap = 1;
    }
    kvf_status_t st = kvf_engine_create(&p, &s->eng);
    if (st != KVF_OK) {
        fprintf(stderr, "kvferry bench: kvf_engine_create (%s): %s; see the "
                "engine's log above\n", kvf_role_name(role), kvf_status_str(st));
        return -1;
    }
    size_t buf = (size_t)pages * g->page_bytes;
    s->kv_len = buf * g->num_buffers;
    s->npages = pages;
    s->kv = calloc(1, s->kv_len);
    s->aux = calloc(pages, KVT_AUX_SLOT_BYTES);
    kvf_buffer_t *kv = calloc(g->num_buffers, sizeof(*kv));
    if (!s->kv || !s->aux || !kv) {
        free(kv);
        fprintf(stderr, "kvferry bench: out of memory for %u pages\n", pages);
        return -1;
    }
    for (uint32_t b = 0; b < g->num_buffers; b++)
        kv[b] = (kvf_buffer_t){ s->kv + b * buf, buf, g->page_bytes };
    kvf_buffer_t aux = { s->aux, (size_t)pages * KVT_AUX_SLOT_BYTES, KVT_AUX_SLOT_BYTES };
    kvf_layout_t l;
    kvf_layout_init(&l);
    l.page_size = g->page_size;
    l.kv_dtype = g->dtype->name;
    l.attn = g->model->attn;
    l.num_layers = g->model->num_layers;
    l.heads_per_rank = g->heads_per_rank;
    l.total_heads = g->total_heads;
    l.bytes_per_head = g->bytes_per_head;
    l.num_kv = g->num_buffers;
    l.kv = kv;
    l.num_aux = 1;
    l.aux = &aux;
    st = kvf_engine_register_layout(s->eng, &l);
    free(kv);
    if (st != KVF_OK) {
        fprintf(stderr, "kvferry bench: kvf_engine_register_layout (%s): %s\n",
                kvf_role_name(role), kvf_status_str(st));
        return -1;
    }
    return 0;
}

/* Room i of one side's array: its senders' or its receivers'. */
static kvf_poll_t kvt_poll_at(kvf_sender_t **snd, kvf_receiver_t **rcv, uint32_t i)
{
    if (snd != NULL)
        return kvf_sender_poll(snd[i]);
    return rcv != NULL ? kvf_receiver_poll(rcv[i]) : KVF_POLL_FAILED;
}

/* Wait until every room of one side is at least `want` (or final).
 * @return the number that FAILED, or -1 on timeout. */
static long kvt_wait_all(kvf_sender_t **snd, kvf_receiver_t **rcv, uint32_t n,
                         kvf_poll_t want, double timeout_s)
{
    double until = kvt_now_s() + timeout_s;
    for (;;) {
        long failed = 0;
        uint32_t ready = 0;
        for (uint32_t i = 0; i < n; i++) {
            kvf_poll_t s = kvt_poll_at(snd, rcv, i);
            failed += s == KVF_POLL_FAILED;
            ready += s == KVF_POLL_FAILED || s >= want;
        }
        if (ready == n)
            return failed;
        if (kvt_now_s() > until)
            return -1;
        struct timespec ts = { 0, 1000000 };
        nanosleep(&ts, NULL);
    }
}

/* Median time of one poll pass over all rooms of one side, in ms. */
static double kvt_poll_pass_ms(kvf_sender_t **snd, kvf_receiver_t **rcv,
                               uint32_t n, double *max_p)
{
    enum { REPS = 51 };
    double t[REPS];
    volatile unsigned sink = 0;
    for (int r = 0; r < REPS; r++) {
        double a = kvt_now_s();
        unsigned acc = 0;
        for (uint32_t i = 0; i < n; i++)
            acc += snd ? (unsigned)kvf_sender_poll(snd[i])
                       : (unsigned)kvf_receiver_poll(rcv[i]);
        t[r] = (kvt_now_s() - a) * 1e3;
        sink += acc;
    }
    (void)sink;               /* only there so the loop is not optimised away */
    qsort(t, REPS, sizeof(double), kvt_cmp_d);
    *max_p = t[REPS - 1];
    return t[REPS / 2];
}

static int kvt_bench_rooms(uint32_t n, const char *transport)
{
    kvt_geom_t g;
    kvt_geom_init(&g, kvt_model_find("tiny"), kvt_dtype_find("bfloat16"), 1, 0, 16);
    kvt_side_t pre = { 0 }, dec = { 0 };
    kvf_sender_t **snd = calloc(n + 1, sizeof(*snd));
    kvf_receiver_t **rcv = calloc(n + 1, sizeof(*rcv));
    uint32_t *idx = malloc((n + 1) * sizeof(uint32_t));
    char reg[KVF_ADDR_MAX];
    int rc = 1;
    if (!snd || !rcv || !idx)
        goto out;
    for (uint32_t i = 0; i <= n; i++)
        idx[i] = i;
    if (kvt_side_make(&pre, KVF_ROLE_PREFILL, &g, n + 1, transport, "127.0.0.1:0") ||
        kvf_engine_bootstrap_addr(pre.eng, reg, sizeof(reg)) != KVF_OK ||
        kvt_side_make(&dec, KVF_ROLE_DECODE, &g, n + 1, transport, NULL))
        goto out;

    /* One room end to end first: registry lookup, connection, handshake. */
    uint64_t warm = 1ull << 40;
    if (kvf_receiver_create(dec.eng, reg, warm, -1, &rcv[n]) != KVF_OK ||
        kvf_receiver_init(rcv[n], &idx[n], 1, n, NULL, 0) != KVF_OK ||
        kvf_sender_create(pre.eng, reg, warm, &snd[n]) != KVF_OK ||
        kvt_wait_all(&snd[n], NULL, 1, KVF_POLL_WAITING_FOR_INPUT, 30) != 0 ||
        kvf_sender_init(snd[n], 1, n) != KVF_OK ||
        kvf_sender_send(snd[n], &idx[n], 1, 1) != KVF_OK ||
        kvt_wait_all(NULL, &rcv[n], 1, KVF_POLL_SUCCESS, 30) != 0 ||
        kvt_wait_all(&snd[n], NULL, 1, KVF_POLL_SUCCESS, 30) != 0) {
        fprintf(stderr, "kvferry bench --rooms-in-flight: the warm-up room did "
                "not succeed; run 'kvferry demo --model tiny' to see why\n");
        goto out;
    }
    kvf_sender_destroy(snd[n]);
    kvf_receiver_destroy(rcv[n]);

    long rss0 = kvt_vm_rss_kb();
    for (uint32_t i = 0; i < n; i++)
        if (kvf_receiver_create(dec.eng, reg, i + 1, -1, &rcv[i]) != KVF_OK ||
            kvf_receiver_init(rcv[i], &idx[i], 1, i, NULL, 0) != KVF_OK) {
            fprintf(stderr, "kvferry bench: receiver %u refused\n", i);
            goto out;
        }
    long f1 = kvt_wait_all(NULL, rcv, n, KVF_POLL_WAITING_FOR_INPUT, 60);
    long rss1 = kvt_vm_rss_kb();
    for (uint32_t i = 0; i < n; i++)
        if (kvf_sender_create(pre.eng, reg, i + 1, &snd[i]) != KVF_OK) {
            fprintf(stderr, "kvferry bench: sender %u refused\n", i);
            goto out;
        }
    long f2 = kvt_wait_all(snd, NULL, n, KVF_POLL_WAITING_FOR_INPUT, 60);
    long rss2 = kvt_vm_rss_kb();
    double dmax, pmax;
    double dpass = kvt_poll_pass_ms(NULL, rcv, n, &dmax);
    double ppass = kvt_poll_pass_ms(snd, NULL, n, &pmax);

    double t = kvt_now_s();
    for (uint32_t i = 0; i < n; i++)
        if (kvf_sender_init(snd[i], 1, i) != KVF_OK ||
            kvf_sender_send(snd[i], &idx[i], 1, 1) != KVF_OK) {
            fprintf(stderr, "kvferry bench: send of room %u refused\n", i);
            goto out;
        }
    long f3 = kvt_wait_all(NULL, rcv, n, KVF_POLL_SUCCESS, 60);
    double complete = kvt_now_s() - t;
    long f4 = kvt_wait_all(snd, NULL, n, KVF_POLL_SUCCESS, 60);
    long failed = (f1 < 0 || f2 < 0 || f3 < 0 || f4 < 0) ? (long)n : f3 + f4;

    /* Page indices: one uint32 per page, held by the caller and the engine. */
    double idx_bytes = 4.0;
    double dec_b = (double)(rss1 - rss0) * 1024.0 / n - idx_bytes;
    double pre_b = (double)(rss2 - rss1) * 1024.0 / n - idx_bytes;
    printf("{\"rooms\":%u,\"transport\":\"%s\",\"decode_bytes_per_room\":%.1f,"
           "\"prefill_bytes_per_room\":%.1f,\"per_room_bytes\":%.1f,"
           "\"poll_pass_ms_decode\":%.4f,\"poll_pass_ms_prefill\":%.4f,"
           "\"poll_pass_ms\":%.4f,\"poll_pass_max_ms\":%.4f,"
           "\"complete_s\":%.4f,\"rooms_per_s\":%.1f,\"failed\":%ld,"
           "\"rss_kb\":[%ld,%ld,%ld]}\n", n, kvf_engine_transport(dec.eng),
           dec_b, pre_b, dec_b > pre_b ? dec_b : pre_b, dpass, ppass,
           dpass > ppass ? dpass : ppass, dmax > pmax ? dmax : pmax,
           complete, n / complete, failed, rss0, rss1, rss2);
    rc = failed ? 1 : 0;
out:
    for (uint32_t i = 0; i < n; i++) {
        if (snd && snd[i])
            kvf_sender_destroy(snd[i]);
        if (rcv && rcv[i])
            kvf_receiver_destroy(rcv[i]);
    }
    if (dec.eng)
        kvf_engine_destroy(dec.eng);
    if (pre.eng)
        kvf_engine_destroy(pre.eng);
    free(pre.kv); free(pre.aux); free(dec.kv); free(dec.aux);
    free(snd); free(rcv); free(idx);
    return rc;
}

/* ------------------------------------------------------------------------ */
/* Application call latency under load                                      */
/* ------------------------------------------------------------------------ */

/*
 * What a scheduler's step pays per kvferry call, and whether a transfer in
 * flight makes it pay more: one-page rooms are created, initialised, sent,
 * polled and destroyed from this (the application) thread, every call
 * timed, first with the engines idle, then while a load thread keeps
 * rooms in flight between the same two engines: two --load-mib rooms
 * streaming (bytes), or --load-rooms one-page rooms (many rooms, each a
 * handful of messages).  The engines are in this process, so both sides'
 * calls are measured.
 */
enum { KVT_C_RCREATE, KVT_C_RINIT, KVT_C_SCREATE, KVT_C_SINIT, KVT_C_SEND, KVT_C_POLL,
       KVT_C_FAILURE, KVT_C_METRIC, KVT_C_SDESTROY, KVT_C_RDESTROY, KVT_C_SABORT,
       KVT_C_RABORT, KVT_C_SHELD, KVT_C_RREMOTE, KVT_C_PREFIX, KVT_C_NULL, KVT_C_WAKE,
       KVT_CALLS };
static const char *const kvt_call_names[KVT_CALLS] = {
    "receiver_create", "receiver_init", "sender_create", "sender_init", "sender_send",
    "poll", "receiver_failure", "sender_metric", "sender_destroy", "receiver_destroy",
    "sender_abort", "receiver_abort", "sender_create_held", "receiver_create_remote",
    "sender_prefix_len", "null_call", "wake_call"
};

typedef struct kvt_samples {
    double *v;
    size_t  n, cap;
} kvt_samples_t;

static int kvt_sample(kvt_samples_t *s, double ms)
{
    if (s->n == s->cap) {
        size_t cap = s->cap ? 2 * s->cap : 4096;
        double *v = realloc(s->v, cap * sizeof(double));
        if (v == NULL)
            return -1;
        s->v = v;
        s->cap = cap;
    }
    s->v[s->n++] = ms;
    return 0;
}

/* The q-quantile of sorted samples. */
static double kvt_quantile(const kvt_samples_t *s, double q)
{
    return s->n ? s->v[(size_t)((double)(s->n - 1) * q)] : 0;
}

/* {"p50":..,"p99":..,"p999":..,"max":..,"n":..} of each call's samples
 * (sorted here). */
static void kvt_print_calls(kvt_samples_t *c, double *p99, double *p999, double *max)
{
    printf("{");
    for (int k = 0; k < KVT_CALLS; k++) {
        kvt_samples_t *s = &c[k];
        qsort(s->v, s->n, sizeof(double), kvt_cmp_d);
        p99[k] = kvt_quantile(s, 0.99);
        p999[k] = kvt_quantile(s, 0.999);
        max[k] = kvt_quantile(s, 1.0);
        /* Nanosecond steps: most calls last a fraction of a microsecond. */
        printf("%s\"%s\":{\"p50_ms\":%.6f,\"p99_ms\":%.6f,\"p999_ms\":%.6f,"
               "\"max_ms\":%.6f,\"n\":%zu}", k ? "," : "", kvt_call_names[k],
               kvt_quantile(s, 0.5), p99[k], p999[k], max[k], s->n);
    }
    printf("}");
}

/* Each call's p99 and p99.9 as a ratio to the null call's, in one phase:
 * {"call":{"p99":x,"p999":y},...}; the worst of each into *w99, *w999. */
static void kvt_print_vs_null(const double *p99, const double *p999, double *w99,
                              double *w999)
{
    printf("{");
    *w99 = *w999 = 0;
    for (int k = 0; k < KVT_C_NULL; k++) {
        double a = p99[KVT_C_NULL] > 0 ? p99[k] / p99[KVT_C_NULL] : 0;
        double b = p999[KVT_C_NULL] > 0 ? p999[k] / p999[KVT_C_NULL] : 0;
        printf("%s\"%s\":{\"p99\":%.2f,\"p999\":%.2f}", k ? "," : "", kvt_call_names[k],
               a, b);
        *w99 = a > *w99 ? a : *w99;
        *w999 = b > *w999 ? b : *w999;
    }
    printf("}");
}

typedef struct kvt_load {
    kvt_side_t     *pre, *dec;
    const char     *reg;
    uint32_t        nrooms;         /* in flight at a time */
    uint32_t        first, pages;   /* room k's pages: first + k * pages */
    pthread_mutex_t lock;
    int             stop, streaming, failed;
    uint64_t        rooms, bytes;
} kvt_load_t;

/* ld->nrooms rooms in flight at a time, over and over, until told to stop. */
static void *kvt_load_main(void *arg)
{
    kvt_load_t *ld = arg;
    uint32_t nr = ld->nrooms;
    uint32_t *idx = malloc((size_t)nr * ld->pages * sizeof(uint32_t));
    kvf_sender_t **snd = calloc(nr, sizeof(*snd));
    kvf_receiver_t **rcv = calloc(nr, sizeof(*rcv));
    uint64_t id = 1ull << 41;
    if (idx == NULL || snd == NULL || rcv == NULL) {
        pthread_mutex_lock(&ld->lock);
        ld->failed = 1;
        pthread_mutex_unlock(&ld->lock);
        goto out;
    }
    for (uint32_t i = 0; i < nr * ld->pages; i++)
        idx[i] = ld->first + i;
    for (;;) {
        pthread_mutex_lock(&ld->lock);
        int stop = ld->stop;
        pthread_mutex_unlock(&ld->lock);
        if (stop)
            break;
        memset(snd, 0, nr * sizeof(*snd));
        memset(rcv, 0, nr * sizeof(*rcv));
        int bad = 0;
        for (uint32_t k = 0; k < nr && !bad; k++, id++)
            bad = kvf_receiver_create(ld->dec->eng, ld->reg, id, -1, &rcv[k]) != KVF_OK ||
                  kvf_receiver_init(rcv[k], idx + k * ld->pages, ld->pages, 64 + k, NULL,
                                    0) != KVF_OK ||
                  kvf_sender_create(ld->pre->eng, ld->reg, id, &snd[k]) != KVF_OK;
        bad = bad || kvt_wait_all(snd, NULL, nr, KVF_POLL_WAITING_FOR_INPUT, 60) != 0;
        for (uint32_t k = 0; k < nr && !bad; k++)
            bad = kvf_sender_init(snd[k], ld->pages, 64 + k) != KVF_OK ||
                  kvf_sender_send(snd[k], idx + k * ld->pages, ld->pages, 1) != KVF_OK;
        if (!bad) {
            pthread_mutex_lock(&ld->lock);
            ld->streaming = 1;
            pthread_mutex_unlock(&ld->lock);
        }
        bad = bad || kvt_wait_all(NULL, rcv, nr, KVF_POLL_SUCCESS, 120) != 0 ||
              kvt_wait_all(snd, NULL, nr, KVF_POLL_SUCCESS, 120) != 0;
        for (uint32_t k = 0; k < nr; k++) {
            kvf_sender_destroy(snd[k]);
            kvf_receiver_destroy(rcv[k]);
        }
        pthread_mutex_lock(&ld->lock);
        ld->failed |= bad;
        ld->rooms += bad ? 0 : nr;
        ld->bytes += bad ? 0 : nr * (uint64_t)ld->pages * (ld->pre->kv_len / ld->pre->npages);
        stop = ld->failed;
        pthread_mutex_unlock(&ld->lock);
        if (stop)
            break;
    }
out:
    free(idx);
    free(snd);
    free(rcv);
    return NULL;
}

static double kvt_ms_since(double t)
{
    return (kvt_now_s() - t) * 1e3;
}

/* The null call, timed where the call before it was: the same thread, the
 * same moment's load. */
static void kvt_null_beside(kvt_samples_t *c)
{
    double t = kvt_now_s();
    kvf_null_call();
    kvt_sample(&c[KVT_C_NULL], kvt_ms_since(t));
}

/*
 * The wake call, the other baseline: one eventfd write that wakes a thread
 * asleep in epoll_wait, as a call that hands work to a sleeping lane must
 * make (the engine's lanes sleep so).  One after each room, timed with
 * its calls: the room's own calls leave the sleeper time to fall asleep
 * again; if it has not, that write costs less, so the figure is a floor.
 */
typedef struct kvt_sleeper {
    int        efd, ep;
    sem_t      woke;      /* posted after each wake */
    atomic_int stop;
    pthread_t  th;
} kvt_sleeper_t;

static void *kvt_sleeper_main(void *arg)
{
    kvt_sleeper_t *z = arg;
    for (;;) {
        struct epoll_event ev;
        uint64_t v;
        int k = epoll_wait(z->ep, &ev, 1, 100);     /* the timeout: to see stop */
        if (atomic_load(&z->stop))
            return NULL;
        if (k == 1 && read(z->efd, &v, sizeof(v)) == sizeof(v))
            sem_post(&z->woke);
    }
}

static void kvt_sleeper_close(kvt_sleeper_t *z)
{
    if (z->efd >= 0)
        close(z->efd);
    if (z->ep >= 0)
        close(z->ep);
}

/* @return 0, or -1 (said on stderr). */
static int kvt_sleeper_start(kvt_sleeper_t *z)
{
    *z = (kvt_sleeper_t){.efd = eventfd(0, EFD_NONBLOCK), .ep = epoll_create1(0)};
    struct epoll_event ev = {.events = EPOLLIN};
    if (z->efd < 0 || z->ep < 0 || epoll_ctl(z->ep, EPOLL_CTL_ADD, z->efd, &ev) != 0 ||
        sem_init(&z->woke, 0, 0) != 0) {
        fprintf(stderr, "kvferry bench --call-latency: the wake call's eventfd: %s\n",
                strerror(errno));
        kvt_sleeper_close(z);
        return -1;
    }
    if (pthread_create(&z->th, NULL, kvt_sleeper_main, z) != 0) {
        fprintf(stderr, "kvferry bench --call-latency: no thread for the wake call\n");
        sem_destroy(&z->woke);
        kvt_sleeper_close(z);
        return -1;
    }
    return 0;
}

static void kvt_sleeper_stop(kvt_sleeper_t *z)
{
    atomic_store(&z->stop, 1);
    pthread_join(z->th, NULL);
    sem_destroy(&z->woke);
    kvt_sleeper_close(z);
}

/* One wake call into c[KVT_C_WAKE], back once the sleeper woke.
 * @return 0, or -1 (said on stderr). */
static int kvt_wake_call(kvt_sleeper_t *z, kvt_samples_t *c)
{
    uint64_t one = 1;
    double t = kvt_now_s();
    if (write(z->efd, &one, sizeof(one)) != sizeof(one)) {
        fprintf(stderr, "kvferry bench --call-latency: eventfd write: %s\n", strerror(errno));
        return -1;
    }
    kvt_sample(&c[KVT_C_WAKE], kvt_ms_since(t));
    while (sem_wait(&z->woke) != 0 && errno == EINTR)
        ;
    return 0;
}

/* Until both sides of a room reach `want` (WAITING_FOR_INPUT: or pass it;
 * FAILED: both failed), polling at a scheduler step's pace: 0, or -1 when
 * one failed unasked or after 30 s. */
static int kvt_await_rooms(kvf_sender_t *s, kvf_receiver_t *r, kvf_poll_t want)
{
    int failed = want == KVF_POLL_FAILED;
    for (double until = kvt_now_s() + 30; kvt_now_s() < until;) {
        kvf_poll_t ps = kvf_sender_poll(s), ds = kvf_receiver_poll(r);
        if (failed ? ps == KVF_POLL_FAILED && ds == KVF_POLL_FAILED
                   : ps >= want && ds >= want)
            return 0;
        if (!failed && (ps == KVF_POLL_FAILED || ds == KVF_POLL_FAILED))
            return -1;
        struct timespec ts = {0, 20000};
        nanosleep(&ts, NULL);
    }
    return -1;
}

/* A room the application aborts while it is live (waiting for its
 * input), on the decode side (`rx`) or the prefill side, that call timed
 * into c[]; then its other side learns it, and both are destroyed.
 * @return 0, or -1 (said on stderr). */
static int kvt_aborted_room(kvt_side_t *pre, kvt_side_t *dec, const char *reg, uint64_t id,
                            uint32_t page, int rx, kvt_samples_t *c)
{
    kvf_sender_t *s = NULL;
    kvf_receiver_t *r = NULL;
    int bad = kvf_receiver_create(dec->eng, reg, id, -1, &r) != KVF_OK ||
              kvf_receiver_init(r, &page, 1, page, NULL, 0) != KVF_OK ||
              kvf_sender_create(pre->eng, reg, id, &s) != KVF_OK ||
              kvt_await_rooms(s, r, KVF_POLL_WAITING_FOR_INPUT) != 0;
    if (!bad) {
        double t = kvt_now_s();
        if (rx)
            kvf_receiver_abort(r);
        else
            kvf_sender_abort(s);
        kvt_sample(&c[rx ? KVT_C_RABORT : KVT_C_SABORT], kvt_ms_since(t));
        kvt_null_beside(c);
        bad = kvt_await_rooms(s, r, KVF_POLL_FAILED) != 0;
    }
    if (s != NULL)
        kvf_sender_destroy(s);
    if (r != NULL)
        kvf_receiver_destroy(r);
    if (bad)
        fprintf(stderr, "kvferry bench --call-latency: aborted room %llu did not fail on "
                "both sides\n", (unsigned long long)id);
    return bad ? -1 : 0;
}

/* A room as vLLM's connector moves it: the prefill holds its page first
 * (kvf_sender_create_held, then init and send at once), the decode reads
 * it by the prefill's descriptor (kvf_receiver_create_remote); both
 * creates timed into c[], the room waited for and destroyed.
 * @return 0, or -1 (said on stderr). */
static int kvt_held_room(kvt_side_t *pre, kvt_side_t *dec, uint64_t id, uint32_t page,
                         kvt_samples_t *c)
{
    kvf_sender_t *s = NULL;
    kvf_receiver_t *r = NULL;
    char text[KVF_DESCRIPTOR_MAX];
    const char *desc = text;     /* what the prefill hands the decode, via vLLM */
    if (kvf_engine_descriptor(pre->eng, text, sizeof(text)) != KVF_OK) {
        fprintf(stderr, "kvferry bench --call-latency: no descriptor of the prefill engine\n");
        return -1;
    }
    kvf_hold_t h;
    kvf_hold_init(&h);
    double t = kvt_now_s();
    int bad = kvf_sender_create_held(pre->eng, id, &h, &s) != KVF_OK;
    kvt_sample(&c[KVT_C_SHELD], kvt_ms_since(t));
    kvt_null_beside(c);
    bad = bad || kvf_sender_init(s, 1, page) != KVF_OK ||
          kvf_sender_send(s, &page, 1, 1) != KVF_OK;
    kvf_remote_t rm;
    kvf_remote_init(&rm);
    rm.room = id;
    rm.descriptors = &desc;
    rm.num_descriptors = 1;
    t = kvt_now_s();
    bad = bad || kvf_receiver_create_remote(dec->eng, &rm, &r) != KVF_OK;
    kvt_sample(&c[KVT_C_RREMOTE], kvt_ms_since(t));
    kvt_null_beside(c);
    bad = bad || kvf_receiver_init(r, &page, 1, page, NULL, 0) != KVF_OK ||
          kvt_await_rooms(s, r, KVF_POLL_SUCCESS) != 0;
    if (s != NULL)
        kvf_sender_destroy(s);
    if (r != NULL)
        kvf_receiver_destroy(r);
    if (bad)
        fprintf(stderr, "kvferry bench --call-latency: held room %llu did not succeed\n",
                (unsigned long long)id);
    return bad ? -1 : 0;
}

/* A sender WAITING_FOR_INPUT asked for the decode's prefix (as SGLang's
 * prefill does then), initialised and sent its page, each call timed into
 * c[]: 0, or -1 if one refused. */
static int kvt_sender_go(kvf_sender_t *s, uint32_t page, uint32_t slot, kvt_samples_t *c)
{
    uint32_t prefix;
    double t = kvt_now_s();
    int bad = kvf_sender_decode_prefix_len(s, &prefix) != KVF_OK || prefix != 0;
    kvt_sample(&c[KVT_C_PREFIX], kvt_ms_since(t));
    kvt_null_beside(c);
    t = kvt_now_s();
    bad = bad || kvf_sender_init(s, 1, slot) != KVF_OK;
    kvt_sample(&c[KVT_C_SINIT], kvt_ms_since(t));
    kvt_null_beside(c);
    t = kvt_now_s();
    bad = bad || kvf_sender_send(s, &page, 1, 1) != KVF_OK;
    kvt_sample(&c[KVT_C_SEND], kvt_ms_since(t));
    kvt_null_beside(c);
    return bad ? -1 : 0;
}

/* n one-page rooms, one after the other, every call timed into c[], then
 * a room aborted on one side or the other and a held room read by
 * descriptor, and a wake call of z's after each. */
static int kvt_small_rooms(kvt_side_t *pre, kvt_side_t *dec, kvt_sleeper_t *z,
                           const char *reg, uint32_t n, uint64_t id0, kvt_samples_t *c)
{

    for (uint32_t i = 0; i < n; i++) {
        uint32_t page = i % 64, slot = i % 64;
        uint64_t id = id0 + i;
        kvf_sender_t *s = NULL;
        kvf_receiver_t *r = NULL;
        double t = kvt_now_s();
        int bad = kvf_receiver_create(dec->eng, reg, id, -1, &r) != KVF_OK;
        kvt_sample(&c[KVT_C_RCREATE], kvt_ms_since(t));
        kvt_null_beside(c);
        t = kvt_now_s();
        bad = bad || kvf_receiver_init(r, &page, 1, slot, NULL, 0) != KVF_OK;
        kvt_sample(&c[KVT_C_RINIT], kvt_ms_since(t));
        kvt_null_beside(c);
        t = kvt_now_s();
        bad = bad || kvf_sender_create(pre->eng, reg, id, &s) != KVF_OK;
        kvt_sample(&c[KVT_C_SCREATE], kvt_ms_since(t));
        kvt_null_beside(c);
        int stage = 0;    /* 0: wait for WAITING_FOR_INPUT, 1: for SUCCESS */
        double until = kvt_now_s() + 30;
        while (!bad) {
            t = kvt_now_s();
            kvf_poll_t ps = kvf_sender_poll(s), ds = kvf_receiver_poll(r);
            kvt_sample(&c[KVT_C_POLL], kvt_ms_since(t) / 2);
            kvt_null_beside(c);
            if (ps == KVF_POLL_FAILED || ds == KVF_POLL_FAILED || kvt_now_s() > until) {
                bad = 1;
            } else if (stage == 0 && ps >= KVF_POLL_WAITING_FOR_INPUT) {
                bad = kvt_sender_go(s, page, slot, c) != 0;
                stage = 1;
            } else if (stage == 1 && ps == KVF_POLL_SUCCESS && ds == KVF_POLL_SUCCESS) {
                break;
            } else {
                struct timespec ts = {0, 20000};   /* a scheduler step's pace */
                nanosleep(&ts, NULL);
            }
        }
        /* A scheduler asks for a record once poll says FAILED; on this
         * room, which succeeded, the call answers KVF_ERR_AGAIN, the same
         * way (a failed room's adds the copy of one record).  Then for
         * what the room cost (SGLang's KVTransferMetric). */
        if (!bad) {
            kvf_failure_t f;
            kvf_failure_init(&f);
            t = kvt_now_s();
            bad = kvf_receiver_failure(r, &f) != KVF_ERR_AGAIN;
            kvt_sample(&c[KVT_C_FAILURE], kvt_ms_since(t));
            kvt_null_beside(c);
            kvf_room_metric_t m = {.size = sizeof(m)};   /* what it cost */
            t = kvt_now_s();
            bad = bad || kvf_sender_metric(s, &m) != KVF_OK || m.bytes == 0;
            kvt_sample(&c[KVT_C_METRIC], kvt_ms_since(t));
            kvt_null_beside(c);
        }
        t = kvt_now_s();
        kvf_sender_destroy(s);
        kvt_sample(&c[KVT_C_SDESTROY], kvt_ms_since(t));
        kvt_null_beside(c);
        t = kvt_now_s();
        kvf_receiver_destroy(r);
        kvt_sample(&c[KVT_C_RDESTROY], kvt_ms_since(t));
        kvt_null_beside(c);
        if (bad) {
            fprintf(stderr, "kvferry bench --call-latency: small room %u failed\n", i);
            return -1;
        }
        if (kvt_aborted_room(pre, dec, reg, (1ull << 40) + id, page, (int)(i & 1), c) != 0 ||
            kvt_held_room(pre, dec, (1ull << 39) + id, page, c) != 0)
            return -1;
        if (kvt_wake_call(z, c) != 0)
            return -1;
    }
    return 0;
}

static int kvt_bench_calls(uint32_t n, uint32_t load_mib, uint32_t load_rooms,
                           const char *transport)
{
    kvt_geom_t g;
    /* Page size 1: a one-page room is 128 KiB, a 1 GiB room 8192 pages. */
    kvt_geom_init(&g, kvt_model_find("llama3-8b"), kvt_dtype_find("bfloat16"), 1, 0, 1);
    size_t page_all = g.page_bytes * g.num_buffers;
    uint32_t big = load_rooms ? 1 : (uint32_t)(((uint64_t)load_mib << 20) / page_all);
    uint32_t nload = load_rooms ? load_rooms : 2;
    uint32_t pages = 64 + nload * big;
    kvt_side_t pre = {0}, dec = {0};
    kvt_samples_t idle[KVT_CALLS] = {{0}}, load[KVT_CALLS] = {{0}};
    kvt_load_t ld = {0};
    pthread_t th;
    kvt_sleeper_t sleeper;
    int started = 0, sleeping = 0, rc = 1;
    char reg[KVF_ADDR_MAX];

    if (big == 0) {
        fprintf(stderr, "kvferry bench --call-latency: --load-mib below one page\n");
        return 2;
    }
    if (kvt_side_make(&pre, KVF_ROLE_PREFILL, &g, pages, transport, "127.0.0.1:0") ||
        kvf_engine_bootstrap_addr(pre.eng, reg, sizeof(reg)) != KVF_OK ||
        kvt_side_make(&dec, KVF_ROLE_DECODE, &g, pages, transport, NULL))
        goto out;
    if (kvt_sleeper_start(&sleeper) != 0)
        goto out;
    sleeping = 1;
    if (kvt_small_rooms(&pre, &dec, &sleeper, reg, 16, 1, idle) != 0)   /* warm up */
        goto out;
    for (int k = 0; k < KVT_CALLS; k++)
        idle[k].n = 0;
    if (kvt_small_rooms(&pre, &dec, &sleeper, reg, n, 1000, idle) != 0)
        goto out;

    ld = (kvt_load_t){.pre = &pre, .dec = &dec, .reg = reg, .nrooms = nload, .first = 64,
                      .pages = big};
    pthread_mutex_init(&ld.lock, NULL);
    if (pthread_create(&th, NULL, kvt_load_main, &ld) != 0)
        goto out;
    started = 1;
    for (double until = kvt_now_s() + 60;;) {     /* bytes must be flowing */
        pthread_mutex_lock(&ld.lock);
        int go = ld.streaming || ld.failed;
        pthread_mutex_unlock(&ld.lock);
        if (go || kvt_now_s() > until)
            break;
        struct timespec ts = {0, 1000000};
        nanosleep(&ts, NULL);
    }
    double t0 = kvt_now_s();
    int small = kvt_small_rooms(&pre, &dec, &sleeper, reg, n, 1000000, load);
    double dt = kvt_now_s() - t0;
    pthread_mutex_lock(&ld.lock);
    ld.stop = 1;
    pthread_mutex_unlock(&ld.lock);
    pthread_join(th, NULL);
    started = 0;
    if (small != 0 || ld.failed || !ld.streaming) {
        fprintf(stderr, "kvferry bench --call-latency: the load rooms %s\n",
                ld.failed ? "failed" : "did not start");
        goto out;
    }

    double ip99[KVT_CALLS], ip999[KVT_CALLS], imax[KVT_CALLS];
    double lp99[KVT_CALLS], lp999[KVT_CALLS], lmax[KVT_CALLS], w99, w999;
    kvf_engine_params_t defaults;   /* what kvt_side_make left as it was */
    kvf_engine_params_init(&defaults);
    printf("{\"rooms\":%u,\"transport\":\"%s\",\"load_mib\":%u,\"load_in_flight\":%u,"
           "\"busy_poll_us\":%u,\"idle\":", n, kvf_engine_transport(dec.eng),
           load_rooms ? 0 : load_mib, nload, defaults.busy_poll_us);
    kvt_print_calls(idle, ip99, ip999, imax);
    printf(",\"load\":");
    kvt_print_calls(load, lp99, lp999, lmax);
    printf(",\"idle_vs_null\":");
    kvt_print_vs_null(ip99, ip999, &w99, &w999);
    printf(",\"load_vs_null\":");
    kvt_print_vs_null(lp99, lp999, &w99, &w999);
    printf(",\"worst_p99_vs_null\":%.2f,\"worst_p999_vs_null\":%.2f", w99, w999);
    printf(",\"wake_vs_null\":{\"idle\":{\"p99\":%.2f,\"p999\":%.2f},"
           "\"load\":{\"p99\":%.2f,\"p999\":%.2f}}",
           ip99[KVT_C_NULL] > 0 ? ip99[KVT_C_WAKE] / ip99[KVT_C_NULL] : 0,
           ip999[KVT_C_NULL] > 0 ? ip999[KVT_C_WAKE] / ip999[KVT_C_NULL] : 0,
           lp99[KVT_C_NULL] > 0 ? lp99[KVT_C_WAKE] / lp99[KVT_C_NULL] : 0,
           lp999[KVT_C_NULL] > 0 ? lp999[KVT_C_WAKE] / lp999[KVT_C_NULL] : 0);
    double worst_ratio = 0, worst_max = 0;
    printf(",\"p99_ratio\":{");
    for (int k = 0; k < KVT_C_NULL; k++) {
        double x = ip99[k] > 0 ? lp99[k] / ip99[k] : 0;
        printf("%s\"%s\":%.2f", k ? "," : "", kvt_call_names[k], x);
        worst_ratio = x > worst_ratio ? x : worst_ratio;
        worst_max = lmax[k] > worst_max ? lmax[k] : worst_max;
    }
    printf("},\"worst_p99_ratio\":%.2f,\"worst_max_ms_under_load\":%.4f,"
           "\"load_rooms\":%llu,\"load_gbps\":%.3f}\n", worst_ratio, worst_max,
           (unsigned long long)ld.rooms, dt > 0 ? (double)ld.bytes / dt / 1e9 : 0);
    rc = 0;
out:
    if (started) {
        pthread_mutex_lock(&ld.lock);
        ld.stop = 1;
        pthread_mutex_unlock(&ld.lock);
        pthread_join(th, NULL);
    }
    if (sleeping)
        kvt_sleeper_stop(&sleeper);
    if (dec.eng)
        kvf_engine_destroy(dec.eng);
    if (pre.eng)
        kvf_engine_destroy(pre.eng);
    free(pre.kv); free(pre.aux); free(dec.kv); free(dec.aux);
    for (int k = 0; k < KVT_CALLS; k++) {
        free(idle[k].v);
        free(load[k].v);
    }
    return rc;
}

int kvt_bench_micro_main(int argc, char **argv)
{
    uint32_t mib = 256, repeats = 9, rooms = 0, calls = 1000, load_mib = 1024, load_rooms = 0;
    if (kvt_arg_u32(argc, argv, "--mib", &mib) ||
        kvt_arg_u32(argc, argv, "--repeats", &repeats) ||
        kvt_arg_u32(argc, argv, "--rooms-in-flight", &rooms) ||
        kvt_arg_u32(argc, argv, "--rooms", &calls) ||
        kvt_arg_u32(argc, argv, "--load-mib", &load_mib) ||
        kvt_arg_u32(argc, argv, "--load-rooms", &load_rooms))
        return 2;
    for (int i = 2; i < argc; i++) {
        if (strcmp(argv[i], "--memcpy") == 0)
            return kvt_bench_memcpy(mib, repeats);
        if (strcmp(argv[i], "--call-latency") == 0)
            return kvt_bench_calls(calls, load_mib, load_rooms,
                                   kvt_arg_str(argc, argv, "--transport"));
    }
    if (!rooms) {
        fprintf(stderr, "kvferry bench: --rooms-in-flight N needs a count\n");
        return 2;
    }
    return kvt_bench_rooms(rooms, kvt_arg_str(argc, argv, "--transport"));
}
