# SPDX-License-Identifier: Apache-2.0
"""kvwire.sglang.standalone: the first kvwire backend for sglang, written
against sglang's Base* interface by duck typing, with kvwire's own
bootstrap service (ZeroMQ) and no sglang import.

It is NOT what `--disaggregation-transfer-backend kvwire` serves: sglang's
schedulers also use CommonKVManager's prefill_info_table,
try_ensure_parallel_info(), the receivers' conclude_state and the HTTP
bootstrap server (/route, /query_dp_ranks, /health), which only the
Common-based classes in kvwire.sglang.conn have. Kept for the unit-level
harness (python/tests/guest/sglang_harness.py) and for callers that drive
kvwire with sglang-shaped calls without sglang.

Mapping: one kvwire.Engine per TP rank; prefill registers with the kvwire
bootstrap service as rank (system_dp_rank << 16) + engine_rank and decode
asks for (prefill_dp_rank << 16) + its own engine_rank (equal TP sizes).
"""

from __future__ import annotations

import os
import socket
import sys
import time
from typing import Any, List, Optional, Sequence

import kvwire
from kvwire import Error, Poll

__all__ = [
    "KVWireKVBootstrapServer", "KVWireKVManager", "KVWireKVReceiver", "KVWireKVSender",
    "KVTransferError",
]

_DP_SHIFT = 16


class KVTransferError(Exception):
    """Raised by failure_exception(): room, the kvwire Error (status, name,
    reason), and a message naming both."""

    def __init__(self, bootstrap_room: int, error: Optional[Error], what: str):
        self.bootstrap_room = bootstrap_room
        self.error = error
        self.failure_reason = str(error) if error else what
        super().__init__(f"kvwire {what} room {bootstrap_room}: {self.failure_reason}")


class KVTransferMetricCompat:
    """Same fields as sglang's KVTransferMetric (used when sglang is absent)."""

    def __init__(self, transfer_latency_s: Optional[float] = None,
                 alloc_latency_s: Optional[float] = None,
                 transfer_total_bytes: Optional[int] = None):
        self.transfer_latency_s = transfer_latency_s
        self.alloc_latency_s = alloc_latency_s
        self.transfer_total_bytes = transfer_total_bytes

    def __repr__(self) -> str:
        return (f"KVTransferMetric(transfer_latency_s={self.transfer_latency_s}, "
                f"alloc_latency_s={self.alloc_latency_s}, "
                f"transfer_total_bytes={self.transfer_total_bytes})")


def _metric(latency_s: Optional[float], nbytes: Optional[int]) -> Any:
    base = sys.modules.get("sglang.srt.disaggregation.base.conn")
    cls = getattr(base, "KVTransferMetric", None) or KVTransferMetricCompat
    return cls(transfer_latency_s=latency_s, transfer_total_bytes=nbytes)


def _mode_name(mode: Any) -> str:
    v = getattr(mode, "value", mode)
    v = str(v).lower()
    if v not in ("prefill", "decode"):
        raise ValueError(f"kvwire.sglang: disaggregation_mode must be PREFILL or DECODE, not {mode!r}")
    return v


def _local_ip(server_args: Any, toward: Optional[str]) -> str:
    ip = os.environ.get("KVWIRE_LOCAL_IP")
    if ip:
        return ip
    host = getattr(server_args, "host", None)
    if host and host not in ("0.0.0.0", "::", "", "localhost"):
        try:
            return socket.gethostbyname(host)
        except OSError:
            pass
    target = toward or "192.0.2.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((target, 9))  # UDP connect sends nothing: only picks the route
        return s.getsockname()[0]


def _flat(x: Any) -> List[int]:
    out: List[int] = []
    for v in x or []:
        if isinstance(v, (list, tuple)):
            out.extend(int(i) for i in v)
        else:
            out.append(int(v))
    return out


def _regions(ptrs: Sequence[int], lens: Sequence[int], items: Sequence[int]) -> List[kvwire.Region]:
    if not (len(ptrs) == len(lens) == len(items)):
        raise ValueError("kvwire.sglang: data_ptrs, data_lens and item_lens differ in length")
    return [kvwire.Region(int(p), int(n), int(i)) for p, n, i in zip(ptrs, lens, items)]


def _tolerant(req: Any, call: Any, *args: Any) -> None:
    """Run a request call; if it fails because the request has failed (or
    fails it), swallow the error: sglang learns of failures from poll() and
    failure_exception(), and calls send()/send_metadata() on requests the
    other side already failed. Any other error is raised."""
    try:
        call(*args)
    except Error:
        if not req.closed and req.poll() == Poll.FAILED:
            return
        raise


class _FailedRequest:
    """Stands in for a sender/receiver whose creation failed (a duplicate
    room, a closed engine...): sglang constructs backends without expecting
    errors, so the failure is reported by poll() and failure_exception()."""

    def __init__(self, error: Error):
        self.error = error
        self.closed = False

    def poll(self) -> Poll:
        return Poll.FAILED

    def failure(self) -> Error:
        return self.error

    def metrics(self) -> kvwire.ReqMetrics:
        return kvwire.ReqMetrics(0, 0, 0)

    def _noop(self, *args: Any, **kwargs: Any) -> None:
        return None

    init = send = send_state = abort = _noop

    def close(self) -> None:
        self.closed = True


class KVWireKVManager:
    """BaseKVManager: one kvwire engine for this TP rank's KV, aux and state
    buffers (kv_args), in PREFILL or DECODE mode. Thread-safe; close() (or
    process exit) destroys the engine after its requests."""

    def __init__(self, args: Any, disaggregation_mode: Any, server_args: Any = None,
                 is_mla_backend: Optional[bool] = False):
        self.kv_args = args
        self.mode = _mode_name(disaggregation_mode)
        self.server_args = server_args
        self.is_mla_backend = bool(is_mla_backend)
        self.engine_rank = int(getattr(args, "engine_rank", 0))
        self.dp_rank = int(getattr(args, "system_dp_rank", 0) or 0)
        bs_port = getattr(server_args, "disaggregation_bootstrap_port", None)
        bs_host = getattr(server_args, "host", None)
        self.local_ip = _local_ip(server_args, None if bs_host in (None, "0.0.0.0", "::") else bs_host)
        if bs_host in (None, "", "0.0.0.0", "::", "localhost"):
            bs_host = self.local_ip
        self.bootstrap_addr = os.environ.get("KVWIRE_BOOTSTRAP_ADDR") or (
            f"{bs_host}:{bs_port}" if bs_port else None)
        device = getattr(args, "ib_device", None) or None
        if device and "," in device:
            devs = [d.strip() for d in device.split(",") if d.strip()]
            device = devs[int(getattr(args, "gpu_id", 0) or 0) % len(devs)]

        kv = _regions(args.kv_data_ptrs, args.kv_data_lens, args.kv_item_lens)
        aux = _regions(getattr(args, "aux_data_ptrs", []) or [],
                       getattr(args, "aux_data_lens", []) or [],
                       getattr(args, "aux_item_lens", []) or [])
        state = _regions(_flat(getattr(args, "state_data_ptrs", None)),
                         _flat(getattr(args, "state_data_lens", None)),
                         _flat(getattr(args, "state_item_lens", None)))
        if not kv:
            raise ValueError("kvwire.sglang: kv_args.kv_data_ptrs is empty")
        feats = kvwire.features()
        # MHA: K layers then V layers (2 regions per layer); MLA: 1 per layer.
        per_layer = 1 if self.is_mla_backend or len(kv) % 2 else 2
        layers = len(kv) // per_layer
        common = dict(device=device, engine_rank=self._my_rank(),
                      bootstrap_addr=self.bootstrap_addr if self.mode == "prefill" else None)
        if feats["groups"]:
            groups = [kvwire.Group(kvwire.GroupKind.KV, layers, per_layer, kv)]
            if aux:
                groups.append(kvwire.Group(kvwire.GroupKind.AUX, 1, len(aux), aux))
            if state:
                groups.append(kvwire.Group(kvwire.GroupKind.STATE, 1, len(state), state))
            self.has_state = bool(state)
            self.engine = kvwire.Engine(self.mode, self.local_ip, groups=groups, **common)
        else:
            if state:
                raise Error(kvwire.Status.ERR_UNSUPPORTED,
                            "state buffers need a libkvwire with buffer groups")
            if len(kv) % 2:
                raise Error(kvwire.Status.ERR_UNSUPPORTED,
                            f"{len(kv)} KV regions (odd) need a libkvwire with buffer groups")
            # Every KV region moves the same pages: an even count of MLA
            # regions maps onto the classic K/V layout unchanged.
            self.has_state = False
            self.engine = kvwire.Engine(self.mode, self.local_ip, kv=kv, num_layers=len(kv) // 2,
                                        aux=aux, **common)
        # Chunked sends (several kvw_sender_send per request) came with the
        # calls of the same API revision; older libraries get one send.
        self.chunked_sends = feats["send_part"]

    def _my_rank(self) -> int:
        return (self.dp_rank << _DP_SHIFT) + self.engine_rank

    def prefill_rank(self, prefill_dp_rank: Optional[int]) -> int:
        """The kvwire rank of the prefill TP rank this decode rank reads from."""
        return ((int(prefill_dp_rank or 0)) << _DP_SHIFT) + self.engine_rank

    def register_to_bootstrap(self) -> None:
        """No-op: a prefill kvwire engine registers when created and
        refreshes its registration every second on its own."""

    def close(self) -> None:
        self.engine.close()


class KVWireKVSender:
    """BaseKVSender for one request on one prefill TP rank. One thread at a
    time (sglang's scheduler thread)."""

    def __init__(self, mgr: KVWireKVManager, bootstrap_addr: str, bootstrap_room: int,
                 dest_tp_ranks: Optional[List[int]] = None, pp_rank: int = 0,
                 req_has_disagg_prefill_dp_rank: bool = False, **_: Any):
        self.kv_mgr = mgr
        self.bootstrap_room = int(bootstrap_room)
        self.sender: Any
        try:
            self.sender = mgr.engine.sender(self.bootstrap_room)
        except Error as e:
            self.sender = _FailedRequest(e)
        self.num_kv_indices: Optional[int] = None
        self.sent = 0
        self.pending: List[Any] = []  # chunks held back for a one-send library
        self.last = Poll.BOOTSTRAPPING
        self.t_first_send: Optional[float] = None
        self.t_done: Optional[float] = None

    def init(self, num_kv_indices: int, aux_index: Optional[int] = None) -> None:
        self.num_kv_indices = int(num_kv_indices)
        _tolerant(self.sender, self.sender.init, self.num_kv_indices, aux_index)

    def send(self, kv_indices: Any, state_indices: Optional[Any] = None,
             token_position_offset: int = 0) -> None:
        """One chunk of page indices (sglang: non-final chunks are whole
        pages; the final one is recognised by the running count)."""
        if token_position_offset:
            raise Error(kvwire.Status.ERR_UNSUPPORTED, "token_position_offset != 0")
        if self.t_first_send is None:
            self.t_first_send = time.monotonic()
        n = len(kv_indices)
        final = self.num_kv_indices is not None and self.sent + n >= self.num_kv_indices
        if state_indices is not None and len(_flat(state_indices)):
            _tolerant(self.sender, self.sender.send_state, _flat(state_indices))
        if self.kv_mgr.chunked_sends:
            _tolerant(self.sender, self.sender.send, kv_indices)
        else:
            self.pending.append(kv_indices)
            if final:
                pages: List[int] = []
                for c in self.pending:
                    pages.extend(int(i) for i in c)
                self.pending = []
                _tolerant(self.sender, self.sender.send, pages)
        self.sent += n

    def pop_decode_prefix_len(self) -> int:
        return 0

    def should_send_kv_chunk(self, num_pages: int, last_chunk: bool) -> bool:
        return num_pages > 0

    def poll(self) -> int:
        """KVPoll value; never blocks. After clear() the last state seen."""
        if self.sender.closed:
            return int(self.last)
        self.last = self.sender.poll()
        if self.last in (Poll.SUCCESS, Poll.FAILED) and self.t_done is None:
            self.t_done = time.monotonic()
        return int(self.last)

    def failure_exception(self) -> None:
        err = None if self.sender.closed else self.sender.failure()
        raise KVTransferError(self.bootstrap_room, err, "sender")

    def get_transfer_metric(self) -> Any:
        if kvwire.features()["metrics"] and not self.sender.closed:
            m = self.sender.metrics()
            return _metric(m.transfer_us / 1e6 if m.transfer_us else None, m.bytes or None)
        lat = (self.t_done - self.t_first_send) if self.t_done and self.t_first_send else None
        return _metric(lat, None)

    def abort(self) -> None:
        try:
            self.sender.abort()
        except Error as e:
            if e.status != kvwire.Status.ERR_STATE:
                raise

    def clear(self) -> None:
        if not self.sender.closed:
            self.last = self.sender.poll()
        self.sender.close()


class KVWireKVReceiver:
    """BaseKVReceiver for one request on one decode TP rank: Bootstrapping
    until init(prefill_dp_rank) connected it, WaitingForInput until
    send_metadata(), then Transferring, Success or Failed."""

    def __init__(self, mgr: KVWireKVManager, bootstrap_addr: str,
                 bootstrap_room: Optional[int] = None, **_: Any):
        self.kv_mgr = mgr
        self.bootstrap_addr = bootstrap_addr
        self.bootstrap_room = int(bootstrap_room or 0)
        self.receiver: Optional[kvwire.Receiver] = None
        self.last = Poll.BOOTSTRAPPING
        self.t_meta: Optional[float] = None
        self.t_done: Optional[float] = None

    def init(self, prefill_dp_rank: Optional[int] = None) -> None:
        try:
            self.receiver = self.kv_mgr.engine.receiver(
                self.bootstrap_addr, self.kv_mgr.prefill_rank(prefill_dp_rank),
                self.bootstrap_room)
        except Error as e:
            self.receiver = _FailedRequest(e)  # type: ignore[assignment]

    def send_metadata(self, kv_indices: Any, aux_index: Optional[int] = None,
                      state_indices: Optional[Any] = None,
                      decode_prefix_len: Optional[int] = None) -> None:
        if self.receiver is None:
            raise Error(kvwire.Status.ERR_STATE, "send_metadata before init(prefill_dp_rank)")
        if decode_prefix_len:
            raise Error(kvwire.Status.ERR_UNSUPPORTED, "decode_prefix_len != 0")
        state = _flat(state_indices) if state_indices is not None else None
        self.t_meta = time.monotonic()
        _tolerant(self.receiver, self.receiver.init, kv_indices, aux_index, state or None)

    def poll(self) -> int:
        r = self.receiver
        if r is None:
            return int(Poll.BOOTSTRAPPING)
        if r.closed:
            return int(self.last)
        self.last = r.poll()
        if self.last in (Poll.SUCCESS, Poll.FAILED) and self.t_done is None:
            self.t_done = time.monotonic()
        return int(self.last)

    def failure_exception(self) -> None:
        r = self.receiver
        err = None if r is None or r.closed else r.failure()
        raise KVTransferError(self.bootstrap_room, err, "receiver")

    def get_transfer_metric(self) -> Any:
        r = self.receiver
        if r is not None and not r.closed and kvwire.features()["metrics"]:
            m = r.metrics()
            return _metric(m.transfer_us / 1e6 if m.transfer_us else None, m.bytes or None)
        lat = (self.t_done - self.t_meta) if self.t_done and self.t_meta else None
        return _metric(lat, None)

    def abort(self) -> None:
        if self.receiver is None:
            self.last = Poll.FAILED
            return
        try:
            self.receiver.abort()
        except Error as e:
            if e.status != kvwire.Status.ERR_STATE:
                raise

    def clear(self) -> None:
        if self.receiver is not None:
            if not self.receiver.closed:
                self.last = self.receiver.poll()
            self.receiver.close()


class KVWireKVBootstrapServer:
    """BaseKVBootstrapServer: a kvwire bootstrap service on host:port (a
    wildcard host binds that; port 0 picks one, see .addr)."""

    def __init__(self, host: Any = None, port: Optional[int] = None, **_: Any):
        if port is None and isinstance(host, int):  # the older (port) signature
            host, port = None, host
        host = host or "0.0.0.0"
        self.server = kvwire.Bootstrap(f"{host}:{int(port or 0)}")
        self.addr = self.server.addr
        self.port = int(self.addr.rsplit(":", 1)[1])

    def close(self) -> None:
        self.server.close()

    def poll(self) -> int:  # some sglang versions declare it
        return int(Poll.SUCCESS if not self.server.closed else Poll.FAILED)
