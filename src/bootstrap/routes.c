/*
 * Bootstrap registry request handling: SGLang's CommonKVBootstrapServer
 * routes (PUT/GET /route, /health, /register_dp_rank, /query_dp_ranks),
 * kvferry's room readiness (/room_ready, /query_room_ready) and GET
 * /metrics, as one pure function of (method, path, query, body)
 * and the registry state.  The MHD glue (registry.c), the unit tests and
 * the fuzzer all call kvf__registry_handle(), so the fuzzer exercises
 * exactly what the network reaches.
 *
 * Compatibility notes (SGLang disaggregation/common/conn.py):
 *  - dp_size is attn_dp_size when system_dp_size == 1, else system_dp_size;
 *    the DP coordinate of a rank follows the same rule.
 *  - a missing load_balance_method counts as "follow_bootstrap_room".
 *  - the parallel info answers exactly the keys of SGLang's
 *    PrefillServerInfo, because decode servers build one with
 *    PrefillServerInfo(**data): a key more or less is a TypeError there.
 *    The six keys decode fills in itself (target_*, required_*) are null.
 *  - as SGLang, kv_cache_dtype and prefill_http_port that the first
 *    registration left null are taken from the first later one that has
 *    them; every other field of the info is the first registration's.
 *  - SGLang counts every PUT; we count distinct coordinates, so a restarted
 *    rank re-registering does not make the registry "ready" too early.
 *  - integers in a query, and in strings of the DP-rank routes, are read
 *    as Python's int() reads them (ASCII only: py_int), over every byte
 *    of the decoded value, so "1%00junk" is no integer.
 *  - stricter than SGLang: 400 (not 500) for bad input, 409 for a rank
 *    whose parallel info would break transfers (unless the rule below lets
 *    it replace that info).
 *  - access, as SGLang's bootstrap_auth.py: the mutating routes (PUT
 *    /route, POST /register_dp_rank, and kvferry's POST /room_ready) need
 *    "Authorization: Bearer <token>" (scheme case-insensitive, token
 *    compared in constant time) when the registry has a token, and answer
 *    401 otherwise; GET /route, /health, POST /query_dp_ranks, POST
 *    /query_room_ready and /metrics stay open.  Without a token SGLang
 *    refuses every write; we accept loopback clients only (protected mode)
 *    or, with KVF_AUTH=none, anyone.
 *
 * The configuration rule: the parallel info is set by the first
 * registration.  A registration conflicts with it when it differs in
 * attn_tp_size, attn_cp_size, dp_size, pp_size or page_size (the shape of
 * the rank table and what decode computes from it), or names another
 * concrete kv_cache_dtype ("auto" and null conflict with nothing: what
 * "auto" resolves to is the model's dtype, which only the engines know,
 * and their handshake compares the real dtypes).  load_balance_method,
 * enable_dsa_cache_layer_split and prefill_http_port are server-wide
 * settings: the first registration's stay, as in SGLang, and never
 * conflict.  A conflicting registration replaces the info, dropping every
 * entry of the old configuration, when either
 *  (a) the old configuration holds a registered rank at the newcomer's
 *      (dp, cp, tp, pp): that rank restarted with a new configuration, or
 *  (b) no rank of the old configuration has registered for KVF_BS_STALE_MS:
 *      whoever set it is gone (a stray or a dead cluster), and kvferry
 *      engines re-register every 5 s, so a live configuration is never
 *      stale.
 * Otherwise it gets 409.  A restarted cluster thus comes back without a
 * registry restart, and a live misconfigured rank still gets a 409 that
 * names who set the registry's configuration.
 */
#include <ctype.h>
#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include <jansson.h>
#include <openssl/crypto.h>

#include "bootstrap/bootstrap.h"
#include "bootstrap/rooms.h"
#include "util/log.h"
#include "util/time.h"
#include "util/token.h"

#define CT_TEXT    "text/plain; charset=utf-8"
#define CT_JSON    "application/json"
#define CT_METRICS "text/plain; version=0.0.4; charset=utf-8"

enum { R_ROUTE, R_HEALTH, R_REG_DP, R_QUERY_DP, R_READY, R_QUERY_READY,
       R_METRICS, R_OTHER, R_N };
enum { M_GET, M_PUT, M_POST, M_HEAD, M_OTHER, M_N };
static const char *const route_names[R_N] = {
    "/route", "/health", "/register_dp_rank", "/query_dp_ranks", "/room_ready",
    "/query_room_ready", "/metrics", "other"};
static const char *const method_names[M_N] = {"GET", "PUT", "POST", "HEAD",
                                              "other"};
static const int counted_codes[] = {200, 400, 401, 403, 404, 405, 409, 413,
                                     414, 500, 503};
/* Why a mutating request was refused. */
enum { REF_MISSING, REF_WRONG, REF_NOT_LOOPBACK, REF_N };
static const char *const refusal_names[REF_N] = {"missing_token",
                                                 "wrong_token", "not_loopback"};
/* At most one log line per this long about refused requests. */
#define REFUSAL_LOG_MS 10000u
#define C_N ((int)(sizeof(counted_codes) / sizeof(counted_codes[0])) + 1)

typedef struct rank_entry {
    char *ip;        /* NULL: not registered */
    int   port;
} rank_entry_t;

struct kvf_registry_state {
    pthread_mutex_t lock;

    /* Parallel info, fixed by the first registration. */
    int    have_info;
    int    attn_tp_size, attn_cp_size, dp_size, pp_size, page_size;
    int    dtype_null;
    char   dtype[64];               /* what GET /route answers */
    char   dtype_concrete[64];      /* the first dtype not "auto" ("": none
                                       yet), what conflicts are judged by */
    int    follow_bootstrap_room;
    int    http_port;               /* 0: null (not known) */
    int    dsa;
    char   policy[64];              /* decode_allocation_policy; "": none */
    char   first_desc[320];         /* who set the info, for 409 messages */
    rank_entry_t *ranks;            /* [dp][cp][tp][pp] */
    size_t nranks, nregistered;
    uint64_t info_touched_ms;       /* last registration under this info */
    uint64_t replaced;              /* configurations replaced (rule a/b) */

    /* The access rule: set before serving, read without the lock. */
    char   token[KVF_TOKEN_MAX + 1];
    int    auth_open;
    /* Refused mutating requests, and the rate limit of their log lines. */
    uint64_t refused[REF_N];
    uint64_t refused_unlogged, refusal_logged_ms;
    int      refusal_logged;

    kvf_bs_clock_cb_t clock;
    void             *clock_arg;

    kvf_bs_rooms_t rooms;           /* POST /register_dp_rank */
    kvf_bs_rooms_t ready;           /* POST /room_ready: READY_*, reason */

    uint64_t requests[R_N][M_N][C_N];

    kvf_bs_stats_cb_t stats_cb;
    void             *stats_arg;
    unsigned          stats_busy;   /* callbacks running right now */
    pthread_cond_t    stats_idle;
};

typedef struct reply {
    int         status;
    char       *body;
    const char *ctype;
} reply_t;

__attribute__((format(printf, 3, 4)))
static void reply_text(reply_t *r, int status, const char *fmt, ...)
{
    va_list ap;

    va_start(ap, fmt);
    if (vasprintf(&r->body, fmt, ap) < 0) {
        r->body = NULL;
        status = 500;
    }
    va_end(ap);
    r->status = status;
    r->ctype = CT_TEXT;
}

/* Takes ownership of `j`. */
static void reply_json(reply_t *r, json_t *j)
{
    r->body = j ? json_dumps(j, JSON_COMPACT) : NULL;
    json_decref(j);
    r->status = r->body ? 200 : 500;
    r->ctype = r->body ? CT_JSON : CT_TEXT;
}

static uint64_t now_ms(const kvf_registry_state_t *st)
{
    return st->clock ? st->clock(st->clock_arg) : kvf_now_ms();
}

/* ------------------------------------------------------------------------ */
/* Request parsing helpers                                                  */
/* ------------------------------------------------------------------------ */

static int hexval(int c)
{
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

/* Percent-decode [s, s+n) into out (at least n+1 bytes).  @return the
 * decoded length: "%00" decodes to a NUL inside it. */
static size_t url_decode(const char *s, size_t n, char *out)
{
    size_t o = 0;
    for (size_t i = 0; i < n; i++) {
        if (s[i] == '+') {
            out[o++] = ' ';
        } else if (s[i] == '%' && i + 2 < n && hexval(s[i + 1]) >= 0 &&
                   hexval(s[i + 2]) >= 0) {
            out[o++] = (char)(hexval(s[i + 1]) * 16 + hexval(s[i + 2]));
            i += 2;
        } else {
            out[o++] = s[i];
        }
    }
    out[o] = '\0';
    return o;
}

/* Python's whitespace, its ASCII part: what int() strips around a number. */
static int py_space(char c)
{
    return c == ' ' || (c >= '\t' && c <= '\r') || (c >= 0x1c && c <= 0x1f);
}

enum { INT_OK, INT_NOT, INT_RANGE };

/*
 * A decimal integer as SGLang reads one: Python's int() of a str, over
 * ASCII (surrounding whitespace, one sign, digits with single '_' between
 * them).  All n bytes count, so a NUL inside (a query's "%00") is not an
 * integer, whatever precedes it.  @return INT_OK with the sign and
 * magnitude, INT_RANGE (an integer beyond 64 bits) or INT_NOT.
 */
static int py_int(const char *s, size_t n, int *neg_p, uint64_t *mag_p)
{
    size_t i = 0, digits = 0;
    uint64_t x = 0;
    int over = 0;

    while (n > 0 && py_space(s[n - 1]))
        n--;
    while (i < n && py_space(s[i]))
        i++;
    *neg_p = i < n && s[i] == '-';
    if (i < n && (s[i] == '+' || s[i] == '-'))
        i++;
    for (; i < n; i++) {
        if (s[i] == '_' && digits > 0 && i + 1 < n && s[i + 1] >= '0' && s[i + 1] <= '9')
            continue;
        if (s[i] < '0' || s[i] > '9')
            return INT_NOT;
        uint64_t d = (uint64_t)(s[i] - '0');
        if (x > (UINT64_MAX - d) / 10)
            over = 1;
        else
            x = x * 10 + d;
        digits++;
    }
    if (digits == 0)
        return INT_NOT;
    *mag_p = x;
    return over ? INT_RANGE : INT_OK;
}

/* The n bytes of s for an error message: at most 64 of them, bytes that
 * are not printable ASCII (or are '"' or '\\') as \xNN. */
static void quote_bytes(const char *s, size_t n, char *out, size_t cap)
{
    size_t o = 0;
    for (size_t i = 0; i < n && o + 5 < cap && i < 64; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c >= ' ' && c < 0x7f && c != '"' && c != '\\')
            out[o++] = (char)c;
        else
            o += (size_t)snprintf(out + o, cap - o, "\\x%02x", c);
    }
    if (n > 64 && o + 4 < cap)
        o += (size_t)snprintf(out + o, cap - o, "...");
    out[o] = '\0';
}

/*
 * Find parameter `name` in a raw query string; the first occurrence wins,
 * its key compared whole (a key "name%00x" is another key).  @return 0
 * and *v_p, 1 when missing or empty (as SGLang), or -1 after a 400 reply
 * for a value that is not an integer of int's range.
 */
static int query_int(const char *what, const char *query, const char *name, int *v_p,
                     reply_t *r)
{
    for (const char *p = query; p != NULL && *p != '\0';) {
        const char *end = strchr(p, '&');
        size_t len = end ? (size_t)(end - p) : strlen(p);
        const char *eq = memchr(p, '=', len);
        size_t klen = eq ? (size_t)(eq - p) : len;
        size_t vlen = eq ? len - klen - 1 : 0;
        char *buf = malloc((klen > vlen ? klen : vlen) + 1);
        if (buf == NULL) {
            reply_text(r, 500, "out of memory");
            return -1;
        }
        int match = url_decode(p, klen, buf) == strlen(name) && strcmp(buf, name) == 0;
        if (!match) {
            free(buf);
            p = end ? end + 1 : NULL;
            continue;
        }
        vlen = url_decode(eq ? eq + 1 : p, vlen, buf);
        int neg = 0, rc = vlen ? INT_NOT : INT_OK;
        uint64_t mag = 0;
        if (vlen > 0 && (rc = py_int(buf, vlen, &neg, &mag)) == INT_OK &&
            mag > (neg ? (uint64_t)INT_MAX + 1 : (uint64_t)INT_MAX))
            rc = INT_RANGE;
        char shown[300];
        quote_bytes(buf, vlen, shown, sizeof(shown));
        free(buf);
        if (vlen == 0)
            return 1;
        if (rc == INT_NOT)
            reply_text(r, 400, "%s: %s=\"%s\" is not an integer (decimal digits, "
                       "optionally signed)", what, name, shown);
        else if (rc == INT_RANGE)
            reply_text(r, 400, "%s: %s=\"%s\" is out of range (%d..%d)", what, name,
                       shown, INT_MIN, INT_MAX);
        if (rc != INT_OK)
            return -1;
        *v_p = neg ? (int)(-(int64_t)mag) : (int)mag;
        return 0;
    }
    return 1;
}

/* A JSON object body, or NULL after a 400 reply naming what is wrong. */
static json_t *parse_object(const char *what, const char *body, size_t len,
                            reply_t *r)
{
    json_error_t jerr;
    json_t *root = json_loadb(body ? body : "", len, 0, &jerr);

    if (root == NULL) {
        reply_text(r, 400, "%s: malformed JSON body: %s (line %d, column %d)",
                   what, jerr.text, jerr.line, jerr.column);
        return NULL;
    }
    if (!json_is_object(root)) {
        reply_text(r, 400, "%s: the body must be a JSON object", what);
        json_decref(root);
        return NULL;
    }
    return root;
}

/* An integer field within [min, max], or a 400 reply. */
static int field_int(json_t *o, const char *name, int min, int max, int *v_p,
                     reply_t *r)
{
    json_t *v = json_object_get(o, name);

    if (!json_is_integer(v)) {
        reply_text(r, 400, "PUT /route: field \"%s\" %s", name,
                   v ? "must be an integer" : "is missing");
        return -1;
    }
    json_int_t x = json_integer_value(v);
    if (x < min || x > max) {
        reply_text(r, 400, "PUT /route: field \"%s\" is %lld, outside "
                   "%d..%d", name, (long long)x, min, max);
        return -1;
    }
    *v_p = (int)x;
    return 0;
}

/* A string field of at most max bytes (null allowed when *null_p given). */
static int field_str(json_t *o, const char *name, size_t max, int *null_p,
                     const char **s_p, reply_t *r)
{
    json_t *v = json_object_get(o, name);

    if (null_p != NULL && json_is_null(v)) {
        *null_p = 1;
        *s_p = "";
        return 0;
    }
    int ok = json_is_string(v) && json_string_length(v) > 0 &&
             json_string_length(v) <= max;
    /* Printable ASCII only: these strings end up in log lines. */
    for (const char *c = ok ? json_string_value(v) : ""; *c; c++)
        ok &= *c > ' ' && *c < 0x7f;
    if (!ok) {
        reply_text(r, 400, "PUT /route: field \"%s\" must be a string of 1 "
                   "to %zu printable characters without spaces", name, max);
        return -1;
    }
    if (null_p != NULL)
        *null_p = 0;
    *s_p = json_string_value(v);
    return 0;
}

/* SGLang's int(x) of a JSON value, where a non-negative integer is
 * wanted: an integer, or a string int() reads (py_int).  @return INT_OK
 * and *x_p, INT_RANGE (negative, or beyond 64 bits) or INT_NOT. */
static int json_to_u64(json_t *v, uint64_t *x_p)
{
    if (json_is_integer(v)) {
        if (json_integer_value(v) < 0)
            return INT_RANGE;
        *x_p = (uint64_t)json_integer_value(v);
        return INT_OK;
    }
    if (!json_is_string(v))
        return INT_NOT;
    int neg, rc = py_int(json_string_value(v), json_string_length(v), &neg, x_p);
    return rc == INT_OK && neg && *x_p != 0 ? INT_RANGE : rc;
}

/* ------------------------------------------------------------------------ */
/* Routes                                                                   */
/* ------------------------------------------------------------------------ */

/* The entry for (dp, cp, tp, pp), or NULL when outside the layout. */
static rank_entry_t *rank_at_locked(kvf_registry_state_t *st, int dp, int cp,
                                    int tp, int pp)
{
    if (!st->have_info || dp < 0 || dp >= st->dp_size || cp < 0 ||
        cp >= st->attn_cp_size || tp < 0 || tp >= st->attn_tp_size ||
        pp < 0 || pp >= st->pp_size)
        return NULL;
    size_t i = (size_t)dp;
    i = i * (size_t)st->attn_cp_size + (size_t)cp;
    i = i * (size_t)st->attn_tp_size + (size_t)tp;
    i = i * (size_t)st->pp_size + (size_t)pp;
    return &st->ranks[i];
}

typedef struct put_fields {
    int attn_tp_size, attn_tp_rank, attn_cp_size, attn_cp_rank;
    int attn_dp_size, attn_dp_rank, pp_size, pp_rank;
    int system_dp_size, system_dp_rank, rank_port, page_size;
} put_fields_t;

static const struct {
    const char *name;
    size_t      off;
    int         min, max;
} put_ints[] = {
#define F_(n, lo, hi) {#n, offsetof(put_fields_t, n), lo, hi}
    F_(attn_tp_size, 1, INT_MAX), F_(attn_tp_rank, 0, INT_MAX),
    F_(attn_cp_size, 1, INT_MAX), F_(attn_cp_rank, 0, INT_MAX),
    F_(attn_dp_size, 1, INT_MAX), F_(attn_dp_rank, 0, INT_MAX),
    F_(pp_size, 1, INT_MAX), F_(pp_rank, 0, INT_MAX),
    F_(system_dp_size, 1, INT_MAX), F_(system_dp_rank, 0, INT_MAX),
    F_(rank_port, 1, 65535), F_(page_size, 1, INT_MAX),
#undef F_
};

static int check_rank(const char *rn, int rank, const char *sn, int size,
                      reply_t *r)
{
    if (rank < size)
        return 0;
    reply_text(r, 400, "PUT /route: %s=%d is out of range for %s=%d",
               rn, rank, sn, size);
    return -1;
}

/*
 * kv_cache_dtype spellings that name one dtype: SGLang's --kv-cache-dtype
 * choices and torch's names, so that "bf16" next to "bfloat16" is no
 * conflict.  The first name of a row stands for the row.
 */
static const char *const dtype_aliases[][3] = {
    {"bfloat16", "bf16", NULL},
    {"float16", "fp16", "half"},
    {"float32", "fp32", "float"},
    {"fp8_e4m3", "float8_e4m3fn", NULL},
    {"fp8_e5m2", "float8_e5m2", NULL},
};

static const char *dtype_canonical(const char *d)
{
    for (size_t i = 0; i < sizeof(dtype_aliases) / sizeof(dtype_aliases[0]);
         i++)
        for (int k = 0; k < 3 && dtype_aliases[i][k] != NULL; k++)
            if (strcasecmp(d, dtype_aliases[i][k]) == 0)
                return dtype_aliases[i][0];
    return d;
}

/* A dtype that says which one it is: not null, not "auto" (which each
 * engine resolves to its model's dtype, unknown here). */
static int dtype_is_concrete(int null, const char *d)
{
    return !null && strcasecmp(d, "auto") != 0;
}

/* Why a registration would break transfers under the fixed info (the
 * configuration rule at the top of the file): 1 and buf, or 0. */
static int conflict_locked(kvf_registry_state_t *st, const put_fields_t *f,
                           int dp_size, int dtype_null, const char *dtype,
                           char *buf, size_t len)
{
    const struct { const char *n; int mine, theirs; } ints[] = {
        {"attn_tp_size", f->attn_tp_size, st->attn_tp_size},
        {"attn_cp_size", f->attn_cp_size, st->attn_cp_size},
        {"dp_size", dp_size, st->dp_size},
        {"pp_size", f->pp_size, st->pp_size},
        {"page_size", f->page_size, st->page_size},
    };
    for (size_t i = 0; i < sizeof(ints) / sizeof(ints[0]); i++) {
        if (ints[i].mine != ints[i].theirs) {
            snprintf(buf, len, "%s=%d, but the registry has %s=%d",
                     ints[i].n, ints[i].mine, ints[i].n, ints[i].theirs);
            return 1;
        }
    }
    if (dtype_is_concrete(dtype_null, dtype) && st->dtype_concrete[0] &&
        strcmp(dtype_canonical(dtype),
               dtype_canonical(st->dtype_concrete)) != 0) {
        snprintf(buf, len, "kv_cache_dtype=%s, but the registry has "
                 "kv_cache_dtype=%s", dtype, st->dtype_concrete);
        return 1;
    }
    return 0;
}

/* What a registration adds to an info it does not conflict with: the
 * first concrete dtype, and (as SGLang) the dtype and HTTP port the info
 * still has as null. */
static void merge_info_locked(kvf_registry_state_t *st, int dtype_null,
                              const char *dtype, int http_port)
{
    if (dtype_is_concrete(dtype_null, dtype) && !st->dtype_concrete[0])
        snprintf(st->dtype_concrete, sizeof(st->dtype_concrete), "%s", dtype);
    if (st->dtype_null && !dtype_null) {
        st->dtype_null = 0;
        snprintf(st->dtype, sizeof(st->dtype), "%s", dtype);
    }
    if (st->http_port == 0)
        st->http_port = http_port;
}

static void set_info_locked(kvf_registry_state_t *st, const put_fields_t *f,
                            int dp_size, int dtype_null, const char *dtype,
                            int http_port, json_t *o)
{
    json_t *lbm = json_object_get(o, "load_balance_method");

    st->have_info = 1;
    st->attn_tp_size = f->attn_tp_size;
    st->attn_cp_size = f->attn_cp_size;
    st->dp_size = dp_size;
    st->pp_size = f->pp_size;
    st->page_size = f->page_size;
    st->dtype_null = 1;
    st->dtype[0] = '\0';
    st->dtype_concrete[0] = '\0';
    st->http_port = 0;
    merge_info_locked(st, dtype_null, dtype, http_port);
    /* SGLang: data.get("load_balance_method", "follow_bootstrap_room"). */
    st->follow_bootstrap_room =
        lbm == NULL ||
        (json_is_string(lbm) &&
         strcmp(json_string_value(lbm), "follow_bootstrap_room") == 0);
    st->dsa = json_is_true(json_object_get(o, "enable_dsa_cache_layer_split"));
    json_t *pol = json_object_get(o, "decode_allocation_policy");
    snprintf(st->policy, sizeof(st->policy), "%s",
             json_is_string(pol) ? json_string_value(pol) : "");
}

/* A PUT /route body, read and checked, before it touches the state. */
typedef struct put_req {
    put_fields_t f;
    const char  *ip, *dtype;       /* borrowed from the parsed JSON */
    int          dtype_null, http_port;
    int          dp_size, dp;      /* the DP coordinate, SGLang's rule */
    uint64_t     total;            /* ranks of the configuration it names */
    char         coords[64];       /* "dpX cpX tpX ppX", for messages */
} put_req_t;

/* The body's fields, each typed and bounded: 0, or -1 and a 400 in r. */
static int put_read_fields(json_t *o, put_req_t *q, reply_t *r)
{
    for (size_t i = 0; i < sizeof(put_ints) / sizeof(put_ints[0]); i++)
        if (field_int(o, put_ints[i].name, put_ints[i].min, put_ints[i].max,
                      (int *)((char *)&q->f + put_ints[i].off), r) != 0)
            return -1;
    if (field_str(o, "rank_ip", 255, NULL, &q->ip, r) != 0 ||
        field_str(o, "kv_cache_dtype", 63, &q->dtype_null, &q->dtype, r) != 0)
        return -1;
    json_t *lbm = json_object_get(o, "load_balance_method");
    if (lbm != NULL && !json_is_string(lbm) && !json_is_null(lbm)) {
        reply_text(r, 400, "PUT /route: field \"load_balance_method\" must "
                   "be a string");
        return -1;
    }
    json_t *dsa = json_object_get(o, "enable_dsa_cache_layer_split");
    if (dsa != NULL && !json_is_boolean(dsa) && !json_is_null(dsa)) {
        reply_text(r, 400, "PUT /route: field \"enable_dsa_cache_layer_split\""
                   " must be true or false");
        return -1;
    }
    /* Optional: SGLang before the decode allocation policy sends none. */
    json_t *pol = json_object_get(o, "decode_allocation_policy");
    const char *policy;
    int policy_null;
    if (pol != NULL &&
        field_str(o, "decode_allocation_policy", 63, &policy_null, &policy, r) != 0)
        return -1;
    /* Optional, null when the prefill server does not know its HTTP port. */
    q->http_port = 0;
    json_t *hp = json_object_get(o, "prefill_http_port");
    if (hp != NULL && !json_is_null(hp) &&
        field_int(o, "prefill_http_port", 1, 65535, &q->http_port, r) != 0)
        return -1;
    return 0;
}

/* The rank's coordinates inside its sizes, and a rank table small enough
 * to allocate: 0, or -1 and a 400 in r. */
static int put_check_shape(put_req_t *q, reply_t *r)
{
    const put_fields_t *f = &q->f;

    /* SGLang uses system DP when it is on (no DP attention), attention DP
     * otherwise; the unused rank carries no meaning and is not checked. */
    int sys_dp = f->system_dp_size > 1;
    q->dp_size = sys_dp ? f->system_dp_size : f->attn_dp_size;
    q->dp = sys_dp ? f->system_dp_rank : f->attn_dp_rank;
    if (check_rank("attn_tp_rank", f->attn_tp_rank, "attn_tp_size",
                   f->attn_tp_size, r) ||
        check_rank("attn_cp_rank", f->attn_cp_rank, "attn_cp_size",
                   f->attn_cp_size, r) ||
        check_rank("pp_rank", f->pp_rank, "pp_size", f->pp_size, r) ||
        check_rank(sys_dp ? "system_dp_rank" : "attn_dp_rank", q->dp,
                   sys_dp ? "system_dp_size" : "attn_dp_size", q->dp_size, r))
        return -1;
    q->total = 1;
    const int sizes[] = {f->attn_tp_size, f->attn_cp_size, q->dp_size,
                         f->pp_size};
    for (int i = 0; i < 4; i++) {
        q->total *= (uint64_t)sizes[i];
        if (q->total > KVF_BS_MAX_RANKS) {
            reply_text(r, 400, "PUT /route: attn_tp_size*attn_cp_size*"
                       "dp_size*pp_size exceeds %d ranks", KVF_BS_MAX_RANKS);
            return -1;
        }
    }
    snprintf(q->coords, sizeof(q->coords), "dp%d cp%d tp%d pp%d", q->dp,
             f->attn_cp_rank, f->attn_tp_rank, f->pp_rank);
    return 0;
}

/* The configuration rule (top of the file) for a registration that
 * conflicts with the info (why): the reason it may replace the info in
 * *rule_p and 0, or -1 and a 409 in r. */
static int put_may_replace_locked(kvf_registry_state_t *st,
                                  const put_req_t *q, uint64_t now,
                                  const char *why, const char **rule_p,
                                  reply_t *r)
{
    const rank_entry_t *prev = rank_at_locked(st, q->dp, q->f.attn_cp_rank,
                                              q->f.attn_tp_rank, q->f.pp_rank);
    if (prev != NULL && prev->ip != NULL) {
        *rule_p = "the rank at these coordinates restarted with a new "
                  "configuration";
        return 0;
    }
    if (now - st->info_touched_ms >= KVF_BS_STALE_MS) {
        *rule_p = "no rank of the old configuration has registered for "
                  "15 s";
        return 0;
    }
    reply_text(r, 409, "Registration of prefill rank %s (%s:%d) "
               "conflicts with this bootstrap registry: %s (set by "
               "%s, %llu ms since a rank of it last registered). "
               "Every prefill rank must use the same parallel "
               "configuration, page size and KV cache dtype. A "
               "different configuration replaces the registry's when "
               "it comes from a rank already registered (a restart), "
               "or once no rank of the old one has registered for "
               "15 s.", q->coords, q->ip, q->f.rank_port, why, st->first_desc,
               (unsigned long long)(now - st->info_touched_ms));
    return -1;
}

/* The first registration, or one that replaces the info (rule != NULL):
 * a fresh rank table and the newcomer's info.  0, or -1 and a 500 in r. */
static int put_set_config_locked(kvf_registry_state_t *st, const put_req_t *q,
                                 json_t *o, const char *why, const char *rule,
                                 reply_t *r)
{
    rank_entry_t *ranks = calloc(q->total, sizeof(*ranks));
    if (ranks == NULL) {
        reply_text(r, 500, "out of memory");
        return -1;
    }
    size_t dropped = st->nregistered;
    for (size_t i = 0; i < st->nranks; i++)
        free(st->ranks[i].ip);
    free(st->ranks);
    st->ranks = ranks;
    st->nranks = q->total;
    st->nregistered = 0;
    set_info_locked(st, &q->f, q->dp_size, q->dtype_null, q->dtype,
                    q->http_port, o);
    if (rule != NULL) {
        st->replaced++;
        kvf_warn("bootstrap registry: prefill rank %s at %s:%d replaces "
                 "the registry's configuration (%s; set by %s) because %s; "
                 "the %zu registered rank(s) of the old configuration are "
                 "dropped", q->coords, q->ip, q->f.rank_port, why,
                 st->first_desc, rule, dropped);
    }
    snprintf(st->first_desc, sizeof(st->first_desc), "rank %s at %s:%d",
             q->coords, q->ip, q->f.rank_port);
    return 0;
}

/* The rank's address at its coordinates; ipcopy becomes the table's. */
static void put_record_locked(kvf_registry_state_t *st, const put_req_t *q,
                              char *ipcopy)
{
    rank_entry_t *e = rank_at_locked(st, q->dp, q->f.attn_cp_rank,
                                     q->f.attn_tp_rank, q->f.pp_rank);
    if (e->ip != NULL)
        kvf_info("bootstrap registry: prefill rank %s re-registered: "
                 "%s:%d replaces %s:%d", q->coords, q->ip, q->f.rank_port,
                 e->ip, e->port);
    else
        st->nregistered++;
    free(e->ip);
    e->ip = ipcopy;
    e->port = q->f.rank_port;
}

static void route_put(kvf_registry_state_t *st, const char *body, size_t len,
                      reply_t *r)
{
    json_t *o = parse_object("PUT /route", body, len, r);
    put_req_t q;

    if (o == NULL)
        return;
    if (put_read_fields(o, &q, r) != 0 || put_check_shape(&q, r) != 0)
        goto out;
    char *ipcopy = strdup(q.ip);
    if (ipcopy == NULL) {
        reply_text(r, 500, "out of memory");
        goto out;
    }

    pthread_mutex_lock(&st->lock);
    uint64_t now = now_ms(st);
    char why[200] = "";
    const char *rule = NULL;
    if (st->have_info && conflict_locked(st, &q.f, q.dp_size, q.dtype_null,
                                         q.dtype, why, sizeof(why)) &&
        put_may_replace_locked(st, &q, now, why, &rule, r) != 0) {
        pthread_mutex_unlock(&st->lock);
        kvf_warn("bootstrap registry: %s", r->body ? r->body : why);
        free(ipcopy);
        goto out;
    }
    if (!st->have_info || rule != NULL) {
        if (put_set_config_locked(st, &q, o, why, rule, r) != 0) {
            pthread_mutex_unlock(&st->lock);
            free(ipcopy);
            goto out;
        }
    } else {
        merge_info_locked(st, q.dtype_null, q.dtype, q.http_port);
    }
    st->info_touched_ms = now;
    put_record_locked(st, &q, ipcopy);
    size_t nreg = st->nregistered, ntotal = st->nranks;
    pthread_mutex_unlock(&st->lock);
    kvf_info("bootstrap registry: prefill rank %s at %s:%d registered "
             "(%zu/%zu)", q.coords, q.ip, q.f.rank_port, nreg, ntotal);
    reply_text(r, 200, "OK");
out:
    json_decref(o);
}

static void reply_not_ready_locked(kvf_registry_state_t *st, reply_t *r)
{
    if (!st->have_info)
        reply_text(r, 503, "Prefill server not fully registered yet (no "
                   "prefill rank has registered with this bootstrap "
                   "registry).");
    else
        reply_text(r, 503, "Prefill server not fully registered yet (%zu of "
                   "%zu ranks registered; attn_tp_size=%d attn_cp_size=%d "
                   "dp_size=%d pp_size=%d).", st->nregistered, st->nranks,
                   st->attn_tp_size, st->attn_cp_size, st->dp_size,
                   st->pp_size);
}

static json_t *info_json_base_locked(kvf_registry_state_t *st)
{
    return json_pack("{s:i, s:i, s:i, s:i, s:i, s:o, s:b, s:b, s:o, s:n, s:n, "
                     "s:n, s:n, s:n, s:n}",
        "attn_tp_size", st->attn_tp_size, "attn_cp_size", st->attn_cp_size,
        "dp_size", st->dp_size, "pp_size", st->pp_size,
        "page_size", st->page_size,
        "kv_cache_dtype", st->dtype_null ? json_null() : json_string(st->dtype),
        "follow_bootstrap_room", st->follow_bootstrap_room,
        "enable_dsa_cache_layer_split", st->dsa,
        "prefill_http_port", st->http_port ? json_integer(st->http_port)
                                           : json_null(),
        "target_tp_rank", "target_tp_ranks", "target_cp_ranks",
        "target_pp_ranks", "required_dst_info_num",
        "required_prefill_response_num");
}

/* dataclasses.asdict(PrefillServerInfo(...)) as SGLang's server builds it:
 * these keys, no other; decode_allocation_policy (newer SGLang's) only when
 * a prefill rank registered one, so that an older decode server, which
 * builds PrefillServerInfo(**answer), gets the keys it knows. */
static json_t *info_json_locked(kvf_registry_state_t *st)
{
    json_t *j = info_json_base_locked(st);
    if (j != NULL && st->policy[0] != '\0' &&
        json_object_set_new(j, "decode_allocation_policy",
                            json_string(st->policy)) != 0) {
        json_decref(j);
        return NULL;
    }
    return j;
}

static void route_get(kvf_registry_state_t *st, const char *query,
                      reply_t *r)
{
    static const char *const names[4] = {"prefill_dp_rank", "prefill_cp_rank",
                                         "target_tp_rank", "target_pp_rank"};
    int v[4];

    for (int i = 0; i < 4; i++) {
        int rc = query_int("GET /route", query, names[i], &v[i], r);
        if (rc == 1)
            reply_text(r, 400, "Missing inputs for bootstrap server: GET "
                       "/route needs prefill_dp_rank, prefill_cp_rank, "
                       "target_tp_rank and target_pp_rank (%s is missing).",
                       names[i]);
        if (rc != 0)
            return;
    }
    int dp = v[0], cp = v[1], tp = v[2], pp = v[3];
    const rank_entry_t *e;

    pthread_mutex_lock(&st->lock);
    if (dp == -1 && cp == -1 && tp == -1 && pp == -1) {
        if (st->nregistered < st->nranks || !st->have_info)
            reply_not_ready_locked(st, r);
        else
            reply_json(r, info_json_locked(st));
    } else if ((e = rank_at_locked(st, dp, cp, tp, pp)) != NULL &&
               e->ip != NULL) {
        reply_json(r, json_pack("{s:s, s:i}", "rank_ip", e->ip, "rank_port",
                                e->port));
    } else if (!st->have_info || st->nregistered < st->nranks) {
        reply_not_ready_locked(st, r);
    } else {
        reply_text(r, 404, "Bootstrap info not found for dp_rank=%d "
                   "cp_rank=%d tp_rank=%d pp_rank=%d (the registry has "
                   "dp_size=%d attn_cp_size=%d attn_tp_size=%d pp_size=%d).",
                   dp, cp, tp, pp, st->dp_size, st->attn_cp_size,
                   st->attn_tp_size, st->pp_size);
    }
    pthread_mutex_unlock(&st->lock);
}

static void route_register_dp(kvf_registry_state_t *st, const char *body,
                              size_t len, reply_t *r)
{
    json_t *o = parse_object("POST /register_dp_rank", body, len, r);
    uint64_t room, dp;

    if (o == NULL)
        return;
    int rc_room = json_to_u64(json_object_get(o, "bootstrap_room"), &room);
    int rc_dp = json_to_u64(json_object_get(o, "dp_rank"), &dp);
    if (rc_dp == INT_OK && dp > INT32_MAX)
        rc_dp = INT_RANGE;
    if (rc_room != INT_OK || rc_dp != INT_OK) {
        int room_bad = rc_room != INT_OK;
        reply_text(r, 400, "POST /register_dp_rank: \"%s\" %s; the body needs "
                   "\"bootstrap_room\" (0..%llu) and \"dp_rank\" (0..%d), each an "
                   "integer or a string of one", room_bad ? "bootstrap_room" : "dp_rank",
                   (room_bad ? rc_room : rc_dp) == INT_RANGE ? "is out of range"
                                                             : "is missing or not an integer",
                   (unsigned long long)UINT64_MAX, INT32_MAX);
        json_decref(o);
        return;
    }
    json_decref(o);
    pthread_mutex_lock(&st->lock);
    int rc = kvf__bs_rooms_put(&st->rooms, room, (int)dp);
    pthread_mutex_unlock(&st->lock);
    if (rc != 0)
        reply_text(r, 500, "out of memory");
    else
        reply_text(r, 200, "OK");
}

static void route_query_dp(kvf_registry_state_t *st, const char *body,
                           size_t len, reply_t *r)
{
    json_t *o = parse_object("POST /query_dp_ranks", body, len, r);
    json_t *rooms, *res, *v;
    size_t i;

    if (o == NULL)
        return;
    rooms = json_object_get(o, "bootstrap_rooms");
    if (!json_is_array(rooms)) {
        reply_text(r, 400, "POST /query_dp_ranks: the body needs "
                   "\"bootstrap_rooms\", an array of room ids");
        json_decref(o);
        return;
    }
    res = json_object();
    pthread_mutex_lock(&st->lock);
    json_array_foreach(rooms, i, v) {
        uint64_t room;
        int rc = json_to_u64(v, &room);
        if (rc != INT_OK) {
            pthread_mutex_unlock(&st->lock);
            reply_text(r, 400, "POST /query_dp_ranks: bootstrap_rooms[%zu] %s: room "
                       "ids are integers 0..%llu (or strings of one)", i,
                       rc == INT_RANGE ? "is out of range" : "is not an integer",
                       (unsigned long long)UINT64_MAX);
            json_decref(res);
            json_decref(o);
            return;
        }
        int dp = kvf__bs_rooms_get(&st->rooms, room);
        char key[24];
        snprintf(key, sizeof(key), "%llu", (unsigned long long)room);
        if (dp >= 0 && res != NULL)
            json_object_set_new(res, key, json_integer(dp));
    }
    pthread_mutex_unlock(&st->lock);
    json_decref(o);
    reply_json(r, res);
}

/*
 * Room readiness, for SGLang's --disaggregation-decode-allocation-policy
 * prefill_complete: a decode server allocates a room's pages only once the
 * prefill has computed it.  kvferry's own routes (SGLang carries this on
 * its backends' connections): a prefill rank posts that a room is ready,
 * or failed before it was (with the reason, so that the decode ranks name
 * the root cause); decode ranks ask for many rooms at once.  Bounded as
 * the DP ranks are: the oldest entries are forgotten first.
 */
enum { READY_READY = 1, READY_FAILED = 2 };
#define READY_REASON_MAX 1024u

static void route_room_ready(kvf_registry_state_t *st, const char *body,
                             size_t len, reply_t *r)
{
    json_t *o = parse_object("POST /room_ready", body, len, r);
    json_t *status, *reason;
    uint64_t room;

    if (o == NULL)
        return;
    status = json_object_get(o, "status");
    reason = json_object_get(o, "reason");
    int value = !json_is_string(status) ? 0
                : strcmp(json_string_value(status), "ready") == 0 ? READY_READY
                : strcmp(json_string_value(status), "failed") == 0 ? READY_FAILED
                : 0;
    if (json_to_u64(json_object_get(o, "bootstrap_room"), &room) != 0 ||
        value == 0 ||
        (reason != NULL && !json_is_null(reason) &&
         (!json_is_string(reason) ||
          json_string_length(reason) > READY_REASON_MAX))) {
        reply_text(r, 400, "POST /room_ready: the body needs \"bootstrap_room\" "
                   "(a non-negative integer), \"status\" (\"ready\" or "
                   "\"failed\") and optionally \"reason\" (a string of at most "
                   "%u bytes)", READY_REASON_MAX);
        json_decref(o);
        return;
    }
    pthread_mutex_lock(&st->lock);
    /* A failure is final: a late "ready" does not undo it. */
    int rc = kvf__bs_rooms_get(&st->ready, room) == READY_FAILED ? 0
             : kvf__bs_rooms_put_note(&st->ready, room, value,
                                      json_is_string(reason)
                                          ? json_string_value(reason) : NULL);
    pthread_mutex_unlock(&st->lock);
    json_decref(o);
    if (rc != 0)
        reply_text(r, 500, "out of memory");
    else
        reply_text(r, 200, "OK");
}

/* {"<room>": {"status": "ready"|"failed", "reason": ...}} for the rooms it
 * knows; rooms it does not know are left out (not ready yet). */
static void route_query_ready(kvf_registry_state_t *st, const char *body,
                              size_t len, reply_t *r)
{
    json_t *o = parse_object("POST /query_room_ready", body, len, r);
    json_t *rooms, *res, *v;
    size_t i;

    if (o == NULL)
        return;
    rooms = json_object_get(o, "bootstrap_rooms");
    if (!json_is_array(rooms)) {
        reply_text(r, 400, "POST /query_room_ready: the body needs "
                   "\"bootstrap_rooms\", an array of room ids");
        json_decref(o);
        return;
    }
    res = json_object();
    pthread_mutex_lock(&st->lock);
    json_array_foreach(rooms, i, v) {
        uint64_t room;
        if (json_to_u64(v, &room) != 0) {
            pthread_mutex_unlock(&st->lock);
            reply_text(r, 400, "POST /query_room_ready: bootstrap_rooms[%zu] "
                       "is not a non-negative integer", i);
            json_decref(res);
            json_decref(o);
            return;
        }
        int value = kvf__bs_rooms_get(&st->ready, room);
        const char *note = kvf__bs_rooms_note(&st->ready, room);
        char key[24];
        snprintf(key, sizeof(key), "%llu", (unsigned long long)room);
        json_t *e = value > 0 ? json_pack("{s:s}", "status", value == READY_READY
                                                             ? "ready" : "failed")
                              : NULL;
        if (e != NULL && note != NULL)
            json_object_set_new(e, "reason", json_string(note));
        if (e != NULL && res != NULL)
            json_object_set_new(res, key, e);
        else
            json_decref(e);
    }
    pthread_mutex_unlock(&st->lock);
    json_decref(o);
    reply_json(r, res);
}

/* ------------------------------------------------------------------------ */
/* Metrics                                                                  */
/* ------------------------------------------------------------------------ */

static void metric_head(FILE *f, const char *name, const char *type,
                        const char *help)
{
    fprintf(f, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
}

/* What /metrics reports of the registry, copied under its lock. */
typedef struct metrics_snap {
    uint64_t req[R_N][M_N][C_N];
    size_t   nreg, ntotal, nrooms;
    uint64_t refused[REF_N], replaced;
    kvf_engine_stats_t es;         /* zero when no engine is attached */
    int      have_engine;
} metrics_snap_t;

/* The registry's counters, then the engine's through its callback. */
static void metrics_snapshot(kvf_registry_state_t *st, metrics_snap_t *s)
{
    kvf_bs_stats_cb_t cb;
    void *arg;

    pthread_mutex_lock(&st->lock);
    memcpy(s->req, st->requests, sizeof(s->req));
    s->nreg = st->nregistered;
    s->ntotal = st->nranks;
    s->nrooms = st->rooms.count;
    memcpy(s->refused, st->refused, sizeof(s->refused));
    s->replaced = st->replaced;
    cb = st->stats_cb;
    arg = st->stats_arg;
    if (cb != NULL)
        st->stats_busy++;
    pthread_mutex_unlock(&st->lock);

    /* The engine's callback takes engine locks: call it with ours released. */
    kvf_engine_stats_init(&s->es);
    s->have_engine = cb != NULL;
    if (cb != NULL) {
        cb(arg, &s->es);
        pthread_mutex_lock(&st->lock);
        if (--st->stats_busy == 0)
            pthread_cond_broadcast(&st->stats_idle);
        pthread_mutex_unlock(&st->lock);
    }
}

/* The registry's own metrics: ranks, rooms, access rule, requests. */
static void metrics_write_registry(FILE *f, const kvf_registry_state_t *st,
                                   const metrics_snap_t *s)
{
    metric_head(f, "kvferry_registry_ranks_registered", "gauge",
                "Prefill ranks registered with this bootstrap registry.");
    fprintf(f, "kvferry_registry_ranks_registered %zu\n", s->nreg);
    metric_head(f, "kvferry_registry_ranks_expected", "gauge",
                "Prefill ranks the registry waits for (0: none registered).");
    fprintf(f, "kvferry_registry_ranks_expected %zu\n", s->ntotal);
    metric_head(f, "kvferry_registry_rooms_tracked", "gauge",
                "Rooms with a DP rank from POST /register_dp_rank.");
    fprintf(f, "kvferry_registry_rooms_tracked %zu\n", s->nrooms);
    metric_head(f, "kvferry_registry_auth", "gauge",
                "The registry's access rule for mutating requests (1).");
    fprintf(f, "kvferry_registry_auth{mode=\"%s\"} 1\n",
            st->token[0] ? "token" : st->auth_open ? "open" : "protected");
    metric_head(f, "kvferry_registry_refused_total", "counter",
                "Mutating requests refused (401/403), by reason.");
    for (int i = 0; i < REF_N; i++)
        fprintf(f, "kvferry_registry_refused_total{reason=\"%s\"} %llu\n",
                refusal_names[i], (unsigned long long)s->refused[i]);
    metric_head(f, "kvferry_registry_config_replaced_total", "counter",
                "Parallel configurations replaced by a newer registration.");
    fprintf(f, "kvferry_registry_config_replaced_total %llu\n",
            (unsigned long long)s->replaced);
    metric_head(f, "kvferry_registry_requests_total", "counter",
                "HTTP requests answered, by route, method and status code.");
    for (int a = 0; a < R_N; a++)
        for (int m = 0; m < M_N; m++)
            for (int c = 0; c < C_N; c++) {
                if (s->req[a][m][c] == 0)
                    continue;
                char code[8];
                if (c < C_N - 1)
                    snprintf(code, sizeof(code), "%d", counted_codes[c]);
                else
                    snprintf(code, sizeof(code), "other");
                fprintf(f, "kvferry_registry_requests_total{route=\"%s\","
                        "method=\"%s\",code=\"%s\"} %llu\n", route_names[a],
                        method_names[m], code,
                        (unsigned long long)s->req[a][m][c]);
            }
}

/* The attached engine's metrics: rooms, bytes, failures, peers. */
static void metrics_write_engine(FILE *f, const kvf_engine_stats_t *es)
{
    static const char *const states[] = {NULL, "bootstrapping",
        "waiting_for_input", "transferring"};
    metric_head(f, "kvferry_rooms", "gauge", "Live rooms by poll state.");
    for (int s = KVF_POLL_BOOTSTRAPPING; s <= KVF_POLL_TRANSFERRING; s++)
        fprintf(f, "kvferry_rooms{state=\"%s\"} %llu\n", states[s],
                (unsigned long long)es->rooms_by_state[s]);
    metric_head(f, "kvferry_rooms_total", "counter",
                "Rooms that ended, by result.");
    fprintf(f, "kvferry_rooms_total{result=\"success\"} %llu\n"
            "kvferry_rooms_total{result=\"failed\"} %llu\n",
            (unsigned long long)es->rooms_succeeded,
            (unsigned long long)es->rooms_failed);
    metric_head(f, "kvferry_bytes_total", "counter",
                "KV payload bytes moved, by direction.");
    fprintf(f, "kvferry_bytes_total{direction=\"sent\"} %llu\n"
            "kvferry_bytes_total{direction=\"received\"} %llu\n",
            (unsigned long long)es->bytes_sent,
            (unsigned long long)es->bytes_received);
    metric_head(f, "kvferry_failures_total", "counter",
                "Room failures by blast radius of their status.");
    fprintf(f, "kvferry_failures_total{class=\"room\"} %llu\n"
            "kvferry_failures_total{class=\"peer\"} %llu\n"
            "kvferry_failures_total{class=\"other\"} %llu\n",
            (unsigned long long)es->failures_room,
            (unsigned long long)es->failures_peer,
            (unsigned long long)es->failures_other);
    metric_head(f, "kvferry_peers_connected", "gauge",
                "Peers with a live control connection.");
    fprintf(f, "kvferry_peers_connected %llu\n",
            (unsigned long long)es->peers_connected);
    metric_head(f, "kvferry_peers", "gauge",
                "Connected peers by the transport their payload uses (every "
                "transport kvferry has; one this build lacks reads 0).");
    for (unsigned i = 0; kvf_transport_name(i) != NULL; i++)
        fprintf(f, "kvferry_peers{transport=\"%s\"} %llu\n", kvf_transport_name(i),
                (unsigned long long)es->peers_by_path[i]);
}

static void route_metrics(kvf_registry_state_t *st, reply_t *r)
{
    metrics_snap_t s;
    char *text = NULL;
    size_t textlen = 0;

    metrics_snapshot(st, &s);
    FILE *f = open_memstream(&text, &textlen);
    if (f == NULL) {
        reply_text(r, 500, "out of memory");
        return;
    }
    metrics_write_registry(f, st, &s);
    if (s.have_engine)
        metrics_write_engine(f, &s.es);
    if (fclose(f) != 0 || text == NULL) {
        free(text);
        reply_text(r, 500, "out of memory");
        return;
    }
    r->status = 200;
    r->body = text;
    r->ctype = CT_METRICS;
}

/* ------------------------------------------------------------------------ */
/* Dispatch                                                                 */
/* ------------------------------------------------------------------------ */

static int route_of(const char *path)
{
    for (int i = 0; i < R_OTHER; i++)
        if (path != NULL && strcmp(path, route_names[i]) == 0)
            return i;
    return R_OTHER;
}

static int method_of(const char *method)
{
    for (int i = 0; i < M_OTHER; i++)
        if (method != NULL && strcmp(method, method_names[i]) == 0)
            return i;
    return M_OTHER;
}

const char *kvf__registry_allowed(const char *path)
{
    static const char *const allowed[R_N] = {"GET, HEAD, PUT", "GET, HEAD",
        "POST", "POST", "POST", "POST", "GET, HEAD", NULL};
    return allowed[route_of(path)];
}

/* ------------------------------------------------------------------------ */
/* Access                                                                   */
/* ------------------------------------------------------------------------ */

/* @return -1 when `client` may change the registry, else why not (REF_*).
 * st->token and st->auth_open do not change while the registry serves. */
static int refusal_of(const kvf_registry_state_t *st,
                      const kvf_bs_client_t *client)
{
    if (st->token[0] != '\0') {
        const char *h = client ? client->authorization : NULL;
        if (h == NULL || h[0] == '\0')
            return REF_MISSING;
        /* SGLang's rule: "<scheme> <token>", the scheme case-insensitive,
         * the token everything after the first space. */
        if (strncasecmp(h, "Bearer ", 7) != 0)
            return REF_WRONG;
        return kvf_token_equal(h + 7, st->token) ? -1 : REF_WRONG;
    }
    if (st->auth_open || client == NULL || client->loopback)
        return -1;
    return REF_NOT_LOOPBACK;
}

/* Count a refusal and log it, at most once per REFUSAL_LOG_MS: a flood of
 * bad requests must not become a flood of log lines. */
static void note_refusal(kvf_registry_state_t *st, int why,
                         const char *method, const char *path,
                         const kvf_bs_client_t *client)
{
    static const char *const what[REF_N] = {
        "no bearer token", "a wrong bearer token",
        "not from loopback, and the registry has no token"};
    uint64_t now = now_ms(st), more = 0;
    int log = 0;

    pthread_mutex_lock(&st->lock);
    st->refused[why]++;
    if (!st->refusal_logged || now - st->refusal_logged_ms >= REFUSAL_LOG_MS) {
        log = 1;
        more = st->refused_unlogged;
        st->refused_unlogged = 0;
        st->refusal_logged = 1;
        st->refusal_logged_ms = now;
    } else {
        st->refused_unlogged++;
    }
    pthread_mutex_unlock(&st->lock);
    if (log && more)
        kvf_warn("bootstrap registry: refused %.16s %s from %s: %s (and %llu "
                 "more refused requests since the last such line)", method,
                 path, client && client->addr ? client->addr : "unknown",
                 what[why], (unsigned long long)more);
    else if (log)
        kvf_warn("bootstrap registry: refused %.16s %s from %s: %s (further "
                 "refusals: one line per %u s)", method, path,
                 client && client->addr ? client->addr : "unknown", what[why],
                 REFUSAL_LOG_MS / 1000);
}

static void reply_refusal(reply_t *r, int why, const char *method,
                          const char *path)
{
    switch (why) {
    case REF_MISSING:
        reply_text(r, 401, "Unauthorized: %.16s %s needs this bootstrap "
                   "registry's cluster token, as \"Authorization: Bearer "
                   "<token>\". kvferry and SGLang send it when KVF_AUTH_TOKEN, "
                   "KVF_AUTH_TOKEN_FILE or "
                   "SGLANG_DISAGGREGATION_BOOTSTRAP_AUTH_TOKEN is set.",
                   method, path);
        break;
    case REF_WRONG:
        reply_text(r, 401, "Unauthorized: the bearer token of %.16s %s does "
                   "not match this bootstrap registry's cluster token. Give "
                   "the registry and every prefill rank the same "
                   "KVF_AUTH_TOKEN (or KVF_AUTH_TOKEN_FILE).", method, path);
        break;
    default:
        reply_text(r, 403, "Forbidden: this bootstrap registry has no "
                   "cluster token (protected mode), so it accepts %.16s %s "
                   "from loopback clients only. Set KVF_AUTH_TOKEN (or "
                   "KVF_AUTH_TOKEN_FILE) on the registry and on every rank, "
                   "or start the registry with KVF_AUTH=none to accept "
                   "anyone.", method, path);
        break;
    }
}

/* 0 when the raw query is within the limits, else a 414/400 reply. */
static int check_query(const char *query, reply_t *r)
{
    size_t len = query ? strlen(query) : 0, n = len ? 1 : 0;

    if (len > KVF_BS_MAX_QUERY) {
        reply_text(r, 414, "URI Too Long: the query string is longer than "
                   "%u bytes; the bootstrap registry accepts at most that "
                   "(GET /route needs four short parameters)",
                   KVF_BS_MAX_QUERY);
        return -1;
    }
    for (size_t i = 0; i < len; i++)
        n += query[i] == '&';
    if (n > KVF_BS_MAX_QUERY_PARAMS) {
        reply_text(r, 400, "too many query parameters: %zu; the bootstrap "
                   "registry accepts at most %u (GET /route needs four)", n,
                   KVF_BS_MAX_QUERY_PARAMS);
        return -1;
    }
    return 0;
}

int kvf__registry_handle(kvf_registry_state_t *st,
                         const kvf_bs_client_t *client, const char *method,
                         const char *path, const char *query,
                         const char *body, size_t body_len, char **resp_p,
                         const char **ctype_p)
{
    int route = route_of(path), m = method_of(method);
    int get = m == M_GET || m == M_HEAD;
    int mutating = (route == R_ROUTE && m == M_PUT) ||
                   (route == R_REG_DP && m == M_POST) ||
                   (route == R_READY && m == M_POST);
    int why = mutating ? refusal_of(st, client) : -1;
    reply_t r = {0};

    if (why >= 0) {
        note_refusal(st, why, method_names[m], route_names[route], client);
        reply_refusal(&r, why, method_names[m], route_names[route]);
    } else if (body_len > KVF_BS_MAX_BODY) {
        reply_text(&r, 413, "request body too large: the bootstrap registry "
                   "accepts at most %u bytes", KVF_BS_MAX_BODY);
    } else if (check_query(query, &r) != 0) {
        /* r holds the 414 or 400 */
    } else if (route == R_OTHER) {
        reply_text(&r, 404, "no such route: %.200s (routes: /route, /health, "
                   "/register_dp_rank, /query_dp_ranks, /room_ready, "
                   "/query_room_ready, /metrics)", path ? path : "");
    } else if (route == R_ROUTE && m == M_PUT) {
        route_put(st, body, body_len, &r);
    } else if (route == R_ROUTE && get) {
        route_get(st, query, &r);
    } else if (route == R_HEALTH && get) {
        reply_text(&r, 200, "OK");
    } else if (route == R_REG_DP && m == M_POST) {
        route_register_dp(st, body, body_len, &r);
    } else if (route == R_QUERY_DP && m == M_POST) {
        route_query_dp(st, body, body_len, &r);
    } else if (route == R_READY && m == M_POST) {
        route_room_ready(st, body, body_len, &r);
    } else if (route == R_QUERY_READY && m == M_POST) {
        route_query_ready(st, body, body_len, &r);
    } else if (route == R_METRICS && get) {
        route_metrics(st, &r);
    } else {
        reply_text(&r, 405, "Method not allowed: %.16s %s (allowed: %s)",
                   method ? method : "", route_names[route],
                   kvf__registry_allowed(path));
    }

    int c = 0;
    while (c < C_N - 1 && counted_codes[c] != r.status)
        c++;
    pthread_mutex_lock(&st->lock);
    st->requests[route][m][c]++;
    pthread_mutex_unlock(&st->lock);

    *resp_p = r.body;
    *ctype_p = r.ctype ? r.ctype : CT_TEXT;
    return r.status;
}

kvf_registry_state_t *kvf__registry_state_create(size_t max_rooms)
{
    kvf_registry_state_t *st = calloc(1, sizeof(*st));

    if (st == NULL)
        return NULL;
    pthread_mutex_init(&st->lock, NULL);
    pthread_cond_init(&st->stats_idle, NULL);
    kvf__bs_rooms_init(&st->rooms, max_rooms ? max_rooms : KVF_BS_MAX_ROOMS);
    kvf__bs_rooms_init(&st->ready, max_rooms ? max_rooms : KVF_BS_MAX_ROOMS);
    return st;
}

void kvf__registry_state_destroy(kvf_registry_state_t *st)
{
    if (st == NULL)
        return;
    for (size_t i = 0; i < st->nranks; i++)
        free(st->ranks[i].ip);
    free(st->ranks);
    kvf__bs_rooms_free(&st->rooms);
    kvf__bs_rooms_free(&st->ready);
    OPENSSL_cleanse(st->token, sizeof(st->token));
    pthread_cond_destroy(&st->stats_idle);
    pthread_mutex_destroy(&st->lock);
    free(st);
}

kvf_status_t kvf__registry_set_auth(kvf_registry_state_t *st,
                                    const char *token, int open)
{
    char err[256];

    st->token[0] = '\0';
    st->auth_open = 0;
    if (token != NULL && token[0] != '\0') {
        kvf_status_t rc = kvf_token_load(token, st->token, sizeof(st->token),
                                         err, sizeof(err));
        if (rc != KVF_OK) {
            kvf_error("bootstrap registry: %s", err);
            return rc;
        }
        return KVF_OK;
    }
    st->auth_open = open != 0;
    return KVF_OK;
}

void kvf__registry_set_clock(kvf_registry_state_t *st, kvf_bs_clock_cb_t cb,
                             void *arg)
{
    st->clock = cb;
    st->clock_arg = arg;
}

void kvf__registry_set_stats_cb(kvf_registry_state_t *st,
                                kvf_bs_stats_cb_t cb, void *arg)
{
    pthread_mutex_lock(&st->lock);
    st->stats_cb = cb;
    st->stats_arg = arg;
    while (st->stats_busy > 0)
        pthread_cond_wait(&st->stats_idle, &st->lock);
    pthread_mutex_unlock(&st->lock);
}

