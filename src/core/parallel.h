/*
 * Parallel layouts: which prefill rank feeds which decode rank, with which
 * KV heads and which layers.  Pure functions of the two sides' parallel
 * coordinates, computed the same way on both sides, so that neither has to
 * tell the other how the room is split.
 *
 * Heads (MHA/GQA).  A rank of a side with TP size T holds H/T consecutive
 * KV heads when T <= H, or one head replicated T/H times when T > H (GQA
 * replication).  A decode rank takes each of its heads from the prefill
 * rank that holds it; among replicas it takes replica (d mod replicas), to
 * spread the load.  Heads a prefill rank sends to one decode rank are
 * always consecutive, so a slice is (first head, count).
 *
 * MLA.  Every rank holds the whole latent vector: decode rank d takes it
 * from prefill rank d mod P.
 *
 * Idle prefill ranks.  A prefill rank that feeds no decode rank still has
 * a sender for the room; decode rank (p mod D) tells it the room exists
 * with an empty destination, so it completes instead of timing out.
 *
 * Layers (PP).  Decode PP equal to prefill PP pairs stage with stage;
 * decode PP 1 takes every prefill stage's layers into its own buffers at
 * the stage's first layer.  Other combinations are refused.
 */
#ifndef KVF_CORE_PARALLEL_H
#define KVF_CORE_PARALLEL_H

#include <stddef.h>
#include <stdint.h>

#include "kvferry/kvferry.h"

#define KVF_MAX_SOURCES 64

/* "decode rank 1", with its stage and DP group where the server has more
 * than one (pp_size stages, dp_size groups): how failure reasons name a
 * rank.  @return buf. */
const char *kvf__rank_name(kvf_role_t role, int tp_rank, int pp_rank, int pp_size,
                           int dp_rank, int dp_size, char *buf, size_t len);

/* What both sides must know of a rank to plan a room. */
typedef struct kvf_par {
    int             tp_rank, tp_size;
    int             pp_rank, pp_size;
    kvf_attn_kind_t attn;
    uint32_t        total_heads;      /* MHA */
    uint32_t        heads_per_rank;   /* MHA */
    uint32_t        num_layers;       /* layers this rank holds */
    uint32_t        first_layer;      /* global index of its first layer */
    uint32_t        num_kv;           /* KV buffers */
} kvf_par_t;

/* The global heads rank r of TP size T holds: [*first_p, *first_p + *count_p). */
void kvf__rank_heads(uint32_t total_heads, int tp_size, int tp_rank,
                     uint32_t *first_p, uint32_t *count_p);

/*
 * Is this TP size valid for the model's heads?  KVF_OK, or
 * KVF_ERR_INCOMPATIBLE with a message naming the setting.
 */
kvf_status_t kvf__check_tp(const char *side, uint32_t total_heads, int tp_size,
                           uint32_t heads_per_rank, char *err, size_t errlen);

/* The prefill TP ranks that feed decode TP rank d, ascending.  @return count. */
int kvf__sources(kvf_attn_kind_t attn, uint32_t total_heads, int prefill_tp,
                 int decode_tp, int d, int *ranks);

/*
 * The prefill TP ranks decode rank d must tell about a room although they
 * send it nothing: those no decode rank takes anything from, and whose
 * rank is d modulo the decode TP size.  @return count.
 */
int kvf__idle_sources(kvf_attn_kind_t attn, uint32_t total_heads, int prefill_tp,
                      int decode_tp, int d, int *ranks);

/* What one prefill rank sends one decode rank. */
typedef struct kvf_slice {
    int      sliced;       /* 0: whole pages; 1: a run of heads, of each token
                              (NHD pages) or of each page (HND, kv_order) */
    uint32_t nheads;       /* heads in the run (sliced) */
    uint32_t src_head;     /* first of them, within the prefill rank's heads */
    uint32_t dst_head;     /* first of them, within the decode rank's heads */
} kvf_slice_t;

/*
 * Plan prefill rank `pre` -> decode rank `dec` (both kvf_par_t).
 * @return KVF_OK with *slice_p; KVF_ERR_NOT_FOUND when `pre` sends `dec`
 * nothing; KVF_ERR_INCOMPATIBLE with a message in err.
 */
kvf_status_t kvf__plan_slice(const kvf_par_t *pre, const kvf_par_t *dec,
                             kvf_slice_t *slice_p, char *err, size_t errlen);

/* Is the PP pairing supported?  KVF_OK or KVF_ERR_INCOMPATIBLE + message. */
kvf_status_t kvf__check_pp(const kvf_par_t *pre, const kvf_par_t *dec, char *err,
                           size_t errlen);

#endif /* KVF_CORE_PARALLEL_H */
