/* SPDX-License-Identifier: Apache-2.0 */
#include "mem/mem.h"

#include "common/config.h"
#include "common/log.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <sys/resource.h>
#include <unistd.h>

static const char *const path_names[KVW_MEM_NUM_PATHS] = {"host", "dmabuf", "peermem", "staging"};

const char *kvw__mem_path_name(kvw_mem_path_t path)
{
    return (unsigned)path < KVW_MEM_NUM_PATHS ? path_names[path] : "?";
}

/* ---- deciding --------------------------------------------------------------- */

static void append(char *buf, size_t size, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void append(char *buf, size_t size, const char *fmt, ...)
{
    size_t used = strnlen(buf, size);
    if (used + 1 >= size)
        return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf + used, size - used, fmt, ap);
    va_end(ap);
}

/* Why this memory cannot be given to the NIC as GPU memory at all (by
 * either GPUDirect path), or NULL. */
static const char *gpudirect_blocker(const kvw_mem_facts_t *f)
{
    if (f->ptr.type == KVW_CUDA_PTR_MANAGED)
        return "managed memory (cudaMallocManaged) cannot be registered for GPUDirect RDMA; "
               "allocate KV memory with cudaMalloc, or cuMemCreate with "
               "allocFlags.gpuDirectRDMACapable = 1";
    if (f->ptr.vmm && f->ptr.rdma_capable == 0)
        return "a VMM allocation (cuMemCreate/cuMemMap, e.g. PyTorch expandable_segments) made "
               "without allocFlags.gpuDirectRDMACapable = 1; set that flag (the GPU must report "
               "GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED), or turn expandable segments off "
               "(PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False)";
    if (f->gpu && f->gpu->gdr == 0)
        return "the GPU does not support GPUDirect RDMA "
               "(CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED = 0)";
    return NULL;
}

static const char *dmabuf_blocker(const kvw_mem_facts_t *f)
{
    if (f->gpu && f->gpu->dmabuf == 0)
        return "the GPU driver does not offer dma-buf (CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED = "
               "0: needs the open GPU kernel modules, CUDA >= 11.7 and Linux >= 5.12)";
    if (f->nic_dmabuf == 0)
        return f->nic_dmabuf_why && *f->nic_dmabuf_why
                   ? f->nic_dmabuf_why
                   : "the NIC or its driver refuses dma-buf (needs rdma-core >= 34, Linux >= "
                     "5.12 and a NIC driver with dma-buf support, e.g. mlx5)";
    if (f->past_allocation)
        return "the region runs past the end of its CUDA allocation (one dma-buf covers one "
               "allocation: register each allocation as its own region)";
    return NULL;
}

static const char *peermem_blocker(const kvw_mem_facts_t *f)
{
    if (!f->peermem)
        return "nvidia_peermem is not loaded ('sudo modprobe nvidia_peermem')";
    return NULL;
}

static kvw_mem_path_t forced(const kvw_mem_facts_t *f, char *reason, size_t size)
{
    const char *no = f->force == KVW_MEM_PATH_DMABUF    ? dmabuf_blocker(f)
                     : f->force == KVW_MEM_PATH_PEERMEM ? peermem_blocker(f)
                                                        : NULL;
    append(reason, size, "forced by KVW_GPU_PATH=%s", path_names[f->force]);
    if (no)
        append(reason, size, " (detection says: %s)", no);
    return (kvw_mem_path_t)f->force;
}

kvw_mem_path_t kvw__mem_choose(const kvw_mem_facts_t *f, char *reason, size_t size)
{
    reason[0] = '\0';
    if (f->ptr.type != KVW_CUDA_PTR_DEVICE && f->ptr.type != KVW_CUDA_PTR_MANAGED) {
        append(reason, size, "%s memory",
               f->ptr.type == KVW_CUDA_PTR_PINNED ? "CUDA pinned host" : "host");
        return KVW_MEM_PATH_HOST;
    }
    if (f->force > KVW_MEM_PATH_HOST)
        return forced(f, reason, size);
    const char *all = gpudirect_blocker(f);
    if (all) {
        append(reason, size, "no GPUDirect: %s", all);
        return KVW_MEM_PATH_STAGING;
    }
    const char *no_dmabuf = dmabuf_blocker(f);
    if (!no_dmabuf) {
        append(reason, size, "dma-buf: the GPU exports it and the NIC takes it");
        return KVW_MEM_PATH_DMABUF;
    }
    const char *no_peermem = peermem_blocker(f);
    if (!no_peermem) {
        append(reason, size, "nvidia_peermem is loaded; not dma-buf: %s", no_dmabuf);
        return KVW_MEM_PATH_PEERMEM;
    }
    append(reason, size, "not dma-buf: %s; not nvidia_peermem: %s", no_dmabuf, no_peermem);
    return KVW_MEM_PATH_STAGING;
}

void kvw__mem_export_range(uint64_t addr, size_t len, uint64_t base, uint64_t size, uint64_t page,
                           uint64_t *start_p, size_t *len_p)
{
    uint64_t start = addr & ~(page - 1);
    uint64_t end = (addr + len + page - 1) & ~(page - 1);
    if (size) {
        /* The page rounding may reach past the allocation's ends: clamp,
         * since the driver exports only memory of this allocation. */
        if (start < base)
            start = base;
        if (end > base + size)
            end = base + size;
    }
    *start_p = start;
    *len_p = (size_t)(end > start ? end - start : 0);
}

kvw_status_t kvw__mem_ctx_init(kvw_mem_ctx_t *m, const kvw_config_t *cfg)
{
    memset(m, 0, sizeof(*m));
    m->force = -1;
    m->flush = -1;
    m->relaxed = -1;
    m->nic_dmabuf = -1;
    if (!cfg)
        return KVW_OK;
    m->force = kvw__config_gpu_path(cfg);
    m->flush = cfg->gpu_flush;
    m->relaxed = cfg->gpu_relaxed_ordering;
    if (m->force < -1) {
        KVW_ERROR("config: gpu_path (KVW_GPU_PATH) '%.15s' is not one of auto, dmabuf, peermem, "
                  "staging",
                  cfg->gpu_path);
        m->force = -1;
        return KVW_ERR_INVALID;
    }
    return KVW_OK;
}

/* Does the NIC take dma-bufs? Registering fd -1 with no memory answers
 * without touching memory: EBADF means it would, EOPNOTSUPP or
 * EPROTONOSUPPORT that it will not (NCCL's probe). */
static void probe_nic_dmabuf(kvw_mem_ctx_t *m, kvw_dev_t *dev)
{
    if (m->nic_dmabuf >= 0)
        return;
    errno = 0;
    struct ibv_mr *mr = dev->ops->reg_dmabuf_mr(dev->pd, 0, 0, 0, -1, 0);
    int err = errno;
    if (mr) { /* cannot happen with fd -1, but never leak an MR */
        dev->ops->dereg_mr(mr);
        err = EBADF;
    }
    m->nic_dmabuf = !(err == EOPNOTSUPP || err == EPROTONOSUPPORT || err == ENOSYS);
    if (!m->nic_dmabuf)
        snprintf(m->nic_dmabuf_why, sizeof(m->nic_dmabuf_why),
                 "%s refuses dma-buf registration (%s)", dev->name, strerror(err));
}

/* Auto flush: GPUs before compute capability 9.0 do not order the NIC's
 * writes for their own kernels (NCCL flushes there only). */
static bool wants_flush(const kvw_mem_ctx_t *m, const kvw_cuda_dev_t *gpu)
{
    if (m->flush >= 0)
        return m->flush == 1;
    if (gpu->writes_ordering >= 0)
        return gpu->writes_ordering < 100; /* CU_GPU_DIRECT_RDMA_WRITES_ORDERING_OWNER */
    return gpu->cc_major < 9;
}

static void set_plan_flush(const kvw_mem_ctx_t *m, const kvw_cuda_dev_t *gpu, bool remote_write,
                           kvw_mem_plan_t *p)
{
    bool gpudirect = p->path == KVW_MEM_PATH_DMABUF || p->path == KVW_MEM_PATH_PEERMEM;
    p->flush = gpudirect && remote_write && wants_flush(m, gpu);
}

kvw_status_t kvw__mem_decide(kvw_mem_ctx_t *m, kvw_dev_t *dev, const void *addr, size_t len,
                             bool remote_write, kvw_mem_plan_t *plan_p)
{
    if (!addr || !len) {
        KVW_ERROR("cannot register an empty region (addr %p, len %zu)", addr, len);
        return KVW_ERR_INVALID;
    }
    const kvw_cuda_ops_t *cuda = kvw__cuda_ops();
    kvw_mem_plan_t p;
    memset(&p, 0, sizeof(p));
    char why[160] = "";
    if (cuda->pointer_info(addr, &p.ptr, why, sizeof(why))) {
        /* The driver is there but cannot say: register as host memory, and
         * say so if that fails (see explain_host_failure). */
        p.ptr = (kvw_cuda_ptr_t){.type = KVW_CUDA_PTR_HOST, .device = -1, .rdma_capable = -1};
        snprintf(p.reason, sizeof(p.reason), "host memory? CUDA could not classify it: %s", why);
        *plan_p = p;
        return KVW_OK;
    }
    kvw_cuda_dev_t gpu = {.dmabuf = -1, .gdr = -1, .vmm_gdr = -1, .writes_ordering = -1};
    bool on_gpu = p.ptr.type == KVW_CUDA_PTR_DEVICE || p.ptr.type == KVW_CUDA_PTR_MANAGED;
    if (on_gpu && cuda->device_info(p.ptr.device, &gpu, why, sizeof(why)))
        KVW_WARN("GPU %d: cannot query its GPUDirect attributes (%s); assuming it has them",
                 p.ptr.device, why);
    uint64_t a = (uint64_t)(uintptr_t)addr;
    bool past = p.ptr.size && (a < p.ptr.base || a - p.ptr.base + len > p.ptr.size);
    if (on_gpu)
        probe_nic_dmabuf(m, dev);
    kvw_mem_facts_t f = {.force = m->force,
                         .ptr = p.ptr,
                         .gpu = on_gpu ? &gpu : NULL,
                         .past_allocation = past,
                         .nic_dmabuf = m->nic_dmabuf,
                         .nic_dmabuf_why = m->nic_dmabuf_why,
                         .peermem = on_gpu && cuda->peermem_loaded()};
    p.path = kvw__mem_choose(&f, p.reason, sizeof(p.reason));
    kvw__mem_export_range(a, len, p.ptr.base, p.ptr.size, (uint64_t)sysconf(_SC_PAGESIZE), &p.start,
                          &p.len);
    if (on_gpu)
        set_plan_flush(m, &gpu, remote_write, &p);
    *plan_p = p;
    return KVW_OK;
}

/* ---- registering ------------------------------------------------------------- */

static int mr_access(const kvw_mem_ctx_t *m, bool remote_write, bool gpu)
{
    int access = IBV_ACCESS_LOCAL_WRITE | (remote_write ? IBV_ACCESS_REMOTE_WRITE : 0);
    /* An optional flag (IBV_ACCESS_OPTIONAL_RANGE): libibverbs drops it on
     * kernels that cannot pass it, and NICs without it ignore it. */
    if (m->relaxed == 1 || (m->relaxed == -1 && gpu))
        access |= IBV_ACCESS_RELAXED_ORDERING;
    return access;
}

static void explain_host_failure(const kvw_dev_t *dev, const kvw_mem_plan_t *p, size_t len, int err)
{
    struct rlimit rl = {0, 0};
    getrlimit(RLIMIT_MEMLOCK, &rl);
    char cuda_why[160] = "";
    if (kvw__cuda_ops()->init(cuda_why, sizeof(cuda_why)) == 0)
        cuda_why[0] = '\0';
    if (err == ENOMEM && rl.rlim_cur != RLIM_INFINITY)
        KVW_ERROR("%s: cannot register %zu bytes: locked-memory limit is %llu bytes; run "
                  "'ulimit -l unlimited' (or raise memlock in limits.conf)",
                  dev->name, len, (unsigned long long)rl.rlim_cur);
    else if (strstr(p->reason, "CUDA could not classify"))
        KVW_ERROR("%s: ibv_reg_mr(%zu bytes) failed: %s; if this is GPU memory: %s", dev->name, len,
                  strerror(err), p->reason);
    else if (cuda_why[0] && (err == EFAULT || err == EINVAL))
        KVW_ERROR("%s: ibv_reg_mr(%zu bytes) failed: %s; if this is GPU memory, CUDA was not "
                  "usable to detect it: %s",
                  dev->name, len, strerror(err), cuda_why);
    else
        KVW_ERROR("%s: ibv_reg_mr(%zu bytes) failed: %s", dev->name, len, strerror(err));
}

static struct ibv_mr *register_dmabuf(kvw_dev_t *dev, const kvw_mem_plan_t *p, void *addr,
                                      size_t len, int access, char *why, size_t size)
{
    int fd = -1;
    if (kvw__cuda_ops()->dmabuf_export(p->ptr.ctx, p->start, p->len, &fd, why, size))
        return NULL;
    uint64_t iova = (uint64_t)(uintptr_t)addr;
    struct ibv_mr *mr = dev->ops->reg_dmabuf_mr(dev->pd, iova - p->start, len, iova, fd, access);
    int err = errno;
    close(fd); /* the MR holds its own reference to the dma-buf */
    if (!mr)
        snprintf(why, size, "ibv_reg_dmabuf_mr: %s", strerror(err));
    return mr;
}

static struct ibv_mr *register_gpu(kvw_mem_ctx_t *m, kvw_dev_t *dev, kvw_mem_plan_t *p, void *addr,
                                   size_t len, int access)
{
    char why[192] = "";
    if (p->path == KVW_MEM_PATH_DMABUF) {
        struct ibv_mr *mr = register_dmabuf(dev, p, addr, len, access, why, sizeof(why));
        if (mr || m->force == KVW_MEM_PATH_DMABUF || !kvw__cuda_ops()->peermem_loaded()) {
            if (!mr)
                KVW_ERROR("%s: GPU %d: dma-buf registration of %zu bytes failed: %s", dev->name,
                          p->ptr.device, len, why);
            return mr;
        }
        /* The probe passed yet this region failed: nvidia_peermem may. */
        KVW_WARN("%s: GPU %d: dma-buf registration failed (%s); trying nvidia_peermem", dev->name,
                 p->ptr.device, why);
        p->path = KVW_MEM_PATH_PEERMEM;
    }
    struct ibv_mr *mr = dev->ops->reg_mr(dev->pd, addr, len, access);
    if (!mr)
        KVW_ERROR("%s: GPU %d: ibv_reg_mr of GPU memory through nvidia_peermem failed: %s%s",
                  dev->name, p->ptr.device, strerror(errno),
                  kvw__cuda_ops()->peermem_loaded()
                      ? ""
                      : " (nvidia_peermem is not loaded: 'sudo modprobe nvidia_peermem')");
    return mr;
}

static void log_choice_once(kvw_mem_ctx_t *m, const kvw_dev_t *dev, const kvw_mem_plan_t *p)
{
    if (m->logged & (1u << p->path))
        return;
    m->logged |= 1u << p->path;
    if (p->path == KVW_MEM_PATH_HOST)
        KVW_DEBUG("%s: host regions: ibv_reg_mr (%s)", dev->name, p->reason);
    else
        KVW_INFO("%s: GPU %d regions: %s (%s)", dev->name, p->ptr.device,
                 kvw__mem_path_name(p->path), p->reason);
}

/* Remember the region's context for kvw__mem_flush_gpu_writes, once. */
static kvw_status_t add_flush(kvw_mem_ctx_t *m, const kvw_mem_plan_t *p)
{
    for (int i = 0; i < m->nflush; i++)
        if (m->flush_ctx[i] == p->ptr.ctx)
            return KVW_OK;
    if (m->nflush == KVW_MEM_MAX_FLUSH) {
        KVW_ERROR("decode regions span more than %d GPUs to flush", KVW_MEM_MAX_FLUSH);
        return KVW_ERR_LIMIT;
    }
    m->flush_ctx[m->nflush++] = p->ptr.ctx;
    KVW_INFO("GPU %d: decode flushes GPUDirect writes before Success (%s; KVW_GPU_FLUSH=0 "
             "turns it off)",
             p->ptr.device,
             m->flush == 1 ? "KVW_GPU_FLUSH=1" : "the GPU does not order them for its kernels");
    return KVW_OK;
}

kvw_status_t kvw__mem_register_in(kvw_mem_ctx_t *m, kvw_dev_t *dev, void *addr, size_t len,
                                  bool remote_write, kvw_mr_t *mr_p)
{
    kvw_mem_plan_t p;
    kvw_status_t st = kvw__mem_decide(m, dev, addr, len, remote_write, &p);
    if (st)
        return st;
    log_choice_once(m, dev, &p);
    if (p.path == KVW_MEM_PATH_STAGING) {
        *mr_p = (kvw_mr_t){.addr = (uint64_t)(uintptr_t)addr,
                           .len = len,
                           .kind = KVW_MEM_CUDA,
                           .path = p.path,
                           .cuda_ctx = p.ptr.ctx};
        return KVW_OK; /* nothing to register: the engine stages it */
    }
    bool gpu = p.path != KVW_MEM_PATH_HOST;
    kvw_mr_t r = {.addr = (uint64_t)(uintptr_t)addr,
                  .len = len,
                  .kind = gpu ? KVW_MEM_CUDA : KVW_MEM_HOST,
                  .path = p.path,
                  .cuda_ctx = gpu ? p.ptr.ctx : NULL};
    int access = mr_access(m, remote_write, gpu);
    if (gpu) {
        r.mr = register_gpu(m, dev, &p, addr, len, access);
        r.path = p.path;
    } else {
        r.mr = dev->ops->reg_mr(dev->pd, addr, len, access);
        if (!r.mr)
            explain_host_failure(dev, &p, len, errno);
    }
    if (!r.mr)
        return KVW_ERR_REGISTER;
    if (p.flush && (st = add_flush(m, &p)) != KVW_OK) {
        dev->ops->dereg_mr(r.mr);
        return st;
    }
    r.lkey = r.mr->lkey;
    r.rkey = r.mr->rkey;
    *mr_p = r;
    return KVW_OK;
}

kvw_status_t kvw__mem_register_rails(kvw_mem_ctx_t *m, kvw_dev_t *const *devs, uint32_t n,
                                     void *addr, size_t len, bool remote_write, kvw_mr_t *mrs_p)
{
    for (uint32_t k = 0; k < n; k++) {
        kvw_status_t st = kvw__mem_register_in(m, devs[k], addr, len, remote_write, &mrs_p[k]);
        if (!st && n > 1 && mrs_p[k].path == KVW_MEM_PATH_STAGING) {
            KVW_ERROR("a region at %p takes the staging path, which one engine on %u devices "
                      "(KVW_DEVICES) does not support: name one device, or make the GPU memory "
                      "reachable by the NICs (dma-buf or nvidia_peermem)",
                      addr, n);
            st = KVW_ERR_UNSUPPORTED;
        }
        if (st) {
            for (uint32_t j = 0; j < k; j++)
                kvw__mem_deregister(devs[j], &mrs_p[j]);
            return st;
        }
    }
    return KVW_OK;
}

kvw_status_t kvw__mem_register(kvw_dev_t *dev, void *addr, size_t len, bool remote_write,
                               kvw_mr_t *mr_p)
{
    kvw_mem_ctx_t m;
    kvw__mem_ctx_init(&m, NULL);
    return kvw__mem_register_in(&m, dev, addr, len, remote_write, mr_p);
}

void kvw__mem_deregister(kvw_dev_t *dev, kvw_mr_t *mr)
{
    if (mr && mr->mr) {
        dev->ops->dereg_mr(mr->mr);
        mr->mr = NULL;
    }
}

kvw_status_t kvw__mem_flush_gpu_writes(const kvw_mem_ctx_t *m)
{
    for (int i = 0; i < m->nflush; i++) {
        char why[160] = "";
        if (kvw__cuda_ops()->flush_writes(m->flush_ctx[i], why, sizeof(why))) {
            KVW_ERROR("cannot flush GPUDirect writes before Success: %s", why);
            return KVW_ERR_TRANSFER;
        }
    }
    return KVW_OK;
}
