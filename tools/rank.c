/*
 * `kvferry _rank`: one prefill or decode rank of `kvferry demo`, a process
 * of its own, driven like a scheduler drives kvferry.
 *
 * It creates an engine, registers KV buffers shaped like the model's (a
 * pool of pages per buffer, twice what the rooms in flight need, so decode
 * pages can be scattered), says "ready" on stdout, waits for "go" on stdin,
 * then runs the rooms in index order with a window of --concurrency rooms
 * in flight, polling them in a loop as a scheduler step would.
 *
 * Parallel layout: --rank is the process's index within its side, and
 * kvt_opts_coord() gives its dp/pp/tp.  A pipeline stage holds its share
 * of the layers (kvt_stage_layers) and registers them at its first_layer;
 * pattern data is keyed by the GLOBAL buffer index, so decode verifies
 * stage-to-stage and all-stages-into-one alike.  A prefill rank runs only
 * the rooms of its DP group (room % --dp); decode ranks run every room.
 * Only the last prefill stage writes the aux record.
 *
 * Protocol with the orchestrator: stdin carries commands, one per line:
 * "go" (run --requests rooms), "batch FIRST COUNT [SIZES]" (run the rooms
 * of those request indices: the fresh batch after a fault, or a chaos
 * test's rooms), "release INDEX STATE" (every rank of the room is final;
 * STATE is their MIN, Success or Failed), "resume" (end a --hold),
 * "exit".  SIZES gives each room of the batch its own size, as
 * comma-separated TOKENS:CHUNK, one per request (CHUNK: tokens per send,
 * a multiple of --page-size; 0 sends the room at once; TOKENS at most
 * --tokens, which sized the page pools); without it every room has
 * --tokens and --chunk.  Every rank of a run must get the same SIZES.
 * stdout carries events, one JSON object per line:
 *   {"event":"ready", side, rank, addr, at, pid, ...}   at: {dp_rank,
 *        pp_rank, tp_rank, first_layer, num_layers}
 *   {"event":"phase", side, rank, room, index, phase}   bootstrap, waiting,
 *        mid (prefill sent a non-last chunk), last (prefill sent the last
 *        chunk), transferring (decode saw TRANSFERRING)
 *   {"event":"final", side, rank, room, index, state}   the room became
 *        final here (its poll state, as a scheduler all-reduces it)
 *   {"event":"room", side, rank, room, index, state, verified, bytes,
 *        start, end, final_state, outcome, awaited_ms, failure?}
 *                                                       released: the state
 *        and record the room then has
 *   {"event":"result", side, rank, at, rooms[], failures[], bytes, start,
 *        end, stats}                                    after each batch
 *   {"event":"error", side, rank, message}              a fatal setup error
 *
 * Rooms live as a scheduler keeps them: a room that is final here stays
 * (its handle, its pages) until the orchestrator says that every rank of
 * the room, both sides, is final, and with which outcome: the MIN of
 * their states, as SGLang's scheduler all-reduces its ranks' states (the
 * demo's one scheduler spans both servers: report.h).  A rank whose own
 * room has not failed while the outcome is Failed waits, at most
 * KVT_CAUSE_WAIT_MS, for the cause (kvf_*_await_failure, as
 * kvferry.sglang does): it is on its way from the rank that saw it, and a
 * room that had succeeded here may fail too (docs/FAILURES.md, "Every
 * rank of the request names the cause").  Then the rank reports the room
 * as it then is and destroys it.
 *
 * Per-room events let the orchestrator account for rooms of a rank that is
 * later killed, and are what a fault injector keys its timing on.  Logs go
 * to stderr.
 */
#include <errno.h>
#include <inttypes.h>
#include <jansson.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "kvferry/kvferry.h"
#include "cmdin.h"
#include "models.h"
#include "opts.h"
#include "pattern.h"
#include "pool.h"
#include "rank.h"
#include "tool.h"

typedef enum kvt_stage {
    KVT_FREE = 0,   /* window slot unused */
    KVT_BOOT,       /* prefill: waiting for WAITING_FOR_INPUT */
    KVT_SEND,       /* prefill: sending chunks, one per loop turn */
    KVT_WAIT,       /* waiting for SUCCESS or FAILED */
    KVT_FINAL,      /* final here; kept until the orchestrator releases it */
} kvt_stage_t;

/* How long a rank whose room has not failed waits for the cause once the
 * outcome of its ranks says Failed: what kvferry.sglang waits
 * (RELAY_WAIT_S).  The cause comes within milliseconds. */
#define KVT_CAUSE_WAIT_MS 1000

typedef struct kvt_room {
    kvt_stage_t     stage;
    uint32_t        index;
    uint64_t        id;
    kvf_sender_t   *snd;
    kvf_receiver_t *rcv;
    kvf_poll_t      seen;      /* highest state reported as a phase */
    uint32_t        npages;    /* this room's pages (at most room_pages) */
    uint32_t        chunk_pages;  /* prefill: pages per send */
    uint32_t       *pages;     /* room_pages entries, owned by the rank */
    int             has_pages;
    uint32_t        sent;      /* prefill: pages sent so far */
    uint32_t        aux_slot;
    int             has_aux;
    double          start;
    double          final_at;  /* wall clock when it became final here */
    kvf_poll_t      final_state;
    json_t         *failure;   /* a cause this process saw itself, or NULL */
} kvt_room_t;

/* One room's size in a "batch ... SIZES" command. */
typedef struct kvt_size {
    uint32_t tokens;
    uint32_t chunk;   /* tokens per send; 0: the whole room at once */
} kvt_size_t;

/* The longest command line: a batch with a size per room. */
#define KVT_CMD_MAX 8192


/* ------------------------------------------------------------------------ */
/* Events                                                                   */
/* ------------------------------------------------------------------------ */

/* Write one event line and steal `ev`.  stdout is a pipe to the
 * orchestrator: flush per line so it sees progress as it happens. */
void kvt_emit(kvt_rank_t *r, const char *event, json_t *ev)
{
    if (!ev) {
        fprintf(stderr, "kvferry _rank %s[%u]: cannot build the '%s' event "
                "(out of memory?)\n", r->side, r->o.rank, event);
        return;
    }
    json_object_set_new(ev, "event", json_string(event));
    json_object_set_new(ev, "side", json_string(r->side));
    json_object_set_new(ev, "rank", json_integer(r->o.rank));
    char *s = json_dumps(ev, JSON_COMPACT);
    if (s) {
        fputs(s, stdout);
        fputc('\n', stdout);
        fflush(stdout);
        free(s);
    }
    json_decref(ev);
}

/* --hold PHASE[:INDEX] (set by the demo's fault injector): stop the room
 * loop right after the first PHASE event (of request INDEX, if given)
 * until the orchestrator says "resume", so that it can kill or stop a
 * process while the room is exactly there.  The engine's threads run on. */
static void kvt_hold(kvt_rank_t *r, const kvt_room_t *rm, const char *phase)
{
    if (!r->o.hold)
        return;
    size_t n = strcspn(r->o.hold, ":");
    const char *index = r->o.hold[n] == ':' ? r->o.hold + n + 1 : NULL;
    if (strlen(phase) != n || strncmp(r->o.hold, phase, n) != 0 ||
        (index && strtoul(index, NULL, 10) != rm->index))
        return;
    r->o.hold = NULL;   /* once */
    /* Other lines (releases of rooms final everywhere) stay queued. */
    while (!kvt_cmdin_take(&r->cmd, "resume"))
        if (kvt_cmdin_fill(&r->cmd, -1) < 0)
            return;
}

static void kvt_emit_phase(kvt_rank_t *r, const kvt_room_t *rm,
                           const char *phase)
{
    kvt_emit(r, "phase", json_pack("{s:I, s:i, s:s}", "room", (json_int_t)rm->id,
                                   "index", (int)rm->index, "phase", phase));
    kvt_hold(r, rm, phase);
}

void kvt_fatal(kvt_rank_t *r, const char *fmt, ...)
{
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    fprintf(stderr, "kvferry _rank %s[%u]: %s\n", r->side, r->o.rank, msg);
    kvt_emit(r, "error", json_pack("{s:s}", "message", msg));
}

/* A failure record, as reported on stdout. */
static json_t *kvt_failure_json(kvt_rank_t *r, const kvt_room_t *rm,
                                const char *status, const char *reason,
                                int from_another, const char *origin_side,
                                int origin_rank, const char *origin_addr)
{
    return json_pack("{s:I, s:i, s:i, s:s, s:s, s:b, s:s, s:s, s:i, s:s}",
                     "room", (json_int_t)rm->id, "index", (int)rm->index,
                     "rank", (int)r->o.rank, "side", r->side,
                     "reason", reason, "from_another_rank", from_another,
                     "status", status, "origin_side", origin_side,
                     "origin_rank", origin_rank, "origin_addr", origin_addr);
}

/* A failure this process detected itself (a refused call, bad data). */
static json_t *kvt_local_failure(kvt_rank_t *r, const kvt_room_t *rm,
                                 const char *status, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

static json_t *kvt_local_failure(kvt_rank_t *r, const kvt_room_t *rm,
                                 const char *status, const char *fmt, ...)
{
    char reason[KVF_REASON_MAX + 128];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(reason, sizeof(reason), fmt, ap);
    va_end(ap);
    return kvt_failure_json(r, rm, status, reason, 0, r->side, (int)r->o.rank,
                            r->addr);
}

/* The engine's failure record of a FAILED room (consumed here, once). */
static json_t *kvt_engine_failure(kvt_rank_t *r, kvt_room_t *rm)
{
    kvf_failure_t f;
    kvf_failure_init(&f);
    kvf_status_t st = r->prefill ? kvf_sender_failure(rm->snd, &f)
                                 : kvf_receiver_failure(rm->rcv, &f);
    if (st != KVF_OK)
        return kvt_local_failure(r, rm, kvf_status_name(st),
                                 "room FAILED but its failure record could "
                                 "not be read: %s (engine bug)",
                                 kvf_status_str(st));
    f.reason[sizeof(f.reason) - 1] = '\0';
    f.origin_addr[sizeof(f.origin_addr) - 1] = '\0';
    return kvt_failure_json(r, rm, kvf_status_name(f.status), f.reason,
                            f.from_another_rank, kvf_role_name(f.origin_side),
                            f.origin_rank, f.origin_addr);
}

/* ------------------------------------------------------------------------ */
/* Pages                                                                    */
/* ------------------------------------------------------------------------ */

uint8_t *kvt_page(kvt_rank_t *r, uint32_t buffer, uint32_t page)
{
    return r->kv + (size_t)buffer * r->buf_len + (size_t)page * r->g.page_bytes;
}

uint8_t *kvt_aux(kvt_rank_t *r, uint32_t slot)
{
    return r->aux + (size_t)slot * KVT_AUX_SLOT_BYTES;
}

static uint64_t kvt_room_bytes(const kvt_rank_t *r, const kvt_room_t *rm)
{
    return (uint64_t)rm->npages * r->g.page_bytes * r->g.num_buffers;
}

/* Decode: check every byte of every page of every buffer, then the aux
 * record.  @return NULL if all is right, else the failure record. */
static json_t *kvt_verify_room(kvt_rank_t *r, kvt_room_t *rm)
{
    const kvt_geom_t *g = &r->g;
    for (uint32_t b = 0; b < g->num_buffers; b++) {
        for (uint32_t i = 0; i < rm->npages; i++) {
            kvt_mismatch_t mm;
            if (kvt_pattern_verify(kvt_page(r, b, rm->pages[i]), g, rm->id,
                                   g->buf0 + b, i * g->page_size, g->page_size,
                                   &mm) == 0)
                continue;
            return kvt_local_failure(
                r, rm, "VERIFY_FAILED",
                "verification failed after SUCCESS: buffer %u (layer %u %s), "
                "room page %u = decode page %u, token %u, head %u, byte %u: "
                "expected 0x%02x, found 0x%02x (the engine reported data "
                "that is not in place)", mm.buffer,
                mm.buffer / g->buffers_per_layer,
                g->buffers_per_layer == 1 ? "KV" : (mm.buffer % 2 ? "V" : "K"),
                i, rm->pages[i], mm.token, mm.head, mm.byte, mm.expected, mm.got);
        }
    }
    /* The aux record is the last prefill stage's: decode PP 1 gets it on
     * every rank, stage-to-stage only the last decode stage (the others
     * pair with prefill stages that never produce an output token). */
    if (r->o.decode_pp != 1 && r->at.pp + 1 != r->o.decode_pp)
        return NULL;
    char why[256];
    if (kvt_aux_check(kvt_aux(r, rm->aux_slot), rm->id, why, sizeof(why)))
        return kvt_local_failure(r, rm, "VERIFY_FAILED",
                                 "verification failed after SUCCESS: %s", why);
    return NULL;
}

/* Pages and an aux slot for a room.  The pools hold twice what the window
 * of rooms in flight can use, so running out is a bug in this file. */
static void kvt_take(kvt_rank_t *r, kvt_room_t *rm)
{
    if (kvt_pool_take(&r->pages, rm->npages, rm->pages) ||
        kvt_pool_take(&r->slots, 1, &rm->aux_slot)) {
        fprintf(stderr, "kvferry _rank %s[%u]: internal error: page pool "
                "exhausted with %u rooms in flight\n", r->side, r->o.rank,
                r->o.concurrency);
        abort();
    }
    rm->has_pages = rm->has_aux = 1;
}

/*
 * Decode: how many of a new room's pages are not all zero.  Pages go back
 * to the pool zeroed once their room is destroyed (kvt_give_back), and a
 * final room's pages must never be written again: a page found dirty here
 * was written after that (a read that landed late), which the failure
 * model forbids.
 */
static uint32_t kvt_stale_pages(kvt_rank_t *r, const kvt_room_t *rm)
{
    static const uint8_t zero[4096];
    uint32_t stale = 0;
    for (uint32_t i = 0; i < rm->npages; i++) {
        int dirty = 0;
        for (uint32_t b = 0; b < r->g.num_buffers && !dirty; b++) {
            const uint8_t *p = kvt_page(r, b, rm->pages[i]);
            for (size_t off = 0; off < r->g.page_bytes && !dirty; off += sizeof(zero)) {
                size_t n = r->g.page_bytes - off < sizeof(zero) ? r->g.page_bytes - off
                                                                : sizeof(zero);
                dirty = memcmp(p + off, zero, n) != 0;
            }
        }
        stale += (uint32_t)dirty;
    }
    return stale;
}

static void kvt_give_back(kvt_rank_t *r, kvt_room_t *rm)
{
    if (rm->has_pages) {
        /* Decode zeroes what it returns, so a later room that got no data
         * can never verify against stale bytes of an earlier one. */
        if (!r->prefill)
            for (uint32_t b = 0; b < r->g.num_buffers; b++)
                for (uint32_t i = 0; i < rm->npages; i++)
                    memset(kvt_page(r, b, rm->pages[i]), 0, r->g.page_bytes);
        kvt_pool_give(&r->pages, rm->pages, rm->npages);
        rm->has_pages = 0;
    }
    if (rm->has_aux) {
        memset(kvt_aux(r, rm->aux_slot), 0, KVT_AUX_SLOT_BYTES);
        kvt_pool_give(&r->slots, &rm->aux_slot, 1);
        rm->has_aux = 0;
    }
}

/* ------------------------------------------------------------------------ */
/* Rooms                                                                    */
/* ------------------------------------------------------------------------ */

static kvf_poll_t kvt_poll(const kvt_room_t *rm)
{
    return rm->snd ? kvf_sender_poll(rm->snd)
         : rm->rcv ? kvf_receiver_poll(rm->rcv) : KVF_POLL_FAILED;
}

/* The room became final here: say so (the orchestrator reduces the
 * ranks' states) and keep it until it is released.  `failure`: a cause
 * this process saw itself (stolen), else NULL. */
static void kvt_final(kvt_rank_t *r, kvt_room_t *rm, kvf_poll_t state, json_t *failure)
{
    rm->stage = KVT_FINAL;
    rm->final_state = state;
    rm->final_at = kvt_wall_now();
    rm->failure = failure;
    kvt_emit(r, "final", json_pack("{s:I, s:i, s:s}", "room", (json_int_t)rm->id,
                                   "index", (int)rm->index, "state", kvf_poll_name(state)));
}

/* The room is released: verify (decode, SUCCESS), report the state and
 * record it has now, destroy the handle, then give its pages back. */
static void kvt_finish(kvt_rank_t *r, kvt_room_t *rm, kvf_poll_t outcome, double awaited_ms)
{
    double now = kvt_wall_now();
    uint64_t bytes = 0;
    int verified = 0;
    json_t *failure = rm->failure;
    kvf_poll_t state = failure ? KVF_POLL_FAILED : kvt_poll(rm);

    rm->failure = NULL;
    if (state == KVF_POLL_FAILED && !failure)
        failure = kvt_engine_failure(r, rm);
    if (state == KVF_POLL_SUCCESS) {
        if (r->prefill) {
            bytes = kvt_room_bytes(r, rm);
        } else {
            failure = kvt_verify_room(r, rm);
            verified = failure == NULL;
            bytes = verified ? kvt_room_bytes(r, rm) : 0;
        }
    }
    /* Destroy before touching the pages: after kvf_receiver_destroy no
     * write into them can land, and prefill pages are no longer read. */
    if (rm->snd)
        kvf_sender_destroy(rm->snd);
    if (rm->rcv)
        kvf_receiver_destroy(rm->rcv);
    rm->snd = NULL;
    rm->rcv = NULL;
    kvt_give_back(r, rm);

    /* A state that changed after the room was final here (a success a
     * sibling's failure overrode) was seen to change now. */
    double end = state == rm->final_state ? rm->final_at : now;
    r->bytes += bytes;
    if (end > r->last_end)
        r->last_end = end;
    json_t *res = json_pack("{s:I, s:i, s:s, s:o, s:I, s:f, s:f, s:s, s:s, s:f, s:f}",
                            "room", (json_int_t)rm->id, "index", (int)rm->index,
                            "state", kvf_poll_name(state),
                            "verified", r->prefill ? json_null() : json_boolean(verified),
                            "bytes", (json_int_t)bytes, "start", rm->start,
                            "end", end, "final_state", kvf_poll_name(rm->final_state),
                            "outcome", kvf_poll_name(outcome), "awaited_ms", awaited_ms,
                            "released", now);
    if (failure) {
        json_array_append(r->failures, failure);
        json_object_set_new(res, "failure", failure);
    }
    json_array_append_new(r->rooms, res);
    kvt_emit(r, "room", json_copy(res));   /* shallow: the event fields stay out of r->rooms */
    rm->stage = KVT_FREE;
}

/*
 * "release INDEX STATE": every rank of the room is final and STATE is the
 * MIN of their states.  A room that has not failed here while another
 * rank's did waits for the cause until deadline_ms (monotonic), then is
 * reported as it is.
 */
static void kvt_on_release(kvt_rank_t *r, const char *cmd, uint64_t deadline_ms)
{
    unsigned index;
    char state[32];
    kvt_room_t *rm = NULL;
    if (sscanf(cmd, "release %u %31s", &index, state) == 2)
        for (uint32_t i = 0; i < r->o.concurrency && !rm; i++)
            if (r->win[i].stage == KVT_FINAL && r->win[i].index == index)
                rm = &r->win[i];
    if (!rm) {
        fprintf(stderr, "kvferry _rank %s[%u]: ignoring '%s': no room of that request is "
                "final here (orchestrator bug)\n", r->side, r->o.rank, cmd);
        return;
    }
    kvf_poll_t outcome = strcmp(state, kvf_poll_name(KVF_POLL_FAILED)) == 0
                             ? KVF_POLL_FAILED : KVF_POLL_SUCCESS;
    double waited = 0;
    if (outcome == KVF_POLL_FAILED && !rm->failure && kvt_poll(rm) != KVF_POLL_FAILED) {
        uint64_t now = kvt_mono_ms();
        unsigned left = deadline_ms > now ? (unsigned)(deadline_ms - now) : 0;
        double t0 = kvt_wall_now();
        if (rm->snd)
            kvf_sender_await_failure(rm->snd, left);
        else
            kvf_receiver_await_failure(rm->rcv, left);
        waited = (kvt_wall_now() - t0) * 1000.0;
    }
    kvt_finish(r, rm, outcome, waited);
}

/* The orchestrator's lines that came while rooms run. */
static void kvt_commands(kvt_rank_t *r)
{
    /* Rooms released together wait for their causes together: each wait
     * ends KVT_CAUSE_WAIT_MS after the outcome arrived, not after the
     * previous room's wait. */
    uint64_t deadline = kvt_mono_ms() + KVT_CAUSE_WAIT_MS;
    char cmd[128];
    while (kvt_cmdin_next(&r->cmd, cmd, sizeof(cmd))) {
        if (strncmp(cmd, "release ", 8) == 0)
            kvt_on_release(r, cmd, deadline);
        else
            fprintf(stderr, "kvferry _rank %s[%u]: ignoring command '%s' while rooms "
                    "run\n", r->side, r->o.rank, cmd);
    }
}

/* A call the demo makes was refused: the room fails here with that reason,
 * which every rank of the room then names (kvf_*_fail). */
static void kvt_call_failed(kvt_rank_t *r, kvt_room_t *rm, const char *call,
                            kvf_status_t st)
{
    char why[256];
    snprintf(why, sizeof(why), "%s refused the room: %s (%s)", call, kvf_status_str(st),
             kvf_status_name(st));
    if (rm->snd)
        kvf_sender_fail(rm->snd, st, why);
    if (rm->rcv)
        kvf_receiver_fail(rm->rcv, st, why);
    kvt_final(r, rm, KVF_POLL_FAILED, kvt_local_failure(r, rm, kvf_status_name(st), "%s", why));
}

static void kvt_start(kvt_rank_t *r, kvt_room_t *rm, uint32_t index,
                      const kvt_size_t *size)
{
    uint32_t *pages = rm->pages;
    memset(rm, 0, sizeof(*rm));
    rm->pages = pages;
    rm->index = index;
    rm->npages = r->room_pages;
    rm->chunk_pages = r->chunk_pages;
    if (size) {
        rm->npages = kvt_pages_for(size->tokens, r->prefill ? r->o.page_size
                                                            : r->o.decode_page_size);
        rm->chunk_pages = size->chunk ? size->chunk / r->o.page_size : rm->npages;
    }
    rm->id = kvt_room_id(r->o.seed, index);
    rm->start = kvt_wall_now();
    rm->seen = KVF_POLL_BOOTSTRAPPING;
    if (r->first_start == 0)
        r->first_start = rm->start;
    kvf_status_t st;
    if (r->prefill) {
        rm->stage = KVT_BOOT;
        st = kvf_sender_create(r->eng, r->o.registry, rm->id, &rm->snd);
        if (st != KVF_OK) {
            kvt_call_failed(r, rm, "kvf_sender_create", st);
            return;
        }
        kvt_emit_phase(r, rm, "bootstrap");
        return;
    }
    rm->stage = KVT_WAIT;
    st = kvf_receiver_create(r->eng, r->o.registry, rm->id, -1, &rm->rcv);
    if (st != KVF_OK) {
        kvt_call_failed(r, rm, "kvf_receiver_create", st);
        return;
    }
    kvt_emit_phase(r, rm, "bootstrap");
    kvt_take(r, rm);
    uint32_t stale = kvt_stale_pages(r, rm);
    if (stale > 0) {
        json_t *f = kvt_local_failure(r, rm, "STALE_WRITE", "%u of the %u pages given to "
                                      "this room held bytes written after their previous "
                                      "room was final (engine bug)", stale, rm->npages);
        kvf_receiver_fail(rm->rcv, KVF_ERR_ABORTED,
                          json_string_value(json_object_get(f, "reason")));
        kvt_final(r, rm, KVF_POLL_FAILED, f);
        return;
    }
    st = kvf_receiver_init(rm->rcv, rm->pages, rm->npages, rm->aux_slot,
                           NULL, 0);
    if (st != KVF_OK)
        kvt_call_failed(r, rm, "kvf_receiver_init", st);
}

/* Prefill: "compute" one chunk (fill its pages) and send it. */
static void kvt_send_chunk(kvt_rank_t *r, kvt_room_t *rm)
{
    uint32_t n = rm->npages - rm->sent;
    if (n > rm->chunk_pages)
        n = rm->chunk_pages;
    int last = rm->sent + n == rm->npages;
    for (uint32_t b = 0; b < r->g.num_buffers; b++)
        for (uint32_t i = rm->sent; i < rm->sent + n; i++)
            kvt_pattern_fill(kvt_page(r, b, rm->pages[i]), &r->g, rm->id,
                             r->g.buf0 + b, i * r->g.page_size, r->g.page_size);
    /* Only the last stage has the first output token: the engine must take
     * aux from there, and decode's aux check fails if it does not. */
    if (last && r->at.pp + 1 == r->o.prefill_pp)
        kvt_aux_fill(kvt_aux(r, rm->aux_slot), rm->id);
    kvf_status_t st = kvf_sender_send(rm->snd, rm->pages + rm->sent, n, last);
    if (st != KVF_OK) {
        /* Refused because the room failed meanwhile: report that cause. */
        if (kvf_sender_poll(rm->snd) == KVF_POLL_FAILED)
            kvt_final(r, rm, KVF_POLL_FAILED, NULL);
        else
            kvt_call_failed(r, rm, "kvf_sender_send", st);
        return;
    }
    rm->sent += n;
    kvt_emit_phase(r, rm, last ? "last" : "mid");
    if (last)
        rm->stage = KVT_WAIT;
}

/* One poll of one room.  @return 1 if anything happened. */
static int kvt_progress(kvt_rank_t *r, kvt_room_t *rm)
{
    kvf_poll_t st = r->prefill ? kvf_sender_poll(rm->snd)
                               : kvf_receiver_poll(rm->rcv);
    if (st == KVF_POLL_FAILED) {
        kvt_final(r, rm, st, NULL);
        return 1;
    }
    int changed = 0;
    if (st > rm->seen && st < KVF_POLL_SUCCESS) {
        /* Prefill reports its own sends as phases, decode what it sees. */
        if (st == KVF_POLL_WAITING_FOR_INPUT || !r->prefill)
            kvt_emit_phase(r, rm, st == KVF_POLL_WAITING_FOR_INPUT
                                      ? "waiting" : "transferring");
        rm->seen = st;
        changed = 1;
    }
    switch (rm->stage) {
    case KVT_BOOT: {
        if (st < KVF_POLL_WAITING_FOR_INPUT)
            return changed;
        kvt_take(r, rm);
        kvf_status_t s = kvf_sender_init(rm->snd, rm->npages, rm->aux_slot);
        if (s != KVF_OK) {
            kvt_call_failed(r, rm, "kvf_sender_init", s);
            return 1;
        }
        rm->stage = KVT_SEND;
        return 1;
    }
    case KVT_SEND:
        kvt_send_chunk(r, rm);
        return 1;
    case KVT_WAIT:
        if (st == KVF_POLL_SUCCESS) {
            kvt_final(r, rm, st, NULL);
            return 1;
        }
        return changed;
    case KVT_FREE:
    case KVT_FINAL:
        break;
    }
    return changed;
}

/* Is request `index` this rank's?  Decode ranks take every room; a
 * prefill rank only those of its DP group, room % --dp.  Decode receivers
 * pass prefill_dp_rank -1, and the engine picks the same group: prefill
 * registers load_balance_method "follow_bootstrap_room" (the default), so
 * room % dp_size (docs/GUIDE.md). */
static int kvt_owns(const kvt_rank_t *r, uint32_t index)
{
    return !r->prefill || r->o.dp == 1 ||
           kvt_room_id(r->o.seed, index) % r->o.dp == r->at.dp;
}

/* The first request at or after `index`, below `end`, this rank owns. */
static uint32_t kvt_next_owned(const kvt_rank_t *r, uint32_t index, uint32_t end)
{
    while (index < end && !kvt_owns(r, index))
        index++;
    return index;
}

/* Run this rank's rooms of [first, first + count) until each one is
 * final on every rank and released (kvt_on_release); sizes, if not NULL,
 * has one entry per request of the range. */
static void kvt_run(kvt_rank_t *r, uint32_t first, uint32_t count,
                    const kvt_size_t *sizes)
{
    uint32_t end = first + count, total = 0;
    for (uint32_t i = first; i < end; i++)
        total += kvt_owns(r, i);
    uint32_t next = kvt_next_owned(r, first, end), done = 0, inflight = 0;
    uint32_t conc = r->o.concurrency;
    while (done < total) {
        int changed = 0;
        for (uint32_t i = 0; i < conc && next < end; i++) {
            if (r->win[i].stage != KVT_FREE)
                continue;
            /* Every rank starts its rooms in index order, so the windows
             * of all ranks always overlap and no room waits on a peer
             * that has not admitted it. */
            kvt_start(r, &r->win[i], next, sizes ? &sizes[next - first] : NULL);
            next = kvt_next_owned(r, next + 1, end);
            inflight++;
            changed = 1;
        }
        for (uint32_t i = 0; i < conc; i++) {
            kvt_room_t *rm = &r->win[i];
            if (rm->stage == KVT_FREE || rm->stage == KVT_FINAL)
                continue;
            changed |= kvt_progress(r, rm);
        }
        kvt_commands(r);
        uint32_t live = 0;
        for (uint32_t i = 0; i < conc; i++)
            live += r->win[i].stage != KVT_FREE;
        done += inflight - live;
        inflight = live;
        /* Idle: sleep until a command comes, 200 us at most. */
        if (kvt_cmdin_fill(&r->cmd, changed ? 0 : 200 * 1000) < 0 && done < total) {
            fprintf(stderr, "kvferry _rank %s[%u]: the orchestrator is gone (stdin "
                    "closed) with %u rooms unreleased; stopping\n", r->side, r->o.rank,
                    total - done);
            return;
        }
    }
}

/* ------------------------------------------------------------------------ */
/* Setup (memory and engine: rank_setup.c)                                  */
/* ------------------------------------------------------------------------ */

/* The window of rooms in flight, each with room for its page list. */
static int kvt_setup_window(kvt_rank_t *r)
{
    uint32_t conc = r->o.concurrency;
    r->win = calloc(conc, sizeof(*r->win));
    r->page_store = malloc((size_t)conc * r->room_pages * sizeof(uint32_t));
    if (!r->win || !r->page_store) {
        kvt_fatal(r, "out of memory");
        return -1;
    }
    for (uint32_t i = 0; i < conc; i++)
        r->win[i].pages = r->page_store + (size_t)i * r->room_pages;
    return 0;
}

static void kvt_emit_result(kvt_rank_t *r)
{
    kvf_engine_stats_t s;
    kvf_engine_stats_init(&s);
    kvf_engine_stats(r->eng, &s);
    kvt_emit(r, "result", json_pack(
        "{s:s, s:s, s:o, s:O, s:O, s:I, s:f, s:f, s:{s:I, s:I, s:I, s:I}}",
        "addr", r->addr, "transport", kvf_engine_transport(r->eng),
        "at", kvt_rank_coord_json(r),
        "rooms", r->rooms, "failures", r->failures,
        "bytes", (json_int_t)r->bytes, "start", r->first_start, "end", r->last_end,
        "stats", "bytes_sent", (json_int_t)s.bytes_sent,
        "bytes_received", (json_int_t)s.bytes_received,
        "rooms_succeeded", (json_int_t)s.rooms_succeeded,
        "rooms_failed", (json_int_t)s.rooms_failed));
}

/*
 * The SIZES of "batch FIRST COUNT SIZES": COUNT comma-separated
 * TOKENS:CHUNK.  The page pools were sized for --tokens, so no room may
 * be larger; a chunk must end on a page boundary, as --chunk must.
 * @return 0, or -1 with the reason in why.
 */
static int kvt_parse_sizes(const kvt_rank_t *r, const char *text, uint32_t count,
                           kvt_size_t *sizes, char *why, size_t len)
{
    const char *p = text;
    for (uint32_t i = 0; i < count; i++) {
        char *end;
        unsigned long t = strtoul(p, &end, 10), c = 0;
        if (end == p || *end != ':') {
            snprintf(why, len, "size %u of %u: expected TOKENS:CHUNK at '%.40s'",
                     i + 1, count, p);
            return -1;
        }
        p = end + 1;
        c = strtoul(p, &end, 10);
        if (end == p || (*end != ',' && *end != '\0') || (*end == '\0') != (i + 1 == count)) {
            snprintf(why, len, "size %u of %u: expected TOKENS:CHUNK, with one per room "
                     "of the batch, at '%.40s'", i + 1, count, p);
            return -1;
        }
        if (t == 0 || t > r->o.tokens || (c % r->o.page_size) != 0) {
            snprintf(why, len, "size %u of %u: %lu:%lu is not a room this rank can run: "
                     "TOKENS must be 1..--tokens %u, CHUNK 0 or a multiple of --page-size "
                     "%u", i + 1, count, t, c, r->o.tokens, r->o.page_size);
            return -1;
        }
        sizes[i] = (kvt_size_t){ (uint32_t)t, (uint32_t)c };
        p = *end ? end + 1 : end;
    }
    return 0;
}

/* "batch FIRST COUNT [SIZES]": run those rooms, then report. */
static void kvt_batch(kvt_rank_t *r, uint32_t first, uint32_t count, const char *rest)
{
    while (*rest == ' ')
        rest++;
    kvt_size_t *sizes = NULL;
    if (*rest) {
        char why[256];
        sizes = count <= KVT_CMD_MAX ? calloc(count, sizeof(*sizes)) : NULL;
        if (!sizes) {
            kvt_fatal(r, "batch %u %u: a batch with sizes has at most %u rooms",
                      first, count, KVT_CMD_MAX);
            return;
        }
        if (kvt_parse_sizes(r, rest, count, sizes, why, sizeof(why)) != 0) {
            kvt_fatal(r, "batch %u %u: %s", first, count, why);
            free(sizes);
            return;
        }
    }
    kvt_run(r, first, count, sizes);
    free(sizes);
    kvt_emit_result(r);
}

static void kvt_cleanup(kvt_rank_t *r)
{
    if (r->win)
        for (uint32_t i = 0; i < r->o.concurrency; i++) {
            json_decref(r->win[i].failure);
            if (r->win[i].snd)
                kvf_sender_destroy(r->win[i].snd);
            if (r->win[i].rcv)
                kvf_receiver_destroy(r->win[i].rcv);
        }
    if (r->eng)
        kvf_engine_destroy(r->eng);
    kvf_mem_free(r->kv);
    kvt_pool_fini(&r->pages);
    kvt_pool_fini(&r->slots);
    free(r->aux);
    free(r->win);
    free(r->page_store);
    json_decref(r->rooms);
    json_decref(r->failures);
}

int kvt_rank_main(int argc, char **argv)
{
    kvt_rank_t r;
    memset(&r, 0, sizeof(r));
    kvt_opts_defaults(&r.o, KVT_OPTS_RANK);
    if (kvt_opts_parse(&r.o, KVT_OPTS_RANK, argc, argv, 2) != 0 ||
        kvt_opts_resolve(&r.o, KVT_OPTS_RANK) != 0)
        return 2;
    /* The engine's sockets must not kill us; a closed stdout is handled by
     * the orchestrator's death signal instead. */
    signal(SIGPIPE, SIG_IGN);
    r.prefill = strcmp(r.o.role, "prefill") == 0;
    r.side = r.prefill ? "prefill" : "decode";
    r.at = kvt_opts_coord(&r.o, r.prefill, r.o.rank);
    uint32_t page_size = r.prefill ? r.o.page_size : r.o.decode_page_size;
    kvt_geom_init(&r.g, kvt_model_find(r.o.model),
                  kvt_dtype_find(r.prefill ? r.o.kv_dtype : r.o.decode_kv_dtype),
                  r.prefill ? r.o.prefill_tp : r.o.decode_tp, r.at.tp, page_size);
    kvt_geom_set_stage(&r.g, r.prefill ? r.o.prefill_pp : r.o.decode_pp, r.at.pp);
    /* Checked by kvt_opts_resolve. */
    kvt_kv_order_find(r.prefill ? r.o.kv_order : r.o.decode_kv_order, &r.g.kv_order);
    r.room_pages = kvt_pages_for(r.o.tokens, page_size);
    r.chunk_pages = kvt_pages_for(r.o.chunk, page_size);
    r.rooms = json_array();
    r.failures = json_array();

    int rc = 1;
    if (kvt_rank_setup_memory(&r) || kvt_setup_window(&r) ||
        kvt_rank_setup_engine(&r) ||
        (r.o.bench && kvt_bench_rank_prepare(&r)))
        goto out;
    kvt_emit(&r, "ready", json_pack(
        "{s:s, s:s, s:o, s:i, s:i, s:i, s:I, s:I, s:I}", "addr", r.addr,
        "transport", kvf_engine_transport(r.eng), "at", kvt_rank_coord_json(&r),
        "pid", (int)getpid(), "buffers", (int)r.g.num_buffers,
        "heads", (int)r.g.heads_per_rank, "page_bytes", (json_int_t)r.g.page_bytes,
        "pool_pages", (json_int_t)(r.buf_len / r.g.page_bytes),
        "memory_bytes", (json_int_t)r.kv_len));
    /* Commands, one per stdin line (cmdin.h): "go" runs the batch of
     * rooms, "exit" or EOF ends the process.  Ranks that are done keep
     * their engines up until then, so no rank tears down connections that
     * a slower rank still uses. */
    char cmd[KVT_CMD_MAX];
    int ran = 0;
    while (kvt_cmdin_wait(&r.cmd, cmd, sizeof(cmd)) == 0) {
        if (strcmp(cmd, "exit") == 0)
            break;
        if (strcmp(cmd, "go") == 0 && !ran) {
            if (r.o.bench) {
                kvt_bench_rank_run(&r);
            } else {
                kvt_run(&r, 0, r.o.requests, NULL);
                kvt_emit_result(&r);
            }
            ran = 1;
            continue;
        }
        /* A fresh batch, after a fault: "batch FIRST COUNT [SIZES]"
         * (request indices, so room ids never repeat those of the first
         * batch). */
        uint32_t first, count;
        int used = 0;
        if (!r.o.bench && sscanf(cmd, "batch %u %u%n", &first, &count, &used) == 2) {
            kvt_batch(&r, first, count, cmd + used);
            continue;
        }
        fprintf(stderr, "kvferry _rank %s[%u]: ignoring command '%s'\n",
                r.side, r.o.rank, cmd);
    }
    rc = 0;
out:
    kvt_cleanup(&r);
    return rc;
}
