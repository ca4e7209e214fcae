/*
 * A decode rank's owed acknowledgements (acks.c): the DONE_ACKs it keeps
 * per prefill peer until that rank confirms them.  Bounded two ways: at
 * most KVF_ACKS_OWED per peer (one more drops the oldest), none older
 * than two heartbeat timeouts; and a confirmation takes only the answer
 * it names (room, instance and bytes).  The peer here is a bare struct on
 * a real engine: nothing is sent, only the ring is looked at.
 */
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "core/room.h"
#include "unit/kvf_test.h"

static kvf_engine_t *decode_engine(void)
{
    kvf_engine_params_t p;
    kvf_engine_t *eng = NULL;
    kvf_engine_params_init(&p);
    p.role = KVF_ROLE_DECODE;
    p.transport = "tcp";
    CHECK_EQ_INT(kvf_engine_create(&p, &eng), KVF_OK);
    return eng;
}

/* Does p's prefill rank confirming (room, room + 1000, bytes) take one? */
static int confirm(kvf_peer_t *p, uint64_t room, uint64_t bytes)
{
    kvf_msg_done_ack_t m = {.room = room, .instance = room + 1000, .status = KVF_OK,
                            .bytes = bytes};
    return kvf__acks_confirmed(p, &m);
}

static void owe(kvf_peer_t *p, uint64_t room)
{
    kvf__acks_owe(p, room, room + 1000, 4096);
}

/* The one past KVF_ACKS_OWED drops the oldest, and only it. */
static void test_one_more_drops_the_oldest(void)
{
    kvf_engine_t *eng = decode_engine();
    if (eng == NULL)
        return;
    kvf_peer_t p;
    memset(&p, 0, sizeof(p));
    p.eng = eng;
    kvf__lock(eng);
    for (uint64_t room = 1; room <= KVF_ACKS_OWED + 1; room++)
        owe(&p, room);
    CHECK_EQ_INT(confirm(&p, 1, 4096), 0);              /* dropped */
    CHECK_EQ_INT(confirm(&p, 2, 4096), 1);              /* the oldest kept */
    CHECK_EQ_INT(confirm(&p, KVF_ACKS_OWED + 1, 4096), 1);
    kvf__unlock(eng);
    free(p.owed);
    kvf_engine_destroy(eng);
}

/* One older than two heartbeat timeouts is gone at the next owe. */
static void test_old_ones_are_pruned(void)
{
    kvf_engine_t *eng = decode_engine();
    if (eng == NULL)
        return;
    kvf_peer_t p;
    memset(&p, 0, sizeof(p));
    p.eng = eng;
    kvf__lock(eng);
    unsigned hb = eng->params.heartbeat_timeout_ms;
    eng->params.heartbeat_timeout_ms = 1;               /* a window of 2 ms */
    owe(&p, 1);
    nanosleep(&(struct timespec){0, 20 * 1000000}, NULL);
    owe(&p, 2);
    CHECK_EQ_INT(confirm(&p, 1, 4096), 0);
    CHECK_EQ_INT(confirm(&p, 2, 4096), 1);
    eng->params.heartbeat_timeout_ms = hb;
    kvf__unlock(eng);
    free(p.owed);
    kvf_engine_destroy(eng);
}

/* A confirmation takes the answer it names, once, and no other. */
static void test_confirmation_takes_only_its_match(void)
{
    kvf_engine_t *eng = decode_engine();
    if (eng == NULL)
        return;
    kvf_peer_t p;
    memset(&p, 0, sizeof(p));
    p.eng = eng;
    kvf__lock(eng);
    CHECK_EQ_INT(confirm(&p, 1, 4096), 0);              /* nothing owed yet */
    owe(&p, 1);
    owe(&p, 2);
    owe(&p, 3);
    kvf_msg_done_ack_t m = {.room = 2, .instance = 1002, .status = KVF_OK, .bytes = 4096};
    m.instance = 1003;                                  /* another instance of room 2 */
    CHECK_EQ_INT(kvf__acks_confirmed(&p, &m), 0);
    m.instance = 1002;
    m.bytes = 4095;                                     /* another byte count */
    CHECK_EQ_INT(kvf__acks_confirmed(&p, &m), 0);
    m.bytes = 4096;
    m.status = KVF_ERR_ABORTED;                         /* not a confirmation */
    CHECK_EQ_INT(kvf__acks_confirmed(&p, &m), 0);
    CHECK_EQ_INT(confirm(&p, 2, 4096), 1);              /* the middle one */
    CHECK_EQ_INT(confirm(&p, 2, 4096), 0);              /* once */
    CHECK_EQ_INT(confirm(&p, 1, 4096), 1);              /* its neighbours stay */
    CHECK_EQ_INT(confirm(&p, 3, 4096), 1);
    kvf__unlock(eng);
    free(p.owed);
    kvf_engine_destroy(eng);
}

KVF_TEST_MAIN(KVF_CASE(test_one_more_drops_the_oldest), KVF_CASE(test_old_ones_are_pruned),
              KVF_CASE(test_confirmation_takes_only_its_match))
