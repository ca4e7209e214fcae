/*
 * Engine metrics: the counting hooks (metrics.h) and kvf_engine_metrics(),
 * which renders them as Prometheus text.
 *
 * A scrape takes the engine lock once, for a snapshot: the counters (a
 * struct copy) and a walk over the attached rooms and the peers for the
 * live figures.  Formatting happens after the lock is released, into the
 * caller's buffer, measured first with snprintf's count (a short or no
 * buffer is left untouched and learns the size) and then written, both
 * from the one snapshot, without a malloc in the library.  Every docs/OPERATIONS.md entry is one metric_*
 * block below; the two must name the same metrics.
 */
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bootstrap/bootstrap.h"
#include "core/room.h"
#include "util/log.h"
#include "util/time.h"

static const double seconds_bounds[KVF_HIST_SECONDS_N] = {
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
    0.25, 0.5, 1, 2.5, 5, 10, 30, 60};

/* 4 KiB to 64 GiB, a factor of 4 apart. */
static uint64_t bytes_bound(unsigned i)
{
    return 4096ull << (2 * i);
}

static void hist_add(kvf_hist_t *h, double v, int bytes)
{
    unsigned n = bytes ? KVF_HIST_BYTES_N : KVF_HIST_SECONDS_N;
    for (unsigned i = 0; i < n; i++)
        if (bytes ? v <= (double)bytes_bound(i) : v <= seconds_bounds[i]) {
            h->bucket[i]++;
            break;
        }
    h->count++;
    h->sum += v;
}

unsigned kvf__metrics_path(const kvf_mover_ops_t *ops, int staged)
{
    return staged ? KVF_PATH_STAGED : kvf_mover_path(ops);
}

/* A path's `path` label: the transport's own name, or "staged". */
static const char *path_name(unsigned path)
{
    return path == KVF_PATH_STAGED ? "staged" : kvf_transport_name(path);
}

/* Whether this build has transport path i (tcp always: the control stream). */
static int path_built(unsigned i)
{
    const char *name = kvf_transport_name(i);
    return i == KVF_PATH_TCP || (name != NULL && kvf_mover_find(name, strlen(name)) != NULL);
}

void kvf__metrics_room_final(kvf_room_t *r, const kvf_failure_t *f, int reversed)
{
    KVF_ASSERT_LOCKED(r->eng);
    kvf_metrics_t *m = &r->eng->metrics;
    int res = f != NULL ? KVF_MET_FAILED : KVF_MET_SUCCESS;
    uint64_t final = atomic_load_explicit(&r->t_final_ns, memory_order_relaxed);

    m->rooms_final[res]++;
    m->rooms_reversed += reversed != 0;
    hist_add(&m->room_seconds[res], (double)(final - r->t_create_ns) * 1e-9, 0);
    if (f != NULL) {
        unsigned code = f->status < 0 && f->status > -KVF_MET_STATUS_N
                      ? (unsigned)-f->status : KVF_MET_STATUS_N;
        m->failures[code][f->from_another_rank ? KVF_MET_REMOTE : KVF_MET_LOCAL]++;
        return;
    }
    uint64_t dest = atomic_load_explicit(&r->t_dest_ns, memory_order_relaxed);
    uint64_t from = dest ? dest : r->t_create_ns;
    hist_add(&m->transfer_seconds, (double)(final - from) * 1e-9, 0);
    hist_add(&m->room_bytes, (double)atomic_load_explicit(&r->bytes, memory_order_relaxed), 1);
}

/* ------------------------------------------------------------------------ */
/* Snapshot                                                                  */
/* ------------------------------------------------------------------------ */

enum { PEER_CONNECTING, PEER_AUTH, PEER_HANDSHAKE, PEER_READY, PEER_NSTATES };
static const char *const peer_states[PEER_NSTATES] = {
    "connecting", "authenticating", "handshake", "ready"};
static const char *const poll_labels[5] = {
    "failed", "bootstrapping", "waiting_for_input", "transferring", "success"};

typedef struct snap {
    kvf_metrics_t m;
    uint64_t      live[5];
    /* [sibling][state][path]; a peer not ready has no path yet: slot 0 */
    uint64_t      peers[2][PEER_NSTATES][KVF_PATHS];
    uint64_t      auth_refused, msgs_dropped, stash_dropped, reads_inflight;
} snap_t;

static int peer_state(kvf_peer_state_t s)
{
    switch (s) {
    case KVF_PEER_CONNECTING:
    case KVF_PEER_REDIAL:    return PEER_CONNECTING;
    case KVF_PEER_AUTH:      return PEER_AUTH;
    case KVF_PEER_HANDSHAKE: return PEER_HANDSHAKE;
    case KVF_PEER_READY:     return PEER_READY;
    default:                 return -1;      /* dead: about to be unlinked */
    }
}

static void take_snapshot(kvf_engine_t *eng, snap_t *s)
{
    memset(s, 0, sizeof(*s));
    kvf__lock(eng);
    s->m = eng->metrics;
    /* The rooms as the application has them: created (a lane may not have
     * taken one in yet, so not on eng->rooms) and not destroyed.  A room
     * leaves the id map under both locks before it is freed. */
    pthread_mutex_lock(&eng->ids_lock);
    kvf_room_t *r;
    for (size_t pos = 0; (r = kvf_map_next(&eng->rooms_by_id, &pos)) != NULL;)
        if (!room_closing(r))    /* destroyed, not yet taken out */
            s->live[atomic_load_explicit(&r->state, memory_order_relaxed)]++;
    pthread_mutex_unlock(&eng->ids_lock);
    for (kvf_peer_t *p = eng->peers; p != NULL; p = p->next) {
        int st = peer_state(p->state);
        if (st < 0)
            continue;
        unsigned path = st == PEER_READY && !p->watch_only ? kvf__metrics_path(p->mover, 0)
                                                           : 0;
        s->peers[p->watch_only ? 1 : 0][st][path]++;
    }
    s->auth_refused = eng->auth_refused;
    s->msgs_dropped = eng->room_msgs_dropped;
    s->stash_dropped = eng->stash_dropped;
    s->reads_inflight = eng->reads_inflight;
    kvf__unlock(eng);
}

/* ------------------------------------------------------------------------ */
/* Text                                                                      */
/* ------------------------------------------------------------------------ */

/* Output into the caller's buffer; `need` counts what did not fit too. */
typedef struct out {
    char  *buf;
    size_t len, need;
} out_t;

__attribute__((format(printf, 2, 3)))
static void put(out_t *o, const char *fmt, ...)
{
    va_list ap;
    size_t room = o->need < o->len ? o->len - o->need : 0;
    va_start(ap, fmt);
    int n = vsnprintf(room ? o->buf + o->need : NULL, room, fmt, ap);
    va_end(ap);
    if (n > 0)
        o->need += (size_t)n;
}

static void head(out_t *o, const char *name, const char *type, const char *help)
{
    put(o, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
}

/* One histogram series: cumulative buckets, +Inf, sum, count.  `labels`
 * are the series' own (without braces, may be ""). */
static void hist(out_t *o, const char *name, const char *labels, const kvf_hist_t *h,
                 int bytes)
{
    unsigned n = bytes ? KVF_HIST_BYTES_N : KVF_HIST_SECONDS_N;
    const char *sep = labels[0] ? "," : "";
    uint64_t cum = 0;
    for (unsigned i = 0; i < n; i++) {
        cum += h->bucket[i];
        if (bytes)
            put(o, "%s_bucket{%s%sle=\"%" PRIu64 "\"} %" PRIu64 "\n", name, labels, sep,
                bytes_bound(i), cum);
        else
            put(o, "%s_bucket{%s%sle=\"%g\"} %" PRIu64 "\n", name, labels, sep,
                seconds_bounds[i], cum);
    }
    put(o, "%s_bucket{%s%sle=\"+Inf\"} %" PRIu64 "\n", name, labels, sep, h->count);
    put(o, "%s_sum{%s} %.9g\n%s_count{%s} %" PRIu64 "\n", name, labels, h->sum, name,
        labels, h->count);
}

static void metric_info(out_t *o, const kvf_engine_t *eng, const char *side)
{
    const kvf_engine_params_t *p = &eng->params;
    head(o, "kvferry_engine_info", "gauge",
         "This engine: its side, parallel coordinates, control address and instance (1).");
    put(o, "kvferry_engine_info{side=\"%s\",tp_rank=\"%d\",tp_size=\"%d\",pp_rank=\"%d\","
        "pp_size=\"%d\",dp_rank=\"%d\",dp_size=\"%d\",address=\"%s\",instance=\"%016" PRIx64
        "\",version=\"%s\"} 1\n", side, p->tp_rank, p->tp_size, p->pp_rank, p->pp_size,
        p->dp_rank, p->dp_size, eng->addr, eng->instance_id, kvf_version());
}

static void metric_rooms(out_t *o, const snap_t *s, const char *side)
{
    head(o, "kvferry_engine_rooms", "gauge",
         "Rooms attached to this engine (not yet destroyed), by poll state.");
    for (int st = 0; st < 5; st++)
        put(o, "kvferry_engine_rooms{side=\"%s\",state=\"%s\"} %" PRIu64 "\n", side,
            poll_labels[st], s->live[st]);
    head(o, "kvferry_engine_rooms_total", "counter",
         "Rooms that turned final, by final state (a room that succeeded and then "
         "failed counts in both, and in kvferry_engine_rooms_reversed_total).");
    put(o, "kvferry_engine_rooms_total{side=\"%s\",state=\"success\"} %" PRIu64 "\n"
        "kvferry_engine_rooms_total{side=\"%s\",state=\"failed\"} %" PRIu64 "\n", side,
        s->m.rooms_final[KVF_MET_SUCCESS], side, s->m.rooms_final[KVF_MET_FAILED]);
    head(o, "kvferry_engine_rooms_reversed_total", "counter",
         "Rooms that succeeded here and then failed: their request failed on another rank.");
    put(o, "kvferry_engine_rooms_reversed_total{side=\"%s\"} %" PRIu64 "\n", side,
        s->m.rooms_reversed);
}

static void failure_row(out_t *o, const snap_t *s, const char *side, const char *name,
                        unsigned code, int always)
{
    static const char *const origin[2] = {"local", "another_rank"};
    for (int k = 0; k < 2; k++)
        if (always || s->m.failures[code][k] != 0)
            put(o, "kvferry_engine_room_failures_total{side=\"%s\",status=\"%s\","
                "origin=\"%s\"} %" PRIu64 "\n", side, name, origin[k], s->m.failures[code][k]);
}

static void metric_failures(out_t *o, const snap_t *s, const char *side)
{
    head(o, "kvferry_engine_room_failures_total", "counter",
         "Rooms that failed, by the status of their root cause and by where it was "
         "seen: on this rank (local) or on another rank, learned from it (another_rank).");
#define KVF_MET_ROW_(name, value, text) \
    if ((value) < 0 && (value) > -KVF_MET_STATUS_N) \
        failure_row(o, s, side, #name, (unsigned)-(value), 1);
    KVF_STATUS_TABLE(KVF_MET_ROW_)
#undef KVF_MET_ROW_
    failure_row(o, s, side, "other", KVF_MET_STATUS_N, 0);
}

static void metric_histograms(out_t *o, const snap_t *s, const char *side)
{
    char l[64];
    head(o, "kvferry_engine_room_duration_seconds", "histogram",
         "Seconds from a room's creation until it turned final, by final state.");
    snprintf(l, sizeof(l), "side=\"%s\",state=\"success\"", side);
    hist(o, "kvferry_engine_room_duration_seconds", l, &s->m.room_seconds[KVF_MET_SUCCESS], 0);
    snprintf(l, sizeof(l), "side=\"%s\",state=\"failed\"", side);
    hist(o, "kvferry_engine_room_duration_seconds", l, &s->m.room_seconds[KVF_MET_FAILED], 0);
    snprintf(l, sizeof(l), "side=\"%s\"", side);
    head(o, "kvferry_engine_room_transfer_seconds", "histogram",
         "Seconds from the moment a room's decode pages were known until SUCCESS, "
         "per room that succeeded.");
    hist(o, "kvferry_engine_room_transfer_seconds", l, &s->m.transfer_seconds, 0);
    head(o, "kvferry_engine_room_payload_bytes", "histogram",
         "Payload bytes this rank sent (prefill) or placed (decode), per room that succeeded.");
    hist(o, "kvferry_engine_room_payload_bytes", l, &s->m.room_bytes, 1);
}

static void metric_paths(out_t *o, const snap_t *s, const char *side, int prefill)
{
    head(o, "kvferry_engine_payload_bytes_total", "counter",
         "KV payload bytes sent (prefill) or placed (decode), by path: tcp (in the "
         "stream), staged (device memory through bounce buffers), or a mover.");
    for (unsigned p = 0; p < KVF_PATHS; p++)
        if (p == KVF_PATH_STAGED || path_built(p))
            put(o, "kvferry_engine_payload_bytes_total{side=\"%s\",direction=\"%s\","
                "path=\"%s\"} %" PRIu64 "\n", side, prefill ? "sent" : "received",
                path_name(p), s->m.path_bytes[p]);
}

static void metric_peers(out_t *o, const snap_t *s)
{
    static const char *const kind[2] = {"payload", "sibling"};
    head(o, "kvferry_engine_peers", "gauge",
         "Connections to other engines, by kind (payload, or a sibling link that "
         "carries only a room's failure), payload path and state.");
    for (int k = 0; k < 2; k++)
        for (int st = 0; st < PEER_NSTATES; st++) {
            if (st != PEER_READY || k == 1) {
                put(o, "kvferry_engine_peers{kind=\"%s\",path=\"%s\",state=\"%s\"} %" PRIu64
                    "\n", kind[k], st == PEER_READY ? "none" : "pending", peer_states[st],
                    s->peers[k][st][0]);
                continue;
            }
            for (unsigned p = 0; p < KVF_PATHS_MAX; p++)
                if (path_built(p))
                    put(o, "kvferry_engine_peers{kind=\"payload\",path=\"%s\",state=\"ready\"} "
                        "%" PRIu64 "\n", path_name(p), s->peers[0][st][p]);
        }
}

static void metric_counters(out_t *o, const snap_t *s)
{
    head(o, "kvferry_engine_heartbeat_losses_total", "counter",
         "Peers declared dead because they sent nothing for the heartbeat timeout.");
    put(o, "kvferry_engine_heartbeat_losses_total %" PRIu64 "\n", s->m.heartbeat_losses);
    head(o, "kvferry_engine_auth_refused_total", "counter",
         "Connections refused before the peer authenticated (wrong or no cluster token, "
         "protected mode, too many unauthenticated, no descriptor).");
    put(o, "kvferry_engine_auth_refused_total %" PRIu64 "\n", s->auth_refused);
    head(o, "kvferry_engine_room_messages_dropped_total", "counter",
         "Room messages from an authenticated peer the room is not bound to, or naming "
         "another instance of the room: dropped, they changed nothing.");
    put(o, "kvferry_engine_room_messages_dropped_total %" PRIu64 "\n", s->msgs_dropped);
    head(o, "kvferry_engine_stash_dropped_total", "counter",
         "Prefill: messages kept for rooms without a sender yet, dropped to stay bounded.");
    put(o, "kvferry_engine_stash_dropped_total %" PRIu64 "\n", s->stash_dropped);
    head(o, "kvferry_engine_acks_repeated_total", "counter",
         "Decode: DONE_ACKs said again to a prefill rank on a new connection, after the "
         "one they were first sent on reset before the prefill rank confirmed them.");
    put(o, "kvferry_engine_acks_repeated_total %" PRIu64 "\n", s->m.acks_repeated);
    head(o, "kvferry_engine_reads_in_flight", "gauge",
         "Decode: reads of a mover (shm, ucx, cuda) or staged copies into room pages "
         "in flight now.");
    put(o, "kvferry_engine_reads_in_flight %" PRIu64 "\n", s->reads_inflight);
}

static void render(out_t *o, const kvf_engine_t *eng, const snap_t *s)
{
    const char *side = kvf_role_name(eng->params.role);
    metric_info(o, eng, side);
    metric_rooms(o, s, side);
    metric_failures(o, s, side);
    metric_histograms(o, s, side);
    metric_paths(o, s, side, eng->params.role == KVF_ROLE_PREFILL);
    metric_peers(o, s);
    metric_counters(o, s);
}

kvf_status_t kvf_engine_metrics(kvf_engine_t *eng, char *buf, size_t len, size_t *needed_p)
{
    if (eng == NULL)
        return KVF_ERR_INVALID_PARAM;
    snap_t snap;
    take_snapshot(eng, &snap);
    /* Measured first, so that a short buffer is left untouched. */
    out_t o = {0};
    render(&o, eng, &snap);
    if (needed_p != NULL)
        *needed_p = o.need + 1;
    if (buf == NULL || o.need + 1 > len)
        return KVF_ERR_AGAIN;
    o = (out_t){.buf = buf, .len = len};
    render(&o, eng, &snap);
    return KVF_OK;
}

/* ------------------------------------------------------------------------ */
/* The endpoint                                                              */
/* ------------------------------------------------------------------------ */

/* The scrape server's thread: the text, in a buffer it frees. */
static int scrape_text(void *arg, char **text_p)
{
    kvf_engine_t *eng = arg;
    size_t len = 16384, need = 0;
    for (int tries = 0; tries < 4; tries++) {
        char *b = malloc(len);
        if (b == NULL)
            return -1;
        kvf_status_t st = kvf_engine_metrics(eng, b, len, &need);
        if (st == KVF_OK) {
            *text_p = b;
            return 0;
        }
        free(b);
        if (st != KVF_ERR_AGAIN)
            return -1;
        len = need + need / 4;      /* the text may grow between the calls */
    }
    return -1;
}

/*
 * "host:PORT+": every rank of a server on one setting, each on its own
 * port: PORT plus the rank's index in its server (DP group, stage, TP
 * rank), so that a scrape config can list them.  @return 0, or -1 when
 * the port would pass 65535.
 */
static int port_per_rank(const kvf_engine_t *eng, const char *spec, char *out, size_t len)
{
    const kvf_engine_params_t *p = &eng->params;
    size_t n = strlen(spec);
    const char *colon = strrchr(spec, ':');
    snprintf(out, len, "%s", spec);
    if (n == 0 || spec[n - 1] != '+' || colon == NULL)
        return 0;
    long port = strtol(colon + 1, NULL, 10);
    if (port > 0)
        port += ((long)p->dp_rank * p->pp_size + p->pp_rank) * p->tp_size + p->tp_rank;
    if (port > 65535)
        return -1;
    snprintf(out + (colon - spec) + 1, len - (size_t)(colon - spec) - 1, "%ld", port);
    return 0;
}

kvf_status_t kvf__metrics_start_unlocked(kvf_engine_t *eng)
{
    const char *spec = eng->params.metrics_addr;
    char addr[160];
    if (spec == NULL || spec[0] == '\0')
        spec = getenv("KVF_METRICS_ADDR");
    eng->params.metrics_addr = NULL;      /* the caller's string: never kept */
    if (spec == NULL || spec[0] == '\0')
        return KVF_OK;
    if (port_per_rank(eng, spec, addr, sizeof(addr)) != 0) {
        kvf_error("metrics endpoint '%s': this rank's port (the base plus its index) is "
                  "past 65535: pick a lower base", spec);
        return KVF_ERR_INVALID_PARAM;
    }
    kvf_status_t st = kvf__scrape_create(addr, eng->has_token, eng->auth_open, scrape_text,
                                         eng, &eng->scrape, eng->metrics_addr,
                                         sizeof(eng->metrics_addr));
    if (st != KVF_OK)
        return st;
    eng->params.metrics_addr = eng->metrics_addr;
    kvf_info("%s engine rank %d: metrics at http://%s/metrics", kvf_role_name(eng->params.role),
             eng->params.tp_rank, eng->metrics_addr);
    return KVF_OK;
}

void kvf__metrics_stop_unlocked(kvf_engine_t *eng)
{
    if (eng->scrape != NULL)
        kvf__scrape_destroy(eng->scrape);
    eng->scrape = NULL;
}

kvf_status_t kvf_engine_metrics_addr(const kvf_engine_t *eng, char *buf, size_t len)
{
    if (eng == NULL || buf == NULL)
        return KVF_ERR_INVALID_PARAM;
    if (eng->scrape == NULL)
        return KVF_ERR_STATE;
    if (len <= strlen(eng->metrics_addr))
        return KVF_ERR_INVALID_PARAM;
    strcpy(buf, eng->metrics_addr);
    return KVF_OK;
}
