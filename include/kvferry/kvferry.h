/*
 * kvferry — move LLM KV cache from prefill servers to decode servers, one
 * request ("room") at a time, and turn every failure into an explicit,
 * per-room error with its root cause on every rank involved.
 *
 * Objects
 *   kvf_engine_t    one per rank (one GPU's worth of KV): role, parallel
 *                   coordinates, registered layout, a progress thread.
 *   kvf_sender_t    one room on a prefill rank.
 *   kvf_receiver_t  one room on a decode rank.
 *   kvf_bootstrap_t a bootstrap registry (HTTP) server, SGLang-compatible.
 *
 * Threads
 *   Every function is thread-safe and never waits on a peer, a socket or a
 *   deadline unless its comment says otherwise (kvf_*_await_failure waits
 *   by design; a destroy of a room not yet final waits for reads into its
 *   pages, bounded by their deadline).  kvf_sender_create(),
 *   kvf_sender_create_held(), kvf_receiver_create(),
 *   kvf_receiver_create_remote(), kvf_sender_init(),
 *   kvf_sender_decode_prefix_len(),
 *   kvf_sender_set_states(), kvf_sender_send(), kvf_sender_send_layers(),
 *   kvf_receiver_set_dest()
 *   (and the _init and set_state forms), kvf_*_poll(), kvf_*_failure(),
 *   kvf_*_metric(), kvf_*_abort(), kvf_*_fail() and the destroy of a
 *   room that is final with its pages released take no engine lock: a
 *   create claims the room id under a lock of the ids alone, and these
 *   calls publish their work for the progress threads; a poll reads one
 *   atomic, a failure read a record fixed once the room failed (under the
 *   room's own lock), a metric the room's atomics; so a scheduler may call
 *   them for thousands of rooms in each step.  A call that publishes finds
 *   a progress thread awake or wakes one (a system call, a few
 *   microseconds); with kvf_engine_params_t.busy_poll_us they stay awake
 *   after their work.  kvf_*_await_failure() on a room already FAILED
 *   takes none either.
 *   Other calls take the engine lock for their bookkeeping, which the
 *   engine's threads hold only for bounded passes, so such a call may wait
 *   for the rest of one pass (docs/ARCHITECTURE.md, docs/BENCHMARKS.md
 *   "Application calls against a null call").  All network I/O happens on the
 *   engine's own threads.  A handle must not be used concurrently with, or
 *   after, its destroy call.
 *
 * Errors
 *   Functions return kvf_status_t (status.h): KVF_OK or a negative code.
 *   Output arguments (suffix _p) are written only on KVF_OK.  A room that
 *   fails does not make any call fail: its poll state becomes
 *   KVF_POLL_FAILED and kvf_*_failure() returns its failure record.
 */
#ifndef KVFERRY_KVFERRY_H
#define KVFERRY_KVFERRY_H

#include <stddef.h>
#include <stdint.h>

#include "kvferry/status.h"
#include "kvferry/version.h"   /* generated: KVF_VERSION_MAJOR/MINOR/PATCH */

#ifdef __cplusplus
extern "C" {
#endif

#if defined(KVF_BUILDING_LIBRARY)
#define KVF_API __attribute__((visibility("default")))
#else
#define KVF_API
#endif

/** @return the library version as "MAJOR.MINOR.PATCH" (static string). */
KVF_API const char *kvf_version(void);

/** @return the transports this build has, e.g. "tcp shm ucx(1.13.1)" with
 *  the UCX library's version (static). */
KVF_API const char *kvf_transports(void);

/** @return the symbolic name of a status, e.g. "KVF_ERR_TIMED_OUT" (static). */
KVF_API const char *kvf_status_name(kvf_status_t status);

/** @return a one-line description of a status (static, thread-safe). */
KVF_API const char *kvf_status_str(kvf_status_t status);

/* ------------------------------------------------------------------------ */
/* Roles, poll states, failure records                                      */
/* ------------------------------------------------------------------------ */

typedef enum kvf_role {
    KVF_ROLE_PREFILL = 0,
    KVF_ROLE_DECODE  = 1
} kvf_role_t;

/** @return "prefill" or "decode" (static). */
KVF_API const char *kvf_role_name(kvf_role_t role);

/**
 * Poll state of a room.  The order is total and a room only moves up,
 * except that FAILED overrides everything: a scheduler may take the MIN
 * over its TP ranks and every rank agrees.  Values match SGLang's KVPoll.
 */
typedef enum kvf_poll {
    KVF_POLL_FAILED            = 0,
    KVF_POLL_BOOTSTRAPPING     = 1,
    KVF_POLL_WAITING_FOR_INPUT = 2,
    KVF_POLL_TRANSFERRING      = 3,
    KVF_POLL_SUCCESS           = 4
} kvf_poll_t;

/** @return "Failed", "Bootstrapping", ... (static). */
KVF_API const char *kvf_poll_name(kvf_poll_t state);

/*
 * Structs that grow without breaking callers, the way UCX's and libuv's
 * do: the parameter structs the library reads (kvf_engine_params_t,
 * kvf_layout_t, kvf_hold_t, kvf_dest_t, kvf_remote_t) and the records it
 * fills (kvf_failure_t, kvf_engine_stats_t):
 *   - fields are only added at the end; no field ever moves or changes type;
 *   - the caller states its struct's size: set `size` with the init
 *     function (a macro passing sizeof(*p), so it is your header's size);
 *   - the library reads and writes only `size` bytes: parameter fields
 *     past your size take their defaults, record fields past it are not
 *     written;
 *   - a parameter field added later reads 0 as "the default", so that a
 *     caller built against a newer header runs on an older library as long
 *     as it leaves the newer fields at 0; a record's bytes past the fields
 *     the library knows are written as 0;
 *   - a size below the struct's first version (KVF_*_SIZE_V0), or a
 *     parameter struct's that reaches past the fields this library knows
 *     with any of those bytes nonzero, is refused with
 *     KVF_ERR_INVALID_PARAM and a message naming the function and the
 *     sizes (kvf_last_error()).
 */

/** The offset just past `field` in `type`: the least `size` that holds it. */
#define KVF_FIELD_END(type, field) \
    (offsetof(type, field) + sizeof(((type *)0)->field))

#define KVF_REASON_MAX 512
#define KVF_ADDR_MAX   64

/**
 * Why a room failed.  The first root cause wins: a consequence seen later
 * (a reset connection after the peer already reported the failure, say)
 * never overwrites it.  Initialise with kvf_failure_init() before
 * kvf_sender_failure()/kvf_receiver_failure() fill it; grows by the rules
 * above.
 */
typedef struct kvf_failure {
    size_t       size;               /**< the caller's sizeof(kvf_failure_t); set by _init */
    kvf_status_t status;             /**< what went wrong, as a code */
    kvf_role_t   origin_side;        /**< side of the rank that saw the root cause */
    int          origin_rank;        /**< its tp rank */
    char         origin_addr[KVF_ADDR_MAX]; /**< its control address host:port */
    int          from_another_rank;  /**< 1 if this rank only learned of it from a peer */
    char         reason[KVF_REASON_MAX];    /**< human-readable root cause */
    /* Fields added later go here, at the end, so that `size` tells them apart. */
} kvf_failure_t;

/** kvf_failure_t as its first sized version has it: the least `size` accepted. */
#define KVF_FAILURE_SIZE_V0 KVF_FIELD_END(kvf_failure_t, reason)

/**
 * Zero the first `size` bytes of `failure` and set failure->size = size.
 * Writes nothing past `size`; a size below KVF_FAILURE_SIZE_V0 is logged
 * and the failure getters refuse the struct.  Call it through the
 * kvf_failure_init() macro, which passes your sizeof.
 *
 * @param [out] failure  the caller's struct, at least `size` bytes
 * @param [in]  size     sizeof the caller's kvf_failure_t
 */
KVF_API void kvf_failure_init_sized(kvf_failure_t *failure, size_t size);
#define kvf_failure_init(failure) kvf_failure_init_sized((failure), sizeof(*(failure)))

/* ------------------------------------------------------------------------ */
/* Engine                                                                   */
/* ------------------------------------------------------------------------ */

typedef struct kvf_engine   kvf_engine_t;
typedef struct kvf_sender   kvf_sender_t;
typedef struct kvf_receiver kvf_receiver_t;

/**
 * Engine parameters.  Initialise with kvf_engine_params_init(), which sets
 * every default (several come from KVF_* environment variables), then
 * override what you need.  Grows by the rules above.
 */
typedef struct kvf_engine_params {
    size_t      size;          /**< the caller's sizeof(kvf_engine_params_t); set by _init */
    kvf_role_t  role;          /**< default KVF_ROLE_PREFILL */
    int         tp_rank;       /**< default 0 */
    int         tp_size;       /**< default 1 */
    int         pp_rank;       /**< default 0 */
    int         pp_size;       /**< default 1 */
    int         dp_rank;       /**< default 0 */
    int         dp_size;       /**< default 1 */
    const char *host;          /**< address to bind and advertise; default "127.0.0.1" (KVF_HOST) */
    int         port;          /**< control port; default 0 = any free port */
    /**
     * Prefill: the registry this engine registers with, "host:port"; NULL:
     * none, decode engines reach this one by its descriptor
     * (kvf_engine_descriptor, kvf_receiver_create_remote).  Decode: unused
     * (each receiver names its own).  Default NULL.
     */
    const char *bootstrap_addr;
    /**
     * Prefill only: run the registry in-process, listening on
     * bootstrap_addr (its port may be 0: the chosen one is then reported by
     * kvf_engine_bootstrap_addr()).  Default 0.
     */
    int         host_bootstrap;
    /**
     * "auto" (on this host cuda when both sides' KV is GPU memory, else
     * shm; else ucx when built and both sides have it; else tcp, GPU
     * memory staged through pinned host memory), "tcp", "shm", "ucx" or
     * "cuda" (a preference: tcp when it cannot be used, said once in the
     * log).  Default "auto" (KVF_TRANSPORT).
     */
    const char *transport;
    int         checksum;      /**< 1: XXH3 end-to-end checksums; default 0 (KVF_CHECKSUM) */
    /** Deadlines, in milliseconds: no progress for that long fails the room. */
    unsigned    bootstrap_timeout_ms;   /**< default 30000 (KVF_BOOTSTRAP_TIMEOUT_MS) */
    unsigned    waiting_timeout_ms;     /**< default 300000 (KVF_WAITING_TIMEOUT_MS) */
    unsigned    transfer_timeout_ms;    /**< default 30000 (KVF_TRANSFER_TIMEOUT_MS) */
    unsigned    heartbeat_interval_ms;  /**< default 500 (KVF_HEARTBEAT_INTERVAL_MS) */
    unsigned    heartbeat_timeout_ms;   /**< default 2500 (KVF_HEARTBEAT_TIMEOUT_MS) */
    /**
     * Faults to inject, for testing failure handling: a spec such as
     * "reset@1048576" or "corrupt@4096,drop-ack" (docs/FAILURES.md).
     * Default NULL = none (KVF_FAULTS).
     */
    const char *faults;
    /* ---- added after 0.1.0 (a caller's smaller size gets the default) ---- */
    /**
     * A connection that has not finished its handshake (connect, HELLO,
     * the transport choice) this many milliseconds after it began is
     * closed, and its rooms fail as for an unreachable peer.  0 means the
     * default: 5000 (KVF_HANDSHAKE_TIMEOUT_MS).
     */
    unsigned    handshake_timeout_ms;
    /**
     * The cluster token: every engine of a deployment holds the same one,
     * and a peer is trusted only once it has proved, in the handshake,
     * that it holds it (docs/SECURITY.md).  NULL or "" means the default:
     * KVF_AUTH_TOKEN, else the contents of the file KVF_AUTH_TOKEN_FILE,
     * else SGLANG_DISAGGREGATION_BOOTSTRAP_AUTH_TOKEN, else none.  Without
     * a token the engine accepts peers on the loopback interface only, and
     * refuses to listen on another address unless KVF_AUTH=none is set
     * (protected mode).  Copied at create.  Default NULL.
     */
    const char *auth_token;
    /*
     * What a prefill engine tells its bootstrap registry beyond its
     * coordinates: the fields of SGLang's PUT /route that SGLang's decode
     * servers and routers read (docs/REGISTRY.md).  Set them from the
     * prefill server's real configuration (SGLang's server_args); decode
     * engines ignore them.
     */
    /** Attention context-parallel rank (SGLang's attn_cp_rank), below
     *  cp_size.  Default 0. */
    int         cp_rank;
    /** Attention context-parallel size (SGLang's attn_cp_size).  0 means the
     *  default: 1.  kvferry's own decode engines take KV from CP rank 0. */
    int         cp_size;
    /**
     * How dp_rank/dp_size are registered.  0 (default): system DP, one
     * scheduler per DP group (SGLang without --enable-dp-attention):
     * system_dp_size = dp_size, attn_dp_size = 1.  1: attention DP (SGLang's
     * --enable-dp-attention): attn_dp_size = dp_size, system_dp_size = 1.
     * Either way the registry's dp_size and a rank's DP group are dp_size and
     * dp_rank.
     */
    int         dp_attention;
    /**
     * The KV cache dtype as the prefill server was told it, e.g. "auto" or
     * "fp8_e4m3" (SGLang's --kv-cache-dtype): SGLang's decode servers refuse
     * a prefill server whose string differs from their own.  At most 63
     * printable characters without spaces.  NULL or "" means the default:
     * KVF_KV_CACHE_DTYPE, else the layout's kv_dtype.  Copied at create.
     */
    const char *kv_cache_dtype;
    /**
     * SGLang's --load-balance-method of the prefill server: decode servers
     * read "follow_bootstrap_room" as "the DP group is bootstrap_room %
     * dp_size" and anything else as "ask POST /query_dp_ranks".  Same
     * character rules as kv_cache_dtype.  NULL or "" means the default:
     * KVF_LOAD_BALANCE_METHOD, else "follow_bootstrap_room" (what SGLang's
     * prefill servers resolve "auto" and "round_robin" to).  Copied at
     * create.
     */
    const char *load_balance_method;
    /**
     * The prefill server's HTTP API port (SGLang's --port), which decode
     * servers call to have a retracted request recomputed.  0 means the
     * default: KVF_PREFILL_HTTP_PORT, else not known (registered as null).
     */
    int         prefill_http_port;
    /** 1: the prefill server runs SGLang's --enable-dsa-cache-layer-split
     *  (decode servers then take KV from every CP rank).  Default 0. */
    int         dsa_cache_layer_split;
    /**
     * Streams per peer pair for tcp payload: one connection each, every
     * one authenticated, and one progress thread (lane) per stream in
     * this engine, so that one large room uses more than one core.  A
     * pair uses the smaller of its two engines' settings (1 with a peer
     * whose build has no streams); shm and ucx peers use one (shm copies
     * on its own threads, KVF_SHM_COPIERS).  1..8; 0 means the default:
     * KVF_STREAMS, else a quarter of the CPUs, at least 1 and at most 4.
     */
    unsigned    streams;
    /**
     * The cluster token's last source, used when auth_token and the
     * variables give none: SGLang's --api-key, which SGLang's bootstrap
     * falls back to (kvf_auth_token_resolve() gives the whole order).
     * NULL or "" means none.  Copied at create, never kept.  Default NULL.
     */
    const char *api_key;
    /**
     * SGLang's --disaggregation-decode-allocation-policy of the prefill
     * server ("early" or "prefill_complete": decode servers then allocate
     * a room's pages only once the prefill has computed it), registered
     * as decode_allocation_policy in PUT /route and answered in GET /route
     * (docs/REGISTRY.md).  Same character rules as kv_cache_dtype.  NULL
     * or "" means not registered (older SGLang: "early").  Copied at
     * create.  Default NULL.
     */
    const char *decode_allocation_policy;
    /**
     * Serve this engine's metrics (kvf_engine_metrics, Prometheus text
     * format) over HTTP, GET /metrics, on "host:port" (port 0: any free
     * one; kvf_engine_metrics_addr says which), or "host:port+": the port
     * plus this rank's index in its server, (dp_rank * pp_size + pp_rank)
     * * tp_size + tp_rank, so that one setting serves every rank of a
     * server on ports a scrape config can list.  Its own listener and
     * thread (libmicrohttpd), apart from the control port.  Bound like the
     * bootstrap registry: a host that is not a loopback address needs a
     * cluster token (see auth_token) unless KVF_AUTH=none (protected mode);
     * scrapes are read-only and need no token.  NULL or "" means the
     * default: KVF_METRICS_ADDR, else no endpoint.  Copied at create.
     */
    const char *metrics_addr;
    /**
     * Write the room trace: one JSON line per room event (created,
     * resolved, connected, destination, state, chunk queued and completed,
     * done, ack, failed, watch sent and received, destroyed) with the room
     * id, this rank and a monotonic and a wall-clock time stamp
     * (docs/OPERATIONS.md; `kvferry trace` merges the ranks' lines into
     * one timeline).  A file path (opened for appending, created with mode
     * 0600: the lines name rooms and peers, never KV bytes), or "fd:N" for
     * a descriptor the application opened (the engine writes to it, never
     * closes it).  Several engines, in one process or several, may share
     * one file: each line is one write() in append mode.  When off, the
     * engine does nothing for it but test one field.  NULL or "" means the
     * default: KVF_TRACE, else off.  Read at create.
     */
    const char *trace;
    /**
     * Busy polling, in microseconds: after a pass that had work (an event,
     * or work an application call published) while the engine has rooms,
     * each progress thread keeps polling for this long before it sleeps,
     * yielding its CPU between polls.  While it does, the calls that
     * publish work (the creates, inits, sends and set_dest) find it awake
     * and make no system call, and a small room is not held up by waking
     * a thread; the price is a CPU per progress thread while rooms come
     * and go.  0 (the default unless KVF_BUSY_POLL_US says otherwise):
     * sleep at once, and a call that finds every progress thread asleep
     * wakes one (a few microseconds).  At most 1000000 (docs/GUIDE.md,
     * "Busy polling").
     */
    unsigned    busy_poll_us;
} kvf_engine_params_t;

/** kvf_engine_params_t as kvferry 0.1.0 has it: the least `size` accepted. */
#define KVF_ENGINE_PARAMS_SIZE_V0 KVF_FIELD_END(kvf_engine_params_t, faults)

/**
 * Fill the first `size` bytes of `params` with the defaults documented
 * above and set params->size = size.  Writes nothing past `size`; fields
 * that do not fit in it are left out (the library gives them their
 * defaults), bytes past the fields this library knows are zeroed.  A size
 * below KVF_ENGINE_PARAMS_SIZE_V0 is logged (kvf_last_error()), the bytes
 * zeroed and kvf_engine_create() refuses the struct.  Call it through the
 * kvf_engine_params_init() macro, which passes your sizeof.
 *
 * @param [out] params  the caller's struct, at least `size` bytes
 * @param [in]  size    sizeof the caller's kvf_engine_params_t
 */
KVF_API void kvf_engine_params_init_sized(kvf_engine_params_t *params, size_t size);

/**
 * Fill `params` with the defaults, for a struct of this header's size.
 * The function of the same name is still exported, for callers built
 * against kvferry 0.1.0 and for dlsym()/ctypes: it takes the size to be
 * KVF_ENGINE_PARAMS_SIZE_V0.
 */
KVF_API void (kvf_engine_params_init)(kvf_engine_params_t *params);
#define kvf_engine_params_init(params) \
    kvf_engine_params_init_sized((params), sizeof(*(params)))

/**
 * Create an engine: bind its control port and start its progress thread.
 * May block briefly (bind, thread start); never on the network.
 *
 * @param [in]  params    parameters, read up to params->size; strings are
 *                        copied
 * @param [out] engine_p  the new engine
 * @return KVF_OK, KVF_ERR_INVALID_PARAM (with a log line saying which,
 *         including a `size` the growth rules above refuse, a token that
 *         cannot be read, and a host other than loopback without a cluster
 *         token unless KVF_AUTH=none: see auth_token),
 *         KVF_ERR_IO (bind failed), KVF_ERR_NO_MEMORY, KVF_ERR_UNSUPPORTED.
 */
KVF_API kvf_status_t kvf_engine_create(const kvf_engine_params_t *params,
                                       kvf_engine_t **engine_p);

/**
 * Destroy an engine: fail and free every room still attached, close every
 * connection, stop its threads.  Blocks until its threads have stopped.
 * Senders and receivers must be destroyed first.
 */
KVF_API void kvf_engine_destroy(kvf_engine_t *engine);

/** Write the engine's control address "host:port" into buf (NUL-terminated). */
KVF_API kvf_status_t kvf_engine_address(const kvf_engine_t *engine,
                                        char *buf, size_t len);

/**
 * Write the address of the in-process registry ("host:port") into buf.
 * @return KVF_ERR_STATE when this engine hosts no registry.
 */
KVF_API kvf_status_t kvf_engine_bootstrap_addr(const kvf_engine_t *engine,
                                               char *buf, size_t len);

/**
 * The transports this engine's peers have used for payload: "tcp", "shm",
 * "ucx", or a combination such as "tcp+shm"; before any peer, the
 * `transport` parameter.  Valid while the engine lives.
 */
KVF_API const char *kvf_engine_transport(const kvf_engine_t *engine);

/**
 * The address of the engine's metrics endpoint ("host:port",
 * kvf_engine_params_t.metrics_addr, its port resolved) into buf.
 * @return KVF_OK, KVF_ERR_STATE (the engine serves no endpoint),
 *         KVF_ERR_INVALID_PARAM (buf NULL or too short).
 */
KVF_API kvf_status_t kvf_engine_metrics_addr(const kvf_engine_t *engine, char *buf,
                                             size_t len);

/** The engine's 64-bit instance id: random, new at every kvf_engine_create. */
KVF_API uint64_t kvf_engine_instance_id(const kvf_engine_t *engine);

/** The most bytes kvf_engine_descriptor() writes, its NUL included. */
#define KVF_DESCRIPTOR_MAX 512

/**
 * The engine's descriptor: what a decode engine needs to reach this
 * engine without a registry (kvf_receiver_create_remote), as one line of
 * printable ASCII without quotes or backslashes, so that it travels as a
 * JSON string (vLLM's kv_transfer_params).  It names the engine's
 * instance, its control address, role, parallel coordinates and a
 * summary of its layout; docs/PROTOCOL.md gives the format.  Treat it as
 * opaque: it is checked again by the handshake, never trusted instead of
 * it.  Any thread, once the layout is registered.
 *
 * @return KVF_OK, KVF_ERR_STATE (no layout registered yet),
 *         KVF_ERR_INVALID_PARAM (buf NULL or len below what it needs;
 *         KVF_DESCRIPTOR_MAX always suffices), KVF_ERR_UNSUPPORTED (the
 *         engine's host is a name, or an address peers cannot dial: the
 *         wildcard in any spelling, multicast, broadcast, link-local IPv6,
 *         docs/PROTOCOL.md section 7; a kv_dtype of other characters than
 *         letters, digits, '_', '-' and '.').
 */
KVF_API kvf_status_t kvf_engine_descriptor(const kvf_engine_t *engine, char *buf,
                                           size_t len);

/* ------------------------------------------------------------------------ */
/* Layout                                                                   */
/* ------------------------------------------------------------------------ */

typedef enum kvf_attn_kind {
    KVF_ATTN_MHA = 0,   /**< MHA/GQA: per-rank slice of KV heads */
    KVF_ATTN_MLA = 1    /**< MLA: every rank holds the full latent vector */
} kvf_attn_kind_t;

/**
 * What memory a family of buffers is (kvf_layout_t: mem_kind for KV,
 * aux_mem_kind, state_mem_kind).  Registration asks the CUDA driver, when
 * one is installed, what each buffer really is, and refuses a buffer that
 * is not what its family declares.
 */
typedef enum kvf_mem_kind {
    KVF_MEM_HOST = 0,   /**< host memory (pageable or pinned) */
    /**
     * Device memory of CUDA device kvf_layout_t.cuda_device.  Moved by the
     * cuda mover between two processes on one host (CUDA IPC), staged
     * through pinned host buffers over tcp between hosts or with a host-
     * memory peer, or by ucx when its build has CUDA support.  Needs a
     * kvferry built with CUDA (KVF_CUDA) and the CUDA driver at run time.
     */
    KVF_MEM_CUDA = 1
} kvf_mem_kind_t;

/**
 * How an MHA/GQA KV page orders its bytes (kvf_layout_t.kv_order).  A page
 * of a KV buffer holds page_size tokens of heads_per_rank heads of
 * bytes_per_head bytes each:
 */
typedef enum kvf_kv_order {
    /** Token-major, [page_size tokens][heads_per_rank heads][bytes_per_head]:
     *  token t's head h at (t * heads_per_rank + h) * bytes_per_head (SGLang's
     *  layout, vLLM's "NHD").  The default. */
    KVF_KV_NHD = 0,
    /** Head-major, [heads_per_rank heads][page_size tokens][bytes_per_head]:
     *  token t's head h at (h * page_size + t) * bytes_per_head (vLLM's "HND"):
     *  the heads one TP rank sends another are one contiguous piece of the
     *  page. */
    KVF_KV_HND = 1
} kvf_kv_order_t;

/** One registered buffer: `length` bytes at `base`, cut into items. */
typedef struct kvf_buffer {
    void  *base;
    size_t length;         /**< bytes; a whole number of items */
    size_t item_bytes;     /**< bytes per page (KV) or per slot (aux, state) */
} kvf_buffer_t;

/** What a KV buffer holds of its layer (kvf_kv_tag_t.role). */
typedef enum kvf_kv_role {
    KVF_KV_K  = 0,   /**< keys (MHA/GQA) */
    KVF_KV_V  = 1,   /**< values (MHA/GQA) */
    KVF_KV_KV = 2    /**< the layer's one buffer: MLA's latent vector, or K and V together */
} kvf_kv_role_t;

/**
 * Which KV buffer this is, so that each prefill buffer finds its decode
 * buffer whatever order the two sides register them in: a prefill buffer
 * goes to the decode buffer with the same tag.
 */
typedef struct kvf_kv_tag {
    uint32_t layer;   /**< the layer's global index in its group (0 = the model's first) */
    uint32_t role;    /**< kvf_kv_role_t; larger values name further per-layer
                           buffers, the same on both sides */
    uint32_t group;   /**< 0: the model; 1, 2, ...: another model whose KV lives
                           in the same pages (a speculative-decoding draft model) */
} kvf_kv_tag_t;

/**
 * Typed state (SGLang's StateType): a group of buffers that a room names
 * by one array of indices, the same indices in each of its buffers.  A
 * Mamba group names one slot (its conv and temporal state of every layer);
 * a sliding-window group names the pages of the window in its own pool.
 * Index k of the prefill's array goes to index k of the decode's, in every
 * buffer of the group; a room whose two arrays differ in length fails.
 */
typedef struct kvf_state_group {
    const char         *type;         /**< e.g. "mamba", "swa"; both sides register
                                           the same types in the same order */
    uint32_t            num_buffers;
    const kvf_buffer_t *buffers;      /**< item_bytes: bytes per index */
} kvf_state_group_t;

/** Indices into every buffer of one state group (n may be 0: nothing). */
typedef struct kvf_indices {
    const uint32_t *idx;
    size_t          n;
} kvf_indices_t;

/**
 * What an engine registers.  KV buffers are typically one K and one V
 * buffer per layer (MHA) or one per layer (MLA); prefill and decode must
 * register the same number, in the same order.  Arrays are copied.
 * Initialise with kvf_layout_init(); grows by the rules of
 * kvf_engine_params_t.
 */
typedef struct kvf_layout {
    size_t              size;        /**< the caller's sizeof(kvf_layout_t); set by _init */
    uint32_t            page_size;   /**< tokens per page; required */
    const char         *kv_dtype;    /**< e.g. "bfloat16"; required */
    kvf_attn_kind_t     attn;        /**< default KVF_ATTN_MHA */
    uint32_t            num_layers;  /**< model layers on this rank; required */
    /**
     * MHA: KV heads on this rank, of the model, and bytes per head per
     * token (of group 0; another group's head size is its item_bytes /
     * (page_size x heads_per_rank)).  A decode engine may leave all three 0
     * (SGLang's decode side does not know them): they are then taken from
     * its first prefill peer, heads_per_rank = total_heads / tp_size (1 when
     * tp_size > total_heads), and checked against item_bytes then.
     */
    uint32_t            heads_per_rank;
    uint32_t            total_heads;
    uint32_t            bytes_per_head;
    kvf_mem_kind_t      mem_kind;    /**< the KV buffers' memory; default KVF_MEM_HOST
                                          (a caller whose `size` ends before
                                          aux_mem_kind: every buffer's) */
    uint32_t            num_kv;      /**< number of KV buffers */
    const kvf_buffer_t *kv;
    uint32_t            num_aux;     /**< aux buffers (bytes per slot) */
    const kvf_buffer_t *aux;
    uint32_t            num_state;   /**< optional state buffers (bytes per slot), each
                                          named by one slot; see also state_groups */
    const kvf_buffer_t *state;
    uint32_t            first_layer; /**< global index of this rank's first layer
                                          (a pipeline stage's offset); default 0 */
    /* ---- added after 0.1.0 (a caller's smaller size gets the default) ---- */
    /**
     * kv_tags[i] says what kv[i] holds (num_kv entries).  NULL means the
     * 0.1.0 order: layer by layer from first_layer, each layer's buffers in
     * turn (K then V for MHA, role KVF_KV_KV for MLA's one).  With tags the
     * buffers may come in any order and in several groups; num_layers is
     * then the number of group-0 layers this rank holds (first_layer up).
     * Default NULL.
     */
    const kvf_kv_tag_t      *kv_tags;
    /** Typed state buffers, instead of num_state/state (not both).  Default 0. */
    uint32_t                 num_state_groups;
    const kvf_state_group_t *state_groups;
    /**
     * The aux and the state buffers' memory, each family its own (SGLang:
     * KV and Mamba state on the GPU, aux in host memory).  Default
     * KVF_MEM_HOST.
     */
    kvf_mem_kind_t           aux_mem_kind;
    kvf_mem_kind_t           state_mem_kind;
    /** The CUDA device ordinal of every KVF_MEM_CUDA buffer (one GPU per
     *  rank).  Default 0. */
    int                      cuda_device;
    /**
     * The byte order of every KV page, kvf_kv_order_t: KVF_KV_NHD
     * (token-major) or KVF_KV_HND (head-major), for every KV buffer of
     * the layout (a draft model's group too).  MHA/GQA: prefill and decode
     * must register the same order (kvferry moves pages and head slices,
     * it does not transpose them): a pair whose orders differ is refused
     * at the handshake and fails every room with a message naming both.
     * When the TP sizes differ, an NHD page is sent as a piece per token
     * (that token's run of heads), an HND page as one piece (the run of
     * heads, every token of it).  MLA ignores it: a page is one latent
     * vector per token, never cut by heads.  Default KVF_KV_NHD; any other
     * value is refused (KVF_ERR_INVALID_PARAM).
     */
    kvf_kv_order_t           kv_order;
    /* Fields added later go here, at the end, so that `size` tells them apart. */
} kvf_layout_t;

/** kvf_layout_t as kvferry 0.1.0 has it: the least `size` accepted. */
#define KVF_LAYOUT_SIZE_V0 KVF_FIELD_END(kvf_layout_t, first_layer)

/**
 * Zero the first `size` bytes of `layout` and set layout->size = size:
 * every default of kvf_layout_t is 0.  Writes nothing past `size`; a size
 * below KVF_LAYOUT_SIZE_V0 is logged and kvf_engine_register_layout()
 * refuses the struct.  Call it through the kvf_layout_init() macro.
 *
 * @param [out] layout  the caller's struct, at least `size` bytes
 * @param [in]  size    sizeof the caller's kvf_layout_t
 */
KVF_API void kvf_layout_init_sized(kvf_layout_t *layout, size_t size);

/**
 * Zero a layout of this header's size and set its `size`.  Also exported
 * as a function, for callers built against kvferry 0.1.0 and for
 * dlsym()/ctypes: that one takes the size to be KVF_LAYOUT_SIZE_V0.
 */
KVF_API void (kvf_layout_init)(kvf_layout_t *layout);
#define kvf_layout_init(layout) kvf_layout_init_sized((layout), sizeof(*(layout)))

/**
 * Register the engine's layout, once.  A prefill engine then registers
 * itself with its bootstrap registry in the background (retrying with
 * backoff).  Rooms can be created only after this call.
 *
 * @param [in] layout  read up to layout->size; arrays are copied
 * @return KVF_OK, KVF_ERR_INVALID_PARAM (the log and kvf_last_error() say
 *         which field, or which `size` the growth rules refuse),
 *         KVF_ERR_STATE (already registered),
 *         KVF_ERR_UNSUPPORTED (memory kind not supported by any transport).
 */
KVF_API kvf_status_t kvf_engine_register_layout(kvf_engine_t *engine,
                                                const kvf_layout_t *layout);

/**
 * Allocate host memory for KV buffers that a decode engine on the same
 * host can map (a memfd): with the shm transport, reading it is one
 * memcpy instead of a cross-process copy at about half that speed.  Only
 * an allocation the engine's registered buffers cover whole (one buffer,
 * or several that tile it) is shared: a peer could map all of it, so one
 * registered in part is read the slower way (the engine warns).  Any
 * memory works with every transport; this is only faster.  Zeroed,
 * page-aligned.
 *
 * @return KVF_OK; KVF_ERR_INVALID_PARAM (len 0, ptr_p NULL);
 *         KVF_ERR_NO_MEMORY (no memfd, or no memory behind it: memfd_create,
 *         ftruncate or mmap failed); KVF_ERR_IO (the memfd could not be
 *         made read-only for peers: sealing it needs Linux 5.1, and reopening
 *         it read-only needs /proc and a free descriptor; memory from
 *         malloc or mmap serves instead, read the slower way).  On an error
 *         nothing is allocated, and the log and kvf_last_error() name the
 *         step that failed with its errno text.
 */
KVF_API kvf_status_t kvf_mem_alloc(size_t len, void **ptr_p);

/** Free memory from kvf_mem_alloc (after the engines using it are gone). */
KVF_API void kvf_mem_free(void *ptr);

/* ------------------------------------------------------------------------ */
/* Sender (prefill side of a room)                                          */
/* ------------------------------------------------------------------------ */

/**
 * Create the sender for `room`.  BOOTSTRAPPING until every decode rank this
 * engine must feed has sent its destination, then WAITING_FOR_INPUT.
 *
 * @param [in]  bootstrap_addr  the registry "host:port" (informational on
 *                              prefill; checked against the engine's)
 * @return KVF_OK, KVF_ERR_STATE (no layout registered),
 *         KVF_ERR_ROOM_IN_USE (a live sender has this room id),
 *         KVF_ERR_NO_MEMORY.
 */
KVF_API kvf_status_t kvf_sender_create(kvf_engine_t *engine,
                                       const char *bootstrap_addr,
                                       uint64_t room, kvf_sender_t **sender_p);

/**
 * Declare the room's size: `num_pages` KV pages and the source aux slot.
 * Once.  num_pages may be 0 (the decode side holds the whole prompt: only
 * aux and state move, on a last send() of no pages).  Without the engine
 * lock: published, as a send is; a destination that disagrees with it
 * fails the room when the engine takes it in.  @return KVF_OK,
 * KVF_ERR_STATE (second call), KVF_ERR_OUT_OF_RANGE (aux slot not
 * registered), KVF_ERR_NO_MEMORY.
 */
KVF_API kvf_status_t kvf_sender_init(kvf_sender_t *sender, uint32_t num_pages,
                                     uint32_t aux_slot);

/**
 * kvf_sender_set_states() with one slot per state group (a layout of
 * plain state buffers: one slot per buffer).  n 0: no state.
 */
KVF_API kvf_status_t kvf_sender_set_state(kvf_sender_t *sender,
                                          const uint32_t *slots, size_t n);

/**
 * Source state indices, one entry per state group of the layout (or per
 * state buffer of a layout without groups, each entry one slot), written
 * on the last chunk: group i's indices go to the decode's indices of the
 * same group, in order.  Optional; once, before the last send.
 * @return KVF_OK, KVF_ERR_STATE, KVF_ERR_OUT_OF_RANGE (an index outside
 * its group's buffers), KVF_ERR_INVALID_PARAM (n differs from the number
 * of groups).  A group whose count differs from the decode's fails the
 * room at the last send (no partial state).  Without the engine lock: the
 * indices are checked and copied on the caller's thread, and go with the
 * last send.
 */
KVF_API kvf_status_t kvf_sender_set_states(kvf_sender_t *sender,
                                           const kvf_indices_t *states, size_t n);

/**
 * The decode's prefix: tokens of the request it already holds (its prefix
 * cache), told with its destination (kvf_dest_t.decode_prefix_len); the
 * prefill sends only the rest, so its pages start there.  Known once every
 * decode rank's destination arrived (the room is WAITING_FOR_INPUT).
 * Without the engine lock: two atomic loads.
 * @return KVF_OK, KVF_ERR_AGAIN (not yet known).
 */
KVF_API kvf_status_t kvf_sender_decode_prefix_len(kvf_sender_t *sender,
                                                  uint32_t *tokens_p);

/**
 * Send one prefill chunk: `n` source pages, the next `n` of the room.
 * Non-blocking, and without the engine lock: the page numbers are copied
 * out of the caller's array and published; the progress thread takes the
 * chunk in at its next pass (the room is TRANSFERRING from then, not
 * necessarily when the call returns) and writes the pages.  The page
 * memory must stay unchanged until the room reaches SUCCESS or FAILED.  On the last chunk (is_last) aux and
 * state are written too and the receivers are told the byte count.
 *
 * @return KVF_OK; KVF_ERR_STATE (not initialised, not yet
 *         WAITING_FOR_INPUT, already sent the last chunk, or the room
 *         failed), KVF_ERR_OUT_OF_RANGE (a page outside the registered
 *         buffers, or more pages than declared): nothing is sent.
 */
KVF_API kvf_status_t kvf_sender_send(kvf_sender_t *sender,
                                     const uint32_t *pages, size_t n,
                                     int is_last);

/**
 * Send some layers of one prefill chunk as soon as they are computed
 * (layer-wise transfer): the room's pages [first_page, first_page + n),
 * source pages pages[0..n), of the KV buffers that hold layers
 * [layer_begin, layer_end) of `group` (kvf_kv_tag_t: group 0 is the model,
 * its layers numbered from 0 at the model's first, so a pipeline stage's
 * are [first_layer, first_layer + num_layers); 1, 2, ... a draft model).
 * The decode's bytes of those layers start moving at once, while the
 * prefill computes the next ones.  Non-blocking and without the engine
 * lock, as kvf_sender_send.
 *
 * Any order of layer ranges and chunks, each layer's chunks in page order:
 * every layer of the range must have had exactly pages [0, first_page)
 * (a layer sent twice, or a chunk skipped, is refused).  A position sent
 * for one layer names the same source page for every other (one page
 * table per room).  kvf_sender_send() still sends a chunk of every layer
 * (when every layer has the same pages so far).  The room ends with
 * kvf_sender_send(sender, pages, n, 1): the last pages of every layer, or
 * none (n 0) when the layer sends gave them all, with aux and state; a last
 * send that leaves a layer short fails the room, on every rank, with a
 * reason naming the layer, its pages and this rank (and returns
 * KVF_ERR_INVALID_PARAM).  State moves with that last send.
 *
 * @return KVF_OK; KVF_ERR_STATE (as kvf_sender_send); KVF_ERR_OUT_OF_RANGE
 *         (a page outside the registered buffers or past the declared
 *         pages, a layer this rank holds no KV buffer of);
 *         KVF_ERR_INVALID_PARAM (no pages, an empty layer range, a layer
 *         not at first_page, a source page other than the one a position
 *         was sent with): nothing is sent, and kvf_last_error() says why.
 */
KVF_API kvf_status_t kvf_sender_send_layers(kvf_sender_t *sender, const uint32_t *pages,
                                            size_t n, uint32_t first_page, uint32_t group,
                                            uint32_t layer_begin, uint32_t layer_end);

/** @return the sender's poll state (an atomic load: cheap). */
KVF_API kvf_poll_t kvf_sender_poll(const kvf_sender_t *sender);

/**
 * Consume the failure record, once.  Takes no engine lock: the record is
 * fixed once the room is FAILED.
 *
 * @param [in,out] failure_p  the caller's record, its `size` set by
 *                            kvf_failure_init(): only that many bytes are
 *                            written (see the growth rules)
 * @return KVF_OK (record written), KVF_ERR_AGAIN (the room has not
 *         failed), KVF_ERR_NOT_FOUND (already consumed),
 *         KVF_ERR_INVALID_PARAM (failure_p NULL, or a `size` below
 *         KVF_FAILURE_SIZE_V0 or far past any version: nothing is written
 *         and the record is not consumed; kvf_last_error() says why).
 */
KVF_API kvf_status_t kvf_sender_failure(kvf_sender_t *sender,
                                        kvf_failure_t *failure_p);

/**
 * Abort the room here and on all its peers.  No-op once final.  Without
 * the engine lock: the room is FAILED (poll, kvf_sender_failure) when the
 * call returns, and its peers hear it once a progress thread took it in
 * (its next pass, which the call wakes).
 */
KVF_API void kvf_sender_abort(kvf_sender_t *sender);

/**
 * Fail the room here with the application's own root cause: `status` (a
 * negative kvf_status_t; a room-level one such as KVF_ERR_BAD_INDICES or
 * KVF_ERR_ABORTED fits best) and `reason` (copied, cut at KVF_REASON_MAX),
 * with this rank as its origin.  Every peer and sibling of the room learns
 * it as it would a failure kvferry saw itself (docs/FAILURES.md).  For an
 * application that refuses a request before kvferry sees it (an index
 * its own checks rejected, say), so that every rank names that refusal
 * rather than an abort.  No-op once the room is final.  Without the
 * engine lock, as kvf_sender_abort.
 * @return KVF_OK, KVF_ERR_INVALID_PARAM (status not negative, no reason).
 */
KVF_API kvf_status_t kvf_sender_fail(kvf_sender_t *sender, kvf_status_t status,
                                     const char *reason);

/**
 * Wait, at most `timeout_ms`, for the room to fail: the one call that
 * waits, for an application that learned from elsewhere (its scheduler's
 * all-reduce over this side's ranks, say) that the request failed on
 * another rank of this side before this rank's room heard why (the
 * failure reaches every rank of the room within milliseconds:
 * docs/FAILURES.md, "Siblings").  It waits on an event, not by polling.
 * Call it only then: the call says that this side failed the request, so
 * a room that succeeded here and kept a cause it heard from the other
 * side (kept because this side had not failed then) fails with that
 * cause at once, and one that kept none takes the first that comes.  Any
 * thread.
 * @return KVF_OK (the room is FAILED: kvf_sender_failure has its record),
 *         KVF_ERR_AGAIN (it has not failed within the time).
 */
KVF_API kvf_status_t kvf_sender_await_failure(kvf_sender_t *sender, unsigned timeout_ms);

/**
 * Release the sender (aborting the room if it is still live).  The room id
 * may be used again as soon as this returns.  A sender that is final and
 * whose pages no stream is reading is only marked for the engine's
 * threads, without the engine lock; any other takes it, and so does one
 * its application aborted or failed that no progress thread took in yet.
 */
KVF_API void kvf_sender_destroy(kvf_sender_t *sender);

/** The room id. */
KVF_API uint64_t kvf_sender_room(const kvf_sender_t *sender);

/**
 * What a room cost, for a scheduler's metrics (SGLang's KVTransferMetric).
 * Set `size` to sizeof(kvf_room_metric_t) before the call: the library
 * writes only that much, so the struct may grow.
 */
typedef struct kvf_room_metric {
    size_t   size;
    uint64_t bytes;        /**< payload bytes of the room this rank sent (prefill) or
                                placed (decode) so far */
    double   alloc_s;      /**< seconds from create until the decode pages were known:
                                every destination arrived (prefill), the
                                destination was given (decode); 0 until then */
    double   transfer_s;   /**< seconds from then until the room was final, or until
                                now while it is not */
} kvf_room_metric_t;

/**
 * Snapshot a sender's metric.  Takes no engine lock.  Once the room is
 * final, `bytes` is its last count.
 * @return KVF_OK, KVF_ERR_INVALID_PARAM (size).
 */
KVF_API kvf_status_t kvf_sender_metric(kvf_sender_t *sender, kvf_room_metric_t *metric);

/* ------------------------------------------------------------------------ */
/* Held rooms and request ids (vLLM: prefill computes first, decode reads)  */
/* ------------------------------------------------------------------------ */

/**
 * A room id and instance for an application's request id, computed the
 * same way on every host: XXH3-128 of the request id's bytes, seed 0;
 * `room` is its low 64 bits, `instance` its high 64 bits (1 where those
 * are 0, since 0 means "any").  A prefill holds the room under the
 * instance (kvf_hold_t.instance) and a decode names both
 * (kvf_remote_t): two request ids whose rooms collide then differ in
 * their instance, and a reader of the one is refused by the other
 * (KVF_ERR_ROOM_CONFLICT) instead of reading its bytes.
 */
typedef struct kvf_room_key {
    uint64_t room;
    uint64_t instance;
} kvf_room_key_t;

/** The room key of `len` bytes of request id (any bytes; len may be 0). */
KVF_API kvf_room_key_t kvf_room_key(const void *request_id, size_t len);

/**
 * How a sender holds its pages for readers that come later
 * (kvf_sender_create_held).  Initialise with kvf_hold_init(); grows by the
 * rules of kvf_engine_params_t.
 */
typedef struct kvf_hold {
    size_t   size;        /**< the caller's sizeof(kvf_hold_t); set by _init */
    /**
     * Milliseconds, from kvf_sender_create_held, within which every decode
     * rank that reads the room must have asked for it.  0 means the
     * default: KVF_LEASE_MS, else 480000 (vLLM's abort timeout).
     */
    unsigned lease_ms;
    /**
     * The instance a reader must name (kvf_remote_t.instance), usually
     * kvf_room_key()'s: a reader naming another one, or none, is refused,
     * and only decode ranks that name it may fail or abort the room.  0:
     * the room takes any reader.
     */
    uint64_t instance;
} kvf_hold_t;

/** kvf_hold_t as it first shipped: the least `size` accepted. */
#define KVF_HOLD_SIZE_V0 KVF_FIELD_END(kvf_hold_t, instance)

/** Zero `size` bytes of `hold` and set its size (every default is 0). */
KVF_API void kvf_hold_init_sized(kvf_hold_t *hold, size_t size);
#define kvf_hold_init(hold) kvf_hold_init_sized((hold), sizeof(*(hold)))

/**
 * Create a sender that holds its pages for readers that come later: the
 * prefill side computes first and gives all its pages before any decode
 * rank has asked (vLLM's flow).  As kvf_sender_create, except:
 *
 *  - kvf_sender_send() is accepted while the room is still BOOTSTRAPPING:
 *    the pages are kept (unchanged until the room is final, as always)
 *    and move once every decode rank that reads the room has asked.  From
 *    there the room goes on as any other: SUCCESS when every reader has
 *    all its bytes, checked; FAILED with the reason otherwise, on both
 *    sides.
 *  - The lease: when it ends with a reader missing (none asked, or fewer
 *    than the readers announced), the room fails with
 *    KVF_ERR_LEASE_EXPIRED and its pages may be reused at once.  The
 *    bootstrap deadline does not apply; once every reader asked, the
 *    waiting and transfer deadlines do, as usual.  A reader that gives up
 *    after asking (aborts) fails the room at once.
 *  - A reader that does not name hold->instance (when it is not 0) is
 *    refused (KVF_ERR_ROOM_CONFLICT on its side, without learning the
 *    instance); the room goes on.  A FAIL or ABORT from a decode rank not
 *    bound to the room is dropped unless it names the instance (a reader
 *    that failed or gave up before it asked: the room then fails at
 *    once).
 *  - A reader's destination may hold fewer pages: with a decode prefix
 *    (kvf_dest_t.decode_prefix_len, a whole number of pages) its pages are
 *    the sender's from that page on, and it may stop before the sender's
 *    last page.  (A room that is not held keeps the rule that both sides
 *    name the same pages, the prefill's starting at the prefix.)
 *
 * @return as kvf_sender_create, and KVF_ERR_INVALID_PARAM (hold NULL or
 *         its `size` refused).
 */
KVF_API kvf_status_t kvf_sender_create_held(kvf_engine_t *engine, uint64_t room,
                                            const kvf_hold_t *hold,
                                            kvf_sender_t **sender_p);

/* ------------------------------------------------------------------------ */
/* Receiver (decode side of a room)                                         */
/* ------------------------------------------------------------------------ */

/**
 * Create the receiver for `room`, fed by the prefill server whose registry
 * is at `bootstrap_addr`.  The registry lookup and the connection happen on
 * the engine's threads (cached per address and per peer): BOOTSTRAPPING
 * until its prefill ranks are resolved, connected and found compatible,
 * then WAITING_FOR_INPUT: the scheduler may now find pages and give them
 * (kvf_receiver_set_dest); nothing moves before.
 *
 * @param [in] prefill_dp_rank  prefill DP group to use, or -1 for the
 *                              registry's choice / room % dp_size
 * @return KVF_OK, KVF_ERR_STATE (no layout), KVF_ERR_ROOM_IN_USE,
 *         KVF_ERR_INVALID_PARAM (malformed address), KVF_ERR_NO_MEMORY.
 */
KVF_API kvf_status_t kvf_receiver_create(kvf_engine_t *engine,
                                         const char *bootstrap_addr,
                                         uint64_t room, int prefill_dp_rank,
                                         kvf_receiver_t **receiver_p);

/**
 * A receiver's destination, given in one call (kvf_receiver_set_dest).
 * Initialise with kvf_dest_init(); grows by the rules of
 * kvf_engine_params_t.
 */
typedef struct kvf_dest {
    size_t               size;        /**< the caller's sizeof(kvf_dest_t); set by _init */
    /** Decode pages, one per page the prefill sends, in order; may be 0 pages
     *  (a full prefix hit: aux and state only). */
    const uint32_t      *pages;
    size_t               num_pages;
    uint32_t             aux_slot;    /**< the destination aux slot */
    /** One entry per state group (or per legacy state buffer, one slot each),
     *  or num_states 0: no state. */
    const kvf_indices_t *states;
    size_t               num_states;
    /** Tokens of the request this decode already holds (its prefix cache):
     *  the prefill sends only the rest (kvf_sender_decode_prefix_len), and
     *  `pages` are the rest's.  Default 0. */
    uint32_t             decode_prefix_len;
} kvf_dest_t;

/** kvf_dest_t as it first shipped: the least `size` accepted. */
#define KVF_DEST_SIZE_V0 KVF_FIELD_END(kvf_dest_t, decode_prefix_len)

/** Zero `size` bytes of `dest` and set its size (every default is 0). */
KVF_API void kvf_dest_init_sized(kvf_dest_t *dest, size_t size);
#define kvf_dest_init(dest) kvf_dest_init_sized((dest), sizeof(*(dest)))

/**
 * Give the room its destination, once, in any state before final (SGLang
 * gives it once poll() showed WAITING_FOR_INPUT).  Its requests go to the
 * prefill ranks as soon as they are connected.  @return KVF_OK,
 * KVF_ERR_STATE (second call), KVF_ERR_OUT_OF_RANGE (an index outside the
 * registered buffers), KVF_ERR_INVALID_PARAM (a page or state index twice,
 * a state count that is not the layout's, a `size` refused).
 * Without the engine lock: the indices are checked and copied on the
 * caller's thread and published; the progress thread takes them in and
 * sends the requests (the room's metric counts its waiting from the call).
 */
KVF_API kvf_status_t kvf_receiver_set_dest(kvf_receiver_t *receiver,
                                           const kvf_dest_t *dest);

/**
 * kvf_receiver_set_dest() with pages, the aux slot and one slot per legacy
 * state buffer (n_state 0: none), and no decode prefix.
 */
KVF_API kvf_status_t kvf_receiver_init(kvf_receiver_t *receiver,
                                       const uint32_t *pages, size_t n,
                                       uint32_t aux_slot,
                                       const uint32_t *state_slots,
                                       size_t n_state);

/**
 * @return the receiver's poll state (atomic loads: cheap).  A room shows
 * FAILED (or SUCCESS) only once no read into its pages is in flight: a
 * room that failed while the decode side was still pulling bytes shows
 * TRANSFERRING until those reads end (at most the heartbeat timeout), so
 * that a final room's pages may always be given to another request.
 */
KVF_API kvf_poll_t kvf_receiver_poll(const kvf_receiver_t *receiver);

/** Consume the failure record, once (as kvf_sender_failure). */
KVF_API kvf_status_t kvf_receiver_failure(kvf_receiver_t *receiver,
                                          kvf_failure_t *failure_p);

/**
 * Abort the room here and on all its peers.  No-op once final.  Without
 * the engine lock: kvf_receiver_failure has the record when the call
 * returns, but poll shows the room's state before, and its pages stay
 * unreleased, until a progress thread took the abort in (its next pass,
 * which the call wakes): one may be placing bytes it checked live a
 * moment before, and FAILED says that no byte can land any more.
 */
KVF_API void kvf_receiver_abort(kvf_receiver_t *receiver);

/** Fail the room here with the application's root cause (as kvf_sender_fail). */
KVF_API kvf_status_t kvf_receiver_fail(kvf_receiver_t *receiver, kvf_status_t status,
                                       const char *reason);

/** Wait for the room to fail, at most `timeout_ms` (as kvf_sender_await_failure). */
KVF_API kvf_status_t kvf_receiver_await_failure(kvf_receiver_t *receiver,
                                                unsigned timeout_ms);

/**
 * May the room's destination pages be given to another request?  1 once
 * the room is final and no write into its pages can still land; 0 before.
 * Bytes received in the stream are placed by the engine's thread after it
 * checked that the room is live; bytes pulled (shm, ucx) are read by the
 * mover and counted until the mover says no byte of the read can land.
 * So this is 1 exactly when kvf_receiver_poll() shows a final state.  An
 * atomic load: cheap.
 */
KVF_API int kvf_receiver_pages_released(const kvf_receiver_t *receiver);

/**
 * Release the receiver; afterwards nothing more is written into its pages,
 * and its room id may be used again.  Destroying a room poll() showed
 * final never waits, and takes no engine lock (the room is only marked
 * for the engine's threads).  A room destroyed
 * before that is aborted, and destroy waits until the reads into its pages
 * that are in flight have ended (microseconds normally; at most the
 * heartbeat timeout when the prefill process stopped answering).
 */
KVF_API void kvf_receiver_destroy(kvf_receiver_t *receiver);

/** The room id. */
KVF_API uint64_t kvf_receiver_room(const kvf_receiver_t *receiver);

/** Snapshot a receiver's metric (as kvf_sender_metric). */
KVF_API kvf_status_t kvf_receiver_metric(kvf_receiver_t *receiver,
                                         kvf_room_metric_t *metric);

/**
 * A room held by a prefill server that this decode rank reaches without
 * a registry (kvf_receiver_create_remote).  Initialise with
 * kvf_remote_init(); grows by the rules of kvf_engine_params_t.
 */
typedef struct kvf_remote {
    size_t              size;         /**< the caller's sizeof(kvf_remote_t); set by _init */
    uint64_t            room;         /**< the room id the prefill holds */
    /** The instance it holds the room under (kvf_hold_t.instance); 0: any. */
    uint64_t            instance;
    /**
     * Descriptors (kvf_engine_descriptor) of the prefill server's ranks,
     * in any order: every TP rank of its DP group (and every pipeline
     * stage), or at least the ranks this decode rank reads from.  Copied.
     */
    const char *const  *descriptors;
    size_t              num_descriptors;
} kvf_remote_t;

/** kvf_remote_t as it first shipped: the least `size` accepted. */
#define KVF_REMOTE_SIZE_V0 KVF_FIELD_END(kvf_remote_t, num_descriptors)

/** Zero `size` bytes of `remote` and set its size (every default is 0). */
KVF_API void kvf_remote_init_sized(kvf_remote_t *remote, size_t size);
#define kvf_remote_init(remote) kvf_remote_init_sized((remote), sizeof(*(remote)))

/**
 * Create the receiver for a room that prefill ranks described by their
 * descriptors hold (kvf_sender_create_held): as kvf_receiver_create, but the
 * ranks come from the descriptors instead of a registry.  The engine
 * picks the ranks it reads from, connects (the handshake checks each one
 * is the engine instance its descriptor names: a prefill that restarted
 * since fails the room with KVF_ERR_PEER_RESTARTED), and the room is
 * WAITING_FOR_INPUT once they are connected and compatible; then
 * kvf_receiver_set_dest() makes it read.
 *
 * @return KVF_OK, KVF_ERR_STATE (no layout, or not a decode engine),
 *         KVF_ERR_ROOM_IN_USE (a live receiver has this room id on this
 *         engine: two requests whose rooms collide), KVF_ERR_INVALID_PARAM
 *         (a malformed descriptor, one that is not a prefill engine's, one
 *         of a non-loopback address on an engine without a cluster token,
 *         descriptors that disagree, or none for a rank this decode rank
 *         needs; the log says which), KVF_ERR_UNSUPPORTED (more than 64
 *         prefill ranks to read from), KVF_ERR_NO_MEMORY.
 */
KVF_API kvf_status_t kvf_receiver_create_remote(kvf_engine_t *engine,
                                                const kvf_remote_t *remote,
                                                kvf_receiver_t **receiver_p);

/* ------------------------------------------------------------------------ */
/* Statistics                                                               */
/* ------------------------------------------------------------------------ */

/**
 * Payload paths, by a fixed index (kvf_transport_name): 0 is the control
 * connection's own stream (tcp), then cuda, shm, ucx.  An index names the
 * same transport in every build and every version; a build without a
 * transport never counts its slot.  A new transport takes the next free
 * slot, up to KVF_PATHS_MAX.
 */
#define KVF_PATHS_MAX 8

/**
 * @return the name of payload path `i`, as the `transport` parameter and
 *         KVF_TRANSPORT spell it ("tcp", "cuda", "shm", "ucx"; static),
 *         whether or not this build has it; NULL for an index past the
 *         last path this version knows.
 */
KVF_API const char *kvf_transport_name(unsigned i);

/**
 * The engine's counters.  Initialise with kvf_engine_stats_init() before
 * kvf_engine_stats() fills it; grows by the rules above kvf_failure_t.
 */
typedef struct kvf_engine_stats {
    size_t   size;                /**< the caller's sizeof(kvf_engine_stats_t); set by _init */
    uint64_t rooms_by_state[5];   /**< live rooms, indexed by kvf_poll_t */
    uint64_t rooms_succeeded;     /**< total rooms that reached SUCCESS */
    uint64_t rooms_failed;        /**< total rooms that reached FAILED */
    uint64_t failures_room;       /**< failures with a room-level status */
    uint64_t failures_peer;       /**< failures with a peer-level status */
    uint64_t failures_other;
    uint64_t bytes_sent;          /**< payload bytes written to peers */
    uint64_t bytes_received;      /**< payload bytes placed by peers */
    uint64_t peers_connected;     /**< connections to peers that finished their
                                       handshake, sibling links included (they
                                       carry no payload, and count in no path) */
    /** Connected peers by the path their payload uses, indexed as
     *  kvf_transport_name() names them; slots past the last name are 0. */
    uint64_t peers_by_path[KVF_PATHS_MAX];
    /* ---- past KVF_ENGINE_STATS_SIZE_V0: a caller's smaller size gets none ---- */
    /**
     * Connections refused before the peer authenticated: a wrong or
     * missing cluster token, a message before the handshake finished (or
     * a frame header larger than the handshake's), a non-loopback peer in
     * protected mode, too many connections still authenticating, no
     * descriptor to spare (docs/SECURITY.md).
     */
    uint64_t auth_refused;
    /**
     * Room messages dropped because they came from an authenticated peer
     * the room is not bound to, or named another instance of the room (an
     * earlier room with the same id): a stale retry, a buggy or hostile
     * rank.  They changed nothing (docs/SECURITY.md, "Token holders").
     */
    uint64_t room_msgs_dropped;
    /**
     * Prefill: messages kept for rooms that had no sender yet
     * (destinations, failures) dropped, oldest first, to stay within the
     * bound (32768 messages and 32 MiB engine-wide).
     */
    uint64_t stash_dropped;
    /* Fields added later go here, at the end, so that `size` tells them apart. */
} kvf_engine_stats_t;

/**
 * The least `size` kvf_engine_stats() accepts: the counters kvferry 0.1.0
 * had in this struct (peers by path instead of by named backend).  The
 * counters after them were functions of their own until the struct had a
 * size.
 */
#define KVF_ENGINE_STATS_SIZE_V0 KVF_FIELD_END(kvf_engine_stats_t, peers_by_path)

/**
 * Zero the first `size` bytes of `stats` and set stats->size = size.
 * Writes nothing past `size`; a size below KVF_ENGINE_STATS_SIZE_V0 is
 * logged and kvf_engine_stats() refuses the struct.  Call it through the
 * kvf_engine_stats_init() macro, which passes your sizeof.
 *
 * @param [out] stats  the caller's struct, at least `size` bytes
 * @param [in]  size   sizeof the caller's kvf_engine_stats_t
 */
KVF_API void kvf_engine_stats_init_sized(kvf_engine_stats_t *stats, size_t size);
#define kvf_engine_stats_init(stats) kvf_engine_stats_init_sized((stats), sizeof(*(stats)))

/**
 * Snapshot the engine's counters since it started (live rooms and peers:
 * now).  Any thread: it takes the engine lock for the snapshot.
 *
 * @param [in,out] stats_p  the caller's struct, its `size` set by
 *                          kvf_engine_stats_init(): only that many bytes
 *                          are written
 * @return KVF_OK, KVF_ERR_INVALID_PARAM (engine or stats_p NULL, or a
 *         `size` below KVF_ENGINE_STATS_SIZE_V0 or far past any version:
 *         nothing is written; kvf_last_error() says why).
 */
KVF_API kvf_status_t kvf_engine_stats(kvf_engine_t *engine, kvf_engine_stats_t *stats_p);

/**
 * Streams per peer pair this engine takes (kvf_engine_params_t.streams,
 * resolved: 1..8).  Any thread.
 */
KVF_API unsigned kvf_engine_streams(const kvf_engine_t *engine);

/**
 * Payload bytes this engine moved over stream index `stream` of its peers
 * since it started, sent (prefill) or placed (decode); 0 for an index of
 * 8 or more.  Stream 0 is each peer's first connection.  Any thread.
 */
KVF_API uint64_t kvf_engine_stream_bytes(kvf_engine_t *engine, unsigned stream);

/**
 * A call into the library that takes a lock of its own, which nothing else
 * takes, and returns: the floor under every call's latency on this host.
 * `kvferry bench --call-latency` times it beside each application call, so
 * that the operating system's preemption (which this call meets too) and
 * waiting for an engine (which it never does) are told apart.  Any thread.
 */
KVF_API void kvf_null_call(void);

/**
 * The engine's metrics as Prometheus text (exposition format 0.0.4): what
 * its endpoint (kvf_engine_params_t.metrics_addr) serves, for an
 * application that serves its own /metrics.  Every metric is named in
 * docs/OPERATIONS.md: rooms by final state and side, failures by status
 * and by origin (seen here, or learned from another rank), room latency
 * and bytes as histograms, payload bytes by path, peers by kind, path and
 * state, heartbeat losses, authentication refusals, dropped room
 * messages, stash drops, reads in flight.  Counters only grow while the
 * engine lives.
 *
 * The caller owns buf; the text is written NUL-terminated when it fits.
 * Any thread: it takes the engine lock for one snapshot (counters and a
 * walk over the live rooms and peers) and formats after releasing it.
 *
 * @param [out] buf       where the text goes (may be NULL with len 0)
 * @param [in]  len       bytes at buf
 * @param [out] needed_p  (may be NULL) the bytes the text needs, its NUL
 *                        included; also set when KVF_ERR_AGAIN is returned
 * @return KVF_OK, KVF_ERR_AGAIN (buf is too short for the text: nothing
 *         is written; call again with *needed_p bytes or more, and allow
 *         for growth between the calls), KVF_ERR_INVALID_PARAM (engine
 *         NULL).
 */
KVF_API kvf_status_t kvf_engine_metrics(kvf_engine_t *engine, char *buf, size_t len,
                                        size_t *needed_p);

/* ------------------------------------------------------------------------ */
/* Bootstrap registry                                                       */
/* ------------------------------------------------------------------------ */

typedef struct kvf_bootstrap kvf_bootstrap_t;

/**
 * Start a bootstrap registry (HTTP, SGLang's routes, kvferry's room
 * readiness for SGLang's prefill_complete policy, and /metrics;
 * docs/REGISTRY.md) on host:port (port 0: any free port).  It serves from its own thread.
 *
 * Who may change it (PUT /route, POST /register_dp_rank, POST /room_ready)
 * is read from the environment when it starts (docs/SECURITY.md):
 *  - the cluster token, first found of KVF_AUTH_TOKEN, KVF_AUTH_TOKEN_FILE
 *    (a file only its owner may read; trailing newline stripped) and
 *    SGLANG_DISAGGREGATION_BOOTSTRAP_AUTH_TOKEN: every mutating request
 *    must then carry "Authorization: Bearer <token>", or gets 401;
 *  - no token: protected mode, mutating requests from loopback clients
 *    only (others get 403), and a host that is not a loopback address is
 *    refused (KVF_ERR_INVALID_PARAM, the log and kvf_last_error() say how
 *    to set a token);
 *  - no token and KVF_AUTH=none: anyone may write, on any host (a warning
 *    is logged at start).
 * Read-only routes (GET /route, /health, /metrics, POST /query_dp_ranks,
 * POST /query_room_ready) are open in every mode.  Connections are bounded (512 in all, 64 per
 * client address, idle ones closed after 15 s), and so are queries (2048
 * bytes, 32 parameters) and bodies (1 MiB).
 *
 * @return KVF_OK, KVF_ERR_IO (cannot resolve the host or listen),
 *         KVF_ERR_INVALID_PARAM (NULL host, port outside 0..65535; a
 *         non-loopback host without a token; a token that is malformed or
 *         whose file others can read), KVF_ERR_NO_MEMORY.
 */
KVF_API kvf_status_t kvf_bootstrap_create(const char *host, int port,
                                          kvf_bootstrap_t **bootstrap_p);

/**
 * kvf_bootstrap_create() whose token has one more source, after the
 * variables: `api_key` (SGLang's --api-key, which SGLang's own bootstrap
 * server falls back to; NULL or "": none), as kvf_auth_token_resolve()
 * orders them.  Same returns.
 */
KVF_API kvf_status_t kvf_bootstrap_create_keyed(const char *host, int port,
                                                const char *api_key,
                                                kvf_bootstrap_t **bootstrap_p);

/** @return the port the registry listens on. */
KVF_API int kvf_bootstrap_port(const kvf_bootstrap_t *bootstrap);

/**
 * @return who may change the registry: "token" (holders of the cluster
 *         token), "protected" (loopback clients) or "open" (anyone);
 *         static text.
 */
KVF_API const char *kvf_bootstrap_access(const kvf_bootstrap_t *bootstrap);

/** Stop the registry and free it.  Blocks until its thread has stopped. */
KVF_API void kvf_bootstrap_destroy(kvf_bootstrap_t *bootstrap);

/**
 * The cluster token this process's engines and registries would use, and
 * where it comes from: the one rule for every caller (the Python adapters
 * ask here rather than read the variables themselves).  First found of
 * KVF_AUTH_TOKEN, KVF_AUTH_TOKEN_FILE (a file only its owner may read;
 * trailing newline stripped), SGLANG_DISAGGREGATION_BOOTSTRAP_AUTH_TOKEN,
 * then `api_key` (SGLang's --api-key, its own fallback; NULL or "": none).
 * Reads the environment and possibly a file: call it at setup.  Any thread.
 *
 * @param [in]  api_key     the last source, or NULL
 * @param [out] token       the token, NUL-terminated; "" when none is set
 * @param [in]  len         bytes at token; 513 holds any token
 * @param [out] source      where it came from ("KVF_AUTH_TOKEN",
 *                          "KVF_AUTH_TOKEN_FILE (/path)",
 *                          "SGLANG_DISAGGREGATION_BOOTSTRAP_AUTH_TOKEN",
 *                          "the API key (--api-key)"; "" when none); may
 *                          be NULL
 * @param [in]  source_len  bytes at source
 * @return KVF_OK (token may be ""), KVF_ERR_INVALID_PARAM (a malformed
 *         token, a token file others may read or write, NULL token or
 *         len 0, len too small), KVF_ERR_IO (the token file cannot be
 *         read); on error token is "" and kvf_last_error() says which
 *         source and what to do.
 */
KVF_API kvf_status_t kvf_auth_token_resolve(const char *api_key, char *token,
                                            size_t len, char *source,
                                            size_t source_len);

/* ------------------------------------------------------------------------ */
/* Logging                                                                  */
/* ------------------------------------------------------------------------ */

typedef enum kvf_log_level {
    KVF_LOG_ERROR = 0,
    KVF_LOG_WARN  = 1,
    KVF_LOG_INFO  = 2,
    KVF_LOG_DEBUG = 3
} kvf_log_level_t;

/** Set the log level (default from KVF_LOG: error|warn|info|debug; else warn). */
KVF_API void kvf_log_set_level(kvf_log_level_t level);

/**
 * The last error the library reported on the calling thread, whatever the
 * log level: a refused call says here which argument or state and what to
 * do.  "" when there is none.  Thread-local; valid until the thread's next
 * call into the library.
 */
KVF_API const char *kvf_last_error(void);

#ifdef __cplusplus
}
#endif

#endif /* KVFERRY_KVFERRY_H */
