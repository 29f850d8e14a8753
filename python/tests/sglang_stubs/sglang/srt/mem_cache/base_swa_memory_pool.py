# SPDX-License-Identifier: Apache-2.0
"""Stub of sglang.srt.mem_cache.base_swa_memory_pool (isinstance target)."""
from sglang.srt.mem_cache.memory_pool import KVCache


class BaseSWAKVPool(KVCache):
    pass
