# SPDX-License-Identifier: Apache-2.0
"""Stub of sglang.srt.configs.mamba_utils (a type name for decode.py)."""


class Mamba2CacheParams:
    pass
