/* SPDX-License-Identifier: Apache-2.0 */
/* The fake NIC: see fake_nic.h. Unit tests and fault injection only; it
 * is not RDMA.
 *
 * All state sits behind one mutex (nic_lock). The wire thread takes it to
 * execute one WR at a time and waits on nic.changed, which every op that
 * can create or remove work broadcasts; fake_nic_quiesce() waits on the
 * same condition. The wire never keeps a pointer across an unlock, so
 * destroying a QP or deregistering an MR can never leave it dangling. */
#include "support/fake_nic.h"

#include <arpa/inet.h>
#include <endian.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <time.h>
#include <unistd.h>

enum {
    NIC_DEFAULT_DEVICES = 2,
    NIC_PORT = 1,
    NIC_GID_TBL_LEN = 2,
    NIC_MAX_QP = 1024,
    NIC_MAX_QP_WR = 16384,
    NIC_MAX_CQE = 65536,
    NIC_MAX_SGE = 32,
    NIC_RNR_FOREVER = 7, /* rnr_retry 7 means retry without limit */
};

#define NIC_DEFAULT_MAX_MSG (8u << 20)
#define NIC_DEFAULT_RNR_DELAY_US 640u
#define NIC_PSN_MASK 0xffffffu
#define NIC_NEVER UINT64_MAX

/* From a pointer to an embedded verbs struct to our object around it. */
// clang-format off
#define NIC_OWNER(ptr, type, member) ((type *)(void *)((char *)(ptr) - offsetof(type, member)))
// clang-format on

typedef struct nic_dev {
    struct ibv_device ibdev;
    int index;
    struct in_addr ip;
    bool killed;
    uint32_t num_qps;
} nic_dev_t;

enum { NIC_ASYNC_EVENTS = 16 };

/* async_fd is the read end of a pipe holding one byte per queued event. */
typedef struct nic_ctx {
    struct ibv_context ibctx;
    nic_dev_t *dev;
    int async_wr;
    struct ibv_async_event async[NIC_ASYNC_EVENTS];
    uint32_t async_head, async_count;
    struct nic_ctx *next;
} nic_ctx_t;

typedef struct nic_pd {
    struct ibv_pd ibpd;
    nic_dev_t *dev;
    struct nic_pd *next;
} nic_pd_t;

typedef struct nic_mr {
    struct ibv_mr ibmr;
    const struct nic_pd *pd;
    int access;
    struct nic_mr *next;
} nic_mr_t;

typedef struct nic_cq nic_cq_t;
typedef struct nic_qp nic_qp_t;

typedef struct nic_event {
    nic_cq_t *cq;
    struct nic_event *next;
} nic_event_t;

/* Its eventfd is readable exactly while events are queued. */
typedef struct nic_chan {
    struct ibv_comp_channel ibch;
    nic_event_t *head, *tail;
    struct nic_chan *next;
} nic_chan_t;

typedef struct nic_cqe {
    struct ibv_wc wc;
    nic_qp_t *sq_owner; /* send CQEs: polling one frees its QP's slots up to seq */
    uint64_t seq;
    uint64_t visible_ns; /* a late ACK: pollable from then on (FIFO) */
} nic_cqe_t;

struct nic_cq {
    struct ibv_cq ibcq;
    nic_chan_t *chan;
    nic_cqe_t *ring;
    uint32_t size, head, count;
    bool armed, solicited_only;
    uint64_t events_delivered, events_acked;
    uint64_t notify_at; /* a late ACK's CQE turns pollable then: notify then */
    nic_cq_t *next;
};

/* A send WR, copied at post time (the caller reuses its arrays). */
typedef struct nic_swr {
    uint64_t wr_id;
    enum ibv_wr_opcode opcode;
    bool signaled, solicited;
    uint64_t local_addr, remote_addr; /* local_addr, lkey: the first entry's */
    uint32_t len, lkey, rkey;         /* len: every entry's together */
    uint32_t num_sge;                 /* gathered in order into remote_addr */
    struct ibv_sge sge[NIC_MAX_SGE];
    uint32_t imm_data;    /* network order, as in the WR */
    uint64_t due_ns;      /* post time + injected delay */
    uint64_t retry_at_ns; /* next RNR / unreachable retry, 0 if none */
    bool counted;         /* seen by the error_wr fault counter */
    bool unreachable;     /* retrying a peer that does not answer, since: */
    uint64_t unreachable_since_ns;
    bool rnr_waiting; /* the last attempt met an empty receive queue */
    uint32_t rnr_naks;
} nic_swr_t;

struct nic_qp {
    struct ibv_qp ibqp;
    nic_dev_t *dev;
    const nic_pd_t *pd;
    nic_cq_t *scq, *rcq;
    bool sig_all;
    int access;
    uint32_t dest_qp_num, rq_psn, sq_psn;
    enum ibv_mtu path_mtu;
    struct ibv_ah_attr ah;
    uint8_t rnr_retry, retry_cnt, timeout, min_rnr_timer;
    /* Send ring: [sq_freed, sq_head) executed but their slots not yet
     * released by a polled completion, [sq_head, sq_tail) outstanding. */
    nic_swr_t *sq;
    uint32_t sq_cap;
    uint32_t max_send_sge; /* a WR with more entries is refused, as verbs do */
    uint64_t sq_freed, sq_head, sq_tail;
    uint64_t *rq; /* receive wr_ids, [rq_head, rq_tail) posted */
    uint32_t rq_cap;
    uint64_t rq_head, rq_tail;
    nic_qp_t *next;
};

typedef struct nic_state {
    bool up, stop;
    pthread_cond_t changed;
    pthread_t wire;
    uint32_t max_msg_sz;
    int max_qp_wr;
    bool no_dmabuf;
    uint64_t retry_ns, rnr_delay_ns;
    nic_dev_t *devs;
    int num_devs;
    nic_ctx_t *ctxs;
    nic_pd_t *pds;
    nic_mr_t *mrs;
    nic_chan_t *chans;
    nic_cq_t *cqs;
    nic_qp_t *qps;
    uint32_t next_handle;
    fake_nic_faults_t faults;
    uint64_t fault_posts, fault_execs, fault_recv_posts, rng;
    uint64_t fault_bytes; /* bytes placed in scope since the faults were set (flip_byte) */
    fake_nic_stats_t stats;
} nic_state_t;

static pthread_mutex_t nic_lock = PTHREAD_MUTEX_INITIALIZER;
static nic_state_t nic; /* guarded by nic_lock */
/* Not reset by fini, so QP numbers and keys stay unique across the many
 * init/fini cycles of one test process: a stale one never matches. */
static uint32_t next_qpn = 0x100, next_key = 1;

/* ---- helpers --------------------------------------------------------- */

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void lock(void)
{
    pthread_mutex_lock(&nic_lock);
}

static void unlock(void)
{
    pthread_mutex_unlock(&nic_lock);
}

/* Something changed: the wire may have work, a quiesce may be over. */
static void changed(void)
{
    if (nic.up)
        pthread_cond_broadcast(&nic.changed);
}

static void wait_changed(uint64_t deadline_ns)
{
    if (deadline_ns == NIC_NEVER) {
        pthread_cond_wait(&nic.changed, &nic_lock);
        return;
    }
    struct timespec ts = {.tv_sec = (time_t)(deadline_ns / 1000000000ull),
                          .tv_nsec = (long)(deadline_ns % 1000000000ull)};
    pthread_cond_timedwait(&nic.changed, &nic_lock, &ts);
}

static int fail_rc(int err)
{
    errno = err;
    return err;
}

static void *fail_ptr(int err)
{
    errno = err;
    return NULL;
}

__attribute__((format(printf, 1, 2))) static void record_fatal(const char *fmt, ...)
{
    char msg[sizeof(nic.stats.fatal)];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    fprintf(stderr, "fake_nic: FATAL: %s\n", msg);
    if (nic.stats.fatal_errors++ == 0)
        memcpy(nic.stats.fatal, msg, sizeof(msg));
}

/* xorshift64: reproducible jitter from the fault seed. */
static uint64_t next_random(void)
{
    uint64_t x = nic.rng;
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    nic.rng = x;
    return x;
}

static bool in_fault_scope(const nic_qp_t *qp)
{
    return !nic.faults.fault_qp_num || nic.faults.fault_qp_num == qp->ibqp.qp_num;
}

static nic_ctx_t *ctx_of(struct ibv_context *c)
{
    return NIC_OWNER(c, nic_ctx_t, ibctx);
}

static nic_pd_t *pd_of(struct ibv_pd *p)
{
    return NIC_OWNER(p, nic_pd_t, ibpd);
}

static nic_mr_t *mr_of(struct ibv_mr *m)
{
    return NIC_OWNER(m, nic_mr_t, ibmr);
}

static nic_chan_t *chan_of(struct ibv_comp_channel *c)
{
    return NIC_OWNER(c, nic_chan_t, ibch);
}

static nic_cq_t *cq_of(struct ibv_cq *c)
{
    return NIC_OWNER(c, nic_cq_t, ibcq);
}

static nic_qp_t *qp_of(struct ibv_qp *q)
{
    return NIC_OWNER(q, nic_qp_t, ibqp);
}

/* Unlink obj from the singly linked list at *headp (obj->next links). */
#define NIC_UNLINK(headp, obj)                                                                     \
    do {                                                                                           \
        __typeof__(obj) *pp_ = (headp);                                                            \
        while (*pp_ && *pp_ != (obj))                                                              \
            pp_ = &(*pp_)->next;                                                                   \
        if (*pp_)                                                                                  \
            *pp_ = (obj)->next;                                                                    \
    } while (0)

#define NIC_PUSH(headp, obj)                                                                       \
    do {                                                                                           \
        (obj)->next = *(headp);                                                                    \
        *(headp) = (obj);                                                                          \
    } while (0)

/* ---- devices --------------------------------------------------------- */

/* GID 0: link-local RoCEv1 (fe80::, from a made-up MAC); GID 1: RoCEv2
 * IPv4-mapped (::ffff:a.b.c.d) of the device's IP, what kvwire picks. */
static void fill_gid(const nic_dev_t *dev, uint32_t index, union ibv_gid *gid)
{
    memset(gid, 0, sizeof(*gid));
    if (index == 0) {
        gid->raw[0] = 0xfe;
        gid->raw[1] = 0x80;
        gid->raw[8] = 0x02;
        gid->raw[11] = 0xff;
        gid->raw[12] = 0xfe;
        gid->raw[15] = (uint8_t)(dev->index + 1);
    } else {
        gid->raw[10] = gid->raw[11] = 0xff;
        memcpy(gid->raw + 12, &dev->ip, 4);
    }
}

static bool gid_belongs_to(const nic_dev_t *dev, const union ibv_gid *gid)
{
    for (uint32_t i = 0; i < NIC_GID_TBL_LEN; i++) {
        union ibv_gid g;
        fill_gid(dev, i, &g);
        if (memcmp(g.raw, gid->raw, sizeof(g.raw)) == 0)
            return true;
    }
    return false;
}

static int init_devices(const fake_nic_config_t *cfg, int n)
{
    nic.devs = calloc((size_t)n, sizeof(*nic.devs));
    if (!nic.devs)
        return ENOMEM;
    nic.num_devs = n;
    for (int i = 0; i < n; i++) {
        nic_dev_t *d = &nic.devs[i];
        const char *ip = cfg->ip[i] ? cfg->ip[i] : "127.0.0.1";
        d->index = i;
        if (inet_pton(AF_INET, ip, &d->ip) != 1)
            return EINVAL;
        snprintf(d->ibdev.name, sizeof(d->ibdev.name), "fake%d", i);
        snprintf(d->ibdev.dev_name, sizeof(d->ibdev.dev_name), "uverbs%d", i);
        d->ibdev.node_type = IBV_NODE_CA;
        d->ibdev.transport_type = IBV_TRANSPORT_IB;
    }
    return 0;
}

static struct ibv_device **nic_get_device_list(int *num)
{
    lock();
    struct ibv_device **list = nic.up ? calloc((size_t)nic.num_devs + 1, sizeof(*list)) : NULL;
    int n = list ? nic.num_devs : 0;
    for (int i = 0; i < n; i++)
        list[i] = &nic.devs[i].ibdev;
    int err = nic.up ? ENOMEM : ENODEV;
    unlock();
    if (num)
        *num = n;
    return list ? list : fail_ptr(err);
}

static void nic_free_device_list(struct ibv_device **list)
{
    free(list);
}

static const char *nic_get_device_name(struct ibv_device *dev)
{
    return dev->name; /* fixed from init to fini */
}

static struct ibv_context *nic_open_device(struct ibv_device *dev)
{
    nic_ctx_t *c = calloc(1, sizeof(*c));
    if (!c)
        return fail_ptr(ENOMEM);
    c->dev = NIC_OWNER(dev, nic_dev_t, ibdev);
    c->ibctx.device = dev;
    c->ibctx.cmd_fd = -1;
    c->ibctx.num_comp_vectors = 1;
    int fds[2];
    if (pipe2(fds, O_NONBLOCK | O_CLOEXEC)) {
        free(c);
        return fail_ptr(errno);
    }
    c->ibctx.async_fd = fds[0];
    c->async_wr = fds[1];
    lock();
    NIC_PUSH(&nic.ctxs, c);
    unlock();
    return &c->ibctx;
}

static bool ctx_in_use(const struct ibv_context *ibctx)
{
    for (const nic_pd_t *p = nic.pds; p; p = p->next)
        if (p->ibpd.context == ibctx)
            return true;
    for (const nic_cq_t *q = nic.cqs; q; q = q->next)
        if (q->ibcq.context == ibctx)
            return true;
    for (const nic_chan_t *ch = nic.chans; ch; ch = ch->next)
        if (ch->ibch.context == ibctx)
            return true;
    return false;
}

/* With objects still open: EBUSY, and fake_nic_fini() frees them later. */
static int nic_close_device(struct ibv_context *ibctx)
{
    nic_ctx_t *c = ctx_of(ibctx);
    lock();
    bool busy = ctx_in_use(ibctx);
    if (!busy)
        NIC_UNLINK(&nic.ctxs, c);
    unlock();
    if (busy)
        return fail_rc(EBUSY);
    close(c->ibctx.async_fd);
    close(c->async_wr);
    free(c);
    return 0;
}

static int nic_get_async_event(struct ibv_context *ibctx, struct ibv_async_event *ev)
{
    nic_ctx_t *c = ctx_of(ibctx);
    char byte;
    lock();
    bool have = c->async_count > 0 && read(c->ibctx.async_fd, &byte, 1) == 1;
    if (have) {
        *ev = c->async[c->async_head];
        c->async_head = (c->async_head + 1) % NIC_ASYNC_EVENTS;
        c->async_count--;
    }
    unlock();
    return have ? 0 : fail_rc(EAGAIN);
}

static void nic_ack_async_event(struct ibv_async_event *ev)
{
    (void)ev;
}

/* (lock) Queue ev on every context of dev. */
static void raise_async_locked(const nic_dev_t *dev, const struct ibv_async_event *ev)
{
    for (nic_ctx_t *c = nic.ctxs; c; c = c->next) {
        if (c->dev != dev || c->async_count == NIC_ASYNC_EVENTS)
            continue;
        c->async[(c->async_head + c->async_count) % NIC_ASYNC_EVENTS] = *ev;
        c->async_count++;
        if (write(c->async_wr, "e", 1) != 1)
            record_fatal("async event pipe write failed: %s", strerror(errno));
    }
}

int fake_nic_raise_port_event(const char *name, enum ibv_event_type type)
{
    lock();
    int rc = -1;
    for (int i = 0; i < nic.num_devs; i++) {
        if (strcmp(nic.devs[i].ibdev.name, name) != 0)
            continue;
        struct ibv_async_event ev = {.event_type = type};
        ev.element.port_num = 1;
        raise_async_locked(&nic.devs[i], &ev);
        rc = 0;
    }
    unlock();
    return rc;
}

int fake_nic_raise_qp_event(uint32_t qp_num, enum ibv_event_type type)
{
    lock();
    int rc = -1;
    for (nic_qp_t *q = nic.qps; q; q = q->next) {
        if (q->ibqp.qp_num != qp_num)
            continue;
        struct ibv_async_event ev = {.event_type = type};
        ev.element.qp = &q->ibqp;
        raise_async_locked(q->dev, &ev);
        rc = 0;
    }
    unlock();
    return rc;
}

static int nic_device_for_ip(const char *ip, char *name, size_t name_size, uint8_t *port)
{
    struct in_addr a;
    if (!ip || inet_pton(AF_INET, ip, &a) != 1)
        return EINVAL;
    int rc = ENODEV;
    lock();
    for (int i = 0; nic.up && i < nic.num_devs && rc; i++) {
        if (nic.devs[i].ip.s_addr != a.s_addr)
            continue;
        snprintf(name, name_size, "%s", nic.devs[i].ibdev.name);
        *port = NIC_PORT;
        rc = 0;
    }
    unlock();
    return rc;
}

static int nic_query_device(struct ibv_context *ibctx, struct ibv_device_attr *attr)
{
    const nic_dev_t *d = ctx_of(ibctx)->dev;
    memset(attr, 0, sizeof(*attr));
    snprintf(attr->fw_ver, sizeof(attr->fw_ver), "fake-nic");
    attr->node_guid = htobe64(0x0200000000000000ull | (uint64_t)(d->index + 1));
    attr->max_mr_size = UINT64_MAX;
    attr->max_qp = NIC_MAX_QP;
    lock();
    attr->max_qp_wr = nic.max_qp_wr;
    unlock();
    attr->max_sge = NIC_MAX_SGE;
    attr->max_cq = 65536;
    attr->max_cqe = NIC_MAX_CQE;
    attr->max_mr = 65536;
    attr->max_pd = 65536;
    attr->max_qp_rd_atom = attr->max_qp_init_rd_atom = 16;
    attr->phys_port_cnt = 1;
    return 0;
}

static int nic_query_port(struct ibv_context *ibctx, uint8_t port, struct ibv_port_attr *attr)
{
    if (port != NIC_PORT)
        return fail_rc(EINVAL);
    memset(attr, 0, sizeof(*attr));
    lock();
    /* A killed device is a link that went down (fake_nic_revive_device:
     * back up). */
    attr->state = ctx_of(ibctx)->dev->killed ? IBV_PORT_DOWN : IBV_PORT_ACTIVE;
    unlock();
    attr->max_mtu = attr->active_mtu = IBV_MTU_4096;
    attr->gid_tbl_len = NIC_GID_TBL_LEN;
    attr->pkey_tbl_len = 1;
    lock();
    attr->max_msg_sz = nic.max_msg_sz;
    unlock();
    attr->lid = 0;
    attr->link_layer = IBV_LINK_LAYER_ETHERNET;
    attr->phys_state = 5; /* LinkUp */
    attr->active_width = 1;
    attr->active_speed = 1;
    return 0;
}

static int nic_query_gid_ex(struct ibv_context *ibctx, uint32_t port, uint32_t index,
                            struct ibv_gid_entry *entry)
{
    if (port != NIC_PORT || index >= NIC_GID_TBL_LEN)
        return fail_rc(EINVAL);
    memset(entry, 0, sizeof(*entry));
    fill_gid(ctx_of(ibctx)->dev, index, &entry->gid);
    entry->gid_index = index;
    entry->port_num = port;
    entry->gid_type = index == 0 ? IBV_GID_TYPE_ROCE_V1 : IBV_GID_TYPE_ROCE_V2;
    entry->ndev_ifindex = 1;
    return 0;
}

/* ---- protection domains and memory regions --------------------------- */

static struct ibv_pd *nic_alloc_pd(struct ibv_context *ibctx)
{
    nic_pd_t *p = calloc(1, sizeof(*p));
    if (!p)
        return fail_ptr(ENOMEM);
    p->dev = ctx_of(ibctx)->dev;
    p->ibpd.context = ibctx;
    lock();
    p->ibpd.handle = ++nic.next_handle;
    NIC_PUSH(&nic.pds, p);
    unlock();
    return &p->ibpd;
}

static bool pd_in_use(const nic_pd_t *p)
{
    for (const nic_mr_t *m = nic.mrs; m; m = m->next)
        if (m->pd == p)
            return true;
    for (const nic_qp_t *q = nic.qps; q; q = q->next)
        if (q->pd == p)
            return true;
    return false;
}

static int nic_dealloc_pd(struct ibv_pd *ibpd)
{
    nic_pd_t *p = pd_of(ibpd);
    lock();
    bool busy = pd_in_use(p);
    if (!busy)
        NIC_UNLINK(&nic.pds, p);
    unlock();
    if (busy)
        return fail_rc(EBUSY);
    free(p);
    return 0;
}

static struct ibv_mr *nic_reg_mr(struct ibv_pd *ibpd, void *addr, size_t len, int access)
{
    /* Like the kernel: remote write needs local write. */
    bool bad_access = (access & IBV_ACCESS_REMOTE_WRITE) && !(access & IBV_ACCESS_LOCAL_WRITE);
    if (!len || bad_access)
        return fail_ptr(EINVAL);
    nic_mr_t *m = calloc(1, sizeof(*m));
    if (!m)
        return fail_ptr(ENOMEM);
    m->pd = pd_of(ibpd);
    m->access = access;
    m->ibmr.context = ibpd->context;
    m->ibmr.pd = ibpd;
    m->ibmr.addr = addr;
    m->ibmr.length = len;
    lock();
    uint32_t k = next_key++ & 0xffffff;
    m->ibmr.handle = ++nic.next_handle;
    m->ibmr.lkey = k << 8 | 0x4c; /* distinct lkey and rkey: mixing them up fails */
    m->ibmr.rkey = k << 8 | 0x52;
    NIC_PUSH(&nic.mrs, m);
    unlock();
    return &m->ibmr;
}

/* Tests pose host memory as GPU memory, so the "dma-buf" is the host
 * memory at iova: registered like reg_mr, once the fd proves real. */
static struct ibv_mr *nic_reg_dmabuf_mr(struct ibv_pd *pd, uint64_t offset, size_t len,
                                        uint64_t iova, int fd, int access)
{
    (void)offset;
    if (nic.no_dmabuf)
        return fail_ptr(EOPNOTSUPP);
    if (fd < 0 || fcntl(fd, F_GETFD) < 0)
        return fail_ptr(EBADF); /* also the answer to kvwire's support probe */
    return nic_reg_mr(pd, (void *)(uintptr_t)iova, len, access);
}

static int nic_dereg_mr(struct ibv_mr *ibmr)
{
    nic_mr_t *m = mr_of(ibmr);
    lock();
    NIC_UNLINK(&nic.mrs, m);
    unlock();
    free(m);
    return 0;
}

/* The MR of pd with this key covering [addr, addr + len) with `need`
 * access, or NULL. */
static const nic_mr_t *find_mr(const nic_pd_t *pd, uint32_t key, bool remote, uint64_t addr,
                               uint64_t len, int need)
{
    for (const nic_mr_t *m = nic.mrs; m; m = m->next) {
        if (m->pd != pd || (remote ? m->ibmr.rkey : m->ibmr.lkey) != key)
            continue;
        uint64_t start = (uint64_t)(uintptr_t)m->ibmr.addr;
        bool inside =
            addr >= start && len <= m->ibmr.length && addr - start <= m->ibmr.length - len;
        return inside && (m->access & need) == need ? m : NULL;
    }
    return NULL;
}

/* ---- completion channels and CQs --------------------------------------- */

static void chan_set_readable(nic_chan_t *ch, bool readable)
{
    uint64_t v = 1;
    if (readable) {
        if (write(ch->ibch.fd, &v, sizeof(v)) != sizeof(v))
            record_fatal("comp channel eventfd write failed: %s", strerror(errno));
    } else if (read(ch->ibch.fd, &v, sizeof(v)) < 0 && errno != EAGAIN) {
        record_fatal("comp channel eventfd read failed: %s", strerror(errno));
    }
}

static void chan_push(nic_chan_t *ch, nic_cq_t *cq)
{
    nic_event_t *ev = calloc(1, sizeof(*ev));
    if (!ev) {
        record_fatal("no memory for a completion event");
        return;
    }
    ev->cq = cq;
    if (ch->tail) {
        ch->tail->next = ev;
    } else {
        ch->head = ev;
        chan_set_readable(ch, true);
    }
    ch->tail = ev;
}

/* Forget the events of a CQ being destroyed (the kernel does the same). */
static void chan_drop_cq(nic_chan_t *ch, const nic_cq_t *cq)
{
    nic_event_t **pp = &ch->head, *last = NULL;
    bool had = ch->head != NULL;
    while (*pp) {
        nic_event_t *ev = *pp;
        if (ev->cq == cq) {
            *pp = ev->next;
            free(ev);
        } else {
            last = ev;
            pp = &ev->next;
        }
    }
    ch->tail = last;
    if (had && !ch->head)
        chan_set_readable(ch, false);
}

static struct ibv_comp_channel *nic_create_comp_channel(struct ibv_context *ibctx)
{
    nic_chan_t *ch = calloc(1, sizeof(*ch));
    if (!ch)
        return fail_ptr(ENOMEM);
    ch->ibch.fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (ch->ibch.fd < 0) {
        int err = errno;
        free(ch);
        return fail_ptr(err);
    }
    ch->ibch.context = ibctx;
    lock();
    NIC_PUSH(&nic.chans, ch);
    unlock();
    return &ch->ibch;
}

static void chan_free(nic_chan_t *ch)
{
    while (ch->head) {
        nic_event_t *ev = ch->head;
        ch->head = ev->next;
        free(ev);
    }
    close(ch->ibch.fd);
    free(ch);
}

static int nic_destroy_comp_channel(struct ibv_comp_channel *ibch)
{
    nic_chan_t *ch = chan_of(ibch);
    lock();
    bool busy = false;
    for (const nic_cq_t *cq = nic.cqs; cq; cq = cq->next)
        busy |= cq->chan == ch;
    if (!busy)
        NIC_UNLINK(&nic.chans, ch);
    unlock();
    if (busy)
        return fail_rc(EBUSY);
    chan_free(ch);
    return 0;
}

static struct ibv_cq *nic_create_cq(struct ibv_context *ibctx, int cqe, void *cq_ctx,
                                    struct ibv_comp_channel *ibch, int vector)
{
    if (cqe < 1 || cqe > NIC_MAX_CQE || vector != 0)
        return fail_ptr(EINVAL);
    nic_cq_t *cq = calloc(1, sizeof(*cq));
    nic_cqe_t *ring = calloc((size_t)cqe, sizeof(*ring));
    if (!cq || !ring) {
        free(cq);
        free(ring);
        return fail_ptr(ENOMEM);
    }
    cq->ring = ring;
    cq->size = (uint32_t)cqe;
    cq->chan = ibch ? chan_of(ibch) : NULL;
    cq->ibcq.context = ibctx;
    cq->ibcq.channel = ibch;
    cq->ibcq.cq_context = cq_ctx;
    cq->ibcq.cqe = cqe;
    lock();
    cq->ibcq.handle = ++nic.next_handle;
    NIC_PUSH(&nic.cqs, cq);
    unlock();
    return &cq->ibcq;
}

static int nic_destroy_cq(struct ibv_cq *ibcq)
{
    nic_cq_t *cq = cq_of(ibcq);
    lock();
    bool busy = false;
    for (const nic_qp_t *q = nic.qps; q; q = q->next)
        busy |= q->scq == cq || q->rcq == cq;
    if (!busy) {
        /* ibv_destroy_cq waits for every delivered event to be acked. */
        if (cq->events_acked != cq->events_delivered)
            record_fatal("destroy_cq with %llu unacked events (hangs on real verbs)",
                         (unsigned long long)(cq->events_delivered - cq->events_acked));
        if (cq->chan)
            chan_drop_cq(cq->chan, cq);
        NIC_UNLINK(&nic.cqs, cq);
    }
    unlock();
    if (busy)
        return fail_rc(EBUSY);
    free(cq->ring);
    free(cq);
    return 0;
}

static int nic_req_notify_cq(struct ibv_cq *ibcq, int solicited_only)
{
    nic_cq_t *cq = cq_of(ibcq);
    lock();
    cq->armed = true;
    cq->solicited_only = solicited_only != 0;
    unlock();
    return 0;
}

/* An armed CQ turns its next (matching) CQE into one channel event. */
static void cq_notify(nic_cq_t *cq, bool solicited)
{
    if (!cq->armed || (cq->solicited_only && !solicited) || nic.faults.mute_events)
        return;
    cq->armed = false;
    if (cq->chan)
        chan_push(cq->chan, cq);
}

static void cq_push(nic_cq_t *cq, const struct ibv_wc *wc, nic_qp_t *sq_owner, uint64_t seq,
                    bool solicited)
{
    if (cq->count == cq->size) {
        nic.stats.cq_overruns++;
        record_fatal("cq overrun: CQ of %u entries full, CQE of QP %u (wr_id %llu, %s) lost",
                     cq->size, wc->qp_num, (unsigned long long)wc->wr_id,
                     wc->status == IBV_WC_SUCCESS ? "success" : "error");
        return;
    }
    nic_cqe_t *e = &cq->ring[(cq->head + cq->count++) % cq->size];
    e->wc = *wc;
    e->sq_owner = sq_owner;
    e->seq = seq;
    /* The data landed; the sender hears of it only when the ACK arrives. */
    e->visible_ns = sq_owner && wc->status == IBV_WC_SUCCESS
                        ? now_ns() + (uint64_t)nic.faults.ack_delay_us * 1000
                        : 0;
    nic.stats.cqes++;
    if (e->visible_ns) { /* the event comes with the ACK (wire thread) */
        if (!cq->notify_at || e->visible_ns < cq->notify_at)
            cq->notify_at = e->visible_ns;
        return;
    }
    cq_notify(cq, solicited || wc->status != IBV_WC_SUCCESS);
}

/* Wire thread: deliver the events of CQEs whose late ACK arrived; *wake
 * gets the earliest one still to come. */
static void late_acks(uint64_t now, uint64_t *wake)
{
    for (nic_cq_t *cq = nic.cqs; cq; cq = cq->next) {
        if (!cq->notify_at)
            continue;
        if (cq->notify_at <= now) {
            cq_notify(cq, false);
            /* The next late ACK in this CQ, if any, notifies in its turn. */
            cq->notify_at = 0;
            for (uint32_t i = 0; i < cq->count; i++) {
                uint64_t v = cq->ring[(cq->head + i) % cq->size].visible_ns;
                if (v > now && (!cq->notify_at || v < cq->notify_at))
                    cq->notify_at = v;
            }
        }
        if (cq->notify_at && cq->notify_at < *wake) {
            *wake = cq->notify_at;
        }
    }
}

/* Drop the CQEs of a destroyed QP so none points at it (mlx5 cleans its
 * CQs the same way). Compacts in place, keeping order. */
static void cq_purge_qp(nic_cq_t *cq, uint32_t qpn)
{
    uint32_t kept = 0;
    for (uint32_t i = 0; i < cq->count; i++) {
        nic_cqe_t e = cq->ring[(cq->head + i) % cq->size];
        if (e.wc.qp_num != qpn)
            cq->ring[(cq->head + kept++) % cq->size] = e;
    }
    cq->count = kept;
}

static int nic_get_cq_event(struct ibv_comp_channel *ibch, struct ibv_cq **cq_out, void **ctx_out)
{
    nic_chan_t *ch = chan_of(ibch);
    lock();
    nic_event_t *ev = ch->head;
    if (ev) {
        ch->head = ev->next;
        if (!ch->head) {
            ch->tail = NULL;
            chan_set_readable(ch, false);
        }
        ev->cq->events_delivered++;
        *cq_out = &ev->cq->ibcq;
        *ctx_out = ev->cq->ibcq.cq_context;
    }
    unlock();
    if (!ev) {
        errno = EAGAIN; /* never blocks, as on a non-blocking channel fd */
        return -1;
    }
    free(ev);
    return 0;
}

static void nic_ack_cq_events(struct ibv_cq *ibcq, unsigned int n)
{
    nic_cq_t *cq = cq_of(ibcq);
    lock();
    cq->events_acked += n;
    if (cq->events_acked > cq->events_delivered)
        record_fatal("ack_cq_events: %llu acked, only %llu delivered",
                     (unsigned long long)cq->events_acked,
                     (unsigned long long)cq->events_delivered);
    unlock();
}

static int nic_poll_cq(struct ibv_cq *ibcq, int n, struct ibv_wc *wc)
{
    nic_cq_t *cq = cq_of(ibcq);
    int got = 0;
    lock();
    uint64_t now = now_ns();
    while (got < n && cq->count && cq->ring[cq->head].visible_ns <= now) {
        nic_cqe_t *e = &cq->ring[cq->head];
        wc[got++] = e->wc;
        /* Like mlx5: send-queue slots come back when the CQE is polled. */
        if (e->sq_owner && e->seq + 1 > e->sq_owner->sq_freed)
            e->sq_owner->sq_freed = e->seq + 1;
        cq->head = (cq->head + 1) % cq->size;
        cq->count--;
    }
    unlock();
    return got;
}

/* ---- completions and flushing ---------------------------------------- */

/* Ring length for a queue of capacity cap (a zero-depth queue still gets
 * one entry, never used, so indexing needs no special case). */
static uint32_t ring_len(uint32_t cap)
{
    return cap ? cap : 1;
}

static nic_swr_t *sq_at(const nic_qp_t *qp, uint64_t seq)
{
    return &qp->sq[seq % ring_len(qp->sq_cap)];
}

static uint64_t *rq_at(const nic_qp_t *qp, uint64_t seq)
{
    return &qp->rq[seq % ring_len(qp->rq_cap)];
}

static void complete_send(nic_qp_t *qp, uint64_t seq, enum ibv_wc_status status)
{
    const nic_swr_t *w = sq_at(qp, seq);
    struct ibv_wc wc = {.wr_id = w->wr_id,
                        .status = status,
                        .opcode = IBV_WC_RDMA_WRITE,
                        .byte_len = status == IBV_WC_SUCCESS ? w->len : 0,
                        .qp_num = qp->ibqp.qp_num};
    cq_push(qp->scq, &wc, qp, seq, false);
}

static void flush_sends(nic_qp_t *qp)
{
    for (; qp->sq_head < qp->sq_tail; qp->sq_head++) {
        complete_send(qp, qp->sq_head, IBV_WC_WR_FLUSH_ERR);
        nic.stats.wrs_flushed++;
    }
}

static void flush_recvs(nic_qp_t *qp)
{
    for (; qp->rq_head < qp->rq_tail; qp->rq_head++) {
        struct ibv_wc wc = {.wr_id = *rq_at(qp, qp->rq_head),
                            .status = IBV_WC_WR_FLUSH_ERR,
                            .opcode = IBV_WC_RECV,
                            .qp_num = qp->ibqp.qp_num};
        cq_push(qp->rcq, &wc, NULL, 0, false);
        nic.stats.recvs_flushed++;
    }
}

/* ERR: every outstanding send, then every posted receive, completes with
 * IBV_WC_WR_FLUSH_ERR, in order. */
static void qp_to_error(nic_qp_t *qp)
{
    qp->ibqp.state = IBV_QPS_ERR;
    flush_sends(qp);
    flush_recvs(qp);
}

/* RESET: the queues are emptied without completions, as the verbs spec
 * has it (the CQEs already queued stay; the caller reaps them first). */
static void qp_to_reset(nic_qp_t *qp)
{
    nic.stats.wrs_flushed += qp->sq_tail - qp->sq_head;
    nic.stats.recvs_flushed += qp->rq_tail - qp->rq_head;
    qp->sq_freed = qp->sq_head = qp->sq_tail;
    qp->rq_head = qp->rq_tail;
    qp->ibqp.state = IBV_QPS_RESET;
}

/* The head WR failed: its error CQE (signaled or not), then the flush. */
static void fail_head(nic_qp_t *qp, enum ibv_wc_status status)
{
    complete_send(qp, qp->sq_head++, status);
    nic.stats.wrs_errored++;
    qp_to_error(qp);
}

/* ---- QPs ------------------------------------------------------------- */

static int check_qp_init_attr(const struct ibv_pd *pd, const struct ibv_qp_init_attr *a)
{
    const struct ibv_qp_cap *c = &a->cap;
    if (a->qp_type != IBV_QPT_RC || !a->send_cq || !a->recv_cq || a->srq)
        return EINVAL;
    if (a->send_cq->context != pd->context || a->recv_cq->context != pd->context)
        return EINVAL;
    if (c->max_send_wr > NIC_MAX_QP_WR || c->max_recv_wr > NIC_MAX_QP_WR ||
        c->max_send_sge > NIC_MAX_SGE || c->max_recv_sge > NIC_MAX_SGE || c->max_inline_data)
        return EINVAL;
    return 0;
}

static nic_qp_t *qp_alloc(const struct ibv_qp_cap *cap)
{
    nic_qp_t *qp = calloc(1, sizeof(*qp));
    if (!qp)
        return NULL;
    qp->sq_cap = cap->max_send_wr;
    qp->max_send_sge = cap->max_send_sge;
    qp->rq_cap = cap->max_recv_wr;
    qp->sq = calloc(ring_len(qp->sq_cap), sizeof(*qp->sq));
    qp->rq = calloc(ring_len(qp->rq_cap), sizeof(*qp->rq));
    if (!qp->sq || !qp->rq) {
        free(qp->sq);
        free(qp->rq);
        free(qp);
        return NULL;
    }
    return qp;
}

static void qp_free(nic_qp_t *qp)
{
    free(qp->sq);
    free(qp->rq);
    free(qp);
}

static struct ibv_qp *nic_create_qp(struct ibv_pd *ibpd, struct ibv_qp_init_attr *attr)
{
    int err = check_qp_init_attr(ibpd, attr);
    nic_qp_t *qp = err ? NULL : qp_alloc(&attr->cap);
    if (!qp)
        return fail_ptr(err ? err : ENOMEM);
    qp->pd = pd_of(ibpd);
    qp->dev = qp->pd->dev;
    qp->scq = cq_of(attr->send_cq);
    qp->rcq = cq_of(attr->recv_cq);
    qp->sig_all = attr->sq_sig_all != 0;
    qp->ibqp = (struct ibv_qp){.context = ibpd->context,
                               .qp_context = attr->qp_context,
                               .pd = ibpd,
                               .send_cq = attr->send_cq,
                               .recv_cq = attr->recv_cq,
                               .state = IBV_QPS_RESET,
                               .qp_type = IBV_QPT_RC};
    lock();
    if (qp->dev->num_qps >= NIC_MAX_QP) {
        unlock();
        qp_free(qp);
        return fail_ptr(ENOMEM);
    }
    qp->dev->num_qps++;
    qp->ibqp.handle = ++nic.next_handle;
    qp->ibqp.qp_num = next_qpn++ & NIC_PSN_MASK;
    NIC_PUSH(&nic.qps, qp);
    unlock();
    attr->cap.max_inline_data = 0;
    return &qp->ibqp;
}

static bool has_all(int mask, int need)
{
    return (mask & need) == need;
}

static int to_init(nic_qp_t *qp, const struct ibv_qp_attr *a, int mask)
{
    if (!has_all(mask, IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS) ||
        a->port_num != NIC_PORT)
        return EINVAL;
    qp->access = (int)a->qp_access_flags;
    qp->ibqp.state = IBV_QPS_INIT;
    return 0;
}

static int to_rtr(nic_qp_t *qp, const struct ibv_qp_attr *a, int mask)
{
    int need = IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
               IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER;
    /* RoCE has no LIDs: the address vector must carry a GRH. */
    if (!has_all(mask, need) || !a->ah_attr.is_global ||
        a->ah_attr.grh.sgid_index >= NIC_GID_TBL_LEN || a->path_mtu < IBV_MTU_256 ||
        a->path_mtu > IBV_MTU_4096)
        return EINVAL;
    qp->dest_qp_num = a->dest_qp_num & NIC_PSN_MASK;
    qp->path_mtu = a->path_mtu;
    qp->rq_psn = a->rq_psn & NIC_PSN_MASK;
    qp->ah = a->ah_attr;
    qp->min_rnr_timer = a->min_rnr_timer;
    qp->ibqp.state = IBV_QPS_RTR;
    return 0;
}

static int to_rts(nic_qp_t *qp, const struct ibv_qp_attr *a, int mask)
{
    int need = IBV_QP_SQ_PSN | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
               IBV_QP_MAX_QP_RD_ATOMIC;
    if (!has_all(mask, need))
        return EINVAL;
    qp->sq_psn = a->sq_psn & NIC_PSN_MASK;
    qp->timeout = a->timeout;
    qp->retry_cnt = a->retry_cnt & 7;
    qp->rnr_retry = a->rnr_retry & 7;
    qp->ibqp.state = IBV_QPS_RTS;
    return 0;
}

static int qp_transition(nic_qp_t *qp, const struct ibv_qp_attr *a, int mask)
{
    enum ibv_qp_state from = qp->ibqp.state, to = a->qp_state;
    if (!(mask & IBV_QP_STATE))
        return EINVAL; /* attribute-only modifies are not modelled */
    if (to == IBV_QPS_ERR) {
        qp_to_error(qp);
        return 0;
    }
    if (to == IBV_QPS_RESET) {
        qp_to_reset(qp);
        return 0;
    }
    if (from == IBV_QPS_RESET && to == IBV_QPS_INIT)
        return to_init(qp, a, mask);
    /* RoCE resolves the peer's address at RTR: with the link down there is
     * no route (rxe: ENETUNREACH). */
    if (from == IBV_QPS_INIT && to == IBV_QPS_RTR)
        return qp->dev->killed ? ENETUNREACH : to_rtr(qp, a, mask);
    if (from == IBV_QPS_RTR && to == IBV_QPS_RTS)
        return to_rts(qp, a, mask);
    return EINVAL;
}

static int nic_modify_qp(struct ibv_qp *ibqp, struct ibv_qp_attr *attr, int mask)
{
    lock();
    int rc = qp_transition(qp_of(ibqp), attr, mask);
    changed();
    unlock();
    return rc ? fail_rc(rc) : 0;
}

/* Outstanding WRs vanish without completions (counted as flushed), and so
 * do the QP's CQEs still queued, so nothing refers to it afterwards. */
static int nic_destroy_qp(struct ibv_qp *ibqp)
{
    nic_qp_t *qp = qp_of(ibqp);
    lock();
    nic.stats.wrs_flushed += qp->sq_tail - qp->sq_head;
    nic.stats.recvs_flushed += qp->rq_tail - qp->rq_head;
    cq_purge_qp(qp->scq, ibqp->qp_num);
    if (qp->rcq != qp->scq)
        cq_purge_qp(qp->rcq, ibqp->qp_num);
    NIC_UNLINK(&nic.qps, qp);
    qp->dev->num_qps--;
    changed();
    unlock();
    qp_free(qp);
    return 0;
}

/* ---- posting ----------------------------------------------------------- */

/* Index of the WR where an injected post failure hits this call, or -1. */
static long post_fault_index(const nic_qp_t *qp, const struct ibv_send_wr *wr)
{
    const fake_nic_faults_t *f = &nic.faults;
    if (!f->fail_post_call || !in_fault_scope(qp) || ++nic.fault_posts != f->fail_post_call)
        return -1;
    long last = -1;
    for (; wr; wr = wr->next)
        last++;
    return (long)f->fail_post_wr < last ? (long)f->fail_post_wr : last;
}

static int check_send_wr(const nic_qp_t *qp, const struct ibv_send_wr *w)
{
    const unsigned int flags = IBV_SEND_SIGNALED | IBV_SEND_SOLICITED | IBV_SEND_FENCE;
    if (qp->ibqp.state != IBV_QPS_RTS && qp->ibqp.state != IBV_QPS_ERR)
        return EINVAL;
    if (w->opcode != IBV_WR_RDMA_WRITE && w->opcode != IBV_WR_RDMA_WRITE_WITH_IMM)
        return EINVAL;
    if (w->num_sge < 0 || (uint32_t)w->num_sge > qp->max_send_sge || (w->num_sge && !w->sg_list))
        return EINVAL;
    if (w->send_flags & ~flags)
        return EINVAL; /* inline and the rest are not modelled */
    if (qp->sq_tail - qp->sq_freed >= qp->sq_cap)
        return ENOMEM;
    return 0;
}

static uint64_t injected_delay_ns(void)
{
    uint64_t us = nic.faults.delay_us;
    if (nic.faults.delay_jitter_us)
        us += next_random() % ((uint64_t)nic.faults.delay_jitter_us + 1);
    return us * 1000;
}

static void sq_push(nic_qp_t *qp, const struct ibv_send_wr *w, uint64_t now)
{
    nic_swr_t *s = sq_at(qp, qp->sq_tail++);
    *s = (nic_swr_t){.wr_id = w->wr_id,
                     .opcode = w->opcode,
                     .signaled = qp->sig_all || (w->send_flags & IBV_SEND_SIGNALED),
                     .solicited = (w->send_flags & IBV_SEND_SOLICITED) != 0,
                     .remote_addr = w->wr.rdma.remote_addr,
                     .rkey = w->wr.rdma.rkey,
                     .imm_data = w->imm_data,
                     .due_ns = now + injected_delay_ns()};
    if (w->num_sge >= 1) {
        s->local_addr = w->sg_list[0].addr;
        s->lkey = w->sg_list[0].lkey;
    }
    s->num_sge = (uint32_t)w->num_sge;
    for (int i = 0; i < w->num_sge; i++) {
        s->sge[i] = w->sg_list[i];
        s->len += w->sg_list[i].length;
    }
    nic.stats.wrs_accepted++;
}

static int nic_post_send(struct ibv_qp *ibqp, struct ibv_send_wr *wr, struct ibv_send_wr **bad_wr)
{
    nic_qp_t *qp = qp_of(ibqp);
    uint64_t now = now_ns();
    struct ibv_send_wr *w = wr;
    int rc = 0;
    lock();
    nic.stats.post_send_calls++;
    long fail_at = post_fault_index(qp, wr);
    for (long i = 0; w; w = w->next, i++) {
        rc = i == fail_at ? (nic.faults.fail_post_rc ? nic.faults.fail_post_rc : EIO)
                          : check_send_wr(qp, w);
        if (rc)
            break;
        sq_push(qp, w, now);
    }
    if (qp->ibqp.state == IBV_QPS_ERR)
        flush_sends(qp); /* hardware takes WRs in ERR and flushes them */
    changed();
    unlock();
    if (rc && bad_wr)
        *bad_wr = w;
    return rc ? fail_rc(rc) : 0;
}

static int check_recv_wr(const nic_qp_t *qp, const struct ibv_recv_wr *w)
{
    if (qp->ibqp.state == IBV_QPS_RESET)
        return EINVAL;
    if (w->num_sge < 0 || w->num_sge > 1 || (w->num_sge == 1 && !w->sg_list))
        return EINVAL;
    if (qp->rq_tail - qp->rq_head >= qp->rq_cap)
        return ENOMEM;
    return 0;
}

/* Index of the receive where an injected post_recv failure hits this
 * call, or -1. */
static long recv_fault_index(const nic_qp_t *qp, const struct ibv_recv_wr *wr)
{
    const fake_nic_faults_t *f = &nic.faults;
    if (!f->fail_recv_call || !in_fault_scope(qp) || ++nic.fault_recv_posts != f->fail_recv_call)
        return -1;
    long last = -1;
    for (; wr; wr = wr->next)
        last++;
    return (long)f->fail_recv_wr < last ? (long)f->fail_recv_wr : last;
}

static int nic_post_recv(struct ibv_qp *ibqp, struct ibv_recv_wr *wr, struct ibv_recv_wr **bad_wr)
{
    nic_qp_t *qp = qp_of(ibqp);
    struct ibv_recv_wr *w = wr;
    int rc = 0;
    lock();
    long fault_at = recv_fault_index(qp, wr);
    for (long i = 0; w; w = w->next, i++) {
        rc = i == fault_at ? ENOMEM : check_recv_wr(qp, w);
        if (rc)
            break;
        *rq_at(qp, qp->rq_tail++) = w->wr_id;
        nic.stats.recvs_posted++;
    }
    if (qp->ibqp.state == IBV_QPS_ERR)
        flush_recvs(qp);
    changed(); /* a sender may be waiting on RNR */
    unlock();
    if (rc && bad_wr)
        *bad_wr = w;
    return rc ? fail_rc(rc) : 0;
}

/* ---- the wire ---------------------------------------------------------- */

static nic_qp_t *find_qp(uint32_t qpn)
{
    for (nic_qp_t *q = nic.qps; q; q = q->next)
        if (q->ibqp.qp_num == qpn)
            return q;
    return NULL;
}

/* The QP qp's packets reach, or NULL when nothing would answer: no such
 * QP, a dead device, not ready to receive, a GID that is not its device's,
 * or a PSN out of sequence (the responder NAKs until retries run out). */
static nic_qp_t *reachable_remote(const nic_qp_t *qp)
{
    nic_qp_t *r = find_qp(qp->dest_qp_num);
    if (!r || r->dev->killed)
        return NULL;
    if (r->ibqp.state != IBV_QPS_RTR && r->ibqp.state != IBV_QPS_RTS)
        return NULL;
    if (!gid_belongs_to(r->dev, &qp->ah.grh.dgid) || r->rq_psn != qp->sq_psn)
        return NULL;
    return r;
}

static bool remote_has_recv(const nic_qp_t *qp)
{
    const nic_qp_t *r = find_qp(qp->dest_qp_num);
    return r && r->rq_head != r->rq_tail;
}

/* When qp's head WR may next be attempted; NIC_NEVER if it has none or
 * cannot send (not RTS, dead device, stalled by the faults). */
static uint64_t head_ready_time(const nic_qp_t *qp)
{
    if (qp->ibqp.state != IBV_QPS_RTS || qp->dev->killed || qp->sq_head == qp->sq_tail ||
        (nic.faults.stall_qp_num && nic.faults.stall_qp_num == qp->ibqp.qp_num))
        return NIC_NEVER;
    const nic_swr_t *w = sq_at(qp, qp->sq_head);
    if (w->rnr_waiting && remote_has_recv(qp))
        return w->due_ns; /* a receive was posted: retry now */
    return w->due_ns > w->retry_at_ns ? w->due_ns : w->retry_at_ns;
}

/* Whether qp still has a WR that will execute without outside help (a WR
 * RNR-retrying forever waits for a receive only the test can post). */
static bool qp_has_work(const nic_qp_t *qp)
{
    if (head_ready_time(qp) == NIC_NEVER)
        return false;
    const nic_swr_t *w = sq_at(qp, qp->sq_head);
    bool stalled = w->rnr_waiting && qp->rnr_retry == NIC_RNR_FOREVER && !remote_has_recv(qp) &&
                   reachable_remote(qp);
    return !stalled;
}

static bool any_work(void)
{
    for (const nic_qp_t *q = nic.qps; q; q = q->next)
        if (qp_has_work(q))
            return true;
    return false;
}

static enum ibv_wc_status injected_error(const nic_qp_t *qp, nic_swr_t *w)
{
    const fake_nic_faults_t *f = &nic.faults;
    if (w->counted)
        return IBV_WC_SUCCESS; /* a retry, already counted */
    w->counted = true;
    if (!f->error_wr || !in_fault_scope(qp) || ++nic.fault_execs != f->error_wr)
        return IBV_WC_SUCCESS;
    return f->error_status != IBV_WC_SUCCESS ? f->error_status : IBV_WC_REM_ACCESS_ERR;
}

static enum ibv_wc_status check_local(const nic_qp_t *qp, const nic_swr_t *w)
{
    if (w->len > nic.max_msg_sz)
        return IBV_WC_LOC_LEN_ERR;
    for (uint32_t i = 0; i < w->num_sge; i++)
        if (w->sge[i].length &&
            !find_mr(qp->pd, w->sge[i].lkey, false, w->sge[i].addr, w->sge[i].length, 0))
            return IBV_WC_LOC_PROT_ERR;
    return IBV_WC_SUCCESS;
}

static enum ibv_wc_status check_remote(const nic_qp_t *r, const nic_swr_t *w)
{
    if (!(r->access & IBV_ACCESS_REMOTE_WRITE))
        return IBV_WC_REM_ACCESS_ERR;
    /* A zero-length write touches no memory, so its rkey is not checked. */
    if (w->len && !find_mr(r->pd, w->rkey, true, w->remote_addr, w->len, IBV_ACCESS_REMOTE_WRITE))
        return IBV_WC_REM_ACCESS_ERR;
    return IBV_WC_SUCCESS;
}

/* Nobody answers: retry for retry_us, then give up like the transport
 * retry counter would. */
static void retry_unreachable(nic_qp_t *qp, nic_swr_t *w, uint64_t now)
{
    if (!w->unreachable) {
        w->unreachable = true;
        w->unreachable_since_ns = now;
    }
    if (now - w->unreachable_since_ns >= nic.retry_ns)
        fail_head(qp, IBV_WC_RETRY_EXC_ERR);
    else
        w->retry_at_ns = w->unreachable_since_ns + nic.retry_ns;
}

/* The responder has no receive for the immediate. rnr_retry 7 waits
 * forever (the WR stays at the head and blocks the QP); otherwise the first
 * attempt plus rnr_retry retries, then RNR_RETRY_EXC_ERR. */
static void rnr_nak(nic_qp_t *qp, nic_swr_t *w, uint64_t now)
{
    if (qp->rnr_retry != NIC_RNR_FOREVER && w->rnr_naks++ >= qp->rnr_retry) {
        fail_head(qp, IBV_WC_RNR_RETRY_EXC_ERR);
        return;
    }
    w->rnr_waiting = true;
    w->retry_at_ns = now + nic.rnr_delay_ns;
}

static uint32_t packets(const nic_qp_t *qp, uint32_t len)
{
    uint32_t mtu = 128u << qp->path_mtu; /* IBV_MTU_256 is 1 */
    return len ? (len + mtu - 1) / mtu : 1;
}

static void consume_recv(nic_qp_t *r, const nic_qp_t *from, const nic_swr_t *w)
{
    struct ibv_wc wc = {.wr_id = *rq_at(r, r->rq_head++),
                        .status = IBV_WC_SUCCESS,
                        .opcode = IBV_WC_RECV_RDMA_WITH_IMM,
                        .byte_len = w->len,
                        .imm_data = w->imm_data,
                        .qp_num = r->ibqp.qp_num,
                        .src_qp = from->ibqp.qp_num,
                        .wc_flags = IBV_WC_WITH_IMM};
    nic.stats.recvs_consumed++;
    cq_push(r->rcq, &wc, NULL, 0, w->solicited);
}

/* The flip_byte fault: invert one byte of the len just placed at addr if
 * the count reaches it within them. */
static void flip_in_flight(const nic_qp_t *qp, uint64_t addr, uint64_t len)
{
    uint64_t want = nic.faults.flip_byte;
    if (!want || !len || !in_fault_scope(qp))
        return;
    uint64_t before = nic.fault_bytes;
    nic.fault_bytes += len;
    if (want <= before || want > nic.fault_bytes)
        return;
    ((uint8_t *)(uintptr_t)addr)[want - before - 1] ^= 0xff;
    nic.stats.bytes_flipped++;
}

/* Success: place the bytes, then the receive's and our own completions. */
static void deliver(nic_qp_t *qp, nic_qp_t *r, nic_swr_t *w)
{
    uint64_t at = w->remote_addr; /* the entries, gathered in order */
    for (uint32_t i = 0; i < w->num_sge; i++) {
        if (w->sge[i].length)
            memmove((void *)(uintptr_t)at, (const void *)(uintptr_t)w->sge[i].addr,
                    w->sge[i].length);
        at += w->sge[i].length;
    }
    flip_in_flight(qp, w->remote_addr, w->len);
    nic.stats.bytes_written += w->len;
    uint32_t n = packets(qp, w->len);
    qp->sq_psn = (qp->sq_psn + n) & NIC_PSN_MASK;
    r->rq_psn = (r->rq_psn + n) & NIC_PSN_MASK;
    if (w->opcode == IBV_WR_RDMA_WRITE_WITH_IMM)
        consume_recv(r, qp, w);
    uint64_t seq = qp->sq_head++;
    nic.stats.wrs_succeeded++;
    if (w->signaled)
        complete_send(qp, seq, IBV_WC_SUCCESS);
}

static void execute_head(nic_qp_t *qp, uint64_t now)
{
    nic_swr_t *w = sq_at(qp, qp->sq_head);
    enum ibv_wc_status st = injected_error(qp, w);
    if (st == IBV_WC_SUCCESS)
        st = check_local(qp, w);
    if (st != IBV_WC_SUCCESS) {
        fail_head(qp, st);
        return;
    }
    nic_qp_t *r = reachable_remote(qp);
    if (!r) {
        retry_unreachable(qp, w, now);
        return;
    }
    w->unreachable = false;
    st = check_remote(r, w);
    if (st != IBV_WC_SUCCESS)
        fail_head(qp, st);
    else if (w->opcode == IBV_WR_RDMA_WRITE_WITH_IMM && r->rq_head == r->rq_tail)
        rnr_nak(qp, w, now);
    else
        deliver(qp, r, w);
}

/* The QP whose head WR has waited longest among those due now; *wake
 * gets the earliest later due time. */
static nic_qp_t *next_ready(uint64_t now, uint64_t *wake)
{
    nic_qp_t *best = NULL;
    uint64_t best_t = NIC_NEVER;
    for (nic_qp_t *q = nic.qps; q; q = q->next) {
        uint64_t t = head_ready_time(q);
        if (t <= now && t < best_t) {
            best = q;
            best_t = t;
        } else if (t > now && t < *wake) {
            *wake = t;
        }
    }
    return best;
}

static void *wire_main(void *arg)
{
    (void)arg;
    lock();
    while (!nic.stop) {
        uint64_t now = now_ns(), wake = NIC_NEVER;
        late_acks(now, &wake);
        nic_qp_t *qp = next_ready(now, &wake);
        if (qp) {
            execute_head(qp, now);
            changed();
            /* Let posters and pollers in between WRs, as a NIC would. */
            unlock();
            sched_yield();
            lock();
            continue;
        }
        wait_changed(wake);
    }
    unlock();
    return NULL;
}

/* ---- control ----------------------------------------------------------- */

static int init_state(const fake_nic_config_t *c, int n)
{
    memset(&nic, 0, sizeof(nic));
    nic.max_msg_sz = c->max_msg_sz ? c->max_msg_sz : NIC_DEFAULT_MAX_MSG;
    nic.max_qp_wr = c->max_qp_wr ? (int)c->max_qp_wr : NIC_MAX_QP_WR;
    nic.no_dmabuf = c->no_dmabuf != 0;
    nic.retry_ns = (uint64_t)c->retry_us * 1000;
    nic.rnr_delay_ns =
        (uint64_t)(c->rnr_delay_us ? c->rnr_delay_us : NIC_DEFAULT_RNR_DELAY_US) * 1000;
    nic.rng = 0x9e3779b97f4a7c15ull;
    int err = init_devices(c, n);
    if (err)
        return err;
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    err = pthread_cond_init(&nic.changed, &ca);
    pthread_condattr_destroy(&ca);
    if (err)
        return err;
    err = pthread_create(&nic.wire, NULL, wire_main, NULL);
    if (err)
        pthread_cond_destroy(&nic.changed);
    return err;
}

int fake_nic_init(const fake_nic_config_t *cfg)
{
    fake_nic_config_t c = cfg ? *cfg : (fake_nic_config_t){0};
    int n = c.num_devices ? c.num_devices : NIC_DEFAULT_DEVICES;
    int err = n >= 1 && n <= FAKE_NIC_MAX_DEVICES ? 0 : EINVAL;
    lock();
    if (!err && nic.up)
        err = EBUSY;
    else if (!err && (err = init_state(&c, n)) != 0) {
        free(nic.devs);
        memset(&nic, 0, sizeof(nic));
    }
    if (!err)
        nic.up = true;
    unlock();
    if (err) {
        errno = err;
        return -1;
    }
    return 0;
}

static void free_all(void)
{
    while (nic.qps) {
        nic_qp_t *q = nic.qps;
        nic.qps = q->next;
        qp_free(q);
    }
    while (nic.cqs) {
        nic_cq_t *c = nic.cqs;
        nic.cqs = c->next;
        free(c->ring);
        free(c);
    }
    while (nic.chans) {
        nic_chan_t *ch = nic.chans;
        nic.chans = ch->next;
        chan_free(ch);
    }
    while (nic.mrs) {
        nic_mr_t *m = nic.mrs;
        nic.mrs = m->next;
        free(m);
    }
    while (nic.pds) {
        nic_pd_t *p = nic.pds;
        nic.pds = p->next;
        free(p);
    }
    while (nic.ctxs) {
        nic_ctx_t *c = nic.ctxs;
        nic.ctxs = c->next;
        close(c->ibctx.async_fd);
        close(c->async_wr);
        free(c);
    }
    free(nic.devs);
}

void fake_nic_fini(void)
{
    lock();
    if (!nic.up) {
        unlock();
        return;
    }
    nic.stop = true;
    changed();
    unlock();
    pthread_join(nic.wire, NULL);
    lock();
    free_all();
    pthread_cond_destroy(&nic.changed);
    memset(&nic, 0, sizeof(nic));
    unlock();
}

void fake_nic_set_faults(const fake_nic_faults_t *faults)
{
    lock();
    nic.faults = faults ? *faults : (fake_nic_faults_t){0};
    nic.fault_posts = nic.fault_execs = nic.fault_recv_posts = nic.fault_bytes = 0;
    nic.rng = nic.faults.seed ? nic.faults.seed : 0x9e3779b97f4a7c15ull;
    changed();
    unlock();
}

static int set_killed(const char *name, bool killed)
{
    int rc = -1;
    lock();
    for (int i = 0; nic.up && i < nic.num_devs && rc; i++)
        if (strcmp(nic.devs[i].ibdev.name, name) == 0) {
            nic.devs[i].killed = killed;
            rc = 0;
        }
    changed();
    unlock();
    return rc;
}

int fake_nic_kill_device(const char *name)
{
    return set_killed(name, true);
}

uint8_t fake_nic_peek(const void *addr)
{
    lock(); /* the wire thread writes memory with the lock held */
    uint8_t v = *(const volatile uint8_t *)addr;
    unlock();
    return v;
}

int fake_nic_revive_device(const char *name)
{
    return set_killed(name, false);
}

void fake_nic_stats(fake_nic_stats_t *out)
{
    lock();
    *out = nic.stats;
    out->wrs_outstanding =
        out->wrs_accepted - out->wrs_succeeded - out->wrs_errored - out->wrs_flushed;
    for (const nic_ctx_t *c = nic.ctxs; c; c = c->next)
        out->live_contexts++;
    for (const nic_pd_t *p = nic.pds; p; p = p->next)
        out->live_pds++;
    for (const nic_mr_t *m = nic.mrs; m; m = m->next)
        out->live_mrs++;
    for (const nic_chan_t *ch = nic.chans; ch; ch = ch->next)
        out->live_channels++;
    for (const nic_cq_t *c = nic.cqs; c; c = c->next)
        out->live_cqs++;
    for (const nic_qp_t *q = nic.qps; q; q = q->next)
        out->live_qps++;
    unlock();
}

int fake_nic_mr_access(const void *addr)
{
    int access = -1;
    uint64_t a = (uint64_t)(uintptr_t)addr;
    lock();
    for (const nic_mr_t *m = nic.mrs; m && access < 0; m = m->next) {
        uint64_t start = (uint64_t)(uintptr_t)m->ibmr.addr;
        if (a >= start && a - start < m->ibmr.length)
            access = m->access;
    }
    unlock();
    return access;
}

int fake_nic_qp_access(uint32_t qp_num)
{
    int access = -1;
    lock();
    for (const nic_qp_t *q = nic.qps; q && access < 0; q = q->next)
        if (q->ibqp.qp_num == qp_num)
            access = q->access;
    unlock();
    return access;
}

int fake_nic_qp_ah(uint32_t qp_num, struct ibv_ah_attr *ah_p)
{
    int rc = -1;
    lock();
    for (const nic_qp_t *q = nic.qps; q && rc < 0; q = q->next)
        if (q->ibqp.qp_num == qp_num && q->ibqp.state != IBV_QPS_RESET &&
            q->ibqp.state != IBV_QPS_INIT) {
            *ah_p = q->ah;
            rc = 0;
        }
    unlock();
    return rc;
}

int fake_nic_quiesce(int timeout_ms)
{
    uint64_t deadline = now_ns() + (uint64_t)(timeout_ms > 0 ? timeout_ms : 0) * 1000000ull;
    int rc = 0;
    lock();
    while (nic.up && any_work()) {
        if (now_ns() >= deadline) {
            rc = -1;
            break;
        }
        wait_changed(deadline);
    }
    unlock();
    return rc;
}

/* Fork protection as libibverbs keeps it: process-wide, and too late once
 * memory was registered (EINVAL, as rdma-core answers then). */
static enum ibv_fork_status fork_status = IBV_FORK_DISABLED;

void fake_nic_set_fork_status(enum ibv_fork_status s)
{
    lock();
    fork_status = s;
    unlock();
}

static int nic_fork_init(void)
{
    lock();
    int rc = 0;
    nic.stats.fork_init_calls++;
    if (nic.mrs && fork_status == IBV_FORK_DISABLED)
        rc = EINVAL;
    else if (fork_status == IBV_FORK_DISABLED)
        fork_status = IBV_FORK_ENABLED;
    unlock();
    return rc;
}

static enum ibv_fork_status nic_is_fork_initialized(void)
{
    lock();
    enum ibv_fork_status s = fork_status;
    unlock();
    return s;
}

const kvw_verbs_ops_t fake_nic_ops = {
    .get_device_list = nic_get_device_list,
    .free_device_list = nic_free_device_list,
    .get_device_name = nic_get_device_name,
    .open_device = nic_open_device,
    .close_device = nic_close_device,
    .device_for_ip = nic_device_for_ip,
    .query_device = nic_query_device,
    .query_port = nic_query_port,
    .query_gid_ex = nic_query_gid_ex,
    .alloc_pd = nic_alloc_pd,
    .dealloc_pd = nic_dealloc_pd,
    .reg_mr = nic_reg_mr,
    .reg_dmabuf_mr = nic_reg_dmabuf_mr,
    .dereg_mr = nic_dereg_mr,
    .create_comp_channel = nic_create_comp_channel,
    .destroy_comp_channel = nic_destroy_comp_channel,
    .create_cq = nic_create_cq,
    .destroy_cq = nic_destroy_cq,
    .req_notify_cq = nic_req_notify_cq,
    .get_cq_event = nic_get_cq_event,
    .ack_cq_events = nic_ack_cq_events,
    .create_qp = nic_create_qp,
    .modify_qp = nic_modify_qp,
    .destroy_qp = nic_destroy_qp,
    .post_send = nic_post_send,
    .post_recv = nic_post_recv,
    .poll_cq = nic_poll_cq,
    .fork_init = nic_fork_init,
    .is_fork_initialized = nic_is_fork_initialized,
    .get_async_event = nic_get_async_event,
    .ack_async_event = nic_ack_async_event,
};
