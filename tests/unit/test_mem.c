/* SPDX-License-Identifier: Apache-2.0 */
/* Unit tests for src/mem/: which path each region takes (host, dma-buf,
 * nvidia_peermem, staging) and why, the override, the export range, and
 * registration on the fake NIC. The fake CUDA seam (support/fake_cuda)
 * makes host memory pose as GPU memory: the fake NIC registers a "dma-buf" as the host memory at
 * its iova, so GPU regions really are registered and checked. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include <stdio.h>
#include <unistd.h>

#include "common/config.h"
#include "mem/mem.h"
#include "support/fake_cuda.h"
#include "support/fake_nic.h"

enum { GPU_LEN = 1 << 20 };

/* The fake GPU (support/fake_cuda): one allocation of GPU_LEN bytes, and
 * what it and the GPU report, which each test changes as it needs. */
static uint8_t *gpu_mem;
static fake_cuda_facts_t *fake;

/* ---- log capture ---------------------------------------------------------------- */

static char logbuf[8192];

static void capture(void *arg, kvw_log_level_t level, const char *msg)
{
    (void)arg;
    (void)level;
    size_t used = strlen(logbuf);
    snprintf(logbuf + used, sizeof(logbuf) - used, "%s\n", msg);
}

static int count_lines(const char *needle)
{
    int n = 0;
    for (const char *p = logbuf; (p = strstr(p, needle)); p += strlen(needle))
        n++;
    return n;
}

/* ---- fixture -------------------------------------------------------------------- */

typedef struct {
    kvw_dev_t *dev;
    kvw_mem_ctx_t m;
} fixture_t;

static int setup_with(void **state, int no_dmabuf)
{
    fake_cuda_init(&(fake_cuda_config_t){.gdr = 1});
    fake = fake_cuda_facts();
    fake->rdma_capable = 1;
    fake->dev = (kvw_cuda_dev_t){.name = "Fake H100",
                                 .cc_major = 9,
                                 .dmabuf = 1,
                                 .gdr = 1,
                                 .vmm_gdr = 1,
                                 .writes_ordering = 100};
    gpu_mem = fake_cuda_alloc(GPU_LEN);
    assert_non_null(gpu_mem);
    logbuf[0] = '\0';
    kvw_set_log_handler(capture, NULL, KVW_LOG_INFO);
    fake_nic_config_t nc = {.num_devices = 1, .no_dmabuf = no_dmabuf};
    assert_int_equal(fake_nic_init(&nc), 0);
    kvw__verbs_set_ops(&fake_nic_ops);
    kvw__cuda_set_ops(&fake_cuda_ops);
    fixture_t *f = calloc(1, sizeof(*f));
    assert_int_equal(kvw__dev_open("fake0", "127.0.0.1", 1, -1, &f->dev), KVW_OK);
    assert_int_equal(kvw__mem_ctx_init(&f->m, NULL), KVW_OK);
    *state = f;
    return 0;
}

static int setup(void **state)
{
    return setup_with(state, 0);
}

static int setup_no_nic_dmabuf(void **state)
{
    return setup_with(state, 1);
}

static int teardown(void **state)
{
    fixture_t *f = *state;
    kvw__dev_close(f->dev);
    free(f);
    kvw__cuda_set_ops(NULL);
    kvw__verbs_set_ops(NULL);
    fake_nic_stats_t st;
    fake_nic_stats(&st);
    assert_int_equal(st.live_mrs, 0);
    fake_nic_fini();
    fake_cuda_free(gpu_mem);
    kvw_set_log_handler(NULL, NULL, KVW_LOG_WARN);
    return 0;
}

static fake_cuda_stats_t cuda_stats(void)
{
    fake_cuda_stats_t st;
    fake_cuda_stats(&st);
    return st;
}

static kvw_mem_path_t decide(fixture_t *f, void *addr, size_t len, kvw_mem_plan_t *p)
{
    assert_int_equal(kvw__mem_decide(&f->m, f->dev, addr, len, true, p), KVW_OK);
    return p->path;
}

/* ---- the decision --------------------------------------------------------------- */

static void test_host_memory_is_host(void **state)
{
    fixture_t *f = *state;
    static uint8_t host[8192];
    kvw_mem_plan_t p;
    assert_int_equal(decide(f, host, sizeof(host), &p), KVW_MEM_PATH_HOST);
    assert_false(p.flush);
    assert_int_equal(kvw__mem_decide(&f->m, f->dev, NULL, 10, true, &p), KVW_ERR_INVALID);
    assert_int_equal(kvw__mem_decide(&f->m, f->dev, host, 0, true, &p), KVW_ERR_INVALID);
}

static void test_dmabuf_first(void **state)
{
    fixture_t *f = *state;
    kvw_mem_plan_t p;
    fake->peermem = true; /* dma-buf still wins */
    assert_int_equal(decide(f, gpu_mem, 4096, &p), KVW_MEM_PATH_DMABUF);
    assert_non_null(strstr(p.reason, "dma-buf"));
}

static void test_peermem_when_gpu_has_no_dmabuf(void **state)
{
    fixture_t *f = *state;
    kvw_mem_plan_t p;
    fake->dev.dmabuf = 0;
    fake->peermem = true;
    assert_int_equal(decide(f, gpu_mem, 4096, &p), KVW_MEM_PATH_PEERMEM);
    assert_non_null(strstr(p.reason, "DMA_BUF_SUPPORTED = 0"));
}

static void test_peermem_when_nic_refuses_dmabuf(void **state)
{
    fixture_t *f = *state;
    kvw_mem_plan_t p;
    fake->peermem = true;
    assert_int_equal(decide(f, gpu_mem, 4096, &p), KVW_MEM_PATH_PEERMEM);
    assert_non_null(strstr(p.reason, "fake0 refuses dma-buf"));
}

static void test_staging_when_neither(void **state)
{
    fixture_t *f = *state;
    kvw_mem_plan_t p;
    fake->dev.dmabuf = 0;
    assert_int_equal(decide(f, gpu_mem, 4096, &p), KVW_MEM_PATH_STAGING);
    assert_non_null(strstr(p.reason, "modprobe nvidia_peermem"));
    assert_non_null(strstr(p.reason, "open GPU kernel modules"));
    /* Registration registers nothing (the engine stages it), keeps the
     * region's context for the copies, and logs why once. */
    kvw_mr_t mr = {0};
    assert_int_equal(kvw__mem_register_in(&f->m, f->dev, gpu_mem, 4096, true, &mr), KVW_OK);
    assert_null(mr.mr);
    assert_int_equal(mr.path, KVW_MEM_PATH_STAGING);
    assert_ptr_equal(mr.cuda_ctx, fake_cuda_ctx());
    assert_int_equal(mr.lkey, 0);
    assert_non_null(strstr(logbuf, "GPU 0 regions: staging"));
    assert_non_null(strstr(logbuf, "modprobe nvidia_peermem"));
    fake_nic_stats_t ns;
    fake_nic_stats(&ns);
    assert_int_equal(ns.live_mrs, 0);
}

static void test_override_honoured(void **state)
{
    fixture_t *f = *state;
    kvw_config_t cfg;
    kvw_config_init(&cfg);
    kvw_mem_plan_t p;
    fake->peermem = true;
    snprintf(cfg.gpu_path, sizeof(cfg.gpu_path), "peermem");
    assert_int_equal(kvw__mem_ctx_init(&f->m, &cfg), KVW_OK);
    assert_int_equal(decide(f, gpu_mem, 4096, &p), KVW_MEM_PATH_PEERMEM);
    assert_non_null(strstr(p.reason, "KVW_GPU_PATH=peermem"));

    snprintf(cfg.gpu_path, sizeof(cfg.gpu_path), "staging");
    assert_int_equal(kvw__mem_ctx_init(&f->m, &cfg), KVW_OK);
    assert_int_equal(decide(f, gpu_mem, 4096, &p), KVW_MEM_PATH_STAGING);

    /* A forced path the detection says no to is still taken, and says so. */
    fake->peermem = false;
    snprintf(cfg.gpu_path, sizeof(cfg.gpu_path), "peermem");
    assert_int_equal(kvw__mem_ctx_init(&f->m, &cfg), KVW_OK);
    assert_int_equal(decide(f, gpu_mem, 4096, &p), KVW_MEM_PATH_PEERMEM);
    assert_non_null(strstr(p.reason, "detection says"));

    /* Host memory is host memory whatever is forced. */
    static uint8_t host[4096];
    assert_int_equal(decide(f, host, sizeof(host), &p), KVW_MEM_PATH_HOST);

    snprintf(cfg.gpu_path, sizeof(cfg.gpu_path), "auto");
    assert_int_equal(kvw__mem_ctx_init(&f->m, &cfg), KVW_OK);
    assert_int_equal(f->m.force, -1);
    snprintf(cfg.gpu_path, sizeof(cfg.gpu_path), "gpudirect");
    assert_int_equal(kvw__mem_ctx_init(&f->m, &cfg), KVW_ERR_INVALID);
    assert_int_equal(kvw__config_validate(&cfg), KVW_ERR_INVALID);
}

static void test_override_from_environment(void **state)
{
    (void)state;
    kvw_config_t cfg;
    setenv("KVW_GPU_PATH", "dmabuf", 1);
    setenv("KVW_GPU_FLUSH", "1", 1);
    assert_int_equal(kvw_config_init(&cfg), KVW_OK);
    unsetenv("KVW_GPU_PATH");
    unsetenv("KVW_GPU_FLUSH");
    assert_string_equal(cfg.gpu_path, "dmabuf");
    assert_int_equal(cfg.gpu_flush, 1);
    assert_int_equal(cfg.gpu_relaxed_ordering, -1);
    assert_int_equal(kvw__config_gpu_path(&cfg), KVW_MEM_PATH_DMABUF);
    assert_int_equal(kvw__config_validate(&cfg), KVW_OK);
}

static void test_vmm_without_rdma_flag(void **state)
{
    fixture_t *f = *state;
    kvw_mem_plan_t p;
    fake->vmm = true;
    fake->rdma_capable = 0;
    fake->peermem = true;
    assert_int_equal(decide(f, gpu_mem, 4096, &p), KVW_MEM_PATH_STAGING);
    assert_non_null(strstr(p.reason, "VMM allocation"));
    assert_non_null(strstr(p.reason, "gpuDirectRDMACapable"));
    assert_non_null(strstr(p.reason, "expandable_segments"));
    fake->rdma_capable = 1; /* with the flag, dma-buf as usual */
    assert_int_equal(decide(f, gpu_mem, 4096, &p), KVW_MEM_PATH_DMABUF);
}

static void test_managed_memory(void **state)
{
    fixture_t *f = *state;
    kvw_mem_plan_t p;
    fake->type = KVW_CUDA_PTR_MANAGED;
    fake->peermem = true;
    assert_int_equal(decide(f, gpu_mem, 4096, &p), KVW_MEM_PATH_STAGING);
    assert_non_null(strstr(p.reason, "managed memory"));
}

static void test_gpu_without_gpudirect(void **state)
{
    fixture_t *f = *state;
    kvw_mem_plan_t p;
    fake->dev.gdr = 0;
    fake->peermem = true;
    assert_int_equal(decide(f, gpu_mem, 4096, &p), KVW_MEM_PATH_STAGING);
    assert_non_null(strstr(p.reason, "GPU_DIRECT_RDMA_SUPPORTED = 0"));
}

static void test_export_range_clamped(void **state)
{
    (void)state;
    uint64_t start;
    size_t len;
    /* Unclamped: the pages covering the region. */
    kvw__mem_export_range(0x10100, 0x200, 0, 0, 0x1000, &start, &len);
    assert_int_equal(start, 0x10000);
    assert_int_equal(len, 0x1000);
    /* An allocation that starts and ends inside pages: never past it. */
    kvw__mem_export_range(0x10100, 0x200, 0x10080, 0x300, 0x1000, &start, &len);
    assert_int_equal(start, 0x10080);
    assert_int_equal(len, 0x300);
    /* A region ending at the allocation's unaligned end. */
    kvw__mem_export_range(0x20000, 0x1800, 0x20000, 0x1800, 0x1000, &start, &len);
    assert_int_equal(start, 0x20000);
    assert_int_equal(len, 0x1800);
}

static void test_decide_clamps_to_allocation(void **state)
{
    fixture_t *f = *state;
    kvw_mem_plan_t p;
    long page = sysconf(_SC_PAGESIZE);
    fake_cuda_set_alloc_size(gpu_mem, (uint64_t)(2 * page + 100)); /* ends mid-page */
    assert_int_equal(decide(f, gpu_mem + page + 8, (size_t)page + 92, &p), KVW_MEM_PATH_DMABUF);
    assert_int_equal(p.start, (uint64_t)(uintptr_t)gpu_mem + (uint64_t)page);
    assert_int_equal(p.len, (size_t)page + 100);
    /* Past the allocation's end: one dma-buf cannot cover it. */
    fake->peermem = true;
    assert_int_equal(decide(f, gpu_mem + page, 2 * (size_t)page, &p), KVW_MEM_PATH_PEERMEM);
    assert_non_null(strstr(p.reason, "runs past the end of its CUDA allocation"));
}

static void test_query_failure_is_explained(void **state)
{
    fixture_t *f = *state;
    kvw_mem_plan_t p;
    fake->query_fails = true;
    assert_int_equal(decide(f, gpu_mem, 4096, &p), KVW_MEM_PATH_HOST);
    assert_non_null(strstr(p.reason, "CUDA could not classify"));
}

/* ---- registration ------------------------------------------------------------------ */

static void test_host_registration_unchanged(void **state)
{
    fixture_t *f = *state;
    static uint8_t host[16384];
    kvw_mr_t a = {0}, b = {0};
    assert_int_equal(kvw__mem_register_in(&f->m, f->dev, host, 8192, true, &a), KVW_OK);
    assert_int_equal(kvw__mem_register_in(&f->m, f->dev, host + 8192, 8192, false, &b), KVW_OK);
    assert_int_equal(a.path, KVW_MEM_PATH_HOST);
    assert_int_equal(a.kind, KVW_MEM_HOST);
    assert_int_equal(a.addr, (uint64_t)(uintptr_t)host);
    assert_int_equal(a.lkey, a.mr->lkey);
    /* No relaxed ordering on host memory by default. */
    assert_int_equal(fake_nic_mr_access(host), IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
    assert_int_equal(fake_nic_mr_access(host + 8192), IBV_ACCESS_LOCAL_WRITE);
    assert_false(kvw__mem_needs_flush(&f->m));
    kvw__mem_deregister(f->dev, &a);
    kvw__mem_deregister(f->dev, &b);
    kvw__mem_deregister(f->dev, &b); /* twice is harmless */
    assert_int_equal(kvw__mem_register(f->dev, host, 4096, true, &a), KVW_OK);
    kvw__mem_deregister(f->dev, &a);
    /* Relaxed ordering everywhere when asked. */
    kvw_config_t cfg;
    kvw_config_init(&cfg);
    cfg.gpu_relaxed_ordering = 1;
    kvw__mem_ctx_init(&f->m, &cfg);
    assert_int_equal(kvw__mem_register_in(&f->m, f->dev, host, 8192, false, &a), KVW_OK);
    assert_true(fake_nic_mr_access(host) & IBV_ACCESS_RELAXED_ORDERING);
    kvw__mem_deregister(f->dev, &a);
}

static void test_gpu_dmabuf_registration(void **state)
{
    fixture_t *f = *state;
    long page = sysconf(_SC_PAGESIZE);
    kvw_mr_t mr = {0}, mr2 = {0};
    uint8_t *addr = gpu_mem + page + 16;
    assert_int_equal(kvw__mem_register_in(&f->m, f->dev, addr, 1000, true, &mr), KVW_OK);
    assert_int_equal(mr.path, KVW_MEM_PATH_DMABUF);
    assert_int_equal(mr.kind, KVW_MEM_CUDA);
    assert_int_equal(cuda_stats().exports, 1);
    assert_int_equal(cuda_stats().export_start, (uint64_t)(uintptr_t)(gpu_mem + page));
    assert_int_equal(cuda_stats().export_len, (size_t)page);
    /* The MR is at the region's own address, with relaxed ordering. */
    assert_int_equal(fake_nic_mr_access(addr), IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE |
                                                   IBV_ACCESS_RELAXED_ORDERING);
    assert_ptr_equal(mr.mr->addr, addr);
    assert_int_equal(mr.mr->length, 1000);
    /* The choice is logged once per engine, not once per region. */
    assert_int_equal(kvw__mem_register_in(&f->m, f->dev, addr + 4096, 1000, true, &mr2), KVW_OK);
    assert_int_equal(count_lines("regions: dmabuf"), 1);
    /* Hopper orders GPUDirect writes for its own kernels: no flush. */
    assert_false(kvw__mem_needs_flush(&f->m));
    kvw__mem_deregister(f->dev, &mr);
    kvw__mem_deregister(f->dev, &mr2);
}

static void test_gpu_peermem_registration(void **state)
{
    fixture_t *f = *state;
    kvw_mr_t mr = {0};
    fake->peermem = true;
    assert_int_equal(kvw__mem_register_in(&f->m, f->dev, gpu_mem, 8192, false, &mr), KVW_OK);
    assert_int_equal(mr.path, KVW_MEM_PATH_PEERMEM);
    assert_int_equal(cuda_stats().exports, 0);
    assert_int_equal(fake_nic_mr_access(gpu_mem),
                     IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_RELAXED_ORDERING);
    assert_non_null(strstr(logbuf, "regions: peermem"));
    assert_non_null(strstr(logbuf, "refuses dma-buf"));
    kvw__mem_deregister(f->dev, &mr);
}

static void test_flush(void **state)
{
    fixture_t *f = *state;
    kvw_mr_t mr = {0}, src = {0};
    fake->dev.cc_major = 8; /* Ampere: writes not ordered for the owner */
    fake->dev.writes_ordering = 0;
    /* Prefill's regions (no remote write) never need it. */
    assert_int_equal(kvw__mem_register_in(&f->m, f->dev, gpu_mem, 4096, false, &src), KVW_OK);
    assert_false(kvw__mem_needs_flush(&f->m));
    assert_int_equal(kvw__mem_flush_gpu_writes(&f->m), KVW_OK);
    assert_int_equal(cuda_stats().flushes, 0);
    assert_int_equal(kvw__mem_register_in(&f->m, f->dev, gpu_mem + 8192, 4096, true, &mr), KVW_OK);
    assert_true(kvw__mem_needs_flush(&f->m));
    assert_int_equal(kvw__mem_flush_gpu_writes(&f->m), KVW_OK);
    assert_int_equal(cuda_stats().flushes, 1);
    assert_ptr_equal(cuda_stats().flushed_ctx, fake_cuda_ctx());
    assert_non_null(strstr(logbuf, "flushes GPUDirect writes"));
    kvw__mem_deregister(f->dev, &mr);
    kvw__mem_deregister(f->dev, &src);

    /* gpu_flush=0 turns it off; =1 turns it on for Hopper too. */
    kvw_config_t cfg;
    kvw_config_init(&cfg);
    cfg.gpu_flush = 0;
    kvw__mem_ctx_init(&f->m, &cfg);
    assert_int_equal(kvw__mem_register_in(&f->m, f->dev, gpu_mem, 4096, true, &mr), KVW_OK);
    assert_false(kvw__mem_needs_flush(&f->m));
    kvw__mem_deregister(f->dev, &mr);
    fake->dev.cc_major = 9;
    fake->dev.writes_ordering = 100;
    cfg.gpu_flush = 1;
    kvw__mem_ctx_init(&f->m, &cfg);
    assert_int_equal(kvw__mem_register_in(&f->m, f->dev, gpu_mem, 4096, true, &mr), KVW_OK);
    assert_true(kvw__mem_needs_flush(&f->m));
    kvw__mem_deregister(f->dev, &mr);
}

static void test_choose_is_pure(void **state)
{
    (void)state;
    /* What kvwire-info asks: a cudaMalloc region on a GPU, no NIC probe. */
    kvw_cuda_dev_t gpu = {.dmabuf = 1, .gdr = 1};
    kvw_mem_facts_t facts = {.force = -1,
                             .ptr = {.type = KVW_CUDA_PTR_DEVICE, .rdma_capable = -1},
                             .gpu = &gpu,
                             .nic_dmabuf = -1};
    char why[KVW_MEM_REASON_MAX];
    assert_int_equal(kvw__mem_choose(&facts, why, sizeof(why)), KVW_MEM_PATH_DMABUF);
    gpu.dmabuf = -1; /* an old driver that cannot say: try it */
    assert_int_equal(kvw__mem_choose(&facts, why, sizeof(why)), KVW_MEM_PATH_DMABUF);
    facts.nic_dmabuf = 0;
    facts.nic_dmabuf_why = "rxe0 refuses dma-buf registration (Operation not supported)";
    assert_int_equal(kvw__mem_choose(&facts, why, sizeof(why)), KVW_MEM_PATH_STAGING);
    assert_non_null(strstr(why, "rxe0 refuses"));
    assert_string_equal(kvw__mem_path_name(KVW_MEM_PATH_PEERMEM), "peermem");
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_host_memory_is_host, setup, teardown),
        cmocka_unit_test_setup_teardown(test_dmabuf_first, setup, teardown),
        cmocka_unit_test_setup_teardown(test_peermem_when_gpu_has_no_dmabuf, setup, teardown),
        cmocka_unit_test_setup_teardown(test_peermem_when_nic_refuses_dmabuf, setup_no_nic_dmabuf,
                                        teardown),
        cmocka_unit_test_setup_teardown(test_staging_when_neither, setup, teardown),
        cmocka_unit_test_setup_teardown(test_override_honoured, setup, teardown),
        cmocka_unit_test(test_override_from_environment),
        cmocka_unit_test_setup_teardown(test_vmm_without_rdma_flag, setup, teardown),
        cmocka_unit_test_setup_teardown(test_managed_memory, setup, teardown),
        cmocka_unit_test_setup_teardown(test_gpu_without_gpudirect, setup, teardown),
        cmocka_unit_test(test_export_range_clamped),
        cmocka_unit_test_setup_teardown(test_decide_clamps_to_allocation, setup, teardown),
        cmocka_unit_test_setup_teardown(test_query_failure_is_explained, setup, teardown),
        cmocka_unit_test_setup_teardown(test_host_registration_unchanged, setup, teardown),
        cmocka_unit_test_setup_teardown(test_gpu_dmabuf_registration, setup, teardown),
        cmocka_unit_test_setup_teardown(test_gpu_peermem_registration, setup_no_nic_dmabuf,
                                        teardown),
        cmocka_unit_test_setup_teardown(test_flush, setup, teardown),
        cmocka_unit_test(test_choose_is_pure),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
