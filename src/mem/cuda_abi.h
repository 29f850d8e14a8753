/* SPDX-License-Identifier: Apache-2.0 */
/* The few CUDA driver API types and constants kvwire uses, from cuda.h (a
 * stable ABI), so that CUDA is never a build dependency: src/mem/cuda.c
 * and tests/tools/kvw-gpucheck.c load libcuda.so.1 with dlopen and call it
 * through these. */
#ifndef KVW_MEM_CUDA_ABI_H
#define KVW_MEM_CUDA_ABI_H

#include <stddef.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr_t;
typedef unsigned long long CUmemHandle_t;
typedef void *CUcontext_t;
typedef void *CUstream_t;
typedef void *CUevent_t;

enum {
    CUDA_SUCCESS = 0,
    CUDA_ERROR_INVALID_VALUE = 1,
    CUDA_ERROR_INVALID_CONTEXT = 201,
    CUDA_ERROR_NOT_READY = 600,
    CU_POINTER_ATTRIBUTE_CONTEXT = 1,
    CU_POINTER_ATTRIBUTE_MEMORY_TYPE = 2,
    CU_POINTER_ATTRIBUTE_IS_MANAGED = 8,
    CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL = 9,
    CU_POINTER_ATTRIBUTE_RANGE_START_ADDR = 11,
    CU_POINTER_ATTRIBUTE_RANGE_SIZE = 12,
    CU_POINTER_ATTRIBUTE_IS_GPU_DIRECT_RDMA_CAPABLE = 15,
    CU_MEMORYTYPE_HOST = 1,
    CU_MEMORYTYPE_DEVICE = 2,
    CU_DEVICE_ATTRIBUTE_PCI_BUS_ID = 33,
    CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75,
    CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR = 76,
    CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED = 110,
    CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED = 116,
    CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WRITES_ORDERING = 118,
    CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED = 124,
    CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD = 1,
    CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TARGET_CURRENT_CTX = 0,
    CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TO_OWNER = 100,
    CU_MEMHOSTALLOC_PORTABLE = 0x01,
    CU_STREAM_NON_BLOCKING = 0x1,
    CU_MEM_ALLOCATION_TYPE_PINNED = 1,
    CU_MEM_LOCATION_TYPE_DEVICE = 1,
    CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3,
    CU_MEM_ATTACH_GLOBAL = 1,
    CU_MEMORYTYPE_UNIFIED = 4,
};

/* CUDA_MEMCPY2D (cuMemcpy2DAsync_v2). */
typedef struct {
    size_t src_x_bytes, src_y;
    int src_memory_type;
    const void *src_host;
    CUdeviceptr_t src_device;
    void *src_array;
    size_t src_pitch;
    size_t dst_x_bytes, dst_y;
    int dst_memory_type;
    void *dst_host;
    CUdeviceptr_t dst_device;
    void *dst_array;
    size_t dst_pitch;
    size_t width_bytes, height;
} cu_memcpy2d_t;

/* CUmemAllocationProp. */
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
} cu_mem_prop_t;

/* CUmemAccessDesc. */
typedef struct {
    struct {
        int type, id;
    } location;
    unsigned long long flags;
} cu_access_desc_t;

#endif
