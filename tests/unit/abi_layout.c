/*
 * The C compiler's view of what the Python binding mirrors by hand
 * (python/kvferry/_lib.py), printed as JSON for
 * python/tests/test_abi_binding.py:
 *
 *   {"version": "M.m.p",
 *    "structs":   {"kvf_x_t": {"size": N, "fields": {"f": [offset, size], ...}}},
 *    "statuses":  {"KVF_OK": 0, "KVF_ERR_...": -1, ...},
 *    "constants": {"KVF_REASON_MAX": 512, ...}}
 *
 * Fields are listed in declaration order; the test holds that order to the
 * header's and to the ctypes classes'.  Statuses come from the table in
 * status.h itself, so a new code reaches the test without an edit here.
 * A test helper only: never installed.
 */
#include <stddef.h>
#include <stdio.h>

#include "kvferry/kvferry.h"
#include "util/token.h"

static const char *struct_sep = "";
static const char *field_sep = "";

static void struct_begin(const char *name, size_t size)
{
    printf("%s\n    \"%s\": {\"size\": %zu, \"fields\": {", struct_sep, name, size);
    struct_sep = ",";
    field_sep = "";
}

static void struct_end(void)
{
    printf("}}");
}

static void field(const char *name, size_t offset, size_t size)
{
    printf("%s\"%s\": [%zu, %zu]", field_sep, name, offset, size);
    field_sep = ", ";
}

/* Each dump function declares its struct as T, block-scoped. */
#define BEGIN(type) struct_begin(#type, sizeof(type))
#define F(f) field(#f, offsetof(T, f), sizeof(((T *)0)->f))

static void dump_failure(void)
{
    typedef kvf_failure_t T;
    BEGIN(kvf_failure_t);
    F(size); F(status); F(origin_side); F(origin_rank); F(origin_addr);
    F(from_another_rank); F(reason);
    struct_end();
}

static void dump_engine_params(void)
{
    typedef kvf_engine_params_t T;
    BEGIN(kvf_engine_params_t);
    F(size); F(role); F(tp_rank); F(tp_size); F(pp_rank); F(pp_size);
    F(dp_rank); F(dp_size); F(host); F(port); F(bootstrap_addr);
    F(host_bootstrap); F(transport); F(checksum); F(bootstrap_timeout_ms);
    F(waiting_timeout_ms); F(transfer_timeout_ms); F(heartbeat_interval_ms);
    F(heartbeat_timeout_ms); F(faults); F(handshake_timeout_ms);
    F(auth_token); F(cp_rank); F(cp_size); F(dp_attention);
    F(kv_cache_dtype); F(load_balance_method); F(prefill_http_port);
    F(dsa_cache_layer_split); F(streams); F(api_key);
    F(decode_allocation_policy); F(metrics_addr); F(trace); F(busy_poll_us);
    struct_end();
}

static void dump_layout_parts(void)
{
    {
        typedef kvf_buffer_t T;
        BEGIN(kvf_buffer_t);
        F(base); F(length); F(item_bytes);
        struct_end();
    }
    {
        typedef kvf_kv_tag_t T;
        BEGIN(kvf_kv_tag_t);
        F(layer); F(role); F(group);
        struct_end();
    }
    {
        typedef kvf_state_group_t T;
        BEGIN(kvf_state_group_t);
        F(type); F(num_buffers); F(buffers);
        struct_end();
    }
    {
        typedef kvf_indices_t T;
        BEGIN(kvf_indices_t);
        F(idx); F(n);
        struct_end();
    }
}

static void dump_layout(void)
{
    typedef kvf_layout_t T;
    BEGIN(kvf_layout_t);
    F(size); F(page_size); F(kv_dtype); F(attn); F(num_layers);
    F(heads_per_rank); F(total_heads); F(bytes_per_head); F(mem_kind);
    F(num_kv); F(kv); F(num_aux); F(aux); F(num_state); F(state);
    F(first_layer); F(kv_tags); F(num_state_groups); F(state_groups);
    F(aux_mem_kind); F(state_mem_kind); F(cuda_device); F(kv_order);
    struct_end();
}

static void dump_rooms(void)
{
    {
        typedef kvf_room_metric_t T;
        BEGIN(kvf_room_metric_t);
        F(size); F(bytes); F(alloc_s); F(transfer_s);
        struct_end();
    }
    {
        typedef kvf_room_key_t T;
        BEGIN(kvf_room_key_t);
        F(room); F(instance);
        struct_end();
    }
    {
        typedef kvf_hold_t T;
        BEGIN(kvf_hold_t);
        F(size); F(lease_ms); F(instance);
        struct_end();
    }
    {
        typedef kvf_dest_t T;
        BEGIN(kvf_dest_t);
        F(size); F(pages); F(num_pages); F(aux_slot); F(states);
        F(num_states); F(decode_prefix_len);
        struct_end();
    }
    {
        typedef kvf_remote_t T;
        BEGIN(kvf_remote_t);
        F(size); F(room); F(instance); F(descriptors); F(num_descriptors);
        struct_end();
    }
}

static void dump_engine_stats(void)
{
    typedef kvf_engine_stats_t T;
    BEGIN(kvf_engine_stats_t);
    F(size); F(rooms_by_state); F(rooms_succeeded); F(rooms_failed);
    F(failures_room); F(failures_peer); F(failures_other); F(bytes_sent);
    F(bytes_received); F(peers_connected); F(peers_by_path); F(auth_refused);
    F(room_msgs_dropped); F(stash_dropped);
    struct_end();
}

static void dump_statuses(void)
{
    const char *sep = "";
#define KVF_STATUS_JSON_(name, value, text) \
    printf("%s\n    \"%s\": %d", sep, #name, (int)(value)); sep = ",";
    KVF_STATUS_TABLE(KVF_STATUS_JSON_)
#undef KVF_STATUS_JSON_
}

/* The header's limits and enum values the binding names (KVF_ + its name). */
static void dump_constants(void)
{
    const char *sep = "";
#define C(name) printf("%s\n    \"%s\": %ld", sep, #name, (long)(name)); sep = ",";
    C(KVF_REASON_MAX) C(KVF_ADDR_MAX) C(KVF_DESCRIPTOR_MAX) C(KVF_TOKEN_MAX)
    C(KVF_PATHS_MAX)
    C(KVF_ROLE_PREFILL) C(KVF_ROLE_DECODE) C(KVF_ATTN_MHA) C(KVF_ATTN_MLA)
    C(KVF_MEM_HOST) C(KVF_MEM_CUDA) C(KVF_KV_K) C(KVF_KV_V) C(KVF_KV_KV)
    C(KVF_KV_NHD) C(KVF_KV_HND)
#undef C
}

int main(void)
{
    printf("{\"version\": \"%d.%d.%d\",\n  \"structs\": {", KVF_VERSION_MAJOR,
           KVF_VERSION_MINOR, KVF_VERSION_PATCH);
    dump_failure();
    dump_engine_params();
    dump_layout_parts();
    dump_layout();
    dump_rooms();
    dump_engine_stats();
    printf("},\n  \"statuses\": {");
    dump_statuses();
    printf("},\n  \"constants\": {");
    dump_constants();
    printf("}}\n");
    return fflush(stdout) == 0 ? 0 : 1;
}
