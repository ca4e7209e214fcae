/*
 * The TCP transport: one non-blocking stream per peer pair that carries the
 * control messages and the payload, framed as in docs/PROTOCOL.md.
 *
 * Writing: control messages go to a byte queue; puts (transport.h) are
 * turned into DATA frames one at a time, each frame a single writev() of
 * [header+segment table][payload pieces straight from registered memory]:
 * no copy, no syscall per page.  Control messages are sent only between
 * frames, so a DONE queued after a put completed always follows its data.
 *
 * Reading: headers and bodies accumulate in a receive buffer; a DATA
 * frame's payload is scattered into the targets the engine resolved for
 * its segments with readv() straight into destination memory (up to 1024
 * targets per call); only bytes that arrived together with a header are
 * copied out of the buffer.
 *
 * Threads: everything here runs on the engine's progress thread, under the
 * engine lock; callbacks are made the same way and may queue messages on
 * any connection, but must not destroy one (shutdown marks it dead).
 * The ops are in transport.h (kvf_tcp_ops).
 */
#ifndef KVF_TRANSPORT_TCP_H
#define KVF_TRANSPORT_TCP_H

#include <stddef.h>
#include <stdint.h>

#include "transport/transport.h"
#include "wire/wire.h"

typedef struct kvf_tcp_conn kvf_tcp_conn_t;

/* Listen on host:port (0 = any).  @return KVF_OK or KVF_ERR_IO. */
kvf_status_t kvf_tcp_listen(const char *host, int port, int *fd_p, int *port_p);

#endif /* KVF_TRANSPORT_TCP_H */
