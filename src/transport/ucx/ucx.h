/*
 * The ucx transport: cluster payload (RDMA, InfiniBand/RoCE, and whatever
 * else UCX drives: tcp, shared memory, CUDA memory) by one-sided reads.
 *
 * Same model as shm: the receiver pulls.  A prefill engine registers its
 * buffers with UCX and advertises, in its XPORT message, its worker address
 * and for every registered region (base, length, remote key).  A decode
 * engine that picks ucx connects to that worker and, for each DATA_REF
 * segment it has already checked against the pages its room declared,
 * reads the bytes with ucp_get_nbx from the prefill's memory straight into
 * its own.  Every byte that lands was asked for by the receiver, into memory
 * the receiver chose: whatever the sender claims, nothing lands elsewhere.
 * A prefill engine makes that offer only where UCX confines its holder to
 * the registered regions (RDMA; see "Remote-key bounds" below).
 *
 * Threads: the engine calls every function of one kvf_ucx_t (and of its
 * endpoints) from one thread at a time, under its own lock; the worker is
 * created UCS_THREAD_MODE_SERIALIZED for exactly that.  Reads are
 * synchronous: kvf_ucx_read progresses the worker itself until its batch
 * is done, failed or timed out.
 *
 * The side that is read from must progress too.  Only RDMA (and cma)
 * serve a get without the target's CPU; UCX emulates gets on tcp and
 * answers connection setup ("wireup") with messages that the target's
 * worker handles only when progressed.  So an engine with a kvf_ucx_t
 * watches kvf_ucx_fd() in its event loop and calls kvf_ucx_progress()
 * when it is readable (and whenever kvf_ucx_progress asked for it).
 *
 * Build: compiled only when CMake's KVF_UCX is on, which defines
 * KVF_HAVE_UCX=1.  Include this header unconditionally and test the macro:
 *
 *     #ifdef KVF_HAVE_UCX
 *         if (kvf_ucx_available()) ...
 *     #endif
 *
 * UCX reads its own settings from the environment (UCX_TLS,
 * UCX_NET_DEVICES, ...): see docs/TRANSPORTS.md.
 */
#ifndef KVF_TRANSPORT_UCX_H
#define KVF_TRANSPORT_UCX_H

#include <stddef.h>
#include <stdint.h>
#include <sys/uio.h>

#include "kvferry/kvferry.h"
#include "kvferry/status.h"
#include "transport/mover.h"
#include "util/buf.h"

#ifdef KVF_HAVE_UCX

/* The ucx mover (mover.h), over the functions below. */
extern const kvf_mover_ops_t kvf_ucx_mover;

/* Bound on waiting for UCX to complete the reads of a batch it was told
 * to stop (a failed or timed-out read force-closes its endpoint), and for
 * endpoint closes to finish at kvf_ucx_destroy. */
#define KVF_UCX_CLOSE_MS 1000u

/* Per engine: a UCP context and one worker. */
typedef struct kvf_ucx kvf_ucx_t;
/* Per peer: an endpoint to the peer's worker and its unpacked remote keys. */
typedef struct kvf_ucx_ep kvf_ucx_ep_t;

/* 1: this build has the ucx transport. */
int          kvf_ucx_available(void);

/* The UCX library's version, e.g. "1.13.1" (static). */
const char  *kvf_ucx_version(void);

/*
 * 0 with UCX before 1.14: a peer that dies while UCX is still setting up
 * its connection can trip an assertion inside UCX's tcp transport
 * (ucp_request.c, fixed upstream by openucx/ucx#8175) and abort this
 * process.  The engine then uses ucx only when asked for explicitly.
 */
int          kvf_ucx_survives_peer_death(void);

/*
 * Create the UCP context (UCP_FEATURE_RMA) and worker.  UCX takes its
 * configuration from the environment at this point (UCX_TLS, ...).
 * @return KVF_OK, or KVF_ERR_UNSUPPORTED (UCX could not start: no usable
 * transport, bad UCX_* setting) / KVF_ERR_NO_MEMORY with why in err.
 */
kvf_status_t kvf_ucx_create(kvf_ucx_t **u_p, char *err, size_t errlen);

/* Destroy the worker and context and unmap every region.  Disconnect every
 * endpoint first (one still open is force-closed, with a warning).  Waits
 * at most KVF_UCX_CLOSE_MS for closes under way to finish. */
void         kvf_ucx_destroy(kvf_ucx_t *u);

/*
 * A file descriptor that becomes readable when the worker has work
 * (epoll it with EPOLLIN), or -1 when UCX offers none here: then call
 * kvf_ucx_progress on every turn of the event loop.  Owned by u.
 */
int          kvf_ucx_fd(const kvf_ucx_t *u);

/*
 * Serve what arrived (peers' reads, connection setup, errors) without
 * blocking, then re-arm the fd.  @return 0 when the worker is idle and the
 * fd armed, 1 when work remains: call again without waiting for the fd.
 */
int          kvf_ucx_progress(kvf_ucx_t *u);

/*
 * Register [base, base+len) as memory of `kind` (KVF_MEM_HOST, or
 * KVF_MEM_CUDA where this UCX build carries CUDA memory), as a source
 * peers may read (prefill) or a destination of our reads (decode).  The
 * memory must stay valid until kvf_ucx_destroy.  Register before
 * kvf_ucx_pack: a blob lists the regions registered when it was packed.
 * @return KVF_OK, KVF_ERR_INVALID_PARAM (NULL/empty), KVF_ERR_UNSUPPORTED
 * (memory kind not supported by this UCX) or KVF_ERR_IO (ucp_mem_map
 * failed) with why in err.
 */
kvf_status_t kvf_ucx_register(kvf_ucx_t *u, void *base, size_t len, kvf_mem_kind_t kind,
                              char *err, size_t errlen);

/*
 * Append the XPORT blob (worker address, then every registered region
 * with its packed remote key; explicit little-endian, self-delimiting, at
 * most KVF_WIRE_MAX_BLOB bytes) to *out.
 * @return KVF_OK, KVF_ERR_NO_MEMORY, or KVF_ERR_UNSUPPORTED when it would
 * exceed KVF_WIRE_MAX_BLOB (logged: too many regions).
 */
kvf_status_t kvf_ucx_pack(kvf_ucx_t *u, kvf_buf_t *out);

/*
 * Parse a peer's blob (untrusted: every length is checked) and create an
 * endpoint to its worker with peer-failure error handling, unpacking one
 * remote key per region.  Does not wait for the connection: a peer that
 * cannot be reached shows up as an error of the first read.
 * @return KVF_OK and *ep_p, KVF_ERR_PROTOCOL (malformed blob),
 * KVF_ERR_UNREACHABLE (no UCX transport reaches that worker, or a remote
 * key cannot be unpacked with our transports) or KVF_ERR_NO_MEMORY, with
 * why in err.
 */
kvf_status_t kvf_ucx_connect(kvf_ucx_t *u, const uint8_t *blob, size_t len,
                             kvf_ucx_ep_t **ep_p, char *err, size_t errlen);

/* Close the endpoint (force-close when it failed); never waits.  The
 * handle is invalid afterwards; its memory is freed once UCX has finished
 * the close (by kvf_ucx_progress, or at the latest kvf_ucx_destroy). */
void         kvf_ucx_disconnect(kvf_ucx_ep_t *ep);

/*
 * Start reading remote[i] (addresses in the peer's process) into local[i],
 * n pieces of pairwise equal lengths, without waiting.  Every remote piece
 * must lie inside one region the peer registered, every local piece inside
 * one region registered on our kvf_ucx_t.  All gets are issued at once;
 * kvf_ucx_progress hands the batch back through rd->done, in the order the
 * reads were started: KVF_OK with every byte in local memory, or an error,
 * after which no byte of the batch can land.
 *
 * A batch not finished within timeout_ms is stopped at the next
 * kvf_ucx_tick by force-closing the endpoint, the only way UCX stops an
 * outstanding get: its done follows with KVF_ERR_PEER_TIMEOUT.  A failed
 * request fails the endpoint the same way (KVF_ERR_CONN_RESET, with UCX's
 * status text).  A failed endpoint stays failed: every later read fails at
 * once, and the caller disconnects it.
 *
 * @return KVF_OK (started; rd->done follows);
 *   KVF_ERR_PROTOCOL      a remote piece outside every region of the peer;
 *   KVF_ERR_INVALID_PARAM a local piece outside our registered memory, or
 *                         lengths that differ;
 *   KVF_ERR_CONN_RESET / KVF_ERR_PEER_TIMEOUT  the endpoint has failed;
 *   KVF_ERR_NO_MEMORY.
 *   On every error nothing was started and rd->done is not called.
 */
kvf_status_t kvf_ucx_read(kvf_ucx_ep_t *ep, kvf_mover_read_t *rd, struct iovec *local,
                          struct iovec *remote, size_t n, unsigned timeout_ms, char *err,
                          size_t errlen);

/* Stop the endpoint's oldest read if its deadline passed (every tick). */
void         kvf_ucx_tick(kvf_ucx_ep_t *ep);

/*
 * Remote-key bounds (bounds.c).  A peer that holds a prefill engine's
 * offer reaches its memory through whichever transport UCX uses, and only
 * RDMA confines it to the registered regions: over tcp or shared memory
 * UCX serves any address.  So a prefill engine's ucx mover starts only
 * where UCX enforces the bounds on every transport a peer can reach it
 * over (or KVF_UCX_SOFTWARE_RMA=allow says to go on anyway); the decode
 * side of a pair whose prefill did not offer ucx uses tcp.
 */

/* One transport UCX selected for a context, and what UCX reports of it. */
typedef struct kvf_ucx_tl {
    char     tl[16], dev[40];   /* "rc_mlx5", "mlx5_0:1"; "tcp", "lo" */
    int      md_index;          /* its memory domain in the context */
    int      dev_type;          /* uct_device_type_t (UCT_DEVICE_TYPE_NET, _SHM, _ACC,
                                 * _SELF); -1: UCT did not say */
    int      aux;               /* UCX uses it only to set up connections */
    uint64_t md_flags;          /* UCT_MD_FLAG_* of its memory domain */
    size_t   rkey_size;         /* that domain's packed remote key, bytes */
    uint64_t iface_flags;       /* UCT_IFACE_FLAG_* (network transports; else 0) */
} kvf_ucx_tl_t;

#define KVF_UCX_MAX_TLS 32

/*
 * The transports UCX selected for u (as ucp_context_print_info lists
 * them), each with its device type, memory domain flags and key size, and
 * for network transports the interface's capability flags (UCT opens each
 * one, as `ucx_info -d` does).  At most max.
 * @return KVF_OK and *n_p, or KVF_ERR_UNSUPPORTED / KVF_ERR_NO_MEMORY with
 * why in err.
 */
kvf_status_t kvf_ucx_transports(const kvf_ucx_t *u, kvf_ucx_tl_t *tls, size_t max,
                                size_t *n_p, char *err, size_t errlen);

/*
 * 1 when every transport in tls that a peer can reach (all but self and
 * accelerator copies) is a network transport that reads remote memory in
 * hardware (or only sets up connections) with a memory domain whose
 * non-empty remote key the hardware checks, and there is at least one.
 * Otherwise 0, and why lists the others ("tcp/eth0, tcp/lo").
 */
int          kvf_ucx_bounds_enforced(const kvf_ucx_tl_t *tls, size_t n, char *why,
                                     size_t whylen);

/* 1 when KVF_UCX_SOFTWARE_RMA=allow: offer ucx over transports that do not
 * enforce the bounds (a value other than "allow" is warned about and
 * ignored). */
int          kvf_ucx_software_rma_allowed(void);

#endif /* KVF_HAVE_UCX */

#endif /* KVF_TRANSPORT_UCX_H */
