/*
 * The fake CUDA driver (unit/fake/fake_cuda.c) from a test: point the
 * library at it before its first driver call, and reach its controls.
 */
#ifndef KVF_FAKE_CUDA_H
#define KVF_FAKE_CUDA_H

#include <dlfcn.h>
#include <stdint.h>
#include <stdlib.h>

typedef struct fake_cuda {
    void     (*add)(void *base, size_t len, int ordinal);  /* declare "device memory" */
    void     (*reset)(void);
    void     (*fail_after)(uint64_t bytes);   /* copies fail past this many bytes */
    void     (*delay_ms)(unsigned ms);        /* events complete this late */
    uint64_t (*copied)(void);                 /* bytes copied so far */
} fake_cuda_t;

/* Load it (the library's own dlopen of the same path gets this instance). */
static inline int fake_cuda_load(fake_cuda_t *f)
{
    setenv("KVF_CUDA_DRIVER", KVF_FAKE_CUDA, 1);
    void *h = dlopen(KVF_FAKE_CUDA, RTLD_NOW | RTLD_LOCAL);
    if (h == NULL)
        return 0;
    *(void **)&f->add = dlsym(h, "fake_cuda_add");
    *(void **)&f->reset = dlsym(h, "fake_cuda_reset");
    *(void **)&f->fail_after = dlsym(h, "fake_cuda_fail_after");
    *(void **)&f->delay_ms = dlsym(h, "fake_cuda_delay_ms");
    *(void **)&f->copied = dlsym(h, "fake_cuda_copied");
    return f->add && f->reset && f->fail_after && f->delay_ms && f->copied;
}

#endif /* KVF_FAKE_CUDA_H */
