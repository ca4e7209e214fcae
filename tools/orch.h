/*
 * The orchestrator shared by `kvferry demo` and `kvferry bench`: one
 * registry process and the rank processes (`kvferry _rank`) on this host,
 * driven through their stdin/stdout: --dp x --prefill-pp x --prefill-tp
 * prefill ranks and --decode-pp x --decode-tp decode ranks, each named by
 * its index within its side (kvt_opts_coord() gives its dp/pp/tp).
 *
 * The orchestrator owns the process table, the signals (SIGINT/SIGTERM end
 * the run, SIGCHLD wakes the loop) and the start sequence: registry ->
 * every rank "ready" -> the registry lists every prefill rank -> "go" to
 * every rank.  What the ranks report is the caller's business: each event
 * line of a rank reaches on_event as a parsed JSON object, after the
 * orchestrator has noted the protocol events it needs itself ("ready",
 * "result", "error").  on_tick runs at least every tick_ms while the run
 * lasts; the bench uses it for its progress line and --duration.
 *
 * Hooks for the demo's fault injector (fault.c): rank_args adds argv to a
 * rank at its first start; on_finished, called while every rank has
 * finished its batch, returns 1 to keep the ranks running (it will send
 * them more work) instead of releasing them; ranks and the registry can be
 * started again while the run lasts.
 */
#ifndef KVT_ORCH_H
#define KVT_ORCH_H

#include <jansson.h>
#include <limits.h>
#include <stdint.h>

#include "opts.h"
#include "proc.h"

typedef struct kvt_orch kvt_orch_t;

typedef void (*kvt_orch_event_cb_t)(void *ctx, kvt_child_t *c,
                                    const char *type, json_t *ev);
typedef void (*kvt_orch_tick_cb_t)(void *ctx, uint64_t now_ms);
typedef char *const *(*kvt_orch_args_cb_t)(void *ctx, kvt_child_role_t role,
                                           uint32_t rank);
typedef int (*kvt_orch_finished_cb_t)(void *ctx);

struct kvt_orch {
    const char         *cmd;             /* "demo" or "bench", for messages */
    char                exe[PATH_MAX];
    kvt_children_t      kids;
    kvt_child_t        *registry;
    char                registry_addr[64];
    /* Which cluster token the run uses, for the summary: "cluster token
     * generated for this run (registry writes, engine handshakes)", ... */
    char                registry_auth[128];
    char                transport[32];   /* what the ranks' engines report */
    int                 sfd;             /* signalfd: SIGCHLD, SIGINT, SIGTERM */
    unsigned            timeout_s;
    uint64_t            deadline_ms;
    uint64_t            ready_at_ms;     /* when the last rank said ready */
    uint64_t            go_at_ms;        /* when "go" went out; 0 before */
    int                 go_sent;
    int                 signal;          /* SIGINT/SIGTERM received */
    int                 timed_out;
    char                error[512];      /* first setup error */
    kvt_orch_event_cb_t on_event;
    kvt_orch_tick_cb_t  on_tick;
    unsigned            tick_ms;
    kvt_orch_args_cb_t  rank_args;       /* optional */
    kvt_orch_finished_cb_t on_finished;  /* optional */
    char              **fwd;             /* forwarded options, from run */
    void               *ctx;
};

/**
 * Prepare: find our executable, block the signals, size the child table.
 * @return 0, or -1 with a message printed.
 */
int kvt_orch_init(kvt_orch_t *o, const char *cmd, const kvt_opts_t *opts,
                  unsigned timeout_s);

/**
 * Start the registry and the ranks (each gets `fwd`, the forwarded
 * options), release them together and run until every rank has exited, the
 * deadline passes or a signal arrives.  Does not stop the children: call
 * kvt_orch_stop() next, whatever this returned.
 */
void kvt_orch_run(kvt_orch_t *o, const kvt_opts_t *opts, char **fwd);

/** Kill and reap every child, draining their last events. */
void kvt_orch_stop(kvt_orch_t *o);

void kvt_orch_fini(kvt_orch_t *o);

/** Record the first error of the run (later ones follow from it). */
void kvt_orch_error(kvt_orch_t *o, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

/**
 * Start one rank process with the forwarded options plus `extra` (NULL-
 * terminated, may be NULL).  @return its child entry, or NULL (error
 * recorded).
 */
kvt_child_t *kvt_orch_start_rank(kvt_orch_t *o, kvt_child_role_t role,
                                 uint32_t rank, char *const *extra);

/**
 * Start a new registry process on the port of the current one (which must
 * be gone), and wait for it to listen.  Blocks up to 10 s.  @return 0 or -1.
 */
int kvt_orch_restart_registry(kvt_orch_t *o);

/** GET `path` from the registry.  @return the HTTP status, -1 if unreachable. */
int kvt_orch_http_get(kvt_orch_t *o, const char *path, char *body, size_t len);

/** Does the registry list every prefill rank?  1 yes, 0 not yet, -1 cannot tell. */
int kvt_orch_registry_complete(kvt_orch_t *o);

/** Write a command line to every rank's stdin. */
void kvt_orch_send_ranks(kvt_orch_t *o, const char *line);

#endif /* KVT_ORCH_H */
