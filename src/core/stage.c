/*
 * Staging through pinned host memory (stage.h): the prefill's staged put
 * and the engine's pool of bounce buffers.
 */
#include <assert.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/room.h"
#include "core/stage.h"
#include "core/sync.h"
#include "transport/copier.h"
#include "util/log.h"

#define SLOTS       4                 /* one on the wire, three copying ahead */
#define SLOT_BYTES  (4u << 20)        /* a DATA frame's payload (tcp.c) */
#define SLOT_SEGS   1023              /* a DATA frame's segments */
#define SLOT_PIECES KVF_WIRE_MAX_PIECES
#define POOL_MAX    64                /* bounce buffers kept for reuse */

int kvf__seg_on_device(const kvf_engine_t *eng, uint8_t kind)
{
    KVF_ASSERT_LOCKED(eng);
    int f = kind == KVF_BUF_KV ? KVF_FAMILY_KV : kind == KVF_BUF_AUX ? KVF_FAMILY_AUX
                                                                    : KVF_FAMILY_STATE;
    return kvf__family_mem(&eng->layout, f) == KVF_MEM_CUDA;
}

/* ---- the bounce pool ---------------------------------------------------- */

typedef struct kvf_bounce {
    void              *p;
    size_t             cap;
    struct kvf_bounce *next;
} kvf_bounce_t;

void *kvf__bounce_get(kvf_engine_t *eng, size_t len, size_t *cap_p)
{
    KVF_ASSERT_LOCKED(eng);
    for (kvf_bounce_t **b = &eng->bounce_free; *b != NULL; b = &(*b)->next) {
        if ((*b)->cap >= len) {
            kvf_bounce_t *f = *b;
            void *p = f->p;
            *cap_p = f->cap;
            *b = f->next;
            free(f);
            eng->bounce_pooled--;
            return p;
        }
    }
    size_t cap = len < SLOT_BYTES ? SLOT_BYTES : len;
    void *p = eng->copier_ops->host_alloc(eng->copier, cap);
    if (p == NULL)
        kvf_warn("no pinned host memory for a %zu-byte bounce buffer", cap);
    *cap_p = cap;
    return p;
}

void kvf__bounce_put(kvf_engine_t *eng, void *p, size_t cap)
{
    KVF_ASSERT_LOCKED(eng);
    kvf_bounce_t *f = eng->bounce_pooled < POOL_MAX ? malloc(sizeof(*f)) : NULL;
    if (f == NULL) {
        eng->copier_ops->host_free(eng->copier, p);
        return;
    }
    *f = (kvf_bounce_t){p, cap, eng->bounce_free};
    eng->bounce_free = f;
    eng->bounce_pooled++;
}

void kvf__bounce_free_all_unlocked(kvf_engine_t *eng)
{
    while (eng->bounce_free != NULL) {
        kvf_bounce_t *f = eng->bounce_free;
        eng->bounce_free = f->next;
        eng->copier_ops->host_free(eng->copier, f->p);
        free(f);
    }
    eng->bounce_pooled = 0;
}

void kvf__engine_progress_copier(kvf_engine_t *eng)
{
    KVF_ASSERT_LOCKED(eng);
    if (eng->copier == NULL)
        return;
    eng->copier_ops->progress(eng->copier);
    kvf__peers_reads_done(eng);
}

/* ---- the staged put ----------------------------------------------------- */

typedef enum { SLOT_FREE, SLOT_COPYING, SLOT_READY } slot_state_t;

typedef struct stage_put stage_put_t;

typedef struct slot {
    kvf_copy_t      cp;          /* first: what the copier hands back */
    stage_put_t    *sp;
    slot_state_t    state;
    uint8_t        *buf;
    size_t          cap, bytes;
    uint32_t        nsegs, yielded, pieces;
    kvf_wire_seg_t *segs;        /* SLOT_SEGS each */
    const uint8_t **srcs;
} slot_t;

struct stage_put {
    kvf_put_t      put;          /* first: what the connection sees */
    kvf_put_t     *inner;
    kvf_engine_t  *eng;
    const kvf_stage_cbs_t *cbs;
    slot_t         slots[SLOTS];
    int            ready;        /* slots set up */
    uint32_t       head, tail;   /* yielding slots[head]; filling slots[tail] */
    int            copying;      /* slots whose copy is in flight */
    int            inner_end;
    kvf_status_t   stop;         /* the room failed or a copy did: stop with it */
    int            completed;    /* the connection completed us; inner waits for copies */
    kvf_status_t   complete_st;
    int            has_carry;    /* a segment, or a strided one's rest, for the next slot */
    kvf_wire_seg_t carry;
    const uint8_t *carry_src;
    struct iovec  *dst, *src;    /* scratch for one slot's copy */
};

static void stage_free(stage_put_t *sp)
{
    kvf_engine_t *eng = sp->eng;
    for (int i = 0; i < SLOTS; i++) {
        if (sp->slots[i].buf != NULL)
            kvf__bounce_put(eng, sp->slots[i].buf, sp->slots[i].cap);
        free(sp->slots[i].segs);
        free(sp->slots[i].srcs);
    }
    free(sp->dst);
    free(sp->src);
    kvf_put_t *inner = sp->inner;
    kvf_status_t st = sp->complete_st;
    free(sp);
    inner->complete(inner, st);
}

static void slot_copied(kvf_copy_t *cp, kvf_status_t st, const char *err)
{
    slot_t *s = (slot_t *)cp;
    stage_put_t *sp = s->sp;
    sp->copying--;
    sp->eng->copies_inflight--;
    sp->inner->busy(sp->inner, 0);     /* its pages are no longer read */
    s->state = SLOT_READY;
    if (st != KVF_OK && sp->stop == KVF_OK) {
        sp->stop = st;
        sp->cbs->fail(sp->inner, st, err ? err : kvf_status_str(st));
    }
    if (sp->completed && sp->copying == 0)
        stage_free(sp);
}

static int setup(stage_put_t *sp)
{
    size_t maxp = SLOT_PIECES;
    sp->dst = malloc(maxp * sizeof(struct iovec));
    sp->src = malloc(maxp * sizeof(struct iovec));
    if (sp->dst == NULL || sp->src == NULL)
        return 0;
    for (int i = 0; i < SLOTS; i++) {
        slot_t *s = &sp->slots[i];
        s->sp = sp;
        s->cp.done = slot_copied;
        s->segs = malloc(SLOT_SEGS * sizeof(*s->segs));
        s->srcs = malloc(SLOT_SEGS * sizeof(*s->srcs));
        if (s->segs == NULL || s->srcs == NULL)
            return 0;
    }
    sp->ready = 1;
    return 1;
}

/* The next segment from inner (or the carried rest): as put->next. */
static int inner_next(stage_put_t *sp, kvf_wire_seg_t *seg, const uint8_t **src)
{
    if (sp->has_carry) {
        sp->has_carry = 0;
        *seg = sp->carry;
        *src = sp->carry_src;
        return 1;
    }
    const void *s;
    int rc = sp->inner->next(sp->inner, seg, &s);
    *src = s;
    return rc;
}

/* The next segment for slot s, cut between pieces to what the slot still
 * holds (the rest carried to the next slot): *fit_p of its *cnt_p pieces.
 * @return 1, or 0: the slot is done (inner ended or failed, or the whole
 * segment waits for the next slot). */
static int take_segment(stage_put_t *sp, const slot_t *s, uint64_t payload,
                        kvf_wire_seg_t *seg, const uint8_t **src, uint32_t *fit_p,
                        uint32_t *cnt_p)
{
    int rc = inner_next(sp, seg, src);
    if (rc < 0) {
        sp->stop = (kvf_status_t)rc;
        return 0;
    }
    if (rc == 0) {
        sp->inner_end = 1;
        return 0;
    }
    uint32_t cnt = kvf_wire_seg_pieces(seg), fit = cnt;
    uint64_t room = SLOT_BYTES - payload;
    if (cnt > 1) {
        /* Pieces come only from a head slice (sender.c, next_kv): a piece
         * is nheads x bytes_per_head (x page_size), nheads >= 1 heads this
         * rank feeds (parallel.c, kvf__plan_slice), and bytes_per_head >= 1
         * since layout.c refuses an item_bytes of 0 or one that is not a
         * multiple of page_size x heads_per_rank (copy_bufs, check_heads). */
        assert(seg->len > 0);
        uint64_t by_bytes = room / seg->len;
        fit = SLOT_PIECES - s->pieces;
        fit = by_bytes < fit ? (uint32_t)by_bytes : fit;
        fit = fit > cnt ? cnt : fit;
    } else if (seg->len > room) {
        fit = 0;
    }
    if (fit == 0 && s->nsegs > 0) {
        sp->carry = *seg, sp->carry_src = *src, sp->has_carry = 1;
        return 0;     /* the next slot starts with it */
    }
    if (fit == 0)
        fit = cnt;  /* alone in its slot: a plain segment over a frame */
    if (fit < cnt) {
        sp->carry = *seg;
        sp->carry.count = cnt - fit;
        sp->carry.offset += (uint64_t)fit * seg->dst_stride;
        sp->carry_src = *src + (size_t)fit * seg->src_stride;
        sp->has_carry = 1;
        seg->count = fit;
    }
    *fit_p = fit;
    *cnt_p = cnt;
    return 1;
}

/* A device segment's pieces go through the slot's bounce buffer: queue
 * their copies (sp->dst/src from *ncp_p on) and point the segment at the
 * buffer.  @return where the connection sends from, or NULL: no memory. */
static const uint8_t *bounce_pieces(stage_put_t *sp, slot_t *s, kvf_wire_seg_t *seg,
                                    uint32_t fit, const uint8_t *src, uint32_t *ncp_p)
{
    kvf_engine_t *eng = sp->eng;
    KVF_ASSERT_LOCKED(eng);
    uint32_t ncp = *ncp_p;
    uint64_t need = s->bytes + (uint64_t)fit * seg->len;
    if (need > s->cap) {
        /* The first use, or an oversized segment alone in its slot. */
        if (s->buf != NULL)
            kvf__bounce_put(eng, s->buf, s->cap);
        s->buf = kvf__bounce_get(eng, need, &s->cap);
        if (s->buf == NULL) {
            sp->stop = KVF_ERR_NO_MEMORY;
            return NULL;
        }
    }
    for (uint32_t k = 0; k < fit; k++) {
        sp->dst[ncp] = (struct iovec){s->buf + s->bytes + (size_t)k * seg->len,
                                      seg->len};
        sp->src[ncp++] = (struct iovec){(void *)(src + (size_t)k * seg->src_stride),
                                        seg->len};
    }
    const uint8_t *from = s->buf + s->bytes;
    seg->src_stride = seg->len;    /* contiguous in the bounce buffer */
    s->bytes += (uint64_t)fit * seg->len;
    *ncp_p = ncp;
    return from;
}

/* A filled slot is ready at once (host memory only), or once its copies
 * end.  @return 1, or 0: the copy could not start and the put failed. */
static int start_slot(stage_put_t *sp, slot_t *s, uint32_t ncp)
{
    kvf_engine_t *eng = sp->eng;
    char err[256];

    if (ncp == 0) {
        s->state = SLOT_READY;     /* host memory only */
    } else if (eng->copier_ops->copy(eng->copier, &s->cp, sp->dst, sp->src, ncp, err,
                                     sizeof(err)) == KVF_OK) {
        s->state = SLOT_COPYING;
        sp->copying++;
        eng->copies_inflight++;
        sp->inner->busy(sp->inner, 1);   /* the copy reads the room's pages */
    } else {
        sp->stop = KVF_ERR_IO;
        sp->cbs->fail(sp->inner, KVF_ERR_IO, err);
        return 0;
    }
    sp->tail = (sp->tail + 1) % SLOTS;
    return 1;
}

/*
 * Fill slots[tail] with whole segments, up to one frame of payload (a
 * strided segment is cut between pieces where it would not fit, so that
 * the connection never cuts one itself and carries a rest across frames),
 * and start the copy of its device pieces.  @return 1 a slot was filled,
 * 0 nothing more to fill now.
 */
static int fill_one(stage_put_t *sp)
{
    slot_t *s = &sp->slots[sp->tail];
    uint64_t payload = 0;
    uint32_t ncp = 0;

    if (s->state != SLOT_FREE || sp->inner_end || sp->stop != KVF_OK)
        return 0;
    s->nsegs = s->yielded = s->pieces = 0;
    s->bytes = 0;
    while (s->nsegs < SLOT_SEGS && s->pieces < SLOT_PIECES && payload < SLOT_BYTES) {
        kvf_wire_seg_t seg;
        const uint8_t *src;
        uint32_t fit, cnt;
        if (!take_segment(sp, s, payload, &seg, &src, &fit, &cnt))
            break;
        const uint8_t *from = src;    /* what the connection sends from */
        if (kvf__seg_on_device(sp->eng, seg.kind) &&
            (from = bounce_pieces(sp, s, &seg, fit, src, &ncp)) == NULL)
            break;
        s->segs[s->nsegs] = seg;
        s->srcs[s->nsegs++] = from;
        payload += (uint64_t)fit * seg.len;
        s->pieces += fit;
        if (fit < cnt)
            break;
    }
    if (s->nsegs == 0 || sp->stop != KVF_OK)
        return 0;      /* a stop drops what this slot collected: never sent */
    return start_slot(sp, s, ncp);
}

static void fill(stage_put_t *sp)
{
    while (fill_one(sp))
        ;
}

static int stage_next(kvf_put_t *put, kvf_wire_seg_t *seg, const void **src)
{
    stage_put_t *sp = (stage_put_t *)put;

    if (!sp->ready && !setup(sp))
        return KVF_ERR_NO_MEMORY;
    if (sp->stop == KVF_OK && sp->inner->live != NULL && !sp->inner->live(sp->inner)) {
        kvf_wire_seg_t s;
        const void *p;
        int rc = sp->inner->next(sp->inner, &s, &p);
        sp->stop = rc < 0 ? (kvf_status_t)rc : KVF_ERR_ABORTED;
    }
    if (sp->stop == KVF_OK)
        fill(sp);
    if (sp->stop != KVF_OK)
        /* Nothing more goes out; the put ends once no copy reads the pages. */
        return sp->copying > 0 ? KVF_PUT_WAIT : (int)sp->stop;
    slot_t *s = &sp->slots[sp->head];
    if (s->state == SLOT_READY && s->yielded < s->nsegs) {
        uint32_t i = s->yielded++;
        *seg = s->segs[i];
        *src = s->srcs[i];
        for (uint32_t k = 0; k < kvf_wire_seg_pieces(seg); k++)
            sp->cbs->hash(sp->inner, s->srcs[i] + (size_t)k * seg->src_stride, seg->len);
        return 1;
    }
    if (s->state == SLOT_FREE && sp->inner_end)
        return 0;      /* every slot was sent and released */
    return KVF_PUT_WAIT;    /* the slot ended (end the frame), or is copying */
}

/* The connection wrote a frame: the slots it held are free again. */
static void stage_sent(kvf_put_t *put)
{
    stage_put_t *sp = (stage_put_t *)put;
    for (int k = 0; k < SLOTS; k++) {
        slot_t *s = &sp->slots[sp->head];
        if (s->state != SLOT_READY || s->yielded < s->nsegs || s->nsegs == 0)
            break;
        s->state = SLOT_FREE;
        s->nsegs = 0;
        sp->head = (sp->head + 1) % SLOTS;
    }
    if (sp->stop == KVF_OK && sp->ready)
        fill(sp);     /* the next copy starts while this frame's successor goes out */
}

static void stage_complete(kvf_put_t *put, kvf_status_t st)
{
    stage_put_t *sp = (stage_put_t *)put;
    sp->completed = 1;
    sp->complete_st = st;
    if (sp->copying == 0)
        stage_free(sp);
}

static void stage_busy(kvf_put_t *put, int busy)
{
    stage_put_t *sp = (stage_put_t *)put;
    if (sp->inner->busy != NULL)
        sp->inner->busy(sp->inner, busy);
}

static int stage_live(kvf_put_t *put)
{
    stage_put_t *sp = (stage_put_t *)put;
    return sp->inner->live == NULL || sp->inner->live(sp->inner);
}

kvf_put_t *kvf__stage_put(kvf_engine_t *eng, kvf_put_t *inner, const kvf_stage_cbs_t *cbs)
{
    KVF_ASSERT_LOCKED(eng);
    stage_put_t *sp = calloc(1, sizeof(*sp));
    if (sp == NULL)
        return NULL;
    sp->put = *inner;
    sp->put.next = stage_next;
    sp->put.complete = stage_complete;
    sp->put.busy = stage_busy;
    sp->put.live = stage_live;
    sp->put.sent = stage_sent;
    sp->put.qnext = NULL;
    sp->inner = inner;
    sp->eng = eng;
    sp->cbs = cbs;
    return &sp->put;
}
