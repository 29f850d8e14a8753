# SPDX-License-Identifier: Apache-2.0
"""Stub of sglang.srt.configs.model_config."""


def get_dsa_index_topk(*args, **kwargs):
    return 0


# How often ModelConfig.from_server_args was called in this process:
# kvwire's backend must never load the model's HF config (decode learns its
# KV heads from prefill's handshake), which the tests assert.
from_server_args_calls = 0


class ModelConfig:
    """Stub of sglang's ModelConfig: loading one (sglang reads the HF config
    from the model path) is counted and refused."""

    @classmethod
    def from_server_args(cls, server_args, **kwargs):
        global from_server_args_calls
        from_server_args_calls += 1
        raise RuntimeError("stub ModelConfig: kvwire's backend must not load the model config")
