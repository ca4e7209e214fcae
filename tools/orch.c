/*
 * The orchestrator of `kvferry demo` and `kvferry bench` (see orch.h).
 *
 * It never links a rank's memory or engine: all it knows comes from the
 * ranks' event lines on their stdout pipes, and all it can do is write
 * commands to their stdin and send them signals.  That keeps a verdict
 * honest (a rank that dies loses nothing already reported) and is the hook
 * for fault injection: a `--fault KIND@WHEN` handler watches "phase" events
 * and acts on the child table.  Every exit path kills and reaps every
 * child, and children die with us anyway (PR_SET_PDEATHSIG).
 */
#include "orch.h"

#include <errno.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include "tool.h"
#include "util/token.h"

#define KVT_REGISTRY_START_MS 10000   /* registry must print its port */
#define KVT_REGISTRY_WAIT_MS  15000   /* prefill ranks must show up in it */
#define KVT_STOP_GRACE_MS     2000

void kvt_orch_error(kvt_orch_t *d, const char *fmt, ...)
{
    if (d->error[0])
        return;   /* the first error is the cause; later ones follow from it */
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(d->error, sizeof(d->error), fmt, ap);
    va_end(ap);
    fprintf(stderr, "kvferry %s: %s\n", d->cmd, d->error);
}

void kvt_orch_send_ranks(kvt_orch_t *d, const char *line)
{
    for (size_t i = 0; i < d->kids.n; i++)
        if (d->kids.v[i].role != KVT_CHILD_REGISTRY)
            kvt_child_send(&d->kids.v[i], line);
}

/* ------------------------------------------------------------------------ */
/* Events from children                                                     */
/* ------------------------------------------------------------------------ */

/* Note what the start sequence needs, then hand the event on. */
static void kvt_orch_on_event(kvt_orch_t *d, kvt_child_t *c, json_t *ev)
{
    const char *type = json_string_value(json_object_get(ev, "event"));
    if (!type)
        return;
    /* The engines report their transport when ready (the preference) and
     * with their result (what their peers actually used): the last wins. */
    const char *t = json_string_value(json_object_get(ev, "transport"));
    if (t != NULL && (strcmp(type, "ready") == 0 || strcmp(type, "result") == 0))
        snprintf(d->transport, sizeof(d->transport), "%s", t);
    if (strcmp(type, "ready") == 0) {
        c->ready = 1;
    } else if (strcmp(type, "result") == 0) {
        c->finished = 1;
    } else if (strcmp(type, "error") == 0) {
        kvt_orch_error(d, "%s: %s", c->name,
                       json_string_value(json_object_get(ev, "message")));
    }
    if (d->on_event)
        d->on_event(d->ctx, c, type, ev);
}

static void kvt_orch_on_line(void *ctx, kvt_child_t *c, char *line)
{
    kvt_orch_t *d = ctx;
    if (c->role == KVT_CHILD_REGISTRY) {
        /* "kvferry bootstrap registry listening on HOST:PORT" */
        const char *p = strstr(line, "listening on ");
        if (p && !d->registry_addr[0])
            snprintf(d->registry_addr, sizeof(d->registry_addr), "%s",
                     p + strlen("listening on "));
        return;
    }
    json_error_t err;
    json_t *ev = json_loads(line, 0, &err);
    if (!json_is_object(ev)) {
        fprintf(stderr, "kvferry %s: %s printed a line that is not a JSON "
                "event (%s): %.200s\n", d->cmd, c->name, err.text, line);
        json_decref(ev);
        return;
    }
    kvt_orch_on_event(d, c, ev);
    json_decref(ev);
}

/* ------------------------------------------------------------------------ */
/* Registry                                                                 */
/* ------------------------------------------------------------------------ */

/*
 * One HTTP GET with a short timeout; the body (what fits) goes to `body`
 * when it is not NULL.  @return the status code, or -1 when the registry
 * cannot be reached.  A raw socket is enough for the registry's short
 * answers, and keeps the tool on kvferry's public API alone.
 */
static int kvt_http_get(const char *host, const char *port, const char *path,
                        char *body, size_t body_len)
{
    struct addrinfo hints = { .ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM };
    struct addrinfo *ai = NULL;
    if (getaddrinfo(host, port, &hints, &ai) != 0)
        return -1;
    int fd = socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, 0);
    int code = -1;
    struct timeval tv = { 1, 0 };
    if (fd >= 0 && setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv)) == 0 &&
        setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv)) == 0 &&
        connect(fd, ai->ai_addr, ai->ai_addrlen) == 0) {
        char req[512], resp[2048];
        int n = snprintf(req, sizeof(req), "GET %s HTTP/1.0\r\nHost: %s:%s\r\n"
                         "Connection: close\r\n\r\n", path, host, port);
        size_t got = 0;
        ssize_t k = 0;
        if (send(fd, req, (size_t)n, MSG_NOSIGNAL) == n)
            while (got < sizeof(resp) - 1 &&
                   (k = recv(fd, resp + got, sizeof(resp) - 1 - got, 0)) > 0)
                got += (size_t)k;
        resp[got] = '\0';
        if (got == 0 || sscanf(resp, "HTTP/%*d.%*d %d", &code) != 1)
            code = -1;
        const char *b = strstr(resp, "\r\n\r\n");
        if (body && body_len)
            snprintf(body, body_len, "%s", b ? b + 4 : "");
    }
    if (fd >= 0)
        close(fd);
    freeaddrinfo(ai);
    return code;
}

int kvt_orch_http_get(kvt_orch_t *d, const char *path, char *body,
                      size_t len)
{
    char host[64], *colon;
    snprintf(host, sizeof(host), "%s", d->registry_addr);
    if (!(colon = strrchr(host, ':')))
        return -1;
    *colon = '\0';
    return kvt_http_get(host, colon + 1, path, body, len);
}

int kvt_orch_registry_complete(kvt_orch_t *d)
{
    int code = kvt_orch_http_get(d, "/route?prefill_dp_rank=-1&prefill_cp_rank=-1"
                                 "&target_tp_rank=-1&target_pp_rank=-1", NULL, 0);
    if (code == 200)
        return 1;
    if (code == 503 || code == -1)
        return 0;
    fprintf(stderr, "kvferry %s: registry %s answered GET /route with HTTP "
            "%d (expected 200 or 503); starting the rooms anyway\n",
            d->cmd, d->registry_addr, code);
    return -1;
}

/*
 * Every process of the run holds one cluster token, which the registry asks
 * of every registration and engines ask of each other: one from the
 * environment is kept (the children inherit it), else a fresh random one
 * goes into KVF_AUTH_TOKEN before the first child starts.  KVF_AUTH=none
 * runs without one.
 */
static int kvt_orch_token(kvt_orch_t *d)
{
    static const char *const vars[] = {
        "KVF_AUTH_TOKEN", "KVF_AUTH_TOKEN_FILE",
        "SGLANG_DISAGGREGATION_BOOTSTRAP_AUTH_TOKEN"};
    for (size_t i = 0; i < sizeof(vars) / sizeof(vars[0]); i++) {
        const char *v = getenv(vars[i]);
        if (v != NULL && v[0] != '\0') {
            snprintf(d->registry_auth, sizeof(d->registry_auth),
                     "cluster token from %s (registry writes, engine handshakes)", vars[i]);
            return 0;
        }
    }
    const char *mode = getenv("KVF_AUTH");
    if (mode != NULL && strcmp(mode, "none") == 0) {
        snprintf(d->registry_auth, sizeof(d->registry_auth),
                 "open to any registration (KVF_AUTH=none)");
        return 0;
    }
    unsigned char r[24];
    char hex[2 * sizeof(r) + 1];
    if (getrandom(r, sizeof(r), 0) != (ssize_t)sizeof(r)) {
        kvt_orch_error(d, "cannot draw a cluster token for the run: %s",
                       strerror(errno));
        return -1;
    }
    for (size_t i = 0; i < sizeof(r); i++)
        snprintf(hex + 2 * i, 3, "%02x", r[i]);
    if (setenv("KVF_AUTH_TOKEN", hex, 1) != 0) {
        kvt_orch_error(d, "cannot set KVF_AUTH_TOKEN: %s", strerror(errno));
        return -1;
    }
    snprintf(d->registry_auth, sizeof(d->registry_auth),
             "cluster token generated for this run (registry writes, engine "
             "handshakes)");
    return 0;
}

/* Start the registry on `port` ("0": any) and wait for the line with its
 * address. */
static int kvt_start_registry(kvt_orch_t *d, const char *port)
{
    /* --quiet: the run's own lines say what the registry would (its
     * address and access rule), and its stop is ours. */
    char *argv[] = { d->exe, "bootstrap", "--host", "127.0.0.1", "--port",
                     (char *)port, "--quiet", NULL };
    d->registry = kvt_children_add(&d->kids, KVT_CHILD_REGISTRY, 0);
    if (!d->registry || kvt_child_spawn(d->registry, d->exe, argv) != 0) {
        kvt_orch_error(d, "cannot start the registry process");
        return -1;
    }
    uint64_t until = kvt_mono_ms() + KVT_REGISTRY_START_MS;
    while (!d->registry_addr[0]) {
        struct pollfd p[2] = { { d->registry->out_fd, POLLIN, 0 },
                               { d->sfd, POLLIN, 0 } };
        uint64_t now = kvt_mono_ms();
        if (now >= until) {
            kvt_orch_error(d, "the registry did not report its port within "
                           "%d s; see its log above", KVT_REGISTRY_START_MS / 1000);
            return -1;
        }
        if (poll(p, 2, (int)(until - now)) < 0 && errno != EINTR)
            return -1;
        if (p[1].revents) {
            struct signalfd_siginfo si;
            kvt_children_reap(&d->kids);   /* this may be the only SIGCHLD */
            if (read(d->sfd, &si, sizeof(si)) == sizeof(si) &&
                si.ssi_signo != SIGCHLD) {
                d->signal = (int)si.ssi_signo;
                return -1;
            }
        }
        if (p[0].revents && kvt_child_read(d->registry, kvt_orch_on_line, d) <= 0
            && !d->registry_addr[0]) {
            kvt_orch_error(d, "the registry exited before it listened; see "
                           "its log above (is kvf_bootstrap_create working?)");
            return -1;
        }
    }
    return 0;
}

/*
 * A free port for the registry outside the kernel's ephemeral range
 * (net.ipv4.ip_local_port_range), or "0".  The registry is restarted on
 * the same port after a registry-down fault, and meanwhile the ranks'
 * connection attempts each take an ephemeral local port: one of them
 * could take the registry's, and the restart would find it in use.
 */
static void kvt_registry_port(char *buf, size_t len)
{
    unsigned lo = 32768, hi = 60999;
    FILE *f = fopen("/proc/sys/net/ipv4/ip_local_port_range", "r");
    if (f != NULL) {
        if (fscanf(f, "%u %u", &lo, &hi) != 2)
            lo = 32768;
        fclose(f);
    }
    snprintf(buf, len, "0");
    if (lo <= 11024)
        return;   /* no room below the range: let the kernel choose */
    for (int tries = 0; tries < 64; tries++) {
        uint16_t r;
        if (getrandom(&r, sizeof(r), 0) != (ssize_t)sizeof(r))
            return;
        unsigned port = 10000 + r % (lo - 11024);
        struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port),
                                 .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
        int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0), one = 1;
        if (fd < 0)
            return;
        setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
        int ok = bind(fd, (struct sockaddr *)&sa, sizeof(sa)) == 0;
        close(fd);
        if (ok) {
            snprintf(buf, len, "%u", port);
            return;
        }
    }
}

int kvt_orch_restart_registry(kvt_orch_t *d)
{
    const char *colon = strrchr(d->registry_addr, ':');
    char port[16];
    snprintf(port, sizeof(port), "%s", colon ? colon + 1 : "0");
    /* The same port: ranks and receivers know the registry by address.
     * Keep the address until the new one prints its line (the same). */
    char keep[sizeof(d->registry_addr)];
    snprintf(keep, sizeof(keep), "%s", d->registry_addr);
    d->registry_addr[0] = '\0';
    int rc = kvt_start_registry(d, port);
    if (!d->registry_addr[0])
        snprintf(d->registry_addr, sizeof(d->registry_addr), "%s", keep);
    return rc;
}

/* ------------------------------------------------------------------------ */
/* Ranks                                                                    */
/* ------------------------------------------------------------------------ */

kvt_child_t *kvt_orch_start_rank(kvt_orch_t *d, kvt_child_role_t role,
                                 uint32_t rank, char *const *extra)
{
    char **fwd = d->fwd;
    char rank_s[16];
    snprintf(rank_s, sizeof(rank_s), "%u", rank);
    char *head[] = { d->exe, "_rank", "--role",
                     role == KVT_CHILD_PREFILL ? "prefill" : "decode",
                     "--rank", rank_s, "--registry", d->registry_addr };
    size_t nh = sizeof(head) / sizeof(head[0]), nf = 0, ne = 0;
    while (fwd[nf])
        nf++;
    while (extra && extra[ne])
        ne++;
    char **argv = calloc(nh + nf + ne + 1, sizeof(*argv));
    kvt_child_t *c = kvt_children_add(&d->kids, role, rank);
    if (!argv || !c) {
        free(argv);
        kvt_orch_error(d, "cannot start %s %u: out of memory or of process "
                       "table slots", role == KVT_CHILD_PREFILL ? "prefill"
                       : "decode", rank);
        return NULL;
    }
    memcpy(argv, head, sizeof(head));
    memcpy(argv + nh, fwd, nf * sizeof(*argv));
    if (ne)
        memcpy(argv + nh + nf, extra, ne * sizeof(*argv));
    int rc = kvt_child_spawn(c, d->exe, argv);
    free(argv);
    if (rc != 0) {
        kvt_orch_error(d, "cannot start %s", c->name);
        return NULL;
    }
    return c;
}

static int kvt_ranks_all(kvt_orch_t *d, int ready)
{
    for (size_t i = 0; i < d->kids.n; i++) {
        kvt_child_t *c = &d->kids.v[i];
        if (c->role == KVT_CHILD_REGISTRY)
            continue;
        if (ready ? !c->ready : (c->out_fd >= 0 || !c->reaped))
            return 0;
    }
    return 1;
}

/* Has every rank sent its result (or gone)? */
static int kvt_ranks_finished(kvt_orch_t *d)
{
    for (size_t i = 0; i < d->kids.n; i++) {
        kvt_child_t *c = &d->kids.v[i];
        if (c->role != KVT_CHILD_REGISTRY && !c->finished && c->out_fd >= 0)
            return 0;
    }
    return 1;
}

/* Once every rank is ready and the registry knows every prefill rank,
 * release them all at once: the clock of the run starts here. */
static void kvt_maybe_go(kvt_orch_t *d)
{
    if (d->go_sent || !kvt_ranks_all(d, 1))
        return;
    uint64_t now = kvt_mono_ms();
    if (!d->ready_at_ms)
        d->ready_at_ms = now;
    int complete = kvt_orch_registry_complete(d);
    if (complete == 0 && now - d->ready_at_ms < KVT_REGISTRY_WAIT_MS)
        return;
    if (complete == 0)
        fprintf(stderr, "kvferry %s: registry %s still lacks prefill ranks "
                "after %d s; starting the rooms anyway (they will fail in "
                "BOOTSTRAPPING if it stays so)\n", d->cmd, d->registry_addr,
                KVT_REGISTRY_WAIT_MS / 1000);
    for (size_t i = 0; i < d->kids.n; i++)
        if (d->kids.v[i].role != KVT_CHILD_REGISTRY)
            kvt_child_send(&d->kids.v[i], "go\n");
    d->go_sent = 1;
    d->go_at_ms = kvt_mono_ms();
}

/* A rank that exits before "ready" leaves the others waiting for "go"
 * forever: that ends the run. */
static int kvt_check_early_exit(kvt_orch_t *d)
{
    for (size_t i = 0; i < d->kids.n; i++) {
        kvt_child_t *c = &d->kids.v[i];
        if (c->role == KVT_CHILD_REGISTRY || c->ready ||
            (c->out_fd >= 0 && !c->reaped))
            continue;
        char ex[64];
        kvt_child_exit_str(c, ex, sizeof(ex));
        kvt_orch_error(d, "%s stopped before it was ready (%s); see its log "
                       "above", c->name, ex);
        return -1;
    }
    return 0;
}

static void kvt_orch_loop(kvt_orch_t *d)
{
    /* Sized for the whole table: a fault injector may restart children. */
    struct pollfd *p = calloc(d->kids.cap + 1, sizeof(*p));
    if (!p) {
        kvt_orch_error(d, "out of memory");
        return;
    }
    int released = 0;
    while (!kvt_ranks_all(d, 0)) {
        size_t n = d->kids.n;
        if (!released && kvt_ranks_finished(d) &&
            !(d->on_finished && d->go_sent && d->on_finished(d->ctx))) {
            /* Every rank has reported: let them all exit together. */
            for (size_t i = 0; i < n; i++)
                if (d->kids.v[i].role != KVT_CHILD_REGISTRY)
                    kvt_child_send(&d->kids.v[i], "exit\n");
            released = 1;
        }
        uint64_t now = kvt_mono_ms();
        if (now >= d->deadline_ms) {
            d->timed_out = 1;
            fprintf(stderr, "kvferry %s: --timeout %u s reached; killing "
                    "every process\n", d->cmd, d->timeout_s);
            break;
        }
        if (!d->go_sent && kvt_check_early_exit(d))
            break;
        kvt_maybe_go(d);
        p[0] = (struct pollfd){ d->sfd, POLLIN, 0 };
        for (size_t i = 0; i < n; i++)
            p[i + 1] = (struct pollfd){ d->kids.v[i].out_fd, POLLIN, 0 };
        int wait = (int)(d->deadline_ms - now);
        if (!d->go_sent && wait > 50)
            wait = 50;   /* re-ask the registry */
        if (d->on_tick && d->go_sent) {
            d->on_tick(d->ctx, now);
            if (wait > (int)d->tick_ms)
                wait = (int)d->tick_ms;
        }
        if (poll(p, n + 1, wait) < 0 && errno != EINTR) {
            kvt_orch_error(d, "poll: %s", strerror(errno));
            break;
        }
        if (p[0].revents) {
            struct signalfd_siginfo si;
            while (read(d->sfd, &si, sizeof(si)) == sizeof(si))
                if (si.ssi_signo != SIGCHLD)
                    d->signal = (int)si.ssi_signo;
            kvt_children_reap(&d->kids);
            if (d->signal) {
                fprintf(stderr, "kvferry %s: interrupted by SIG%s; killing "
                        "every process\n", d->cmd, sigabbrev_np(d->signal));
                break;
            }
        }
        for (size_t i = 0; i < n; i++)
            if (p[i + 1].revents)
                kvt_child_read(&d->kids.v[i], kvt_orch_on_line, d);
    }
    free(p);
}

static int kvt_orch_signals(kvt_orch_t *d)
{
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGCHLD);
    sigaddset(&set, SIGINT);
    sigaddset(&set, SIGTERM);
    sigaddset(&set, SIGHUP);
    if (sigprocmask(SIG_BLOCK, &set, NULL) != 0 ||
        (d->sfd = signalfd(-1, &set, SFD_NONBLOCK | SFD_CLOEXEC)) < 0) {
        fprintf(stderr, "kvferry %s: signalfd: %s\n", d->cmd, strerror(errno));
        return -1;
    }
    signal(SIGPIPE, SIG_IGN);   /* a dead rank's stdin: EPIPE, not death */
    return 0;
}

/* ------------------------------------------------------------------------ */
/* Lifecycle                                                                */
/* ------------------------------------------------------------------------ */

int kvt_orch_init(kvt_orch_t *d, const char *cmd, const kvt_opts_t *opts,
                  unsigned timeout_s)
{
    memset(d, 0, sizeof(*d));
    d->cmd = cmd;
    d->sfd = -1;
    d->timeout_s = timeout_s;
    d->tick_ms = 250;
    ssize_t len = readlink("/proc/self/exe", d->exe, sizeof(d->exe) - 1);
    if (len <= 0) {
        fprintf(stderr, "kvferry %s: cannot find my own executable "
                "(/proc/self/exe): %s\n", cmd, strerror(errno));
        return -1;
    }
    d->exe[len] = '\0';
    /* Twice the processes: room for restarting each one once (faults). */
    if (kvt_children_init(&d->kids, 2 * (1 + kvt_opts_nranks(opts, 1) +
                                         kvt_opts_nranks(opts, 0))) != 0) {
        fprintf(stderr, "kvferry %s: out of memory\n", cmd);
        return -1;
    }
    return kvt_orch_signals(d);
}

void kvt_orch_run(kvt_orch_t *d, const kvt_opts_t *o, char **fwd)
{
    d->deadline_ms = kvt_mono_ms() + (uint64_t)d->timeout_s * 1000;
    d->fwd = fwd;
    char port[16];
    kvt_registry_port(port, sizeof(port));
    if (kvt_orch_token(d) != 0 || kvt_start_registry(d, port) != 0)
        return;
    fprintf(stderr, "kvferry %s: registry %s, %s\n", d->cmd,
            d->registry_addr, d->registry_auth);
    int ok = 1;
    uint32_t np = kvt_opts_nranks(o, 1), nd = kvt_opts_nranks(o, 0);
    for (uint32_t r = 0; ok && r < np + nd; r++) {
        kvt_child_role_t role = r < np ? KVT_CHILD_PREFILL : KVT_CHILD_DECODE;
        uint32_t rank = r < np ? r : r - np;
        char *const *extra = d->rank_args ? d->rank_args(d->ctx, role, rank) : NULL;
        ok = kvt_orch_start_rank(d, role, rank, extra) != NULL;
    }
    if (ok)
        kvt_orch_loop(d);
}

void kvt_orch_stop(kvt_orch_t *d)
{
    kvt_children_stop_all(&d->kids, KVT_STOP_GRACE_MS, kvt_orch_on_line, d);
}

void kvt_orch_fini(kvt_orch_t *d)
{
    kvt_children_fini(&d->kids);
    if (d->sfd >= 0)
        close(d->sfd);
    d->sfd = -1;
}
