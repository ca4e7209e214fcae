/*
 * A prefill engine's tombs (room.h): the failure records of destroyed
 * senders it keeps, the last KVF_TOMBS burials, to answer late requests
 * with the room's true reason.  A room id buried twice has two slots in
 * the ring; its older slot falling out must not take the newer record.
 */
#include <stdio.h>
#include <string.h>

#include "core/room.h"
#include "unit/kvf_test.h"

/* Bury a failed sender of `id` with reason `why` (what
 * kvf_sender_destroy does for a failed room). */
static void bury(kvf_engine_t *eng, uint64_t id, const char *why)
{
    kvf_room_t r;
    kvf_failure_t f = {.size = sizeof(f), .status = KVF_ERR_ABORTED};
    memset(&r, 0, sizeof(r));
    r.eng = eng;
    r.id = id;
    r.failure = &f;
    snprintf(f.reason, sizeof(f.reason), "%s", why);
    kvf__sender_bury(&r);
}

static const char *tomb_reason(kvf_engine_t *eng, uint64_t id)
{
    const kvf_tomb_t *t = kvf_map_get(&eng->tombs, id);
    return t ? t->f.reason : NULL;
}

static void test_reburied_id_outlives_its_old_slot(void)
{
    kvf_engine_params_t p;
    kvf_engine_t *eng;
    kvf_engine_params_init(&p);
    p.bootstrap_addr = "127.0.0.1:0";
    p.host_bootstrap = 1;
    CHECK_EQ_INT(kvf_engine_create(&p, &eng), KVF_OK);

    kvf__lock(eng);
    bury(eng, 7, "first");
    bury(eng, 7, "second");             /* the id reused, failed again */
    CHECK_STR_CONTAINS(tomb_reason(eng, 7), "second");
    /* Push the first burial of 7 out of the ring. */
    for (uint64_t id = 1000; id < 1000 + KVF_TOMBS - 1; id++)
        bury(eng, id, "other");
    CHECK_STR_CONTAINS(tomb_reason(eng, 7), "second");
    CHECK(tomb_reason(eng, 1000) != NULL);
    /* One more: now the second burial of 7 is the oldest, and goes. */
    bury(eng, 5000, "other");
    CHECK(tomb_reason(eng, 7) == NULL);
    CHECK(tomb_reason(eng, 1000) != NULL);
    bury(eng, 5001, "other");
    CHECK(tomb_reason(eng, 1000) == NULL);
    CHECK(tomb_reason(eng, 1001) != NULL);
    kvf__unlock(eng);
    kvf_engine_destroy(eng);
}

KVF_TEST_MAIN(KVF_CASE(test_reburied_id_outlives_its_old_slot))
