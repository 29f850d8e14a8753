# SPDX-License-Identifier: Apache-2.0
"""The two calls of libkvwire that the sglang backend needs beyond the
general binding, bound on the same library handle (kvwire._lib.load()):

  kvw_receiver_create_at  a receiver for a prefill engine whose control
                          endpoint is known (sglang's bootstrap server
                          carries it), with no kvwire bootstrap lookup;
  kvw_sender_requested    what decode asked of a sender (page count, aux).

Both are optional: an older library lacks them and the backend refuses to
start with a reason (has()).
"""

from __future__ import annotations

import ctypes
from typing import Any, Optional, Tuple

import kvwire
from kvwire import _lib
from kvwire._engine import _U32_MAX, _U64_MAX, _text, _uint

_L = _lib.load()
_c = _L.c

_SIGS = {
    "kvw_receiver_create_at": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_uint32,
                                              ctypes.c_uint64, ctypes.POINTER(ctypes.c_void_p)]),
    "kvw_sender_requested": (ctypes.c_int, [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t),
                                            ctypes.POINTER(ctypes.c_uint32)]),
}
_fns = {}
for _name, (_res, _args) in _SIGS.items():
    _fn = getattr(_c, _name, None)
    if _fn is not None:
        _fn.restype = _res
        _fn.argtypes = _args
    _fns[_name] = _fn


def has() -> Optional[str]:
    """None if the library has both calls, else the name of a missing one."""
    for name, fn in _fns.items():
        if fn is None:
            return name
    return None


def _check(st: int, what: str) -> None:
    if st != 0:
        raise kvwire.Error(st, None, what)


class EndpointReceiver(kvwire.Receiver):
    """A kvwire.Receiver made with kvw_receiver_create_at: decode dials the
    prefill engine's control endpoint ("tcp://ip:port") directly."""

    def __init__(self, engine: kvwire.Engine, endpoint: str, prefill_rank: int, room: int):
        fn = _fns["kvw_receiver_create_at"]
        if fn is None:
            raise kvwire.Error(kvwire.Status.ERR_UNSUPPORTED,
                               "libkvwire lacks kvw_receiver_create_at", "EndpointReceiver")
        self._engine = engine
        # Checked as kvwire.Receiver's: ctypes would wrap what does not fit.
        self.room = _uint(room, _U64_MAX, "EndpointReceiver: room")
        addr = _text(endpoint, "EndpointReceiver: endpoint")
        self.bootstrap_addr = endpoint
        self.prefill_rank = _uint(prefill_rank, _U32_MAX, "EndpointReceiver: prefill_rank")
        h = ctypes.c_void_p()
        with engine._lock:
            _check(fn(engine._get(), addr, self.prefill_rank, self.room,
                      ctypes.byref(h)), f"kvw_receiver_create_at({endpoint}, room {self.room})")
            self._cell = engine._adopt(h.value, "receiver")


def requested(sender: kvwire.Sender) -> Optional[Tuple[int, bool]]:
    """(pages, wants_aux) that decode asked of this sender, or None while
    decode's request has not arrived."""
    fn = _fns["kvw_sender_requested"]
    if fn is None:
        raise kvwire.Error(kvwire.Status.ERR_UNSUPPORTED, "libkvwire lacks kvw_sender_requested")
    n = ctypes.c_size_t()
    aux = ctypes.c_uint32()
    cell: Any = sender._cell
    with cell.lock:
        if cell.h is None:
            return None
        st = fn(cell.h, ctypes.byref(n), ctypes.byref(aux))
    if st == int(kvwire.Status.ERR_STATE):
        return None
    _check(st, f"kvw_sender_requested(room {sender.room})")
    return int(n.value), aux.value != kvwire.NO_AUX
