/*
 * Waiting in unit tests, always against a deadline on the monotonic clock:
 * a sender or a receiver until it reaches a state or fails, an engine
 * until a condition the test names holds, and the failure a room ended
 * with.  The library's only event to wait on is a room's failure
 * (kvf_*_await_failure); everything else is poll(), which takes no lock,
 * checked every millisecond until its deadline; so is a child process,
 * until it exits.  The default deadline, 20 s, is far past any test's
 * need: only a broken room takes that long, and the test then fails on
 * its state.
 */
#ifndef KVF_ROOMS_H
#define KVF_ROOMS_H

#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>

#include "kvferry/kvferry.h"
#include "unit/kvf_test.h"

#define KVF_TEST_WAIT_MS 20000

static inline void sleep_ms(int ms)
{
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

static inline int room_is_final(kvf_poll_t s)
{
    return s == KVF_POLL_SUCCESS || s == KVF_POLL_FAILED;
}

/* Milliseconds on the monotonic clock. */
static inline long long kvf_test_now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* Until cond(arg) holds, limit_ms at most.  @return 1 if it held. */
static inline int wait_until(int (*cond)(const void *arg), const void *arg, int limit_ms)
{
    long long end = kvf_test_now_ms() + limit_ms;
    for (;;) {
        if (cond(arg))
            return 1;
        if (kvf_test_now_ms() >= end)
            return 0;
        sleep_ms(1);
    }
}

/* The engine's counters (kvf_engine_stats), of this header's size. */
static inline kvf_engine_stats_t engine_stats(kvf_engine_t *eng)
{
    kvf_engine_stats_t st;
    kvf_engine_stats_init(&st);
    kvf_engine_stats_init(&st);
    CHECK_EQ_INT(kvf_engine_stats(eng, &st), KVF_OK);
    return st;
}

typedef struct dropped_arg {
    kvf_engine_t *eng;
    uint64_t      n;
} dropped_arg_t;

static inline int has_dropped(const void *arg)
{
    const dropped_arg_t *d = arg;
    return engine_stats(d->eng).room_msgs_dropped >= d->n;
}

/* Until the engine has dropped at least n room messages as not its
 * rooms' (room.c), limit_ms at most.  @return 1 if it has. */
static inline int wait_dropped(kvf_engine_t *eng, uint64_t n, int limit_ms)
{
    dropped_arg_t d = {eng, n};
    return wait_until(has_dropped, &d, limit_ms);
}

/* Until child process pid exits, limit_ms at most; it is reaped, its
 * status in *status_p (unless NULL).  @return 1 if it exited. */
static inline int wait_child(pid_t pid, int *status_p, int limit_ms)
{
    long long end = kvf_test_now_ms() + limit_ms;
    int status = 0;
    pid_t w;
    while ((w = waitpid(pid, &status, WNOHANG)) == 0 && kvf_test_now_ms() < end)
        sleep_ms(1);
    if (w == pid && status_p != NULL)
        *status_p = status;
    return w == pid;
}

/* Until the sender is at least `want`, or failed, limit_ms at most.
 * @return its state. */
static inline kvf_poll_t wait_sender_ms(const kvf_sender_t *s, kvf_poll_t want, int limit_ms)
{
    long long end = kvf_test_now_ms() + limit_ms;
    kvf_poll_t p = kvf_sender_poll(s);
    while (p < want && p != KVF_POLL_FAILED && kvf_test_now_ms() < end) {
        sleep_ms(1);
        p = kvf_sender_poll(s);
    }
    return p;
}

static inline kvf_poll_t wait_receiver_ms(const kvf_receiver_t *r, kvf_poll_t want,
                                          int limit_ms)
{
    long long end = kvf_test_now_ms() + limit_ms;
    kvf_poll_t p = kvf_receiver_poll(r);
    while (p < want && p != KVF_POLL_FAILED && kvf_test_now_ms() < end) {
        sleep_ms(1);
        p = kvf_receiver_poll(r);
    }
    return p;
}

static inline kvf_poll_t wait_sender(const kvf_sender_t *s, kvf_poll_t want)
{
    return wait_sender_ms(s, want, KVF_TEST_WAIT_MS);
}

static inline kvf_poll_t wait_receiver(const kvf_receiver_t *r, kvf_poll_t want)
{
    return wait_receiver_ms(r, want, KVF_TEST_WAIT_MS);
}

/* Until both are final (either may be NULL). */
static inline void wait_final(const kvf_sender_t *s, const kvf_receiver_t *r)
{
    if (s != NULL)
        wait_sender(s, KVF_POLL_SUCCESS);
    if (r != NULL)
        wait_receiver(r, KVF_POLL_SUCCESS);
}

/* Until every one of ns senders and nr receivers is final. */
static inline void wait_all_final(kvf_sender_t *const *s, int ns, kvf_receiver_t *const *r,
                                  int nr)
{
    for (int i = 0; i < ns; i++)
        wait_sender(s[i], KVF_POLL_SUCCESS);
    for (int i = 0; i < nr; i++)
        wait_receiver(r[i], KVF_POLL_SUCCESS);
}

/* The receiver's room fails, with `status` and a reason that says `why`
 * (and `why2`, unless NULL). */
static inline void check_recv_failed(kvf_receiver_t *r, kvf_status_t status, const char *why,
                                     const char *why2)
{
    kvf_failure_t f;
    kvf_failure_init(&f);
    CHECK_EQ_INT(wait_receiver(r, KVF_POLL_SUCCESS), KVF_POLL_FAILED);
    CHECK_EQ_INT(kvf_receiver_failure(r, &f), KVF_OK);
    CHECK_EQ_INT(f.status, status);
    CHECK_STR_CONTAINS(f.reason, why);
    if (why2 != NULL)
        CHECK_STR_CONTAINS(f.reason, why2);
}

/* A room's final state, the failure call's status and its record: the
 * room failed with `want`, its reason saying `part`. */
static inline void check_failed_with(kvf_poll_t state, kvf_status_t got, kvf_status_t want,
                                     const kvf_failure_t *f, const char *part)
{
    CHECK_EQ_INT(state, KVF_POLL_FAILED);
    CHECK_EQ_INT(got, KVF_OK);
    CHECK_EQ_INT(f->status, want);
    CHECK_STR_CONTAINS(f->reason, part);
}

#endif /* KVF_ROOMS_H */
