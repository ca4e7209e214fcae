/*
 * Peers: one per pair of engines, its handshake, its streams and its
 * liveness.  What a peer sends, and how it waits, is outbox.c's; what it
 * reports to the rooms goes through eng->peer_events (peer.h), so this
 * file names no room code.
 *
 * Decode engines connect (one connection per prefill rank, cached by
 * address and shared by every room); prefill engines accept.  Both sides
 * authenticate first (auth.c: nothing else is sent or read before the
 * peer has proved it holds the cluster token), then send HELLO: protocol
 * version, instance id, ranks and the layout.
 * An incompatible pair stays connected, so that every room on it can fail
 * on both sides with the precise message, rather than a refused connect.
 *
 * Liveness: every byte received counts; when a peer has sent nothing for
 * heartbeat_interval we send a HEARTBEAT, and when we have heard nothing
 * for heartbeat_timeout the peer is dead and its rooms fail.  A stopped
 * (SIGSTOP) process, a hung one and a cut link all look the same here.
 *
 * Busy: a prefill engine that cannot take a connection now (too many from
 * this host still authenticating, or out of descriptors) closes it before
 * its AUTH.  That is no verdict on the peer: the decode side dials again,
 * with backoff, for as long as a room waits for it, and the rooms' own
 * deadlines end the wait, naming the refusals (kvf__peer_refusals).
 */
#include <assert.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/random.h>
#include <unistd.h>

#include <openssl/crypto.h>

#include "core/room.h"
#include "core/stage.h"
#include "util/log.h"
#include "util/time.h"

static void auth_start(kvf_peer_t *p);
static void refuse(kvf_peer_t *p, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void on_connected(void *arg);
static void on_msg(void *arg, const kvf_msg_t *msg);
static void on_data(void *arg, const kvf_msg_data_t *d, kvf_rx_target_t *t);
static int  rx_valid(void *arg);
static int  rx_ready(void *arg);
static void rx_busy(void *arg, int busy);
static void on_placed(void *arg, const uint8_t *p, size_t n);
static void on_data_end(void *arg, uint64_t placed);
static void on_close(void *arg, kvf_status_t st, const char *reason);

const kvf_conn_handler_t kvf__peer_handler = {
    .on_connected = on_connected,
    .on_msg = on_msg,
    .on_data = on_data,
    .rx_valid = rx_valid,
    .rx_ready = rx_ready,
    .rx_busy = rx_busy,
    .on_placed = on_placed,
    .on_data_end = on_data_end,
    .on_close = on_close,
};

const char *kvf__peer_name(const kvf_peer_t *p, char *buf, size_t len)
{
    KVF_ASSERT_LOCKED(p->eng);
    if (p->outbound && p->instance_id == 0)      /* rank from the registry */
        snprintf(buf, len, "prefill rank %d (%s)", p->tp_rank, p->addr);
    else if (p->instance_id == 0)
        snprintf(buf, len, "decode peer at %s", p->addr);
    else {
        char who[96];
        snprintf(buf, len, "%s (%s)", kvf__rank_name(p->role, p->tp_rank, p->pp_rank,
                                                     p->pp_size, p->dp_rank, p->dp_size,
                                                     who, sizeof(who)), p->addr);
    }
    return buf;
}

#define REDIAL_FIRST_MS 50      /* first redial after a refusal; doubles */
#define REDIAL_MAX_MS   1000    /* and stays there */

static kvf_peer_t *peer_new(kvf_engine_t *eng)
{
    kvf_peer_t *p = calloc(1, sizeof(*p));
    if (p == NULL)
        return NULL;
    p->ev_kind = KVF_EV_PEER;
    p->eng = eng;
    p->refs = 1;                        /* engine->peers */
    p->last_hb_ms = kvf_now_ms();
    p->handshake_until_ms = p->last_hb_ms + eng->params.handshake_timeout_ms;
    p->nstreams = 1;
    p->next = eng->peers;
    eng->peers = p;
    return p;
}

static void peer_free(kvf_peer_t *p)
{
    kvf__peer_held_free(p);
    /* Nothing waits in an outbox here: the peer was dead, or drained, by
     * the time its last reference went (kvf__peer_outbox_drain).  Its
     * streams' lanes let go of them before it could go (peers_tick). */
    assert(!kvf__streams_held(p));
    if (p->conn)
        p->conn->ops->destroy(p->conn);
    kvf__layout_free(&p->layout);
    free(p->kv_map);
    free(p->kv_src);
    free(p->incompatible);
    if (p->mep != NULL)
        p->mep->ops->disconnect(p->mep);
    free(p->ref_tgt);
    if (p->rx_bounce != NULL)
        p->eng->room_ops->release_rx(p);
    free(p->rx_dev);
    free(p->rx_bnc);
    free(p->owed);
    free(p);
}

void kvf__peer_put(kvf_peer_t *p)
{
    kvf_engine_t *eng = p->eng;
    KVF_ASSERT_LOCKED(eng);
    if (--p->refs > 0)
        return;
    if (kvf__owns_io(eng) && p->out_head == NULL) {
        peer_free(p);
        return;
    }
    /* Its connection is the owner's to close (it may be in a system call
     * on it right now): hand it over. */
    p->free_next = eng->peers_free;
    eng->peers_free = p;
    kvf__engine_wake(eng);
}

void kvf__peers_free(kvf_engine_t *eng)
{
    KVF_ASSERT_LOCKED(eng);
    assert(kvf__owns_io(eng));
    while (eng->peers_free != NULL) {
        kvf_peer_t *p = eng->peers_free;
        eng->peers_free = p->free_next;
        kvf__peer_outbox_drain(p);
        peer_free(p);
    }
}

/* The XPORT entry that carries capability bits (wire.h, KVF_WIRE_CAPS_NAME). */
static kvf_wire_xport_t caps_entry(uint8_t *blob, uint32_t caps)
{
    kvf_put_u32(blob, caps);
    return (kvf_wire_xport_t){{KVF_WIRE_CAPS_NAME, (uint32_t)strlen(KVF_WIRE_CAPS_NAME)},
                              blob, KVF_WIRE_CAPS_LEN};
}

static int is_entry(const kvf_wire_xport_t *e, const char *name)
{
    return e->name.len == strlen(name) && memcmp(e->name.ptr, name, e->name.len) == 0;
}

/* Prefill: what a decode engine may pull payload with, besides the stream:
 * every mover this engine has, each with its blob; then the optional
 * payload forms this engine can send (a decode engine of an older build
 * skips that entry, answers without it, and gets plain frames). */
static void send_offers(kvf_peer_t *p)
{
    kvf_engine_t *eng = p->eng;
    kvf_buf_t blobs[KVF_MAX_MOVERS];
    uint8_t caps[KVF_WIRE_CAPS_LEN];
    kvf_msg_t m = {.type = KVF_MSG_XPORT};
    kvf_msg_xport_t *x = &m.u.xport;
    /* Only ever for a peer that authenticated: what it declared there. */
    assert(p->auth.done);
    kvf_mover_peer_t who = {p->auth.theirs.pid, p->auth.theirs.instance_id};

    for (int i = 0; i < KVF_MAX_MOVERS; i++) {
        kvf_mover_t *mv = eng->movers[i];
        kvf_buf_init(&blobs[i]);
        if (mv == NULL || x->count == KVF_WIRE_MAX_XPORTS ||
            mv->ops->pack(mv, &who, &blobs[i]) != KVF_OK)
            continue;
        x->x[x->count++] = (kvf_wire_xport_t){
            {mv->ops->name, (uint32_t)strlen(mv->ops->name)}, blobs[i].data,
            (uint32_t)blobs[i].len};
    }
    if (x->count < KVF_WIRE_MAX_XPORTS)
        x->x[x->count++] = caps_entry(caps, KVF_CAPS_KNOWN);
    uint8_t streams[KVF_WIRE_STREAMS_OFFER];
    if (x->count < KVF_WIRE_MAX_XPORTS && kvf__streams_offer(p, streams, &x->x[x->count]))
        x->count++;
    kvf_status_t st = kvf__peer_send(p, &m);
    for (int i = 0; i < KVF_MAX_MOVERS; i++)
        kvf_buf_free(&blobs[i]);
    if (st != KVF_OK)
        kvf__peer_fail(p, st, "cannot send XPORT: %s", kvf_status_str(st));
}

/* The payload path of this peer from now on (NULL: the control stream). */
static void use_mover(kvf_peer_t *p, const kvf_mover_ops_t *ops)
{
    p->mover = ops;
    /* Relaxed: a display-only mask that is only ever or-ed into. */
    __atomic_fetch_or(&p->eng->used_paths, ops ? 2u << kvf_mover_index(ops) : 1u,
                      __ATOMIC_RELAXED);
}

static const char *path_name(const kvf_mover_ops_t *ops)
{
    return ops ? ops->name : kvf_stream_name();
}

static const kvf_wire_xport_t *find_offer(const kvf_msg_xport_t *x, const char *name)
{
    for (uint32_t i = 0; i < x->count; i++)
        if (is_entry(&x->x[i], name))
            return &x->x[i];
    return NULL;
}

/* Decode: try the offer of kvf_movers[i]; on failure say why in `why`. */
static int try_offer(kvf_peer_t *p, const kvf_msg_xport_t *x, int i, char *why,
                     size_t len)
{
    const kvf_mover_ops_t *ops = kvf_movers[i];
    kvf_mover_t *mv = p->eng->movers[i];
    const kvf_wire_xport_t *o = find_offer(x, ops->name);
    if (o == NULL) {
        snprintf(why, len, "the prefill engine does not offer it; its log says why");
        return 0;
    }
    if (mv == NULL) {
        snprintf(why, len, "not available on this engine (see its log)");
        return 0;
    }
    return kvf_mover_connect(p->eng->faults, mv, o->blob, o->blob_len, &p->mep, why, len) ==
           KVF_OK;
}

/* Device memory moves over a mover that carries it, or over the stream
 * through this engine's copier (stage.h); each side sees to its own
 * memory.  Any other choice makes the pair fail its rooms with this
 * reason. */
static void check_device_memory(kvf_peer_t *p)
{
    const kvf_layout_int_t *mine = &p->eng->layout;
    if ((kvf__peer_caps(p) & KVF_MOVER_CAP_MEM_DEVICE) || p->incompatible != NULL ||
        !kvf__layout_on_device(mine) || (p->mover == NULL && kvf__stages(p->eng)))
        return;
    char why[KVF_REASON_MAX];
    snprintf(why, sizeof(why), "KV cache in device memory cannot move over %s between "
             "this prefill/decode pair: %s (see the log for why no other transport was "
             "chosen).", path_name(p->mover), kvf_movers_device_hint());
    p->incompatible = strdup(why);
}

/*
 * Decode: pick how payload comes from this prefill engine and tell it,
 * before any ROOM_REQ: the first mover in table order that this engine
 * allows and whose offer works here; otherwise the control stream, saying
 * why once when a mover was asked for or expected.
 */
static void choose_xport(kvf_peer_t *p, const kvf_msg_xport_t *x)
{
    kvf_engine_t *eng = p->eng;
    char why[256] = "", tried[512] = "";
    uint8_t caps[KVF_WIRE_CAPS_LEN];
    kvf_msg_t m = {.type = KVF_MSG_XPORT};
    const kvf_mover_ops_t *chosen = NULL;

    /* A sibling link moves no payload: no mover, one stream. */
    for (int i = 0; kvf_movers[i] != NULL && chosen == NULL && !p->watch_only; i++) {
        if (!kvf_mover_allowed(eng->transport, kvf_movers[i]))
            continue;
        if (try_offer(p, x, i, why, sizeof(why)))
            chosen = kvf_movers[i];
        else
            snprintf(tried + strlen(tried), sizeof(tried) - strlen(tried), "%s%s: %s",
                     tried[0] ? "; " : "", kvf_movers[i]->name, why);
    }
    if (chosen != NULL) {
        m.u.xport.count = 1;
        m.u.xport.x[0].name = (kvf_wire_str_t){chosen->name, (uint32_t)strlen(chosen->name)};
        kvf_info("prefill rank %d at %s: payload over %s", p->tp_rank, p->addr, chosen->name);
    } else if (tried[0] != '\0') {
        static int said;   /* once per process unless asked for explicitly */
        if (!said++ || strcmp(eng->transport, "auto") != 0)
            kvf_warn("prefill rank %d at %s: payload over %s (%s)", p->tp_rank, p->addr,
                     kvf_stream_name(), tried);
    }
    /* Accept what both builds know; answer only a prefill that asked, so a
     * prefill rank of an older build never sees the entry. */
    const kvf_wire_xport_t *offer = find_offer(x, KVF_WIRE_CAPS_NAME);
    if (offer != NULL && offer->blob_len == KVF_WIRE_CAPS_LEN) {
        p->caps = kvf_get_u32(offer->blob) & KVF_CAPS_KNOWN;
        if (p->caps != 0)
            m.u.xport.x[m.u.xport.count++] = caps_entry(caps, p->caps);
    }
    /* Several streams only for payload in the stream (tcp). */
    uint8_t streams[KVF_WIRE_STREAMS_ANSWER];
    if (chosen == NULL && !p->watch_only)
        p->nstreams = kvf__streams_accept(p, find_offer(x, KVF_WIRE_STREAMS_NAME), streams,
                                          &m.u.xport.x[m.u.xport.count]);
    if (p->nstreams > 1)
        m.u.xport.count++;
    kvf_status_t st = kvf__peer_send(p, &m);
    if (st != KVF_OK) {
        kvf__peer_fail(p, st, "cannot send XPORT: %s", kvf_status_str(st));
        return;
    }
    use_mover(p, chosen);
    if (!p->watch_only)
        check_device_memory(p);
    if (p->nstreams > 1) {
        /* READY once every stream has joined (below, "Streams"). */
        kvf__streams_open(p);
        return;
    }
    p->state = KVF_PEER_READY;
    eng->peer_events->ready(eng, p);
}

static void on_xport(kvf_peer_t *p, const kvf_msg_xport_t *x)
{
    kvf_engine_t *eng = p->eng;
    if (p->role == KVF_ROLE_PREFILL) {
        if (p->state != KVF_PEER_HANDSHAKE || !p->hello_done) {
            kvf__peer_fail(p, KVF_ERR_PROTOCOL, "XPORT out of order");
            return;
        }
        choose_xport(p, x);
        return;
    }
    /* The answer: at most one transport, the capabilities accepted, and
     * the streams wanted. */
    const kvf_wire_xport_t *choice = NULL, *caps = NULL, *streams = NULL;
    int twice = 0;
    for (uint32_t i = 0; i < x->count; i++) {
        const kvf_wire_xport_t **slot =
            is_entry(&x->x[i], KVF_WIRE_CAPS_NAME)      ? &caps
            : is_entry(&x->x[i], KVF_WIRE_STREAMS_NAME) ? &streams
                                                        : &choice;
        twice |= *slot != NULL;      /* a second of any: refused below */
        *slot = &x->x[i];
    }
    if (p->state != KVF_PEER_READY || twice || (streams != NULL && p->nstreams > 1)) {
        kvf__peer_fail(p, KVF_ERR_PROTOCOL, "XPORT out of order or with several choices");
        return;
    }
    if (caps != NULL) {
        uint32_t bits = caps->blob_len == KVF_WIRE_CAPS_LEN ? kvf_get_u32(caps->blob) : 0;
        if (bits == 0 || (bits & ~KVF_CAPS_KNOWN) != 0) {
            kvf__peer_fail(p, KVF_ERR_PROTOCOL, "decode engine accepted capabilities "
                           "0x%x (%u-byte entry), but 0x%x were offered", bits,
                           caps->blob_len, KVF_CAPS_KNOWN);
            return;
        }
        p->caps = bits;
    }
    char err[160];
    if (streams != NULL && (choice != NULL || kvf__streams_answer(p, streams, err,
                                                                  sizeof(err)) != KVF_OK)) {
        kvf__peer_fail(p, KVF_ERR_PROTOCOL, "%s", choice != NULL ? "decode engine asked "
                       "for streams beside a transport that pulls" : err);
        return;
    }
    if (streams == NULL && kvf__streams_held(p)) {
        /* Streams joined (on their own connections) that it now does not ask for. */
        kvf__peer_fail(p, KVF_ERR_PROTOCOL, "decode engine asked for one stream after "
                       "others joined");
        return;
    }
    const kvf_mover_ops_t *ops = NULL;
    if (choice != NULL) {
        ops = kvf_mover_find(choice->name.ptr, choice->name.len);
        int i = ops ? kvf_mover_index(ops) : -1;
        if (i < 0 || eng->movers[i] == NULL) {
            kvf__peer_fail(p, KVF_ERR_PROTOCOL, "decode engine chose a transport that "
                           "was not offered");
            return;
        }
    }
    use_mover(p, ops);
    kvf_info("decode rank %d at %s: payload over %s", p->tp_rank, p->addr, path_name(ops));
    check_device_memory(p);
}

static void send_hello(kvf_peer_t *p)
{
    kvf_engine_t *eng = p->eng;
    kvf_msg_t m = {.type = KVF_MSG_HELLO};
    kvf_msg_hello_t *h = &m.u.hello;
    if (kvf__layout_to_wire(&eng->layout, &h->layout) != KVF_OK) {
        kvf__peer_fail(p, KVF_ERR_NO_MEMORY, "no memory for HELLO");
        return;
    }
    h->magic = KVF_WIRE_MAGIC;
    h->version = KVF_WIRE_VERSION;
    h->role = (uint8_t)eng->params.role;
    h->flags = eng->params.checksum ? KVF_HELLO_F_CHECKSUM : 0;
    h->instance_id = eng->instance_id;
    h->tp_rank = (uint32_t)eng->params.tp_rank;
    h->tp_size = (uint32_t)eng->params.tp_size;
    h->pp_rank = (uint32_t)eng->params.pp_rank;
    h->pp_size = (uint32_t)eng->params.pp_size;
    h->dp_rank = (uint32_t)eng->params.dp_rank;
    h->dp_size = (uint32_t)eng->params.dp_size;
    h->addr = (kvf_wire_str_t){eng->addr, (uint32_t)strlen(eng->addr)};
    kvf_status_t st = kvf__peer_send(p, &m);
    kvf__layout_wire_free(&h->layout);
    if (st != KVF_OK) {
        kvf__peer_fail(p, st, "cannot send HELLO: %s", kvf_status_str(st));
        return;
    }
    if (eng->params.role == KVF_ROLE_PREFILL)
        send_offers(p);
}

kvf_peer_t *kvf__peer_get(kvf_engine_t *eng, const char *host, int port, int tp_rank,
                          int watch)
{
    KVF_ASSERT_LOCKED(eng);
    char addr[KVF_ADDR_MAX];
    snprintf(addr, sizeof(addr), "%s:%d", host, port);
    for (kvf_peer_t *p = eng->peers; p != NULL; p = p->next)
        if (p->outbound && p->state != KVF_PEER_DEAD && !p->lingering &&
            p->watch_only == watch && strcmp(p->addr, addr) == 0)
            return p;

    kvf_peer_t *p = peer_new(eng);
    if (p == NULL)
        return NULL;
    p->outbound = 1;
    p->watch_only = watch;
    p->role = KVF_ROLE_PREFILL;
    p->tp_rank = tp_rank;
    p->state = KVF_PEER_CONNECTING;
    snprintf(p->addr, sizeof(p->addr), "%s", addr);
    snprintf(p->dial_host, sizeof(p->dial_host), "%s", host);
    p->dial_port = port;
    if (kvf__peer_dial(p) != KVF_OK) {
        /* Dead from the start: rooms that link it fail right away. */
        p->state = KVF_PEER_DEAD;
        eng->peer_generation++;
    }
    kvf_debug("connecting to prefill peer %s", addr);
    return p;
}

kvf_status_t kvf__peer_dial(kvf_peer_t *p)
{
    KVF_ASSERT_LOCKED(p->eng);
    kvf_engine_t *eng = p->eng;
    const kvf_peer_t *m = kvf__peer_main(p);
    kvf_conn_env_t env = {eng->lanes[p->lane].epfd, p, kvf__engine_io_unlock,
                          kvf__engine_io_lock, eng};
    /* With KVF_FAULTS set, every connection carries the engine's faults. */
    kvf_status_t st = kvf_control_connect(eng->faults, m->dial_host, m->dial_port, &env,
                                          &kvf__peer_handler, p, &p->conn);
    if (st != KVF_OK)
        p->conn = NULL;
    return st;
}

/*
 * Outbound, closed before the peer's AUTH came: the prefill engine refused
 * the connection at the door (it sends AUTH first thing to any connection
 * it takes on).  Dial again later, backing off with jitter, so that the
 * decode ranks of a host do not come back in step.  @return 1 when a
 * redial is planned (the connection is left shut, for kvf__peer_redial to
 * destroy outside its callbacks).
 */
static int redial_later(kvf_peer_t *p, kvf_status_t st, const char *reason)
{
    char name[128];
    if (!p->outbound || p->auth.got_auth || p->lingering || st != KVF_ERR_CONN_RESET)
        return 0;
    uint64_t now = kvf_now_ms();
    uint64_t base = REDIAL_FIRST_MS << (p->redials < 5 ? p->redials : 5);
    if (base > REDIAL_MAX_MS)
        base = REDIAL_MAX_MS;
    uint64_t x = (kvf_now_ns() ^ (uintptr_t)p) * 0x9e3779b97f4a7c15ull;
    p->redial_at_ms = now + base / 2 + (x >> 33) % (base / 2 + 1);
    p->redials++;
    p->refused_ms = now;
    snprintf(p->refused_why, sizeof(p->refused_why), "%s", reason);
    p->state = KVF_PEER_REDIAL;
    /* Or the engine there is gone (killed while this dialled) and comes
     * back elsewhere: new rooms look its rank up afresh, as after a death. */
    p->eng->peer_generation++;
    if (p->refused++ == 0)
        kvf_warn("%s%s closed the connection before its handshake (%s): it refuses new "
                 "connections while too many from this host are still authenticating, or "
                 "while it is out of file descriptors; dialling again until the rooms' "
                 "deadlines", kvf__peer_name(kvf__peer_main(p), name, sizeof(name)),
                 p->primary != NULL ? " (a stream)" : "", reason);
    return 1;
}

void kvf__peer_redial(kvf_peer_t *p, uint64_t now)
{
    KVF_ASSERT_LOCKED(p->eng);
    assert(p->state == KVF_PEER_REDIAL && kvf__owns_lane(p->eng, p->lane));
    kvf_peer_t *m = kvf__peer_main(p);
    if (!p->eng->peer_events->needed(p->eng, m)) {
        p->quiet = 1;
        kvf__peer_fail(p, KVF_ERR_CONN_RESET, "refused before its handshake (%s), and no "
                       "room waits for it any more", p->refused_why);
        return;
    }
    p->conn->ops->destroy(p->conn);
    p->conn = NULL;
    memset(&p->auth, 0, sizeof(p->auth));
    p->state = KVF_PEER_CONNECTING;
    /* Each attempt has its own deadline; a stream's is its primary's too
     * (which waits in HANDSHAKE for it). */
    p->handshake_until_ms = now + p->eng->params.handshake_timeout_ms;
    if (m->handshake_until_ms < p->handshake_until_ms)
        m->handshake_until_ms = p->handshake_until_ms;
    kvf_status_t st = kvf__peer_dial(p);
    if (st != KVF_OK)
        kvf__peer_fail(p, KVF_ERR_UNREACHABLE, "cannot connect to %s:%d: %s", m->dial_host,
                       m->dial_port, kvf_status_str(st));
}

int kvf__peer_refusals(const kvf_peer_t *p, char *buf, size_t len)
{
    KVF_ASSERT_LOCKED(p->eng);
    char name[128];
    const kvf_peer_t *last = NULL;
    unsigned n = 0;
    for (unsigned k = 0; k < KVF_MAX_STREAMS; k++) {
        const kvf_peer_t *s = k == 0 ? p : p->streams[k];
        if (s == NULL || s->refused == 0)
            continue;
        n += s->refused;
        if (last == NULL || s->refused_ms > last->refused_ms)
            last = s;
    }
    if (p->state == KVF_PEER_READY || last == NULL)
        return 0;
    snprintf(buf, len, "%s refused %u connection%s before its handshake, the last %.1f s "
             "ago (%s): it turns connections away while too many from this host are still "
             "authenticating (a flood of connections that never authenticate) or while it "
             "is out of file descriptors; kept dialling",
             kvf__peer_name(p, name, sizeof(name)), n, n == 1 ? "" : "s",
             (double)kvf_elapsed_ms(kvf_now_ms(), last->refused_ms) / 1000.0,
             last->refused_why);
    return 1;
}

void kvf__peer_accept(kvf_engine_t *eng, int fd, const char *host)
{
    KVF_ASSERT_LOCKED(eng);
    kvf_peer_t *p = peer_new(eng);
    if (p == NULL) {
        close(fd);
        return;
    }
    p->state = KVF_PEER_AUTH;
    snprintf(p->remote_host, sizeof(p->remote_host), "%s", host);
    snprintf(p->addr, sizeof(p->addr), "%s (not authenticated)", host);
    kvf_conn_env_t env = {eng->epfd, p, kvf__engine_io_unlock, kvf__engine_io_lock, eng};
    kvf_status_t st = kvf_control_accept(eng->faults, fd, &env, &kvf__peer_handler, p,
                                         &p->conn);
    if (st != KVF_OK) {
        close(fd);
        p->state = KVF_PEER_DEAD;
        return;
    }
    auth_start(p);
}

/* The peer proved it holds the token; the handshake goes on. */
static void authenticated(kvf_peer_t *p)
{
    KVF_ASSERT_LOCKED(p->eng);
    char name[128];
    p->state = KVF_PEER_HANDSHAKE;
    if (p->refused > 0)
        kvf_info("%s%s: authenticated after %u connection%s refused before the handshake",
                 kvf__peer_name(kvf__peer_main(p), name, sizeof(name)),
                 p->primary != NULL ? " (a stream)" : "", p->refused,
                 p->refused == 1 ? "" : "s");
    p->refused = 0;
    if (p->primary != NULL) {            /* decode: our extra stream */
        kvf__stream_authenticated(p);
        return;
    }
    if (!p->outbound && (p->auth.theirs.flags & KVF_AUTH_F_JOIN)) {
        p->joining = 1;                  /* no HELLO: its JOIN comes next */
        return;
    }
    send_hello(p);
    /* What waited for it (its rooms that failed while it connected) goes
     * right after our HELLO. */
    kvf__peer_send_held(p);
    if (p->lingering) {
        /* Its rooms failed while it was stopped: it has learnt why, and
         * the connection ends as it would have. */
        kvf__peer_fail(p, KVF_ERR_PEER_TIMEOUT, "told it about the rooms that failed "
                       "while it was not answering");
    }
}

/* Do what a step of the handshake asks (auth.h): auth.c decides, the
 * peer acts, so that auth.c never calls back into this file. */
static void auth_do(kvf_peer_t *p, const kvf_auth_step_t *s)
{
    if (s->verdict.st != KVF_OK) {
        if (s->quiet)
            p->quiet = 1;
        kvf__peer_heed(p, &s->verdict);
        return;
    }
    if (s->set_limit)
        p->conn->ops->limit(p->conn, s->limit);
    if (s->send) {
        kvf_status_t st = kvf__peer_send(p, &s->msg);
        if (st != KVF_OK)
            kvf__peer_fail(p, st, "cannot send %s: %s", kvf_wire_type_name((uint8_t)s->msg.type),
                           kvf_status_str(st));
    }
    if (s->authenticated && p->state != KVF_PEER_DEAD)
        authenticated(p);
}

/* Our AUTH, the first frame on a new connection. */
static void auth_start(kvf_peer_t *p)
{
    kvf_auth_step_t s;
    kvf__auth_start(p, &s);
    auth_do(p, &s);
}

/* Close a peer that has not authenticated: refused (counted and logged
 * once per address by auth.c), and failed quietly. */
static void refuse(kvf_peer_t *p, const char *fmt, ...)
{
    char why[KVF_REASON_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(why, sizeof(why), fmt, ap);
    va_end(ap);
    kvf_auth_step_t s;
    kvf__auth_refuse(p, why, &s);
    auth_do(p, &s);
}

void kvf__peer_fail(kvf_peer_t *p, kvf_status_t st, const char *fmt, ...)
{
    char why[KVF_REASON_MAX], name[128], reason[KVF_REASON_MAX];
    va_list ap;

    KVF_ASSERT_LOCKED(p->eng);
    if (p->state == KVF_PEER_DEAD)
        return;
    va_start(ap, fmt);
    vsnprintf(why, sizeof(why), fmt, ap);
    va_end(ap);
    if (p->primary != NULL) {
        /* A stream: its failure is the peer's, with every stream of it. */
        kvf_peer_t *m = p->primary;
        if (m->streams[p->stream] == p && m->state != KVF_PEER_DEAD)
            kvf__peer_fail(m, st, "stream %u of %u: %s", p->stream, m->nstreams, why);
        kvf__streams_close(m);
        return;
    }
    if (p->lingering)
        goto close;
    kvf__peer_name(p, name, sizeof(name));
    p->eng->peer_generation++;
    snprintf(reason, sizeof(reason), "%s: %s", name, why);
    /*
     * Rooms first, then the stream: completions of its puts must not be
     * taken for the root cause.  The rooms tell their other peers; this
     * one we tell ourselves, while the stream is still up: a peer that was
     * only stopped finds the FAILs in its socket when it runs again, and
     * fails its side at once with our reason instead of waiting for a
     * reconnect or deadline.
     */
    kvf_room_failed_t *failed;
    size_t nfailed;
    int rooms = p->eng->peer_events->failed(p->eng, p, st, reason, &failed, &nfailed);
    /* What other threads queued goes out while the stream is up (and a
     * put in the outbox holds a reference to this peer); off its lane,
     * the lane sends it before it closes (kvf__peer_close_pending).  Only
     * now: a closing stream fails the puts it is handed, and a room must
     * hear why first (a reset one waits for the reconnect). */
    if (kvf__owns_lane(p->eng, p->lane))
        kvf__peer_outbox_drain(p);
    for (size_t i = 0; i < nfailed; i++)
        kvf__send_fail_keyed(p, failed[i].room, failed[i].instance, failed[i].key,
                             &failed[i].failure, 0);
    free(failed);
    if (rooms > 0)
        kvf_warn("%s (%d live rooms affected)", reason, rooms);
    else if (p->quiet)
        kvf_debug("%s", reason);
    else
        kvf_info("%s", reason);
    /*
     * Outbound and still authenticating (the prefill is stopped, say):
     * the FAILs its rooms just queued cannot go before it has proved
     * itself, so the connection stays until the handshake deadline, for
     * a prefill that resumes to learn of them at once.  No room uses it
     * any more (kvf__peer_get skips it).
     */
    if (p->state == KVF_PEER_AUTH && p->outbound && p->held_head != NULL &&
        st == KVF_ERR_PEER_TIMEOUT && p->conn != NULL &&
        kvf_now_ms() < p->handshake_until_ms) {   /* silent, not broken */
        p->lingering = 1;
        return;
    }
close:
    p->state = KVF_PEER_DEAD;
    p->eng->peer_events->dead(p, st);
    kvf__streams_close(p);
    p->close_pending = 1;
    if (kvf__owns_lane(p->eng, p->lane))
        kvf__peer_close_pending(p);
    else
        kvf__lane_wake(p->eng, p->lane);
}

kvf_verdict_t kvf__verdict(kvf_status_t st, const char *fmt, ...)
{
    kvf_verdict_t v;
    va_list ap;
    v.st = st;
    va_start(ap, fmt);
    vsnprintf(v.why, sizeof(v.why), fmt, ap);
    va_end(ap);
    return v;
}

void kvf__peer_heed(kvf_peer_t *p, const kvf_verdict_t *v)
{
    KVF_ASSERT_LOCKED(p->eng);
    if (v->st != KVF_OK)
        kvf__peer_fail(p, v->st, "%s", v->why);
}

/*
 * A read's verdict on its peer (its endpoint went down with it) is acted
 * on as soon as the read is taken in, before the next one: not kept on the
 * peer for later in the pass.  A peer failed at once is dead when its
 * next reads come in, so they count for nothing and its rooms fail with
 * the endpoint's reason, as they always did; kept for later, each of
 * those reads would fail its room with a reason of its own first.
 */
void kvf__peers_reads_done(kvf_engine_t *eng)
{
    kvf_verdict_t v;
    kvf_peer_t *p;
    KVF_ASSERT_LOCKED(eng);
    if (eng->room_ops->read_take == NULL)
        return;
    while ((p = eng->room_ops->read_take(eng, &v)) != NULL) {
        kvf__peer_heed(p, &v);
        kvf__peer_put(p);          /* the read's reference */
    }
}

void kvf__peer_close_pending(kvf_peer_t *p)
{
    KVF_ASSERT_LOCKED(p->eng);
    assert(kvf__owns_lane(p->eng, p->lane));
    if (!p->close_pending)
        return;
    kvf__peer_outbox_drain(p);             /* still up: what it queued goes */
    p->close_pending = 0;
    if (p->conn) {
        p->conn->ops->flush(p->conn);      /* best effort, never blocks */
        p->conn->ops->shutdown(p->conn);
    }
    /* Reads still in flight are stopped; each is handed back (and its room
     * released) by the mover's progress. */
    if (p->mep != NULL) {
        p->mep->ops->disconnect(p->mep);
        p->mep = NULL;
    }
}

void kvf__peer_handle(kvf_peer_t *p, uint32_t events)
{
    KVF_ASSERT_LOCKED(p->eng);
    if (p->state != KVF_PEER_DEAD && p->conn)
        p->conn->ops->handle(p->conn, events);
}

static void on_connected(void *arg)
{
    kvf_peer_t *p = arg;
    p->state = KVF_PEER_AUTH;
    auth_start(p);
}

static void on_close(void *arg, kvf_status_t st, const char *reason)
{
    kvf_peer_t *p = arg;
    char why[KVF_REASON_MAX];
    if (p->state == KVF_PEER_DEAD)
        return;
    if (p->state == KVF_PEER_AUTH) {
        if (kvf__auth_explain_close(p, why, sizeof(why))) {
            kvf__peer_fail(p, KVF_ERR_AUTH, "%s", why);
            return;
        }
        if (redial_later(p, st, reason))
            return;
        /* A stranger that sent garbage (or an engine of another version):
         * refused, and logged once per address; one that just left: quiet. */
        if (!p->outbound && (st == KVF_ERR_PROTOCOL || st == KVF_ERR_VERSION)) {
            refuse(p, "%s", reason);
            return;
        }
        if (!p->outbound)
            p->quiet = 1;
    }
    kvf__peer_fail(p, st, "connection lost: %s", reason);
}

/* The checks a HELLO must pass before anything of it is kept, then the
 * peer's ranks, instance and layout.  @return 1, or 0: the peer failed. */
static int hello_accept(kvf_peer_t *p, const kvf_msg_hello_t *h)
{
    kvf_engine_t *eng = p->eng;
    KVF_ASSERT_LOCKED(eng);
    char err[KVF_REASON_MAX];

    if (p->state != KVF_PEER_HANDSHAKE) {
        kvf__peer_fail(p, KVF_ERR_PROTOCOL, "second HELLO on an established connection");
        return 0;
    }
    if (h->role == (uint8_t)eng->params.role) {
        kvf__peer_fail(p, KVF_ERR_INCOMPATIBLE, "peer is also a %s engine",
                       kvf_role_name(eng->params.role));
        return 0;
    }
    if (h->tp_size == 0 || h->tp_rank >= h->tp_size || h->pp_size == 0 ||
        h->pp_rank >= h->pp_size || h->dp_size == 0 || h->dp_rank >= h->dp_size ||
        h->tp_size > 65536 || h->pp_size > 65536) {
        kvf__peer_fail(p, KVF_ERR_PROTOCOL, "HELLO with impossible ranks (tp %u/%u, pp "
                       "%u/%u, dp %u/%u)", h->tp_rank, h->tp_size, h->pp_rank, h->pp_size,
                       h->dp_rank, h->dp_size);
        return 0;
    }
    kvf_status_t st = kvf__layout_from_wire(&p->layout, &h->layout, err, sizeof(err));
    if (st != KVF_OK) {
        kvf__peer_fail(p, st, "%s", err);
        return 0;
    }
    p->role = (kvf_role_t)h->role;
    p->tp_rank = (int)h->tp_rank;
    p->tp_size = (int)h->tp_size;
    p->pp_rank = (int)h->pp_rank;
    p->pp_size = (int)h->pp_size;
    p->dp_rank = (int)h->dp_rank;
    p->dp_size = (int)h->dp_size;
    p->instance_id = h->instance_id;
    p->checksum = (h->flags & KVF_HELLO_F_CHECKSUM) != 0;
    snprintf(p->addr, sizeof(p->addr), "%.*s", (int)h->addr.len, h->addr.ptr);

    /* A prefill says its heads; only a decode may leave them to the other. */
    if (p->role == KVF_ROLE_PREFILL && p->layout.attn == KVF_ATTN_MHA &&
        (p->layout.heads_per_rank == 0 || p->layout.total_heads == 0 ||
         p->layout.bytes_per_head == 0)) {
        kvf__peer_fail(p, KVF_ERR_PROTOCOL, "HELLO of an MHA prefill layout without its "
                       "KV heads");
        return 0;
    }
    return 1;
}

/* Is the pair compatible?  Fills *own with this engine's layout as it
 * would be with the heads adopted, and the peer's buffer maps (kv_map,
 * and kv_src from a prefill).  @return with err empty, or the reason. */
static void hello_pair_check(kvf_peer_t *p, kvf_layout_int_t *own, char *err, size_t errlen)
{
    kvf_engine_t *eng = p->eng;
    KVF_ASSERT_LOCKED(eng);

    /* A decode layout without heads takes the prefill's (the same model),
     * on both sides of the pair; our own only once the pair is found
     * compatible, so that a stray prefill of another model cannot set it. */
    err[0] = '\0';
    *own = eng->layout;   /* shallow: only the heads may change */
    if (p->role == KVF_ROLE_PREFILL)
        kvf__layout_adopt_heads(own, eng->params.tp_size, &p->layout, err, errlen);
    else
        kvf__layout_adopt_heads(&p->layout, p->tp_size, &eng->layout, err, errlen);
    kvf_par_t mine, theirs;
    kvf__par_fill(&mine, eng->params.tp_rank, eng->params.tp_size, eng->params.pp_rank,
                  eng->params.pp_size, own);
    kvf__par_fill(&theirs, p->tp_rank, p->tp_size, p->pp_rank, p->pp_size, &p->layout);
    const kvf_layout_int_t *pl = p->role == KVF_ROLE_PREFILL ? &p->layout : own;
    const kvf_layout_int_t *dl = p->role == KVF_ROLE_PREFILL ? own : &p->layout;
    /* The check also finds which decode buffer each prefill buffer goes to. */
    if (err[0] == '\0' && (p->kv_map = malloc(pl->num_kv * sizeof(uint32_t))) == NULL)
        snprintf(err, errlen, "no memory for the KV buffer map");
    if (err[0] == '\0' &&
        kvf__pair_check(pl, p->role == KVF_ROLE_PREFILL ? &theirs : &mine, dl,
                        p->role == KVF_ROLE_PREFILL ? &mine : &theirs, p->kv_map, err,
                        errlen) != KVF_OK && err[0] == '\0')
        snprintf(err, errlen, "no memory to check the pair");
    if (err[0] == '\0' && p->role == KVF_ROLE_PREFILL) {
        if ((p->kv_src = malloc(dl->num_kv * sizeof(uint32_t))) == NULL) {
            snprintf(err, errlen, "no memory for the KV buffer map");
        } else {
            memset(p->kv_src, 0xff, dl->num_kv * sizeof(uint32_t));
            for (uint32_t i = 0; i < pl->num_kv; i++)
                p->kv_src[p->kv_map[i]] = i;
        }
    }
}

static void on_hello(kvf_peer_t *p, const kvf_msg_hello_t *h)
{
    kvf_engine_t *eng = p->eng;
    char err[KVF_REASON_MAX];
    kvf_layout_int_t own;

    if (!hello_accept(p, h))
        return;
    hello_pair_check(p, &own, err, sizeof(err));
    /* Two stages of one pipeline never pair for bytes (a decode stage
     * reads its own prefill stage): such a connection is a decode rank's
     * sibling link (siblings.c), whose layers differ by design.  It stays
     * incompatible, refusing any destination, but that is no error. */
    int other_stage = p->pp_size == eng->params.pp_size && p->pp_rank != eng->params.pp_rank;
    if (err[0] != '\0') {
        p->incompatible = strdup(err);
        if (!other_stage)
            kvf_error("%s rank %d at %s: %s", kvf_role_name(p->role), p->tp_rank,
                      p->addr, err);
    } else {
        eng->layout.heads_per_rank = own.heads_per_rank;   /* adopted, or as they were */
        /* Atomic: kvf_receiver_create_remote reads it without the lock. */
        __atomic_store_n(&eng->layout.total_heads, own.total_heads, __ATOMIC_RELAXED);
        eng->layout.bytes_per_head = own.bytes_per_head;
    }
    kvf_info("%s rank %d at %s connected (instance %016llx)", kvf_role_name(p->role),
             p->tp_rank, p->addr, (unsigned long long)p->instance_id);
    if (p->role == KVF_ROLE_PREFILL) {
        p->hello_done = 1;          /* ready once its XPORT offer is answered */
        return;
    }
    p->mover = NULL;                /* the stream, until the decode engine chooses */
    p->state = KVF_PEER_READY;
    eng->peer_events->ready(eng, p);
}

static void on_msg(void *arg, const kvf_msg_t *msg)
{
    kvf_peer_t *p = arg;
    if (msg->type == KVF_MSG_AUTH || msg->type == KVF_MSG_AUTH_PROOF) {
        kvf_auth_step_t s;
        kvf__auth_on_msg(p, msg, &s);
        auth_do(p, &s);
        return;
    }
    /* The gate: nothing of an unauthenticated peer is read any further. */
    if (!p->auth.done) {
        refuse(p, "%s before authenticating", kvf_wire_type_name((uint8_t)msg->type));
        return;
    }
    if (p->primary != NULL) {
        kvf__stream_on_msg(p, msg);
        return;
    }
    if (msg->type == KVF_MSG_JOIN || p->joining) {
        if (msg->type == KVF_MSG_JOIN)
            kvf__stream_on_join(p, &msg->u.join);
        else
            kvf__peer_fail(p, KVF_ERR_PROTOCOL, "%s on a connection that announced a "
                           "JOIN", kvf_wire_type_name((uint8_t)msg->type));
        return;
    }
    if (msg->type == KVF_MSG_HELLO) {
        on_hello(p, &msg->u.hello);
        return;
    }
    if (msg->type == KVF_MSG_XPORT) {
        on_xport(p, &msg->u.xport);
        return;
    }
    /* A decode engine's peer waits for its streams to join, READY after. */
    if (msg->type == KVF_MSG_HEARTBEAT && p->hello_done)
        return;
    /* A prefill rank whose HELLO came may answer, before its XPORT offer
     * is settled and its streams joined, what followed our HELLO (a FAIL,
     * a watch, an acknowledgement said again: kvf__peer_send_soon). */
    int answer = msg->type == KVF_MSG_FAIL || msg->type == KVF_MSG_ABORT ||
                 msg->type == KVF_MSG_DONE_ACK;
    if (p->state != KVF_PEER_READY && !(p->hello_done && answer)) {
        kvf__peer_fail(p, KVF_ERR_PROTOCOL, "%s before HELLO",
                       kvf_wire_type_name((uint8_t)msg->type));
        return;
    }
    if (msg->type == KVF_MSG_HEARTBEAT)
        return;
    /* Stream 0's DONE: its stream fields exactly when streams were agreed. */
    if (msg->type == KVF_MSG_DONE &&
        (msg->u.done.stream != 0 ||
         msg->u.done.streams != (p->nstreams > 1 ? p->nstreams : 0))) {
        kvf__peer_fail(p, KVF_ERR_PROTOCOL, "DONE for stream %u of %u on stream 0 of a "
                       "pair with %u", msg->u.done.stream, msg->u.done.streams, p->nstreams);
        return;
    }
    if (msg->type == KVF_MSG_ROOM_REQ && kvf__peer_nstreams(p) != p->nstreams) {
        kvf__peer_fail(p, KVF_ERR_PROTOCOL, "ROOM_REQ before its %u streams joined",
                       p->nstreams);
        return;
    }
    if (msg->type == KVF_MSG_DATA_REF) {
        if (p->role != KVF_ROLE_PREFILL ||
            !kvf__peer_pulls(p)) {
            kvf__peer_fail(p, KVF_ERR_PROTOCOL, "DATA_REF without an agreed transport "
                           "that pulls");
            return;
        }
        kvf_verdict_t v = p->eng->room_ops->on_data_ref(p, &msg->u.data);
        kvf__peer_heed(p, &v);
        return;
    }
    kvf_verdict_t v = p->eng->peer_events->room_msg(p, msg);
    kvf__peer_heed(p, &v);
}

static void on_data(void *arg, const kvf_msg_data_t *d, kvf_rx_target_t *t)
{
    kvf_peer_t *p = arg;
    if (!p->auth.done) {
        refuse(p, "DATA before authenticating");
        return;
    }
    if (p->state != KVF_PEER_READY || p->role != KVF_ROLE_PREFILL ||
        kvf__peer_main(p)->state != KVF_PEER_READY) {
        kvf__peer_fail(p, KVF_ERR_PROTOCOL, "DATA from a peer that may not send it");
        return;
    }
    kvf_verdict_t v = p->eng->room_ops->on_data(p, d, t);
    kvf__peer_heed(p, &v);
}

/* Place the next bytes of the frame?  Not into a room that is final: its
 * pages may be the application's again (kvf_receiver_pages_released, and
 * a destroy that does not wait, room.c), and a SUCCESS has every byte. */
static int rx_valid(void *arg)
{
    kvf_peer_t *p = arg;
    return p->rx_room != NULL && p->rx_room->attached && !room_final(p->rx_room);
}

/* Parse on while the reads of this peer's DATA_REFs in flight are within
 * the window; beyond it its stream waits (and, through TCP, its sender). */
static int rx_ready(void *arg)
{
    const kvf_peer_t *p = arg;
    return p->read_bytes < KVF_READ_WINDOW;
}

/* The frame's room keeps its pages while the stream writes into them with
 * the lock released: counted like a mover read (room.h, `reads`). */
static void rx_busy(void *arg, int busy)
{
    kvf_peer_t *p = arg;
    kvf_room_t *r = busy ? p->rx_room : p->rx_pinned;
    p->rx_pinned = busy ? r : NULL;
    if (r == NULL)
        return;
    if (busy)
        atomic_fetch_add_explicit(&r->reads, 1, memory_order_relaxed);
    else if (atomic_fetch_sub_explicit(&r->reads, 1, memory_order_release) == 1)
        pthread_cond_broadcast(&p->eng->reads_cond);
}

int kvf__peer_rx_ready(const kvf_peer_t *p)
{
    KVF_ASSERT_LOCKED(p->eng);
    return rx_ready((void *)p);
}

static void on_placed(void *arg, const uint8_t *ptr, size_t n)
{
    kvf_peer_t *p = arg;
    if (p->rx_link != NULL && p->rx_link->hash[p->stream] != NULL)
        XXH3_64bits_update(p->rx_link->hash[p->stream], ptr, n);
}

static void on_data_end(void *arg, uint64_t placed)
{
    kvf_peer_t *p = arg;
    if (p->rx_room == NULL)       /* on_data pointed the frame at no room */
        return;
    kvf_verdict_t v = p->eng->room_ops->on_data_end(p, placed);
    kvf__peer_heed(p, &v);
}

void kvf__peers_tick(kvf_engine_t *eng, uint64_t now)
{
    KVF_ASSERT_LOCKED(eng);
    const kvf_engine_params_t *pr = &eng->params;
    char name[128];

    for (kvf_peer_t *p = eng->peers; p != NULL; p = p->next) {
        /* A connect that hangs, or a handshake that trickles (bytes keep
         * coming, so heartbeats would never call it dead), ends here. */
        if (p->state == KVF_PEER_AUTH && !p->outbound && now >= p->handshake_until_ms &&
            now >= p->grace_until_ms) {
            refuse(p, "did not authenticate within %.1f s (handshake timeout)",
                   (double)pr->handshake_timeout_ms / 1000.0);
            continue;
        }
        if ((p->state == KVF_PEER_CONNECTING || p->state == KVF_PEER_AUTH ||
             p->state == KVF_PEER_HANDSHAKE) &&
            now >= p->handshake_until_ms && now >= p->grace_until_ms) {
            kvf__peer_fail(p, p->state == KVF_PEER_CONNECTING ? KVF_ERR_UNREACHABLE
                                                              : KVF_ERR_PEER_TIMEOUT,
                           "%s not finished within %.1f s (handshake timeout)",
                           p->state == KVF_PEER_CONNECTING ? "connect" : "handshake",
                           (double)pr->handshake_timeout_ms / 1000.0);
            continue;
        }
        if (p->state == KVF_PEER_REDIAL) {
            if (now >= p->redial_at_ms)
                kvf__peer_redial(p, now);
            continue;
        }
        if (p->state == KVF_PEER_DEAD || p->state == KVF_PEER_CONNECTING || p->lingering)
            continue;
        const kvf_transport_ops_t *ops = p->conn->ops;
        if (ops->tick)
            ops->tick(p->conn, now);
        if (p->mep != NULL && p->mep->ops->tick != NULL)
            p->mep->ops->tick(p->mep);
        uint64_t silent = kvf_elapsed_ms(now, ops->last_rx(p->conn));
        if (silent >= pr->heartbeat_timeout_ms && now >= p->grace_until_ms) {
            eng->metrics.heartbeat_losses++;
            kvf__peer_fail(p, KVF_ERR_PEER_TIMEOUT,
                           "sent nothing for %.1f s (heartbeat timeout %.1f s): the "
                           "process is stopped, hung or cut off from the network",
                           (double)silent / 1000.0,
                           (double)pr->heartbeat_timeout_ms / 1000.0);
            continue;
        }
        if (p->state == KVF_PEER_READY &&
            kvf_elapsed_ms(now, ops->last_tx(p->conn)) >= pr->heartbeat_interval_ms &&
            ops->idle(p->conn)) {
            kvf_msg_t m = {.type = KVF_MSG_HEARTBEAT};
            m.u.heartbeat.seq = ++p->hb_seq;
            m.u.heartbeat.time_ns = kvf_now_ns();
            if (kvf__peer_send(p, &m) != KVF_OK)
                kvf_debug("heartbeat to %s not queued", kvf__peer_name(p, name, sizeof(name)));
        }
    }
    /* Unlink dead peers, once their streams' lanes let go of them; their
     * memory lives on while rooms reference it. */
    for (kvf_peer_t **pp = &eng->peers; *pp != NULL;) {
        kvf_peer_t *p = *pp;
        kvf__peer_close_pending(p);
        /* That may have let the lock go (its flush), and another thread
         * added a peer at the head meanwhile: only this thread unlinks, so
         * the walk is intact past the head; start it again from there. */
        if (*pp != p) {
            pp = &eng->peers;
            continue;
        }
        if (p->state == KVF_PEER_DEAD && !kvf__streams_held(p)) {
            *pp = p->next;
            p->next = NULL;
            kvf__peer_put(p);
        } else {
            pp = &p->next;
        }
    }
}

/* ------------------------------------------------------------------------ */
/* Streams                                                                   */
/* ------------------------------------------------------------------------ */

/*
 * Several tcp connections per pair of engines, each driven by a
 * progress thread of its own (a lane), so that one large room moves on
 * more than one core.
 *
 * The one idea: a stream k >= 1 is a peer (kvf_peer_t) in every way that
 * matters to a connection (its own authentication, outbox, inbound frame
 * and lane), and in no way that matters to a room: rooms name only its
 * primary, and whatever fails on a stream fails the primary, which closes
 * every stream.  Order holds per stream: a stream's DONE follows its own
 * DATA frames, and a receiver completes a link only once every stream's
 * DONE has checked (receiver.c).
 *
 * Joining.  The prefill rank's XPORT offer names how many streams it takes
 * and a cookie for this peer (32 random bytes, sent only to a peer that
 * authenticated); a decode rank that wants n > 1 answers with n, then
 * opens streams 1..n-1 to the same control port.  Each authenticates like
 * any connection (AUTH carries KVF_AUTH_F_JOIN, so the prefill sends no
 * HELLO), then sends JOIN (cookie, index).  The prefill attaches it only
 * to the live peer that holds the cookie, from the same engine instance,
 * at a free index below n; anything else closes that connection alone.
 * Lane 0 took the JOIN, so it moves the connection to lane k (rebind)
 * between two passes, and lane k answers the JOIN.  The decode rank's
 * peer is READY, and its rooms send their requests, once every stream
 * has been answered within the handshake deadline.
 */
int kvf__streams_offer(kvf_peer_t *p, uint8_t *blob, kvf_wire_xport_t *e)
{
    KVF_ASSERT_LOCKED(p->eng);
    /* Staged rooms (device memory over tcp) keep to one stream: the bounce
     * buffers and their reads are per connection (stage.h). */
    if (p->eng->nlanes < 2 || kvf__stages(p->eng) ||
        getrandom(p->cookie, sizeof(p->cookie), 0) != (ssize_t)sizeof(p->cookie))
        return 0;
    kvf_put_u32(blob, p->eng->nlanes);
    memcpy(blob + 4, p->cookie, KVF_WIRE_COOKIE_LEN);
    p->streams_offered = 1;
    *e = (kvf_wire_xport_t){{KVF_WIRE_STREAMS_NAME, (uint32_t)strlen(KVF_WIRE_STREAMS_NAME)},
                            blob, KVF_WIRE_STREAMS_OFFER};
    return 1;
}

unsigned kvf__streams_accept(kvf_peer_t *p, const kvf_wire_xport_t *o, uint8_t *blob,
                             kvf_wire_xport_t *answer)
{
    KVF_ASSERT_LOCKED(p->eng);
    if (o == NULL || o->blob_len != KVF_WIRE_STREAMS_OFFER || kvf__stages(p->eng))
        return 1;
    unsigned n = kvf_get_u32(o->blob);
    if (n > p->eng->nlanes)
        n = p->eng->nlanes;
    if (n < 2)
        return 1;
    memcpy(p->cookie, o->blob + 4, KVF_WIRE_COOKIE_LEN);
    kvf_put_u32(blob, n);
    *answer = (kvf_wire_xport_t){{KVF_WIRE_STREAMS_NAME,
                                  (uint32_t)strlen(KVF_WIRE_STREAMS_NAME)},
                                 blob, KVF_WIRE_STREAMS_ANSWER};
    return n;
}

kvf_status_t kvf__streams_answer(kvf_peer_t *p, const kvf_wire_xport_t *e, char *err,
                                 size_t len)
{
    KVF_ASSERT_LOCKED(p->eng);
    uint32_t n = e->blob_len == KVF_WIRE_STREAMS_ANSWER ? kvf_get_u32(e->blob) : 0;
    if (p->eng->nlanes < 2 || n < 2 || n > p->eng->nlanes) {
        snprintf(err, len, "decode engine asked for %u streams (%u-byte entry), but %u "
                 "were offered", n, e->blob_len, p->eng->nlanes < 2 ? 0 : p->eng->nlanes);
        return KVF_ERR_PROTOCOL;
    }
    /* Streams may join before this answer is read (another connection):
     * none beyond what it asks for. */
    for (unsigned k = n; k < KVF_MAX_STREAMS; k++)
        if (p->streams[k] != NULL) {
            snprintf(err, len, "decode engine asked for %u streams after stream %u joined",
                     n, k);
            return KVF_ERR_PROTOCOL;
        }
    p->nstreams = n;
    return KVF_OK;
}

/* A stream of p (k >= 1), owned by lane k from the start (decode side: it
 * dials on its lane, kvf__lane_pass). */
static kvf_peer_t *stream_new(kvf_peer_t *p, unsigned k)
{
    kvf_peer_t *s = calloc(1, sizeof(*s));
    if (s == NULL)
        return NULL;
    s->ev_kind = KVF_EV_PEER;
    s->eng = p->eng;
    s->refs = 1;                          /* p->streams[k] */
    s->state = KVF_PEER_CONNECTING;
    s->outbound = 1;
    s->role = p->role;
    s->tp_rank = p->tp_rank;
    s->instance_id = p->instance_id;
    s->nstreams = 1;
    s->lane = k;
    s->primary = p;
    s->stream = k;
    s->last_hb_ms = kvf_now_ms();
    s->handshake_until_ms = p->handshake_until_ms;
    snprintf(s->addr, sizeof(s->addr), "%s", p->addr);
    return s;
}

void kvf__streams_open(kvf_peer_t *p)
{
    KVF_ASSERT_LOCKED(p->eng);
    for (unsigned k = 1; k < p->nstreams; k++) {
        kvf_peer_t *s = stream_new(p, k);
        if (s == NULL) {
            kvf__peer_fail(p, KVF_ERR_NO_MEMORY, "no memory for stream %u", k);
            return;
        }
        p->streams[k] = s;
        kvf__lane_wake(p->eng, k);
    }
}

/* Decode, lane k: dial stream s, to where its primary was dialled. */
static void stream_dial(kvf_peer_t *s)
{
    kvf_peer_t *p = s->primary;
    kvf_status_t st = kvf__peer_dial(s);
    if (st != KVF_OK) {
        kvf__peer_fail(s, KVF_ERR_UNREACHABLE, "cannot connect to %s:%d: %s", p->dial_host,
                       p->dial_port, kvf_status_str(st));
    }
}

void kvf__stream_authenticated(kvf_peer_t *s)
{
    KVF_ASSERT_LOCKED(s->eng);
    kvf_msg_t m = {.type = KVF_MSG_JOIN};
    memcpy(m.u.join.cookie, s->primary->cookie, KVF_WIRE_COOKIE_LEN);
    m.u.join.stream = s->stream;
    s->state = KVF_PEER_HANDSHAKE;
    kvf_status_t st = kvf__peer_send(s, &m);
    if (st != KVF_OK)
        kvf__peer_fail(s, st, "cannot send JOIN: %s", kvf_status_str(st));
}

/* Prefill: close a connection whose JOIN is refused; nothing else changes. */
static void refuse_join(kvf_peer_t *j, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

static void refuse_join(kvf_peer_t *j, const char *fmt, ...)
{
    char why[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(why, sizeof(why), fmt, ap);
    va_end(ap);
    kvf_warn("refused a stream from %s: %s", j->remote_host, why);
    j->quiet = 1;                  /* said above */
    kvf__peer_fail(j, KVF_ERR_PROTOCOL, "JOIN refused: %s", why);
}

/* Decode: a stream's JOIN was answered; the peer is READY with the last. */
static void join_answered(kvf_peer_t *s, const kvf_msg_join_t *m)
{
    kvf_peer_t *p = s->primary;
    if (s->state != KVF_PEER_HANDSHAKE || m->stream != s->stream ||
        CRYPTO_memcmp(m->cookie, p->cookie, KVF_WIRE_COOKIE_LEN) != 0) {
        kvf__peer_fail(s, KVF_ERR_PROTOCOL, "unexpected JOIN answer (stream %u)", m->stream);
        return;
    }
    s->state = KVF_PEER_READY;
    if (++p->joined + 1 < p->nstreams || p->state != KVF_PEER_HANDSHAKE)
        return;
    kvf_info("prefill rank %d at %s: payload over %u tcp streams", p->tp_rank, p->addr,
             p->nstreams);
    p->state = KVF_PEER_READY;
    p->eng->peer_events->ready(p->eng, p);
}

void kvf__stream_on_join(kvf_peer_t *j, const kvf_msg_join_t *m)
{
    KVF_ASSERT_LOCKED(j->eng);
    kvf_engine_t *eng = j->eng;
    char name[128];

    if (j->outbound) {             /* decode: our stream's answer */
        if (j->primary != NULL)
            join_answered(j, m);
        else
            kvf__peer_fail(j, KVF_ERR_PROTOCOL, "JOIN on the first stream");
        return;
    }
    if (!j->joining) {
        refuse_join(j, "JOIN on a connection that did not announce one in its AUTH "
                    "(a peer's first stream, or a second JOIN)");
        return;
    }
    /* The peer's XPORT answer, on its own connection, may not have been
     * read yet: any live peer that was offered streams, up to the offer
     * (kvf__streams_answer refuses streams beyond the answer). */
    kvf_peer_t *p = NULL;
    for (kvf_peer_t *q = eng->peers; q != NULL && p == NULL; q = q->next)
        if (q != j && q->primary == NULL && q->streams_offered && q->auth.done &&
            q->state != KVF_PEER_DEAD &&
            CRYPTO_memcmp(q->cookie, m->cookie, KVF_WIRE_COOKIE_LEN) == 0)
            p = q;
    if (p == NULL) {
        refuse_join(j, "its cookie names no live peer of this engine");
        return;
    }
    kvf__peer_name(p, name, sizeof(name));
    if (p->auth.theirs.instance_id != j->auth.theirs.instance_id) {
        refuse_join(j, "it authenticated as engine instance %016llx, but the cookie is %s's",
                    (unsigned long long)j->auth.theirs.instance_id, name);
        return;
    }
    unsigned most = p->nstreams > 1 ? p->nstreams : eng->nlanes;
    if (m->stream >= most || p->streams[m->stream] != NULL) {
        refuse_join(j, "stream %u of %s is %s", m->stream, name,
                    m->stream >= most ? "beyond the streams agreed" : "taken");
        return;
    }
    /* Reserved now (a second JOIN for the index is refused); attached to
     * lane k after this pass, when lane 0 no longer holds the connection. */
    p->streams[m->stream] = j;
    j->refs++;                     /* the slot's */
    j->joining = 0;
    j->primary = p;
    j->stream = m->stream;
    j->role = KVF_ROLE_DECODE;     /* what it may send: nothing a decode rank may not */
    j->move_pending = 1;
}

static void stream_detach(kvf_peer_t *s);

/* Lane 0: j's JOIN was taken; hand its connection to lane k. */
static void stream_move(kvf_peer_t *j)
{
    kvf_engine_t *eng = j->eng;
    kvf_peer_t *p = j->primary;
    unsigned k = j->stream;
    kvf_conn_env_t env = {eng->lanes[k].epfd, j, kvf__engine_io_unlock,
                          kvf__engine_io_lock, eng};

    j->move_pending = 0;
    if (j->conn->ops->rebind(j->conn, &env) != KVF_OK) {
        kvf__peer_fail(j, KVF_ERR_IO, "cannot hand stream %u to its thread", k);
        return;
    }
    j->lane = k;
    j->state = KVF_PEER_READY;
    p->joined++;
    kvf_msg_t m = {.type = KVF_MSG_JOIN};
    memcpy(m.u.join.cookie, p->cookie, KVF_WIRE_COOKIE_LEN);
    m.u.join.stream = k;
    kvf__peer_send(j, &m);         /* lane k sends it, in its next pass */
    kvf_debug("stream %u of decode rank %d (%s) attached", k, p->tp_rank, p->addr);
}

void kvf__streams_move(kvf_engine_t *eng)
{
    KVF_ASSERT_LOCKED(eng);
    for (kvf_peer_t **pp = &eng->peers; *pp != NULL;) {
        kvf_peer_t *j = *pp;
        if (!j->move_pending) {
            pp = &j->next;
            continue;
        }
        if (j->state != KVF_PEER_DEAD && !j->close_pending)
            stream_move(j);
        if (j->state == KVF_PEER_DEAD || j->close_pending) {
            /* It, or its peer, failed first: the slot lets go of it here
             * (no lane k ever saw it), the list in peers_tick. */
            j->move_pending = 0;
            stream_detach(j);
            pp = &j->next;
            continue;
        }
        *pp = j->next;                     /* the list's reference goes; the */
        j->next = NULL;                    /* slot's stays */
        j->refs--;
    }
}

void kvf__stream_on_msg(kvf_peer_t *s, const kvf_msg_t *msg)
{
    KVF_ASSERT_LOCKED(s->eng);
    kvf_peer_t *p = s->primary;
    if (s->move_pending) {         /* prefill: nothing may follow its JOIN yet */
        kvf__peer_fail(s, KVF_ERR_PROTOCOL, "%s before stream %u's JOIN was answered",
                       kvf_wire_type_name((uint8_t)msg->type), s->stream);
        return;
    }
    switch (msg->type) {
    case KVF_MSG_JOIN:
        kvf__stream_on_join(s, &msg->u.join);
        return;
    case KVF_MSG_HEARTBEAT:
        return;
    case KVF_MSG_DONE:
        /* Its stream's end: it must name the stream it came on. */
        if (s->state == KVF_PEER_READY && p->role == KVF_ROLE_PREFILL &&
            msg->u.done.streams == p->nstreams && msg->u.done.stream == s->stream) {
            kvf_verdict_t v = p->eng->peer_events->room_msg(p, msg);
            kvf__peer_heed(p, &v);
            return;
        }
        kvf__peer_fail(s, KVF_ERR_PROTOCOL, "DONE for stream %u of %u on stream %u of %u",
                       msg->u.done.stream, msg->u.done.streams, s->stream, p->nstreams);
        return;
    default:
        kvf__peer_fail(s, KVF_ERR_PROTOCOL, "%s on stream %u, which carries payload only",
                       kvf_wire_type_name((uint8_t)msg->type), s->stream);
        return;
    }
}

/*
 * Owner lane, at the top of its pass (never inside a connection's
 * callback: the connection may still be on the stack there): let go of a
 * closed stream.  Its connection is destroyed with it, by lane 0, once
 * nothing else holds it.
 */
static void stream_detach(kvf_peer_t *s)
{
    kvf_peer_t *p = s->primary;
    s->state = KVF_PEER_DEAD;
    s->close_pending = 0;
    s->eng->peer_events->rx_dropped(s);
    if (s->conn != NULL)
        s->conn->ops->shutdown(s->conn);   /* its puts complete, reset */
    kvf__peer_outbox_drain(s);             /* dead: the same for what waits */
    if (p->streams[s->stream] == s)
        p->streams[s->stream] = NULL;
    kvf__peer_put(s);
}

void kvf__streams_close(kvf_peer_t *p)
{
    KVF_ASSERT_LOCKED(p->eng);
    for (unsigned k = 1; k < KVF_MAX_STREAMS; k++) {
        kvf_peer_t *s = p->streams[k];
        if (s == NULL || s->close_pending)
            continue;
        s->state = KVF_PEER_DEAD;
        s->close_pending = 1;
        if (s->conn != NULL && kvf__owns_lane(p->eng, s->lane))
            s->conn->ops->shutdown(s->conn);   /* at once, as for the peer */
        kvf__lane_wake(p->eng, s->lane);
    }
}

void kvf__streams_release(kvf_peer_t *p)
{
    KVF_ASSERT_LOCKED(p->eng);
    for (unsigned k = 1; k < KVF_MAX_STREAMS; k++)
        if (p->streams[k] != NULL) {
            p->streams[k]->state = KVF_PEER_DEAD;
            stream_detach(p->streams[k]);
        }
}

int kvf__streams_held(const kvf_peer_t *p)
{
    KVF_ASSERT_LOCKED(p->eng);
    for (unsigned k = 1; k < KVF_MAX_STREAMS; k++)
        if (p->streams[k] != NULL)
            return 1;
    return 0;
}

void kvf__lane_event(kvf_lane_t *lane, void *ptr, uint32_t events)
{
    KVF_ASSERT_LOCKED(lane->eng);
    /* Only a stream still attached is touched: an event of one this lane
     * let go of earlier in the batch names freed memory. */
    for (kvf_peer_t *p = lane->eng->peers; p != NULL; p = p->next)
        if (p->streams[lane->index] == ptr) {
            kvf_peer_t *s = ptr;
            if (s->lane == lane->index)
                kvf__peer_handle(s, events);
            return;
        }
}

int kvf__lane_pass(kvf_lane_t *lane)
{
    KVF_ASSERT_LOCKED(lane->eng);
    kvf_engine_t *eng = lane->eng;
    unsigned k = lane->index;
    int more = 0;

    for (kvf_peer_t *p = eng->peers; p != NULL; p = p->next) {
        kvf_peer_t *s = p->streams[k];
        if (s == NULL || s->lane != k)
            continue;
        if (s->state == KVF_PEER_DEAD || s->close_pending) {
            stream_detach(s);
            continue;
        }
        if (s->conn == NULL) {     /* decode: dial it */
            stream_dial(s);
            continue;
        }
        if (s->state == KVF_PEER_REDIAL) {   /* decode: refused at the door */
            uint64_t now = kvf_now_ms();
            if (now >= s->redial_at_ms)
                kvf__peer_redial(s, now);
            continue;
        }
        /* Each step may fail the peer, and with it this stream (closed,
         * detached on the next pass): ask again before the next. */
        kvf__peer_outbox_drain(s);
        if (s->state != KVF_PEER_DEAD)
            s->conn->ops->flush(s->conn);
        if (s->state != KVF_PEER_DEAD && s->conn->ops->tick != NULL)
            s->conn->ops->tick(s->conn, kvf_now_ms());
        if (s->state != KVF_PEER_DEAD && s->conn->ops->pending(s->conn)) {
            s->conn->ops->handle(s->conn, EPOLLIN);
            more |= s->state != KVF_PEER_DEAD && s->conn->ops->pending(s->conn);
        }
        more |= s->close_pending;
    }
    return more;
}
