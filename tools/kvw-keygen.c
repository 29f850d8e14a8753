/* SPDX-License-Identifier: Apache-2.0 */
/* kvw-keygen: write a new cluster key (a ZeroMQ CURVE secret key, Z85) for
 * kvwire's authenticated, encrypted control plane.
 * Usage: kvw-keygen [--force] FILE
 * The file is created with mode 0600; an existing one is kept unless
 * --force. */
#include "kvwire.h"

#include "ctrl/zsock.h"
#include "kvw-tools.h"

#include <getopt.h>

#include <errno.h>
#include <stdbool.h>
#include <stdio.h>
#include <string.h>

static void usage(void)
{
    printf("Usage: kvw-keygen [--force] FILE\n"
           "Write a new kvwire cluster key (a ZeroMQ CURVE secret key, Z85) to FILE,\n"
           "created with mode 0600, for kvwire's authenticated, encrypted control plane.\n"
           "\n"
           "Options:\n"
           "  --force        replace an existing FILE (every engine and bootstrap service\n"
           "                 must then get the new key)\n"
           "  -h, --help     this help\n"
           "  -V, --version  the kvwire version\n"
           "\n"
           "Exit status: 0 written; 1 a bad command line, FILE exists (without --force),\n"
           "cannot be written, or libzmq has no CURVE support.\n");
    exit(0);
}

int main(int argc, char **argv)
{
    kvw_tool_name = "kvw-keygen";
    static const struct option opts[] = {{"force", no_argument, NULL, 'f'},
                                         {"help", no_argument, NULL, 'h'},
                                         {"version", no_argument, NULL, 'V'},
                                         {NULL, 0, NULL, 0}};
    bool force = false;
    int c;
    while ((c = getopt_long(argc, argv, "hV", opts, NULL)) != -1) {
        if (c == 'f')
            force = true;
        else if (c == 'h')
            usage();
        else if (c == 'V')
            kvw_tool_version();
        else
            kvw_tool_bad_option();
    }
    if (optind != argc - 1)
        kvw_tool_usage_error(optind == argc ? "missing FILE" : "one FILE only");
    const char *path = argv[optind];
    if (!zmq_has("curve")) {
        fprintf(stderr, "kvw-keygen: this libzmq has no CURVE support (built without "
                        "libsodium); the control plane cannot be secured here\n");
        return 1;
    }
    int err = kvw__zkey_write_file(path, force, NULL);
    if (err == EEXIST) {
        fprintf(stderr, "kvw-keygen: %s exists; keeping it (use --force to replace it)\n", path);
        return 1;
    }
    if (err) {
        fprintf(stderr, "kvw-keygen: cannot write %s: %s\n", path, strerror(err));
        return 1;
    }
    printf("wrote a new kvwire cluster key to %s (mode 0600)\n"
           "Copy it to every host of the cluster (keep it secret), then give it to every\n"
           "engine, bootstrap service and tool there:\n"
           "  export KVW_CLUSTER_KEY_FILE=%s\n"
           "(or kvw_config_t.cluster_key_file). Control connections are then encrypted, and\n"
           "only holders of this key can register, look up, handshake or request.\n",
           path, path);
    return 0;
}
