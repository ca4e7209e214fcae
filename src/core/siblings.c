/*
 * Siblings: every rank that takes part in a room hears of its failure,
 * also a rank whose own bytes moved without a fault.
 *
 * The ranks of one server that serve the same requests (the TP ranks and
 * pipeline stages of one DP group) are siblings for a room, and a
 * scheduler takes the minimum of their poll states: a room that fails on
 * one of them fails on all.  Each of them must then be able to say why.
 * The byte links alone do not connect them: with equal TP on both sides,
 * prefill rank k feeds decode rank k only, and nothing joins pair 0 to
 * pair 1.
 *
 * The one idea: a decode rank links to every prefill rank of the room's
 * DP group, those it reads from (its byte links, room.h's kvf_link_t) and
 * the others (its sibling links, here): it sends each of the others a
 * watch, a ROOM_REQ that names the room and its instance and asks for
 * nothing.  Every room then spans the complete bipartite graph between its
 * decode ranks and its prefill ranks, and a failure travels along it as
 * on a byte link: the rank that sees the root cause tells every peer of
 * the room (room.c, kvf__room_fail_record), each of them records it as
 * learned from another rank and tells its own peers but the one it heard
 * it from.  Any rank reaches any other in at most two hops, over as many
 * disjoint paths as the other side has ranks, so one rank dying on the
 * way loses no relay; and a rank that dies is seen to die by every rank
 * of the other side directly (docs/PROTOCOL.md, "Siblings").
 *
 * A sibling link binds like a byte link (docs/SECURITY.md): a FAIL counts
 * only from the peer that watched, naming the room instance it watched
 * with.  It moves no payload, so its connection takes no mover
 * (kvf__peer_get's `watch`).  A sender that loses a watcher forgets it:
 * the decode rank's own byte links see to it, and the failures they
 * record still reach every sibling around the lost link.  A decode rank
 * that loses a prefill rank it watches fails the room (lost(), below):
 * it cannot know whether that rank's share was done.  This file only
 * says so, as a verdict; the caller that owns the room (room.c for a
 * peer gone, receiver.c for a rank it could not dial again) fails it,
 * so that rooms call down here and never the other way.  Everything here
 * runs under the engine lock.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/room.h"
#include "core/sync.h"
#include "core/trace.h"
#include "util/log.h"
#include "util/time.h"

/* Watches a sender keeps per room: more than any real server's decode
 * ranks; past it a watch is dropped (counted as a dropped room message). */
#define MAX_WATCHERS MAX_LINKS

void kvf__siblings_free(kvf_room_t *r)
{
    KVF_ASSERT_LOCKED(r->eng);
    for (uint32_t i = 0; i < r->nwatch; i++)
        if (r->watch[i].peer != NULL)
            kvf__peer_put(r->watch[i].peer);
    free(r->watch);
    r->watch = NULL;
    r->nwatch = 0;
}

static kvf_watch_t *watch_of(const kvf_room_t *r, const kvf_peer_t *p)
{
    for (uint32_t i = 0; i < r->nwatch; i++)
        if (r->watch[i].peer == p)
            return &r->watch[i];
    return NULL;
}

int kvf__siblings_bound(const kvf_room_t *r, const kvf_peer_t *p, uint64_t instance)
{
    KVF_ASSERT_LOCKED(r->eng);
    const kvf_watch_t *w = watch_of(r, p);
    return w != NULL && (r->side == KVF_ROLE_DECODE || w->instance == instance);
}

/* ------------------------------------------------------------------------ */
/* Decode: the prefill ranks it does not read from                          */
/* ------------------------------------------------------------------------ */

void kvf__siblings_link(kvf_room_t *r, const kvf_target_t *t, int n)
{
    KVF_ASSERT_LOCKED(r->eng);
    if (n <= 0)
        return;
    r->watch = calloc((size_t)n, sizeof(kvf_watch_t));
    if (r->watch == NULL) {
        /* Only the relay to these ranks is lost; the room itself goes on. */
        kvf_warn("room %llu: no memory for its %d sibling links: a failure of the room "
                 "reaches those prefill ranks through the others only",
                 (unsigned long long)r->id, n);
        return;
    }
    for (int i = 0; i < n; i++) {
        kvf_peer_t *p = kvf__peer_get(r->eng, t[i].host, t[i].port, t[i].rank, 1);
        if (p == NULL)
            continue;
        p->refs++;
        kvf_watch_t *w = &r->watch[r->nwatch++];
        *w = (kvf_watch_t){.peer = p, .rank = (uint32_t)t[i].rank, .port = t[i].port};
        snprintf(w->host, sizeof(w->host), "%s", t[i].host);
    }
    kvf__siblings_send(r);
}

static void send_watch(kvf_room_t *r, kvf_watch_t *w)
{
    kvf_msg_t m = {.type = KVF_MSG_ROOM_REQ};
    m.u.room_req.room = r->id;
    m.u.room_req.instance = r->instance;
    m.u.room_req.dst_rank = (uint32_t)r->eng->params.tp_rank;
    m.u.room_req.aux_slot = KVF_NO_SLOT;
    m.u.room_req.sender_instance = ((kvf_receiver_t *)r)->sender_instance;
    m.u.room_req.flags = KVF_REQ_WATCH;
    w->sent = kvf__peer_send_soon(w->peer, &m);
    if (w->sent)
        kvf__trace_peer_event(r, "watch_sent", w->peer, -1, -1, -1);
}

void kvf__siblings_send(kvf_room_t *r)
{
    KVF_ASSERT_LOCKED(r->eng);
    for (uint32_t i = 0; i < r->nwatch; i++) {
        kvf_watch_t *w = &r->watch[i];
        if (w->sent || w->peer == NULL)
            continue;
        send_watch(r, w);
        /* Failed before the watch could go: the watch binds the FAIL. */
        if (w->sent && room_state(r) == KVF_POLL_FAILED && r->failure != NULL)
            kvf__room_send_fail(r, w->peer, r->failure->status == KVF_ERR_ABORTED);
    }
}

/* ------------------------------------------------------------------------ */
/* Prefill: the decode ranks that watch a room                              */
/* ------------------------------------------------------------------------ */

/* The watch or byte link of room r held by decode rank (tp, pp), if any. */
static const kvf_peer_t *coord_holder(const kvf_room_t *r, int tp, int pp,
                                      uint64_t *instance_p)
{
    for (uint32_t i = 0; i < r->nlinks; i++)
        if (r->links[i].peer->tp_rank == tp && r->links[i].peer->pp_rank == pp) {
            *instance_p = r->links[i].tx.instance;
            return r->links[i].peer;
        }
    for (uint32_t i = 0; i < r->nwatch; i++)
        if (r->watch[i].peer->tp_rank == tp && r->watch[i].peer->pp_rank == pp) {
            *instance_p = r->watch[i].instance;
            return r->watch[i].peer;
        }
    return NULL;
}

/*
 * A watch binds a decode rank's coordinates (its TP rank and stage) to the
 * room like a destination binds its slot (sender.c): the first one for a
 * rank no byte link of the room holds binds it; another one for a bound
 * rank is refused, and a byte link that comes later for a watched rank
 * takes its place (kvf__siblings_evict).  So a token holder can fail a
 * room through a watch no more than through a destination: only by
 * racing a rank that has not told the room yet (docs/SECURITY.md).
 */
void kvf__siblings_take(kvf_room_t *r, kvf_peer_t *p, uint32_t rank, uint64_t instance)
{
    KVF_ASSERT_LOCKED(r->eng);
    const kvf_sender_t *s = (const kvf_sender_t *)r;
    uint64_t bound = 0;

    if (p->state == KVF_PEER_DEAD)
        return;
    /* A held room's readers come by descriptor, with no siblings. */
    if (s->held) {
        kvf__room_dropped(p, "ROOM_REQ (watch)", r->id, instance, "a held room takes no "
                          "watches");
        return;
    }
    const kvf_peer_t *holder = coord_holder(r, p->tp_rank, p->pp_rank, &bound);
    if (holder == p && bound == instance)
        return;                              /* told twice (a resumed connection) */
    if (room_state(r) == KVF_POLL_FAILED) {
        /* It failed before the watch came: the watcher learns why now. */
        kvf__send_fail(p, r->id, instance, r->failure, r->failure->status == KVF_ERR_ABORTED);
        return;
    }
    if (holder != NULL || (uint32_t)p->tp_rank != rank || r->nwatch == MAX_WATCHERS) {
        kvf_failure_t f;
        kvf__failure_set(&f, r->eng, KVF_ERR_ROOM_CONFLICT, "%s watched room %llu "
                         "(instance %016llx) on %s, %s: refused", kvf__peer_name(p,
                         (char[128]){0}, 128), (unsigned long long)r->id,
                         (unsigned long long)instance,
                         kvf__engine_rank_name_unlocked(r->eng, (char[96]){0}, 96),
                         holder != NULL ? "but that decode rank is bound to the room "
                                          "already: two live requests use one room id?"
                         : (uint32_t)p->tp_rank != rank ? "naming another decode rank "
                                                          "than its own"
                                                        : "past the watches it keeps");
        kvf__send_fail(p, r->id, instance, &f, 0);
        kvf__room_dropped(p, "ROOM_REQ (watch)", r->id, instance, f.reason);
        return;
    }
    kvf_watch_t *w = realloc(r->watch, (r->nwatch + 1) * sizeof(*w));
    if (w == NULL)
        return;
    r->watch = w;
    r->watch[r->nwatch++] = (kvf_watch_t){.peer = p, .rank = rank, .instance = instance,
                                          .sent = 1};
    p->refs++;
    kvf__trace_peer_event(r, "watch_received", p, -1, -1, -1);
}

void kvf__siblings_evict(kvf_room_t *r, const kvf_peer_t *p)
{
    KVF_ASSERT_LOCKED(r->eng);
    for (uint32_t i = 0; i < r->nwatch; i++) {
        kvf_watch_t *w = &r->watch[i];
        if (w->peer == p || w->peer->tp_rank != p->tp_rank || w->peer->pp_rank != p->pp_rank)
            continue;
        kvf__room_dropped(w->peer, "ROOM_REQ (watch)", r->id, w->instance, "the decode rank "
                          "it named sent the room its destination: the watch was not its");
        kvf__peer_put(w->peer);
        *w = r->watch[--r->nwatch];
        return;
    }
}

void kvf__siblings_on_watch(kvf_peer_t *p, kvf_room_t *r, const kvf_msg_room_req_t *m)
{
    KVF_ASSERT_LOCKED(p->eng);
    kvf_engine_t *eng = p->eng;

    if (r != NULL) {
        kvf__siblings_take(r, p, m->dst_rank, m->instance);
        return;
    }
    /* No sender: it failed and is gone (its tomb says why), or it is yet
     * to come (the watch waits in the stash, bounded, and expires quietly:
     * a sender that never comes fails the room through its byte links). */
    const kvf_failure_t *f = kvf_map_get(&eng->tombs, m->room);
    if (f != NULL)
        kvf__send_fail(p, m->room, m->instance, f, f->status == KVF_ERR_ABORTED);
    else if (!kvf__instance_retired(eng, m->instance))
        kvf__sender_stash_watch(p, m->room, m->dst_rank, m->instance);
}

/* ------------------------------------------------------------------------ */
/* Both sides                                                                */
/* ------------------------------------------------------------------------ */

void kvf__siblings_tell(kvf_room_t *r, const kvf_peer_t *from, int abort)
{
    KVF_ASSERT_LOCKED(r->eng);
    for (uint32_t i = 0; i < r->nwatch; i++) {
        kvf_watch_t *w = &r->watch[i];
        if (w->peer == from || w->peer == NULL)
            continue;
        /* The FAIL needs the watch first (a peer still connecting gets
         * both in order once it has authenticated). */
        if (r->side == KVF_ROLE_DECODE && !w->sent)
            send_watch(r, w);
        kvf__room_send_fail(r, w->peer, abort);
    }
}

/*
 * A decode rank that loses a prefill rank it watches, with the room still
 * live here, fails the room as it would for a byte link: it cannot know
 * whether that rank's share of the request was done, and its own byte
 * links may see nothing wrong (docs/FAILURES.md).  A reset is dialled
 * again first (RETRY_BASE_MS, doubling, MAX_RETRIES times), as a byte
 * link's is: a killed rank refuses the connection, a reset one answers.
 * This file says so and does not fail the room itself: the caller that
 * owns the room does, with the verdict (events one way: room.c and
 * receiver.c call down here, never the other way).  @return 1 when the
 * room must fail, with *v; 0 while the rank is dialled again.
 */
static int lost(kvf_room_t *r, kvf_watch_t *w, kvf_status_t st, const char *reason,
                kvf_verdict_t *v)
{
    if (st == KVF_ERR_CONN_RESET && w->retries < MAX_RETRIES) {
        w->retries++;
        w->retry_at_ms = kvf_now_ms() + (RETRY_BASE_MS << (w->retries - 1));
        if (r->last_err == NULL)
            r->last_err = strdup(reason);
        return 0;
    }
    if (w->retries > 0 && r->last_err != NULL)
        *v = kvf__verdict(st, "%s; gave up after %u reconnects, the last: %s", r->last_err,
                          w->retries, reason);
    else
        *v = kvf__verdict(st, "%s", reason);
    return 1;
}

int kvf__siblings_peer_lost(kvf_room_t *r, kvf_peer_t *p, kvf_status_t st, const char *reason,
                            kvf_verdict_t *v)
{
    KVF_ASSERT_LOCKED(r->eng);
    kvf_watch_t *w = watch_of(r, p);
    if (w == NULL)
        return 0;
    kvf__peer_put(p);
    w->peer = NULL;
    w->sent = 0;
    if (r->side == KVF_ROLE_PREFILL || room_final(r)) {
        *w = r->watch[--r->nwatch];         /* forgotten */
        return 0;
    }
    return lost(r, w, st, reason, v);
}

int kvf__siblings_tick(kvf_room_t *r, uint64_t now, kvf_verdict_t *v)
{
    KVF_ASSERT_LOCKED(r->eng);
    char name[128];
    for (uint32_t i = 0; i < r->nwatch && !room_final(r); i++) {
        kvf_watch_t *w = &r->watch[i];
        if (w->peer != NULL || w->retry_at_ms == 0 || now < w->retry_at_ms)
            continue;
        w->retry_at_ms = 0;
        kvf_peer_t *p = kvf__peer_get(r->eng, w->host, w->port, (int)w->rank, 1);
        if (p == NULL || p->state == KVF_PEER_DEAD) {
            snprintf(name, sizeof(name), "cannot reach prefill rank %u at %s:%d", w->rank,
                     w->host, w->port);
            /* Not a reset: not dialled again, the room fails (lost()). */
            return lost(r, w, KVF_ERR_UNREACHABLE, p == NULL ? "no memory to reconnect" : name,
                        v);
        }
        p->refs++;
        w->peer = p;
        kvf__siblings_send(r);          /* at once if it was ready, else on ready */
    }
    return 0;
}
