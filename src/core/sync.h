/*
 * The engine lock, the lanes' wake-ups and who owns which connection: what
 * every file of src/core needs to take, check, release and wait on the one
 * engine lock, and to hand work to a progress thread.  Rooms (sender.c,
 * receiver.c and the files beside them) reach lock and wake here, never
 * through engine.c.
 *
 * This header stands below engine.h (engine.h includes it), so it cannot
 * see struct kvf_engine: the engine keeps a kvf_sync_t as its first
 * member, and kvf__sync() finds it from the engine's address (engine.h
 * asserts the offset at compile time).
 *
 * THE LOCK RULE
 *   Every `kvf__` function of src/core that takes an engine, a peer, a
 *   room or a lane (or a stash entry) runs with that engine's lock held,
 *   and says so at its top: KVF_ASSERT_LOCKED.  The exceptions:
 *     - a name that ends in `_unlocked` runs without the lock: at create
 *       before the engine's threads start, at destroy after they stopped,
 *       or on data that does not change once the engine runs;
 *     - the entry points take the lock themselves: the public kvf_* calls,
 *       the threads' mains (progress, lanes, resolver, metrics), and the
 *       room.c calls those public calls land in and kvf__resolver_stop,
 *       marked "takes the lock" where room.h and resolver.h declare them;
 *     - the plumbing of this file;
 *     - publishing without the lock (kvf__room_submit, and the public
 *       calls that fill what it publishes, kvf_sender_init,
 *       kvf_sender_set_states, kvf_sender_send, kvf_sender_send_layers and
 *       kvf_receiver_set_dest): they touch
 *       only atomics and fields the application's thread owns under the
 *       room's app_lock, and the lanes take what it published under the
 *       lock (kvf__rooms_take_submitted); an abort or fail of the
 *       application's (kvf__room_abort, kvf__room_fail_app), which turns
 *       a live room FAILED under the room's final_lock, a leaf lock the
 *       lanes take for their own turns too; the descriptor sets a decode
 *       engine keeps (kvf__remote_seen_get, _put: descriptor.c), under
 *       the engine's remote_lock, another leaf; the read of a failed room's
 *       record (kvf__room_consume_failure), which is fixed once FAILED;
 *       and the room's metric (kvf__room_metric), which reads atomics.
 *   Functions that take none of these (layouts, parallel plans, page runs,
 *   sized structs, wire messages) touch nothing the lock guards.
 *
 *   A connection op that may let the lock go inside it (around its system
 *   calls: kvf_conn_env_t) says so in transport/transport.h: handle, flush
 *   and abort.  So may the core calls that reach them on a connection's
 *   own lane, marked "may let the lock go" in peer.h: kvf__peer_handle,
 *   kvf__peer_close_pending, kvf__peer_fail, kvf__lane_pass and
 *   kvf__lane_event.  Whoever walks a list across one of those re-checks
 *   what another thread may have changed meanwhile: a walk of eng->peers
 *   reads the next link only after the call returned (another thread only
 *   adds peers at the head; lane 0 alone unlinks them, and a lane keeps
 *   the peers of its streams linked), and an unlinking walk checks that
 *   its link still names the peer it holds; the resolver, which lets the
 *   lock go for whole registry calls, compares eng->peer_generation.
 */
#ifndef KVF_CORE_SYNC_H
#define KVF_CORE_SYNC_H

#include <assert.h>
#include <pthread.h>
#include <stdatomic.h>
#include <time.h>

#include "wire/wire.h"

/* kvferry.h's kvf_engine_t, named here by its struct: this header sees
 * neither the struct nor the public header. */
struct kvf_engine;

#define KVF_MAX_STREAMS KVF_WIRE_MAX_STREAMS   /* streams per peer, lanes per engine */

/* What an engine's lock and wake-ups are made of: the first member of
 * struct kvf_engine (kvf__sync). */
typedef struct kvf_sync {
    pthread_mutex_t lock;
    atomic_int      lock_wanted;              /* threads waiting in kvf__lock */
    int             wakefd[KVF_MAX_STREAMS];  /* lane k's eventfd, -1: none */
    /* Lanes not asleep: in a pass, or between passes, or waiting for the
     * lock; each takes in published work before it sleeps.  A call that
     * publishes work wakes lane 0 when this is 0 (kvf__engine_wake_idle). */
    atomic_int      awake;
} kvf_sync_t;

static inline kvf_sync_t *kvf__sync(const struct kvf_engine *eng)
{
    return (kvf_sync_t *)(void *)eng;
}

/*
 * The engine lock, with its holder recorded per thread so that functions
 * that expect it held can say so: KVF_ASSERT_LOCKED(eng) at their top
 * (checked in debug builds, the sanitizer ones included; libfabric's
 * genlock idea).  A thread holds at most one engine's lock at a time.
 */
extern _Thread_local const struct kvf_engine *kvf__lock_held;

#define KVF_ASSERT_LOCKED(eng) assert(kvf__lock_held == (eng))

/*
 * The threads that own an engine's connections: its lanes (kvf__io_lane
 * says which), and the thread tearing it down once they are gone (every
 * lane, KVF_LANE_ALL).  Only a connection's lane calls its ops (they let
 * the lock go around their system calls); other threads queue what they
 * send (kvf__peer_send, kvf__peer_put_data).  kvf__owns_io: lane 0, which
 * also owns the listener, the movers, the ticks and freeing peers.
 */
#define KVF_LANE_ALL (~0u)
extern _Thread_local const struct kvf_engine *kvf__io_owner;
extern _Thread_local unsigned kvf__io_lane;

static inline int kvf__owns_lane(const struct kvf_engine *eng, unsigned lane)
{
    return kvf__io_owner == eng && (kvf__io_lane == lane || kvf__io_lane == KVF_LANE_ALL);
}

static inline int kvf__owns_io(const struct kvf_engine *eng)
{
    return kvf__owns_lane(eng, 0);
}

/*
 * Every thread but the progress threads takes the lock through this: it
 * counts itself in `lock_wanted` while it waits, and the progress thread,
 * which would otherwise take the lock back the moment it let go (a mutex
 * is not fair), lets such waiters go first between its passes
 * (kvf__lock_yield).
 */
static inline void kvf__lock(struct kvf_engine *eng)
{
    kvf_sync_t *s = kvf__sync(eng);
    /* Relaxed: a hint for the progress thread; the mutex orders the rest. */
    atomic_fetch_add_explicit(&s->lock_wanted, 1, memory_order_relaxed);
    pthread_mutex_lock(&s->lock);
    atomic_fetch_sub_explicit(&s->lock_wanted, 1, memory_order_relaxed);
    kvf__lock_held = eng;
}

/* A progress thread (a lane) takes the lock back: not counted in
 * lock_wanted, since it is the one that yields to those who are. */
static inline void kvf__lock_lane(struct kvf_engine *eng)
{
    pthread_mutex_lock(&kvf__sync(eng)->lock);
    kvf__lock_held = eng;
}

static inline void kvf__unlock(struct kvf_engine *eng)
{
    kvf__lock_held = NULL;
    pthread_mutex_unlock(&kvf__sync(eng)->lock);
}

/* pthread_cond_timedwait on the engine lock, keeping the record true. */
static inline int kvf__cond_timedwait(struct kvf_engine *eng, pthread_cond_t *cond,
                                      const struct timespec *until)
{
    kvf__lock_held = NULL;
    int rc = pthread_cond_timedwait(cond, &kvf__sync(eng)->lock, until);
    kvf__lock_held = eng;
    return rc;
}

/* sync.c */
void kvf__sync_init(kvf_sync_t *s);
void kvf__sync_destroy(kvf_sync_t *s);
/* Wake lane `lane`'s progress thread (kvf__engine_wake: lane 0's).  Any
 * thread, with or without the lock. */
void kvf__lane_wake(struct kvf_engine *eng, unsigned lane);
void kvf__engine_wake(struct kvf_engine *eng);
/* Wake lane 0 only if every lane sleeps: what a call that published work
 * without the lock does.  A lane counts itself out of `awake` and then
 * looks for published work once more before it sleeps (sequentially
 * consistent), and a publisher publishes and then reads `awake`: one of
 * the two sees the other, so work is never left until the next tick, and
 * while any lane is busy the call makes no system call (a wake costs a
 * few microseconds, and may hand the caller's CPU to the lane). */
void kvf__engine_wake_idle(struct kvf_engine *eng);
/* A progress thread between its passes, with the lock released: let the
 * threads waiting in kvf__lock have it first, for a bounded time. */
void kvf__lock_yield(struct kvf_engine *eng);
/* What a connection calls around its system calls (kvf_conn_env_t's
 * unlock and lock; arg: the engine). */
void kvf__engine_io_unlock(void *eng);
void kvf__engine_io_lock(void *eng);

#endif /* KVF_CORE_SYNC_H */
