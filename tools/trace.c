/*
 * `kvferry trace ROOM FILES...`: one room's story on every rank, merged.
 *
 * Each engine with a trace (kvf_engine_params_t.trace, KVF_TRACE) writes
 * one JSON line per room event, with its rank and two clocks: the wall
 * clock, to order lines of different processes (and hosts, as well as
 * their clocks agree), and its own monotonic clock, which orders its own
 * lines even when the wall clock steps.  This command reads every line of
 * every file given, keeps the room's, orders them, and prints one
 * timeline, what each rank spent in each state, and where the failure
 * started: the earliest "failed" line that is not from_another_rank, the
 * rank that saw the root cause.  --json prints the same as one object.
 *
 * Lines that are not trace records (a log interleaved in the file) are
 * skipped and counted.  Exit status: 0, 1 when no line names the room or
 * a file cannot be read, 2 for bad usage.
 */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "tool.h"

typedef struct kvt_rec {
    json_t     *j;
    const char *event;
    long long   wall, mono;
    size_t      seq;          /* input order, the last tie-break */
    int         rank;         /* index in kvt_trace_t.ranks */
} kvt_rec_t;

typedef struct kvt_rank {
    char        label[96];    /* "decode rank 0", with stage / DP group */
    const char *engine;       /* instance (hex) */
    const char *addr;
    long long   t_state[5];   /* wall time it entered each poll state; 0 never */
    long long   t_created, t_final, t_destroyed;
    const char *final;        /* "Success", "Failed", or NULL */
} kvt_rank_t;

typedef struct kvt_trace {
    kvt_rec_t  *recs;
    size_t      n, cap;
    kvt_rank_t  ranks[256];
    int         nranks;
    size_t      skipped;
} kvt_trace_t;

static const char *const kvt_states[5] = {"Failed", "Bootstrapping", "WaitingForInput",
                                          "Transferring", "Success"};

static const char *kvt_str(json_t *j, const char *key)
{
    const char *s = json_string_value(json_object_get(j, key));
    return s != NULL ? s : "";
}

static long long kvt_int(json_t *j, const char *key)
{
    return (long long)json_integer_value(json_object_get(j, key));
}

/* The rank a record is from (one per engine instance), added if new. */
static int kvt_rank_of(kvt_trace_t *t, json_t *j)
{
    const char *engine = kvt_str(j, "engine");
    for (int i = 0; i < t->nranks; i++)
        if (strcmp(t->ranks[i].engine, engine) == 0)
            return i;
    if (t->nranks == (int)(sizeof(t->ranks) / sizeof(t->ranks[0])))
        return -1;
    kvt_rank_t *r = &t->ranks[t->nranks];
    memset(r, 0, sizeof(*r));
    r->engine = engine;
    r->addr = kvt_str(j, "addr");
    int n = snprintf(r->label, sizeof(r->label), "%s rank %lld", kvt_str(j, "side"),
                     kvt_int(j, "tp"));
    if (kvt_int(j, "pp") > 0)
        n += snprintf(r->label + n, sizeof(r->label) - (size_t)n, " stage %lld",
                      kvt_int(j, "pp"));
    if (kvt_int(j, "dp") > 0)
        snprintf(r->label + n, sizeof(r->label) - (size_t)n, " dp %lld", kvt_int(j, "dp"));
    /* The same rank again: an engine restarted (a new instance). */
    for (int i = 0; i < t->nranks; i++)
        if (strcmp(t->ranks[i].label, r->label) == 0) {
            snprintf(r->label + strlen(r->label), sizeof(r->label) - strlen(r->label),
                     " (instance %.6s)", engine);
            break;
        }
    return t->nranks++;
}

/* Keep the records of `room` from one file ("-": stdin).  -1 on error. */
static int kvt_read(kvt_trace_t *t, const char *path, const char *room)
{
    FILE *f = strcmp(path, "-") == 0 ? stdin : fopen(path, "r");
    if (f == NULL) {
        fprintf(stderr, "kvferry trace: cannot read %s: %s\n", path, strerror(errno));
        return -1;
    }
    char *line = NULL;
    size_t cap = 0;
    while (getline(&line, &cap, f) > 0) {
        json_t *j = json_loads(line, 0, NULL);
        const char *r = json_string_value(json_object_get(j, "room"));
        if (!json_is_object(j) || r == NULL || !json_is_integer(json_object_get(j, "wall_ns"))) {
            t->skipped++;
            json_decref(j);
            continue;
        }
        if (strcmp(r, room) != 0) {
            json_decref(j);
            continue;
        }
        if (t->n == t->cap) {
            size_t c = t->cap ? 2 * t->cap : 256;
            kvt_rec_t *g = realloc(t->recs, c * sizeof(*g));
            if (g == NULL) {
                json_decref(j);
                break;
            }
            t->recs = g;
            t->cap = c;
        }
        kvt_rec_t *k = &t->recs[t->n];
        k->j = j;
        k->event = kvt_str(j, "event");
        k->wall = kvt_int(j, "wall_ns");
        k->mono = kvt_int(j, "mono_ns");
        k->seq = t->n++;
        k->rank = kvt_rank_of(t, j);
    }
    free(line);
    if (f != stdin)
        fclose(f);
    return 0;
}

/* Wall clock orders ranks; one rank's own lines keep their monotonic order. */
static int kvt_cmp(const void *a, const void *b)
{
    const kvt_rec_t *x = a, *y = b;
    if (x->rank == y->rank && x->mono != y->mono)
        return x->mono < y->mono ? -1 : 1;
    if (x->wall != y->wall)
        return x->wall < y->wall ? -1 : 1;
    return x->seq < y->seq ? -1 : x->seq > y->seq;
}

/* Each rank's state changes, for "where the time went". */
static void kvt_phases(kvt_trace_t *t)
{
    for (size_t i = 0; i < t->n; i++) {
        kvt_rec_t *k = &t->recs[i];
        if (k->rank < 0)
            continue;
        kvt_rank_t *r = &t->ranks[k->rank];
        if (strcmp(k->event, "created") == 0) {
            r->t_created = k->wall;
            r->t_state[1] = k->wall;
        } else if (strcmp(k->event, "destroyed") == 0) {
            r->t_destroyed = k->wall;
        } else if (strcmp(k->event, "state") == 0 || strcmp(k->event, "failed") == 0) {
            const char *s = strcmp(k->event, "failed") == 0 ? "Failed" : kvt_str(k->j, "state");
            for (int st = 0; st < 5; st++)
                if (strcmp(s, kvt_states[st]) == 0 && (r->t_state[st] == 0 || st == 0))
                    r->t_state[st] = k->wall;
            if (strcmp(s, "Success") == 0 || strcmp(s, "Failed") == 0) {
                r->final = strcmp(s, "Success") == 0 ? kvt_states[4] : kvt_states[0];
                r->t_final = k->wall;
            }
        }
    }
}

/* Milliseconds rank r spent in state st: until the next state it reached,
 * its end, or -1 when it never was in it. */
static double kvt_in_state(const kvt_rank_t *r, int st)
{
    if (r->t_state[st] == 0)
        return -1;
    long long end = 0;
    for (int n = st + 1; n < 5 && end == 0; n++)
        end = r->t_state[n];
    if (r->final != NULL && strcmp(r->final, "Failed") == 0 &&
        (end == 0 || r->t_state[0] < end))
        end = r->t_state[0];
    if (end == 0)
        end = r->t_destroyed;
    return end > 0 ? (double)(end - r->t_state[st]) / 1e6 : -1;
}

static const kvt_rec_t *kvt_root_cause(const kvt_trace_t *t)
{
    for (size_t i = 0; i < t->n; i++)
        if (strcmp(t->recs[i].event, "failed") == 0 &&
            kvt_int(t->recs[i].j, "from_another_rank") == 0)
            return &t->recs[i];
    return NULL;
}

/* The fields of an event worth a timeline line, "k=v ..." */
static void kvt_details(json_t *j, char *buf, size_t len)
{
    static const char *const keys[] = {"state", "peer", "stream", "pages", "bytes", "ranks",
                                       "targets"};
    size_t n = 0;
    buf[0] = '\0';
    for (size_t i = 0; i < sizeof(keys) / sizeof(keys[0]) && n < len; i++) {
        json_t *v = json_object_get(j, keys[i]);
        if (json_is_string(v))
            n += (size_t)snprintf(buf + n, len - n, " %s=%s", keys[i], json_string_value(v));
        else if (json_is_integer(v))
            n += (size_t)snprintf(buf + n, len - n, " %s=%" JSON_INTEGER_FORMAT, keys[i],
                                  json_integer_value(v));
    }
}

static void kvt_print_failed(const kvt_rec_t *k, const kvt_rec_t *root)
{
    json_t *j = k->j;
    if (k == root)
        printf("FAILED %s, the root cause, seen here: %s\n", kvt_str(j, "status"),
               kvt_str(j, "reason"));
    else
        printf("failed %s, learned from another rank (origin %s rank %lld at %s%s%s%s)\n",
               kvt_str(j, "status"), kvt_str(j, "origin_side"), kvt_int(j, "origin_rank"),
               kvt_str(j, "origin_addr"), json_object_get(j, "via") ? ", via " : "",
               kvt_str(j, "via"), kvt_int(j, "after_success") ? ", after it had succeeded here"
                                                              : "");
}

static void kvt_print(const kvt_trace_t *t, const char *room)
{
    long long t0 = t->recs[0].wall;
    int w = 0;
    for (int i = 0; i < t->nranks; i++)
        if ((int)strlen(t->ranks[i].label) > w)
            w = (int)strlen(t->ranks[i].label);
    printf("room %s: %d rank%s, %zu events over %.3f ms\n", room, t->nranks,
           t->nranks == 1 ? "" : "s", t->n, (double)(t->recs[t->n - 1].wall - t0) / 1e6);
    const kvt_rec_t *root = kvt_root_cause(t);
    for (size_t i = 0; i < t->n; i++) {
        const kvt_rec_t *k = &t->recs[i];
        printf("  %+10.3f ms  %-*s  ", (double)(k->wall - t0) / 1e6, w,
               k->rank >= 0 ? t->ranks[k->rank].label : "?");
        if (strcmp(k->event, "failed") == 0) {
            kvt_print_failed(k, root);
            continue;
        }
        char d[512];
        if (strcmp(k->event, "state") == 0) {
            printf("-> %s\n", kvt_str(k->j, "state"));
            continue;
        }
        kvt_details(k->j, d, sizeof(d));
        printf("%s%s\n", k->event, d);
    }
    printf("\nwhere the time went:\n");
    for (int i = 0; i < t->nranks; i++) {
        const kvt_rank_t *r = &t->ranks[i];
        printf("  %-*s ", w, r->label);
        for (int st = 1; st <= 3; st++) {
            double ms = kvt_in_state(r, st);
            if (ms >= 0)
                printf(" %s %.3f ms,", kvt_states[st], ms);
        }
        if (r->final != NULL)
            printf(" %s at %+.3f ms\n", r->final, (double)(r->t_final - t0) / 1e6);
        else
            printf(" not final in this trace\n");
    }
    if (root != NULL) {
        const kvt_rank_t *r = &t->ranks[root->rank];
        int learned = 0;
        for (size_t i = 0; i < t->n; i++)
            learned += strcmp(t->recs[i].event, "failed") == 0 && &t->recs[i] != root;
        printf("\nthe failure started on %s (%s) at %+.3f ms: %s: %s\n", r->label, r->addr,
               (double)(root->wall - t0) / 1e6, kvt_str(root->j, "status"),
               kvt_str(root->j, "reason"));
        printf("%d other rank%s learned it from another rank\n", learned,
               learned == 1 ? "" : "s");
    } else {
        for (size_t i = 0; i < t->n; i++)
            if (strcmp(t->recs[i].event, "failed") == 0) {
                printf("\nno trace given has the root cause where it was seen: every rank "
                       "here learned it; its origin is %s rank %lld at %s (add that rank's "
                       "trace file)\n", kvt_str(t->recs[i].j, "origin_side"),
                       kvt_int(t->recs[i].j, "origin_rank"),
                       kvt_str(t->recs[i].j, "origin_addr"));
                break;
            }
    }
}

static json_t *kvt_json(const kvt_trace_t *t, const char *room)
{
    long long t0 = t->recs[0].wall;
    json_t *events = json_array(), *ranks = json_array();
    for (size_t i = 0; i < t->n; i++) {
        json_t *e = json_copy(t->recs[i].j);
        json_object_set_new(e, "t_ms", json_real((double)(t->recs[i].wall - t0) / 1e6));
        if (t->recs[i].rank >= 0)
            json_object_set_new(e, "rank", json_string(t->ranks[t->recs[i].rank].label));
        json_array_append_new(events, e);
    }
    for (int i = 0; i < t->nranks; i++) {
        const kvt_rank_t *r = &t->ranks[i];
        json_t *ms = json_object();
        for (int st = 1; st <= 3; st++) {
            double v = kvt_in_state(r, st);
            if (v >= 0)
                json_object_set_new(ms, kvt_states[st], json_real(v));
        }
        json_array_append_new(ranks, json_pack(
            "{s:s, s:s, s:s, s:o, s:o, s:o}", "rank", r->label, "engine", r->engine,
            "addr", r->addr, "final", r->final ? json_string(r->final) : json_null(),
            "final_ms", r->final ? json_real((double)(r->t_final - t0) / 1e6) : json_null(),
            "ms_in_state", ms));
    }
    const kvt_rec_t *root = kvt_root_cause(t);
    json_t *rc = json_null();
    if (root != NULL) {
        rc = json_copy(root->j);
        json_object_set_new(rc, "rank", json_string(t->ranks[root->rank].label));
        json_object_set_new(rc, "t_ms", json_real((double)(root->wall - t0) / 1e6));
    }
    return json_pack("{s:s, s:o, s:o, s:o, s:I}", "room", room, "root_cause", rc,
                     "ranks", ranks, "events", events, "skipped_lines",
                     (json_int_t)t->skipped);
}

static void kvt_trace_usage(FILE *out)
{
    fprintf(out,
        "Usage: kvferry trace ROOM FILE... [--json]\n"
        "\n"
        "Merge the room trace of every rank (engines run with KVF_TRACE=FILE, or\n"
        "kvf_engine_params_t.trace) into one timeline of room ROOM (its\n"
        "bootstrap_room, a decimal number): every event of every rank in order,\n"
        "the time each rank spent in each state, and where a failure started:\n"
        "the first rank that saw the root cause itself, not from another rank.\n"
        "FILE may be '-' for stdin; ranks may share a file.  Lines that are not\n"
        "trace records are skipped.  Ranks on different hosts are ordered by\n"
        "their wall clocks: keep them in sync (NTP, PTP).\n"
        "\n"
        "  --json   print one JSON object: root_cause, ranks, events\n");
}

int kvt_trace_main(int argc, char **argv)
{
    const char *room = NULL;
    int json = 0, nfiles = 0, rc = 0;
    kvt_trace_t *t = calloc(1, sizeof(*t));
    if (t == NULL)
        return 1;
    for (int i = 2; i < argc; i++) {
        if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) {
            kvt_trace_usage(stdout);
            free(t);
            return 0;
        }
        if (strcmp(argv[i], "--json") == 0) {
            json = 1;
        } else if (argv[i][0] == '-' && argv[i][1] != '\0') {
            fprintf(stderr, "kvferry trace: unknown option '%s' (see 'kvferry help trace')\n",
                    argv[i]);
            free(t);
            return 2;
        } else if (room == NULL) {
            room = argv[i];
            if (room[strspn(room, "0123456789")] != '\0' || room[0] == '\0') {
                fprintf(stderr, "kvferry trace: ROOM must be a room id (a decimal number), "
                        "got '%s'\n", room);
                free(t);
                return 2;
            }
        }
    }
    for (int i = 2; i < argc; i++)
        if (argv[i] != room && strcmp(argv[i], "--json") != 0) {
            nfiles++;
            if (kvt_read(t, argv[i], room) != 0)
                rc = 1;
        }
    if (room == NULL || nfiles == 0) {
        kvt_trace_usage(stderr);
        free(t);
        return 2;
    }
    if (t->n == 0) {
        fprintf(stderr, "kvferry trace: no trace record of room %s in the %d file%s given "
                "(%zu other lines skipped); was the trace on (KVF_TRACE)?\n", room, nfiles,
                nfiles == 1 ? "" : "s", t->skipped);
        rc = 1;
    } else {
        qsort(t->recs, t->n, sizeof(t->recs[0]), kvt_cmp);
        kvt_phases(t);
        if (json) {
            json_t *o = kvt_json(t, room);
            char *s = o ? json_dumps(o, JSON_COMPACT) : NULL;
            if (s != NULL)
                printf("%s\n", s);
            free(s);
            json_decref(o);
        } else {
            kvt_print(t, room);
        }
    }
    for (size_t i = 0; i < t->n; i++)
        json_decref(t->recs[i].j);
    free(t->recs);
    free(t);
    return rc;
}
