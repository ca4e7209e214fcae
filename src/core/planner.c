#include "core/planner.h"

size_t kvf__plan_runs(const uint32_t *src, const uint32_t *dst, size_t n,
                      uint32_t max_pages, kvf_run_t *runs)
{
    size_t nr = 0;

    if (max_pages == 0)
        max_pages = 1;
    for (size_t i = 0; i < n; i++) {
        kvf_run_t *r = nr ? &runs[nr - 1] : NULL;
        if (r != NULL && r->count < max_pages &&
            (uint64_t)r->src + r->count == src[i] &&
            (uint64_t)r->dst + r->count == dst[i]) {
            r->count++;
            continue;
        }
        runs[nr++] = (kvf_run_t){.src = src[i], .dst = dst[i], .count = 1};
    }
    return nr;
}

int kvf__pages_contain(const uint32_t *sorted, size_t n, uint64_t first,
                       uint64_t last)
{
    size_t lo = 0, hi = n;

    if (first > last)
        return 0;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (sorted[mid] < first)
            lo = mid + 1;
        else
            hi = mid;
    }
    uint64_t span = last - first;
    if (lo + span >= n)
        return 0;
    /* Sorted and unique: the span is covered iff its ends are. */
    return sorted[lo] == first && sorted[lo + span] == last;
}
