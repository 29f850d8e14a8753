/* SPDX-License-Identifier: Apache-2.0 */
/* kvwire-info: what kvwire would find on this node. Every RDMA device and
 * port (state, link layer, MTU, max message, GIDs with their type and the
 * one kvwire picks), the locked-memory limit, and per GPU whether dma-buf
 * and nvidia_peermem are there and which path a region on it would take.
 * Each "no" names its fix. And the PCIe topology: the GPU x NIC distance
 * matrix and, per GPU, the device an engine naming none would open and
 * the devices KVW_DEVICES=near would give it, with the reasons
 * (verbs/topo.h). Text, or JSON with --json. Exits 0 whatever it
 * finds (2 for bad arguments): it reports, it does not judge. */
#include "common/config.h"
#include "mem/mem.h"
#include "verbs/device.h"
#include "verbs/topo.h"

#include <arpa/inet.h>
#include <errno.h>
#include <getopt.h>
#include <net/if.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>

#define MAX_GIDS 64
#define MAX_PORTS 4
#define MAX_NICS 16
#define MAX_GPUS 16

typedef struct {
    int index;
    char addr[INET6_ADDRSTRLEN];
    const char *type;
    char netdev[IF_NAMESIZE];
} gid_t_;

typedef struct {
    int num;
    struct ibv_port_attr attr;
    gid_t_ gids[MAX_GIDS];
    int ngids;
    int pick;        /* GID index kvwire picks, -1 none */
    const char *why; /* why that one, or why none */
} port_t;

typedef struct {
    char name[64];
    port_t ports[MAX_PORTS];
    int nports;
    int dmabuf; /* 1 yes, 0 no, -1 could not probe */
    char dmabuf_why[256];
    char error[128];
} nic_t;

typedef struct {
    kvw_cuda_dev_t info;
    kvw_mem_path_t path;
    char reason[KVW_MEM_REASON_MAX];
} gpu_t;

typedef struct {
    nic_t nics[MAX_NICS];
    int nnics;
    char nic_error[128];
    struct rlimit memlock;
    char cuda_why[160];
    gpu_t gpus[MAX_GPUS];
    int ngpus;
    bool peermem;
    const char *ip;
    /* The PCIe topology (verbs/topo.h): GPU x NIC distances and the NIC an
     * engine naming no device would pick. */
    int topo_ok;
    kvw_topo_t topo;
    kvw_topo_pos_t rows[MAX_GPUS]; /* the GPUs CUDA reports, else those sysfs lists */
    int nrows;
    kvw_topo_pick_t picks[MAX_GPUS], host_pick;
    int host_numa;
    /* What KVW_DEVICES=near would give an engine with KV on each GPU, and
     * in host memory. */
    kvw_topo_near_t nears[MAX_GPUS], host_near;
    /* Rails: the devices KVW_DEVICES names (nrails 0: unset, -1: malformed),
     * each an index into nics (-1: not found). */
    kvw_config_t cfg;
    char rails[KVW_CONFIG_MAX_DEVICES][KVW_CONFIG_DEVICE_NAME];
    int nrails, rail_nic[KVW_CONFIG_MAX_DEVICES];
} report_t;

/* ---- gathering ---------------------------------------------------------------- */

static const char *gid_type_name(uint32_t t)
{
    return t == IBV_GID_TYPE_IB ? "IB" : t == IBV_GID_TYPE_ROCE_V1 ? "RoCEv1" : "RoCEv2";
}

static bool gid_empty(const union ibv_gid *g)
{
    static const union ibv_gid zero;
    return memcmp(g, &zero, sizeof(zero)) == 0;
}

/* Why kvwire picks p->pick (or none), given whether --ip matched it. */
static const char *pick_reason(const port_t *p, const char *ip, bool ip_matched)
{
    if (p->attr.link_layer == IBV_LINK_LAYER_INFINIBAND)
        return "InfiniBand: GID 0";
    if (p->pick < 0)
        return "no RoCEv2 IPv4-mapped GID: assign an IPv4 address to the port's netdev (or set "
               "KVW_GID_INDEX)";
    if (!ip)
        return "the first RoCEv2 IPv4-mapped GID (an engine also matches its own IP)";
    return ip_matched ? "the RoCEv2 IPv4-mapped GID carrying --ip"
                      : "the first RoCEv2 IPv4-mapped GID; none carries --ip, so an engine on "
                        "that IP uses another device";
}

/* The GIDs, and the one kvwire's device.c would pick (same helper). */
static void read_gids(struct ibv_context *ctx, port_t *p, const char *ip)
{
    int with_ip = -1, any = -1;
    for (int i = 0; i < p->attr.gid_tbl_len && p->ngids < MAX_GIDS; i++) {
        struct ibv_gid_entry e;
        if (ibv_query_gid_ex(ctx, (uint32_t)p->num, (uint32_t)i, &e, 0) || gid_empty(&e.gid))
            continue; /* an empty slot */
        gid_t_ *g = &p->gids[p->ngids++];
        g->index = i;
        g->type = gid_type_name(e.gid_type);
        if (!inet_ntop(AF_INET6, e.gid.raw, g->addr, sizeof(g->addr)))
            snprintf(g->addr, sizeof(g->addr), "?");
        if (!e.ndev_ifindex || !if_indextoname(e.ndev_ifindex, g->netdev))
            g->netdev[0] = '\0';
        if (with_ip < 0 && kvw__gid_usable(&e, ip))
            with_ip = i;
        if (any < 0 && kvw__gid_usable(&e, NULL))
            any = i;
    }
    if (p->attr.link_layer == IBV_LINK_LAYER_INFINIBAND)
        p->pick = 0;
    else
        p->pick = with_ip >= 0 ? with_ip : any;
    p->why = pick_reason(p, ip, with_ip >= 0);
}

/* NCCL's probe: fd -1 and no memory; EBADF means dma-buf would be taken. */
static void probe_dmabuf(struct ibv_context *ctx, nic_t *n)
{
    struct ibv_pd *pd = ibv_alloc_pd(ctx);
    n->dmabuf = -1;
    if (!pd) {
        snprintf(n->dmabuf_why, sizeof(n->dmabuf_why), "ibv_alloc_pd: %s", strerror(errno));
        return;
    }
    errno = 0;
    struct ibv_mr *mr = ibv_reg_dmabuf_mr(pd, 0, 0, 0, -1, 0);
    int err = errno;
    if (mr)
        ibv_dereg_mr(mr);
    n->dmabuf = !(err == EOPNOTSUPP || err == EPROTONOSUPPORT || err == ENOSYS);
    char name[sizeof(n->name)];
    memcpy(name, n->name, sizeof(name));
    if (!n->dmabuf)
        snprintf(n->dmabuf_why, sizeof(n->dmabuf_why),
                 "%s refuses dma-buf registration (%s): needs rdma-core >= 34, Linux >= 5.12 "
                 "and a NIC driver with dma-buf (mlx5, not rxe)",
                 name, strerror(err));
    ibv_dealloc_pd(pd);
}

static void read_nic(struct ibv_device *d, nic_t *n, const char *ip)
{
    snprintf(n->name, sizeof(n->name), "%s", ibv_get_device_name(d));
    struct ibv_context *ctx = ibv_open_device(d);
    struct ibv_device_attr da;
    if (!ctx || ibv_query_device(ctx, &da)) {
        snprintf(n->error, sizeof(n->error), "cannot open: %s (is /dev/infiniband readable?)",
                 strerror(errno));
        if (ctx)
            ibv_close_device(ctx);
        return;
    }
    for (int p = 1; p <= da.phys_port_cnt && n->nports < MAX_PORTS; p++) {
        port_t *pt = &n->ports[n->nports];
        pt->num = p;
        if (ibv_query_port(ctx, (uint8_t)p, &pt->attr))
            continue;
        read_gids(ctx, pt, ip);
        n->nports++;
    }
    probe_dmabuf(ctx, n);
    ibv_close_device(ctx);
}

static void read_nics(report_t *r)
{
    int num = 0;
    struct ibv_device **list = ibv_get_device_list(&num);
    if (!list) {
        snprintf(r->nic_error, sizeof(r->nic_error), "ibv_get_device_list: %s", strerror(errno));
        return;
    }
    for (int i = 0; i < num && r->nnics < MAX_NICS; i++)
        read_nic(list[i], &r->nics[r->nnics++], r->ip);
    ibv_free_device_list(list);
}

/* The NIC verdict a GPU region would meet: yes if any NIC takes dma-bufs. */
static void nic_verdict(const report_t *r, int *ok_p, const char **why_p)
{
    *ok_p = r->nnics ? 0 : -1;
    *why_p = NULL;
    for (int i = 0; i < r->nnics; i++) {
        if (r->nics[i].dmabuf == 1)
            *ok_p = 1;
        else if (!*why_p && r->nics[i].dmabuf == 0)
            *why_p = r->nics[i].dmabuf_why;
    }
}

static void read_gpus(report_t *r)
{
    const kvw_cuda_ops_t *cuda = kvw__cuda_ops();
    if (cuda->init(r->cuda_why, sizeof(r->cuda_why)))
        return;
    r->peermem = cuda->peermem_loaded();
    int ok;
    const char *why;
    nic_verdict(r, &ok, &why);
    int n = cuda->device_count();
    for (int i = 0; i < n && r->ngpus < MAX_GPUS; i++) {
        gpu_t *g = &r->gpus[r->ngpus];
        char err[160];
        if (cuda->device_info(i, &g->info, err, sizeof(err)))
            continue;
        /* A cudaMalloc region on this GPU. */
        kvw_mem_facts_t f = {.force = -1,
                             .ptr = {.type = KVW_CUDA_PTR_DEVICE, .device = i, .rdma_capable = -1},
                             .gpu = &g->info,
                             .nic_dmabuf = ok,
                             .nic_dmabuf_why = why,
                             .peermem = r->peermem};
        g->path = kvw__mem_choose(&f, g->reason, sizeof(g->reason));
        r->ngpus++;
    }
    if (!n)
        snprintf(r->cuda_why, sizeof(r->cuda_why), "the driver reports no GPU");
}

/* The topology below kvw__topo_root() (KVW_SYSFS_ROOT: a fake tree, whose
 * devices are then taken as present), and each GPU's pick. */
static void read_topology(report_t *r)
{
    kvw_config_t cfg;
    kvw_config_init(&cfg);
    const char *root = kvw__topo_root();
    char owner[64] = "";
    uint8_t port = 0;
    r->topo_ok =
        kvw__topo_read(root, cfg.ib_port, r->ip, kvw__topo_prefix_len(r->ip), &r->topo) == 0;
    if (!r->topo_ok)
        return;
    if (!root[0])
        kvw__topo_mark_listed(&r->topo, kvw__verbs_ops());
    if (r->ip && kvw__verbs_ops()->device_for_ip(r->ip, owner, sizeof(owner), &port))
        owner[0] = '\0';
    for (int i = 0; i < r->ngpus && r->nrows < MAX_GPUS; i++)
        if (kvw__topo_pos(root, r->gpus[i].info.pci, &r->rows[r->nrows]) == 0)
            r->nrows++;
    for (int i = 0; !r->ngpus && i < r->topo.ngpus && r->nrows < MAX_GPUS; i++)
        r->rows[r->nrows++] = r->topo.gpus[i];
    const char *own = owner[0] ? owner : NULL;
    for (int i = 0; i < r->nrows; i++) {
        kvw__topo_pick(&r->topo, &r->rows[i], -1, own, &r->picks[i]);
        kvw__topo_pick_near(&r->topo, &r->rows[i], -1, own, &r->nears[i]);
    }
    r->host_numa = kvw__topo_my_numa();
    kvw__topo_pick(&r->topo, NULL, r->host_numa, own, &r->host_pick);
    kvw__topo_pick_near(&r->topo, NULL, r->host_numa, own, &r->host_near);
}

/* ---- text ------------------------------------------------------------------------ */

/* KVW_DEVICES, as an engine created now in this environment reads it. */
static void read_rails(report_t *r)
{
    kvw_config_init(&r->cfg);
    r->nrails = kvw__config_devices(r->cfg.devices, r->rails);
    for (int k = 0; k < r->nrails; k++) {
        r->rail_nic[k] = -1;
        for (int i = 0; i < r->nnics; i++)
            if (!strcmp(r->nics[i].name, r->rails[k]))
                r->rail_nic[k] = i;
    }
}

/* A rail's port (the engine's ib_port), or NULL. */
static const port_t *rail_port(const report_t *r, int k)
{
    if (r->rail_nic[k] < 0)
        return NULL;
    const nic_t *n = &r->nics[r->rail_nic[k]];
    for (int p = 0; p < n->nports; p++)
        if (n->ports[p].num == r->cfg.ib_port)
            return &n->ports[p];
    return NULL;
}

/* The GID a rail uses: its first RoCEv2 IPv4-mapped one (an engine on
 * several devices matches no local_ip), GID 0 on InfiniBand; -1 none. */
static int rail_gid(const port_t *p)
{
    if (p->attr.link_layer == IBV_LINK_LAYER_INFINIBAND)
        return 0;
    for (int i = 0; i < p->ngids; i++)
        if (!strcmp(p->gids[i].type, "RoCEv2") && !strncmp(p->gids[i].addr, "::ffff:", 7))
            return p->gids[i].index;
    return -1;
}

static void text_rails(const report_t *r)
{
    if (r->nrails < 0) {
        printf("Rails: KVW_DEVICES \"%s\" is malformed (engines refuse it)\n", r->cfg.devices);
        return;
    }
    if (kvw__config_devices_near(r->cfg.devices)) {
        printf("Rails (KVW_DEVICES=near): an engine opens the devices near its KV regions (see "
               "\"With KVW_DEVICES=near\" above) and stripes requests over them\n");
        return;
    }
    if (r->nrails == 0) {
        printf("Rails: one device per engine (KVW_DEVICES unset; set it to a comma-separated list "
               "to stripe over several, or to near for every device as near as the pick)\n");
        return;
    }
    printf("Rails (KVW_DEVICES=%s): an engine opens %d device%s, registers every region on each "
           "and stripes requests over them, weighted by link speed:\n",
           r->cfg.devices, r->nrails, r->nrails > 1 ? "s" : "");
    for (int k = 0; k < r->nrails; k++) {
        const port_t *p = rail_port(r, k);
        if (!p) {
            printf("  rail %d  %-10s not found (engines refuse the list)\n", k, r->rails[k]);
            continue;
        }
        uint32_t mbps = kvw__link_mbps(p->attr.active_speed, p->attr.active_width);
        int gid = rail_gid(p);
        printf("  rail %d  %-10s port %u %s  link %u Mb/s%s  GID %d%s\n", k, r->rails[k],
               (unsigned)p->num, ibv_port_state_str(p->attr.state), mbps, mbps ? "" : " (unknown)",
               gid, gid < 0 ? " (none usable: the engine refuses it)" : "");
    }
    printf("  a connection: decode's rail i pairs with prefill's rail i mod (prefill's rails), "
           "qps_per_peer (%u) QPs on each pair\n",
           r->cfg.qps_per_peer);
}

static const char *reach_name(int reaches)
{
    return reaches > 0 ? "yes" : reaches == 0 ? "no" : "cannot tell";
}

static void text_pick(const report_t *r, const char *who, const kvw_topo_pick_t *p)
{
    printf("  %s -> %s: %s\n", who, p->nic >= 0 ? r->topo.nics[p->nic].name : "none", p->reason);
}

static void text_near(const report_t *r, const char *who, const kvw_topo_near_t *n)
{
    printf("  %s ->", who);
    for (int k = 0; k < n->nrails; k++)
        printf("%s %s", k ? " +" : "", r->topo.nics[n->rails[k]].name);
    printf("%s: %s\n", n->nrails ? "" : " none", n->reason);
}

static void text_topology(const report_t *r)
{
    if (!r->topo_ok) {
        printf("Topology: %s/sys/class/infiniband not readable\n", kvw__topo_root());
        return;
    }
    printf("Topology (nearest first: SW same PCIe switch, RC same root complex, NODE same NUMA "
           "node, SYS across sockets, - unknown):\n");
    for (int i = 0; i < r->topo.nnics; i++) {
        const kvw_topo_nic_t *n = &r->topo.nics[i];
        printf("  %-10s %-13s NUMA %2d  port %s  reaches %s's network: %s%s\n", n->name,
               n->pos.bus_id[0] ? n->pos.bus_id : "(no PCI)", n->pos.numa,
               n->active ? "up" : "DOWN", r->ip ? r->ip : "--ip", reach_name(n->reaches),
               n->usable ? "" : " (not listed by libibverbs)");
    }
    printf("  %-20s", "");
    for (int i = 0; i < r->topo.nnics; i++)
        printf(" %8.8s", r->topo.nics[i].name);
    printf("\n");
    for (int g = 0; g < r->nrows; g++) {
        printf("  GPU %-2d %-13s", g, r->rows[g].bus_id);
        for (int i = 0; i < r->topo.nnics; i++)
            printf(" %8s",
                   kvw__topo_level_short(kvw__topo_level(&r->rows[g], &r->topo.nics[i].pos, NULL)));
        printf("\n");
    }
    printf("Device an engine naming none opens:\n");
    char who[64];
    for (int g = 0; g < r->nrows; g++) {
        snprintf(who, sizeof(who), "KV on GPU %d (%s)", g, r->rows[g].bus_id);
        text_pick(r, who, &r->picks[g]);
    }
    snprintf(who, sizeof(who), "KV in host memory (NUMA node %d)", r->host_numa);
    text_pick(r, who, &r->host_pick);
    printf("With KVW_DEVICES=near, an engine opens (rail 0 first: the device above):\n");
    for (int g = 0; g < r->nrows; g++) {
        snprintf(who, sizeof(who), "KV on GPU %d (%s)", g, r->rows[g].bus_id);
        text_near(r, who, &r->nears[g]);
    }
    snprintf(who, sizeof(who), "KV in host memory (NUMA node %d)", r->host_numa);
    text_near(r, who, &r->host_near);
}

/* ---- text (devices) --------------------------------------------------------------- */

static const char *link_name(uint8_t ll)
{
    return ll == IBV_LINK_LAYER_INFINIBAND ? "InfiniBand"
           : ll == IBV_LINK_LAYER_ETHERNET ? "Ethernet (RoCE)"
                                           : "unspecified";
}

static int mtu_bytes(enum ibv_mtu m)
{
    return m >= IBV_MTU_256 && m <= IBV_MTU_4096 ? 128 << m : 0;
}

static const char *tri(int v)
{
    return v > 0 ? "yes" : v == 0 ? "no" : "unknown";
}

static void text_port(const port_t *p)
{
    printf("    port %d: %s%s, %s, MTU %d (max %d), max message %u bytes\n", p->num,
           ibv_port_state_str(p->attr.state),
           p->attr.state == IBV_PORT_ACTIVE ? "" : " (fix: bring its link/netdev up)",
           link_name(p->attr.link_layer), mtu_bytes(p->attr.active_mtu), mtu_bytes(p->attr.max_mtu),
           p->attr.max_msg_sz);
    for (int i = 0; i < p->ngids; i++) {
        const gid_t_ *g = &p->gids[i];
        printf("      GID %-3d %-40s %-6s %s%s\n", g->index, g->addr, g->type, g->netdev,
               g->index == p->pick ? "  <- kvwire's pick" : "");
    }
    if (p->pick >= 0)
        printf("      kvwire picks GID %d: %s\n", p->pick, p->why);
    else
        printf("      kvwire picks none: %s\n", p->why);
}

static void text_memlock(const struct rlimit *rl)
{
    if (rl->rlim_cur == RLIM_INFINITY)
        printf("memlock limit: unlimited\n");
    else
        printf("memlock limit: %llu bytes (host regions beyond it fail; fix: 'ulimit -l "
               "unlimited' or memlock in /etc/security/limits.conf; dma-buf MRs do not count)\n",
               (unsigned long long)rl->rlim_cur);
}

static void print_text(const report_t *r)
{
    printf("RDMA devices: %d%s%s\n", r->nnics, r->nic_error[0] ? " - " : "", r->nic_error);
    if (!r->nnics)
        printf("  (fix: load the NIC's driver, e.g. 'modprobe mlx5_ib', or soft-RoCE: "
               "tools/kvw-rxe up)\n");
    for (int i = 0; i < r->nnics; i++) {
        const nic_t *n = &r->nics[i];
        printf("  %s%s%s\n", n->name, n->error[0] ? ": " : "", n->error);
        if (n->error[0])
            continue;
        for (int p = 0; p < n->nports; p++)
            text_port(&n->ports[p]);
        printf("    dma-buf: %s%s%s\n", tri(n->dmabuf), n->dmabuf == 1 ? "" : " - ",
               n->dmabuf == 1 ? "" : n->dmabuf_why);
    }
    text_memlock(&r->memlock);
    text_topology(r);
    text_rails(r);
    if (!r->ngpus) {
        printf("GPUs: none - %s; GPU regions are not possible here\n", r->cuda_why);
        return;
    }
    printf("nvidia_peermem: %s\n", r->peermem ? "loaded"
                                              : "not loaded (fix: 'sudo modprobe "
                                                "nvidia_peermem')");
    for (int i = 0; i < r->ngpus; i++) {
        const gpu_t *g = &r->gpus[i];
        printf("GPU %d: %s (%s), compute %d.%d\n", i, g->info.name, g->info.pci, g->info.cc_major,
               g->info.cc_minor);
        printf("  dma-buf: %s%s\n", tri(g->info.dmabuf),
               g->info.dmabuf == 0 ? " (fix: the open GPU kernel modules, CUDA >= 11.7, Linux "
                                     ">= 5.12)"
                                   : "");
        printf("  GPUDirect RDMA: %s; with VMM (cuMemCreate): %s\n", tri(g->info.gdr),
               tri(g->info.vmm_gdr));
        printf("  a cudaMalloc region takes: %s (%s)\n", kvw__mem_path_name(g->path), g->reason);
    }
}

/* ---- JSON ------------------------------------------------------------------------ */

static void json_str(const char *s)
{
    putchar('"');
    for (; *s; s++) {
        if (*s == '"' || *s == '\\')
            printf("\\%c", *s);
        else if ((unsigned char)*s < 0x20)
            printf("\\u%04x", *s);
        else
            putchar(*s);
    }
    putchar('"');
}

static void json_port(const port_t *p)
{
    printf("{\"port\":%d,\"state\":", p->num);
    json_str(ibv_port_state_str(p->attr.state));
    printf(",\"active\":%s,\"link_layer\":", p->attr.state == IBV_PORT_ACTIVE ? "true" : "false");
    json_str(link_name(p->attr.link_layer));
    printf(",\"mtu\":%d,\"max_mtu\":%d,\"max_msg_sz\":%u,\"gids\":[", mtu_bytes(p->attr.active_mtu),
           mtu_bytes(p->attr.max_mtu), p->attr.max_msg_sz);
    for (int i = 0; i < p->ngids; i++) {
        printf("%s{\"index\":%d,\"gid\":", i ? "," : "", p->gids[i].index);
        json_str(p->gids[i].addr);
        printf(",\"type\":");
        json_str(p->gids[i].type);
        printf(",\"netdev\":");
        json_str(p->gids[i].netdev);
        printf("}");
    }
    printf("],\"kvwire_gid\":%d,\"kvwire_gid_why\":", p->pick);
    json_str(p->why);
    printf("}");
}

static void json_nic(const nic_t *n)
{
    printf("{\"name\":");
    json_str(n->name);
    printf(",\"error\":");
    json_str(n->error);
    printf(",\"dmabuf\":%d,\"dmabuf_why\":", n->dmabuf);
    json_str(n->dmabuf_why);
    printf(",\"ports\":[");
    for (int p = 0; p < n->nports; p++) {
        printf("%s", p ? "," : "");
        json_port(&n->ports[p]);
    }
    printf("]}");
}

static void json_gpu(int i, const gpu_t *g)
{
    printf("{\"index\":%d,\"name\":", i);
    json_str(g->info.name);
    printf(",\"pci\":");
    json_str(g->info.pci);
    printf(",\"compute\":\"%d.%d\",\"dmabuf\":%d,\"gpudirect_rdma\":%d,\"vmm_gpudirect_rdma\":%d,"
           "\"path\":",
           g->info.cc_major, g->info.cc_minor, g->info.dmabuf, g->info.gdr, g->info.vmm_gdr);
    json_str(kvw__mem_path_name(g->path));
    printf(",\"why\":");
    json_str(g->reason);
    printf("}");
}

static void json_pick(const report_t *r, const kvw_topo_pick_t *p)
{
    printf("\"pick\":");
    json_str(p->nic >= 0 ? r->topo.nics[p->nic].name : "");
    printf(",\"level\":");
    json_str(kvw__topo_level_short(p->level));
    printf(",\"why\":");
    json_str(p->reason);
}

static void json_near(const report_t *r, const kvw_topo_near_t *n)
{
    printf(",\"near\":{\"rails\":[");
    for (int k = 0; k < n->nrails; k++) {
        printf("%s", k ? "," : "");
        json_str(r->topo.nics[n->rails[k]].name);
    }
    printf("],\"why\":");
    json_str(n->reason);
    printf("}");
}

static void json_topology(const report_t *r)
{
    printf(",\"topology\":{\"readable\":%s,\"nics\":[", r->topo_ok ? "true" : "false");
    for (int i = 0; i < r->topo.nnics; i++) {
        const kvw_topo_nic_t *n = &r->topo.nics[i];
        printf("%s{\"name\":", i ? "," : "");
        json_str(n->name);
        printf(",\"bus_id\":");
        json_str(n->pos.bus_id);
        printf(",\"numa\":%d,\"active\":%s,\"reaches\":%d,\"usable\":%s}", n->pos.numa,
               n->active ? "true" : "false", n->reaches, n->usable ? "true" : "false");
    }
    printf("],\"gpus\":[");
    for (int g = 0; g < r->nrows; g++) {
        printf("%s{\"bus_id\":", g ? "," : "");
        json_str(r->rows[g].bus_id);
        printf(",\"numa\":%d,\"levels\":[", r->rows[g].numa);
        for (int i = 0; i < r->topo.nnics; i++) {
            printf("%s", i ? "," : "");
            json_str(
                kvw__topo_level_short(kvw__topo_level(&r->rows[g], &r->topo.nics[i].pos, NULL)));
        }
        printf("],");
        json_pick(r, &r->picks[g]);
        json_near(r, &r->nears[g]);
        printf("}");
    }
    printf("],\"host\":{\"numa\":%d,", r->host_numa);
    json_pick(r, &r->host_pick);
    json_near(r, &r->host_near);
    printf("}}");
}

static void json_rails(const report_t *r)
{
    printf(",\"rails\":{\"devices\":");
    json_str(r->cfg.devices);
    printf(",\"valid\":%s,\"near\":%s,\"rails\":[", r->nrails >= 0 ? "true" : "false",
           kvw__config_devices_near(r->cfg.devices) ? "true" : "false");
    for (int k = 0; k < r->nrails; k++) {
        const port_t *p = rail_port(r, k);
        printf("%s{\"device\":", k ? "," : "");
        json_str(r->rails[k]);
        printf(",\"found\":%s,\"link_mbps\":%u,\"gid_index\":%d}", p ? "true" : "false",
               p ? kvw__link_mbps(p->attr.active_speed, p->attr.active_width) : 0,
               p ? rail_gid(p) : -1);
    }
    printf("]}");
}

static void print_json(const report_t *r)
{
    printf("{\"rdma_devices\":[");
    for (int i = 0; i < r->nnics; i++) {
        printf("%s", i ? "," : "");
        json_nic(&r->nics[i]);
    }
    printf("],\"rdma_error\":");
    json_str(r->nic_error);
    if (r->memlock.rlim_cur == RLIM_INFINITY)
        printf(",\"memlock\":\"unlimited\"");
    else
        printf(",\"memlock\":%llu", (unsigned long long)r->memlock.rlim_cur);
    printf(",\"cuda\":");
    json_str(r->ngpus ? "" : r->cuda_why);
    printf(",\"nvidia_peermem\":%s,\"gpus\":[", r->peermem ? "true" : "false");
    for (int i = 0; i < r->ngpus; i++) {
        printf("%s", i ? "," : "");
        json_gpu(i, &r->gpus[i]);
    }
    printf("]");
    json_topology(r);
    json_rails(r);
    printf("}\n");
}

static void usage(FILE *out)
{
    fprintf(out, "usage: kvwire-info [--json] [--ip IPV4]\n"
                 "  RDMA devices, ports and GIDs, the memlock limit, and the path GPU memory\n"
                 "  would take (dma-buf, nvidia_peermem, staging), each 'no' with its fix;\n"
                 "  the GPU x NIC PCIe distances and the NIC an engine naming no device\n"
                 "  opens for each GPU, and those KVW_DEVICES=near would give it\n"
                 "  (KVW_SYSFS_ROOT: read a fake sysfs tree instead).\n"
                 "  --ip   show the GID kvwire picks for an engine on this local IP\n"
                 "  --json one JSON object instead of text\n");
}

int main(int argc, char **argv)
{
    static const struct option opts[] = {
        {"json", no_argument, NULL, 'j'},
        {"ip", required_argument, NULL, 'i'},
        {"help", no_argument, NULL, 'h'},
        {NULL, 0, NULL, 0},
    };
    static report_t r;
    bool json = false;
    int c;
    while ((c = getopt_long(argc, argv, "ji:h", opts, NULL)) != -1) {
        if (c == 'j') {
            json = true;
        } else if (c == 'i') {
            r.ip = optarg;
        } else if (c == 'h') {
            usage(stdout);
            return 0;
        } else {
            usage(stderr);
            return 2;
        }
    }
    if (optind < argc) {
        usage(stderr);
        return 2;
    }
    read_nics(&r);
    getrlimit(RLIMIT_MEMLOCK, &r.memlock);
    read_gpus(&r);
    read_topology(&r);
    read_rails(&r);
    if (json)
        print_json(&r);
    else
        print_text(&r);
    return 0;
}
