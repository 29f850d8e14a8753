# SPDX-License-Identifier: Apache-2.0
"""Stub of sglang.srt.managers.utils (a type name for the queues)."""


class GenerationBatchResult:
    pass
