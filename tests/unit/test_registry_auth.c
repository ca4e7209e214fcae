/*
 * The bootstrap registry trusts no one it should not: the cluster token
 * (util/token.c), the registry's access rule (401 without the token, 403
 * from a remote client in protected mode, refusal to listen beyond
 * loopback without a token), the configuration-replacement rule, and its
 * bounded resources (1,100 idle connections and a flood of refused
 * requests while /health must answer within a second; oversized queries).
 *
 * Real servers on 127.0.0.1 port 0, driven through libcurl; strangers are
 * raw requests, the real rank is the client (kvf__bs_*) with the token.
 * The environment variables of util/token.c are set and unset here while
 * no server thread runs.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <curl/curl.h>
#include <jansson.h>

#include "bootstrap/bootstrap.h"
#include "util/time.h"
#include "util/token.h"

#include "kvf_http_capture.h"
#include "kvf_test.h"

#define TMO   3000u
#define TOKEN "kvf-test-cluster-token-6f1d2c9a"

static const char *const TOKEN_VARS[] = {
    "KVF_AUTH_TOKEN", "KVF_AUTH_TOKEN_FILE",
    "SGLANG_DISAGGREGATION_BOOTSTRAP_AUTH_TOKEN", "KVF_AUTH"};

static void clear_env(void)
{
    for (size_t i = 0; i < sizeof(TOKEN_VARS) / sizeof(TOKEN_VARS[0]); i++)
        unsetenv(TOKEN_VARS[i]);
}

typedef struct srv {
    kvf_bootstrap_t *bs;
    char addr[64];
} srv_t;

static int srv_start(srv_t *s, const char *token)
{
    if (kvf__bootstrap_create_auth("127.0.0.1", 0, token, 0, &s->bs) != KVF_OK)
        return -1;
    snprintf(s->addr, sizeof(s->addr), "127.0.0.1:%d",
             kvf_bootstrap_port(s->bs));
    return 0;
}

static kvf_bs_reg_t mkreg(int tp_size, int tp_rank, int port, int page)
{
    kvf_bs_reg_t r = {
        .attn_tp_size = tp_size, .attn_tp_rank = tp_rank,
        .attn_cp_size = 1, .attn_cp_rank = 0,
        .attn_dp_size = 1, .attn_dp_rank = 0,
        .pp_size = 1, .pp_rank = 0,
        .system_dp_size = 1, .system_dp_rank = 0,
        .rank_ip = "127.0.0.1", .rank_port = port,
        .page_size = page, .kv_cache_dtype = "bfloat16",
    };
    return r;
}

/* A registration body of a stranger: rank tp0 of tp_size at 6.6.6.6. */
static void stranger_body(char *buf, size_t len, int tp_size, int page)
{
    snprintf(buf, len, "{\"attn_tp_size\":%d,\"attn_tp_rank\":0,"
             "\"attn_cp_size\":1,\"attn_cp_rank\":0,\"attn_dp_size\":1,"
             "\"attn_dp_rank\":0,\"pp_size\":1,\"pp_rank\":0,"
             "\"system_dp_size\":1,\"system_dp_rank\":0,\"rank_ip\":"
             "\"6.6.6.6\",\"rank_port\":6666,\"page_size\":%d,"
             "\"kv_cache_dtype\":\"bfloat16\"}", tp_size, page);
}

/* ------------------------------------------------------------------------ */
/* Raw HTTP                                                                 */
/* ------------------------------------------------------------------------ */

typedef struct raw_resp {
    long   status;
    char  *body;
    size_t len;
    char   www_auth[128];
    double seconds;
} raw_resp_t;

static size_t raw_data(char *p, size_t size, size_t n, void *arg)
{
    raw_resp_t *r = arg;
    char *nb = realloc(r->body, r->len + size * n + 1);
    if (nb == NULL)
        return 0;
    r->body = nb;
    memcpy(r->body + r->len, p, size * n);
    r->len += size * n;
    r->body[r->len] = '\0';
    return size * n;
}

static size_t raw_header(char *p, size_t size, size_t n, void *arg)
{
    raw_resp_t *r = arg;
    if (size * n > 18 && strncasecmp(p, "WWW-Authenticate: ", 18) == 0)
        snprintf(r->www_auth, sizeof(r->www_auth), "%.*s",
                 (int)(size * n - 20), p + 18);
    return size * n;
}

/* `auth`: an Authorization header value or NULL; `from`: a source address
 * to connect from, or NULL. */
static raw_resp_t raw(const char *addr, const char *method,
                      const char *target, const char *body, const char *auth,
                      const char *from)
{
    raw_resp_t r = {0};
    char url[4096], hdr[256], iface[80];
    struct curl_slist *h = NULL;
    CURL *c = curl_easy_init();

    snprintf(url, sizeof(url), "http://%s%s", addr, target);
    curl_easy_setopt(c, CURLOPT_URL, url);
    curl_easy_setopt(c, CURLOPT_NOPROXY, "*");
    curl_easy_setopt(c, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(c, CURLOPT_TIMEOUT_MS, 5000L);
    curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, raw_data);
    curl_easy_setopt(c, CURLOPT_WRITEDATA, &r);
    curl_easy_setopt(c, CURLOPT_HEADERFUNCTION, raw_header);
    curl_easy_setopt(c, CURLOPT_HEADERDATA, &r);
    if (from != NULL) {
        snprintf(iface, sizeof(iface), "host!%s", from);
        curl_easy_setopt(c, CURLOPT_INTERFACE, iface);
    }
    if (auth != NULL) {
        snprintf(hdr, sizeof(hdr), "Authorization: %s", auth);
        h = curl_slist_append(h, hdr);
    }
    h = curl_slist_append(h, "Expect:");
    curl_easy_setopt(c, CURLOPT_HTTPHEADER, h);
    if (body != NULL)
        curl_easy_setopt(c, CURLOPT_POSTFIELDS, body);
    curl_easy_setopt(c, CURLOPT_CUSTOMREQUEST, method);
    uint64_t t0 = kvf_now_ns();
    CURLcode rc = curl_easy_perform(c);
    r.seconds = (double)(kvf_now_ns() - t0) / 1e9;
    if (rc == CURLE_OK)
        curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &r.status);
    else
        fprintf(stderr, "  raw %s %s: %s\n", method, target,
                curl_easy_strerror(rc));
    curl_slist_free_all(h);
    curl_easy_cleanup(c);
    return r;
}

#define RAW_CHECK(addr_, meth_, tgt_, body_, auth_, want_status, want_text)    \
    do {                                                                       \
        raw_resp_t r_ = raw((addr_), (meth_), (tgt_), (body_), (auth_), NULL); \
        CHECK_EQ_INT(r_.status, (want_status));                                \
        CHECK_STR_CONTAINS(r_.body ? r_.body : "", (want_text));               \
        free(r_.body);                                                         \
    } while (0)

#define INFO_Q "/route?prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1" \
               "&target_pp_rank=-1"

/* ------------------------------------------------------------------------ */
/* The token                                                                */
/* ------------------------------------------------------------------------ */

static int write_file(const char *path, const char *text, mode_t mode)
{
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0600);
    if (fd < 0)
        return -1;
    ssize_t n = write(fd, text, strlen(text));
    close(fd);
    return n == (ssize_t)strlen(text) && chmod(path, mode) == 0 ? 0 : -1;
}

static void test_token_load(void)
{
    char tok[KVF_TOKEN_MAX + 1], err[512], path[] = "/tmp/kvf-token-XXXXXX";
    const char *from = NULL;

    clear_env();
    CHECK_EQ_INT(kvf_token_load_ex(NULL, tok, sizeof(tok), &from, err,
                                   sizeof(err)), KVF_OK);
    CHECK(tok[0] == '\0' && from[0] == '\0');

    /* The order: explicit, KVF_AUTH_TOKEN, the file, SGLang's variable. */
    setenv("SGLANG_DISAGGREGATION_BOOTSTRAP_AUTH_TOKEN", "sglang-token-0123456789",
           1);
    CHECK_EQ_INT(kvf_token_load_ex(NULL, tok, sizeof(tok), &from, err,
                                   sizeof(err)), KVF_OK);
    CHECK(strcmp(tok, "sglang-token-0123456789") == 0);
    CHECK(strcmp(from, "SGLANG_DISAGGREGATION_BOOTSTRAP_AUTH_TOKEN") == 0);

    int fd = mkstemp(path);
    CHECK(fd >= 0);
    close(fd);
    CHECK(write_file(path, "file-token-0123456789\r\n", 0600) == 0);
    setenv("KVF_AUTH_TOKEN_FILE", path, 1);
    CHECK_EQ_INT(kvf_token_load_ex(NULL, tok, sizeof(tok), &from, err,
                                   sizeof(err)), KVF_OK);
    CHECK(strcmp(tok, "file-token-0123456789") == 0);
    CHECK_STR_CONTAINS(from, "KVF_AUTH_TOKEN_FILE");
    /* Group-readable: used (with a warning); world-readable: refused. */
    CHECK(chmod(path, 0640) == 0);
    CHECK_EQ_INT(kvf_token_load(NULL, tok, sizeof(tok), err, sizeof(err)),
                 KVF_OK);
    CHECK(strcmp(tok, "file-token-0123456789") == 0);
    CHECK(chmod(path, 0644) == 0);
    CHECK_EQ_INT(kvf_token_load(NULL, tok, sizeof(tok), err, sizeof(err)),
                 KVF_ERR_INVALID_PARAM);
    CHECK(tok[0] == '\0');
    CHECK_STR_CONTAINS(err, "chmod 600");
    CHECK(chmod(path, 0620) == 0);
    CHECK_EQ_INT(kvf_token_load(NULL, tok, sizeof(tok), err, sizeof(err)),
                 KVF_ERR_INVALID_PARAM);
    CHECK(write_file(path, "\n", 0600) == 0);
    CHECK_EQ_INT(kvf_token_load(NULL, tok, sizeof(tok), err, sizeof(err)),
                 KVF_ERR_INVALID_PARAM);
    CHECK_STR_CONTAINS(err, "is empty");
    setenv("KVF_AUTH_TOKEN_FILE", "/nonexistent/kvf-token", 1);
    CHECK_EQ_INT(kvf_token_load(NULL, tok, sizeof(tok), err, sizeof(err)),
                 KVF_ERR_IO);
    CHECK_STR_CONTAINS(err, "/nonexistent/kvf-token cannot be opened");
    unlink(path);

    setenv("KVF_AUTH_TOKEN", "env-token-0123456789", 1);
    CHECK_EQ_INT(kvf_token_load_ex(NULL, tok, sizeof(tok), &from, err,
                                   sizeof(err)), KVF_OK);
    CHECK(strcmp(tok, "env-token-0123456789") == 0);
    CHECK(strcmp(from, "KVF_AUTH_TOKEN") == 0);
    CHECK_EQ_INT(kvf_token_load_ex("explicit-token-0123456789", tok,
                                   sizeof(tok), &from, err, sizeof(err)),
                 KVF_OK);
    CHECK(strcmp(tok, "explicit-token-0123456789") == 0);
    CHECK(strcmp(from, "the explicit value") == 0);

    /* What a token may hold. */
    CHECK_EQ_INT(kvf_token_load("has space-0123456789", tok, sizeof(tok), err,
                                sizeof(err)), KVF_ERR_INVALID_PARAM);
    CHECK_STR_CONTAINS(err, "the explicit value");
    CHECK_EQ_INT(kvf_token_load("tab\there-0123456789", tok, sizeof(tok), err,
                                sizeof(err)), KVF_ERR_INVALID_PARAM);
    char big[KVF_TOKEN_MAX + 2];
    memset(big, 'a', sizeof(big) - 1);
    big[sizeof(big) - 1] = '\0';
    CHECK_EQ_INT(kvf_token_load(big, tok, sizeof(tok), err, sizeof(err)),
                 KVF_ERR_INVALID_PARAM);
    big[KVF_TOKEN_MAX] = '\0';
    CHECK_EQ_INT(kvf_token_load(big, tok, sizeof(tok), err, sizeof(err)),
                 KVF_OK);
    CHECK_EQ_INT(kvf_token_load(big, tok, 8, err, sizeof(err)),
                 KVF_ERR_INVALID_PARAM);

    CHECK(kvf_token_equal("abc", "abc"));
    CHECK(!kvf_token_equal("abc", "abd"));
    CHECK(!kvf_token_equal("abc", "abcd"));
    CHECK(!kvf_token_equal("", ""));
    CHECK(!kvf_token_equal(NULL, "abc"));
    CHECK(!kvf_token_equal("abc", NULL));

    setenv("KVF_AUTH", "none", 1);
    CHECK(kvf_auth_open());
    setenv("KVF_AUTH", "off", 1);
    CHECK(!kvf_auth_open());
    clear_env();
}

/* ------------------------------------------------------------------------ */
/* Access                                                                   */
/* ------------------------------------------------------------------------ */

/* A stranger tries to hijack a registered rank, to register first with a
 * wrong page size, and to set rooms' DP ranks: all 401, nothing changes. */
static void test_stranger_is_refused(void)
{
    srv_t s;
    char err[512] = "", ip[64], body[512];
    int port = 0;

    clear_env();
    if (srv_start(&s, TOKEN) != 0) {
        CHECK(!"server start");
        return;
    }
    CHECK(strcmp(kvf_bootstrap_access(s.bs), "token") == 0);

    /* First, before any real rank: a wrong page size must not stick. */
    stranger_body(body, sizeof(body), 1, 1);
    raw_resp_t r = raw(s.addr, "PUT", "/route", body, NULL, NULL);
    CHECK_EQ_INT(r.status, 401);
    CHECK_STR_CONTAINS(r.body, "Unauthorized");
    CHECK_STR_CONTAINS(r.body, "Authorization: Bearer <token>");
    CHECK_STR_CONTAINS(r.www_auth, "Bearer");
    free(r.body);
    RAW_CHECK(s.addr, "PUT", "/route", body, "Bearer not-the-token", 401,
              "does not match");
    RAW_CHECK(s.addr, "PUT", "/route", body, "Basic " TOKEN, 401,
              "Unauthorized");
    RAW_CHECK(s.addr, "PUT", "/route", body, "Bearer " TOKEN "x", 401,
              "Unauthorized");
    RAW_CHECK(s.addr, "PUT", "/route", body, "Bearer", 401, "Unauthorized");
    /* An invalid body from a stranger is refused before it is parsed. */
    RAW_CHECK(s.addr, "PUT", "/route", "{", NULL, 401, "Unauthorized");
    RAW_CHECK(s.addr, "GET", INFO_Q, NULL, NULL, 503,
              "no prefill rank has registered");

    /* The real rank, through the client with the token. */
    kvf_bs_reg_t r0 = mkreg(1, 0, 17000, 64);
    CHECK_EQ_INT(kvf__bs_register_auth(s.addr, &r0, TOKEN, TMO, err,
                                       sizeof(err)), KVF_OK);
    RAW_CHECK(s.addr, "GET", INFO_Q, NULL, NULL, 200, "\"page_size\":64");

    /* Now the hijack of the registered rank, and the DP-rank route. */
    stranger_body(body, sizeof(body), 1, 64);
    RAW_CHECK(s.addr, "PUT", "/route", body, NULL, 401, "Unauthorized");
    RAW_CHECK(s.addr, "PUT", "/route", body, "Bearer wrong-token-0123456", 401,
              "does not match");
    RAW_CHECK(s.addr, "POST", "/register_dp_rank",
              "{\"bootstrap_room\": 7, \"dp_rank\": 0}", NULL, 401,
              "Unauthorized");
    RAW_CHECK(s.addr, "POST", "/register_dp_rank",
              "{\"bootstrap_room\": 7, \"dp_rank\": 0}", "Bearer nope", 401,
              "Unauthorized");
    CHECK_EQ_INT(kvf__bs_get_rank(s.addr, 0, 0, 0, 0, TMO, ip, sizeof(ip),
                                  &port, err, sizeof(err)), KVF_OK);
    CHECK(strcmp(ip, "127.0.0.1") == 0);
    CHECK_EQ_INT(port, 17000);
    RAW_CHECK(s.addr, "POST", "/query_dp_ranks", "{\"bootstrap_rooms\":[7]}",
              NULL, 200, "{}");

    /* A client without the token learns why at once (no retries). */
    uint64_t t0 = kvf_now_ms();
    kvf_bs_reg_t r1 = mkreg(1, 0, 17001, 64);
    CHECK_EQ_INT(kvf__bs_register(s.addr, &r1, 5000, err, sizeof(err)),
                 KVF_ERR_BOOTSTRAP);
    CHECK(kvf_now_ms() - t0 < 1000);
    CHECK_STR_CONTAINS(err, "answered 401");
    CHECK_STR_CONTAINS(err, "this process has no cluster token");
    CHECK_EQ_INT(kvf__bs_register_auth(s.addr, &r1, "wrong-token-0123456789",
                                       TMO, err, sizeof(err)),
                 KVF_ERR_BOOTSTRAP);
    CHECK_STR_CONTAINS(err, "sent the token from the explicit value");
    CHECK_EQ_INT(kvf__bs_register_dp_rank(s.addr, 9, 1, TMO, err,
                                          sizeof(err)), KVF_ERR_BOOTSTRAP);
    CHECK_STR_CONTAINS(err, "answered 401");

    /* The token in the environment is what the client sends by default;
     * the scheme is case-insensitive, as SGLang's check. */
    setenv("KVF_AUTH_TOKEN", TOKEN, 1);
    CHECK_EQ_INT(kvf__bs_register_dp_rank(s.addr, 9, 1, TMO, err,
                                          sizeof(err)), KVF_OK);
    int dp = -1;
    uint64_t room = 9;
    CHECK_EQ_INT(kvf__bs_query_dp_ranks(s.addr, &room, 1, &dp, TMO, err,
                                        sizeof(err)), KVF_OK);
    CHECK_EQ_INT(dp, 1);
    /* The real rank restarts on another port: it replaces its entry. */
    CHECK_EQ_INT(kvf__bs_register(s.addr, &r1, TMO, err, sizeof(err)),
                 KVF_OK);
    clear_env();
    CHECK_EQ_INT(kvf__bs_get_rank(s.addr, 0, 0, 0, 0, TMO, ip, sizeof(ip),
                                  &port, err, sizeof(err)), KVF_OK);
    CHECK_EQ_INT(port, 17001);
    RAW_CHECK(s.addr, "POST", "/register_dp_rank",
              "{\"bootstrap_room\": 10, \"dp_rank\": 0}", "bearer " TOKEN, 200,
              "OK");

    /* Every refusal is counted; the GETs were never refused. */
    raw_resp_t m = raw(s.addr, "GET", "/metrics", NULL, NULL, NULL);
    CHECK_EQ_INT(m.status, 200);
    CHECK_STR_CONTAINS(m.body, "kvferry_registry_auth{mode=\"token\"} 1\n");
    CHECK_STR_CONTAINS(m.body, "kvferry_registry_refused_total{reason="
                       "\"missing_token\"} 6\n");
    CHECK_STR_CONTAINS(m.body, "kvferry_registry_refused_total{reason="
                       "\"wrong_token\"} 7\n");
    CHECK_STR_CONTAINS(m.body, "kvferry_registry_refused_total{reason="
                       "\"not_loopback\"} 0\n");
    CHECK_STR_CONTAINS(m.body, "kvferry_registry_requests_total{route="
                       "\"/route\",method=\"PUT\",code=\"401\"} 10\n");
    free(m.body);
    kvf_bootstrap_destroy(s.bs);
}

/* The first non-loopback IPv4 address of this host, or -1. */
static int local_address(char *buf, size_t len)
{
    struct ifaddrs *ifa = NULL;
    int rc = -1;
    if (getifaddrs(&ifa) != 0)
        return -1;
    for (struct ifaddrs *i = ifa; i != NULL && rc != 0; i = i->ifa_next) {
        if (i->ifa_addr == NULL || i->ifa_addr->sa_family != AF_INET)
            continue;
        const struct sockaddr_in *a = (const struct sockaddr_in *)i->ifa_addr;
        if ((ntohl(a->sin_addr.s_addr) >> 24) == 127)
            continue;
        if (inet_ntop(AF_INET, &a->sin_addr, buf, (socklen_t)len) != NULL)
            rc = 0;
    }
    freeifaddrs(ifa);
    return rc;
}

static void test_protected_mode(void)
{
    kvf_bootstrap_t *bs = NULL;
    char body[512], from[64], err[512];

    clear_env();
    /* No token: loopback only, and the reason says how to set one. */
    CHECK_EQ_INT(kvf__bootstrap_create_auth("0.0.0.0", 0, NULL, 0, &bs),
                 KVF_ERR_INVALID_PARAM);
    CHECK_STR_CONTAINS(kvf_last_error(), "KVF_AUTH_TOKEN");
    CHECK_STR_CONTAINS(kvf_last_error(), "0.0.0.0 is not a loopback address");
    CHECK_EQ_INT(kvf_bootstrap_create("0.0.0.0", 0, &bs),
                 KVF_ERR_INVALID_PARAM);
    CHECK_EQ_INT(kvf_bootstrap_create("::", 0, &bs), KVF_ERR_INVALID_PARAM);
    /* KVF_AUTH=none: open, anywhere. */
    setenv("KVF_AUTH", "none", 1);
    CHECK_EQ_INT(kvf_bootstrap_create("0.0.0.0", 0, &bs), KVF_OK);
    CHECK(strcmp(kvf_bootstrap_access(bs), "open") == 0);
    kvf_bootstrap_destroy(bs);
    /* A token: anywhere, token required (it wins over KVF_AUTH=none). */
    setenv("KVF_AUTH_TOKEN", TOKEN, 1);
    CHECK_EQ_INT(kvf_bootstrap_create("0.0.0.0", 0, &bs), KVF_OK);
    CHECK(strcmp(kvf_bootstrap_access(bs), "token") == 0);
    kvf_bootstrap_destroy(bs);
    /* A token source that is broken is an error, not "no token". */
    clear_env();
    setenv("KVF_AUTH_TOKEN_FILE", "/nonexistent/kvf-token", 1);
    CHECK_EQ_INT(kvf_bootstrap_create("127.0.0.1", 0, &bs),
                 KVF_ERR_INVALID_PARAM);
    CHECK_STR_CONTAINS(kvf_last_error(), "cannot be opened");
    clear_env();

    /* Protected mode on loopback: a loopback client registers, one from
     * another address of this host (connected to 127.0.0.1) gets 403. */
    CHECK_EQ_INT(kvf_bootstrap_create("127.0.0.1", 0, &bs), KVF_OK);
    CHECK(strcmp(kvf_bootstrap_access(bs), "protected") == 0);
    char addr[64];
    snprintf(addr, sizeof(addr), "127.0.0.1:%d", kvf_bootstrap_port(bs));
    stranger_body(body, sizeof(body), 1, 64);
    if (local_address(from, sizeof(from)) == 0) {
        raw_resp_t r = raw(addr, "PUT", "/route", body, NULL, from);
        CHECK_EQ_INT(r.status, 403);
        CHECK_STR_CONTAINS(r.body, "protected mode");
        CHECK_STR_CONTAINS(r.body, "KVF_AUTH_TOKEN");
        free(r.body);
        r = raw(addr, "POST", "/register_dp_rank",
                "{\"bootstrap_room\": 1, \"dp_rank\": 0}", "Bearer x", from);
        CHECK_EQ_INT(r.status, 403);
        free(r.body);
        r = raw(addr, "GET", "/health", NULL, NULL, from);
        CHECK_EQ_INT(r.status, 200);
        free(r.body);
        RAW_CHECK(addr, "GET", INFO_Q, NULL, NULL, 503, "no prefill rank");
    } else {
        fprintf(stderr, "  note: no non-loopback address here; the 403 is "
                "checked without the network only\n");
    }
    kvf_bs_reg_t r0 = mkreg(1, 0, 17000, 64);
    CHECK_EQ_INT(kvf__bs_register(addr, &r0, TMO, err, sizeof(err)), KVF_OK);
    RAW_CHECK(addr, "GET", "/metrics", NULL, NULL, 200,
              "kvferry_registry_auth{mode=\"protected\"} 1\n");
    kvf_bootstrap_destroy(bs);

    /* The same rule without the network. */
    kvf_registry_state_t *st = kvf__registry_state_create(0);
    kvf_bs_client_t remote = {.loopback = 0, .addr = "192.0.2.9"};
    kvf_bs_client_t local = {.loopback = 1, .addr = "127.0.0.1"};
    char *resp;
    const char *ctype;
    CHECK_EQ_INT(kvf__registry_handle(st, &remote, "PUT", "/route", NULL, body,
                                      strlen(body), &resp, &ctype), 403);
    free(resp);
    CHECK_EQ_INT(kvf__registry_handle(st, &remote, "GET", "/route",
                                      "prefill_dp_rank=-1&prefill_cp_rank=-1&"
                                      "target_tp_rank=-1&target_pp_rank=-1",
                                      NULL, 0, &resp, &ctype), 503);
    free(resp);
    CHECK_EQ_INT(kvf__registry_handle(st, &local, "PUT", "/route", NULL, body,
                                      strlen(body), &resp, &ctype), 200);
    free(resp);
    CHECK_EQ_INT(kvf__registry_set_auth(st, NULL, 1), KVF_OK);
    CHECK_EQ_INT(kvf__registry_handle(st, &remote, "PUT", "/route", NULL, body,
                                      strlen(body), &resp, &ctype), 200);
    free(resp);
    kvf__registry_state_destroy(st);
}

/* ------------------------------------------------------------------------ */
/* Replacing the configuration                                              */
/* ------------------------------------------------------------------------ */

static uint64_t fake_ms;

static uint64_t fake_clock(void *arg)
{
    return fake_ms;
}

static int put(kvf_registry_state_t *st, int tp_size, int tp_rank, int port,
               int page, char **resp_p)
{
    char body[512];
    const char *ctype;
    snprintf(body, sizeof(body), "{\"attn_tp_size\":%d,\"attn_tp_rank\":%d,"
             "\"attn_cp_size\":1,\"attn_cp_rank\":0,\"attn_dp_size\":1,"
             "\"attn_dp_rank\":0,\"pp_size\":1,\"pp_rank\":0,"
             "\"system_dp_size\":1,\"system_dp_rank\":0,\"rank_ip\":"
             "\"10.0.0.1\",\"rank_port\":%d,\"page_size\":%d,"
             "\"kv_cache_dtype\":\"bfloat16\"}", tp_size, tp_rank, port, page);
    kvf_bs_client_t c = {.authorization = "Bearer " TOKEN, .addr = "10.0.0.1"};
    return kvf__registry_handle(st, &c, "PUT", "/route", NULL, body,
                                strlen(body), resp_p, &ctype);
}

static int get_rank(kvf_registry_state_t *st, int tp, char **resp_p)
{
    char q[160];
    const char *ctype;
    snprintf(q, sizeof(q), "prefill_dp_rank=%d&prefill_cp_rank=0&"
             "target_tp_rank=%d&target_pp_rank=0", tp < 0 ? -1 : 0, tp);
    if (tp < 0)
        snprintf(q, sizeof(q), "prefill_dp_rank=-1&prefill_cp_rank=-1&"
                 "target_tp_rank=-1&target_pp_rank=-1");
    return kvf__registry_handle(st, NULL, "GET", "/route", q, NULL, 0, resp_p,
                                &ctype);
}

#define EXPECT(call_, want_status, want_text)                                  \
    do {                                                                       \
        char *resp_ = NULL;                                                    \
        CHECK_EQ_INT(call_, (want_status));                                    \
        CHECK_STR_CONTAINS(resp_ ? resp_ : "", (want_text));                   \
        free(resp_);                                                           \
    } while (0)

static void test_config_replacement(void)
{
    kvf_registry_state_t *st = kvf__registry_state_create(0);
    CHECK_EQ_INT(kvf__registry_set_auth(st, TOKEN, 0), KVF_OK);
    kvf__registry_set_clock(st, fake_clock, NULL);

    /* A stray first registration at rank 0 with page_size 1: the real
     * rank 0 replaces it at once (it holds the stray's coordinates). */
    fake_ms = 100000;
    EXPECT(put(st, 1, 0, 9999, 1, &resp_), 200, "OK");
    fake_ms += 10;
    EXPECT(put(st, 2, 0, 17000, 64, &resp_), 200, "OK");
    EXPECT(get_rank(st, 0, &resp_), 200, "17000");
    kvf__registry_state_destroy(st);

    /* A stray at coordinates the real cluster does not start with: 409
     * while the stray is fresh... */
    st = kvf__registry_state_create(0);
    CHECK_EQ_INT(kvf__registry_set_auth(st, TOKEN, 0), KVF_OK);
    kvf__registry_set_clock(st, fake_clock, NULL);
    EXPECT(put(st, 4, 3, 9999, 1, &resp_), 200, "OK");
    fake_ms += 1000;
    EXPECT(put(st, 2, 0, 17000, 64, &resp_), 409, "attn_tp_size=2, but the "
           "registry has attn_tp_size=4");
    fake_ms += KVF_BS_STALE_MS - 1000 - 1;
    EXPECT(put(st, 2, 0, 17000, 64, &resp_), 409, "15 s");
    /* ... until the stray has not registered for KVF_BS_STALE_MS. */
    fake_ms += 1;
    EXPECT(put(st, 2, 0, 17000, 64, &resp_), 200, "OK");
    EXPECT(put(st, 2, 1, 17001, 64, &resp_), 200, "OK");
    EXPECT(get_rank(st, -1, &resp_), 200, "\"attn_tp_size\":2,");
    EXPECT(get_rank(st, 1, &resp_), 200, "17001");

    /* A live configuration: a conflicting rank outside it gets 409 however
     * often it asks, while the live ranks keep registering. */
    for (int i = 0; i < 5; i++) {
        fake_ms += 5000;
        EXPECT(put(st, 2, 0, 17000, 64, &resp_), 200, "OK");
        EXPECT(put(st, 4, 3, 9999, 1, &resp_), 409, "conflicts");
    }
    EXPECT(get_rank(st, -1, &resp_), 200, "\"page_size\":64");

    /* The cluster restarts with page_size 16: its rank 0 replaces the
     * configuration at once (it held these coordinates), dropping rank 1's
     * old entry; the new rank 1 completes it. */
    fake_ms += 1000;
    EXPECT(put(st, 2, 0, 18000, 16, &resp_), 200, "OK");
    EXPECT(get_rank(st, -1, &resp_), 503, "1 of 2 ranks registered");
    EXPECT(get_rank(st, 1, &resp_), 503, "not fully registered");
    EXPECT(get_rank(st, 0, &resp_), 200, "18000");
    EXPECT(put(st, 2, 1, 18001, 16, &resp_), 200, "OK");
    EXPECT(get_rank(st, -1, &resp_), 200, "\"page_size\":16");

    /* Smaller, after a restart: tp1 of the old layout is gone. */
    fake_ms += 1000;
    EXPECT(put(st, 1, 0, 19000, 16, &resp_), 200, "OK");
    EXPECT(get_rank(st, -1, &resp_), 200, "\"attn_tp_size\":1,");

    const char *ctype;
    char *m = NULL;
    kvf__registry_handle(st, NULL, "GET", "/metrics", NULL, NULL, 0, &m,
                         &ctype);
    CHECK_STR_CONTAINS(m, "kvferry_registry_config_replaced_total 3\n");
    CHECK_STR_CONTAINS(m, "kvferry_registry_ranks_registered 1\n");
    free(m);
    kvf__registry_state_destroy(st);
}

/* ------------------------------------------------------------------------ */
/* Bounded resources                                                        */
/* ------------------------------------------------------------------------ */

static void test_query_limits(void)
{
    srv_t s;
    if (srv_start(&s, TOKEN) != 0) {
        CHECK(!"server start");
        return;
    }
    char q[64 * 1024];
    for (int n = 0; n < 3; n++) {
        static const int counts[] = {33, 600, 5000};
        size_t off = (size_t)snprintf(q, sizeof(q), "/route?");
        for (int i = 0; i < counts[n] && off < sizeof(q) - 16; i++)
            off += (size_t)snprintf(q + off, sizeof(q) - off, "%sp%d=%d",
                                    i ? "&" : "", i, i);
        raw_resp_t r = raw(s.addr, "GET", q, NULL, NULL, NULL);
        CHECK(r.status == 400 || r.status == 414);
        CHECK(r.seconds < 1.0);
        CHECK_STR_CONTAINS(r.body, counts[n] == 33 ? "too many query "
                           "parameters: 33" : "query string is longer than");
        free(r.body);
    }
    /* 32 parameters is within the limit (and GET /route answers). */
    size_t off = (size_t)snprintf(q, sizeof(q), "/route?prefill_dp_rank=-1&"
        "prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1");
    for (int i = 4; i < 32; i++)
        off += (size_t)snprintf(q + off, sizeof(q) - off, "&x%d=1", i);
    RAW_CHECK(s.addr, "GET", q, NULL, NULL, 503, "not fully registered");
    /* Tiny parameters, many: "a&a&a..." of 20 KB. */
    off = (size_t)snprintf(q, sizeof(q), "/route?a");
    while (off < 20000)
        off += (size_t)snprintf(q + off, sizeof(q) - off, "&a");
    RAW_CHECK(s.addr, "GET", q, NULL, NULL, 414, "URI Too Long");
    RAW_CHECK(s.addr, "GET", "/health", NULL, NULL, 200, "OK");
    kvf_bootstrap_destroy(s.bs);
}

typedef struct flood {
    const char *addr;
    atomic_int  stop;
    atomic_long sent;
    long        unexpected;
} flood_t;

static void *flood_main(void *arg)
{
    flood_t *f = arg;
    char body[512];
    stranger_body(body, sizeof(body), 1, 1);
    while (!atomic_load(&f->stop)) {
        raw_resp_t r = raw(f->addr, "PUT", "/route", body, "Bearer guess",
                           NULL);
        if (r.status != 401)
            f->unexpected++;
        free(r.body);
        atomic_fetch_add(&f->sent, 1);
    }
    return NULL;
}

/* Connect n idle sockets to port from 127.0.0.2 (a client address of its
 * own: the per-IP limit is what is under test).  @return how many. */
static int idle_connect(int *fds, int n, int port)
{
    struct sockaddr_in to = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    struct sockaddr_in from = {.sin_family = AF_INET};
    to.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    from.sin_addr.s_addr = htonl(0x7f000002);
    int k = 0;
    for (; k < n; k++) {
        fds[k] = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
        if (fds[k] < 0 ||
            bind(fds[k], (struct sockaddr *)&from, sizeof(from)) != 0 ||
            connect(fds[k], (struct sockaddr *)&to, sizeof(to)) != 0) {
            fprintf(stderr, "  idle connection %d: %s\n", k, strerror(errno));
            if (fds[k] >= 0)
                close(fds[k]);
            break;
        }
    }
    return k;
}

static void test_idle_connections_and_flood(void)
{
    enum { IDLE = 1100, FLOODERS = 4, CHECKS = 20 };
    static int fds[IDLE];
    struct rlimit rl;
    srv_t s;
    char err[512];

    if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < IDLE + 256) {
        rl.rlim_cur = rl.rlim_max < IDLE + 256 ? rl.rlim_max : IDLE + 256;
        setrlimit(RLIMIT_NOFILE, &rl);
    }
    if (srv_start(&s, TOKEN) != 0) {
        CHECK(!"server start");
        return;
    }
    int n = idle_connect(fds, IDLE, kvf_bootstrap_port(s.bs));
    CHECK_EQ_INT(n, IDLE);

    /* The registry keeps KVF_BS_MAX_CONNS_PER_IP of them and closes the
     * rest: wait (on the sockets) until it has. */
    struct pollfd *pf = calloc((size_t)n, sizeof(*pf));
    int closed = 0;
    uint64_t until = kvf_now_ms() + 10000;
    for (int i = 0; i < n; i++)
        pf[i] = (struct pollfd){.fd = fds[i], .events = POLLIN};
    while (closed < n - (int)KVF_BS_MAX_CONNS_PER_IP && kvf_now_ms() < until) {
        if (poll(pf, (nfds_t)n, 1000) <= 0)
            continue;
        for (int i = 0; i < n; i++)
            if (pf[i].fd >= 0 && pf[i].revents) {
                char c;
                if (recv(pf[i].fd, &c, 1, MSG_DONTWAIT) <= 0) {
                    pf[i].fd = -pf[i].fd - 1;   /* poll ignores it now */
                    closed++;
                }
            }
    }
    CHECK_EQ_INT(closed, n - (int)KVF_BS_MAX_CONNS_PER_IP);

    /* /health answers within a second, first with only the idle ones... */
    uint64_t t0 = kvf_now_ms();
    CHECK_EQ_INT(kvf__bs_health(s.addr, 1000, err, sizeof(err)), KVF_OK);
    CHECK(kvf_now_ms() - t0 < 1000);

    /* ... then while strangers flood it with refused registrations. */
    flood_t f = {.addr = s.addr};
    pthread_t t[FLOODERS];
    for (int i = 0; i < FLOODERS; i++)
        pthread_create(&t[i], NULL, flood_main, &f);
    while (atomic_load(&f.sent) < 50)
        sched_yield();
    uint64_t worst = 0;
    for (int i = 0; i < CHECKS; i++) {
        t0 = kvf_now_ms();
        CHECK_EQ_INT(kvf__bs_health(s.addr, 1000, err, sizeof(err)), KVF_OK);
        uint64_t dt = kvf_now_ms() - t0;
        worst = dt > worst ? dt : worst;
    }
    CHECK(worst < 1000);
    atomic_store(&f.stop, 1);
    for (int i = 0; i < FLOODERS; i++)
        pthread_join(t[i], NULL);
    CHECK_EQ_INT(f.unexpected, 0);
    fprintf(stderr, "  /health: worst %llu ms during %ld refused requests, "
            "%d idle connections open\n", (unsigned long long)worst,
            atomic_load(&f.sent), (int)KVF_BS_MAX_CONNS_PER_IP);

    for (int i = 0; i < n; i++)
        close(fds[i]);
    free(pf);
    kvf_bootstrap_destroy(s.bs);
}

/* ------------------------------------------------------------------------ */
/* An engine with the token in its environment                              */
/* ------------------------------------------------------------------------ */

static void test_engine_registers_with_token(void)
{
    enum { PAGES = 8, PAGE_B = 256 };
    char err[512] = "", ip[64], addr[80], body[512];
    int port = 0;

    clear_env();
    setenv("KVF_AUTH_TOKEN", TOKEN, 1);
    kvf_engine_params_t p;
    kvf_engine_params_init(&p);
    p.role = KVF_ROLE_PREFILL;
    p.bootstrap_addr = "127.0.0.1:0";
    p.host_bootstrap = 1;
    kvf_engine_t *eng = NULL;
    CHECK_EQ_INT(kvf_engine_create(&p, &eng), KVF_OK);
    if (eng == NULL) {
        clear_env();
        return;
    }
    uint8_t *kv = calloc(2 * PAGES, PAGE_B), *aux = calloc(4, 16);
    kvf_buffer_t b[2] = {{kv, PAGES * PAGE_B, PAGE_B},
                         {kv + PAGES * PAGE_B, PAGES * PAGE_B, PAGE_B}};
    kvf_buffer_t a = {aux, 64, 16};
    kvf_layout_t l;
    kvf_layout_init(&l);
    l.page_size = 4;
    l.kv_dtype = "bfloat16";
    l.num_layers = 1;
    l.heads_per_rank = l.total_heads = 2;
    l.bytes_per_head = 32;
    l.num_kv = 2;
    l.kv = b;
    l.num_aux = 1;
    l.aux = &a;
    CHECK_EQ_INT(kvf_engine_register_layout(eng, &l), KVF_OK);
    CHECK_EQ_INT(kvf_engine_bootstrap_addr(eng, addr, sizeof(addr)), KVF_OK);

    /* The engine registers itself from its resolver thread: each lookup
     * below is one bounded HTTP call, until it shows up or 10 s pass. */
    kvf_status_t st = KVF_ERR_AGAIN;
    uint64_t until = kvf_now_ms() + 10000;
    while (st != KVF_OK && kvf_now_ms() < until)
        st = kvf__bs_get_rank(addr, 0, 0, 0, 0, TMO, ip, sizeof(ip), &port,
                              err, sizeof(err));
    CHECK_EQ_INT(st, KVF_OK);
    /* Its in-process registry wants the same token from everyone else. */
    stranger_body(body, sizeof(body), 1, 4);
    RAW_CHECK(addr, "PUT", "/route", body, NULL, 401, "Unauthorized");
    RAW_CHECK(addr, "GET", "/metrics", NULL, NULL, 200,
              "kvferry_registry_auth{mode=\"token\"} 1\n");
    int port2 = 0;
    CHECK_EQ_INT(kvf__bs_get_rank(addr, 0, 0, 0, 0, TMO, ip, sizeof(ip),
                                  &port2, err, sizeof(err)), KVF_OK);
    CHECK_EQ_INT(port2, port);
    kvf_engine_destroy(eng);
    free(kv);
    free(aux);
    clear_env();
}

/* ------------------------------------------------------------------------ */
/* What an engine registers                                                 */
/* ------------------------------------------------------------------------ */

typedef struct reg_engine {
    kvf_engine_t *eng;
    uint8_t      *kv, *aux;
} reg_engine_t;

/* A prefill engine (p's registration fields, tp 2 rank 1) registering
 * with the registry at p->bootstrap_addr once its layout is in. */
static int reg_engine_start(reg_engine_t *e, kvf_engine_params_t *p)
{
    enum { PAGES = 8, PAGE_B = 256 };

    memset(e, 0, sizeof(*e));
    p->role = KVF_ROLE_PREFILL;
    p->tp_size = 2;
    p->tp_rank = 1;
    if (kvf_engine_create(p, &e->eng) != KVF_OK)
        return -1;
    e->kv = calloc(2 * PAGES, PAGE_B);
    e->aux = calloc(4, 16);
    kvf_buffer_t b[2] = {{e->kv, PAGES * PAGE_B, PAGE_B},
                         {e->kv + PAGES * PAGE_B, PAGES * PAGE_B, PAGE_B}};
    kvf_buffer_t a = {e->aux, 64, 16};
    kvf_layout_t l;
    kvf_layout_init(&l);
    l.page_size = 4;
    l.kv_dtype = "bfloat16";
    l.num_layers = 1;
    l.heads_per_rank = 2;
    l.total_heads = 4;
    l.bytes_per_head = 32;
    l.num_kv = 2;
    l.kv = b;
    l.num_aux = 1;
    l.aux = &a;
    return kvf_engine_register_layout(e->eng, &l) == KVF_OK ? 0 : -1;
}

static void reg_engine_stop(reg_engine_t *e)
{
    kvf_engine_destroy(e->eng);
    free(e->kv);
    free(e->aux);
}

/* The body of the engine's first PUT /route (10 s at most), or NULL. */
static json_t *first_registration(capture_t *cap)
{
    uint64_t until = kvf_now_ms() + 10000;
    while (capture_count(cap) == 0 && kvf_now_ms() < until)
        usleep(10000);
    pthread_mutex_lock(&cap->lock);
    json_t *j = cap->count ? json_loads(cap->body, 0, NULL) : NULL;
    pthread_mutex_unlock(&cap->lock);
    return j;
}

static int ji(json_t *o, const char *k)
{
    json_t *v = json_object_get(o, k);
    return json_is_integer(v) ? (int)json_integer_value(v) : -12345;
}

static const char *js(json_t *o, const char *k)
{
    json_t *v = json_object_get(o, k);
    return json_is_string(v) ? json_string_value(v) : "(not a string)";
}

static void test_engine_registration_fields(void)
{
    static const char *const REG_VARS[] = {
        "KVF_KV_CACHE_DTYPE", "KVF_LOAD_BALANCE_METHOD",
        "KVF_PREFILL_HTTP_PORT"};
    capture_t cap;
    reg_engine_t e;
    kvf_engine_params_t p;
    char addr[80];

    clear_env();
    for (size_t i = 0; i < 3; i++)
        unsetenv(REG_VARS[i]);

    /* Every field set away from its default: each one arrives, with the
     * cluster token. */
    if (capture_start(&cap) != 0) {
        CHECK(!"capture server start");
        return;
    }
    kvf_engine_params_init(&p);
    p.bootstrap_addr = cap.addr;
    p.auth_token = TOKEN;
    p.pp_size = 2;
    p.pp_rank = 1;
    p.dp_size = 3;
    p.dp_rank = 2;
    p.dp_attention = 1;
    p.cp_size = 2;
    p.cp_rank = 1;
    p.kv_cache_dtype = "auto";
    p.load_balance_method = "total_requests";
    p.prefill_http_port = 30123;
    p.dsa_cache_layer_split = 1;
    CHECK_EQ_INT(reg_engine_start(&e, &p), 0);
    json_t *b = first_registration(&cap);
    CHECK(b != NULL);
    CHECK(strcmp(cap.authorization, "Bearer " TOKEN) == 0);
    CHECK_EQ_INT(json_object_size(b), 17);
    CHECK_EQ_INT(ji(b, "attn_tp_size"), 2);
    CHECK_EQ_INT(ji(b, "attn_tp_rank"), 1);
    CHECK_EQ_INT(ji(b, "attn_cp_size"), 2);
    CHECK_EQ_INT(ji(b, "attn_cp_rank"), 1);
    CHECK_EQ_INT(ji(b, "attn_dp_size"), 3);
    CHECK_EQ_INT(ji(b, "attn_dp_rank"), 2);
    CHECK_EQ_INT(ji(b, "system_dp_size"), 1);
    CHECK_EQ_INT(ji(b, "system_dp_rank"), 2);
    CHECK_EQ_INT(ji(b, "pp_size"), 2);
    CHECK_EQ_INT(ji(b, "pp_rank"), 1);
    CHECK_EQ_INT(ji(b, "page_size"), 4);
    CHECK(strcmp(js(b, "kv_cache_dtype"), "auto") == 0);
    CHECK(strcmp(js(b, "load_balance_method"), "total_requests") == 0);
    CHECK(json_is_true(json_object_get(b, "enable_dsa_cache_layer_split")));
    CHECK_EQ_INT(ji(b, "prefill_http_port"), 30123);
    CHECK_EQ_INT(kvf_engine_address(e.eng, addr, sizeof(addr)), KVF_OK);
    char want[80];
    snprintf(want, sizeof(want), "%s:%d", js(b, "rank_ip"),
             ji(b, "rank_port"));
    CHECK(strcmp(want, addr) == 0);
    json_decref(b);
    reg_engine_stop(&e);
    capture_stop(&cap);

    /* The defaults: system DP, CP 1, the layout's dtype, SGLang's
     * prefill-side default method, no HTTP port, no token to send. */
    if (capture_start(&cap) != 0) {
        CHECK(!"capture server start");
        return;
    }
    kvf_engine_params_init(&p);
    p.bootstrap_addr = cap.addr;
    p.dp_size = 2;
    p.dp_rank = 1;
    CHECK_EQ_INT(reg_engine_start(&e, &p), 0);
    b = first_registration(&cap);
    CHECK(b != NULL);
    CHECK(cap.authorization[0] == '\0');
    CHECK_EQ_INT(json_object_size(b), 17);
    CHECK_EQ_INT(ji(b, "attn_cp_size"), 1);
    CHECK_EQ_INT(ji(b, "attn_cp_rank"), 0);
    CHECK_EQ_INT(ji(b, "attn_dp_size"), 1);
    CHECK_EQ_INT(ji(b, "attn_dp_rank"), 0);
    CHECK_EQ_INT(ji(b, "system_dp_size"), 2);
    CHECK_EQ_INT(ji(b, "system_dp_rank"), 1);
    CHECK(strcmp(js(b, "kv_cache_dtype"), "bfloat16") == 0);
    CHECK(strcmp(js(b, "load_balance_method"), "follow_bootstrap_room") == 0);
    CHECK(json_is_false(json_object_get(b, "enable_dsa_cache_layer_split")));
    CHECK(json_is_null(json_object_get(b, "prefill_http_port")));
    json_decref(b);
    reg_engine_stop(&e);
    capture_stop(&cap);

    /* The variables stand in for unset parameters. */
    if (capture_start(&cap) != 0) {
        CHECK(!"capture server start");
        return;
    }
    setenv("KVF_KV_CACHE_DTYPE", "fp8_e4m3", 1);
    setenv("KVF_LOAD_BALANCE_METHOD", "round_robin", 1);
    setenv("KVF_PREFILL_HTTP_PORT", "31000", 1);
    kvf_engine_params_init(&p);
    p.bootstrap_addr = cap.addr;
    CHECK_EQ_INT(reg_engine_start(&e, &p), 0);
    b = first_registration(&cap);
    CHECK(b != NULL);
    CHECK(strcmp(js(b, "kv_cache_dtype"), "fp8_e4m3") == 0);
    CHECK(strcmp(js(b, "load_balance_method"), "round_robin") == 0);
    CHECK_EQ_INT(ji(b, "prefill_http_port"), 31000);
    json_decref(b);
    reg_engine_stop(&e);
    capture_stop(&cap);
    for (size_t i = 0; i < 3; i++)
        unsetenv(REG_VARS[i]);

    /* Bad registration parameters are refused at create, by name. */
    const struct { int cp_rank, cp_size, dp_attention, http; const char *dt;
                   const char *what; } bad[] = {
        {2, 2, 0, 0, NULL, "invalid cp"},
        {1, 0, 0, 0, NULL, "invalid cp"},
        {0, 0, 2, 0, NULL, "invalid dp_attention"},
        {0, 0, 0, 65536, NULL, "invalid prefill_http_port"},
        {0, 0, 0, 0, "fp8 e4m3", "invalid kv_cache_dtype"},
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        kvf_engine_t *eng = NULL;
        kvf_engine_params_init(&p);
        p.bootstrap_addr = "127.0.0.1:1";
        p.cp_rank = bad[i].cp_rank;
        p.cp_size = bad[i].cp_size;
        p.dp_attention = bad[i].dp_attention;
        p.prefill_http_port = bad[i].http;
        p.kv_cache_dtype = bad[i].dt;
        CHECK_EQ_INT(kvf_engine_create(&p, &eng), KVF_ERR_INVALID_PARAM);
        CHECK_STR_CONTAINS(kvf_last_error(), bad[i].what);
    }
}

/* Registry side: SGLang's full body needs the token once the registry has
 * one, and a refused one changes nothing. */
static void test_full_registration_needs_token(void)
{
    srv_t s;
    char body[768];

    clear_env();
    if (srv_start(&s, TOKEN) != 0) {
        CHECK(!"server start");
        return;
    }
    snprintf(body, sizeof(body), "{\"attn_tp_size\":1,\"attn_tp_rank\":0,"
             "\"attn_cp_size\":1,\"attn_cp_rank\":0,\"attn_dp_size\":1,"
             "\"attn_dp_rank\":0,\"pp_size\":1,\"pp_rank\":0,"
             "\"system_dp_size\":1,\"system_dp_rank\":0,\"rank_ip\":"
             "\"127.0.0.1\",\"rank_port\":41000,\"page_size\":16,"
             "\"kv_cache_dtype\":\"auto\",\"load_balance_method\":"
             "\"follow_bootstrap_room\",\"enable_dsa_cache_layer_split\":"
             "false,\"prefill_http_port\":30000}");
    RAW_CHECK(s.addr, "PUT", "/route", body, NULL, 401, "Unauthorized");
    RAW_CHECK(s.addr, "PUT", "/route", body, "Bearer not-" TOKEN, 401,
              "does not match");
    RAW_CHECK(s.addr, "GET", "/route?prefill_dp_rank=-1&prefill_cp_rank=-1&"
              "target_tp_rank=-1&target_pp_rank=-1", NULL, NULL, 503,
              "no prefill rank has registered");
    RAW_CHECK(s.addr, "PUT", "/route", body, "Bearer " TOKEN, 200, "OK");
    RAW_CHECK(s.addr, "GET", "/route?prefill_dp_rank=-1&prefill_cp_rank=-1&"
              "target_tp_rank=-1&target_pp_rank=-1", NULL, NULL, 200,
              "\"kv_cache_dtype\":\"auto\",\"follow_bootstrap_room\":true,"
              "\"enable_dsa_cache_layer_split\":false,"
              "\"prefill_http_port\":30000,");
    kvf_bootstrap_destroy(s.bs);
}

KVF_TEST_MAIN(KVF_CASE(test_token_load),
              KVF_CASE(test_stranger_is_refused),
              KVF_CASE(test_protected_mode),
              KVF_CASE(test_config_replacement),
              KVF_CASE(test_query_limits),
              KVF_CASE(test_idle_connections_and_flood),
              KVF_CASE(test_engine_registers_with_token),
              KVF_CASE(test_engine_registration_fields),
              KVF_CASE(test_full_registration_needs_token))
