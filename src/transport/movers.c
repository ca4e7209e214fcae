/*
 * The registration table of movers (mover.h): the one place that names
 * the backends built into this library, and the only one with a backend
 * #ifdef.  Everything else walks kvf_movers[].  (The fault transport,
 * which wraps the others rather than standing beside them, is named in
 * open.c, where connections and endpoints open.)
 */
#include <assert.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "transport/copier.h"
#include "transport/mover.h"
#ifdef KVF_HAVE_CUDA
#include "transport/cuda/cuda.h"
#endif
#include "transport/shm/shm.h"
#include "transport/tcp/tcp.h"
#include "transport/ucx/ucx.h"

const kvf_transport_ops_t *const kvf_control_ops = &kvf_tcp_ops;

kvf_status_t kvf_control_listen(const char *host, int port, int *fd_p, int *port_p)
{
    return kvf_tcp_listen(host, port, fd_p, port_p);
}

const char *kvf_stream_name(void)
{
    return kvf_tcp_ops.name;
}

/* In the order "auto" prefers them: same-host memory first, then ucx. */
const kvf_mover_ops_t *const kvf_movers[] = {
#ifdef KVF_HAVE_CUDA
    &kvf_cuda_mover,       /* device memory on this host (shm takes host memory only) */
#endif
    &kvf_shm_mover,
#ifdef KVF_HAVE_UCX
    &kvf_ucx_mover,
#endif
    NULL
};

#ifdef KVF_HAVE_CUDA
const kvf_copier_ops_t *const kvf_copier_ops = &kvf_cuda_copier;
#else
const kvf_copier_ops_t *const kvf_copier_ops = NULL;
#endif

/*
 * Payload paths by their public index (kvf_transport_name): 0 is the
 * control stream, then every mover kvferry has, built here or not.  The
 * indices are fixed for good, so that kvf_engine_stats_t.peers_by_path[i]
 * means one transport in every build and version: a build without a
 * mover leaves its slot at 0, and a new mover takes the next free slot
 * (at most KVF_PATHS_MAX).  check_table holds the built movers' names to
 * this table.
 */
static const char *const path_names[] = {"tcp", "cuda", "shm", "ucx"};
#define NPATHS (sizeof(path_names) / sizeof(path_names[0]))
_Static_assert(NPATHS <= KVF_PATHS_MAX, "more payload paths than KVF_PATHS_MAX");

/* Its index in path_names, or NPATHS. */
static unsigned path_of(const char *name)
{
    unsigned i = 0;
    while (i < NPATHS && strcmp(path_names[i], name) != 0)
        i++;
    return i;
}

/* Required ops, checked once (a new mover that forgot one fails loudly in
 * every test run, not in production). */
static void check_table(void)
{
    size_t n = 0;
    for (const kvf_mover_ops_t *const *m = kvf_movers; *m != NULL; m++, n++) {
        const kvf_mover_ops_t *o = *m;
        assert(o->name && o->create && o->destroy && o->fd && o->progress && o->pack &&
               o->connect && o->disconnect && o->read);
        /* Core has a path for pulled payload only (DATA_REF). */
        assert((o->caps & KVF_MOVER_CAP_PULL) && !(o->caps & KVF_MOVER_CAP_PUSH));
        assert((o->caps & (KVF_MOVER_CAP_MEM_HOST | KVF_MOVER_CAP_MEM_DEVICE)) != 0);
        assert(!(o->caps & KVF_MOVER_CAP_READ_FAIL_CLOSES_EP) == !o->ep_failed);
        assert(path_of(o->name) > 0 && path_of(o->name) < NPATHS);   /* has a slot */
        (void)o;
    }
    assert(n <= KVF_MAX_MOVERS);
    (void)n;
    const kvf_transport_ops_t *c = kvf_control_ops;
    assert(c->connect && c->accept && c->handle && c->send_msg && c->put && c->flush &&
           c->shutdown && c->destroy && c->last_rx && c->last_tx && c->idle && c->pending &&
           c->limit);
    assert(path_of(c->name) == 0);
    (void)c;
}

static pthread_once_t table_once = PTHREAD_ONCE_INIT;

void kvf_movers_check(void)
{
    pthread_once(&table_once, check_table);
}

const kvf_mover_ops_t *kvf_mover_find(const char *name, size_t len)
{
    kvf_movers_check();
    for (const kvf_mover_ops_t *const *m = kvf_movers; *m != NULL; m++)
        if (strlen((*m)->name) == len && memcmp((*m)->name, name, len) == 0)
            return *m;
    return NULL;
}

int kvf_mover_allowed(const char *transport, const kvf_mover_ops_t *ops)
{
    if (strcmp(transport, "auto") == 0)
        return ops->auto_ok == NULL || ops->auto_ok();
    return strcmp(transport, ops->name) == 0;
}

int kvf_mover_index(const kvf_mover_ops_t *ops)
{
    for (int i = 0; kvf_movers[i] != NULL; i++)
        if (kvf_movers[i] == ops)
            return i;
    return -1;
}

/* Every combination of payload paths, named once. */
static char mask_names[1u << (KVF_MAX_MOVERS + 1)][64];
static char transports[128];

static void name_all(void)
{
    for (unsigned mask = 0; mask < (1u << (KVF_MAX_MOVERS + 1)); mask++) {
        char *b = mask_names[mask];
        size_t len = sizeof(mask_names[mask]);
        b[0] = '\0';
        if (mask & 1u)
            snprintf(b, len, "tcp");
        for (int i = 0; kvf_movers[i] != NULL; i++)
            if (mask & (2u << i))
                snprintf(b + strlen(b), len - strlen(b), "%s%s", b[0] ? "+" : "",
                         kvf_movers[i]->name);
        if (b[0] == '\0')
            snprintf(b, len, "tcp");   /* nothing used yet: the control stream */
    }
    snprintf(transports, sizeof(transports), "tcp");
    for (int i = 0; kvf_movers[i] != NULL; i++)
        snprintf(transports + strlen(transports), sizeof(transports) - strlen(transports),
                 " %s", kvf_movers[i]->name);
#ifdef KVF_HAVE_UCX
    snprintf(transports + strlen(transports), sizeof(transports) - strlen(transports),
             "(%s)", kvf_ucx_version());   /* ucx is last in the table */
#endif
}

static pthread_once_t names_once = PTHREAD_ONCE_INIT;

const char *kvf_movers_mask_name(unsigned mask)
{
    pthread_once(&names_once, name_all);
    return mask_names[mask & ((1u << (KVF_MAX_MOVERS + 1)) - 1)];
}

const char *kvf_transports(void)
{
    pthread_once(&names_once, name_all);
    return transports;
}

const char *kvf_transport_name(unsigned i)
{
    return i < NPATHS ? path_names[i] : NULL;
}

unsigned kvf_mover_path(const kvf_mover_ops_t *ops)
{
    unsigned i = path_of(ops == NULL ? kvf_control_ops->name : ops->name);
    return i < NPATHS ? i : 0;      /* (never: check_table asserts a slot) */
}

const char *kvf_movers_device_hint(void)
{
#ifdef KVF_HAVE_UCX
    return "ucx carries it only with a UCX that has its CUDA module (`ucx_info -d` lists "
           "cuda_copy/cuda_ipc) and --transport ucx or auto";
#else
    return "this build has no ucx transport either";
#endif
}
