# SPDX-License-Identifier: Apache-2.0
"""kvwire as an sglang PD-disaggregation transfer backend, selected with
`--disaggregation-transfer-backend kvwire`.

Pinned: sgl-project/sglang 0094505da74125a31ceb354f37ae7a1b6a97d3f5 (its
disaggregation/{base,common}/conn.py, utils.py, prefill.py, decode.py).

The backend (kvwire.sglang.conn) subclasses sglang's CommonKVManager,
CommonKVSender, CommonKVReceiver and CommonKVBootstrapServer, as sglang's
mooncake and nixl backends do: discovery, DP-rank resolution,
prefill_info_table, the HTTP bootstrap server, the heartbeat,
conclude_state and room status are sglang's; kvwire carries the QP
handshake and the data. Importing this package does not import sglang;
the classes load on first use (KVWireKVManager... attributes, or
get_kv_class).

Selecting it. Installed (pip install ./python), kvwire registers plugin()
under the entry point group "sglang.srt.plugins": an sglang with the plugin
framework runs it (load_plugins()) in `python -m sglang.launch_server`
before it parses the arguments and at the start of every scheduler process,
spawned or not. For an sglang without plugins, launch through `python3 -m
kvwire.sglang.launch_server`, which stays the main module, so that spawned
schedulers re-import it and call install() too. Either way install()
patches three things of sglang, each as its module is loaded (or at once if
it already is), in this process and in the processes it forks:

  1. server_args.DISAGG_TRANSFER_BACKEND_CHOICES (and
     arg_groups.choices's, where it exists) gains "kvwire", so the option
     parses;
  2. disaggregation.utils.TransferBackend gains the member KVWIRE =
     "kvwire", so TransferBackend(server_args.disaggregation_transfer_backend)
     works;
  3. disaggregation.utils.get_kv_class (and every sglang module's imported
     copy of it) returns kvwire's classes for TransferBackend.KVWIRE and
     sglang's KVArgs for KVClassType.KVARGS; every other backend is
     passed to sglang's own function untouched.

No other backend's package is imported or started: with the name
"kvwire", sglang's code paths keyed on "mooncake" (its transfer engine in
the model runner, its custom memory pool) are not taken.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Any, Dict, Optional

__all__ = [
    "KVWireKVBootstrapServer", "KVWireKVManager", "KVWireKVReceiver", "KVWireKVSender",
    "install", "uninstall", "installed_backend", "plugin", "BACKEND",
]

BACKEND = "kvwire"
_CLASS_NAMES = {
    "MANAGER": "KVWireKVManager",
    "SENDER": "KVWireKVSender",
    "RECEIVER": "KVWireKVReceiver",
    "BOOTSTRAP_SERVER": "KVWireKVBootstrapServer",
}
_state: Dict[str, Any] = {"replace": None, "original": None}
_lock = threading.RLock()
_UTILS = "sglang.srt.disaggregation.utils"
_CHOICES = ("sglang.srt.server_args", "sglang.srt.arg_groups.choices")


def __getattr__(name: str) -> Any:
    if name in _CLASS_NAMES.values() or name == "KVArgs":
        from . import conn

        return getattr(conn, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _backend_class(class_type: Any) -> Any:
    """kvwire's class for a KVClassType, or None (KVARGS: sglang's KVArgs)."""
    key = getattr(class_type, "name", str(class_type)).upper()
    if key == "KVARGS":
        from sglang.srt.disaggregation.base.conn import KVArgs

        return KVArgs
    name = _CLASS_NAMES.get(key)
    if name is None:
        return None
    from . import conn

    return getattr(conn, name)


def _backend_name(transfer_backend: Any) -> str:
    return str(getattr(transfer_backend, "value", transfer_backend)).lower()


def _patched(original: Any, replace: str) -> Any:
    def get_kv_class(transfer_backend: Any, class_type: Any, *args: Any, **kwargs: Any) -> Any:
        if _backend_name(transfer_backend) == replace:
            cls = _backend_class(class_type)
            if cls is not None:
                return cls
        return original(transfer_backend, class_type, *args, **kwargs)

    get_kv_class._kvwire_original = original  # type: ignore[attr-defined]
    get_kv_class.__doc__ = f"sglang's get_kv_class, with backend {replace!r} served by kvwire"
    return get_kv_class


def _extend_enum(enum_cls: Any, member: str, value: str) -> None:
    """Add member = value to an Enum class in place (sglang's
    TransferBackend), as the aenum package's extend_enum does."""
    if value in enum_cls._value2member_map_:
        return
    m = object.__new__(enum_cls)
    m._name_ = member
    m._value_ = value
    m.__objclass__ = enum_cls
    if hasattr(m, "__init__"):
        try:
            m.__init__(value)
        except TypeError:
            pass
    enum_cls._member_map_[member] = m
    enum_cls._member_names_.append(member)
    enum_cls._value2member_map_[value] = m
    type.__setattr__(enum_cls, member, m)


def _patch_choices(mod: Any, replace: str) -> None:
    choices = getattr(mod, "DISAGG_TRANSFER_BACKEND_CHOICES", None)
    if isinstance(choices, list) and replace not in choices:
        choices.append(replace)  # argparse holds this very list


def _patch_utils(utils: Any, replace: str) -> bool:
    if not hasattr(utils, "get_kv_class"):
        return False
    tb = getattr(utils, "TransferBackend", None)
    if tb is not None:
        _extend_enum(tb, replace.upper(), replace)
    cur = utils.get_kv_class
    original = getattr(cur, "_kvwire_original", cur)
    new = _patched(original, replace)
    _state["original"] = original
    # Modules that did `from ...utils import get_kv_class` hold their own name.
    for name, mod in list(sys.modules.items()):
        if name.startswith("sglang") and mod is not None:
            f = getattr(mod, "get_kv_class", None)
            if f is not None and (f is original or getattr(f, "_kvwire_original", None) is original):
                setattr(mod, "get_kv_class", new)
    return True


def _patch_loaded(replace: str) -> bool:
    for name in _CHOICES:
        mod = sys.modules.get(name)
        if mod is not None:
            _patch_choices(mod, replace)
    utils = sys.modules.get(_UTILS)
    return utils is not None and _patch_utils(utils, replace)


def _after_exec(fullname: str, module: Any) -> None:
    replace = _state["replace"]
    if not replace:
        return
    with _lock:
        if fullname == _UTILS:
            _patch_utils(module, replace)
        else:
            _patch_choices(module, replace)


class _Finder:
    """Meta-path hook: patch sglang's modules right after they execute,
    before any other module imports names from them."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != _UTILS and fullname not in _CHOICES:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is None:
                continue
            loader = spec.loader
            if loader is not None and hasattr(loader, "exec_module"):
                orig_exec = loader.exec_module

                def exec_module(module: Any, _orig: Any = orig_exec, _n: str = fullname) -> None:
                    _orig(module)
                    _after_exec(_n, module)

                loader.exec_module = exec_module  # type: ignore[method-assign]
            return spec
        return None


_finder = _Finder()


def install(replace: Optional[str] = None) -> None:
    """Make sglang's `--disaggregation-transfer-backend kvwire` use kvwire
    (see the module's docstring for what is patched). `replace` (or
    $KVWIRE_SGLANG_BACKEND) names another backend to serve instead, e.g.
    "mooncake" for a launcher that cannot pass a new name; that name then
    keeps sglang's other behaviour for it (mooncake's transfer engine in
    the model runner). Patches sglang now if it is imported, else as soon
    as it is. Idempotent; thread-safe; affects this process and children
    it forks."""
    replace = (replace or os.environ.get("KVWIRE_SGLANG_BACKEND") or BACKEND).lower()
    with _lock:
        if _state["replace"] is None:
            _state["env"] = os.environ.get("KVWIRE_SGLANG_BACKEND")
        _state["replace"] = replace
        os.environ["KVWIRE_SGLANG_BACKEND"] = replace  # for spawned schedulers
        _patch_loaded(replace)
        if _finder not in sys.meta_path:
            sys.meta_path.insert(0, _finder)


def uninstall() -> None:
    """Undo install()'s get_kv_class patch and its KVWIRE_SGLANG_BACKEND in
    this process (the added choice and enum member stay: harmless without
    the patch)."""
    with _lock:
        if _state["replace"] is not None:  # the environment as before install()
            env = _state.get("env")
            if env is None:
                os.environ.pop("KVWIRE_SGLANG_BACKEND", None)
            else:
                os.environ["KVWIRE_SGLANG_BACKEND"] = env
        _state["replace"] = None
        if _finder in sys.meta_path:
            sys.meta_path.remove(_finder)
        original = _state["original"]
        if original is None:
            return
        for name, mod in list(sys.modules.items()):
            if name.startswith("sglang") and mod is not None:
                f = getattr(mod, "get_kv_class", None)
                if getattr(f, "_kvwire_original", None) is original:
                    setattr(mod, "get_kv_class", original)


def installed_backend() -> Optional[str]:
    """The sglang backend name kvwire serves, or None."""
    return _state["replace"]


def plugin() -> None:
    """sglang's general plugin (entry point group "sglang.srt.plugins",
    declared in python/pyproject.toml): install(). sglang's load_plugins()
    calls it once per process, before it parses the arguments and at the
    start of each scheduler process; it imports nothing of sglang itself.
    $SGLANG_PLUGINS, where set, must name "kvwire" for sglang to load it."""
    install()
