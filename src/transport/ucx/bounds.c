/*
 * Does UCX check remote keys here?  A prefill engine asks before it offers
 * ucx to anyone, because its offer (worker address and remote keys) lets
 * the peer reach its memory through whatever transport UCX picks, and
 * only some transports confine that peer to the registered regions.
 *
 * The one idea: ask UCX, never guess from UCX_TLS.  UCX reports the
 * transports it selected for the context (ucp_context_print_info: each
 * resource with its memory domain), and UCT reports, for each, the device
 * type, the memory domain's key (UCT_MD_FLAG_NEED_RKEY, the packed key's
 * size) and whether the transport reads remote memory itself
 * (UCT_IFACE_FLAG_GET_*).  kvf_ucx_bounds_enforced() then decides from
 * those attributes alone, so the decision is testable with any of them.
 *
 * What UCX does with each kind (UCX 1.13 through today, from its source):
 *
 *   - an RDMA transport (rc, dc): the NIC reads with the remote key of a
 *     memory region, and refuses an address outside it;
 *   - a network transport without RMA of its own (tcp, ud): UCX emulates
 *     gets and puts with active messages (ucp/rma/rma_sw.c), whose handler
 *     on the target copies from or to whatever address the message names;
 *     tcp's memory domain packs an empty (0-byte) key, so no check at all;
 *   - shared-memory transports (cma, posix, sysv, xpmem, knem): same-host
 *     access that UCX does not confine to the region (cma reads any
 *     address with process_vm_readv, xpmem exports the whole address
 *     space, posix/sysv cannot register the engine's buffers at all and
 *     fall back to the emulation above);
 *   - self, and accelerator copies (cuda_copy, gdr_copy): only this process
 *     reaches them, a peer never does.
 */
#include "transport/ucx/bounds.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <ucs/async/async_fwd.h>
#include <uct/api/uct.h>

#include "util/log.h"

/* ------------------------------------------------------------- the verdict */

static int md_keyed(const kvf_ucx_tl_t *t)
{
    return (t->md_flags & UCT_MD_FLAG_REG) && (t->md_flags & UCT_MD_FLAG_NEED_RKEY) &&
           t->rkey_size > 0;
}

/* 1: a peer reaching us over t reads only what a remote key it was given
 * covers, and the hardware checks that key. */
static int tl_enforces(const kvf_ucx_tl_t *t)
{
    const uint64_t gets = UCT_IFACE_FLAG_GET_SHORT | UCT_IFACE_FLAG_GET_BCOPY |
                          UCT_IFACE_FLAG_GET_ZCOPY;
    if (t->dev_type != UCT_DEVICE_TYPE_NET || !md_keyed(t))
        return 0;
    /* An auxiliary transport only carries connection setup (ud beside rc). */
    return t->aux || (t->iface_flags & gets) != 0;
}

int kvf_ucx_bounds_enforced(const kvf_ucx_tl_t *tls, size_t n, char *why, size_t whylen)
{
    size_t len = 0, net = 0, bad = 0;
    why[0] = '\0';
    for (size_t i = 0; i < n; i++) {
        const kvf_ucx_tl_t *t = &tls[i];
        if (t->dev_type == UCT_DEVICE_TYPE_SELF || t->dev_type == UCT_DEVICE_TYPE_ACC)
            continue;   /* only this process reaches them */
        if (tl_enforces(t)) {
            net++;
            continue;
        }
        if (len < whylen)
            len += (size_t)snprintf(why + len, whylen - len, "%s%s/%s", bad ? ", " : "",
                                    t->tl, t->dev);
        bad++;
    }
    if (bad == 0 && net == 0)
        snprintf(why, whylen, "no network transport that reads remote memory in hardware");
    return bad == 0 && net > 0;
}

/* ------------------------------------------------------ what UCX reports */

#define MAX_CMPTS 32
#define MAX_MDS   32

typedef struct names {
    char cmpt[MAX_CMPTS][UCT_COMPONENT_NAME_MAX];
    int  ncmpts;
    char md[MAX_MDS][UCT_MD_NAME_MAX];
    int  md_cmpt[MAX_MDS];
    int  nmds;
} names_t;

/*
 * One line of ucp_context_print_info: a component, a memory domain or a
 * transport resource (tl/dev on memory domain N, 'a' when auxiliary).
 * Its format has been the same from UCX 1.9 to today.
 */
static void parse_line(const char *line, names_t *nm, kvf_ucx_tl_t *tls, size_t max,
                       size_t *n)
{
    int idx, ref, dev;
    char name[64], aux, sock, tldev[96];
    if (sscanf(line, "# component %d : %63s", &idx, name) == 2) {
        if (idx >= 0 && idx < MAX_CMPTS) {
            snprintf(nm->cmpt[idx], sizeof(nm->cmpt[idx]), "%s", name);
            nm->ncmpts = idx + 1 > nm->ncmpts ? idx + 1 : nm->ncmpts;
        }
    } else if (sscanf(line, "# md %d : component %d %63s", &idx, &ref, name) == 3) {
        if (idx >= 0 && idx < MAX_MDS) {
            snprintf(nm->md[idx], sizeof(nm->md[idx]), "%s", name);
            nm->md_cmpt[idx] = ref;
            nm->nmds = idx + 1 > nm->nmds ? idx + 1 : nm->nmds;
        }
    } else if (sscanf(line, "# resource %d : md %d dev %d flags %c%c %95s", &idx, &ref,
                      &dev, &aux, &sock, tldev) == 6 && *n < max) {
        kvf_ucx_tl_t *t = &tls[*n];
        char *slash = strchr(tldev, '/');
        if (slash == NULL)
            return;
        *slash = '\0';
        memset(t, 0, sizeof(*t));
        snprintf(t->tl, sizeof(t->tl), "%s", tldev);
        snprintf(t->dev, sizeof(t->dev), "%s", slash + 1);
        t->aux = aux == 'a';
        t->md_index = ref;
        t->dev_type = -1;   /* until UCT says */
        (*n)++;
    }
}

/* The transports UCX selected for ctx, as it prints them. */
static kvf_status_t list_resources(ucp_context_h ctx, names_t *nm, kvf_ucx_tl_t *tls,
                                   size_t max, size_t *n_p, char *err, size_t errlen)
{
    char *text = NULL;
    size_t size = 0;
    FILE *f = open_memstream(&text, &size);
    if (f == NULL) {
        snprintf(err, errlen, "cannot ask UCX for its transports: open_memstream: %m");
        return KVF_ERR_NO_MEMORY;
    }
    ucp_context_print_info(ctx, f);
    fclose(f);
    memset(nm, 0, sizeof(*nm));
    *n_p = 0;
    for (char *save = NULL, *line = strtok_r(text, "\n", &save); line != NULL;
         line = strtok_r(NULL, "\n", &save))
        parse_line(line, nm, tls, max, n_p);
    free(text);
    if (*n_p == 0) {
        snprintf(err, errlen, "UCX reported no transports for its context (UCX %s prints "
                 "them in a form this build does not read)", ucp_get_version_string());
        return KVF_ERR_UNSUPPORTED;
    }
    return KVF_OK;
}

static uct_component_h find_component(uct_component_h *c, unsigned nc, const char *name)
{
    for (unsigned i = 0; i < nc; i++) {
        uct_component_attr_t a = {.field_mask = UCT_COMPONENT_ATTR_FIELD_NAME};
        if (uct_component_query(c[i], &a) == UCS_OK && strcmp(a.name, name) == 0)
            return c[i];
    }
    return NULL;
}

/* Whether the transport t of md reads remote memory itself: open it the
 * way `ucx_info -d` does and ask. */
static void query_iface(uct_md_h md, uct_worker_h worker, kvf_ucx_tl_t *t)
{
    uct_iface_config_t *cfg;
    uct_iface_h iface;
    uct_iface_attr_t attr;
    uct_iface_params_t ip = {
        .field_mask = UCT_IFACE_PARAM_FIELD_OPEN_MODE | UCT_IFACE_PARAM_FIELD_DEVICE,
        .open_mode = UCT_IFACE_OPEN_MODE_DEVICE,
        .mode.device = {.tl_name = t->tl, .dev_name = t->dev},
    };
    if (uct_md_iface_config_read(md, t->tl, NULL, NULL, &cfg) != UCS_OK)
        return;
    ucs_status_t st = uct_iface_open(md, worker, &ip, cfg, &iface);
    uct_config_release(cfg);
    if (st != UCS_OK)
        return;   /* iface_flags stay 0: counted as not reading in hardware */
    if (uct_iface_query(iface, &attr) == UCS_OK)
        t->iface_flags = attr.cap.flags;
    uct_iface_close(iface);
}

/* Fill in what UCT reports for the transports of one memory domain. */
static void query_md(uct_component_h cmpt, const char *md_name, int md_index,
                     uct_worker_h worker, kvf_ucx_tl_t *tls, size_t n)
{
    uct_md_config_t *cfg;
    uct_md_h md;
    uct_md_attr_t attr;
    uct_tl_resource_desc_t *rsc;
    unsigned nrsc;
    if (uct_md_config_read(cmpt, NULL, NULL, &cfg) != UCS_OK)
        return;
    ucs_status_t st = uct_md_open(cmpt, md_name, cfg, &md);
    uct_config_release(cfg);
    if (st != UCS_OK)
        return;
    if (uct_md_query(md, &attr) != UCS_OK ||
        uct_md_query_tl_resources(md, &rsc, &nrsc) != UCS_OK) {
        uct_md_close(md);
        return;
    }
    for (size_t i = 0; i < n; i++) {
        kvf_ucx_tl_t *t = &tls[i];
        if (t->md_index != md_index)
            continue;
        t->md_flags = attr.cap.flags;
        t->rkey_size = attr.rkey_packed_size;
        for (unsigned r = 0; r < nrsc; r++)
            if (strcmp(rsc[r].tl_name, t->tl) == 0 && strcmp(rsc[r].dev_name, t->dev) == 0)
                t->dev_type = (int)rsc[r].dev_type;
        if (t->dev_type == UCT_DEVICE_TYPE_NET && worker != NULL)
            query_iface(md, worker, t);
    }
    uct_release_tl_resource_list(rsc);
    uct_md_close(md);
}

kvf_status_t kvf__ucx_list_tls(ucp_context_h ctx, kvf_ucx_tl_t *tls, size_t max,
                               size_t *n_p, char *err, size_t errlen)
{
    names_t nm;
    uct_component_h *cmpts;
    unsigned ncmpts;
    ucs_async_context_t *async = NULL;
    uct_worker_h worker = NULL;
    kvf_status_t s = list_resources(ctx, &nm, tls, max, n_p, err, errlen);
    if (s != KVF_OK)
        return s;
    if (uct_query_components(&cmpts, &ncmpts) != UCS_OK) {
        snprintf(err, errlen, "UCT lists no components");
        return KVF_ERR_UNSUPPORTED;
    }
    /* A worker to open network transports on; without one they count as
     * not reading in hardware. */
    if (ucs_async_context_create(UCS_ASYNC_MODE_POLL, &async) == UCS_OK &&
        uct_worker_create(async, UCS_THREAD_MODE_SINGLE, &worker) != UCS_OK)
        worker = NULL;
    for (int m = 0; m < nm.nmds; m++) {
        int c = nm.md_cmpt[m];
        uct_component_h cmpt = c >= 0 && c < nm.ncmpts
                                   ? find_component(cmpts, ncmpts, nm.cmpt[c]) : NULL;
        if (cmpt != NULL)
            query_md(cmpt, nm.md[m], m, worker, tls, *n_p);
    }
    if (worker != NULL)
        uct_worker_destroy(worker);
    if (async != NULL)
        ucs_async_context_destroy(async);
    uct_release_component_list(cmpts);
    for (size_t i = 0; i < *n_p; i++)
        kvf_debug("ucx: transport %s/%s: device type %d%s, memory domain flags 0x%llx, "
                  "remote key %zu bytes, interface flags 0x%llx", tls[i].tl, tls[i].dev,
                  tls[i].dev_type, tls[i].aux ? " (auxiliary)" : "",
                  (unsigned long long)tls[i].md_flags, tls[i].rkey_size,
                  (unsigned long long)tls[i].iface_flags);
    return KVF_OK;
}

/* --------------------------------------------------------------- the rule */

int kvf_ucx_software_rma_allowed(void)
{
    const char *v = getenv("KVF_UCX_SOFTWARE_RMA");
    if (v == NULL || v[0] == '\0')
        return 0;
    if (strcmp(v, "allow") == 0)
        return 1;
    kvf_warn("KVF_UCX_SOFTWARE_RMA=%s is not understood (its one value is \"allow\"): "
             "ignored", v);
    return 0;
}

kvf_status_t kvf__ucx_may_offer(ucp_context_h ctx, char *err, size_t errlen)
{
    kvf_ucx_tl_t tls[KVF_UCX_MAX_TLS];
    size_t n;
    char why[256];
    kvf_status_t s = kvf__ucx_list_tls(ctx, tls, KVF_UCX_MAX_TLS, &n, err, errlen);
    if (s == KVF_OK && kvf_ucx_bounds_enforced(tls, n, why, sizeof(why)))
        return KVF_OK;
    if (s != KVF_OK)
        snprintf(why, sizeof(why), "%s", err);
    if (kvf_ucx_software_rma_allowed()) {
        kvf_warn("ucx: KVF_UCX_SOFTWARE_RMA=allow: offering ucx although UCX checks no "
                 "remote-key bounds over %s: every peer that holds the cluster token can "
                 "read and write any memory of this process", why);
        return KVF_OK;
    }
    snprintf(err, errlen, "UCX moves this engine's remote reads in software or without "
             "a remote-key check (over %s), so a peer holding its offer could read and "
             "write any of its memory; for ucx set UCX_TLS to RDMA transports only (rc "
             "or dc, plus cuda_copy,gdr_copy for GPU memory), or KVF_UCX_SOFTWARE_RMA=allow "
             "where every token holder may have all of this process's memory", why);
    return KVF_ERR_UNSUPPORTED;
}
