/* CUDA driver seam, loaded with dlopen so CUDA is never a build or link
 * requirement. Without libcuda.so.1 every pointer is host memory. */
#include "mem/mem.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <unistd.h>

/* The few driver types and constants we need, from cuda.h (stable ABI). */
typedef int CUresult;
typedef unsigned long long CUdeviceptr_t;
enum {
    CU_POINTER_ATTRIBUTE_MEMORY_TYPE = 2,
    CU_MEMORYTYPE_DEVICE = 2,
    CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD = 1,
};

static struct {
    pthread_once_t once;
    CUresult (*pointer_get_attribute)(void *data, int attribute, CUdeviceptr_t ptr);
    CUresult (*get_handle_for_range)(void *handle, CUdeviceptr_t ptr, size_t size, int type,
                                     unsigned long long flags);
} cuda = {.once = PTHREAD_ONCE_INIT};

static void cuda_load(void)
{
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib)
        return;
    /* Kept open for the life of the process, as NCCL and UCX do. */
    *(void **)&cuda.pointer_get_attribute = dlsym(lib, "cuPointerGetAttribute");
    *(void **)&cuda.get_handle_for_range = dlsym(lib, "cuMemGetHandleForAddressRange");
}

int kvw__cuda_is_device_ptr(const void *addr)
{
    pthread_once(&cuda.once, cuda_load);
    if (!cuda.pointer_get_attribute)
        return 0;
    unsigned int type = 0;
    if (cuda.pointer_get_attribute(&type, CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
                                   (CUdeviceptr_t)(uintptr_t)addr) != 0)
        return 0; /* not known to CUDA: host memory */
    return type == CU_MEMORYTYPE_DEVICE;
}

int kvw__cuda_dmabuf_fd(const void *addr, size_t len, int *fd_p, uint64_t *offset_p,
                        size_t *aligned_len_p)
{
    pthread_once(&cuda.once, cuda_load);
    if (!cuda.get_handle_for_range)
        return -1;
    uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
    uintptr_t start = (uintptr_t)addr & ~(page - 1);
    uintptr_t end = ((uintptr_t)addr + len + page - 1) & ~(page - 1);
    int fd = -1;
    if (cuda.get_handle_for_range(&fd, (CUdeviceptr_t)start, end - start,
                                  CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, 0) != 0 ||
        fd < 0)
        return -1;
    *fd_p = fd;
    *offset_p = (uint64_t)((uintptr_t)addr - start);
    *aligned_len_p = end - start;
    return 0;
}

int kvw__cuda_peermem_loaded(void)
{
    return access("/sys/module/nvidia_peermem", F_OK) == 0 ||
           access("/sys/kernel/mm/memory_peers/nv_mem/version", F_OK) == 0;
}
