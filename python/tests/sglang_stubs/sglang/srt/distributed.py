# SPDX-License-Identifier: Apache-2.0
"""Stub of sglang.srt.distributed: one process group per rank (nnodes 1)."""


class _Group:
    rank_in_group = 0
    world_size = 1

    def broadcast_object(self, obj, src=0):
        return obj


def get_pp_group():
    return _Group()


def get_world_group():
    return _Group()
