/*
 * Options of `kvferry demo`, `kvferry bench` and of their `_rank` processes.
 *
 * One table describes every option once: the parser, the usage text and the
 * argv the orchestrator hands to each rank process are all generated from
 * it, so a new option (--fault, --prefill-pp, ...) is one table row plus a
 * struct field, and the ranks can never disagree with the orchestrator on
 * a default: the orchestrator resolves defaults and forwards every value
 * explicitly.
 */
#ifndef KVT_OPTS_H
#define KVT_OPTS_H

#include <stdint.h>
#include <stdio.h>

typedef struct kvt_opts {
    const char *model;
    uint32_t    requests;
    uint32_t    tokens;
    uint32_t    chunk;             /**< 0: all tokens in one send */
    uint32_t    page_size;
    uint32_t    decode_page_size;  /**< 0: same as page_size */
    const char *kv_dtype;
    const char *decode_kv_dtype;   /**< NULL: same as kv_dtype */
    const char *kv_order;          /**< KV page order on prefill: "nhd" or "hnd" */
    const char *decode_kv_order;   /**< NULL: same as kv_order */
    uint32_t    prefill_tp;
    uint32_t    decode_tp;
    uint32_t    prefill_pp;        /**< pipeline stages on prefill */
    uint32_t    decode_pp;         /**< on decode: prefill_pp or 1 (others are refused) */
    uint32_t    dp;                /**< prefill DP groups; room r goes to r % dp */
    uint32_t    concurrency;
    uint64_t    seed;
    uint32_t    timeout;           /**< seconds */
    int         checksum;
    const char *transport;         /**< NULL: the engine's default */
    uint32_t    streams;           /**< tcp streams per peer pair; 0: the engine's default */
    const char *busy_poll;         /**< microseconds, every engine; NULL: the engine's
                                        default (KVF_BUSY_POLL_US) */
    const char *decode_busy_poll;  /**< the decode engines'; NULL: busy_poll */
    int         contiguous;        /**< decode pages contiguous, not scattered */
    int         json;
    /* bench */
    const char *pattern;           /**< "contiguous" or "scattered"; sets contiguous */
    uint32_t    duration;          /**< seconds; 0: run --requests rooms */
    int         verify;            /**< decode checks every byte, off the figures */
    int         bench;             /**< _rank: run the bench loop (bench_rank.c) */
    int         relay;             /**< bench: prefill rank 0 aborts every room after
                                        its first chunk; time the failure's relay */
    int         spin;              /**< bench: poll without sleeping between passes */
    const char *plot;              /**< bench: draw the figures into this PNG (plot.h) */
    const char *baselines;         /**< bench: bench/baselines.sh's JSON, for --plot */
    /* demo: faults (fault.h) */
    const char *fault;             /**< "KIND@WHEN", or NULL */
    uint32_t    after_fault_requests;  /**< fresh rooms after the fault */
    const char *hold;              /**< _rank: pause after this phase until "resume" */
    const char *faults;            /**< _rank: the engine's `faults` spec */
    /* _rank only */
    const char *role;              /**< "prefill" or "decode" */
    uint32_t    rank;              /**< process index within its side (kvt_opts_coord) */
    const char *registry;          /**< "host:port" */
} kvt_opts_t;

typedef enum kvt_opts_mode {
    KVT_OPTS_DEMO,   /**< `kvferry demo`: public options */
    KVT_OPTS_BENCH,  /**< `kvferry bench`: public options */
    KVT_OPTS_RANK    /**< `kvferry _rank`: forwarded options + rank identity */
} kvt_opts_mode_t;

/** The defaults of a command (bench has its own sizes). */
void kvt_opts_defaults(kvt_opts_t *o, kvt_opts_mode_t mode);

/**
 * Parse argv[first..argc).  An unknown option or a bad value prints a
 * message to stderr and returns -1 (the caller exits 2).  "--help" returns 1.
 */
int kvt_opts_parse(kvt_opts_t *o, kvt_opts_mode_t mode, int argc,
                   char **argv, int first);

/** Fill derived defaults and check consistency; -1 with a message printed. */
int kvt_opts_resolve(kvt_opts_t *o, kvt_opts_mode_t mode);

/** Print the option list of a command, with the defaults in `defaults`. */
void kvt_opts_usage(FILE *out, kvt_opts_mode_t mode, const kvt_opts_t *defaults);

/**
 * The busy polling (kvf_engine_params_t.busy_poll_us) a side's engines
 * are given: 1 and *us_p set, 0 for the engine's default, or -1 for a
 * value that is not 0..1000000 (kvt_opts_resolve refuses it).
 */
int kvt_opts_busy_poll(const kvt_opts_t *o, int prefill, unsigned *us_p);

/** A rank process's parallel coordinates. */
typedef struct kvt_coord {
    uint32_t dp, pp, tp;
} kvt_coord_t;

/**
 * Rank processes of a side: dp x prefill_pp x prefill_tp on prefill,
 * decode_pp x decode_tp on decode (one decode DP group).
 */
uint32_t kvt_opts_nranks(const kvt_opts_t *o, int prefill);

/**
 * The coordinates of process `index` of a side:
 * index = (dp * pp_size + pp) * tp_size + tp, so TP ranks of one stage are
 * neighbours and index 0 is dp 0, pp 0, tp 0.
 */
kvt_coord_t kvt_opts_coord(const kvt_opts_t *o, int prefill, uint32_t index);

/**
 * The forwarded options of `o` as a malloc'd argv fragment (every value
 * explicit, NULL-terminated), for a rank process.  Free with
 * kvt_opts_argv_free().  NULL when out of memory.
 */
char **kvt_opts_argv(const kvt_opts_t *o);
void kvt_opts_argv_free(char **argv);

#endif /* KVT_OPTS_H */
