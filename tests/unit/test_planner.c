/* The planner's coalescing and containment checks, and the room map. */
#include <stdint.h>
#include <stdlib.h>

#include "core/planner.h"
#include "unit/kvf_test.h"
#include "util/map.h"

static void test_contiguous_is_one_run(void)
{
    uint32_t src[100], dst[100];
    kvf_run_t runs[100];
    for (int i = 0; i < 100; i++) {
        src[i] = 1000 + (uint32_t)i;
        dst[i] = 7 + (uint32_t)i;
    }
    CHECK_EQ_INT(kvf__plan_runs(src, dst, 100, 1000, runs), 1);
    CHECK_EQ_INT(runs[0].src, 1000);
    CHECK_EQ_INT(runs[0].dst, 7);
    CHECK_EQ_INT(runs[0].count, 100);
}

static void test_runs_break_where_either_side_jumps(void)
{
    uint32_t src[6] = {1, 2, 3, 4, 5, 6};
    uint32_t dst[6] = {10, 11, 20, 21, 22, 5};
    kvf_run_t runs[6];
    CHECK_EQ_INT(kvf__plan_runs(src, dst, 6, 1000, runs), 3);
    CHECK_EQ_INT(runs[0].count, 2);
    CHECK_EQ_INT(runs[1].src, 3);
    CHECK_EQ_INT(runs[1].dst, 20);
    CHECK_EQ_INT(runs[1].count, 3);
    CHECK_EQ_INT(runs[2].count, 1);
    uint32_t s2[3] = {5, 6, 9}, d2[3] = {1, 3, 4};
    CHECK_EQ_INT(kvf__plan_runs(s2, d2, 3, 1000, runs), 3);
}

static void test_run_length_capped(void)
{
    uint32_t src[10], dst[10];
    kvf_run_t runs[10];
    for (int i = 0; i < 10; i++)
        src[i] = dst[i] = (uint32_t)i;
    CHECK_EQ_INT(kvf__plan_runs(src, dst, 10, 4, runs), 3);
    CHECK_EQ_INT(runs[2].count, 2);
    CHECK_EQ_INT(kvf__plan_runs(src, dst, 0, 4, runs), 0);
}

static void test_pages_contain(void)
{
    uint32_t s[] = {2, 3, 4, 8, 10, 11};
    CHECK(kvf__pages_contain(s, 6, 2, 4));
    CHECK(kvf__pages_contain(s, 6, 3, 3));
    CHECK(kvf__pages_contain(s, 6, 10, 11));
    CHECK(!kvf__pages_contain(s, 6, 4, 8));     /* 5..7 missing */
    CHECK(!kvf__pages_contain(s, 6, 1, 2));
    CHECK(!kvf__pages_contain(s, 6, 11, 12));
    CHECK(!kvf__pages_contain(s, 6, 9, 9));
    CHECK(!kvf__pages_contain(s, 6, 5, 4));
    CHECK(!kvf__pages_contain(s, 0, 0, 0));
    CHECK(!kvf__pages_contain(s, 6, UINT64_MAX - 1, UINT64_MAX));
}

static void test_map(void)
{
    kvf_map_t m;
    kvf_map_init(&m);
    CHECK(kvf_map_get(&m, 5) == NULL);
    CHECK(kvf_map_del(&m, 5) == NULL);
    enum { N = 20000 };
    static int vals[N];
    for (int i = 0; i < N; i++)
        CHECK_EQ_INT(kvf_map_put(&m, (uint64_t)i * 7919u, &vals[i]), 0);
    CHECK_EQ_INT(m.count, N);
    for (int i = 0; i < N; i += 2)
        CHECK(kvf_map_del(&m, (uint64_t)i * 7919u) == &vals[i]);
    int bad = 0;
    for (int i = 0; i < N; i++) {
        void *v = kvf_map_get(&m, (uint64_t)i * 7919u);
        bad += (i % 2 == 0) ? v != NULL : v != &vals[i];
    }
    CHECK_EQ_INT(bad, 0);
    CHECK_EQ_INT(m.count, N / 2);
    /* kvf_map_next yields each value left once (the odd ones). */
    static unsigned char seen[N];
    size_t pos = 0, n = 0;
    for (int *v; (v = kvf_map_next(&m, &pos)) != NULL; n++) {
        bad += (v - vals) % 2 == 0 || seen[v - vals];
        seen[v - vals] = 1;
    }
    CHECK_EQ_INT(bad, 0);
    CHECK_EQ_INT(n, N / 2);
    kvf_map_free(&m);
    pos = 0;
    CHECK(kvf_map_next(&m, &pos) == NULL);

    /* Full up to the growth threshold: replacing a value must not grow
     * the table (a caller swapping a chain head relies on it never
     * failing); inserting a new key does. */
    kvf_map_init(&m);
    for (int i = 0; m.cap == 0 || (m.count + 1) * 4 <= m.cap * 3; i++)
        CHECK_EQ_INT(kvf_map_put(&m, (uint64_t)i, &vals[i]), 0);
    size_t cap = m.cap;
    CHECK_EQ_INT(kvf_map_put(&m, 0, &vals[1]), 0);
    CHECK_EQ_INT(m.cap, cap);
    CHECK(kvf_map_get(&m, 0) == &vals[1]);
    CHECK_EQ_INT(kvf_map_put(&m, 99999, &vals[2]), 0);
    CHECK(m.cap > cap);
    kvf_map_free(&m);
}

KVF_TEST_MAIN(KVF_CASE(test_contiguous_is_one_run),
              KVF_CASE(test_runs_break_where_either_side_jumps),
              KVF_CASE(test_run_length_capped), KVF_CASE(test_pages_contain),
              KVF_CASE(test_map))
