/*
 * Bootstrap registry client: the kvf__bs_* calls an engine's resolver
 * thread makes (see bootstrap.h), over libcurl with one easy handle per
 * call, and kvf__split_addr.
 *
 * Every call is bounded by its timeout_ms (connect and transfer both), uses
 * no proxy whatever the environment says, and never raises signals
 * (CURLOPT_NOSIGNAL: engines are multi-threaded).  A failure leaves exactly
 * one line in err, naming the registry, what happened and the request, so
 * a caller can put it into a room's failure reason as it is.
 *
 * The mutating calls carry "Authorization: Bearer <token>" (SGLang's
 * bootstrap_auth_headers()) when a cluster token is given or configured
 * (util/token.h); the token is read per call, which is cheap next to an
 * HTTP exchange and follows a rotated token file.
 */
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <curl/curl.h>
#include <jansson.h>

#include <openssl/crypto.h>

#include "bootstrap/bootstrap.h"
#include "util/log.h"
#include "util/time.h"
#include "util/token.h"

#define BS_BACKOFF_FIRST_MS 50u
#define BS_BACKOFF_MAX_MS   1000u
#define BS_LAST_ATTEMPT_MS  50u     /* what the last attempt is left at least */

static pthread_once_t curl_once = PTHREAD_ONCE_INIT;
static CURLcode curl_init_rc;

static void curl_init(void)
{
    curl_init_rc = curl_global_init(CURL_GLOBAL_DEFAULT);
}

__attribute__((format(printf, 3, 4)))
static void set_err(char *err, size_t errlen, const char *fmt, ...)
{
    va_list ap;

    if (err == NULL || errlen == 0)
        return;
    va_start(ap, fmt);
    vsnprintf(err, errlen, fmt, ap);
    va_end(ap);
    for (char *p = err; *p; p++)
        if (*p == '\n' || *p == '\r' || *p == '\t')
            *p = ' ';
}

kvf_status_t kvf__split_addr(const char *addr, char *host, size_t hostlen,
                             int *port_p)
{
    const char *h, *hend, *p;

    if (addr == NULL || host == NULL || port_p == NULL)
        return KVF_ERR_INVALID_PARAM;
    if (addr[0] == '[') {
        h = addr + 1;
        hend = strchr(h, ']');
        if (hend == NULL || hend[1] != ':')
            return KVF_ERR_INVALID_PARAM;
        p = hend + 2;
    } else {
        h = addr;
        hend = strchr(addr, ':');
        /* A second colon means an IPv6 address without brackets: where its
         * port starts is a guess, so refuse it. */
        if (hend == NULL || strchr(hend + 1, ':') != NULL)
            return KVF_ERR_INVALID_PARAM;
        p = hend + 1;
    }
    size_t hl = (size_t)(hend - h), pl = strlen(p);
    if (hl == 0 || hl >= hostlen || pl == 0 || pl > 5)
        return KVF_ERR_INVALID_PARAM;
    int port = 0;
    for (size_t i = 0; i < pl; i++) {
        if (p[i] < '0' || p[i] > '9')
            return KVF_ERR_INVALID_PARAM;
        port = port * 10 + (p[i] - '0');
    }
    if (port > 65535)
        return KVF_ERR_INVALID_PARAM;
    memcpy(host, h, hl);
    host[hl] = '\0';
    *port_p = port;
    return KVF_OK;
}

/* ------------------------------------------------------------------------ */
/* One HTTP exchange                                                        */
/* ------------------------------------------------------------------------ */

typedef struct bs_resp {
    long   status;
    char  *body;          /* NUL-terminated */
    size_t len, cap;
    int    too_large;
} bs_resp_t;

static size_t on_data(char *p, size_t size, size_t nmemb, void *arg)
{
    bs_resp_t *r = arg;
    size_t n = size * nmemb;

    if (n > KVF_BS_MAX_BODY - r->len) {
        r->too_large = 1;
        return 0;
    }
    if (r->len + n + 1 > r->cap) {
        size_t ncap = r->cap ? r->cap : 1024;
        while (ncap < r->len + n + 1)
            ncap *= 2;
        char *nb = realloc(r->body, ncap);
        if (nb == NULL)
            return 0;
        r->body = nb;
        r->cap = ncap;
    }
    memcpy(r->body + r->len, p, n);
    r->len += n;
    r->body[r->len] = '\0';
    return n;
}

/* The URL of target on the registry at addr, once libcurl is ready:
 * KVF_OK, or KVF_ERR_INVALID_PARAM / KVF_ERR_BOOTSTRAP and err. */
static kvf_status_t bs_url(const char *addr, const char *target, char *url,
                           size_t urllen, char *err, size_t errlen)
{
    char host[256];
    int port;

    if (kvf__split_addr(addr, host, sizeof(host), &port) != KVF_OK ||
        port == 0) {
        set_err(err, errlen, "bootstrap address \"%s\" is not host:port "
                "(port 1..65535; IPv6 as [addr]:port)", addr ? addr : "");
        return KVF_ERR_INVALID_PARAM;
    }
    pthread_once(&curl_once, curl_init);
    if (curl_init_rc != CURLE_OK) {
        set_err(err, errlen, "bootstrap registry %s: libcurl failed to "
                "initialise: %s", addr, curl_easy_strerror(curl_init_rc));
        return KVF_ERR_BOOTSTRAP;
    }
    snprintf(url, urllen, strchr(host, ':') ? "http://[%s]:%d%s"
             : "http://%s:%d%s", host, port, target);
    return KVF_OK;
}

/* Free a request's headers, wiping them first: curl_slist_append copied
 * the Authorization header, token and all, onto the heap. */
static void free_headers(struct curl_slist *hdrs)
{
    for (struct curl_slist *h = hdrs; h != NULL; h = h->next)
        if (h->data != NULL)
            OPENSSL_cleanse(h->data, strlen(h->data));
    curl_slist_free_all(hdrs);
}

/* A JSON body sent with `method`, with the token's Authorization header
 * when there is one: 0, or -1 when out of memory (*hdrs_p, whatever it
 * holds, is the caller's to free). */
static int bs_set_body(CURL *c, struct curl_slist **hdrs_p, const char *method,
                       const char *json, const char *token)
{
    char authz[KVF_TOKEN_MAX + 32];
    struct curl_slist *hdrs;

    hdrs = *hdrs_p = curl_slist_append(NULL, "Content-Type: application/json");
    /* No "Expect: 100-continue" round trip for our small bodies. */
    struct curl_slist *h2 = hdrs ? curl_slist_append(hdrs, "Expect:") : NULL;
    if (h2 == NULL)
        return -1;
    hdrs = *hdrs_p = h2;
    if (token != NULL && token[0] != '\0') {
        snprintf(authz, sizeof(authz), "Authorization: Bearer %s", token);
        h2 = curl_slist_append(hdrs, authz);
        OPENSSL_cleanse(authz, sizeof(authz));
        if (h2 == NULL)
            return -1;
        hdrs = *hdrs_p = h2;
    }
    curl_easy_setopt(c, CURLOPT_HTTPHEADER, hdrs);
    curl_easy_setopt(c, CURLOPT_POSTFIELDS, json);
    curl_easy_setopt(c, CURLOPT_POSTFIELDSIZE, (long)strlen(json));
    curl_easy_setopt(c, CURLOPT_CUSTOMREQUEST, method);
    return 0;
}

/* What curl_easy_perform's rc means for the caller: KVF_OK with the
 * status in resp, or KVF_ERR_BOOTSTRAP and err naming the failure. */
static kvf_status_t bs_result(CURL *c, CURLcode rc, bs_resp_t *resp,
                              const char *addr, const char *method,
                              const char *target, long tmo, const char *cerr,
                              char *err, size_t errlen)
{
    if (rc == CURLE_OK) {
        curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &resp->status);
        return KVF_OK;
    }
    if (resp->too_large)
        set_err(err, errlen, "bootstrap registry %s: answer larger than %u "
                "bytes (%s %s)", addr, KVF_BS_MAX_BODY, method, target);
    else if (rc == CURLE_OPERATION_TIMEDOUT)
        set_err(err, errlen, "bootstrap registry %s did not answer within "
                "%ld ms: %s (%s %s)", addr, tmo, cerr[0] ? cerr
                : curl_easy_strerror(rc), method, target);
    else
        set_err(err, errlen, "bootstrap registry %s unreachable: %s (%s %s)",
                addr, curl_easy_strerror(rc), method, target);
    return KVF_ERR_BOOTSTRAP;
}

/*
 * `method` `target` on the registry at addr, with an optional JSON body.
 * @return KVF_OK with resp->status set (any status: callers judge it), or
 *         KVF_ERR_BOOTSTRAP (no HTTP answer), KVF_ERR_INVALID_PARAM,
 *         KVF_ERR_NO_MEMORY; err says why.
 */
static kvf_status_t bs_http(const char *addr, const char *method,
                            const char *target, const char *json,
                            const char *token, unsigned timeout_ms,
                            bs_resp_t *resp, char *err, size_t errlen)
{
    char url[512], cerr[CURL_ERROR_SIZE] = "";
    struct curl_slist *hdrs = NULL;
    kvf_status_t st;

    memset(resp, 0, sizeof(*resp));
    if ((st = bs_url(addr, target, url, sizeof(url), err, errlen)) != KVF_OK)
        return st;
    CURL *c = curl_easy_init();
    if (c == NULL) {
        set_err(err, errlen, "bootstrap registry %s: out of memory (%s %s)",
                addr, method, target);
        return KVF_ERR_NO_MEMORY;
    }
    long tmo = timeout_ms ? (long)timeout_ms : 1;   /* 0 would mean "none" */
    curl_easy_setopt(c, CURLOPT_URL, url);
    curl_easy_setopt(c, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(c, CURLOPT_NOPROXY, "*");
    curl_easy_setopt(c, CURLOPT_TIMEOUT_MS, tmo);
    curl_easy_setopt(c, CURLOPT_CONNECTTIMEOUT_MS, tmo);
    curl_easy_setopt(c, CURLOPT_ERRORBUFFER, cerr);
    curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, on_data);
    curl_easy_setopt(c, CURLOPT_WRITEDATA, resp);
    if (json != NULL && bs_set_body(c, &hdrs, method, json, token) != 0) {
        st = KVF_ERR_NO_MEMORY;
        set_err(err, errlen, "bootstrap registry %s: out of memory "
                "(%s %s)", addr, method, target);
    } else {
        st = bs_result(c, curl_easy_perform(c), resp, addr, method, target,
                       tmo, cerr, err, errlen);
    }
    curl_easy_cleanup(c);        /* before the headers it points at */
    free_headers(hdrs);
    if (st != KVF_OK) {
        free(resp->body);
        memset(resp, 0, sizeof(*resp));
    }
    return st;
}

/* err for an answer the caller did not expect: status and body's text. */
static void set_http_err(char *err, size_t errlen, const char *addr,
                         const char *method, const char *target,
                         const bs_resp_t *r)
{
    set_err(err, errlen, "bootstrap registry %s answered %ld to %s %s: %.400s",
            addr, r->status, method, target,
            r->body && r->body[0] ? r->body : "(empty body)");
}

/* After a 401/403: say what this process sent, so the reader knows which
 * side to fix. */
static void add_auth_hint(char *err, size_t errlen, const char *from)
{
    if (err == NULL || errlen == 0)
        return;
    size_t n = strlen(err);
    if (from[0] != '\0')
        snprintf(err + n, errlen - n, " [this process sent the token from "
                 "%s]", from);
    else
        snprintf(err + n, errlen - n, " [this process has no cluster token: "
                 "KVF_AUTH_TOKEN, KVF_AUTH_TOKEN_FILE and "
                 "SGLANG_DISAGGREGATION_BOOTSTRAP_AUTH_TOKEN are unset]");
}

/* The token a mutating call sends: `explicit_token` or the configured one.
 * @return KVF_OK (tok may be ""), or the error of a bad token source. */
static kvf_status_t call_token(const char *addr, const char *explicit_token,
                               char *tok, size_t len, const char **from_p,
                               char *err, size_t errlen)
{
    char why[512];
    kvf_status_t st = kvf_token_load_ex(explicit_token, tok, len, from_p, why,
                                        sizeof(why));
    if (st != KVF_OK)
        set_err(err, errlen, "bootstrap registry %s: cannot load the cluster "
                "token: %s", addr ? addr : "", why);
    return st;
}

static json_t *parse_answer(const char *addr, const char *method,
                            const char *target, const bs_resp_t *r,
                            int want_object, char *err, size_t errlen)
{
    json_error_t jerr;
    json_t *j = json_loadb(r->body ? r->body : "", r->len, 0, &jerr);

    if (j == NULL || (want_object && !json_is_object(j))) {
        set_err(err, errlen, "bootstrap registry %s sent a malformed answer "
                "to %s %s: %s", addr, method, target,
                j ? "not a JSON object" : jerr.text);
        json_decref(j);
        return NULL;
    }
    return j;
}

static int get_int(json_t *o, const char *name, int *v_p)
{
    json_t *v = json_object_get(o, name);
    if (!json_is_integer(v) || json_integer_value(v) < INT32_MIN ||
        json_integer_value(v) > INT32_MAX)
        return -1;
    *v_p = (int)json_integer_value(v);
    return 0;
}

/* ------------------------------------------------------------------------ */
/* The calls                                                                */
/* ------------------------------------------------------------------------ */

kvf_status_t kvf__bs_register(const char *addr, const kvf_bs_reg_t *reg,
                              unsigned timeout_ms, char *err, size_t errlen)
{
    return kvf__bs_register_auth(addr, reg, NULL, timeout_ms, err, errlen);
}

/* SGLang's CommonKVManager.register_to_bootstrap() body, key for key
 * and in its order; load_balance_method is left out when NULL (SGLang
 * then assumes "follow_bootstrap_room").  NULL and err when out of memory. */
static char *register_body(const char *addr, const kvf_bs_reg_t *reg,
                           char *err, size_t errlen)
{
    json_t *j = json_pack(
        "{s:i, s:i, s:i, s:i, s:i, s:i, s:i, s:i, s:i, s:i, s:s?, s:i, s:i, "
        "s:s?}",
        "attn_tp_size", reg->attn_tp_size, "attn_tp_rank", reg->attn_tp_rank,
        "attn_cp_size", reg->attn_cp_size, "attn_cp_rank", reg->attn_cp_rank,
        "attn_dp_size", reg->attn_dp_size, "attn_dp_rank", reg->attn_dp_rank,
        "pp_size", reg->pp_size, "pp_rank", reg->pp_rank,
        "system_dp_size", reg->system_dp_size,
        "system_dp_rank", reg->system_dp_rank,
        "rank_ip", reg->rank_ip, "rank_port", reg->rank_port,
        "page_size", reg->page_size, "kv_cache_dtype", reg->kv_cache_dtype);
    if (j != NULL &&
        ((reg->load_balance_method != NULL &&
          json_object_set_new(j, "load_balance_method",
                              json_string(reg->load_balance_method)) != 0) ||
         json_object_set_new(j, "enable_dsa_cache_layer_split",
                             json_boolean(reg->enable_dsa_cache_layer_split))
             != 0 ||
         json_object_set_new(j, "prefill_http_port",
                             reg->prefill_http_port > 0
                                 ? json_integer(reg->prefill_http_port)
                                 : json_null()) != 0 ||
         (reg->decode_allocation_policy != NULL &&
          json_object_set_new(j, "decode_allocation_policy",
                              json_string(reg->decode_allocation_policy))
              != 0))) {
        json_decref(j);
        j = NULL;
    }
    char *body = j ? json_dumps(j, JSON_COMPACT) : NULL;
    json_decref(j);
    if (body == NULL)
        set_err(err, errlen, "bootstrap registry %s: cannot encode the "
                "registration (out of memory)", addr ? addr : "");
    return body;
}

/* One PUT /route with what is left of the deadline: KVF_OK on a 200, else
 * the error (err says why) and *final_p set when asking again cannot
 * help. */
static kvf_status_t register_once(const char *addr, const char *body,
                                  const char *tok, const char *from,
                                  uint64_t deadline, int *final_p, char *err,
                                  size_t errlen)
{
    bs_resp_t r;
    uint64_t now = kvf_now_ms();
    kvf_status_t st = bs_http(addr, "PUT", "/route", body, tok,
                              (unsigned)(deadline > now ? deadline - now : 1),
                              &r, err, errlen);
    *final_p = 0;
    if (st != KVF_OK) {
        *final_p = st != KVF_ERR_BOOTSTRAP;
        return st;
    }
    long code = r.status;
    if (code != 200)
        set_http_err(err, errlen, addr, "PUT", "/route", &r);
    if (code == 401 || code == 403)
        add_auth_hint(err, errlen, from);
    free(r.body);
    if (code == 200)
        return KVF_OK;
    /* The registry refused this registration: asking again cannot
     * change its mind. */
    *final_p = code == 400 || code == 401 || code == 403 || code == 409 ||
               code == 413;
    return KVF_ERR_BOOTSTRAP;
}

/* The nap before the next attempt, doubling *delay_p up to
 * BS_BACKOFF_MAX_MS: 0, or -1 when the deadline leaves no attempt. */
static int register_backoff(uint64_t deadline, unsigned *delay_p,
                            unsigned attempts, const char *err)
{
    /* The last attempt gets BS_LAST_ATTEMPT_MS at least: one started
     * with a millisecond left can only time out, and its "did not
     * answer" would hide why the earlier ones failed. */
    uint64_t now = kvf_now_ms();
    if (now + BS_LAST_ATTEMPT_MS >= deadline)
        return -1;
    uint64_t left = deadline - now - BS_LAST_ATTEMPT_MS;
    uint64_t nap = left < *delay_p ? left : *delay_p;
    kvf_debug("bootstrap register attempt %u failed (%s); retrying in "
              "%llu ms", attempts, err ? err : "", (unsigned long long)nap);
    struct timespec ts = {(time_t)(nap / 1000),
                          (long)(nap % 1000) * 1000000};
    nanosleep(&ts, NULL);
    *delay_p = *delay_p * 2 > BS_BACKOFF_MAX_MS ? BS_BACKOFF_MAX_MS
                                                : *delay_p * 2;
    return 0;
}

kvf_status_t kvf__bs_register_auth(const char *addr, const kvf_bs_reg_t *reg,
                                   const char *token, unsigned timeout_ms,
                                   char *err, size_t errlen)
{
    char tok[KVF_TOKEN_MAX + 1];
    const char *from = "";

    if (reg == NULL) {
        set_err(err, errlen, "bootstrap registration without parameters");
        return KVF_ERR_INVALID_PARAM;
    }
    char *body = register_body(addr, reg, err, errlen);
    if (body == NULL)
        return KVF_ERR_NO_MEMORY;
    kvf_status_t tst = call_token(addr, token, tok, sizeof(tok), &from, err,
                                  errlen);
    if (tst != KVF_OK) {
        free(body);
        return tst;
    }

    uint64_t start = kvf_now_ms(), deadline = start + timeout_ms;
    unsigned delay = BS_BACKOFF_FIRST_MS, attempts = 0;
    kvf_status_t st;
    int final;
    do {
        attempts++;
        st = register_once(addr, body, tok, from, deadline, &final, err,
                           errlen);
    } while (st != KVF_OK && !final &&
             register_backoff(deadline, &delay, attempts, err) == 0);
    free(body);
    OPENSSL_cleanse(tok, sizeof(tok));
    if (st == KVF_ERR_BOOTSTRAP && attempts > 1 && err != NULL && errlen > 0) {
        size_t n = strlen(err);
        snprintf(err + n, errlen - n, " [%u attempts in %llu ms]", attempts,
                 (unsigned long long)(kvf_now_ms() - start));
    }
    return st;
}

kvf_status_t kvf__bs_get_info(const char *addr, unsigned timeout_ms,
                              kvf_bs_info_t *info_p, char *err, size_t errlen)
{
    static const char target[] = "/route?prefill_dp_rank=-1&prefill_cp_rank="
                                 "-1&target_tp_rank=-1&target_pp_rank=-1";
    bs_resp_t r;
    kvf_status_t st = bs_http(addr, "GET", target, NULL, NULL, timeout_ms, &r,
                              err, errlen);
    if (st != KVF_OK)
        return st;
    if (r.status != 200) {
        set_http_err(err, errlen, addr, "GET", target, &r);
        free(r.body);
        return r.status == 503 ? KVF_ERR_AGAIN : KVF_ERR_BOOTSTRAP;
    }
    json_t *j = parse_answer(addr, "GET", target, &r, 1, err, errlen);
    free(r.body);
    if (j == NULL)
        return KVF_ERR_BOOTSTRAP;

    kvf_bs_info_t info;
    memset(&info, 0, sizeof(info));
    /* PrefillServerInfo's fields; those with a default in SGLang's
     * dataclass may be missing (an older server), any may be null but the
     * four sizes.  The six decode-side fields and unknown keys are
     * ignored. */
    json_t *dt = json_object_get(j, "kv_cache_dtype");
    json_t *fb = json_object_get(j, "follow_bootstrap_room");
    json_t *ps = json_object_get(j, "page_size");
    json_t *dsa = json_object_get(j, "enable_dsa_cache_layer_split");
    json_t *hp = json_object_get(j, "prefill_http_port");
    json_t *pol = json_object_get(j, "decode_allocation_policy");
    st = KVF_ERR_BOOTSTRAP;
    if (get_int(j, "attn_tp_size", &info.attn_tp_size) != 0 ||
        get_int(j, "attn_cp_size", &info.attn_cp_size) != 0 ||
        get_int(j, "dp_size", &info.dp_size) != 0 ||
        get_int(j, "pp_size", &info.pp_size) != 0 ||
        (!json_is_null(ps) && get_int(j, "page_size", &info.page_size) != 0) ||
        (dt != NULL && !json_is_null(dt) &&
         (!json_is_string(dt) ||
          json_string_length(dt) >= sizeof(info.kv_cache_dtype))) ||
        (fb != NULL && !json_is_boolean(fb)) ||
        (dsa != NULL && !json_is_null(dsa) && !json_is_boolean(dsa)) ||
        (hp != NULL && !json_is_null(hp) &&
         (get_int(j, "prefill_http_port", &info.prefill_http_port) != 0 ||
          info.prefill_http_port < 1 || info.prefill_http_port > 65535)) ||
        (pol != NULL && !json_is_null(pol) &&
         (!json_is_string(pol) ||
          json_string_length(pol) >= sizeof(info.decode_allocation_policy)))) {
        set_err(err, errlen, "bootstrap registry %s sent parallel info without "
                "the expected fields (GET %s)", addr, target);
    } else {
        if (json_is_string(dt))
            memcpy(info.kv_cache_dtype, json_string_value(dt),
                   json_string_length(dt) + 1);
        if (json_is_string(pol))
            memcpy(info.decode_allocation_policy, json_string_value(pol),
                   json_string_length(pol) + 1);
        info.follow_bootstrap_room = fb == NULL || json_is_true(fb);
        info.enable_dsa_cache_layer_split = json_is_true(dsa);
        *info_p = info;
        st = KVF_OK;
    }
    json_decref(j);
    return st;
}

kvf_status_t kvf__bs_get_rank(const char *addr, int dp_rank, int cp_rank,
                              int tp_rank, int pp_rank, unsigned timeout_ms,
                              char *ip, size_t iplen, int *port_p,
                              char *err, size_t errlen)
{
    char target[160];
    bs_resp_t r;

    snprintf(target, sizeof(target), "/route?prefill_dp_rank=%d&"
             "prefill_cp_rank=%d&target_tp_rank=%d&target_pp_rank=%d",
             dp_rank, cp_rank, tp_rank, pp_rank);
    kvf_status_t st = bs_http(addr, "GET", target, NULL, NULL, timeout_ms, &r,
                              err, errlen);
    if (st != KVF_OK)
        return st;
    if (r.status != 200) {
        set_http_err(err, errlen, addr, "GET", target, &r);
        free(r.body);
        return r.status == 404 ? KVF_ERR_NOT_FOUND
             : r.status == 503 ? KVF_ERR_AGAIN : KVF_ERR_BOOTSTRAP;
    }
    json_t *j = parse_answer(addr, "GET", target, &r, 1, err, errlen);
    free(r.body);
    if (j == NULL)
        return KVF_ERR_BOOTSTRAP;
    json_t *jip = json_object_get(j, "rank_ip");
    int port;
    if (!json_is_string(jip) || json_string_length(jip) == 0 ||
        json_string_length(jip) >= iplen ||
        get_int(j, "rank_port", &port) != 0 || port < 1 || port > 65535) {
        set_err(err, errlen, "bootstrap registry %s sent a rank without a "
                "usable rank_ip/rank_port (GET %s)", addr, target);
        st = KVF_ERR_BOOTSTRAP;
    } else {
        memcpy(ip, json_string_value(jip), json_string_length(jip) + 1);
        *port_p = port;
    }
    json_decref(j);
    return st;
}

/* A call whose only good answer is 200. */
static kvf_status_t bs_expect_200(const char *addr, const char *method,
                                  const char *target, const char *json,
                                  const char *token, const char *token_from,
                                  unsigned timeout_ms, char *err,
                                  size_t errlen)
{
    bs_resp_t r;
    kvf_status_t st = bs_http(addr, method, target, json, token, timeout_ms,
                              &r, err, errlen);
    if (st == KVF_OK && r.status != 200) {
        set_http_err(err, errlen, addr, method, target, &r);
        if (r.status == 401 || r.status == 403)
            add_auth_hint(err, errlen, token_from ? token_from : "");
        st = KVF_ERR_BOOTSTRAP;
    }
    free(r.body);
    return st;
}

kvf_status_t kvf__bs_health(const char *addr, unsigned timeout_ms,
                            char *err, size_t errlen)
{
    return bs_expect_200(addr, "GET", "/health", NULL, NULL, NULL, timeout_ms,
                         err, errlen);
}

/* Rooms above INT64_MAX do not fit a JSON integer in jansson: they travel
 * as decimal strings, which SGLang's int() and our registry both accept. */
static json_t *room_json(uint64_t room)
{
    char s[24];
    if (room <= (uint64_t)INT64_MAX)
        return json_integer((json_int_t)room);
    snprintf(s, sizeof(s), "%llu", (unsigned long long)room);
    return json_string(s);
}

kvf_status_t kvf__bs_register_dp_rank(const char *addr, uint64_t room,
                                      int dp_rank, unsigned timeout_ms,
                                      char *err, size_t errlen)
{
    return kvf__bs_register_dp_rank_auth(addr, room, dp_rank, NULL,
                                         timeout_ms, err, errlen);
}

kvf_status_t kvf__bs_register_dp_rank_auth(const char *addr, uint64_t room,
                                           int dp_rank, const char *token,
                                           unsigned timeout_ms, char *err,
                                           size_t errlen)
{
    char tok[KVF_TOKEN_MAX + 1];
    const char *from = "";
    json_t *j = json_pack("{s:o, s:i}", "bootstrap_room", room_json(room),
                          "dp_rank", dp_rank);
    char *body = j ? json_dumps(j, JSON_COMPACT) : NULL;
    json_decref(j);
    if (body == NULL) {
        set_err(err, errlen, "bootstrap registry %s: out of memory "
                "(POST /register_dp_rank)", addr ? addr : "");
        return KVF_ERR_NO_MEMORY;
    }
    kvf_status_t st = call_token(addr, token, tok, sizeof(tok), &from, err,
                                 errlen);
    if (st == KVF_OK)
        st = bs_expect_200(addr, "POST", "/register_dp_rank", body, tok, from,
                           timeout_ms, err, errlen);
    OPENSSL_cleanse(tok, sizeof(tok));
    free(body);
    return st;
}

kvf_status_t kvf__bs_query_dp_ranks(const char *addr, const uint64_t *rooms,
                                    size_t n, int *dp_ranks_p,
                                    unsigned timeout_ms, char *err,
                                    size_t errlen)
{
    static const char target[] = "/query_dp_ranks";
    json_t *arr = json_array(), *j;
    char *body = NULL;
    bs_resp_t r;

    for (size_t i = 0; arr != NULL && i < n; i++)
        if (json_array_append_new(arr, room_json(rooms[i])) != 0) {
            json_decref(arr);
            arr = NULL;
        }
    j = arr ? json_pack("{s:o}", "bootstrap_rooms", arr) : NULL;
    body = j ? json_dumps(j, JSON_COMPACT) : NULL;
    json_decref(j);
    if (body == NULL) {
        set_err(err, errlen, "bootstrap registry %s: out of memory "
                "(POST %s)", addr ? addr : "", target);
        return KVF_ERR_NO_MEMORY;
    }
    kvf_status_t st = bs_http(addr, "POST", target, body, NULL, timeout_ms, &r,
                              err, errlen);
    free(body);
    if (st != KVF_OK)
        return st;
    if (r.status != 200) {
        set_http_err(err, errlen, addr, "POST", target, &r);
        free(r.body);
        return KVF_ERR_BOOTSTRAP;
    }
    j = parse_answer(addr, "POST", target, &r, 1, err, errlen);
    free(r.body);
    if (j == NULL)
        return KVF_ERR_BOOTSTRAP;
    for (size_t i = 0; i < n; i++) {
        char key[24];
        int dp;
        snprintf(key, sizeof(key), "%llu", (unsigned long long)rooms[i]);
        json_t *v = json_object_get(j, key);
        if (v == NULL || get_int(j, key, &dp) != 0 || dp < 0)
            dp = -1;
        dp_ranks_p[i] = dp;
    }
    json_decref(j);
    return KVF_OK;
}
