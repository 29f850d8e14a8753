# SPDX-License-Identifier: Apache-2.0
"""kvwire: move LLM KV cache between inference engines over RDMA.

Pure-Python binding (ctypes) of libkvwire; see include/kvwire.h for the
semantics of every call, which this module keeps. Quick tour:

    import kvwire
    bs = kvwire.Bootstrap("10.0.0.1:0")                 # prefill host
    eng = kvwire.Engine("prefill", "10.0.0.1", bootstrap_addr=bs.addr,
                        kv=[kvwire.Region.of(a, item_len) for a in k_and_v])
    with eng.sender(room) as s:
        s.init(len(pages)); s.send(pages)
        while s.poll() not in (kvwire.Poll.SUCCESS, kvwire.Poll.FAILED): ...

Ownership. Objects own their C handle and free it in close(), at the end of
a `with` block, or when garbage collected. Memory given to an Engine (Region)
is the caller's: it must stay valid until the engine is closed; a Region made
with Region.of(buffer) keeps that buffer object alive for the engine's life.
Closing an Engine first closes every Sender and Receiver made from it. Any
call on a closed object raises ClosedError; none can crash the interpreter.

Threads. Every call releases the GIL while in C. Engine methods may be called
from any thread. So may a Sender's or Receiver's: the binding serialises
them on the object's own lock (as C does on its engine's), so poll() never
blocks, except behind another call or a close() of the same object running
in another thread. Errors raise kvwire.Error with .status (int),
.name ("KVW_ERR_TIMEOUT") and .reason (the library's own message when it
logged one on the calling thread, else the status text).
"""

from __future__ import annotations

# The binding in modules: _lib (ctypes declarations and the loader), _core
# (the loaded library, enums, errors, logging), _config (Config), _engine
# (Bootstrap, Engine, Sender, Receiver and their value types), _indices
# (index arrays). Everything public is re-exported here; `import kvwire` is
# the whole API.
from . import _lib
from ._config import Config
from ._version import __version__
from ._core import (
    NO_AUX,
    ClosedError,
    Error,
    GroupKind,
    LogLevel,
    Poll,
    Role,
    Status,
    _c,
    _L,
    features,
    library_path,
    log_to_python,
    log_to_stderr,
    set_log_handler,
    version,
    version_info,
)
from ._engine import (
    Bootstrap,
    Counters,
    Engine,
    Group,
    GroupHeads,
    PrefillRank,
    RanksReceiver,
    Receiver,
    Region,
    ReqMetrics,
    Sender,
    _Cell,
)
from ._indices import Indices, as_indices

__all__ = [
    "Bootstrap", "ClosedError", "Config", "Counters", "Engine", "Error", "Group", "GroupHeads", "GroupKind",
    "LogLevel", "NO_AUX", "Poll", "PrefillRank", "RanksReceiver", "Receiver", "Region", "ReqMetrics", "Role", "Sender", "Status",
    "as_indices", "features", "library_path", "set_log_handler", "version", "version_info",
    "__version__", "log_to_python", "log_to_stderr",
]
