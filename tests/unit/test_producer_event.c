/* SPDX-License-Identifier: Apache-2.0 */
/* The producer contract for GPU memory (kvw_sender_send_part_after and
 * kvw_sender_send_after), on the fake NIC and the fake CUDA seam
 * (tests/support: not RDMA, not a GPU). A fake CUDA event stands for the
 * event the application records on its compute stream after the kernels
 * that write a part's pages: kvwire must read nothing of that part (no
 * RDMA write of directly registered memory, no staging copy of staged
 * memory) before the event completed, must not wait for it on the
 * caller's thread, must go on with other requests meanwhile, and must
 * fail the request on both sides, naming the CUDA error, when the event
 * fails. Prefill's memory takes one of three forms per test:
 *   DIRECT  "GPU" memory with GPUDirect RDMA: registered through dma-buf,
 *           the NIC reads it;
 *   STAGED  "GPU" memory without it: prefill's stager copies it to host
 *           chunks on its own streams;
 *   HOST    host memory (a kernel may write pinned host memory: the event
 *           still holds).
 * Decode's memory is host memory. Memory the fake NIC may be writing is
 * read through fake_nic_peek (race-free), a few bytes per page. */
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "engine/core.h"
#include "engine/stager.h"
#include "support/engine_pair.h"
#include "support/fake_cuda.h"
#include "support/fake_nic.h"

enum {
    LAYERS = 4,
    NKV = 2 * LAYERS, /* K layers 0..L-1, then V layers 0..L-1 */
    ITEM = 4096,      /* a page of one region */
    PAGES = 64,       /* per region */
    AUX_ITEM = 64,
    AUX_ITEMS = 8,
    CANARY = 0xee,
    WAIT_MS = 10000, /* "must happen within": far beyond what any step takes */
    HOLD_MS = 150,   /* how long an event is held to see that nothing moves */
    GRACE_MS = 200,  /* after an end: time for a late write to show */
    LAUNCH_FAILED = 719,
};

typedef enum { MEM_HOST, MEM_DIRECT, MEM_STAGED } mem_t;

typedef struct side {
    uint8_t *kv[NKV], *aux;
    bool gpu;
    kvw_region_t kvr[NKV], auxr;
} side_t;

static struct {
    kvw_bootstrap_t *bs;
    kvw_engine_t *prefill, *decode;
    side_t src, dst;
    kvw_config_t pcfg, dcfg;
    kvw_cuda_ops_t no_cuda; /* fake_cuda_ops whose driver does not load */
} rig;

/* ERROR lines logged (any thread). */
static pthread_mutex_t log_lock = PTHREAD_MUTEX_INITIALIZER;
static char errors[8192];

static void capture(void *arg, kvw_log_level_t level, const char *msg)
{
    (void)arg;
    pthread_mutex_lock(&log_lock);
    if (level == KVW_LOG_ERROR) {
        size_t used = strlen(errors);
        snprintf(errors + used, sizeof(errors) - used, "%s\n", msg);
    }
    pthread_mutex_unlock(&log_lock);
    if (getenv("KVW_TEST_LOG"))
        fprintf(stderr, "kvwire %d: %s\n", (int)level, msg);
}

static bool logged(const char *needle)
{
    pthread_mutex_lock(&log_lock);
    bool found = strstr(errors, needle) != NULL;
    pthread_mutex_unlock(&log_lock);
    return found;
}

static uint8_t pattern(uint32_t region, uint64_t page, size_t byte)
{
    return (uint8_t)(region * 29u + page * 7u + byte * 13u + 3u);
}

static void side_alloc(side_t *s, bool gpu, bool fill)
{
    s->gpu = gpu;
    for (uint32_t i = 0; i < NKV; i++) {
        size_t len = (size_t)ITEM * PAGES;
        s->kv[i] = gpu ? fake_cuda_alloc(len) : malloc(len);
        assert_non_null(s->kv[i]);
        for (size_t b = 0; b < len; b++)
            s->kv[i][b] = fill ? pattern(i, b / ITEM, b % ITEM) : CANARY;
        s->kvr[i] = (kvw_region_t){s->kv[i], len, ITEM};
    }
    s->aux = malloc(AUX_ITEM * AUX_ITEMS);
    assert_non_null(s->aux);
    for (size_t b = 0; b < AUX_ITEM * AUX_ITEMS; b++)
        s->aux[b] = fill ? pattern(99, b / AUX_ITEM, b % AUX_ITEM) : CANARY;
    s->auxr = (kvw_region_t){s->aux, AUX_ITEM * AUX_ITEMS, AUX_ITEM};
}

static void side_free(side_t *s)
{
    for (uint32_t i = 0; i < NKV; i++)
        if (s->gpu)
            fake_cuda_free(s->kv[i]);
        else
            free(s->kv[i]);
    free(s->aux);
}

static kvw_engine_params_t params(side_t *s, kvw_role_t role, const kvw_config_t *cfg)
{
    bool decode = role == KVW_ROLE_DECODE;
    return (kvw_engine_params_t){
        .struct_size = sizeof(kvw_engine_params_t),
        .role = role,
        .device = decode ? "fake1" : "fake0",
        .local_ip = "127.0.0.1",
        .bootstrap_addr = decode ? NULL : kvw_bootstrap_addr(rig.bs),
        .num_layers = LAYERS,
        .kv_regions = s->kvr,
        .num_aux = 1,
        .aux_regions = &s->auxr,
        .config = cfg,
    };
}

static int no_driver(char *why, size_t size)
{
    snprintf(why, size, "libcuda.so.1 not found (no NVIDIA driver)");
    return -1;
}

static int setup(void **state)
{
    (void)state;
    memset(&rig, 0, sizeof(rig));
    errors[0] = '\0';
    kvw_set_log_handler(capture, NULL, getenv("KVW_TEST_LOG") ? KVW_LOG_INFO : KVW_LOG_ERROR);
    if (fake_nic_init(NULL))
        return -1;
    kvw__verbs_set_ops(&fake_nic_ops);
    pair_config(&rig.pcfg);
    rig.pcfg.staging_mib = 1;        /* prefill: 16 chunks of 64 KiB (8 pages of a layer) */
    rig.pcfg.staging_chunk_kib = 64; /* so a request is staged as many slices */
    rig.pcfg.transfer_timeout_ms = 20000;
    rig.dcfg = rig.pcfg;
    rig.no_cuda = fake_cuda_ops;
    rig.no_cuda.init = no_driver;
    return 0;
}

static int teardown(void **state)
{
    (void)state;
    pair_order_peeks(rig.prefill); /* peeks at its connections, before they go */
    kvw_engine_destroy(rig.decode);
    kvw_engine_destroy(rig.prefill);
    kvw_bootstrap_destroy(rig.bs);
    kvw__verbs_set_ops(NULL);
    fake_nic_fini();
    kvw__cuda_set_ops(NULL);
    side_free(&rig.src);
    side_free(&rig.dst);
    kvw_set_log_handler(NULL, NULL, KVW_LOG_WARN);
    memset(&rig, 0, sizeof(rig));
    return 0;
}

/* Both engines, prefill's KV memory as mem, decode's host memory; the
 * fake CUDA seam installed (ops NULL: fake_cuda_ops). */
static void rig_open_with(mem_t mem, const kvw_cuda_ops_t *ops)
{
    fake_cuda_init(&(fake_cuda_config_t){.gdr = mem == MEM_DIRECT});
    kvw__cuda_set_ops(ops ? ops : &fake_cuda_ops);
    side_alloc(&rig.src, mem != MEM_HOST, true);
    side_alloc(&rig.dst, false, false);
    kvw_bootstrap_params_t bp = {.struct_size = sizeof(kvw_bootstrap_params_t),
                                 .bind_addr = "127.0.0.1:0",
                                 .config = &rig.pcfg};
    assert_int_equal(kvw_bootstrap_create(&bp, &rig.bs), KVW_OK);
    kvw_engine_params_t pp = params(&rig.src, KVW_ROLE_PREFILL, &rig.pcfg);
    kvw_engine_params_t dp = params(&rig.dst, KVW_ROLE_DECODE, &rig.dcfg);
    assert_int_equal(kvw_engine_create(&pp, &rig.prefill), KVW_OK);
    assert_int_equal(kvw_engine_create(&dp, &rig.decode), KVW_OK);
    kvw_mem_path_t want = mem == MEM_HOST     ? KVW_MEM_PATH_HOST
                          : mem == MEM_DIRECT ? KVW_MEM_PATH_DMABUF
                                              : KVW_MEM_PATH_STAGING;
    assert_int_equal(rig.prefill->mrs[0].path, want);
    assert_int_equal(mem == MEM_STAGED, rig.prefill->stager != NULL);
}

static void rig_open(mem_t mem)
{
    rig_open_with(mem, NULL);
}

/* ------------------------------------------------------------ rooms */

typedef struct room {
    uint64_t room;
    size_t n;
    uint64_t src[PAGES], dst[PAGES];
    uint32_t aux_src, aux_dst;
    kvw_sender_t *s;
    kvw_receiver_t *r;
} room_t;

/* n pages from scattered sources to decode's pages [first, first + n);
 * both handles created and initialised, and decode's request arrived at
 * prefill (so that writes could start the moment pages are handed over). */
static void room_start(room_t *q, uint64_t room, size_t n, uint64_t first)
{
    memset(q, 0, sizeof(*q));
    q->room = room;
    q->n = n;
    for (size_t i = 0; i < n; i++) {
        q->src[i] = (i * 7 + room) % PAGES;
        q->dst[i] = first + i;
    }
    q->aux_src = (uint32_t)(room % AUX_ITEMS);
    q->aux_dst = (uint32_t)(first / 8 % AUX_ITEMS);
    assert_int_equal(kvw_sender_create(rig.prefill, room, &q->s), KVW_OK);
    assert_int_equal(kvw_receiver_create(rig.decode, kvw_bootstrap_addr(rig.bs), 0, room, &q->r),
                     KVW_OK);
    assert_int_equal(kvw_receiver_init(q->r, q->dst, n, q->aux_dst), KVW_OK);
    assert_int_equal(kvw_sender_init(q->s, n, q->aux_src), KVW_OK);
    uint64_t end = pair_now_ms() + WAIT_MS;
    while (kvw_sender_poll(q->s) == KVW_POLL_BOOTSTRAPPING && pair_now_ms() < end)
        pair_sleep_ms(1);
    assert_int_equal(kvw_sender_poll(q->s), KVW_POLL_WAITING_FOR_INPUT);
}

/* Layers [lb, le) of every page of q. */
static kvw_part_t layers(const room_t *q, uint32_t lb, uint32_t le)
{
    return (kvw_part_t){.pages = q->src, .num_pages = q->n, .layer_begin = lb, .layer_end = le};
}

static bool ended(kvw_poll_t s)
{
    return s == KVW_POLL_SUCCESS || s == KVW_POLL_FAILED;
}

static kvw_poll_t wait_receiver(const room_t *q, int ms)
{
    uint64_t end = pair_now_ms() + (uint64_t)ms;
    while (!ended(kvw_receiver_poll(q->r)) && pair_now_ms() < end)
        pair_sleep_ms(1);
    return kvw_receiver_poll(q->r);
}

static kvw_poll_t wait_sender(const room_t *q, int ms)
{
    uint64_t end = pair_now_ms() + (uint64_t)ms;
    while (!ended(kvw_sender_poll(q->s)) && pair_now_ms() < end)
        pair_sleep_ms(1);
    return kvw_sender_poll(q->s);
}

/* Bytes of q's pages and aux item at decode that differ from what prefill
 * sent. Only once the receiver is Success (every write landed before). */
static size_t wrong_bytes(const room_t *q)
{
    size_t bad = 0;
    for (uint32_t i = 0; i < NKV; i++)
        for (size_t k = 0; k < q->n; k++)
            for (size_t b = 0; b < ITEM; b++)
                bad += rig.dst.kv[i][q->dst[k] * ITEM + b] != pattern(i, q->src[k], b);
    for (size_t b = 0; b < AUX_ITEM; b++)
        bad += rig.dst.aux[q->aux_dst * AUX_ITEM + b] != pattern(99, q->aux_src, b);
    return bad;
}

static void assert_success(const room_t *q)
{
    const char *why = "";
    if (wait_receiver(q, WAIT_MS) != KVW_POLL_SUCCESS)
        kvw_receiver_failure(q->r, &why);
    assert_string_equal(why, "");
    assert_int_equal(wait_sender(q, WAIT_MS), KVW_POLL_SUCCESS);
    assert_int_equal(wrong_bytes(q), 0);
}

static void room_destroy(room_t *q)
{
    kvw_receiver_destroy(q->r);
    kvw_sender_destroy(q->s);
    q->r = NULL;
    q->s = NULL;
}

/* ---- what landed, read race-free while the wire may be writing ---------- */

static const size_t SAMPLE[] = {0, 511, 1031, 2047, 3001, ITEM - 1};
#define NSAMPLE (sizeof(SAMPLE) / sizeof(SAMPLE[0]))

/* Of q's pages in the K and V regions of layers [lb, le): how many show
 * any write (a sampled byte not the canary), and how many show prefill's
 * bytes at every sample. */
static void look(const room_t *q, uint32_t lb, uint32_t le, size_t *touched, size_t *right)
{
    *touched = *right = 0;
    for (uint32_t l = lb; l < le; l++)
        for (int kv = 0; kv < 2; kv++) {
            uint32_t i = l + (uint32_t)kv * LAYERS;
            for (size_t k = 0; k < q->n; k++) {
                size_t same = 0, canary = 0;
                for (size_t j = 0; j < NSAMPLE; j++) {
                    uint8_t v = fake_nic_peek(&rig.dst.kv[i][q->dst[k] * ITEM + SAMPLE[j]]);
                    canary += v == CANARY;
                    same += v == pattern(i, q->src[k], SAMPLE[j]);
                }
                *touched += canary < NSAMPLE;
                *right += same == NSAMPLE;
            }
        }
}

static size_t touched(const room_t *q, uint32_t lb, uint32_t le)
{
    size_t t, r;
    look(q, lb, le, &t, &r);
    return t;
}

static size_t aux_touched(const room_t *q)
{
    size_t n = 0;
    for (size_t b = 0; b < AUX_ITEM; b++)
        n += fake_nic_peek(&rig.dst.aux[q->aux_dst * AUX_ITEM + b]) != CANARY;
    return n;
}

/* Wait until every page of layers [lb, le) of q shows prefill's bytes. */
static void wait_layers_landed(const room_t *q, uint32_t lb, uint32_t le)
{
    size_t t, r, want = q->n * 2 * (le - lb);
    uint64_t end = pair_now_ms() + WAIT_MS;
    do {
        look(q, lb, le, &t, &r);
        if (r == want)
            return;
        pair_sleep_ms(1);
    } while (pair_now_ms() < end);
    fail_msg("layers [%u, %u): %zu of %zu pages landed", lb, le, r, want);
}

/* Hold for ms, polling q's sender and receiver as an application would
 * (so that the callers' own passes run too): neither ends, and nothing of
 * q lands at decode. (A staged sender shows WaitingForInput until its
 * first slice is staged.) */
static void hold_nothing_lands(const room_t *q, int ms)
{
    uint64_t end = pair_now_ms() + (uint64_t)ms;
    while (pair_now_ms() < end) {
        assert_false(ended(kvw_sender_poll(q->s)));
        assert_int_equal(kvw_receiver_poll(q->r), KVW_POLL_TRANSFERRING);
        pair_sleep_ms(1);
    }
    assert_int_equal(touched(q, 0, LAYERS), 0);
    assert_int_equal(aux_touched(q), 0);
}

/* ----------------------------------------------------------- the tests */

/* (a) An event that completes late delays the writes: while it is pending
 * no byte of the request lands at decode (and prefill's poller looks at
 * the event a bounded number of times, sleeping in between rather than
 * spinning), another request on the same connection completes meanwhile,
 * and once the test completes the event the request is a Success with
 * every byte right, its first write posted after the event completed. */
static void late_event_delays_writes(mem_t mem)
{
    rig_open(mem);
    room_t a, b;
    room_start(&a, 1, 24, 0);
    void *ev = fake_cuda_event_create();
    kvw_engine_t *p = rig.prefill;
    uint64_t sleeps0 = atomic_load(&p->counters.sleeps), t0 = pair_now_ms();
    assert_int_equal(kvw_sender_send_after(a.s, a.src, a.n, ev), KVW_OK);
    hold_nothing_lands(&a, HOLD_MS);

    /* A bystander on the same connection is not held up. */
    room_start(&b, 2, 16, 32);
    assert_int_equal(kvw_sender_send(b.s, b.src, b.n), KVW_OK);
    assert_success(&b);
    hold_nothing_lands(&a, HOLD_MS);
    assert_false(fake_cuda_event_done(ev));

    uint64_t held_ms = pair_now_ms() - t0 + 1;
    long queries = fake_cuda_event_queries(ev);
    uint64_t sleeps = atomic_load(&p->counters.sleeps) - sleeps0;
    print_message("held %llu ms: %ld queries of the event, %llu poller sleeps\n",
                  (unsigned long long)held_ms, queries, (unsigned long long)sleeps);
    assert_true(queries > 0);
    assert_true((uint64_t)queries <= held_ms * 50); /* a re-check, not a spinning core */
    assert_true(atomic_load(&p->counters.event_waits) > 0);
    if (mem != MEM_STAGED)
        assert_true(sleeps > 0); /* the poller slept while the event ran */

    fake_cuda_event_complete(ev);
    assert_success(&a);
    kvw_req_metrics_t m;
    assert_int_equal(kvw_sender_metrics(a.s, &m), KVW_OK);
    assert_true(m.start_ns >= fake_cuda_event_done_ns(ev)); /* first post after the event */
    fake_cuda_event_destroy(ev);
    room_destroy(&a);
    room_destroy(&b);
    fake_cuda_stats_t cs;
    fake_cuda_stats(&cs);
    assert_int_equal(cs.event_misuse, 0);
}

static void test_late_event_direct(void **state)
{
    (void)state;
    late_event_delays_writes(MEM_DIRECT);
}

/* Host memory: the event is honoured all the same (a kernel may write
 * pinned host memory). */
static void test_late_event_host(void **state)
{
    (void)state;
    late_event_delays_writes(MEM_HOST);
}

/* (d) Staged prefill: the stager copies nothing of the part (no copy out
 * of the fake GPU at all) before the event completed, and meanwhile
 * stages another request. */
static void test_late_event_staged(void **state)
{
    (void)state;
    late_event_delays_writes(MEM_STAGED);
}

/* The same, watching the stager's copies: none out of the GPU for the
 * request while its event runs. */
static void test_staged_no_copy_before_event(void **state)
{
    (void)state;
    rig_open(MEM_STAGED);
    room_t a;
    room_start(&a, 1, 24, 0);
    void *ev = fake_cuda_event_create();
    fake_cuda_event_complete_in(ev, 2 * HOLD_MS);
    assert_int_equal(kvw_sender_send_after(a.s, a.src, a.n, ev), KVW_OK);
    fake_cuda_stats_t cs;
    uint64_t end = pair_now_ms() + HOLD_MS;
    while (pair_now_ms() < end) {
        fake_cuda_stats(&cs);
        bool done = fake_cuda_event_done(ev); /* after the look: a copy seen came before it */
        if (!done)
            assert_int_equal(cs.copies_from_gpu, 0);
        pair_sleep_ms(1);
    }
    assert_success(&a);
    kvw_req_metrics_t m;
    assert_int_equal(kvw_sender_metrics(a.s, &m), KVW_OK);
    assert_true(m.start_ns >= fake_cuda_event_done_ns(ev));
    fake_cuda_stats(&cs);
    assert_true(cs.copies_from_gpu > 0);
    room_destroy(&a);
    fake_cuda_event_destroy(ev);
}

/* (b) An event that fails fails the request on both sides with a reason
 * naming the CUDA error: layer 0 (no event) landed, the layer whose event
 * failed and the ones after it do not land, decode reports Failed only
 * once nothing more can land (its memory does not change after), and the
 * connection and a bystander request are unaffected. */
static void failed_event_fails_request(mem_t mem)
{
    rig_open(mem);
    room_t a, b, c;
    room_start(&a, 1, 24, 0);
    room_start(&b, 2, 16, 32);
    const kvw_peer_t *peer = kvw__peer_at(rig.prefill, 0);
    void *e1 = fake_cuda_event_create(), *e2 = fake_cuda_event_create();
    fake_cuda_event_complete(e2); /* the part after it is ready: it must not go either */
    kvw_part_t l0 = layers(&a, 0, 1), l1 = layers(&a, 1, 2), rest = layers(&a, 2, LAYERS);
    assert_int_equal(kvw_sender_send_part_after(a.s, &l0, NULL), KVW_OK);
    assert_int_equal(kvw_sender_send_part_after(a.s, &l1, e1), KVW_OK);
    assert_int_equal(kvw_sender_send_part_after(a.s, &rest, e2), KVW_OK);
    wait_layers_landed(&a, 0, 1);
    assert_int_equal(kvw_sender_send(b.s, b.src, b.n), KVW_OK);
    fake_cuda_event_fail(e1, LAUNCH_FAILED);

    const char *why = "";
    assert_int_equal(wait_sender(&a, WAIT_MS), KVW_POLL_FAILED);
    fake_cuda_event_destroy(e1); /* the request ended: kvwire is done with its events */
    fake_cuda_event_destroy(e2);
    assert_int_equal(kvw_sender_failure(a.s, &why), KVW_ERR_TRANSFER);
    print_message("prefill: %s\n", why);
    assert_non_null(strstr(why, "CUDA_ERROR_LAUNCH_FAILED"));
    assert_non_null(strstr(why, "layers [1, 2)"));
    assert_int_equal(wait_receiver(&a, WAIT_MS), KVW_POLL_FAILED);
    assert_int_equal(kvw_receiver_failure(a.r, &why), KVW_ERR_TRANSFER);
    print_message("decode: %s\n", why);
    assert_true(strncmp(why, "prefill: ", 9) == 0);
    assert_non_null(strstr(why, "CUDA_ERROR_LAUNCH_FAILED"));
    assert_true(logged("CUDA_ERROR_LAUNCH_FAILED"));

    /* Decode's Failed is final: nothing of the failed part, or after it,
     * ever lands. */
    size_t t0, r0;
    look(&a, 0, 1, &t0, &r0);
    pair_sleep_ms(GRACE_MS);
    assert_int_equal(touched(&a, 1, LAYERS), 0);
    assert_int_equal(aux_touched(&a), 0);
    size_t t1, r1;
    look(&a, 0, 1, &t1, &r1);
    assert_int_equal(r0, a.n * 2); /* layer 0 had landed, and stays as it was */
    assert_int_equal(r1, r0);

    /* The bystander, and the next request, on the same connection. */
    assert_success(&b);
    room_start(&c, 3, 16, 48);
    assert_int_equal(kvw_sender_send(c.s, c.src, c.n), KVW_OK);
    assert_success(&c);
    assert_ptr_equal(kvw__peer_at(rig.prefill, 0), peer);
    assert_int_equal(atomic_load(&peer->state), PEER_CONNECTED);
    assert_int_equal(atomic_load(&rig.prefill->num_peers), 1);
    room_destroy(&a);
    room_destroy(&b);
    room_destroy(&c);
    fake_cuda_stats_t cs;
    fake_cuda_stats(&cs);
    assert_int_equal(cs.event_misuse, 0);
}

static void test_failed_event_direct(void **state)
{
    (void)state;
    failed_event_fails_request(MEM_DIRECT);
}

static void test_failed_event_staged(void **state)
{
    (void)state;
    failed_event_fails_request(MEM_STAGED);
}

/* (c) Layer-wise: every layer handed over at once with its own event (as
 * a forward pass queues its layers), the events completed in order by the
 * test: each layer lands once its event completed and not before, later
 * layers stay untouched meanwhile, and the request is a Success. */
static void layer_wise_in_order(mem_t mem)
{
    rig_open(mem);
    room_t a;
    room_start(&a, 1, 24, 0);
    void *ev[LAYERS];
    for (uint32_t l = 0; l < LAYERS; l++) {
        ev[l] = fake_cuda_event_create();
        kvw_part_t part = layers(&a, l, l + 1);
        assert_int_equal(kvw_sender_send_part_after(a.s, &part, ev[l]), KVW_OK);
    }
    hold_nothing_lands(&a, HOLD_MS / 3);
    for (uint32_t l = 0; l < LAYERS; l++) {
        fake_cuda_event_complete(ev[l]);
        wait_layers_landed(&a, l, l + 1);
        pair_sleep_ms(20); /* a later layer would have had time to land */
        assert_int_equal(touched(&a, l + 1, LAYERS), 0);
        if (l + 1 < LAYERS)
            assert_int_equal(aux_touched(&a), 0); /* with the final part */
    }
    assert_success(&a);
    room_destroy(&a);
    for (uint32_t l = 0; l < LAYERS; l++)
        fake_cuda_event_destroy(ev[l]);
}

static void test_layer_wise_direct(void **state)
{
    (void)state;
    layer_wise_in_order(MEM_DIRECT);
}

static void test_layer_wise_staged(void **state)
{
    (void)state;
    layer_wise_in_order(MEM_STAGED);
}

/* Layer-wise with events completing by themselves at set times
 * (SPACING_MS apart): midway between two, the layers whose events have
 * not completed are untouched; the request ends Success, its first write
 * after layer 0's event. */
static void test_layer_wise_timed(void **state)
{
    (void)state;
    enum { SPACING_MS = 300, LOOK_MS = 100 };
    rig_open(MEM_DIRECT);
    room_t a;
    room_start(&a, 1, 24, 0);
    void *ev[LAYERS];
    uint64_t start = pair_now_ms();
    for (uint32_t l = 0; l < LAYERS; l++) {
        ev[l] = fake_cuda_event_create();
        fake_cuda_event_complete_in(ev[l], SPACING_MS * (l + 1));
        kvw_part_t part = layers(&a, l, l + 1);
        assert_int_equal(kvw_sender_send_part_after(a.s, &part, ev[l]), KVW_OK);
    }
    for (uint32_t l = 0; l <= LAYERS; l++) {
        uint64_t at = start + (uint64_t)SPACING_MS * l + LOOK_MS;
        while (pair_now_ms() < at)
            pair_sleep_ms(1);
        for (uint32_t j = l; j < LAYERS; j++) {
            if (fake_cuda_event_done(ev[j]))
                continue; /* this thread was late: nothing to say of it */
            size_t t = touched(&a, j, j + 1);
            if (!fake_cuda_event_done(ev[j]))
                assert_int_equal(t, 0);
        }
    }
    assert_success(&a);
    kvw_req_metrics_t m;
    assert_int_equal(kvw_sender_metrics(a.s, &m), KVW_OK);
    assert_true(m.start_ns >= fake_cuda_event_done_ns(ev[0]));
    room_destroy(&a);
}

/* Giving a request up while it waits on its event: it fails at once on
 * prefill and on decode, the caller may destroy the event as soon as it
 * sees Failed (kvwire never queries it after), nothing lands, and the
 * connection goes on. Also by destroying the sender. */
static void give_up_while_waiting(mem_t mem)
{
    rig_open(mem);
    room_t a, b, c;
    room_start(&a, 1, 24, 0);
    room_start(&b, 2, 16, 32);
    void *ea = fake_cuda_event_create(), *eb = fake_cuda_event_create();
    assert_int_equal(kvw_sender_send_after(a.s, a.src, a.n, ea), KVW_OK);
    assert_int_equal(kvw_sender_send_after(b.s, b.src, b.n, eb), KVW_OK);
    pair_sleep_ms(20); /* both set aside, their events queried */

    assert_int_equal(kvw_sender_abort(a.s), KVW_OK);
    assert_int_equal(kvw_sender_poll(a.s), KVW_POLL_FAILED);
    fake_cuda_event_destroy(ea);
    kvw_sender_t *bs = b.s;
    b.s = NULL;
    kvw_sender_destroy(bs);
    fake_cuda_event_destroy(eb);

    assert_int_equal(wait_receiver(&a, WAIT_MS), KVW_POLL_FAILED);
    assert_int_equal(kvw_receiver_failure(a.r, NULL), KVW_ERR_ABORTED);
    assert_int_equal(wait_receiver(&b, WAIT_MS), KVW_POLL_FAILED);
    pair_sleep_ms(GRACE_MS);
    assert_int_equal(touched(&a, 0, LAYERS) + aux_touched(&a), 0);
    assert_int_equal(touched(&b, 0, LAYERS) + aux_touched(&b), 0);
    fake_cuda_stats_t cs;
    fake_cuda_stats(&cs);
    assert_int_equal(cs.event_misuse, 0);

    room_start(&c, 3, 16, 48);
    assert_int_equal(kvw_sender_send(c.s, c.src, c.n), KVW_OK);
    assert_success(&c);
    room_destroy(&a);
    kvw_receiver_destroy(b.r);
    room_destroy(&c);
    fake_cuda_stats(&cs);
    assert_int_equal(cs.event_misuse, 0);
}

static void test_give_up_while_waiting_direct(void **state)
{
    (void)state;
    give_up_while_waiting(MEM_DIRECT);
}

static void test_give_up_while_waiting_staged(void **state)
{
    (void)state;
    give_up_while_waiting(MEM_STAGED);
}

/* (e) A NULL event is the call without _after: chunks and layer-wise
 * parts land as before, and no event is ever queried. */
static void test_null_event_unchanged(void **state)
{
    (void)state;
    rig_open(MEM_DIRECT);
    room_t a, b;
    room_start(&a, 1, 24, 0);
    assert_int_equal(kvw_sender_send_after(a.s, a.src, 10, NULL), KVW_OK);
    assert_int_equal(kvw_sender_send_after(a.s, a.src + 10, a.n - 10, NULL), KVW_OK);
    assert_success(&a);
    room_start(&b, 2, 16, 32);
    for (uint32_t l = 0; l < LAYERS; l++) {
        kvw_part_t part = layers(&b, l, l + 1);
        assert_int_equal(kvw_sender_send_part_after(b.s, &part, NULL), KVW_OK);
    }
    assert_success(&b);
    fake_cuda_stats_t cs;
    fake_cuda_stats(&cs);
    assert_int_equal(cs.event_queries, 0);
    assert_int_equal(atomic_load(&rig.prefill->counters.event_queries), 0);
    assert_int_equal(atomic_load(&rig.prefill->counters.event_waits), 0);
    room_destroy(&a);
    room_destroy(&b);
}

/* Without CUDA (the driver does not load), an event is refused with
 * KVW_ERR_UNSUPPORTED and a log line that says why, and nothing changes:
 * the request goes on with the same part without an event. */
static void test_event_without_cuda(void **state)
{
    (void)state;
    rig_open_with(MEM_HOST, &rig.no_cuda);
    room_t a;
    room_start(&a, 1, 24, 0);
    void *ev = fake_cuda_event_create();
    kvw_part_t part = layers(&a, 0, LAYERS);
    assert_int_equal(kvw_sender_send_part_after(a.s, &part, ev), KVW_ERR_UNSUPPORTED);
    assert_int_equal(kvw_sender_send_after(a.s, a.src, a.n, ev), KVW_ERR_UNSUPPORTED);
    assert_true(logged("CUDA is not available"));
    assert_true(logged("libcuda.so.1 not found"));
    assert_int_equal(kvw_sender_poll(a.s), KVW_POLL_WAITING_FOR_INPUT);
    assert_int_equal(fake_cuda_event_queries(ev), 0);
    assert_int_equal(kvw_sender_send_part_after(a.s, &part, NULL), KVW_OK);
    assert_success(&a);
    room_destroy(&a);
}

int main(int argc, char **argv)
{
    /* An argument runs only the tests whose name contains it. */
    if (argc > 1)
        cmocka_set_test_filter(argv[1]);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_late_event_direct, setup, teardown),
        cmocka_unit_test_setup_teardown(test_late_event_host, setup, teardown),
        cmocka_unit_test_setup_teardown(test_late_event_staged, setup, teardown),
        cmocka_unit_test_setup_teardown(test_staged_no_copy_before_event, setup, teardown),
        cmocka_unit_test_setup_teardown(test_failed_event_direct, setup, teardown),
        cmocka_unit_test_setup_teardown(test_failed_event_staged, setup, teardown),
        cmocka_unit_test_setup_teardown(test_layer_wise_direct, setup, teardown),
        cmocka_unit_test_setup_teardown(test_layer_wise_staged, setup, teardown),
        cmocka_unit_test_setup_teardown(test_layer_wise_timed, setup, teardown),
        cmocka_unit_test_setup_teardown(test_give_up_while_waiting_direct, setup, teardown),
        cmocka_unit_test_setup_teardown(test_give_up_while_waiting_staged, setup, teardown),
        cmocka_unit_test_setup_teardown(test_null_event_unchanged, setup, teardown),
        cmocka_unit_test_setup_teardown(test_event_without_cuda, setup, teardown),
    };
    return cmocka_run_group_tests_name("producer events on the fake NIC and fake CUDA", tests, NULL,
                                       NULL);
}
