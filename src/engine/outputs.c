/* SPDX-License-Identifier: Apache-2.0 */
/* Sized outputs (include/kvwire.h, kvw_engine_counters_ex): the whole
 * struct as this library has it, then as much of it as the caller's size
 * holds. The entry points before them keep filling their first release's
 * fields only, so a program built then never has more written than its
 * struct holds. */
#include "engine/core.h"

#include <stddef.h>
#include <string.h>

_Static_assert(offsetof(kvw_counters_t, caller_passes) + sizeof(uint64_t) == KVW_COUNTERS_SIZE_1_0,
               "kvw_counters_t's 1.0 fields moved");
/* kvw_sender_metrics and kvw_receiver_metrics write the struct whole: the
 * day it grows they must fill KVW_REQ_METRICS_SIZE_1_0 bytes only. */
_Static_assert(sizeof(kvw_req_metrics_t) == KVW_REQ_METRICS_SIZE_1_0,
               "kvw_req_metrics_t grew: make the old entry points fill its 1.0 size only");

/* Copy min(size, have) bytes of full to out. */
static kvw_status_t fill(void *out, size_t size, const void *full, size_t have, size_t min)
{
    if (!out || size < min)
        return KVW_ERR_INVALID;
    memcpy(out, full, size < have ? size : have);
    return KVW_OK;
}

kvw_status_t kvw_engine_counters_ex(const kvw_engine_t *e, kvw_counters_t *c, size_t size)
{
    if (!e)
        return KVW_ERR_INVALID;
    kvw_counters_t full = {0};
    kvw_engine_counters(e, &full); /* the 1.0 fields */
    kvw_engine_counters_t *k = (kvw_engine_counters_t *)&e->counters;
    full.handshakes = atomic_load(&k->handshakes);
    full.handshakes_refused = atomic_load(&k->handshakes_refused);
    return fill(c, size, &full, sizeof(full), KVW_COUNTERS_SIZE_1_0);
}

kvw_status_t kvw_sender_metrics_ex(const kvw_sender_t *s, kvw_req_metrics_t *m, size_t size)
{
    kvw_req_metrics_t full = {0};
    kvw_status_t st = m ? kvw_sender_metrics(s, &full) : KVW_ERR_INVALID;
    return st ? st : fill(m, size, &full, sizeof(full), KVW_REQ_METRICS_SIZE_1_0);
}

kvw_status_t kvw_receiver_metrics_ex(const kvw_receiver_t *r, kvw_req_metrics_t *m, size_t size)
{
    kvw_req_metrics_t full = {0};
    kvw_status_t st = m ? kvw_receiver_metrics(r, &full) : KVW_ERR_INVALID;
    return st ? st : fill(m, size, &full, sizeof(full), KVW_REQ_METRICS_SIZE_1_0);
}
