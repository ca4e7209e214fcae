/*
 * Engine descriptors (descriptor.c): one engine's address, instance and
 * layout summary as a line of text (kvf_engine_descriptor), parsed back
 * by a decode engine that reaches it without a registry.
 */
#ifndef KVF_CORE_DESCRIPTOR_H
#define KVF_CORE_DESCRIPTOR_H

#include <sys/socket.h>

#include "kvferry/kvferry.h"

typedef struct kvf_descriptor {
    uint64_t        instance;          /* the engine's instance id, never 0 */
    char            addr[KVF_ADDR_MAX];
    char            host[KVF_ADDR_MAX];   /* numeric, without brackets */
    int             port;
    struct sockaddr_storage sa;          /* host, port 0 */
    kvf_role_t      role;
    int             tp_rank, tp_size;
    int             pp_rank, pp_size;
    int             dp_rank, dp_size;
    uint32_t        page_size;
    char            dtype[64];
    kvf_attn_kind_t attn;
    uint32_t        total_heads;       /* 0: the engine leaves them to its peers */
} kvf_descriptor_t;

/* Parse one descriptor.  @return KVF_OK, or KVF_ERR_INVALID_PARAM with
 * what is wrong in err. */
kvf_status_t kvf__descriptor_parse(const char *text, kvf_descriptor_t *d, char *err,
                                   size_t errlen);

/*
 * The descriptor sets a decode engine was given lately, with what it made
 * of each (kvf_receiver_create_remote: the prefill ranks to read from),
 * so that a set seen again is not parsed and checked again: a decode
 * engine reads from the same few prefill servers, request after request.
 * A set is the text of its descriptors, in the order given, and the heads
 * the engine knew then; a descriptor names its engine's instance, so a
 * prefill that restarted is a new set.  The engine's remote_lock, a leaf,
 * guards them; they are read and filled without the engine lock.
 */
#define KVF_REMOTE_SEEN 8

typedef struct kvf_remote_seen {
    uint64_t hash;
    char    *key;         /* the heads, then each descriptor and its NUL */
    size_t   key_len;
    void    *value;       /* what the caller made of the set */
    size_t   value_len;
} kvf_remote_seen_t;

/* What was made of this set, copied into out (at most cap bytes): its
 * length, or 0 when the set was not seen lately. */
size_t kvf__remote_seen_get(kvf_engine_t *eng, const char *const *descs, size_t n,
                            uint32_t heads, void *out, size_t cap);
/* Keep what was made of this set (len bytes), in place of the set kept
 * longest; without memory, nothing is kept. */
void   kvf__remote_seen_put(kvf_engine_t *eng, const char *const *descs, size_t n,
                            uint32_t heads, const void *value, size_t len);
/* At engine destroy, after its threads stopped. */
void   kvf__remote_seen_free_unlocked(kvf_engine_t *eng);

#endif /* KVF_CORE_DESCRIPTOR_H */
