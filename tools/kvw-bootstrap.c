/* kvw-bootstrap: run the bootstrap service standalone.
 * Usage: kvw-bootstrap [--key-file FILE] IP[:PORT]   (port 0 or none: ephemeral)
 * Prints "bootstrap IP:PORT" once listening; runs until SIGINT/SIGTERM.
 * With a cluster key (--key-file, or KVW_CLUSTER_KEY_FILE / KVW_CLUSTER_KEY
 * in the environment) only engines holding the same key are served, over
 * encrypted connections. It may be restarted at any time: prefill engines
 * re-register every KVW_BOOTSTRAP_REFRESH_MS. */
#include "kvwire.h"

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

static int usage(const char *argv0)
{
    fprintf(stderr, "usage: %s [--key-file FILE] IP[:PORT]\n", argv0);
    return 2;
}

int main(int argc, char **argv)
{
    kvw_config_t cfg;
    if (kvw_config_init(&cfg))
        return 1; /* the library said which variable */
    int i = 1;
    if (argc == 4 && strcmp(argv[1], "--key-file") == 0) {
        snprintf(cfg.cluster_key_file, sizeof(cfg.cluster_key_file), "%s", argv[2]);
        cfg.cluster_key[0] = '\0';
        i = 3;
    }
    if (argc != i + 1 || argv[i][0] == '-')
        return usage(argv[0]);
    char addr[128];
    snprintf(addr, sizeof(addr), strchr(argv[i], ':') ? "%s" : "%s:0", argv[i]);
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
