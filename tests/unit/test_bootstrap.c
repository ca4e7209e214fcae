/*
 * Bootstrap registry: a real server on 127.0.0.1, port 0, driven through
 * the client calls (kvf__bs_*) for the good paths and through raw libcurl
 * requests for what the client never sends (bad parameters, malformed and
 * oversized bodies, wrong methods).
 */
#include <arpa/inet.h>
#include <dirent.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdint.h>
#include <sys/socket.h>
#include <unistd.h>

#include <curl/curl.h>
#include <jansson.h>

#include "bootstrap/bootstrap.h"
#include "util/time.h"

#include "kvf_http_capture.h"
#include "kvf_test.h"

#define TMO 3000u

typedef struct srv {
    kvf_bootstrap_t *bs;
    char addr[64];
} srv_t;

static int srv_start(srv_t *s)
{
    if (kvf_bootstrap_create("127.0.0.1", 0, &s->bs) != KVF_OK)
        return -1;
    snprintf(s->addr, sizeof(s->addr), "127.0.0.1:%d",
             kvf_bootstrap_port(s->bs));
    return 0;
}

static kvf_bs_reg_t mkreg(int tp_size, int tp_rank, int port)
{
    kvf_bs_reg_t r = {
        .attn_tp_size = tp_size, .attn_tp_rank = tp_rank,
        .attn_cp_size = 1, .attn_cp_rank = 0,
        .attn_dp_size = 1, .attn_dp_rank = 0,
        .pp_size = 1, .pp_rank = 0,
        .system_dp_size = 1, .system_dp_rank = 0,
        .rank_ip = "127.0.0.1", .rank_port = port,
        .page_size = 64, .kv_cache_dtype = "bfloat16",
        .load_balance_method = "round_robin",
    };
    return r;
}

/* ------------------------------------------------------------------------ */
/* Raw HTTP                                                                 */
/* ------------------------------------------------------------------------ */

typedef struct raw_resp {
    long   status;
    char  *body;
    size_t len;
    char   allow[64];
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
    if (size * n > 7 && strncasecmp(p, "Allow: ", 7) == 0)
        snprintf(r->allow, sizeof(r->allow), "%.*s", (int)(size * n - 9),
                 p + 7);
    return size * n;
}

typedef struct gen { size_t left; } gen_t;

static size_t gen_read(char *p, size_t size, size_t n, void *arg)
{
    gen_t *g = arg;
    size_t k = size * n < g->left ? size * n : g->left;
    memset(p, 'x', k);
    g->left -= k;
    return k;
}

/* body_len (size_t)-1: strlen(body).  chunked: upload `chunked` bytes of
 * 'x' with Transfer-Encoding: chunked instead of body. */
static raw_resp_t raw(const srv_t *s, const char *method, const char *target,
                      const char *body, size_t body_len, size_t chunked)
{
    raw_resp_t r = {0};
    char url[256];
    gen_t g = {chunked};
    struct curl_slist *h = NULL;
    CURL *c = curl_easy_init();

    snprintf(url, sizeof(url), "http://%s%s", s->addr, target);
    curl_easy_setopt(c, CURLOPT_URL, url);
    curl_easy_setopt(c, CURLOPT_NOPROXY, "*");
    curl_easy_setopt(c, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(c, CURLOPT_TIMEOUT_MS, 10000L);
    curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, raw_data);
    curl_easy_setopt(c, CURLOPT_WRITEDATA, &r);
    curl_easy_setopt(c, CURLOPT_HEADERFUNCTION, raw_header);
    curl_easy_setopt(c, CURLOPT_HEADERDATA, &r);
    if (chunked) {
        h = curl_slist_append(h, "Transfer-Encoding: chunked");
        curl_easy_setopt(c, CURLOPT_UPLOAD, 1L);
        curl_easy_setopt(c, CURLOPT_READFUNCTION, gen_read);
        curl_easy_setopt(c, CURLOPT_READDATA, &g);
    } else if (body != NULL) {
        curl_easy_setopt(c, CURLOPT_POSTFIELDS, body);
        curl_easy_setopt(c, CURLOPT_POSTFIELDSIZE_LARGE,
                         (curl_off_t)(body_len == (size_t)-1 ? strlen(body)
                                                             : body_len));
    }
    if (strcmp(method, "HEAD") == 0)
        curl_easy_setopt(c, CURLOPT_NOBODY, 1L);
    else
        curl_easy_setopt(c, CURLOPT_CUSTOMREQUEST, method);
    curl_easy_setopt(c, CURLOPT_HTTPHEADER, h);
    CURLcode rc = curl_easy_perform(c);
    if (rc == CURLE_OK)
        curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &r.status);
    else
        fprintf(stderr, "  raw %s %s: %s\n", method, target,
                curl_easy_strerror(rc));
    curl_slist_free_all(h);
    curl_easy_cleanup(c);
    return r;
}

#define RAW_CHECK(srv_, meth_, tgt_, req_, want_status, want_text)             \
    do {                                                                       \
        raw_resp_t r_ = raw((srv_), (meth_), (tgt_), (req_), (size_t)-1, 0);   \
        CHECK_EQ_INT(r_.status, (want_status));                                \
        CHECK_STR_CONTAINS(r_.body ? r_.body : "", (want_text));               \
        free(r_.body);                                                         \
    } while (0)

static void put_reg(const srv_t *s, const kvf_bs_reg_t *reg, int want)
{
    char err[512] = "";
    kvf_status_t st = kvf__bs_register(s->addr, reg, TMO, err, sizeof(err));
    CHECK_EQ_INT(st, want);
    if (st != want)
        fprintf(stderr, "  register: %s\n", err);
}

/* ------------------------------------------------------------------------ */
/* Tests                                                                    */
/* ------------------------------------------------------------------------ */

static void test_split_addr(void)
{
    char host[64];
    int port = -7;

    CHECK_EQ_INT(kvf__split_addr("127.0.0.1:8998", host, sizeof(host), &port),
                 KVF_OK);
    CHECK(strcmp(host, "127.0.0.1") == 0);
    CHECK_EQ_INT(port, 8998);
    CHECK_EQ_INT(kvf__split_addr("[::1]:80", host, sizeof(host), &port),
                 KVF_OK);
    CHECK(strcmp(host, "::1") == 0);
    CHECK_EQ_INT(port, 80);
    CHECK_EQ_INT(kvf__split_addr("prefill-0.svc:65535", host, sizeof(host),
                                 &port), KVF_OK);
    CHECK(strcmp(host, "prefill-0.svc") == 0);
    CHECK_EQ_INT(port, 65535);
    CHECK_EQ_INT(kvf__split_addr("h:0", host, sizeof(host), &port), KVF_OK);
    CHECK_EQ_INT(port, 0);

    port = -7;
    const char *bad[] = {"127.0.0.1", "127.0.0.1:", ":80", "h:65536",
                         "h:-1", "h:8x", "h:123456", "::1:80", "[::1]80",
                         "[::1", "[]:80", "", "h: 80"};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        kvf_status_t st = kvf__split_addr(bad[i], host, sizeof(host), &port);
        if (st != KVF_ERR_INVALID_PARAM)
            fprintf(stderr, "  accepted \"%s\"\n", bad[i]);
        CHECK_EQ_INT(st, KVF_ERR_INVALID_PARAM);
    }
    CHECK_EQ_INT(port, -7);
    CHECK_EQ_INT(kvf__split_addr("abcdef:1", host, 6, &port),
                 KVF_ERR_INVALID_PARAM);
    CHECK_EQ_INT(kvf__split_addr("abcde:1", host, 6, &port), KVF_OK);
    CHECK_EQ_INT(kvf__split_addr(NULL, host, 6, &port), KVF_ERR_INVALID_PARAM);
}

static void test_health_routes_methods(void)
{
    srv_t s;
    char err[512];

    if (srv_start(&s) != 0) {
        CHECK(!"server start");
        return;
    }
    CHECK(kvf_bootstrap_port(s.bs) > 0);
    CHECK_EQ_INT(kvf__bs_health(s.addr, TMO, err, sizeof(err)), KVF_OK);
    RAW_CHECK(&s, "GET", "/health", NULL, 200, "OK");
    raw_resp_t r = raw(&s, "HEAD", "/health", NULL, 0, 0);
    CHECK_EQ_INT(r.status, 200);
    free(r.body);
    RAW_CHECK(&s, "GET", "/nope", NULL, 404, "no such route: /nope");
    RAW_CHECK(&s, "GET", "/route/", NULL, 404, "no such route");
    r = raw(&s, "DELETE", "/route", NULL, 0, 0);
    CHECK_EQ_INT(r.status, 405);
    CHECK_STR_CONTAINS(r.body, "Method not allowed");
    CHECK(strcmp(r.allow, "GET, HEAD, PUT") == 0);
    free(r.body);
    RAW_CHECK(&s, "POST", "/health", "{}", 405, "allowed: GET, HEAD");
    RAW_CHECK(&s, "GET", "/register_dp_rank", NULL, 405, "allowed: POST");
    RAW_CHECK(&s, "PUT", "/query_dp_ranks", "{}", 405, "allowed: POST");
    kvf_bootstrap_destroy(s.bs);
}

static void test_register_until_ready(void)
{
    srv_t s;
    char err[512] = "", ip[64];
    int port = 0;
    kvf_bs_info_t info;

    if (srv_start(&s) != 0) {
        CHECK(!"server start");
        return;
    }
    memset(&info, 0, sizeof(info));
    CHECK_EQ_INT(kvf__bs_get_info(s.addr, TMO, &info, err, sizeof(err)),
                 KVF_ERR_AGAIN);
    CHECK_STR_CONTAINS(err, "no prefill rank has registered");
    CHECK_STR_CONTAINS(err, "answered 503");

    kvf_bs_reg_t r0 = mkreg(2, 0, 17000), r1 = mkreg(2, 1, 17001);
    put_reg(&s, &r0, KVF_OK);
    CHECK_EQ_INT(kvf__bs_get_info(s.addr, TMO, &info, err, sizeof(err)),
                 KVF_ERR_AGAIN);
    CHECK_STR_CONTAINS(err, "1 of 2 ranks registered");
    CHECK(strchr(err, '\n') == NULL);
    /* The registered rank answers; the missing one is not 404 yet. */
    CHECK_EQ_INT(kvf__bs_get_rank(s.addr, 0, 0, 0, 0, TMO, ip, sizeof(ip),
                                  &port, err, sizeof(err)), KVF_OK);
    CHECK_EQ_INT(port, 17000);
    CHECK_EQ_INT(kvf__bs_get_rank(s.addr, 0, 0, 1, 0, TMO, ip, sizeof(ip),
                                  &port, err, sizeof(err)), KVF_ERR_AGAIN);

    put_reg(&s, &r1, KVF_OK);
    CHECK_EQ_INT(kvf__bs_get_info(s.addr, TMO, &info, err, sizeof(err)),
                 KVF_OK);
    CHECK_EQ_INT(info.attn_tp_size, 2);
    CHECK_EQ_INT(info.attn_cp_size, 1);
    CHECK_EQ_INT(info.dp_size, 1);
    CHECK_EQ_INT(info.pp_size, 1);
    CHECK_EQ_INT(info.page_size, 64);
    CHECK(strcmp(info.kv_cache_dtype, "bfloat16") == 0);
    CHECK_EQ_INT(info.follow_bootstrap_room, 0);
    RAW_CHECK(&s, "GET", "/route?prefill_dp_rank=-1&prefill_cp_rank=-1&"
              "target_tp_rank=-1&target_pp_rank=-1", NULL, 200,
              "{\"attn_tp_size\":2,\"attn_cp_size\":1,\"dp_size\":1,"
              "\"pp_size\":1,\"page_size\":64,\"kv_cache_dtype\":\"bfloat16\","
              "\"follow_bootstrap_room\":false,"
              "\"enable_dsa_cache_layer_split\":false,"
              "\"prefill_http_port\":null,\"target_tp_rank\":null,"
              "\"target_tp_ranks\":null,\"target_cp_ranks\":null,"
              "\"target_pp_ranks\":null,\"required_dst_info_num\":null,"
              "\"required_prefill_response_num\":null}");

    CHECK_EQ_INT(kvf__bs_get_rank(s.addr, 0, 0, 1, 0, TMO, ip, sizeof(ip),
                                  &port, err, sizeof(err)), KVF_OK);
    CHECK(strcmp(ip, "127.0.0.1") == 0);
    CHECK_EQ_INT(port, 17001);
    RAW_CHECK(&s, "GET", "/route?prefill_dp_rank=0&prefill_cp_rank=0&"
              "target_tp_rank=1&target_pp_rank=0", NULL, 200,
              "{\"rank_ip\":\"127.0.0.1\",\"rank_port\":17001}");
    port = 5;
    CHECK_EQ_INT(kvf__bs_get_rank(s.addr, 0, 0, 2, 0, TMO, ip, sizeof(ip),
                                  &port, err, sizeof(err)), KVF_ERR_NOT_FOUND);
    CHECK_EQ_INT(port, 5);
    CHECK_STR_CONTAINS(err, "Bootstrap info not found for dp_rank=0 "
                       "cp_rank=0 tp_rank=2 pp_rank=0");
    CHECK_EQ_INT(kvf__bs_get_rank(s.addr, 1, 0, 0, 0, TMO, ip, sizeof(ip),
                                  &port, err, sizeof(err)), KVF_ERR_NOT_FOUND);
    /* An ip buffer too small for the answer is a failure, not truncation. */
    CHECK_EQ_INT(kvf__bs_get_rank(s.addr, 0, 0, 1, 0, TMO, ip, 4, &port, err,
                                  sizeof(err)), KVF_ERR_BOOTSTRAP);
    kvf_bootstrap_destroy(s.bs);
}

static void test_route_params(void)
{
    srv_t s;
    if (srv_start(&s) != 0) {
        CHECK(!"server start");
        return;
    }
    RAW_CHECK(&s, "GET", "/route", NULL, 400, "Missing inputs");
    RAW_CHECK(&s, "GET", "/route?prefill_dp_rank=-1&prefill_cp_rank=-1&"
              "target_tp_rank=-1", NULL, 400, "target_pp_rank is missing");
    RAW_CHECK(&s, "GET", "/route?prefill_dp_rank=-1&prefill_cp_rank=-1&"
              "target_tp_rank=&target_pp_rank=-1", NULL, 400,
              "target_tp_rank is missing");
    RAW_CHECK(&s, "GET", "/route?prefill_dp_rank=abc&prefill_cp_rank=-1&"
              "target_tp_rank=-1&target_pp_rank=-1", NULL, 400,
              "prefill_dp_rank=\"abc\" is not an integer");
    RAW_CHECK(&s, "GET", "/route?prefill_dp_rank=99999999999&prefill_cp_rank="
              "-1&target_tp_rank=-1&target_pp_rank=-1", NULL, 400,
              "is out of range");
    RAW_CHECK(&s, "GET", "/route?prefill_dp_rank=-1&prefill_cp_rank=-1&"
              "target_tp_rank=-1&target_pp_rank=", NULL, 400,
              "target_pp_rank is missing");
    RAW_CHECK(&s, "GET", "/route?prefill_dp_rank=-1&prefill_cp_rank=-1&"
              "target_tp_rank=-1&target_pp_rank=+", NULL, 400,
              "target_pp_rank=\" \" is not an integer");
    /* Percent-encoded parameters are decoded; spaces around a number are
     * accepted, as Python's int() does. */
    RAW_CHECK(&s, "GET", "/route?prefill%5Fdp_rank=%2D1&prefill_cp_rank=-1&"
              "target_tp_rank=+-1+&target_pp_rank=-1", NULL, 503,
              "not fully registered");
    kvf_bootstrap_destroy(s.bs);
}

/* GET /route?<four parameters, each set to v> */
static raw_resp_t route_all(const srv_t *s, const char *v)
{
    char target[512];
    snprintf(target, sizeof(target), "/route?prefill_dp_rank=%s&prefill_cp_rank=%s&"
             "target_tp_rank=%s&target_pp_rank=%s", v, v, v, v);
    return raw(s, "GET", target, NULL, 0, 0);
}

/*
 * Integer parameters are exactly integers: what SGLang's int() reads
 * (surrounding whitespace, a sign, '_' between digits) means the same
 * here, and anything else, a NUL ("%00") with junk after it included,
 * gets 400 naming the parameter, as does a value beyond the range.
 */
static void test_integer_params(void)
{
    static const char *const not_int[] = {
        "1%00junk", "-1%00", "%001", "1%00", "0%00%00", "1junk", "0x1", "1.0", "1e3",
        "%2B-1", "--1", "1__0", "_1", "1_", "-_1", "%C2%A01", "%EF%BC%91", "%20",
        "%2B", "-",
    };
    static const char *const out_of_range[] = {
        "2147483648", "-2147483649", "99999999999999999999999", "%2B4294967296",
    };
    srv_t s;
    if (srv_start(&s) != 0) {
        CHECK(!"server start");
        return;
    }
    for (size_t i = 0; i < sizeof(not_int) / sizeof(not_int[0]); i++) {
        raw_resp_t r = route_all(&s, not_int[i]);
        CHECK_EQ_INT(r.status, 400);
        CHECK_STR_CONTAINS(r.body ? r.body : "", "prefill_dp_rank=\"");
        CHECK_STR_CONTAINS(r.body ? r.body : "", "\" is not an integer");
        if (r.status != 400)
            fprintf(stderr, "  %s: %ld %s\n", not_int[i], r.status, r.body);
        free(r.body);
    }
    RAW_CHECK(&s, "GET", "/route?prefill_dp_rank=1%00junk&prefill_cp_rank=-1&"
              "target_tp_rank=-1&target_pp_rank=-1", NULL, 400,
              "prefill_dp_rank=\"1\\x00junk\" is not an integer");
    for (size_t i = 0; i < sizeof(out_of_range) / sizeof(out_of_range[0]); i++) {
        raw_resp_t r = route_all(&s, out_of_range[i]);
        CHECK_EQ_INT(r.status, 400);
        CHECK_STR_CONTAINS(r.body ? r.body : "", "is out of range (-2147483648..2147483647)");
        free(r.body);
    }
    /* A key with a NUL in it is another key, not prefill_dp_rank. */
    RAW_CHECK(&s, "GET", "/route?prefill_dp_rank%00=x&prefill_dp_rank=-1&prefill_cp_rank="
              "-1&target_tp_rank=-1&target_pp_rank=-1", NULL, 503, "not fully registered");
    RAW_CHECK(&s, "GET", "/route?prefill_dp_rank%00=-1&prefill_cp_rank=-1&"
              "target_tp_rank=-1&target_pp_rank=-1", NULL, 400, "prefill_dp_rank is missing");

    /* What int() reads, read the same: -1 everywhere is the parallel info,
     * 0 a rank, 10 a rank the registry does not have. */
    kvf_bs_reg_t reg = mkreg(1, 0, 17000);
    put_reg(&s, &reg, KVF_OK);
    static const char *const minus_one[] = {"-1", "-0_1", "%2D1", "%09-1%0A", "%1F-1",
                                            "+-1+", "-001"};
    for (size_t i = 0; i < sizeof(minus_one) / sizeof(minus_one[0]); i++) {
        raw_resp_t r = route_all(&s, minus_one[i]);
        CHECK_EQ_INT(r.status, 200);
        CHECK_STR_CONTAINS(r.body ? r.body : "", "\"attn_tp_size\":1");
        free(r.body);
    }
    static const char *const zero[] = {"0", "%2B0", "-0", "0_0", "+0+", "%0B0%0C", "00"};
    for (size_t i = 0; i < sizeof(zero) / sizeof(zero[0]); i++) {
        raw_resp_t r = route_all(&s, zero[i]);
        CHECK_EQ_INT(r.status, 200);
        CHECK_STR_CONTAINS(r.body ? r.body : "", "\"rank_port\":17000");
        free(r.body);
    }
    RAW_CHECK(&s, "GET", "/route?prefill_dp_rank=1_0&prefill_cp_rank=0&target_tp_rank=0&"
              "target_pp_rank=0", NULL, 404, "dp_rank=10 cp_rank=0");
    RAW_CHECK(&s, "GET", "/route?prefill_dp_rank=-2147483648&prefill_cp_rank=0&"
              "target_tp_rank=0&target_pp_rank=0", NULL, 404, "dp_rank=-2147483648");

    /* The DP-rank routes: a JSON integer, or a string int() reads. */
    RAW_CHECK(&s, "POST", "/register_dp_rank",
              "{\"bootstrap_room\": \" 4_2 \", \"dp_rank\": \"+3\"}", 200, "OK");
    RAW_CHECK(&s, "POST", "/register_dp_rank",
              "{\"bootstrap_room\": \"-0\", \"dp_rank\": 1}", 200, "OK");
    RAW_CHECK(&s, "POST", "/query_dp_ranks", "{\"bootstrap_rooms\": [\"42\", 0]}", 200,
              "{\"42\":3,\"0\":1}");
    RAW_CHECK(&s, "POST", "/register_dp_rank",
              "{\"bootstrap_room\": \"42x\", \"dp_rank\": 1}", 400,
              "\"bootstrap_room\" is missing or not an integer");
    RAW_CHECK(&s, "POST", "/register_dp_rank",
              "{\"bootstrap_room\": \"18446744073709551616\", \"dp_rank\": 1}", 400,
              "\"bootstrap_room\" is out of range");
    RAW_CHECK(&s, "POST", "/register_dp_rank",
              "{\"bootstrap_room\": \"-1\", \"dp_rank\": 1}", 400,
              "\"bootstrap_room\" is out of range");
    RAW_CHECK(&s, "POST", "/register_dp_rank",
              "{\"bootstrap_room\": 1, \"dp_rank\": \"2147483648\"}", 400,
              "\"dp_rank\" is out of range");
    RAW_CHECK(&s, "POST", "/register_dp_rank",
              "{\"bootstrap_room\": \"4\\u00002\", \"dp_rank\": 1}", 400,
              "malformed JSON body");
    RAW_CHECK(&s, "POST", "/query_dp_ranks", "{\"bootstrap_rooms\": [\"1 2\"]}", 400,
              "bootstrap_rooms[0] is not an integer");
    RAW_CHECK(&s, "POST", "/query_dp_ranks", "{\"bootstrap_rooms\": [-5]}", 400,
              "bootstrap_rooms[0] is out of range");
    kvf_bootstrap_destroy(s.bs);
}

static void test_bad_bodies(void)
{
    srv_t s;
    if (srv_start(&s) != 0) {
        CHECK(!"server start");
        return;
    }
    RAW_CHECK(&s, "PUT", "/route", "{\"attn_tp_size\": 1,", 400,
              "malformed JSON body");
    RAW_CHECK(&s, "PUT", "/route", "", 400, "malformed JSON body");
    RAW_CHECK(&s, "PUT", "/route", "[1,2]", 400, "must be a JSON object");
    RAW_CHECK(&s, "PUT", "/route", "{\"attn_tp_size\": 1}", 400,
              "field \"attn_tp_rank\" is missing");
    RAW_CHECK(&s, "POST", "/register_dp_rank", "{\"bootstrap_room\": 1", 400,
              "malformed JSON body");
    RAW_CHECK(&s, "POST", "/register_dp_rank", "{\"bootstrap_room\": -1, "
              "\"dp_rank\": 0}", 400, "\"bootstrap_room\" is out of range");
    RAW_CHECK(&s, "POST", "/query_dp_ranks", "{\"bootstrap_rooms\": 5}", 400,
              "an array of room ids");
    RAW_CHECK(&s, "POST", "/query_dp_ranks", "{\"bootstrap_rooms\": [1, "
              "\"x\"]}", 400, "bootstrap_rooms[1]");

    char base[512];
    const char *fmt = "{\"attn_tp_size\":%s,\"attn_tp_rank\":%s,"
        "\"attn_cp_size\":1,\"attn_cp_rank\":0,\"attn_dp_size\":1,"
        "\"attn_dp_rank\":0,\"pp_size\":1,\"pp_rank\":0,\"system_dp_size\":1,"
        "\"system_dp_rank\":7,\"rank_ip\":\"127.0.0.1\",\"rank_port\":%s,"
        "\"page_size\":1,\"kv_cache_dtype\":\"auto\"}";
    snprintf(base, sizeof(base), fmt, "2", "2", "5000");
    RAW_CHECK(&s, "PUT", "/route", base, 400,
              "attn_tp_rank=2 is out of range for attn_tp_size=2");
    snprintf(base, sizeof(base), fmt, "0", "0", "5000");
    RAW_CHECK(&s, "PUT", "/route", base, 400,
              "\"attn_tp_size\" is 0, outside 1..2147483647");
    snprintf(base, sizeof(base), fmt, "1", "0", "0");
    RAW_CHECK(&s, "PUT", "/route", base, 400, "\"rank_port\" is 0");
    snprintf(base, sizeof(base), fmt, "1", "0", "65536");
    RAW_CHECK(&s, "PUT", "/route", base, 400,
              "\"rank_port\" is 65536, outside 1..65535");
    snprintf(base, sizeof(base), fmt, "\"1\"", "0", "5000");
    RAW_CHECK(&s, "PUT", "/route", base, 400,
              "\"attn_tp_size\" must be an integer");
    snprintf(base, sizeof(base), fmt, "1", "0", "5000");
    char *ws = strstr(base, "127.0.0.1");
    memcpy(ws, "10.0 0.1", 8);
    RAW_CHECK(&s, "PUT", "/route", base, 400, "\"rank_ip\" must be a string");
    snprintf(base, sizeof(base), fmt, "100000", "0", "5000");
    RAW_CHECK(&s, "PUT", "/route", base, 400, "exceeds 65536 ranks");
    /* system_dp_rank is not checked when system DP is off (SGLang sends
     * the scheduler's DP rank there under DP attention). */
    snprintf(base, sizeof(base), fmt, "1", "0", "5000");
    RAW_CHECK(&s, "PUT", "/route", base, 200, "OK");

    /* Oversized: declared with Content-Length, then chunked (undeclared). */
    size_t big = (size_t)KVF_BS_MAX_BODY + 1;
    char *huge = malloc(big);
    memset(huge, ' ', big);
    raw_resp_t r = raw(&s, "POST", "/register_dp_rank", huge, big, 0);
    CHECK_EQ_INT(r.status, 413);
    CHECK_STR_CONTAINS(r.body, "too large");
    free(r.body);
    r = raw(&s, "PUT", "/route", NULL, 0, 3u << 20);
    CHECK_EQ_INT(r.status, 413);
    free(r.body);
    /* Exactly the limit is accepted (and is not JSON). */
    r = raw(&s, "POST", "/query_dp_ranks", huge, KVF_BS_MAX_BODY, 0);
    CHECK_EQ_INT(r.status, 400);
    free(r.body);
    free(huge);
    /* The server still serves after all that. */
    RAW_CHECK(&s, "GET", "/health", NULL, 200, "OK");
    kvf_bootstrap_destroy(s.bs);
}

static void test_conflict_and_reregister(void)
{
    srv_t s;
    char err[512] = "", ip[64];
    int port = 0;

    if (srv_start(&s) != 0) {
        CHECK(!"server start");
        return;
    }
    kvf_bs_reg_t r0 = mkreg(2, 0, 17000);
    put_reg(&s, &r0, KVF_OK);

    kvf_bs_reg_t bad = mkreg(4, 1, 17001);
    uint64_t t0 = kvf_now_ms();
    CHECK_EQ_INT(kvf__bs_register(s.addr, &bad, 5000, err, sizeof(err)),
                 KVF_ERR_BOOTSTRAP);
    CHECK(kvf_now_ms() - t0 < 1000);   /* 409 is final: no retries */
    CHECK_STR_CONTAINS(err, "answered 409");
    CHECK_STR_CONTAINS(err, "attn_tp_size=4, but the registry has "
                       "attn_tp_size=2");
    bad = mkreg(2, 1, 17001);
    bad.page_size = 1;
    CHECK_EQ_INT(kvf__bs_register(s.addr, &bad, TMO, err, sizeof(err)),
                 KVF_ERR_BOOTSTRAP);
    CHECK_STR_CONTAINS(err, "page_size=1, but the registry has page_size=64");
    bad = mkreg(2, 1, 17001);
    bad.kv_cache_dtype = "fp8_e5m2";
    CHECK_EQ_INT(kvf__bs_register(s.addr, &bad, TMO, err, sizeof(err)),
                 KVF_ERR_BOOTSTRAP);
    CHECK_STR_CONTAINS(err, "kv_cache_dtype=fp8_e5m2");
    RAW_CHECK(&s, "GET", "/route?prefill_dp_rank=-1&prefill_cp_rank=-1&"
              "target_tp_rank=-1&target_pp_rank=-1", NULL, 503, "1 of 2");

    /* A restarted rank 0 replaces its entry and does not count twice. */
    r0.rank_ip = "127.0.0.9";
    r0.rank_port = 18000;
    put_reg(&s, &r0, KVF_OK);
    RAW_CHECK(&s, "GET", "/route?prefill_dp_rank=-1&prefill_cp_rank=-1&"
              "target_tp_rank=-1&target_pp_rank=-1", NULL, 503, "1 of 2");
    CHECK_EQ_INT(kvf__bs_get_rank(s.addr, 0, 0, 0, 0, TMO, ip, sizeof(ip),
                                  &port, err, sizeof(err)), KVF_OK);
    CHECK(strcmp(ip, "127.0.0.9") == 0);
    CHECK_EQ_INT(port, 18000);
    RAW_CHECK(&s, "GET", "/metrics", NULL, 200,
              "kvferry_registry_ranks_registered 1\n");
    kvf_bootstrap_destroy(s.bs);
}

static void test_dp_layouts(void)
{
    srv_t s;
    char err[512] = "", ip[64];
    int port = 0;
    kvf_bs_info_t info;

    if (srv_start(&s) != 0) {
        CHECK(!"server start");
        return;
    }
    /* System DP (no DP attention): dp_size and the coordinate come from
     * system_dp_*; SGLang's optional fields are echoed. */
    const char *fmt = "{\"attn_tp_size\":1,\"attn_tp_rank\":0,"
        "\"attn_cp_size\":1,\"attn_cp_rank\":0,\"attn_dp_size\":1,"
        "\"attn_dp_rank\":0,\"pp_size\":1,\"pp_rank\":0,\"system_dp_size\":2,"
        "\"system_dp_rank\":%d,\"rank_ip\":\"::1\",\"rank_port\":%d,"
        "\"page_size\":16,\"kv_cache_dtype\":null,"
        "\"prefill_http_port\":30000,\"enable_dsa_cache_layer_split\":false}";
    char body[512];
    snprintf(body, sizeof(body), fmt, 1, 6001);
    RAW_CHECK(&s, "PUT", "/route", body, 200, "OK");
    snprintf(body, sizeof(body), fmt, 0, 6000);
    RAW_CHECK(&s, "PUT", "/route", body, 200, "OK");
    RAW_CHECK(&s, "GET", "/route?prefill_dp_rank=-1&prefill_cp_rank=-1&"
              "target_tp_rank=-1&target_pp_rank=-1", NULL, 200,
              "\"dp_size\":2,\"pp_size\":1,\"page_size\":16,"
              "\"kv_cache_dtype\":null,\"follow_bootstrap_room\":true,"
              "\"enable_dsa_cache_layer_split\":false,"
              "\"prefill_http_port\":30000,\"target_tp_rank\":null,");
    CHECK_EQ_INT(kvf__bs_get_info(s.addr, TMO, &info, err, sizeof(err)),
                 KVF_OK);
    CHECK_EQ_INT(info.dp_size, 2);
    CHECK_EQ_INT(info.follow_bootstrap_room, 1);
    CHECK(info.kv_cache_dtype[0] == '\0');
    CHECK_EQ_INT(info.prefill_http_port, 30000);
    CHECK_EQ_INT(info.enable_dsa_cache_layer_split, 0);
    CHECK_EQ_INT(kvf__bs_get_rank(s.addr, 1, 0, 0, 0, TMO, ip, sizeof(ip),
                                  &port, err, sizeof(err)), KVF_OK);
    CHECK(strcmp(ip, "::1") == 0);
    CHECK_EQ_INT(port, 6001);
    kvf_bootstrap_destroy(s.bs);

    /* DP attention: attn_dp_* count, system_dp_rank is ignored. */
    if (srv_start(&s) != 0) {
        CHECK(!"server start");
        return;
    }
    for (int dp = 0; dp < 2; dp++) {
        kvf_bs_reg_t r = mkreg(1, 0, 7000 + dp);
        r.attn_dp_size = 2;
        r.attn_dp_rank = dp;
        r.system_dp_rank = 3;
        r.load_balance_method = "follow_bootstrap_room";
        put_reg(&s, &r, KVF_OK);
    }
    CHECK_EQ_INT(kvf__bs_get_info(s.addr, TMO, &info, err, sizeof(err)),
                 KVF_OK);
    CHECK_EQ_INT(info.dp_size, 2);
    CHECK_EQ_INT(info.follow_bootstrap_room, 1);
    CHECK_EQ_INT(kvf__bs_get_rank(s.addr, 1, 0, 0, 0, TMO, ip, sizeof(ip),
                                  &port, err, sizeof(err)), KVF_OK);
    CHECK_EQ_INT(port, 7001);
    kvf_bootstrap_destroy(s.bs);

    /* No load_balance_method: the key is left out, as SGLang's default. */
    if (srv_start(&s) != 0) {
        CHECK(!"server start");
        return;
    }
    kvf_bs_reg_t r = mkreg(1, 0, 7000);
    r.load_balance_method = NULL;
    put_reg(&s, &r, KVF_OK);
    CHECK_EQ_INT(kvf__bs_get_info(s.addr, TMO, &info, err, sizeof(err)),
                 KVF_OK);
    CHECK_EQ_INT(info.follow_bootstrap_room, 1);
    kvf_bootstrap_destroy(s.bs);
}

/* ------------------------------------------------------------------------ */
/* SGLang's fields, exactly                                                 */
/* ------------------------------------------------------------------------ */

/* The keys of SGLang's PUT /route body (CommonKVManager.register_to_bootstrap)
 * and of its PrefillServerInfo dataclass, in its order. */
static const char *const PUT_KEYS[] = {
    "attn_tp_size", "attn_tp_rank", "attn_cp_size", "attn_cp_rank",
    "attn_dp_size", "attn_dp_rank", "pp_size", "pp_rank", "system_dp_size",
    "system_dp_rank", "rank_ip", "rank_port", "page_size", "kv_cache_dtype",
    "load_balance_method", "enable_dsa_cache_layer_split",
    "prefill_http_port"};
static const char *const INFO_KEYS[] = {
    "attn_tp_size", "attn_cp_size", "dp_size", "pp_size", "page_size",
    "kv_cache_dtype", "follow_bootstrap_room", "enable_dsa_cache_layer_split",
    "prefill_http_port", "target_tp_rank", "target_tp_ranks",
    "target_cp_ranks", "target_pp_ranks", "required_dst_info_num",
    "required_prefill_response_num"};
#define NKEYS(a) (sizeof(a) / sizeof((a)[0]))

/* o has exactly these keys (no more, none missing), in this order. */
static int exact_keys(json_t *o, const char *const *keys, size_t n)
{
    const char *k;
    json_t *v;
    size_t i = 0;

    if (!json_is_object(o) || json_object_size(o) != n) {
        fprintf(stderr, "  %zu keys, want %zu\n",
                json_is_object(o) ? json_object_size(o) : 0, n);
        return 0;
    }
    json_object_foreach(o, k, v) {
        if (strcmp(k, keys[i]) != 0) {
            fprintf(stderr, "  key %zu is \"%s\", want \"%s\"\n", i, k,
                    keys[i]);
            return 0;
        }
        i++;
    }
    return 1;
}

static int jint(json_t *o, const char *k)
{
    json_t *v = json_object_get(o, k);
    return json_is_integer(v) ? (int)json_integer_value(v) : -12345;
}

static const char *jstr(json_t *o, const char *k)
{
    json_t *v = json_object_get(o, k);
    return json_is_string(v) ? json_string_value(v) : "(not a string)";
}

/* GET /route with all four parameters -1, as JSON (NULL unless 200). */
static json_t *get_info_json(const srv_t *s)
{
    raw_resp_t r = raw(s, "GET", "/route?prefill_dp_rank=-1&prefill_cp_rank="
                       "-1&target_tp_rank=-1&target_pp_rank=-1", NULL, 0, 0);
    json_t *j = r.status == 200 ? json_loads(r.body, 0, NULL) : NULL;
    if (r.status != 200)
        fprintf(stderr, "  GET /route: %ld %s\n", r.status,
                r.body ? r.body : "");
    free(r.body);
    return j;
}

/* A registration with every field away from its default: CP 2, DP
 * attention 3 groups, PP 2, dtype "auto", a load-balance method that is
 * not follow_bootstrap_room, the DSA split on, an HTTP port. */
static kvf_bs_reg_t mkfull(int cp_rank, int dp_rank, int pp_rank, int port)
{
    kvf_bs_reg_t r = {
        .attn_tp_size = 1, .attn_tp_rank = 0,
        .attn_cp_size = 2, .attn_cp_rank = cp_rank,
        .attn_dp_size = 3, .attn_dp_rank = dp_rank,
        .pp_size = 2, .pp_rank = pp_rank,
        .system_dp_size = 1, .system_dp_rank = dp_rank,
        .rank_ip = "127.0.0.1", .rank_port = port,
        .page_size = 32, .kv_cache_dtype = "auto",
        .load_balance_method = "total_requests",
        .enable_dsa_cache_layer_split = 1, .prefill_http_port = 30123,
    };
    return r;
}

static void test_registration_fields(void)
{
    capture_t cap;
    srv_t s;
    char err[512] = "";

    /* What the client sends: SGLang's body, key for key, and the token. */
    if (capture_start(&cap) != 0) {
        CHECK(!"capture server start");
        return;
    }
    kvf_bs_reg_t full = mkfull(1, 2, 1, 17005);
    CHECK_EQ_INT(kvf__bs_register_auth(cap.addr, &full, "tok-123", TMO, err,
                                       sizeof(err)), KVF_OK);
    CHECK_EQ_INT(capture_count(&cap), 1);
    CHECK(strcmp(cap.method, "PUT") == 0);
    CHECK(strcmp(cap.target, "/route") == 0);
    CHECK(strcmp(cap.authorization, "Bearer tok-123") == 0);
    json_t *b = json_loads(cap.body, 0, NULL);
    CHECK(exact_keys(b, PUT_KEYS, NKEYS(PUT_KEYS)));
    CHECK_EQ_INT(jint(b, "attn_cp_size"), 2);
    CHECK_EQ_INT(jint(b, "attn_cp_rank"), 1);
    CHECK_EQ_INT(jint(b, "attn_dp_size"), 3);
    CHECK_EQ_INT(jint(b, "attn_dp_rank"), 2);
    CHECK_EQ_INT(jint(b, "pp_size"), 2);
    CHECK_EQ_INT(jint(b, "pp_rank"), 1);
    CHECK_EQ_INT(jint(b, "system_dp_size"), 1);
    CHECK_EQ_INT(jint(b, "system_dp_rank"), 2);
    CHECK_EQ_INT(jint(b, "rank_port"), 17005);
    CHECK_EQ_INT(jint(b, "page_size"), 32);
    CHECK(strcmp(jstr(b, "kv_cache_dtype"), "auto") == 0);
    CHECK(strcmp(jstr(b, "load_balance_method"), "total_requests") == 0);
    CHECK(json_is_true(json_object_get(b, "enable_dsa_cache_layer_split")));
    CHECK_EQ_INT(jint(b, "prefill_http_port"), 30123);
    json_decref(b);
    /* Unknown values travel as null, never as a made-up number. */
    kvf_bs_reg_t bare = mkreg(1, 0, 17000);
    bare.kv_cache_dtype = NULL;
    CHECK_EQ_INT(kvf__bs_register_auth(cap.addr, &bare, "tok-123", TMO, err,
                                       sizeof(err)), KVF_OK);
    b = json_loads(cap.body, 0, NULL);
    CHECK(exact_keys(b, PUT_KEYS, NKEYS(PUT_KEYS)));
    CHECK(json_is_null(json_object_get(b, "prefill_http_port")));
    CHECK(json_is_null(json_object_get(b, "kv_cache_dtype")));
    CHECK(json_is_false(json_object_get(b, "enable_dsa_cache_layer_split")));
    json_decref(b);
    capture_stop(&cap);

    /* What the registry keeps and answers: every rank of CP 2 x DP 3 x
     * PP 2, then PrefillServerInfo's keys exactly, with these values. */
    if (srv_start(&s) != 0) {
        CHECK(!"server start");
        return;
    }
    int port = 17100;
    for (int dp = 0; dp < 3; dp++)
        for (int cp = 0; cp < 2; cp++)
            for (int pp = 0; pp < 2; pp++) {
                kvf_bs_reg_t r = mkfull(cp, dp, pp, port++);
                put_reg(&s, &r, KVF_OK);
            }
    json_t *j = get_info_json(&s);
    CHECK(exact_keys(j, INFO_KEYS, NKEYS(INFO_KEYS)));
    CHECK_EQ_INT(jint(j, "attn_tp_size"), 1);
    CHECK_EQ_INT(jint(j, "attn_cp_size"), 2);
    CHECK_EQ_INT(jint(j, "dp_size"), 3);
    CHECK_EQ_INT(jint(j, "pp_size"), 2);
    CHECK_EQ_INT(jint(j, "page_size"), 32);
    CHECK(strcmp(jstr(j, "kv_cache_dtype"), "auto") == 0);
    CHECK(json_is_false(json_object_get(j, "follow_bootstrap_room")));
    CHECK(json_is_true(json_object_get(j, "enable_dsa_cache_layer_split")));
    CHECK_EQ_INT(jint(j, "prefill_http_port"), 30123);
    for (size_t i = 9; i < NKEYS(INFO_KEYS); i++)
        CHECK(json_is_null(json_object_get(j, INFO_KEYS[i])));
    json_decref(j);
    /* The C decode side reads the same answer. */
    kvf_bs_info_t info;
    CHECK_EQ_INT(kvf__bs_get_info(s.addr, TMO, &info, err, sizeof(err)),
                 KVF_OK);
    CHECK_EQ_INT(info.attn_cp_size, 2);
    CHECK_EQ_INT(info.dp_size, 3);
    CHECK_EQ_INT(info.pp_size, 2);
    CHECK_EQ_INT(info.follow_bootstrap_room, 0);
    CHECK_EQ_INT(info.enable_dsa_cache_layer_split, 1);
    CHECK_EQ_INT(info.prefill_http_port, 30123);
    CHECK(strcmp(info.kv_cache_dtype, "auto") == 0);
    /* Each rank is kept at its (dp, cp, tp, pp). */
    char ip[64];
    int rp = 0;
    CHECK_EQ_INT(kvf__bs_get_rank(s.addr, 2, 1, 0, 1, TMO, ip, sizeof(ip),
                                  &rp, err, sizeof(err)), KVF_OK);
    CHECK_EQ_INT(rp, 17100 + 2 * 4 + 1 * 2 + 1);
    RAW_CHECK(&s, "GET", "/metrics", NULL, 200,
              "kvferry_registry_ranks_registered 12\n");
    kvf_bootstrap_destroy(s.bs);
}

/* PUT /route with this kv_cache_dtype (NULL: null) for tp rank `tp` of 4. */
static int put_dtype(const srv_t *s, int tp, const char *dtype, char *err,
                     size_t errlen)
{
    kvf_bs_reg_t r = mkreg(4, tp, 17200 + tp);
    r.kv_cache_dtype = dtype;
    return (int)kvf__bs_register(s->addr, &r, TMO, err, errlen);
}

static void test_dtype_auto(void)
{
    srv_t s;
    char err[512] = "";
    json_t *j;

    /* "auto" beside "auto", beside the dtype it may resolve to, and
     * spellings of one dtype: none is refused; the first one's string is
     * what decode servers compare with their own --kv-cache-dtype. */
    if (srv_start(&s) != 0) {
        CHECK(!"server start");
        return;
    }
    CHECK_EQ_INT(put_dtype(&s, 0, "auto", err, sizeof(err)), KVF_OK);
    CHECK_EQ_INT(put_dtype(&s, 1, "auto", err, sizeof(err)), KVF_OK);
    CHECK_EQ_INT(put_dtype(&s, 2, "bfloat16", err, sizeof(err)), KVF_OK);
    CHECK_EQ_INT(put_dtype(&s, 3, "bf16", err, sizeof(err)), KVF_OK);
    j = get_info_json(&s);
    CHECK(strcmp(jstr(j, "kv_cache_dtype"), "auto") == 0);
    json_decref(j);
    /* Once a concrete dtype is known, another concrete one would break
     * the transfers of one of them: 409, naming both. */
    RAW_CHECK(&s, "GET", "/metrics", NULL, 200,
              "kvferry_registry_ranks_registered 4\n");
    kvf_bootstrap_destroy(s.bs);

    if (srv_start(&s) != 0) {
        CHECK(!"server start");
        return;
    }
    CHECK_EQ_INT(put_dtype(&s, 0, "auto", err, sizeof(err)), KVF_OK);
    CHECK_EQ_INT(put_dtype(&s, 1, "bfloat16", err, sizeof(err)), KVF_OK);
    CHECK_EQ_INT(put_dtype(&s, 2, "fp8_e4m3", err, sizeof(err)),
                 KVF_ERR_BOOTSTRAP);
    CHECK_STR_CONTAINS(err, "answered 409");
    CHECK_STR_CONTAINS(err, "kv_cache_dtype=fp8_e4m3, but the registry has "
                       "kv_cache_dtype=bfloat16");
    CHECK_EQ_INT(put_dtype(&s, 2, NULL, err, sizeof(err)), KVF_OK);
    CHECK_EQ_INT(put_dtype(&s, 3, "AUTO", err, sizeof(err)), KVF_OK);
    kvf_bootstrap_destroy(s.bs);

    /* A first registration without a dtype (null): SGLang takes the first
     * one a later rank names. */
    if (srv_start(&s) != 0) {
        CHECK(!"server start");
        return;
    }
    for (int tp = 0; tp < 4; tp++)
        CHECK_EQ_INT(put_dtype(&s, tp, tp == 0 ? NULL : "auto", err,
                               sizeof(err)), KVF_OK);
    j = get_info_json(&s);
    CHECK(strcmp(jstr(j, "kv_cache_dtype"), "auto") == 0);
    json_decref(j);
    kvf_bootstrap_destroy(s.bs);
}

static void test_reregistration(void)
{
    srv_t s;
    char err[512] = "", ip[64];
    int port = 0;

    if (srv_start(&s) != 0) {
        CHECK(!"server start");
        return;
    }
    /* The same registration again and again (engines re-register every
     * 5 s): always 200, counted once. */
    kvf_bs_reg_t r0 = mkfull(0, 0, 0, 17300);
    for (int i = 0; i < 5; i++)
        put_reg(&s, &r0, KVF_OK);
    RAW_CHECK(&s, "GET", "/metrics", NULL, 200,
              "kvferry_registry_ranks_registered 1\n");
    /* Server-wide settings that differ never refuse a rank: the first
     * registration's stay, as in SGLang. */
    kvf_bs_reg_t r1 = mkfull(1, 0, 0, 17301);
    r1.load_balance_method = "follow_bootstrap_room";
    r1.prefill_http_port = 30999;
    r1.enable_dsa_cache_layer_split = 0;
    put_reg(&s, &r1, KVF_OK);
    /* The same slot naming a dtype where it said "auto": no conflict, the
     * rank still counts once. */
    r0.kv_cache_dtype = "fp8_e5m2";
    put_reg(&s, &r0, KVF_OK);
    RAW_CHECK(&s, "GET", "/metrics", NULL, 200,
              "kvferry_registry_ranks_registered 2\n");
    /* The same slot with another page size (a restart): it replaces the
     * configuration, no 409. */
    r0.page_size = 16;
    r0.rank_port = 17400;
    put_reg(&s, &r0, KVF_OK);
    CHECK_EQ_INT(kvf__bs_get_rank(s.addr, 0, 0, 0, 0, TMO, ip, sizeof(ip),
                                  &port, err, sizeof(err)), KVF_OK);
    CHECK_EQ_INT(port, 17400);
    RAW_CHECK(&s, "GET", "/metrics", NULL, 200,
              "kvferry_registry_config_replaced_total 1\n");
    /* ... and re-registering it once more, the same: still 200. */
    put_reg(&s, &r0, KVF_OK);
    RAW_CHECK(&s, "GET", "/metrics", NULL, 200,
              "kvferry_registry_ranks_registered 1\n");
    kvf_bootstrap_destroy(s.bs);

    /* Without replacement: settings of the first registration stay. */
    if (srv_start(&s) != 0) {
        CHECK(!"server start");
        return;
    }
    kvf_bs_reg_t a = mkreg(2, 0, 17500), b = mkreg(2, 1, 17501);
    a.prefill_http_port = 30001;
    b.prefill_http_port = 30002;
    b.load_balance_method = "follow_bootstrap_room";
    b.enable_dsa_cache_layer_split = 1;
    put_reg(&s, &a, KVF_OK);
    put_reg(&s, &b, KVF_OK);
    put_reg(&s, &b, KVF_OK);
    json_t *j = get_info_json(&s);
    CHECK(exact_keys(j, INFO_KEYS, NKEYS(INFO_KEYS)));
    CHECK_EQ_INT(jint(j, "prefill_http_port"), 30001);
    CHECK(json_is_false(json_object_get(j, "follow_bootstrap_room")));
    CHECK(json_is_false(json_object_get(j, "enable_dsa_cache_layer_split")));
    json_decref(j);
    kvf_bootstrap_destroy(s.bs);
}

static void test_sglang_bodies(void)
{
    srv_t s;

    if (srv_start(&s) != 0) {
        CHECK(!"server start");
        return;
    }
    /* SGLang's own body as its prefill sends it, then the optional
     * fields' bad values. */
    const char *fmt = "{\"attn_tp_size\":1,\"attn_tp_rank\":0,"
        "\"attn_cp_size\":1,\"attn_cp_rank\":0,\"attn_dp_size\":1,"
        "\"attn_dp_rank\":0,\"pp_size\":1,\"pp_rank\":0,\"system_dp_size\":1,"
        "\"system_dp_rank\":0,\"rank_ip\":\"10.1.2.3\",\"rank_port\":41000,"
        "\"page_size\":1,\"kv_cache_dtype\":\"auto\","
        "\"load_balance_method\":\"follow_bootstrap_room\","
        "\"enable_dsa_cache_layer_split\":%s,\"prefill_http_port\":%s}";
    char body[768];
    snprintf(body, sizeof(body), fmt, "1", "30000");
    RAW_CHECK(&s, "PUT", "/route", body, 400,
              "\"enable_dsa_cache_layer_split\" must be true or false");
    snprintf(body, sizeof(body), fmt, "false", "\"30000\"");
    RAW_CHECK(&s, "PUT", "/route", body, 400,
              "\"prefill_http_port\" must be an integer");
    snprintf(body, sizeof(body), fmt, "false", "70000");
    RAW_CHECK(&s, "PUT", "/route", body, 400,
              "\"prefill_http_port\" is 70000, outside 1..65535");
    snprintf(body, sizeof(body), fmt, "false", "null");
    RAW_CHECK(&s, "PUT", "/route", body, 200, "OK");
    json_t *j = get_info_json(&s);
    CHECK(exact_keys(j, INFO_KEYS, NKEYS(INFO_KEYS)));
    CHECK(json_is_null(json_object_get(j, "prefill_http_port")));
    CHECK(json_is_true(json_object_get(j, "follow_bootstrap_room")));
    json_decref(j);
    /* A later rank's HTTP port fills the unknown one, as SGLang does. */
    snprintf(body, sizeof(body), fmt, "false", "30000");
    RAW_CHECK(&s, "PUT", "/route", body, 200, "OK");
    j = get_info_json(&s);
    CHECK_EQ_INT(jint(j, "prefill_http_port"), 30000);
    json_decref(j);
    kvf_bootstrap_destroy(s.bs);
}

static void test_dp_rooms(void)
{
    srv_t s;
    char err[512] = "";
    if (srv_start(&s) != 0) {
        CHECK(!"server start");
        return;
    }
    CHECK_EQ_INT(kvf__bs_register_dp_rank(s.addr, 5, 1, TMO, err,
                                          sizeof(err)), KVF_OK);
    CHECK_EQ_INT(kvf__bs_register_dp_rank(s.addr, UINT64_MAX, 2, TMO, err,
                                          sizeof(err)), KVF_OK);
    CHECK_EQ_INT(kvf__bs_register_dp_rank(s.addr, 5, 3, TMO, err,
                                          sizeof(err)), KVF_OK);
    uint64_t rooms[] = {5, 6, UINT64_MAX};
    int dps[3] = {9, 9, 9};
    CHECK_EQ_INT(kvf__bs_query_dp_ranks(s.addr, rooms, 3, dps, TMO, err,
                                        sizeof(err)), KVF_OK);
    CHECK_EQ_INT(dps[0], 3);
    CHECK_EQ_INT(dps[1], -1);
    CHECK_EQ_INT(dps[2], 2);
    CHECK_EQ_INT(kvf__bs_query_dp_ranks(s.addr, rooms, 0, dps, TMO, err,
                                        sizeof(err)), KVF_OK);
    /* SGLang's shapes: "OK", and an object keyed by the decimal room id. */
    RAW_CHECK(&s, "POST", "/register_dp_rank",
              "{\"bootstrap_room\": 9007199254740993, \"dp_rank\": 4}", 200,
              "OK");
    RAW_CHECK(&s, "POST", "/query_dp_ranks",
              "{\"bootstrap_rooms\": [9007199254740993, 5, 77]}", 200,
              "{\"9007199254740993\":4,\"5\":3}");
    RAW_CHECK(&s, "POST", "/query_dp_ranks", "{\"bootstrap_rooms\": []}", 200,
              "{}");
    kvf_bootstrap_destroy(s.bs);
}

static void test_room_eviction(void)
{
    kvf_registry_state_t *st = kvf__registry_state_create(4);
    char *resp, body[128];
    const char *ctype;

    for (int room = 1; room <= 10; room++) {
        snprintf(body, sizeof(body), "{\"bootstrap_room\":%d,\"dp_rank\":%d}",
                 room, room % 3);
        CHECK_EQ_INT(kvf__registry_handle(st, NULL, "POST", "/register_dp_rank",
                                          NULL, body, strlen(body), &resp,
                                          &ctype), 200);
        free(resp);
    }
    snprintf(body, sizeof(body), "{\"bootstrap_rooms\":[1,6,7,8,9,10]}");
    CHECK_EQ_INT(kvf__registry_handle(st, NULL, "POST", "/query_dp_ranks", NULL,
                                      body, strlen(body), &resp, &ctype), 200);
    CHECK(strcmp(resp, "{\"7\":1,\"8\":2,\"9\":0,\"10\":1}") == 0);
    CHECK(strcmp(ctype, "application/json") == 0);
    free(resp);
    /* Odd inputs straight into the handler. */
    CHECK_EQ_INT(kvf__registry_handle(st, NULL, NULL, NULL, NULL, NULL, 0, &resp,
                                      &ctype), 404);
    free(resp);
    CHECK_EQ_INT(kvf__registry_handle(st, NULL, "GET", "/route", "a=%&b&=&&%zz",
                                      NULL, 0, &resp, &ctype), 400);
    free(resp);
    CHECK_EQ_INT(kvf__registry_handle(st, NULL, "PUT", "/route", NULL, NULL,
                                      KVF_BS_MAX_BODY + 1u, &resp, &ctype),
                 413);
    free(resp);
    kvf__registry_state_destroy(st);

    /* Many rooms through a larger map: growth and eviction together. */
    st = kvf__registry_state_create(3000);
    for (int room = 0; room < 10000; room++) {
        snprintf(body, sizeof(body), "{\"bootstrap_room\":%d,\"dp_rank\":1}",
                 room * 7919);
        kvf__registry_handle(st, NULL, "POST", "/register_dp_rank", NULL, body,
                             strlen(body), &resp, &ctype);
        free(resp);
    }
    snprintf(body, sizeof(body), "{\"bootstrap_rooms\":[%d,%d,%d]}",
             6999 * 7919, 7000 * 7919, 9999 * 7919);
    kvf__registry_handle(st, NULL, "POST", "/query_dp_ranks", NULL, body,
                         strlen(body), &resp, &ctype);
    char want[128];
    snprintf(want, sizeof(want), "{\"%d\":1,\"%d\":1}", 7000 * 7919,
             9999 * 7919);
    CHECK(resp != NULL && strcmp(resp, want) == 0);
    free(resp);
    kvf__registry_handle(st, NULL, "GET", "/metrics", NULL, NULL, 0, &resp, &ctype);
    CHECK_STR_CONTAINS(resp, "kvferry_registry_rooms_tracked 3000\n");
    free(resp);
    kvf__registry_state_destroy(st);
}

static void fake_stats(void *arg, kvf_engine_stats_t *s)
{
    (*(int *)arg)++;
    s->rooms_by_state[KVF_POLL_BOOTSTRAPPING] = 3;
    s->rooms_by_state[KVF_POLL_WAITING_FOR_INPUT] = 2;
    s->rooms_by_state[KVF_POLL_TRANSFERRING] = 1;
    s->rooms_succeeded = 40;
    s->rooms_failed = 2;
    s->failures_room = 1;
    s->failures_peer = 1;
    s->bytes_sent = 123456789;
    s->bytes_received = 7;
    s->peers_connected = 4;
    s->peers_by_path[0] = 1;                      /* kvf_transport_name(0): tcp */
    s->peers_by_path[2] = 3;                      /* shm */
}

static void test_metrics(void)
{
    srv_t s;
    int calls = 0;

    if (srv_start(&s) != 0) {
        CHECK(!"server start");
        return;
    }
    raw_resp_t r = raw(&s, "GET", "/metrics", NULL, 0, 0);
    CHECK_EQ_INT(r.status, 200);
    CHECK_STR_CONTAINS(r.body, "# TYPE kvferry_registry_ranks_registered "
                       "gauge\nkvferry_registry_ranks_registered 0\n");
    CHECK(r.body && strstr(r.body, "kvferry_rooms{") == NULL);
    free(r.body);

    RAW_CHECK(&s, "GET", "/nope", NULL, 404, "");
    kvf__bootstrap_set_stats_cb(s.bs, fake_stats, &calls);
    r = raw(&s, "GET", "/metrics", NULL, 0, 0);
    CHECK_EQ_INT(r.status, 200);
    CHECK_EQ_INT(calls, 1);
    const char *want[] = {
        "# HELP kvferry_registry_requests_total ",
        "# TYPE kvferry_registry_requests_total counter\n",
        "kvferry_registry_requests_total{route=\"/metrics\",method=\"GET\","
        "code=\"200\"} 1\n",
        "kvferry_registry_requests_total{route=\"other\",method=\"GET\","
        "code=\"404\"} 1\n",
        "# TYPE kvferry_rooms gauge\n",
        "kvferry_rooms{state=\"bootstrapping\"} 3\n",
        "kvferry_rooms{state=\"waiting_for_input\"} 2\n",
        "kvferry_rooms{state=\"transferring\"} 1\n",
        "# TYPE kvferry_rooms_total counter\n",
        "kvferry_rooms_total{result=\"success\"} 40\n",
        "kvferry_rooms_total{result=\"failed\"} 2\n",
        "kvferry_bytes_total{direction=\"sent\"} 123456789\n",
        "kvferry_bytes_total{direction=\"received\"} 7\n",
        "kvferry_failures_total{class=\"room\"} 1\n",
        "kvferry_failures_total{class=\"peer\"} 1\n",
        "kvferry_failures_total{class=\"other\"} 0\n",
        "# TYPE kvferry_peers_connected gauge\n",
        "kvferry_peers_connected 4\n",
        "# TYPE kvferry_peers gauge\n",
        "kvferry_peers{transport=\"tcp\"} 1\n",
        "kvferry_peers{transport=\"cuda\"} 0\n",
        "kvferry_peers{transport=\"shm\"} 3\n",
        "kvferry_peers{transport=\"ucx\"} 0\n",
    };
    for (size_t i = 0; i < sizeof(want) / sizeof(want[0]); i++)
        CHECK_STR_CONTAINS(r.body, want[i]);
    free(r.body);

    kvf__bootstrap_set_stats_cb(s.bs, NULL, NULL);
    r = raw(&s, "GET", "/metrics", NULL, 0, 0);
    CHECK(r.body && strstr(r.body, "kvferry_peers_connected") == NULL);
    CHECK_EQ_INT(calls, 1);
    free(r.body);
    kvf_bootstrap_destroy(s.bs);
}

static int free_port(void)
{
    struct sockaddr_in a = {.sin_family = AF_INET};
    socklen_t len = sizeof(a);
    int fd = socket(AF_INET, SOCK_STREAM, 0);

    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (fd < 0 || bind(fd, (struct sockaddr *)&a, sizeof(a)) != 0 ||
        getsockname(fd, (struct sockaddr *)&a, &len) != 0) {
        if (fd >= 0)
            close(fd);
        return -1;
    }
    close(fd);
    return ntohs(a.sin_port);
}

static void test_unreachable(void)
{
    char addr[64], err[512] = "";
    int port = free_port();
    kvf_bs_reg_t r = mkreg(1, 0, 17000);

    CHECK(port > 0);
    snprintf(addr, sizeof(addr), "127.0.0.1:%d", port);
    uint64_t t0 = kvf_now_ms();
    CHECK_EQ_INT(kvf__bs_register(addr, &r, 700, err, sizeof(err)),
                 KVF_ERR_BOOTSTRAP);
    uint64_t dt = kvf_now_ms() - t0;
    CHECK(dt >= 650 && dt < 1700);
    char want[256];
    snprintf(want, sizeof(want), "bootstrap registry %s unreachable: "
             "Couldn't connect to server (PUT /route)", addr);
    CHECK_STR_CONTAINS(err, want);
    CHECK_STR_CONTAINS(err, "attempts in");
    CHECK(strchr(err, '\n') == NULL);

    CHECK_EQ_INT(kvf__bs_health(addr, 500, err, sizeof(err)),
                 KVF_ERR_BOOTSTRAP);
    CHECK_STR_CONTAINS(err, "unreachable");
    CHECK_EQ_INT(kvf__bs_health("nonsense", 500, err, sizeof(err)),
                 KVF_ERR_INVALID_PARAM);
    CHECK_STR_CONTAINS(err, "not host:port");
    CHECK_EQ_INT(kvf__bs_health("127.0.0.1:0", 500, err, sizeof(err)),
                 KVF_ERR_INVALID_PARAM);
}

static int count_fds(void)
{
    int n = 0;
    DIR *d = opendir("/proc/self/fd");
    while (d && readdir(d))
        n++;
    if (d)
        closedir(d);
    return n;
}

static void test_create_errors(void)
{
    kvf_bootstrap_t *a, *b;

    int fds = count_fds();
    CHECK_EQ_INT(kvf_bootstrap_create("127.0.0.1", 0, &a), KVF_OK);
    int port = kvf_bootstrap_port(a);
    CHECK_EQ_INT(kvf_bootstrap_create("127.0.0.1", port, &b), KVF_ERR_IO);
    CHECK_EQ_INT(kvf_bootstrap_create("127.0.0.1", 70000, &b),
                 KVF_ERR_INVALID_PARAM);
    CHECK_EQ_INT(kvf_bootstrap_create("no-such-host.invalid", 0, &b),
                 KVF_ERR_IO);
    kvf_bootstrap_destroy(a);
    kvf_bootstrap_destroy(NULL);
    CHECK_EQ_INT(count_fds(), fds);
}

typedef struct hammer { const char *addr; int id, failures; } hammer_t;

static void *hammer_main(void *arg)
{
    hammer_t *h = arg;
    char err[512];
    for (int i = 0; i < 40; i++) {
        uint64_t room = (uint64_t)h->id * 1000 + (uint64_t)i;
        int dp = -1;
        if (kvf__bs_register_dp_rank(h->addr, room, h->id, TMO, err,
                                     sizeof(err)) != KVF_OK ||
            kvf__bs_query_dp_ranks(h->addr, &room, 1, &dp, TMO, err,
                                   sizeof(err)) != KVF_OK ||
            dp != h->id || kvf__bs_health(h->addr, TMO, err, sizeof(err)))
            h->failures++;
    }
    return NULL;
}

static void test_concurrent_clients(void)
{
    srv_t s;
    pthread_t t[8];
    hammer_t h[8];

    if (srv_start(&s) != 0) {
        CHECK(!"server start");
        return;
    }
    for (int i = 0; i < 8; i++) {
        h[i] = (hammer_t){.addr = s.addr, .id = i};
        pthread_create(&t[i], NULL, hammer_main, &h[i]);
    }
    for (int i = 0; i < 8; i++) {
        pthread_join(t[i], NULL);
        CHECK_EQ_INT(h[i].failures, 0);
    }
    kvf_bootstrap_destroy(s.bs);
}

KVF_TEST_MAIN(KVF_CASE(test_split_addr),
              KVF_CASE(test_health_routes_methods),
              KVF_CASE(test_register_until_ready),
              KVF_CASE(test_route_params),
              KVF_CASE(test_integer_params),
              KVF_CASE(test_bad_bodies),
              KVF_CASE(test_conflict_and_reregister),
              KVF_CASE(test_dp_layouts),
              KVF_CASE(test_registration_fields),
              KVF_CASE(test_dtype_auto),
              KVF_CASE(test_reregistration),
              KVF_CASE(test_sglang_bodies),
              KVF_CASE(test_dp_rooms),
              KVF_CASE(test_room_eviction),
              KVF_CASE(test_metrics),
              KVF_CASE(test_unreachable),
              KVF_CASE(test_create_errors),
              KVF_CASE(test_concurrent_clients))
