/*
 * The cluster token: the one secret every engine and registry of a
 * deployment holds, and the only thing that makes a peer trusted
 * (docs/SECURITY.md).  Loading it, and comparing two of them in constant
 * time.  Depends on nothing but libc and libcrypto.
 */
#ifndef KVF_UTIL_TOKEN_H
#define KVF_UTIL_TOKEN_H

#include <stddef.h>

/* Longest token accepted, in bytes (without the NUL). */
#define KVF_TOKEN_MAX 1024

/* The cluster token: `explicit` if non-NULL and non-empty, else KVF_AUTH_TOKEN, else the contents of KVF_AUTH_TOKEN_FILE (trailing newline stripped), else SGLANG_DISAGGREGATION_BOOTSTRAP_AUTH_TOKEN. @return 1 with the token in out, 0 when none is set, -1 on error (why in err). */
int kvf_token_load(const char *explicit_token, char *out, size_t len, char *err, size_t errlen);
/* Constant-time equality of two NUL-terminated tokens. */
int kvf_token_equal(const char *a, const char *b);

#endif /* KVF_UTIL_TOKEN_H */
