#include "util/log.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static int log_level_from_env(void)
{
    const char *v = getenv("KVF_LOG");
    if (v == NULL) return KVF_LOG_WARN;
    if (!strcmp(v, "error")) return KVF_LOG_ERROR;
    if (!strcmp(v, "warn")) return KVF_LOG_WARN;
    if (!strcmp(v, "info")) return KVF_LOG_INFO;
    if (!strcmp(v, "debug")) return KVF_LOG_DEBUG;
    return KVF_LOG_WARN;
}

_Atomic int kvf__log_level = KVF_LOG_WARN;

/* What a refused call said, for callers that do not read stderr (Python). */
static _Thread_local char last_error[512];

const char *kvf_last_error(void)
{
    return last_error;
}

void kvf__set_last_error(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(last_error, sizeof(last_error), fmt, ap);
    va_end(ap);
}

__attribute__((constructor)) static void log_init(void)
{
    atomic_store_explicit(&kvf__log_level, log_level_from_env(), memory_order_relaxed);
}

void kvf_log_set_level(kvf_log_level_t level)
{
    /* Relaxed: loggers need the new level soon, not ordered with anything. */
    atomic_store_explicit(&kvf__log_level, (int)level, memory_order_relaxed);
}

void kvf__log(kvf_log_level_t level, const char *file, int line,
              const char *fmt, ...)
{
    static const char *names[] = {"ERROR", "WARN", "INFO", "DEBUG"};
    const char *base = strrchr(file, '/');
    char msg[1024];
    va_list ap;

    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    /* One fprintf per line so lines from several threads do not interleave. */
    fprintf(stderr, "kvferry[%d] %s %s:%d: %s\n", (int)getpid(), names[level],
            base ? base + 1 : file, line, msg);
}
