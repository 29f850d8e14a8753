/* kvw-gpucheck: what can be verified of kvwire's GPU memory support on a
 * machine with an NVIDIA GPU and no RDMA NIC (run by tests/tools/gpu-check).
 *   1. kvwire's CUDA seam classifies cuMemAlloc (cudaMalloc), VMM
 *      (cuMemCreate + cuMemMap, with and without gpuDirectRDMACapable)
 *      and managed memory correctly;
 *   2. each exports as a dma-buf, or is refused where expected (managed);
 *   3. kvwire's staging copy engine (mem/staging.h) copies GPU memory
 *      into its pinned pool correctly, and how fast against a plain
 *      device-to-host copy of the same bytes (the ratio).
 * With --transfer DEVICE IP it does instead a whole request from GPU
 * memory to GPU memory over the RDMA device DEVICE (e.g. a soft-RoCE rxe
 * device, which cannot register GPU memory, so kvwire must stage it by
 * itself; IP is the IPv4 address of DEVICE's interface), with kvwire's
 * public API only: a bootstrap service, a prefill and a decode engine on
 * DEVICE, 4 layers x K/V regions of 64 pages x 16 KiB from cuMemAlloc on
 * GPU 0 and a host aux region on each side, 40 scattered pages sent in 2
 * chunks; then every byte of decode's GPU regions is read back and
 * checked (pages outside the request must still be zero). It prints the
 * memory path kvwire chose (its info log), the bytes, the time, and
 * PASS or FAIL with the first wrong byte.
 * Without libcuda.so.1 or a GPU it says so and exits 0 (skipped), so the
 * build, argument handling and the skip run in CI. Exit 1 when a check
 * fails, 2 for bad arguments. CUDA is loaded with dlopen, as in kvwire. */
#include "mem/cuda_abi.h"
#include "mem/mem.h"
#include "mem/staging.h"
#include "kvwire.h"
#include "kvw-tools.h"

#include <arpa/inet.h>
#include <dlfcn.h>
#include <getopt.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

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
    CUresult (*memcpy_htod)(CUdeviceptr_t dst, const void *src, size_t n);
    CUresult (*granularity)(size_t *g, const cu_mem_prop_t *prop, int option);
    CUresult (*mem_create)(CUmemHandle_t *h, size_t n, const cu_mem_prop_t *prop,
                           unsigned long long flags);
    CUresult (*address_reserve)(CUdeviceptr_t *p, size_t n, size_t align, CUdeviceptr_t addr,
                                unsigned long long flags);
    CUresult (*mem_map)(CUdeviceptr_t p, size_t n, size_t off, CUmemHandle_t h,
                        unsigned long long flags);
    CUresult (*set_access)(CUdeviceptr_t p, size_t n, const cu_access_desc_t *d, size_t count);
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
    SYM(memcpy_htod, "cuMemcpyHtoD_v2");
    SYM(granularity, "cuMemGetAllocationGranularity");
    SYM(mem_create, "cuMemCreate");
    SYM(address_reserve, "cuMemAddressReserve");
    SYM(mem_map, "cuMemMap");
    SYM(set_access, "cuMemSetAccess");
    SYM(mem_unmap, "cuMemUnmap");
    SYM(address_free, "cuMemAddressFree");
    SYM(mem_release, "cuMemRelease");
    return cu.device_get && cu.primary_ctx_retain && cu.ctx_set_current && cu.mem_alloc &&
           cu.mem_free && cu.memcpy_dtoh && cu.memcpy_htod && cu.mem_host_alloc && cu.mem_free_host;
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
    cu_mem_prop_t prop = {.type = CU_MEM_ALLOCATION_TYPE_PINNED,
                          .location = {CU_MEM_LOCATION_TYPE_DEVICE, dev}};
    prop.alloc_flags.gpu_direct_rdma_capable = rdma;
    size_t g = 0;
    cu.granularity(&g, &prop, 0);
    len = g ? (len + g - 1) / g * g : len;
    CUmemHandle_t h = 0;
    CUdeviceptr_t va = 0;
    cu_access_desc_t acc = {{CU_MEM_LOCATION_TYPE_DEVICE, dev}, CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
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

/* The bytes every copy moves: word k of the device buffer holds pattern(k),
 * so a chunk copied from the wrong offset is caught, not only a lost one. */
static uint32_t pattern(size_t k)
{
    return (uint32_t)k * 2654435761u + 0x6b767721u;
}

/* SIZE_MAX when buf holds the pattern's bytes [off, off + n), else the
 * offset of the first wrong word. */
static size_t bad_offset(const void *buf, size_t off, size_t n)
{
    const uint32_t *w = buf;
    for (size_t i = 0; i < n / 4; i++)
        if (w[i] != pattern(off / 4 + i))
            return off + i * 4;
    return SIZE_MAX;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double median(double *v, int n)
{
    qsort(v, (size_t)n, sizeof(*v), cmp_double);
    return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

/* The engine's staged copy of one transfer (engine/stager.c): chunks of
 * STAGE_CHUNK bytes, round-robin over STAGE_LANES lanes, each lane with
 * its own chunk of the pool, reused once the lane was waited for. */
enum { STAGE_CHUNK = 4 << 20, STAGE_LANES = 2 };

typedef struct {
    kvw_staging_t *s;
    void *ctx;
    CUdeviceptr_t d;
    size_t len, chunk;
    char why[192];
} stage_t;

static size_t chunk_len(const stage_t *g, size_t i)
{
    size_t off = i * g->chunk;
    return g->len - off < g->chunk ? g->len - off : g->chunk;
}

/* Wait for chunk i's lane; with verify, check the chunk that landed. */
static bool stage_wait(stage_t *g, size_t i, bool verify)
{
    int lane = (int)(i % STAGE_LANES);
    if (kvw__staging_wait(g->s, lane, g->why, sizeof(g->why)))
        return false;
    size_t bad =
        verify ? bad_offset(g->s->base + (size_t)lane * g->chunk, i * g->chunk, chunk_len(g, i))
               : SIZE_MAX;
    if (bad != SIZE_MAX)
        snprintf(g->why, sizeof(g->why), "wrong bytes at offset %zu (chunk %zu, lane %d)", bad, i,
                 lane);
    return bad == SIZE_MAX;
}

/* One staged copy of the whole buffer: its seconds, or -1 (g->why). With
 * verify_all every chunk is checked as its lane is waited for (a pass not
 * timed); else only the chunks left in the pool, after the clock stops. */
static double stage_pass(stage_t *g, bool verify_all)
{
    size_t n = (g->len + g->chunk - 1) / g->chunk;
    double t0 = now_s();
    for (size_t i = 0; i < n; i++) {
        int lane = (int)(i % STAGE_LANES);
        if (i >= STAGE_LANES && !stage_wait(g, i - STAGE_LANES, verify_all))
            return -1;
        if (kvw__staging_copy(g->s, lane, g->ctx, g->s->base + (size_t)lane * g->chunk,
                              (const void *)(uintptr_t)(g->d + i * g->chunk), chunk_len(g, i),
                              g->why, sizeof(g->why)))
            return -1;
    }
    size_t first = n > STAGE_LANES ? n - STAGE_LANES : 0;
    for (size_t i = first; i < n; i++)
        if (!stage_wait(g, i, verify_all))
            return -1;
    double s = now_s() - t0;
    for (size_t i = first; i < n && !verify_all; i++)
        if (bad_offset(g->s->base + (i % STAGE_LANES) * g->chunk, i * g->chunk, chunk_len(g, i)) !=
            SIZE_MAX) {
            snprintf(g->why, sizeof(g->why), "wrong bytes in the last chunks");
            return -1;
        }
    return s;
}

/* Plain cuMemcpyDtoH and the staged copy, interleaved, reps times each. */
static void compare_copies(stage_t *g, void *h, int reps)
{
    double *plain = calloc((size_t)reps * 2, sizeof(double)), *staged = plain + reps;
    char detail[224];
    if (!plain) {
        check(false, "staged copy", "out of memory");
        return;
    }
    for (int i = 0; i < reps; i++) {
        double t0 = now_s();
        if (cu.memcpy_dtoh(h, g->d, g->len)) {
            check(false, "plain cuMemcpyDtoH", "failed");
            free(plain);
            return;
        }
        plain[i] = (double)g->len / (now_s() - t0) / 1e9;
        double s = stage_pass(g, false);
        if (s < 0) {
            check(false, "staged copy", g->why);
            free(plain);
            return;
        }
        staged[i] = (double)g->len / s / 1e9;
    }
    double p = median(plain, reps), st = median(staged, reps);
    size_t bad = bad_offset(h, 0, g->len);
    snprintf(detail, sizeof(detail), "%.1f GB/s into pinned host memory (median of %d)", p, reps);
    check(bad == SIZE_MAX, "plain cuMemcpyDtoH", bad == SIZE_MAX ? detail : "wrong bytes");
    snprintf(detail, sizeof(detail),
             "%.1f GB/s (%zu MiB chunks over %d lanes, a pool of %zu MiB, median of %d)", st,
             g->chunk >> 20, STAGE_LANES, (g->chunk * STAGE_LANES) >> 20, reps);
    check(true, "staging copy engine", detail);
    printf("  staging / plain D2H = %.2fx\n", st / p);
    free(plain);
}

static void check_copy(size_t len, int iters, void *ctx)
{
    int reps = iters < 5 ? 5 : iters;
    CUdeviceptr_t d = 0;
    void *h = NULL;
    printf("device-to-host copy, %zu MiB x %d, plain and staged (interleaved)\n", len >> 20, reps);
    if (cu.mem_alloc(&d, len) || cu.mem_host_alloc(&h, len, 0)) {
        check(false, "allocate", "cuMemAlloc/cuMemHostAlloc failed");
        if (d)
            cu.mem_free(d);
        return;
    }
    for (size_t k = 0; k < len / 4; k++)
        ((uint32_t *)h)[k] = pattern(k);
    stage_t g = {.ctx = ctx, .d = d, .len = len, .chunk = len < STAGE_CHUNK ? len : STAGE_CHUNK};
    if (cu.memcpy_htod(d, h, len)) {
        check(false, "fill", "cuMemcpyHtoD failed");
    } else if (kvw__staging_create(NULL, g.chunk * STAGE_LANES, false, &g.ctx, 1, STAGE_LANES,
                                   &g.s)) {
        check(false, "staging copy engine", "kvw__staging_create failed (see the log above)");
    } else {
        cu.memcpy_dtoh(h, d, len);           /* warm up */
        bool ok = stage_pass(&g, true) >= 0; /* warm up, every chunk verified */
        if (ok)
            snprintf(g.why, sizeof(g.why), "%zu chunk(s) match the device buffer",
                     (len + g.chunk - 1) / g.chunk);
        check(ok, "staged copy, every chunk verified", g.why);
        if (ok)
            compare_copies(&g, h, reps);
        for (int l = 0; l < STAGE_LANES; l++)
            kvw__staging_wait(g.s, l, g.why, sizeof(g.why)); /* before destroying */
        kvw__staging_destroy(g.s);
    }
    cu.mem_free_host(h);
    cu.mem_free(d);
}

/* ---- a staged transfer over RDMA (--transfer) -------------------------------------- */

/* Each side: 4 layers x K/V regions of 64 pages x 16 KiB on GPU 0 (K
 * layers 0..3 are regions 0..3, V layers regions 4..7) and one host aux
 * region of 4 items. XF_PAGES of them go, in 2 sends (XF_FIRST, then the
 * rest). */
enum {
    XF_LAYERS = 4,
    XF_REGIONS = 2 * XF_LAYERS,
    XF_ITEMS = 64,
    XF_PAGE = 16 << 10,
    XF_LEN = XF_ITEMS * XF_PAGE,
    XF_PAGES = 40,
    XF_FIRST = 24,
    XF_AUX_ITEMS = 4,
    XF_AUX_LEN = 256,
    XF_AUX_SRC = 2,
    XF_AUX_DST = 1,
    XF_STAGING_MIB = 64,
    XF_WAIT_MS = 60000,
};
#define XF_SEED 0x6b7677677075ull

/* The memory paths kvwire logged for GPU regions ("... regions: PATH
 * (...)"), one bit each, in mem.c's order. */
static const char *const xf_path_names[] = {"dmabuf", "peermem", "staging"};
static atomic_uint xf_paths_seen;

/* Any library thread. INFO lines about the memory path and the staging
 * pool, and every warning and error, are shown. */
static void xf_log(void *arg, kvw_log_level_t level, const char *msg)
{
    (void)arg;
    const char *at = strstr(msg, "regions: ");
    if (at && level == KVW_LOG_INFO) {
        at += strlen("regions: ");
        for (unsigned i = 0; i < sizeof(xf_path_names) / sizeof(*xf_path_names); i++) {
            size_t n = strlen(xf_path_names[i]);
            if (!strncmp(at, xf_path_names[i], n) && (at[n] == ' ' || !at[n]))
                atomic_fetch_or(&xf_paths_seen, 1u << i);
        }
    }
    if (level <= KVW_LOG_WARN || strstr(msg, "regions:") || !strncmp(msg, "staging:", 8))
        printf("  kvwire %s: %s\n",
               level == KVW_LOG_ERROR  ? "error"
               : level == KVW_LOG_WARN ? "warning"
                                       : "info",
               msg);
}

typedef struct {
    CUdeviceptr_t src[XF_REGIONS], dst[XF_REGIONS];
    uint8_t *host; /* one region: the fill, and the read-back */
    uint8_t *src_aux, *dst_aux;
    kvw_region_t src_kv[XF_REGIONS], dst_kv[XF_REGIONS], src_ax, dst_ax;
    uint64_t src_pages[XF_PAGES], dst_pages[XF_PAGES];
    int slot[XF_ITEMS]; /* decode page -> its position in the request, or -1 */
    kvw_bootstrap_t *bs;
    kvw_engine_t *prefill, *decode;
    kvw_sender_t *s;
    kvw_receiver_t *r;
} xfer_t;

/* The 8-byte word w of item `item` of prefill's region `region` (aux:
 * region XF_REGIONS). */
static uint64_t xf_word(uint32_t region, uint64_t item, size_t w)
{
    return content(XF_SEED, region, item, w);
}

/* Word w of decode's region after the request: a page the request wrote
 * holds its source page, any other still zero. */
static uint64_t xf_expected(const xfer_t *x, uint32_t region, size_t w)
{
    size_t item_len = region < XF_REGIONS ? XF_PAGE : XF_AUX_LEN;
    uint64_t item = w * 8 / item_len;
    size_t iw = w % (item_len / 8);
    if (region == XF_REGIONS)
        return item == XF_AUX_DST ? xf_word(region, XF_AUX_SRC, iw) : 0;
    int i = x->slot[item];
    return i < 0 ? 0 : xf_word(region, x->src_pages[i], iw);
}

static void xf_region_name(uint32_t region, char *buf, size_t size)
{
    if (region == XF_REGIONS)
        snprintf(buf, size, "aux (host)");
    else
        snprintf(buf, size, "%c layer %u (GPU)", region < XF_LAYERS ? 'K' : 'V',
                 region % XF_LAYERS);
}

/* Compare decode's bytes of one region (got, len) with what they should
 * be: false with the first wrong byte in why. */
static bool xf_verify(const xfer_t *x, uint32_t region, const uint8_t *got, size_t len, char *why,
                      size_t size)
{
    size_t item_len = region < XF_REGIONS ? XF_PAGE : XF_AUX_LEN;
    for (size_t w = 0; w < len / 8; w++) {
        uint64_t want = xf_expected(x, region, w), have;
        memcpy(&have, got + w * 8, 8);
        if (have == want)
            continue;
        size_t b = 0;
        while (b < 7 && ((have >> (8 * b)) & 0xff) == ((want >> (8 * b)) & 0xff))
            b++;
        size_t off = w * 8 + b;
        uint64_t item = off / item_len;
        char name[32];
        xf_region_name(region, name, sizeof(name));
        snprintf(why, size,
                 "first wrong byte: region %s, offset %zu (item %llu%s, byte %zu): 0x%02x, "
                 "expected 0x%02x",
                 name, off, (unsigned long long)item,
                 region < XF_REGIONS && x->slot[item] < 0 ? ", not in the request" : "",
                 off % item_len, (unsigned)((have >> (8 * b)) & 0xff),
                 (unsigned)((want >> (8 * b)) & 0xff));
        return false;
    }
    return true;
}

/* GPU regions allocated and filled: prefill's from the pattern, decode's
 * with zeros; the host aux regions likewise. */
static bool xf_alloc(xfer_t *x, char *why, size_t size)
{
    x->host = malloc(XF_LEN);
    x->src_aux = malloc(XF_AUX_ITEMS * XF_AUX_LEN);
    x->dst_aux = calloc(XF_AUX_ITEMS, XF_AUX_LEN);
    if (!x->host || !x->src_aux || !x->dst_aux) {
        snprintf(why, size, "out of host memory");
        return false;
    }
    for (size_t w = 0; w < XF_AUX_ITEMS * XF_AUX_LEN / 8; w++) {
        uint64_t v = xf_word(XF_REGIONS, w * 8 / XF_AUX_LEN, w % (XF_AUX_LEN / 8));
        memcpy(x->src_aux + w * 8, &v, 8);
    }
    for (uint32_t r = 0; r < XF_REGIONS; r++) {
        if (cu.mem_alloc(&x->src[r], XF_LEN) || cu.mem_alloc(&x->dst[r], XF_LEN)) {
            snprintf(why, size, "cuMemAlloc of %d bytes failed", XF_LEN);
            return false;
        }
        for (size_t w = 0; w < XF_LEN / 8; w++) {
            uint64_t v = xf_word(r, w * 8 / XF_PAGE, w % (XF_PAGE / 8));
            memcpy(x->host + w * 8, &v, 8);
        }
        if (cu.memcpy_htod(x->src[r], x->host, XF_LEN)) {
            snprintf(why, size, "cuMemcpyHtoD (prefill's region %u) failed", r);
            return false;
        }
    }
    memset(x->host, 0, XF_LEN);
    for (uint32_t r = 0; r < XF_REGIONS; r++)
        if (cu.memcpy_htod(x->dst[r], x->host, XF_LEN)) {
            snprintf(why, size, "cuMemcpyHtoD (decode's region %u) failed", r);
            return false;
        }
    for (uint32_t r = 0; r < XF_REGIONS; r++) {
        x->src_kv[r] = (kvw_region_t){(void *)(uintptr_t)x->src[r], XF_LEN, XF_PAGE};
        x->dst_kv[r] = (kvw_region_t){(void *)(uintptr_t)x->dst[r], XF_LEN, XF_PAGE};
    }
    x->src_ax = (kvw_region_t){x->src_aux, XF_AUX_ITEMS * XF_AUX_LEN, XF_AUX_LEN};
    x->dst_ax = (kvw_region_t){x->dst_aux, XF_AUX_ITEMS * XF_AUX_LEN, XF_AUX_LEN};
    /* Scattered pages: source in runs of up to 2, decode one by one. */
    uint64_t perm[XF_ITEMS];
    shuffled_chunk_pages(perm, XF_ITEMS, 2, XF_SEED);
    memcpy(x->src_pages, perm, sizeof(x->src_pages));
    shuffled_chunk_pages(perm, XF_ITEMS, 1, XF_SEED + 1);
    memcpy(x->dst_pages, perm, sizeof(x->dst_pages));
    for (int i = 0; i < XF_ITEMS; i++)
        x->slot[i] = -1;
    for (int i = 0; i < XF_PAGES; i++)
        x->slot[x->dst_pages[i]] = i;
    return true;
}

static void xf_free(xfer_t *x)
{
    kvw_sender_destroy(x->s);
    kvw_receiver_destroy(x->r);
    kvw_engine_destroy(x->decode);
    kvw_engine_destroy(x->prefill);
    kvw_bootstrap_destroy(x->bs);
    for (uint32_t r = 0; r < XF_REGIONS; r++) {
        if (x->src[r])
            cu.mem_free(x->src[r]);
        if (x->dst[r])
            cu.mem_free(x->dst[r]);
    }
    free(x->host);
    free(x->src_aux);
    free(x->dst_aux);
}

/* What kvwire chose for the GPU regions, from its log. False when it
 * logged no GPU path (it took them for host memory). */
static bool xf_report_path(void)
{
    unsigned seen = atomic_load(&xf_paths_seen);
    if (!seen) {
        printf("  memory path: kvwire logged none for GPU regions (it took them for host "
               "memory?)\n");
        return false;
    }
    for (unsigned i = 0; i < sizeof(xf_path_names) / sizeof(*xf_path_names); i++)
        if (seen & (1u << i))
            printf("  memory path: %s%s\n", xf_path_names[i],
                   i == 2 ? " (GPU memory copied through kvwire's pinned pool)"
                          : " (the NIC reaches GPU memory itself: no staging needed, also fine)");
    return true;
}

/* One side's state for a message: its poll state, and why it failed. */
static void xf_side(char *buf, size_t size, kvw_poll_t p, kvw_status_t st, const char *reason)
{
    if (p == KVW_POLL_FAILED)
        snprintf(buf, size, "Failed, %s%s%s", kvw_status_name(st), reason ? ": " : "",
                 reason ? reason : "");
    else
        snprintf(buf, size, "%s", kvw_poll_name(p));
}

/* why: what, then both sides' states (and failures). */
static void xf_states(const xfer_t *x, const char *what, char *why, size_t size)
{
    const char *rs = NULL, *rr = NULL;
    kvw_status_t ss = kvw_sender_failure(x->s, &rs), sr = kvw_receiver_failure(x->r, &rr);
    char a[240], b[240];
    xf_side(a, sizeof(a), kvw_sender_poll(x->s), ss, rs);
    xf_side(b, sizeof(b), kvw_receiver_poll(x->r), sr, rr);
    snprintf(why, size, "%s (prefill: %s; decode: %s)", what, a, b);
}

/* Wait until both sides ended, at most XF_WAIT_MS. */
static bool xf_wait(const xfer_t *x, kvw_poll_t *ps, kvw_poll_t *pr)
{
    double end = now_s() + XF_WAIT_MS / 1000.0;
    for (;;) {
        *ps = kvw_sender_poll(x->s);
        *pr = kvw_receiver_poll(x->r);
        bool done = (*ps == KVW_POLL_SUCCESS || *ps == KVW_POLL_FAILED) &&
                    (*pr == KVW_POLL_SUCCESS || *pr == KVW_POLL_FAILED);
        if (done)
            return true;
        if (now_s() > end)
            return false;
        struct timespec ts = {0, 200000};
        nanosleep(&ts, NULL);
    }
}

/* The request itself, once both engines are up: false with why. */
static bool xf_run(xfer_t *x, char *why, size_t size)
{
    kvw_status_t st;
    if ((st = kvw_sender_create(x->prefill, 1, &x->s)) ||
        (st = kvw_receiver_create(x->decode, kvw_bootstrap_addr(x->bs), 0, 1, &x->r)) ||
        (st = kvw_receiver_init(x->r, x->dst_pages, XF_PAGES, XF_AUX_DST)) ||
        (st = kvw_sender_init(x->s, XF_PAGES, XF_AUX_SRC))) {
        snprintf(why, size, "setting up the request: %s", kvw_strerror(st));
        return false;
    }
    /* Decode's request in first: the clock then times the data alone,
     * not the connection's set-up. */
    double t0 = now_s(), ready_by = t0 + XF_WAIT_MS / 1000.0;
    kvw_poll_t ps, pr;
    while ((ps = kvw_sender_poll(x->s)) == KVW_POLL_BOOTSTRAPPING && now_s() < ready_by) {
        struct timespec ts = {0, 200000};
        nanosleep(&ts, NULL);
    }
    if (ps != KVW_POLL_WAITING_FOR_INPUT) {
        xf_states(x, "decode's request did not reach prefill", why, size);
        return false;
    }
    printf("  connected in %.1f ms\n", (now_s() - t0) * 1e3);
    t0 = now_s();
    if ((st = kvw_sender_send(x->s, x->src_pages, XF_FIRST)) ||
        (st = kvw_sender_send(x->s, x->src_pages + XF_FIRST, XF_PAGES - XF_FIRST))) {
        snprintf(why, size, "kvw_sender_send: %s", kvw_strerror(st));
        return false;
    }
    bool ended = xf_wait(x, &ps, &pr);
    double secs = now_s() - t0;
    if (!ended || ps != KVW_POLL_SUCCESS || pr != KVW_POLL_SUCCESS) {
        char what[64] = "the request failed";
        if (!ended)
            snprintf(what, sizeof(what), "no end after %d s", XF_WAIT_MS / 1000);
        xf_states(x, what, why, size);
        return false;
    }
    kvw_req_metrics_t ms = {0}, mr = {0};
    kvw_sender_metrics(x->s, &ms);
    kvw_receiver_metrics(x->r, &mr);
    uint64_t want = (uint64_t)XF_PAGES * XF_REGIONS * XF_PAGE + XF_AUX_LEN;
    printf("  moved %llu bytes (%d pages x %d regions x %d KiB + %d aux bytes) in %llu writes\n",
           (unsigned long long)ms.bytes, XF_PAGES, XF_REGIONS, XF_PAGE >> 10, XF_AUX_LEN,
           (unsigned long long)ms.writes);
    printf("  time: %.2f ms from the first send to both sides' Success (%.2f GB/s); prefill's "
           "transfer %.2f ms, decode's %.2f ms\n",
           secs * 1e3, (double)ms.bytes / secs / 1e9, (double)ms.transfer_us / 1e3,
           (double)mr.transfer_us / 1e3);
    if (ms.bytes != want) {
        snprintf(why, size, "prefill posted %llu bytes, the request has %llu",
                 (unsigned long long)ms.bytes, (unsigned long long)want);
        return false;
    }
    return true;
}

/* Decode's memory, read back and checked: bytes verified, or 0 (why). */
static size_t xf_check(const xfer_t *x, char *why, size_t size)
{
    size_t verified = 0;
    for (uint32_t r = 0; r < XF_REGIONS; r++) {
        if (cu.memcpy_dtoh(x->host, x->dst[r], XF_LEN)) {
            snprintf(why, size, "cuMemcpyDtoH of decode's region %u failed", r);
            return 0;
        }
        if (!xf_verify(x, r, x->host, XF_LEN, why, size))
            return 0;
        verified += XF_LEN;
    }
    if (!xf_verify(x, XF_REGIONS, x->dst_aux, XF_AUX_ITEMS * XF_AUX_LEN, why, size))
        return 0;
    return verified + XF_AUX_ITEMS * XF_AUX_LEN;
}

static int transfer(const char *device, const char *ip)
{
    xfer_t x = {0};
    char why[640] = "", bind[80];
    size_t verified = 0;
    kvw_config_t cfg;
    kvw_status_t st;
    printf("staged transfer from GPU memory: prefill -> decode on %s (%s), %d layers x K/V of "
           "%d x %d KiB pages on GPU 0, %d pages in 2 sends\n",
           device, ip, XF_LAYERS, XF_ITEMS, XF_PAGE >> 10, XF_PAGES);
    kvw_set_log_handler(xf_log, NULL, KVW_LOG_INFO);
    if (kvw_config_init(&cfg)) {
        snprintf(why, sizeof(why), "a KVW_* variable does not parse (see the log above)");
        goto out;
    }
    if (!getenv("KVW_STAGING_MIB"))
        cfg.staging_mib = XF_STAGING_MIB;
    printf("  gpu_path %s, staging pool %u MiB in %u KiB chunks, %u lane(s)\n",
           cfg.gpu_path[0] ? cfg.gpu_path : "auto", cfg.staging_mib, cfg.staging_chunk_kib,
           cfg.staging_lanes);
    if (!xf_alloc(&x, why, sizeof(why)))
        goto out;
    snprintf(bind, sizeof(bind), "%s:0", ip);
    kvw_bootstrap_params_t bp = {
        .struct_size = sizeof(kvw_bootstrap_params_t), .bind_addr = bind, .config = &cfg};
    kvw_engine_params_t pp = {.struct_size = sizeof(kvw_engine_params_t),
                              .role = KVW_ROLE_PREFILL,
                              .device = device,
                              .local_ip = ip,
                              .num_layers = XF_LAYERS,
                              .kv_regions = x.src_kv,
                              .num_aux = 1,
                              .aux_regions = &x.src_ax,
                              .config = &cfg};
    kvw_engine_params_t dp = pp;
    dp.role = KVW_ROLE_DECODE;
    dp.kv_regions = x.dst_kv;
    dp.aux_regions = &x.dst_ax;
    if ((st = kvw_bootstrap_create(&bp, &x.bs))) {
        snprintf(why, sizeof(why), "kvw_bootstrap_create on %s: %s", bind, kvw_strerror(st));
        goto out;
    }
    pp.bootstrap_addr = kvw_bootstrap_addr(x.bs);
    if ((st = kvw_engine_create(&pp, &x.prefill)) || (st = kvw_engine_create(&dp, &x.decode))) {
        snprintf(why, sizeof(why), "kvw_engine_create (%s): %s", x.prefill ? "decode" : "prefill",
                 kvw_strerror(st));
        goto out;
    }
    if (!xf_report_path()) {
        snprintf(why, sizeof(why), "kvwire did not see GPU memory");
        goto out;
    }
    if (xf_run(&x, why, sizeof(why)))
        verified = xf_check(&x, why, sizeof(why));
out:
    xf_free(&x);
    kvw_set_log_handler(NULL, NULL, KVW_LOG_WARN);
    if (verified)
        printf("staged transfer from GPU memory: PASS (%zu bytes verified)\n", verified);
    else
        printf("staged transfer from GPU memory: FAIL (%s)\n", why);
    return verified ? 0 : 1;
}

static void usage(FILE *out)
{
    fprintf(out, "usage: kvw-gpucheck [--size MIB] [--iters N]\n"
                 "       kvw-gpucheck --transfer DEVICE IP\n"
                 "  checks kvwire's GPU memory detection, dma-buf export and copy throughput\n"
                 "  on GPU 0; with --transfer, instead moves KV pages from GPU memory to GPU\n"
                 "  memory between a prefill and a decode engine on the RDMA device DEVICE\n"
                 "  (IP: the IPv4 address of its interface) and verifies every byte.\n"
                 "  Exits 0 (skipped) without an NVIDIA GPU\n");
}

typedef struct {
    size_t mib;
    int iters;
    bool sized;         /* --size or --iters given */
    const char *device; /* --transfer */
    const char *ip;
} args_t;

static int parse(int argc, char **argv, args_t *a)
{
    static const struct option opts[] = {{"size", required_argument, NULL, 's'},
                                         {"iters", required_argument, NULL, 'n'},
                                         {"transfer", required_argument, NULL, 't'},
                                         {"help", no_argument, NULL, 'h'},
                                         {NULL, 0, NULL, 0}};
    int c;
    while ((c = getopt_long(argc, argv, "s:n:t:h", opts, NULL)) != -1) {
        char *end = NULL;
        long v = c == 's' || c == 'n' ? strtol(optarg, &end, 10) : 0;
        if ((c == 's' || c == 'n') && (*end || v < 1 || v > 65536)) {
            fprintf(stderr, "kvw-gpucheck: --%s wants 1..65536, not '%s'\n",
                    c == 's' ? "size" : "iters", optarg);
            return 2;
        }
        if (c == 's')
            a->mib = (size_t)v;
        else if (c == 'n')
            a->iters = (int)v;
        else if (c == 't')
            a->device = optarg;
        else if (c == 'h') {
            usage(stdout);
            return 1;
        } else {
            usage(stderr);
            return 2;
        }
        a->sized |= c == 's' || c == 'n';
    }
    if (!a->device)
        return optind < argc ? 2 : 0;
    struct in_addr in;
    if (!a->device[0] || optind != argc - 1) {
        fprintf(stderr, "kvw-gpucheck: --transfer wants DEVICE IP\n");
        return 2;
    }
    a->ip = argv[optind];
    if (inet_pton(AF_INET, a->ip, &in) != 1) {
        fprintf(stderr, "kvw-gpucheck: --transfer: '%s' is not an IPv4 address\n", a->ip);
        return 2;
    }
    if (a->sized) {
        fprintf(stderr, "kvw-gpucheck: --size and --iters do not go with --transfer\n");
        return 2;
    }
    return 0;
}

int main(int argc, char **argv)
{
    args_t a = {.mib = 256, .iters = 10};
    int rc = parse(argc, argv, &a);
    if (rc)
        return rc == 1 ? 0 : 2;
    const char *what = a.device ? "staged transfer" : "GPU checks";
    char why[160] = "";
    if (kvw__cuda_ops()->init(why, sizeof(why)) || !load()) {
        printf("no NVIDIA GPU here (%s): %s skipped\n", why[0] ? why : "no libcuda", what);
        return 0;
    }
    int dev = 0;
    void *ctx = NULL;
    kvw_cuda_dev_t gpu;
    if (cu.device_get(&dev, 0) || cu.primary_ctx_retain(&ctx, dev) || cu.ctx_set_current(ctx) ||
        kvw__cuda_ops()->device_info(0, &gpu, why, sizeof(why))) {
        printf("no usable GPU 0 (%s): %s skipped\n", why, what);
        return 0;
    }
    printf("GPU 0: %s (%s), compute %d.%d, dma-buf %d, GPUDirect RDMA %d, with VMM %d\n", gpu.name,
           gpu.pci, gpu.cc_major, gpu.cc_minor, gpu.dmabuf, gpu.gdr, gpu.vmm_gdr);
    if (a.device)
        return transfer(a.device, a.ip);
    size_t len = a.mib << 20;
    check_malloc(len, &gpu);
    if (gpu.vmm_gdr == 1)
        check_vmm(dev, len, true, &gpu);
    check_vmm(dev, len, false, &gpu);
    check_managed(len, &gpu);
    check_copy(len, a.iters, ctx);
    printf("%s: %d check(s) failed\n", failures ? "FAIL" : "PASS", failures);
    return failures ? 1 : 0;
}
