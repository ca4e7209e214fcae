/*
 * `kvferry bench`: throughput, room latency, CPU and memory of a real
 * prefill/decode pair, in separate processes, on this host.
 *
 * It is the demo's deployment (orch.c: a registry, --prefill-tp prefill
 * and --decode-tp decode rank processes) with the ranks in bench mode
 * (bench_rank.c): no data generation or verification in the timed path,
 * nothing per room on the pipes while the clock runs.  Each rank reports,
 * once at the end, its window (CLOCK_MONOTONIC, one clock for the whole
 * host), its CPU time over that window (getrusage: every thread of the
 * process, the engine's included), its peak RSS and one timestamp per
 * room.  From those:
 *
 *   bytes         payload placed in decode memory: the sum over decode
 *                 ranks of what each received (its heads of every room).
 *                 With unequal TP this is the transfer's total payload, the
 *                 same as the prefill ranks' sum; where data is replicated
 *                 (MLA, GQA heads shared by ranks) it counts every copy that
 *                 was delivered, and a prefill rank that sends nothing (MLA
 *                 with prefill TP > decode TP) counts nothing.
 *   gbps          bytes / (last rank's end - first rank's start), 1e9 B/s
 *   rooms_per_s   rooms that succeeded on every rank / the same window
 *   p50/p99_ms    per room: latest decode SUCCESS - latest prefill send of
 *                 the last chunk (nearest-rank percentiles)
 *   cpu_s_per_gb  CPU seconds of the rank processes per GB of payload;
 *                 per side and both together
 *   peak_rss_mb   the largest rank process (each one is in "ranks")
 *
 * A room counts as failed unless every rank saw it succeed; any failed
 * room makes the exit status 1.
 *
 * --relay measures siblings instead (bench_rank.c): prefill rank 0 aborts
 * every room after its first chunk and each rank times its room's
 * failure.  Per room, the relay latency is the last rank's FAILED minus
 * the abort (p50/p99/max over rooms), the first sibling's too; a room
 * counts as relayed when every rank failed it naming that abort, and any
 * other room makes the exit status 1.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <jansson.h>

#include "bench_micro.h"
#include "kvferry/kvferry.h"
#include "models.h"
#include "opts.h"
#include "orch.h"
#include "plot.h"
#include "progress.h"
#include "tool.h"

typedef struct kvt_bench {
    kvt_opts_t  o;
    kvt_orch_t  orch;
    json_t    **results;      /* per child index: its "result" event */
    uint32_t   *done;         /* per child index: last progress */
    uint32_t   *failed;
    uint64_t   *bytes;
    int         stop_sent, until_sent;
    uint32_t    admitted_max, admitted_n;
    kvt_progress_t prog;      /* the live line (progress.h) */
    kvt_series_t   series;    /* decode bytes over time, for --plot (plot.h) */
    double         t_end;     /* the run's end, seconds after "go" (the ticks' clock) */
} kvt_bench_t;

static void kvt_bench_on_event(void *ctx, kvt_child_t *c, const char *type,
                               json_t *ev)
{
    kvt_bench_t *b = ctx;
    size_t i = (size_t)(c - b->orch.kids.v);
    if (strcmp(type, "progress") == 0) {
        b->done[i] = (uint32_t)json_integer_value(json_object_get(ev, "done"));
        b->failed[i] = (uint32_t)json_integer_value(json_object_get(ev, "failed"));
        b->bytes[i] = (uint64_t)json_integer_value(json_object_get(ev, "bytes"));
    } else if (strcmp(type, "admitted") == 0) {
        uint32_t n = (uint32_t)json_integer_value(json_object_get(ev, "next"));
        if (n > b->admitted_max)
            b->admitted_max = n;
        b->admitted_n++;
    } else if (strcmp(type, "result") == 0 && !b->results[i]) {
        b->results[i] = json_incref(ev);
    }
}

/* Live progress on a terminal, and the --duration handshake. */
static void kvt_bench_on_tick(void *ctx, uint64_t now)
{
    kvt_bench_t *b = ctx;
    kvt_orch_t *o = &b->orch;
    uint32_t nranks = b->o.prefill_tp + b->o.decode_tp;
    if (now < o->go_at_ms)
        return;   /* "go" went out after this turn's clock reading */
    if (b->o.duration && !b->stop_sent &&
        now - o->go_at_ms >= (uint64_t)b->o.duration * 1000) {
        kvt_orch_send_ranks(o, "stop\n");
        b->stop_sent = 1;
    }
    if (b->stop_sent && !b->until_sent && b->admitted_n == nranks) {
        char line[64];
        snprintf(line, sizeof(line), "until %u\n", b->admitted_max);
        kvt_orch_send_ranks(o, line);
        b->until_sent = 1;
    }
    /* Decode's view: a room is done when decode has it. */
    uint64_t bytes = 0;
    uint32_t done = UINT32_MAX, failed = 0;
    for (size_t i = 0; i < o->kids.n; i++) {
        failed += b->failed[i];
        if (o->kids.v[i].role == KVT_CHILD_DECODE) {
            bytes += b->bytes[i];
            if (b->done[i] < done)
                done = b->done[i];
        }
    }
    kvt_series_add(&b->series, (double)(now - o->go_at_ms) / 1000.0, bytes);
    kvt_progress_show(&b->prog, now, o->go_at_ms, done == UINT32_MAX ? 0 : done,
                      b->o.duration ? 0 : b->o.requests, bytes, failed);
}

/* ------------------------------------------------------------------------ */
/* Figures                                                                  */
/* ------------------------------------------------------------------------ */

static int kvt_cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* Nearest-rank percentile of sorted v[0..n). */
static double kvt_pct(const double *v, size_t n, double p)
{
    if (n == 0)
        return 0;
    size_t k = (size_t)ceil(p / 100.0 * (double)n);
    return v[k ? k - 1 : 0];
}

static json_t *kvt_num(double v)
{
    return json_real(isfinite(v) ? v : 0.0);
}

/* Per side: CPU, memory.  Adds into *cpu_p; returns the side's object. */
static json_t *kvt_bench_side(kvt_bench_t *b, kvt_child_role_t role,
                              double gb, double *cpu_p, double *rss_p,
                              json_t *ranks)
{
    kvt_orch_t *o = &b->orch;
    double cpu = 0, rss = 0, pool = 0;
    for (size_t i = 0; i < o->kids.n; i++) {
        json_t *r = b->results[i];
        if (o->kids.v[i].role != role || !r)
            continue;
        double c = json_real_value(json_object_get(r, "cpu_s"));
        double m = (double)json_integer_value(json_object_get(r, "vm_hwm_kb")) / 1024.0;
        double p = (double)json_integer_value(json_object_get(r, "pool_bytes")) / 1048576.0;
        cpu += c;
        pool += p;
        if (m > rss)
            rss = m;
        json_array_append_new(ranks, json_pack(
            "{s:s, s:o, s:o, s:o, s:o, s:o}", "name", o->kids.v[i].name,
            "cpu_s", kvt_num(c), "cpu_s_per_gb", kvt_num(gb > 0 ? c / gb : 0),
            "peak_rss_mb", kvt_num(m), "kv_pool_mb", kvt_num(p),
            "rss_beyond_pool_mb", kvt_num(m - p)));
    }
    *cpu_p += cpu;
    if (rss > *rss_p)
        *rss_p = rss;
    return json_pack("{s:o, s:o, s:o, s:o}", "cpu_s", kvt_num(cpu),
                     "cpu_s_per_gb", kvt_num(gb > 0 ? cpu / gb : 0),
                     "peak_rss_mb", kvt_num(rss), "kv_pool_mb", kvt_num(pool));
}

/* --relay: per room of [0, rooms) that every rank failed, the abort
 * (times in `cause`) -> the first and the last other rank's FAILED, in ms.
 * @return how many rooms. */
static size_t kvt_relay_times(kvt_bench_t *b, json_t *cause, uint32_t rooms,
                              double *first, double *last)
{
    kvt_orch_t *o = &b->orch;
    size_t n = 0;
    for (uint32_t k = 0; k < rooms; k++) {
        int64_t t0 = json_integer_value(json_array_get(cause, k)), lo = INT64_MAX, hi = 0;
        for (size_t i = 0; i < o->kids.n && t0 > 0; i++) {
            json_t *times = json_object_get(b->results[i], "times_ns");
            if (times == NULL || times == cause)
                continue;                        /* the registry, the aborting rank */
            int64_t t = json_integer_value(json_array_get(times, k));
            if (t == 0) {                        /* not relayed there */
                hi = 0;
                break;
            }
            lo = t < lo ? t : lo;
            hi = t > hi ? t : hi;
        }
        if (t0 <= 0 || hi == 0)
            continue;
        first[n] = (double)(lo - t0) * 1e-6;
        last[n++] = (double)(hi - t0) * 1e-6;
    }
    return n;
}

/* --relay: per room, how long the abort took to reach every rank. */
static json_t *kvt_bench_relay_figures(kvt_bench_t *b, int *ok_p)
{
    kvt_orch_t *o = &b->orch;
    json_t *cause = NULL;
    uint32_t rooms = UINT32_MAX;
    int missing = 0;
    for (size_t i = 0; i < o->kids.n; i++) {
        json_t *r = b->results[i];
        if (o->kids.v[i].role == KVT_CHILD_REGISTRY)
            continue;
        if (!r) {
            missing++;
            continue;
        }
        uint32_t n = (uint32_t)json_integer_value(json_object_get(r, "rooms"));
        rooms = n < rooms ? n : rooms;
        if (o->kids.v[i].role == KVT_CHILD_PREFILL && o->kids.v[i].rank == 0)
            cause = json_object_get(r, "times_ns");
    }
    if (missing || !cause || rooms == UINT32_MAX)
        rooms = 0;
    double *last = calloc(rooms ? rooms : 1, sizeof(double));
    double *first = calloc(rooms ? rooms : 1, sizeof(double));
    size_t n = last && first ? kvt_relay_times(b, cause, rooms, first, last) : 0;
    json_t *failures = json_array();
    for (size_t i = 0; i < o->kids.n; i++) {
        size_t j;
        json_t *f;
        json_array_foreach(json_object_get(b->results[i], "failures"), j, f) {
            json_t *g = json_copy(f);
            json_object_set_new(g, "rank", json_string(o->kids.v[i].name));
            json_array_append_new(failures, g);
        }
    }
    if (n) {
        qsort(last, n, sizeof(double), kvt_cmp_double);
        qsort(first, n, sizeof(double), kvt_cmp_double);
    }
    *ok_p = !missing && rooms > 0 && n == rooms && !o->error[0] && !o->timed_out &&
            !o->signal;
    const kvt_opts_t *p = &b->o;
    json_t *out = json_pack(
        "{s:b, s:i, s:i, s:o, s:o, s:o, s:o, s:o, s:o, s:o,"
        " s:{s:s, s:i, s:i, s:i, s:i, s:i, s:s}}",
        "ok", *ok_p, "rooms", (int)rooms, "relayed", (int)n,
        "relay_p50_ms", kvt_num(kvt_pct(last, n, 50)),
        "relay_p99_ms", kvt_num(kvt_pct(last, n, 99)),
        "relay_max_ms", kvt_num(n ? last[n - 1] : 0),
        "first_p50_ms", kvt_num(kvt_pct(first, n, 50)),
        "first_p99_ms", kvt_num(kvt_pct(first, n, 99)),
        "failures", failures, "ranks", json_integer((json_int_t)(p->prefill_tp + p->decode_tp)),
        "config", "model", p->model, "tokens", (int)p->tokens, "chunk", (int)p->chunk,
        "concurrency", (int)p->concurrency, "prefill_tp", (int)p->prefill_tp,
        "decode_tp", (int)p->decode_tp,
        "transport", o->transport[0] ? o->transport : "unknown");
    if (out && o->error[0])
        json_object_set_new(out, "error", json_string(o->error));
    free(last);
    free(first);
    return out;
}

static void kvt_bench_relay_print(FILE *f, json_t *j)
{
    json_t *c = json_object_get(j, "config");
#define NUM(o, k) json_number_value(json_object_get(o, k))
    fprintf(f, "kvferry bench --relay: TP %d->%d, %d rooms, transport %s\n",
            (int)NUM(c, "prefill_tp"), (int)NUM(c, "decode_tp"), (int)NUM(j, "rooms"),
            json_string_value(json_object_get(c, "transport")));
    fprintf(f, "  relayed      %d of %d rooms failed on every rank naming prefill rank 0's "
            "abort\n", (int)NUM(j, "relayed"), (int)NUM(j, "rooms"));
    fprintf(f, "  last rank    p50 %.3f ms, p99 %.3f ms, max %.3f ms (abort -> the last "
            "sibling's FAILED)\n", NUM(j, "relay_p50_ms"), NUM(j, "relay_p99_ms"),
            NUM(j, "relay_max_ms"));
    fprintf(f, "  first rank   p50 %.3f ms, p99 %.3f ms\n", NUM(j, "first_p50_ms"),
            NUM(j, "first_p99_ms"));
    size_t i;
    json_t *r;
    json_array_foreach(json_object_get(j, "failures"), i, r)
        fprintf(f, "  FAILED       room %d on %s: %s: %s\n", (int)NUM(r, "index"),
                json_string_value(json_object_get(r, "rank")),
                json_string_value(json_object_get(r, "status")),
                json_string_value(json_object_get(r, "reason")));
    fprintf(f, "  result       %s\n", json_is_true(json_object_get(j, "ok"))
            ? "every rank of every room named the abort" : "FAILED: see above");
#undef NUM
}

/* The figures as one JSON object; *ok_p = 1 if every room succeeded. */
static json_t *kvt_bench_figures(kvt_bench_t *b, int *ok_p, double **lat_p, size_t *nlat_p)
{
    if (b->o.relay)
        return kvt_bench_relay_figures(b, ok_p);
    kvt_orch_t *o = &b->orch;
    uint32_t rooms = UINT32_MAX;
    int64_t t0 = INT64_MAX, t1 = 0;
    double bytes = 0, prefill_bytes = 0;
    int missing = 0;
    for (size_t i = 0; i < o->kids.n; i++) {
        json_t *r = b->results[i];
        if (o->kids.v[i].role == KVT_CHILD_REGISTRY)
            continue;
        if (!r) {
            missing++;
            continue;
        }
        uint32_t n = (uint32_t)json_integer_value(json_object_get(r, "rooms"));
        int64_t a = json_integer_value(json_object_get(r, "t0_ns"));
        int64_t z = json_integer_value(json_object_get(r, "t1_ns"));
        rooms = n < rooms ? n : rooms;
        t0 = a < t0 ? a : t0;
        t1 = z > t1 ? z : t1;
        double rb = (double)json_integer_value(json_object_get(r, "bytes"));
        if (o->kids.v[i].role == KVT_CHILD_DECODE)
            bytes += rb;
        else if (o->kids.v[i].role == KVT_CHILD_PREFILL)
            prefill_bytes += rb;
    }
    if (missing || rooms == UINT32_MAX)
        rooms = 0;
    double secs = t1 > t0 ? (double)(t1 - t0) * 1e-9 : 0;

    /* Per room: succeeded on every rank, and its latency. */
    double *lat = calloc(rooms ? rooms : 1, sizeof(double));
    size_t nlat = 0;
    uint32_t ok_rooms = 0;
    json_t *failures = json_array();
    for (uint32_t k = 0; k < rooms && lat; k++) {
        int64_t send = 0, succ = 0;
        int ok = 1;
        for (size_t i = 0; i < o->kids.n; i++) {
            json_t *r = b->results[i];
            if (!r)
                continue;
            int64_t t = json_integer_value(json_array_get(json_object_get(r, "times_ns"), k));
            if (t == 0)
                ok = 0;
            if (o->kids.v[i].role == KVT_CHILD_PREFILL && t > send)
                send = t;
            if (o->kids.v[i].role == KVT_CHILD_DECODE && t > succ)
                succ = t;
        }
        if (!ok)
            continue;
        ok_rooms++;
        lat[nlat++] = (double)(succ - send) * 1e-6;
    }
    for (size_t i = 0; i < o->kids.n; i++)
        if (b->results[i]) {
            size_t j;
            json_t *f;
            json_array_foreach(json_object_get(b->results[i], "failures"), j, f) {
                json_t *g = json_copy(f);
                json_object_set_new(g, "rank", json_string(o->kids.v[i].name));
                json_array_append_new(failures, g);
            }
        }
    if (lat)
        qsort(lat, nlat, sizeof(double), kvt_cmp_double);
    double gb = bytes / 1e9, cpu = 0, rss = 0;
    json_t *ranks = json_array();
    json_t *pre = kvt_bench_side(b, KVT_CHILD_PREFILL, gb, &cpu, &rss, ranks);
    json_t *dec = kvt_bench_side(b, KVT_CHILD_DECODE, gb, &cpu, &rss, ranks);
    uint32_t failed = rooms - ok_rooms;
    *ok_p = !missing && rooms > 0 && failed == 0 && !o->error[0] &&
            !o->timed_out && !o->signal;
    const kvt_opts_t *p = &b->o;
    json_t *out = json_pack(
        "{s:b, s:o, s:o, s:o, s:o, s:o, s:o, s:o, s:i, s:i, s:I, s:o,"
        " s:o, s:o, s:o, s:o}",
        "ok", *ok_p, "gbps", kvt_num(secs > 0 ? bytes / secs / 1e9 : 0),
        "rooms_per_s", kvt_num(secs > 0 ? ok_rooms / secs : 0),
        "p50_ms", kvt_num(kvt_pct(lat, nlat, 50)),
        "p99_ms", kvt_num(kvt_pct(lat, nlat, 99)),
        "max_ms", kvt_num(nlat ? lat[nlat - 1] : 0),
        "cpu_s_per_gb", kvt_num(gb > 0 ? cpu / gb : 0),
        "peak_rss_mb", kvt_num(rss),
        "rooms", (int)rooms, "failed", (int)failed, "bytes", (json_int_t)bytes,
        "seconds", kvt_num(secs), "prefill", pre, "decode", dec,
        "ranks", ranks, "failures", failures);
    json_object_set_new(out, "config", json_pack(
        "{s:s, s:s, s:s, s:i, s:i, s:i, s:i, s:i, s:i, s:i, s:i, s:b, s:b, s:s}",
        "model", p->model, "kv_dtype", p->kv_dtype,
        "pattern", p->contiguous ? "contiguous" : "scattered",
        "page_size", (int)p->page_size, "tokens", (int)p->tokens,
        "chunk", (int)p->chunk, "concurrency", (int)p->concurrency,
        "requests", p->duration ? 0 : (int)p->requests,
        "duration", (int)p->duration, "prefill_tp", (int)p->prefill_tp,
        "decode_tp", (int)p->decode_tp, "checksum", p->checksum,
        "verify", p->verify,
        "transport", o->transport[0] ? o->transport : "unknown"));
    json_object_set_new(json_object_get(out, "config"), "streams",
                        json_integer((json_int_t)p->streams));
    json_object_set_new(json_object_get(out, "config"), "kv_order",
                        json_string(p->kv_order));
    json_object_set_new(json_object_get(out, "config"), "spin", json_boolean(p->spin));
    unsigned us;
    for (int prefill = 1; prefill >= 0; prefill--)
        json_object_set_new(json_object_get(out, "config"),
                            prefill ? "prefill_busy_poll_us" : "decode_busy_poll_us",
                            kvt_opts_busy_poll(p, prefill, &us) > 0
                                ? json_integer((json_int_t)us) : json_null());
    json_object_set_new(out, "prefill_bytes", json_integer((json_int_t)prefill_bytes));
    json_object_set_new(out, "registry_auth", json_string(
        o->registry_auth[0] ? o->registry_auth : "unknown"));
    if (o->error[0])
        json_object_set_new(out, "error", json_string(o->error));
    *lat_p = lat;
    *nlat_p = nlat;
    return out;
}

static void kvt_bench_print(FILE *f, json_t *j)
{
    json_t *c = json_object_get(j, "config");
#define NUM(o, k) json_number_value(json_object_get(o, k))
#define STR(o, k) json_string_value(json_object_get(o, k))
    const char *order = STR(c, "kv_order");
    fprintf(f, "kvferry bench: %s, %s%s pages, page size %d, %d tokens per room, "
            "%d in flight, TP %d->%d, transport %s\n", STR(c, "model"),
            order && strcmp(order, "nhd") != 0 ? "hnd " : "",
            STR(c, "pattern"), (int)NUM(c, "page_size"), (int)NUM(c, "tokens"),
            (int)NUM(c, "concurrency"), (int)NUM(c, "prefill_tp"),
            (int)NUM(c, "decode_tp"), STR(c, "transport"));
    fprintf(f, "  rooms        %d, %d failed, %.3f GB in %.3f s\n",
            (int)NUM(j, "rooms"), (int)NUM(j, "failed"), NUM(j, "bytes") / 1e9,
            NUM(j, "seconds"));
    fprintf(f, "  registry     %s\n", STR(j, "registry_auth"));
    fprintf(f, "  throughput   %.3f GB/s, %.1f rooms/s\n", NUM(j, "gbps"),
            NUM(j, "rooms_per_s"));
    fprintf(f, "  latency      p50 %.3f ms, p99 %.3f ms, max %.3f ms "
            "(last chunk sent -> decode SUCCESS)\n", NUM(j, "p50_ms"),
            NUM(j, "p99_ms"), NUM(j, "max_ms"));
    fprintf(f, "  cpu          %.3f s/GB (prefill %.3f, decode %.3f)\n",
            NUM(j, "cpu_s_per_gb"), NUM(json_object_get(j, "prefill"), "cpu_s_per_gb"),
            NUM(json_object_get(j, "decode"), "cpu_s_per_gb"));
    size_t i;
    json_t *r;
    json_array_foreach(json_object_get(j, "ranks"), i, r)
        fprintf(f, "  memory       %-10s peak RSS %.1f MB (KV pool %.1f MB)\n",
                STR(r, "name"), NUM(r, "peak_rss_mb"), NUM(r, "kv_pool_mb"));
    json_array_foreach(json_object_get(j, "failures"), i, r)
        fprintf(f, "  FAILED       room %d on %s: %s: %s\n", (int)NUM(r, "index"),
                STR(r, "rank"), STR(r, "status"), STR(r, "reason"));
    if (json_object_get(j, "error"))
        fprintf(f, "  error        %s\n", STR(j, "error"));
    fprintf(f, "  result       %s\n", json_is_true(json_object_get(j, "ok"))
            ? "every room succeeded" : "FAILED: see above");
#undef NUM
#undef STR
}

/* --plot: draw the figures; the file's name goes into them ("plot"). */
static int kvt_bench_plot(kvt_bench_t *b, json_t *fig, const double *lat, size_t nlat)
{
    kvt_baseline_t bl[8];
    char err[512], title[256];
    kvt_series_end(&b->series, b->t_end, (uint64_t)json_integer_value(json_object_get(fig,
                                                                                   "bytes")));
    int nbl = kvt_plot_baselines(b->o.baselines, bl, 8, err, sizeof(err));
    json_t *c = json_object_get(fig, "config");
    snprintf(title, sizeof(title), "kvferry bench: %s, %s pages, %d tokens per room, TP %d->%d, "
             "%s", json_string_value(json_object_get(c, "model")),
             json_string_value(json_object_get(c, "pattern")),
             (int)json_integer_value(json_object_get(c, "tokens")), (int)b->o.prefill_tp,
             (int)b->o.decode_tp, json_string_value(json_object_get(c, "transport")));
    kvt_plot_t p = {.png = b->o.plot, .title = title, .series = &b->series, .lat_ms = lat,
                    .nlat = nlat, .bl = bl, .nbl = nbl > 0 ? (size_t)nbl : 0,
                    .gbps = json_real_value(json_object_get(fig, "gbps")),
                    .p50_ms = json_real_value(json_object_get(fig, "p50_ms")),
                    .p99_ms = json_real_value(json_object_get(fig, "p99_ms"))};
    if (nbl < 0 || kvt_plot_bench(&p, err, sizeof(err)) != 0) {
        fprintf(stderr, "kvferry bench: --plot %s: %s\n", b->o.plot, err);
        json_object_set_new(fig, "error", json_string(err));
        return -1;
    }
    json_object_set_new(fig, "plot", json_string(b->o.plot));
    return 0;
}

/* ------------------------------------------------------------------------ */
/* Main                                                                     */
/* ------------------------------------------------------------------------ */

static void kvt_bench_usage(FILE *out)
{
    fprintf(out,
        "Usage: kvferry bench [options]\n"
        "\n"
        "Measure kvferry on this host: a bootstrap registry, --prefill-tp\n"
        "prefill and --decode-tp decode rank processes with KV buffers of a\n"
        "real model's layout move rooms as fast as they can.  Reports payload\n"
        "throughput (GB/s = 1e9 B/s), rooms per second, room latency p50/p99\n"
        "(prefill's send of the last chunk -> decode's SUCCESS), CPU seconds\n"
        "per GB of each side and peak RSS of each process.  No data is\n"
        "generated or checked in the timed path (--verify checks decode's\n"
        "bytes, off the CPU figures).  Exit status 1 if any room failed.\n"
        "\n"
        "Options:\n");
    kvt_opts_t def;
    kvt_opts_defaults(&def, KVT_OPTS_BENCH);
    kvt_opts_usage(out, KVT_OPTS_BENCH, &def);
    fprintf(out, "\n");
    kvt_models_print(out);
    fprintf(out,
        "\nUnequal --prefill-tp and --decode-tp move each decode rank's heads\n"
        "from the prefill ranks that hold them (TP-sliced).  Payload bytes are\n"
        "what the decode ranks received, summed over them: the whole transfer,\n"
        "so GB/s and CPU s/GB compare across TP pairs of the same model.\n"
        "bench/baselines.sh runs the issue's cases against iperf3, memcpy and\n"
        "UCX on the same host; docs/BENCHMARKS.md has the figures.\n"
        "\n--relay measures how fast a failure reaches every rank of a room\n"
        "instead: prefill rank 0 aborts each room after its first chunk, the\n"
        "other prefill ranks send no more, and every rank notes when its room\n"
        "failed (CLOCK_MONOTONIC), checking that its record names the abort.\n"
        "Reported: abort -> the last rank's FAILED and abort -> the first\n"
        "sibling's, p50/p99/max over rooms; exit status 1 if any rank of any\n"
        "room failed it for another cause or never.\n"
        "\n--layerwise [--model M] [--tokens N] [--page-size P]\n"
        "  [--compute-us-per-token U] [--layers-per-send K] [--repeats R]\n"
        "  [--transport T] [--json]\n"
        "compares sending each layer as the prefill computes it with sending\n"
        "the chunk after its forward pass, in one process (defaults: llama3-8b,\n"
        "4096 tokens, page 64, 40 us of emulated compute per token, a send\n"
        "per layer, 5 repeats, tcp).  Reported: the tail, from the last\n"
        "layer's compute end to the decode's SUCCESS, of each, and tail_ratio\n"
        "(layer-wise / whole); the throughput of each without compute, and\n"
        "throughput_ratio.\n");
}

int kvt_bench_main(int argc, char **argv)
{
    for (int i = 2; i < argc; i++)
        if (strcmp(argv[i], "--layerwise") == 0)
            return kvt_bench_layers_main(argc, argv);
    for (int i = 2; i < argc; i++)
        if (strcmp(argv[i], "--memcpy") == 0 ||
            strcmp(argv[i], "--call-latency") == 0 ||
            strncmp(argv[i], "--rooms-in-flight", 17) == 0)
            return kvt_bench_micro_main(argc, argv);

    static kvt_bench_t b;
    memset(&b, 0, sizeof(b));
    kvt_opts_defaults(&b.o, KVT_OPTS_BENCH);
    int prc = kvt_opts_parse(&b.o, KVT_OPTS_BENCH, argc, argv, 2);
    if (prc == 1) {
        kvt_bench_usage(stdout);
        return 0;
    }
    if (prc != 0 || kvt_opts_resolve(&b.o, KVT_OPTS_BENCH) != 0)
        return 2;
    b.o.bench = 1;
    unsigned timeout = b.o.timeout;
    if (b.o.duration && timeout < b.o.duration + 60)
        timeout = b.o.duration + 60;
    if (b.o.plot != NULL && strpbrk(b.o.plot, "'\"\\") != NULL) {
        fprintf(stderr, "kvferry bench: --plot %s: a file name without quotes or "
                "backslashes, please\n", b.o.plot);
        return 2;
    }
    kvt_progress_init(&b.prog, "bench", b.o.json);

    if (kvt_orch_init(&b.orch, "bench", &b.o, timeout) != 0)
        return 1;
    size_t n = b.orch.kids.cap;
    char **fwd = kvt_opts_argv(&b.o);
    b.results = calloc(n, sizeof(*b.results));
    b.done = calloc(n, sizeof(*b.done));
    b.failed = calloc(n, sizeof(*b.failed));
    b.bytes = calloc(n, sizeof(*b.bytes));
    int ok = 0;
    if (!fwd || !b.results || !b.done || !b.failed || !b.bytes) {
        fprintf(stderr, "kvferry bench: out of memory\n");
        goto out;
    }
    b.orch.on_event = kvt_bench_on_event;
    b.orch.on_tick = kvt_bench_on_tick;
    b.orch.ctx = &b;
    kvt_orch_run(&b.orch, &b.o, fwd);
    if (b.orch.go_at_ms != 0)
        b.t_end = (double)(kvt_mono_ms() - b.orch.go_at_ms) / 1000.0;
    kvt_orch_stop(&b.orch);
    kvt_progress_end(&b.prog);

    double *lat = NULL;
    size_t nlat = 0;
    json_t *fig = kvt_bench_figures(&b, &ok, &lat, &nlat);
    if (fig != NULL && b.o.plot != NULL && kvt_bench_plot(&b, fig, lat, nlat) != 0)
        ok = 0;
    free(lat);
    if (!fig) {
        fprintf(stderr, "kvferry bench: cannot build the figures (out of memory)\n");
        ok = 0;
    } else if (b.o.json) {
        char *s = json_dumps(fig, JSON_COMPACT);
        if (s)
            printf("%s\n", s);
        free(s);
    } else if (b.o.relay) {
        kvt_bench_relay_print(stdout, fig);
    } else {
        kvt_bench_print(stdout, fig);
    }
    fflush(stdout);
    json_decref(fig);
out:
    for (size_t i = 0; b.results && i < n; i++)
        json_decref(b.results[i]);
    free(b.results);
    free(b.done);
    free(b.failed);
    free(b.bytes);
    kvt_series_free(&b.series);
    kvt_opts_argv_free(fwd);
    kvt_orch_fini(&b.orch);
    return ok ? 0 : 1;
}
