/*
 * Engine descriptors: what a decode engine needs to reach a prefill
 * engine without a registry (vLLM's flow carries them in its
 * kv_transfer_params), and room keys for an application's request ids.
 *
 * A descriptor is one line of text, so that it travels as a JSON string:
 *
 *   kvf1 id=<16 hex> addr=<ip:port> role=prefill|decode tp=<rank>/<size>
 *        pp=<rank>/<size> dp=<rank>/<size> page=<tokens> dtype=<name>
 *        attn=mha|mla heads=<model's KV heads>
 *
 * (one line; fields separated by one space).  A reader takes the fields in
 * any order, needs each of these once and skips fields it does not know,
 * so that later versions may add some.  Nothing in it is trusted beyond
 * picking the ranks to dial: the handshake checks each peer is the engine
 * instance its descriptor names, and the layouts, as for any peer.
 */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <xxhash.h>

#include "bootstrap/bootstrap.h"
#include "core/descriptor.h"
#include "core/engine.h"
#include "core/sync.h"
#include "util/log.h"

static int dtype_ok(const char *v);

kvf_room_key_t kvf_room_key(const void *request_id, size_t len)
{
    XXH128_hash_t h = XXH3_128bits(len ? request_id : "", len);
    kvf_room_key_t k = {h.low64, h.high64 ? h.high64 : 1};
    return k;
}

/*
 * A numeric address into *sa (port 0).  @return 0 for a host name, which a
 * descriptor does not carry: a reader would resolve it with the engine
 * lock held.
 */
static int numeric_host(const char *host, struct sockaddr_storage *sa)
{
    struct sockaddr_in *in = (struct sockaddr_in *)sa;
    struct sockaddr_in6 *in6 = (struct sockaddr_in6 *)sa;
    memset(sa, 0, sizeof(*sa));
    if (inet_pton(AF_INET, host, &in->sin_addr) == 1) {
        in->sin_family = AF_INET;
        return 1;
    }
    if (inet_pton(AF_INET6, host, &in6->sin6_addr) == 1) {
        in6->sin6_family = AF_INET6;
        return 1;
    }
    return 0;
}

/* Why a decode engine cannot dial this IPv4 address (host order), or NULL. */
static const char *unusable_v4(uint32_t a)
{
    if (a == 0)
        return "the wildcard address";
    if ((a >> 24) == 0)
        return "in 0.0.0.0/8, which names no host";
    if ((a >> 28) == 0xe)
        return "a multicast address";
    if (a == 0xffffffffu)
        return "the broadcast address";
    return NULL;
}

/*
 * Why a decode engine cannot dial this address, or NULL.  Every spelling
 * counts: "0.0.0.0", "::", "[::0]", "::ffff:0.0.0.0" and "::ffff:0:0"
 * are the one wildcard, and an IPv4-mapped address is judged by its IPv4.
 */
static const char *unusable_host(const struct sockaddr_storage *sa)
{
    if (sa->ss_family == AF_INET)
        return unusable_v4(ntohl(((const struct sockaddr_in *)sa)->sin_addr.s_addr));
    const struct in6_addr *a = &((const struct sockaddr_in6 *)sa)->sin6_addr;
    uint32_t v4;
    memcpy(&v4, a->s6_addr + 12, 4);
    if (IN6_IS_ADDR_UNSPECIFIED(a))
        return "the wildcard address";
    if (IN6_IS_ADDR_V4MAPPED(a))
        return unusable_v4(ntohl(v4));
    if (IN6_IS_ADDR_V4COMPAT(a))
        return "an IPv4-compatible IPv6 address (deprecated by RFC 4291; nothing routes it)";
    if (IN6_IS_ADDR_MULTICAST(a))
        return "a multicast address";
    if (IN6_IS_ADDR_LINKLOCAL(a))
        return "a link-local address (it needs an interface, which a descriptor cannot "
               "name)";
    return NULL;
}

kvf_status_t kvf_engine_descriptor(const kvf_engine_t *engine, char *buf, size_t len)
{
    kvf_engine_t *eng = (kvf_engine_t *)engine;
    const kvf_engine_params_t *p = &eng->params;
    const kvf_layout_int_t *l = &eng->layout;
    struct sockaddr_storage sa;
    kvf_status_t st = KVF_OK;
    int n = 0;

    if (eng == NULL || buf == NULL)
        return KVF_ERR_INVALID_PARAM;
    const char *why = numeric_host(eng->host, &sa) ? unusable_host(&sa)
                                                   : "a name, not a numeric address";
    if (why != NULL) {
        kvf_error("kvf_engine_descriptor: the engine listens on \"%s\" (%s), which a "
                  "decode engine cannot dial from a descriptor: set host (KVF_HOST) to the "
                  "numeric address decode engines reach this one at", eng->host, why);
        return KVF_ERR_UNSUPPORTED;
    }
    /* Under the lock: a decode engine adopts its heads from its first peer. */
    kvf__lock(eng);
    if (!eng->registered) {
        kvf_error("kvf_engine_descriptor: register the engine's layout first");
        st = KVF_ERR_STATE;
    } else if (!dtype_ok(l->kv_dtype)) {
        kvf_error("kvf_engine_descriptor: the layout's kv_dtype \"%s\" has characters a "
                  "descriptor cannot carry (letters, digits, '_', '-', '.')", l->kv_dtype);
        st = KVF_ERR_UNSUPPORTED;
    } else {
        int v6 = sa.ss_family == AF_INET6;
        n = snprintf(buf, len, "kvf1 id=%016llx addr=%s%s%s:%d role=%s tp=%d/%d pp=%d/%d "
                     "dp=%d/%d page=%u dtype=%s attn=%s heads=%u",
                     (unsigned long long)eng->instance_id, v6 ? "[" : "", eng->host,
                     v6 ? "]" : "", eng->port, kvf_role_name(p->role), p->tp_rank,
                     p->tp_size, p->pp_rank, p->pp_size, p->dp_rank, p->dp_size,
                     l->page_size, l->kv_dtype, l->attn == KVF_ATTN_MLA ? "mla" : "mha",
                     l->total_heads);
    }
    kvf__unlock(eng);
    if (st == KVF_OK && (n < 0 || (size_t)n >= len)) {
        kvf_error("kvf_engine_descriptor: %zu bytes given, %d needed (KVF_DESCRIPTOR_MAX "
                  "always suffices)", len, n + 1);
        st = KVF_ERR_INVALID_PARAM;
    }
    return st;
}

/* "r/n" with 0 <= r < n <= max. */
/* Digits only: strtol would also take leading blanks and a sign ("\n-1"). */
static int parse_coord(const char *v, int max, int *rank, int *size)
{
    char *end;
    if (v[0] < '0' || v[0] > '9')
        return 0;
    long r = strtol(v, &end, 10);
    if (*end != '/')
        return 0;
    const char *s = end + 1;
    if (s[0] < '0' || s[0] > '9')
        return 0;
    long n = strtol(s, &end, 10);
    if (*end != '\0' || n < 1 || n > max || r >= n)
        return 0;
    *rank = (int)r;
    *size = (int)n;
    return 1;
}

static int parse_u32(const char *v, uint32_t max, uint32_t *out)
{
    char *end;
    if (v[0] < '0' || v[0] > '9')
        return 0;
    unsigned long long x = strtoull(v, &end, 10);
    if (*end != '\0' || x > max)
        return 0;
    *out = (uint32_t)x;
    return 1;
}

/* The dtype's characters (layout.c accepts any printable name; a
 * descriptor carries only what stays a plain JSON string). */
static int dtype_ok(const char *v)
{
    size_t n = strlen(v);
    if (n == 0 || n >= sizeof(((kvf_descriptor_t *)0)->dtype))
        return 0;
    for (const char *c = v; *c; c++)
        if (!((*c >= 'a' && *c <= 'z') || (*c >= 'A' && *c <= 'Z') ||
              (*c >= '0' && *c <= '9') || *c == '_' || *c == '-' || *c == '.'))
            return 0;
    return 1;
}

enum { F_ID, F_ADDR, F_ROLE, F_TP, F_PP, F_DP, F_PAGE, F_DTYPE, F_ATTN, F_HEADS, F_COUNT };
static const char *const field_names[F_COUNT] = {
    "id", "addr", "role", "tp", "pp", "dp", "page", "dtype", "attn", "heads"};

/* One field's value into d.  @return 1, or 0 (and *why_p, when there is
 * more to say than "not valid"). */
static int parse_field(kvf_descriptor_t *d, int f, const char *v, const char **why_p)
{
    char *end;
    switch (f) {
    case F_ID:
        if (strlen(v) != 16 || strspn(v, "0123456789abcdef") != 16)
            return 0;
        d->instance = strtoull(v, &end, 16);
        return d->instance != 0;
    case F_ADDR:
        /* A numeric IPv4 or [IPv6] address a decode engine can dial, and the port. */
        if (strlen(v) >= sizeof(d->addr) ||
            strspn(v, "0123456789abcdefABCDEF.:[]") != strlen(v) ||
            kvf__split_addr(v, d->host, sizeof(d->host), &d->port) != KVF_OK ||
            d->port == 0 || !numeric_host(d->host, &d->sa))
            return 0;
        if ((*why_p = unusable_host(&d->sa)) != NULL)
            return 0;
        memcpy(d->addr, v, strlen(v) + 1);
        return 1;
    case F_ROLE:
        if (strcmp(v, "prefill") != 0 && strcmp(v, "decode") != 0)
            return 0;
        d->role = v[0] == 'p' ? KVF_ROLE_PREFILL : KVF_ROLE_DECODE;
        return 1;
    case F_TP:
        return parse_coord(v, 4096, &d->tp_rank, &d->tp_size);
    case F_PP:
        return parse_coord(v, 1024, &d->pp_rank, &d->pp_size);
    case F_DP:
        return parse_coord(v, 65536, &d->dp_rank, &d->dp_size);
    case F_PAGE:
        return parse_u32(v, UINT32_MAX, &d->page_size) && d->page_size > 0;
    case F_DTYPE:
        if (!dtype_ok(v))
            return 0;
        memcpy(d->dtype, v, strlen(v) + 1);
        return 1;
    case F_ATTN:
        if (strcmp(v, "mha") != 0 && strcmp(v, "mla") != 0)
            return 0;
        d->attn = v[1] == 'h' ? KVF_ATTN_MHA : KVF_ATTN_MLA;
        return 1;
    case F_HEADS:
        return parse_u32(v, 65536, &d->total_heads);
    }
    return 0;
}

kvf_status_t kvf__descriptor_parse(const char *text, kvf_descriptor_t *d, char *err,
                                   size_t errlen)
{
    char line[KVF_DESCRIPTOR_MAX];
    unsigned seen = 0;

    memset(d, 0, sizeof(*d));
    if (text == NULL || strnlen(text, sizeof(line)) == sizeof(line)) {
        snprintf(err, errlen, "%s", text == NULL ? "a NULL descriptor"
                 : "a descriptor longer than KVF_DESCRIPTOR_MAX");
        return KVF_ERR_INVALID_PARAM;
    }
    memcpy(line, text, strlen(text) + 1);
    if (strncmp(line, "kvf1 ", 5) != 0) {
        snprintf(err, errlen, "not a kvferry descriptor (it starts \"%.8s\", not \"kvf1 \")",
                 line);
        return KVF_ERR_INVALID_PARAM;
    }
    for (char *tok = line + 5, *next; tok != NULL; tok = next) {
        next = strchr(tok, ' ');
        if (next != NULL)
            *next++ = '\0';
        if (*tok == '\0') {
            snprintf(err, errlen, "an empty field: fields are separated by one space");
            return KVF_ERR_INVALID_PARAM;
        }
        char *eq = strchr(tok, '=');
        if (eq == NULL) {
            snprintf(err, errlen, "field \"%.32s\" has no '='", tok);
            return KVF_ERR_INVALID_PARAM;
        }
        *eq = '\0';
        int f = 0;
        while (f < F_COUNT && strcmp(tok, field_names[f]) != 0)
            f++;
        if (f == F_COUNT)
            continue;                    /* a later version's field */
        if (seen & (1u << f)) {
            snprintf(err, errlen, "field %s given twice", tok);
            return KVF_ERR_INVALID_PARAM;
        }
        const char *why = NULL;
        if (!parse_field(d, f, eq + 1, &why)) {
            snprintf(err, errlen, "field %s=\"%.64s\" is not valid%s%s", tok, eq + 1,
                     why ? ": " : "", why ? why : "");
            return KVF_ERR_INVALID_PARAM;
        }
        seen |= 1u << f;
    }
    for (int f = 0; f < F_COUNT; f++) {
        if (!(seen & (1u << f))) {
            snprintf(err, errlen, "field %s is missing", field_names[f]);
            return KVF_ERR_INVALID_PARAM;
        }
    }
    return KVF_OK;
}

/* ------------------------------------------------------------------------ */
/* Descriptor sets seen lately (kvf_receiver_create_remote)                  */
/* ------------------------------------------------------------------------ */

static uint64_t set_hash(const char *const *descs, size_t n, uint32_t heads)
{
    uint64_t h = XXH3_64bits(&heads, sizeof(heads));
    for (size_t i = 0; i < n; i++)        /* each one seeded by those before */
        h = XXH3_64bits_withSeed(descs[i], strlen(descs[i]) + 1, h);
    return h;
}

/* Is e the set (descs, n, heads)? */
static int set_is(const kvf_remote_seen_t *e, const char *const *descs, size_t n,
                  uint32_t heads)
{
    size_t at = sizeof(heads);
    if (e->key == NULL || e->key_len < at || memcmp(e->key, &heads, at) != 0)
        return 0;
    for (size_t i = 0; i < n; i++) {
        size_t len = strlen(descs[i]) + 1;
        if (e->key_len - at < len || memcmp(e->key + at, descs[i], len) != 0)
            return 0;
        at += len;
    }
    return at == e->key_len;
}

size_t kvf__remote_seen_get(kvf_engine_t *eng, const char *const *descs, size_t n,
                            uint32_t heads, void *out, size_t cap)
{
    uint64_t h = set_hash(descs, n, heads);
    size_t got = 0;
    pthread_mutex_lock(&eng->remote_lock);
    for (unsigned i = 0; i < KVF_REMOTE_SEEN && got == 0; i++) {
        const kvf_remote_seen_t *e = &eng->remote_seen[i];
        if (e->hash == h && set_is(e, descs, n, heads) && e->value_len <= cap) {
            memcpy(out, e->value, e->value_len);
            got = e->value_len;
            eng->remote_hits++;
        }
    }
    pthread_mutex_unlock(&eng->remote_lock);
    return got;
}

void kvf__remote_seen_put(kvf_engine_t *eng, const char *const *descs, size_t n,
                          uint32_t heads, const void *value, size_t len)
{
    size_t key_len = sizeof(heads);
    for (size_t i = 0; i < n; i++)
        key_len += strlen(descs[i]) + 1;
    char *key = malloc(key_len);
    void *val = malloc(len ? len : 1);
    if (key == NULL || val == NULL) {
        free(key);
        free(val);
        return;
    }
    memcpy(key, &heads, sizeof(heads));
    for (size_t i = 0, at = sizeof(heads); i < n; i++) {
        size_t l = strlen(descs[i]) + 1;
        memcpy(key + at, descs[i], l);
        at += l;
    }
    memcpy(val, value, len);
    uint64_t h = set_hash(descs, n, heads);
    pthread_mutex_lock(&eng->remote_lock);
    kvf_remote_seen_t *e = &eng->remote_seen[eng->remote_next];
    eng->remote_next = (eng->remote_next + 1) % KVF_REMOTE_SEEN;
    char *old_key = e->key;
    void *old_val = e->value;
    *e = (kvf_remote_seen_t){.hash = h, .key = key, .key_len = key_len, .value = val,
                             .value_len = len};
    pthread_mutex_unlock(&eng->remote_lock);
    free(old_key);
    free(old_val);
}

void kvf__remote_seen_free_unlocked(kvf_engine_t *eng)
{
    for (unsigned i = 0; i < KVF_REMOTE_SEEN; i++) {
        free(eng->remote_seen[i].key);
        free(eng->remote_seen[i].value);
    }
}
