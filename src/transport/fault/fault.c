/*
 * The fault transport: wraps a real connection and injects the failures
 * that the failure model must survive, so that tests reach them on demand
 * (libfabric's prov/hook idea).
 *
 * Spec (KVF_FAULTS or the engine parameter `faults`): comma-separated
 * faults, each KIND[@BYTES][:MS][/ROOM].  BYTES counts payload bytes per
 * room: the fault fires once, inside the first room whose own payload
 * reaches BYTES (default 0: at the first payload), so that which room it
 * hits does not depend on how concurrent rooms interleave.  MS is a
 * duration (default 1000).  ROOM (a bootstrap_room id) keeps a payload
 * fault for that room alone: a test that arms many faults at start-up
 * places each in the room, and so at the moment, it chose.
 *
 *   reset      close the connection with an RST
 *   truncate   close it with a FIN in the middle of a DATA frame
 *   corrupt    one payload byte of one room is wrong when it lands: the
 *              byte is flipped in the sender's registered memory for as
 *              long as the receiver can read it (pushed: until the put is
 *              in the stream; pulled: until the receiver next speaks of
 *              the room, or the connection closes), then put back
 *   badaddr    pulled payload only: one segment names a source address
 *              outside every region this engine registered (a buggy or
 *              lying sender); the receiver must refuse that room alone
 *   stall      send nothing for MS
 *   delay      hold every put for MS before its first byte
 *   drop-ack   drop every DONE_ACK this engine would send (BYTES ignored)
 *   lose-ack   the first DONE_ACK this engine sends (of room ROOM, with
 *              /ROOM) is lost with its connection: not sent, and the
 *              connection resets (BYTES ignored)
 *
 * and, at a decode engine's mover endpoints (the fault mover, end of this
 * file; BYTES counts the bytes of reads started on this engine):
 *
 *   readfail   the read that passes BYTES is handed back failed
 *   readstall  that read is handed back MS late; later reads wait behind it
 *
 * Payload is counted as segments are produced (put->next), which is when
 * the bytes are committed to the stream; a fault fires in the segment
 * that crosses its BYTES.  The sender's checksum is taken as the segment
 * is produced, before the fault alters it, so a receiver with checksums
 * on catches a corrupt byte whichever transport carried it.
 *
 * The fault layer sits between the real connection and the engine: it
 * makes the inner connection with its own handler, so that it sees what
 * the peer says (to put a corrupted byte back) before the engine does.
 * It is put there where connections and endpoints open (transport/open.c),
 * never by core.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "transport/fault/fault.h"
#include "util/log.h"
#include "util/time.h"

typedef enum {
    F_RESET, F_TRUNCATE, F_CORRUPT, F_BADADDR, F_STALL, F_DELAY, F_DROP_ACK,
    F_LOSE_ACK, F_READFAIL, F_READSTALL, F_KINDS
} fault_kind_t;

static const char *const kind_names[F_KINDS] = {
    "reset", "truncate", "corrupt", "badaddr", "stall", "delay", "drop-ack",
    "lose-ack", "readfail", "readstall"
};

typedef struct fault_conn fault_conn_t;

typedef struct fault {
    fault_kind_t  kind;
    uint64_t      bytes;
    uint64_t      ms;
    int           fired;
    int           one_room; /* fires only inside room only_room (/ROOM) */
    uint64_t      only_room;
    /* corrupt: the flipped byte, until it is put back */
    uint8_t      *at;
    uint8_t       orig;
    uint64_t      room;
    fault_conn_t *fc;       /* the connection whose reader may still read it */
} fault_t;

#define MAX_FAULTS 16
#define ROOM_SLOTS 256      /* rooms whose payload is counted at once */

typedef struct room_count {
    uint64_t room;
    uint64_t bytes;
} room_count_t;

struct kvf_faults {
    fault_t      f[MAX_FAULTS];
    int          n;
    uint64_t     sent;       /* payload bytes produced, all connections */
    uint64_t     pulled;     /* bytes of reads started, all mover endpoints */
    /* Per-room counts, by room id modulo ROOM_SLOTS: a room that takes the
     * slot of another starts from zero (only with hundreds in flight). */
    room_count_t rooms[ROOM_SLOTS];
};

static uint64_t *room_bytes(kvf_faults_t *fs, uint64_t room)
{
    room_count_t *rc = &fs->rooms[room % ROOM_SLOTS];
    if (rc->room != room)
        *rc = (room_count_t){room, 0};
    return &rc->bytes;
}

struct fault_conn {
    kvf_conn_t                base;
    kvf_conn_t               *inner;
    kvf_faults_t             *faults;
    const kvf_conn_handler_t *h;         /* the engine's handler, and its arg */
    void                     *arg;
    int                       reset_pending;
    int                       cut;       /* a reset or truncate is on its way */
};

/* A put seen through the fault layer: counts and may corrupt its bytes. */
typedef struct fault_put {
    kvf_put_t     put;
    kvf_put_t    *inner;
    fault_conn_t *fc;
    fault_t      *corrupted;   /* pushed: put back when the put completes */
} fault_put_t;

kvf_status_t kvf_fault_parse(const char *spec, kvf_faults_t **faults_p, char *err,
                             size_t errlen)
{
    kvf_faults_t *fs = calloc(1, sizeof(*fs));
    char *copy = strdup(spec);
    char *save = NULL;

    if (fs == NULL || copy == NULL) {
        snprintf(err, errlen, "out of memory for the fault table (%zu bytes) or a copy of "
                 "the %zu-byte spec", sizeof(*fs), strlen(spec) + 1);
        free(fs);
        free(copy);
        return KVF_ERR_NO_MEMORY;
    }
    for (char *tok = strtok_r(copy, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        fault_t f = {.ms = 1000};
        char *at = strchr(tok, '@'), *colon = strchr(tok, ':'), *slash = strchr(tok, '/');
        char *end;
        size_t klen = strcspn(tok, "@:/");
        int k;
        for (k = 0; k < F_KINDS; k++)
            if (strlen(kind_names[k]) == klen && strncmp(tok, kind_names[k], klen) == 0)
                break;
        if (k == F_KINDS) {
            snprintf(err, errlen, "unknown fault '%.*s' (known: reset, truncate, corrupt, "
                     "badaddr, stall, delay, drop-ack, lose-ack, readfail, readstall)", (int)klen, tok);
            goto bad;
        }
        f.kind = (fault_kind_t)k;
        if (at != NULL) {
            f.bytes = strtoull(at + 1, &end, 10);
            if (end == at + 1 || (*end != '\0' && *end != ':' && *end != '/')) {
                snprintf(err, errlen, "'%s': expected KIND@BYTES with BYTES a number", tok);
                goto bad;
            }
        }
        if (colon != NULL) {
            f.ms = strtoull(colon + 1, &end, 10);
            if (end == colon + 1 || (*end != '\0' && *end != '/')) {
                snprintf(err, errlen, "'%s': expected KIND:MS with MS a number", tok);
                goto bad;
            }
        }
        if (slash != NULL) {
            f.only_room = strtoull(slash + 1, &end, 10);
            f.one_room = 1;
            if (end == slash + 1 || *end != '\0') {
                snprintf(err, errlen, "'%s': expected KIND/ROOM with ROOM a room id", tok);
                goto bad;
            }
            if (f.kind == F_DELAY || f.kind == F_DROP_ACK || f.kind == F_READFAIL ||
                f.kind == F_READSTALL) {
                snprintf(err, errlen, "'%s': %s does not count a room's payload, so it "
                         "cannot be kept to one room (/ROOM)", tok, kind_names[k]);
                goto bad;
            }
        }
        if (fs->n == MAX_FAULTS) {
            snprintf(err, errlen, "at most %d faults", MAX_FAULTS);
            goto bad;
        }
        fs->f[fs->n++] = f;
    }
    if (fs->n == 0) {
        snprintf(err, errlen, "empty fault spec");
        goto bad;
    }
    free(copy);
    *faults_p = fs;
    return KVF_OK;
bad:
    free(copy);
    free(fs);
    return KVF_ERR_INVALID_PARAM;
}

void kvf_fault_free(kvf_faults_t *fs)
{
    free(fs);
}

static int has(kvf_faults_t *fs, fault_kind_t kind)
{
    for (int i = 0; i < fs->n; i++)
        if (fs->f[i].kind == kind)
            return 1;
    return 0;
}

/* The first fault of a kind not fired yet that may fire in `room`. */
static fault_t *armed(kvf_faults_t *fs, fault_kind_t kind, uint64_t room)
{
    for (int i = 0; i < fs->n; i++)
        if (fs->f[i].kind == kind && !fs->f[i].fired &&
            (!fs->f[i].one_room || fs->f[i].only_room == room))
            return &fs->f[i];
    return NULL;
}

/* Put a corrupted byte back: its reader is done with it. */
static void restore(fault_t *f)
{
    if (f->at == NULL)
        return;
    *f->at = f->orig;
    f->at = NULL;
    f->fc = NULL;
}

/* Put back every byte whose reader is this connection (it is closing). */
static void restore_conn(fault_conn_t *fc)
{
    for (int i = 0; i < fc->faults->n; i++)
        if (fc->faults->f[i].fc == fc)
            restore(&fc->faults->f[i]);
}

/* Flip one byte of the segment that crosses f->bytes, in place. */
static void corrupt(fault_put_t *fp, fault_t *f, uint64_t before, kvf_wire_seg_t *seg,
                    const void **src)
{
    uint64_t at = f->bytes > before ? f->bytes - before : 0;
    /* Payload offset `at` of a strided segment is byte at % len of piece
     * at / len, which lies src_stride apart in the source (dst_stride in
     * the destination). */
    uint64_t piece = at / seg->len, in = at % seg->len;
    uint64_t src_off = piece * seg->src_stride + in;
    at = piece * seg->dst_stride + in;
    /* Registered memory is the application's, writable by contract: the
     * byte goes back before anything but this segment's reader sees it. */
    f->at = (uint8_t *)(uintptr_t)*src + src_off;
    f->orig = *f->at;
    *f->at ^= 0x5a;
    f->room = fp->put.room;
    f->fc = fp->fc;
    f->fired = 1;
    if (!fp->put.by_ref)
        fp->corrupted = f;
    kvf_warn("injected fault: corrupted payload byte %llu (room %llu, buffer %u, "
             "offset %llu)", (unsigned long long)f->bytes,
             (unsigned long long)fp->put.room, seg->buf,
             (unsigned long long)(seg->offset + at));
}

/* Name a source no region contains: the faults record itself. */
static void badaddr(fault_put_t *fp, fault_t *f, kvf_wire_seg_t *seg, const void **src)
{
    *src = f;
    f->fired = 1;
    kvf_warn("injected fault: room %llu names a source outside every registered region "
             "(%llu bytes for buffer %u, offset %llu)", (unsigned long long)fp->put.room,
             (unsigned long long)kvf_wire_seg_bytes(seg), seg->buf,
             (unsigned long long)seg->offset);
}

/*
 * Count the payload and fire the byte-triggered faults in the segment that
 * crosses their threshold, so they hit the stream right there: the frame
 * being built is the one that stalls, is cut, or never leaves.
 */
static int fput_next(kvf_put_t *put, kvf_wire_seg_t *seg, const void **src)
{
    fault_put_t *fp = (fault_put_t *)put;
    fault_conn_t *fc = fp->fc;
    kvf_faults_t *fs = fc->faults;
    char why[160];

    int rc = fp->inner->next(fp->inner, seg, src);
    if (rc != 1)
        return rc;
    uint64_t *count = room_bytes(fs, put->room);
    uint64_t before = *count;
    /* One reset or truncate per connection: each one is a break of its own. */
    int cut = fc->cut;
    fs->sent += kvf_wire_seg_bytes(seg);
    *count += kvf_wire_seg_bytes(seg);
    for (int i = 0; i < fs->n; i++) {
        fault_t *f = &fs->f[i];
        if (f->fired || *count <= f->bytes || (f->one_room && f->only_room != put->room) ||
            (cut && (f->kind == F_RESET || f->kind == F_TRUNCATE)))
            continue;
        switch (f->kind) {
        case F_CORRUPT:
            corrupt(fp, f, before, seg, src);
            break;
        case F_BADADDR:
            if (put->by_ref)     /* pushed bytes name no source */
                badaddr(fp, f, seg, src);
            break;
        case F_STALL:
            f->fired = 1;
            kvf_warn("injected fault: stalling sends for %llu ms after %llu payload bytes "
                     "of room %llu", (unsigned long long)f->ms, (unsigned long long)before,
                     (unsigned long long)put->room);
            fc->inner->ops->pause(fc->inner, kvf_now_ms() + f->ms);
            break;
        case F_RESET:
            f->fired = cut = fc->cut = 1;
            fc->reset_pending = 1;
            fc->inner->ops->pause(fc->inner, UINT64_MAX);
            break;
        case F_TRUNCATE:
            f->fired = cut = fc->cut = 1;
            snprintf(why, sizeof(why), "injected fault (KVF_FAULTS): connection closed in "
                     "the middle of a frame after %llu payload bytes of room %llu",
                     (unsigned long long)before, (unsigned long long)put->room);
            kvf_warn("%s", why);
            fc->inner->ops->truncate(fc->inner, why);
            break;
        default:
            break;
        }
    }
    return 1;
}

static void fput_complete(kvf_put_t *put, kvf_status_t st)
{
    fault_put_t *fp = (fault_put_t *)put;
    if (fp->corrupted != NULL && fp->corrupted->fc == fp->fc)
        restore(fp->corrupted);   /* every byte of the put is in the stream */
    fp->inner->complete(fp->inner, st);
    free(fp);
}

/* The inner put's pages are what the stream reads: pin them, and ask
 * whether they are still the put's, through it. */
static void fput_busy(kvf_put_t *put, int busy)
{
    kvf_put_t *inner = ((fault_put_t *)put)->inner;
    if (inner->busy != NULL)
        inner->busy(inner, busy);
}

static int fput_live(kvf_put_t *put)
{
    kvf_put_t *inner = ((fault_put_t *)put)->inner;
    return inner->live == NULL || inner->live(inner);
}

static void fault_put(kvf_conn_t *c, kvf_put_t *inner)
{
    fault_conn_t *fc = (fault_conn_t *)c;
    fault_put_t *fp = calloc(1, sizeof(*fp));
    if (fp == NULL) {
        inner->complete(inner, KVF_ERR_NO_MEMORY);
        return;
    }
    fp->put.next = fput_next;
    fp->put.complete = fput_complete;
    fp->put.busy = fput_busy;
    fp->put.live = fput_live;
    fp->put.room = inner->room;
    fp->put.instance = inner->instance;
    fp->put.src_rank = inner->src_rank;
    fp->put.by_ref = inner->by_ref;
    fp->inner = inner;
    fp->fc = fc;
    for (int i = 0; i < fc->faults->n; i++) {
        fault_t *f = &fc->faults->f[i];
        if (f->kind == F_DELAY && fc->faults->sent >= f->bytes)
            fc->inner->ops->pause(fc->inner, kvf_now_ms() + f->ms);
    }
    fc->inner->ops->put(fc->inner, &fp->put);
}

/* A reset armed in fput_next: the stream is paused right there; cut it. */
static void fire(fault_conn_t *fc)
{
    char why[160];

    if (!fc->reset_pending)
        return;
    fc->reset_pending = 0;
    snprintf(why, sizeof(why), "injected fault (KVF_FAULTS): connection reset after "
             "%llu payload bytes on this engine", (unsigned long long)fc->faults->sent);
    kvf_warn("%s", why);
    fc->inner->ops->abort(fc->inner, 1, why);
}

static void fault_flush(kvf_conn_t *c)
{
    fault_conn_t *fc = (fault_conn_t *)c;
    fc->inner->ops->flush(fc->inner);
    fire(fc);
}

static void fault_handle(kvf_conn_t *c, uint32_t events)
{
    fault_conn_t *fc = (fault_conn_t *)c;
    fc->inner->ops->handle(fc->inner, events);
    fire(fc);
}

static kvf_status_t fault_send_msg(kvf_conn_t *c, const kvf_msg_t *msg)
{
    fault_conn_t *fc = (fault_conn_t *)c;
    if (msg->type == KVF_MSG_DONE_ACK && has(fc->faults, F_DROP_ACK)) {
        kvf_warn("injected fault: dropping DONE_ACK for room %llu",
                 (unsigned long long)msg->u.done_ack.room);
        return KVF_OK;
    }
    fault_t *f = msg->type == KVF_MSG_DONE_ACK && !fc->cut
               ? armed(fc->faults, F_LOSE_ACK, msg->u.done_ack.room) : NULL;
    if (f != NULL) {
        f->fired = fc->cut = fc->reset_pending = 1;
        kvf_warn("injected fault: the DONE_ACK for room %llu is lost with its connection",
                 (unsigned long long)msg->u.done_ack.room);
        fc->inner->ops->pause(fc->inner, UINT64_MAX);
        return KVF_OK;
    }
    return fc->inner->ops->send_msg(fc->inner, msg);
}

static void fault_tick(kvf_conn_t *c, uint64_t now)
{
    fault_conn_t *fc = (fault_conn_t *)c;
    if (fc->inner->ops->tick)
        fc->inner->ops->tick(fc->inner, now);
}

static kvf_status_t fault_rebind(kvf_conn_t *c, const kvf_conn_env_t *env)
{
    fault_conn_t *fc = (fault_conn_t *)c;
    return fc->inner->ops->rebind ? fc->inner->ops->rebind(fc->inner, env) : KVF_ERR_IO;
}

static void fault_shutdown(kvf_conn_t *c)
{
    fault_conn_t *fc = (fault_conn_t *)c;
    fc->inner->ops->shutdown(fc->inner);
    restore_conn(fc);
}

static void fault_destroy(kvf_conn_t *c)
{
    fault_conn_t *fc = (fault_conn_t *)c;
    if (fc->inner != NULL)
        fc->inner->ops->destroy(fc->inner);
    restore_conn(fc);
    free(fc);
}

static uint64_t fault_last_rx(const kvf_conn_t *c)
{
    const fault_conn_t *fc = (const fault_conn_t *)c;
    return fc->inner->ops->last_rx(fc->inner);
}

static uint64_t fault_last_tx(const kvf_conn_t *c)
{
    const fault_conn_t *fc = (const fault_conn_t *)c;
    return fc->inner->ops->last_tx(fc->inner);
}

static int fault_idle(const kvf_conn_t *c)
{
    const fault_conn_t *fc = (const fault_conn_t *)c;
    return fc->inner->ops->idle(fc->inner);
}

static int fault_pending(const kvf_conn_t *c)
{
    const fault_conn_t *fc = (const fault_conn_t *)c;
    return fc->inner->ops->pending(fc->inner);
}

static void fault_limit(kvf_conn_t *c, const kvf_rx_limit_t *lim)
{
    fault_conn_t *fc = (fault_conn_t *)c;
    fc->inner->ops->limit(fc->inner, lim);
}

static const kvf_transport_ops_t fault_ops = {
    .name = "fault",
    .handle = fault_handle,
    .send_msg = fault_send_msg,
    .put = fault_put,
    .flush = fault_flush,
    .tick = fault_tick,
    .rebind = fault_rebind,
    .shutdown = fault_shutdown,
    .destroy = fault_destroy,
    .last_rx = fault_last_rx,
    .last_tx = fault_last_tx,
    .idle = fault_idle,
    .pending = fault_pending,
    .limit = fault_limit,
};

/* ------------------------------------------------------------------------ */
/* What the peer says, seen before the engine                               */
/* ------------------------------------------------------------------------ */

/* The room a message from the peer speaks of, or 0 for none. */
static int msg_room(const kvf_msg_t *m, uint64_t *room)
{
    switch (m->type) {
    case KVF_MSG_ROOM_REQ: *room = m->u.room_req.room; return 1;
    case KVF_MSG_DONE_ACK: *room = m->u.done_ack.room; return 1;
    case KVF_MSG_FAIL:
    case KVF_MSG_ABORT:    *room = m->u.fail.room; return 1;
    default:               return 0;
    }
}

static void fh_on_connected(void *arg)
{
    fault_conn_t *fc = arg;
    fc->h->on_connected(fc->arg);
}

/*
 * A pulled corrupt byte goes back once its reader speaks of the room
 * again: it acknowledges, fails or re-requests the room only after it has
 * read (or given up on) every frame sent before.
 */
static void fh_on_msg(void *arg, const kvf_msg_t *msg)
{
    fault_conn_t *fc = arg;
    uint64_t room;
    if (msg_room(msg, &room))
        for (int i = 0; i < fc->faults->n; i++)
            if (fc->faults->f[i].fc == fc && fc->faults->f[i].room == room)
                restore(&fc->faults->f[i]);
    fc->h->on_msg(fc->arg, msg);
}

static void fh_on_data(void *arg, const kvf_msg_data_t *d, kvf_rx_target_t *t)
{
    fault_conn_t *fc = arg;
    fc->h->on_data(fc->arg, d, t);
}

static int fh_rx_valid(void *arg)
{
    fault_conn_t *fc = arg;
    return fc->h->rx_valid(fc->arg);
}

static int fh_rx_ready(void *arg)
{
    fault_conn_t *fc = arg;
    return fc->h->rx_ready == NULL || fc->h->rx_ready(fc->arg);
}

static void fh_on_placed(void *arg, const uint8_t *p, size_t n)
{
    fault_conn_t *fc = arg;
    if (fc->h->on_placed)
        fc->h->on_placed(fc->arg, p, n);
}

static void fh_on_data_end(void *arg, uint64_t placed)
{
    fault_conn_t *fc = arg;
    fc->h->on_data_end(fc->arg, placed);
}

static void fh_on_close(void *arg, kvf_status_t st, const char *reason)
{
    fault_conn_t *fc = arg;
    restore_conn(fc);
    fc->h->on_close(fc->arg, st, reason);
}

static const kvf_conn_handler_t fault_handler = {
    .on_connected = fh_on_connected,
    .on_msg = fh_on_msg,
    .on_data = fh_on_data,
    .rx_valid = fh_rx_valid,
    .rx_ready = fh_rx_ready,
    .on_placed = fh_on_placed,
    .on_data_end = fh_on_data_end,
    .on_close = fh_on_close,
};

static fault_conn_t *fault_conn_new(kvf_faults_t *faults, const kvf_transport_ops_t *inner,
                                    const kvf_conn_handler_t *h, void *arg)
{
    if (inner->abort == NULL || inner->pause == NULL || inner->truncate == NULL) {
        kvf_error("the fault transport cannot wrap %s connections (no abort, pause or "
                  "truncate op)", inner->name);
        return NULL;
    }
    fault_conn_t *fc = calloc(1, sizeof(*fc));
    if (fc == NULL)
        return NULL;
    fc->base.ops = &fault_ops;
    fc->faults = faults;
    fc->h = h;
    fc->arg = arg;
    return fc;
}

kvf_status_t kvf_fault_connect(kvf_faults_t *faults, const kvf_transport_ops_t *inner,
                               const char *host, int port, const kvf_conn_env_t *env,
                               const kvf_conn_handler_t *h, void *arg, kvf_conn_t **conn_p)
{
    fault_conn_t *fc = fault_conn_new(faults, inner, h, arg);
    if (fc == NULL)
        return KVF_ERR_UNSUPPORTED;
    kvf_status_t st = inner->connect(host, port, env, &fault_handler, fc, &fc->inner);
    if (st != KVF_OK) {
        free(fc);
        return st;
    }
    *conn_p = &fc->base;
    return KVF_OK;
}

kvf_status_t kvf_fault_accept(kvf_faults_t *faults, const kvf_transport_ops_t *inner, int fd,
                              const kvf_conn_env_t *env, const kvf_conn_handler_t *h,
                              void *arg, kvf_conn_t **conn_p)
{
    fault_conn_t *fc = fault_conn_new(faults, inner, h, arg);
    if (fc == NULL)
        return KVF_ERR_UNSUPPORTED;
    kvf_status_t st = inner->accept(fd, env, &fault_handler, fc, &fc->inner);
    if (st != KVF_OK) {
        free(fc);
        return st;
    }
    *conn_p = &fc->base;
    return KVF_OK;
}

/* ------------------------------------------------------------------------ */
/* The fault mover: read faults at a decode engine's endpoints              */
/* ------------------------------------------------------------------------ */

typedef struct fault_read fault_read_t;

typedef struct fault_ep {
    kvf_mover_ep_t  base;       /* first: ops = &ops */
    /* fault_ep_ops with the inner mover's caps (and ep_failed only where
     * those say it has one): core asks the endpoint it holds what it can
     * do, and the answer must be the real mover's. */
    kvf_mover_ops_t ops;
    kvf_mover_ep_t *inner;
    kvf_faults_t   *faults;
    /* Reads started, in order, until handed back: the inner mover hands
     * them back in order, and a stalled one holds the ones after it. */
    fault_read_t   *head, **tail;
    int             closed;     /* disconnected: freed once head is NULL */
} fault_ep_t;

struct fault_read {
    kvf_mover_read_t  base;     /* what the inner mover hands back */
    kvf_mover_read_t *outer;    /* the engine's */
    fault_ep_t       *fe;
    int               fail;
    uint64_t          until_ms; /* stalled: not handed back before */
    int               back;     /* the inner mover handed it back */
    kvf_status_t      st;
    char              err[160];
    fault_read_t     *next;
};

static void fep_free(fault_ep_t *fe)
{
    free(fe);
}

/* Hand back, in order, what the inner mover returned and no stall holds. */
static void fep_release(fault_ep_t *fe)
{
    uint64_t now = kvf_now_ms();
    while (fe->head != NULL && fe->head->back && (fe->closed || now >= fe->head->until_ms)) {
        fault_read_t *fr = fe->head;
        if ((fe->head = fr->next) == NULL)
            fe->tail = &fe->head;
        fr->outer->done(fr->outer, fr->st, fr->err);
        free(fr);
    }
    if (fe->closed && fe->head == NULL)
        fep_free(fe);
}

static void fep_done(kvf_mover_read_t *base, kvf_status_t st, const char *err)
{
    fault_read_t *fr = (fault_read_t *)base;
    fr->back = 1;
    fr->st = st;
    snprintf(fr->err, sizeof(fr->err), "%s", err ? err : "");
    if (st == KVF_OK && fr->fail) {
        fr->st = KVF_ERR_IO;
        snprintf(fr->err, sizeof(fr->err), "injected fault (KVF_FAULTS): read failed");
    }
    fep_release(fr->fe);
}

static kvf_status_t fep_read(kvf_mover_ep_t *ep, kvf_mover_read_t *rd, struct iovec *local,
                             struct iovec *remote, size_t n, unsigned timeout_ms, char *err,
                             size_t errlen)
{
    fault_ep_t *fe = (fault_ep_t *)ep;
    kvf_faults_t *fs = fe->faults;
    fault_read_t *fr = calloc(1, sizeof(*fr));
    if (fr == NULL) {
        snprintf(err, errlen, "out of memory");
        return KVF_ERR_NO_MEMORY;
    }
    uint64_t bytes = 0;
    for (size_t i = 0; i < n; i++)
        bytes += local[i].iov_len;
    for (int i = 0; i < fs->n; i++) {
        fault_t *f = &fs->f[i];
        if (f->fired || (f->kind != F_READFAIL && f->kind != F_READSTALL) ||
            fs->pulled + bytes <= f->bytes)
            continue;
        f->fired = 1;
        if (f->kind == F_READFAIL) {
            fr->fail = 1;
            kvf_warn("injected fault (KVF_FAULTS): the read of %llu bytes past byte %llu "
                     "will fail", (unsigned long long)bytes, (unsigned long long)f->bytes);
        } else {
            fr->until_ms = kvf_now_ms() + f->ms;
            kvf_warn("injected fault (KVF_FAULTS): the read of %llu bytes past byte %llu "
                     "is held for %llu ms", (unsigned long long)bytes,
                     (unsigned long long)f->bytes, (unsigned long long)f->ms);
        }
    }
    fr->base.done = fep_done;
    fr->outer = rd;
    fr->fe = fe;
    kvf_status_t st = fe->inner->ops->read(fe->inner, &fr->base, local, remote, n,
                                           timeout_ms, err, errlen);
    if (st != KVF_OK) {
        free(fr);
        return st;
    }
    fs->pulled += bytes;
    fr->next = NULL;
    *fe->tail = fr;
    fe->tail = &fr->next;
    return KVF_OK;
}

static void fep_tick(kvf_mover_ep_t *ep)
{
    fault_ep_t *fe = (fault_ep_t *)ep;
    if (fe->inner->ops->tick != NULL)
        fe->inner->ops->tick(fe->inner);
    fep_release(fe);
}

/* The inner endpoint stops its reads; what they hand back goes straight
 * on (no stall outlives the endpoint), then the wrapper goes. */
static void fep_disconnect(kvf_mover_ep_t *ep)
{
    fault_ep_t *fe = (fault_ep_t *)ep;
    if (fe == NULL)
        return;
    fe->inner->ops->disconnect(fe->inner);
    fe->closed = 1;
    fep_release(fe);
}

static int fep_failed(const kvf_mover_ep_t *ep)
{
    const fault_ep_t *fe = (const fault_ep_t *)ep;
    return fe->inner->ops->ep_failed(fe->inner);
}

/* Endpoint ops only: the engine reaches the mover itself through the
 * inner mover's own table.  Each wrapper copies them with its inner's caps. */
static const kvf_mover_ops_t fault_ep_ops = {
    .name = "fault",
    .disconnect = fep_disconnect,
    .tick = fep_tick,
    .read = fep_read,
    .ep_failed = fep_failed,
};

void kvf_fault_wrap_ep(kvf_faults_t *fs, kvf_mover_ep_t **ep_p)
{
    int any = 0;
    for (int i = 0; fs != NULL && i < fs->n; i++)
        any |= fs->f[i].kind == F_READFAIL || fs->f[i].kind == F_READSTALL;
    if (!any || *ep_p == NULL)
        return;
    fault_ep_t *fe = calloc(1, sizeof(*fe));
    if (fe == NULL) {
        kvf_warn("no memory for the fault mover: read faults not injected");
        return;
    }
    fe->ops = fault_ep_ops;
    fe->ops.caps = (*ep_p)->ops->caps;
    if (!(fe->ops.caps & KVF_MOVER_CAP_READ_FAIL_CLOSES_EP))
        fe->ops.ep_failed = NULL;
    fe->base.ops = &fe->ops;
    fe->inner = *ep_p;
    fe->faults = fs;
    fe->tail = &fe->head;
    *ep_p = &fe->base;
}
