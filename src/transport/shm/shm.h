/*
 * The shm transport: same-host payload, pulled by the receiver.
 *
 * The receiver reads each DATA_REF segment, already checked against the
 * pages its room declared, straight from the sender's memory into its own.
 * Because the receiver does the writing, "nothing lands outside what the
 * room declared" holds exactly as for TCP, whatever the sender claims.
 *
 * Two ways to read, fastest first:
 *   - Shared mappings.  Memory allocated with kvf_mem_alloc() is a memfd
 *     (util/memfd.h); a prefill engine hands a decode engine, over a unix
 *     socket (SCM_RIGHTS), the memfd of every such allocation its
 *     registered buffers cover whole, which the decode engine maps
 *     read-only: a read is then one memcpy.  A peer can map all of a
 *     memfd it holds, so an allocation registered only in part is never
 *     handed out: it is read the other way.
 *   - Cross-memory attach.  Any other memory is read with
 *     process_vm_readv(): one copy too, but the kernel pins pages as it
 *     goes, which costs about half of memcpy's bandwidth.
 *
 * A prefill engine offers shm in its XPORT message (pid, boot id, a probe
 * address, the unix socket's name, a one-time cookie), only to a peer that
 * authenticated; a decode engine on the same host
 * probes one read and, if the kernel allows it, answers "shm".  Reading
 * another process's memory needs ptrace permission: same user and, under
 * Yama's ptrace_scope 1, the target's consent, which a prefill engine that
 * offers shm gives with prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY).
 *
 * The memfds go only to the authenticated peer, and only read-only: the
 * handout socket answers a connection whose first bytes are a cookie this
 * engine put in an offer, unused, and whose SO_PEERCRED pid is the one
 * that peer declared in its AUTH; the memfds are sealed against writes
 * (F_SEAL_FUTURE_WRITE, SHRINK, GROW) and handed out as read-only file
 * descriptions (docs/SECURITY.md).
 */
#ifndef KVF_TRANSPORT_SHM_H
#define KVF_TRANSPORT_SHM_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>
#include <sys/uio.h>

#include "kvferry/status.h"
#include "transport/mover.h"
#include "util/buf.h"

/* The shm mover (mover.h), over the functions below. */
extern const kvf_mover_ops_t kvf_shm_mover;

typedef struct kvf_shm_peer kvf_shm_peer_t;

/* Prefill: allow same-user processes to read our memory (Yama). */
void         kvf_shm_allow_readers(void);

/*
 * Prefill: a non-blocking unix socket, in the abstract namespace, on which
 * decode engines fetch the memfds of the buffers [bases[i], +lens[i]).
 * @return KVF_OK with the socket in *fd_p, or KVF_ERR_IO.
 */
kvf_status_t kvf_shm_listen(uint64_t instance, int *fd_p);

/* The offer blob's layout (docs/PROTOCOL.md, XPORT). */
#define KVF_SHM_COOKIE_LEN     32
#define KVF_SHM_OFF_NAME       (4 + 36 + 8)
#define KVF_SHM_OFF_COOKIE     (KVF_SHM_OFF_NAME + 48)
#define KVF_SHM_OFF_NREGIONS   (KVF_SHM_OFF_COOKIE + KVF_SHM_COOKIE_LEN)

/* Prefill: the offer blob (pid, boot id, a probe address, the socket name,
 * the cookie that fetches the memfds, and the n registered buffers
 * [bases[i], +lens[i]), the only memory a decode engine reads: it refuses
 * any source outside them).
 * @return KVF_OK, KVF_ERR_NO_MEMORY, or KVF_ERR_UNSUPPORTED (no boot id,
 * no buffers). */
kvf_status_t kvf_shm_pack(void *const *bases, const size_t *lens, size_t n,
                          uint64_t instance, const uint8_t cookie[KVF_SHM_COOKIE_LEN],
                          kvf_buf_t *out);

/*
 * Decode: can we read from the engine that made this offer?  Checks the
 * host (boot id) and reads 1 byte at its probe address; never blocks.  It
 * also asks for the memfds of the buffers, and maps them when they arrive
 * (kvf_shm_peer_progress); reads go through process_vm_readv until then.
 * @return KVF_OK and a peer handle, or KVF_ERR_UNSUPPORTED with why in err.
 */
kvf_status_t kvf_shm_accept(const uint8_t *blob, size_t len, kvf_shm_peer_t **peer_p,
                            char *err, size_t errlen);
void         kvf_shm_peer_free(kvf_shm_peer_t *peer);
/* Pick up the memfds if they have arrived (or give up on them after 1 s).
 * Never blocks; call it periodically.  NULL is a no-op. */
void         kvf_shm_peer_progress(kvf_shm_peer_t *peer);
pid_t        kvf_shm_peer_pid(const kvf_shm_peer_t *peer);
/* How many of the peer's regions are mapped (for logs and tests). */
size_t       kvf_shm_peer_mapped(const kvf_shm_peer_t *peer);

#endif /* KVF_TRANSPORT_SHM_H */
