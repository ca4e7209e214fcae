/*
 * Lookup of [addr, addr+len) in a sorted array of memory regions.
 *
 * Pull transports check every address a peer names against the regions
 * that peer registered before they read a byte; the arrays are short (one
 * region per registered buffer) and searched once per segment, so a binary
 * search over an array sorted by base is enough.  Each element of the
 * array starts with `uint64_t base, len`; `stride` is the element size, so
 * a transport can keep its own per-region data behind them.
 */
#ifndef KVF_UTIL_REGION_H
#define KVF_UTIL_REGION_H

#include <stddef.h>
#include <stdint.h>

/* The index of the region of regs[0..n) (sorted by base) that contains all
 * of [addr, addr+len), or SIZE_MAX. */
static inline size_t kvf_region_find(const void *regs, size_t stride, size_t n,
                                     uint64_t addr, uint64_t len)
{
#define KVF_RBASE_(i) (*(const uint64_t *)((const char *)regs + (i) * stride))
#define KVF_RLEN_(i)  (*(const uint64_t *)((const char *)regs + (i) * stride + 8))
    size_t lo = 0, hi = n;   /* first index with base > addr */
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (KVF_RBASE_(mid) <= addr)
            lo = mid + 1;
        else
            hi = mid;
    }
    /* Usually the nearest region below; overlapping ones are searched on. */
    for (size_t i = lo; i-- > 0;)
        if (addr - KVF_RBASE_(i) <= KVF_RLEN_(i) &&
            len <= KVF_RLEN_(i) - (addr - KVF_RBASE_(i)))
            return i;
    return SIZE_MAX;
#undef KVF_RBASE_
#undef KVF_RLEN_
}

#endif /* KVF_UTIL_REGION_H */
