# SPDX-License-Identifier: Apache-2.0
"""The objects that own C handles: Bootstrap, Engine, Sender and Receiver,
and the value types they take and return (Region, Group, GroupHeads,
Counters, ReqMetrics). Internal: re-exported by kvwire/__init__.py."""

from __future__ import annotations

import ctypes
import threading
from typing import (Any, Dict, Iterable, List, Mapping, NamedTuple, Optional, Sequence, Tuple,
                    Union)

from . import _lib
from ._config import Config, _cfg_ptr
from ._core import (NO_AUX, ClosedError, Error, GroupKind, Poll, Role, Status, _c, _call, _L, _s,
                    _unsupported)
from ._indices import as_indices

# ----------------------------------------------------------- C integers
#
# ctypes converts a Python int into a C integer by truncation: -1 becomes
# SIZE_MAX, 2**64 + 8192 becomes 8192, and the library then validates a
# value it was never given. Every integer the binding hands to C goes
# through _uint first, so that one that does not fit is an exception here.

_SIZE_MAX = (1 << (8 * ctypes.sizeof(ctypes.c_size_t))) - 1
_PTR_MAX = (1 << (8 * ctypes.sizeof(ctypes.c_void_p))) - 1
_U32_MAX = (1 << 32) - 1
_U64_MAX = (1 << 64) - 1
# kvw_engine_params_t's counts (num_kv_regions, ...) came with 1.4: an
# older library refuses a struct whose bytes past its own end are set, so
# they are left 0 ("implied") there, and the checks below stand alone.
_HAS_COUNTS = int(_c.kvw_version()) >= 10400
# attn_tp_rank / attn_tp_size (heads learned from prefill) came with 1.5.
_HAS_LEARNING = int(_c.kvw_version()) >= 10500


def _uint(value: Any, hi: int, what: str) -> int:
    """value as a C unsigned integer of at most hi: TypeError for anything
    but an integer (bool and float included: no silent truncation),
    OverflowError outside 0..hi (the C type's range)."""
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise TypeError(f"{what} must be an int, not {type(value).__name__}")
    v = value.__index__()
    if not 0 <= v <= hi:
        raise OverflowError(f"{what} {v} does not fit its C type (0..{hi})")
    return v


def _text(value: Any, what: str, optional: bool = False) -> Optional[bytes]:
    """A str for a C string: TypeError for anything else, ValueError for an
    embedded NUL (C would see only the text before it)."""
    if value is None and optional:
        return None
    if not isinstance(value, str):
        raise TypeError(f"{what} must be a str, not {type(value).__name__}")
    if "\0" in value:
        raise ValueError(f"{what} {value!r} contains a NUL character")
    return value.encode()


def _seq(value: Any, what: str) -> List[Any]:
    """A list of the entries of a sequence (not a str or bytes)."""
    if isinstance(value, (str, bytes, bytearray)) or not isinstance(value, Iterable):
        raise TypeError(f"{what} must be a sequence, not {type(value).__name__}")
    return list(value)

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
                                        _text(bind_addr, "kvwire.Bootstrap: bind_addr"),
                                        _cfg_ptr(config),
                                        _uint(lease_ms, _U32_MAX, "kvwire.Bootstrap: lease_ms"))
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
            return cls(int(ai["data"][0]), mv.nbytes, _uint(item_len, _SIZE_MAX, "item_len"), buf)
        mv = memoryview(buf)
        if not mv.c_contiguous:
            raise ValueError("kvwire.Region.of: the buffer must be C-contiguous")
        if mv.readonly:
            raise ValueError("kvwire.Region.of: the buffer must be writable")
        n = mv.nbytes
        if n == 0:
            raise ValueError("kvwire.Region.of: empty buffer")
        arr = (ctypes.c_char * n).from_buffer(mv.cast("B"))
        return cls(ctypes.addressof(arr), n, _uint(item_len, _SIZE_MAX, "item_len"), (buf, arr))


RegionLike = Union[Region, Tuple[int, int, int]]


class Group(NamedTuple):
    """kvw_group_t: num_layers * regions_per_layer regions, region-major
    (region j of layer l at regions[j * num_layers + l]; for sglang's MHA
    kv_data_ptrs, K layers then V layers, that is regions_per_layer=2)."""

    kind: GroupKind
    num_layers: int
    regions_per_layer: int
    regions: Sequence[RegionLike]


class GroupHeads(NamedTuple):
    """kvw_group_heads_t (head slicing, docs/head-slicing.md): a KV group's
    pages hold page_tokens tokens of num_heads heads of head_bytes each,
    heads [first_head, first_head + num_heads) of the model's total_heads;
    page_order "NHD" (token-major, sglang's MHA pools) or "HND" (head-major
    per page), or 0 / 1."""

    total_heads: int
    first_head: int
    num_heads: int
    head_bytes: int
    page_tokens: int
    page_order: Union[int, str] = 0

    @classmethod
    def learned(cls, page_tokens: int, page_order: Union[int, str] = 0) -> "GroupHeads":
        """A decode KV group that learns its heads from prefill's handshake
        (docs/head-slicing.md): only its page is given; the engine needs
        attn_tp_rank and attn_tp_size (kvwire.Engine), and head_bytes,
        total_heads, first_head and num_heads come from the first prefill
        rank that describes its heads and the group's item length."""
        return cls(0, 0, 0, 0, page_tokens, page_order)


_PAGE_ORDERS = {"NHD": 0, "HND": 1, 0: 0, 1: 1}


def _page_order(order: Any, what: str) -> int:
    if isinstance(order, str) and order in _PAGE_ORDERS:
        return _PAGE_ORDERS[order]
    if not isinstance(order, bool) and hasattr(order, "__index__") and order.__index__() in (0, 1):
        return order.__index__()
    raise ValueError(f"{what}: page_order {order!r} is not NHD or HND (0 or 1)")


def _group_heads(heads: Any, want: int, keep: List[Any]) -> Tuple[Any, int]:
    """The kvw_group_heads_t array: one entry per group (None: not
    described); returns it and its length."""
    heads = _seq(heads, "kvwire.Engine: group_heads")
    if len(heads) != want:
        raise ValueError(f"kvwire.Engine: group_heads has {len(heads)} entries, one per group "
                         f"({want}) is needed")
    arr = (_lib.kvw_group_heads_t * want)()
    for i, h in enumerate(heads):
        if h is None:
            continue
        what = f"kvwire.Engine: group_heads[{i}]"
        try:
            h = h if isinstance(h, GroupHeads) else GroupHeads(*h)
        except TypeError:
            raise TypeError(f"{what}: a GroupHeads or a tuple of its 5 or 6 fields, "
                            f"not {h!r}") from None
        for nm in ("total_heads", "first_head", "num_heads", "head_bytes", "page_tokens"):
            setattr(arr[i], nm, _uint(getattr(h, nm), _U32_MAX, f"{what}.{nm}"))
        arr[i].page_order = _page_order(h.page_order, what)
    keep.append(arr)
    return arr, want


def _state_lists(lists: Optional[Mapping[int, Any]], what: str) -> Tuple[Any, int, List[Any]]:
    """kvw_state_list_t entries from {group index: indices}; None or an
    empty list skips the group for this request (sglang's None)."""
    keep: List[Any] = []
    if not lists:
        return None, 0, keep
    arr = (_lib.kvw_state_list_t * len(lists))()
    for i, (g, idx) in enumerate(lists.items()):
        if isinstance(g, bool) or not isinstance(g, int) or not 0 <= g < 2 ** 32:
            raise TypeError(f"{what}: state list keys are group indices (int), got {g!r}")
        ix = as_indices(idx)
        keep.append(ix)
        arr[i].group, arr[i].indices, arr[i].count = g, ix.ptr, ix.count
    keep.append(arr)
    return arr, len(lists), keep


def _region(r: Any, what: str) -> Region:
    """One region, checked as kvw_engine_create would (a non-NULL address,
    a non-empty length that is a multiple of a non-zero item length), and
    first that each field fits its C type and the region the address
    space."""
    if not isinstance(r, Region):
        if isinstance(r, (str, bytes)) or not isinstance(r, (tuple, list)) or len(r) != 3:
            raise TypeError(f"{what}: a Region or an (addr, length, item_len) triple, not {r!r}")
        r = Region(*r)
    addr = _uint(r.addr, _PTR_MAX, f"{what}: addr")
    length = _uint(r.length, _SIZE_MAX, f"{what}: length")
    item_len = _uint(r.item_len, _SIZE_MAX, f"{what}: item_len")
    if not addr or not length or not item_len:
        raise ValueError(f"{what}: addr {addr:#x}, length {length}, item_len {item_len}: each "
                         "must be non-zero")
    if length % item_len:
        raise ValueError(f"{what}: length {length} is not a multiple of item_len {item_len}")
    if addr + length - 1 > _PTR_MAX:
        raise OverflowError(f"{what}: {length} bytes from {addr:#x} run past the end of the "
                            "address space")
    return Region(addr, length, item_len, r.owner)


def _regions(seq: Any, keep: List[Any], what: str) -> Tuple[Any, int]:
    """The kvw_region_t array of seq (None when empty) and its length."""
    items = [_region(r, f"{what}[{i}]") for i, r in enumerate(_seq(seq, what))]
    if not items:
        return None, 0
    arr = (_lib.kvw_region_t * len(items))()
    for i, r in enumerate(items):
        arr[i].addr, arr[i].len, arr[i].item_len = r.addr, r.length, r.item_len
        if r.owner is not None:
            keep.append(r.owner)
    keep.append(arr)
    return ctypes.cast(arr, ctypes.POINTER(_lib.kvw_region_t)), len(items)


def _kv_layers(nkv: int, num_layers: Any) -> int:
    """The classic layout's L: kv= holds exactly 2L regions, K then V."""
    if num_layers is None:
        if not nkv or nkv % 2:
            raise ValueError(f"kvwire.Engine: kv has {nkv} regions; 2 per layer (K layers, then "
                             "V layers) are needed")
        return nkv // 2
    layers = _uint(num_layers, _U32_MAX // 2, "kvwire.Engine: num_layers")
    if not layers or nkv != 2 * layers:
        raise ValueError(f"kvwire.Engine: kv has {nkv} regions, but num_layers {layers} needs "
                         f"2 x {layers} = {2 * layers} (K layers, then V layers)")
    return layers


def _group(g: Any, i: int, keep: List[Any]) -> Tuple[Any, int]:
    """kvw_group_t i and the number of regions its array holds."""
    what = f"kvwire.Engine: group {i}"
    if not isinstance(g, Group):
        if isinstance(g, (str, bytes)) or not isinstance(g, (tuple, list)) or len(g) != 4:
            raise TypeError(f"{what}: a Group or a (kind, num_layers, regions_per_layer, "
                            f"regions) tuple, not {g!r}")
        g = Group(*g)
    kind = _uint(g.kind, _U32_MAX, f"{what}: kind")
    if kind not in set(GroupKind):
        raise ValueError(f"{what}: kind {kind} is not a GroupKind (KV, AUX, STATE)")
    layers = _uint(g.num_layers, _U32_MAX, f"{what}: num_layers")
    per_layer = _uint(g.regions_per_layer, _U32_MAX, f"{what}: regions_per_layer")
    regs, n = _regions(g.regions, keep, f"{what}: regions")
    if not n or n != layers * per_layer:
        raise ValueError(f"{what} has {n} regions, not num_layers*regions_per_layer = "
                         f"{layers} x {per_layer} = {layers * per_layer}")
    return _lib.kvw_group_t(kind, layers, per_layer, regs), n


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
    handshakes: int  # control-plane handshakes completed, and refused (1.5)
    handshakes_refused: int


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
    if isinstance(role, bool) or not hasattr(role, "__index__"):
        raise TypeError(f"kvwire: role must be 'prefill', 'decode' or a Role, not {role!r}")
    return Role(role.__index__())  # ValueError for another number


class Engine(_Handle):
    """One engine per process and role (kvw_engine_create): opens the RDMA
    device (by name, or found from local_ip), registers the memory once,
    starts its control and poller threads and (prefill) registers
    engine_rank with the bootstrap service at bootstrap_addr.

    Memory, either
      kv:  2L regions, K layers 0..L-1 then V layers 0..L-1 (num_layers = L,
           default len(kv) // 2), plus aux: regions indexed by aux index; or
      groups: a list of Group (needs a library with buffer groups).
    group_heads: head slicing (docs/head-slicing.md), one GroupHeads or None
    per group (one for kv=, its K/V group); only KV groups describe heads.
    A decode engine may leave its heads to prefill: GroupHeads.learned(
    page_tokens, order) entries, with attn_tp_rank of attn_tp_size (its
    place among the ranks splitting the model's heads; needs libkvwire
    1.5).
    The memory stays the caller's and must outlive close().

    A shape the library would misread is refused before it is called:
    ValueError for a region count the layout does not read (kv not
    2 x num_layers, ...) or a region the library refuses (zero address,
    length or item_len; length not a multiple of item_len), OverflowError
    for an integer that does not fit its C type, TypeError for a value of
    the wrong type. Otherwise raises Error (KVW_ERR_NO_DEVICE, ...) with
    nothing left allocated.
    Thread-safe; close() first closes every Sender and Receiver of it."""

    _what = "kvwire.Engine"

    def __init__(self, role: Union[str, int, Role], local_ip: str, *,
                 kv: Sequence[RegionLike] = (), num_layers: Optional[int] = None,
                 aux: Sequence[RegionLike] = (), groups: Optional[Sequence[Group]] = None,
                 device: Optional[str] = None, engine_rank: int = 0,
                 bootstrap_addr: Optional[str] = None, config: Optional[Config] = None,
                 group_heads: Optional[Sequence[Optional[GroupHeads]]] = None,
                 attn_tp_rank: int = 0, attn_tp_size: int = 0):
        self._keep: List[Any] = []
        self._lock = threading.RLock()
        self._children: Dict[int, _Cell] = {}
        self.role = _role(role)
        p = _lib.kvw_engine_params_t()
        p.struct_size = ctypes.sizeof(_lib.kvw_engine_params_t)
        p.role = int(self.role)
        p.engine_rank = _uint(engine_rank, _U32_MAX, "kvwire.Engine: engine_rank")
        p.device = _text(device, "kvwire.Engine: device", optional=True) or None
        p.local_ip = _text(local_ip, "kvwire.Engine: local_ip")
        p.bootstrap_addr = _text(bootstrap_addr, "kvwire.Engine: bootstrap_addr",
                                 optional=True) or None
        if groups:
            self._groups(p, groups, kv, aux, num_layers)
        else:
            self._classic(p, kv, aux, num_layers)
        if group_heads is not None:
            harr, nh = _group_heads(group_heads, p.num_groups or 1, self._keep)
            p.group_heads = ctypes.cast(harr, ctypes.POINTER(_lib.kvw_group_heads_t))
            p.num_group_heads = nh if _HAS_COUNTS else 0
        if attn_tp_rank or attn_tp_size:
            if not _HAS_LEARNING:
                raise Error(Status.ERR_UNSUPPORTED,
                            f"kvwire.Engine(attn_tp_size=...) needs libkvwire 1.5 or newer "
                            f"(heads learned from prefill); {_L.path} is older")
            p.attn_tp_rank = _uint(attn_tp_rank, _U32_MAX, "kvwire.Engine: attn_tp_rank")
            p.attn_tp_size = _uint(attn_tp_size, _U32_MAX, "kvwire.Engine: attn_tp_size")
        cfgp = _cfg_ptr(config)
        p.config = cfgp
        h = ctypes.c_void_p()
        _call(_c.kvw_engine_create, f"kvw_engine_create({self.role.name.lower()} on {local_ip})",
              ctypes.byref(p), ctypes.byref(h))
        self._cell = _Cell(h.value, "engine")
        self.engine_rank = engine_rank

    # Every array handed to kvw_engine_create is built here from a list
    # whose length was checked against the layout, and its count goes
    # with it (num_kv_regions, group_num_regions, num_group_heads): the
    # library checks those too, so that no array is read past its end.

    def _classic(self, p: Any, kv: Any, aux: Any, num_layers: Any) -> None:
        """The classic layout: kv is 2L regions, K layers then V layers."""
        kvp, nkv = _regions(kv, self._keep, "kvwire.Engine: kv")
        p.num_layers = _kv_layers(nkv, num_layers)
        p.kv_regions = kvp
        p.num_kv_regions = nkv if _HAS_COUNTS else 0
        auxp, naux = _regions(aux, self._keep, "kvwire.Engine: aux")
        p.num_aux = _uint(naux, _U32_MAX, "kvwire.Engine: the number of aux regions")
        p.aux_regions = auxp

    def _groups(self, p: Any, groups: Any, kv: Any, aux: Any, num_layers: Any) -> None:
        """Buffer groups: each group's regions array with its count."""
        if kv or aux or num_layers:
            raise ValueError("kvwire.Engine: give either groups or kv/aux, not both")
        if not _L.has(_lib.GROUPS_MARKER):
            raise _unsupported(_lib.GROUPS_MARKER, "kvwire.Engine(groups=...)")
        groups = _seq(groups, "kvwire.Engine: groups")
        if len(groups) > _lib.MAX_GROUPS:
            raise ValueError(f"kvwire.Engine: {len(groups)} groups; at most {_lib.MAX_GROUPS}")
        garr = (_lib.kvw_group_t * len(groups))()
        counts = (ctypes.c_size_t * len(groups))()
        for i, g in enumerate(groups):
            garr[i], counts[i] = _group(g, i, self._keep)
        self._keep += [garr, counts]
        p.num_groups, p.groups = len(groups), garr
        if _HAS_COUNTS:
            p.group_num_regions = ctypes.cast(counts, ctypes.POINTER(ctypes.c_size_t))

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
            _c.kvw_engine_counters_ex(self._get(), ctypes.byref(c), ctypes.sizeof(c))
        return Counters(*(getattr(c, n) for n, _ in c._fields_))

    def rails(self) -> List[dict]:
        """The engine's rails (KVW_DEVICES; one entry with one device): each a
        dict of device, gid_index, link_mbps (0: unknown), the WRs and
        bytes prefill posted on it, and its lanes' failures and rejoins
        (lanes_failed, lanes_rejoined, lanes_out, probes, recovery_us_last,
        recovery_us_max; kvw_engine_rails)."""
        fn = _L.optional.get("kvw_engine_rails")
        if fn is None:
            raise _unsupported("kvw_engine_rails", "an engine's rails")
        buf = (_lib.kvw_rail_t * 8)()
        health = (_lib.kvw_rail_health_t * 8)()
        health_fn = _L.optional.get("kvw_engine_rail_health")
        with self._lock:
            n = fn(self._get(), buf, 8)
            if health_fn is not None:
                health_fn(self._get(), health, 8)
        rails = []
        for i in range(min(n, 8)):
            rail = {name: getattr(buf[i], name) for name, _ in _lib.kvw_rail_t._fields_}
            rail["device"] = buf[i].device.decode()
            if health_fn is not None:
                rail.update({name: getattr(health[i], name)
                             for name, _ in _lib.kvw_rail_health_t._fields_})
            rails.append(rail)
        return rails

    def metrics_text(self) -> str:
        """The engine's metrics in the OpenMetrics text format, one complete
        exposition ending "# EOF" (kvw_engine_metrics_text; the families:
        docs/operations.md, "Metrics"). kvwire.metrics.KvwireCollector
        serves them to prometheus_client."""
        fn = _L.optional.get("kvw_engine_metrics_text")
        if fn is None:
            raise _unsupported("kvw_engine_metrics_text", "an engine's metrics")
        size = ctypes.c_size_t(16384)
        while True:
            buf = ctypes.create_string_buffer(size.value)
            with self._lock:
                st = fn(self._get(), buf, size, ctypes.byref(size))
            if st == Status.OK:
                return buf.value.decode()
            if st != Status.ERR_LIMIT:
                raise Error(st, "kvw_engine_metrics_text failed")

    # -- requests --------------------------------------------------------
    def _adopt(self, h: int, kind: str) -> _Cell:
        cell = _Cell(h, kind)
        self._children[id(cell)] = cell
        return cell

    def _forget(self, cell: _Cell) -> None:
        with self._lock:
            self._children.pop(id(cell), None)

    def sender(self, room: int, receivers: Optional[int] = 1) -> "Sender":
        """Prefill: a Sender for room (kvw_sender_create). receivers > 1:
        one sender serving the room to that many decode receivers, one per
        decode engine (kvw_sender_create_fanout: decode TP > prefill TP,
        each decode rank getting its heads, or MLA's replicated latent, and
        its own aux item); the calls apply to each request, Success once
        every one is delivered, a failure of any fails them all.
        receivers=None: as many as the first decode request for the room
        says (kvw_sender_create_learn; Receiver.set_room_receivers on
        decode, 1 when it says none); init and send only once poll() left
        BOOTSTRAPPING."""
        return Sender(self, room, receivers)

    def receiver(self, bootstrap_addr: str, prefill_rank: int, room: int) -> "Receiver":
        """Decode: a Receiver for room from the prefill engine registered as
        prefill_rank at bootstrap_addr (kvw_receiver_create)."""
        return Receiver(self, bootstrap_addr, prefill_rank, room)

    def receiver_ranks(self, ranks: Sequence[Any], room: int) -> "RanksReceiver":
        """Decode: one Receiver for room whose heads come from several
        prefill ranks (kvw_receiver_create_ranks; head slicing with decode
        TP < prefill TP, docs/head-slicing.md). ranks: PrefillRank, or
        (address, rank) pairs where an address "tcp://ip:port" is a prefill
        engine's control endpoint (as sglang's bootstrap server carries it)
        and any other a kvwire bootstrap service ("host:port")."""
        return RanksReceiver(self, ranks, room)

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

    def __init__(self, engine: Engine, room: int, receivers: Optional[int] = 1):
        self._engine = engine
        self.room = _uint(room, _U64_MAX, "kvwire.Sender: room")
        # None: as many as decode's requests say
        self.receivers: Optional[int] = None
        if receivers is None:
            self._create_learn(engine)
            return
        n = _uint(receivers, _U32_MAX, "kvwire.Sender: receivers")
        if not 1 <= n <= _lib.MAX_DECODE_RECEIVERS:
            raise ValueError(f"kvwire: receivers {n} is outside 1..{_lib.MAX_DECODE_RECEIVERS}")
        self.receivers = n
        fan = None
        if n > 1:
            fan = _L.optional.get("kvw_sender_create_fanout")
            if fan is None:
                raise _unsupported("kvw_sender_create_fanout", "kvwire.Engine.sender(receivers>1)")
        h = ctypes.c_void_p()
        with engine._lock:
            if fan is None:
                _call(_c.kvw_sender_create, f"kvw_sender_create(room {self.room})",
                      engine._get(), self.room, ctypes.byref(h))
            else:
                _call(fan, f"kvw_sender_create_fanout(room {self.room}, {n} receivers)",
                      engine._get(), self.room, n, ctypes.byref(h))
            self._cell = engine._adopt(h.value, "sender")

    def _create_learn(self, engine: Engine) -> None:
        fn = _L.optional.get("kvw_sender_create_learn")
        if fn is None:
            raise _unsupported("kvw_sender_create_learn", "kvwire.Engine.sender(receivers=None)")
        h = ctypes.c_void_p()
        with engine._lock:
            _call(fn, f"kvw_sender_create_learn(room {self.room})", engine._get(), self.room,
                  ctypes.byref(h))
            self._cell = engine._adopt(h.value, "sender")

    def init(self, num_pages: int, aux_index: Optional[int] = None) -> None:
        """Declare the request's page count (all chunks together) and its aux
        index (None: no aux)."""
        with self._cell.lock:
            _call(_c.kvw_sender_init, f"kvw_sender_init(room {self.room})", self._get(),
                  _uint(num_pages, _SIZE_MAX, "kvwire.Sender.init: num_pages"), _aux(aux_index))

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
        what = "kvwire.Sender.send_part"
        first = _uint(first_page, _SIZE_MAX, f"{what}: first_page")
        begin = _uint(layer_begin, _U32_MAX, f"{what}: layer_begin")
        end = _uint(layer_end, _U32_MAX, f"{what}: layer_end")
        idx = as_indices(pages)
        part = _lib.kvw_part_t(idx.ptr, idx.count, first, begin, end)
        args = (ctypes.byref(part),) if ev is None else (ctypes.byref(part), ev)
        with self._cell.lock:
            _call(fn, f"{name}(room {self.room})", self._get(), *args)

    def send_state(self, state: Any = None,
                   lists: Optional[Mapping[int, Any]] = None) -> None:
        """The request's state indices: state for every state group, or
        (hybrid models) lists={group index: indices} giving a state group
        its own list (Mamba: its slot; SWA/DSA: their page lists; None or
        [] skips the group), the groups not listed taking state. Decode's
        counts must match group by group (Error(KVW_ERR_MISMATCH))."""
        idx = as_indices(state)
        if lists:
            fn = _L.optional.get("kvw_sender_send_state_lists")
            if fn is None:
                raise _unsupported("kvw_sender_send_state_lists",
                                   "kvwire.Sender.send_state(lists=...)")
            arr, n, keep = _state_lists(lists, "kvwire.Sender.send_state")
            with self._cell.lock:
                _call(fn, f"kvw_sender_send_state_lists(room {self.room})", self._get(), idx.ptr,
                      idx.count, arr, n)
            del keep
            return
        fn = _L.optional.get("kvw_sender_send_state")
        if fn is None:
            raise _unsupported("kvw_sender_send_state", "kvwire.Sender.send_state()")
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

    def set_digest(self, digest: int) -> None:
        """Verified transfers (Config(verify=1)) with GPU memory the NIC
        reaches directly: the digest of what this request sends, any
        64-bit function of its bytes that decode's caller computes the same
        way (kvw_sender_set_digest), once, before or after Success; a
        fan-out sender's goes to each of its decode receivers.
        Error(KVW_ERR_STATE) when kvwire computes the digests itself (host
        or staged memory), the check is off, or it was given already."""
        fn = _L.optional.get("kvw_sender_set_digest")
        if fn is None:
            raise _unsupported("kvw_sender_set_digest", "kvwire.Sender.set_digest()")
        with self._cell.lock:
            _call(fn, f"kvw_sender_set_digest(room {self.room})", self._get(),
                  _digest(digest, "kvwire.Sender.set_digest"))

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
        self.room = _uint(room, _U64_MAX, "kvwire.Receiver: room")
        addr = _text(bootstrap_addr, "kvwire.Receiver: bootstrap_addr")
        self.bootstrap_addr = bootstrap_addr
        self.prefill_rank = _uint(prefill_rank, _U32_MAX, "kvwire.Receiver: prefill_rank")
        h = ctypes.c_void_p()
        with engine._lock:
            _call(_c.kvw_receiver_create, f"kvw_receiver_create(room {self.room})",
                  engine._get(), addr, self.prefill_rank, self.room, ctypes.byref(h))
            self._cell = engine._adopt(h.value, "receiver")

    def set_room_receivers(self, n: int) -> None:
        """Before init(): how many decode receivers ask this receiver's
        prefill rank for the room, this one included (decode TP > prefill
        TP), 1..KVW_MAX_DECODE_RECEIVERS (0: not said). The request carries
        it where both engines speak wire 12 with its capability, and a
        prefill sender made with receivers=None learns its count from it
        (kvw_receiver_set_room_receivers)."""
        fn = _L.optional.get("kvw_receiver_set_room_receivers")
        if fn is None:
            raise _unsupported("kvw_receiver_set_room_receivers",
                               "kvwire.Receiver.set_room_receivers")
        n = _uint(n, _U32_MAX, "kvwire.Receiver.set_room_receivers: n")
        if n > _lib.MAX_DECODE_RECEIVERS:
            raise ValueError(f"kvwire: {n} decode receivers is outside "
                             f"0..{_lib.MAX_DECODE_RECEIVERS}")
        with self._cell.lock:
            _call(fn, f"kvw_receiver_set_room_receivers(room {self.room}, {n})", self._get(), n)

    def init(self, pages: Any, aux_index: Optional[int] = None, state: Any = None,
             state_lists: Optional[Mapping[int, Any]] = None) -> None:
        """Destination pages (see as_indices), aux index (None: none) and
        state indices (needs kvw_receiver_init_indices) for every state
        group; state_lists={group index: indices} gives a state group its
        own list (hybrid models: Mamba's slot, an SWA/DSA page list; None or
        [] skips the group). May be called while still Bootstrapping."""
        p = as_indices(pages)
        s = as_indices(state)
        if state_lists:
            fl = _L.optional.get("kvw_receiver_init_lists")
            if fl is None:
                raise _unsupported("kvw_receiver_init_lists",
                                   "kvwire.Receiver.init(state_lists=...)")
            arr, n, keep = _state_lists(state_lists, "kvwire.Receiver.init")
            ix = _lib.kvw_indices_t(p.ptr, p.count, _aux(aux_index), s.ptr, s.count)
            with self._cell.lock:
                _call(fl, f"kvw_receiver_init_lists(room {self.room})", self._get(),
                      ctypes.byref(ix), arr, n)
            del keep
            return
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

    def landed(self) -> bool:
        """Verified transfers with the caller's digests: every write of the
        request landed, so its digest may be computed now and given to
        verify() (kvw_receiver_landed). False otherwise, and always when
        kvwire computes the digests itself."""
        fn = _L.optional.get("kvw_receiver_landed")
        if fn is None:
            return False
        with self._cell.lock:
            return bool(fn(self._get()))

    def verify(self, digest: int) -> None:
        """Decode's digest of the pages that landed (kvw_receiver_verify):
        SUCCESS once it equals prefill's, FAILED with KVW_ERR_CORRUPT when
        not. Error(KVW_ERR_STATE) before landed(), or once given."""
        fn = _L.optional.get("kvw_receiver_verify")
        if fn is None:
            raise _unsupported("kvw_receiver_verify", "kvwire.Receiver.verify()")
        with self._cell.lock:
            _call(fn, f"kvw_receiver_verify(room {self.room})", self._get(),
                  _digest(digest, "kvwire.Receiver.verify"))

    def close(self) -> None:
        """Destroy; a live request is aborted and the barrier awaited. Idempotent."""
        self._close_with(_c.kvw_receiver_destroy)

    def __repr__(self) -> str:
        st = "closed" if self.closed else self.poll().name
        return f"<kvwire.Receiver room {self.room} {st}>"


def _digest(x: Any, what: str) -> int:
    """A caller's digest: an int in [0, 2^64)."""
    if isinstance(x, bool) or not isinstance(x, int) or not 0 <= x < 2**64:
        raise ValueError(f"{what}: digest {x!r} is not an integer in [0, 2^64)")
    return x


class PrefillRank(NamedTuple):
    """One prefill rank of a receiver over several (kvw_prefill_rank_t):
    rank at the kvwire bootstrap service bootstrap_addr ("host:port"), or,
    bootstrap_addr None, the prefill engine whose control endpoint is
    endpoint ("tcp://ip:port"). Exactly one of the two."""

    rank: int
    bootstrap_addr: Optional[str] = None
    endpoint: Optional[str] = None


def _prefill_rank(x: Any, what: str) -> PrefillRank:
    if not isinstance(x, PrefillRank):
        if not isinstance(x, (tuple, list)) or len(x) != 2 or not isinstance(x[0], str):
            raise TypeError(f"{what}: a rank is a PrefillRank or an (address, rank) pair, "
                            f"not {x!r}")
        addr, rank = x
        x = (PrefillRank(rank, endpoint=addr) if addr.startswith("tcp://")
             else PrefillRank(rank, bootstrap_addr=addr))
    if isinstance(x.rank, bool) or not isinstance(x.rank, int) or not 0 <= x.rank < 2**32:
        raise ValueError(f"{what}: rank {x.rank!r} is not an integer in [0, 2^32)")
    _text(x.bootstrap_addr, f"{what}: rank {x.rank}'s bootstrap_addr", optional=True)
    _text(x.endpoint, f"{what}: rank {x.rank}'s endpoint", optional=True)
    if (x.bootstrap_addr is None) == (x.endpoint is None):
        raise ValueError(f"{what}: rank {x.rank} needs exactly one of bootstrap_addr and "
                         "endpoint")
    if x.endpoint is not None and (not x.endpoint.startswith("tcp://") or
                                   len(x.endpoint) == len("tcp://")):
        raise ValueError(f"{what}: rank {x.rank}'s endpoint {x.endpoint!r} is not tcp://ip:port")
    if x.bootstrap_addr is not None and (not x.bootstrap_addr or x.bootstrap_addr[0] == "@"):
        raise ValueError(f"{what}: rank {x.rank}'s bootstrap address {x.bootstrap_addr!r} "
                         "is not host:port")
    return x


class RanksReceiver(Receiver):
    """A Receiver for one room from several prefill ranks
    (kvw_receiver_create_ranks). Once every rank is connected, each is
    asked for the heads it sends (exactly one sender per head; ranks
    holding only heads another sends owe nothing and finish at once); the
    first rank owing heads also sends aux and state. Success once every
    rank delivered; when one fails the others are aborted and it turns
    Failed once none can land anything more, its reason naming the rank.
    Both engines must describe their heads (Engine(group_heads=...)).
    ranks is the list of PrefillRank, in the order given."""

    def __init__(self, engine: Engine, ranks: Sequence[Any], room: int):
        what = "kvwire.Engine.receiver_ranks"
        fn = _L.optional.get("kvw_receiver_create_ranks")
        if fn is None:
            raise _unsupported("kvw_receiver_create_ranks", what)
        if isinstance(ranks, (str, bytes)) or not isinstance(ranks, Sequence):
            raise TypeError(f"{what}: ranks is a list of PrefillRank or (address, rank)")
        self.ranks: List[PrefillRank] = [_prefill_rank(x, what) for x in ranks]
        if not 1 <= len(self.ranks) <= _lib.MAX_PREFILL_RANKS:
            raise ValueError(f"{what}: {len(self.ranks)} ranks; 1 to "
                             f"{_lib.MAX_PREFILL_RANKS} (KVW_MAX_PREFILL_RANKS)")
        self._engine = engine
        self.room = _uint(room, _U64_MAX, f"{what}: room")
        self.prefill_rank = self.ranks[0].rank
        self.bootstrap_addr = ", ".join(
            f"rank {k.rank} at {k.bootstrap_addr or k.endpoint}" for k in self.ranks)
        arr = (_lib.kvw_prefill_rank_t * len(self.ranks))()
        for i, k in enumerate(self.ranks):
            arr[i].bootstrap_addr = k.bootstrap_addr.encode() if k.bootstrap_addr else None
            arr[i].endpoint = k.endpoint.encode() if k.endpoint else None
            arr[i].rank = k.rank
        p = _lib.kvw_receiver_params_t(ctypes.sizeof(_lib.kvw_receiver_params_t), self.room,
                                       len(self.ranks), arr)
        h = ctypes.c_void_p()
        with engine._lock:
            _call(fn, f"kvw_receiver_create_ranks(room {self.room}, {len(self.ranks)} ranks)",
                  engine._get(), ctypes.byref(p), ctypes.byref(h))
            self._cell = engine._adopt(h.value, "receiver")

    def __repr__(self) -> str:
        st = "closed" if self.closed else self.poll().name
        return f"<kvwire.RanksReceiver room {self.room} {len(self.ranks)} ranks {st}>"
