/* SPDX-License-Identifier: Apache-2.0 */
/* examples/transfer.c: one KV cache transfer, prefill -> decode, verified.
 *
 *     build/examples/transfer PREFILL_IP DECODE_IP [PREFILL_DEV DECODE_DEV]
 *
 * A template for integrating kvwire into an inference engine, using only
 * the public header. Both engines live in this one process so that the
 * example is self-contained; in a deployment the prefill half and the
 * decode half run in separate processes or hosts, and only the bootstrap
 * address ("ip:port") and the room number travel between them (in your
 * engine's own request metadata).
 *
 *   1. A bootstrap service (here embedded; or the standalone kvw-bootstrap).
 *   2. A prefill engine and a decode engine, each registering its KV memory
 *      once: 2L regions (K layers 0..L-1, then V layers 0..L-1) of PAGES
 *      pages of ITEM bytes, and one aux buffer of AUX_ITEMS items.
 *   3. One request ("room"): decode says where the pages go, prefill says
 *      which pages to send; both sides poll until Success or Failed.
 *   4. Decode's memory is checked byte for byte, then everything is torn
 *      down in order: requests, engines, bootstrap service.
 *
 * The IPs are the hosts' addresses on the RDMA network; without device
 * names the engines find their RDMA device from them. Registered host
 * memory counts against the locked-memory limit (ulimit -l). */
#include <kvwire.h>

#include <inttypes.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

enum {
    LAYERS = 4,     /* L: K and V regions per layer */
    PAGES = 64,     /* pages per region */
    ITEM = 2048,    /* bytes per page index in each region */
    AUX_ITEMS = 8,  /* items in the aux buffer (one per request in flight) */
    AUX_ITEM = 256, /* bytes per aux item */
    NUM_PAGES = 5,  /* pages in the request */
    TIMEOUT_S = 30, /* give the request up after this long */
};

/* One side's memory: 2L KV regions and one aux region, all host memory
 * here (a GPU engine passes its cudaMalloc'ed KV pool's pointers). */
typedef struct side {
    uint8_t *kv[2 * LAYERS];
    uint8_t *aux;
    kvw_region_t kv_regions[2 * LAYERS];
    kvw_region_t aux_region;
} side_t;

static bool side_alloc(side_t *s)
{
    memset(s, 0, sizeof(*s));
    for (int r = 0; r < 2 * LAYERS; r++) {
        s->kv[r] = calloc(PAGES, ITEM);
        if (!s->kv[r])
            return false;
        s->kv_regions[r] = (kvw_region_t){.addr = s->kv[r], .len = PAGES * ITEM, .item_len = ITEM};
    }
    s->aux = calloc(AUX_ITEMS, AUX_ITEM);
    s->aux_region =
        (kvw_region_t){.addr = s->aux, .len = AUX_ITEMS * AUX_ITEM, .item_len = AUX_ITEM};
    return s->aux != NULL;
}

static void side_free(side_t *s)
{
    for (int r = 0; r < 2 * LAYERS; r++)
        free(s->kv[r]);
    free(s->aux);
}

/* The byte prefill holds at offset i of region r: each page of a region
 * differs from the others, so a misplaced page is caught. */
static uint8_t pattern(int r, size_t i)
{
    return (uint8_t)(i * 31 + (size_t)r * 7 + i / ITEM * 13 + 1);
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static int fail(const char *what, kvw_status_t st)
{
    fprintf(stderr, "transfer: %s: %s (%s)\n", what, kvw_strerror(st), kvw_status_name(st));
    return 1;
}

static bool ended(kvw_poll_t p)
{
    return p == KVW_POLL_SUCCESS || p == KVW_POLL_FAILED;
}

/* Both sides' pages of the request, and decode's and prefill's aux items. */
static const uint64_t src_pages[NUM_PAGES] = {3, 4, 5, 9, 20};
static const uint64_t dst_pages[NUM_PAGES] = {10, 11, 12, 0, 63};
static const uint32_t src_aux = 2, dst_aux = 5;

/* Decode's memory after the request: the request's pages and aux item hold
 * prefill's bytes, every other byte is still zero. Returns the bytes wrong. */
static size_t verify(const side_t *prefill, const side_t *decode)
{
    size_t wrong = 0;
    for (int r = 0; r < 2 * LAYERS; r++) {
        for (uint64_t page = 0; page < PAGES; page++) {
            const uint8_t *want = NULL; /* NULL: page not written, must be zero */
            for (int k = 0; k < NUM_PAGES; k++)
                if (dst_pages[k] == page)
                    want = prefill->kv[r] + src_pages[k] * ITEM;
            const uint8_t *got = decode->kv[r] + page * ITEM;
            for (size_t i = 0; i < ITEM; i++)
                wrong += got[i] != (want ? want[i] : 0);
        }
    }
    for (uint32_t a = 0; a < AUX_ITEMS; a++) {
        const uint8_t *got = decode->aux + (size_t)a * AUX_ITEM;
        for (size_t i = 0; i < AUX_ITEM; i++)
            wrong += got[i] != (a == dst_aux ? prefill->aux[src_aux * AUX_ITEM + i] : 0);
    }
    return wrong;
}

int main(int argc, char **argv)
{
    if (argc != 3 && argc != 5) {
        fprintf(stderr, "usage: %s PREFILL_IP DECODE_IP [PREFILL_DEV DECODE_DEV]\n", argv[0]);
        return 2;
    }
    const char *prefill_ip = argv[1], *decode_ip = argv[2];
    const char *prefill_dev = argc == 5 ? argv[3] : NULL; /* NULL: found from the IP */
    const char *decode_dev = argc == 5 ? argv[4] : NULL;
    const uint64_t room = 42; /* unique per request across the deployment */

    side_t p_mem, d_mem;
    if (!side_alloc(&p_mem) || !side_alloc(&d_mem)) {
        fprintf(stderr, "transfer: out of memory\n");
        return 1;
    }
    for (int r = 0; r < 2 * LAYERS; r++)
        for (size_t i = 0; i < PAGES * ITEM; i++)
            p_mem.kv[r][i] = pattern(r, i);
    for (size_t i = 0; i < AUX_ITEMS * AUX_ITEM; i++)
        p_mem.aux[i] = (uint8_t)(0xa5 ^ i);

    int rc = 1;
    kvw_status_t st;
    kvw_bootstrap_t *bootstrap = NULL;
    kvw_engine_t *prefill = NULL, *decode = NULL;
    kvw_sender_t *sender = NULL;
    kvw_receiver_t *receiver = NULL;

    /* 1. The bootstrap service, on an ephemeral port of prefill's address. */
    char bind_addr[64];
    snprintf(bind_addr, sizeof(bind_addr), "%s:0", prefill_ip);
    kvw_bootstrap_params_t bp;
    kvw_bootstrap_params_init(&bp); /* zeroed, struct_size set: defaults for the rest */
    bp.bind_addr = bind_addr;
    if ((st = kvw_bootstrap_create(&bp, &bootstrap))) {
        fail("bootstrap service", st);
        goto out;
    }
    const char *bootstrap_addr = kvw_bootstrap_addr(bootstrap);

    /* 2. The engines. config NULL: defaults plus the KVW_* environment. */
    kvw_engine_params_t pp = {
        .struct_size = sizeof(kvw_engine_params_t), /* lets the library grow the struct */
        .role = KVW_ROLE_PREFILL,
        .engine_rank = 0, /* the rank decode asks the bootstrap service for */
        .device = prefill_dev,
        .local_ip = prefill_ip,
        .bootstrap_addr = bootstrap_addr,
        .num_layers = LAYERS,
        .kv_regions = p_mem.kv_regions,
        .num_kv_regions = 2 * LAYERS, /* the array's length: a mismatch is refused, not read past */
        .num_aux = 1,
        .aux_regions = &p_mem.aux_region,
    };
    if ((st = kvw_engine_create(&pp, &prefill))) {
        fail("prefill engine", st);
        goto out;
    }
    kvw_engine_params_t dp = {
        .struct_size = sizeof(kvw_engine_params_t),
        .role = KVW_ROLE_DECODE,
        .device = decode_dev,
        .local_ip = decode_ip,
        .num_layers = LAYERS,
        .kv_regions = d_mem.kv_regions,
        .num_kv_regions = 2 * LAYERS,
        .num_aux = 1,
        .aux_regions = &d_mem.aux_region,
    };
    if ((st = kvw_engine_create(&dp, &decode))) {
        fail("decode engine", st);
        goto out;
    }
    printf("transfer: prefill on %s (%s), decode on %s (%s), bootstrap %s\n",
           kvw_engine_device_name(prefill), prefill_ip, kvw_engine_device_name(decode), decode_ip,
           bootstrap_addr);

    /* 3. One request. Decode: where the pages go (prefill rank 0, this
     * room). Prefill: how many pages come, then which ones; send may be
     * called once per prefill chunk instead, as the chunks are computed. */
    if ((st = kvw_receiver_create(decode, bootstrap_addr, 0, room, &receiver))) {
        fail("receiver", st);
        goto out;
    }
    if ((st = kvw_receiver_init(receiver, dst_pages, NUM_PAGES, dst_aux))) {
        fail("receiver init", st);
        goto out;
    }
    if ((st = kvw_sender_create(prefill, room, &sender))) {
        fail("sender", st);
        goto out;
    }
    if ((st = kvw_sender_init(sender, NUM_PAGES, src_aux))) {
        fail("sender init", st);
        goto out;
    }
    if ((st = kvw_sender_send(sender, src_pages, NUM_PAGES))) {
        fail("send", st);
        goto out;
    }

    /* Poll both sides until each is Success or Failed. Polls never block
     * (an engine polls from its scheduler loop, once a step); past the
     * deadline, both sides give the request up. A receiver's abort
     * returns at once but the receiver stays Transferring until nothing
     * more can land in its pages, so keep polling until it ended. */
    double deadline = now_s() + TIMEOUT_S;
    bool aborted = false;
    kvw_poll_t rs, ss;
    for (;;) {
        rs = kvw_receiver_poll(receiver);
        ss = kvw_sender_poll(sender);
        if (ended(rs) && ended(ss))
            break;
        if (!aborted && now_s() > deadline) {
            fprintf(stderr, "transfer: no result after %d s: aborting (decode %s, prefill %s)\n",
                    TIMEOUT_S, kvw_poll_name(rs), kvw_poll_name(ss));
            if (!ended(rs))
                kvw_receiver_abort(receiver);
            if (!ended(ss))
                kvw_sender_abort(sender);
            aborted = true;
        }
        nanosleep(&(struct timespec){.tv_nsec = 100000}, NULL); /* 100 us */
    }
    const char *why = NULL;
    if (rs == KVW_POLL_FAILED) {
        st = kvw_receiver_failure(receiver, &why);
        fprintf(stderr, "transfer: decode failed: %s: %s\n", kvw_strerror(st), why ? why : "");
    }
    if (ss == KVW_POLL_FAILED) {
        st = kvw_sender_failure(sender, &why);
        fprintf(stderr, "transfer: prefill failed: %s: %s\n", kvw_strerror(st), why ? why : "");
    }
    if (rs != KVW_POLL_SUCCESS || ss != KVW_POLL_SUCCESS)
        goto out;

    /* 4. Decode's Success means every write landed: check the bytes. */
    kvw_req_metrics_t pm, dm;
    kvw_sender_metrics(sender, &pm);
    kvw_receiver_metrics(receiver, &dm);
    size_t wrong = verify(&p_mem, &d_mem);
    printf("transfer: room %" PRIu64 ": %d pages x %d regions + aux item: prefill wrote %" PRIu64
           " bytes in %" PRIu64 " RDMA writes, decode saw them land in %" PRIu64
           " us; %zu bytes wrong\n",
           room, NUM_PAGES, 2 * LAYERS, pm.bytes, pm.writes, dm.transfer_us, wrong);
    rc = wrong ? 1 : 0;

out:
    /* Teardown: requests before their engines, engines before the
     * bootstrap service their prefill registered with. Each accepts NULL. */
    kvw_receiver_destroy(receiver);
    kvw_sender_destroy(sender);
    kvw_engine_destroy(decode);
    kvw_engine_destroy(prefill);
    kvw_bootstrap_destroy(bootstrap);
    side_free(&d_mem);
    side_free(&p_mem);
    printf("transfer: %s\n", rc ? "FAILED" : "every byte verified");
    return rc;
}
