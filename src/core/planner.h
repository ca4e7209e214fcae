/*
 * Transfer planning: turn (source page, destination page) pairs into runs,
 * where both sides advance by one page at a time.  A run becomes one
 * segment per KV buffer, so contiguous pages on both sides cost one
 * segment however long they are, and scattered pages cost one per page.
 */
#ifndef KVF_CORE_PLANNER_H
#define KVF_CORE_PLANNER_H

#include <stddef.h>
#include <stdint.h>

typedef struct kvf_run {
    uint32_t src;     /* first source page */
    uint32_t dst;     /* first destination page */
    uint32_t count;   /* pages */
} kvf_run_t;

/*
 * Coalesce src[i] -> dst[i] (i < n) into runs, none longer than max_pages.
 * `runs` must have room for n entries.  @return the number of runs.
 */
size_t kvf__plan_runs(const uint32_t *src, const uint32_t *dst, size_t n,
                      uint32_t max_pages, kvf_run_t *runs);

/*
 * Is every page of [first, last] in `sorted` (ascending, no duplicates)?
 * O(log n + span).  The receiver's check that a write lands only inside
 * the pages its room declared.
 */
int kvf__pages_contain(const uint32_t *sorted, size_t n, uint64_t first,
                       uint64_t last);

#endif /* KVF_CORE_PLANNER_H */
