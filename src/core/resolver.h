/*
 * The resolver, internal (resolver.c): the thread that makes an engine's
 * blocking registry calls, registering a prefill engine and looking up
 * the prefill ranks a decode room reads from, and the rule that maps a
 * decode rank onto those ranks.
 *
 * This header names the engine and the room only as structs, so that
 * engine.c and receiver.c can include it without it seeing either's
 * internals.
 */
#ifndef KVF_CORE_RESOLVER_H
#define KVF_CORE_RESOLVER_H

#include <stdint.h>

#include "kvferry/kvferry.h"

struct kvf_room;

/* Check the registration parameters of p (a full-size copy).
 * @return KVF_OK or KVF_ERR_INVALID_PARAM, logged. */
kvf_status_t kvf__registration_check(const kvf_engine_params_t *p);
/* Give eng->params' registration fields their defaults (KVF_* variables)
 * and copy its strings into eng. */
void         kvf__registration_setup_unlocked(kvf_engine_t *eng);
kvf_status_t kvf__resolver_start_unlocked(kvf_engine_t *eng);
/* Destroy: stop the resolver thread (takes the lock). */
void         kvf__resolver_stop(kvf_engine_t *eng);
/* Queue a receiver for the lookup of its prefill ranks; the queue holds
 * a reference to the room until the resolver is done with it. */
void         kvf__resolver_enqueue(kvf_engine_t *eng, struct kvf_room *room);

/* The prefill ranks (tp[i], pp[i]) that decode engine `eng` reads a room
 * from, of a prefill server of TP size prefill_tp and PP size prefill_pp;
 * `heads` the model's KV heads as the engine knows them (0: guessed,
 * kvf__receiver_try_request checks).  @return how many, or -1 when they
 * would be more than KVF_MAX_TARGETS. */
int          kvf__receiver_targets_unlocked(const kvf_engine_t *eng, uint32_t heads,
                                            int prefill_tp, int prefill_pp, int *tp, int *pp);

#endif /* KVF_CORE_RESOLVER_H */
