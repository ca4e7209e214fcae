/*
 * The tcp connection on its own, driven the way the engine drives it:
 * what it promises about the pages of a put.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#include "transport/transport.h"
#include "util/buf.h"
#include "wire/wire.h"
#include "unit/kvf_test.h"
#include "util/time.h"

#define SEG_BYTES (4u << 20)   /* one segment, one frame */
#define NSEG      8            /* 32 MiB: far more than the socket buffers */

/* A put of NSEG segments of one source buffer, with a `live` switch. */
typedef struct test_put {
    kvf_put_t put;
    uint8_t  *src;
    int       next_seg;
    int       live;
    int       busy, busy_max;
    int       completed;
    kvf_status_t status;
} test_put_t;

static int tp_next(kvf_put_t *put, kvf_wire_seg_t *seg, const void **src)
{
    test_put_t *t = (test_put_t *)put;
    if (!t->live)
        return KVF_ERR_ABORTED;   /* as a sender's put does once its room failed */
    if (t->next_seg == NSEG)
        return 0;
    *seg = (kvf_wire_seg_t){.kind = KVF_BUF_KV, .buf = 0,
                            .offset = (uint64_t)t->next_seg * SEG_BYTES, .len = SEG_BYTES,
                            .count = 1};
    *src = t->src + (size_t)t->next_seg * SEG_BYTES;
    t->next_seg++;
    return 1;
}

static void tp_complete(kvf_put_t *put, kvf_status_t st)
{
    test_put_t *t = (test_put_t *)put;
    t->completed++;
    t->status = st;
}

static void tp_busy(kvf_put_t *put, int busy)
{
    test_put_t *t = (test_put_t *)put;
    t->busy += busy ? 1 : -1;
    if (t->busy > t->busy_max)
        t->busy_max = t->busy;
}

static int tp_live(kvf_put_t *put)
{
    return ((test_put_t *)put)->live;
}

/* The handler of a connection that only sends. */
static int closed;
static void h_connected(void *arg) { (void)arg; }
static void h_msg(void *arg, const kvf_msg_t *m) { (void)arg; (void)m; }
static void h_data(void *arg, const kvf_msg_data_t *d, kvf_rx_target_t *t)
{
    (void)arg;
    for (uint32_t i = 0; i < d->npieces; i++)
        t[i].dst = NULL;
}
static int  h_valid(void *arg) { (void)arg; return 1; }
static void h_end(void *arg, uint64_t n) { (void)arg; (void)n; }
static void h_close(void *arg, kvf_status_t st, const char *why)
{
    (void)arg;
    (void)st;
    (void)why;
    closed = 1;
}

static const kvf_conn_handler_t handler = {
    .on_connected = h_connected, .on_msg = h_msg, .on_data = h_data,
    .rx_valid = h_valid, .on_data_end = h_end, .on_close = h_close,
};

/* The engine's lock, as the connection lets go of it around its calls. */
static int locked = 1, unlocks;
static void t_unlock(void *arg) { (void)arg; CHECK(locked); locked = 0; unlocks++; }
static void t_lock(void *arg) { (void)arg; CHECK(!locked); locked = 1; }

/*
 * A connection accepted on loopback, its far end a raw socket (*rfd_p),
 * in epoll instance *epfd_p.
 */
static kvf_conn_t *open_pair(const kvf_conn_handler_t *h, int *lfd_p, int *rfd_p,
                             int *epfd_p)
{
    struct sockaddr_in sa = {.sin_family = AF_INET};
    socklen_t salen = sizeof(sa);
    inet_pton(AF_INET, "127.0.0.1", &sa.sin_addr);
    int lfd = socket(AF_INET, SOCK_STREAM, 0);
    CHECK(lfd >= 0 && bind(lfd, (struct sockaddr *)&sa, sizeof(sa)) == 0 &&
          listen(lfd, 1) == 0);
    getsockname(lfd, (struct sockaddr *)&sa, &salen);
    int rfd = socket(AF_INET, SOCK_STREAM, 0);
    CHECK(connect(rfd, (struct sockaddr *)&sa, sizeof(sa)) == 0);
    int afd = accept(lfd, NULL, NULL);
    CHECK(afd >= 0);

    int epfd = epoll_create1(0);
    kvf_conn_env_t env = {epfd, NULL, t_unlock, t_lock, NULL};
    kvf_conn_t *c = NULL;
    CHECK_EQ_INT(kvf_tcp_ops.accept(afd, &env, h, NULL, &c), KVF_OK);
    *lfd_p = lfd;
    *rfd_p = rfd;
    *epfd_p = epfd;
    return c;
}

/*
 * A frame already started when its put stops being live (its room failed
 * or was destroyed, and the application may reuse the pages at once): the
 * rest of the frame goes out as zeros, never from the pages; no later
 * frame is built; the pages are pinned around every write.
 */
static void test_frame_after_room_gone_sends_zeros(void)
{
    int lfd, rfd, epfd;
    kvf_conn_t *c = open_pair(&handler, &lfd, &rfd, &epfd);

    test_put_t *t = calloc(1, sizeof(*t));
    t->src = malloc((size_t)NSEG * SEG_BYTES);
    memset(t->src, 0x11, (size_t)NSEG * SEG_BYTES);
    t->live = 1;
    t->put = (kvf_put_t){.next = tp_next, .complete = tp_complete, .busy = tp_busy,
                         .live = tp_live, .room = 7};
    c->ops->put(c, &t->put);

    /* Write until the socket takes no more (the reader reads nothing). */
    for (int i = 0; i < 64; i++)
        c->ops->flush(c);
    CHECK(t->next_seg >= 1 && t->next_seg < NSEG);   /* a frame is under way */
    CHECK(unlocks > 0);
    CHECK_EQ_INT(t->busy, 0);
    CHECK_EQ_INT(t->busy_max, 1);

    /* The room goes; the pages are someone else's at once. */
    t->live = 0;
    memset(t->src, 0xee, (size_t)NSEG * SEG_BYTES);

    /* Read everything the connection still sends, flushing as we go, then
     * the rest once it is closed (to EOF). */
    static uint8_t buf[1 << 20];
    uint64_t got = 0, ee = 0, eleven = 0, until = kvf_now_ms() + 20000;
    int eof = 0, destroyed = 0;
    while (!eof && kvf_now_ms() < until) {
        if (!destroyed) {
            c->ops->flush(c);
            if (t->completed && c->ops->idle(c)) {
                CHECK(locked);
                c->ops->destroy(c);
                destroyed = 1;
            }
        }
        struct pollfd pfd = {rfd, POLLIN, 0};
        if (poll(&pfd, 1, 10) <= 0)
            continue;
        ssize_t n = recv(rfd, buf, sizeof(buf), MSG_DONTWAIT);
        eof = n == 0;
        for (ssize_t i = 0; i < n; i++) {
            ee += buf[i] == 0xee;
            eleven += buf[i] == 0x11;
        }
        got += n > 0 ? (uint64_t)n : 0;
    }
    CHECK(eof);
    /* Every frame it started went out whole: header and 4 MiB each. */
    CHECK(got > (uint64_t)t->next_seg * SEG_BYTES);
    CHECK_EQ_INT(t->completed, 1);
    CHECK_EQ_INT(t->status, KVF_ERR_ABORTED);
    CHECK(!closed);
    CHECK(eleven > 0);            /* what was written before the room went */
    CHECK_EQ_INT(ee, 0);          /* and nothing of the pages after */
    CHECK(t->next_seg < NSEG);    /* no frame started after it */
    close(rfd);
    close(lfd);
    close(epfd);
    free(t->src);
    free(t);
}

/* The handler of a connection that reads, and may say it is not ready. */
static int ready, msgs, closes;
static kvf_status_t close_st;
static char close_why[512];
static void r_msg(void *arg, const kvf_msg_t *m)
{
    (void)arg;
    (void)m;
    msgs++;
}
static int r_ready(void *arg) { (void)arg; return ready; }
static void r_close(void *arg, kvf_status_t st, const char *why)
{
    (void)arg;
    closes++;
    close_st = st;
    snprintf(close_why, sizeof(close_why), "%s", why);
}

static const kvf_conn_handler_t reader = {
    .on_connected = h_connected, .on_msg = r_msg, .on_data = h_data,
    .rx_valid = h_valid, .rx_ready = r_ready, .on_data_end = h_end,
    .on_close = r_close,
};

static void reader_reset(void)
{
    ready = 1;
    msgs = closes = 0;
    close_st = KVF_OK;
    close_why[0] = '\0';
}

/* Events epoll reports for the connection now, without waiting. */
static int events_now(int epfd)
{
    struct epoll_event ev[4];
    return epoll_wait(epfd, ev, 4, 0);
}

/*
 * The peer reset the connection while this side held its input (a peer's
 * pulled reads in flight: the handler not ready) and then wrote to it.
 * The write failing must not spin, nor make epoll report the dead socket
 * at every wait; once the handler is ready, every message the peer sent
 * before its reset is read, and only then does the connection fail, with
 * the write's reason.
 */
static void test_write_failure_while_held_reads_first(void)
{
    int lfd, rfd, epfd;
    reader_reset();
    kvf_conn_t *c = open_pair(&reader, &lfd, &rfd, &epfd);

    /* Its messages, more than one event parses. */
    kvf_buf_t out;
    kvf_buf_init(&out);
    enum { NMSG = 150 };
    for (int i = 0; i < NMSG; i++) {
        kvf_msg_t m = {.type = KVF_MSG_HEARTBEAT, .u.heartbeat = {.seq = (uint64_t)i}};
        CHECK_EQ_INT(kvf_wire_encode(&out, &m), KVF_OK);
    }
    CHECK(send(rfd, out.data, out.len, 0) == (ssize_t)out.len);
    kvf_buf_free(&out);

    /* Read into the connection, held after the first message or so. */
    ready = 0;
    c->ops->handle(c, EPOLLIN);
    CHECK_EQ_INT(msgs, 0);
    CHECK(c->ops->pending(c));

    /* The peer resets the connection; this side writes. */
    struct linger lg = {.l_onoff = 1, .l_linger = 0};
    CHECK(setsockopt(rfd, SOL_SOCKET, SO_LINGER, &lg, sizeof(lg)) == 0);
    close(rfd);
    kvf_msg_t hb = {.type = KVF_MSG_HEARTBEAT};
    uint64_t until = kvf_now_ms() + 10000;
    while (c->ops->idle(c) && kvf_now_ms() < until) {
        /* Write until the reset is seen (the first write after it fails). */
        CHECK_EQ_INT(c->ops->send_msg(c, &hb), KVF_OK);
        c->ops->flush(c);
    }
    c->ops->flush(c);
    CHECK_EQ_INT(closes, 0);                 /* its input is not read yet */
    CHECK(!c->ops->idle(c));                 /* what failed stays unsent */

    /* Nothing to do until the handler is ready: epoll says so at most
     * once, not at every wait. */
    events_now(epfd);
    CHECK_EQ_INT(events_now(epfd), 0);
    CHECK_EQ_INT(events_now(epfd), 0);

    /* Ready: every message, then the failure, once. */
    ready = 1;
    for (int i = 0; i < 100 && closes == 0; i++)
        c->ops->handle(c, EPOLLIN);
    CHECK_EQ_INT(msgs, NMSG);
    CHECK_EQ_INT(closes, 1);
    CHECK_EQ_INT(close_st, KVF_ERR_CONN_RESET);
    CHECK_STR_CONTAINS(close_why, "write failed");
    c->ops->destroy(c);
    close(lfd);
    close(epfd);
}

/*
 * The loop's guard: a connection whose events keep coming while nothing
 * moves fails, once, saying so, instead of holding the engine forever.
 * (Here the loop calls handle() with nothing to read.)
 */
static void test_events_that_move_nothing_fail_the_connection(void)
{
    int lfd, rfd, epfd;
    reader_reset();
    kvf_conn_t *c = open_pair(&reader, &lfd, &rfd, &epfd);

    uint64_t until = kvf_now_ms() + 20000;
    long calls = 0;
    while (closes == 0 && kvf_now_ms() < until) {
        c->ops->handle(c, EPOLLIN);
        calls++;
    }
    CHECK_EQ_INT(closes, 1);
    CHECK(calls >= 10000);
    CHECK_STR_CONTAINS(close_why, "progress stalled");
    c->ops->destroy(c);
    close(rfd);
    close(lfd);
    close(epfd);
}

KVF_TEST_MAIN(KVF_CASE(test_frame_after_room_gone_sends_zeros),
              KVF_CASE(test_write_failure_while_held_reads_first),
              KVF_CASE(test_events_that_move_nothing_fail_the_connection))
