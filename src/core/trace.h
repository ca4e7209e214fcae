/*
 * The room trace, internal (trace.c): one JSON line per room event, so
 * that `kvferry trace ROOM FILES...` can lay a room's story on every rank
 * side by side (docs/OPERATIONS.md, "Tracing a room").
 *
 * Off unless kvf_engine_params_t.trace or KVF_TRACE names a file or a
 * descriptor; then every event below is one write() of one line, made
 * under the engine lock where the event happens.  When off, each call
 * site costs the test of one field (the inline wrappers): nothing is
 * formatted and no function is called.
 *
 * A line: {"mono_ns":..., "wall_ns":..., "event":"...", "room":"<id>",
 * "side":..., "tp":..., "tp_size":..., "pp":..., "dp":..., "addr":...,
 * "engine":"<instance>", then the event's own fields.  The room id is a
 * string: it is a 64-bit number, more than a JSON double holds exactly.
 */
#ifndef KVF_CORE_TRACE_H
#define KVF_CORE_TRACE_H

#include "core/room.h"

/* Engine create / destroy: open the trace (params.trace, else KVF_TRACE),
 * close it.  KVF_OK, or KVF_ERR_INVALID_PARAM (a spec that cannot be
 * opened; the log says why). */
kvf_status_t kvf__trace_open_unlocked(kvf_engine_t *eng);
void         kvf__trace_close_unlocked(kvf_engine_t *eng);

static inline int kvf__tracing(const kvf_engine_t *eng)
{
    KVF_ASSERT_LOCKED(eng);
    return eng->trace_fd >= 0;
}

/* A line being built: begin, add fields, end (which writes it). */
typedef struct kvf_trace {
    char   b[2048];
    size_t n;
} kvf_trace_t;

void kvf__trace_begin(kvf_trace_t *t, const kvf_room_t *r, const char *event);
void kvf__trace_u64(kvf_trace_t *t, const char *key, uint64_t v);
void kvf__trace_str(kvf_trace_t *t, const char *key, const char *v);
/* "peer": its name, "peer_side", "peer_rank". */
void kvf__trace_peer(kvf_trace_t *t, const kvf_peer_t *p);
void kvf__trace_end(kvf_trace_t *t, kvf_engine_t *eng);

/* The events, each a no-op when tracing is off. */
void kvf__trace_event_(kvf_room_t *r, const char *event);
void kvf__trace_peer_event_(kvf_room_t *r, const char *event, const kvf_peer_t *p,
                            int64_t stream, int64_t pages, int64_t bytes);
void kvf__trace_state_(kvf_room_t *r, kvf_poll_t state);
/* The room's root cause was recorded: f, learned through `via` (NULL:
 * seen here), after the room had succeeded here or not. */
void kvf__trace_failed_(kvf_room_t *r, const kvf_failure_t *f, const kvf_peer_t *via,
                        int after_success);

static inline void kvf__trace_event(kvf_room_t *r, const char *event)
{
    KVF_ASSERT_LOCKED(r->eng);
    if (kvf__tracing(r->eng))
        kvf__trace_event_(r, event);
}

/* stream, pages, bytes: -1 leaves the field out. */
static inline void kvf__trace_peer_event(kvf_room_t *r, const char *event,
                                         const kvf_peer_t *p, int64_t stream,
                                         int64_t pages, int64_t bytes)
{
    KVF_ASSERT_LOCKED(r->eng);
    if (kvf__tracing(r->eng))
        kvf__trace_peer_event_(r, event, p, stream, pages, bytes);
}

static inline void kvf__trace_state(kvf_room_t *r, kvf_poll_t state)
{
    KVF_ASSERT_LOCKED(r->eng);
    if (kvf__tracing(r->eng))
        kvf__trace_state_(r, state);
}

static inline void kvf__trace_failed(kvf_room_t *r, const kvf_failure_t *f,
                                     const kvf_peer_t *via, int after_success)
{
    KVF_ASSERT_LOCKED(r->eng);
    if (kvf__tracing(r->eng))
        kvf__trace_failed_(r, f, via, after_success);
}

#endif /* KVF_CORE_TRACE_H */
