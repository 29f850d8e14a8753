/* The one place memory is registered. Host memory goes to ibv_reg_mr; GPU
 * memory (detected through the CUDA driver, loaded with dlopen at run time)
 * goes through dma-buf, then nvidia_peermem, else a clear error. */
#ifndef KVW_MEM_MEM_H
#define KVW_MEM_MEM_H

#include "verbs/device.h"

#include <stdbool.h>

typedef enum { KVW_MEM_HOST = 0, KVW_MEM_CUDA = 1 } kvw_mem_kind_t;

typedef struct kvw_mr {
    struct ibv_mr *mr;
    kvw_mem_kind_t kind;
    uint64_t addr;
    size_t len;
    uint32_t lkey, rkey;
} kvw_mr_t;

/* Register [addr, addr+len) for local access, and for remote writes by
 * the peer when remote_write (decode's memory only: prefill's memory is a
 * write source and grants the network nothing). */
kvw_status_t kvw__mem_register(kvw_dev_t *dev, void *addr, size_t len, bool remote_write,
                               kvw_mr_t *mr_p);
/* Accepts a zeroed (never registered) mr. */
void kvw__mem_deregister(kvw_dev_t *dev, kvw_mr_t *mr);

/* CUDA seam (mem/cuda.c). Both return 0 / -1 when the driver is absent. */
int kvw__cuda_is_device_ptr(const void *addr);
/* dma-buf fd for the host-page-aligned range covering [addr, addr+len);
 * *offset_p is addr's offset into it. Returns 0 on success. */
int kvw__cuda_dmabuf_fd(const void *addr, size_t len, int *fd_p, uint64_t *offset_p,
                        size_t *aligned_len_p);
/* Whether the nvidia_peermem module is loaded (plain ibv_reg_mr works). */
int kvw__cuda_peermem_loaded(void);

#endif
