/*
 * The cuda component: what kvferry does with device memory itself, built
 * when the library is configured with CUDA (KVF_CUDA).  A copier
 * (copier.c) for the staged tcp path, and a mover (ipc.c) that pulls from
 * another process's device memory on the same host through CUDA IPC.
 * Both call the driver that util/cudrv.c loads at run time.
 */
#ifndef KVF_TRANSPORT_CUDA_CUDA_H
#define KVF_TRANSPORT_CUDA_CUDA_H

#include "transport/copier.h"
#include "transport/mover.h"
#include "util/cudrv.h"

extern const kvf_copier_ops_t kvf_cuda_copier;
extern const kvf_mover_ops_t  kvf_cuda_mover;

/* The driver and the primary context of CUDA device `device` (retained:
 * release with DevicePrimaryCtxRelease).  @return KVF_OK, or
 * KVF_ERR_UNSUPPORTED with why in err. */
kvf_status_t kvf_cuda_context(int device, const kvf_cudrv_t **d_p, cu_ctx_t *ctx_p,
                              char *err, size_t errlen);

#endif /* KVF_TRANSPORT_CUDA_CUDA_H */
