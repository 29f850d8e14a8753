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

import atexit
import ctypes
import enum
import os
import tempfile
import threading
from typing import Any, Callable, Dict, Iterable, List, NamedTuple, Optional, Sequence, Tuple, Union

from . import _lib
from ._indices import Indices, as_indices

__all__ = [
    "Bootstrap", "ClosedError", "Config", "Counters", "Engine", "Error", "Group", "GroupKind",
    "LogLevel", "NO_AUX", "Poll", "Receiver", "Region", "ReqMetrics", "Role", "Sender", "Status",
    "as_indices", "features", "library_path", "set_log_handler", "version", "version_info",
]

_L = _lib.load()
_c = _L.c
NO_AUX = _lib.NO_AUX


def library_path() -> str:
    """Path of the libkvwire this process loaded."""
    return _L.path


def version() -> str:
    """Version of the loaded libkvwire, "MAJOR.MINOR.PATCH" (kvw_version_string)."""
    return _s(_c.kvw_version_string())


def version_info() -> Tuple[int, int, int]:
    """The same as numbers, (MAJOR, MINOR, PATCH), from kvw_version()."""
    v = int(_c.kvw_version())
    return (v // 10000, v // 100 % 100, v % 100)


def features() -> Dict[str, bool]:
    """Which newer C calls the loaded library has: groups (buffer groups in
    Engine), init_indices (Receiver.init with state), send_part, send_state,
    metrics, send_after (the event= argument of Sender.send and
    Sender.send_part). A missing one makes only the method that needs it
    raise Error(KVW_ERR_UNSUPPORTED)."""
    return {
        "groups": _L.has(_lib.GROUPS_MARKER),
        "init_indices": _L.has("kvw_receiver_init_indices"),
        "send_part": _L.has("kvw_sender_send_part"),
        "send_state": _L.has("kvw_sender_send_state"),
        "metrics": _L.has("kvw_sender_metrics") and _L.has("kvw_receiver_metrics"),
        "send_after": _L.has("kvw_sender_send_after") and _L.has("kvw_sender_send_part_after"),
    }


# ------------------------------------------------------------------ enums


class Status(enum.IntEnum):
    """kvw_status_t (include/kvwire.h KVW_STATUS_MAP)."""
    OK = 0
    ERR_INVALID = -1
    ERR_NO_MEMORY = -2
    ERR_NO_DEVICE = -3
    ERR_VERBS = -4
    ERR_REGISTER = -5
    ERR_CONTROL = -6
    ERR_PROTOCOL = -7
    ERR_OUT_OF_RANGE = -8
    ERR_MISMATCH = -9
    ERR_TIMEOUT = -10
    ERR_PEER = -11
    ERR_TRANSFER = -12
    ERR_STATE = -13
    ERR_NOT_FOUND = -14
    ERR_EXISTS = -15
    ERR_UNSUPPORTED = -16
    ERR_ABORTED = -17
    ERR_LIMIT = -18


class Poll(enum.IntEnum):
    """Request states; same numbers as sglang's KVPoll (Failed=0 .. Success=4),
    so min() over ranks keeps Failed winning."""
    FAILED = 0
    BOOTSTRAPPING = 1
    WAITING_FOR_INPUT = 2
    TRANSFERRING = 3
    SUCCESS = 4


class Role(enum.IntEnum):
    PREFILL = 0
    DECODE = 1


class GroupKind(enum.IntEnum):
    """kvw_group_kind_t: which request indices address a group's items."""
    KV = 0     # the request's pages
    AUX = 1    # the request's aux index
    STATE = 2  # the request's state indices


class LogLevel(enum.IntEnum):
    ERROR = 0
    WARN = 1
    INFO = 2
    DEBUG = 3


# ----------------------------------------------------------------- errors


def _s(p: Optional[bytes]) -> str:
    return p.decode("utf-8", "replace") if p else ""


class Error(Exception):
    """A kvwire call failed. status: the kvw_status_t value (int; compare
    with Status); name: its C name; reason: why, in words."""

    def __init__(self, status: int, reason: Optional[str] = None, what: Optional[str] = None):
        self.status = int(status)
        self.name = _s(_c.kvw_status_name(self.status))
        self.reason = reason or _s(_c.kvw_strerror(self.status))
        self.what = what
        msg = f"{self.reason} ({self.name})"
        super().__init__(f"{what}: {msg}" if what else msg)


class ClosedError(Error):
    """The object was closed (or its engine was); status KVW_ERR_STATE."""

    def __init__(self, what: str):
        super().__init__(Status.ERR_STATE, f"{what} is closed", None)


def _unsupported(symbol: str, what: str) -> Error:
    return Error(Status.ERR_UNSUPPORTED,
                 f"{what} needs {symbol}(), which {_L.path} does not export (an older libkvwire)")


# ---------------------------------------------------------------- logging
#
# One trampoline is installed for the life of the process. It remembers the
# last ERROR logged on each thread, so a failed call can say why in its
# exception, and hands every line to the user's handler or writes it to
# stderr like the library's default. It runs on library threads too, under
# the library's log lock: it never calls back into kvwire.

_tls = threading.local()
_TAGS = ("ERROR", "WARN", "INFO", "DEBUG")
_user_handler: Optional[Callable[[int, str], None]] = None


def _trampoline(_arg: Any, level: int, msg: Optional[bytes]) -> None:
    try:
        text = _s(msg)
        if level == LogLevel.ERROR:
            _tls.last_error = text
        h = _user_handler
        if h is not None:
            h(level, text)
        else:
            os.write(2, f"kvwire {_TAGS[level] if 0 <= level < 4 else level}: {text}\n".encode())
    except BaseException:  # a callback must not raise into C
        pass


_trampoline_c = _lib.LOG_FN(_trampoline)


def _env_level() -> int:
    names = {"error": 0, "warn": 1, "info": 2, "debug": 3}
    return names.get(os.environ.get("KVW_LOG_LEVEL", "").lower(), int(LogLevel.WARN))


_log_level = _env_level()


def set_log_handler(handler: Optional[Callable[[int, str], None]],
                    level: Optional[int] = None) -> None:
    """Route libkvwire's log lines to handler(level, message) (None: stderr,
    the default), delivering levels up to `level` (None: keep the current,
    initially KVW_LOG_LEVEL or WARN). The handler runs on library threads,
    possibly concurrently, must be quick, and must not call kvwire; whatever
    it raises is ignored. Process-wide; thread-safe."""
    global _user_handler, _log_level
    _user_handler = handler
    if level is not None:
        _log_level = int(LogLevel(level))
    _c.kvw_set_log_handler(_trampoline_c, None, _log_level)


def log_to_python(logger: Any = None, level: Optional[int] = None) -> None:
    """set_log_handler() into the `logging` module (logger "kvwire" by default)."""
    import logging

    lg = logger or logging.getLogger("kvwire")
    to_py = {0: logging.ERROR, 1: logging.WARNING, 2: logging.INFO, 3: logging.DEBUG}
    set_log_handler(lambda lvl, msg: lg.log(to_py.get(lvl, logging.INFO), "%s", msg), level)


def _restore_default_log() -> None:
    # Library threads may outlive the interpreter's finalisation; from here
    # on they log through the C default and never enter Python again.
    _c.kvw_set_log_handler(_lib.LOG_FN(), None, _log_level)


set_log_handler(None)
atexit.register(_restore_default_log)


def _call(fn: Any, what: str, *args: Any) -> None:
    """Call a status-returning C function; raise Error on failure."""
    _tls.last_error = None
    st = fn(*args)
    if st != 0:
        raise Error(st, getattr(_tls, "last_error", None), what)


# ----------------------------------------------------------------- config


_CFG_FIELDS: Dict[str, Tuple[int, int]] = {}
for _name, _ct in _lib.kvw_config_t._fields_:
    if _ct is ctypes.c_uint32:
        _CFG_FIELDS[_name] = (0, (1 << 32) - 1)
    elif _ct is ctypes.c_int32:
        _CFG_FIELDS[_name] = (-(1 << 31), (1 << 31) - 1)
    elif _ct is ctypes.c_uint8:
        _CFG_FIELDS[_name] = (0, 255)
_CFG_TEXT = {"cluster_key_file": 255, "cluster_key": 40, "gpu_path": 15}


class Config:
    """kvw_config_t: the library's defaults, then the KVW_* environment
    (kvw_config_init), then the keyword overrides given here, by field name
    (sq_depth=..., peer_timeout_ms=..., cluster_key_file=...). Raises
    Error(KVW_ERR_INVALID) when a KVW_* variable does not parse, TypeError
    for an unknown field, ValueError for a value out of the field's range.
    A plain value object: not shared with C after the call that uses it;
    not thread-safe to mutate while another thread reads it."""

    FIELDS: Tuple[str, ...] = tuple(n for n, _ in _lib.kvw_config_t._fields_ if n != "struct_size")

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


# --------------------------------------------------------------- handles


class _Cell:
    """One C handle, shared by its Python object and (for requests) its
    engine, so that whichever closes first frees it exactly once."""

    __slots__ = ("h", "lock", "kind")

    def __init__(self, h: int, kind: str):
        self.h: Optional[int] = h
        self.lock = threading.Lock()
        self.kind = kind


class _Handle:
    _cell: Optional[_Cell] = None
    _what = "object"

    def _get(self) -> int:
        cell = self._cell
        if cell is None or cell.h is None:
            raise ClosedError(self._what)
        return cell.h

    @property
    def closed(self) -> bool:
        return self._cell is None or self._cell.h is None

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def close(self) -> None:  # pragma: no cover - overridden
        raise NotImplementedError


# -------------------------------------------------------------- bootstrap


class Bootstrap(_Handle):
    """A bootstrap (directory) service on its own thread, as
    kvw_bootstrap_create: bind_addr "ip:port" (port 0: ephemeral), the
    cluster key from config (None: the KVW_* environment), lease_ms (0: the
    default). .addr is where it listens. close() stops it; thread-safe."""

    _what = "kvwire.Bootstrap"

    def __init__(self, bind_addr: str, config: Optional[Config] = None, lease_ms: int = 0):
        p = _lib.kvw_bootstrap_params_t(ctypes.sizeof(_lib.kvw_bootstrap_params_t),
                                        bind_addr.encode(), _cfg_ptr(config), lease_ms)
        h = ctypes.c_void_p()
        _call(_c.kvw_bootstrap_create, f"kvw_bootstrap_create({bind_addr})", ctypes.byref(p),
              ctypes.byref(h))
        self._cell = _Cell(h.value, "bootstrap")
        self._addr = _s(_c.kvw_bootstrap_addr(h.value))

    @property
    def addr(self) -> str:
        self._get()
        return self._addr

    def close(self) -> None:
        cell = self._cell
        if cell is None:
            return
        with cell.lock:
            if cell.h is not None:
                _c.kvw_bootstrap_destroy(cell.h)
                cell.h = None

    def __repr__(self) -> str:
        return f"<kvwire.Bootstrap {'closed' if self.closed else self._addr}>"


# ---------------------------------------------------------------- memory


class Region(NamedTuple):
    """One registered memory region: addr (int), length (bytes), item_len
    (bytes per page or aux index; length must be a multiple). owner: an
    object kept alive as long as the engine (Region.of sets it)."""

    addr: int
    length: int
    item_len: int
    owner: Any = None

    @classmethod
    def of(cls, buf: Any, item_len: int) -> "Region":
        """The whole of a C-contiguous buffer: a numpy array (host memory),
        a bytearray, a writable memoryview, a ctypes array... item_len bytes
        per index. The Region holds a reference to buf."""
        ai = getattr(buf, "__array_interface__", None)
        if isinstance(ai, dict):
            mv = memoryview(buf)  # raises for non-contiguous numpy arrays only later
            if not mv.c_contiguous:
                raise ValueError("kvwire.Region.of: the array must be C-contiguous")
            return cls(int(ai["data"][0]), mv.nbytes, int(item_len), buf)
        mv = memoryview(buf)
        if not mv.c_contiguous:
            raise ValueError("kvwire.Region.of: the buffer must be C-contiguous")
        if mv.readonly:
            raise ValueError("kvwire.Region.of: the buffer must be writable")
        n = mv.nbytes
        if n == 0:
            raise ValueError("kvwire.Region.of: empty buffer")
        arr = (ctypes.c_char * n).from_buffer(mv.cast("B"))
        return cls(ctypes.addressof(arr), n, int(item_len), (buf, arr))


RegionLike = Union[Region, Tuple[int, int, int]]


class Group(NamedTuple):
    """kvw_group_t: num_layers * regions_per_layer regions, region-major
    (region j of layer l at regions[j * num_layers + l]; for sglang's MHA
    kv_data_ptrs, K layers then V layers, that is regions_per_layer=2)."""

    kind: GroupKind
    num_layers: int
    regions_per_layer: int
    regions: Sequence[RegionLike]


def _regions(seq: Iterable[RegionLike], keep: List[Any]) -> Tuple[Any, int]:
    items = [r if isinstance(r, Region) else Region(*r) for r in seq]
    if not items:
        return None, 0
    arr = (_lib.kvw_region_t * len(items))()
    for i, r in enumerate(items):
        for v, nm in ((r.addr, "addr"), (r.length, "length"), (r.item_len, "item_len")):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise TypeError(f"kvwire: region {i}: {nm} must be a non-negative int")
        arr[i].addr, arr[i].len, arr[i].item_len = r.addr, r.length, r.item_len
        if r.owner is not None:
            keep.append(r.owner)
    keep.append(arr)
    return arr, len(items)


# ---------------------------------------------------------------- engine


class Counters(NamedTuple):
    """kvw_counters_t: an engine's monotonic counters."""

    bytes_posted: int
    wrs_posted: int
    chains_posted: int
    completions: int
    wrs_completed: int
    wrs_flushed: int
    errors: int
    requests_ok: int
    requests_failed: int
    cq_sleeps: int
    caller_passes: int


class ReqMetrics(NamedTuple):
    """kvw_req_metrics_t: one request's bytes, RDMA writes and transfer time;
    start_ns and end_ns bound it on CLOCK_MONOTONIC (time.monotonic_ns())."""

    bytes: int
    writes: int
    transfer_us: int
    start_ns: int = 0
    end_ns: int = 0


def _role(role: Union[str, int, Role]) -> Role:
    if isinstance(role, str):
        try:
            return Role[role.upper()]
        except KeyError:
            raise ValueError(f"kvwire: role must be 'prefill' or 'decode', not {role!r}") from None
    return Role(role)


class Engine(_Handle):
    """One engine per process and role (kvw_engine_create): opens the RDMA
    device (by name, or found from local_ip), registers the memory once,
    starts its control and poller threads and (prefill) registers
    engine_rank with the bootstrap service at bootstrap_addr.

    Memory, either
      kv:  2L regions, K layers 0..L-1 then V layers 0..L-1 (num_layers = L,
           default len(kv) // 2), plus aux: regions indexed by aux index; or
      groups: a list of Group (needs a library with buffer groups).
    The memory stays the caller's and must outlive close().

    Raises Error (KVW_ERR_NO_DEVICE, ...) with nothing left allocated.
    Thread-safe; close() first closes every Sender and Receiver of it."""

    _what = "kvwire.Engine"

    def __init__(self, role: Union[str, int, Role], local_ip: str, *,
                 kv: Sequence[RegionLike] = (), num_layers: Optional[int] = None,
                 aux: Sequence[RegionLike] = (), groups: Optional[Sequence[Group]] = None,
                 device: Optional[str] = None, engine_rank: int = 0,
                 bootstrap_addr: Optional[str] = None, config: Optional[Config] = None):
        self._keep: List[Any] = []
        self._lock = threading.RLock()
        self._children: Dict[int, _Cell] = {}
        self.role = _role(role)
        p = _lib.kvw_engine_params_t()
        p.struct_size = ctypes.sizeof(_lib.kvw_engine_params_t)
        p.role = int(self.role)
        p.engine_rank = engine_rank
        p.device = device.encode() if device else None
        p.local_ip = local_ip.encode()
        p.bootstrap_addr = bootstrap_addr.encode() if bootstrap_addr else None
        if groups:
            if kv or aux or num_layers:
                raise ValueError("kvwire.Engine: give either groups or kv/aux, not both")
            if not _L.has(_lib.GROUPS_MARKER):
                raise _unsupported(_lib.GROUPS_MARKER, "kvwire.Engine(groups=...)")
            garr = (_lib.kvw_group_t * len(groups))()
            for i, g in enumerate(groups):
                regs, n = _regions(g.regions, self._keep)
                if n != g.num_layers * g.regions_per_layer:
                    raise ValueError(f"kvwire.Engine: group {i} has {n} regions, "
                                     f"not num_layers*regions_per_layer = "
                                     f"{g.num_layers * g.regions_per_layer}")
                garr[i].kind = int(GroupKind(g.kind))
                garr[i].num_layers = g.num_layers
                garr[i].regions_per_layer = g.regions_per_layer
                garr[i].regions = ctypes.cast(regs, ctypes.POINTER(_lib.kvw_region_t))
            self._keep.append(garr)
            p.num_groups, p.groups = len(groups), garr
        else:
            kvarr, nkv = _regions(kv, self._keep)
            if num_layers is None:
                num_layers = nkv // 2
            p.num_layers = num_layers
            p.kv_regions = ctypes.cast(kvarr, ctypes.POINTER(_lib.kvw_region_t)) if nkv else None
            auxarr, naux = _regions(aux, self._keep)
            p.num_aux = naux
            p.aux_regions = ctypes.cast(auxarr, ctypes.POINTER(_lib.kvw_region_t)) if naux else None
        cfgp = _cfg_ptr(config)
        p.config = cfgp
        h = ctypes.c_void_p()
        _call(_c.kvw_engine_create, f"kvw_engine_create({self.role.name.lower()} on {local_ip})",
              ctypes.byref(p), ctypes.byref(h))
        self._cell = _Cell(h.value, "engine")
        self.engine_rank = engine_rank

    # -- properties ------------------------------------------------------
    @property
    def device_name(self) -> str:
        with self._lock:
            return _s(_c.kvw_engine_device_name(self._get()))

    @property
    def gid_index(self) -> int:
        with self._lock:
            return int(_c.kvw_engine_gid_index(self._get()))

    @property
    def endpoint(self) -> str:
        """"tcp://ip:port" of the control socket."""
        with self._lock:
            return _s(_c.kvw_engine_endpoint(self._get()))

    def counters(self) -> Counters:
        """Snapshot of the engine's counters (each exact, not taken together)."""
        c = _lib.kvw_counters_t()
        with self._lock:
            _c.kvw_engine_counters(self._get(), ctypes.byref(c))
        return Counters(*(getattr(c, n) for n, _ in c._fields_))

    # -- requests --------------------------------------------------------
    def _adopt(self, h: int, kind: str) -> _Cell:
        cell = _Cell(h, kind)
        self._children[id(cell)] = cell
        return cell

    def _forget(self, cell: _Cell) -> None:
        with self._lock:
            self._children.pop(id(cell), None)

    def sender(self, room: int) -> "Sender":
        """Prefill: a Sender for room (kvw_sender_create)."""
        return Sender(self, room)

    def receiver(self, bootstrap_addr: str, prefill_rank: int, room: int) -> "Receiver":
        """Decode: a Receiver for room from the prefill engine registered as
        prefill_rank at bootstrap_addr (kvw_receiver_create)."""
        return Receiver(self, bootstrap_addr, prefill_rank, room)

    def close(self) -> None:
        """Close every Sender/Receiver of this engine (receivers wait for
        their abort barrier), then destroy the engine. Idempotent."""
        cell = self._cell
        if cell is None:
            return
        with self._lock:
            for child in list(self._children.values()):
                with child.lock:
                    if child.h is not None:
                        if child.kind == "sender":
                            _c.kvw_sender_destroy(child.h)
                        else:
                            _c.kvw_receiver_destroy(child.h)
                        child.h = None
            self._children.clear()
            with cell.lock:
                if cell.h is not None:
                    _c.kvw_engine_destroy(cell.h)
                    cell.h = None
            self._keep = []

    def __repr__(self) -> str:
        return f"<kvwire.Engine {self.role.name.lower()} {'closed' if self.closed else self.endpoint}>"


class _Request(_Handle):
    _engine: Engine
    room: int

    def _close_with(self, destroy: Any) -> None:
        cell = self._cell
        if cell is None:
            return
        with cell.lock:
            if cell.h is not None:
                destroy(cell.h)
                cell.h = None
        self._engine._forget(cell)

    def _failure(self, fn: Any, what: str) -> Optional[Error]:
        reason = ctypes.c_char_p()
        with self._cell.lock if self._cell else _nolock:
            st = fn(self._get(), ctypes.byref(reason))
            text = _s(reason.value)
        if st == 0:
            return None
        return Error(st, text or None, f"{what} room {self.room}")

    def _metrics(self, name: str) -> ReqMetrics:
        fn = _L.optional.get(name)
        if fn is None:
            raise _unsupported(name, f"{self._what}.metrics()")
        m = _lib.kvw_req_metrics_t()
        with self._cell.lock if self._cell else _nolock:
            _call(fn, name, self._get(), ctypes.byref(m))
        return ReqMetrics(m.bytes, m.writes, m.transfer_us, m.start_ns, m.end_ns)


class _NoLock:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *a: Any) -> None:
        return None


_nolock = _NoLock()


def _event(event: Optional[int]) -> Optional[int]:
    """A producer's CUDA event as the C calls take it: the CUevent handle as
    an int (torch.cuda.Event().cuda_event, cupy's Event.ptr, a cudaEvent_t
    from ctypes), or None / 0 for none."""
    if event is None:
        return None
    if isinstance(event, bool) or not hasattr(event, "__index__"):
        raise TypeError("kvwire: event must be a CUDA event handle (an int) or None")
    e = event.__index__()
    if not 0 <= e < 1 << (8 * ctypes.sizeof(ctypes.c_void_p)):
        raise ValueError(f"kvwire: event handle {e} is not a pointer value")
    return e or None


def _aux(aux_index: Optional[int]) -> int:
    if aux_index is None:
        return NO_AUX
    if isinstance(aux_index, bool) or not hasattr(aux_index, "__index__"):
        raise TypeError("kvwire: aux_index must be an int or None")
    a = aux_index.__index__()
    if not 0 <= a <= NO_AUX:
        raise ValueError(f"kvwire: aux_index {a} is outside 0..2**32-1")
    return a


class Sender(_Request):
    """Prefill side of one request (kvw_sender_*). Bootstrapping until
    decode's request for the room arrives, WaitingForInput, Transferring
    once pages are handed over, Success when every write completed. Closing
    a live sender aborts it (it does not wait). One thread at a time."""

    _what = "kvwire.Sender"

    def __init__(self, engine: Engine, room: int):
        self._engine = engine
        self.room = int(room)
        h = ctypes.c_void_p()
        with engine._lock:
            _call(_c.kvw_sender_create, f"kvw_sender_create(room {self.room})", engine._get(),
                  self.room, ctypes.byref(h))
            self._cell = engine._adopt(h.value, "sender")

    def init(self, num_pages: int, aux_index: Optional[int] = None) -> None:
        """Declare the request's page count (all chunks together) and its aux
        index (None: no aux)."""
        with self._cell.lock:
            _call(_c.kvw_sender_init, f"kvw_sender_init(room {self.room})", self._get(),
                  int(num_pages), _aux(aux_index))

    def send(self, pages: Any, event: Optional[int] = None) -> None:
        """Hand over the next source pages (all layers). May be called once
        per chunk; the request completes when init's num_pages are all
        handed over (and the state, if any). pages: see as_indices().

        The pages must be fully written when this is called, or event is a
        CUDA event (its handle as an int, e.g. torch.cuda.Event().cuda_event)
        recorded on the producing stream after the writes: kvwire then reads
        nothing of these pages before it completed, without this call
        waiting for it (kvw_sender_send_after). Keep the event alive, and do
        not record it again, until the request ended (poll() says SUCCESS or
        FAILED, or close() returned). Error(KVW_ERR_UNSUPPORTED) for an
        event when CUDA is not available."""
        idx = as_indices(pages)
        ev = _event(event)
        if ev is None:
            with self._cell.lock:
                _call(_c.kvw_sender_send, f"kvw_sender_send(room {self.room})", self._get(),
                      idx.ptr, idx.count)
            return
        fn = _L.optional.get("kvw_sender_send_after")
        if fn is None:
            raise _unsupported("kvw_sender_send_after", "kvwire.Sender.send(event=...)")
        with self._cell.lock:
            _call(fn, f"kvw_sender_send_after(room {self.room})", self._get(), idx.ptr,
                  idx.count, ev)

    def send_part(self, pages: Any, first_page: int, layer_begin: int = 0,
                  layer_end: int = 0, event: Optional[int] = None) -> None:
        """Layer-wise: pages for page positions first_page.. of layers
        [layer_begin, layer_end) (0, 0: all layers). Per layer, parts must
        cover page positions in order. event: as for send(), e.g. one event
        per layer recorded right after the layer's kernels
        (kvw_sender_send_part_after)."""
        ev = _event(event)
        name = "kvw_sender_send_part" if ev is None else "kvw_sender_send_part_after"
        fn = _L.optional.get(name)
        if fn is None:
            what = "kvwire.Sender.send_part()" if ev is None else "kvwire.Sender.send_part(event=...)"
            raise _unsupported(name, what)
        idx = as_indices(pages)
        part = _lib.kvw_part_t(idx.ptr, idx.count, int(first_page), int(layer_begin),
                               int(layer_end))
        args = (ctypes.byref(part),) if ev is None else (ctypes.byref(part), ev)
        with self._cell.lock:
            _call(fn, f"{name}(room {self.room})", self._get(), *args)

    def send_state(self, state: Any) -> None:
        """The request's state indices (state groups)."""
        fn = _L.optional.get("kvw_sender_send_state")
        if fn is None:
            raise _unsupported("kvw_sender_send_state", "kvwire.Sender.send_state()")
        idx = as_indices(state)
        with self._cell.lock:
            _call(fn, f"kvw_sender_send_state(room {self.room})", self._get(), idx.ptr, idx.count)

    def poll(self) -> Poll:
        """Current state; never blocks."""
        self._get()
        with self._cell.lock:
            return Poll(_c.kvw_sender_poll(self._get()))

    def failure(self) -> Optional[Error]:
        """Why the request failed (an Error, not raised), or None."""
        return self._failure(_c.kvw_sender_failure, "sender")

    def abort(self) -> None:
        """Fail the request now (KVW_ERR_ABORTED); decode is told once the
        writes already posted completed. Error(KVW_ERR_STATE) if it ended."""
        with self._cell.lock:
            _call(_c.kvw_sender_abort, f"kvw_sender_abort(room {self.room})", self._get())

    def metrics(self) -> ReqMetrics:
        """Bytes, writes and transfer time of this request so far."""
        return self._metrics("kvw_sender_metrics")

    def close(self) -> None:
        """Destroy (aborting a live request first, without waiting). Idempotent."""
        self._close_with(_c.kvw_sender_destroy)

    def __repr__(self) -> str:
        st = "closed" if self.closed else self.poll().name
        return f"<kvwire.Sender room {self.room} {st}>"


class Receiver(_Request):
    """Decode side of one request (kvw_receiver_*). Bootstrapping until the
    prefill rank is connected, WaitingForInput, Transferring after init(),
    Success once the request's last write landed here. Once it reports
    Failed nothing more lands in its pages. close() of a live receiver
    aborts it and waits for the abort barrier (at most ~peer_timeout_ms).
    One thread at a time."""

    _what = "kvwire.Receiver"

    def __init__(self, engine: Engine, bootstrap_addr: str, prefill_rank: int, room: int):
        self._engine = engine
        self.room = int(room)
        self.bootstrap_addr = bootstrap_addr
        self.prefill_rank = int(prefill_rank)
        h = ctypes.c_void_p()
        with engine._lock:
            _call(_c.kvw_receiver_create, f"kvw_receiver_create(room {self.room})",
                  engine._get(), bootstrap_addr.encode(), self.prefill_rank, self.room,
                  ctypes.byref(h))
            self._cell = engine._adopt(h.value, "receiver")

    def init(self, pages: Any, aux_index: Optional[int] = None, state: Any = None) -> None:
        """Destination pages (see as_indices), aux index (None: none) and
        state indices (needs kvw_receiver_init_indices). May be called while
        still Bootstrapping."""
        p = as_indices(pages)
        s = as_indices(state)
        fn = _L.optional.get("kvw_receiver_init_indices")
        with self._cell.lock:
            if s.count:
                if fn is None:
                    raise _unsupported("kvw_receiver_init_indices", "kvwire.Receiver.init(state=...)")
                ix = _lib.kvw_indices_t(p.ptr, p.count, _aux(aux_index), s.ptr, s.count)
                _call(fn, f"kvw_receiver_init_indices(room {self.room})", self._get(),
                      ctypes.byref(ix))
            else:
                _call(_c.kvw_receiver_init, f"kvw_receiver_init(room {self.room})", self._get(),
                      p.ptr, p.count, _aux(aux_index))

    def poll(self) -> Poll:
        """Current state; never blocks."""
        self._get()
        with self._cell.lock:
            return Poll(_c.kvw_receiver_poll(self._get()))

    def failure(self) -> Optional[Error]:
        """Why the request failed (an Error, not raised), or None."""
        return self._failure(_c.kvw_receiver_failure, "receiver")

    def abort(self) -> None:
        """Give the request up without blocking (see kvw_receiver_abort)."""
        with self._cell.lock:
            _call(_c.kvw_receiver_abort, f"kvw_receiver_abort(room {self.room})", self._get())

    def metrics(self) -> ReqMetrics:
        return self._metrics("kvw_receiver_metrics")

    def close(self) -> None:
        """Destroy; a live request is aborted and the barrier awaited. Idempotent."""
        self._close_with(_c.kvw_receiver_destroy)

    def __repr__(self) -> str:
        st = "closed" if self.closed else self.poll().name
        return f"<kvwire.Receiver room {self.room} {st}>"
