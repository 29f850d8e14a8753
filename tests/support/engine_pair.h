/* SPDX-License-Identifier: Apache-2.0 */
/* A prefill and a decode engine in one test process, on the fake NIC
 * (tests/support/fake_nic.h), talking ZeroMQ over 127.0.0.1 through an
 * embedded bootstrap service. For unit tests and fault injection: the fake
 * NIC is not RDMA and nothing here is reported as RDMA.
 *
 * Prefill's pages hold deterministic contents; decode's pages start as a
 * canary pattern, so a test can tell landed bytes from untouched ones. */
#ifndef KVW_TESTS_ENGINE_PAIR_H
#define KVW_TESTS_ENGINE_PAIR_H

#include "kvwire.h"
#include "support/fake_cuda.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define PAIR_LAYERS 2
#define PAIR_ITEM 256
#define PAIR_POOL 64
#define PAIR_AUX_ITEM 64
#define PAIR_AUX_ITEMS 8
#define PAIR_CANARY 0xee

typedef struct engine_pair {
    kvw_bootstrap_t *bootstrap;
    kvw_engine_t *prefill, *decode;
    kvw_config_t cfg, decode_cfg;
    uint8_t *src[2 * PAIR_LAYERS], *dst[2 * PAIR_LAYERS];
    uint8_t *src_aux, *dst_aux;
    /* fake NIC stats taken by pair_close() after both engines were
     * destroyed, before the NIC itself goes: for leak and balance checks. */
    struct fake_nic_stats *final_stats;
    kvw_region_t prefill_kv[2 * PAIR_LAYERS], prefill_aux;
    bool gpu_src, gpu_dst; /* KV regions in fake CUDA memory (pair_open_staged) */
} engine_pair_t;

/* Test-sized defaults: small queues (chains, signaling and credits all
 * wrap), short timeouts. */
void pair_config(kvw_config_t *cfg);
/* fake_nic_init + ops + bootstrap + both engines ("fake0" prefill, "fake1"
 * decode). cfg NULL: pair_config(). Returns KVW_OK or the failing status. */
kvw_status_t pair_open(engine_pair_t *p, const kvw_config_t *cfg);
/* The same with a different config for decode (NULL: cfg). The bootstrap
 * service uses cfg's cluster key, so a decode_cfg without it (or with
 * another) is a decode engine outside the cluster. */
kvw_status_t pair_open2(engine_pair_t *p, const kvw_config_t *cfg, const kvw_config_t *decode_cfg);
/* pair_open2 with the KV regions of prefill (gpu_src), decode (gpu_dst) or
 * both in "GPU memory" of the fake CUDA seam (support/fake_cuda.h, set up
 * here with cuda, or defaults when NULL): a GPU without GPUDirect RDMA, so
 * those regions take the staging path and every byte goes through the
 * host staging pool (cfg's staging_mib, staging_chunk_kib). Aux regions
 * stay in host memory. pair_close() restores the real CUDA seam. */
kvw_status_t pair_open_staged(engine_pair_t *p, const kvw_config_t *cfg,
                              const kvw_config_t *decode_cfg, bool gpu_src, bool gpu_dst,
                              const fake_cuda_config_t *cuda);
/* Destroy the prefill engine (as its process exiting would close its
 * connections) and start a new one, registered as rank 0 at the same
 * bootstrap. Its senders must have been destroyed. */
kvw_status_t pair_restart_prefill(engine_pair_t *p);
/* One more decode engine ("fake1", decode_cfg) over the same destination
 * pages as p->decode: another decode process, as prefill sees it. */
kvw_status_t pair_add_decode(engine_pair_t *p, kvw_engine_t **engine_p);
/* How many fake devices the next pair_open* creates ("fake0" ...; 0: the
 * fake NIC's default of 2): engines with several rails (KVW_DEVICES) need
 * more. Stays set until changed. */
void pair_set_nic_devices(int n);
/* Devices (up to two; NULL: none) whose link is down (fake_nic_kill_device)
 * when the next pair_open* creates the engines. Stays set until changed. */
void pair_set_down_at_open(const char *a, const char *b);
/* Destroy engines and bootstrap, restore the real ops, fake_nic_fini.
 * Fills *p->final_stats first when it is set. */
void pair_close(engine_pair_t *p);
/* Tests peek at an engine's connections (kvw__peer_at) without its lock.
 * When the other engine goes, this one's poller frees the connection after
 * unpublishing it under the engine lock; taking that lock once before
 * orders every earlier peek before the free (as ThreadSanitizer requires).
 * pair_close() does it for prefill; rigs of their own call it before they
 * destroy decode. */
void pair_order_peeks(kvw_engine_t *e);

/* One request on both sides. */
typedef struct pair_room {
    uint64_t room;
    size_t n;
    uint64_t src[PAIR_POOL], dst[PAIR_POOL];
    uint32_t aux_src, aux_dst;
    kvw_sender_t *s;
    kvw_receiver_t *r;
} pair_room_t;

/* Fill pr with n source pages and n disjoint destination pages chosen from
 * seed (slot picks a destination window, so rooms with different slots do
 * not share pages; n * slots must fit in PAIR_POOL). */
void pair_pick(pair_room_t *pr, uint64_t room, size_t n, uint64_t seed, uint32_t slot);
/* Create both handles. */
kvw_status_t pair_create(engine_pair_t *p, pair_room_t *pr);
/* Wait until the handle's state is Success or Failed, or timeout_ms. */
kvw_poll_t pair_wait_sender(const pair_room_t *pr, int timeout_ms);
kvw_poll_t pair_wait_receiver(const pair_room_t *pr, int timeout_ms);
/* Wait until the sender leaves Bootstrapping (decode's request arrived). */
kvw_poll_t pair_wait_sender_ready(const pair_room_t *pr, int timeout_ms);
/* Bytes in decode's pages of pr that differ from what prefill sent. */
size_t pair_wrong_bytes(const engine_pair_t *p, const pair_room_t *pr);
/* Copy / compare decode's pages of pr (all regions and the aux item) to
 * detect writes that land after Failed. buf holds pair_snapshot_size(). */
size_t pair_snapshot_size(const pair_room_t *pr);
void pair_snapshot(const engine_pair_t *p, const pair_room_t *pr, uint8_t *buf);
bool pair_snapshot_equal(const engine_pair_t *p, const pair_room_t *pr, const uint8_t *buf);
void pair_destroy_room(pair_room_t *pr);

/* Requests in an engine's table, read under the engine's lock (the
 * control thread adds and removes them concurrently). */
size_t pair_table_size(kvw_engine_t *e);

uint64_t pair_now_ms(void);
void pair_sleep_ms(int ms);

#endif
