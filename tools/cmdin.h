/*
 * The command channel of a rank process (`kvferry _rank`): lines on its
 * stdin from the orchestrator, read without blocking while rooms run.
 *
 * The one idea: stdin is read with read(2) only, never through stdio, so
 * no byte of a later command can sit in a stdio buffer where poll(2) does
 * not see it; complete lines wait in this buffer until the rank takes
 * them, in order or, for a line it waits for (a held rank's "resume"),
 * out of order, the others staying queued.
 */
#ifndef KVT_CMDIN_H
#define KVT_CMDIN_H

#include <stddef.h>

typedef struct kvt_cmdin {
    char   buf[16384];
    size_t len;
    int    eof;         /* stdin closed (or unreadable): no more commands */
} kvt_cmdin_t;

/**
 * Read what stdin has, waiting at most timeout_ns for it to become
 * readable (0: do not wait; negative: until it is).  @return 1 if bytes
 * came, 0 if none, -1 at end of input.
 */
int kvt_cmdin_fill(kvt_cmdin_t *c, long long timeout_ns);

/**
 * Take the first complete line (without its newline; empty lines are
 * skipped) into out.  @return 1 if a line was taken, 0 if none is there.
 */
int kvt_cmdin_next(kvt_cmdin_t *c, char *out, size_t len);

/** Take the first complete line equal to `line`, wherever it is.  @return 1 or 0. */
int kvt_cmdin_take(kvt_cmdin_t *c, const char *line);

/**
 * The next line, waiting for it as long as it takes.  @return 0, or -1 at
 * end of input.
 */
int kvt_cmdin_wait(kvt_cmdin_t *c, char *out, size_t len);

#endif /* KVT_CMDIN_H */
