/*
 * Strangers cost an engine a nuisance, never its memory, CPU or
 * descriptors, and legitimate peers are served through their flood.
 *
 * The engine under attack runs in a child process (engine_child_t), so
 * that its RSS and CPU time can be read from /proc and its descriptors
 * limited; the strangers and the legitimate decode engine are this
 * process.  docs/SECURITY.md states the bounds these cases measure.
 */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "bootstrap/bootstrap.h"
#include "core/auth.h"
#include "kvferry/kvferry.h"
#include "unit/kvf_sides.h"
#include "unit/kvf_test.h"
#include "unit/kvf_wire_peer.h"

#define TOKEN "flood-test-token-0123456789abcdef"

/* A sanitizer's shadow memory, redzones and quarantine are in the RSS. */
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define KVF_TEST_SANITIZED 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#define KVF_TEST_SANITIZED 1
#endif
#endif

/* What docs/SECURITY.md states one unauthenticated connection may hold of
 * an engine's memory, at most. */
#define CONN_BOUND (4u << 10)

static unsigned tune_handshake_ms, tune_bootstrap_ms, tune_heartbeat_ms, tune_streams = 1;

static void tune(kvf_engine_params_t *p)
{
    p->streams = tune_streams;
    if (tune_handshake_ms)
        p->handshake_timeout_ms = tune_handshake_ms;
    if (tune_bootstrap_ms)
        p->bootstrap_timeout_ms = tune_bootstrap_ms;
    if (tune_heartbeat_ms)
        p->heartbeat_timeout_ms = tune_heartbeat_ms;
}

/* ---- a prefill engine in a child process ------------------------------- */

#define CMD_REFUSED UINT64_MAX    /* instead of a room: report auth_refused */

typedef struct engine_child {
    pid_t pid;
    int   cmd;        /* to the child: the registry's address, then rooms (0: exit) */
    int   res;        /* from it: its port, then each room's state */
    int   port;
} engine_child_t;

static void child_main(int cmd, int res, rlim_t nofile, int log_fd)
{
    char bs[64];
    side_t pre;
    alarm(90);                                  /* never outlive the test */
    if (read(cmd, bs, sizeof(bs)) != sizeof(bs))
        _exit(99);
    if (log_fd >= 0)
        dup2(log_fd, STDERR_FILENO);
    struct rlimit rl = {nofile, nofile};
    if (nofile != 0 && setrlimit(RLIMIT_NOFILE, &rl) != 0)
        _exit(98);
    side_tune = tune;
    side_init(&pre, KVF_ROLE_PREFILL, bs, TOKEN);
    int port = port_of(pre.eng);
    if (write(res, &port, sizeof(port)) != sizeof(port))
        _exit(97);
    uint64_t room;
    while (read(cmd, &room, sizeof(room)) == sizeof(room) && room != 0) {
        uint64_t out = room == CMD_REFUSED ? engine_stats(pre.eng).auth_refused
                                           : (uint64_t)legit_send(&pre, bs, room);
        if (write(res, &out, sizeof(out)) != sizeof(out))
            _exit(96);
    }
    side_fini(&pre);
    _exit(kvf_test_failures_ ? 1 : 0);
}

/* Forked before any thread of this process exists; the child waits for
 * engine_child_start to tell it where the registry is.  nofile: its
 * RLIMIT_NOFILE (0: as it is); log_fd: where its log goes (-1: stderr). */
static engine_child_t engine_child_fork(rlim_t nofile, int log_fd)
{
    int c[2], r[2];
    engine_child_t ch = {-1, -1, -1, 0};
    if (pipe(c) != 0 || pipe(r) != 0)
        return ch;
    fflush(NULL);                     /* nothing buffered is written twice */
    ch.pid = fork();
    if (ch.pid == 0) {
        close(c[1]);
        close(r[0]);
        child_main(c[0], r[1], nofile, log_fd);
    }
    close(c[0]);
    close(r[1]);
    ch.cmd = c[1];
    ch.res = r[0];
    return ch;
}

static int engine_child_start(engine_child_t *ch, const char *bs)
{
    char buf[64] = {0};
    snprintf(buf, sizeof(buf), "%s", bs);
    struct pollfd pfd = {ch->res, POLLIN, 0};
    return write(ch->cmd, buf, sizeof(buf)) == sizeof(buf) && poll(&pfd, 1, 20000) == 1 &&
           read(ch->res, &ch->port, sizeof(ch->port)) == sizeof(ch->port);
}

/* Ask the child (a room it serves, or CMD_REFUSED) and wait for its answer. */
static uint64_t engine_child_ask(engine_child_t *ch, uint64_t what)
{
    uint64_t out = UINT64_MAX;
    struct pollfd pfd = {ch->res, POLLIN, 0};
    if (write(ch->cmd, &what, sizeof(what)) != sizeof(what) || poll(&pfd, 1, 30000) != 1 ||
        read(ch->res, &out, sizeof(out)) != sizeof(out))
        return UINT64_MAX;
    return out;
}

/* Send it a room to serve; its state comes with engine_child_result. */
static void engine_child_serve(engine_child_t *ch, uint64_t room)
{
    CHECK(write(ch->cmd, &room, sizeof(room)) == sizeof(room));
}

static uint64_t engine_child_result(engine_child_t *ch)
{
    uint64_t out = UINT64_MAX;
    struct pollfd pfd = {ch->res, POLLIN, 0};
    if (poll(&pfd, 1, 30000) != 1 || read(ch->res, &out, sizeof(out)) != sizeof(out))
        return UINT64_MAX;
    return out;
}

static int engine_child_end(engine_child_t *ch)
{
    uint64_t zero = 0;
    int status = -1;
    CHECK(write(ch->cmd, &zero, sizeof(zero)) == sizeof(zero));
    close(ch->cmd);
    close(ch->res);
    CHECK(waitpid(ch->pid, &status, 0) == ch->pid);
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

/* A "VmRSS:"-style line of /proc/pid/status, in KiB (-1: none). */
static long proc_status_kib(pid_t pid, const char *key)
{
    char path[64], line[256];
    long v = -1;
    snprintf(path, sizeof(path), "/proc/%d/status", (int)pid);
    FILE *f = fopen(path, "r");
    while (f != NULL && fgets(line, sizeof(line), f) != NULL)
        if (strncmp(line, key, strlen(key)) == 0)
            v = strtol(line + strlen(key), NULL, 10);
    if (f != NULL)
        fclose(f);
    return v;
}

/* Start VmHWM over from the present RSS (Linux 4.0 and later). */
static int reset_peak(pid_t pid)
{
    char path[64];
    snprintf(path, sizeof(path), "/proc/%d/clear_refs", (int)pid);
    FILE *f = fopen(path, "w");
    int ok = f != NULL && fputs("5", f) >= 0;
    if (f != NULL)
        ok &= fclose(f) == 0;
    return ok;
}

/* CPU seconds (user + system) the process has used. */
static double proc_cpu_s(pid_t pid)
{
    char path[64], buf[1024];
    snprintf(path, sizeof(path), "/proc/%d/stat", (int)pid);
    FILE *f = fopen(path, "r");
    size_t n = f != NULL ? fread(buf, 1, sizeof(buf) - 1, f) : 0;
    if (f != NULL)
        fclose(f);
    buf[n] = '\0';
    /* Fields 14 and 15, counted after the ")" that ends the command name. */
    const char *p = strrchr(buf, ')');
    unsigned long long ut = 0, st = 0;
    if (p == NULL || sscanf(p + 2, "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %llu %llu",
                            &ut, &st) != 2)
        return -1;
    return (double)(ut + st) / (double)sysconf(_SC_CLK_TCK);
}

/* The engine has accepted and read all of `n` connections to its port:
 * /proc/net/tcp shows n established sockets on that local port with
 * nothing left in their receive queues (waits 10 s at most). */
static int engine_read_all(int port, int n)
{
    for (uint64_t until = kvf_now_ms() + 10000; kvf_now_ms() < until; sleep_ms(5)) {
        char line[512];
        int seen = 0, queued = 0;
        FILE *f = fopen("/proc/net/tcp", "r");
        while (f != NULL && fgets(line, sizeof(line), f) != NULL) {
            unsigned lport, st;
            unsigned long txq, rxq;
            if (sscanf(line, " %*d: %*x:%x %*x:%*x %x %lx:%lx", &lport, &st, &txq, &rxq) == 4 &&
                (int)lport == port && st == 1) {
                seen++;
                queued += rxq != 0;
            }
        }
        if (f != NULL)
            fclose(f);
        if (seen >= n && queued == 0)
            return 1;
    }
    return 0;
}

/* Connections from 127.0.0.1 to port, each once the engine sent its AUTH
 * (accepted, its buffers made).  @return how many. */
static int strangers_open(int *fds, int n, int port)
{
    uint8_t body[256];
    kvf_msg_t m;
    int k = 0;
    for (; k < n; k++) {
        fds[k] = dial(port);
        if (fds[k] < 0 || wp_recv(fds[k], &m, body, sizeof(body), 5000) != KVF_MSG_AUTH) {
            if (fds[k] >= 0)
                close(fds[k]);
            break;
        }
    }
    return k;
}

/* The engine closed fd (EOF or reset) within ms, whatever it sent first
 * (its AUTH). */
static int closed_within(int fd, unsigned ms)
{
    uint8_t sink[256];
    for (uint64_t until = kvf_now_ms() + ms; kvf_now_ms() < until;) {
        struct pollfd pfd = {fd, POLLIN, 0};
        if (poll(&pfd, 1, (int)(until - kvf_now_ms())) != 1)
            return 0;
        if (recv(fd, sink, sizeof(sink), 0) <= 0)
            return 1;
    }
    return 0;
}

/* Wait until the engine closed each, then close ours.  @return how many it
 * closed within ms (from the call). */
static int strangers_closed(int *fds, int n, unsigned ms)
{
    uint64_t until = kvf_now_ms() + ms;
    int closed = 0;
    for (int i = 0; i < n; i++) {
        uint64_t now = kvf_now_ms();
        closed += closed_within(fds[i], now < until ? (unsigned)(until - now) : 0);
        close(fds[i]);
    }
    return closed;
}

static void strangers_close(int *fds, int n)
{
    for (int i = 0; i < n; i++)
        close(fds[i]);
}

/* A frame header claiming `len` body bytes of `type`, then `fill` bytes:
 * the magic and version first (so that an AUTH's prefix is this
 * version's), the rest zeros.  Sent as far as the socket takes it. */
static void send_claim(int fd, uint8_t type, uint32_t len, size_t fill)
{
    static uint8_t buf[8 + (256 << 10)];
    memset(buf, 0, sizeof(buf));
    kvf_put_u32(buf, len);
    buf[4] = type;
    kvf_put_u32(buf + 8, KVF_WIRE_MAGIC);
    kvf_put_u16(buf + 12, KVF_WIRE_VERSION);
    size_t n = 8 + (fill < sizeof(buf) - 8 ? fill : sizeof(buf) - 8);
    ssize_t sent = send(fd, buf, n, MSG_NOSIGNAL | MSG_DONTWAIT);
    (void)sent;
}

/* ------------------------------------------------------------------------ */

/*
 * Memory.  128 strangers from one address (the cap) each claim a 16 MiB
 * frame and send 256 KiB of it: every one is closed at its header, long
 * before its handshake deadline, and refused.  Then 128 that send a valid
 * AUTH and half a header and hold on: the engine keeps them until their
 * deadline, at most CONN_BOUND each.  The engine's peak RSS over both
 * grows by less than 128 * CONN_BOUND and 1 MiB (what first use of the
 * allocator's arenas and the log's buffers costs, whatever the count).
 * A room succeeds afterwards.
 */
static void test_strangers_cost_little_memory(void)
{
    enum { N = KVF_MAX_UNAUTH_PER_HOST };
    static int fds[N];
    char bs[64];
    kvf_bootstrap_t *reg;
    side_t dec;

    clear_env();
    tune_handshake_ms = 30000;        /* a close before it is a refusal */
    engine_child_t ch = engine_child_fork(0, -1);
    CHECK(ch.pid > 0);
    CHECK_EQ_INT(kvf_bootstrap_create("127.0.0.1", 0, &reg), KVF_OK);
    snprintf(bs, sizeof(bs), "127.0.0.1:%d", kvf_bootstrap_port(reg));
    CHECK(engine_child_start(&ch, bs));
    side_tune = tune;
    side_init(&dec, KVF_ROLE_DECODE, NULL, TOKEN);

    /* A room first: what a legitimate peer costs is in the baseline. */
    kvf_receiver_t *r = legit_recv_start(&dec, bs, 1);
    engine_child_serve(&ch, 1);
    CHECK_EQ_INT(wait_receiver(r, KVF_POLL_SUCCESS), KVF_POLL_SUCCESS);
    CHECK_EQ_INT(engine_child_result(&ch), KVF_POLL_SUCCESS);
    kvf_receiver_destroy(r);
    uint64_t refused0 = engine_child_ask(&ch, CMD_REFUSED);
    CHECK(reset_peak(ch.pid));
    long base = proc_status_kib(ch.pid, "VmRSS:");

    /* Claims of 16 MiB (DATA, and an AUTH of this version), then 256 KiB. */
    CHECK_EQ_INT(strangers_open(fds, N, ch.port), N);
    for (int i = 0; i < N; i++)
        send_claim(fds[i], i % 2 ? KVF_MSG_DATA : KVF_MSG_AUTH, KVF_WIRE_MAX_BODY, 256 << 10);
    CHECK_EQ_INT(strangers_closed(fds, N, 10000), N);
    CHECK_EQ_INT(engine_child_ask(&ch, CMD_REFUSED) - refused0, N);

    /* Held: a valid AUTH and half of the next header, read by the engine. */
    CHECK_EQ_INT(strangers_open(fds, N, ch.port), N);
    for (int i = 0; i < N; i++) {
        kvf_msg_t a = wp_auth_msg(KVF_ROLE_DECODE, "");
        uint8_t half[4] = {KVF_WIRE_MAC_LEN, 0, 0, 0};
        CHECK(wp_send(fds[i], &a, NULL, 0) && send(fds[i], half, 4, MSG_NOSIGNAL) == 4);
    }
    CHECK(engine_read_all(ch.port, N));
    long peak = proc_status_kib(ch.pid, "VmHWM:");
    long held = proc_status_kib(ch.pid, "VmRSS:");
    long bound = (long)N * CONN_BOUND / 1024 + 1024;
    fprintf(stderr, "  engine RSS %ld KiB; peak over the flood +%ld KiB, with %d strangers "
            "held +%ld KiB (bound +%ld KiB)\n", base, peak - base, N, held - base, bound);
    CHECK(base > 0 && peak > 0 && held > 0);
#ifndef KVF_TEST_SANITIZED
    CHECK(peak - base < bound);
#else
    fprintf(stderr, "  (sanitizer build: its shadow memory is in the RSS; the bound is "
            "checked in the other builds)\n");
#endif
    strangers_close(fds, N);

    r = legit_recv_start(&dec, bs, 2);
    engine_child_serve(&ch, 2);
    CHECK_EQ_INT(wait_receiver(r, KVF_POLL_SUCCESS), KVF_POLL_SUCCESS);
    CHECK(legit_bytes(&dec));
    CHECK_EQ_INT(engine_child_result(&ch), KVF_POLL_SUCCESS);
    kvf_receiver_destroy(r);
    CHECK_EQ_INT(engine_child_end(&ch), 0);
    side_fini(&dec);
    kvf_bootstrap_destroy(reg);
    side_tune = NULL;
    tune_handshake_ms = 0;
}

/* Lines of the file that contain `what`. */
static int lines_with(int fd, const char *what)
{
    char line[2048];
    int n = 0;
    FILE *f = fdopen(dup(fd), "r");
    if (f == NULL)
        return -1;
    rewind(f);
    while (fgets(line, sizeof(line), f) != NULL)
        n += strstr(line, what) != NULL;
    fclose(f);
    return n;
}

/*
 * Descriptors.  An engine with RLIMIT_NOFILE 64 meets 256 connections at
 * once: it takes what its descriptors allow and sheds the rest (accepted
 * and closed at once), and the ones it took end at its handshake deadline
 * (1.5 s).  Meanwhile it does not spin: its CPU time over the flood stays
 * under a quarter of the wall time.  A listener that spins on EMFILE
 * costs a whole core for as long as the flood's connections stay pending
 * (at least half the wall time even on a loaded 2-CPU machine, since the
 * spinning thread is always runnable); accepting and closing a few
 * hundred connections and the 50 ms tick cost milliseconds.  Its log
 * says so in a line or two, not once per turn; and a decode engine that
 * dials during the flood gets its room, within the room's deadline.
 */
static void test_descriptor_flood_sheds(void)
{
    enum { N = 256 };
    static int fds[N];
    char bs[64], logpath[] = "/tmp/kvf_flood_XXXXXX";
    kvf_bootstrap_t *reg;
    side_t dec;

    clear_env();
    int logfd = mkstemp(logpath);
    CHECK(logfd >= 0);
    unlink(logpath);
    tune_handshake_ms = 1500;
    engine_child_t ch = engine_child_fork(64, logfd);
    CHECK(ch.pid > 0);
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < 2 * N) {
        rl.rlim_cur = rl.rlim_max < 2 * N ? rl.rlim_max : 2 * N;
        setrlimit(RLIMIT_NOFILE, &rl);
    }
    CHECK_EQ_INT(kvf_bootstrap_create("127.0.0.1", 0, &reg), KVF_OK);
    snprintf(bs, sizeof(bs), "127.0.0.1:%d", kvf_bootstrap_port(reg));
    CHECK(engine_child_start(&ch, bs));
    side_tune = tune;
    tune_handshake_ms = 0;
    tune_bootstrap_ms = 10000;
    side_init(&dec, KVF_ROLE_DECODE, NULL, TOKEN);

    uint64_t t0 = kvf_now_ms();
    double cpu0 = proc_cpu_s(ch.pid);
    int n = 0;
    for (; n < N && (fds[n] = dial(ch.port)) >= 0; n++)
        ;
    CHECK_EQ_INT(n, N);
    kvf_receiver_t *r = legit_recv_start(&dec, bs, 3);
    engine_child_serve(&ch, 3);
    /* The window ends when the engine has closed every one of them. */
    CHECK_EQ_INT(strangers_closed(fds, n, 10000), n);
    double cpu = proc_cpu_s(ch.pid) - cpu0, wall = (double)(kvf_now_ms() - t0) / 1000.0;
    CHECK_EQ_INT(wait_receiver(r, KVF_POLL_SUCCESS), KVF_POLL_SUCCESS);
    CHECK(legit_bytes(&dec));
    CHECK_EQ_INT(engine_child_result(&ch), KVF_POLL_SUCCESS);
    kvf_receiver_destroy(r);
    uint64_t refused = engine_child_ask(&ch, CMD_REFUSED);
    int shed_lines = lines_with(logfd, "out of file descriptors");
    int emfile_lines = lines_with(logfd, "Too many open files");
    fprintf(stderr, "  %d connections at RLIMIT_NOFILE 64: engine CPU %.3f s over %.2f s; "
            "%llu refused; log lines: %d about descriptors, %d with EMFILE\n", n, cpu, wall,
            (unsigned long long)refused, shed_lines, emfile_lines);
    CHECK(cpu >= 0 && cpu < 0.25 * wall);
    CHECK(shed_lines >= 1 && shed_lines <= 3);
    CHECK(emfile_lines <= 3);
    CHECK(refused >= (uint64_t)n);    /* shed, and the held ones at their deadline */
    CHECK_EQ_INT(engine_child_end(&ch), 0);
    side_fini(&dec);
    kvf_bootstrap_destroy(reg);
    close(logfd);
    side_tune = NULL;
    tune_bootstrap_ms = 0;
}

/* The prefill engine turned a connection away, or the room moved on. */
typedef struct refusal {
    kvf_engine_t   *pre;
    kvf_receiver_t *r;
    uint64_t        before;
} refusal_t;

static int refused_or_moved(const void *arg)
{
    const refusal_t *rf = arg;
    return engine_stats(rf->pre).auth_refused != rf->before ||
           kvf_receiver_poll(rf->r) != KVF_POLL_BOOTSTRAPPING;
}

/*
 * The pending queue.  Strangers hold all 128 slots for connections from
 * 127.0.0.1 that are still authenticating; a decode engine on the same
 * address starts a room.  Its connection is closed before the handshake
 * (busy), it dials again, and it gets in once the strangers let go, or
 * once the prefill closed them at their handshake deadline (2 s): the
 * room succeeds within its own deadline (8 s) both times.
 */
static void test_dialler_waits_out_a_full_queue(void)
{
    enum { N = KVF_MAX_UNAUTH_PER_HOST };
    static int fds[N];
    side_t pre, dec;
    char bs[64];

    clear_env();
    side_tune = tune;
    tune_handshake_ms = 2000;
    side_init(&pre, KVF_ROLE_PREFILL, "127.0.0.1:0", TOKEN);
    CHECK_EQ_INT(kvf_engine_bootstrap_addr(pre.eng, bs, sizeof(bs)), KVF_OK);
    tune_handshake_ms = 0;
    tune_bootstrap_ms = 8000;
    side_init(&dec, KVF_ROLE_DECODE, NULL, TOKEN);
    int port = port_of(pre.eng);

    /* They let go once the decode engine was turned away. */
    CHECK_EQ_INT(strangers_open(fds, N, port), N);
    uint64_t before = engine_stats(pre.eng).auth_refused;
    kvf_receiver_t *r = legit_recv_start(&dec, bs, 4);
    refusal_t rf = {pre.eng, r, before};
    CHECK(wait_until(refused_or_moved, &rf, KVF_TEST_WAIT_MS));
    CHECK_EQ_INT(kvf_receiver_poll(r), KVF_POLL_BOOTSTRAPPING);
    strangers_close(fds, N);
    CHECK_EQ_INT(legit_send(&pre, bs, 4), KVF_POLL_SUCCESS);
    CHECK_EQ_INT(wait_receiver(r, KVF_POLL_SUCCESS), KVF_POLL_SUCCESS);
    CHECK(legit_bytes(&dec));
    kvf_receiver_destroy(r);
    side_fini(&dec);

    /* They hold on: the prefill closes them at their deadline. */
    side_init(&dec, KVF_ROLE_DECODE, NULL, TOKEN);
    CHECK_EQ_INT(strangers_open(fds, N, port), N);
    uint64_t t0 = kvf_now_ms();
    CHECK(legit_room(&pre, &dec, bs, 5));
    uint64_t took = kvf_now_ms() - t0;
    CHECK_EQ_INT(strangers_closed(fds, N, 5000), N);
    fprintf(stderr, "  room through a full queue: %llu ms (the queue's deadline 2000 ms, "
            "the room's 8000 ms)\n", (unsigned long long)took);
    side_fini(&dec);
    side_fini(&pre);
    side_tune = NULL;
    tune_bootstrap_ms = 0;
}

/*
 * A room whose deadline passes while the queue stays full fails then, and
 * says why: the prefill rank turned its connections away.  Once the
 * strangers are gone, the next room on the same engines succeeds.  The
 * strangers send nothing, so the prefill would call them dead at its
 * heartbeat timeout (2.5 s by default, as long as the room's deadline
 * here, and counted from the first stranger, before the room began): the
 * decode rank's redial could then get in just before its deadline, and
 * the room fail later for another reason.  So the prefill waits 30 s for
 * them both ways, handshake and heartbeat.
 */
static void test_full_queue_fails_at_the_deadline(void)
{
    enum { N = KVF_MAX_UNAUTH_PER_HOST };
    static int fds[N];
    side_t pre, dec;
    char bs[64];
    kvf_failure_t f;
    kvf_failure_init(&f);

    clear_env();
    side_tune = tune;
    tune_handshake_ms = tune_heartbeat_ms = 30000;
    side_init(&pre, KVF_ROLE_PREFILL, "127.0.0.1:0", TOKEN);
    CHECK_EQ_INT(kvf_engine_bootstrap_addr(pre.eng, bs, sizeof(bs)), KVF_OK);
    tune_handshake_ms = tune_heartbeat_ms = 0;
    tune_bootstrap_ms = 2500;     /* a redial comes within 1 s of the queue emptying */
    side_init(&dec, KVF_ROLE_DECODE, NULL, TOKEN);
    tune_bootstrap_ms = 0;

    CHECK_EQ_INT(strangers_open(fds, N, port_of(pre.eng)), N);
    kvf_receiver_t *r = legit_recv_start(&dec, bs, 6);
    CHECK_EQ_INT(wait_receiver(r, KVF_POLL_SUCCESS), KVF_POLL_FAILED);
    CHECK_EQ_INT(kvf_receiver_failure(r, &f), KVF_OK);
    CHECK_EQ_INT(f.status, KVF_ERR_TIMED_OUT);
    CHECK_STR_CONTAINS(f.reason, "room 6 made no progress in Bootstrapping");
    CHECK_STR_CONTAINS(f.reason, "before its handshake");
    CHECK_STR_CONTAINS(f.reason, "still authenticating");
    kvf_receiver_destroy(r);
    strangers_close(fds, N);
    CHECK(legit_room(&pre, &dec, bs, 7));
    side_fini(&dec);
    side_fini(&pre);
    side_tune = NULL;
}

/* ---- a proxy that turns one connection away ----------------------------- */

#define PROXY_PAIRS 8

/* Forwards connections to 127.0.0.1:to_port, but closes its `refuse`-th
 * (1-based) at once, unread, as a busy prefill engine does. */
typedef struct proxy {
    int        lfd, port, to_port, refuse;
    int        fd[PROXY_PAIRS][2];   /* accepted, upstream; -1: free */
    atomic_int accepted, stop;
    pthread_t  thread;
} proxy_t;

static void proxy_accept(proxy_t *px)
{
    int c = accept4(px->lfd, NULL, NULL, SOCK_CLOEXEC);
    if (c < 0)
        return;
    if (atomic_fetch_add(&px->accepted, 1) + 1 == px->refuse) {
        close(c);
        return;
    }
    for (int i = 0; i < PROXY_PAIRS; i++)
        if (px->fd[i][0] < 0) {
            px->fd[i][0] = c;
            px->fd[i][1] = dial(px->to_port);
            return;
        }
    close(c);
}

static void *proxy_main(void *arg)
{
    proxy_t *px = arg;
    static uint8_t buf[1 << 16];
    while (!atomic_load(&px->stop)) {
        struct pollfd pf[1 + 2 * PROXY_PAIRS];
        pf[0] = (struct pollfd){px->lfd, POLLIN, 0};
        for (int i = 0; i < PROXY_PAIRS; i++)
            for (int k = 0; k < 2; k++)
                pf[1 + 2 * i + k] = (struct pollfd){px->fd[i][k], POLLIN, 0};
        if (poll(pf, 1 + 2 * PROXY_PAIRS, 50) <= 0)
            continue;
        if (pf[0].revents & POLLIN)
            proxy_accept(px);
        for (int i = 0; i < PROXY_PAIRS; i++)
            for (int k = 0; k < 2; k++) {
                if (px->fd[i][k] < 0 || !pf[1 + 2 * i + k].revents)
                    continue;
                ssize_t n = recv(px->fd[i][k], buf, sizeof(buf), 0);
                if (n > 0 && px->fd[i][!k] >= 0 &&
                    send(px->fd[i][!k], buf, (size_t)n, MSG_NOSIGNAL) == n)
                    continue;
                close(px->fd[i][0]);       /* either side gone: both go */
                if (px->fd[i][1] >= 0)
                    close(px->fd[i][1]);
                px->fd[i][0] = px->fd[i][1] = -1;
            }
    }
    return NULL;
}

static int proxy_start(proxy_t *px, int to_port, int refuse)
{
    struct sockaddr_in sa = {.sin_family = AF_INET};
    socklen_t len = sizeof(sa);
    inet_pton(AF_INET, "127.0.0.1", &sa.sin_addr);
    memset(px->fd, 0xff, sizeof(px->fd));
    px->to_port = to_port;
    px->refuse = refuse;
    atomic_init(&px->accepted, 0);
    atomic_init(&px->stop, 0);
    px->lfd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (px->lfd < 0 || bind(px->lfd, (struct sockaddr *)&sa, sizeof(sa)) != 0 ||
        listen(px->lfd, 16) != 0 || getsockname(px->lfd, (struct sockaddr *)&sa, &len) != 0)
        return 0;
    px->port = ntohs(sa.sin_port);
    return pthread_create(&px->thread, NULL, proxy_main, px) == 0;
}

static void proxy_stop(proxy_t *px)
{
    atomic_store(&px->stop, 1);
    pthread_join(px->thread, NULL);
    for (int i = 0; i < PROXY_PAIRS; i++)
        for (int k = 0; k < 2; k++)
            if (px->fd[i][k] >= 0)
                close(px->fd[i][k]);
    close(px->lfd);
}

/*
 * A stream turned away at the door.  A pair with two streams, through a
 * proxy that closes the decode engine's second connection (its first
 * stream) before the prefill could answer it: that stream alone dials
 * again and joins, and the room succeeds over the three connections.
 * (Were the refusal the peer's failure, the room would reconnect the
 * whole peer, to the address the prefill advertises in its HELLO, past
 * the proxy: two.)
 */
static void test_stream_turned_away_dials_again(void)
{
    side_t pre, dec;
    proxy_t px;
    char bs[64], err[256];
    kvf_bootstrap_t *reg;

    clear_env();
    side_tune = tune;
    tune_streams = 2;
    side_init(&pre, KVF_ROLE_PREFILL, NULL, TOKEN);
    side_init(&dec, KVF_ROLE_DECODE, NULL, TOKEN);
    CHECK(proxy_start(&px, port_of(pre.eng), 2));
    CHECK_EQ_INT(kvf_bootstrap_create("127.0.0.1", 0, &reg), KVF_OK);
    snprintf(bs, sizeof(bs), "127.0.0.1:%d", kvf_bootstrap_port(reg));
    kvf_bs_reg_t r = {
        .attn_tp_size = 1, .attn_cp_size = 1, .attn_dp_size = 1, .pp_size = 1,
        .system_dp_size = 1, .rank_ip = "127.0.0.1", .rank_port = px.port,
        .page_size = PAGE, .kv_cache_dtype = "bfloat16",
    };
    CHECK_EQ_INT(kvf__bs_register(bs, &r, 3000, err, sizeof(err)), KVF_OK);

    CHECK(legit_room(&pre, &dec, bs, 8));
    CHECK_EQ_INT(atomic_load(&px.accepted), 3);
    CHECK(kvf_engine_stream_bytes(dec.eng, 1) > 0 || kvf_engine_stream_bytes(pre.eng, 1) > 0);
    side_fini(&dec);
    side_fini(&pre);
    proxy_stop(&px);
    kvf_bootstrap_destroy(reg);
    side_tune = NULL;
    tune_streams = 1;
}

KVF_TEST_MAIN(
    KVF_CASE(test_strangers_cost_little_memory),
    KVF_CASE(test_descriptor_flood_sheds),
    KVF_CASE(test_dialler_waits_out_a_full_queue),
    KVF_CASE(test_full_queue_fails_at_the_deadline),
    KVF_CASE(test_stream_turned_away_dials_again)
)
