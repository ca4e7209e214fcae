/*
 * Engine metrics, internal: the counters and histograms an engine keeps
 * for kvf_engine_metrics() (metrics.c) and its HTTP endpoint.
 *
 * Counting is done where the state already changes, under the engine lock
 * that the change holds anyway: a room turning final, a failure recorded,
 * a segment's bytes added to its link, a peer declared silent.  No new
 * lock, no atomic, nothing per byte: one add per segment (at most 4 MiB),
 * a few per room.  Live figures (rooms by state, peers, reads in flight)
 * are not kept at all: the snapshot walks the engine's lists.
 */
#ifndef KVF_CORE_METRICS_H
#define KVF_CORE_METRICS_H

#include <stdint.h>

#include "kvferry/kvferry.h"
#include "transport/mover.h"

/* Histogram buckets (upper bounds; +Inf is the count). */
#define KVF_HIST_SECONDS_N 16
#define KVF_HIST_BYTES_N   13
#define KVF_HIST_MAX       16

typedef struct kvf_hist {
    uint64_t bucket[KVF_HIST_MAX];   /* observations <= bound i (not cumulative) */
    uint64_t count;
    double   sum;
} kvf_hist_t;

/*
 * Payload paths: how a room's bytes moved, by the public path index
 * (kvf_transport_name: 0 the control stream, tcp, from host memory; then
 * cuda, shm, ucx), and one path that is no transport: staged, the control
 * stream through pinned bounce buffers (device memory), after them.
 */
enum { KVF_PATH_TCP = 0, KVF_PATH_STAGED = KVF_PATHS_MAX };
#define KVF_PATHS (KVF_PATHS_MAX + 1)

/* Failure statuses counted by code: -status below this, the rest as "other"
 * (a peer's record may carry any number). */
#define KVF_MET_STATUS_N 64

enum { KVF_MET_SUCCESS = 0, KVF_MET_FAILED = 1 };
enum { KVF_MET_LOCAL = 0, KVF_MET_REMOTE = 1 };

typedef struct kvf_metrics {
    uint64_t   rooms_final[2];               /* by KVF_MET_SUCCESS/FAILED */
    /* Rooms that succeeded here and then failed: their request failed on
     * another rank (siblings.c).  Counted in both results above. */
    uint64_t   rooms_reversed;
    uint64_t   failures[KVF_MET_STATUS_N + 1][2];  /* [-status or N][origin] */
    kvf_hist_t room_seconds[2];              /* create -> final, by result */
    kvf_hist_t transfer_seconds;             /* pages known -> SUCCESS */
    kvf_hist_t room_bytes;                   /* a succeeded room's payload */
    uint64_t   path_bytes[KVF_PATHS];
    uint64_t   heartbeat_losses;             /* peers that went silent */
    uint64_t   acks_repeated;                /* DONE_ACKs said again (acks.c) */
} kvf_metrics_t;

struct kvf_room;
struct kvf_engine;

/* A path index for payload to or from a peer whose mover is `ops` (NULL:
 * the stream), `staged` when it goes through bounce buffers. */
unsigned kvf__metrics_path(const kvf_mover_ops_t *ops, int staged);

/* Room r just turned final: `failure` NULL for SUCCESS.  `reversed`: it had
 * succeeded before.  Engine lock held. */
void kvf__metrics_room_final(struct kvf_room *r, const kvf_failure_t *failure,
                             int reversed);

/* The metrics endpoint (bootstrap/scrape.c) and what engine.c does with it. */
kvf_status_t kvf__metrics_start_unlocked(struct kvf_engine *eng);
void         kvf__metrics_stop_unlocked(struct kvf_engine *eng);

#endif /* KVF_CORE_METRICS_H */
