# SPDX-License-Identifier: Apache-2.0
"""Stub of sglang.srt.mem_cache.base_prefix_cache: names the decode queues
import (radix cache and HiCache are off in these tests)."""
import dataclasses


class BasePrefixCache:
    pass


@dataclasses.dataclass
class EvictParams:
    num_tokens: int = 0
    mamba_num: int = 0


@dataclasses.dataclass
class InitLoadBackParams:
    pass
