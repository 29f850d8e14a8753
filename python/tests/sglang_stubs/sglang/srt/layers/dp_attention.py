# SPDX-License-Identifier: Apache-2.0
"""Stub of sglang.srt.layers.dp_attention (values from runtime_context)."""
from sglang.srt.runtime_context import get_parallel


def get_attention_dp_rank():
    return get_parallel().attn_dp_rank


def get_attention_dp_size():
    return get_parallel().attn_dp_size


def get_attention_tp_rank():
    return get_parallel().attn_tp_rank


def get_attention_tp_size():
    return get_parallel().attn_tp_size
