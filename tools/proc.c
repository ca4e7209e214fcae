/*
 * Child processes of the orchestrator (see proc.h).
 *
 * The subtle part is the window between fork() and exec(): the child sets
 * its death signal, then checks that its parent is still the orchestrator
 * (the parent may have died before prctl() took effect), restores the
 * signal mask and SIGPIPE the orchestrator changed, and leaves the
 * terminal's process group.  Pipes are created O_CLOEXEC so no child
 * inherits another child's pipe ends: EOF on a stdout pipe then means that
 * exactly that child is gone.
 */
#include "proc.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "tool.h"

#define KVT_LINE_MAX (256u << 20)   /* a result line of 1e6 rooms fits */

int kvt_children_init(kvt_children_t *t, size_t cap)
{
    t->v = calloc(cap, sizeof(*t->v));
    t->n = 0;
    t->cap = cap;
    return t->v ? 0 : -1;
}

void kvt_children_fini(kvt_children_t *t)
{
    for (size_t i = 0; i < t->n; i++) {
        kvt_child_t *c = &t->v[i];
        if (c->out_fd >= 0)
            close(c->out_fd);
        if (c->in_fd >= 0)
            close(c->in_fd);
        free(c->buf);
    }
    free(t->v);
    t->v = NULL;
    t->n = t->cap = 0;
}

kvt_child_t *kvt_children_add(kvt_children_t *t, kvt_child_role_t role,
                              uint32_t rank)
{
    if (t->n == t->cap)
        return NULL;
    kvt_child_t *c = &t->v[t->n++];
    memset(c, 0, sizeof(*c));
    c->role = role;
    c->rank = rank;
    c->out_fd = c->in_fd = -1;
    if (role == KVT_CHILD_REGISTRY)
        snprintf(c->name, sizeof(c->name), "registry");
    else
        snprintf(c->name, sizeof(c->name), "%s[%u]",
                 role == KVT_CHILD_PREFILL ? "prefill" : "decode", rank);
    return c;
}

kvt_child_t *kvt_children_find(kvt_children_t *t, kvt_child_role_t role,
                               uint32_t rank)
{
    for (size_t i = 0; i < t->n; i++)
        if (t->v[i].role == role && t->v[i].rank == rank)
            return &t->v[i];
    return NULL;
}

int kvt_child_spawn(kvt_child_t *c, const char *exe, char *const argv[])
{
    int in[2], out[2];
    if (pipe2(in, O_CLOEXEC) != 0)
        goto err;
    if (pipe2(out, O_CLOEXEC) != 0) {
        close(in[0]);
        close(in[1]);
        goto err;
    }
    pid_t parent = getpid();
    pid_t pid = fork();
    if (pid < 0) {
        close(in[0]); close(in[1]); close(out[0]); close(out[1]);
        goto err;
    }
    if (pid == 0) {
        sigset_t none;
        sigemptyset(&none);
        if (prctl(PR_SET_PDEATHSIG, SIGKILL) != 0 || getppid() != parent)
            _exit(127);
        signal(SIGPIPE, SIG_DFL);
        signal(SIGINT, SIG_DFL);
        signal(SIGTERM, SIG_DFL);
        sigprocmask(SIG_SETMASK, &none, NULL);
        setpgid(0, 0);
        if (dup2(in[0], STDIN_FILENO) < 0 || dup2(out[1], STDOUT_FILENO) < 0)
            _exit(127);
        execv(exe, argv);
        fprintf(stderr, "kvferry demo: cannot start %s (%s): %s\n", c->name,
                exe, strerror(errno));
        _exit(127);
    }
    close(in[0]);
    close(out[1]);
    c->pid = pid;
    c->in_fd = in[1];
    c->out_fd = out[0];
    fcntl(c->out_fd, F_SETFL, fcntl(c->out_fd, F_GETFL) | O_NONBLOCK);
    return 0;
err:
    fprintf(stderr, "kvferry demo: cannot start %s: %s\n", c->name,
            strerror(errno));
    return -1;
}

/* Hand every complete line in c->buf to cb and keep the rest. */
static void kvt_child_lines(kvt_child_t *c, kvt_line_cb_t cb, void *ctx)
{
    size_t at = 0;
    for (;;) {
        char *nl = memchr(c->buf + at, '\n', c->len - at);
        if (!nl)
            break;
        *nl = '\0';
        cb(ctx, c, c->buf + at);
        at = (size_t)(nl - c->buf) + 1;
    }
    memmove(c->buf, c->buf + at, c->len - at);
    c->len -= at;
}

static void kvt_child_close_out(kvt_child_t *c, kvt_line_cb_t cb, void *ctx)
{
    if (c->len > 0) {           /* a last line without its newline */
        c->buf[c->len] = '\0';
        cb(ctx, c, c->buf);
        c->len = 0;
    }
    close(c->out_fd);
    c->out_fd = -1;
}

int kvt_child_read(kvt_child_t *c, kvt_line_cb_t cb, void *ctx)
{
    if (c->out_fd < 0)
        return 0;
    for (;;) {
        if (c->cap - c->len < 65536 + 1) {
            size_t ncap = c->cap ? 2 * c->cap : 131072;
            char *nb = ncap <= KVT_LINE_MAX ? realloc(c->buf, ncap) : NULL;
            if (!nb) {
                fprintf(stderr, "kvferry demo: %s printed a line longer than "
                        "%zu bytes; ignoring the rest of its output\n",
                        c->name, c->cap);
                c->len = 0;
                kvt_child_close_out(c, cb, ctx);
                return -1;
            }
            c->buf = nb;
            c->cap = ncap;
        }
        ssize_t n = read(c->out_fd, c->buf + c->len, c->cap - c->len - 1);
        if (n > 0) {
            c->len += (size_t)n;
            kvt_child_lines(c, cb, ctx);
            continue;
        }
        if (n == 0) {
            kvt_child_close_out(c, cb, ctx);
            return 0;
        }
        if (errno == EINTR)
            continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK)
            return 1;
        fprintf(stderr, "kvferry demo: reading the output of %s: %s\n",
                c->name, strerror(errno));
        kvt_child_close_out(c, cb, ctx);
        return -1;
    }
}

int kvt_child_send(kvt_child_t *c, const char *line)
{
    if (c->in_fd < 0)
        return -1;
    size_t len = strlen(line), off = 0;
    while (off < len) {
        ssize_t n = write(c->in_fd, line + off, len - off);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            return -1;   /* EPIPE: it is gone; its exit tells the rest */
        off += (size_t)n;
    }
    return 0;
}

void kvt_child_signal(kvt_child_t *c, int sig)
{
    if (c->pid > 0 && !c->reaped)
        kill(c->pid, sig);
}

void kvt_children_reap(kvt_children_t *t)
{
    for (size_t i = 0; i < t->n; i++) {
        kvt_child_t *c = &t->v[i];
        if (c->pid <= 0 || c->reaped)
            continue;
        int st;
        pid_t r = waitpid(c->pid, &st, WNOHANG);
        if (r == c->pid) {
            c->reaped = 1;
            c->wstatus = st;
        }
    }
}

static int kvt_children_all_reaped(kvt_children_t *t)
{
    for (size_t i = 0; i < t->n; i++)
        if (t->v[i].pid > 0 && !t->v[i].reaped)
            return 0;
    return 1;
}

void kvt_children_stop_all(kvt_children_t *t, unsigned grace_ms,
                           kvt_line_cb_t cb, void *ctx)
{
    for (size_t i = 0; i < t->n; i++) {
        kvt_child_t *c = &t->v[i];
        if (c->in_fd >= 0) {
            close(c->in_fd);
            c->in_fd = -1;
        }
        if (c->role == KVT_CHILD_REGISTRY) {
            kvt_child_signal(c, SIGTERM);
        } else {
            kvt_child_signal(c, SIGKILL);
        }
        if (c->stopped)
            kvt_child_signal(c, SIGCONT);
    }
    uint64_t kill_at = kvt_mono_ms() + grace_ms;
    int killed = 0;
    for (;;) {
        /* Drain what the children wrote before they died: a rank's last
         * room events still count. */
        for (size_t i = 0; i < t->n; i++)
            kvt_child_read(&t->v[i], cb, ctx);
        kvt_children_reap(t);
        if (kvt_children_all_reaped(t))
            break;
        if (!killed && kvt_mono_ms() >= kill_at) {
            for (size_t i = 0; i < t->n; i++)
                if (!t->v[i].reaped && t->v[i].pid > 0) {
                    fprintf(stderr, "kvferry demo: %s did not stop within "
                            "%u ms of SIGTERM; killing it\n", t->v[i].name,
                            grace_ms);
                    kvt_child_signal(&t->v[i], SIGKILL);
                }
            killed = 1;
        }
        struct timespec ts = { 0, 10 * 1000 * 1000 };
        nanosleep(&ts, NULL);
    }
    /* Every writer is dead: what is left is buffered data, then EOF (the
     * bound only guards against a pipe end leaked to some other process). */
    for (size_t i = 0; i < t->n; i++)
        for (int k = 0; k < 100 && kvt_child_read(&t->v[i], cb, ctx) == 1; k++)
            ;
}

/* The exit status ThreadSanitizer ends a process with once it reported a
 * race (its `exitcode` option); its children are this binary, built alike. */
#if defined(__SANITIZE_THREAD__)
#define TSAN_EXIT 66
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define TSAN_EXIT 66
#endif
#endif

void kvt_child_exit_str(const kvt_child_t *c, char *buf, size_t len)
{
    if (!c->reaped)
        snprintf(buf, len, c->pid > 0 ? "running" : "not started");
#ifdef TSAN_EXIT
    else if (WIFEXITED(c->wstatus) && WEXITSTATUS(c->wstatus) == TSAN_EXIT)
        snprintf(buf, len, "exit %d (ThreadSanitizer stopped it: see its report)",
                 TSAN_EXIT);
#endif
    else if (WIFEXITED(c->wstatus))
        snprintf(buf, len, "exit %d", WEXITSTATUS(c->wstatus));
    else if (WIFSIGNALED(c->wstatus))
        snprintf(buf, len, "killed by SIG%s", sigabbrev_np(WTERMSIG(c->wstatus))
                 ? sigabbrev_np(WTERMSIG(c->wstatus)) : "?");
    else
        snprintf(buf, len, "status 0x%x", c->wstatus);
}

int kvt_child_exited_ok(const kvt_child_t *c)
{
    return c->reaped && WIFEXITED(c->wstatus) && WEXITSTATUS(c->wstatus) == 0;
}
