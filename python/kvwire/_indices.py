# SPDX-License-Identifier: Apache-2.0
"""Page and state index lists handed to the C library as `const uint64_t *`.

Accepted: any Python sequence or iterable of non-negative ints, any object
with the buffer protocol holding integers (array.array, memoryview, bytes of
'Q'), and numpy arrays of any integer dtype. A 1-D C-contiguous array of
native uint64 (numpy dtype uint64, array('Q'), memoryview format 'Q') is
passed without a copy; anything else is converted (one copy). Negative
values, non-integers and values above 2**64-1 raise TypeError/ValueError
before anything reaches the library.

numpy is optional: it is never imported here; numpy arrays are recognised
through __array_interface__, and converted with numpy (already imported by
their owner) when they need converting.
"""

from __future__ import annotations

import ctypes
import sys
from typing import Any, Optional

_U64_MAX = (1 << 64) - 1
_NATIVE = "<" if sys.byteorder == "little" else ">"
# typestrs of a native-endian 8-byte unsigned integer
_U64_TYPESTRS = {_NATIVE + "u8", "=u8", "|u8"}
# memoryview formats of one 8-byte unsigned integer ('L' is 8 bytes on LP64)
_U64_FORMATS = {"Q", "=Q", "@Q", _NATIVE + "Q"}
if ctypes.sizeof(ctypes.c_ulong) == 8:
    _U64_FORMATS |= {"L", "@L"}
_INT_FORMATS = set("bBhHiIlLqQnN")


class Indices:
    """Indices ready for one C call.

    ptr: a ctypes POINTER(c_uint64) (NULL when count is 0); count: how many;
    copied: False when ptr points into the caller's own buffer (zero-copy);
    address: the integer address of ptr. The object keeps whatever owns the
    memory alive; hold it until the C call returned (the library copies the
    indices it needs, so nothing is kept after that)."""

    __slots__ = ("ptr", "count", "copied", "address", "_keep")

    def __init__(self, ptr: Any, count: int, copied: bool, address: int, keep: Any):
        self.ptr = ptr
        self.count = count
        self.copied = copied
        self.address = address
        self._keep = keep


_NULL = ctypes.POINTER(ctypes.c_uint64)()


def _from_list(values: list) -> Indices:
    for v in values:
        # bool is an int subclass; numpy integer scalars have __index__
        if isinstance(v, bool) or not hasattr(v, "__index__"):
            raise TypeError(f"kvwire: indices must be integers, got {type(v).__name__}")
    ints = [v.__index__() for v in values]
    if ints and (min(ints) < 0 or max(ints) > _U64_MAX):
        bad = min(ints) if min(ints) < 0 else max(ints)
        raise ValueError(f"kvwire: index {bad} is outside 0..2**64-1")
    n = len(ints)
    if n == 0:
        return Indices(_NULL, 0, True, 0, None)
    arr = (ctypes.c_uint64 * n)(*ints)
    return Indices(ctypes.cast(arr, ctypes.POINTER(ctypes.c_uint64)), n, True,
                   ctypes.addressof(arr), arr)


def _from_address(addr: int, n: int, keep: Any) -> Indices:
    if n == 0:
        return Indices(_NULL, 0, False, 0, keep)
    return Indices(ctypes.cast(ctypes.c_void_p(addr), ctypes.POINTER(ctypes.c_uint64)), n,
                   False, addr, keep)


def _from_numpy(obj: Any) -> Optional[Indices]:
    ai = getattr(obj, "__array_interface__", None)
    if not isinstance(ai, dict):
        return None
    shape = tuple(ai.get("shape", ()))
    if len(shape) != 1:
        if len(shape) == 0:
            raise TypeError("kvwire: indices must be one-dimensional, got a scalar array")
        raise TypeError(f"kvwire: indices must be one-dimensional, got shape {shape}")
    typestr = ai.get("typestr", "")
    strides = ai.get("strides")
    n = shape[0]
    if typestr in _U64_TYPESTRS and (strides is None or strides == (8,) or n <= 1):
        return _from_address(ai["data"][0], n, obj)
    kind = typestr[1:2]
    if kind not in ("i", "u"):
        raise TypeError(f"kvwire: indices must be integers, got array typestr {typestr!r}")
    np = sys.modules.get("numpy")
    if np is None or not isinstance(obj, np.ndarray):
        return _from_list(list(obj))
    if kind == "i" and n and int(obj.min()) < 0:
        raise ValueError(f"kvwire: index {int(obj.min())} is outside 0..2**64-1")
    conv = np.ascontiguousarray(obj, dtype=np.uint64)
    return Indices(ctypes.cast(ctypes.c_void_p(conv.ctypes.data), ctypes.POINTER(ctypes.c_uint64)),
                   n, True, conv.ctypes.data, conv)


def _from_buffer(obj: Any) -> Optional[Indices]:
    try:
        mv = memoryview(obj)
    except TypeError:
        return None
    if mv.ndim != 1:
        raise TypeError(f"kvwire: indices must be one-dimensional, got {mv.ndim} dimensions")
    fmt = mv.format
    if fmt in _U64_FORMATS and mv.itemsize == 8 and mv.c_contiguous:
        n = mv.shape[0]
        if n == 0:
            return Indices(_NULL, 0, False, 0, mv)
        if not mv.readonly:
            arr = (ctypes.c_uint64 * n).from_buffer(mv)
            return Indices(ctypes.cast(arr, ctypes.POINTER(ctypes.c_uint64)), n, False,
                           ctypes.addressof(arr), (mv, arr))
        arr = (ctypes.c_uint64 * n).from_buffer_copy(mv)  # read-only: ctypes needs a copy
        return Indices(ctypes.cast(arr, ctypes.POINTER(ctypes.c_uint64)), n, True,
                       ctypes.addressof(arr), arr)
    if fmt.lstrip("@=<>!") not in _INT_FORMATS:
        raise TypeError(f"kvwire: indices must be integers, got buffer format {fmt!r}")
    return _from_list(mv.tolist())


def as_indices(obj: Any) -> Indices:
    """Convert obj (see the module docstring) for one C call. Thread-safe;
    does not modify obj."""
    if obj is None:
        return Indices(_NULL, 0, True, 0, None)
    if isinstance(obj, str):
        raise TypeError("kvwire: indices must be integers, got str")
    if isinstance(obj, (bytes, bytearray)):
        raise TypeError("kvwire: indices must be integers; for raw bytes pass memoryview(b).cast('Q')")
    got = _from_numpy(obj)
    if got is None:
        got = _from_buffer(obj)
    if got is not None:
        return got
    try:
        values = list(obj)
    except TypeError:
        raise TypeError(f"kvwire: indices must be a sequence of integers, got {type(obj).__name__}") from None
    return _from_list(values)
