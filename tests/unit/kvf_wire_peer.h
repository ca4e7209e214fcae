/*
 * A hand-written peer's side of the wire protocol, for tests that play an
 * engine (or a stranger) on a plain socket through the codec: read and
 * write whole frames, and run the authenticated handshake (AUTH, then
 * AUTH_PROOF in the order the real engines use) with a token of the
 * test's choosing.  Header-only, like kvf_test.h.
 */
#ifndef KVF_WIRE_PEER_H
#define KVF_WIRE_PEER_H

#include <poll.h>
#include <stdint.h>
#include <string.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <unistd.h>

#include "core/auth.h"
#include "util/buf.h"
#include "util/time.h"
#include "util/token.h"
#include "wire/wire.h"

/* Exactly n bytes, or 0 after timeout_ms (or at EOF / error). */
static inline int wp_read(int fd, uint8_t *p, size_t n, unsigned timeout_ms)
{
    uint64_t until = kvf_now_ms() + timeout_ms;
    while (n > 0) {
        struct pollfd pfd = {fd, POLLIN, 0};
        uint64_t now = kvf_now_ms();
        if (now >= until || poll(&pfd, 1, (int)(until - now)) < 0)
            return 0;
        if (!(pfd.revents & (POLLIN | POLLHUP | POLLERR)))
            continue;
        ssize_t got = recv(fd, p, n, 0);
        if (got <= 0)
            return 0;
        p += got;
        n -= (size_t)got;
    }
    return 1;
}

/* Wait for EOF (or a reset) on fd: 1 if it came within timeout_ms with no
 * byte before it, 0 otherwise. */
static inline int wp_closed(int fd, unsigned timeout_ms)
{
    uint8_t b;
    struct pollfd pfd = {fd, POLLIN, 0};
    if (poll(&pfd, 1, (int)timeout_ms) != 1)
        return 0;
    return recv(fd, &b, 1, 0) <= 0;
}

/* The next frame, decoded into m (its strings point into body, of cap
 * bytes).  @return the frame's type, or 0 (EOF, timeout, garbage). */
static inline int wp_recv(int fd, kvf_msg_t *m, uint8_t *body, size_t cap,
                          unsigned timeout_ms)
{
    uint8_t h[KVF_WIRE_HDR_LEN];
    kvf_wire_hdr_t hdr;
    char err[256];
    if (!wp_read(fd, h, sizeof(h), timeout_ms) ||
        kvf_wire_parse_header(h, &hdr, err, sizeof(err)) != KVF_OK || hdr.length > cap ||
        !wp_read(fd, body, hdr.length, timeout_ms) ||
        kvf_wire_decode(&hdr, body, m, err, sizeof(err)) != KVF_OK)
        return 0;
    return hdr.type;
}

/* The next frame of `type`, the others skipped (a DATA frame's payload,
 * at most 64 KiB, read and dropped), decoded into m as wp_recv does.
 * @return 1, or 0 (EOF, timeout, garbage, a larger payload). */
static inline int wp_expect(int fd, uint8_t type, kvf_msg_t *m, uint8_t *body, size_t cap,
                            unsigned timeout_ms)
{
    for (;;) {
        int t = wp_recv(fd, m, body, cap, timeout_ms);
        if (t == 0)
            return 0;
        if (t == KVF_MSG_DATA) {
            static uint8_t sink[1 << 16];
            if (m->u.data.payload_len > sizeof(sink) ||
                !wp_read(fd, sink, m->u.data.payload_len, timeout_ms))
                return 0;
        }
        if (t == type)
            return 1;
    }
}

/* Send one frame (and a DATA payload).  @return 1 if all of it went. */
static inline int wp_send(int fd, const kvf_msg_t *m, const uint8_t *payload, size_t n)
{
    kvf_buf_t b;
    kvf_buf_init(&b);
    int ok = kvf_wire_encode(&b, m) == KVF_OK && kvf_buf_append(&b, payload, n) == KVF_OK &&
             send(fd, b.data, b.len, MSG_NOSIGNAL) == (ssize_t)b.len;
    kvf_buf_free(&b);
    return ok;
}

/* The token an engine in this process would load (none: ""). */
static inline const char *wp_engine_token(void)
{
    static char tok[KVF_TOKEN_MAX + 1];
    char err[256];
    if (kvf_token_load(NULL, tok, sizeof(tok), err, sizeof(err)) != 1)
        tok[0] = '\0';
    return tok;
}

/* Our AUTH, as the engines make it. */
static inline kvf_msg_t wp_auth_msg(kvf_role_t role, const char *token)
{
    kvf_msg_t m = {.type = KVF_MSG_AUTH};
    m.u.auth.magic = KVF_WIRE_MAGIC;
    m.u.auth.version = KVF_WIRE_VERSION;
    m.u.auth.role = (uint8_t)role;
    m.u.auth.flags = token[0] ? KVF_AUTH_F_TOKEN : 0;
    m.u.auth.instance_id = 0x5eed0000u ^ (uint64_t)getpid();
    m.u.auth.pid = (uint32_t)getpid();
    if (getrandom(m.u.auth.nonce, sizeof(m.u.auth.nonce), 0) != sizeof(m.u.auth.nonce))
        memset(m.u.auth.nonce, 0x5a, sizeof(m.u.auth.nonce));
    return m;
}

/*
 * Authenticate on fd with `token` as a `role` engine that connected
 * (connected = 1: proves first) or accepted (checks the peer's proof
 * first).  theirs_p: the peer's AUTH.  @return 1 once both proofs
 * checked; 0 if the peer's proof is wrong or the connection ended.
 */
static inline int wp_authenticate_flags(int fd, const char *token, kvf_role_t role,
                                        int connected, uint8_t flags,
                                        kvf_msg_auth_t *theirs_p)
{
    uint8_t body[256];
    kvf_msg_t mine = wp_auth_msg(role, token), m, proof = {.type = KVF_MSG_AUTH_PROOF};
    mine.u.auth.flags |= flags;
    uint8_t want[KVF_WIRE_MAC_LEN];
    if (!wp_send(fd, &mine, NULL, 0) ||
        wp_recv(fd, &m, body, sizeof(body), 5000) != KVF_MSG_AUTH)
        return 0;
    kvf_msg_auth_t theirs = m.u.auth;
    kvf__auth_mac(token, connected, &mine.u.auth, &theirs, proof.u.proof.mac);
    kvf__auth_mac(token, !connected, &theirs, &mine.u.auth, want);
    if (connected && !wp_send(fd, &proof, NULL, 0))
        return 0;
    if (wp_recv(fd, &m, body, sizeof(body), 5000) != KVF_MSG_AUTH_PROOF ||
        memcmp(m.u.proof.mac, want, sizeof(want)) != 0)
        return 0;
    if (!connected && !wp_send(fd, &proof, NULL, 0))
        return 0;
    if (theirs_p != NULL)
        *theirs_p = theirs;
    return 1;
}

/* The same, with no extra AUTH flags (KVF_AUTH_F_JOIN: an extra stream). */
static inline int wp_authenticate(int fd, const char *token, kvf_role_t role, int connected,
                                  kvf_msg_auth_t *theirs_p)
{
    return wp_authenticate_flags(fd, token, role, connected, 0, theirs_p);
}

#endif /* KVF_WIRE_PEER_H */
