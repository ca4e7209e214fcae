/*
 * The ucx transport between two real processes: a forked "prefill" peer
 * registers a patterned buffer and hands its XPORT blob over a socketpair;
 * the test process (the "decode" side) connects and pulls scattered pieces
 * into its own registered buffer, then kills or stops the peer and checks
 * that a read fails, within its timeout, instead of hanging.
 *
 * Every case runs once per UCX transport set (UCX_TLS=tcp, sm,tcp and
 * posix,cma; KVF_TEST_UCX_TLS overrides), each in its own forked runner,
 * because UCX reads UCX_TLS when a context is created and a forked runner
 * is also the cleanest way to make sure no peer outlives its case.  UCX
 * 1.13 cannot detect a dead peer over shared memory, so with posix,cma the
 * connect is refused (checked, then the case is skipped) and with sm,tcp
 * UCX moves the payload over tcp.
 *
 * Remote-key bounds: a prefill engine offers ucx only where UCX confines
 * a key's holder to the registered regions (RDMA).  The rule is checked
 * against attributes as UCX reports them for an RDMA host and for mixes
 * (this host has no RDMA NIC: every transport here is tcp, shared memory
 * or self, none of which confines a peer), against what UCX reports here
 * under each UCX_TLS, and end to end: an engine pair asked for ucx under
 * UCX_TLS=tcp moves its room over tcp, bytes verified, and over ucx only
 * with KVF_UCX_SOFTWARE_RMA=allow.
 *
 * KVF_UCX_BENCH=1 adds a bandwidth figure for 4 MiB reads (no timing is
 * asserted): compare with `ucx_perftest -t ucp_get -s 4194304`.
 */
#include <errno.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <poll.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "transport/ucx/ucx.h"
#include "unit/kvf_test.h"

#ifndef KVF_HAVE_UCX

static void test_skip(void)
{
    printf("SKIP test_ucx: built without UCX (configure with -DKVF_UCX=ON and "
           "libucx-dev installed)\n");
}

KVF_TEST_MAIN(KVF_CASE(test_skip))

#else /* KVF_HAVE_UCX */

#include <uct/api/uct.h>

#define HEAD_B 64
#define SLOTS  4
#include "unit/kvf_sides.h"
#include "util/time.h"

#define MIB        (1024u * 1024u)
#define PEER_LEN   (24u * MIB)     /* the peer's registered, patterned buffer */
#define LOCAL_LEN  (48u * MIB)     /* our registered destination */
#define RUN_MS     90000           /* bound on one runner */

/* The UCX_TLS values every case runs under; KVF_TEST_UCX_TLS="a;b" overrides
 * (e.g. "rc,tcp" on an InfiniBand host). */
static const char *tls_default[] = {"tcp", "sm,tcp", "posix,cma"};
static const char *tls_sets[8];
static size_t ntls;

static void tls_init(void)
{
    static char buf[256];
    const char *env = getenv("KVF_TEST_UCX_TLS");
    if (ntls > 0)
        return;
    if (env == NULL || *env == '\0') {
        for (; ntls < sizeof(tls_default) / sizeof(tls_default[0]); ntls++)
            tls_sets[ntls] = tls_default[ntls];
        return;
    }
    snprintf(buf, sizeof(buf), "%s", env);
    for (char *save = NULL, *t = strtok_r(buf, ";", &save); t && ntls < 8;
         t = strtok_r(NULL, ";", &save))
        tls_sets[ntls++] = t;
}

static inline uint8_t pattern(uint64_t i)
{
    return (uint8_t)((i * 2654435761u) >> 13) ^ (uint8_t)(i >> 20);
}

/* ------------------------------------------------------------ the peer */

typedef struct peer {
    pid_t    pid;
    int      sock;
    uint8_t *blob;
    size_t   blob_len;
    uint64_t base, len;
} peer_t;

static int write_all(int fd, const void *p, size_t n)
{
    for (const char *c = p; n > 0;) {
        ssize_t w = write(fd, c, n);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0)
            return -1;
        c += w;
        n -= (size_t)w;
    }
    return 0;
}

static int read_all(int fd, void *p, size_t n)
{
    for (char *c = p; n > 0;) {
        ssize_t r = read(fd, c, n);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            return -1;
        c += r;
        n -= (size_t)r;
    }
    return 0;
}

/* The peer process: register, send the blob, serve until the socket closes. */
static void peer_main(int sock, size_t len)
{
    char err[256];
    kvf_ucx_t *u;
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    uint8_t *buf = aligned_alloc(4096, len);
    for (size_t i = 0; i < len; i++)
        buf[i] = pattern(i);
    if (kvf_ucx_create(&u, err, sizeof(err)) != KVF_OK ||
        kvf_ucx_register(u, buf, len, KVF_MEM_HOST, err, sizeof(err)) != KVF_OK) {
        fprintf(stderr, "peer: %s\n", err);
        _exit(2);
    }
    kvf_buf_t b;
    kvf_buf_init(&b);
    if (kvf_ucx_pack(u, &b) != KVF_OK)
        _exit(3);
    uint64_t hdr[3] = {b.len, (uint64_t)(uintptr_t)buf, len};
    if (write_all(sock, hdr, sizeof(hdr)) || write_all(sock, b.data, b.len))
        _exit(4);
    kvf_buf_free(&b);
    /* Serve (tcp emulates gets with messages this worker must answer). */
    for (;;) {
        struct pollfd pf[2] = {{.fd = sock, .events = POLLIN},
                               {.fd = kvf_ucx_fd(u), .events = POLLIN}};
        int more = kvf_ucx_progress(u);
        int busy = more || pf[1].fd < 0 || getenv("KVF_TEST_PEER_BUSY") != NULL;
        if (poll(pf, pf[1].fd >= 0 ? 2 : 1, busy ? 0 : 100) < 0 &&
            errno != EINTR)
            break;
        if (pf[0].revents) {
            char c;
            if (read(sock, &c, 1) <= 0)
                break;
        }
    }
    kvf_ucx_destroy(u);
    free(buf);
    close(sock);
    exit(0);   /* not _exit: sanitizer builds check for leaks at exit */
}

static int peer_start(peer_t *p, size_t len)
{
    int sv[2];
    memset(p, 0, sizeof(*p));
    if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv) != 0)
        return -1;
    fflush(NULL);
    p->pid = fork();
    if (p->pid < 0)
        return -1;
    if (p->pid == 0) {
        close(sv[0]);
        peer_main(sv[1], len);
    }
    close(sv[1]);
    p->sock = sv[0];
    uint64_t hdr[3];
    if (read_all(p->sock, hdr, sizeof(hdr)) != 0 || hdr[0] > (1u << 20))
        return -1;
    p->blob_len = hdr[0];
    p->base = hdr[1];
    p->len = hdr[2];
    p->blob = malloc(p->blob_len);
    return read_all(p->sock, p->blob, p->blob_len);
}

/* Stop the peer (it may be stopped or dead already) and reap it. */
static void peer_stop(peer_t *p)
{
    if (p->pid > 0) {
        kill(p->pid, SIGCONT);
        close(p->sock);   /* a live peer exits on EOF */
        p->sock = -1;
        if (!wait_child(p->pid, NULL, 2000)) {
            kill(p->pid, SIGKILL);
            waitpid(p->pid, NULL, 0);
        }
        p->pid = 0;
    }
    if (p->sock >= 0)
        close(p->sock);
    free(p->blob);
    p->blob = NULL;
}

/* ------------------------------------------------------- the decode side */

typedef struct ucx_side {
    peer_t        peer;
    kvf_ucx_t    *u;
    kvf_ucx_ep_t *ep;
    uint8_t      *local;
    char          err[512];
} ucx_side_t;

static int ucx_side_init(ucx_side_t *s, size_t peer_len, size_t local_len)
{
    memset(s, 0, sizeof(*s));
    s->peer.sock = -1;
    /* Fork the peer before UCX starts in this process. */
    CHECK(peer_start(&s->peer, peer_len) == 0);
    s->local = aligned_alloc(4096, local_len);
    memset(s->local, 0, local_len);
    CHECK_EQ_INT(kvf_ucx_create(&s->u, s->err, sizeof(s->err)), KVF_OK);
    if (s->u == NULL || s->peer.blob == NULL)
        return -1;
    CHECK_EQ_INT(kvf_ucx_register(s->u, s->local, local_len, KVF_MEM_HOST, s->err,
                                  sizeof(s->err)), KVF_OK);
    kvf_status_t st = kvf_ucx_connect(s->u, s->peer.blob, s->peer.blob_len, &s->ep,
                                      s->err, sizeof(s->err));
    if (st == KVF_ERR_UNREACHABLE && strstr(getenv("UCX_TLS"), "tcp") == NULL) {
        /* Shared memory alone: UCX 1.13 cannot detect a dead peer over it,
         * and kvferry refuses endpoints that cannot (see ucx.c). */
        CHECK_STR_CONTAINS(s->err, "peer-failure detection");
        printf("  SKIP UCX_TLS=%s: refused as expected: %s\n", getenv("UCX_TLS"), s->err);
        return 1;
    }
    CHECK_EQ_INT(st, KVF_OK);
    return s->ep != NULL ? 0 : -1;
}

static void ucx_side_fini(ucx_side_t *s)
{
    if (s->ep != NULL)
        kvf_ucx_disconnect(s->ep);
    if (s->u != NULL)
        kvf_ucx_destroy(s->u);
    peer_stop(&s->peer);
    free(s->local);
}

static struct iovec rptr(const ucx_side_t *s, uint64_t off, size_t len)
{
    return (struct iovec){(void *)(uintptr_t)(s->peer.base + off), len};
}

/* A read, waited for the way the engine does: progress on the worker fd,
 * a tick for the deadline, until the batch is handed back. */
typedef struct {
    kvf_mover_read_t base;
    int              done;
    kvf_status_t     st;
    char             err[256];
} test_read_t;

static void test_read_done(kvf_mover_read_t *base, kvf_status_t st, const char *err)
{
    test_read_t *rd = (test_read_t *)base;
    rd->done++;
    rd->st = st;
    snprintf(rd->err, sizeof(rd->err), "%s", err ? err : "");
}

static kvf_status_t read_wait(kvf_ucx_t *u, kvf_ucx_ep_t *ep, struct iovec *l,
                              struct iovec *r, size_t n, unsigned timeout_ms, char *err,
                              size_t errlen)
{
    test_read_t rd = {.base.done = test_read_done};
    kvf_status_t st = kvf_ucx_read(ep, &rd.base, l, r, n, timeout_ms, err, errlen);
    if (st != KVF_OK) {
        CHECK_EQ_INT(rd.done, 0);   /* refused: never handed back */
        return st;
    }
    CHECK_EQ_INT(rd.done, 0);       /* never from kvf_ucx_read itself */
    while (!rd.done) {
        if (kvf_ucx_progress(u) == 0 && !rd.done && kvf_ucx_fd(u) >= 0) {
            struct pollfd pfd = {.fd = kvf_ucx_fd(u), .events = POLLIN};
            poll(&pfd, 1, 10);
        }
        kvf_ucx_tick(ep);
    }
    CHECK_EQ_INT(rd.done, 1);
    snprintf(err, errlen, "%s", rd.err);
    return rd.st;
}

/* Read one small piece and verify it: the endpoint works. */
static kvf_status_t probe(ucx_side_t *s, unsigned timeout_ms)
{
    struct iovec l = {s->local, 4096}, r = rptr(s, 12345, 4096);
    kvf_status_t st = read_wait(s->u, s->ep, &l, &r, 1, timeout_ms, s->err, sizeof(s->err));
    if (st == KVF_OK)
        for (size_t i = 0; i < 4096; i++)
            if (s->local[i] != pattern(12345 + i)) {
                fprintf(stderr, "  probe: byte %zu differs\n", i);
                return KVF_ERR_INCOMPLETE;
            }
    return st;
}

static uint64_t rnd(uint64_t *x)
{
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    return *x;
}

/* Scattered pieces of 1 KiB .. 8 MiB, verified byte by byte; gaps stay 0. */
static void case_scatter(void)
{
    ucx_side_t s;
    if (ucx_side_init(&s, PEER_LEN, LOCAL_LEN) != 0)
        goto out;
    static const size_t sizes[] = {1024, 1000, 4096, 65536, 300000, MIB, 8 * MIB, 17};
    enum { NPIECE = 96 };
    struct iovec l[NPIECE], r[NPIECE];
    uint64_t x = 88172645463325252ull, loff = 0;
    size_t n = 0;
    while (n < NPIECE) {
        size_t len = sizes[rnd(&x) % (sizeof(sizes) / sizeof(sizes[0]))];
        uint64_t gap = 64 + rnd(&x) % 4096;
        if (loff + gap + len > LOCAL_LEN)
            break;
        loff += gap;
        l[n] = (struct iovec){s.local + loff, len};
        r[n] = rptr(&s, rnd(&x) % (PEER_LEN - len + 1), len);
        loff += len;
        n++;
    }
    CHECK(n > 20);
    uint64_t t0 = kvf_now_ms();
    CHECK_EQ_INT(read_wait(s.u, s.ep, l, r, n, 20000, s.err, sizeof(s.err)), KVF_OK);
    printf("  %zu pieces, %llu bytes in %llu ms\n", n, (unsigned long long)loff,
           (unsigned long long)(kvf_now_ms() - t0));
    /* Every byte: inside pieces the pattern, outside untouched. */
    size_t bad = 0, p = 0;
    for (uint64_t i = 0; i < LOCAL_LEN; i++) {
        uint8_t want = 0;
        while (p < n && (uint8_t *)l[p].iov_base + l[p].iov_len <= s.local + i)
            p++;
        if (p < n && (uint8_t *)l[p].iov_base <= s.local + i) {
            uint64_t roff = (uint64_t)(uintptr_t)r[p].iov_base - s.peer.base;
            want = pattern(roff + (uint64_t)(s.local + i - (uint8_t *)l[p].iov_base));
        }
        if (s.local[i] != want && bad++ < 5)
            fprintf(stderr, "  byte %llu: 0x%02x, want 0x%02x\n", (unsigned long long)i,
                    s.local[i], want);
    }
    CHECK_EQ_INT(bad, 0);
out:
    ucx_side_fini(&s);
}

/* Addresses the peer did not register are refused before anything moves;
 * so are unregistered destinations and malformed blobs. */
static void case_refuse(void)
{
    ucx_side_t s;
    if (ucx_side_init(&s, PEER_LEN, LOCAL_LEN) != 0)
        goto out;
    CHECK_EQ_INT(probe(&s, 10000), KVF_OK);

    struct iovec l[2] = {{s.local, 4096}, {s.local + 8192, 200}};
    struct iovec r[2] = {rptr(&s, 0, 4096), rptr(&s, PEER_LEN - 100, 200)};
    memset(s.local, 0, 16384);
    CHECK_EQ_INT(read_wait(s.u, s.ep, l, r, 2, 5000, s.err, sizeof(s.err)), KVF_ERR_PROTOCOL);
    CHECK_STR_CONTAINS(s.err, "outside every region");
    CHECK(s.local[0] == 0);   /* nothing was issued, not even the valid piece */
    r[1] = (struct iovec){(void *)(uintptr_t)4096, 16};
    l[1].iov_len = 16;
    CHECK_EQ_INT(read_wait(s.u, s.ep, l, r, 2, 5000, s.err, sizeof(s.err)), KVF_ERR_PROTOCOL);
    r[1] = (struct iovec){(void *)(uintptr_t)(UINT64_MAX - 8), 16};
    CHECK_EQ_INT(read_wait(s.u, s.ep, l, r, 2, 5000, s.err, sizeof(s.err)), KVF_ERR_PROTOCOL);

    uint8_t stack[64];
    struct iovec ls = {stack, sizeof(stack)}, rs = rptr(&s, 0, sizeof(stack));
    CHECK_EQ_INT(read_wait(s.u, s.ep, &ls, &rs, 1, 5000, s.err, sizeof(s.err)),
                 KVF_ERR_INVALID_PARAM);
    CHECK_EQ_INT(probe(&s, 10000), KVF_OK);   /* the endpoint still works */

    /* Every truncation of a real blob, and one byte too many, is refused
     * (quietly: each refusal logs an error). */
    kvf_ucx_ep_t *bad = NULL;
    kvf_log_set_level((kvf_log_level_t)-1);
    for (size_t len = 0; len < s.peer.blob_len; len++)
        CHECK_EQ_INT(kvf_ucx_connect(s.u, s.peer.blob, len, &bad, s.err, sizeof(s.err)),
                     KVF_ERR_PROTOCOL);
    uint8_t *longer = malloc(s.peer.blob_len + 1);
    memcpy(longer, s.peer.blob, s.peer.blob_len);
    longer[s.peer.blob_len] = 0;
    CHECK_EQ_INT(kvf_ucx_connect(s.u, longer, s.peer.blob_len + 1, &bad, s.err,
                                 sizeof(s.err)), KVF_ERR_PROTOCOL);
    /* A region count that cannot fit. */
    memcpy(longer, s.peer.blob, s.peer.blob_len);
    size_t addr_len = kvf_get_u32(longer + 4);
    kvf_put_u32(longer + 8 + addr_len, 0xffffffffu);
    CHECK_EQ_INT(kvf_ucx_connect(s.u, longer, s.peer.blob_len, &bad, s.err, sizeof(s.err)),
                 KVF_ERR_PROTOCOL);
    free(longer);
    kvf_log_set_level(KVF_LOG_WARN);
    CHECK(bad == NULL);
out:
    ucx_side_fini(&s);
}

/* A killed peer: the read fails within its timeout, and so do later ones. */
static void case_killed(void)
{
    ucx_side_t s;
    if (ucx_side_init(&s, PEER_LEN, LOCAL_LEN) != 0)
        goto out;
    CHECK_EQ_INT(probe(&s, 10000), KVF_OK);
    kill(s.peer.pid, SIGKILL);
    waitpid(s.peer.pid, NULL, 0);
    s.peer.pid = 0;

    struct iovec l = {s.local, 8 * MIB}, r = rptr(&s, 0, 8 * MIB);
    uint64_t t0 = kvf_now_ms();
    kvf_status_t st = read_wait(s.u, s.ep, &l, &r, 1, 3000, s.err, sizeof(s.err));
    uint64_t dt = kvf_now_ms() - t0;
    printf("  after SIGKILL: %s in %llu ms: %s\n", kvf_status_name(st),
           (unsigned long long)dt, s.err);
    CHECK(st == KVF_ERR_CONN_RESET || st == KVF_ERR_PEER_TIMEOUT);
    CHECK(dt < 3000 + 1500);   /* the timeout, plus the bound on closing */
    t0 = kvf_now_ms();
    CHECK(read_wait(s.u, s.ep, &l, &r, 1, 3000, s.err, sizeof(s.err)) != KVF_OK);
    CHECK(kvf_now_ms() - t0 < 100);   /* a dead endpoint fails at once */
out:
    ucx_side_fini(&s);
}

/* A stopped peer: a read that needs it times out (tcp emulates gets with
 * messages the peer must answer).  A truly one-sided get (RDMA, cma) is
 * served by a stopped process all the same: then it succeeds with the
 * right bytes, and noticing the stopped peer is the heartbeats' job. */
static void case_stopped(void)
{
    ucx_side_t s;
    if (ucx_side_init(&s, PEER_LEN, LOCAL_LEN) != 0)
        goto out;
    CHECK_EQ_INT(probe(&s, 10000), KVF_OK);
    kill(s.peer.pid, SIGSTOP);

    memset(s.local, 0, 4096);
    uint64_t t0 = kvf_now_ms();
    kvf_status_t st = probe(&s, 1000);
    uint64_t dt = kvf_now_ms() - t0;
    printf("  after SIGSTOP: %s in %llu ms%s%s\n", kvf_status_name(st),
           (unsigned long long)dt, st ? ": " : "", st ? s.err : "");
    if (strcmp(getenv("UCX_TLS"), "tcp") == 0)   /* gets are emulated on tcp */
        CHECK_EQ_INT(st, KVF_ERR_PEER_TIMEOUT);
    else
        CHECK(st == KVF_OK || st == KVF_ERR_PEER_TIMEOUT);
    if (st == KVF_ERR_PEER_TIMEOUT) {
        CHECK(dt >= 1000 && dt < 1000 + 1500);
        CHECK_STR_CONTAINS(s.err, "within 1000 ms");
        CHECK_EQ_INT(probe(&s, 1000), KVF_ERR_PEER_TIMEOUT);   /* the ep is dead */
    }
    kill(s.peer.pid, SIGCONT);
    kill(s.peer.pid, SIGKILL);
out:
    ucx_side_fini(&s);
}

/* Bandwidth of 4 MiB reads (KVF_UCX_BENCH=1): printed, never asserted. */
static void case_bench(void)
{
    if (getenv("KVF_UCX_BENCH") == NULL) {
        printf("  (set KVF_UCX_BENCH=1 for the 4 MiB read bandwidth)\n");
        return;
    }
    enum { PIECE = 4 * MIB, BATCH = 16 };
    ucx_side_t s;
    if (ucx_side_init(&s, BATCH * PIECE, BATCH * PIECE) != 0)
        goto out;
    struct iovec l[BATCH], r[BATCH];
    for (int i = 0; i < BATCH; i++) {
        l[i] = (struct iovec){s.local + (size_t)i * PIECE, PIECE};
        r[i] = rptr(&s, (uint64_t)i * PIECE, PIECE);
    }
    for (int one = 1; one >= 0; one--) {   /* one piece per read, then batches */
        size_t per = one ? 1 : BATCH;
        CHECK_EQ_INT(read_wait(s.u, s.ep, l, r, per, 20000, s.err, sizeof(s.err)), KVF_OK);
        uint64_t bytes = 0, t0 = kvf_now_ns();
        while (kvf_now_ns() - t0 < 2000000000ull) {
            if (read_wait(s.u, s.ep, l, r, per, 20000, s.err, sizeof(s.err)) != KVF_OK) {
                CHECK(0);
                break;
            }
            bytes += per * PIECE;
        }
        double sec = (double)(kvf_now_ns() - t0) / 1e9;
        printf("  bench UCX_TLS=%s: %zu x 4 MiB per read: %.1f MB/s\n",
               getenv("UCX_TLS"), per, (double)bytes / sec / 1e6);
    }
out:
    ucx_side_fini(&s);
}

/* ------------------------------------------------------ remote-key bounds */

/* Attributes as UCT reports them (UCX 1.13's memory domains and interfaces,
 * from its source): an InfiniBand HCA's memory domain packs an 8-byte key
 * that the HCA checks; rc and dc read remote memory themselves, ud only
 * sends messages; tcp's domain packs an empty key; cma needs none; posix
 * cannot register the engine's buffers. */
#define IB_MD  (UCT_MD_FLAG_REG | UCT_MD_FLAG_NEED_MEMH | UCT_MD_FLAG_NEED_RKEY | \
                UCT_MD_FLAG_ADVISE)
#define AM_IF  (UCT_IFACE_FLAG_AM_SHORT | UCT_IFACE_FLAG_AM_BCOPY | UCT_IFACE_FLAG_AM_ZCOPY)
#define RC_IF  (AM_IF | UCT_IFACE_FLAG_PUT_SHORT | UCT_IFACE_FLAG_PUT_ZCOPY | \
                UCT_IFACE_FLAG_GET_BCOPY | UCT_IFACE_FLAG_GET_ZCOPY)

static kvf_ucx_tl_t tl(const char *tl, const char *dev, int type, int aux, uint64_t md,
                       size_t rkey, uint64_t iface)
{
    kvf_ucx_tl_t t = {.dev_type = type, .aux = aux, .md_flags = md, .rkey_size = rkey,
                      .iface_flags = iface};
    snprintf(t.tl, sizeof(t.tl), "%s", tl);
    snprintf(t.dev, sizeof(t.dev), "%s", dev);
    return t;
}

#define RC      tl("rc_mlx5", "mlx5_0:1", UCT_DEVICE_TYPE_NET, 0, IB_MD, 8, RC_IF)
#define DC      tl("dc_mlx5", "mlx5_1:1", UCT_DEVICE_TYPE_NET, 0, IB_MD, 8, RC_IF)
#define UD_AUX  tl("ud_mlx5", "mlx5_0:1", UCT_DEVICE_TYPE_NET, 1, IB_MD, 8, AM_IF)
#define UD      tl("ud_mlx5", "mlx5_0:1", UCT_DEVICE_TYPE_NET, 0, IB_MD, 8, AM_IF)
#define TCP     tl("tcp", "eth0", UCT_DEVICE_TYPE_NET, 0, \
                   UCT_MD_FLAG_REG | UCT_MD_FLAG_NEED_RKEY, 0, AM_IF | UCT_IFACE_FLAG_PUT_ZCOPY)
#define CMA     tl("cma", "memory", UCT_DEVICE_TYPE_SHM, 0, UCT_MD_FLAG_REG, 0, 0)
#define POSIX   tl("posix", "memory", UCT_DEVICE_TYPE_SHM, 0, \
                   UCT_MD_FLAG_ALLOC | UCT_MD_FLAG_NEED_RKEY | UCT_MD_FLAG_RKEY_PTR, 24, 0)
#define SELF    tl("self", "memory0", UCT_DEVICE_TYPE_SELF, 0, \
                   UCT_MD_FLAG_REG | UCT_MD_FLAG_NEED_RKEY, 0, 0)
#define CUDA    tl("cuda_copy", "cuda", UCT_DEVICE_TYPE_ACC, 0, \
                   UCT_MD_FLAG_REG | UCT_MD_FLAG_ALLOC, 0, 0)

#define VERDICT(why, ...) \
    kvf_ucx_bounds_enforced((kvf_ucx_tl_t[]){__VA_ARGS__}, \
                            sizeof((kvf_ucx_tl_t[]){__VA_ARGS__}) / sizeof(kvf_ucx_tl_t), \
                            why, sizeof(why))

/* The rule, on both sides of it (no RDMA NIC needed). */
static void test_bounds_rule(void)
{
    char why[256];
    /* UCX_TLS=rc or dc on an InfiniBand host (ud carries connection setup);
     * self and accelerator copies are reached by this process alone. */
    CHECK_EQ_INT(VERDICT(why, RC, UD_AUX), 1);
    CHECK_EQ_INT(VERDICT(why, DC, UD_AUX), 1);
    CHECK_EQ_INT(VERDICT(why, RC, UD_AUX, DC, SELF, CUDA), 1);

    /* tcp beside RDMA: a peer with tcp only would get emulated gets. */
    CHECK_EQ_INT(VERDICT(why, RC, UD_AUX, TCP), 0);
    CHECK(strcmp(why, "tcp/eth0") == 0);
    /* Shared memory beside RDMA. */
    CHECK_EQ_INT(VERDICT(why, RC, UD_AUX, CMA, POSIX, SELF), 0);
    CHECK(strcmp(why, "cma/memory, posix/memory") == 0);
    /* ud alone moves every get in software. */
    CHECK_EQ_INT(VERDICT(why, UD), 0);
    CHECK_STR_CONTAINS(why, "ud_mlx5/mlx5_0:1");
    /* What this host's UCX reports under UCX_TLS=tcp, sm and all. */
    CHECK_EQ_INT(VERDICT(why, TCP), 0);
    CHECK_EQ_INT(VERDICT(why, CMA, POSIX), 0);
    CHECK_EQ_INT(VERDICT(why, SELF, TCP, POSIX, CMA), 0);
    CHECK(strcmp(why, "tcp/eth0, posix/memory, cma/memory") == 0);

    /* Nothing a peer can reach at all. */
    CHECK_EQ_INT(VERDICT(why, SELF, CUDA), 0);
    CHECK_STR_CONTAINS(why, "no network transport");
    CHECK_EQ_INT(kvf_ucx_bounds_enforced(NULL, 0, why, sizeof(why)), 0);

    /* Each attribute counts: an empty key, a memory domain that needs no
     * key or cannot register, an interface UCT could not open (no flags),
     * a device type UCT did not report. */
    kvf_ucx_tl_t t = RC;
    t.rkey_size = 0;
    CHECK_EQ_INT(VERDICT(why, t, UD_AUX), 0);
    t = RC;
    t.md_flags &= ~(uint64_t)UCT_MD_FLAG_NEED_RKEY;
    CHECK_EQ_INT(VERDICT(why, t, UD_AUX), 0);
    t = RC;
    t.md_flags &= ~(uint64_t)UCT_MD_FLAG_REG;
    CHECK_EQ_INT(VERDICT(why, t, UD_AUX), 0);
    t = RC;
    t.iface_flags = 0;
    CHECK_EQ_INT(VERDICT(why, t, UD_AUX), 0);
    t = RC;
    t.dev_type = -1;
    CHECK_EQ_INT(VERDICT(why, t, UD_AUX), 0);
    CHECK_STR_CONTAINS(why, "rc_mlx5/mlx5_0:1");

    /* A long list: the reason is cut, never overrun. */
    char small[12];
    CHECK_EQ_INT(VERDICT(small, TCP, CMA, POSIX, TCP, CMA, POSIX), 0);
    CHECK(strlen(small) < sizeof(small));
}

/* The transports of this context, as UCX and UCT report them. */
static int list_tls(kvf_ucx_tl_t *tls, size_t *n, char *why, size_t whylen)
{
    kvf_ucx_t *u = NULL;
    char err[512];
    *n = 0;
    CHECK_EQ_INT(kvf_ucx_create(&u, err, sizeof(err)), KVF_OK);
    if (u == NULL)
        return -1;
    CHECK_EQ_INT(kvf_ucx_transports(u, tls, KVF_UCX_MAX_TLS, n, err, sizeof(err)), KVF_OK);
    kvf_ucx_destroy(u);
    return kvf_ucx_bounds_enforced(tls, *n, why, whylen);
}

static int is_tl(const kvf_ucx_tl_t *t, const char *name)
{
    return strcmp(t->tl, name) == 0;
}

/* What UCX reports here under this UCX_TLS: the attributes `ucx_info -d`
 * shows for each transport, and the verdict they give. */
static void case_reported(void)
{
    kvf_ucx_tl_t tls[KVF_UCX_MAX_TLS];
    size_t n;
    char why[256];
    int enforced = list_tls(tls, &n, why, sizeof(why));
    printf("  %zu transports; bounds %s%s\n", n, enforced ? "enforced" : "not enforced: ",
           enforced ? "" : why);
    CHECK(n > 0);
    int unconfined = 0;   /* transports that cannot confine a peer */
    const uint64_t gets = UCT_IFACE_FLAG_GET_SHORT | UCT_IFACE_FLAG_GET_BCOPY |
                          UCT_IFACE_FLAG_GET_ZCOPY;
    for (size_t i = 0; i < n; i++) {
        const kvf_ucx_tl_t *t = &tls[i];
        char name[64];
        snprintf(name, sizeof(name), "%s/%s", t->tl, t->dev);
        CHECK(t->dev_type >= 0);   /* UCT described every one */
        if (is_tl(t, "tcp")) {     /* "remote key: 0 bytes", no get_* */
            CHECK_EQ_INT(t->dev_type, UCT_DEVICE_TYPE_NET);
            CHECK_EQ_INT(t->rkey_size, 0);
            CHECK((t->iface_flags & UCT_IFACE_FLAG_AM_BCOPY) != 0);   /* it was asked */
            CHECK((t->iface_flags & gets) == 0);
        } else if (is_tl(t, "cma")) {
            CHECK_EQ_INT(t->dev_type, UCT_DEVICE_TYPE_SHM);
            CHECK((t->md_flags & UCT_MD_FLAG_NEED_RKEY) == 0);
        } else if (is_tl(t, "posix") || is_tl(t, "sysv")) {
            CHECK_EQ_INT(t->dev_type, UCT_DEVICE_TYPE_SHM);
            CHECK((t->md_flags & UCT_MD_FLAG_REG) == 0);
        } else if (is_tl(t, "self")) {
            CHECK_EQ_INT(t->dev_type, UCT_DEVICE_TYPE_SELF);
            CHECK(strstr(why, name) == NULL);
            continue;
        }
        if (t->dev_type == UCT_DEVICE_TYPE_SHM || is_tl(t, "tcp")) {
            unconfined++;
            CHECK_STR_CONTAINS(why, name);
        }
    }
    if (unconfined > 0)
        CHECK_EQ_INT(enforced, 0);
}

/* The ucx mover of a prefill engine starts only where the bounds hold (or
 * KVF_UCX_SOFTWARE_RMA=allow); a decode engine's always (it offers nothing). */
static void case_mover(void)
{
    kvf_ucx_tl_t tls[KVF_UCX_MAX_TLS];
    size_t n;
    char why[256], err[512] = "";
    int enforced = list_tls(tls, &n, why, sizeof(why));
    static uint8_t buf[1 << 16];
    void *bases[1] = {buf};
    size_t lens[1] = {sizeof(buf)};
    kvf_mem_kind_t kinds[1] = {KVF_MEM_HOST};
    kvf_mover_params_t p = {.role = KVF_ROLE_PREFILL, .bases = bases, .lens = lens,
                            .n = 1, .mem_kind = KVF_MEM_HOST, .kinds = kinds, .by_name = 1};
    kvf_mover_t *m = NULL;

    unsetenv("KVF_UCX_SOFTWARE_RMA");
    kvf_status_t st = kvf_ucx_mover.create(&p, &m, err, sizeof(err));
    if (enforced) {
        CHECK_EQ_INT(st, KVF_OK);
    } else {
        printf("  prefill refused: %s\n", err);
        CHECK_EQ_INT(st, KVF_ERR_UNSUPPORTED);
        CHECK(m == NULL);
        CHECK_STR_CONTAINS(err, why);   /* names the transports */
        CHECK_STR_CONTAINS(err, "set UCX_TLS to RDMA transports only");
        CHECK_STR_CONTAINS(err, "KVF_UCX_SOFTWARE_RMA=allow");
        setenv("KVF_UCX_SOFTWARE_RMA", "yes", 1);   /* not the value: refused */
        CHECK_EQ_INT(kvf_ucx_mover.create(&p, &m, err, sizeof(err)), KVF_ERR_UNSUPPORTED);
        setenv("KVF_UCX_SOFTWARE_RMA", "allow", 1);
        CHECK_EQ_INT(kvf_ucx_mover.create(&p, &m, err, sizeof(err)), KVF_OK);
        unsetenv("KVF_UCX_SOFTWARE_RMA");
    }
    if (m != NULL) {
        kvf_buf_t b;
        kvf_buf_init(&b);
        kvf_mover_peer_t who = {1, 2};
        CHECK_EQ_INT(m->ops->pack(m, &who, &b), KVF_OK);
        CHECK(b.len > 12);
        kvf_buf_free(&b);
        m->ops->destroy(m);
    }
    p.role = KVF_ROLE_DECODE;
    m = NULL;
    CHECK_EQ_INT(kvf_ucx_mover.create(&p, &m, err, sizeof(err)), KVF_OK);
    if (m != NULL)
        m->ops->destroy(m);
}

/* ---- an engine pair asked for ucx where UCX moves reads in software */

/* Both sides over ucx, the library's transfer deadline. */
static void ucx_engine_side(side_t *s, kvf_role_t role, const char *bs)
{
    side_transport = "ucx";
    side_transfer_ms = 0;
    side_init(s, role, bs, NULL);
}

/* One room between a prefill and a decode engine that both ask for ucx:
 * every byte verified; the payload went over `want`. */
static void pair_room(const char *want)
{
    side_t pre, dec;
    char bs[64];
    ucx_engine_side(&pre, KVF_ROLE_PREFILL, "127.0.0.1:0");
    CHECK_EQ_INT(kvf_engine_bootstrap_addr(pre.eng, bs, sizeof(bs)), KVF_OK);
    ucx_engine_side(&dec, KVF_ROLE_DECODE, NULL);
    memcpy(pre.aux + AUX_B, "bounds-room-0007", AUX_B);

    uint32_t src[5] = {3, 4, 5, 20, 9}, dst[5] = {30, 0, 1, 2, 17};
    kvf_sender_t *s = NULL;
    kvf_receiver_t *r = NULL;
    CHECK_EQ_INT(kvf_sender_create(pre.eng, bs, 7, &s), KVF_OK);
    CHECK_EQ_INT(kvf_receiver_create(dec.eng, bs, 7, -1, &r), KVF_OK);
    CHECK_EQ_INT(kvf_receiver_init(r, dst, 5, 2, NULL, 0), KVF_OK);
    CHECK_EQ_INT(wait_sender(s, KVF_POLL_WAITING_FOR_INPUT), KVF_POLL_WAITING_FOR_INPUT);
    CHECK_EQ_INT(kvf_sender_init(s, 5, 1), KVF_OK);
    CHECK_EQ_INT(kvf_sender_send(s, src, 5, 1), KVF_OK);
    wait_final(s, r);
    CHECK_EQ_INT(kvf_sender_poll(s), KVF_POLL_SUCCESS);
    CHECK_EQ_INT(kvf_receiver_poll(r), KVF_POLL_SUCCESS);
    for (int b = 0; b < NKV; b++)
        for (int i = 0; i < 5; i++)
            CHECK(memcmp(dec.kv[b] + (size_t)dst[i] * PAGE_B,
                         pre.kv[b] + (size_t)src[i] * PAGE_B, PAGE_B) == 0);
    CHECK(memcmp(dec.aux + 2 * AUX_B, "bounds-room-0007", AUX_B) == 0);
    kvf_sender_destroy(s);
    kvf_receiver_destroy(r);

    kvf_engine_stats_t st;
    kvf_engine_stats_init(&st);
    kvf_engine_stats(dec.eng, &st);
    printf("  payload over %s\n", kvf_engine_transport(dec.eng));
    CHECK(strcmp(kvf_engine_transport(dec.eng), want) == 0);
    CHECK(strcmp(kvf_engine_transport(pre.eng), want) == 0);
    /* One peer, counted in the path its payload took, by name. */
    for (unsigned i = 0; kvf_transport_name(i) != NULL; i++)
        CHECK_EQ_INT(st.peers_by_path[i], strcmp(kvf_transport_name(i), want) == 0);
    CHECK_EQ_INT(st.rooms_succeeded, 1);
    side_fini(&dec);
    side_fini(&pre);
}

static void case_pair(void)
{
    kvf_ucx_tl_t tls[KVF_UCX_MAX_TLS];
    size_t n;
    char why[256];
    CHECK_EQ_INT(list_tls(tls, &n, why, sizeof(why)), 0);   /* software here */
    unsetenv("KVF_UCX_SOFTWARE_RMA");
    pair_room("tcp");   /* no offer, no worker address, no key */
    setenv("KVF_UCX_SOFTWARE_RMA", "allow", 1);
    pair_room("ucx");   /* the same room over ucx, once allowed */
    unsetenv("KVF_UCX_SOFTWARE_RMA");
}

/* Run fn in a forked runner with UCX_TLS=tls; its failures become ours. */
static void run_under(void (*fn)(void), const char *name, const char *tls)
{
    printf("  -- %s, UCX_TLS=%s\n", name, tls);
    fflush(stdout);
    pid_t pid = fork();
    if (pid == 0) {
        setenv("UCX_TLS", tls, 1);
        alarm(RUN_MS / 1000);   /* the runner's own watchdog */
        kvf_test_failures_ = 0;
        fn();
        fflush(stdout);
        exit(kvf_test_failures_ ? 1 : 0);   /* leak check in sanitizer builds */
    }
    CHECK(pid > 0);
    int status = 0;
    if (!wait_child(pid, &status, RUN_MS + 5000)) {
        kill(pid, SIGKILL);
        waitpid(pid, &status, 0);
    }
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0)
        fprintf(stderr, "  %s under UCX_TLS=%s failed (%s %d)\n", name, tls,
                WIFEXITED(status) ? "exit" : "signal",
                WIFEXITED(status) ? WEXITSTATUS(status) : WTERMSIG(status));
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
}

static void run_per_tls(void (*fn)(void), const char *name)
{
    tls_init();
    for (size_t t = 0; t < ntls; t++)
        run_under(fn, name, tls_sets[t]);
}

#define PER_TLS(fn) \
    static void test_##fn(void) { run_per_tls(case_##fn, #fn); }
PER_TLS(scatter)
PER_TLS(refuse)
PER_TLS(killed)
PER_TLS(stopped)
PER_TLS(bench)
PER_TLS(reported)
PER_TLS(mover)

/* UCX_TLS=tcp: UCX emulates every get in software (with UCX_TLS=tcp set
 * explicitly, whatever KVF_TEST_UCX_TLS says). */
static void test_pair_software_rma(void)
{
    run_under(case_pair, "pair", "tcp");
}

static void test_available(void)
{
    CHECK_EQ_INT(kvf_ucx_available(), 1);
}

KVF_TEST_MAIN(KVF_CASE(test_available), KVF_CASE(test_scatter), KVF_CASE(test_refuse),
              KVF_CASE(test_killed), KVF_CASE(test_stopped), KVF_CASE(test_bench),
              KVF_CASE(test_bounds_rule), KVF_CASE(test_reported), KVF_CASE(test_mover),
              KVF_CASE(test_pair_software_rma))

#endif /* KVF_HAVE_UCX */
