/*
 * Inside the ucx transport: the part of bounds.c that needs UCP's types
 * (ucx.c calls it with its context).  Everything else is in ucx.h.
 */
#ifndef KVF_TRANSPORT_UCX_BOUNDS_H
#define KVF_TRANSPORT_UCX_BOUNDS_H

#include <ucp/api/ucp.h>

#include "transport/ucx/ucx.h"

/* The transports UCX selected for ctx and what UCT reports about each (see
 * kvf_ucx_transports). */
kvf_status_t kvf__ucx_list_tls(ucp_context_h ctx, kvf_ucx_tl_t *tls, size_t max,
                               size_t *n_p, char *err, size_t errlen);

/* KVF_OK when an engine with this context may offer ucx to its peers:
 * UCX enforces remote-key bounds on every transport a peer can reach it
 * over, or KVF_UCX_SOFTWARE_RMA=allow (then with a warning).  Otherwise
 * KVF_ERR_UNSUPPORTED with why and what to do in err (not logged). */
kvf_status_t kvf__ucx_may_offer(ucp_context_h ctx, char *err, size_t errlen);

#endif /* KVF_TRANSPORT_UCX_BOUNDS_H */
