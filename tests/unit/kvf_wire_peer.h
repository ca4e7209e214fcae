/*
 * A hand-written peer's side of the wire protocol, for tests that play an
 * engine (or a stranger) on a plain socket through the codec: read and
 * write whole frames, run the authenticated handshake (AUTH, then
 * AUTH_PROOF in the order the real engines use) with a token of the
 * test's choosing, and (wp_peer_t) be a whole played engine: listen on a
 * free port or dial a real engine, register in a registry, say a HELLO
 * built from a small layout description, and remember the instance and
 * aux slot of each ROOM_REQ it hears, which its frames for the room must
 * name.  The one idea: a test writes only the frames it means to test;
 * the handshake around them is the engines' own.  Header-only, like
 * kvf_test.h.
 */
#ifndef KVF_WIRE_PEER_H
#define KVF_WIRE_PEER_H

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <unistd.h>

#include "bootstrap/bootstrap.h"
#include "core/auth.h"
#include "kvferry/kvferry.h"
#include "unit/kvf_test.h"
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

/* ---- sockets to engines ------------------------------------------------ */

/* The port of an engine's control listener. */
static inline int port_of(kvf_engine_t *eng)
{
    char addr[64];
    CHECK_EQ_INT(kvf_engine_address(eng, addr, sizeof(addr)), KVF_OK);
    return atoi(strrchr(addr, ':') + 1);
}

/* A blocking connection to 127.0.0.1:port, or -1.  Frames go out as
 * written (the engines do the same), not held back for the peer's
 * delayed acknowledgement. */
static inline int dial(int port)
{
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    inet_pton(AF_INET, "127.0.0.1", &sa.sin_addr);
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0), one = 1;
    if (fd >= 0)
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    if (fd >= 0 && connect(fd, (struct sockaddr *)&sa, sizeof(sa)) != 0) {
        close(fd);
        fd = -1;
    }
    return fd;
}

/* ---- a played engine ------------------------------------------------------ */

/* The layout a played engine announces in its HELLO: num_kv buffers of
 * `pages` pages (K and V of each layer in turn, tagged so), each page
 * page * hpr heads of head_b bytes; one aux buffer; one plain state
 * buffer of 8-byte items if state_slots; rank tp_rank of tp_size. */
typedef struct wp_layout {
    uint32_t page, pages, layers, num_kv, hpr, total_heads, head_b;
    uint32_t aux_b, slots, state_slots;
    uint32_t tp_rank, tp_size;
    uint8_t  kv_order;         /* KVF_KV_NHD (0) unless set */
    uint64_t instance_id;      /* 0: one made of the port */
} wp_layout_t;

typedef struct wp_peer {
    int         lfd, fd, port;
    wp_layout_t lay;
    uint64_t    inst[256];     /* per room id % 256: its ROOM_REQ's instance */
    uint32_t    aux_slot[256]; /* and aux slot */
    uint8_t     body[1 << 16];
} wp_peer_t;

/* f listens on a free loopback port (f->port). */
static inline void wp_listen(wp_peer_t *f)
{
    struct sockaddr_in sa = {.sin_family = AF_INET};
    socklen_t len = sizeof(sa);
    inet_pton(AF_INET, "127.0.0.1", &sa.sin_addr);
    f->lfd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    CHECK(f->lfd >= 0 && bind(f->lfd, (struct sockaddr *)&sa, sizeof(sa)) == 0 &&
          listen(f->lfd, 4) == 0);
    getsockname(f->lfd, (struct sockaddr *)&sa, &len);
    f->port = ntohs(sa.sin_port);
    f->fd = -1;
}

/* Register f's listener in the registry at bs as prefill rank
 * f->lay.tp_rank of f->lay.tp_size. */
static inline void wp_register(const wp_peer_t *f, const char *bs)
{
    char err[256];
    kvf_bs_reg_t reg = {
        .attn_tp_size = (int)f->lay.tp_size, .attn_tp_rank = (int)f->lay.tp_rank,
        .attn_cp_size = 1, .attn_dp_size = 1, .pp_size = 1, .system_dp_size = 1,
        .rank_ip = "127.0.0.1", .rank_port = f->port, .page_size = (int)f->lay.page,
        .kv_cache_dtype = "bfloat16",
    };
    CHECK_EQ_INT(kvf__bs_register(bs, &reg, 3000, err, sizeof(err)), KVF_OK);
}

/* Take the next connection to f's listener (5 s at most). */
static inline void wp_accept(wp_peer_t *f)
{
    struct pollfd pfd = {f->lfd, POLLIN, 0};
    CHECK(poll(&pfd, 1, 5000) == 1);
    f->fd = accept4(f->lfd, NULL, NULL, SOCK_CLOEXEC);
    CHECK(f->fd >= 0);
}

/* Connect f to a real engine's control port (f->port: our own end's). */
static inline void wp_connect(wp_peer_t *f, kvf_engine_t *eng)
{
    struct sockaddr_in me;
    socklen_t ml = sizeof(me);
    f->lfd = -1;
    f->fd = dial(port_of(eng));
    CHECK(f->fd >= 0);
    getsockname(f->fd, (struct sockaddr *)&me, &ml);
    f->port = ntohs(me.sin_port);
}

static inline void wp_close(wp_peer_t *f)
{
    if (f->fd >= 0)
        close(f->fd);
    if (f->lfd >= 0)
        close(f->lfd);
    f->fd = f->lfd = -1;
}

/* The next frame of `type` (others, heartbeats among them, skipped as
 * wp_expect does), 5 s at most; the instance and aux slot of every
 * ROOM_REQ on the way are remembered. */
static inline int wp_peer_expect(wp_peer_t *f, uint8_t type, kvf_msg_t *m)
{
    for (;;) {
        int t = wp_recv(f->fd, m, f->body, sizeof(f->body), 5000);
        if (t == 0)
            return 0;
        if (t == KVF_MSG_DATA) {
            static uint8_t sink[1 << 16];
            if (m->u.data.payload_len > sizeof(sink) ||
                !wp_read(f->fd, sink, m->u.data.payload_len, 5000))
                return 0;
        }
        if (t == KVF_MSG_ROOM_REQ) {
            f->inst[m->u.room_req.room % 256] = m->u.room_req.instance;
            f->aux_slot[m->u.room_req.room % 256] = m->u.room_req.aux_slot;
        }
        if (t == type)
            return 1;
    }
}

/* Send one frame (and a DATA payload) from f; a short send fails the case. */
static inline void wp_peer_send(wp_peer_t *f, const kvf_msg_t *m, const uint8_t *payload,
                                size_t n)
{
    CHECK(wp_send(f->fd, m, payload, n));
}

/* f's HELLO as a `role` engine, its layout f->lay. */
static inline void wp_hello(wp_peer_t *f, kvf_role_t role)
{
    const wp_layout_t *y = &f->lay;
    uint64_t kb[64], ki[64], kt[64], ab = y->aux_b, ai = y->slots, sb = 8, si = y->state_slots;
    uint32_t one = 1;
    char addr[32];
    CHECK(y->num_kv <= 64);
    for (uint32_t i = 0; i < y->num_kv && i < 64; i++) {
        kb[i] = (uint64_t)y->page * y->hpr * y->head_b;
        ki[i] = y->pages;
        kt[i] = kvf_wire_tag(i / 2, i % 2, 0);   /* K, V per layer */
    }
    snprintf(addr, sizeof(addr), "127.0.0.1:%d", f->port);
    kvf_msg_t m = {.type = KVF_MSG_HELLO};
    kvf_msg_hello_t *h = &m.u.hello;
    h->magic = KVF_WIRE_MAGIC;
    h->version = KVF_WIRE_VERSION;
    h->role = (uint8_t)role;
    h->instance_id = y->instance_id ? y->instance_id : 0x5eed0000ull + (uint64_t)f->port;
    h->tp_rank = y->tp_rank;
    h->tp_size = y->tp_size;
    h->pp_size = h->dp_size = 1;
    h->addr = (kvf_wire_str_t){addr, (uint32_t)strlen(addr)};
    h->layout.page_size = y->page;
    h->layout.kv_dtype = (kvf_wire_str_t){"bfloat16", 8};
    h->layout.attn = KVF_ATTN_MHA;
    h->layout.num_layers = y->layers;
    h->layout.heads_per_rank = y->hpr;
    h->layout.total_heads = y->total_heads;
    h->layout.bytes_per_head = y->head_b;
    h->layout.kv_item_bytes = (kvf_wire_arr64_t){y->num_kv, kb, NULL};
    h->layout.kv_items = (kvf_wire_arr64_t){y->num_kv, ki, NULL};
    h->layout.aux_item_bytes = (kvf_wire_arr64_t){1, &ab, NULL};
    h->layout.aux_items = (kvf_wire_arr64_t){1, &ai, NULL};
    if (y->state_slots) {
        h->layout.state_item_bytes = (kvf_wire_arr64_t){1, &sb, NULL};
        h->layout.state_items = (kvf_wire_arr64_t){1, &si, NULL};
        h->layout.state_groups = (kvf_wire_arr32_t){1, &one, NULL};   /* a plain state buffer */
    }
    h->layout.kv_tags = (kvf_wire_arr64_t){y->num_kv, kt, NULL};
    h->layout.kv_order = y->kv_order;
    CHECK(wp_send(f->fd, &m, NULL, 0));
}

/* The XPORT entry of capabilities, `bits` in `blob`. */
static inline kvf_wire_xport_t wp_caps_xport(uint8_t blob[4], uint32_t bits)
{
    kvf_put_u32(blob, bits);
    return (kvf_wire_xport_t){{KVF_WIRE_CAPS_NAME, 4}, blob, 4};
}

/* Send our XPORT: the capabilities `caps`, or (0) nothing but DATA frames. */
static inline void wp_xport(wp_peer_t *f, uint32_t caps)
{
    uint8_t blob[4];
    kvf_msg_t x = {.type = KVF_MSG_XPORT};
    if (caps != 0)
        x.u.xport.x[x.u.xport.count++] = wp_caps_xport(blob, caps);
    CHECK(wp_send(f->fd, &x, NULL, 0));
}

/* Take a decode engine's connection and run the handshake as a prefill
 * rank up to the XPORT offers: AUTH, its HELLO then ours.  hello_p
 * (unless NULL): the decode engine's HELLO (its numbers only: its
 * strings and arrays pointed into a buffer reused since). */
static inline void wp_accept_hello(wp_peer_t *f, kvf_msg_hello_t *hello_p)
{
    kvf_msg_t m;
    wp_accept(f);
    CHECK(wp_authenticate(f->fd, wp_engine_token(), KVF_ROLE_PREFILL, 0, NULL));
    CHECK(wp_peer_expect(f, KVF_MSG_HELLO, &m) && m.u.hello.role == KVF_ROLE_DECODE);
    if (hello_p != NULL)
        *hello_p = m.u.hello;
    wp_hello(f, KVF_ROLE_PREFILL);
}

/* The whole handshake so, offering `caps`: our XPORT, then its. */
static inline void wp_accept_decode(wp_peer_t *f, uint32_t caps)
{
    kvf_msg_t m;
    wp_accept_hello(f, NULL);
    wp_xport(f, caps);
    CHECK(wp_peer_expect(f, KVF_MSG_XPORT, &m));
}

/* Dial a prefill engine and run the handshake as a decode rank up to the
 * XPORT offers: AUTH, our HELLO then its (*hello_p, as wp_accept_hello). */
static inline void wp_connect_hello(wp_peer_t *f, kvf_engine_t *pre, kvf_msg_hello_t *hello_p)
{
    kvf_msg_t m;
    wp_connect(f, pre);
    CHECK(wp_authenticate(f->fd, wp_engine_token(), KVF_ROLE_DECODE, 1, NULL));
    wp_hello(f, KVF_ROLE_DECODE);
    CHECK(wp_peer_expect(f, KVF_MSG_HELLO, &m) && m.u.hello.role == KVF_ROLE_PREFILL);
    if (hello_p != NULL)
        *hello_p = m.u.hello;
}

/* The whole handshake so: its XPORT, then ours (offering nothing). */
static inline void wp_connect_prefill(wp_peer_t *f, kvf_engine_t *pre)
{
    kvf_msg_t m;
    wp_connect_hello(f, pre, NULL);
    CHECK(wp_peer_expect(f, KVF_MSG_XPORT, &m));
    wp_xport(f, 0);
}

#endif /* KVF_WIRE_PEER_H */
