/*
 * A rank's command lines (see cmdin.h): read(2) into one buffer, lines
 * taken out of it.  A line longer than the buffer is no command of ours:
 * it is dropped whole, with a warning, so that the channel stays in step.
 */
#include "cmdin.h"

#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

int kvt_cmdin_fill(kvt_cmdin_t *c, long long timeout_ns)
{
    if (c->eof)
        return -1;
    if (c->len == sizeof(c->buf) - 1 && memchr(c->buf, '\n', c->len) == NULL) {
        fprintf(stderr, "kvferry _rank: dropping a command line longer than %zu bytes\n",
                sizeof(c->buf) - 1);
        c->len = 0;
    }
    if (c->len == sizeof(c->buf) - 1)
        return 0;                       /* full of lines: take some first */
    struct pollfd p = {STDIN_FILENO, POLLIN, 0};
    struct timespec ts = {(time_t)(timeout_ns / 1000000000), (long)(timeout_ns % 1000000000)};
    int n = ppoll(&p, 1, timeout_ns < 0 ? NULL : &ts, NULL);
    if (n <= 0)
        return 0;                       /* nothing yet, or EINTR: the caller comes back */
    ssize_t k = read(STDIN_FILENO, c->buf + c->len, sizeof(c->buf) - 1 - c->len);
    if (k < 0 && (errno == EINTR || errno == EAGAIN))
        return 0;
    if (k <= 0) {
        c->eof = 1;
        return -1;
    }
    c->len += (size_t)k;
    c->buf[c->len] = '\0';
    return 1;
}

/* Remove [at, at + n) from the buffer. */
static void cut(kvt_cmdin_t *c, size_t at, size_t n)
{
    memmove(c->buf + at, c->buf + at + n, c->len - at - n);
    c->len -= n;
    c->buf[c->len] = '\0';
}

int kvt_cmdin_next(kvt_cmdin_t *c, char *out, size_t len)
{
    for (;;) {
        char *nl = memchr(c->buf, '\n', c->len);
        if (nl == NULL)
            return 0;
        size_t n = (size_t)(nl - c->buf);
        if (n > 0 && c->buf[n - 1] == '\r')
            n--;
        snprintf(out, len, "%.*s", (int)n, c->buf);
        cut(c, 0, (size_t)(nl - c->buf) + 1);
        if (out[0] != '\0')
            return 1;
    }
}

int kvt_cmdin_take(kvt_cmdin_t *c, const char *line)
{
    size_t want = strlen(line), at = 0;
    while (at < c->len) {
        char *nl = memchr(c->buf + at, '\n', c->len - at);
        if (nl == NULL)
            return 0;
        size_t n = (size_t)(nl - (c->buf + at));
        size_t body = n > 0 && c->buf[at + n - 1] == '\r' ? n - 1 : n;
        if (body == want && memcmp(c->buf + at, line, want) == 0) {
            cut(c, at, n + 1);
            return 1;
        }
        at += n + 1;
    }
    return 0;
}

int kvt_cmdin_wait(kvt_cmdin_t *c, char *out, size_t len)
{
    while (!kvt_cmdin_next(c, out, len))
        if (kvt_cmdin_fill(c, -1) < 0)
            return kvt_cmdin_next(c, out, len) ? 0 : -1;
    return 0;
}
