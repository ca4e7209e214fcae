/*
 * `kvferry demo`: a whole prefill/decode deployment on this host, one
 * process per part, and a verdict on every room.
 *
 * The orchestrator (orch.c) starts a registry and the prefill and decode
 * rank processes (`kvferry _rank`, see rank.c; --dp x --prefill-pp x
 * --prefill-tp and --decode-pp x --decode-tp of them), releases
 * them together and relays their event lines here, where the report
 * (report.c) merges them into one verdict per room.  Here too is the
 * all-reduce a scheduler runs over its ranks: once a room is final on
 * every rank that takes part in it, on both sides, each of them is told
 * the MIN of their states ("release"), and only then reports the room and
 * lets it go.  With --fault KIND@WHEN
 * the injector (fault.c) sees every event after the report, acts on the
 * orchestrator's child table when the first room reaches WHEN, and runs
 * the recovery and the fresh batch that follow.
 *
 * A fault run shortens the engines' room deadlines (unless the
 * environment sets them) so that every room resolves within seconds: the
 * verdict checks that nothing waits on a dead or stopped peer.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "kvferry/kvferry.h"
#include "fault.h"
#include "models.h"
#include "opts.h"
#include "orch.h"
#include "progress.h"
#include "report.h"
#include "tool.h"

typedef struct kvt_demo {
    kvt_opts_t     o;
    kvt_orch_t     orch;
    kvt_report_t   rep;
    kvt_fault_t    fault;
    kvt_injector_t inj;        /* used only with --fault */
    /* The progress line (progress.h): per room index, the decode ranks
     * that reported it final and whether any rank failed it. */
    kvt_progress_t prog;
    uint32_t       nrooms, done, failed;
    uint64_t       bytes;
    uint8_t       *dec_final, *room_failed;
} kvt_demo_t;

/* A rank's "room" event, for the progress line: a room is done once every
 * decode rank has it final, failed once any rank failed it. */
static void kvt_demo_count(kvt_demo_t *d, const kvt_child_t *c, json_t *ev)
{
    json_int_t i = json_integer_value(json_object_get(ev, "index"));
    if (d->dec_final == NULL || i < 0 || (uint64_t)i >= d->nrooms)
        return;
    const char *state = json_string_value(json_object_get(ev, "state"));
    if (state != NULL && strcmp(state, "Failed") == 0 && !d->room_failed[i]) {
        d->room_failed[i] = 1;
        d->failed++;
    }
    if (c->role != KVT_CHILD_DECODE)
        return;
    d->bytes += (uint64_t)json_integer_value(json_object_get(ev, "bytes"));
    if (++d->dec_final[i] == kvt_opts_nranks(&d->o, 0))
        d->done++;
}

/* Room deadlines of a fault run, each set only if the environment does not
 * set it: a room on a dead peer fails within heartbeat_timeout (2.5 s),
 * one that waits for a peer that never comes within these. */
static const char *const kvt_fault_env[][2] = {
    { "KVF_BOOTSTRAP_TIMEOUT_MS", "3000" },
    { "KVF_WAITING_TIMEOUT_MS",   "3000" },
    { "KVF_TRANSFER_TIMEOUT_MS",  "3000" },
};

/* Room `index` is final on every rank of it: tell each the outcome. */
static void kvt_demo_release(kvt_demo_t *d, uint32_t index)
{
    char line[64];
    snprintf(line, sizeof(line), "release %u %s\n", index,
             kvf_poll_name((kvf_poll_t)kvt_report_outcome(&d->rep, index)));
    kvt_orch_t *o = &d->orch;
    for (size_t i = 0; i < o->kids.n; i++)
        if (o->kids.v[i].out_fd >= 0 && kvt_report_involves(&d->rep, index, &o->kids.v[i]))
            kvt_child_send(&o->kids.v[i], line);
}

static void kvt_demo_on_event(void *ctx, kvt_child_t *c, const char *type,
                              json_t *ev)
{
    kvt_demo_t *d = ctx;
    if (strcmp(type, "final") == 0) {
        kvt_report_final(&d->rep, c, ev);
        json_t *ji = json_object_get(ev, "index");
        if (json_is_integer(ji) && json_integer_value(ji) >= 0 &&
            kvt_report_releasable(&d->rep, (uint32_t)json_integer_value(ji)))
            kvt_demo_release(d, (uint32_t)json_integer_value(ji));
    } else if (strcmp(type, "phase") == 0)
        kvt_report_phase(&d->rep, c, ev);
    else if (strcmp(type, "room") == 0) {
        kvt_report_room(&d->rep, c, ev);
        kvt_demo_count(d, c, ev);
    }
    else if (strcmp(type, "result") == 0)
        kvt_report_result(&d->rep, c, ev);
    if (d->o.fault)
        kvt_injector_on_event(&d->inj, c, type, ev);
}

static char *const *kvt_demo_rank_args(void *ctx, kvt_child_role_t role,
                                       uint32_t rank)
{
    kvt_demo_t *d = ctx;
    return kvt_injector_rank_args(&d->inj, role, rank);
}

static void kvt_demo_on_tick(void *ctx, uint64_t now_ms)
{
    kvt_demo_t *d = ctx;
    kvt_injector_tick(&d->inj);
    /* A killed rank's rooms count as final once the injector recorded them. */
    for (uint32_t i = 0; i < d->rep.nrooms; i++)
        if (kvt_report_releasable(&d->rep, i))
            kvt_demo_release(d, i);
    kvt_progress_show(&d->prog, now_ms, d->orch.go_at_ms, d->done, d->nrooms, d->bytes,
                      d->failed);
}

static int kvt_demo_on_finished(void *ctx)
{
    kvt_demo_t *d = ctx;
    return kvt_injector_on_finished(&d->inj);
}

/* Parse and check --fault; pick a chunk size that has a "mid" when none
 * was given.  Runs before kvt_opts_resolve.  @return 0, or -1 (message
 * printed). */
static int kvt_demo_fault_opts(kvt_demo_t *d)
{
    char err[512];
    if (!d->o.fault)
        return 0;
    if (kvt_fault_parse(d->o.fault, &d->fault, err, sizeof(err)) != 0) {
        fprintf(stderr, "kvferry demo: %s\n", err);
        return -1;
    }
    if (!d->o.chunk && d->o.page_size &&
        d->o.tokens / 4 / d->o.page_size * d->o.page_size >= d->o.page_size)
        d->o.chunk = d->o.tokens / 4 / d->o.page_size * d->o.page_size;
    for (size_t i = 0; i < sizeof(kvt_fault_env) / sizeof(kvt_fault_env[0]); i++)
        setenv(kvt_fault_env[i][0], kvt_fault_env[i][1], 0);
    return 0;
}

/* ------------------------------------------------------------------------ */
/* Main                                                                     */
/* ------------------------------------------------------------------------ */

static void kvt_demo_usage(FILE *out)
{
    fprintf(out,
        "Usage: kvferry demo [options]\n"
        "\n"
        "Run a whole prefill/decode deployment on this host, one process per\n"
        "part: a bootstrap registry, --dp x --prefill-pp x --prefill-tp prefill\n"
        "ranks and --decode-pp x --decode-tp decode ranks, each with KV buffers\n"
        "of a real model's layout (a pipeline stage holds its share of the\n"
        "layers; a prefill DP group serves the rooms with id %% --dp equal to\n"
        "its DP rank).  --requests rooms of --tokens tokens go from prefill\n"
        "pages into randomly scattered decode pages; decode verifies every byte\n"
        "of its heads and layers, and the aux tag from the last prefill stage.\n"
        "Each rank keeps a room until every rank of it, both sides, is final,\n"
        "then is told the MIN of their states (a scheduler's all-reduce); a\n"
        "rank whose room did not fail waits up to 1 s for the cause\n"
        "(kvf_*_await_failure) and reports the room as it then is.  Every room\n"
        "must end in one state on all its ranks, and its failure records must\n"
        "name one rank in common (docs/GUIDE.md, Faults).\n"
        "Exit status 0 only when every room succeeded and verified (under\n"
        "--fault: see Faults below), 1 otherwise, 2 for bad options.\n"
        "\n"
        "Options:\n");
    kvt_opts_t def;
    kvt_opts_defaults(&def, KVT_OPTS_DEMO);
    kvt_opts_usage(out, KVT_OPTS_DEMO, &def);
    fprintf(out, "\n");
    kvt_models_print(out);
    fprintf(out,
        "\nFaults (--fault KIND@WHEN), acting on rank 0 of a side when the first\n"
        "room reaches WHEN (bootstrap, mid: after a non-last chunk, last: after\n"
        "the last chunk):\n"
        "  kill-prefill, kill-decode   SIGKILL the rank; restarted for the fresh batch\n"
        "  stop-prefill, stop-decode   SIGSTOP it; SIGCONT when its peers resolved (4 s at most)\n"
        "  reset, corrupt              prefill[0]'s engine resets its connection or\n"
        "                              flips a payload byte at that point of its bytes\n"
        "                              (KVF_FAULTS syntax; use --checksum with corrupt)\n"
        "  badaddr                     prefill[0]'s engine names a source outside its\n"
        "                              registered memory (shm, ucx: the decode side\n"
        "                              pulls); that room alone must fail\n"
        "  registry-down               kill the registry; restarted on the same port\n"
        "Then every room must be final (SUCCESS, or FAILED with a reason) as\n"
        "above, rooms the fault did not touch must succeed (with --dp, every\n"
        "room of a DP group without the rank it acted on), no room may report\n"
        "SUCCESS with wrong data, and --after-fault-requests fresh rooms must\n"
        "all succeed.  Any --prefill-tp, --decode-tp, --prefill-pp, --decode-pp\n"
        "and --dp: rank 0 of a side is TP rank 0 of stage 0 of DP group 0.\n"
        "A fault run sends rooms in 4 chunks unless --chunk is given, and sets\n"
        "KVF_{BOOTSTRAP,WAITING,TRANSFER}_TIMEOUT_MS=3000 unless they are set.\n"
        "The JSON adds fault, touched_rooms (in flight at the fault), later_rooms\n"
        "(started while it lasted), max_resolve_seconds (from the fault to the\n"
        "last final state of a room in flight; on a stopped rank, from its\n"
        "SIGCONT), after_fault and fault_detail.\n"
        "Every run's JSON has failed_rooms (per room that did not succeed: each\n"
        "rank's state, first final state, wait for the cause, and the rank its\n"
        "records name in common) and max_awaited_ms.\n");
    fprintf(out,
        "\nEngine settings not listed here come from KVF_* environment\n"
        "variables (KVF_LOG=info, KVF_TRANSFER_TIMEOUT_MS, ...), which every\n"
        "rank inherits.\n");
}

int kvt_demo_main(int argc, char **argv)
{
    static kvt_demo_t d;
    memset(&d, 0, sizeof(d));
    kvt_opts_defaults(&d.o, KVT_OPTS_DEMO);
    int prc = kvt_opts_parse(&d.o, KVT_OPTS_DEMO, argc, argv, 2);
    if (prc == 1) {
        kvt_demo_usage(stdout);
        return 0;
    }
    if (prc != 0 || kvt_demo_fault_opts(&d) != 0 ||
        kvt_opts_resolve(&d.o, KVT_OPTS_DEMO) != 0)
        return 2;
    if (d.o.fault) {
        char err[512];
        if (kvt_fault_check(&d.fault, &d.o, err, sizeof(err)) != 0) {
            fprintf(stderr, "kvferry demo: %s\n", err);
            return 2;
        }
    }

    if (kvt_orch_init(&d.orch, "demo", &d.o, d.o.timeout) != 0)
        return 1;
    d.orch.on_event = kvt_demo_on_event;
    d.orch.ctx = &d;
    char **fwd = kvt_opts_argv(&d.o);
    if (!fwd || kvt_report_init(&d.rep, &d.o) != 0 ||
        (d.o.fault && kvt_injector_init(&d.inj, &d.fault, &d.orch, &d.rep,
                                        &d.o) != 0)) {
        fprintf(stderr, "kvferry demo: out of memory\n");
        kvt_orch_fini(&d.orch);
        kvt_opts_argv_free(fwd);
        return 1;
    }
    if (d.o.fault) {
        d.orch.rank_args = kvt_demo_rank_args;
        d.orch.on_finished = kvt_demo_on_finished;
        d.orch.tick_ms = 20;   /* SIGCONT and recovery are timed by ticks */
    }
    d.orch.on_tick = kvt_demo_on_tick;
    kvt_progress_init(&d.prog, "demo", d.o.json);
    d.nrooms = d.o.requests + (d.o.fault ? d.o.after_fault_requests : 0);
    d.dec_final = calloc(d.nrooms, 1);
    d.room_failed = calloc(d.nrooms, 1);
    kvt_orch_run(&d.orch, &d.o, fwd);
    kvt_orch_stop(&d.orch);
    kvt_progress_end(&d.prog);
    free(d.dec_final);
    free(d.room_failed);
    d.dec_final = d.room_failed = NULL;

    kvt_orch_t *o = &d.orch;
    json_t *detail = d.o.fault ? kvt_injector_detail(&d.inj) : NULL;
    kvt_run_info_t info = { o->transport[0] ? o->transport : "unknown",
                            o->registry_auth[0] ? o->registry_auth : "unknown",
                            o->error[0] ? o->error : NULL, o->timed_out,
                            o->signal, d.o.fault, d.inj.injected,
                            d.inj.injected_at, detail,
                            d.inj.resumed ? d.inj.victim : NULL, d.inj.resumed_at, -1 };
    info.victim = !d.o.fault || d.fault.target == KVT_CHILD_REGISTRY ? -1
                : d.fault.target == KVT_CHILD_PREFILL ? 0 : (int)d.rep.nprefill;
    int ok = 0;
    json_t *summary = kvt_report_summary(&d.rep, &o->kids, &info, &ok);
    json_decref(detail);
    if (!summary) {
        fprintf(stderr, "kvferry demo: cannot build the summary (out of memory)\n");
        ok = 0;
    } else if (d.o.json) {
        char *s = json_dumps(summary, JSON_COMPACT);
        if (s) {
            printf("%s\n", s);
            free(s);
        }
    } else {
        kvt_report_print(stdout, summary);
    }
    fflush(stdout);
    json_decref(summary);
    kvt_report_fini(&d.rep);
    if (d.o.fault)
        kvt_injector_fini(&d.inj);
    kvt_orch_fini(o);
    kvt_opts_argv_free(fwd);
    return ok ? 0 : 1;
}
