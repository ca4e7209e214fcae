/*
 * Rooms: the state machine of one request's transfer, on both sides.
 *
 * A room's poll state only moves up (BOOTSTRAPPING < WAITING_FOR_INPUT <
 * TRANSFERRING < SUCCESS) and FAILED overrides everything; once SUCCESS or
 * FAILED it never changes again, which is what makes "the first root cause
 * wins" hold: a later consequence finds the room final and is dropped.
 *
 * This file: what both sides share (lifetime, failing a room and telling
 * its peers, message dispatch, peers going away, deadlines).  The failure
 * records themselves, and sending one to a peer, are failure.c's; a
 * room's state indices are states.c's.  The sides themselves are in
 * sender.c and receiver.c; this file reaches what differs between them
 * only through the room's table of side ops (r->ops, or the engine's for a
 * message whose room it does not have: room.h, kvf_room_ops_t), never by
 * asking which side a room is.
 */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>

#include <openssl/crypto.h>
#include <openssl/evp.h>

#include "core/room.h"
#include "core/sized.h"
#include "core/trace.h"
#include "util/log.h"
#include "util/time.h"

/* ------------------------------------------------------------------------ */
/* Lifetime                                                                  */
/* ------------------------------------------------------------------------ */

static void link_free(kvf_link_t *l)
{
    if (l->peer)
        kvf__peer_put(l->peer);
    free(l->tx.pages);
    kvf__states_free(&l->tx.state);
    free(l->rx.cover);
    for (unsigned k = 0; k < KVF_MAX_STREAMS; k++)
        if (l->hash[k])
            XXH3_freeState(l->hash[k]);
}

void kvf__link_streams_reset(kvf_room_t *r, kvf_link_t *lk, uint32_t n, int hash)
{
    KVF_ASSERT_LOCKED(r->eng);
    atomic_store_explicit(&r->bytes,            /* out of the room's sum (kvf__link_count) */
                          atomic_load_explicit(&r->bytes, memory_order_relaxed) - lk->bytes,
                          memory_order_relaxed);
    lk->nstreams = n;
    lk->ends = 0;
    lk->bytes = 0;
    for (uint32_t k = 0; k < KVF_MAX_STREAMS; k++) {
        lk->stream_bytes[k] = 0;
        if (k < n && hash && lk->hash[k] == NULL)
            lk->hash[k] = XXH3_createState();
        if (lk->hash[k] != NULL && (k >= n || !hash)) {
            XXH3_freeState(lk->hash[k]);
            lk->hash[k] = NULL;
        }
        if (lk->hash[k] != NULL)
            XXH3_64bits_reset(lk->hash[k]);
    }
}

void kvf__room_put(kvf_room_t *r)
{
    KVF_ASSERT_LOCKED(r->eng);
    if (--r->refs > 0)
        return;
    for (uint32_t i = 0; i < r->nlinks; i++)
        link_free(&r->links[i]);
    free(r->links);
    kvf__siblings_free(r);
    free(r->failure);
    r->ops->free(r);
    free(r->last_err);
    pthread_mutex_destroy(&r->app_lock);
    pthread_mutex_destroy(&r->final_lock);
    free(r);
}

/* Room r turned final: f NULL for SUCCESS; `reversed` after a SUCCESS. */
static void stats_final(kvf_room_t *r, const kvf_failure_t *f, int reversed)
{
    kvf_engine_t *eng = r->eng;
    /* Release: kvf__room_metric, seeing it, sees every byte counted. */
    atomic_store_explicit(&r->t_final_ns, kvf_now_ns(), memory_order_release);
    kvf__metrics_room_final(r, f, reversed);
    if (f == NULL) {
        eng->stats.rooms_succeeded++;
        return;
    }
    eng->stats.rooms_failed++;
    if (f->status <= -40)
        eng->stats.failures_peer++;
    else if (f->status <= -20)
        eng->stats.failures_room++;
    else
        eng->stats.failures_other++;
}

void kvf__room_set_state(kvf_room_t *r, kvf_poll_t s)
{
    KVF_ASSERT_LOCKED(r->eng);
    /* Under final_lock: the application's abort may turn it FAILED meanwhile. */
    pthread_mutex_lock(&r->final_lock);
    kvf_poll_t cur = room_state(r);
    int moves = !(cur == KVF_POLL_FAILED || cur == KVF_POLL_SUCCESS || s <= cur);
    /* Release: a poller that sees SUCCESS also sees the bytes in place. */
    if (moves)
        atomic_store_explicit(&r->state, (int)s, memory_order_release);
    pthread_mutex_unlock(&r->final_lock);
    if (!moves)
        return;
    r->t_state_ms = kvf_now_ms();
    if (s == KVF_POLL_SUCCESS)
        stats_final(r, NULL, 0);
    kvf__trace_state(r, s);
}

/* ------------------------------------------------------------------------ */
/* Failure                                                                   */
/* ------------------------------------------------------------------------ */

/*
 * Tell every peer of the room its record: byte links, siblings.  Not
 * `from`, which told it, unless this rank knows of a failed side that
 * from's FAIL (`told`) did not name, its own once it failed: then from
 * must hear it, as it may be the one way to the ranks of this side that
 * have not (prefill TP 2 into decode TP 1: the decode rank is the one
 * link between the prefill ranks).  Knowledge of sides only grows, so
 * this ends.
 */
static void tell_peers(kvf_room_t *r, const kvf_peer_t *from, int abort, uint8_t told)
{
    const kvf_peer_t *skip = r->failed_sides & (uint8_t)~told ? NULL : from;
    for (uint32_t i = 0; i < r->nlinks; i++) {
        kvf_link_t *lk = &r->links[i];
        if (lk->peer != skip)
            lk->fail_told |= kvf__room_send_fail(r, lk->peer, abort);
        else
            lk->fail_told = 1;            /* it told us */
    }
    kvf__siblings_tell(r, skip, abort);
}

/* Turn r FAILED from `was`, with f as its record unless it keeps one (f
 * is then freed; NULL: it keeps one): 1, or 0, f untouched, when r is no
 * longer `was` (the application's abort turned it FAILED meanwhile). */
static int room_turn_failed(kvf_room_t *r, kvf_poll_t was, kvf_failure_t *f)
{
    pthread_mutex_lock(&r->final_lock);
    int turns = room_state(r) == was;
    if (turns) {
        if (r->failure == NULL)
            r->failure = f;
        else
            free(f);              /* the cause it kept while it succeeded */
        /* Release: whoever sees FAILED sees the record. */
        atomic_store_explicit(&r->state, KVF_POLL_FAILED, memory_order_release);
    }
    pthread_mutex_unlock(&r->final_lock);
    return turns;
}

/* The room turned FAILED here from `was` with the record it holds
 * (r->failure): counted, traced, and its peers told (tell_peers: `from`
 * told it, with `told`). */
static void room_failed(kvf_room_t *r, kvf_poll_t was, kvf_peer_t *from, int abort,
                        uint8_t told, const char *how)
{
    const kvf_failure_t *f = r->failure;
    r->failed_sides |= KVF_SIDE_BIT(r->side);
    r->t_state_ms = kvf_now_ms();
    if (was == KVF_POLL_SUCCESS)
        r->eng->stats.rooms_succeeded--;
    stats_final(r, f, was == KVF_POLL_SUCCESS);
    kvf__trace_failed(r, f, from, was == KVF_POLL_SUCCESS);
    kvf_info("room %llu failed on %s%s%s: %s", (unsigned long long)r->id,
             kvf__engine_rank_name_unlocked(r->eng, (char[96]){0}, 96),
             f->from_another_rank ? " (from another rank)" : "", how, f->reason);
    tell_peers(r, from, abort, told);
    pthread_cond_broadcast(&r->eng->final_cond);
    kvf__engine_wake(r->eng);
}

/*
 * Record `f` as the room's root cause and tell every peer but `from`.
 * The first cause wins: a room that failed takes no other record.  A room
 * that succeeded here takes one learned from another rank (its siblings
 * are one request: if the request failed on one of them it failed as a
 * whole, and this rank must say so too, with the cause), never one seen
 * here (a local consequence of a finished room is no cause).
 */
void kvf__room_fail_record(kvf_room_t *r, kvf_failure_t *f, kvf_peer_t *from,
                             int abort, uint8_t sides)
{
    KVF_ASSERT_LOCKED(r->eng);
    uint8_t mine = KVF_SIDE_BIT(r->side);
    kvf__room_take_app_failure(r);      /* the application's came first */
    kvf_poll_t was = room_state(r);
    if (was == KVF_POLL_SUCCESS && !f->from_another_rank) {
        free(f);                  /* a consequence here of a finished room */
        return;
    }
    /* What the room's ranks now know of where it failed (siblings.c). */
    sides |= KVF_SIDE_BIT(f->origin_side) | (f->from_another_rank ? 0 : mine);
    uint8_t news = sides & (uint8_t)~r->failed_sides;
    r->failed_sides |= sides;
    if (was == KVF_POLL_FAILED || (was == KVF_POLL_SUCCESS && !(r->failed_sides & mine))) {
        /* Final here: the record stays the first one.  What is new to it
         * about the sides goes on, once per side, so that a rank that
         * succeeded learns when its own side failed elsewhere. */
        if (r->failure == NULL)
            r->failure = f;
        else
            free(f);
        if (news)
            tell_peers(r, from, abort, sides);
        return;
    }
    /* The other side, when this rank's failure fails it too: its FAILs
     * say so at once, so that a rank of that side whose own room had
     * succeeded takes the failure from the first FAIL it hears, not from
     * a relay that a scheduler's clear() of a sibling's room may cut. */
    r->failed_sides |= mine | r->ops->doomed_side(r);
    if (!room_turn_failed(r, was, f)) {
        /* The application's abort or fail came between: the first cause. */
        free(f);
        kvf__room_take_app_failure(r);
        return;
    }
    room_failed(r, was, from, abort, sides,
                was == KVF_POLL_SUCCESS ? " after it had succeeded here" : "");
}

/* Fail a live room with a root cause seen here, telling every peer but
 * `from`; a copy of the record goes to *out.  `sides`: besides this one,
 * the sides known to have failed (a lost peer's).  @return 1 when
 * recorded. */
static int room_vfail(kvf_room_t *r, kvf_peer_t *from, kvf_room_failed_t *out,
                      kvf_status_t st, uint8_t sides, const char *fmt, va_list ap)
{
    if (room_final(r))
        return 0;
    kvf_failure_t *f = malloc(sizeof(*f));
    if (f == NULL)
        return 0;
    kvf__failure_vset_unlocked(f, r->eng, st, fmt, ap);
    kvf__room_fail_record(r, f, from, st == KVF_ERR_ABORTED, sides);
    if (out != NULL) {           /* f, or the application's abort, first */
        out->room = r->id;
        out->instance = r->ops->instance_for(r, from);
        out->key = r->ops->fail_key(r);
        out->failure = *r->failure;
    }
    return 1;
}

void kvf__room_fail(kvf_room_t *r, kvf_status_t st, const char *fmt, ...)
{
    KVF_ASSERT_LOCKED(r->eng);
    va_list ap;
    va_start(ap, fmt);
    room_vfail(r, NULL, NULL, st, 0, fmt, ap);
    va_end(ap);
}

void kvf__room_fail_lost(kvf_room_t *r, kvf_role_t lost, kvf_status_t st, const char *fmt,
                         ...)
{
    KVF_ASSERT_LOCKED(r->eng);
    va_list ap;
    va_start(ap, fmt);
    room_vfail(r, NULL, NULL, st, KVF_SIDE_BIT(lost), fmt, ap);
    va_end(ap);
}

void kvf__room_fail_remote(kvf_room_t *r, kvf_peer_t *from, int abort,
                           const kvf_msg_fail_t *m)
{
    KVF_ASSERT_LOCKED(r->eng);
    kvf_failure_t *f = kvf__room_remote_failure(m);
    if (f != NULL)
        kvf__room_fail_record(r, f, from, abort, m->sides);
}

kvf_status_t kvf__room_consume_failure(kvf_room_t *r, kvf_failure_t *out, const char *fn)
{
    kvf_status_t st;
    char err[256] = "";

    if (out == NULL)
        return KVF_ERR_INVALID_PARAM;
    /* Without the engine lock: a room's record is set before it turns
     * FAILED (room_failed, whose store releases it) and never changes
     * after; only the room's free, which the application's destroy starts,
     * lets it go.  `failure_consumed` is the application's alone. */
    pthread_mutex_lock(&r->app_lock);
    if (room_state(r) != KVF_POLL_FAILED)
        st = KVF_ERR_AGAIN;
    else if (r->failure_consumed || r->failure == NULL)
        st = KVF_ERR_NOT_FOUND;
    else {
        /* A size refused leaves the record unconsumed: the caller may
         * retry with a struct that is right. */
        st = kvf__failure_export(out, r->failure, fn, err, sizeof(err));
        if (st == KVF_OK)
            r->failure_consumed = 1;
    }
    pthread_mutex_unlock(&r->app_lock);
    if (st == KVF_ERR_INVALID_PARAM)
        kvf_error("%s", err);
    return st;
}

/* ------------------------------------------------------------------------ */
/* Creation and destruction (both sides)                                     */
/* ------------------------------------------------------------------------ */

const char *kvf__room_ops_missing(const kvf_room_ops_t *o)
{
    /* Called by room.c, peer.c and resolver.c without a NULL test (room.h
     * says which may be NULL: init, destroyed, peer_ready, read_take). */
    const struct { const char *name; int set; } need[] = {
        {"on_msg", o->on_msg != NULL},           {"free", o->free != NULL},
        {"instance_for", o->instance_for != NULL}, {"fail_key", o->fail_key != NULL},
        {"doomed_side", o->doomed_side != NULL}, {"retry_at", o->retry_at != NULL},
        {"tick", o->tick != NULL},               {"deadline_detail", o->deadline_detail != NULL},
        {"take", o->take != NULL},
    };
    /* The decode ops: called only for a prefill peer, so on a decode engine. */
    const struct { const char *name; int set; } decode[] = {
        {"on_data", o->on_data != NULL},         {"on_data_end", o->on_data_end != NULL},
        {"on_data_ref", o->on_data_ref != NULL}, {"release_rx", o->release_rx != NULL},
        {"resolved", o->resolved != NULL},
    };
    if (o->size < sizeof(kvf_room_t))
        return "size";
    for (size_t i = 0; i < sizeof(need) / sizeof(need[0]); i++)
        if (!need[i].set)
            return need[i].name;
    for (size_t i = 0; o->side == KVF_ROLE_DECODE && i < sizeof(decode) / sizeof(decode[0]); i++)
        if (!decode[i].set)
            return decode[i].name;
    return NULL;
}

kvf_status_t kvf__room_create(kvf_engine_t *eng, const kvf_room_ops_t *ops, uint64_t id,
                              kvf_room_t **room_p)
{
    kvf_role_t side = ops->side;

    if (!atomic_load(&eng->registered)) {
        kvf_error("room %llu: register the engine's layout first "
                  "(kvf_engine_register_layout)", (unsigned long long)id);
        return KVF_ERR_STATE;
    }
    if (eng->params.role != side) {
        kvf_error("room %llu: a %s engine cannot create a %s", (unsigned long long)id,
                  kvf_role_name(eng->params.role),
                  side == KVF_ROLE_PREFILL ? "sender" : "receiver");
        return KVF_ERR_STATE;
    }
    kvf_room_t *r = calloc(1, ops->size);
    if (r == NULL)
        return KVF_ERR_NO_MEMORY;
    r->eng = eng;
    r->id = id;
    r->side = side;
    r->ops = ops;
    r->refs = 1;
    r->attached = 1;
    pthread_mutex_init(&r->app_lock, NULL);
    pthread_mutex_init(&r->final_lock, NULL);
    r->t_create_ns = kvf_now_ns();
    r->t_state_ms = r->t_create_ms = r->t_create_ns / 1000000u;
    atomic_init(&r->state, KVF_POLL_BOOTSTRAPPING);
    if (ops->init != NULL)
        ops->init(r);

    /* A room the application destroyed but no lane took out yet gives its
     * id up: it is final, and leaves the map only if still there. */
    pthread_mutex_lock(&eng->ids_lock);
    kvf_room_t *old = kvf_map_get(&eng->rooms_by_id, id);
    kvf_status_t st = old != NULL && !room_closing(old) ? KVF_ERR_ROOM_IN_USE
                      : kvf_map_put(&eng->rooms_by_id, id, r);
    pthread_mutex_unlock(&eng->ids_lock);
    if (st != KVF_OK) {
        if (st == KVF_ERR_ROOM_IN_USE)
            kvf_error("room %llu is already live on this engine; destroy it before "
                      "reusing the id", (unsigned long long)id);
        ops->free(r);
        pthread_mutex_destroy(&r->app_lock);
        pthread_mutex_destroy(&r->final_lock);
        free(r);
        return st;
    }
    *room_p = r;
    return KVF_OK;
}

/*
 * A receiver's instance is the engine's n-th draw enciphered: AES-128 of
 * n under a random key taken at engine start, the first 64 bits.  As
 * unpredictable as getrandom() per room was (a token holder that saw one
 * instance cannot tell the next, docs/SECURITY.md), at 0.02 us instead of
 * 0.3 us, three quarters of a receiver's create.  Should the cipher be
 * unavailable, getrandom() per draw as before.
 */
void kvf__room_instances_setup(kvf_engine_t *eng)
{
    unsigned char key[16];
    EVP_CIPHER_CTX *c = EVP_CIPHER_CTX_new();
    if (c != NULL && getrandom(key, sizeof(key), 0) == (ssize_t)sizeof(key) &&
        EVP_EncryptInit_ex(c, EVP_aes_128_ecb(), NULL, key, NULL) == 1 &&
        EVP_CIPHER_CTX_set_padding(c, 0) == 1) {
        eng->inst_cipher = c;
        c = NULL;
    } else {
        kvf_warn("room instances: no AES-128 from libcrypto; getrandom() per room");
    }
    EVP_CIPHER_CTX_free(c);
    OPENSSL_cleanse(key, sizeof(key));
}

uint64_t kvf__room_new_instance(kvf_engine_t *eng)
{
    uint64_t x = 0;
    while (x == 0) {
        uint64_t block[2] = {0, 0}, out[2] = {0, 0};
        int len = 0, ok = 0;
        pthread_mutex_lock(&eng->inst_lock);
        if (eng->inst_cipher != NULL) {
            block[0] = eng->instances_drawn++;
            ok = EVP_EncryptUpdate(eng->inst_cipher, (unsigned char *)out, &len,
                                   (const unsigned char *)block, sizeof(block)) == 1 &&
                 len == (int)sizeof(block);
        }
        pthread_mutex_unlock(&eng->inst_lock);
        if (ok)
            x = out[0];
        else if (getrandom(&x, sizeof(x), 0) != (ssize_t)sizeof(x))
            x = kvf_now_ns() ^ ((uint64_t)(uintptr_t)&x << 16);
    }
    return x;
}

void kvf__room_list(kvf_room_t *r)
{
    kvf_engine_t *eng = r->eng;
    KVF_ASSERT_LOCKED(eng);
    r->listed = 1;
    r->next = eng->rooms;
    if (eng->rooms)
        eng->rooms->prev = r;
    eng->rooms = r;
    kvf__trace_event(r, "created");
    if (r->ops->open != NULL)
        r->ops->open(r);
}

/* The room leaves the engine: out of the id map (unless its id is another
 * room's already) and off the list.  Once. */
static void room_close(kvf_room_t *r)
{
    kvf_engine_t *eng = r->eng;
    KVF_ASSERT_LOCKED(eng);
    if (!r->attached)
        return;
    pthread_mutex_lock(&eng->ids_lock);
    if (kvf_map_get(&eng->rooms_by_id, r->id) == r)
        kvf_map_del(&eng->rooms_by_id, r->id);
    pthread_mutex_unlock(&eng->ids_lock);
    if (r->listed) {
        if (r->ops->destroyed != NULL)
            r->ops->destroyed(r);
        if (r->prev)
            r->prev->next = r->next;
        else
            eng->rooms = r->next;
        if (r->next)
            r->next->prev = r->prev;
    }
    /* From here on no inbound byte is placed into this room's pages:
     * rx_valid() checks `attached` before every placement. */
    r->attached = 0;
    kvf__trace_event(r, "destroyed");
}

kvf_room_t *kvf__room_find(kvf_engine_t *eng, uint64_t id)
{
    KVF_ASSERT_LOCKED(eng);
    pthread_mutex_lock(&eng->ids_lock);
    kvf_room_t *r = kvf_map_get(&eng->rooms_by_id, id);
    pthread_mutex_unlock(&eng->ids_lock);
    if (r != NULL && room_closing(r)) {
        room_close(r);     /* as if a lane had taken it out already */
        return NULL;
    }
    return r != NULL && r->listed ? r : NULL;
}

/*
 * A receiver destroyed while mover reads into its pages are in flight (one
 * destroyed before it was final, or before poll showed it so) waits for
 * them: the pages are the caller's again when destroy returns.  A read
 * ends within its deadline (the heartbeat timeout) whatever the peer does;
 * past that plus a margin something is wrong here, and we say so rather
 * than hang.
 */
static void wait_reads(kvf_room_t *r)
{
    kvf_engine_t *eng = r->eng;
    if (atomic_load_explicit(&r->reads, memory_order_acquire) == 0)
        return;
    kvf__engine_wake(eng);
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_sec += eng->params.heartbeat_timeout_ms / 1000 + 3;
    while (atomic_load_explicit(&r->reads, memory_order_acquire) != 0)
        if (kvf__cond_timedwait(eng, &eng->reads_cond, &until) == ETIMEDOUT) {
            kvf_error("room %llu destroyed with %u reads into its pages still in flight "
                      "past their deadline", (unsigned long long)r->id,
                      atomic_load(&r->reads));
            return;
        }
}

/* Put r on eng->submitted, marked with `flags`, unless it is there;
 * @return 1 if it was not (this call pushed it). */
static int push_submitted(kvf_room_t *r, int flags)
{
    kvf_engine_t *eng = r->eng;
    if (atomic_fetch_or(&r->submit, ROOM_SUBMITTED | flags) & ROOM_SUBMITTED)
        return 0;        /* listed, not taken yet: the taker reads all of it */
    kvf_room_t *head = atomic_load_explicit(&eng->submitted, memory_order_relaxed);
    do
        r->submit_next = head;
    while (!atomic_compare_exchange_weak(&eng->submitted, &head, r));
    return 1;
}

void kvf__room_submit(kvf_room_t *r)
{
    kvf_engine_t *eng = r->eng;      /* r may be freed once pushed */
    if (push_submitted(r, 0))
        kvf__engine_wake_idle(eng);
}

void kvf__rooms_take_submitted(kvf_engine_t *eng)
{
    KVF_ASSERT_LOCKED(eng);
    kvf_room_t *r = atomic_exchange(&eng->submitted, NULL);
    while (r != NULL) {
        kvf_room_t *next = r->submit_next;
        /* Unlisted before its work is read: what is published from here
         * on lists it again, and is taken in then if not now.  A room not
         * closing yet may be destroyed (and pushed again, closing) as soon
         * as this clears ROOM_SUBMITTED; one closing already is this
         * lane's alone. */
        if (atomic_fetch_and(&r->submit, ~ROOM_SUBMITTED) & ROOM_CLOSING) {
            room_close(r);
            kvf__room_put(r);
        } else {
            if (!r->listed)
                kvf__room_list(r);
            r->ops->take(r);
            kvf__room_take_app_failure(r);
        }
        r = next;
    }
}

void kvf__room_lock(kvf_room_t *r)
{
    kvf__lock(r->eng);
    if (!r->listed)
        kvf__rooms_take_submitted(r->eng);
}

void kvf__room_destroy(kvf_room_t *r)
{
    kvf_engine_t *eng = r->eng;
    /* Settled, with no I/O on its pages: none can start (every placement
     * and read checks that its room is not final, under the lock, and
     * counts itself in `reads` before letting the lock go; and a lane
     * took in, under the lock, the turn to final that an abort of the
     * application's makes without it), so the pages are the caller's now.
     * The lanes take the room out at their next pass, or when a message
     * names it; nothing to wake them for. */
    if (room_settled(r) && atomic_load_explicit(&r->reads, memory_order_acquire) == 0) {
        push_submitted(r, ROOM_CLOSING);     /* r is the lanes' from here */
        return;
    }
    kvf__lock(eng);
    /* The room is freed below: it may not stay on the list (and is on
     * the engine's, taken in, from here). */
    kvf__rooms_take_submitted(eng);
    if (!room_final(r))
        kvf__room_fail(r, KVF_ERR_ABORTED, "room %llu destroyed by the application "
                       "on %s before it finished", (unsigned long long)r->id,
                       kvf__engine_rank_name_unlocked(eng, (char[96]){0}, 96));
    room_close(r);
    wait_reads(r);
    kvf__room_put(r);
    kvf__unlock(eng);
}

/*
 * The application fails live room r with its own record (abort, fail),
 * without the engine lock: FAILED at once, under final_lock, so that a
 * lane's turn of it (to SUCCESS, or FAILED with a cause of its own) and
 * this one do not both happen.  The rest of the failure (telling the
 * peers...) is the lanes', at their next pass: the room is listed for them
 * with its state before (app_failed), which a receiver's poll still shows
 * until then, as a lane may be placing bytes it checked live before.
 * The record is the engine's abort record (no formatting on the caller's
 * thread), with st and `reason` in place of its own unless reason is NULL.
 */
static void room_fail_app(kvf_room_t *r, kvf_status_t st, const char *reason)
{
    kvf_failure_t *f = malloc(sizeof(*f));
    if (f == NULL) {
        kvf_error("room %llu: no memory to fail it", (unsigned long long)r->id);
        return;
    }
    *f = r->eng->app_abort;
    if (reason != NULL) {
        f->status = st;
        size_t n = strnlen(reason, sizeof(f->reason) - 1);
        memcpy(f->reason, reason, n);
        f->reason[n] = '\0';
    }
    pthread_mutex_lock(&r->final_lock);
    kvf_poll_t was = room_state(r);
    int turns = was != KVF_POLL_FAILED && was != KVF_POLL_SUCCESS;
    if (turns) {
        r->failure = f;            /* none yet: a live room has no record */
        atomic_store(&r->app_failed, (int)was + 1);
        atomic_store_explicit(&r->state, KVF_POLL_FAILED, memory_order_release);
    }
    pthread_mutex_unlock(&r->final_lock);
    if (turns)
        kvf__room_submit(r);
    else
        free(f);
}

void kvf__room_take_app_failure(kvf_room_t *r)
{
    KVF_ASSERT_LOCKED(r->eng);
    /* A load first: every room a lane takes in comes here, few aborted. */
    int was = atomic_load_explicit(&r->app_failed, memory_order_relaxed) != 0
              ? atomic_exchange(&r->app_failed, 0) : 0;
    if (was == 0)
        return;
    r->failed_sides |= KVF_SIDE_BIT(r->side) | r->ops->doomed_side(r);
    room_failed(r, (kvf_poll_t)(was - 1), NULL, r->failure->status == KVF_ERR_ABORTED, 0,
                "");
}

/* Abort and fail are no-ops on a final room, which stays final: seeing
 * it so, they return at once. */
void kvf__room_abort(kvf_room_t *r)
{
    if (!room_final(r))
        room_fail_app(r, KVF_ERR_ABORTED, NULL);
}

kvf_status_t kvf__room_fail_app(kvf_room_t *r, kvf_status_t st, const char *reason)
{
    if (st >= 0 || reason == NULL) {
        kvf_error("room %llu: kvf_*_fail needs a negative status and a reason",
                  (unsigned long long)r->id);
        return KVF_ERR_INVALID_PARAM;
    }
    if (!room_final(r))
        room_fail_app(r, st, reason);
    return KVF_OK;
}

kvf_status_t kvf__room_await_failure(kvf_room_t *r, unsigned timeout_ms)
{
    kvf_engine_t *eng = r->eng;
    if (room_state(r) == KVF_POLL_FAILED)
        return KVF_OK;           /* for good: nothing to wait for or to lock */
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_sec += timeout_ms / 1000;
    until.tv_nsec += (long)(timeout_ms % 1000) * 1000000L;
    if (until.tv_nsec >= 1000000000L) {
        until.tv_sec++;
        until.tv_nsec -= 1000000000L;
    }
    kvf__room_lock(r);
    /*
     * The caller says the request failed on another rank of this side (its
     * scheduler's all-reduce over its ranks): this side is among those
     * that failed the room.  A room that succeeded here and kept a cause
     * learned from the other side, because this side had not failed when
     * it came (kvf__room_fail_record), fails with it at once and tells its
     * peers; one that has none takes the first that comes.  Waiting for
     * the news that this side failed would not do: it travels through
     * ranks of the other side, which may have let their rooms go already
     * (they were final there), so it may never come.
     */
    if (room_state(r) == KVF_POLL_SUCCESS) {
        r->failed_sides |= KVF_SIDE_BIT(r->side);
        if (r->failure != NULL && room_turn_failed(r, KVF_POLL_SUCCESS, NULL))
            room_failed(r, KVF_POLL_SUCCESS, NULL, r->failure->status == KVF_ERR_ABORTED, 0,
                        " after it had succeeded here (its application says this side "
                        "failed)");
    }
    while (room_state(r) != KVF_POLL_FAILED)
        if (kvf__cond_timedwait(eng, &eng->final_cond, &until) == ETIMEDOUT)
            break;
    kvf_status_t st = room_state(r) == KVF_POLL_FAILED ? KVF_OK : KVF_ERR_AGAIN;
    kvf__unlock(eng);
    return st;
}

/* ------------------------------------------------------------------------ */
/* Messages about rooms                                                      */
/* ------------------------------------------------------------------------ */

/*
 * Ownership: a room's messages count only from the peer it is bound to,
 * naming the room's instance.  A receiver is bound to the prefill ranks
 * it asked (its links, once their ROOM_REQ went) under its own instance;
 * a sender to the decode rank and instance of each ROOM_REQ it accepted.
 * Anything else is dropped (kvf__room_dropped) and never fails the room.
 * The one exception is a sender still collecting destinations: a FAIL
 * from a decode rank not bound yet, whose instance no destroyed sender
 * served, fails it, because a decode rank that failed before it could
 * send its destination has no other way to say so (docs/SECURITY.md).
 * Each side checks this in its on_msg (sender.c, receiver.c), which gets
 * the room looked up here, or NULL: what a message for a room this
 * engine does not have means is the side's to say too.
 */
/* The room a room message names: 1, or 0 for a message of another type. */
static int msg_room(const kvf_msg_t *msg, uint64_t *id_p)
{
    switch (msg->type) {
    case KVF_MSG_ROOM_REQ:
        *id_p = msg->u.room_req.room;
        return 1;
    case KVF_MSG_DONE:
        *id_p = msg->u.done.room;
        return 1;
    case KVF_MSG_DONE_ACK:
        *id_p = msg->u.done_ack.room;
        return 1;
    case KVF_MSG_FAIL:
    case KVF_MSG_ABORT:
        *id_p = msg->u.fail.room;
        return 1;
    default:
        return 0;
    }
}

kvf_verdict_t kvf__room_on_msg(kvf_peer_t *p, const kvf_msg_t *msg)
{
    KVF_ASSERT_LOCKED(p->eng);
    kvf_engine_t *eng = p->eng;
    uint64_t id;

    if (!msg_room(msg, &id))
        return kvf__room_unexpected(p, msg);
    return eng->room_ops->on_msg(p, kvf__room_find(eng, id), msg);
}

kvf_verdict_t kvf__room_unexpected(const kvf_peer_t *p, const kvf_msg_t *msg)
{
    KVF_ASSERT_LOCKED(p->eng);
    return kvf__verdict(KVF_ERR_PROTOCOL, "unexpected %s message from a %s engine",
                        kvf_wire_type_name((uint8_t)msg->type), kvf_role_name(p->role));
}

/* ------------------------------------------------------------------------ */
/* Peers and deadlines                                                       */
/* ------------------------------------------------------------------------ */

/* Fail a room because `p` failed: its other peers are told; `p` is not
 * (its peer code sends the FAIL itself, from the record kept in *out).
 * @return 1 when recorded. */
static int fail_for_peer(kvf_room_t *r, kvf_peer_t *p, kvf_room_failed_t *out,
                         kvf_status_t st, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));

static int fail_for_peer(kvf_room_t *r, kvf_peer_t *p, kvf_room_failed_t *out,
                         kvf_status_t st, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    int done = room_vfail(r, p, out, st, KVF_SIDE_BIT(p->role), fmt, ap);
    va_end(ap);
    return done;
}

void kvf__room_rx_drop(kvf_peer_t *p)
{
    KVF_ASSERT_LOCKED(p->eng);
    if (p->rx_room != NULL) {
        kvf__room_put(p->rx_room);
        p->rx_room = NULL;
        p->rx_link = NULL;
    }
}

int kvf__rooms_peer_failed(kvf_engine_t *eng, kvf_peer_t *p, kvf_status_t st,
                           const char *reason, kvf_room_failed_t **failed_p,
                           size_t *nfailed_p)
{
    KVF_ASSERT_LOCKED(eng);
    int n = 0;
    size_t nf = 0, cap = 0;
    kvf_room_failed_t *failed = NULL;

    kvf__room_rx_drop(p);
    uint64_t now = kvf_now_ms();
    for (kvf_room_t *r = eng->rooms; r != NULL; r = r->next) {
        kvf_link_t *lk = link_of(r, p);
        if (lk == NULL || room_final(r))
            continue;
        n++;
        /* A reset stream may be transient: the decode side reconnects and
         * resumes; the prefill side waits for that, briefly. */
        if (st != KVF_ERR_CONN_RESET || r->retries >= MAX_RETRIES) {
            if (nf == cap) {
                size_t c = cap ? 2 * cap : 8;
                kvf_room_failed_t *g = realloc(failed, c * sizeof(*g));
                if (g != NULL) {
                    failed = g;
                    cap = c;
                }
            }
            kvf_room_failed_t *out = nf < cap ? &failed[nf] : NULL;
            int done;
            /* The first break is the root cause; say how reconnecting ended. */
            if (r->retries > 0 && r->last_err != NULL)
                done = fail_for_peer(r, p, out, st, "%s; gave up after %u reconnects, "
                                     "the last: %s", r->last_err, r->retries, reason);
            else
                done = fail_for_peer(r, p, out, st, "%s", reason);
            nf += done && out != NULL;
            continue;
        }
        /* The old stream's DONE, checked or waiting for its reads, goes
         * with it: the resumed stream sends everything again, DONE too,
         * and reads of the old one that end now count for nothing. */
        for (uint32_t i = 0; i < r->nlinks; i++)
            if (r->links[i].peer == p) {
                r->links[i].broken = 1;
                r->links[i].rx.done_waiting = 0;
                r->links[i].rx.confirming = 0;
            }
        if (r->last_err == NULL)
            r->last_err = strdup(reason);
        r->retries++;
        r->retry_at_ms = r->ops->retry_at(r, now);
    }
    /* The rooms that watched p (siblings.c): siblings.c says which must
     * fail with it, and they fail here, as the byte links' rooms did. */
    for (kvf_room_t *r = eng->rooms; r != NULL; r = r->next) {
        kvf_verdict_t v;
        if (kvf__siblings_peer_lost(r, p, st, reason, &v))
            kvf__room_fail_lost(r, KVF_ROLE_PREFILL, v.st, "%s", v.why);
    }
    *failed_p = failed;
    *nfailed_p = nf;
    return n;
}

void kvf__rooms_peer_ready(kvf_engine_t *eng, kvf_peer_t *p)
{
    KVF_ASSERT_LOCKED(eng);
    for (kvf_room_t *r = eng->rooms; r != NULL; r = r->next)
        if (r->ops->peer_ready != NULL && link_of(r, p) != NULL)
            r->ops->peer_ready(r);
}

int kvf__rooms_wait_on(kvf_engine_t *eng, const kvf_peer_t *p)
{
    KVF_ASSERT_LOCKED(eng);
    for (kvf_room_t *r = eng->rooms; r != NULL; r = r->next)
        if (!room_final(r) && (link_of(r, p) != NULL || kvf__siblings_bound(r, p, 0)))
            return 1;
    return 0;
}

void kvf__rooms_tick(kvf_engine_t *eng, uint64_t now)
{
    KVF_ASSERT_LOCKED(eng);
    const kvf_engine_params_t *pr = &eng->params;
    char detail[420];

    for (kvf_room_t *r = eng->rooms; r != NULL; r = r->next) {
        if (r->ops->tick(r, now))
            continue;
        kvf_poll_t s = room_state(r);
        unsigned limit = s == KVF_POLL_BOOTSTRAPPING ? pr->bootstrap_timeout_ms
                       : s == KVF_POLL_WAITING_FOR_INPUT ? pr->waiting_timeout_ms
                       : s == KVF_POLL_TRANSFERRING ? pr->transfer_timeout_ms : 0;
        uint64_t idle = kvf_elapsed_ms(now, r->t_state_ms);
        if (limit == 0 || idle < limit)
            continue;
        /* Waiting for a lost connection to come back when the deadline
         * expires: the loss is the room's cause, and names the peer. */
        if (has_broken_link(r)) {
            kvf__room_fail(r, KVF_ERR_CONN_RESET, "%s; the connection was not back when "
                           "the room's %s deadline expired (%.1f s without progress)",
                           r->last_err ? r->last_err : "connection lost",
                           kvf_poll_name(s), limit / 1000.0);
            continue;
        }
        r->ops->deadline_detail(r, s, detail, sizeof(detail));
        kvf__room_fail(r, KVF_ERR_TIMED_OUT, "room %llu made no progress in %s for "
                       "%.1f s (deadline %.1f s): %s", (unsigned long long)r->id,
                       kvf_poll_name(s), (double)idle / 1000.0, limit / 1000.0, detail);
    }
}

kvf_status_t kvf__room_metric(kvf_room_t *r, kvf_room_metric_t *m)
{
    if (m == NULL || m->size < KVF_FIELD_END(kvf_room_metric_t, transfer_s)) {
        kvf_error("kvf_*_metric: set metric->size to sizeof(kvf_room_metric_t)");
        return KVF_ERR_INVALID_PARAM;
    }
    kvf_room_metric_t v = {.size = m->size};
    uint64_t end = atomic_load_explicit(&r->t_final_ns, memory_order_acquire);
    uint64_t dest = atomic_load_explicit(&r->t_dest_ns, memory_order_relaxed);
    v.bytes = atomic_load_explicit(&r->bytes, memory_order_relaxed);
    if (dest != 0) {
        v.alloc_s = (double)(dest - r->t_create_ns) * 1e-9;
        v.transfer_s = (double)((end ? end : kvf_now_ns()) - dest) * 1e-9;
    }
    memcpy(m, &v, m->size < sizeof(v) ? m->size : sizeof(v));
    return KVF_OK;
}
