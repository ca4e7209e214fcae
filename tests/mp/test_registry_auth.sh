#!/usr/bin/env bash
# The standalone registry (`kvferry bootstrap`) and its cluster token, as
# separate processes see them:
#  - without a token it refuses a non-loopback --host, saying how to set one;
#  - KVF_AUTH=none lets it listen anyway, with a warning;
#  - it listens on 127.0.0.1 by default; with a token, a stranger's
#    PUT /route and POST /register_dp_rank get 401 and change nothing,
#    while a bearer of the token registers;
#  - `kvferry demo` with KVF_AUTH_TOKEN set runs every rank with it against
#    its own registry process, and says so.
set -euo pipefail
KVFERRY=${KVFERRY:-build/kvferry}
tmp=$(mktemp -d)
reg_pid=
cleanup() {
    if [ -n "$reg_pid" ]; then kill "$reg_pid" 2>/dev/null || true; wait "$reg_pid" 2>/dev/null || true; fi
    rm -rf "$tmp"
}
trap cleanup EXIT
fail() { echo "FAIL: $*"; for f in "$tmp"/*.err; do [ -f "$f" ] && sed 's/^/  | /' "$f"; done; exit 1; }
clean_env=(env -u KVF_AUTH_TOKEN -u KVF_AUTH_TOKEN_FILE
           -u SGLANG_DISAGGREGATION_BOOTSTRAP_AUTH_TOKEN -u KVF_AUTH)

# 1. No token, 0.0.0.0: refused, exit status 1, the message says what to do.
rc=0
timeout 20 "${clean_env[@]}" "$KVFERRY" bootstrap --host 0.0.0.0 --port 0 \
    >"$tmp/open.out" 2>"$tmp/open.err" || rc=$?
[ "$rc" = 1 ] || fail "kvferry bootstrap --host 0.0.0.0 without a token exited $rc, not 1"
grep -q "refusing to listen on 0.0.0.0" "$tmp/open.err" || fail "no refusal message"
grep -q "KVF_AUTH_TOKEN=<secret>" "$tmp/open.err" || fail "the refusal does not say how to set a token"
[ ! -s "$tmp/open.out" ] || fail "it printed a listening line: $(cat "$tmp/open.out")"
echo "ok: without a token, --host 0.0.0.0 is refused and the message names KVF_AUTH_TOKEN"

# Start a registry in the background, wait for its address line (an
# event: the line arrives, or the process exits, or 20 s pass).
start_registry() {   # env-prefix... -- args...
    mkfifo "$tmp/reg.fifo"
    "$@" >"$tmp/reg.fifo" 2>"$tmp/reg.err" &
    reg_pid=$!
    exec 3<"$tmp/reg.fifo"
    rm -f "$tmp/reg.fifo"
    line=
    read -r -t 20 -u 3 line || fail "the registry printed no address line"
    case $line in
        "kvferry bootstrap registry listening on "*) addr=${line##* } ;;
        *) fail "unexpected first line: $line" ;;
    esac
}
stop_registry() {
    kill "$reg_pid"; wait "$reg_pid" 2>/dev/null || true; reg_pid=
    exec 3<&-
}

# 2. KVF_AUTH=none: it listens on 0.0.0.0, and warns.
start_registry "${clean_env[@]}" KVF_AUTH=none KVF_LOG=warn "$KVFERRY" bootstrap --host 0.0.0.0 --port 0
case $addr in 0.0.0.0:*) ;; *) fail "KVF_AUTH=none registry at $addr" ;; esac
grep -q "runs OPEN (KVF_AUTH=none)" "$tmp/reg.err" || fail "no warning for KVF_AUTH=none"
stop_registry
echo "ok: KVF_AUTH=none listens on 0.0.0.0 with a warning"

# 3. The default host, a token, a stranger and the real rank.
token=$(python3 -c 'import secrets; print(secrets.token_hex(24))')
start_registry "${clean_env[@]}" KVF_AUTH_TOKEN="$token" "$KVFERRY" bootstrap --port 0
case $addr in 127.0.0.1:*) ;; *) fail "default host is not 127.0.0.1: $addr" ;; esac
grep -q "registering needs the cluster token" "$tmp/reg.err" || fail "no access line"
body='{"attn_tp_size":1,"attn_tp_rank":0,"attn_cp_size":1,"attn_cp_rank":0,
"attn_dp_size":1,"attn_dp_rank":0,"pp_size":1,"pp_rank":0,"system_dp_size":1,
"system_dp_rank":0,"rank_ip":"6.6.6.6","rank_port":6666,"page_size":1,
"kv_cache_dtype":"auto"}'
code() { curl -s -o "$tmp/body" -w '%{http_code}' --max-time 5 --noproxy '*' "$@"; }
c=$(code -X PUT "http://$addr/route" -d "$body")
[ "$c" = 401 ] || fail "stranger PUT /route: $c"
grep -q "^Unauthorized" "$tmp/body" || fail "401 body: $(cat "$tmp/body")"
c=$(code -X PUT "http://$addr/route" -H "Authorization: Bearer guess" -d "$body")
[ "$c" = 401 ] || fail "wrong-token PUT /route: $c"
c=$(code -X POST "http://$addr/register_dp_rank" -d '{"bootstrap_room":1,"dp_rank":0}')
[ "$c" = 401 ] || fail "stranger POST /register_dp_rank: $c"
q="prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1"
c=$(code "http://$addr/route?$q")
[ "$c" = 503 ] || fail "after the strangers, GET /route: $c (nothing should be registered)"
real=${body/6.6.6.6/127.0.0.1}
real=${real/\"page_size\":1,/\"page_size\":64,}
c=$(code -X PUT "http://$addr/route" -H "Authorization: Bearer $token" -d "$real")
[ "$c" = 200 ] || fail "the real rank's PUT /route: $c $(cat "$tmp/body")"
c=$(code -X PUT "http://$addr/route" -d "$body")
[ "$c" = 401 ] || fail "stranger hijack after the real rank: $c"
c=$(code "http://$addr/route?prefill_dp_rank=0&prefill_cp_rank=0&target_tp_rank=0&target_pp_rank=0")
[ "$c" = 200 ] && grep -q '"rank_ip":"127.0.0.1"' "$tmp/body" || fail "GET /route: $c $(cat "$tmp/body")"
c=$(code "http://$addr/metrics")
grep -q 'kvferry_registry_refused_total{reason="missing_token"} 3' "$tmp/body" || fail "metrics: $(grep refused "$tmp/body")"
stop_registry
echo "ok: with a token, strangers get 401 and change nothing; the token holder registers"

# 4. The demo with a token in the environment: every process uses it.
out=$(timeout 120 "${clean_env[@]}" KVF_AUTH_TOKEN="$token" "$KVFERRY" demo --json \
      --model tiny --requests 2 --timeout 60 2>"$tmp/demo.err") || fail "demo failed: $out"
python3 -c '
import json, sys
d = json.loads(sys.argv[1])
assert d["succeeded"] == 2 and d["verified"] is True, d
assert d["registry_auth"] == "cluster token from KVF_AUTH_TOKEN (registry writes, engine handshakes)", d["registry_auth"]
' "$out" || fail "demo summary: $out"
grep -q "cluster token from KVF_AUTH_TOKEN (registry writes, engine handshakes)" "$tmp/demo.err" || fail "demo did not say it"
echo "ok: kvferry demo with KVF_AUTH_TOKEN: 2 rooms verified, and it says how the registry was protected"
