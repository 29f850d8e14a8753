#include "mem/mem.h"

#include "common/log.h"

#include <errno.h>
#include <string.h>
#include <sys/resource.h>
#include <unistd.h>

static int mr_access(bool remote_write)
{
    return IBV_ACCESS_LOCAL_WRITE | (remote_write ? IBV_ACCESS_REMOTE_WRITE : 0);
}

static void explain_host_failure(const kvw_dev_t *dev, size_t len, int err)
{
    struct rlimit rl = {0, 0};
    getrlimit(RLIMIT_MEMLOCK, &rl);
    if (err == ENOMEM && rl.rlim_cur != RLIM_INFINITY)
        KVW_ERROR("%s: cannot register %zu bytes: locked-memory limit is %llu bytes; run "
                  "'ulimit -l unlimited' (or raise memlock in limits.conf)",
                  dev->name, len, (unsigned long long)rl.rlim_cur);
    else
        KVW_ERROR("%s: ibv_reg_mr(%zu bytes) failed: %s", dev->name, len, strerror(err));
}

static struct ibv_mr *register_cuda(kvw_dev_t *dev, void *addr, size_t len, int access)
{
    int fd = -1;
    uint64_t offset = 0;
    size_t aligned_len = 0;
    if (kvw__cuda_dmabuf_fd(addr, len, &fd, &offset, &aligned_len) == 0) {
        struct ibv_mr *mr =
            dev->ops->reg_dmabuf_mr(dev->pd, offset, len, (uint64_t)addr, fd, access);
        int err = errno;
        close(fd); /* the MR holds its own reference to the dma-buf */
        if (mr)
            return mr;
        KVW_INFO("%s: dma-buf registration failed (%s); trying nvidia_peermem", dev->name,
                 strerror(err));
    }
    if (kvw__cuda_peermem_loaded()) {
        struct ibv_mr *mr = dev->ops->reg_mr(dev->pd, addr, len, access);
        if (mr)
            return mr;
        KVW_ERROR("%s: GPU registration through nvidia_peermem failed: %s", dev->name,
                  strerror(errno));
        return NULL;
    }
    KVW_ERROR("%s: cannot register GPU memory: the NIC/driver refused dma-buf and "
              "nvidia_peermem is not loaded ('modprobe nvidia_peermem', or use the open GPU "
              "kernel modules with CUDA >= 11.7 for dma-buf)",
              dev->name);
    return NULL;
}

kvw_status_t kvw__mem_register(kvw_dev_t *dev, void *addr, size_t len, bool remote_write,
                               kvw_mr_t *mr_p)
{
    if (!addr || !len) {
        KVW_ERROR("cannot register an empty region (addr %p, len %zu)", addr, len);
        return KVW_ERR_INVALID;
    }
    kvw_mr_t m = {.addr = (uint64_t)addr, .len = len};
    m.kind = kvw__cuda_is_device_ptr(addr) ? KVW_MEM_CUDA : KVW_MEM_HOST;
    if (m.kind == KVW_MEM_CUDA) {
        m.mr = register_cuda(dev, addr, len, mr_access(remote_write));
    } else {
        m.mr = dev->ops->reg_mr(dev->pd, addr, len, mr_access(remote_write));
        if (!m.mr)
            explain_host_failure(dev, len, errno);
    }
    if (!m.mr)
        return KVW_ERR_REGISTER;
    m.lkey = m.mr->lkey;
    m.rkey = m.mr->rkey;
    *mr_p = m;
    return KVW_OK;
}

void kvw__mem_deregister(kvw_dev_t *dev, kvw_mr_t *mr)
{
    if (mr && mr->mr) {
        dev->ops->dereg_mr(mr->mr);
        mr->mr = NULL;
    }
}
