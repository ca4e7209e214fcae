/*
 * Engine metrics: what a prefill and a decode engine serve on their
 * metrics endpoints (GET /metrics over HTTP, scraped while rooms run and
 * after) against what their rooms really did: a fault that corrupts one
 * room's byte (checksums on), a refusal by the decode application and an
 * abort by the prefill one, the rest succeeding.  Counts by final state,
 * failures by status and origin, histogram counts and byte sums, bytes by
 * path, peers.  Then the endpoint's binding rule (the registry's:
 * protected mode) and the text call's buffer contract.
 */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "unit/kvf_sides.h"

static void with_metrics(kvf_engine_params_t *p)
{
    p->metrics_addr = "127.0.0.1:0";
    p->checksum = 1;
}

/* ---- HTTP and the text ---------------------------------------------------- */

/* GET path from addr ("host:port"); the status, and the body in `body`
 * (malloc'd, NUL-terminated), or -1. */
static int http_get(const char *addr, const char *path, const char *method, char **body)
{
    int port = atoi(strrchr(addr, ':') + 1);
    int fd = dial(port);
    char req[256], *resp = NULL;
    size_t len = 0, cap = 0;
    *body = NULL;
    if (fd < 0)
        return -1;
    int n = snprintf(req, sizeof(req), "%s %s HTTP/1.0\r\nHost: %s\r\n\r\n", method, path,
                     addr);
    if (send(fd, req, (size_t)n, MSG_NOSIGNAL) != n) {
        close(fd);
        return -1;
    }
    for (;;) {
        if (len + 4096 + 1 > cap) {
            cap = cap ? 2 * cap : 65536;
            char *g = realloc(resp, cap);
            if (g == NULL)
                break;
            resp = g;
        }
        ssize_t k = recv(fd, resp + len, cap - len - 1, 0);
        if (k <= 0)
            break;
        len += (size_t)k;
    }
    close(fd);
    if (resp == NULL)
        return -1;
    resp[len] = '\0';
    int status = -1;
    char *b = strstr(resp, "\r\n\r\n");
    if (sscanf(resp, "HTTP/1.%*d %d", &status) != 1 || b == NULL) {
        free(resp);
        return -1;
    }
    *body = strdup(b + 4);
    if (strstr(resp, "version=0.0.4") == NULL && status == 200)
        status = -2;                /* not Prometheus' content type */
    free(resp);
    return status;
}

static char *scrape(kvf_engine_t *eng)
{
    char addr[64], *body = NULL;
    CHECK_EQ_INT(kvf_engine_metrics_addr(eng, addr, sizeof(addr)), KVF_OK);
    CHECK_EQ_INT(http_get(addr, "/metrics", "GET", &body), 200);
    return body;
}

/* The value of the sample named exactly `series` ("name{labels}"), or -1. */
static double value(const char *text, const char *series)
{
    size_t n = strlen(series);
    for (const char *l = text; l != NULL && *l; l = strchr(l, '\n'), l = l ? l + 1 : NULL)
        if (strncmp(l, series, n) == 0 && l[n] == ' ')
            return strtod(l + n + 1, NULL);
    fprintf(stderr, "  no sample %s\n", series);
    return -1;
}

__attribute__((format(printf, 2, 3)))
static double valuef(const char *text, const char *fmt, ...)
{
    char series[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(series, sizeof(series), fmt, ap);
    va_end(ap);
    return value(text, series);
}

/* Every line a comment or "series value"; every family typed once. */
static int well_formed(const char *text)
{
    int ok = 1, types = 0;
    for (const char *l = text; *l; ) {
        const char *e = strchr(l, '\n');
        if (e == NULL)
            return 0;            /* the text ends with a newline */
        if (strncmp(l, "# TYPE ", 7) == 0)
            types++;
        else if (l[0] != '#') {
            const char *sp = memchr(l, ' ', (size_t)(e - l));
            char *end;
            ok &= sp != NULL && strncmp(l, "kvferry_engine_", 15) == 0;
            if (sp != NULL) {
                strtod(sp + 1, &end);
                ok &= end == e;
            }
        }
        l = e + 1;
    }
    return ok && types >= 14;
}

/* ---- rooms ----------------------------------------------------------------- */

typedef struct tally {
    int      ok[2], failed[2];        /* [prefill, decode] */
    uint64_t bytes[2];                /* the succeeded rooms' metric bytes */
} tally_t;

static void count(tally_t *t, int side, kvf_poll_t st, uint64_t bytes)
{
    if (st == KVF_POLL_SUCCESS) {
        t->ok[side]++;
        t->bytes[side] += bytes;
    } else if (st == KVF_POLL_FAILED) {
        t->failed[side]++;
    }
}

static uint64_t sender_bytes(kvf_sender_t *s)
{
    kvf_room_metric_t m = {.size = sizeof(m)};
    CHECK_EQ_INT(kvf_sender_metric(s, &m), KVF_OK);
    return m.bytes;
}

static uint64_t receiver_bytes(kvf_receiver_t *r)
{
    kvf_room_metric_t m = {.size = sizeof(m)};
    CHECK_EQ_INT(kvf_receiver_metric(r, &m), KVF_OK);
    return m.bytes;
}

/* One room: how it ends is `how`: 0 runs it, 1 the decode application
 * refuses it, 2 the prefill application aborts it. */
static void room(side_t *pre, side_t *dec, const char *bs, uint64_t id, int how, tally_t *t,
                 kvf_status_t want)
{
    kvf_sender_t *s = legit_send_start(pre, bs, id);
    kvf_receiver_t *r = legit_recv_start(dec, bs, id);
    CHECK_EQ_INT(wait_sender(s, KVF_POLL_WAITING_FOR_INPUT), KVF_POLL_WAITING_FOR_INPUT);
    if (how == 1)
        CHECK_EQ_INT(kvf_receiver_fail(r, KVF_ERR_BAD_INDICES, "the test refused the room"),
                     KVF_OK);
    if (how == 2)
        kvf_sender_abort(s);
    if (how == 0) {
        CHECK_EQ_INT(kvf_sender_init(s, 3, 1), KVF_OK);
        CHECK_EQ_INT(kvf_sender_send(s, legit_src, 3, 1), KVF_OK);
    }
    kvf_poll_t ss = wait_sender(s, KVF_POLL_SUCCESS), rs = wait_receiver(r, KVF_POLL_SUCCESS);
    kvf_failure_t f;
    kvf_failure_init(&f);
    if (want != KVF_OK) {
        CHECK_EQ_INT(ss, KVF_POLL_FAILED);
        CHECK_EQ_INT(rs, KVF_POLL_FAILED);
        CHECK_EQ_INT(kvf_receiver_failure(r, &f), KVF_OK);
        CHECK_EQ_INT(f.status, want);
    }
    count(t, 0, ss, sender_bytes(s));
    count(t, 1, rs, receiver_bytes(r));
    kvf_sender_destroy(s);
    kvf_receiver_destroy(r);
}

static void check_side(const char *text, const char *side, int ok, int failed,
                       uint64_t bytes)
{
    CHECK(well_formed(text));
    CHECK_EQ_INT(valuef(text, "kvferry_engine_rooms_total{side=\"%s\",state=\"success\"}",
                        side), ok);
    CHECK_EQ_INT(valuef(text, "kvferry_engine_rooms_total{side=\"%s\",state=\"failed\"}",
                        side), failed);
    CHECK_EQ_INT(valuef(text, "kvferry_engine_room_duration_seconds_count{side=\"%s\","
                        "state=\"success\"}", side), ok);
    CHECK_EQ_INT(valuef(text, "kvferry_engine_room_duration_seconds_count{side=\"%s\","
                        "state=\"failed\"}", side), failed);
    CHECK_EQ_INT(valuef(text, "kvferry_engine_room_duration_seconds_bucket{side=\"%s\","
                        "state=\"success\",le=\"+Inf\"}", side), ok);
    CHECK_EQ_INT(valuef(text, "kvferry_engine_room_transfer_seconds_count{side=\"%s\"}", side),
                 ok);
    CHECK_EQ_INT(valuef(text, "kvferry_engine_room_payload_bytes_count{side=\"%s\"}", side), ok);
    CHECK_EQ_INT(valuef(text, "kvferry_engine_room_payload_bytes_sum{side=\"%s\"}", side),
                 (double)bytes);
    CHECK_EQ_INT(valuef(text, "kvferry_engine_rooms_reversed_total{side=\"%s\"}", side), 0);
    /* Every room was destroyed: none is attached. */
    CHECK_EQ_INT(valuef(text, "kvferry_engine_rooms{side=\"%s\",state=\"success\"}", side), 0);
    CHECK_EQ_INT(valuef(text, "kvferry_engine_peers{kind=\"payload\",path=\"tcp\","
                        "state=\"ready\"}"), 1);
}

#define NROOMS 9

static void test_metrics_match_outcomes(void)
{
    side_t pre, dec;
    char bs[64];
    tally_t t;
    memset(&t, 0, sizeof(t));
    clear_env();
    side_tune = with_metrics;
    CHECK_EQ_INT(setenv("KVF_FAULTS", "corrupt@100", 1), 0);
    side_init(&pre, KVF_ROLE_PREFILL, "127.0.0.1:0", NULL);
    unsetenv("KVF_FAULTS");
    side_init(&dec, KVF_ROLE_DECODE, NULL, NULL);
    side_tune = NULL;
    CHECK_EQ_INT(kvf_engine_bootstrap_addr(pre.eng, bs, sizeof(bs)), KVF_OK);

    room(&pre, &dec, bs, 100, 0, &t, KVF_ERR_CHECKSUM);    /* the fault's room */
    room(&pre, &dec, bs, 101, 1, &t, KVF_ERR_BAD_INDICES);
    room(&pre, &dec, bs, 102, 2, &t, KVF_ERR_ABORTED);
    /* While rooms run: what is there so far, no more. */
    kvf_sender_t *s = legit_send_start(&pre, bs, 103);
    kvf_receiver_t *r = legit_recv_start(&dec, bs, 103);
    char *mid = scrape(dec.eng);
    CHECK(mid != NULL && well_formed(mid));
    CHECK_EQ_INT(valuef(mid, "kvferry_engine_rooms_total{side=\"decode\",state=\"failed\"}"),
                 3);
    CHECK_EQ_INT(valuef(mid, "kvferry_engine_rooms_total{side=\"decode\",state=\"success\"}"),
                 0);
    CHECK_EQ_INT(valuef(mid, "kvferry_engine_rooms{side=\"decode\",state=\"failed\"}") +
                 valuef(mid, "kvferry_engine_rooms{side=\"decode\",state=\"bootstrapping\"}") +
                 valuef(mid, "kvferry_engine_rooms{side=\"decode\",state=\"waiting_for_input\"}") +
                 valuef(mid, "kvferry_engine_rooms{side=\"decode\",state=\"transferring\"}") +
                 valuef(mid, "kvferry_engine_rooms{side=\"decode\",state=\"success\"}"), 1);
    free(mid);
    CHECK_EQ_INT(wait_sender(s, KVF_POLL_WAITING_FOR_INPUT), KVF_POLL_WAITING_FOR_INPUT);
    CHECK_EQ_INT(kvf_sender_init(s, 3, 1), KVF_OK);
    CHECK_EQ_INT(kvf_sender_send(s, legit_src, 3, 1), KVF_OK);
    kvf_poll_t ss = wait_sender(s, KVF_POLL_SUCCESS), rs = wait_receiver(r, KVF_POLL_SUCCESS);
    count(&t, 0, ss, sender_bytes(s));
    count(&t, 1, rs, receiver_bytes(r));
    CHECK(legit_bytes(&dec));
    kvf_sender_destroy(s);
    kvf_receiver_destroy(r);
    for (uint64_t id = 104; id < 100 + NROOMS; id++)
        room(&pre, &dec, bs, id, 0, &t, KVF_OK);

    char *ptext = scrape(pre.eng), *dtext = scrape(dec.eng);
    CHECK(ptext != NULL && dtext != NULL);
    CHECK_EQ_INT(t.ok[0], NROOMS - 3);
    CHECK_EQ_INT(t.ok[1], NROOMS - 3);
    check_side(ptext, "prefill", t.ok[0], t.failed[0], t.bytes[0]);
    check_side(dtext, "decode", t.ok[1], t.failed[1], t.bytes[1]);
    /* Each failure on the rank that saw it, and on the other as learned. */
    static const struct { const char *status; int prefill_local; } f[] = {
        {"KVF_ERR_CHECKSUM", 0}, {"KVF_ERR_BAD_INDICES", 0}, {"KVF_ERR_ABORTED", 1}};
    for (int i = 0; i < 3; i++) {
        const char *o[2] = {"local", "another_rank"};
        int pl = f[i].prefill_local;
        CHECK_EQ_INT(valuef(ptext, "kvferry_engine_room_failures_total{side=\"prefill\","
                            "status=\"%s\",origin=\"%s\"}", f[i].status, o[!pl]), 1);
        CHECK_EQ_INT(valuef(ptext, "kvferry_engine_room_failures_total{side=\"prefill\","
                            "status=\"%s\",origin=\"%s\"}", f[i].status, o[pl]), 0);
        CHECK_EQ_INT(valuef(dtext, "kvferry_engine_room_failures_total{side=\"decode\","
                            "status=\"%s\",origin=\"%s\"}", f[i].status, o[pl]), 1);
        CHECK_EQ_INT(valuef(dtext, "kvferry_engine_room_failures_total{side=\"decode\","
                            "status=\"%s\",origin=\"%s\"}", f[i].status, o[!pl]), 0);
    }
    /* Bytes by path: every byte over tcp, as the engine's own totals say. */
    kvf_engine_stats_t ps, ds;
    kvf_engine_stats_init(&ps);
    kvf_engine_stats_init(&ds);
    kvf_engine_stats(pre.eng, &ps);
    kvf_engine_stats(dec.eng, &ds);
    CHECK_EQ_INT(valuef(ptext, "kvferry_engine_payload_bytes_total{side=\"prefill\","
                        "direction=\"sent\",path=\"tcp\"}"), (double)ps.bytes_sent);
    CHECK_EQ_INT(valuef(dtext, "kvferry_engine_payload_bytes_total{side=\"decode\","
                        "direction=\"received\",path=\"tcp\"}"), (double)ds.bytes_received);
    CHECK_EQ_INT(valuef(dtext, "kvferry_engine_payload_bytes_total{side=\"decode\","
                        "direction=\"received\",path=\"staged\"}"), 0);
    CHECK(ds.bytes_received >= t.bytes[1]);
    CHECK_EQ_INT(valuef(dtext, "kvferry_engine_heartbeat_losses_total"), 0);
    CHECK_EQ_INT(valuef(ptext, "kvferry_engine_auth_refused_total"), 0);
    CHECK_EQ_INT(ps.auth_refused, 0);
    CHECK_EQ_INT(valuef(ptext, "kvferry_engine_stash_dropped_total"), 0);
    CHECK_EQ_INT(ps.stash_dropped, 0);
    CHECK_EQ_INT(valuef(dtext, "kvferry_engine_reads_in_flight"), 0);
    free(ptext);
    free(dtext);
    side_fini(&dec);
    side_fini(&pre);
}

/* ---- binding ---------------------------------------------------------------- */

static const char *metrics_at;
static void metrics_only(kvf_engine_params_t *p)
{
    p->metrics_addr = metrics_at;
}

static kvf_status_t try_metrics(const char *addr, const char *token, side_t *s)
{
    metrics_at = addr;
    side_tune = metrics_only;
    kvf_status_t st = side_try(s, KVF_ROLE_DECODE, NULL, token, NULL);
    side_tune = NULL;
    return st;
}

/*
 * The registry's rule: without a cluster token, and unless KVF_AUTH=none,
 * the endpoint listens on loopback only; with a token, anywhere.  Scrapes
 * need no token.
 */
static void test_metrics_protected_mode(void)
{
    side_t s;
    char addr[64], *body = NULL;
    clear_env();
    CHECK_EQ_INT(try_metrics("0.0.0.0:0", NULL, &s), KVF_ERR_INVALID_PARAM);
    CHECK_STR_CONTAINS(kvf_last_error(), "refusing to listen on 0.0.0.0:0 without a cluster "
                       "token");
    CHECK_STR_CONTAINS(kvf_last_error(), "KVF_AUTH_TOKEN");
    /* The registry says no to the same host. */
    kvf_bootstrap_t *bs = NULL;
    CHECK_EQ_INT(kvf_bootstrap_create("0.0.0.0", 0, &bs), KVF_ERR_INVALID_PARAM);
    CHECK_EQ_INT(try_metrics("no-port", NULL, &s), KVF_ERR_INVALID_PARAM);

    CHECK_EQ_INT(try_metrics("0.0.0.0:0", "alpha", &s), KVF_OK);
    CHECK_EQ_INT(kvf_engine_metrics_addr(s.eng, addr, sizeof(addr)), KVF_OK);
    CHECK(strncmp(addr, "0.0.0.0:", 8) == 0 && atoi(addr + 8) > 0);
    CHECK_EQ_INT(http_get(addr, "/metrics", "GET", &body), 200);
    CHECK(body != NULL && strstr(body, "kvferry_engine_info{side=\"decode\"") != NULL);
    free(body);
    CHECK_EQ_INT(http_get(addr, "/other", "GET", &body), 404);
    free(body);
    CHECK_EQ_INT(http_get(addr, "/metrics", "POST", &body), 405);
    free(body);
    kvf_engine_destroy(s.eng);

    CHECK_EQ_INT(setenv("KVF_AUTH", "none", 1), 0);
    CHECK_EQ_INT(try_metrics("0.0.0.0:0", NULL, &s), KVF_OK);
    kvf_engine_destroy(s.eng);
    unsetenv("KVF_AUTH");

    /* "port+": the base plus the rank's index in its server (TP rank 1 here). */
    CHECK_EQ_INT(try_metrics("127.0.0.1:0+", NULL, &s), KVF_OK);   /* 0 stays "any" */
    kvf_engine_destroy(s.eng);
    {
        kvf_engine_params_t p;
        kvf_engine_t *e = NULL;
        kvf_engine_params_init(&p);
        p.tp_rank = 1;
        p.tp_size = 2;
        p.metrics_addr = "127.0.0.1:65535+";
        CHECK_EQ_INT(kvf_engine_create(&p, &e), KVF_ERR_INVALID_PARAM);
        CHECK_STR_CONTAINS(kvf_last_error(), "past 65535");
        /* A free base found by binding 0 first, then the rank above it. */
        p.metrics_addr = "127.0.0.1:0";
        CHECK_EQ_INT(kvf_engine_create(&p, &e), KVF_OK);
        CHECK_EQ_INT(kvf_engine_metrics_addr(e, addr, sizeof(addr)), KVF_OK);
        kvf_engine_destroy(e);
        char spec[64];
        int base = atoi(strrchr(addr, ':') + 1) - 1;
        snprintf(spec, sizeof(spec), "127.0.0.1:%d+", base);
        p.metrics_addr = spec;
        CHECK_EQ_INT(kvf_engine_create(&p, &e), KVF_OK);
        CHECK_EQ_INT(kvf_engine_metrics_addr(e, addr, sizeof(addr)), KVF_OK);
        CHECK_EQ_INT(atoi(strrchr(addr, ':') + 1), base + 1);
        kvf_engine_destroy(e);
    }

    /* From the environment; without one, no endpoint. */
    CHECK_EQ_INT(setenv("KVF_METRICS_ADDR", "127.0.0.1:0", 1), 0);
    CHECK_EQ_INT(try_metrics(NULL, NULL, &s), KVF_OK);
    CHECK_EQ_INT(kvf_engine_metrics_addr(s.eng, addr, sizeof(addr)), KVF_OK);
    kvf_engine_destroy(s.eng);
    unsetenv("KVF_METRICS_ADDR");
    CHECK_EQ_INT(try_metrics(NULL, NULL, &s), KVF_OK);
    CHECK_EQ_INT(kvf_engine_metrics_addr(s.eng, addr, sizeof(addr)), KVF_ERR_STATE);
    kvf_engine_destroy(s.eng);
}

/* The text call: the size first, then the text; a short buffer is untouched. */
static void test_metrics_text_call(void)
{
    side_t s;
    size_t need = 0, again = 0;
    clear_env();
    CHECK_EQ_INT(side_try(&s, KVF_ROLE_PREFILL, NULL, NULL, NULL), KVF_OK);
    CHECK_EQ_INT(kvf_engine_metrics(s.eng, NULL, 0, &need), KVF_ERR_AGAIN);
    CHECK(need > 1000);
    char *b = malloc(need);
    memset(b, 'x', need);
    CHECK_EQ_INT(kvf_engine_metrics(s.eng, b, need - 1, &again), KVF_ERR_AGAIN);
    CHECK_EQ_INT(again, need);
    CHECK(b[0] == 'x');
    CHECK_EQ_INT(kvf_engine_metrics(s.eng, b, need, NULL), KVF_OK);
    CHECK_EQ_INT(strlen(b) + 1, need);
    CHECK(well_formed(b));
    CHECK(strstr(b, "kvferry_engine_stash_dropped_total 0\n") != NULL);
    CHECK_EQ_INT(kvf_engine_metrics(NULL, b, need, NULL), KVF_ERR_INVALID_PARAM);
    free(b);
    kvf_engine_destroy(s.eng);
}

/* The engine's metrics text, through the call (malloc'd). */
static char *metrics_text(kvf_engine_t *eng)
{
    size_t need = 0;
    CHECK_EQ_INT(kvf_engine_metrics(eng, NULL, 0, &need), KVF_ERR_AGAIN);
    char *b = malloc(need + 4096);         /* room for growth between the calls */
    CHECK_EQ_INT(kvf_engine_metrics(eng, b, need + 4096, NULL), KVF_OK);
    return b;
}

/*
 * Peers by path: each engine of a pair over `transport` counts its one
 * peer in the slot that kvf_transport_name() gives that name, and in no
 * other; the metrics text counts it, and the room's payload bytes,
 * under the same name.
 */
static void peers_by_path(const char *transport)
{
    side_t pre, dec;
    char bs[64];

    clear_env();
    side_transport = transport;
    side_pair(&pre, &dec, bs, sizeof(bs), NULL);
    side_transport = "tcp";
    CHECK(legit_room(&pre, &dec, bs, 1));
    for (int k = 0; k < 2; k++) {
        kvf_engine_t *eng = k ? dec.eng : pre.eng;
        kvf_engine_stats_t st = engine_stats(eng);
        CHECK_EQ_INT(st.peers_connected, 1);
        for (unsigned i = 0; i < KVF_PATHS_MAX; i++) {
            const char *name = kvf_transport_name(i);
            CHECK_EQ_INT(st.peers_by_path[i], name != NULL && strcmp(name, transport) == 0);
        }
        char *text = metrics_text(eng);
        CHECK_EQ_INT(valuef(text, "kvferry_engine_peers{kind=\"payload\",path=\"%s\","
                            "state=\"ready\"}", transport), 1);
        /* The room's bytes count under the same name. */
        CHECK(valuef(text, "kvferry_engine_payload_bytes_total{side=\"%s\",direction=\"%s\","
                     "path=\"%s\"}", k ? "decode" : "prefill", k ? "received" : "sent",
                     transport) > 0);
        free(text);
    }
    side_fini(&dec);
    side_fini(&pre);
}

static void test_peers_by_path_tcp(void) { peers_by_path("tcp"); }
static void test_peers_by_path_shm(void) { peers_by_path("shm"); }

KVF_TEST_MAIN(KVF_CASE(test_metrics_match_outcomes),
              KVF_CASE(test_metrics_protected_mode),
              KVF_CASE(test_metrics_text_call),
              KVF_CASE(test_peers_by_path_tcp), KVF_CASE(test_peers_by_path_shm))
