/*
 * Fuzz the bootstrap registry's request handling without the network.
 *
 * An input is up to 16 requests separated by NUL bytes, run in order
 * against two fresh registries (so a registration can be followed by
 * lookups): one with the cluster token FUZZ_TOKEN, whose client is remote
 * and sends the request's Authorization value; one without a token
 * (protected mode), whose client is loopback for even-numbered requests
 * and remote for odd ones.  Each request is "METHOD TARGET[ AUTH]\nBODY":
 * TARGET splits at the first '?' into path and raw query, AUTH (the rest
 * of the line) is the Authorization header.  The registries' clock moves
 * 4 s per request, so the stale-configuration rule is reached too.
 *
 * Besides the sanitizers, the oracle checks that every answer has a known
 * status, a body, and valid JSON whenever it says application/json; that
 * GET /route answers have exactly the keys of SGLang's PrefillServerInfo
 * (newer SGLang's, with decode_allocation_policy, when one was registered)
 * or PrefillRankInfo; and the access rule: with the token, a mutating
 * request without exactly "Bearer FUZZ_TOKEN" (scheme in any case) gets
 * 401, one with it never does; in protected mode, a remote mutating
 * request gets 403.
 */
#include <stdint.h>
#include <stdio.h>
#include <strings.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "bootstrap/bootstrap.h"

#define MAX_REQUESTS 16
#define FUZZ_TOKEN "fuzz-cluster-token-0123456789"

static uint64_t fake_now;

static uint64_t fake_clock(void *arg)
{
    return fake_now;
}

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

/* with_token: the registry holds FUZZ_TOKEN (else protected mode). */
static void run_one(kvf_registry_state_t *st, int with_token, int loopback,
                    const uint8_t *p, size_t n)
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
    const uint8_t *sp2 = memchr(target, ' ', tlen);
    char *auth = sp2 ? dup_range(sp2 + 1, (size_t)(p + line - sp2 - 1))
                     : NULL;
    if (sp2)
        tlen = (size_t)(sp2 - target);
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
    kvf_bs_client_t client = {.authorization = with_token ? auth : NULL,
                              .loopback = !with_token && loopback,
                              .addr = "192.0.2.1"};
    int status = kvf__registry_handle(st, &client, method, path, query, body,
                                      blen, &resp, &ctype);
    switch (status) {
    case 200: case 400: case 401: case 403: case 404: case 405: case 409:
    case 413: case 414: case 503:
        break;
    default:
        fprintf(stderr, "unexpected status %d\n", status);
        abort();
    }
    int mutating = (strcmp(path, "/route") == 0 && strcmp(method, "PUT") == 0)
        || (strcmp(path, "/register_dp_rank") == 0 &&
            strcmp(method, "POST") == 0)
        || (strcmp(path, "/room_ready") == 0 && strcmp(method, "POST") == 0);
    int good = auth != NULL && strncasecmp(auth, "Bearer ", 7) == 0 &&
               strcmp(auth + 7, FUZZ_TOKEN) == 0;
    if (with_token && mutating && (status == 401) == good) {
        fprintf(stderr, "access rule broken: %s %s with \"%s\" got %d\n",
                method, path, auth ? auth : "(none)", status);
        abort();
    }
    if (with_token && status == 401 && !mutating) {
        fprintf(stderr, "401 for a read-only %s %s\n", method, path);
        abort();
    }
    if (!with_token && mutating && (status == 403) == (loopback != 0)) {
        fprintf(stderr, "protected mode broken: %s %s from %s got %d\n",
                method, path, loopback ? "loopback" : "remote", status);
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
        /* GET /route answers SGLang's shapes exactly: decode servers do
         * PrefillServerInfo(**data) / PrefillRankInfo(**data); newer
         * SGLang's info adds decode_allocation_policy, sent only when a
         * prefill registered one. */
        size_t info_keys = 15 + (json_object_get(j, "decode_allocation_policy") != NULL);
        if (strcmp(path, "/route") == 0 && status == 200 &&
            !(json_object_size(j) == info_keys &&
              json_object_get(j, "required_prefill_response_num")) &&
            !(json_object_size(j) == 2 && json_object_get(j, "rank_ip") &&
              json_object_get(j, "rank_port"))) {
            fprintf(stderr, "GET /route answered neither PrefillServerInfo "
                    "nor PrefillRankInfo: %s\n", resp);
            abort();
        }
        json_decref(j);
    }
    free(resp);
    free(body);
    free(query);
    free(path);
    free(method);
    free(auth);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    /* 409s and refusals log warnings: too noisy here */
    kvf_log_set_level(KVF_LOG_ERROR);
    for (int with_token = 1; with_token >= 0; with_token--) {
        kvf_registry_state_t *st = kvf__registry_state_create(8);
        if (st == NULL)
            return 0;
        kvf__registry_set_stats_cb(st, fake_stats, NULL);
        kvf__registry_set_clock(st, fake_clock, NULL);
        if (kvf__registry_set_auth(st, with_token ? FUZZ_TOKEN : NULL, 0) !=
            KVF_OK)
            abort();
        fake_now = 1000;
        size_t off = 0;
        for (int i = 0; i < MAX_REQUESTS && off <= size; i++) {
            const uint8_t *end =
                off < size ? memchr(data + off, '\0', size - off) : NULL;
            size_t n = end ? (size_t)(end - (data + off)) : size - off;
            run_one(st, with_token, i % 2 == 0, data + off, n);
            fake_now += 4000;
            if (end == NULL)
                break;
            off += n + 1;
        }
        kvf__registry_state_destroy(st);
    }
    return 0;
}
