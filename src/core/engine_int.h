/*
 * Engine internals: the engine, its peers and its rooms.
 *
 * Ownership and threads
 *   One mutex, engine->lock, guards everything below except room->state,
 *   which is atomic so that kvf_*_poll() never takes a lock.  Three kinds of
 *   threads take the lock:
 *     - application threads, in the public calls: they change room state
 *       and queue work, then wake the progress thread (eventfd); they never
 *       touch a socket;
 *     - the progress thread: epoll over the listener, the eventfd and every
 *       peer's stream; it holds the lock while it handles events (all I/O is
 *       non-blocking, so that is bounded) and releases it in epoll_wait;
 *     - the resolver thread: blocking registry HTTP calls, with the lock
 *       released; it takes the lock only to post results.
 *
 * Lifetimes
 *   Rooms and peers are reference-counted under the lock.  A room is
 *   referenced by its application handle, by each put in flight and by the
 *   resolver while it works on it; a peer by its stream and by every room
 *   link and stashed request that names it.
 */
#ifndef KVF_CORE_ENGINE_INT_H
#define KVF_CORE_ENGINE_INT_H

#include <pthread.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <stdatomic.h>
#include <stdint.h>

#include <xxhash.h>

#include "kvferry/kvferry.h"
#include "core/parallel.h"
#include "core/planner.h"
#include "transport/mover.h"
#include "transport/transport.h"
#include "util/map.h"

typedef struct kvf_peer kvf_peer_t;
typedef struct kvf_room kvf_room_t;

/* What epoll's data.ptr points at. */
typedef enum {
    KVF_EV_LISTENER, KVF_EV_WAKE, KVF_EV_PEER, KVF_EV_MOVER
} kvf_ev_kind_t;

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
    kvf_mem_kind_t  mem_kind;
    uint32_t        num_layers, first_layer;
    uint32_t        heads_per_rank, total_heads, bytes_per_head;
    uint32_t        num_kv, num_aux, num_state;
    kvf_buffer_t   *kv, *aux, *state;   /* base NULL for a peer's layout */
} kvf_layout_int_t;

typedef enum {
    KVF_PEER_CONNECTING,   /* outbound connect in progress */
    KVF_PEER_HANDSHAKE,    /* waiting for the remote HELLO (decode: and XPORT) */
    KVF_PEER_READY,
    KVF_PEER_DEAD
} kvf_peer_state_t;

struct kvf_peer {
    kvf_ev_kind_t     ev_kind;       /* KVF_EV_PEER; first member */
    kvf_engine_t     *eng;
    int               refs;
    kvf_peer_state_t  state;
    kvf_conn_t       *conn;
    int               outbound;      /* we connected (decode side) */
    char              addr[KVF_ADDR_MAX]; /* remote control address */
    /* From the remote HELLO. */
    kvf_role_t        role;
    int               tp_rank, tp_size, pp_rank, pp_size, dp_rank, dp_size;
    uint64_t          instance_id;
    int               checksum;      /* remote computes checksums */
    kvf_layout_int_t  layout;
    char             *incompatible;  /* set: every room on this pair fails */
    int               hello_done;    /* decode: HELLO seen, XPORT awaited */
    /* Payload path, chosen at the handshake: a mover, or NULL for the
     * control stream itself.  Decode: mep reads the prefill's memory. */
    const kvf_mover_ops_t *mover;
    kvf_mover_ep_t   *mep;
    struct iovec     *ref_iov;       /* DATA_REF scratch: local then remote */
    kvf_rx_target_t  *ref_tgt;       /* DATA_REF scratch: checked targets */
    uint32_t          ref_cap;
    /* Current inbound DATA frame (decode side). */
    kvf_room_t       *rx_room;
    struct kvf_link  *rx_link;
    uint64_t          handshake_until_ms; /* READY by then, or closed */
    uint64_t          last_hb_ms;
    uint64_t          grace_until_ms; /* no liveness verdict before (own stall) */
    uint64_t          hb_seq;
    kvf_peer_t       *next;          /* engine->peers */
};

/*
 * One peer of a room.  On a sender: a decode rank it feeds (destination
 * pages from its ROOM_REQ).  On a receiver: a prefill rank that feeds it.
 */
#define KVF_NO_SLOT UINT32_MAX   /* ROOM_REQ aux_slot: another prefill rank sends aux */
#define KVF_TOMBS   4096         /* failure records kept for destroyed senders */

typedef struct kvf_link {
    kvf_peer_t    *peer;
    uint32_t       rank;          /* the peer's tp rank */
    int            idle;          /* the prefill rank sends nothing to this decode rank */
    kvf_slice_t    slice;         /* sender: what of each page goes to this peer */
    uint32_t      *pages;         /* sender: decode pages (n_pages) */
    uint32_t       n_pages;
    uint32_t       aux_slot;
    uint32_t      *state_slots;   /* sender: decode state slots */
    uint32_t       n_state;
    uint64_t       bytes;         /* sender: queued; receiver: placed */
    uint64_t       expected;      /* receiver: bytes this peer must place */
    int            req_sent;      /* receiver: ROOM_REQ sent */
    int            done;          /* sender: acked; receiver: DONE checked */
    int            confirming;    /* receiver, pull: DONE checked, awaiting confirmation */
    int            last_queued;   /* sender: the last chunk's put is queued */
    int            broken;        /* its connection broke; a reconnect may resume it */
    uint64_t       resume_instance; /* receiver: the peer instance to resume with */
    XXH3_state_t  *hash;          /* checksum of this peer's bytes, or NULL */
} kvf_link_t;

struct kvf_room {
    kvf_engine_t    *eng;
    uint64_t         id;
    kvf_role_t       side;
    _Atomic int      state;       /* kvf_poll_t; written under the lock */
    int              refs;
    int              attached;    /* the application handle is live */
    int              initialized;
    uint64_t         t_state_ms;  /* entered the state, or last progress */
    kvf_failure_t   *failure;     /* first root cause, or NULL */
    int              failure_consumed;
    kvf_room_t      *prev, *next; /* engine->rooms list (attached rooms) */
    uint32_t         nlinks;
    uint32_t         expected_links;
    kvf_link_t      *links;
    uint32_t         aux_slot;      /* sender: source slot; receiver: destination */
    char            *last_err;      /* last resolver or connection error */
    uint32_t         retries;       /* reconnects used */
    uint64_t         retry_at_ms;   /* decode: next reconnect; prefill: resume deadline */
    /* The side's own fields follow: struct kvf_sender, struct kvf_receiver
     * (room.h), each starting with this struct. */
};

/* A destination that arrived before its sender existed. */
typedef struct kvf_stash {
    kvf_peer_t       *peer;
    uint64_t          t_ms;
    kvf_link_t        link;        /* the parsed ROOM_REQ (pages owned) */
    uint32_t          expected;    /* expected_receivers */
    kvf_failure_t    *failure;     /* or a FAIL/ABORT for the room */
    struct kvf_stash *next;
} kvf_stash_t;

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
    int                 epfd, wakefd, listenfd;
    kvf_ev_kind_t       ev_listener, ev_wake;
    pthread_t           progress_thread;
    int                 stopping;
    uint64_t            now_ms;           /* progress thread's clock, per wake-up */

    int                 registered;       /* layout registered */
    kvf_layout_int_t    layout;
    uint64_t            kv_item_bytes_sum;
    uint64_t            aux_item_bytes_sum;
    uint64_t            state_item_bytes_sum;
    void              **reg_bases;        /* every registered buffer: kv, aux, */
    size_t             *reg_lens;         /* state (what peers may read) */
    size_t              nregs;

    kvf_map_t           rooms_by_id;      /* attached rooms */
    kvf_room_t         *rooms;            /* list of the same */
    kvf_map_t           stash;            /* prefill: room id -> kvf_stash_t* */
    kvf_map_t           tombs;            /* prefill: room id -> kvf_failure_t* */
    uint64_t           *tomb_ring;        /* their ids, oldest at tomb_head */
    size_t              tomb_head, ntombs;
    kvf_peer_t         *peers;
    uint64_t            peer_generation;  /* bumped when a peer dies */

    /* resolver thread */
    pthread_t           resolver_thread;
    pthread_cond_t      resolver_cond;
    kvf_room_t         *rq_head, *rq_tail;
    int                 want_register;
    char               *register_error;

    kvf_bootstrap_t    *bootstrap;        /* in-process registry */
    kvf_faults_t       *faults;           /* injected faults, or NULL */
    kvf_engine_stats_t  stats;
};

/* The receiver pulls this peer's payload (DATA_REF) instead of receiving
 * it in the stream. */
static inline int kvf__peer_pulls(const kvf_peer_t *p)
{
    return p->mover != NULL;
}

#define KVF_HANDSHAKE_TIMEOUT_MS 5000   /* handshake_timeout_ms 0 means this */

/* engine.c */
void kvf__engine_wake(kvf_engine_t *eng);
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

/* layout.c: validate the caller's layout (read through kvf__layout_import)
 * into l, which owns copies of the buffer arrays. */
kvf_status_t kvf__layout_copy(kvf_layout_int_t *dst, const kvf_layout_t *src,
                              char *err, size_t errlen);
void         kvf__layout_free(kvf_layout_int_t *l);
/* Same model and settings on both sides (page size, dtype, attention,
 * heads, aux, state)?  KVF_OK, or KVF_ERR_INCOMPATIBLE with an
 * SGLang-style message in err. */
kvf_status_t kvf__layout_check(const kvf_layout_int_t *prefill,
                               const kvf_layout_int_t *decode,
                               char *err, size_t errlen);
/* Can this prefill rank and this decode rank work together (the model
 * check above, TP and PP pairing, page sizes of the buffers it writes)? */
kvf_status_t kvf__pair_check(const kvf_layout_int_t *pl, const kvf_par_t *pp,
                             const kvf_layout_int_t *dl, const kvf_par_t *dp,
                             char *err, size_t errlen);
void kvf__par_fill(kvf_par_t *par, int tp_rank, int tp_size, int pp_rank, int pp_size,
                   const kvf_layout_int_t *l);

/* peer.c */
/* The connection to the prefill rank `tp_rank` at host:port (cached). */
kvf_peer_t  *kvf__peer_get(kvf_engine_t *eng, const char *host, int port, int tp_rank);
void         kvf__peer_put(kvf_peer_t *peer);
void         kvf__peer_accept(kvf_engine_t *eng, int fd);
void         kvf__peer_handle(kvf_peer_t *peer, uint32_t events);
void         kvf__peer_fail(kvf_peer_t *peer, kvf_status_t st, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
void         kvf__peers_tick(kvf_engine_t *eng, uint64_t now);
kvf_status_t kvf__peer_send(kvf_peer_t *peer, const kvf_msg_t *msg);
/* "decode rank 1 (127.0.0.1:4000)" */
const char  *kvf__peer_name(const kvf_peer_t *peer, char *buf, size_t len);

/* room.c */
void kvf__room_put(kvf_room_t *room);
void kvf__room_set_state(kvf_room_t *room, kvf_poll_t state);
/* Fail a room with a root cause seen here (peer: the one it concerns, or
 * NULL).  Tells the room's other peers.  No-op once the room is final. */
void kvf__room_fail(kvf_room_t *room, kvf_status_t st, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* Fail a room with a record received from `from`. */
void kvf__room_fail_remote(kvf_room_t *room, kvf_peer_t *from, int abort,
                           const kvf_msg_fail_t *m);
void kvf__receiver_try_request(kvf_room_t *room);
void kvf__rooms_tick(kvf_engine_t *eng, uint64_t now);
void kvf__room_on_msg(kvf_peer_t *peer, const kvf_msg_t *msg);
void kvf__receiver_on_data(kvf_peer_t *peer, const kvf_msg_data_t *d,
                       kvf_rx_target_t *targets);
void kvf__receiver_on_data_end(kvf_peer_t *peer, uint64_t placed);
/* A DATA_REF frame (shm): check, then pull the bytes from the peer. */
void kvf__receiver_on_data_ref(kvf_peer_t *peer, const kvf_msg_data_t *d);
/* The peer went away: fail every live room linked to it; @return how many. */
int  kvf__rooms_peer_failed(kvf_engine_t *eng, kvf_peer_t *peer,
                            kvf_status_t st, const char *reason);
/* A peer finished its handshake: send the requests waiting for it. */
void kvf__rooms_peer_ready(kvf_engine_t *eng, kvf_peer_t *peer);

/* sender.c: free a chain of stashed destinations */
void kvf__stash_free(kvf_stash_t *s);

/* resolver.c */
kvf_status_t kvf__resolver_start(kvf_engine_t *eng);
void         kvf__resolver_stop(kvf_engine_t *eng);
void         kvf__resolver_enqueue(kvf_engine_t *eng, kvf_room_t *room);

#endif /* KVF_CORE_ENGINE_INT_H */
