/*
 * The demo's room table: what every rank said about every room, merged
 * into the final verdict.
 *
 * One slot per (room, rank): the state the room first reached there (its
 * "final" event), the state and failure record it reported once released,
 * whether decode verified it, its bytes, times, and the last phase it
 * reported.  Rank events feed it as they arrive; merging is idempotent
 * (the first report of a slot wins), so per-room events and the rank's
 * closing result line can both be fed in.
 *
 * The table is also the demo's all-reduce: once every rank of a room, on
 * both sides, is final (a killed rank counts, once recorded as gone), the
 * orchestrator releases the room on each of them with the MIN of all
 * their states (kvt_report_releasable, kvt_report_outcome).  That is one
 * scheduler over both servers, stricter than SGLang's (each server
 * reduces over its own ranks): a failed request fails on both sides, and
 * a side that had every byte when the other failed takes that failure too
 * (its wait for the cause, kvf_*_await_failure, says its side failed),
 * where SGLang's would keep its success.  A room is
 *   succeeded   every rank reported SUCCESS and every decode rank verified it,
 *   failed      every rank reported it and one FAILED or did not verify,
 *   unresolved  some rank never reported it (killed, hung, timeout).
 * "Every rank" is every rank that takes part in the room: every decode
 * rank, and the prefill ranks of the room's DP group (room % --dp).
 *
 * The verdict on each room (kvt_report_summary) holds for every run:
 *   one state   every rank that reported it (a killed rank's record is
 *               the injector's, not judged here) reports the same state,
 *               except that a side may keep SUCCESS when every failed rank
 *               is on the other side and names a cause there (a failure
 *               after this side had every byte: docs/FAILURES.md);
 *   one cause   every FAILED record has a reason, none "unknown reason",
 *               and all of a room's records (a killed or stopped rank's
 *               aside: verdict.h) name one rank in common: as
 *               their origin or in their reason (the dead, stopped or cut
 *               peer, by its address), so that two ranks that saw one
 *               peer die, or the two ends of a cut link, agree;
 *   reach       a room without the rank a fault acted on (another
 *               prefill DP group's) succeeds, whenever it ran.
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
    int8_t   first;      /* -1 not final there yet, else kvf_poll_t ("final") */
    int8_t   state;      /* -1 not reported, else kvf_poll_t ("room", released) */
    int8_t   verified;   /* decode: 1 / 0; prefill: -1 */
    int8_t   phase;      /* last phase reported (kvt_phase_names) */
    int8_t   gone;       /* killed before it reported: the injector's record */
    uint64_t bytes;
    double   start, end;
    double   awaited_ms; /* how long it waited for the cause once released */
    json_t  *failure;
} kvt_slot_t;

typedef struct kvt_report {
    const kvt_opts_t *o;
    uint32_t          nrooms;    /* first batch + fresh batch after a fault */
    uint32_t          nfirst;    /* --requests: the first batch */
    uint32_t          nprefill;  /* prefill rank processes (dp x pp x tp) */
    uint32_t          nranks;    /* prefill and decode rank processes */
    uint8_t          *touched;   /* per room: KVT_UNTOUCHED, KVT_HIT, KVT_LATER */
    uint8_t          *released;  /* per room: its outcome went to its ranks */
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
    int         victim;      /**< the rank the fault acted on: prefill index,
                                  or nprefill + decode index; -1 none */
} kvt_run_info_t;

int kvt_report_init(kvt_report_t *r, const kvt_opts_t *o);
void kvt_report_fini(kvt_report_t *r);

/** A "phase" event of room `index` from child c. */
void kvt_report_phase(kvt_report_t *r, const kvt_child_t *c, json_t *ev);

/** A room's report from child c once released ("room" event or result entry). */
void kvt_report_room(kvt_report_t *r, const kvt_child_t *c, json_t *room);

/** A room became final on child c ("final" event). */
void kvt_report_final(kvt_report_t *r, const kvt_child_t *c, json_t *ev);

/**
 * Is room `index` final on every rank that takes part in it, and not yet
 * released?  If so it is marked released: @return 1 once per room.
 */
int kvt_report_releasable(kvt_report_t *r, uint32_t index);

/**
 * The MIN of the states room `index` reached on its ranks, both sides; a
 * killed rank counts as FAILED.
 */
int kvt_report_outcome(const kvt_report_t *r, uint32_t index);

/** Does child c's rank take part in room `index`? */
int kvt_report_involves(const kvt_report_t *r, uint32_t index, const kvt_child_t *c);

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

/** 1 if room `index` is final on every rank ("final" events). */
int kvt_report_room_final(const kvt_report_t *r, uint32_t index);

/** 1 if rooms [first, first + n) are final on every rank. */
int kvt_report_batch_final(const kvt_report_t *r, uint32_t first, uint32_t n);

/**
 * Rank c is gone (killed by the fault): record every room of [first,
 * first + n) it takes part in and had not reported as FAILED at time
 * `at`, with `reason` and c itself (control address `addr`) as origin.
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
