/*
 * Bootstrap registry: internal interface.
 *
 * The server (registry.c, libmicrohttpd) keeps which prefill rank serves
 * which (dp, cp, tp, pp) coordinates and answers SGLang's bootstrap routes.
 * The client (client.c, libcurl, jansson) is what engines use: blocking
 * calls with timeouts, made only from an engine's resolver thread, never
 * from an application's thread.
 */
#ifndef KVF_BOOTSTRAP_BOOTSTRAP_H
#define KVF_BOOTSTRAP_BOOTSTRAP_H

#include <stddef.h>
#include <stdint.h>
#include <sys/socket.h>

#include "kvferry/kvferry.h"

/* Largest request body the server accepts (bytes); more gets 413. */
#define KVF_BS_MAX_BODY (1u << 20)
/* Largest query string (bytes, raw) and number of query parameters a
 * request may carry: more gets 414 / 400 at once.  GET /route needs 4. */
#define KVF_BS_MAX_QUERY        2048u
#define KVF_BS_MAX_QUERY_PARAMS 32u
/* Connections the server keeps open at once, in total and per client IP,
 * and how long an idle one may stay (seconds). */
#define KVF_BS_MAX_CONNS        512u
#define KVF_BS_MAX_CONNS_PER_IP 64u
#define KVF_BS_IDLE_TIMEOUT_S   15u
/* A parallel configuration none of whose ranks has registered for this
 * long is stale: a conflicting registration may replace it (routes.c). */
#define KVF_BS_STALE_MS         15000u

/* A prefill rank's registration: the JSON fields of SGLang's PUT /route. */
typedef struct kvf_bs_reg {
    int         attn_tp_size, attn_tp_rank;
    int         attn_cp_size, attn_cp_rank;
    int         attn_dp_size, attn_dp_rank;
    int         pp_size, pp_rank;
    int         system_dp_size, system_dp_rank;
    const char *rank_ip;
    int         rank_port;
    int         page_size;
    /* SGLang's --kv-cache-dtype string ("auto", "fp8_e4m3", ...); NULL is
     * sent as null. */
    const char *kv_cache_dtype;
    /* e.g. "follow_bootstrap_room"; NULL is not sent, which SGLang (and
     * the registry) read as "follow_bootstrap_room". */
    const char *load_balance_method;
    int         enable_dsa_cache_layer_split;   /* sent as a JSON boolean */
    int         prefill_http_port;  /* 1..65535; 0 is sent as null (unknown) */
    /* SGLang's --disaggregation-decode-allocation-policy ("early",
     * "prefill_complete"); NULL is not sent (older SGLang has none). */
    const char *decode_allocation_policy;
} kvf_bs_reg_t;

/* The server's parallel info: GET /route with every parameter -1 (the
 * fields of SGLang's PrefillServerInfo that the server fills). */
typedef struct kvf_bs_info {
    int  attn_tp_size;
    int  attn_cp_size;
    int  dp_size;
    int  pp_size;
    int  page_size;                 /* 0: null */
    char kv_cache_dtype[64];        /* "": null */
    int  follow_bootstrap_room;
    int  enable_dsa_cache_layer_split;
    int  prefill_http_port;         /* 0: null (not known) */
    char decode_allocation_policy[64];  /* "": not registered */
} kvf_bs_info_t;

/*
 * Source of engine statistics for GET /metrics (an in-process registry
 * reports its engine's rooms, bytes and failures).  Called from the
 * server's thread.
 */
typedef void (*kvf_bs_stats_cb_t)(void *arg, kvf_engine_stats_t *stats_p);
void kvf__bootstrap_set_stats_cb(kvf_bootstrap_t *bs, kvf_bs_stats_cb_t cb,
                                 void *arg);

/*
 * Client calls.  `addr` is "host:port".  Each call blocks for at most
 * timeout_ms and writes a one-line reason into err on failure.  Every call
 * also returns KVF_ERR_INVALID_PARAM for an address kvf__split_addr()
 * refuses or whose port is 0, and KVF_ERR_NO_MEMORY.
 */

/*
 * The mutating calls (PUT /route, POST /register_dp_rank) send
 * "Authorization: Bearer <token>" when a cluster token is configured
 * (util/token.h: KVF_AUTH_TOKEN, KVF_AUTH_TOKEN_FILE,
 * SGLANG_DISAGGREGATION_BOOTSTRAP_AUTH_TOKEN); the _auth variants take an
 * explicit token that wins over the environment.  The read-only calls never
 * send it.  A 401 or 403 answer is final and its err says how to fix it.
 */

/* PUT /route, retried with exponential backoff (50 ms doubling to 1 s)
 * until it answers 200 or timeout_ms has passed.  An answer that retrying
 * cannot change (400 invalid registration, 401/403 refused, 409
 * conflicting parallel info, 413) ends the call at once.
 * @return KVF_OK, KVF_ERR_BOOTSTRAP. */
kvf_status_t kvf__bs_register(const char *addr, const kvf_bs_reg_t *reg,
                              unsigned timeout_ms, char *err, size_t errlen);
kvf_status_t kvf__bs_register_auth(const char *addr, const kvf_bs_reg_t *reg,
                                   const char *token, unsigned timeout_ms,
                                   char *err, size_t errlen);

/* GET /route?...=-1.  @return KVF_OK; KVF_ERR_AGAIN (503: not every rank
 * has registered yet); KVF_ERR_BOOTSTRAP (unreachable, other answers). */
kvf_status_t kvf__bs_get_info(const char *addr, unsigned timeout_ms,
                              kvf_bs_info_t *info_p, char *err, size_t errlen);

/* GET /route for one prefill rank.  @return KVF_OK; KVF_ERR_NOT_FOUND
 * (404: every rank has registered, this one is not among them);
 * KVF_ERR_AGAIN (503: this rank has not registered, others may still
 * come); KVF_ERR_BOOTSTRAP. */
kvf_status_t kvf__bs_get_rank(const char *addr, int dp_rank, int cp_rank,
                              int tp_rank, int pp_rank, unsigned timeout_ms,
                              char *ip, size_t iplen, int *port_p,
                              char *err, size_t errlen);

/* GET /health.  @return KVF_OK or KVF_ERR_BOOTSTRAP. */
kvf_status_t kvf__bs_health(const char *addr, unsigned timeout_ms,
                            char *err, size_t errlen);

/* POST /register_dp_rank {bootstrap_room, dp_rank}. */
kvf_status_t kvf__bs_register_dp_rank(const char *addr, uint64_t room,
                                      int dp_rank, unsigned timeout_ms,
                                      char *err, size_t errlen);
kvf_status_t kvf__bs_register_dp_rank_auth(const char *addr, uint64_t room,
                                           int dp_rank, const char *token,
                                           unsigned timeout_ms, char *err,
                                           size_t errlen);

/* POST /query_dp_ranks {bootstrap_rooms:[...]}: dp_ranks_p[i] is the DP
 * rank of rooms[i], or -1 where the registry does not know the room. */
kvf_status_t kvf__bs_query_dp_ranks(const char *addr, const uint64_t *rooms,
                                    size_t n, int *dp_ranks_p,
                                    unsigned timeout_ms, char *err,
                                    size_t errlen);

/* Split "host:port" (IPv4, name, or [IPv6]:port; the brackets are not
 * copied).  The port may be 0..65535: whether 0 ("any port") is acceptable
 * is the caller's decision.  @return KVF_OK or KVF_ERR_INVALID_PARAM
 * (no port, unbracketed IPv6, empty host, port not a number or out of
 * range, host longer than hostlen - 1). */
kvf_status_t kvf__split_addr(const char *addr, char *host, size_t hostlen,
                             int *port_p);

/*
 * The registry's request handling without the network (registry.c): the
 * MHD glue and the fuzzer both feed requests through kvf__registry_handle.
 */

/* Room -> DP rank entries kept for POST /register_dp_rank; beyond this the
 * oldest registration is forgotten. */
#define KVF_BS_MAX_ROOMS (1u << 20)
/* Largest attn_tp_size * attn_cp_size * dp_size * pp_size accepted. */
#define KVF_BS_MAX_RANKS 65536

typedef struct kvf_registry_state kvf_registry_state_t;

/* max_rooms 0 means KVF_BS_MAX_ROOMS.  @return NULL when out of memory. */
kvf_registry_state_t *kvf__registry_state_create(size_t max_rooms);
void kvf__registry_state_destroy(kvf_registry_state_t *st);

/*
 * Who may change the registry (PUT /route, POST /register_dp_rank, POST
 * /room_ready):
 *  - with a token (non-empty): a request whose "Authorization: Bearer"
 *    matches it, from anywhere; any other gets 401;
 *  - without one, `open` 0 (protected mode, the default): loopback clients
 *    only; others get 403;
 *  - without one, `open` 1 (KVF_AUTH=none): anyone.
 * Read-only routes are open in every mode.  Call before the registry
 * serves.  @return KVF_OK or KVF_ERR_INVALID_PARAM (a token util/token.h
 * would refuse). */
kvf_status_t kvf__registry_set_auth(kvf_registry_state_t *st,
                                    const char *token, int open);

/* The registry's clock (milliseconds, monotonic), for tests of the stale
 * rule; NULL restores kvf_now_ms().  Call before the registry serves. */
typedef uint64_t (*kvf_bs_clock_cb_t)(void *arg);
void kvf__registry_set_clock(kvf_registry_state_t *st, kvf_bs_clock_cb_t cb,
                             void *arg);

/* Set or clear (cb NULL) the /metrics stats source.  When it returns, the
 * previous callback is not running and will not be called again, so its
 * arg may be freed.  Must not be called from inside the callback. */
void kvf__registry_set_stats_cb(kvf_registry_state_t *st,
                                kvf_bs_stats_cb_t cb, void *arg);

/* Who sent a request, as the network glue saw it. */
typedef struct kvf_bs_client {
    const char *authorization;  /* the Authorization header, NULL: none */
    int         loopback;       /* connected from 127.0.0.0/8 or ::1 */
    const char *addr;           /* its IP address, for logs; NULL: unknown */
} kvf_bs_client_t;

/*
 * Answer one request.  `client` is who sent it (NULL: a loopback client
 * without credentials).  `method` is the HTTP method, `path` the URL path
 * without the query, `query` the raw (percent-encoded) query string without
 * '?' or NULL, `body` the request body (NULL when body_len is 0).  A
 * body_len above KVF_BS_MAX_BODY answers 413 without reading `body` (the
 * network glue passes NULL then: it never buffers more than the limit).
 * A mutating request that its client may not make (see
 * kvf__registry_set_auth) is answered 401/403 before anything else is
 * looked at.  Thread-safe.
 *
 * @param [out] resp_p   response body, NUL-terminated, caller frees with
 *                       free(); NULL only when out of memory (status 500)
 * @param [out] ctype_p  its Content-Type (static string)
 * @return the HTTP status code.
 */
int kvf__registry_handle(kvf_registry_state_t *st,
                         const kvf_bs_client_t *client, const char *method,
                         const char *path, const char *query,
                         const char *body, size_t body_len, char **resp_p,
                         const char **ctype_p);

/* The Allow header value for a known path ("GET, PUT"), or NULL. */
const char *kvf__registry_allowed(const char *path);

/*
 * kvf_bootstrap_create() with the access rule spelled out instead of read
 * from the environment: `token` (NULL or "": none) and `open` as in
 * kvf__registry_set_auth().  Without a token and with open 0, a host that
 * is not a loopback address is refused (KVF_ERR_INVALID_PARAM).
 */
kvf_status_t kvf__bootstrap_create_auth(const char *host, int port,
                                        const char *token, int open,
                                        kvf_bootstrap_t **bootstrap_p);

/* Is `sa` a loopback address (127.0.0.0/8, ::1, v4-mapped 127/8)? */
int kvf__bs_loopback(const struct sockaddr *sa);

/*
 * A metrics endpoint (scrape.c): GET /metrics on its own libmicrohttpd
 * thread, answered with the text `cb` makes (malloc'd, NUL-terminated,
 * freed by the server; cb returns 0, or -1 for a 500).  `addr` is
 * "host:port" (port 0: any).  Bound like the registry: without a token
 * (has_token 0) and with open 0, a host that is not a loopback address
 * is refused, saying how to set a token.  The port bound goes into
 * `bound` as "host:port".  @return KVF_OK, KVF_ERR_INVALID_PARAM (a
 * malformed address, a refused host), KVF_ERR_IO (cannot resolve or
 * listen), KVF_ERR_NO_MEMORY.
 */
typedef struct kvf_scrape kvf_scrape_t;
typedef int (*kvf_scrape_cb_t)(void *arg, char **text_p);
kvf_status_t kvf__scrape_create(const char *addr, int has_token, int open,
                                kvf_scrape_cb_t cb, void *arg, kvf_scrape_t **scrape_p,
                                char *bound, size_t boundlen);
/* Stop serving; when it returns, cb is not running and will not run. */
void kvf__scrape_destroy(kvf_scrape_t *scrape);

/* The registry state of a running server (tests set its clock). */
kvf_registry_state_t *kvf__bootstrap_state(kvf_bootstrap_t *bs);

#endif /* KVF_BOOTSTRAP_BOOTSTRAP_H */
