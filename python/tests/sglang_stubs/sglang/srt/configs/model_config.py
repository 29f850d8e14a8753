# SPDX-License-Identifier: Apache-2.0
"""Stub of sglang.srt.configs.model_config."""


def get_dsa_index_topk(*args, **kwargs):
    return 0
