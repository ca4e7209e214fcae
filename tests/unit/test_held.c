/*
 * Held rooms (vLLM's flow), between real engines over loopback: a prefill
 * sender that is given all its pages before any decode rank asked, and
 * decode receivers that reach it by its engines' descriptors, without a
 * registry, then read.  Every byte is checked, per head and token, for
 * TP 1 -> 1, 1 -> 2 and 2 -> 1, over tcp and shm; the lease ends rooms
 * nobody read, or read only in part; a reader naming another request's
 * instance is refused and the room goes on; a reader with a cached prefix
 * takes the rest; a restarted prefill is told apart from the one its
 * descriptor names; descriptors and room keys themselves.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "core/descriptor.h"
#include "core/engine.h"
#include "kvferry/kvferry.h"

#define PAGES  16
#define HEADS  4           /* the model's KV heads */
#define HEAD_B 8           /* bytes per head per token */
#define SLOTS  4
#include "unit/kvf_sides.h"

#define MAXR   2

/* The bootstrap deadline and the port of the next engines made (rank_up). */
static unsigned bootstrap_ms = 5000;
static int next_port;

/* Byte k of global head g of token t of source page pg of KV buffer b. */
static uint8_t pat(int b, uint32_t pg, uint32_t t, uint32_t g, uint32_t k)
{
    return (uint8_t)(b * 131 + pg * 17 + t * 5 + g * 29 + k * 3 + 1);
}

/* What a prefill rank's KV holds at offset j of buffer b: pat() of the
 * global head there. */
static uint8_t held_byte(const side_t *s, int b, size_t j)
{
    uint32_t hpr = HEADS / (uint32_t)s->tp_size;
    size_t at = j % s->page_b;
    return pat(b, (uint32_t)(j / s->page_b), (uint32_t)(at / (hpr * HEAD_B)),
               (uint32_t)s->tp_rank * hpr + (uint32_t)(at / HEAD_B % hpr),
               (uint32_t)(at % HEAD_B));
}

/* s's descriptor, written into buf (KVF_DESCRIPTOR_MAX bytes). */
static const char *desc_of(const side_t *s, char *buf)
{
    CHECK_EQ_INT(kvf_engine_descriptor(s->eng, buf, KVF_DESCRIPTOR_MAX), KVF_OK);
    return buf;
}

static void tune(kvf_engine_params_t *p)
{
    p->checksum = 1;
    p->port = next_port;
}

/* A rank with its KV in kvf_mem_alloc() memory, no registry, the library's
 * transfer deadline; a prefill rank's pages hold pat(), its aux slot s the
 * byte 0x40 + s.  Every rank writes its descriptor. */
static void rank_up(side_t *r, kvf_role_t role, int tp_rank, int tp_size, const char *transport,
                    int port)
{
    char desc[KVF_DESCRIPTOR_MAX];
    side_transport = transport;
    side_mem_alloc = 1;
    side_bootstrap_ms = bootstrap_ms;
    side_transfer_ms = 0;
    side_rank = (side_rank_t){.tp = tp_rank, .tp_size = tp_size};
    side_fill = held_byte;
    side_tune = tune;
    next_port = port;
    side_init(r, role, NULL, NULL);
    side_rank = (side_rank_t){0};
    for (int s = 0; role == KVF_ROLE_PREFILL && s < SLOTS; s++)
        memset(r->aux + s * AUX_B, 0x40 + s, AUX_B);
    desc_of(r, desc);
}

/* Hold room `key` on every prefill rank: pages src[0..n) and aux slot 1,
 * given at once, before any reader. */
static void hold_all(side_t *pre, int np, kvf_room_key_t key, unsigned lease_ms,
                     const uint32_t *src, size_t n, kvf_sender_t **s)
{
    kvf_hold_t h;
    kvf_hold_init(&h);
    h.lease_ms = lease_ms;
    h.instance = key.instance;
    for (int i = 0; i < np; i++) {
        CHECK_EQ_INT(kvf_sender_create_held(pre[i].eng, key.room, &h, &s[i]), KVF_OK);
        CHECK_EQ_INT(kvf_sender_init(s[i], (uint32_t)n, 1), KVF_OK);
        CHECK_EQ_INT(kvf_sender_send(s[i], src, n, 1), KVF_OK);
        CHECK_EQ_INT(kvf_sender_poll(s[i]), KVF_POLL_BOOTSTRAPPING);
    }
}

/* A reader on decode rank `dec` of a room, by the descriptors of the
 * prefill ranks that hold it. */
static kvf_receiver_t *reader_of(side_t *dec, const char *const *descs, int n, uint64_t room,
                                 uint64_t instance)
{
    kvf_receiver_t *r = NULL;
    kvf_remote_t rm;
    kvf_remote_init(&rm);
    rm.room = room;
    rm.instance = instance;
    rm.descriptors = descs;
    rm.num_descriptors = (size_t)n;
    CHECK_EQ_INT(kvf_receiver_create_remote(dec->eng, &rm, &r), KVF_OK);
    return r;
}

/* A reader on decode rank `dec` of the room the np prefill ranks hold. */
static kvf_receiver_t *reader(side_t *dec, side_t *pre, int np, uint64_t room,
                              uint64_t instance)
{
    char text[MAXR][KVF_DESCRIPTOR_MAX];
    const char *descs[MAXR];
    for (int i = 0; i < np; i++)
        descs[i] = desc_of(&pre[i], text[i]);
    return reader_of(dec, descs, np, room, instance);
}

static void give_dest(kvf_receiver_t *r, const uint32_t *dst, size_t n, uint32_t prefix)
{
    kvf_dest_t d;
    kvf_dest_init(&d);
    d.pages = dst;
    d.num_pages = n;
    d.aux_slot = 2;
    d.decode_prefix_len = prefix;
    CHECK_EQ_INT(wait_receiver(r, KVF_POLL_WAITING_FOR_INPUT), KVF_POLL_WAITING_FOR_INPUT);
    CHECK_EQ_INT(kvf_receiver_set_dest(r, &d), KVF_OK);
}

/* Decode rank `dec` holds, in dst[j], the heads of its TP rank of source
 * page src[skip + j], every token and byte; and aux slot 1's bytes in
 * its slot 2. */
static int placed_ok(const side_t *dec, const uint32_t *src, size_t skip, const uint32_t *dst,
                     size_t n)
{
    uint32_t hpr = HEADS / (uint32_t)dec->tp_size;
    size_t pb = dec->page_b;
    for (int b = 0; b < NKV; b++)
        for (size_t j = 0; j < n; j++)
            for (uint32_t t = 0; t < PAGE; t++)
                for (uint32_t h = 0; h < hpr; h++)
                    for (uint32_t k = 0; k < HEAD_B; k++) {
                        uint8_t got = dec->kv[b][dst[j] * pb + (t * hpr + h) * HEAD_B + k];
                        uint32_t g = (uint32_t)dec->tp_rank * hpr + h;
                        if (got != pat(b, src[skip + j], t, g, k)) {
                            fprintf(stderr, "  buffer %d dest page %u token %u head %u byte "
                                    "%u: %u, want %u\n", b, dst[j], t, g, k, got,
                                    pat(b, src[skip + j], t, g, k));
                            return 0;
                        }
                    }
    for (int i = 0; i < AUX_B; i++)
        if (dec->aux[2 * AUX_B + i] != 0x41)
            return 0;
    return 1;
}

/* Every sender and receiver reaches SUCCESS, each decode rank holds the
 * source pages from `skip` on in dst[0..n); then all of it is torn down. */
static void all_read(side_t *pre, kvf_sender_t **s, int np, side_t *dec, kvf_receiver_t **r,
                     int nd, const uint32_t *src, size_t skip, const uint32_t *dst, size_t n)
{
    for (int i = 0; i < np; i++)
        CHECK_EQ_INT(wait_sender(s[i], KVF_POLL_SUCCESS), KVF_POLL_SUCCESS);
    for (int i = 0; i < nd; i++) {
        CHECK_EQ_INT(wait_receiver(r[i], KVF_POLL_SUCCESS), KVF_POLL_SUCCESS);
        CHECK(placed_ok(&dec[i], src, skip, dst, n));
    }
    for (int i = 0; i < np; i++)
        kvf_sender_destroy(s[i]);
    for (int i = 0; i < nd; i++)
        kvf_receiver_destroy(r[i]);
    for (int i = 0; i < nd; i++)
        side_fini(&dec[i]);
    for (int i = 0; i < np; i++)
        side_fini(&pre[i]);
}

/* One prefill and one decode rank (TP 1 -> 1, tcp), the prefill holding
 * room `key` with pages src[0..n). */
static void held_pair(side_t *pre, side_t *dec, kvf_room_key_t key, unsigned lease_ms,
                      const uint32_t *src, size_t n, kvf_sender_t **s)
{
    rank_up(pre, KVF_ROLE_PREFILL, 0, 1, "tcp", 0);
    rank_up(dec, KVF_ROLE_DECODE, 0, 1, "tcp", 0);
    hold_all(pre, 1, key, lease_ms, src, n, s);
}

/* The room's own reader (its key) then reads it whole, and all goes. */
static void owner_reads(side_t *pre, kvf_sender_t *s, side_t *dec, kvf_room_key_t key,
                        const uint32_t *src, const uint32_t *dst, size_t n)
{
    kvf_receiver_t *r = reader(dec, pre, 1, key.room, key.instance);
    give_dest(r, dst, n, 0);
    all_read(pre, &s, 1, dec, &r, 1, src, 0, dst, n);
}

/* P prefill ranks hold a room; D decode ranks read it; every byte checked. */
static void held_case(int np, int nd, const char *transport)
{
    side_t pre[MAXR] = {0}, dec[MAXR] = {0};
    kvf_sender_t *s[MAXR];
    kvf_receiver_t *r[MAXR];
    uint32_t src[5] = {3, 4, 5, 11, 0}, dst[5] = {7, 1, 2, 3, 15};
    kvf_room_key_t key = kvf_room_key("cmpl-held-1", 11);

    for (int i = 0; i < np; i++)
        rank_up(&pre[i], KVF_ROLE_PREFILL, i, np, transport, 0);
    for (int i = 0; i < nd; i++)
        rank_up(&dec[i], KVF_ROLE_DECODE, i, nd, transport, 0);
    hold_all(pre, np, key, 10000, src, 5, s);
    for (int i = 0; i < nd; i++)
        r[i] = reader(&dec[i], pre, np, key.room, key.instance);
    for (int i = 0; i < nd; i++)
        give_dest(r[i], dst, 5, 0);
    all_read(pre, s, np, dec, r, nd, src, 0, dst, 5);
}

static void test_held_tcp(void)
{
    held_case(1, 1, "tcp");
    held_case(1, 2, "tcp");
    held_case(2, 1, "tcp");
}

static void test_held_shm(void)
{
    held_case(1, 1, "shm");
    held_case(1, 2, "shm");
    held_case(2, 1, "shm");
}

/*
 * A held room given layer by layer (kvf_sender_send_layers) before any
 * reader asked: the prefill keeps each layer's chunks, and every reader,
 * once all asked, gets them all (TP 1 -> 2: each its heads).
 */
static void test_held_layer_by_layer(void)
{
    side_t pre[1] = {0}, dec[2] = {0};
    kvf_sender_t *s;
    kvf_receiver_t *r[2];
    uint32_t src[5] = {3, 4, 5, 11, 0}, dst[5] = {7, 1, 2, 3, 15};
    kvf_room_key_t key = kvf_room_key("cmpl-held-layers", 16);
    kvf_hold_t h;

    rank_up(&pre[0], KVF_ROLE_PREFILL, 0, 1, "tcp", 0);
    for (int i = 0; i < 2; i++)
        rank_up(&dec[i], KVF_ROLE_DECODE, i, 2, "tcp", 0);
    kvf_hold_init(&h);
    h.lease_ms = 10000;
    h.instance = key.instance;
    CHECK_EQ_INT(kvf_sender_create_held(pre[0].eng, key.room, &h, &s), KVF_OK);
    CHECK_EQ_INT(kvf_sender_init(s, 5, 1), KVF_OK);
    CHECK_EQ_INT(kvf_sender_send_layers(s, src, 3, 0, 0, 0, 1), KVF_OK);
    CHECK_EQ_INT(kvf_sender_send_layers(s, src, 5, 0, 0, 1, 2), KVF_OK);
    for (int i = 0; i < 2; i++) {
        CHECK_EQ_INT(kvf_sender_poll(s), KVF_POLL_BOOTSTRAPPING);   /* a reader missing */
        r[i] = reader(&dec[i], pre, 1, key.room, key.instance);
        give_dest(r[i], dst, 5, 0);
    }
    /* Released with its layers at different pages: each gets its own. */
    CHECK_EQ_INT(wait_receiver(r[1], KVF_POLL_TRANSFERRING), KVF_POLL_TRANSFERRING);
    CHECK_EQ_INT(kvf_sender_send_layers(s, src + 3, 2, 3, 0, 0, 1), KVF_OK);
    CHECK_EQ_INT(kvf_sender_send(s, NULL, 0, 1), KVF_OK);
    all_read(pre, &s, 1, dec, r, 2, src, 0, dst, 5);
}

/* A reader created by descriptors on another thread. */
typedef struct {
    side_t         *dec;
    const char     *desc;
    kvf_room_key_t  key;
    kvf_receiver_t *r;
    kvf_status_t    st;
    kvf_poll_t      seen;        /* its poll, the lock still held */
} reader_arg_t;

static void create_reader(void *arg)
{
    reader_arg_t *a = arg;
    kvf_remote_t rm;
    kvf_remote_init(&rm);
    rm.room = a->key.room;
    rm.instance = a->key.instance;
    rm.descriptors = &a->desc;
    rm.num_descriptors = 1;
    a->st = kvf_receiver_create_remote(a->dec->eng, &rm, &a->r);
    if (a->st == KVF_OK)
        a->seen = kvf_receiver_poll(a->r);
}

/* The create by descriptors publishes, as the create by a registry's
 * address does: it returns while the decode engine's lock is held (here
 * by this thread, as a lane's pass would), and the room, linked by the
 * lane that takes it in, reads every byte. */
static void test_reader_created_without_lock(void)
{
    side_t pre = {0}, dec = {0};
    kvf_sender_t *s;
    uint32_t src[3] = {3, 4, 5}, dst[3] = {7, 1, 2};
    char text[KVF_DESCRIPTOR_MAX];
    reader_arg_t a = {.dec = &dec, .key = kvf_room_key("cmpl-held-unlocked", 12)};

    held_pair(&pre, &dec, a.key, 10000, src, 3, &s);
    a.desc = desc_of(&pre, text);
    CHECK_EQ_INT(call_while_locked(dec.eng, create_reader, &a), 0);
    CHECK_EQ_INT(a.st, KVF_OK);
    CHECK_EQ_INT(a.seen, KVF_POLL_BOOTSTRAPPING);    /* not taken in */
    give_dest(a.r, dst, 3, 0);
    all_read(&pre, &s, 1, &dec, &a.r, 1, src, 0, dst, 3);
}

/* A decode engine given the same descriptor set again takes what it made
 * of it before (descriptor.c), and the room reads every byte as the first
 * did; a set it refused is refused again, not kept. */
static void test_descriptor_set_seen_again(void)
{
    side_t pre = {0}, dec = {0};
    kvf_sender_t *s[2];
    kvf_receiver_t *r[2];
    uint32_t src[3] = {3, 4, 5}, dst[2][3] = {{7, 1, 2}, {9, 10, 11}};
    kvf_room_key_t key[2] = {kvf_room_key("cmpl-seen-1", 11), kvf_room_key("cmpl-seen-2", 11)};
    char text[KVF_DESCRIPTOR_MAX], dtext[KVF_DESCRIPTOR_MAX];

    rank_up(&pre, KVF_ROLE_PREFILL, 0, 1, "tcp", 0);
    rank_up(&dec, KVF_ROLE_DECODE, 0, 1, "tcp", 0);
    const char *descs[1] = {desc_of(&pre, text)}, *wrong[1] = {desc_of(&dec, dtext)};
    for (int k = 0; k < 2; k++) {
        hold_all(&pre, 1, key[k], 10000, src, 3, &s[k]);
        r[k] = reader_of(&dec, descs, 1, key[k].room, key[k].instance);
        CHECK_EQ_INT((int)dec.eng->remote_hits, k);     /* parsed once, then seen */
        kvf_remote_t rm;
        kvf_remote_init(&rm);
        rm.room = 900 + (uint64_t)k;
        rm.descriptors = wrong;                         /* a decode engine's */
        rm.num_descriptors = 1;
        kvf_receiver_t *bad;
        CHECK_EQ_INT(kvf_receiver_create_remote(dec.eng, &rm, &bad), KVF_ERR_INVALID_PARAM);
        CHECK_EQ_INT((int)dec.eng->remote_hits, k);
        give_dest(r[k], dst[k], 3, 0);
        CHECK_EQ_INT(wait_sender(s[k], KVF_POLL_SUCCESS), KVF_POLL_SUCCESS);
        CHECK_EQ_INT(wait_receiver(r[k], KVF_POLL_SUCCESS), KVF_POLL_SUCCESS);
        CHECK(placed_ok(&dec, src, 0, dst[k], 3));
    }
    for (int k = 0; k < 2; k++) {
        kvf_sender_destroy(s[k]);
        kvf_receiver_destroy(r[k]);
    }
    side_fini(&dec);
    side_fini(&pre);
}

/* No reader within the lease: the room fails, its pages free. */
static void test_lease_expires_unread(void)
{
    side_t pre = {0};
    kvf_sender_t *s;
    kvf_failure_t f;
    kvf_failure_init(&f);
    uint32_t src[2] = {1, 2};
    rank_up(&pre, KVF_ROLE_PREFILL, 0, 1, "tcp", 0);
    hold_all(&pre, 1, kvf_room_key("never-read", 10), 200, src, 2, &s);
    kvf_poll_t st = wait_sender(s, KVF_POLL_SUCCESS);
    check_failed_with(st, kvf_sender_failure(s, &f), KVF_ERR_LEASE_EXPIRED, &f,
                      "no decode rank asked for it");
    CHECK_EQ_INT(f.from_another_rank, 0);
    kvf_sender_destroy(s);
    side_fini(&pre);
}

/* TP 1 -> 2, one decode rank never asks: the lease ends the room on the
 * prefill and, through it, on the decode rank that did ask. */
static void test_lease_expires_half_read(void)
{
    side_t pre = {0}, dec = {0};
    kvf_sender_t *s;
    kvf_receiver_t *r;
    kvf_failure_t f;
    kvf_failure_init(&f);
    uint32_t src[2] = {1, 2}, dst[2] = {5, 6};
    kvf_room_key_t key = kvf_room_key("half-read", 9);
    rank_up(&pre, KVF_ROLE_PREFILL, 0, 1, "tcp", 0);
    rank_up(&dec, KVF_ROLE_DECODE, 0, 2, "tcp", 0);
    hold_all(&pre, 1, key, 500, src, 2, &s);
    r = reader(&dec, &pre, 1, key.room, key.instance);
    give_dest(r, dst, 2, 0);
    kvf_poll_t st = wait_sender(s, KVF_POLL_SUCCESS);
    check_failed_with(st, kvf_sender_failure(s, &f), KVF_ERR_LEASE_EXPIRED, &f,
                      "with 1 of its 2 readers asking");
    st = wait_receiver(r, KVF_POLL_SUCCESS);
    check_failed_with(st, kvf_receiver_failure(r, &f), KVF_ERR_LEASE_EXPIRED, &f, "lease ended");
    CHECK_EQ_INT(f.from_another_rank, 1);
    CHECK_EQ_INT(f.origin_side, KVF_ROLE_PREFILL);
    kvf_sender_destroy(s);
    kvf_receiver_destroy(r);
    side_fini(&dec);
    side_fini(&pre);
}

/* A reader naming another request's instance (two request ids, one room
 * id) is refused; the held room goes on and serves its own reader. */
static void test_other_instance_refused(void)
{
    side_t pre = {0}, dec = {0};
    kvf_sender_t *s;
    kvf_receiver_t *bad, *good;
    kvf_failure_t f;
    kvf_failure_init(&f);
    uint32_t src[2] = {1, 2}, dst[2] = {5, 6};
    kvf_room_key_t key = kvf_room_key("req-a", 5), other = kvf_room_key("req-b", 5);
    CHECK(key.instance != other.instance);
    held_pair(&pre, &dec, key, 10000, src, 2, &s);

    bad = reader(&dec, &pre, 1, key.room, other.instance);
    /* The same room id twice on one decode engine: refused at create. */
    kvf_remote_t rm;
    char text[KVF_DESCRIPTOR_MAX];
    const char *d0 = desc_of(&pre, text);
    kvf_receiver_t *twice = NULL;
    kvf_remote_init(&rm);
    rm.room = key.room;
    rm.descriptors = &d0;
    rm.num_descriptors = 1;
    CHECK_EQ_INT(kvf_receiver_create_remote(dec.eng, &rm, &twice), KVF_ERR_ROOM_IN_USE);
    give_dest(bad, dst, 2, 0);
    kvf_poll_t st = wait_receiver(bad, KVF_POLL_SUCCESS);
    check_failed_with(st, kvf_receiver_failure(bad, &f), KVF_ERR_ROOM_CONFLICT, &f,
                      "holds it for another request key");
    char hex[32];
    snprintf(hex, sizeof(hex), "%016llx", (unsigned long long)key.instance);
    CHECK(strstr(f.reason, hex) == NULL);         /* a wrong guess teaches nothing */
    CHECK_EQ_INT(kvf_sender_poll(s), KVF_POLL_BOOTSTRAPPING);
    kvf_receiver_destroy(bad);

    good = reader(&dec, &pre, 1, key.room, key.instance);
    give_dest(good, dst, 2, 0);
    CHECK_EQ_INT(wait_sender(s, KVF_POLL_SUCCESS), KVF_POLL_SUCCESS);
    CHECK_EQ_INT(wait_receiver(good, KVF_POLL_SUCCESS), KVF_POLL_SUCCESS);
    CHECK(placed_ok(&dec, src, 0, dst, 2));
    kvf_sender_destroy(s);
    kvf_receiver_destroy(good);

    /* A room that is not held refuses a reader that names an instance. */
    kvf_sender_t *plain;
    CHECK_EQ_INT(kvf_sender_create(pre.eng, NULL, 99, &plain), KVF_OK);
    bad = reader(&dec, &pre, 1, 99, key.instance);
    give_dest(bad, dst, 2, 0);
    st = wait_receiver(bad, KVF_POLL_SUCCESS);
    check_failed_with(st, kvf_receiver_failure(bad, &f), KVF_ERR_ROOM_CONFLICT, &f,
                      "does not hold that room");
    kvf_receiver_destroy(bad);
    kvf_sender_destroy(plain);
    side_fini(&dec);
    side_fini(&pre);
}

/* A reader that holds a prefix takes the held pages after it; one whose
 * prefix is not whole pages fails the room on both sides. */
static void test_reader_prefix(void)
{
    side_t pre = {0}, dec = {0};
    kvf_sender_t *s;
    kvf_receiver_t *r;
    kvf_failure_t f;
    kvf_failure_init(&f);
    uint32_t src[6] = {9, 8, 7, 6, 5, 4}, dst[3] = {0, 1, 2};
    rank_up(&pre, KVF_ROLE_PREFILL, 0, 1, "tcp", 0);
    rank_up(&dec, KVF_ROLE_DECODE, 0, 1, "tcp", 0);

    kvf_room_key_t key = kvf_room_key("prefix", 6);
    hold_all(&pre, 1, key, 10000, src, 6, &s);
    r = reader(&dec, &pre, 1, key.room, key.instance);
    give_dest(r, dst, 3, 2 * PAGE);        /* holds pages 0-1: takes 2, 3, 4 */
    CHECK_EQ_INT(wait_sender(s, KVF_POLL_SUCCESS), KVF_POLL_SUCCESS);
    CHECK_EQ_INT(wait_receiver(r, KVF_POLL_SUCCESS), KVF_POLL_SUCCESS);
    CHECK(placed_ok(&dec, src, 2, dst, 3));
    kvf_sender_destroy(s);
    kvf_receiver_destroy(r);

    key = kvf_room_key("prefix-bad", 10);
    hold_all(&pre, 1, key, 10000, src, 6, &s);
    r = reader(&dec, &pre, 1, key.room, key.instance);
    give_dest(r, dst, 3, PAGE + 1);
    kvf_poll_t st = wait_sender(s, KVF_POLL_SUCCESS);
    check_failed_with(st, kvf_sender_failure(s, &f), KVF_ERR_BAD_INDICES, &f,
                      "not a whole number of 4-token pages");
    st = wait_receiver(r, KVF_POLL_SUCCESS);
    check_failed_with(st, kvf_receiver_failure(r, &f), KVF_ERR_BAD_INDICES, &f, "whole pages");
    kvf_sender_destroy(s);
    kvf_receiver_destroy(r);

    key = kvf_room_key("prefix-long", 11);
    hold_all(&pre, 1, key, 10000, src, 6, &s);
    r = reader(&dec, &pre, 1, key.room, key.instance);
    give_dest(r, dst, 3, 4 * PAGE);        /* pages 4, 5, 6 of 6 */
    st = wait_sender(s, KVF_POLL_SUCCESS);
    check_failed_with(st, kvf_sender_failure(s, &f), KVF_ERR_BAD_INDICES, &f,
                      "from page 4 on, but the prefill side holds 6");
    kvf_sender_destroy(s);
    kvf_receiver_destroy(r);
    side_fini(&dec);
    side_fini(&pre);
}

/* A reader that gives up after asking fails the held room at once. */
static void test_reader_abort(void)
{
    side_t pre = {0}, dec = {0};
    kvf_sender_t *s;
    kvf_receiver_t *r;
    kvf_failure_t f;
    kvf_failure_init(&f);
    uint32_t src[2] = {1, 2}, dst[2] = {5, 6};
    kvf_room_key_t key = kvf_room_key("abort", 5);
    rank_up(&pre, KVF_ROLE_PREFILL, 0, 1, "tcp", 0);
    rank_up(&dec, KVF_ROLE_DECODE, 0, 2, "tcp", 0);      /* the other rank never asks */
    hold_all(&pre, 1, key, 60000, src, 2, &s);
    r = reader(&dec, &pre, 1, key.room, key.instance);
    give_dest(r, dst, 2, 0);
    /* The ABORT follows the request on the one connection: the prefill
     * has the reader bound when it comes. */
    kvf_receiver_abort(r);
    kvf_poll_t st = wait_sender(s, KVF_POLL_SUCCESS);
    check_failed_with(st, kvf_sender_failure(s, &f), KVF_ERR_ABORTED, &f, "aborted");
    CHECK_EQ_INT(f.from_another_rank, 1);
    kvf_sender_destroy(s);
    kvf_receiver_destroy(r);
    side_fini(&dec);
    side_fini(&pre);
}

/* The prefill restarted on the same port: its descriptor's instance is
 * gone, and the reader says so instead of asking the new engine. */
static void test_restarted_prefill(void)
{
    side_t pre = {0}, dec = {0};
    kvf_receiver_t *r;
    kvf_failure_t f;
    kvf_failure_init(&f);
    char addr[KVF_ADDR_MAX], old_desc[KVF_DESCRIPTOR_MAX];
    rank_up(&pre, KVF_ROLE_PREFILL, 0, 1, "tcp", 0);
    CHECK_EQ_INT(kvf_engine_address(pre.eng, addr, sizeof(addr)), KVF_OK);
    int port = atoi(strrchr(addr, ':') + 1);
    const char *old = desc_of(&pre, old_desc);
    side_fini(&pre);
    rank_up(&pre, KVF_ROLE_PREFILL, 0, 1, "tcp", port);
    rank_up(&dec, KVF_ROLE_DECODE, 0, 1, "tcp", 0);
    r = reader_of(&dec, &old, 1, 5, 0);
    kvf_poll_t st = wait_receiver(r, KVF_POLL_SUCCESS);
    check_failed_with(st, kvf_receiver_failure(r, &f), KVF_ERR_PEER_RESTARTED, &f,
                      "the prefill engine restarted since it held the room");
    kvf_receiver_destroy(r);
    side_fini(&dec);
    side_fini(&pre);
}

/* A reader of a room the prefill never holds hears so at the prefill's
 * bootstrap deadline, instead of waiting out its own. */
static void test_room_never_held(void)
{
    side_t pre = {0}, dec = {0};
    kvf_receiver_t *r;
    kvf_failure_t f;
    kvf_failure_init(&f);
    uint32_t dst[2] = {5, 6};
    bootstrap_ms = 300;
    rank_up(&pre, KVF_ROLE_PREFILL, 0, 1, "tcp", 0);
    bootstrap_ms = 5000;
    rank_up(&dec, KVF_ROLE_DECODE, 0, 1, "tcp", 0);
    r = reader(&dec, &pre, 1, 12345, 0);
    give_dest(r, dst, 2, 0);
    kvf_poll_t st = wait_receiver(r, KVF_POLL_SUCCESS);
    check_failed_with(st, kvf_receiver_failure(r, &f), KVF_ERR_TIMED_OUT, &f,
                      "had no sender for room 12345");
    CHECK_EQ_INT(f.from_another_rank, 1);
    kvf_receiver_destroy(r);
    side_fini(&dec);
    side_fini(&pre);
}

/* A reader that names no request key, as one that knows only the room
 * id would, is refused: the room is the request's. */
static void test_keyless_reader_refused(void)
{
    side_t pre = {0}, dec = {0};
    kvf_sender_t *s;
    kvf_receiver_t *r;
    kvf_failure_t f;
    kvf_failure_init(&f);
    uint32_t src[2] = {1, 2}, dst[2] = {5, 6};
    kvf_room_key_t key = kvf_room_key("secret-req", 10);
    held_pair(&pre, &dec, key, 10000, src, 2, &s);
    r = reader(&dec, &pre, 1, key.room, 0);
    give_dest(r, dst, 2, 0);
    kvf_poll_t st = wait_receiver(r, KVF_POLL_SUCCESS);
    check_failed_with(st, kvf_receiver_failure(r, &f), KVF_ERR_ROOM_CONFLICT, &f,
                      "the reader named none");
    CHECK_EQ_INT(kvf_sender_poll(s), KVF_POLL_BOOTSTRAPPING);
    for (size_t i = 0; i < PAGE * (HEADS * HEAD_B); i++)
        CHECK(dec.kv[0][5 * dec.page_b + i] == 0);
    kvf_receiver_destroy(r);
    owner_reads(&pre, s, &dec, key, src, dst, 2);
}

/* A decode rank that is not the room's reader (another request key)
 * aborting cannot end the held room: only its bound readers can. */
static void test_stranger_abort_ignored(void)
{
    side_t pre = {0}, dec = {0};
    kvf_sender_t *s;
    kvf_receiver_t *r;
    uint32_t src[2] = {1, 2}, dst[2] = {5, 6};
    kvf_room_key_t key = kvf_room_key("kill-me", 7);
    held_pair(&pre, &dec, key, 10000, src, 2, &s);
    r = reader(&dec, &pre, 1, key.room, kvf_room_key("other", 5).instance);
    CHECK_EQ_INT(wait_receiver(r, KVF_POLL_WAITING_FOR_INPUT), KVF_POLL_WAITING_FOR_INPUT);
    uint64_t before = engine_stats(pre.eng).room_msgs_dropped;
    kvf_receiver_abort(r);
    wait_dropped(pre.eng, before + 1, KVF_TEST_WAIT_MS);
    CHECK(engine_stats(pre.eng).room_msgs_dropped > before);     /* the ABORT, dropped */
    CHECK_EQ_INT(kvf_sender_poll(s), KVF_POLL_BOOTSTRAPPING);
    kvf_receiver_destroy(r);
    owner_reads(&pre, s, &dec, key, src, dst, 2);
}

/* A reader that knows the request key and gives up before it asked (its
 * ABORT names the key) ends the held room at once, instead of at the end
 * of the lease. */
static void test_keyed_abort_before_asking(void)
{
    side_t pre = {0}, dec = {0};
    kvf_sender_t *s;
    kvf_receiver_t *r;
    kvf_failure_t f;
    kvf_failure_init(&f);
    uint32_t src[2] = {1, 2};
    kvf_room_key_t key = kvf_room_key("give-up", 7);
    held_pair(&pre, &dec, key, 60000, src, 2, &s);
    r = reader(&dec, &pre, 1, key.room, key.instance);
    CHECK_EQ_INT(wait_receiver(r, KVF_POLL_WAITING_FOR_INPUT), KVF_POLL_WAITING_FOR_INPUT);
    kvf_receiver_abort(r);                     /* no destination was ever sent */
    kvf_poll_t st = wait_sender(s, KVF_POLL_SUCCESS);
    check_failed_with(st, kvf_sender_failure(s, &f), KVF_ERR_ABORTED, &f, "aborted");
    CHECK_EQ_INT(f.from_another_rank, 1);
    kvf_sender_destroy(s);
    kvf_receiver_destroy(r);
    side_fini(&dec);
    side_fini(&pre);
}

/* Readers that ask before kvf_sender_init, or between two sends: the
 * pages move whenever the last of them and the pages are there. */
static void partial_case(int np, int nd, int before_init, uint32_t prefix_pages)
{
    side_t pre[MAXR] = {0}, dec[MAXR] = {0};
    kvf_sender_t *s[MAXR];
    kvf_receiver_t *r[MAXR];
    uint32_t src[6] = {3, 4, 5, 11, 0, 9}, dst[6] = {7, 1, 2, 3, 15, 12};
    kvf_room_key_t key = kvf_room_key("partial", 7);
    kvf_hold_t h;
    kvf_hold_init(&h);
    h.instance = key.instance;
    for (int i = 0; i < np; i++)
        rank_up(&pre[i], KVF_ROLE_PREFILL, i, np, "tcp", 0);
    for (int i = 0; i < nd; i++)
        rank_up(&dec[i], KVF_ROLE_DECODE, i, nd, "tcp", 0);
    for (int i = 0; i < np; i++) {
        CHECK_EQ_INT(kvf_sender_create_held(pre[i].eng, key.room, &h, &s[i]), KVF_OK);
        if (!before_init) {
            CHECK_EQ_INT(kvf_sender_init(s[i], 6, 1), KVF_OK);
            CHECK_EQ_INT(kvf_sender_send(s[i], src, 3, 0), KVF_OK);
        }
    }
    for (int i = 0; i < nd; i++)
        r[i] = reader(&dec[i], pre, np, key.room, key.instance);
    for (int i = 0; i < nd; i++)
        give_dest(r[i], dst, 6 - prefix_pages, prefix_pages * PAGE);
    for (int i = 0; i < np; i++)
        CHECK(wait_sender(s[i], KVF_POLL_WAITING_FOR_INPUT) >= KVF_POLL_WAITING_FOR_INPUT);
    for (int i = 0; i < np; i++) {
        if (before_init) {
            CHECK_EQ_INT(kvf_sender_init(s[i], 6, 1), KVF_OK);
            CHECK_EQ_INT(kvf_sender_send(s[i], src, 3, 0), KVF_OK);
        }
        CHECK_EQ_INT(kvf_sender_send(s[i], src + 3, 3, 1), KVF_OK);
    }
    all_read(pre, s, np, dec, r, nd, src, prefix_pages, dst, 6 - prefix_pages);
}

static void test_readers_before_pages(void)
{
    for (int before_init = 0; before_init < 2; before_init++)
        for (uint32_t prefix = 0; prefix < 6; prefix += 2) {
            partial_case(1, 1, before_init, prefix);
            partial_case(1, 2, before_init, prefix);
            partial_case(2, 1, before_init, prefix);
        }
}

/* An IPv6 prefill engine's descriptor names it in brackets, and a reader
 * reaches it by it. */
static void test_ipv6_descriptor(void)
{
    side_t pre = {0}, dec = {0};
    kvf_sender_t *s;
    uint32_t src[2] = {1, 2}, dst[2] = {5, 6};
    kvf_room_key_t key = kvf_room_key("v6", 2);
    setenv("KVF_HOST", "::1", 1);
    rank_up(&pre, KVF_ROLE_PREFILL, 0, 1, "tcp", 0);
    unsetenv("KVF_HOST");
    rank_up(&dec, KVF_ROLE_DECODE, 0, 1, "tcp", 0);
    char desc[KVF_DESCRIPTOR_MAX];
    CHECK_STR_CONTAINS(desc_of(&pre, desc), " addr=[::1]:");
    hold_all(&pre, 1, key, 10000, src, 2, &s);
    owner_reads(&pre, s, &dec, key, src, dst, 2);
}

/* An engine whose host is a name, or the wildcard, writes no descriptor:
 * a reader could not dial it (or would resolve it under its lock). */
static void test_descriptor_needs_numeric_host(void)
{
    const char *hosts[] = {"localhost", "0.0.0.0", "::"};
    setenv("KVF_AUTH", "none", 1);               /* the wildcard without a token */
    for (size_t i = 0; i < sizeof(hosts) / sizeof(hosts[0]); i++) {
        side_t pre = {0};
        char buf[KVF_DESCRIPTOR_MAX];
        setenv("KVF_HOST", hosts[i], 1);
        kvf_engine_params_t p;
        kvf_engine_params_init(&p);
        CHECK_EQ_INT(kvf_engine_create(&p, &pre.eng), KVF_OK);
        unsetenv("KVF_HOST");
        kvf_buffer_t kv = {NULL, 0, 0};
        CHECK_EQ_INT(kvf_mem_alloc(PAGES * PAGE_B, &kv.base), KVF_OK);
        kv.length = PAGES * PAGE_B;
        kv.item_bytes = PAGE_B;
        kvf_buffer_t two[2] = {kv, kv};
        kvf_layout_t l;
        kvf_layout_init(&l);
        l.page_size = PAGE;
        l.kv_dtype = "bfloat16";
        l.num_layers = 1;
        l.heads_per_rank = l.total_heads = HEADS;
        l.bytes_per_head = HEAD_B;
        l.num_kv = 2;
        l.kv = two;
        CHECK_EQ_INT(kvf_engine_register_layout(pre.eng, &l), KVF_OK);
        CHECK_EQ_INT(kvf_engine_descriptor(pre.eng, buf, sizeof(buf)), KVF_ERR_UNSUPPORTED);
        CHECK_STR_CONTAINS(kvf_last_error(), "numeric address");
        kvf_engine_destroy(pre.eng);
        kvf_mem_free(kv.base);
    }
    unsetenv("KVF_AUTH");
}

/* Descriptors a decode engine refuses before it dials anything: a
 * non-loopback peer without a cluster token (protected mode), and more
 * prefill ranks than it links. */
static void test_descriptors_refused_before_dialing(void)
{
    side_t dec = {0};
    kvf_receiver_t *r = NULL;
    kvf_remote_t rm;
    char text[65][KVF_DESCRIPTOR_MAX];
    const char *descs[65];
    rank_up(&dec, KVF_ROLE_DECODE, 0, 1, "tcp", 0);
    kvf_remote_init(&rm);
    rm.room = 3;
    rm.descriptors = descs;

    descs[0] = "kvf1 id=0123456789abcdef addr=192.0.2.2:4000 role=prefill tp=0/1 pp=0/1 "
               "dp=0/1 page=4 dtype=bfloat16 attn=mha heads=4";
    rm.num_descriptors = 1;
    CHECK_EQ_INT(kvf_receiver_create_remote(dec.eng, &rm, &r), KVF_ERR_INVALID_PARAM);
    CHECK_STR_CONTAINS(kvf_last_error(), "not a loopback address, and this engine has no "
                       "cluster token");

    for (int i = 0; i < 65; i++) {
        snprintf(text[i], sizeof(text[i]), "kvf1 id=%016x addr=127.0.0.1:%d role=prefill "
                 "tp=0/1 pp=%d/65 dp=0/1 page=4 dtype=bfloat16 attn=mha heads=4", i + 1,
                 4000 + i, i);
        descs[i] = text[i];
    }
    rm.num_descriptors = 65;
    CHECK_EQ_INT(kvf_receiver_create_remote(dec.eng, &rm, &r), KVF_ERR_UNSUPPORTED);
    CHECK_STR_CONTAINS(kvf_last_error(), "more than 64 prefill ranks");
    side_fini(&dec);
}

/* What a malformed or foreign descriptor list gets: a refused call. */
static void test_descriptors(void)
{
    side_t pre = {0}, dec = {0};
    char buf[KVF_DESCRIPTOR_MAX], addr[KVF_ADDR_MAX], desc[KVF_DESCRIPTOR_MAX];
    char desc1[KVF_DESCRIPTOR_MAX];
    rank_up(&pre, KVF_ROLE_PREFILL, 0, 2, "tcp", 0);
    rank_up(&dec, KVF_ROLE_DECODE, 0, 1, "tcp", 0);
    desc_of(&pre, desc);
    CHECK_EQ_INT(kvf_engine_address(pre.eng, addr, sizeof(addr)), KVF_OK);
    CHECK_STR_CONTAINS(desc, "kvf1 id=");
    CHECK_STR_CONTAINS(desc, addr);
    CHECK_STR_CONTAINS(desc, " role=prefill tp=0/2 pp=0/1 dp=0/1 page=4 dtype=bfloat16 "
                       "attn=mha heads=4");
    CHECK(strchr(desc, '"') == NULL && strchr(desc, '\\') == NULL);
    CHECK_EQ_INT(kvf_engine_descriptor(pre.eng, buf, 20), KVF_ERR_INVALID_PARAM);

    const char *bad[] = {
        "",
        "kvf2 id=0123456789abcdef",
        "kvf1 id=0123456789abcdef addr=127.0.0.1:1 role=prefill tp=0/2 pp=0/1 dp=0/1 "
        "page=4 dtype=bfloat16 attn=mha",                           /* no heads */
        "kvf1 id=0123456789abcdef id=0123456789abcdef addr=127.0.0.1:1 role=prefill "
        "tp=0/2 pp=0/1 dp=0/1 page=4 dtype=bfloat16 attn=mha heads=4",  /* twice */
        "kvf1 id=0000000000000000 addr=127.0.0.1:1 role=prefill tp=0/2 pp=0/1 dp=0/1 "
        "page=4 dtype=bfloat16 attn=mha heads=4",                   /* id 0 */
        "kvf1 id=0123456789abcdef addr=127.0.0.1:1 role=prefill tp=2/2 pp=0/1 dp=0/1 "
        "page=4 dtype=bfloat16 attn=mha heads=4",                   /* rank >= size */
        "kvf1 id=0123456789abcdef addr=127.0.0.1 role=prefill tp=0/2 pp=0/1 dp=0/1 "
        "page=4 dtype=bfloat16 attn=mha heads=4",                   /* no port */
        "kvf1 id=0123456789abcdef addr=127.0.0.1:1 role=decode tp=0/2 pp=0/1 dp=0/1 "
        "page=4 dtype=bfloat16 attn=mha heads=4",                   /* a decode's */
        "kvf1 id=0123456789abcdef addr=127.0.0.1:1 role=prefill tp=0/-2 pp=0/1 dp=0/1 "
        "page=4 dtype=bfloat16 attn=mha heads=4",
        "kvf1 id=0123456789abcdef addr=127.0.0.1:1 role=prefill tp=0/2 pp=0/1 dp=0/1 "
        "page=4 dtype=bf\"16 attn=mha heads=4",
        "kvf1 id=0123456789abcdef addr=127.0.0.1:1 role=prefill tp=0/2 pp=0/1 dp=0/1 "
        "page=4 dtype=bfloat16 attn=gqa heads=4",
        "kvf1 id=0123456789abcdef addr=localhost:1 role=prefill tp=0/2 pp=0/1 dp=0/1 "
        "page=4 dtype=bfloat16 attn=mha heads=4",                   /* a name */
        "kvf1 id=0123456789abcdef addr=0.0.0.0:1 role=prefill tp=0/2 pp=0/1 dp=0/1 "
        "page=4 dtype=bfloat16 attn=mha heads=4",                   /* the wildcard */
        "kvf1  id=0123456789abcdef addr=127.0.0.1:1 role=prefill tp=0/2 pp=0/1 dp=0/1 "
        "page=4 dtype=bfloat16 attn=mha heads=4",                   /* an empty field */
    };
    kvf_receiver_t *r = NULL;
    kvf_remote_t rm;
    kvf_remote_init(&rm);
    rm.room = 1;
    rm.num_descriptors = 1;
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        rm.descriptors = &bad[i];
        CHECK_EQ_INT(kvf_receiver_create_remote(dec.eng, &rm, &r), KVF_ERR_INVALID_PARAM);
    }
    /* TP 2 -> 1 reads both prefill ranks: one descriptor is not enough,
     * nor the same one twice. */
    const char *one[2] = {desc, desc};
    rm.descriptors = one;
    CHECK_EQ_INT(kvf_receiver_create_remote(dec.eng, &rm, &r), KVF_ERR_INVALID_PARAM);
    CHECK_STR_CONTAINS(kvf_last_error(), "no descriptor names it");
    rm.num_descriptors = 2;
    CHECK_EQ_INT(kvf_receiver_create_remote(dec.eng, &rm, &r), KVF_ERR_INVALID_PARAM);
    CHECK_STR_CONTAINS(kvf_last_error(), "both name prefill rank tp 0 pp 0");
    rm.num_descriptors = 0;
    CHECK_EQ_INT(kvf_receiver_create_remote(dec.eng, &rm, &r), KVF_ERR_INVALID_PARAM);
    /* A later version's field is skipped. */
    snprintf(buf, sizeof(buf), "%s future=1", desc);
    const char *two[2] = {buf, NULL};
    side_t pre1 = {0};
    rank_up(&pre1, KVF_ROLE_PREFILL, 1, 2, "tcp", 0);
    two[1] = desc_of(&pre1, desc1);
    rm.descriptors = two;
    rm.num_descriptors = 2;
    CHECK_EQ_INT(kvf_receiver_create_remote(dec.eng, &rm, &r), KVF_OK);
    kvf_receiver_destroy(r);
    side_fini(&pre1);
    side_fini(&dec);
    side_fini(&pre);
}

/* A descriptor names an address a decode engine can dial: every spelling
 * of the wildcard is refused, IPv4-mapped ones too, and so are addresses
 * that name no one host; the refusal says why.  Usable spellings pass. */
static void test_descriptor_addresses(void)
{
    static const char *const refused[] = {
        "0.0.0.0", "[::]", "[::0]", "[0:0:0:0:0:0:0:0]", "[::0.0.0.0]",
        "[::ffff:0.0.0.0]", "[::ffff:0:0]", "[::FFFF:0000:0000]", "[0:0:0:0:0:ffff:0:0]",
        "0.1.2.3", "[::ffff:0.1.2.3]", "224.0.0.1", "239.255.255.250", "[::ffff:224.0.0.1]",
        "255.255.255.255", "[::ffff:255.255.255.255]", "[ff02::1]", "[fe80::1]",
        "[::1.2.3.4]",
    };
    static const char *const usable[] = {
        "127.0.0.1", "[::1]", "[0:0:0:0:0:0:0:1]", "[::ffff:127.0.0.1]", "10.1.2.3",
        "[::ffff:10.1.2.3]", "[2001:db8::1]", "1.0.0.0", "223.255.255.255",
    };
    char text[KVF_DESCRIPTOR_MAX], err[256];
    kvf_descriptor_t d;
    side_t dec = {0};
    kvf_receiver_t *r = NULL;
    kvf_remote_t rm;
    const char *one[1] = {text};

    for (size_t i = 0; i < sizeof(usable) / sizeof(usable[0]); i++) {
        snprintf(text, sizeof(text), "kvf1 id=0123456789abcdef addr=%s:4000 role=prefill "
                 "tp=0/1 pp=0/1 dp=0/1 page=4 dtype=bfloat16 attn=mha heads=4", usable[i]);
        CHECK_EQ_INT(kvf__descriptor_parse(text, &d, err, sizeof(err)), KVF_OK);
    }
    /* The decode engine runs open (KVF_AUTH=none), so that protected mode,
     * which refuses non-loopback addresses anyway, does not hide the rule. */
    setenv("KVF_AUTH", "none", 1);
    rank_up(&dec, KVF_ROLE_DECODE, 0, 1, "tcp", 0);
    unsetenv("KVF_AUTH");
    kvf_remote_init(&rm);
    rm.room = 5;
    rm.descriptors = one;
    rm.num_descriptors = 1;
    for (size_t i = 0; i < sizeof(refused) / sizeof(refused[0]); i++) {
        snprintf(text, sizeof(text), "kvf1 id=0123456789abcdef addr=%s:4000 role=prefill "
                 "tp=0/1 pp=0/1 dp=0/1 page=4 dtype=bfloat16 attn=mha heads=4", refused[i]);
        err[0] = '\0';
        CHECK_EQ_INT(kvf__descriptor_parse(text, &d, err, sizeof(err)), KVF_ERR_INVALID_PARAM);
        CHECK_STR_CONTAINS(err, "field addr=");
        CHECK(strstr(err, "wildcard") || strstr(err, "multicast") ||
              strstr(err, "broadcast") || strstr(err, "0.0.0.0/8") ||
              strstr(err, "link-local") || strstr(err, "IPv4-compatible"));
        r = NULL;
        CHECK_EQ_INT(kvf_receiver_create_remote(dec.eng, &rm, &r), KVF_ERR_INVALID_PARAM);
        CHECK_STR_CONTAINS(kvf_last_error(), "field addr=");
        if (r != NULL)
            kvf_receiver_destroy(r);
        if (kvf_test_failures_)
            fprintf(stderr, "  refused[%zu] = %s: %s\n", i, refused[i], err);
    }
    side_fini(&dec);
}

/* A rank and size are digits and a slash, nothing else: strtol alone would
 * take leading blanks and a sign, and a rank of -1 after them (the fuzzer
 * found "pp=\n-1/2"). */
static void test_descriptor_coordinates(void)
{
    static const char *const refused[] = {
        "\n-1/2", " 0/2", "-1/2", "+0/2", "0/ 2", "0/+2", "0/\n2", "2/2", "0/0", "0/",
        "/2", "0/2 ",
    };
    char text[KVF_DESCRIPTOR_MAX], err[256];
    kvf_descriptor_t d;

    for (size_t i = 0; i < sizeof(refused) / sizeof(refused[0]); i++) {
        snprintf(text, sizeof(text), "kvf1 id=0123456789abcdef addr=127.0.0.1:4000 "
                 "role=prefill tp=0/1 pp=%s dp=0/1 page=4 dtype=bfloat16 attn=mha heads=4",
                 refused[i]);
        err[0] = '\0';
        CHECK_EQ_INT(kvf__descriptor_parse(text, &d, err, sizeof(err)), KVF_ERR_INVALID_PARAM);
        CHECK(err[0] != '\0');
        if (kvf_test_failures_)
            fprintf(stderr, "  refused[%zu]: %s\n", i, err);
    }
    snprintf(text, sizeof(text), "kvf1 id=0123456789abcdef addr=127.0.0.1:4000 "
             "role=prefill tp=0/1 pp=3/4 dp=0/1 page=4 dtype=bfloat16 attn=mha heads=4");
    CHECK_EQ_INT(kvf__descriptor_parse(text, &d, err, sizeof(err)), KVF_OK);
    CHECK(d.pp_rank == 3 && d.pp_size == 4);
}

/* The documented function: XXH3-128 of the bytes, low half the room,
 * high half the instance.  Pinned, since both sides compute it. */
static void test_room_key(void)
{
    kvf_room_key_t a = kvf_room_key("cmpl-1234", 9), b = kvf_room_key("cmpl-1234", 9);
    kvf_room_key_t c = kvf_room_key("cmpl-1235", 9);
    CHECK(a.room == b.room && a.instance == b.instance);
    CHECK(a.room != c.room && a.instance != c.instance);
    CHECK(kvf_room_key("", 0).instance != 0);
    CHECK(kvf_room_key(NULL, 0).room == kvf_room_key("", 0).room);
    kvf_room_key_t abc = kvf_room_key("abc", 3);
    CHECK(abc.room == 0x78af5f94892f3950ull && abc.instance == 0x06b05ab6733a6185ull);
}

KVF_TEST_MAIN(KVF_CASE(test_held_tcp), KVF_CASE(test_held_layer_by_layer),
              KVF_CASE(test_reader_created_without_lock),
              KVF_CASE(test_descriptor_set_seen_again),
              KVF_CASE(test_held_shm),
              KVF_CASE(test_lease_expires_unread),
              KVF_CASE(test_lease_expires_half_read),
              KVF_CASE(test_other_instance_refused),
              KVF_CASE(test_reader_prefix),
              KVF_CASE(test_reader_abort),
              KVF_CASE(test_restarted_prefill),
              KVF_CASE(test_room_never_held),
              KVF_CASE(test_keyless_reader_refused),
              KVF_CASE(test_stranger_abort_ignored),
              KVF_CASE(test_keyed_abort_before_asking),
              KVF_CASE(test_readers_before_pages),
              KVF_CASE(test_ipv6_descriptor),
              KVF_CASE(test_descriptor_needs_numeric_host),
              KVF_CASE(test_descriptors_refused_before_dialing),
              KVF_CASE(test_descriptors),
              KVF_CASE(test_descriptor_addresses),
              KVF_CASE(test_descriptor_coordinates),
              KVF_CASE(test_room_key))
