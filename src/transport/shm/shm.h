/*
 * The shm transport: same-host payload by cross-memory attach.
 *
 * The receiver pulls: for each DATA_REF segment it has already checked
 * against the pages its room declared, it reads the bytes straight from
 * the sender's registered memory into its own (process_vm_readv: one copy,
 * no socket, no shared mapping to set up).  Because the receiver does the
 * writing, the guarantee "nothing lands outside what the room declared" is
 * enforced exactly as for TCP, whatever the sender claims.
 *
 * A prefill engine offers shm in its XPORT message (its pid, the host's
 * boot id, and one address to probe); a decode engine on the same host
 * probes one read and, if the kernel allows it, answers "shm".  Reading
 * another process's memory needs ptrace permission: same user and, under
 * Yama's ptrace_scope 1, the target's consent, which a prefill engine that
 * offers shm gives with prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY).
 */
#ifndef KVF_TRANSPORT_SHM_H
#define KVF_TRANSPORT_SHM_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>
#include <sys/uio.h>

#include "kvferry/status.h"
#include "util/buf.h"

/* Prefill: allow same-user processes to read our memory (Yama). */
void         kvf_shm_allow_readers(void);

/* Prefill: the offer blob (pid, boot id, probe address). */
kvf_status_t kvf_shm_pack(const void *probe, kvf_buf_t *out);

/*
 * Decode: can we pull from the engine that made this offer?  Checks the
 * host (boot id) and reads 1 byte at its probe address.
 * @return KVF_OK and its pid, or KVF_ERR_UNSUPPORTED with why in err.
 */
kvf_status_t kvf_shm_accept(const uint8_t *blob, size_t len, pid_t *pid_p,
                            char *err, size_t errlen);

/*
 * Read remote[i] (in process pid) into local[i], n pieces of equal
 * lengths pairwise, all of it or an error.  @return KVF_OK or
 * KVF_ERR_CONN_RESET (the process is gone, or the memory is no longer
 * mapped) with why in err.
 */
kvf_status_t kvf_shm_read(pid_t pid, struct iovec *local, struct iovec *remote,
                          size_t n, char *err, size_t errlen);

#endif /* KVF_TRANSPORT_SHM_H */
