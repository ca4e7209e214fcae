/*
 * On a real GPU (skipped, with the reason, anywhere else): memory kinds as
 * the real driver reports them, and one room of device memory staged over
 * tcp between two engines of this process, verified byte for byte.  The
 * device check (tests/gpu/run.sh) runs it; the same paths run everywhere
 * against the fake driver in test_memkind and test_stage.
 */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kvf_test.h"
#include "kvferry/kvferry.h"
#include "util/cudrv.h"

#define PAGES  64
#define PAGE_B 65536
#define NKV    2

static int (*mem_alloc)(unsigned long long *p, size_t n);
static int (*mem_free)(unsigned long long p);
static int (*htod)(unsigned long long dst, const void *src, size_t n);
static int (*dtoh)(void *dst, unsigned long long src, size_t n);
static cu_ctx_t ctx;
static const kvf_cudrv_t *drv;

static void sleep_ms(int ms)
{
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

typedef struct side {
    kvf_engine_t      *eng;
    unsigned long long kv[NKV];
    uint8_t            aux[4 * 16];
} side_t;

static kvf_status_t side_init(side_t *s, kvf_role_t role, const char *bs, int declare_host)
{
    kvf_engine_params_t p;
    kvf_engine_params_init(&p);
    p.role = role;
    p.transport = "tcp";
    p.checksum = 1;
    p.bootstrap_addr = bs;
    p.host_bootstrap = role == KVF_ROLE_PREFILL;
    CHECK_EQ_INT(kvf_engine_create(&p, &s->eng), KVF_OK);
    kvf_buffer_t kv[NKV], aux = {s->aux, sizeof(s->aux), 16};
    for (int i = 0; i < NKV; i++) {
        CHECK_EQ_INT(mem_alloc(&s->kv[i], (size_t)PAGES * PAGE_B), 0);
        kv[i] = (kvf_buffer_t){(void *)(uintptr_t)s->kv[i], (size_t)PAGES * PAGE_B, PAGE_B};
    }
    kvf_layout_t l;
    kvf_layout_init(&l);
    l.page_size = 16;
    l.kv_dtype = "bfloat16";
    l.num_layers = 1;
    l.heads_per_rank = l.total_heads = 1;
    l.bytes_per_head = PAGE_B / 16;
    l.num_kv = NKV;
    l.kv = kv;
    l.num_aux = 1;
    l.aux = &aux;
    l.mem_kind = declare_host ? KVF_MEM_HOST : KVF_MEM_CUDA;
    return kvf_engine_register_layout(s->eng, &l);
}

static void side_fini(side_t *s)
{
    kvf_engine_destroy(s->eng);
    drv->CtxSetCurrent(ctx);
    for (int i = 0; i < NKV; i++)
        mem_free(s->kv[i]);
}

static void test_device_pointer_declared_host_is_refused(void)
{
    side_t s;
    CHECK_EQ_INT(side_init(&s, KVF_ROLE_DECODE, NULL, 1), KVF_ERR_INVALID_PARAM);
    CHECK_STR_CONTAINS(kvf_last_error(), "is memory of CUDA device 0, but the layout says "
                                         "host memory");
    side_fini(&s);
}

static void test_staged_room_on_the_device(void)
{
    side_t pre, dec;
    char bs[64];
    uint32_t src[8] = {1, 2, 3, 9, 10, 30, 31, 50}, dst[8] = {60, 5, 6, 7, 40, 41, 0, 20};
    uint8_t *pat = malloc(PAGE_B), *got = malloc(PAGE_B);

    CHECK_EQ_INT(side_init(&pre, KVF_ROLE_PREFILL, "127.0.0.1:0", 0), KVF_OK);
    CHECK_EQ_INT(kvf_engine_bootstrap_addr(pre.eng, bs, sizeof(bs)), KVF_OK);
    CHECK_EQ_INT(side_init(&dec, KVF_ROLE_DECODE, NULL, 0), KVF_OK);
    drv->CtxSetCurrent(ctx);
    for (int b = 0; b < NKV; b++)
        for (int i = 0; i < 8; i++) {
            for (int k = 0; k < PAGE_B; k++)
                pat[k] = (uint8_t)(k * 7 + i * 13 + b);
            htod(pre.kv[b] + (size_t)src[i] * PAGE_B, pat, PAGE_B);
        }
    kvf_sender_t *s;
    kvf_receiver_t *r;
    CHECK_EQ_INT(kvf_sender_create(pre.eng, bs, 1, &s), KVF_OK);
    CHECK_EQ_INT(kvf_receiver_create(dec.eng, bs, 1, -1, &r), KVF_OK);
    CHECK_EQ_INT(kvf_receiver_init(r, dst, 8, 1, NULL, 0), KVF_OK);
    for (int i = 0; i < 10000 && kvf_sender_poll(s) < KVF_POLL_WAITING_FOR_INPUT; i++)
        sleep_ms(1);
    CHECK_EQ_INT(kvf_sender_init(s, 8, 2), KVF_OK);
    CHECK_EQ_INT(kvf_sender_send(s, src, 8, 1), KVF_OK);
    for (int i = 0; i < 20000 && kvf_receiver_poll(r) != KVF_POLL_SUCCESS &&
                    kvf_receiver_poll(r) != KVF_POLL_FAILED; i++)
        sleep_ms(1);
    CHECK_EQ_INT(kvf_receiver_poll(r), KVF_POLL_SUCCESS);
    drv->CtxSetCurrent(ctx);
    for (int b = 0; b < NKV; b++)
        for (int i = 0; i < 8; i++) {
            for (int k = 0; k < PAGE_B; k++)
                pat[k] = (uint8_t)(k * 7 + i * 13 + b);
            dtoh(got, dec.kv[b] + (size_t)dst[i] * PAGE_B, PAGE_B);
            CHECK(memcmp(got, pat, PAGE_B) == 0);
        }
    kvf_sender_destroy(s);
    kvf_receiver_destroy(r);
    side_fini(&dec);
    side_fini(&pre);
    free(pat);
    free(got);
}

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
    };
    return kvf_test_run(cases, sizeof(cases) / sizeof(cases[0]), argc, argv);
}
