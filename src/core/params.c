/*
 * The engine's parameters: kvf_engine_params_t's defaults (from KVF_*
 * variables), its init and its import at create, which follow the growth
 * rules of sized.h, and the stream count a machine allows.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/engine.h"
#include "core/sized.h"
#include "util/log.h"

/*
 * The end of the last field this library knows: move these when a field
 * is added.  The assertions catch a new last field that grew the struct,
 * not one that fits in its trailing padding.
 */
#define PARAMS_KNOWN KVF_FIELD_END(kvf_engine_params_t, busy_poll_us)
_Static_assert(sizeof(kvf_engine_params_t) - PARAMS_KNOWN < _Alignof(kvf_engine_params_t),
               "PARAMS_KNOWN must name the last field of kvf_engine_params_t");

static const kvf_sized_type_t params_type = {
    "kvf_engine_params_t", "kvf_engine_params_init", KVF_SIZED_SINCE_0_1_0,
    KVF_ENGINE_PARAMS_SIZE_V0, PARAMS_KNOWN};

/* KVF_BUSY_POLL_US, else 0 (off). */
static unsigned busy_poll_default(void)
{
    const char *v = getenv("KVF_BUSY_POLL_US");
    if (v == NULL || *v == '\0')
        return 0;
    char *end;
    unsigned long x = strtoul(v, &end, 10);
    if (*end == '\0' && x <= KVF_BUSY_POLL_MAX_US)
        return (unsigned)x;
    kvf_warn("ignoring KVF_BUSY_POLL_US=%s: expected microseconds (0..%d)", v,
             KVF_BUSY_POLL_MAX_US);
    return 0;
}

static void params_defaults(void *dst)
{
    kvf_engine_params_t *p = dst;
    const char *v;

    memset(p, 0, sizeof(*p));
    p->size = sizeof(*p);
    p->role = KVF_ROLE_PREFILL;
    p->tp_size = p->pp_size = p->dp_size = 1;
    p->host = (v = getenv("KVF_HOST")) ? v : "127.0.0.1";
    p->transport = (v = getenv("KVF_TRANSPORT")) ? v : "auto";
    p->checksum = (v = getenv("KVF_CHECKSUM")) != NULL && strcmp(v, "0") != 0;
    p->bootstrap_timeout_ms = kvf__env_ms("KVF_BOOTSTRAP_TIMEOUT_MS", 30000);
    p->waiting_timeout_ms = kvf__env_ms("KVF_WAITING_TIMEOUT_MS", 300000);
    p->transfer_timeout_ms = kvf__env_ms("KVF_TRANSFER_TIMEOUT_MS", 30000);
    p->heartbeat_interval_ms = kvf__env_ms("KVF_HEARTBEAT_INTERVAL_MS", 500);
    p->heartbeat_timeout_ms = kvf__env_ms("KVF_HEARTBEAT_TIMEOUT_MS", 2500);
    p->faults = (v = getenv("KVF_FAULTS")) != NULL && *v != '\0' ? v : NULL;
    p->handshake_timeout_ms = kvf__env_ms("KVF_HANDSHAKE_TIMEOUT_MS", KVF_HANDSHAKE_TIMEOUT_MS);
    p->streams = 0;                    /* kvf__streams_default() at create */
    p->busy_poll_us = busy_poll_default();
}

unsigned kvf__streams_default(void)
{
    const char *v = getenv("KVF_STREAMS");
    if (v != NULL && *v != '\0') {
        char *end;
        unsigned long x = strtoul(v, &end, 10);
        if (*end == '\0' && x >= 1 && x <= KVF_MAX_STREAMS)
            return (unsigned)x;
        kvf_warn("ignoring KVF_STREAMS=%s: expected 1..%d", v, KVF_MAX_STREAMS);
    }
    /* A lane is a thread that wants a core of its own, beside the
     * scheduler's and the other engines' of the host (one per GPU): a
     * quarter of the CPUs, 1 to 4 (docs/GUIDE.md, Streams, measured). */
    long n = sysconf(_SC_NPROCESSORS_ONLN) / 4;
    return n < 1 ? 1 : n > 4 ? 4 : (unsigned)n;
}

void kvf_engine_params_init_sized(kvf_engine_params_t *p, size_t size)
{
    kvf_engine_params_t def;

    params_defaults(&def);
    kvf__sized_init(p, size, &def, &params_type);
}

/* The header's macro of this name passes sizeof; the parentheses define
 * the exported function that callers built against 0.1.0 link to. */
void (kvf_engine_params_init)(kvf_engine_params_t *p)
{
    kvf_engine_params_init_sized(p, KVF_ENGINE_PARAMS_SIZE_V0);
}

kvf_status_t kvf__engine_params_import(kvf_engine_params_t *dst,
                                       const kvf_engine_params_t *src,
                                       const char *fn, char *err, size_t errlen)
{
    return kvf__sized_import(dst, sizeof(*dst), src, params_defaults, &params_type, fn,
                             err, errlen);
}
