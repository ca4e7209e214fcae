/*
 * A metrics endpoint: GET /metrics, and nothing else, from its own
 * libmicrohttpd thread, with the text a callback makes (an engine's
 * kvf_engine_metrics).  The same glue as the registry's, smaller: no
 * body, no query, no writes.
 *
 * It binds like the registry (registry.c): without a cluster token, and
 * unless KVF_AUTH=none, only a loopback address.  The text names no room,
 * reason or token, but a deployment without a token is one that faces
 * this host only, and every listener of it keeps to that.  Scrapes need
 * no token, like the registry's read-only routes.  Connections are few
 * and short-lived (a scraper every few seconds), so they are bounded
 * tightly: a client holding many idle ones holds KVF_SCRAPE_PER_IP.
 */
#include <errno.h>
#include <netdb.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#include <microhttpd.h>

#include "bootstrap/bootstrap.h"
#include "util/log.h"

#define KVF_SCRAPE_CONNS   32u
#define KVF_SCRAPE_PER_IP  8u
#define KVF_SCRAPE_IDLE_S  15u

struct kvf_scrape {
    struct MHD_Daemon *daemon;
    kvf_scrape_cb_t    cb;
    void              *arg;
};

static enum MHD_Result answer(struct MHD_Connection *conn, unsigned status, char *body,
                              const char *ctype)
{
    struct MHD_Response *resp =
        MHD_create_response_from_buffer(strlen(body), body, MHD_RESPMEM_MUST_FREE);
    if (resp == NULL) {
        free(body);
        return MHD_NO;
    }
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, ctype);
    if (status == 405)
        MHD_add_response_header(resp, MHD_HTTP_HEADER_ALLOW, "GET, HEAD");
    enum MHD_Result ret = MHD_queue_response(conn, status, resp);
    MHD_destroy_response(resp);
    return ret;
}

static enum MHD_Result answer_text(struct MHD_Connection *conn, unsigned status,
                                   const char *text)
{
    char *body = strdup(text);
    return body != NULL ? answer(conn, status, body, "text/plain; charset=utf-8") : MHD_NO;
}

static enum MHD_Result on_request(void *cls, struct MHD_Connection *conn, const char *url,
                                  const char *method, const char *version,
                                  const char *upload_data, size_t *upload_data_size,
                                  void **con_cls)
{
    kvf_scrape_t *s = cls;
    static int first_call;

    /* The first call of a request comes with its headers only. */
    if (*con_cls == NULL) {
        *con_cls = &first_call;
        return MHD_YES;
    }
    if (*upload_data_size > 0) {       /* a body we do not read */
        *upload_data_size = 0;
        return MHD_YES;
    }
    if (strcmp(url, "/metrics") != 0)
        return answer_text(conn, 404, "not found: this endpoint serves GET /metrics\n");
    if (strcmp(method, "GET") != 0 && strcmp(method, "HEAD") != 0)
        return answer_text(conn, 405, "method not allowed: GET /metrics\n");
    char *text = NULL;
    if (s->cb(s->arg, &text) != 0 || text == NULL)
        return answer_text(conn, 500, "cannot render the metrics (out of memory)\n");
    return answer(conn, 200, text, "text/plain; version=0.0.4; charset=utf-8");
}

/* Protected mode: may this engine listen on every address of `res`? */
static int allowed(const struct addrinfo *res, const char *host, int port)
{
    for (const struct addrinfo *ai = res; ai != NULL; ai = ai->ai_next) {
        if ((ai->ai_family == AF_INET || ai->ai_family == AF_INET6) &&
            !kvf__bs_loopback(ai->ai_addr)) {
            kvf_error("metrics endpoint: refusing to listen on %s:%d without a cluster "
                      "token: %s is not a loopback address, and an engine without a token "
                      "keeps every listener to this host (protected mode). Set "
                      "KVF_AUTH_TOKEN=<secret> (or KVF_AUTH_TOKEN_FILE=<file>) here and on "
                      "every rank, or listen on 127.0.0.1, or set KVF_AUTH=none to run it "
                      "open anyway", host, port, host);
            return 0;
        }
    }
    return 1;
}

static struct MHD_Daemon *start(kvf_scrape_t *s, const struct addrinfo *ai, int port)
{
    unsigned flags = MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_AUTO;
    if (ai->ai_family == AF_INET6)
        flags |= MHD_USE_IPv6;
    return MHD_start_daemon(flags, (uint16_t)port, NULL, NULL, on_request, s,
                            MHD_OPTION_SOCK_ADDR, ai->ai_addr,
                            MHD_OPTION_CONNECTION_TIMEOUT, KVF_SCRAPE_IDLE_S,
                            MHD_OPTION_CONNECTION_LIMIT, KVF_SCRAPE_CONNS,
                            MHD_OPTION_PER_IP_CONNECTION_LIMIT, KVF_SCRAPE_PER_IP,
                            MHD_OPTION_END);
}

kvf_status_t kvf__scrape_create(const char *addr, int has_token, int open,
                                kvf_scrape_cb_t cb, void *arg, kvf_scrape_t **scrape_p,
                                char *bound, size_t boundlen)
{
    char host[128], portstr[8];
    int port;

    if (kvf__split_addr(addr, host, sizeof(host), &port) != KVF_OK) {
        kvf_error("metrics endpoint: invalid address '%s' (expected host:port, e.g. "
                  "127.0.0.1:9464; port 0 picks a free one)", addr);
        return KVF_ERR_INVALID_PARAM;
    }
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM,
                             .ai_flags = AI_PASSIVE | AI_NUMERICSERV}, *res = NULL;
    snprintf(portstr, sizeof(portstr), "%d", port);
    int rc = getaddrinfo(host, portstr, &hints, &res);
    if (rc != 0) {
        kvf_error("metrics endpoint: cannot resolve host \"%s\": %s", host, gai_strerror(rc));
        return KVF_ERR_IO;
    }
    if (!has_token && !open && !allowed(res, host, port)) {
        freeaddrinfo(res);
        return KVF_ERR_INVALID_PARAM;
    }
    kvf_scrape_t *s = calloc(1, sizeof(*s));
    if (s == NULL) {
        freeaddrinfo(res);
        return KVF_ERR_NO_MEMORY;
    }
    s->cb = cb;
    s->arg = arg;
    for (const struct addrinfo *ai = res; ai != NULL && s->daemon == NULL; ai = ai->ai_next)
        if (ai->ai_family == AF_INET || ai->ai_family == AF_INET6)
            s->daemon = start(s, ai, port);
    freeaddrinfo(res);
    if (s->daemon == NULL) {
        kvf_error("metrics endpoint: cannot listen on %s:%d (port in use? pick another, "
                  "or port 0 for any free one)", host, port);
        free(s);
        return KVF_ERR_IO;
    }
    const union MHD_DaemonInfo *info = MHD_get_daemon_info(s->daemon,
                                                            MHD_DAEMON_INFO_BIND_PORT);
    int real = info != NULL ? (int)info->port : port;
    snprintf(bound, boundlen, strchr(host, ':') ? "[%s]:%d" : "%s:%d", host, real);
    *scrape_p = s;
    return KVF_OK;
}

void kvf__scrape_destroy(kvf_scrape_t *s)
{
    if (s == NULL)
        return;
    MHD_stop_daemon(s->daemon);
    free(s);
}
