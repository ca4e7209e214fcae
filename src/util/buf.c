#include "util/buf.h"

#include <stdlib.h>

void kvf_buf_init(kvf_buf_t *b)
{
    b->data = NULL;
    b->len = b->cap = 0;
}

void kvf_buf_free(kvf_buf_t *b)
{
    free(b->data);
    kvf_buf_init(b);
}

kvf_status_t kvf_buf_reserve(kvf_buf_t *b, size_t extra)
{
    if (b->cap - b->len >= extra)
        return KVF_OK;
    size_t cap = b->cap ? b->cap : 256;
    while (cap - b->len < extra) {
        if (cap > SIZE_MAX / 2)
            return KVF_ERR_NO_MEMORY;
        cap *= 2;
    }
    uint8_t *p = realloc(b->data, cap);
    if (p == NULL)
        return KVF_ERR_NO_MEMORY;
    b->data = p;
    b->cap = cap;
    return KVF_OK;
}

kvf_status_t kvf_buf_append(kvf_buf_t *b, const void *p, size_t n)
{
    kvf_status_t st = kvf_buf_reserve(b, n);
    if (st != KVF_OK)
        return st;
    if (n)
        memcpy(b->data + b->len, p, n);
    b->len += n;
    return KVF_OK;
}

void kvf_buf_consume(kvf_buf_t *b, size_t n)
{
    if (n >= b->len) {
        b->len = 0;
        return;
    }
    memmove(b->data, b->data + n, b->len - n);
    b->len -= n;
}
