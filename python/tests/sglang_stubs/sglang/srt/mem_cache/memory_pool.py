# SPDX-License-Identifier: Apache-2.0
"""Stub of sglang.srt.mem_cache.memory_pool: the pool class names the
disaggregation code tests with isinstance (is_mla_backend,
setup_state_kv_args, the decode queue). Test pools subclass KVCache, or
MLATokenToKVPool for an MLA model."""


class KVCache:
    pass


class MHATokenToKVPool(KVCache):
    pass


class MLATokenToKVPool(KVCache):
    pass


class DSATokenToKVPool(MLATokenToKVPool):
    pass


class HybridLinearKVPool(KVCache):
    pass


class MiniMaxSparseKVPool(KVCache):
    pass


class ReqToTokenPool:
    pass


class HybridReqToTokenPool(ReqToTokenPool):
    pass
