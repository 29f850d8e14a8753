/* SPDX-License-Identifier: Apache-2.0 */
/* kvw-bootstrap: run the bootstrap service standalone.
 * Usage: kvw-bootstrap [--key-file FILE] IP[:PORT]   (port 0 or none: ephemeral;
 * kvw-bootstrap --help for the rest)
 * Prints "bootstrap IP:PORT" once listening; runs until SIGINT/SIGTERM.
 * With a cluster key (--key-file, or KVW_CLUSTER_KEY_FILE / KVW_CLUSTER_KEY
 * in the environment) only engines holding the same key are served, over
 * encrypted connections. It may be restarted at any time: prefill engines
 * re-register every KVW_BOOTSTRAP_REFRESH_MS. */
#include "kvwire.h"
#include "kvw-tools.h"

#include <getopt.h>

#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

static volatile sig_atomic_t stop;

static void on_signal(int sig)
{
    (void)sig;
    stop = 1;
}

static void usage(void)
{
    printf("Usage: kvw-bootstrap [--key-file FILE] IP[:PORT]\n"
           "Run kvwire's bootstrap service standalone on IP (an IPv4 address), port PORT\n"
           "(0 to 65535; 0 or none: a free port). Prints \"bootstrap IP:PORT\" once\n"
           "listening, then runs until SIGINT or SIGTERM. Prefill engines re-register\n"
           "every KVW_BOOTSTRAP_REFRESH_MS, so it may be restarted at any time.\n"
           "\n"
           "Options:\n"
           "  --key-file FILE  the cluster key (kvw-keygen): serve only engines holding it,\n"
           "                   over encrypted connections (default: KVW_CLUSTER_KEY_FILE or\n"
           "                   KVW_CLUSTER_KEY from the environment)\n"
           "  -h, --help       this help\n"
           "  -V, --version    the kvwire version\n"
           "\n"
           "Exit status: 0 stopped by a signal; 1 a bad command line or the service\n"
           "could not start.\n");
    exit(0);
}

int main(int argc, char **argv)
{
    kvw_tool_name = "kvw-bootstrap";
    static const struct option opts[] = {{"key-file", required_argument, NULL, 'k'},
                                         {"help", no_argument, NULL, 'h'},
                                         {"version", no_argument, NULL, 'V'},
                                         {NULL, 0, NULL, 0}};
    const char *key_file = NULL;
    int c;
    while ((c = getopt_long(argc, argv, "hV", opts, NULL)) != -1) {
        if (c == 'k')
            key_file = optarg;
        else if (c == 'h')
            usage();
        else if (c == 'V')
            kvw_tool_version();
        else
            kvw_tool_bad_option();
    }
    if (optind != argc - 1)
        kvw_tool_usage_error(optind == argc ? "missing IP[:PORT]" : "one IP[:PORT] only");
    char host[INET_ADDRSTRLEN];
    uint16_t port;
    const char *why;
    if (kvw_parse_ipv4_port(argv[optind], host, sizeof(host), &port, &why))
        kvw_tool_usage_error("invalid address '%s': %s", argv[optind], why);
    kvw_config_t cfg;
    if (kvw_config_init(&cfg))
        return 1; /* the library said which variable */
    if (key_file) {
        snprintf(cfg.cluster_key_file, sizeof(cfg.cluster_key_file), "%s", key_file);
        cfg.cluster_key[0] = '\0';
    }
    char addr[INET_ADDRSTRLEN + 8];
    snprintf(addr, sizeof(addr), "%s:%u", host, (unsigned)port);
    kvw_bootstrap_params_t p = {
        .struct_size = sizeof(kvw_bootstrap_params_t), .bind_addr = addr, .config = &cfg};
    kvw_bootstrap_t *b;
    kvw_status_t st = kvw_bootstrap_create(&p, &b);
    if (st) {
        fprintf(stderr, "kvw-bootstrap: %s\n", kvw_strerror(st));
        return 1;
    }
    signal(SIGINT, on_signal);
    signal(SIGTERM, on_signal);
    printf("bootstrap %s\n", kvw_bootstrap_addr(b));
    fflush(stdout);
    if (cfg.cluster_key_file[0] || cfg.cluster_key[0])
        fprintf(stderr, "kvw-bootstrap: cluster key set: CURVE authentication and encryption\n");
    while (!stop)
        pause();
    kvw_bootstrap_destroy(b);
    return 0;
}
