# SPDX-License-Identifier: Apache-2.0
"""kvwire as an sglang transfer backend, built on sglang's own connection
classes (sglang/srt/disaggregation/common/conn.py), as sglang's mooncake
and nixl backends are. Imports sglang: load it through install() or
get_kv_class(), not on its own.

What is sglang's and what is kvwire's:

  sglang (inherited unchanged)   the HTTP bootstrap server (PUT/GET /route,
        /register_dp_rank, /query_dp_ranks, /health), prefill registration,
        decode's try_ensure_parallel_info / prefill_info_table and its rank
        mapping (TP, DP attention, CP, PP), the heartbeat that fails the
        rooms of a prefill that stopped answering, request_status,
        failure_records, the bootstrap and waiting timeouts (decode's
        poll runs _check_waiting_timeout from send_metadata). On decode a
        failed request reports Failed to sglang only once kvwire's
        receivers have ended (KVWireKVReceiver), since sglang reuses its
        pages on that Failed.
  kvwire                         the QP handshake and the data: each rank's
        manager owns one kvwire engine; what a prefill rank registers with
        sglang's bootstrap server as (rank_ip, rank_port) is its kvwire
        engine's control endpoint, which decode dials directly
        (kvw_receiver_create_at). There is no kvwire bootstrap service.

Layouts: TP equal on both sides, DP attention on either side (sglang's
mapping), MLA with prefill TP > decode TP (decode reads one prefill rank;
the others are asked for nothing and finish with an empty final part, as
mooncake's dummy ranks do), MHA/GQA with prefill TP > decode TP (head
slicing: each prefill engine describes its heads from sglang's KV args,
each decode engine, whose KV args carry no head count, learns its own from
prefill's handshake (its page and attention TP place; no model config is
read), and one kvwire receiver over the prefill ranks of sglang's target
range asks each for the heads it sends; GQA replicas owe nothing), MLA and MHA/GQA with
decode TP > prefill TP (one prefill rank serves each room to the decode
ranks of its range, kvw_sender_create_fanout: MLA's latent whole to each,
MHA/GQA each decode rank's heads gathered; each gets its own aux item, as
mooncake sends to every decode rank of transfer_infos). Prefill learns how
many decode ranks read a room from each room's first kvwire request, which
carries sglang's required_dst_info_num of the decode rank
(kvw_receiver_set_room_receivers -> kvw_sender_create_learn, wire 12), as
mooncake learns it from decode's messages; with sglang's
--disaggregation-decode-tp (and --disaggregation-decode-dp: DP attention)
on prefill the count is fixed from the flags, and a request that says
another fails the room, naming both.
Decode prefix reuse (decode_prefix_len > 0): decode asks only for the
pages after its prefix, and prefill, which hands over every page
(pop_decode_prefix_len() is 0: kvwire's request does not carry the
length), drops the first ones. Pipeline parallelism: stage to stage at
equal PP sizes; decode PP 1 gathers prefill's stages, one engine per
stage over its layers (KVWireKVManager.stage_engine), the metadata from
the last stage. Refused with a reason naming both TP sizes: MHA/GQA with
different TP sizes and hybrid state or staged GPU memory
(KVW_GPU_PATH=staging) or KV args that do not describe the heads; a PP
gather across TP sizes or with hybrid state. Refused too: context
parallelism, decode-context parallelism (sglang's own guard), prefill
memory release (--enable-memory-saver on prefill), token_position_offset
!= 0.
Hybrid models: each StateType with buffers is its own kvwire state group
and index space (Mamba's slot, SWA/DSA page lists; a None component moves
nothing for that group); prefill's and decode's counts must agree per
group or the request fails on both sides.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from typing import Any, Dict, List, Optional, Tuple

from sglang.srt.disaggregation.base.conn import KVArgs, KVPoll, KVTransferMetric
from sglang.srt.disaggregation.common.conn import (
    CommonKVBootstrapServer,
    CommonKVManager,
    CommonKVReceiver,
    CommonKVSender,
    KVTransferError,
)
from sglang.srt.disaggregation.utils import DisaggregationMode

import kvwire
from kvwire import _sglang_lib
from kvwire import Error, Poll

logger = logging.getLogger("kvwire.sglang")

__all__ = ["KVArgs", "KVWireKVBootstrapServer", "KVWireKVManager", "KVWireKVReceiver",
           "KVWireKVSender", "KVTransferError"]

_log_routed = False
_log_lock = threading.Lock()


def _route_logs() -> None:
    """libkvwire's log lines go to the logging logger "kvwire" (once per
    process; the binding's default), unless KVWIRE_SGLANG_LOG=stderr writes
    them to stderr as the C library does."""
    global _log_routed
    with _log_lock:
        if _log_routed:
            return
        if os.environ.get("KVWIRE_SGLANG_LOG", "").lower() == "stderr":
            kvwire.log_to_stderr()
        else:
            kvwire.log_to_python(logging.getLogger("kvwire"))
        _log_routed = True


def _export_metrics(engine: kvwire.Engine) -> None:
    """sglang's --enable-metrics: the engine's metrics (kvwire_*) join
    sglang's /metrics through prometheus_client (kvwire.metrics; in the
    multiprocess mode sglang runs it in, a thread mirrors them into
    PROMETHEUS_MULTIPROC_DIR, which sglang's HTTP server reads)."""
    try:
        import kvwire.metrics

        kvwire.metrics.register(engine)
    except ImportError as e:
        logger.warning("kvwire: metrics not exported (%s): install python3-prometheus-client", e)


def _unexport_metrics(engine: kvwire.Engine) -> None:
    """Before the engine closes: its last values written (multiprocess)."""
    try:
        import kvwire.metrics

        kvwire.metrics.unregister(engine)
    except ImportError:
        pass


def _rdma_ip(server_args: Any) -> str:
    """This host's address on the RDMA network: $KVWIRE_LOCAL_IP, else
    sglang's own choice (get_local_ip_auto(), which honours
    SGLANG_HOST_IP / SGLANG_LOCAL_IP_NIC)."""
    ip = os.environ.get("KVWIRE_LOCAL_IP")
    if ip:
        return ip
    from sglang.srt.utils.network import get_local_ip_auto

    return get_local_ip_auto()


def _regions(ptrs: Any, lens: Any, items: Any) -> List[kvwire.Region]:
    ptrs, lens, items = list(ptrs or []), list(lens or []), list(items or [])
    if not (len(ptrs) == len(lens) == len(items)):
        raise ValueError("kvwire: data_ptrs, data_lens and item_lens differ in length")
    return [kvwire.Region(int(p), int(n), int(i)) for p, n, i in zip(ptrs, lens, items)]


def _state_kind(st: Any) -> str:
    return str(getattr(st, "value", st))


def _flat_indices(x: Any) -> List[int]:
    """One state component's indices: a numpy array or list of page
    indices (SWA, DSA), or [array([i])] (Mamba's single index)."""
    out: List[int] = []
    if x is None:
        return out
    for v in x:
        # sglang's Mamba payload indexes its 1-D req_index_to_mamba_index_mapping
        # with one request slot: a 0-d array, which has __len__ but no length.
        if getattr(v, "ndim", 1) == 0 or not hasattr(v, "__len__") or isinstance(v, (str, bytes)):
            out.append(int(v))
        else:
            out.extend(int(i) for i in v)
    return out


def _state_lists(state_indices: Optional[List], groups: Dict[int, int]) -> Dict[int, List[int]]:
    """sglang's per-StateType state_indices (one component per entry of
    kv_args.state_types) as kvwire state lists: each component's indices
    for its own kvwire state group (groups: component -> group index), in
    its own index space. Mamba's [array([slot])] is its one slot, SWA and
    DSA page arrays their page lists; a None (or missing) component, and
    every group on a side that has none this chunk, moves nothing."""
    out: Dict[int, List[int]] = {}
    for slot, group in groups.items():
        comp = state_indices[slot] if state_indices and slot < len(state_indices) else None
        out[group] = [] if comp is None else _flat_indices(comp)
    return out


def _heads(args: KVArgs, nkv: int, attn_tp: Tuple[int, int]) -> Optional[kvwire.GroupHeads]:
    """This rank's KV heads (head slicing, docs/head-slicing.md) from
    sglang's MHA/GQA KV args: kv_head_num heads per rank; the model's
    total_kv_head_num, or kv_head_num x attn TP size when not given; with
    fewer KV heads than ranks (GQA replication) each rank holds head
    attn_tp_rank x total / attn_tp_size (attn_tp: size, rank). head bytes
    from the item length (page_size tokens x heads x head bytes: sglang's
    MHA pools are token-major, NHD). Decode's KV args carry no head count
    (sglang sets kv_head_num on prefill, and on decode only with its own
    staging): its group then learns its heads from prefill's handshake
    (GroupHeads.learned: only the page; the engine gets the attention TP
    place), as mooncake's prefill derives decode's from decode's item
    length; no model config is read. None when the args do not say (the
    engine then moves whole regions, and different TP sizes are refused)."""
    page = int(getattr(args, "page_size", 0) or 0)
    lens = list(args.kv_item_lens or [])
    if page <= 0 or not lens or nkv == 0 or any(x != lens[0] for x in lens):
        return None
    tp, rank = attn_tp
    n = int(getattr(args, "kv_head_num", 0) or 0)
    if n <= 0:  # decode: learned from prefill
        return kvwire.GroupHeads.learned(page, "NHD") if lens[0] % page == 0 else None
    total = int(getattr(args, "total_kv_head_num", 0) or 0) or n * tp
    if lens[0] % (page * n):
        return None  # not one page of n equal heads per item: move regions whole
    if total >= tp:
        if n * tp != total:
            return None
        first = rank * n
    else:  # replicated: each head on tp // total ranks
        if n != 1 or tp % total:
            return None
        first = rank * total // tp
    return kvwire.GroupHeads(total, first, n, lens[0] // (page * n), page, "NHD")


def _attn_tp() -> Tuple[int, int]:
    """(attention TP size, this rank's attention TP rank), as sglang's
    runtime context has them (read once, at manager creation)."""
    from sglang.srt.runtime_context import get_parallel

    par = get_parallel()
    return int(par.attn_tp_size or 1), int(par.attn_tp_rank or 0)


def _layer_slice(kv: List[kvwire.Region], per_layer: int, begin: int,
                 end: int) -> List[kvwire.Region]:
    """KV regions of layers [begin, end): MHA's K layers then V layers
    (sglang's order), MLA's one per layer."""
    n = len(kv) // per_layer
    if not 0 <= begin < end <= n:
        raise ValueError(f"kvwire: layers [{begin}, {end}) outside the {n} KV layers")
    return [kv[p * n + i] for p in range(per_layer) for i in range(begin, end)]


def _pp_layers(num_layers: int, pp_rank: int, pp_size: int) -> Tuple[int, int]:
    """The layers [start, end) of PP stage pp_rank as sglang partitions a
    model's layers: $SGLANG_PP_LAYER_PARTITION (comma-separated counts per
    stage) where set, else num_layers // pp_size per stage, the last stage
    taking the remainder. Each prefill stage's own layer count is checked
    by kvwire's handshake against this range."""
    spec = os.environ.get("SGLANG_PP_LAYER_PARTITION")
    if spec:
        counts = [int(x) for x in spec.split(",")]
        if len(counts) != pp_size or sum(counts) != num_layers:
            raise ValueError(f"kvwire: SGLANG_PP_LAYER_PARTITION={spec} does not split "
                             f"{num_layers} layers into {pp_size} stages")
        start = sum(counts[:pp_rank])
        return start, start + counts[pp_rank]
    per = num_layers // pp_size
    start = pp_rank * per
    return start, num_layers if pp_rank == pp_size - 1 else start + per


# Why a hybrid model's state cannot cross different TP sizes: what kvwire's
# library lacks (docs/head-slicing.md, hybrid state).
_STATE_NOT_SLICED = (
    "a hybrid model's state (Mamba, SWA, DSA) is not sliced across TP sizes: kvwire writes a "
    "state item whole from one prefill rank, and has no slicing of state items by sglang's "
    "state_dim_per_tensor (each prefill rank's share at its offset in decode's item); use "
    "equal TP sizes")


def _endpoint(info: dict) -> str:
    ip = str(info["rank_ip"])
    if ":" in ip and not ip.startswith("["):
        ip = f"[{ip}]"
    return f"tcp://{ip}:{int(info['rank_port'])}"


class _Closer:
    """Destroys kvwire receivers off the scheduler thread: a receiver that
    has not ended waits for its abort barrier (at most about
    peer_timeout_ms) in kvw_receiver_destroy, which clear() must not do on
    the scheduler thread. One daemon thread per manager, started lazily."""

    def __init__(self) -> None:
        self.q: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
        self.thread: Optional[threading.Thread] = None
        self.lock = threading.Lock()

    def close(self, req: Any, deliver: bool = False) -> None:
        """deliver: first let a Bootstrapping receiver's request reach
        prefill (bounded), so that prefill hears of it (a refused layout)."""
        if req.closed:
            return
        try:
            ended = req.poll() in (Poll.SUCCESS, Poll.FAILED)
        except Error:
            ended = True
        if ended:
            req.close()  # nothing to wait for
            return
        req._kvwire_deliver = deliver
        with self.lock:
            if self.thread is None:
                self.thread = threading.Thread(target=self._run, name="kvwire-closer",
                                               daemon=True)
                self.thread.start()
        self.q.put(req)

    def _run(self) -> None:
        while True:
            req = self.q.get()
            if req is None:
                return
            try:
                end = time.monotonic() + 30.0
                while (getattr(req, "_kvwire_deliver", False) and not req.closed
                       and req.poll() == Poll.BOOTSTRAPPING and time.monotonic() < end):
                    time.sleep(0.02)
                req.close()
            except Exception:  # pragma: no cover - close() of a closed engine
                logger.exception("kvwire: closing a receiver failed")

    def drain(self) -> None:
        with self.lock:
            t = self.thread
            self.thread = None
        if t is not None:
            self.q.put(None)
            t.join()


class KVWireKVManager(CommonKVManager):
    """CommonKVManager with one kvwire engine for this rank's KV, aux and
    state buffers. Refuses (raises) the layouts it cannot carry, before
    registering anything."""

    # kvwire has no DCP-aware remap: CommonKVManager._check_dcp_compat then
    # refuses dcp_size > 1 at creation (fail closed).
    supports_dcp_transfer = False

    def __init__(self, args: KVArgs, disaggregation_mode: DisaggregationMode, server_args: Any,
                 is_mla_backend: Optional[bool] = False):
        missing = _sglang_lib.has()
        if missing:
            raise RuntimeError(f"kvwire: {kvwire.library_path()} lacks {missing}; "
                               "the sglang backend needs a newer libkvwire")
        _route_logs()
        self.engine: Optional[kvwire.Engine] = None
        # decode gathering prefill PP stages: (pp_size, pp_rank) -> engine
        self.stage_engines: Dict[Tuple[int, int], kvwire.Engine] = {}
        self._stage_lock = threading.Lock()
        self._closer = _Closer()
        self._refuse_layout(args, server_args, disaggregation_mode)
        # The engine exists before CommonKVManager.__init__ registers this
        # rank: its endpoint is what gets registered.
        self.kvwire_ip = _rdma_ip(server_args)
        self._kvwire_attn_tp = _attn_tp()  # (size, rank): our heads, or what decode learns
        self._kvwire_args = (args, disaggregation_mode, bool(is_mla_backend))
        self.engine = self._make_engine()
        self._metrics_on = bool(getattr(server_args, "enable_metrics", False))
        if self._metrics_on:
            _export_metrics(self.engine)
        try:
            super().__init__(args, disaggregation_mode, server_args, is_mla_backend)
        except BaseException:
            self.engine.close()
            raise
        # CommonKVManager binds a ZMQ PULL socket for backends that talk to
        # prefill over it; kvwire's control plane is its own: close it.
        try:
            self.server_socket.close(linger=0)
        except Exception:  # pragma: no cover
            pass
        # Prefill: how many decode ranks read each room of this rank (decode
        # TP > prefill TP: one fan-out sender per room); None: each room's
        # first request says (no --disaggregation-decode-tp). sglang's
        # transfer metrics count MLA's replicated copy once per decode rank
        # (mooncake resolves the factor from its own handshake, which kvwire
        # does not run; get_transfer_metric takes kvwire's byte count, the
        # sum over the decode ranks, where it has one); MHA/GQA head slices
        # are disjoint (factor 1).
        self.decode_receivers: Optional[int] = 1
        if self.disaggregation_mode == DisaggregationMode.PREFILL:
            self.decode_receivers = self._decode_receivers(server_args)
        self._kv_replica_factor = (self.decode_receivers or 1) if is_mla_backend else 1
        if self.disaggregation_mode == DisaggregationMode.DECODE:
            self._start_heartbeat_checker_thread()
        logger.info("kvwire %s rank: attn tp %d/%d dp %d/%d pp %d/%d, engine %s on %s",
                    self.disaggregation_mode.value, self.attn_tp_rank, self.attn_tp_size,
                    self.attn_dp_rank, self.attn_dp_size, self.pp_rank, self.pp_size,
                    self.engine.endpoint, self.engine.device_name)

    # ------------------------------------------------------------ layout

    def _decode_receivers(self, server_args: Any) -> Optional[int]:
        """Prefill: the decode ranks that read each room of this rank: the
        decode attention TP size over this rank's, when larger. sglang sets
        --disaggregation-decode-tp (and --disaggregation-decode-dp, taken as
        DP attention: attention TP = TP / DP) on the prefill server only;
        unset: None, each room's sender learns the count from decode's first
        request for it (kvw_sender_create_learn; 1 from a decode whose
        request does not say). Hybrid state across TP sizes is then refused
        per room: decode refuses it (KVWireKVReceiver._refusal, naming both
        TP sizes) and asks this rank for nothing, which fails the room here
        (KVWireKVSender.init)."""
        dtp = int(getattr(server_args, "disaggregation_decode_tp", None) or 0)
        ddp = int(getattr(server_args, "disaggregation_decode_dp", None) or 1)
        if dtp <= 0:
            if not kvwire.features().get("sender_learn"):
                return 1  # an older library: one decode rank per room
            return None
        attn = dtp // ddp if ddp > 1 and dtp % ddp == 0 else dtp
        ptp = int(self.attn_tp_size or 1)
        if attn <= ptp:
            return 1
        if attn % ptp:
            raise RuntimeError(f"kvwire: decode attn TP size {attn} (disaggregation_decode_tp "
                               f"{dtp}, _dp {ddp}) is not a multiple of prefill attn TP size "
                               f"{ptp}")
        if self.state_groups and not self.is_mla_backend:
            raise RuntimeError(f"kvwire: prefill attn TP size {ptp}, decode attn TP size "
                               f"{attn}: {_STATE_NOT_SLICED}")
        return attn // ptp

    def _refuse_layout(self, args: KVArgs, server_args: Any, mode: DisaggregationMode) -> None:
        dcp = getattr(args, "dcp_size", 1) or 1
        if dcp > 1:
            raise RuntimeError(
                f"KVWireKVManager does not implement DCP-aware KV transfer, but the engine is "
                f"configured with dcp_size={dcp}: the transfer would silently corrupt the KV "
                "cache. Use --dcp-size 1 on the disaggregated engine.")
        # Pipeline parallelism: served stage to stage (prefill PP size = decode
        # PP size: each decode stage holds the layers of the prefill stage of
        # its rank, one kvwire engine per stage on both sides). Decode with
        # another PP size than prefill's is refused at its first contact with
        # that prefill (KVWireKVReceiver._pp_refusal): only then does it learn
        # prefill's PP size, which prefill never learns.
        if (getattr(server_args, "enable_memory_saver", False)
                and getattr(mode, "value", mode) == "prefill"):
            # Decode's release (release_memory_occupation) reaches the backend
            # (deregister_buffer_to_engine: its engine is closed, then made
            # anew); prefill's does not, and its pool stays registered with
            # the NIC while the memory saver unmaps it.
            raise RuntimeError(
                "kvwire: prefill memory release (--enable-memory-saver on a prefill server) "
                "is not served: sglang's prefill never tells the transfer backend when it "
                "releases the KV pool, which kvwire keeps registered with the NIC. Start "
                "prefill without --enable-memory-saver (decode may use it)")
        from sglang.srt.runtime_context import get_parallel

        cp = get_parallel().attn_cp_size
        if cp > 1:
            raise RuntimeError(f"kvwire: attention context parallelism (attn_cp_size={cp}) "
                               "is not supported")

    def _make_engine(self, layers: Optional[Tuple[int, int]] = None) -> kvwire.Engine:
        """This rank's kvwire engine over its KV, aux and state buffers; with
        layers (decode gathering prefill PP stages, stage_engine()): over KV
        layers [begin, end) and the aux buffers only, one prefill stage's
        layout."""
        args, mode, is_mla = self._kvwire_args
        role = "prefill" if mode == DisaggregationMode.PREFILL else "decode"
        kv = _regions(args.kv_data_ptrs, args.kv_data_lens, args.kv_item_lens)
        if not kv:
            raise ValueError("kvwire: kv_args.kv_data_ptrs is empty")
        aux = _regions(getattr(args, "aux_data_ptrs", None), getattr(args, "aux_data_lens", None),
                       getattr(args, "aux_item_lens", None))
        # MHA: K layers then V layers (2 regions per layer); MLA: 1 per layer.
        per_layer = 1 if is_mla or len(kv) % 2 else 2
        if layers is not None:
            kv = _layer_slice(kv, per_layer, *layers)
        groups = [kvwire.Group(kvwire.GroupKind.KV, len(kv) // per_layer, per_layer, kv)]
        if aux:
            groups.append(kvwire.Group(kvwire.GroupKind.AUX, 1, len(aux), aux))
        if layers is not None:
            return self._new_engine(role, groups, [self.heads] if self.heads is not None else None,
                                    kvwire.Config())
        # Hybrid models: each StateType with buffers is its own kvwire state
        # group, in its own index space (Mamba: one slot per request; SWA,
        # DSA: page lists of their own). state_groups maps the component's
        # position in sglang's state_indices to the kvwire group index.
        self.state_groups: Dict[int, int] = {}
        self.state_kinds: Dict[int, str] = {}
        types = list(getattr(args, "state_types", None) or [])
        for i, ptrs in enumerate(getattr(args, "state_data_ptrs", None) or []):
            if not ptrs:
                continue
            regs = _regions(ptrs, args.state_data_lens[i], args.state_item_lens[i])
            self.state_groups[i] = len(groups)
            self.state_kinds[i] = _state_kind(types[i]) if i < len(types) else str(i)
            groups.append(kvwire.Group(kvwire.GroupKind.STATE, 1, len(regs), regs))
        self.heads = None if is_mla else _heads(args, len(kv), self._kvwire_attn_tp)
        cfg = kvwire.Config()
        # Verified transfers (KVW_VERIFY=1): with KV pages in GPU memory the
        # NIC reaches directly, the digests are ours (digest.py); kvwire
        # refuses them (KVW_ERR_STATE) where it reads the memory itself.
        self.verify = bool(cfg.verify)
        self.caller_digests: Optional[bool] = None  # unknown until kvwire says
        self._kv_digest: Any = None
        if role == "prefill" and "KVW_BOOTSTRAP_TIMEOUT_MS" not in os.environ:
            # A sender waits for decode's request as long as sglang lets it
            # (SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT, 300 s), not kvwire's 30 s.
            from sglang.srt.environ import envs

            sg_ms = int(float(envs.SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT.get()) * 1000)
            cfg.bootstrap_timeout_ms = min(max(cfg.bootstrap_timeout_ms, sg_ms + 5000), 3600000)
        # bounds a receiver's abort barrier (kvw_receiver_abort)
        self.peer_timeout_ms = int(cfg.peer_timeout_ms)
        return self._new_engine(role, groups, [self.heads] if self.heads is not None else None, cfg)

    def _new_engine(self, role: str, groups: List[kvwire.Group],
                    heads: Optional[List[kvwire.GroupHeads]], cfg: kvwire.Config) -> kvwire.Engine:
        args = self._kvwire_args[0]
        device = getattr(args, "ib_device", None) or None
        if device and "," in device:
            devs = [d.strip() for d in device.split(",") if d.strip()]
            device = devs[int(getattr(args, "gpu_id", 0) or 0) % len(devs)]
        tp_rank = tp_size = 0
        if heads is not None:
            heads = heads + [None] * (len(groups) - len(heads))
            if any(h is not None and not h.total_heads for h in heads):
                # decode learns its heads from prefill: its attention TP place
                tp_size, tp_rank = self._kvwire_attn_tp
        return kvwire.Engine(role, self.kvwire_ip, groups=groups, device=device,
                             engine_rank=int(getattr(args, "engine_rank", 0) or 0), config=cfg,
                             group_heads=heads, attn_tp_rank=tp_rank, attn_tp_size=tp_size)

    def stage_engine(self, pp_size: int, pp_rank: int) -> kvwire.Engine:
        """Decode (PP 1) gathering prefill PP stages: the engine over the KV
        layers of prefill stage pp_rank of pp_size (and the aux buffers),
        made on first use. The stage's layers are sglang's partition
        (_pp_layers); a wrong guess differs from the stage's own layer count,
        which kvwire's handshake refuses, failing the room, never a copy into
        another stage's layers (every stage of a room is asked, and each
        stage's range starts where the previous stages' counts end)."""
        key = (pp_size, pp_rank)
        with self._stage_lock:
            eng = self.stage_engines.get(key)
            if eng is None:
                per_layer = 1 if self.is_mla_backend or len(self.kv_args.kv_data_ptrs) % 2 else 2
                total = len(self.kv_args.kv_data_ptrs) // per_layer
                eng = self._make_engine(_pp_layers(total, pp_rank, pp_size))
                self.stage_engines[key] = eng
            return eng

    def kv_digest(self, pages: List[int], first: int = 0) -> int:
        """The caller's digest of these KV pages (digest.py), on the KV
        regions' GPU with torch."""
        if self._kv_digest is None:
            import torch

            from kvwire.sglang.digest import KVDigest

            args = self._kvwire_args[0]
            self._kv_digest = KVDigest(args.kv_data_ptrs, args.kv_data_lens, args.kv_item_lens,
                                       torch.cuda.current_device())
        return self._kv_digest.digest(pages, first)

    # ------------------------------------------------------ registration

    def register_to_bootstrap(self) -> None:
        """sglang's registration (HTTP PUT /route), with this rank's kvwire
        control endpoint as (rank_ip, rank_port)."""
        host, port = self.engine.endpoint[len("tcp://"):].rsplit(":", 1)
        saved = (self.local_ip, self.rank_port)
        self.local_ip, self.rank_port = host.strip("[]"), int(port)
        try:
            super().register_to_bootstrap()
        finally:
            self.local_ip, self.rank_port = saved

    # ------------------------------------------------- memory release (RL)

    def deregister_buffer_to_engine(self) -> None:
        """Decode releasing its KV memory (sglang's release_memory_occupation,
        queues already cleared): the kvwire engine is destroyed, which
        deregisters the memory and fails whatever is still in flight."""
        if self.disaggregation_mode != DisaggregationMode.DECODE:
            raise RuntimeError("kvwire: releasing a prefill engine's memory is not supported "
                               "(its endpoint is registered with the bootstrap server)")
        self._closer.drain()
        self._close_engines()

    def _close_engines(self) -> None:
        with self._stage_lock:
            stages, self.stage_engines = list(self.stage_engines.values()), {}
        for eng in stages:
            eng.close()
        self._close_engine()

    def register_buffer_to_engine(self) -> None:
        """Decode resuming (resume_memory_occupation): a new kvwire engine
        over the same kv_args."""
        if self.disaggregation_mode != DisaggregationMode.DECODE:
            raise RuntimeError("kvwire: releasing a prefill engine's memory is not supported")
        if self.engine is None:
            self.engine = self._make_engine()
            if self._metrics_on:
                _export_metrics(self.engine)

    def close(self) -> None:
        self._closer.drain()
        self._close_engines()

    def _close_engine(self) -> None:
        if self.engine is None:
            return
        if getattr(self, "_metrics_on", False):
            _unexport_metrics(self.engine)
        self.engine.close()
        self.engine = None

    def where(self) -> str:
        return (f"{self.disaggregation_mode.value} attn tp rank {self.attn_tp_rank}/"
                f"{self.attn_tp_size}, dp rank {self.attn_dp_rank}/{self.attn_dp_size}")


def KVPoll_name(v: int) -> str:  # noqa: N802
    return {0: "Failed", 1: "Bootstrapping", 2: "WaitingForInput", 3: "Transferring",
            4: "Success"}.get(int(v), str(v))


# The library names room UINT64_MAX when a failed write matched no request
# it still had in flight on the lane ("RDMA write (room 18446744073709551615)
# completed with ..."): no room of sglang's.
_NO_ROOM = f"room {2**64 - 1}"


def _reason(err: Optional[Error]) -> str:
    if err is None:
        return "unknown"
    return str(err).replace(_NO_ROOM, "no room in flight")


class KVWireKVSender(CommonKVSender):
    """One request on one prefill rank: a kvwire sender for the room."""

    def __init__(self, mgr: KVWireKVManager, bootstrap_addr: str, bootstrap_room: int,
                 dest_tp_ranks: Optional[List[int]] = None, pp_rank: int = 0,
                 req_has_disagg_prefill_dp_rank: bool = False):
        super().__init__(mgr, bootstrap_addr, bootstrap_room, dest_tp_ranks or [], pp_rank,
                         req_has_disagg_prefill_dp_rank)
        self.kv_mgr: KVWireKVManager = mgr
        self.init_time = time.time()
        self.dummy = False
        self.sender: Optional[kvwire.Sender] = None
        self._t_first: Optional[float] = None
        self._digest, self._pages_sent = 0, 0  # verified: the caller's digest so far
        # Decode prefix reuse: the request's first pages, which decode already
        # holds (decode_prefix_len) and did not ask for, are not sent.
        self._skip_pages = 0
        n = getattr(mgr, "decode_receivers", 1)
        try:
            self.sender = mgr.engine.sender(int(bootstrap_room), receivers=n)
        except Error as e:
            count = "as many decode receivers as decode's requests say" if n is None else \
                f"{n} decode receivers"
            self._fail(f"cannot create the kvwire sender ({mgr.where()}, {count}): {e}")

    def _fail(self, reason: str) -> None:
        self.kv_mgr.record_failure(self.bootstrap_room, reason)
        self.kv_mgr.update_status(self.bootstrap_room, KVPoll.Failed)
        self.conclude_state = KVPoll.Failed
        if self.sender is not None and not self.sender.closed:
            try:
                self.sender.abort()
            except Error:
                pass

    def init(self, num_kv_indices: int, aux_index: Optional[int] = None) -> None:
        super().init(num_kv_indices, aux_index)
        if self.sender is None or self.conclude_state == KVPoll.Failed:
            return
        asked = _sglang_lib.requested(self.sender)
        if asked is not None and asked[0] == 0 and not asked[1] and num_kv_indices > 0:
            if not self.kv_mgr.is_mla_backend:
                self._fail(
                    f"decode asked nothing of this MHA/GQA prefill rank (attn tp "
                    f"{self.kv_mgr.attn_tp_size}): decode refused the layout (decode TP > "
                    "prefill TP, or a layout head slicing does not serve); decode's failure "
                    "names both TP sizes")
                return
            self.dummy = True  # MLA: another prefill rank sends this decode rank's copy
            num_kv_indices, aux_index = 0, None
        if (asked is not None and not asked[1] and not self.dummy and aux_index is not None
                and int(self.kv_mgr.pp_size or 1) > 1):
            # A stage before the last one, read by a decode rank that gathers
            # every stage: that decode rank takes the metadata from the last.
            aux_index = None
        if not self.dummy and asked is not None and asked[0] < num_kv_indices:
            # Decode prefix reuse (decode_prefix_len > 0, a page multiple): decode
            # asked only for the pages after the prefix it holds. sglang's
            # pop_decode_prefix_len() (mooncake learns the length from decode's
            # message) said 0 here, so sglang hands over every page of the
            # request from the first; send() drops the prefix's pages.
            self._skip_pages = num_kv_indices - asked[0]
            num_kv_indices = asked[0]
        try:
            self.sender.init(num_kv_indices, aux_index)
        except Error as e:
            self._fail(f"kvwire sender init: {e}")

    def send(self, kv_indices: Any, state_indices: Optional[List] = None,
             token_position_offset: int = 0) -> None:
        if self.conclude_state == KVPoll.Failed or self.sender is None:
            return
        if token_position_offset:
            self._fail("kvwire: token_position_offset != 0 is not supported")
            return
        kv_indices, _slice, is_last, skip = self._prepare_send_indices(kv_indices, state_indices)
        if skip:
            return
        if self._skip_pages:
            dropped = min(self._skip_pages, len(kv_indices))
            kv_indices = kv_indices[dropped:]
            self._skip_pages -= dropped
            if not is_last and len(kv_indices) == 0:
                return  # a chunk within decode's prefix: nothing to send
        self._record_transfer_indices(kv_indices, state_indices)
        if self._t_first is None:
            self._t_first = time.monotonic()
        try:
            groups = self.kv_mgr.state_groups
            if self.dummy:
                if is_last:
                    if groups:  # asked for no state either
                        self.sender.send_state(lists=_state_lists(None, groups))
                    self.sender.send([])
                    self._give_digest()  # of nothing: 0, as decode's dummy
                return
            if is_last and groups:
                self.sender.send_state(lists=_state_lists(state_indices, groups))
            self._add_digest(kv_indices)
            self.sender.send(kv_indices)
            if is_last:
                self._give_digest()
        except Error as e:
            if self.sender.poll() != Poll.FAILED:
                self._fail(f"kvwire send: {e}")

    def _add_digest(self, kv_indices: Any) -> None:
        """Verified, with the caller's digests: add this part's pages (the
        forward pass that wrote them is ordered before on the current
        stream; the sum syncs the host once per part)."""
        mgr = self.kv_mgr
        if not mgr.verify or mgr.caller_digests is False:
            return
        pages = _flat_indices(kv_indices)
        self._digest = (self._digest + mgr.kv_digest(pages, self._pages_sent)) & ((1 << 64) - 1)
        self._pages_sent += len(pages)

    def _give_digest(self) -> None:
        mgr = self.kv_mgr
        if not mgr.verify or mgr.caller_digests is False:
            return
        try:
            self.sender.set_digest(self._digest)
            mgr.caller_digests = True
        except Error as e:
            if e.status != kvwire.Status.ERR_STATE or mgr.caller_digests:
                raise
            mgr.caller_digests = False  # kvwire reads this memory itself: stop summing
            logger.info("kvwire verifies this engine's memory itself: no caller digests")

    def poll(self) -> int:
        if self.conclude_state is not None:
            return self.conclude_state
        if self.kv_mgr.request_status.get(self.bootstrap_room) == KVPoll.Failed:
            self._fail(self.kv_mgr.failure_records.get(self.bootstrap_room, "failed"))
            return KVPoll.Failed
        if self.sender.closed:  # cleared before it ended
            return KVPoll.Failed
        s = self.sender.poll()
        if s == Poll.FAILED:
            self.kv_mgr.record_failure(self.bootstrap_room, _reason(self.sender.failure()))
            self.kv_mgr.update_status(self.bootstrap_room, KVPoll.Failed)
            self.conclude_state = KVPoll.Failed
            return KVPoll.Failed
        if s == Poll.BOOTSTRAPPING and self._check_bootstrap_timeout() == KVPoll.Failed:
            self._fail(self.kv_mgr.failure_records.get(self.bootstrap_room, "bootstrap timeout"))
            return KVPoll.Failed
        if s == Poll.SUCCESS:
            self.kv_mgr.update_status(self.bootstrap_room, KVPoll.Success)
            self.conclude_state = KVPoll.Success
        return int(s)

    def failure_exception(self) -> None:
        with self.kv_mgr.failure_lock:
            reason = self.kv_mgr.failure_records.pop(self.bootstrap_room, None)
        if reason is None and self.sender is not None and not self.sender.closed:
            if self.sender.poll() == Poll.FAILED:
                reason = _reason(self.sender.failure())
        if reason is None:
            reason = f"failed on another rank (this one: {KVPoll_name(self.poll())})"
        raise KVTransferError(self.bootstrap_room, f"kvwire {self.kv_mgr.where()}: {reason}")

    def get_transfer_metric(self) -> KVTransferMetric:
        m = super().get_transfer_metric()
        if self.dummy:  # MLA, asked for nothing: another prefill rank sent decode's copy
            m.transfer_total_bytes = 0
            return m
        if self.sender is not None and not self.sender.closed:
            try:
                km = self.sender.metrics()
                if km.transfer_us:
                    m.transfer_latency_s = km.transfer_us / 1e6
                if km.bytes:
                    m.transfer_total_bytes = km.bytes
            except Error:
                pass
        return m

    def abort(self) -> None:
        super().abort()
        if self.sender is not None and not self.sender.closed:
            try:
                self.sender.abort()
            except Error:
                pass  # already ended

    def clear(self) -> None:
        super().clear()
        if self.sender is not None:
            self.sender.close()  # never waits


class KVWireKVReceiver(CommonKVReceiver):
    """One request on one decode rank: sglang resolves the prefill ranks
    (init), kvwire receives from each of them.

    Failed means "free the pages": sglang's decode queue releases the
    request's pages on the poll that reports it (release_kv_cache) and hands
    them to the next request. So once send_metadata() has given the pages to
    kvwire, no path reports Failed before every kvwire receiver of the
    request has ended (Failed: its abort barrier passed, nothing of the
    request lands any more; or Success): an abort, sglang's waiting timeout,
    its heartbeat (prefill dead), a kvwire failure on one prefill rank. Until
    then the request is failing: its kvwire receivers are aborted (which
    never blocks) and poll() keeps answering Transferring. Before
    send_metadata kvwire holds none of sglang's pages: Failed at once."""

    def __init__(self, mgr: KVWireKVManager, bootstrap_addr: str,
                 bootstrap_room: Optional[int] = None):
        self.recvs: List[Tuple[kvwire.Receiver, bool]] = []
        super().__init__(mgr, bootstrap_addr, bootstrap_room)
        self.kv_mgr: KVWireKVManager = mgr
        self.abort_notified = True  # kvwire tells prefill itself (kvw_receiver_abort)
        self._deliver = False
        self._t_meta: Optional[float] = None
        self._pages: List[int] = []  # verified: the pages to digest once landed
        self._pages_given = False  # send_metadata handed sglang's pages to kvwire
        self._failing = False  # failed, its kvwire receivers not all ended yet
        self._aborted = False  # its kvwire receivers aborted

    def _fail(self, reason: str, abort: bool = True) -> int:
        """Record the failure (sglang's failure record and room status) and
        abort the kvwire receivers; Failed once they have ended (see the
        class), else Transferring. abort=False (a refused layout, before
        send_metadata): the receivers' empty requests still go out."""
        self.kv_mgr.record_failure(self.bootstrap_room, reason)
        self.kv_mgr.update_status(self.bootstrap_room, KVPoll.Failed)
        if not abort:
            self._deliver = True
        return self._settle(abort)

    def _settle(self, abort: bool = True) -> int:
        self._failing = True
        if abort:
            self._abort_recvs()
        if self._pages_given and not self._recvs_ended():
            return KVPoll.Transferring  # writes may still land: keep the pages
        self.conclude_state = KVPoll.Failed
        return KVPoll.Failed

    def _recvs_ended(self) -> bool:
        for r, _ in self.recvs:
            if r.closed:
                continue
            try:
                if r.poll() not in (Poll.SUCCESS, Poll.FAILED):
                    return False
            except Error:
                pass  # its engine is gone: nothing lands
        return True

    def _abort_recvs(self) -> None:
        """Once per request (a failing request's polls come back here)."""
        if self._aborted:
            return
        self._aborted = True
        for r, _ in self.recvs:
            if not r.closed:
                try:
                    r.abort()  # never blocks
                except Error:
                    pass  # already ended

    def init(self, prefill_dp_rank: int) -> None:
        if self.conclude_state == KVPoll.Failed:
            return  # aborted before init
        super().init(prefill_dp_rank)
        if self.conclude_state == KVPoll.Failed:
            return
        info = self.prefill_info
        mgr = self.kv_mgr
        mla = bool(mgr.is_mla_backend)
        ppp = int(info.pp_size or 1)
        if ppp != int(mgr.pp_size or 1):
            pp_refusal = self._pp_refusal(ppp, info.attn_tp_size)
            if pp_refusal is not None:
                # No kvwire receiver: its handshake would be refused (the layer
                # counts differ); kvwire holds none of sglang's pages yet.
                self._fail(f"kvwire refuses room {self.bootstrap_room} ({mgr.where()}): "
                           f"{pp_refusal}")
            else:
                self._init_pp_gather(ppp)
            return
        refuse = self._refusal(info.attn_tp_size)
        if refuse is None and not mla and info.attn_tp_size > mgr.attn_tp_size:
            self._init_sliced(info.attn_tp_size)
            return
        for bi in self.bootstrap_infos or []:
            dummy = bool(bi.get("is_dummy")) or refuse is not None
            try:
                r = _sglang_lib.EndpointReceiver(mgr.engine, _endpoint(bi),
                                                 int(self.target_tp_rank or 0),
                                                 int(self.bootstrap_room))
            except Error as e:
                self._fail(f"kvwire receiver for prefill at {_endpoint(bi)}: {e}")
                return
            self.recvs.append((r, dummy))
            if not self._say_room_receivers(r):
                return
            if dummy:
                # Asked for nothing: an MLA prefill rank whose copy another
                # one sends finishes empty; a refused layout fails there.
                try:
                    r.init([], None)
                except Error as e:
                    self._fail(f"kvwire receiver init: {e}")
                    return
        if refuse is not None:
            # Not aborted: the empty requests go out, and prefill, asked for
            # nothing by an MHA/GQA decode rank, fails its side at once.
            self._fail(f"kvwire refuses room {self.bootstrap_room} ({mgr.where()}): {refuse}",
                       abort=False)

    def _say_room_receivers(self, r: kvwire.Receiver) -> bool:
        """Tell kvwire how many decode ranks ask r's prefill rank for this
        room (sglang's required_dst_info_num: decode attn TP over prefill
        attn TP when larger, else 1), which its request carries, so that a
        prefill started without --disaggregation-decode-tp serves them all
        (and one started with it checks it). False: failed. A library
        without the call says nothing (prefill then serves one)."""
        if not kvwire.features().get("sender_learn"):
            return True
        n = int(getattr(self, "required_dst_info_num", None)
                or getattr(self.prefill_info, "required_dst_info_num", None) or 1)
        try:
            r.set_room_receivers(n)
        except (Error, ValueError) as e:
            self._fail(f"kvwire receiver for room {self.bootstrap_room}: {n} decode ranks per "
                       f"prefill rank: {e}")
            return False
        return True

    def _pp_refusal(self, ppp: int, ptp: int) -> Optional[str]:
        """Prefill PP size ppp != decode's: why it cannot be served (None:
        it can). Decode PP 1 gathers every prefill stage's layers (sglang's
        target_pp_ranks), each stage into its own engine over that stage's
        layers (KVWireKVManager.stage_engine) with equal attention TP sizes,
        no hybrid state (a stage's state buffers are its layers' own) and no
        caller digests (they sum every KV layer)."""
        mgr = self.kv_mgr
        dpp = int(mgr.pp_size or 1)
        sizes = f"prefill PP size {ppp}, decode PP size {dpp}"
        if dpp != 1:
            return f"{sizes}: decode gathers prefill stages only with decode PP size 1 (sglang's)"
        if ptp != mgr.attn_tp_size:
            return (f"{sizes} with prefill attn TP size {ptp} != decode attn TP size "
                    f"{mgr.attn_tp_size}: gathering PP stages is served at equal TP sizes only")
        if mgr.state_groups:
            return (f"{sizes}: a hybrid model's state (Mamba, SWA, DSA) is not split by "
                    "PP stage; use the same --pp-size on both sides")
        if mgr.verify and mgr.caller_digests is not False:
            return f"{sizes}: verified transfers (KVW_VERIFY=1) digest every layer at once"
        return None

    def _init_pp_gather(self, ppp: int) -> None:
        """Decode PP 1, prefill PP ppp: one kvwire receiver per prefill stage
        (sglang's bootstrap_infos: per target TP rank, its stages from the
        last, _setup_bootstrap_infos), each on the engine over that stage's
        layers. Only the last stage is asked for the aux item (the metadata:
        its output token), as mooncake sends aux from the last PP rank."""
        mgr = self.kv_mgr
        infos = list(self.bootstrap_infos or [])
        if len(infos) != ppp:
            self._fail(f"kvwire: {len(infos)} prefill ranks resolved for {ppp} PP stages "
                       f"({mgr.where()})")
            return
        stages = list(reversed(list(self.target_pp_ranks or range(ppp))))
        for stage, bi in zip(stages, infos):
            try:
                eng = mgr.stage_engine(ppp, int(stage))
                r = _sglang_lib.EndpointReceiver(eng, _endpoint(bi), int(self.target_tp_rank or 0),
                                                 int(self.bootstrap_room))
            except (Error, ValueError) as e:
                self._fail(f"kvwire receiver for prefill PP stage {stage} of {ppp} at "
                           f"{_endpoint(bi)}: {e}")
                return
            r._kvwire_aux = int(stage) == ppp - 1  # the last stage sends the metadata
            self.recvs.append((r, False))

    def _refusal(self, ptp: int) -> Optional[str]:
        """Why this layout cannot be served (None: it can), naming both
        attention TP sizes."""
        mgr = self.kv_mgr
        dtp = mgr.attn_tp_size
        sizes = f"prefill attn TP size {ptp}, decode attn TP size {dtp}"
        if ptp == dtp:
            return None
        if mgr.is_mla_backend:
            # prefill TP > decode TP: one rank sends, the others finish empty;
            # decode TP > prefill TP: the prefill rank's fan-out sender sends
            # the latent whole to each decode rank of its range
            return None
        if mgr.heads is None:
            return (f"prefill attn TP size {ptp} != decode attn TP size {dtp} for an MHA/GQA "
                    "model whose KV args do not describe its heads (kv_head_num, page_size, "
                    "equal item lengths)")
        if mgr.state_groups:
            return f"{sizes}: {_STATE_NOT_SLICED}"
        if os.environ.get("KVW_GPU_PATH", "").lower() == "staging":
            return (f"{sizes}: head slicing does not work with staged GPU memory "
                    "(KVW_GPU_PATH=staging)")
        return None

    def _init_sliced(self, ptp: int) -> None:
        """MHA/GQA with decode attn TP < prefill attn TP: one kvwire
        receiver over every prefill rank of the target range (sglang's
        target_tp_ranks, one bootstrap_info each), which asks each rank for
        the heads it sends (head slicing, docs/head-slicing.md)."""
        mgr = self.kv_mgr
        infos = list(self.bootstrap_infos or [])
        tps = list(self.target_tp_ranks or [])
        if len(infos) != len(tps) or not infos:
            self._fail(f"kvwire: {len(infos)} prefill ranks resolved for target attn TP ranks "
                       f"{tps} (prefill attn TP size {ptp}, decode {mgr.attn_tp_size})")
            return
        ranks = [kvwire.PrefillRank(int(t), endpoint=_endpoint(bi)) for t, bi in zip(tps, infos)]
        try:
            r = mgr.engine.receiver_ranks(ranks, int(self.bootstrap_room))
        except Error as e:
            self._fail(f"kvwire receiver over prefill attn TP ranks {tps} (prefill attn TP size "
                       f"{ptp}, decode attn TP size {mgr.attn_tp_size}): {e}")
            return
        self.recvs.append((r, False))

    def send_metadata(self, kv_indices: Any, aux_index: Optional[int] = None,
                      state_indices: Optional[List] = None,
                      decode_prefix_len: Optional[int] = None) -> None:
        if self.conclude_state is not None:
            return
        page = int(getattr(self.kv_mgr.kv_args, "page_size", 1) or 1)
        if decode_prefix_len and decode_prefix_len % page:
            # Prefill drops whole pages (it learns the prefix as the pages
            # decode did not ask for): a prefix inside a page has no such page.
            self._fail(f"kvwire: decode prefix length {decode_prefix_len} is not a multiple of "
                       f"the page size {page}")
            return
        lists = _state_lists(state_indices, self.kv_mgr.state_groups)
        self._t_meta = time.monotonic()
        if self.kv_mgr.verify:
            self._pages = _flat_indices(kv_indices)
        # sglang's waiting timeout (SGLANG_DISAGGREGATION_WAITING_TIMEOUT)
        # runs from here: the pages are held, waiting for prefill's data.
        self.init_time = time.time()
        self._pages_given = True
        for r, dummy in self.recvs:
            if dummy:
                continue
            try:
                aux = aux_index if getattr(r, "_kvwire_aux", True) else None
                r.init(kv_indices, aux, state_lists=lists or None)
            except Error as e:
                if r.poll() != Poll.FAILED:
                    self._fail(f"kvwire receiver init: {e}")
                    return
        self.kv_mgr.update_status(self.bootstrap_room, KVPoll.Transferring)

    def poll(self) -> int:
        if self.conclude_state is not None:
            return self.conclude_state
        common = self.kv_mgr.request_status.get(self.bootstrap_room, KVPoll.Failed)
        if common == KVPoll.Failed or self._failing:
            # heartbeat, abort, timeout (sglang's verdict) or kvwire's own:
            # Failed once kvwire's receivers have ended
            return self._settle()
        if self._pages_given and self._check_waiting_timeout() == KVPoll.Failed:
            return self._settle()  # sglang recorded why (timed out after ...)
        if not self.recvs:
            return common
        low = Poll.SUCCESS
        for r, dummy in self.recvs:
            self._verify_landed(r, dummy)
            s = r.poll()
            if s == Poll.FAILED:
                err = r.failure()
                return self._fail(f"kvwire, prefill at {r.bootstrap_addr}: {_reason(err)}"
                                  f"{self._claimed_hint(err)}")
            low = min(low, s)
        if low == Poll.SUCCESS:
            self.kv_mgr.update_status(self.bootstrap_room, KVPoll.Success)
            self.conclude_state = KVPoll.Success
        return int(low)

    def _claimed_hint(self, err: Optional[Error]) -> str:
        """Decode TP > prefill TP and the room already claimed by another
        decode rank: prefill serves one decode rank per room, since it
        neither was told decode's TP nor learned it from kvwire's request
        (a prefill or decode with kvwire before 1.5, whose request carries
        no rank count)."""
        info = getattr(self, "prefill_info", None)
        if (err is None or err.status not in (kvwire.Status.ERR_EXISTS, kvwire.Status.ERR_LIMIT)
                or info is None or info.attn_tp_size >= self.kv_mgr.attn_tp_size):
            return ""
        return (f" (decode attn TP size {self.kv_mgr.attn_tp_size} > prefill attn TP size "
                f"{info.attn_tp_size}: start prefill with --disaggregation-decode-tp "
                "(and --disaggregation-decode-dp) naming decode's sizes, so that each prefill "
                "rank serves every decode rank of its range, or without it and kvwire 1.5 or "
                "later on both sides, whose request carries decode's rank count)")

    def _verify_landed(self, r: kvwire.Receiver, dummy: bool) -> None:
        """Verified, with the caller's digests: once r landed, the digest of
        our pages (a dummy, asked for nothing: 0), which kvwire compares
        with prefill's. landed() is False where kvwire digests itself."""
        if not self.kv_mgr.verify or r.closed or not r.landed():
            return
        try:
            r.verify(0 if dummy else self.kv_mgr.kv_digest(self._pages, 0))
        except Error:
            pass  # ended meanwhile (aborted, timed out): its poll says why

    def _wait_recvs_ended(self) -> bool:
        """Block until this rank's kvwire receivers have ended (aborting
        them), bounded as kvw_receiver_destroy is (2 x peer_timeout_ms +
        1 s). For a request sglang fails on another rank's verdict (the
        TP group's polls are all-reduced: one rank's Failed frees every
        rank's pages) while this rank's writes may still land. True if
        it had to abort them."""
        if not self._pages_given or self._recvs_ended():
            return False
        self._failing = True
        self._abort_recvs()
        bound = 2 * self.kv_mgr.peer_timeout_ms / 1000 + 1.0
        end = time.monotonic() + bound
        while not self._recvs_ended():
            if time.monotonic() > end:
                logger.error("kvwire %s: room %d: the receivers did not end within %.1f s of "
                             "their abort; sglang frees the pages now", self.kv_mgr.where(),
                             self.bootstrap_room, bound)
                return True
            time.sleep(0.001)
        self.conclude_state = KVPoll.Failed
        return True

    def failure_exception(self) -> None:
        # sglang asks this on a Failed poll, right before it frees the pages
        # (release_kv_cache): if the Failed was another rank's, this rank's
        # own transfer must be over first.
        aborted_here = self._wait_recvs_ended()
        with self.kv_mgr.failure_lock:
            reason = self.kv_mgr.failure_records.pop(self.bootstrap_room, None)
        if reason is None and aborted_here:
            reason = ("failed on another rank (this rank's transfer was still under way: "
                      "aborted, its writes over)")
        if reason is None:
            errs = [f"prefill at {r.bootstrap_addr}: {_reason(r.failure())}"
                    for r, _ in self.recvs if not r.closed and r.poll() == Poll.FAILED]
            reason = "; ".join(errs) or (
                f"failed on another rank (this one: {KVPoll_name(self.poll())})")
        raise KVTransferError(self.bootstrap_room, f"kvwire {self.kv_mgr.where()}: {reason}")

    def get_transfer_metric(self) -> KVTransferMetric:
        m = KVTransferMetric()
        for r, dummy in self.recvs:
            if dummy or r.closed:
                continue
            try:
                km = r.metrics()
                if km.transfer_us:
                    m.transfer_latency_s = max(m.transfer_latency_s or 0.0, km.transfer_us / 1e6)
                if km.bytes:
                    m.transfer_total_bytes = (m.transfer_total_bytes or 0) + km.bytes
            except Error:
                pass
        return m

    def abort(self) -> None:
        """sglang's AbortReq: kvwire's receivers are aborted (kvwire tells
        prefill: no abort notification of sglang's); the request turns
        Failed once they have ended (see the class): at once before
        send_metadata, also before init."""
        if self.conclude_state is not None or self._failing:
            return  # ended, or failing already (its reason stands)
        self._fail("Aborted by AbortReq.")

    def clear(self) -> None:
        """Never blocks: a receiver that has not ended is destroyed on the
        manager's closer thread, which waits for its abort barrier there."""
        super().clear()
        recvs, self.recvs = self.recvs, []
        for r, _ in recvs:
            self.kv_mgr._closer.close(r, deliver=self._deliver)


class KVWireKVBootstrapServer(CommonKVBootstrapServer):
    """sglang's HTTP bootstrap server, unchanged: kvwire runs none of its own."""
