# SPDX-License-Identifier: Apache-2.0
"""Stub of sglang.srt.mem_cache.deepseek_v4_memory_pool (isinstance target)."""
from sglang.srt.mem_cache.memory_pool import KVCache


class DeepSeekV4TokenToKVPool(KVCache):
    pass
