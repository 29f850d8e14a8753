# SPDX-License-Identifier: Apache-2.0
"""Stub of sglang.srt.mem_cache.swa_memory_pool (isinstance target)."""
from sglang.srt.mem_cache.base_swa_memory_pool import BaseSWAKVPool


class SWAKVPool(BaseSWAKVPool):
    pass
