/*
 * Layouts, internal: what an engine registered, or a peer said in its
 * HELLO, as the library keeps it (owned copies), and the checks that pair
 * a prefill rank's layout with a decode rank's (layout.c).  Everything
 * here is computation on the layouts it is handed: no lock, no engine.
 */
#ifndef KVF_CORE_LAYOUT_H
#define KVF_CORE_LAYOUT_H

#include <stddef.h>
#include <stdint.h>

#include "kvferry/kvferry.h"
#include "core/parallel.h"

/* An engine's (or a peer's) layout, owned copies. */
typedef struct kvf_layout_int {
    uint32_t        page_size;
    char            kv_dtype[64];
    kvf_attn_kind_t attn;
    kvf_mem_kind_t  mem_kind;           /* the KV buffers' (what HELLO carries) */
    kvf_mem_kind_t  aux_mem, state_mem; /* the aux and state buffers' */
    int             cuda_device;
    kvf_kv_order_t  kv_order;           /* how a KV page orders its heads and tokens */
    uint32_t        num_layers, first_layer;
    /* An engine that left its heads to its peers adopts a peer's (peer.c,
     * on_hello), total_heads atomically: kvf_receiver_create_remote reads
     * it without the lock. */
    uint32_t        heads_per_rank, total_heads, bytes_per_head;
    uint32_t        num_kv, num_aux, num_state;
    kvf_buffer_t   *kv, *aux, *state;   /* base NULL for a peer's layout */
    kvf_kv_tag_t   *tags;               /* what kv[i] holds (always set) */
    /* Layer slots (an engine's own layout): each (group, layer) its KV
     * buffers hold, in tag order, so that a group's range of layers is a
     * range of slots; kv_slot[i] is KV buffer i's.  What a per-layer send
     * names (kvf_sender_send_layers).  NULL for a peer's layout. */
    uint32_t        num_slots;
    kvf_kv_tag_t   *slots;              /* role 0 */
    uint32_t       *kv_slot;
    /* State groups: group g is state[group_first[g] .. group_first[g+1]);
     * a layout of plain state buffers has one group per buffer, type "".
     * Their types, joined by ',' (what HELLO carries). */
    uint32_t        num_groups;
    uint32_t       *group_first;        /* num_groups + 1 entries */
    char           *state_types;
} kvf_layout_int_t;

/* The state group of state buffer b. */
static inline uint32_t kvf__group_of(const kvf_layout_int_t *l, uint32_t b)
{
    uint32_t g = 0;
    while (g + 1 < l->num_groups && l->group_first[g + 1] <= b)
        g++;
    return g;
}

/* The slot of layer `layer` of group `group`, or UINT32_MAX: no KV
 * buffer of this layout holds it. */
uint32_t kvf__slot_of(const kvf_layout_int_t *l, uint32_t group, uint32_t layer);
/* "layer 3 V", "layer 0 K of group 1": a tag as messages name it. */
const char *kvf__tag_name(const kvf_kv_tag_t *t, char *buf, size_t len);

/* MHA: bytes per head per token of KV buffer i (each group's own).  The
 * same in either kv_order: an NHD page is [tokens][heads][bytes], an HND
 * page [heads][tokens][bytes]. */
static inline uint64_t kvf__head_bytes(const kvf_layout_int_t *l, uint32_t i)
{
    return l->kv[i].item_bytes / ((uint64_t)l->page_size * l->heads_per_rank);
}

/* Validate the caller's layout (read through kvf__layout_import, sized.h)
 * into dst, which owns copies of the buffer arrays. */
kvf_status_t kvf__layout_copy(kvf_layout_int_t *dst, const kvf_layout_t *src,
                              int may_omit_heads, char *err, size_t errlen);
void         kvf__layout_free(kvf_layout_int_t *l);
/* Write state group g's type into buf ("" for a plain state buffer). */
void         kvf__group_type(const kvf_layout_int_t *l, uint32_t g, char *buf, size_t len);
/* Buffer families, in the order of registration (reg_bases). */
enum { KVF_FAMILY_KV = 0, KVF_FAMILY_AUX = 1, KVF_FAMILY_STATE = 2 };
const char    *kvf__family_name(int family);          /* "KV", "aux", "state" */
kvf_mem_kind_t kvf__family_mem(const kvf_layout_int_t *l, int family);
/* Is any family device memory? */
int            kvf__layout_on_device(const kvf_layout_int_t *l);
/* Every buffer is the memory its family declares (the CUDA driver says);
 * why not in err.  @return KVF_OK, KVF_ERR_INVALID_PARAM (a mismatch),
 * KVF_ERR_UNSUPPORTED (CUDA memory declared and no driver). */
kvf_status_t   kvf__layout_check_memory(const kvf_layout_int_t *l, char *err, size_t errlen);
/* A decode layout that left its heads 0 takes them from a prefill peer's
 * (same model): heads_per_rank from its own TP size.  KVF_OK (also when
 * it has them), or KVF_ERR_INCOMPATIBLE when its buffers do not hold that
 * many heads. */
kvf_status_t kvf__layout_adopt_heads(kvf_layout_int_t *l, int tp_size,
                                     const kvf_layout_int_t *from, char *err,
                                     size_t errlen);
/* Which decode KV buffer each prefill KV buffer goes to, by tag:
 * dst_of[i] for prefill buffer i.  KVF_ERR_INCOMPATIBLE when one has no
 * match. */
kvf_status_t kvf__kv_map(const kvf_layout_int_t *pl, const kvf_layout_int_t *dl,
                         uint32_t *dst_of, char *err, size_t errlen);
/* Same model and settings on both sides (page size, dtype, attention,
 * heads, KV page order, aux, state)?  KVF_OK, or KVF_ERR_INCOMPATIBLE with an
 * SGLang-style message in err. */
kvf_status_t kvf__layout_check(const kvf_layout_int_t *prefill,
                               const kvf_layout_int_t *decode,
                               char *err, size_t errlen);
/* Can this prefill rank and this decode rank work together (the model
 * check above, TP and PP pairing, page sizes of the buffers it writes)?
 * Fills dst_of (pl->num_kv entries) as kvf__kv_map does. */
kvf_status_t kvf__pair_check(const kvf_layout_int_t *pl, const kvf_par_t *pp,
                             const kvf_layout_int_t *dl, const kvf_par_t *dp,
                             uint32_t *dst_of, char *err, size_t errlen);
void kvf__par_fill(kvf_par_t *par, int tp_rank, int tp_size, int pp_rank, int pp_size,
                   const kvf_layout_int_t *l);

/* layout_wire.c: a layout as HELLO carries it. */
struct kvf_wire_layout;
/* Encode l into w (its arrays allocated: kvf__layout_wire_free; its
 * strings point into l).  KVF_OK or KVF_ERR_NO_MEMORY. */
kvf_status_t kvf__layout_to_wire(const kvf_layout_int_t *l, struct kvf_wire_layout *w);
void         kvf__layout_wire_free(struct kvf_wire_layout *w);
/* A peer's layout from its HELLO, checked (KVF_ERR_PROTOCOL, or
 * KVF_ERR_NO_MEMORY, with why in err); kvf__layout_free frees it. */
kvf_status_t kvf__layout_from_wire(kvf_layout_int_t *l, const struct kvf_wire_layout *w,
                                   char *err, size_t errlen);

#endif /* KVF_CORE_LAYOUT_H */
