/*
 * Peer authentication: only a holder of the cluster token sees an offer,
 * a memory handle or a room.
 *
 * Every connection opens with AUTH from both sides at once (who it is and
 * a fresh 32-byte nonce), then each proves it holds the token with an
 * HMAC-SHA256 over both AUTHs (kvf__auth_mac).  The side that accepted
 * sends its proof only after it has checked the connecting side's, so a
 * stranger who connects learns nothing but our AUTH; the side that
 * connected proves itself first (it chose to talk to that address), and
 * sends nothing else before the acceptor's proof checks.  The label in
 * the MAC names the prover's direction, so a proof reflected back to the
 * side that made it does not check, and the nonces make every proof good
 * for one connection only.
 *
 * Without a token every engine's key is empty: the exchange is the same
 * (one protocol), proves nothing, and protected mode (loopback peers only)
 * stands in for it.
 *
 * A stranger's connection never reaches a room, and costs a few KiB: until
 * the peer has proved itself, its connection lets through only AUTH and
 * AUTH_PROOF frames no larger than they are, checked at each header
 * before any body is read (kvf_rx_limit_t); peer.c hands every message of
 * an unauthenticated peer here all the same.  Refusals are counted and
 * logged once per address and minute, so that a scanner cannot fill the
 * log.
 *
 * No I/O here, and no call into peer.c: each event of the handshake is one
 * call that updates the peer's kvf_auth_t and says in a kvf_auth_step_t
 * what to do (the receive limit, the frame to send, a verdict, whether the
 * peer is now trusted); peer.c does it (auth.h).  The peer's code stays
 * off the stack while the handshake decides, and the handshake reads the
 * same in a test that plays the peer.
 */
#include "core/auth.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <unistd.h>

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>

#include "core/peer.h"    /* kvf_peer_t's fields only: auth.c calls nothing of peer.c */
#include "util/log.h"
#include "util/time.h"

#define LABEL_CONNECTOR "kvferry-auth-v2 connector"
#define LABEL_ACCEPTOR  "kvferry-auth-v2 acceptor"
#define PARTY_LEN       (1 + 8 + 4 + KVF_WIRE_NONCE_LEN)

_Static_assert(KVF_WIRE_MAX_AUTH_BODY >= KVF_WIRE_AUTH_LEN &&
               KVF_WIRE_MAX_AUTH_BODY >= KVF_WIRE_MAC_LEN, "the handshake's frames fit");

/* What a peer may send before it has authenticated. */
static const kvf_rx_limit_t unauth_limit = {
    .types = 1u << KVF_MSG_AUTH | 1u << KVF_MSG_AUTH_PROOF,
    .max_body = KVF_WIRE_MAX_AUTH_BODY,
    .why = "before authenticating",
};

static const char *how_to_set =
    "set the same token on every engine and registry of the cluster: KVF_AUTH_TOKEN=<secret>, "
    "or KVF_AUTH_TOKEN_FILE=<path>, or SGLANG_DISAGGREGATION_BOOTSTRAP_AUTH_TOKEN, or "
    "kvf_engine_params_t.auth_token";

static size_t put_party(uint8_t *b, const kvf_msg_auth_t *a)
{
    b[0] = a->role;
    kvf_put_u64(b + 1, a->instance_id);
    kvf_put_u32(b + 9, a->pid);
    memcpy(b + 13, a->nonce, KVF_WIRE_NONCE_LEN);
    return PARTY_LEN;
}

void kvf__auth_mac(const char *token, int prover_connected, const kvf_msg_auth_t *prover,
                   const kvf_msg_auth_t *verifier, uint8_t mac[KVF_WIRE_MAC_LEN])
{
    const char *label = prover_connected ? LABEL_CONNECTOR : LABEL_ACCEPTOR;
    uint8_t buf[sizeof(LABEL_CONNECTOR) + 2 * PARTY_LEN];
    size_t n = strlen(label) + 1;          /* the label and its NUL */
    memcpy(buf, label, n);
    n += put_party(buf + n, prover);
    n += put_party(buf + n, verifier);
    unsigned len = KVF_WIRE_MAC_LEN;
    static const unsigned char empty_key[1];
    size_t klen = strlen(token);
    if (HMAC(EVP_sha256(), klen ? (const void *)token : empty_key, (int)klen, buf, n, mac,
             &len) == NULL || len != KVF_WIRE_MAC_LEN) {
        /* Cannot happen with a working libcrypto; a proof of zeros
         * checks against nothing a peer computes. */
        kvf_error("HMAC-SHA256 failed in libcrypto");
        memset(mac, 0, KVF_WIRE_MAC_LEN);
    }
}

int kvf__auth_is_loopback(const struct sockaddr *sa)
{
    if (sa->sa_family == AF_INET) {
        const struct sockaddr_in *in = (const struct sockaddr_in *)sa;
        return (ntohl(in->sin_addr.s_addr) >> 24) == 127;
    }
    if (sa->sa_family == AF_INET6) {
        const struct in6_addr *a = &((const struct sockaddr_in6 *)sa)->sin6_addr;
        return IN6_IS_ADDR_LOOPBACK(a) || (IN6_IS_ADDR_V4MAPPED(a) && a->s6_addr[12] == 127);
    }
    return sa->sa_family == AF_UNIX;
}

static void host_of(const struct sockaddr *sa, char *buf, size_t len)
{
    const void *a = sa->sa_family == AF_INET
                        ? (const void *)&((const struct sockaddr_in *)sa)->sin_addr
                        : (const void *)&((const struct sockaddr_in6 *)sa)->sin6_addr;
    if ((sa->sa_family != AF_INET && sa->sa_family != AF_INET6) ||
        inet_ntop(sa->sa_family, a, buf, (socklen_t)len) == NULL)
        snprintf(buf, len, "(unknown address)");
}

int kvf__auth_setup_unlocked(kvf_engine_t *eng, const char *explicit_token,
                    const char *api_key, const struct sockaddr *bound)
{
    char err[256];
    if (kvf_token_resolve(explicit_token, api_key, eng->token, sizeof(eng->token),
                          NULL, err, sizeof(err)) != KVF_OK) {
        kvf_error("cluster token: %s", err);
        return KVF_ERR_INVALID_PARAM;
    }
    eng->has_token = eng->token[0] != '\0';
    int none = kvf_auth_open();
    if (eng->has_token) {
        if (none)
            kvf_warn("KVF_AUTH=none is ignored: a cluster token is set, and every peer "
                     "must prove it holds it");
        return KVF_OK;
    }
    eng->auth_open = none;
    if (none) {
        kvf_warn("KVF_AUTH=none: no cluster token, and peers from any address are "
                 "accepted: any process that can reach %s can read and overwrite KV cache "
                 "and fail rooms; %s", eng->host, how_to_set);
        return KVF_OK;
    }
    if (!kvf__auth_is_loopback(bound)) {
        kvf_error("refusing to listen on %s without a cluster token: any process that can "
                  "reach that address could read and overwrite KV cache (users' prompts) "
                  "and fail rooms. To fix, %s; or listen on 127.0.0.1. KVF_AUTH=none turns "
                  "this protection off.", eng->host, how_to_set);
        return KVF_ERR_INVALID_PARAM;
    }
    return KVF_OK;
}

/* The slot that logs `host`'s refusals: its own, a free one, one not used
 * for a minute, or (every slot busy) the one for all other addresses. */
static kvf_auth_log_t *log_slot(kvf_engine_t *eng, const char *host, uint64_t now)
{
    kvf_auth_log_t *oldest = &eng->auth_log[0];
    for (int i = 0; i < KVF_AUTH_LOG_SLOTS; i++) {
        kvf_auth_log_t *s = &eng->auth_log[i];
        if (s->host[0] != '\0' && strcmp(s->host, host) == 0)
            return s;
        if (s->last_ms < oldest->last_ms)
            oldest = s;
    }
    /* A slot whose address was logged within the minute keeps it, or that
     * address would be logged again: many addresses share one line. */
    if (oldest->last_ms != 0 && now - oldest->last_ms < KVF_AUTH_LOG_MS)
        return &eng->auth_log_rest;
    snprintf(oldest->host, sizeof(oldest->host), "%s", host);
    oldest->last_ms = 0;
    oldest->count = 0;
    return oldest;
}

/* Count a refusal of `host` and log it, at most once per address and
 * KVF_AUTH_LOG_MS (the first refusal of an address is always logged, but
 * for addresses beyond KVF_AUTH_LOG_SLOTS within a minute: those share
 * one line a minute). */
static void log_refusal(kvf_engine_t *eng, const char *host, const char *why)
{
    uint64_t now = kvf_now_ms();
    kvf_auth_log_t *slot = log_slot(eng, host, now);
    eng->auth_refused++;
    if (slot->last_ms != 0 && now - slot->last_ms < KVF_AUTH_LOG_MS) {
        slot->count++;
        return;
    }
    if (slot == &eng->auth_log_rest)
        kvf_warn("refused a connection from %s: %s (and %llu more in the last minute from "
                 "addresses beyond the %d whose refusals are logged one by one; this line "
                 "once a minute)", host, why, (unsigned long long)slot->count,
                 KVF_AUTH_LOG_SLOTS);
    else if (slot->count > 0)
        kvf_warn("refused a connection from %s: %s (and %llu more from that address in "
                 "the last minute)", host, why, (unsigned long long)slot->count);
    else
        kvf_warn("refused a connection from %s: %s (further refusals of that address are "
                 "logged once a minute)", host, why);
    slot->last_ms = now ? now : 1;
    slot->count = 0;
}

int kvf__auth_admit(kvf_engine_t *eng, const struct sockaddr *sa)
{
    KVF_ASSERT_LOCKED(eng);
    char host[64], why[512];
    host_of(sa, host, sizeof(host));
    if (!eng->has_token && !eng->auth_open && !kvf__auth_is_loopback(sa)) {
        snprintf(why, sizeof(why), "protected mode: no cluster token is set, so only peers "
                 "on this host (loopback) are accepted; %s", how_to_set);
        log_refusal(eng, host, why);
        return 0;
    }
    unsigned all = 0, here = 0;
    for (const kvf_peer_t *p = eng->peers; p != NULL; p = p->next) {
        if (p->outbound || p->auth.done || p->state == KVF_PEER_DEAD)
            continue;
        all++;
        here += strcmp(p->remote_host, host) == 0;
    }
    if (here < KVF_MAX_UNAUTH_PER_HOST && all < KVF_MAX_UNAUTH)
        return 1;
    snprintf(why, sizeof(why), "%u connections %s are still authenticating (at most %d "
             "from one address and %d in all; each is closed at its handshake deadline)",
             here < KVF_MAX_UNAUTH_PER_HOST ? all : here,
             here < KVF_MAX_UNAUTH_PER_HOST ? "in all" : "from that address",
             KVF_MAX_UNAUTH_PER_HOST, KVF_MAX_UNAUTH);
    log_refusal(eng, host, why);
    return 0;
}

/* A step that asks for nothing yet. */
static void step_init(kvf_auth_step_t *s)
{
    memset(s, 0, sizeof(*s));
    s->verdict = kvf__verdict_ok();
}

/* The step fails the peer with st and the reason (printf). */
static void step_fail(kvf_auth_step_t *s, kvf_status_t st, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void step_fail(kvf_auth_step_t *s, kvf_status_t st, const char *fmt, ...)
{
    va_list ap;
    s->verdict.st = st;
    va_start(ap, fmt);
    vsnprintf(s->verdict.why, sizeof(s->verdict.why), fmt, ap);
    va_end(ap);
}

void kvf__auth_refuse(const kvf_peer_t *p, const char *reason, kvf_auth_step_t *step_p)
{
    KVF_ASSERT_LOCKED(p->eng);
    char why[384];
    snprintf(why, sizeof(why), "%s", reason);
    step_init(step_p);
    if (!p->outbound) {
        log_refusal(p->eng, p->remote_host, why);
        step_p->quiet = 1;     /* logged above, once per address */
    }
    step_fail(step_p, KVF_ERR_AUTH, "%s", why);
}

void kvf__auth_start(kvf_peer_t *p, kvf_auth_step_t *step_p)
{
    KVF_ASSERT_LOCKED(p->eng);
    kvf_engine_t *eng = p->eng;
    kvf_msg_auth_t a = {
        .magic = KVF_WIRE_MAGIC,
        .version = KVF_WIRE_VERSION,
        .role = (uint8_t)eng->params.role,
        .flags = (eng->has_token ? KVF_AUTH_F_TOKEN : 0) | (p->primary ? KVF_AUTH_F_JOIN : 0),
        .instance_id = eng->instance_id,
        .pid = (uint32_t)getpid(),
    };
    step_init(step_p);
    ssize_t got;
    while ((got = getrandom(a.nonce, sizeof(a.nonce), 0)) < 0 && errno == EINTR)
        ;
    if (got != (ssize_t)sizeof(a.nonce)) {
        step_fail(step_p, KVF_ERR_IO, "getrandom for the handshake nonce: %s",
                  got < 0 ? strerror(errno) : "short read");
        return;
    }
    p->auth.mine = a;
    step_p->set_limit = 1;
    step_p->limit = &unauth_limit;
    step_p->send = 1;
    step_p->msg.type = KVF_MSG_AUTH;
    step_p->msg.u.auth = a;
}

/* The step sends our proof. */
static void send_proof(kvf_peer_t *p, kvf_auth_step_t *s)
{
    s->send = 1;
    s->msg.type = KVF_MSG_AUTH_PROOF;
    kvf__auth_mac(p->eng->token, p->outbound, &p->auth.mine, &p->auth.theirs, s->msg.u.proof.mac);
    p->auth.proof_sent = 1;
}

/* Why two proofs may disagree, from the (unauthenticated) token flag. */
static const char *mismatch_hint(const kvf_peer_t *p)
{
    int theirs = (p->auth.theirs.flags & KVF_AUTH_F_TOKEN) != 0, mine = p->eng->has_token;
    return theirs && mine  ? "both have a cluster token, and they differ"
           : theirs        ? "it has a cluster token, this engine has none"
           : mine          ? "this engine has a cluster token, it has none"
                           : "neither has a token, yet the proof is wrong: not a kvferry "
                             "engine of this version";
}

void kvf__auth_on_msg(kvf_peer_t *p, const kvf_msg_t *msg, kvf_auth_step_t *step_p)
{
    KVF_ASSERT_LOCKED(p->eng);
    step_init(step_p);
    if (p->auth.done) {
        step_fail(step_p, KVF_ERR_PROTOCOL, "%s after authentication",
                  kvf_wire_type_name((uint8_t)msg->type));
        return;
    }
    if (msg->type == KVF_MSG_AUTH) {
        const kvf_msg_auth_t *a = &msg->u.auth;
        if (p->auth.got_auth) {
            kvf__auth_refuse(p, "second AUTH in one handshake", step_p);
            return;
        }
        if (CRYPTO_memcmp(a->nonce, p->auth.mine.nonce, KVF_WIRE_NONCE_LEN) == 0) {
            kvf__auth_refuse(p, "AUTH with this engine's own nonce (a reflection)", step_p);
            return;
        }
        p->auth.theirs = *a;
        p->auth.got_auth = 1;
        if (p->outbound)
            send_proof(p, step_p);
        return;
    }
    /* AUTH_PROOF */
    if (!p->auth.got_auth) {
        kvf__auth_refuse(p, "AUTH_PROOF before AUTH", step_p);
        return;
    }
    uint8_t want[KVF_WIRE_MAC_LEN];
    kvf__auth_mac(p->eng->token, !p->outbound, &p->auth.theirs, &p->auth.mine, want);
    int ok = CRYPTO_memcmp(want, msg->u.proof.mac, KVF_WIRE_MAC_LEN) == 0;
    OPENSSL_cleanse(want, sizeof(want));
    if (!ok && p->outbound) {
        step_fail(step_p, KVF_ERR_AUTH, "authentication failed: the prefill engine did not "
                  "prove it holds this cluster's token (%s); %s", mismatch_hint(p), how_to_set);
        return;
    }
    if (!ok) {
        char why[128];
        snprintf(why, sizeof(why), "wrong cluster token (%s)", mismatch_hint(p));
        kvf__auth_refuse(p, why, step_p);
        return;
    }
    p->auth.done = 1;
    step_p->set_limit = 1;
    step_p->limit = NULL;          /* trusted: any frame, any size */
    if (!p->outbound)
        send_proof(p, step_p);
    step_p->authenticated = 1;
}

int kvf__auth_explain_close(const kvf_peer_t *p, char *why, size_t len)
{
    KVF_ASSERT_LOCKED(p->eng);
    if (!p->outbound || !p->auth.proof_sent || p->auth.done)
        return 0;
    snprintf(why, len, "authentication failed: the prefill engine closed the connection "
             "after checking this engine's proof, so the two hold different cluster tokens "
             "(%s); %s", mismatch_hint(p), how_to_set);
    return 1;
}
