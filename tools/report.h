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
    uint32_t          nrooms;
    uint32_t          nranks;    /* prefill_tp + decode_tp */
    uint64_t         *ids;       /* room id per index */
    kvt_slot_t       *slots;     /* [room][prefill ranks, decode ranks] */
    json_t           *ranks;     /* per-rank summary from "result" lines */
} kvt_report_t;

/** Extra facts about the run, for the verdict. */
typedef struct kvt_run_info {
    const char *transport;   /**< as the engine parameters say */
    const char *error;       /**< setup error, or NULL */
    int         timed_out;
    int         signal;      /**< signal that interrupted the demo, or 0 */
} kvt_run_info_t;

int kvt_report_init(kvt_report_t *r, const kvt_opts_t *o);
void kvt_report_fini(kvt_report_t *r);

/** A "phase" event of room `index` from child c. */
void kvt_report_phase(kvt_report_t *r, const kvt_child_t *c, json_t *ev);

/** A room's final result from child c ("room" event or result entry). */
void kvt_report_room(kvt_report_t *r, const kvt_child_t *c, json_t *room);

/** A rank's closing "result" line. */
void kvt_report_result(kvt_report_t *r, const kvt_child_t *c, json_t *ev);

/**
 * The verdict as one JSON object (new reference), with every process's
 * exit.  *ok_p is 1 only if every room succeeded and verified and nothing
 * else went wrong.
 */
json_t *kvt_report_summary(kvt_report_t *r, const kvt_children_t *kids,
                           const kvt_run_info_t *info, int *ok_p);

/** The readable form of a summary. */
void kvt_report_print(FILE *out, json_t *summary);

#endif /* KVT_REPORT_H */
