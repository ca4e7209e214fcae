/*
 * Plots of `kvferry bench` (plot.h): data files and a script in a
 * private temporary directory, then gnuplot, run as a child with its
 * output checked; the directory goes afterwards.
 */
#include "plot.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <jansson.h>

#include "tool.h"

#define KVT_SAMPLE_S 0.25

static void kvt_series_put(kvt_series_t *s, double t, uint64_t bytes)
{
    if (s->n == s->cap) {
        size_t c = s->cap ? 2 * s->cap : 256;
        double *nt = realloc(s->t, c * sizeof(*nt));
        if (nt == NULL)
            return;
        s->t = nt;
        uint64_t *nb = realloc(s->bytes, c * sizeof(*nb));
        if (nb == NULL)
            return;
        s->bytes = nb;
        s->cap = c;
    }
    s->t[s->n] = t;
    s->bytes[s->n++] = bytes;
}

void kvt_series_add(kvt_series_t *s, double t, uint64_t bytes)
{
    if (s->n == 0 || t - s->t[s->n - 1] >= KVT_SAMPLE_S)
        kvt_series_put(s, t, bytes);
}

void kvt_series_end(kvt_series_t *s, double t, uint64_t bytes)
{
    if (s->n == 0)
        kvt_series_put(s, 0, 0);
    if (t > s->t[s->n - 1])
        kvt_series_put(s, t, bytes);
}

void kvt_series_free(kvt_series_t *s)
{
    free(s->t);
    free(s->bytes);
    memset(s, 0, sizeof(*s));
}

/* ------------------------------------------------------------------------ */
/* Baselines                                                                */
/* ------------------------------------------------------------------------ */

static int kvt_cmp_d(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* The median of a figure's rounds (nulls skipped); 0 when none. */
static double kvt_median(json_t *rounds)
{
    double v[64];
    size_t n = 0, i;
    json_t *x;
    json_array_foreach(rounds, i, x)
        if (json_is_number(x) && n < 64)
            v[n++] = json_number_value(x);
    if (n == 0)
        return 0;
    qsort(v, n, sizeof(v[0]), kvt_cmp_d);
    return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

/* Single-threaded memcpy of 256 MiB, best of three after a warm-up. */
static double kvt_memcpy_gbps(void)
{
    size_t len = 256u << 20;
    void *a = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    void *b = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    double best = 0;
    if (a != MAP_FAILED && b != MAP_FAILED) {
        memset(a, 1, len);
        memcpy(b, a, len);
        for (int k = 0; k < 3; k++) {
            double t0 = kvt_wall_now();
            memcpy(b, a, len);
            double dt = kvt_wall_now() - t0;
            if (dt > 0 && (double)len / dt / 1e9 > best)
                best = (double)len / dt / 1e9;
        }
    }
    if (a != MAP_FAILED)
        munmap(a, len);
    if (b != MAP_FAILED)
        munmap(b, len);
    return best;
}

int kvt_plot_baselines(const char *file, kvt_baseline_t *bl, size_t max, char *err,
                       size_t errlen)
{
    static const struct { const char *key, *name; } known[] = {
        {"memcpy", "memcpy, 1 thread"},
        {"iperf3", "iperf3, 1 TCP stream"},
        {"iperf3_p", "iperf3, N TCP streams"},
        {"ucp_get", "UCX ucp\\_get"},
    };
    size_t n = 0;
    if (file == NULL) {
        if (max > 0) {
            snprintf(bl[0].name, sizeof(bl[0].name), "memcpy, 1 thread (measured now)");
            bl[0].gbps = kvt_memcpy_gbps();
            n = bl[0].gbps > 0;
        }
        return (int)n;
    }
    json_error_t je;
    json_t *j = json_load_file(file, 0, &je);
    json_t *fig = json_object_get(j, "figures");
    if (!json_is_object(fig)) {
        snprintf(err, errlen, "--baselines %s: not the JSON bench/baselines.sh writes "
                 "(OUT=FILE): %s", file, j == NULL ? je.text : "no \"figures\" object");
        json_decref(j);
        return -1;
    }
    for (size_t i = 0; i < sizeof(known) / sizeof(known[0]) && n < max; i++) {
        double v = kvt_median(json_object_get(fig, known[i].key));
        if (v <= 0)
            continue;
        snprintf(bl[n].name, sizeof(bl[n].name), "%s", known[i].name);
        bl[n++].gbps = v;
    }
    json_decref(j);
    return (int)n;
}

/* ------------------------------------------------------------------------ */
/* Drawing                                                                  */
/* ------------------------------------------------------------------------ */

static int kvt_write_data(const char *dir, const kvt_plot_t *p)
{
    char path[256];
    snprintf(path, sizeof(path), "%s/throughput.dat", dir);
    FILE *f = fopen(path, "w");
    if (f == NULL)
        return -1;
    const kvt_series_t *s = p->series;
    for (size_t i = 1; s != NULL && i < s->n; i++) {
        double dt = s->t[i] - s->t[i - 1];
        if (dt > 0 && s->bytes[i] >= s->bytes[i - 1])
            fprintf(f, "%.3f %.6f\n", s->t[i], (double)(s->bytes[i] - s->bytes[i - 1]) / dt / 1e9);
    }
    if (fclose(f) != 0)
        return -1;
    snprintf(path, sizeof(path), "%s/latency.dat", dir);
    if ((f = fopen(path, "w")) == NULL)
        return -1;
    for (size_t i = 0; i < p->nlat; i++)
        fprintf(f, "%.6f %.6f\n", p->lat_ms[i], (double)(i + 1) / (double)p->nlat);
    return fclose(f);
}

/* A title for gnuplot's enhanced text: quotes dropped, _ and ^ escaped. */
static void kvt_gp_text(const char *in, char *out, size_t len)
{
    size_t n = 0;
    for (; *in && n + 3 < len; in++) {
        if (*in == '"' || *in == '\\')
            continue;
        if (*in == '_' || *in == '^' || *in == '@' || *in == '&' || *in == '{' || *in == '}') {
            out[n++] = '\\';
            out[n++] = '\\';
        }
        out[n++] = *in;
    }
    out[n] = '\0';
}

static int kvt_write_script(const char *dir, const kvt_plot_t *p)
{
    char path[256], title[512];
    snprintf(path, sizeof(path), "%s/plot.gp", dir);
    FILE *f = fopen(path, "w");
    if (f == NULL)
        return -1;
    kvt_gp_text(p->title, title, sizeof(title));
    fprintf(f, "set terminal pngcairo size 1400,560 enhanced font ',10'\n"
            "set output '%s'\n"
            "set multiplot layout 1,2 title \"%s\"\n"
            "set grid\nset key bottom right box opaque\n", p->png, title);
    fprintf(f, "set title 'Throughput (decode ranks, per quarter second)'\n"
            "set xlabel 'seconds since the rooms started'\nset ylabel 'GB/s (10^9 B/s)'\n"
            "set yrange [0:*]\n");
    fprintf(f, "plot '%s/throughput.dat' using 1:2 with linespoints lw 2 pt 7 ps 0.6 title 'kvferry'", dir);
    fprintf(f, ", %.6f with lines dt 2 lw 2 title 'kvferry mean %.2f GB/s'", p->gbps, p->gbps);
    for (size_t i = 0; i < p->nbl; i++) {
        char name[128];
        kvt_gp_text(p->bl[i].name, name, sizeof(name));
        fprintf(f, ", %.6f with lines dt 3 lw 2 title \"%s %.2f GB/s\"", p->bl[i].gbps,
                name, p->bl[i].gbps);
    }
    fprintf(f, "\nset title 'Room latency (last chunk sent -> decode SUCCESS)'\n"
            "set xlabel 'ms'\nset ylabel 'fraction of rooms'\nset logscale x\n"
            "set yrange [0:1.02]\n");
    /* The percentiles as vertical lines, their key entries drawn alike. */
    fprintf(f, "set arrow 1 from %.6f, graph 0 to %.6f, graph 1 nohead dt 2 lw 2 "
            "lc rgb 'dark-green'\n"
            "set arrow 2 from %.6f, graph 0 to %.6f, graph 1 nohead dt 3 lw 2 "
            "lc rgb 'dark-orange'\n", p->p50_ms, p->p50_ms, p->p99_ms, p->p99_ms);
    fprintf(f, "plot '%s/latency.dat' using 1:2 with steps lw 2 title 'rooms (CDF)', "
            "NaN dt 2 lw 2 lc rgb 'dark-green' title 'p50 %.3f ms', "
            "NaN dt 3 lw 2 lc rgb 'dark-orange' title 'p99 %.3f ms'\n",
            dir, p->p50_ms, p->p99_ms);
    fprintf(f, "unset multiplot\n");
    return fclose(f);
}

/* Run gnuplot on the script; its messages go to our stderr. */
static int kvt_gnuplot(const char *dir, char *err, size_t errlen)
{
    char script[256];
    snprintf(script, sizeof(script), "%s/plot.gp", dir);
    fflush(NULL);
    pid_t pid = fork();
    if (pid < 0) {
        snprintf(err, errlen, "cannot start gnuplot: %s", strerror(errno));
        return -1;
    }
    if (pid == 0) {
        execlp("gnuplot", "gnuplot", script, (char *)NULL);
        _exit(errno == ENOENT ? 127 : 126);
    }
    int status = 0;
    while (waitpid(pid, &status, 0) < 0 && errno == EINTR)
        ;
    if (WIFEXITED(status) && WEXITSTATUS(status) == 0)
        return 0;
    if (WIFEXITED(status) && WEXITSTATUS(status) == 127)
        snprintf(err, errlen, "gnuplot not found: install Debian's gnuplot-nox (`make deps` "
                 "does)");
    else
        snprintf(err, errlen, "gnuplot failed (status 0x%x); its messages are above",
                 status);
    return -1;
}

int kvt_plot_bench(const kvt_plot_t *p, char *err, size_t errlen)
{
    char dir[] = "/tmp/kvferry-plot.XXXXXX";
    if (mkdtemp(dir) == NULL) {
        snprintf(err, errlen, "cannot make a temporary directory: %s", strerror(errno));
        return -1;
    }
    int rc = -1;
    if (kvt_write_data(dir, p) != 0 || kvt_write_script(dir, p) != 0)
        snprintf(err, errlen, "cannot write the plot's data in %s: %s", dir, strerror(errno));
    else
        rc = kvt_gnuplot(dir, err, errlen);
    static const char *const files[] = {"throughput.dat", "latency.dat", "plot.gp"};
    for (size_t i = 0; i < sizeof(files) / sizeof(files[0]); i++) {
        char path[256];
        snprintf(path, sizeof(path), "%s/%s", dir, files[i]);
        unlink(path);
    }
    rmdir(dir);
    return rc;
}
