/*
 * kvf_mem_alloc / kvf_mem_free (kvferry.h) and the table of what they
 * handed out (memfd.h).
 */
#include "util/memfd.h"

#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <unistd.h>

#include "kvferry/kvferry.h"
#include "util/log.h"

#ifndef F_SEAL_FUTURE_WRITE
#define F_SEAL_FUTURE_WRITE 0x0010   /* Linux 5.1; older headers lack it */
#endif

/* Every kvf_mem_alloc'd region of this process; few and long-lived. */
static pthread_mutex_t     regions_lock = PTHREAD_MUTEX_INITIALIZER;
static kvf_memfd_region_t *regions;
static size_t              nregions;

/*
 * What a decode engine gets must not let it write: the prefill's own
 * mapping (made before) stays writable, and every later one is read-only.
 * Two locks, each enough alone: the seals (F_SEAL_FUTURE_WRITE refuses
 * writable mappings and write() to anyone, even through a reopened
 * /proc/<pid>/fd link; SHRINK / GROW keep the size, so a holder cannot
 * truncate the prefill into SIGBUS; SEAL fixes the set), and a read-only
 * file description (reopened through /proc/self/fd), whose writable
 * MAP_SHARED mmap fails with EACCES.  @return that descriptor, or -1.
 */
static int seal_read_only(int fd, size_t len)
{
    char path[64];
    if (fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_FUTURE_WRITE |
                                   F_SEAL_SEAL) != 0) {
        kvf_error("sealing a %zu-byte memfd read-only for peers (F_SEAL_FUTURE_WRITE needs "
                  "Linux 5.1): %m", len);
        return -1;
    }
    snprintf(path, sizeof(path), "/proc/self/fd/%d", fd);
    int ro = open(path, O_RDONLY | O_CLOEXEC);
    if (ro < 0)
        kvf_error("reopening a memfd read-only (%s): %m", path);
    return ro;
}

kvf_status_t kvf_mem_alloc(size_t len, void **ptr_p)
{
    if (len == 0 || ptr_p == NULL) {
        kvf_error("kvf_mem_alloc: %s", len == 0 ? "len is 0" : "ptr_p is NULL");
        return KVF_ERR_INVALID_PARAM;
    }
    int fd = memfd_create("kvferry-kv", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (fd < 0) {
        kvf_error("memfd_create: %m");
        return KVF_ERR_NO_MEMORY;
    }
    if (ftruncate(fd, (off_t)len) != 0) {
        kvf_error("ftruncate of a %zu-byte memfd: %m", len);
        close(fd);
        return KVF_ERR_NO_MEMORY;
    }
    /* Populated now: KV pools are allocated before serving, and a first
     * touch in the middle of a transfer would stall it. */
    void *p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
    if (p == MAP_FAILED) {
        kvf_error("mmap of %zu bytes: %m", len);
        close(fd);
        return KVF_ERR_NO_MEMORY;
    }
    int ro_fd = seal_read_only(fd, len);
    if (ro_fd < 0) {      /* not memory: the kernel or /proc (kvferry.h says) */
        munmap(p, len);
        close(fd);
        return KVF_ERR_IO;
    }
    pthread_mutex_lock(&regions_lock);
    kvf_memfd_region_t *r = realloc(regions, (nregions + 1) * sizeof(*r));
    if (r != NULL) {
        regions = r;
        regions[nregions++] = (kvf_memfd_region_t){p, len, fd, ro_fd};
    }
    pthread_mutex_unlock(&regions_lock);
    if (r == NULL) {
        kvf_error("kvf_mem_alloc: no memory to record a %zu-byte region", len);
        munmap(p, len);
        close(fd);
        close(ro_fd);
        return KVF_ERR_NO_MEMORY;
    }
    *ptr_p = p;
    return KVF_OK;
}

void kvf_mem_free(void *ptr)
{
    if (ptr == NULL)
        return;
    pthread_mutex_lock(&regions_lock);
    for (size_t i = 0; i < nregions; i++) {
        if (regions[i].base != ptr)
            continue;
        munmap(regions[i].base, regions[i].len);
        close(regions[i].fd);
        close(regions[i].ro_fd);
        regions[i] = regions[--nregions];
        break;
    }
    pthread_mutex_unlock(&regions_lock);
}

const kvf_memfd_region_t *kvf_memfd_regions_hold(size_t *n_p)
{
    pthread_mutex_lock(&regions_lock);
    *n_p = nregions;
    return regions;
}

void kvf_memfd_regions_release(void)
{
    pthread_mutex_unlock(&regions_lock);
}
