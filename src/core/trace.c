/*
 * The room trace (trace.h): JSON lines, one write() each.
 *
 * A line is built in a fixed buffer on the stack (fields that would not
 * fit are left out, the line stays valid JSON) and written with one
 * write() to a descriptor in append mode, so lines of several engines,
 * in one process or several, never interleave in a shared file.  A write
 * that fails turns the trace off, said once: a full disk must not cost a
 * room anything.
 */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "core/trace.h"
#include "util/log.h"
#include "util/time.h"

kvf_status_t kvf__trace_open_unlocked(kvf_engine_t *eng)
{
    const char *spec = eng->params.trace;
    if (spec == NULL || spec[0] == '\0')
        spec = getenv("KVF_TRACE");
    eng->params.trace = NULL;             /* the caller's string: never kept */
    if (spec == NULL || spec[0] == '\0')
        return KVF_OK;
    if (strncmp(spec, "fd:", 3) == 0) {
        char *end;
        long fd = strtol(spec + 3, &end, 10);
        if (end == spec + 3 || *end != '\0' || fd < 0 || fd > 1 << 24 ||
            fcntl((int)fd, F_GETFD) < 0) {
            kvf_error("trace '%s': not an open descriptor (\"fd:N\" names one the "
                      "application opened for writing)", spec);
            return KVF_ERR_INVALID_PARAM;
        }
        eng->trace_fd = (int)fd;
        eng->trace_owned = 0;
    } else {
        int fd = open(spec, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0600);
        if (fd < 0) {
            kvf_error("trace '%s': cannot open it for appending: %m (give a writable "
                      "file path, or \"fd:N\")", spec);
            return KVF_ERR_INVALID_PARAM;
        }
        eng->trace_fd = fd;
        eng->trace_owned = 1;
    }
    kvf_info("%s engine rank %d: room trace to %s", kvf_role_name(eng->params.role),
             eng->params.tp_rank, spec);
    return KVF_OK;
}

/* Stop tracing: under the lock (a failed write), or at destroy. */
static void trace_stop(kvf_engine_t *eng)
{
    if (eng->trace_fd >= 0 && eng->trace_owned)
        close(eng->trace_fd);
    eng->trace_fd = -1;
}

void kvf__trace_close_unlocked(kvf_engine_t *eng)
{
    trace_stop(eng);
}

__attribute__((format(printf, 2, 3)))
static void add(kvf_trace_t *t, const char *fmt, ...)
{
    /* Two bytes kept for the closing "}\n". */
    size_t room = sizeof(t->b) - 2 - t->n;
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(t->b + t->n, room, fmt, ap);
    va_end(ap);
    if (n >= 0 && (size_t)n < room)
        t->n += (size_t)n;
    else
        t->b[t->n] = '\0';      /* left out whole: the line stays valid */
}

void kvf__trace_begin(kvf_trace_t *t, const kvf_room_t *r, const char *event)
{
    KVF_ASSERT_LOCKED(r->eng);
    const kvf_engine_t *eng = r->eng;
    const kvf_engine_params_t *p = &eng->params;
    struct timespec wall;
    clock_gettime(CLOCK_REALTIME, &wall);
    t->n = 0;
    add(t, "{\"mono_ns\":%" PRIu64 ",\"wall_ns\":%" PRIu64 ",\"event\":\"%s\",\"room\":\"%"
        PRIu64 "\",\"side\":\"%s\",\"tp\":%d,\"tp_size\":%d,\"pp\":%d,\"dp\":%d,"
        "\"addr\":\"%s\",\"engine\":\"%016" PRIx64 "\"", kvf_now_ns(),
        (uint64_t)wall.tv_sec * 1000000000u + (uint64_t)wall.tv_nsec, event, r->id,
        kvf_role_name(p->role), p->tp_rank, p->tp_size, p->pp_rank, p->dp_rank, eng->addr,
        eng->instance_id);
    if (r->side == KVF_ROLE_DECODE)
        add(t, ",\"room_instance\":\"%016" PRIx64 "\"", r->instance);
}

void kvf__trace_u64(kvf_trace_t *t, const char *key, uint64_t v)
{
    add(t, ",\"%s\":%" PRIu64, key, v);
}

/* JSON string escaping: quotes, backslashes and control characters. */
void kvf__trace_str(kvf_trace_t *t, const char *key, const char *v)
{
    char esc[1100];
    size_t n = 0;
    for (const unsigned char *s = (const unsigned char *)v; *s && n + 7 < sizeof(esc); s++) {
        if (*s == '"' || *s == '\\') {
            esc[n++] = '\\';
            esc[n++] = (char)*s;
        } else if (*s < 0x20 || *s == 0x7f) {
            n += (size_t)snprintf(esc + n, sizeof(esc) - n, "\\u%04x", *s);
        } else {
            esc[n++] = (char)*s;
        }
    }
    esc[n] = '\0';
    add(t, ",\"%s\":\"%s\"", key, esc);
}

void kvf__trace_peer(kvf_trace_t *t, const kvf_peer_t *p)
{
    char name[128];
    kvf__trace_str(t, "peer", kvf__peer_name(p, name, sizeof(name)));
    if (p->instance_id != 0 || p->outbound) {
        /* Its side: from its HELLO, or, before it, the side it was dialled as. */
        add(t, ",\"peer_side\":\"%s\",\"peer_rank\":%d",
            p->instance_id != 0 ? kvf_role_name(p->role) : "prefill", p->tp_rank);
    }
}

void kvf__trace_end(kvf_trace_t *t, kvf_engine_t *eng)
{
    KVF_ASSERT_LOCKED(eng);
    t->b[t->n++] = '}';
    t->b[t->n++] = '\n';
    ssize_t w = write(eng->trace_fd, t->b, t->n);
    if (w == (ssize_t)t->n)
        return;
    kvf_warn("room trace: %s; tracing stops for this engine",
             w < 0 ? strerror(errno) : "a short write");
    trace_stop(eng);
}

void kvf__trace_event_(kvf_room_t *r, const char *event)
{
    KVF_ASSERT_LOCKED(r->eng);
    kvf_trace_t t;
    kvf__trace_begin(&t, r, event);
    if (strcmp(event, "destroyed") == 0)
        kvf__trace_str(&t, "state", kvf_poll_name(room_state(r)));
    kvf__trace_end(&t, r->eng);
}

void kvf__trace_peer_event_(kvf_room_t *r, const char *event, const kvf_peer_t *p,
                            int64_t stream, int64_t pages, int64_t bytes)
{
    KVF_ASSERT_LOCKED(r->eng);
    kvf_trace_t t;
    kvf__trace_begin(&t, r, event);
    if (p != NULL)
        kvf__trace_peer(&t, p);
    if (stream >= 0)
        kvf__trace_u64(&t, "stream", (uint64_t)stream);
    if (pages >= 0)
        kvf__trace_u64(&t, "pages", (uint64_t)pages);
    if (bytes >= 0)
        kvf__trace_u64(&t, "bytes", (uint64_t)bytes);
    kvf__trace_end(&t, r->eng);
}

void kvf__trace_state_(kvf_room_t *r, kvf_poll_t state)
{
    KVF_ASSERT_LOCKED(r->eng);
    kvf_trace_t t;
    kvf__trace_begin(&t, r, "state");
    kvf__trace_str(&t, "state", kvf_poll_name(state));
    kvf__trace_end(&t, r->eng);
}

void kvf__trace_failed_(kvf_room_t *r, const kvf_failure_t *f, const kvf_peer_t *via,
                        int after_success)
{
    KVF_ASSERT_LOCKED(r->eng);
    kvf_trace_t t;
    kvf__trace_begin(&t, r, "failed");
    kvf__trace_str(&t, "status", kvf_status_name(f->status));
    add(&t, ",\"code\":%d,\"origin_side\":\"%s\",\"origin_rank\":%d", (int)f->status,
        kvf_role_name(f->origin_side), f->origin_rank);
    kvf__trace_str(&t, "origin_addr", f->origin_addr);
    add(&t, ",\"from_another_rank\":%d,\"after_success\":%d", f->from_another_rank ? 1 : 0,
        after_success ? 1 : 0);
    if (via != NULL) {
        char name[128];
        kvf__trace_str(&t, "via", kvf__peer_name(via, name, sizeof(name)));
    }
    /* Last: a long reason is what gets cut, never the fields before it. */
    kvf__trace_str(&t, "reason", f->reason);
    kvf__trace_end(&t, r->eng);
}
