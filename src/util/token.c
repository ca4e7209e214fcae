/*
 * The cluster token (token.h): where it is read from, what a valid one
 * looks like, and how two are compared without a timing leak.
 *
 * The one idea: every source ends in the same check (check_token), so an
 * explicit value, a variable and a file are held to the same rules, and
 * every refusal names its source.
 */
#include "util/token.h"

#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <openssl/crypto.h>

#include "util/log.h"

__attribute__((format(printf, 3, 4)))
static void set_err(char *err, size_t errlen, const char *fmt, ...)
{
    va_list ap;

    if (err == NULL || errlen == 0)
        return;
    va_start(ap, fmt);
    vsnprintf(err, errlen, fmt, ap);
    va_end(ap);
}

/* Copy a candidate token into out after checking it.  @return KVF_OK or
 * KVF_ERR_INVALID_PARAM with err naming `from`. */
static kvf_status_t check_token(const char *tok, size_t n, const char *from,
                                char *out, size_t len, char *err,
                                size_t errlen)
{
    if (n == 0) {
        set_err(err, errlen, "the token from %s is empty", from);
        return KVF_ERR_INVALID_PARAM;
    }
    if (n > KVF_TOKEN_MAX) {
        set_err(err, errlen, "the token from %s is %zu bytes long; at most %d "
                "are accepted", from, n, KVF_TOKEN_MAX);
        return KVF_ERR_INVALID_PARAM;
    }
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)tok[i];
        if (c <= ' ' || c >= 0x7f) {
            set_err(err, errlen, "the token from %s holds a space, a control "
                    "or a non-ASCII character at byte %zu; use printable "
                    "ASCII without spaces (e.g. the output of 'openssl rand "
                    "-hex 32')", from, i);
            return KVF_ERR_INVALID_PARAM;
        }
    }
    if (len < n + 1) {
        set_err(err, errlen, "no room for the token from %s (%zu bytes; the "
                "buffer holds %zu)", from, n, len);
        return KVF_ERR_INVALID_PARAM;
    }
    if (n < KVF_TOKEN_SHORT)
        kvf_warn("the cluster token from %s is only %zu characters long: a "
                 "short token can be guessed; use at least 32 random "
                 "characters", from, n);
    memcpy(out, tok, n);
    out[n] = '\0';
    return KVF_OK;
}

/* KVF_AUTH_TOKEN_FILE: its permissions, then up to cap bytes of it. */
static kvf_status_t read_file(const char *path, char *buf, size_t cap, size_t *n_p,
                              char *err, size_t errlen)
{
    struct stat sb;
    int fd = open(path, O_RDONLY | O_CLOEXEC);

    if (fd < 0) {
        set_err(err, errlen, "KVF_AUTH_TOKEN_FILE=%s cannot be opened: %s",
                path, strerror(errno));
        return KVF_ERR_IO;
    }
    if (fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode)) {
        set_err(err, errlen, "KVF_AUTH_TOKEN_FILE=%s is not a regular file",
                path);
        close(fd);
        return KVF_ERR_IO;
    }
    /* Like ssh with its keys: a secret others can read is no secret, and
     * one others can write is not ours.  Group-readable is common where a
     * pod's fsGroup owns mounted secrets, so that one only warns. */
    if (sb.st_mode & (S_IROTH | S_IWOTH | S_IWGRP)) {
        set_err(err, errlen, "KVF_AUTH_TOKEN_FILE=%s has mode %04o: other "
                "users may read or change it; run 'chmod 600 %s' (Kubernetes: "
                "defaultMode: 0400 on the secret volume)", path,
                (unsigned)(sb.st_mode & 07777), path);
        close(fd);
        return KVF_ERR_INVALID_PARAM;
    }
    if (sb.st_mode & S_IRGRP)
        kvf_warn("KVF_AUTH_TOKEN_FILE=%s is readable by its group (mode "
                 "%04o); 0600 keeps the token to its owner", path,
                 (unsigned)(sb.st_mode & 07777));
    size_t n = 0;
    for (;;) {
        ssize_t r = read(fd, buf + n, cap - n);
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0) {
            set_err(err, errlen, "KVF_AUTH_TOKEN_FILE=%s cannot be read: %s",
                    path, strerror(errno));
            close(fd);
            return KVF_ERR_IO;
        }
        if (r == 0 || (n += (size_t)r) == cap)
            break;
    }
    close(fd);
    *n_p = n;
    return KVF_OK;
}

/* The file's bytes pass through buf on the stack: wiped before return. */
static kvf_status_t load_file(const char *path, char *out, size_t len,
                              const char *from, char *err, size_t errlen)
{
    char buf[KVF_TOKEN_MAX + 3];
    size_t n = 0;
    kvf_status_t st = read_file(path, buf, sizeof(buf), &n, err, errlen);
    if (st == KVF_OK) {
        /* One trailing newline (LF or CRLF), as `echo` and editors leave it. */
        if (n > 0 && buf[n - 1] == '\n')
            n--;
        if (n > 0 && buf[n - 1] == '\r')
            n--;
        st = check_token(buf, n, from, out, len, err, errlen);
    }
    OPENSSL_cleanse(buf, sizeof(buf));
    return st;
}

kvf_status_t kvf_token_load_ex(const char *explicit_token, char *out,
                               size_t len, const char **from_p, char *err,
                               size_t errlen)
{
    return kvf_token_resolve(explicit_token, NULL, out, len, from_p, err,
                             errlen);
}

kvf_status_t kvf_token_resolve(const char *explicit_token, const char *api_key,
                               char *out, size_t len, const char **from_p,
                               char *err, size_t errlen)
{
    static _Thread_local char from_file[96];
    const char *v, *from = "";
    kvf_status_t st = KVF_OK;

    if (out == NULL || len == 0) {
        set_err(err, errlen, "kvf_token_load: no output buffer");
        return KVF_ERR_INVALID_PARAM;
    }
    out[0] = '\0';
    if (explicit_token != NULL && explicit_token[0] != '\0') {
        from = "the explicit value";
        st = check_token(explicit_token, strlen(explicit_token), from, out,
                         len, err, errlen);
    } else if ((v = getenv("KVF_AUTH_TOKEN")) != NULL && v[0] != '\0') {
        from = "KVF_AUTH_TOKEN";
        st = check_token(v, strlen(v), from, out, len, err, errlen);
    } else if ((v = getenv("KVF_AUTH_TOKEN_FILE")) != NULL && v[0] != '\0') {
        snprintf(from_file, sizeof(from_file), "KVF_AUTH_TOKEN_FILE (%s)", v);
        from = from_file;
        st = load_file(v, out, len, from, err, errlen);
    } else if ((v = getenv("SGLANG_DISAGGREGATION_BOOTSTRAP_AUTH_TOKEN")) !=
                   NULL && v[0] != '\0') {
        from = "SGLANG_DISAGGREGATION_BOOTSTRAP_AUTH_TOKEN";
        st = check_token(v, strlen(v), from, out, len, err, errlen);
    } else if (api_key != NULL && api_key[0] != '\0') {
        /* SGLang's own order (bootstrap_auth.py): its variable, then the
         * server's --api-key. */
        from = "the API key (--api-key)";
        st = check_token(api_key, strlen(api_key), from, out, len, err,
                         errlen);
    }
    if (st != KVF_OK) {
        out[0] = '\0';
        from = "";
    }
    if (from_p != NULL)
        *from_p = from;
    return st;
}

kvf_status_t kvf_token_load(const char *explicit_token, char *out, size_t len,
                            char *err, size_t errlen)
{
    return kvf_token_load_ex(explicit_token, out, len, NULL, err, errlen);
}

kvf_status_t kvf_auth_token_resolve(const char *api_key, char *token,
                                    size_t len, char *source,
                                    size_t source_len)
{
    char err[512];
    const char *from = "";

    if (source != NULL && source_len > 0)
        source[0] = '\0';
    if (token == NULL || len == 0) {
        kvf_error("kvf_auth_token_resolve: no buffer for the token");
        return KVF_ERR_INVALID_PARAM;
    }
    kvf_status_t st = kvf_token_resolve(NULL, api_key, token, len, &from, err,
                                        sizeof(err));
    if (st != KVF_OK) {
        kvf_error("cluster token: %s", err);
        return st;
    }
    if (source != NULL && source_len > 0)
        snprintf(source, source_len, "%s", from);
    return KVF_OK;
}

int kvf_token_equal(const char *a, const char *b)
{
    if (a == NULL || b == NULL)
        return 0;
    size_t la = strlen(a), lb = strlen(b);
    /* The lengths are not secret enough to hide (every token of a cluster
     * has the same one); the bytes are compared in constant time. */
    if (la != lb || la == 0)
        return 0;
    return CRYPTO_memcmp(a, b, la) == 0;
}

int kvf_auth_open(void)
{
    const char *v = getenv("KVF_AUTH");

    if (v == NULL || v[0] == '\0')
        return 0;
    if (strcmp(v, "none") == 0)
        return 1;
    kvf_warn("KVF_AUTH=%.32s is not understood (the only value is \"none\", "
             "which turns authentication off); ignoring it", v);
    return 0;
}
