/*
 * Structs that grow (sized.c): how the library reads a caller's parameter
 * struct of any `size` (kvferry.h's growth rules) into a full-size copy of
 * its own, and writes a full-size record of its own into a caller's of
 * any `size`.  Computation on what it is handed: no lock, no engine.
 */
#ifndef KVF_CORE_SIZED_H
#define KVF_CORE_SIZED_H

#include <stddef.h>

#include "kvferry/kvferry.h"

/* One such struct: its names (for messages), and its sizes. */
typedef struct kvf_sized_type {
    const char *name;     /* "kvf_engine_params_t" */
    const char *init;     /* "kvf_engine_params_init" */
    const char *since;    /* its first version, for messages: KVF_SIZED_SINCE_* */
    size_t      v0;       /* KVF_..._SIZE_V0 */
    size_t      known;    /* the end of the last field this library knows */
} kvf_sized_type_t;

#define KVF_SIZED_SINCE_0_1_0 "kvferry 0.1.0"
#define KVF_SIZED_SINCE_SIZED "the first with a size, after kvferry 0.1.0"

/* Write the caller's `size` bytes at dst: the defaults in def (a full
 * struct) that fit, zero past the known fields, then `size` itself. */
void         kvf__sized_init(void *dst, size_t size, const void *def,
                             const kvf_sized_type_t *t);
/* Copy the caller's struct at src into dst (a full struct of dst_size
 * bytes), only the bytes this library knows; fields the caller's lacks
 * take what `defaults` writes (NULL: 0).  KVF_OK, or KVF_ERR_INVALID_PARAM
 * with a message naming `fn` and the sizes in err. */
kvf_status_t kvf__sized_import(void *dst, size_t dst_size, const void *src,
                               void (*defaults)(void *), const kvf_sized_type_t *t,
                               const char *fn, char *err, size_t errlen);
/* Write the full record at src into the caller's struct at dst, only
 * dst's `size` bytes (the known fields that fit, zero past them).
 * KVF_OK, or KVF_ERR_INVALID_PARAM with a message naming `fn` and the
 * sizes in err, and nothing written. */
kvf_status_t kvf__sized_export(void *dst, const void *src, const kvf_sized_type_t *t,
                               const char *fn, char *err, size_t errlen);
/* The milliseconds in environment variable `name` (1..86400000), else def
 * (warned when set and not that). */
unsigned     kvf__env_ms(const char *name, unsigned def);

/* The structs whose every default is 0, imported as above. */
kvf_status_t kvf__layout_import(kvf_layout_t *dst, const kvf_layout_t *src,
                                const char *fn, char *err, size_t errlen);
kvf_status_t kvf__dest_import(kvf_dest_t *dst, const kvf_dest_t *src, const char *fn,
                              char *err, size_t errlen);
kvf_status_t kvf__hold_import(kvf_hold_t *dst, const kvf_hold_t *src, const char *fn,
                              char *err, size_t errlen);
kvf_status_t kvf__remote_import(kvf_remote_t *dst, const kvf_remote_t *src, const char *fn,
                                char *err, size_t errlen);
/* The records, exported as above. */
kvf_status_t kvf__failure_export(kvf_failure_t *dst, const kvf_failure_t *src, const char *fn,
                                 char *err, size_t errlen);
kvf_status_t kvf__engine_stats_export(kvf_engine_stats_t *dst, const kvf_engine_stats_t *src,
                                      const char *fn, char *err, size_t errlen);
/* A held room's lease when kvf_hold_t leaves it 0: KVF_LEASE_MS, else
 * 480000. */
unsigned     kvf__lease_default(void);

#endif /* KVF_CORE_SIZED_H */
