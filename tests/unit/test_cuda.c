/*
 * On a real GPU (skipped, with the reason, anywhere else): memory kinds as
 * the real driver reports them, and a room of device memory staged over
 * tcp between two engines of this process, sent whole and layer by layer
 * (kvf_sender_send_layers), verified byte for byte.  The
 * device check (tests/gpu/run.sh) runs it; the same paths run everywhere
 * against the fake driver in test_memkind and test_stage.
 */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvferry/kvferry.h"
#include "util/cudrv.h"

#define LAYERS 1
#define HEADS  1
#define HEAD_B 4096
#define PAGE   16
#define PAGES  64                 /* of PAGE_B, 64 KiB */
#define SLOTS  4
#include "unit/kvf_sides.h"

static int (*mem_alloc)(unsigned long long *p, size_t n);
static int (*mem_free)(unsigned long long p);
static int (*htod)(unsigned long long dst, const void *src, size_t n);
static int (*dtoh)(void *dst, unsigned long long src, size_t n);
static cu_ctx_t ctx;
static const kvf_cudrv_t *drv;

/* The device address of p (a side's KV is device memory here). */
static unsigned long long dev(const uint8_t *p)
{
    return (unsigned long long)(uintptr_t)p;
}

static void tune(kvf_engine_params_t *p)
{
    p->checksum = 1;
}

static int declare_host;          /* of the next device_side */

/* The layout says what the KV is: device memory, or (declare_host) host
 * memory, which it is not. */
static void declared_kind(side_t *s, kvf_layout_t *l)
{
    (void)s;
    l->mem_kind = declare_host ? KVF_MEM_HOST : KVF_MEM_CUDA;
}

/* A side whose KV is device memory (the CPU never writes it), with
 * checksums and the library's deadlines.  @return what registering said. */
static kvf_status_t device_side(side_t *s, kvf_role_t role, const char *bs, int host)
{
    side_bootstrap_ms = side_transfer_ms = 0;
    side_tune = tune;
    side_shape = declared_kind;
    declare_host = host;
    CHECK_EQ_INT(side_try(s, role, bs, NULL, NULL), KVF_OK);
    for (int i = 0; i < s->nkv; i++) {
        unsigned long long d = 0;
        CHECK_EQ_INT(mem_alloc(&d, (size_t)PAGES * s->page_b), 0);
        s->kv[i] = (uint8_t *)(uintptr_t)d;
    }
    s->aux = calloc(SLOTS, AUX_B);
    return side_try_register(s);
}

static void device_side_fini(side_t *s)
{
    kvf_engine_destroy(s->eng);
    drv->CtxSetCurrent(ctx);
    for (int i = 0; i < s->nkv; i++)
        mem_free(dev(s->kv[i]));
    free(s->aux);
}

static void test_device_pointer_declared_host_is_refused(void)
{
    side_t s;
    CHECK_EQ_INT(device_side(&s, KVF_ROLE_DECODE, NULL, 1), KVF_ERR_INVALID_PARAM);
    CHECK_STR_CONTAINS(kvf_last_error(), "is memory of CUDA device 0, but the layout says "
                                         "host memory");
    device_side_fini(&s);
}

/* One room of 8 pages, device memory on both sides staged over tcp: sent
 * whole, or (layered) in two chunks of every layer by
 * kvf_sender_send_layers, then a last send without pages. */
static void staged_room(int layered)
{
    side_t pre, dec;
    char bs[64];
    uint32_t src[8] = {1, 2, 3, 9, 10, 30, 31, 50}, dst[8] = {60, 5, 6, 7, 40, 41, 0, 20};
    uint8_t *pat = malloc(PAGE_B), *got = malloc(PAGE_B);

    CHECK_EQ_INT(device_side(&pre, KVF_ROLE_PREFILL, "127.0.0.1:0", 0), KVF_OK);
    CHECK_EQ_INT(kvf_engine_bootstrap_addr(pre.eng, bs, sizeof(bs)), KVF_OK);
    CHECK_EQ_INT(device_side(&dec, KVF_ROLE_DECODE, NULL, 0), KVF_OK);
    drv->CtxSetCurrent(ctx);
    for (int b = 0; b < NKV; b++)
        for (int i = 0; i < 8; i++) {
            for (int k = 0; k < PAGE_B; k++)
                pat[k] = (uint8_t)(k * 7 + i * 13 + b);
            htod(dev(pre.kv[b] + (size_t)src[i] * PAGE_B), pat, PAGE_B);
        }
    kvf_sender_t *s;
    kvf_receiver_t *r;
    CHECK_EQ_INT(kvf_sender_create(pre.eng, bs, 1, &s), KVF_OK);
    CHECK_EQ_INT(kvf_receiver_create(dec.eng, bs, 1, -1, &r), KVF_OK);
    CHECK_EQ_INT(kvf_receiver_init(r, dst, 8, 1, NULL, 0), KVF_OK);
    wait_sender_ms(s, KVF_POLL_WAITING_FOR_INPUT, 10000);
    CHECK_EQ_INT(kvf_sender_init(s, 8, 2), KVF_OK);
    if (layered) {
        CHECK_EQ_INT(kvf_sender_send_layers(s, src, 4, 0, 0, 0, LAYERS), KVF_OK);
        CHECK_EQ_INT(kvf_sender_send_layers(s, src + 4, 4, 4, 0, 0, LAYERS), KVF_OK);
        CHECK_EQ_INT(kvf_sender_send(s, NULL, 0, 1), KVF_OK);
    } else {
        CHECK_EQ_INT(kvf_sender_send(s, src, 8, 1), KVF_OK);
    }
    wait_receiver(r, KVF_POLL_SUCCESS);
    CHECK_EQ_INT(kvf_receiver_poll(r), KVF_POLL_SUCCESS);
    drv->CtxSetCurrent(ctx);
    for (int b = 0; b < NKV; b++)
        for (int i = 0; i < 8; i++) {
            for (int k = 0; k < PAGE_B; k++)
                pat[k] = (uint8_t)(k * 7 + i * 13 + b);
            dtoh(got, dev(dec.kv[b] + (size_t)dst[i] * PAGE_B), PAGE_B);
            CHECK(memcmp(got, pat, PAGE_B) == 0);
        }
    /* Staged over the stream: the peer counts in tcp's slot, not cuda's. */
    kvf_engine_stats_t st = engine_stats(dec.eng);
    CHECK_EQ_INT(st.peers_by_path[0], 1);
    CHECK_EQ_INT(st.peers_by_path[1], 0);
    kvf_sender_destroy(s);
    kvf_receiver_destroy(r);
    device_side_fini(&dec);
    device_side_fini(&pre);
    free(pat);
    free(got);
}

static void test_staged_room_on_the_device(void) { staged_room(0); }
static void test_layer_wise_room_on_the_device(void) { staged_room(1); }

int main(int argc, char **argv)
{
    char why[256];
    int dev;
    if ((drv = kvf_cudrv(why, sizeof(why))) == NULL) {
        printf("skipped: %s\n", why);
        return 77;
    }
    void *h = dlopen(getenv("KVF_CUDA_DRIVER") ? getenv("KVF_CUDA_DRIVER") : "libcuda.so.1",
                     RTLD_NOW);
    *(void **)&mem_alloc = h ? dlsym(h, "cuMemAlloc_v2") : NULL;
    *(void **)&mem_free = h ? dlsym(h, "cuMemFree_v2") : NULL;
    *(void **)&htod = h ? dlsym(h, "cuMemcpyHtoD_v2") : NULL;
    *(void **)&dtoh = h ? dlsym(h, "cuMemcpyDtoH_v2") : NULL;
    int n = 0;
    if (!mem_alloc || !mem_free || !htod || !dtoh) {
        printf("skipped: the CUDA driver lacks cuMemAlloc/cuMemcpy (a fake driver?)\n");
        return 77;
    }
    if (drv->DeviceGetCount(&n) != 0 || n == 0 || drv->DeviceGet(&dev, 0) != 0 ||
        drv->DevicePrimaryCtxRetain(&ctx, dev) != 0) {
        printf("skipped: the CUDA driver has no usable device (%d devices)\n", n);
        return 77;
    }
    drv->CtxSetCurrent(ctx);
    kvf_test_case_t cases[] = {
        KVF_CASE(test_device_pointer_declared_host_is_refused),
        KVF_CASE(test_staged_room_on_the_device),
        KVF_CASE(test_layer_wise_room_on_the_device),
    };
    return kvf_test_run(cases, sizeof(cases) / sizeof(cases[0]), argc, argv);
}
