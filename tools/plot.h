/*
 * `kvferry bench --plot FILE.png`: the run's throughput over time and its
 * room latencies, drawn against baselines, by gnuplot (Debian's
 * gnuplot-nox, which `make deps` installs; nothing is fetched at run
 * time).  The baselines are bench/baselines.sh's figures when --baselines
 * names its JSON (OUT=...): memcpy, iperf3 and, when measured, UCX's
 * ucp_get, medians over its rounds; without it, a single-threaded memcpy
 * measured here right after the run.
 */
#ifndef KVT_PLOT_H
#define KVT_PLOT_H

#include <stddef.h>
#include <stdint.h>

/** Decode bytes over time (seconds since "go"), one sample a quarter second. */
typedef struct kvt_series {
    double   *t;
    uint64_t *bytes;
    size_t    n, cap;
} kvt_series_t;

void kvt_series_add(kvt_series_t *s, double t, uint64_t bytes);
/* The run's last point, however soon after the previous one (a short run
 * has a line too). */
void kvt_series_end(kvt_series_t *s, double t, uint64_t bytes);
void kvt_series_free(kvt_series_t *s);

typedef struct kvt_baseline {
    char   name[64];
    double gbps;
} kvt_baseline_t;

/**
 * The baselines: from `file` (bench/baselines.sh's JSON), or, with file
 * NULL, a memcpy measured now.  @return how many (at most max), or -1 with
 * why in err.
 */
int kvt_plot_baselines(const char *file, kvt_baseline_t *bl, size_t max, char *err,
                       size_t errlen);

/** What the plot shows besides the series. */
typedef struct kvt_plot {
    const char           *png;
    const char           *title;
    const kvt_series_t   *series;
    const double         *lat_ms;     /* sorted, per room that succeeded */
    size_t                nlat;
    double                gbps;       /* the run's mean */
    double                p50_ms, p99_ms;
    const kvt_baseline_t *bl;
    size_t                nbl;
} kvt_plot_t;

/** Draw it.  @return 0, or -1 with why in err (gnuplot missing or failing). */
int kvt_plot_bench(const kvt_plot_t *p, char *err, size_t errlen);

#endif /* KVT_PLOT_H */
