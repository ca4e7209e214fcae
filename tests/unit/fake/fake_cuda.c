/*
 * A fake CUDA driver (libcuda.so.1's entries that kvferry calls), for
 * testing on machines without a GPU: tests point KVF_CUDA_DRIVER at it.
 * "Device memory" is host memory the test declared with fake_cuda_add():
 * the pointer attributes say device, copies are memcpy.  The test can make
 * a copy fail once the copied bytes pass a mark (fake_cuda_fail_after) and
 * make events complete late (fake_cuda_delay_ms), which is how the staged
 * paths' failure and pinning rules are tested.
 */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define NOT_READY 600
#define UNKNOWN   999

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static struct { uintptr_t base; size_t len; int ord; } ranges[64];
static int nranges;
static uint64_t copied, fail_after = UINT64_MAX;
static unsigned delay_ms;

static uint64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
}

void fake_cuda_add(void *base, size_t len, int ordinal)
{
    pthread_mutex_lock(&mu);
    ranges[nranges].base = (uintptr_t)base;
    ranges[nranges].len = len;
    ranges[nranges++].ord = ordinal;
    pthread_mutex_unlock(&mu);
}

void fake_cuda_reset(void)
{
    pthread_mutex_lock(&mu);
    nranges = 0;
    copied = 0;
    fail_after = UINT64_MAX;
    delay_ms = 0;
    pthread_mutex_unlock(&mu);
}

void fake_cuda_fail_after(uint64_t bytes) { pthread_mutex_lock(&mu); fail_after = bytes; pthread_mutex_unlock(&mu); }
void fake_cuda_delay_ms(unsigned ms) { pthread_mutex_lock(&mu); delay_ms = ms; pthread_mutex_unlock(&mu); }

uint64_t fake_cuda_copied(void)
{
    pthread_mutex_lock(&mu);
    uint64_t c = copied;
    pthread_mutex_unlock(&mu);
    return c;
}

static int find(uintptr_t p, int *ord)
{
    for (int i = 0; i < nranges; i++)
        if (p >= ranges[i].base && p - ranges[i].base < ranges[i].len) {
            *ord = ranges[i].ord;
            return 1;
        }
    return 0;
}

int cuInit(unsigned flags) { (void)flags; return 0; }
int cuGetErrorString(int r, const char **s) { *s = r == UNKNOWN ? "fake copy failure" : "fake"; return 0; }
int cuDeviceGetCount(int *n) { *n = 2; return 0; }
int cuDeviceGet(int *d, int ord) { *d = ord; return 0; }
int cuDevicePrimaryCtxRetain(void **ctx, int d) { *ctx = (void *)(uintptr_t)(d + 1); return 0; }
int cuDevicePrimaryCtxRelease_v2(int d) { (void)d; return 0; }
int cuCtxSetCurrent(void *ctx) { (void)ctx; return 0; }

int cuPointerGetAttributes(unsigned n, int *attrs, void **data, unsigned long long p)
{
    int ord = -1;
    pthread_mutex_lock(&mu);
    int dev = find((uintptr_t)p, &ord);
    pthread_mutex_unlock(&mu);
    for (unsigned i = 0; i < n; i++) {
        if (attrs[i] == 2)
            *(unsigned *)data[i] = dev ? 2 : 0;        /* memory type */
        else if (attrs[i] == 8)
            *(unsigned *)data[i] = 0;                  /* managed */
        else if (attrs[i] == 9)
            *(int *)data[i] = ord;                     /* ordinal */
    }
    return 0;
}

int cuStreamCreate(void **s, unsigned flags) { (void)flags; *s = malloc(1); return 0; }
int cuStreamDestroy_v2(void *s) { free(s); return 0; }

int cuStreamSynchronize(void *s)
{
    (void)s;
    pthread_mutex_lock(&mu);
    unsigned d = delay_ms;
    pthread_mutex_unlock(&mu);
    struct timespec ts = {d / 1000, (long)(d % 1000) * 1000000L};
    nanosleep(&ts, NULL);
    return 0;
}

int cuEventCreate(void **e, unsigned flags) { (void)flags; *e = calloc(1, sizeof(uint64_t)); return 0; }
int cuEventDestroy_v2(void *e) { free(e); return 0; }

int cuEventRecord(void *e, void *s)
{
    (void)s;
    pthread_mutex_lock(&mu);
    *(uint64_t *)e = now_ms() + delay_ms;
    pthread_mutex_unlock(&mu);
    return 0;
}

int cuEventQuery(void *e) { return now_ms() >= *(uint64_t *)e ? 0 : NOT_READY; }

int cuMemcpyAsync(unsigned long long dst, unsigned long long src, size_t n, void *s)
{
    (void)s;
    pthread_mutex_lock(&mu);
    int fail = copied + n > fail_after;
    if (!fail)
        copied += n;
    pthread_mutex_unlock(&mu);
    if (fail)
        return UNKNOWN;
    memcpy((void *)(uintptr_t)dst, (const void *)(uintptr_t)src, n);
    return 0;
}

int cuLaunchHostFunc(void *s, void (*fn)(void *), void *arg) { (void)s; fn(arg); return 0; }
int cuMemHostAlloc(void **p, size_t n, unsigned flags) { (void)flags; *p = malloc(n); return *p ? 0 : 2; }
int cuMemFreeHost(void *p) { free(p); return 0; }

/* IPC within one process (tests run both engines in one): a handle is the
 * allocation's pid and base, and opening one of this process's maps it
 * where it is.  Another process's handle fails, as it would without a GPU. */
int cuMemGetAddressRange_v2(unsigned long long *base, size_t *size, unsigned long long p)
{
    int ok = 0;
    pthread_mutex_lock(&mu);
    for (int i = 0; i < nranges; i++)
        if ((uintptr_t)p >= ranges[i].base && (uintptr_t)p - ranges[i].base < ranges[i].len) {
            *base = ranges[i].base;
            *size = ranges[i].len;
            ok = 1;
        }
    pthread_mutex_unlock(&mu);
    return ok ? 0 : 1;
}

typedef struct { char reserved[64]; } handle_t;

int cuIpcGetMemHandle(handle_t *h, unsigned long long p)
{
    uint64_t pid = (uint64_t)getpid();
    memset(h, 0, sizeof(*h));
    memcpy(h->reserved, &pid, 8);
    memcpy(h->reserved + 8, &p, 8);
    return 0;
}

int cuIpcOpenMemHandle_v2(unsigned long long *p, handle_t h, unsigned flags)
{
    uint64_t pid;
    (void)flags;
    memcpy(&pid, h.reserved, 8);
    if (pid != (uint64_t)getpid())
        return 201;    /* CUDA_ERROR_INVALID_CONTEXT */
    memcpy(p, h.reserved + 8, 8);
    return 0;
}

int cuIpcCloseMemHandle(unsigned long long p) { (void)p; return 0; }

int cuMemcpyBatchAsync_v2(unsigned long long *dsts, unsigned long long *srcs, size_t *sizes,
                          size_t count, void *attrs, size_t *idxs, size_t nattrs, void *s)
{
    (void)attrs, (void)idxs, (void)nattrs;
    for (size_t i = 0; i < count; i++) {
        int r = cuMemcpyAsync(dsts[i], srcs[i], sizes[i], s);
        if (r != 0)
            return r;
    }
    return 0;
}
