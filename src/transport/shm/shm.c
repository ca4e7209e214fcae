#include "transport/shm/shm.h"

#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <string.h>
#include <sys/prctl.h>
#include <unistd.h>

#include "util/log.h"

#define BOOT_ID_LEN 36
#define BLOB_LEN    (4 + BOOT_ID_LEN + 8)
#define READ_IOV    1024     /* iovecs per process_vm_readv (UIO_MAXIOV) */

static int boot_id(char id[BOOT_ID_LEN])
{
    FILE *f = fopen("/proc/sys/kernel/random/boot_id", "r");
    if (f == NULL)
        return -1;
    size_t n = fread(id, 1, BOOT_ID_LEN, f);
    fclose(f);
    return n == BOOT_ID_LEN ? 0 : -1;
}

void kvf_shm_allow_readers(void)
{
#ifdef PR_SET_PTRACER
    /* Only matters under Yama ptrace_scope 1; harmless elsewhere. */
    if (prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY, 0, 0, 0) != 0 && errno != EINVAL)
        kvf_debug("prctl(PR_SET_PTRACER): %m");
#endif
}

kvf_status_t kvf_shm_pack(const void *probe, kvf_buf_t *out)
{
    uint8_t blob[BLOB_LEN];
    char id[BOOT_ID_LEN];
    if (boot_id(id) != 0)
        return KVF_ERR_UNSUPPORTED;
    kvf_put_u32(blob, (uint32_t)getpid());
    memcpy(blob + 4, id, BOOT_ID_LEN);
    kvf_put_u64(blob + 4 + BOOT_ID_LEN, (uint64_t)(uintptr_t)probe);
    return kvf_buf_append(out, blob, sizeof(blob));
}

kvf_status_t kvf_shm_accept(const uint8_t *blob, size_t len, pid_t *pid_p, char *err,
                            size_t errlen)
{
    char id[BOOT_ID_LEN];
    if (len != BLOB_LEN) {
        snprintf(err, errlen, "malformed shm offer (%zu bytes)", len);
        return KVF_ERR_UNSUPPORTED;
    }
    if (boot_id(id) != 0 || memcmp(id, blob + 4, BOOT_ID_LEN) != 0) {
        snprintf(err, errlen, "the prefill engine runs on another host");
        return KVF_ERR_UNSUPPORTED;
    }
    pid_t pid = (pid_t)kvf_get_u32(blob);
    uint8_t byte;
    struct iovec l = {&byte, 1};
    struct iovec r = {(void *)(uintptr_t)kvf_get_u64(blob + 4 + BOOT_ID_LEN), 1};
    if (process_vm_readv(pid, &l, 1, &r, 1, 0) != 1) {
        snprintf(err, errlen, "cannot read the prefill engine's memory (pid %d): %s%s",
                 (int)pid, strerror(errno),
                 errno == EPERM ? " (different user, or ptrace restricted: see "
                                  "/proc/sys/kernel/yama/ptrace_scope)"
                 : errno == ESRCH ? " (another PID namespace?)" : "");
        return KVF_ERR_UNSUPPORTED;
    }
    *pid_p = pid;
    return KVF_OK;
}

kvf_status_t kvf_shm_read(pid_t pid, struct iovec *local, struct iovec *remote, size_t n,
                          char *err, size_t errlen)
{
    for (size_t i = 0; i < n;) {
        size_t k = n - i < READ_IOV ? n - i : READ_IOV;
        size_t want = 0;
        for (size_t j = 0; j < k; j++)
            want += local[i + j].iov_len;
        ssize_t got = process_vm_readv(pid, local + i, (unsigned long)k, remote + i,
                                       (unsigned long)k, 0);
        if (got < 0 || (size_t)got != want) {
            /* Partial reads stop at an unmapped page: nothing to resume. */
            snprintf(err, errlen, "reading %zu bytes from process %d failed: %s", want,
                     (int)pid, got < 0 ? strerror(errno) : "short read");
            return KVF_ERR_CONN_RESET;
        }
        i += k;
    }
    return KVF_OK;
}
