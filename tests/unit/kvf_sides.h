/*
 * Engines with a small layout for the tests that put strangers beside
 * legitimate rooms (test_auth.c, test_flood.c): a prefill or decode side
 * with its token, a room moved between two sides and checked byte for
 * byte (in one process, or its halves in two), raw sockets to an
 * engine's control port, and stranger processes forked before any engine
 * thread exists.  Header-only, like kvf_test.h.
 */
#ifndef KVF_SIDES_H
#define KVF_SIDES_H

#include <arpa/inet.h>
#include <stdio.h>
#include <netinet/in.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "kvferry/kvferry.h"
#include "unit/kvf_test.h"

#define LAYERS 2
#define NKV    (2 * LAYERS)
#define HEADS  2
#define HEAD_B 32
#define PAGE   4
#define PAGES  32
#define PAGE_B (PAGE * HEADS * HEAD_B)
#define AUX_B  16
#define SLOTS  8

typedef struct side {
    kvf_engine_t *eng;
    uint8_t      *kv[NKV];
    uint8_t      *aux;
} side_t;

/* What the next side_init makes: its transport, its KV in kvf_mem_alloc()
 * memory, and any other parameter a test sets (side_tune). */
static const char *side_transport = "tcp";
static int side_mem_alloc;
static void (*side_tune)(kvf_engine_params_t *p);

/* No token from the environment: every case says which one each engine holds. */
static inline void clear_env(void)
{
    unsetenv("KVF_AUTH_TOKEN");
    unsetenv("KVF_AUTH_TOKEN_FILE");
    unsetenv("SGLANG_DISAGGREGATION_BOOTSTRAP_AUTH_TOKEN");
    unsetenv("KVF_AUTH");
}

static inline kvf_status_t side_try(side_t *s, kvf_role_t role, const char *bs,
                                    const char *token, const char *host)
{
    kvf_engine_params_t p;
    kvf_engine_params_init(&p);
    p.role = role;
    p.bootstrap_addr = bs;
    p.host_bootstrap = role == KVF_ROLE_PREFILL && bs != NULL &&
                       strcmp(bs, "127.0.0.1:0") == 0;
    p.bootstrap_timeout_ms = 5000;
    p.transfer_timeout_ms = 5000;
    p.transport = side_transport;
    p.auth_token = token;
    if (host != NULL)
        p.host = host;
    if (side_tune != NULL)
        side_tune(&p);
    memset(s, 0, sizeof(*s));
    return kvf_engine_create(&p, &s->eng);
}

/* The byte a prefill side holds at offset j of KV buffer i. */
static inline uint8_t side_kv_byte(int i, size_t j)
{
    return (uint8_t)(j * 7 + (size_t)i * 13 + 1);
}

/* Register s's KV (s->kv[], already placed) and aux (s->aux) as its
 * layout; a prefill's KV gets its pattern first. */
static inline void side_register(side_t *s, kvf_role_t role)
{
    kvf_buffer_t kv[NKV], aux;
    for (int i = 0; i < NKV; i++) {
        if (role == KVF_ROLE_PREFILL)
            for (size_t j = 0; j < (size_t)PAGES * PAGE_B; j++)
                s->kv[i][j] = side_kv_byte(i, j);
        kv[i] = (kvf_buffer_t){s->kv[i], (size_t)PAGES * PAGE_B, PAGE_B};
    }
    aux = (kvf_buffer_t){s->aux, SLOTS * AUX_B, AUX_B};
    kvf_layout_t l;
    kvf_layout_init(&l);
    l.page_size = PAGE;
    l.kv_dtype = "bfloat16";
    l.num_layers = LAYERS;
    l.heads_per_rank = l.total_heads = HEADS;
    l.bytes_per_head = HEAD_B;
    l.num_kv = NKV;
    l.kv = kv;
    l.num_aux = 1;
    l.aux = &aux;
    CHECK_EQ_INT(kvf_engine_register_layout(s->eng, &l), KVF_OK);
}

static inline void side_init(side_t *s, kvf_role_t role, const char *bs, const char *token)
{
    CHECK_EQ_INT(side_try(s, role, bs, token, NULL), KVF_OK);
    for (int i = 0; i < NKV; i++) {
        if (side_mem_alloc)
            CHECK_EQ_INT(kvf_mem_alloc((size_t)PAGES * PAGE_B, (void **)&s->kv[i]), KVF_OK);
        else
            s->kv[i] = calloc(PAGES, PAGE_B);
    }
    s->aux = calloc(SLOTS, AUX_B);
    side_register(s, role);
}

static inline void side_fini(side_t *s)
{
    kvf_engine_destroy(s->eng);
    for (int i = 0; i < NKV; i++) {
        if (side_mem_alloc)
            kvf_mem_free(s->kv[i]);
        else
            free(s->kv[i]);
    }
    free(s->aux);
}

static inline void pause_ms(int ms)
{
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

/* The room's state once it is final or past `want` (limit_ms at most). */
static inline kvf_poll_t recv_wait_ms(kvf_receiver_t *r, kvf_poll_t want, int limit_ms)
{
    kvf_poll_t st = kvf_receiver_poll(r);
    for (int i = 0; i < limit_ms && st != KVF_POLL_FAILED && st < want; i++) {
        pause_ms(1);
        st = kvf_receiver_poll(r);
    }
    return st;
}

static inline kvf_poll_t recv_wait(kvf_receiver_t *r, kvf_poll_t want)
{
    return recv_wait_ms(r, want, 10000);
}

static inline kvf_poll_t send_wait(kvf_sender_t *s, kvf_poll_t want)
{
    kvf_poll_t st = kvf_sender_poll(s);
    for (int i = 0; i < 10000 && st != KVF_POLL_FAILED && st < want; i++) {
        pause_ms(1);
        st = kvf_sender_poll(s);
    }
    return st;
}

static const uint32_t src_pages[3] = {3, 4, 9}, dst_pages[3] = {20, 5, 6};

/* The prefill half of a room, in two steps: its sender first (before the
 * receiver asks: a request for a room id whose sender was destroyed, and
 * that no sender holds yet, is answered as gone), then its pages, once
 * the receiver asked.  @return the sender's final state (or the one it
 * stopped in); the sender is destroyed. */
static inline kvf_sender_t *legit_send_start(side_t *pre, const char *bs, uint64_t room)
{
    kvf_sender_t *s = NULL;
    memcpy(pre->aux + 1 * AUX_B, "legit-room-tag-1", AUX_B);
    CHECK_EQ_INT(kvf_sender_create(pre->eng, bs, room, &s), KVF_OK);
    return s;
}

static inline kvf_poll_t legit_send_finish(kvf_sender_t *s)
{
    kvf_poll_t st = send_wait(s, KVF_POLL_WAITING_FOR_INPUT);
    if (st == KVF_POLL_WAITING_FOR_INPUT) {
        CHECK_EQ_INT(kvf_sender_init(s, 3, 1), KVF_OK);
        CHECK_EQ_INT(kvf_sender_send(s, src_pages, 3, 1), KVF_OK);
        st = send_wait(s, KVF_POLL_SUCCESS);
    }
    kvf_sender_destroy(s);
    return st;
}

static inline kvf_poll_t legit_send(side_t *pre, const char *bs, uint64_t room)
{
    return legit_send_finish(legit_send_start(pre, bs, room));
}

/* The decode half: a receiver of `room` with its destination. */
static inline kvf_receiver_t *legit_recv_start(side_t *dec, const char *bs, uint64_t room)
{
    kvf_receiver_t *r = NULL;
    CHECK_EQ_INT(kvf_receiver_create(dec->eng, bs, room, -1, &r), KVF_OK);
    CHECK_EQ_INT(kvf_receiver_init(r, dst_pages, 3, 2, NULL, 0), KVF_OK);
    return r;
}

/* 1 if the room's pages and aux are what a prefill side holds. */
static inline int legit_bytes(const side_t *dec)
{
    int ok = 1;
    for (int b = 0; b < NKV; b++)
        for (int i = 0; i < 3; i++)
            for (size_t j = 0; j < PAGE_B; j++)
                ok &= dec->kv[b][(size_t)dst_pages[i] * PAGE_B + j] ==
                      side_kv_byte(b, (size_t)src_pages[i] * PAGE_B + j);
    return ok && memcmp(dec->aux + 2 * AUX_B, "legit-room-tag-1", AUX_B) == 0;
}

/* Room `room` from pre to dec, whole; 1 if every byte is in place. */
static inline int legit_room(side_t *pre, side_t *dec, const char *bs, uint64_t room)
{
    kvf_sender_t *s = legit_send_start(pre, bs, room);
    kvf_receiver_t *r = legit_recv_start(dec, bs, room);
    int ok = legit_send_finish(s) == KVF_POLL_SUCCESS &&
             recv_wait(r, KVF_POLL_SUCCESS) == KVF_POLL_SUCCESS && legit_bytes(dec);
    kvf_receiver_destroy(r);
    return ok;
}

static inline int port_of(kvf_engine_t *eng)
{
    char addr[64];
    CHECK_EQ_INT(kvf_engine_address(eng, addr, sizeof(addr)), KVF_OK);
    return atoi(strrchr(addr, ':') + 1);
}

/* A blocking connection to 127.0.0.1:port, or -1. */
static inline int dial(int port)
{
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    inet_pton(AF_INET, "127.0.0.1", &sa.sin_addr);
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd >= 0 && connect(fd, (struct sockaddr *)&sa, sizeof(sa)) != 0) {
        close(fd);
        fd = -1;
    }
    return fd;
}

/* ---- stranger processes ------------------------------------------------ */

/* What the stranger does; @return 0 if the engine behaved. */
typedef int (*stranger_fn_t)(int port);

/* Run fn in a child process (it learns the port through a pipe, so it is
 * forked before any engine thread exists); waitable with stranger_join. */
typedef struct stranger {
    pid_t pid;
    int   wfd;
} stranger_t;

static inline stranger_t stranger_fork(stranger_fn_t fn)
{
    int p[2];
    stranger_t s = {-1, -1};
    if (pipe(p) != 0)
        return s;
    fflush(NULL);                     /* nothing buffered is written twice */
    s.pid = fork();
    if (s.pid == 0) {
        int port = 0;
        close(p[1]);
        alarm(60);                    /* never outlive the test */
        if (read(p[0], &port, sizeof(port)) != sizeof(port))
            _exit(99);
        _exit(fn(port));
    }
    close(p[0]);
    s.wfd = p[1];
    return s;
}

static inline int stranger_join(stranger_t *s, int port)
{
    int status = -1;
    CHECK(write(s->wfd, &port, sizeof(port)) == sizeof(port));
    close(s->wfd);
    CHECK(waitpid(s->pid, &status, 0) == s->pid);
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

#endif /* KVF_SIDES_H */
