/*
 * The live progress line of `kvferry demo` and `kvferry bench`: one line
 * on stderr, rewritten in place (carriage return, erase to the end), at
 * most four times a second: elapsed seconds, rooms done (of how many),
 * GB/s over the last interval, rooms failed.  Only on a terminal: when
 * stdout or stderr is not one (a pipe, a file, CI), or with --json, the
 * line is never drawn, so that what a script reads is the report alone.
 * The line is erased before the report is printed.
 */
#ifndef KVT_PROGRESS_H
#define KVT_PROGRESS_H

#include <stdint.h>
#include <stdio.h>

typedef struct kvt_progress {
    const char *cmd;         /* "demo" or "bench" */
    FILE       *out;         /* stderr */
    int         on;          /* drawn at all */
    int         shown;       /* a line is on the screen now */
    uint64_t    t0_ms;       /* the clock's start (the run's "go") */
    uint64_t    last_ms;     /* last line drawn */
    uint64_t    last_bytes;
    double      gbps;        /* over the last interval */
} kvt_progress_t;

/** Decide whether to draw at all: not under --json, and only when both
 *  stdout and stderr are terminals. */
void kvt_progress_init(kvt_progress_t *p, const char *cmd, int json);

/** Draw the line if a quarter second has passed since the last one.
 *  total 0: unknown (a --duration run).  now_ms and t0_ms: monotonic. */
void kvt_progress_show(kvt_progress_t *p, uint64_t now_ms, uint64_t t0_ms, uint32_t done,
                       uint32_t total, uint64_t bytes, uint32_t failed);

/** Erase the line, if one is shown, before the report. */
void kvt_progress_end(kvt_progress_t *p);

#endif /* KVT_PROGRESS_H */
