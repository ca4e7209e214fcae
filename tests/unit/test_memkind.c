/*
 * Memory kinds: registration asks the CUDA driver what each buffer is and
 * refuses a buffer that is not what its family declares, naming it; a
 * CUDA-declared buffer without a driver is refused with that reason; a
 * host-declared one without a driver is taken as it is.  The driver here
 * is the fake one (unit/fake), which says "device" for what the test
 * declares; the no-driver case runs in a child pointed at no driver.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "kvf_fake_cuda.h"
#include "kvf_test.h"
#include "kvferry/kvferry.h"

#define PAGE_B 1024
#define PAGES  4
#define NKV    4

static fake_cuda_t fake;
static uint8_t kvmem[NKV][PAGES * PAGE_B], auxmem[2 * 16];

typedef struct lay {
    kvf_layout_t l;
    kvf_buffer_t kv[NKV], aux;
} lay_t;

/* Two layers, K and V each (MHA: 1 head of PAGE_B/4 bytes, page_size 4). */
static void lay_init(lay_t *y)
{
    kvf_layout_init(&y->l);
    y->l.page_size = 4;
    y->l.kv_dtype = "bfloat16";
    y->l.num_layers = 2;
    y->l.heads_per_rank = y->l.total_heads = 1;
    y->l.bytes_per_head = PAGE_B / 4;
    for (int i = 0; i < NKV; i++)
        y->kv[i] = (kvf_buffer_t){kvmem[i], sizeof(kvmem[i]), PAGE_B};
    y->aux = (kvf_buffer_t){auxmem, sizeof(auxmem), 16};
    y->l.num_kv = NKV;
    y->l.kv = y->kv;
    y->l.num_aux = 1;
    y->l.aux = &y->aux;
}

static kvf_status_t try_register(const lay_t *y)
{
    kvf_engine_params_t p;
    kvf_engine_t *eng;
    kvf_engine_params_init(&p);
    p.role = KVF_ROLE_DECODE;
    p.transport = "tcp";
    if (kvf_engine_create(&p, &eng) != KVF_OK)
        return KVF_ERR_IO;
    kvf_status_t st = kvf_engine_register_layout(eng, &y->l);
    kvf_engine_destroy(eng);
    return st;
}

static void declare_kv_device(int ordinal, int upto)
{
    fake.reset();
    for (int i = 0; i < upto; i++)
        fake.add(kvmem[i], sizeof(kvmem[i]), ordinal);
}

/* KV buffer 3 is host memory while the layout says CUDA. */
static void test_cuda_declared_host_buffer_is_refused(void)
{
    lay_t y;
    char want[160];
    lay_init(&y);
    declare_kv_device(0, NKV - 1);
    y.l.mem_kind = KVF_MEM_CUDA;
    CHECK_EQ_INT(try_register(&y), KVF_ERR_INVALID_PARAM);
    snprintf(want, sizeof(want), "KV buffer 3 (layer 1 V) at %p is host memory, but the "
             "layout says CUDA device 0", (void *)kvmem[3]);
    CHECK_STR_CONTAINS(kvf_last_error(), want);
}

/* A device pointer declared as host is refused, never dereferenced. */
static void test_device_pointer_declared_host_is_refused(void)
{
    lay_t y;
    lay_init(&y);
    fake.reset();
    fake.add(auxmem, sizeof(auxmem), 0);
    CHECK_EQ_INT(try_register(&y), KVF_ERR_INVALID_PARAM);
    CHECK_STR_CONTAINS(kvf_last_error(), "aux buffer 0 at");
    CHECK_STR_CONTAINS(kvf_last_error(), "is memory of CUDA device 0, but the layout says "
                                         "host memory");
    fake.reset();
    fake.add(kvmem[1], sizeof(kvmem[1]), 0);
    CHECK_EQ_INT(try_register(&y), KVF_ERR_INVALID_PARAM);
    CHECK_STR_CONTAINS(kvf_last_error(), "KV buffer 1 (layer 0 V)");
}

static void test_wrong_device_is_refused(void)
{
    lay_t y;
    lay_init(&y);
    declare_kv_device(1, NKV);
    y.l.mem_kind = KVF_MEM_CUDA;
    CHECK_EQ_INT(try_register(&y), KVF_ERR_INVALID_PARAM);
    CHECK_STR_CONTAINS(kvf_last_error(), "is memory of CUDA device 1, but the layout says "
                                         "CUDA device 0 (cuda_device)");
    y.l.cuda_device = 1;
#ifdef KVF_HAVE_CUDA
    CHECK_EQ_INT(try_register(&y), KVF_OK);
#else
    CHECK_EQ_INT(try_register(&y), KVF_ERR_UNSUPPORTED);   /* checked, then no copier */
#endif
}

/* SGLang's split: KV on the GPU, aux in host memory. */
static void test_kv_device_aux_host(void)
{
    lay_t y;
    lay_init(&y);
    declare_kv_device(0, NKV);
    y.l.mem_kind = KVF_MEM_CUDA;
#ifdef KVF_HAVE_CUDA
    CHECK_EQ_INT(try_register(&y), KVF_OK);
#else
    CHECK_EQ_INT(try_register(&y), KVF_ERR_UNSUPPORTED);
    CHECK_STR_CONTAINS(kvf_last_error(), "built without CUDA");
#endif
    /* A caller of the first layout size declared one kind for all: aux too. */
    y.l.size = KVF_FIELD_END(kvf_layout_t, state_groups);
    CHECK_EQ_INT(try_register(&y), KVF_ERR_INVALID_PARAM);
    CHECK_STR_CONTAINS(kvf_last_error(), "aux buffer 0 at");
    y.l.size = sizeof(y.l);
    y.l.aux_mem_kind = (kvf_mem_kind_t)7;
    CHECK_EQ_INT(try_register(&y), KVF_ERR_INVALID_PARAM);
    CHECK_STR_CONTAINS(kvf_last_error(), "unknown memory kind 7 for the aux buffers");
}

/* In a child pointed at no driver (the driver loads once per process). */
static void test_child_no_driver(void)
{
    if (getenv("KVF_TEST_NO_DRIVER") == NULL)
        return;
    lay_t y;
    lay_init(&y);
    CHECK_EQ_INT(try_register(&y), KVF_OK);     /* host memory: not asked */
    y.l.mem_kind = KVF_MEM_CUDA;
    CHECK_EQ_INT(try_register(&y), KVF_ERR_UNSUPPORTED);
    CHECK_STR_CONTAINS(kvf_last_error(), "declares CUDA device memory, but there is no "
                                         "usable CUDA driver in this process (no CUDA driver:");
}

static void test_no_driver(void)
{
    pid_t pid = fork();
    if (pid == 0) {
        setenv("KVF_TEST_NO_DRIVER", "1", 1);
        setenv("KVF_CUDA_DRIVER", "/nonexistent/libcuda.so.1", 1);
        execl("/proc/self/exe", "test_memkind", "test_child_no_driver", (char *)NULL);
        _exit(127);
    }
    int status = 0;
    CHECK(pid > 0 && waitpid(pid, &status, 0) == pid);
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
}

int main(int argc, char **argv)
{
    if (getenv("KVF_TEST_NO_DRIVER") == NULL && !fake_cuda_load(&fake)) {
        printf("cannot load the fake CUDA driver %s: %s\n", KVF_FAKE_CUDA, dlerror());
        return 1;
    }
    kvf_test_case_t cases[] = {
        KVF_CASE(test_cuda_declared_host_buffer_is_refused),
        KVF_CASE(test_device_pointer_declared_host_is_refused),
        KVF_CASE(test_wrong_device_is_refused),
        KVF_CASE(test_kv_device_aux_host),
        KVF_CASE(test_child_no_driver),
        KVF_CASE(test_no_driver),
    };
    return kvf_test_run(cases, sizeof(cases) / sizeof(cases[0]), argc, argv);
}
