/*
 * The CUDA copier (transport/copier.h): one non-blocking stream on the
 * engine's device, in its primary context (the one PyTorch and every
 * runtime-API user share, so their pointers are valid here).  A batch is
 * its copies (one cuMemcpyBatchAsync where the driver has it, else one
 * cuMemcpyAsync per piece), then an event; a host function queued behind
 * the event writes an eventfd, which is what wakes the engine's loop, and
 * progress hands batches back in order as their events say they are done.
 * The driver is the one util/cudrv.c loaded: nothing here is linked.
 */
#include <errno.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include "transport/cuda/cuda.h"
#include "util/log.h"

typedef struct job {
    kvf_copy_t  *cp;
    cu_event_t   ev;
    cu_result_t  failed;      /* a copy that could not be queued (0: none) */
    struct job  *next;
} job_t;

struct kvf_copier {
    const kvf_cudrv_t *d;
    int                dev;
    cu_ctx_t           ctx;
    cu_stream_t        stream;
    int                efd;
    job_t             *head, **tail;
    cu_ptr_t          *dsts, *srcs;   /* batch arguments, grown as needed */
    size_t            *sizes, cap;
};

kvf_status_t kvf_cuda_context(int device, const kvf_cudrv_t **d_p, cu_ctx_t *ctx_p, char *err,
                              size_t errlen)
{
    char why[256];
    const kvf_cudrv_t *d = kvf_cudrv(why, sizeof(why));
    int n = 0, dev;
    cu_result_t r;

    if (d == NULL) {
        snprintf(err, errlen, "%s", why);
        return KVF_ERR_UNSUPPORTED;
    }
    if (d->DeviceGetCount == NULL || d->DeviceGet == NULL ||
        d->DevicePrimaryCtxRetain == NULL || d->CtxSetCurrent == NULL ||
        d->StreamCreate == NULL || d->EventCreate == NULL || d->EventRecord == NULL ||
        d->EventQuery == NULL || d->MemcpyAsync == NULL || d->MemHostAlloc == NULL) {
        snprintf(err, errlen, "the CUDA driver lacks an entry kvferry needs (a driver "
                 "older than CUDA 10?)");
        return KVF_ERR_UNSUPPORTED;
    }
    if ((r = d->DeviceGetCount(&n)) != 0 || device >= n) {
        snprintf(err, errlen, "CUDA device %d does not exist here (%d device%s%s%s)", device,
                 n, n == 1 ? "" : "s", r ? ": " : "",
                 r ? kvf_cudrv_strerror(r, why, sizeof(why)) : "");
        return KVF_ERR_UNSUPPORTED;
    }
    if ((r = d->DeviceGet(&dev, device)) != 0 ||
        (r = d->DevicePrimaryCtxRetain(ctx_p, dev)) != 0) {
        snprintf(err, errlen, "no context on CUDA device %d: %s", device,
                 kvf_cudrv_strerror(r, why, sizeof(why)));
        return KVF_ERR_UNSUPPORTED;
    }
    *d_p = d;
    return KVF_OK;
}

static void wake(void *arg)
{
    uint64_t one = 1;
    /* A driver thread: nothing but the write (no CUDA call is allowed). */
    if (write((int)(intptr_t)arg, &one, sizeof(one)) < 0)
        (void)errno;
}

static kvf_status_t cuda_create(int device, kvf_copier_t **c_p, char *err, size_t errlen)
{
    kvf_copier_t *c = calloc(1, sizeof(*c));
    char why[160];
    cu_result_t r;

    if (c == NULL) {
        snprintf(err, errlen, "out of memory");
        return KVF_ERR_NO_MEMORY;
    }
    c->dev = device;
    c->efd = -1;
    c->tail = &c->head;
    kvf_status_t st = kvf_cuda_context(device, &c->d, &c->ctx, err, errlen);
    if (st != KVF_OK) {
        free(c);
        return st;
    }
    c->d->CtxSetCurrent(c->ctx);
    if ((r = c->d->StreamCreate(&c->stream, KVF_CU_STREAM_NON_BLOCKING)) != 0) {
        snprintf(err, errlen, "cuStreamCreate: %s", kvf_cudrv_strerror(r, why, sizeof(why)));
        goto fail;
    }
    if (c->d->LaunchHostFunc != NULL &&
        (c->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)) < 0) {
        snprintf(err, errlen, "eventfd: %s", strerror(errno));
        goto fail;
    }
    *c_p = c;
    return KVF_OK;
fail:
    if (c->stream != NULL && c->d->StreamDestroy != NULL)
        c->d->StreamDestroy(c->stream);
    if (c->d->DevicePrimaryCtxRelease != NULL)
        c->d->DevicePrimaryCtxRelease(device);
    free(c);
    return KVF_ERR_UNSUPPORTED;
}

static int reserve(kvf_copier_t *c, size_t n)
{
    if (n <= c->cap)
        return 1;
    cu_ptr_t *d = realloc(c->dsts, n * sizeof(*d));
    if (d != NULL)
        c->dsts = d;
    cu_ptr_t *s = realloc(c->srcs, n * sizeof(*s));
    if (s != NULL)
        c->srcs = s;
    size_t *z = realloc(c->sizes, n * sizeof(*z));
    if (z != NULL)
        c->sizes = z;
    if (d == NULL || s == NULL || z == NULL)
        return 0;
    c->cap = n;
    return 1;
}

/* Queue the pieces: one batch call, or a loop.  @return 0 or the first
 * error, and in *queued whether any copy was queued before it. */
static cu_result_t queue(kvf_copier_t *c, const struct iovec *dst, const struct iovec *src,
                         size_t n, int *queued)
{
    const kvf_cudrv_t *d = c->d;
    *queued = 0;
    if (d->MemcpyBatchAsync != NULL && n > 1 && reserve(c, n)) {
        for (size_t i = 0; i < n; i++) {
            c->dsts[i] = (cu_ptr_t)(uintptr_t)dst[i].iov_base;
            c->srcs[i] = (cu_ptr_t)(uintptr_t)src[i].iov_base;
            c->sizes[i] = src[i].iov_len;
        }
        cu_memcpy_attrs_t attr = {.src_access_order = KVF_CU_SRC_ACCESS_ORDER_STREAM};
        size_t idx = 0;
        cu_result_t r = d->MemcpyBatchAsync(c->dsts, c->srcs, c->sizes, n, &attr, &idx, 1,
                                            c->stream);
        if (r == 0) {
            *queued = 1;
            return 0;
        }
        /* A driver that has the entry but refuses the batch: the loop. */
    }
    for (size_t i = 0; i < n; i++) {
        cu_result_t r = d->MemcpyAsync((cu_ptr_t)(uintptr_t)dst[i].iov_base,
                                       (cu_ptr_t)(uintptr_t)src[i].iov_base, src[i].iov_len,
                                       c->stream);
        if (r != 0)
            return r;
        *queued = 1;
    }
    return 0;
}

static kvf_status_t cuda_copy(kvf_copier_t *c, kvf_copy_t *cp, const struct iovec *dst,
                              const struct iovec *src, size_t n, char *err, size_t errlen)
{
    const kvf_cudrv_t *d = c->d;
    char why[160];
    job_t *j = calloc(1, sizeof(*j));
    cu_result_t r;
    int queued;

    if (j == NULL) {
        snprintf(err, errlen, "out of memory");
        return KVF_ERR_NO_MEMORY;
    }
    d->CtxSetCurrent(c->ctx);
    if ((r = d->EventCreate(&j->ev, KVF_CU_EVENT_DISABLE_TIMING)) != 0) {
        snprintf(err, errlen, "cuEventCreate: %s", kvf_cudrv_strerror(r, why, sizeof(why)));
        free(j);
        return KVF_ERR_IO;
    }
    r = queue(c, dst, src, n, &queued);
    if (r != 0 && !queued) {
        snprintf(err, errlen, "cuMemcpyAsync: %s", kvf_cudrv_strerror(r, why, sizeof(why)));
        d->EventDestroy(j->ev);
        free(j);
        return KVF_ERR_IO;
    }
    /* Copies were queued: the batch is in flight whatever follows, and it
     * is handed back (failed, if a later copy could not be queued) only
     * once its event says the queued ones ended. */
    j->failed = r;
    j->cp = cp;
    if ((r = d->EventRecord(j->ev, c->stream)) != 0) {
        /* No event to wait on: wait for the stream (device-local, bounded). */
        d->StreamSynchronize(c->stream);
        d->EventDestroy(j->ev);
        j->ev = NULL;
        j->failed = j->failed ? j->failed : r;
    }
    if (c->efd >= 0)
        d->LaunchHostFunc(c->stream, wake, (void *)(intptr_t)c->efd);
    *c->tail = j;
    c->tail = &j->next;
    return KVF_OK;
}

static void finish(kvf_copier_t *c, job_t *j, cu_result_t r)
{
    char why[160], msg[200];
    if ((c->head = j->next) == NULL)
        c->tail = &c->head;
    if (j->ev != NULL)
        c->d->EventDestroy(j->ev);
    r = j->failed ? j->failed : r;
    if (r == 0) {
        j->cp->done(j->cp, KVF_OK, NULL);
    } else {
        snprintf(msg, sizeof(msg), "copy on CUDA device %d failed: %s", c->dev,
                 kvf_cudrv_strerror(r, why, sizeof(why)));
        j->cp->done(j->cp, KVF_ERR_IO, msg);
    }
    free(j);
}

static int cuda_progress(kvf_copier_t *c)
{
    uint64_t v;
    if (c->efd >= 0 && read(c->efd, &v, sizeof(v)) < 0 && errno != EAGAIN)
        kvf_warn("copier eventfd: %m");
    if (c->head != NULL)
        c->d->CtxSetCurrent(c->ctx);
    while (c->head != NULL) {
        cu_result_t r = c->head->ev != NULL ? c->d->EventQuery(c->head->ev) : 0;
        if (r == KVF_CU_NOT_READY)
            break;
        finish(c, c->head, r);
    }
    return c->head != NULL;
}

static void cuda_drain(kvf_copier_t *c)
{
    c->d->CtxSetCurrent(c->ctx);
    c->d->StreamSynchronize(c->stream);   /* the host functions ran too */
    while (c->head != NULL)
        finish(c, c->head, c->head->ev != NULL ? c->d->EventQuery(c->head->ev) : 0);
}

static void cuda_destroy(kvf_copier_t *c)
{
    if (c == NULL)
        return;
    cuda_drain(c);
    c->d->StreamDestroy(c->stream);
    if (c->d->DevicePrimaryCtxRelease != NULL)
        c->d->DevicePrimaryCtxRelease(c->dev);
    if (c->efd >= 0)
        close(c->efd);
    free(c->dsts);
    free(c->srcs);
    free(c->sizes);
    free(c);
}

static int cuda_fd(const kvf_copier_t *c)
{
    return c->efd;
}

static void *cuda_host_alloc(kvf_copier_t *c, size_t len)
{
    void *p = NULL;
    c->d->CtxSetCurrent(c->ctx);
    /* Portable: pinned for every context, as the IPC mover's too. */
    return c->d->MemHostAlloc(&p, len, KVF_CU_MEMHOSTALLOC_PORTABLE) == 0 ? p : NULL;
}

static void cuda_host_free(kvf_copier_t *c, void *p)
{
    if (p != NULL) {
        c->d->CtxSetCurrent(c->ctx);
        c->d->MemFreeHost(p);
    }
}

const kvf_copier_ops_t kvf_cuda_copier = {
    .name = "cuda",
    .create = cuda_create,
    .drain = cuda_drain,
    .destroy = cuda_destroy,
    .fd = cuda_fd,
    .progress = cuda_progress,
    .copy = cuda_copy,
    .host_alloc = cuda_host_alloc,
    .host_free = cuda_host_free,
};
