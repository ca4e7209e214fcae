/*
 * Receiver: the decode side of a room.
 *
 * A receiver resolves its prefill ranks (resolver.c), sends each its
 * destination once every handshake is done (which ranks send what comes
 * from parallel.c), checks every inbound segment against the pages and
 * slots it declared before a byte is placed, and reaches SUCCESS when
 * every prefill rank has reported DONE with the byte count (and checksum)
 * it expects.  With shm and ucx it pulls the bytes itself (DATA_REF).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/auth.h"
#include "core/descriptor.h"
#include "core/resolver.h"
#include "core/room.h"
#include "core/sized.h"
#include "core/stage.h"
#include "core/sync.h"
#include "core/trace.h"
#include "transport/copier.h"
#include "util/log.h"
#include "util/time.h"

/* Free what only a receiver holds (its room is being freed). */
static void receiver_free(kvf_room_t *r)
{
    kvf_receiver_t *rv = receiver_of(r);
    free(atomic_exchange(&rv->given, NULL));   /* never taken in */
    free(rv->dest);                            /* taken in: its arrays */
    free(rv->bootstrap_addr);
    free(rv->targets);                         /* never listed */
}

kvf_status_t kvf_receiver_create(kvf_engine_t *eng, const char *bootstrap_addr,
                                 uint64_t room, int prefill_dp_rank,
                                 kvf_receiver_t **receiver_p)
{
    kvf_room_t *r;
    if (eng == NULL || receiver_p == NULL || bootstrap_addr == NULL ||
        strchr(bootstrap_addr, ':') == NULL || prefill_dp_rank < -1) {
        kvf_error("receiver: need an engine, a bootstrap address host:port and a "
                  "prefill DP rank >= -1");
        return KVF_ERR_INVALID_PARAM;
    }
    char *addr = strdup(bootstrap_addr);
    if (addr == NULL)
        return KVF_ERR_NO_MEMORY;
    kvf_status_t st = kvf__room_create(eng, &kvf_receiver_room_ops, room, &r);
    if (st != KVF_OK) {
        free(addr);
        return st;
    }
    kvf_receiver_t *rv = receiver_of(r);
    rv->dp_rank = prefill_dp_rank;
    rv->bootstrap_addr = addr;
    *receiver_p = (kvf_receiver_t *)r;
    kvf__room_submit(r);          /* a lane lists it: receiver_open */
    return KVF_OK;
}

void kvf__receiver_tell_failed(kvf_room_t *r)
{
    KVF_ASSERT_LOCKED(r->eng);
    if (room_state(r) != KVF_POLL_FAILED || r->failure == NULL)
        return;
    for (uint32_t i = 0; i < r->nlinks; i++) {
        kvf_link_t *lk = &r->links[i];
        if (!lk->fail_told)
            lk->fail_told = kvf__room_send_fail(r, lk->peer,
                                                r->failure->status == KVF_ERR_ABORTED);
    }
}

/* Link a resolved receiver to the n prefill ranks it reads from, and go
 * on with it (a failure fails the room). */
static void receiver_link(kvf_room_t *r, const kvf_target_t *t, int n)
{
    KVF_ASSERT_LOCKED(r->eng);
    kvf_engine_t *eng = r->eng;
    r->links = calloc((size_t)n, sizeof(kvf_link_t));
    if (r->links == NULL) {
        kvf__room_fail(r, KVF_ERR_NO_MEMORY, "no memory for the room's links");
        return;
    }
    for (int i = 0; i < n; i++) {
        kvf_peer_t *p = kvf__peer_get(eng, t[i].host, t[i].port, t[i].rank, 0);
        if (p == NULL) {
            kvf__room_fail(r, KVF_ERR_NO_MEMORY, "no memory for a peer");
            return;
        }
        r->links[i].peer = p;
        r->links[i].rank = (uint32_t)t[i].rank;
        r->links[i].want_instance = t[i].instance;
        p->refs++;
        r->nlinks++;
    }
    r->expected_links = r->nlinks;
    if (kvf__tracing(eng)) {
        kvf_trace_t tr;
        char list[512] = "";
        for (int i = 0; i < n; i++)
            snprintf(list + strlen(list), sizeof(list) - strlen(list), "%s%s:%d",
                     i ? "," : "", t[i].host, t[i].port);
        kvf__trace_begin(&tr, r, "resolved");
        kvf__trace_u64(&tr, "ranks", (uint64_t)n);
        kvf__trace_str(&tr, "targets", list);
        kvf__trace_end(&tr, eng);
    }
    kvf__receiver_tell_failed(r);          /* failed before it knew them */
    kvf__receiver_try_request(r);
    kvf__engine_wake(eng);
}

/* The resolver's lookup for the room (its `resolved` op). */
static void receiver_resolved(kvf_room_t *r, const kvf_lookup_t *res)
{
    KVF_ASSERT_LOCKED(r->eng);
    if (res->res == KVF_LOOKUP_FATAL && room_final(r))
        return;                   /* failed already: it has no one to tell */
    if (res->res == KVF_LOOKUP_FATAL) {
        kvf__room_fail(r, res->status, "%s", res->err);
        return;
    }
    if (res->res == KVF_LOOKUP_RETRY) {
        free(r->last_err);
        r->last_err = strdup(res->err);
        kvf__resolver_enqueue(r->eng, r);
        return;
    }
    free(r->last_err);       /* a registry hiccup that resolved is no cause */
    r->last_err = NULL;
    kvf__siblings_link(r, res->w, res->nwatch);
    receiver_link(r, res->t, res->ntargets);
}

/*
 * The prefill ranks of a remote room, from their descriptors: every one a
 * prefill engine's, of one server (TP and PP sizes, DP group, page size,
 * dtype, attention, heads alike), each rank once; then the ranks this
 * engine reads from, each of which must be among them (known_heads: the
 * engine's total heads, 0 if it has none yet).  Without the lock: what it
 * reads of the engine is fixed once the engine registered.
 */
static kvf_status_t remote_targets(const kvf_engine_t *eng, const kvf_remote_t *rm,
                                   uint32_t known_heads, kvf_target_t *t, int *n_p)
{
    kvf_descriptor_t *d = calloc(rm->num_descriptors ? rm->num_descriptors : 1, sizeof(*d));
    char err[256];
    kvf_status_t st = KVF_OK;
    size_t i, j;

    if (d == NULL)
        return KVF_ERR_NO_MEMORY;
    for (i = 0; i < rm->num_descriptors && st == KVF_OK; i++) {
        if ((st = kvf__descriptor_parse(rm->descriptors[i], &d[i], err, sizeof(err))) != KVF_OK)
            kvf_error("kvf_receiver_create_remote: descriptor %zu: %s", i, err);
        else if (d[i].role != KVF_ROLE_PREFILL)
            kvf_error("kvf_receiver_create_remote: descriptor %zu is a decode engine's (%s)",
                      i, d[i].addr);
        else if (!eng->has_token && !eng->auth_open &&
                 !kvf__auth_is_loopback((const struct sockaddr *)&d[i].sa))
            kvf_error("kvf_receiver_create_remote: descriptor %zu names %s, not a loopback "
                      "address, and this engine has no cluster token: in protected mode it "
                      "talks to loopback peers only (set the same KVF_AUTH_TOKEN on every "
                      "engine, docs/SECURITY.md)", i, d[i].addr);
        else if (d[i].tp_size != d[0].tp_size || d[i].pp_size != d[0].pp_size ||
                 d[i].dp_rank != d[0].dp_rank || d[i].page_size != d[0].page_size ||
                 strcmp(d[i].dtype, d[0].dtype) != 0 || d[i].attn != d[0].attn ||
                 d[i].total_heads != d[0].total_heads)
            kvf_error("kvf_receiver_create_remote: descriptors %zu (%s) and 0 (%s) are not "
                      "of one prefill server: its TP and PP sizes, DP group and layout "
                      "differ", i, d[i].addr, d[0].addr);
        else
            continue;
        st = KVF_ERR_INVALID_PARAM;
    }
    for (i = 0; i < rm->num_descriptors && st == KVF_OK; i++) {
        for (j = 0; j < i; j++) {
            if (d[j].tp_rank == d[i].tp_rank && d[j].pp_rank == d[i].pp_rank) {
                kvf_error("kvf_receiver_create_remote: descriptors %zu and %zu both name "
                          "prefill rank tp %d pp %d", j, i, d[i].tp_rank, d[i].pp_rank);
                st = KVF_ERR_INVALID_PARAM;
                break;
            }
        }
    }
    int tp[KVF_MAX_TARGETS], pp[KVF_MAX_TARGETS], n = 0;
    if (st == KVF_OK) {
        uint32_t heads = known_heads ? known_heads : d[0].total_heads;
        n = kvf__receiver_targets_unlocked(eng, heads, d[0].tp_size, d[0].pp_size, tp, pp);
        if (n < 0) {
            kvf_error("kvf_receiver_create_remote: decode rank %d would read room %llu from "
                      "more than %d prefill ranks (TP %d, PP %d), more than kvferry links",
                      eng->params.tp_rank, (unsigned long long)rm->room, KVF_MAX_TARGETS,
                      d[0].tp_size, d[0].pp_size);
            st = KVF_ERR_UNSUPPORTED;
            n = 0;
        }
    }
    for (int k = 0; k < n && st == KVF_OK; k++) {
        for (i = 0; i < rm->num_descriptors; i++)
            if (d[i].tp_rank == tp[k] && d[i].pp_rank == pp[k])
                break;
        if (i == rm->num_descriptors) {
            kvf_error("kvf_receiver_create_remote: decode rank %d reads room %llu from "
                      "prefill rank tp %d pp %d (of TP %d, PP %d), and no descriptor names "
                      "it", eng->params.tp_rank, (unsigned long long)rm->room, tp[k], pp[k],
                      d[0].tp_size, d[0].pp_size);
            st = KVF_ERR_INVALID_PARAM;
            break;
        }
        snprintf(t[k].host, sizeof(t[k].host), "%s", d[i].host);
        t[k].port = d[i].port;
        t[k].rank = d[i].tp_rank;
        t[k].instance = d[i].instance;
    }
    free(d);
    *n_p = n;
    return st;
}

/* remote_targets, or what it made of the same set lately (descriptor.c):
 * a decode engine is given the same few sets, request after request.
 * Only a set that passed is kept; one refused is refused (and said) again. */
static kvf_status_t remote_ranks(kvf_engine_t *eng, const kvf_remote_t *rm, kvf_target_t *t,
                                 int *n_p)
{
    /* Atomic: a peer's HELLO may set them meanwhile (on_hello), to the
     * prefill's own, which its descriptors name too. */
    uint32_t heads = __atomic_load_n(&eng->layout.total_heads, __ATOMIC_RELAXED);
    size_t got = kvf__remote_seen_get(eng, rm->descriptors, rm->num_descriptors, heads, t,
                                      KVF_MAX_TARGETS * sizeof(*t));
    if (got != 0) {
        *n_p = (int)(got / sizeof(*t));
        return KVF_OK;
    }
    kvf_status_t st = remote_targets(eng, rm, heads, t, n_p);
    if (st == KVF_OK && *n_p > 0)
        kvf__remote_seen_put(eng, rm->descriptors, rm->num_descriptors, heads, t,
                             (size_t)*n_p * sizeof(*t));
    return st;
}

kvf_status_t kvf_receiver_create_remote(kvf_engine_t *eng, const kvf_remote_t *remote,
                                        kvf_receiver_t **receiver_p)
{
    kvf_remote_t rm;
    kvf_room_t *r;
    char err[KVF_REASON_MAX];
    int n = 0;

    if (eng == NULL || remote == NULL || receiver_p == NULL) {
        kvf_error("kvf_receiver_create_remote: need an engine, a remote room and a result");
        return KVF_ERR_INVALID_PARAM;
    }
    if (kvf__remote_import(&rm, remote, "kvf_receiver_create_remote", err,
                           sizeof(err)) != KVF_OK) {
        kvf_error("%s", err);
        return KVF_ERR_INVALID_PARAM;
    }
    if (rm.num_descriptors == 0 || rm.descriptors == NULL) {
        kvf_error("kvf_receiver_create_remote: no descriptors of the prefill ranks");
        return KVF_ERR_INVALID_PARAM;
    }
    /* Published as a create by address is, without the engine lock: the
     * lane that lists the room links it (receiver_open). */
    kvf_target_t found[KVF_MAX_TARGETS], *t = NULL;
    kvf_status_t st = atomic_load(&eng->registered) ? remote_ranks(eng, &rm, found, &n)
                                                    : KVF_OK;
    if (st == KVF_OK && (t = malloc((n ? (size_t)n : 1) * sizeof(*t))) == NULL)
        st = KVF_ERR_NO_MEMORY;
    if (st == KVF_OK)
        st = kvf__room_create(eng, &kvf_receiver_room_ops, rm.room, &r);
    if (st != KVF_OK) {
        free(t);
        return st;
    }
    memcpy(t, found, (size_t)n * sizeof(*t));
    kvf_receiver_t *rv = receiver_of(r);
    rv->dp_rank = -1;
    rv->sender_instance = rm.instance;
    rv->remote = 1;
    rv->targets = t;
    rv->ntargets = n;
    *receiver_p = (kvf_receiver_t *)r;
    kvf__room_submit(r);
    return KVF_OK;
}

static int cmp_u32(const void *a, const void *b)
{
    uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
    return x < y ? -1 : x > y;
}

/* A sorted copy of v[0..n) into sorted; @return the index in it of a
 * value that appears twice, or n. */
static size_t sort_unique(const uint32_t *v, size_t n, uint32_t *sorted)
{
    if (n == 0)
        return 0;
    memcpy(sorted, v, n * sizeof(uint32_t));
    qsort(sorted, n, sizeof(uint32_t), cmp_u32);
    for (size_t i = 1; i < n; i++)
        if (sorted[i] == sorted[i - 1])
            return i;
    return n;
}

/*
 * A destination the application gave, checked and copied in one
 * allocation (one malloc on the application's thread, one free by a
 * lane): published until a lane takes it in, then the receiver's
 * (rv->dest) until the room is freed.  The arrays follow the header:
 * state_bit0[ngroups + 1], pages[n], sorted[n], states.count[ngroups],
 * states.idx[total], state_sorted[total].
 */
typedef struct kvf_dest_given {
    uint32_t    *pages, *sorted;   /* as given, and ascending */
    kvf_states_t states;
    uint32_t    *state_sorted;     /* per group, ascending */
    uint64_t    *state_bit0;       /* per group, its first coverage bit */
    uint32_t     n_pages, aux_slot, decode_prefix;
    uint64_t     t_ns;             /* when it was given (the room's metric) */
} kvf_dest_given_t;

/* Check d's shape against the layout: KVF_OK, or the status of the
 * refusal (logged).  *total_p: its state indices, all groups. */
static kvf_status_t dest_check(kvf_room_t *r, const kvf_dest_t *d, size_t *total_p)
{
    const kvf_layout_int_t *l = &r->eng->layout;
    unsigned long long id = r->id;
    size_t n = d->num_pages, bad, total = 0;

    if ((n > 0 && d->pages == NULL) || n > UINT32_MAX) {
        kvf_error("room %llu: destination of %zu pages at %p", id, n, (void *)d->pages);
        return KVF_ERR_INVALID_PARAM;
    }
    if ((bad = first_bad_page(l, d->pages, n)) < n) {
        kvf_error("room %llu: page %u (index %zu) outside the registered KV buffers "
                  "(%llu pages)", id, d->pages[bad], bad,
                  (unsigned long long)min_items(l->kv, l->num_kv));
        return KVF_ERR_OUT_OF_RANGE;
    }
    if (!aux_slot_ok(l, d->aux_slot)) {
        kvf_error("room %llu: aux slot %u outside the registered aux buffers", id,
                  d->aux_slot);
        return KVF_ERR_OUT_OF_RANGE;
    }
    if (d->num_states != 0 && (d->num_states != l->num_groups || d->states == NULL)) {
        kvf_error("room %llu: state indices for %zu groups given, %u state groups "
                  "registered", id, d->num_states, l->num_groups);
        return KVF_ERR_INVALID_PARAM;
    }
    for (size_t g = 0; g < d->num_states; g++) {
        if ((d->states[g].n > 0 && d->states[g].idx == NULL) || d->states[g].n > UINT32_MAX ||
            (total += d->states[g].n) > UINT32_MAX) {
            kvf_error("room %llu: state group %zu: %zu indices at %p", id, g,
                      d->states[g].n, (const void *)d->states[g].idx);
            return KVF_ERR_INVALID_PARAM;
        }
    }
    *total_p = total;
    return KVF_OK;
}

/* d's arrays copied into g's tail (sized by dest_check's total). */
static void dest_fill(kvf_dest_given_t *g, const kvf_dest_t *d, size_t total)
{
    size_t n = d->num_pages, ng = d->num_states;
    g->state_bit0 = (uint64_t *)(g + 1);
    g->pages = (uint32_t *)(g->state_bit0 + ng + 1);
    g->sorted = g->pages + n;
    g->states = (kvf_states_t){.ngroups = (uint32_t)ng, .count = g->sorted + n,
                               .idx = g->sorted + n + ng, .total = (uint32_t)total};
    g->state_sorted = g->states.idx + total;
    if (n > 0)
        memcpy(g->pages, d->pages, n * sizeof(uint32_t));
    for (size_t i = 0, at = 0; i < ng; at += d->states[i++].n) {
        g->states.count[i] = (uint32_t)d->states[i].n;
        if (d->states[i].n > 0)
            memcpy(g->states.idx + at, d->states[i].idx, d->states[i].n * sizeof(uint32_t));
    }
}

/* Sort g's pages and each state group's indices, and say where each
 * group's coverage bits start (after every KV unit and aux buffer):
 * KVF_OK, or the status of the refusal (logged). */
static kvf_status_t dest_sort(kvf_room_t *r, kvf_dest_given_t *g)
{
    const kvf_layout_int_t *l = &r->eng->layout;
    unsigned long long id = r->id;
    size_t n = g->n_pages, bad;

    if ((bad = sort_unique(g->pages, n, g->sorted)) < n) {
        kvf_error("room %llu: page %u appears twice in the destination", id, g->sorted[bad]);
        return KVF_ERR_INVALID_PARAM;
    }
    uint32_t k = first_bad_state(l, &g->states);
    if (k < g->states.total) {
        kvf_error("room %llu: state index %u (position %u) outside its state group's "
                  "buffers", id, g->states.idx[k], k);
        return KVF_ERR_OUT_OF_RANGE;
    }
    uint64_t bit = (uint64_t)l->num_kv * n * l->page_size + l->num_aux;
    for (uint32_t i = 0, at = 0; i < g->states.ngroups; at += g->states.count[i++]) {
        uint32_t cnt = g->states.count[i];
        g->state_bit0[i] = bit;
        bit += (uint64_t)cnt * (l->group_first[i + 1] - l->group_first[i]);
        if ((bad = sort_unique(g->states.idx + at, cnt, g->state_sorted + at)) < cnt) {
            char type[64];
            kvf__group_type(l, i, type, sizeof(type));
            kvf_error("room %llu: state index %u appears twice in state group %u (%s)",
                      id, g->state_sorted[at + bad], i, type);
            return KVF_ERR_INVALID_PARAM;
        }
    }
    g->state_bit0[g->states.ngroups] = bit;
    return KVF_OK;
}

/* d checked against the layout and copied: *g_p (free() it), or the
 * status of the refusal (logged). */
static kvf_status_t dest_copy(kvf_room_t *r, const kvf_dest_t *d, kvf_dest_given_t **g_p)
{
    size_t total;
    kvf_status_t st = dest_check(r, d, &total);
    if (st != KVF_OK)
        return st;
    size_t ng = d->num_states;
    kvf_dest_given_t *g = malloc(sizeof(*g) + (ng + 1) * sizeof(uint64_t) +
                                 (2 * d->num_pages + ng + 2 * total) * sizeof(uint32_t));
    if (g == NULL)
        return KVF_ERR_NO_MEMORY;
    dest_fill(g, d, total);
    g->n_pages = (uint32_t)d->num_pages;
    g->aux_slot = d->aux_slot;
    g->decode_prefix = d->decode_prefix_len;
    g->t_ns = kvf_now_ns();
    if ((st = dest_sort(r, g)) != KVF_OK) {
        free(g);
        return st;
    }
    *g_p = g;
    return KVF_OK;
}

kvf_status_t kvf_receiver_set_dest(kvf_receiver_t *rv, const kvf_dest_t *dest)
{
    kvf_room_t *r = &rv->room;
    char err[256];
    kvf_dest_t d;
    kvf_dest_given_t *g;

    if (dest == NULL)
        return KVF_ERR_INVALID_PARAM;
    if (kvf__dest_import(&d, dest, "kvf_receiver_set_dest", err, sizeof(err)) != KVF_OK) {
        kvf_error("%s", err);
        return KVF_ERR_INVALID_PARAM;
    }
    kvf_status_t st = dest_copy(r, &d, &g);
    if (st != KVF_OK)
        return st;
    /* Published as a sender's init is, without the engine lock: a lane
     * takes it in (receiver_take) and only then is the room initialized. */
    pthread_mutex_lock(&r->app_lock);
    if (rv->dest_given) {
        kvf_error("room %llu: its destination was given already", (unsigned long long)r->id);
        st = KVF_ERR_STATE;
    } else {
        rv->dest_given = 1;
        atomic_store_explicit(&rv->given, g, memory_order_release);
        g = NULL;
    }
    pthread_mutex_unlock(&r->app_lock);
    free(g);
    if (st == KVF_OK)
        kvf__room_submit(r);
    return st;
}

/* The receiver's take op: the destination the application published. */
static void receiver_take(kvf_room_t *r)
{
    KVF_ASSERT_LOCKED(r->eng);
    kvf_receiver_t *rv = receiver_of(r);
    kvf_dest_given_t *g = atomic_exchange_explicit(&rv->given, NULL, memory_order_acquire);
    if (g == NULL)
        return;
    rv->dest = g;
    rv->pages = g->pages;
    rv->sorted_pages = g->sorted;
    rv->n_pages = g->n_pages;
    r->aux_slot = g->aux_slot;
    rv->state_dst = g->states;
    rv->state_sorted = g->state_sorted;
    rv->state_bit0 = g->state_bit0;
    rv->decode_prefix = g->decode_prefix;
    r->initialized = 1;
    /* The waiting deadline runs from here: the time the scheduler took
     * to find pages is not the prefill's. */
    r->t_state_ms = kvf_now_ms();
    if (!room_final(r))      /* a destination given too late is not in its times */
        atomic_store_explicit(&r->t_dest_ns, g->t_ns, memory_order_relaxed);
    kvf__trace_peer_event(r, "dest_set", NULL, -1, rv->n_pages, -1);
    kvf__receiver_try_request(r);
}

kvf_status_t kvf_receiver_init(kvf_receiver_t *rv, const uint32_t *pages, size_t n,
                               uint32_t aux_slot, const uint32_t *state_slots,
                               size_t n_state)
{
    kvf_dest_t d;
    kvf_indices_t *one = NULL;

    kvf_dest_init(&d);
    d.pages = pages;
    d.num_pages = n;
    d.aux_slot = aux_slot;
    if (n_state > 0) {
        if (state_slots == NULL || n_state > KVF_WIRE_MAX_BUFS) {
            kvf_error("room %llu: kvf_receiver_init: %zu state slots at %p",
                      (unsigned long long)rv->room.id, n_state, (const void *)state_slots);
            return KVF_ERR_INVALID_PARAM;
        }
        if ((one = malloc(n_state * sizeof(*one))) == NULL)
            return KVF_ERR_NO_MEMORY;
        for (size_t i = 0; i < n_state; i++)
            one[i] = (kvf_indices_t){&state_slots[i], 1};
        d.states = one;
        d.num_states = n_state;
    }
    kvf_status_t st = kvf_receiver_set_dest(rv, &d);
    free(one);
    return st;
}

/*
 * Bytes land in a room's pages in two ways.  The stream places them under
 * the engine lock after checking that the room is live (rx_valid), and a
 * lane turns the room final under the same lock, or takes in the turn an
 * application's abort made without it (room_settled).  A mover read is
 * started only for a live room, and counted in `reads` until the mover
 * says no byte of it can land.  So once the room is settled and `reads`
 * is 0, nothing is written into its pages or can start to be.
 */
static int pages_busy(const kvf_receiver_t *rv)
{
    return atomic_load_explicit(&rv->room.reads, memory_order_acquire) != 0;
}

int kvf_receiver_pages_released(const kvf_receiver_t *rv)
{
    return room_settled(&rv->room) && !pages_busy(rv);
}

/* FAILED tells the scheduler it may free the pages, so it shows only once
 * no byte can still land in them: a room that failed while reads into its
 * pages were in flight shows TRANSFERRING until they end, one the
 * application aborted its state before until a lane took the abort in
 * (SUCCESS never comes before its reads ended). */
kvf_poll_t kvf_receiver_poll(const kvf_receiver_t *rv)
{
    kvf_poll_t s = room_state(&rv->room);
    if (s != KVF_POLL_FAILED)
        return s;
    int was = atomic_load(&rv->room.app_failed);
    if (was != 0)
        return (kvf_poll_t)(was - 1);
    return pages_busy(rv) ? KVF_POLL_TRANSFERRING : s;
}

kvf_status_t kvf_receiver_failure(kvf_receiver_t *rv, kvf_failure_t *f)
{
    return kvf__room_consume_failure(&rv->room, f, "kvf_receiver_failure");
}

void kvf_receiver_abort(kvf_receiver_t *rv) { kvf__room_abort(&rv->room); }

kvf_status_t kvf_receiver_fail(kvf_receiver_t *rv, kvf_status_t st, const char *reason)
{
    return rv == NULL ? KVF_ERR_INVALID_PARAM : kvf__room_fail_app(&rv->room, st, reason);
}

kvf_status_t kvf_receiver_await_failure(kvf_receiver_t *rv, unsigned timeout_ms)
{
    return rv == NULL ? KVF_ERR_INVALID_PARAM : kvf__room_await_failure(&rv->room, timeout_ms);
}

void kvf_receiver_destroy(kvf_receiver_t *rv)
{
    if (rv != NULL)
        kvf__room_destroy(&rv->room);
}

uint64_t kvf_receiver_room(const kvf_receiver_t *rv) { return rv->room.id; }

kvf_status_t kvf_receiver_metric(kvf_receiver_t *rv, kvf_room_metric_t *m)
{
    return kvf__room_metric(&rv->room, m);
}

/*
 * The resolver chose the room's prefill ranks by the model's heads; a
 * decode layout that left them to the prefill had them guessed (resolver.c,
 * targets).  Now that they are known: is every stage's set of linked TP
 * ranks the one they call for?  @return 1, or 0 with the reason in err.
 */
static int links_match_heads(kvf_room_t *r, char *err, size_t errlen)
{
    const kvf_engine_t *eng = r->eng;
    const kvf_layout_int_t *l = &eng->layout;
    if (l->attn != KVF_ATTN_MHA)
        return 1;
    for (uint32_t i = 0; i < r->nlinks; i++) {
        const kvf_peer_t *p = r->links[i].peer;
        int want[2 * KVF_MAX_SOURCES], nw, have = 0;
        nw = kvf__sources(l->attn, l->total_heads, p->tp_size, eng->params.tp_size,
                          eng->params.tp_rank, want);
        nw += kvf__idle_sources(l->attn, l->total_heads, p->tp_size, eng->params.tp_size,
                                eng->params.tp_rank, want + nw);
        for (uint32_t j = 0; j < r->nlinks; j++) {
            const kvf_peer_t *q = r->links[j].peer;
            if (q->pp_rank != p->pp_rank)
                continue;
            int found = 0;
            for (int k = 0; k < nw; k++)
                found |= want[k] == q->tp_rank;
            if (!found)
                break;
            have++;
        }
        if (have != nw) {
            snprintf(err, errlen, "room %llu: with %u KV heads over prefill TP %d and "
                     "decode TP %d, decode rank %d needs %d prefill ranks of stage %d, but "
                     "was linked to others: its layout left the KV heads to the prefill, "
                     "which works when both TP sizes divide the heads; give this decode "
                     "engine its heads (kvf_layout_t heads_per_rank, total_heads, "
                     "bytes_per_head)", (unsigned long long)r->id, l->total_heads,
                     p->tp_size, eng->params.tp_size, eng->params.tp_rank, nw, p->pp_rank);
            return 0;
        }
    }
    return 1;
}

/* Is every link's handshake done, with the instance the room expects?
 * @return 1, or 0: not yet, a link is to be retried, or the room failed. */
static int links_ready(kvf_room_t *r)
{
    KVF_ASSERT_LOCKED(r->eng);
    char name[128];

    /* Wait for every handshake before judging, so that a refusal reaches
     * every prefill rank of the room. */
    for (uint32_t i = 0; i < r->nlinks; i++) {
        kvf_peer_t *p = r->links[i].peer;
        if (r->links[i].broken)
            return 0;
        if (p->state == KVF_PEER_DEAD) {
            char why[160];
            snprintf(why, sizeof(why), "cannot reach %s",
                     kvf__peer_name(p, name, sizeof(name)));
            if (r->links[i].rx.resume_instance != 0 && r->retries < MAX_RETRIES) {
                r->links[i].broken = 1;
                r->retries++;
                r->retry_at_ms = kvf_now_ms() + (RETRY_BASE_MS << (r->retries - 1));
                return 0;
            }
            if (r->retries > 0)
                kvf__room_fail_lost(r, KVF_ROLE_PREFILL, KVF_ERR_UNREACHABLE, "%s after %u "
                                    "reconnects; the connection was lost first: %s", why,
                                    r->retries, r->last_err ? r->last_err : "unknown");
            else
                kvf__room_fail_lost(r, KVF_ROLE_PREFILL, KVF_ERR_UNREACHABLE, "%s", why);
            return 0;
        }
        if (p->state != KVF_PEER_READY)
            return 0;
        if (r->links[i].want_instance != 0 && r->links[i].want_instance != p->instance_id) {
            kvf__room_fail(r, KVF_ERR_PEER_RESTARTED, "%s is engine instance %016llx, but "
                           "room %llu's descriptor names instance %016llx: the prefill "
                           "engine restarted since it held the room, which is gone",
                           kvf__peer_name(p, name, sizeof(name)),
                           (unsigned long long)p->instance_id, (unsigned long long)r->id,
                           (unsigned long long)r->links[i].want_instance);
            return 0;
        }
        if (r->links[i].rx.resume_instance != 0 &&
            r->links[i].rx.resume_instance != p->instance_id) {
            kvf__room_fail(r, KVF_ERR_PEER_RESTARTED, "%s restarted (instance %016llx, "
                           "was %016llx) while room %llu was in flight: its KV for the "
                           "room is gone", kvf__peer_name(p, name, sizeof(name)),
                           (unsigned long long)p->instance_id,
                           (unsigned long long)r->links[i].rx.resume_instance,
                           (unsigned long long)r->id);
            return 0;
        }
    }
    return 1;
}

/* Every linked peer's layout agrees with this engine's, and the links are
 * the ranks the heads call for.  @return 1, or 0: the room failed. */
static int links_compatible(kvf_room_t *r)
{
    KVF_ASSERT_LOCKED(r->eng);
    for (uint32_t i = 0; i < r->nlinks; i++) {
        if (r->links[i].peer->incompatible) {
            kvf__room_fail(r, KVF_ERR_INCOMPATIBLE, "%s", r->links[i].peer->incompatible);
            return 0;
        }
    }
    char why[KVF_REASON_MAX];
    if (!links_match_heads(r, why, sizeof(why))) {
        kvf__room_fail(r, KVF_ERR_INCOMPATIBLE, "%s", why);
        return 0;
    }
    return 1;
}

/* Which links carry data, which one also carries aux and state (the
 * last pipeline stage's lowest TP rank, in *designated_p), and each
 * data link's slice.  @return 1, or 0: the room failed. */
static int plan_links(kvf_room_t *r, int *designated_p)
{
    kvf_engine_t *eng = r->eng;
    KVF_ASSERT_LOCKED(eng);
    kvf_par_t mine, theirs;
    kvf__par_fill(&mine, eng->params.tp_rank, eng->params.tp_size, eng->params.pp_rank,
                  eng->params.pp_size, &eng->layout);
    int designated = -1;
    for (uint32_t i = 0; i < r->nlinks; i++) {
        kvf_link_t *lk = &r->links[i];
        kvf_peer_t *p = lk->peer;
        char err[256];
        kvf__par_fill(&theirs, p->tp_rank, p->tp_size, p->pp_rank, p->pp_size, &p->layout);
        kvf_status_t st = kvf__plan_slice(&theirs, &mine, &lk->slice, err, sizeof(err));
        lk->idle = st == KVF_ERR_NOT_FOUND;
        if (lk->idle)
            continue;
        if (st != KVF_OK) {
            kvf__room_fail(r, st, "%s", err);
            return 0;
        }
        kvf_peer_t *d = designated < 0 ? NULL : r->links[designated].peer;
        if (d == NULL || p->pp_rank > d->pp_rank ||
            (p->pp_rank == d->pp_rank && p->tp_rank < d->tp_rank))
            designated = (int)i;
    }
    *designated_p = designated;
    return 1;
}

/* The ROOM_REQ for one link: the destination it may write (pages, aux
 * slot, state indices) and how many decode ranks it serves.
 * @return the bytes per page the link owes (0 for an idle one). */
static uint64_t fill_request(kvf_room_t *r, kvf_link_t *lk, int aux, int state,
                             kvf_msg_t *m)
{
    kvf_engine_t *eng = r->eng;
    KVF_ASSERT_LOCKED(eng);
    kvf_receiver_t *rv = receiver_of(r);
    kvf_peer_t *p = lk->peer;
    uint64_t per_page = 0;

    *m = (kvf_msg_t){.type = KVF_MSG_ROOM_REQ};
    m->u.room_req.room = r->id;
    m->u.room_req.instance = r->instance;
    m->u.room_req.dst_rank = (uint32_t)eng->params.tp_rank;
    m->u.room_req.aux_slot = aux ? r->aux_slot : KVF_NO_SLOT;
    m->u.room_req.attempt = lk->rx.resume_instance ? r->retries : 0;
    m->u.room_req.sender_instance = rv->sender_instance;
    if (lk->idle) {
        /* Tell it the room exists; it owes nothing. */
        m->u.room_req.expected_receivers = 1;
    } else {
        int src[KVF_MAX_SOURCES], n = 0;
        for (int d = 0; d < eng->params.tp_size; d++) {
            int k = kvf__sources(eng->layout.attn, eng->layout.total_heads, p->tp_size,
                                 eng->params.tp_size, d, src);
            for (int j = 0; j < k; j++)
                n += src[j] == p->tp_rank;
        }
        m->u.room_req.expected_receivers = (uint32_t)n;
        m->u.room_req.pages = (kvf_wire_arr32_t){rv->n_pages, rv->pages, NULL};
        if (state) {
            m->u.room_req.state_counts = (kvf_wire_arr32_t){rv->state_dst.ngroups,
                                                            rv->state_dst.count, NULL};
            m->u.room_req.state_idx = (kvf_wire_arr32_t){rv->state_dst.total,
                                                         rv->state_dst.idx, NULL};
        }
        /* A slice: its heads of every token, whichever the page order. */
        for (uint32_t b = 0; b < p->layout.num_kv; b++)
            per_page += lk->slice.sliced
                ? (uint64_t)eng->layout.page_size * lk->slice.nheads *
                      kvf__head_bytes(&p->layout, b)
                : p->layout.kv[b].item_bytes;
    }
    /* A resumed link starts over: the prefill rank resends everything. */
    m->u.room_req.decode_prefix_len = rv->decode_prefix;
    return per_page;
}

/* Ask one link's prefill rank for its share: what it owes, the coverage
 * bitmap its bytes are checked against, then the ROOM_REQ itself.
 * @return 1, or 0: the room failed. */
static int send_request(kvf_room_t *r, kvf_link_t *lk, int designee)
{
    kvf_engine_t *eng = r->eng;
    KVF_ASSERT_LOCKED(eng);
    kvf_receiver_t *rv = receiver_of(r);
    kvf_peer_t *p = lk->peer;
    char name[128];
    kvf_msg_t m;

    /* Aux holds the first output token, which only the last pipeline
     * stage has: a decode stage paired with an earlier one gets none.
     * A link is named aux and state only where there is some to move,
     * so that "owes nothing" reads the same on both sides (no pages, no
     * aux slot, no state groups: sender.c, add_destination). */
    int state = designee && rv->state_dst.total > 0;
    int aux = designee && eng->layout.num_aux > 0 &&
              (eng->params.pp_size == 1 || eng->params.pp_rank == eng->params.pp_size - 1);
    uint64_t per_page = fill_request(r, lk, aux, state, &m);
    lk->rx.expected = rv->n_pages * per_page + (aux ? eng->aux_item_bytes_sum : 0) +
        (state ? states_bytes(&eng->layout, &rv->state_dst) : 0);
    /* What this peer may write, each unit once (cover_mark). */
    lk->aux_slot = aux ? r->aux_slot : KVF_NO_SLOT;
    lk->rx.sends_state = state && rv->state_dst.ngroups > 0;
    free(lk->rx.cover);
    lk->rx.cover = NULL;
    if (!lk->idle) {
        uint64_t bits = rv->state_bit0[rv->state_dst.ngroups];
        if ((lk->rx.cover = calloc((size_t)(bits + 7) / 8, 1)) == NULL) {
            kvf__room_fail(r, KVF_ERR_NO_MEMORY, "no memory to track room %llu's "
                           "%llu destination units", (unsigned long long)r->id,
                           (unsigned long long)bits);
            return 0;
        }
    }
    /* Nothing owed (a zero-page room's link that carries neither aux
     * nor state): the prefill rank treats it as idle too. */
    lk->done = lk->idle || (rv->n_pages == 0 && !aux && !state);
    kvf__link_streams_reset(r, lk, kvf__peer_nstreams(p), !lk->idle && want_checksum(eng, p));
    kvf_status_t st = kvf__peer_send(p, &m);
    if (st != KVF_OK) {
        kvf__room_fail(r, st, "cannot send the room's destination to %s: %s",
                       kvf__peer_name(p, name, sizeof(name)), kvf_status_str(st));
        return 0;
    }
    lk->rx.req_sent = 1;
    kvf__trace_peer_event(r, "request_sent", p, -1, lk->idle ? 0 : rv->n_pages, -1);
    return 1;
}

void kvf__receiver_try_request(kvf_room_t *r)
{
    KVF_ASSERT_LOCKED(r->eng);
    int designated;

    if (r->nlinks == 0 || room_final(r))
        return;
    if (!links_ready(r) || !links_compatible(r) || !plan_links(r, &designated))
        return;
    /* Resolved, connected and compatible: the scheduler may now give the
     * room its pages (SGLang allocates them only then). */
    if (room_state(r) == KVF_POLL_BOOTSTRAPPING)
        kvf__trace_peer_event(r, "connected", NULL, -1, -1, -1);
    if (!r->initialized) {
        kvf__room_set_state(r, KVF_POLL_WAITING_FOR_INPUT);
        return;
    }
    for (uint32_t i = 0; i < r->nlinks; i++) {
        if (r->links[i].rx.req_sent)
            continue;
        if (!send_request(r, &r->links[i], (int)i == designated))
            return;
    }
    kvf__room_set_state(r, KVF_POLL_WAITING_FOR_INPUT);
    if (all_done(r))          /* every link owes nothing: no DONE will come */
        kvf__room_set_state(r, KVF_POLL_SUCCESS);
}

/* Where state group g's indices start in the receiver's arrays. */
static uint32_t group_at(const kvf_receiver_t *rv, uint32_t g)
{
    uint32_t at = 0;
    for (uint32_t i = 0; i < g; i++)
        at += rv->state_dst.count[i];
    return at;
}

/* The position of `v` in sorted[0..n) (it is there: seg_target checked). */
static uint64_t sorted_index(const uint32_t *sorted, size_t n, uint64_t v)
{
    size_t lo = 0, hi = n;
    while (lo + 1 < hi) {
        size_t mid = (lo + hi) / 2;
        if (sorted[mid] <= v)
            lo = mid;
        else
            hi = mid;
    }
    return lo;
}

/*
 * Resolve one inbound segment to its place in this room's memory: the
 * address of its first byte, once every byte it touches is inside what
 * the room declared.  A strided segment is checked over its span, from
 * its first piece's start to its last piece's end, which holds each of
 * its pieces: the sender's pieces fill consecutive pages, so the span of
 * a real one is declared whenever its pieces are.
 */
static uint8_t *seg_target(kvf_room_t *r, const kvf_wire_seg_t *s, char *err,
                           size_t errlen)
{
    kvf_receiver_t *rv = receiver_of(r);
    const kvf_layout_int_t *l = &r->eng->layout;
    const kvf_buffer_t *b;
    uint64_t lo, hi, span;

    if (!kvf_wire_seg_span(s, 0, &span) || s->offset > UINT64_MAX - span) {
        snprintf(err, errlen, "%u pieces of %u bytes %llu apart from offset %llu "
                 "wrap around", kvf_wire_seg_pieces(s), s->len,
                 (unsigned long long)s->dst_stride, (unsigned long long)s->offset);
        return NULL;
    }
    if (s->kind == KVF_BUF_KV && s->buf < l->num_kv) {
        b = &l->kv[s->buf];
        uint64_t first = s->offset / b->item_bytes;
        uint64_t last = (s->offset + span - 1) / b->item_bytes;
        /* Head slices hit the same page many times in a row: remember it. */
        if (first >= rv->ok_first && last <= rv->ok_last)
            return (uint8_t *)b->base + s->offset;
        if (kvf__pages_contain(rv->sorted_pages, rv->n_pages, first, last)) {
            rv->ok_first = first;
            rv->ok_last = last;
            return (uint8_t *)b->base + s->offset;
        }
        snprintf(err, errlen, "bytes [%llu, %llu) of KV buffer %u are outside the "
                 "pages the room declared", (unsigned long long)s->offset,
                 (unsigned long long)(s->offset + span), s->buf);
        return NULL;
    }
    if (s->kind == KVF_BUF_STATE && s->buf < l->num_state && rv->state_dst.ngroups > 0) {
        /* Whole items, each one of the group's destination indices. */
        b = &l->state[s->buf];
        uint32_t g = kvf__group_of(l, s->buf), at = group_at(rv, g);
        uint64_t first = s->offset / b->item_bytes;
        uint64_t last = (s->offset + span - 1) / b->item_bytes;
        if (kvf__pages_contain(rv->state_sorted + at, rv->state_dst.count[g], first, last))
            return (uint8_t *)b->base + s->offset;
        snprintf(err, errlen, "bytes [%llu, %llu) of state buffer %u are outside the "
                 "state indices the room declared", (unsigned long long)s->offset,
                 (unsigned long long)(s->offset + span), s->buf);
        return NULL;
    }
    if (s->kind == KVF_BUF_AUX && s->buf < l->num_aux) {
        b = &l->aux[s->buf];
        lo = (uint64_t)r->aux_slot * b->item_bytes;
    } else {
        snprintf(err, errlen, "segment names %s buffer %u, which this room does not have",
                 s->kind == KVF_BUF_KV ? "KV" : s->kind == KVF_BUF_AUX ? "aux" : "state",
                 s->buf);
        return NULL;
    }
    hi = lo + b->item_bytes;
    if (s->offset >= lo && s->offset <= hi && span <= hi - s->offset)
        return (uint8_t *)b->base + s->offset;
    snprintf(err, errlen, "bytes [%llu, %llu) of aux buffer %u are outside the room's "
             "slot [%llu, %llu)", (unsigned long long)s->offset,
             (unsigned long long)(s->offset + span), s->buf, (unsigned long long)lo,
             (unsigned long long)hi);
    return NULL;
}

/* Test and set bit i of a coverage bitmap: 1 if it was clear. */
static int cover_set(uint8_t *c, uint64_t i)
{
    uint8_t m = (uint8_t)(1u << (i & 7));
    if (c[i >> 3] & m)
        return 0;
    c[i >> 3] |= m;
    return 1;
}

/* cover_mark for a KV segment: each piece is whole tokens, or this link's
 * run of heads of one token (NHD) or one page (HND), each unit once. */
static int cover_mark_kv(kvf_room_t *r, kvf_link_t *lk, const kvf_wire_seg_t *s,
                         char *err, size_t errlen)
{
    KVF_ASSERT_LOCKED(r->eng);
    kvf_receiver_t *rv = receiver_of(r);
    const kvf_layout_int_t *l = &r->eng->layout;
    uint64_t ps = l->page_size;
    uint32_t pieces = kvf_wire_seg_pieces(s);
    const kvf_buffer_t *b = &l->kv[s->buf];
    uint64_t tok = b->item_bytes / ps;
    const kvf_slice_t *sl = &lk->slice;
    /* A sliced link's piece: its heads of one token (NHD), at `at` in
     * the token, or of one page (HND: every token), at `at` in the page. */
    int hnd = sl->sliced && l->kv_order == KVF_KV_HND;
    uint64_t unit = hnd ? b->item_bytes : tok, ntok = hnd ? ps : 1;
    uint64_t bph = sl->sliced ? kvf__head_bytes(l, s->buf) : 0;
    uint64_t at = sl->sliced ? (uint64_t)sl->dst_head * bph * ntok : 0;
    uint64_t want = sl->sliced ? (uint64_t)sl->nheads * bph * ntok : 0;
    if (lk->peer->kv_src == NULL || lk->peer->kv_src[s->buf] == UINT32_MAX) {
        snprintf(err, errlen, "KV buffer %u holds layers this peer does not send to "
                 "this rank", s->buf);
        return 0;
    }
    for (uint32_t k = 0; k < pieces; k++) {
        uint64_t off = s->offset + (uint64_t)k * s->dst_stride;
        if (off % unit != at || (want ? s->len != want : s->len % tok != 0)) {
            snprintf(err, errlen, "bytes [%llu, %llu) of KV buffer %u are not %s",
                     (unsigned long long)off, (unsigned long long)(off + s->len),
                     s->buf, !want ? "whole tokens"
                             : hnd ? "this peer's heads of one page (HND pages)"
                                   : "this peer's heads of one token");
            return 0;
        }
        uint64_t t0 = hnd ? off / unit * ps : off / tok, n = want ? ntok : s->len / tok;
        uint64_t first = t0 / ps, idx0 = sorted_index(rv->sorted_pages, rv->n_pages, first);
        for (uint64_t t = t0; t < t0 + n; t++) {
            /* Consecutive pages: seg_target found them all declared. */
            uint64_t idx = idx0 + (t / ps - first);
            if (cover_set(lk->rx.cover, ((uint64_t)s->buf * rv->n_pages + idx) * ps +
                                         t % ps))
                continue;
            if (hnd)
                snprintf(err, errlen, "token %llu of page %llu of KV buffer %u (this "
                         "peer's heads of the page: bytes [%llu, %llu)) is written a "
                         "second time: each destination byte is placed once",
                         (unsigned long long)(t % ps), (unsigned long long)(t / ps),
                         s->buf, (unsigned long long)off,
                         (unsigned long long)(off + want));
            else
                snprintf(err, errlen, "token %llu of page %llu of KV buffer %u (bytes "
                         "[%llu, %llu)) is written a second time: each destination "
                         "byte is placed once", (unsigned long long)(t % ps),
                         (unsigned long long)(t / ps), s->buf,
                         (unsigned long long)(t * tok + at),
                         (unsigned long long)(t * tok + at + (want ? want : tok)));
            return 0;
        }
    }
    return 1;
}

/* cover_mark for a state segment: whole items of the room's state
 * indices, from the link that sends state, each item once. */
static int cover_mark_state(kvf_room_t *r, kvf_link_t *lk, const kvf_wire_seg_t *s,
                            char *err, size_t errlen)
{
    KVF_ASSERT_LOCKED(r->eng);
    kvf_receiver_t *rv = receiver_of(r);
    const kvf_layout_int_t *l = &r->eng->layout;
    const kvf_buffer_t *b = &l->state[s->buf];
    uint32_t g = kvf__group_of(l, s->buf), at = group_at(rv, g);
    uint32_t cnt = rv->state_dst.count[g];
    if (!lk->rx.sends_state) {
        snprintf(err, errlen, "this peer does not send the room's state");
        return 0;
    }
    if (kvf_wire_seg_pieces(s) != 1 || s->offset % b->item_bytes != 0 ||
        s->len % b->item_bytes != 0) {
        snprintf(err, errlen, "bytes [%llu, %llu) of state buffer %u are not whole "
                 "items", (unsigned long long)s->offset,
                 (unsigned long long)(s->offset + s->len), s->buf);
        return 0;
    }
    uint64_t first = s->offset / b->item_bytes, n = s->len / b->item_bytes;
    uint64_t bit0 = rv->state_bit0[g] + (uint64_t)(s->buf - l->group_first[g]) * cnt;
    for (uint64_t it = first; it < first + n; it++) {
        if (!cover_set(lk->rx.cover, bit0 + sorted_index(rv->state_sorted + at, cnt, it))) {
            snprintf(err, errlen, "item %llu of state buffer %u is written a second "
                     "time: each destination byte is placed once",
                     (unsigned long long)it, s->buf);
            return 0;
        }
    }
    return 1;
}

/* cover_mark for an aux segment: the room's whole slot, from the link
 * that sends aux, once.  Its bits follow the KV tokens' in the bitmap. */
static int cover_mark_aux(kvf_room_t *r, kvf_link_t *lk, const kvf_wire_seg_t *s,
                          char *err, size_t errlen)
{
    KVF_ASSERT_LOCKED(r->eng);
    kvf_receiver_t *rv = receiver_of(r);
    const kvf_layout_int_t *l = &r->eng->layout;
    uint64_t nkv = (uint64_t)l->num_kv * rv->n_pages * l->page_size;
    const kvf_buffer_t *b = &l->aux[s->buf];
    if (lk->aux_slot == KVF_NO_SLOT) {
        snprintf(err, errlen, "this peer does not send the room's aux");
        return 0;
    }
    if (kvf_wire_seg_pieces(s) != 1 || s->offset != (uint64_t)r->aux_slot * b->item_bytes ||
        s->len != b->item_bytes) {
        snprintf(err, errlen, "bytes [%llu, %llu) of aux buffer %u are not its whole slot",
                 (unsigned long long)s->offset, (unsigned long long)(s->offset + s->len),
                 s->buf);
        return 0;
    }
    if (!cover_set(lk->rx.cover, nkv + s->buf)) {
        snprintf(err, errlen, "aux buffer %u's slot is written a second time: each "
                 "destination byte is placed once", s->buf);
        return 0;
    }
    return 1;
}

/*
 * Exact coverage: a receiver counts each destination byte once.  Every
 * piece a peer sends must be whole destination units of its own share:
 * whole tokens of the KV buffers its layers map to (a TP-sliced link:
 * exactly its run of heads of one token of an NHD page, or of one HND
 * page, which covers every token of that page), the whole aux slot if it
 * is the link that sends aux, each whole state slot if it sends state; and
 * no unit twice.  With the byte count DONE checks, that makes the bytes
 * placed exactly the room's, each once.  The check runs when a frame is
 * accepted, for pushed (DATA) and pulled (DATA_REF) frames alike, so a
 * frame that repeats a unit places nothing.  @return 1, or 0 with err.
 */
static int cover_mark(kvf_room_t *r, kvf_link_t *lk, const kvf_wire_seg_t *s, char *err,
                      size_t errlen)
{
    if (lk->rx.cover == NULL)
        return 1;     /* an idle link: any byte it sends fails the count */
    if (s->kind == KVF_BUF_KV)
        return cover_mark_kv(r, lk, s, err, errlen);
    if (s->kind == KVF_BUF_STATE)
        return cover_mark_state(r, lk, s, err, errlen);
    return cover_mark_aux(r, lk, s, err, errlen);
}

/*
 * Where each piece of an inbound DATA or DATA_REF frame goes (t[0..
 * d->npieces), segment by segment, a plain segment being one piece),
 * checked against what the room declared before a byte is placed.
 * @return the link the frame belongs to, or NULL: place nothing (the room
 * is not live here, the peer was not asked, or a segment is out of
 * bounds, which fails the room).
 */
static kvf_link_t *frame_targets(kvf_peer_t *p, const kvf_msg_data_t *d,
                                 kvf_rx_target_t *t, kvf_room_t **room_p)
{
    kvf_room_t *r = kvf__room_find(p->eng, d->room);
    char err[256], name[128];

    if (r == NULL || room_final(r)) {
        kvf_debug("discarding %llu bytes for room %llu (not live here)",
                  (unsigned long long)d->payload_len, (unsigned long long)d->room);
        return NULL;
    }
    kvf_link_t *lk = link_of(r, kvf__peer_main(p));
    if (lk == NULL || !lk->rx.req_sent) {
        kvf__room_dropped(p, "DATA", d->room, d->instance, "the room did not ask this "
                          "peer for any; its bytes were discarded");
        return NULL;
    }
    if (d->instance != r->instance) {
        kvf__room_dropped(p, "DATA", d->room, d->instance, "it names another instance of "
                          "the room (an earlier room with this id); its bytes were discarded");
        return NULL;
    }
    uint32_t k = 0;
    for (uint32_t i = 0; i < d->nseg; i++) {
        kvf_wire_seg_t s;
        kvf_wire_seg_at(d, i, &s);
        uint8_t *dst = seg_target(r, &s, err, sizeof(err));
        if (dst == NULL) {
            for (uint32_t j = 0; j < k; j++)
                t[j].dst = NULL;
            kvf__room_fail(r, KVF_ERR_BAD_INDICES, "%s wrote outside room %llu's "
                           "destination: segment %u: %s; nothing of it was placed",
                           kvf__peer_name(p, name, sizeof(name)),
                           (unsigned long long)r->id, i, err);
            return NULL;
        }
        if (!cover_mark(r, lk, &s, err, sizeof(err))) {
            for (uint32_t j = 0; j < k; j++)
                t[j].dst = NULL;
            kvf__room_fail(r, KVF_ERR_PROTOCOL, "%s sent room %llu a segment it must not: "
                           "segment %u: %s; nothing of the frame was placed",
                           kvf__peer_name(p, name, sizeof(name)),
                           (unsigned long long)r->id, i, err);
            return NULL;
        }
        /* The codec bounds the pieces of a frame by d->npieces. */
        for (uint32_t j = 0; j < kvf_wire_seg_pieces(&s) && k < d->npieces; j++, k++)
            t[k] = (kvf_rx_target_t){dst + (size_t)j * s.dst_stride, s.len};
    }
    kvf__room_set_state(r, KVF_POLL_TRANSFERRING);
    *room_p = r;
    return lk;
}

/*
 * DATA_REF: the (local, remote) iovec of every piece of the frame, from
 * its checked targets t[0..d->npieces) and each segment's source address.
 * @return the number of pieces.
 */
static uint32_t ref_pieces(const kvf_msg_data_t *d, const kvf_rx_target_t *t,
                           struct iovec *local, struct iovec *remote)
{
    uint32_t k = 0;
    for (uint32_t i = 0; i < d->nseg; i++) {
        kvf_wire_seg_t s;
        kvf_wire_seg_at(d, i, &s);
        uint64_t a = kvf_wire_arr64_at(&d->src_addrs, i);
        for (uint32_t j = 0; j < kvf_wire_seg_pieces(&s) && k < d->npieces; j++, k++) {
            local[k] = (struct iovec){t[k].dst, t[k].len};
            remote[k] = (struct iovec){(void *)(uintptr_t)(a + (uint64_t)j * s.src_stride),
                                       t[k].len};
        }
    }
    return k;
}

/*
 * A staging engine (stage.h): the frame's pieces in device memory are
 * received into a bounce buffer instead, and remembered (rx_dev <- rx_bnc)
 * for the copy that follows the frame.  @return 0: no memory.
 */
static int stage_targets(kvf_peer_t *p, const kvf_msg_data_t *d, kvf_rx_target_t *t)
{
    kvf_engine_t *eng = p->eng;
    uint64_t dev = 0;
    uint32_t k = 0, ndev = 0;

    for (uint32_t i = 0; i < d->nseg; i++) {
        kvf_wire_seg_t s;
        kvf_wire_seg_at(d, i, &s);
        uint32_t cnt = kvf_wire_seg_pieces(&s);
        if (kvf__seg_on_device(eng, s.kind)) {
            dev += (uint64_t)cnt * s.len;
            ndev += cnt;
        }
    }
    if (p->rx_bounce != NULL) {
        /* A frame its connection cut short left it (on_data_end never came). */
        kvf__bounce_put(eng, p->rx_bounce, p->rx_bounce_cap);
        p->rx_bounce = NULL;
    }
    if (ndev == 0)
        return 1;
    if (p->rx_dev_cap < ndev) {
        struct iovec *a = realloc(p->rx_dev, (size_t)ndev * sizeof(*a));
        if (a != NULL)
            p->rx_dev = a;
        struct iovec *b = realloc(p->rx_bnc, (size_t)ndev * sizeof(*b));
        if (b != NULL)
            p->rx_bnc = b;
        if (a == NULL || b == NULL)
            return 0;
        p->rx_dev_cap = ndev;
    }
    if ((p->rx_bounce = kvf__bounce_get(eng, dev, &p->rx_bounce_cap)) == NULL)
        return 0;
    uint8_t *at = p->rx_bounce;
    ndev = 0;
    for (uint32_t i = 0; i < d->nseg; i++) {
        kvf_wire_seg_t s;
        kvf_wire_seg_at(d, i, &s);
        int on_dev = kvf__seg_on_device(eng, s.kind);
        for (uint32_t j = 0; j < kvf_wire_seg_pieces(&s) && k < d->npieces; j++, k++) {
            if (!on_dev)
                continue;
            p->rx_dev[ndev] = (struct iovec){t[k].dst, t[k].len};
            p->rx_bnc[ndev++] = (struct iovec){at, t[k].len};
            t[k].dst = at;
            at += t[k].len;
        }
    }
    p->rx_ndev = ndev;
    p->rx_dev_bytes = dev;
    return 1;
}

static kvf_verdict_t receiver_on_data(kvf_peer_t *p, const kvf_msg_data_t *d,
                                      kvf_rx_target_t *t)
{
    kvf_room_t *r = NULL;
    kvf_link_t *lk = frame_targets(p, d, t, &r);

    p->rx_room = NULL;
    p->rx_link = NULL;
    if (lk == NULL)
        return kvf__verdict_ok();
    if (kvf__stages(p->eng) && !stage_targets(p, d, t)) {
        for (uint32_t k = 0; k < d->npieces; k++)
            t[k].dst = NULL;
        kvf__room_fail(r, KVF_ERR_NO_MEMORY, "no pinned host memory to stage %llu bytes "
                       "for room %llu", (unsigned long long)d->payload_len,
                       (unsigned long long)r->id);
        return kvf__verdict_ok();
    }
    r->refs++;
    p->rx_room = r;
    p->rx_link = lk;
    p->rx_payload = d->payload_len;
    return kvf__verdict_ok();
}

/*
 * A mover read in flight: one DATA_REF frame's pieces, checked, started,
 * and taken in when the mover hands it back.  It holds its room and its
 * peer: neither goes away while a byte of it may still land.
 */
typedef struct kvf_read {
    kvf_mover_read_t base;       /* first: what the mover hands back */
    kvf_engine_t    *eng;
    kvf_room_t      *room;
    kvf_peer_t      *peer;
    uint32_t         link;       /* its index in room->links */
    uint64_t         bytes;
    uint32_t         n;
    kvf_status_t     st;
    char             err[160];
    void            *bounce;     /* a staged frame's copy: from here (hashed already) */
    size_t           bounce_cap;
    struct kvf_read *next;       /* eng->reads_done */
    struct iovec     iov[];      /* local[n], then remote[n] */
} kvf_read_t;

/* The mover is done with it: queue it for the engine loop, which takes it
 * in after the mover's progress returns (nothing here calls back into the
 * mover).  Movers hand reads back in the order they were started. */
static void read_done(kvf_mover_read_t *base, kvf_status_t st, const char *err)
{
    kvf_read_t *rd = (kvf_read_t *)base;
    kvf_engine_t *eng = rd->eng;
    rd->st = st;
    if (st != KVF_OK)
        snprintf(rd->err, sizeof(rd->err), "%s", err ? err : kvf_status_str(st));
    rd->next = NULL;
    *eng->reads_done_tail = rd;
    eng->reads_done_tail = &rd->next;
}

static void check_done(kvf_peer_t *p, kvf_room_t *r, kvf_link_t *lk, uint32_t k,
                       uint64_t bytes, int has_checksum, uint64_t checksum);

/* A read's accounting once it started (mover or copier alike). */
static void read_started(kvf_peer_t *p, kvf_room_t *r, kvf_link_t *lk, kvf_read_t *rd)
{
    r->refs++;
    p->refs++;
    lk->rx.reads++;
    atomic_fetch_add_explicit(&r->reads, 1, memory_order_relaxed);
    p->read_bytes += rd->bytes;
    p->eng->reads_inflight++;
}

/* After a failed read: whether its endpoint went down with it.  The
 * endpoint's own ops say (a fault wrapper forwards its inner's caps). */
static int ep_down(const kvf_mover_ep_t *ep)
{
    return (ep->ops->caps & KVF_MOVER_CAP_READ_FAIL_CLOSES_EP) && ep->ops->ep_failed(ep);
}

/* One finished read: its bytes count (or its failure fails the room), and
 * a DONE that waited for it is checked.  *verdict_p: what it says of its
 * peer (an endpoint gone with the read). */
static void read_finish(kvf_read_t *rd, kvf_verdict_t *verdict_p)
{
    kvf_engine_t *eng = rd->eng;
    kvf_room_t *r = rd->room;
    kvf_peer_t *p = rd->peer;
    kvf_link_t *lk = &r->links[rd->link];
    const struct iovec *local = rd->iov;
    char name[128];

    *verdict_p = kvf__verdict_ok();
    lk->rx.reads--;
    p->read_bytes -= rd->bytes;
    eng->reads_inflight--;
    if (lk->peer != p || p->state == KVF_PEER_DEAD) {
        /* Its connection broke meanwhile, and that decided for the room
         * (failed, or reconnecting to be sent everything again): what this
         * read did no longer counts.  The link's DONE waited for it all
         * the same, since it could still write into the pages. */
    } else if (rd->st == KVF_OK) {
        if (!room_final(r)) {
            for (uint32_t i = 0; lk->hash[0] != NULL && rd->bounce == NULL && i < rd->n; i++)
                XXH3_64bits_update(lk->hash[0], local[i].iov_base, local[i].iov_len);
            kvf__link_count(r, lk, 0, rd->bytes);
            eng->stats.bytes_received += rd->bytes;
            eng->metrics.path_bytes[kvf__metrics_path(p->mover, rd->bounce != NULL)] +=
                rd->bytes;
            r->t_state_ms = kvf_now_ms();
        }
    } else if (rd->bounce != NULL) {
        kvf__room_fail(r, rd->st, "staging the bytes from %s into device memory failed: "
                       "%s", kvf__peer_name(p, name, sizeof(name)), rd->err);
    } else {
        kvf__room_fail(r, rd->st, "%s transfer from %s failed: %s", p->mover->name,
                       kvf__peer_name(p, name, sizeof(name)), rd->err);
        /* An endpoint that can read nothing any more takes its peer along. */
        if (p->mep != NULL && ep_down(p->mep))
            *verdict_p = kvf__verdict(rd->st, "%s endpoint failed: %s", p->mover->name,
                                      rd->err);
    }
    /* Release: a poller that sees the count reach 0 sees the bytes too. */
    if (atomic_fetch_sub_explicit(&r->reads, 1, memory_order_release) == 1)
        pthread_cond_broadcast(&eng->reads_cond);
    if (lk->rx.reads == 0 && lk->rx.done_waiting) {
        lk->rx.done_waiting = 0;
        if (!room_final(r))
            check_done(lk->peer, r, lk, 0, lk->rx.done_bytes, lk->rx.done_has_checksum,
                       lk->rx.done_checksum);
    }
    if (rd->bounce != NULL)
        kvf__bounce_put(eng, rd->bounce, rd->bounce_cap);
    kvf__room_put(r);
    free(rd);                     /* its reference to p goes with the caller */
}

static kvf_peer_t *receiver_read_take(kvf_engine_t *eng, kvf_verdict_t *verdict_p)
{
    KVF_ASSERT_LOCKED(eng);
    kvf_read_t *rd = eng->reads_done;
    if (rd == NULL)
        return NULL;
    if ((eng->reads_done = rd->next) == NULL)
        eng->reads_done_tail = &eng->reads_done;
    kvf_peer_t *p = rd->peer;
    read_finish(rd, verdict_p);
    return p;
}

/* A DATA_REF frame: the same checks as DATA, then the mover starts reading
 * the bytes from the prefill's memory; they count once it hands them back. */
static kvf_verdict_t receiver_on_data_ref(kvf_peer_t *p, const kvf_msg_data_t *d)
{
    kvf_engine_t *eng = p->eng;
    kvf_room_t *r = NULL;
    char err[256], name[128];

    if (p->ref_cap < d->npieces) {
        kvf_rx_target_t *tg = realloc(p->ref_tgt, (size_t)d->npieces * sizeof(*tg));
        if (tg == NULL)
            return kvf__verdict(KVF_ERR_NO_MEMORY, "no memory for a DATA_REF frame");
        p->ref_tgt = tg;
        p->ref_cap = d->npieces;
    }
    kvf_rx_target_t *t = p->ref_tgt;
    kvf_link_t *lk = frame_targets(p, d, t, &r);
    if (lk == NULL)
        return kvf__verdict_ok();
    kvf_read_t *rd = malloc(sizeof(*rd) + 2 * (size_t)d->npieces * sizeof(struct iovec));
    if (rd == NULL) {
        kvf__room_fail(r, KVF_ERR_NO_MEMORY, "no memory to read %llu bytes for room %llu",
                       (unsigned long long)d->payload_len, (unsigned long long)r->id);
        return kvf__verdict_ok();
    }
    rd->bounce = NULL;
    struct iovec *local = rd->iov, *remote = rd->iov + d->npieces;
    uint32_t n = ref_pieces(d, t, local, remote);
    rd->base.done = read_done;
    rd->eng = eng;
    rd->room = r;
    rd->peer = p;
    rd->link = (uint32_t)(lk - r->links);
    rd->bytes = d->payload_len;
    rd->n = n;
    const char *via = p->mover->name;
    kvf_status_t st = p->mep == NULL ? KVF_ERR_CONN_RESET
                      : p->mep->ops->read(p->mep, &rd->base, local, remote, n,
                                       eng->params.heartbeat_timeout_ms, err, sizeof(err));
    if (st == KVF_OK) {
        read_started(p, r, lk, rd);
        return kvf__verdict_ok();
    }
    free(rd);
    if (st == KVF_ERR_PROTOCOL) {
        /*
         * A source outside what the peer registered: nothing was read
         * and the endpoint is fine, so this is one bad request, not a
         * dead peer.  The room fails; the peer's other rooms, whose
         * segments are checked the same way, go on
         * (docs/FAILURES.md, "bad source address").
         */
        kvf__room_fail(r, KVF_ERR_BAD_INDICES, "refused a %s read for room %llu "
                       "from %s: %s; nothing of the frame was read", via,
                       (unsigned long long)r->id,
                       kvf__peer_name(p, name, sizeof(name)), err);
        return kvf__verdict_ok();
    }
    kvf__room_fail(r, st, "%s transfer from %s failed: %s", via,
                   kvf__peer_name(p, name, sizeof(name)), err);
    if (p->mep == NULL || ep_down(p->mep))
        return kvf__verdict(st, "%s endpoint failed: %s", via, err);
    return kvf__verdict_ok();
}

/*
 * A staged frame is in its bounce buffer: copy its device pieces into the
 * pages, as a read (the bytes count, and the pages stay held, until the
 * copier hands it back).  A frame cut short (its room went away) or a
 * room no longer live copies nothing.  @return the bytes now in flight.
 */
static uint64_t stage_copy(kvf_peer_t *p, kvf_room_t *r, kvf_link_t *lk, uint64_t placed)
{
    kvf_engine_t *eng = p->eng;
    void *bounce = p->rx_bounce;
    uint64_t bytes = p->rx_dev_bytes;
    char err[256], name[128];

    p->rx_bounce = NULL;
    p->rx_dev_bytes = 0;
    if (placed != p->rx_payload || room_final(r)) {
        kvf__bounce_put(eng, bounce, p->rx_bounce_cap);
        return bytes < placed ? bytes : placed;
    }
    kvf_read_t *rd = calloc(1, sizeof(*rd) + 2 * (size_t)p->rx_ndev * sizeof(struct iovec));
    kvf_status_t st = KVF_ERR_NO_MEMORY;
    snprintf(err, sizeof(err), "out of memory");
    if (rd != NULL) {
        memcpy(rd->iov, p->rx_dev, p->rx_ndev * sizeof(struct iovec));
        memcpy(rd->iov + p->rx_ndev, p->rx_bnc, p->rx_ndev * sizeof(struct iovec));
        rd->base.done = read_done;
        rd->eng = eng;
        rd->room = r;
        rd->peer = p;
        rd->link = (uint32_t)(lk - r->links);
        rd->bytes = bytes;
        rd->n = p->rx_ndev;
        rd->bounce = bounce;
        rd->bounce_cap = p->rx_bounce_cap;
        st = eng->copier_ops->copy(eng->copier, &rd->base, rd->iov, rd->iov + rd->n, rd->n,
                                   err, sizeof(err));
    }
    if (st == KVF_OK) {
        read_started(p, r, lk, rd);
        return bytes;
    }
    free(rd);
    kvf__bounce_put(eng, bounce, p->rx_bounce_cap);
    kvf__room_fail(r, st, "staging the bytes from %s into device memory failed: %s",
                   kvf__peer_name(p, name, sizeof(name)), err);
    return bytes;
}

static kvf_verdict_t receiver_on_data_end(kvf_peer_t *p, uint64_t placed)
{
    kvf_room_t *r = p->rx_room;
    if (r == NULL)
        return kvf__verdict_ok();
    if (p->rx_bounce != NULL)
        placed -= stage_copy(p, r, p->rx_link, placed);   /* those count when copied */
    kvf__link_count(r, p->rx_link, p->stream, placed);
    p->eng->stats.bytes_received += placed;
    p->eng->metrics.path_bytes[KVF_PATH_TCP] += placed;
    p->eng->stream_bytes[p->stream] += placed;
    r->t_state_ms = kvf_now_ms();
    p->rx_room = NULL;
    p->rx_link = NULL;
    kvf__room_put(r);
    return kvf__verdict_ok();
}

static void on_done(kvf_peer_t *p, kvf_room_t *r, const kvf_msg_done_t *m)
{
    kvf_link_t *lk = link_of(r, p);
    uint32_t k = m->stream;        /* 0 without streams */
    char name[128];

    if (lk == NULL || lk->done || lk->rx.confirming || lk->rx.done_waiting ||
        (lk->ends & (1u << k))) {
        kvf__room_fail(r, KVF_ERR_PROTOCOL, "%s sent %s DONE for room %llu",
                       kvf__peer_name(p, name, sizeof(name)),
                       lk ? "a second" : "an unexpected", (unsigned long long)r->id);
        return;
    }
    if (lk->rx.reads > 0) {
        /* The DONE follows the frames in the stream, but their bytes are
         * still being read: judge once they are in (pulled: one stream). */
        lk->rx.done_waiting = 1;
        lk->rx.done_bytes = m->bytes;
        lk->rx.done_has_checksum = m->has_checksum;
        lk->rx.done_checksum = m->checksum;
        return;
    }
    check_done(p, r, lk, k, m->bytes, m->has_checksum, m->checksum);
}

/* The set bits of c in [lo, hi). */
static uint64_t bits_set(const uint8_t *c, uint64_t lo, uint64_t hi)
{
    uint64_t n = 0;
    for (uint64_t i = lo; i < hi; i++)
        n += (c[i >> 3] >> (i & 7)) & 1;
    return n;
}

/*
 * What a link's coverage still lacks of the room's KV, for a reason:
 * "; layer 3 V has 8 of 24 of its tokens from it (and 5 more KV buffers
 * are short)", the lowest layer short named (a prefill sending layer by
 * layer that stopped).  @return 0 when every token it owes is in.
 */
static int kv_short(kvf_room_t *r, const kvf_link_t *lk, char *buf, size_t len)
{
    const kvf_receiver_t *rv = receiver_of(r);
    const kvf_layout_int_t *l = &r->eng->layout;
    uint64_t per = (uint64_t)rv->n_pages * l->page_size, have = 0;
    uint32_t first = UINT32_MAX, more = 0;
    char tb[64];
    if (lk->rx.cover == NULL || lk->peer == NULL || lk->peer->kv_src == NULL)
        return 0;
    for (uint32_t b = 0; b < l->num_kv; b++) {
        uint64_t got = lk->peer->kv_src[b] == UINT32_MAX ? per
                                                         : bits_set(lk->rx.cover, b * per,
                                                                    (b + 1) * per);
        if (got == per)
            continue;
        if (first != UINT32_MAX && l->kv_slot[first] <= l->kv_slot[b]) {
            more++;
            continue;
        }
        more += first != UINT32_MAX;
        first = b;
        have = got;
    }
    if (first == UINT32_MAX)
        return 0;
    char also[64] = "";
    if (more > 0)
        snprintf(also, sizeof(also), " (and %u more KV buffers are short)", more);
    snprintf(buf, len, "; %s has %llu of %llu of its tokens from it%s",
             kvf__tag_name(&l->tags[first], tb, sizeof(tb)), (unsigned long long)have,
             (unsigned long long)per, also);
    return 1;
}

/*
 * The DONE of stream k with every byte of that stream before it in place:
 * compare its count and checksum with what came on that stream.  Once
 * every stream's DONE has checked, the link's total must be what the room
 * expects (each unit was counted once, cover_mark): then answer.
 */
static void check_done(kvf_peer_t *p, kvf_room_t *r, kvf_link_t *lk, uint32_t k,
                       uint64_t bytes, int has_checksum, uint64_t checksum)
{
    char name[128], on[48] = "";
    kvf__peer_name(p, name, sizeof(name));
    if (lk->nstreams > 1)
        snprintf(on, sizeof(on), " on stream %u of %u", k, lk->nstreams);

    if (bytes != lk->stream_bytes[k] || (lk->nstreams == 1 && bytes != lk->rx.expected)) {
        char lack[160] = "";
        kv_short(r, lk, lack, sizeof(lack));
        kvf__room_fail(r, KVF_ERR_INCOMPLETE, "incomplete transfer from %s%s: it reported "
                       "%llu bytes, %llu were placed, room %llu expects %llu%s", name, on,
                       (unsigned long long)bytes, (unsigned long long)lk->stream_bytes[k],
                       (unsigned long long)r->id, (unsigned long long)lk->rx.expected,
                       lack);
        return;
    }
    if (lk->hash[k] != NULL) {
        uint64_t got = XXH3_64bits_digest(lk->hash[k]);
        if (!has_checksum || got != checksum) {
            kvf__room_fail(r, KVF_ERR_CHECKSUM, "checksum mismatch on the %llu bytes "
                           "from %s%s: sender %s%016llx, receiver %016llx",
                           (unsigned long long)lk->stream_bytes[k], name, on,
                           has_checksum ? "" : "sent none, ",
                           (unsigned long long)checksum, (unsigned long long)got);
            return;
        }
    }
    lk->ends |= 1u << k;
    if (lk->ends != (1u << lk->nstreams) - 1)
        return;                    /* other streams' DONEs to come */
    if (lk->bytes != lk->rx.expected) {
        char lack[160] = "";
        kv_short(r, lk, lack, sizeof(lack));
        kvf__room_fail(r, KVF_ERR_INCOMPLETE, "incomplete transfer from %s: its %u streams "
                       "carried %llu bytes, room %llu expects %llu%s", name, lk->nstreams,
                       (unsigned long long)lk->bytes, (unsigned long long)r->id,
                       (unsigned long long)lk->rx.expected, lack);
        return;
    }
    kvf_msg_t ack = {.type = KVF_MSG_DONE_ACK};
    ack.u.done_ack.room = r->id;
    ack.u.done_ack.instance = r->instance;
    ack.u.done_ack.status = KVF_OK;
    ack.u.done_ack.bytes = lk->bytes;
    kvf__peer_send(p, &ack);
    kvf__trace_peer_event(r, "ack_sent", p, -1, -1, (int64_t)lk->bytes);
    /*
     * Pulled bytes were read from the sender's memory, which is the
     * sender's only while its room is live: if it failed meanwhile (this
     * process was stopped, say) and the pages went to another request,
     * what we read may be anything.  Only the sender can say, so a pull
     * link waits for its confirmation (DONE_ACK back) before SUCCESS.
     */
    if (kvf__peer_pulls(p)) {
        lk->rx.confirming = 1;
        return;
    }
    /* Pushed bytes are all here: SUCCESS now.  The answer is kept until
     * the sender confirms it, to be said again if it is lost with its
     * connection (acks.c). */
    kvf__acks_owe(p, r->id, r->instance, lk->bytes);
    lk->done = 1;
    if (all_done(r))
        kvf__room_set_state(r, KVF_POLL_SUCCESS);
}

/* A prefill rank confirms its room was live when our DONE_ACK arrived
 * (pull transports: the bytes we read were still its room's). */
static void on_confirm(kvf_peer_t *p, kvf_room_t *r, const kvf_msg_done_ack_t *m)
{
    kvf_link_t *lk = link_of(r, p);
    char name[128];

    if (lk == NULL || !lk->rx.confirming || m->status != KVF_OK) {
        kvf__room_fail(r, KVF_ERR_PROTOCOL, "%s sent an unexpected confirmation for room "
                       "%llu", kvf__peer_name(p, name, sizeof(name)),
                       (unsigned long long)r->id);
        return;
    }
    lk->rx.confirming = 0;
    lk->done = 1;
    kvf__trace_peer_event(r, "confirmed", p, -1, -1, -1);
    if (all_done(r))
        kvf__room_set_state(r, KVF_POLL_SUCCESS);
}

/* ---- the decode side's room ops (room.h, kvf_room_ops_t) ---------------- */

/* Taken in: a room created by its registry's address asks the resolver
 * for the prefill ranks; one created by descriptors is linked to the
 * ranks they named (checked by kvf_receiver_create_remote). */
static void receiver_open(kvf_room_t *r)
{
    kvf_receiver_t *rv = receiver_of(r);
    if (!rv->remote) {
        kvf__resolver_enqueue(r->eng, r);
        return;
    }
    receiver_link(r, rv->targets, rv->ntargets);
    free(rv->targets);
    rv->targets = NULL;
}

/* Fresh per receiver: the instance every frame of this room will name. */
static void receiver_init(kvf_room_t *r)
{
    r->instance = kvf__room_new_instance(r->eng);
    receiver_of(r)->ok_first = 1;    /* empty: no page range checked yet */
    receiver_of(r)->ok_last = 0;
}

/* A prefill rank's DONE: judged once the room asked that rank, under this
 * room's instance (room.c, "Ownership"). */
static void take_done(kvf_peer_t *p, kvf_room_t *r, const kvf_msg_done_t *m)
{
    kvf_link_t *lk = r ? link_of(r, p) : NULL;
    if (r == NULL || room_final(r))
        return;
    if (lk == NULL || !lk->rx.req_sent)
        kvf__room_dropped(p, "DONE", m->room, m->instance, "the room did not ask this peer");
    else if (m->instance != r->instance)
        kvf__room_dropped(p, "DONE", m->room, m->instance, "it names another instance "
                          "of the room (an earlier room with this id)");
    else
        on_done(p, r, m);
}

/* A prefill rank's DONE_ACK: the confirmation of a push link's answer
 * (acks.c), or of a pull link's (on_confirm). */
static void take_confirm(kvf_peer_t *p, kvf_room_t *r, const kvf_msg_done_ack_t *m)
{
    kvf_link_t *lk = r ? link_of(r, p) : NULL;
    if (kvf__acks_confirmed(p, m))
        return;                    /* a push link's answer arrived */
    if (r == NULL || room_final(r))
        return;
    if (lk == NULL || !lk->rx.req_sent)
        kvf__room_dropped(p, "DONE_ACK", m->room, m->instance,
                          "the room did not ask this peer");
    else if (m->instance != r->instance)
        kvf__room_dropped(p, "DONE_ACK", m->room, m->instance, "it names another "
                          "instance of the room (an earlier room with this id)");
    else
        on_confirm(p, r, m);
}

/* A FAIL or ABORT on a decode engine, from a prefill rank the room links
 * to or watches (siblings.c). */
static void take_fail(kvf_peer_t *p, kvf_room_t *r, int abort, const kvf_msg_fail_t *m)
{
    const char *what = abort ? "ABORT" : "FAIL";
    kvf_link_t *lk = r ? link_of(r, p) : NULL;

    if (r == NULL)
        return;                        /* nothing to fail */
    /* A room that failed still takes what its bound peers tell of where
     * else it failed (kvf__room_fail_record), and drops the rest quietly. */
    if (lk == NULL && !kvf__siblings_bound(r, p, m->instance)) {
        if (room_state(r) != KVF_POLL_FAILED)
            kvf__room_dropped(p, what, m->room, m->instance,
                              "the room did not ask this peer");
    } else if (m->instance != r->instance) {
        kvf__room_dropped(p, what, m->room, m->instance, "it names another instance "
                          "of the room (an earlier room with this id)");
    } else {
        kvf__room_fail_remote(r, p, abort, m);
    }
}

/* A decode engine takes DONEs, confirmations and failures; a ROOM_REQ is
 * for a prefill engine. */
static kvf_verdict_t receiver_on_msg(kvf_peer_t *p, kvf_room_t *r, const kvf_msg_t *msg)
{
    switch (msg->type) {
    case KVF_MSG_DONE:
        take_done(p, r, &msg->u.done);
        return kvf__verdict_ok();
    case KVF_MSG_DONE_ACK:
        take_confirm(p, r, &msg->u.done_ack);
        return kvf__verdict_ok();
    case KVF_MSG_FAIL:
    case KVF_MSG_ABORT:
        take_fail(p, r, msg->type == KVF_MSG_ABORT, &msg->u.fail);
        return kvf__verdict_ok();
    default:
        return kvf__room_unexpected(p, msg);
    }
}

static void receiver_release_rx(kvf_peer_t *p)
{
    kvf__bounce_put(p->eng, p->rx_bounce, p->rx_bounce_cap);
    p->rx_bounce = NULL;
}

/* Every peer knows a receiver by its own instance. */
static uint64_t receiver_instance_for(kvf_room_t *r, const kvf_peer_t *to)
{
    (void)to;
    return r->instance;
}

/* A held room's request key (kvf_receiver_create_remote), or 0. */
static uint64_t receiver_fail_key(const kvf_room_t *r)
{
    return ((const kvf_receiver_t *)r)->sender_instance;
}

/* A receiver that never acknowledged a prefill rank's DONE (or never
 * reached every prefill rank) leaves that rank without its success.  A
 * held room's ranks have no siblings to tell. */
static uint8_t receiver_doomed_side(kvf_room_t *r)
{
    if (receiver_of(r)->remote)
        return 0;
    if (r->nlinks < r->expected_links)
        return KVF_SIDE_BIT(KVF_ROLE_PREFILL);
    for (uint32_t i = 0; i < r->nlinks; i++)
        if (!r->links[i].done && !r->links[i].rx.confirming)
            return KVF_SIDE_BIT(KVF_ROLE_PREFILL);
    return 0;
}

/* The receiver reconnects itself, after a delay that doubles each time. */
static uint64_t receiver_retry_at(kvf_room_t *r, uint64_t now)
{
    return now + (RETRY_BASE_MS << (r->retries - 1));
}

/* Reconnect the broken links of a room and ask to resume. */
static void reconnect(kvf_room_t *r)
{
    kvf_engine_t *eng = r->eng;
    for (uint32_t i = 0; i < r->nlinks; i++) {
        kvf_link_t *lk = &r->links[i];
        char host[KVF_ADDR_MAX];
        char *colon;
        if (!lk->broken)
            continue;
        snprintf(host, sizeof(host), "%s", lk->peer->addr);
        colon = strrchr(host, ':');
        if (colon == NULL) {
            kvf__room_fail(r, KVF_ERR_UNREACHABLE, "no address to reconnect to");
            return;
        }
        *colon = '\0';
        kvf_peer_t *p = kvf__peer_get(eng, host, atoi(colon + 1), lk->peer->tp_rank, 0);
        if (p == NULL) {
            kvf__room_fail(r, KVF_ERR_NO_MEMORY, "no memory to reconnect");
            return;
        }
        if (lk->rx.resume_instance == 0)
            lk->rx.resume_instance = lk->peer->instance_id;
        kvf__peer_put(lk->peer);
        lk->peer = p;
        p->refs++;
        lk->broken = 0;
        lk->rx.req_sent = 0;
    }
    kvf_info("room %llu: reconnecting (attempt %u of %u)", (unsigned long long)r->id,
             r->retries, MAX_RETRIES);
    kvf__receiver_try_request(r);
}

/* Every prefill rank of the room has its destination. */
static int asked_all(const kvf_room_t *r)
{
    for (uint32_t i = 0; i < r->nlinks; i++)
        if (!r->links[i].rx.req_sent)
            return 0;
    return r->nlinks > 0;
}

static int receiver_tick(kvf_room_t *r, uint64_t now)
{
    kvf_verdict_t v;
    /* Again after a failure that found no memory: the watches after the
     * lost one are dialled too. */
    while (!room_final(r) && kvf__siblings_tick(r, now, &v))
        kvf__room_fail_lost(r, KVF_ROLE_PREFILL, v.st, "%s", v.why);
    if (!room_final(r) && has_broken_link(r) && now >= r->retry_at_ms)
        reconnect(r);
    /* A held room's, asked: its lease, or its deadlines, end it, and say so. */
    return room_state(r) == KVF_POLL_WAITING_FOR_INPUT && receiver_of(r)->remote &&
           asked_all(r);
}

/* Bootstrapping: a prefill rank it waits for refused it at the door. */
static int refused_detail(const kvf_room_t *r, char *buf, size_t len)
{
    for (uint32_t i = 0; i < r->nlinks; i++)
        if (kvf__peer_refusals(r->links[i].peer, buf, len))
            return 1;
    return 0;
}

static int awaiting_confirmation(const kvf_room_t *r)
{
    for (uint32_t i = 0; i < r->nlinks; i++)
        if (r->links[i].rx.confirming)
            return 1;
    return 0;
}

/* The first link still owed KV, as kv_short says it, after its peer's
 * name: "; from prefill rank 1: layer 3 V has ...", or "". */
static const char *kv_lacks(kvf_room_t *r, char *buf, size_t len)
{
    char name[128], lack[160];
    for (uint32_t i = 0; i < r->nlinks; i++) {
        const kvf_link_t *lk = &r->links[i];
        if (!lk->done && lk->rx.req_sent && kv_short(r, lk, lack, sizeof(lack))) {
            snprintf(buf, len, "; from %s: %s", kvf__peer_name(lk->peer, name, sizeof(name)),
                     lack + 2);
            return buf;
        }
    }
    return "";
}

static void receiver_deadline_detail(kvf_room_t *r, kvf_poll_t s, char *buf, size_t len)
{
    char lack[320];
    if (s == KVF_POLL_BOOTSTRAPPING && r->last_err == NULL && refused_detail(r, buf, len))
        return;
    if (s == KVF_POLL_BOOTSTRAPPING)
        snprintf(buf, len, "%s", r->last_err ? r->last_err
                 : !r->initialized ? "kvf_receiver_init was not called"
                 : "waiting for the prefill rank's handshake");
    else if (s == KVF_POLL_WAITING_FOR_INPUT)
        snprintf(buf, len, "no data from the prefill side yet");
    else if (awaiting_confirmation(r))
        snprintf(buf, len, "every byte was read, but the prefill side did not "
                 "confirm its room was still live while it was read");
    else
        snprintf(buf, len, "no bytes placed since%s", kv_lacks(r, lack, sizeof(lack)));
}

const kvf_room_ops_t kvf_receiver_room_ops = {
    .side            = KVF_ROLE_DECODE,
    .size            = sizeof(kvf_receiver_t),
    .on_msg          = receiver_on_msg,
    .on_data         = receiver_on_data,
    .on_data_end     = receiver_on_data_end,
    .on_data_ref     = receiver_on_data_ref,
    .release_rx      = receiver_release_rx,
    .read_take       = receiver_read_take,
    .init            = receiver_init,
    .open            = receiver_open,
    .free            = receiver_free,
    .instance_for    = receiver_instance_for,
    .fail_key        = receiver_fail_key,
    .doomed_side     = receiver_doomed_side,
    .retry_at        = receiver_retry_at,
    .peer_ready      = kvf__receiver_try_request,
    .tick            = receiver_tick,
    .deadline_detail = receiver_deadline_detail,
    .take            = receiver_take,
    .resolved        = receiver_resolved,
};
