/*
 * `kvferry demo --fault KIND@WHEN`: the fault injector of the demo.
 *
 * It lives beside the orchestrator (orch.c) and sees every rank event the
 * demo sees.  When the first room reaches WHEN on the trigger rank it acts
 * on the process table: SIGKILL or SIGSTOP a rank, kill the registry, or,
 * for engine-level faults (reset, corrupt, badaddr), nothing at all: those were
 * armed at start-up in prefill rank 0's engine (its `faults` parameter)
 * and fire inside the library when its byte count reaches the WHEN point.
 *
 * Then it brings the deployment back: a stopped rank gets SIGCONT once
 * the others have resolved the rooms it hit (or after
 * KVT_FAULT_STOP_HOLD_MS),
 * a killed rank's unreported rooms are recorded as failed by the kill, and
 * once every room of the first batch is final, a killed process is
 * restarted (the registry on the same port) and every rank serves
 * --after-fault-requests fresh rooms, which must all succeed.
 *
 * Timing: a phase is only meaningful if the rank is caught right there,
 * so the trigger rank of a process fault is started with `--hold
 * PHASE[:INDEX]`: it stops its room loop after emitting that phase until
 * the injector writes "resume" (its engine keeps running).  Mid and last
 * fire on the first room to get there.  Bootstrap fires on the last room
 * of the trigger rank's first window (--concurrency of the rooms it runs:
 * a prefill rank runs its DP group's), while the first is still
 * bootstrapping: a stop that landed between two room creations would
 * leave the rest of the window to be created after SIGCONT, for peers
 * that failed those rooms long before.
 */
#ifndef KVT_FAULT_H
#define KVT_FAULT_H

#include <jansson.h>
#include <stdint.h>

#include "opts.h"
#include "orch.h"
#include "proc.h"
#include "report.h"

/* A stopped rank gets SIGCONT when every other rank has resolved the
 * rooms the stop hit, or this long after the stop: well past the engine's
 * default heartbeat timeout (2.5 s), by which its peers must have seen it. */
#define KVT_FAULT_STOP_HOLD_MS 4000

/* How long recovery may take before the run gives up on it: a restarted
 * rank must say "ready", a restarted registry must list prefill again
 * (prefill ranks re-register every 5 s). */
#define KVT_FAULT_RECOVER_MS 20000

typedef enum kvt_fault_kind {
    KVT_FAULT_NONE = 0,
    KVT_FAULT_KILL_PREFILL,
    KVT_FAULT_KILL_DECODE,
    KVT_FAULT_STOP_PREFILL,
    KVT_FAULT_STOP_DECODE,
    KVT_FAULT_RESET,
    KVT_FAULT_CORRUPT,
    KVT_FAULT_BADADDR,
    KVT_FAULT_REGISTRY_DOWN
} kvt_fault_kind_t;

typedef enum kvt_fault_when {
    KVT_WHEN_BOOTSTRAP = 0,
    KVT_WHEN_MID,
    KVT_WHEN_LAST
} kvt_fault_when_t;

typedef enum kvt_fault_stage {
    KVT_FSTAGE_FIRST = 0,   /* first batch running; fault pending or done */
    KVT_FSTAGE_RECOVER,     /* restarting what the fault took down */
    KVT_FSTAGE_AFTER,       /* the fresh batch is running */
    KVT_FSTAGE_DONE
} kvt_fault_stage_t;

/** A parsed --fault spec and what it means for the run. */
typedef struct kvt_fault {
    kvt_fault_kind_t  kind;
    kvt_fault_when_t  when;
    char              spec[48];       /**< as given: "kill-prefill@mid" */
    kvt_child_role_t  target;         /**< process acted on (prefill for engine faults) */
    kvt_child_role_t  trigger;        /**< whose phase event fires it */
    const char       *phase;          /**< "bootstrap", "mid" or "last" */
    int               index;          /**< trigger room; -1: the first to get there */
    int               hold;           /**< trigger rank holds at the phase */
    int               engine;         /**< fires inside prefill[0]'s engine */
} kvt_fault_t;

/** The injector's state for one run. */
typedef struct kvt_injector {
    kvt_fault_t        f;
    kvt_orch_t        *orch;
    kvt_report_t      *rep;
    const kvt_opts_t  *o;
    char               engine_spec[64];  /**< `faults` of prefill[0], or "" */
    char               hold_arg[32];
    char               faults_arg[96];
    char              *extra[3];         /**< extra argv of the trigger rank */
    kvt_fault_stage_t  stage;
    int                injected;
    double             injected_at;      /**< wall clock, as ranks report */
    uint64_t           injected_ms;      /**< monotonic */
    int                room;             /**< index of the room that hit WHEN */
    int                window_open;      /**< engine faults: still marking touched rooms */
    kvt_child_t       *victim;           /**< the process acted on, if any */
    char               target_addr[64];  /**< its control address ("ready") */
    int                resumed;          /**< SIGCONT sent */
    double             resumed_at;       /**< wall clock of the SIGCONT */
    int                gone_marked;      /**< a killed rank's rooms recorded */
    kvt_child_t       *restarted;        /**< its replacement */
    char               restarted_addr[64];
    uint64_t           recover_at_ms;    /**< when recovery began */
    uint64_t           asked_at_ms;      /**< last registry query */
    int                batch_sent;
    json_t            *log;              /**< actions, with times */
} kvt_injector_t;

/**
 * Parse "KIND@WHEN".  @return 0, or -1 with a message in err that lists
 * the valid kinds and phases.
 */
int kvt_fault_parse(const char *spec, kvt_fault_t *f, char *err, size_t len);

/** Check the spec against the run's options (mid needs 2+ chunks...). */
int kvt_fault_check(const kvt_fault_t *f, const kvt_opts_t *o, char *err,
                    size_t len);

/**
 * The engine fault spec for prefill rank 0 (KVF_FAULTS syntax): reset or
 * corrupt at 0 (bootstrap), half a room's bytes on that rank (mid), or a
 * room's bytes less one page (last).  Empty for process faults.
 */
void kvt_fault_engine_spec(const kvt_fault_t *f, const kvt_opts_t *o,
                           char *buf, size_t len);

int kvt_injector_init(kvt_injector_t *inj, const kvt_fault_t *f,
                      kvt_orch_t *orch, kvt_report_t *rep,
                      const kvt_opts_t *o);
void kvt_injector_fini(kvt_injector_t *inj);

/** Extra argv for a rank at its first start (NULL-terminated), or NULL. */
char *const *kvt_injector_rank_args(kvt_injector_t *inj,
                                    kvt_child_role_t role, uint32_t rank);

/** Every rank event, after the report has taken it in. */
void kvt_injector_on_event(kvt_injector_t *inj, kvt_child_t *c,
                           const char *type, json_t *ev);

/** Periodic work: SIGCONT, recording a killed rank's rooms. */
void kvt_injector_tick(kvt_injector_t *inj);

/**
 * Every rank has finished its batch (or is gone).  Drives recovery and the
 * fresh batch.  @return 1 while there is more to do (the orchestrator must
 * not release the ranks yet), 0 when the run may end.
 */
int kvt_injector_on_finished(kvt_injector_t *inj);

/** The "fault_detail" object of the summary (new reference). */
json_t *kvt_injector_detail(const kvt_injector_t *inj);

#endif /* KVT_FAULT_H */
