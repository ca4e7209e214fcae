/*
 * The engine, internal: its struct, its layout and the calls of engine.c,
 * params.c, layout.c and resolver.c.  Peers are in peer.h, rooms in room.h.
 *
 * Ownership and threads
 *   One mutex, engine->lock, guards everything below except room->state,
 *   which is atomic so that kvf_*_poll() never takes a lock.  Three kinds of
 *   threads take the lock:
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

#include <assert.h>
#include <pthread.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <stdatomic.h>
#include <stdint.h>

#include <xxhash.h>

#include "kvferry/kvferry.h"
#include "core/auth.h"
#include "core/metrics.h"
#include "core/parallel.h"
#include "core/planner.h"
#include "transport/mover.h"
#include "transport/transport.h"
#include "util/map.h"

typedef struct kvf_peer kvf_peer_t;
typedef struct kvf_room kvf_room_t;

/* What epoll's data.ptr points at. */
typedef enum {
    KVF_EV_LISTENER, KVF_EV_WAKE, KVF_EV_PEER, KVF_EV_MOVER, KVF_EV_COPIER
} kvf_ev_kind_t;

#define KVF_MAX_STREAMS KVF_WIRE_MAX_STREAMS   /* streams per peer, lanes per engine */

/*
 * A lane: a progress thread and its epoll instance.  Lane 0 is the
 * engine's progress thread (its epfd and wakefd are the engine's);
 * lane k >= 1 owns stream k of every peer: only it calls that stream's
 * connection ops.  Other threads queue work in the stream's outbox and
 * wake the lane (kvf__lane_wake).
 */
typedef struct kvf_lane {
    kvf_engine_t  *eng;
    unsigned       index;
    int            epfd, wakefd;
    kvf_ev_kind_t  ev_wake;          /* KVF_EV_WAKE */
    pthread_t      thread;           /* lanes >= 1 */
    int            started;
} kvf_lane_t;

/* epoll data for a mover's fd: which one. */
typedef struct kvf_mover_ev {
    kvf_ev_kind_t kind;      /* KVF_EV_MOVER; first member */
    int           index;     /* in kvf_movers[] */
} kvf_mover_ev_t;

/* An engine's (or a peer's) layout, owned copies. */
typedef struct kvf_layout_int {
    uint32_t        page_size;
    char            kv_dtype[64];
    kvf_attn_kind_t attn;
    kvf_mem_kind_t  mem_kind;           /* the KV buffers' (what HELLO carries) */
    kvf_mem_kind_t  aux_mem, state_mem; /* the aux and state buffers' */
    int             cuda_device;
    kvf_kv_order_t  kv_order;           /* how a KV page orders its heads and tokens */
    uint32_t        num_layers, first_layer;
    uint32_t        heads_per_rank, total_heads, bytes_per_head;
    uint32_t        num_kv, num_aux, num_state;
    kvf_buffer_t   *kv, *aux, *state;   /* base NULL for a peer's layout */
    kvf_kv_tag_t   *tags;               /* what kv[i] holds (always set) */
    /* State groups: group g is state[group_first[g] .. group_first[g+1]);
     * a layout of plain state buffers has one group per buffer, type "".
     * Their types, joined by ',' (what HELLO carries). */
    uint32_t        num_groups;
    uint32_t       *group_first;        /* num_groups + 1 entries */
    char           *state_types;
} kvf_layout_int_t;

/* The state group of state buffer b. */
static inline uint32_t kvf__group_of(const kvf_layout_int_t *l, uint32_t b)
{
    uint32_t g = 0;
    while (g + 1 < l->num_groups && l->group_first[g + 1] <= b)
        g++;
    return g;
}

/* MHA: bytes per head per token of KV buffer i (each group's own).  The
 * same in either kv_order: an NHD page is [tokens][heads][bytes], an HND
 * page [heads][tokens][bytes]. */
static inline uint64_t kvf__head_bytes(const kvf_layout_int_t *l, uint32_t i)
{
    return l->kv[i].item_bytes / ((uint64_t)l->page_size * l->heads_per_rank);
}

#define KVF_TOMBS 4096   /* failure records kept for destroyed senders */
#define KVF_RETIRED 16384 /* room instances of destroyed senders remembered */
#define KVF_HANDSHAKE_TIMEOUT_MS 5000   /* handshake_timeout_ms 0 means this */


struct kvf_engine {
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

    pthread_mutex_t     lock;
    atomic_int          lock_wanted;      /* threads waiting in kvf__lock */
    int                 epfd, wakefd, listenfd;
    kvf_ev_kind_t       ev_listener, ev_wake;
    pthread_t           progress_thread;
    int                 stopping;
    uint64_t            now_ms;           /* progress thread's clock, per wake-up */
    unsigned            nlanes;           /* params.streams, resolved */
    kvf_lane_t          lanes[KVF_MAX_STREAMS];
    uint64_t            stream_bytes[KVF_MAX_STREAMS]; /* payload per stream index */

    int                 registered;       /* layout registered */
    kvf_layout_int_t    layout;
    uint64_t            kv_item_bytes_sum;
    uint64_t            aux_item_bytes_sum;
    void              **reg_bases;        /* every registered buffer: kv, aux, */
    size_t             *reg_lens;         /* state (what peers may read) */
    kvf_mem_kind_t     *reg_kinds;        /* and what memory each is */
    size_t              nregs;

    kvf_map_t           rooms_by_id;      /* attached rooms */
    kvf_room_t         *rooms;            /* list of the same */
    /* The side ops of this engine's role (room.h: what a message for a
     * room it does not have, or a DATA frame, goes to). */
    const struct kvf_room_ops *room_ops;
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
     * instance, the room is not bound to (room.c); the log says so at most
     * once per KVF_DROP_LOG_MS. */
    uint64_t            room_msgs_dropped;
    uint64_t            drop_log_ms, drops_unlogged;
    kvf_peer_t         *peers;
    uint64_t            peer_generation;  /* bumped when a peer dies */
    struct kvf_reack   *reacks;           /* decode: acknowledgements to say again
                                             on a new connection (acks.c) */
    kvf_peer_t         *peers_free;       /* last reference dropped off the
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
    kvf_room_t         *rq_head, *rq_tail;
    int                 want_register;
    char               *register_error;
    /* What the registration sends beyond the coordinates, resolved at
     * create (kvf__registration_setup); params.kv_cache_dtype and
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
    int                 warned_no_registry;  /* kvf_sender_create without one: said once */
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

/*
 * The engine lock, with its holder recorded per thread so that functions
 * that expect it held can say so: KVF_ASSERT_LOCKED(eng) at their top
 * (checked in debug builds, the sanitizer ones included; libfabric's
 * genlock idea).  A thread holds at most one engine's lock at a time.
 */
extern _Thread_local const kvf_engine_t *kvf__lock_held;

/*
 * The threads that own an engine's connections: its lanes (kvf__io_lane
 * says which), and the thread tearing it down once they are gone (every
 * lane, KVF_LANE_ALL).  Only a connection's lane calls its ops (they let
 * the lock go around their system calls); other threads queue what they
 * send (kvf__peer_send, kvf__peer_put_data).  kvf__owns_io: lane 0, which
 * also owns the listener, the movers, the ticks and freeing peers.
 */
#define KVF_LANE_ALL (~0u)
extern _Thread_local const kvf_engine_t *kvf__io_owner;
extern _Thread_local unsigned kvf__io_lane;

static inline int kvf__owns_lane(const kvf_engine_t *eng, unsigned lane)
{
    return kvf__io_owner == eng && (kvf__io_lane == lane || kvf__io_lane == KVF_LANE_ALL);
}

static inline int kvf__owns_io(const kvf_engine_t *eng)
{
    return kvf__owns_lane(eng, 0);
}

/*
 * Every thread but the progress thread takes the lock through this: it
 * counts itself in `lock_wanted` while it waits, and the progress thread,
 * which would otherwise take the lock back the moment it let go (a mutex
 * is not fair), lets such waiters go first between its passes.
 */
static inline void kvf__lock(kvf_engine_t *eng)
{
    /* Relaxed: a hint for the progress thread; the mutex orders the rest. */
    atomic_fetch_add_explicit(&eng->lock_wanted, 1, memory_order_relaxed);
    pthread_mutex_lock(&eng->lock);
    atomic_fetch_sub_explicit(&eng->lock_wanted, 1, memory_order_relaxed);
    kvf__lock_held = eng;
}

static inline void kvf__unlock(kvf_engine_t *eng)
{
    kvf__lock_held = NULL;
    pthread_mutex_unlock(&eng->lock);
}

/* pthread_cond_timedwait on the engine lock, keeping the record true. */
static inline int kvf__cond_timedwait(kvf_engine_t *eng, pthread_cond_t *cond,
                                      const struct timespec *until)
{
    kvf__lock_held = NULL;
    int rc = pthread_cond_timedwait(cond, &eng->lock, until);
    kvf__lock_held = eng;
    return rc;
}

#define KVF_ASSERT_LOCKED(eng) assert(kvf__lock_held == (eng))

/* engine.c */
void kvf__engine_wake(kvf_engine_t *eng);      /* lane 0 */
/* "decode rank 1", with its stage and DP group where the server has more
 * than one: how a failure reason names this engine.  @return buf. */
const char *kvf__engine_rank_name(const kvf_engine_t *eng, char *buf, size_t len);
/* The same for any rank of a server of pp_size stages and dp_size groups. */
const char *kvf__rank_name(kvf_role_t role, int tp_rank, int pp_rank, int pp_size,
                           int dp_rank, int dp_size, char *buf, size_t len);
void kvf__lane_wake(kvf_engine_t *eng, unsigned lane);
/* What a connection calls around its system calls (kvf_conn_env_t). */
void kvf__engine_io_unlock(void *eng);
void kvf__engine_io_lock(void *eng);
/* Call every mover's progress (reads in flight want their completions). */
void kvf__engine_progress_movers(kvf_engine_t *eng);

/* listener.c (lane 0): open the reserve descriptor (create; listenfd
 * set), accept what the listener has, and the listener's timers. */
void kvf__listener_init(kvf_engine_t *eng);
void kvf__listener_accept(kvf_engine_t *eng);
void kvf__listener_tick(kvf_engine_t *eng, uint64_t now);
/* May this engine use `ops` (its `transport` setting)? */
int  kvf__engine_allows(const kvf_engine_t *eng, const kvf_mover_ops_t *ops);

/* params.c: copy a caller's kvf_engine_params_t / kvf_layout_t, of the
 * caller's `size`, into a full-size struct; fields past that size take
 * their defaults.  KVF_OK, or KVF_ERR_INVALID_PARAM with a message naming
 * `fn` and the sizes in err (the growth rules of kvferry.h). */
kvf_status_t kvf__engine_params_import(kvf_engine_params_t *dst,
                                       const kvf_engine_params_t *src,
                                       const char *fn, char *err, size_t errlen);
kvf_status_t kvf__layout_import(kvf_layout_t *dst, const kvf_layout_t *src,
                                const char *fn, char *err, size_t errlen);
kvf_status_t kvf__dest_import(kvf_dest_t *dst, const kvf_dest_t *src, const char *fn,
                              char *err, size_t errlen);
kvf_status_t kvf__hold_import(kvf_hold_t *dst, const kvf_hold_t *src, const char *fn,
                              char *err, size_t errlen);
kvf_status_t kvf__remote_import(kvf_remote_t *dst, const kvf_remote_t *src, const char *fn,
                                char *err, size_t errlen);
/* params.streams 0: KVF_STREAMS, else what the machine's CPUs allow. */
unsigned     kvf__streams_default(void);
/* A held room's lease when kvf_hold_t leaves it 0: KVF_LEASE_MS, else
 * 480000. */
unsigned     kvf__lease_default(void);

/* layout.c: validate the caller's layout (read through kvf__layout_import)
 * into l, which owns copies of the buffer arrays. */
kvf_status_t kvf__layout_copy(kvf_layout_int_t *dst, const kvf_layout_t *src,
                              int may_omit_heads, char *err, size_t errlen);
void         kvf__layout_free(kvf_layout_int_t *l);
/* Write state group g's type into buf ("" for a plain state buffer). */
void         kvf__group_type(const kvf_layout_int_t *l, uint32_t g, char *buf, size_t len);
/* Buffer families, in the order of registration (reg_bases). */
enum { KVF_FAMILY_KV = 0, KVF_FAMILY_AUX = 1, KVF_FAMILY_STATE = 2 };
const char    *kvf__family_name(int family);          /* "KV", "aux", "state" */
kvf_mem_kind_t kvf__family_mem(const kvf_layout_int_t *l, int family);
/* Is any family device memory? */
int            kvf__layout_on_device(const kvf_layout_int_t *l);
/* Every buffer is the memory its family declares (the CUDA driver says);
 * why not in err.  @return KVF_OK, KVF_ERR_INVALID_PARAM (a mismatch),
 * KVF_ERR_UNSUPPORTED (CUDA memory declared and no driver). */
kvf_status_t   kvf__layout_check_memory(const kvf_layout_int_t *l, char *err, size_t errlen);
/* A decode layout that left its heads 0 takes them from a prefill peer's
 * (same model): heads_per_rank from its own TP size.  KVF_OK (also when
 * it has them), or KVF_ERR_INCOMPATIBLE when its buffers do not hold that
 * many heads. */
kvf_status_t kvf__layout_adopt_heads(kvf_layout_int_t *l, int tp_size,
                                     const kvf_layout_int_t *from, char *err,
                                     size_t errlen);
/* Which decode KV buffer each prefill KV buffer goes to, by tag:
 * dst_of[i] for prefill buffer i.  KVF_ERR_INCOMPATIBLE when one has no
 * match. */
kvf_status_t kvf__kv_map(const kvf_layout_int_t *pl, const kvf_layout_int_t *dl,
                         uint32_t *dst_of, char *err, size_t errlen);
/* Same model and settings on both sides (page size, dtype, attention,
 * heads, KV page order, aux, state)?  KVF_OK, or KVF_ERR_INCOMPATIBLE with an
 * SGLang-style message in err. */
kvf_status_t kvf__layout_check(const kvf_layout_int_t *prefill,
                               const kvf_layout_int_t *decode,
                               char *err, size_t errlen);
/* Can this prefill rank and this decode rank work together (the model
 * check above, TP and PP pairing, page sizes of the buffers it writes)?
 * Fills dst_of (pl->num_kv entries) as kvf__kv_map does. */
kvf_status_t kvf__pair_check(const kvf_layout_int_t *pl, const kvf_par_t *pp,
                             const kvf_layout_int_t *dl, const kvf_par_t *dp,
                             uint32_t *dst_of, char *err, size_t errlen);
void kvf__par_fill(kvf_par_t *par, int tp_rank, int tp_size, int pp_rank, int pp_size,
                   const kvf_layout_int_t *l);

/* resolver.c */
/* Check the registration parameters of p (a full-size copy).
 * @return KVF_OK or KVF_ERR_INVALID_PARAM, logged. */
kvf_status_t kvf__registration_check(const kvf_engine_params_t *p);
/* Give eng->params' registration fields their defaults (KVF_* variables)
 * and copy its strings into eng. */
void         kvf__registration_setup(kvf_engine_t *eng);
kvf_status_t kvf__resolver_start(kvf_engine_t *eng);
void         kvf__resolver_stop(kvf_engine_t *eng);
void         kvf__resolver_enqueue(kvf_engine_t *eng, kvf_room_t *room);

#endif /* KVF_CORE_ENGINE_H */
