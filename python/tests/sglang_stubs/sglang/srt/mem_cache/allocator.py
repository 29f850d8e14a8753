# SPDX-License-Identifier: Apache-2.0
"""Stub of sglang.srt.mem_cache.allocator: the base class name only."""


class BaseTokenToKVPoolAllocator:
    pass
