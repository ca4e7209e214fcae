/*
 * Merging rank reports into the demo's verdict (see report.h), and
 * printing it: as one JSON object, or as a short readable summary whose
 * failure section groups identical reasons so that 1,000 rooms failing for
 * one cause read as one line with a count.
 */
#include "report.h"

#include <stdlib.h>
#include <string.h>

#include "kvferry/kvferry.h"
#include "pattern.h"

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
    r->nrooms = o->requests;
    r->nranks = o->prefill_tp + o->decode_tp;
    r->ids = malloc((size_t)r->nrooms * sizeof(*r->ids));
    r->slots = calloc((size_t)r->nrooms * r->nranks, sizeof(*r->slots));
    r->ranks = json_array();
    if (!r->ids || !r->slots || !r->ranks)
        return -1;
    for (uint32_t i = 0; i < r->nrooms; i++)
        r->ids[i] = kvt_room_id(o->seed, i);
    for (size_t i = 0; i < (size_t)r->nrooms * r->nranks; i++) {
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
    json_decref(r->ranks);
    memset(r, 0, sizeof(*r));
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
    uint32_t col = c->role == KVT_CHILD_PREFILL ? c->rank
                                                : r->o->prefill_tp + c->rank;
    return &r->slots[(size_t)index * r->nranks + col];
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
    json_t *f = json_object_get(room, "failure");
    if (json_is_object(f))
        s->failure = json_incref(f);
}

void kvt_report_result(kvt_report_t *r, const kvt_child_t *c, json_t *ev)
{
    json_t *rooms = json_object_get(ev, "rooms"), *room;
    size_t i;
    json_array_foreach(rooms, i, room)
        kvt_report_room(r, c, room);
    json_array_append_new(r->ranks, json_pack(
        "{s:s, s:O?, s:O?, s:O?, s:O?, s:O?, s:i}", "name", c->name,
        "addr", json_object_get(ev, "addr"), "bytes", json_object_get(ev, "bytes"),
        "start", json_object_get(ev, "start"), "end", json_object_get(ev, "end"),
        "stats", json_object_get(ev, "stats"), "rooms", (int)json_array_size(rooms)));
}

/* "decode[1] at waiting" for each rank that has not reported room i. */
static json_t *kvt_pending(kvt_report_t *r, uint32_t i)
{
    json_t *a = json_array();
    for (uint32_t k = 0; k < r->nranks; k++) {
        const kvt_slot_t *s = &r->slots[(size_t)i * r->nranks + k];
        if (s->state >= 0)
            continue;
        int pre = k < r->o->prefill_tp;
        unsigned rank = pre ? k : k - r->o->prefill_tp;
        if (s->phase == 0)
            json_array_append_new(a, json_sprintf(
                "%s[%u] not started", pre ? "prefill" : "decode", rank));
        else
            json_array_append_new(a, json_sprintf(
                "%s[%u] last phase: %s", pre ? "prefill" : "decode", rank,
                kvt_phase_names[s->phase]));
    }
    return a;
}

json_t *kvt_report_summary(kvt_report_t *r, const kvt_children_t *kids,
                           const kvt_run_info_t *info, int *ok_p)
{
    const kvt_opts_t *o = r->o;
    uint32_t ok_rooms = 0, failed = 0, unresolved = 0;
    uint64_t bytes = 0;
    int verified = 1;
    double t0 = 0, t1 = 0;
    json_t *failures = json_array(), *unres = json_array();
    json_t *procs = json_array(), *problems = json_array();

    for (uint32_t i = 0; i < r->nrooms; i++) {
        int all_final = 1, all_ok = 1;
        uint64_t room_bytes = 0;
        for (uint32_t k = 0; k < r->nranks; k++) {
            const kvt_slot_t *s = &r->slots[(size_t)i * r->nranks + k];
            int decode = k >= o->prefill_tp;
            if (s->failure)
                json_array_append(failures, s->failure);
            if (s->state < 0) {
                all_final = all_ok = 0;
                continue;
            }
            if (t0 == 0 || s->start < t0)
                t0 = s->start;
            if (s->end > t1)
                t1 = s->end;
            if (s->state != KVF_POLL_SUCCESS || (decode && s->verified != 1))
                all_ok = 0;
            if (decode && s->state == KVF_POLL_SUCCESS && s->verified != 1)
                verified = 0;
            if (decode)
                room_bytes += s->bytes;
        }
        if (!all_final) {
            unresolved++;
            if (json_array_size(unres) < KVT_UNRESOLVED_LIST_MAX)
                json_array_append_new(unres, json_pack(
                    "{s:I, s:i, s:o}", "room", (json_int_t)r->ids[i],
                    "index", (int)i, "pending", kvt_pending(r, i)));
        } else if (all_ok) {
            ok_rooms++;
            bytes += room_bytes;
        } else {
            failed++;
        }
    }

    if (info->error)   /* the root cause first; exits below follow from it */
        json_array_append_new(problems, json_string(info->error));
    int procs_ok = 1;
    for (size_t i = 0; i < kids->n; i++) {
        const kvt_child_t *c = &kids->v[i];
        char ex[64];
        kvt_child_exit_str(c, ex, sizeof(ex));
        json_array_append_new(procs, json_pack("{s:s, s:i, s:s}", "name",
                                               c->name, "pid", (int)c->pid,
                                               "exit", ex));
        if (c->role != KVT_CHILD_REGISTRY && !kvt_child_exited_ok(c)) {
            procs_ok = 0;
            json_array_append_new(problems, json_sprintf("%s: %s", c->name, ex));
        }
    }
    if (info->timed_out)
        json_array_append_new(problems, json_sprintf(
            "timeout: not finished after --timeout %u s; every process was "
            "killed", o->timeout));
    if (info->signal)
        json_array_append_new(problems, json_sprintf(
            "interrupted by SIG%s", sigabbrev_np(info->signal)));

    double secs = t1 > t0 ? t1 - t0 : 0;
    *ok_p = ok_rooms == r->nrooms && verified && procs_ok && !info->error &&
            !info->timed_out && !info->signal;
    return json_pack(
        "{s:b, s:s, s:s, s:s, s:i, s:i, s:i, s:i, s:i, s:i, s:i, s:i,"
        " s:I, s:b, s:s, s:b,"
        " s:i, s:i, s:i, s:i, s:I, s:b, s:f, s:f,"
        " s:o, s:o, s:o, s:o, s:O}",
        "ok", *ok_p, "model", o->model, "kv_dtype", o->kv_dtype,
        "decode_kv_dtype", o->decode_kv_dtype, "page_size", (int)o->page_size,
        "decode_page_size", (int)o->decode_page_size, "tokens", (int)o->tokens,
        "chunk", (int)o->chunk, "prefill_tp", (int)o->prefill_tp,
        "decode_tp", (int)o->decode_tp, "concurrency", (int)o->concurrency,
        "timeout", (int)o->timeout,
        "seed", (json_int_t)o->seed, "checksum", o->checksum,
        "transport", info->transport, "scattered", !o->contiguous,
        "rooms", (int)r->nrooms, "succeeded", (int)ok_rooms,
        "failed", (int)failed, "unresolved", (int)unresolved,
        "bytes", (json_int_t)bytes, "verified", verified,
        "seconds", secs, "gbps", secs > 0 ? (double)bytes / secs / 1e9 : 0.0,
        "failures", failures, "unresolved_rooms", unres,
        "problems", problems, "processes", procs, "ranks", r->ranks);
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

void kvt_report_print(FILE *out, json_t *s)
{
    long long rooms = kvt_int(s, "rooms"), ok = kvt_int(s, "succeeded");
    double gb = (double)kvt_int(s, "bytes") / 1e9;
    double secs = json_real_value(json_object_get(s, "seconds"));
    fprintf(out, "kvferry demo: %s, %s (decode %s), page_size %lld (decode "
            "%lld), TP %lld -> %lld\n", kvt_str(s, "model"),
            kvt_str(s, "kv_dtype"), kvt_str(s, "decode_kv_dtype"),
            kvt_int(s, "page_size"), kvt_int(s, "decode_page_size"),
            kvt_int(s, "prefill_tp"), kvt_int(s, "decode_tp"));
    fprintf(out, "  requests   %lld rooms x %lld tokens, %lld tokens per send, "
            "%lld in flight per rank, %s decode pages, transport %s%s\n",
            rooms, kvt_int(s, "tokens"), kvt_int(s, "chunk"),
            kvt_int(s, "concurrency"),
            json_is_true(json_object_get(s, "scattered")) ? "scattered" : "contiguous",
            kvt_str(s, "transport"),
            json_is_true(json_object_get(s, "checksum")) ? ", checksums on" : "");
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
    json_array_foreach(json_object_get(s, "problems"), i, e)
        fprintf(out, "  problem    %s\n", json_string_value(e));
    fprintf(out, "  result     %s\n", json_is_true(json_object_get(s, "ok"))
            ? "PASS: every room succeeded and every byte verified"
            : "FAIL");
}
