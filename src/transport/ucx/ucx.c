/*
 * The ucx transport (see ucx.h): one UCP context and worker per engine,
 * one endpoint per peer, payload by ucp_get_nbx from the peer's registered
 * memory into ours.
 *
 * The one idea: a read is a batch of gets that ends exactly once.  All
 * gets are issued at once (UCX pipelines them over its lanes) and the
 * read returns; the worker's fd wakes the engine, kvf_ucx_progress counts
 * the callbacks, and a batch whose every request called back is handed
 * back (the read's done).  A batch that cannot finish (the peer died, or
 * did not answer within its deadline, checked every tick) is stopped by
 * force-closing the endpoint, which makes UCX complete every outstanding
 * request with an error: so when a batch is handed back, whatever the
 * outcome, no get of it can still write into local memory, and the engine
 * may hand the room's pages back.
 *
 * Blob layout (all little-endian, every length explicit):
 *
 *   u32 version (1)
 *   u32 addr_len   | addr_len bytes: the UCP worker address
 *   u32 nregions   | per region: u64 base, u64 length, u32 rkey_len,
 *                    rkey_len bytes: the packed remote key
 */
#include "transport/ucx/ucx.h"

#include <errno.h>
#include <poll.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <ucp/api/ucp.h>

#include "transport/ucx/bounds.h"
#include "util/log.h"
#include "util/region.h"
#include "util/time.h"
#include "wire/wire.h"

#define BLOB_VERSION     1u
#define REGION_HDR       20u     /* u64 base, u64 len, u32 rkey_len */
#define IDLE_SPINS       16      /* empty progress calls before sleeping */
#define IDLE_SLEEP_MS    10      /* longest sleep on the worker fd */

typedef struct region {          /* one of our registered regions */
    uint64_t   base, len;
    ucp_mem_h  memh;
    void      *rkey_buf;         /* packed remote key (ucp_rkey_buffer_release) */
    size_t     rkey_len;
} region_t;

typedef struct rregion {         /* one region of the peer */
    uint64_t   base, len;
    ucp_rkey_h rkey;
} rregion_t;

struct kvf_ucx {
    kvf_mover_t   base;          /* first: the mover */
    ucp_context_h ctx;
    ucp_worker_h  worker;
    int           efd;           /* ucp_worker_get_efd, or -1 */
    ucp_address_t *addr;
    size_t        addr_len;
    uint64_t      mem_types;     /* UCS_BIT(ucs_memory_type_t) this UCX carries */
    region_t     *regs;          /* sorted by base */
    size_t        nregs, capregs;
    kvf_ucx_ep_t *eps;           /* open endpoints, and zombies (below) */
};

/* One read: its gets, and how many of them called back. */
typedef struct batch {
    kvf_mover_read_t *rd;
    uint64_t          deadline_ms;
    unsigned          timeout_ms;
    size_t            npieces;
    size_t            nreqs, ndone;  /* requests UCX returned / called back */
    ucs_status_t      err;           /* first failed request, or issuing */
    struct batch     *next;
    void             *reqs[];
} batch_t;

struct kvf_ucx_ep {
    kvf_mover_ep_t base;         /* first: the mover endpoint */
    kvf_ucx_t    *u;
    ucp_ep_h      ep;            /* NULL once closed */
    rregion_t    *regs;          /* sorted by base */
    size_t        nregs;
    /* Set by the error callback, or by a timed-out read. */
    ucs_status_t  failed;
    int           timed_out;     /* failed because a read timed out */
    char          why[160];
    batch_t      *batches;       /* reads in flight, oldest first */
    batch_t     **batches_tail;
    /* A zombie: disconnected, but UCX may still call back into it (its close
     * did not finish in time); freed by kvf_ucx_destroy after the worker. */
    int           zombie;
    void         *close_req;
    kvf_ucx_ep_t *next, **pprev;
};

int kvf_ucx_available(void)
{
    return 1;
}

const char *kvf_ucx_version(void)
{
    return ucp_get_version_string();
}

int kvf_ucx_survives_peer_death(void)
{
    unsigned major, minor, release;
    ucp_get_version(&major, &minor, &release);
    return major > 1 || (major == 1 && minor >= 14);
}

/* ---------------------------------------------------------------- context */

kvf_status_t kvf_ucx_create(kvf_ucx_t **u_p, char *err, size_t errlen)
{
    kvf_ucx_t *u = calloc(1, sizeof(*u));
    ucp_config_t *config = NULL;
    ucs_status_t st;
    if (u == NULL) {
        snprintf(err, errlen, "out of memory creating the UCX transport");
        return KVF_ERR_NO_MEMORY;
    }
    u->efd = -1;
    u->base.ops = &kvf_ucx_mover;

    st = ucp_config_read(NULL, NULL, &config);
    if (st != UCS_OK) {
        snprintf(err, errlen, "UCX configuration rejected: %s (check the UCX_* "
                 "environment variables, e.g. UCX_TLS)", ucs_status_string(st));
        goto fail;
    }
    ucp_params_t params = {
        .field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED |
                      UCP_PARAM_FIELD_NAME,
        .features = UCP_FEATURE_RMA | UCP_FEATURE_WAKEUP,
        .mt_workers_shared = 0,
        .name = "kvferry",
    };
    st = ucp_init(&params, config, &u->ctx);
    ucp_config_release(config);
    if (st != UCS_OK) {
        snprintf(err, errlen, "UCX could not start: %s (is a UCX transport usable "
                 "here? see `ucx_info -d` and UCX_TLS)", ucs_status_string(st));
        goto fail;
    }

    ucp_context_attr_t cattr = {.field_mask = UCP_ATTR_FIELD_MEMORY_TYPES};
    if (ucp_context_query(u->ctx, &cattr) == UCS_OK)
        u->mem_types = cattr.memory_types;
    u->mem_types |= UCS_BIT(UCS_MEMORY_TYPE_HOST);

    /* The engine serialises every call under its lock. */
    ucp_worker_params_t wparams = {
        .field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE,
        .thread_mode = UCS_THREAD_MODE_SERIALIZED,
    };
    st = ucp_worker_create(u->ctx, &wparams, &u->worker);
    if (st != UCS_OK) {
        snprintf(err, errlen, "UCX worker creation failed: %s", ucs_status_string(st));
        goto fail;
    }
    if (ucp_worker_get_efd(u->worker, &u->efd) != UCS_OK) {
        kvf_debug("ucx: no worker fd: progress is polled");
        u->efd = -1;
    }
    st = ucp_worker_get_address(u->worker, &u->addr, &u->addr_len);
    if (st != UCS_OK) {
        snprintf(err, errlen, "UCX worker address unavailable: %s", ucs_status_string(st));
        goto fail;
    }
    kvf_debug("ucx: worker up, address %zu bytes", u->addr_len);
    *u_p = u;
    return KVF_OK;

fail:
    kvf_error("%s", err);
    kvf_ucx_destroy(u);
    return KVF_ERR_UNSUPPORTED;
}

static void ep_release(kvf_ucx_ep_t *ep);
static void ep_close(kvf_ucx_ep_t *ep);
static void ep_fail(kvf_ucx_ep_t *ep, ucs_status_t st, int timed_out, const char *why);
static void reap_zombies(kvf_ucx_t *u);

int kvf_ucx_fd(const kvf_ucx_t *u)
{
    return u->efd;
}

#define PROGRESS_BUDGET 1024   /* progress calls before yielding to the loop */

static void finish_batches(kvf_ucx_t *u);

int kvf_ucx_progress(kvf_ucx_t *u)
{
    for (int budget = PROGRESS_BUDGET; budget > 0;) {
        while (budget > 0 && ucp_worker_progress(u->worker) != 0)
            budget--;
        finish_batches(u);
        reap_zombies(u);
        if (u->efd < 0)
            return 0;
        /* BUSY: events arrived after the last progress; serve them first. */
        ucs_status_t st = ucp_worker_arm(u->worker);
        if (st == UCS_OK)
            return 0;
        if (st != UCS_ERR_BUSY) {
            kvf_warn("ucx: cannot arm the worker fd: %s", ucs_status_string(st));
            return 1;
        }
        budget--;
    }
    return 1;
}

void kvf_ucx_destroy(kvf_ucx_t *u)
{
    if (u == NULL)
        return;
    for (kvf_ucx_ep_t *ep = u->eps; ep != NULL; ep = ep->next) {
        if (!ep->zombie) {
            kvf_warn("ucx: an endpoint was still open at destroy; closing it");
            ep_close(ep);
        }
    }
    /*
     * Let closes under way finish, for a bounded time: this is teardown,
     * where waiting is expected, and a peer whose worker still talks to a
     * half-closed endpoint of ours can trip UCX 1.13's wireup assertion
     * (ucp_request.c:684) once our worker is gone.  What is still under
     * way then is released: UCX insists that no request be left
     * unreleased.
     */
    uint64_t deadline = kvf_now_ms() + KVF_UCX_CLOSE_MS;
    for (int busy = 1; busy && kvf_now_ms() < deadline;) {
        busy = 0;
        for (kvf_ucx_ep_t *ep = u->eps; ep != NULL && !busy; ep = ep->next)
            busy = ep->close_req != NULL &&
                   ucp_request_check_status(ep->close_req) == UCS_INPROGRESS;
        if (busy && ucp_worker_progress(u->worker) == 0)
            sched_yield();
    }
    for (kvf_ucx_ep_t *ep = u->eps; ep != NULL; ep = ep->next) {
        if (ep->close_req != NULL)
            ucp_request_free(ep->close_req);
        ep->close_req = NULL;
        for (batch_t *b = ep->batches; b != NULL; b = b->next)
            for (size_t i = 0; i < b->nreqs; i++)
                ucp_request_free(b->reqs[i]);
    }
    if (u->addr != NULL)
        ucp_worker_release_address(u->worker, u->addr);
    if (u->worker != NULL)
        ucp_worker_destroy(u->worker);
    /* No callback can run any more, and no get can land: hand back the
     * reads still in flight, and free the zombies. */
    while (u->eps != NULL) {
        kvf_ucx_ep_t *ep = u->eps;
        u->eps = ep->next;
        while (ep->batches != NULL) {
            batch_t *b = ep->batches;
            ep->batches = b->next;
            b->rd->done(b->rd, KVF_ERR_CONN_RESET, "the UCX transport was shut down "
                        "while the read was in flight");
            free(b);
        }
        ep_release(ep);
    }
    for (size_t i = 0; i < u->nregs; i++) {
        ucp_rkey_buffer_release(u->regs[i].rkey_buf);
        ucp_mem_unmap(u->ctx, u->regs[i].memh);
    }
    free(u->regs);
    if (u->ctx != NULL)
        ucp_cleanup(u->ctx);
    free(u);
}

kvf_status_t kvf_ucx_transports(const kvf_ucx_t *u, kvf_ucx_tl_t *tls, size_t max,
                                size_t *n_p, char *err, size_t errlen)
{
    return kvf__ucx_list_tls(u->ctx, tls, max, n_p, err, errlen);
}

/* ----------------------------------------------------------- registration */

kvf_status_t kvf_ucx_register(kvf_ucx_t *u, void *base, size_t len, kvf_mem_kind_t kind,
                              char *err, size_t errlen)
{
    ucs_memory_type_t mt;
    if (base == NULL || len == 0) {
        snprintf(err, errlen, "UCX registration of an empty region (%p, %zu bytes)", base,
                 len);
        return KVF_ERR_INVALID_PARAM;
    }
    switch (kind) {
    case KVF_MEM_HOST: mt = UCS_MEMORY_TYPE_HOST; break;
    case KVF_MEM_CUDA: mt = UCS_MEMORY_TYPE_CUDA; break;
    default:
        snprintf(err, errlen, "unknown memory kind %d", (int)kind);
        return KVF_ERR_INVALID_PARAM;
    }
    if (!(u->mem_types & UCS_BIT(mt))) {
        snprintf(err, errlen, "this UCX build cannot carry %s memory (install UCX "
                 "with its CUDA module, e.g. ucx-cuda, and check `ucx_info -d`), or "
                 "use host memory", ucs_memory_type_names[mt]);
        kvf_error("%s", err);
        return KVF_ERR_UNSUPPORTED;
    }
    if (u->nregs == u->capregs) {
        size_t cap = u->capregs ? 2 * u->capregs : 16;
        region_t *r = realloc(u->regs, cap * sizeof(*r));
        if (r == NULL) {
            snprintf(err, errlen, "out of memory registering a UCX region");
            return KVF_ERR_NO_MEMORY;
        }
        u->regs = r;
        u->capregs = cap;
    }

    region_t r = {.base = (uint64_t)(uintptr_t)base, .len = len};
    /* Peers read registered memory and never write it, so the key asks for
     * remote read only; UCX does not honour that (it registers for every
     * access its features need: an RDMA key also lets its holder write
     * into the region, docs/SECURITY.md).  Only authenticated peers ever
     * get a key, and a prefill engine offers keys only over transports
     * that confine them to the region (bounds.c). */
    ucp_mem_map_params_t mp = {
        .field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                      UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE | UCP_MEM_MAP_PARAM_FIELD_PROT,
        .address = base,
        .length = len,
        .memory_type = mt,
        .prot = UCP_MEM_MAP_PROT_LOCAL_READ | UCP_MEM_MAP_PROT_LOCAL_WRITE |
                UCP_MEM_MAP_PROT_REMOTE_READ,
    };
    ucs_status_t st = ucp_mem_map(u->ctx, &mp, &r.memh);
    if (st != UCS_OK) {
        snprintf(err, errlen, "UCX cannot register %zu bytes at %p: %s (locked-memory "
                 "limit? see `ulimit -l`)", len, base, ucs_status_string(st));
        kvf_error("%s", err);
        return KVF_ERR_IO;
    }
    st = ucp_rkey_pack(u->ctx, r.memh, &r.rkey_buf, &r.rkey_len);
    if (st != UCS_OK) {
        snprintf(err, errlen, "UCX cannot pack the remote key of %p: %s", base,
                 ucs_status_string(st));
        kvf_error("%s", err);
        ucp_mem_unmap(u->ctx, r.memh);
        return KVF_ERR_IO;
    }
    /* Keep the array sorted by base (few regions: insertion is fine). */
    size_t i = u->nregs;
    while (i > 0 && u->regs[i - 1].base > r.base) {
        u->regs[i] = u->regs[i - 1];
        i--;
    }
    u->regs[i] = r;
    u->nregs++;
    return KVF_OK;
}

kvf_status_t kvf_ucx_pack(kvf_ucx_t *u, kvf_buf_t *out)
{
    size_t total = 4 + 4 + u->addr_len + 4;
    for (size_t i = 0; i < u->nregs; i++)
        total += REGION_HDR + u->regs[i].rkey_len;
    if (total > KVF_WIRE_MAX_BLOB) {
        kvf_error("ucx: the XPORT blob would be %zu bytes (%zu regions), over the %u-byte "
                  "limit; register fewer, larger buffers", total, u->nregs,
                  KVF_WIRE_MAX_BLOB);
        return KVF_ERR_UNSUPPORTED;
    }
    kvf_status_t s = kvf_buf_reserve(out, total);
    if (s != KVF_OK)
        return s;
    uint8_t *p = out->data + out->len;
    kvf_put_u32(p, BLOB_VERSION);
    kvf_put_u32(p + 4, (uint32_t)u->addr_len);
    memcpy(p + 8, u->addr, u->addr_len);
    p += 8 + u->addr_len;
    kvf_put_u32(p, (uint32_t)u->nregs);
    p += 4;
    for (size_t i = 0; i < u->nregs; i++) {
        const region_t *r = &u->regs[i];
        kvf_put_u64(p, r->base);
        kvf_put_u64(p + 8, r->len);
        kvf_put_u32(p + 16, (uint32_t)r->rkey_len);
        memcpy(p + REGION_HDR, r->rkey_buf, r->rkey_len);
        p += REGION_HDR + r->rkey_len;
    }
    out->len += total;
    return KVF_OK;
}

/* -------------------------------------------------------------- endpoints */

static void ep_err_cb(void *arg, ucp_ep_h uep, ucs_status_t status)
{
    kvf_ucx_ep_t *ep = arg;
    if (ep->failed != UCS_OK)
        return;
    ep->failed = status;
    snprintf(ep->why, sizeof(ep->why), "UCX endpoint failed: %s", ucs_status_string(status));
    if (!ep->zombie)
        kvf_warn("ucx: %s (the peer died or the network to it is cut)", ep->why);
}

static void ep_release(kvf_ucx_ep_t *ep)
{
    free(ep->regs);
    free(ep);
}

/*
 * Destroy the remote keys and start closing the UCX endpoint; never waits.
 * A close UCX does not finish at once (a graceful one waits for the peer,
 * which may be stopped) leaves ep->close_req set: kvf_ucx_progress frees
 * the request, and the endpoint, when UCX completes it.
 */
static void ep_close(kvf_ucx_ep_t *ep)
{
    for (size_t i = 0; i < ep->nregs; i++)
        if (ep->regs[i].rkey != NULL) {
            ucp_rkey_destroy(ep->regs[i].rkey);
            ep->regs[i].rkey = NULL;
        }
    if (ep->ep == NULL)
        return;
    /* A healthy endpoint closes gracefully (UCX tells the peer); a failed
     * one can only be discarded, and so can one with reads in flight: only
     * a forced close stops a get (its request completes with an error). */
    if (ep->batches != NULL)
        ep_fail(ep, UCS_ERR_CANCELED, 0, "the UCX endpoint was closed while a read was "
                "in flight");
    ucp_request_param_t prm = {
        .op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS,
        .flags = ep->failed != UCS_OK ? UCP_EP_CLOSE_FLAG_FORCE : 0,
    };
    void *req = ucp_ep_close_nbx(ep->ep, &prm);
    ep->ep = NULL;
    if (req != NULL && !UCS_PTR_IS_ERR(req))
        ep->close_req = req;
}

static void ep_unlink(kvf_ucx_ep_t *ep)
{
    if (ep->pprev != NULL) {
        *ep->pprev = ep->next;
        if (ep->next)
            ep->next->pprev = ep->pprev;
    }
    ep->pprev = NULL;
    ep->next = NULL;
}

/* Free disconnected endpoints that UCX is done with.  A zombie lingers for
 * as long as its close or a read of it is outstanding: UCX may still call
 * back into it, and a get of it may still land. */
static void reap_zombies(kvf_ucx_t *u)
{
    for (kvf_ucx_ep_t *ep = u->eps, *next; ep != NULL; ep = next) {
        next = ep->next;
        if (!ep->zombie)
            continue;
        if (ep->close_req != NULL && ucp_request_check_status(ep->close_req) != UCS_INPROGRESS) {
            ucp_request_free(ep->close_req);
            ep->close_req = NULL;
        }
        if (ep->close_req == NULL && ep->batches == NULL) {
            ep_unlink(ep);
            ep_release(ep);
        }
    }
}

static int rregion_cmp(const void *a, const void *b)
{
    const rregion_t *x = a, *y = b;
    return x->base < y->base ? -1 : x->base > y->base;
}

/* A peer's offer, checked: where its parts lie in the blob. */
typedef struct ucx_offer {
    const uint8_t *addr;          /* the peer's worker address */
    size_t         addr_len;
    size_t         nregs;
    size_t         first;         /* offset of the first region */
} ucx_offer_t;

/* The region list from o->first: every region's header and key inside
 * the blob, and nothing after the last.  KVF_OK, or KVF_ERR_PROTOCOL and
 * err. */
static kvf_status_t check_regions(const uint8_t *blob, size_t len,
                                  const ucx_offer_t *o, char *err,
                                  size_t errlen)
{
    size_t off = o->first;

    for (size_t i = 0; i < o->nregs; i++) {
        if (len - off < REGION_HDR)
            goto truncated;
        uint64_t base = kvf_get_u64(blob + off), rlen = kvf_get_u64(blob + off + 8);
        size_t klen = kvf_get_u32(blob + off + 16);
        off += REGION_HDR;
        if (rlen == 0 || base + rlen < base || klen == 0 || klen > len - off) {
            if (klen > len - off)
                goto truncated;
            snprintf(err, errlen, "malformed ucx offer: region %zu (base 0x%llx, %llu "
                     "bytes, key %zu bytes)", i, (unsigned long long)base,
                     (unsigned long long)rlen, klen);
            return KVF_ERR_PROTOCOL;
        }
        off += klen;
    }
    if (off != len) {
        snprintf(err, errlen, "malformed ucx offer: %zu trailing bytes", len - off);
        return KVF_ERR_PROTOCOL;
    }
    return KVF_OK;

truncated:
    snprintf(err, errlen, "malformed ucx offer: truncated region list (%zu bytes)", len);
    return KVF_ERR_PROTOCOL;
}

/* The whole offer, parsed before anything touches UCX: version, worker
 * address, region count, then the regions.  KVF_OK and *o, or
 * KVF_ERR_PROTOCOL and err. */
static kvf_status_t parse_offer(const uint8_t *blob, size_t len, ucx_offer_t *o,
                                char *err, size_t errlen)
{
    if (len < 12 || len > KVF_WIRE_MAX_BLOB) {
        snprintf(err, errlen, "malformed ucx offer: %zu bytes", len);
        return KVF_ERR_PROTOCOL;
    }
    if (kvf_get_u32(blob) != BLOB_VERSION) {
        snprintf(err, errlen, "ucx offer of version %u, this build reads version %u: "
                 "run the same kvferry build on both sides", kvf_get_u32(blob), BLOB_VERSION);
        return KVF_ERR_PROTOCOL;
    }
    size_t addr_len = kvf_get_u32(blob + 4), off = 8;
    if (addr_len == 0 || addr_len > len - off || len - off - addr_len < 4) {
        snprintf(err, errlen, "malformed ucx offer: worker address of %zu bytes in a "
                 "%zu-byte blob", addr_len, len);
        return KVF_ERR_PROTOCOL;
    }
    o->addr = blob + off;
    o->addr_len = addr_len;
    off += addr_len;
    o->nregs = kvf_get_u32(blob + off);
    off += 4;
    if (o->nregs > (len - off) / REGION_HDR) {
        snprintf(err, errlen, "malformed ucx offer: %zu regions in %zu bytes", o->nregs,
                 len - off);
        return KVF_ERR_PROTOCOL;
    }
    o->first = off;
    return check_regions(blob, len, o, err, errlen);
}

/* The UCX endpoint to the worker at addr, with peer-failure detection,
 * linked into u's list.  KVF_OK, or KVF_ERR_UNREACHABLE and err. */
static kvf_status_t ep_open(kvf_ucx_t *u, kvf_ucx_ep_t *ep, void *addr,
                            char *err, size_t errlen)
{
    ucp_ep_params_t epp = {
        .field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS |
                      UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | UCP_EP_PARAM_FIELD_ERR_HANDLER,
        .address = addr,
        .err_mode = UCP_ERR_HANDLING_MODE_PEER,
        .err_handler = {.cb = ep_err_cb, .arg = ep},
    };
    ucs_status_t st = ucp_ep_create(u->worker, &epp, &ep->ep);
    if (st != UCS_OK) {
        ep->ep = NULL;
        /* PEER error handling is not optional: without it UCX can leave a
         * get to a dead or stopped peer outstanding even after a forced
         * close, and its bytes could land after the room's pages were
         * handed back.  UCX 1.13's shared-memory transports (posix, sysv)
         * cannot report peer failure, so UCX refuses them here. */
        snprintf(err, errlen, "UCX cannot reach the peer with peer-failure detection "
                 "(%s): UCX_TLS needs a transport both sides have that reports dead "
                 "peers (tcp, rc, dc; not posix/sysv in UCX 1.13); on one host use "
                 "--transport shm", ucs_status_string(st));
        return KVF_ERR_UNREACHABLE;
    }
    /* Linked before anything can fail, so that the cleanup below is ep_close. */
    ep->next = u->eps;
    if (u->eps)
        u->eps->pprev = &ep->next;
    ep->pprev = &u->eps;
    u->eps = ep;
    return KVF_OK;
}

/* The peer's remote keys, one per region (tmp: room for an aligned copy
 * of any key).  KVF_OK, or the error and err; ep->nregs counts the
 * regions tried, for the cleanup. */
static kvf_status_t unpack_rkeys(kvf_ucx_ep_t *ep, const uint8_t *blob,
                                 const ucx_offer_t *o, void *tmp, char *err,
                                 size_t errlen)
{
    size_t off = o->first;

    for (size_t i = 0; i < o->nregs; i++) {
        rregion_t *r = &ep->regs[i];
        r->base = kvf_get_u64(blob + off);
        r->len = kvf_get_u64(blob + off + 8);
        size_t klen = kvf_get_u32(blob + off + 16);
        memcpy(tmp, blob + off + REGION_HDR, klen);
        off += REGION_HDR + klen;
        ucs_status_t st = ucp_ep_rkey_unpack(ep->ep, tmp, &r->rkey);
        ep->nregs = i + 1;
        if (st != UCS_OK) {
            r->rkey = NULL;
            snprintf(err, errlen, "UCX cannot use the peer's remote key for region %zu: "
                     "%s (the peer's memory is not reachable with our UCX transports)",
                     i, ucs_status_string(st));
            return st == UCS_ERR_NO_MEMORY ? KVF_ERR_NO_MEMORY : KVF_ERR_UNREACHABLE;
        }
    }
    return KVF_OK;
}

kvf_status_t kvf_ucx_connect(kvf_ucx_t *u, const uint8_t *blob, size_t len,
                             kvf_ucx_ep_t **ep_p, char *err, size_t errlen)
{
    kvf_status_t s;
    kvf_ucx_ep_t *ep = NULL;
    void *addr = NULL, *tmp = NULL;
    ucx_offer_t o;

    /* Parse everything before touching UCX. */
    if ((s = parse_offer(blob, len, &o, err, errlen)) != KVF_OK)
        goto out;

    s = KVF_ERR_NO_MEMORY;
    ep = calloc(1, sizeof(*ep));
    addr = malloc(o.addr_len);
    tmp = malloc(len);   /* aligned copies of the keys */
    if (ep == NULL || addr == NULL || tmp == NULL ||
        (o.nregs && (ep->regs = calloc(o.nregs, sizeof(*ep->regs))) == NULL)) {
        snprintf(err, errlen, "out of memory connecting a UCX endpoint");
        goto out;
    }
    memcpy(addr, o.addr, o.addr_len);
    ep->base.ops = &kvf_ucx_mover;
    ep->u = u;
    ep->failed = UCS_OK;
    ep->batches_tail = &ep->batches;
    if ((s = ep_open(u, ep, addr, err, errlen)) != KVF_OK ||
        (s = unpack_rkeys(ep, blob, &o, tmp, err, errlen)) != KVF_OK)
        goto out;
    qsort(ep->regs, ep->nregs, sizeof(*ep->regs), rregion_cmp);
    kvf_debug("ucx: connected, %zu remote regions", ep->nregs);
    *ep_p = ep;
    ep = NULL;
    s = KVF_OK;
    goto done;

out:
    kvf_error("%s", err);
done:
    if (ep != NULL) {
        if (ep->ep != NULL)
            kvf_ucx_disconnect(ep);
        else
            ep_release(ep);
    }
    free(addr);
    free(tmp);
    return s;
}

void kvf_ucx_disconnect(kvf_ucx_ep_t *ep)
{
    if (ep == NULL)
        return;
    ep_close(ep);
    ep->zombie = 1;     /* freed by reap_zombies, now or once UCX is done */
    reap_zombies(ep->u);
}

/* ------------------------------------------------------------------ reads */

static void get_cb(void *request, ucs_status_t status, void *user_data)
{
    batch_t *b = user_data;
    (void)request;
    b->ndone++;
    if (status != UCS_OK && b->err == UCS_OK)
        b->err = status;
}

/* The endpoint can read nothing any more: say why once, for every read. */
static void ep_fail(kvf_ucx_ep_t *ep, ucs_status_t st, int timed_out, const char *why)
{
    if (ep->failed != UCS_OK)
        return;
    ep->failed = st;
    ep->timed_out = timed_out;
    snprintf(ep->why, sizeof(ep->why), "%s", why);
    kvf_warn("ucx: %s", ep->why);
}

/* Hand back, in order, the batches every request of which called back;
 * stop the endpoint (force-close) when one failed, which completes the
 * others with an error. */
static void finish_batches(kvf_ucx_t *u)
{
    for (kvf_ucx_ep_t *ep = u->eps; ep != NULL; ep = ep->next) {
        while (ep->batches != NULL && ep->batches->ndone == ep->batches->nreqs) {
            batch_t *b = ep->batches;
            ep->batches = b->next;
            if (ep->batches == NULL)
                ep->batches_tail = &ep->batches;
            for (size_t i = 0; i < b->nreqs; i++)
                ucp_request_free(b->reqs[i]);
            if (b->err != UCS_OK) {
                char why[160];
                /* A failed request without an endpoint error: the peer's
                 * memory is not readable any more all the same. */
                snprintf(why, sizeof(why), "UCX read failed: %s", ucs_status_string(b->err));
                ep_fail(ep, b->err, 0, why);
                ep_close(ep);
            }
            if (b->err == UCS_OK)
                b->rd->done(b->rd, KVF_OK, NULL);
            else
                b->rd->done(b->rd, ep->timed_out ? KVF_ERR_PEER_TIMEOUT : KVF_ERR_CONN_RESET,
                            ep->why);
            free(b);
        }
    }
}

void kvf_ucx_tick(kvf_ucx_ep_t *ep)
{
    batch_t *b = ep->batches;
    if (b == NULL || ep->ep == NULL || kvf_now_ms() < b->deadline_ms)
        return;
    char why[160];
    snprintf(why, sizeof(why), "the peer did not serve a UCX read of %zu pieces within "
             "%u ms (stopped or overloaded)", b->npieces, b->timeout_ms);
    ep_fail(ep, UCS_ERR_TIMED_OUT, 1, why);
    ep_close(ep);   /* forced: its gets complete with an error */
}

kvf_status_t kvf_ucx_read(kvf_ucx_ep_t *ep, kvf_mover_read_t *rd, struct iovec *local,
                          struct iovec *remote, size_t n, unsigned timeout_ms, char *err,
                          size_t errlen)
{
    kvf_ucx_t *u = ep->u;

    if (ep->failed != UCS_OK || ep->ep == NULL) {
        snprintf(err, errlen, "%s", ep->why[0] ? ep->why : "UCX endpoint closed");
        return ep->timed_out ? KVF_ERR_PEER_TIMEOUT : KVF_ERR_CONN_RESET;
    }
    /* Check every piece before issuing any. */
    for (size_t i = 0; i < n; i++) {
        uint64_t ra = (uint64_t)(uintptr_t)remote[i].iov_base, len = remote[i].iov_len;
        uint64_t la = (uint64_t)(uintptr_t)local[i].iov_base;
        if (local[i].iov_len != len) {
            snprintf(err, errlen, "UCX read piece %zu: local %zu bytes, remote %llu", i,
                     local[i].iov_len, (unsigned long long)len);
            return KVF_ERR_INVALID_PARAM;
        }
        if (len == 0)
            continue;
        if (kvf_region_find(ep->regs, sizeof(rregion_t), ep->nregs, ra, len) == SIZE_MAX) {
            snprintf(err, errlen, "the peer asked for a read of %llu bytes at 0x%llx, "
                     "outside every region it registered", (unsigned long long)len,
                     (unsigned long long)ra);
            kvf_error("ucx: %s", err);
            return KVF_ERR_PROTOCOL;
        }
        if (kvf_region_find(u->regs, sizeof(region_t), u->nregs, la, len) == SIZE_MAX) {
            snprintf(err, errlen, "UCX read destination %p (+%llu) is not registered "
                     "memory", local[i].iov_base, (unsigned long long)len);
            kvf_error("ucx: %s", err);
            return KVF_ERR_INVALID_PARAM;
        }
    }
    batch_t *b = malloc(sizeof(*b) + n * sizeof(void *));
    if (b == NULL) {
        snprintf(err, errlen, "out of memory for %zu UCX reads", n);
        return KVF_ERR_NO_MEMORY;
    }
    *b = (batch_t){.rd = rd, .deadline_ms = kvf_now_ms() + timeout_ms,
                   .timeout_ms = timeout_ms, .npieces = n};
    for (size_t i = 0; i < n && b->err == UCS_OK; i++) {
        size_t len = remote[i].iov_len;
        if (len == 0)
            continue;
        uint64_t ra = (uint64_t)(uintptr_t)remote[i].iov_base;
        uint64_t la = (uint64_t)(uintptr_t)local[i].iov_base;
        size_t r = kvf_region_find(ep->regs, sizeof(rregion_t), ep->nregs, ra, len);
        size_t l = kvf_region_find(u->regs, sizeof(region_t), u->nregs, la, len);
        ucp_request_param_t prm = {
            .op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                            UCP_OP_ATTR_FIELD_MEMH,
            .cb.send = get_cb,
            .user_data = b,
            .memh = u->regs[l].memh,
        };
        void *req = ucp_get_nbx(ep->ep, local[i].iov_base, len, ra, ep->regs[r].rkey, &prm);
        if (UCS_PTR_IS_ERR(req))
            b->err = UCS_PTR_STATUS(req);
        else if (req != NULL)
            b->reqs[b->nreqs++] = req;
    }
    /* Queued even when every get finished at once or issuing failed: the
     * batch is handed back from progress, in order with the others. */
    b->next = NULL;
    *ep->batches_tail = b;
    ep->batches_tail = &b->next;
    return KVF_OK;
}

/* ------------------------------------------------------------------ mover */

static kvf_status_t mv_create(const kvf_mover_params_t *p, kvf_mover_t **m_p, char *err,
                              size_t errlen)
{
    kvf_ucx_t *u;
    kvf_status_t st = kvf_ucx_create(&u, err, errlen);
    if (st != KVF_OK)
        return st;
    /* A prefill engine hands out its worker address and keys: not where UCX
     * would let their holder past the registered regions. */
    if (p->role == KVF_ROLE_PREFILL &&
        (st = kvf__ucx_may_offer(u->ctx, err, errlen)) != KVF_OK) {
        kvf_ucx_destroy(u);
        return st;
    }
    for (size_t i = 0; i < p->n; i++) {
        st = kvf_ucx_register(u, p->bases[i], p->lens[i], p->kinds[i], err, errlen);
        if (st != KVF_OK) {
            kvf_ucx_destroy(u);
            return st;
        }
    }
    if (p->by_name && !kvf_ucx_survives_peer_death())
        kvf_warn("UCX %s can abort this process when a peer dies while UCX is still "
                 "setting up its connection (fixed in UCX 1.14, openucx/ucx#8175); "
                 "prefer UCX >= 1.14 for --transport ucx", kvf_ucx_version());
    *m_p = &u->base;
    return KVF_OK;
}

static void mv_destroy(kvf_mover_t *m)
{
    kvf_ucx_destroy((kvf_ucx_t *)m);
}

static int mv_fd(const kvf_mover_t *m)
{
    return kvf_ucx_fd((const kvf_ucx_t *)m);
}

static int mv_progress(kvf_mover_t *m)
{
    return kvf_ucx_progress((kvf_ucx_t *)m);
}

/* The same blob for every peer: what makes it theirs alone is that only
 * authenticated peers ever see it (peer.c). */
static kvf_status_t mv_pack(kvf_mover_t *m, const kvf_mover_peer_t *peer, kvf_buf_t *out)
{
    (void)peer;
    return kvf_ucx_pack((kvf_ucx_t *)m, out);
}

static kvf_status_t mv_connect(kvf_mover_t *m, const uint8_t *blob, size_t len,
                               kvf_mover_ep_t **ep_p, char *why, size_t whylen)
{
    kvf_ucx_ep_t *ep;
    kvf_status_t st = kvf_ucx_connect((kvf_ucx_t *)m, blob, len, &ep, why, whylen);
    if (st == KVF_OK)
        *ep_p = &ep->base;
    return st;
}

static void mv_disconnect(kvf_mover_ep_t *ep)
{
    kvf_ucx_disconnect((kvf_ucx_ep_t *)ep);
}

static kvf_status_t mv_read(kvf_mover_ep_t *ep, kvf_mover_read_t *rd, struct iovec *local,
                            struct iovec *remote, size_t n, unsigned timeout_ms, char *err,
                            size_t errlen)
{
    return kvf_ucx_read((kvf_ucx_ep_t *)ep, rd, local, remote, n, timeout_ms, err, errlen);
}

static void mv_tick(kvf_mover_ep_t *ep)
{
    kvf_ucx_tick((kvf_ucx_ep_t *)ep);
}

/* A failed UCX endpoint stays failed: every later read fails at once. */
static int mv_ep_failed(const kvf_mover_ep_t *ep)
{
    const kvf_ucx_ep_t *e = (const kvf_ucx_ep_t *)ep;
    return e->failed != UCS_OK || e->ep == NULL;
}

const kvf_mover_ops_t kvf_ucx_mover = {
    .name = "ucx",
    /* A failed request closes the endpoint (finish_batches). */
    .caps = KVF_MOVER_CAP_PULL | KVF_MOVER_CAP_MEM_HOST | KVF_MOVER_CAP_MEM_DEVICE |
            KVF_MOVER_CAP_READ_FAIL_CLOSES_EP,
    .auto_ok = kvf_ucx_survives_peer_death,
    .create = mv_create,
    .destroy = mv_destroy,
    .fd = mv_fd,
    .progress = mv_progress,
    .pack = mv_pack,
    .connect = mv_connect,
    .disconnect = mv_disconnect,
    .tick = mv_tick,
    .read = mv_read,
    .ep_failed = mv_ep_failed,
};
