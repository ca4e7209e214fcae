/*
 * The option table of `kvferry demo` / `kvferry _rank` (see opts.h).
 *
 * Each row: name, kind, struct offset, where it is accepted (demo, rank or
 * both), whether the orchestrator forwards it to ranks, its minimum, and
 * its usage line.  Values are checked here (range, numbers); combinations
 * (chunk vs page size, TP vs heads) in kvt_opts_resolve().
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
    KVT_FORWARD = 4    /* the orchestrator passes it on to every rank */
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
#define BOTH (KVT_IN_DEMO | KVT_IN_RANK | KVT_FORWARD)

static const kvt_opt_t kvt_opt_table[] = {
    { "model", KVT_STR, OFF(model), BOTH, 0, "NAME",
      "model KV layout (default llama3-8b; see below)" },
    { "requests", KVT_U32, OFF(requests), BOTH, 1, "N",
      "rooms (requests) to transfer (default 32)" },
    { "tokens", KVT_U32, OFF(tokens), BOTH, 1, "N",
      "tokens per room (default 1024)" },
    { "chunk", KVT_U32, OFF(chunk), BOTH, 1, "N",
      "tokens per send, a multiple of --page-size (default: all in one send)" },
    { "page-size", KVT_U32, OFF(page_size), BOTH, 1, "N",
      "tokens per page on prefill (default 16)" },
    { "decode-page-size", KVT_U32, OFF(decode_page_size), BOTH, 1, "N",
      "tokens per page on decode (default --page-size)" },
    { "kv-dtype", KVT_STR, OFF(kv_dtype), BOTH, 0, "DTYPE",
      "KV dtype on prefill (default bfloat16)" },
    { "decode-kv-dtype", KVT_STR, OFF(decode_kv_dtype), BOTH, 0, "DTYPE",
      "KV dtype on decode (default --kv-dtype)" },
    { "prefill-tp", KVT_U32, OFF(prefill_tp), BOTH, 1, "N",
      "prefill TP size: prefill rank processes (default 1)" },
    { "decode-tp", KVT_U32, OFF(decode_tp), BOTH, 1, "N",
      "decode TP size: decode rank processes (default 1)" },
    { "concurrency", KVT_U32, OFF(concurrency), BOTH, 1, "N",
      "rooms in flight per rank (default 4)" },
    { "seed", KVT_U64, OFF(seed), BOTH, 0, "N",
      "seed of room ids, data and page scattering (default 1)" },
    { "checksum", KVT_FLAG, OFF(checksum), BOTH, 0, NULL,
      "enable end-to-end XXH3 checksums in the engine" },
    { "transport", KVT_STR, OFF(transport), BOTH, 0, "NAME",
      "engine transport: auto or tcp (default: engine default, KVF_TRANSPORT)" },
    { "contiguous", KVT_FLAG, OFF(contiguous), BOTH, 0, NULL,
      "give decode contiguous pages instead of randomly scattered ones" },
    { "timeout", KVT_U32, OFF(timeout), KVT_IN_DEMO, 1, "SECONDS",
      "kill every process after this; rooms not final are unresolved (default 120)" },
    { "json", KVT_FLAG, OFF(json), KVT_IN_DEMO, 0, NULL,
      "print exactly one JSON object on stdout (logs go to stderr)" },
    /* identity of a rank process: set by the orchestrator only */
    { "role", KVT_STR, OFF(role), KVT_IN_RANK, 0, "prefill|decode", NULL },
    { "rank", KVT_U32, OFF(rank), KVT_IN_RANK, 0, "N", NULL },
    { "registry", KVT_STR, OFF(registry), KVT_IN_RANK, 0, "HOST:PORT", NULL },
};

#define KVT_NOPTS (sizeof(kvt_opt_table) / sizeof(kvt_opt_table[0]))

void kvt_opts_defaults(kvt_opts_t *o)
{
    memset(o, 0, sizeof(*o));
    o->model = "llama3-8b";
    o->requests = 32;
    o->tokens = 1024;
    o->page_size = 16;
    o->kv_dtype = "bfloat16";
    o->prefill_tp = 1;
    o->decode_tp = 1;
    o->concurrency = 4;
    o->seed = 1;
    o->timeout = 120;
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
    const char *cmd = mode == KVT_OPTS_DEMO ? "demo" : "_rank";
    unsigned where = mode == KVT_OPTS_DEMO ? KVT_IN_DEMO : KVT_IN_RANK;
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

int kvt_opts_resolve(kvt_opts_t *o, kvt_opts_mode_t mode)
{
    const char *cmd = mode == KVT_OPTS_DEMO ? "demo" : "_rank";
    char err[256];
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
    if (!o->decode_page_size)
        o->decode_page_size = o->page_size;
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
    if (mode == KVT_OPTS_RANK) {
        if (!o->role || (strcmp(o->role, "prefill") && strcmp(o->role, "decode"))) {
            fprintf(stderr, "kvferry _rank: --role prefill|decode is required "
                    "(this command is started by 'kvferry demo', not by hand)\n");
            return -1;
        }
        uint32_t tp = strcmp(o->role, "prefill") == 0 ? o->prefill_tp : o->decode_tp;
        if (o->rank >= tp || !o->registry) {
            fprintf(stderr, "kvferry _rank: needs --rank below the %s TP "
                    "size %u and --registry HOST:PORT\n", o->role, tp);
            return -1;
        }
    }
    return 0;
}

void kvt_opts_usage(FILE *out)
{
    for (size_t i = 0; i < KVT_NOPTS; i++) {
        const kvt_opt_t *d = &kvt_opt_table[i];
        if (!(d->flags & KVT_IN_DEMO))
            continue;
        char lhs[48];
        snprintf(lhs, sizeof(lhs), "--%s%s%s", d->name, d->arg ? " " : "",
                 d->arg ? d->arg : "");
        fprintf(out, "  %-26s %s\n", lhs, d->help);
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
