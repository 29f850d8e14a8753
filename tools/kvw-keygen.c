/* SPDX-License-Identifier: Apache-2.0 */
/* kvw-keygen: write a new cluster key (a ZeroMQ CURVE secret key, Z85) for
 * kvwire's authenticated, encrypted control plane.
 * Usage: kvw-keygen [--force] FILE
 * The file is created with mode 0600; an existing one is kept unless
 * --force. */
#include "kvwire.h"

#include "ctrl/zsock.h"

#include <errno.h>
#include <stdbool.h>
#include <stdio.h>
#include <string.h>

static int usage(const char *argv0)
{
    fprintf(stderr,
            "usage: %s [--force] FILE\n"
            "  writes a new kvwire cluster key to FILE (mode 0600); --force replaces an\n"
            "  existing one (every engine and bootstrap service must then get the new key)\n",
            argv0);
    return 2;
}

int main(int argc, char **argv)
{
    bool force = false;
    const char *path = NULL;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--force") == 0)
            force = true;
        else if (argv[i][0] == '-' || path)
            return usage(argv[0]);
        else
            path = argv[i];
    }
    if (!path)
        return usage(argv[0]);
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
