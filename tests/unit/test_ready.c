/*
 * What newer SGLang asks of a bootstrap registry and of the token rules:
 * the decode allocation policy a prefill registers (PUT /route) and the
 * registry answers (GET /route), room readiness for the prefill_complete
 * policy (POST /room_ready, POST /query_room_ready), and the cluster
 * token's last source, SGLang's --api-key (kvf_auth_token_resolve,
 * kvf_bootstrap_create_keyed).  Requests go straight into the handler,
 * except where the network client or a running registry is the point.
 */
#include <jansson.h>

#include "bootstrap/bootstrap.h"
#include "util/token.h"

#include "kvf_test.h"

#define TMO 3000u

static const char *const TOKEN_VARS[] = {
    "KVF_AUTH_TOKEN", "KVF_AUTH_TOKEN_FILE",
    "SGLANG_DISAGGREGATION_BOOTSTRAP_AUTH_TOKEN", "KVF_AUTH"};

static void clear_env(void)
{
    for (size_t i = 0; i < sizeof(TOKEN_VARS) / sizeof(TOKEN_VARS[0]); i++)
        unsetenv(TOKEN_VARS[i]);
}

/* One request into the handler; the body is kept in *resp_p (free it). */
static int handle(kvf_registry_state_t *st, const kvf_bs_client_t *c,
                  const char *method, const char *path, const char *query,
                  const char *body, char **resp_p)
{
    const char *ctype;
    return kvf__registry_handle(st, c, method, path, query, body,
                                body ? strlen(body) : 0, resp_p, &ctype);
}

static int put_rank(kvf_registry_state_t *st, int tp, const char *policy)
{
    char body[768], *resp = NULL;
    snprintf(body, sizeof(body),
             "{\"attn_tp_size\":2,\"attn_tp_rank\":%d,\"attn_cp_size\":1,"
             "\"attn_cp_rank\":0,\"attn_dp_size\":1,\"attn_dp_rank\":0,"
             "\"pp_size\":1,\"pp_rank\":0,\"system_dp_size\":1,"
             "\"system_dp_rank\":0,\"rank_ip\":\"127.0.0.1\",\"rank_port\":%d,"
             "\"page_size\":16,\"kv_cache_dtype\":\"auto\"%s%s}",
             tp, 17000 + tp, policy ? ",\"decode_allocation_policy\":" : "",
             policy ? policy : "");
    int code = handle(st, NULL, "PUT", "/route", NULL, body, &resp);
    free(resp);
    return code;
}

static json_t *get_info(kvf_registry_state_t *st)
{
    char *resp = NULL;
    int code = handle(st, NULL, "GET", "/route",
                      "prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&"
                      "target_pp_rank=-1", NULL, &resp);
    json_t *j = code == 200 ? json_loads(resp, 0, NULL) : NULL;
    free(resp);
    return j;
}

static void test_policy_registered_and_answered(void)
{
    kvf_registry_state_t *st = kvf__registry_state_create(0);

    /* Older SGLang registers no policy: the answer has none either, so
     * that an older decode's PrefillServerInfo(**answer) still builds. */
    CHECK_EQ_INT(put_rank(st, 0, NULL), 200);
    CHECK_EQ_INT(put_rank(st, 1, NULL), 200);
    json_t *j = get_info(st);
    CHECK(j != NULL && json_object_get(j, "decode_allocation_policy") == NULL);
    json_decref(j);
    kvf__registry_state_destroy(st);

    st = kvf__registry_state_create(0);
    CHECK_EQ_INT(put_rank(st, 0, "\"prefill_complete\""), 200);
    CHECK_EQ_INT(put_rank(st, 1, "\"prefill_complete\""), 200);
    j = get_info(st);
    CHECK(j != NULL);
    CHECK(strcmp(json_string_value(json_object_get(j, "decode_allocation_policy")),
                 "prefill_complete") == 0);
    json_decref(j);
    /* Bad values are refused with the field's name. */
    char *resp = NULL;
    CHECK_EQ_INT(put_rank(st, 0, "7"), 400);
    CHECK_EQ_INT(put_rank(st, 0, "\"two words\""), 400);
    CHECK_EQ_INT(handle(st, NULL, "PUT", "/route", NULL,
                        "{\"decode_allocation_policy\": 1}", &resp), 400);
    free(resp);
    kvf__registry_state_destroy(st);
}

static void test_policy_through_the_client(void)
{
    kvf_bootstrap_t *bs;
    char addr[64], err[512] = "";

    clear_env();
    if (kvf_bootstrap_create("127.0.0.1", 0, &bs) != KVF_OK) {
        CHECK(!"registry start");
        return;
    }
    snprintf(addr, sizeof(addr), "127.0.0.1:%d", kvf_bootstrap_port(bs));
    kvf_bs_reg_t r = {
        .attn_tp_size = 1, .attn_cp_size = 1, .attn_dp_size = 1,
        .pp_size = 1, .system_dp_size = 1, .rank_ip = "127.0.0.1",
        .rank_port = 17100, .page_size = 16, .kv_cache_dtype = "auto",
        .decode_allocation_policy = "prefill_complete",
    };
    CHECK_EQ_INT(kvf__bs_register(addr, &r, TMO, err, sizeof(err)), KVF_OK);
    kvf_bs_info_t info;
    CHECK_EQ_INT(kvf__bs_get_info(addr, TMO, &info, err, sizeof(err)), KVF_OK);
    CHECK(strcmp(info.decode_allocation_policy, "prefill_complete") == 0);
    kvf_bootstrap_destroy(bs);
}

static void test_room_ready(void)
{
    kvf_registry_state_t *st = kvf__registry_state_create(4);
    char *resp = NULL;

    CHECK_EQ_INT(handle(st, NULL, "POST", "/room_ready", NULL,
                        "{\"bootstrap_room\": \"18446744073709551615\", "
                        "\"status\": \"ready\"}", &resp), 200);
    free(resp);
    CHECK_EQ_INT(handle(st, NULL, "POST", "/room_ready", NULL,
                        "{\"bootstrap_room\": 7, \"status\": \"failed\", "
                        "\"reason\": \"Aborted by AbortReq.\"}", &resp), 200);
    free(resp);
    /* A failure is final: a late "ready" does not undo it. */
    CHECK_EQ_INT(handle(st, NULL, "POST", "/room_ready", NULL,
                        "{\"bootstrap_room\": 7, \"status\": \"ready\"}", &resp),
                 200);
    free(resp);
    CHECK_EQ_INT(handle(st, NULL, "POST", "/query_room_ready", NULL,
                        "{\"bootstrap_rooms\": [\"18446744073709551615\", 7, 8]}",
                        &resp), 200);
    CHECK(resp != NULL && strcmp(resp,
        "{\"18446744073709551615\":{\"status\":\"ready\"},"
        "\"7\":{\"status\":\"failed\",\"reason\":\"Aborted by AbortReq.\"}}") == 0);
    free(resp);
    /* What the handler refuses, and says why. */
    CHECK_EQ_INT(handle(st, NULL, "POST", "/room_ready", NULL,
                        "{\"bootstrap_room\": 1, \"status\": \"maybe\"}", &resp),
                 400);
    CHECK_STR_CONTAINS(resp, "\"status\" (\"ready\" or \"failed\")");
    free(resp);
    CHECK_EQ_INT(handle(st, NULL, "POST", "/room_ready", NULL,
                        "{\"bootstrap_room\": -1, \"status\": \"ready\"}", &resp),
                 400);
    free(resp);
    CHECK_EQ_INT(handle(st, NULL, "POST", "/query_room_ready", NULL,
                        "{\"bootstrap_rooms\": [\"x\"]}", &resp), 400);
    free(resp);
    CHECK_EQ_INT(handle(st, NULL, "GET", "/room_ready", NULL, NULL, &resp), 405);
    free(resp);
    /* Bounded: the oldest rooms are forgotten first, notes with them. */
    for (int room = 100; room < 110; room++) {
        char body[128];
        snprintf(body, sizeof(body), "{\"bootstrap_room\": %d, \"status\": "
                 "\"failed\", \"reason\": \"r%d\"}", room, room);
        CHECK_EQ_INT(handle(st, NULL, "POST", "/room_ready", NULL, body, &resp),
                     200);
        free(resp);
    }
    CHECK_EQ_INT(handle(st, NULL, "POST", "/query_room_ready", NULL,
                        "{\"bootstrap_rooms\": [7, 105, 106, 109]}", &resp), 200);
    CHECK(resp != NULL && strcmp(resp,
        "{\"106\":{\"status\":\"failed\",\"reason\":\"r106\"},"
        "\"109\":{\"status\":\"failed\",\"reason\":\"r109\"}}") == 0);
    free(resp);
    kvf__registry_state_destroy(st);
}

/* POST /room_ready changes what decode servers do: it needs the token. */
static void test_room_ready_needs_the_token(void)
{
    kvf_registry_state_t *st = kvf__registry_state_create(0);
    kvf_bs_client_t none = {NULL, 0, "10.0.0.9"};
    kvf_bs_client_t good = {"Bearer ready-token-0123456789", 0, "10.0.0.9"};
    char *resp = NULL;
    const char *body = "{\"bootstrap_room\": 3, \"status\": \"ready\"}";

    CHECK_EQ_INT(kvf__registry_set_auth(st, "ready-token-0123456789", 0), KVF_OK);
    CHECK_EQ_INT(handle(st, &none, "POST", "/room_ready", NULL, body, &resp), 401);
    free(resp);
    CHECK_EQ_INT(handle(st, &good, "POST", "/room_ready", NULL, body, &resp), 200);
    free(resp);
    /* Asking stays open, as POST /query_dp_ranks. */
    CHECK_EQ_INT(handle(st, &none, "POST", "/query_room_ready", NULL,
                        "{\"bootstrap_rooms\": [3]}", &resp), 200);
    CHECK_STR_CONTAINS(resp, "\"3\":{\"status\":\"ready\"}");
    free(resp);
    kvf__registry_state_destroy(st);
}

static void test_api_key_is_the_last_source(void)
{
    char tok[KVF_TOKEN_MAX + 1], src[128];

    clear_env();
    CHECK_EQ_INT(kvf_auth_token_resolve(NULL, tok, sizeof(tok), src, sizeof(src)),
                 KVF_OK);
    CHECK(tok[0] == '\0' && src[0] == '\0');
    CHECK_EQ_INT(kvf_auth_token_resolve("api-key-0123456789abcdef", tok, sizeof(tok),
                                        src, sizeof(src)), KVF_OK);
    CHECK(strcmp(tok, "api-key-0123456789abcdef") == 0);
    CHECK(strcmp(src, "the API key (--api-key)") == 0);
    /* SGLang's order: its variable wins over --api-key, and kvferry's own
     * variables over both. */
    setenv("SGLANG_DISAGGREGATION_BOOTSTRAP_AUTH_TOKEN", "sglang-token-0123456789", 1);
    CHECK_EQ_INT(kvf_auth_token_resolve("api-key-0123456789abcdef", tok, sizeof(tok),
                                        src, sizeof(src)), KVF_OK);
    CHECK(strcmp(tok, "sglang-token-0123456789") == 0);
    CHECK(strcmp(src, "SGLANG_DISAGGREGATION_BOOTSTRAP_AUTH_TOKEN") == 0);
    setenv("KVF_AUTH_TOKEN", "kvf-token-0123456789", 1);
    CHECK_EQ_INT(kvf_auth_token_resolve("api-key-0123456789abcdef", tok, sizeof(tok),
                                        NULL, 0), KVF_OK);
    CHECK(strcmp(tok, "kvf-token-0123456789") == 0);
    /* A key that cannot be a bearer token is refused, naming its source. */
    clear_env();
    CHECK_EQ_INT(kvf_auth_token_resolve("has space", tok, sizeof(tok), src,
                                        sizeof(src)), KVF_ERR_INVALID_PARAM);
    CHECK(tok[0] == '\0');
    CHECK_STR_CONTAINS(kvf_last_error(), "--api-key");
    CHECK_EQ_INT(kvf_auth_token_resolve(NULL, NULL, 0, NULL, 0),
                 KVF_ERR_INVALID_PARAM);
}

/* A registry whose only source is --api-key takes it as its token: with
 * only --api-key set, SGLang's prefill ranks (which send it) may write. */
static void test_keyed_registry(void)
{
    kvf_bootstrap_t *bs;
    char addr[64], err[512] = "";

    clear_env();
    CHECK_EQ_INT(kvf_bootstrap_create_keyed("127.0.0.1", 0,
                                            "api-key-0123456789abcdef", &bs),
                 KVF_OK);
    CHECK(strcmp(kvf_bootstrap_access(bs), "token") == 0);
    snprintf(addr, sizeof(addr), "127.0.0.1:%d", kvf_bootstrap_port(bs));
    kvf_bs_reg_t r = {
        .attn_tp_size = 1, .attn_cp_size = 1, .attn_dp_size = 1,
        .pp_size = 1, .system_dp_size = 1, .rank_ip = "127.0.0.1",
        .rank_port = 17200, .page_size = 16, .kv_cache_dtype = "auto",
    };
    CHECK_EQ_INT(kvf__bs_register_auth(addr, &r, "wrong-key-0123456789abc", TMO,
                                       err, sizeof(err)), KVF_ERR_BOOTSTRAP);
    CHECK_STR_CONTAINS(err, "401");
    CHECK_EQ_INT(kvf__bs_register_auth(addr, &r, "api-key-0123456789abcdef", TMO,
                                       err, sizeof(err)), KVF_OK);
    kvf_bootstrap_destroy(bs);
    /* A key that cannot be a token: the registry does not start. */
    CHECK_EQ_INT(kvf_bootstrap_create_keyed("127.0.0.1", 0, "two words", &bs),
                 KVF_ERR_INVALID_PARAM);
}

KVF_TEST_MAIN(KVF_CASE(test_policy_registered_and_answered),
              KVF_CASE(test_policy_through_the_client),
              KVF_CASE(test_room_ready),
              KVF_CASE(test_room_ready_needs_the_token),
              KVF_CASE(test_api_key_is_the_last_source),
              KVF_CASE(test_keyed_registry))
