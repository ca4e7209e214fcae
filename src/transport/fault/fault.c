/*
 * The fault transport: wraps a real connection and injects the failures
 * that the failure model must survive, so that tests reach them on demand
 * (libfabric's prov/hook idea).
 *
 * Spec (KVF_FAULTS or the engine parameter `faults`): comma-separated
 * faults, each KIND[@BYTES][:MS].  BYTES counts the payload bytes this
 * engine has handed to its connections, all of them together; the fault
 * fires once when the count reaches BYTES (default 0: at the first
 * payload).  MS is a duration (default 1000).
 *
 *   reset      close the connection with an RST
 *   truncate   close it with a FIN in the middle of a DATA frame
 *   corrupt    flip one payload byte on the wire (memory is untouched)
 *   stall      send nothing for MS
 *   delay      hold every put for MS before its first byte
 *   drop-ack   drop every DONE_ACK this engine would send (BYTES ignored)
 *
 * Payload is counted as segments are produced (put->next), which is when
 * the bytes are committed to the stream; a fault fires in the segment
 * that crosses its BYTES.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "transport/tcp/tcp.h"
#include "transport/transport.h"
#include "util/log.h"
#include "util/time.h"

typedef enum {
    F_RESET, F_TRUNCATE, F_CORRUPT, F_STALL, F_DELAY, F_DROP_ACK, F_KINDS
} fault_kind_t;

static const char *const kind_names[F_KINDS] = {
    "reset", "truncate", "corrupt", "stall", "delay", "drop-ack"
};

typedef struct fault {
    fault_kind_t kind;
    uint64_t     bytes;
    uint64_t     ms;
    int          fired;
    uint8_t     *scratch;   /* corrupt: the altered copy, kept for the engine's life
                               because a by-reference peer reads it later */
} fault_t;

#define MAX_FAULTS 16

struct kvf_faults {
    fault_t  f[MAX_FAULTS];
    int      n;
    uint64_t sent;          /* payload bytes produced, all connections */
};

typedef struct fault_conn {
    kvf_conn_t    base;
    kvf_conn_t   *inner;     /* keeps calling the engine's handler itself */
    kvf_faults_t *faults;
    int           reset_pending;
    int           cut;       /* a reset or truncate is on its way */
} fault_conn_t;

/* A put seen through the fault layer: counts and may corrupt its bytes. */
typedef struct fault_put {
    kvf_put_t     put;
    kvf_put_t    *inner;
    fault_conn_t *fc;
} fault_put_t;

kvf_status_t kvf_faults_parse(const char *spec, kvf_faults_t **faults_p, char *err,
                              size_t errlen)
{
    kvf_faults_t *fs = calloc(1, sizeof(*fs));
    char *copy = strdup(spec);
    char *save = NULL;

    if (fs == NULL || copy == NULL) {
        free(fs);
        free(copy);
        return KVF_ERR_NO_MEMORY;
    }
    for (char *tok = strtok_r(copy, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        fault_t f = {.ms = 1000};
        char *at = strchr(tok, '@'), *colon = strchr(tok, ':'), *end;
        size_t klen = strcspn(tok, "@:");
        int k;
        for (k = 0; k < F_KINDS; k++)
            if (strlen(kind_names[k]) == klen && strncmp(tok, kind_names[k], klen) == 0)
                break;
        if (k == F_KINDS) {
            snprintf(err, errlen, "unknown fault '%.*s' (known: reset, truncate, corrupt, "
                     "stall, delay, drop-ack)", (int)klen, tok);
            goto bad;
        }
        f.kind = (fault_kind_t)k;
        if (at != NULL) {
            f.bytes = strtoull(at + 1, &end, 10);
            if (end == at + 1 || (*end != '\0' && *end != ':')) {
                snprintf(err, errlen, "'%s': expected KIND@BYTES with BYTES a number", tok);
                goto bad;
            }
        }
        if (colon != NULL) {
            f.ms = strtoull(colon + 1, &end, 10);
            if (end == colon + 1 || *end != '\0') {
                snprintf(err, errlen, "'%s': expected KIND:MS with MS a number", tok);
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

void kvf_faults_free(kvf_faults_t *fs)
{
    if (fs == NULL)
        return;
    for (int i = 0; i < fs->n; i++)
        free(fs->f[i].scratch);
    free(fs);
}

static int has(kvf_faults_t *fs, fault_kind_t kind)
{
    for (int i = 0; i < fs->n; i++)
        if (fs->f[i].kind == kind)
            return 1;
    return 0;
}

/* Corrupt one byte of the segment that crosses f->bytes, in a copy. */
static void corrupt(fault_put_t *fp, fault_t *f, uint64_t before, kvf_wire_seg_t *seg,
                    const void **src)
{
    uint64_t at = f->bytes > before ? f->bytes - before : 0;
    if ((f->scratch = malloc(seg->len)) == NULL)
        return;
    memcpy(f->scratch, *src, seg->len);
    f->scratch[at] ^= 0x5a;
    *src = f->scratch;
    f->fired = 1;
    kvf_warn("injected fault: corrupted payload byte %llu (room %llu, buffer %u, "
             "offset %llu)", (unsigned long long)f->bytes,
             (unsigned long long)fp->put.room, seg->buf,
             (unsigned long long)(seg->offset + at));
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
    uint64_t before = fs->sent;
    /* One reset or truncate per connection: each one is a break of its own. */
    int cut = fc->cut;
    fs->sent += seg->len;
    for (int i = 0; i < fs->n; i++) {
        fault_t *f = &fs->f[i];
        if (f->fired || fs->sent <= f->bytes ||
            (cut && (f->kind == F_RESET || f->kind == F_TRUNCATE)))
            continue;
        switch (f->kind) {
        case F_CORRUPT:
            corrupt(fp, f, before, seg, src);
            break;
        case F_STALL:
            f->fired = 1;
            kvf_warn("injected fault: stalling sends for %llu ms after %llu payload bytes",
                     (unsigned long long)f->ms, (unsigned long long)before);
            kvf_tcp_conn_pause(fc->inner, kvf_now_ms() + f->ms);
            break;
        case F_RESET:
            f->fired = cut = fc->cut = 1;
            fc->reset_pending = 1;
            kvf_tcp_conn_pause(fc->inner, UINT64_MAX);
            break;
        case F_TRUNCATE:
            f->fired = cut = fc->cut = 1;
            snprintf(why, sizeof(why), "injected fault (KVF_FAULTS): connection closed in "
                     "the middle of a frame after %llu payload bytes",
                     (unsigned long long)before);
            kvf_warn("%s", why);
            kvf_tcp_conn_truncate(fc->inner, why);
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
    fp->inner->complete(fp->inner, st);
    free(fp);
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
    fp->put.room = inner->room;
    fp->put.src_rank = inner->src_rank;
    fp->put.by_ref = inner->by_ref;
    fp->inner = inner;
    fp->fc = fc;
    for (int i = 0; i < fc->faults->n; i++) {
        fault_t *f = &fc->faults->f[i];
        if (f->kind == F_DELAY && fc->faults->sent >= f->bytes)
            kvf_tcp_conn_pause(fc->inner, kvf_now_ms() + f->ms);
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
             "%llu payload bytes", (unsigned long long)fc->faults->sent);
    kvf_warn("%s", why);
    kvf_tcp_conn_abort(fc->inner, 1, why);
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
    return fc->inner->ops->send_msg(fc->inner, msg);
}

static void fault_tick(kvf_conn_t *c, uint64_t now)
{
    fault_conn_t *fc = (fault_conn_t *)c;
    if (fc->inner->ops->tick)
        fc->inner->ops->tick(fc->inner, now);
}

static void fault_shutdown(kvf_conn_t *c)
{
    fault_conn_t *fc = (fault_conn_t *)c;
    fc->inner->ops->shutdown(fc->inner);
}

static void fault_destroy(kvf_conn_t *c)
{
    fault_conn_t *fc = (fault_conn_t *)c;
    fc->inner->ops->destroy(fc->inner);
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

static const kvf_transport_ops_t fault_ops = {
    .name = "fault",
    .handle = fault_handle,
    .send_msg = fault_send_msg,
    .put = fault_put,
    .flush = fault_flush,
    .tick = fault_tick,
    .shutdown = fault_shutdown,
    .destroy = fault_destroy,
    .last_rx = fault_last_rx,
    .last_tx = fault_last_tx,
    .idle = fault_idle,
    .pending = fault_pending,
};

kvf_status_t kvf_fault_wrap(kvf_faults_t *faults, kvf_conn_t *inner, kvf_conn_t **conn_p)
{
    if (inner->ops != &kvf_tcp_ops) {
        kvf_error("the fault transport wraps tcp connections only");
        return KVF_ERR_UNSUPPORTED;
    }
    fault_conn_t *fc = calloc(1, sizeof(*fc));
    if (fc == NULL)
        return KVF_ERR_NO_MEMORY;
    fc->base.ops = &fault_ops;
    fc->inner = inner;
    fc->faults = faults;
    *conn_p = &fc->base;
    return KVF_OK;
}
