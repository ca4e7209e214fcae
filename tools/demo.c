/*
 * `kvferry demo`: a whole prefill/decode deployment on this host, one
 * process per part, and a verdict on every room.
 *
 * The orchestrator starts a registry (`kvferry bootstrap --port 0`, whose
 * first stdout line gives its port), then --prefill-tp prefill and
 * --decode-tp decode rank processes (`kvferry _rank`, see rank.c).  It
 * never links a rank's memory or engine: all it knows comes from the
 * ranks' event lines on their stdout pipes, and all it can do is write
 * commands to their stdin and send them signals.  That keeps the verdict
 * honest (a rank that dies loses nothing already reported) and is the hook
 * for fault injection: a `--fault KIND@WHEN` handler watches the "phase"
 * events in kvt_demo_on_event(), and acts on the child table (kill or
 * SIGSTOP a role/rank, stop the registry) when the first room reaches WHEN.
 *
 * Sequence: spawn all -> every rank "ready" -> registry lists every prefill
 * rank (GET /route) -> "go" to every rank -> events until every rank has
 * exited -> verdict.  A deadline (--timeout), SIGINT/SIGTERM, or a rank dying
 * before "ready" end the run early; every exit path kills and reaps every
 * child, and children die with us anyway (PR_SET_PDEATHSIG).
 */
#include <errno.h>
#include <limits.h>
#include <netdb.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <jansson.h>

#include "kvferry/kvferry.h"
#include "models.h"
#include "opts.h"
#include "proc.h"
#include "report.h"
#include "tool.h"

#define KVT_REGISTRY_START_MS 10000   /* registry must print its port */
#define KVT_REGISTRY_WAIT_MS  15000   /* prefill ranks must show up in it */
#define KVT_STOP_GRACE_MS     2000

typedef struct kvt_demo {
    kvt_opts_t      o;
    char            exe[PATH_MAX];
    kvt_children_t  kids;
    kvt_child_t    *registry;
    char            registry_addr[64];
    int             sfd;              /* signalfd: SIGCHLD, SIGINT, SIGTERM */
    uint64_t        deadline_ms;
    uint64_t        ready_at_ms;      /* when the last rank said ready */
    int             go_sent;
    int             signal;           /* SIGINT/SIGTERM received */
    int             timed_out;
    char            error[512];       /* first setup error */
    char            transport[32];    /* what the ranks' engines report */
    kvt_report_t    rep;
} kvt_demo_t;

static void kvt_demo_error(kvt_demo_t *d, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

static void kvt_demo_error(kvt_demo_t *d, const char *fmt, ...)
{
    if (d->error[0])
        return;   /* the first error is the cause; later ones follow from it */
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(d->error, sizeof(d->error), fmt, ap);
    va_end(ap);
    fprintf(stderr, "kvferry demo: %s\n", d->error);
}

/* ------------------------------------------------------------------------ */
/* Events from children                                                     */
/* ------------------------------------------------------------------------ */

static void kvt_demo_on_event(kvt_demo_t *d, kvt_child_t *c, json_t *ev)
{
    const char *type = json_string_value(json_object_get(ev, "event"));
    if (!type)
        return;
    if (strcmp(type, "phase") == 0) {
        kvt_report_phase(&d->rep, c, ev);
        /* Fault injection hooks in here: match (role, phase) against the
         * --fault spec and act on d->kids. */
    } else if (strcmp(type, "room") == 0) {
        kvt_report_room(&d->rep, c, ev);
    } else if (strcmp(type, "ready") == 0) {
        const char *t = json_string_value(json_object_get(ev, "transport"));
        c->ready = 1;
        if (t != NULL)
            snprintf(d->transport, sizeof(d->transport), "%s", t);
    } else if (strcmp(type, "result") == 0) {
        kvt_report_result(&d->rep, c, ev);
        c->finished = 1;
    } else if (strcmp(type, "error") == 0) {
        kvt_demo_error(d, "%s: %s", c->name,
                       json_string_value(json_object_get(ev, "message")));
    }
}

static void kvt_demo_on_line(void *ctx, kvt_child_t *c, char *line)
{
    kvt_demo_t *d = ctx;
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
        fprintf(stderr, "kvferry demo: %s printed a line that is not a JSON "
                "event (%s): %.200s\n", c->name, err.text, line);
        json_decref(ev);
        return;
    }
    kvt_demo_on_event(d, c, ev);
    json_decref(ev);
}

/* ------------------------------------------------------------------------ */
/* Registry                                                                 */
/* ------------------------------------------------------------------------ */

/*
 * One HTTP GET with a short timeout.  @return the status code, or -1 when
 * the registry cannot be reached.  A raw socket is enough for a status
 * line, and keeps the tool on kvferry's public API alone.
 */
static int kvt_http_status(const char *host, const char *port, const char *path)
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
        char req[512], resp[64];
        int n = snprintf(req, sizeof(req), "GET %s HTTP/1.0\r\nHost: %s:%s\r\n"
                         "Connection: close\r\n\r\n", path, host, port);
        ssize_t got = 0;
        if (send(fd, req, (size_t)n, MSG_NOSIGNAL) == n)
            got = recv(fd, resp, sizeof(resp) - 1, 0);
        if (got > 0) {
            resp[got] = '\0';
            if (sscanf(resp, "HTTP/%*d.%*d %d", &code) != 1)
                code = -1;
        }
    }
    if (fd >= 0)
        close(fd);
    freeaddrinfo(ai);
    return code;
}

/* Has every prefill rank registered?  SGLang's route answers 503 until
 * then.  @return 1 yes, 0 not yet, -1 cannot tell (go ahead anyway). */
static int kvt_registry_complete(kvt_demo_t *d)
{
    char host[64], *colon;
    snprintf(host, sizeof(host), "%s", d->registry_addr);
    if (!(colon = strrchr(host, ':')))
        return -1;
    *colon = '\0';
    int code = kvt_http_status(host, colon + 1,
                               "/route?prefill_dp_rank=-1&prefill_cp_rank=-1"
                               "&target_tp_rank=-1&target_pp_rank=-1");
    if (code == 200)
        return 1;
    if (code == 503 || code == -1)
        return 0;
    fprintf(stderr, "kvferry demo: registry %s answered GET /route with HTTP "
            "%d (expected 200 or 503); starting the rooms anyway\n",
            d->registry_addr, code);
    return -1;
}

/* Start the registry and wait for the line with its port. */
static int kvt_start_registry(kvt_demo_t *d)
{
    char *argv[] = { d->exe, "bootstrap", "--host", "127.0.0.1", "--port", "0",
                     NULL };
    d->registry = kvt_children_add(&d->kids, KVT_CHILD_REGISTRY, 0);
    if (kvt_child_spawn(d->registry, d->exe, argv) != 0) {
        kvt_demo_error(d, "cannot start the registry process");
        return -1;
    }
    uint64_t until = kvt_mono_ms() + KVT_REGISTRY_START_MS;
    while (!d->registry_addr[0]) {
        struct pollfd p[2] = { { d->registry->out_fd, POLLIN, 0 },
                               { d->sfd, POLLIN, 0 } };
        uint64_t now = kvt_mono_ms();
        if (now >= until) {
            kvt_demo_error(d, "the registry did not report its port within "
                           "%d s; see its log above", KVT_REGISTRY_START_MS / 1000);
            return -1;
        }
        if (poll(p, 2, (int)(until - now)) < 0 && errno != EINTR)
            return -1;
        if (p[1].revents) {
            struct signalfd_siginfo si;
            if (read(d->sfd, &si, sizeof(si)) == sizeof(si) &&
                si.ssi_signo != SIGCHLD) {
                d->signal = (int)si.ssi_signo;
                return -1;
            }
        }
        if (p[0].revents && kvt_child_read(d->registry, kvt_demo_on_line, d) <= 0
            && !d->registry_addr[0]) {
            kvt_demo_error(d, "the registry exited before it listened; see "
                           "its log above (is kvf_bootstrap_create working?)");
            return -1;
        }
    }
    return 0;
}

/* ------------------------------------------------------------------------ */
/* Ranks                                                                    */
/* ------------------------------------------------------------------------ */

static int kvt_start_rank(kvt_demo_t *d, kvt_child_role_t role, uint32_t rank,
                          char **fwd)
{
    char rank_s[16];
    snprintf(rank_s, sizeof(rank_s), "%u", rank);
    char *head[] = { d->exe, "_rank", "--role",
                     role == KVT_CHILD_PREFILL ? "prefill" : "decode",
                     "--rank", rank_s, "--registry", d->registry_addr };
    size_t nh = sizeof(head) / sizeof(head[0]), nf = 0;
    while (fwd[nf])
        nf++;
    char **argv = calloc(nh + nf + 1, sizeof(*argv));
    if (!argv)
        return -1;
    memcpy(argv, head, sizeof(head));
    memcpy(argv + nh, fwd, nf * sizeof(*argv));
    kvt_child_t *c = kvt_children_add(&d->kids, role, rank);
    int rc = kvt_child_spawn(c, d->exe, argv);
    free(argv);
    if (rc != 0)
        kvt_demo_error(d, "cannot start %s", c->name);
    return rc;
}

static int kvt_ranks_all(kvt_demo_t *d, int ready)
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
static int kvt_ranks_finished(kvt_demo_t *d)
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
static void kvt_maybe_go(kvt_demo_t *d)
{
    if (d->go_sent || !kvt_ranks_all(d, 1))
        return;
    uint64_t now = kvt_mono_ms();
    if (!d->ready_at_ms)
        d->ready_at_ms = now;
    int complete = kvt_registry_complete(d);
    if (complete == 0 && now - d->ready_at_ms < KVT_REGISTRY_WAIT_MS)
        return;
    if (complete == 0)
        fprintf(stderr, "kvferry demo: registry %s still lacks prefill ranks "
                "after %d s; starting the rooms anyway (they will fail in "
                "BOOTSTRAPPING if it stays so)\n", d->registry_addr,
                KVT_REGISTRY_WAIT_MS / 1000);
    for (size_t i = 0; i < d->kids.n; i++)
        if (d->kids.v[i].role != KVT_CHILD_REGISTRY)
            kvt_child_send(&d->kids.v[i], "go\n");
    d->go_sent = 1;
}

/* A rank that exits before "ready" leaves the others waiting for "go"
 * forever: that ends the run. */
static int kvt_check_early_exit(kvt_demo_t *d)
{
    for (size_t i = 0; i < d->kids.n; i++) {
        kvt_child_t *c = &d->kids.v[i];
        if (c->role == KVT_CHILD_REGISTRY || c->ready ||
            (c->out_fd >= 0 && !c->reaped))
            continue;
        char ex[64];
        kvt_child_exit_str(c, ex, sizeof(ex));
        kvt_demo_error(d, "%s stopped before it was ready (%s); see its log "
                       "above", c->name, ex);
        return -1;
    }
    return 0;
}

static void kvt_demo_loop(kvt_demo_t *d)
{
    size_t n = d->kids.n;
    struct pollfd *p = calloc(n + 1, sizeof(*p));
    if (!p) {
        kvt_demo_error(d, "out of memory");
        return;
    }
    int released = 0;
    while (!kvt_ranks_all(d, 0)) {
        if (!released && kvt_ranks_finished(d)) {
            /* Every rank has reported: let them all exit together. */
            for (size_t i = 0; i < n; i++)
                if (d->kids.v[i].role != KVT_CHILD_REGISTRY)
                    kvt_child_send(&d->kids.v[i], "exit\n");
            released = 1;
        }
        uint64_t now = kvt_mono_ms();
        if (now >= d->deadline_ms) {
            d->timed_out = 1;
            fprintf(stderr, "kvferry demo: --timeout %u s reached; killing "
                    "every process\n", d->o.timeout);
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
        if (poll(p, n + 1, wait) < 0 && errno != EINTR) {
            kvt_demo_error(d, "poll: %s", strerror(errno));
            break;
        }
        if (p[0].revents) {
            struct signalfd_siginfo si;
            while (read(d->sfd, &si, sizeof(si)) == sizeof(si))
                if (si.ssi_signo != SIGCHLD)
                    d->signal = (int)si.ssi_signo;
            kvt_children_reap(&d->kids);
            if (d->signal) {
                fprintf(stderr, "kvferry demo: interrupted by SIG%s; killing "
                        "every process\n", sigabbrev_np(d->signal));
                break;
            }
        }
        for (size_t i = 0; i < n; i++)
            if (p[i + 1].revents)
                kvt_child_read(&d->kids.v[i], kvt_demo_on_line, d);
    }
    free(p);
}

/* ------------------------------------------------------------------------ */
/* Main                                                                     */
/* ------------------------------------------------------------------------ */

static void kvt_demo_usage(FILE *out)
{
    fprintf(out,
        "Usage: kvferry demo [options]\n"
        "\n"
        "Run a whole prefill/decode deployment on this host, one process per\n"
        "part: a bootstrap registry, --prefill-tp prefill ranks and\n"
        "--decode-tp decode ranks, each with KV buffers of a real model's\n"
        "layout.  --requests rooms of --tokens tokens go from prefill pages\n"
        "into randomly scattered decode pages; decode verifies every byte and\n"
        "the aux tag.  Exit status 0 only when every room succeeded and\n"
        "verified, 1 otherwise, 2 for bad options.\n"
        "\n"
        "Options:\n");
    kvt_opts_usage(out);
    fprintf(out, "\n");
    kvt_models_print(out);
    fprintf(out,
        "\nEngine settings not listed here come from KVF_* environment\n"
        "variables (KVF_LOG=info, KVF_TRANSFER_TIMEOUT_MS, ...), which every\n"
        "rank inherits.\n");
}

static int kvt_demo_signals(kvt_demo_t *d)
{
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGCHLD);
    sigaddset(&set, SIGINT);
    sigaddset(&set, SIGTERM);
    sigaddset(&set, SIGHUP);
    if (sigprocmask(SIG_BLOCK, &set, NULL) != 0 ||
        (d->sfd = signalfd(-1, &set, SFD_NONBLOCK | SFD_CLOEXEC)) < 0) {
        fprintf(stderr, "kvferry demo: signalfd: %s\n", strerror(errno));
        return -1;
    }
    signal(SIGPIPE, SIG_IGN);   /* a dead rank's stdin: EPIPE, not death */
    return 0;
}

int kvt_demo_main(int argc, char **argv)
{
    static kvt_demo_t d;
    memset(&d, 0, sizeof(d));
    d.sfd = -1;
    kvt_opts_defaults(&d.o);
    int prc = kvt_opts_parse(&d.o, KVT_OPTS_DEMO, argc, argv, 2);
    if (prc == 1) {
        kvt_demo_usage(stdout);
        return 0;
    }
    if (prc != 0 || kvt_opts_resolve(&d.o, KVT_OPTS_DEMO) != 0)
        return 2;

    ssize_t len = readlink("/proc/self/exe", d.exe, sizeof(d.exe) - 1);
    if (len <= 0) {
        fprintf(stderr, "kvferry demo: cannot find my own executable "
                "(/proc/self/exe): %s\n", strerror(errno));
        return 1;
    }
    d.exe[len] = '\0';

    char **fwd = kvt_opts_argv(&d.o);
    if (!fwd || kvt_report_init(&d.rep, &d.o) != 0 ||
        kvt_children_init(&d.kids, 1 + d.o.prefill_tp + d.o.decode_tp) != 0 ||
        kvt_demo_signals(&d) != 0) {
        fprintf(stderr, "kvferry demo: out of memory or no signalfd\n");
        return 1;
    }
    d.deadline_ms = kvt_mono_ms() + (uint64_t)d.o.timeout * 1000;

    if (kvt_start_registry(&d) == 0) {
        int rc = 0;
        for (uint32_t r = 0; rc == 0 && r < d.o.prefill_tp; r++)
            rc = kvt_start_rank(&d, KVT_CHILD_PREFILL, r, fwd);
        for (uint32_t r = 0; rc == 0 && r < d.o.decode_tp; r++)
            rc = kvt_start_rank(&d, KVT_CHILD_DECODE, r, fwd);
        if (rc == 0)
            kvt_demo_loop(&d);
    }
    kvt_children_stop_all(&d.kids, KVT_STOP_GRACE_MS, kvt_demo_on_line, &d);

    kvt_run_info_t info = { d.transport[0] ? d.transport : "unknown", d.error[0] ? d.error : NULL,
                            d.timed_out, d.signal };
    int ok = 0;
    json_t *summary = kvt_report_summary(&d.rep, &d.kids, &info, &ok);
    if (!summary) {
        fprintf(stderr, "kvferry demo: cannot build the summary (out of memory)\n");
        ok = 0;
    } else if (d.o.json) {
        char *s = json_dumps(summary, JSON_COMPACT);
        if (s) {
            printf("%s\n", s);
            free(s);
        }
    } else {
        kvt_report_print(stdout, summary);
    }
    fflush(stdout);
    json_decref(summary);
    kvt_report_fini(&d.rep);
    kvt_children_fini(&d.kids);
    kvt_opts_argv_free(fwd);
    close(d.sfd);
    return ok ? 0 : 1;
}
