/*
 * The demo's rules for one room across its ranks (report.c applies them to
 * every room; tests/mp/siblings.py holds the same rules for the tests).
 *
 * A room is one request: a scheduler takes the MIN of its ranks' poll
 * states, so they must agree, and every rank that failed must say why,
 * naming the one root cause.  The rules, on what the ranks reported once
 * the room was released (a killed rank's record is the demo's, not
 * judged by either rule):
 *
 *   one state  every rank reports the same final state; the one exception
 *              (docs/FAILURES.md): a side whose ranks all succeeded keeps
 *              SUCCESS when every failed rank is on the other side and
 *              every failed rank's record names a cause on that other side
 *              (origin_side), and no rank of the succeeding side was
 *              killed: a failure there after this side had every byte (a
 *              lost acknowledgement, a deadline).
 *   one cause  every FAILED record has a reason, none of them "unknown
 *              reason", and all the records of the room name one rank in
 *              common: as their origin, or by its host:port in their
 *              reason; but the record of a rank the fault stopped: it
 *              heard only what its peers had told it before they gave up
 *              on it, and one it had not finished its handshake with told
 *              it nothing (docs/FAILURES.md, Known limits).  A cause a rank saw itself names it as origin; the
 *              ranks that learned it copy it; two ranks that each saw one
 *              peer die (every rank of the other side sees it directly)
 *              name that peer in their reasons; the two ends of a cut
 *              link name each other, and each is the other's origin.  A
 *              rank that reports a cause of its own (its own deadline, an
 *              unknown reason) shares no rank with the others.
 */
#ifndef KVT_VERDICT_H
#define KVT_VERDICT_H

#include <jansson.h>
#include <stddef.h>

/** One rank's report of a room. */
typedef struct kvt_rank_view {
    int         prefill;    /**< side: 1 prefill, 0 decode */
    unsigned    rank;       /**< index within its side */
    int         state;      /**< kvf_poll_t as reported (SUCCESS, FAILED) */
    int         gone;       /**< killed before it reported: not judged for its state */
    int         stopped;    /**< the rank a stop fault acted on: its record is not
                                 judged for the one cause */
    json_t     *failure;    /**< its failure record (borrowed), or NULL */
} kvt_rank_view_t;

/** Does `reason` name `addr` (host:port), as a whole token? */
int kvt_reason_names(const char *reason, const char *addr);

/**
 * The one-state rule over the n ranks of a room.  @return 1 if it holds,
 * 0 with why (one line) otherwise.
 */
int kvt_verdict_one_state(const kvt_rank_view_t *v, size_t n, char *why, size_t len);

/**
 * The one-cause rule: the rank every FAILED record names goes to common
 * (empty when none failed).  @return 1 if it holds, 0 with why otherwise.
 */
int kvt_verdict_one_cause(const kvt_rank_view_t *v, size_t n, char *common,
                          size_t common_len, char *why, size_t len);

#endif /* KVT_VERDICT_H */
