/*
 * The memory kvf_mem_alloc() hands the application (kvferry.h): each
 * allocation a memfd, mapped here and sealed so that what is handed to a
 * peer lets it read and never write.  This process's allocations sit in
 * one table, which a transport that shares memory on this host (shm)
 * reads to hand a peer the memfds of the buffers it registered.  The
 * allocator belongs to the application, not to a transport: any memory
 * works with every transport, this is only faster to read.
 */
#ifndef KVF_UTIL_MEMFD_H
#define KVF_UTIL_MEMFD_H

#include <stddef.h>

typedef struct kvf_memfd_region {
    void  *base;
    size_t len;
    int    fd;
    int    ro_fd;      /* the same memfd opened read-only: what is handed out */
} kvf_memfd_region_t;

/*
 * Hold the table of this process's kvf_mem_alloc regions, *n_p of them,
 * until kvf_memfd_regions_release: no region is freed meanwhile, so its
 * ro_fd can be sent to a peer while held.  Few and long-lived; any thread.
 */
const kvf_memfd_region_t *kvf_memfd_regions_hold(size_t *n_p);
void                      kvf_memfd_regions_release(void);

#endif /* KVF_UTIL_MEMFD_H */
