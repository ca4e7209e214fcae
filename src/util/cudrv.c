/*
 * The CUDA driver, loaded at run time (cudrv.h).  One dlopen per process,
 * never closed: CUDA's own threads may run code of it until exit.
 */
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "util/cudrv.h"

/* Pointer attributes and memory types of the driver ABI (cuda.h). */
#define CU_POINTER_ATTRIBUTE_MEMORY_TYPE    2
#define CU_POINTER_ATTRIBUTE_IS_MANAGED     8
#define CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL 9
#define CU_MEMORYTYPE_DEVICE                2
#define CU_MEMORYTYPE_UNIFIED               4

static kvf_cudrv_t    drv;
static int            drv_ok;
static char           drv_err[256];
static pthread_once_t drv_once = PTHREAD_ONCE_INIT;

static void *sym(void *h, const char *name)
{
    return dlsym(h, name);
}

static void load(void)
{
    const char *path = getenv("KVF_CUDA_DRIVER");
    if (path == NULL || path[0] == '\0')
        path = "libcuda.so.1";
    void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (h == NULL) {
        snprintf(drv_err, sizeof(drv_err), "no CUDA driver: %s", dlerror());
        return;
    }
    /* The _v2 names are what cuda.h maps the plain ones to today. */
    *(void **)&drv.Init = sym(h, "cuInit");
    *(void **)&drv.GetErrorString = sym(h, "cuGetErrorString");
    *(void **)&drv.DeviceGetCount = sym(h, "cuDeviceGetCount");
    *(void **)&drv.DeviceGet = sym(h, "cuDeviceGet");
    *(void **)&drv.DevicePrimaryCtxRetain = sym(h, "cuDevicePrimaryCtxRetain");
    *(void **)&drv.DevicePrimaryCtxRelease = sym(h, "cuDevicePrimaryCtxRelease_v2");
    *(void **)&drv.CtxSetCurrent = sym(h, "cuCtxSetCurrent");
    *(void **)&drv.PointerGetAttributes = sym(h, "cuPointerGetAttributes");
    *(void **)&drv.StreamCreate = sym(h, "cuStreamCreate");
    *(void **)&drv.StreamDestroy = sym(h, "cuStreamDestroy_v2");
    *(void **)&drv.StreamSynchronize = sym(h, "cuStreamSynchronize");
    *(void **)&drv.EventCreate = sym(h, "cuEventCreate");
    *(void **)&drv.EventDestroy = sym(h, "cuEventDestroy_v2");
    *(void **)&drv.EventRecord = sym(h, "cuEventRecord");
    *(void **)&drv.EventQuery = sym(h, "cuEventQuery");
    *(void **)&drv.MemcpyAsync = sym(h, "cuMemcpyAsync");
    /* CUDA 13's signature (12.8's had a failIdx argument): only that one. */
    *(void **)&drv.MemcpyBatchAsync = sym(h, "cuMemcpyBatchAsync_v2");
    *(void **)&drv.LaunchHostFunc = sym(h, "cuLaunchHostFunc");
    *(void **)&drv.MemHostAlloc = sym(h, "cuMemHostAlloc");
    *(void **)&drv.MemFreeHost = sym(h, "cuMemFreeHost");
    *(void **)&drv.IpcGetMemHandle = sym(h, "cuIpcGetMemHandle");
    *(void **)&drv.IpcOpenMemHandle = sym(h, "cuIpcOpenMemHandle_v2");
    *(void **)&drv.IpcCloseMemHandle = sym(h, "cuIpcCloseMemHandle");
    *(void **)&drv.MemGetAddressRange = sym(h, "cuMemGetAddressRange_v2");
    if (drv.Init == NULL || drv.PointerGetAttributes == NULL) {
        snprintf(drv_err, sizeof(drv_err), "no CUDA driver: %s lacks cuInit or "
                 "cuPointerGetAttributes", path);
        return;
    }
    cu_result_t r = drv.Init(0);
    if (r != 0) {
        char b[160];
        snprintf(drv_err, sizeof(drv_err), "the CUDA driver is installed but cuInit failed: "
                 "%s", kvf_cudrv_strerror(r, b, sizeof(b)));
        return;
    }
    drv_ok = 1;
}

const kvf_cudrv_t *kvf_cudrv(char *err, size_t errlen)
{
    pthread_once(&drv_once, load);
    if (!drv_ok) {
        snprintf(err, errlen, "%s", drv_err);
        return NULL;
    }
    return &drv;
}

const char *kvf_cudrv_strerror(cu_result_t r, char *buf, size_t len)
{
    const char *s = NULL;
    if (drv.GetErrorString == NULL || drv.GetErrorString(r, &s) != 0 || s == NULL)
        s = "unknown CUDA error";
    snprintf(buf, len, "CUDA error %d: %s", r, s);
    return buf;
}

/* One address: device (with its ordinal) or host. */
static void one_kind(const kvf_cudrv_t *d, cu_ptr_t p, int *device, int *ordinal)
{
    unsigned type = 0, managed = 0;
    int ord = -1;
    int attrs[3] = {CU_POINTER_ATTRIBUTE_MEMORY_TYPE, CU_POINTER_ATTRIBUTE_IS_MANAGED,
                    CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL};
    void *data[3] = {&type, &managed, &ord};
    /* Memory CUDA does not know is reported as type 0 (or an error). */
    if (d->PointerGetAttributes(3, attrs, data, p) != 0)
        type = 0;
    *device = type == CU_MEMORYTYPE_DEVICE || type == CU_MEMORYTYPE_UNIFIED || managed;
    *ordinal = *device ? ord : -1;
}

kvf_status_t kvf_cudrv_ptr_kind(const void *p, size_t len, kvf_ptr_kind_t *kind_p,
                                int *ordinal_p, char *err, size_t errlen)
{
    const kvf_cudrv_t *d = kvf_cudrv(err, errlen);
    if (d == NULL)
        return KVF_ERR_UNSUPPORTED;
    int dev0, ord0, dev1, ord1;
    one_kind(d, (cu_ptr_t)(uintptr_t)p, &dev0, &ord0);
    one_kind(d, (cu_ptr_t)(uintptr_t)p + (len ? len - 1 : 0), &dev1, &ord1);
    *kind_p = dev0 != dev1 || ord0 != ord1 ? KVF_PTR_MIXED
              : dev0 ? KVF_PTR_DEVICE : KVF_PTR_HOST;
    *ordinal_p = ord0;
    return KVF_OK;
}
