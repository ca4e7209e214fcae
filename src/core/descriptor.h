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

#endif /* KVF_CORE_DESCRIPTOR_H */
