/*
 * Bootstrap registry server: libmicrohttpd glue around
 * kvf__registry_handle() (routes.c), and the public kvf_bootstrap_* API.
 *
 * MHD serves every connection from one internal thread (epoll/poll, chosen
 * by MHD_USE_AUTO).  Every request is cheap, so one thread answers /health
 * at once however many other requests come; what could starve it is a
 * shortage of connections, so they are bounded: KVF_BS_MAX_CONNS in all,
 * KVF_BS_MAX_CONNS_PER_IP from one client address (MHD accepts and closes
 * the excess at once), and an idle one is closed after
 * KVF_BS_IDLE_TIMEOUT_S.  One client holding a thousand idle connections
 * thus holds 64 of them, and everyone else is still served.
 *
 * The glue keeps a request's raw query (taken in the URI callback, before
 * MHD splits it), its Authorization header and its client's address in a
 * per-request context (*con_cls, freed in the request-completed callback),
 * and accumulates its body, never more than KVF_BS_MAX_BODY: a declared
 * oversized PUT/POST is answered 413 before its body is read, an
 * undeclared one (chunked) is read and dropped past the limit, then
 * answered 413.
 *
 * kvf_bootstrap_create() reads the cluster token (util/token.h) and
 * refuses to listen beyond loopback without one (protected mode), unless
 * KVF_AUTH=none.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <netdb.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include <microhttpd.h>
#include <openssl/crypto.h>

#include "bootstrap/bootstrap.h"
#include "util/log.h"
#include "util/time.h"
#include "util/token.h"

/* libmicrohttpd's own messages (one per refused connection, say): at most
 * one line per this long, with a count of those left out. */
#define MHD_LOG_EVERY_MS 5000u

struct kvf_bootstrap {
    struct MHD_Daemon    *daemon;
    kvf_registry_state_t *st;
    int                   port;
    const char           *access;      /* "token", "protected" or "open" */
    pthread_mutex_t       log_lock;    /* the MHD log's rate limit */
    uint64_t              log_ms, log_dropped;
    int                   log_any;
};

/* Per-request context (*con_cls), made in the URI callback. */
typedef struct req_ctx {
    char  *query;       /* raw, at most KVF_BS_MAX_QUERY + 1 bytes; or NULL */
    char  *auth;        /* the Authorization header, or NULL */
    char   addr[INET6_ADDRSTRLEN];
    int    loopback;
    int    have_client;
    char  *body;
    size_t len, cap;
    int    too_large;   /* over KVF_BS_MAX_BODY: the rest is discarded */
    int    answered;    /* a response was queued early */
} req_ctx_t;

__attribute__((format(printf, 2, 0)))
static void mhd_log(void *cls, const char *fmt, va_list ap)
{
    kvf_bootstrap_t *bs = cls;
    char msg[512];
    uint64_t now = kvf_now_ms(), dropped = 0;
    int log = 0;

    pthread_mutex_lock(&bs->log_lock);
    if (!bs->log_any || now - bs->log_ms >= MHD_LOG_EVERY_MS) {
        log = 1;
        dropped = bs->log_dropped;
        bs->log_dropped = 0;
        bs->log_ms = now;
        bs->log_any = 1;
    } else {
        bs->log_dropped++;
    }
    pthread_mutex_unlock(&bs->log_lock);
    if (!log)
        return;
    vsnprintf(msg, sizeof(msg), fmt, ap);
    size_t n = strlen(msg);
    while (n > 0 && (msg[n - 1] == '\n' || msg[n - 1] == '\r'))
        msg[--n] = '\0';
    if (dropped)
        kvf_info("bootstrap registry (libmicrohttpd): %s (%llu more messages "
                 "left out)", msg, (unsigned long long)dropped);
    else
        kvf_info("bootstrap registry (libmicrohttpd): %s", msg);
}

int kvf__bs_loopback(const struct sockaddr *sa)
{
    if (sa == NULL)
        return 0;
    if (sa->sa_family == AF_INET) {
        const struct sockaddr_in *a = (const struct sockaddr_in *)sa;
        return (ntohl(a->sin_addr.s_addr) >> 24) == 127;
    }
    if (sa->sa_family == AF_INET6) {
        const struct in6_addr *a = &((const struct sockaddr_in6 *)sa)->sin6_addr;
        return IN6_IS_ADDR_LOOPBACK(a) ||
               (IN6_IS_ADDR_V4MAPPED(a) && a->s6_addr[12] == 127);
    }
    return 0;
}

static void sockaddr_text(const struct sockaddr *sa, char *buf, size_t len)
{
    const void *a = NULL;
    if (sa != NULL && sa->sa_family == AF_INET)
        a = &((const struct sockaddr_in *)sa)->sin_addr;
    else if (sa != NULL && sa->sa_family == AF_INET6)
        a = &((const struct sockaddr_in6 *)sa)->sin6_addr;
    if (a == NULL || inet_ntop(sa->sa_family, a, buf, (socklen_t)len) == NULL)
        snprintf(buf, len, "unknown");
}

/*
 * MHD calls this with the request's URI before it splits the query into
 * arguments, which it stores in the connection's fixed memory pool: a
 * query of a few hundred parameters exhausts the pool, and MHD then closes
 * the connection without an answer.  So the raw query is copied here
 * (routes.c parses it), and when it is over the limits, MHD's copy is cut
 * off at the '?': MHD documents this callback as running "before we modify
 * URI or args", in its own writable read buffer, and parses what is left.
 * The handler then answers 414 or 400 from the copy.
 */
static void *on_uri(void *cls, const char *uri, struct MHD_Connection *conn)
{
    req_ctx_t *rc = calloc(1, sizeof(*rc));
    const char *q = uri ? strchr(uri, '?') : NULL;

    if (q == NULL)
        return rc;
    size_t len = strnlen(q + 1, KVF_BS_MAX_QUERY + 1), params = 1;
    for (size_t i = 0; i < len; i++)
        params += q[1 + i] == '&';
    if (rc != NULL && (rc->query = malloc(len + 1)) != NULL) {
        memcpy(rc->query, q + 1, len);
        rc->query[len] = '\0';
    }
    if (len > KVF_BS_MAX_QUERY || params > KVF_BS_MAX_QUERY_PARAMS ||
        rc == NULL || rc->query == NULL)
        ((char *)q)[1] = '\0';
    return rc;
}

/* Fill the context's view of the client (first call for a request). */
static void take_client(req_ctx_t *rc, struct MHD_Connection *conn)
{
    const union MHD_ConnectionInfo *ci =
        MHD_get_connection_info(conn, MHD_CONNECTION_INFO_CLIENT_ADDRESS);
    const struct sockaddr *sa = ci ? ci->client_addr : NULL;
    const char *auth = MHD_lookup_connection_value(
        conn, MHD_HEADER_KIND, MHD_HTTP_HEADER_AUTHORIZATION);

    rc->loopback = kvf__bs_loopback(sa);
    sockaddr_text(sa, rc->addr, sizeof(rc->addr));
    rc->auth = auth ? strdup(auth) : NULL;
    rc->have_client = 1;
}

static kvf_bs_client_t client_of(const req_ctx_t *rc)
{
    kvf_bs_client_t c = {.authorization = rc->auth, .loopback = rc->loopback,
                         .addr = rc->addr};
    return c;
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
    if (status == 401)
        MHD_add_response_header(resp, MHD_HTTP_HEADER_WWW_AUTHENTICATE,
                                "Bearer realm=\"kvferry bootstrap registry\"");
    enum MHD_Result ret = MHD_queue_response(conn, (unsigned)status, resp);
    MHD_destroy_response(resp);
    return ret;
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

    if (rc == NULL)   /* the URI callback ran out of memory */
        return MHD_NO;
    if (!rc->have_client) {
        take_client(rc, conn);
        /* A declared oversized PUT/POST is refused before its body is
         * read (401/403 first, when its client may not write at all): MHD
         * then skips the body and closes the connection. */
        uint64_t cl;
        if ((strcmp(method, "PUT") == 0 || strcmp(method, "POST") == 0) &&
            parse_content_length(MHD_lookup_connection_value(conn,
                                     MHD_HEADER_KIND,
                                     MHD_HTTP_HEADER_CONTENT_LENGTH),
                                 &cl) == 0 &&
            cl > KVF_BS_MAX_BODY) {
            char *resp;
            const char *ctype;
            kvf_bs_client_t client = client_of(rc);
            int status = kvf__registry_handle(bs->st, &client, method, url,
                                              NULL, NULL,
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

    char *resp;
    const char *ctype;
    kvf_bs_client_t client = client_of(rc);
    int status = kvf__registry_handle(
        bs->st, &client, method, url, rc->query,
        rc->too_large ? NULL : rc->body,
        rc->too_large ? (size_t)KVF_BS_MAX_BODY + 1 : rc->len, &resp, &ctype);
    rc->answered = 1;
    return respond(conn, url, status, resp, ctype);
}

static void on_completed(void *cls, struct MHD_Connection *conn,
                         void **con_cls, enum MHD_RequestTerminationCode toe)
{
    req_ctx_t *rc = *con_cls;
    if (rc != NULL) {
        free(rc->body);
        free(rc->query);
        if (rc->auth != NULL)         /* a bearer token, when the client sent one */
            OPENSSL_cleanse(rc->auth, strlen(rc->auth));
        free(rc->auth);
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

/* The addresses host:port names, for the daemon to bind: KVF_OK and
 * *res_p (caller frees), or KVF_ERR_IO. */
static kvf_status_t resolve_listen(const char *host, int port,
                                   struct addrinfo **res_p)
{
    struct addrinfo hints = {0};
    char portstr[8];

    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
    snprintf(portstr, sizeof(portstr), "%d", port);
    int rc = getaddrinfo(host, portstr, &hints, res_p);
    if (rc != 0) {
        kvf_error("bootstrap registry: cannot resolve host \"%s\": %s", host,
                  gai_strerror(rc));
        return KVF_ERR_IO;
    }
    return KVF_OK;
}

/* Protected mode, as Redis has it: without a token, a registry that
 * others can reach would let anyone point decode servers at their own
 * "prefill rank", so it listens on loopback only.  KVF_OK when every
 * address of res is loopback, else KVF_ERR_INVALID_PARAM. */
static kvf_status_t check_protected(const struct addrinfo *res,
                                    const char *host, int port)
{
    for (const struct addrinfo *ai = res; ai != NULL; ai = ai->ai_next) {
        if ((ai->ai_family == AF_INET || ai->ai_family == AF_INET6) &&
            !kvf__bs_loopback(ai->ai_addr)) {
            kvf_error("bootstrap registry: refusing to listen on %s:%d "
                      "without a cluster token: %s is not a loopback "
                      "address, and anyone who reaches the registry "
                      "could register prefill ranks and send decode "
                      "servers' requests elsewhere. Set KVF_AUTH_TOKEN="
                      "<secret> (or KVF_AUTH_TOKEN_FILE=<file>) here and "
                      "on every rank, or listen on 127.0.0.1, or set "
                      "KVF_AUTH=none to run it open anyway", host, port,
                      host);
            return KVF_ERR_INVALID_PARAM;
        }
    }
    return KVF_OK;
}

/* The registry object and its state, with the access rule set, before
 * anything listens: KVF_OK and *bs_p, or an error with nothing left. */
static kvf_status_t bs_alloc(const char *token, int open,
                             kvf_bootstrap_t **bs_p)
{
    kvf_bootstrap_t *bs = calloc(1, sizeof(*bs));
    if (bs == NULL || (bs->st = kvf__registry_state_create(0)) == NULL) {
        free(bs);
        kvf_error("bootstrap registry: out of memory");
        return KVF_ERR_NO_MEMORY;
    }
    pthread_mutex_init(&bs->log_lock, NULL);
    if (kvf__registry_set_auth(bs->st, token, open) != KVF_OK) {
        kvf__registry_state_destroy(bs->st);
        pthread_mutex_destroy(&bs->log_lock);
        free(bs);
        return KVF_ERR_INVALID_PARAM;
    }
    *bs_p = bs;
    return KVF_OK;
}

/* MHD's daemon on the first IPv4/IPv6 address of res it can bind; when
 * none starts, bs->daemon stays NULL and the last bind's errno (0: MHD
 * failed for another reason) is returned, for the log. */
static int start_daemon(kvf_bootstrap_t *bs, const struct addrinfo *res,
                        int port)
{
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
            MHD_OPTION_EXTERNAL_LOGGER, mhd_log, bs,
            MHD_OPTION_SOCK_ADDR, ai->ai_addr,
            MHD_OPTION_URI_LOG_CALLBACK, on_uri, NULL,
            MHD_OPTION_NOTIFY_COMPLETED, on_completed, NULL,
            MHD_OPTION_CONNECTION_TIMEOUT, (unsigned)KVF_BS_IDLE_TIMEOUT_S,
            MHD_OPTION_CONNECTION_LIMIT, (unsigned)KVF_BS_MAX_CONNS,
            MHD_OPTION_PER_IP_CONNECTION_LIMIT,
            (unsigned)KVF_BS_MAX_CONNS_PER_IP,
            MHD_OPTION_END);
        if (bs->daemon == NULL)
            err = bind_errno(ai);
    }
    return err;
}

/* The one way in: with the access rule already decided. */
static kvf_status_t create(const char *host, int port, const char *token,
                           const char *token_from, int open,
                           kvf_bootstrap_t **bootstrap_p)
{
    struct addrinfo *res = NULL;
    kvf_status_t st;

    if (host == NULL || bootstrap_p == NULL || port < 0 || port > 65535) {
        kvf_error("kvf_bootstrap_create: need a host, a port in 0..65535 "
                  "and bootstrap_p (got host=%s port=%d)",
                  host ? host : "NULL", port);
        return KVF_ERR_INVALID_PARAM;
    }
    int have_token = token != NULL && token[0] != '\0';
    if (have_token && open) {
        kvf_warn("bootstrap registry: KVF_AUTH=none is ignored: a cluster "
                 "token is configured (%s), and it is required", token_from);
        open = 0;
    }
    if ((st = resolve_listen(host, port, &res)) != KVF_OK)
        return st;
    if (!have_token && !open &&
        (st = check_protected(res, host, port)) != KVF_OK) {
        freeaddrinfo(res);
        return st;
    }

    kvf_bootstrap_t *bs;
    if ((st = bs_alloc(token, open, &bs)) != KVF_OK) {
        freeaddrinfo(res);
        return st;
    }
    bs->access = have_token ? "token" : open ? "open" : "protected";
    int err = start_daemon(bs, res, port);
    freeaddrinfo(res);
    if (bs->daemon == NULL) {
        kvf_error("bootstrap registry: cannot listen on %s:%d: %s", host,
                  port, err ? strerror(err) : "libmicrohttpd failed to start");
        kvf__registry_state_destroy(bs->st);
        pthread_mutex_destroy(&bs->log_lock);
        free(bs);
        return KVF_ERR_IO;
    }
    const union MHD_DaemonInfo *info =
        MHD_get_daemon_info(bs->daemon, MHD_DAEMON_INFO_BIND_PORT);
    bs->port = info ? (int)info->port : port;
    if (open)
        kvf_warn("bootstrap registry on %s:%d runs OPEN (KVF_AUTH=none): "
                 "anyone who can reach it can register prefill ranks and "
                 "redirect decode servers; set KVF_AUTH_TOKEN instead",
                 host, bs->port);
    kvf_info("bootstrap registry listening on %s:%d (writes: %s)", host,
             bs->port, have_token ? "need the cluster token" : open
             ? "open to anyone" : "loopback clients only");
    *bootstrap_p = bs;
    return KVF_OK;
}

kvf_status_t kvf_bootstrap_create(const char *host, int port,
                                  kvf_bootstrap_t **bootstrap_p)
{
    return kvf_bootstrap_create_keyed(host, port, NULL, bootstrap_p);
}

kvf_status_t kvf_bootstrap_create_keyed(const char *host, int port,
                                        const char *api_key,
                                        kvf_bootstrap_t **bootstrap_p)
{
    char token[KVF_TOKEN_MAX + 1], err[512];
    const char *from = "";
    kvf_status_t st = kvf_token_resolve(NULL, api_key, token, sizeof(token),
                                        &from, err, sizeof(err));
    if (st != KVF_OK) {
        kvf_error("bootstrap registry: %s", err);
        return KVF_ERR_INVALID_PARAM;
    }
    st = create(host, port, token, from, token[0] ? 0 : kvf_auth_open(),
                bootstrap_p);
    /* The stack copy of the secret is not left behind. */
    OPENSSL_cleanse(token, sizeof(token));
    return st;
}

kvf_status_t kvf__bootstrap_create_auth(const char *host, int port,
                                        const char *token, int open,
                                        kvf_bootstrap_t **bootstrap_p)
{
    return create(host, port, token, "the explicit value", open,
                  bootstrap_p);
}

kvf_registry_state_t *kvf__bootstrap_state(kvf_bootstrap_t *bs)
{
    return bs->st;
}

const char *kvf_bootstrap_access(const kvf_bootstrap_t *bootstrap)
{
    return bootstrap ? bootstrap->access : "";
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
    pthread_mutex_destroy(&bootstrap->log_lock);
    free(bootstrap);
}

void kvf__bootstrap_set_stats_cb(kvf_bootstrap_t *bs, kvf_bs_stats_cb_t cb,
                                 void *arg)
{
    kvf__registry_set_stats_cb(bs->st, cb, arg);
}
