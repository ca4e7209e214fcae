/*
 * The kvferry command: a front door of subcommands.
 *
 *   demo       a whole local prefill/decode deployment, verified (demo.c)
 *   bench      the same deployment, measured (bench.c; bench_rank.c in the
 *              ranks; bench_micro.c: --memcpy, --rooms-in-flight)
 *   bootstrap  a standalone bootstrap registry (here)
 *   trace      one room's trace lines of every rank, merged (trace.c)
 *   version    the library version
 *   help       usage
 *   _rank      one rank process of the demo (rank.c); hidden: the demo
 *              starts it, people do not
 *
 * Exit status: 0 success, 1 failure, 2 bad usage.
 */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvferry/kvferry.h"
#include "tool.h"

static void kvt_usage(FILE *out)
{
    fprintf(out,
        "Usage: kvferry <command> [options]\n"
        "\n"
        "kvferry moves LLM KV cache from prefill servers to decode servers,\n"
        "one request (room) at a time, and fails every room explicitly, with\n"
        "its root cause, when anything goes wrong.\n"
        "\n"
        "Commands:\n"
        "  demo        run a local prefill/decode deployment in separate\n"
        "              processes and verify every byte of every room\n"
        "  bench       measure throughput, room latency, CPU and memory of a\n"
        "              local prefill/decode pair\n"
        "  bootstrap   run a bootstrap registry (SGLang-compatible routes)\n"
        "  trace ROOM FILE...\n"
        "              merge every rank's trace of one room into one timeline\n"
        "              and say where its failure started\n"
        "  version     print the version\n"
        "  help [CMD]  print this text, or the options of CMD\n"
        "\n"
        "Run 'kvferry help demo', 'kvferry help bench', 'kvferry help\n"
        "bootstrap' or 'kvferry help trace' for options.\n");
}

static void kvt_bootstrap_usage(FILE *out)
{
    fprintf(out,
        "Usage: kvferry bootstrap [--host HOST] [--port PORT] [--quiet]\n"
        "\n"
        "Run a bootstrap registry: prefill ranks register with it (PUT /route),\n"
        "decode ranks look them up (GET /route).  Prints\n"
        "  kvferry bootstrap registry listening on HOST:PORT\n"
        "once it listens, then serves until SIGINT or SIGTERM.\n"
        "\n"
        "Options:\n"
        "  --host HOST   address to listen on (default 127.0.0.1: this host only)\n"
        "  --port PORT   port to listen on; 0 picks a free one (default 8998)\n"
        "  --quiet       print nothing on stderr but errors (not the access rule,\n"
        "                not the line saying a signal stopped it): for a parent\n"
        "                that starts and stops the registry itself\n"
        "\n"
        "Access (docs/SECURITY.md): registering (PUT /route, POST\n"
        "/register_dp_rank, POST /room_ready) needs the cluster token, sent as\n"
        "\"Authorization: Bearer <token>\", when one is set here:\n"
        "  KVF_AUTH_TOKEN=<token>        the token itself\n"
        "  KVF_AUTH_TOKEN_FILE=<file>    a file holding it (mode 0600 or 0400)\n"
        "  SGLANG_DISAGGREGATION_BOOTSTRAP_AUTH_TOKEN=<token>  SGLang's variable\n"
        "Give every prefill rank the same one.  Without a token only clients on\n"
        "this host may register, and a HOST other than a loopback address is\n"
        "refused, unless KVF_AUTH=none (anyone may register: not recommended).\n"
        "Lookups (GET /route, /health, /metrics) need no token.\n");
}

static int kvt_bootstrap_main(int argc, char **argv)
{
    const char *host = "127.0.0.1";
    long port = 8998;
    int quiet = 0;
    for (int i = 2; i < argc; i++) {
        const char *a = argv[i];
        if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
            kvt_bootstrap_usage(stdout);
            return 0;
        }
        if (strcmp(a, "--quiet") == 0) {
            quiet = 1;
            continue;
        }
        int is_host = strcmp(a, "--host") == 0, is_port = strcmp(a, "--port") == 0;
        if (!is_host && !is_port) {
            fprintf(stderr, "kvferry bootstrap: unknown option '%s' (see "
                    "'kvferry help bootstrap')\n", a);
            return 2;
        }
        if (i + 1 >= argc) {
            fprintf(stderr, "kvferry bootstrap: %s needs a value\n", a);
            return 2;
        }
        const char *v = argv[++i];
        if (is_host) {
            host = v;
            continue;
        }
        char *end;
        errno = 0;
        port = strtol(v, &end, 10);
        if (errno || end == v || *end || port < 0 || port > 65535) {
            fprintf(stderr, "kvferry bootstrap: --port %s: expected a port "
                    "number from 0 to 65535\n", v);
            return 2;
        }
    }

    /* Block the stop signals before the registry starts its thread, so the
     * thread inherits the mask and sigwait() below receives them. */
    sigset_t stop;
    sigemptyset(&stop);
    sigaddset(&stop, SIGINT);
    sigaddset(&stop, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &stop, NULL);
    signal(SIGPIPE, SIG_IGN);

    kvf_bootstrap_t *bs = NULL;
    kvf_status_t st = kvf_bootstrap_create(host, (int)port, &bs);
    if (st == KVF_ERR_INVALID_PARAM) {
        /* No token for a non-loopback host, or a bad token: the library
         * says which and what to do. */
        fprintf(stderr, "kvferry bootstrap: %s\n", kvf_last_error());
        return 1;
    }
    if (st != KVF_OK) {
        fprintf(stderr, "kvferry bootstrap: cannot listen on %s:%ld: %s (%s); "
                "is the port in use? Pick another with --port, or 0 for any\n",
                host, port, kvf_status_str(st), kvf_status_name(st));
        return 1;
    }
    /* The access rule on stderr, then the address on stdout, the line
     * scripts wait for: when they have it, the rule is written too. */
    const char *access = kvf_bootstrap_access(bs);
    if (!quiet)
        fprintf(stderr, "kvferry bootstrap: %s\n",
                strcmp(access, "token") == 0
                ? "registering needs the cluster token (Authorization: Bearer)"
                : strcmp(access, "open") == 0
                ? "KVF_AUTH=none: anyone who reaches this registry may register"
                : "no cluster token: only clients on this host may register "
                  "(set KVF_AUTH_TOKEN to accept other hosts' ranks)");
    printf("kvferry bootstrap registry listening on %s:%d\n", host,
           kvf_bootstrap_port(bs));
    fflush(stdout);

    int sig = 0;
    while (sigwait(&stop, &sig) != 0)
        ;
    if (!quiet)
        fprintf(stderr, "kvferry bootstrap: SIG%s received, stopping\n",
                sigabbrev_np(sig));
    kvf_bootstrap_destroy(bs);
    return 0;
}

int main(int argc, char **argv)
{
    const char *cmd = argc > 1 ? argv[1] : "help";
    if (strcmp(cmd, "demo") == 0)
        return kvt_demo_main(argc, argv);
    if (strcmp(cmd, "bench") == 0)
        return kvt_bench_main(argc, argv);
    if (strcmp(cmd, "bootstrap") == 0)
        return kvt_bootstrap_main(argc, argv);
    if (strcmp(cmd, "trace") == 0)
        return kvt_trace_main(argc, argv);
    if (strcmp(cmd, "_rank") == 0)
        return kvt_rank_main(argc, argv);
    if (strcmp(cmd, "version") == 0 || strcmp(cmd, "--version") == 0) {
        printf("kvferry %s\ntransports: %s\n", kvf_version(), kvf_transports());
        return 0;
    }
    if (strcmp(cmd, "help") == 0 || strcmp(cmd, "--help") == 0 ||
        strcmp(cmd, "-h") == 0) {
        const char *topic = argc > 2 ? argv[2] : NULL;
        if (topic && strcmp(topic, "demo") == 0) {
            char *a[] = { argv[0], "demo", "--help", NULL };
            return kvt_demo_main(3, a);
        }
        if (topic && strcmp(topic, "bench") == 0) {
            char *a[] = { argv[0], "bench", "--help", NULL };
            return kvt_bench_main(3, a);
        }
        if (topic && strcmp(topic, "trace") == 0) {
            char *a[] = { argv[0], "trace", "--help", NULL };
            return kvt_trace_main(3, a);
        }
        if (topic && strcmp(topic, "bootstrap") == 0) {
            kvt_bootstrap_usage(stdout);
            return 0;
        }
        kvt_usage(stdout);
        return 0;
    }
    fprintf(stderr, "kvferry: unknown command '%s'\n\n", cmd);
    kvt_usage(stderr);
    return 2;
}
