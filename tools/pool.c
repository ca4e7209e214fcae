/* Page free lists (see pool.h). */
#include "pool.h"

#include <stdlib.h>

#include "pattern.h"

int kvt_pool_init(kvt_pool_t *p, uint32_t n, int scatter, uint64_t seed)
{
    p->free = malloc((size_t)(n ? n : 1) * sizeof(uint32_t));
    if (!p->free)
        return -1;
    /* Descending, so that the LIFO pops 0, 1, 2, ... */
    for (uint32_t i = 0; i < n; i++)
        p->free[i] = n - 1 - i;
    p->nfree = p->cap = n;
    p->scatter = scatter;
    p->rng = seed;
    return 0;
}

void kvt_pool_fini(kvt_pool_t *p)
{
    free(p->free);
    p->free = NULL;
    p->nfree = p->cap = 0;
}

int kvt_pool_take(kvt_pool_t *p, uint32_t n, uint32_t *out)
{
    if (n > p->nfree)
        return -1;
    for (uint32_t i = 0; i < n; i++) {
        uint32_t at = p->nfree - 1;
        if (p->scatter) {
            /* Swap-remove a random free index. */
            uint32_t r = (uint32_t)(kvt_splitmix64(&p->rng) % p->nfree);
            uint32_t t = p->free[r];
            p->free[r] = p->free[at];
            p->free[at] = t;
        }
        out[i] = p->free[at];
        p->nfree--;
    }
    return 0;
}

void kvt_pool_give(kvt_pool_t *p, const uint32_t *idx, uint32_t n)
{
    /* Reverse order, so the next LIFO take returns the same run in order. */
    for (uint32_t i = n; i-- > 0;)
        p->free[p->nfree++] = idx[i];
}
