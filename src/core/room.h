/*
 * Rooms, internal: what room.c (lifecycle, failures, deadlines, message
 * dispatch), failure.c (failure records), sender.c (prefill side) and
 * receiver.c (decode side) share, and the table of side ops through which
 * room.c, peer.c and the resolver reach a side (kvf_room_ops_t).
 * Everything here runs under the engine lock unless it says otherwise.
 *
 * Events flow one way: transport -> peer -> room.  A peer that fails
 * tells its rooms (kvf__rooms_peer_failed), and they do not call back
 * into it.  A room that finds its peer broken (a message of a type it
 * never takes, no memory for what the peer sent, a mover endpoint gone)
 * does not fail the peer either: failing a peer fails every room on it,
 * which would re-enter room code with this room's call still on the
 * stack.  It returns a verdict (core/verdict.h, kvf_verdict_t) from the
 * entry point the peer called, and the peer acts on it once that call has
 * returned (kvf__peer_heed).  So no file of a room's (room.c, failure.c,
 * sender.c, receiver.c, stash.c, siblings.c, acks.c) calls kvf__peer_fail.
 */
#ifndef KVF_CORE_ROOM_H
#define KVF_CORE_ROOM_H

#include <stdarg.h>

#include "core/peer.h"
#include "core/sync.h"

typedef struct kvf_room kvf_room_t;

/* This engine's rank as a failure reason names it (kvf__rank_name): from
 * its parameters, which do not change once it runs. */
static inline const char *kvf__engine_rank_name_unlocked(const kvf_engine_t *eng,
                                                         char *buf, size_t len)
{
    const kvf_engine_params_t *p = &eng->params;
    return kvf__rank_name(p->role, p->tp_rank, p->pp_rank, p->pp_size, p->dp_rank,
                          p->dp_size, buf, len);
}

/*
 * One peer of a room.  On a sender: a decode rank it feeds (destination
 * pages from its ROOM_REQ).  On a receiver: a prefill rank that feeds it.
 */
#define KVF_NO_SLOT UINT32_MAX   /* ROOM_REQ aux_slot: another prefill rank sends aux */

/*
 * A room's state indices on one side: count[g] indices for state group g,
 * every group's in group order in idx.  ngroups 0: the room moves no state.
 */
typedef struct kvf_states {
    uint32_t  ngroups;
    uint32_t *count;
    uint32_t *idx;
    uint32_t  total;       /* sum of count */
} kvf_states_t;

/* A link's fields that only a sender's link uses: the destination a
 * decode rank's ROOM_REQ gave (also what the stash keeps of one). */
typedef struct kvf_link_tx {
    uint64_t       instance;      /* the receiver's room instance, from its
                                     ROOM_REQ: what the link is bound to */
    uint32_t      *pages;         /* decode pages (n_pages) */
    uint32_t       n_pages;
    uint32_t       prefix;        /* the decode's prefix (tokens) */
    kvf_states_t   state;         /* decode state indices (this link's: none
                                     unless it carries the room's state) */
    int            last_queued;   /* the last chunk's put is queued */
} kvf_link_tx_t;

/* A link's fields that only a receiver's link uses. */
typedef struct kvf_link_rx {
    int            sends_state;   /* this peer sends the room's state */
    uint64_t       expected;      /* bytes this peer must place */
    int            req_sent;      /* ROOM_REQ sent */
    int            confirming;    /* pull: DONE checked, awaiting confirmation */
    uint64_t       resume_instance; /* the peer instance to resume with */
    /* Exact coverage, one bit per destination unit this peer writes, set
     * when a segment naming it is accepted: per (KV buffer, page index,
     * token) of the room, then per aux buffer, then per state buffer
     * (receiver.c, cover_mark).  A unit named twice fails the room. */
    uint8_t       *cover;
    uint32_t       reads;         /* pull: mover reads in flight */
    /* Pull: a DONE that came while reads were in flight, checked once
     * they end. */
    int            done_waiting;
    int            done_has_checksum;
    uint64_t       done_bytes, done_checksum;
} kvf_link_rx_t;

typedef struct kvf_link {
    kvf_peer_t    *peer;
    uint32_t       rank;          /* the peer's tp rank */
    int            idle;          /* the prefill rank sends nothing to this decode rank */
    kvf_slice_t    slice;         /* what of each page goes to (sender) or comes
                                     from (receiver) this peer */
    uint32_t       aux_slot;
    uint64_t       bytes;         /* sender: queued; receiver: placed */
    int            fail_told;     /* the peer has the room's FAIL (sent, or it
                                     sent it); a receiver's failure before it
                                     linked tells those without it */
    int            done;          /* sender: acked; receiver: DONE checked */
    int            broken;        /* its connection broke; a reconnect may resume it */
    /* Receiver: the prefill engine instance its descriptor names
     * (kvf_receiver_create_remote), 0 without one.  Sender: the held
     * room's instance the reader named (ROOM_REQ sender_instance). */
    uint64_t       want_instance;
    /* Per stream of the peer (peer.c, "Streams"; one without): the bytes queued
     * (sender) or placed (receiver) on it, their checksum in that
     * stream's order (or NULL), and, receiver, the streams whose DONE
     * checked (a bit each); lk->bytes is their sum. */
    uint32_t       nstreams;
    uint32_t       ends;
    uint64_t       stream_bytes[KVF_MAX_STREAMS];
    XXH3_state_t  *hash[KVF_MAX_STREAMS];
    kvf_link_tx_t  tx;            /* a sender's link */
    kvf_link_rx_t  rx;            /* a receiver's link */
} kvf_link_t;

/* A prefill rank a receiver reads from, or watches (siblings.c). */
#define KVF_MAX_TARGETS 64
typedef struct kvf_target {
    char     host[64];
    int      port;
    int      rank;              /* its tp rank */
    uint64_t instance;          /* the engine instance it must be, or 0 */
} kvf_target_t;

/* What the resolver thread found for a receiver (resolver.c), handed to
 * the room's `resolved` op under the lock. */
typedef struct kvf_lookup {
    enum { KVF_LOOKUP_OK, KVF_LOOKUP_RETRY, KVF_LOOKUP_FATAL } res;
    kvf_status_t status;                 /* KVF_LOOKUP_FATAL */
    char         err[KVF_REASON_MAX - 64];
    int          ntargets;               /* the prefill ranks it reads from */
    kvf_target_t t[KVF_MAX_TARGETS];
    int          nwatch;                 /* the DP group's other ranks (siblings.c) */
    kvf_target_t w[KVF_MAX_TARGETS];
} kvf_lookup_t;

/*
 * A sibling link (siblings.c): on a receiver, a prefill rank of the room's
 * DP group that this decode rank reads nothing from; on a sender, a decode
 * rank that told it about the room all the same (a watch).  It moves no
 * byte: it carries the room's FAIL and ABORT, both ways.
 */
typedef struct kvf_watch {
    kvf_peer_t *peer;         /* NULL while a reset one waits to reconnect */
    uint32_t    rank;         /* the peer's tp rank */
    uint64_t    instance;     /* sender: the receiver's room instance */
    int         sent;         /* receiver: the watch went out */
    /* Receiver: where to dial it again after a reset, the reconnects
     * used, and when the next one is due (0: none due). */
    char        host[64];
    int         port;
    uint32_t    retries;
    uint64_t    retry_at_ms;
} kvf_watch_t;

/*
 * What differs between a room's two sides, one table per side: sender.c
 * fills kvf_sender_room_ops, receiver.c kvf_receiver_room_ops.  room.c
 * holds what the sides share and calls through the table; it never asks
 * which side a room is.  Each room points at its side's table (r->ops,
 * from kvf__room_create), and so does each engine (eng->room_ops, from its
 * role at create: every room of an engine is of the engine's side).  The
 * engine's table serves what does not belong to one room: a message may
 * name a room this engine does not have, or no longer has (a destination
 * before its sender, an answer after it), and a DATA frame's room is found
 * by the receiver from the frame itself.  An op marked "decode" is NULL in
 * the sender's table, and is called only for a prefill peer (so only on a
 * decode engine); an op that says "NULL:" may be NULL.  Every op runs under
 * the engine lock.
 */
typedef struct kvf_room_ops {
    kvf_role_t side;
    size_t     size;               /* the side's room (kvf_sender_t, kvf_receiver_t) */

    /* The engine's (eng->room_ops), called by room.c and peer.c.  Each
     * entry point a peer calls returns its verdict on the peer (KVF_OK:
     * it goes on), which the peer acts on once the call has returned. */
    /* A room message from p (ROOM_REQ, DONE, DONE_ACK, FAIL, ABORT); r the
     * live room its id names, or NULL.  A type this side never takes is
     * a protocol error (kvf__room_unexpected). */
    kvf_verdict_t (*on_msg)(kvf_peer_t *p, kvf_room_t *r, const kvf_msg_t *msg);
    /* Decode: a DATA frame's header: find its room, check every segment,
     * and point the pieces at their destination (t) or at nothing. */
    kvf_verdict_t (*on_data)(kvf_peer_t *p, const kvf_msg_data_t *d, kvf_rx_target_t *t);
    /* Decode: the frame on_data pointed at a room (p->rx_room) is in,
     * `placed` of its bytes placed. */
    kvf_verdict_t (*on_data_end)(kvf_peer_t *p, uint64_t placed);
    /* Decode: a DATA_REF frame: check, then start pulling the bytes from p. */
    kvf_verdict_t (*on_data_ref)(kvf_peer_t *p, const kvf_msg_data_t *d);
    /* Decode: p is being freed with a frame's bounce buffer still kept on
     * it (p->rx_bounce, a frame cut short): let go of it. */
    void (*release_rx)(kvf_peer_t *p);
    /* Decode: take in the next read the movers handed back: its bytes
     * count, or its failure fails its room.  @return its peer, whose
     * reference the read held and the caller now owns (kvf__peer_put),
     * with the read's verdict on it in *verdict_p; NULL when none is left
     * (peer.c, kvf__peers_reads_done).  NULL on a side that reads nothing. */
    kvf_peer_t *(*read_take)(kvf_engine_t *eng, kvf_verdict_t *verdict_p);

    /* A room's (r->ops), called by room.c. */
    /* Set up the side's fields of a room just created, before anything
     * sees it (its "created" trace).  NULL: nothing to set up. */
    void     (*init)(kvf_room_t *r);
    /* Free what only this side's room holds (the room is being freed). */
    void     (*free)(kvf_room_t *r);
    /* A lane took the room in for the first time, and listed it on the
     * engine (kvf__room_list): the side's first work (a receiver asks the
     * resolver, a sender binds the destinations that came before it).
     * NULL: nothing to do then. */
    void     (*open)(kvf_room_t *r);
    /* The application destroyed the room, which is out of the engine's id
     * map and still on its list.  NULL: nothing to keep of it. */
    void     (*destroyed)(kvf_room_t *r);
    /* The room instance peer `to` knows the room by (0: none). */
    uint64_t (*instance_for)(kvf_room_t *r, const kvf_peer_t *to);
    /* The request key the room's FAILs carry (FAIL's sender_instance). */
    uint64_t (*fail_key)(const kvf_room_t *r);
    /* The other side's bit (KVF_SIDE_BIT) when this room's failure here
     * fails that side too, else 0 (room.c, kvf__room_fail_record). */
    uint8_t  (*doomed_side)(kvf_room_t *r);
    /* A link of the room broke with a reset stream (r->retries counts
     * this break): when the room acts on it (ops->tick). */
    uint64_t (*retry_at)(kvf_room_t *r, uint64_t now);
    /* A peer the room links to finished its handshake.  NULL: nothing to
     * do then. */
    void     (*peer_ready)(kvf_room_t *r);
    /* The side's own timers, each tick before the room's deadline is
     * checked: reconnects, sibling links, a held room's lease.  @return 1
     * when the state's deadline does not apply to the room now. */
    int      (*tick)(kvf_room_t *r, uint64_t now);
    /* What the room was waiting for in state s when its deadline expired
     * (the end of its failure reason). */
    void     (*deadline_detail)(kvf_room_t *r, kvf_poll_t s, char *buf, size_t len);
    /* Take in what the application published on the room without the
     * lock (kvf__room_submit: a sender's init and chunks, a receiver's
     * destination). */
    void     (*take)(kvf_room_t *r);
    /* Decode: the resolver thread looked up the prefill ranks the room
     * asked for (kvf__resolver_enqueue): link it to them, fail it, or
     * ask again.  The resolver calls up through this op alone. */
    void     (*resolved)(kvf_room_t *r, const kvf_lookup_t *res);
} kvf_room_ops_t;

extern const kvf_room_ops_t kvf_sender_room_ops;     /* sender.c */
extern const kvf_room_ops_t kvf_receiver_room_ops;   /* receiver.c */

/* The first op of `ops` that room.c or peer.c calls without a NULL test
 * (a decode op only in a decode table) and that is NULL, or "size" for a
 * size too small for a room; NULL when the table is whole.  Engine create
 * asserts it of the engine's table, so a side that forgot an op fails in
 * every debug test run, not at the first message that needs it. */
const char *kvf__room_ops_missing(const kvf_room_ops_t *ops);

struct kvf_room {
    kvf_engine_t    *eng;
    uint64_t         id;
    uint64_t         instance;    /* receiver: this room's instance (wire.h),
                                     drawn at create, kept across resumes */
    kvf_role_t       side;
    const kvf_room_ops_t *ops;    /* its side's */
    /* kvf_poll_t.  Turned by the lanes under the lock, and by an
     * application's abort or fail without it (kvf__room_fail_app); either
     * turn, and the record (`failure`) a FAILED one carries, is made under
     * final_lock, so that exactly one wins. */
    _Atomic int      state;
    /* The state (+1) before the application's abort or fail turned the
     * room FAILED, until a lane takes that failure in (tells the peers,
     * counts it: kvf__room_take_app_failure); 0 otherwise.  Until then a
     * lane may still be placing bytes in its pages, which it checked live
     * before the turn: the pages are not released (room_settled). */
    atomic_int       app_failed;
    pthread_mutex_t  final_lock;  /* a leaf: nothing is taken under it */
    /* I/O on its pages with the lock released: mover reads into a
     * receiver's pages in flight, and a stream's system call writing into
     * them (receiver) or reading them (sender).  Written under the lock,
     * read without it: a receiver is shown final, and its pages released,
     * only once this is 0, and a destroy waits for it (room.c). */
    _Atomic unsigned reads;
    int              refs;
    int              attached;    /* the application handle is live */
    int              listed;      /* on eng->rooms: a lane took it in */
    int              initialized;
    uint64_t         t_state_ms;  /* entered the state, or last progress */
    uint64_t         t_create_ms;
    /* For kvf_*_metric and the metrics' histograms (monotonic ns): created,
     * decode pages known, final (0: not yet).  Written by lanes under the
     * lock, read by kvf_*_metric without it: t_final_ns is stored
     * (release) after every byte the room moved is in `bytes`. */
    uint64_t         t_create_ns;
    _Atomic uint64_t t_dest_ns, t_final_ns;
    _Atomic uint64_t bytes;       /* its links' lk->bytes, summed (kvf__link_count) */
    kvf_failure_t   *failure;     /* first root cause, or NULL (a room that
                                     succeeded may keep one it did not take:
                                     siblings.c); set before the room turns
                                     FAILED, fixed from then on */
    uint8_t          failed_sides; /* KVF_SIDE_BIT of each side known to
                                      have failed the room (siblings.c) */
    int              failure_consumed;  /* the application's, under app_lock */
    kvf_room_t      *prev, *next; /* engine->rooms list (attached rooms) */
    uint32_t         nlinks;
    uint32_t         expected_links;
    kvf_link_t      *links;
    uint32_t         nwatch;
    kvf_watch_t     *watch;       /* siblings.c */
    uint32_t         aux_slot;      /* sender: source slot; receiver: destination */
    char            *last_err;      /* last resolver or connection error */
    uint32_t         retries;       /* reconnects used */
    uint64_t         retry_at_ms;   /* decode: next reconnect; prefill: resume deadline */
    /* ROOM_SUBMITTED: on eng->submitted (kvf__room_submit), which
     * submit_next links; set by the application's thread, cleared by the
     * lane taking it in.  ROOM_CLOSING: destroyed by the application
     * without the lock (final, nothing in flight on its pages); out of
     * the engine once a lane takes it in, or sooner, when a lane looks its
     * id up (kvf__room_find).  One word, so that the destroy that sets
     * CLOSING learns in the same step whether the room is on the list
     * already (a lane takes it out and frees it: the destroy may not
     * touch it again) or is its to push. */
    atomic_int       submit;
    kvf_room_t      *submit_next;
    /* The application's threads take turns on the handle's own fields
     * with this (calls that publish without the engine lock: a sender's
     * pages_given...); taken before the engine lock, never by an engine
     * thread, so a call waits only for another call on the same room. */
    pthread_mutex_t  app_lock;
    /* The side's own fields follow: struct kvf_sender, struct kvf_receiver
     * (room.h), each starting with this struct. */
};

/*
 * A destination (or a FAIL) that arrived before its sender existed.  Per
 * room id a chain, newest first (engine->stash); engine-wide a FIFO of
 * every entry, oldest first, so that the stashes are bounded in count and
 * bytes (KVF_STASH_MAX, KVF_STASH_BYTES) by dropping the oldest.
 */
#define KVF_STASH_MAX   32768
#define KVF_STASH_BYTES (32u << 20)

typedef struct kvf_stash {
    kvf_peer_t       *peer;
    uint64_t          room;
    size_t            bytes;       /* what it holds, as the bound counts it */
    int               queued;      /* in the engine's FIFO */
    struct kvf_stash *older, *newer; /* the FIFO */
    uint64_t          t_ms;
    kvf_link_t        link;        /* the parsed ROOM_REQ (pages owned) */
    uint32_t          expected;    /* expected_receivers */
    kvf_failure_t    *failure;     /* or a FAIL/ABORT for the room */
    uint64_t          instance;    /* the room instance it names */
    uint64_t          key;         /* a FAIL's request key (sender_instance) */
    int               watch;       /* a watch (siblings.c), not a destination */
    uint8_t           sides;       /* a FAIL's (wire.h) */
    struct kvf_stash *next;
} kvf_stash_t;

/*
 * A destroyed failed sender's record (engine->tombs): its failure and the
 * decode ranks whose destination it had bound.  A request from one of
 * those ranks with a new instance is a retry (the id reused); one from a
 * rank it never heard from is that rank's late request for this room.
 */
typedef struct kvf_tomb {
    kvf_failure_t f;               /* first: the record */
    uint64_t      seq;             /* its burial (engine->tomb_seq) */
    uint32_t      nranks;
    uint32_t      ranks[];
} kvf_tomb_t;

/* One burial in the ring (engine->tomb_ring): an id buried again has a
 * newer slot, and its older one, when it falls out, must not take the
 * newer tomb with it. */
struct kvf_tomb_slot {
    uint64_t room;
    uint64_t seq;
};

/* room.c */
void kvf__room_put(kvf_room_t *room);
void kvf__room_set_state(kvf_room_t *room, kvf_poll_t state);
/* Fail a room with a root cause seen here (peer: the one it concerns, or
 * NULL).  Tells the room's other peers.  No-op once the room is final. */
void kvf__room_fail(kvf_room_t *room, kvf_status_t st, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* The same, the cause being a rank of side `lost` gone (dead, stopped,
 * unreachable): that side failed the room too (siblings.c's verdicts). */
void kvf__room_fail_lost(kvf_room_t *room, kvf_role_t lost, kvf_status_t st,
                         const char *fmt, ...) __attribute__((format(printf, 4, 5)));
/* Fail a room with a record received from `from`. */
void kvf__room_fail_remote(kvf_room_t *room, kvf_peer_t *from, int abort,
                           const kvf_msg_fail_t *m);
void kvf__rooms_tick(kvf_engine_t *eng, uint64_t now);
/* A room message (ROOM_REQ, DONE, DONE_ACK, FAIL, ABORT) from a peer: its
 * room looked up, then handed to the engine's side (eng->room_ops).
 * @return the verdict on the peer. */
kvf_verdict_t kvf__room_on_msg(kvf_peer_t *peer, const kvf_msg_t *msg);
/* The verdict on a peer that sent a message of a type this engine's rooms
 * never take (KVF_ERR_PROTOCOL). */
kvf_verdict_t kvf__room_unexpected(const kvf_peer_t *peer, const kvf_msg_t *msg);
/* What peers report to the rooms (peer.h, kvf_peer_events_t; engine.c
 * fills the table with these). */
/* A frame from p cut short: let go of the room it was for (rx_dropped). */
void kvf__room_rx_drop(kvf_peer_t *p);
/* The peer went away (kvf_peer_events_t's `failed`). */
int  kvf__rooms_peer_failed(kvf_engine_t *eng, kvf_peer_t *peer, kvf_status_t st,
                            const char *reason, kvf_room_failed_t **failed_p,
                            size_t *nfailed_p);
/* A peer finished its handshake: send the requests waiting for it. */
void kvf__rooms_peer_ready(kvf_engine_t *eng, kvf_peer_t *peer);
/* 1 while a room that is not final has a link to this peer. */
int  kvf__rooms_wait_on(kvf_engine_t *eng, const kvf_peer_t *peer);



/* A run of pages becomes segments of at most this much: what one DATA
 * frame carries, and what one pull (shm, ucx) reads without yielding. */
#define MAX_RUN_BYTES (4ull << 20)
#define MAX_LINKS     1024
#define MAX_RETRIES   3              /* reconnects per room */
#define RETRY_BASE_MS 100            /* first reconnect delay; doubles */

/* The prefill side of a room: what it has been told to send. */
struct kvf_sender {
    kvf_room_t  room;            /* first: what both sides share */
    uint32_t    num_pages;       /* declared by kvf_sender_init */
    uint32_t    pages_sent;
    uint32_t   *src_pages;       /* source pages sent so far (for resends) */
    kvf_states_t state_src;      /* source state indices (kvf_sender_set_states) */
    /* KVF_PREFIX_KNOWN | the decode's prefix in tokens, as the
     * destinations say, stored by the lane once every destination came; 0
     * before: kvf_sender_decode_prefix_len reads it without the engine
     * lock. */
    _Atomic uint64_t prefix_known;
#define KVF_PREFIX_KNOWN (1ull << 32)
    int         last_sent;
    /* What the application gave (kvf_sender_init, kvf_sender_send), kept
     * under the room's app_lock, without the engine lock; pages_sent and
     * last_sent above are what the engine took in of it (the `take` op),
     * from `published`: pages given,
     * with KVF_SENT_LAST once the last chunk was, and KVF_SENT_INIT once
     * kvf_sender_init was (num_pages, src_pages and the room's aux_slot
     * then hold its values; the lanes read them only once they took it
     * in: the room's `initialized`). */
#define KVF_SENT_LAST (1ull << 32)
#define KVF_SENT_INIT (1ull << 33)   /* kvf_sender_init was called */
    uint32_t    pages_given;
    int         last_given;
    int         init_given;
    _Atomic uint64_t published;
    /* Layer-wise (kvf_sender_send_layers): NULL until the first per-layer
     * send, then, per layer slot (layout.h), the pages given so far,
     * stored (release) after src_pages as `published` is, and read by the
     * lanes (acquire); slot_sent, the lanes' own, what they took in of it.
     * pages_known, the application's: how many of src_pages are set (the
     * most pages any slot was given). */
    _Atomic uint32_t *_Atomic slot_given;
    uint32_t   *slot_sent;
    uint32_t    pages_known;
    /* A decode rank declared state indices: set before the room is
     * WAITING_FOR_INPUT, so a sender that sees that state sees it too. */
    atomic_int  wants_states;
    /* Held (kvf_sender_create_held): sends are kept until every reader
     * asked, within the lease from t_create_ms; a reader must name
     * hold_instance when it is not 0. */
    int         held;
    unsigned    lease_ms;
    uint64_t    hold_instance;
};

/* The decode side of a room: where its bytes may land. */
struct kvf_receiver {
    kvf_room_t  room;            /* first: what both sides share */
    char       *bootstrap_addr;  /* the registry to resolve its prefill ranks */
    int         dp_rank;
    /* The destination taken in, one block (receiver.c, kvf_dest_given_t):
     * pages ... state_bit0 below point into it; freed with the room. */
    struct kvf_dest_given *dest;
    uint32_t   *pages;           /* declared pages, in order */
    uint32_t   *sorted_pages;    /* the same, ascending */
    uint32_t    n_pages;
    uint64_t    ok_first, ok_last; /* last page range found declared */
    kvf_states_t state_dst;      /* destination state indices */
    /* Per group, its indices ascending (as state_dst.idx) and the first
     * coverage bit of its first buffer (cover_mark). */
    uint32_t   *state_sorted;
    uint64_t   *state_bit0;
    uint32_t    decode_prefix;
    uint64_t    sender_instance; /* the held room's instance to ask for (0: any) */
    int         remote;          /* from descriptors (kvf_receiver_create_remote) */
    /* A remote room's prefill ranks, checked on the application's thread,
     * until the lane that lists the room links it to them (receiver_open). */
    kvf_target_t *targets;
    int         ntargets;
    kvf_room_t *rq_next;         /* resolver queue */
    /* The application's destination, published without the engine lock
     * (kvf_receiver_set_dest) until a lane takes it in (the receiver's
     * take op fills the fields above from it); dest_given, under the
     * room's app_lock, refuses a second one. */
    _Atomic(struct kvf_dest_given *) given;
    int         dest_given;
};

static inline kvf_sender_t *sender_of(kvf_room_t *r)
{
    return (kvf_sender_t *)r;    /* r->side == KVF_ROLE_PREFILL */
}

static inline kvf_receiver_t *receiver_of(kvf_room_t *r)
{
    return (kvf_receiver_t *)r;  /* r->side == KVF_ROLE_DECODE */
}

/* Lock-free: the state is atomic (acquire pairs with kvf__room_set_state). */
static inline kvf_poll_t room_state(const kvf_room_t *r)
{
    return (kvf_poll_t)atomic_load_explicit(&r->state, memory_order_acquire);
}

enum { ROOM_SUBMITTED = 1, ROOM_CLOSING = 2 };

static inline int room_closing(const kvf_room_t *r)
{
    return (atomic_load(&r->submit) & ROOM_CLOSING) != 0;
}

static inline int room_final(const kvf_room_t *r)
{
    kvf_poll_t s = room_state(r);
    return s == KVF_POLL_FAILED || s == KVF_POLL_SUCCESS;
}

/* Final, and the lanes have taken in how: no lane is still acting on it
 * as live (an abort of the application's not taken in yet is not). */
static inline int room_settled(const kvf_room_t *r)
{
    return room_final(r) && atomic_load(&r->app_failed) == 0;
}

/* Sender: the link bound to this peer and room instance, or NULL. */
static inline kvf_link_t *link_bound(kvf_room_t *r, const kvf_peer_t *p, uint64_t instance)
{
    for (uint32_t i = 0; i < r->nlinks; i++)
        if (r->links[i].peer == p && r->links[i].tx.instance == instance)
            return &r->links[i];
    return NULL;
}

static inline kvf_link_t *link_of(kvf_room_t *r, const kvf_peer_t *p)
{
    for (uint32_t i = 0; i < r->nlinks; i++)
        if (r->links[i].peer == p)
            return &r->links[i];
    return NULL;
}

/* The number of items (pages, slots) every one of n buffers has. */
static inline uint64_t min_items(const kvf_buffer_t *b, uint32_t n)
{
    uint64_t m = UINT64_MAX;
    for (uint32_t i = 0; i < n; i++)
        if (b[i].length / b[i].item_bytes < m)
            m = b[i].length / b[i].item_bytes;
    return n ? m : 0;
}

/*
 * Bounds of what a room names, against a layout (ours, or a peer's from
 * its HELLO): the one place each kind of index is checked.
 */
/* The index of the first of pages[0..n) outside l's KV buffers, or n. */
static inline size_t first_bad_page(const kvf_layout_int_t *l, const uint32_t *pages,
                                    size_t n)
{
    uint64_t items = min_items(l->kv, l->num_kv);
    for (size_t i = 0; i < n; i++)
        if (pages[i] >= items)
            return i;
    return n;
}

/* 1 when `slot` is an aux slot of l (or l has no aux buffers). */
static inline int aux_slot_ok(const kvf_layout_int_t *l, uint32_t slot)
{
    return l->num_aux == 0 || slot < min_items(l->aux, l->num_aux);
}

/* The items every buffer of state group g of l has. */
static inline uint64_t group_items(const kvf_layout_int_t *l, uint32_t g)
{
    return min_items(l->state + l->group_first[g], l->group_first[g + 1] - l->group_first[g]);
}

/* Bytes one index of state group g moves: one item of each of its buffers. */
static inline uint64_t group_item_bytes(const kvf_layout_int_t *l, uint32_t g)
{
    uint64_t n = 0;
    for (uint32_t b = l->group_first[g]; b < l->group_first[g + 1]; b++)
        n += l->state[b].item_bytes;
    return n;
}

/* The first index of s (position in s->idx) outside its group's buffers
 * in l, or s->total (s->ngroups must be l->num_groups). */
static inline uint32_t first_bad_state(const kvf_layout_int_t *l, const kvf_states_t *s)
{
    uint32_t k = 0;
    for (uint32_t g = 0; g < s->ngroups; g++) {
        uint64_t items = group_items(l, g);
        for (uint32_t i = 0; i < s->count[g]; i++, k++)
            if (s->idx[k] >= items)
                return k;
    }
    return s->total;
}

/* The payload bytes the state indices s move. */
static inline uint64_t states_bytes(const kvf_layout_int_t *l, const kvf_states_t *s)
{
    uint64_t n = 0;
    for (uint32_t g = 0; g < s->ngroups; g++)
        n += (uint64_t)s->count[g] * group_item_bytes(l, g);
    return n;
}

static inline int has_broken_link(const kvf_room_t *r)
{
    for (uint32_t i = 0; i < r->nlinks; i++)
        if (r->links[i].broken)
            return 1;
    return 0;
}

static inline int all_done(const kvf_room_t *r)
{
    for (uint32_t i = 0; i < r->nlinks; i++)
        if (!r->links[i].done)
            return 0;
    return r->nlinks == r->expected_links;
}

static inline int want_checksum(const kvf_engine_t *eng, const kvf_peer_t *p)
{
    /* Both sides know the mover: they agree on skipping what has no host copy. */
    if (kvf__peer_caps(p) & KVF_MOVER_CAP_NO_HOST_COPY)
        return 0;
    return eng->params.checksum || p->checksum;
}

/* room.c: start a link's tallies over n streams afresh, lk->bytes
 * included (and out of the room's), with a checksum per stream when
 * `hash` (a stream without memory for one goes without: the receiver
 * fails the room on it). */
void kvf__link_streams_reset(kvf_room_t *r, kvf_link_t *lk, uint32_t n, int hash);
/* n payload bytes of room r moved on link lk's stream k (per segment: on
 * the transfer's path).  The lanes write r->bytes under the lock, one at
 * a time, so a load and a store do (no locked add); kvf__room_metric reads
 * it without the lock. */
static inline void kvf__link_count(kvf_room_t *r, kvf_link_t *lk, uint32_t k, uint64_t n)
{
    KVF_ASSERT_LOCKED(r->eng);
    lk->bytes += n;
    lk->stream_bytes[k] += n;
    atomic_store_explicit(&r->bytes, atomic_load_explicit(&r->bytes, memory_order_relaxed) + n,
                          memory_order_relaxed);
}

/* states.c */
/* Copy n per-group index arrays into s (n 0: none).  KVF_ERR_NO_MEMORY. */
kvf_status_t   kvf__states_set(kvf_states_t *s, const kvf_indices_t *in, size_t n);
/* The same from a ROOM_REQ's arrays (checked by the wire). */
kvf_status_t   kvf__states_from_wire(kvf_states_t *s, const kvf_wire_arr32_t *counts,
                                     const kvf_wire_arr32_t *idx);
void           kvf__states_free(kvf_states_t *s);

/* room.c */
/*
 * A room of ops->side (the engine's role), with its side's table, without
 * the engine lock: the id is the room's from here (a second create of it
 * is refused), but lanes see the room only once one took it in.  The
 * caller fills the side's fields, then hands it to the lanes
 * (kvf__room_submit), or lists it at once holding the lock.
 */
kvf_status_t   kvf__room_create(kvf_engine_t *eng, const kvf_room_ops_t *ops, uint64_t id,
                                kvf_room_t **room_p);
/* A receiver's instance (docs/PROTOCOL.md, "Room instances"), from any
 * thread: never 0, as unpredictable as a random draw, and never the same
 * twice on this engine but by a random collision (2^-64 per pair). */
uint64_t       kvf__room_new_instance(kvf_engine_t *eng);
/* The engine's key for them (at engine start, before any room). */
void           kvf__room_instances_setup(kvf_engine_t *eng);
/* Put a room just created on the engine's list (under the lock): lanes
 * see it from here; its side's ops->open runs. */
void           kvf__room_list(kvf_room_t *r);
/* The live room of an id, or NULL (under the lock): a room not yet taken
 * in is not live yet, one the application destroyed no longer is. */
kvf_room_t    *kvf__room_find(kvf_engine_t *eng, uint64_t id);
/* Take the engine lock for an application call on r: r is taken in
 * first if no lane did yet, so the call sees it listed. */
void           kvf__room_lock(kvf_room_t *r);
/*
 * kvf_*_destroy.  A settled room (room_settled) with nothing in flight on
 * its pages is only marked for the lanes (no lock, no wait): no byte can
 * land in them any more.  Any other takes the lock, fails the room if it
 * is live, and waits for what is in flight on its pages.
 */
void           kvf__room_destroy(kvf_room_t *r);
/*
 * The application published work on r without the lock (its create, a
 * sender's init and chunks...): list r for the lanes, the first of which to end a pass
 * takes it in (ops->take), and wake lane 0 if every lane sleeps.  Without
 * the lock, from the thread that holds the room's handle; a room already
 * listed is not listed twice (what is published is taken in whole).
 */
void           kvf__room_submit(kvf_room_t *r);
/* Take in every listed room's published work (each lane at each pass,
 * and whoever is about to free a room, which must not stay listed). */
void           kvf__rooms_take_submitted(kvf_engine_t *eng);
/*
 * kvf_*_abort and kvf_*_fail, without the engine lock: a live room turns
 * FAILED at once with the application's record (under its final_lock),
 * and is listed for the lanes, which take the failure in at their next
 * pass (kvf__room_take_app_failure: the peers are told then).  A no-op on
 * a final room, which stays final.
 */
void           kvf__room_abort(kvf_room_t *r);
kvf_status_t   kvf__room_fail_app(kvf_room_t *r, kvf_status_t st, const char *reason);
/* A lane takes in the failure an application's abort or fail published,
 * if r has one: what a failure here does besides turning the room FAILED
 * (its peers told, its stats and trace, await_failure's waiters woken). */
void           kvf__room_take_app_failure(kvf_room_t *r);
/* kvf_*_await_failure: takes the lock, but not on a room already FAILED,
 * which stays FAILED. */
kvf_status_t   kvf__room_await_failure(kvf_room_t *r, unsigned timeout_ms);
/* kvf_sender_failure / kvf_receiver_failure (`fn`, for messages): the
 * record into the caller's `out`, of its size.  Without the engine lock,
 * under the room's app_lock: a FAILED room's record does not change. */
kvf_status_t   kvf__room_consume_failure(kvf_room_t *r, kvf_failure_t *out, const char *fn);
/* kvf_sender_metric / kvf_receiver_metric, without the lock: it reads
 * the room's atomics (t_dest_ns, t_final_ns, bytes). */
kvf_status_t   kvf__room_metric(kvf_room_t *r, kvf_room_metric_t *m);
/* Record `f` (owned) as the root cause and tell every peer but `from`;
 * `sides`: the FAIL's, for a record received (0 for one seen here). */
void           kvf__room_fail_record(kvf_room_t *r, kvf_failure_t *f, kvf_peer_t *from,
                                     int abort, uint8_t sides);

/* failure.c */
/* Fill *f as a root cause seen on this engine (origin: its role, rank and
 * address): the one place a local failure record is made. */
void           kvf__failure_set(kvf_failure_t *f, const kvf_engine_t *eng, kvf_status_t st,
                                const char *fmt, ...) __attribute__((format(printf, 4, 5)));
/* The same with a va_list, and without the lock (it reads only what
 * does not change once the engine runs): room.c's room_vfail. */
void           kvf__failure_vset_unlocked(kvf_failure_t *f, const kvf_engine_t *eng,
                                          kvf_status_t st, const char *fmt, va_list ap)
    __attribute__((format(printf, 4, 0)));
/* The same, without the lock: the engine's record of an abort of the
 * application's (engine->app_abort), once its address is bound. */
void           kvf__failure_set_unlocked(kvf_failure_t *f, const kvf_engine_t *eng,
                                         kvf_status_t st, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
/* The record a FAIL or ABORT brought, learned from another rank (malloc'd;
 * NULL without memory). */
kvf_failure_t *kvf__room_remote_failure(const kvf_msg_fail_t *m);
/* Tell `to` the room failed (its record): now if the connection is up,
 * once it is if we are still making it (kvf__peer_send_soon), not at all
 * to a dead peer.  @return 1 if sent or kept. */
int            kvf__room_send_fail(kvf_room_t *r, kvf_peer_t *to, int abort);
/* A room message from `p` that the room is not bound to (another peer,
 * another instance): counted, logged at most once per KVF_DROP_LOG_MS,
 * and otherwise ignored; it never fails the room. */
#define KVF_DROP_LOG_MS 10000
void           kvf__room_dropped(kvf_peer_t *p, const char *what, uint64_t room,
                                 uint64_t instance, const char *why);
/* Prefill: did a destroyed sender serve this room instance? */
int            kvf__instance_retired(const kvf_engine_t *eng, uint64_t instance);
/* Prefill: remember the room instances a sender being destroyed served,
 * forgetting the oldest beyond KVF_RETIRED. */
void           kvf__room_retire_instances(kvf_room_t *r);

/* stash.c */
/* Free a chain of stashed destinations. */
void kvf__stash_free(kvf_stash_t *s);
/* Drop what waited longer than the bootstrap deadline for its sender. */
void kvf__stash_expire(kvf_engine_t *eng, uint64_t now);
/* Take what was kept for `room`, oldest first (a chain the caller frees). */
kvf_stash_t *kvf__stash_take(kvf_engine_t *eng, uint64_t room);
/* Keep a destroyed failed sender's record, to answer late requests. */
void kvf__sender_bury(kvf_room_t *r);
/* A decode rank names a room whose sender is gone: tell it so. */
void kvf__sender_answer_gone(kvf_peer_t *p, uint64_t room, uint64_t instance);
/* A ROOM_REQ (lk) or a failure (f, naming request key `key`) for a room
 * whose sender does not exist yet.  @return the entry, or NULL when it
 * could not be kept. */
kvf_stash_t *kvf__sender_stash_add(kvf_peer_t *p, uint64_t room, uint64_t instance,
                                   kvf_link_t *lk, uint32_t expected, kvf_failure_t *f,
                                   uint64_t key);
/* A watch (siblings.c) from decode rank `rank` for a room without a sender. */
void kvf__sender_stash_watch(kvf_peer_t *p, uint64_t room, uint32_t rank, uint64_t instance);

/* siblings.c: the rooms' sibling links (docs/PROTOCOL.md, "Siblings"). */
/* Decode: watch the n prefill ranks of the room's DP group it reads nothing
 * from (each told about the room once its connection is ready). */
void kvf__siblings_link(kvf_room_t *r, const kvf_target_t *t, int n);
/* Decode: send the watches not sent yet (to a peer still connecting, once
 * it has authenticated: kvf__peer_send_soon), and, for a room that failed
 * meanwhile, its FAIL after them. */
void kvf__siblings_send(kvf_room_t *r);
/* Prefill: a decode rank's watch (ROOM_REQ with KVF_REQ_WATCH) of room
 * m->room, live here as r (NULL: not live). */
void kvf__siblings_on_watch(kvf_peer_t *p, kvf_room_t *r, const kvf_msg_room_req_t *m);
/* Prefill: the same for a live sender (a watch that waited in the stash). */
void kvf__siblings_take(kvf_room_t *r, kvf_peer_t *p, uint32_t rank, uint64_t instance);
/* Prefill: a byte link of room r now binds decode rank p: a watch another
 * peer holds for that rank goes. */
void kvf__siblings_evict(kvf_room_t *r, const kvf_peer_t *p);
/* Is `p` a sibling of room r (naming `instance`, on a sender)? */
int  kvf__siblings_bound(const kvf_room_t *r, const kvf_peer_t *p, uint64_t instance);
/* Tell every sibling but `from` that the room failed (its record). */
void kvf__siblings_tell(kvf_room_t *r, const kvf_peer_t *from, int abort);
/* Peer p went away (st, reason): if room r watched it, a decode room still
 * live dials it again after a reset, as a byte link would, and otherwise
 * must fail with it; a sender, or a final room, forgets the watch.
 * @return 1 when the room must fail, with *v (st and the reason): the
 * caller fails it (kvf__room_fail_lost, side KVF_ROLE_PREFILL). */
int  kvf__siblings_peer_lost(kvf_room_t *r, kvf_peer_t *p, kvf_status_t st,
                             const char *reason, kvf_verdict_t *v);
/* Decode: dial again the sibling links whose reconnect is due.  @return 1
 * when one is unreachable and the room must fail, with *v, as above. */
int  kvf__siblings_tick(kvf_room_t *r, uint64_t now, kvf_verdict_t *v);
void kvf__siblings_free(kvf_room_t *r);

/* acks.c: decode, the DONE_ACKs of push links until the prefill rank
 * confirms them, said again on a new connection after a reset.  At most
 * KVF_ACKS_OWED per peer (a new one drops the oldest), none kept past two
 * heartbeat timeouts. */
#define KVF_ACKS_OWED 256
/* One answered on p (after it was sent). */
void kvf__acks_owe(kvf_peer_t *p, uint64_t room, uint64_t instance, uint64_t bytes);
/* A DONE_ACK from prefill peer p: the confirmation of one owed?  @return
 * 1 when it was (and it is no longer owed). */
int  kvf__acks_confirmed(kvf_peer_t *p, const kvf_msg_done_ack_t *m);
/* Peer p failed with st (it is dead now; kvf_peer_events_t's `dead`):
 * after a reset, what it owed is said again at the next tick. */
void kvf__acks_peer_lost(kvf_peer_t *p, kvf_status_t st);
void kvf__acks_tick(kvf_engine_t *eng, uint64_t now);
void kvf__acks_free(kvf_engine_t *eng);

/* receiver.c */
/* Send the room's destination to every prefill rank it links to, once
 * each is ready and compatible. */
void kvf__receiver_try_request(kvf_room_t *room);
/*
 * A receiver that failed before it knew the prefill ranks it reads from
 * (its lookup was under way) tells each of them, once linked: their
 * senders would otherwise wait out their own deadline for this rank's
 * destination, and name that.  A FAIL to a connection not up yet waits
 * for it (kvf__peer_send_soon), also if the room is destroyed meanwhile.
 */
void kvf__receiver_tell_failed(kvf_room_t *room);

#endif /* KVF_CORE_ROOM_H */
