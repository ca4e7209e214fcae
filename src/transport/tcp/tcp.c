/*
 * TCP transport: framing, scatter-gather writes, scatter reads.  See tcp.h.
 *
 * The one idea: the stream is strictly ordered, so "data placed before
 * DONE is processed" needs no acknowledgement per write: the writer only
 * has to put DONE after the last payload byte, and the reader only has to
 * place every payload byte before it parses the next header.
 *
 * A connection costs what its peer may send: the receive buffer and the
 * DATA frame tables are allocated on first use, and while a receive
 * limit is set (an unauthenticated peer) every header is checked against
 * it before its body is read, so the buffer never outgrows the limit.
 */
#include "transport/tcp/tcp.h"

#include <arpa/inet.h>
#include <errno.h>
#include <stdarg.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#include "util/log.h"
#include "util/time.h"

#define TCP_FRAME_SEGS    1023              /* segments per DATA frame */
#define TCP_FRAME_PIECES  KVF_WIRE_MAX_PIECES  /* pieces (strided segments) per frame */
#define TCP_FRAME_BYTES   (4u << 20)        /* payload per DATA frame */
#define TCP_IOV_MAX       1024              /* iovecs per sendmsg (Linux UIO_MAXIOV) */
#define TCP_RX_BUF        (256u << 10)
#define TCP_RX_IOV        1024              /* targets per readv() */
#define TCP_PASS_BYTES    (1u << 20)        /* bytes one event moves, per
                                               connection and direction: a
                                               pass stays bounded */
#define TCP_PASS_MSGS     64                /* fairness: messages per event */
#define TCP_PASS_REFS     TCP_FRAME_BYTES   /* bytes of DATA_REFs whose reads
                                               one event starts: one frame's
                                               worth, then the other
                                               connections' turn */
#define TCP_SOCKBUF       (4 << 20)

/* RX_REFUSE: a header beyond the limit was read; its first bytes may
 * still say that the peer speaks another protocol version. */
enum { RX_HDR, RX_BODY, RX_PAYLOAD, RX_REFUSE };

/* The current outbound DATA frame's segment table: only a connection that
 * sends payload allocates it (tcp_txf). */
typedef struct tcp_txf {
    kvf_wire_seg_t segs[TCP_FRAME_SEGS];
    uint64_t       addrs[TCP_FRAME_SEGS];  /* DATA_REF sources */
} tcp_txf_t;

struct kvf_tcp_conn {
    kvf_conn_t               base;          /* ops: first member */
    int                      fd;
    int                      epfd;
    void                    *ep_data;
    void                   (*unlock)(void *);
    void                   (*lock)(void *);
    void                    *lock_arg;
    uint32_t                 ep_events;
    const kvf_conn_handler_t *h;
    void                    *arg;
    int                      connecting;
    int                      closing;       /* in on_close: queue nothing */
    int                      backlog;       /* parsing stopped with frames left */
    int                      tx_cut;        /* a truncate fault cut the stream:
                                               nothing more is written */
    int                      tx_err;        /* errno of a failed write: nothing
                                               more is written, and the
                                               connection fails once its
                                               input is read to the end */
    int                      held;          /* the handler is not ready for more */
    int                      frame_zeroed;  /* the frame's rest comes from zeros */
    int                      dead;
    uint64_t                 last_rx_ms;
    uint64_t                 last_tx_ms;
    uint64_t                 paused_until_ms;  /* 0: not paused */
    uint64_t                 moved;         /* counts every step of progress:
                                               bytes read or written, a
                                               frame parsed */
    uint32_t                 idle_events;   /* handle() calls in a row that
                                               moved nothing, */
    uint64_t                 idle_since_ms; /* since then */
    char                    *truncate_reason;  /* cut the next frame (faults) */

    /* transmit */
    kvf_buf_t                ctrl;          /* encoded control frames */
    size_t                   ctrl_off;
    kvf_put_t               *q_head, *q_tail;
    kvf_put_t               *cur_put;       /* producing the current frame */
    int                      cur_put_ended;
    int                      cur_put_waiting;  /* its next said KVF_PUT_WAIT, frame empty */
    int                      frame_active;
    kvf_buf_t                frame;         /* current DATA header + body */
    struct iovec            *iov;           /* header, then one per piece */
    uint32_t                 iov_cap;
    int                      iov_n, iov_i;
    tcp_txf_t               *txf;           /* NULL until the first put */
    /* The pieces of the current put's last strided segment that did not
     * fit in the frame: the next frame starts with them. */
    int                      has_carry;
    kvf_wire_seg_t           carry;
    const uint8_t           *carry_src;

    /* receive */
    const kvf_rx_limit_t    *limit;         /* NULL: none */
    kvf_buf_t                rx;            /* bytes rx.data[rx_off..rx.len) unread;
                                               allocated at the first read */
    size_t                   rx_off;
    int                      rx_state;
    kvf_wire_hdr_t           hdr;
    kvf_rx_target_t         *tgt;
    uint32_t                 tgt_cap, tgt_n, tgt_i, tgt_off;
    uint64_t                 payload_left, placed;
};

static void conn_fail(kvf_tcp_conn_t *c, kvf_status_t st, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static int tcp_idle(const kvf_conn_t *base);

static int set_nonblock(int fd)
{
    int fl = fcntl(fd, F_GETFL, 0);
    return fl < 0 ? -1 : fcntl(fd, F_SETFL, fl | O_NONBLOCK);
}

static void tune_socket(int fd)
{
    int one = 1, sz = TCP_SOCKBUF;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &sz, sizeof(sz));
    setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &sz, sizeof(sz));
}

static kvf_status_t resolve(const char *host, int port, struct sockaddr_storage *ss,
                            socklen_t *len)
{
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM,
                             .ai_flags = AI_NUMERICSERV};
    struct addrinfo *res = NULL;
    char portstr[16];

    snprintf(portstr, sizeof(portstr), "%d", port);
    int rc = getaddrinfo(host, portstr, &hints, &res);
    if (rc != 0 || res == NULL) {
        kvf_error("cannot resolve %s:%d: %s", host, port, gai_strerror(rc));
        return KVF_ERR_UNREACHABLE;
    }
    memcpy(ss, res->ai_addr, res->ai_addrlen);
    *len = res->ai_addrlen;
    freeaddrinfo(res);
    return KVF_OK;
}

kvf_status_t kvf_tcp_listen(const char *host, int port, int *fd_p, int *port_p)
{
    struct sockaddr_storage ss;
    socklen_t len;
    int one = 1, fd;

    if (resolve(host, port, &ss, &len) != KVF_OK)
        return KVF_ERR_IO;
    fd = socket(ss.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) {
        kvf_error("socket: %m");
        return KVF_ERR_IO;
    }
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (bind(fd, (struct sockaddr *)&ss, len) != 0) {
        kvf_error("cannot bind control port %s:%d: %m", host, port);
        goto err;
    }
    if (listen(fd, 512) != 0) {
        kvf_error("listen on %s:%d: %m", host, port);
        goto err;
    }
    len = sizeof(ss);
    getsockname(fd, (struct sockaddr *)&ss, &len);
    *port_p = ntohs(ss.ss_family == AF_INET6
                        ? ((struct sockaddr_in6 *)&ss)->sin6_port
                        : ((struct sockaddr_in *)&ss)->sin_port);
    *fd_p = fd;
    return KVF_OK;
err:
    close(fd);
    return KVF_ERR_IO;
}

/* Around a system call: let the engine lock go, and take it back.  Only
 * this connection's thread uses it meanwhile (kvf_conn_env_t). */
static void io_begin(kvf_tcp_conn_t *c)
{
    if (c->unlock != NULL)
        c->unlock(c->lock_arg);
}

static void io_end(kvf_tcp_conn_t *c)
{
    if (c->lock != NULL)
        c->lock(c->lock_arg);
}

static void update_events(kvf_tcp_conn_t *c)
{
    /* Held: the socket is not read, so its readiness is not asked for
     * (the engine calls handle() again once the handler is ready). */
    uint32_t want = c->held ? 0 : EPOLLIN | EPOLLRDHUP;
    if (c->connecting || (!tcp_idle(&c->base) && c->tx_err == 0 &&
                          (c->paused_until_ms == 0 || kvf_now_ms() >= c->paused_until_ms)))
        want |= EPOLLOUT;
    /* Asking for nothing, epoll still reports a reset or hung-up socket
     * (EPOLLERR, EPOLLHUP), at every wait while they last: edge-triggered,
     * once.  Nothing can be done about them until the handler is ready. */
    if (!(want & (EPOLLIN | EPOLLOUT)))
        want |= EPOLLET;
    if (c->dead || want == c->ep_events)
        return;
    struct epoll_event ev = {.events = want, .data.ptr = c->ep_data};
    if (epoll_ctl(c->epfd, EPOLL_CTL_MOD, c->fd, &ev) == 0)
        c->ep_events = want;
}

static kvf_status_t conn_new(int fd, const kvf_conn_env_t *env, int connecting,
                             const kvf_conn_handler_t *h, void *arg,
                             kvf_conn_t **conn_p)
{
    kvf_tcp_conn_t *c = calloc(1, sizeof(*c));
    if (c == NULL)
        return KVF_ERR_NO_MEMORY;
    c->base.ops = &kvf_tcp_ops;
    c->fd = fd;
    c->epfd = env->epfd;
    c->ep_data = env->ep_data;
    c->unlock = env->unlock;
    c->lock = env->lock;
    c->lock_arg = env->lock_arg;
    c->h = h;
    c->arg = arg;
    c->connecting = connecting;
    c->last_rx_ms = c->last_tx_ms = kvf_now_ms();
    kvf_buf_init(&c->ctrl);
    kvf_buf_init(&c->frame);
    kvf_buf_init(&c->rx);
    c->ep_events = EPOLLIN | EPOLLRDHUP | (connecting ? EPOLLOUT : 0);
    struct epoll_event ev = {.events = c->ep_events, .data.ptr = c->ep_data};
    if (epoll_ctl(c->epfd, EPOLL_CTL_ADD, fd, &ev) != 0) {
        kvf_error("epoll_ctl: %m");
        free(c);
        return KVF_ERR_NO_MEMORY;
    }
    *conn_p = &c->base;
    return KVF_OK;
}

static kvf_status_t tcp_connect(const char *host, int port, const kvf_conn_env_t *env,
                                const kvf_conn_handler_t *h, void *arg,
                                kvf_conn_t **conn_p)
{
    struct sockaddr_storage ss;
    socklen_t len;
    kvf_status_t st = resolve(host, port, &ss, &len);
    if (st != KVF_OK)
        return st;
    int fd = socket(ss.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) {
        kvf_error("socket: %m");
        return KVF_ERR_IO;
    }
    tune_socket(fd);
    if (connect(fd, (struct sockaddr *)&ss, len) != 0 && errno != EINPROGRESS) {
        kvf_warn("connect to %s:%d: %m", host, port);
        close(fd);
        return KVF_ERR_UNREACHABLE;
    }
    st = conn_new(fd, env, 1, h, arg, conn_p);
    if (st != KVF_OK)
        close(fd);
    return st;
}

static kvf_status_t tcp_rebind(kvf_conn_t *base, const kvf_conn_env_t *env)
{
    kvf_tcp_conn_t *c = (kvf_tcp_conn_t *)base;
    struct epoll_event ev = {.events = c->ep_events, .data.ptr = env->ep_data};
    if (c->dead || epoll_ctl(env->epfd, EPOLL_CTL_ADD, c->fd, &ev) != 0)
        return KVF_ERR_IO;
    epoll_ctl(c->epfd, EPOLL_CTL_DEL, c->fd, NULL);
    c->epfd = env->epfd;
    c->ep_data = env->ep_data;
    return KVF_OK;
}

static kvf_status_t tcp_accept(int fd, const kvf_conn_env_t *env,
                               const kvf_conn_handler_t *h, void *arg,
                               kvf_conn_t **conn_p)
{
    if (set_nonblock(fd) != 0)
        return KVF_ERR_IO;
    tune_socket(fd);
    return conn_new(fd, env, 0, h, arg, conn_p);
}

static int tcp_idle(const kvf_conn_t *base)
{
    const kvf_tcp_conn_t *c = (const kvf_tcp_conn_t *)base;
    return !c->frame_active && c->ctrl_off == c->ctrl.len &&
           c->cur_put == NULL && c->q_head == NULL;
}

static uint64_t tcp_last_rx(const kvf_conn_t *c)
{
    return ((const kvf_tcp_conn_t *)c)->last_rx_ms;
}

static uint64_t tcp_last_tx(const kvf_conn_t *c)
{
    return ((const kvf_tcp_conn_t *)c)->last_tx_ms;
}

static int tcp_pending(const kvf_conn_t *c)
{
    const kvf_tcp_conn_t *t = (const kvf_tcp_conn_t *)c;
    return !t->dead && t->backlog;
}

/* Complete every queued put with `st` (the stream is gone). */
static void fail_puts(kvf_tcp_conn_t *c, kvf_status_t st)
{
    kvf_put_t *p = c->cur_put;
    c->cur_put = NULL;
    c->frame_active = 0;
    c->has_carry = 0;
    if (p != NULL)
        p->complete(p, st);
    while ((p = c->q_head) != NULL) {
        c->q_head = p->qnext;
        p->complete(p, st);
    }
    c->q_tail = NULL;
}

static void tcp_shutdown(kvf_conn_t *base)
{
    kvf_tcp_conn_t *c = (kvf_tcp_conn_t *)base;
    if (c->dead)
        return;
    c->dead = 1;
    epoll_ctl(c->epfd, EPOLL_CTL_DEL, c->fd, NULL);
    close(c->fd);
    c->fd = -1;
    fail_puts(c, KVF_ERR_CONN_RESET);
}

static void tcp_destroy(kvf_conn_t *base)
{
    kvf_tcp_conn_t *c = (kvf_tcp_conn_t *)base;
    if (c == NULL)
        return;
    tcp_shutdown(base);
    kvf_buf_free(&c->ctrl);
    kvf_buf_free(&c->frame);
    kvf_buf_free(&c->rx);
    free(c->tgt);
    free(c->iov);
    free(c->txf);
    free(c->truncate_reason);
    free(c);
}

static void conn_fail(kvf_tcp_conn_t *c, kvf_status_t st, const char *fmt, ...)
{
    char reason[512];
    va_list ap;

    if (c->dead || c->closing)
        return;
    va_start(ap, fmt);
    vsnprintf(reason, sizeof(reason), fmt, ap);
    va_end(ap);
    /* The handler learns why before the puts complete with a bare
     * KVF_ERR_CONN_RESET, so the root cause is what rooms record. */
    c->closing = 1;
    c->h->on_close(c->arg, st, reason);
    tcp_shutdown(&c->base);
}

static kvf_status_t tcp_send_msg(kvf_conn_t *base, const kvf_msg_t *msg)
{
    kvf_tcp_conn_t *c = (kvf_tcp_conn_t *)base;
    if (c->dead || c->closing)
        return KVF_ERR_CONN_RESET;
    if (c->ctrl_off == c->ctrl.len)
        c->ctrl.len = c->ctrl_off = 0;
    return kvf_wire_encode(&c->ctrl, msg);
}

static void tcp_put(kvf_conn_t *base, kvf_put_t *put)
{
    kvf_tcp_conn_t *c = (kvf_tcp_conn_t *)base;
    if (c->dead || c->closing) {
        put->complete(put, KVF_ERR_CONN_RESET);
        return;
    }
    put->qnext = NULL;
    if (c->q_tail)
        c->q_tail->qnext = put;
    else
        c->q_head = put;
    c->q_tail = put;
}

/* Room for `n` iovecs (the header's and one per piece). */
static int reserve_iov(kvf_tcp_conn_t *c, uint32_t n)
{
    if (n <= c->iov_cap)
        return 1;
    uint32_t cap = n <= TCP_FRAME_SEGS + 1 ? TCP_FRAME_SEGS + 1 : TCP_FRAME_PIECES + 1;
    struct iovec *v = realloc(c->iov, cap * sizeof(*v));
    if (v == NULL)
        return 0;
    c->iov = v;
    c->iov_cap = cap;
    return 1;
}

/*
 * The next segment of the current put: the carried rest of the last one,
 * or a new one.  @return as put->next.
 */
static int next_seg(kvf_tcp_conn_t *c, kvf_wire_seg_t *seg, const uint8_t **src)
{
    if (c->has_carry) {
        c->has_carry = 0;
        *seg = c->carry;
        *src = c->carry_src;
        return 1;
    }
    const void *s;
    int rc = c->cur_put->next(c->cur_put, seg, &s);
    *src = s;
    return rc;
}

/* What a DATA frame being built holds so far. */
typedef struct tcp_fill {
    uint64_t payload;
    uint32_t n, pieces;     /* segments in the table, pieces in them */
    uint8_t  strided;
} tcp_fill_t;

/* A strided segment that would cross the frame's byte or piece limit is
 * cut there, and its other pieces become the carry that starts the next
 * frame.  @return the pieces that stay in this frame. */
static uint32_t cut_strided(kvf_tcp_conn_t *c, kvf_wire_seg_t *s,
                            const uint8_t *src, const tcp_fill_t *f)
{
    uint32_t cnt = kvf_wire_seg_pieces(s);
    uint64_t fit = (TCP_FRAME_BYTES - f->payload + s->len - 1) / s->len;
    if (fit > TCP_FRAME_PIECES - f->pieces)
        fit = TCP_FRAME_PIECES - f->pieces;
    if (fit < cnt) {
        c->carry = *s;
        c->carry.count = cnt - (uint32_t)fit;
        c->carry.offset += fit * s->dst_stride;
        c->carry_src = src + fit * s->src_stride;
        c->has_carry = 1;
        s->count = cnt = (uint32_t)fit;
    }
    return cnt;
}

/* Segments of the current put into the frame's table (and, sent by value,
 * their pieces into the iovecs) up to the frame's limits.  @return 0, or
 * the put's failure (negative: its room failed); *st_p becomes
 * KVF_ERR_NO_MEMORY when the iovecs cannot grow. */
static int fill_frame(kvf_tcp_conn_t *c, tcp_fill_t *f, kvf_status_t *st_p)
{
    kvf_put_t *p = c->cur_put;

    while (f->n < TCP_FRAME_SEGS && f->pieces < TCP_FRAME_PIECES &&
           f->payload < TCP_FRAME_BYTES) {
        kvf_wire_seg_t *s = &c->txf->segs[f->n];
        const uint8_t *src;
        int rc = next_seg(c, s, &src);
        if (rc < 0)
            return rc;
        if (rc == 0) {
            c->cur_put_ended = 1;
            break;
        }
        if (rc == KVF_PUT_WAIT) {
            c->cur_put_waiting = f->n == 0;   /* nothing to send: stop flushing it */
            break;
        }
        uint32_t cnt = kvf_wire_seg_pieces(s);
        if (cnt > 1) {
            cnt = cut_strided(c, s, src, f);
            f->strided = 1;
        }
        /* By reference, only the header goes: the receiver reads the rest. */
        if (!p->by_ref) {
            if (!reserve_iov(c, f->pieces + cnt + 1)) {
                *st_p = KVF_ERR_NO_MEMORY;
                break;
            }
            for (uint32_t k = 0; k < cnt; k++)
                c->iov[1 + f->pieces + k] = (struct iovec){(void *)(src + (size_t)k * s->src_stride),
                                                           s->len};
        }
        c->txf->addrs[f->n] = (uint64_t)(uintptr_t)src;
        f->payload += (uint64_t)cnt * s->len;
        f->pieces += cnt;
        f->n++;
    }
    return 0;
}

/* The frame's DATA or DATA_REF header and segment table, into c->frame. */
static kvf_status_t encode_frame(kvf_tcp_conn_t *c, const kvf_put_t *p,
                                 const tcp_fill_t *f)
{
    kvf_msg_t m = {.type = p->by_ref ? KVF_MSG_DATA_REF : KVF_MSG_DATA};
    m.u.data.room = p->room;
    m.u.data.instance = p->instance;
    m.u.data.src_rank = p->src_rank;
    m.u.data.payload_len = f->payload;
    m.u.data.nseg = f->n;
    m.u.data.segs = c->txf->segs;
    m.u.data.strided = f->strided;
    for (uint32_t i = 0; f->strided && i < f->n; i++)
        if (c->txf->segs[i].count == 0)
            c->txf->segs[i].count = 1;      /* a plain one among strided ones */
    if (p->by_ref)
        m.u.data.src_addrs = (kvf_wire_arr64_t){f->n, c->txf->addrs, NULL};
    c->frame.len = 0;
    return reserve_iov(c, 1) ? kvf_wire_encode(&c->frame, &m) : KVF_ERR_NO_MEMORY;
}

/*
 * Pull segments from the current put into one DATA frame, up to its
 * limits in segments, pieces and bytes; a strided segment that would cross
 * them is cut there, and its other pieces start the next frame.
 * @return 1 a frame is ready, 0 the put ended with nothing more to send.
 */
static int build_frame(kvf_tcp_conn_t *c)
{
    kvf_put_t *p = c->cur_put;
    tcp_fill_t f = {0};
    kvf_status_t st = KVF_OK;

    if (c->txf == NULL && (c->txf = malloc(sizeof(*c->txf))) == NULL) {
        c->cur_put = NULL;
        p->complete(p, KVF_ERR_NO_MEMORY);
        return 0;
    }
    int rc = fill_frame(c, &f, &st);
    if (rc < 0) {
        /* Room failed: drop what was collected, it was never sent. */
        c->cur_put = NULL;
        p->complete(p, (kvf_status_t)rc);
        return 0;
    }
    if (st == KVF_OK && f.n == 0 && c->cur_put_waiting)
        return 0;
    if (st == KVF_OK && f.n == 0) {
        c->cur_put = NULL;
        p->complete(p, KVF_OK);
        return 0;
    }
    if (st == KVF_OK)
        st = encode_frame(c, p, &f);
    if (st != KVF_OK) {
        c->cur_put = NULL;
        c->has_carry = 0;
        p->complete(p, st);
        return 0;
    }
    c->iov[0].iov_base = c->frame.data;
    c->iov[0].iov_len = c->frame.len;
    c->iov_n = p->by_ref ? 1 : (int)f.pieces + 1;
    c->iov_i = 0;
    c->frame_active = 1;
    c->frame_zeroed = 0;
    return 1;
}

/*
 * The rest of the current frame's payload, from zeros: its put's source
 * is no longer its to read, and a frame cannot be cut short.  (Zero-filled
 * and never written: it costs no memory until read, and then only the
 * kernel's zero page.)
 */
static uint8_t zeros[TCP_FRAME_BYTES];

static void zero_rest(kvf_tcp_conn_t *c)
{
    for (int i = c->iov_i > 0 ? c->iov_i : 1; i < c->iov_n; i++)
        c->iov[i].iov_base = zeros;
    c->frame_zeroed = 1;
}

/* Advance the iovec cursor past `n` written bytes. */
static void iov_advance(kvf_tcp_conn_t *c, size_t n)
{
    while (n > 0 && c->iov_i < c->iov_n) {
        struct iovec *v = &c->iov[c->iov_i];
        if (n < v->iov_len) {
            v->iov_base = (uint8_t *)v->iov_base + n;
            v->iov_len -= n;
            return;
        }
        n -= v->iov_len;
        c->iov_i++;
    }
}

/*
 * The peer closed or reset the connection under a write.  What it sent
 * before closing may still wait in our socket (a peer that gave up on us
 * sends its FAILs first), so the connection does not fail here: it stops
 * writing, and fails when reading reaches the end of that input
 * (handle_readable), so that the peer's reasons are known first.  Reading
 * goes on at the pace of the events and of the handler: a handler that is
 * not ready (reads in flight) is waited for, never spun on.
 */
static void write_failed(kvf_tcp_conn_t *c, int err)
{
    c->tx_err = err;
    update_events(c);
}

/* Why the connection ends, once its input is read to the end. */
static void input_ended(kvf_tcp_conn_t *c, const char *what)
{
    if (c->tx_err != 0)
        conn_fail(c, KVF_ERR_CONN_RESET, "write failed: %s", strerror(c->tx_err));
    else
        conn_fail(c, KVF_ERR_CONN_RESET, "%s", what);
}

/* A fault's truncation: the header and segment table go out, the payload
 * never does, and nothing after them: the FAILs the dying connection's
 * rooms send while it closes (conn_fail re-enters tcp_flush) would
 * otherwise follow, or the frame go out twice. */
static void cut_frame(kvf_tcp_conn_t *c)
{
    ssize_t n = send(c->fd, c->iov[c->iov_i].iov_base, c->iov[c->iov_i].iov_len,
                     MSG_NOSIGNAL);
    (void)n;
    c->tx_cut = 1;
    conn_fail(c, KVF_ERR_CONN_RESET, "%s", c->truncate_reason);
}

/* One sendmsg of the current frame's next iovecs.  @return as sendmsg,
 * with its errno. */
static ssize_t send_frame_part(kvf_tcp_conn_t *c, size_t budget)
{
    kvf_put_t *cp = c->cur_put;
    if (!c->frame_zeroed && cp != NULL && cp->live != NULL && !cp->live(cp))
        zero_rest(c);
    /* No more than the budget per call: a pass stays bounded (the
     * tick and the other connections wait for it). */
    int cnt = 0;
    size_t sum = 0, clipped = 0;
    struct iovec *v = c->iov + c->iov_i;
    while (c->iov_i + cnt < c->iov_n && sum < budget && cnt < TCP_IOV_MAX)
        sum += v[cnt++].iov_len;
    if (sum > budget) {
        clipped = v[cnt - 1].iov_len;
        v[cnt - 1].iov_len -= sum - budget;
    }
    kvf_put_t *src = c->cur_put;   /* the frame's source pages: pinned */
    if (src != NULL && src->busy != NULL)
        src->busy(src, 1);
    /* sendmsg, not writev: a peer that closed gives EPIPE, never
     * a SIGPIPE to the application (one stream of a failing peer
     * may still be written while the peer closes the others). */
    struct msghdr mh = {.msg_iov = v, .msg_iovlen = (size_t)cnt};
    io_begin(c);
    ssize_t n = sendmsg(c->fd, &mh, MSG_NOSIGNAL);
    int werr = errno;
    io_end(c);
    if (src != NULL && src->busy != NULL)
        src->busy(src, 0);
    errno = werr;
    if (clipped)
        v[cnt - 1].iov_len = clipped;
    return n;
}

/* The current frame is written: tell its put, and complete a put that
 * has ended. */
static void frame_written(kvf_tcp_conn_t *c)
{
    c->frame_active = 0;
    if (c->cur_put != NULL && c->cur_put->sent != NULL)
        c->cur_put->sent(c->cur_put);
    if (c->cur_put_ended) {
        kvf_put_t *p = c->cur_put;
        c->cur_put = NULL;
        c->cur_put_ended = 0;
        p->complete(p, KVF_OK);
    }
}

/* After a send: 1 to go on (EINTR), 0 to stop (EAGAIN, or the write
 * failed). */
static int send_error(kvf_tcp_conn_t *c)
{
    if (errno == EINTR)
        return 1;
    if (errno != EAGAIN)
        write_failed(c, errno);
    return 0;
}

/* Some of the current frame, within *budget.  @return 1 to go on
 * flushing, 0 to stop. */
static int flush_frame(kvf_tcp_conn_t *c, size_t *budget)
{
    ssize_t n = send_frame_part(c, *budget);
    if (n < 0)
        return send_error(c);
    c->last_tx_ms = kvf_now_ms();
    c->moved++;
    *budget -= (size_t)n < *budget ? (size_t)n : *budget;
    iov_advance(c, (size_t)n);
    if (c->iov_i == c->iov_n)
        frame_written(c);
    return 1;
}

/* Some of the queued control frames.  @return 1 to go on, 0 to stop. */
static int flush_ctrl(kvf_tcp_conn_t *c)
{
    io_begin(c);
    ssize_t n = send(c->fd, c->ctrl.data + c->ctrl_off,
                     c->ctrl.len - c->ctrl_off, MSG_NOSIGNAL);
    int serr = errno;
    io_end(c);
    errno = serr;
    if (n < 0)
        return send_error(c);
    c->last_tx_ms = kvf_now_ms();
    c->moved++;
    c->ctrl_off += (size_t)n;
    if (c->ctrl_off == c->ctrl.len)
        c->ctrl.len = c->ctrl_off = 0;
    return 1;
}

/* The next DATA frame, from the current put or the next queued one.
 * @return 1 to go on, 0 to stop (nothing to send, or the put waits). */
static int next_frame(kvf_tcp_conn_t *c)
{
    if (c->cur_put == NULL && c->q_head != NULL) {
        c->cur_put = c->q_head;
        c->q_head = c->cur_put->qnext;
        if (c->q_head == NULL)
            c->q_tail = NULL;
        c->cur_put_ended = 0;
    }
    if (c->cur_put == NULL)
        return 0;
    build_frame(c);
    if (c->cur_put_waiting) {
        c->cur_put_waiting = 0;   /* asked again on the next flush */
        return 0;
    }
    return 1;
}

static void tcp_flush(kvf_conn_t *base)
{
    kvf_tcp_conn_t *c = (kvf_tcp_conn_t *)base;
    size_t budget = TCP_PASS_BYTES;

    while (!c->dead && !c->connecting && !c->tx_cut && !c->tx_err && budget > 0) {
        if (c->paused_until_ms != 0) {
            if (kvf_now_ms() < c->paused_until_ms)
                break;
            c->paused_until_ms = 0;
        }
        if (c->truncate_reason != NULL && c->frame_active) {
            cut_frame(c);
            return;
        }
        /* A frame under way first, then control frames, then payload. */
        int go;
        if (c->frame_active)
            go = flush_frame(c, &budget);
        else if (c->ctrl_off < c->ctrl.len)
            go = flush_ctrl(c);
        else
            go = next_frame(c);
        if (!go)
            break;
    }
    update_events(c);
}

/* Place up to n bytes from src (NULL: read straight from the socket). */
static void place(kvf_tcp_conn_t *c, const uint8_t *src, size_t n)
{
    kvf_rx_target_t *t = &c->tgt[c->tgt_i];
    if (t->dst != NULL) {
        memcpy(t->dst + c->tgt_off, src, n);
        if (c->h->on_placed)
            c->h->on_placed(c->arg, t->dst + c->tgt_off, n);
        c->placed += n;
    }
    c->tgt_off += (uint32_t)n;
    c->payload_left -= n;
    c->moved++;
    if (c->tgt_off == t->len) {
        c->tgt_i++;
        c->tgt_off = 0;
    }
}

static void payload_done(kvf_tcp_conn_t *c)
{
    c->rx_state = RX_HDR;
    c->h->on_data_end(c->arg, c->placed);
}

/* This event's share of messages and DATA_REF pulls, spent across every
 * parse of the event: reading on between parses must not renew it. */
typedef struct {
    int      msgs;
    uint64_t pulled;
} pass_t;

static int limit_admits(const kvf_rx_limit_t *lim, const kvf_wire_hdr_t *h)
{
    return lim == NULL || ((lim->types >> h->type & 1u) && h->length <= lim->max_body);
}

/* A header beyond the limit: close, saying so; a frame that leads with
 * its protocol version once `have` of its first bytes say whether it is
 * another version's (until then, wait for them). */
static void refuse_frame(kvf_tcp_conn_t *c, const uint8_t *body, size_t have)
{
    char err[256];
    uint32_t need = kvf_wire_prefix_len(c->hdr.type);
    if (need > c->hdr.length)
        need = c->hdr.length;
    if (have < need)
        return;
    if (kvf_wire_check_prefix(c->hdr.type, body, need, err, sizeof(err)) == KVF_ERR_VERSION)
        conn_fail(c, KVF_ERR_VERSION, "%s", err);
    else
        conn_fail(c, KVF_ERR_PROTOCOL, "%s frame of %u bytes %s: refused at its header",
                  kvf_wire_type_name(c->hdr.type), c->hdr.length,
                  c->limit->why != NULL ? c->limit->why : "beyond this connection's limit");
}

/* Some of the current frame's payload from the buffer into its targets.
 * @return 1 to parse on, 0 to wait for more bytes. */
static int rx_payload(kvf_tcp_conn_t *c, const uint8_t *p, size_t have)
{
    if (c->payload_left == 0) {
        payload_done(c);
        return 1;
    }
    if (have == 0)
        return 0;
    size_t left = c->tgt[c->tgt_i].len - c->tgt_off;
    size_t n = have < left ? have : left;
    place(c, p, n);
    c->rx_off += n;
    return 1;
}

/* The next frame's header, once the handler is ready for a frame.
 * @return 1 to parse on, 0 to stop (short, held, or failed). */
static int rx_header(kvf_tcp_conn_t *c, const uint8_t *p, size_t have)
{
    char err[256];

    if (have < KVF_WIRE_HDR_LEN)
        return 0;
    if (c->h->rx_ready != NULL && !c->h->rx_ready(c->arg)) {
        c->held = 1;
        c->backlog = 1;
        update_events(c);
        return 0;
    }
    if (kvf_wire_parse_header(p, &c->hdr, err, sizeof(err)) != KVF_OK) {
        conn_fail(c, KVF_ERR_PROTOCOL, "malformed frame header: %s", err);
        return 0;
    }
    c->rx_off += KVF_WIRE_HDR_LEN;
    /* Beyond the limit: not one byte of its body is buffered. */
    c->rx_state = limit_admits(c->limit, &c->hdr) ? RX_BODY : RX_REFUSE;
    return 1;
}

/* A body larger than the buffer: room for all of it, read bytes first. */
static void rx_make_room(kvf_tcp_conn_t *c)
{
    size_t need = c->hdr.length;
    if (c->rx.cap < need) {
        kvf_buf_consume(&c->rx, c->rx_off);
        c->rx_off = 0;
        if (kvf_buf_reserve(&c->rx, need - c->rx.len) != KVF_OK) {
            conn_fail(c, KVF_ERR_NO_MEMORY, "no memory for a %zu-byte frame", need);
        }
    }
}

/* One target per piece: the payload is the pieces concatenated; on_data
 * says where each goes.  @return 1, or 0 when out of memory. */
static int rx_data_begin(kvf_tcp_conn_t *c, const kvf_msg_t *m)
{
    uint32_t np = m->u.data.npieces;
    if (c->tgt_cap < np) {
        kvf_rx_target_t *t = realloc(c->tgt, np * sizeof(*t));
        if (t == NULL) {
            conn_fail(c, KVF_ERR_NO_MEMORY, "no memory for DATA targets");
            return 0;
        }
        c->tgt = t;
        c->tgt_cap = np;
    }
    for (uint32_t i = 0, k = 0; i < m->u.data.nseg; i++) {
        kvf_wire_seg_t s;
        kvf_wire_seg_at(&m->u.data, i, &s);
        for (uint32_t j = 0; j < kvf_wire_seg_pieces(&s) && k < np; j++, k++)
            c->tgt[k] = (kvf_rx_target_t){NULL, s.len};
    }
    c->tgt_n = np;
    c->tgt_i = c->tgt_off = 0;
    c->payload_left = m->u.data.payload_len;
    c->placed = 0;
    c->rx_state = RX_PAYLOAD;
    c->moved++;
    c->h->on_data(c->arg, &m->u.data, c->tgt);
    return 1;
}

/* The buffered frame, decoded and handed to the handler.  @return 1 to
 * parse on, 0 to stop (failed, or this event's share is spent). */
static int rx_message(kvf_tcp_conn_t *c, const uint8_t *p, pass_t *pass)
{
    char err[256];
    kvf_msg_t m;

    kvf_status_t st = kvf_wire_decode(&c->hdr, p, &m, err, sizeof(err));
    if (st != KVF_OK) {
        conn_fail(c, st, "malformed %s message: %s",
                  kvf_wire_type_name(c->hdr.type), err);
        return 0;
    }
    c->rx_off += c->hdr.length;
    if (m.type == KVF_MSG_DATA)
        return rx_data_begin(c, &m);
    c->rx_state = RX_HDR;
    c->moved++;
    c->h->on_msg(c->arg, &m);
    /* A DATA_REF's payload is read by the engine while we wait:
     * count it, so one event never holds the engine for long. */
    if (m.type == KVF_MSG_DATA_REF)
        pass->pulled += m.u.data.payload_len;
    if (++pass->msgs >= TCP_PASS_MSGS || pass->pulled >= TCP_PASS_REFS) {
        c->backlog = 1;     /* the engine calls back: see pending() */
        return 0;
    }
    return 1;
}

/* Parse the complete frames the receive buffer holds, up to the bound. */
static void parse_buffered(kvf_tcp_conn_t *c, pass_t *pass)
{
    c->backlog = 0;
    while (!c->dead) {
        size_t have = c->rx.len - c->rx_off;
        const uint8_t *p = c->rx.data + c->rx_off;
        int go;

        if (c->rx_state == RX_REFUSE) {
            refuse_frame(c, p, have);
            return;
        }
        if (c->rx_state == RX_PAYLOAD) {
            go = rx_payload(c, p, have);
        } else if (c->rx_state == RX_HDR) {
            go = rx_header(c, p, have);
        } else if (have < c->hdr.length) {   /* RX_BODY */
            rx_make_room(c);
            return;
        } else {
            go = rx_message(c, p, pass);
        }
        if (!go)
            return;
    }
}

static void discard_rest(kvf_tcp_conn_t *c)
{
    for (uint32_t i = c->tgt_i; i < c->tgt_n; i++)
        c->tgt[i].dst = NULL;
}

/* readv the current frame's payload into its next targets (stops at a
 * discarded one, which goes through the buffer).  Same result as recv(). */
static ssize_t read_into_targets(kvf_tcp_conn_t *c, size_t budget)
{
    struct iovec iov[TCP_RX_IOV];
    uint64_t want = 0;
    int k = 0;

    for (uint32_t i = c->tgt_i; i < c->tgt_n && k < TCP_RX_IOV && want < c->payload_left &&
         want < budget; i++) {
        const kvf_rx_target_t *t = &c->tgt[i];
        size_t off = i == c->tgt_i ? c->tgt_off : 0;
        if (t->dst == NULL)
            break;
        iov[k].iov_base = t->dst + off;
        iov[k].iov_len = t->len - off;
        if (want + iov[k].iov_len > budget)
            iov[k].iov_len = budget - want;   /* the rest in the next call */
        want += iov[k++].iov_len;
    }
    if (c->h->rx_busy != NULL)
        c->h->rx_busy(c->arg, 1);
    io_begin(c);
    ssize_t n = readv(c->fd, iov, k);
    int rerr = errno;
    io_end(c);
    if (c->h->rx_busy != NULL)
        c->h->rx_busy(c->arg, 0);
    errno = rerr;
    if (n <= 0)
        return n;
    c->last_rx_ms = kvf_now_ms();
    c->moved++;
    c->placed += (size_t)n;
    c->payload_left -= (size_t)n;
    for (size_t left = (size_t)n; left > 0;) {
        const kvf_rx_target_t *t = &c->tgt[c->tgt_i];
        size_t piece = t->len - c->tgt_off;
        if (piece > left)
            piece = left;
        if (c->h->on_placed)
            c->h->on_placed(c->arg, t->dst + c->tgt_off, piece);
        c->tgt_off += (uint32_t)piece;
        left -= piece;
        if (c->tgt_off == t->len) {
            c->tgt_i++;
            c->tgt_off = 0;
        }
    }
    return n;
}

static void handle_readable(kvf_tcp_conn_t *c)
{
    size_t budget = TCP_PASS_BYTES;
    pass_t pass = {0, 0};

    if (c->held) {
        if (!c->h->rx_ready(c->arg))
            return;
        c->held = 0;
        update_events(c);
    }
    while (!c->dead && budget > 0) {
        /* Every pass: the room may have gone while the lock was let go. */
        if (c->rx_state == RX_PAYLOAD && !c->h->rx_valid(c->arg))
            discard_rest(c);
        parse_buffered(c, &pass);
        /* Share used up: the rest waits in the buffer (pending()). */
        if (c->dead || c->backlog)
            return;
        if (c->rx_off == c->rx.len)
            c->rx.len = c->rx_off = 0;

        ssize_t n;
        kvf_rx_target_t *t = c->rx_state == RX_PAYLOAD ? &c->tgt[c->tgt_i] : NULL;
        if (t != NULL && t->dst != NULL && c->rx_off == c->rx.len) {
            /* Payload with the buffer empty: scatter it straight into place,
             * as many targets per readv as the kernel takes. */
            n = read_into_targets(c, budget);
            if (n > 0) {
                budget -= (size_t)n < budget ? (size_t)n : budget;
                continue;
            }
        } else {
            if (c->rx.len == c->rx.cap && c->rx_off > 0) {
                kvf_buf_consume(&c->rx, c->rx_off);
                c->rx_off = 0;
            }
            /* The buffer, at its first read; grown once the limit is gone. */
            size_t want = c->limit != NULL ? KVF_WIRE_HDR_LEN + c->limit->max_body
                                           : TCP_RX_BUF;
            if (c->rx.cap < want && kvf_buf_reserve(&c->rx, want - c->rx.len) != KVF_OK) {
                conn_fail(c, KVF_ERR_NO_MEMORY, "no memory for a receive buffer");
                return;
            }
            size_t room = c->rx.cap - c->rx.len;
            io_begin(c);
            n = recv(c->fd, c->rx.data + c->rx.len, room < budget ? room : budget, 0);
            int rerr = errno;
            io_end(c);
            errno = rerr;
            if (n > 0) {
                c->last_rx_ms = kvf_now_ms();
                c->moved++;
                budget -= (size_t)n < budget ? (size_t)n : budget;
                c->rx.len += (size_t)n;
                continue;
            }
        }
        if (n == 0) {
            input_ended(c, c->rx_state == RX_HDR && c->rx_off == c->rx.len
                           ? "peer closed the connection"
                           : "peer closed the connection in the middle of a frame");
            return;
        }
        if (errno == EINTR)
            continue;
        if (errno != EAGAIN) {
            char what[128];
            snprintf(what, sizeof(what), "read failed: %s", strerror(errno));
            input_ended(c, what);
        }
        return;
    }
}

/*
 * The loop's guard against a spin: an event that moves nothing is
 * harmless once, but one that keeps coming back while nothing moves is a
 * livelock (a readiness asked for that nothing can serve) and would hold
 * the engine forever.  After STALL_EVENTS such events over STALL_MS, the
 * connection fails, once, saying so; its peer's rooms fail with it and
 * the engine goes on.
 */
#define STALL_EVENTS 10000
#define STALL_MS     2000

static void stalled(kvf_tcp_conn_t *c, uint64_t moved_before)
{
    if (c->moved != moved_before || c->dead) {
        c->idle_events = 0;
        return;
    }
    uint64_t now = kvf_now_ms();
    if (c->idle_events++ == 0)
        c->idle_since_ms = now;
    if (c->idle_events < STALL_EVENTS || now - c->idle_since_ms < STALL_MS)
        return;
    kvf_error("tcp connection: %u events in %.1f s moved nothing (a kvferry bug: please "
              "report it); closing the connection so that the engine goes on",
              c->idle_events, (double)(now - c->idle_since_ms) / 1000.0);
    conn_fail(c, KVF_ERR_CONN_RESET,
              "progress stalled on the connection (%u events moved nothing): closed",
              c->idle_events);
}

static void tcp_handle(kvf_conn_t *base, uint32_t events)
{
    kvf_tcp_conn_t *c = (kvf_tcp_conn_t *)base;
    if (c->dead)
        return;
    uint64_t moved_before = c->moved;
    if (c->connecting) {
        if (!(events & (EPOLLOUT | EPOLLERR | EPOLLHUP)))
            return;
        int err = 0;
        socklen_t len = sizeof(err);
        getsockopt(c->fd, SOL_SOCKET, SO_ERROR, &err, &len);
        if (err != 0) {
            conn_fail(c, KVF_ERR_UNREACHABLE, "connect failed: %s", strerror(err));
            return;
        }
        c->connecting = 0;
        c->moved++;
        c->last_rx_ms = kvf_now_ms();
        c->h->on_connected(c->arg);
    }
    if (events & (EPOLLIN | EPOLLRDHUP | EPOLLHUP | EPOLLERR))
        handle_readable(c);
    if (!c->dead)
        tcp_flush(&c->base);
    stalled(c, moved_before);
}

static void tcp_abort(kvf_conn_t *base, int rst, const char *reason)
{
    kvf_tcp_conn_t *c = (kvf_tcp_conn_t *)base;
    if (c->dead)
        return;
    if (rst) {
        struct linger lg = {.l_onoff = 1, .l_linger = 0};
        setsockopt(c->fd, SOL_SOCKET, SO_LINGER, &lg, sizeof(lg));
    }
    conn_fail(c, KVF_ERR_CONN_RESET, "%s", reason);
}

static void tcp_pause(kvf_conn_t *base, uint64_t until_ms)
{
    kvf_tcp_conn_t *c = (kvf_tcp_conn_t *)base;
    c->paused_until_ms = until_ms;
    update_events(c);
}

static void tcp_limit(kvf_conn_t *base, const kvf_rx_limit_t *lim)
{
    ((kvf_tcp_conn_t *)base)->limit = lim;
}

static void tcp_truncate(kvf_conn_t *base, const char *reason)
{
    kvf_tcp_conn_t *c = (kvf_tcp_conn_t *)base;
    if (c->truncate_reason == NULL)
        c->truncate_reason = strdup(reason);
}

const kvf_transport_ops_t kvf_tcp_ops = {
    .name = "tcp",
    .connect = tcp_connect,
    .accept = tcp_accept,
    .handle = tcp_handle,
    .send_msg = tcp_send_msg,
    .put = tcp_put,
    .flush = tcp_flush,
    .shutdown = tcp_shutdown,
    .destroy = tcp_destroy,
    .rebind = tcp_rebind,
    .last_rx = tcp_last_rx,
    .last_tx = tcp_last_tx,
    .idle = tcp_idle,
    .pending = tcp_pending,
    .limit = tcp_limit,
    .abort = tcp_abort,
    .pause = tcp_pause,
    .truncate = tcp_truncate,
};
