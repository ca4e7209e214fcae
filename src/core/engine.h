/*
 * The engine, internal: its struct and the calls of engine.c, params.c
 * and listener.c.  The lock and the lanes' wake-ups are in sync.h,
 * layouts in layout.h, peers in peer.h, rooms in room.h, the resolver
 * thread's calls in resolver.h.
 *
 * Ownership and threads
 *   One mutex, the engine lock (sync.h), guards everything below except
 *   room->state, which is atomic so that kvf_*_poll() never takes a lock.
 *   Three kinds of threads take the lock:
 *     - application threads, in the public calls: they change room state
 *       and queue work, then wake the progress thread (eventfd); they never
 *       touch a socket;
 *     - the progress threads, one per lane (kvf_lane_t): lane 0 runs epoll
 *       over the listener, its eventfd, every peer's first stream and the
 *       movers, and the ticks; lane k >= 1 over its eventfd and stream k of
 *       every peer (peer.h, streams).  Each holds the lock while it handles
 *       events (all I/O is non-blocking, so that is bounded) and releases
 *       it in epoll_wait and around payload system calls;
 *     - the resolver thread: blocking registry HTTP calls, with the lock
 *       released; it takes the lock only to post results.
 *
 * Lifetimes
 *   Rooms and peers are reference-counted under the lock.  A room is
 *   referenced by its application handle, by each put in flight and by the
 *   resolver while it works on it; a peer by its stream and by every room
 *   link and stashed request that names it.
 */
#ifndef KVF_CORE_ENGINE_H
#define KVF_CORE_ENGINE_H

#include <pthread.h>
#include <stddef.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <stdatomic.h>
#include <stdint.h>

#include <openssl/types.h>
#include <xxhash.h>

#include "kvferry/kvferry.h"
#include "core/auth.h"
#include "core/descriptor.h"
#include "core/layout.h"
#include "core/metrics.h"
#include "core/planner.h"
#include "core/sync.h"
#include "transport/mover.h"
#include "transport/transport.h"
#include "util/map.h"

/* What epoll's data.ptr points at. */
typedef enum {
    KVF_EV_LISTENER, KVF_EV_WAKE, KVF_EV_PEER, KVF_EV_MOVER, KVF_EV_COPIER
} kvf_ev_kind_t;

/*
 * A lane: a progress thread and its epoll instance.  Lane 0 is the
 * engine's progress thread (its epfd is the engine's);
 * lane k >= 1 owns stream k of every peer: only it calls that stream's
 * connection ops.  Other threads queue work in the stream's outbox and
 * wake the lane (kvf__lane_wake: its eventfd is sync.wakefd[index]).
 */
typedef struct kvf_lane {
    kvf_engine_t  *eng;
    unsigned       index;
    int            epfd;
    kvf_ev_kind_t  ev_wake;          /* KVF_EV_WAKE */
    pthread_t      thread;           /* lanes >= 1 */
    int            started;
    uint64_t       busy_until_ns;    /* polls on until then (params.busy_poll_us) */
} kvf_lane_t;

/* epoll data for a mover's fd: which one. */
typedef struct kvf_mover_ev {
    kvf_ev_kind_t kind;      /* KVF_EV_MOVER; first member */
    int           index;     /* in kvf_movers[] */
} kvf_mover_ev_t;

#define KVF_TOMBS 4096   /* failure records kept for destroyed senders */
#define KVF_RETIRED 16384 /* room instances of destroyed senders remembered */
#define KVF_HANDSHAKE_TIMEOUT_MS 5000   /* handshake_timeout_ms 0 means this */
#define KVF_BUSY_POLL_MAX_US 1000000    /* busy_poll_us: at most a second */


struct kvf_engine {
    kvf_sync_t          sync;             /* first: sync.h finds it (kvf__sync) */
    kvf_engine_params_t params;
    char               *host;
    char               *bootstrap_addr;   /* owned copy, or NULL */
    char               *transport;
    /* The movers this engine has (kvf_movers[i] -> movers[i]), created at
     * layout registration; NULL where not allowed or not usable. */
    kvf_mover_t        *movers[KVF_MAX_MOVERS];
    kvf_mover_ev_t      mover_ev[KVF_MAX_MOVERS];
    unsigned            used_paths;       /* kvf_movers_mask_name() bits seen */
    int                 port;
    char                addr[KVF_ADDR_MAX];
    uint64_t            instance_id;

    int                 epfd, listenfd;   /* lane 0's epoll; its eventfd: sync */
    kvf_ev_kind_t       ev_listener, ev_wake;
    pthread_t           progress_thread;
    int                 stopping;
    uint64_t            now_ms;           /* progress thread's clock, per wake-up */
    unsigned            nlanes;           /* params.streams, resolved */
    kvf_lane_t          lanes[KVF_MAX_STREAMS];
    uint64_t            stream_bytes[KVF_MAX_STREAMS]; /* payload per stream index */

    atomic_int          registered;       /* layout registered (set last) */
    kvf_layout_int_t    layout;
    uint64_t            kv_item_bytes_sum;
    uint64_t            aux_item_bytes_sum;
    void              **reg_bases;        /* every registered buffer: kv, aux, */
    size_t             *reg_lens;         /* state (what peers may read) */
    kvf_mem_kind_t     *reg_kinds;        /* and what memory each is */
    size_t              nregs;

    /* Every room the application holds a handle of, by id, under its own
     * lock: taken alone by a create (the application's thread), or inside
     * the engine lock (room.c: a lane's lookup, a room leaving). */
    pthread_mutex_t     ids_lock;
    kvf_map_t           rooms_by_id;
    /* Receivers' instances (room.c, kvf__room_new_instance): AES-128,
     * under a key drawn at engine start, of how many were drawn, under
     * inst_lock.  NULL cipher: getrandom() per draw. */
    pthread_mutex_t     inst_lock;
    EVP_CIPHER_CTX     *inst_cipher;
    uint64_t            instances_drawn;
    struct kvf_room    *rooms;            /* those lanes took in (listed) */
    /* The record of an abort of the application's, made once its address
     * is bound (its origin does not change): kvf_*_abort and kvf_*_fail
     * copy it rather than format one (room.c). */
    kvf_failure_t       app_abort;
    /* Descriptor sets given to kvf_receiver_create_remote lately
     * (descriptor.c), under remote_lock; remote_next: the one to replace. */
    pthread_mutex_t     remote_lock;
    kvf_remote_seen_t   remote_seen[KVF_REMOTE_SEEN];
    unsigned            remote_next;
    uint64_t            remote_hits;       /* sets found there (tests) */
    /* Rooms the application published work on without the lock, newest
     * first, for the lanes to take in (room.c, kvf__room_submit). */
    _Atomic(struct kvf_room *) submitted;
    /* The side ops of this engine's role (room.h: what a message for a
     * room it does not have, or a DATA frame, goes to). */
    const struct kvf_room_ops *room_ops;
    const struct kvf_peer_events *peer_events;   /* peer.h */
    kvf_map_t           stash;            /* prefill: room id -> kvf_stash_t* */
    struct kvf_stash   *stash_oldest, *stash_newest; /* every entry, in order */
    size_t              stash_count, stash_bytes;    /* bounded (room.h) */
    uint64_t            stash_dropped;    /* entries dropped to stay bounded */
    uint64_t            stash_log_ms, stash_unlogged;
    kvf_map_t           tombs;            /* prefill: room id -> kvf_failure_t* */
    struct kvf_tomb_slot *tomb_ring;      /* burials, oldest at tomb_head */
    size_t              tomb_head, ntombs;
    uint64_t            tomb_seq;         /* burials so far */
    /* Prefill: the room instances (wire.h) that destroyed senders served,
     * the last KVF_RETIRED of them: a late FAIL or request naming one is
     * the old room's, never the next room with the same id. */
    kvf_map_t           retired;          /* instance -> (void *)1 */
    uint64_t           *retired_ring;     /* oldest at retired_head */
    size_t              retired_head, nretired;
    /* Room messages dropped because they came from a peer, or named an
     * instance, the room is not bound to (failure.c, kvf__room_dropped);
     * the log says so at most once per KVF_DROP_LOG_MS. */
    uint64_t            room_msgs_dropped;
    uint64_t            drop_log_ms, drops_unlogged;
    /* Every peer: any thread adds at the head (under the lock); lane 0
     * alone unlinks (kvf__peers_tick), so its walks survive a connection
     * op that lets the lock go (sync.h, the lock rule). */
    struct kvf_peer    *peers;
    uint64_t            peer_generation;  /* bumped when a peer dies or is to
                                             be dialled again (redial_later) */
    struct kvf_reack   *reacks;           /* decode: acknowledgements to say again
                                             on a new connection (acks.c) */
    struct kvf_peer    *peers_free;       /* last reference dropped off the
                                             owner thread: freed by it */

    /* Mover reads (receiver.c): how many are in flight, those the movers
     * handed back and not yet taken in (in order), and a signal for a
     * destroy waiting for a room's reads to end. */
    uint32_t            reads_inflight;
    struct kvf_read    *reads_done, **reads_done_tail;
    pthread_cond_t      reads_cond;
    /* Broadcast whenever a room fails (room.c): kvf_*_await_failure. */
    pthread_cond_t      final_cond;

    /* Staging (stage.h): the copier, when this engine has device memory,
     * the staged puts' copies in flight (a staged receive's are reads),
     * and the pool of pinned bounce buffers. */
    const struct kvf_copier_ops *copier_ops;
    struct kvf_copier  *copier;
    kvf_ev_kind_t       ev_copier;
    uint32_t            copies_inflight;
    struct kvf_bounce  *bounce_free;
    uint32_t            bounce_pooled;

    /* resolver thread */
    pthread_t           resolver_thread;
    pthread_cond_t      resolver_cond;
    struct kvf_room    *rq_head, *rq_tail;
    int                 want_register;
    char               *register_error;
    /* What the registration sends beyond the coordinates, resolved at
     * create (kvf__registration_setup_unlocked); params.kv_cache_dtype and
     * params.load_balance_method point here or are NULL. */
    char                reg_dtype[64];    /* "": the layout's kv_dtype */
    char                reg_lbm[64];
    char                reg_policy[64];   /* "": not registered */

    kvf_bootstrap_t    *bootstrap;        /* in-process registry */
    kvf_faults_t       *faults;           /* injected faults, or NULL */
    kvf_engine_stats_t  stats;

    /* Authentication (auth.c): the cluster token ("" without one), and
     * protected mode's switch. */
    char                token[KVF_TOKEN_MAX + 1];
    int                 has_token;
    atomic_int          warned_no_registry;  /* kvf_sender_create without one: said once */
    int                 auth_open;        /* no token and KVF_AUTH=none */
    uint64_t            auth_refused;     /* connections refused, ever */
    kvf_auth_log_t      auth_log[KVF_AUTH_LOG_SLOTS];
    kvf_auth_log_t      auth_log_rest;    /* addresses beyond the slots */

    /* The listener under descriptor pressure (listener.c): a descriptor
     * kept in reserve, when the listener is back in epoll (0: it is in),
     * connections shed since the last log line and that line's time. */
    int                 reserve_fd;
    uint64_t            listen_paused_until_ms;
    uint64_t            shed_unlogged, shed_log_ms;
    int                 shed_errno;

    /* Observability: the counters of kvf_engine_metrics (metrics.h), its
     * HTTP endpoint and address (none: NULL, ""), and the room trace
     * (trace.h): where its lines go (-1: off) and whether this engine
     * opened that descriptor (then it closes it). */
    kvf_metrics_t       metrics;
    struct kvf_scrape  *scrape;
    char                metrics_addr[KVF_ADDR_MAX];
    int                 trace_fd;
    int                 trace_owned;
};

_Static_assert(offsetof(struct kvf_engine, sync) == 0,
               "sync.h finds an engine's kvf_sync_t at its address");

/* engine.c */
/* Call every mover's progress (reads in flight want their completions). */
void kvf__engine_progress_movers(kvf_engine_t *eng);

/* listener.c (lane 0): open the reserve descriptor (create; listenfd
 * set), accept what the listener has, and the listener's timers. */
void kvf__listener_init_unlocked(kvf_engine_t *eng);
void kvf__listener_accept(kvf_engine_t *eng);
void kvf__listener_tick(kvf_engine_t *eng, uint64_t now);

/* params.c: copy a caller's kvf_engine_params_t, of the caller's `size`,
 * into a full-size struct; fields past that size take their defaults
 * (sized.h).  KVF_OK, or KVF_ERR_INVALID_PARAM with a message naming `fn`
 * and the sizes in err. */
kvf_status_t kvf__engine_params_import(kvf_engine_params_t *dst,
                                       const kvf_engine_params_t *src,
                                       const char *fn, char *err, size_t errlen);
/* params.streams 0: KVF_STREAMS, else what the machine's CPUs allow. */
unsigned     kvf__streams_default(void);

#endif /* KVF_CORE_ENGINE_H */
