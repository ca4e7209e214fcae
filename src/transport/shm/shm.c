#include "transport/shm/shm.h"

#include <errno.h>
#include <sched.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <openssl/crypto.h>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "kvferry/kvferry.h"
#include "util/bootid.h"
#include "util/log.h"
#include "util/memfd.h"
#include "util/reserve.h"
#include "util/time.h"
#include "util/region.h"

#define NAME_LEN     48
#define COOKIE_LEN   KVF_SHM_COOKIE_LEN
#define BLOB_LEN     (4 + KVF_BOOT_ID_LEN + 8 + NAME_LEN + COOKIE_LEN)
#define MAX_COOKIES  256      /* offers whose cookie is not used yet */
#define COOKIE_MS    30000    /* an unused cookie expires */
#define MAX_PENDING  16       /* handout connections waiting for their cookie */
#define PENDING_MS   1000
#define REFUSAL_LOG_MS 60000  /* at most one line this often about refused requests */

#define READ_IOV     1024     /* iovecs per process_vm_readv (UIO_MAXIOV) */
#define MAX_REGIONS  250      /* memfds per answer (SCM_MAX_FD is 253) */
#define MAX_OFFER_REGIONS 65536 /* registered buffers named in an offer */

/* A registered buffer (prefill), or one the peer registered (decode). */
typedef struct span {
    uint64_t base, len;   /* first: kvf_region_find's element layout */
} span_t;

static int span_cmp(const void *a, const void *b)
{
    const span_t *x = a, *y = b;
    return x->base < y->base ? -1 : x->base > y->base;
}

/* ------------------------------------------------------------------------ */
/* Offer, listen, serve (prefill)                                           */
/* ------------------------------------------------------------------------ */

/* Abstract-namespace name: no file to clean up, gone with the process. */
static socklen_t socket_name(struct sockaddr_un *sa, const char *name)
{
    memset(sa, 0, sizeof(*sa));
    sa->sun_family = AF_UNIX;
    size_t n = strnlen(name, NAME_LEN);
    memcpy(sa->sun_path + 1, name, n);
    return (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + n);
}

static void make_name(char name[NAME_LEN], uint64_t instance)
{
    memset(name, 0, NAME_LEN);
    snprintf(name, NAME_LEN, "kvferry-shm-%d-%016llx", (int)getpid(),
             (unsigned long long)instance);
}

void kvf_shm_allow_readers(void)
{
#ifdef PR_SET_PTRACER
    /* Only matters under Yama ptrace_scope 1; harmless elsewhere. */
    if (prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY, 0, 0, 0) != 0 && errno != EINVAL)
        kvf_debug("prctl(PR_SET_PTRACER): %m");
#endif
}

kvf_status_t kvf_shm_listen(uint64_t instance, int *fd_p)
{
    char name[NAME_LEN];
    struct sockaddr_un sa;
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) {
        kvf_error("unix socket: %m");
        return KVF_ERR_IO;
    }
    make_name(name, instance);
    socklen_t len = socket_name(&sa, name);
    if (bind(fd, (struct sockaddr *)&sa, len) != 0 || listen(fd, 64) != 0) {
        kvf_warn("shm: cannot listen on unix socket @%s: %m", name);
        close(fd);
        return KVF_ERR_IO;
    }
    *fd_p = fd;
    return KVF_OK;
}

/* Whether the spans (sorted by base) cover every byte of [rb, re). */
static int covered(const span_t *sp, size_t n, uint64_t rb, uint64_t re)
{
    uint64_t at = rb;    /* [rb, at) is covered */
    for (size_t i = 0; i < n && at < re; i++) {
        if (sp[i].base > at)
            return 0;    /* sorted: no later span starts before this gap */
        if (sp[i].base + sp[i].len > at)
            at = sp[i].base + sp[i].len;
    }
    return at >= re;
}

/*
 * Send, as (base, len) + fds, the memfd of every kvf_mem_alloc region that
 * the registered buffers (sorted spans) cover whole.  A peer can map all
 * of a memfd it holds, whatever length it is told: the memfd of a region
 * registered only in part would hand it the rest too, so such a region is
 * left to process_vm_readv, with which the decode engine reads only the
 * sources it has checked against the registered buffers.
 */
static void answer(int fd, const span_t *spans, size_t n)
{
    uint64_t desc[2 * MAX_REGIONS + 1];
    int fds[MAX_REGIONS];
    size_t k = 0, nregions;

    /* Held until the fds are sent: none is closed (and reused) meanwhile. */
    const kvf_memfd_region_t *regions = kvf_memfd_regions_hold(&nregions);
    for (size_t r = 0; r < nregions && k < MAX_REGIONS; r++) {
        uintptr_t rb = (uintptr_t)regions[r].base, re = rb + regions[r].len;
        if (covered(spans, n, rb, re)) {
            desc[1 + 2 * k] = rb;
            desc[2 + 2 * k] = regions[r].len;
            fds[k++] = regions[r].ro_fd;
        }
    }
    desc[0] = k;
    char cbuf[CMSG_SPACE(sizeof(fds))];
    struct iovec iov = {desc, (1 + 2 * k) * sizeof(uint64_t)};
    struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1};
    if (k > 0) {
        mh.msg_control = cbuf;
        mh.msg_controllen = CMSG_SPACE(k * sizeof(int));
        struct cmsghdr *cm = CMSG_FIRSTHDR(&mh);
        cm->cmsg_level = SOL_SOCKET;
        cm->cmsg_type = SCM_RIGHTS;
        cm->cmsg_len = CMSG_LEN(k * sizeof(int));
        memcpy(CMSG_DATA(cm), fds, k * sizeof(int));
    }
    /* A few hundred bytes into an empty socket buffer: never blocks. */
    if (sendmsg(fd, &mh, MSG_NOSIGNAL | MSG_DONTWAIT) < 0)
        kvf_debug("shm: answering a decode engine: %m");
    kvf_memfd_regions_release();
}

/*
 * Say once, when a prefill engine starts, which kvf_mem_alloc regions its
 * buffers register only in part: their memfds are never handed out, so
 * peers read them at cross-memory-attach speed, and the fix is the
 * application's (register whole allocations).
 */
static void note_partial_regions(const span_t *spans, size_t n)
{
    size_t partial = 0, first = SIZE_MAX, nregions;

    const kvf_memfd_region_t *regions = kvf_memfd_regions_hold(&nregions);
    for (size_t r = 0; r < nregions; r++) {
        uintptr_t rb = (uintptr_t)regions[r].base, re = rb + regions[r].len;
        size_t i = 0;
        while (i < n && spans[i].base + spans[i].len <= rb)
            i++;
        if (i < n && spans[i].base < re && !covered(spans, n, rb, re)) {
            partial++;
            first = first == SIZE_MAX ? r : first;
        }
    }
    if (partial > 0)
        kvf_warn("shm: %zu kvf_mem_alloc allocation(s) are registered only in part (the "
                 "first: %zu bytes at %p): a decode engine could map all of one, so they "
                 "are not shared, and it reads them with process_vm_readv, at about half "
                 "the speed of a mapping. Register whole allocations (one buffer, or "
                 "buffers that tile it) to be read through a mapping",
                 partial, regions[first].len, regions[first].base);
    kvf_memfd_regions_release();
}

kvf_status_t kvf_shm_pack(void *const *bases, const size_t *lens, size_t n,
                          uint64_t instance, const uint8_t cookie[KVF_SHM_COOKIE_LEN],
                          kvf_buf_t *out)
{
    uint8_t blob[BLOB_LEN];
    char id[KVF_BOOT_ID_LEN];
    if (n == 0 || n > MAX_OFFER_REGIONS || kvf_boot_id(id) != 0)
        return KVF_ERR_UNSUPPORTED;
    kvf_put_u32(blob, (uint32_t)getpid());
    memcpy(blob + 4, id, KVF_BOOT_ID_LEN);
    kvf_put_u64(blob + 4 + KVF_BOOT_ID_LEN, (uint64_t)(uintptr_t)bases[0]);
    make_name((char *)blob + 4 + KVF_BOOT_ID_LEN + 8, instance);
    memcpy(blob + 4 + KVF_BOOT_ID_LEN + 8 + NAME_LEN, cookie, COOKIE_LEN);
    kvf_status_t st = kvf_buf_reserve(out, sizeof(blob) + 4 + n * 16);
    if (st != KVF_OK)
        return st;
    kvf_buf_append(out, blob, sizeof(blob));
    uint8_t *p = out->data + out->len;
    kvf_put_u32(p, (uint32_t)n);
    for (size_t i = 0; i < n; i++) {
        kvf_put_u64(p + 4 + 16 * i, (uint64_t)(uintptr_t)bases[i]);
        kvf_put_u64(p + 12 + 16 * i, (uint64_t)lens[i]);
    }
    out->len += 4 + n * 16;
    return KVF_OK;
}

/* ------------------------------------------------------------------------ */
/* Accept and read (decode)                                                 */
/* ------------------------------------------------------------------------ */

typedef struct mapping {
    uint64_t base;     /* in the peer process */
    size_t   len;
    uint8_t *map;      /* here, read-only */
} mapping_t;

struct kvf_shm_peer {
    kvf_mover_ep_t base;  /* first: the mover endpoint */
    struct kvf_shm *s;    /* the mover whose copier reads for it */
    size_t    jobs;       /* reads started and not handed back */
    int       closed;     /* disconnected: freed once jobs is 0 */
    pid_t     pid;
    span_t   *regs;       /* what the peer registered, sorted by base */
    size_t    nregs;
    int       fetch_fd;   /* waiting for the memfds, or -1 */
    uint8_t   cookie[COOKIE_LEN]; /* the offer's: the first bytes we send */
    uint64_t  fetch_deadline_ms;
    size_t    nmaps;
    mapping_t maps[MAX_REGIONS];
};

/*
 * Fetching the peer's memfds never waits: the connect is non-blocking (a
 * unix socket whose backlog is full answers EAGAIN at once, and then we do
 * without mappings), and the answer is picked up by kvf_shm_peer_progress
 * when it is there, within FETCH_MS.  Until then, and without it, reads go
 * through process_vm_readv: the same bytes, one copy too.
 */
#define FETCH_MS 1000

static void fetch_start(kvf_shm_peer_t *sp, const char *name)
{
    struct sockaddr_un sa;
    socklen_t salen = socket_name(&sa, name);
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);

    sp->fetch_fd = -1;
    if (fd < 0)
        return;
    /* The cookie goes at once: a few bytes into an empty socket buffer. */
    if (connect(fd, (struct sockaddr *)&sa, salen) != 0 ||
        send(fd, sp->cookie, COOKIE_LEN, MSG_DONTWAIT | MSG_NOSIGNAL) != COOKIE_LEN) {
        kvf_debug("shm: no mappings from pid %d (connect @%s: %m): reading with "
                  "process_vm_readv", (int)sp->pid, name);
        close(fd);
        return;
    }
    sp->fetch_fd = fd;
    sp->fetch_deadline_ms = kvf_now_ms() + FETCH_MS;
}

static void populate_soon(kvf_shm_peer_t *sp);

/* Map the peer's memfd regions once its answer is there; no regions is not
 * an error. */
static void fetch_poll(kvf_shm_peer_t *sp)
{
    uint64_t desc[2 * MAX_REGIONS + 1];
    char cbuf[CMSG_SPACE(MAX_REGIONS * sizeof(int))];

    if (sp->fetch_fd < 0)
        return;
    struct iovec iov = {desc, sizeof(desc)};
    struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = cbuf,
                        .msg_controllen = sizeof(cbuf)};
    ssize_t got = recvmsg(sp->fetch_fd, &mh, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
    if (got < 0 && (errno == EAGAIN || errno == EINTR)) {
        if (kvf_now_ms() < sp->fetch_deadline_ms)
            return;
        kvf_debug("shm: pid %d did not hand over its memfds within %d ms: reading "
                  "with process_vm_readv", (int)sp->pid, FETCH_MS);
    }
    close(sp->fetch_fd);
    sp->fetch_fd = -1;
    struct cmsghdr *cm = got > 0 ? CMSG_FIRSTHDR(&mh) : NULL;
    int fds[MAX_REGIONS];
    size_t nfd = 0;
    if (cm != NULL && cm->cmsg_level == SOL_SOCKET && cm->cmsg_type == SCM_RIGHTS) {
        nfd = (cm->cmsg_len - CMSG_LEN(0)) / sizeof(int);
        memcpy(fds, CMSG_DATA(cm), nfd * sizeof(int));
    }
    size_t k = got >= 8 ? (size_t)desc[0] : 0;
    if (k != nfd || (size_t)got != (1 + 2 * k) * sizeof(uint64_t))
        k = 0;   /* malformed: use none of it */
    /* Not MAP_POPULATE: this runs on the progress thread, under the engine
     * lock, and populating costs 35-50 ms per GiB of the peer's pool
     * (measured here).  A copier populates them instead (populate_soon):
     * faulting the pages in one by one as reads first touch them costs
     * ten times that. */
    for (size_t i = 0; i < nfd; i++) {
        void *m = i < k ? mmap(NULL, desc[2 + 2 * i], PROT_READ, MAP_SHARED, fds[i], 0)
                        : MAP_FAILED;
        close(fds[i]);
        if (m != MAP_FAILED)
            sp->maps[sp->nmaps++] = (mapping_t){desc[1 + 2 * i], desc[2 + 2 * i], m};
    }
    kvf_debug("shm: mapped %zu memfd regions of pid %d", sp->nmaps, (int)sp->pid);
    if (sp->nmaps > 0)
        populate_soon(sp);
}

void kvf_shm_peer_progress(kvf_shm_peer_t *sp)
{
    if (sp != NULL)
        fetch_poll(sp);
}

kvf_status_t kvf_shm_accept(const uint8_t *blob, size_t len, kvf_shm_peer_t **peer_p,
                            char *err, size_t errlen)
{
    char id[KVF_BOOT_ID_LEN], name[NAME_LEN + 1];
    size_t nregs = len >= BLOB_LEN + 4 ? kvf_get_u32(blob + BLOB_LEN) : 0;
    if (nregs == 0 || nregs > MAX_OFFER_REGIONS || len != BLOB_LEN + 4 + 16 * nregs) {
        snprintf(err, errlen, "malformed shm offer (%zu bytes, %zu regions)", len, nregs);
        return KVF_ERR_UNSUPPORTED;
    }
    if (kvf_boot_id(id) != 0 || memcmp(id, blob + 4, KVF_BOOT_ID_LEN) != 0) {
        snprintf(err, errlen, "the prefill engine runs on another host");
        return KVF_ERR_UNSUPPORTED;
    }
    pid_t pid = (pid_t)kvf_get_u32(blob);
    uint8_t byte;
    struct iovec l = {&byte, 1};
    struct iovec r = {(void *)(uintptr_t)kvf_get_u64(blob + 4 + KVF_BOOT_ID_LEN), 1};
    if (process_vm_readv(pid, &l, 1, &r, 1, 0) != 1) {
        snprintf(err, errlen, "cannot read the prefill engine's memory (pid %d): %s%s",
                 (int)pid, strerror(errno),
                 errno == EPERM ? " (different user, or ptrace restricted: see "
                                  "/proc/sys/kernel/yama/ptrace_scope)"
                 : errno == ESRCH ? " (another PID namespace?)" : "");
        return KVF_ERR_UNSUPPORTED;
    }
    kvf_shm_peer_t *sp = calloc(1, sizeof(*sp));
    if (sp == NULL) {
        snprintf(err, errlen, "out of memory");
        return KVF_ERR_UNSUPPORTED;
    }
    sp->base.ops = &kvf_shm_mover;
    sp->pid = pid;
    sp->nregs = nregs;
    if ((sp->regs = malloc(nregs * sizeof(*sp->regs))) == NULL) {
        free(sp);
        snprintf(err, errlen, "out of memory");
        return KVF_ERR_UNSUPPORTED;
    }
    for (size_t i = 0; i < nregs; i++) {
        const uint8_t *q = blob + BLOB_LEN + 4 + 16 * i;
        sp->regs[i] = (span_t){kvf_get_u64(q), kvf_get_u64(q + 8)};
    }
    qsort(sp->regs, nregs, sizeof(*sp->regs), span_cmp);
    memcpy(name, blob + 4 + KVF_BOOT_ID_LEN + 8, NAME_LEN);
    name[NAME_LEN] = '\0';
    memcpy(sp->cookie, blob + 4 + KVF_BOOT_ID_LEN + 8 + NAME_LEN, COOKIE_LEN);
    fetch_start(sp, name);
    *peer_p = sp;
    return KVF_OK;
}

void kvf_shm_peer_free(kvf_shm_peer_t *sp)
{
    if (sp == NULL)
        return;
    for (size_t i = 0; i < sp->nmaps; i++)
        munmap(sp->maps[i].map, sp->maps[i].len);
    if (sp->fetch_fd >= 0)
        close(sp->fetch_fd);
    free(sp->regs);
    free(sp);
}

pid_t kvf_shm_peer_pid(const kvf_shm_peer_t *sp)
{
    return sp->pid;
}

size_t kvf_shm_peer_mapped(const kvf_shm_peer_t *sp)
{
    return sp->nmaps;
}

#define STREAM_MIN (64u << 10)   /* copies this large bypass the caches */

/*
 * Copy KV into its destination pages.  Large pieces use non-temporal
 * stores: the bytes are not read again soon by this CPU, and streaming
 * them skips the read-for-ownership of every destination line, which
 * roughly doubles the speed of a copy that misses the caches anyway (libc
 * only streams copies larger than most of the last-level cache, and ours
 * come in pieces of at most a few MiB).
 */
static void copy_kv(uint8_t *dst, const uint8_t *src, size_t n)
{
#if defined(__SSE2__)
    if (n >= STREAM_MIN) {
        size_t head = (16 - ((uintptr_t)dst & 15)) & 15;
        memcpy(dst, src, head);
        dst += head;
        src += head;
        n -= head;
        for (; n >= 64; n -= 64, dst += 64, src += 64) {
            __m128i a = _mm_loadu_si128((const __m128i *)src);
            __m128i b = _mm_loadu_si128((const __m128i *)(src + 16));
            __m128i c = _mm_loadu_si128((const __m128i *)(src + 32));
            __m128i d = _mm_loadu_si128((const __m128i *)(src + 48));
            _mm_stream_si128((__m128i *)dst, a);
            _mm_stream_si128((__m128i *)(dst + 16), b);
            _mm_stream_si128((__m128i *)(dst + 32), c);
            _mm_stream_si128((__m128i *)(dst + 48), d);
        }
        _mm_sfence();   /* streamed stores are visible before we go on */
    }
#endif
    memcpy(dst, src, n);
}

/* The local view of [addr, +len) in the peer, or NULL. */
static const uint8_t *mapped(const kvf_shm_peer_t *sp, uint64_t addr, size_t len)
{
    for (size_t i = 0; i < sp->nmaps; i++) {
        const mapping_t *m = &sp->maps[i];
        if (addr >= m->base && addr - m->base <= m->len && len <= m->len - (addr - m->base))
            return m->map + (addr - m->base);
    }
    return NULL;
}

static kvf_status_t cma_read(pid_t pid, struct iovec *local, struct iovec *remote, size_t n,
                             char *err, size_t errlen)
{
    size_t want = 0;
    for (size_t j = 0; j < n; j++)
        want += local[j].iov_len;
    ssize_t got = process_vm_readv(pid, local, (unsigned long)n, remote, (unsigned long)n, 0);
    if (got < 0 || (size_t)got != want) {
        /* Partial reads stop at an unmapped page: nothing to resume. */
        snprintf(err, errlen, "reading %zu bytes from process %d failed: %s", want,
                 (int)pid, got < 0 ? strerror(errno) : "short read");
        return KVF_ERR_CONN_RESET;
    }
    return KVF_OK;
}

/*
 * One read, copied by the mover's copier thread without the engine lock:
 * the pieces, the local view of each source (NULL: process_vm_readv),
 * and the outcome.  Everything the copier needs is in the job, so that it
 * never looks at the peer while the progress thread changes it.
 */
typedef struct job {
    kvf_mover_read_t *rd;          /* NULL: populate sp's mappings instead */
    kvf_shm_peer_t   *sp;
    pid_t             pid;
    struct iovec     *local, *remote;
    size_t            n;
    kvf_status_t      st;
    int               finished;    /* copied (under kvf_shm_t.mu) */
    char              err[160];
    struct job       *next;
    const uint8_t    *src[];
} job_t;

/* Copy one job (the copier thread, no lock held). */
static void copy_job(job_t *j)
{
    size_t start = 0;   /* first piece of the pending process_vm_readv batch */

    j->st = KVF_OK;
    for (size_t i = 0; i <= j->n && j->st == KVF_OK; i++) {
        const uint8_t *src = i < j->n ? j->src[i] : NULL;
        if (i < j->n && src == NULL && i - start < READ_IOV)
            continue;
        if (i > start)
            j->st = cma_read(j->pid, j->local + start, j->remote + start, i - start,
                             j->err, sizeof(j->err));
        if (src != NULL && j->st == KVF_OK)
            copy_kv(j->local[i].iov_base, src, j->local[i].iov_len);
        start = src != NULL ? i + 1 : i;
    }
}

/* Populate a peer's mappings (the copier thread, no lock held); a kernel
 * without MADV_POPULATE_READ (before 5.14) leaves it to the reads. */
static void populate(const kvf_shm_peer_t *sp)
{
    for (size_t i = 0; i < sp->nmaps; i++)
        if (madvise(sp->maps[i].map, sp->maps[i].len, MADV_POPULATE_READ) != 0) {
            kvf_debug("shm: populating a mapping of pid %d: %m", (int)sp->pid);
            return;
        }
}

/* ------------------------------------------------------------------------ */
/* The mover (mover.h)                                                      */
/* ------------------------------------------------------------------------ */

/*
 * Decode: reads are copied by copier threads (KVF_SHM_COPIERS of them, see
 * shm_create), with the engine lock free: an application call never waits
 * for a copy, the progress thread parses the next frames meanwhile, and
 * one large room's frames are copied on as many cores as there are
 * copiers.  Jobs stay in one list in the order they were started; each
 * copier takes the first not yet taken.  Finished jobs go back to the
 * progress thread through an eventfd (the mover's fd), whose progress
 * hands back the finished head of the list (rd->done): in order, as the
 * contract wants, whichever copier finished first.
 */
#define MAX_COPIERS 16

/* An offer's cookie: good once, for the process that was offered it. */
typedef struct cookie {
    uint8_t  bytes[COOKIE_LEN];
    pid_t    pid;              /* as the peer declared it in its AUTH */
    uint64_t expires_ms;       /* 0: free slot */
} cookie_t;

/* A handout connection whose cookie has not all arrived. */
typedef struct pending {
    int      fd;               /* -1: free slot */
    size_t   got;
    uint8_t  bytes[COOKIE_LEN];
    uint64_t until_ms;
} pending_t;

typedef struct kvf_shm {
    kvf_mover_t     base;
    uint64_t        instance;
    int             listen_fd;     /* prefill: hands out memfds, or -1 */
    int             hand_epfd;     /* prefill: the listener and pending[], or -1 */
    int             reserve_fd;    /* prefill: kept for when out of descriptors */
    pending_t       pending[MAX_PENDING];
    cookie_t        cookies[MAX_COOKIES];
    uint64_t        refusal_logged_ms;  /* last line about a refused request, or 0 */
    uint64_t        refused_unlogged;   /* refused since that line */
    void          **bases;         /* the registered buffers, for offers */
    size_t         *lens;
    size_t          n;
    span_t         *spans;         /* prefill: the same, sorted by base */
    /* decode */
    int             efd;           /* finished jobs are waiting, or -1 */
    pthread_t       copier[MAX_COPIERS];
    int             ncopiers;      /* started */
    pthread_mutex_t mu;            /* the job list and `stopping` */
    pthread_cond_t  cv;
    int             stopping;
    job_t          *jobs, **jobs_tail;  /* started and not handed back */
    job_t          *untaken;       /* first job no copier has taken, or NULL */
} kvf_shm_t;

/* ---- the memfd handout (prefill) --------------------------------------- */

static int handout_start(kvf_shm_t *s)
{
    struct epoll_event ev = {.events = EPOLLIN, .data.u32 = UINT32_MAX};
    s->hand_epfd = epoll_create1(EPOLL_CLOEXEC);
    if (s->hand_epfd < 0 || epoll_ctl(s->hand_epfd, EPOLL_CTL_ADD, s->listen_fd, &ev) != 0) {
        kvf_warn("shm: epoll for the memfd handout: %m");
        if (s->hand_epfd >= 0)
            close(s->hand_epfd);
        s->hand_epfd = -1;
        return -1;
    }
    return 0;
}

/* A fresh cookie for `pid`, remembered until used or COOKIE_MS. */
static int cookie_new(kvf_shm_t *s, pid_t pid, uint8_t out[COOKIE_LEN])
{
    uint64_t now = kvf_now_ms();
    cookie_t *slot = &s->cookies[0];
    for (int i = 0; i < MAX_COOKIES; i++) {
        cookie_t *c = &s->cookies[i];
        if (c->expires_ms <= now) {   /* free or expired */
            slot = c;
            break;
        }
        if (c->expires_ms < slot->expires_ms)
            slot = c;                 /* all taken: the oldest goes */
    }
    if (getrandom(slot->bytes, COOKIE_LEN, 0) != COOKIE_LEN) {
        kvf_error("shm: getrandom for a handout cookie: %m");
        slot->expires_ms = 0;
        return -1;
    }
    slot->pid = pid;
    slot->expires_ms = now + COOKIE_MS;
    memcpy(out, slot->bytes, COOKIE_LEN);
    return 0;
}

/* The cookie that matches, used up (whoever presented it); or NULL. */
static const cookie_t *cookie_take(kvf_shm_t *s, const uint8_t bytes[COOKIE_LEN])
{
    uint64_t now = kvf_now_ms();
    for (int i = 0; i < MAX_COOKIES; i++) {
        cookie_t *c = &s->cookies[i];
        if (c->expires_ms > now && CRYPTO_memcmp(c->bytes, bytes, COOKIE_LEN) == 0) {
            c->expires_ms = 0;
            return c;
        }
    }
    return NULL;
}

static void pending_close(kvf_shm_t *s, pending_t *q)
{
    epoll_ctl(s->hand_epfd, EPOLL_CTL_DEL, q->fd, NULL);
    close(q->fd);
    q->fd = -1;
}

/* Log a refused memfd request, at most once per REFUSAL_LOG_MS with the
 * number refused since the last line: anyone on the host can connect to
 * the socket, and a flood of bad cookies must not become a flood of log
 * lines (progress thread). */
static void log_refusal(kvf_shm_t *s, const char *why)
{
    uint64_t now = kvf_now_ms();
    if (s->refusal_logged_ms != 0 && now - s->refusal_logged_ms < REFUSAL_LOG_MS) {
        s->refused_unlogged++;
        return;
    }
    if (s->refused_unlogged > 0)
        kvf_warn("shm: refused a memfd request %s (and %llu more since the last such "
                 "line)", why, (unsigned long long)s->refused_unlogged);
    else
        kvf_warn("shm: refused a memfd request %s (further refusals are logged once a "
                 "minute, with their number)", why);
    s->refusal_logged_ms = now ? now : 1;
    s->refused_unlogged = 0;
}

/* A connection sent its cookie: memfds if it is one we gave out, to the
 * process we gave it to; nothing otherwise. */
static void pending_done(kvf_shm_t *s, pending_t *q)
{
    struct ucred cred = {0};
    socklen_t clen = sizeof(cred);
    char why[128];
    const cookie_t *c = cookie_take(s, q->bytes);
    if (c == NULL) {
        log_refusal(s, "with an unknown or used cookie");
    } else if (getsockopt(q->fd, SOL_SOCKET, SO_PEERCRED, &cred, &clen) != 0 ||
               cred.pid != c->pid) {
        snprintf(why, sizeof(why), "from pid %d with the cookie offered to pid %d (the "
                 "authenticated peer)", (int)cred.pid, (int)c->pid);
        log_refusal(s, why);
    } else {
        answer(q->fd, s->spans, s->n);
    }
    pending_close(s, q);
}

static void pending_read(kvf_shm_t *s, pending_t *q)
{
    ssize_t got = recv(q->fd, q->bytes + q->got, COOKIE_LEN - q->got, MSG_DONTWAIT);
    if (got > 0 && (q->got += (size_t)got) == COOKIE_LEN)
        pending_done(s, q);
    else if (got == 0 || (got < 0 && errno != EAGAIN && errno != EINTR))
        pending_close(s, q);
}

/* Accept what is waiting, read the cookies that arrived, drop those late
 * (a connection that sends nothing holds a slot for PENDING_MS at most,
 * and when all are taken the oldest goes).  Never blocks. */
static void serve(kvf_shm_t *s)
{
    struct epoll_event evs[MAX_PENDING + 1];
    uint64_t now = kvf_now_ms();
    int n = epoll_wait(s->hand_epfd, evs, MAX_PENDING + 1, 0);
    for (int i = 0; i < n; i++)
        if (evs[i].data.u32 != UINT32_MAX && s->pending[evs[i].data.u32].fd >= 0)
            pending_read(s, &s->pending[evs[i].data.u32]);
    for (int i = 0; i < MAX_PENDING; i++)
        if (s->pending[i].fd >= 0 && now >= s->pending[i].until_ms)
            pending_close(s, &s->pending[i]);
    for (;;) {
        int fd = accept4(s->listen_fd, NULL, NULL, SOCK_CLOEXEC | SOCK_NONBLOCK);
        if (fd < 0 && (errno == EMFILE || errno == ENFILE)) {
            /* Out of descriptors: the listener would stay readable and the
             * engine's loop spin on it; turn the connection away. */
            if (kvf_reserve_shed(&s->reserve_fd, s->listen_fd) > 0) {
                log_refusal(s, "at once: this process is out of file descriptors");
                continue;
            }
        }
        if (fd < 0)
            return;
        pending_t *q = &s->pending[0];
        for (int i = 0; i < MAX_PENDING; i++) {
            if (s->pending[i].fd < 0) {
                q = &s->pending[i];
                break;
            }
            if (s->pending[i].until_ms < q->until_ms)
                q = &s->pending[i];
        }
        if (q->fd >= 0)
            pending_close(s, q);
        *q = (pending_t){.fd = fd, .got = 0, .until_ms = now + PENDING_MS};
        struct epoll_event ev = {.events = EPOLLIN, .data.u32 = (uint32_t)(q - s->pending)};
        if (epoll_ctl(s->hand_epfd, EPOLL_CTL_ADD, fd, &ev) != 0) {
            close(fd);
            q->fd = -1;
            continue;
        }
        pending_read(s, q);     /* the cookie is usually there already */
    }
}

static void *copier_main(void *arg)
{
    kvf_shm_t *s = arg;
    pthread_mutex_lock(&s->mu);
    for (;;) {
        while (s->untaken == NULL && !s->stopping)
            pthread_cond_wait(&s->cv, &s->mu);
        if (s->untaken == NULL)
            break;
        job_t *j = s->untaken;
        s->untaken = j->next;
        pthread_mutex_unlock(&s->mu);
        if (j->rd != NULL)
            copy_job(j);
        else
            populate(j->sp);
        pthread_mutex_lock(&s->mu);
        j->finished = 1;
        uint64_t one = 1;
        if (s->jobs == j && write(s->efd, &one, sizeof(one)) < 0 && errno != EAGAIN)
            kvf_warn("shm: eventfd write: %m");
    }
    pthread_mutex_unlock(&s->mu);
    return NULL;
}

/* Hand back the finished jobs at the head of the list (progress thread);
 * free the endpoints that were disconnected and have none left. */
static void hand_back(kvf_shm_t *s)
{
    pthread_mutex_lock(&s->mu);
    job_t *head = s->jobs, **cut = &s->jobs;
    while (*cut != NULL && (*cut)->finished)
        cut = &(*cut)->next;
    if (cut == &s->jobs) {
        pthread_mutex_unlock(&s->mu);
        return;
    }
    s->jobs = *cut;
    if (s->jobs == NULL)
        s->jobs_tail = &s->jobs;
    *cut = NULL;
    pthread_mutex_unlock(&s->mu);
    for (job_t *j = head, *next; j != NULL; j = next) {
        next = j->next;
        kvf_shm_peer_t *sp = j->sp;
        if (j->rd != NULL)
            j->rd->done(j->rd, j->st, j->err);
        free(j);
        if (--sp->jobs == 0 && sp->closed)
            kvf_shm_peer_free(sp);
    }
}

static void shm_destroy(kvf_mover_t *m)
{
    kvf_shm_t *s = (kvf_shm_t *)m;
    if (s == NULL)
        return;
    if (s->ncopiers > 0) {
        /* The copiers finish what was given them (bounded copies each),
         * then everything is handed back: nothing lands after this. */
        pthread_mutex_lock(&s->mu);
        s->stopping = 1;
        pthread_cond_broadcast(&s->cv);
        pthread_mutex_unlock(&s->mu);
        for (int i = 0; i < s->ncopiers; i++)
            pthread_join(s->copier[i], NULL);
        for (job_t *j = s->untaken; j != NULL; j = j->next) {
            j->st = KVF_ERR_CONN_RESET;   /* never taken: never will be */
            snprintf(j->err, sizeof(j->err), "the shm transport was shut down before "
                     "the read was copied");
        }
        for (job_t *j = s->jobs; j != NULL; j = j->next)
            j->finished = 1;
        hand_back(s);
    }
    if (s->listen_fd >= 0)
        close(s->listen_fd);
    if (s->reserve_fd >= 0)
        close(s->reserve_fd);
    for (int i = 0; i < MAX_PENDING; i++)
        if (s->pending[i].fd >= 0)
            close(s->pending[i].fd);
    if (s->hand_epfd >= 0)
        close(s->hand_epfd);
    if (s->efd >= 0)
        close(s->efd);
    pthread_mutex_destroy(&s->mu);
    pthread_cond_destroy(&s->cv);
    free(s->bases);
    free(s->lens);
    free(s->spans);
    free(s);
}

/*
 * How many copier threads a decode engine runs: KVF_SHM_COPIERS, or by
 * default one per two CPUs this process may run on, at most 4 (a copy is
 * bound by memory bandwidth, which a few cores saturate; the other CPUs
 * are the inference engine's).
 */
static int copiers_wanted(void)
{
    const char *env = getenv("KVF_SHM_COPIERS");
    long n = 0;
    if (env != NULL && *env != '\0') {
        char *end;
        n = strtol(env, &end, 10);
        if (*end != '\0' || n < 1 || n > MAX_COPIERS) {
            kvf_warn("KVF_SHM_COPIERS=%s is not a number in 1..%d: using the default",
                     env, MAX_COPIERS);
            n = 0;
        }
    }
    if (n == 0) {
        cpu_set_t set;
        long cpus = sched_getaffinity(0, sizeof(set), &set) == 0 ? CPU_COUNT(&set)
                                                                : sysconf(_SC_NPROCESSORS_ONLN);
        n = cpus / 2;
        n = n < 1 ? 1 : n > 4 ? 4 : n;
    }
    return (int)n;
}

static kvf_status_t shm_create(const kvf_mover_params_t *p, kvf_mover_t **m_p, char *err,
                               size_t errlen)
{
    if (p->mem_kind != KVF_MEM_HOST) {
        snprintf(err, errlen, "shm moves host memory only");
        return KVF_ERR_UNSUPPORTED;
    }
    kvf_shm_t *s = calloc(1, sizeof(*s));
    if (s == NULL) {
        snprintf(err, errlen, "out of memory");
        return KVF_ERR_NO_MEMORY;
    }
    s->base.ops = &kvf_shm_mover;
    s->instance = p->instance_id;
    s->listen_fd = -1;
    s->hand_epfd = -1;
    s->reserve_fd = p->role == KVF_ROLE_PREFILL ? kvf_reserve_open() : -1;
    for (int i = 0; i < MAX_PENDING; i++)
        s->pending[i].fd = -1;
    s->efd = -1;
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->cv, NULL);
    s->jobs_tail = &s->jobs;
    if ((s->bases = malloc(p->n * sizeof(void *))) == NULL ||
        (s->lens = malloc(p->n * sizeof(size_t))) == NULL) {
        shm_destroy(&s->base);
        snprintf(err, errlen, "out of memory");
        return KVF_ERR_NO_MEMORY;
    }
    s->n = p->n;
    memcpy(s->bases, p->bases, p->n * sizeof(void *));
    memcpy(s->lens, p->lens, p->n * sizeof(size_t));
    if (p->role == KVF_ROLE_PREFILL) {
        if ((s->spans = malloc(p->n * sizeof(*s->spans))) == NULL) {
            shm_destroy(&s->base);
            snprintf(err, errlen, "out of memory");
            return KVF_ERR_NO_MEMORY;
        }
        for (size_t i = 0; i < p->n; i++)
            s->spans[i] = (span_t){(uint64_t)(uintptr_t)p->bases[i], p->lens[i]};
        qsort(s->spans, p->n, sizeof(*s->spans), span_cmp);
        note_partial_regions(s->spans, p->n);
        kvf_shm_allow_readers();
        /* Without the socket, readers use process_vm_readv: still shm. */
        if (kvf_shm_listen(p->instance_id, &s->listen_fd) != KVF_OK)
            s->listen_fd = -1;
        else if (handout_start(s) != 0) {
            close(s->listen_fd);
            s->listen_fd = -1;
        }
    } else {
        int want = copiers_wanted();
        s->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
        for (int i = 0; s->efd >= 0 && i < want; i++) {
            if (pthread_create(&s->copier[i], NULL, copier_main, s) != 0)
                break;
            s->ncopiers++;
        }
        if (s->ncopiers == 0) {
            snprintf(err, errlen, "cannot start the shm copier: %s", strerror(errno));
            shm_destroy(&s->base);
            return KVF_ERR_NO_MEMORY;
        }
    }
    *m_p = &s->base;
    return KVF_OK;
}

static int shm_fd(const kvf_mover_t *m)
{
    const kvf_shm_t *s = (const kvf_shm_t *)m;
    return s->hand_epfd >= 0 ? s->hand_epfd : s->efd;
}

static int shm_progress(kvf_mover_t *m)
{
    kvf_shm_t *s = (kvf_shm_t *)m;
    uint64_t v;
    if (s->hand_epfd >= 0)
        serve(s);
    if (s->efd >= 0 && read(s->efd, &v, sizeof(v)) == sizeof(v))
        hand_back(s);
    return 0;
}

static kvf_status_t shm_pack_offer(kvf_mover_t *m, const kvf_mover_peer_t *peer,
                                   kvf_buf_t *out)
{
    kvf_shm_t *s = (kvf_shm_t *)m;
    uint8_t cookie[COOKIE_LEN] = {0};
    if (s->hand_epfd >= 0 && cookie_new(s, (pid_t)peer->pid, cookie) != 0)
        return KVF_ERR_IO;
    /* Without the socket the cookie is never asked for: readers use
     * process_vm_readv, which the kernel checks itself. */
    return kvf_shm_pack(s->bases, s->lens, s->n, s->instance, cookie, out);
}

static kvf_status_t shm_connect(kvf_mover_t *m, const uint8_t *blob, size_t len,
                                kvf_mover_ep_t **ep_p, char *why, size_t whylen)
{
    kvf_shm_peer_t *sp;
    kvf_shm_t *s = (kvf_shm_t *)m;
    if (s->ncopiers == 0) {
        snprintf(why, whylen, "a prefill engine does not read over shm");
        return KVF_ERR_UNSUPPORTED;
    }
    kvf_status_t st = kvf_shm_accept(blob, len, &sp, why, whylen);
    if (st == KVF_OK) {
        sp->s = s;
        *ep_p = &sp->base;
    }
    return st;
}

/* Reads already given to the copier finish (a bounded copy each); the
 * endpoint, and its mappings, go once they are handed back. */
static void shm_disconnect(kvf_mover_ep_t *ep)
{
    kvf_shm_peer_t *sp = (kvf_shm_peer_t *)ep;
    if (sp == NULL)
        return;
    sp->closed = 1;
    if (sp->jobs == 0)
        kvf_shm_peer_free(sp);
}

static void shm_tick(kvf_mover_ep_t *ep)
{
    kvf_shm_peer_progress((kvf_shm_peer_t *)ep);
}

/* Give a job to the copiers; the endpoint stays until it is handed back. */
static void enqueue(kvf_shm_peer_t *sp, job_t *j)
{
    kvf_shm_t *s = sp->s;
    sp->jobs++;
    pthread_mutex_lock(&s->mu);
    *s->jobs_tail = j;
    s->jobs_tail = &j->next;
    if (s->untaken == NULL)
        s->untaken = j;
    pthread_cond_signal(&s->cv);
    pthread_mutex_unlock(&s->mu);
}

/* The first job for a peer's new mappings: the reads after it find the
 * pages in place. */
static void populate_soon(kvf_shm_peer_t *sp)
{
    job_t *j = sp->s != NULL ? calloc(1, sizeof(*j)) : NULL;
    if (j == NULL)
        return;                 /* the reads fault the pages in */
    j->sp = sp;
    enqueue(sp, j);
}

/*
 * Check every source against what the peer registered (the peer names the
 * addresses, and we read nothing else of it), resolve each to our mapping
 * of it or to process_vm_readv, and give the job to the copier.
 */
static kvf_status_t shm_read_ep(kvf_mover_ep_t *ep, kvf_mover_read_t *rd,
                                struct iovec *local, struct iovec *remote, size_t n,
                                unsigned timeout_ms, char *err, size_t errlen)
{
    kvf_shm_peer_t *sp = (kvf_shm_peer_t *)ep;
    (void)timeout_ms;   /* a bounded copy here: nothing waits on the peer */

    fetch_poll(sp);
    for (size_t i = 0; i < n; i++) {
        uint64_t a = (uint64_t)(uintptr_t)remote[i].iov_base;
        if (remote[i].iov_len != local[i].iov_len ||
            kvf_region_find(sp->regs, sizeof(*sp->regs), sp->nregs, a,
                            remote[i].iov_len) == SIZE_MAX) {
            snprintf(err, errlen, "the peer asked for a read of %zu bytes at 0x%llx, "
                     "outside every region it registered", remote[i].iov_len,
                     (unsigned long long)a);
            return KVF_ERR_PROTOCOL;
        }
    }
    job_t *j = malloc(sizeof(*j) + n * sizeof(j->src[0]));
    if (j == NULL) {
        snprintf(err, errlen, "out of memory for a %zu-piece read", n);
        return KVF_ERR_NO_MEMORY;
    }
    *j = (job_t){.rd = rd, .sp = sp, .pid = sp->pid, .local = local, .remote = remote,
                 .n = n};
    for (size_t i = 0; i < n; i++)
        j->src[i] = mapped(sp, (uint64_t)(uintptr_t)remote[i].iov_base, remote[i].iov_len);
    enqueue(sp, j);
    return KVF_OK;
}

/* A failed read is the memory of one read gone, not the endpoint: no
 * KVF_MOVER_CAP_READ_FAIL_CLOSES_EP, no ep_failed. */
const kvf_mover_ops_t kvf_shm_mover = {
    .name = "shm",
    .caps = KVF_MOVER_CAP_PULL | KVF_MOVER_CAP_MEM_HOST,
    .create = shm_create,
    .destroy = shm_destroy,
    .fd = shm_fd,
    .progress = shm_progress,
    .pack = shm_pack_offer,
    .connect = shm_connect,
    .disconnect = shm_disconnect,
    .tick = shm_tick,
    .read = shm_read_ep,
};
