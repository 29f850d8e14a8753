/* SPDX-License-Identifier: Apache-2.0 */
/* Node topology from sysfs: where each RDMA device and each GPU sits on
 * the PCIe tree, and which device an engine should use for the GPU that
 * owns its KV regions (or, for host memory, for the caller's NUMA node).
 * A NIC behind another PCIe switch or socket than the GPU halves the
 * bandwidth and loads the inter-socket link, so the nearest one wins:
 * same PCIe switch, then same root complex, then same NUMA node.
 *
 * Everything is read below a root directory ("" is the real /sys's
 * parent, "/"); tests point it at a tree they build (KVW_SYSFS_ROOT, see
 * kvw__topo_root). The decision itself (kvw__topo_pick) is pure. */
#ifndef KVW_VERBS_TOPO_H
#define KVW_VERBS_TOPO_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "verbs/ops.h"

#define KVW_TOPO_MAX_NICS 32
#define KVW_TOPO_MAX_GPUS 32
#define KVW_TOPO_PATH_MAX 384
#define KVW_TOPO_REASON_MAX 256
#define KVW_TOPO_MAX_RAILS 4 /* devices per engine (KVW_DEVICES, rails/state.h's KVW_MAX_RAILS) */
#define KVW_TOPO_NEAR_REASON_MAX 512

/* How far two devices are apart, nearest first (nvidia-smi topo's PIX/PXB,
 * PHB, NODE, SYS). */
typedef enum {
    KVW_TOPO_SWITCH = 0, /* share a PCIe bridge below the root complex (a switch) */
    KVW_TOPO_ROOT,       /* same root complex (host bridge), different root ports */
    KVW_TOPO_NODE,       /* different root complexes of one NUMA node */
    KVW_TOPO_SYS,        /* different NUMA nodes: across the inter-socket link */
    KVW_TOPO_NONE,       /* a position is unknown (a virtual device such as rxe) */
} kvw_topo_level_t;

/* A PCI function's place: its path below /sys/devices
 * ("pci0000:00/0000:00:01.0/0000:01:00.0/0000:03:00.0": host bridge, the
 * bridges down to it, itself), "" when it has none, and its NUMA node (-1
 * unknown). */
typedef struct kvw_topo_pos {
    char bus_id[16]; /* "0000:03:00.0", lower case */
    char path[KVW_TOPO_PATH_MAX];
    int numa;
} kvw_topo_pos_t;

typedef struct kvw_topo_nic {
    char name[64];
    kvw_topo_pos_t pos;
    bool active; /* the port's state is ACTIVE */
    int reaches; /* 1 a RoCE GID in local_ip's subnet, 0 none, -1 cannot tell (InfiniBand,
                  * or no local_ip) */
    bool usable; /* the caller may use it (kvw__topo_read: true; the engine clears the
                  * devices its verbs table does not list) */
} kvw_topo_nic_t;

typedef struct kvw_topo {
    kvw_topo_nic_t nics[KVW_TOPO_MAX_NICS];
    int nnics;
    kvw_topo_pos_t gpus[KVW_TOPO_MAX_GPUS]; /* NVIDIA GPUs on the PCI bus, by bus id */
    int ngpus;
} kvw_topo_t;

typedef struct kvw_topo_pick {
    int nic; /* index into nics, -1 none */
    kvw_topo_level_t level;
    char reason[KVW_TOPO_REASON_MAX];
} kvw_topo_pick_t;

/* The root sysfs is read below: $KVW_SYSFS_ROOT (for tests: a directory
 * holding a fake sys/ tree), else "". */
const char *kvw__topo_root(void);

/* Read every RDMA device under root/sys/class/infiniband (port `port`: its
 * state and, against local_ip/prefix_len, whether it reaches that network;
 * local_ip NULL: reaches is -1) and every NVIDIA GPU under
 * root/sys/bus/pci/devices. 0, or -1 when root has no RDMA device class
 * (t is then empty). */
int kvw__topo_read(const char *root, uint8_t port, const char *local_ip, int prefix_len,
                   kvw_topo_t *t);

/* The position of PCI function bus_id ("0000:17:00.0"; CUDA's
 * "00000000:17:00.0" and upper case are accepted). 0, or -1 if sysfs has
 * no such device. */
int kvw__topo_pos(const char *root, const char *bus_id, kvw_topo_pos_t *pos);

/* How far a and b are; *shared (may be NULL) gets how many path
 * components they share (more is nearer within one level). */
kvw_topo_level_t kvw__topo_level(const kvw_topo_pos_t *a, const kvw_topo_pos_t *b, int *shared);
const char *kvw__topo_level_name(kvw_topo_level_t level);
/* The short form for a matrix cell: SW, RC, NODE, SYS, -. */
const char *kvw__topo_level_short(kvw_topo_level_t level);

/* Choose among the usable NICs that are active and reach local_ip's
 * network (reaches != 0): the nearest to gpu, or with gpu NULL to NUMA
 * node `numa` (-1 unknown). Ties at a known distance are spread over the
 * GPUs that share the same nearest NICs (the k-th such GPU gets the k-th
 * NIC), so that 8 GPUs and 8 NICs pair up; ties with nothing known (no
 * PCI position, no NUMA node) keep `owner`, the device that owns local_ip
 * (may be NULL), as kvwire did before it read the topology. pick->reason
 * says why. 0, or -1 when no NIC qualifies (reason says why). */
int kvw__topo_pick(const kvw_topo_t *t, const kvw_topo_pos_t *gpu, int numa, const char *owner,
                   kvw_topo_pick_t *pick);

/* KVW_DEVICES=near: the devices an engine takes as its rails. */
typedef struct kvw_topo_near {
    kvw_topo_pick_t pick;                  /* rail 0: kvw__topo_pick's choice, and why */
    int rails[KVW_TOPO_MAX_RAILS];         /* indexes into nics, rails[0] = pick.nic */
    int nrails;                            /* 0 when pick found none */
    char reason[KVW_TOPO_NEAR_REASON_MAX]; /* why these rails and not more */
} kvw_topo_near_t;

/* KVW_DEVICES=near: kvw__topo_pick's choice as rail 0, then every other
 * usable device whose port is active (on any network: in a rail-optimised
 * cluster each rail is on its own) at the same level from gpu (or NUMA
 * node numa) as rail 0, nearest first then by name, up to
 * KVW_TOPO_MAX_RAILS. A device another GPU of the node takes by the tie
 * rule (computed from the topology alone, whatever network it is on) is
 * left to that GPU, so 2 GPUs and 2 NICs on a switch still pair up one to
 * one; a GPU alone on a switch with 2 NICs gets both. With nothing to tell
 * the devices apart (level unknown: rxe), or rail 0 across the
 * inter-socket link (more rails would only load it more), rail 0 alone.
 * near->reason says which were taken, which left to other GPUs and which
 * cut by the cap. 0, or -1 when kvw__topo_pick finds none (near->reason
 * says why). */
int kvw__topo_pick_near(const kvw_topo_t *t, const kvw_topo_pos_t *gpu, int numa, const char *owner,
                        kvw_topo_near_t *near);

/* The prefix length of local interface address ip (getifaddrs), 32 when
 * no interface has it. */
int kvw__topo_prefix_len(const char *ip);
/* The NUMA node the calling thread runs on, -1 unknown. */
int kvw__topo_my_numa(void);
/* Clear `usable` on the devices ops does not list (the fake NIC in tests,
 * a device whose driver is not loaded). */
void kvw__topo_mark_listed(kvw_topo_t *t, const kvw_verbs_ops_t *ops);

/* The engine's choice when no device is named: the topology below
 * kvw__topo_root(), the devices ops lists, the one that owns local_ip (for
 * ties), and the GPU gpu_bus_id owns the KV regions (NULL: host memory,
 * the calling thread's NUMA node). 0 with the device's name and why; -1
 * with why when the topology cannot choose (the caller then finds the
 * device from local_ip, as before). Thread-safe. */
int kvw__topo_choose(const kvw_verbs_ops_t *ops, uint8_t port, const char *local_ip,
                     const char *gpu_bus_id, char *name, size_t name_size, char *reason,
                     size_t reason_size);

/* kvw__topo_choose for KVW_DEVICES=near (kvw__topo_pick_near): the rails'
 * names, rail 0 first. Their count (1 to KVW_TOPO_MAX_RAILS) with why, or
 * -1 with why when the topology cannot choose. Thread-safe. */
int kvw__topo_choose_near(const kvw_verbs_ops_t *ops, uint8_t port, const char *local_ip,
                          const char *gpu_bus_id, char names[][64], char *reason,
                          size_t reason_size);

#endif
