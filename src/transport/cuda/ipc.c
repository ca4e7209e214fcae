/*
 * The cuda mover: between two processes on one host, the decode engine
 * pulls from the prefill's device memory through CUDA IPC.
 *
 * The prefill's offer names every registered region: base, length, and
 * for device memory the IPC handle of the allocation that holds it
 * (cuIpcGetMemHandle) with the region's offset inside it.  The decode
 * opens each handle once (cuIpcOpenMemHandle), which maps the prefill's
 * allocation into its own address space, and reads DATA_REF pieces with
 * device-to-device copies on a stream of its own (a copier, copier.c: one
 * cuMemcpyBatchAsync per frame where the driver has it), handed back when
 * the batch's event says they ended.  Host regions (SGLang's aux) are
 * read with process_vm_readv, as shm does, a few bytes per room.
 *
 * Legacy IPC handles rather than cuMemExportToShareableHandle: they work
 * on the plain cudaMalloc memory that PyTorch's caching allocator hands
 * out (the shareable-handle path needs memory allocated through the VMM
 * API with a POSIX-fd handle type).  A handle is a capability on this
 * host: it goes only in an offer to an authenticated peer
 * (docs/SECURITY.md), as shm's cookie does.
 *
 * Checksums are not computed on this path: its bytes never pass through
 * host memory (mover.h, KVF_MOVER_CAP_NO_HOST_COPY).  Byte counts still are.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>
#include <unistd.h>

#include "transport/cuda/cuda.h"
#include "util/bootid.h"
#include "util/buf.h"
#include "util/log.h"
#include "util/region.h"

#define IPC_VERSION  1
#define HEAD_LEN     (4 + 4 + KVF_BOOT_ID_LEN + 4)   /* version, pid, boot id, nregions */
#define REGION_LEN   (8 + 8 + 4 + 8 + 64)            /* base, len, kind, offset, handle */
#define MAX_REGIONS  ((KVF_WIRE_MAX_BLOB - HEAD_LEN) / REGION_LEN)

/* A region: first base and len (kvf_region_find's layout). */
typedef struct region {
    uint64_t        base, len;
    int             device;
    uint64_t        offset;          /* of base in its allocation (device) */
    cu_ipc_handle_t handle;
    cu_ptr_t        mapped;          /* decode: the allocation, opened here */
} region_t;

typedef struct kvf_cuda {
    kvf_mover_t        base;         /* first */
    kvf_role_t         role;
    const kvf_cudrv_t *d;
    cu_ctx_t           ctx;
    int                dev;
    kvf_copier_t      *copier;       /* decode: the stream its reads run on */
    region_t          *own;          /* every registered buffer, sorted by base */
    size_t             nown;
} kvf_cuda_t;

typedef struct kvf_cuda_ep {
    kvf_mover_ep_t base;             /* first */
    kvf_cuda_t    *m;
    pid_t          pid;
    region_t      *regs;             /* the peer's, sorted by base */
    size_t         nregs;
    size_t         inflight;         /* reads started, not handed back */
    int            closed;           /* disconnected: freed once inflight is 0 */
} kvf_cuda_ep_t;

/* One read on the copier: the caller's record and the endpoint it holds. */
typedef struct ipc_read {
    kvf_copy_t        cp;            /* first: what the copier hands back */
    kvf_mover_read_t *rd;
    kvf_cuda_ep_t    *ep;
} ipc_read_t;

static int by_base(const void *a, const void *b)
{
    uint64_t x = ((const region_t *)a)->base, y = ((const region_t *)b)->base;
    return x < y ? -1 : x > y;
}

static void ep_free(kvf_cuda_ep_t *ep)
{
    const kvf_cudrv_t *d = ep->m->d;
    d->CtxSetCurrent(ep->m->ctx);
    for (size_t i = 0; i < ep->nregs; i++) {
        if (ep->regs[i].mapped == 0)
            continue;
        /* One mapping per allocation: close it once, for the first user. */
        cu_ptr_t p = ep->regs[i].mapped;
        for (size_t j = i; j < ep->nregs; j++)
            if (ep->regs[j].mapped == p)
                ep->regs[j].mapped = 0;
        d->IpcCloseMemHandle(p);
    }
    free(ep->regs);
    free(ep);
}

static void cuda_destroy(kvf_mover_t *base)
{
    kvf_cuda_t *m = (kvf_cuda_t *)base;
    if (m == NULL)
        return;
    if (m->copier != NULL) {
        kvf_cuda_copier.drain(m->copier);    /* every read is handed back */
        kvf_cuda_copier.destroy(m->copier);
    }
    m->d->DevicePrimaryCtxRelease(m->dev);
    free(m->own);
    free(m);
}

static kvf_status_t cuda_create(const kvf_mover_params_t *p, kvf_mover_t **m_p, char *err,
                                size_t errlen)
{
    if (p->mem_kind != KVF_MEM_CUDA || p->n == 0 || p->kinds[0] != KVF_MEM_CUDA) {
        snprintf(err, errlen, "the KV buffers are host memory (cuda moves device memory)");
        return KVF_ERR_UNSUPPORTED;
    }
    kvf_cuda_t *m = calloc(1, sizeof(*m));
    if (m == NULL || (m->own = calloc(p->n, sizeof(region_t))) == NULL) {
        free(m);
        snprintf(err, errlen, "out of memory");
        return KVF_ERR_NO_MEMORY;
    }
    m->base.ops = &kvf_cuda_mover;
    m->role = p->role;
    m->nown = p->n;
    m->dev = p->cuda_device;
    kvf_status_t st = kvf_cuda_context(m->dev, &m->d, &m->ctx, err, errlen);
    int have_ctx = st == KVF_OK;
    if (st == KVF_OK && (m->d->IpcGetMemHandle == NULL || m->d->IpcOpenMemHandle == NULL ||
                         m->d->IpcCloseMemHandle == NULL || m->d->MemGetAddressRange == NULL)) {
        snprintf(err, errlen, "the CUDA driver has no IPC entries");
        st = KVF_ERR_UNSUPPORTED;
    }
    if (st == KVF_OK && p->role == KVF_ROLE_DECODE)
        st = kvf_cuda_copier.create(m->dev, &m->copier, err, errlen);
    if (st != KVF_OK) {
        if (have_ctx)      /* the context kvf_cuda_context retained */
            m->d->DevicePrimaryCtxRelease(m->dev);
        free(m->own);
        free(m);
        return st;
    }
    m->d->CtxSetCurrent(m->ctx);
    for (size_t i = 0; i < p->n; i++) {
        region_t *r = &m->own[i];
        r->base = (uint64_t)(uintptr_t)p->bases[i];
        r->len = p->lens[i];
        r->device = p->kinds[i] == KVF_MEM_CUDA;
        if (!r->device || p->role != KVF_ROLE_PREFILL)
            continue;
        cu_ptr_t abase;
        size_t asize;
        cu_result_t res = m->d->MemGetAddressRange(&abase, &asize, r->base);
        if (res == 0)
            res = m->d->IpcGetMemHandle(&r->handle, abase);
        if (res != 0) {
            char b[160];
            snprintf(err, errlen, "no IPC handle for the buffer at 0x%llx: %s",
                     (unsigned long long)r->base, kvf_cudrv_strerror(res, b, sizeof(b)));
            cuda_destroy(&m->base);
            return KVF_ERR_UNSUPPORTED;
        }
        r->offset = r->base - abase;
    }
    qsort(m->own, m->nown, sizeof(region_t), by_base);
    *m_p = &m->base;
    return KVF_OK;
}

static int cuda_fd(const kvf_mover_t *base)
{
    const kvf_cuda_t *m = (const kvf_cuda_t *)base;
    return m->copier != NULL ? kvf_cuda_copier.fd(m->copier) : -1;
}

static int cuda_progress(kvf_mover_t *base)
{
    kvf_cuda_t *m = (kvf_cuda_t *)base;
    if (m->copier != NULL)
        kvf_cuda_copier.progress(m->copier);
    return 0;
}

/* The offer: every region, device ones with their allocation's handle. */
static kvf_status_t cuda_pack(kvf_mover_t *base, const kvf_mover_peer_t *peer,
                              kvf_buf_t *out)
{
    kvf_cuda_t *m = (kvf_cuda_t *)base;
    char id[KVF_BOOT_ID_LEN];
    (void)peer;
    if (m->role != KVF_ROLE_PREFILL || m->nown > MAX_REGIONS || kvf_boot_id(id) != 0)
        return KVF_ERR_UNSUPPORTED;
    kvf_status_t st = kvf_buf_reserve(out, HEAD_LEN + m->nown * REGION_LEN);
    if (st != KVF_OK)
        return st;
    uint8_t *p = out->data + out->len;
    kvf_put_u32(p, IPC_VERSION);
    kvf_put_u32(p + 4, (uint32_t)getpid());
    memcpy(p + 8, id, KVF_BOOT_ID_LEN);
    kvf_put_u32(p + 8 + KVF_BOOT_ID_LEN, (uint32_t)m->nown);
    p += HEAD_LEN;
    for (size_t i = 0; i < m->nown; i++, p += REGION_LEN) {
        const region_t *r = &m->own[i];
        kvf_put_u64(p, r->base);
        kvf_put_u64(p + 8, r->len);
        kvf_put_u32(p + 16, (uint32_t)r->device);
        kvf_put_u64(p + 20, r->offset);
        memcpy(p + 28, &r->handle, 64);
    }
    out->len += HEAD_LEN + m->nown * REGION_LEN;
    return KVF_OK;
}

/* Check an offer (untrusted bytes): its framing, this host, its regions. */
static kvf_status_t parse_offer(const uint8_t *blob, size_t len, pid_t *pid_p,
                                  region_t **regs_p, size_t *n_p, char *why, size_t whylen)
{
    char id[KVF_BOOT_ID_LEN];
    size_t n = len >= HEAD_LEN ? kvf_get_u32(blob + 8 + KVF_BOOT_ID_LEN) : 0;
    if (len < HEAD_LEN || kvf_get_u32(blob) != IPC_VERSION || n == 0 || n > MAX_REGIONS ||
        len != HEAD_LEN + n * REGION_LEN) {
        snprintf(why, whylen, "malformed cuda offer (%zu bytes, version %u, %zu regions)",
                 len, len >= 4 ? kvf_get_u32(blob) : 0, n);
        return KVF_ERR_UNSUPPORTED;
    }
    if (kvf_boot_id(id) != 0 || memcmp(id, blob + 8, KVF_BOOT_ID_LEN) != 0) {
        snprintf(why, whylen, "the prefill engine runs on another host");
        return KVF_ERR_UNSUPPORTED;
    }
    region_t *regs = calloc(n, sizeof(*regs));
    if (regs == NULL) {
        snprintf(why, whylen, "out of memory");
        return KVF_ERR_UNSUPPORTED;
    }
    const uint8_t *p = blob + HEAD_LEN;
    for (size_t i = 0; i < n; i++, p += REGION_LEN) {
        region_t *r = &regs[i];
        r->base = kvf_get_u64(p);
        r->len = kvf_get_u64(p + 8);
        r->device = kvf_get_u32(p + 16) != 0;
        r->offset = kvf_get_u64(p + 20);
        memcpy(&r->handle, p + 28, 64);
        if (r->len == 0 || r->base + r->len < r->base) {
            snprintf(why, whylen, "malformed cuda offer: region %zu (0x%llx, %llu bytes)",
                     i, (unsigned long long)r->base, (unsigned long long)r->len);
            free(regs);
            return KVF_ERR_UNSUPPORTED;
        }
    }
    qsort(regs, n, sizeof(*regs), by_base);
    *pid_p = (pid_t)kvf_get_u32(blob + 4);
    *regs_p = regs;
    *n_p = n;
    return KVF_OK;
}

static kvf_status_t cuda_connect(kvf_mover_t *base, const uint8_t *blob, size_t len,
                                 kvf_mover_ep_t **ep_p, char *why, size_t whylen)
{
    kvf_cuda_t *m = (kvf_cuda_t *)base;
    if (m->role != KVF_ROLE_DECODE) {
        snprintf(why, whylen, "a prefill engine does not read over cuda");
        return KVF_ERR_UNSUPPORTED;
    }
    kvf_cuda_ep_t *ep = calloc(1, sizeof(*ep));
    if (ep == NULL) {
        snprintf(why, whylen, "out of memory");
        return KVF_ERR_UNSUPPORTED;
    }
    ep->base.ops = &kvf_cuda_mover;
    ep->m = m;
    kvf_status_t st = parse_offer(blob, len, &ep->pid, &ep->regs, &ep->nregs, why, whylen);
    if (st != KVF_OK) {
        free(ep);
        return st;
    }
    m->d->CtxSetCurrent(m->ctx);
    for (size_t i = 0; i < ep->nregs; i++) {
        region_t *r = &ep->regs[i];
        if (!r->device) {
            /* Host memory is read with process_vm_readv: may we? */
            uint8_t byte;
            struct iovec l = {&byte, 1}, rem = {(void *)(uintptr_t)r->base, 1};
            if (process_vm_readv(ep->pid, &l, 1, &rem, 1, 0) != 1) {
                snprintf(why, whylen, "cannot read the prefill engine's host memory (pid "
                         "%d): %s", (int)ep->pid, strerror(errno));
                ep_free(ep);
                return KVF_ERR_UNSUPPORTED;
            }
            continue;
        }
        for (size_t j = 0; j < i && r->mapped == 0; j++)
            if (ep->regs[j].device && memcmp(&ep->regs[j].handle, &r->handle, 64) == 0)
                r->mapped = ep->regs[j].mapped;
        cu_result_t res = 0;
        if (r->mapped == 0 &&
            (res = m->d->IpcOpenMemHandle(&r->mapped, r->handle,
                                          KVF_CU_IPC_LAZY_ENABLE_PEER)) != 0) {
            char b[160];
            snprintf(why, whylen, "cannot open the prefill engine's device memory (pid %d): "
                     "%s", (int)ep->pid, kvf_cudrv_strerror(res, b, sizeof(b)));
            r->mapped = 0;
            ep_free(ep);
            return KVF_ERR_UNSUPPORTED;
        }
        /* The offer's offset and length are the prefill's word: reads stay
         * inside the allocation the handle opened, whatever it says. */
        cu_ptr_t abase;
        size_t asize;
        if (m->d->MemGetAddressRange(&abase, &asize, r->mapped) != 0 || abase != r->mapped ||
            r->offset > asize || r->len > asize - r->offset) {
            snprintf(why, whylen, "the prefill engine (pid %d) offered device region %zu at "
                     "offset %llu, %llu bytes long, outside the %zu-byte allocation its "
                     "handle opens", (int)ep->pid, i, (unsigned long long)r->offset,
                     (unsigned long long)r->len, asize);
            ep_free(ep);
            return KVF_ERR_UNSUPPORTED;
        }
    }
    *ep_p = &ep->base;
    return KVF_OK;
}

static void cuda_disconnect(kvf_mover_ep_t *base)
{
    kvf_cuda_ep_t *ep = (kvf_cuda_ep_t *)base;
    if (ep == NULL)
        return;
    ep->closed = 1;
    if (ep->inflight == 0)
        ep_free(ep);
}

static void read_copied(kvf_copy_t *cp, kvf_status_t st, const char *err)
{
    ipc_read_t *ir = (ipc_read_t *)cp;
    kvf_cuda_ep_t *ep = ir->ep;
    kvf_mover_read_t *rd = ir->rd;
    free(ir);
    rd->done(rd, st, err);
    if (--ep->inflight == 0 && ep->closed)
        ep_free(ep);
}

/*
 * Check every source against the peer's regions, resolve device sources
 * to our mapping of them, read host sources now (process_vm_readv, into
 * host memory only), and start the device copies as one batch.
 */
static kvf_status_t cuda_read(kvf_mover_ep_t *base, kvf_mover_read_t *rd, struct iovec *local,
                              struct iovec *remote, size_t n, unsigned timeout_ms, char *err,
                              size_t errlen)
{
    kvf_cuda_ep_t *ep = (kvf_cuda_ep_t *)base;
    kvf_cuda_t *m = ep->m;
    (void)timeout_ms;     /* device-local copies: nothing waits on the peer */
    struct iovec *src = malloc((n ? n : 1) * sizeof(*src));
    struct iovec *dst = malloc((n ? n : 1) * sizeof(*dst));
    ipc_read_t *ir = malloc(sizeof(*ir));
    kvf_status_t st = KVF_OK;
    size_t k = 0;

    if (src == NULL || dst == NULL || ir == NULL) {
        snprintf(err, errlen, "out of memory for a %zu-piece read", n);
        st = KVF_ERR_NO_MEMORY;
        goto out;
    }
    for (size_t i = 0; i < n; i++) {
        uint64_t a = (uint64_t)(uintptr_t)remote[i].iov_base;
        size_t ri = remote[i].iov_len != local[i].iov_len ? SIZE_MAX
                    : kvf_region_find(ep->regs, sizeof(*ep->regs), ep->nregs, a,
                                      remote[i].iov_len);
        if (ri == SIZE_MAX) {
            snprintf(err, errlen, "the peer asked for a read of %zu bytes at 0x%llx, "
                     "outside every region it registered", remote[i].iov_len,
                     (unsigned long long)a);
            st = KVF_ERR_PROTOCOL;
            goto out;
        }
        const region_t *r = &ep->regs[ri];
        if (r->device) {
            dst[k] = local[i];
            src[k++] = (struct iovec){(void *)(uintptr_t)(r->mapped + r->offset + (a - r->base)),
                                      remote[i].iov_len};
        }
    }
    /* Host sources, into host memory: device pages cannot take a
     * process_vm_readv (the kernel writes them). */
    for (size_t i = 0; i < n; i++) {
        uint64_t a = (uint64_t)(uintptr_t)remote[i].iov_base;
        size_t ri = kvf_region_find(ep->regs, sizeof(*ep->regs), ep->nregs, a,
                                    remote[i].iov_len);
        if (ep->regs[ri].device)
            continue;
        size_t li = kvf_region_find(m->own, sizeof(*m->own), m->nown,
                                    (uint64_t)(uintptr_t)local[i].iov_base, local[i].iov_len);
        if (li != SIZE_MAX && m->own[li].device) {
            snprintf(err, errlen, "the prefill's buffer at 0x%llx is host memory and ours "
                     "is device memory: register that buffer family as the same kind on "
                     "both sides", (unsigned long long)a);
            st = KVF_ERR_UNSUPPORTED;
            goto out;
        }
        if (process_vm_readv(ep->pid, &local[i], 1, &remote[i], 1, 0) !=
            (ssize_t)local[i].iov_len) {
            snprintf(err, errlen, "reading %zu bytes from process %d failed: %s",
                     local[i].iov_len, (int)ep->pid, strerror(errno));
            st = KVF_ERR_CONN_RESET;
            goto out;
        }
    }
    *ir = (ipc_read_t){.cp.done = read_copied, .rd = rd, .ep = ep};
    m->d->CtxSetCurrent(m->ctx);
    st = kvf_cuda_copier.copy(m->copier, &ir->cp, dst, src, k, err, errlen);
    if (st == KVF_OK) {
        ep->inflight++;
        ir = NULL;
    }
out:
    free(ir);
    free(src);
    free(dst);
    return st;
}

/* KV in device memory only (its host regions are aux, beside it); a
 * failed read is one batch gone, the mappings stay usable: no
 * KVF_MOVER_CAP_READ_FAIL_CLOSES_EP, no ep_failed. */
const kvf_mover_ops_t kvf_cuda_mover = {
    .name = "cuda",
    .caps = KVF_MOVER_CAP_PULL | KVF_MOVER_CAP_MEM_DEVICE | KVF_MOVER_CAP_NO_HOST_COPY,
    .create = cuda_create,
    .destroy = cuda_destroy,
    .fd = cuda_fd,
    .progress = cuda_progress,
    .pack = cuda_pack,
    .connect = cuda_connect,
    .disconnect = cuda_disconnect,
    .read = cuda_read,
};
