/* SPDX-License-Identifier: Apache-2.0 */
#include "support/engine_pair.h"

#include "engine/core.h"
#include "support/fake_nic.h"
#include "verbs/ops.h"

#include <stdlib.h>
#include <string.h>
#include <time.h>

uint64_t pair_now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

void pair_sleep_ms(int ms)
{
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

static int nic_devices;
static const char *down_at_open[2];

void pair_set_nic_devices(int n)
{
    nic_devices = n;
}

void pair_set_down_at_open(const char *a, const char *b)
{
    down_at_open[0] = a;
    down_at_open[1] = b;
}

void pair_config(kvw_config_t *cfg)
{
    kvw_config_init(cfg);
    cfg->sq_depth = 64;
    cfg->rq_depth = 16;
    cfg->chain_max = 8;
    cfg->signal_every = 4;
    cfg->poll_spin_us = 20;
    cfg->bootstrap_timeout_ms = 3000;
    cfg->transfer_timeout_ms = 3000;
    cfg->heartbeat_ms = 50;
    cfg->peer_timeout_ms = 400;
    cfg->idle_heartbeat_ms = 100;
    cfg->bootstrap_refresh_ms = 1000;
}

static uint8_t content(uint32_t region, uint64_t page, size_t byte)
{
    return (uint8_t)(region * 31u + page * 7u + byte * 13u + 1u);
}

static kvw_status_t alloc_regions(engine_pair_t *p, kvw_region_t *pk, kvw_region_t *dk,
                                  kvw_region_t *pa, kvw_region_t *da)
{
    for (uint32_t i = 0; i < 2 * PAIR_LAYERS; i++) {
        p->src[i] =
            p->gpu_src ? fake_cuda_alloc(PAIR_ITEM * PAIR_POOL) : malloc(PAIR_ITEM * PAIR_POOL);
        p->dst[i] =
            p->gpu_dst ? fake_cuda_alloc(PAIR_ITEM * PAIR_POOL) : malloc(PAIR_ITEM * PAIR_POOL);
        if (!p->src[i] || !p->dst[i])
            return KVW_ERR_NO_MEMORY;
        for (uint64_t pg = 0; pg < PAIR_POOL; pg++)
            for (size_t b = 0; b < PAIR_ITEM; b++)
                p->src[i][pg * PAIR_ITEM + b] = content(i, pg, b);
        memset(p->dst[i], PAIR_CANARY, PAIR_ITEM * PAIR_POOL);
        pk[i] = (kvw_region_t){p->src[i], PAIR_ITEM * PAIR_POOL, PAIR_ITEM};
        dk[i] = (kvw_region_t){p->dst[i], PAIR_ITEM * PAIR_POOL, PAIR_ITEM};
    }
    p->src_aux = malloc(PAIR_AUX_ITEM * PAIR_AUX_ITEMS);
    p->dst_aux = malloc(PAIR_AUX_ITEM * PAIR_AUX_ITEMS);
    if (!p->src_aux || !p->dst_aux)
        return KVW_ERR_NO_MEMORY;
    for (uint64_t it = 0; it < PAIR_AUX_ITEMS; it++)
        for (size_t b = 0; b < PAIR_AUX_ITEM; b++)
            p->src_aux[it * PAIR_AUX_ITEM + b] = content(99, it, b);
    memset(p->dst_aux, PAIR_CANARY, PAIR_AUX_ITEM * PAIR_AUX_ITEMS);
    *pa = (kvw_region_t){p->src_aux, PAIR_AUX_ITEM * PAIR_AUX_ITEMS, PAIR_AUX_ITEM};
    *da = (kvw_region_t){p->dst_aux, PAIR_AUX_ITEM * PAIR_AUX_ITEMS, PAIR_AUX_ITEM};
    return KVW_OK;
}

static kvw_engine_params_t prefill_params(const engine_pair_t *p)
{
    return (kvw_engine_params_t){
        .struct_size = sizeof(kvw_engine_params_t),
        .role = KVW_ROLE_PREFILL,
        .device = "fake0",
        .local_ip = "127.0.0.1",
        .bootstrap_addr = kvw_bootstrap_addr(p->bootstrap),
        .num_layers = PAIR_LAYERS,
        .kv_regions = p->prefill_kv,
        .num_aux = 1,
        .aux_regions = &p->prefill_aux,
        .config = &p->cfg,
    };
}

static kvw_engine_params_t decode_params(const engine_pair_t *p, kvw_region_t *dk, kvw_region_t *da)
{
    for (uint32_t i = 0; i < 2 * PAIR_LAYERS; i++)
        dk[i] = (kvw_region_t){p->dst[i], PAIR_ITEM * PAIR_POOL, PAIR_ITEM};
    *da = (kvw_region_t){p->dst_aux, PAIR_AUX_ITEM * PAIR_AUX_ITEMS, PAIR_AUX_ITEM};
    return (kvw_engine_params_t){
        .struct_size = sizeof(kvw_engine_params_t),
        .role = KVW_ROLE_DECODE,
        .device = "fake1",
        .local_ip = "127.0.0.1",
        .num_layers = PAIR_LAYERS,
        .kv_regions = dk,
        .num_aux = 1,
        .aux_regions = da,
        .config = &p->decode_cfg,
    };
}

kvw_status_t pair_add_decode(engine_pair_t *p, kvw_engine_t **engine_p)
{
    kvw_region_t dk[2 * PAIR_LAYERS], da;
    kvw_engine_params_t dp = decode_params(p, dk, &da);
    return kvw_engine_create(&dp, engine_p);
}

kvw_status_t pair_restart_prefill(engine_pair_t *p)
{
    kvw_engine_destroy(p->prefill);
    p->prefill = NULL;
    kvw_engine_params_t pp = prefill_params(p);
    return kvw_engine_create(&pp, &p->prefill);
}

kvw_status_t pair_open(engine_pair_t *p, const kvw_config_t *cfg)
{
    return pair_open2(p, cfg, NULL);
}

kvw_status_t pair_open2(engine_pair_t *p, const kvw_config_t *cfg, const kvw_config_t *decode_cfg)
{
    return pair_open_staged(p, cfg, decode_cfg, false, false, NULL);
}

kvw_status_t pair_open_staged(engine_pair_t *p, const kvw_config_t *cfg,
                              const kvw_config_t *decode_cfg, bool gpu_src, bool gpu_dst,
                              const fake_cuda_config_t *cuda)
{
    memset(p, 0, sizeof(*p));
    p->gpu_src = gpu_src;
    p->gpu_dst = gpu_dst;
    if (gpu_src || gpu_dst) {
        fake_cuda_init(cuda);
        kvw__cuda_set_ops(&fake_cuda_ops);
    }
    if (cfg)
        p->cfg = *cfg;
    else
        pair_config(&p->cfg);
    p->decode_cfg = decode_cfg ? *decode_cfg : p->cfg;
    fake_nic_config_t nic = {.num_devices = nic_devices};
    if (fake_nic_init(&nic))
        return KVW_ERR_NO_DEVICE;
    for (int i = 0; i < 2 && down_at_open[i]; i++)
        if (fake_nic_kill_device(down_at_open[i]))
            return KVW_ERR_NO_DEVICE;
    kvw__verbs_set_ops(&fake_nic_ops);
    kvw_region_t pk[2 * PAIR_LAYERS], dk[2 * PAIR_LAYERS], pa, da;
    kvw_status_t st = alloc_regions(p, pk, dk, &pa, &da);
    /* The service takes prefill's cluster key (if any) from its config. */
    kvw_bootstrap_params_t bp = {.struct_size = sizeof(kvw_bootstrap_params_t),
                                 .bind_addr = "127.0.0.1:0",
                                 .config = &p->cfg};
    if (!st)
        st = kvw_bootstrap_create(&bp, &p->bootstrap);
    if (st)
        return st;
    memcpy(p->prefill_kv, pk, sizeof(pk));
    p->prefill_aux = pa;
    kvw_engine_params_t pp = prefill_params(p);
    kvw_engine_params_t dp = pp;
    dp.role = KVW_ROLE_DECODE;
    dp.device = "fake1";
    dp.bootstrap_addr = NULL;
    dp.kv_regions = dk;
    dp.aux_regions = &da;
    dp.config = &p->decode_cfg;
    st = kvw_engine_create(&pp, &p->prefill);
    if (!st)
        st = kvw_engine_create(&dp, &p->decode);
    return st;
}

void pair_order_peeks(kvw_engine_t *e)
{
    if (!e)
        return;
    pthread_mutex_lock(&e->lock);
    pthread_mutex_unlock(&e->lock);
}

void pair_close(engine_pair_t *p)
{
    pair_order_peeks(p->prefill);
    kvw_engine_destroy(p->decode);
    kvw_engine_destroy(p->prefill);
    kvw_bootstrap_destroy(p->bootstrap);
    if (p->final_stats) {
        fake_nic_quiesce(1000);
        fake_nic_stats(p->final_stats);
    }
    kvw__verbs_set_ops(NULL);
    fake_nic_fini();
    for (uint32_t i = 0; i < 2 * PAIR_LAYERS; i++) {
        if (p->gpu_src)
            fake_cuda_free(p->src[i]);
        else
            free(p->src[i]);
        if (p->gpu_dst)
            fake_cuda_free(p->dst[i]);
        else
            free(p->dst[i]);
    }
    if (p->gpu_src || p->gpu_dst)
        kvw__cuda_set_ops(NULL);
    free(p->src_aux);
    free(p->dst_aux);
    memset(p, 0, sizeof(*p));
}

static uint64_t mix(uint64_t x)
{
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    return x;
}

void pair_pick(pair_room_t *pr, uint64_t room, size_t n, uint64_t seed, uint32_t slot)
{
    memset(pr, 0, sizeof(*pr));
    pr->room = room;
    pr->n = n;
    /* Source: any pages (reads may overlap). Destination: a window per
     * slot, rotated, so the planner also sees contiguous runs. */
    uint64_t start = (uint64_t)slot * n;
    for (size_t i = 0; i < n; i++) {
        pr->src[i] = mix(seed + i) % PAIR_POOL; /* fragmented: about one write per page */
        pr->dst[i] = (start + (i + mix(seed) % n) % n) % PAIR_POOL;
    }
    /* Aux items are few: only the first slots get one, so rooms in flight
     * together never share a destination item. */
    pr->aux_src = slot < PAIR_AUX_ITEMS ? (uint32_t)(mix(seed ^ 5) % PAIR_AUX_ITEMS) : KVW_NO_AUX;
    pr->aux_dst = slot < PAIR_AUX_ITEMS ? slot : KVW_NO_AUX;
}

kvw_status_t pair_create(engine_pair_t *p, pair_room_t *pr)
{
    kvw_status_t st = kvw_sender_create(p->prefill, pr->room, &pr->s);
    if (!st)
        st = kvw_receiver_create(p->decode, kvw_bootstrap_addr(p->bootstrap), 0, pr->room, &pr->r);
    return st;
}

static bool ended(kvw_poll_t s)
{
    return s == KVW_POLL_SUCCESS || s == KVW_POLL_FAILED;
}

kvw_poll_t pair_wait_sender(const pair_room_t *pr, int timeout_ms)
{
    uint64_t end = pair_now_ms() + (uint64_t)timeout_ms;
    while (!ended(kvw_sender_poll(pr->s)) && pair_now_ms() < end)
        pair_sleep_ms(1);
    return kvw_sender_poll(pr->s);
}

kvw_poll_t pair_wait_receiver(const pair_room_t *pr, int timeout_ms)
{
    uint64_t end = pair_now_ms() + (uint64_t)timeout_ms;
    while (!ended(kvw_receiver_poll(pr->r)) && pair_now_ms() < end)
        pair_sleep_ms(1);
    return kvw_receiver_poll(pr->r);
}

kvw_poll_t pair_wait_sender_ready(const pair_room_t *pr, int timeout_ms)
{
    uint64_t end = pair_now_ms() + (uint64_t)timeout_ms;
    while (kvw_sender_poll(pr->s) == KVW_POLL_BOOTSTRAPPING && pair_now_ms() < end)
        pair_sleep_ms(1);
    return kvw_sender_poll(pr->s);
}

size_t pair_wrong_bytes(const engine_pair_t *p, const pair_room_t *pr)
{
    size_t bad = 0;
    for (uint32_t i = 0; i < 2 * PAIR_LAYERS; i++)
        for (size_t k = 0; k < pr->n; k++)
            for (size_t b = 0; b < PAIR_ITEM; b++)
                bad += p->dst[i][pr->dst[k] * PAIR_ITEM + b] != content(i, pr->src[k], b);
    for (size_t b = 0; pr->aux_dst != KVW_NO_AUX && b < PAIR_AUX_ITEM; b++)
        bad += p->dst_aux[pr->aux_dst * PAIR_AUX_ITEM + b] != content(99, pr->aux_src, b);
    return bad;
}

size_t pair_snapshot_size(const pair_room_t *pr)
{
    return 2 * PAIR_LAYERS * pr->n * PAIR_ITEM + (pr->aux_dst != KVW_NO_AUX ? PAIR_AUX_ITEM : 0);
}

static void walk(const engine_pair_t *p, const pair_room_t *pr, uint8_t *buf, bool *equal)
{
    size_t off = 0;
    for (uint32_t i = 0; i < 2 * PAIR_LAYERS; i++)
        for (size_t k = 0; k < pr->n; k++, off += PAIR_ITEM) {
            const uint8_t *page = p->dst[i] + pr->dst[k] * PAIR_ITEM;
            if (equal)
                *equal = *equal && memcmp(buf + off, page, PAIR_ITEM) == 0;
            else
                memcpy(buf + off, page, PAIR_ITEM);
        }
    if (pr->aux_dst == KVW_NO_AUX)
        return;
    const uint8_t *aux = p->dst_aux + pr->aux_dst * PAIR_AUX_ITEM;
    if (equal)
        *equal = *equal && memcmp(buf + off, aux, PAIR_AUX_ITEM) == 0;
    else
        memcpy(buf + off, aux, PAIR_AUX_ITEM);
}

void pair_snapshot(const engine_pair_t *p, const pair_room_t *pr, uint8_t *buf)
{
    walk(p, pr, buf, NULL);
}

bool pair_snapshot_equal(const engine_pair_t *p, const pair_room_t *pr, const uint8_t *buf)
{
    bool equal = true;
    walk(p, pr, (uint8_t *)buf, &equal);
    return equal;
}

void pair_destroy_room(pair_room_t *pr)
{
    kvw_receiver_destroy(pr->r);
    kvw_sender_destroy(pr->s);
    pr->r = NULL;
    pr->s = NULL;
}

size_t pair_table_size(kvw_engine_t *e)
{
    pthread_mutex_lock(&e->lock);
    size_t n = e->tab.num_reqs;
    pthread_mutex_unlock(&e->lock);
    return n;
}
