/*
 * A side: one engine on loopback with its KV, aux and (optionally) state
 * buffers registered as one small layout, the same in every test that
 * moves rooms between real engines.  The one idea: a test says only what
 * differs from that side (its transport, a token, an engine parameter,
 * its place among ranks, the layout's shape) and what it checks.  It gives:
 *   - the shape (LAYERS ... SLOTS): defaults a test may #define first;
 *   - side_init / side_try / side_fini, side_pair (a prefill hosting
 *     the registry on a free port, and a decode engine that finds it) and
 *     side_ranks (TP prefill and decode ranks around one registry), set
 *     by side_transport, side_mem_alloc, side_state_b, side_page,
 *     side_dtype, side_heads, the deadlines, side_rank (TP, PP and DP
 *     rank), side_tune (any other engine parameter), side_shape (any
 *     other layout field) and side_fill (what a prefill's KV holds);
 *   - a rank's layout follows its place: HEADS / TP size heads per rank,
 *     and a pipeline stage holds its share of the layers;
 *   - a prefill's KV holds side_rank_byte() from the start;
 *   - a "legit" room moved whole and checked byte for byte (in one
 *     process, or its halves in two), beside whatever a test does;
 *   - stranger processes forked before any engine thread exists;
 *   - a call made while an engine's lock is held (call_while_locked).
 * Waits are kvf_rooms.h's, raw sockets kvf_wire_peer.h's.  Header-only.
 */
#ifndef KVF_SIDES_H
#define KVF_SIDES_H

#include <errno.h>
#include <pthread.h>
#include <semaphore.h>
#include <stdio.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "core/sync.h"
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
    int           nkv;        /* KV buffers of its layout: NKV / pipeline stages */
    int           tp_rank, tp_size, pp_rank, pp_size;
    size_t        page_b;     /* bytes of one of its KV pages */
} side_t;

/* A side's place among ranks: sizes 0 mean 1. */
typedef struct side_rank {
    int tp, tp_size, pp, pp_size, dp, dp_size;
} side_rank_t;

/* What the next side_init makes: its transport, its KV in kvf_mem_alloc()
 * memory, a state buffer of SLOTS items this big (0: none), tokens per
 * page (0: PAGE), KV dtype (NULL: bfloat16) and the model's heads (0:
 * HEADS) of its layout, its bootstrap and transfer deadlines (0: the
 * library's defaults), its place, any other engine parameter a test sets
 * (side_tune, called last), any other field of its layout (side_shape,
 * called just before it is registered) and the byte its KV holds at
 * offset j of buffer i if it is a prefill (side_fill; NULL:
 * side_rank_byte). */
static const char *side_transport = "tcp";
static int side_mem_alloc;
static size_t side_state_b;
static uint32_t side_page;
static const char *side_dtype;
static uint32_t side_heads;
static unsigned side_bootstrap_ms = 5000, side_transfer_ms = 5000;
static side_rank_t side_rank;
static void (*side_tune)(kvf_engine_params_t *p);
static void (*side_shape)(side_t *s, kvf_layout_t *l);
static uint8_t (*side_fill)(const side_t *s, int i, size_t j);

/* No token from the environment: every case says which one each engine holds. */
static inline void clear_env(void)
{
    unsetenv("KVF_AUTH_TOKEN");
    unsetenv("KVF_AUTH_TOKEN_FILE");
    unsetenv("SGLANG_DISAGGREGATION_BOOTSTRAP_AUTH_TOKEN");
    unsetenv("KVF_AUTH");
}

/* The engine alone: it hosts the registry when it is a prefill asked to
 * bind one on a free port ("127.0.0.1:0").  s records its place. */
static inline kvf_status_t side_try(side_t *s, kvf_role_t role, const char *bs,
                                    const char *token, const char *host)
{
    kvf_engine_params_t p;
    kvf_engine_params_init(&p);
    p.role = role;
    p.bootstrap_addr = bs;
    p.host_bootstrap = role == KVF_ROLE_PREFILL && bs != NULL &&
                       strcmp(bs, "127.0.0.1:0") == 0;
    if (side_bootstrap_ms)
        p.bootstrap_timeout_ms = side_bootstrap_ms;
    if (side_transfer_ms)
        p.transfer_timeout_ms = side_transfer_ms;
    p.transport = side_transport;
    p.auth_token = token;
    p.tp_rank = side_rank.tp;
    p.tp_size = side_rank.tp_size ? side_rank.tp_size : 1;
    p.pp_rank = side_rank.pp;
    p.pp_size = side_rank.pp_size ? side_rank.pp_size : 1;
    p.dp_rank = side_rank.dp;
    p.dp_size = side_rank.dp_size ? side_rank.dp_size : 1;
    if (host != NULL)
        p.host = host;
    if (side_tune != NULL)
        side_tune(&p);
    memset(s, 0, sizeof(*s));
    s->tp_rank = p.tp_rank;
    s->tp_size = p.tp_size > 0 ? p.tp_size : 1;
    s->pp_rank = p.pp_rank;
    s->pp_size = p.pp_size > 0 ? p.pp_size : 1;
    s->nkv = NKV / s->pp_size;
    s->page_b = (size_t)(side_page ? side_page : PAGE) *
                ((side_heads ? side_heads : HEADS) / (uint32_t)s->tp_size) * HEAD_B;
    return kvf_engine_create(&p, &s->eng);
}

/* The byte a prefill side holds at offset j of KV buffer i: it differs
 * from page to page, so a page placed in the wrong slot shows. */
static inline uint8_t side_kv_byte(int i, size_t j)
{
    return (uint8_t)(j * 7 + j / PAGE_B + (size_t)i * 13 + 1);
}

/* The same, and from TP rank to TP rank: a page from another rank shows. */
static inline uint8_t side_rank_byte(const side_t *s, int i, size_t j)
{
    return (uint8_t)(side_kv_byte(i, j) + s->tp_rank * 31);
}

/* Register s's KV (s->kv[], already placed), aux and state as its
 * layout, as they are (device memory the test writes itself).
 * @return what registering said. */
static inline kvf_status_t side_try_register(side_t *s)
{
    uint32_t heads = side_heads ? side_heads : HEADS;
    kvf_buffer_t kv[NKV], aux, st;
    for (int i = 0; i < s->nkv; i++)
        kv[i] = (kvf_buffer_t){s->kv[i], (size_t)PAGES * s->page_b, s->page_b};
    aux = (kvf_buffer_t){s->aux, SLOTS * AUX_B, AUX_B};
    st = (kvf_buffer_t){s->state, SLOTS * side_state_b, side_state_b};
    kvf_layout_t l;
    kvf_layout_init(&l);
    l.page_size = side_page ? side_page : PAGE;
    l.kv_dtype = side_dtype ? side_dtype : "bfloat16";
    l.num_layers = LAYERS / (uint32_t)s->pp_size;
    l.first_layer = (uint32_t)s->pp_rank * l.num_layers;
    l.heads_per_rank = heads / (uint32_t)s->tp_size;
    l.total_heads = heads;
    l.bytes_per_head = HEAD_B;
    l.num_kv = (uint32_t)s->nkv;
    l.kv = kv;
    l.num_aux = 1;
    l.aux = &aux;
    l.num_state = s->state != NULL ? 1 : 0;
    l.state = &st;
    if (side_shape != NULL)
        side_shape(s, &l);
    return kvf_engine_register_layout(s->eng, &l);
}

/* The same, a prefill's KV given its pattern (side_fill) first. */
static inline void side_register(side_t *s, kvf_role_t role)
{
    for (int i = 0; role == KVF_ROLE_PREFILL && i < s->nkv; i++)
        for (size_t j = 0; j < (size_t)PAGES * s->page_b; j++)
            s->kv[i][j] = side_fill ? side_fill(s, i, j) : side_rank_byte(s, i, j);
    CHECK_EQ_INT(side_try_register(s), KVF_OK);
}

static inline void side_init(side_t *s, kvf_role_t role, const char *bs, const char *token)
{
    CHECK_EQ_INT(side_try(s, role, bs, token, NULL), KVF_OK);
    for (int i = 0; i < s->nkv; i++) {
        if (side_mem_alloc)
            CHECK_EQ_INT(kvf_mem_alloc((size_t)PAGES * s->page_b, (void **)&s->kv[i]), KVF_OK);
        else
            s->kv[i] = calloc(PAGES, s->page_b);
    }
    s->aux = calloc(SLOTS, AUX_B);
    if (side_state_b)
        s->state = calloc(SLOTS, side_state_b);
    side_register(s, role);
}

static inline void side_fini(side_t *s)
{
    kvf_engine_destroy(s->eng);
    for (int i = 0; i < s->nkv; i++) {
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

/*
 * np prefill ranks, as dp DP groups of TP np / dp (rank k: TP rank
 * k % (np / dp) of DP group k / (np / dp)), and nd decode ranks (TP nd),
 * at side_rank's pipeline stage.  With bs, prefill rank 0 hosts the
 * registry (its address in bs) and every other rank finds it there;
 * without (NULL), no rank has one.  side_rank is left as it was.
 */
static inline void side_ranks(side_t *pre, int np, int dp, side_t *dec, int nd, char *bs,
                              size_t bslen)
{
    side_rank_t keep = side_rank;
    int tps = np / dp;
    for (int k = 0; k < np; k++) {
        side_rank.tp = k % tps;
        side_rank.tp_size = tps;
        side_rank.dp = k / tps;
        side_rank.dp_size = dp;
        side_init(&pre[k], KVF_ROLE_PREFILL, bs == NULL ? NULL : k == 0 ? "127.0.0.1:0" : bs,
                  NULL);
        if (k == 0 && bs != NULL)
            CHECK_EQ_INT(kvf_engine_bootstrap_addr(pre[0].eng, bs, bslen), KVF_OK);
    }
    for (int j = 0; j < nd; j++) {
        side_rank.tp = j;
        side_rank.tp_size = nd;
        side_rank.dp = 0;
        side_rank.dp_size = 1;
        side_init(&dec[j], KVF_ROLE_DECODE, NULL, NULL);
    }
    side_rank = keep;
}

/* The decode ranks, then the prefill ranks, the registry's last. */
static inline void side_ranks_fini(side_t *pre, int np, side_t *dec, int nd)
{
    for (int j = 0; j < nd; j++)
        side_fini(&dec[j]);
    for (int k = np - 1; k >= 0; k--)
        side_fini(&pre[k]);
}

static const uint32_t legit_src[3] = {3, 4, 9}, legit_dst[3] = {20, 5, 6};

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
        CHECK_EQ_INT(kvf_sender_send(s, legit_src, 3, 1), KVF_OK);
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
    CHECK_EQ_INT(kvf_receiver_init(r, legit_dst, 3, 2, NULL, 0), KVF_OK);
    return r;
}

/* 1 if the room's pages and aux are what a prefill side holds. */
static inline int legit_bytes(const side_t *dec)
{
    int ok = 1;
    for (int b = 0; b < NKV; b++)
        for (int i = 0; i < 3; i++)
            for (size_t j = 0; j < PAGE_B; j++)
                ok &= dec->kv[b][(size_t)legit_dst[i] * PAGE_B + j] ==
                      side_kv_byte(b, (size_t)legit_src[i] * PAGE_B + j);
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
/* What call_while_locked runs on its thread. */
typedef struct {
    void  (*fn)(void *arg);
    void   *arg;
    sem_t   done;
} locked_call_t;

static inline void *locked_call_main(void *arg)
{
    locked_call_t *c = arg;
    c->fn(c->arg);
    sem_post(&c->done);
    return NULL;
}

/* fn(arg) on a thread of its own while this thread holds eng's lock, as a
 * lane's pass would: 0 once fn returned, -1 if it had not within 10 s (it
 * waits for the engine lock).  The lock is let go and the thread joined
 * either way. */
static inline int call_while_locked(kvf_engine_t *eng, void (*fn)(void *), void *arg)
{
    locked_call_t c = {.fn = fn, .arg = arg};
    pthread_t t;
    CHECK_EQ_INT(sem_init(&c.done, 0, 0), 0);
    kvf__lock(eng);
    CHECK_EQ_INT(pthread_create(&t, NULL, locked_call_main, &c), 0);
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_sec += 10;
    int waited;
    while ((waited = sem_timedwait(&c.done, &until)) != 0 && errno == EINTR)
        ;
    kvf__unlock(eng);
    pthread_join(t, NULL);
    sem_destroy(&c.done);
    return waited == 0 ? 0 : -1;
}

#endif /* KVF_SIDES_H */
