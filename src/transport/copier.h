/*
 * Copiers: the copy engine that moves bytes between device memory and host
 * memory on this process's own GPU, for the staged paths.
 *
 * KV in device memory cannot be written to a socket nor read from one:
 * the tcp path stages it through pinned host bounce buffers, a copy of
 * each frame's device pieces into a bounce buffer before its send
 * (prefill), out of one after its receive (decode).  A copier starts such
 * a batch and returns; the batch comes back through its done, in the
 * order batches were started, from `progress`, which the engine calls
 * when the copier's fd is readable (or every loop pass without an fd).
 * Nothing waits: the engine's loop goes on serving its sockets while the
 * copy engine of the GPU works, which is what overlaps the copy of one
 * frame with the send (or the receive) of the next.
 *
 * Threads: every op runs on the progress thread under the engine lock,
 * except create and destroy (with the layout, on the caller's thread).
 */
#ifndef KVF_TRANSPORT_COPIER_H
#define KVF_TRANSPORT_COPIER_H

#include <stddef.h>
#include <sys/uio.h>

#include "kvferry/status.h"
#include "transport/mover.h"

/* A batch in flight, handed back like a mover read (mover.h): done runs
 * once, from progress() or destroy(), never from copy(). */
typedef kvf_mover_read_t kvf_copy_t;

typedef struct kvf_copier kvf_copier_t;

typedef struct kvf_copier_ops {
    const char *name;
    /* A copy engine on CUDA device `device`.  Never blocks on a peer.
     * @return KVF_OK, or why not in err (KVF_ERR_UNSUPPORTED: no driver or
     * device). */
    kvf_status_t (*create)(int device, kvf_copier_t **c_p, char *err, size_t errlen);
    /* Wait for the batches in flight (device-local copies: bounded) and
     * hand each back before returning. */
    void         (*drain)(kvf_copier_t *c);
    /* Free it; nothing may be in flight (drain first).  Pinned memory from
     * host_alloc must be freed before. */
    void         (*destroy)(kvf_copier_t *c);
    /* An fd that turns readable when a batch may have finished, or -1. */
    int          (*fd)(const kvf_copier_t *c);
    /* Hand back the batches that finished; 1 while more are in flight. */
    int          (*progress)(kvf_copier_t *c);
    /*
     * Start copying src[i] into dst[i] (equal lengths), n pieces, any mix
     * of device and host memory on either side.  The arrays need not
     * outlive the call; the memory they name must stay until cp->done.
     * @return KVF_OK: cp->done follows once every byte is in place, or with
     *         an error once none of the batch can still move;
     *         otherwise nothing was started (why in err), no done.
     */
    kvf_status_t (*copy)(kvf_copier_t *c, kvf_copy_t *cp, const struct iovec *dst,
                         const struct iovec *src, size_t n, char *err, size_t errlen);
    /* Pinned host memory for bounce buffers (NULL: none), and its free. */
    void        *(*host_alloc)(kvf_copier_t *c, size_t len);
    void         (*host_free)(kvf_copier_t *c, void *p);
} kvf_copier_ops_t;

/* The copier of this build (transport/cuda), or NULL: built without CUDA. */
extern const kvf_copier_ops_t *const kvf_copier_ops;

#endif /* KVF_TRANSPORT_COPIER_H */
