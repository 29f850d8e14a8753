/* SPDX-License-Identifier: Apache-2.0 */
/* Symbols that older releases exported in an earlier version node than
 * the one of the release that added them (src/kvwire.map). 1.1 added
 * kvw_receiver_create_at and kvw_sender_requested, and 1.1 to 1.4 exported
 * them in KVWIRE_1.0 (the node's pattern caught them): a program linked
 * against those releases asks for name@KVWIRE_1.0. Since 1.5 each is
 * name@@KVWIRE_1.1, and these aliases answer the old requests, so such a
 * program still loads. Shared library only: a static link has no
 * versions. */
#include "kvwire.h"

#ifdef __PIC__
/* Each calls the current symbol, which stays the default. */
#define KVW_COMPAT(ret, name, node, params, args)                                                  \
    KVW_API ret kvw__compat_##name params;                                                         \
    KVW_API ret kvw__compat_##name params                                                          \
    {                                                                                              \
        return name args;                                                                          \
    }                                                                                              \
    __asm__(".symver kvw__compat_" #name "," #name "@" node);

KVW_COMPAT(kvw_status_t, kvw_receiver_create_at, "KVWIRE_1.0",
           (kvw_engine_t * engine, const char *endpoint, uint32_t prefill_rank, uint64_t room,
            kvw_receiver_t **receiver_p),
           (engine, endpoint, prefill_rank, room, receiver_p))
KVW_COMPAT(kvw_status_t, kvw_sender_requested, "KVWIRE_1.0",
           (const kvw_sender_t *sender, size_t *num_pages_p, uint32_t *aux_p),
           (sender, num_pages_p, aux_p))
#endif
