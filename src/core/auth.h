/*
 * Peer authentication, internal (auth.c): the challenge-response every
 * connection starts with, protected mode, and the once-per-address log of
 * what was refused.  docs/SECURITY.md and docs/PROTOCOL.md section 4.
 *
 * The handshake is a state machine without I/O, as TLS libraries and QUIC
 * stacks keep theirs: each event (start, a frame, a refusal) is one call
 * that updates the peer's kvf_auth_t and fills a kvf_auth_step_t; peer.c
 * does what the step says (sets the receive limit, sends, fails or goes
 * on).  auth.c decides and calls nothing of peer.c, so the two files call
 * each other one way (tests/structure/one_way.sh).
 */
#ifndef KVF_CORE_AUTH_H
#define KVF_CORE_AUTH_H

#include <stdint.h>
#include <sys/socket.h>

#include "core/verdict.h"
#include "transport/transport.h"
#include "util/token.h"
#include "wire/wire.h"

/* kvferry.h's kvf_engine_t and peer.h's kvf_peer_t, named by their
 * structs: peer.h includes this header (through engine.h). */
struct kvf_engine;
struct kvf_peer;

/* One peer's side of the handshake (in kvf_peer_t). */
typedef struct kvf_auth {
    kvf_msg_auth_t mine;       /* the AUTH we sent (our nonce) */
    kvf_msg_auth_t theirs;     /* the peer's, once got_auth */
    int            got_auth;
    int            proof_sent; /* our AUTH_PROOF was handed out to send (a send that
                                  fails fails the peer) */
    int            done;       /* the peer's proof checked: it is trusted */
} kvf_auth_t;

/* Connections still authenticating, at most: from one address, and in
 * all.  Each is closed at its handshake deadline; past these, new ones
 * are refused at once, so a flood of idle connections cannot exhaust the
 * engine's descriptors and memory (docs/SECURITY.md). */
#define KVF_MAX_UNAUTH_PER_HOST 128
#define KVF_MAX_UNAUTH          1024

/* Addresses whose refusals were logged recently (in kvf_engine_t). */
#define KVF_AUTH_LOG_SLOTS 64
#define KVF_AUTH_LOG_MS    60000   /* one line per address per minute */

typedef struct kvf_auth_log {
    char     host[64];
    uint64_t last_ms;
    uint64_t count;            /* refused since the last line */
} kvf_auth_log_t;

/*
 * Engine create: load the token (params->auth_token, else the environment,
 * else params->api_key: util/token.h) and decide whether the listener may
 * face the network.  `bound` is the listener's address.  @return KVF_OK, KVF_ERR_INVALID_PARAM (no token on
 * a non-loopback address without KVF_AUTH=none; a token that cannot be
 * read), with the reason logged.
 */
int          kvf__auth_setup_unlocked(struct kvf_engine *eng, const char *explicit_token,
                             const char *api_key, const struct sockaddr *bound);

/* Is this address on the loopback interface (127.0.0.0/8, ::1, v4-mapped)? */
int          kvf__auth_is_loopback(const struct sockaddr *sa);

/* Accept: may a connection from `sa` go on to the handshake?  Protected
 * mode refuses all but loopback, and past the bounds on connections still
 * authenticating every one is refused (counted, logged once per address). */
int          kvf__auth_admit(struct kvf_engine *eng, const struct sockaddr *sa);

/*
 * What the handshake asks of its peer after one event.  peer.c does it in
 * this order: with a verdict other than KVF_OK, fails the peer with it and
 * does nothing else (the rest is not set); else sets the connection's
 * receive limit, sends msg, and then, the peer still alive, lets its
 * handshake go on (HELLO, or a stream's JOIN).  A send that fails fails
 * the peer with "cannot send AUTH: ..." or "cannot send AUTH_PROOF: ...".
 */
typedef struct kvf_auth_step {
    kvf_verdict_t         verdict;
    int                   quiet;     /* the verdict is a refusal, counted and
                                        logged here: fail the peer quietly */
    int                   set_limit; /* set the receive limit to `limit` */
    const kvf_rx_limit_t *limit;     /* NULL: none (the peer is trusted) */
    int                   send;      /* send msg: our AUTH or AUTH_PROOF */
    kvf_msg_t             msg;       /* self-contained: no pointers */
    int                   authenticated; /* the peer proved it holds the token */
} kvf_auth_step_t;

/* A new connection, either side: our AUTH is its first frame. */
void         kvf__auth_start(struct kvf_peer *p, kvf_auth_step_t *step_p);
/* AUTH or AUTH_PROOF from the peer. */
void         kvf__auth_on_msg(struct kvf_peer *p, const kvf_msg_t *msg,
                              kvf_auth_step_t *step_p);
/* Refuse a peer that has not authenticated, for `why` (peer.c's reasons:
 * a frame before the handshake finished, its deadline, garbage): an
 * inbound one is counted and logged once per address, and the step fails
 * it quietly. */
void         kvf__auth_refuse(const struct kvf_peer *p, const char *why,
                              kvf_auth_step_t *step_p);
/* The connection closed before the peer authenticated: what to tell its
 * rooms (an outbound peer's), as status and reason.  @return 1 when the
 * close is best explained by a token mismatch. */
int          kvf__auth_explain_close(const struct kvf_peer *p, char *why, size_t len);

/*
 * The proof a side sends: HMAC-SHA256 under the token over
 *   label || 0x00 || prover's (role, instance_id, pid, nonce) ||
 *   verifier's (role, instance_id, pid, nonce)
 * with label "kvferry-auth-v2 connector" or "kvferry-auth-v2 acceptor" for
 * the side that connected or accepted (integers little-endian: u8, u64,
 * u32, 32 bytes).  Exposed for the tests that play a peer.
 */
void         kvf__auth_mac(const char *token, int prover_connected,
                           const kvf_msg_auth_t *prover, const kvf_msg_auth_t *verifier,
                           uint8_t mac[KVF_WIRE_MAC_LEN]);

#endif /* KVF_CORE_AUTH_H */
