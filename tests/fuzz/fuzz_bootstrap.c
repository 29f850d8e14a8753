/* SPDX-License-Identifier: Apache-2.0 */
/* libFuzzer harness for the bootstrap service, black-box: a real service
 * (kvw_bootstrap_create) and two ZeroMQ DEALERs that send it the input's
 * records (fuzz_common.h); records flagged FUZZ_OTHER go out on the
 * second one, so registrations from two peers meet.
 *
 * Sync: the first DEALER then looks up a rank that the input does not
 * mention (no 4-byte little-endian copy of it in the input), so the reply
 * that echoes that rank can only answer the harness's LOOKUP. The service
 * serves one connection in order, so that reply proves every frame of the
 * first DEALER before it was handled. No reply within FUZZ_SYNC_MS is a
 * hang: abort(). This relies only on what any version of the service does
 * at the socket level: a LOOKUP is answered by a LOOKUP_REPLY for its rank.
 * ASan/UBSan reports and crashes in the service thread end the process,
 * which libFuzzer reports with the input. */
#include "fuzz/fuzz_common.h"

#include <string.h>

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

enum {
    SYNC_RANK_FIRST = 1000, /* inside the service's rank range, away from the seeds' */
    SYNC_RANKS = 3000,
};

static struct {
    void *zctx, *main, *other;
    kvw_bootstrap_t *bootstrap;
    uint32_t next_rank;
} g;

static bool mentions(const uint8_t *data, size_t size, uint32_t rank)
{
    uint8_t le[4] = {(uint8_t)rank, (uint8_t)(rank >> 8), (uint8_t)(rank >> 16),
                     (uint8_t)(rank >> 24)};
    return memmem(data, size, le, sizeof(le)) != NULL;
}

/* A rank for this input's LOOKUP that no record can have asked about. */
static uint32_t sync_rank(const uint8_t *data, size_t size)
{
    for (;;) {
        uint32_t r = SYNC_RANK_FIRST + g.next_rank++ % SYNC_RANKS;
        if (!mentions(data, size, r))
            return r;
    }
}

static void drain(void *sock)
{
    kvw_msg_t m;
    while (fuzz_recv_msg(sock, 0, NULL, NULL, &m))
        kvw__wire_free(&m);
}

static bool reply_for(const kvw_msg_t *m, void *arg)
{
    return m->type == KVW_MSG_BS_LOOKUP_REPLY && m->u.bs.rank == *(const uint32_t *)arg;
}

static bool await_reply(uint32_t rank)
{
    return fuzz_await(g.main, FUZZ_SYNC_MS, reply_for, &rank);
}

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    fuzz_quiet_log();
    fuzz_open_service(&g.zctx, &g.bootstrap);
    g.main = fuzz_service_dealer(g.zctx, g.bootstrap);
    g.other = fuzz_service_dealer(g.zctx, g.bootstrap);
    /* Left to process exit on purpose: libFuzzer ends with exit(). */
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    drain(g.main);
    drain(g.other);
    fuzz_record_t recs[FUZZ_MAX_RECORDS];
    size_t n = fuzz_split(data, size, recs);
    fuzz_send_records(g.main, NULL, 0, recs, n, FUZZ_SEND_MAIN);
    fuzz_send_records(g.other, NULL, 0, recs, n, FUZZ_SEND_OTHER);
    kvw_msg_t look = {.type = KVW_MSG_BS_LOOKUP};
    look.u.bs.rank = sync_rank(data, size);
    fuzz_send_msg(g.main, NULL, 0, &look);
    if (!await_reply(look.u.bs.rank))
        fuzz_die("the bootstrap service answered no LOOKUP within %d ms: hung", FUZZ_SYNC_MS);
    return 0;
}
