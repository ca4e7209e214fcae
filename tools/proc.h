/*
 * The orchestrator's table of child processes: the registry and every rank.
 *
 * Each child has a role and a rank (so a fault injector can say "stop
 * decode rank 1"), a pipe to its stdin (commands) and one from its stdout
 * (events, one line each); its stderr is ours.  Children run in their own
 * process group, so a terminal's Ctrl-C reaches only the orchestrator,
 * which then stops them in order; and they die with SIGKILL if the
 * orchestrator dies (PR_SET_PDEATHSIG), whatever killed it.
 */
#ifndef KVT_PROC_H
#define KVT_PROC_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

typedef enum kvt_child_role {
    KVT_CHILD_REGISTRY = 0,
    KVT_CHILD_PREFILL  = 1,
    KVT_CHILD_DECODE   = 2
} kvt_child_role_t;

typedef struct kvt_child {
    kvt_child_role_t role;
    uint32_t         rank;
    char             name[32];   /**< "registry", "prefill[0]", ... */
    pid_t            pid;        /**< 0 before spawn */
    int              out_fd;     /**< its stdout; -1 after EOF */
    int              in_fd;      /**< its stdin; -1 once closed */
    char            *buf;        /**< partial line read from out_fd */
    size_t           len, cap;
    int              reaped;     /**< waitpid() returned it */
    int              wstatus;    /**< its status, once reaped */
    int              stopped;    /**< we sent it SIGSTOP (faults) */
    int              faulted;    /**< killed on purpose by the fault injector */
    /* Protocol state, maintained by the orchestrator. */
    int              ready;      /**< sent its "ready" event */
    int              finished;   /**< sent its "result" event */
} kvt_child_t;

typedef struct kvt_children {
    kvt_child_t *v;
    size_t       n, cap;
} kvt_children_t;

/** Called with each complete line (NUL-terminated, no newline). */
typedef void (*kvt_line_cb_t)(void *ctx, kvt_child_t *c, char *line);

/** A table for up to `cap` children (entries never move). */
int kvt_children_init(kvt_children_t *t, size_t cap);
void kvt_children_fini(kvt_children_t *t);
kvt_child_t *kvt_children_add(kvt_children_t *t, kvt_child_role_t role,
                              uint32_t rank);
kvt_child_t *kvt_children_find(kvt_children_t *t, kvt_child_role_t role,
                               uint32_t rank);

/**
 * Start `exe` with argv (argv[0] included) as child c.  Signals the caller
 * blocks are unblocked in the child, SIGPIPE reset.  @return 0 or -1.
 */
int kvt_child_spawn(kvt_child_t *c, const char *exe, char *const argv[]);

/**
 * Read what is available on c's stdout and call cb for each complete line.
 * @return 1 while the pipe is open, 0 at EOF (out_fd is then closed), -1
 *         on a read error (also closed).
 */
int kvt_child_read(kvt_child_t *c, kvt_line_cb_t cb, void *ctx);

/** Write a command line to c's stdin.  @return 0, or -1 (it is gone). */
int kvt_child_send(kvt_child_t *c, const char *line);

/** Send a signal if c is still running. */
void kvt_child_signal(kvt_child_t *c, int sig);

/** Reap every child that has exited, without blocking. */
void kvt_children_reap(kvt_children_t *t);

/**
 * Stop everything: SIGKILL the ranks (SIGCONT first for stopped ones,
 * harmless), SIGTERM the registry and SIGKILL it after grace_ms, drain
 * every stdout pipe through cb, reap all.  Blocks until all are reaped.
 */
void kvt_children_stop_all(kvt_children_t *t, unsigned grace_ms,
                           kvt_line_cb_t cb, void *ctx);

/** "exit 0", "exit 1", "killed by SIGKILL", "running". */
void kvt_child_exit_str(const kvt_child_t *c, char *buf, size_t len);

/** 1 if c exited with status 0. */
int kvt_child_exited_ok(const kvt_child_t *c);

#endif /* KVT_PROC_H */
