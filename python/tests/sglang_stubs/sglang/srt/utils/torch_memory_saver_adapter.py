# SPDX-License-Identifier: Apache-2.0
"""Stub of sglang.srt.utils.torch_memory_saver_adapter: memory saver off."""
import contextlib


class TorchMemorySaverAdapter:
    @staticmethod
    def create(enable: bool = False):
        assert not enable, "the memory saver is not part of these tests"
        return TorchMemorySaverAdapter()

    def region(self, tag=None):
        return contextlib.nullcontext()
