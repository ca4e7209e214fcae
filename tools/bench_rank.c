/*
 * The bench loop of one rank process (`kvferry _rank --bench`): rooms as a
 * scheduler runs them, with nothing timed that a real server would not do.
 *
 * The one idea: the window of rooms in flight is the only work in the
 * timed path.  Prefill never generates data per room: each window slot owns
 * a fixed run of prefill pages, filled once before "ready" (with --verify;
 * otherwise their content does not matter to a transfer and they are only
 * populated).  Decode takes pages from the pool (consecutive or scattered)
 * and gives them back untouched unless --verify asks it to check and zero
 * them; the CPU time of that check is measured and left out of cpu_s.
 *
 * Nothing per room goes to the orchestrator while the clock runs (a JSON
 * line per room would cost more than a small room's transfer).  Each rank
 * keeps one CLOCK_MONOTONIC timestamp per room (prefill: just before the
 * send of the last chunk; decode: when its poll first saw SUCCESS) and
 * ships them all in its "result" line; CLOCK_MONOTONIC is one clock for
 * every process of a Linux host, so the orchestrator can subtract them.
 * A "progress" line goes out every 250 ms for the live display.
 *
 * Between passes that changed nothing the loop sleeps, backing off from
 * 20 us to 1 ms, so decode's timestamp is late by up to the sleep it was
 * in; --spin yields the CPU instead of sleeping, and the timestamp is the
 * library's SUCCESS to within a pass.
 *
 * --duration: the orchestrator sends "stop" when time is up; each rank
 * stops admitting rooms and answers {"event":"admitted","next":N}; the
 * orchestrator then sends "until M" (the largest N) and every rank runs
 * rooms up to M, so both sides hold the same set of rooms.
 *
 * --relay: how fast a failure reaches every rank of a room.  Every prefill
 * rank sends a room's first chunk and no more, so no pair can finish it;
 * prefill rank 0 then aborts it (its timestamp: just before
 * kvf_sender_abort, which records the cause).  Every other rank notes when
 * its poll first saw the room FAILED, and checks that its record names
 * that abort (learned from prefill rank 0); a room whose record names
 * anything else counts as failed.  Polls back off to 50 us at most here,
 * so a timestamp is late by that much at worst.
 */
#include <errno.h>
#include <inttypes.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

#include "pattern.h"
#include "rank.h"
#include "tool.h"

/* Room id whose pattern every prefill page carries (data is per slot, not
 * per room); the aux record still carries each room's own id. */
#define KVT_BENCH_DATA_ROOM 0x42454E4348ull   /* "BENCH" */
#define KVT_BENCH_FAILURES  8                 /* failure records kept */
#define KVT_BENCH_IDLE_NS   20000             /* first sleep when a pass did nothing */
#define KVT_BENCH_IDLE_MAX  1000000           /* ... doubling up to this */
#define KVT_RELAY_IDLE_MAX  50000             /* ... or this, with --relay */

enum { KVT_B_FREE = 0, KVT_B_BOOT, KVT_B_SEND, KVT_B_WAIT };

typedef struct kvt_bslot {
    int             stage;
    uint32_t        index;
    uint64_t        id;
    kvf_sender_t   *snd;
    kvf_receiver_t *rcv;
    uint32_t       *pages;     /* room_pages entries */
    uint32_t        sent;      /* prefill: pages sent so far */
} kvt_bslot_t;

typedef struct kvt_bench_rank {
    kvt_rank_t  *r;
    kvt_bslot_t *slots;
    uint32_t    *page_store;
    uint64_t    *t_ns;         /* per room index; 0 = not succeeded */
    size_t       t_cap;
    uint32_t     next, limit, done, failed;
    int          paused;       /* --duration: "stop" received */
    int          limit_known;
    uint64_t     bytes;
    double       verify_cpu_s;
    json_t      *failures;
} kvt_bench_rank_t;

static uint64_t kvt_mono_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static double kvt_thread_cpu_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static double kvt_rusage_cpu_s(void)
{
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    return (double)ru.ru_utime.tv_sec + ru.ru_utime.tv_usec * 1e-6 +
           (double)ru.ru_stime.tv_sec + ru.ru_stime.tv_usec * 1e-6;
}

/* VmHWM from /proc/self/status, in KiB (0 if unreadable). */
static long kvt_vm_hwm_kb(void)
{
    FILE *f = fopen("/proc/self/status", "r");
    char line[256];
    long kb = 0;
    while (f && fgets(line, sizeof(line), f))
        if (sscanf(line, "VmHWM: %ld kB", &kb) == 1)
            break;
    if (f)
        fclose(f);
    return kb;
}

int kvt_bench_rank_prepare(kvt_rank_t *r)
{
    if (!r->prefill || !r->o.verify)
        return 0;
    for (uint32_t w = 0; w < r->o.concurrency; w++)
        for (uint32_t b = 0; b < r->g.num_buffers; b++)
            for (uint32_t i = 0; i < r->room_pages; i++)
                kvt_pattern_fill(kvt_page(r, b, w * r->room_pages + i), &r->g,
                                 KVT_BENCH_DATA_ROOM, b, i * r->g.page_size,
                                 r->g.page_size);
    return 0;
}

/* ------------------------------------------------------------------------ */
/* Rooms                                                                    */
/* ------------------------------------------------------------------------ */

static int kvt_bench_note_time(kvt_bench_rank_t *b, uint32_t index, uint64_t t)
{
    if (index >= b->t_cap) {
        size_t cap = b->t_cap ? 2 * b->t_cap : 4096;
        while (cap <= index)
            cap *= 2;
        uint64_t *v = realloc(b->t_ns, cap * sizeof(*v));
        if (!v)
            return -1;
        memset(v + b->t_cap, 0, (cap - b->t_cap) * sizeof(*v));
        b->t_ns = v;
        b->t_cap = cap;
    }
    b->t_ns[index] = t;
    return 0;
}

static void kvt_bench_failure(kvt_bench_rank_t *b, kvt_bslot_t *s,
                              const char *status, const char *reason)
{
    b->failed++;
    if (json_array_size(b->failures) < KVT_BENCH_FAILURES)
        json_array_append_new(b->failures, json_pack(
            "{s:i, s:I, s:s, s:s}", "index", (int)s->index,
            "room", (json_int_t)s->id, "status", status, "reason", reason));
}

/* Decode, --verify: every byte of every page, the aux tag, then zero them
 * so a later room cannot pass on stale bytes.  @return 0 if all is right. */
static int kvt_bench_verify(kvt_bench_rank_t *b, kvt_bslot_t *s, char *why,
                            size_t len)
{
    kvt_rank_t *r = b->r;
    double t = kvt_thread_cpu_s();
    int bad = 0;
    for (uint32_t k = 0; k < r->g.num_buffers && !bad; k++)
        for (uint32_t i = 0; i < r->room_pages && !bad; i++) {
            kvt_mismatch_t mm;
            if (kvt_pattern_verify(kvt_page(r, k, s->pages[i]), &r->g,
                                   KVT_BENCH_DATA_ROOM, k, i * r->g.page_size,
                                   r->g.page_size, &mm) != 0) {
                snprintf(why, len, "verification failed after SUCCESS: buffer "
                         "%u, room page %u = decode page %u, token %u, head %u, "
                         "byte %u: expected 0x%02x, found 0x%02x", mm.buffer, i,
                         s->pages[i], mm.token, mm.head, mm.byte, mm.expected,
                         mm.got);
                bad = 1;
            }
        }
    uint32_t w = (uint32_t)(s - b->slots);
    if (!bad && kvt_aux_check(kvt_aux(r, w), s->id, why, len))
        bad = 1;
    for (uint32_t k = 0; k < r->g.num_buffers; k++)
        for (uint32_t i = 0; i < r->room_pages; i++)
            memset(kvt_page(r, k, s->pages[i]), 0, r->g.page_bytes);
    memset(kvt_aux(r, w), 0, KVT_AUX_SLOT_BYTES);
    b->verify_cpu_s += kvt_thread_cpu_s() - t;
    return bad ? -1 : 0;
}

/* Destroy the slot's room, return its pages, count it done. */
static void kvt_bench_release(kvt_bench_rank_t *b, kvt_bslot_t *s)
{
    if (s->snd)
        kvf_sender_destroy(s->snd);
    if (s->rcv)
        kvf_receiver_destroy(s->rcv);
    s->snd = NULL;
    s->rcv = NULL;
    if (!b->r->prefill && s->pages)
        kvt_pool_give(&b->r->pages, s->pages, b->r->room_pages);
    s->stage = KVT_B_FREE;
    b->done++;
}

/* The room is final here: account for it and free its slot. */
static void kvt_bench_finish(kvt_bench_rank_t *b, kvt_bslot_t *s,
                             kvf_poll_t state, uint64_t t)
{
    kvt_rank_t *r = b->r;
    if (state == KVF_POLL_SUCCESS) {
        char why[KVF_REASON_MAX];
        if (!r->prefill && r->o.verify && kvt_bench_verify(b, s, why, sizeof(why))) {
            kvt_bench_failure(b, s, "VERIFY_FAILED", why);
        } else {
            b->bytes += (uint64_t)r->room_pages * r->g.page_bytes * r->g.num_buffers;
            if (!r->prefill && kvt_bench_note_time(b, s->index, t) != 0)
                kvt_bench_failure(b, s, "KVF_ERR_NO_MEMORY", "out of memory "
                                  "for room timestamps");
        }
    } else {
        kvf_failure_t f;
        kvf_failure_init(&f);
        kvf_status_t st = r->prefill ? kvf_sender_failure(s->snd, &f)
                                     : kvf_receiver_failure(s->rcv, &f);
        f.reason[sizeof(f.reason) - 1] = '\0';
        kvt_bench_failure(b, s, kvf_status_name(st == KVF_OK ? f.status : st),
                          st == KVF_OK ? f.reason : "room FAILED without a "
                          "failure record (engine bug)");
        if (r->prefill)   /* its last-send time must not count */
            kvt_bench_note_time(b, s->index, 0);
    }
    kvt_bench_release(b, s);
}

/* A call was refused: fail the room here; the abort tells its peers. */
static void kvt_bench_refused(kvt_bench_rank_t *b, kvt_bslot_t *s,
                              const char *call, kvf_status_t st)
{
    char why[256];
    snprintf(why, sizeof(why), "%s refused the room: %s", call, kvf_status_str(st));
    if (s->snd)
        kvf_sender_abort(s->snd);
    if (s->rcv)
        kvf_receiver_abort(s->rcv);
    kvt_bench_failure(b, s, kvf_status_name(st), why);
    if (b->r->prefill)
        kvt_bench_note_time(b, s->index, 0);
    kvt_bench_release(b, s);
}

static void kvt_bench_start(kvt_bench_rank_t *b, kvt_bslot_t *s)
{
    kvt_rank_t *r = b->r;
    uint32_t w = (uint32_t)(s - b->slots);
    s->index = b->next++;
    s->id = kvt_room_id(r->o.seed, s->index);
    s->sent = 0;
    s->snd = NULL;
    s->rcv = NULL;
    kvf_status_t st;
    if (r->prefill) {
        s->stage = KVT_B_BOOT;
        for (uint32_t i = 0; i < r->room_pages; i++)
            s->pages[i] = w * r->room_pages + i;
        st = kvf_sender_create(r->eng, r->o.registry, s->id, &s->snd);
        if (st != KVF_OK)
            kvt_bench_refused(b, s, "kvf_sender_create", st);
        return;
    }
    s->stage = KVT_B_WAIT;
    if (kvt_pool_take(&r->pages, r->room_pages, s->pages) != 0) {
        fprintf(stderr, "kvferry _rank decode[%u]: internal error: page pool "
                "exhausted\n", r->o.rank);
        abort();
    }
    st = kvf_receiver_create(r->eng, r->o.registry, s->id, -1, &s->rcv);
    if (st == KVF_OK)
        st = kvf_receiver_init(s->rcv, s->pages, r->room_pages, w, NULL, 0);
    if (st != KVF_OK)
        kvt_bench_refused(b, s, s->rcv ? "kvf_receiver_init"
                                       : "kvf_receiver_create", st);
}

/* --relay: the room is final here at t (prefill rank 0: failed by its own
 * abort, timed when it aborted).  Note when, if it names that abort. */
static void kvt_bench_relay_final(kvt_bench_rank_t *b, kvt_bslot_t *s, kvf_poll_t st,
                                  uint64_t t)
{
    kvt_rank_t *r = b->r;
    int cause = r->prefill && r->o.rank == 0;
    kvf_failure_t f;
    kvf_failure_init(&f);
    kvf_status_t got = st != KVF_POLL_FAILED ? KVF_ERR_STATE
                     : r->prefill ? kvf_sender_failure(s->snd, &f)
                                  : kvf_receiver_failure(s->rcv, &f);
    f.reason[sizeof(f.reason) - 1] = '\0';
    char why[KVF_REASON_MAX + 128] = "";
    if (st != KVF_POLL_FAILED)
        snprintf(why, sizeof(why), "the room ended %s, though prefill rank 0 aborted it",
                 kvf_poll_name(st));
    else if (got != KVF_OK)
        snprintf(why, sizeof(why), "FAILED without a failure record (engine bug)");
    else if (f.status != KVF_ERR_ABORTED || f.origin_side != KVF_ROLE_PREFILL ||
             f.origin_rank != 0 || f.from_another_rank == cause)
        snprintf(why, sizeof(why), "its record names another cause than prefill rank 0's "
                 "abort: %s from %s rank %d%s: %s", kvf_status_name(f.status),
                 kvf_role_name(f.origin_side), f.origin_rank,
                 f.from_another_rank ? " (learned)" : "", f.reason);
    if (why[0] != '\0') {
        kvt_bench_failure(b, s, got == KVF_OK ? kvf_status_name(f.status) : "RELAY", why);
        kvt_bench_note_time(b, s->index, 0);
    } else if (!cause && kvt_bench_note_time(b, s->index, t) != 0) {
        kvt_bench_failure(b, s, "KVF_ERR_NO_MEMORY", "out of memory for room timestamps");
    }
    kvt_bench_release(b, s);
}

/* --relay: the first chunk, then prefill rank 0 aborts; the others wait. */
static int kvt_bench_relay_send(kvt_bench_rank_t *b, kvt_bslot_t *s)
{
    kvt_rank_t *r = b->r;
    kvf_status_t e = kvf_sender_send(s->snd, s->pages, r->chunk_pages, 0);
    if (e != KVF_OK) {
        if (kvf_sender_poll(s->snd) == KVF_POLL_FAILED)
            kvt_bench_relay_final(b, s, KVF_POLL_FAILED, kvt_mono_ns());
        else
            kvt_bench_refused(b, s, "kvf_sender_send", e);
        return 1;
    }
    s->stage = KVT_B_WAIT;
    if (r->o.rank == 0) {
        uint64_t t = kvt_mono_ns();
        kvf_sender_abort(s->snd);
        if (kvt_bench_note_time(b, s->index, t) != 0)
            kvt_bench_failure(b, s, "KVF_ERR_NO_MEMORY", "out of memory for room timestamps");
    }
    return 1;
}

/* One poll of one room.  @return 1 if anything happened. */
static int kvt_bench_progress(kvt_bench_rank_t *b, kvt_bslot_t *s)
{
    kvt_rank_t *r = b->r;
    kvf_poll_t st = r->prefill ? kvf_sender_poll(s->snd) : kvf_receiver_poll(s->rcv);
    if (r->o.relay && (st == KVF_POLL_FAILED || st == KVF_POLL_SUCCESS)) {
        kvt_bench_relay_final(b, s, st, kvt_mono_ns());
        return 1;
    }
    if (st == KVF_POLL_FAILED || (st == KVF_POLL_SUCCESS && s->stage == KVT_B_WAIT)) {
        kvt_bench_finish(b, s, st, kvt_mono_ns());
        return 1;
    }
    if (s->stage == KVT_B_BOOT) {
        if (st < KVF_POLL_WAITING_FOR_INPUT)
            return 0;
        uint32_t w = (uint32_t)(s - b->slots);
        kvf_status_t e = kvf_sender_init(s->snd, r->room_pages, w);
        if (e != KVF_OK) {
            kvt_bench_refused(b, s, "kvf_sender_init", e);
            return 1;
        }
        kvt_aux_fill(kvt_aux(r, w), s->id);   /* 64 bytes: the room's tag */
        s->stage = KVT_B_SEND;
        return 1;
    }
    if (s->stage == KVT_B_SEND && r->o.relay)
        return kvt_bench_relay_send(b, s);
    if (s->stage == KVT_B_SEND) {
        /* One chunk per pass, as chunked prefill sends one per step. */
        uint32_t n = r->room_pages - s->sent;
        if (n > r->chunk_pages)
            n = r->chunk_pages;
        int last = s->sent + n == r->room_pages;
        if (last && kvt_bench_note_time(b, s->index, kvt_mono_ns()) != 0) {
            kvt_bench_refused(b, s, "timestamp table", KVF_ERR_NO_MEMORY);
            return 1;
        }
        kvf_status_t e = kvf_sender_send(s->snd, s->pages + s->sent, n, last);
        if (e != KVF_OK) {
            if (kvf_sender_poll(s->snd) == KVF_POLL_FAILED)
                kvt_bench_finish(b, s, KVF_POLL_FAILED, 0);
            else
                kvt_bench_refused(b, s, "kvf_sender_send", e);
            return 1;
        }
        s->sent += n;
        if (last)
            s->stage = KVT_B_WAIT;
        return 1;
    }
    return 0;
}

/* ------------------------------------------------------------------------ */
/* Commands and events                                                      */
/* ------------------------------------------------------------------------ */

static void kvt_bench_command(kvt_bench_rank_t *b, const char *cmd)
{
    unsigned long long m;
    if (strcmp(cmd, "stop") == 0 && !b->paused) {
        b->paused = 1;
        kvt_emit(b->r, "admitted", json_pack("{s:i}", "next", (int)b->next));
    } else if (sscanf(cmd, "until %llu", &m) == 1 && m <= UINT32_MAX) {
        b->limit = (uint32_t)m;
        b->limit_known = 1;
        b->paused = 0;
    } else {
        fprintf(stderr, "kvferry _rank %s[%u]: ignoring command '%s'\n",
                b->r->side, b->r->o.rank, cmd);
    }
}

/* Commands arrive on stdin while rooms run; never block on it. */
static void kvt_bench_read_commands(kvt_bench_rank_t *b)
{
    char cmd[128];
    kvt_cmdin_fill(&b->r->cmd, 0);
    while (kvt_cmdin_next(&b->r->cmd, cmd, sizeof(cmd)))
        kvt_bench_command(b, cmd);
}

static void kvt_bench_result(kvt_bench_rank_t *b, uint64_t t0, uint64_t t1,
                             double cpu_s)
{
    kvt_rank_t *r = b->r;
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    json_t *times = json_array();
    for (uint32_t i = 0; i < b->next && times; i++)
        json_array_append_new(times, json_integer(
            i < b->t_cap ? (json_int_t)b->t_ns[i] : 0));
    kvt_emit(r, "result", json_pack(
        "{s:s, s:s, s:i, s:i, s:I, s:I, s:I, s:f, s:f, s:I, s:I, s:I, s:I, s:o, s:o}",
        "addr", r->addr, "transport", kvf_engine_transport(r->eng),
        "rooms", (int)b->next, "failed", (int)b->failed,
        "bytes", (json_int_t)b->bytes, "t0_ns", (json_int_t)t0,
        "t1_ns", (json_int_t)t1, "cpu_s", cpu_s, "verify_cpu_s", b->verify_cpu_s,
        "maxrss_kb", (json_int_t)ru.ru_maxrss, "vm_hwm_kb", (json_int_t)kvt_vm_hwm_kb(),
        "pool_bytes", (json_int_t)r->kv_len,
        "room_bytes", (json_int_t)((uint64_t)r->room_pages * r->g.page_bytes *
                                   r->g.num_buffers),
        "failures", json_incref(b->failures), "times_ns", times));
}

void kvt_bench_rank_run(kvt_rank_t *r)
{
    kvt_bench_rank_t b;
    memset(&b, 0, sizeof(b));
    b.r = r;
    uint32_t conc = r->o.concurrency;
    b.slots = calloc(conc, sizeof(*b.slots));
    b.page_store = malloc((size_t)conc * r->room_pages * sizeof(uint32_t));
    b.failures = json_array();
    if (!b.slots || !b.page_store || !b.failures) {
        kvt_fatal(r, "out of memory for the room window");
        goto out;
    }
    for (uint32_t i = 0; i < conc; i++)
        b.slots[i].pages = b.page_store + (size_t)i * r->room_pages;
    b.limit = r->o.duration ? UINT32_MAX : r->o.requests;
    b.limit_known = !r->o.duration;
    /* nanosleep's default 50 us slack would dominate a small room. */
    prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0);

    uint64_t t0 = kvt_mono_ns(), t1 = t0, last_progress = t0;
    long idle_ns = KVT_BENCH_IDLE_NS;
    long idle_max = r->o.relay ? KVT_RELAY_IDLE_MAX : KVT_BENCH_IDLE_MAX;
    double cpu0 = kvt_rusage_cpu_s();
    while (!(b.limit_known && b.done >= b.limit)) {
        int changed = 0;
        uint32_t done_before = b.done;
        for (uint32_t i = 0; i < conc; i++) {
            kvt_bslot_t *s = &b.slots[i];
            if (s->stage == KVT_B_FREE) {
                if (b.paused || b.next >= b.limit)
                    continue;
                /* Every rank admits rooms in index order, so the windows
                 * of all ranks overlap and no room waits on an absent peer. */
                kvt_bench_start(&b, s);
                changed = 1;
                if (s->stage == KVT_B_FREE)
                    continue;
            }
            changed |= kvt_bench_progress(&b, s);
        }
        uint64_t now = kvt_mono_ns();
        if (b.done != done_before)
            t1 = now;   /* the window ends with the last room, not idling */
        if (now - last_progress >= 250000000u) {
            last_progress = now;
            kvt_emit(r, "progress", json_pack("{s:i, s:i, s:I}", "done",
                                               (int)b.done, "failed", (int)b.failed,
                                               "bytes", (json_int_t)b.bytes));
        }
        if (r->o.duration)
            kvt_bench_read_commands(&b);
        /* Back off while nothing happens: a profile of 1 GiB rooms showed
         * a fixed 20 us sleep costing a quarter of each rank's CPU in
         * context switches.  Small rooms keep it short: they change state
         * on almost every pass.  But a room that ends while this thread
         * sleeps is seen when it wakes, and one small room at a time
         * spends most of its measured latency here (tens to hundreds of
         * us): --spin yields instead, as a scheduler's loop polls every
         * step. */
        if (changed) {
            idle_ns = KVT_BENCH_IDLE_NS;
        } else if (r->o.spin) {
            sched_yield();
        } else {
            struct timespec ts = { 0, idle_ns };
            nanosleep(&ts, NULL);
            idle_ns = idle_ns * 2 > idle_max ? idle_max : idle_ns * 2;
        }
    }
    double cpu = kvt_rusage_cpu_s() - cpu0 - b.verify_cpu_s;
    kvt_bench_result(&b, t0, t1, cpu);
out:
    json_decref(b.failures);
    free(b.t_ns);
    free(b.slots);
    free(b.page_store);
}
