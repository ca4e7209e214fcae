/*
 * Fuzz the bootstrap registry's request handling without the network.
 *
 * An input is up to 16 requests separated by NUL bytes, run in order
 * against one fresh registry (so a registration can be followed by
 * lookups).  Each request is "METHOD TARGET\nBODY": TARGET splits at the
 * first '?' into path and raw query.  Besides the sanitizers, the oracle
 * checks that every answer has a known status, a body, and valid JSON
 * whenever it says application/json.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "bootstrap/bootstrap.h"

#define MAX_REQUESTS 16

static void fake_stats(void *arg, kvf_engine_stats_t *s)
{
    s->rooms_by_state[KVF_POLL_TRANSFERRING] = 1;
    s->bytes_sent = 42;
}

static char *dup_range(const uint8_t *p, size_t n)
{
    char *s = malloc(n + 1);
    if (s == NULL)
        abort();
    memcpy(s, p, n);
    s[n] = '\0';
    return s;
}

static void run_one(kvf_registry_state_t *st, const uint8_t *p, size_t n)
{
    static const uint8_t empty[1];
    if (n == 0)
        p = empty;
    const uint8_t *nl = memchr(p, '\n', n);
    size_t line = nl ? (size_t)(nl - p) : n;
    const uint8_t *sp = memchr(p, ' ', line);
    size_t mlen = sp ? (size_t)(sp - p) : line;
    const uint8_t *target = sp ? sp + 1 : p + line;
    size_t tlen = (size_t)(p + line - target);
    const uint8_t *q = memchr(target, '?', tlen);

    char *method = dup_range(p, mlen);
    char *path = dup_range(target, q ? (size_t)(q - target) : tlen);
    char *query = q ? dup_range(q + 1, (size_t)(target + tlen - q - 1)) : NULL;
    size_t blen = nl ? n - line - 1 : 0;
    /* An exact-size heap copy, so ASan sees any read past the body. */
    char *body = blen ? malloc(blen) : NULL;
    if (blen && body == NULL)
        abort();
    if (blen)
        memcpy(body, nl + 1, blen);

    char *resp = NULL;
    const char *ctype = NULL;
    int status = kvf__registry_handle(st, method, path, query, body, blen,
                                      &resp, &ctype);
    switch (status) {
    case 200: case 400: case 404: case 405: case 409: case 413: case 503:
        break;
    default:
        fprintf(stderr, "unexpected status %d\n", status);
        abort();
    }
    if (resp == NULL || ctype == NULL)
        abort();
    if (strcmp(ctype, "application/json") == 0) {
        json_error_t err;
        json_t *j = json_loads(resp, 0, &err);
        if (j == NULL) {
            fprintf(stderr, "invalid JSON answer: %s\n", resp);
            abort();
        }
        json_decref(j);
    }
    free(resp);
    free(body);
    free(query);
    free(path);
    free(method);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    kvf_log_set_level(KVF_LOG_ERROR);   /* 409s log warnings: too noisy here */
    kvf_registry_state_t *st = kvf__registry_state_create(8);
    if (st == NULL)
        return 0;
    kvf__registry_set_stats_cb(st, fake_stats, NULL);

    size_t off = 0;
    for (int i = 0; i < MAX_REQUESTS && off <= size; i++) {
        const uint8_t *end =
            off < size ? memchr(data + off, '\0', size - off) : NULL;
        size_t n = end ? (size_t)(end - (data + off)) : size - off;
        run_one(st, data + off, n);
        if (end == NULL)
            break;
        off += n + 1;
    }
    kvf__registry_state_destroy(st);
    return 0;
}
