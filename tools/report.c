/*
 * Merging rank reports into the demo's verdict (see report.h), and
 * printing it: as one JSON object, or as a short readable summary whose
 * failure section groups identical reasons so that 1,000 rooms failing for
 * one cause read as one line with a count.
 */
#include "report.h"

#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

#include "kvferry/kvferry.h"
#include "pattern.h"
#include "verdict.h"

static const char *const kvt_phase_names[] = {
    "none", "bootstrap", "waiting", "mid", "transferring", "last",
};
#define KVT_NPHASES (int)(sizeof(kvt_phase_names) / sizeof(kvt_phase_names[0]))
#define KVT_UNRESOLVED_LIST_MAX 20
#define KVT_UNRESOLVED_PRINT_MAX 5

int kvt_report_init(kvt_report_t *r, const kvt_opts_t *o)
{
    memset(r, 0, sizeof(*r));
    r->o = o;
    r->nfirst = o->requests;
    r->nrooms = o->requests + (o->fault ? o->after_fault_requests : 0);
    r->nprefill = kvt_opts_nranks(o, 1);
    r->nranks = r->nprefill + kvt_opts_nranks(o, 0);
    r->ids = malloc((size_t)r->nrooms * sizeof(*r->ids));
    r->slots = calloc((size_t)r->nrooms * r->nranks, sizeof(*r->slots));
    r->touched = calloc(r->nrooms, 1);
    r->released = calloc(r->nrooms, 1);
    r->ranks = json_array();
    if (!r->ids || !r->slots || !r->touched || !r->released || !r->ranks)
        return -1;
    for (uint32_t i = 0; i < r->nrooms; i++)
        r->ids[i] = kvt_room_id(o->seed, i);
    for (size_t i = 0; i < (size_t)r->nrooms * r->nranks; i++) {
        r->slots[i].first = -1;
        r->slots[i].state = -1;
        r->slots[i].verified = -1;
    }
    return 0;
}

void kvt_report_fini(kvt_report_t *r)
{
    if (r->slots)
        for (size_t i = 0; i < (size_t)r->nrooms * r->nranks; i++)
            json_decref(r->slots[i].failure);
    free(r->slots);
    free(r->ids);
    free(r->touched);
    free(r->released);
    json_decref(r->ranks);
    memset(r, 0, sizeof(*r));
}

static kvt_slot_t *kvt_slot_at(const kvt_report_t *r, uint32_t index,
                               uint32_t col)
{
    return &r->slots[(size_t)index * r->nranks + col];
}

static uint32_t kvt_col(const kvt_report_t *r, const kvt_child_t *c)
{
    return c->role == KVT_CHILD_PREFILL ? c->rank : r->nprefill + c->rank;
}

/* Does rank column k take part in room `index`?  Every decode rank does;
 * a prefill rank only in the rooms of its DP group (room % --dp). */
static int kvt_involved(const kvt_report_t *r, uint32_t index, uint32_t k)
{
    if (k >= r->nprefill || r->o->dp == 1)
        return 1;
    return r->ids[index] % r->o->dp == kvt_opts_coord(r->o, 1, k).dp;
}

/* "prefill" or "decode", and the rank's index within its side. */
static const char *kvt_col_side(const kvt_report_t *r, uint32_t k,
                                unsigned *rank_p)
{
    int pre = k < r->nprefill;
    *rank_p = pre ? k : k - r->nprefill;
    return pre ? "prefill" : "decode";
}

/* The slot of room `index` on child c, or NULL (with a warning) when the
 * event does not name a room of this demo. */
static kvt_slot_t *kvt_slot(kvt_report_t *r, const kvt_child_t *c, json_t *ev)
{
    json_t *ji = json_object_get(ev, "index"), *jr = json_object_get(ev, "room");
    if (c->role == KVT_CHILD_REGISTRY || !json_is_integer(ji))
        return NULL;
    json_int_t index = json_integer_value(ji);
    if (index < 0 || index >= (json_int_t)r->nrooms ||
        (uint64_t)json_integer_value(jr) != r->ids[index]) {
        fprintf(stderr, "kvferry demo: %s reported room %lld as request %lld, "
                "which is not a room of this demo; ignored\n", c->name,
                (long long)json_integer_value(jr), (long long)index);
        return NULL;
    }
    return kvt_slot_at(r, (uint32_t)index, kvt_col(r, c));
}

void kvt_report_phase(kvt_report_t *r, const kvt_child_t *c, json_t *ev)
{
    kvt_slot_t *s = kvt_slot(r, c, ev);
    const char *p = json_string_value(json_object_get(ev, "phase"));
    if (!s || !p)
        return;
    for (int i = 0; i < KVT_NPHASES; i++)
        if (strcmp(kvt_phase_names[i], p) == 0)
            s->phase = (int8_t)i;
}

void kvt_report_room(kvt_report_t *r, const kvt_child_t *c, json_t *room)
{
    kvt_slot_t *s = kvt_slot(r, c, room);
    const char *state = json_string_value(json_object_get(room, "state"));
    if (!s || !state || s->state >= 0)
        return;   /* unknown, or already merged: the first report wins */
    if (strcmp(state, kvf_poll_name(KVF_POLL_SUCCESS)) == 0)
        s->state = KVF_POLL_SUCCESS;
    else if (strcmp(state, kvf_poll_name(KVF_POLL_FAILED)) == 0)
        s->state = KVF_POLL_FAILED;
    else
        return;
    json_t *v = json_object_get(room, "verified");
    s->verified = json_is_boolean(v) ? json_is_true(v) : -1;
    s->bytes = (uint64_t)json_integer_value(json_object_get(room, "bytes"));
    s->start = json_number_value(json_object_get(room, "start"));
    s->end = json_number_value(json_object_get(room, "end"));
    s->awaited_ms = json_number_value(json_object_get(room, "awaited_ms"));
    json_t *f = json_object_get(room, "failure");
    if (json_is_object(f))
        s->failure = json_incref(f);
    if (s->first < 0)
        s->first = s->state;   /* a rank that reported at once (a result line) */
}

void kvt_report_final(kvt_report_t *r, const kvt_child_t *c, json_t *ev)
{
    kvt_slot_t *s = kvt_slot(r, c, ev);
    const char *state = json_string_value(json_object_get(ev, "state"));
    if (!s || !state || s->first >= 0)
        return;
    s->first = strcmp(state, kvf_poll_name(KVF_POLL_SUCCESS)) == 0 ? KVF_POLL_SUCCESS
                                                                   : KVF_POLL_FAILED;
}

int kvt_report_involves(const kvt_report_t *r, uint32_t index, const kvt_child_t *c)
{
    return c->role != KVT_CHILD_REGISTRY && index < r->nrooms &&
           kvt_involved(r, index, kvt_col(r, c));
}

int kvt_report_releasable(kvt_report_t *r, uint32_t index)
{
    if (index >= r->nrooms || r->released[index] || !kvt_report_room_final(r, index))
        return 0;
    r->released[index] = 1;
    return 1;
}

/* A killed rank counts as FAILED: its server lost a rank of the request. */
int kvt_report_outcome(const kvt_report_t *r, uint32_t index)
{
    int min = KVF_POLL_SUCCESS;
    for (uint32_t k = 0; k < r->nranks; k++) {
        const kvt_slot_t *s = kvt_slot_at(r, index, k);
        if (kvt_involved(r, index, k) && s->first >= 0 && s->first < min)
            min = s->first;
    }
    return min;
}

/* ------------------------------------------------------------------------ */
/* Fault bookkeeping                                                        */
/* ------------------------------------------------------------------------ */

int kvt_report_room_final(const kvt_report_t *r, uint32_t index)
{
    if (index >= r->nrooms)
        return 0;
    for (uint32_t k = 0; k < r->nranks; k++)
        if (kvt_involved(r, index, k) && kvt_slot_at(r, index, k)->first < 0)
            return 0;
    return 1;
}

int kvt_report_batch_final(const kvt_report_t *r, uint32_t first, uint32_t n)
{
    for (uint32_t i = first; i < first + n; i++)
        if (!kvt_report_room_final(r, i))
            return 0;
    return 1;
}

static int kvt_room_started(const kvt_report_t *r, uint32_t index)
{
    for (uint32_t k = 0; k < r->nranks; k++) {
        const kvt_slot_t *s = kvt_slot_at(r, index, k);
        if (s->phase > 0 || s->first >= 0)
            return 1;
    }
    return 0;
}

void kvt_report_touch_pending(kvt_report_t *r, int later)
{
    for (uint32_t i = 0; i < r->nfirst; i++) {
        if (kvt_report_room_final(r, i))
            continue;
        if (kvt_room_started(r, i))
            r->touched[i] = KVT_HIT;
        else if (later)
            r->touched[i] = KVT_LATER;
    }
}

void kvt_report_touch(kvt_report_t *r, uint32_t index)
{
    if (index < r->nfirst)
        r->touched[index] = KVT_HIT;
}

int kvt_report_hit_final_except(const kvt_report_t *r, const kvt_child_t *c)
{
    uint32_t skip = kvt_col(r, c);
    for (uint32_t i = 0; i < r->nfirst; i++)
        for (uint32_t k = 0; r->touched[i] == KVT_HIT && k < r->nranks; k++)
            if (k != skip && kvt_involved(r, i, k) &&
                kvt_slot_at(r, i, k)->first < 0)
                return 0;
    return 1;
}

uint32_t kvt_report_touched(const kvt_report_t *r, int how)
{
    uint32_t n = 0;
    for (uint32_t i = 0; i < r->nfirst; i++)
        n += r->touched[i] == how;
    return n;
}

void kvt_report_rank_gone(kvt_report_t *r, const kvt_child_t *c,
                          const char *addr, uint32_t first, uint32_t n,
                          const char *reason, double at)
{
    uint32_t col = kvt_col(r, c);
    const char *side = c->role == KVT_CHILD_PREFILL ? "prefill" : "decode";
    for (uint32_t i = first; i < first + n && i < r->nrooms; i++) {
        kvt_slot_t *s = kvt_slot_at(r, i, col);
        if (s->state >= 0 || !kvt_involved(r, i, col))
            continue;
        s->gone = 1;
        if (s->first < 0)
            s->first = KVF_POLL_FAILED;
        s->state = KVF_POLL_FAILED;
        s->verified = c->role == KVT_CHILD_DECODE ? 0 : -1;
        s->start = s->end = at;
        /* No engine saw this: the process itself is the origin. */
        s->failure = json_pack("{s:I, s:i, s:i, s:s, s:s, s:b, s:s, s:s, s:i, s:s}",
                               "room", (json_int_t)r->ids[i], "index", (int)i,
                               "rank", (int)c->rank, "side", side,
                               "reason", reason, "from_another_rank", 0,
                               "status", "KILLED_BY_FAULT", "origin_side", side,
                               "origin_rank", (int)c->rank, "origin_addr", addr);
    }
}

void kvt_report_result(kvt_report_t *r, const kvt_child_t *c, json_t *ev)
{
    json_t *rooms = json_object_get(ev, "rooms"), *room;
    size_t i;
    json_array_foreach(rooms, i, room)
        kvt_report_room(r, c, room);
    json_t *at = json_object_get(ev, "at");
    json_t *info = json_pack(
        "{s:s, s:s, s:O?, s:O?, s:O?, s:O?, s:O?, s:i}", "name", c->name,
        "side", c->role == KVT_CHILD_PREFILL ? "prefill" : "decode",
        "addr", json_object_get(ev, "addr"), "bytes", json_object_get(ev, "bytes"),
        "start", json_object_get(ev, "start"), "end", json_object_get(ev, "end"),
        "stats", json_object_get(ev, "stats"), "rooms", (int)json_array_size(rooms));
    /* dp_rank, pp_rank, tp_rank, first_layer, num_layers */
    if (info && json_is_object(at))
        json_object_update(info, at);
    json_array_append_new(r->ranks, info);
}

/* "decode[1] at waiting" for each rank that has not reported room i. */
static json_t *kvt_pending(kvt_report_t *r, uint32_t i)
{
    json_t *a = json_array();
    for (uint32_t k = 0; k < r->nranks; k++) {
        const kvt_slot_t *s = &r->slots[(size_t)i * r->nranks + k];
        if (s->state >= 0 || !kvt_involved(r, i, k))
            continue;
        unsigned rank;
        const char *side = kvt_col_side(r, k, &rank);
        if (s->phase == 0)
            json_array_append_new(a, json_sprintf(
                "%s[%u] not started", side, rank));
        else
            json_array_append_new(a, json_sprintf(
                "%s[%u] last phase: %s", side, rank, kvt_phase_names[s->phase]));
    }
    return a;
}

/* What a range of rooms came to. */
typedef struct kvt_tally {
    uint32_t rooms, ok, failed, unresolved;
    uint64_t bytes;
    int      verified;     /* no decode rank reported SUCCESS with wrong data */
    double   t0, t1;
    double   resolve;      /* latest final state of a room the fault hit, after it
                              (a stopped rank's: after its SIGCONT) */
    double   awaited_ms;   /* longest wait of a rank for its room's cause */
    json_t  *failures, *unres;
    json_t  *split;        /* per room that did not succeed: what each rank reported */
} kvt_tally_t;

/* Problem lines of one kind: the first few in full, then a count, so a
 * systematic failure over 1,000 rooms stays readable. */
typedef struct kvt_problems {
    json_t  *a;
    unsigned verify, reasonless, untouched, state, cause, reach;
} kvt_problems_t;

#define KVT_PROBLEMS_PER_KIND 10

static void kvt_problem(kvt_problems_t *p, unsigned *count, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static void kvt_problem(kvt_problems_t *p, unsigned *count, const char *fmt, ...)
{
    if ((*count)++ >= KVT_PROBLEMS_PER_KIND)
        return;
    char msg[KVF_REASON_MAX + 256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    json_array_append_new(p->a, json_string(msg));
}

static void kvt_problems_close(kvt_problems_t *p)
{
    unsigned n[] = { p->verify, p->reasonless, p->untouched, p->state, p->cause, p->reach };
    for (size_t i = 0; i < sizeof(n) / sizeof(n[0]); i++)
        if (n[i] > KVT_PROBLEMS_PER_KIND)
            json_array_append_new(p->a, json_sprintf(
                "... and %u more problem(s) like the ones above",
                n[i] - KVT_PROBLEMS_PER_KIND));
}

static const char *kvt_reason(const kvt_slot_t *s)
{
    const char *why = json_string_value(json_object_get(s->failure, "reason"));
    return why ? why : "";
}

/* The checks that hold for every final slot, fault or not. */
static void kvt_check_slot(const kvt_report_t *r, uint32_t i, uint32_t k,
                           const kvt_slot_t *s, kvt_tally_t *t,
                           kvt_problems_t *p)
{
    unsigned rank;
    const char *side = kvt_col_side(r, k, &rank);
    int pre = k < r->nprefill;
    if (!pre && s->state == KVF_POLL_SUCCESS && s->verified != 1) {
        t->verified = 0;
        kvt_problem(p, &p->verify, "room %u (id %llu): %s[%u] reported "
                    "SUCCESS but its data did not verify: %s (a partial or "
                    "corrupt transfer passed as complete)", i,
                    (unsigned long long)r->ids[i], side, rank, kvt_reason(s));
    }
    if (s->state == KVF_POLL_FAILED && s->verified == 1)
        kvt_problem(p, &p->reasonless, "room %u (id %llu): %s[%u] reported "
                    "FAILED yet counted it as verified", i,
                    (unsigned long long)r->ids[i], side, rank);
}

/* What each rank reported of room i, for the rules of verdict.h and for
 * the summary; `stopped`: the column a stop fault acted on, or -1.
 * @return how many ranks take part (views in v). */
static size_t kvt_views(const kvt_report_t *r, uint32_t i, int stopped, kvt_rank_view_t *v,
                        json_t *detail)
{
    size_t n = 0;
    for (uint32_t k = 0; k < r->nranks; k++) {
        const kvt_slot_t *s = kvt_slot_at(r, i, k);
        if (!kvt_involved(r, i, k))
            continue;
        unsigned rank;
        const char *side = kvt_col_side(r, k, &rank);
        v[n++] = (kvt_rank_view_t){k < r->nprefill, rank, s->state, s->gone,
                                   (int)k == stopped, s->failure};
        json_array_append_new(detail, json_pack(
            "{s:s, s:i, s:s, s:s, s:b, s:f}", "side", side, "rank", (int)rank,
            "state", s->state < 0 ? "unreported" : kvf_poll_name((kvf_poll_t)s->state),
            "final_state", s->first < 0 ? "unreported" : kvf_poll_name((kvf_poll_t)s->first),
            "killed", s->gone, "awaited_ms", s->awaited_ms));
    }
    return n;
}

/* The rules of verdict.h over a room every rank reported, and whether a
 * fault could reach it at all. */
static void kvt_check_room(const kvt_report_t *r, uint32_t i, const kvt_run_info_t *info,
                           int all_ok, kvt_problems_t *p, kvt_tally_t *t)
{
    kvt_rank_view_t *v = calloc(r->nranks, sizeof(*v));
    json_t *detail = json_array();
    char why[KVF_REASON_MAX * 2], common[64];
    if (!v || !detail) {
        free(v);
        json_decref(detail);
        return;
    }
    int stopped = info->fault && strncmp(info->fault, "stop-", 5) == 0 ? info->victim : -1;
    size_t n = kvt_views(r, i, stopped, v, detail);
    if (!kvt_verdict_one_state(v, n, why, sizeof(why)))
        kvt_problem(p, &p->state, "room %u (id %llu): %s", i, (unsigned long long)r->ids[i],
                    why);
    common[0] = '\0';
    /* With the registry down the sides may never have linked: each names
     * the failure it saw, and no rank in common (docs/FAILURES.md, Known
     * limits); the rest of the rule holds. */
    int unlinked = info->fault && strncmp(info->fault, "registry-down", 13) == 0;
    if (!kvt_verdict_one_cause(v, n, common, sizeof(common), why, sizeof(why)) &&
        !(unlinked && strstr(why, "name no rank in common") != NULL))
        kvt_problem(p, &p->cause, "room %u (id %llu): %s", i, (unsigned long long)r->ids[i],
                    why);
    if (!all_ok && info->fault_injected && info->victim >= 0 &&
        !kvt_involved(r, i, (uint32_t)info->victim))
        kvt_problem(p, &p->reach, "room %u (id %llu) failed although the rank the fault "
                    "acted on takes no part in it (another DP group's room)", i,
                    (unsigned long long)r->ids[i]);
    if (all_ok)
        json_decref(detail);
    else
        json_array_append_new(t->split, json_pack("{s:i, s:I, s:s, s:o}", "index", (int)i,
                                                  "room", (json_int_t)r->ids[i],
                                                  "cause_addr", common, "ranks", detail));
    free(v);
}

/* Tally rooms [first, first + n): states, bytes, failures, problems. */
static void kvt_tally(const kvt_report_t *r, uint32_t first, uint32_t n,
                      const kvt_run_info_t *info, kvt_problems_t *p,
                      kvt_tally_t *t)
{
    memset(t, 0, sizeof(*t));
    t->rooms = n;
    t->verified = 1;
    t->failures = json_array();
    t->unres = json_array();
    t->split = json_array();
    for (uint32_t i = first; i < first + n; i++) {
        int all_final = 1, all_ok = 1, touched = r->touched[i];
        uint64_t room_bytes = 0;
        const char *why = NULL;
        for (uint32_t k = 0; k < r->nranks; k++) {
            const kvt_slot_t *s = kvt_slot_at(r, i, k);
            int decode = k >= r->nprefill;
            if (!kvt_involved(r, i, k))
                continue;
            if (s->failure) {
                json_array_append(t->failures, s->failure);
                if (!why)
                    why = kvt_reason(s);
            }
            if (s->state < 0) {
                all_final = all_ok = 0;
                continue;
            }
            kvt_check_slot(r, i, k, s, t, p);
            if (t->t0 == 0 || s->start < t->t0)
                t->t0 = s->start;
            if (s->end > t->t1)
                t->t1 = s->end;
            double from = info->stopped && k == kvt_col(r, info->stopped) &&
                          info->resumed_at > 0 ? info->resumed_at : info->fault_at;
            if (touched == KVT_HIT && info->fault_injected && s->end - from > t->resolve)
                t->resolve = s->end - from;
            if (s->state != KVF_POLL_SUCCESS || (decode && s->verified != 1))
                all_ok = 0;
            if (s->awaited_ms > t->awaited_ms)
                t->awaited_ms = s->awaited_ms;
            if (decode)
                room_bytes += s->bytes;
        }
        if (!all_final) {
            t->unresolved++;
            if (json_array_size(t->unres) < KVT_UNRESOLVED_LIST_MAX)
                json_array_append_new(t->unres, json_pack(
                    "{s:I, s:i, s:o}", "room", (json_int_t)r->ids[i],
                    "index", (int)i, "pending", kvt_pending((kvt_report_t *)r, i)));
            continue;
        }
        kvt_check_room(r, i, info, all_ok, p, t);
        if (all_ok) {
            t->ok++;
            t->bytes += room_bytes;
        } else {
            t->failed++;
            if (info->fault && i < r->nfirst && !touched)
                kvt_problem(p, &p->untouched, "room %u (id %llu) was not "
                            "touched by the fault but did not succeed: %s", i,
                            (unsigned long long)r->ids[i], why ? why : "?");
        }
    }
}

/* Every process and how it ended.  @return 1 if every rank exited 0,
 * apart from those the fault injector killed on purpose. */
static int kvt_processes(const kvt_children_t *kids, json_t *procs,
                         json_t *problems)
{
    int ok = 1;
    for (size_t i = 0; i < kids->n; i++) {
        const kvt_child_t *c = &kids->v[i];
        char ex[64];
        kvt_child_exit_str(c, ex, sizeof(ex));
        json_array_append_new(procs, json_pack("{s:s, s:i, s:s, s:b}", "name",
                                               c->name, "pid", (int)c->pid,
                                               "exit", ex, "faulted", c->faulted));
        if (c->role != KVT_CHILD_REGISTRY && !c->faulted && !kvt_child_exited_ok(c)) {
            ok = 0;
            json_array_append_new(problems, json_sprintf("%s: %s", c->name, ex));
        }
    }
    return ok;
}

static json_t *kvt_after_json(const kvt_tally_t *t)
{
    return json_pack("{s:i, s:i, s:i, s:i, s:I, s:b, s:O, s:O, s:O, s:f}",
                     "rooms", (int)t->rooms, "succeeded", (int)t->ok,
                     "failed", (int)t->failed, "unresolved", (int)t->unresolved,
                     "bytes", (json_int_t)t->bytes, "verified", t->verified,
                     "failures", t->failures, "unresolved_rooms", t->unres,
                     "failed_rooms", t->split, "max_awaited_ms", t->awaited_ms);
}

/* The fault's own verdict lines, and its fields in the summary. */
static void kvt_fault_summary(const kvt_report_t *r, const kvt_run_info_t *info,
                              const kvt_tally_t *first, const kvt_tally_t *after,
                              json_t *problems, json_t *out)
{
    if (!info->fault) {
        json_object_set_new(out, "fault", json_null());
        json_object_set_new(out, "max_resolve_seconds", json_null());
        json_object_set_new(out, "after_fault", json_null());
        return;
    }
    if (!info->fault_injected)
        json_array_append_new(problems, json_sprintf(
            "fault %s was never injected: no room reached that phase on the "
            "trigger rank (see fault_detail.log)", info->fault));
    else if (after->rooms && after->ok < after->rooms)
        json_array_append_new(problems, json_sprintf(
            "after the fault, %u of %u fresh rooms did not succeed (%u "
            "failed, %u unresolved): the surviving engines must serve new "
            "rooms", after->rooms - after->ok, after->rooms, after->failed,
            after->unresolved));
    json_object_set_new(out, "fault", json_string(info->fault));
    json_object_set_new(out, "max_resolve_seconds", info->fault_injected
                        ? json_real(first->resolve) : json_null());
    json_object_set_new(out, "touched_rooms", json_integer(kvt_report_touched(r, KVT_HIT)));
    json_object_set_new(out, "later_rooms", json_integer(kvt_report_touched(r, KVT_LATER)));
    json_object_set_new(out, "after_fault", kvt_after_json(after));
    json_object_set_new(out, "fault_detail", info->fault_detail
                        ? json_deep_copy(info->fault_detail) : json_null());
}

json_t *kvt_report_summary(kvt_report_t *r, const kvt_children_t *kids,
                           const kvt_run_info_t *info, int *ok_p)
{
    const kvt_opts_t *o = r->o;
    json_t *procs = json_array();
    kvt_problems_t p = { json_array(), 0, 0, 0, 0, 0, 0 };
    kvt_tally_t first, after;

    if (info->error)   /* the root cause first; exits below follow from it */
        json_array_append_new(p.a, json_string(info->error));
    kvt_tally(r, 0, r->nfirst, info, &p, &first);
    kvt_tally(r, r->nfirst, r->nrooms - r->nfirst, info, &p, &after);
    kvt_problems_close(&p);
    int procs_ok = kvt_processes(kids, procs, p.a);
    if (info->timed_out)
        json_array_append_new(p.a, json_sprintf(
            "timeout: not finished after --timeout %u s; every process was "
            "killed", o->timeout));
    if (info->signal)
        json_array_append_new(p.a, json_sprintf(
            "interrupted by SIG%s", sigabbrev_np(info->signal)));

    double secs = first.t1 > first.t0 ? first.t1 - first.t0 : 0;
    json_t *out = json_pack(
        "{s:b, s:s, s:s, s:s, s:s, s:s, s:i, s:i, s:i, s:i, s:i, s:i, s:i, s:i,"
        " s:I, s:b, s:s, s:b,"
        " s:i, s:i, s:i, s:i, s:I, s:b, s:f, s:f,"
        " s:O, s:O, s:o, s:O}",
        "ok", 0, "model", o->model, "kv_dtype", o->kv_dtype,
        "decode_kv_dtype", o->decode_kv_dtype, "kv_order", o->kv_order,
        "decode_kv_order", o->decode_kv_order, "page_size", (int)o->page_size,
        "decode_page_size", (int)o->decode_page_size, "tokens", (int)o->tokens,
        "chunk", (int)o->chunk, "prefill_tp", (int)o->prefill_tp,
        "decode_tp", (int)o->decode_tp, "concurrency", (int)o->concurrency,
        "timeout", (int)o->timeout,
        "seed", (json_int_t)o->seed, "checksum", o->checksum,
        "transport", info->transport, "scattered", !o->contiguous,
        "rooms", (int)first.rooms, "succeeded", (int)first.ok,
        "failed", (int)first.failed, "unresolved", (int)first.unresolved,
        "bytes", (json_int_t)first.bytes, "verified", first.verified,
        "seconds", secs, "gbps", secs > 0 ? (double)first.bytes / secs / 1e9 : 0.0,
        "failures", first.failures, "unresolved_rooms", first.unres,
        "processes", procs, "ranks", r->ranks);
    if (out) {
        json_object_set_new(out, "prefill_pp", json_integer(o->prefill_pp));
        json_object_set_new(out, "decode_pp", json_integer(o->decode_pp));
        json_object_set_new(out, "dp", json_integer(o->dp));
        json_object_set_new(out, "registry_auth",
                            json_string(info->registry_auth));
        json_object_set(out, "failed_rooms", first.split);
        json_object_set_new(out, "max_awaited_ms", json_real(first.awaited_ms));
        kvt_fault_summary(r, info, &first, &after, p.a, out);
    }
    /* Without a fault every room must succeed; with one, every room must
     * be final and every rule above hold (any breach is a problem line). */
    *ok_p = info->fault
        ? first.unresolved == 0 && json_array_size(p.a) == 0
        : first.ok == first.rooms && first.verified && procs_ok &&
          !info->error && !info->timed_out && !info->signal;
    if (out) {
        json_object_set_new(out, "ok", json_boolean(*ok_p));
        json_object_set(out, "problems", p.a);
    }
    json_decref(p.a);
    json_decref(first.failures);
    json_decref(first.unres);
    json_decref(first.split);
    json_decref(after.split);
    json_decref(after.failures);
    json_decref(after.unres);
    return out;
}

/* ------------------------------------------------------------------------ */
/* Readable output                                                          */
/* ------------------------------------------------------------------------ */

#define KVT_GROUPS_MAX 8

static const char *kvt_str(json_t *o, const char *key)
{
    const char *s = json_string_value(json_object_get(o, key));
    return s ? s : "?";
}

static long long kvt_int(json_t *o, const char *key)
{
    return (long long)json_integer_value(json_object_get(o, key));
}

/* Failures grouped by (side, rank, status, origin, reason), first seen
 * first, with a count each. */
static void kvt_print_failures(FILE *out, json_t *failures)
{
    size_t n = json_array_size(failures), shown = 0, groups = 0;
    char *seen = calloc(n ? n : 1, 1);
    if (!seen)
        return;
    fprintf(out, "  failures   %zu record(s):\n", n);
    for (size_t i = 0; i < n; i++) {
        if (seen[i])
            continue;
        json_t *f = json_array_get(failures, i);
        size_t count = 0;
        for (size_t j = i; j < n; j++) {
            json_t *g = json_array_get(failures, j);
            if (!seen[j] && strcmp(kvt_str(f, "side"), kvt_str(g, "side")) == 0 &&
                kvt_int(f, "rank") == kvt_int(g, "rank") &&
                strcmp(kvt_str(f, "status"), kvt_str(g, "status")) == 0 &&
                strcmp(kvt_str(f, "origin_addr"), kvt_str(g, "origin_addr")) == 0 &&
                strcmp(kvt_str(f, "reason"), kvt_str(g, "reason")) == 0) {
                seen[j] = 1;
                count++;
            }
        }
        groups++;
        if (shown++ >= KVT_GROUPS_MAX)
            continue;
        char origin[160] = "";
        if (json_is_true(json_object_get(f, "from_another_rank")))
            snprintf(origin, sizeof(origin), " (from %s[%lld] %s)",
                     kvt_str(f, "origin_side"), kvt_int(f, "origin_rank"),
                     kvt_str(f, "origin_addr"));
        fprintf(out, "    %5zu x %s[%lld] %s%s: %s\n", count, kvt_str(f, "side"),
                kvt_int(f, "rank"), kvt_str(f, "status"), origin,
                kvt_str(f, "reason"));
    }
    if (groups > KVT_GROUPS_MAX)
        fprintf(out, "    ... and %zu more distinct failure(s); --json lists "
                "them all\n", groups - KVT_GROUPS_MAX);
    free(seen);
}

/* The fault, its reach and the recovery, in three lines. */
static void kvt_print_fault(FILE *out, json_t *s)
{
    json_t *d = json_object_get(s, "fault_detail");
    json_t *a = json_object_get(s, "after_fault");
    if (!json_is_string(json_object_get(s, "fault")))
        return;
    if (json_is_true(json_object_get(d, "injected")))
        fprintf(out, "  fault      %s: %s at %s of room %lld; %lld room(s) "
                "hit, all final within %.3f s; %lld started later\n",
                kvt_str(s, "fault"), kvt_str(d, "target"), kvt_str(d, "phase"),
                kvt_int(d, "room"), kvt_int(s, "touched_rooms"),
                json_real_value(json_object_get(s, "max_resolve_seconds")),
                kvt_int(s, "later_rooms"));
    else
        fprintf(out, "  fault      %s: NOT injected\n", kvt_str(s, "fault"));
    if (kvt_int(a, "rooms") > 0)
        fprintf(out, "  after      %lld/%lld fresh rooms succeeded, %lld failed, "
                "%lld unresolved%s\n", kvt_int(a, "succeeded"), kvt_int(a, "rooms"),
                kvt_int(a, "failed"), kvt_int(a, "unresolved"),
                json_is_true(json_object_get(a, "verified")) ? "" : ", NOT verified");
    json_t *f = json_object_get(a, "failures");
    if (json_array_size(f))
        kvt_print_failures(out, f);
}

void kvt_report_print(FILE *out, json_t *s)
{
    long long rooms = kvt_int(s, "rooms"), ok = kvt_int(s, "succeeded");
    double gb = (double)kvt_int(s, "bytes") / 1e9;
    double secs = json_real_value(json_object_get(s, "seconds"));
    fprintf(out, "kvferry demo: %s, %s (decode %s), page_size %lld (decode "
            "%lld), TP %lld -> %lld", kvt_str(s, "model"),
            kvt_str(s, "kv_dtype"), kvt_str(s, "decode_kv_dtype"),
            kvt_int(s, "page_size"), kvt_int(s, "decode_page_size"),
            kvt_int(s, "prefill_tp"), kvt_int(s, "decode_tp"));
    const char *ko = kvt_str(s, "kv_order"), *dko = kvt_str(s, "decode_kv_order");
    if (strcmp(ko, "nhd") != 0 || strcmp(dko, "nhd") != 0)
        fprintf(out, ", KV pages %s (decode %s)", ko, dko);
    if (kvt_int(s, "prefill_pp") > 1 || kvt_int(s, "decode_pp") > 1)
        fprintf(out, ", PP %lld -> %lld", kvt_int(s, "prefill_pp"),
                kvt_int(s, "decode_pp"));
    if (kvt_int(s, "dp") > 1)
        fprintf(out, ", prefill DP %lld", kvt_int(s, "dp"));
    fprintf(out, "\n");
    fprintf(out, "  requests   %lld rooms x %lld tokens, %lld tokens per send, "
            "%lld in flight per rank, %s decode pages, transport %s%s\n",
            rooms, kvt_int(s, "tokens"), kvt_int(s, "chunk"),
            kvt_int(s, "concurrency"),
            json_is_true(json_object_get(s, "scattered")) ? "scattered" : "contiguous",
            kvt_str(s, "transport"),
            json_is_true(json_object_get(s, "checksum")) ? ", checksums on" : "");
    fprintf(out, "  registry   %s\n",
            kvt_str(s, "registry_auth"));
    fprintf(out, "  rooms      %lld/%lld succeeded, %lld failed, %lld unresolved\n",
            ok, rooms, kvt_int(s, "failed"), kvt_int(s, "unresolved"));
    fprintf(out, "  verified   %s\n",
            json_is_true(json_object_get(s, "verified"))
                ? (ok ? "yes: every byte of every SUCCESS room, on every decode rank"
                      : "nothing to verify: no room succeeded")
                : "NO: a room reported SUCCESS with wrong data (see failures)");
    fprintf(out, "  moved      %.3f GB in %.3f s = %.2f GB/s\n", gb, secs,
            json_real_value(json_object_get(s, "gbps")));
    json_t *f = json_object_get(s, "failures");
    if (json_array_size(f))
        kvt_print_failures(out, f);
    json_t *u = json_object_get(s, "unresolved_rooms"), *e;
    size_t i;
    json_array_foreach(u, i, e) {
        if (i == KVT_UNRESOLVED_PRINT_MAX) {
            fprintf(out, "  ... %lld unresolved in all; --json lists the "
                    "first %d\n", kvt_int(s, "unresolved"),
                    KVT_UNRESOLVED_LIST_MAX);
            break;
        }
        fprintf(out, "  unresolved room %lld (request %lld):", kvt_int(e, "room"),
                kvt_int(e, "index"));
        json_t *p;
        size_t j;
        json_array_foreach(json_object_get(e, "pending"), j, p)
            fprintf(out, "%s %s", j ? "," : "", json_string_value(p));
        fprintf(out, "\n");
    }
    kvt_print_fault(out, s);
    json_array_foreach(json_object_get(s, "problems"), i, e)
        fprintf(out, "  problem    %s\n", json_string_value(e));
    fprintf(out, "  result     %s\n", !json_is_true(json_object_get(s, "ok"))
            ? "FAIL"
            : json_is_string(json_object_get(s, "fault"))
            ? "PASS: every room resolved with its reason, untouched rooms and "
              "the fresh batch succeeded and verified"
            : "PASS: every room succeeded and every byte verified");
}
