# SPDX-License-Identifier: Apache-2.0
"""kvwire.Config: kvw_config_t as a Python object. Internal: re-exported by
kvwire/__init__.py."""

from __future__ import annotations

import ctypes
import os
import tempfile
from typing import Any, Dict, Optional, Tuple

from . import _lib
from ._core import _c, _call, _s

# ----------------------------------------------------------------- config


_CFG_FIELDS: Dict[str, Tuple[int, int]] = {}
for _name, _ct in _lib.kvw_config_t._fields_:
    if _name.startswith("reserved"):  # padding kept zero, not a field
        continue
    if _ct is ctypes.c_uint32:
        _CFG_FIELDS[_name] = (0, (1 << 32) - 1)
    elif _ct is ctypes.c_int32:
        _CFG_FIELDS[_name] = (-(1 << 31), (1 << 31) - 1)
    elif _ct is ctypes.c_uint8:
        _CFG_FIELDS[_name] = (0, 255)
_CFG_TEXT = {"cluster_key_file": 255, "cluster_key": 40, "gpu_path": 15, "devices": 127}


class Config:
    """kvw_config_t: the library's defaults, then the KVW_* environment
    (kvw_config_init), then the keyword overrides given here, by field name
    (sq_depth=..., peer_timeout_ms=..., cluster_key_file=...). Raises
    Error(KVW_ERR_INVALID) when a KVW_* variable does not parse, TypeError
    for an unknown field, ValueError for a value out of the field's range.
    A plain value object: not shared with C after the call that uses it;
    not thread-safe to mutate while another thread reads it."""

    FIELDS: Tuple[str, ...] = tuple(
        n for n, _ in _lib.kvw_config_t._fields_
        if n != "struct_size" and not n.startswith("reserved"))

    def __init__(self, **overrides: Any):
        # kvw_config_init_size writes exactly this binding's struct (a newer
        # library zeroes nothing past it, an older one fills what it knows
        # and zeroes the rest) and sets struct_size.
        object.__setattr__(self, "_c", _lib.kvw_config_t())
        _call(_c.kvw_config_init_size, "kvw_config_init (KVW_* environment)",
              ctypes.byref(self._c), ctypes.sizeof(_lib.kvw_config_t))
        for k, v in overrides.items():
            setattr(self, k, v)

    def __getattr__(self, name: str) -> Any:
        if name in _CFG_TEXT:
            return _s(getattr(self._c, name))
        if name in _CFG_FIELDS:
            return getattr(self._c, name)
        raise AttributeError(f"kvwire.Config has no field {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _CFG_TEXT:
            b = os.fsencode(value) if not isinstance(value, bytes) else value
            if len(b) > _CFG_TEXT[name]:
                raise ValueError(f"kvwire.Config.{name}: longer than {_CFG_TEXT[name]} bytes")
            setattr(self._c, name, b)
        elif name in _CFG_FIELDS:
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"kvwire.Config.{name}: an int, not {type(value).__name__}")
            lo, hi = _CFG_FIELDS[name]
            if not lo <= value <= hi:
                raise ValueError(f"kvwire.Config.{name}: {value} is outside {lo}..{hi}")
            setattr(self._c, name, value)
        else:
            raise TypeError(f"kvwire.Config has no field {name!r} (fields: {', '.join(self.FIELDS)})")

    def as_dict(self) -> Dict[str, Any]:
        """Every field (the cluster key itself shown as '<set>' or '')."""
        d = {n: getattr(self, n) for n in self.FIELDS}
        if d["cluster_key"]:
            d["cluster_key"] = "<set>"
        return d

    def dump(self) -> str:
        """kvw_config_print's text: "name = value (ENV_VAR)" per field."""
        libc = ctypes.CDLL(None)
        libc.fdopen.restype = ctypes.c_void_p
        libc.fdopen.argtypes = [ctypes.c_int, ctypes.c_char_p]
        libc.fclose.argtypes = [ctypes.c_void_p]
        with tempfile.TemporaryFile() as tf:
            fp = libc.fdopen(os.dup(tf.fileno()), b"w")
            if not fp:
                raise OSError("fdopen failed")
            _c.kvw_config_print(ctypes.byref(self._c), fp)
            libc.fclose(fp)
            tf.seek(0)
            return tf.read().decode("utf-8", "replace")

    def __repr__(self) -> str:
        return "kvwire.Config(" + ", ".join(f"{k}={v!r}" for k, v in self.as_dict().items()) + ")"


def _cfg_ptr(config: Optional[Config]) -> Any:
    if config is None:
        return None
    if not isinstance(config, Config):
        raise TypeError("config must be a kvwire.Config or None")
    return ctypes.pointer(config._c)
