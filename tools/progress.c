/* The live progress line (progress.h). */
#include "progress.h"

#include <unistd.h>

#define KVT_PROGRESS_EVERY_MS 250

void kvt_progress_init(kvt_progress_t *p, const char *cmd, int json)
{
    *p = (kvt_progress_t){.cmd = cmd, .out = stderr};
    p->on = !json && isatty(STDOUT_FILENO) && isatty(STDERR_FILENO);
}

void kvt_progress_show(kvt_progress_t *p, uint64_t now_ms, uint64_t t0_ms, uint32_t done,
                       uint32_t total, uint64_t bytes, uint32_t failed)
{
    if (!p->on || now_ms < t0_ms ||
        (p->shown && now_ms - p->last_ms < KVT_PROGRESS_EVERY_MS))
        return;
    if (p->shown && now_ms > p->last_ms && bytes >= p->last_bytes)
        p->gbps = (double)(bytes - p->last_bytes) / (double)(now_ms - p->last_ms) / 1e6;
    char of[24] = "";
    if (total)
        snprintf(of, sizeof(of), "/%u", total);
    /* \r and "erase to the end of the line": a shorter line leaves no tail. */
    fprintf(p->out, "\rkvferry %s: %6.1f s  %u%s rooms  %.2f GB/s  %u failed\033[K",
            p->cmd, (double)(now_ms - t0_ms) / 1000.0, done, of, p->gbps, failed);
    fflush(p->out);
    p->shown = 1;
    p->last_ms = now_ms;
    p->last_bytes = bytes;
}

void kvt_progress_end(kvt_progress_t *p)
{
    if (!p->shown)
        return;
    fprintf(p->out, "\r\033[K");
    fflush(p->out);
    p->shown = 0;
}
