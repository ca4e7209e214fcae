/*
 * Decode: the acknowledgements a prefill rank has not confirmed yet.
 *
 * On a push link (tcp: the payload comes in the stream) a decode rank
 * reaches SUCCESS as it answers a DONE that checked: every byte is in its
 * memory.  The prefill rank reaches SUCCESS when that DONE_ACK arrives.  If
 * the connection resets in between, the answer is lost with it, and the
 * prefill rank waits one heartbeat timeout for the decode rank to come
 * back, which it would not: its room is over.  So each such answer is kept
 * here, on its peer, until the prefill rank confirms it (it answers every
 * DONE_ACK it takes with one of its own, protocol section 5); when the
 * connection resets first, the answers still owed are said again on a new
 * connection to the same prefill rank (the engine's tick dials it), where
 * the prefill rank takes them as the link's verdict
 * (sender.c, reacked).  They do not depend on the rooms: a room the
 * application destroyed right after its SUCCESS is still answered for.
 *
 * Bounded: KVF_ACKS_OWED per peer, and none older than two heartbeat
 * timeouts (a prefill rank waits one after its own connection broke).  A
 * prefill rank that never confirms costs this engine one full ring.
 * Everything here runs under the engine lock.
 */
#include <stdio.h>
#include <stdlib.h>

#include "core/peer.h"
#include "core/room.h"
#include "core/sync.h"
#include "util/log.h"
#include "util/time.h"

typedef struct kvf_owed {
    uint64_t room, instance, bytes;
    uint64_t t_ms;          /* when it was first said */
    int      confirmed;
} kvf_owed_t;

typedef struct kvf_acks {
    unsigned   head, n;     /* a ring, oldest first */
    kvf_owed_t a[KVF_ACKS_OWED];
} kvf_acks_t;

/* The answers of a peer whose connection reset, until the tick says them
 * again on a new connection. */
struct kvf_reack {
    struct kvf_reack *next;
    char              host[64];
    int               port, tp_rank;
    kvf_acks_t       *owed;
};

static uint64_t window_ms(const kvf_engine_t *eng)
{
    return 2ull * eng->params.heartbeat_timeout_ms;
}

static kvf_owed_t *at(kvf_acks_t *q, unsigned i)
{
    return &q->a[(q->head + i) % KVF_ACKS_OWED];
}

/* Drop from the front what was confirmed or is too old to matter. */
static void prune(kvf_acks_t *q, uint64_t now, uint64_t window)
{
    while (q->n > 0 && (at(q, 0)->confirmed || kvf_elapsed_ms(now, at(q, 0)->t_ms) > window)) {
        q->head = (q->head + 1) % KVF_ACKS_OWED;
        q->n--;
    }
}

static void push(kvf_peer_t *p, const kvf_owed_t *o)
{
    if (p->owed == NULL && (p->owed = calloc(1, sizeof(*p->owed))) == NULL)
        return;                 /* not kept: a reset then loses it, as before */
    kvf_acks_t *q = p->owed;
    prune(q, kvf_now_ms(), window_ms(p->eng));
    if (q->n == KVF_ACKS_OWED) {
        /* A prefill rank this far behind in confirming is not reading:
         * the oldest answer is no longer kept. */
        q->head = (q->head + 1) % KVF_ACKS_OWED;
        q->n--;
    }
    *at(q, q->n++) = *o;
}

void kvf__acks_owe(kvf_peer_t *p, uint64_t room, uint64_t instance, uint64_t bytes)
{
    KVF_ASSERT_LOCKED(p->eng);
    kvf_owed_t o = {room, instance, bytes, kvf_now_ms(), 0};
    push(p, &o);
}

int kvf__acks_confirmed(kvf_peer_t *p, const kvf_msg_done_ack_t *m)
{
    KVF_ASSERT_LOCKED(p->eng);
    kvf_acks_t *q = p->owed;
    if (q == NULL || m->status != KVF_OK)
        return 0;
    for (unsigned i = 0; i < q->n; i++) {
        kvf_owed_t *o = at(q, i);
        if (!o->confirmed && o->room == m->room && o->instance == m->instance &&
            o->bytes == m->bytes) {
            o->confirmed = 1;
            prune(q, kvf_now_ms(), window_ms(p->eng));
            return 1;
        }
    }
    return 0;
}

void kvf__acks_peer_lost(kvf_peer_t *p, kvf_status_t st)
{
    KVF_ASSERT_LOCKED(p->eng);
    kvf_engine_t *eng = p->eng;
    if (p->owed == NULL || st != KVF_ERR_CONN_RESET || !p->outbound)
        return;
    prune(p->owed, kvf_now_ms(), window_ms(eng));
    struct kvf_reack *ra = p->owed->n > 0 ? calloc(1, sizeof(*ra)) : NULL;
    if (ra == NULL)
        return;                 /* the ring goes with the peer */
    snprintf(ra->host, sizeof(ra->host), "%s", p->dial_host);
    ra->port = p->dial_port;
    ra->tp_rank = p->tp_rank;
    ra->owed = p->owed;
    p->owed = NULL;
    ra->next = eng->reacks;
    eng->reacks = ra;
}

/* Say a lost peer's answers again, on the connection to the same prefill
 * rank that kvf__peer_get finds or opens; they are owed there now. */
static void say_again(kvf_engine_t *eng, struct kvf_reack *ra, uint64_t now)
{
    kvf_acks_t *q = ra->owed;
    prune(q, now, window_ms(eng));
    if (q->n == 0)
        return;
    kvf_peer_t *p = kvf__peer_get(eng, ra->host, ra->port, ra->tp_rank, 0);
    if (p == NULL || p->state == KVF_PEER_DEAD) {
        kvf_info("prefill rank %d at %s:%d: cannot dial it again to repeat %u "
                 "acknowledgements lost with its connection", ra->tp_rank, ra->host,
                 ra->port, q->n);
        return;
    }
    kvf_info("prefill rank %d at %s:%d: repeating %u acknowledgements lost with its "
             "connection", ra->tp_rank, ra->host, ra->port, q->n);
    for (unsigned i = 0; i < q->n; i++) {
        kvf_owed_t *o = at(q, i);
        kvf_msg_t m = {.type = KVF_MSG_DONE_ACK};
        if (o->confirmed)
            continue;
        m.u.done_ack.room = o->room;
        m.u.done_ack.instance = o->instance;
        m.u.done_ack.status = KVF_OK;
        m.u.done_ack.bytes = o->bytes;
        if (kvf__peer_send_soon(p, &m)) {
            eng->metrics.acks_repeated++;
            push(p, o);
        }
    }
}

void kvf__acks_tick(kvf_engine_t *eng, uint64_t now)
{
    KVF_ASSERT_LOCKED(eng);
    while (eng->reacks != NULL) {
        struct kvf_reack *ra = eng->reacks;
        eng->reacks = ra->next;
        say_again(eng, ra, now);
        free(ra->owed);
        free(ra);
    }
}

void kvf__acks_free(kvf_engine_t *eng)
{
    KVF_ASSERT_LOCKED(eng);
    while (eng->reacks != NULL) {
        struct kvf_reack *ra = eng->reacks;
        eng->reacks = ra->next;
        free(ra->owed);
        free(ra);
    }
}
