/*
 * A side: one engine on loopback with its KV, aux and (optionally) state
 * buffers registered as one small layout, the same in every test that
 * moves rooms between real engines.  The one idea: a test says only what
 * differs from that side (its transport, a token, an engine parameter,
 * the layout's shape) and what it checks.  It gives:
 *   - the shape (LAYERS ... SLOTS): defaults a test may #define first;
 *   - side_init / side_try / side_fini, and side_pair (a prefill hosting
 *     the registry on a free port, and a decode engine that finds it),
 *     set by side_transport, side_mem_alloc, side_state_b, side_page,
 *     side_dtype and side_tune (any other engine parameter);
 *   - a prefill's KV holds side_kv_byte() from the start;
 *   - a "legit" room moved whole and checked byte for byte (in one
 *     process, or its halves in two), beside whatever a test does;
 *   - stranger processes forked before any engine thread exists.
 * Waits are kvf_rooms.h's, raw sockets kvf_wire_peer.h's.  Header-only.
 */
#ifndef KVF_SIDES_H
#define KVF_SIDES_H

#include <stdio.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "kvferry/kvferry.h"
#include "unit/kvf_rooms.h"
#include "unit/kvf_test.h"
#include "unit/kvf_wire_peer.h"

#ifndef LAYERS
#define LAYERS 2
#endif
#define NKV    (2 * LAYERS)
#ifndef HEADS
#define HEADS  2
#endif
#ifndef HEAD_B
#define HEAD_B 32
#endif
#ifndef PAGE
#define PAGE   4
#endif
#ifndef PAGES
#define PAGES  32
#endif
#define PAGE_B (PAGE * HEADS * HEAD_B)
#ifndef AUX_B
#define AUX_B  16
#endif
#ifndef SLOTS
#define SLOTS  8
#endif

typedef struct side {
    kvf_engine_t *eng;
    uint8_t      *kv[NKV];
    uint8_t      *aux;
    uint8_t      *state;      /* SLOTS items of side_state_b, or NULL */
} side_t;

/* What the next side_init makes: its transport, its KV in kvf_mem_alloc()
 * memory, a state buffer of SLOTS items this big (0: none), tokens per
 * page (0: PAGE) and KV dtype (NULL: bfloat16) of its layout, and any
 * other engine parameter a test sets (side_tune). */
static const char *side_transport = "tcp";
static int side_mem_alloc;
static size_t side_state_b;
static uint32_t side_page;
static const char *side_dtype;
static void (*side_tune)(kvf_engine_params_t *p);

/* No token from the environment: every case says which one each engine holds. */
static inline void clear_env(void)
{
    unsetenv("KVF_AUTH_TOKEN");
    unsetenv("KVF_AUTH_TOKEN_FILE");
    unsetenv("SGLANG_DISAGGREGATION_BOOTSTRAP_AUTH_TOKEN");
    unsetenv("KVF_AUTH");
}

/* The engine alone: it hosts the registry when it is a prefill asked to
 * bind one on a free port ("127.0.0.1:0"). */
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

/* Bytes of one KV page of the next side's layout. */
static inline size_t side_page_b(void)
{
    return (size_t)(side_page ? side_page : PAGE) * HEADS * HEAD_B;
}

/* The byte a prefill side holds at offset j of KV buffer i: it differs
 * from page to page, so a page placed in the wrong slot shows. */
static inline uint8_t side_kv_byte(int i, size_t j)
{
    return (uint8_t)(j * 7 + j / PAGE_B + (size_t)i * 13 + 1);
}

/* Register s's KV (s->kv[], already placed), aux and state as its
 * layout; a prefill's KV gets its pattern first. */
static inline void side_register(side_t *s, kvf_role_t role)
{
    size_t page_b = side_page_b();
    kvf_buffer_t kv[NKV], aux, st;
    for (int i = 0; i < NKV; i++) {
        if (role == KVF_ROLE_PREFILL)
            for (size_t j = 0; j < (size_t)PAGES * page_b; j++)
                s->kv[i][j] = side_kv_byte(i, j);
        kv[i] = (kvf_buffer_t){s->kv[i], (size_t)PAGES * page_b, page_b};
    }
    aux = (kvf_buffer_t){s->aux, SLOTS * AUX_B, AUX_B};
    st = (kvf_buffer_t){s->state, SLOTS * side_state_b, side_state_b};
    kvf_layout_t l;
    kvf_layout_init(&l);
    l.page_size = side_page ? side_page : PAGE;
    l.kv_dtype = side_dtype ? side_dtype : "bfloat16";
    l.num_layers = LAYERS;
    l.heads_per_rank = l.total_heads = HEADS;
    l.bytes_per_head = HEAD_B;
    l.num_kv = NKV;
    l.kv = kv;
    l.num_aux = 1;
    l.aux = &aux;
    l.num_state = s->state != NULL ? 1 : 0;
    l.state = &st;
    CHECK_EQ_INT(kvf_engine_register_layout(s->eng, &l), KVF_OK);
}

static inline void side_init(side_t *s, kvf_role_t role, const char *bs, const char *token)
{
    size_t page_b = side_page_b();
    CHECK_EQ_INT(side_try(s, role, bs, token, NULL), KVF_OK);
    for (int i = 0; i < NKV; i++) {
        if (side_mem_alloc)
            CHECK_EQ_INT(kvf_mem_alloc((size_t)PAGES * page_b, (void **)&s->kv[i]), KVF_OK);
        else
            s->kv[i] = calloc(PAGES, page_b);
    }
    s->aux = calloc(SLOTS, AUX_B);
    if (side_state_b)
        s->state = calloc(SLOTS, side_state_b);
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
    free(s->state);
}

/* A prefill side hosting the registry (its address in bs) and a decode
 * side that finds the prefill through it, both holding `token`. */
static inline void side_pair(side_t *pre, side_t *dec, char *bs, size_t bslen,
                             const char *token)
{
    side_init(pre, KVF_ROLE_PREFILL, "127.0.0.1:0", token);
    CHECK_EQ_INT(kvf_engine_bootstrap_addr(pre->eng, bs, bslen), KVF_OK);
    side_init(dec, KVF_ROLE_DECODE, NULL, token);
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
    kvf_poll_t st = wait_sender(s, KVF_POLL_WAITING_FOR_INPUT);
    if (st == KVF_POLL_WAITING_FOR_INPUT) {
        CHECK_EQ_INT(kvf_sender_init(s, 3, 1), KVF_OK);
        CHECK_EQ_INT(kvf_sender_send(s, src_pages, 3, 1), KVF_OK);
        st = wait_sender(s, KVF_POLL_SUCCESS);
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
             wait_receiver(r, KVF_POLL_SUCCESS) == KVF_POLL_SUCCESS && legit_bytes(dec);
    kvf_receiver_destroy(r);
    return ok;
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
