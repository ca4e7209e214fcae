/*
 * Fuzz the engine descriptor parser (core/descriptor.c): descriptors come
 * from the application's metadata (vLLM's kv_transfer_params, through a
 * proxy), so a decode engine parses whatever it is handed.
 *
 * Besides the sanitizers, the oracle checks every descriptor the parser
 * accepts: its fields are within the documented ranges, its address is
 * not the wildcard in any spelling (IPv4-mapped included), and written
 * back in the documented format it parses again to the same fields.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <netinet/in.h>

#include "core/descriptor.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static int same(const kvf_descriptor_t *a, const kvf_descriptor_t *b)
{
    return a->instance == b->instance && !strcmp(a->addr, b->addr) &&
           !strcmp(a->host, b->host) && a->port == b->port && a->role == b->role &&
           a->tp_rank == b->tp_rank && a->tp_size == b->tp_size &&
           a->pp_rank == b->pp_rank && a->pp_size == b->pp_size &&
           a->dp_rank == b->dp_rank && a->dp_size == b->dp_size &&
           a->page_size == b->page_size && !strcmp(a->dtype, b->dtype) &&
           a->attn == b->attn && a->total_heads == b->total_heads;
}

/* 0.0.0.0, ::, ::ffff:0.0.0.0: what a decode engine cannot dial, judged by
 * the bytes rather than by the parser's own rule. */
static int wildcard(const struct sockaddr_storage *sa)
{
    static const uint8_t zero[16], mapped[16] = {[10] = 0xff, [11] = 0xff};
    if (sa->ss_family == AF_INET)
        return ((const struct sockaddr_in *)sa)->sin_addr.s_addr == 0;
    if (sa->ss_family != AF_INET6)
        return 1;
    const uint8_t *a = ((const struct sockaddr_in6 *)sa)->sin6_addr.s6_addr;
    return memcmp(a, zero, 16) == 0 || memcmp(a, mapped, 16) == 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char text[KVF_DESCRIPTOR_MAX + 64], again[2 * KVF_DESCRIPTOR_MAX], err[256];
    kvf_descriptor_t d, e;

    if (size >= sizeof(text))
        return 0;
    memcpy(text, data, size);
    text[size] = '\0';
    if (kvf__descriptor_parse(text, &d, err, sizeof(err)) != KVF_OK) {
        if (err[0] == '\0')
            abort();                       /* a refusal always says why */
        return 0;
    }
    if (d.instance == 0 || d.port < 1 || d.port > 65535 || d.page_size == 0 ||
        d.tp_rank < 0 || d.tp_rank >= d.tp_size || d.tp_size > 4096 ||
        d.pp_rank < 0 || d.pp_rank >= d.pp_size || d.pp_size > 1024 ||
        d.dp_rank < 0 || d.dp_rank >= d.dp_size || d.dp_size > 65536 ||
        d.total_heads > 65536 || d.dtype[0] == '\0' ||
        strchr(d.addr, ' ') != NULL || strchr(d.addr, '"') != NULL || wildcard(&d.sa))
        abort();
    snprintf(again, sizeof(again), "kvf1 id=%016llx addr=%s role=%s tp=%d/%d pp=%d/%d "
             "dp=%d/%d page=%u dtype=%s attn=%s heads=%u", (unsigned long long)d.instance,
             d.addr, d.role == KVF_ROLE_PREFILL ? "prefill" : "decode", d.tp_rank,
             d.tp_size, d.pp_rank, d.pp_size, d.dp_rank, d.dp_size, d.page_size, d.dtype,
             d.attn == KVF_ATTN_MLA ? "mla" : "mha", d.total_heads);
    if (strlen(again) < KVF_DESCRIPTOR_MAX &&
        (kvf__descriptor_parse(again, &e, err, sizeof(err)) != KVF_OK || !same(&d, &e)))
        abort();
    return 0;
}
