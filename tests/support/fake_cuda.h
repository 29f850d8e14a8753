/* A fake CUDA driver behind kvwire's CUDA seam (kvw__cuda_set_ops), for
 * the staging tests on the fake NIC and on real rxe: "device memory" is
 * host memory that pointer_info reports as a cudaMalloc allocation on a
 * GPU without GPUDirect RDMA (so kvwire must stage it), pinned memory is
 * aligned_alloc, and every stream is a worker thread copying with memcpy,
 * in order, so copies really run asynchronously to the caller. Faults: a
 * copy that fails, copies that take time, copies into the GPU held at a
 * gate for as long as a test likes. Events stand for the application's
 * CUDA events (kvw_sender_send_part_after): each completes when the test
 * says, or at a time it set, or fails with the CUDA error it chose. With
 * gdr set the GPU has GPUDirect RDMA and exports dma-bufs (an eventfd,
 * which the fake NIC takes as the memory at its iova), so its memory is
 * registered directly instead of staged. Never reported as a GPU. */
#ifndef KVW_TEST_FAKE_CUDA_H
#define KVW_TEST_FAKE_CUDA_H

#include "mem/mem.h"

#include <stddef.h>
#include <stdint.h>

extern const kvw_cuda_ops_t fake_cuda_ops;

typedef struct fake_cuda_config {
    int gdr;                /* what the GPU reports for GPUDirect RDMA (0: staging) */
    unsigned copy_delay_us; /* each copy takes at least this long */
    long fail_host_alloc;   /* nonzero: pinned allocations fail */
} fake_cuda_config_t;

/* Reset state and counters; install with kvw__cuda_set_ops(&fake_cuda_ops). */
void fake_cuda_init(const fake_cuda_config_t *cfg);
/* The next copy out of (to_gpu false) or into (true) fake GPU memory
 * fails: its stream's sync reports an error. */
void fake_cuda_fail_next(bool to_gpu);
/* Closed: a copy into fake GPU memory waits, at the head of its stream,
 * until the gate opens (a GPU busy for as long as the test wants), so a
 * test can act while decode's copy from the staging pool is under way.
 * fake_cuda_stats().gated counts the copies waiting now. fake_cuda_init
 * opens it; open it before destroying an engine that copies. */
void fake_cuda_gate_to_gpu(bool closed);
/* len bytes of "GPU memory" (zeroed); freed by fake_cuda_free. */
void *fake_cuda_alloc(size_t len);
void fake_cuda_free(void *p);

typedef struct fake_cuda_stats {
    long copies, failed_copies;
    uint64_t bytes_copied;
    long max_pending; /* most copies queued on all streams at once */
    long live_streams, live_host_allocs;
    uint64_t host_bytes; /* pinned bytes allocated in all */
    long copies_from_gpu, copies_to_gpu;
    long gated;                       /* copies into the GPU waiting at the closed gate now */
    long pending;                     /* copies queued or running on all streams now */
    long event_queries, event_misuse; /* all events; queries of destroyed ones */
} fake_cuda_stats_t;
void fake_cuda_stats(fake_cuda_stats_t *st);

/* ---- events: a CUevent as kvwire sees it (pass the pointer as the event) */

/* A recorded event whose work has not completed: its queries say
 * CUDA_ERROR_NOT_READY until one of the calls below. Freed by the next
 * fake_cuda_init. */
void *fake_cuda_event_create(void);
/* It completes now. */
void fake_cuda_event_complete(void *ev);
/* It completes ms milliseconds from now (CLOCK_MONOTONIC). */
void fake_cuda_event_complete_in(void *ev, unsigned ms);
/* Its queries fail with this CUDA error from now on (e.g. 719,
 * CUDA_ERROR_LAUNCH_FAILED: the producing kernel faulted). */
void fake_cuda_event_fail(void *ev, int cuda_error);
/* The application destroyed it: a query from now on is counted as misuse
 * (fake_cuda_stats().event_misuse) and fails with
 * CUDA_ERROR_INVALID_HANDLE. */
void fake_cuda_event_destroy(void *ev);
/* Whether a query now would say it completed, and when it did (or will:
 * CLOCK_MONOTONIC ns; 0 while no completion is set). Not counted as
 * queries. */
bool fake_cuda_event_done(void *ev);
uint64_t fake_cuda_event_done_ns(void *ev);
/* Queries kvwire made of it. */
long fake_cuda_event_queries(void *ev);

#endif
