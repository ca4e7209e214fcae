/*
 * Sender: the prefill side of a room.
 *
 * A sender collects one destination (ROOM_REQ) per decode rank it feeds,
 * then turns each send() chunk into one put per destination and stream,
 * produced lazily segment by segment (whole page runs, or, when the TP
 * sizes differ, head slices of each token of NHD pages or of each HND
 * page); with several streams each gets its share of every chunk's pages
 * (spread_runs).  After the last chunk's put completes on a stream, that
 * stream carries its DONE with its byte count (and checksum), and the
 * sender reaches SUCCESS when every destination has acknowledged.  A
 * destination that arrives before its sender waits in the stash (stash.c).
 * A decode rank that reconnects resumes its destination: everything queued
 * so far is sent again (writes are idempotent).  A held sender
 * (kvf_sender_create_held) keeps the chunks it is given until every
 * reader asked, within its lease.
 */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/room.h"
#include "core/sized.h"
#include "core/stage.h"
#include "core/sync.h"
#include "core/trace.h"
#include "util/log.h"
#include "util/time.h"

/* One send() chunk toward one destination, produced lazily (transport.h). */
typedef struct chunk_put {
    kvf_put_t   put;
    kvf_room_t *room;
    kvf_peer_t *peer;         /* the peer it was queued to */
    uint32_t    stream;       /* on this stream of it */
    uint32_t    link;
    uint32_t    nruns, run, buf;
    uint32_t    slot_lo, slot_hi; /* the layer slots it carries (layout.h) */
    uint32_t    page, tok;    /* sliced: position inside the current run */
    uint32_t    extra;        /* aux segments, on the last chunk */
    int         last;
    int         staged;       /* wrapped by a staged put, which hashes the bytes */
    unsigned    path;         /* its bytes' path, for the metrics (metrics.h) */
    /* The last chunk's state: runs of (source, destination) indices per
     * group, group g's at sruns[srun_first[g] .. srun_first[g+1]), sent
     * for every buffer of the group in turn; sb, sr: the next one. */
    kvf_run_t  *sruns;
    uint32_t   *srun_first;
    uint32_t    sb, sr;
    kvf_run_t   runs[];
} chunk_put_t;

/*
 * The next KV segment: a whole run of pages per buffer, or, when the link
 * carries a slice of the heads, that slice of every page of the run.  Its
 * pages are consecutive on both sides, so the slice is evenly spaced
 * through the run and the run is one strided segment:
 *   - NHD pages ([tokens][heads][bytes]): a run of heads is contiguous
 *     inside a token, so a piece per token, tokens apart on each side;
 *   - HND pages ([heads][tokens][bytes]): a run of heads is contiguous
 *     inside a page, every token of it, so a piece per page, pages apart
 *     on each side (the two sides' pages differ in size: their heads).
 * A peer that has not accepted strided segments (KVF_CAP_STRIDED) gets a
 * plain segment per piece instead.
 */
static int next_kv(chunk_put_t *c, const kvf_layout_int_t *l, const kvf_link_t *lk,
                   kvf_wire_seg_t *seg, const void **src)
{
    const kvf_slice_t *sl = &lk->slice;
    while (c->buf < l->num_kv && (c->run >= c->nruns || l->kv_slot[c->buf] < c->slot_lo ||
                                  l->kv_slot[c->buf] >= c->slot_hi)) {
        c->buf++;
        c->run = c->page = c->tok = 0;
    }
    if (c->buf >= l->num_kv)
        return 0;
    const kvf_run_t *run = &c->runs[c->run];
    const uint8_t *base = l->kv[c->buf].base;
    uint32_t dbuf = c->peer->kv_map[c->buf];
    if (!sl->sliced) {
        size_t ib = l->kv[c->buf].item_bytes;
        *seg = (kvf_wire_seg_t){.kind = KVF_BUF_KV, .buf = dbuf,
                                .offset = (uint64_t)run->dst * ib,
                                .len = (uint32_t)(run->count * ib), .count = 1};
        *src = base + (size_t)run->src * ib;
        c->run++;
        return 1;
    }
    uint64_t ps = l->page_size, bph = kvf__head_bytes(l, c->buf);
    int strided = (c->peer->caps & KVF_CAP_STRIDED) != 0;
    if (l->kv_order == KVF_KV_HND) {
        /* Page bytes of each side: the strides, from page to page. */
        uint64_t sps = l->kv[c->buf].item_bytes;
        uint64_t dps = lk->peer->layout.kv[dbuf].item_bytes;
        uint64_t spage = (uint64_t)run->src + c->page, dpage = (uint64_t)run->dst + c->page;
        /* Within one page (its bytes are below 4 GiB, layout.c): fits. */
        *seg = (kvf_wire_seg_t){.kind = KVF_BUF_KV, .buf = dbuf,
                                .offset = dpage * dps + sl->dst_head * ps * bph,
                                .len = (uint32_t)(sl->nheads * ps * bph), .count = 1};
        *src = base + spage * sps + sl->src_head * ps * bph;
        if (strided) {
            seg->count = run->count;       /* MAX_RUN_BYTES of pages at most */
            seg->dst_stride = dps;
            seg->src_stride = sps;
            c->run++;
        } else if (++c->page == run->count) {
            c->page = 0;
            c->run++;
        }
        return 1;
    }
    uint64_t sts = l->heads_per_rank * bph, dts = lk->peer->layout.heads_per_rank * bph;
    uint64_t stok = ((uint64_t)run->src + c->page) * ps + c->tok;
    uint64_t dtok = ((uint64_t)run->dst + c->page) * ps + c->tok;
    *seg = (kvf_wire_seg_t){.kind = KVF_BUF_KV, .buf = dbuf,
                            .offset = dtok * dts + sl->dst_head * bph,
                            .len = (uint32_t)(sl->nheads * bph), .count = 1};
    *src = base + stok * sts + sl->src_head * bph;
    if (strided) {
        /* Runs hold at most MAX_RUN_BYTES of pages: the count fits. */
        seg->count = (uint32_t)(run->count * ps);
        seg->dst_stride = dts;
        seg->src_stride = sts;
        c->run++;
        return 1;
    }
    if (++c->tok == ps) {
        c->tok = 0;
        if (++c->page == run->count) {
            c->page = 0;
            c->run++;
        }
    }
    return 1;
}

/* The next state segment of the last chunk: a run of indices of one
 * buffer of a group.  @return 0 at the end. */
static int next_state(chunk_put_t *c, const kvf_layout_int_t *l, kvf_wire_seg_t *seg,
                      const void **src)
{
    while (c->sruns != NULL && c->sb < l->num_state) {
        uint32_t g = kvf__group_of(l, c->sb);
        if (c->sr < c->srun_first[g + 1] - c->srun_first[g]) {
            const kvf_run_t *run = &c->sruns[c->srun_first[g] + c->sr++];
            size_t ib = l->state[c->sb].item_bytes;
            *seg = (kvf_wire_seg_t){.kind = KVF_BUF_STATE, .buf = c->sb,
                                    .offset = (uint64_t)run->dst * ib,
                                    .len = (uint32_t)(run->count * ib), .count = 1};
            *src = (const uint8_t *)l->state[c->sb].base + (size_t)run->src * ib;
            return 1;
        }
        c->sb++;          /* the next buffer: its group's runs from the first */
        c->sr = 0;
    }
    return 0;
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
    } else if (c->last && c->stream == 0 && lk->aux_slot != KVF_NO_SLOT &&
               c->extra < l->num_aux) {
        uint32_t i = c->extra++;
        size_t ib = l->aux[i].item_bytes;
        *seg = (kvf_wire_seg_t){.kind = KVF_BUF_AUX, .buf = i,
                                .offset = (uint64_t)lk->aux_slot * ib,
                                .len = (uint32_t)ib, .count = 1};
        *src = (const uint8_t *)l->aux[i].base + (size_t)r->aux_slot * ib;
    } else if (c->stream != 0 || !next_state(c, l, seg, src)) {
        return 0;
    }
    uint64_t bytes = kvf_wire_seg_bytes(seg);
    XXH3_state_t *hash = lk->hash[c->stream];
    kvf__link_count(r, lk, c->stream, bytes);
    eng->stats.bytes_sent += bytes;
    eng->stream_bytes[c->stream] += bytes;
    eng->metrics.path_bytes[c->path] += bytes;
    r->t_state_ms = kvf_now_ms();    /* per segment (lanes >= 1 have no now_ms) */
    /* Piece by piece, in payload order: what the receiver hashes as it
     * places them (a strided segment's source is not one range). */
    for (uint32_t k = 0; hash && !c->staged && k < kvf_wire_seg_pieces(seg); k++)
        XXH3_64bits_update(hash, (const uint8_t *)*src + (size_t)k * seg->src_stride,
                           seg->len);
    return 1;
}

/* Stream k's end: its bytes and checksum, behind its last DATA frame. */
static void send_done(kvf_room_t *r, kvf_link_t *lk, uint32_t k)
{
    kvf_peer_t *s = kvf__peer_stream(lk->peer, k);
    kvf_msg_t m = {.type = KVF_MSG_DONE};
    m.u.done.room = r->id;
    m.u.done.instance = lk->tx.instance;
    m.u.done.src_rank = (uint32_t)r->eng->params.tp_rank;
    m.u.done.bytes = lk->stream_bytes[k];
    if (lk->hash[k]) {
        m.u.done.has_checksum = 1;
        m.u.done.checksum = XXH3_64bits_digest(lk->hash[k]);
    }
    if (lk->nstreams > 1) {
        m.u.done.stream = k;
        m.u.done.streams = lk->nstreams;
    }
    if (s != NULL)                 /* else the peer is failing: no DONE */
        kvf__peer_send(s, &m);
    kvf__trace_peer_event(r, "done_sent", lk->peer, k, -1, (int64_t)lk->stream_bytes[k]);
}

/*
 * Puts on one stream complete in order, so when the last chunk's put
 * completes, everything before it is in the stream too: its DONE may follow.
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
        /* Broken: the room waits for a reconnect.  Reset while its peer
         * is still being failed (a put another thread queued, handed to
         * the closing connection first): the peer's failure, next, judges
         * the room, and may leave it to resume. */
        if (!lk->broken && !(st == KVF_ERR_CONN_RESET && c->peer->state != KVF_PEER_DEAD))
            kvf__room_fail(r, st, "transfer to %s failed: %s",
                           kvf__peer_name(lk->peer, name, sizeof(name)),
                           kvf_status_str(st));
    } else {
        kvf__trace_peer_event(r, "chunk_done", lk->peer, c->stream, -1,
                              (int64_t)lk->stream_bytes[c->stream]);
        if (c->last)
            send_done(r, lk, c->stream);
    }
    kvf__peer_put(c->peer);
    kvf__room_put(r);
    free(c->sruns);
    free(c->srun_first);
    free(c);
}

/* A staged put hashes the host copy of the bytes (the pages may be device
 * memory), in the same payload order. */
static void chunk_hash(kvf_put_t *put, const void *p, size_t n)
{
    chunk_put_t *c = (chunk_put_t *)put;
    kvf_link_t *lk = &c->room->links[c->link];
    if (lk->hash[c->stream] != NULL)
        XXH3_64bits_update(lk->hash[c->stream], p, n);
}

/* A staged put's copy failed: the room fails with what the copier said. */
static void chunk_stage_failed(kvf_put_t *put, kvf_status_t st, const char *why)
{
    chunk_put_t *c = (chunk_put_t *)put;
    kvf_room_t *r = c->room;
    if (c->peer == r->links[c->link].peer && !room_final(r))
        kvf__room_fail(r, st, "staging room %llu's device memory for the stream failed: %s",
                       (unsigned long long)r->id, why);
}

static const kvf_stage_cbs_t chunk_stage_cbs = {chunk_hash, chunk_stage_failed};

/* The stream reads this chunk's pages with the lock released: the room
 * keeps them (a destroy waits for the call to end, room.h `reads`). */
static void chunk_busy(kvf_put_t *put, int busy)
{
    chunk_put_t *c = (chunk_put_t *)put;
    kvf_room_t *r = c->room;
    if (busy)
        atomic_fetch_add_explicit(&r->reads, 1, memory_order_relaxed);
    else if (atomic_fetch_sub_explicit(&r->reads, 1, memory_order_release) == 1)
        pthread_cond_broadcast(&r->eng->reads_cond);
}

/* Are the chunk's pages still the room's to send? */
static int chunk_live(kvf_put_t *put)
{
    const kvf_room_t *r = ((chunk_put_t *)put)->room;
    return r->attached && !room_final(r);
}

/* The last chunk's state runs: the sender's indices of each group to the
 * link's (as many of each: kvf_sender_send checked). */
static kvf_status_t plan_state(chunk_put_t *c, kvf_room_t *r, const kvf_link_t *lk)
{
    const kvf_layout_int_t *l = &r->eng->layout;
    const kvf_states_t *src = &sender_of(r)->state_src, *dst = &lk->tx.state;
    c->sruns = malloc((dst->total ? dst->total : 1) * sizeof(kvf_run_t));
    c->srun_first = malloc((dst->ngroups + 1) * sizeof(uint32_t));
    if (c->sruns == NULL || c->srun_first == NULL) {
        free(c->sruns);
        free(c->srun_first);
        return KVF_ERR_NO_MEMORY;
    }
    uint32_t at = 0, nr = 0;
    for (uint32_t g = 0; g < dst->ngroups; g++) {
        uint64_t max_ib = 1;
        for (uint32_t b = l->group_first[g]; b < l->group_first[g + 1]; b++)
            max_ib = l->state[b].item_bytes > max_ib ? l->state[b].item_bytes : max_ib;
        c->srun_first[g] = nr;
        if (dst->count[g] > 0)
            nr += (uint32_t)kvf__plan_runs(src->idx + at, dst->idx + at, dst->count[g],
                                           (uint32_t)(MAX_RUN_BYTES / max_ib), c->sruns + nr);
        at += dst->count[g];
    }
    c->srun_first[dst->ngroups] = nr;
    return KVF_OK;
}

/*
 * Spread a chunk's page runs over ns streams, balanced by pages (every
 * page carries the same bytes toward a link, whatever its slice): a run
 * of at least ns pages is cut into ns parts, a shorter one goes whole to
 * the stream with the fewest pages so far.
 */
static void spread_runs(const kvf_run_t *runs, size_t nruns, chunk_put_t **c, uint32_t ns)
{
    uint64_t load[KVF_MAX_STREAMS] = {0};
    for (size_t i = 0; i < nruns; i++) {
        const kvf_run_t *run = &runs[i];
        if (run->count >= ns) {
            uint32_t off = 0;
            for (uint32_t k = 0; k < ns; k++) {
                uint32_t cnt = run->count / ns + (k < run->count % ns);
                c[k]->runs[c[k]->nruns++] = (kvf_run_t){run->src + off, run->dst + off, cnt};
                load[k] += cnt;
                off += cnt;
            }
            continue;
        }
        uint32_t least = 0;
        for (uint32_t k = 1; k < ns; k++)
            if (load[k] < load[least])
                least = k;
        c[least]->runs[c[least]->nruns++] = *run;
        load[least] += run->count;
    }
}

/* The layer slots a chunk carries: [lo, hi). */
typedef struct slots {
    uint32_t lo, hi;
} slots_t;

/* Queue src[i] -> the link's destination page dst_off + i, i < n, of the
 * KV buffers of layer slots sl: one put per stream of the link. */
static kvf_status_t queue_chunk(kvf_room_t *r, uint32_t li, const uint32_t *pages,
                                uint32_t dst_off, size_t n, int last, slots_t sl)
{
    kvf_link_t *lk = &r->links[li];
    uint32_t ns = lk->nstreams > 1 ? lk->nstreams : 1;
    chunk_put_t *c[KVF_MAX_STREAMS] = {0};
    kvf_run_t *plan = ns > 1 ? malloc((n ? n : 1) * sizeof(kvf_run_t)) : NULL;
    int ok = ns == 1 || plan != NULL;
    for (uint32_t k = 0; k < ns && ok; k++)
        ok = (c[k] = calloc(1, sizeof(chunk_put_t) + n * sizeof(kvf_run_t))) != NULL;
    if (!ok) {
        for (uint32_t k = 0; k < ns; k++)
            free(c[k]);
        free(plan);
        return KVF_ERR_NO_MEMORY;
    }
    uint64_t max_ib = 1;
    for (uint32_t i = 0; i < r->eng->layout.num_kv; i++)
        if (r->eng->layout.kv[i].item_bytes > max_ib)
            max_ib = r->eng->layout.kv[i].item_bytes;
    uint32_t max_pages = (uint32_t)(MAX_RUN_BYTES / max_ib);
    if (n == 0) {
        /* nothing but the last chunk's aux and state */
    } else if (ns == 1) {
        c[0]->nruns = (uint32_t)kvf__plan_runs(pages, lk->tx.pages + dst_off, n, max_pages,
                                               c[0]->runs);
    } else {
        size_t nr = kvf__plan_runs(pages, lk->tx.pages + dst_off, n, max_pages, plan);
        spread_runs(plan, nr, c, ns);
    }
    free(plan);
    /* Aux and state ride on stream 0. */
    if (last && lk->tx.state.ngroups > 0 && plan_state(c[0], r, lk) != KVF_OK) {
        for (uint32_t k = 0; k < ns; k++)
            free(c[k]);
        return KVF_ERR_NO_MEMORY;
    }
    if (last)
        lk->tx.last_queued = 1;
    for (uint32_t k = 0; k < ns; k++) {
        c[k]->put.next = chunk_next;
        c[k]->put.complete = chunk_complete;
        c[k]->put.busy = chunk_busy;
        c[k]->put.live = chunk_live;
        c[k]->put.room = r->id;
        c[k]->put.instance = lk->tx.instance;
        c[k]->put.src_rank = (uint32_t)r->eng->params.tp_rank;
        c[k]->put.by_ref = kvf__peer_pulls(lk->peer);
        c[k]->room = r;
        c[k]->peer = lk->peer;
        c[k]->stream = k;
        c[k]->link = li;
        c[k]->last = last;
        c[k]->slot_lo = sl.lo;
        c[k]->slot_hi = sl.hi;
        r->refs++;
        lk->peer->refs++;
        kvf_put_t *put = &c[k]->put;
        c[k]->path = kvf__metrics_path(lk->peer->mover, !put->by_ref && kvf__stages(r->eng));
        kvf__trace_peer_event(r, last ? "last_chunk_queued" : "chunk_queued", lk->peer, k,
                              ns == 1 || k == 0 ? (int64_t)n : -1, -1);
        if (!put->by_ref && kvf__stages(r->eng)) {
            /* Pushed from device memory: through bounce buffers (stage.h). */
            c[k]->staged = 1;
            if ((put = kvf__stage_put(r->eng, &c[k]->put, &chunk_stage_cbs)) == NULL) {
                kvf__room_fail(r, KVF_ERR_NO_MEMORY, "no memory to stage a chunk of room "
                               "%llu", (unsigned long long)r->id);
                c[k]->put.complete(&c[k]->put, KVF_ERR_NO_MEMORY);
                continue;
            }
        }
        /* A stream gone means the peer is failing: its put completes reset. */
        kvf_peer_t *s = kvf__peer_stream(lk->peer, k);
        if (s != NULL)
            kvf__peer_put_data(s, put);
        else
            put->complete(put, KVF_ERR_CONN_RESET);
    }
    return KVF_OK;
}

/*
 * Queue the room's pages [first, first + n) (source pages pages[0..n)) of
 * layer slots sl to link li, as far as its destination takes them: a held
 * room's reader takes the held pages from its prefix's page on (as many
 * as it has pages), any other destination the room's pages one for one.
 */
static kvf_status_t queue_pages(kvf_room_t *r, uint32_t li, const uint32_t *pages,
                                uint32_t first, size_t n, int last, slots_t sl)
{
    const kvf_link_t *lk = &r->links[li];
    uint64_t skip = sender_of(r)->held ? lk->tx.prefix / r->eng->layout.page_size : 0;
    uint64_t lo = first > skip ? first : skip;
    uint64_t hi = (uint64_t)first + n;
    if (hi > skip + lk->tx.n_pages)
        hi = skip + lk->tx.n_pages;
    if (lo >= hi) {
        /* None of these pages for it: only the last chunk's aux and state. */
        return last ? queue_chunk(r, li, pages, 0, 0, 1, sl) : KVF_OK;
    }
    return queue_chunk(r, li, pages + (lo - first), (uint32_t)(lo - skip), hi - lo, last, sl);
}

/*
 * Does a destination fit the pages this sender declared?  @return NULL,
 * or why not (in why).  A held room's reader takes its pages from its
 * prefix's page on; any other destination names exactly the room's.
 */
static const char *dest_misfit(const kvf_room_t *r, const kvf_link_t *lk, char *why,
                               size_t len)
{
    const kvf_sender_t *s = (const kvf_sender_t *)r;
    uint32_t ps = r->eng->layout.page_size;
    char name[128];

    if (lk->idle)
        return NULL;
    kvf__peer_name(lk->peer, name, sizeof(name));
    if (s->held && lk->tx.prefix % ps != 0) {
        snprintf(why, len, "%s holds %u tokens of room %llu already, not a whole number "
                 "of %u-token pages: a held room's reader takes whole pages",
                 name, lk->tx.prefix, (unsigned long long)r->id, ps);
        return why;
    }
    if (!r->initialized)
        return NULL;
    if (s->held && (uint64_t)lk->tx.prefix / ps + lk->tx.n_pages > s->num_pages) {
        snprintf(why, len, "%s asked for %u pages of room %llu from page %u on, but the "
                 "prefill side holds %u (kvf_sender_init num_pages)", name, lk->tx.n_pages,
                 (unsigned long long)r->id, lk->tx.prefix / ps, s->num_pages);
        return why;
    }
    if (!s->held && lk->tx.n_pages != s->num_pages) {
        snprintf(why, len, "%s declared %u pages for room %llu, but the prefill side "
                 "declared %u (kvf_sender_init num_pages)", name, lk->tx.n_pages,
                 (unsigned long long)r->id, s->num_pages);
        return why;
    }
    return NULL;
}

/*
 * Tell `p` that its request (room instance `inst`) was refused, with the
 * reason, so that its receiver fails at once; the room itself goes on.
 */
static void refuse(kvf_room_t *r, kvf_peer_t *p, uint64_t inst, kvf_status_t st,
                   const char *fmt, ...) __attribute__((format(printf, 5, 6)));

static void refuse(kvf_room_t *r, kvf_peer_t *p, uint64_t inst, kvf_status_t st,
                   const char *fmt, ...)
{
    kvf_failure_t f;
    char why[KVF_REASON_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(why, sizeof(why), fmt, ap);
    va_end(ap);
    kvf__failure_set(&f, r->eng, st, "%s", why);
    kvf__send_fail(p, r->id, inst, &f, 0);
    kvf__room_dropped(p, "ROOM_REQ", r->id, inst, why);
}

/* The link bound to decode rank `rank`, or NULL. */
static kvf_link_t *slot_of(kvf_room_t *r, uint32_t rank)
{
    for (uint32_t i = 0; i < r->nlinks; i++)
        if (r->links[i].rank == rank)
            return &r->links[i];
    return NULL;
}

static int state_counts_agree(kvf_room_t *r);

/* A destination declares state indices, and the sender has none. */
static int states_missing(const kvf_room_t *r)
{
    if (((const kvf_sender_t *)r)->state_src.ngroups > 0)
        return 0;
    for (uint32_t i = 0; i < r->nlinks; i++)
        if (r->links[i].tx.state.ngroups > 0)
            return 1;
    return 0;
}

/*
 * What to queue: every layer's pages [first, first + n) (source pages
 * pages[0..n)), or, when `to` is set (a layer-wise room), each layer slot
 * k's pages [from[k], to[k]) (from NULL: 0); then, with `last`, the last
 * chunk.
 */
typedef struct sends {
    const uint32_t *pages;
    uint32_t        first;
    size_t          n;
    const uint32_t *from, *to;
    int             last;
} sends_t;

static void queue_all(kvf_room_t *r, const sends_t *w);

/* Everything taken in so far: what a resumed link or a held room's
 * readers get. */
static sends_t sent_so_far(const kvf_sender_t *s)
{
    if (s->slot_sent != NULL)
        return (sends_t){.to = s->slot_sent, .last = s->last_sent};
    return (sends_t){.pages = s->src_pages, .n = s->pages_sent, .last = s->last_sent};
}

/* Did the engine take in anything to send (a page of some layer, or the
 * last chunk)? */
static int anything_sent(const kvf_sender_t *s)
{
    if (s->pages_sent > 0 || s->last_sent)
        return 1;
    for (uint32_t k = 0; s->slot_sent != NULL && k < s->room.eng->layout.num_slots; k++)
        if (s->slot_sent[k] > 0)
            return 1;
    return 0;
}

/*
 * The checks of a last chunk that need the room's destinations, made when
 * the engine takes the chunk in: kvf_sender_send refuses what it can see
 * without the lock, and what it cannot (a held room's reader asking after
 * the last chunk) fails the room.  @return 0 when the room failed.
 */
static int last_chunk_fits(kvf_room_t *r)
{
    if (states_missing(r)) {
        kvf__room_fail(r, KVF_ERR_BAD_INDICES, "room %llu: the decode side declared "
                       "state indices, and the prefill sent its last chunk without any "
                       "(kvf_sender_set_states)", (unsigned long long)r->id);
        return 0;
    }
    return state_counts_agree(r);
}

/*
 * Every reader of a held room asked: what the application sent so far
 * moves now, to all of them, and the room goes on as any other.
 */
static void release_held(kvf_room_t *r)
{
    kvf_sender_t *s = sender_of(r);
    if (!anything_sent(s))
        return;              /* nothing given yet: sends go out as they come */
    if (s->last_sent && !last_chunk_fits(r))
        return;
    sends_t w = sent_so_far(s);
    queue_all(r, &w);
}

/* May this request take one of the room's decode slots?  The first one
 * sizes the slots; a request that disagrees, or finds them all bound, is
 * refused.  @return 1, or 0: refused, or the room failed. */
static int dest_slot_open(kvf_room_t *r, kvf_peer_t *p, const kvf_link_t *dst,
                          uint32_t expected, const char *name)
{
    KVF_ASSERT_LOCKED(r->eng);
    if (expected == 0 || expected > MAX_LINKS) {
        if (r->nlinks > 0)
            refuse(r, p, dst->tx.instance, KVF_ERR_PROTOCOL, "%s announced %u receivers for "
                   "room %llu", name, expected, (unsigned long long)r->id);
        else
            kvf__room_fail(r, KVF_ERR_PROTOCOL, "%s announced %u receivers for room %llu",
                           name, expected, (unsigned long long)r->id);
        return 0;
    }
    if (r->links == NULL) {
        r->links = calloc(expected, sizeof(kvf_link_t));
        if (r->links == NULL) {
            kvf__room_fail(r, KVF_ERR_NO_MEMORY, "no memory for room destinations");
            return 0;
        }
        r->expected_links = expected;
    } else if (expected != r->expected_links) {
        /* The ranks bound first said otherwise: this request is the odd one. */
        refuse(r, p, dst->tx.instance, KVF_ERR_PROTOCOL, "%s announced %u receivers for "
               "room %llu, the decode ranks bound to it announced %u", name, expected,
               (unsigned long long)r->id, r->expected_links);
        return 0;
    }
    if (link_of(r, p) != NULL || r->nlinks == r->expected_links) {
        refuse(r, p, dst->tx.instance, KVF_ERR_ROOM_CONFLICT, "%s asked for room %llu "
               "(instance %016llx) on prefill rank %d, whose %u decode ranks are all "
               "bound to other requests: two live requests use one room id (a stale "
               "retry, or a bootstrap_room drawn twice?); this request was refused",
               name, (unsigned long long)r->id, (unsigned long long)dst->tx.instance,
               r->eng->params.tp_rank, r->expected_links);
        return 0;
    }
    return 1;
}

/* Does the destination fit this rank: its slice of the heads, and pages,
 * aux and state the room can fill?  Sets dst's slice, idle and peer.
 * @return 1, or 0: the room failed and the decode rank was told. */
static int dest_fits(kvf_room_t *r, kvf_peer_t *p, kvf_link_t *dst, const char *name)
{
    KVF_ASSERT_LOCKED(r->eng);
    kvf_par_t mine, theirs;
    char err[KVF_REASON_MAX - 128];
    kvf__par_fill(&mine, r->eng->params.tp_rank, r->eng->params.tp_size,
                  r->eng->params.pp_rank, r->eng->params.pp_size, &r->eng->layout);
    kvf__par_fill(&theirs, p->tp_rank, p->tp_size, p->pp_rank, p->pp_size, &p->layout);
    kvf_status_t st = kvf__plan_slice(&mine, &theirs, &dst->slice, err, sizeof(err));
    /* Owes nothing: no pages, and neither aux nor state (the receiver
     * marks such a link done from the same request). */
    dst->idle = dst->tx.n_pages == 0 && dst->aux_slot == KVF_NO_SLOT &&
                dst->tx.state.ngroups == 0;
    if (st == KVF_ERR_NOT_FOUND ? !dst->idle : st != KVF_OK) {
        kvf__room_fail(r, st == KVF_ERR_NOT_FOUND ? KVF_ERR_BAD_INDICES : st,
                       "%s asked for room %llu's KV from prefill rank %d, which %s", name,
                       (unsigned long long)r->id, r->eng->params.tp_rank,
                       st == KVF_ERR_NOT_FOUND ? "holds none of its heads" : err);
        kvf__send_fail(p, r->id, dst->tx.instance, r->failure, 0);
        return 0;
    }
    char why[KVF_REASON_MAX - 64];
    dst->peer = p;
    if (dest_misfit(r, dst, why, sizeof(why)) != NULL) {
        kvf__room_fail(r, KVF_ERR_BAD_INDICES, "%s", why);
        kvf__send_fail(p, r->id, dst->tx.instance, r->failure, 0);
        return 0;
    }
    return 1;
}

/* A decode rank's destination for a live sender, for a slot not bound
 * yet: the first valid request binds it. */
static void add_destination(kvf_room_t *r, kvf_peer_t *p, kvf_link_t *dst,
                            uint32_t expected)
{
    char name[128];
    kvf__peer_name(p, name, sizeof(name));

    if (!dest_slot_open(r, p, dst, expected, name) || !dest_fits(r, p, dst, name))
        goto out;
    kvf_link_t *lk = &r->links[r->nlinks++];
    *lk = *dst;
    memset(dst, 0, sizeof(*dst));
    lk->peer = p;
    p->refs++;
    kvf__trace_peer_event(r, "dest_received", p, -1, lk->tx.n_pages, -1);
    if (lk->tx.state.ngroups > 0)
        atomic_store(&sender_of(r)->wants_states, 1);
    kvf__siblings_evict(r, p);
    kvf__link_streams_reset(r, lk, kvf__peer_nstreams(p), !lk->idle && want_checksum(r->eng, p));
    if (lk->tx.prefix != r->links[0].tx.prefix) {
        /* The prefill sends the rest of one prefix: the ranks must agree. */
        kvf__room_fail(r, KVF_ERR_BAD_INDICES, "decode ranks disagree on room %llu's "
                       "cached prefix: %s holds %u tokens, %s %u",
                       (unsigned long long)r->id, name, lk->tx.prefix,
                       kvf__peer_name(r->links[0].peer, (char[128]){0}, 128),
                       r->links[0].tx.prefix);
        return;
    }
    if (r->nlinks == r->expected_links) {
        atomic_store_explicit(&sender_of(r)->prefix_known, KVF_PREFIX_KNOWN | lk->tx.prefix,
                              memory_order_relaxed);
        if (room_state(r) == KVF_POLL_BOOTSTRAPPING)
            atomic_store_explicit(&r->t_dest_ns, kvf_now_ns(),   /* every decode */
                                  memory_order_relaxed);        /* rank's pages arrived */
        kvf__room_set_state(r, KVF_POLL_WAITING_FOR_INPUT);
        if (sender_of(r)->held)
            release_held(r);
    }
    return;
out:
    free(dst->tx.pages);
    kvf__states_free(&dst->tx.state);
    memset(dst, 0, sizeof(*dst));
}

static int resume(kvf_room_t *r, kvf_peer_t *p, kvf_link_t *lk, const kvf_link_t *req);

/*
 * A reader that names a held room's instance reads only that room: a
 * sender that holds the room under another one, or does not hold it,
 * refuses it (two request ids whose rooms collide, or a stale request).
 * @return 1 when the request may go on.
 */
static int instance_ok(kvf_room_t *r, kvf_peer_t *p, const kvf_link_t *req)
{
    const kvf_sender_t *s = (const kvf_sender_t *)r;
    char name[128], why[KVF_REASON_MAX - 128];
    kvf_failure_t f;

    if (s->held ? s->hold_instance == 0 || req->want_instance == s->hold_instance
                : req->want_instance == 0)
        return 1;
    kvf__peer_name(p, name, sizeof(name));
    /* The reader is told its key is not the room's, never which key is:
     * one wrong guess must not teach the right one. */
    snprintf(why, sizeof(why), "%s asked for room %llu as held for request key %016llx, "
             "but prefill rank %d %s: two request ids with one room id, or a stale request; "
             "refused", name, (unsigned long long)r->id,
             (unsigned long long)req->want_instance, r->eng->params.tp_rank,
             !s->held ? "does not hold that room (its sender was not created with "
                        "kvf_sender_create_held)"
             : req->want_instance == 0 ? "holds it for a request key, and the reader named none"
                                       : "holds it for another request key");
    kvf__failure_set(&f, r->eng, KVF_ERR_ROOM_CONFLICT, "%s", why);
    kvf__send_fail(p, r->id, req->tx.instance, &f, 0);
    kvf__room_dropped(p, "ROOM_REQ", r->id, req->tx.instance, why);
    return 0;
}

/*
 * A request (req, whose pages are moved or freed by the callee's callers)
 * for a room that has a sender.  `bad`: the request's own failure (bad
 * indices, an incompatible pair), owned.  A request of the instance a
 * slot is bound to is that receiver's (a resume); one of another instance
 * for a bound slot is refused; one for a room that is over waits for the
 * next sender with the id (the application reuses it); the first valid
 * one for a free slot binds it.
 */
static void take_request(kvf_room_t *r, kvf_peer_t *p, kvf_link_t *req, uint32_t expected,
                         uint32_t attempt, kvf_failure_t *bad)
{
    kvf_link_t *slot = slot_of(r, req->rank);
    char name[128];

    if (slot != NULL && slot->tx.instance == req->tx.instance) {
        if (attempt > 0 && bad != NULL && !room_final(r)) {
            /* Resumed from a peer, or with a request, that cannot work. */
            kvf__room_fail_record(r, bad, NULL, 0, 0);
            kvf__send_fail(p, r->id, req->tx.instance, r->failure, 0);
            return;
        }
        if (attempt > 0)
            resume(r, p, slot, req);
        else if (room_state(r) == KVF_POLL_FAILED)
            kvf__send_fail(p, r->id, req->tx.instance, r->failure, 0);
        else
            kvf__room_dropped(p, "ROOM_REQ", r->id, req->tx.instance,
                              "a second request of the same room instance");
        free(bad);
        return;
    }
    if (!instance_ok(r, p, req)) {
        free(bad);
        return;
    }
    if (room_state(r) == KVF_POLL_FAILED && slot == NULL) {
        /* A rank it never heard from, late: the room failed without it. */
        kvf__send_fail(p, r->id, req->tx.instance, r->failure, 0);
        free(bad);
        return;
    }
    if (room_final(r)) {
        /* A new instance for a rank that was served: the id reused, for
         * the next sender the application creates with it. */
        kvf__sender_stash_add(p, r->id, req->tx.instance, req, expected, bad, 0);
        return;
    }
    if (slot != NULL) {
        refuse(r, p, req->tx.instance, KVF_ERR_ROOM_CONFLICT, "%s asked for room %llu "
               "(instance %016llx) as decode rank %u, but that rank's destination is "
               "bound to %s (instance %016llx): two live requests use one room id (a "
               "stale retry, or a bootstrap_room drawn twice?); this request was refused",
               kvf__peer_name(p, name, sizeof(name)), (unsigned long long)r->id,
               (unsigned long long)req->tx.instance, req->rank,
               kvf__peer_name(slot->peer, (char[128]){0}, 128),
               (unsigned long long)slot->tx.instance);
        free(bad);
        return;
    }
    if (bad != NULL) {
        kvf__room_fail_record(r, bad, NULL, 0, 0);
        kvf__send_fail(p, r->id, req->tx.instance, r->failure, 0);
        return;
    }
    add_destination(r, p, req, expected);
}

/*
 * May a FAIL/ABORT from `p`, naming receiver instance `instance` and
 * request key `key`, to which the sender r has no link bound, fail it?
 * Only while it still collects destinations, from a decode rank it has no
 * destination of, of an instance no destroyed sender served, and, for a
 * room held under a request key, naming that key.
 */
static int fail_unbound_applies(const kvf_room_t *r, const kvf_peer_t *p, uint64_t instance,
                                uint64_t key)
{
    const kvf_sender_t *s = (const kvf_sender_t *)r;
    /* A held room under a request key is failed only by the decode ranks
     * that know the key (a reader that failed before it asked names it);
     * anyone else waits for the lease. */
    if (s->held && s->hold_instance != 0 && key != s->hold_instance)
        return 0;
    return room_state(r) == KVF_POLL_BOOTSTRAPPING && link_of((kvf_room_t *)r, p) == NULL &&
           !kvf__instance_retired(r->eng, instance);
}

/* A FAIL that came before its sender: does it concern this room? */
static int stash_fail_applies(kvf_room_t *r, const kvf_stash_t *s)
{
    if (room_final(r))
        return 0;
    if (link_bound(r, s->peer, s->instance) != NULL ||
        kvf__siblings_bound(r, s->peer, s->instance))
        return 1;
    return fail_unbound_applies(r, s->peer, s->instance, s->key);
}

/* Did this stashed destination's receiver (its rank, its room instance)
 * ask again later in the chain, on a new connection? */
static int asked_again(const kvf_stash_t *s)
{
    for (const kvf_stash_t *n = s->next; n != NULL; n = n->next)
        if (n->link.tx.pages != NULL && n->link.rank == s->link.rank &&
            n->instance == s->instance)
            return 1;
    return 0;
}

/*
 * A destination whose connection broke before its sender existed: bound
 * all the same, as a link that broke, so that the decode rank's resume
 * (it reconnects, as for any reset) moves it to the new connection, and
 * the room fails only if it does not come back within one heartbeat
 * timeout, as a live link would.
 */
static void take_broken(kvf_room_t *r, kvf_stash_t *s)
{
    char name[160], why[256];
    uint32_t rank = s->link.rank;
    kvf_failure_t *bad = s->failure;
    s->failure = NULL;
    take_request(r, s->peer, &s->link, s->expected, 0, bad);
    kvf_link_t *lk = slot_of(r, rank);
    if (lk == NULL || lk->peer != s->peer || room_final(r))
        return;
    snprintf(why, sizeof(why), "%s disconnected before the sender for room %llu was "
             "created", kvf__peer_name(s->peer, name, sizeof(name)),
             (unsigned long long)r->id);
    lk->broken = 1;
    if (r->last_err == NULL)
        r->last_err = strdup(why);
    r->retries++;
    r->retry_at_ms = kvf_now_ms() + r->eng->params.heartbeat_timeout_ms;
}

/* Taken in (ops->open): what came for this room before its sender binds
 * now, oldest first, under a held room's rules. */
static void stash_apply(kvf_room_t *r)
{
    kvf_stash_t *s;
    for (s = kvf__stash_take(r->eng, r->id); s != NULL;) {
        kvf_stash_t *n = s->next;
        if (s->watch) {
            kvf__siblings_take(r, s->peer, s->link.rank, s->instance);
        } else if (s->link.tx.pages == NULL) {    /* a FAIL / ABORT */
            if (stash_fail_applies(r, s)) {
                kvf__room_fail_record(r, s->failure, s->peer,
                                      s->failure->status == KVF_ERR_ABORTED, s->sides);
                s->failure = NULL;
            } else {
                kvf__room_dropped(s->peer, "FAIL", r->id, s->instance,
                                  "the room is not bound to this peer and instance");
            }
        } else if (s->peer->state == KVF_PEER_DEAD) {
            if (!room_final(r) && !asked_again(s))
                take_broken(r, s);
        } else {
            kvf_failure_t *bad = s->failure;
            s->failure = NULL;
            take_request(r, s->peer, &s->link, s->expected, 0, bad);
        }
        s->next = NULL;
        kvf__stash_free(s);
        s = n;
    }
}

/* Free what only a sender holds (its room is being freed). */
static void sender_free(kvf_room_t *r)
{
    kvf_sender_t *s = sender_of(r);
    free((void *)atomic_load_explicit(&s->slot_given, memory_order_relaxed));
    free(s->slot_sent);
    free(s->src_pages);
    kvf__states_free(&s->state_src);
}

/* Create a sender, held when `hold` is not NULL (imported). */
static kvf_status_t create(kvf_engine_t *eng, uint64_t room, const kvf_hold_t *hold,
                           kvf_sender_t **sender_p)
{
    kvf_room_t *r;
    kvf_status_t st = kvf__room_create(eng, &kvf_sender_room_ops, room, &r);
    if (st != KVF_OK)
        return st;
    if (hold != NULL) {
        kvf_sender_t *s = sender_of(r);
        s->held = 1;
        s->lease_ms = hold->lease_ms ? hold->lease_ms : kvf__lease_default();
        s->hold_instance = hold->instance;
    }
    *sender_p = (kvf_sender_t *)r;
    kvf__room_submit(r);          /* a lane lists it: stash_apply */
    return KVF_OK;
}

kvf_status_t kvf_sender_create(kvf_engine_t *eng, const char *bootstrap_addr,
                               uint64_t room, kvf_sender_t **sender_p)
{
    if (eng == NULL || sender_p == NULL)
        return KVF_ERR_INVALID_PARAM;
    if (bootstrap_addr && eng->bootstrap_addr && strcmp(bootstrap_addr, eng->bootstrap_addr) != 0)
        kvf_debug("room %llu: bootstrap address %s differs from the engine's %s",
                  (unsigned long long)room, bootstrap_addr, eng->bootstrap_addr);
    if (eng->bootstrap_addr == NULL && !atomic_exchange(&eng->warned_no_registry, 1))
        kvf_warn("room %llu: this prefill engine has no bootstrap registry "
                 "(bootstrap_addr), so decode ranks can reach it only by its descriptor "
                 "(kvf_receiver_create_remote); said once", (unsigned long long)room);
    return create(eng, room, NULL, sender_p);
}

kvf_status_t kvf_sender_create_held(kvf_engine_t *eng, uint64_t room, const kvf_hold_t *hold,
                                    kvf_sender_t **sender_p)
{
    kvf_hold_t h;
    char err[KVF_REASON_MAX];
    if (eng == NULL || hold == NULL || sender_p == NULL) {
        kvf_error("kvf_sender_create_held: need an engine, a hold and a result");
        return KVF_ERR_INVALID_PARAM;
    }
    if (kvf__hold_import(&h, hold, "kvf_sender_create_held", err, sizeof(err)) != KVF_OK) {
        kvf_error("%s", err);
        return KVF_ERR_INVALID_PARAM;
    }
    return create(eng, room, &h, sender_p);
}

kvf_status_t kvf_sender_init(kvf_sender_t *s, uint32_t num_pages, uint32_t aux_slot)
{
    kvf_room_t *r = &s->room;
    const kvf_layout_int_t *l = &r->eng->layout;
    kvf_status_t st = KVF_OK;

    /* Published as a send is, without the engine lock: the lanes read
     * num_pages, src_pages and aux_slot only once they took it in
     * (take_init: r->initialized). */
    pthread_mutex_lock(&r->app_lock);
    if (s->init_given) {
        kvf_error("room %llu: kvf_sender_init called twice", (unsigned long long)r->id);
        st = KVF_ERR_STATE;
    } else if (!aux_slot_ok(l, aux_slot)) {
        kvf_error("room %llu: aux slot %u outside the registered aux buffers (%llu slots)",
                  (unsigned long long)r->id, aux_slot,
                  (unsigned long long)min_items(l->aux, l->num_aux));
        st = KVF_ERR_OUT_OF_RANGE;
    } else if ((s->src_pages = malloc((num_pages ? num_pages : 1) * sizeof(uint32_t))) == NULL) {
        st = KVF_ERR_NO_MEMORY;
    } else {
        s->num_pages = num_pages;
        r->aux_slot = aux_slot;
        s->init_given = 1;
        atomic_store_explicit(&s->published, KVF_SENT_INIT, memory_order_release);
    }
    pthread_mutex_unlock(&r->app_lock);
    if (st == KVF_OK)
        kvf__room_submit(r);
    return st;
}

/* The application's kvf_sender_init, taken in (take_sends): the
 * destinations that arrived before it are checked against it now. */
static void take_init(kvf_room_t *r)
{
    r->initialized = 1;
    for (uint32_t i = 0; i < r->nlinks; i++) {
        char why[KVF_REASON_MAX - 64];
        if (dest_misfit(r, &r->links[i], why, sizeof(why)) != NULL) {
            kvf__room_fail(r, KVF_ERR_BAD_INDICES, "%s", why);
            return;
        }
    }
}

kvf_status_t kvf_sender_set_states(kvf_sender_t *s, const kvf_indices_t *states, size_t n)
{
    kvf_room_t *r = &s->room;
    const kvf_layout_int_t *l = &r->eng->layout;
    unsigned long long id = r->id;
    kvf_states_t st_src;
    kvf_status_t st = KVF_OK;

    if (n != l->num_groups || (n > 0 && states == NULL)) {
        kvf_error("room %llu: state indices for %zu groups given, %u state groups "
                  "registered", id, n, l->num_groups);
        return KVF_ERR_INVALID_PARAM;
    }
    for (size_t g = 0; g < n; g++) {
        if ((states[g].n > 0 && states[g].idx == NULL) || states[g].n > UINT32_MAX) {
            kvf_error("room %llu: state group %zu: %zu indices at %p", id, g, states[g].n,
                      (const void *)states[g].idx);
            return KVF_ERR_INVALID_PARAM;
        }
    }
    if (kvf__states_set(&st_src, states, n) != KVF_OK)
        return KVF_ERR_NO_MEMORY;
    uint32_t bad = first_bad_state(l, &st_src);
    if (bad < st_src.total) {
        kvf_error("room %llu: state index %u (position %u) outside its state group's "
                  "buffers", id, st_src.idx[bad], bad);
        kvf__states_free(&st_src);
        return KVF_ERR_OUT_OF_RANGE;
    }
    /* The application's field, under the room's app_lock alone: the lanes
     * read state_src only once they took the last chunk in, which this
     * call must come before (last_given), and whose publishing (release)
     * follows this store. */
    pthread_mutex_lock(&r->app_lock);
    if (s->last_given || s->state_src.ngroups > 0) {
        kvf_error("room %llu: state indices %s", id, s->last_given
                  ? "given after the last chunk" : "given twice");
        st = KVF_ERR_STATE;
    } else {
        s->state_src = st_src;
        memset(&st_src, 0, sizeof(st_src));
    }
    pthread_mutex_unlock(&r->app_lock);
    kvf__states_free(&st_src);
    return st;
}

/* One slot per state group (a layout of plain state buffers: one each). */
kvf_status_t kvf_sender_set_state(kvf_sender_t *s, const uint32_t *slots, size_t n)
{
    if (n == 0)
        return KVF_OK;
    kvf_indices_t *one = slots && n <= KVF_WIRE_MAX_BUFS ? malloc(n * sizeof(*one)) : NULL;
    if (one == NULL) {
        kvf_error("room %llu: kvf_sender_set_state: %zu slots at %p",
                  (unsigned long long)s->room.id, n, (const void *)slots);
        return slots && n <= KVF_WIRE_MAX_BUFS ? KVF_ERR_NO_MEMORY : KVF_ERR_INVALID_PARAM;
    }
    for (size_t i = 0; i < n; i++)
        one[i] = (kvf_indices_t){&slots[i], 1};
    kvf_status_t st = kvf_sender_set_states(s, one, n);
    free(one);
    return st;
}

/* Without the engine lock: the lane stores the prefix before it turns
 * the room WAITING_FOR_INPUT (whose store releases it). */
kvf_status_t kvf_sender_decode_prefix_len(kvf_sender_t *s, uint32_t *tokens_p)
{
    if (room_state(&s->room) < KVF_POLL_WAITING_FOR_INPUT)
        return KVF_ERR_AGAIN;
    uint64_t known = atomic_load_explicit(&s->prefix_known, memory_order_relaxed);
    if (!(known & KVF_PREFIX_KNOWN))
        return KVF_ERR_AGAIN;
    *tokens_p = (uint32_t)known;
    return KVF_OK;
}

/*
 * The link that carries the room's state wants as many indices of each
 * group as the sender has: otherwise the room fails (no partial state).
 * @return 0 when it failed.
 */
static int state_counts_agree(kvf_room_t *r)
{
    const kvf_states_t *src = &sender_of(r)->state_src;
    char name[128], type[64];
    for (uint32_t i = 0; i < r->nlinks; i++) {
        const kvf_states_t *dst = &r->links[i].tx.state;
        for (uint32_t g = 0; g < dst->ngroups; g++) {
            if (src->count[g] == dst->count[g])
                continue;
            kvf__group_type(&r->eng->layout, g, type, sizeof(type));
            kvf__room_fail(r, KVF_ERR_BAD_INDICES, "room %llu: state group %u (%s): the "
                           "prefill gave %u indices, %s expects %u",
                           (unsigned long long)r->id, g, type, src->count[g],
                           kvf__peer_name(r->links[i].peer, name, sizeof(name)),
                           dst->count[g]);
            return 0;
        }
    }
    return 1;
}

/*
 * Why the room takes no send now (with its status in *st_p), or NULL.
 * Under the room's app_lock, without the engine lock: the fields read are
 * the application's own (last_given, init_given) or set before it could
 * call (held), and the room's state is atomic.
 */
static const char *room_refusal(const kvf_sender_t *s, kvf_status_t *st_p)
{
    kvf_poll_t state = room_state(&s->room);
    *st_p = KVF_ERR_STATE;
    if (!s->init_given)
        return "kvf_sender_init was not called";
    if (s->last_given)
        return "the last chunk was already sent";
    if (state == KVF_POLL_FAILED)
        return "the room failed";
    if (state < KVF_POLL_WAITING_FOR_INPUT && !s->held)
        return "the room is still Bootstrapping (poll until WaitingForInput)";
    *st_p = KVF_OK;
    return NULL;
}

/* Why kvf_sender_send may not send this chunk of every layer now, from
 * pages_given on, or NULL (room_refusal first); under app_lock. */
static const char *send_refusal(kvf_sender_t *s, size_t n, int is_last, kvf_status_t *st_p)
{
    *st_p = KVF_ERR_STATE;
    if (is_last && s->state_src.ngroups == 0 && atomic_load(&s->wants_states))
        return "the decode side declared state indices: call kvf_sender_set_states "
               "before the last chunk";
    *st_p = KVF_ERR_OUT_OF_RANGE;
    if (n > s->num_pages - s->pages_given)
        return "more pages than kvf_sender_init declared";
    *st_p = KVF_ERR_INVALID_PARAM;
    if (is_last && s->pages_given + n != s->num_pages)
        return "the last chunk leaves declared pages unsent";
    if (n == 0 && !is_last)
        return "an empty chunk that is not the last";
    *st_p = KVF_OK;
    return NULL;
}

/* "layer 3", "layer 2 of group 1": layer slot k as messages name it. */
static const char *slot_name(const kvf_layout_int_t *l, uint32_t k, char *buf, size_t len)
{
    if (l->slots[k].group == 0)
        snprintf(buf, len, "layer %u", l->slots[k].layer);
    else
        snprintf(buf, len, "layer %u of group %u", l->slots[k].layer, l->slots[k].group);
    return buf;
}

/* Is slot k short of `want` pages once `add` more are given to each? */
static int slot_short(_Atomic uint32_t *given, uint32_t k, uint32_t add, uint32_t want)
{
    return (uint64_t)atomic_load_explicit(&given[k], memory_order_relaxed) + add < want;
}

/*
 * The layers of a layer-wise room that have fewer than `want` pages once
 * `add` more are given to each, as ranges into buf ("layers 4-7, layer 9
 * of group 1": the first four ranges, then how many layers more).
 * @return the first such slot, or num_slots: none.
 */
static uint32_t short_layers(const kvf_layout_int_t *l, _Atomic uint32_t *given,
                             uint32_t add, uint32_t want, char *buf, size_t len)
{
    uint32_t first = l->num_slots, runs = 0, more = 0;
    size_t at = 0;
    buf[0] = '\0';
    for (uint32_t k = 0, e; k < l->num_slots; k = e) {
        e = k + 1;
        if (!slot_short(given, k, add, want))
            continue;
        while (e < l->num_slots && l->slots[e].group == l->slots[k].group &&
               l->slots[e].layer == l->slots[e - 1].layer + 1 &&
               slot_short(given, e, add, want))
            e++;
        first = first < k ? first : k;
        if (runs++ == 4 || at >= len) {
            more += e - k;
            runs--;
            continue;
        }
        char g[24] = "";
        if (l->slots[k].group != 0)
            snprintf(g, sizeof(g), " of group %u", l->slots[k].group);
        if (e - k == 1)
            at += (size_t)snprintf(buf + at, len - at, "%slayer %u%s", runs > 1 ? ", " : "",
                                   l->slots[k].layer, g);
        else
            at += (size_t)snprintf(buf + at, len - at, "%slayers %u-%u%s",
                                   runs > 1 ? ", " : "", l->slots[k].layer,
                                   l->slots[e - 1].layer, g);
    }
    if (more > 0 && at < len)
        snprintf(buf + at, len - at, " and %u layers more", more);
    return first;
}

/* The first slot of [lo, hi) that has not exactly `at` pages, or hi. */
static uint32_t slot_not_at(_Atomic uint32_t *given, uint32_t lo, uint32_t hi, uint32_t at)
{
    for (uint32_t k = lo; k < hi; k++)
        if (atomic_load_explicit(&given[k], memory_order_relaxed) != at)
            return k;
    return hi;
}

/*
 * kvf_sender_send on a layer-wise room (under app_lock): it sends every
 * layer's next pages, so every layer must be at the same page, which
 * pages_given then is; and a last send must leave no layer short, or the
 * room fails (*fail_p, the reason in why).  @return NULL, or why not.
 */
static const char *layered_refusal(kvf_sender_t *s, _Atomic uint32_t *given, size_t n,
                                   int is_last, int *fail_p, char *why, size_t len,
                                   kvf_status_t *st_p)
{
    const kvf_layout_int_t *l = &s->room.eng->layout;
    uint32_t at = atomic_load_explicit(&given[0], memory_order_relaxed);
    uint32_t odd = slot_not_at(given, 0, l->num_slots, at);
    char a[48], b[48], list[160], rank[96];
    *st_p = KVF_ERR_INVALID_PARAM;
    if (odd < l->num_slots && n > 0) {
        snprintf(why, len, "its layers are at different pages (%s has %u, %s %u), and "
                 "kvf_sender_send sends the next pages of every layer: send each layer's "
                 "rest with kvf_sender_send_layers", slot_name(l, 0, a, sizeof(a)), at,
                 slot_name(l, odd, b, sizeof(b)),
                 atomic_load_explicit(&given[odd], memory_order_relaxed));
        return why;
    }
    s->pages_given = at;
    if (!is_last || n > s->num_pages - at)
        return NULL;
    uint32_t k = short_layers(l, given, (uint32_t)n, s->num_pages, list, sizeof(list));
    if (k == l->num_slots)
        return NULL;
    *fail_p = 1;
    snprintf(why, len, "room %llu: the last send left %s without every one of the %u pages "
             "kvf_sender_init declared (%s had %u) on %s: a layer never sent",
             (unsigned long long)s->room.id, list, s->num_pages, slot_name(l, k, a, sizeof(a)),
             atomic_load_explicit(&given[k], memory_order_relaxed) + (uint32_t)n,
             kvf__engine_rank_name_unlocked(s->room.eng, rank, sizeof(rank)));
    return why;
}

/* Publish the next n pages of every layer (after the checks, under
 * app_lock): the pages first, then how far they go (release), then the
 * room on the lanes' list (take_sends takes them in). */
static void publish_send(kvf_sender_t *s, _Atomic uint32_t *given, const uint32_t *pages,
                         size_t n, int is_last)
{
    if (n > 0)
        memcpy(s->src_pages + s->pages_given, pages, n * sizeof(uint32_t));
    s->pages_given += (uint32_t)n;
    s->pages_known = s->pages_given > s->pages_known ? s->pages_given : s->pages_known;
    for (uint32_t k = 0; given != NULL && n > 0 && k < s->room.eng->layout.num_slots; k++)
        atomic_store_explicit(&given[k], s->pages_given, memory_order_release);
    s->last_given = is_last;
    atomic_store_explicit(&s->published,
                          KVF_SENT_INIT | s->pages_given | (is_last ? KVF_SENT_LAST : 0),
                          memory_order_release);
}

kvf_status_t kvf_sender_send(kvf_sender_t *s, const uint32_t *pages, size_t n,
                             int is_last)
{
    kvf_room_t *r = &s->room;
    const kvf_layout_int_t *l = &r->eng->layout;
    kvf_status_t st;
    char why_buf[KVF_REASON_MAX];
    int fail = 0;
    size_t bad;

    if (n > 0 && pages == NULL)
        return KVF_ERR_INVALID_PARAM;
    if ((bad = first_bad_page(l, pages, n)) < n) {
        kvf_error("room %llu: page %u (chunk index %zu) outside the registered KV "
                  "buffers (%llu pages); nothing sent", (unsigned long long)r->id,
                  pages[bad], bad, (unsigned long long)min_items(l->kv, l->num_kv));
        return KVF_ERR_OUT_OF_RANGE;
    }
    pthread_mutex_lock(&r->app_lock);
    _Atomic uint32_t *given = atomic_load_explicit(&s->slot_given, memory_order_relaxed);
    const char *why = room_refusal(s, &st);
    if (why == NULL && given != NULL)
        why = layered_refusal(s, given, n, is_last, &fail, why_buf, sizeof(why_buf), &st);
    if (why == NULL)
        why = send_refusal(s, n, is_last, &st);
    if (why != NULL) {
        kvf_error("room %llu: send of %zu pages (pages %u..%zu of %u%s) refused: %s",
                  (unsigned long long)r->id, n, s->pages_given, s->pages_given + n,
                  s->num_pages, is_last ? ", last" : "", why);
        pthread_mutex_unlock(&r->app_lock);
        if (fail)
            kvf__room_fail_app(r, KVF_ERR_INCOMPLETE, why);
        return st;
    }
    publish_send(s, given, pages, n, is_last);
    pthread_mutex_unlock(&r->app_lock);
    kvf__room_submit(r);
    return KVF_OK;
}

/* The layer slots of layers [lb, le) of `group`, every one held here:
 * [*lo_p, *hi_p).  @return NULL, or why not (with its status). */
static const char *layer_slots(const kvf_layout_int_t *l, uint32_t group, uint32_t lb,
                               uint32_t le, uint32_t *lo_p, uint32_t *hi_p, char *why,
                               size_t len, kvf_status_t *st_p)
{
    *st_p = KVF_ERR_INVALID_PARAM;
    if (lb >= le) {
        snprintf(why, len, "layers [%u, %u) of group %u: no layer", lb, le, group);
        return why;
    }
    *st_p = KVF_ERR_OUT_OF_RANGE;
    for (uint32_t layer = lb; layer < le; layer++) {
        uint32_t k = kvf__slot_of(l, group, layer);
        if (k == UINT32_MAX) {
            snprintf(why, len, "layer %u of group %u: no KV buffer of this rank holds it",
                     layer, group);
            return why;
        }
        *lo_p = layer == lb ? k : *lo_p;
        *hi_p = k + 1;
    }
    *st_p = KVF_OK;
    return NULL;
}

/*
 * Why kvf_sender_send_layers may not send pages [first, first + n) of
 * layer slots [lo, hi) now, or NULL (room_refusal first); under app_lock.
 * given is NULL before the room's first per-layer send: every slot then
 * has pages_given.
 */
static const char *layers_refusal(kvf_sender_t *s, _Atomic uint32_t *given,
                                  const uint32_t *pages, size_t n, uint32_t first,
                                  uint32_t lo, uint32_t hi, char *why, size_t len,
                                  kvf_status_t *st_p)
{
    const kvf_layout_int_t *l = &s->room.eng->layout;
    char a[48];
    *st_p = KVF_ERR_OUT_OF_RANGE;
    if (first > s->num_pages || n > s->num_pages - first) {
        snprintf(why, len, "pages [%u, %llu) are past the %u kvf_sender_init declared", first,
                 (unsigned long long)first + n, s->num_pages);
        return why;
    }
    *st_p = KVF_ERR_INVALID_PARAM;
    for (uint32_t k = lo; k < hi; k++) {
        uint32_t at = given != NULL ? atomic_load_explicit(&given[k], memory_order_relaxed)
                                    : s->pages_given;
        if (at > first)
            snprintf(why, len, "%s already has pages [0, %u): a layer's pages are sent once",
                     slot_name(l, k, a, sizeof(a)), at);
        else if (at < first)
            snprintf(why, len, "%s has pages [0, %u) only: pages [%u, %u) come first (each "
                     "layer's chunks in page order)", slot_name(l, k, a, sizeof(a)), at, at,
                     first);
        if (at != first)
            return why;
    }
    for (uint32_t p = first; p < s->pages_known && p - first < n; p++) {
        if (s->src_pages[p] != pages[p - first]) {
            snprintf(why, len, "page %u of the room was sent as source page %u, and is "
                     "named %u now: every layer has the same pages", p, s->src_pages[p],
                     pages[p - first]);
            return why;
        }
    }
    *st_p = KVF_OK;
    return NULL;
}

/* A layer-wise room's slots, made at its first per-layer send (under
 * app_lock): each with the pages every layer had so far.  NULL: no memory. */
static _Atomic uint32_t *layered(kvf_sender_t *s)
{
    uint32_t ns = s->room.eng->layout.num_slots;
    _Atomic uint32_t *given = malloc(ns * sizeof(*given));
    for (uint32_t k = 0; given != NULL && k < ns; k++)
        atomic_init(&given[k], s->pages_given);
    if (given != NULL)
        atomic_store_explicit(&s->slot_given, given, memory_order_release);
    return given;
}

kvf_status_t kvf_sender_send_layers(kvf_sender_t *s, const uint32_t *pages, size_t n,
                                    uint32_t first, uint32_t group, uint32_t layer_begin,
                                    uint32_t layer_end)
{
    kvf_room_t *r = &s->room;
    const kvf_layout_int_t *l = &r->eng->layout;
    kvf_status_t st = KVF_ERR_INVALID_PARAM;
    char why_buf[256];
    const char *why = n == 0 || pages == NULL ? "no pages" : NULL;
    uint32_t lo = 0, hi = 0;
    size_t bad;

    if (why == NULL && (bad = first_bad_page(l, pages, n)) < n) {
        snprintf(why_buf, sizeof(why_buf), "page %u (chunk index %zu) is outside the "
                 "registered KV buffers (%llu pages)", pages[bad], bad,
                 (unsigned long long)min_items(l->kv, l->num_kv));
        why = why_buf;
        st = KVF_ERR_OUT_OF_RANGE;
    }
    if (why == NULL)
        why = layer_slots(l, group, layer_begin, layer_end, &lo, &hi, why_buf,
                          sizeof(why_buf), &st);
    pthread_mutex_lock(&r->app_lock);
    _Atomic uint32_t *given = atomic_load_explicit(&s->slot_given, memory_order_relaxed);
    if (why == NULL)
        why = room_refusal(s, &st);
    if (why == NULL)
        why = layers_refusal(s, given, pages, n, first, lo, hi, why_buf, sizeof(why_buf), &st);
    if (why == NULL && given == NULL && (given = layered(s)) == NULL) {
        why = "no memory for its layers";
        st = KVF_ERR_NO_MEMORY;
    }
    if (why != NULL) {
        kvf_error("room %llu: send of pages [%u, %llu) of layers [%u, %u) of group %u "
                  "refused: %s", (unsigned long long)r->id, first,
                  (unsigned long long)first + n, layer_begin, layer_end, group, why);
        pthread_mutex_unlock(&r->app_lock);
        return st;
    }
    /* The positions no layer had named yet, then how far each layer goes
     * (release), then the room on the lanes' list (take_layers). */
    if (first + n > s->pages_known) {
        memcpy(s->src_pages + s->pages_known, pages + (s->pages_known - first),
               (first + n - s->pages_known) * sizeof(uint32_t));
        s->pages_known = first + (uint32_t)n;
    }
    for (uint32_t k = lo; k < hi; k++)
        atomic_store_explicit(&given[k], first + (uint32_t)n, memory_order_release);
    pthread_mutex_unlock(&r->app_lock);
    kvf__room_submit(r);
    return KVF_OK;
}

/*
 * take_sends for a layer-wise room: each layer slot's pages given since
 * the last time (a snapshot of slot_given, after slot_sent in the same
 * block), slots that moved alike in one chunk, then the last chunk.
 */
static void take_layers(kvf_room_t *r, _Atomic uint32_t *given, int last)
{
    kvf_sender_t *s = sender_of(r);
    uint32_t ns = r->eng->layout.num_slots;
    if (s->slot_sent == NULL) {
        if ((s->slot_sent = malloc(2 * (size_t)ns * sizeof(uint32_t))) == NULL) {
            kvf__room_fail(r, KVF_ERR_NO_MEMORY, "no memory to take in room %llu's "
                           "sends of %u layers", (unsigned long long)r->id, ns);
            return;
        }
        for (uint32_t k = 0; k < ns; k++)
            s->slot_sent[k] = s->pages_sent;
    }
    uint32_t *to = s->slot_sent + ns, least = UINT32_MAX;
    int moved = last != s->last_sent;
    for (uint32_t k = 0; k < ns; k++) {
        to[k] = atomic_load_explicit(&given[k], memory_order_acquire);
        moved |= to[k] != s->slot_sent[k];
        least = to[k] < least ? to[k] : least;
    }
    if (!moved)
        return;
    sends_t w = {.from = s->slot_sent, .to = to, .last = last && !s->last_sent};
    s->pages_sent = least;               /* every layer has these */
    s->last_sent = last;
    kvf_poll_t state = room_state(r);
    if (state != KVF_POLL_FAILED && state >= KVF_POLL_WAITING_FOR_INPUT &&
        (!w.last || last_chunk_fits(r)))
        queue_all(r, &w);
    memcpy(s->slot_sent, to, ns * sizeof(uint32_t));
}

/*
 * Take in what the application published (kvf_sender_init, then the
 * chunks of kvf_sender_send) since the last time: the room's `take` op,
 * run by the first lane to end a pass.  A failed room sends nothing more;
 * a held room that some reader has not asked for yet keeps them
 * (release_held).
 */
static void take_sends(kvf_room_t *r)
{
    KVF_ASSERT_LOCKED(r->eng);
    kvf_sender_t *s = sender_of(r);
    uint64_t pub = atomic_load_explicit(&s->published, memory_order_acquire);
    _Atomic uint32_t *given = atomic_load_explicit(&s->slot_given, memory_order_acquire);
    uint32_t upto = (uint32_t)pub, first = s->pages_sent;
    int last = (pub & KVF_SENT_LAST) != 0;

    if ((pub & KVF_SENT_INIT) && !r->initialized)
        take_init(r);
    if (given != NULL) {
        take_layers(r, given, last);
        return;
    }
    if (upto == first && last == s->last_sent)
        return;
    s->pages_sent = upto;
    s->last_sent = last;
    kvf_poll_t state = room_state(r);
    if (state == KVF_POLL_FAILED || state < KVF_POLL_WAITING_FOR_INPUT)
        return;
    if (last && !last_chunk_fits(r))
        return;      /* the room failed, with the reason; the call did not */
    sends_t w = {.pages = s->src_pages + first, .first = first, .n = upto - first,
                 .last = last};
    queue_all(r, &w);
}

/* To link li: what w says (sends_t), layer slots that move alike in one
 * chunk per stream, the last chunk after every other. */
static kvf_status_t queue_link(kvf_room_t *r, uint32_t li, const sends_t *w)
{
    const kvf_sender_t *s = sender_of(r);
    uint32_t ns = r->eng->layout.num_slots;
    kvf_status_t st = KVF_OK;
    if (w->to == NULL)
        return queue_pages(r, li, w->pages, w->first, w->n, w->last, (slots_t){0, ns});
    for (uint32_t lo = 0, hi; lo < ns && st == KVF_OK; lo = hi) {
        uint32_t a = w->from != NULL ? w->from[lo] : 0, b = w->to[lo];
        for (hi = lo + 1; hi < ns && (w->from != NULL ? w->from[hi] : 0) == a &&
                          w->to[hi] == b; hi++)
            ;
        if (b > a)
            st = queue_pages(r, li, s->src_pages + a, a, b - a, 0, (slots_t){lo, hi});
    }
    if (st == KVF_OK && w->last)
        st = queue_pages(r, li, NULL, 0, 0, 1, (slots_t){0, 0});
    return st;
}

/*
 * Queue what w says to every link: a link that owes nothing is done with
 * the last chunk, a broken one gets it all again when it resumes.  The
 * room is then TRANSFERRING, or SUCCESS when nothing is owed.
 */
static void queue_all(kvf_room_t *r, const sends_t *w)
{
    kvf_status_t st = KVF_OK;
    for (uint32_t i = 0; i < r->nlinks && st == KVF_OK; i++) {
        kvf_link_t *lk = &r->links[i];
        if (lk->idle)
            lk->done = w->last;
        else if (!lk->broken)
            st = queue_link(r, i, w);
    }
    if (st != KVF_OK) {
        kvf__room_fail(r, st, "cannot queue chunk: %s", kvf_status_str(st));
        return;
    }
    kvf__room_set_state(r, KVF_POLL_TRANSFERRING);
    if (all_done(r))
        kvf__room_set_state(r, KVF_POLL_SUCCESS);
}

/* Fail a held room whose lease ended with a reader missing. */
static void lease_tick(kvf_room_t *r, uint64_t now)
{
    kvf_sender_t *s = sender_of(r);
    uint64_t held = kvf_elapsed_ms(now, r->t_create_ms);
    if (held < s->lease_ms)
        return;
    if (r->nlinks == 0)
        kvf__room_fail(r, KVF_ERR_LEASE_EXPIRED, "room %llu: its lease ended %.1f s after "
                       "it was held, and no decode rank asked for it; its pages are free",
                       (unsigned long long)r->id, (double)held / 1000.0);
    else
        kvf__room_fail(r, KVF_ERR_LEASE_EXPIRED, "room %llu: its lease ended %.1f s after "
                       "it was held, with %u of its %u readers asking; its pages are free",
                       (unsigned long long)r->id, (double)held / 1000.0, r->nlinks,
                       r->expected_links);
}

kvf_poll_t kvf_sender_poll(const kvf_sender_t *s) { return room_state(&s->room); }

kvf_status_t kvf_sender_failure(kvf_sender_t *s, kvf_failure_t *f)
{
    return kvf__room_consume_failure(&s->room, f, "kvf_sender_failure");
}

void kvf_sender_abort(kvf_sender_t *s) { kvf__room_abort(&s->room); }

kvf_status_t kvf_sender_fail(kvf_sender_t *s, kvf_status_t st, const char *reason)
{
    return s == NULL ? KVF_ERR_INVALID_PARAM : kvf__room_fail_app(&s->room, st, reason);
}

kvf_status_t kvf_sender_await_failure(kvf_sender_t *s, unsigned timeout_ms)
{
    return s == NULL ? KVF_ERR_INVALID_PARAM : kvf__room_await_failure(&s->room, timeout_ms);
}

void kvf_sender_destroy(kvf_sender_t *s)
{
    if (s != NULL)
        kvf__room_destroy(&s->room);
}


uint64_t kvf_sender_room(const kvf_sender_t *s) { return s->room.id; }

kvf_status_t kvf_sender_metric(kvf_sender_t *s, kvf_room_metric_t *m)
{
    return kvf__room_metric(&s->room, m);
}

/*
 * Answer a decode rank's DONE_ACK with one of our own, the room being
 * live: on a pull link, what it read was still ours (it waits for this);
 * on a push link, its answer arrived (it stops keeping it, acks.c).
 */
static void confirm(kvf_peer_t *p, const kvf_link_t *lk, const kvf_msg_done_ack_t *m)
{
    kvf_msg_t c = {.type = KVF_MSG_DONE_ACK};
    c.u.done_ack.room = m->room;
    c.u.done_ack.instance = lk->tx.instance;
    c.u.done_ack.status = KVF_OK;
    c.u.done_ack.bytes = m->bytes;
    kvf__peer_send(p, &c);
}

static void on_done_ack(kvf_peer_t *p, kvf_room_t *r, kvf_link_t *lk,
                        const kvf_msg_done_ack_t *m)
{
    char name[128];

    if (!lk->tx.last_queued)
        return;
    if (lk->done) {
        /* A push link's answer said twice (the first confirmation was
         * lost with its connection): confirmed again. */
        if (m->status == KVF_OK && !kvf__peer_pulls(p))
            confirm(p, lk, m);
        return;
    }
    if (m->status != KVF_OK) {
        kvf__room_fail(r, (kvf_status_t)m->status, "%s refused room %llu's data: %s",
                       kvf__peer_name(p, name, sizeof(name)), (unsigned long long)r->id,
                       kvf_status_str((kvf_status_t)m->status));
        return;
    }
    lk->done = 1;
    kvf__trace_peer_event(r, "ack_received", p, -1, -1, (int64_t)m->bytes);
    confirm(p, lk, m);
    if (all_done(r))
        kvf__room_set_state(r, KVF_POLL_SUCCESS);
}

/*
 * A DONE_ACK from p that no link of r is bound to: is it a push link's
 * answer said again on a new connection of the decode engine the link is
 * bound to (acks.c)?  @return that link (moved to p when the answer counts
 * every byte queued on it), or NULL.
 */
static kvf_link_t *reacked(kvf_room_t *r, kvf_peer_t *p, const kvf_msg_done_ack_t *m)
{
    char name[128];

    for (uint32_t i = 0; i < r->nlinks; i++) {
        kvf_link_t *lk = &r->links[i];
        if (lk->tx.instance != m->instance || lk->peer == p ||
            lk->peer->instance_id != p->instance_id || kvf__peer_pulls(lk->peer))
            continue;
        if (lk->done)
            return lk;             /* taken before its connection went */
        if (!lk->tx.last_queued || m->status != KVF_OK || m->bytes != lk->bytes)
            return NULL;
        kvf_info("%s repeated its acknowledgement of room %llu (%llu bytes) on a new "
                 "connection", kvf__peer_name(p, name, sizeof(name)),
                 (unsigned long long)r->id, (unsigned long long)m->bytes);
        kvf__peer_put(lk->peer);
        lk->peer = p;
        p->refs++;
        lk->broken = 0;
        return lk;
    }
    return NULL;
}

/*
 * The receiver a slot is bound to (same room instance) lost its
 * connection and asks again (attempt > 0): move its link to the new
 * connection and resend everything queued so far (writes are idempotent).
 */
static int resume(kvf_room_t *r, kvf_peer_t *p, kvf_link_t *lk, const kvf_link_t *req)
{
    char name[128];
    uint32_t li = (uint32_t)(lk - r->links);

    kvf__peer_name(p, name, sizeof(name));
    if (room_final(r)) {
        if (room_state(r) == KVF_POLL_FAILED)
            kvf__send_fail(p, r->id, req->tx.instance, r->failure, 0);
        return 1;
    }
    if (lk->peer->instance_id != p->instance_id) {
        /* Not the engine the room is bound to: refused, the room goes on. */
        refuse(r, p, req->tx.instance, KVF_ERR_PEER_RESTARTED, "%s resumed room %llu, which "
               "is bound to decode engine instance %016llx, not %016llx: refused",
               name, (unsigned long long)r->id, (unsigned long long)lk->peer->instance_id,
               (unsigned long long)p->instance_id);
        return 1;
    }
    if (req->tx.n_pages != lk->tx.n_pages ||
        memcmp(req->tx.pages, lk->tx.pages, lk->tx.n_pages * sizeof(uint32_t)) != 0) {
        kvf__room_fail(r, KVF_ERR_BAD_INDICES, "%s resumed room %llu with a different "
                       "destination", name, (unsigned long long)r->id);
        return 1;
    }
    kvf_sender_t *snd = sender_of(r);
    kvf_info("%s resumed room %llu (attempt %u): resending %u pages", name,
             (unsigned long long)r->id, r->retries, snd->pages_sent);
    kvf__peer_put(lk->peer);
    lk->peer = p;
    p->refs++;
    lk->broken = 0;
    lk->done = 0;
    lk->tx.last_queued = 0;
    kvf__link_streams_reset(r, lk, kvf__peer_nstreams(p), !lk->idle && want_checksum(r->eng, p));
    r->t_state_ms = kvf_now_ms();
    /* (A held room that is still waiting for readers keeps its pages.) */
    if (anything_sent(snd) && room_state(r) >= KVF_POLL_WAITING_FOR_INPUT) {
        sends_t w = sent_so_far(snd);
        kvf_status_t st = queue_link(r, li, &w);
        if (st != KVF_OK)
            kvf__room_fail(r, st, "cannot queue the resend: %s", kvf_status_str(st));
    }
    return 1;
}

static int tomb_has_rank(const kvf_tomb_t *t, uint32_t rank)
{
    for (uint32_t i = 0; i < t->nranks; i++)
        if (t->ranks[i] == rank)
            return 1;
    return 0;
}

/* A decode rank's destination for room r (NULL: no sender for it yet, or
 * any more), or its watch (siblings.c). */
static kvf_verdict_t on_room_req(kvf_peer_t *p, kvf_room_t *r, const kvf_msg_room_req_t *m)
{
    kvf_engine_t *eng = p->eng;
    const kvf_layout_int_t *pl = &p->layout;
    kvf_link_t lk = {0};
    const char *bad = NULL;

    if (m->flags & KVF_REQ_WATCH) {            /* a sibling's: no destination */
        kvf__siblings_on_watch(p, r, m);
        return kvf__verdict_ok();
    }
    lk.rank = m->dst_rank;
    lk.tx.n_pages = m->pages.count;
    lk.aux_slot = m->aux_slot;
    lk.tx.prefix = m->decode_prefix_len;
    lk.want_instance = m->sender_instance;
    lk.tx.pages = malloc((lk.tx.n_pages ? lk.tx.n_pages : 1) * sizeof(uint32_t));
    if (lk.tx.pages == NULL ||
        kvf__states_from_wire(&lk.tx.state, &m->state_counts, &m->state_idx) != KVF_OK) {
        free(lk.tx.pages);
        return kvf__verdict(KVF_ERR_NO_MEMORY, "no memory for a room destination");
    }
    for (uint32_t i = 0; i < lk.tx.n_pages; i++)
        lk.tx.pages[i] = kvf_wire_arr32_at(&m->pages, i);
    /* Against the decode rank's own layout, as its HELLO described it. */
    if (m->aux_slot != KVF_NO_SLOT && !aux_slot_ok(pl, m->aux_slot))
        bad = "aux slot outside its registered aux buffers";
    else if (lk.tx.state.ngroups != 0 && lk.tx.state.ngroups != pl->num_groups)
        bad = "a state group count that differs from its state groups";
    else if (first_bad_page(pl, lk.tx.pages, lk.tx.n_pages) < lk.tx.n_pages)
        bad = "a page outside its registered KV buffers";
    else if (lk.tx.state.ngroups != 0 && first_bad_state(pl, &lk.tx.state) < lk.tx.state.total)
        bad = "a state index outside its state buffers";

    char name[128];
    kvf__peer_name(p, name, sizeof(name));
    kvf_failure_t *f = NULL;
    if ((bad != NULL || p->incompatible != NULL) && (f = malloc(sizeof(*f))) == NULL) {
        /* Without the record the request would pass for a valid one. */
        free(lk.tx.pages);
        kvf__states_free(&lk.tx.state);
        return kvf__verdict(KVF_ERR_NO_MEMORY, "no memory to refuse a room destination");
    }
    if (f != NULL) {
        if (bad)
            kvf__failure_set(f, eng, KVF_ERR_BAD_INDICES, "%s sent a destination for "
                             "room %llu with %s", name, (unsigned long long)m->room, bad);
        else
            kvf__failure_set(f, eng, KVF_ERR_INCOMPATIBLE, "%s", p->incompatible);
    }
    lk.tx.instance = m->instance;
    const kvf_tomb_t *tomb = r == NULL ? kvf_map_get(&eng->tombs, m->room) : NULL;
    if (r == NULL && (kvf__instance_retired(eng, m->instance) ||
                      (tomb != NULL && !tomb_has_rank(tomb, m->dst_rank)))) {
        /* Resuming, or asking late, for a room whose sender is gone: a
         * rank the failed sender never heard from, or an instance it
         * served.  (A new instance from a rank it had bound is a retry
         * with the id reused: stashed for the next sender.  So is a
         * resume of an instance no sender served: its sender is still to
         * come, and its first request, if it got here, may wait in the
         * stash too, or went with the connection that broke.) */
        kvf__sender_answer_gone(p, m->room, m->instance);
        free(f);
    } else if (r == NULL) {
        kvf__sender_stash_add(p, m->room, m->instance, &lk, m->expected_receivers, f, 0);
    } else {
        take_request(r, p, &lk, m->expected_receivers, m->attempt, f);
    }
    free(lk.tx.pages);
    kvf__states_free(&lk.tx.state);
    return kvf__verdict_ok();
}

/* ---- the prefill side's room ops (room.h, kvf_room_ops_t) --------------- */

/* A FAIL or ABORT on a prefill engine (room.c, "Ownership"); r NULL: no
 * sender for its room yet (it waits in the stash), or any more. */
static void on_fail(kvf_peer_t *p, kvf_room_t *r, int abort, const kvf_msg_fail_t *m)
{
    kvf_engine_t *eng = p->eng;
    const char *what = abort ? "ABORT" : "FAIL";

    if (r == NULL) {
        kvf_stash_t *s = NULL;
        if (kvf__instance_retired(eng, m->instance))
            kvf__room_dropped(p, what, m->room, m->instance, "its room is gone");
        else
            s = kvf__sender_stash_add(p, m->room, m->instance, NULL, 0,
                                      kvf__room_remote_failure(m), m->sender_instance);
        if (s != NULL)
            s->sides = m->sides;
        return;
    }
    /* A room that failed still takes what its bound peers tell of where
     * else it failed (kvf__room_fail_record), and drops the rest quietly. */
    if (link_bound(r, p, m->instance) != NULL || kvf__siblings_bound(r, p, m->instance))
        kvf__room_fail_remote(r, p, abort, m);
    else if (room_state(r) == KVF_POLL_FAILED)
        return;
    else if (fail_unbound_applies(r, p, m->instance, m->sender_instance))
        kvf__room_fail_remote(r, p, abort, m);
    else
        kvf__room_dropped(p, what, m->room, m->instance, "the room is not bound to this "
                          "peer and instance");
}

/* A decode rank's answer to a link's DONE (or to a FAIL: a DONE_ACK
 * refusing the room's data). */
static void on_ack(kvf_peer_t *p, kvf_room_t *r, const kvf_msg_done_ack_t *m)
{
    kvf_link_t *lk = r ? link_bound(r, p, m->instance) : NULL;
    if (lk == NULL && r != NULL)
        lk = reacked(r, p, m);
    if (lk == NULL) {
        /* Its sender is gone (or this is another room with the id): a
         * decode rank that pulled must not trust what it read.  The
         * answer names the acknowledged instance, so it reaches
         * nothing else. */
        if (r != NULL)
            kvf__room_dropped(p, "DONE_ACK", m->room, m->instance,
                              "the room is not bound to this peer and instance");
        kvf__sender_answer_gone(p, m->room, m->instance);
    } else if (room_state(r) == KVF_POLL_FAILED) {
        kvf__room_send_fail(r, p, 0);
    } else {
        on_done_ack(p, r, lk, m);
    }
}

/* A prefill engine takes destinations, answers and failures; a DONE is
 * for a decode engine. */
static kvf_verdict_t sender_on_msg(kvf_peer_t *p, kvf_room_t *r, const kvf_msg_t *msg)
{
    switch (msg->type) {
    case KVF_MSG_ROOM_REQ:
        return on_room_req(p, r, &msg->u.room_req);
    case KVF_MSG_DONE_ACK:
        on_ack(p, r, &msg->u.done_ack);
        return kvf__verdict_ok();
    case KVF_MSG_FAIL:
    case KVF_MSG_ABORT:
        on_fail(p, r, msg->type == KVF_MSG_ABORT, &msg->u.fail);
        return kvf__verdict_ok();
    default:
        return kvf__room_unexpected(p, msg);
    }
}

/* A failed sender's record is kept to answer late requests (stash.c), and
 * the instances it served, to tell them from the next room with its id. */
static void sender_destroyed(kvf_room_t *r)
{
    if (room_state(r) == KVF_POLL_FAILED)
        kvf__sender_bury(r);
    kvf__room_retire_instances(r);
}

/* That of the link bound to `to`, or of its watch (siblings.c). */
static uint64_t sender_instance_for(kvf_room_t *r, const kvf_peer_t *to)
{
    kvf_link_t *lk = link_of(r, to);
    if (lk != NULL)
        return lk->tx.instance;
    for (uint32_t i = 0; i < r->nwatch; i++)
        if (r->watch[i].peer == to)
            return r->watch[i].instance;
    return 0;
}

/* A sender's FAILs name no request key: it asks for nothing. */
static uint64_t sender_fail_key(const kvf_room_t *r)
{
    (void)r;
    return 0;
}

/*
 * A sender that was never given its last chunk leaves every decode rank it
 * feeds without its bytes.  One that had sent everything cannot tell (the
 * decode side may have it all: docs/FAILURES.md), nor can a held room's
 * ranks, which have no siblings.
 */
static uint8_t sender_doomed_side(kvf_room_t *r)
{
    if (sender_of(r)->held || sender_of(r)->last_sent)
        return 0;
    for (uint32_t i = 0; i < r->nlinks; i++)
        if (!r->links[i].idle)
            return KVF_SIDE_BIT(KVF_ROLE_DECODE);
    return 0;
}

/* The decode rank reconnects and resumes (a ROOM_REQ again); the sender
 * waits one heartbeat timeout for that. */
static uint64_t sender_retry_at(kvf_room_t *r, uint64_t now)
{
    return now + r->eng->params.heartbeat_timeout_ms;
}

static int sender_tick(kvf_room_t *r, uint64_t now)
{
    if (!room_final(r) && has_broken_link(r) && now >= r->retry_at_ms)
        kvf__room_fail_lost(r, KVF_ROLE_DECODE, KVF_ERR_CONN_RESET, "%s; it did not "
                            "reconnect within %.1f s",
                            r->last_err ? r->last_err : "connection lost",
                            r->eng->params.heartbeat_timeout_ms / 1000.0);
    if (room_state(r) == KVF_POLL_BOOTSTRAPPING && sender_of(r)->held) {
        lease_tick(r, now);     /* the lease, not the bootstrap deadline */
        return 1;
    }
    return 0;
}

/* A layer-wise room whose application has not given every layer its
 * pages: which (into buf).  @return 0 when it has, or the room is not
 * layer-wise. */
static int layers_short(kvf_room_t *r, char *buf, size_t len)
{
    kvf_sender_t *s = sender_of(r);
    const kvf_layout_int_t *l = &r->eng->layout;
    _Atomic uint32_t *given = atomic_load_explicit(&s->slot_given, memory_order_acquire);
    char list[160], a[48];
    uint32_t k = given != NULL ? short_layers(l, given, 0, s->num_pages, list, sizeof(list))
                               : l->num_slots;
    if (k == l->num_slots)
        return 0;
    snprintf(buf, len, "the application sent %s fewer than the %u pages declared (%s: %u)",
             list, s->num_pages, slot_name(l, k, a, sizeof(a)),
             atomic_load_explicit(&given[k], memory_order_relaxed));
    return 1;
}

static void sender_deadline_detail(kvf_room_t *r, kvf_poll_t s, char *buf, size_t len)
{
    kvf_engine_t *eng = r->eng;
    if (s == KVF_POLL_BOOTSTRAPPING)
        snprintf(buf, len, "%u of %u decode ranks sent their destination%s%s",
                 r->nlinks, r->expected_links ? r->expected_links : 1,
                 eng->register_error ? "; registry: " : "",
                 eng->register_error ? eng->register_error : "");
    else if (s == KVF_POLL_WAITING_FOR_INPUT)
        snprintf(buf, len, "the scheduler did not call kvf_sender_send");
    else if (!layers_short(r, buf, len))
        snprintf(buf, len, "%u of %u pages queued, no bytes moved since",
                 sender_of(r)->pages_sent, sender_of(r)->num_pages);
}

const kvf_room_ops_t kvf_sender_room_ops = {
    .side            = KVF_ROLE_PREFILL,
    .size            = sizeof(kvf_sender_t),
    .on_msg          = sender_on_msg,
    .free            = sender_free,
    .open            = stash_apply,
    .destroyed       = sender_destroyed,
    .instance_for    = sender_instance_for,
    .fail_key        = sender_fail_key,
    .doomed_side     = sender_doomed_side,
    .retry_at        = sender_retry_at,
    .tick            = sender_tick,
    .deadline_detail = sender_deadline_detail,
    .take            = take_sends,
};
