/*
 * kvferry declares the part of the CUDA driver ABI it calls itself
 * (util/cudrv.h), so that nothing of CUDA is needed to build or load it.
 * This file, compiled with the toolkit's cuda.h, checks those declarations
 * against the real ones: a toolkit that changed one fails the build here.
 */
#include <cuda.h>
#include <stddef.h>

#include "util/cudrv.h"

_Static_assert(CUDA_ERROR_NOT_READY == KVF_CU_NOT_READY, "CUDA_ERROR_NOT_READY");
_Static_assert(CU_EVENT_DISABLE_TIMING == KVF_CU_EVENT_DISABLE_TIMING, "event flags");
_Static_assert(CU_STREAM_NON_BLOCKING == KVF_CU_STREAM_NON_BLOCKING, "stream flags");
_Static_assert(CU_MEMHOSTALLOC_PORTABLE == KVF_CU_MEMHOSTALLOC_PORTABLE, "host alloc flags");
_Static_assert(CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS == KVF_CU_IPC_LAZY_ENABLE_PEER, "ipc flags");
_Static_assert(CU_POINTER_ATTRIBUTE_MEMORY_TYPE == 2, "pointer attribute");
_Static_assert(CU_POINTER_ATTRIBUTE_IS_MANAGED == 8, "pointer attribute");
_Static_assert(CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL == 9, "pointer attribute");
_Static_assert(CU_MEMORYTYPE_DEVICE == 2 && CU_MEMORYTYPE_UNIFIED == 4, "memory types");
_Static_assert(sizeof(CUipcMemHandle) == sizeof(cu_ipc_handle_t), "CUipcMemHandle");
_Static_assert(sizeof(CUdeviceptr) == sizeof(cu_ptr_t), "CUdeviceptr");
#if CUDA_VERSION >= 12080
_Static_assert(sizeof(CUmemcpyAttributes) == sizeof(cu_memcpy_attrs_t), "CUmemcpyAttributes");
_Static_assert(offsetof(CUmemcpyAttributes, flags) == offsetof(cu_memcpy_attrs_t, flags),
               "CUmemcpyAttributes.flags");
_Static_assert(CU_MEMCPY_SRC_ACCESS_ORDER_STREAM == KVF_CU_SRC_ACCESS_ORDER_STREAM,
               "source access order");
#endif

/* The translation unit must declare something (ISO C). */
int kvf__cuda_abi_checked;
