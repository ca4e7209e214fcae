/*
 * The fault transport's entry points (fault.c).  Only transport/open.c
 * calls them: it wraps a connection or an endpoint as it opens, so that
 * core asks for a connection and gets the faults with it.
 */
#ifndef KVF_TRANSPORT_FAULT_H
#define KVF_TRANSPORT_FAULT_H

#include "transport/mover.h"
#include "transport/transport.h"

/* The faults of a spec string (KVF_FAULTS; its grammar heads fault.c).
 * @return KVF_OK; KVF_ERR_INVALID_PARAM or KVF_ERR_NO_MEMORY,
 * with why in err (what was malformed, or what ran out). */
kvf_status_t kvf_fault_parse(const char *spec, kvf_faults_t **faults_p, char *err,
                             size_t errlen);
void         kvf_fault_free(kvf_faults_t *faults);

/* Connect / accept like inner->connect / inner->accept, through the
 * faults: the fault layer sees the connection's events before `h`.
 * KVF_ERR_UNSUPPORTED when `inner` lacks the ops the faults drive. */
kvf_status_t kvf_fault_connect(kvf_faults_t *faults, const kvf_transport_ops_t *inner,
                               const char *host, int port, const kvf_conn_env_t *env,
                               const kvf_conn_handler_t *h, void *arg,
                               kvf_conn_t **conn_p);
kvf_status_t kvf_fault_accept(kvf_faults_t *faults, const kvf_transport_ops_t *inner,
                              int fd, const kvf_conn_env_t *env,
                              const kvf_conn_handler_t *h, void *arg,
                              kvf_conn_t **conn_p);

/*
 * The fault mover: wraps a decode endpoint `*ep_p` (of any mover) with the
 * engine's read faults, replacing *ep_p by the wrapper, which owns the
 * inner endpoint and answers with its caps; no-op when the spec has none.
 *   readfail@BYTES       the read during which this engine's pulled bytes
 *                        pass BYTES is handed back failed (its bytes may
 *                        have landed; the endpoint stays usable)
 *   readstall@BYTES:MS   that read is handed back MS late, and every read
 *                        of the endpoint after it waits behind it
 */
void kvf_fault_wrap_ep(kvf_faults_t *faults, kvf_mover_ep_t **ep_p);

#endif /* KVF_TRANSPORT_FAULT_H */
