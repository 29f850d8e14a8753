# SPDX-License-Identifier: Apache-2.0
"""Stub of sglang.srt.environ: envs.NAME.get() with sglang's defaults for
the variables the disaggregation code reads; $NAME overrides."""
import os

_DEFAULTS = {
    "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": 300,
    "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": 300,
    "SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": 5.0,
    "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE": 2,
    "SGLANG_DISAGGREGATION_BOOTSTRAP_ENTRY_CLEANUP_INTERVAL": 120,
    "SGLANG_DISAGGREGATION_THREAD_POOL_SIZE": None,
    "SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER": False,
    "SGLANG_DISAGGREGATION_FORCE_QUERY_PREFILL_DP_RANK": False,
    "SGLANG_DISAGG_STAGING_BUFFER": False,
    # read by the scheduler queues (prefill.py, decode.py, utils.py)
    "SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION": 4096,
    "SGLANG_DISAGGREGATION_SAMPLING_MASK_MAX_TOKENS": 0,
    "SGLANG_MOONCAKE_CUSTOM_MEM_POOL": None,
    "SGLANG_TEST_DISAGG_FAILURE_PROB": 0.0,
    # read by the plugin loader (plugins/__init__.py): a whitelist of names
    "SGLANG_PLUGINS": None,
}


class _Var:
    def __init__(self, name):
        self.name = name

    def get(self):
        d = _DEFAULTS.get(self.name)
        v = os.environ.get(self.name)
        if v is None:
            return d
        if isinstance(d, bool):
            return v.lower() in ("1", "true", "yes")
        if isinstance(d, int):
            return int(v)
        if isinstance(d, float):
            return float(v)
        return v


class _Envs:
    def __getattr__(self, name):
        return _Var(name)


envs = _Envs()
