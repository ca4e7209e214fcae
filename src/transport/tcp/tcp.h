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
 * its segments, with recv() straight into destination memory for large
 * pieces and memcpy() from the buffer for small ones.
 *
 * Threads: everything here runs on the engine's progress thread, under the
 * engine lock; callbacks are made the same way and may queue messages on
 * any connection, but must not destroy one (kvf_tcp_conn_shutdown marks it).
 */
#ifndef KVF_TRANSPORT_TCP_H
#define KVF_TRANSPORT_TCP_H

#include <stddef.h>
#include <stdint.h>

#include "transport/transport.h"
#include "wire/wire.h"

typedef struct kvf_tcp_conn kvf_tcp_conn_t;

typedef struct kvf_tcp_handler {
    /* An outbound connect finished (the stream is writable). */
    void (*on_connected)(void *arg);
    /* A decoded control message (every type but DATA). */
    void (*on_msg)(void *arg, const kvf_msg_t *msg);
    /* A DATA frame arrived: fill targets[0..d->nseg-1] (dst NULL: discard). */
    void (*on_data)(void *arg, const kvf_msg_data_t *d, kvf_rx_target_t *targets);
    /* Before more payload of the current frame is placed: 0 = discard the
     * rest (its room went away meanwhile). */
    int  (*rx_valid)(void *arg);
    /* Payload bytes were placed at p (for checksums).  May be NULL. */
    void (*on_placed)(void *arg, const uint8_t *p, size_t n);
    /* The current DATA frame's payload has been read completely. */
    void (*on_data_end)(void *arg, uint64_t placed);
    /* The stream failed or the peer closed it.  Called once; the conn is
     * shut down afterwards and only kvf_tcp_conn_destroy may follow. */
    void (*on_close)(void *arg, kvf_status_t status, const char *reason);
} kvf_tcp_handler_t;

/* Listen on host:port (0 = any).  @return KVF_OK or KVF_ERR_IO. */
kvf_status_t kvf_tcp_listen(const char *host, int port, int *fd_p, int *port_p);

/* Start a non-blocking connect; on_connected or on_close follows. */
kvf_status_t kvf_tcp_connect(const char *host, int port, int epfd, void *ep_data,
                             const kvf_tcp_handler_t *h, void *arg,
                             kvf_tcp_conn_t **conn_p);

/* Wrap an accepted socket. */
kvf_status_t kvf_tcp_accept(int fd, int epfd, void *ep_data,
                            const kvf_tcp_handler_t *h, void *arg,
                            kvf_tcp_conn_t **conn_p);

/* Handle epoll events for the conn. */
void kvf_tcp_conn_handle(kvf_tcp_conn_t *c, uint32_t events);

/* Queue a control message.  @return KVF_OK, KVF_ERR_CONN_RESET (shut down),
 * KVF_ERR_NO_MEMORY, KVF_ERR_INVALID_PARAM (message over limits). */
kvf_status_t kvf_tcp_send_msg(kvf_tcp_conn_t *c, const kvf_msg_t *msg);

/* Queue a put; it completes through put->complete (also when the conn
 * closes first, with KVF_ERR_CONN_RESET). */
void kvf_tcp_put(kvf_tcp_conn_t *c, kvf_put_t *put);

/* Write whatever is queued, as far as the socket takes it. */
void kvf_tcp_conn_flush(kvf_tcp_conn_t *c);

/* Close the socket and fail queued puts; no callback but put completions. */
void kvf_tcp_conn_shutdown(kvf_tcp_conn_t *c);
void kvf_tcp_conn_destroy(kvf_tcp_conn_t *c);

/* Milliseconds (kvf_now_ms) of the last byte received / sent. */
uint64_t kvf_tcp_conn_last_rx(const kvf_tcp_conn_t *c);
uint64_t kvf_tcp_conn_last_tx(const kvf_tcp_conn_t *c);
/* 1 when nothing is queued or half-written. */
int kvf_tcp_conn_idle(const kvf_tcp_conn_t *c);

#endif /* KVF_TRANSPORT_TCP_H */
