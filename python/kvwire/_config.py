# SPDX-License-Identifier: Apache-2.0
"""kvwire.Config: kvw_config_t as a Python object. Internal: re-exported by
kvwire/__init__.py."""

from __future__ import annotations

import ctypes
import os
import tempfile
from typing import Any, Dict, Optional, Tuple

from . import _lib
from ._core import _L, _c, _call, _s, _tls

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
    for an unknown field or a value of the wrong type, ValueError for a
    value the engine would refuse (out of range, or at odds with another
    field: chain_max over sq_depth / 2, heartbeat_ms not below
    peer_timeout_ms, ...), with the library's own message: the library
    checks (kvw_config_validate), so the rules are the engine's.

    A Config always holds a config the engine accepts: setting a field
    that would break that raises and changes nothing; change related
    fields together with update(sq_depth=16, chain_max=8, signal_every=8).
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
        self.update(**overrides)

    def __getattr__(self, name: str) -> Any:
        if name in _CFG_TEXT:
            return _s(getattr(self._c, name))
        if name in _CFG_FIELDS:
            return getattr(self._c, name)
        raise AttributeError(f"kvwire.Config has no field {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        self.update(**{name: value})

    def update(self, **fields: Any) -> "Config":
        """Set several fields at once, checked together: all of them, or
        (raising) none. Returns self."""
        c = _lib.kvw_config_t.from_buffer_copy(self._c)
        for name, value in fields.items():
            _set_field(c, name, value)
        _validate(c)
        object.__setattr__(self, "_c", c)
        return self

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


def _set_field(c: Any, name: str, value: Any) -> None:
    """One field into the ctypes struct, checked only for what the struct
    can hold (the library checks the rest): the type, the C type's width
    (ctypes would wrap silently), text's buffer."""
    if name in _CFG_TEXT:
        b = os.fsencode(value) if not isinstance(value, bytes) else value
        if len(b) > _CFG_TEXT[name]:
            raise ValueError(f"kvwire.Config.{name}: longer than {_CFG_TEXT[name]} bytes")
        setattr(c, name, b)
    elif name in _CFG_FIELDS:
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"kvwire.Config.{name}: an int, not {type(value).__name__}")
        lo, hi = _CFG_FIELDS[name]
        if not lo <= value <= hi:
            raise ValueError(f"kvwire.Config.{name}: {value} is outside {lo}..{hi}")
        setattr(c, name, value)
    else:
        raise TypeError(f"kvwire.Config has no field {name!r} (fields: {', '.join(Config.FIELDS)})")


def _validate(c: Any) -> None:
    """The engine's own checks (kvw_config_validate), raising ValueError with
    the library's message. A library older than 1.5 lacks the call: then
    only the struct's limits above apply and the engine checks the rest."""
    fn = _L.optional.get("kvw_config_validate")
    if fn is None:
        return
    _tls.last_error = None
    if fn(ctypes.byref(c)) != 0:
        reason = getattr(_tls, "last_error", None) or "refused by kvw_config_validate"
        raise ValueError(f"kvwire.Config: {reason}")


def _cfg_ptr(config: Optional[Config]) -> Any:
    if config is None:
        return None
    if not isinstance(config, Config):
        raise TypeError("config must be a kvwire.Config or None")
    return ctypes.pointer(config._c)
