# SPDX-License-Identifier: Apache-2.0
"""Stub of sglang.srt.constants: the memory tag names."""
GPU_MEMORY_TYPE_KV_CACHE = "kv_cache"
GPU_MEMORY_TYPE_WEIGHTS = "weights"
