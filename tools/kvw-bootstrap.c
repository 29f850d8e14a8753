/* kvw-bootstrap: run the bootstrap service standalone.
 * Usage: kvw-bootstrap IP[:PORT]   (port 0 or none: ephemeral)
 * Prints "bootstrap IP:PORT" once listening; runs until SIGINT/SIGTERM. */
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

int main(int argc, char **argv)
{
    if (argc != 2 || strcmp(argv[1], "-h") == 0 || strcmp(argv[1], "--help") == 0) {
        fprintf(stderr, "usage: %s IP[:PORT]\n", argv[0]);
        return 2;
    }
    char addr[128];
    snprintf(addr, sizeof(addr), strchr(argv[1], ':') ? "%s" : "%s:0", argv[1]);
    kvw_bootstrap_t *b;
    kvw_status_t st = kvw_bootstrap_create(addr, &b);
    if (st) {
        fprintf(stderr, "kvw-bootstrap: %s\n", kvw_strerror(st));
        return 1;
    }
    signal(SIGINT, on_signal);
    signal(SIGTERM, on_signal);
    printf("bootstrap %s\n", kvw_bootstrap_addr(b));
    fflush(stdout);
    while (!stop)
        pause();
    kvw_bootstrap_destroy(b);
    return 0;
}
