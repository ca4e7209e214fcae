/*
 * Failure records and dropped room messages: the leaves of room.c's
 * failure handling, which the sides (sender.c, receiver.c), the stash and
 * the siblings use too.
 *
 * A record is made here (kvf__failure_set: a root cause seen on this
 * engine; kvf__room_remote_failure: one a FAIL brought) and sent to a peer
 * from here (kvf__room_send_fail); what it does to a room, and who else
 * must hear of it, is room.c's (kvf__room_fail_record).  The one idea: this
 * file calls nothing above it, only peer.c below (which never calls it).
 * So siblings.c and stash.c, which room.c calls, use these without calling
 * back into room.c: core's files call each other one way
 * (tests/structure/one_way.sh).  Everything here runs under the engine
 * lock, but the _unlocked ones (what they read does not change once the
 * engine runs).
 */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/room.h"
#include "core/sync.h"
#include "util/log.h"
#include "util/time.h"

/* ------------------------------------------------------------------------ */
/* Records                                                               */
/* ------------------------------------------------------------------------ */

void kvf__failure_vset_unlocked(kvf_failure_t *f, const kvf_engine_t *eng, kvf_status_t st,
                                const char *fmt, va_list ap)
{
    memset(f, 0, sizeof(*f));
    f->size = sizeof(*f);
    f->status = st;
    f->origin_side = eng->params.role;
    f->origin_rank = eng->params.tp_rank;
    snprintf(f->origin_addr, sizeof(f->origin_addr), "%s", eng->addr);
    vsnprintf(f->reason, sizeof(f->reason), fmt, ap);
}

void kvf__failure_set(kvf_failure_t *f, const kvf_engine_t *eng, kvf_status_t st,
                      const char *fmt, ...)
{
    KVF_ASSERT_LOCKED(eng);
    va_list ap;
    va_start(ap, fmt);
    kvf__failure_vset_unlocked(f, eng, st, fmt, ap);
    va_end(ap);
}

void kvf__failure_set_unlocked(kvf_failure_t *f, const kvf_engine_t *eng, kvf_status_t st,
                               const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    kvf__failure_vset_unlocked(f, eng, st, fmt, ap);
    va_end(ap);
}

kvf_failure_t *kvf__room_remote_failure(const kvf_msg_fail_t *m)
{
    kvf_failure_t *f = calloc(1, sizeof(*f));
    if (f == NULL)
        return NULL;
    f->size = sizeof(*f);
    f->status = (kvf_status_t)m->status;
    f->origin_side = (kvf_role_t)m->origin_side;
    f->origin_rank = (int)m->origin_rank;
    f->from_another_rank = 1;
    snprintf(f->origin_addr, sizeof(f->origin_addr), "%.*s", (int)m->origin_addr.len,
             m->origin_addr.ptr);
    snprintf(f->reason, sizeof(f->reason), "%.*s", (int)m->reason.len, m->reason.ptr);
    return f;
}

/* ------------------------------------------------------------------------ */
/* Telling a peer                                                        */
/* ------------------------------------------------------------------------ */

int kvf__room_send_fail(kvf_room_t *r, kvf_peer_t *to, int abort)
{
    KVF_ASSERT_LOCKED(r->eng);
    return kvf__peer_send_fail(to, r->id, r->ops->instance_for(r, to), r->ops->fail_key(r),
                               r->failure, abort, r->failed_sides);
}

/* ------------------------------------------------------------------------ */
/* Messages dropped, instances retired                                   */
/* ------------------------------------------------------------------------ */

void kvf__room_dropped(kvf_peer_t *p, const char *what, uint64_t room, uint64_t instance,
                       const char *why)
{
    KVF_ASSERT_LOCKED(p->eng);
    kvf_engine_t *eng = p->eng;
    char name[128];
    uint64_t now = kvf_now_ms();
    eng->room_msgs_dropped++;
    if (eng->drop_log_ms != 0 && now - eng->drop_log_ms < KVF_DROP_LOG_MS) {
        eng->drops_unlogged++;
        return;
    }
    kvf_warn("dropped %s for room %llu (instance %016llx) from %s: %s (%llu more room "
             "messages dropped since the last such line)", what, (unsigned long long)room,
             (unsigned long long)instance, kvf__peer_name(p, name, sizeof(name)), why,
             (unsigned long long)eng->drops_unlogged);
    eng->drop_log_ms = now;
    eng->drops_unlogged = 0;
}

int kvf__instance_retired(const kvf_engine_t *eng, uint64_t instance)
{
    KVF_ASSERT_LOCKED(eng);
    return instance != 0 && kvf_map_get(&eng->retired, instance) != NULL;
}

void kvf__room_retire_instances(kvf_room_t *r)
{
    KVF_ASSERT_LOCKED(r->eng);
    kvf_engine_t *eng = r->eng;
    for (uint32_t i = 0; i < r->nlinks; i++) {
        uint64_t inst = r->links[i].tx.instance;
        if (inst == 0 || kvf__instance_retired(eng, inst))
            continue;
        if (eng->nretired == KVF_RETIRED) {
            kvf_map_del(&eng->retired, eng->retired_ring[eng->retired_head]);
            eng->retired_head = (eng->retired_head + 1) % KVF_RETIRED;
            eng->nretired--;
        }
        if (kvf_map_put(&eng->retired, inst, (void *)(uintptr_t)1) != KVF_OK)
            return;
        eng->retired_ring[(eng->retired_head + eng->nretired) % KVF_RETIRED] = inst;
        eng->nretired++;
    }
}
