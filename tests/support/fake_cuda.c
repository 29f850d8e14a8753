/* SPDX-License-Identifier: Apache-2.0 */
#include "support/fake_cuda.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <time.h>

enum { MAX_ALLOCS = 64, MAX_EVENTS = 256 };

typedef struct fake_event {
    uint64_t done_ns; /* completes at this CLOCK_MONOTONIC time; 0: not set */
    int error;        /* nonzero: queries fail with it */
    bool destroyed;
    long queries;
} fake_event_t;

typedef struct copy_op {
    struct copy_op *next;
    void *dst;
    const void *src;
    size_t len;
    size_t height, dpitch, spitch; /* a 2D copy: height rows of len bytes; 0: 1D */
    bool fail, to_gpu;
} copy_op_t;

typedef struct fake_stream {
    pthread_t thread;
    pthread_mutex_t lock;
    pthread_cond_t cond;
    copy_op_t *head, *tail;
    long queued, done;
    bool failed, stop;
} fake_stream_t;

static struct {
    pthread_mutex_t lock;
    pthread_cond_t gate_cond;
    bool gate_closed;
    fake_cuda_config_t cfg;
    struct {
        uint8_t *p;
        size_t len;
        uint64_t size; /* what pointer_info reports as its size */
    } allocs[MAX_ALLOCS];
    fake_cuda_facts_t facts;
    fake_cuda_stats_t st;
    long pending;
    bool fail_from_gpu, fail_to_gpu;
    fake_event_t *events[MAX_EVENTS];
    int nevents;
} fk = {.lock = PTHREAD_MUTEX_INITIALIZER, .gate_cond = PTHREAD_COND_INITIALIZER};

static char ctx_token; /* the one fake context */

void fake_cuda_init(const fake_cuda_config_t *cfg)
{
    pthread_mutex_lock(&fk.lock);
    for (int i = 0; i < fk.nevents; i++)
        free(fk.events[i]);
    fk.nevents = 0;
    memset(&fk.allocs, 0, sizeof(fk.allocs));
    memset(&fk.st, 0, sizeof(fk.st));
    fk.pending = 0;
    fk.fail_from_gpu = fk.fail_to_gpu = false;
    fk.cfg = cfg ? *cfg : (fake_cuda_config_t){0};
    fk.facts = (fake_cuda_facts_t){.dev = {.name = "fake GPU (host memory)",
                                           .pci = "0000:00:00.0",
                                           .cc_major = 9,
                                           .dmabuf = fk.cfg.gdr,
                                           .gdr = fk.cfg.gdr,
                                           .vmm_gdr = fk.cfg.gdr,
                                           .writes_ordering = 100},
                                   .type = KVW_CUDA_PTR_DEVICE,
                                   .rdma_capable = -1};
    fk.gate_closed = false;
    pthread_cond_broadcast(&fk.gate_cond);
    pthread_mutex_unlock(&fk.lock);
}

void fake_cuda_gate_to_gpu(bool closed)
{
    pthread_mutex_lock(&fk.lock);
    fk.gate_closed = closed;
    pthread_cond_broadcast(&fk.gate_cond);
    pthread_mutex_unlock(&fk.lock);
}

void fake_cuda_fail_next(bool to_gpu)
{
    pthread_mutex_lock(&fk.lock);
    if (to_gpu)
        fk.fail_to_gpu = true;
    else
        fk.fail_from_gpu = true;
    pthread_mutex_unlock(&fk.lock);
}

void *fake_cuda_alloc(size_t len)
{
    uint8_t *p = aligned_alloc(4096, (len + 4095) & ~(size_t)4095);
    if (!p)
        return NULL;
    memset(p, 0, len);
    pthread_mutex_lock(&fk.lock);
    for (int i = 0; i < MAX_ALLOCS; i++)
        if (!fk.allocs[i].p) {
            fk.allocs[i].p = p;
            fk.allocs[i].len = len;
            fk.allocs[i].size = len;
            break;
        }
    pthread_mutex_unlock(&fk.lock);
    return p;
}

void fake_cuda_free(void *p)
{
    pthread_mutex_lock(&fk.lock);
    for (int i = 0; i < MAX_ALLOCS; i++)
        if (fk.allocs[i].p == p)
            fk.allocs[i].p = NULL;
    pthread_mutex_unlock(&fk.lock);
    free(p);
}

void fake_cuda_set_alloc_size(void *p, uint64_t size)
{
    pthread_mutex_lock(&fk.lock);
    for (int i = 0; i < MAX_ALLOCS; i++)
        if (fk.allocs[i].p == p)
            fk.allocs[i].size = size;
    pthread_mutex_unlock(&fk.lock);
}

void *fake_cuda_ctx(void)
{
    return &ctx_token;
}

fake_cuda_facts_t *fake_cuda_facts(void)
{
    return &fk.facts;
}

void fake_cuda_stats(fake_cuda_stats_t *st)
{
    pthread_mutex_lock(&fk.lock);
    *st = fk.st;
    st->pending = fk.pending;
    pthread_mutex_unlock(&fk.lock);
}

/* The allocation holding addr, or -1 (host memory). Under fk.lock. */
static int find_alloc(const void *addr)
{
    const uint8_t *a = addr;
    for (int i = 0; i < MAX_ALLOCS; i++)
        if (fk.allocs[i].p && a >= fk.allocs[i].p && a < fk.allocs[i].p + fk.allocs[i].len)
            return i;
    return -1;
}

static int f_init(char *why, size_t size)
{
    (void)why;
    (void)size;
    return 0;
}

static int f_device_count(void)
{
    return 1;
}

static int f_device_info(int ordinal, kvw_cuda_dev_t *info_p, char *why, size_t size)
{
    if (ordinal != 0) {
        snprintf(why, size, "no fake GPU %d", ordinal);
        return -1;
    }
    pthread_mutex_lock(&fk.lock);
    *info_p = fk.facts.dev;
    pthread_mutex_unlock(&fk.lock);
    return 0;
}

static int f_pointer_info(const void *addr, kvw_cuda_ptr_t *info_p, char *why, size_t size)
{
    kvw_cuda_ptr_t p = {.type = KVW_CUDA_PTR_HOST, .device = -1, .rdma_capable = -1};
    pthread_mutex_lock(&fk.lock);
    if (fk.facts.query_fails) {
        pthread_mutex_unlock(&fk.lock);
        snprintf(why, size, "cuPointerGetAttribute(MEMORY_TYPE): CUDA_ERROR_UNKNOWN (999)");
        return -1;
    }
    int i = find_alloc(addr);
    if (i >= 0) {
        p.type = fk.facts.type;
        p.device = 0;
        p.ctx = &ctx_token;
        p.base = (uint64_t)(uintptr_t)fk.allocs[i].p;
        p.size = fk.allocs[i].size;
        p.vmm = fk.facts.vmm;
        p.rdma_capable = fk.facts.rdma_capable;
    }
    pthread_mutex_unlock(&fk.lock);
    *info_p = p;
    return 0;
}

/* When the GPU exports dma-bufs (facts.dev.dmabuf, config.gdr by default):
 * a real fd, which kvwire must close, and which the fake NIC registers as
 * the memory at the MR's iova. */
static int f_dmabuf_export(void *ctx, uint64_t start, size_t len, int *fd_p, char *why, size_t size)
{
    (void)ctx;
    pthread_mutex_lock(&fk.lock);
    fk.st.exports++;
    fk.st.export_start = start;
    fk.st.export_len = len;
    bool dmabuf = fk.facts.dev.dmabuf > 0;
    pthread_mutex_unlock(&fk.lock);
    if (dmabuf && (*fd_p = eventfd(0, EFD_CLOEXEC)) >= 0)
        return 0;
    snprintf(why, size, "the fake GPU exports no dma-buf");
    return -1;
}

static int f_flush_writes(void *ctx, char *why, size_t size)
{
    (void)why;
    (void)size;
    pthread_mutex_lock(&fk.lock);
    fk.st.flushes++;
    fk.st.flushed_ctx = ctx;
    pthread_mutex_unlock(&fk.lock);
    return 0;
}

static bool f_peermem_loaded(void)
{
    pthread_mutex_lock(&fk.lock);
    bool loaded = fk.facts.peermem;
    pthread_mutex_unlock(&fk.lock);
    return loaded;
}

static void *f_host_alloc(size_t len, char *why, size_t size)
{
    if (fk.cfg.fail_host_alloc) {
        snprintf(why, size, "cuMemHostAlloc: CUDA_ERROR_OUT_OF_MEMORY (2) (injected)");
        return NULL;
    }
    void *p = aligned_alloc(4096, (len + 4095) & ~(size_t)4095);
    if (!p) {
        snprintf(why, size, "out of host memory");
        return NULL;
    }
    pthread_mutex_lock(&fk.lock);
    fk.st.live_host_allocs++;
    fk.st.host_bytes += len;
    pthread_mutex_unlock(&fk.lock);
    return p;
}

static void f_host_free(void *p)
{
    pthread_mutex_lock(&fk.lock);
    fk.st.live_host_allocs--;
    pthread_mutex_unlock(&fk.lock);
    free(p);
}

static void sleep_us(unsigned us)
{
    struct timespec ts = {us / 1000000, (long)(us % 1000000) * 1000};
    nanosleep(&ts, NULL);
}

/* A copy into the GPU waits while the gate is closed. */
static void pass_gate(const copy_op_t *op)
{
    pthread_mutex_lock(&fk.lock);
    if (op->to_gpu && fk.gate_closed) {
        fk.st.gated++;
        while (fk.gate_closed)
            pthread_cond_wait(&fk.gate_cond, &fk.lock);
        fk.st.gated--;
    }
    pthread_mutex_unlock(&fk.lock);
}

static void run_copy(fake_stream_t *s, copy_op_t *op)
{
    pass_gate(op);
    if (fk.cfg.copy_delay_us)
        sleep_us(fk.cfg.copy_delay_us);
    for (size_t y = 0; !op->fail && y < (op->height ? op->height : 1); y++)
        memmove((uint8_t *)op->dst + y * op->dpitch, (const uint8_t *)op->src + y * op->spitch,
                op->len);
    pthread_mutex_lock(&fk.lock);
    fk.pending--;
    pthread_mutex_unlock(&fk.lock);
    pthread_mutex_lock(&s->lock);
    s->failed |= op->fail;
    s->done++;
    pthread_cond_broadcast(&s->cond);
    pthread_mutex_unlock(&s->lock);
    free(op);
}

static void *stream_main(void *arg)
{
    fake_stream_t *s = arg;
    pthread_mutex_lock(&s->lock);
    for (;;) {
        while (!s->head && !s->stop)
            pthread_cond_wait(&s->cond, &s->lock);
        if (!s->head)
            break;
        copy_op_t *op = s->head;
        s->head = op->next;
        if (!s->head)
            s->tail = NULL;
        pthread_mutex_unlock(&s->lock);
        run_copy(s, op);
        pthread_mutex_lock(&s->lock);
    }
    pthread_mutex_unlock(&s->lock);
    return NULL;
}

static int f_stream_create(void *ctx, void **stream_p, char *why, size_t size)
{
    (void)ctx;
    fake_stream_t *s = calloc(1, sizeof(*s));
    if (!s) {
        snprintf(why, size, "out of memory");
        return -1;
    }
    pthread_mutex_init(&s->lock, NULL);
    pthread_cond_init(&s->cond, NULL);
    if (pthread_create(&s->thread, NULL, stream_main, s)) {
        snprintf(why, size, "pthread_create failed");
        free(s);
        return -1;
    }
    pthread_mutex_lock(&fk.lock);
    fk.st.live_streams++;
    pthread_mutex_unlock(&fk.lock);
    *stream_p = s;
    return 0;
}

static void f_stream_destroy(void *stream)
{
    fake_stream_t *s = stream;
    pthread_mutex_lock(&s->lock);
    s->stop = true;
    pthread_cond_broadcast(&s->cond);
    pthread_mutex_unlock(&s->lock);
    pthread_join(s->thread, NULL);
    pthread_mutex_destroy(&s->lock);
    pthread_cond_destroy(&s->cond);
    free(s);
    pthread_mutex_lock(&fk.lock);
    fk.st.live_streams--;
    pthread_mutex_unlock(&fk.lock);
}

static int queue_copy(fake_stream_t *s, copy_op_t *op);

static int f_copy_async(void *stream, void *dst, const void *src, size_t len, char *why,
                        size_t size)
{
    copy_op_t *op = calloc(1, sizeof(*op));
    if (!op) {
        snprintf(why, size, "out of memory");
        return -1;
    }
    *op = (copy_op_t){.dst = dst, .src = src, .len = len};
    return queue_copy(stream, op);
}

static int f_copy_2d_async(void *stream, void *dst, size_t dpitch, const void *src, size_t spitch,
                           size_t width, size_t height, char *why, size_t size)
{
    if (width > dpitch || width > spitch) {
        snprintf(why, size, "cuMemcpy2DAsync: CUDA_ERROR_INVALID_VALUE (1): width over a pitch");
        return -1;
    }
    copy_op_t *op = calloc(1, sizeof(*op));
    if (!op) {
        snprintf(why, size, "out of memory");
        return -1;
    }
    *op = (copy_op_t){
        .dst = dst, .src = src, .len = width, .height = height, .dpitch = dpitch, .spitch = spitch};
    pthread_mutex_lock(&fk.lock);
    fk.st.copies_2d++;
    fk.st.rows_2d += height;
    pthread_mutex_unlock(&fk.lock);
    return queue_copy(stream, op);
}

static void *f_dev_alloc(void *ctx, size_t len, char *why, size_t size)
{
    (void)ctx;
    void *p = fake_cuda_alloc(len);
    if (!p)
        snprintf(why, size, "cuMemAlloc: CUDA_ERROR_OUT_OF_MEMORY (2) (fake)");
    pthread_mutex_lock(&fk.lock);
    fk.st.live_dev_allocs += p != NULL;
    pthread_mutex_unlock(&fk.lock);
    return p;
}

static void f_dev_free(void *ctx, void *p)
{
    (void)ctx;
    if (!p)
        return;
    fake_cuda_free(p);
    pthread_mutex_lock(&fk.lock);
    fk.st.live_dev_allocs--;
    pthread_mutex_unlock(&fk.lock);
}

static int queue_copy(fake_stream_t *s, copy_op_t *op)
{
    const void *src = op->src, *dst = op->dst;
    size_t len = op->len * (op->height ? op->height : 1);
    pthread_mutex_lock(&fk.lock);
    fk.st.copies++;
    bool from_gpu = find_alloc(src) >= 0, to_gpu = find_alloc(dst) >= 0;
    if (from_gpu && fk.fail_from_gpu)
        op->fail = !(fk.fail_from_gpu = false);
    if (to_gpu && fk.fail_to_gpu)
        op->fail = !(fk.fail_to_gpu = false);
    fk.st.failed_copies += op->fail;
    fk.st.bytes_copied += len;
    fk.st.copies_from_gpu += from_gpu;
    fk.st.copies_to_gpu += to_gpu;
    op->to_gpu = to_gpu;
    if (++fk.pending > fk.st.max_pending)
        fk.st.max_pending = fk.pending;
    pthread_mutex_unlock(&fk.lock);
    pthread_mutex_lock(&s->lock);
    if (s->tail)
        s->tail->next = op;
    else
        s->head = op;
    s->tail = op;
    s->queued++;
    pthread_cond_broadcast(&s->cond);
    pthread_mutex_unlock(&s->lock);
    return 0;
}

static int f_stream_sync(void *stream, char *why, size_t size)
{
    fake_stream_t *s = stream;
    pthread_mutex_lock(&s->lock);
    while (s->done < s->queued)
        pthread_cond_wait(&s->cond, &s->lock);
    bool failed = s->failed;
    s->failed = false; /* reported once, like a sticky error cleared by the caller */
    pthread_mutex_unlock(&s->lock);
    if (failed)
        snprintf(why, size, "cuStreamSynchronize: CUDA_ERROR_ILLEGAL_ADDRESS (700) (injected)");
    return failed ? -1 : 0;
}

/* ---- events ---------------------------------------------------------------- */

static uint64_t mono_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

void *fake_cuda_event_create(void)
{
    fake_event_t *ev = calloc(1, sizeof(*ev));
    if (!ev)
        return NULL;
    pthread_mutex_lock(&fk.lock);
    if (fk.nevents < MAX_EVENTS) {
        fk.events[fk.nevents++] = ev;
    } else {
        free(ev);
        ev = NULL;
    }
    pthread_mutex_unlock(&fk.lock);
    return ev;
}

void fake_cuda_event_complete(void *e)
{
    fake_event_t *ev = e;
    pthread_mutex_lock(&fk.lock);
    ev->done_ns = mono_ns();
    pthread_mutex_unlock(&fk.lock);
}

void fake_cuda_event_complete_in(void *e, unsigned ms)
{
    fake_event_t *ev = e;
    pthread_mutex_lock(&fk.lock);
    ev->done_ns = mono_ns() + (uint64_t)ms * 1000000ull;
    pthread_mutex_unlock(&fk.lock);
}

void fake_cuda_event_fail(void *e, int cuda_error)
{
    fake_event_t *ev = e;
    pthread_mutex_lock(&fk.lock);
    ev->error = cuda_error;
    pthread_mutex_unlock(&fk.lock);
}

void fake_cuda_event_destroy(void *e)
{
    fake_event_t *ev = e;
    pthread_mutex_lock(&fk.lock);
    ev->destroyed = true;
    pthread_mutex_unlock(&fk.lock);
}

bool fake_cuda_event_done(void *e)
{
    fake_event_t *ev = e;
    pthread_mutex_lock(&fk.lock);
    bool done = !ev->error && ev->done_ns && mono_ns() >= ev->done_ns;
    pthread_mutex_unlock(&fk.lock);
    return done;
}

uint64_t fake_cuda_event_done_ns(void *e)
{
    fake_event_t *ev = e;
    pthread_mutex_lock(&fk.lock);
    uint64_t ns = ev->done_ns;
    pthread_mutex_unlock(&fk.lock);
    return ns;
}

long fake_cuda_event_queries(void *e)
{
    fake_event_t *ev = e;
    pthread_mutex_lock(&fk.lock);
    long n = ev->queries;
    pthread_mutex_unlock(&fk.lock);
    return n;
}

static const char *cuda_error_name(int rc)
{
    switch (rc) {
    case 400:
        return "CUDA_ERROR_INVALID_HANDLE";
    case 700:
        return "CUDA_ERROR_ILLEGAL_ADDRESS";
    case 719:
        return "CUDA_ERROR_LAUNCH_FAILED";
    default:
        return "CUDA_ERROR_UNKNOWN";
    }
}

static int f_event_query(void *ctx, void *e, char *why, size_t size)
{
    (void)ctx;
    fake_event_t *ev = e;
    pthread_mutex_lock(&fk.lock);
    fk.st.event_queries++;
    ev->queries++;
    int error = ev->destroyed ? 400 : ev->error;
    fk.st.event_misuse += ev->destroyed;
    int rc = error ? -1 : ev->done_ns && mono_ns() >= ev->done_ns ? 0 : 1;
    pthread_mutex_unlock(&fk.lock);
    if (error)
        snprintf(why, size, "cuEventQuery: %s (%d) (injected)", cuda_error_name(error), error);
    return rc;
}

const kvw_cuda_ops_t fake_cuda_ops = {
    .init = f_init,
    .device_count = f_device_count,
    .device_info = f_device_info,
    .pointer_info = f_pointer_info,
    .dmabuf_export = f_dmabuf_export,
    .flush_writes = f_flush_writes,
    .peermem_loaded = f_peermem_loaded,
    .host_alloc = f_host_alloc,
    .host_free = f_host_free,
    .stream_create = f_stream_create,
    .stream_destroy = f_stream_destroy,
    .copy_async = f_copy_async,
    .stream_sync = f_stream_sync,
    .event_query = f_event_query,
    .dev_alloc = f_dev_alloc,
    .dev_free = f_dev_free,
    .copy_2d_async = f_copy_2d_async,
};
