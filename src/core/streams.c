/*
 * Streams: several tcp connections per pair of engines, each driven by a
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
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/random.h>

#include <openssl/crypto.h>

#include "core/room.h"
#include "core/stage.h"
#include "util/log.h"
#include "util/time.h"

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
    if (s->rx_room != NULL) {
        kvf__room_put(s->rx_room);
        s->rx_room = NULL;
        s->rx_link = NULL;
    }
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
