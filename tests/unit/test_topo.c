/* SPDX-License-Identifier: Apache-2.0 */
/* Unit tests for src/verbs/topo.c: NIC by PCIe affinity, and the rails
 * KVW_DEVICES=near takes (kvw__topo_pick_near), read from fake
 * sysfs trees that each test builds in a temporary directory (the layout
 * of the real one: /sys/devices/pci<host bridge>/<bridges>/<function>,
 * /sys/bus/pci/devices/<bus id> and /sys/class/infiniband/<dev>/device as
 * relative symlinks to it, ports/<n>/state, gids/<i>, gid_attrs/types/<i>). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include <sys/stat.h>
#include <unistd.h>

#include "support/fake_cuda.h"
#include "support/fake_nic.h"
#include "verbs/topo.h"

static char root[256];

/* ---- building a tree ---------------------------------------------------- */

static void mkdir_p(const char *path)
{
    char buf[1024];
    snprintf(buf, sizeof(buf), "%s", path);
    for (char *p = buf + 1; *p; p++) {
        if (*p != '/')
            continue;
        *p = '\0';
        mkdir(buf, 0755);
        *p = '/';
    }
    mkdir(buf, 0755);
}

static void put(const char *rel, const char *text)
{
    char path[1024], dir[1024];
    snprintf(path, sizeof(path), "%s/%s", root, rel);
    snprintf(dir, sizeof(dir), "%s", path);
    *strrchr(dir, '/') = '\0';
    mkdir_p(dir);
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    fprintf(f, "%s\n", text);
    fclose(f);
}

/* A relative symlink at rel to sys/devices/<dev>, as sysfs makes them. */
static void link_dev(const char *rel, int depth, const char *dev)
{
    char path[1024], dir[1024], target[1024] = "";
    snprintf(path, sizeof(path), "%s/%s", root, rel);
    snprintf(dir, sizeof(dir), "%s", path);
    *strrchr(dir, '/') = '\0';
    mkdir_p(dir);
    for (int i = 0; i < depth; i++)
        strcat(target, "../");
    strcat(target, "devices/");
    strcat(target, dev);
    assert_int_equal(symlink(target, path), 0);
}

typedef struct {
    int host_bus; /* the host bridge pci0000:<host_bus> */
    int numa;
    int root_port; /* its root port 0000:<host_bus>:<root_port>.0 */
    int bus;       /* the switch's buses: bus (upstream), bus+1 (downstream), bus+2.. */
    int ngpus, nnics;
} switch_t;

typedef struct {
    int gpus, nics;
    const char *down;      /* a NIC whose port is DOWN, or NULL */
    const char *elsewhere; /* a NIC on another network (10.9.0.x), or NULL */
    const char *prefix;    /* device names: prefix + number; NULL "mlx5_" */
    int net;               /* the NICs' network: net.0.0.x; 0: 10 */
} tree_t;

static void add_nic(tree_t *t, const char *dev_path, const char *bus_id, int numa)
{
    char name[32], rel[512], text[64];
    int i = t->nics++;
    snprintf(name, sizeof(name), "%s%d", t->prefix ? t->prefix : "mlx5_", i);
    snprintf(rel, sizeof(rel), "sys/devices/%s/numa_node", dev_path);
    snprintf(text, sizeof(text), "%d", numa);
    put(rel, text);
    snprintf(rel, sizeof(rel), "sys/bus/pci/devices/%s", bus_id);
    link_dev(rel, 3, dev_path);
    snprintf(rel, sizeof(rel), "sys/class/infiniband/%s/device", name);
    link_dev(rel, 3, dev_path);
    bool down = t->down && strcmp(t->down, name) == 0;
    bool elsewhere = t->elsewhere && strcmp(t->elsewhere, name) == 0;
    snprintf(rel, sizeof(rel), "sys/class/infiniband/%s/ports/1/state", name);
    put(rel, down ? "1: DOWN" : "4: ACTIVE");
    snprintf(rel, sizeof(rel), "sys/class/infiniband/%s/ports/1/link_layer", name);
    put(rel, "Ethernet");
    snprintf(rel, sizeof(rel), "sys/class/infiniband/%s/ports/1/gids/0", name);
    put(rel, "fe80:0000:0000:0000:0000:0000:0000:0001");
    snprintf(rel, sizeof(rel), "sys/class/infiniband/%s/ports/1/gid_attrs/types/0", name);
    put(rel, "IB/RoCE v1");
    /* 10.0.0.(10 + i), or 10.9.0.(10 + i) for the NIC on another network. */
    snprintf(rel, sizeof(rel), "sys/class/infiniband/%s/ports/1/gids/1", name);
    snprintf(text, sizeof(text), "0000:0000:0000:0000:0000:ffff:%02x%02x:00%02x",
             t->net ? t->net : 10, elsewhere ? 9 : 0, 10 + i);
    put(rel, text);
    snprintf(rel, sizeof(rel), "sys/class/infiniband/%s/ports/1/gid_attrs/types/1", name);
    put(rel, "RoCE v2");
}

static void add_gpu(const char *dev_path, const char *bus_id, int numa)
{
    char rel[512], text[16];
    snprintf(rel, sizeof(rel), "sys/devices/%s/vendor", dev_path);
    put(rel, "0x10de");
    snprintf(rel, sizeof(rel), "sys/devices/%s/class", dev_path);
    put(rel, "0x030200");
    snprintf(rel, sizeof(rel), "sys/devices/%s/numa_node", dev_path);
    snprintf(text, sizeof(text), "%d", numa);
    put(rel, text);
    snprintf(rel, sizeof(rel), "sys/bus/pci/devices/%s", bus_id);
    link_dev(rel, 3, dev_path);
}

/* One PCIe switch: upstream port, one downstream port per endpoint, its
 * GPUs then its NICs. */
static void add_switch(tree_t *t, const switch_t *s)
{
    char up[160], path[256], bus_id[16];
    snprintf(up, sizeof(up), "pci0000:%02x/0000:%02x:%02x.0/0000:%02x:00.0", s->host_bus,
             s->host_bus, s->root_port, s->bus);
    for (int k = 0; k < s->ngpus + s->nnics; k++) {
        snprintf(bus_id, sizeof(bus_id), "0000:%02x:00.0", s->bus + 2 + k);
        snprintf(path, sizeof(path), "%s/0000:%02x:%02x.0/%s", up, s->bus + 1, k, bus_id);
        if (k < s->ngpus) {
            add_gpu(path, bus_id, s->numa);
            t->gpus++;
        } else {
            add_nic(t, path, bus_id, s->numa);
        }
    }
}

/* A virtual RDMA device (rxe): no PCI device behind it. */
static void add_rxe(const char *name, int ip_last)
{
    char rel[256], text[64];
    snprintf(rel, sizeof(rel), "sys/class/infiniband/%s/ports/1/state", name);
    put(rel, "4: ACTIVE");
    snprintf(rel, sizeof(rel), "sys/class/infiniband/%s/ports/1/gids/0", name);
    put(rel, "fe80:0000:0000:0000:0000:0000:0000:0001");
    snprintf(rel, sizeof(rel), "sys/class/infiniband/%s/ports/1/gids/1", name);
    snprintf(text, sizeof(text), "0000:0000:0000:0000:0000:ffff:0a00:00%02x", ip_last);
    put(rel, text);
    snprintf(rel, sizeof(rel), "sys/class/infiniband/%s/ports/1/gid_attrs/types/1", name);
    put(rel, "RoCE v2");
}

/* DGX-like: two sockets, two PCIe switches per socket, each switch with
 * two GPUs and two NICs (8 and 8). */
static void build_dgx(tree_t *t)
{
    for (int s = 0; s < 4; s++) {
        switch_t sw = {.host_bus = (s / 2) * 0x80,
                       .numa = s / 2,
                       .root_port = 1 + 2 * (s % 2),
                       .bus = (s / 2) * 0x80 + 0x10 + 0x10 * (s % 2),
                       .ngpus = 2,
                       .nnics = 2};
        add_switch(t, &sw);
    }
}

static int setup(void **state)
{
    (void)state;
    snprintf(root, sizeof(root), "/tmp/kvw-topo-XXXXXX");
    assert_non_null(mkdtemp(root));
    return 0;
}

static int teardown(void **state)
{
    (void)state;
    char cmd[300];
    snprintf(cmd, sizeof(cmd), "rm -rf '%s'", root);
    return system(cmd) == 0 ? 0 : -1;
}

static void read_tree(kvw_topo_t *topo)
{
    assert_int_equal(kvw__topo_read(root, 1, "10.0.0.10", 24, topo), 0);
}

/* The NIC picked for GPU g (its bus id from the topology's GPU list). */
static const char *pick_for_gpu(const kvw_topo_t *topo, int g, kvw_topo_pick_t *pick)
{
    assert_true(g < topo->ngpus);
    assert_int_equal(kvw__topo_pick(topo, &topo->gpus[g], -1, "mlx5_0", pick), 0);
    assert_true(pick->nic >= 0 && pick->nic < topo->nnics);
    printf("  GPU %d (%s) -> %s: %s\n", g, topo->gpus[g].bus_id, topo->nics[pick->nic].name,
           pick->reason);
    return topo->nics[pick->nic].name;
}

/* What KVW_DEVICES=near gives KV on gpu (NULL: host memory on NUMA node
 * numa), as "name,name" in rail order; printed with the reason. */
static const char *near_rails(const kvw_topo_t *topo, const kvw_topo_pos_t *gpu, int numa,
                              const char *owner, kvw_topo_near_t *near)
{
    static char list[KVW_TOPO_MAX_RAILS * 64];
    assert_int_equal(kvw__topo_pick_near(topo, gpu, numa, owner, near), 0);
    assert_true(near->nrails >= 1 && near->nrails <= KVW_TOPO_MAX_RAILS);
    assert_int_equal(near->rails[0], near->pick.nic); /* rail 0 is the affinity pick */
    list[0] = '\0';
    for (int k = 0; k < near->nrails; k++) {
        if (k)
            strcat(list, ",");
        strcat(list, topo->nics[near->rails[k]].name);
    }
    printf("  near %s -> %s: %s\n", gpu ? gpu->bus_id : "host memory", list, near->reason);
    return list;
}

/* ---- tests ------------------------------------------------------------------ */

static void test_dgx_pairs(void **state)
{
    (void)state;
    tree_t t = {0};
    build_dgx(&t);
    kvw_topo_t topo;
    read_tree(&topo);
    assert_int_equal(topo.nnics, 8);
    assert_int_equal(topo.ngpus, 8);
    for (int i = 0; i < 8; i++) {
        assert_true(topo.nics[i].active);
        assert_int_equal(topo.nics[i].reaches, 1);
        assert_int_equal(topo.nics[i].pos.numa, i / 4);
    }
    /* Each GPU shares its switch with two NICs: the first GPU of a switch
     * takes its first NIC, the second its second, and no NIC serves two. */
    int used[8] = {0};
    for (int g = 0; g < 8; g++) {
        kvw_topo_pick_t pick;
        char want[24];
        snprintf(want, sizeof(want), "mlx5_%d", g);
        assert_string_equal(pick_for_gpu(&topo, g, &pick), want);
        assert_int_equal(pick.level, KVW_TOPO_SWITCH);
        used[pick.nic]++;
    }
    for (int i = 0; i < 8; i++)
        assert_int_equal(used[i], 1);
    /* Levels: same switch, the other switch of the socket (one root
     * complex here), the other socket. */
    int shared;
    assert_int_equal(kvw__topo_level(&topo.gpus[0], &topo.nics[1].pos, &shared), KVW_TOPO_SWITCH);
    assert_int_equal(shared, 3); /* host bridge, root port, switch upstream port */
    assert_int_equal(kvw__topo_level(&topo.gpus[0], &topo.nics[2].pos, NULL), KVW_TOPO_ROOT);
    assert_int_equal(kvw__topo_level(&topo.gpus[0], &topo.nics[4].pos, NULL), KVW_TOPO_SYS);
    /* Host memory: the caller's NUMA node; a tie keeps local_ip's owner. */
    kvw_topo_pick_t pick;
    assert_int_equal(kvw__topo_pick(&topo, NULL, 1, "mlx5_5", &pick), 0);
    assert_string_equal(topo.nics[pick.nic].name, "mlx5_5");
    assert_int_equal(pick.level, KVW_TOPO_NODE);
    assert_int_equal(kvw__topo_pick(&topo, NULL, 1, "mlx5_0", &pick), 0);
    assert_string_equal(topo.nics[pick.nic].name, "mlx5_4"); /* the first on node 1 */
}

/* 8 GPUs, 2 NICs: one on each socket's first switch; the second switch of
 * socket 0 hangs off the same root complex, socket 1's off another one.
 * down: a NIC whose port is down, or NULL. */
static void fewer_nics_tree(kvw_topo_t *topo, const char *down)
{
    tree_t t = {.down = down};
    switch_t sw[4] = {
        {.host_bus = 0x00, .numa = 0, .root_port = 1, .bus = 0x10, .ngpus = 2, .nnics = 1},
        {.host_bus = 0x00, .numa = 0, .root_port = 3, .bus = 0x20, .ngpus = 2},
        {.host_bus = 0x80, .numa = 1, .root_port = 1, .bus = 0x90, .ngpus = 2, .nnics = 1},
        {.host_bus = 0xc0, .numa = 1, .root_port = 1, .bus = 0xd0, .ngpus = 2},
    };
    for (int s = 0; s < 4; s++)
        add_switch(&t, &sw[s]);
    read_tree(topo);
}

static void test_fewer_nics(void **state)
{
    (void)state;
    kvw_topo_t topo;
    fewer_nics_tree(&topo, NULL);
    assert_int_equal(topo.nnics, 2);
    assert_int_equal(topo.ngpus, 8);
    static const char *const want[8] = {"mlx5_0", "mlx5_0", "mlx5_0", "mlx5_0",
                                        "mlx5_1", "mlx5_1", "mlx5_1", "mlx5_1"};
    static const kvw_topo_level_t level[8] = {KVW_TOPO_SWITCH, KVW_TOPO_SWITCH, KVW_TOPO_ROOT,
                                              KVW_TOPO_ROOT,   KVW_TOPO_SWITCH, KVW_TOPO_SWITCH,
                                              KVW_TOPO_NODE,   KVW_TOPO_NODE};
    for (int g = 0; g < 8; g++) {
        kvw_topo_pick_t pick;
        assert_string_equal(pick_for_gpu(&topo, g, &pick), want[g]);
        assert_int_equal(pick.level, level[g]);
    }
    /* With socket 1's NIC down, its GPUs cross the inter-socket link. */
    teardown(NULL);
    setup(NULL);
    fewer_nics_tree(&topo, "mlx5_1");
    kvw_topo_pick_t pick;
    assert_string_equal(pick_for_gpu(&topo, 6, &pick), "mlx5_0");
    assert_int_equal(pick.level, KVW_TOPO_SYS);
}

/* A NIC that is down, and one on another network: their GPUs share the
 * switch's other NIC. */
static void test_nic_down(void **state)
{
    (void)state;
    tree_t t = {.down = "mlx5_0", .elsewhere = "mlx5_3"};
    build_dgx(&t);
    kvw_topo_t topo;
    read_tree(&topo);
    assert_false(topo.nics[0].active);
    assert_int_equal(topo.nics[3].reaches, 0);
    kvw_topo_pick_t pick;
    assert_string_equal(pick_for_gpu(&topo, 0, &pick), "mlx5_1");
    assert_int_equal(pick.level, KVW_TOPO_SWITCH);
    assert_string_equal(pick_for_gpu(&topo, 1, &pick), "mlx5_1");
    assert_string_equal(pick_for_gpu(&topo, 2, &pick), "mlx5_2");
    assert_string_equal(pick_for_gpu(&topo, 3, &pick), "mlx5_2");
    assert_string_equal(pick_for_gpu(&topo, 4, &pick), "mlx5_4"); /* untouched switches */
    /* Every NIC down: nothing to pick, and the reason counts them. */
    for (int i = 0; i < topo.nnics; i++)
        topo.nics[i].active = false;
    assert_int_equal(kvw__topo_pick(&topo, &topo.gpus[0], -1, NULL, &pick), -1);
    assert_int_equal(pick.nic, -1);
    assert_non_null(strstr(pick.reason, "8 down"));
}

/* Devices the caller's verbs table does not list are never picked. */
static void test_unusable(void **state)
{
    (void)state;
    tree_t t = {0};
    build_dgx(&t);
    kvw_topo_t topo;
    read_tree(&topo);
    topo.nics[0].usable = false;
    kvw_topo_pick_t pick;
    assert_string_equal(pick_for_gpu(&topo, 0, &pick), "mlx5_1");
}

/* rxe: no PCI position, so no preference: the device owning local_ip is
 * kept, as kvwire chose before it read the topology. */
static void test_virtual_devices(void **state)
{
    (void)state;
    add_rxe("rxe0", 10);
    add_rxe("rxe1", 11);
    kvw_topo_t topo;
    read_tree(&topo);
    assert_int_equal(topo.nnics, 2);
    assert_int_equal(topo.ngpus, 0);
    assert_string_equal(topo.nics[1].pos.path, "");
    kvw_topo_pos_t gpu = {.bus_id = "0000:17:00.0", .path = "pci0000:16/0000:16:02.0/0000:17:00.0"};
    kvw_topo_pick_t pick;
    assert_int_equal(kvw__topo_pick(&topo, &gpu, -1, "rxe1", &pick), 0);
    assert_string_equal(topo.nics[pick.nic].name, "rxe1");
    assert_int_equal(pick.level, KVW_TOPO_NONE);
    assert_int_equal(kvw__topo_pick(&topo, NULL, 0, "rxe1", &pick), 0);
    assert_string_equal(topo.nics[pick.nic].name, "rxe1");
    /* No local IP: reachability unknown, not refused. */
    assert_int_equal(kvw__topo_read(root, 1, NULL, 0, &topo), 0);
    assert_int_equal(topo.nics[0].reaches, -1);
}

/* CUDA's bus id form (8-digit domain, upper case) finds the device; a
 * missing one, or a root without an RDMA class, is an error. */
static void test_bus_ids(void **state)
{
    (void)state;
    tree_t t = {0};
    kvw_topo_pos_t pos;
    assert_int_equal(kvw__topo_read(root, 1, NULL, 0, &(kvw_topo_t){0}), -1);
    switch_t sw = {.host_bus = 0x3a, .numa = 0, .root_port = 2, .bus = 0x3b, .ngpus = 1};
    add_switch(&t, &sw);
    assert_int_equal(kvw__topo_pos(root, "00000000:3D:00.0", &pos), 0);
    assert_string_equal(pos.bus_id, "0000:3d:00.0");
    assert_string_equal(pos.path, "pci0000:3a/0000:3a:02.0/0000:3b:00.0/0000:3c:00.0/0000:3d:00.0");
    assert_int_equal(pos.numa, 0);
    assert_int_equal(kvw__topo_pos(root, "0000:99:00.0", &pos), -1);
    assert_int_equal(kvw__topo_pos(root, "nonsense", &pos), -1);
}

/* KVW_DEVICES=near on the DGX-like node: 2 GPUs and 2 NICs per switch, so
 * each GPU keeps its own NIC only (its sibling's is left to the sibling):
 * one rail each, the same device as without near. Host memory on NUMA
 * node 1: the owner of local_ip, the other three node-1 NICs being GPUs'. */
static void test_near_dgx(void **state)
{
    (void)state;
    tree_t t = {0};
    build_dgx(&t);
    kvw_topo_t topo;
    read_tree(&topo);
    kvw_topo_near_t near;
    for (int g = 0; g < 8; g++) {
        char want[24], sibling[48];
        snprintf(want, sizeof(want), "mlx5_%d", g);
        assert_string_equal(near_rails(&topo, &topo.gpus[g], -1, "mlx5_0", &near), want);
        assert_int_equal(near.pick.level, KVW_TOPO_SWITCH);
        snprintf(sibling, sizeof(sibling), "mlx5_%d (GPU %s)", g ^ 1, topo.gpus[g ^ 1].bus_id);
        assert_non_null(strstr(near.reason, sibling));
    }
    assert_string_equal(near_rails(&topo, NULL, 1, "mlx5_5", &near), "mlx5_5");
    assert_int_equal(near.pick.level, KVW_TOPO_NODE);
    assert_non_null(strstr(near.reason, "mlx5_4 (GPU"));
    assert_non_null(strstr(near.reason, "mlx5_7 (GPU"));
}

/* Each GPU alone on its switch with 2 NICs: both are its rails, its pick
 * first. A NIC down is never a rail; one on another network is (each rail
 * of a rail-optimised cluster is on its own network). */
static void test_near_two_nics_per_gpu(void **state)
{
    (void)state;
    tree_t t = {.down = "mlx5_3", .elsewhere = "mlx5_5"};
    for (int s = 0; s < 4; s++) {
        switch_t sw = {.host_bus = (s / 2) * 0x80,
                       .numa = s / 2,
                       .root_port = 1 + 2 * (s % 2),
                       .bus = (s / 2) * 0x80 + 0x10 + 0x10 * (s % 2),
                       .ngpus = 1,
                       .nnics = 2};
        add_switch(&t, &sw);
    }
    kvw_topo_t topo;
    read_tree(&topo);
    assert_int_equal(topo.ngpus, 4);
    assert_int_equal(topo.nnics, 8);
    assert_int_equal(topo.nics[5].reaches, 0);
    static const char *const want[4] = {"mlx5_0,mlx5_1", "mlx5_2", "mlx5_4,mlx5_5",
                                        "mlx5_6,mlx5_7"};
    kvw_topo_near_t near;
    for (int g = 0; g < 4; g++) {
        assert_string_equal(near_rails(&topo, &topo.gpus[g], -1, "mlx5_0", &near), want[g]);
        assert_int_equal(near.pick.level, KVW_TOPO_SWITCH);
        assert_null(strstr(near.reason, "left to"));
    }
    assert_non_null(strstr(near.reason, "2 rails (mlx5_6, mlx5_7)"));
    /* The same node without near: one device, the first of the switch. */
    kvw_topo_pick_t pick;
    assert_string_equal(pick_for_gpu(&topo, 3, &pick), "mlx5_6");
    /* Socket 1's NICs all down: its GPUs' rail 0 is across the
     * inter-socket link, and near adds none there (mlx5_1 is as far, and
     * no GPU's own pick). */
    for (int i = 4; i < 8; i++)
        topo.nics[i].active = false;
    assert_string_equal(near_rails(&topo, &topo.gpus[2], -1, "mlx5_0", &near), "mlx5_0");
    assert_int_equal(near.pick.level, KVW_TOPO_SYS);
    assert_non_null(strstr(near.reason, "inter-socket"));
}

/* Nearest first, then by name, and at most 4: a GPU behind a switch below
 * the node's switch, with 2 NICs beside it and 3 more one switch up
 * (named before them), all at the same-switch level. */
static void test_near_order_and_cap(void **state)
{
    (void)state;
    tree_t t = {0};
    const char *up = "pci0000:00/0000:00:01.0/0000:10:00.0";
    char path[256], bus_id[16];
    for (int k = 0; k < 3; k++) { /* mlx5_0..2, one switch up */
        snprintf(bus_id, sizeof(bus_id), "0000:%02x:00.0", 0x12 + k);
        snprintf(path, sizeof(path), "%s/0000:11:%02x.0/%s", up, k, bus_id);
        add_nic(&t, path, bus_id, 0);
    }
    const char *lower = "0000:11:08.0/0000:20:00.0"; /* the lower switch's upstream port */
    for (int k = 0; k < 3; k++) {                    /* the GPU, then mlx5_3 and mlx5_4 beside it */
        snprintf(bus_id, sizeof(bus_id), "0000:%02x:00.0", 0x22 + k);
        snprintf(path, sizeof(path), "%s/%s/0000:21:%02x.0/%s", up, lower, k, bus_id);
        if (k == 0)
            add_gpu(path, bus_id, 0);
        else
            add_nic(&t, path, bus_id, 0);
    }
    kvw_topo_t topo;
    read_tree(&topo);
    assert_int_equal(topo.ngpus, 1);
    kvw_topo_near_t near;
    assert_string_equal(near_rails(&topo, &topo.gpus[0], -1, NULL, &near),
                        "mlx5_3,mlx5_4,mlx5_0,mlx5_1");
    assert_int_equal(near.pick.level, KVW_TOPO_SWITCH);
    assert_non_null(strstr(near.reason, "1 more beyond the 4-rail cap"));
}

/* Fewer NICs than GPUs: near takes nothing another level would add (the
 * only device at the pick's level is the pick), and two GPUs sharing a
 * NIC both keep it as rail 0. */
static void test_near_fewer_nics(void **state)
{
    (void)state;
    kvw_topo_t topo;
    fewer_nics_tree(&topo, NULL);
    static const char *const want[8] = {"mlx5_0", "mlx5_0", "mlx5_0", "mlx5_0",
                                        "mlx5_1", "mlx5_1", "mlx5_1", "mlx5_1"};
    kvw_topo_near_t near;
    for (int g = 0; g < 8; g++) {
        assert_string_equal(near_rails(&topo, &topo.gpus[g], -1, "mlx5_0", &near), want[g]);
        assert_non_null(strstr(near.reason, "no other device is up"));
    }
    assert_string_equal(near_rails(&topo, NULL, 0, NULL, &near), "mlx5_0");
}

/* The NIC down / NIC on another network tree of test_nic_down: GPU 0's
 * switch has mlx5_1 only up; on GPU 2's, mlx5_3 is on another network, so
 * GPU 3 takes mlx5_2 as its pick, yet mlx5_3 is still GPU 3's by the
 * topology (its engine may be on mlx5_3's network) and is left to it. */
static void test_near_nic_down(void **state)
{
    (void)state;
    tree_t t = {.down = "mlx5_0", .elsewhere = "mlx5_3"};
    build_dgx(&t);
    kvw_topo_t topo;
    read_tree(&topo);
    kvw_topo_near_t near;
    assert_string_equal(near_rails(&topo, &topo.gpus[0], -1, NULL, &near), "mlx5_1");
    assert_string_equal(near_rails(&topo, &topo.gpus[1], -1, NULL, &near), "mlx5_1");
    assert_string_equal(near_rails(&topo, &topo.gpus[2], -1, NULL, &near), "mlx5_2");
    assert_non_null(strstr(near.reason, "mlx5_3 (GPU 0000:23:00.0)"));
    /* Every NIC down: no pick, no rail. */
    for (int i = 0; i < topo.nnics; i++)
        topo.nics[i].active = false;
    assert_int_equal(kvw__topo_pick_near(&topo, &topo.gpus[0], -1, NULL, &near), -1);
    assert_int_equal(near.nrails, 0);
    assert_non_null(strstr(near.reason, "8 down"));
}

/* Host memory on a node without GPUs: every device up on the caller's
 * NUMA node, local_ip's owner first. */
static void test_near_host_memory(void **state)
{
    (void)state;
    tree_t t = {0};
    switch_t a = {.host_bus = 0x00, .numa = 0, .root_port = 1, .bus = 0x10, .nnics = 2};
    switch_t b = {.host_bus = 0x80, .numa = 1, .root_port = 1, .bus = 0x90, .nnics = 1};
    add_switch(&t, &a);
    add_switch(&t, &b);
    kvw_topo_t topo;
    read_tree(&topo);
    kvw_topo_near_t near;
    assert_string_equal(near_rails(&topo, NULL, 0, "mlx5_1", &near), "mlx5_1,mlx5_0");
    assert_int_equal(near.pick.level, KVW_TOPO_NODE);
    assert_string_equal(near_rails(&topo, NULL, 1, "mlx5_1", &near), "mlx5_2");
}

/* rxe: nothing tells the devices apart, so near gives the one device that
 * owns local_ip, and says why. */
static void test_near_virtual_devices(void **state)
{
    (void)state;
    add_rxe("rxe0", 10);
    add_rxe("rxe1", 11);
    kvw_topo_t topo;
    read_tree(&topo);
    kvw_topo_pos_t gpu = {.bus_id = "0000:17:00.0", .path = "pci0000:16/0000:16:02.0/0000:17:00.0"};
    kvw_topo_near_t near;
    assert_string_equal(near_rails(&topo, &gpu, -1, "rxe1", &near), "rxe1");
    assert_non_null(strstr(near.reason, "nothing tells the devices apart"));
    assert_string_equal(near_rails(&topo, NULL, -1, "rxe0", &near), "rxe0");
}

static char picked_log[512];

static void keep_pick(void *arg, kvw_log_level_t level, const char *msg)
{
    (void)arg;
    (void)level;
    if (strstr(msg, "no RDMA device named") || !strncmp(msg, "KVW_DEVICES=near", 16))
        snprintf(picked_log, sizeof(picked_log), "%s", msg);
}

/* The fake NIC's devices fake0..fake3 given places in the fake tree:
 * fake0 and fake1 behind another switch, fake2 and fake3 beside the GPU
 * 0000:12:00.0 (fake3 down when asked). */
static void fake_nic_tree(bool fake3_down)
{
    tree_t t = {.prefix = "fake", .net = 127, .down = fake3_down ? "fake3" : NULL};
    switch_t far = {.host_bus = 0x80, .numa = 1, .root_port = 1, .bus = 0x90, .nnics = 2};
    switch_t near = {
        .host_bus = 0x00, .numa = 0, .root_port = 1, .bus = 0x10, .ngpus = 1, .nnics = 2};
    add_switch(&t, &far);
    add_switch(&t, &near);
}

/* A decode engine whose KV regions are on the fake GPU 0000:12:00.0 and
 * that names no device, with KVW_DEVICES = devices (NULL: unset): its
 * rails' names ("a,b") into rails, and the log line saying why into
 * picked_log. */
static void engine_rails(const char *devices, char *rails, size_t size)
{
    assert_int_equal(setenv("KVW_SYSFS_ROOT", root, 1), 0);
    if (devices)
        assert_int_equal(setenv("KVW_DEVICES", devices, 1), 0);
    fake_nic_config_t nc = {.num_devices = 4};
    assert_int_equal(fake_nic_init(&nc), 0);
    kvw__verbs_set_ops(&fake_nic_ops);
    fake_cuda_config_t cc = {.gdr = 1};
    fake_cuda_init(&cc);
    snprintf(fake_cuda_facts()->dev.pci, sizeof(fake_cuda_facts()->dev.pci), "0000:12:00.0");
    kvw__cuda_set_ops(&fake_cuda_ops);
    kvw_set_log_handler(keep_pick, NULL, KVW_LOG_INFO);

    enum { LEN = 1 << 16 };
    kvw_region_t kv[2];
    for (int i = 0; i < 2; i++)
        kv[i] = (kvw_region_t){.addr = fake_cuda_alloc(LEN), .len = LEN, .item_len = 4096};
    kvw_engine_params_t p;
    kvw_engine_params_init(&p);
    p.role = KVW_ROLE_DECODE;
    p.local_ip = "127.0.0.1";
    p.num_layers = 1;
    p.kv_regions = kv;
    kvw_engine_t *e = NULL;
    picked_log[0] = '\0';
    assert_int_equal(kvw_engine_create(&p, &e), KVW_OK);
    printf("  engine on the fake NIC (not RDMA: the choice only): %s\n", picked_log);
    kvw_rail_t r[KVW_TOPO_MAX_RAILS];
    uint32_t n = kvw_engine_rails(e, r, KVW_TOPO_MAX_RAILS);
    rails[0] = '\0';
    for (uint32_t k = 0; k < n && k < KVW_TOPO_MAX_RAILS; k++)
        snprintf(rails + strlen(rails), size - strlen(rails), "%s%s", k ? "," : "", r[k].device);
    printf("  engine rails: %s\n", rails);
    kvw_engine_destroy(e);

    kvw_set_log_handler(NULL, NULL, KVW_LOG_INFO);
    for (int i = 0; i < 2; i++)
        fake_cuda_free(kv[i].addr);
    kvw__cuda_set_ops(NULL);
    kvw__verbs_set_ops(NULL);
    fake_nic_fini();
    unsetenv("KVW_DEVICES");
    unsetenv("KVW_SYSFS_ROOT");
}

/* The engine itself, naming no device: it opens the NIC on its GPU's
 * switch, not the one that owns local_ip (fake0), and logs why. The fake
 * NIC is not RDMA: this checks the choice only. */
static void test_engine_pick(void **state)
{
    (void)state;
    char rails[256];
    fake_nic_tree(true);
    engine_rails(NULL, rails, sizeof(rails));
    assert_string_equal(rails, "fake2");
    assert_non_null(strstr(picked_log, "using fake2"));
    assert_non_null(strstr(picked_log, "same PCIe switch"));
}

/* KVW_DEVICES=near: the engine opens both NICs beside its GPU as rails
 * (fake2 first, the affinity pick), and one when the other is down; both
 * logged with why. The fake NIC is not RDMA: this checks the choice only
 * (test_rails carries requests over fake rails). */
static void test_engine_near(void **state)
{
    (void)state;
    char rails[256];
    fake_nic_tree(false);
    engine_rails("near", rails, sizeof(rails));
    assert_string_equal(rails, "fake2,fake3");
    assert_non_null(strstr(picked_log, "KVW_DEVICES=near: 2 rails (fake2, fake3)"));
    assert_non_null(strstr(picked_log, "same PCIe switch"));
    teardown(NULL);
    setup(NULL);
    fake_nic_tree(true);
    engine_rails("near", rails, sizeof(rails));
    assert_string_equal(rails, "fake2");
    assert_non_null(strstr(picked_log, "KVW_DEVICES=near: 1 rail (fake2)"));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_dgx_pairs, setup, teardown),
        cmocka_unit_test_setup_teardown(test_fewer_nics, setup, teardown),
        cmocka_unit_test_setup_teardown(test_nic_down, setup, teardown),
        cmocka_unit_test_setup_teardown(test_unusable, setup, teardown),
        cmocka_unit_test_setup_teardown(test_virtual_devices, setup, teardown),
        cmocka_unit_test_setup_teardown(test_bus_ids, setup, teardown),
        cmocka_unit_test_setup_teardown(test_near_dgx, setup, teardown),
        cmocka_unit_test_setup_teardown(test_near_two_nics_per_gpu, setup, teardown),
        cmocka_unit_test_setup_teardown(test_near_order_and_cap, setup, teardown),
        cmocka_unit_test_setup_teardown(test_near_fewer_nics, setup, teardown),
        cmocka_unit_test_setup_teardown(test_near_nic_down, setup, teardown),
        cmocka_unit_test_setup_teardown(test_near_host_memory, setup, teardown),
        cmocka_unit_test_setup_teardown(test_near_virtual_devices, setup, teardown),
        cmocka_unit_test_setup_teardown(test_engine_pick, setup, teardown),
        cmocka_unit_test_setup_teardown(test_engine_near, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
