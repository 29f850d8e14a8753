# SPDX-License-Identifier: Apache-2.0
"""Stub of sglang.srt.runtime_context.get_parallel(): the attention
TP/CP/DP rank and size of the rank being set up. A test process may hold
several ranks: set_rank() before creating each one's KV manager (which
reads these once, in __init__)."""
import dataclasses


@dataclasses.dataclass
class Parallel:
    attn_tp_size: int = 1
    attn_tp_rank: int = 0
    attn_cp_size: int = 1
    attn_cp_rank: int = 0
    attn_dp_size: int = 1
    attn_dp_rank: int = 0


_current = Parallel()


def set_rank(**kw):
    global _current
    _current = Parallel(**kw)


def get_parallel():
    return _current
