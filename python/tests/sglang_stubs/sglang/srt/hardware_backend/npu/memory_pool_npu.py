# SPDX-License-Identifier: Apache-2.0
"""Stub of sglang.srt.hardware_backend.npu.memory_pool_npu (isinstance target)."""
from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool


class NPUMLATokenToKVPool(MLATokenToKVPool):
    pass
