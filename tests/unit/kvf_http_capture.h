/*
 * A stand-in bootstrap registry for tests that must see exactly what a
 * client sent: an HTTP/1.1 server on 127.0.0.1 (a free port) that keeps
 * the method, target, Authorization header and body of the last request
 * and answers every request 200 "OK".  One thread, one request per
 * connection, small bodies only.
 */
#ifndef KVF_HTTP_CAPTURE_H
#define KVF_HTTP_CAPTURE_H

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <unistd.h>

#define CAP_MAX 65536

typedef struct capture {
    int             fd;
    int             port;
    char            addr[32];
    pthread_t       thread;
    atomic_int      stop;
    pthread_mutex_t lock;
    int             count;            /* requests seen */
    char            method[16];
    char            target[256];
    char            authorization[512];
    char            body[CAP_MAX];
} capture_t;

/* A header's value in [head, end), or "" (copied into out). */
static void cap_header(const char *head, const char *name, char *out,
                       size_t len)
{
    size_t n = strlen(name);
    out[0] = '\0';
    for (const char *l = strstr(head, "\r\n"); l != NULL;
         l = strstr(l + 2, "\r\n")) {
        if (strncasecmp(l + 2, name, n) == 0 && l[2 + n] == ':') {
            const char *v = l + 3 + n, *e = strstr(v, "\r\n");
            while (*v == ' ')
                v++;
            snprintf(out, len, "%.*s", (int)(e ? e - v : (long)strlen(v)), v);
            return;
        }
    }
}

static void cap_serve(capture_t *c, int fd)
{
    char *buf = malloc(CAP_MAX + 4096), clen[32], auth[512];
    size_t got = 0;
    char *eoh = NULL;

    if (buf == NULL)
        return;
    /* Headers, then Content-Length bytes of body (5 s at most). */
    while (eoh == NULL || got < (size_t)(eoh - buf) + 4 + strtoul(clen, 0, 10)) {
        struct pollfd p = {fd, POLLIN, 0};
        if (got >= CAP_MAX + 4095 || poll(&p, 1, 5000) != 1)
            break;
        ssize_t n = recv(fd, buf + got, CAP_MAX + 4095 - got, 0);
        if (n <= 0)
            break;
        got += (size_t)n;
        buf[got] = '\0';
        if (eoh == NULL && (eoh = strstr(buf, "\r\n\r\n")) != NULL) {
            *eoh = '\0';
            cap_header(buf, "Content-Length", clen, sizeof(clen));
        }
    }
    if (eoh != NULL) {
        cap_header(buf, "Authorization", auth, sizeof(auth));
        pthread_mutex_lock(&c->lock);
        sscanf(buf, "%15s %255s", c->method, c->target);
        snprintf(c->authorization, sizeof(c->authorization), "%s", auth);
        snprintf(c->body, sizeof(c->body), "%s", eoh + 4);
        c->count++;
        pthread_mutex_unlock(&c->lock);
        static const char ok[] = "HTTP/1.1 200 OK\r\nContent-Type: text/plain"
                                 "\r\nContent-Length: 2\r\nConnection: close"
                                 "\r\n\r\nOK";
        if (send(fd, ok, sizeof(ok) - 1, MSG_NOSIGNAL) < 0)
            perror("capture send");
    }
    free(buf);
}

static void *cap_main(void *arg)
{
    capture_t *c = arg;
    while (!atomic_load(&c->stop)) {
        struct pollfd p = {c->fd, POLLIN, 0};
        if (poll(&p, 1, 50) != 1)
            continue;
        int fd = accept(c->fd, NULL, NULL);
        if (fd < 0)
            continue;
        cap_serve(c, fd);
        close(fd);
    }
    return NULL;
}

static int capture_start(capture_t *c)
{
    struct sockaddr_in a = {.sin_family = AF_INET,
                            .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t alen = sizeof(a);

    memset(c, 0, sizeof(*c));
    c->fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (c->fd < 0 || bind(c->fd, (struct sockaddr *)&a, sizeof(a)) != 0 ||
        listen(c->fd, 16) != 0 ||
        getsockname(c->fd, (struct sockaddr *)&a, &alen) != 0) {
        if (c->fd >= 0)
            close(c->fd);
        return -1;
    }
    c->port = ntohs(a.sin_port);
    snprintf(c->addr, sizeof(c->addr), "127.0.0.1:%d", c->port);
    pthread_mutex_init(&c->lock, NULL);
    atomic_init(&c->stop, 0);
    if (pthread_create(&c->thread, NULL, cap_main, c) != 0) {
        close(c->fd);
        return -1;
    }
    return 0;
}

/* Requests seen so far. */
static int capture_count(capture_t *c)
{
    pthread_mutex_lock(&c->lock);
    int n = c->count;
    pthread_mutex_unlock(&c->lock);
    return n;
}

static void capture_stop(capture_t *c)
{
    atomic_store(&c->stop, 1);
    pthread_join(c->thread, NULL);
    close(c->fd);
    pthread_mutex_destroy(&c->lock);
}

#endif /* KVF_HTTP_CAPTURE_H */
