/*
 * The demo's room table: what every rank said about every room, merged
 * into the final verdict.
 *
 * One slot per (room, rank): its final state, whether decode verified it,
 * its bytes, times, failure record, and the last phase it reported.  Rank
 * events feed it as they arrive; merging is idempotent (the first final
 * report of a slot wins), so per-room events and the rank's closing result
 * line can both be fed in.  A room is
 *   succeeded   every rank reached SUCCESS and every decode rank verified it,
 *   failed      every rank is final and one FAILED or did not verify,
 *   unresolved  some rank never reported it final (killed, hung, timeout).
 * "Every rank" is every rank that takes part in the room: every decode
 * rank, and the prefill ranks of the room's DP group (room % --dp).
 *
 * Under --fault the table also holds the fresh batch that follows the
 * fault (indices from --requests on), judged apart from the first batch,
 * and marks how the fault met each first-batch room: in flight when it
 * struck (KVT_HIT), or started later while it lasted (KVT_LATER: a dead
 * or stopped peer, no registry).  Either may fail, with a reason; a room
 * the fault did not meet must still succeed.  max_resolve_seconds is
 * taken over the rooms it hit: how fast the engines resolve a fault, not
 * how long later rooms wait for a peer that is gone (their own deadlines
 * bound that, and they must be final like every room).
 * A rank killed by the fault cannot report; the injector records its
 * rooms through kvt_report_rank_gone().
 */
#ifndef KVT_REPORT_H
#define KVT_REPORT_H

#include <jansson.h>
#include <stdint.h>
#include <stdio.h>

#include "opts.h"
#include "proc.h"

typedef struct kvt_slot {
    int8_t   state;      /* -1 not final, else kvf_poll_t */
    int8_t   verified;   /* decode: 1 / 0; prefill: -1 */
    int8_t   phase;      /* last phase reported (kvt_phase_names) */
    uint64_t bytes;
    double   start, end;
    json_t  *failure;
} kvt_slot_t;

typedef struct kvt_report {
    const kvt_opts_t *o;
    uint32_t          nrooms;    /* first batch + fresh batch after a fault */
    uint32_t          nfirst;    /* --requests: the first batch */
    uint32_t          nprefill;  /* prefill rank processes (dp x pp x tp) */
    uint32_t          nranks;    /* prefill and decode rank processes */
    uint8_t          *touched;   /* per room: KVT_UNTOUCHED, KVT_HIT, KVT_LATER */
    uint64_t         *ids;       /* room id per index */
    kvt_slot_t       *slots;     /* [room][prefill ranks, decode ranks] */
    json_t           *ranks;     /* per-rank summary from "result" lines */
} kvt_report_t;

/** Extra facts about the run, for the verdict. */
typedef struct kvt_run_info {
    const char *transport;   /**< as the engine parameters say */
    const char *registry_auth;   /**< how registering was protected */
    const char *error;       /**< setup error, or NULL */
    int         timed_out;
    int         signal;      /**< signal that interrupted the demo, or 0 */
    /* --fault only (fault NULL otherwise) */
    const char *fault;       /**< the spec, "kill-decode@mid" */
    int         fault_injected;
    double      fault_at;    /**< wall clock of the injection */
    json_t     *fault_detail;   /**< borrowed; copied into the summary */
    /* A stopped rank cannot act until continued: its own rooms are timed
     * from its SIGCONT (resumed_at, wall clock), not from the stop. */
    const kvt_child_t *stopped;
    double      resumed_at;
} kvt_run_info_t;

int kvt_report_init(kvt_report_t *r, const kvt_opts_t *o);
void kvt_report_fini(kvt_report_t *r);

/** A "phase" event of room `index` from child c. */
void kvt_report_phase(kvt_report_t *r, const kvt_child_t *c, json_t *ev);

/** A room's final result from child c ("room" event or result entry). */
void kvt_report_room(kvt_report_t *r, const kvt_child_t *c, json_t *room);

enum { KVT_UNTOUCHED = 0, KVT_HIT = 1, KVT_LATER = 2 };

/** At the fault: first-batch rooms some rank has started and that are not
 *  final are KVT_HIT; with `later`, rooms not started yet are KVT_LATER. */
void kvt_report_touch_pending(kvt_report_t *r, int later);

/** Mark room `index` as KVT_HIT (ignored outside the first batch). */
void kvt_report_touch(kvt_report_t *r, uint32_t index);

/** 1 if every rank but c has reported every KVT_HIT room final. */
int kvt_report_hit_final_except(const kvt_report_t *r, const kvt_child_t *c);

/** How many first-batch rooms are marked `how`. */
uint32_t kvt_report_touched(const kvt_report_t *r, int how);

/** 1 if every rank has reported room `index` final. */
int kvt_report_room_final(const kvt_report_t *r, uint32_t index);

/** 1 if rooms [first, first + n) are final on every rank. */
int kvt_report_batch_final(const kvt_report_t *r, uint32_t first, uint32_t n);

/**
 * Rank c is gone (killed by the fault): record every room of [first,
 * first + n) it had not reported as FAILED at time `at`, with `reason`
 * and c itself (control address `addr`) as origin.
 */
void kvt_report_rank_gone(kvt_report_t *r, const kvt_child_t *c,
                          const char *addr, uint32_t first, uint32_t n,
                          const char *reason, double at);

/** A rank's closing "result" line. */
void kvt_report_result(kvt_report_t *r, const kvt_child_t *c, json_t *ev);

/**
 * The verdict as one JSON object (new reference), with every process's
 * exit.  *ok_p is 1 only if every room succeeded and verified and nothing
 * else went wrong; under --fault, if every first-batch room is final, the
 * rooms the fault did not touch succeeded, every failure has a reason,
 * no room reported SUCCESS with wrong data, and the fresh batch succeeded.
 */
json_t *kvt_report_summary(kvt_report_t *r, const kvt_children_t *kids,
                           const kvt_run_info_t *info, int *ok_p);

/** The readable form of a summary. */
void kvt_report_print(FILE *out, json_t *summary);

#endif /* KVT_REPORT_H */
