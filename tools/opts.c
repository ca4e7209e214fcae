/*
 * The option table of `kvferry demo` / `kvferry _rank` (see opts.h).
 *
 * Each row: name, kind, struct offset, where it is accepted (demo, bench,
 * rank), whether the orchestrator forwards it to ranks, its minimum, and
 * its usage line.  The usage shows each default from the command's own
 * defaults struct, so demo and bench can differ without two tables.
 * Values are checked here (range, numbers); combinations (chunk vs page
 * size, TP vs heads) in kvt_opts_resolve().
 */
#include "opts.h"

#include <errno.h>
#include <inttypes.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "models.h"

typedef enum kvt_opt_kind {
    KVT_U32,
    KVT_U64,
    KVT_STR,
    KVT_FLAG
} kvt_opt_kind_t;

enum {
    KVT_IN_DEMO = 1,   /* accepted by `kvferry demo` */
    KVT_IN_RANK = 2,   /* accepted by `kvferry _rank` */
    KVT_FORWARD = 4,   /* the orchestrator passes it on to every rank */
    KVT_IN_BENCH = 8   /* accepted by `kvferry bench` */
};

typedef struct kvt_opt {
    const char    *name;
    kvt_opt_kind_t kind;
    size_t         off;
    unsigned       flags;
    uint64_t       min;
    const char    *arg;
    const char    *help;
} kvt_opt_t;

#define OFF(f) offsetof(kvt_opts_t, f)
#define ALL (KVT_IN_DEMO | KVT_IN_BENCH | KVT_IN_RANK | KVT_FORWARD)
#define DEMO_RANK (KVT_IN_DEMO | KVT_IN_RANK | KVT_FORWARD)

static const kvt_opt_t kvt_opt_table[] = {
    { "model", KVT_STR, OFF(model), ALL, 0, "NAME",
      "model KV layout (see below)" },
    { "requests", KVT_U32, OFF(requests), ALL, 1, "N",
      "rooms (requests) to transfer" },
    { "duration", KVT_U32, OFF(duration), KVT_IN_BENCH | KVT_IN_RANK | KVT_FORWARD,
      0, "SECONDS", "run rooms until this much time has passed, instead of --requests" },
    { "tokens", KVT_U32, OFF(tokens), ALL, 1, "N",
      "tokens per room" },
    { "chunk", KVT_U32, OFF(chunk), ALL, 1, "N",
      "tokens per send, a multiple of --page-size (default: all in one send)" },
    { "page-size", KVT_U32, OFF(page_size), ALL, 1, "N",
      "tokens per page on prefill" },
    { "decode-page-size", KVT_U32, OFF(decode_page_size), ALL, 1, "N",
      "tokens per page on decode (default --page-size)" },
    { "kv-dtype", KVT_STR, OFF(kv_dtype), ALL, 0, "DTYPE",
      "KV dtype on prefill" },
    { "decode-kv-dtype", KVT_STR, OFF(decode_kv_dtype), ALL, 0, "DTYPE",
      "KV dtype on decode (default --kv-dtype)" },
    { "kv-order", KVT_STR, OFF(kv_order), ALL, 0, "nhd|hnd",
      "KV page order on prefill: nhd, token-major [tokens][heads][bytes]; hnd, "
      "head-major [heads][tokens][bytes] (vLLM's HND)" },
    { "decode-kv-order", KVT_STR, OFF(decode_kv_order), ALL, 0, "nhd|hnd",
      "KV page order on decode (default --kv-order)" },
    { "prefill-tp", KVT_U32, OFF(prefill_tp), ALL, 1, "N",
      "prefill TP size: prefill rank processes" },
    { "decode-tp", KVT_U32, OFF(decode_tp), ALL, 1, "N",
      "decode TP size: decode rank processes" },
    { "prefill-pp", KVT_U32, OFF(prefill_pp), DEMO_RANK, 1, "N",
      "prefill pipeline stages; each holds its share of the layers" },
    { "decode-pp", KVT_U32, OFF(decode_pp), DEMO_RANK, 1, "N",
      "decode pipeline stages: --prefill-pp or 1 (others: every room fails)" },
    { "dp", KVT_U32, OFF(dp), DEMO_RANK, 1, "N",
      "prefill DP groups, of pp x tp ranks each; room r goes to group r % N" },
    { "concurrency", KVT_U32, OFF(concurrency), ALL, 1, "N",
      "rooms in flight per rank" },
    { "seed", KVT_U64, OFF(seed), ALL, 0, "N",
      "seed of room ids, data and page scattering" },
    { "checksum", KVT_FLAG, OFF(checksum), ALL, 0, NULL,
      "enable end-to-end XXH3 checksums in the engine" },
    { "transport", KVT_STR, OFF(transport), ALL, 0, "NAME",
      "engine transport: auto, tcp, shm or ucx (default: engine default, KVF_TRANSPORT)" },
    { "streams", KVT_U32, OFF(streams), ALL, 0, "N",
      "tcp streams (connections, progress threads) per peer pair, 1..8 (0: the engine's "
      "default, KVF_STREAMS)" },
    { "busy-poll", KVT_STR, OFF(busy_poll), ALL, 0, "US",
      "busy polling of every engine, in microseconds, 0..1000000 (default: the engine's, "
      "KVF_BUSY_POLL_US)" },
    { "decode-busy-poll", KVT_STR, OFF(decode_busy_poll), ALL, 0, "US",
      "busy polling of the decode engines (default --busy-poll)" },
    { "contiguous", KVT_FLAG, OFF(contiguous), KVT_IN_DEMO | KVT_IN_RANK | KVT_FORWARD,
      0, NULL, "give decode contiguous pages instead of randomly scattered ones" },
    { "pattern", KVT_STR, OFF(pattern), KVT_IN_BENCH, 0, "contiguous|scattered",
      "decode pages: consecutive, or drawn at random from a pool twice the size" },
    { "verify", KVT_FLAG, OFF(verify), KVT_IN_BENCH | KVT_IN_RANK | KVT_FORWARD,
      0, NULL, "check every byte on decode (CPU time of the check is left out)" },
    { "relay", KVT_FLAG, OFF(relay), KVT_IN_BENCH | KVT_IN_RANK | KVT_FORWARD,
      0, NULL, "time how fast a failure reaches every rank: prefill rank 0 aborts each "
      "room after its first chunk, the others send no more, and each rank notes when "
      "its room failed (default --chunk: one page)" },
    { "spin", KVT_FLAG, OFF(spin), KVT_IN_BENCH | KVT_IN_RANK | KVT_FORWARD,
      0, NULL, "poll rooms without sleeping between passes (yielding the CPU), as a "
      "scheduler's loop polls every step: room latency is then the library's to within "
      "a pass, not the polling's back-off (the CPU figures count the polling)" },
    { "timeout", KVT_U32, OFF(timeout), KVT_IN_DEMO | KVT_IN_BENCH, 1, "SECONDS",
      "kill every process after this; rooms not final are unresolved" },
    { "json", KVT_FLAG, OFF(json), KVT_IN_DEMO | KVT_IN_BENCH, 0, NULL,
      "print exactly one JSON object on stdout (logs go to stderr)" },
    { "plot", KVT_STR, OFF(plot), KVT_IN_BENCH, 0, "FILE.png",
      "draw throughput over time and the room latencies against the baselines "
      "into FILE.png (gnuplot)" },
    { "baselines", KVT_STR, OFF(baselines), KVT_IN_BENCH, 0, "FILE.json",
      "the baselines --plot draws: bench/baselines.sh's JSON (OUT=FILE.json); "
      "default: a memcpy measured after the run" },
    { "fault", KVT_STR, OFF(fault), KVT_IN_DEMO, 0, "KIND@WHEN",
      "inject a fault when the first room reaches WHEN (see Faults below)" },
    { "after-fault-requests", KVT_U32, OFF(after_fault_requests), KVT_IN_DEMO,
      0, "N", "fresh rooms the survivors serve after a --fault, all must succeed" },
    /* identity of a rank process: set by the orchestrator only */
    { "role", KVT_STR, OFF(role), KVT_IN_RANK, 0, "prefill|decode", NULL },
    { "rank", KVT_U32, OFF(rank), KVT_IN_RANK, 0, "N", NULL },
    { "registry", KVT_STR, OFF(registry), KVT_IN_RANK, 0, "HOST:PORT", NULL },
    { "bench", KVT_FLAG, OFF(bench), KVT_IN_RANK | KVT_FORWARD, 0, NULL, NULL },
    /* set by the demo's fault injector for one rank (fault.h) */
    { "hold", KVT_STR, OFF(hold), KVT_IN_RANK, 0, "PHASE", NULL },
    { "faults", KVT_STR, OFF(faults), KVT_IN_RANK, 0, "SPEC", NULL },
};

#define KVT_NOPTS (sizeof(kvt_opt_table) / sizeof(kvt_opt_table[0]))

void kvt_opts_defaults(kvt_opts_t *o, kvt_opts_mode_t mode)
{
    memset(o, 0, sizeof(*o));
    o->model = "llama3-8b";
    o->requests = 32;
    o->tokens = 1024;
    o->page_size = 16;
    o->kv_dtype = "bfloat16";
    o->kv_order = "nhd";
    o->prefill_tp = 1;
    o->decode_tp = 1;
    o->prefill_pp = 1;
    o->decode_pp = 1;
    o->dp = 1;
    o->concurrency = 4;
    o->seed = 1;
    o->timeout = 120;
    o->after_fault_requests = 8;
    if (mode == KVT_OPTS_BENCH) {
        /* The headline case: 8,192-token rooms of 64-token pages.
         * Two rooms of 1 GiB in flight keep the link busy while one
         * finishes, without mapping more memory than a small host has. */
        o->requests = 16;
        o->tokens = 8192;
        o->page_size = 64;
        o->concurrency = 2;
        o->pattern = "contiguous";
    }
}

static const char *kvt_mode_cmd(kvt_opts_mode_t mode)
{
    return mode == KVT_OPTS_DEMO ? "demo" : mode == KVT_OPTS_BENCH ? "bench" : "_rank";
}

static unsigned kvt_mode_flag(kvt_opts_mode_t mode)
{
    return mode == KVT_OPTS_DEMO ? KVT_IN_DEMO
         : mode == KVT_OPTS_BENCH ? KVT_IN_BENCH : KVT_IN_RANK;
}

static const kvt_opt_t *kvt_opt_find(const char *name, size_t len,
                                     unsigned where)
{
    for (size_t i = 0; i < KVT_NOPTS; i++) {
        const kvt_opt_t *d = &kvt_opt_table[i];
        if ((d->flags & where) && strlen(d->name) == len &&
            strncmp(d->name, name, len) == 0)
            return d;
    }
    return NULL;
}

static int kvt_opt_set(kvt_opts_t *o, const kvt_opt_t *d, const char *val,
                       const char *cmd)
{
    char *p = (char *)o + d->off;
    if (d->kind == KVT_STR) {
        if (*val == '\0') {
            fprintf(stderr, "kvferry %s: --%s needs a non-empty value\n", cmd,
                    d->name);
            return -1;
        }
        *(const char **)p = val;
        return 0;
    }
    char *end;
    errno = 0;
    unsigned long long v = strtoull(val, &end, 0);
    uint64_t max = d->kind == KVT_U32 ? UINT32_MAX : UINT64_MAX;
    if (errno || end == val || *end || val[0] == '-' || v > max || v < d->min) {
        fprintf(stderr, "kvferry %s: --%s %s: expected an integer from %" PRIu64
                " to %" PRIu64 "\n", cmd, d->name, val, d->min, max);
        return -1;
    }
    if (d->kind == KVT_U32)
        *(uint32_t *)p = (uint32_t)v;
    else
        *(uint64_t *)p = (uint64_t)v;
    return 0;
}

int kvt_opts_parse(kvt_opts_t *o, kvt_opts_mode_t mode, int argc,
                   char **argv, int first)
{
    const char *cmd = kvt_mode_cmd(mode);
    unsigned where = kvt_mode_flag(mode);
    for (int i = first; i < argc; i++) {
        const char *a = argv[i];
        if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0)
            return 1;
        if (strncmp(a, "--", 2) != 0) {
            fprintf(stderr, "kvferry %s: unexpected argument '%s' (options "
                    "start with --; see 'kvferry help %s')\n", cmd, a, cmd);
            return -1;
        }
        const char *name = a + 2, *eq = strchr(name, '=');
        size_t len = eq ? (size_t)(eq - name) : strlen(name);
        const kvt_opt_t *d = kvt_opt_find(name, len, where);
        if (!d) {
            fprintf(stderr, "kvferry %s: unknown option '--%.*s' (see "
                    "'kvferry help %s')\n", cmd, (int)len, name, cmd);
            return -1;
        }
        if (d->kind == KVT_FLAG) {
            if (eq) {
                fprintf(stderr, "kvferry %s: --%s takes no value\n", cmd,
                        d->name);
                return -1;
            }
            *(int *)((char *)o + d->off) = 1;
            continue;
        }
        const char *val = eq ? eq + 1 : NULL;
        if (!val) {
            if (i + 1 >= argc) {
                fprintf(stderr, "kvferry %s: --%s needs a value (%s)\n", cmd,
                        d->name, d->arg);
                return -1;
            }
            val = argv[++i];
        }
        if (kvt_opt_set(o, d, val, cmd) != 0)
            return -1;
    }
    return 0;
}

/* Every stage needs a layer.  A decode PP that is neither --prefill-pp
 * nor 1 is run anyway (the engine must refuse it, room by room), with a
 * note saying so. */
static int kvt_opts_check_pp(const kvt_opts_t *o, const kvt_model_t *m,
                             const char *cmd)
{
    uint32_t pp = o->prefill_pp > o->decode_pp ? o->prefill_pp : o->decode_pp;
    if (pp > m->num_layers) {
        fprintf(stderr, "kvferry %s: --%s %u is more pipeline stages than the "
                "%u layers of %s: use at most %u\n", cmd,
                o->prefill_pp > o->decode_pp ? "prefill-pp" : "decode-pp", pp,
                m->num_layers, m->name, m->num_layers);
        return -1;
    }
    if (strcmp(cmd, "demo") == 0 && o->decode_pp != 1 &&
        o->decode_pp != o->prefill_pp)
        fprintf(stderr, "kvferry demo: note: --decode-pp %u is neither "
                "--prefill-pp %u nor 1, which kvferry does not support: every "
                "room is expected to fail with the engine's reason\n",
                o->decode_pp, o->prefill_pp);
    return 0;
}

int kvt_opts_resolve(kvt_opts_t *o, kvt_opts_mode_t mode)
{
    const char *cmd = kvt_mode_cmd(mode);
    char err[256];
    if (o->pattern) {
        if (strcmp(o->pattern, "contiguous") == 0) {
            o->contiguous = 1;
        } else if (strcmp(o->pattern, "scattered") == 0) {
            o->contiguous = 0;
        } else {
            fprintf(stderr, "kvferry %s: --pattern %s: expected contiguous or "
                    "scattered\n", cmd, o->pattern);
            return -1;
        }
    }
    const kvt_model_t *m = kvt_model_find(o->model);
    if (!m) {
        fprintf(stderr, "kvferry %s: unknown model '%s'\n", cmd, o->model);
        kvt_models_print(stderr);
        return -1;
    }
    if (!o->decode_kv_dtype)
        o->decode_kv_dtype = o->kv_dtype;
    if (!kvt_dtype_find(o->kv_dtype) || !kvt_dtype_find(o->decode_kv_dtype)) {
        fprintf(stderr, "kvferry %s: unknown KV dtype '%s'\n", cmd,
                kvt_dtype_find(o->kv_dtype) ? o->decode_kv_dtype : o->kv_dtype);
        kvt_models_print(stderr);
        return -1;
    }
    if (!o->decode_kv_order)
        o->decode_kv_order = o->kv_order;
    kvf_kv_order_t order;
    if (kvt_kv_order_find(o->kv_order, &order) || kvt_kv_order_find(o->decode_kv_order, &order)) {
        fprintf(stderr, "kvferry %s: unknown KV page order '%s': use nhd (token-major "
                "pages) or hnd (head-major pages)\n", cmd,
                kvt_kv_order_find(o->kv_order, &order) ? o->kv_order : o->decode_kv_order);
        return -1;
    }
    if (!o->decode_page_size)
        o->decode_page_size = o->page_size;
    if (!o->decode_busy_poll)
        o->decode_busy_poll = o->busy_poll;
    unsigned us;
    for (int prefill = 1; prefill >= 0; prefill--)   /* --busy-poll's own first */
        if (kvt_opts_busy_poll(o, prefill, &us) < 0) {
            fprintf(stderr, "kvferry %s: --%sbusy-poll %s: expected microseconds, "
                    "0..1000000\n", cmd, prefill ? "" : "decode-",
                    prefill ? o->busy_poll : o->decode_busy_poll);
            return -1;
        }
    if (o->relay && !o->chunk)
        o->chunk = o->page_size;   /* the first chunk is one page */
    if (o->relay && (o->chunk >= o->tokens || o->prefill_tp != o->decode_tp)) {
        fprintf(stderr, "kvferry %s: --relay needs rooms of two or more chunks (--chunk "
                "below --tokens %u) and equal --prefill-tp and --decode-tp (prefill rank "
                "k feeding decode rank k alone: nothing but the siblings' relay joins the "
                "pairs)\n", cmd, o->tokens);
        return -1;
    }
    if (!o->chunk || o->chunk > o->tokens)
        o->chunk = o->tokens;
    if (o->chunk < o->tokens && o->chunk % o->page_size != 0) {
        fprintf(stderr, "kvferry %s: --chunk %u is not a multiple of "
                "--page-size %u: every chunk but the last must end on a page "
                "boundary\n", cmd, o->chunk, o->page_size);
        return -1;
    }
    if (kvt_tp_check(m, o->prefill_tp, "--prefill-tp", err, sizeof(err)) ||
        kvt_tp_check(m, o->decode_tp, "--decode-tp", err, sizeof(err))) {
        fprintf(stderr, "kvferry %s: %s\n", cmd, err);
        return -1;
    }
    if (kvt_opts_check_pp(o, m, cmd) != 0)
        return -1;
    if (mode == KVT_OPTS_RANK) {
        if (!o->role || (strcmp(o->role, "prefill") && strcmp(o->role, "decode"))) {
            fprintf(stderr, "kvferry _rank: --role prefill|decode is required "
                    "(this command is started by 'kvferry demo', not by hand)\n");
            return -1;
        }
        uint32_t n = kvt_opts_nranks(o, strcmp(o->role, "prefill") == 0);
        if (o->rank >= n || !o->registry) {
            fprintf(stderr, "kvferry _rank: needs --rank below the %u %s "
                    "rank processes and --registry HOST:PORT\n", n, o->role);
            return -1;
        }
    }
    return 0;
}

int kvt_opts_busy_poll(const kvt_opts_t *o, int prefill, unsigned *us_p)
{
    const char *v = prefill ? o->busy_poll : o->decode_busy_poll;
    if (v == NULL)
        return 0;
    char *end;
    errno = 0;
    unsigned long us = strtoul(v, &end, 10);
    if (*v < '0' || *v > '9' || *end != '\0' || errno != 0 || us > 1000000ul)
        return -1;
    *us_p = (unsigned)us;
    return 1;
}

uint32_t kvt_opts_nranks(const kvt_opts_t *o, int prefill)
{
    return prefill ? o->dp * o->prefill_pp * o->prefill_tp
                   : o->decode_pp * o->decode_tp;
}

kvt_coord_t kvt_opts_coord(const kvt_opts_t *o, int prefill, uint32_t index)
{
    uint32_t tp = prefill ? o->prefill_tp : o->decode_tp;
    uint32_t pp = prefill ? o->prefill_pp : o->decode_pp;
    kvt_coord_t c = { index / (tp * pp), index / tp % pp, index % tp };
    return c;
}

void kvt_opts_usage(FILE *out, kvt_opts_mode_t mode, const kvt_opts_t *defaults)
{
    unsigned where = kvt_mode_flag(mode);
    for (size_t i = 0; i < KVT_NOPTS; i++) {
        const kvt_opt_t *d = &kvt_opt_table[i];
        const char *p = (const char *)defaults + d->off;
        if (!(d->flags & where))
            continue;
        char lhs[48], def[64] = "";
        snprintf(lhs, sizeof(lhs), "--%s%s%s", d->name, d->arg ? " " : "",
                 d->arg ? d->arg : "");
        /* A zero or NULL default is described by the help text itself. */
        if (d->kind == KVT_STR && *(const char *const *)p)
            snprintf(def, sizeof(def), " (default %s)", *(const char *const *)p);
        else if (d->kind == KVT_U32 && *(const uint32_t *)p)
            snprintf(def, sizeof(def), " (default %" PRIu32 ")", *(const uint32_t *)p);
        else if (d->kind == KVT_U64 && *(const uint64_t *)p)
            snprintf(def, sizeof(def), " (default %" PRIu64 ")", *(const uint64_t *)p);
        fprintf(out, "  %-26s %s%s\n", lhs, d->help, def);
    }
}

char **kvt_opts_argv(const kvt_opts_t *o)
{
    char **v = calloc(2 * KVT_NOPTS + 1, sizeof(*v));
    size_t n = 0;
    if (!v)
        return NULL;
    for (size_t i = 0; i < KVT_NOPTS; i++) {
        const kvt_opt_t *d = &kvt_opt_table[i];
        const char *p = (const char *)o + d->off;
        char num[32];
        const char *val = NULL;
        if (!(d->flags & KVT_FORWARD))
            continue;
        switch (d->kind) {
        case KVT_FLAG:
            if (!*(const int *)p)
                continue;
            break;
        case KVT_STR:
            if (!(val = *(const char *const *)p))
                continue;
            break;
        case KVT_U32:
            snprintf(num, sizeof(num), "%" PRIu32, *(const uint32_t *)p);
            val = num;
            break;
        case KVT_U64:
            snprintf(num, sizeof(num), "%" PRIu64, *(const uint64_t *)p);
            val = num;
            break;
        }
        size_t len = strlen(d->name) + 3 + (val ? strlen(val) + 1 : 0);
        if (!(v[n] = malloc(len))) {
            kvt_opts_argv_free(v);
            return NULL;
        }
        snprintf(v[n++], len, "--%s%s%s", d->name, val ? "=" : "",
                 val ? val : "");
    }
    return v;
}

void kvt_opts_argv_free(char **argv)
{
    if (!argv)
        return;
    for (char **p = argv; *p; p++)
        free(*p);
    free(argv);
}
