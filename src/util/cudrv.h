/*
 * The CUDA driver, loaded at run time.
 *
 * The library never links the driver (nor the CUDA runtime): a process
 * without a GPU must load libkvferry all the same.  The first caller
 * dlopen()s libcuda.so.1 (or $KVF_CUDA_DRIVER, which tests point at a fake
 * driver) and resolves the driver API by name; every entry is the driver's
 * stable C ABI, declared here with plain C types, so that this file builds
 * with no CUDA header at all.  Registration asks it what each buffer really
 * is (kvf_cudrv_ptr_kind) in every build; the cuda component
 * (src/transport/cuda) calls the rest.
 */
#ifndef KVF_UTIL_CUDRV_H
#define KVF_UTIL_CUDRV_H

#include <stddef.h>
#include <stdint.h>

#include "kvferry/status.h"

typedef int                cu_result_t;     /* CUresult; 0 is CUDA_SUCCESS */
typedef unsigned long long cu_ptr_t;        /* CUdeviceptr */
typedef void              *cu_ctx_t;        /* CUcontext */
typedef void              *cu_stream_t;     /* CUstream */
typedef void              *cu_event_t;      /* CUevent */
typedef struct { char reserved[64]; } cu_ipc_handle_t;   /* CUipcMemHandle */

/* CUmemcpyAttributes (CUDA 12.8+), for cuMemcpyBatchAsync. */
typedef struct {
    int      src_access_order;              /* CUmemcpySrcAccessOrder */
    int      src_loc_type, src_loc_id;      /* CUmemLocation */
    int      dst_loc_type, dst_loc_id;
    unsigned flags;
} cu_memcpy_attrs_t;

#define KVF_CU_NOT_READY                 600  /* CUDA_ERROR_NOT_READY */
#define KVF_CU_EVENT_DISABLE_TIMING      0x2
#define KVF_CU_STREAM_NON_BLOCKING       0x1
#define KVF_CU_MEMHOSTALLOC_PORTABLE     0x1
#define KVF_CU_IPC_LAZY_ENABLE_PEER      0x1
#define KVF_CU_SRC_ACCESS_ORDER_STREAM   0x1

/* The driver entries kvferry calls; NULL where this driver lacks one. */
typedef struct kvf_cudrv {
    cu_result_t (*Init)(unsigned flags);
    cu_result_t (*GetErrorString)(cu_result_t r, const char **s);
    cu_result_t (*DeviceGetCount)(int *n);
    cu_result_t (*DeviceGet)(int *dev, int ordinal);
    cu_result_t (*DevicePrimaryCtxRetain)(cu_ctx_t *ctx, int dev);
    cu_result_t (*DevicePrimaryCtxRelease)(int dev);
    cu_result_t (*CtxSetCurrent)(cu_ctx_t ctx);
    cu_result_t (*PointerGetAttributes)(unsigned n, int *attrs, void **data, cu_ptr_t p);
    cu_result_t (*StreamCreate)(cu_stream_t *s, unsigned flags);
    cu_result_t (*StreamDestroy)(cu_stream_t s);
    cu_result_t (*StreamSynchronize)(cu_stream_t s);
    cu_result_t (*EventCreate)(cu_event_t *e, unsigned flags);
    cu_result_t (*EventDestroy)(cu_event_t e);
    cu_result_t (*EventRecord)(cu_event_t e, cu_stream_t s);
    cu_result_t (*EventQuery)(cu_event_t e);
    cu_result_t (*MemcpyAsync)(cu_ptr_t dst, cu_ptr_t src, size_t n, cu_stream_t s);
    cu_result_t (*MemcpyBatchAsync)(cu_ptr_t *dsts, cu_ptr_t *srcs, size_t *sizes,
                                    size_t count, cu_memcpy_attrs_t *attrs,
                                    size_t *attr_idxs, size_t nattrs, cu_stream_t s);
    cu_result_t (*LaunchHostFunc)(cu_stream_t s, void (*fn)(void *), void *arg);
    cu_result_t (*MemHostAlloc)(void **p, size_t n, unsigned flags);
    cu_result_t (*MemFreeHost)(void *p);
    cu_result_t (*IpcGetMemHandle)(cu_ipc_handle_t *h, cu_ptr_t p);
    cu_result_t (*IpcOpenMemHandle)(cu_ptr_t *p, cu_ipc_handle_t h, unsigned flags);
    cu_result_t (*IpcCloseMemHandle)(cu_ptr_t p);
    cu_result_t (*MemGetAddressRange)(cu_ptr_t *base, size_t *size, cu_ptr_t p);
} kvf_cudrv_t;

/*
 * The driver, loaded and initialised once per process (cuInit(0)), or
 * NULL with why in err ("no CUDA driver: libcuda.so.1: cannot open shared
 * object file", "cuInit failed: no CUDA-capable device is detected").
 * Any thread.
 */
const kvf_cudrv_t *kvf_cudrv(char *err, size_t errlen);

/* "CUDA_ERROR_...: text" of a driver result, into buf. */
const char *kvf_cudrv_strerror(cu_result_t r, char *buf, size_t len);

/* What memory [p, p+len) is, as the driver sees it. */
typedef enum kvf_ptr_kind {
    KVF_PTR_HOST   = 0,   /* ordinary or pinned host memory, or unknown to CUDA */
    KVF_PTR_DEVICE = 1,   /* device memory of `ordinal` */
    KVF_PTR_MIXED  = 2    /* its two ends differ: more than one allocation */
} kvf_ptr_kind_t;

/*
 * Ask the driver what [p, p+len) is (both ends are asked).  Managed memory
 * counts as device memory of the device it was allocated on.
 * @return KVF_OK with *kind_p and *ordinal_p (-1 for host);
 *         KVF_ERR_UNSUPPORTED: no usable driver (why in err).
 */
kvf_status_t kvf_cudrv_ptr_kind(const void *p, size_t len, kvf_ptr_kind_t *kind_p,
                                int *ordinal_p, char *err, size_t errlen);

#endif /* KVF_UTIL_CUDRV_H */
