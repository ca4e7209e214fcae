/*
 * The cluster token (token.h).  The sources are tried in a fixed order so
 * that one deployment can hand every process the same secret whichever
 * way it prefers: a parameter, the environment, a file (a Kubernetes
 * secret mount), or SGLang's own variable.
 */
#include "util/token.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <openssl/crypto.h>

static int put(const char *src, size_t n, const char *what, char *out, size_t len,
               char *err, size_t errlen)
{
    if (n > KVF_TOKEN_MAX || n + 1 > len) {
        snprintf(err, errlen, "the token from %s is %zu bytes long; at most %d are "
                 "accepted", what, n, n + 1 > len && len <= KVF_TOKEN_MAX
                                          ? (int)len - 1 : KVF_TOKEN_MAX);
        return -1;
    }
    memcpy(out, src, n);
    out[n] = '\0';
    return 1;
}

static int from_file(const char *path, char *out, size_t len, char *err, size_t errlen)
{
    char buf[KVF_TOKEN_MAX + 2];
    FILE *f = fopen(path, "r");
    if (f == NULL) {
        snprintf(err, errlen, "KVF_AUTH_TOKEN_FILE=%s: cannot open: %s", path,
                 strerror(errno));
        return -1;
    }
    size_t n = fread(buf, 1, sizeof(buf), f);
    int bad = ferror(f);
    fclose(f);
    if (bad) {
        snprintf(err, errlen, "KVF_AUTH_TOKEN_FILE=%s: cannot read", path);
        return -1;
    }
    if (n > 0 && buf[n - 1] == '\n')
        n--;
    if (n > 0 && buf[n - 1] == '\r')
        n--;
    if (n == 0) {
        snprintf(err, errlen, "KVF_AUTH_TOKEN_FILE=%s is empty", path);
        return -1;
    }
    if (memchr(buf, '\0', n) != NULL) {
        snprintf(err, errlen, "KVF_AUTH_TOKEN_FILE=%s holds a NUL byte", path);
        return -1;
    }
    return put(buf, n, "KVF_AUTH_TOKEN_FILE", out, len, err, errlen);
}

int kvf_token_load(const char *explicit_token, char *out, size_t len, char *err,
                   size_t errlen)
{
    const char *v;
    if (out == NULL || len == 0) {
        snprintf(err, errlen, "kvf_token_load: no room for the token");
        return -1;
    }
    if (explicit_token != NULL && explicit_token[0] != '\0')
        return put(explicit_token, strlen(explicit_token), "the engine parameters", out,
                   len, err, errlen);
    if ((v = getenv("KVF_AUTH_TOKEN")) != NULL && v[0] != '\0')
        return put(v, strlen(v), "KVF_AUTH_TOKEN", out, len, err, errlen);
    if ((v = getenv("KVF_AUTH_TOKEN_FILE")) != NULL && v[0] != '\0')
        return from_file(v, out, len, err, errlen);
    if ((v = getenv("SGLANG_DISAGGREGATION_BOOTSTRAP_AUTH_TOKEN")) != NULL && v[0] != '\0')
        return put(v, strlen(v), "SGLANG_DISAGGREGATION_BOOTSTRAP_AUTH_TOKEN", out, len,
                   err, errlen);
    out[0] = '\0';
    return 0;
}

int kvf_token_equal(const char *a, const char *b)
{
    /* The lengths are compared in the open: what a timing attack must not
     * learn is which bytes match, and the comparison below always reads
     * the full length of the longer token's prefix. */
    size_t na = strlen(a), nb = strlen(b);
    if (na != nb)
        return 0;
    return CRYPTO_memcmp(a, b, na) == 0;
}
