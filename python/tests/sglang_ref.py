# SPDX-License-Identifier: Apache-2.0
"""Where sglang's reference snapshot and the stubs for the rest of sglang
are, for the tests that run sglang's own disaggregation code.

The snapshot (sglang's disaggregation package at the pinned commit, see its
README) is read-only reference kept beside the repository, never copied into
it: $KVWIRE_SGLANG_REF (its python/ directory), else
../shared/reference/sglang-0094505/python or shared/reference/... relative
to the repository root."""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
STUBS = os.path.join(HERE, "sglang_stubs")
PIN = "sglang-0094505"


def reference() -> str:
    env = os.environ.get("KVWIRE_SGLANG_REF")
    cands = [env] if env else []
    for base in (os.path.join(ROOT, "..", "shared"), os.path.join(ROOT, "shared")):
        cands.append(os.path.join(base, "reference", PIN, "python"))
    for c in cands:
        if c and os.path.isdir(os.path.join(c, "sglang", "srt", "disaggregation", "common")):
            return os.path.abspath(c)
    return ""


def missing() -> str:
    """Why sglang's code cannot run here ("" if it can)."""
    if not reference():
        return f"sglang reference snapshot {PIN} not found (set KVWIRE_SGLANG_REF)"
    for mod in ("torch", "zmq", "requests", "aiohttp", "numpy"):
        try:
            __import__(mod)
        except ImportError:
            return f"python3 module {mod} missing (scripts/install-deps.sh)"
    return ""


def shim_torch() -> None:
    """What sglang's code uses of torch 2.x that Debian's torch 1.13 lacks."""
    import torch

    if not hasattr(torch, "uint64"):
        torch.uint64 = torch.int64
    if not hasattr(torch.Tensor, "nbytes"):
        torch.Tensor.nbytes = property(lambda t: t.element_size() * t.nelement())


def enter() -> None:
    """Put the stubs and the snapshot on sys.path, forget any sglang
    modules (and kvwire.sglang.conn) loaded from elsewhere."""
    for p in (reference(), STUBS):
        if p in sys.path:
            sys.path.remove(p)
        sys.path.insert(0, p)
    leave_modules()
    shim_torch()


def leave_modules() -> None:
    for name in [n for n in sys.modules if n == "sglang" or n.startswith("sglang.")
                 or n == "kvwire.sglang.conn"]:
        del sys.modules[name]
