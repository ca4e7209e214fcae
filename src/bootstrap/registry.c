/*
 * Bootstrap registry server: libmicrohttpd glue around
 * kvf__registry_handle() (routes.c), and the public kvf_bootstrap_* API.
 *
 * MHD serves every connection from one internal thread (epoll/poll, chosen
 * by MHD_USE_AUTO).  The glue only accumulates a request's body in its
 * per-request context (*con_cls, freed in the request-completed callback),
 * never more than KVF_BS_MAX_BODY: a declared oversized PUT/POST is
 * answered 413 before its body is read, an undeclared one (chunked) is
 * read and dropped past the limit, then answered 413.
 */
#include <errno.h>
#include <netdb.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include <microhttpd.h>

#include "bootstrap/bootstrap.h"
#include "util/log.h"

struct kvf_bootstrap {
    struct MHD_Daemon    *daemon;
    kvf_registry_state_t *st;
    int                   port;
};

/* Per-request context (*con_cls): the body so far. */
typedef struct req_ctx {
    char  *body;
    size_t len, cap;
    int    too_large;   /* over KVF_BS_MAX_BODY: the rest is discarded */
    int    answered;    /* a response was queued early */
} req_ctx_t;

__attribute__((format(printf, 2, 0)))
static void mhd_log(void *cls, const char *fmt, va_list ap)
{
    char msg[512];
    vsnprintf(msg, sizeof(msg), fmt, ap);
    size_t n = strlen(msg);
    while (n > 0 && (msg[n - 1] == '\n' || msg[n - 1] == '\r'))
        msg[--n] = '\0';
    kvf_info("bootstrap registry (libmicrohttpd): %s", msg);
}

static enum MHD_Result respond(struct MHD_Connection *conn, const char *url,
                               int status, char *body, const char *ctype)
{
    struct MHD_Response *resp =
        body ? MHD_create_response_from_buffer(strlen(body), body,
                                               MHD_RESPMEM_MUST_FREE)
             : MHD_create_response_from_buffer(0, (void *)"",
                                               MHD_RESPMEM_PERSISTENT);
    if (resp == NULL) {
        free(body);
        return MHD_NO;
    }
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, ctype);
    if (status == 405 && kvf__registry_allowed(url) != NULL)
        MHD_add_response_header(resp, MHD_HTTP_HEADER_ALLOW,
                                kvf__registry_allowed(url));
    enum MHD_Result ret = MHD_queue_response(conn, (unsigned)status, resp);
    MHD_destroy_response(resp);
    return ret;
}

static void put_escaped(FILE *f, const char *s)
{
    for (; *s; s++) {
        unsigned char c = (unsigned char)*s;
        if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
            (c >= '0' && c <= '9') || c == '-' || c == '_' || c == '.' ||
            c == '~')
            fputc(c, f);
        else
            fprintf(f, "%%%02X", c);
    }
}

/* MHD has already split and decoded the query: re-encode it so that the
 * handler sees one raw query string whoever calls it. */
static enum MHD_Result collect_arg(void *cls, enum MHD_ValueKind kind,
                                   const char *key, const char *value)
{
    FILE *f = cls;
    if (ftell(f) > 0)
        fputc('&', f);
    put_escaped(f, key ? key : "");
    if (value != NULL) {
        fputc('=', f);
        put_escaped(f, value);
    }
    return MHD_YES;
}

static int parse_content_length(const char *s, uint64_t *v_p)
{
    uint64_t v = 0;
    if (s == NULL || *s == '\0')
        return -1;
    for (; *s; s++) {
        if (*s < '0' || *s > '9' || v > UINT64_MAX / 10 - 1)
            return -1;
        v = v * 10 + (uint64_t)(*s - '0');
    }
    *v_p = v;
    return 0;
}

static enum MHD_Result on_request(void *cls, struct MHD_Connection *conn,
                                  const char *url, const char *method,
                                  const char *version,
                                  const char *upload_data,
                                  size_t *upload_data_size, void **con_cls)
{
    kvf_bootstrap_t *bs = cls;
    req_ctx_t *rc = *con_cls;

    if (rc == NULL) {
        rc = calloc(1, sizeof(*rc));
        if (rc == NULL)
            return MHD_NO;
        *con_cls = rc;
        /* A declared oversized PUT/POST is refused before its body is
         * read: MHD then skips the body and closes the connection. */
        uint64_t cl;
        if ((strcmp(method, "PUT") == 0 || strcmp(method, "POST") == 0) &&
            parse_content_length(MHD_lookup_connection_value(conn,
                                     MHD_HEADER_KIND,
                                     MHD_HTTP_HEADER_CONTENT_LENGTH),
                                 &cl) == 0 &&
            cl > KVF_BS_MAX_BODY) {
            char *resp;
            const char *ctype;
            int status = kvf__registry_handle(bs->st, method, url, NULL, NULL,
                                              (size_t)KVF_BS_MAX_BODY + 1,
                                              &resp, &ctype);
            rc->answered = 1;
            return respond(conn, url, status, resp, ctype);
        }
        return MHD_YES;
    }

    if (*upload_data_size > 0) {
        size_t n = *upload_data_size;
        *upload_data_size = 0;
        if (rc->answered || rc->too_large)
            return MHD_YES;
        if (n > KVF_BS_MAX_BODY - rc->len) {
            rc->too_large = 1;
            free(rc->body);
            rc->body = NULL;
            rc->len = rc->cap = 0;
            return MHD_YES;
        }
        if (rc->len + n + 1 > rc->cap) {
            size_t ncap = rc->cap ? rc->cap : 4096;
            while (ncap < rc->len + n + 1)
                ncap *= 2;
            if (ncap > (size_t)KVF_BS_MAX_BODY + 1)
                ncap = (size_t)KVF_BS_MAX_BODY + 1;
            char *nb = realloc(rc->body, ncap);
            if (nb == NULL)
                return MHD_NO;
            rc->body = nb;
            rc->cap = ncap;
        }
        memcpy(rc->body + rc->len, upload_data, n);
        rc->len += n;
        return MHD_YES;
    }
    if (rc->answered)
        return MHD_YES;

    char *query = NULL;
    size_t qlen = 0;
    FILE *qf = open_memstream(&query, &qlen);
    if (qf == NULL)
        return MHD_NO;
    MHD_get_connection_values(conn, MHD_GET_ARGUMENT_KIND, collect_arg, qf);
    if (fclose(qf) != 0) {
        free(query);
        return MHD_NO;
    }

    char *resp;
    const char *ctype;
    int status = kvf__registry_handle(
        bs->st, method, url, query, rc->too_large ? NULL : rc->body,
        rc->too_large ? (size_t)KVF_BS_MAX_BODY + 1 : rc->len, &resp, &ctype);
    free(query);
    rc->answered = 1;
    return respond(conn, url, status, resp, ctype);
}

static void on_completed(void *cls, struct MHD_Connection *conn,
                         void **con_cls, enum MHD_RequestTerminationCode toe)
{
    req_ctx_t *rc = *con_cls;
    if (rc != NULL) {
        free(rc->body);
        free(rc);
        *con_cls = NULL;
    }
}

/* After MHD failed to start, find out why binding fails, for the log. */
static int bind_errno(const struct addrinfo *ai)
{
    int fd = socket(ai->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
    int one = 1, err = 0;
    if (fd < 0)
        return errno;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (bind(fd, ai->ai_addr, ai->ai_addrlen) != 0 || listen(fd, 1) != 0)
        err = errno;
    close(fd);
    return err;
}

kvf_status_t kvf_bootstrap_create(const char *host, int port,
                                  kvf_bootstrap_t **bootstrap_p)
{
    struct addrinfo hints = {0}, *res = NULL;
    char portstr[8];
    int rc;

    if (host == NULL || bootstrap_p == NULL || port < 0 || port > 65535) {
        kvf_error("kvf_bootstrap_create: need a host, a port in 0..65535 "
                  "and bootstrap_p (got host=%s port=%d)",
                  host ? host : "NULL", port);
        return KVF_ERR_INVALID_PARAM;
    }
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
    snprintf(portstr, sizeof(portstr), "%d", port);
    rc = getaddrinfo(host, portstr, &hints, &res);
    if (rc != 0) {
        kvf_error("bootstrap registry: cannot resolve host \"%s\": %s", host,
                  gai_strerror(rc));
        return KVF_ERR_IO;
    }

    kvf_bootstrap_t *bs = calloc(1, sizeof(*bs));
    if (bs == NULL || (bs->st = kvf__registry_state_create(0)) == NULL) {
        free(bs);
        freeaddrinfo(res);
        kvf_error("bootstrap registry: out of memory");
        return KVF_ERR_NO_MEMORY;
    }
    int err = 0;
    for (const struct addrinfo *ai = res; ai != NULL && bs->daemon == NULL;
         ai = ai->ai_next) {
        unsigned flags = MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_AUTO |
                         MHD_USE_ERROR_LOG;
        if (ai->ai_family == AF_INET6)
            flags |= MHD_USE_IPv6;
        else if (ai->ai_family != AF_INET)
            continue;
        bs->daemon = MHD_start_daemon(
            flags, (uint16_t)port, NULL, NULL, on_request, bs,
            MHD_OPTION_EXTERNAL_LOGGER, mhd_log, NULL,
            MHD_OPTION_SOCK_ADDR, ai->ai_addr,
            MHD_OPTION_NOTIFY_COMPLETED, on_completed, NULL,
            MHD_OPTION_CONNECTION_TIMEOUT, (unsigned)30,
            MHD_OPTION_END);
        if (bs->daemon == NULL)
            err = bind_errno(ai);
    }
    freeaddrinfo(res);
    if (bs->daemon == NULL) {
        kvf_error("bootstrap registry: cannot listen on %s:%d: %s", host,
                  port, err ? strerror(err) : "libmicrohttpd failed to start");
        kvf__registry_state_destroy(bs->st);
        free(bs);
        return KVF_ERR_IO;
    }
    const union MHD_DaemonInfo *info =
        MHD_get_daemon_info(bs->daemon, MHD_DAEMON_INFO_BIND_PORT);
    bs->port = info ? (int)info->port : port;
    kvf_info("bootstrap registry listening on %s:%d", host, bs->port);
    *bootstrap_p = bs;
    return KVF_OK;
}

int kvf_bootstrap_port(const kvf_bootstrap_t *bootstrap)
{
    return bootstrap ? bootstrap->port : -1;
}

void kvf_bootstrap_destroy(kvf_bootstrap_t *bootstrap)
{
    if (bootstrap == NULL)
        return;
    MHD_stop_daemon(bootstrap->daemon);
    kvf__registry_state_destroy(bootstrap->st);
    free(bootstrap);
}

void kvf__bootstrap_set_stats_cb(kvf_bootstrap_t *bs, kvf_bs_stats_cb_t cb,
                                 void *arg)
{
    kvf__registry_set_stats_cb(bs->st, cb, arg);
}
