/* Status names and strings, generated from the table in status.h. */
#include "kvferry/kvferry.h"

const char *kvf_status_name(kvf_status_t status)
{
    switch (status) {
#define KVF_STATUS_NAME_(name, value, text) case name: return #name;
    KVF_STATUS_TABLE(KVF_STATUS_NAME_)
#undef KVF_STATUS_NAME_
    }
    return "KVF_ERR_UNKNOWN";
}

const char *kvf_status_str(kvf_status_t status)
{
    switch (status) {
#define KVF_STATUS_STR_(name, value, text) case name: return text;
    KVF_STATUS_TABLE(KVF_STATUS_STR_)
#undef KVF_STATUS_STR_
    }
    return "unknown status";
}

const char *kvf_version(void)
{
#define KVF_STR2_(x) #x
#define KVF_STR_(x) KVF_STR2_(x)
    return KVF_STR_(KVF_VERSION_MAJOR) "." KVF_STR_(KVF_VERSION_MINOR) "."
        KVF_STR_(KVF_VERSION_PATCH);
}

const char *kvf_role_name(kvf_role_t role)
{
    return role == KVF_ROLE_PREFILL ? "prefill" : "decode";
}

const char *kvf_poll_name(kvf_poll_t state)
{
    switch (state) {
    case KVF_POLL_FAILED: return "Failed";
    case KVF_POLL_BOOTSTRAPPING: return "Bootstrapping";
    case KVF_POLL_WAITING_FOR_INPUT: return "WaitingForInput";
    case KVF_POLL_TRANSFERRING: return "Transferring";
    case KVF_POLL_SUCCESS: return "Success";
    }
    return "Unknown";
}
