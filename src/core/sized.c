/*
 * Structs that grow: parameter structs (kvf_engine_params_t, kvf_layout_t,
 * kvf_dest_t, kvf_hold_t, kvf_remote_t) and records (kvf_failure_t,
 * kvf_engine_stats_t).  The caller's `size` says how much of the struct
 * its header had, and the library never touches a byte past it.  Init
 * writes `size` bytes; the calls that take a parameter struct "import"
 * it, copying its bytes over a full-size struct of defaults, so that
 * fields the caller's header lacked take their defaults and everything
 * afterwards reads only the library's own full-size copy; the calls that
 * fill a record build a full-size one and "export" what fits.  Here: the
 * rules, and the structs whose every default is 0 (the engine's
 * parameters are params.c's).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/sized.h"
#include "util/log.h"

/*
 * The end of the last field this library knows: move these when a field
 * is added.  The assertions catch a new last field that grew the struct,
 * not one that fits in its trailing padding.
 */
#define LAYOUT_KNOWN KVF_FIELD_END(kvf_layout_t, kv_order)
_Static_assert(sizeof(kvf_layout_t) - LAYOUT_KNOWN < _Alignof(kvf_layout_t),
               "LAYOUT_KNOWN must name the last field of kvf_layout_t");
#define DEST_KNOWN KVF_FIELD_END(kvf_dest_t, decode_prefix_len)
_Static_assert(sizeof(kvf_dest_t) - DEST_KNOWN < _Alignof(kvf_dest_t),
               "DEST_KNOWN must name the last field of kvf_dest_t");

#define HOLD_KNOWN KVF_FIELD_END(kvf_hold_t, instance)
_Static_assert(sizeof(kvf_hold_t) - HOLD_KNOWN < _Alignof(kvf_hold_t),
               "HOLD_KNOWN must name the last field of kvf_hold_t");
#define REMOTE_KNOWN KVF_FIELD_END(kvf_remote_t, num_descriptors)
_Static_assert(sizeof(kvf_remote_t) - REMOTE_KNOWN < _Alignof(kvf_remote_t),
               "REMOTE_KNOWN must name the last field of kvf_remote_t");
#define FAILURE_KNOWN KVF_FIELD_END(kvf_failure_t, reason)
_Static_assert(sizeof(kvf_failure_t) - FAILURE_KNOWN < _Alignof(kvf_failure_t),
               "FAILURE_KNOWN must name the last field of kvf_failure_t");
#define STATS_KNOWN KVF_FIELD_END(kvf_engine_stats_t, stash_dropped)
_Static_assert(sizeof(kvf_engine_stats_t) - STATS_KNOWN < _Alignof(kvf_engine_stats_t),
               "STATS_KNOWN must name the last field of kvf_engine_stats_t");

/* Larger than any version of these structs will be: a `size` past it is
 * garbage (an uninitialised struct), not a newer header. */
#define SIZE_SANE 4096

/*
 * Write the caller's `size` bytes at dst: the defaults in def (a full
 * struct) that fit, zero past the known fields, then `size` itself.  A
 * size below v0 gets zeros only: that struct is refused anyway.
 */
void kvf__sized_init(void *dst, size_t size, const void *def, const kvf_sized_type_t *t)
{
    size_t n = size < t->v0 ? 0 : size < t->known ? size : t->known;

    if (size < t->v0)
        kvf_error("%s_sized: size %zu is below %zu, the size of %s's first version "
                  "(%s): pass sizeof your %s, as the %s() macro does",
                  t->init, size, t->v0, t->name, t->since, t->name, t->init);
    memcpy(dst, def, n);
    memset((char *)dst + n, 0, size - n);
    if (size >= sizeof(size_t))
        memcpy(dst, &size, sizeof(size_t));
}

/* The caller's `size` of a struct it hands in: KVF_OK, or
 * KVF_ERR_INVALID_PARAM with the reason in err. */
static kvf_status_t size_check(size_t size, const kvf_sized_type_t *t, const char *fn,
                               char *err, size_t errlen)
{
    if (size < t->v0) {
        snprintf(err, errlen,
                 "%s: %s size %zu is below %zu, the size of its first version "
                 "(%s): initialise the struct with %s()", fn, t->name, size, t->v0,
                 t->since, t->init);
        return KVF_ERR_INVALID_PARAM;
    }
    if (size > SIZE_SANE) {
        snprintf(err, errlen,
                 "%s: %s size %zu is far past any version of it (this kvferry knows "
                 "%zu bytes): initialise the struct with %s()", fn, t->name, size,
                 t->known, t->init);
        return KVF_ERR_INVALID_PARAM;
    }
    return KVF_OK;
}

/*
 * Copy the caller's struct at src into dst (a full struct): only the
 * caller's bytes, and only those this library knows; dst->size is then
 * the full size.  A caller's struct that lacks some fields gets the
 * defaults from `defaults` first (only then: it reads the environment,
 * and may warn about it, as init already did); NULL: every default is 0.
 */
kvf_status_t kvf__sized_import(void *dst, size_t dst_size, const void *src,
                               void (*defaults)(void *), const kvf_sized_type_t *t,
                               const char *fn, char *err, size_t errlen)
{
    size_t size;

    memcpy(&size, src, sizeof(size));
    kvf_status_t st = size_check(size, t, fn, err, errlen);
    if (st != KVF_OK)
        return st;
    /* Past what this library knows: a newer header's fields, which are
     * fine at their default 0 and must not be silently ignored otherwise. */
    for (size_t i = t->known; i < size; i++) {
        if (((const unsigned char *)src)[i] != 0) {
            snprintf(err, errlen,
                     "%s: %s size %zu reaches past the %zu bytes this kvferry (%s) "
                     "knows, and byte %zu there is nonzero: the caller was built "
                     "against a newer kvferry.h and sets a field this library "
                     "lacks: link that kvferry's library, or leave the newer fields "
                     "at 0 (%s() zeroes them)",
                     fn, t->name, size, t->known, kvf_version(), i, t->init);
            return KVF_ERR_INVALID_PARAM;
        }
    }
    memset(dst, 0, dst_size);
    if (size < t->known && defaults != NULL)
        defaults(dst);
    memcpy(dst, src, size < t->known ? size : t->known);
    memcpy(dst, &dst_size, sizeof(size_t));
    return KVF_OK;
}

/*
 * Write the library's full record at src into the caller's struct at dst,
 * of the caller's `size`: the fields this library knows that fit, zero
 * past them (a newer header's fields, which this library does not fill),
 * and dst->size left as it was.  Nothing is written when the size is
 * refused.
 */
kvf_status_t kvf__sized_export(void *dst, const void *src, const kvf_sized_type_t *t,
                               const char *fn, char *err, size_t errlen)
{
    size_t size;

    memcpy(&size, dst, sizeof(size));
    kvf_status_t st = size_check(size, t, fn, err, errlen);
    if (st != KVF_OK)
        return st;
    size_t n = size < t->known ? size : t->known;
    memcpy((char *)dst + sizeof(size_t), (const char *)src + sizeof(size_t),
           n - sizeof(size_t));
    memset((char *)dst + n, 0, size - n);
    return KVF_OK;
}

unsigned kvf__env_ms(const char *name, unsigned def)
{
    const char *v = getenv(name);
    if (v == NULL || *v == '\0')
        return def;
    char *end;
    unsigned long x = strtoul(v, &end, 10);
    if (*end != '\0' || x == 0 || x > 86400000ul) {
        kvf_warn("ignoring %s=%s: expected milliseconds (1..86400000)", name, v);
        return def;
    }
    return (unsigned)x;
}

unsigned kvf__lease_default(void)
{
    return kvf__env_ms("KVF_LEASE_MS", 480000);
}

static const kvf_sized_type_t layout_type = {
    "kvf_layout_t", "kvf_layout_init", KVF_SIZED_SINCE_0_1_0, KVF_LAYOUT_SIZE_V0,
    LAYOUT_KNOWN};
static const kvf_sized_type_t dest_type = {
    "kvf_dest_t", "kvf_dest_init", KVF_SIZED_SINCE_0_1_0, KVF_DEST_SIZE_V0, DEST_KNOWN};
static const kvf_sized_type_t hold_type = {
    "kvf_hold_t", "kvf_hold_init", KVF_SIZED_SINCE_0_1_0, KVF_HOLD_SIZE_V0, HOLD_KNOWN};
static const kvf_sized_type_t remote_type = {
    "kvf_remote_t", "kvf_remote_init", KVF_SIZED_SINCE_0_1_0, KVF_REMOTE_SIZE_V0,
    REMOTE_KNOWN};
/* These two had no `size` in kvferry 0.1.0. */
static const kvf_sized_type_t failure_type = {
    "kvf_failure_t", "kvf_failure_init", KVF_SIZED_SINCE_SIZED, KVF_FAILURE_SIZE_V0,
    FAILURE_KNOWN};
static const kvf_sized_type_t stats_type = {
    "kvf_engine_stats_t", "kvf_engine_stats_init", KVF_SIZED_SINCE_SIZED,
    KVF_ENGINE_STATS_SIZE_V0, STATS_KNOWN};

/*
 * The structs whose every default is 0 (kvf_layout_t, kvf_dest_t,
 * kvf_hold_t, kvf_remote_t, and the records; a lease of 0 is resolved
 * where it is used).
 */
static const unsigned char zeros[SIZE_SANE];

void kvf_layout_init_sized(kvf_layout_t *layout, size_t size)
{
    kvf__sized_init(layout, size, zeros, &layout_type);
}

void (kvf_layout_init)(kvf_layout_t *layout)
{
    kvf_layout_init_sized(layout, KVF_LAYOUT_SIZE_V0);
}

kvf_status_t kvf__layout_import(kvf_layout_t *dst, const kvf_layout_t *src,
                                const char *fn, char *err, size_t errlen)
{
    return kvf__sized_import(dst, sizeof(*dst), src, NULL, &layout_type, fn, err, errlen);
}

void kvf_dest_init_sized(kvf_dest_t *dest, size_t size)
{
    kvf__sized_init(dest, size, zeros, &dest_type);
}

kvf_status_t kvf__dest_import(kvf_dest_t *dst, const kvf_dest_t *src, const char *fn,
                              char *err, size_t errlen)
{
    return kvf__sized_import(dst, sizeof(*dst), src, NULL, &dest_type, fn, err, errlen);
}

void kvf_hold_init_sized(kvf_hold_t *hold, size_t size)
{
    kvf__sized_init(hold, size, zeros, &hold_type);
}

kvf_status_t kvf__hold_import(kvf_hold_t *dst, const kvf_hold_t *src, const char *fn,
                              char *err, size_t errlen)
{
    return kvf__sized_import(dst, sizeof(*dst), src, NULL, &hold_type, fn, err, errlen);
}

void kvf_remote_init_sized(kvf_remote_t *remote, size_t size)
{
    kvf__sized_init(remote, size, zeros, &remote_type);
}

kvf_status_t kvf__remote_import(kvf_remote_t *dst, const kvf_remote_t *src, const char *fn,
                                char *err, size_t errlen)
{
    return kvf__sized_import(dst, sizeof(*dst), src, NULL, &remote_type, fn, err, errlen);
}

void kvf_failure_init_sized(kvf_failure_t *failure, size_t size)
{
    kvf__sized_init(failure, size, zeros, &failure_type);
}

kvf_status_t kvf__failure_export(kvf_failure_t *dst, const kvf_failure_t *src, const char *fn,
                                 char *err, size_t errlen)
{
    return kvf__sized_export(dst, src, &failure_type, fn, err, errlen);
}

void kvf_engine_stats_init_sized(kvf_engine_stats_t *stats, size_t size)
{
    kvf__sized_init(stats, size, zeros, &stats_type);
}

kvf_status_t kvf__engine_stats_export(kvf_engine_stats_t *dst, const kvf_engine_stats_t *src,
                                      const char *fn, char *err, size_t errlen)
{
    return kvf__sized_export(dst, src, &stats_type, fn, err, errlen);
}
