/*
 * Waiting on rooms in unit tests: poll a sender or a receiver until it
 * reaches a state or fails, 20 s at most (far past any test's need: only
 * a broken room takes that long, and the test then fails on its state).
 */
#ifndef KVF_ROOMS_H
#define KVF_ROOMS_H

#include <time.h>

#include "kvferry/kvferry.h"

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

/* Until the sender is at least `want`, or failed.  @return its state. */
static inline kvf_poll_t wait_sender(const kvf_sender_t *s, kvf_poll_t want)
{
    long long end = kvf_test_now_ms() + KVF_TEST_WAIT_MS;
    kvf_poll_t p = kvf_sender_poll(s);
    while (p < want && p != KVF_POLL_FAILED && kvf_test_now_ms() < end) {
        sleep_ms(1);
        p = kvf_sender_poll(s);
    }
    return p;
}

static inline kvf_poll_t wait_receiver(const kvf_receiver_t *r, kvf_poll_t want)
{
    long long end = kvf_test_now_ms() + KVF_TEST_WAIT_MS;
    kvf_poll_t p = kvf_receiver_poll(r);
    while (p < want && p != KVF_POLL_FAILED && kvf_test_now_ms() < end) {
        sleep_ms(1);
        p = kvf_receiver_poll(r);
    }
    return p;
}

/* Until both are final (either may be NULL). */
static inline void wait_final(const kvf_sender_t *s, const kvf_receiver_t *r)
{
    if (s != NULL)
        wait_sender(s, KVF_POLL_SUCCESS);
    if (r != NULL)
        wait_receiver(r, KVF_POLL_SUCCESS);
}

#endif /* KVF_ROOMS_H */
