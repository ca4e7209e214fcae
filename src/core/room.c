/*
 * Rooms: the state machine of one request's transfer, on both sides.
 *
 * A room's poll state only moves up (BOOTSTRAPPING < WAITING_FOR_INPUT <
 * TRANSFERRING < SUCCESS) and FAILED overrides everything; once SUCCESS or
 * FAILED it never changes again, which is what makes "the first root cause
 * wins" hold: a later consequence finds the room final and is dropped.
 *
 * Sender (prefill): collects one destination (ROOM_REQ) per decode rank it
 * feeds, then turns each send() chunk into one put per destination; after
 * the last chunk's put completes it sends DONE with the byte count, and
 * reaches SUCCESS when every destination has acknowledged.
 *
 * Receiver (decode): resolves its prefill ranks (resolver.c), sends its
 * destination to each, checks every inbound DATA segment against the pages
 * and slots it declared before a byte is placed, and reaches SUCCESS when
 * every prefill rank has reported DONE with the byte count it expects.
 */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/engine_int.h"
#include "transport/shm/shm.h"
#include "transport/ucx/ucx.h"
#include "util/log.h"
#include "util/time.h"

#define MAX_RUN_BYTES (1ull << 30)   /* one segment per run at most this big */
#define MAX_LINKS     1024
#define MAX_RETRIES   3              /* reconnects per room */
#define RETRY_BASE_MS 100            /* first reconnect delay; doubles */

struct kvf_sender   { kvf_room_t room; };
struct kvf_receiver { kvf_room_t room; };

static kvf_poll_t room_state(const kvf_room_t *r)
{
    return (kvf_poll_t)atomic_load_explicit(&r->state, memory_order_acquire);
}

static int room_final(const kvf_room_t *r)
{
    kvf_poll_t s = room_state(r);
    return s == KVF_POLL_FAILED || s == KVF_POLL_SUCCESS;
}

static kvf_link_t *link_of(kvf_room_t *r, const kvf_peer_t *p)
{
    for (uint32_t i = 0; i < r->nlinks; i++)
        if (r->links[i].peer == p)
            return &r->links[i];
    return NULL;
}

static uint64_t min_items(const kvf_buffer_t *b, uint32_t n)
{
    uint64_t m = UINT64_MAX;
    for (uint32_t i = 0; i < n; i++)
        if (b[i].length / b[i].item_bytes < m)
            m = b[i].length / b[i].item_bytes;
    return n ? m : 0;
}

/* ------------------------------------------------------------------------ */
/* Lifetime                                                                  */
/* ------------------------------------------------------------------------ */

static void link_free(kvf_link_t *l)
{
    if (l->peer)
        kvf__peer_put(l->peer);
    free(l->pages);
    free(l->state_slots);
    if (l->hash)
        XXH3_freeState(l->hash);
}

void kvf__room_put(kvf_room_t *r)
{
    if (--r->refs > 0)
        return;
    for (uint32_t i = 0; i < r->nlinks; i++)
        link_free(&r->links[i]);
    free(r->links);
    free(r->failure);
    free(r->state_src);
    free(r->src_pages);
    free(r->bootstrap_addr);
    free(r->sorted_pages);
    free(r->pages);
    free(r->state_dst);
    free(r->last_err);
    free(r);
}

static void stats_final(kvf_engine_t *eng, kvf_poll_t s, kvf_status_t st)
{
    if (s == KVF_POLL_SUCCESS) {
        eng->stats.rooms_succeeded++;
        return;
    }
    eng->stats.rooms_failed++;
    if (st <= -40)
        eng->stats.failures_peer++;
    else if (st <= -20)
        eng->stats.failures_room++;
    else
        eng->stats.failures_other++;
}

void kvf__room_set_state(kvf_room_t *r, kvf_poll_t s)
{
    kvf_poll_t cur = room_state(r);
    if (cur == KVF_POLL_FAILED || cur == KVF_POLL_SUCCESS || s <= cur)
        return;
    r->t_state_ms = kvf_now_ms();
    /* Release: a poller that sees SUCCESS also sees the bytes in place. */
    atomic_store_explicit(&r->state, (int)s, memory_order_release);
    if (s == KVF_POLL_SUCCESS)
        stats_final(r->eng, s, KVF_OK);
}

/* ------------------------------------------------------------------------ */
/* Failure                                                                   */
/* ------------------------------------------------------------------------ */

static void send_fail(kvf_room_t *r, kvf_peer_t *to, int abort)
{
    const kvf_failure_t *f = r->failure;
    kvf_msg_t m = {.type = abort ? KVF_MSG_ABORT : KVF_MSG_FAIL};
    m.u.fail.room = r->id;
    m.u.fail.status = f->status;
    m.u.fail.origin_side = (uint8_t)f->origin_side;
    m.u.fail.origin_rank = (uint32_t)f->origin_rank;
    m.u.fail.origin_addr = (kvf_wire_str_t){f->origin_addr, (uint32_t)strlen(f->origin_addr)};
    m.u.fail.reason = (kvf_wire_str_t){f->reason, (uint32_t)strlen(f->reason)};
    if (to->state == KVF_PEER_READY)
        kvf__peer_send(to, &m);
}

/* Record `f` as the room's root cause and tell every peer but `from`. */
static void room_fail_record(kvf_room_t *r, kvf_failure_t *f, kvf_peer_t *from,
                             int abort)
{
    if (room_final(r)) {
        free(f);
        return;
    }
    r->failure = f;
    r->t_state_ms = kvf_now_ms();
    atomic_store_explicit(&r->state, KVF_POLL_FAILED, memory_order_release);
    stats_final(r->eng, KVF_POLL_FAILED, f->status);
    kvf_info("room %llu failed on %s rank %d%s: %s", (unsigned long long)r->id,
             kvf_role_name(r->side), r->eng->params.tp_rank,
             f->from_another_rank ? " (from another rank)" : "", f->reason);
    for (uint32_t i = 0; i < r->nlinks; i++)
        if (r->links[i].peer != from)
            send_fail(r, r->links[i].peer, abort);
    kvf__engine_wake(r->eng);
}

static kvf_failure_t *local_failure(kvf_room_t *r, kvf_status_t st, const char *fmt,
                                    va_list ap)
{
    kvf_failure_t *f = calloc(1, sizeof(*f));
    if (f == NULL)
        return NULL;
    f->status = st;
    f->origin_side = r->side;
    f->origin_rank = r->eng->params.tp_rank;
    snprintf(f->origin_addr, sizeof(f->origin_addr), "%s", r->eng->addr);
    vsnprintf(f->reason, sizeof(f->reason), fmt, ap);
    return f;
}

void kvf__room_fail(kvf_room_t *r, kvf_status_t st, const char *fmt, ...)
{
    va_list ap;
    if (room_final(r))
        return;
    va_start(ap, fmt);
    kvf_failure_t *f = local_failure(r, st, fmt, ap);
    va_end(ap);
    if (f != NULL)
        room_fail_record(r, f, NULL, st == KVF_ERR_ABORTED);
}

static kvf_failure_t *remote_failure(const kvf_msg_fail_t *m)
{
    kvf_failure_t *f = calloc(1, sizeof(*f));
    if (f == NULL)
        return NULL;
    f->status = (kvf_status_t)m->status;
    f->origin_side = (kvf_role_t)m->origin_side;
    f->origin_rank = (int)m->origin_rank;
    f->from_another_rank = 1;
    snprintf(f->origin_addr, sizeof(f->origin_addr), "%.*s", (int)m->origin_addr.len,
             m->origin_addr.ptr);
    snprintf(f->reason, sizeof(f->reason), "%.*s", (int)m->reason.len, m->reason.ptr);
    return f;
}

void kvf__room_fail_remote(kvf_room_t *r, kvf_peer_t *from, int abort,
                           const kvf_msg_fail_t *m)
{
    kvf_failure_t *f = remote_failure(m);
    if (f != NULL)
        room_fail_record(r, f, from, abort);
}

static kvf_status_t consume_failure(kvf_room_t *r, kvf_failure_t *out)
{
    kvf_status_t st;
    pthread_mutex_lock(&r->eng->lock);
    if (room_state(r) != KVF_POLL_FAILED)
        st = KVF_ERR_AGAIN;
    else if (r->failure_consumed || r->failure == NULL)
        st = KVF_ERR_NOT_FOUND;
    else {
        *out = *r->failure;
        r->failure_consumed = 1;
        st = KVF_OK;
    }
    pthread_mutex_unlock(&r->eng->lock);
    return st;
}

/* ------------------------------------------------------------------------ */
/* Creation and destruction (both sides)                                     */
/* ------------------------------------------------------------------------ */

static kvf_status_t room_create(kvf_engine_t *eng, kvf_role_t side, uint64_t id,
                                kvf_room_t **room_p)
{
    if (!eng->registered) {
        kvf_error("room %llu: register the engine's layout first "
                  "(kvf_engine_register_layout)", (unsigned long long)id);
        return KVF_ERR_STATE;
    }
    if (eng->params.role != side) {
        kvf_error("room %llu: a %s engine cannot create a %s", (unsigned long long)id,
                  kvf_role_name(eng->params.role),
                  side == KVF_ROLE_PREFILL ? "sender" : "receiver");
        return KVF_ERR_STATE;
    }
    if (kvf_map_get(&eng->rooms_by_id, id) != NULL) {
        kvf_error("room %llu is already live on this engine; destroy it before "
                  "reusing the id", (unsigned long long)id);
        return KVF_ERR_ROOM_IN_USE;
    }
    kvf_room_t *r = calloc(1, side == KVF_ROLE_PREFILL ? sizeof(kvf_sender_t)
                                                       : sizeof(kvf_receiver_t));
    if (r == NULL || kvf_map_put(&eng->rooms_by_id, id, r) != KVF_OK) {
        free(r);
        return KVF_ERR_NO_MEMORY;
    }
    r->eng = eng;
    r->id = id;
    r->side = side;
    r->refs = 1;
    r->attached = 1;
    r->t_state_ms = kvf_now_ms();
    atomic_init(&r->state, KVF_POLL_BOOTSTRAPPING);
    r->ok_first = 1;          /* empty: no page range checked yet */
    r->ok_last = 0;
    r->next = eng->rooms;
    if (eng->rooms)
        eng->rooms->prev = r;
    eng->rooms = r;
    *room_p = r;
    return KVF_OK;
}

static void room_destroy(kvf_room_t *r)
{
    kvf_engine_t *eng = r->eng;
    pthread_mutex_lock(&eng->lock);
    if (!room_final(r))
        kvf__room_fail(r, KVF_ERR_ABORTED, "room %llu destroyed by the application "
                       "on %s rank %d before it finished", (unsigned long long)r->id,
                       kvf_role_name(r->side), eng->params.tp_rank);
    kvf_map_del(&eng->rooms_by_id, r->id);
    if (r->prev)
        r->prev->next = r->next;
    else
        eng->rooms = r->next;
    if (r->next)
        r->next->prev = r->prev;
    /* From here on no inbound byte is placed into this room's pages:
     * rx_valid() checks `attached` before every placement. */
    r->attached = 0;
    kvf__room_put(r);
    pthread_mutex_unlock(&eng->lock);
}

static void room_abort(kvf_room_t *r)
{
    pthread_mutex_lock(&r->eng->lock);
    kvf__room_fail(r, KVF_ERR_ABORTED, "aborted by the application on %s rank %d",
                   kvf_role_name(r->side), r->eng->params.tp_rank);
    pthread_mutex_unlock(&r->eng->lock);
}

/* ------------------------------------------------------------------------ */
/* Sender                                                                    */
/* ------------------------------------------------------------------------ */

/* One send() chunk toward one destination, produced lazily (transport.h). */
typedef struct chunk_put {
    kvf_put_t   put;
    kvf_room_t *room;
    kvf_peer_t *peer;         /* the connection it was queued on */
    uint32_t    link;
    uint32_t    nruns, run, buf;
    uint32_t    page, tok;    /* sliced: position inside the current run */
    uint32_t    extra;        /* aux then state segments, on the last chunk */
    int         last;
    kvf_run_t   runs[];
} chunk_put_t;

/*
 * The next KV segment: a whole run of pages per buffer, or, when the link
 * carries a slice of the heads, the slice of one token (a run of heads is
 * contiguous inside a token on both sides, tokens are not).
 */
static int next_kv(chunk_put_t *c, const kvf_layout_int_t *l, const kvf_link_t *lk,
                   kvf_wire_seg_t *seg, const void **src)
{
    const kvf_slice_t *sl = &lk->slice;
    while (c->buf < l->num_kv && c->run >= c->nruns) {
        c->buf++;
        c->run = c->page = c->tok = 0;
    }
    if (c->buf >= l->num_kv)
        return 0;
    const kvf_run_t *run = &c->runs[c->run];
    const uint8_t *base = l->kv[c->buf].base;
    uint32_t dbuf = c->buf + sl->dst_buf0;
    if (!sl->sliced) {
        size_t ib = l->kv[c->buf].item_bytes;
        *seg = (kvf_wire_seg_t){KVF_BUF_KV, dbuf, (uint64_t)run->dst * ib,
                                (uint32_t)(run->count * ib)};
        *src = base + (size_t)run->src * ib;
        c->run++;
        return 1;
    }
    uint64_t ps = l->page_size, bph = l->bytes_per_head;
    uint64_t stok = ((uint64_t)run->src + c->page) * ps + c->tok;
    uint64_t dtok = ((uint64_t)run->dst + c->page) * ps + c->tok;
    *seg = (kvf_wire_seg_t){KVF_BUF_KV, dbuf,
                            (dtok * lk->peer->layout.heads_per_rank + sl->dst_head) * bph,
                            (uint32_t)(sl->nheads * bph)};
    *src = base + (stok * l->heads_per_rank + sl->src_head) * bph;
    if (++c->tok == ps) {
        c->tok = 0;
        if (++c->page == run->count) {
            c->page = 0;
            c->run++;
        }
    }
    return 1;
}

static int chunk_next(kvf_put_t *put, kvf_wire_seg_t *seg, const void **src)
{
    chunk_put_t *c = (chunk_put_t *)put;
    kvf_room_t *r = c->room;
    kvf_engine_t *eng = r->eng;
    const kvf_layout_int_t *l = &eng->layout;
    kvf_link_t *lk = &r->links[c->link];

    if (room_state(r) == KVF_POLL_FAILED)
        return r->failure ? r->failure->status : KVF_ERR_ABORTED;
    if (next_kv(c, l, lk, seg, src)) {
        /* produced */
    } else if (c->last && lk->aux_slot != KVF_NO_SLOT && c->extra < l->num_aux) {
        uint32_t i = c->extra++;
        size_t ib = l->aux[i].item_bytes;
        *seg = (kvf_wire_seg_t){KVF_BUF_AUX, i, (uint64_t)lk->aux_slot * ib, (uint32_t)ib};
        *src = (const uint8_t *)l->aux[i].base + (size_t)r->aux_slot * ib;
    } else if (c->last && lk->n_state > 0 && c->extra < l->num_aux + l->num_state) {
        if (c->extra < l->num_aux)
            c->extra = l->num_aux;
        uint32_t i = c->extra++ - l->num_aux;
        size_t ib = l->state[i].item_bytes;
        *seg = (kvf_wire_seg_t){KVF_BUF_STATE, i, (uint64_t)lk->state_slots[i] * ib,
                                (uint32_t)ib};
        *src = (const uint8_t *)l->state[i].base + (size_t)r->state_src[i] * ib;
    } else {
        return 0;
    }
    lk->bytes += seg->len;
    eng->stats.bytes_sent += seg->len;
    r->t_state_ms = eng->now_ms;     /* per segment: the progress thread's clock */
    if (lk->hash)
        XXH3_64bits_update(lk->hash, *src, seg->len);
    return 1;
}

static int all_done(const kvf_room_t *r)
{
    for (uint32_t i = 0; i < r->nlinks; i++)
        if (!r->links[i].done)
            return 0;
    return r->nlinks == r->expected_links;
}

static void send_done(kvf_room_t *r, kvf_link_t *lk)
{
    kvf_msg_t m = {.type = KVF_MSG_DONE};
    m.u.done.room = r->id;
    m.u.done.src_rank = (uint32_t)r->eng->params.tp_rank;
    m.u.done.bytes = lk->bytes;
    if (lk->hash) {
        m.u.done.has_checksum = 1;
        m.u.done.checksum = XXH3_64bits_digest(lk->hash);
    }
    kvf__peer_send(lk->peer, &m);
}

/*
 * Puts on one connection complete in order, so when the last chunk's put
 * completes, everything before it is in the stream too: DONE may follow.
 * A put from a connection the link has since left (a resumed link) is
 * stale: its outcome no longer matters.
 */
static void chunk_complete(kvf_put_t *put, kvf_status_t st)
{
    chunk_put_t *c = (chunk_put_t *)put;
    kvf_room_t *r = c->room;
    kvf_link_t *lk = &r->links[c->link];
    char name[128];

    if (c->peer != lk->peer || room_final(r)) {
        /* stale, or nothing left to do */
    } else if (st != KVF_OK) {
        if (!lk->broken)   /* broken: the room waits for a reconnect */
            kvf__room_fail(r, st, "transfer to %s failed: %s",
                           kvf__peer_name(lk->peer, name, sizeof(name)),
                           kvf_status_str(st));
    } else if (c->last) {
        send_done(r, lk);
    }
    kvf__peer_put(c->peer);
    kvf__room_put(r);
    free(c);
}

/* Queue src[i] -> the link's destination page dst_off + i, i < n. */
static kvf_status_t queue_chunk(kvf_room_t *r, uint32_t li, const uint32_t *pages,
                                uint32_t dst_off, size_t n, int last)
{
    kvf_link_t *lk = &r->links[li];
    chunk_put_t *c = malloc(sizeof(*c) + n * sizeof(kvf_run_t));
    if (c == NULL)
        return KVF_ERR_NO_MEMORY;
    uint64_t max_ib = 1;
    for (uint32_t i = 0; i < r->eng->layout.num_kv; i++)
        if (r->eng->layout.kv[i].item_bytes > max_ib)
            max_ib = r->eng->layout.kv[i].item_bytes;
    memset(c, 0, sizeof(*c));
    c->nruns = (uint32_t)kvf__plan_runs(pages, lk->pages + dst_off, n,
                                        (uint32_t)(MAX_RUN_BYTES / max_ib), c->runs);
    c->put.next = chunk_next;
    c->put.complete = chunk_complete;
    c->put.room = r->id;
    c->put.src_rank = (uint32_t)r->eng->params.tp_rank;
    c->put.by_ref = lk->peer->xport == KVF_XPORT_SHM || lk->peer->xport == KVF_XPORT_UCX;
    c->room = r;
    c->peer = lk->peer;
    c->link = li;
    c->last = last;
    r->refs++;
    lk->peer->refs++;
    if (last)
        lk->last_queued = 1;
    if (lk->peer->conn == NULL)
        chunk_complete(&c->put, KVF_ERR_CONN_RESET);
    else
        lk->peer->conn->ops->put(lk->peer->conn, &c->put);
    return KVF_OK;
}

static int want_checksum(const kvf_engine_t *eng, const kvf_peer_t *p)
{
    return eng->params.checksum || p->checksum;
}

/* A decode rank's destination for a live sender. */
static void add_destination(kvf_room_t *r, kvf_peer_t *p, kvf_link_t *dst,
                            uint32_t expected)
{
    char name[128];
    kvf__peer_name(p, name, sizeof(name));

    if (room_final(r)) {
        if (room_state(r) == KVF_POLL_FAILED) {
            send_fail(r, p, 0);
        } else {
            kvf_failure_t f = {.status = KVF_ERR_ROOM_CONFLICT, .origin_side = r->side,
                               .origin_rank = r->eng->params.tp_rank};
            snprintf(f.origin_addr, sizeof(f.origin_addr), "%s", r->eng->addr);
            snprintf(f.reason, sizeof(f.reason), "room %llu already completed on "
                     "prefill rank %d; a room id must not be reused while its sender "
                     "is alive", (unsigned long long)r->id, r->eng->params.tp_rank);
            kvf_failure_t *keep = r->failure;
            r->failure = &f;
            send_fail(r, p, 0);
            r->failure = keep;
        }
        goto out;
    }
    if (expected == 0 || expected > MAX_LINKS) {
        kvf__room_fail(r, KVF_ERR_PROTOCOL, "%s announced %u receivers for room %llu",
                       name, expected, (unsigned long long)r->id);
        goto out;
    }
    if (r->links == NULL) {
        r->links = calloc(expected, sizeof(kvf_link_t));
        if (r->links == NULL) {
            kvf__room_fail(r, KVF_ERR_NO_MEMORY, "no memory for room destinations");
            goto out;
        }
        r->expected_links = expected;
    } else if (expected != r->expected_links) {
        kvf__room_fail(r, KVF_ERR_PROTOCOL, "%s announced %u receivers for room %llu, "
                       "another decode rank announced %u", name, expected,
                       (unsigned long long)r->id, r->expected_links);
        goto out;
    }
    if (link_of(r, p) != NULL || r->nlinks == r->expected_links) {
        kvf__room_fail(r, KVF_ERR_ROOM_CONFLICT, "%s sent a second destination for "
                       "room %llu while the room is live (room id reused?)", name,
                       (unsigned long long)r->id);
        goto out;
    }
    kvf_par_t mine, theirs;
    char err[KVF_REASON_MAX - 128];
    kvf__par_fill(&mine, r->eng->params.tp_rank, r->eng->params.tp_size,
                  r->eng->params.pp_rank, r->eng->params.pp_size, &r->eng->layout);
    kvf__par_fill(&theirs, p->tp_rank, p->tp_size, p->pp_rank, p->pp_size, &p->layout);
    kvf_status_t st = kvf__plan_slice(&mine, &theirs, &dst->slice, err, sizeof(err));
    dst->idle = dst->n_pages == 0;
    if (st == KVF_ERR_NOT_FOUND ? !dst->idle : st != KVF_OK) {
        kvf__room_fail(r, st == KVF_ERR_NOT_FOUND ? KVF_ERR_BAD_INDICES : st,
                       "%s asked for room %llu's KV from prefill rank %d, which %s", name,
                       (unsigned long long)r->id, r->eng->params.tp_rank,
                       st == KVF_ERR_NOT_FOUND ? "holds none of its heads" : err);
        goto out;
    }
    if (r->initialized && !dst->idle && dst->n_pages != r->num_pages) {
        kvf__room_fail(r, KVF_ERR_BAD_INDICES, "%s declared %u pages for room %llu, "
                       "but the prefill side declared %u (kvf_sender_init num_pages)",
                       name, dst->n_pages, (unsigned long long)r->id, r->num_pages);
        goto out;
    }
    kvf_link_t *lk = &r->links[r->nlinks++];
    *lk = *dst;
    memset(dst, 0, sizeof(*dst));
    lk->peer = p;
    p->refs++;
    if (!lk->idle && want_checksum(r->eng, p) && (lk->hash = XXH3_createState()) != NULL)
        XXH3_64bits_reset(lk->hash);
    if (r->nlinks == r->expected_links)
        kvf__room_set_state(r, KVF_POLL_WAITING_FOR_INPUT);
    return;
out:
    free(dst->pages);
    free(dst->state_slots);
    memset(dst, 0, sizeof(*dst));
}

static void stash_apply(kvf_room_t *r)
{
    kvf_stash_t *s = kvf_map_del(&r->eng->stash, r->id);
    while (s != NULL) {
        kvf_stash_t *n = s->next;
        char name[128];
        if (s->failure != NULL) {
            if (!room_final(r)) {
                room_fail_record(r, s->failure, s->peer, s->failure->status == KVF_ERR_ABORTED);
                s->failure = NULL;
            }
        } else if (s->peer->state == KVF_PEER_DEAD) {
            kvf__room_fail(r, KVF_ERR_CONN_RESET, "%s disconnected before the sender "
                           "for room %llu was created",
                           kvf__peer_name(s->peer, name, sizeof(name)),
                           (unsigned long long)r->id);
        } else {
            add_destination(r, s->peer, &s->link, s->expected);
        }
        free(s->link.pages);
        free(s->link.state_slots);
        free(s->failure);
        kvf__peer_put(s->peer);
        free(s);
        s = n;
    }
}

kvf_status_t kvf_sender_create(kvf_engine_t *eng, const char *bootstrap_addr,
                               uint64_t room, kvf_sender_t **sender_p)
{
    kvf_room_t *r;
    if (eng == NULL || sender_p == NULL)
        return KVF_ERR_INVALID_PARAM;
    pthread_mutex_lock(&eng->lock);
    kvf_status_t st = room_create(eng, KVF_ROLE_PREFILL, room, &r);
    if (st == KVF_OK) {
        if (bootstrap_addr && eng->bootstrap_addr &&
            strcmp(bootstrap_addr, eng->bootstrap_addr) != 0)
            kvf_debug("room %llu: bootstrap address %s differs from the engine's %s",
                      (unsigned long long)room, bootstrap_addr, eng->bootstrap_addr);
        stash_apply(r);
        *sender_p = (kvf_sender_t *)r;
    }
    pthread_mutex_unlock(&eng->lock);
    return st;
}

kvf_status_t kvf_sender_init(kvf_sender_t *s, uint32_t num_pages, uint32_t aux_slot)
{
    kvf_room_t *r = &s->room;
    kvf_engine_t *eng = r->eng;
    const kvf_layout_int_t *l = &eng->layout;
    kvf_status_t st = KVF_OK;

    pthread_mutex_lock(&eng->lock);
    if (r->initialized) {
        kvf_error("room %llu: kvf_sender_init called twice", (unsigned long long)r->id);
        st = KVF_ERR_STATE;
    } else if (num_pages == 0) {
        kvf_error("room %llu: num_pages must be positive", (unsigned long long)r->id);
        st = KVF_ERR_INVALID_PARAM;
    } else if (l->num_aux > 0 && aux_slot >= min_items(l->aux, l->num_aux)) {
        kvf_error("room %llu: aux slot %u outside the registered aux buffers (%llu slots)",
                  (unsigned long long)r->id, aux_slot,
                  (unsigned long long)min_items(l->aux, l->num_aux));
        st = KVF_ERR_OUT_OF_RANGE;
    } else {
        r->src_pages = malloc(num_pages * sizeof(uint32_t));
        if (r->src_pages == NULL) {
            pthread_mutex_unlock(&eng->lock);
            return KVF_ERR_NO_MEMORY;
        }
        r->num_pages = num_pages;
        r->aux_slot = aux_slot;
        r->initialized = 1;
        for (uint32_t i = 0; i < r->nlinks; i++) {
            char name[128];
            if (!r->links[i].idle && r->links[i].n_pages != num_pages) {
                kvf__room_fail(r, KVF_ERR_BAD_INDICES, "%s declared %u pages for room "
                               "%llu, but the prefill side declared %u",
                               kvf__peer_name(r->links[i].peer, name, sizeof(name)),
                               r->links[i].n_pages, (unsigned long long)r->id, num_pages);
                break;
            }
        }
    }
    pthread_mutex_unlock(&eng->lock);
    return st;
}

kvf_status_t kvf_sender_set_state(kvf_sender_t *s, const uint32_t *slots, size_t n)
{
    kvf_room_t *r = &s->room;
    const kvf_layout_int_t *l = &r->eng->layout;
    kvf_status_t st = KVF_OK;

    if (n != l->num_state || (n > 0 && slots == NULL)) {
        kvf_error("room %llu: %zu state slots given, %u state buffers registered",
                  (unsigned long long)r->id, n, l->num_state);
        return KVF_ERR_INVALID_PARAM;
    }
    for (size_t i = 0; i < n; i++) {
        if (slots[i] >= l->state[i].length / l->state[i].item_bytes) {
            kvf_error("room %llu: state slot %u outside state buffer %zu",
                      (unsigned long long)r->id, slots[i], i);
            return KVF_ERR_OUT_OF_RANGE;
        }
    }
    pthread_mutex_lock(&r->eng->lock);
    if (r->last_sent || r->state_src != NULL) {
        st = KVF_ERR_STATE;
    } else if (n > 0) {
        r->state_src = malloc(n * sizeof(uint32_t));
        if (r->state_src == NULL)
            st = KVF_ERR_NO_MEMORY;
        else {
            memcpy(r->state_src, slots, n * sizeof(uint32_t));
            r->n_state_src = (uint32_t)n;
        }
    }
    pthread_mutex_unlock(&r->eng->lock);
    return st;
}

kvf_status_t kvf_sender_send(kvf_sender_t *s, const uint32_t *pages, size_t n,
                             int is_last)
{
    kvf_room_t *r = &s->room;
    kvf_engine_t *eng = r->eng;
    const char *why = NULL;
    kvf_status_t st = KVF_ERR_STATE;
    uint64_t items = min_items(eng->layout.kv, eng->layout.num_kv);

    if (n > 0 && pages == NULL)
        return KVF_ERR_INVALID_PARAM;
    for (size_t i = 0; i < n; i++) {
        if (pages[i] >= items) {
            kvf_error("room %llu: page %u (chunk index %zu) outside the registered KV "
                      "buffers (%llu pages); nothing sent", (unsigned long long)r->id,
                      pages[i], i, (unsigned long long)items);
            return KVF_ERR_OUT_OF_RANGE;
        }
    }
    pthread_mutex_lock(&eng->lock);
    kvf_poll_t state = room_state(r);
    if (!r->initialized)
        why = "kvf_sender_init was not called";
    else if (r->last_sent)
        why = "the last chunk was already sent";
    else if (state == KVF_POLL_FAILED)
        why = "the room failed";
    else if (state < KVF_POLL_WAITING_FOR_INPUT)
        why = "the room is still Bootstrapping (poll until WaitingForInput)";
    else if (n > r->num_pages - r->pages_sent) {
        why = "more pages than kvf_sender_init declared";
        st = KVF_ERR_OUT_OF_RANGE;
    } else if (is_last && r->pages_sent + n != r->num_pages) {
        why = "the last chunk leaves declared pages unsent";
        st = KVF_ERR_INVALID_PARAM;
    } else if (n == 0 && !is_last) {
        why = "an empty chunk that is not the last";
        st = KVF_ERR_INVALID_PARAM;
    } else {
        for (uint32_t i = 0; i < r->nlinks && r->links[i].n_state > 0 && is_last; i++) {
            if (r->n_state_src == 0) {
                why = "the decode side declared state slots: call kvf_sender_set_state "
                      "before the last chunk";
                st = KVF_ERR_STATE;
                break;
            }
        }
    }
    if (why == NULL) {
        st = KVF_OK;
        memcpy(r->src_pages + r->pages_sent, pages, n * sizeof(uint32_t));
        for (uint32_t i = 0; i < r->nlinks && st == KVF_OK; i++) {
            kvf_link_t *lk = &r->links[i];
            if (lk->idle)            /* nothing to send: done with the last chunk */
                lk->done = is_last;
            else if (!lk->broken)    /* a resumed link gets it all again */
                st = queue_chunk(r, i, pages, r->pages_sent, n, is_last);
        }
        if (st != KVF_OK) {
            kvf__room_fail(r, st, "cannot queue chunk: %s", kvf_status_str(st));
        } else {
            r->pages_sent += (uint32_t)n;
            r->last_sent = is_last;
            kvf__room_set_state(r, KVF_POLL_TRANSFERRING);
            if (all_done(r))
                kvf__room_set_state(r, KVF_POLL_SUCCESS);
        }
    } else {
        kvf_error("room %llu: send of %zu pages (pages %u..%zu of %u%s) refused: %s",
                  (unsigned long long)r->id, n, r->pages_sent, r->pages_sent + n,
                  r->num_pages, is_last ? ", last" : "", why);
    }
    pthread_mutex_unlock(&eng->lock);
    if (st == KVF_OK)
        kvf__engine_wake(eng);
    return st;
}

kvf_poll_t kvf_sender_poll(const kvf_sender_t *s) { return room_state(&s->room); }
kvf_status_t kvf_sender_failure(kvf_sender_t *s, kvf_failure_t *f)
{
    return consume_failure(&s->room, f);
}
void kvf_sender_abort(kvf_sender_t *s) { room_abort(&s->room); }
void kvf_sender_destroy(kvf_sender_t *s)
{
    if (s != NULL)
        room_destroy(&s->room);
}
uint64_t kvf_sender_room(const kvf_sender_t *s) { return s->room.id; }

/* ------------------------------------------------------------------------ */
/* Receiver                                                                  */
/* ------------------------------------------------------------------------ */

kvf_status_t kvf_receiver_create(kvf_engine_t *eng, const char *bootstrap_addr,
                                 uint64_t room, int prefill_dp_rank,
                                 kvf_receiver_t **receiver_p)
{
    kvf_room_t *r;
    if (eng == NULL || receiver_p == NULL || bootstrap_addr == NULL ||
        strchr(bootstrap_addr, ':') == NULL || prefill_dp_rank < -1) {
        kvf_error("receiver: need an engine, a bootstrap address host:port and a "
                  "prefill DP rank >= -1");
        return KVF_ERR_INVALID_PARAM;
    }
    pthread_mutex_lock(&eng->lock);
    kvf_status_t st = room_create(eng, KVF_ROLE_DECODE, room, &r);
    if (st == KVF_OK) {
        r->dp_rank = prefill_dp_rank;
        r->bootstrap_addr = strdup(bootstrap_addr);
        if (r->bootstrap_addr == NULL)
            kvf__room_fail(r, KVF_ERR_NO_MEMORY, "no memory");
        else
            kvf__resolver_enqueue(eng, r);
        *receiver_p = (kvf_receiver_t *)r;
    }
    pthread_mutex_unlock(&eng->lock);
    return st;
}

static int cmp_u32(const void *a, const void *b)
{
    uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
    return x < y ? -1 : x > y;
}

kvf_status_t kvf_receiver_init(kvf_receiver_t *rv, const uint32_t *pages, size_t n,
                               uint32_t aux_slot, const uint32_t *state_slots,
                               size_t n_state)
{
    kvf_room_t *r = &rv->room;
    kvf_engine_t *eng = r->eng;
    const kvf_layout_int_t *l = &eng->layout;
    uint64_t items = min_items(l->kv, l->num_kv);
    unsigned long long id = r->id;

    if (n == 0 || pages == NULL || n > UINT32_MAX) {
        kvf_error("room %llu: kvf_receiver_init needs at least one page", id);
        return KVF_ERR_INVALID_PARAM;
    }
    for (size_t i = 0; i < n; i++) {
        if (pages[i] >= items) {
            kvf_error("room %llu: page %u (index %zu) outside the registered KV buffers "
                      "(%llu pages)", id, pages[i], i, (unsigned long long)items);
            return KVF_ERR_OUT_OF_RANGE;
        }
    }
    if (l->num_aux > 0 && aux_slot >= min_items(l->aux, l->num_aux)) {
        kvf_error("room %llu: aux slot %u outside the registered aux buffers", id, aux_slot);
        return KVF_ERR_OUT_OF_RANGE;
    }
    if (n_state != 0 && (n_state != l->num_state || state_slots == NULL)) {
        kvf_error("room %llu: %zu state slots given, %u state buffers registered", id,
                  n_state, l->num_state);
        return KVF_ERR_INVALID_PARAM;
    }
    for (size_t i = 0; i < n_state; i++) {
        if (state_slots[i] >= l->state[i].length / l->state[i].item_bytes) {
            kvf_error("room %llu: state slot %u outside state buffer %zu", id,
                      state_slots[i], i);
            return KVF_ERR_OUT_OF_RANGE;
        }
    }
    uint32_t *sorted = malloc(n * sizeof(uint32_t));
    uint32_t *copy = malloc(n * sizeof(uint32_t));
    uint32_t *st_copy = n_state ? malloc(n_state * sizeof(uint32_t)) : NULL;
    if (sorted == NULL || copy == NULL || (n_state && st_copy == NULL)) {
        free(sorted);
        free(copy);
        free(st_copy);
        return KVF_ERR_NO_MEMORY;
    }
    memcpy(copy, pages, n * sizeof(uint32_t));
    memcpy(sorted, pages, n * sizeof(uint32_t));
    qsort(sorted, n, sizeof(uint32_t), cmp_u32);
    for (size_t i = 1; i < n; i++) {
        if (sorted[i] == sorted[i - 1]) {
            kvf_error("room %llu: page %u appears twice in the destination", id, sorted[i]);
            free(sorted);
            free(copy);
            free(st_copy);
            return KVF_ERR_INVALID_PARAM;
        }
    }
    if (n_state)
        memcpy(st_copy, state_slots, n_state * sizeof(uint32_t));

    kvf_status_t st = KVF_OK;
    pthread_mutex_lock(&eng->lock);
    if (r->initialized) {
        kvf_error("room %llu: kvf_receiver_init called twice", id);
        st = KVF_ERR_STATE;
    } else {
        r->pages = copy;
        r->sorted_pages = sorted;
        r->n_pages = (uint32_t)n;
        r->aux_slot = aux_slot;
        r->state_dst = st_copy;
        r->n_state_dst = (uint32_t)n_state;
        r->initialized = 1;
        copy = sorted = st_copy = NULL;
        kvf__room_try_request(r);
    }
    pthread_mutex_unlock(&eng->lock);
    free(copy);
    free(sorted);
    free(st_copy);
    if (st == KVF_OK)
        kvf__engine_wake(eng);
    return st;
}

kvf_poll_t kvf_receiver_poll(const kvf_receiver_t *rv) { return room_state(&rv->room); }
kvf_status_t kvf_receiver_failure(kvf_receiver_t *rv, kvf_failure_t *f)
{
    return consume_failure(&rv->room, f);
}
void kvf_receiver_abort(kvf_receiver_t *rv) { room_abort(&rv->room); }

int kvf_receiver_pages_released(const kvf_receiver_t *rv)
{
    /* Placement happens under the engine lock and checks that the room is
     * live first (kvf__room_on_data, rx_valid); the final state is stored
     * under the same lock, so once it is visible no write is in progress
     * or can start. */
    return room_final(&rv->room);
}
void kvf_receiver_destroy(kvf_receiver_t *rv)
{
    if (rv != NULL)
        room_destroy(&rv->room);
}
uint64_t kvf_receiver_room(const kvf_receiver_t *rv) { return rv->room.id; }

void kvf__room_try_request(kvf_room_t *r)
{
    kvf_engine_t *eng = r->eng;
    char name[128];

    if (!r->initialized || r->nlinks == 0 || room_final(r))
        return;
    /* Wait for every handshake before judging, so that a refusal reaches
     * every prefill rank of the room. */
    for (uint32_t i = 0; i < r->nlinks; i++) {
        kvf_peer_t *p = r->links[i].peer;
        if (r->links[i].broken)
            return;
        if (p->state == KVF_PEER_DEAD) {
            char why[160];
            snprintf(why, sizeof(why), "cannot reach %s",
                     kvf__peer_name(p, name, sizeof(name)));
            if (r->links[i].resume_instance != 0 && r->retries < MAX_RETRIES) {
                r->links[i].broken = 1;
                r->retries++;
                r->retry_at_ms = kvf_now_ms() + (RETRY_BASE_MS << (r->retries - 1));
                return;
            }
            if (r->retries > 0)
                kvf__room_fail(r, KVF_ERR_UNREACHABLE, "%s after %u reconnects; the "
                               "connection was lost first: %s", why, r->retries,
                               r->last_err ? r->last_err : "unknown");
            else
                kvf__room_fail(r, KVF_ERR_UNREACHABLE, "%s", why);
            return;
        }
        if (p->state != KVF_PEER_READY)
            return;
        if (r->links[i].resume_instance != 0 &&
            r->links[i].resume_instance != p->instance_id) {
            kvf__room_fail(r, KVF_ERR_PEER_RESTARTED, "%s restarted (instance %016llx, "
                           "was %016llx) while room %llu was in flight: its KV for the "
                           "room is gone", kvf__peer_name(p, name, sizeof(name)),
                           (unsigned long long)p->instance_id,
                           (unsigned long long)r->links[i].resume_instance,
                           (unsigned long long)r->id);
            return;
        }
    }
    for (uint32_t i = 0; i < r->nlinks; i++) {
        if (r->links[i].peer->incompatible) {
            kvf__room_fail(r, KVF_ERR_INCOMPATIBLE, "%s", r->links[i].peer->incompatible);
            return;
        }
    }
    /* Which links carry data, which one also carries aux and state (the
     * last pipeline stage's lowest TP rank), and how many bytes each owes. */
    kvf_par_t mine, theirs;
    kvf__par_fill(&mine, eng->params.tp_rank, eng->params.tp_size, eng->params.pp_rank,
                  eng->params.pp_size, &eng->layout);
    int designated = -1;
    for (uint32_t i = 0; i < r->nlinks; i++) {
        kvf_link_t *lk = &r->links[i];
        kvf_peer_t *p = lk->peer;
        char err[256];
        kvf__par_fill(&theirs, p->tp_rank, p->tp_size, p->pp_rank, p->pp_size, &p->layout);
        kvf_status_t st = kvf__plan_slice(&theirs, &mine, &lk->slice, err, sizeof(err));
        lk->idle = st == KVF_ERR_NOT_FOUND;
        if (lk->idle)
            continue;
        if (st != KVF_OK) {
            kvf__room_fail(r, st, "%s", err);
            return;
        }
        kvf_peer_t *d = designated < 0 ? NULL : r->links[designated].peer;
        if (d == NULL || p->pp_rank > d->pp_rank ||
            (p->pp_rank == d->pp_rank && p->tp_rank < d->tp_rank))
            designated = (int)i;
    }
    for (uint32_t i = 0; i < r->nlinks; i++) {
        kvf_link_t *lk = &r->links[i];
        kvf_peer_t *p = lk->peer;
        int aux = (int)i == designated;
        if (lk->req_sent)
            continue;
        kvf_msg_t m = {.type = KVF_MSG_ROOM_REQ};
        m.u.room_req.room = r->id;
        m.u.room_req.dst_rank = (uint32_t)eng->params.tp_rank;
        m.u.room_req.aux_slot = aux ? r->aux_slot : KVF_NO_SLOT;
        m.u.room_req.attempt = lk->resume_instance ? r->retries : 0;
        uint64_t per_page = 0;
        if (lk->idle) {
            /* Tell it the room exists; it owes nothing. */
            m.u.room_req.expected_receivers = 1;
        } else {
            int src[KVF_MAX_SOURCES], n = 0;
            for (int d = 0; d < eng->params.tp_size; d++) {
                int k = kvf__sources(eng->layout.attn, eng->layout.total_heads, p->tp_size,
                                     eng->params.tp_size, d, src);
                for (int j = 0; j < k; j++)
                    n += src[j] == p->tp_rank;
            }
            m.u.room_req.expected_receivers = (uint32_t)n;
            m.u.room_req.pages = (kvf_wire_arr32_t){r->n_pages, r->pages, NULL};
            if (aux)
                m.u.room_req.state_slots =
                    (kvf_wire_arr32_t){r->n_state_dst, r->state_dst, NULL};
            for (uint32_t b = 0; b < p->layout.num_kv; b++)
                per_page += lk->slice.sliced
                    ? (uint64_t)eng->layout.page_size * lk->slice.nheads *
                          eng->layout.bytes_per_head
                    : p->layout.kv[b].item_bytes;
        }
        /* A resumed link starts over: the prefill rank resends everything. */
        lk->expected = r->n_pages * per_page +
            (aux ? eng->aux_item_bytes_sum +
                   (r->n_state_dst ? eng->state_item_bytes_sum : 0) : 0);
        lk->bytes = 0;
        lk->done = lk->idle;
        if (lk->hash == NULL && !lk->idle && want_checksum(eng, p))
            lk->hash = XXH3_createState();
        if (lk->hash)
            XXH3_64bits_reset(lk->hash);
        kvf_status_t st = kvf__peer_send(p, &m);
        if (st != KVF_OK) {
            kvf__room_fail(r, st, "cannot send the room's destination to %s: %s",
                           kvf__peer_name(p, name, sizeof(name)), kvf_status_str(st));
            return;
        }
        lk->req_sent = 1;
    }
    kvf__room_set_state(r, KVF_POLL_WAITING_FOR_INPUT);
}

/* Resolve one inbound segment to its place in this room's memory. */
static uint8_t *seg_target(kvf_room_t *r, const kvf_wire_seg_t *s, char *err,
                           size_t errlen)
{
    const kvf_layout_int_t *l = &r->eng->layout;
    const kvf_buffer_t *b;
    uint64_t lo, hi;

    if (s->kind == KVF_BUF_KV && s->buf < l->num_kv) {
        b = &l->kv[s->buf];
        uint64_t first = s->offset / b->item_bytes;
        uint64_t last = (s->offset + s->len - 1) / b->item_bytes;
        /* Head slices hit the same page many times in a row: remember it. */
        if (first >= r->ok_first && last <= r->ok_last)
            return (uint8_t *)b->base + s->offset;
        if (s->offset <= UINT64_MAX - s->len &&
            kvf__pages_contain(r->sorted_pages, r->n_pages, first, last)) {
            r->ok_first = first;
            r->ok_last = last;
            return (uint8_t *)b->base + s->offset;
        }
        snprintf(err, errlen, "bytes [%llu, %llu) of KV buffer %u are outside the "
                 "pages the room declared", (unsigned long long)s->offset,
                 (unsigned long long)(s->offset + s->len), s->buf);
        return NULL;
    }
    if (s->kind == KVF_BUF_AUX && s->buf < l->num_aux) {
        b = &l->aux[s->buf];
        lo = (uint64_t)r->aux_slot * b->item_bytes;
    } else if (s->kind == KVF_BUF_STATE && s->buf < r->n_state_dst) {
        b = &l->state[s->buf];
        lo = (uint64_t)r->state_dst[s->buf] * b->item_bytes;
    } else {
        snprintf(err, errlen, "segment names %s buffer %u, which this room does not have",
                 s->kind == KVF_BUF_KV ? "KV" : s->kind == KVF_BUF_AUX ? "aux" : "state",
                 s->buf);
        return NULL;
    }
    hi = lo + b->item_bytes;
    if (s->offset >= lo && s->offset <= hi && s->len <= hi - s->offset)
        return (uint8_t *)b->base + s->offset;
    snprintf(err, errlen, "bytes [%llu, %llu) of %s buffer %u are outside the room's "
             "slot [%llu, %llu)", (unsigned long long)s->offset,
             (unsigned long long)(s->offset + s->len),
             s->kind == KVF_BUF_AUX ? "aux" : "state", s->buf, (unsigned long long)lo,
             (unsigned long long)hi);
    return NULL;
}

/*
 * Where each segment of an inbound DATA or DATA_REF frame goes, checked
 * against what the room declared before a byte is placed.  @return the
 * link the frame belongs to, or NULL: place nothing (the room is not live
 * here, the peer was not asked, or a segment is out of bounds, which fails
 * the room).
 */
static kvf_link_t *frame_targets(kvf_peer_t *p, const kvf_msg_data_t *d,
                                 kvf_rx_target_t *t, kvf_room_t **room_p)
{
    kvf_room_t *r = kvf_map_get(&p->eng->rooms_by_id, d->room);
    char err[256], name[128];

    if (r == NULL || room_final(r)) {
        kvf_debug("discarding %llu bytes for room %llu (not live here)",
                  (unsigned long long)d->payload_len, (unsigned long long)d->room);
        return NULL;
    }
    kvf_link_t *lk = link_of(r, p);
    if (lk == NULL || !lk->req_sent) {
        kvf_warn("%s sent data for room %llu, which did not ask it for any: discarded",
                 kvf__peer_name(p, name, sizeof(name)), (unsigned long long)d->room);
        return NULL;
    }
    for (uint32_t i = 0; i < d->nseg; i++) {
        kvf_wire_seg_t s;
        kvf_wire_seg_at(d, i, &s);
        t[i].len = s.len;
        t[i].dst = seg_target(r, &s, err, sizeof(err));
        if (t[i].dst == NULL) {
            for (uint32_t j = 0; j < i; j++)
                t[j].dst = NULL;
            kvf__room_fail(r, KVF_ERR_BAD_INDICES, "%s wrote outside room %llu's "
                           "destination: %s; nothing of it was placed",
                           kvf__peer_name(p, name, sizeof(name)),
                           (unsigned long long)r->id, err);
            return NULL;
        }
    }
    kvf__room_set_state(r, KVF_POLL_TRANSFERRING);
    *room_p = r;
    return lk;
}

void kvf__room_on_data(kvf_peer_t *p, const kvf_msg_data_t *d, kvf_rx_target_t *t)
{
    kvf_room_t *r = NULL;
    kvf_link_t *lk = frame_targets(p, d, t, &r);

    p->rx_room = NULL;
    p->rx_link = NULL;
    if (lk == NULL)
        return;
    r->refs++;
    p->rx_room = r;
    p->rx_link = lk;
}

/* shm: the same checks, then read the bytes from the prefill process. */
void kvf__room_on_data_ref(kvf_peer_t *p, const kvf_msg_data_t *d)
{
    kvf_engine_t *eng = p->eng;
    kvf_room_t *r = NULL;
    char err[256], name[128];

    if (p->ref_cap < d->nseg) {
        struct iovec *v = realloc(p->ref_iov, 2 * (size_t)d->nseg * sizeof(*v));
        kvf_rx_target_t *tg = realloc(p->ref_tgt, (size_t)d->nseg * sizeof(*tg));
        if (v != NULL)
            p->ref_iov = v;
        if (tg != NULL)
            p->ref_tgt = tg;
        if (v == NULL || tg == NULL) {
            kvf__peer_fail(p, KVF_ERR_NO_MEMORY, "no memory for a DATA_REF frame");
            return;
        }
        p->ref_cap = d->nseg;
    }
    kvf_rx_target_t *t = p->ref_tgt;
    kvf_link_t *lk = frame_targets(p, d, t, &r);
    if (lk != NULL) {
        struct iovec *local = p->ref_iov, *remote = p->ref_iov + d->nseg;
        for (uint32_t i = 0; i < d->nseg; i++) {
            local[i] = (struct iovec){t[i].dst, t[i].len};
            remote[i] = (struct iovec){(void *)(uintptr_t)kvf_wire_arr64_at(&d->src_addrs, i),
                                       t[i].len};
        }
        kvf_status_t st;
#ifdef KVF_HAVE_UCX
        if (p->xport == KVF_XPORT_UCX)
            st = kvf_ucx_read(p->ucx_ep, local, remote, d->nseg,
                              eng->params.heartbeat_timeout_ms, err, sizeof(err));
        else
#endif
            st = kvf_shm_read(p->shm, local, remote, d->nseg, err, sizeof(err));
        if (st != KVF_OK) {
            kvf__room_fail(r, st, "%s transfer from %s failed: %s",
                           p->xport == KVF_XPORT_UCX ? "ucx" : "shm",
                           kvf__peer_name(p, name, sizeof(name)), err);
            /* A failed UCX endpoint stays failed: so does the peer. */
            if (p->xport == KVF_XPORT_UCX)
                kvf__peer_fail(p, st, "ucx endpoint failed: %s", err);
        } else {
            for (uint32_t i = 0; lk->hash != NULL && i < d->nseg; i++)
                XXH3_64bits_update(lk->hash, t[i].dst, t[i].len);
            lk->bytes += d->payload_len;
            eng->stats.bytes_received += d->payload_len;
            r->t_state_ms = kvf_now_ms();
        }
    }
}

void kvf__room_on_data_end(kvf_peer_t *p, uint64_t placed)
{
    kvf_room_t *r = p->rx_room;
    if (r == NULL)
        return;
    p->rx_link->bytes += placed;
    p->eng->stats.bytes_received += placed;
    r->t_state_ms = kvf_now_ms();
    p->rx_room = NULL;
    p->rx_link = NULL;
    kvf__room_put(r);
}

static void on_done(kvf_peer_t *p, kvf_room_t *r, const kvf_msg_done_t *m)
{
    kvf_link_t *lk = link_of(r, p);
    char name[128];
    kvf__peer_name(p, name, sizeof(name));

    if (lk == NULL || lk->done) {
        kvf__room_fail(r, KVF_ERR_PROTOCOL, "%s sent %s DONE for room %llu", name,
                       lk ? "a second" : "an unexpected", (unsigned long long)r->id);
        return;
    }
    if (m->bytes != lk->expected || lk->bytes != lk->expected) {
        kvf__room_fail(r, KVF_ERR_INCOMPLETE, "incomplete transfer from %s: it reported "
                       "%llu bytes, %llu were placed, room %llu expects %llu", name,
                       (unsigned long long)m->bytes, (unsigned long long)lk->bytes,
                       (unsigned long long)r->id, (unsigned long long)lk->expected);
        return;
    }
    if (lk->hash != NULL) {
        uint64_t got = XXH3_64bits_digest(lk->hash);
        if (!m->has_checksum || got != m->checksum) {
            kvf__room_fail(r, KVF_ERR_CHECKSUM, "checksum mismatch on the %llu bytes "
                           "from %s: sender %s%016llx, receiver %016llx",
                           (unsigned long long)lk->bytes, name,
                           m->has_checksum ? "" : "sent none, ",
                           (unsigned long long)m->checksum, (unsigned long long)got);
            return;
        }
    }
    lk->done = 1;
    kvf_msg_t ack = {.type = KVF_MSG_DONE_ACK};
    ack.u.done_ack.room = r->id;
    ack.u.done_ack.status = KVF_OK;
    ack.u.done_ack.bytes = lk->bytes;
    kvf__peer_send(p, &ack);
    if (all_done(r))
        kvf__room_set_state(r, KVF_POLL_SUCCESS);
}

static void on_done_ack(kvf_peer_t *p, kvf_room_t *r, const kvf_msg_done_ack_t *m)
{
    kvf_link_t *lk = link_of(r, p);
    char name[128];

    if (lk == NULL || !lk->last_queued || lk->done)
        return;
    if (m->status != KVF_OK) {
        kvf__room_fail(r, (kvf_status_t)m->status, "%s refused room %llu's data: %s",
                       kvf__peer_name(p, name, sizeof(name)), (unsigned long long)r->id,
                       kvf_status_str((kvf_status_t)m->status));
        return;
    }
    lk->done = 1;
    if (all_done(r))
        kvf__room_set_state(r, KVF_POLL_SUCCESS);
}

/* Prefill: a ROOM_REQ or a FAIL for a room that has no sender yet. */
static void stash_add(kvf_peer_t *p, uint64_t room, kvf_link_t *lk, uint32_t expected,
                      kvf_failure_t *f)
{
    kvf_engine_t *eng = p->eng;
    kvf_stash_t *s = calloc(1, sizeof(*s));
    if (s == NULL) {
        free(f);
        return;
    }
    s->peer = p;
    p->refs++;
    s->t_ms = kvf_now_ms();
    if (lk) {
        s->link = *lk;
        memset(lk, 0, sizeof(*lk));
    }
    s->expected = expected;
    s->failure = f;
    s->next = kvf_map_get(&eng->stash, room);
    if (kvf_map_put(&eng->stash, room, s) != KVF_OK) {
        kvf__peer_put(p);
        free(s->link.pages);
        free(s->link.state_slots);
        free(f);
        free(s);
    }
}

/*
 * A decode rank that lost its connection asks again (attempt > 0): move its
 * link to the new connection and resend everything queued so far (writes
 * are idempotent).  @return 0 if the room has no such link (a first
 * request, then).
 */
static int resume(kvf_room_t *r, kvf_peer_t *p, const kvf_link_t *req)
{
    char name[128];
    uint32_t li;

    for (li = 0; li < r->nlinks; li++)
        if (r->links[li].rank == req->rank)
            break;
    if (li == r->nlinks)
        return 0;
    kvf_link_t *lk = &r->links[li];
    kvf__peer_name(p, name, sizeof(name));
    if (room_final(r)) {
        send_fail(r, p, 0);
        return 1;
    }
    if (lk->peer->instance_id != p->instance_id) {
        kvf__room_fail(r, KVF_ERR_PEER_RESTARTED, "%s restarted while room %llu was in "
                       "flight (instance %016llx, was %016llx)", name,
                       (unsigned long long)r->id, (unsigned long long)p->instance_id,
                       (unsigned long long)lk->peer->instance_id);
        return 1;
    }
    if (req->n_pages != lk->n_pages ||
        memcmp(req->pages, lk->pages, lk->n_pages * sizeof(uint32_t)) != 0) {
        kvf__room_fail(r, KVF_ERR_BAD_INDICES, "%s resumed room %llu with a different "
                       "destination", name, (unsigned long long)r->id);
        return 1;
    }
    kvf_info("%s resumed room %llu (attempt %u): resending %u pages", name,
             (unsigned long long)r->id, r->retries, r->pages_sent);
    kvf__peer_put(lk->peer);
    lk->peer = p;
    p->refs++;
    lk->broken = 0;
    lk->bytes = 0;
    lk->done = 0;
    lk->last_queued = 0;
    if (lk->hash)
        XXH3_64bits_reset(lk->hash);
    r->t_state_ms = kvf_now_ms();
    if (r->pages_sent > 0 || r->last_sent) {
        kvf_status_t st = queue_chunk(r, li, r->src_pages, 0, r->pages_sent, r->last_sent);
        if (st != KVF_OK)
            kvf__room_fail(r, st, "cannot queue the resend: %s", kvf_status_str(st));
    }
    return 1;
}

static void on_room_req(kvf_peer_t *p, const kvf_msg_room_req_t *m)
{
    kvf_engine_t *eng = p->eng;
    kvf_room_t *r = kvf_map_get(&eng->rooms_by_id, m->room);
    const kvf_layout_int_t *pl = &p->layout;
    uint64_t items = min_items(pl->kv, pl->num_kv);
    kvf_link_t lk = {0};
    const char *bad = NULL;

    if (pl->num_aux > 0 && m->aux_slot != KVF_NO_SLOT &&
        m->aux_slot >= min_items(pl->aux, pl->num_aux))
        bad = "aux slot outside its registered aux buffers";
    else if (m->state_slots.count != 0 && m->state_slots.count != pl->num_state)
        bad = "state slot count differs from its state buffers";
    for (uint32_t i = 0; bad == NULL && i < m->pages.count; i++)
        if (kvf_wire_arr32_at(&m->pages, i) >= items)
            bad = "a page outside its registered KV buffers";
    for (uint32_t i = 0; bad == NULL && i < m->state_slots.count; i++)
        if (kvf_wire_arr32_at(&m->state_slots, i) >=
            pl->state[i].length / pl->state[i].item_bytes)
            bad = "a state slot outside its state buffers";

    lk.rank = m->dst_rank;
    lk.n_pages = m->pages.count;
    lk.aux_slot = m->aux_slot;
    lk.n_state = m->state_slots.count;
    lk.pages = malloc((lk.n_pages ? lk.n_pages : 1) * sizeof(uint32_t));
    lk.state_slots = lk.n_state ? malloc(lk.n_state * sizeof(uint32_t)) : NULL;
    if (lk.pages == NULL || (lk.n_state && lk.state_slots == NULL)) {
        free(lk.pages);
        free(lk.state_slots);
        kvf__peer_fail(p, KVF_ERR_NO_MEMORY, "no memory for a room destination");
        return;
    }
    for (uint32_t i = 0; i < lk.n_pages; i++)
        lk.pages[i] = kvf_wire_arr32_at(&m->pages, i);
    for (uint32_t i = 0; i < lk.n_state; i++)
        lk.state_slots[i] = kvf_wire_arr32_at(&m->state_slots, i);

    char name[128];
    kvf__peer_name(p, name, sizeof(name));
    if (r == NULL) {
        kvf_failure_t *f = NULL;
        if (bad != NULL || p->incompatible != NULL) {
            kvf_failure_t tmp = {.status = bad ? KVF_ERR_BAD_INDICES : KVF_ERR_INCOMPATIBLE,
                                 .origin_side = KVF_ROLE_PREFILL,
                                 .origin_rank = eng->params.tp_rank};
            snprintf(tmp.origin_addr, sizeof(tmp.origin_addr), "%s", eng->addr);
            if (bad)
                snprintf(tmp.reason, sizeof(tmp.reason), "%s sent a destination for "
                         "room %llu with %s", name, (unsigned long long)m->room, bad);
            else
                snprintf(tmp.reason, sizeof(tmp.reason), "%s", p->incompatible);
            f = malloc(sizeof(*f));
            if (f)
                *f = tmp;
        }
        stash_add(p, m->room, &lk, m->expected_receivers, f);
    } else if (m->attempt > 0 && resume(r, p, &lk)) {
        /* resumed on a new connection */
    } else if (bad != NULL) {
        kvf__room_fail(r, KVF_ERR_BAD_INDICES, "%s sent a destination for room %llu "
                       "with %s", name, (unsigned long long)m->room, bad);
    } else if (p->incompatible != NULL) {
        kvf__room_fail(r, KVF_ERR_INCOMPATIBLE, "%s", p->incompatible);
    } else {
        add_destination(r, p, &lk, m->expected_receivers);
    }
    free(lk.pages);
    free(lk.state_slots);
}

void kvf__room_on_msg(kvf_peer_t *p, const kvf_msg_t *msg)
{
    kvf_engine_t *eng = p->eng;
    int prefill = eng->params.role == KVF_ROLE_PREFILL;
    uint64_t id;

    switch (msg->type) {
    case KVF_MSG_ROOM_REQ:
        if (!prefill)
            break;
        on_room_req(p, &msg->u.room_req);
        return;
    case KVF_MSG_DONE:
        if (prefill)
            break;
        id = msg->u.done.room;
        if (kvf_map_get(&eng->rooms_by_id, id) && !room_final(kvf_map_get(&eng->rooms_by_id, id)))
            on_done(p, kvf_map_get(&eng->rooms_by_id, id), &msg->u.done);
        return;
    case KVF_MSG_DONE_ACK:
        if (!prefill)
            break;
        id = msg->u.done_ack.room;
        if (kvf_map_get(&eng->rooms_by_id, id) && !room_final(kvf_map_get(&eng->rooms_by_id, id)))
            on_done_ack(p, kvf_map_get(&eng->rooms_by_id, id), &msg->u.done_ack);
        return;
    case KVF_MSG_FAIL:
    case KVF_MSG_ABORT: {
        kvf_room_t *r = kvf_map_get(&eng->rooms_by_id, msg->u.fail.room);
        int abort = msg->type == KVF_MSG_ABORT;
        /* A prefill room still collecting destinations also accepts it from a
         * decode rank that failed before it could send its destination. */
        if (r != NULL && (link_of(r, p) != NULL ||
                          (prefill && room_state(r) == KVF_POLL_BOOTSTRAPPING)))
            kvf__room_fail_remote(r, p, abort, &msg->u.fail);
        else if (r == NULL && prefill)
            stash_add(p, msg->u.fail.room, NULL, 0, remote_failure(&msg->u.fail));
        return;
    }
    default:
        break;
    }
    kvf__peer_fail(p, KVF_ERR_PROTOCOL, "unexpected %s message from a %s engine",
                   kvf_wire_type_name((uint8_t)msg->type), kvf_role_name(p->role));
}

/* ------------------------------------------------------------------------ */
/* Peers and deadlines                                                       */
/* ------------------------------------------------------------------------ */

int kvf__rooms_peer_failed(kvf_engine_t *eng, kvf_peer_t *p, kvf_status_t st,
                           const char *reason)
{
    int n = 0;

    if (p->rx_room != NULL) {
        kvf__room_put(p->rx_room);
        p->rx_room = NULL;
        p->rx_link = NULL;
    }
    uint64_t now = kvf_now_ms();
    for (kvf_room_t *r = eng->rooms; r != NULL; r = r->next) {
        kvf_link_t *lk = link_of(r, p);
        if (lk == NULL || room_final(r))
            continue;
        n++;
        /* A reset stream may be transient: the decode side reconnects and
         * resumes; the prefill side waits for that, briefly. */
        if (st != KVF_ERR_CONN_RESET || r->retries >= MAX_RETRIES) {
            /* The first break is the root cause; say how reconnecting ended. */
            if (r->retries > 0 && r->last_err != NULL)
                kvf__room_fail(r, st, "%s; gave up after %u reconnects, the last: %s",
                               r->last_err, r->retries, reason);
            else
                kvf__room_fail(r, st, "%s", reason);
            continue;
        }
        for (uint32_t i = 0; i < r->nlinks; i++)
            if (r->links[i].peer == p)
                r->links[i].broken = 1;
        if (r->last_err == NULL)
            r->last_err = strdup(reason);
        if (r->side == KVF_ROLE_DECODE) {
            r->retries++;
            r->retry_at_ms = now + (RETRY_BASE_MS << (r->retries - 1));
        } else {
            r->retries++;
            r->retry_at_ms = now + eng->params.heartbeat_timeout_ms;
        }
    }
    return n;
}

void kvf__rooms_peer_ready(kvf_engine_t *eng, kvf_peer_t *p)
{
    for (kvf_room_t *r = eng->rooms; r != NULL; r = r->next)
        if (r->side == KVF_ROLE_DECODE && link_of(r, p) != NULL)
            kvf__room_try_request(r);
}

static void deadline_detail(kvf_room_t *r, kvf_poll_t s, char *buf, size_t len)
{
    kvf_engine_t *eng = r->eng;
    if (r->side == KVF_ROLE_PREFILL) {
        if (s == KVF_POLL_BOOTSTRAPPING)
            snprintf(buf, len, "%u of %u decode ranks sent their destination%s%s",
                     r->nlinks, r->expected_links ? r->expected_links : 1,
                     eng->register_error ? "; registry: " : "",
                     eng->register_error ? eng->register_error : "");
        else if (s == KVF_POLL_WAITING_FOR_INPUT)
            snprintf(buf, len, "the scheduler did not call kvf_sender_send");
        else
            snprintf(buf, len, "%u of %u pages queued, no bytes moved since",
                     r->pages_sent, r->num_pages);
    } else {
        if (s == KVF_POLL_BOOTSTRAPPING)
            snprintf(buf, len, "%s", r->last_err ? r->last_err
                     : !r->initialized ? "kvf_receiver_init was not called"
                     : "waiting for the prefill rank's handshake");
        else if (s == KVF_POLL_WAITING_FOR_INPUT)
            snprintf(buf, len, "no data from the prefill side yet");
        else
            snprintf(buf, len, "no bytes placed since");
    }
}

/* Decode: reconnect the broken links of a room and ask to resume. */
static void reconnect(kvf_room_t *r)
{
    kvf_engine_t *eng = r->eng;
    for (uint32_t i = 0; i < r->nlinks; i++) {
        kvf_link_t *lk = &r->links[i];
        char host[KVF_ADDR_MAX];
        char *colon;
        if (!lk->broken)
            continue;
        snprintf(host, sizeof(host), "%s", lk->peer->addr);
        colon = strrchr(host, ':');
        if (colon == NULL) {
            kvf__room_fail(r, KVF_ERR_UNREACHABLE, "no address to reconnect to");
            return;
        }
        *colon = '\0';
        kvf_peer_t *p = kvf__peer_get(eng, host, atoi(colon + 1));
        if (p == NULL) {
            kvf__room_fail(r, KVF_ERR_NO_MEMORY, "no memory to reconnect");
            return;
        }
        if (lk->resume_instance == 0)
            lk->resume_instance = lk->peer->instance_id;
        kvf__peer_put(lk->peer);
        lk->peer = p;
        p->refs++;
        lk->broken = 0;
        lk->req_sent = 0;
    }
    kvf_info("room %llu: reconnecting (attempt %u of %u)", (unsigned long long)r->id,
             r->retries, MAX_RETRIES);
    kvf__room_try_request(r);
}

static int has_broken_link(const kvf_room_t *r)
{
    for (uint32_t i = 0; i < r->nlinks; i++)
        if (r->links[i].broken)
            return 1;
    return 0;
}

void kvf__rooms_tick(kvf_engine_t *eng, uint64_t now)
{
    const kvf_engine_params_t *pr = &eng->params;
    char detail[384];

    for (kvf_room_t *r = eng->rooms; r != NULL; r = r->next) {
        if (!room_final(r) && has_broken_link(r) && now >= r->retry_at_ms) {
            if (r->side == KVF_ROLE_DECODE)
                reconnect(r);
            else
                kvf__room_fail(r, KVF_ERR_CONN_RESET, "%s; it did not reconnect within "
                               "%.1f s", r->last_err ? r->last_err : "connection lost",
                               pr->heartbeat_timeout_ms / 1000.0);
        }
        kvf_poll_t s = room_state(r);
        unsigned limit = s == KVF_POLL_BOOTSTRAPPING ? pr->bootstrap_timeout_ms
                       : s == KVF_POLL_WAITING_FOR_INPUT ? pr->waiting_timeout_ms
                       : s == KVF_POLL_TRANSFERRING ? pr->transfer_timeout_ms : 0;
        if (limit == 0 || now - r->t_state_ms < limit)
            continue;
        deadline_detail(r, s, detail, sizeof(detail));
        kvf__room_fail(r, KVF_ERR_TIMED_OUT, "room %llu made no progress in %s for "
                       "%.1f s (deadline %.1f s): %s", (unsigned long long)r->id,
                       kvf_poll_name(s), (double)(now - r->t_state_ms) / 1000.0,
                       limit / 1000.0, detail);
    }
    /* Destinations whose sender never came. */
    for (size_t i = 0; i < eng->stash.cap; i++) {
        kvf_stash_t *s = eng->stash.slots[i].val;
        if (s == NULL || now - s->t_ms < pr->bootstrap_timeout_ms)
            continue;
        uint64_t room = eng->stash.slots[i].key;
        kvf_debug("dropping stale destinations for room %llu", (unsigned long long)room);
        kvf_map_del(&eng->stash, room);
        while (s != NULL) {
            kvf_stash_t *n = s->next;
            free(s->link.pages);
            free(s->link.state_slots);
            free(s->failure);
            kvf__peer_put(s->peer);
            free(s);
            s = n;
        }
        i--;  /* backward shift may have moved an entry into slot i */
    }
}
