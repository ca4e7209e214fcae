/*
 * What a prefill engine keeps for rooms without a sender: destinations
 * and failures that came before their sender (the stash, bounded
 * engine-wide and expired at the bootstrap deadline, when a reader still
 * waiting is told), and the records of destroyed failed senders (the
 * tombs), so that a decode rank that asks late learns at once why its
 * room is gone.  Everything here runs under the engine lock.
 */
#include <stdlib.h>
#include <string.h>

#include "core/room.h"
#include "core/sync.h"
#include "util/log.h"
#include "util/time.h"

/* Out of the engine's FIFO (no-op if it is not in it). */
static void stash_unqueue(kvf_engine_t *eng, kvf_stash_t *s)
{
    if (!s->queued)
        return;
    if (s->older)
        s->older->newer = s->newer;
    else
        eng->stash_oldest = s->newer;
    if (s->newer)
        s->newer->older = s->older;
    else
        eng->stash_newest = s->older;
    s->older = s->newer = NULL;
    s->queued = 0;
    eng->stash_count--;
    eng->stash_bytes -= s->bytes;
}

void kvf__stash_free(kvf_stash_t *s)
{
    while (s != NULL) {
        KVF_ASSERT_LOCKED(s->peer->eng);
        kvf_stash_t *n = s->next;
        stash_unqueue(s->peer->eng, s);
        free(s->link.tx.pages);
        kvf__states_free(&s->link.tx.state);
        free(s->failure);
        kvf__peer_put(s->peer);
        free(s);
        s = n;
    }
}

/* Take one entry out of its room's chain and free it. */
static void stash_forget(kvf_engine_t *eng, kvf_stash_t *o)
{
    kvf_stash_t *head = kvf_map_get(&eng->stash, o->room);
    if (head == o) {
        if (o->next != NULL)
            kvf_map_put(&eng->stash, o->room, o->next);   /* replaces: no memory */
        else
            kvf_map_del(&eng->stash, o->room);
    } else {
        for (kvf_stash_t *c = head; c != NULL; c = c->next)
            if (c->next == o) {
                c->next = o->next;
                break;
            }
    }
    o->next = NULL;
    kvf__stash_free(o);
}

/* Drop the oldest entry to make room: counted, logged at most once per
 * KVF_DROP_LOG_MS. */
static void stash_drop_oldest(kvf_engine_t *eng)
{
    kvf_stash_t *o = eng->stash_oldest;
    uint64_t now = kvf_now_ms();
    eng->stash_dropped++;
    if (eng->stash_log_ms != 0 && now - eng->stash_log_ms < KVF_DROP_LOG_MS) {
        eng->stash_unlogged++;
    } else {
        char name[128];
        kvf_warn("prefill rank %d: more messages wait for rooms that have no sender yet "
                 "than it keeps (%d messages, %u MiB): dropped the oldest, for room %llu "
                 "from %s (%llu more dropped since the last such line); is a decode "
                 "engine asking for rooms this prefill never creates?",
                 eng->params.tp_rank, KVF_STASH_MAX, KVF_STASH_BYTES >> 20,
                 (unsigned long long)o->room, kvf__peer_name(o->peer, name, sizeof(name)),
                 (unsigned long long)eng->stash_unlogged);
        eng->stash_log_ms = now;
        eng->stash_unlogged = 0;
    }
    stash_forget(eng, o);
}

void kvf__stash_expire(kvf_engine_t *eng, uint64_t now)
{
    KVF_ASSERT_LOCKED(eng);
    while (eng->stash_oldest != NULL &&
           kvf_elapsed_ms(now, eng->stash_oldest->t_ms) >= eng->params.bootstrap_timeout_ms) {
        kvf_stash_t *o = eng->stash_oldest;
        kvf_debug("dropping a stale destination for room %llu", (unsigned long long)o->room);
        if (o->link.tx.pages != NULL && o->peer->state != KVF_PEER_DEAD) {
            /* Its reader would wait out its own deadline: tell it now. */
            kvf_failure_t f;
            kvf__failure_set(&f, eng, KVF_ERR_TIMED_OUT, "%s had no sender for "
                             "room %llu %.1f s after this decode rank asked for it (the "
                             "bootstrap deadline): the prefill side never created it, or "
                             "it had ended before",
                             kvf__engine_rank_name_unlocked(eng, (char[96]){0}, 96),
                             (unsigned long long)o->room,
                             eng->params.bootstrap_timeout_ms / 1000.0);
            kvf__send_fail(o->peer, o->room, o->instance, &f, 0);
        }
        stash_forget(eng, o);
    }
}

/* Take the chain kept for `room`, oldest first, out of the stash and its
 * FIFO: what the caller stashes again meanwhile may make the bound drop
 * the oldest entries, never one of these. */
kvf_stash_t *kvf__stash_take(kvf_engine_t *eng, uint64_t room)
{
    KVF_ASSERT_LOCKED(eng);
    kvf_stash_t *s = kvf_map_del(&eng->stash, room), *old = NULL;
    while (s != NULL) {          /* the chain is newest first */
        kvf_stash_t *n = s->next;
        stash_unqueue(eng, s);
        s->next = old;
        old = s;
        s = n;
    }
    return old;
}

/*
 * Tombstones: the failure records of destroyed failed senders, the last
 * KVF_TOMBS of them, so that a decode rank that comes back late (it was
 * stopped, its connection broke) learns at once why its room is gone
 * instead of waiting for a deadline.
 */
void kvf__sender_bury(kvf_room_t *r)
{
    KVF_ASSERT_LOCKED(r->eng);
    kvf_engine_t *eng = r->eng;
    kvf_tomb_t *f = r->failure ? malloc(sizeof(*f) + r->nlinks * sizeof(uint32_t)) : NULL;
    if (f == NULL)
        return;
    f->f = *r->failure;
    f->seq = ++eng->tomb_seq;
    f->nranks = r->nlinks;
    for (uint32_t i = 0; i < r->nlinks; i++)
        f->ranks[i] = r->links[i].rank;
    if (eng->ntombs == KVF_TOMBS) {       /* forget the oldest burial */
        const struct kvf_tomb_slot *old = &eng->tomb_ring[eng->tomb_head];
        const kvf_tomb_t *t = kvf_map_get(&eng->tombs, old->room);
        if (t != NULL && t->seq == old->seq)
            free(kvf_map_del(&eng->tombs, old->room));
        eng->tomb_head = (eng->tomb_head + 1) % KVF_TOMBS;
        eng->ntombs--;
    }
    free(kvf_map_del(&eng->tombs, r->id));   /* an id reused and failed again */
    if (kvf_map_put(&eng->tombs, r->id, f) != KVF_OK) {
        free(f);
        return;
    }
    eng->tomb_ring[(eng->tomb_head + eng->ntombs) % KVF_TOMBS] =
        (struct kvf_tomb_slot){r->id, f->seq};
    eng->ntombs++;
}

void kvf__sender_answer_gone(kvf_peer_t *p, uint64_t room, uint64_t instance)
{
    KVF_ASSERT_LOCKED(p->eng);
    kvf_engine_t *eng = p->eng;
    const kvf_failure_t *f = kvf_map_get(&eng->tombs, room);
    kvf_failure_t gone;
    if (f == NULL) {
        kvf__failure_set(&gone, eng, KVF_ERR_ABORTED, "room %llu is not live on %s any "
                         "more: its sender was destroyed before the transfer was "
                         "confirmed", (unsigned long long)room,
                         kvf__engine_rank_name_unlocked(eng, (char[96]){0}, 96));
        f = &gone;
    }
    kvf__send_fail(p, room, instance, f, f->status == KVF_ERR_ABORTED);
}

void kvf__sender_stash_watch(kvf_peer_t *p, uint64_t room, uint32_t rank, uint64_t instance)
{
    KVF_ASSERT_LOCKED(p->eng);
    kvf_link_t lk = {.rank = rank, .tx.instance = instance};
    kvf_stash_t *s = kvf__sender_stash_add(p, room, instance, &lk, 0, NULL, 0);
    if (s != NULL)
        s->watch = 1;
}

/* Prefill: a ROOM_REQ or a FAIL for a room that has no sender yet. */
kvf_stash_t *kvf__sender_stash_add(kvf_peer_t *p, uint64_t room, uint64_t instance,
                                   kvf_link_t *lk, uint32_t expected, kvf_failure_t *f,
                                   uint64_t key)
{
    KVF_ASSERT_LOCKED(p->eng);
    kvf_engine_t *eng = p->eng;
    kvf_stash_t *s = calloc(1, sizeof(*s));
    if (s == NULL) {
        free(f);
        return NULL;
    }
    s->peer = p;
    p->refs++;
    s->t_ms = kvf_now_ms();
    if (lk) {
        s->link = *lk;
        memset(lk, 0, sizeof(*lk));
    }
    s->expected = expected;
    s->failure = f;
    s->instance = instance;
    s->key = key;
    s->room = room;
    s->bytes = sizeof(*s) + (size_t)s->link.tx.n_pages * sizeof(uint32_t) +
               ((size_t)s->link.tx.state.ngroups + s->link.tx.state.total) * sizeof(uint32_t) +
               (f ? sizeof(*f) : 0);
    /* Bounded engine-wide: whoever sends messages for rooms that never
     * come must not grow this process (docs/SECURITY.md). */
    while (eng->stash_oldest != NULL && (eng->stash_count >= KVF_STASH_MAX ||
                                         eng->stash_bytes + s->bytes > KVF_STASH_BYTES))
        stash_drop_oldest(eng);
    kvf_stash_t *older = kvf_map_get(&eng->stash, room);
    if (s->bytes > KVF_STASH_BYTES || kvf_map_put(&eng->stash, room, s) != KVF_OK) {
        eng->stash_dropped++;
        kvf__stash_free(s);
        return NULL;
    }
    s->next = older;
    s->queued = 1;
    s->older = eng->stash_newest;
    if (eng->stash_newest)
        eng->stash_newest->newer = s;
    else
        eng->stash_oldest = s;
    eng->stash_newest = s;
    eng->stash_count++;
    eng->stash_bytes += s->bytes;
    return s;
}
