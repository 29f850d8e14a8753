# SPDX-License-Identifier: Apache-2.0
"""Stub of sglang.srt.server_args: the ServerArgs fields the
disaggregation connection code reads (defaults as sglang's)."""
import dataclasses
from typing import Optional

DISAGG_TRANSFER_BACKEND_CHOICES = ["mooncake", "nixl", "ascend", "fake", "mori"]


@dataclasses.dataclass
class ServerArgs:
    host: str = "127.0.0.1"
    port: int = 30000
    disaggregation_mode: str = "null"
    disaggregation_transfer_backend: str = "mooncake"
    disaggregation_bootstrap_port: int = 8998
    disaggregation_ib_device: Optional[str] = None
    # set on the prefill server only: decode's TP / DP sizes (None: as prefill's)
    disaggregation_decode_tp: Optional[int] = None
    disaggregation_decode_dp: Optional[int] = None
    dist_init_addr: Optional[str] = None
    nnodes: int = 1
    tp_size: int = 1
    dp_size: int = 1
    pp_size: int = 1
    enable_dp_attention: bool = False
    kv_cache_dtype: str = "auto"
    load_balance_method: str = "follow_bootstrap_room"
    enable_dsa_cache_layer_split: bool = False
    enable_memory_saver: bool = False  # RL memory release (torch_memory_saver)
    # read by the scheduler queues (decode.py)
    disable_radix_cache: bool = True
    disaggregation_decode_enable_radix_cache: bool = False
