/*
 * Where the engine's connections and mover endpoints open, and the one
 * place that puts the fault transport (transport/fault) around them: an
 * engine with injected faults gets every control connection and every
 * decode endpoint wrapped as it opens, the way libfabric's hook providers
 * sit under an application that never asks for them.  Core hands over its
 * opaque kvf_faults_t and never names the fault transport.
 */
#include "transport/fault/fault.h"
#include "transport/mover.h"
#include "transport/transport.h"

kvf_status_t kvf_transport_faults_parse(const char *spec, kvf_faults_t **faults_p,
                                        char *err, size_t errlen)
{
    return kvf_fault_parse(spec, faults_p, err, errlen);
}

void kvf_transport_faults_free(kvf_faults_t *faults)
{
    kvf_fault_free(faults);
}

kvf_status_t kvf_control_connect(kvf_faults_t *faults, const char *host, int port,
                                 const kvf_conn_env_t *env, const kvf_conn_handler_t *h,
                                 void *arg, kvf_conn_t **conn_p)
{
    if (faults != NULL)
        return kvf_fault_connect(faults, kvf_control_ops, host, port, env, h, arg, conn_p);
    return kvf_control_ops->connect(host, port, env, h, arg, conn_p);
}

kvf_status_t kvf_control_accept(kvf_faults_t *faults, int fd, const kvf_conn_env_t *env,
                                const kvf_conn_handler_t *h, void *arg, kvf_conn_t **conn_p)
{
    if (faults != NULL)
        return kvf_fault_accept(faults, kvf_control_ops, fd, env, h, arg, conn_p);
    return kvf_control_ops->accept(fd, env, h, arg, conn_p);
}

kvf_status_t kvf_mover_connect(kvf_faults_t *faults, kvf_mover_t *m, const uint8_t *blob,
                               size_t len, kvf_mover_ep_t **ep_p, char *why, size_t whylen)
{
    kvf_status_t st = m->ops->connect(m, blob, len, ep_p, why, whylen);
    if (st == KVF_OK)
        kvf_fault_wrap_ep(faults, ep_p);   /* read faults, if any */
    return st;
}
