/*
 * The resolver thread: everything that talks to a bootstrap registry,
 * because those calls block (HTTP with timeouts) and must never run on an
 * application's thread or on the progress thread.
 *
 * Prefill: registers the engine (PUT /route: SGLang's full body, every
 * field from the engine's parameters, layout and bound endpoint), then
 * again every few seconds so that a restarted registry learns it back.
 * Decode: for each new receiver, finds the prefill rank that serves it
 * (GET /route, cached per registry and per rank; the caches are dropped
 * whenever a peer dies or closes a connection before its handshake, since
 * it may have come back elsewhere) and
 * hands what it found to the room's `resolved` op (receiver.c), which
 * links the room to those peers: the resolver names no receiver code.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bootstrap/bootstrap.h"
#include "core/resolver.h"
#include "core/room.h"
#include "core/sync.h"
#include "util/log.h"
#include "util/time.h"

#define REGISTER_PERIOD_MS  5000
#define REGISTER_RETRY_MS   1000
#define RETRY_MS            200
#define CALL_TIMEOUT_MS     2000
#define CACHE_MAX           64
#define RANKS_MAX           1024   /* every rank of several servers' DP groups */

typedef struct info_entry {
    char          addr[KVF_ADDR_MAX];
    kvf_bs_info_t info;
} info_entry_t;

typedef struct rank_entry {
    char addr[KVF_ADDR_MAX];
    int  dp, tp, pp;
    char ip[64];
    int  port;
} rank_entry_t;

typedef struct resolver {
    info_entry_t info[CACHE_MAX];
    int          ninfo;
    rank_entry_t ranks[RANKS_MAX];
    int          nranks;
    uint64_t     generation;
} resolver_t;


static const kvf_bs_info_t *get_info(resolver_t *rs, const char *addr, kvf_lookup_t *out)
{
    for (int i = 0; i < rs->ninfo; i++)
        if (strcmp(rs->info[i].addr, addr) == 0)
            return &rs->info[i].info;
    kvf_bs_info_t info;
    kvf_status_t st = kvf__bs_get_info(addr, CALL_TIMEOUT_MS, &info, out->err,
                                       sizeof(out->err));
    if (st != KVF_OK) {
        out->res = KVF_LOOKUP_RETRY;
        return NULL;
    }
    if (rs->ninfo == CACHE_MAX)
        rs->ninfo = 0;
    info_entry_t *e = &rs->info[rs->ninfo++];
    snprintf(e->addr, sizeof(e->addr), "%s", addr);
    e->info = info;
    return &e->info;
}

static int pick_dp(const kvf_bs_info_t *info, const char *addr, uint64_t room,
                   int requested, kvf_lookup_t *out)
{
    if (requested >= 0) {
        if (requested >= info->dp_size) {
            out->res = KVF_LOOKUP_FATAL;
            out->status = KVF_ERR_INVALID_PARAM;
            snprintf(out->err, sizeof(out->err), "prefill DP rank %d requested, but the "
                     "prefill server at %s has dp_size=%d", requested, addr, info->dp_size);
            return -1;
        }
        return requested;
    }
    if (info->dp_size <= 1)
        return 0;
    if (info->follow_bootstrap_room)
        return (int)(room % (uint64_t)info->dp_size);
    int dp = -1;
    char err[256];
    if (kvf__bs_query_dp_ranks(addr, &room, 1, &dp, CALL_TIMEOUT_MS, err, sizeof(err)) ==
            KVF_OK && dp >= 0 && dp < info->dp_size)
        return dp;
    return (int)(room % (uint64_t)info->dp_size);
}

static uint32_t gcd_u32(uint32_t a, uint32_t b)
{
    while (b != 0) {
        uint32_t t = a % b;
        a = b;
        b = t;
    }
    return a;
}

/*
 * kvf__receiver_targets_unlocked (room.h): the prefill ranks a decode rank talks to
 * for a room: for each pipeline
 * stage it takes layers from (its own stage, or every stage when the
 * decode side has PP 1), the TP ranks that hold its heads (parallel.h)
 * plus the idle ones it must tell about the room.  An unsupported PP
 * pairing still links its own stage, so the handshake can refuse it on
 * both sides.  `heads`: the model's KV heads as the engine knew them when
 * the room was taken (0: its layout leaves them to the prefill, whose
 * HELLO has not come yet): then the ranks are those of as many heads as
 * both TP sizes divide evenly, which is right for every model without
 * head replication, and kvf__receiver_try_request checks the guess once
 * the heads are known.
 */
int kvf__receiver_targets_unlocked(const kvf_engine_t *eng, uint32_t heads, int prefill_tp,
                          int prefill_pp, int *tp, int *pp)
{
    const kvf_engine_params_t *p = &eng->params;
    const kvf_layout_int_t *l = &eng->layout;
    int src[KVF_MAX_SOURCES], idle[KVF_MAX_SOURCES], n = 0;
    uint32_t P = (uint32_t)prefill_tp, D = (uint32_t)p->tp_size;
    if (l->attn == KVF_ATTN_MHA && heads == 0)
        heads = P / gcd_u32(P, D) * D;          /* lcm: at most 4096 x 65536 */
    int ns = kvf__sources(l->attn, heads, prefill_tp, p->tp_size, p->tp_rank, src);
    int ni = kvf__idle_sources(l->attn, heads, prefill_tp, p->tp_size, p->tp_rank, idle);
    int s0 = 0, s1 = prefill_pp;
    if (p->pp_size != 1 || prefill_pp == 1) {
        s0 = p->pp_rank % prefill_pp;
        s1 = s0 + 1;
    }
    if ((s1 - s0) * (ns + ni) > KVF_MAX_TARGETS)
        return -1;
    for (int s = s0; s < s1; s++) {
        for (int i = 0; i < ns + ni; i++) {
            tp[n] = i < ns ? src[i] : idle[i - ns];
            pp[n++] = s;
        }
    }
    return n;
}

static int lookup_rank(resolver_t *rs, const char *addr, int dp, int tp, int pp, char *ip,
                       size_t iplen, int *port, kvf_lookup_t *out)
{
    for (int i = 0; i < rs->nranks; i++) {
        rank_entry_t *e = &rs->ranks[i];
        if (e->dp == dp && e->tp == tp && e->pp == pp && !strcmp(e->addr, addr)) {
            snprintf(ip, iplen, "%s", e->ip);
            *port = e->port;
            return 1;
        }
    }
    if (kvf__bs_get_rank(addr, dp, 0, tp, pp, CALL_TIMEOUT_MS, ip, iplen, port, out->err,
                         sizeof(out->err)) != KVF_OK)
        return 0;
    if (rs->nranks == RANKS_MAX)
        rs->nranks = 0;
    rank_entry_t *e = &rs->ranks[rs->nranks++];
    snprintf(e->addr, sizeof(e->addr), "%s", addr);
    e->dp = dp;
    e->tp = tp;
    e->pp = pp;
    snprintf(e->ip, sizeof(e->ip), "%s", ip);
    e->port = *port;
    return 1;
}

/*
 * The prefill ranks of DP group `dp` the room does not read from (its
 * targets are (tp[i], pp[i]), i < n): the decode rank watches them
 * (siblings.c), so that every rank of the room hears of its failure.  A
 * group of more ranks than a result holds has only its first ones
 * watched: the others still hear through them.  @return 0 (and out->res
 * set) when a rank's address is not known yet.
 */
static int watch_targets(resolver_t *rs, const char *addr, int dp, const kvf_bs_info_t *info,
                         const int *tp, const int *pp, int n, kvf_lookup_t *out)
{
    out->nwatch = 0;
    for (int s = 0; s < info->pp_size; s++)
        for (int t = 0; t < info->attn_tp_size && out->nwatch < KVF_MAX_TARGETS; t++) {
            int linked = 0;
            for (int i = 0; i < n && !linked; i++)
                linked = tp[i] == t && pp[i] == s;
            if (linked)
                continue;
            kvf_target_t *w = &out->w[out->nwatch];
            w->rank = t;
            w->instance = 0;
            if (!lookup_rank(rs, addr, dp, t, s, w->host, sizeof(w->host), &w->port, out)) {
                out->res = KVF_LOOKUP_RETRY;
                return 0;
            }
            out->nwatch++;
        }
    return 1;
}

static void resolve_room(resolver_t *rs, const kvf_engine_t *eng, uint32_t heads,
                         const char *addr, uint64_t room, int dp_req, kvf_lookup_t *out)
{
    const kvf_bs_info_t *info = get_info(rs, addr, out);
    int tp[KVF_MAX_TARGETS], pp[KVF_MAX_TARGETS];

    if (info == NULL)
        return;
    if (info->attn_tp_size < 1 || info->attn_tp_size > 4096 || info->pp_size < 1 ||
        info->pp_size > 1024) {
        out->res = KVF_LOOKUP_FATAL;
        out->status = KVF_ERR_BOOTSTRAP;
        snprintf(out->err, sizeof(out->err), "bootstrap registry %s reports "
                 "attn_tp_size=%d, pp_size=%d", addr, info->attn_tp_size, info->pp_size);
        return;
    }
    int dp = pick_dp(info, addr, room, dp_req, out);
    if (dp < 0)
        return;
    int n = kvf__receiver_targets_unlocked(eng, heads, info->attn_tp_size, info->pp_size, tp, pp);
    if (n < 0) {
        out->res = KVF_LOOKUP_FATAL;
        out->status = KVF_ERR_UNSUPPORTED;
        snprintf(out->err, sizeof(out->err), "decode rank %d would read room %llu from more "
                 "than %d prefill ranks of %s (attn_tp_size %d, pp_size %d), more than "
                 "kvferry links", eng->params.tp_rank, (unsigned long long)room,
                 KVF_MAX_TARGETS, addr, info->attn_tp_size, info->pp_size);
        return;
    }
    for (int i = 0; i < n; i++) {
        out->t[i].rank = tp[i];
        if (!lookup_rank(rs, addr, dp, tp[i], pp[i], out->t[i].host, sizeof(out->t[i].host),
                         &out->t[i].port, out)) {
            out->res = KVF_LOOKUP_RETRY;
            return;
        }
    }
    out->ntargets = n;
    if (!watch_targets(rs, addr, dp, info, tp, pp, n, out))
        return;
    out->res = KVF_LOOKUP_OK;
}

/*
 * Does room r need its prefill ranks looked up?  While it bootstraps; and
 * once it failed before it knew them (its application failed or aborted
 * it), for as long as their senders would wait for its destination (the
 * bootstrap deadline): linked, it tells them (kvf__receiver_tell_failed)
 * rather than leave them to fail at that deadline, naming it.
 */
static int wants_lookup(const kvf_engine_t *eng, const kvf_room_t *r)
{
    kvf_poll_t st = atomic_load(&r->state);
    return r->attached &&
           (st == KVF_POLL_BOOTSTRAPPING ||
            (st == KVF_POLL_FAILED && r->nlinks == 0 && r->nwatch == 0 &&
             kvf_elapsed_ms(kvf_now_ms(), r->t_create_ms) < eng->params.bootstrap_timeout_ms));
}

/* ------------------------------------------------------------------------ */
/* The registration                                                         */
/* ------------------------------------------------------------------------ */

#define DEFAULT_LBM "follow_bootstrap_room"

/* What the registry accepts as a string field: 1..63 printable characters
 * without spaces (routes.c's field_str). */
static int reg_string_ok(const char *s)
{
    size_t n = 0;
    for (; s[n] != '\0'; n++)
        if (s[n] <= ' ' || s[n] >= 0x7f)
            return 0;
    return n > 0 && n < 64;
}

static int check_flag(const char *name, int v)
{
    if (v == 0 || v == 1)
        return 1;
    kvf_error("invalid %s %d: 0 or 1", name, v);
    return 0;
}

kvf_status_t kvf__registration_check(const kvf_engine_params_t *p)
{
    int cp_size = p->cp_size ? p->cp_size : 1;
    const struct { const char *name, *v; } strs[] = {
        {"kv_cache_dtype", p->kv_cache_dtype},
        {"load_balance_method", p->load_balance_method},
        {"decode_allocation_policy", p->decode_allocation_policy},
    };

    if (cp_size < 1 || p->cp_rank < 0 || p->cp_rank >= cp_size) {
        kvf_error("invalid cp: rank %d of size %d (need 0 <= rank < size; "
                  "size 0 means 1)", p->cp_rank, p->cp_size);
        return KVF_ERR_INVALID_PARAM;
    }
    if (!check_flag("dp_attention", p->dp_attention) ||
        !check_flag("dsa_cache_layer_split", p->dsa_cache_layer_split))
        return KVF_ERR_INVALID_PARAM;
    for (size_t i = 0; i < sizeof(strs) / sizeof(strs[0]); i++) {
        if (strs[i].v != NULL && strs[i].v[0] != '\0' &&
            !reg_string_ok(strs[i].v)) {
            kvf_error("invalid %s \"%.80s\": 1 to 63 printable characters "
                      "without spaces", strs[i].name, strs[i].v);
            return KVF_ERR_INVALID_PARAM;
        }
    }
    if (p->prefill_http_port < 0 || p->prefill_http_port > 65535) {
        kvf_error("invalid prefill_http_port %d: 1..65535, or 0 for none",
                  p->prefill_http_port);
        return KVF_ERR_INVALID_PARAM;
    }
    return KVF_OK;
}

/* A string parameter, else its variable (a bad value is ignored, said so),
 * into buf; "" when neither is set. */
static void reg_string(const char *param, const char *var, char *buf, size_t len)
{
    const char *v = param;

    if (v == NULL || v[0] == '\0') {
        v = getenv(var);
        if (v != NULL && v[0] != '\0' && !reg_string_ok(v)) {
            kvf_warn("ignoring %s=%.80s: expected 1 to 63 printable characters "
                     "without spaces", var, v);
            v = NULL;
        }
    }
    snprintf(buf, len, "%s", v ? v : "");
}

void kvf__registration_setup_unlocked(kvf_engine_t *eng)
{
    kvf_engine_params_t *p = &eng->params;

    if (p->cp_size == 0)
        p->cp_size = 1;
    reg_string(p->kv_cache_dtype, "KVF_KV_CACHE_DTYPE", eng->reg_dtype,
               sizeof(eng->reg_dtype));
    reg_string(p->load_balance_method, "KVF_LOAD_BALANCE_METHOD", eng->reg_lbm,
               sizeof(eng->reg_lbm));
    if (eng->reg_lbm[0] == '\0')
        snprintf(eng->reg_lbm, sizeof(eng->reg_lbm), "%s", DEFAULT_LBM);
    snprintf(eng->reg_policy, sizeof(eng->reg_policy), "%s",
             p->decode_allocation_policy ? p->decode_allocation_policy : "");
    /* The caller's strings are not kept: only the copies. */
    p->kv_cache_dtype = eng->reg_dtype[0] ? eng->reg_dtype : NULL;
    p->load_balance_method = eng->reg_lbm;
    p->decode_allocation_policy = eng->reg_policy[0] ? eng->reg_policy : NULL;
    const char *hp = getenv("KVF_PREFILL_HTTP_PORT");
    if (p->prefill_http_port == 0 && hp != NULL && hp[0] != '\0') {
        char *end;
        long v = strtol(hp, &end, 10);
        if (*end != '\0' || v < 1 || v > 65535)
            kvf_warn("ignoring KVF_PREFILL_HTTP_PORT=%.80s: expected a port "
                     "(1..65535)", hp);
        else
            p->prefill_http_port = (int)v;
    }
}

/*
 * SGLang's PUT /route body (CommonKVManager.register_to_bootstrap) from
 * this engine's configuration; docs/REGISTRY.md tables where each field
 * comes from.  System DP (no DP attention) registers dp as system_dp_*
 * with attention DP 1; DP attention registers it as attn_dp_* with system
 * DP 1.  SGLang sends its scheduler's DP rank as system_dp_rank either way.
 */
static kvf_bs_reg_t registration(const kvf_engine_t *eng)
{
    const kvf_engine_params_t *p = &eng->params;
    int attn_dp = p->dp_attention;

    return (kvf_bs_reg_t){
        .attn_tp_size = p->tp_size, .attn_tp_rank = p->tp_rank,
        .attn_cp_size = p->cp_size, .attn_cp_rank = p->cp_rank,
        .attn_dp_size = attn_dp ? p->dp_size : 1,
        .attn_dp_rank = attn_dp ? p->dp_rank : 0,
        .pp_size = p->pp_size, .pp_rank = p->pp_rank,
        .system_dp_size = attn_dp ? 1 : p->dp_size,
        .system_dp_rank = p->dp_rank,
        .rank_ip = eng->host, .rank_port = eng->port,
        .page_size = (int)eng->layout.page_size,
        .kv_cache_dtype = eng->reg_dtype[0] ? eng->reg_dtype : eng->layout.kv_dtype,
        .load_balance_method = eng->reg_lbm,
        .enable_dsa_cache_layer_split = p->dsa_cache_layer_split,
        .prefill_http_port = p->prefill_http_port,
        .decode_allocation_policy = p->decode_allocation_policy,
    };
}

static void do_register(kvf_engine_t *eng)
{
    const kvf_engine_params_t *p = &eng->params;
    char err[KVF_REASON_MAX];
    kvf_bs_reg_t reg = registration(eng);
    /* eng->token is set at create and never changes: no lock needed. */
    kvf_status_t st = kvf__bs_register_auth(eng->bootstrap_addr, &reg,
                                            eng->has_token ? eng->token : NULL,
                                            CALL_TIMEOUT_MS, err, sizeof(err));
    kvf__lock(eng);
    free(eng->register_error);
    eng->register_error = NULL;
    if (st != KVF_OK) {
        kvf_error("prefill rank %d cannot register with the bootstrap registry: %s",
                  p->tp_rank, err);
        eng->register_error = strdup(err);
    }
    kvf__unlock(eng);
}

static void timed_wait(kvf_engine_t *eng, uint64_t ms)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    ts.tv_sec += (time_t)(ms / 1000);
    ts.tv_nsec += (long)(ms % 1000) * 1000000L;
    if (ts.tv_nsec >= 1000000000L) {
        ts.tv_sec++;
        ts.tv_nsec -= 1000000000L;
    }
    kvf__cond_timedwait(eng, &eng->resolver_cond, &ts);
}

static void *resolver_main(void *arg)
{
    kvf_engine_t *eng = arg;
    resolver_t *rs = calloc(1, sizeof(*rs));
    uint64_t next_register = 0;
    int retrying = 0;

    kvf__lock(eng);
    while (!eng->stopping && rs != NULL) {
        uint64_t now = kvf_now_ms();
        if (eng->want_register && now >= next_register) {
            kvf__unlock(eng);
            do_register(eng);
            kvf__lock(eng);
            next_register = kvf_now_ms() +
                (eng->register_error ? REGISTER_RETRY_MS : REGISTER_PERIOD_MS);
            continue;
        }
        if (eng->rq_head == NULL || retrying) {
            uint64_t wait = eng->want_register ? next_register - now : 1000;
            if (retrying && wait > RETRY_MS)
                wait = RETRY_MS;
            timed_wait(eng, wait ? wait : 1);
            retrying = 0;
            continue;
        }
        if (rs->generation != eng->peer_generation) {
            rs->ninfo = rs->nranks = 0;
            rs->generation = eng->peer_generation;
        }
        kvf_room_t *batch = eng->rq_head;
        eng->rq_head = eng->rq_tail = NULL;
        while (batch != NULL && !eng->stopping) {
            kvf_room_t *r = batch;
            batch = receiver_of(r)->rq_next;
            receiver_of(r)->rq_next = NULL;
            kvf_lookup_t res = {.res = KVF_LOOKUP_OK};
            if (wants_lookup(eng, r)) {
                char *addr = strdup(receiver_of(r)->bootstrap_addr);
                uint64_t id = r->id;
                int dp = receiver_of(r)->dp_rank;
                uint32_t heads = eng->layout.total_heads;   /* a peer's HELLO may set it */
                kvf__unlock(eng);
                if (addr == NULL) {
                    res.res = KVF_LOOKUP_FATAL;
                    res.status = KVF_ERR_NO_MEMORY;
                } else {
                    resolve_room(rs, eng, heads, addr, id, dp, &res);
                }
                free(addr);
                kvf__lock(eng);
                if (wants_lookup(eng, r))
                    r->ops->resolved(r, &res);
                retrying |= res.res == KVF_LOOKUP_RETRY;
            }
            kvf__room_put(r);
        }
        while (batch != NULL) {
            kvf_room_t *r = batch;
            batch = receiver_of(r)->rq_next;
            kvf__room_put(r);
        }
    }
    kvf__unlock(eng);
    free(rs);
    return NULL;
}

void kvf__resolver_enqueue(kvf_engine_t *eng, kvf_room_t *r)
{
    KVF_ASSERT_LOCKED(eng);
    r->refs++;
    receiver_of(r)->rq_next = NULL;
    if (eng->rq_tail)
        receiver_of(eng->rq_tail)->rq_next = r;
    else
        eng->rq_head = r;
    eng->rq_tail = r;
    pthread_cond_broadcast(&eng->resolver_cond);
}

kvf_status_t kvf__resolver_start_unlocked(kvf_engine_t *eng)
{
    if (pthread_create(&eng->resolver_thread, NULL, resolver_main, eng) != 0) {
        kvf_error("cannot start the resolver thread");
        return KVF_ERR_NO_MEMORY;
    }
    return KVF_OK;
}

void kvf__resolver_stop(kvf_engine_t *eng)
{
    kvf__lock(eng);
    eng->stopping = 1;
    pthread_cond_broadcast(&eng->resolver_cond);
    kvf__unlock(eng);
    pthread_join(eng->resolver_thread, NULL);
    /* Rooms still queued hold a reference each. */
    kvf__lock(eng);
    while (eng->rq_head != NULL) {
        kvf_room_t *r = eng->rq_head;
        eng->rq_head = receiver_of(r)->rq_next;
        kvf__room_put(r);
    }
    eng->rq_tail = NULL;
    kvf__unlock(eng);
}
