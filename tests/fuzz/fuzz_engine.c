/* SPDX-License-Identifier: Apache-2.0 */
/* Set-up shared by the libFuzzer harnesses that run the library (prefill,
 * decode, bootstrap): declared in fuzz_common.h, kept out of
 * fuzz_common.c so that the wire harness and the corpus generator link
 * with the wire format alone. */
#include "fuzz/fuzz_common.h"
#include "support/fake_nic.h"
#include "verbs/ops.h"

#include <stdio.h>
#include <stdlib.h>
#include <zmq.h>

void fuzz_open_service(void **zctx_p, kvw_bootstrap_t **bootstrap_p)
{
    *zctx_p = zmq_ctx_new();
    kvw_bootstrap_params_t bp;
    kvw_bootstrap_params_init(&bp);
    bp.bind_addr = "127.0.0.1:0";
    kvw_status_t st = kvw_bootstrap_create(&bp, bootstrap_p);
    if (!*zctx_p || st)
        fuzz_die("harness: bootstrap service: %s", kvw_strerror(st));
}

void *fuzz_service_dealer(void *zctx, kvw_bootstrap_t *bootstrap)
{
    char ep[KVW_WIRE_ENDPOINT_MAX];
    snprintf(ep, sizeof(ep), "tcp://%s", kvw_bootstrap_addr(bootstrap));
    return fuzz_dealer(zctx, NULL, 0, ep, "the bootstrap service");
}

static void alloc_memory(fuzz_memory_t *m)
{
    for (int i = 0; i < FUZZ_REGIONS; i++) {
        uint64_t item, items;
        fuzz_region_shape(i, &item, &items);
        m->mem[i] = calloc(1, item * items);
        if (!m->mem[i])
            fuzz_die("out of memory");
        m->regions[i] = (kvw_region_t){m->mem[i], item * items, item};
    }
    m->groups[0] = (kvw_group_t){KVW_GROUP_KV, FUZZ_LAYERS, 2, &m->regions[0]};
    m->groups[1] = (kvw_group_t){KVW_GROUP_AUX, 1, 1, &m->regions[FUZZ_AUX_REGION]};
    m->groups[2] = (kvw_group_t){KVW_GROUP_STATE, 1, 1, &m->regions[FUZZ_MAMBA_REGION]};
    m->groups[3] = (kvw_group_t){KVW_GROUP_STATE, 1, 1, &m->regions[FUZZ_SWA_REGION]};
}

void fuzz_engine_setup(fuzz_memory_t *mem)
{
    fuzz_quiet_log();
    if (fake_nic_init(NULL))
        fuzz_die("harness: fake_nic_init failed");
    kvw__verbs_set_ops(&fake_nic_ops);
    alloc_memory(mem);
}

void fuzz_engine_config(kvw_config_t *cfg)
{
    kvw_config_init(cfg);
    cfg->sq_depth = 64;
    cfg->rq_depth = 16;
    cfg->chain_max = 8;
    cfg->signal_every = 4;
}

void fuzz_engine_params(kvw_engine_params_t *p, kvw_role_t role, const char *device,
                        const fuzz_memory_t *mem, const kvw_config_t *cfg)
{
    *p = (kvw_engine_params_t){
        .struct_size = sizeof(kvw_engine_params_t),
        .role = role,
        .device = device,
        .local_ip = "127.0.0.1",
        .num_groups = FUZZ_GROUPS,
        .groups = mem->groups,
        .config = cfg,
    };
}
