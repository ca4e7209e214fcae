/*
 * The transport contract: how payload moves from registered local memory
 * into registered remote memory.
 *
 * A transfer is described by a kvf_put_t: an iterator over segments
 * (source pointer, destination buffer kind/index/offset, length) that the
 * transport pulls from as fast as it can move bytes.  Segments are produced
 * lazily because a scattered room can have hundreds of thousands of them
 * (one per page run per layer buffer): nothing proportional to that is ever
 * materialised.
 *
 * Completion contract: put->complete() is called once, on the progress
 * thread, when every segment is either placed in the peer's memory or
 * ordered before any control message the engine queues to that peer
 * afterwards (TCP: the last byte is in the ordered stream; UCX: after a
 * flush).  Either way, a DONE sent after completion reaches the receiver
 * after the data.  A put whose room fails stops at the next segment
 * boundary it can stop at and completes with the room's status.
 *
 * Threads: every op is called on the engine's progress thread with the
 * engine lock held, and calls back the same way.  Around the system calls
 * that move payload the lock is released (kvf_conn_env_t): the ops that
 * may do so say "lets the lock go", and their callers re-check, after the
 * call, whatever another thread may have changed meanwhile.
 */
#ifndef KVF_TRANSPORT_TRANSPORT_H
#define KVF_TRANSPORT_TRANSPORT_H

#include <stdint.h>
#include <sys/uio.h>

#include "kvferry/status.h"
#include "wire/wire.h"

typedef struct kvf_put kvf_put_t;

/* put->next: nothing more is ready now (see there). */
#define KVF_PUT_WAIT 2

struct kvf_put {
    /*
     * Produce the next segment: its destination in *seg and its source in
     * *src (a strided segment's pieces are seg->src_stride apart from
     * there; the transport may cut it between pieces across frames).
     * @return 1 when a segment was produced, 0 at the end, KVF_PUT_WAIT
     * when nothing more is ready now (the transport ends the frame it is
     * building there and asks again on a later flush: a staged put whose
     * next bytes are still being copied, core/stage.h), or a negative
     * kvf_status_t when the put must stop (its room failed).
     */
    int  (*next)(kvf_put_t *put, kvf_wire_seg_t *seg, const void **src);
    /* Called once, as described above. */
    void (*complete)(kvf_put_t *put, kvf_status_t status);
    /* busy=1 before, busy=0 after, a system call that reads the source
     * bytes of this put with the engine lock released (see
     * kvf_conn_env_t); the room is pinned in between.  May be NULL. */
    void (*busy)(kvf_put_t *put, int busy);
    /* 0 once the source bytes are no longer the put's to read (its room
     * failed or was destroyed): what is left of a frame already started
     * goes out as zeros.  May be NULL: always. */
    int  (*live)(kvf_put_t *put);
    /* A frame of this put has been written whole: the sources of the
     * segments it yielded before are no longer read.  May be NULL. */
    void (*sent)(kvf_put_t *put);
    uint64_t   room;
    uint64_t   instance;   /* the receiver's room instance (wire.h) */
    uint32_t   src_rank;
    int        by_ref;     /* send source addresses, not bytes: the peer pulls */
    kvf_put_t *qnext;      /* transport-owned queue link */
};

/*
 * Where an inbound DATA piece goes (a plain segment is one piece, a
 * strided one `count`).  The engine resolves each piece of a frame to a
 * destination (already bounds-checked against what the room declared) or
 * to NULL: discard those bytes.
 */
typedef struct kvf_rx_target {
    uint8_t *dst;
    uint32_t len;
} kvf_rx_target_t;

/*
 * What a connection reads from its peer while a limit is set (ops->limit):
 * every frame header is checked against it before any of its body is
 * read or buffered.  A peer that has not authenticated may cost the
 * engine no more than the frames it may send then (core/auth.c).
 */
typedef struct kvf_rx_limit {
    uint32_t    types;      /* the message types let through: bit (1u << type) */
    uint32_t    max_body;   /* their body bytes, at most */
    const char *why;        /* ends the refusal's reason: "before authenticating" */
} kvf_rx_limit_t;

/* What a connection tells the engine.  Called on the progress thread with
 * the engine lock held. */
typedef struct kvf_conn_handler {
    /* An outbound connect finished (the stream is writable). */
    void (*on_connected)(void *arg);
    /* A decoded control message (every type but DATA). */
    void (*on_msg)(void *arg, const kvf_msg_t *msg);
    /* A DATA frame arrived: fill targets[0..d->npieces-1], in payload order
     * (dst NULL: discard). */
    void (*on_data)(void *arg, const kvf_msg_data_t *d, kvf_rx_target_t *targets);
    /* Before more payload of the current frame is placed: 0 = discard the
     * rest (its room went away meanwhile). */
    int  (*rx_valid)(void *arg);
    /* Before the next message is parsed: 0 = hold it (and stop reading the
     * socket) until the engine calls handle() again; pending() stays 1
     * meanwhile.  May be NULL: always ready. */
    int  (*rx_ready)(void *arg);
    /* busy=1 before, busy=0 after, a system call that writes the current
     * DATA frame's payload into its targets with the engine lock released
     * (see kvf_conn_env_t): the room must stay put in between.  May be
     * NULL. */
    void (*rx_busy)(void *arg, int busy);
    /* Payload bytes were placed at p (for checksums).  May be NULL. */
    void (*on_placed)(void *arg, const uint8_t *p, size_t n);
    /* The current DATA frame's payload has been read completely. */
    void (*on_data_end)(void *arg, uint64_t placed);
    /* The stream failed or the peer closed it.  Called once; the conn is
     * shut down afterwards and only destroy may follow. */
    void (*on_close)(void *arg, kvf_status_t status, const char *reason);
} kvf_conn_handler_t;

/*
 * Where a connection registers itself for events, and how it lets go of
 * the engine lock around its system calls: unlock before a send, write,
 * recv or read of the socket, lock after (both NULL: keep it).  Only the
 * connection's own thread ever calls its ops (the engine routes what
 * other threads send through that thread), so nothing but the payload
 * pages is shared while the lock is released, and those are pinned
 * (put->busy, handler->rx_busy).
 */
typedef struct kvf_conn_env {
    int   epfd;       /* the engine's epoll instance */
    void *ep_data;    /* epoll_event.data.ptr for this connection */
    void (*unlock)(void *lock_arg);
    void (*lock)(void *lock_arg);
    void *lock_arg;
} kvf_conn_env_t;

typedef struct kvf_conn kvf_conn_t;
typedef struct kvf_transport_ops kvf_transport_ops_t;

/* Every backend's connection struct starts with this. */
struct kvf_conn {
    const kvf_transport_ops_t *ops;
};

/*
 * A transport backend.  Every op runs on the progress thread under the
 * engine lock (and lets the lock go around its system calls, see
 * kvf_conn_env_t), never blocks, and reports failures through the
 * handler's on_close, never by returning them later.
 */
struct kvf_transport_ops {
    const char *name;
    /* Start a non-blocking connect; on_connected or on_close follows. */
    kvf_status_t (*connect)(const char *host, int port, const kvf_conn_env_t *env,
                            const kvf_conn_handler_t *h, void *arg, kvf_conn_t **conn_p);
    /* Take over an accepted socket. */
    kvf_status_t (*accept)(int fd, const kvf_conn_env_t *env,
                           const kvf_conn_handler_t *h, void *arg, kvf_conn_t **conn_p);
    /* epoll reported `events` for this connection.  Lets the lock go
     * (reads, and the writes of a flush). */
    void         (*handle)(kvf_conn_t *c, uint32_t events);
    /* Queue a control message (ordered after every put completed before). */
    kvf_status_t (*send_msg)(kvf_conn_t *c, const kvf_msg_t *msg);
    /* Queue a put; it always completes, with KVF_ERR_CONN_RESET if the
     * connection goes first. */
    void         (*put)(kvf_conn_t *c, kvf_put_t *put);
    /* Move queued bytes as far as the network takes them.  Lets the lock
     * go (writes). */
    void         (*flush)(kvf_conn_t *c);
    /* Move the connection to another thread's epoll instance (env's epfd
     * and ep_data; the lock functions stay): called by its current owner
     * between two handle() calls, after which only the thread of the new
     * epfd touches it.  Buffered input stays buffered (pending() says so).
     * KVF_OK, or KVF_ERR_IO (epoll_ctl failed: the connection is as it
     * was). */
    kvf_status_t (*rebind)(kvf_conn_t *c, const kvf_conn_env_t *env);
    /* Periodic tick (timers of the backend).  May be NULL. */
    void         (*tick)(kvf_conn_t *c, uint64_t now_ms);
    /* Close now: queued puts complete with KVF_ERR_CONN_RESET; no on_close. */
    void         (*shutdown)(kvf_conn_t *c);
    void         (*destroy)(kvf_conn_t *c);
    /* kvf_now_ms() of the last byte received / sent. */
    uint64_t     (*last_rx)(const kvf_conn_t *c);
    uint64_t     (*last_tx)(const kvf_conn_t *c);
    /* 1 when nothing is queued or half-written. */
    int          (*idle)(const kvf_conn_t *c);
    /* 1 when received messages wait in the connection's buffer: a handle
     * stops after a bounded amount of work, and epoll will not say so. */
    int          (*pending)(const kvf_conn_t *c);
    /* Limit what is read from now on (lim: the caller's, kept until the
     * next call; NULL lifts the limit).  A frame whose header is beyond
     * it closes the connection there (on_close with KVF_ERR_PROTOCOL, or
     * KVF_ERR_VERSION when the frame leads with another protocol
     * version's magic and version: only those KVF_WIRE_PREFIX_LEN bytes
     * of its body are read to tell).  While limited, the connection holds
     * no receive buffer larger than the limit needs, and none of the
     * buffers that only payload needs.  A new connection has no limit:
     * set it before the first handle(). */
    void         (*limit)(kvf_conn_t *c, const kvf_rx_limit_t *lim);

    /* What the fault transport drives (optional: a backend without all
     * three cannot be wrapped by it).
     * abort: close now as a failure would, with an RST (rst=1) or a FIN
     * that cuts whatever frame is half-sent (rst=0); on_close follows with
     * `reason` (and lets the lock go where what on_close does flushes).  pause: send nothing before until_ms (kvf_now_ms);
     * receiving goes on.  truncate: send only the header of the next DATA
     * frame (or of the one being sent), then close with a FIN; on_close
     * follows with `reason`. */
    void         (*abort)(kvf_conn_t *c, int rst, const char *reason);
    void         (*pause)(kvf_conn_t *c, uint64_t until_ms);
    void         (*truncate)(kvf_conn_t *c, const char *reason);
};

/* The backends built in. */
extern const kvf_transport_ops_t kvf_tcp_ops;

/*
 * Faults an engine injects (docs/FAILURES.md, KVF_FAULTS): opaque to
 * core, which parses a spec once per engine and hands the result to every
 * connection and endpoint it opens (mover.h, kvf_control_connect and
 * friends); the transport layer wraps them with the fault transport.  The
 * faults are per engine: `kvf_faults_t` counts payload bytes over all its
 * connections.
 *
 * kvf_transport_faults_parse: @return KVF_OK; KVF_ERR_INVALID_PARAM or
 * KVF_ERR_NO_MEMORY, with why in err.
 * kvf_transport_faults_free: NULL is a no-op.
 */
typedef struct kvf_faults kvf_faults_t;
kvf_status_t kvf_transport_faults_parse(const char *spec, kvf_faults_t **faults_p,
                                        char *err, size_t errlen);
void         kvf_transport_faults_free(kvf_faults_t *faults);

#endif /* KVF_TRANSPORT_TRANSPORT_H */
