# SPDX-License-Identifier: Apache-2.0
"""The caller's digests of a verified transfer (KVW_VERIFY=1) for the
sglang backend: KV pages in GPU memory the NIC reaches directly (dma-buf,
nvidia_peermem), which kvwire cannot read without a kernel, are summed on
the GPU with torch, and kvwire carries prefill's digest to decode and
compares (kvw_sender_set_digest, kvw_receiver_verify;
docs/failure-semantics.md, "Verified transfers").

The digest covers the request's KV pages: region i of the engine's KV
regions (sglang's kv_data_ptrs order), page position p in the request
(0-based over every part sent), the page's bytes as little-endian 64-bit
words x_e (bytes, when the item length is not a multiple of 8):

    digest = sum over i, p, e of x_e * (2e + 1) * m(i, p)   (mod 2^64)
    m(i, p) = ((i * 2^32 + p) * 0x9E3779B97F4A7C15) | 1      (mod 2^64)

Any one word changed changes the digest (every weight is odd), and so
does a page written to another position or region. Linear in the pages,
so prefill sums it part by part. The aux item and hybrid state are not
covered (host metadata, small; kvwire checks them where it reads the
memory itself).

reference_digest() is the same function in plain Python, for tests and
for checking a torch build against it."""

from __future__ import annotations

import ctypes
from typing import Any, Dict, List, Optional, Sequence

_M64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def _signed(x: int) -> int:
    x &= _M64
    return x - (1 << 64) if x >> 63 else x


def multiplier(region: int, position: int) -> int:
    """m(i, p), as an unsigned 64-bit int."""
    return (((region << 32) + position) * _GOLDEN | 1) & _M64


def reference_digest(regions: Sequence[bytes], item: int, pages: Sequence[int],
                     first: int = 0) -> int:
    """The digest of pages (positions first, first + 1, ...) of each
    region's bytes, in plain Python (slow: tests only)."""
    word = 8 if item % 8 == 0 else 1
    total = 0
    for i, buf in enumerate(regions):
        for k, page in enumerate(pages):
            base = int(page) * item
            s = 0
            for e in range(item // word):
                x = int.from_bytes(buf[base + e * word:base + (e + 1) * word], "little")
                s += x * (2 * e + 1)
            total += s * multiplier(i, first + k)
    return total & _M64


# ---- torch on the GPU ---------------------------------------------------------


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int), ("device_id", ctypes.c_int)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class _DLManaged(ctypes.Structure):
    pass


_DELETER = ctypes.CFUNCTYPE(None, ctypes.POINTER(_DLManaged))
_DLManaged._fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p),
                       ("deleter", _DELETER)]
_KDL_CPU, _KDL_CUDA, _KDL_UINT = 1, 2, 1


@_DELETER
def _keep(_: Any) -> None:
    """The memory is sglang's KV pool, alive as long as the engine: the
    views free nothing."""


def _bytes_at(ptr: int, length: int, device: Optional[int]) -> Any:
    """A uint8 torch view of length bytes of memory at ptr, on CUDA device
    `device` (None: host memory), through DLPack: torch has no public
    from-pointer constructor. The structs are kept for the process's life
    (_HOLD), as the memory is."""
    import torch.utils.dlpack

    shape = (ctypes.c_int64 * 1)(length)
    m = _DLManaged()
    where = _DLDevice(_KDL_CPU, 0) if device is None else _DLDevice(_KDL_CUDA, device)
    m.dl_tensor = _DLTensor(ctypes.c_void_p(ptr), where, 1,
                            _DLDataType(_KDL_UINT, 8, 1), shape, None, 0)
    m.deleter = _keep
    new = ctypes.pythonapi.PyCapsule_New
    new.restype, new.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_char_p,
                                                   ctypes.c_void_p]
    t = torch.utils.dlpack.from_dlpack(new(ctypes.addressof(m), b"dltensor", None))
    _HOLD.append((m, shape))
    return t


_HOLD: List[Any] = []  # DLPack structs of the views: for the process's life


class KVDigest:
    """The digest above over one engine's KV regions, on their GPU (device
    None: host memory, for tests)."""

    def __init__(self, ptrs: Sequence[int], lens: Sequence[int], items: Sequence[int],
                 device: Optional[int]):
        import torch

        self._torch = torch
        self.device = torch.device("cpu") if device is None else torch.device("cuda", device)
        self.views = [_bytes_at(int(p), int(n), device) for p, n in zip(ptrs, lens)]
        self.items = [int(i) for i in items]
        self._weights: Dict[int, Any] = {}

    def _w(self, words: int) -> Any:
        w = self._weights.get(words)
        if w is None:
            w = self._torch.arange(words, dtype=self._torch.int64, device=self.device) * 2 + 1
            self._weights[words] = w
        return w

    def digest(self, pages: Any, first: int = 0) -> int:
        """The digest of pages at positions first, first + 1, ...: one
        host sync (the pages' producers must have been ordered before it,
        as for any send)."""
        torch = self._torch
        idx = torch.as_tensor(list(int(p) for p in pages), dtype=torch.int64,
                              device=self.device)
        if idx.numel() == 0:
            return 0
        pos = torch.arange(first, first + idx.numel(), dtype=torch.int64, device=self.device)
        total: Optional[Any] = None
        for i, (view, item) in enumerate(zip(self.views, self.items)):
            rows = view[: view.numel() // item * item].view(-1, item).index_select(0, idx)
            words = rows.view(torch.int64) if item % 8 == 0 else rows.to(torch.int64)
            per_page = (words * self._w(words.shape[1])).sum(dim=1)
            # int64 arithmetic wraps: the sums are the digest mod 2^64
            m = ((pos + (i << 32)) * _signed(_GOLDEN)) | 1
            part = (per_page * m).sum()
            total = part if total is None else total + part
        return int(total.item()) & _M64
