/* SPDX-License-Identifier: Apache-2.0 */
#include "verbs/topo.h"

#include <ifaddrs.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <arpa/inet.h>
#include <ctype.h>
#include <dirent.h>
#include <limits.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#define MAX_GIDS 256
#define MAX_DEPTH 24

/* snprintf through a va_list: a path that does not fit is cut (and then
 * names no file), which needs no warning at each call. */
static void fmt(char *buf, size_t size, const char *f, ...) __attribute__((format(printf, 3, 4)));
static void fmt(char *buf, size_t size, const char *f, ...)
{
    va_list ap;
    va_start(ap, f);
    vsnprintf(buf, size, f, ap);
    va_end(ap);
}

const char *kvw__topo_root(void)
{
    const char *r = getenv("KVW_SYSFS_ROOT");
    return r ? r : "";
}

/* The first line of a small sysfs file, without its newline. */
static int read_line(const char *path, char *buf, size_t size)
{
    FILE *f = fopen(path, "r");
    if (!f)
        return -1;
    char *s = fgets(buf, (int)size, f);
    fclose(f);
    if (!s)
        return -1;
    buf[strcspn(buf, "\n")] = '\0';
    return 0;
}

static int read_int(const char *path, int def)
{
    char buf[32];
    return read_line(path, buf, sizeof(buf)) ? def : atoi(buf);
}

/* Names of a directory's entries, sorted (readdir's order is the file
 * system's): devices are then listed and tied the same way everywhere. */
static int list_dir(const char *dir, char (*names)[64], int max)
{
    DIR *d = opendir(dir);
    if (!d)
        return -1;
    int n = 0;
    struct dirent *de;
    while ((de = readdir(d)) && n < max) {
        if (de->d_name[0] == '.' || strlen(de->d_name) >= 64)
            continue;
        memcpy(names[n++], de->d_name, strlen(de->d_name) + 1); /* fits: checked above */
    }
    closedir(d);
    qsort(names, (size_t)n, 64, (int (*)(const void *, const void *))strcmp);
    return n;
}

/* "00000000:17:00.0" or "0000:17:00.0", any case -> "0000:17:00.0". */
static int norm_bus_id(const char *in, char *out, size_t size)
{
    const char *colon = strchr(in, ':');
    if (!colon)
        return -1;
    size_t dom = (size_t)(colon - in);
    const char *p = dom > 4 ? in + dom - 4 : in; /* the domain's last 4 digits */
    if (strlen(p) >= size)
        return -1;
    size_t i = 0;
    for (; p[i]; i++)
        out[i] = (char)tolower((unsigned char)p[i]);
    out[i] = '\0';
    return 0;
}

/* link (a sysfs symlink to a device) -> its path below /sys/devices and
 * its NUMA node. An unresolvable link leaves pos empty. */
static void pos_from_link(const char *root, const char *link, kvw_topo_pos_t *pos)
{
    char devroot[PATH_MAX], dir[PATH_MAX], real[PATH_MAX];
    memset(pos, 0, sizeof(*pos));
    pos->numa = -1;
    fmt(dir, sizeof(dir), "%s/sys/devices", root);
    if (!realpath(dir, devroot) || !realpath(link, real))
        return;
    size_t n = strlen(devroot);
    if (strncmp(real, devroot, n) != 0 || real[n] != '/' ||
        strlen(real + n + 1) >= sizeof(pos->path))
        return; /* not a device below /sys/devices */
    fmt(pos->path, sizeof(pos->path), "%s", real + n + 1);
    const char *last = strrchr(pos->path, '/');
    norm_bus_id(last ? last + 1 : pos->path, pos->bus_id, sizeof(pos->bus_id));
    char f[PATH_MAX + 16];
    fmt(f, sizeof(f), "%s/numa_node", real);
    pos->numa = read_int(f, -1);
}

int kvw__topo_pos(const char *root, const char *bus_id, kvw_topo_pos_t *pos)
{
    char id[16], link[PATH_MAX];
    memset(pos, 0, sizeof(*pos));
    pos->numa = -1;
    if (!bus_id || norm_bus_id(bus_id, id, sizeof(id)))
        return -1;
    fmt(link, sizeof(link), "%s/sys/bus/pci/devices/%s", root, id);
    pos_from_link(root, link, pos);
    return pos->path[0] ? 0 : -1;
}

/* Is this IPv4-mapped GID text in ip/prefix? */
static bool gid_in_subnet(const char *text, struct in_addr ip, int prefix)
{
    static const uint8_t v4map[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
    uint8_t raw[16];
    if (inet_pton(AF_INET6, text, raw) != 1 || memcmp(raw, v4map, sizeof(v4map)) != 0)
        return false;
    uint32_t a, b, mask = prefix <= 0 ? 0 : prefix >= 32 ? ~0u : ~0u << (32 - prefix);
    memcpy(&a, raw + 12, 4);
    memcpy(&b, &ip, 4);
    return ((ntohl(a) ^ ntohl(b)) & mask) == 0;
}

/* 1 if a RoCEv2 IPv4-mapped GID of the port is in local_ip's subnet, 0 if
 * none is, -1 when the GIDs cannot say (InfiniBand, no local_ip). */
static int port_reaches(const char *portdir, const char *local_ip, int prefix)
{
    struct in_addr ip;
    char f[PATH_MAX], text[64];
    if (!local_ip || inet_pton(AF_INET, local_ip, &ip) != 1)
        return -1;
    fmt(f, sizeof(f), "%s/link_layer", portdir);
    if (read_line(f, text, sizeof(text)) == 0 && strcasecmp(text, "InfiniBand") == 0)
        return -1;
    for (int i = 0; i < MAX_GIDS; i++) {
        fmt(f, sizeof(f), "%s/gids/%d", portdir, i);
        if (read_line(f, text, sizeof(text)))
            break; /* past the table */
        if (!gid_in_subnet(text, ip, prefix))
            continue;
        fmt(f, sizeof(f), "%s/gid_attrs/types/%d", portdir, i);
        if (read_line(f, text, sizeof(text)) == 0 && strcasestr(text, "v2"))
            return 1;
    }
    return 0;
}

static void read_nic(const char *root, const char *name, uint8_t port, const char *local_ip,
                     int prefix, kvw_topo_nic_t *n)
{
    char dir[PATH_MAX], f[PATH_MAX + 32], state[64];
    memset(n, 0, sizeof(*n));
    fmt(n->name, sizeof(n->name), "%s", name);
    fmt(dir, sizeof(dir), "%s/sys/class/infiniband/%s", root, name);
    fmt(f, sizeof(f), "%s/device", dir);
    pos_from_link(root, f, &n->pos); /* none for rxe: it has no device */
    fmt(f, sizeof(f), "%s/ports/%u/state", dir, port);
    n->active = read_line(f, state, sizeof(state)) == 0 && strstr(state, "ACTIVE") != NULL;
    fmt(f, sizeof(f), "%s/ports/%u", dir, port);
    n->reaches = port_reaches(f, local_ip, prefix);
    n->usable = true;
}

static bool is_nvidia_gpu(const char *devdir)
{
    char f[PATH_MAX + 16], vendor[16], cls[16];
    fmt(f, sizeof(f), "%s/vendor", devdir);
    if (read_line(f, vendor, sizeof(vendor)) || strcasecmp(vendor, "0x10de") != 0)
        return false;
    fmt(f, sizeof(f), "%s/class", devdir);
    /* 0x0300xx VGA, 0x0302xx 3D controller (the data-centre parts). */
    return read_line(f, cls, sizeof(cls)) == 0 &&
           (strncasecmp(cls, "0x0300", 6) == 0 || strncasecmp(cls, "0x0302", 6) == 0);
}

static void read_gpus(const char *root, kvw_topo_t *t)
{
    static char names[1024][64]; /* PCI functions: too many for the stack */
    static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
    char dir[PATH_MAX], dev[PATH_MAX + 64];
    fmt(dir, sizeof(dir), "%s/sys/bus/pci/devices", root);
    pthread_mutex_lock(&lock);
    int n = list_dir(dir, names, 1024);
    for (int i = 0; i < n && t->ngpus < KVW_TOPO_MAX_GPUS; i++) {
        fmt(dev, sizeof(dev), "%s/%s", dir, names[i]);
        if (is_nvidia_gpu(dev) && kvw__topo_pos(root, names[i], &t->gpus[t->ngpus]) == 0)
            t->ngpus++;
    }
    pthread_mutex_unlock(&lock);
}

int kvw__topo_read(const char *root, uint8_t port, const char *local_ip, int prefix_len,
                   kvw_topo_t *t)
{
    char dir[PATH_MAX], names[KVW_TOPO_MAX_NICS][64];
    memset(t, 0, sizeof(*t));
    fmt(dir, sizeof(dir), "%s/sys/class/infiniband", root);
    int n = list_dir(dir, names, KVW_TOPO_MAX_NICS);
    if (n < 0)
        return -1;
    for (int i = 0; i < n; i++)
        read_nic(root, names[i], port, local_ip, prefix_len, &t->nics[t->nnics++]);
    read_gpus(root, t);
    return 0;
}

/* Split a path into its components (in place). */
static int split(char *path, char **parts, int max)
{
    int n = 0;
    for (char *save = NULL, *s = strtok_r(path, "/", &save); s && n < max;
         s = strtok_r(NULL, "/", &save))
        parts[n++] = s;
    return n;
}

kvw_topo_level_t kvw__topo_level(const kvw_topo_pos_t *a, const kvw_topo_pos_t *b, int *shared)
{
    char pa[KVW_TOPO_PATH_MAX], pb[KVW_TOPO_PATH_MAX];
    char *ca[MAX_DEPTH], *cb[MAX_DEPTH];
    if (shared)
        *shared = 0;
    if (!a->path[0] || !b->path[0])
        return KVW_TOPO_NONE;
    memcpy(pa, a->path, sizeof(pa));
    memcpy(pb, b->path, sizeof(pb));
    int na = split(pa, ca, MAX_DEPTH), nb = split(pb, cb, MAX_DEPTH);
    int same = 0;
    /* The bridges above each device: every component but the last. */
    while (same < na - 1 && same < nb - 1 && strcmp(ca[same], cb[same]) == 0)
        same++;
    if (shared)
        *shared = same;
    if (same >= 2) /* the host bridge and at least one PCIe bridge below it */
        return KVW_TOPO_SWITCH;
    if (same == 1)
        return KVW_TOPO_ROOT;
    return a->numa == b->numa ? KVW_TOPO_NODE : KVW_TOPO_SYS;
}

const char *kvw__topo_level_name(kvw_topo_level_t level)
{
    static const char *const names[] = {"same PCIe switch", "same root complex", "same NUMA node",
                                        "another NUMA node", "position unknown"};
    return level <= KVW_TOPO_NONE ? names[level] : "?";
}

const char *kvw__topo_level_short(kvw_topo_level_t level)
{
    static const char *const names[] = {"SW", "RC", "NODE", "SYS", "-"};
    return level <= KVW_TOPO_NONE ? names[level] : "?";
}

/* May n be picked? `on_net`: it must also reach local_ip's network (an
 * engine's own pick); without it, the topology alone (another GPU's claim,
 * or a rail beyond rail 0). */
static bool eligible(const kvw_topo_nic_t *n, bool on_net)
{
    return n->usable && n->active && (!on_net || n->reaches != 0);
}

/* A NIC's distance to gpu (or to NUMA node numa when gpu is NULL) as one
 * number, smaller nearer: the level, then more shared bridges. */
static int score(const kvw_topo_nic_t *n, const kvw_topo_pos_t *gpu, int numa,
                 kvw_topo_level_t *level_p)
{
    int shared = 0;
    kvw_topo_level_t level;
    if (gpu)
        level = kvw__topo_level(&n->pos, gpu, &shared);
    else if (numa < 0 || n->pos.numa < 0)
        level = KVW_TOPO_NONE;
    else
        level = n->pos.numa == numa ? KVW_TOPO_NODE : KVW_TOPO_SYS;
    if (level_p)
        *level_p = level;
    return (int)level * 100 - shared;
}

/* The eligible NICs nearest gpu: a bit per NIC; *best gets their score. */
static uint64_t nearest_set(const kvw_topo_t *t, const kvw_topo_pos_t *gpu, int numa, bool on_net,
                            int *best)
{
    uint64_t set = 0;
    *best = INT_MAX;
    for (int i = 0; i < t->nnics; i++) {
        if (!eligible(&t->nics[i], on_net))
            continue;
        int s = score(&t->nics[i], gpu, numa, NULL);
        if (s < *best) {
            *best = s;
            set = 0;
        }
        if (s == *best)
            set |= 1ull << i;
    }
    return set;
}

/* gpu's turn among the GPUs whose nearest NICs are the same set: the k-th
 * of them takes the k-th NIC of the set. */
static int gpu_turn(const kvw_topo_t *t, const kvw_topo_pos_t *gpu, uint64_t set, bool on_net,
                    int *sharing)
{
    int turn = 0, count = 0;
    bool found = false;
    for (int g = 0; g < t->ngpus; g++) {
        int best;
        if (nearest_set(t, &t->gpus[g], -1, on_net, &best) != set)
            continue;
        if (strcmp(t->gpus[g].bus_id, gpu->bus_id) == 0)
            found = true;
        else if (!found)
            turn++;
        count++;
    }
    *sharing = count;
    return found ? turn : 0;
}

static int nth_bit(uint64_t set, int n)
{
    for (int i = 0; i < 64; i++)
        if ((set >> i & 1) && n-- == 0)
            return i;
    return -1;
}

static int count_bits(uint64_t set)
{
    return __builtin_popcountll(set);
}

static void no_pick(const kvw_topo_t *t, kvw_topo_pick_t *pick)
{
    int down = 0, away = 0;
    for (int i = 0; i < t->nnics; i++) {
        if (!t->nics[i].usable)
            continue;
        down += !t->nics[i].active;
        away += t->nics[i].active && t->nics[i].reaches == 0;
    }
    fmt(pick->reason, sizeof(pick->reason),
        "no RDMA device is up and reaches local_ip's network (%d device%s, %d down, %d on "
        "other networks)",
        t->nnics, t->nnics == 1 ? "" : "s", down, away);
}

/* "GPU <bus id>" or "host memory on NUMA node <n>", for reasons. */
static void who_name(const kvw_topo_pos_t *gpu, int numa, char *who, size_t size)
{
    if (gpu)
        fmt(who, size, "GPU %s", gpu->bus_id);
    else if (numa < 0)
        fmt(who, size, "host memory on an unknown NUMA node");
    else
        fmt(who, size, "host memory on NUMA node %d", numa);
}

int kvw__topo_pick(const kvw_topo_t *t, const kvw_topo_pos_t *gpu, int numa, const char *owner,
                   kvw_topo_pick_t *pick)
{
    memset(pick, 0, sizeof(*pick));
    pick->nic = -1;
    pick->level = KVW_TOPO_NONE;
    int best;
    uint64_t set = nearest_set(t, gpu, numa, true, &best);
    if (!set) {
        no_pick(t, pick);
        return -1;
    }
    int first = nth_bit(set, 0), ties = count_bits(set);
    score(&t->nics[first], gpu, numa, &pick->level);
    char who[64];
    who_name(gpu, numa, who, sizeof(who));
    if (ties == 1) {
        pick->nic = first;
        fmt(pick->reason, sizeof(pick->reason), "nearest to %s: %s", who,
            kvw__topo_level_name(pick->level));
        return 0;
    }
    int owner_i = -1;
    for (int i = 0; owner && i < t->nnics; i++)
        if ((set >> i & 1) && strcmp(t->nics[i].name, owner) == 0)
            owner_i = i;
    if (!gpu || pick->level == KVW_TOPO_NONE) {
        /* Nothing tells them apart: the device that owns local_ip, as before. */
        pick->nic = owner_i >= 0 ? owner_i : first;
        fmt(pick->reason, sizeof(pick->reason), "%d devices equally near %s (%s): %s", ties, who,
            kvw__topo_level_name(pick->level),
            owner_i >= 0 ? "the one that owns local_ip" : "the first by name");
        return 0;
    }
    int sharing = 0, turn = gpu_turn(t, gpu, set, true, &sharing);
    pick->nic = nth_bit(set, turn % ties);
    fmt(pick->reason, sizeof(pick->reason),
        "nearest to %s: %s, one of %d such devices for %d GPU%s (this GPU is number %d of "
        "them)",
        who, kvw__topo_level_name(pick->level), ties, sharing ? sharing : 1, sharing > 1 ? "s" : "",
        turn + 1);
    return 0;
}

/* ---- KVW_DEVICES=near -------------------------------------------------------- */

/* The device gpu takes by the tie rule on the topology alone: every listed
 * device that is up, whatever its network (in a rail-optimised cluster each
 * GPU's engine is on its own NIC's network, which this engine cannot see
 * from its local_ip). -1 when none, or when nothing tells them apart. */
static int topology_claim(const kvw_topo_t *t, const kvw_topo_pos_t *gpu)
{
    int best, sharing;
    kvw_topo_level_t level;
    uint64_t set = nearest_set(t, gpu, -1, false, &best);
    if (!set)
        return -1;
    score(&t->nics[nth_bit(set, 0)], gpu, -1, &level);
    if (level == KVW_TOPO_NONE)
        return -1;
    return nth_bit(set, gpu_turn(t, gpu, set, false, &sharing) % count_bits(set));
}

/* claimer[i]: the index of a GPU other than gpu that claims device i, -1
 * none (a device two GPUs share names the first). */
static void other_claims(const kvw_topo_t *t, const kvw_topo_pos_t *gpu, int *claimer)
{
    for (int i = 0; i < t->nnics; i++)
        claimer[i] = -1;
    for (int g = 0; g < t->ngpus; g++) {
        if (gpu && strcmp(t->gpus[g].bus_id, gpu->bus_id) == 0)
            continue;
        int nic = topology_claim(t, &t->gpus[g]);
        if (nic >= 0 && claimer[nic] < 0)
            claimer[nic] = g;
    }
}

/* The devices up at rail0's level from gpu (or numa), rail0 left out,
 * nearest first then by name (nics are sorted by name): their count. */
static int same_level(const kvw_topo_t *t, const kvw_topo_pos_t *gpu, int numa, int rail0, int *out)
{
    kvw_topo_level_t level0, level;
    int n = 0, scores[KVW_TOPO_MAX_NICS];
    score(&t->nics[rail0], gpu, numa, &level0);
    for (int i = 0; i < t->nnics; i++) {
        int s = score(&t->nics[i], gpu, numa, &level);
        if (i == rail0 || level != level0 || !eligible(&t->nics[i], false))
            continue;
        int k = n++;
        for (; k > 0 && scores[k - 1] > s; k--) { /* insertion: keeps name order within a score */
            out[k] = out[k - 1];
            scores[k] = scores[k - 1];
        }
        out[k] = i;
        scores[k] = s;
    }
    return n;
}

/* Append to a reason being built; what does not fit is cut. */
static void append(char *buf, size_t size, const char *f, ...)
    __attribute__((format(printf, 3, 4)));
static void append(char *buf, size_t size, const char *f, ...)
{
    size_t len = strlen(buf);
    if (len + 1 >= size)
        return;
    va_list ap;
    va_start(ap, f);
    vsnprintf(buf + len, size - len, f, ap);
    va_end(ap);
}

static void near_reason(const kvw_topo_t *t, kvw_topo_near_t *near, const char *who, bool others,
                        const char *left, int cut)
{
    char list[KVW_TOPO_MAX_RAILS * 66] = "";
    for (int k = 0; k < near->nrails; k++)
        append(list, sizeof(list), "%s%s", k ? ", " : "", t->nics[near->rails[k]].name);
    fmt(near->reason, sizeof(near->reason),
        "%d rail%s (%s): %s at the nearest distance from %s (%s)", near->nrails,
        near->nrails == 1 ? "" : "s", list, others ? "the devices up" : "no other device is up",
        who, kvw__topo_level_name(near->pick.level));
    if (left[0])
        append(near->reason, sizeof(near->reason),
               ", less those left to the GPUs whose own pick they are: %s", left);
    if (cut)
        append(near->reason, sizeof(near->reason), "; %d more beyond the %d-rail cap", cut,
               KVW_TOPO_MAX_RAILS);
}

int kvw__topo_pick_near(const kvw_topo_t *t, const kvw_topo_pos_t *gpu, int numa, const char *owner,
                        kvw_topo_near_t *near)
{
    memset(near, 0, sizeof(*near));
    if (kvw__topo_pick(t, gpu, numa, owner, &near->pick)) {
        fmt(near->reason, sizeof(near->reason), "%s", near->pick.reason);
        return -1;
    }
    int rail0 = near->pick.nic;
    near->rails[near->nrails++] = rail0;
    char who[64];
    who_name(gpu, numa, who, sizeof(who));
    if (near->pick.level == KVW_TOPO_NONE) {
        fmt(near->reason, sizeof(near->reason),
            "1 rail (%s): nothing tells the devices apart from %s (no PCI position or NUMA "
            "node), so one device, as without near",
            t->nics[rail0].name, who);
        return 0;
    }
    if (near->pick.level == KVW_TOPO_SYS) {
        fmt(near->reason, sizeof(near->reason),
            "1 rail (%s): it is across the inter-socket link from %s, and more rails there would "
            "only load that link more",
            t->nics[rail0].name, who);
        return 0;
    }
    int cand[KVW_TOPO_MAX_NICS], claimer[KVW_TOPO_MAX_NICS], cut = 0;
    char left[KVW_TOPO_NEAR_REASON_MAX / 2] = "";
    int n = same_level(t, gpu, numa, rail0, cand);
    other_claims(t, gpu, claimer);
    for (int k = 0; k < n; k++) {
        int i = cand[k];
        if (claimer[i] >= 0)
            append(left, sizeof(left), "%s%s (GPU %s)", left[0] ? ", " : "", t->nics[i].name,
                   t->gpus[claimer[i]].bus_id);
        else if (near->nrails == KVW_TOPO_MAX_RAILS)
            cut++;
        else
            near->rails[near->nrails++] = i;
    }
    near_reason(t, near, who, n > 0, left, cut);
    return 0;
}

int kvw__topo_prefix_len(const char *ip)
{
    struct in_addr a;
    struct ifaddrs *list = NULL;
    int prefix = 32;
    if (!ip || inet_pton(AF_INET, ip, &a) != 1 || getifaddrs(&list))
        return prefix;
    for (struct ifaddrs *i = list; i; i = i->ifa_next) {
        if (!i->ifa_addr || i->ifa_addr->sa_family != AF_INET || !i->ifa_netmask)
            continue;
        if (((struct sockaddr_in *)i->ifa_addr)->sin_addr.s_addr != a.s_addr)
            continue;
        prefix = __builtin_popcount(((struct sockaddr_in *)i->ifa_netmask)->sin_addr.s_addr);
        break;
    }
    freeifaddrs(list);
    return prefix;
}

int kvw__topo_my_numa(void)
{
    unsigned cpu = 0, node = 0;
    return syscall(SYS_getcpu, &cpu, &node, NULL) ? -1 : (int)node;
}

void kvw__topo_mark_listed(kvw_topo_t *t, const kvw_verbs_ops_t *ops)
{
    int n = 0;
    struct ibv_device **list = ops->get_device_list(&n);
    for (int i = 0; i < t->nnics; i++) {
        t->nics[i].usable = false;
        for (int j = 0; list && j < n && !t->nics[i].usable; j++)
            t->nics[i].usable = strcmp(ops->get_device_name(list[j]), t->nics[i].name) == 0;
    }
    if (list)
        ops->free_device_list(list);
}

/* The device that owns local_ip (librdmacm), "" none: it breaks ties that
 * nothing else breaks. Asked outside topo_lock (a route lookup). */
static void ip_owner(const kvw_verbs_ops_t *ops, const char *local_ip, char *owner, size_t size)
{
    uint8_t port = 0;
    if (!local_ip || ops->device_for_ip(local_ip, owner, size, &port))
        owner[0] = '\0';
}

/* The topology the engine's choice reads (t, under topo_lock), and the
 * GPU that owns its KV regions (*gpu_p NULL: host memory). 0, or -1 with
 * why. */
static int engine_view(const kvw_verbs_ops_t *ops, uint8_t port, const char *local_ip,
                       const char *gpu_bus_id, kvw_topo_t *t, kvw_topo_pos_t *gpu,
                       const kvw_topo_pos_t **gpu_p, char *why, size_t why_size)
{
    const char *root = kvw__topo_root();
    if (kvw__topo_read(root, port, local_ip, kvw__topo_prefix_len(local_ip), t)) {
        fmt(why, why_size, "%s/sys/class/infiniband cannot be read", root);
        return -1;
    }
    kvw__topo_mark_listed(t, ops);
    bool on_gpu = gpu_bus_id && kvw__topo_pos(root, gpu_bus_id, gpu) == 0;
    if (gpu_bus_id && !on_gpu) /* the GPU is not in sysfs: its bus id still names it */
        fmt(gpu->bus_id, sizeof(gpu->bus_id), "%s", gpu_bus_id);
    *gpu_p = gpu_bus_id ? gpu : NULL;
    return 0;
}

static kvw_topo_t topo_seen; /* ~30 KiB: not on a caller's stack */
static pthread_mutex_t topo_lock = PTHREAD_MUTEX_INITIALIZER;

int kvw__topo_choose(const kvw_verbs_ops_t *ops, uint8_t port, const char *local_ip,
                     const char *gpu_bus_id, char *name, size_t name_size, char *reason,
                     size_t reason_size)
{
    char owner[64];
    kvw_topo_pos_t gpu;
    const kvw_topo_pos_t *gpu_p = NULL;
    kvw_topo_pick_t pick = {.nic = -1};
    ip_owner(ops, local_ip, owner, sizeof(owner));
    pthread_mutex_lock(&topo_lock);
    if (engine_view(ops, port, local_ip, gpu_bus_id, &topo_seen, &gpu, &gpu_p, pick.reason,
                    sizeof(pick.reason)) == 0) {
        kvw__topo_pick(&topo_seen, gpu_p, kvw__topo_my_numa(), owner, &pick);
        if (pick.nic >= 0)
            fmt(name, name_size, "%s", topo_seen.nics[pick.nic].name);
    }
    pthread_mutex_unlock(&topo_lock);
    fmt(reason, reason_size, "%s", pick.reason);
    return pick.nic >= 0 ? 0 : -1;
}

int kvw__topo_choose_near(const kvw_verbs_ops_t *ops, uint8_t port, const char *local_ip,
                          const char *gpu_bus_id, char names[][64], char *reason,
                          size_t reason_size)
{
    static kvw_topo_near_t near; /* its reasons: not on a caller's stack either */
    char owner[64];
    kvw_topo_pos_t gpu;
    const kvw_topo_pos_t *gpu_p = NULL;
    int n = -1;
    ip_owner(ops, local_ip, owner, sizeof(owner));
    pthread_mutex_lock(&topo_lock);
    memset(&near, 0, sizeof(near));
    if (engine_view(ops, port, local_ip, gpu_bus_id, &topo_seen, &gpu, &gpu_p, near.reason,
                    sizeof(near.reason)) == 0 &&
        kvw__topo_pick_near(&topo_seen, gpu_p, kvw__topo_my_numa(), owner, &near) == 0) {
        n = near.nrails;
        for (int k = 0; k < n; k++)
            fmt(names[k], 64, "%s", topo_seen.nics[near.rails[k]].name);
        fmt(reason, reason_size, "%s; rail 0 %s", near.reason, near.pick.reason);
    } else {
        fmt(reason, reason_size, "%s", near.reason);
    }
    pthread_mutex_unlock(&topo_lock);
    return n;
}
