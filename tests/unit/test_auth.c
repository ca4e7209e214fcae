/*
 * Authentication: only holders of the cluster token touch a room.
 *
 * Engines with the right token, a wrong one and none side by side; a
 * stranger process that speaks the real protocol on a raw socket; a peer
 * of the previous protocol version; protected mode.  Each case checks
 * both that the stranger gets nowhere and that the legitimate room beside
 * it succeeds byte for byte.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <openssl/evp.h>
#include <openssl/hmac.h>

#include "bootstrap/bootstrap.h"
#include "core/engine.h"
#include "transport/shm/shm.h"
#include "kvferry/kvferry.h"
#include "unit/kvf_sides.h"
#include "unit/kvf_test.h"
#include "unit/kvf_wire_peer.h"

/* ------------------------------------------------------------------------ */

/* The proof is exactly what docs/PROTOCOL.md section 4 says. */
static void test_mac_context(void)
{
    kvf_msg_auth_t a = {.role = 1, .instance_id = 0x0102030405060708ull, .pid = 77},
                   b = {.role = 0, .instance_id = 0x1112131415161718ull, .pid = 88};
    memset(a.nonce, 0xaa, sizeof(a.nonce));
    memset(b.nonce, 0xbb, sizeof(b.nonce));
    uint8_t msg[256], want[32], got[32];
    size_t n = 0;
    memcpy(msg, "kvferry-auth-v2 connector", 26);   /* with its NUL */
    n = 26;
    const kvf_msg_auth_t *party[2] = {&a, &b};
    for (int i = 0; i < 2; i++) {
        msg[n++] = party[i]->role;
        kvf_put_u64(msg + n, party[i]->instance_id);
        kvf_put_u32(msg + n + 8, party[i]->pid);
        memcpy(msg + n + 12, party[i]->nonce, 32);
        n += 44;
    }
    unsigned len = 32;
    CHECK(HMAC(EVP_sha256(), "secret", 6, msg, n, want, &len) != NULL);
    kvf__auth_mac("secret", 1, &a, &b, got);
    CHECK(memcmp(want, got, 32) == 0);
    /* The direction label, the order and the key all matter. */
    kvf__auth_mac("secret", 0, &a, &b, got);
    CHECK(memcmp(want, got, 32) != 0);
    kvf__auth_mac("secret", 1, &b, &a, got);
    CHECK(memcmp(want, got, 32) != 0);
    kvf__auth_mac("secreT", 1, &a, &b, got);
    CHECK(memcmp(want, got, 32) != 0);
}

/*
 * Decode engines with a wrong token and with none fail their rooms with
 * KVF_ERR_AUTH and say why; the prefill engine counts them and their
 * ROOM_REQs never reach it; a decode engine with the token, asking for the
 * same room, gets it byte for byte.
 */
static void test_wrong_token_refused(void)
{
    side_t pre, good, wrong, none;
    char bs[64];
    kvf_failure_t f;
    kvf_failure_init(&f);
    clear_env();
    side_init(&pre, KVF_ROLE_PREFILL, "127.0.0.1:0", "alpha");
    CHECK_EQ_INT(kvf_engine_bootstrap_addr(pre.eng, bs, sizeof(bs)), KVF_OK);
    side_init(&wrong, KVF_ROLE_DECODE, NULL, "beta");
    side_init(&none, KVF_ROLE_DECODE, NULL, NULL);
    side_init(&good, KVF_ROLE_DECODE, NULL, "alpha");

    kvf_receiver_t *rw, *rn;
    CHECK_EQ_INT(kvf_receiver_create(wrong.eng, bs, 7, -1, &rw), KVF_OK);
    CHECK_EQ_INT(kvf_receiver_create(none.eng, bs, 7, -1, &rn), KVF_OK);
    CHECK_EQ_INT(wait_receiver(rw, KVF_POLL_WAITING_FOR_INPUT), KVF_POLL_FAILED);
    CHECK_EQ_INT(wait_receiver(rn, KVF_POLL_WAITING_FOR_INPUT), KVF_POLL_FAILED);
    CHECK_EQ_INT(kvf_receiver_failure(rw, &f), KVF_OK);
    CHECK_EQ_INT(f.status, KVF_ERR_AUTH);
    CHECK_STR_CONTAINS(f.reason, "authentication failed");
    CHECK_STR_CONTAINS(f.reason, "both have a cluster token, and they differ");
    CHECK_STR_CONTAINS(f.reason, "KVF_AUTH_TOKEN");
    CHECK_EQ_INT(kvf_receiver_failure(rn, &f), KVF_OK);
    CHECK_EQ_INT(f.status, KVF_ERR_AUTH);
    CHECK_STR_CONTAINS(f.reason, "it has a cluster token, this engine has none");
    CHECK_EQ_INT(engine_stats(pre.eng).auth_refused, 2);

    /* Room 7, which both strangers asked for, is still the legitimate one's. */
    CHECK(legit_room(&pre, &good, bs, 7));
    kvf_engine_stats_t st;
    kvf_engine_stats_init(&st);
    kvf_engine_stats(pre.eng, &st);
    CHECK_EQ_INT(st.rooms_succeeded, 1);
    CHECK_EQ_INT(st.rooms_failed, 0);
    kvf_receiver_destroy(rw);
    kvf_receiver_destroy(rn);
    side_fini(&good);
    side_fini(&none);
    side_fini(&wrong);
    side_fini(&pre);
}

/* ---- a stranger process on a raw socket -------------------------------- */

/* The engine's AUTH, and nothing after it for a while. */
static int only_auth(int fd, kvf_msg_auth_t *auth_p)
{
    uint8_t body[1 << 16];
    kvf_msg_t m;
    if (wp_recv(fd, &m, body, sizeof(body), 5000) != KVF_MSG_AUTH)
        return 0;
    if (auth_p != NULL)
        *auth_p = m.u.auth;
    struct pollfd pfd = {fd, POLLIN, 0};
    return poll(&pfd, 1, 200) == 0;      /* no HELLO, no XPORT follows */
}

static kvf_msg_t hostile(uint8_t type)
{
    static uint32_t pages[2] = {1, 2};
    kvf_msg_t m = {.type = (kvf_msg_type_t)type};
    switch (type) {
    case KVF_MSG_ROOM_REQ:
        m.u.room_req.room = 7;
        m.u.room_req.expected_receivers = 1;
        m.u.room_req.pages = (kvf_wire_arr32_t){2, pages, NULL};
        break;
    case KVF_MSG_DONE:
        m.u.done.room = 7;
        m.u.done.bytes = 4096;
        break;
    case KVF_MSG_DONE_ACK:
        m.u.done_ack.room = 7;
        break;
    default:  /* FAIL, ABORT */
        m.u.fail.room = 7;
        m.u.fail.status = KVF_ERR_ABORTED;
        m.u.fail.reason = (kvf_wire_str_t){"stolen", 6};
        m.u.fail.origin_addr = (kvf_wire_str_t){"x:1", 3};
        break;
    }
    return m;
}

/* Without authenticating: sees only AUTH; each room message, sent right
 * after our own AUTH or instead of it, closes the connection. */
static int stranger_no_token(int port)
{
    static const uint8_t types[] = {KVF_MSG_ROOM_REQ, KVF_MSG_DONE, KVF_MSG_DONE_ACK,
                                    KVF_MSG_FAIL, KVF_MSG_ABORT};
    for (size_t i = 0; i < sizeof(types); i++)
        for (int with_auth = 0; with_auth < 2; with_auth++) {
            int fd = dial(port);
            if (fd < 0 || !only_auth(fd, NULL))
                return 10 + (int)i;
            kvf_msg_t a = wp_auth_msg(KVF_ROLE_DECODE, ""), m = hostile(types[i]);
            if ((with_auth && !wp_send(fd, &a, NULL, 0)) || !wp_send(fd, &m, NULL, 0))
                return 20 + (int)i;
            if (!wp_closed(fd, 5000))
                return 30 + (int)i;
            close(fd);
        }
    return 0;
}

/* A wrong token's proof: closed, and the engine's own proof never comes. */
static int stranger_wrong_token(int port)
{
    int fd = dial(port);
    kvf_msg_auth_t theirs;
    if (fd < 0 || !only_auth(fd, &theirs))
        return 10;
    kvf_msg_t a = wp_auth_msg(KVF_ROLE_DECODE, "guess"), p = {.type = KVF_MSG_AUTH_PROOF},
              m = hostile(KVF_MSG_ROOM_REQ);
    kvf__auth_mac("guess", 1, &a.u.auth, &theirs, p.u.proof.mac);
    if (!wp_send(fd, &a, NULL, 0) || !wp_send(fd, &p, NULL, 0) || !wp_send(fd, &m, NULL, 0))
        return 11;
    if (!wp_closed(fd, 5000))     /* not even its AUTH_PROOF came first */
        return 12;
    close(fd);
    /* A reflection: its own AUTH back, then our proof-shaped bytes. */
    fd = dial(port);
    if (fd < 0 || !only_auth(fd, &theirs))
        return 13;
    kvf_msg_t echo = {.type = KVF_MSG_AUTH};
    echo.u.auth = theirs;
    echo.u.auth.role = KVF_ROLE_DECODE;
    if (!wp_send(fd, &echo, NULL, 0) || !wp_closed(fd, 5000))
        return 14;
    close(fd);
    return 0;
}

/*
 * Frame headers beyond what a peer may send before it has authenticated:
 * a type other than AUTH and AUTH_PROOF, or a body larger than theirs.
 * Each closes the connection at its header, before any body byte came
 * (the engine's handshake deadline is 30 s away in these cases).  The
 * first frame of a version-1 engine too (HELLO, magic and version 1).
 */
static int stranger_big_headers(int port)
{
    static const struct {
        uint8_t  type;
        uint32_t len;
        uint16_t version;   /* of the magic-and-version prefix sent (0: none) */
    } claims[] = {
        {KVF_MSG_DATA, KVF_WIRE_MAX_BODY, 0},
        {KVF_MSG_HELLO, 4096, KVF_WIRE_VERSION},
        {KVF_MSG_HELLO, 4096, 1},
        {KVF_MSG_AUTH, KVF_WIRE_MAX_AUTH_BODY + 1, KVF_WIRE_VERSION},
        {KVF_MSG_AUTH, KVF_WIRE_MAX_BODY, KVF_WIRE_VERSION},
        {KVF_MSG_AUTH_PROOF, 1u << 20, 0},
        {KVF_MSG_ROOM_REQ, 64, 0},
    };
    for (size_t i = 0; i < sizeof(claims) / sizeof(claims[0]); i++) {
        uint8_t frame[KVF_WIRE_HDR_LEN + KVF_WIRE_PREFIX_LEN] = {0};
        size_t n = KVF_WIRE_HDR_LEN;
        kvf_put_u32(frame, claims[i].len);
        frame[4] = claims[i].type;
        if (claims[i].version != 0) {
            kvf_put_u32(frame + n, KVF_WIRE_MAGIC);
            kvf_put_u16(frame + n + 4, claims[i].version);
            n += KVF_WIRE_PREFIX_LEN;
        }
        int fd = dial(port);
        if (fd < 0 || !only_auth(fd, NULL))
            return 10 + (int)i;
        if (send(fd, frame, n, MSG_NOSIGNAL) != (ssize_t)n)
            return 20 + (int)i;
        if (!wp_closed(fd, 5000))
            return 30 + (int)i;
        close(fd);
    }
    return 0;
}

static unsigned tune_handshake_ms;
static const char *tune_faults;

static void tune(kvf_engine_params_t *p)
{
    if (tune_handshake_ms)
        p->handshake_timeout_ms = tune_handshake_ms;
    p->faults = tune_faults;
}

static void stranger_case(stranger_fn_t fn, int refusals)
{
    side_t pre, dec;
    char bs[64];
    clear_env();
    stranger_t s = stranger_fork(fn);
    CHECK(s.pid > 0);
    side_init(&pre, KVF_ROLE_PREFILL, "127.0.0.1:0", "alpha");
    CHECK_EQ_INT(kvf_engine_bootstrap_addr(pre.eng, bs, sizeof(bs)), KVF_OK);
    side_init(&dec, KVF_ROLE_DECODE, NULL, "alpha");
    /* Room 7 is live on the prefill side while the stranger works. */
    kvf_sender_t *live;
    CHECK_EQ_INT(kvf_sender_create(pre.eng, bs, 7, &live), KVF_OK);
    CHECK_EQ_INT(stranger_join(&s, port_of(pre.eng)), 0);
    CHECK_EQ_INT(kvf_sender_poll(live), KVF_POLL_BOOTSTRAPPING);
    CHECK_EQ_INT(engine_stats(pre.eng).auth_refused, refusals);
    kvf_sender_destroy(live);
    CHECK(legit_room(&pre, &dec, bs, 7));
    CHECK(strcmp(kvf_engine_transport(dec.eng), side_transport) == 0);
    side_fini(&dec);
    side_fini(&pre);
}

static void test_stranger_without_token(void)
{
    stranger_case(stranger_no_token, 10);
}

static void test_stranger_with_wrong_token(void)
{
    stranger_case(stranger_wrong_token, 2);
}

static void test_stranger_big_headers(void)
{
    side_tune = tune;
    tune_handshake_ms = 30000;
    stranger_case(stranger_big_headers, 7);
    /* The same through the fault transport, which wraps every connection
     * when faults are set (this one never fires: no room moves 1 TB). */
    tune_faults = "stall@1000000000000";
    stranger_case(stranger_big_headers, 7);
    tune_faults = NULL;
    tune_handshake_ms = 0;
    side_tune = NULL;
}

/* The same strangers beside rooms over shm (mapped memfds) and ucx. */
static void test_strangers_over_shm(void)
{
    side_transport = "shm";
    side_mem_alloc = 1;
    stranger_case(stranger_no_token, 10);
    stranger_case(stranger_wrong_token, 2);
    side_mem_alloc = 0;
    side_transport = "tcp";
}

static void test_strangers_over_ucx(void)
{
#ifdef KVF_HAVE_UCX
    /* UCX's tcp moves reads in software: allowed here, loopback only. */
    setenv("UCX_TLS", "tcp", 1);
    setenv("KVF_UCX_SOFTWARE_RMA", "allow", 1);
    side_transport = "ucx";
    stranger_case(stranger_no_token, 10);
    stranger_case(stranger_wrong_token, 2);
    side_transport = "tcp";
    unsetenv("KVF_UCX_SOFTWARE_RMA");
#else
    fprintf(stderr, "  (no UCX in this build: the ucx case is not run)\n");
#endif
}

/* ---- the shm memfd handout --------------------------------------------- */

/* The prefill's offer of `name`, as a decode engine holding `token` gets it. */
static int raw_offer_of(int port, const char *token, const char *name, uint8_t *blob,
                        size_t cap, size_t *len_p)
{
    static uint8_t body[1 << 20];
    kvf_msg_t m;
    int fd = dial(port), ok = 0;
    if (fd < 0 || !wp_authenticate(fd, token, KVF_ROLE_DECODE, 1, NULL) ||
        wp_recv(fd, &m, body, sizeof(body), 5000) != KVF_MSG_HELLO ||
        wp_recv(fd, &m, body, sizeof(body), 5000) != KVF_MSG_XPORT) {
        if (fd >= 0)
            close(fd);
        return 0;
    }
    for (uint32_t i = 0; i < m.u.xport.count; i++) {
        const kvf_wire_xport_t *x = &m.u.xport.x[i];
        if (x->name.len == strlen(name) && memcmp(x->name.ptr, name, x->name.len) == 0 &&
            x->blob_len <= cap) {
            memcpy(blob, x->blob, x->blob_len);
            *len_p = x->blob_len;
            ok = 1;
        }
    }
    close(fd);
    return ok;
}

static int raw_offer(int port, const char *token, uint8_t *blob, size_t cap, size_t *len_p)
{
    return raw_offer_of(port, token, "shm", blob, cap, len_p);
}

typedef struct handout_req {
    char    name[48];
    uint8_t cookie[KVF_SHM_COOKIE_LEN];
} handout_req_t;

/* Ask the handout socket `name` for memfds with `cookie`: @return how
 * many arrived (into fds; desc, when not NULL, gets the answer's words:
 * the count, then base and length per memfd), 0 when refused, -1 if it
 * could not ask. */
static int fetch_memfds_desc(const handout_req_t *q, int *fds, int max, uint64_t *desc_p)
{
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    size_t n = strnlen(q->name, sizeof(q->name));
    memcpy(sa.sun_path + 1, q->name, n);
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0 || connect(fd, (struct sockaddr *)&sa,
                          (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + n)) != 0 ||
        send(fd, q->cookie, sizeof(q->cookie), MSG_NOSIGNAL) != sizeof(q->cookie)) {
        if (fd >= 0)
            close(fd);
        return -1;
    }
    uint64_t desc[1 + 2 * 256];
    char cbuf[CMSG_SPACE(256 * sizeof(int))];
    struct iovec iov = {desc, sizeof(desc)};
    struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = cbuf,
                        .msg_controllen = sizeof(cbuf)};
    struct pollfd pfd = {fd, POLLIN, 0};
    int got = 0;
    ssize_t len;
    if (poll(&pfd, 1, 5000) == 1 && (len = recvmsg(fd, &mh, MSG_CMSG_CLOEXEC)) > 0) {
        if (desc_p != NULL)
            memcpy(desc_p, desc, (size_t)len);
        struct cmsghdr *cm = CMSG_FIRSTHDR(&mh);
        if (cm != NULL && cm->cmsg_type == SCM_RIGHTS) {
            got = (int)((cm->cmsg_len - CMSG_LEN(0)) / sizeof(int));
            int *in = (int *)CMSG_DATA(cm);
            for (int i = 0; i < got; i++) {
                if (i < max)
                    fds[i] = in[i];
                else
                    close(in[i]);
            }
        }
    }
    close(fd);
    return got;
}

static int fetch_memfds(const handout_req_t *q, int *fds, int max)
{
    return fetch_memfds_desc(q, fds, max, NULL);
}

static handout_req_t req_of(const uint8_t *blob)
{
    handout_req_t q;
    memcpy(q.name, blob + KVF_SHM_OFF_NAME, sizeof(q.name));
    memcpy(q.cookie, blob + KVF_SHM_OFF_COOKIE, sizeof(q.cookie));
    return q;
}

/* Another process with a cookie it stole: exits with the fds it got. */
static int thief_main(int rfd)
{
    handout_req_t q;
    int fds[256];
    alarm(60);
    if (read(rfd, &q, sizeof(q)) != sizeof(q))
        return 99;
    int got = fetch_memfds(&q, fds, 256);
    return got < 0 ? 98 : got;
}

static void test_shm_handout(void)
{
    side_t pre, dec;
    char bs[64];
    uint8_t blob[4096];
    size_t len = 0;
    int fds[256], p[2];
    clear_env();
    CHECK(pipe(p) == 0);
    pid_t thief = fork();
    if (thief == 0) {
        close(p[1]);
        _exit(thief_main(p[0]));
    }
    close(p[0]);
    side_transport = "shm";
    side_mem_alloc = 1;
    side_init(&pre, KVF_ROLE_PREFILL, "127.0.0.1:0", "alpha");
    CHECK_EQ_INT(kvf_engine_bootstrap_addr(pre.eng, bs, sizeof(bs)), KVF_OK);
    int port = port_of(pre.eng);

    /* A cookie offered to this process, used by another: refused by pid,
     * and used up, so that this process cannot use it after that either. */
    CHECK(raw_offer(port, "alpha", blob, sizeof(blob), &len));
    CHECK(len > KVF_SHM_OFF_NREGIONS);
    handout_req_t stolen = req_of(blob);
    CHECK(write(p[1], &stolen, sizeof(stolen)) == sizeof(stolen));
    close(p[1]);
    int status = -1;
    CHECK(waitpid(thief, &status, 0) == thief);
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    CHECK_EQ_INT(fetch_memfds(&stolen, fds, 256), 0);

    /* No cookie (what a stranger without the token has): nothing. */
    CHECK(raw_offer(port, "alpha", blob, sizeof(blob), &len));
    handout_req_t good = req_of(blob), guess = good;
    CHECK(getrandom(guess.cookie, sizeof(guess.cookie), 0) == sizeof(guess.cookie));
    CHECK_EQ_INT(fetch_memfds(&guess, fds, 256), 0);

    /* The right process with its own fresh cookie: the memfds, read-only. */
    int n = fetch_memfds(&good, fds, 256);
    CHECK_EQ_INT(n, NKV);
    for (int i = 0; i < n && i < 256; i++) {
        off_t size = lseek(fds[i], 0, SEEK_END);
        CHECK(size == (off_t)PAGES * PAGE_B);
        void *w = mmap(NULL, (size_t)size, PROT_READ | PROT_WRITE, MAP_SHARED, fds[i], 0);
        CHECK(w == MAP_FAILED && errno == EACCES);
        uint8_t *r = mmap(NULL, (size_t)size, PROT_READ, MAP_SHARED, fds[i], 0);
        CHECK(r != MAP_FAILED);
        int same = 0;
        for (int b = 0; r != MAP_FAILED && b < NKV; b++)
            same |= memcmp(r, pre.kv[b], (size_t)size) == 0;
        CHECK(same);                 /* it is the prefill's KV, not a copy */
        if (r != MAP_FAILED)
            munmap(r, (size_t)size);
        CHECK(ftruncate(fds[i], 0) != 0);
        /* Reopened for writing through /proc: the seals still refuse. */
        char path[64];
        snprintf(path, sizeof(path), "/proc/self/fd/%d", fds[i]);
        int rw = open(path, O_RDWR | O_CLOEXEC);
        if (rw >= 0) {
            w = mmap(NULL, (size_t)size, PROT_READ | PROT_WRITE, MAP_SHARED, rw, 0);
            CHECK(w == MAP_FAILED && errno == EPERM);
            CHECK(pwrite(rw, "x", 1, 0) < 0 && errno == EPERM);
            CHECK(ftruncate(rw, 0) != 0);
            close(rw);
        }
        close(fds[i]);
    }
    /* Used once: not twice. */
    CHECK_EQ_INT(fetch_memfds(&good, fds, 256), 0);

    /* And the real decode engine beside it gets its room. */
    side_init(&dec, KVF_ROLE_DECODE, NULL, "alpha");
    CHECK(legit_room(&pre, &dec, bs, 11));
    CHECK(strcmp(kvf_engine_transport(dec.eng), "shm") == 0);
    side_fini(&dec);
    side_fini(&pre);
    side_mem_alloc = 0;
    side_transport = "tcp";
}

#define KVLEN ((size_t)PAGES * PAGE_B)

/* Whether [b, b+n) lies in the buffers s registered (its KV and aux). */
static int in_registered(const side_t *s, uint64_t b, uint64_t n)
{
    uint64_t at = b;
    for (int progress = 1; progress && at < b + n;) {
        progress = 0;
        for (int i = 0; i <= NKV; i++) {
            uint64_t rb = (uint64_t)(uintptr_t)(i < NKV ? s->kv[i] : s->aux);
            uint64_t re = rb + (i < NKV ? KVLEN : (uint64_t)SLOTS * AUX_B);
            if (rb <= at && at < re) {
                at = re;
                progress = 1;
            }
        }
    }
    return at >= b + n;
}

/* The child maps fd past its end and reads the first byte there. */
static int read_past_end_faults(int fd, size_t size)
{
    size_t pg = (size_t)sysconf(_SC_PAGESIZE), end = (size + pg - 1) / pg * pg;
    pid_t pid = fork();
    if (pid == 0) {
        /* The kernel's verdict, not a handler's (UCX and the sanitizers
         * install their own for SIGBUS). */
        struct sigaction dfl = {.sa_handler = SIG_DFL};
        sigaction(SIGBUS, &dfl, NULL);
        alarm(10);
        volatile const uint8_t *m = mmap(NULL, end + pg, PROT_READ, MAP_SHARED, fd, 0);
        if (m == MAP_FAILED)
            _exit(3);
        _exit(m[end] == 0 ? 1 : 2);    /* reached only if the read did not fault */
    }
    int status = 0;
    return pid > 0 && waitpid(pid, &status, 0) == pid && WIFSIGNALED(status) &&
           WTERMSIG(status) == SIGBUS;
}

/*
 * What a peer holding the memfds can read: for every fd it is handed,
 * every byte the fd holds (fstat, mmap of all of it) is registered memory,
 * and the byte after its last page faults.  @return how many fds came.
 */
static int check_memfds(side_t *pre)
{
    uint8_t blob[4096];
    size_t len = 0;
    int fds[256];
    uint64_t desc[1 + 2 * 256];
    CHECK(raw_offer(port_of(pre->eng), "alpha", blob, sizeof(blob), &len));
    handout_req_t q = req_of(blob);
    int n = fetch_memfds_desc(&q, fds, 256, desc);
    for (int i = 0; i < n && i < 256; i++) {
        struct stat st;
        uint64_t base = desc[1 + 2 * i];
        CHECK(fstat(fds[i], &st) == 0);
        size_t size = (size_t)st.st_size;
        CHECK_EQ_INT(size, desc[2 + 2 * i]);
        CHECK(in_registered(pre, base, size));
        if (!in_registered(pre, base, size))
            fprintf(stderr, "  memfd %d: %zu bytes at 0x%llx, not all registered\n", i,
                    size, (unsigned long long)base);
        const uint8_t *m = mmap(NULL, size, PROT_READ, MAP_SHARED, fds[i], 0);
        CHECK(m != MAP_FAILED);
        if (m != MAP_FAILED) {
            CHECK(memcmp(m, (const void *)(uintptr_t)base, size) == 0);
            munmap((void *)m, size);
        }
        CHECK(read_past_end_faults(fds[i], size));
        close(fds[i]);
    }
    return n;
}

/*
 * The memfds a prefill engine hands out cover registered memory only,
 * whatever the layout: a buffer smaller than its kvf_mem_alloc allocation,
 * one at an offset in it, two sharing one with a gap between them (none of
 * these is handed out: a peer could map the rest), buffers that tile an
 * allocation and one registered whole (handed out), and memory from
 * calloc (never a memfd).  Rooms still move every byte, over shm.
 */
static void test_shm_memfds_cover_registered_only(void)
{
    side_t pre, dec;
    char bs[64];
    size_t pg = (size_t)sysconf(_SC_PAGESIZE);
    uint8_t *a, *b, *c, *t;
    clear_env();
    side_transport = "shm";

    /* Registered in part: the aux buffer alone is a whole allocation. */
    CHECK_EQ_INT(side_try(&pre, KVF_ROLE_PREFILL, "127.0.0.1:0", "alpha", NULL), KVF_OK);
    CHECK_EQ_INT(kvf_mem_alloc(KVLEN + pg, (void **)&a), KVF_OK);
    CHECK_EQ_INT(kvf_mem_alloc(pg + KVLEN, (void **)&b), KVF_OK);
    CHECK_EQ_INT(kvf_mem_alloc(2 * KVLEN + pg, (void **)&c), KVF_OK);
    memset(a, 0xa5, KVLEN + pg);              /* what must not leak */
    memset(b, 0xb5, pg + KVLEN);
    memset(c, 0xc5, 2 * KVLEN + pg);
    pre.kv[0] = a;                            /* the tail page unregistered */
    pre.kv[1] = b + pg;                       /* the head page unregistered */
    pre.kv[2] = c;                            /* a page between two buffers */
    pre.kv[3] = c + KVLEN + pg;
    CHECK_EQ_INT(kvf_mem_alloc((size_t)SLOTS * AUX_B, (void **)&pre.aux), KVF_OK);
    side_register(&pre, KVF_ROLE_PREFILL);
    CHECK_EQ_INT(check_memfds(&pre), 1);
    CHECK_EQ_INT(kvf_engine_bootstrap_addr(pre.eng, bs, sizeof(bs)), KVF_OK);
    side_init(&dec, KVF_ROLE_DECODE, NULL, "alpha");
    CHECK(legit_room(&pre, &dec, bs, 21));
    CHECK(strcmp(kvf_engine_transport(dec.eng), "shm") == 0);
    side_fini(&dec);
    kvf_engine_destroy(pre.eng);
    kvf_mem_free(a);
    kvf_mem_free(b);
    kvf_mem_free(c);
    kvf_mem_free(pre.aux);

    /* One allocation the KV buffers tile: handed out; aux from calloc: not. */
    CHECK_EQ_INT(side_try(&pre, KVF_ROLE_PREFILL, "127.0.0.1:0", "alpha", NULL), KVF_OK);
    CHECK_EQ_INT(kvf_mem_alloc(NKV * KVLEN, (void **)&t), KVF_OK);
    for (int i = 0; i < NKV; i++)
        pre.kv[i] = t + (size_t)i * KVLEN;
    pre.aux = calloc(SLOTS, AUX_B);
    side_register(&pre, KVF_ROLE_PREFILL);
    CHECK_EQ_INT(check_memfds(&pre), 1);
    CHECK_EQ_INT(kvf_engine_bootstrap_addr(pre.eng, bs, sizeof(bs)), KVF_OK);
    side_init(&dec, KVF_ROLE_DECODE, NULL, "alpha");
    CHECK(legit_room(&pre, &dec, bs, 22));
    CHECK(strcmp(kvf_engine_transport(dec.eng), "shm") == 0);
    side_fini(&dec);
    kvf_engine_destroy(pre.eng);
    kvf_mem_free(t);
    free(pre.aux);
    side_transport = "tcp";
}

typedef struct flood {
    handout_req_t req;
    int           n, refused;
} flood_t;

/* n requests with guessed cookies, each answered (refused) before the next. */
static void bad_cookie_flood(void *arg)
{
    flood_t *fl = arg;
    int fds[256];
    for (int i = 0; i < fl->n; i++) {
        handout_req_t q = fl->req;
        if (getrandom(q.cookie, sizeof(q.cookie), 0) != sizeof(q.cookie))
            continue;
        fl->refused += fetch_memfds(&q, fds, 256) == 0;
    }
}

/* Anyone on the host can connect to the handout socket: a flood of bad
 * cookies is refused, counted and logged once a minute, not once each;
 * the real peer's cookie still works after it. */
static void test_shm_handout_refusals_logged_once(void)
{
    side_t pre;
    uint8_t blob[4096];
    size_t len = 0;
    int fds[256];
    clear_env();
    side_transport = "shm";
    side_mem_alloc = 1;
    side_init(&pre, KVF_ROLE_PREFILL, "127.0.0.1:0", "alpha");
    CHECK(raw_offer(port_of(pre.eng), "alpha", blob, sizeof(blob), &len));
    flood_t fl = {.req = req_of(blob), .n = 300};
    uint64_t t0 = kvf_now_ms();
    int lines = log_lines_during(bad_cookie_flood, &fl, "refused a memfd request");
    uint64_t took = kvf_now_ms() - t0;
    CHECK_EQ_INT(fl.refused, fl.n);
    /* The first refusal is logged at once; then one line a minute at most
     * (the flood takes well under a minute, but the bound holds anyway). */
    CHECK(lines >= 1);
    CHECK(lines <= 1 + (int)(took / 60000));
    if (lines > 1 + (int)(took / 60000))
        fprintf(stderr, "  %d log lines for %d refusals in %llu ms\n", lines, fl.n,
                (unsigned long long)took);
    handout_req_t good = req_of(blob);
    int n = fetch_memfds(&good, fds, 256);
    CHECK_EQ_INT(n, NKV);
    for (int i = 0; i < n && i < 256; i++)
        close(fds[i]);
    side_fini(&pre);
    side_mem_alloc = 0;
    side_transport = "tcp";
}

/* Process CPU time (every thread), in seconds. */
static double cpu_s(void)
{
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    return (double)(ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) +
           (double)(ru.ru_utime.tv_usec + ru.ru_stime.tv_usec) / 1e6;
}

/*
 * The shm handout socket out of descriptors.  While this process has none
 * left, another one connects to it: the prefill engine turns each
 * connection away (accepted on its reserve descriptor and closed) instead
 * of spinning on a listener it cannot serve, which would cost a whole
 * core until a descriptor frees.  The test thread only waits meanwhile,
 * so this process's CPU time is the engine's.
 */
static void test_shm_handout_out_of_descriptors(void)
{
    enum { N = 32, HOG_MAX = 8192 };
    static int hog[HOG_MAX];
    side_t pre;
    uint8_t blob[4096];
    size_t len = 0;
    int nhog = 0;
    clear_env();
    side_transport = "shm";
    side_mem_alloc = 1;
    side_init(&pre, KVF_ROLE_PREFILL, "127.0.0.1:0", "alpha");
    CHECK(raw_offer(port_of(pre.eng), "alpha", blob, sizeof(blob), &len));
    handout_req_t q = req_of(blob);
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    size_t n = strnlen(q.name, sizeof(q.name));
    memcpy(sa.sun_path + 1, q.name, n);
    socklen_t salen = (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + n);
    struct rlimit old, rl;
    CHECK(getrlimit(RLIMIT_NOFILE, &old) == 0);
    rl = old;
    if (rl.rlim_cur > 1024)
        rl.rlim_cur = 1024;
    CHECK(setrlimit(RLIMIT_NOFILE, &rl) == 0);

    fflush(NULL);
    while (nhog < HOG_MAX && (hog[nhog] = dup(0)) >= 0)
        nhog++;
    CHECK(nhog < HOG_MAX && errno == EMFILE);
    uint64_t t0 = kvf_now_ms();
    double c0 = cpu_s();
    pid_t child = fork();
    if (child == 0) {
        /* The other process: its own descriptors, N connections, and how
         * many the engine closed within 5 s. */
        int cl[N], closed = 0;
        alarm(30);
        for (int i = 0; i < nhog; i++)
            close(hog[i]);
        for (int i = 0; i < N; i++) {
            cl[i] = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
            if (cl[i] < 0 || connect(cl[i], (struct sockaddr *)&sa, salen) != 0)
                _exit(100);
        }
        for (int i = 0; i < N; i++)
            closed += wp_closed(cl[i], 5000);
        _exit(closed);
    }
    int status = -1;
    CHECK(child > 0 && waitpid(child, &status, 0) == child);
    double cpu = cpu_s() - c0, wall = (double)(kvf_now_ms() - t0) / 1000.0;
    for (int i = 0; i < nhog; i++)
        close(hog[i]);
    CHECK(setrlimit(RLIMIT_NOFILE, &old) == 0);
    int closed = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    /* Each is turned away at once, or, when a descriptor freed meanwhile
     * (another thread of this process let one go), served and dropped at
     * its slot's deadline for a cookie (1 s). */
    fprintf(stderr, "  %d of %d closed (turned away out of descriptors, or at their "
            "slot's deadline); engine CPU %.3f s over %.2f s\n", closed, N, cpu, wall);
    CHECK_EQ_INT(closed, N);
    CHECK(cpu < 0.25 * wall + 0.05);
    /* Descriptors back: the socket serves again (a fresh cookie: an offer's
     * lasts as long as its connection). */
    CHECK(raw_offer(port_of(pre.eng), "alpha", blob, sizeof(blob), &len));
    handout_req_t good = req_of(blob);
    int fds[256];
    int got = fetch_memfds(&good, fds, 256);
    CHECK_EQ_INT(got, NKV);
    for (int i = 0; i < got && i < 256; i++)
        close(fds[i]);
    side_fini(&pre);
    side_mem_alloc = 0;
    side_transport = "tcp";
}

/* ---- what a ucx offer allows over UCX's tcp transport ------------------ */

#ifdef KVF_HAVE_UCX
#include <ucp/api/ucp.h>

/* Wait for a UCX request of the test's own worker; @return its status. */
static ucs_status_t ucx_wait(ucp_worker_h wk, ucs_status_ptr_t req)
{
    ucs_status_t st = UCS_PTR_IS_ERR(req) ? UCS_PTR_STATUS(req) : UCS_OK;
    if (UCS_PTR_IS_PTR(req)) {
        while ((st = ucp_request_check_status(req)) == UCS_INPROGRESS)
            ucp_worker_progress(wk);
        ucp_request_free(req);
    }
    return st;
}

/* The offer's region that is a KV buffer of pre (regions come sorted by
 * address, so the first may be the aux buffer), or NULL. */
static const uint8_t *kv_region(const side_t *pre, const uint8_t *blob, uint8_t **target_p)
{
    uint32_t alen = kvf_get_u32(blob + 4), nregs = kvf_get_u32(blob + 8 + alen);
    const uint8_t *r = blob + 8 + alen + 4;
    for (uint32_t i = 0; i < nregs; i++, r += 20 + kvf_get_u32(r + 16))
        for (int b = 0; b < NKV; b++)
            if ((uint64_t)(uintptr_t)pre->kv[b] == kvf_get_u64(r)) {
                *target_p = pre->kv[b];
                return r;
            }
    return NULL;
}

/*
 * A token holder with a prefill's ucx offer, over UCX's tcp transport,
 * where UCX emulates remote access in software: its active-message
 * handlers copy from and to whatever address a request names, and tcp's
 * remote key is empty (docs/SECURITY.md).  So the prefill engine does not
 * offer ucx there: no worker address, no key.  With
 * KVF_UCX_SOFTWARE_RMA=allow it does, and this records what that allows:
 * a put into a KV buffer, and a get and a put of heap memory that no
 * registered region covers (the engine runs in this process).  If the
 * last two start failing, UCX enforces the bounds over tcp: update the doc.
 */
static void test_ucx_software_rma(void)
{
    side_t pre;
    static uint8_t blob[1 << 16];
    size_t len = 0;
    clear_env();
    setenv("UCX_TLS", "tcp", 1);
    unsetenv("KVF_UCX_SOFTWARE_RMA");
    side_transport = "ucx";
    side_init(&pre, KVF_ROLE_PREFILL, "127.0.0.1:0", "alpha");
    CHECK(raw_offer_of(port_of(pre.eng), "alpha", KVF_WIRE_CAPS_NAME, blob, sizeof(blob),
                       &len));   /* the offer came... */
    CHECK(!raw_offer_of(port_of(pre.eng), "alpha", "ucx", blob, sizeof(blob), &len));
    side_fini(&pre);             /* ...without ucx */

    setenv("KVF_UCX_SOFTWARE_RMA", "allow", 1);
    side_init(&pre, KVF_ROLE_PREFILL, "127.0.0.1:0", "alpha");
    side_transport = "tcp";
    unsetenv("KVF_UCX_SOFTWARE_RMA");
    CHECK(raw_offer_of(port_of(pre.eng), "alpha", "ucx", blob, sizeof(blob), &len));
    uint8_t *target = NULL;
    const uint8_t *kv_r = len > 12 ? kv_region(&pre, blob, &target) : NULL;
    CHECK(kv_r != NULL);
    if (kv_r == NULL) {
        side_fini(&pre);
        return;
    }
    uint8_t *secret = malloc(64);   /* heap of the prefill's process, unregistered */
    memset(secret, 0x5e, 64);

    ucp_config_t *cfg;
    ucp_context_h ctx;
    ucp_worker_h wk;
    ucp_ep_h ep;
    ucp_rkey_h rkey;
    ucp_params_t pp = {.field_mask = UCP_PARAM_FIELD_FEATURES, .features = UCP_FEATURE_RMA};
    ucp_worker_params_t wp = {.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE,
                              .thread_mode = UCS_THREAD_MODE_SINGLE};
    CHECK(ucp_config_read(NULL, NULL, &cfg) == UCS_OK);
    CHECK(ucp_init(&pp, cfg, &ctx) == UCS_OK);
    ucp_config_release(cfg);
    CHECK(ucp_worker_create(ctx, &wp, &wk) == UCS_OK);
    ucp_ep_params_t ep_p = {.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS,
                            .address = (const ucp_address_t *)(blob + 8)};
    CHECK(ucp_ep_create(wk, &ep_p, &ep) == UCS_OK);
    CHECK(ucp_ep_rkey_unpack(ep, kv_r + 20, &rkey) == UCS_OK);
    static uint8_t evil[64], got[64];
    memset(evil, 0xee, sizeof(evil));
    ucp_request_param_t rp = {.op_attr_mask = 0};
    ucs_status_t put = ucx_wait(wk, ucp_put_nbx(ep, evil, sizeof(evil),
                                                kvf_get_u64(kv_r), rkey, &rp));
    ucx_wait(wk, ucp_ep_flush_nbx(ep, &rp));
    int landed = memcmp(target, evil, sizeof(evil)) == 0;
    ucs_status_t get = ucx_wait(wk, ucp_get_nbx(ep, got, sizeof(got),
                                                (uint64_t)(uintptr_t)secret, rkey, &rp));
    int read_out = get == UCS_OK && memcmp(got, secret, sizeof(got)) == 0;
    ucx_wait(wk, ucp_put_nbx(ep, evil, sizeof(evil), (uint64_t)(uintptr_t)secret, rkey, &rp));
    ucx_wait(wk, ucp_ep_flush_nbx(ep, &rp));
    int wrote_out = memcmp(secret, evil, sizeof(evil)) == 0;
    fprintf(stderr, "  ucx over tcp, allowed: put into a region: %s, %s; get outside every "
            "region: %s; put outside: %s\n", ucs_status_string(put),
            landed ? "landed" : "did not land", read_out ? "read" : "refused",
            wrote_out ? "landed" : "did not land");
    CHECK(landed);
    CHECK(read_out);
    CHECK(wrote_out);
    ucp_rkey_destroy(rkey);
    ucx_wait(wk, ucp_ep_close_nbx(ep, &rp));
    ucp_worker_destroy(wk);
    ucp_cleanup(ctx);
    free(secret);
    side_fini(&pre);
}
#else
static void test_ucx_software_rma(void)
{
    fprintf(stderr, "  (no UCX in this build)\n");
}
#endif

/* ---- a prefill engine of protocol version 1 ---------------------------- */

static void test_version1_peer(void)
{
    side_t dec;
    char addr[64], err[256];
    kvf_bootstrap_t *bs;
    clear_env();
    CHECK_EQ_INT(kvf_bootstrap_create("127.0.0.1", 0, &bs), KVF_OK);
    snprintf(addr, sizeof(addr), "127.0.0.1:%d", kvf_bootstrap_port(bs));
    struct sockaddr_in sa = {.sin_family = AF_INET};
    socklen_t len = sizeof(sa);
    inet_pton(AF_INET, "127.0.0.1", &sa.sin_addr);
    int lfd = socket(AF_INET, SOCK_STREAM, 0);
    CHECK(lfd >= 0 && bind(lfd, (struct sockaddr *)&sa, sizeof(sa)) == 0 &&
          listen(lfd, 1) == 0);
    getsockname(lfd, (struct sockaddr *)&sa, &len);
    kvf_bs_reg_t reg = {
        .attn_tp_size = 1, .attn_cp_size = 1, .attn_dp_size = 1, .pp_size = 1,
        .system_dp_size = 1, .rank_ip = "127.0.0.1", .rank_port = ntohs(sa.sin_port),
        .page_size = PAGE, .kv_cache_dtype = "bfloat16",
    };
    CHECK_EQ_INT(kvf__bs_register(addr, &reg, 3000, err, sizeof(err)), KVF_OK);
    side_init(&dec, KVF_ROLE_DECODE, NULL, NULL);
    kvf_receiver_t *r;
    CHECK_EQ_INT(kvf_receiver_create(dec.eng, addr, 5, -1, &r), KVF_OK);
    struct pollfd pfd = {lfd, POLLIN, 0};
    CHECK(poll(&pfd, 1, 5000) == 1);
    int fd = accept(lfd, NULL, NULL);
    /* What a version-1 prefill sends first: HELLO, magic and version 1. */
    uint8_t frame[8 + 40] = {0};
    kvf_put_u32(frame, 40);
    frame[4] = KVF_MSG_HELLO;
    kvf_put_u32(frame + 8, KVF_WIRE_MAGIC);
    kvf_put_u16(frame + 12, 1);
    CHECK(send(fd, frame, sizeof(frame), MSG_NOSIGNAL) == (ssize_t)sizeof(frame));
    CHECK_EQ_INT(wait_receiver(r, KVF_POLL_WAITING_FOR_INPUT), KVF_POLL_FAILED);
    kvf_failure_t f;
    kvf_failure_init(&f);
    CHECK_EQ_INT(kvf_receiver_failure(r, &f), KVF_OK);
    CHECK_EQ_INT(f.status, KVF_ERR_VERSION);
    CHECK_STR_CONTAINS(f.reason, "peer speaks kvferry wire protocol version 1, this build "
                                 "speaks version 5");
    /* And what it got from us: an AUTH, which it refuses as type 11. */
    uint8_t h[8];
    CHECK(wp_read(fd, h, sizeof(h), 5000) && h[4] == KVF_MSG_AUTH);
    kvf_receiver_destroy(r);
    close(fd);
    close(lfd);
    side_fini(&dec);
    kvf_bootstrap_destroy(bs);
}

/* ---- protected mode ---------------------------------------------------- */

static void test_protected_mode(void)
{
    side_t s;
    clear_env();
    /* No token: not on an address others can reach. */
    CHECK_EQ_INT(side_try(&s, KVF_ROLE_DECODE, NULL, NULL, "0.0.0.0"), KVF_ERR_INVALID_PARAM);
    CHECK_STR_CONTAINS(kvf_last_error(), "without a cluster token");
    CHECK_STR_CONTAINS(kvf_last_error(), "KVF_AUTH_TOKEN");
    CHECK_STR_CONTAINS(kvf_last_error(), "KVF_AUTH=none");
    /* With a token, or with KVF_AUTH=none said explicitly: it may. */
    CHECK_EQ_INT(side_try(&s, KVF_ROLE_DECODE, NULL, "alpha", "0.0.0.0"), KVF_OK);
    kvf_engine_destroy(s.eng);
    setenv("KVF_AUTH", "none", 1);
    CHECK_EQ_INT(side_try(&s, KVF_ROLE_DECODE, NULL, NULL, "0.0.0.0"), KVF_OK);
    kvf_engine_destroy(s.eng);
    clear_env();

    /* At accept, without a token: loopback only. */
    CHECK_EQ_INT(side_try(&s, KVF_ROLE_DECODE, NULL, NULL, NULL), KVF_OK);
    struct sockaddr_in far = {.sin_family = AF_INET}, near = {.sin_family = AF_INET};
    struct sockaddr_in6 far6 = {.sin6_family = AF_INET6}, near6 = {.sin6_family = AF_INET6};
    inet_pton(AF_INET, "10.1.2.3", &far.sin_addr);
    inet_pton(AF_INET, "127.0.0.5", &near.sin_addr);
    inet_pton(AF_INET6, "fe80::1", &far6.sin6_addr);
    inet_pton(AF_INET6, "::ffff:127.0.0.1", &near6.sin6_addr);
    kvf__lock(s.eng);
    CHECK(!kvf__auth_admit(s.eng, (struct sockaddr *)&far));
    CHECK(!kvf__auth_admit(s.eng, (struct sockaddr *)&far6));
    CHECK(kvf__auth_admit(s.eng, (struct sockaddr *)&near));
    CHECK(kvf__auth_admit(s.eng, (struct sockaddr *)&near6));
    kvf__unlock(s.eng);
    CHECK_EQ_INT(engine_stats(s.eng).auth_refused, 2);
    kvf_engine_destroy(s.eng);
    /* ... and anyone may try the handshake once a token is set. */
    CHECK_EQ_INT(side_try(&s, KVF_ROLE_DECODE, NULL, "alpha", NULL), KVF_OK);
    kvf__lock(s.eng);
    CHECK(kvf__auth_admit(s.eng, (struct sockaddr *)&far));
    kvf__unlock(s.eng);
    kvf_engine_destroy(s.eng);
}

/*
 * A flood of connections that never authenticate: past the bound from one
 * address, new ones are closed at once (no AUTH sent, counted as
 * refusals); once the idle ones reach their handshake deadline and are
 * closed, connections are admitted again.
 */
static void test_unauthenticated_flood_bounded(void)
{
    static int fds[KVF_MAX_UNAUTH_PER_HOST];
    uint8_t body[1 << 12];
    kvf_msg_t m;
    kvf_engine_params_t p;
    kvf_engine_t *eng;
    clear_env();
    kvf_engine_params_init(&p);
    p.role = KVF_ROLE_DECODE;
    p.auth_token = "alpha";
    p.handshake_timeout_ms = 1000;
    CHECK_EQ_INT(kvf_engine_create(&p, &eng), KVF_OK);
    int port = port_of(eng);

    for (int i = 0; i < KVF_MAX_UNAUTH_PER_HOST; i++) {
        fds[i] = dial(port);
        CHECK(fds[i] >= 0 && wp_recv(fds[i], &m, body, sizeof(body), 5000) == KVF_MSG_AUTH);
    }
    uint64_t before = engine_stats(eng).auth_refused;
    int extra = dial(port);
    CHECK(extra >= 0 && wp_closed(extra, 5000));
    close(extra);
    CHECK_EQ_INT(engine_stats(eng).auth_refused, before + 1);
    /* The engine closes the idle ones at their deadline (EOF here). */
    int closed = 0;
    for (int i = 0; i < KVF_MAX_UNAUTH_PER_HOST; i++) {
        closed += wp_closed(fds[i], 5000);
        close(fds[i]);
    }
    CHECK_EQ_INT(closed, KVF_MAX_UNAUTH_PER_HOST);
    int again = dial(port);
    CHECK(again >= 0 && wp_recv(again, &m, body, sizeof(body), 5000) == KVF_MSG_AUTH);
    close(again);
    kvf_engine_destroy(eng);
}

KVF_TEST_MAIN(
    KVF_CASE(test_mac_context),
    KVF_CASE(test_wrong_token_refused),
    KVF_CASE(test_stranger_without_token),
    KVF_CASE(test_stranger_with_wrong_token),
    KVF_CASE(test_stranger_big_headers),
    KVF_CASE(test_strangers_over_shm),
    KVF_CASE(test_strangers_over_ucx),
    KVF_CASE(test_shm_handout),
    KVF_CASE(test_shm_handout_refusals_logged_once),
    KVF_CASE(test_shm_handout_out_of_descriptors),
    KVF_CASE(test_shm_memfds_cover_registered_only),
    KVF_CASE(test_ucx_software_rma),
    KVF_CASE(test_version1_peer),
    KVF_CASE(test_protected_mode),
    KVF_CASE(test_unauthenticated_flood_bounded)
)
