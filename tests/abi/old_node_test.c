/* SPDX-License-Identifier: Apache-2.0 */
/* A program linked as one built against 1.1 .. 1.4 was: it asks for
 * kvw_receiver_create_at and kvw_sender_requested in KVWIRE_1.0 (the node
 * those releases exported them in). Today's library has them in
 * KVWIRE_1.1 and keeps KVWIRE_1.0 aliases (src/engine/symver.c): the
 * program must load and reach the functions, which refuse its NULL
 * arguments as the real ones do. */
#include "kvwire.h"

#include <stdio.h>

int main(void)
{
    size_t pages = 0;
    uint32_t aux = 0;
    kvw_receiver_t *r = NULL;
    kvw_status_t a = kvw_sender_requested(NULL, &pages, &aux);
    kvw_status_t b = kvw_receiver_create_at(NULL, "tcp://127.0.0.1:1", 0, 0, &r);
    if (a != KVW_ERR_INVALID || b != KVW_ERR_INVALID) {
        fprintf(stderr, "old_node_test: got %s and %s, want KVW_ERR_INVALID twice\n",
                kvw_status_name(a), kvw_status_name(b));
        return 1;
    }
    printf("old_node_test: a program linked against KVWIRE_1.0's kvw_sender_requested and "
           "kvw_receiver_create_at loads and calls them on %s\n",
           kvw_version_string());
    return 0;
}
