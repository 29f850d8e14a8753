/* SPDX-License-Identifier: Apache-2.0 */
/* Engine lifecycle: validate parameters, open the device, register every
 * region once, bind the control socket, publish it, start the threads; and
 * undo all of it in reverse order. */
#include "engine/control.h"
#include "engine/core.h"
#include "engine/stager.h"
#include "engine/verify.h"

#include "common/config.h"
#include "common/log.h"
#include "common/sized.h"
#include "ctrl/bootstrap.h"
#include "ctrl/registry.h"
#include "ctrl/zsock.h"
#include "verbs/topo.h"

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/random.h>
#include <unistd.h>

static kvw_status_t check_region(const char *kind, uint32_t i, const kvw_region_t *g)
{
    if (!g->addr || !g->len || !g->item_len || g->len % g->item_len) {
        KVW_ERROR("%s region %u: addr %p, len %zu, item_len %zu: need a non-empty region whose "
                  "length is a multiple of its item length",
                  kind, i, g->addr, g->len, g->item_len);
        return KVW_ERR_INVALID;
    }
    return KVW_OK;
}

/* A count the caller gave for an array whose length the layout implies
 * (since 1.4). 0 is an older caller's "implied"; any other value must be
 * what the layout reads, since a different one means the array the caller
 * built is not the one the layout describes: reading it would run past
 * its end or leave entries out. */
static kvw_status_t check_count(const char *field, size_t given, uint64_t need, const char *by)
{
    if (!given || given == need)
        return KVW_OK;
    KVW_ERROR("engine params: %s is %zu, but %s needs %llu entries", field, given, by,
              (unsigned long long)need);
    return KVW_ERR_INVALID;
}

/* group_num_regions: each group's regions array against its own shape. */
static kvw_status_t check_group_counts(const kvw_engine_params_t *p)
{
    if (!p->group_num_regions)
        return KVW_OK;
    if (!p->num_groups) {
        KVW_ERROR("engine params: group_num_regions is set, but the classic layout has no "
                  "groups (leave it NULL)");
        return KVW_ERR_INVALID;
    }
    for (uint32_t i = 0; i < p->num_groups; i++) {
        const kvw_group_t *g = &p->groups[i];
        uint64_t need = (uint64_t)g->num_layers * g->regions_per_layer;
        if (p->group_num_regions[i] != need) {
            KVW_ERROR("engine params: group_num_regions[%u] is %zu, but group %u's num_layers %u "
                      "x regions_per_layer %u needs %llu regions",
                      i, p->group_num_regions[i], i, g->num_layers, g->regions_per_layer,
                      (unsigned long long)need);
            return KVW_ERR_INVALID;
        }
    }
    return KVW_OK;
}

static kvw_status_t check_counts(const kvw_engine_params_t *p)
{
    uint64_t kv = p->num_groups ? 0 : (uint64_t)p->num_layers * 2;
    uint64_t heads = !p->group_heads ? 0 : p->num_groups ? p->num_groups : 1;
    const char *kv_by = p->num_groups ? "a layout of groups (kv_regions unused)" : "2 x num_layers";
    const char *heads_by = !p->group_heads ? "group_heads NULL"
                           : p->num_groups ? "one entry per group (num_groups)"
                                           : "the classic layout (its K/V group)";
    kvw_status_t st = check_count("num_kv_regions", p->num_kv_regions, kv, kv_by);
    if (!st)
        st = check_count("num_group_heads", p->num_group_heads, heads, heads_by);
    return st ? st : check_group_counts(p);
}

static kvw_status_t check_params(const kvw_engine_params_t *p)
{
    if (!p || (p->role != KVW_ROLE_PREFILL && p->role != KVW_ROLE_DECODE) || !p->local_ip) {
        KVW_ERROR("engine params: need a role and local_ip");
        return KVW_ERR_INVALID;
    }
    bool classic = p->num_layers || p->kv_regions || p->num_aux || p->aux_regions;
    if (p->num_groups ? classic || !p->groups
                      : !p->num_layers || !p->kv_regions || (p->num_aux && !p->aux_regions)) {
        KVW_ERROR("engine params: give either num_groups and groups, or num_layers > 0 with "
                  "2L kv_regions (and aux_regions when num_aux > 0), not both");
        return KVW_ERR_INVALID;
    }
    if (p->num_groups > KVW_LAYOUT_MAX_GROUPS || (uint64_t)p->num_layers * 2 > UINT32_MAX) {
        KVW_ERROR("engine params: at most %u buffer groups", KVW_LAYOUT_MAX_GROUPS);
        return KVW_ERR_INVALID;
    }
    if ((p->attn_tp_size || p->attn_tp_rank) && p->role != KVW_ROLE_DECODE) {
        KVW_ERROR("engine params: attn_tp_rank and attn_tp_size are for decode engines learning "
                  "their heads; a prefill engine describes its own");
        return KVW_ERR_INVALID;
    }
    if ((p->attn_tp_size || p->attn_tp_rank) && p->attn_tp_rank >= p->attn_tp_size) {
        KVW_ERROR("engine params: attn_tp_rank %u is not below attn_tp_size %u", p->attn_tp_rank,
                  p->attn_tp_size);
        return KVW_ERR_INVALID;
    }
    return check_counts(p);
}

/* The classic parameters as groups: one K/V group, one aux group. */
static uint32_t params_groups(const kvw_engine_params_t *p, kvw_group_t *g)
{
    if (p->num_groups) {
        memcpy(g, p->groups, p->num_groups * sizeof(*g));
        return p->num_groups;
    }
    g[0] = (kvw_group_t){KVW_GROUP_KV, p->num_layers, 2, p->kv_regions};
    g[1] = (kvw_group_t){KVW_GROUP_AUX, 1, p->num_aux, p->aux_regions};
    return p->num_aux ? 2 : 1;
}

static uint64_t random_id(void)
{
    uint64_t v = 0;
    if (getrandom(&v, sizeof(v), 0) != sizeof(v))
        v = kvw__now_ns() ^ ((uint64_t)getpid() << 32);
    return v;
}

_Static_assert((int)KVW_PAGE_NHD == (int)KVW_HEADS_NHD && (int)KVW_PAGE_HND == (int)KVW_HEADS_HND,
               "public and planner page orders agree");

/* Group i's entry learns its heads from prefill (the learning entry, with
 * attn_tp_size set): kept in e->learn, the layout's heads left 0 until
 * learned. Any other undescribed entry is all zeros from here on, so that
 * our HELLO never shows a learning group we do not mean. */
static kvw_status_t take_heads(kvw_engine_t *e, uint32_t i, const kvw_group_t *g, kvw_heads_t h,
                               bool learning_on, kvw_heads_t *out)
{
    *out = (kvw_heads_t){0};
    if (h.total) {
        *out = h;
    } else if (learning_on && kvw__heads_learning(&h)) {
        if (g->kind != KVW_GROUP_KV || h.order > KVW_HEADS_HND) {
            KVW_ERROR("engine params: group %u learns its heads: only kv groups do, with page "
                      "order NHD or HND (%u)",
                      i, h.order);
            return KVW_ERR_INVALID;
        }
        e->learn_groups |= 1ull << i;
        e->learn[i] = h;
    }
    return KVW_OK;
}

static kvw_status_t build_layout(kvw_engine_t *e, const kvw_group_t *g, uint32_t n,
                                 const kvw_group_heads_t *heads, uint32_t num_heads,
                                 bool learning_on)
{
    kvw_layout_group_t lg[KVW_LAYOUT_MAX_GROUPS];
    for (uint32_t i = 0; i < n; i++) {
        if (!g[i].regions) {
            KVW_ERROR("engine params: group %u has no regions", i);
            return KVW_ERR_INVALID;
        }
        lg[i] =
            (kvw_layout_group_t){(uint32_t)g[i].kind, g[i].num_layers, g[i].regions_per_layer, 0};
        if (heads && i < num_heads) { /* the same fields, in the same order (plan/heads.h) */
            kvw_heads_t h = {heads[i].total_heads, heads[i].first_head,  heads[i].num_heads,
                             heads[i].head_bytes,  heads[i].page_tokens, heads[i].page_order};
            kvw_status_t st = take_heads(e, i, &g[i], h, learning_on, &lg[i].heads);
            if (st)
                return st;
        }
    }
    char why[160];
    int rc = kvw__layout_build(&e->layout, lg, n, KVW_WIRE_MAX_REGIONS, why, sizeof(why));
    if (rc == -1)
        KVW_ERROR("engine params: %s", why);
    return rc == 0 ? KVW_OK : rc == -1 ? KVW_ERR_INVALID : KVW_ERR_NO_MEMORY;
}

/* Copy every group's regions into one flat array, in layout order. */
static kvw_status_t copy_layout(kvw_engine_t *e, const kvw_engine_params_t *p)
{
    kvw_group_t g[KVW_LAYOUT_MAX_GROUPS];
    uint32_t n = params_groups(p, g);
    /* The classic layout's one entry is its K/V group's. */
    kvw_status_t st =
        build_layout(e, g, n, p->group_heads, p->num_groups ? n : 1, p->attn_tp_size != 0);
    if (st)
        return st;
    uint32_t total = e->layout.num_regions;
    e->regions = calloc(total, sizeof(*e->regions));
    uint64_t *items = calloc(total, sizeof(*items));
    if (!e->regions || !items) {
        free(items);
        return KVW_ERR_NO_MEMORY;
    }
    for (uint32_t i = 0; i < n; i++) {
        const kvw_layout_group_t *lg = &e->layout.groups[i];
        uint32_t count = lg->num_layers * lg->per_layer;
        for (uint32_t r = 0; r < count && !st; r++)
            st = check_region(kvw__layout_kind_name(lg->kind), lg->first + r, &g[i].regions[r]);
        if (!st)
            memcpy(e->regions + lg->first, g[i].regions, count * sizeof(*e->regions));
    }
    for (uint32_t r = 0; r < total && !st; r++)
        items[r] = e->regions[r].len / e->regions[r].item_len;
    if (!st) {
        kvw__layout_limits(&e->layout, items, e->local_max);
        kvw__layout_state_limits(&e->layout, items, e->state_max);
    }
    for (uint32_t r = 0; r < total && !st; r++)
        items[r] = e->regions[r].item_len; /* now the item lengths, for the heads' check */
    for (uint32_t i = 0; i < n; i++)
        e->layout_heads |= e->layout.groups[i].heads.total != 0 || e->learn_groups >> i & 1;
    char why[200];
    if (!st && kvw__layout_check_heads(&e->layout, items, why, sizeof(why))) {
        KVW_ERROR("engine params: %s", why);
        st = KVW_ERR_INVALID;
    }
    for (uint32_t i = 0; i < n && !st; i++) {
        uint64_t len;
        if (e->learn_groups >> i & 1 &&
            kvw__layout_group_item_len(&e->layout, i, items, &len, why, sizeof(why))) {
            KVW_ERROR("engine params: %s", why);
            st = KVW_ERR_INVALID;
        }
    }
    if (!st && p->attn_tp_size && !e->learn_groups) {
        KVW_ERROR("engine params: attn_tp_size is %u, but no kv group learns its heads (an "
                  "entry of group_heads with total_heads, first_head, num_heads and head_bytes "
                  "0 and page_tokens set)",
                  p->attn_tp_size);
        st = KVW_ERR_INVALID;
    }
    e->tp_rank = p->attn_tp_rank;
    e->tp_size = p->attn_tp_size;
    free(items);
    return st;
}

/* Every region on every rail, through the memory seam; mrs holds rail
 * r's registrations at r * num_regions (kvw__rail_mrs). */
static kvw_status_t register_regions(kvw_engine_t *e)
{
    uint32_t n = e->layout.num_regions;
    e->mrs = calloc((size_t)n * e->nrails, sizeof(*e->mrs));
    if (!e->mrs)
        return KVW_ERR_NO_MEMORY;
    for (uint32_t i = 0; i < n; i++) {
        kvw_mr_t mrs[KVW_MAX_RAILS];
        kvw_dev_t *devs[KVW_MAX_RAILS];
        for (uint32_t r = 0; r < e->nrails; r++)
            devs[r] = e->rail[r].dev;
        kvw_status_t st =
            kvw__mem_register_rails(&e->mem, devs, e->nrails, e->regions[i].addr, e->regions[i].len,
                                    e->role == KVW_ROLE_DECODE, mrs);
        if (st)
            return st;
        for (uint32_t r = 0; r < e->nrails; r++)
            e->mrs[(size_t)r * n + i] = mrs[r];
        if (!e->event_ctx) /* producer events are queried in it, should the driver want one */
            e->event_ctx = e->mrs[i].cuda_ctx;
    }
    return KVW_OK;
}

/* A completion channel per rail: a CQ can only be bound to a channel of
 * its own device. */
static kvw_status_t open_channel(kvw_engine_t *e)
{
    for (uint32_t r = 0; r < e->nrails; r++) {
        kvw_dev_t *d = e->rail[r].dev;
        e->rail[r].channel = d->ops->create_comp_channel(d->ctx);
        if (!e->rail[r].channel) {
            KVW_ERROR("%s: ibv_create_comp_channel failed: %s", d->name, strerror(errno));
            return KVW_ERR_VERBS;
        }
        /* Non-blocking: the poller drains events after poll() says the fd is ready. */
        int flags = fcntl(e->rail[r].channel->fd, F_GETFL);
        fcntl(e->rail[r].channel->fd, F_SETFL, flags | O_NONBLOCK);
    }
    e->channel = e->rail[0].channel;
    e->poller_wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    e->control_wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (e->poller_wake_fd < 0 || e->control_wake_fd < 0) {
        KVW_ERROR("eventfd failed: %s", strerror(errno));
        return KVW_ERR_NO_MEMORY;
    }
    return KVW_OK;
}

static kvw_status_t open_control(kvw_engine_t *e)
{
    e->zctx = zmq_ctx_new();
    if (!e->zctx)
        return KVW_ERR_CONTROL;
    /* Before any socket: only prefill serves (its router needs the ZAP
     * handler); decode only dials out, one DEALER per peer. */
    kvw_status_t st =
        kvw__zsecurity_create(e->zctx, &e->cfg, e->role == KVW_ROLE_PREFILL, &e->zsec);
    if (st || e->role == KVW_ROLE_DECODE)
        return st;
    e->router = kvw__zsocket_secure(e->zctx, ZMQ_ROUTER, e->cfg.heartbeat_ms, e->zsec);
    char bind[KVW_WIRE_ENDPOINT_MAX], name[32];
    size_t len = sizeof(e->endpoint);
    snprintf(bind, sizeof(bind), "tcp://%s:*", e->local_ip);
    /* Sends to a vanished identity fail (EHOSTUNREACH) instead of vanishing:
     * that is how the control thread learns which decode engine went away. */
    int mandatory = 1;
    if (e->router)
        zmq_setsockopt(e->router, ZMQ_ROUTER_MANDATORY, &mandatory, sizeof(mandatory));
    snprintf(name, sizeof(name), "%016llx", (unsigned long long)e->id);
    if (e->router)
        e->router_monitor = kvw__zmonitor(
            e->zctx, e->router, name,
            ZMQ_EVENT_DISCONNECTED | ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL |
                ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL | ZMQ_EVENT_HANDSHAKE_FAILED_AUTH);
    if (!e->router || zmq_bind(e->router, bind) ||
        zmq_getsockopt(e->router, ZMQ_LAST_ENDPOINT, e->endpoint, &len)) {
        KVW_ERROR("cannot bind control socket %s: %s", bind, zmq_strerror(errno));
        return KVW_ERR_CONTROL;
    }
    if (!e->bootstrap_addr[0])
        return KVW_OK;
    st = kvw__registrar_create(e->zctx, e->zsec, e->bootstrap_addr, e->rank, e->endpoint, e->id,
                               e->cfg.bootstrap_refresh_ms, &e->ctl->registrar);
    return st ? st : kvw__registrar_register(e->ctl->registrar, e->cfg.bootstrap_timeout_ms);
}

/* KVW_REGISTRY: prefill puts its rank there (besides any bootstrap
 * address), decode reads the ranks and watches them. Both at most
 * bootstrap_timeout_ms, failing creation as an unreachable bootstrap does. */
static kvw_status_t open_registry(kvw_engine_t *e)
{
    kvw_status_t st = kvw__registry_open_env(&e->registry);
    if (st || !e->registry)
        return st;
    if (e->role == KVW_ROLE_DECODE)
        return kvw__registry_watch(e->registry, e->cfg.bootstrap_timeout_ms);
    /* The lease as the bootstrap service's: three refresh intervals. */
    return kvw__registry_register(e->registry, e->rank, e->endpoint, e->id,
                                  3 * e->cfg.bootstrap_refresh_ms, e->cfg.bootstrap_timeout_ms);
}

/* The PCI bus id of the GPU that owns the engine's first KV region in GPU
 * memory; false for host memory (or a driver that cannot say). */
static bool kv_gpu(const kvw_engine_t *e, char *bus_id, size_t size)
{
    const kvw_cuda_ops_t *cuda = kvw__cuda_ops();
    for (uint32_t g = 0; g < e->layout.num_groups; g++) {
        const kvw_layout_group_t *lg = &e->layout.groups[g];
        if (lg->kind != KVW_GROUP_KV || !lg->num_layers || !lg->per_layer)
            continue;
        kvw_cuda_ptr_t ptr;
        kvw_cuda_dev_t dev;
        char why[160];
        if (cuda->pointer_info(e->regions[lg->first].addr, &ptr, why, sizeof(why)) ||
            (ptr.type != KVW_CUDA_PTR_DEVICE && ptr.type != KVW_CUDA_PTR_MANAGED) ||
            cuda->device_info(ptr.device, &dev, why, sizeof(why)) || dev.pci[0] == '?')
            return false;
        snprintf(bus_id, size, "%s", dev.pci);
        return true;
    }
    return false;
}

/* No device named: the one nearest the KV regions' GPU (or the caller's
 * NUMA node) among those up on local_ip's network (verbs/topo.h); NULL
 * when the topology cannot tell, and the device is found from local_ip as
 * before. Logged once, with the reason. */
static const char *pick_device(const kvw_engine_t *e, const kvw_engine_params_t *p, char *name,
                               size_t size)
{
    char gpu[32], why[KVW_TOPO_REASON_MAX];
    if (p->device)
        return p->device;
    bool on_gpu = kv_gpu(e, gpu, sizeof(gpu));
    if (kvw__topo_choose(kvw__verbs_ops(), e->cfg.ib_port, p->local_ip, on_gpu ? gpu : NULL, name,
                         size, why, sizeof(why)) == 0) {
        KVW_INFO("no RDMA device named: using %s, %s", name, why);
        return name;
    }
    KVW_INFO("no RDMA device named and the topology picks none (%s): the device that owns %s", why,
             p->local_ip);
    return NULL;
}

/* KVW_DEVICES=near: the device picked by affinity and every other one as
 * near the KV regions' GPU (or the caller's NUMA node), into names (rail 0
 * first). Their count, logged once with why; 0 when the topology picks
 * none (the engine then opens one device as without near: the one named,
 * else the one that owns local_ip). */
static int near_devices(const kvw_engine_t *e, const kvw_engine_params_t *p,
                        char names[][KVW_CONFIG_DEVICE_NAME])
{
    char gpu[32], why[KVW_TOPO_NEAR_REASON_MAX + KVW_TOPO_REASON_MAX];
    bool on_gpu = kv_gpu(e, gpu, sizeof(gpu));
    int n = kvw__topo_choose_near(kvw__verbs_ops(), e->cfg.ib_port, p->local_ip,
                                  on_gpu ? gpu : NULL, names, why, sizeof(why));
    if (n > 0) {
        KVW_INFO("KVW_DEVICES=near: %s", why);
        return n;
    }
    KVW_INFO("KVW_DEVICES=near and the topology picks none (%s): one device, %s %s", why,
             p->device ? "the one named," : "the one that owns",
             p->device ? p->device : p->local_ip);
    return 0;
}

/* The engine's devices: those KVW_DEVICES names (each with its first
 * usable GID: local_ip is one device's address, not every rail's), or
 * those near the KV regions (KVW_DEVICES=near: rail 0, the affinity pick,
 * on local_ip's network with its GID, the others with their first), else
 * the one device named or picked by affinity. */
_Static_assert((int)KVW_CONFIG_MAX_DEVICES == (int)KVW_MAX_RAILS,
               "one rail per device KVW_DEVICES names");
_Static_assert((int)KVW_TOPO_MAX_RAILS == (int)KVW_MAX_RAILS,
               "KVW_DEVICES=near takes at most as many devices as rails");
_Static_assert((int)KVW_CONFIG_DEVICE_NAME == 64, "kvw__topo_choose_near's names are 64 long");

static kvw_status_t open_rails(kvw_engine_t *e, const kvw_engine_params_t *p)
{
    char names[KVW_MAX_RAILS][KVW_CONFIG_DEVICE_NAME], picked[64];
    int n = kvw__config_devices(e->cfg.devices, names);
    if (n < 0)
        return KVW_ERR_INVALID;
    bool near = kvw__config_devices_near(e->cfg.devices);
    if (near)
        n = near_devices(e, p, names);
    kvw_status_t st = KVW_OK;
    if (n == 0) {
        /* near with no pick: the one device as without near, without logging twice */
        const char *device = near ? p->device : pick_device(e, p, picked, sizeof(picked));
        st = kvw__dev_open(device, p->local_ip, e->cfg.ib_port, e->cfg.gid_index, &e->rail[0].dev);
        e->nrails = st ? 0 : 1;
    }
    /* One rail of several may be down (a node starting with a NIC out):
     * its lanes join once it comes up. One alone must be up. */
    kvw_status_t (*open_dev)(const char *, const char *, uint8_t, int, kvw_dev_t **) =
        n > 1 ? kvw__dev_open_rail : kvw__dev_open;
    for (int r = 0; r < n && !st; r++) {
        bool on_ip = r == 0 && (n == 1 || near);
        st = open_dev(names[r], on_ip ? p->local_ip : NULL, e->cfg.ib_port, e->cfg.gid_index,
                      &e->rail[r].dev);
        e->nrails = st ? (uint32_t)r : (uint32_t)r + 1;
    }
    uint32_t up = 0;
    for (uint32_t r = 0; r < e->nrails && !st; r++) {
        st = kvw__dev_check_limits(e->rail[r].dev, e->cfg.sq_depth, e->cfg.rq_depth);
        e->rail[r].mbps = e->rail[r].dev->link_mbps;
        up += !e->rail[r].dev->down_at_open;
    }
    if (!st && !up) {
        KVW_ERROR("KVW_DEVICES=%s: no rail's port is up", e->cfg.devices);
        st = KVW_ERR_NO_DEVICE;
    }
    e->dev = e->rail[0].dev;
    if (!st && e->nrails > 1)
        KVW_INFO("%u rails (KVW_DEVICES=%s): requests are striped over them", e->nrails,
                 e->cfg.devices);
    return st;
}

static kvw_status_t start_threads(kvw_engine_t *e)
{
    if (kvw__copier_start(e)) /* first: the poller hands it the landed copies */
        return KVW_ERR_NO_MEMORY;
    if (pthread_create(&e->poller_thread, NULL, kvw__poller_main, e))
        return KVW_ERR_NO_MEMORY;
    e->poller_started = true;
    pthread_setname_np(e->poller_thread, "kvw-poller");
    if (pthread_create(&e->control_thread, NULL, kvw__control_main, e))
        return KVW_ERR_NO_MEMORY;
    e->control_started = true;
    pthread_setname_np(e->control_thread, "kvw-control");
    return KVW_OK;
}

/* Once per engine, so a log says which library ran with which settings:
 * the version and the KVW_* variables that kvw_config_init applied. */
static void log_version_and_overrides(const kvw_engine_params_t *p)
{
    if (!kvw__log_enabled(KVW_LOG_INFO))
        return;
    char vars[768];
    kvw__config_env_summary(vars, sizeof(vars));
    KVW_INFO("kvwire %s, %s engine rank %u: KVW_* overrides %s: %s", kvw_version_string(),
             p->role == KVW_ROLE_PREFILL ? "prefill" : "decode", p->engine_rank,
             p->config ? "in the environment (applied if the caller's config came from "
                         "kvw_config_init)"
                       : "applied",
             vars);
}

static kvw_status_t init_engine(kvw_engine_t *e, const kvw_engine_params_t *p)
{
    kvw_status_t st = kvw__config_read(p->config, &e->cfg);
    if (st || (st = kvw__config_validate(&e->cfg)))
        return st;
    log_version_and_overrides(p);
    e->role = p->role;
    e->ops = e->role == KVW_ROLE_PREFILL ? &kvw__prefill_ops : &kvw__decode_ops;
    e->rank = p->engine_rank;
    e->id = random_id();
    snprintf(e->log_tag, sizeof(e->log_tag), "%s r%u %016llx",
             e->role == KVW_ROLE_PREFILL ? "prefill" : "decode", e->rank,
             (unsigned long long)e->id);
    kvw__log_set_engine(e->log_tag); /* until kvw_engine_create returns */
    snprintf(e->local_ip, sizeof(e->local_ip), "%s", p->local_ip);
    if (p->bootstrap_addr)
        snprintf(e->bootstrap_addr, sizeof(e->bootstrap_addr), "%s", p->bootstrap_addr);
    if (e->role == KVW_ROLE_DECODE) {
        e->tab.tokens = calloc(1u << KVW_TOKEN_BITS, sizeof(*e->tab.tokens));
        e->tab.token_gen = calloc(1u << KVW_TOKEN_BITS, sizeof(*e->tab.token_gen));
        if (!e->tab.tokens || !e->tab.token_gen)
            return KVW_ERR_NO_MEMORY;
    }
    /* Twice the live cap: dead connections keep their slot until their
     * writes drained and their BYE went out. */
    e->peer_slots = 2 * e->cfg.max_peers;
    e->peers = calloc(e->peer_slots, sizeof(*e->peers));
    if (!e->peers || kvw__ctl_create(e))
        return KVW_ERR_NO_MEMORY;
    if ((st = copy_layout(e, p)))
        return st;
    if ((st = open_rails(e, p)))
        return st;
    if ((st = kvw__mem_ctx_init(&e->mem, &e->cfg)) || (st = register_regions(e)) ||
        (st = kvw__stager_create(e)) || (st = kvw__landing_create(e)) || (st = open_channel(e)) ||
        (st = open_control(e)) || (st = open_registry(e)))
        return st;
    e->verify_mode = kvw__verify_mode(e); /* who reads the memory: its path decides */
    e->wire = (kvw_wire_offer_t){KVW_WIRE_VERSION_MIN, KVW_WIRE_VERSION, KVW_WIRE_CAPS_ALL};
    return start_threads(e);
}

kvw_status_t kvw_engine_create(const kvw_engine_params_t *in, kvw_engine_t **engine_p)
{
    kvw_engine_params_t params_in = {0}, *params = &params_in;
    if (!engine_p || !in ||
        kvw__sized_read("engine params", params, sizeof(*params), KVW__ENGINE_PARAMS_MIN_SIZE,
                        in) ||
        check_params(params))
        return KVW_ERR_INVALID;
    kvw_engine_t *e = calloc(1, sizeof(*e));
    if (!e)
        return KVW_ERR_NO_MEMORY;
    e->poller_wake_fd = e->control_wake_fd = -1;
    pthread_mutex_init(&e->lock, NULL);
    pthread_mutex_init(&e->pass_lock, NULL);
    pthread_mutex_init(&e->event_lock, NULL);
    kvw_status_t st = init_engine(e, params);
    if (st) {
        kvw_engine_destroy(e);
        kvw__log_set_engine(NULL);
        return st;
    }
    KVW_INFO("%s engine rank %u on %s (GID %d), control %s", e->role ? "decode" : "prefill",
             e->rank, e->dev->name, e->dev->gid_index, e->endpoint[0] ? e->endpoint : "-");
    kvw__log_set_engine(NULL);
    *engine_p = e;
    return KVW_OK;
}

static void fail_remaining(kvw_engine_t *e)
{
    pthread_mutex_lock(&e->lock);
    for (kvw_req_t *r = e->reqs; r; r = r->next)
        kvw__req_fail(r, KVW_ERR_STATE, "engine destroyed"); /* a parked one: to the ready queue */
    pthread_mutex_unlock(&e->lock);
}

void kvw_engine_destroy(kvw_engine_t *e)
{
    if (!e)
        return;
    kvw__log_set_engine(e->log_tag); /* its lines while it ends; cleared below */
    atomic_store(&e->stop, true);
    kvw__stager_stop(e); /* it appends to requests and takes the lock */
    if (e->control_started) {
        kvw__wake(e->control_wake_fd);
        pthread_join(e->control_thread, NULL);
    }
    /* Only now: decode's control thread ended its connections in order
     * (kvw__decode_close_all) while the poller kept reaping. */
    atomic_store(&e->poller_stop, true);
    if (e->poller_started) {
        kvw__wake(e->poller_wake_fd);
        pthread_join(e->poller_thread, NULL);
    }
    kvw__copier_stop(e); /* what the poller handed it is finished */
    fail_remaining(e);
    /* Requests handed to the poller after it stopped (parked ones failed
     * just above among them) still hold its reference. */
    while (e->ready_head) {
        kvw_req_t *r = e->ready_head;
        e->ready_head = r->qnext;
        kvw__req_unref(r);
    }
    e->ready_tail = NULL;
    if (e->peers)
        kvw__peers_destroy_all(e);
    free((void *)e->peers);
    kvw__stager_destroy(e);  /* no QP reads the pool any more */
    kvw__landing_destroy(e); /* nor writes the landing buffer */
    kvw__ctl_destroy(e);     /* its registrar: before the ZeroMQ context ends */
    kvw__registry_close(e->registry, true);
    kvw__zmonitor_close(e->router, e->router_monitor);
    if (e->router)
        zmq_close(e->router);
    kvw__zsecurity_destroy(e->zsec); /* its ZAP socket would hold zmq_ctx_term */
    if (e->zctx)
        zmq_ctx_term(e->zctx);
    for (uint32_t r = 0; r < e->nrails; r++) {
        if (e->rail[r].channel)
            e->rail[r].dev->ops->destroy_comp_channel(e->rail[r].channel);
        for (uint32_t i = 0; e->mrs && i < e->layout.num_regions; i++)
            kvw__mem_deregister(e->rail[r].dev, &e->mrs[(size_t)r * e->layout.num_regions + i]);
        kvw__dev_close(e->rail[r].dev);
    }
    if (e->poller_wake_fd >= 0)
        close(e->poller_wake_fd);
    if (e->control_wake_fd >= 0)
        close(e->control_wake_fd);
    /* Requests the user never destroyed are the user's leak to fix; the
     * engine only drops its own references. */
    e->reqs_tail = NULL;
    while (e->reqs) {
        kvw_req_t *r = e->reqs;
        e->reqs = r->next;
        r->prev = r->next = NULL;
        kvw__req_unref(r);
    }
    kvw_req_t *r;
    while ((r = kvw__pop_work_locked(e))) /* the work list's references */
        kvw__req_unref(r);
    kvw__reqtab_fini(e);
    free(e->tab.tokens);
    free(e->tab.token_gen);
    free(e->regions);
    free(e->mrs);
    kvw__layout_free(&e->layout);
    pthread_mutex_destroy(&e->lock);
    pthread_mutex_destroy(&e->pass_lock);
    pthread_mutex_destroy(&e->event_lock);
    free(e);
    kvw__log_set_engine(NULL);
}

const char *kvw_engine_device_name(const kvw_engine_t *e)
{
    return e->dev->name;
}

int kvw_engine_gid_index(const kvw_engine_t *e)
{
    return e->dev->gid_index;
}

const char *kvw_engine_endpoint(const kvw_engine_t *e)
{
    return e->endpoint;
}

void kvw_engine_counters(const kvw_engine_t *e, kvw_counters_t *c)
{
    kvw_engine_counters_t *k = (kvw_engine_counters_t *)&e->counters;
    c->bytes_posted = atomic_load(&k->bytes);
    c->wrs_posted = atomic_load(&k->wrs);
    c->chains_posted = atomic_load(&k->chains);
    c->completions = atomic_load(&k->completions);
    c->wrs_completed = atomic_load(&k->wrs_completed);
    c->wrs_flushed = atomic_load(&k->wrs_flushed);
    c->errors = atomic_load(&k->errors);
    c->requests_ok = atomic_load(&k->ok);
    c->requests_failed = atomic_load(&k->failed);
    c->cq_sleeps = atomic_load(&k->sleeps);
    c->caller_passes = atomic_load(&k->caller_passes);
}

uint32_t kvw_engine_rails(const kvw_engine_t *e, kvw_rail_t *rails, uint32_t max)
{
    for (uint32_t r = 0; rails && r < e->nrails && r < max; r++) {
        rails[r] = (kvw_rail_t){.gid_index = e->rail[r].dev->gid_index,
                                .link_mbps = e->rail[r].mbps,
                                .wrs_posted = atomic_load(&e->rail[r].wrs),
                                .bytes_posted = atomic_load(&e->rail[r].bytes)};
        snprintf(rails[r].device, sizeof(rails[r].device), "%s", e->rail[r].dev->name);
    }
    return e->nrails;
}

uint32_t kvw_engine_rail_health(const kvw_engine_t *e, kvw_rail_health_t *health, uint32_t max)
{
    for (uint32_t r = 0; health && r < e->nrails && r < max; r++)
        health[r] =
            (kvw_rail_health_t){.lanes_failed = (uint32_t)atomic_load(&e->rail[r].failed),
                                .lanes_rejoined = (uint32_t)atomic_load(&e->rail[r].rejoined),
                                .lanes_out = (uint32_t)atomic_load(&e->rail[r].out),
                                .probes = (uint32_t)atomic_load(&e->rail[r].probes),
                                .recovery_us_last = atomic_load(&e->rail[r].recovery_us),
                                .recovery_us_max = atomic_load(&e->rail[r].recovery_max_us)};
    return e->nrails;
}
