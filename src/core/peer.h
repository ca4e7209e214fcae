/*
 * Peers, internal: one per connection to another engine (peer.c), its
 * handshake, transport choice and liveness.  What the authentication at
 * its start decides is auth.c's: peer.c asks it (auth.h, one step per
 * event) and does what the step says, and auth.c calls nothing here.
 *
 * Streams (peer.c, "Streams"): a pair that agreed on n > 1 streams has n
 * connections.  The first is the peer itself (owned by lane 0, in
 * engine->peers, carrying the control messages); stream k >= 1 is a
 * kvf_peer_t of its own in peer->streams[k], owned by lane k, whose
 * `primary` is the peer: it carries DATA frames and its own DONE, and its
 * failure is the peer's.  Rooms only ever name the primary.
 */
#ifndef KVF_CORE_PEER_H
#define KVF_CORE_PEER_H

#include "core/engine.h"
#include "core/verdict.h"

typedef struct kvf_peer kvf_peer_t;

typedef enum {
    KVF_PEER_CONNECTING,   /* outbound connect in progress */
    KVF_PEER_REDIAL,       /* outbound, closed before the peer's AUTH (refused
                              at the door: busy): dials again at redial_at_ms */
    KVF_PEER_AUTH,         /* AUTH / AUTH_PROOF: not trusted yet (auth.c) */
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
    int               watch_only;    /* decode: for sibling links only (peer_get) */
    char              addr[KVF_ADDR_MAX]; /* remote control address */
    char              remote_host[64];    /* the connection's source address */
    kvf_auth_t        auth;
    int               quiet;         /* its failure was logged already (auth.c) */
    /* Outbound, still authenticating when its rooms failed: their FAILs
     * wait in `held` for the peer's proof (nothing goes to a peer before
     * it), and the connection lingers until the handshake deadline. */
    struct kvf_outq  *held_head, *held_tail;
    int               lingering;
    /* Outbound: connections the peer closed before its AUTH since this
     * one last authenticated (each dialled again, with backoff, while a
     * room waits: kvf__peer_redial), the last one's time and reason. */
    unsigned          refused;
    unsigned          redials;       /* for the backoff; ever */
    uint64_t          refused_ms;
    uint64_t          redial_at_ms;
    char              refused_why[96];
    /* From the remote HELLO. */
    kvf_role_t        role;
    int               tp_rank, tp_size, pp_rank, pp_size, dp_rank, dp_size;
    uint64_t          instance_id;
    int               checksum;      /* remote computes checksums */
    kvf_layout_int_t  layout;
    uint32_t         *kv_map;        /* the decode KV buffer of each prefill KV
                                        buffer (kvf__kv_map), once compatible */
    uint32_t         *kv_src;        /* decode side: the reverse, UINT32_MAX for
                                        a buffer this peer does not write */
    char             *incompatible;  /* set: every room on this pair fails */
    int               hello_done;    /* decode: HELLO seen, XPORT awaited */
    /* Payload path, chosen at the handshake: a mover, or NULL for the
     * control stream itself.  Decode: mep reads the prefill's memory. */
    const kvf_mover_ops_t *mover;
    kvf_mover_ep_t   *mep;
    uint32_t          caps;          /* KVF_CAP_* both sides agreed in XPORT:
                                        optional forms payload frames may use */
    kvf_rx_target_t  *ref_tgt;       /* DATA_REF scratch: checked targets */
    uint32_t          ref_cap;
    uint64_t          read_bytes;    /* of its DATA_REFs, being read now */
    /* What threads other than the connection's owner sent, in order; the
     * owner hands it to the connection (kvf__peer_outbox_drain). */
    struct kvf_outq  *out_head, *out_tail;
    kvf_peer_t       *free_next;     /* engine->peers_free */
    /* Decode: the DONE_ACKs of push links it has not confirmed (acks.c). */
    struct kvf_acks  *owed;
    /* Streams (peer.c, "Streams").  lane: the lane that owns conn (0 but for a
     * stream k >= 1, once it is attached).  A primary: nstreams agreed in
     * XPORT (1 without), streams[1..nstreams) (a reference each), joined
     * (attached ones), the cookie its joins name, and where to dial them
     * (decode).  A stream: its primary and index. */
    unsigned          lane;
    unsigned          nstreams;
    kvf_peer_t       *streams[KVF_MAX_STREAMS];
    unsigned          joined;
    uint8_t           cookie[KVF_WIRE_COOKIE_LEN];
    char              dial_host[64];
    int               dial_port;
    kvf_peer_t       *primary;
    unsigned          stream;
    int               streams_offered; /* prefill: its XPORT offer named a cookie */
    int               joining;       /* prefill: announced a JOIN (AUTH flag) */
    int               move_pending;  /* prefill: JOIN taken, moves to its lane */
    int               close_pending; /* failed off its lane: the lane closes it */
    /* Current inbound DATA frame (decode side). */
    struct kvf_room  *rx_room;
    struct kvf_link  *rx_link;
    struct kvf_room  *rx_pinned;     /* rx_room, while the stream writes into it */
    /* A staged DATA frame (stage.h): its device pieces land in rx_bounce
     * first, rx_dev[i] <- rx_bnc[i] is copied once the frame is in. */
    uint64_t          rx_payload;    /* the current frame's payload bytes */
    void             *rx_bounce;
    size_t            rx_bounce_cap;
    uint64_t          rx_dev_bytes;
    uint32_t          rx_ndev, rx_dev_cap;
    struct iovec     *rx_dev, *rx_bnc;
    uint64_t          handshake_until_ms; /* READY by then, or closed */
    uint64_t          last_hb_ms;
    uint64_t          grace_until_ms; /* no liveness verdict before (own stall) */
    uint64_t          hb_seq;
    kvf_peer_t       *next;          /* engine->peers */
};

/* What this peer's payload path can do: its mover's KVF_MOVER_CAP_*, or
 * nothing beyond the stream (0). */
static inline unsigned kvf__peer_caps(const kvf_peer_t *p)
{
    KVF_ASSERT_LOCKED(p->eng);
    return p->mover != NULL ? p->mover->caps : 0;
}

/* Does this engine stage device memory over the stream (it has a copier:
 * stage.h)?  Here rather than in stage.c: the peer decides from it which
 * path device memory may take (peer.c), and a peer reaches no
 * room file. */
static inline int kvf__stages(const kvf_engine_t *eng)
{
    KVF_ASSERT_LOCKED(eng);
    return eng->copier != NULL;
}

/* The receiver pulls this peer's payload (DATA_REF) instead of receiving
 * it in the stream. */
static inline int kvf__peer_pulls(const kvf_peer_t *p)
{
    KVF_ASSERT_LOCKED(p->eng);
    return (kvf__peer_caps(p) & KVF_MOVER_CAP_PULL) != 0;
}

/* The peer a connection belongs to: itself, or a stream's primary. */
static inline kvf_peer_t *kvf__peer_main(kvf_peer_t *p)
{
    KVF_ASSERT_LOCKED(p->eng);
    return p->primary != NULL ? p->primary : p;
}

/* Stream k of a peer (0: itself), attached and owned by its lane, or NULL. */
static inline kvf_peer_t *kvf__peer_stream(kvf_peer_t *p, unsigned k)
{
    KVF_ASSERT_LOCKED(p->eng);
    if (k == 0)
        return p;
    kvf_peer_t *s = k < KVF_MAX_STREAMS ? p->streams[k] : NULL;
    return s != NULL && s->lane == k ? s : NULL;
}

/* Streams a room's payload toward this peer is spread over now. */
static inline unsigned kvf__peer_nstreams(const kvf_peer_t *p)
{
    KVF_ASSERT_LOCKED(p->eng);
    return p->state == KVF_PEER_READY && p->joined + 1 == p->nstreams ? p->nstreams : 1;
}

/* A room the rooms failed when its peer went away, which the peer tells
 * its other side itself (kvf_peer_events_t's `failed`). */
typedef struct kvf_room_failed {
    uint64_t      room;
    uint64_t      instance;       /* the room instance the peer knows it by */
    uint64_t      key;            /* a receiver's held room's request key, or 0 */
    kvf_failure_t failure;
} kvf_room_failed_t;

/*
 * What a peer reports to the layers above it.  peer.c names no room or
 * acknowledgement code: it calls up through this table alone
 * (eng->peer_events), which engine.c fills with room.c's and acks.c's
 * functions, so those may call peers and events still flow one way:
 * transport -> peer -> room.  Every entry runs under the engine lock.
 */
typedef struct kvf_peer_events {
    /* A room message (ROOM_REQ, DONE, DONE_ACK, FAIL, ABORT) from p.
     * @return the verdict on p. */
    kvf_verdict_t (*room_msg)(kvf_peer_t *p, const kvf_msg_t *msg);
    /* p went away: fail (or, for a reset stream, hold for a reconnect)
     * every live room linked to it; @return how many.  The rooms tell
     * their other peers, never p: the ones failed are listed in *failed_p
     * (malloc'd, *nfailed_p entries, maybe fewer without memory) for p to
     * send their FAILs itself. */
    int  (*failed)(kvf_engine_t *eng, kvf_peer_t *p, kvf_status_t st, const char *reason,
                   kvf_room_failed_t **failed_p, size_t *nfailed_p);
    /* p finished its handshake: send the requests waiting for it. */
    void (*ready)(kvf_engine_t *eng, kvf_peer_t *p);
    /* 1 while a room that is not final has a link to p. */
    int  (*needed)(kvf_engine_t *eng, const kvf_peer_t *p);
    /* p is dead (st why): keep what it still owes its other side
     * (acks.c: a reset peer's unconfirmed answers). */
    void (*dead)(kvf_peer_t *p, kvf_status_t st);
    /* p's frame in progress was cut short (its stream let go): let go of
     * the room it was for (p->rx_room). */
    void (*rx_dropped)(kvf_peer_t *p);
} kvf_peer_events_t;

/* Bytes of DATA_REF reads one peer may have in flight: beyond it, its
 * stream is held (not parsed) until reads end. */
#define KVF_READ_WINDOW (16ull << 20)

/* outbox.c: what a peer sends, and how it waits. */
/* Queue a message (any thread; off the owner thread it waits in the
 * outbox for the next pass).  KVF_ERR_CONN_RESET once the peer is dead. */
kvf_status_t kvf__peer_send(kvf_peer_t *peer, const kvf_msg_t *msg);
/* An outbound peer still connecting or authenticating: keep msg until it
 * has proved itself, then send it after our HELLO (kvf__peer_send_soon). */
void         kvf__peer_hold(kvf_peer_t *peer, const kvf_msg_t *msg);
/* Queue a put the same way (it always completes). */
void         kvf__peer_put_data(kvf_peer_t *peer, kvf_put_t *put);
/* Owner thread: give the connection what waits in the outbox. */
void         kvf__peer_outbox_drain(kvf_peer_t *peer);
/* Authenticated at last: what waited for it goes out, after our HELLO. */
void         kvf__peer_send_held(kvf_peer_t *peer);
/* Free what is still held (the peer is being freed). */
void         kvf__peer_held_free(kvf_peer_t *peer);
/* Send a room message now, or, to a peer this engine is still connecting
 * to or authenticating, once it has authenticated (right after our
 * HELLO).  Our HELLO is out once the connection is up, so a message may
 * follow it even before the peer's HELLO arrived (the peer may be
 * stopped, and read it later).  @return 1 if sent or kept. */
int          kvf__peer_send_soon(kvf_peer_t *p, const kvf_msg_t *msg);
/* Tell `to` that room `room` (instance, request key `key`: FAIL's
 * sender_instance) failed with record f, the sides known to have failed
 * being `sides` (wire.h): a FAIL, or an ABORT when `abort`, sent as
 * kvf__peer_send_soon does.  @return 1 if sent or kept. */
int          kvf__peer_send_fail(kvf_peer_t *to, uint64_t room, uint64_t instance,
                                 uint64_t key, const kvf_failure_t *f, int abort,
                                 uint8_t sides);
/* The same for a record that is no live room's (a refusal, a tomb, a
 * deadline): its origin's side and this engine's failed. */
void         kvf__send_fail(kvf_peer_t *to, uint64_t room, uint64_t instance,
                            const kvf_failure_t *f, int abort);
/* The same naming the held room's request key the sender failed to read
 * (FAIL's sender_instance). */
void         kvf__send_fail_keyed(kvf_peer_t *to, uint64_t room, uint64_t instance,
                                  uint64_t key, const kvf_failure_t *f, int abort);

/* peer.c */
/* The connection to the prefill rank `tp_rank` at host:port (cached).
 * `watch`: one that only carries the failures of rooms whose bytes come
 * from other ranks (siblings.c): it takes no mover and one stream, and is
 * a connection of its own beside a data one to the same rank. */
kvf_peer_t  *kvf__peer_get(kvf_engine_t *eng, const char *host, int port, int tp_rank,
                           int watch);
void         kvf__peer_put(kvf_peer_t *peer);
/* Open the peer's connection (a stream's on its lane) to where its primary
 * was dialled.  KVF_OK, or what connect said (nothing was opened). */
kvf_status_t kvf__peer_dial(kvf_peer_t *peer);
/* Its owner lane, once redial_at_ms has come: dial a REDIAL peer (or
 * stream) again, while a room still waits for it (or its primary). */
void         kvf__peer_redial(kvf_peer_t *peer, uint64_t now);
/* Why the rooms of a peer that is not READY still wait, when it (or a
 * stream of it) was refused at the door: one sentence in buf.  @return 1
 * when it was. */
int          kvf__peer_refusals(const kvf_peer_t *peer, char *buf, size_t len);
/* A connection from `host` (already admitted by kvf__auth_admit). */
void         kvf__peer_accept(kvf_engine_t *eng, int fd, const char *host);
/* epoll said `events` for the peer's connection.  May let the lock go
 * (its handle op). */
void         kvf__peer_handle(kvf_peer_t *peer, uint32_t events);
/* May its stream be parsed on (its reads in flight are within the window)? */
int          kvf__peer_rx_ready(const kvf_peer_t *peer);
/* Fail the peer and its rooms.  On the peer's own lane it closes the
 * connection at once, and so may let the lock go (kvf__peer_close_pending). */
void         kvf__peer_fail(kvf_peer_t *peer, kvf_status_t st, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
void         kvf__peers_tick(kvf_engine_t *eng, uint64_t now);
/* The peer is broken (st, then the reason as printf): a room's verdict
 * (core/verdict.h). */
kvf_verdict_t kvf__verdict(kvf_status_t st, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
/* Peer code, once a room's call has returned: act on its verdict about
 * peer p (fail p unless it is KVF_OK). */
void         kvf__peer_heed(kvf_peer_t *peer, const kvf_verdict_t *v);
/* Take in the reads the movers handed back (receiver.c), each read's
 * verdict on its peer acted on before the next is taken in (engine loop,
 * destroy). */
void         kvf__peers_reads_done(kvf_engine_t *eng);
/* Owner thread: free the peers whose last reference went elsewhere. */
void         kvf__peers_free(kvf_engine_t *eng);
/* Owner lane: close a peer whose failure came from another thread.  May
 * let the lock go (the connection's last flush). */
void         kvf__peer_close_pending(kvf_peer_t *peer);
/* A peer of this engine's own: the connection handler every peer uses. */
extern const kvf_conn_handler_t kvf__peer_handler;

/* peer.c: streams */
/* Prefill: the XPORT entry offering streams (none when this engine has
 * one lane); @return 1 when *e was filled (blob: KVF_WIRE_STREAMS_OFFER
 * bytes). */
int          kvf__streams_offer(kvf_peer_t *p, uint8_t *blob, kvf_wire_xport_t *e);
/* Decode: the prefill offered streams (entry o, or NULL): how many to use
 * (1: none); fills the answer entry when > 1. */
unsigned     kvf__streams_accept(kvf_peer_t *p, const kvf_wire_xport_t *o, uint8_t *blob,
                                 kvf_wire_xport_t *answer);
/* Prefill: the decode engine's answer; KVF_OK or KVF_ERR_PROTOCOL (err). */
kvf_status_t kvf__streams_answer(kvf_peer_t *p, const kvf_wire_xport_t *e, char *err,
                                 size_t len);
/* Decode: open streams 1..nstreams-1 of a peer whose XPORT answer is out. */
void         kvf__streams_open(kvf_peer_t *p);
/* A JOIN: on a prefill's inbound connection, or a decode's stream's answer. */
void         kvf__stream_on_join(kvf_peer_t *p, const kvf_msg_join_t *m);
/* A message on stream k >= 1 (after authentication). */
void         kvf__stream_on_msg(kvf_peer_t *s, const kvf_msg_t *msg);
/* A stream authenticated: send its JOIN (decode). */
void         kvf__stream_authenticated(kvf_peer_t *s);
/* The peer failed: every stream of it goes too (closed on its lane). */
void         kvf__streams_close(kvf_peer_t *p);
/* Teardown (every lane owned, no callback on the stack): let go of every
 * stream of p now. */
void         kvf__streams_release(kvf_peer_t *p);
/* 1 while a dead peer still has streams its lanes have not let go of. */
int          kvf__streams_held(const kvf_peer_t *p);
/* Lane 0, after its events: attach the streams whose JOIN was taken. */
void         kvf__streams_move(kvf_engine_t *eng);
/* Lane k >= 1: one pass over stream k of every peer; @return 1 when a
 * connection has messages left.  Lets the lock go (flush, handle). */
int          kvf__lane_pass(kvf_lane_t *lane);
/* Lane k >= 1: epoll said `events` for data.ptr `ptr`.  May let the lock
 * go (handle). */
void         kvf__lane_event(kvf_lane_t *lane, void *ptr, uint32_t events);

/* "decode rank 1 (127.0.0.1:4000)" */
const char  *kvf__peer_name(const kvf_peer_t *peer, char *buf, size_t len);

#endif /* KVF_CORE_PEER_H */
