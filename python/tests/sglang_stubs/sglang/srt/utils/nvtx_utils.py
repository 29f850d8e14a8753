# SPDX-License-Identifier: Apache-2.0
"""Stub of sglang.srt.utils.nvtx_utils: the profiling decorator, a no-op."""


def scheduler_nvtx_method(*args, **kwargs):
    if len(args) == 1 and callable(args[0]) and not kwargs:
        return args[0]
    return lambda f: f
