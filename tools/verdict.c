/*
 * One room's rules across its ranks (see verdict.h).  The one-cause rule
 * needs no knowledge of reason texts beyond this: a rank is named by its
 * control address, host:port, which every reason about a peer carries
 * (kvf__peer_name: "prefill rank 0 (127.0.0.1:41000)").
 */
#include "verdict.h"

#include <ctype.h>
#include <stdio.h>
#include <string.h>
#include <strings.h>

#include "kvferry/kvferry.h"

#define KVT_NAMES_MAX 16
#define KVT_ADDR_LEN  64

static int kvt_addr_char(char c)
{
    return isalnum((unsigned char)c) || c == '.' || c == '-' || c == '_';
}

int kvt_reason_names(const char *reason, const char *addr)
{
    size_t n = strlen(addr);
    if (n == 0)
        return 0;
    for (const char *p = strstr(reason, addr); p != NULL; p = strstr(p + 1, addr))
        if ((p == reason || !kvt_addr_char(p[-1])) && !isdigit((unsigned char)p[n]))
            return 1;
    return 0;
}

/* The host:port tokens of a reason, at most max of them. */
static size_t kvt_reason_addrs(const char *reason, char out[][KVT_ADDR_LEN], size_t max)
{
    size_t n = 0;
    for (const char *c = strchr(reason, ':'); c != NULL && n < max; c = strchr(c + 1, ':')) {
        const char *end = c + 1, *start = c;
        while (isdigit((unsigned char)*end))
            end++;
        while (start > reason && kvt_addr_char(start[-1]))
            start--;
        if (end == c + 1 || end - c > 6 || start == c || isalnum((unsigned char)*end) ||
            (size_t)(end - start) >= KVT_ADDR_LEN)
            continue;
        snprintf(out[n++], KVT_ADDR_LEN, "%.*s", (int)(end - start), start);
    }
    return n;
}

static const char *kvt_field(json_t *f, const char *key)
{
    const char *s = json_string_value(json_object_get(f, key));
    return s ? s : "";
}

static int kvt_names(json_t *f, const char *addr)
{
    return strcmp(kvt_field(f, "origin_addr"), addr) == 0 ||
           kvt_reason_names(kvt_field(f, "reason"), addr);
}

static const char *kvt_side(const kvt_rank_view_t *v)
{
    return v->prefill ? "prefill" : "decode";
}

/* "prefill[0] Failed, decode[1] Success, ..." */
static void kvt_states(const kvt_rank_view_t *v, size_t n, char *buf, size_t len)
{
    size_t at = 0;
    buf[0] = '\0';
    for (size_t i = 0; i < n && at < len; i++)
        at += (size_t)snprintf(buf + at, len - at, "%s%s[%u] %s%s", i ? ", " : "",
                               kvt_side(&v[i]), v[i].rank,
                               v[i].state < 0 ? "not reported"
                                              : kvf_poll_name((kvf_poll_t)v[i].state),
                               v[i].gone ? " (killed)" : "");
}

int kvt_verdict_one_state(const kvt_rank_view_t *v, size_t n, char *why, size_t len)
{
    unsigned failed = 0, succeeded = 0, gone = 0;   /* a bit per side: 1 prefill, 2 decode */
    for (size_t i = 0; i < n; i++) {
        unsigned side = v[i].prefill ? 1u : 2u;
        if (v[i].gone)
            gone |= side;
        else if (v[i].state == KVF_POLL_FAILED)
            failed |= side;
        else if (v[i].state == KVF_POLL_SUCCESS)
            succeeded |= side;
    }
    if (!failed || !succeeded)
        return 1;
    /* The exception: each side agrees, the failed one names a cause of its
     * own side, and the one that succeeded lost no rank. */
    int ok = (failed == 1 || failed == 2) && (failed & succeeded) == 0 && !(gone & succeeded);
    for (size_t i = 0; ok && i < n; i++)
        if (!v[i].gone && v[i].state == KVF_POLL_FAILED)
            ok = strcmp(kvt_field(v[i].failure, "origin_side"), kvt_side(&v[i])) == 0;
    if (ok)
        return 1;
    char states[512];
    kvt_states(v, n, states, sizeof(states));
    snprintf(why, len, "its ranks disagree: %s (every rank of a request ends as the others "
             "do; only a side that had every byte may keep SUCCESS when the other side "
             "failed after it, for a cause of its own)", states);
    return 0;
}

int kvt_verdict_one_cause(const kvt_rank_view_t *v, size_t n, char *common,
                          size_t common_len, char *why, size_t len)
{
    char cand[KVT_NAMES_MAX + 1][KVT_ADDR_LEN];
    size_t ncand = 0;
    common[0] = '\0';
    for (size_t i = 0; i < n; i++) {
        if (v[i].state != KVF_POLL_FAILED || v[i].gone)
            continue;
        const char *reason = kvt_field(v[i].failure, "reason");
        if (reason[0] == '\0' || strcasestr(reason, "unknown reason") != NULL) {
            snprintf(why, len, "%s[%u] FAILED %s", kvt_side(&v[i]), v[i].rank,
                     reason[0] ? "for an \"unknown reason\": every rank must name the "
                                 "root cause"
                               : "without a reason");
            return 0;
        }
        if (ncand == 0 && !v[i].stopped) {   /* the first record's names: candidates */
            snprintf(cand[0], KVT_ADDR_LEN, "%s", kvt_field(v[i].failure, "origin_addr"));
            ncand = 1 + kvt_reason_addrs(reason, cand + 1, KVT_NAMES_MAX);
        }
    }
    if (ncand == 0)
        return 1;
    for (size_t c = 0; c < ncand; c++) {
        size_t i = 0;
        while (i < n && (v[i].state != KVF_POLL_FAILED || v[i].gone || v[i].stopped ||
                         kvt_names(v[i].failure, cand[c])))
            i++;
        if (i == n && cand[c][0] != '\0') {
            snprintf(common, common_len, "%s", cand[c]);
            return 1;
        }
    }
    size_t at = (size_t)snprintf(why, len, "its failure records name no rank in common:");
    for (size_t i = 0; i < n && at < len; i++)
        if (v[i].state == KVF_POLL_FAILED && !v[i].gone)
            at += (size_t)snprintf(why + at, len - at, " %s[%u] from %s: \"%.120s\";",
                                   kvt_side(&v[i]), v[i].rank,
                                   kvt_field(v[i].failure, "origin_addr"),
                                   kvt_field(v[i].failure, "reason"));
    return 0;
}
