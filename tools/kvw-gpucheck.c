/* kvw-gpucheck: what can be verified of kvwire's GPU memory support on a
 * machine with an NVIDIA GPU and no RDMA NIC (run by tools/gpu-check).
 *   1. kvwire's CUDA seam classifies cuMemAlloc (cudaMalloc), VMM
 *      (cuMemCreate + cuMemMap, with and without gpuDirectRDMACapable)
 *      and managed memory correctly;
 *   2. each exports as a dma-buf, or is refused where expected (managed);
 *   3. a plain device-to-host copy's throughput, the yardstick for the
 *      staging copy engine (the ratio is reported once staging exists).
 * Without libcuda.so.1 or a GPU it says so and exits 0 (skipped), so the
 * build, argument handling and the skip run in CI. Exit 1 when a check
 * fails, 2 for bad arguments. CUDA is loaded with dlopen, as in kvwire. */
#include "mem/mem.h"

#include <dlfcn.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr_t;
typedef unsigned long long CUmemHandle_t;

/* CUmemAllocationProp and CUmemAccessDesc, as in cuda.h. */
typedef struct {
    int type, requested_handle_types;
    struct {
        int type, id;
    } location;
    void *win32_meta;
    struct {
        unsigned char compression_type, gpu_direct_rdma_capable;
        unsigned short usage;
        unsigned char reserved[4];
    } alloc_flags;
} mem_prop_t;

typedef struct {
    struct {
        int type, id;
    } location;
    unsigned long long flags;
} access_desc_t;

enum {
    CU_MEM_ALLOCATION_TYPE_PINNED = 1,
    CU_MEM_LOCATION_TYPE_DEVICE = 1,
    CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3,
    CU_MEM_ATTACH_GLOBAL = 1,
};

static struct {
    CUresult (*device_get)(int *dev, int ordinal);
    CUresult (*primary_ctx_retain)(void **ctx, int dev);
    CUresult (*ctx_set_current)(void *ctx);
    CUresult (*mem_alloc)(CUdeviceptr_t *p, size_t n);
    CUresult (*mem_free)(CUdeviceptr_t p);
    CUresult (*mem_alloc_managed)(CUdeviceptr_t *p, size_t n, unsigned int flags);
    CUresult (*mem_host_alloc)(void **p, size_t n, unsigned int flags);
    CUresult (*mem_free_host)(void *p);
    CUresult (*memcpy_dtoh)(void *dst, CUdeviceptr_t src, size_t n);
    CUresult (*granularity)(size_t *g, const mem_prop_t *prop, int option);
    CUresult (*mem_create)(CUmemHandle_t *h, size_t n, const mem_prop_t *prop,
                           unsigned long long flags);
    CUresult (*address_reserve)(CUdeviceptr_t *p, size_t n, size_t align, CUdeviceptr_t addr,
                                unsigned long long flags);
    CUresult (*mem_map)(CUdeviceptr_t p, size_t n, size_t off, CUmemHandle_t h,
                        unsigned long long flags);
    CUresult (*set_access)(CUdeviceptr_t p, size_t n, const access_desc_t *d, size_t count);
    CUresult (*mem_unmap)(CUdeviceptr_t p, size_t n);
    CUresult (*address_free)(CUdeviceptr_t p, size_t n);
    CUresult (*mem_release)(CUmemHandle_t h);
} cu;

static int failures;

static void check(bool ok, const char *what, const char *detail)
{
    printf("  [%s] %s%s%s\n", ok ? "ok" : "FAIL", what, detail && *detail ? ": " : "",
           detail ? detail : "");
    if (!ok)
        failures++;
}

#define SYM(field, name) (*(void **)&cu.field = dlsym(lib, name))

static bool load(void)
{
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib)
        return false;
    SYM(device_get, "cuDeviceGet");
    SYM(primary_ctx_retain, "cuDevicePrimaryCtxRetain");
    SYM(ctx_set_current, "cuCtxSetCurrent");
    SYM(mem_alloc, "cuMemAlloc_v2");
    SYM(mem_free, "cuMemFree_v2");
    SYM(mem_alloc_managed, "cuMemAllocManaged");
    SYM(mem_host_alloc, "cuMemHostAlloc");
    SYM(mem_free_host, "cuMemFreeHost");
    SYM(memcpy_dtoh, "cuMemcpyDtoH_v2");
    SYM(granularity, "cuMemGetAllocationGranularity");
    SYM(mem_create, "cuMemCreate");
    SYM(address_reserve, "cuMemAddressReserve");
    SYM(mem_map, "cuMemMap");
    SYM(set_access, "cuMemSetAccess");
    SYM(mem_unmap, "cuMemUnmap");
    SYM(address_free, "cuMemAddressFree");
    SYM(mem_release, "cuMemRelease");
    return cu.device_get && cu.primary_ctx_retain && cu.ctx_set_current && cu.mem_alloc &&
           cu.mem_free && cu.memcpy_dtoh && cu.mem_host_alloc && cu.mem_free_host;
}

/* ---- one allocation kind --------------------------------------------------------- */

typedef struct {
    const char *name;
    kvw_cuda_ptr_type_t want_type;
    int want_vmm;     /* -1: either */
    int want_capable; /* -1: either */
    int want_export;  /* 1: dma-buf export must work (if the GPU has dma-buf);
                       * -1: either, reported only (the driver decides) */
} kind_t;

static const char *type_name(kvw_cuda_ptr_type_t t)
{
    static const char *const n[] = {"host", "pinned host", "device", "managed"};
    return (unsigned)t < 4 ? n[t] : "?";
}

static void check_kind(const kind_t *k, void *addr, size_t len, const kvw_cuda_dev_t *gpu)
{
    const kvw_cuda_ops_t *cuda = kvw__cuda_ops();
    kvw_cuda_ptr_t p;
    char why[192] = "", got[160];
    printf("%s (%zu MiB at %p)\n", k->name, len >> 20, addr);
    if (cuda->pointer_info(addr, &p, why, sizeof(why))) {
        check(false, "pointer detection", why);
        return;
    }
    snprintf(got, sizeof(got), "%s, GPU %d, vmm %d, rdma_capable %d, allocation %llu bytes",
             type_name(p.type), p.device, p.vmm, p.rdma_capable, (unsigned long long)p.size);
    check(p.type == k->want_type && (k->want_vmm < 0 || p.vmm == (k->want_vmm == 1)) &&
              (k->want_capable < 0 || p.rdma_capable == k->want_capable),
          "pointer detection", got);
    uint64_t start;
    size_t elen;
    kvw__mem_export_range((uint64_t)(uintptr_t)addr, len, p.base, p.size,
                          (uint64_t)sysconf(_SC_PAGESIZE), &start, &elen);
    int fd = -1;
    why[0] = '\0';
    bool exported =
        cuda->dmabuf_export(p.ctx ? p.ctx : NULL, start, elen, &fd, why, sizeof(why)) == 0;
    if (exported)
        close(fd);
    bool must = k->want_export == 1 && gpu->dmabuf == 1;
    check(exported || !must, exported ? "dma-buf export: exported" : "dma-buf export: refused",
          why);
    kvw_mem_facts_t f = {
        .force = -1, .ptr = p, .gpu = gpu, .nic_dmabuf = -1, .peermem = cuda->peermem_loaded()};
    char reason[KVW_MEM_REASON_MAX];
    kvw_mem_path_t path = kvw__mem_choose(&f, reason, sizeof(reason));
    printf("  path with a dma-buf NIC: %s (%s)\n", kvw__mem_path_name(path), reason);
}

static void check_malloc(size_t len, const kvw_cuda_dev_t *gpu)
{
    CUdeviceptr_t d = 0;
    if (cu.mem_alloc(&d, len)) {
        check(false, "cuMemAlloc", "failed");
        return;
    }
    kind_t k = {"cudaMalloc (cuMemAlloc)", KVW_CUDA_PTR_DEVICE, -1, -1, 1};
    check_kind(&k, (void *)(uintptr_t)d, len, gpu);
    cu.mem_free(d);
}

static void check_managed(size_t len, const kvw_cuda_dev_t *gpu)
{
    CUdeviceptr_t d = 0;
    if (!cu.mem_alloc_managed || cu.mem_alloc_managed(&d, len, CU_MEM_ATTACH_GLOBAL)) {
        check(false, "cuMemAllocManaged", "failed");
        return;
    }
    kind_t k = {"managed (cuMemAllocManaged)", KVW_CUDA_PTR_MANAGED, -1, -1, -1};
    check_kind(&k, (void *)(uintptr_t)d, len, gpu);
    cu.mem_free(d);
}

static void check_vmm(int dev, size_t len, bool rdma, const kvw_cuda_dev_t *gpu)
{
    if (!cu.mem_create || !cu.address_reserve || !cu.mem_map || !cu.set_access || !cu.granularity) {
        check(false, "VMM", "the driver lacks cuMemCreate/cuMemMap");
        return;
    }
    mem_prop_t prop = {.type = CU_MEM_ALLOCATION_TYPE_PINNED,
                       .location = {CU_MEM_LOCATION_TYPE_DEVICE, dev}};
    prop.alloc_flags.gpu_direct_rdma_capable = rdma;
    size_t g = 0;
    cu.granularity(&g, &prop, 0);
    len = g ? (len + g - 1) / g * g : len;
    CUmemHandle_t h = 0;
    CUdeviceptr_t va = 0;
    access_desc_t acc = {{CU_MEM_LOCATION_TYPE_DEVICE, dev}, CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
    if (cu.mem_create(&h, len, &prop, 0) || cu.address_reserve(&va, len, 0, 0, 0) ||
        cu.mem_map(va, len, 0, h, 0) || cu.set_access(va, len, &acc, 1)) {
        check(false, rdma ? "VMM with gpuDirectRDMACapable" : "VMM", "cannot map");
        return;
    }
    kind_t k = {rdma ? "VMM (cuMemCreate, gpuDirectRDMACapable=1)"
                     : "VMM (cuMemCreate, no gpuDirectRDMACapable)",
                KVW_CUDA_PTR_DEVICE, 1, rdma, rdma ? 1 : -1};
    check_kind(&k, (void *)(uintptr_t)va, len, gpu);
    cu.mem_unmap(va, len);
    cu.address_free(va, len);
    cu.mem_release(h);
}

/* ---- copy throughput -------------------------------------------------------------- */

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void check_copy(size_t len, int iters)
{
    CUdeviceptr_t d = 0;
    void *h = NULL;
    printf("device-to-host copy, %zu MiB x %d\n", len >> 20, iters);
    if (cu.mem_alloc(&d, len) || cu.mem_host_alloc(&h, len, 0)) {
        check(false, "allocate", "cuMemAlloc/cuMemHostAlloc failed");
        return;
    }
    cu.memcpy_dtoh(h, d, len); /* warm up */
    double t0 = now_s();
    bool ok = true;
    for (int i = 0; i < iters && ok; i++)
        ok = cu.memcpy_dtoh(h, d, len) == 0;
    double s = now_s() - t0;
    char detail[96];
    snprintf(detail, sizeof(detail), "%.1f GB/s into pinned host memory",
             (double)len * iters / s / 1e9);
    check(ok, "plain cuMemcpyDtoH", detail);
    printf("  staging copy engine vs this copy (ratio): TODO - staging is not built yet\n");
    cu.mem_free_host(h);
    cu.mem_free(d);
}

static void usage(FILE *out)
{
    fprintf(out, "usage: kvw-gpucheck [--size MIB] [--iters N]\n"
                 "  checks kvwire's GPU memory detection, dma-buf export and copy throughput\n"
                 "  on GPU 0; exits 0 (skipped) without an NVIDIA GPU\n");
}

static int parse(int argc, char **argv, size_t *mib, int *iters)
{
    static const struct option opts[] = {{"size", required_argument, NULL, 's'},
                                         {"iters", required_argument, NULL, 'n'},
                                         {"help", no_argument, NULL, 'h'},
                                         {NULL, 0, NULL, 0}};
    int c;
    while ((c = getopt_long(argc, argv, "s:n:h", opts, NULL)) != -1) {
        char *end = NULL;
        long v = c == 's' || c == 'n' ? strtol(optarg, &end, 10) : 0;
        if ((c == 's' || c == 'n') && (*end || v < 1 || v > 65536)) {
            fprintf(stderr, "kvw-gpucheck: --%s wants 1..65536, not '%s'\n",
                    c == 's' ? "size" : "iters", optarg);
            return 2;
        }
        if (c == 's')
            *mib = (size_t)v;
        else if (c == 'n')
            *iters = (int)v;
        else if (c == 'h') {
            usage(stdout);
            return 1;
        } else {
            usage(stderr);
            return 2;
        }
    }
    return optind < argc ? 2 : 0;
}

int main(int argc, char **argv)
{
    size_t mib = 256;
    int iters = 10;
    int rc = parse(argc, argv, &mib, &iters);
    if (rc)
        return rc == 1 ? 0 : 2;
    char why[160] = "";
    if (kvw__cuda_ops()->init(why, sizeof(why)) || !load()) {
        printf("no NVIDIA GPU here (%s): GPU checks skipped\n", why[0] ? why : "no libcuda");
        return 0;
    }
    int dev = 0;
    void *ctx = NULL;
    kvw_cuda_dev_t gpu;
    if (cu.device_get(&dev, 0) || cu.primary_ctx_retain(&ctx, dev) || cu.ctx_set_current(ctx) ||
        kvw__cuda_ops()->device_info(0, &gpu, why, sizeof(why))) {
        printf("no usable GPU 0 (%s): GPU checks skipped\n", why);
        return 0;
    }
    printf("GPU 0: %s (%s), compute %d.%d, dma-buf %d, GPUDirect RDMA %d, with VMM %d\n", gpu.name,
           gpu.pci, gpu.cc_major, gpu.cc_minor, gpu.dmabuf, gpu.gdr, gpu.vmm_gdr);
    size_t len = mib << 20;
    check_malloc(len, &gpu);
    if (gpu.vmm_gdr == 1)
        check_vmm(dev, len, true, &gpu);
    check_vmm(dev, len, false, &gpu);
    check_managed(len, &gpu);
    check_copy(len, iters);
    printf("staged transfer over soft-RoCE: TODO - staging is not built yet\n");
    printf("%s: %d check(s) failed\n", failures ? "FAIL" : "PASS", failures);
    return failures ? 1 : 0;
}
