/*
 * The control listener: accept what is pending, let the bounds on
 * connections still authenticating decide who goes on (auth.c), and shed
 * load when the process is out of descriptors.
 *
 * The one idea (libuv's): the listener is level-triggered, so a pending
 * connection that cannot be accepted (EMFILE, ENFILE) keeps it readable,
 * and the progress thread would spin on it, logging each turn.  So one
 * descriptor is kept in reserve (/dev/null): out of descriptors, it is
 * closed, the pending connection is accepted on it and closed at once,
 * and the reserve is opened again.  The dialler sees a close before any
 * AUTH, which a kvferry engine takes for "busy, dial again"
 * (docs/PROTOCOL.md section 4).  When even the reserve does not help (a
 * thread of the application took the descriptor, the whole system is
 * out), the listener leaves epoll for SHED_PAUSE_MS instead.  Either way
 * the log says so at most once per SHED_LOG_MS, with how many were shed.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include "core/peer.h"
#include "util/log.h"
#include "util/reserve.h"
#include "util/time.h"

#define ACCEPT_BATCH  64      /* connections one event takes at most: the
                                 listener stays readable for the rest */
#define SHED_PAUSE_MS 100
#define SHED_LOG_MS   10000

void kvf__listener_init_unlocked(kvf_engine_t *eng)
{
    eng->reserve_fd = kvf_reserve_open();
    if (eng->reserve_fd < 0)
        kvf_warn("no descriptor to keep in reserve (%m): out of descriptors, the control "
                 "listener will pause instead of shedding connections");
}

/* One line per SHED_LOG_MS at most: the first of a run says what and why,
 * the next ones how many were shed since. */
static void shed_log(kvf_engine_t *eng, uint64_t now)
{
    struct rlimit rl = {0, 0};
    if (eng->shed_unlogged == 0 ||
        (eng->shed_log_ms != 0 && now - eng->shed_log_ms < SHED_LOG_MS))
        return;
    if (eng->shed_log_ms == 0 || now - eng->shed_log_ms >= 2 * SHED_LOG_MS) {
        getrlimit(RLIMIT_NOFILE, &rl);
        kvf_warn("out of file descriptors (%s; RLIMIT_NOFILE is %llu): closing new "
                 "connections at once until one is free (kvferry engines among them dial "
                 "again); how many follows at most once per %d s. Raise the limit (ulimit "
                 "-n, LimitNOFILE=) or find what holds them (ls /proc/%d/fd)",
                 strerror(eng->shed_errno), (unsigned long long)rl.rlim_cur,
                 SHED_LOG_MS / 1000, (int)getpid());
    } else {
        kvf_warn("out of file descriptors (%s): closed %llu more new connection%s at once "
                 "in the last %.0f s", strerror(eng->shed_errno),
                 (unsigned long long)eng->shed_unlogged, eng->shed_unlogged == 1 ? "" : "s",
                 (double)(now - eng->shed_log_ms) / 1000.0);
    }
    eng->shed_unlogged = 0;
    eng->shed_log_ms = now ? now : 1;
}

/* Out of descriptors: take the next pending connection on the reserve's
 * descriptor and close it.  @return 1 one was shed, 0 none is pending,
 * -1 the reserve did not help. */
static int shed_one(kvf_engine_t *eng, int err)
{
    int shed = kvf_reserve_shed(&eng->reserve_fd, eng->listenfd);
    if (shed <= 0)
        return shed;
    eng->auth_refused++;
    eng->shed_unlogged++;
    eng->shed_errno = err;
    shed_log(eng, kvf_now_ms());
    return 1;
}

/* The listener leaves epoll for a while: nothing else stops a
 * level-triggered listener that cannot be served from waking us. */
static void pause_listener(kvf_engine_t *eng, int err)
{
    uint64_t now = kvf_now_ms();
    if (epoll_ctl(eng->epfd, EPOLL_CTL_DEL, eng->listenfd, NULL) != 0)
        kvf_warn("epoll_ctl (listener): %m");
    eng->listen_paused_until_ms = now + SHED_PAUSE_MS;
    if (err == EMFILE || err == ENFILE) {
        eng->shed_errno = err;
        if (eng->shed_log_ms == 0 || now - eng->shed_log_ms >= SHED_LOG_MS) {
            eng->shed_log_ms = now ? now : 1;
            kvf_warn("out of file descriptors (%s), and none in reserve: not accepting "
                     "connections for %d ms at a time until one is free (this line once "
                     "per %d s)", strerror(err), SHED_PAUSE_MS, SHED_LOG_MS / 1000);
        }
    } else {
        kvf_warn("accept: %s: not accepting connections for %d ms", strerror(err),
                 SHED_PAUSE_MS);
    }
}

void kvf__listener_tick(kvf_engine_t *eng, uint64_t now)
{
    KVF_ASSERT_LOCKED(eng);
    if (eng->reserve_fd < 0)
        eng->reserve_fd = kvf_reserve_open();
    shed_log(eng, now);
    if (eng->listen_paused_until_ms == 0 || now < eng->listen_paused_until_ms)
        return;
    struct epoll_event ev = {.events = EPOLLIN, .data.ptr = &eng->ev_listener};
    if (epoll_ctl(eng->epfd, EPOLL_CTL_ADD, eng->listenfd, &ev) == 0 || errno == EEXIST)
        eng->listen_paused_until_ms = 0;
    else
        eng->listen_paused_until_ms = now + SHED_PAUSE_MS;
}

void kvf__listener_accept(kvf_engine_t *eng)
{
    KVF_ASSERT_LOCKED(eng);
    for (int n = 0; n < ACCEPT_BATCH; n++) {
        struct sockaddr_storage sa;
        socklen_t salen = sizeof(sa);
        char host[64] = "(unknown address)";
        int fd = accept4(eng->listenfd, (struct sockaddr *)&sa, &salen, SOCK_CLOEXEC);
        if (fd < 0) {
            int err = errno;
            if (err == EAGAIN || err == EWOULDBLOCK)
                return;
            if (err == EINTR || err == ECONNABORTED)
                continue;
            int shed = err == EMFILE || err == ENFILE ? shed_one(eng, err) : -1;
            if (shed > 0)
                continue;
            if (shed < 0)
                pause_listener(eng, err);
            return;
        }
        /* Protected mode: without a token only this host's peers get as
         * far as the handshake; and only so many at once. */
        if (!kvf__auth_admit(eng, (struct sockaddr *)&sa)) {
            close(fd);
            continue;
        }
        if (sa.ss_family == AF_INET)
            inet_ntop(AF_INET, &((struct sockaddr_in *)&sa)->sin_addr, host, sizeof(host));
        else if (sa.ss_family == AF_INET6)
            inet_ntop(AF_INET6, &((struct sockaddr_in6 *)&sa)->sin6_addr, host, sizeof(host));
        kvf__peer_accept(eng, fd, host);
    }
}
