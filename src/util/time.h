/* Monotonic time in milliseconds and nanoseconds. */
#ifndef KVF_UTIL_TIME_H
#define KVF_UTIL_TIME_H

#include <stdint.h>
#include <time.h>

static inline uint64_t kvf_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static inline uint64_t kvf_now_ms(void)
{
    return kvf_now_ns() / 1000000ull;
}

/*
 * Milliseconds from `then` to `now`, 0 when `then` is later: a stamp taken
 * by another thread (or by this one while the lock was let go) can be newer
 * than a pass's `now`, and unsigned subtraction would make it ages old.
 */
static inline uint64_t kvf_elapsed_ms(uint64_t now, uint64_t then)
{
    return now > then ? now - then : 0;
}

#endif /* KVF_UTIL_TIME_H */
