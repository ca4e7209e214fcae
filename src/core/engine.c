/*
 * Engine: parameters, creation, layout registration and the progress
 * threads.  Lane 0's is one epoll loop over the control listener
 * (listener.c), a wake-up eventfd, every peer's first stream and the
 * movers, plus a 50 ms tick for heartbeats and room deadlines; lane k >= 1's
 * loops over its own eventfd and stream k of every peer (peer.c, "Streams").
 */
#include <assert.h>
#include <errno.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <unistd.h>

#include <openssl/crypto.h>
#include <openssl/evp.h>

#include "bootstrap/bootstrap.h"
#include "core/resolver.h"
#include "core/room.h"
#include "core/sized.h"
#include "core/stage.h"
#include "core/trace.h"
#include "transport/copier.h"
#include "transport/mover.h"
#include "util/log.h"
#include "util/time.h"

#define TICK_MS  50
#define STALL_MS 1000   /* a tick this late: the process itself was stopped */

static int check_rank(const char *what, int rank, int size)
{
    if (size < 1 || rank < 0 || rank >= size) {
        kvf_error("invalid %s: rank %d of size %d (need 0 <= rank < size)", what,
                  rank, size);
        return 0;
    }
    return 1;
}

/* p is the library's full-size copy (kvf__engine_params_import). */
static kvf_status_t check_params(const kvf_engine_params_t *p)
{
    if (p->role != KVF_ROLE_PREFILL && p->role != KVF_ROLE_DECODE) {
        kvf_error("invalid role %d", (int)p->role);
        return KVF_ERR_INVALID_PARAM;
    }
    if (!check_rank("tp", p->tp_rank, p->tp_size) ||
        !check_rank("pp", p->pp_rank, p->pp_size) ||
        !check_rank("dp", p->dp_rank, p->dp_size))
        return KVF_ERR_INVALID_PARAM;
    if (p->port < 0 || p->port > 65535 || p->host == NULL) {
        kvf_error("invalid host/port");
        return KVF_ERR_INVALID_PARAM;
    }
    if (p->host_bootstrap && (p->role != KVF_ROLE_PREFILL || p->bootstrap_addr == NULL)) {
        kvf_error("host_bootstrap needs role prefill and a bootstrap_addr to listen on");
        return KVF_ERR_INVALID_PARAM;
    }
    if (p->transport != NULL && strcmp(p->transport, "auto") != 0 &&
        strcmp(p->transport, kvf_stream_name()) != 0 &&
        kvf_mover_find(p->transport, strlen(p->transport)) == NULL) {
        kvf_error("transport '%s' is not built into this kvferry (available: auto, %s)",
                  p->transport, kvf_transports());
        return KVF_ERR_UNSUPPORTED;
    }
    if (p->heartbeat_interval_ms == 0 || p->heartbeat_timeout_ms <= p->heartbeat_interval_ms) {
        kvf_error("heartbeat_timeout_ms (%u) must exceed heartbeat_interval_ms (%u)",
                  p->heartbeat_timeout_ms, p->heartbeat_interval_ms);
        return KVF_ERR_INVALID_PARAM;
    }
    if (p->bootstrap_timeout_ms == 0 || p->waiting_timeout_ms == 0 ||
        p->transfer_timeout_ms == 0) {
        kvf_error("room deadlines must be positive");
        return KVF_ERR_INVALID_PARAM;
    }
    if (p->streams > KVF_MAX_STREAMS) {
        kvf_error("invalid streams %u (1..%d, or 0 for the default)", p->streams,
                  KVF_MAX_STREAMS);
        return KVF_ERR_INVALID_PARAM;
    }
    if (p->busy_poll_us > KVF_BUSY_POLL_MAX_US) {
        kvf_error("invalid busy_poll_us %u (0..%d)", p->busy_poll_us, KVF_BUSY_POLL_MAX_US);
        return KVF_ERR_INVALID_PARAM;
    }
    return kvf__registration_check(p);
}

/* The registry hands a struct of its own, initialised: never refused. */
static void stats_cb(void *arg, kvf_engine_stats_t *stats_p)
{
    (void)kvf_engine_stats((kvf_engine_t *)arg, stats_p);
}

static kvf_status_t start_bootstrap(kvf_engine_t *eng)
{
    char host[128];
    int port;

    if (kvf__split_addr(eng->bootstrap_addr, host, sizeof(host), &port) != KVF_OK) {
        kvf_error("invalid bootstrap address '%s' (expected host:port)",
                  eng->bootstrap_addr);
        return KVF_ERR_INVALID_PARAM;
    }
    /* The engine's own token (its parameter, or the environment): the
     * registry asks it of every registration. */
    kvf_status_t st = kvf__bootstrap_create_auth(host, port,
                                                 eng->has_token ? eng->token : NULL,
                                                 eng->auth_open, &eng->bootstrap);
    if (st != KVF_OK)
        return st;
    kvf__bootstrap_set_stats_cb(eng->bootstrap, stats_cb, eng);
    if (port == 0) {
        char buf[160];
        snprintf(buf, sizeof(buf), "%s:%d", host, kvf_bootstrap_port(eng->bootstrap));
        free(eng->bootstrap_addr);
        eng->bootstrap_addr = strdup(buf);
        if (eng->bootstrap_addr == NULL)
            return KVF_ERR_NO_MEMORY;
    }
    kvf_info("bootstrap registry in-process at %s", eng->bootstrap_addr);
    return KVF_OK;
}

static void *progress_main(void *arg);
static void *lane_main(void *arg);

/* What create made and destroy unmakes last: descriptors, strings, locks. */
static void engine_free(kvf_engine_t *eng)
{
    kvf__metrics_stop_unlocked(eng);
    kvf__trace_close_unlocked(eng);
    for (int i = 0; i < KVF_MAX_MOVERS; i++)
        if (eng->movers[i] != NULL)
            eng->movers[i]->ops->destroy(eng->movers[i]);   /* after the peers' endpoints */
    if (eng->copier != NULL) {
        eng->copier_ops->drain(eng->copier);
        kvf__bounce_free_all_unlocked(eng);
        eng->copier_ops->destroy(eng->copier);
    }
    int fds[] = {eng->epfd, eng->listenfd, eng->reserve_fd};
    for (size_t i = 0; i < sizeof(fds) / sizeof(fds[0]); i++)
        if (fds[i] >= 0)
            close(fds[i]);
    for (unsigned k = 1; k < KVF_MAX_STREAMS; k++)
        if (eng->lanes[k].epfd >= 0)
            close(eng->lanes[k].epfd);
    kvf__layout_free(&eng->layout);
    free(eng->reg_bases);
    free(eng->reg_lens);
    free(eng->reg_kinds);
    kvf_transport_faults_free(eng->faults);
    free(eng->tomb_ring);
    free(eng->retired_ring);
    free(eng->register_error);
    OPENSSL_cleanse(eng->token, sizeof(eng->token));
    free(eng->host);
    free(eng->transport);
    free(eng->bootstrap_addr);
    kvf__sync_destroy(&eng->sync);
    pthread_cond_destroy(&eng->resolver_cond);
    pthread_cond_destroy(&eng->reads_cond);
    pthread_cond_destroy(&eng->final_cond);
    pthread_mutex_destroy(&eng->ids_lock);
    EVP_CIPHER_CTX_free(eng->inst_cipher);
    pthread_mutex_destroy(&eng->inst_lock);
    kvf__remote_seen_free_unlocked(eng);
    pthread_mutex_destroy(&eng->remote_lock);
    free(eng);
}

/* What peers report upward (peer.h): room.c takes their room messages,
 * failures and readiness; acks.c what a dead peer still owed. */
static const kvf_peer_events_t peer_events = {
    .room_msg   = kvf__room_on_msg,
    .failed     = kvf__rooms_peer_failed,
    .ready      = kvf__rooms_peer_ready,
    .needed     = kvf__rooms_wait_on,
    .dead       = kvf__acks_peer_lost,
    .rx_dropped = kvf__room_rx_drop,
};

/* The fields that hold no resource: defaults, "-1" fds, event tags, locks
 * and maps, so that engine_free can unwind from any later step. */
static void engine_init(kvf_engine_t *eng, const kvf_engine_params_t *full)
{
    eng->params = *full;
    if (eng->params.handshake_timeout_ms == 0)
        eng->params.handshake_timeout_ms = KVF_HANDSHAKE_TIMEOUT_MS;
    eng->epfd = eng->listenfd = eng->reserve_fd = eng->trace_fd = -1;
    if (eng->params.streams == 0)
        eng->params.streams = kvf__streams_default();
    eng->nlanes = eng->params.streams;
    for (unsigned k = 0; k < KVF_MAX_STREAMS; k++)
        eng->lanes[k] = (kvf_lane_t){.eng = eng, .index = k, .epfd = -1,
                                     .ev_wake = KVF_EV_WAKE};
    eng->ev_listener = KVF_EV_LISTENER;
    eng->ev_wake = KVF_EV_WAKE;
    eng->ev_copier = KVF_EV_COPIER;
    eng->peer_events = &peer_events;
    eng->room_ops = full->role == KVF_ROLE_PREFILL ? &kvf_sender_room_ops
                                                   : &kvf_receiver_room_ops;
    assert(eng->room_ops->side == full->role && kvf__room_ops_missing(eng->room_ops) == NULL);
    for (int i = 0; i < KVF_MAX_MOVERS; i++)
        eng->mover_ev[i] = (kvf_mover_ev_t){KVF_EV_MOVER, i};
    kvf__sync_init(&eng->sync);
    pthread_cond_init(&eng->resolver_cond, NULL);
    pthread_cond_init(&eng->reads_cond, NULL);
    pthread_cond_init(&eng->final_cond, NULL);
    eng->reads_done_tail = &eng->reads_done;
    pthread_mutex_init(&eng->ids_lock, NULL);
    pthread_mutex_init(&eng->inst_lock, NULL);
    pthread_mutex_init(&eng->remote_lock, NULL);
    kvf_map_init(&eng->rooms_by_id);
    kvf_map_init(&eng->stash);
    kvf_map_init(&eng->tombs);
    kvf_map_init(&eng->retired);
}

/* The engine's own copies of the caller's strings, the rings, the fault
 * spec and the instance id: nothing the caller passed is kept by pointer. */
static kvf_status_t engine_own_params(kvf_engine_t *eng, const kvf_engine_params_t *params)
{
    char err[512];
    kvf_status_t st = KVF_ERR_NO_MEMORY;

    eng->tomb_ring = calloc(KVF_TOMBS, sizeof(*eng->tomb_ring));
    eng->retired_ring = calloc(KVF_RETIRED, sizeof(uint64_t));
    eng->host = strdup(params->host);
    eng->transport = strdup(params->transport ? params->transport : "auto");
    if (params->bootstrap_addr)
        eng->bootstrap_addr = strdup(params->bootstrap_addr);
    if (!eng->host || !eng->transport || !eng->tomb_ring || !eng->retired_ring ||
        (params->bootstrap_addr && !eng->bootstrap_addr))
        return st;
    eng->params.host = eng->host;
    eng->params.transport = eng->transport;
    eng->params.faults = NULL;
    kvf__registration_setup_unlocked(eng);
    if (params->faults != NULL) {
        st = kvf_transport_faults_parse(params->faults, &eng->faults, err, sizeof(err));
        if (st != KVF_OK) {
            kvf_error("invalid fault spec '%s': %s", params->faults, err);
            return st;
        }
        kvf_warn("fault injection active: %s", params->faults);
    }
    if (getrandom(&eng->instance_id, sizeof(eng->instance_id), 0) !=
        sizeof(eng->instance_id))
        eng->instance_id = kvf_now_ns() ^ ((uint64_t)getpid() << 32);
    kvf__room_instances_setup(eng);
    return KVF_OK;
}

/* The control listener, then what depends on the address it bound: the
 * token and protected mode, the trace file and the metrics endpoint. */
static kvf_status_t engine_listen(kvf_engine_t *eng, const kvf_engine_params_t *params)
{
    kvf_status_t st = kvf_control_listen(eng->host, params->port, &eng->listenfd, &eng->port);
    if (st != KVF_OK)
        return st;
    snprintf(eng->addr, sizeof(eng->addr), "%s:%d", eng->host, eng->port);
    kvf__failure_set_unlocked(&eng->app_abort, eng, KVF_ERR_ABORTED,
                              "aborted by the application on %s",
                              kvf__engine_rank_name_unlocked(eng, (char[96]){0}, 96));
    /* The token, and protected mode, from the address actually bound. */
    struct sockaddr_storage bound;
    socklen_t blen = sizeof(bound);
    if (getsockname(eng->listenfd, (struct sockaddr *)&bound, &blen) != 0) {
        kvf_error("getsockname: %m");
        return KVF_ERR_IO;
    }
    st = kvf__auth_setup_unlocked(eng, params->auth_token, params->api_key,
                         (struct sockaddr *)&bound);
    eng->params.auth_token = NULL;     /* the caller's strings: never kept */
    eng->params.api_key = NULL;
    if (st != KVF_OK)
        return st;
    /* After the token: the metrics endpoint binds by the same rule. */
    if ((st = kvf__trace_open_unlocked(eng)) != KVF_OK || (st = kvf__metrics_start_unlocked(eng)) != KVF_OK)
        return st;
    return KVF_OK;
}

/* Every lane's epoll set and wake-up eventfd; lane 0's also watches the
 * listener.  Before any thread starts, so a failure leaves nothing running. */
static kvf_status_t engine_open_lanes(kvf_engine_t *eng)
{
    int *wakefd = eng->sync.wakefd;
    eng->epfd = epoll_create1(EPOLL_CLOEXEC);
    wakefd[0] = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (eng->epfd < 0 || wakefd[0] < 0) {
        kvf_error("epoll/eventfd: %m");
        return KVF_ERR_IO;
    }
    struct epoll_event ev = {.events = EPOLLIN, .data.ptr = &eng->ev_listener};
    struct epoll_event wev = {.events = EPOLLIN, .data.ptr = &eng->ev_wake};
    if (epoll_ctl(eng->epfd, EPOLL_CTL_ADD, eng->listenfd, &ev) != 0 ||
        epoll_ctl(eng->epfd, EPOLL_CTL_ADD, wakefd[0], &wev) != 0) {
        kvf_error("epoll_ctl: %m");
        return KVF_ERR_IO;
    }
    eng->lanes[0].epfd = eng->epfd;
    kvf__listener_init_unlocked(eng);
    for (unsigned k = 1; k < eng->nlanes; k++) {
        kvf_lane_t *ln = &eng->lanes[k];
        ln->epfd = epoll_create1(EPOLL_CLOEXEC);
        wakefd[k] = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
        struct epoll_event lev = {.events = EPOLLIN, .data.ptr = &ln->ev_wake};
        if (ln->epfd < 0 || wakefd[k] < 0 ||
            epoll_ctl(ln->epfd, EPOLL_CTL_ADD, wakefd[k], &lev) != 0) {
            kvf_error("epoll/eventfd for lane %u: %m", k);
            return KVF_ERR_IO;
        }
    }
    return KVF_OK;
}

/* Lanes from k on will not run: their epoll sets and eventfds go now. */
static void close_lanes_from(kvf_engine_t *eng, unsigned k)
{
    for (; k < KVF_MAX_STREAMS; k++) {
        if (eng->lanes[k].epfd >= 0)
            close(eng->lanes[k].epfd);
        if (eng->sync.wakefd[k] >= 0)
            close(eng->sync.wakefd[k]);
        eng->lanes[k].epfd = eng->sync.wakefd[k] = -1;
    }
}

/* Stop and join the lanes k >= 1 that started (create failed after them). */
static void stop_lanes(kvf_engine_t *eng)
{
    kvf__lock(eng);
    eng->stopping = 1;
    kvf__unlock(eng);
    for (unsigned k = 1; k < KVF_MAX_STREAMS; k++)
        if (eng->lanes[k].started) {
            kvf__lane_wake(eng, k);
            pthread_join(eng->lanes[k].thread, NULL);
            eng->lanes[k].started = 0;
        }
}

/*
 * The lanes k >= 1 first, then the resolver and lane 0's progress thread:
 * the last step, since a lane that cannot start only lowers the stream
 * count, and that count must be settled before lane 0 runs (it offers
 * peers that many streams, and hands stream k to lane k).  A failure
 * after some lanes started stops and joins them before it returns.
 */
static kvf_status_t engine_start_threads(kvf_engine_t *eng)
{
    for (unsigned k = 1; k < eng->nlanes; k++) {
        if (pthread_create(&eng->lanes[k].thread, NULL, lane_main, &eng->lanes[k]) != 0) {
            kvf_error("cannot start progress thread %u; this engine uses %u streams", k, k);
            close_lanes_from(eng, k);
            eng->nlanes = k;
            break;
        }
        eng->lanes[k].started = 1;
    }
    kvf_status_t st = kvf__resolver_start_unlocked(eng);
    if (st == KVF_OK && pthread_create(&eng->progress_thread, NULL, progress_main, eng) != 0) {
        kvf_error("cannot start the progress thread");
        kvf__resolver_stop(eng);
        st = KVF_ERR_NO_MEMORY;
    }
    if (st != KVF_OK)
        stop_lanes(eng);
    return st;
}

kvf_status_t kvf_engine_create(const kvf_engine_params_t *caller_params,
                               kvf_engine_t **engine_p)
{
    kvf_engine_params_t full;
    char err[512];

    if (caller_params == NULL) {
        kvf_error("kvf_engine_create: params is NULL");
        return KVF_ERR_INVALID_PARAM;
    }
    /* From here on only the full-size copy is read: the caller's struct
     * may be shorter than this library's. */
    kvf_status_t st = kvf__engine_params_import(&full, caller_params,
                                                "kvf_engine_create", err, sizeof(err));
    if (st != KVF_OK) {
        kvf_error("%s", err);
        return st;
    }
    const kvf_engine_params_t *params = &full;
    if ((st = check_params(params)) != KVF_OK)
        return st;

    kvf_engine_t *eng = calloc(1, sizeof(*eng));
    if (eng == NULL)
        return KVF_ERR_NO_MEMORY;
    engine_init(eng, params);
    if ((st = engine_own_params(eng, params)) != KVF_OK ||
        (st = engine_listen(eng, params)) != KVF_OK ||
        (st = engine_open_lanes(eng)) != KVF_OK)
        goto err;
    if (params->host_bootstrap && (st = start_bootstrap(eng)) != KVF_OK)
        goto err;
    eng->params.bootstrap_addr = eng->bootstrap_addr;
    if ((st = engine_start_threads(eng)) != KVF_OK)
        goto err;
    kvf_info("%s engine tp %d/%d at %s (instance %016llx, %u stream%s per peer)",
             kvf_role_name(params->role), params->tp_rank, params->tp_size,
             eng->addr, (unsigned long long)eng->instance_id, eng->nlanes,
             eng->nlanes > 1 ? "s" : "");
    *engine_p = eng;
    return KVF_OK;

err:
    if (eng->bootstrap)
        kvf_bootstrap_destroy(eng->bootstrap);
    engine_free(eng);
    return st;
}

void kvf_engine_destroy(kvf_engine_t *eng)
{
    if (eng == NULL)
        return;
    /* First: a scrape walks the rooms and peers the teardown frees. */
    kvf__metrics_stop_unlocked(eng);
    kvf__lock(eng);
    eng->stopping = 1;
    pthread_cond_broadcast(&eng->resolver_cond);
    kvf__unlock(eng);
    for (unsigned k = 0; k < KVF_MAX_STREAMS; k++)
        if (k == 0 || eng->lanes[k].started)
            kvf__lane_wake(eng, k);
    pthread_join(eng->progress_thread, NULL);
    for (unsigned k = 1; k < KVF_MAX_STREAMS; k++)
        if (eng->lanes[k].started)
            pthread_join(eng->lanes[k].thread, NULL);
    kvf__io_owner = eng;   /* the connections are this thread's now */
    kvf__io_lane = KVF_LANE_ALL;
    kvf__resolver_stop(eng);
    /* The registry's thread reads engine stats: stop it before anything
     * it could read is freed. */
    if (eng->bootstrap)
        kvf_bootstrap_destroy(eng->bootstrap);
    eng->bootstrap = NULL;

    /* Threads are gone; the lock is taken all the same, since the teardown
     * goes through the functions that expect it. */
    kvf__lock(eng);
    /* Rooms destroyed since the last pass leave; created ones are listed. */
    kvf__rooms_take_submitted(eng);
    if (eng->rooms != NULL)
        kvf_warn("engine destroyed with rooms still attached; destroy them first");
    while (eng->peers != NULL) {
        kvf_peer_t *p = eng->peers;
        kvf__peer_fail(p, KVF_ERR_CONN_RESET, "engine destroyed");
        kvf__peer_close_pending(p);
        kvf__streams_release(p);
        eng->peers = p->next;
        p->next = NULL;
        kvf__peer_put(p);
    }
    /* The movers go before the rest: each hands back the reads it still
     * had (failed), which release their rooms and peers. */
    for (int i = 0; i < KVF_MAX_MOVERS; i++)
        if (eng->movers[i] != NULL) {
            eng->movers[i]->ops->destroy(eng->movers[i]);
            eng->movers[i] = NULL;
        }
    /* Then the copier: the staged copies still in flight end and are
     * handed back (their puts complete, their reads are taken in). */
    if (eng->copier != NULL)
        eng->copier_ops->drain(eng->copier);
    kvf__peers_reads_done(eng);
    kvf__peers_free(eng);
    kvf__acks_free(eng);
    for (size_t i = 0; i < eng->stash.cap; i++)
        kvf__stash_free(eng->stash.slots[i].val);
    kvf__unlock(eng);
    kvf__io_owner = NULL;
    kvf__io_lane = 0;
    kvf_map_free(&eng->stash);
    for (size_t i = 0; i < eng->tombs.cap; i++)
        free(eng->tombs.slots[i].val);
    kvf_map_free(&eng->tombs);
    kvf_map_free(&eng->retired);
    kvf_map_free(&eng->rooms_by_id);
    engine_free(eng);
}

kvf_status_t kvf_engine_address(const kvf_engine_t *eng, char *buf, size_t len)
{
    if (eng == NULL || buf == NULL || len <= strlen(eng->addr))
        return KVF_ERR_INVALID_PARAM;
    strcpy(buf, eng->addr);
    return KVF_OK;
}

kvf_status_t kvf_engine_bootstrap_addr(const kvf_engine_t *eng, char *buf, size_t len)
{
    if (eng == NULL || buf == NULL)
        return KVF_ERR_INVALID_PARAM;
    if (eng->bootstrap == NULL)
        return KVF_ERR_STATE;
    if (len <= strlen(eng->bootstrap_addr))
        return KVF_ERR_INVALID_PARAM;
    strcpy(buf, eng->bootstrap_addr);
    return KVF_OK;
}

const char *kvf_engine_transport(const kvf_engine_t *eng)
{
    /* Relaxed: a bit mask only ever set, read for display. */
    unsigned used = __atomic_load_n(&eng->used_paths, __ATOMIC_RELAXED);
    if (used == 0 && strcmp(eng->transport, "auto") != 0)
        return eng->transport;      /* no peer yet: the preference */
    return kvf_movers_mask_name(used);
}

uint64_t kvf_engine_instance_id(const kvf_engine_t *eng)
{
    return eng->instance_id;
}

/*
 * Device memory moves over tcp through the copier (stage.h), which starts
 * with the layout like the movers.  @return KVF_OK, or why not in err.
 */
static kvf_status_t start_copier(kvf_engine_t *eng, char *err, size_t errlen)
{
    if (kvf_copier_ops == NULL) {
        snprintf(err, errlen, "this kvferry was built without CUDA (configure with the "
                 "CUDA toolkit installed, or -DKVF_CUDA=ON)");
        return KVF_ERR_UNSUPPORTED;
    }
    kvf_status_t st = kvf_copier_ops->create(eng->layout.cuda_device, &eng->copier, err,
                                             errlen);
    if (st != KVF_OK)
        return st;
    eng->copier_ops = kvf_copier_ops;
    int fd = kvf_copier_ops->fd(eng->copier);
    struct epoll_event ev = {.events = EPOLLIN, .data.ptr = &eng->ev_copier};
    if (fd >= 0 && epoll_ctl(eng->epfd, EPOLL_CTL_ADD, fd, &ev) != 0) {
        snprintf(err, errlen, "epoll_ctl: %s", strerror(errno));
        kvf_copier_ops->destroy(eng->copier);
        eng->copier = NULL;
        return KVF_ERR_IO;
    }
    return KVF_OK;
}

/*
 * Movers need the registered buffers (to register them with the backend,
 * or to name them in offers), so they start with the layout.  One that
 * cannot start leaves its peers to the others: say why once.
 */
static void start_movers(kvf_engine_t *eng)
{
    kvf_mover_params_t mp = {
        .role = eng->params.role,
        .instance_id = eng->instance_id,
        .bases = eng->reg_bases,
        .lens = eng->reg_lens,
        .n = eng->nregs,
        .mem_kind = kvf__layout_on_device(&eng->layout) ? KVF_MEM_CUDA : KVF_MEM_HOST,
        .kinds = eng->reg_kinds,
        .cuda_device = eng->layout.cuda_device,
        .by_name = strcmp(eng->transport, "auto") != 0,
    };
    kvf_movers_check();
    for (int i = 0; kvf_movers[i] != NULL; i++) {
        const kvf_mover_ops_t *ops = kvf_movers[i];
        char err[512] = "";
        if (!kvf_mover_allowed(eng->transport, ops))
            continue;
        if (ops->create(&mp, &eng->movers[i], err, sizeof(err)) != KVF_OK) {
            eng->movers[i] = NULL;
            if (mp.by_name)
                kvf_warn("%s transport unavailable (%s): peers use %s", ops->name, err,
                         kvf_stream_name());
            else
                kvf_info("%s transport unavailable (%s)", ops->name, err);
            continue;
        }
        int fd = ops->fd(eng->movers[i]);
        struct epoll_event ev = {.events = EPOLLIN, .data.ptr = &eng->mover_ev[i]};
        if (fd >= 0 && epoll_ctl(eng->epfd, EPOLL_CTL_ADD, fd, &ev) != 0) {
            kvf_warn("%s transport unavailable (epoll_ctl: %m)", ops->name);
            ops->destroy(eng->movers[i]);
            eng->movers[i] = NULL;
        }
    }
}

/* Serve what a mover has pending, a bounded number of rounds, and take in
 * the reads it handed back. */
static void progress_mover(kvf_engine_t *eng, int i)
{
    kvf_mover_t *m = eng->movers[i];
    for (int k = 0; m != NULL && k < 64 && m->ops->progress(m); k++)
        ;
    kvf__peers_reads_done(eng);
}

void kvf__engine_progress_movers(kvf_engine_t *eng)
{
    KVF_ASSERT_LOCKED(eng);
    for (int i = 0; i < KVF_MAX_MOVERS; i++)
        progress_mover(eng, i);
}

static int have_device_mover(const kvf_engine_t *eng)
{
    for (int i = 0; i < KVF_MAX_MOVERS; i++)
        if (eng->movers[i] != NULL && (eng->movers[i]->ops->caps & KVF_MOVER_CAP_MEM_DEVICE))
            return 1;
    return 0;
}

static void regions_free(void **bases, size_t *lens, kvf_mem_kind_t *kinds)
{
    free(bases);
    free(lens);
    free(kinds);
}

/* Undo a registration that cannot stand (under the lock). */
static void unregister(kvf_engine_t *eng)
{
    eng->registered = 0;
    kvf__layout_free(&eng->layout);
    memset(&eng->layout, 0, sizeof(eng->layout));
    eng->kv_item_bytes_sum = eng->aux_item_bytes_sum = 0;
    regions_free(eng->reg_bases, eng->reg_lens, eng->reg_kinds);
    eng->reg_bases = NULL;
    eng->reg_lens = NULL;
    eng->reg_kinds = NULL;
    eng->nregs = 0;
}

/* The `n` registered regions of layout `l`, every buffer in family order
 * (kv, aux, state): its base, length and memory kind.  @return
 * KVF_ERR_NO_MEMORY, or KVF_OK and the three arrays (regions_free). */
static kvf_status_t regions_of(const kvf_layout_int_t *l, size_t n, void ***bases_p,
                               size_t **lens_p, kvf_mem_kind_t **kinds_p)
{
    void **bases = malloc(n * sizeof(void *));
    size_t *lens = malloc(n * sizeof(size_t));
    kvf_mem_kind_t *kinds = malloc(n * sizeof(kvf_mem_kind_t));
    if (bases == NULL || lens == NULL || kinds == NULL) {
        regions_free(bases, lens, kinds);
        return KVF_ERR_NO_MEMORY;
    }
    const kvf_buffer_t *all[3] = {l->kv, l->aux, l->state};
    uint32_t cnt[3] = {l->num_kv, l->num_aux, l->num_state};
    size_t k = 0;
    for (int f = 0; f < 3; f++)
        for (uint32_t i = 0; i < cnt[f]; i++, k++) {
            bases[k] = all[f][i].base;
            lens[k] = all[f][i].length;
            kinds[k] = kvf__family_mem(l, f);
        }
    *bases_p = bases;
    *lens_p = lens;
    *kinds_p = kinds;
    return KVF_OK;
}

kvf_status_t kvf_engine_register_layout(kvf_engine_t *eng, const kvf_layout_t *layout)
{
    char err[448];     /* "layout rejected: " + err fits kvf_last_error() */
    kvf_layout_int_t l;

    if (eng == NULL || layout == NULL)
        return KVF_ERR_INVALID_PARAM;
    kvf_status_t st = kvf__layout_copy(&l, layout, eng->params.role == KVF_ROLE_DECODE, err,
                                       sizeof(err));
    if (st == KVF_OK && (st = kvf__layout_check_memory(&l, err, sizeof(err))) != KVF_OK)
        kvf__layout_free(&l);
    if (st != KVF_OK) {
        kvf_error("layout rejected: %s", err);
        return st;
    }
    size_t nregs = (size_t)l.num_kv + l.num_aux + l.num_state;
    void **bases;
    size_t *lens;
    kvf_mem_kind_t *kinds;
    if (regions_of(&l, nregs, &bases, &lens, &kinds) != KVF_OK) {
        kvf__layout_free(&l);
        return KVF_ERR_NO_MEMORY;
    }
    kvf__lock(eng);
    if (eng->registered) {
        kvf__unlock(eng);
        kvf__layout_free(&l);
        regions_free(bases, lens, kinds);
        kvf_error("layout already registered on this engine");
        return KVF_ERR_STATE;
    }
    eng->layout = l;
    eng->reg_bases = bases;
    eng->reg_lens = lens;
    eng->reg_kinds = kinds;
    eng->nregs = nregs;
    for (uint32_t i = 0; i < l.num_kv; i++)
        eng->kv_item_bytes_sum += l.kv[i].item_bytes;
    for (uint32_t i = 0; i < l.num_aux; i++)
        eng->aux_item_bytes_sum += l.aux[i].item_bytes;
    if (kvf__layout_on_device(&l) && start_copier(eng, err, sizeof(err)) != KVF_OK) {
        /* Without staging, device memory still moves over a mover that
         * carries it (ucx with CUDA). */
        kvf_info("no staging of device memory over tcp: %s", err);
    }
    start_movers(eng);
    if (kvf__layout_on_device(&l) && eng->copier == NULL && !have_device_mover(eng)) {
        /* Device memory has no other way to move: refuse now, not per room. */
        for (int i = 0; i < KVF_MAX_MOVERS; i++)
            if (eng->movers[i] != NULL) {
                eng->movers[i]->ops->destroy(eng->movers[i]);
                eng->movers[i] = NULL;
            }
        unregister(eng);
        kvf__unlock(eng);
        kvf_error("device memory cannot move here: %s; %s", err, kvf_movers_device_hint());
        return KVF_ERR_UNSUPPORTED;
    }
    /* Last: a create reads it without the lock. */
    atomic_store(&eng->registered, 1);
    if (eng->params.role == KVF_ROLE_PREFILL && eng->bootstrap_addr != NULL) {
        /* (Without a registry, decode engines reach it by its descriptor.) */
        eng->want_register = 1;
        pthread_cond_broadcast(&eng->resolver_cond);
    }
    kvf__unlock(eng);
    return KVF_OK;
}

kvf_status_t kvf_engine_stats(kvf_engine_t *eng, kvf_engine_stats_t *stats_p)
{
    kvf_engine_stats_t st;
    char err[256];

    if (eng == NULL || stats_p == NULL)
        return KVF_ERR_INVALID_PARAM;
    kvf__lock(eng);
    st = eng->stats;
    memset(st.rooms_by_state, 0, sizeof(st.rooms_by_state));
    kvf__rooms_take_submitted(eng);       /* the rooms as the application has them */
    for (kvf_room_t *r = eng->rooms; r != NULL; r = r->next)
        st.rooms_by_state[atomic_load_explicit(&r->state, memory_order_relaxed)]++;
    st.peers_connected = 0;
    memset(st.peers_by_path, 0, sizeof(st.peers_by_path));
    for (kvf_peer_t *p = eng->peers; p != NULL; p = p->next) {
        if (p->state != KVF_PEER_READY)
            continue;
        st.peers_connected++;
        if (!p->watch_only)              /* a sibling link carries no payload */
            st.peers_by_path[kvf_mover_path(p->mover)]++;
    }
    st.auth_refused = eng->auth_refused;
    st.room_msgs_dropped = eng->room_msgs_dropped;
    st.stash_dropped = eng->stash_dropped;
    kvf__unlock(eng);
    if (kvf__engine_stats_export(stats_p, &st, "kvf_engine_stats", err, sizeof(err)) !=
        KVF_OK) {
        kvf_error("%s", err);
        return KVF_ERR_INVALID_PARAM;
    }
    return KVF_OK;
}

/* Uncontended unless several threads measure at once, as a private lock of
 * a call that never waits for an engine would be. */
static pthread_mutex_t null_lock = PTHREAD_MUTEX_INITIALIZER;

void kvf_null_call(void)
{
    pthread_mutex_lock(&null_lock);
    pthread_mutex_unlock(&null_lock);
}

uint64_t kvf_engine_stream_bytes(kvf_engine_t *eng, unsigned stream)
{
    if (eng == NULL || stream >= KVF_MAX_STREAMS)
        return 0;
    kvf__lock(eng);
    uint64_t n = eng->stream_bytes[stream];
    kvf__unlock(eng);
    return n;
}

unsigned kvf_engine_streams(const kvf_engine_t *eng)
{
    return eng->nlanes;
}

/* Let connections that stopped with messages left go on.  @return 1 if
 * some still have more. */
static int drain_peers(kvf_engine_t *eng)
{
    int more = 0;
    for (kvf_peer_t *p = eng->peers; p != NULL; p = p->next) {
        /* A peer over its read window waits for its reads (progress). */
        if (p->conn == NULL || p->state == KVF_PEER_DEAD || !kvf__peer_rx_ready(p) ||
            !p->conn->ops->pending(p->conn))
            continue;
        p->conn->ops->handle(p->conn, EPOLLIN);
        more |= p->state != KVF_PEER_DEAD && kvf__peer_rx_ready(p) &&
                p->conn->ops->pending(p->conn);
    }
    return more;
}

/* 1 when a connection that may go on has messages left. */
static int peers_pending(const kvf_engine_t *eng)
{
    for (const kvf_peer_t *p = eng->peers; p != NULL; p = p->next)
        if (p->conn != NULL && p->state != KVF_PEER_DEAD && kvf__peer_rx_ready(p) &&
            p->conn->ops->pending(p->conn))
            return 1;
    return 0;
}

/* Hand the connections what other threads queued, and send. */
static void flush_peers(kvf_engine_t *eng)
{
    kvf__streams_move(eng);
    for (kvf_peer_t *p = eng->peers; p != NULL; p = p->next) {
        kvf__peer_close_pending(p);
        kvf__peer_outbox_drain(p);
        if (p->conn != NULL && p->state != KVF_PEER_DEAD)
            p->conn->ops->flush(p->conn);
    }
    kvf__peers_free(eng);
}

/*
 * This process did not run for `gap` ms (SIGSTOP, a debugger, a starved
 * machine): the silence we would now see from every peer, and the lack of
 * progress of every room, is ours, not theirs.  Give peers a fresh
 * heartbeat window and rooms their time back; if a peer gave up on us
 * meanwhile, its FAILs or its closed connection tell us so.
 */
static void own_stall(kvf_engine_t *eng, uint64_t gap)
{
    kvf_warn("this %s engine (rank %d) did not run for %.1f s (stopped or starved): not "
             "blaming its peers or rooms for that time", kvf_role_name(eng->params.role),
             eng->params.tp_rank, (double)gap / 1000.0);
    for (kvf_peer_t *p = eng->peers; p != NULL; p = p->next)
        p->grace_until_ms = eng->now_ms + eng->params.heartbeat_timeout_ms;
    for (kvf_room_t *r = eng->rooms; r != NULL; r = r->next)
        r->t_state_ms += gap;
}

/* Heartbeats and deadlines, once per TICK_MS. */
static void tick_if_due(kvf_engine_t *eng, uint64_t *next_tick)
{
    uint64_t now = kvf_now_ms();
    if (now < *next_tick)
        return;
    /* A tick this late: the loop itself did not run, wherever it was
     * stopped (in epoll_wait, waiting for the lock, or in a pass). */
    if (now - *next_tick > STALL_MS) {
        eng->now_ms = now;
        own_stall(eng, now - *next_tick);
    }
    kvf__peers_tick(eng, now);
    kvf__acks_tick(eng, now);
    kvf__rooms_tick(eng, now);
    /* Destinations whose sender never came (stash.c). */
    kvf__stash_expire(eng, now);
    kvf__listener_tick(eng, now);
    /* Movers' own deadlines (the shm handout's slot for a connection that
     * sends nothing) pass without an event to say so. */
    kvf__engine_progress_movers(eng);
    flush_peers(eng);
    *next_tick = now + TICK_MS;
}

/*
 * A lane is about to wait up to `timeout` ms with the lock released: it
 * counts itself out of the awake lanes, then looks for work published
 * before it did (the other half of kvf__engine_wake_idle); lane_woke()
 * counts it back in.  Busy polling (params.busy_poll_us): within its
 * window the lane does not wait but yields its CPU and polls again,
 * still counted awake, so that a call that publishes work makes no
 * system call.  @return the wait to make.
 */
static int lane_sleep(kvf_engine_t *eng, kvf_lane_t *ln, int timeout)
{
    if (timeout == 0)
        return 0;
    if (ln->busy_until_ns != 0 && kvf_now_ns() < ln->busy_until_ns) {
        sched_yield();
        return 0;
    }
    atomic_fetch_sub(&eng->sync.awake, 1);
    if (atomic_load(&eng->submitted) != NULL) {
        atomic_fetch_add(&eng->sync.awake, 1);
        return 0;
    }
    return timeout;
}

/* After the wait: counted back in.  @return 1 if there is work: events,
 * or work published (for lane_poll_on). */
static int lane_woke(kvf_engine_t *eng, int slept, int events)
{
    if (slept != 0)
        atomic_fetch_add(&eng->sync.awake, 1);
    return events > 0 || atomic_load(&eng->submitted) != NULL;
}

/*
 * After a pass that had work, while the engine has rooms: the lane's
 * busy-polling window opens anew (params.busy_poll_us, lane_sleep).  A
 * tick's timeout is no work, and an engine without rooms lets its window
 * pass, so neither ticks nor a peer's heartbeats keep an idle engine
 * spinning.
 */
static void lane_poll_on(kvf_engine_t *eng, kvf_lane_t *ln, int had_work)
{
    KVF_ASSERT_LOCKED(eng);
    if (eng->params.busy_poll_us != 0 && had_work && eng->rooms != NULL)
        ln->busy_until_ns = kvf_now_ns() + (uint64_t)eng->params.busy_poll_us * 1000u;
}

/*
 * Lane k >= 1: epoll over its eventfd and stream k of every peer.  Its
 * timeout is the tick's, for a stream that lane 0 closed while this one
 * slept; the deadlines are lane 0's.
 */
static void *lane_main(void *arg)
{
    kvf_lane_t *ln = arg;
    kvf_engine_t *eng = ln->eng;
    struct epoll_event evs[64];
    int more = 0;

    kvf__io_owner = eng;
    kvf__io_lane = ln->index;
    atomic_fetch_add(&eng->sync.awake, 1);
    kvf__lock_lane(eng);
    while (!eng->stopping) {
        kvf__unlock(eng);
        /* Between passes: callers waiting for the lock have it first. */
        kvf__lock_yield(eng);
        int timeout = lane_sleep(eng, ln, more ? 0 : TICK_MS);
        int n = epoll_wait(ln->epfd, evs, 64, timeout);
        int work = lane_woke(eng, timeout, n);
        kvf__lock_lane(eng);
        if (n < 0 && errno != EINTR) {
            kvf_error("epoll_wait (lane %u): %m", ln->index);
            break;
        }
        for (int i = 0; i < n; i++) {
            if (evs[i].data.ptr == &ln->ev_wake) {
                uint64_t v;
                if (read(eng->sync.wakefd[ln->index], &v, sizeof(v)) < 0 && errno != EAGAIN)
                    kvf_warn("eventfd read: %m");
            } else {
                kvf__lane_event(ln, evs[i].data.ptr, evs[i].events);
            }
        }
        more = kvf__lane_pass(ln);
        /* Chunks the application published: whichever lane is awake. */
        kvf__rooms_take_submitted(eng);
        lane_poll_on(eng, ln, work);
    }
    kvf__unlock(eng);
    atomic_fetch_sub(&eng->sync.awake, 1);
    return NULL;
}

static void *progress_main(void *arg)
{
    kvf_engine_t *eng = arg;
    struct epoll_event evs[64];
    uint64_t next_tick = kvf_now_ms() + TICK_MS;
    int more = 0;      /* connections have buffered messages left */

    kvf__io_owner = eng;
    kvf__io_lane = 0;
    atomic_fetch_add(&eng->sync.awake, 1);
    kvf__lock_lane(eng);
    while (!eng->stopping) {
        uint64_t now = kvf_now_ms();
        int timeout = more || next_tick <= now ? 0 : (int)(next_tick - now);
        kvf__unlock(eng);
        /* Between passes: callers waiting for the lock have it first. */
        kvf__lock_yield(eng);
        timeout = lane_sleep(eng, &eng->lanes[0], timeout);
        int n = epoll_wait(eng->epfd, evs, 64, timeout);
        int work = lane_woke(eng, timeout, n);
        kvf__lock_lane(eng);
        eng->now_ms = kvf_now_ms();
        if (n < 0 && errno != EINTR) {
            kvf_error("epoll_wait: %m");
            break;
        }
        for (int i = 0; i < n; i++) {
            kvf_ev_kind_t *kind = evs[i].data.ptr;
            if (*kind == KVF_EV_LISTENER) {
                kvf__listener_accept(eng);
            } else if (*kind == KVF_EV_MOVER) {
                progress_mover(eng, ((kvf_mover_ev_t *)kind)->index);
            } else if (*kind == KVF_EV_COPIER) {
                kvf__engine_progress_copier(eng);
            } else if (*kind == KVF_EV_WAKE) {
                uint64_t v;
                if (read(eng->sync.wakefd[0], &v, sizeof(v)) < 0 && errno != EAGAIN)
                    kvf_warn("eventfd read: %m");
            } else {
                kvf__peer_handle((kvf_peer_t *)kind, evs[i].events);
            }
        }
        /* Chunks the application published: whichever lane is awake. */
        kvf__rooms_take_submitted(eng);
        /* Between the two passes too: a peer's event and its drain may each
         * pull a full share, and our heartbeats must not wait for both. */
        tick_if_due(eng, &next_tick);
        more = drain_peers(eng);
        /* Application threads queue work and wake us; send it. */
        flush_peers(eng);
        /* Movers without an fd, and every mover while reads are in flight
         * (a read may finish without its fd saying so). */
        for (int i = 0; i < KVF_MAX_MOVERS; i++)
            if (eng->movers[i] != NULL &&
                (eng->reads_inflight > 0 || eng->movers[i]->ops->fd(eng->movers[i]) < 0))
                progress_mover(eng, i);
        /* Copies may end without the copier's fd saying so (a driver
         * without host functions): ask while any is in flight. */
        if (eng->copier != NULL && (eng->copies_inflight > 0 || eng->reads_inflight > 0))
            kvf__engine_progress_copier(eng);
        more |= peers_pending(eng);   /* windows the reads just reopened */
        tick_if_due(eng, &next_tick);
        lane_poll_on(eng, &eng->lanes[0], work);
    }
    kvf__unlock(eng);
    atomic_fetch_sub(&eng->sync.awake, 1);
    return NULL;
}
