/*
 * The demo's fault injector (see fault.h for what it does and when).
 *
 * The one idea: the injector never trusts a rank to tell it about the
 * fault.  It acts on processes from outside (signals), records what it
 * did with wall-clock times that are comparable with the ranks' own room
 * times, and judges recovery only from what the ranks and the registry
 * report afterwards.  A killed rank cannot report its rooms, so the
 * injector records them as failed by the kill, with the kill as origin;
 * every other room must be resolved by the surviving engines themselves.
 */
#include "fault.h"

#include <inttypes.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "models.h"
#include "pattern.h"
#include "tool.h"

static const struct {
    const char       *name;
    kvt_fault_kind_t  kind;
} kvt_fault_kinds[] = {
    { "kill-prefill",  KVT_FAULT_KILL_PREFILL },
    { "kill-decode",   KVT_FAULT_KILL_DECODE },
    { "stop-prefill",  KVT_FAULT_STOP_PREFILL },
    { "stop-decode",   KVT_FAULT_STOP_DECODE },
    { "reset",         KVT_FAULT_RESET },
    { "corrupt",       KVT_FAULT_CORRUPT },
    { "badaddr",       KVT_FAULT_BADADDR },
    { "registry-down", KVT_FAULT_REGISTRY_DOWN },
};

static const char *const kvt_when_names[] = { "bootstrap", "mid", "last" };

#define KVT_COUNT(a) (sizeof(a) / sizeof((a)[0]))

/* ------------------------------------------------------------------------ */
/* The spec                                                                 */
/* ------------------------------------------------------------------------ */

int kvt_fault_parse(const char *spec, kvt_fault_t *f, char *err, size_t len)
{
    memset(f, 0, sizeof(*f));
    const char *at = strchr(spec, '@');
    size_t klen = at ? (size_t)(at - spec) : strlen(spec);
    for (size_t i = 0; i < KVT_COUNT(kvt_fault_kinds); i++)
        if (strlen(kvt_fault_kinds[i].name) == klen &&
            strncmp(kvt_fault_kinds[i].name, spec, klen) == 0)
            f->kind = kvt_fault_kinds[i].kind;
    int when = -1;
    for (size_t i = 0; at && i < KVT_COUNT(kvt_when_names); i++)
        if (strcmp(at + 1, kvt_when_names[i]) == 0)
            when = (int)i;
    if (f->kind == KVT_FAULT_NONE || when < 0) {
        snprintf(err, len, "--fault %s: expected KIND@WHEN with KIND one of "
                 "kill-prefill, kill-decode, stop-prefill, stop-decode, reset, "
                 "corrupt, badaddr, registry-down and WHEN one of bootstrap, mid, last "
                 "(e.g. --fault kill-decode@mid)", spec);
        return -1;
    }
    f->when = (kvt_fault_when_t)when;
    f->phase = kvt_when_names[when];
    snprintf(f->spec, sizeof(f->spec), "%s", spec);
    f->engine = f->kind == KVT_FAULT_RESET || f->kind == KVT_FAULT_CORRUPT ||
                f->kind == KVT_FAULT_BADADDR;
    f->target = f->kind == KVT_FAULT_KILL_DECODE || f->kind == KVT_FAULT_STOP_DECODE
                    ? KVT_CHILD_DECODE
                : f->kind == KVT_FAULT_REGISTRY_DOWN ? KVT_CHILD_REGISTRY
                                                     : KVT_CHILD_PREFILL;
    /* Only prefill reports mid and last (it makes the sends); bootstrap
     * is caught on the side that is hit. */
    f->trigger = f->target == KVT_CHILD_DECODE && f->when == KVT_WHEN_BOOTSTRAP
                     ? KVT_CHILD_DECODE : KVT_CHILD_PREFILL;
    f->hold = !f->engine;
    f->index = -1;   /* kvt_injector_init() knows the window */
    return 0;
}

int kvt_fault_check(const kvt_fault_t *f, const kvt_opts_t *o, char *err,
                    size_t len)
{
    if (f->when == KVT_WHEN_MID && o->chunk >= o->tokens) {
        snprintf(err, len, "--fault %s needs rooms sent in two or more "
                 "chunks (a 'mid' to stop at), but each room of --tokens %u "
                 "goes in one chunk of %u: give a --chunk below --tokens, a "
                 "multiple of --page-size %u (and raise --tokens if a room "
                 "is a single page)", f->spec, o->tokens, o->chunk,
                 o->page_size);
        return -1;
    }
    return 0;
}

void kvt_fault_engine_spec(const kvt_fault_t *f, const kvt_opts_t *o,
                           char *buf, size_t len)
{
    buf[0] = '\0';
    if (!f->engine)
        return;
    /* Prefill rank 0: TP rank 0 of the first stage of DP group 0. */
    kvt_geom_t g;
    kvt_geom_init(&g, kvt_model_find(o->model), kvt_dtype_find(o->kv_dtype),
                  o->prefill_tp, 0, o->page_size);
    kvt_geom_set_stage(&g, o->prefill_pp, 0);
    uint64_t room = (uint64_t)kvt_pages_for(o->tokens, o->page_size) *
                    g.page_bytes * g.num_buffers;
    uint64_t bytes = f->when == KVT_WHEN_BOOTSTRAP ? 0
                   : f->when == KVT_WHEN_MID       ? room / 2
                   : room > g.page_bytes           ? room - g.page_bytes : 0;
    snprintf(buf, len, "%s@%" PRIu64,
             f->kind == KVT_FAULT_RESET     ? "reset"
             : f->kind == KVT_FAULT_CORRUPT ? "corrupt" : "badaddr", bytes);
}

/* The last room of the trigger rank's first window: --concurrency rooms
 * of those it runs (a prefill rank runs its DP group's, room % --dp). */
static int kvt_fault_window_last(const kvt_fault_t *f, const kvt_opts_t *o)
{
    int last = -1;
    uint32_t seen = 0;
    for (uint32_t i = 0; i < o->requests && seen < o->concurrency; i++)
        if (f->trigger == KVT_CHILD_DECODE || kvt_room_id(o->seed, i) % o->dp == 0) {
            last = (int)i;
            seen++;
        }
    return last;
}

/* ------------------------------------------------------------------------ */
/* Helpers                                                                  */
/* ------------------------------------------------------------------------ */

static void kvt_injector_log(kvt_injector_t *inj, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

/* One line of the action log, timed from the injection (or "before"). */
static void kvt_injector_log(kvt_injector_t *inj, const char *fmt, ...)
{
    char msg[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    double t = inj->injected ? kvt_wall_now() - inj->injected_at : 0;
    json_array_append_new(inj->log, json_pack("{s:f, s:s}", "t", t, "action", msg));
    fprintf(stderr, "kvferry demo: fault %s: +%.3f s %s\n", inj->f.spec, t, msg);
}

/* The newest live process of a role and rank (a restarted one replaces
 * the original in the table's order). */
static kvt_child_t *kvt_live(kvt_orch_t *orch, kvt_child_role_t role,
                             uint32_t rank)
{
    kvt_child_t *found = NULL;
    for (size_t i = 0; i < orch->kids.n; i++) {
        kvt_child_t *c = &orch->kids.v[i];
        if (c->role == role && c->rank == rank && c->pid > 0 && !c->reaped)
            found = c;
    }
    return found;
}

static int kvt_is_rank(const kvt_child_t *c)
{
    return c->role != KVT_CHILD_REGISTRY;
}

/* ------------------------------------------------------------------------ */
/* Life cycle                                                               */
/* ------------------------------------------------------------------------ */

int kvt_injector_init(kvt_injector_t *inj, const kvt_fault_t *f,
                      kvt_orch_t *orch, kvt_report_t *rep, const kvt_opts_t *o)
{
    memset(inj, 0, sizeof(*inj));
    inj->f = *f;
    inj->orch = orch;
    inj->rep = rep;
    inj->o = o;
    inj->room = -1;
    inj->log = json_array();
    if (!inj->log)
        return -1;
    kvt_fault_engine_spec(f, o, inj->engine_spec, sizeof(inj->engine_spec));
    if (f->when == KVT_WHEN_BOOTSTRAP)   /* see fault.h: the window's last room */
        inj->f.index = kvt_fault_window_last(f, o);
    size_t n = 0;
    if (f->hold && inj->f.index >= 0)
        snprintf(inj->hold_arg, sizeof(inj->hold_arg), "--hold=%s:%d",
                 f->phase, inj->f.index);
    else if (f->hold)
        snprintf(inj->hold_arg, sizeof(inj->hold_arg), "--hold=%s", f->phase);
    if (f->hold)
        inj->extra[n++] = inj->hold_arg;
    if (inj->engine_spec[0]) {
        snprintf(inj->faults_arg, sizeof(inj->faults_arg), "--faults=%s",
                 inj->engine_spec);
        inj->extra[n++] = inj->faults_arg;
    }
    inj->extra[n] = NULL;
    return 0;
}

void kvt_injector_fini(kvt_injector_t *inj)
{
    json_decref(inj->log);
    inj->log = NULL;
}

char *const *kvt_injector_rank_args(kvt_injector_t *inj,
                                    kvt_child_role_t role, uint32_t rank)
{
    /* The trigger rank holds; prefill rank 0 carries the engine fault.
     * Both are rank 0, and for engine faults both are prefill. */
    if (rank != 0 || !inj->extra[0])
        return NULL;
    if ((inj->f.hold && role == inj->f.trigger) ||
        (inj->engine_spec[0] && role == KVT_CHILD_PREFILL))
        return inj->extra;
    return NULL;
}

/* ------------------------------------------------------------------------ */
/* Injection                                                                */
/* ------------------------------------------------------------------------ */

static void kvt_injector_fire(kvt_injector_t *inj, kvt_child_t *trigger,
                              int room)
{
    kvt_orch_t *orch = inj->orch;
    inj->injected = 1;
    inj->injected_at = kvt_wall_now();
    inj->injected_ms = kvt_mono_ms();
    inj->room = room;
    kvt_child_t *v = NULL;
    switch (inj->f.kind) {
    case KVT_FAULT_KILL_PREFILL:
    case KVT_FAULT_KILL_DECODE:
    case KVT_FAULT_REGISTRY_DOWN:
        v = inj->f.target == KVT_CHILD_REGISTRY ? orch->registry
                                                : kvt_live(orch, inj->f.target, 0);
        if (v) {
            v->faulted = 1;
            kvt_child_signal(v, SIGKILL);
            kvt_injector_log(inj, "SIGKILL %s (pid %d) at phase %s of room %d",
                             v->name, (int)v->pid, inj->f.phase, room);
        }
        break;
    case KVT_FAULT_STOP_PREFILL:
    case KVT_FAULT_STOP_DECODE:
        if ((v = kvt_live(orch, inj->f.target, 0)) != NULL) {
            v->stopped = 1;
            kvt_child_signal(v, SIGSTOP);
            kvt_injector_log(inj, "SIGSTOP %s (pid %d) at phase %s of room %d",
                             v->name, (int)v->pid, inj->f.phase, room);
        }
        break;
    case KVT_FAULT_RESET:
    case KVT_FAULT_CORRUPT:
    case KVT_FAULT_BADADDR:
        inj->window_open = 1;
        kvt_injector_log(inj, "room %d reached %s on %s; the engine fault "
                         "'%s' fires inside it at that byte count", room,
                         inj->f.phase, trigger->name, inj->engine_spec);
        break;
    case KVT_FAULT_NONE:
        break;
    }
    inj->victim = v;
    if (!v && !inj->f.engine)
        kvt_orch_error(orch, "fault %s: no live %s process to act on",
                       inj->f.spec, inj->f.target == KVT_CHILD_REGISTRY
                       ? "registry" : inj->f.target == KVT_CHILD_PREFILL
                       ? "prefill[0]" : "decode[0]");
    /* The rooms in flight now are the ones the fault hits.  A process
     * fault also meets every room started while it lasts (the peer is
     * dead or stopped until the fresh batch); an engine fault fires once,
     * within the rooms in flight while its bytes go out (the window stays
     * open until the room that hit WHEN is final). */
    kvt_report_touch_pending(inj->rep, !inj->f.engine);
    /* A stopped trigger reads this after SIGCONT; a killed one never (the
     * write then fails with EPIPE, which is ignored). */
    if (inj->f.hold)
        kvt_child_send(trigger, "resume\n");
}

void kvt_injector_on_event(kvt_injector_t *inj, kvt_child_t *c,
                           const char *type, json_t *ev)
{
    json_t *ji = json_object_get(ev, "index");
    int index = json_is_integer(ji) ? (int)json_integer_value(ji) : -1;
    if (strcmp(type, "ready") == 0) {
        const char *a = json_string_value(json_object_get(ev, "addr"));
        if (c == inj->restarted)
            snprintf(inj->restarted_addr, sizeof(inj->restarted_addr), "%s",
                     a ? a : "");
        else if (c->role == inj->f.target && c->rank == 0 && !inj->target_addr[0])
            snprintf(inj->target_addr, sizeof(inj->target_addr), "%s",
                     a ? a : "");
        return;
    }
    if (index < 0)
        return;
    if (strcmp(type, "phase") == 0 && !inj->injected &&
        inj->stage == KVT_FSTAGE_FIRST && c->role == inj->f.trigger &&
        c->rank == 0 && (uint32_t)index < inj->o->requests &&
        (inj->f.index < 0 || index == inj->f.index)) {
        const char *p = json_string_value(json_object_get(ev, "phase"));
        if (p && strcmp(p, inj->f.phase) == 0)
            kvt_injector_fire(inj, c, index);
        return;
    }
    if (!inj->window_open)
        return;
    kvt_report_touch(inj->rep, (uint32_t)index);
    if (index == inj->room && kvt_report_room_final(inj->rep, (uint32_t)index))
        inj->window_open = 0;
}

/* ------------------------------------------------------------------------ */
/* Recovery                                                                 */
/* ------------------------------------------------------------------------ */

/* A killed rank cannot report its rooms: record each one it had not
 * reported as failed by the kill, once its last event line has been read. */
static void kvt_injector_mark_gone(kvt_injector_t *inj)
{
    kvt_child_t *v = inj->victim;
    if (inj->gone_marked || !v || !v->faulted || !kvt_is_rank(v) || v->out_fd >= 0)
        return;
    char reason[256];
    snprintf(reason, sizeof(reason), "%s (pid %d) was killed with SIGKILL by "
             "the demo's fault injector (--fault %s) before it reported this "
             "room; its engine and every room on it are gone", v->name,
             (int)v->pid, inj->f.spec);
    kvt_report_rank_gone(inj->rep, v, inj->target_addr, 0, inj->o->requests,
                         reason, inj->injected_at);
    inj->gone_marked = 1;
}

static void kvt_injector_resume(kvt_injector_t *inj, uint64_t now)
{
    kvt_child_t *v = inj->victim;
    if (!v || !v->stopped || inj->resumed)
        return;
    /* The stop has been seen once every peer has resolved the rooms it
     * hit; rooms started since are the resumed rank's business. */
    int seen = kvt_report_hit_final_except(inj->rep, v);
    if (!seen && now - inj->injected_ms < KVT_FAULT_STOP_HOLD_MS)
        return;
    kvt_child_signal(v, SIGCONT);
    v->stopped = 0;
    inj->resumed = 1;
    inj->resumed_at = kvt_wall_now();
    kvt_injector_log(inj, "SIGCONT %s (%s)", v->name,
                     seen ? "every other rank has resolved the rooms it hit"
                          : "hold time over");
}

/* Start what the fault took down.  @return 0, or -1 (error recorded). */
static int kvt_injector_restart(kvt_injector_t *inj)
{
    kvt_child_t *v = inj->victim;
    if (!v || !v->faulted)
        return 0;
    if (!kvt_is_rank(v)) {
        if (kvt_orch_restart_registry(inj->orch) != 0)
            return -1;
        kvt_injector_log(inj, "restarted the registry on %s (pid %d)",
                         inj->orch->registry_addr, (int)inj->orch->registry->pid);
        return 0;
    }
    inj->restarted = kvt_orch_start_rank(inj->orch, v->role, v->rank, NULL);
    if (!inj->restarted)
        return -1;
    snprintf(inj->restarted->name, sizeof(inj->restarted->name), "%s#2",
             v->name);
    kvt_injector_log(inj, "restarted %s as %s (pid %d)", v->name,
                     inj->restarted->name, (int)inj->restarted->pid);
    return 0;
}

/* Does the registry list the restarted prefill rank at its new address? */
static int kvt_injector_route_ok(kvt_injector_t *inj)
{
    if (kvt_orch_registry_complete(inj->orch) != 1)
        return 0;
    kvt_child_t *r = inj->restarted;
    if (!r || r->role != KVT_CHILD_PREFILL)
        return 1;
    if (!inj->restarted_addr[0])
        return 0;
    char path[160], body[512];
    kvt_coord_t at = kvt_opts_coord(inj->o, 1, r->rank);   /* its DP group, stage, TP rank */
    snprintf(path, sizeof(path), "/route?prefill_dp_rank=%u&prefill_cp_rank=0"
             "&target_tp_rank=%u&target_pp_rank=%u", at.dp, at.tp, at.pp);
    if (kvt_orch_http_get(inj->orch, path, body, sizeof(body)) != 200)
        return 0;
    json_t *j = json_loads(body, 0, NULL);
    char addr[96];
    snprintf(addr, sizeof(addr), "%s:%lld",
             json_string_value(json_object_get(j, "rank_ip"))
                 ? json_string_value(json_object_get(j, "rank_ip")) : "",
             (long long)json_integer_value(json_object_get(j, "rank_port")));
    json_decref(j);
    return strcmp(addr, inj->restarted_addr) == 0;
}

static void kvt_injector_send_batch(kvt_injector_t *inj)
{
    char line[64];
    snprintf(line, sizeof(line), "batch %u %u\n", inj->o->requests,
             inj->o->after_fault_requests);
    kvt_orch_t *orch = inj->orch;
    for (size_t i = 0; i < orch->kids.n; i++) {
        kvt_child_t *c = &orch->kids.v[i];
        if (!kvt_is_rank(c) || c->reaped || c->out_fd < 0)
            continue;
        c->finished = 0;
        kvt_child_send(c, line);
    }
    inj->batch_sent = 1;
    inj->stage = KVT_FSTAGE_AFTER;
    kvt_injector_log(inj, "fresh batch: %u rooms (requests %u..%u)",
                     inj->o->after_fault_requests, inj->o->requests,
                     inj->o->requests + inj->o->after_fault_requests - 1);
}

static void kvt_injector_recover(kvt_injector_t *inj, uint64_t now)
{
    kvt_child_t *r = inj->restarted;
    if (r && !r->ready && (r->reaped || r->out_fd < 0)) {
        char ex[64];
        kvt_child_exit_str(r, ex, sizeof(ex));
        kvt_orch_error(inj->orch, "fault %s: %s exited before it was ready "
                       "(%s); see its log above", inj->f.spec, r->name, ex);
        inj->stage = KVT_FSTAGE_DONE;
        return;
    }
    if ((!r || r->ready) && now - inj->asked_at_ms >= 100) {
        inj->asked_at_ms = now;   /* ticks come every 20 ms; the registry needs no more */
        if (kvt_injector_route_ok(inj)) {
            kvt_injector_send_batch(inj);
            return;
        }
    }
    if (now - inj->recover_at_ms > KVT_FAULT_RECOVER_MS) {
        kvt_orch_error(inj->orch, "fault %s: the deployment did not recover "
                       "within %d s (%s); the fresh batch was not run",
                       inj->f.spec, KVT_FAULT_RECOVER_MS / 1000,
                       r && !r->ready ? "the restarted rank never said ready"
                       : "the registry does not list every prefill rank at "
                         "its current address");
        inj->stage = KVT_FSTAGE_DONE;
    }
}

void kvt_injector_tick(kvt_injector_t *inj)
{
    uint64_t now = kvt_mono_ms();
    if (!inj->injected)
        return;
    kvt_injector_mark_gone(inj);
    kvt_injector_resume(inj, now);
    if (inj->stage == KVT_FSTAGE_RECOVER)
        kvt_injector_recover(inj, now);
}

int kvt_injector_on_finished(kvt_injector_t *inj)
{
    /* The tick may send the fresh batch (recovery done): the ranks have
     * finished the batch before it, not that one. */
    int recovering = inj->stage == KVT_FSTAGE_RECOVER;
    kvt_injector_tick(inj);
    if (recovering)
        return inj->stage != KVT_FSTAGE_DONE;
    switch (inj->stage) {
    case KVT_FSTAGE_FIRST:
        if (!inj->injected) {
            kvt_injector_log(inj, "never fired: no room reached phase %s on "
                             "%s[0]", inj->f.phase,
                             inj->f.trigger == KVT_CHILD_PREFILL ? "prefill"
                                                                 : "decode");
            inj->stage = KVT_FSTAGE_DONE;
            return 0;
        }
        if (inj->victim && inj->victim->stopped)
            return 1;   /* cannot happen: a stopped rank has not finished */
        if (inj->o->after_fault_requests == 0 ||
            !kvt_report_batch_final(inj->rep, 0, inj->o->requests)) {
            inj->stage = KVT_FSTAGE_DONE;   /* unresolved rooms: the verdict says so */
            return 0;
        }
        kvt_injector_log(inj, "every room of the first batch is final");
        inj->stage = KVT_FSTAGE_RECOVER;
        inj->recover_at_ms = kvt_mono_ms();
        if (kvt_injector_restart(inj) != 0) {
            inj->stage = KVT_FSTAGE_DONE;
            return 0;
        }
        kvt_injector_recover(inj, inj->recover_at_ms);
        return inj->stage != KVT_FSTAGE_DONE;
    case KVT_FSTAGE_RECOVER:
        return 1;
    case KVT_FSTAGE_AFTER:
        inj->stage = KVT_FSTAGE_DONE;
        return 0;
    case KVT_FSTAGE_DONE:
        break;
    }
    return 0;
}

json_t *kvt_injector_detail(const kvt_injector_t *inj)
{
    const kvt_child_t *v = inj->victim;
    return json_pack("{s:s, s:s, s:s, s:s?, s:s?, s:b, s:o, s:s?, s:b, s:i, s:O}",
                     "spec", inj->f.spec, "phase", inj->f.phase,
                     "trigger", inj->f.trigger == KVT_CHILD_PREFILL
                                    ? "prefill[0]" : "decode[0]",
                     "target", v ? v->name : inj->f.engine ? "prefill[0] engine" : NULL,
                     "target_addr", inj->target_addr[0] ? inj->target_addr : NULL,
                     "injected", inj->injected,
                     "room", inj->room >= 0 ? json_integer(inj->room) : json_null(),
                     "engine_faults", inj->engine_spec[0] ? inj->engine_spec : NULL,
                     "restarted", inj->restarted != NULL,
                     "touched", (int)kvt_report_touched(inj->rep, KVT_HIT),
                     "log", inj->log);
}
