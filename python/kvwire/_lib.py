# SPDX-License-Identifier: Apache-2.0
"""ctypes declarations for libkvwire (include/kvwire.h) and the loader.

Internal module: the public API is in kvwire/__init__.py. Every structure
here mirrors one in include/kvwire.h field for field; python/tests/test_abi.py
compiles the header and checks sizes and offsets so the two cannot drift.

Functions that a given libkvwire may lack (the API grows) are looked up
one by one: a missing one is None in `optional`, and the feature that needs
it raises kvwire.Error(KVW_ERR_UNSUPPORTED) naming the symbol, instead of
failing the import.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from ctypes import (
    CFUNCTYPE,
    POINTER,
    Structure,
    c_char,
    c_char_p,
    c_int,
    c_int32,
    c_size_t,
    c_uint8,
    c_uint32,
    c_uint64,
    c_void_p,
)
from typing import Dict, List, Optional

# ------------------------------------------------------------ structures


# Every structure the caller fills in (config, engine and bootstrap params)
# starts with struct_size, set to ctypes.sizeof of this binding's mirror
# (include/kvwire.h "sized structs"); new fields are appended, never inserted.


class kvw_config_t(Structure):
    _fields_ = [
        ("struct_size", c_size_t),
        ("sq_depth", c_uint32),
        ("rq_depth", c_uint32),
        ("chain_max", c_uint32),
        ("signal_every", c_uint32),
        ("poll_spin_us", c_uint32),
        ("bootstrap_timeout_ms", c_uint32),
        ("transfer_timeout_ms", c_uint32),
        ("heartbeat_ms", c_uint32),
        ("peer_timeout_ms", c_uint32),
        ("idle_heartbeat_ms", c_uint32),
        ("bootstrap_refresh_ms", c_uint32),
        ("max_peers", c_uint32),
        ("orphan_ttl_ms", c_uint32),
        ("max_orphans_per_peer", c_uint32),
        ("max_orphan_mib_per_peer", c_uint32),
        ("gid_index", c_int32),
        ("ib_port", c_uint8),
        ("qp_timeout", c_uint8),
        ("qp_retry_cnt", c_uint8),
        ("qp_rnr_retry", c_uint8),
        ("cluster_key_file", c_char * 256),
        ("cluster_key", c_char * 41),
        ("traffic_class", c_uint8),
        ("service_level", c_uint8),
        ("hop_limit", c_uint8),
        ("flow_label", c_int32),
        ("ib_use_grh", c_int32),
        ("gpu_path", c_char * 16),
        ("gpu_flush", c_int32),
        ("gpu_relaxed_ordering", c_int32),
        ("staging_mib", c_uint32),
        ("staging_chunk_kib", c_uint32),
        ("staging_lanes", c_uint32),
        ("qps_per_peer", c_uint32),
        ("poll_busy_us", c_uint32),
        ("max_handshakes", c_uint32),
        ("landing_mib", c_uint32),
        ("devices", ctypes.c_char * 128),
        ("reserved_1_4", c_uint32),  # 1.3's tail padding: never read
        ("verify", c_uint32),
    ]


class kvw_region_t(Structure):
    _fields_ = [("addr", c_void_p), ("len", c_size_t), ("item_len", c_size_t)]


class kvw_group_t(Structure):
    _fields_ = [
        ("kind", c_int),
        ("num_layers", c_uint32),
        ("regions_per_layer", c_uint32),
        ("regions", POINTER(kvw_region_t)),
    ]


class kvw_group_heads_t(Structure):
    _fields_ = [
        (name, c_uint32)
        for name in (
            "total_heads",
            "first_head",
            "num_heads",
            "head_bytes",
            "page_tokens",
            "page_order",
        )
    ]


class kvw_engine_params_t(Structure):
    _fields_ = [
        ("struct_size", c_size_t),
        ("role", c_int),
        ("engine_rank", c_uint32),
        ("device", c_char_p),
        ("local_ip", c_char_p),
        ("bootstrap_addr", c_char_p),
        ("num_layers", c_uint32),
        ("kv_regions", POINTER(kvw_region_t)),
        ("num_aux", c_uint32),
        ("aux_regions", POINTER(kvw_region_t)),
        ("config", POINTER(kvw_config_t)),
        ("num_groups", c_uint32),
        ("groups", POINTER(kvw_group_t)),
        ("group_heads", POINTER(kvw_group_heads_t)),
        # 1.4: the lengths of the arrays above whose length the layout
        # implies (0 / NULL: implied); the binding always fills them.
        ("num_kv_regions", c_size_t),
        ("num_group_heads", c_size_t),
        ("group_num_regions", POINTER(c_size_t)),
        # 1.5: decode's attention TP place, for KV groups that learn their
        # heads from prefill (GroupHeads.learned); 0, 0: none learns.
        ("attn_tp_rank", c_uint32),
        ("attn_tp_size", c_uint32),
    ]


class kvw_counters_t(Structure):
    _fields_ = [
        (name, c_uint64)
        for name in (
            "bytes_posted",
            "wrs_posted",
            "chains_posted",
            "completions",
            "wrs_completed",
            "wrs_flushed",
            "errors",
            "requests_ok",
            "requests_failed",
            "cq_sleeps",
            "caller_passes",
            "handshakes",  # 1.5 (kvw_engine_counters_ex)
            "handshakes_refused",
        )
    ]


class kvw_bootstrap_params_t(Structure):
    _fields_ = [
        ("struct_size", c_size_t),
        ("bind_addr", c_char_p),
        ("config", POINTER(kvw_config_t)),
        ("lease_ms", c_uint32),
    ]


class kvw_indices_t(Structure):
    _fields_ = [
        ("pages", POINTER(c_uint64)),
        ("num_pages", c_size_t),
        ("aux_index", c_uint32),
        ("state", POINTER(c_uint64)),
        ("num_state", c_size_t),
    ]


class kvw_state_list_t(Structure):
    _fields_ = [
        ("group", c_uint32),
        ("reserved", c_uint32),
        ("indices", POINTER(c_uint64)),
        ("count", c_size_t),
    ]


class kvw_part_t(Structure):
    _fields_ = [
        ("pages", POINTER(c_uint64)),
        ("num_pages", c_size_t),
        ("first_page", c_size_t),
        ("layer_begin", c_uint32),
        ("layer_end", c_uint32),
    ]


class kvw_req_metrics_t(Structure):
    _fields_ = [
        ("bytes", c_uint64),
        ("writes", c_uint64),
        ("transfer_us", c_uint64),
        ("start_ns", c_uint64),
        ("end_ns", c_uint64),
    ]


class kvw_rail_t(Structure):
    _fields_ = [
        ("device", ctypes.c_char * 64),
        ("gid_index", ctypes.c_int32),
        ("link_mbps", c_uint32),
        ("wrs_posted", c_uint64),
        ("bytes_posted", c_uint64),
    ]


class kvw_rail_health_t(Structure):
    _fields_ = [
        ("lanes_failed", c_uint32),
        ("lanes_rejoined", c_uint32),
        ("lanes_out", c_uint32),
        ("probes", c_uint32),
        ("recovery_us_last", c_uint64),
        ("recovery_us_max", c_uint64),
    ]


class kvw_log_record_t(Structure):
    _fields_ = [
        ("level", c_int),
        ("subsystem", c_char_p),
        ("engine", c_char_p),
        ("msg", c_char_p),
        ("line", c_char_p),
    ]


class kvw_prefill_rank_t(Structure):
    _fields_ = [
        ("bootstrap_addr", c_char_p),
        ("endpoint", c_char_p),
        ("rank", c_uint32),
    ]


class kvw_receiver_params_t(Structure):
    _fields_ = [
        ("struct_size", c_size_t),
        ("room", c_uint64),
        ("num_ranks", c_uint32),
        ("ranks", POINTER(kvw_prefill_rank_t)),
        ("room_receivers", c_uint32),  # 1.5
    ]


STRUCTS = {
    "kvw_config_t": kvw_config_t,
    "kvw_region_t": kvw_region_t,
    "kvw_group_t": kvw_group_t,
    "kvw_group_heads_t": kvw_group_heads_t,
    "kvw_engine_params_t": kvw_engine_params_t,
    "kvw_counters_t": kvw_counters_t,
    "kvw_bootstrap_params_t": kvw_bootstrap_params_t,
    "kvw_indices_t": kvw_indices_t,
    "kvw_state_list_t": kvw_state_list_t,
    "kvw_part_t": kvw_part_t,
    "kvw_rail_t": kvw_rail_t,
    "kvw_rail_health_t": kvw_rail_health_t,
    "kvw_log_record_t": kvw_log_record_t,
    "kvw_req_metrics_t": kvw_req_metrics_t,
    "kvw_prefill_rank_t": kvw_prefill_rank_t,
    "kvw_receiver_params_t": kvw_receiver_params_t,
}

LOG_FN = CFUNCTYPE(None, c_void_p, c_int, c_char_p)
LOG_RECORD_FN = CFUNCTYPE(None, c_void_p, POINTER(kvw_log_record_t))
NO_AUX = 0xFFFFFFFF

# ------------------------------------------------------------ prototypes

_u64p = POINTER(c_uint64)
_cp = c_char_p
# name: (restype, argtypes). Handles are plain c_void_p.
REQUIRED = {
    "kvw_version": (ctypes.c_uint, []),
    "kvw_version_string": (_cp, []),
    "kvw_strerror": (_cp, [c_int]),
    "kvw_status_name": (_cp, [c_int]),
    "kvw_poll_name": (_cp, [c_int]),
    "kvw_set_log_handler": (None, [LOG_FN, c_void_p, c_int]),
    "kvw_config_init_size": (c_int, [POINTER(kvw_config_t), c_size_t]),
    "kvw_config_print": (None, [POINTER(kvw_config_t), c_void_p]),
    "kvw_engine_create": (c_int, [POINTER(kvw_engine_params_t), POINTER(c_void_p)]),
    "kvw_engine_destroy": (None, [c_void_p]),
    "kvw_engine_device_name": (_cp, [c_void_p]),
    "kvw_engine_gid_index": (c_int, [c_void_p]),
    "kvw_engine_endpoint": (_cp, [c_void_p]),
    "kvw_engine_counters": (None, [c_void_p, POINTER(kvw_counters_t)]),
    "kvw_engine_counters_ex": (c_int, [c_void_p, POINTER(kvw_counters_t), c_size_t]),
    "kvw_sender_create": (c_int, [c_void_p, c_uint64, POINTER(c_void_p)]),
    "kvw_sender_init": (c_int, [c_void_p, c_size_t, c_uint32]),
    "kvw_sender_send": (c_int, [c_void_p, _u64p, c_size_t]),
    "kvw_sender_poll": (c_int, [c_void_p]),
    "kvw_sender_failure": (c_int, [c_void_p, POINTER(c_char_p)]),
    "kvw_sender_abort": (c_int, [c_void_p]),
    "kvw_sender_destroy": (None, [c_void_p]),
    "kvw_receiver_create": (c_int, [c_void_p, c_char_p, c_uint32, c_uint64, POINTER(c_void_p)]),
    "kvw_receiver_init": (c_int, [c_void_p, _u64p, c_size_t, c_uint32]),
    "kvw_receiver_poll": (c_int, [c_void_p]),
    "kvw_receiver_failure": (c_int, [c_void_p, POINTER(c_char_p)]),
    "kvw_receiver_abort": (c_int, [c_void_p]),
    "kvw_receiver_destroy": (None, [c_void_p]),
    "kvw_bootstrap_create": (c_int, [POINTER(kvw_bootstrap_params_t), POINTER(c_void_p)]),
    "kvw_bootstrap_addr": (_cp, [c_void_p]),
    "kvw_bootstrap_destroy": (None, [c_void_p]),
}
# Newer calls; each may be missing from an older libkvwire.
OPTIONAL = {
    "kvw_config_validate": (c_int, [POINTER(kvw_config_t)]),
    "kvw_receiver_init_indices": (c_int, [c_void_p, POINTER(kvw_indices_t)]),
    "kvw_sender_send_part": (c_int, [c_void_p, POINTER(kvw_part_t)]),
    "kvw_sender_send_state": (c_int, [c_void_p, _u64p, c_size_t]),
    "kvw_sender_metrics": (c_int, [c_void_p, POINTER(kvw_req_metrics_t)]),
    "kvw_receiver_metrics": (c_int, [c_void_p, POINTER(kvw_req_metrics_t)]),
    # The producer's CUDA event (a CUevent / cudaEvent_t, passed as a pointer).
    "kvw_sender_send_after": (c_int, [c_void_p, _u64p, c_size_t, c_void_p]),
    "kvw_sender_send_part_after": (c_int, [c_void_p, POINTER(kvw_part_t), c_void_p]),
    # Hybrid models: an index list per state group (1.2).
    "kvw_receiver_init_lists": (c_int, [c_void_p, POINTER(kvw_indices_t),
                                        POINTER(kvw_state_list_t), c_size_t]),
    "kvw_sender_send_state_lists": (c_int, [c_void_p, _u64p, c_size_t,
                                            POINTER(kvw_state_list_t), c_size_t]),
    # Decode over several prefill ranks (head slicing, decode TP < prefill TP).
    "kvw_receiver_create_ranks": (c_int, [c_void_p, POINTER(kvw_receiver_params_t),
                                          POINTER(c_void_p)]),
    # Prefill over several decode receivers (decode TP > prefill TP).
    "kvw_sender_create_fanout": (c_int, [c_void_p, c_uint64, c_uint32, POINTER(c_void_p)]),
    # ... with the count decode's requests say (1.5, wire 12).
    "kvw_sender_create_learn": (c_int, [c_void_p, c_uint64, POINTER(c_void_p)]),
    "kvw_receiver_set_room_receivers": (c_int, [c_void_p, c_uint32]),
    # An engine's rails (KVW_DEVICES, 1.2).
    "kvw_engine_rails": (c_uint32, [c_void_p, POINTER(kvw_rail_t), c_uint32]),
    "kvw_engine_rail_health": (c_uint32, [c_void_p, POINTER(kvw_rail_health_t), c_uint32]),
    # Verified transfers, the caller's digests (config verify, 1.4).
    "kvw_sender_set_digest": (c_int, [c_void_p, c_uint64]),
    "kvw_receiver_landed": (c_int, [c_void_p]),
    "kvw_receiver_verify": (c_int, [c_void_p, c_uint64]),
    # Metrics in the OpenMetrics text format; log records (1.5).
    "kvw_engine_metrics_text": (c_int, [c_void_p, c_void_p, c_size_t, POINTER(c_size_t)]),
    "kvw_set_log_record_handler": (None, [LOG_RECORD_FN, c_void_p, c_int]),
}
# KVW_MAX_DECODE_RECEIVERS: the most decode receivers one fan-out sender serves.
MAX_DECODE_RECEIVERS = 64
# KVW_MAX_PREFILL_RANKS: the most ranks one kvw_receiver_create_ranks takes.
MAX_PREFILL_RANKS = 64
# The most buffer groups kvw_engine_create takes (src/plan/layout.h,
# KVW_LAYOUT_MAX_GROUPS; the header says "at most 64 groups").
MAX_GROUPS = 64
# Buffer groups change kvw_engine_params_t, which no symbol names: a library
# that has the calls introduced with them is taken to understand groups.
GROUPS_MARKER = "kvw_receiver_init_indices"

# ------------------------------------------------------------ loading

# The library major (SONAME) these declarations mirror: structures and
# prototypes change incompatibly only with it (docs/api-policy.md), and a
# library of another major is refused at load time.
ABI_MAJOR = 1
SONAME = f"libkvwire.so.{ABI_MAJOR}"


class Lib:
    """The loaded library: `c` is the ctypes.CDLL (which releases the GIL
    around every call), `path` where it came from, `optional` the newer
    functions (None when missing)."""

    def __init__(self, cdll: ctypes.CDLL, path: str):
        self.c = cdll
        self.path = path
        missing = []
        for name, (res, args) in REQUIRED.items():
            try:
                fn = getattr(cdll, name)
            except AttributeError:
                missing.append(name)
                continue
            fn.restype = res
            fn.argtypes = args
        if missing:
            raise OSError(f"{path} lacks {', '.join(missing)}: not a libkvwire this binding knows")
        major = int(cdll.kvw_version()) // 10000
        if major != ABI_MAJOR:
            raise OSError(f"{path} is libkvwire {major}.x; this binding needs {ABI_MAJOR}.x")
        self.optional: Dict[str, Optional[object]] = {}
        for name, (res, args) in OPTIONAL.items():
            fn = getattr(cdll, name, None)
            if fn is not None:
                fn.restype = res
                fn.argtypes = args
            self.optional[name] = fn

    def has(self, name: str) -> bool:
        return self.optional.get(name) is not None


def candidates() -> List[str]:
    """Where libkvwire is looked for, in order: $KVWIRE_LIB (a file), next to
    this package (an install that copied the library in), the source tree's
    build directories (running from python/ in a checkout), then the
    system's search path (ctypes.util.find_library, ldconfig)."""
    out: List[str] = []
    env = os.environ.get("KVWIRE_LIB")
    if env:
        out.append(env)
        return out  # an explicit choice is never second-guessed
    here = os.path.dirname(os.path.abspath(__file__))
    for name in (SONAME, "libkvwire.so"):
        out.append(os.path.join(here, name))
    repo = os.path.dirname(os.path.dirname(here))
    if os.path.exists(os.path.join(repo, "include", "kvwire.h")):
        out.append(os.path.join(repo, "build", SONAME))
    found = ctypes.util.find_library("kvwire")
    if found:
        out.append(found)
    out.append(SONAME)  # the dynamic loader's own search (LD_LIBRARY_PATH)
    return out


_loaded: Optional[Lib] = None


def load() -> Lib:
    """Load libkvwire once per process (thread-safe enough: a race loads the
    same library twice, which dlopen makes one)."""
    global _loaded
    if _loaded is not None:
        return _loaded
    errors = []
    for path in candidates():
        if os.sep in path and not os.path.exists(path):
            errors.append(f"{path}: no such file")
            continue
        try:
            _loaded = Lib(ctypes.CDLL(path), path)
            return _loaded
        except OSError as e:
            errors.append(f"{path}: {e}")
    raise ImportError(
        "kvwire: cannot load libkvwire (build it with `make`, then set KVWIRE_LIB="
        f"/path/to/{SONAME} or install it): " + "; ".join(errors)
    )
