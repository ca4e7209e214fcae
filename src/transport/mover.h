/*
 * Movers: the backends that carry payload beside the control connection.
 *
 * Every pair of engines has one control connection (kvf_conn_t, tcp.h),
 * and payload rides in it unless the pair agrees on a mover at the
 * handshake.  A mover is what UCX calls a transport resource: an engine
 * creates each mover its configuration allows once its memory is
 * registered, a prefill engine offers every mover it has (an XPORT entry
 * per mover, with the mover's blob), and a decode engine accepts the first
 * offer that works here, in table order (accepting an offer is the
 * reachability test).
 *
 * Core never names a backend, the fault transport included: it walks
 * kvf_movers[], decides from each mover's `caps` (KVF_MOVER_CAP_*: does
 * it pull, which memory kinds, may a failed read close the endpoint)
 * rather than from its name, and opens connections and endpoints through
 * kvf_control_connect / kvf_control_accept / kvf_mover_connect (open.c),
 * which wrap them with the fault transport when the engine has faults.
 *
 * The movers built in pull: the decode side reads each DATA_REF segment,
 * already checked against the pages its room declared, from the sender's
 * memory into its own.  Whatever the sender names, nothing lands outside
 * what the receiver chose, and a read names nothing outside what the
 * sender registered (both are checked before a byte moves).
 *
 * Reads are asynchronous: `read` starts a batch and its completion comes
 * back through `progress`, which the engine calls when the mover's fd is
 * readable (or every loop pass without an fd).  A mover that copies may
 * do so on its own thread, never under the engine lock.
 *
 * Threads: every op runs on the engine's progress thread under the engine
 * lock, except `disconnect`, which may also run on an application thread
 * under the lock (a receiver destroyed there drops the last reference to
 * its peer); no op waits on a peer.
 *
 * Adding a mover: a folder under src/transport, an ops table with its
 * caps, a CMake option, and one line in movers.c.
 */
#ifndef KVF_TRANSPORT_MOVER_H
#define KVF_TRANSPORT_MOVER_H

#include <stddef.h>
#include <stdint.h>
#include <sys/uio.h>

#include "kvferry/kvferry.h"
#include "transport/transport.h"
#include "util/buf.h"

typedef struct kvf_mover_ops kvf_mover_ops_t;

/*
 * A read in flight: the caller's record (core embeds it in its own), which
 * the mover hands back through `done` when the read is over.  `err` says
 * why when st is not KVF_OK.  done runs on the progress thread under the
 * engine lock, inside progress(), an endpoint's tick() or disconnect(), or
 * destroy(), never inside read(); it must not call back into the mover.
 * Reads of one endpoint are handed back in the order they were started.
 */
typedef struct kvf_mover_read kvf_mover_read_t;
struct kvf_mover_read {
    void (*done)(kvf_mover_read_t *rd, kvf_status_t st, const char *err);
};

/* Every backend's engine-wide and per-peer structs start with these. */
typedef struct kvf_mover {
    const kvf_mover_ops_t *ops;
} kvf_mover_t;

typedef struct kvf_mover_ep {
    const kvf_mover_ops_t *ops;
} kvf_mover_ep_t;

/* Who an offer is for: the peer as it declared itself in its
 * authenticated handshake (AUTH, docs/PROTOCOL.md section 4). */
typedef struct kvf_mover_peer {
    uint32_t pid;               /* its process id */
    uint64_t instance_id;
} kvf_mover_peer_t;

/* What a mover is created with: the engine and its registered memory. */
typedef struct kvf_mover_params {
    kvf_role_t      role;
    uint64_t        instance_id;
    void *const    *bases;      /* every registered buffer (kv, aux, state) */
    const size_t   *lens;
    size_t          n;
    kvf_mem_kind_t  mem_kind;   /* KVF_MEM_CUDA when any buffer is device memory */
    const kvf_mem_kind_t *kinds; /* each buffer's */
    int             cuda_device; /* of the KVF_MEM_CUDA ones */
    int             by_name;    /* asked for by name, not by "auto" */
} kvf_mover_params_t;

/*
 * What a mover can do (kvf_mover_ops_t.caps), the way UCX's iface flags
 * say it (UCT_IFACE_FLAG_GET_ZCOPY, ...): core decides from these bits,
 * never from a mover's name.
 */
enum {
    /* The decode side reads each DATA_REF segment from the sender's
     * memory (`read`).  Every mover built in pulls. */
    KVF_MOVER_CAP_PULL = 1u << 0,
    /* Reserved: the sender writes into the receiver's memory.  No mover
     * pushes, and core has no path for one that does (kvf_movers_check
     * refuses a mover that does not pull). */
    KVF_MOVER_CAP_PUSH = 1u << 1,
    /* The kinds of KV memory it moves (kvf_mover_params_t.mem_kind):
     * KVF_MEM_HOST, KVF_MEM_CUDA. */
    KVF_MOVER_CAP_MEM_HOST = 1u << 2,
    KVF_MOVER_CAP_MEM_DEVICE = 1u << 3,
    /* Its bytes never pass through host memory: the pair does not checksum
     * them (byte counts still hold). */
    KVF_MOVER_CAP_NO_HOST_COPY = 1u << 4,
    /* A failed read can take the endpoint down with it (every later read
     * would fail): after one, core asks `ep_failed` whether it did, and
     * fails the peer if so.  Without it a failed read is that read alone,
     * and the mover needs no `ep_failed`. */
    KVF_MOVER_CAP_READ_FAIL_CLOSES_EP = 1u << 5,
};

struct kvf_mover_ops {
    const char *name;           /* in offers, logs, metrics, `transport` */
    unsigned    caps;           /* KVF_MOVER_CAP_* */
    /* May "auto" use it?  NULL: yes.  (A mover that can bring its process
     * down when a peer dies is used only when asked for by name.) */
    int          (*auto_ok)(void);

    /* Engine-wide, after layout registration.  Never blocks.
     * @return KVF_OK, or why not in err (the engine goes on without it). */
    kvf_status_t (*create)(const kvf_mover_params_t *p, kvf_mover_t **m_p, char *err,
                           size_t errlen);
    /* Every read still in flight is done (with an error) before it
     * returns: nothing of it can land afterwards. */
    void         (*destroy)(kvf_mover_t *m);
    /* An fd to epoll for EPOLLIN, or -1: then progress runs every loop pass. */
    int          (*fd)(const kvf_mover_t *m);
    /* Serve what is pending without blocking (and call the done of the
     * reads that finished); 1 while more work is ready now. */
    int          (*progress)(kvf_mover_t *m);

    /* Prefill: append the offer blob (at most KVF_WIRE_MAX_BLOB bytes) for
     * one authenticated peer; called only once it has authenticated.  An
     * offer may hold what only that peer may use (shm: a one-time cookie
     * bound to its pid). */
    kvf_status_t (*pack)(kvf_mover_t *m, const kvf_mover_peer_t *peer, kvf_buf_t *out);
    /* Decode: accept a peer's offer (untrusted bytes) and make an endpoint;
     * never blocks.  @return KVF_OK, or why the offer is unusable in `why`. */
    kvf_status_t (*connect)(kvf_mover_t *m, const uint8_t *blob, size_t len,
                            kvf_mover_ep_t **ep_p, char *why, size_t whylen);
    /* Close and free (now, or once the backend is done with it); never
     * blocks.  Reads still in flight are stopped (forcibly: their done
     * follows from progress, with an error unless they had finished).
     * NULL is a no-op. */
    void         (*disconnect)(kvf_mover_ep_t *ep);
    /* Periodic work of an endpoint (every engine tick).  May be NULL. */
    void         (*tick)(kvf_mover_ep_t *ep);

    /*
     * Start reading remote[i] (addresses in the peer) into local[i], n
     * pieces of pairwise equal lengths, and return without waiting.  The
     * arrays and rd stay the caller's and valid until rd->done.  Within
     * timeout_ms the read finishes or the endpoint is failed.
     * @return KVF_OK: rd->done will be called exactly once (see
     *                    kvf_mover_read_t; never from read itself), once
     *                    every byte is in place or no byte of the batch
     *                    can still land;
     *   KVF_ERR_PROTOCOL  a remote piece outside every region the peer
     *                     registered: nothing was started, the endpoint is
     *                     fine, rd->done is not called;
     *   other errors      nothing was started (why in err), rd->done is not
     *                     called; without KVF_MOVER_CAP_READ_FAIL_CLOSES_EP
     *                     the endpoint is fine, with it ep_failed() says
     *                     whether the endpoint is dead.
     */
    kvf_status_t (*read)(kvf_mover_ep_t *ep, kvf_mover_read_t *rd, struct iovec *local,
                         struct iovec *remote, size_t n, unsigned timeout_ms, char *err,
                         size_t errlen);
    /* 1 when the endpoint can read nothing any more (every later read would
     * fail): its peer must be failed.  Required with
     * KVF_MOVER_CAP_READ_FAIL_CLOSES_EP, NULL without. */
    int          (*ep_failed)(const kvf_mover_ep_t *ep);
};

/* The movers built in, in the order "auto" prefers them; NULL-terminated.
 * movers.c is the only file that names them. */
extern const kvf_mover_ops_t *const kvf_movers[];
#define KVF_MAX_MOVERS 4

/* Assert, once per process, that every mover in the table has the
 * required ops (debug builds).  Engines call it before creating movers. */
void                   kvf_movers_check(void);
/* The mover called `name` (len bytes), or NULL. */
const kvf_mover_ops_t *kvf_mover_find(const char *name, size_t len);
/* Whether an engine whose `transport` setting is `transport` ("auto" or
 * one mover's name) may use `ops`. */
int                    kvf_mover_allowed(const char *transport, const kvf_mover_ops_t *ops);
/* Its index in kvf_movers[], or -1. */
int                    kvf_mover_index(const kvf_mover_ops_t *ops);

/* "tcp", "tcp+shm", ...: the payload paths in `mask` (bit 0: in the
 * control stream; bit 1+i: kvf_movers[i]).  Static storage. */
const char *kvf_movers_mask_name(unsigned mask);

/* The public path index (kvf_transport_name, peers_by_path) of payload
 * over `ops` (NULL: the control stream).  Fixed across builds, unlike
 * kvf_mover_index. */
unsigned    kvf_mover_path(const kvf_mover_ops_t *ops);

/* The control connection: its transport ops, its listener, and the name
 * of payload that rides in it ("tcp"). */
extern const kvf_transport_ops_t *const kvf_control_ops;
kvf_status_t kvf_control_listen(const char *host, int port, int *fd_p, int *port_p);
const char  *kvf_stream_name(void);

/*
 * Opening (open.c), with the engine's injected faults (NULL: none), which
 * the transport layer wraps around what it opens: core asks for a
 * connection or an endpoint and never names the fault transport.
 *
 * kvf_control_connect / kvf_control_accept: a control connection, as
 * kvf_control_ops->connect / ->accept make it (same contract), through
 * the fault transport when `faults` is not NULL.
 *
 * kvf_mover_connect: decode, accept a peer's offer for mover `m`, as
 * m->ops->connect (same contract); the endpoint made is wrapped with the
 * read faults (readfail, readstall) when `faults` has any, the wrapper
 * answering with the real endpoint's caps.
 */
kvf_status_t kvf_control_connect(kvf_faults_t *faults, const char *host, int port,
                                 const kvf_conn_env_t *env, const kvf_conn_handler_t *h,
                                 void *arg, kvf_conn_t **conn_p);
kvf_status_t kvf_control_accept(kvf_faults_t *faults, int fd, const kvf_conn_env_t *env,
                                const kvf_conn_handler_t *h, void *arg, kvf_conn_t **conn_p);
kvf_status_t kvf_mover_connect(kvf_faults_t *faults, kvf_mover_t *m, const uint8_t *blob,
                               size_t len, kvf_mover_ep_t **ep_p, char *why, size_t whylen);

/* What to do when device memory is registered, cannot be staged, and no
 * mover carries it: what ucx would need. */
const char *kvf_movers_device_hint(void);

#endif /* KVF_TRANSPORT_MOVER_H */
