# SPDX-License-Identifier: Apache-2.0
"""Stub of sglang.srt.configs.model_config."""


def get_dsa_index_topk(*args, **kwargs):
    return 0


# The model a test process serves: sglang loads it from the model path (the
# HF config); a test sets its KV head count with set_model(). None: no model,
# from_server_args() raises as sglang's would for a path it cannot load.
_total_kv_heads = None


def set_model(total_kv_heads):
    global _total_kv_heads
    _total_kv_heads = total_kv_heads


class ModelConfig:
    """Stub of sglang's ModelConfig: only the KV head counts."""

    def __init__(self, total_kv_heads):
        self._total = total_kv_heads

    @classmethod
    def from_server_args(cls, server_args, **kwargs):
        if _total_kv_heads is None:
            raise OSError("stub ModelConfig: no model set (set_model)")
        return cls(_total_kv_heads)

    def get_total_num_kv_heads(self):
        return self._total

    def get_num_kv_heads(self, tensor_parallel_size):
        return max(1, self._total // tensor_parallel_size)
