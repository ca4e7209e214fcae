/*
 * What a peer sends, and how it waits: the lowest layer of a peer, which
 * calls nothing of peer.c and nothing above it (only the connection's ops,
 * the codec and the lanes' wake-ups), so that rooms, acks and the
 * handshake all send through it.
 *
 * A connection is driven by its lane alone (sync.h, kvf__owns_lane).  On
 * that lane a message goes to the connection at once; from any other
 * thread it is encoded and waits in the peer's outbox, and the lane is
 * woken to hand it over (kvf__peer_outbox_drain) before anything else it
 * sends.  A put (a chunk's payload) waits the same way, and always
 * completes: on a dead peer, with KVF_ERR_CONN_RESET.  An outbound peer
 * that has not authenticated yet sends nothing of a room's: such messages
 * are held (kvf__peer_hold) and go out once it has, after our HELLO
 * (kvf__peer_send_held).  A room's failure is one more message
 * (kvf__peer_send_fail).  Everything here runs under the engine lock.
 */
#include <assert.h>
#include <stdlib.h>
#include <string.h>

#include "core/peer.h"
#include "core/sync.h"
#include "util/buf.h"
#include "util/log.h"

/* One thing a thread other than the owner sent: a put, or a message
 * encoded at once (its arrays are the caller's). */
typedef struct kvf_outq {
    struct kvf_outq *next;
    kvf_put_t       *put;        /* or NULL: msg[0..len) */
    size_t           len;
    uint8_t          msg[];
} kvf_outq_t;

/* A message encoded into a new entry (its arrays are copied), or NULL:
 * *st_p says why (the codec's refusal, or no memory). */
static kvf_outq_t *outq_encode(const kvf_msg_t *msg, kvf_status_t *st_p)
{
    kvf_buf_t b;
    kvf_buf_init(&b);
    kvf_status_t st = kvf_wire_encode(&b, msg);
    kvf_outq_t *q = st == KVF_OK ? malloc(sizeof(*q) + b.len) : NULL;
    if (q != NULL) {
        q->next = NULL;
        q->put = NULL;
        q->len = b.len;
        memcpy(q->msg, b.data, b.len);
    }
    kvf_buf_free(&b);
    *st_p = st != KVF_OK ? st : q == NULL ? KVF_ERR_NO_MEMORY : KVF_OK;
    return q;
}

/* The message back out of an entry (pointing into it): our own encoding
 * decodes, and the parser checks it all the same.  @return 0 if not. */
static int outq_decode(const kvf_outq_t *q, kvf_msg_t *m)
{
    kvf_wire_hdr_t h;
    char err[128];
    if (kvf_wire_parse_header(q->msg, &h, err, sizeof(err)) == KVF_OK &&
        kvf_wire_decode(&h, q->msg + KVF_WIRE_HDR_LEN, m, err, sizeof(err)) == KVF_OK)
        return 1;
    kvf_error("queued message does not decode: %s (bug)", err);
    return 0;
}

void kvf__peer_outbox_drain(kvf_peer_t *p)
{
    KVF_ASSERT_LOCKED(p->eng);
    assert(kvf__owns_lane(p->eng, p->lane) || (p->out_head == NULL && p->conn == NULL) ||
           (kvf__owns_io(p->eng) && p->state == KVF_PEER_DEAD && p->refs == 0));
    while (p->out_head != NULL) {
        kvf_outq_t *q = p->out_head;
        if ((p->out_head = q->next) == NULL)
            p->out_tail = NULL;
        /* A peer that failed on another thread still sends what it queued
         * first (the FAILs of its rooms): kvf__peer_close_pending. */
        int up = (p->state != KVF_PEER_DEAD || p->close_pending) && p->conn != NULL;
        if (q->put != NULL) {
            if (up)
                p->conn->ops->put(p->conn, q->put);
            else
                q->put->complete(q->put, KVF_ERR_CONN_RESET);
        } else if (up) {
            kvf_msg_t m;
            if (outq_decode(q, &m) && p->conn->ops->send_msg(p->conn, &m) != KVF_OK)
                kvf_debug("queued %s not sent: connection closing",
                          kvf_wire_type_name((uint8_t)m.type));
        }
        free(q);
    }
}

static void outbox_add(kvf_peer_t *p, kvf_outq_t *q)
{
    q->next = NULL;
    if (p->out_tail != NULL)
        p->out_tail->next = q;
    else
        p->out_head = q;
    p->out_tail = q;
    kvf__lane_wake(p->eng, p->lane);
}

kvf_status_t kvf__peer_send(kvf_peer_t *p, const kvf_msg_t *msg)
{
    KVF_ASSERT_LOCKED(p->eng);
    if (p->state == KVF_PEER_DEAD || p->conn == NULL)
        return KVF_ERR_CONN_RESET;
    if (!kvf__owns_lane(p->eng, p->lane)) {
        kvf_status_t st;
        kvf_outq_t *q = outq_encode(msg, &st);
        if (q != NULL)
            outbox_add(p, q);
        return st;
    }
    kvf__peer_outbox_drain(p);   /* what others queued goes first */
    kvf_status_t st = p->conn->ops->send_msg(p->conn, msg);
    if (st == KVF_OK)
        kvf__lane_wake(p->eng, p->lane);
    return st;
}

void kvf__peer_hold(kvf_peer_t *p, const kvf_msg_t *msg)
{
    KVF_ASSERT_LOCKED(p->eng);
    kvf_status_t st;
    kvf_outq_t *q = outq_encode(msg, &st);
    if (q == NULL)
        return;
    if (p->held_tail != NULL)
        p->held_tail->next = q;
    else
        p->held_head = q;
    p->held_tail = q;
}

int kvf__peer_send_soon(kvf_peer_t *p, const kvf_msg_t *msg)
{
    KVF_ASSERT_LOCKED(p->eng);
    if (p->state == KVF_PEER_READY || p->state == KVF_PEER_HANDSHAKE)
        return kvf__peer_send(p, msg) == KVF_OK;
    if ((p->state == KVF_PEER_AUTH || p->state == KVF_PEER_CONNECTING ||
         p->state == KVF_PEER_REDIAL) && p->outbound) {
        kvf__peer_hold(p, msg);          /* sent once it has authenticated */
        return 1;
    }
    return 0;
}

/* A room's failure is a message like any other: built here, sent now or
 * held for a connection still being made (kvf__peer_send_soon). */
int kvf__peer_send_fail(kvf_peer_t *to, uint64_t room, uint64_t instance, uint64_t key,
                        const kvf_failure_t *f, int abort, uint8_t sides)
{
    KVF_ASSERT_LOCKED(to->eng);
    kvf_msg_t m = {.type = abort ? KVF_MSG_ABORT : KVF_MSG_FAIL};
    m.u.fail.sides = sides;
    m.u.fail.room = room;
    m.u.fail.instance = instance;
    m.u.fail.sender_instance = key;
    m.u.fail.status = f->status;
    m.u.fail.origin_side = (uint8_t)f->origin_side;
    m.u.fail.origin_rank = (uint32_t)f->origin_rank;
    m.u.fail.origin_addr = (kvf_wire_str_t){f->origin_addr, (uint32_t)strlen(f->origin_addr)};
    m.u.fail.reason = (kvf_wire_str_t){f->reason, (uint32_t)strlen(f->reason)};
    return kvf__peer_send_soon(to, &m);
}

void kvf__send_fail(kvf_peer_t *to, uint64_t room, uint64_t instance, const kvf_failure_t *f,
                    int abort)
{
    KVF_ASSERT_LOCKED(to->eng);
    kvf__send_fail_keyed(to, room, instance, 0, f, abort);
}

/* Not a live room's record: one this engine failed (a refusal, a tomb, a
 * deadline), so its own side failed, and the record's origin's side. */
void kvf__send_fail_keyed(kvf_peer_t *to, uint64_t room, uint64_t instance, uint64_t key,
                          const kvf_failure_t *f, int abort)
{
    KVF_ASSERT_LOCKED(to->eng);
    kvf__peer_send_fail(to, room, instance, key, f, abort,
                        KVF_SIDE_BIT(f->origin_side) | KVF_SIDE_BIT(to->eng->params.role));
}

void kvf__peer_send_held(kvf_peer_t *p)
{
    KVF_ASSERT_LOCKED(p->eng);
    while (p->held_head != NULL && p->state != KVF_PEER_DEAD) {
        kvf_outq_t *q = p->held_head;
        if ((p->held_head = q->next) == NULL)
            p->held_tail = NULL;
        kvf_msg_t m;
        if (outq_decode(q, &m))
            kvf__peer_send(p, &m);
        free(q);
    }
}

void kvf__peer_put_data(kvf_peer_t *p, kvf_put_t *put)
{
    KVF_ASSERT_LOCKED(p->eng);
    if (p->state == KVF_PEER_DEAD || p->conn == NULL) {
        put->complete(put, KVF_ERR_CONN_RESET);
        return;
    }
    if (!kvf__owns_lane(p->eng, p->lane)) {
        kvf_outq_t *q = malloc(sizeof(*q));
        if (q == NULL) {
            put->complete(put, KVF_ERR_NO_MEMORY);
            return;
        }
        q->put = put;
        q->len = 0;
        outbox_add(p, q);
        return;
    }
    kvf__peer_outbox_drain(p);
    p->conn->ops->put(p->conn, put);
    kvf__lane_wake(p->eng, p->lane);
}

void kvf__peer_held_free(kvf_peer_t *p)
{
    while (p->held_head != NULL) {
        kvf_outq_t *q = p->held_head;
        p->held_head = q->next;
        free(q);
    }
    p->held_tail = NULL;
}
