/*
 * The staged tcp path (core/stage.h): KV in device memory crosses the
 * stream through pinned bounce buffers and the copier, pipelined, on both
 * sides; mixed pairs (device prefill, host decode and the reverse) stage
 * on the device side only.  Run here against the fake CUDA driver
 * (unit/fake), whose "device memory" is host memory it was told about and
 * whose copies are memcpy: the code under test is the real copier and
 * staging, only the driver differs.  Byte for byte, with checksums; a copy
 * that fails mid-pipeline fails the room on both sides; a room aborted
 * while a copy into its pages is in flight holds its pages until it ends.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvf_fake_cuda.h"
#include "kvferry/kvferry.h"
#ifdef KVF_HAVE_CUDA
#include "transport/cuda/cuda.h"

#define PAGE    16                /* tokens per page */
#define HEADS   1                 /* one head: 4 KiB pages */
#define HEAD_B  256
#define PAGES   2048              /* 8 MiB per buffer: the ring turns over */
#define STATE_B (64 << 10)        /* a Mamba-like state slot */
#include "unit/kvf_sides.h"

static fake_cuda_t fake;
static kvf_kv_order_t kv_order = KVF_KV_NHD;     /* of the next side_init */
static int kv_device;                            /* of the next side_init */
static int layer_wise;                           /* of the next room_start */

/* Every engine here checks its bytes. */
static void tune(kvf_engine_params_t *p)
{
    p->checksum = 1;
}

/* KV and a "mamba" state group in device memory (kv_device) or host
 * memory, the KV in kv_order; the aux in host memory, as SGLang's. */
static void staged_shape(side_t *s, kvf_layout_t *l)
{
    static kvf_state_group_t group;
    group = (kvf_state_group_t){"mamba", 1, l->state};
    l->num_state = 0;
    l->num_state_groups = 1;
    l->state_groups = &group;
    l->mem_kind = kv_device ? KVF_MEM_CUDA : KVF_MEM_HOST;
    l->state_mem_kind = l->mem_kind;   /* on the GPU with the KV, as SGLang's */
    l->kv_order = kv_order;
    for (int i = 0; kv_device && i < s->nkv; i++)
        fake.add(s->kv[i], l->kv[i].length, 0);
    if (kv_device)
        fake.add(s->state, SLOTS * STATE_B, 0);
}

/* A side with checksums, a 10 s transfer deadline, the library's
 * bootstrap deadline and a state slot of STATE_B bytes, its KV and state
 * in device memory (device) or host memory. */
static void staged_side(side_t *s, kvf_role_t role, const char *bs, int device)
{
    side_bootstrap_ms = 0;
    side_transfer_ms = 10000;
    side_state_b = STATE_B;
    side_tune = tune;
    side_shape = staged_shape;
    kv_device = device;
    side_init(s, role, bs, NULL);
}

/* A room of n scattered pages (every other source page, destinations
 * reversed in runs), in two chunks; pages filled with a pattern.  With
 * layer_wise, layer by layer (kvf_sender_send_layers): the first chunk's
 * last layer first, then its other layers, the second chunk's layers at
 * once, then the last send without pages. */
typedef struct room {
    kvf_sender_t   *s;
    kvf_receiver_t *r;
    uint32_t       *src, *dst;
    uint32_t        n;
} room_t;

static void room_start(room_t *m, side_t *pre, side_t *dec, const char *bs, uint64_t id,
                       uint32_t n)
{
    m->n = n;
    m->src = malloc(n * sizeof(uint32_t));
    m->dst = malloc(n * sizeof(uint32_t));
    for (uint32_t i = 0; i < n; i++) {
        m->src[i] = (i * 2) % PAGES;
        m->dst[i] = (i / 8) * 8 + 7 - i % 8;     /* runs of 8, each reversed */
    }
    for (int b = 0; b < NKV; b++)
        for (size_t i = 0; i < (size_t)PAGES * PAGE_B; i++)
            pre->kv[b][i] = (uint8_t)(i * 7 + b * 13 + id);
    memcpy(pre->aux + 3 * AUX_B, "room-tag-0000001", AUX_B);
    for (size_t i = 0; i < STATE_B; i++)
        pre->state[5 * STATE_B + i] = (uint8_t)(i * 3 + id);
    uint32_t sst = 5, dst_state = 1;
    kvf_indices_t src_states = {&sst, 1}, dst_states = {&dst_state, 1};
    CHECK_EQ_INT(kvf_sender_create(pre->eng, bs, id, &m->s), KVF_OK);
    CHECK_EQ_INT(kvf_receiver_create(dec->eng, bs, id, -1, &m->r), KVF_OK);
    kvf_dest_t d;
    kvf_dest_init(&d);
    d.pages = m->dst;
    d.num_pages = n;
    d.aux_slot = 2;
    d.states = &dst_states;
    d.num_states = 1;
    CHECK_EQ_INT(kvf_receiver_set_dest(m->r, &d), KVF_OK);
    wait_sender_ms(m->s, KVF_POLL_WAITING_FOR_INPUT, 10000);
    CHECK_EQ_INT(kvf_sender_init(m->s, n, 3), KVF_OK);
    CHECK_EQ_INT(kvf_sender_set_states(m->s, &src_states, 1), KVF_OK);
    uint32_t half = n / 2;
    if (layer_wise) {
        CHECK_EQ_INT(kvf_sender_send_layers(m->s, m->src, half, 0, 0, LAYERS - 1, LAYERS),
                     KVF_OK);
        CHECK_EQ_INT(kvf_sender_send_layers(m->s, m->src, half, 0, 0, 0, LAYERS - 1), KVF_OK);
        CHECK_EQ_INT(kvf_sender_send_layers(m->s, m->src + half, n - half, half, 0, 0, LAYERS),
                     KVF_OK);
        CHECK_EQ_INT(kvf_sender_send(m->s, NULL, 0, 1), KVF_OK);
        return;
    }
    CHECK_EQ_INT(kvf_sender_send(m->s, m->src, half, 0), KVF_OK);
    CHECK_EQ_INT(kvf_sender_send(m->s, m->src + half, n - half, 1), KVF_OK);
}

static int room_bytes_equal(const room_t *m, const side_t *pre, const side_t *dec)
{
    for (int b = 0; b < NKV; b++)
        for (uint32_t i = 0; i < m->n; i++)
            if (memcmp(dec->kv[b] + (size_t)m->dst[i] * PAGE_B,
                       pre->kv[b] + (size_t)m->src[i] * PAGE_B, PAGE_B) != 0)
                return 0;
    return memcmp(dec->aux + 2 * AUX_B, "room-tag-0000001", AUX_B) == 0 &&
           memcmp(dec->state + 1 * STATE_B, pre->state + 5 * STATE_B, STATE_B) == 0;
}

static void room_end(room_t *m)
{
    kvf_sender_destroy(m->s);
    kvf_receiver_destroy(m->r);
    free(m->src);
    free(m->dst);
}

/* One room per pairing; copied bytes show which side staged. */
static void pair_room(int pre_device, int dec_device)
{
    side_t pre, dec;
    char bs[64];
    room_t m;
    const uint32_t n = 1024;   /* 16 MiB of KV: the ring of 4 slots turns over */

    fake.reset();
    staged_side(&pre, KVF_ROLE_PREFILL, "127.0.0.1:0", pre_device);
    CHECK_EQ_INT(kvf_engine_bootstrap_addr(pre.eng, bs, sizeof(bs)), KVF_OK);
    staged_side(&dec, KVF_ROLE_DECODE, NULL, dec_device);
    room_start(&m, &pre, &dec, bs, 7, n);
    wait_final(m.s, m.r);
    CHECK_EQ_INT(kvf_sender_poll(m.s), KVF_POLL_SUCCESS);
    CHECK_EQ_INT(kvf_receiver_poll(m.r), KVF_POLL_SUCCESS);
    CHECK(room_bytes_equal(&m, &pre, &dec));
    uint64_t dev = (uint64_t)n * PAGE_B * NKV + STATE_B;   /* the aux is host memory */
    CHECK_EQ_INT(fake.copied(), dev * (uint64_t)(pre_device + dec_device));
    CHECK_EQ_INT(dec.kv[0][(size_t)(n + 100) * PAGE_B], 0);   /* nothing else touched */
    room_end(&m);
    side_fini(&dec);
    side_fini(&pre);
}

static void test_device_to_device(void) { pair_room(1, 1); }
static void test_device_to_host(void) { pair_room(1, 0); }
static void test_host_to_device(void) { pair_room(0, 1); }

/* TP 1 -> TP 2: each decode rank takes one of the two heads, a strided
 * segment per page run (a piece per token of NHD pages, per HND page), cut
 * between pieces where a slot is full; over tcp both decode ranks stage,
 * the prefill too; over cuda the decode ranks pull through IPC. */
static void tp_sliced(kvf_kv_order_t order, const char *via)
{
    side_t pre, dec[2];
    char bs[64];
    const uint32_t n = 1024;
    uint32_t *src = malloc(n * sizeof(uint32_t)), *dst = malloc(n * sizeof(uint32_t));
    kvf_sender_t *s;
    kvf_receiver_t *r[2];

    fake.reset();
    side_heads = 2;
    kv_order = order;
    side_transport = via;
    staged_side(&pre, KVF_ROLE_PREFILL, "127.0.0.1:0", 1);
    CHECK_EQ_INT(kvf_engine_bootstrap_addr(pre.eng, bs, sizeof(bs)), KVF_OK);
    for (int t = 0; t < 2; t++) {
        side_rank = (side_rank_t){.tp = t, .tp_size = 2};
        staged_side(&dec[t], KVF_ROLE_DECODE, NULL, 1);
    }
    side_rank = (side_rank_t){0};
    kv_order = KVF_KV_NHD;
    side_transport = "tcp";
    for (uint32_t i = 0; i < n; i++) {
        /* 300 pages one by one (a strided segment of 16 pieces each per
         * buffer: slots of 512 segments, then 176), then runs of pages on
         * both sides: segments of up to 8192 pieces, which the slot that
         * holds the last 176 cannot take whole. */
        src[i] = i < 300 ? (3 * i) % PAGES : i + n / 2;
        dst[i] = i < 300 ? i * 2 : i + n / 2;
    }
    for (int b = 0; b < NKV; b++)
        for (size_t i = 0; i < (size_t)PAGES * PAGE_B * 2; i++)
            pre.kv[b][i] = (uint8_t)(i * 7 + b * 13 + i / 4093);
    CHECK_EQ_INT(kvf_sender_create(pre.eng, bs, 21, &s), KVF_OK);
    for (int t = 0; t < 2; t++) {
        CHECK_EQ_INT(kvf_receiver_create(dec[t].eng, bs, 21, -1, &r[t]), KVF_OK);
        CHECK_EQ_INT(kvf_receiver_init(r[t], dst, n, 2, NULL, 0), KVF_OK);
    }
    wait_sender_ms(s, KVF_POLL_WAITING_FOR_INPUT, 10000);
    CHECK_EQ_INT(kvf_sender_init(s, n, 3), KVF_OK);
    CHECK_EQ_INT(kvf_sender_send(s, src, n, 1), KVF_OK);
    wait_final(s, r[0]);
    wait_final(NULL, r[1]);
    CHECK_EQ_INT(kvf_sender_poll(s), KVF_POLL_SUCCESS);
    int same = 1;
    for (int t = 0; t < 2; t++) {
        CHECK_EQ_INT(kvf_receiver_poll(r[t]), KVF_POLL_SUCCESS);
        /* Token k's head t of the prefill's two: at (k, t) of an NHD page,
         * at (t, k) of an HND one; the decode's one head, at k either way. */
        for (int b = 0; b < NKV; b++)
            for (uint32_t i = 0; i < n; i++)
                for (uint32_t k = 0; k < PAGE; k++)
                    same &= memcmp(dec[t].kv[b] + (size_t)dst[i] * PAGE_B + (size_t)k * HEAD_B,
                                   pre.kv[b] + (size_t)src[i] * PAGE_B * 2 +
                                       (order == KVF_KV_HND ? (size_t)t * PAGE + k
                                                            : (size_t)k * 2 + t) * HEAD_B,
                                   HEAD_B) == 0;
        kvf_receiver_destroy(r[t]);
    }
    CHECK(same);
    /* Staged: each byte copied twice, out of the prefill, into one decode
     * rank; pulled through IPC: once, device to device. */
    CHECK_EQ_INT(fake.copied(), (strcmp(via, "cuda") == 0 ? 1ull : 2ull) * n * PAGE_B * 2 * NKV);
    if (strcmp(via, "cuda") == 0)
        CHECK(strcmp(kvf_engine_transport(dec[0].eng), "cuda") == 0);
    kvf_sender_destroy(s);
    side_fini(&dec[1]);
    side_fini(&dec[0]);
    side_fini(&pre);
    side_heads = 0;
    free(src);
    free(dst);
}

static void test_tp_sliced_staged(void) { tp_sliced(KVF_KV_NHD, "tcp"); }
static void test_tp_sliced_staged_hnd(void) { tp_sliced(KVF_KV_HND, "tcp"); }
static void test_tp_sliced_ipc_hnd(void) { tp_sliced(KVF_KV_HND, "cuda"); }

/* A copy fails halfway through the room (the prefill's, or the
 * decode's): both sides fail it, neither shows SUCCESS, the pages are
 * released, and the reason says what failed, on the side that saw it and
 * as the other side learned it. */
static void copy_fails(int pre_device, int dec_device)
{
    side_t pre, dec;
    char bs[64];
    room_t m;
    kvf_failure_t f;
    kvf_failure_init(&f);

    fake.reset();
    staged_side(&pre, KVF_ROLE_PREFILL, "127.0.0.1:0", pre_device);
    CHECK_EQ_INT(kvf_engine_bootstrap_addr(pre.eng, bs, sizeof(bs)), KVF_OK);
    staged_side(&dec, KVF_ROLE_DECODE, NULL, dec_device);
    fake.fail_after(8u << 20);
    room_start(&m, &pre, &dec, bs, 8, 1024);
    wait_final(m.s, m.r);
    CHECK_EQ_INT(kvf_sender_poll(m.s), KVF_POLL_FAILED);
    CHECK_EQ_INT(kvf_receiver_poll(m.r), KVF_POLL_FAILED);
    CHECK(kvf_receiver_pages_released(m.r));
    CHECK_EQ_INT(kvf_receiver_failure(m.r, &f), KVF_OK);
    CHECK_STR_CONTAINS(f.reason, "fake copy failure");
    CHECK_EQ_INT(f.from_another_rank, pre_device);
    CHECK_EQ_INT(kvf_sender_failure(m.s, &f), KVF_OK);
    CHECK_STR_CONTAINS(f.reason, "fake copy failure");
    CHECK_EQ_INT(f.from_another_rank, !pre_device);
    room_end(&m);
    side_fini(&dec);
    side_fini(&pre);
}

static void test_prefill_copy_fails_mid_pipeline(void) { copy_fails(1, 0); }
static void test_decode_copy_fails_mid_pipeline(void) { copy_fails(0, 1); }

static int copy_started(const void *arg)
{
    (void)arg;
    return fake.copied() > 0;
}

static int receiver_final(const void *arg)
{
    return room_is_final(kvf_receiver_poll(arg));
}

/* Aborted while a copy into its pages is in flight: the room shows
 * TRANSFERRING and keeps its pages until the copy ends. */
static void test_pages_held_until_copies_end(void)
{
    side_t pre, dec;
    char bs[64];
    room_t m;

    fake.reset();
    staged_side(&pre, KVF_ROLE_PREFILL, "127.0.0.1:0", 0);
    CHECK_EQ_INT(kvf_engine_bootstrap_addr(pre.eng, bs, sizeof(bs)), KVF_OK);
    staged_side(&dec, KVF_ROLE_DECODE, NULL, 1);    /* only decode copies */
    fake.delay_ms(800);
    room_start(&m, &pre, &dec, bs, 9, 64);
    wait_until(copy_started, NULL, 10000);
    CHECK(fake.copied() > 0);                     /* a copy is in flight */
    kvf_receiver_abort(m.r);
    wait_until(receiver_final, m.r, 100);         /* it must not end for 100 ms */
    CHECK_EQ_INT(kvf_receiver_poll(m.r), KVF_POLL_TRANSFERRING);
    CHECK(!kvf_receiver_pages_released(m.r));
    wait_receiver_ms(m.r, KVF_POLL_SUCCESS, 10000);
    CHECK_EQ_INT(kvf_receiver_poll(m.r), KVF_POLL_FAILED);
    CHECK(kvf_receiver_pages_released(m.r));
    fake.delay_ms(0);
    room_end(&m);
    side_fini(&dec);
    side_fini(&pre);
}

/* Same host, device to device: the cuda mover pulls through IPC (the fake
 * maps this process's own handles), no staging, no bounce copy. */
static void test_ipc_device_to_device(void)
{
    side_t pre, dec;
    char bs[64];
    room_t m;
    const uint32_t n = 512;

    fake.reset();
    side_transport = "cuda";
    staged_side(&pre, KVF_ROLE_PREFILL, "127.0.0.1:0", 1);
    CHECK_EQ_INT(kvf_engine_bootstrap_addr(pre.eng, bs, sizeof(bs)), KVF_OK);
    staged_side(&dec, KVF_ROLE_DECODE, NULL, 1);
    side_transport = "tcp";
    room_start(&m, &pre, &dec, bs, 11, n);
    wait_final(m.s, m.r);
    CHECK_EQ_INT(kvf_sender_poll(m.s), KVF_POLL_SUCCESS);
    CHECK_EQ_INT(kvf_receiver_poll(m.r), KVF_POLL_SUCCESS);
    CHECK(room_bytes_equal(&m, &pre, &dec));        /* aux too: process_vm_readv */
    CHECK_EQ_INT(fake.copied(), (uint64_t)n * PAGE_B * NKV + STATE_B);   /* once, D2D */
    CHECK(strcmp(kvf_engine_transport(dec.eng), "cuda") == 0);
    /* The peer counts in the cuda path's slot, none in the stream's. */
    kvf_engine_stats_t st = engine_stats(dec.eng);
    CHECK(strcmp(kvf_transport_name(1), "cuda") == 0);
    CHECK_EQ_INT(st.peers_by_path[1], 1);
    CHECK_EQ_INT(st.peers_by_path[0], 0);
    room_end(&m);
    side_fini(&dec);
    side_fini(&pre);
}

/* Layer by layer, staged over tcp and pulled through IPC: each byte
 * copied as often as when the chunks hold every layer. */
static void test_layer_wise_staged(void)
{
    layer_wise = 1;
    pair_room(1, 1);
    layer_wise = 0;
}

static void test_layer_wise_ipc(void)
{
    layer_wise = 1;
    test_ipc_device_to_device();
    layer_wise = 0;
}

/* A decode engine's cuda mover refuses offers it cannot use, saying why;
 * the pair then goes over the stream. */
static void test_ipc_offer_refused(void)
{
    static uint8_t buf[4096];
    void *bases[1] = {buf};
    size_t lens[1] = {sizeof(buf)};
    kvf_mem_kind_t kinds[1] = {KVF_MEM_CUDA};
    kvf_mover_params_t mp = {.role = KVF_ROLE_PREFILL, .bases = bases, .lens = lens, .n = 1,
                             .mem_kind = KVF_MEM_CUDA, .kinds = kinds};
    kvf_mover_t *pm, *dm;
    kvf_mover_ep_t *ep;
    kvf_buf_t offer;
    char why[256];

    fake.reset();
    fake.add(buf, sizeof(buf), 0);
    CHECK_EQ_INT(kvf_cuda_mover.create(&mp, &pm, why, sizeof(why)), KVF_OK);
    mp.role = KVF_ROLE_DECODE;
    CHECK_EQ_INT(kvf_cuda_mover.create(&mp, &dm, why, sizeof(why)), KVF_OK);
    kvf_buf_init(&offer);
    kvf_mover_peer_t peer = {.pid = 1};
    CHECK_EQ_INT(kvf_cuda_mover.pack(pm, &peer, &offer), KVF_OK);

    CHECK_EQ_INT(kvf_cuda_mover.connect(dm, offer.data, offer.len - 1, &ep, why, sizeof(why)),
                 KVF_ERR_UNSUPPORTED);
    CHECK_STR_CONTAINS(why, "malformed cuda offer");
    offer.data[8] ^= 1;                   /* another boot id: another host */
    CHECK_EQ_INT(kvf_cuda_mover.connect(dm, offer.data, offer.len, &ep, why, sizeof(why)),
                 KVF_ERR_UNSUPPORTED);
    CHECK_STR_CONTAINS(why, "another host");
    offer.data[8] ^= 1;
    CHECK_EQ_INT(kvf_cuda_mover.connect(pm, offer.data, offer.len, &ep, why, sizeof(why)),
                 KVF_ERR_UNSUPPORTED);
    CHECK_STR_CONTAINS(why, "a prefill engine does not read");
    /* another process's handles (the fake's carry a pid): not ours to open */
    offer.data[48 + 28] ^= 0x40;
    CHECK_EQ_INT(kvf_cuda_mover.connect(dm, offer.data, offer.len, &ep, why, sizeof(why)),
                 KVF_ERR_UNSUPPORTED);
    CHECK_STR_CONTAINS(why, "cannot open the prefill engine's device memory");

    offer.data[48 + 28] ^= 0x40;
    /* An offset past the allocation the handle opens: never read. */
    uint64_t off = kvf_get_u64(offer.data + 48 + 20);
    kvf_put_u64(offer.data + 48 + 20, off + sizeof(buf));
    CHECK_EQ_INT(kvf_cuda_mover.connect(dm, offer.data, offer.len, &ep, why, sizeof(why)),
                 KVF_ERR_UNSUPPORTED);
    CHECK_STR_CONTAINS(why, "outside the 4096-byte allocation its handle opens");
    kvf_put_u64(offer.data + 48 + 20, off);
    CHECK_EQ_INT(kvf_cuda_mover.connect(dm, offer.data, offer.len, &ep, why, sizeof(why)),
                 KVF_OK);
    /* A source outside what the prefill registered is refused before a copy. */
    uint8_t local[16];
    struct iovec l = {local, sizeof(local)}, r = {buf + sizeof(buf) - 8, sizeof(local)};
    kvf_mover_read_t rd = {NULL};
    CHECK_EQ_INT(kvf_cuda_mover.read(ep, &rd, &l, &r, 1, 1000, why, sizeof(why)),
                 KVF_ERR_PROTOCOL);
    CHECK_STR_CONTAINS(why, "outside every region it registered");
    kvf_cuda_mover.disconnect(ep);
    kvf_buf_free(&offer);
    kvf_cuda_mover.destroy(dm);
    kvf_cuda_mover.destroy(pm);
    /* Host KV: the mover is not for it. */
    kinds[0] = KVF_MEM_HOST;
    mp.mem_kind = KVF_MEM_HOST;
    CHECK_EQ_INT(kvf_cuda_mover.create(&mp, &dm, why, sizeof(why)), KVF_ERR_UNSUPPORTED);
    CHECK_STR_CONTAINS(why, "host memory");
}

int main(int argc, char **argv)
{
    if (!fake_cuda_load(&fake)) {
        printf("cannot load the fake CUDA driver %s: %s\n", KVF_FAKE_CUDA, dlerror());
        return 1;
    }
    kvf_test_case_t cases[] = {
        KVF_CASE(test_device_to_device),
        KVF_CASE(test_device_to_host),
        KVF_CASE(test_host_to_device),
        KVF_CASE(test_tp_sliced_staged),
        KVF_CASE(test_tp_sliced_staged_hnd),
        KVF_CASE(test_tp_sliced_ipc_hnd),
        KVF_CASE(test_prefill_copy_fails_mid_pipeline),
        KVF_CASE(test_decode_copy_fails_mid_pipeline),
        KVF_CASE(test_pages_held_until_copies_end),
        KVF_CASE(test_ipc_device_to_device),
        KVF_CASE(test_ipc_offer_refused),
        KVF_CASE(test_layer_wise_staged),
        KVF_CASE(test_layer_wise_ipc),
    };
    return kvf_test_run(cases, sizeof(cases) / sizeof(cases[0]), argc, argv);
}

#else   /* no cuda component: nothing to stage with */

int main(void)
{
    printf("skipped: this build has no cuda component (no CUDA toolkit found, or "
           "-DKVF_CUDA=OFF)\n");
    return 77;
}
#endif
