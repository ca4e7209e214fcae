/*
 * The cluster token: one shared secret that every process of a
 * prefill/decode deployment holds, and that the bootstrap registry (and,
 * later, the engine handshake) asks for before it lets a client change
 * anything.
 *
 * Where it comes from, first match wins:
 *   1. an explicit value (a parameter; "" and NULL count as not given),
 *   2. KVF_AUTH_TOKEN,
 *   3. KVF_AUTH_TOKEN_FILE: the file's contents, trailing CR/LF stripped;
 *      a world-readable or group/world-writable file is refused, a
 *      group-readable one is used with a warning,
 *   4. SGLANG_DISAGGREGATION_BOOTSTRAP_AUTH_TOKEN, the variable SGLang's
 *      bootstrap server and its prefill ranks read, so a kvferry registry
 *      or engine launched by SGLang's scripts shares SGLang's token,
 *   5. an API key the caller passes in (SGLang's --api-key, which SGLang
 *      falls back to after its variable): kvf_token_resolve() only.
 * This is the one place that decides; the Python adapters ask it
 * (kvf_auth_token_resolve) instead of reading the variables themselves.
 *
 * A token is 1..KVF_TOKEN_MAX printable ASCII characters without spaces (it
 * travels in an "Authorization: Bearer" header).  Nothing here logs the
 * token itself.  Depends on nothing but libc and libcrypto.
 */
#ifndef KVF_UTIL_TOKEN_H
#define KVF_UTIL_TOKEN_H

#include <stddef.h>

#include "kvferry/kvferry.h"

#define KVF_TOKEN_MAX 512            /* bytes, without the NUL */
#define KVF_TOKEN_SHORT 16           /* shorter than this: a warning */

/*
 * Load the cluster token into out (len bytes, at least KVF_TOKEN_MAX + 1 to
 * hold any token).  Reads the environment and possibly a file: call it at
 * setup, not per request.
 *
 * @param [in]  explicit_token  a value that wins over the environment, or NULL
 * @param [out] out             the token, or "" when none is configured
 * @param [out] from_p          optional: where it came from ("the explicit
 *                              value", "KVF_AUTH_TOKEN", "KVF_AUTH_TOKEN_FILE
 *                              (/path)" ...; static or thread-local text,
 *                              valid until the next call on this thread),
 *                              "" when none
 * @return KVF_OK (out may be "": no token anywhere);
 *         KVF_ERR_INVALID_PARAM (a token that is empty after stripping,
 *         too long, or holds spaces or control characters; a token file
 *         that others may read or write; out too small);
 *         KVF_ERR_IO (KVF_AUTH_TOKEN_FILE cannot be read).
 *         On error err says which source and what to do; out is "".
 */
kvf_status_t kvf_token_load_ex(const char *explicit_token, char *out,
                               size_t len, const char **from_p, char *err,
                               size_t errlen);

/*
 * kvf_token_load_ex() with a last source: `api_key` (NULL or "": none),
 * used when neither the explicit value nor any variable gives a token.
 * Its "from" is "the API key (--api-key)".
 */
kvf_status_t kvf_token_resolve(const char *explicit_token, const char *api_key,
                               char *out, size_t len, const char **from_p,
                               char *err, size_t errlen);

/* kvf_token_load_ex() without from_p. */
kvf_status_t kvf_token_load(const char *explicit_token, char *out, size_t len,
                            char *err, size_t errlen);

/*
 * 1 when a and b are the same token, else 0; NULL equals nothing.  The time
 * it takes depends on the lengths only, never on where the bytes differ
 * (OpenSSL's CRYPTO_memcmp over the presented length).
 */
int kvf_token_equal(const char *a, const char *b);

/*
 * 1 when KVF_AUTH=none asks for an open registry (no token, mutating
 * requests from any address), else 0.  Any other non-empty value of
 * KVF_AUTH is ignored with a warning.
 */
int kvf_auth_open(void);

#endif /* KVF_UTIL_TOKEN_H */
