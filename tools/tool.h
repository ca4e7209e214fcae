/*
 * What the files of the kvferry command share: subcommand entry points and
 * clocks.  Wall-clock time (CLOCK_REALTIME) is what ranks report, because
 * the orchestrator compares times taken in different processes; deadlines
 * inside one process use the monotonic clock.
 */
#ifndef KVT_TOOL_H
#define KVT_TOOL_H

#include <stdint.h>
#include <time.h>

/** `kvferry demo`: the orchestrator (demo.c). */
int kvt_demo_main(int argc, char **argv);

/** `kvferry bench`: the orchestrator of a measured run (bench.c). */
int kvt_bench_main(int argc, char **argv);

/** `kvferry trace`: one room's trace lines of every rank, merged (trace.c). */
int kvt_trace_main(int argc, char **argv);

/** `kvferry _rank`: one prefill or decode rank of the demo (rank.c). */
int kvt_rank_main(int argc, char **argv);

/** Seconds since the epoch, with sub-microsecond resolution. */
static inline double kvt_wall_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/** Monotonic milliseconds, for deadlines. */
static inline uint64_t kvt_mono_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

#endif /* KVT_TOOL_H */
