/* SPDX-License-Identifier: Apache-2.0 */
/* kvwire-info: what kvwire would find on this node. Every RDMA device and
 * port (state, link layer, MTU, max message, GIDs with their type and the
 * one kvwire picks), the locked-memory limit, and per GPU whether dma-buf
 * and nvidia_peermem are there and which path a region on it would take.
 * Each "no" names its fix. And the PCIe topology: the GPU x NIC distance
 * matrix and, per GPU, the device an engine naming none would open and
 * the devices KVW_DEVICES=near would give it, with the reasons
 * (verbs/topo.h). Text, or JSON with --json. It reports, it does not
 * judge: exit 0 whatever it finds, except that no RDMA device at all
 * exits 1 (as ibv_devinfo does).
 *
 * --check judges: the self-test an operator runs before the first
 * transfer. Per device (or --dev NAME), on the engine's port (KVW_IB_PORT):
 * the port is ACTIVE; the GID kvwire uses, opened with the library's own
 * kvw__dev_open (so what it says is what an engine does) and why (RoCE v2
 * on an IPv4 address, not a link-local or v1 entry); the MTU; a loopback
 * RDMA write between two of the library's QPs on that GID, compared byte
 * for byte. For the node: the memlock limit against what an engine pins
 * itself, and per GPU the path its memory would take (dma-buf,
 * nvidia_peermem, staging). Exit 1 if anything will fail. */
#include "common/config.h"
#include "mem/mem.h"
#include "verbs/device.h"
#include "verbs/qp.h"
#include "verbs/topo.h"
#include "kvw-tools.h"

#include <arpa/inet.h>
#include <errno.h>
#include <getopt.h>
#include <net/if.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>

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

/* ---- --check ----------------------------------------------------------------------- */

typedef struct {
    int failed, warned;
} verdict_t;

enum { CHECK_OK, CHECK_WARN, CHECK_FAIL };

static void say(verdict_t *v, int level, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* One line of the check: "  [ OK ] ...", "  [WARN] ..." or "  [FAIL] ...". */
static void say(verdict_t *v, int level, const char *fmt, ...)
{
    static const char *const tag[] = {"[ OK ]", "[WARN]", "[FAIL]"};
    va_list ap;
    va_start(ap, fmt);
    printf("  %s ", tag[level]);
    vprintf(fmt, ap);
    printf("\n");
    va_end(ap);
    v->failed += level == CHECK_FAIL;
    v->warned += level == CHECK_WARN;
}

static const port_t *nic_port(const nic_t *n, int num)
{
    for (int p = 0; p < n->nports; p++)
        if (n->ports[p].num == num)
            return &n->ports[p];
    return NULL;
}

static const gid_t_ *port_gid(const port_t *p, int index)
{
    for (int i = 0; i < p->ngids; i++)
        if (p->gids[i].index == index)
            return &p->gids[i];
    return NULL;
}

/* The entries kvwire passes over before its pick, and why: the automatic
 * choice others get wrong (GID 0 is link-local, RoCE v1 is not routed). */
static void skipped_gids(const port_t *p, int pick, char *out, size_t size)
{
    size_t len = 0;
    out[0] = '\0';
    for (int i = 0; i < p->ngids && p->gids[i].index < pick; i++) {
        const gid_t_ *g = &p->gids[i];
        const char *why = strcmp(g->type, "RoCEv2")             ? "RoCE v1"
                          : !strncmp(g->addr, "fe80:", 5)       ? "link-local"
                          : strncmp(g->addr, "::ffff:", 7) != 0 ? "IPv6, not IPv4-mapped"
                                                                : "another IPv4 address";
        int n = snprintf(out + len, size - len, "%sGID %d (%s)", len ? ", " : "; passed over ",
                         g->index, why);
        if (n < 0 || (size_t)n >= size - len)
            break;
        len += (size_t)n;
    }
}

/* The GID an engine uses: the library's own choice (kvw__dev_open). */
static void check_gid(verdict_t *v, const report_t *r, const port_t *p, const kvw_dev_t *dev,
                      const kvw_config_t *cfg)
{
    const gid_t_ *g = port_gid(p, dev->gid_index);
    const char *addr = g ? g->addr : "?", *type = g ? g->type : "?";
    const char *netdev = g && g->netdev[0] ? g->netdev : "no netdev";
    if (cfg->gid_index >= 0) {
        say(v, CHECK_WARN, "GID index %d (%s, %s on %s): forced by KVW_GID_INDEX, not chosen",
            dev->gid_index, addr, type, netdev);
        return;
    }
    if (p->attr.link_layer == IBV_LINK_LAYER_INFINIBAND) {
        say(v, CHECK_OK, "GID index 0 (%s): InfiniBand", addr);
        return;
    }
    char skipped[256], ip[48] = "";
    skipped_gids(p, dev->gid_index, skipped, sizeof(skipped));
    if (r->ip)
        snprintf(ip, sizeof(ip), " (--ip %s)", r->ip);
    say(v, CHECK_OK, "GID index %d (%s, %s on %s): RoCE v2 on the interface's IPv4 address%s%s",
        dev->gid_index, addr, type, netdev, ip, skipped);
}

static void check_mtu(verdict_t *v, const port_t *p)
{
    int active = mtu_bytes(p->attr.active_mtu), max = mtu_bytes(p->attr.max_mtu);
    if (active < 1024)
        say(v, CHECK_WARN,
            "MTU %d (port max %d): small; raise the netdev's MTU (RoCE takes the largest IB "
            "MTU below it)",
            active, max);
    else
        say(v, CHECK_OK, "MTU %d (port max %d)", active, max);
}

#define LOOPBACK_BYTES (64u * 1024)
#define LOOPBACK_WAIT_S 20 /* rxe in a TCG guest is slow */

/* Wait for the write's completion on qp's CQ; 0 on success, else why. */
static const char *wait_write(kvw_qp_t *qp)
{
    struct timespec t0, t;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (;;) {
        struct ibv_wc wc;
        int n = ibv_poll_cq(qp->cq, 1, &wc);
        if (n < 0)
            return "ibv_poll_cq failed";
        if (n == 1)
            return wc.status == IBV_WC_SUCCESS ? NULL : ibv_wc_status_str(wc.status);
        clock_gettime(CLOCK_MONOTONIC, &t);
        if (t.tv_sec - t0.tv_sec > LOOPBACK_WAIT_S)
            return "no completion within 20 s";
        struct timespec nap = {0, 1000000};
        nanosleep(&nap, NULL);
    }
}

/* Post one RDMA write of src into dst through a (to b) and wait for it. */
static const char *write_once(kvw_qp_t *a, struct ibv_mr *src, struct ibv_mr *dst)
{
    struct ibv_sge sge = {(uintptr_t)src->addr, LOOPBACK_BYTES, src->lkey};
    struct ibv_send_wr wr = {.sg_list = &sge,
                             .num_sge = 1,
                             .opcode = IBV_WR_RDMA_WRITE,
                             .send_flags = IBV_SEND_SIGNALED,
                             .wr.rdma = {(uintptr_t)dst->addr, dst->rkey}};
    struct ibv_send_wr *bad;
    if (ibv_post_send(a->qp, &wr, &bad))
        return "ibv_post_send failed";
    return wait_write(a);
}

/* Two of the library's RC QPs on dev, connected to each other with the
 * engine's fabric settings (kvw__qp_connect: the GID, address vector and
 * MTU a transfer uses); one write from a to b's memory, compared. */
static const char *loopback(kvw_dev_t *dev, const kvw_config_t *cfg, char *buf, size_t size)
{
    kvw_qp_t *a = NULL, *b = NULL;
    struct ibv_mr *src = NULL, *dst = NULL;
    uint8_t *mem = calloc(2, LOOPBACK_BYTES);
    const char *why = NULL;
    kvw_qp_info_t ia, ib;
    if (!mem)
        return "out of memory";
    for (uint32_t i = 0; i < LOOPBACK_BYTES; i++)
        mem[i] = (uint8_t)(mix(i) | 1); /* never 0: the destination starts zeroed */
    if (kvw__qp_create(dev, NULL, NULL, 16, 16, false, &a) ||
        kvw__qp_create(dev, NULL, NULL, 16, 16, true, &b)) {
        why = "cannot create QPs (see the library's message above)";
        goto out;
    }
    kvw__qp_local_info(a, &ia);
    kvw__qp_local_info(b, &ib);
    if (kvw__qp_connect(a, &ib, cfg) || kvw__qp_connect(b, &ia, cfg)) {
        why = "cannot connect the QPs (see the library's message above)";
        goto out;
    }
    src = ibv_reg_mr(dev->pd, mem, LOOPBACK_BYTES, IBV_ACCESS_LOCAL_WRITE);
    dst = ibv_reg_mr(dev->pd, mem + LOOPBACK_BYTES, LOOPBACK_BYTES,
                     IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
    if (!src || !dst) {
        snprintf(buf, size, "ibv_reg_mr of 64 KiB: %s (the memlock limit?)", strerror(errno));
        why = buf;
        goto out;
    }
    why = write_once(a, src, dst);
    if (!why && memcmp(mem, mem + LOOPBACK_BYTES, LOOPBACK_BYTES))
        why = "the write completed but the bytes differ";
    if (!why)
        snprintf(buf, size, "64 KiB written from QP 0x%x to QP 0x%x on GID %d, bytes match", ia.qpn,
                 ib.qpn, dev->gid_index);
out:
    if (src)
        ibv_dereg_mr(src);
    if (dst)
        ibv_dereg_mr(dst);
    kvw__qp_destroy(a);
    kvw__qp_destroy(b);
    free(mem);
    return why;
}

static void check_nic(verdict_t *v, const report_t *r, const nic_t *n, const kvw_config_t *cfg)
{
    printf("%s:\n", n->name);
    if (n->error[0]) {
        say(v, CHECK_FAIL, "%s", n->error);
        return;
    }
    const port_t *p = nic_port(n, cfg->ib_port);
    if (!p) {
        say(v, CHECK_FAIL, "no port %d (KVW_IB_PORT)", cfg->ib_port);
        return;
    }
    if (p->attr.state != IBV_PORT_ACTIVE) {
        say(v, CHECK_FAIL, "port %d: %s, not ACTIVE: bring its link/netdev up", p->num,
            ibv_port_state_str(p->attr.state));
        return;
    }
    say(v, CHECK_OK, "port %d: ACTIVE, %s", p->num, link_name(p->attr.link_layer));
    kvw_dev_t *dev;
    if (kvw__dev_open(n->name, r->ip, cfg->ib_port, cfg->gid_index, &dev)) {
        say(v, CHECK_FAIL, "an engine cannot open it (the library said why, above): %s",
            p->pick < 0 ? p->why : "see that message");
        return;
    }
    check_gid(v, r, p, dev, cfg);
    check_mtu(v, p);
    char buf[160];
    const char *why = loopback(dev, cfg, buf, sizeof(buf));
    if (why)
        say(v, CHECK_FAIL, "loopback RDMA write: %s", why);
    else
        say(v, CHECK_OK, "loopback RDMA write: %s", buf);
    kvw__dev_close(dev);
}

/* Does this process hold CAP_IPC_LOCK (then the memlock limit does not
 * apply to its registrations)? From /proc/self/status's CapEff. */
static bool has_ipc_lock(void)
{
    FILE *f = fopen("/proc/self/status", "r");
    char line[256];
    unsigned long long caps = 0;
    bool found = false;
    while (f && fgets(line, sizeof(line), f))
        if (sscanf(line, "CapEff: %llx", &caps) == 1)
            found = true;
    if (f)
        fclose(f);
    return found && (caps >> 14 & 1); /* CAP_IPC_LOCK is 14 */
}

/* An engine pins its landing buffer (KVW_LANDING_MIB) itself; the KV
 * regions an application registers come on top. */
static void check_memlock(verdict_t *v, const report_t *r, const kvw_config_t *cfg)
{
    unsigned long long need = (unsigned long long)cfg->landing_mib << 20;
    unsigned long long cur = r->memlock.rlim_cur;
    if (r->memlock.rlim_cur == RLIM_INFINITY)
        say(v, CHECK_OK, "memlock limit: unlimited");
    else if (has_ipc_lock())
        say(v, CHECK_OK,
            "memlock limit: %llu bytes, but this process has CAP_IPC_LOCK: it does "
            "not apply",
            cur);
    else if (cur < need)
        say(v, CHECK_FAIL,
            "memlock limit: %llu bytes, below the %llu an engine pins for its landing buffer "
            "(KVW_LANDING_MIB) before any KV region: fix with 'ulimit -l unlimited' or memlock "
            "in /etc/security/limits.conf",
            cur, need);
    else
        say(v, CHECK_WARN,
            "memlock limit: %llu bytes: host KV regions beyond it (less the %llu-byte landing "
            "buffer) fail to register; 'ulimit -l unlimited' lifts it",
            cur, need);
}

static void check_gpus(verdict_t *v, const report_t *r)
{
    if (!r->ngpus) {
        say(v, CHECK_OK, "GPU memory: none here (%s): host memory only", r->cuda_why);
        return;
    }
    for (int i = 0; i < r->ngpus; i++) {
        const gpu_t *g = &r->gpus[i];
        say(v, g->path == KVW_MEM_PATH_STAGING ? CHECK_WARN : CHECK_OK,
            "GPU %d (%s): dma-buf %s, nvidia_peermem %s: a cudaMalloc region takes %s (%s)", i,
            g->info.pci, tri(g->info.dmabuf), r->peermem ? "loaded" : "not loaded",
            kvw__mem_path_name(g->path), g->reason);
    }
}

/* The self-test; returns the exit status. */
static int run_check(const report_t *r, const char *only)
{
    kvw_config_t cfg;
    if (kvw_config_init(&cfg)) {
        printf("kvwire-info --check: the KVW_* environment is invalid (see above)\n");
        return 1;
    }
    verdict_t v = {0, 0};
    int checked = 0;
    for (int i = 0; i < r->nnics; i++) {
        if (only && strcmp(only, r->nics[i].name))
            continue;
        check_nic(&v, r, &r->nics[i], &cfg);
        checked++;
    }
    if (!checked) {
        printf("RDMA devices:\n");
        if (only)
            say(&v, CHECK_FAIL, "no RDMA device named %s", only);
        else
            say(&v, CHECK_FAIL,
                "none found%s%s: load the NIC's driver (e.g. 'modprobe mlx5_ib'), "
                "or soft-RoCE: kvw-rxe up IFACE",
                r->nic_error[0] ? " - " : "", r->nic_error);
    }
    printf("this node:\n");
    check_memlock(&v, r, &cfg);
    check_gpus(&v, r);
    printf("kvwire-info --check: %s (%d failed, %d warning%s)\n", v.failed ? "FAILED" : "ok",
           v.failed, v.warned, v.warned == 1 ? "" : "s");
    return v.failed ? 1 : 0;
}

static void usage(void)
{
    printf("Usage: kvwire-info [--json] [--ip IPV4]\n"
           "  or:  kvwire-info --check [--dev NAME] [--ip IPV4]\n"
           "What kvwire would find on this node: RDMA devices, ports and GIDs, the memlock\n"
           "limit, and the path GPU memory would take (dma-buf, nvidia_peermem, staging),\n"
           "each 'no' with its fix; the GPU x NIC PCIe distances and the NIC an engine\n"
           "naming no device opens for each GPU, and those KVW_DEVICES=near would give it\n"
           "(KVW_SYSFS_ROOT: read a fake sysfs tree instead).\n"
           "\n"
           "Options:\n"
           "  --check        the self-test before the first transfer: per device, the port\n"
           "                 is ACTIVE, the GID kvwire uses and why, the MTU, and a loopback\n"
           "                 RDMA write between two QPs compared byte for byte; for the node,\n"
           "                 the memlock limit and each GPU's memory path. One line per\n"
           "                 check: [ OK ], [WARN] or [FAIL] with the reason\n"
           "  --dev NAME     check only this device (with --check)\n"
           "  --ip IPV4      the GID kvwire picks for an engine on this local IP\n"
           "  --json         one JSON object instead of text (not with --check)\n"
           "  -h, --help     this help\n"
           "  -V, --version  the kvwire version\n"
           "\n"
           "Exit status: 0 done (--check: every check passed or warned); 1 no RDMA device,\n"
           "a bad command line, or (--check) a check failed.\n");
    exit(0);
}

int main(int argc, char **argv)
{
    kvw_tool_name = "kvwire-info";
    static const struct option opts[] = {
        {"json", no_argument, NULL, 'j'},
        {"ip", required_argument, NULL, 'i'},
        {"check", no_argument, NULL, 'c'},
        {"dev", required_argument, NULL, 'd'},
        {"help", no_argument, NULL, 'h'},
        {"version", no_argument, NULL, 'V'},
        {NULL, 0, NULL, 0},
    };
    static report_t r;
    bool json = false, check = false;
    const char *only = NULL;
    int c;
    while ((c = getopt_long(argc, argv, "hV", opts, NULL)) != -1) {
        if (c == 'j')
            json = true;
        else if (c == 'i')
            r.ip = kvw_tool_ipv4("--ip", optarg);
        else if (c == 'c')
            check = true;
        else if (c == 'd')
            only = optarg;
        else if (c == 'h')
            usage();
        else if (c == 'V')
            kvw_tool_version();
        else
            kvw_tool_bad_option();
    }
    if (optind < argc)
        kvw_tool_usage_error("unexpected argument '%s'", argv[optind]);
    if (check && json)
        kvw_tool_usage_error("--check prints text; --json is for the report");
    if (only && !check)
        kvw_tool_usage_error("--dev goes with --check");
    read_nics(&r);
    getrlimit(RLIMIT_MEMLOCK, &r.memlock);
    read_gpus(&r);
    if (check)
        return run_check(&r, only);
    read_topology(&r);
    read_rails(&r);
    if (json)
        print_json(&r);
    else
        print_text(&r);
    if (!r.nnics) {
        fprintf(stderr, "kvwire-info: no RDMA device found%s%s\n", r.nic_error[0] ? ": " : "",
                r.nic_error);
        return 1;
    }
    return 0;
}
