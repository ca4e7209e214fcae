/*
 * The engine lock and the lanes' wake-ups (sync.h): the per-thread records
 * and what cannot be inline.  A lane sleeps in epoll_wait on its own
 * eventfd among its connections; a write to that eventfd is the one way
 * another thread gets its attention.
 */
#include <errno.h>
#include <sched.h>
#include <stdint.h>
#include <unistd.h>

#include "core/sync.h"
#include "util/log.h"

#define YIELD_SPINS 200 /* sched_yield()s at most, letting callers take the lock */

_Thread_local const kvf_engine_t *kvf__lock_held;
_Thread_local const kvf_engine_t *kvf__io_owner;
_Thread_local unsigned kvf__io_lane;

void kvf__sync_init(kvf_sync_t *s)
{
    pthread_mutex_init(&s->lock, NULL);
    atomic_init(&s->lock_wanted, 0);
    atomic_init(&s->awake, 0);
    for (unsigned k = 0; k < KVF_MAX_STREAMS; k++)
        s->wakefd[k] = -1;
}

void kvf__sync_destroy(kvf_sync_t *s)
{
    for (unsigned k = 0; k < KVF_MAX_STREAMS; k++)
        if (s->wakefd[k] >= 0)
            close(s->wakefd[k]);
    pthread_mutex_destroy(&s->lock);
}

void kvf__engine_io_unlock(void *arg)
{
    kvf__unlock(arg);
}

void kvf__engine_io_lock(void *arg)
{
    kvf__lock_lane(arg);
}

void kvf__lane_wake(kvf_engine_t *eng, unsigned lane)
{
    uint64_t one = 1;
    if (write(kvf__sync(eng)->wakefd[lane], &one, sizeof(one)) < 0 && errno != EAGAIN)
        kvf_warn("eventfd write: %m");
}

void kvf__engine_wake(kvf_engine_t *eng)
{
    kvf__lane_wake(eng, 0);
}

void kvf__engine_wake_idle(kvf_engine_t *eng)
{
    if (atomic_load(&kvf__sync(eng)->awake) == 0)
        kvf__lane_wake(eng, 0);
}

/*
 * Without this a busy loop re-takes the lock within the microsecond it
 * let go, and a scheduler's call waits for many passes; a waiter that was
 * descheduled must not stall the loop either, hence the bound.
 */
void kvf__lock_yield(kvf_engine_t *eng)
{
    for (int spins = 0; spins < YIELD_SPINS; spins++) {
        /* Relaxed: only a hint, see kvf__lock. */
        if (atomic_load_explicit(&kvf__sync(eng)->lock_wanted, memory_order_relaxed) == 0)
            return;
        sched_yield();
    }
}
