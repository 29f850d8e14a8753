/* SPDX-License-Identifier: Apache-2.0 */
/* The real CUDA seam: the driver API loaded with dlopen, so CUDA is never a
 * build or link requirement. Without libcuda.so.1 every pointer is host
 * memory and every query says why. */
#include "mem/mem.h"
#include "mem/cuda_abi.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* CUmemAllocationProp (cuMemGetAllocationPropertiesFromHandle), with room
 * to spare in case a later driver writes more. */
typedef union {
    cu_mem_prop_t p;
    unsigned char room[256];
} mem_alloc_prop_t;

#define MAX_GPUS 64

static struct {
    pthread_once_t once;
    pthread_mutex_t lock; /* primary[] */
    char why[160];        /* set when the driver is unusable */
    CUresult (*init)(unsigned int flags);
    CUresult (*get_error_name)(CUresult rc, const char **name);
    CUresult (*device_get_count)(int *n);
    CUresult (*device_get)(int *dev, int ordinal);
    CUresult (*device_get_attribute)(int *v, int attr, int dev);
    CUresult (*device_get_name)(char *name, int len, int dev);
    CUresult (*device_get_pci_bus_id)(char *id, int len, int dev);
    CUresult (*primary_ctx_retain)(CUcontext_t *ctx, int dev);
    CUresult (*ctx_get_current)(CUcontext_t *ctx);
    CUresult (*ctx_set_current)(CUcontext_t ctx);
    CUresult (*pointer_get_attribute)(void *data, int attr, CUdeviceptr_t ptr);
    CUresult (*get_handle_for_range)(void *handle, CUdeviceptr_t ptr, size_t size, int type,
                                     unsigned long long flags);
    CUresult (*flush_rdma_writes)(int target, int scope);
    CUresult (*retain_allocation_handle)(CUmemHandle_t *h, void *addr);
    CUresult (*get_allocation_properties)(void *prop, CUmemHandle_t h);
    CUresult (*mem_release)(CUmemHandle_t h);
    /* Staging (optional: each op says which one is missing). */
    CUresult (*mem_host_alloc)(void **p, size_t len, unsigned int flags);
    CUresult (*mem_free_host)(void *p);
    CUresult (*stream_create)(CUstream_t *stream, unsigned int flags);
    CUresult (*stream_destroy)(CUstream_t stream);
    CUresult (*memcpy_async)(CUdeviceptr_t dst, CUdeviceptr_t src, size_t len, CUstream_t stream);
    CUresult (*stream_synchronize)(CUstream_t stream);
    /* Head slicing's landing buffer (optional, like staging). */
    CUresult (*mem_alloc)(CUdeviceptr_t *p, size_t len);
    CUresult (*mem_free)(CUdeviceptr_t p);
    CUresult (*memcpy_2d_async)(const cu_memcpy2d_t *copy, CUstream_t stream);
    /* Producer events (optional: event_query says when it is missing). */
    CUresult (*event_query)(CUevent_t event);
    CUcontext_t primary[MAX_GPUS];
} cu = {.once = PTHREAD_ONCE_INIT, .lock = PTHREAD_MUTEX_INITIALIZER};

static const char *err_name(CUresult rc)
{
    const char *name = NULL;
    if (cu.get_error_name && cu.get_error_name(rc, &name) == CUDA_SUCCESS && name)
        return name;
    return "CUDA error";
}

static void say(char *why, size_t size, const char *what, CUresult rc)
{
    if (why && size)
        snprintf(why, size, "%s: %s (%d)", what, err_name(rc), rc);
}

#define SYM(field, name) (*(void **)&cu.field = dlsym(lib, name))

static void cuda_load(void)
{
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        snprintf(cu.why, sizeof(cu.why), "libcuda.so.1 not found (no NVIDIA driver)");
        return;
    }
    /* Kept open for the life of the process, as NCCL and UCX do. The _v2
     * names are the ones cuda.h maps the plain names to. */
    SYM(init, "cuInit");
    SYM(get_error_name, "cuGetErrorName");
    SYM(device_get_count, "cuDeviceGetCount");
    SYM(device_get, "cuDeviceGet");
    SYM(device_get_attribute, "cuDeviceGetAttribute");
    SYM(device_get_name, "cuDeviceGetName");
    SYM(device_get_pci_bus_id, "cuDeviceGetPCIBusId");
    SYM(primary_ctx_retain, "cuDevicePrimaryCtxRetain");
    SYM(ctx_get_current, "cuCtxGetCurrent");
    SYM(ctx_set_current, "cuCtxSetCurrent");
    SYM(pointer_get_attribute, "cuPointerGetAttribute");
    SYM(get_handle_for_range, "cuMemGetHandleForAddressRange"); /* CUDA 11.7 */
    SYM(flush_rdma_writes, "cuFlushGPUDirectRDMAWrites");       /* CUDA 11.3 */
    SYM(retain_allocation_handle, "cuMemRetainAllocationHandle");
    SYM(get_allocation_properties, "cuMemGetAllocationPropertiesFromHandle");
    SYM(mem_release, "cuMemRelease");
    SYM(mem_host_alloc, "cuMemHostAlloc");
    SYM(mem_free_host, "cuMemFreeHost");
    SYM(stream_create, "cuStreamCreate");
    if (!SYM(stream_destroy, "cuStreamDestroy_v2"))
        SYM(stream_destroy, "cuStreamDestroy"); /* drivers before CUDA 4.0 */
    /* The legacy-default-stream names: the _ptsz variants differ only for
     * stream 0, and kvwire passes streams of its own. */
    SYM(memcpy_async, "cuMemcpyAsync");
    SYM(stream_synchronize, "cuStreamSynchronize");
    SYM(mem_alloc, "cuMemAlloc_v2");
    SYM(mem_free, "cuMemFree_v2");
    SYM(memcpy_2d_async, "cuMemcpy2DAsync_v2");
    SYM(event_query, "cuEventQuery");
    if (!cu.init || !cu.pointer_get_attribute || !cu.device_get_count || !cu.device_get ||
        !cu.device_get_attribute || !cu.primary_ctx_retain || !cu.ctx_get_current ||
        !cu.ctx_set_current) {
        snprintf(cu.why, sizeof(cu.why), "libcuda.so.1 lacks the driver API kvwire needs");
        return;
    }
    /* Without cuInit every pointer query fails and GPU memory would pass
     * for host memory. Harmless when the application already called it. */
    CUresult rc = cu.init(0);
    if (rc != CUDA_SUCCESS) {
        say(cu.why, sizeof(cu.why), "cuInit", rc);
        cu.init = NULL;
    }
}

static int real_init(char *why, size_t size)
{
    pthread_once(&cu.once, cuda_load);
    if (cu.init)
        return 0;
    if (why && size)
        snprintf(why, size, "%s", cu.why);
    return -1;
}

static int real_device_count(void)
{
    int n = 0;
    if (real_init(NULL, 0) || cu.device_get_count(&n) != CUDA_SUCCESS)
        return 0;
    return n;
}

static int attr(int dev, int which)
{
    int v = -1;
    if (cu.device_get_attribute(&v, which, dev) != CUDA_SUCCESS)
        return -1; /* an older driver does not know the attribute */
    return v;
}

static int real_device_info(int ordinal, kvw_cuda_dev_t *info_p, char *why, size_t size)
{
    if (real_init(why, size))
        return -1;
    int dev = 0;
    CUresult rc = cu.device_get(&dev, ordinal);
    if (rc != CUDA_SUCCESS) {
        say(why, size, "cuDeviceGet", rc);
        return -1;
    }
    kvw_cuda_dev_t d;
    memset(&d, 0, sizeof(d));
    if (!cu.device_get_name || cu.device_get_name(d.name, (int)sizeof(d.name), dev))
        snprintf(d.name, sizeof(d.name), "GPU %d", ordinal);
    if (!cu.device_get_pci_bus_id || cu.device_get_pci_bus_id(d.pci, (int)sizeof(d.pci), dev))
        snprintf(d.pci, sizeof(d.pci), "?");
    d.cc_major = attr(dev, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR);
    d.cc_minor = attr(dev, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR);
    d.dmabuf = cu.get_handle_for_range ? attr(dev, CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED) : 0;
    d.gdr = attr(dev, CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED);
    d.vmm_gdr = attr(dev, CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED);
    d.writes_ordering = attr(dev, CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WRITES_ORDERING);
    *info_p = d;
    return 0;
}

/* The device's primary context, retained once and kept for the process
 * (released contexts would have to be re-created on every use). */
static CUcontext_t primary_ctx(int ordinal)
{
    if (ordinal < 0 || ordinal >= MAX_GPUS)
        return NULL;
    pthread_mutex_lock(&cu.lock);
    CUcontext_t ctx = cu.primary[ordinal];
    int dev = 0;
    if (!ctx && cu.device_get(&dev, ordinal) == CUDA_SUCCESS &&
        cu.primary_ctx_retain(&ctx, dev) == CUDA_SUCCESS)
        cu.primary[ordinal] = ctx;
    pthread_mutex_unlock(&cu.lock);
    return ctx;
}

static CUresult ptr_attr(void *data, int which, const void *addr)
{
    return cu.pointer_get_attribute(data, which, (CUdeviceptr_t)(uintptr_t)addr);
}

/* cuMemCreate allocations: a handle can be retained from the address, and
 * its properties carry the GPUDirect RDMA flag. */
static void vmm_info(const void *addr, kvw_cuda_ptr_t *p)
{
    CUmemHandle_t h = 0;
    if (!cu.retain_allocation_handle || !cu.get_allocation_properties || !cu.mem_release ||
        cu.retain_allocation_handle(&h, (void *)(uintptr_t)addr) != CUDA_SUCCESS)
        return;
    p->vmm = true;
    mem_alloc_prop_t prop;
    memset(&prop, 0, sizeof(prop));
    if (cu.get_allocation_properties(&prop, h) == CUDA_SUCCESS)
        p->rdma_capable = prop.p.alloc_flags.gpu_direct_rdma_capable != 0;
    cu.mem_release(h); /* drops only the reference retain took */
}

static void device_ptr_info(const void *addr, kvw_cuda_ptr_t *p)
{
    unsigned long long base = 0;
    size_t size = 0;
    unsigned int capable = 0;
    if (ptr_attr(&base, CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, addr) == CUDA_SUCCESS &&
        ptr_attr(&size, CU_POINTER_ATTRIBUTE_RANGE_SIZE, addr) == CUDA_SUCCESS) {
        p->base = base;
        p->size = size;
    }
    if (ptr_attr(&capable, CU_POINTER_ATTRIBUTE_IS_GPU_DIRECT_RDMA_CAPABLE, addr) == CUDA_SUCCESS)
        p->rdma_capable = capable != 0;
    vmm_info(addr, p);
    CUcontext_t ctx = NULL;
    /* VMM memory belongs to no context: use the device's primary one. */
    if (ptr_attr(&ctx, CU_POINTER_ATTRIBUTE_CONTEXT, addr) != CUDA_SUCCESS || !ctx)
        ctx = primary_ctx(p->device);
    p->ctx = ctx;
}

static int real_pointer_info(const void *addr, kvw_cuda_ptr_t *info_p, char *why, size_t size)
{
    kvw_cuda_ptr_t p = {.type = KVW_CUDA_PTR_HOST, .device = -1, .rdma_capable = -1};
    if (real_init(NULL, 0)) {
        *info_p = p; /* no driver: no GPU memory either */
        return 0;
    }
    unsigned int type = 0, managed = 0;
    CUresult rc = ptr_attr(&type, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, addr);
    if (rc == CUDA_ERROR_INVALID_VALUE) {
        *info_p = p; /* not an address CUDA knows */
        return 0;
    }
    if (rc != CUDA_SUCCESS) {
        say(why, size, "cuPointerGetAttribute(MEMORY_TYPE)", rc);
        return -1;
    }
    int ordinal = -1;
    ptr_attr(&managed, CU_POINTER_ATTRIBUTE_IS_MANAGED, addr);
    ptr_attr(&ordinal, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, addr);
    p.device = ordinal;
    if (managed)
        p.type = KVW_CUDA_PTR_MANAGED;
    else if (type == CU_MEMORYTYPE_DEVICE)
        p.type = KVW_CUDA_PTR_DEVICE;
    else if (type == CU_MEMORYTYPE_HOST)
        p.type = KVW_CUDA_PTR_PINNED;
    if (p.type == KVW_CUDA_PTR_DEVICE)
        device_ptr_info(addr, &p);
    *info_p = p;
    return 0;
}

/* Run fn in ctx on this thread, then give the thread its context back. */
static CUresult in_ctx(void *ctx, CUresult (*fn)(void *arg), void *arg)
{
    CUcontext_t old = NULL;
    cu.ctx_get_current(&old);
    CUresult rc = old == ctx ? CUDA_SUCCESS : cu.ctx_set_current(ctx);
    if (rc != CUDA_SUCCESS)
        return rc;
    rc = fn(arg);
    if (old != ctx)
        cu.ctx_set_current(old);
    return rc;
}

typedef struct {
    uint64_t start;
    size_t len;
    int fd;
} export_arg_t;

static CUresult do_export(void *arg)
{
    export_arg_t *a = arg;
    return cu.get_handle_for_range(&a->fd, (CUdeviceptr_t)a->start, a->len,
                                   CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, 0);
}

static int real_dmabuf_export(void *ctx, uint64_t start, size_t len, int *fd_p, char *why,
                              size_t size)
{
    if (real_init(why, size))
        return -1;
    if (!cu.get_handle_for_range) {
        snprintf(why, size, "the driver lacks cuMemGetHandleForAddressRange (CUDA < 11.7)");
        return -1;
    }
    export_arg_t a = {.start = start, .len = len, .fd = -1};
    CUresult rc = in_ctx(ctx, do_export, &a);
    if (rc != CUDA_SUCCESS || a.fd < 0) {
        say(why, size, "cuMemGetHandleForAddressRange(DMA_BUF_FD)", rc);
        return -1;
    }
    *fd_p = a.fd;
    return 0;
}

static CUresult do_flush(void *arg)
{
    (void)arg;
    return cu.flush_rdma_writes(CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TARGET_CURRENT_CTX,
                                CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TO_OWNER);
}

static int real_flush_writes(void *ctx, char *why, size_t size)
{
    if (real_init(why, size))
        return -1;
    if (!cu.flush_rdma_writes) {
        snprintf(why, size, "the driver lacks cuFlushGPUDirectRDMAWrites (CUDA < 11.3)");
        return -1;
    }
    CUresult rc = in_ctx(ctx, do_flush, NULL);
    if (rc != CUDA_SUCCESS) {
        say(why, size, "cuFlushGPUDirectRDMAWrites", rc);
        return -1;
    }
    return 0;
}

/* ---- staging: pinned host memory and streams ---------------------------- */

/* 0 when the loaded driver exports sym (have), else -1 with why naming
 * it. Call after real_init: the pointers are NULL until the driver loads. */
static int lacks(bool have, const char *sym, char *why, size_t size)
{
    if (have)
        return 0;
    if (why && size)
        snprintf(why, size, "the driver lacks %s", sym);
    return -1;
}

typedef struct {
    void *p;
    size_t len;
} host_arg_t;

static CUresult do_host_alloc(void *arg)
{
    host_arg_t *a = arg;
    return cu.mem_host_alloc(&a->p, a->len, CU_MEMHOSTALLOC_PORTABLE);
}

static CUresult do_free_host(void *arg)
{
    return cu.mem_free_host(((host_arg_t *)arg)->p);
}

/* Pinned host memory needs a context current while it is allocated and
 * freed; PORTABLE makes it pinned for every other context too, so GPU 0's
 * primary context (retained for the process, outliving the pool) is used
 * whichever contexts will copy through it. */
static void *real_host_alloc(size_t len, char *why, size_t size)
{
    if (real_init(why, size) || lacks(cu.mem_host_alloc != NULL, "cuMemHostAlloc", why, size) ||
        lacks(cu.mem_free_host != NULL, "cuMemFreeHost", why, size))
        return NULL;
    CUcontext_t ctx = primary_ctx(0);
    if (!ctx) {
        if (why && size)
            snprintf(why, size, "cuDevicePrimaryCtxRetain: no primary context for GPU 0");
        return NULL;
    }
    host_arg_t a = {.p = NULL, .len = len};
    CUresult rc = in_ctx(ctx, do_host_alloc, &a);
    if (rc != CUDA_SUCCESS || !a.p) {
        say(why, size, "cuMemHostAlloc(PORTABLE)", rc);
        return NULL;
    }
    return a.p;
}

static void real_host_free(void *p)
{
    if (!p || !cu.mem_free_host) /* p non-NULL: real_host_alloc loaded the driver */
        return;
    host_arg_t a = {.p = p};
    CUcontext_t ctx = primary_ctx(0);
    if (ctx)
        in_ctx(ctx, do_free_host, &a);
}

/* The handle staging holds: a stream and the context it belongs to, made
 * current around each call on it (the stager thread has none of its own). */
typedef struct {
    CUcontext_t ctx;
    CUstream_t stream;
} stream_t;

static CUresult do_stream_create(void *arg)
{
    stream_t *s = arg;
    /* NON_BLOCKING: no implicit synchronization with the legacy default
     * stream, so the application's own work on stream 0 does not stall
     * kvwire's copies (nor the reverse). */
    return cu.stream_create(&s->stream, CU_STREAM_NON_BLOCKING);
}

static CUresult do_stream_destroy(void *arg)
{
    return cu.stream_destroy(((stream_t *)arg)->stream);
}

static int real_stream_create(void *ctx, void **stream_p, char *why, size_t size)
{
    if (real_init(why, size) || lacks(cu.stream_create != NULL, "cuStreamCreate", why, size) ||
        lacks(cu.stream_destroy != NULL, "cuStreamDestroy_v2", why, size))
        return -1;
    /* NULL: the calling thread's current context, else GPU 0's primary
     * one. It is resolved here, as in_ctx(NULL) would unbind the thread. */
    if (!ctx && (cu.ctx_get_current(&ctx) != CUDA_SUCCESS || !ctx))
        ctx = primary_ctx(0);
    if (!ctx) {
        if (why && size)
            snprintf(why, size, "no CUDA context: none current and none primary on GPU 0");
        return -1;
    }
    stream_t *s = calloc(1, sizeof(*s));
    if (!s) {
        if (why && size)
            snprintf(why, size, "out of memory");
        return -1;
    }
    s->ctx = ctx;
    CUresult rc = in_ctx(ctx, do_stream_create, s);
    if (rc != CUDA_SUCCESS) {
        say(why, size, "cuStreamCreate(NON_BLOCKING)", rc);
        free(s);
        return -1;
    }
    *stream_p = s;
    return 0;
}

/* Returns at once: work still queued on the stream completes, and the
 * driver releases the stream then. */
static void real_stream_destroy(void *stream)
{
    stream_t *s = stream;
    if (!s)
        return;
    if (cu.stream_destroy)
        in_ctx(s->ctx, do_stream_destroy, s);
    free(s);
}

typedef struct {
    stream_t *s;
    void *dst;
    const void *src;
    size_t len;
} copy_arg_t;

static CUresult do_copy(void *arg)
{
    copy_arg_t *a = arg;
    return cu.memcpy_async((CUdeviceptr_t)(uintptr_t)a->dst, (CUdeviceptr_t)(uintptr_t)a->src,
                           a->len, a->s->stream);
}

static int real_copy_async(void *stream, void *dst, const void *src, size_t len, char *why,
                           size_t size)
{
    if (real_init(why, size) || lacks(cu.memcpy_async != NULL, "cuMemcpyAsync", why, size))
        return -1;
    if (!stream) {
        if (why && size)
            snprintf(why, size, "cuMemcpyAsync: no stream");
        return -1;
    }
    copy_arg_t a = {.s = stream, .dst = dst, .src = src, .len = len};
    CUresult rc = in_ctx(a.s->ctx, do_copy, &a);
    if (rc != CUDA_SUCCESS) {
        say(why, size, "cuMemcpyAsync", rc);
        return -1;
    }
    return 0;
}

static CUresult do_sync(void *arg)
{
    return cu.stream_synchronize(((stream_t *)arg)->stream);
}

/* Also reports a failure of any copy queued earlier (asynchronous errors
 * surface at the next synchronization). */
static int real_stream_sync(void *stream, char *why, size_t size)
{
    if (real_init(why, size) ||
        lacks(cu.stream_synchronize != NULL, "cuStreamSynchronize", why, size))
        return -1;
    if (!stream) {
        if (why && size)
            snprintf(why, size, "cuStreamSynchronize: no stream");
        return -1;
    }
    stream_t *s = stream;
    CUresult rc = in_ctx(s->ctx, do_sync, s);
    if (rc != CUDA_SUCCESS) {
        say(why, size, "cuStreamSynchronize", rc);
        return -1;
    }
    return 0;
}

/* ---- head slicing: the landing buffer ----------------------------------- */

typedef struct {
    CUdeviceptr_t p;
    size_t len;
} dev_arg_t;

static CUresult do_dev_alloc(void *arg)
{
    dev_arg_t *a = arg;
    return cu.mem_alloc(&a->p, a->len);
}

static CUresult do_dev_free(void *arg)
{
    return cu.mem_free(((dev_arg_t *)arg)->p);
}

static void *real_dev_alloc(void *ctx, size_t len, char *why, size_t size)
{
    if (real_init(why, size) || lacks(cu.mem_alloc != NULL, "cuMemAlloc_v2", why, size) ||
        lacks(cu.mem_free != NULL, "cuMemFree_v2", why, size))
        return NULL;
    dev_arg_t a = {.p = 0, .len = len};
    CUresult rc = in_ctx(ctx, do_dev_alloc, &a);
    if (rc != CUDA_SUCCESS || !a.p) {
        say(why, size, "cuMemAlloc", rc);
        return NULL;
    }
    return (void *)(uintptr_t)a.p;
}

static void real_dev_free(void *ctx, void *p)
{
    if (!p || !cu.mem_free) /* p non-NULL: real_dev_alloc loaded the driver */
        return;
    dev_arg_t a = {.p = (CUdeviceptr_t)(uintptr_t)p};
    in_ctx(ctx, do_dev_free, &a);
}

typedef struct {
    stream_t *s;
    cu_memcpy2d_t c;
} copy2d_arg_t;

static CUresult do_copy_2d(void *arg)
{
    copy2d_arg_t *a = arg;
    return cu.memcpy_2d_async(&a->c, a->s->stream);
}

/* Unified addressing on both sides: the driver tells device from host. */
static int real_copy_2d_async(void *stream, void *dst, size_t dpitch, const void *src,
                              size_t spitch, size_t width, size_t height, char *why, size_t size)
{
    if (real_init(why, size) || lacks(cu.memcpy_2d_async != NULL, "cuMemcpy2DAsync_v2", why, size))
        return -1;
    if (!stream) {
        if (why && size)
            snprintf(why, size, "cuMemcpy2DAsync: no stream");
        return -1;
    }
    copy2d_arg_t a = {.s = stream,
                      .c = {.src_memory_type = CU_MEMORYTYPE_UNIFIED,
                            .src_device = (CUdeviceptr_t)(uintptr_t)src,
                            .src_pitch = spitch,
                            .dst_memory_type = CU_MEMORYTYPE_UNIFIED,
                            .dst_device = (CUdeviceptr_t)(uintptr_t)dst,
                            .dst_pitch = dpitch,
                            .width_bytes = width,
                            .height = height}};
    CUresult rc = in_ctx(a.s->ctx, do_copy_2d, &a);
    if (rc != CUDA_SUCCESS) {
        say(why, size, "cuMemcpy2DAsync", rc);
        return -1;
    }
    return 0;
}

/* ---- producer events ------------------------------------------------------ */

typedef struct {
    CUevent_t event;
} event_arg_t;

static CUresult do_event_query(void *arg)
{
    return cu.event_query(((event_arg_t *)arg)->event);
}

/* cuEventQuery needs no current context (an event knows its own); should a
 * driver want one all the same, the query is made again in ctx. Called
 * from kvwire's poller and stager threads, which have none. */
static int real_event_query(void *ctx, void *event, char *why, size_t size)
{
    if (real_init(why, size) || lacks(cu.event_query != NULL, "cuEventQuery", why, size))
        return -1;
    event_arg_t a = {.event = event};
    CUresult rc = cu.event_query(event);
    if (rc == CUDA_ERROR_INVALID_CONTEXT && ctx)
        rc = in_ctx(ctx, do_event_query, &a);
    if (rc == CUDA_SUCCESS)
        return 0;
    if (rc == CUDA_ERROR_NOT_READY)
        return 1;
    say(why, size, "cuEventQuery", rc);
    return -1;
}

static bool real_peermem_loaded(void)
{
    return access("/sys/module/nvidia_peermem", F_OK) == 0 ||
           access("/sys/kernel/mm/memory_peers/nv_mem/version", F_OK) == 0;
}

const kvw_cuda_ops_t kvw__cuda_real_ops = {
    .init = real_init,
    .device_count = real_device_count,
    .device_info = real_device_info,
    .pointer_info = real_pointer_info,
    .dmabuf_export = real_dmabuf_export,
    .flush_writes = real_flush_writes,
    .peermem_loaded = real_peermem_loaded,
    .host_alloc = real_host_alloc,
    .host_free = real_host_free,
    .stream_create = real_stream_create,
    .stream_destroy = real_stream_destroy,
    .copy_async = real_copy_async,
    .stream_sync = real_stream_sync,
    .event_query = real_event_query,
    .dev_alloc = real_dev_alloc,
    .dev_free = real_dev_free,
    .copy_2d_async = real_copy_2d_async,
};

static const kvw_cuda_ops_t *current_ops = &kvw__cuda_real_ops;

const kvw_cuda_ops_t *kvw__cuda_ops(void)
{
    return current_ops;
}

void kvw__cuda_set_ops(const kvw_cuda_ops_t *ops)
{
    current_ops = ops ? ops : &kvw__cuda_real_ops;
}
