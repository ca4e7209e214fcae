/*
 * Logging: one line per event on stderr, "kvferry[pid] LEVEL file:line: msg".
 *
 * Errors are logged where they are first detected; callers up the stack
 * return the status without logging it again.  The level comes from KVF_LOG
 * (error|warn|info|debug) or kvf_log_set_level().
 */
#ifndef KVF_UTIL_LOG_H
#define KVF_UTIL_LOG_H

#include <stdatomic.h>

#include "kvferry/kvferry.h"

/* Set by any thread (kvf_log_set_level) while engine threads log. */
extern _Atomic int kvf__log_level;

void kvf__log(kvf_log_level_t level, const char *file, int line,
              const char *fmt, ...) __attribute__((format(printf, 4, 5)));

void kvf__set_last_error(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

/* Relaxed load: the level is a lone flag; nothing is published with it. */
#define KVF_LOG_(lvl, ...)                                                     \
    do {                                                                       \
        if ((int)(lvl) <= atomic_load_explicit(&kvf__log_level,                \
                                               memory_order_relaxed))          \
            kvf__log((lvl), __FILE__, __LINE__, __VA_ARGS__);                  \
    } while (0)

/* Errors are also kept as the thread's kvf_last_error(). */
#define kvf_error(...)                                                         \
    do {                                                                       \
        kvf__set_last_error(__VA_ARGS__);                                      \
        KVF_LOG_(KVF_LOG_ERROR, __VA_ARGS__);                                  \
    } while (0)
#define kvf_warn(...)  KVF_LOG_(KVF_LOG_WARN, __VA_ARGS__)
#define kvf_info(...)  KVF_LOG_(KVF_LOG_INFO, __VA_ARGS__)
#define kvf_debug(...) KVF_LOG_(KVF_LOG_DEBUG, __VA_ARGS__)

#endif /* KVF_UTIL_LOG_H */
