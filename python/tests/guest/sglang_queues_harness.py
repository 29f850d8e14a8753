# SPDX-License-Identifier: Apache-2.0
"""Prefill and decode engines running sglang's REAL scheduler queues on
kvwire, one process per rank and side (run by test_sglang_queues.py).

    sglang_queues_harness.py --world 2 --ip0 IP --dev0 DEV --ip1 IP --dev1 DEV
                             --rendezvous DIR [--cases tp11,tp22,...]

The launcher starts, with multiprocessing's spawn (sglang's start method:
each process imports sglang and kvwire afresh), the 2 x world rank
processes (prefill ranks on ip0/dev0, decode ranks on ip1/dev1) and one
running sglang's bootstrap server (on ip0), as sglang runs it in the HTTP
server's process; they meet only through that server, kvwire and, within
a side, gloo.

Real (sglang's pinned snapshot, never copied):
  - prefill: PrefillBootstrapQueue (add, pop_bootstrapped, its KV manager
    set-up from the pool), SchedulerDisaggregationPrefillMixin.send_kv_chunk
    (chunked: page-aligned partial sends, then the last chunk with the
    metadata buffers) and .process_disagg_prefill_inflight_queue;
  - decode: DecodePreallocQueue (add, _resolve_pending_reqs with
    try_ensure_parallel_info / prefill_info_table, _update_handshake_waiters,
    pop_preallocated with its token budget, _pre_alloc,
    alloc_for_decode_prealloc, send_metadata), DecodeTransferQueue
    (pop_transferred with the metadata gate and the bootstrap_room check,
    _commit_transfer_to_req), DecodeReqToTokenPool;
  - MetadataBuffers, ReqToMetadataIdxAllocator, poll_and_all_reduce and
    poll_and_all_reduce_attn_cp_tp_group over gloo process groups (one
    process per rank; the TP group of a case is a torch.distributed group);
  - CommonKVManager/Sender/Receiver/BootstrapServer under kvwire's classes
    (install("kvwire"), get_kv_class), the HTTP bootstrap server;
  - kvwire on real rxe (the test bed's devices).

Stand-ins (each where sglang would run a model, an allocator or a scheduler;
python/tests/sglang_stubs holds the module-level stubs for the rest of sglang):
  - FakeReq: sglang's Req carries tokenizer, sampling and batch state the
    queues do not read; FakeReq has the fields they read (rid, bootstrap
    host/port/room, origin_input_ids, fill_ids, output_ids, req_pool_idx,
    metadata_buffer_index, cached-token counts, finished_reason ...), and a
    time_stats that accepts any call (tracing only).
  - CpuKVPool (a KVCache / MLATokenToKVPool subclass of the stub classes):
    the model's KV pool on the GPU; here numpy host buffers, one per layer
    for K then V (MHA) or one per layer (MLA), page_size tokens per item,
    token-major (NHD) with this rank's KV heads (the model's 4 over the
    attention TP size), get_contiguous_buf_infos() as sglang's pools
    report them.
  - ModelConfig (sglang_stubs' configs/model_config.py): never loaded by
    kvwire's backend (decode learns its KV heads from prefill's handshake;
    sglang's decode KV args carry none); the stub counts and refuses a load.
  - PagedAllocator: sglang's paged token-to-KV allocator (GPU kernels);
    here a free list of pages with alloc_extend() for a fresh request.
  - PrefillReqToTokenPool: sglang's ReqToTokenPool (a GPU tensor); here a
    CPU int32 tensor of the same shape.
  - hybrid22's pools: CpuHybridPool (an SWAKVPool subclass: sglang's SWA
    pool, whose get_state_buf_infos its real setup_state_kv_args reads as
    StateType.SWA, plus Mamba's conv and ssm buffers), the allocator's SWA
    pages and translate_loc_from_full_to_swa (sglang's
    SWATokenToKVPoolAllocator, GPU), MambaSlots / HybridDecodeReqToTokenPool
    (the Mamba side of sglang's HybridReqToTokenPool: a 1-D
    req_index_to_mamba_index_mapping, GPU); and Mamba's component appended
    after the real setup_state_kv_args (_setup_state_kv_args_hybrid: no pool
    class at the pinned commit has both kinds). The payloads themselves
    (_mamba_payload, _swa_payload) are sglang's send_kv_chunk and
    pop_preallocated code.
  - FakeTreeCache: the radix cache (off, as --disable-radix-cache); it only
    frees a finished or failed request's pages and slot, counting them.
  - PrefillSched / DecodeSched: the Scheduler object; they carry the
    attributes the queue code reads (server_args, ps, model_config,
    tp_worker, the gloo groups, running_batch, the inflight queue ...) and
    record what the queues stream out (stream_output), since there is no
    tokenizer to stream to. The scheduler's loop itself (batches, the
    forward pass) is replaced by the loops below, which call the queue
    methods in the order sglang's event loops do: prefill
    pop_bootstrapped -> (forward: write the chunk's KV) -> send_kv_chunk ...
    -> last chunk (output token, metadata) -> process_disagg_prefill_inflight_queue;
    decode pop_preallocated -> transfer_queue.extend -> pop_transferred.

Cases (CASES; chunked prefill everywhere: CHUNK tokens per forward, so
several send() per request): tp11, tp22 (MHA, a gloo group of 2), abort22
(aborts on either side, see aborts()), dpattn (tp 2, attn_tp 1, dp 2 on both
sides), mla21 (MLA, prefill TP 2 -> decode TP 1), mha21 (MHA, prefill TP 2
-> decode TP 1: head slicing, decode's one receiver over both prefill
ranks, each sending its 2 of decode's 4 heads), mha12 and mla12 (prefill
TP 1 -> decode TP 2: one prefill rank serves each room to both decode
ranks, kvw_sender_create_fanout; MHA each its 2 heads, MLA the latent to
each, each its own metadata; prefill told decode's TP as sglang's
--disaggregation-decode-tp),
hybrid22 (TP 2 -> 2, Mamba state and an SWA pool beside the KV: each
StateType its own kvwire state group; every byte of the SWA window and of
the Mamba slot checked on decode), hybrid21 (the same model, prefill TP 2
-> decode TP 1: refused, every request failing at once on decode, the
reason naming the sizes and the missing state slicing, REFUSALS; kvwire's
handshake refuses the layouts (the SWA items differ), which names no room,
so prefill's requests end by sglang's bootstrap timeout, 10 s there),
prefix11 (decode's radix cache on, holding the first 8 tokens, 2 pages, of
each request longer than that: sglang's DecodePreallocQueue sends
decode_prefix_len 8 and only the other pages; prefill sends those only
(its transfer metric counts them)),
pp21 (prefill PP 2: the two prefill rank processes are PP stages 0 and 1,
each attn TP 1 with its one layer, PrefillBootstrapQueue(pp_rank, pp_size);
decode PP 1 with both layers gathers them),
freeze22 (the test SIGSTOPs every prefill rank while decode's requests sit
in the transfer queue; the bootstrap server, in its own process, keeps
answering sglang's heartbeat, and kvwire's own peer timers are set to
30 s, so sglang's waiting timeout (FREEZE_WAITING_S) fails them; then
SIGCONT), kill22 (the prefill ranks and the bootstrap server SIGKILLed
there: the whole prefill server gone). For the last two, decode's
heartbeat is set to 2 s x 2 through the environ stub. Every KV byte of every request, the first output token and
cached-token count (metadata buffers) and the bootstrap_room that sglang's
transfer queue checks are verified; every page, metadata slot and request
slot must be back in its free list at the end.
"""
import time

T0 = time.monotonic()  # noqa: E402 (imports below cost seconds in a TCG guest)
import argparse  # noqa: E402
import logging  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
import traceback  # noqa: E402

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # python/tests
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))  # python/
import sglang_ref  # noqa: E402

logging.basicConfig(level=logging.WARNING, format="%(name)s %(levelname)s: %(message)s")
sglang_ref.enter()
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import kvwire.sglang as ks  # noqa: E402

ks.install("kvwire")
import sglang.srt.disaggregation.decode as sg_decode  # noqa: E402
import sglang.srt.disaggregation.prefill as sg_prefill  # noqa: E402
from sglang.srt.disaggregation.base.conn import StateType  # noqa: E402
from sglang.srt.disaggregation.decode import (DecodePreallocQueue,  # noqa: E402
                                              DecodeReqToTokenPool, DecodeTransferQueue)
from sglang.srt.disaggregation.prefill import (PrefillBootstrapQueue,  # noqa: E402
                                               SchedulerDisaggregationPrefillMixin)
from sglang.srt.disaggregation.utils import (MetadataBuffers,  # noqa: E402
                                             ReqToMetadataIdxAllocator, TransferBackend,
                                             KVClassType, append_state_component,
                                             get_kv_class)
from sglang.srt.managers.schedule_batch import FINISH_ABORT  # noqa: E402
from sglang.srt.mem_cache.allocator import BaseTokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.memory_pool import KVCache, MLATokenToKVPool  # noqa: E402
from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool  # noqa: E402
from sglang.srt.runtime_context import set_rank  # noqa: E402
from sglang.srt.server_args import ServerArgs  # noqa: E402

BACKEND = TransferBackend("kvwire")
# name: (MLA, prefill (attn TP, DP), decode (attn TP, DP)); one process per rank
CASES = {
    "tp11": (False, (1, 1), (1, 1)),
    "tp22": (False, (2, 1), (2, 1)),
    "abort22": (False, (2, 1), (2, 1)),
    "dpattn": (False, (1, 2), (1, 2)),  # tp 2, attn_tp 1, dp 2 on both sides
    "mla21": (True, (2, 1), (1, 1)),
    "mha21": (False, (2, 1), (1, 1)),  # head slicing: decode takes 2 heads from each rank
    "mha12": (False, (1, 1), (2, 1)),  # one prefill rank serves both decode ranks their heads
    "mla12": (True, (1, 1), (2, 1)),  # one prefill rank serves both decode ranks the latent
    "mha12noflag": (False, (1, 1), (2, 1)),  # mha12, prefill not told decode's TP (NOFLAG)
    "hybrid22": (False, (2, 1), (2, 1)),  # + Mamba and SWA state (HYBRID)
    "hybrid21": (False, (2, 1), (1, 1)),  # refused: state is not sliced across TP sizes
    "freeze22": (False, (2, 1), (2, 1)),  # prefill SIGSTOPped: sglang's waiting timeout
    "pp21": (False, (1, 1), (1, 1)),  # prefill PP 2 (PP_STAGES), decode PP 1 gathers both
    "prefix11": (False, (1, 1), (1, 1)),  # decode's radix cache holds a prefix (PREFIX_TOKENS)
    "kill22": (False, (2, 1), (2, 1)),  # last: prefill (ranks, bootstrap server) SIGKILLed
}
# Prefill is started without --disaggregation-decode-tp: each room's sender
# learns decode's rank count from decode's requests (sglang's
# required_dst_info_num in kvwire's REQUEST), as mooncake's does.
# (MLA without the flag is served too, but prefill's sglang transfer metric
# then counts one copy of the latent, not one per decode rank: the backend
# cannot read the learned count yet, and this harness checks the metric.)
NOFLAG = ("mha12noflag",)
# Prefill's PP size per case (the prefill rank processes are its stages,
# each attn TP 1, holding layers [stage, stage + 1)); decode PP 1.
PP_STAGES = {"pp21": 2}
# Decode prefix reuse: decode's radix cache (on) holds the first N tokens
# (whole pages) of each request longer than that; decode asks prefill only
# for the rest (sglang's decode_prefix_len).
PREFIX_TOKENS = {"prefix11": 8}


def prefix_len(case, n):
    """The tokens of an n-token request decode's radix cache holds."""
    p = PREFIX_TOKENS.get(case, 0)
    return p if n > p else 0
PAGE, LAYERS, POOL_PAGES = 4, 2, 96
FREEZE_WAITING_S = 12  # freeze22: decode's SGLANG_DISAGGREGATION_WAITING_TIMEOUT
MODEL_KV_HEADS, HEAD_BYTES = 4, 16  # MHA: a head of a token is head_dim x dtype bytes
MLA_TOKEN_BYTES = 64  # MLA: one latent "head", the same on every rank
MD_SLOTS, MAX_CTX, CHUNK = 8, 128, 6
# A hybrid model (HYBRID cases): Mamba's conv and ssm state, one slot per
# request (MAMBA_SLOTS in its pool, slot 0 padding as sglang's), and an SWA
# KV pool of its own (K and V per layer, its own page ids) holding the last
# WINDOW tokens; each is its own sglang StateType, so its own kvwire state
# group and index space.
HYBRID = {"hybrid22", "hybrid21"}
MAMBA_SLOTS, MAMBA_ITEMS, WINDOW = 2 * MD_SLOTS + 1, (96, 160), 9
BASE = {c: 1000 * (i + 1) for i, c in enumerate(CASES)}


def say(*a):
    print(*a, flush=True)


def requests(case):
    """(room, prompt length) of a case's requests (both sides): lengths that
    are and are not multiples of the page, one shorter than a chunk."""
    b = BASE[case]
    if case == "abort22":  # 3 that succeed, then the aborted ones (aborts())
        return [(b + 1, 17), (b + 2, 24), (b + 3, 13), (b + 4, 31), (b + 5, 31)]
    return [(b + 1, 17), (b + 2, 24), (b + 3, 5), (b + 4, 31), (b + 5, 13)]


def aborts(case):
    """abort22's aborted rooms: prefill aborts one after its first chunk
    (sglang's abort_request: the sender's abort()), decode aborts one in
    its transfer queue (after send_metadata) and one in its prealloc queue
    that prefill never receives (a client that gave up before prefill got
    it)."""
    b = BASE[case]
    if case != "abort22":
        return {}
    return {"prefill_mid_chunks": b + 4, "decode_transfer_queue": b + 5,
            "decode_prealloc_queue": b + 6}


def expect_success(case, room):
    return case != "freeze22" and case not in REFUSALS and room not in aborts(case).values()


# case: what decode's reason must say for a layout kvwire refuses (every
# request fails at once on both sides, nothing held)
REFUSED_BOOTSTRAP_S = 10  # prefill's SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT there
REFUSALS = {"hybrid21": "prefill attn TP size 2, decode attn TP size 1: a hybrid model's "
                        "state (Mamba, SWA, DSA) is not sliced across TP sizes"}


def layout(case, role, rank):
    """This rank's (attn TP size, DP size, attn TP rank, DP rank, MLA), or
    None when the case uses fewer ranks on this side."""
    mla, p, d = CASES[case]
    tp, dp = p if role == "prefill" else d
    stages = PP_STAGES.get(case, 1) if role == "prefill" else 1
    if rank >= tp * dp * stages:
        return None
    if stages > 1:  # this rank is PP stage `rank` (pp_stage())
        return tp, dp, 0, 0, mla
    return tp, dp, rank % tp, rank // tp, mla


def pp_stage(case, role, rank):
    """(PP rank, PP size) of a rank: prefill's ranks are PP_STAGES' stages."""
    n = PP_STAGES.get(case, 1) if role == "prefill" else 1
    return (rank, n) if n > 1 else (0, 1)


def prefill_dp(room, dp):
    return room % dp  # sglang's follow_bootstrap_room (what decode resolves)


def decode_dp(room, dp):
    return (room // 7) % dp  # the router's choice of decode DP rank: any


def heads_of(mla, attn_tp, attn_tp_rank):
    """(first head, heads) a rank holds: MHA splits the model's KV heads
    over the attention TP ranks; MLA's latent cache is one replicated head."""
    if mla:
        return 0, 1
    n = MODEL_KV_HEADS // attn_tp
    return attn_tp_rank * n, n


def token_bytes(mla, attn_tp):
    return MLA_TOKEN_BYTES if mla else heads_of(False, attn_tp, 0)[1] * HEAD_BYTES


def kv_content(room, dp_rank, buf, n, mla, heads):
    """What prefill's forward pass writes for a request's n tokens in KV
    buffer buf on a rank of prefill DP rank dp_rank holding heads (first,
    count): each head of each token its own bytes, so that a decode rank
    holding other heads than one prefill rank checks each head it got."""
    rng = np.random.default_rng([room, dp_rank, buf])
    if mla:
        return rng.integers(0, 256, (n, MLA_TOKEN_BYTES), dtype=np.uint8)
    full = rng.integers(0, 256, (n, MODEL_KV_HEADS * HEAD_BYTES), dtype=np.uint8)
    first, count = heads
    return full[:, first * HEAD_BYTES:(first + count) * HEAD_BYTES]


def mamba_content(room, dp_rank, j):
    """Prefill's final Mamba state of a request: its conv (j 0) and ssm (j 1)
    item."""
    return np.random.default_rng([room, dp_rank, 100 + j]).integers(
        0, 256, MAMBA_ITEMS[j], dtype=np.uint8)


def swa_content(room, dp_rank, buf, n, heads):
    """What prefill's forward pass writes in SWA buffer buf (K, V per layer)
    for a request's n tokens: other bytes than its full-attention KV."""
    return kv_content(room + 100000, dp_rank, buf, n, False, heads)


def swa_window_start(n):
    """sglang's _swa_payload: the window's first token, page-aligned down."""
    return max(0, n - WINDOW) // PAGE * PAGE


def first_token(room):
    return room * 7 + 3


def cached_tokens(room):
    return room % 5


class _Any:
    """Accepts any call (sglang's per-request time_stats / trace context)."""

    def __getattr__(self, name):
        return _Any()

    def __call__(self, *a, **k):
        return None


class _TimeStats(_Any):
    """time_stats, noting the transfer metric sglang's inflight queue
    observes for a finished request (the sender's get_transfer_metric())."""

    metric_bytes = None

    def compute_and_observe_kv_transfer_metrics(self, metric):
        self.metric_bytes = metric.transfer_total_bytes
        return None


class _Obj:
    def __init__(self, **kw):
        self.__dict__.update(kw)


class FakeReq:
    def __init__(self, room, n, host, port):
        self.rid = f"req-{room}"
        self.bootstrap_host, self.bootstrap_port, self.bootstrap_room = host, port, room
        self.disagg_prefill_dp_rank = None
        self.origin_input_ids = [(room + i) % 32000 for i in range(n)]
        self.fill_ids = []
        self.output_ids = []
        self.sampling_params = _Obj(max_new_tokens=8)
        self.return_logprob = False
        self.return_sampling_mask = False
        self.time_stats = _TimeStats()
        self.finished_reason = None
        self.metadata_buffer_index = -1
        self.start_send_idx = 0
        self.req_pool_idx = None
        self.kv = None
        self.kv_committed_len = 0
        self.inflight_middle_chunks = 0
        self.priority = None
        self.cached_tokens = 0
        self.cached_tokens_device = self.cached_tokens_host = self.cached_tokens_storage = 0
        self.multimodal_inputs = None
        self.hidden_states_tensor = None
        self.disagg_kv_sender = None
        self.extend_range = None
        self.kv_len = n  # tokens whose slots the tree cache frees

    def set_extend_range(self, start, end):
        self.extend_range = _Obj(start=start, end=end)


class CpuKVPool(KVCache):
    def __init__(self, mla, attn_tp, stage=(0, 1)):
        # a PP stage holds layers [start, end) of the model's (sglang's split)
        per = LAYERS // stage[1]
        self.start_layer = stage[0] * per
        self.end_layer = LAYERS if stage[0] == stage[1] - 1 else self.start_layer + per
        self.page_size = PAGE
        self.head_num = heads_of(mla, attn_tp, 0)[1]
        self.token_bytes = token_bytes(mla, attn_tp)
        self.size = POOL_PAGES * PAGE
        layers = list(range(self.start_layer, self.end_layer))
        # each buffer's index in the whole model's (K layers then V layers):
        # what kv_content() is keyed on, so a stage writes what decode checks
        self.buf_ids = layers if mla else layers + [LAYERS + x for x in layers]
        # + one page: sglang's pools keep slot 0 (page 0) as padding.
        self.bufs = [np.zeros((self.size + PAGE, self.token_bytes), dtype=np.uint8)
                     for _ in self.buf_ids]

    def get_contiguous_buf_infos(self):
        return ([b.ctypes.data for b in self.bufs], [b.nbytes for b in self.bufs],
                [self.token_bytes * PAGE] * len(self.bufs))


class CpuMLAPool(CpuKVPool, MLATokenToKVPool):
    pass


class CpuHybridPool(CpuKVPool, SWAKVPool):
    """A hybrid model's pools: the full-attention KV (CpuKVPool), an SWA KV
    pool of its own pages (K and V per layer: sglang's SWAKVPool, whose
    get_state_buf_infos setup_state_kv_args reads as StateType.SWA) and
    Mamba's state (conv, ssm: one item per slot, get_mamba_buf_infos)."""

    def __init__(self, attn_tp):
        super().__init__(False, attn_tp)
        self.swa_bufs = [np.zeros((self.size + PAGE, self.token_bytes), dtype=np.uint8)
                         for _ in range(2 * LAYERS)]
        self.mamba_bufs = [np.zeros((MAMBA_SLOTS, n), dtype=np.uint8) for n in MAMBA_ITEMS]

    def get_state_buf_infos(self):
        return ([b.ctypes.data for b in self.swa_bufs], [b.nbytes for b in self.swa_bufs],
                [self.token_bytes * PAGE] * len(self.swa_bufs))

    def get_mamba_buf_infos(self):
        return ([b.ctypes.data for b in self.mamba_bufs], [b.nbytes for b in self.mamba_bufs],
                list(MAMBA_ITEMS))


def kv_pool(mla, attn_tp, hybrid=False, stage=(0, 1)):
    if hybrid:
        return CpuHybridPool(attn_tp)
    return CpuMLAPool(True, attn_tp, stage) if mla else CpuKVPool(False, attn_tp, stage)


def _setup_state_kv_args_hybrid(real):
    """sglang's setup_state_kv_args, then Mamba's component. Stand-in: at the
    pinned commit it reads one state kind per pool class (SWAKVPool: SWA;
    HybridLinearKVPool: Mamba), and no pool class there has both; a model
    with both is modelled by appending Mamba's component (sglang's own
    append_state_component) after the real call reads the SWA pool. The
    queues then build both payloads per StateType, as they do for any
    state_types list."""

    def setup(kv_args, token_to_kv_pool, *a, **k):
        real(kv_args, token_to_kv_pool, *a, **k)
        if isinstance(token_to_kv_pool, CpuHybridPool):
            append_state_component(kv_args, StateType.MAMBA,
                                   *token_to_kv_pool.get_mamba_buf_infos())

    return setup


sg_prefill.setup_state_kv_args = _setup_state_kv_args_hybrid(sg_prefill.setup_state_kv_args)
# sglang's match_prefix_for_req over its RadixCache: the stand-in radix cache's
sg_decode.match_prefix_for_req = lambda tree_cache, req, *a, **k: \
    tree_cache.match_prefix_for_req(req)
sg_decode.setup_state_kv_args = _setup_state_kv_args_hybrid(sg_decode.setup_state_kv_args)


class PagedAllocator(BaseTokenToKVPoolAllocator):
    def __init__(self, pool):
        self.pool, self.page_size, self.device = pool, PAGE, "cpu"
        self.free_pages = list(range(1, POOL_PAGES + 1))
        # A hybrid model's SWA pool: its own pages, one per full page here
        # (sglang's SWA allocator frees those out of the window; not needed
        # for the transfer), in another order than the full pool's.
        self.swa_free = list(range(POOL_PAGES, 0, -1))
        self.swa_of = {}  # full page -> SWA page

    def translate_loc_from_full_to_swa(self, locs):
        """sglang's SWATokenToKVPoolAllocator: a full-pool token slot's SWA slot."""
        return torch.tensor([self.swa_of[int(x) // PAGE] * PAGE + int(x) % PAGE for x in locs],
                            dtype=torch.int64)

    def get_kvcache(self):
        return self.pool

    def available_size(self):
        return len(self.free_pages) * PAGE

    def alloc_tokens(self, n):
        pages = -(-n // PAGE)
        if pages > len(self.free_pages):
            return None
        got, self.free_pages = self.free_pages[:pages], self.free_pages[pages:]
        if isinstance(self.pool, CpuHybridPool):
            for p in got:
                self.swa_of[p] = self.swa_free.pop()
        return torch.tensor([p * PAGE + i for p in got for i in range(PAGE)][:n],
                            dtype=torch.int64)

    def alloc_extend(self, prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc,
                     extend_num_tokens):
        # decode's radix cache (prefix11) holds whole pages: the rest starts a page
        assert int(prefix_lens_cpu[0]) % PAGE == 0, "a prefix of whole pages"
        return self.alloc_tokens(int(extend_num_tokens))

    def free_tokens(self, locs):
        pages = sorted({int(x) // PAGE for x in locs})
        self.free_pages.extend(pages)
        self.swa_free.extend(self.swa_of.pop(p) for p in pages if p in self.swa_of)


class PrefillReqToTokenPool:
    def __init__(self):
        self.req_to_token = torch.zeros((MD_SLOTS * 2 + 1, MAX_CTX), dtype=torch.int32)
        self.free_slots = list(range(1, MD_SLOTS * 2 + 1))
        self.mamba = MambaSlots()
        self.req_index_to_mamba_index_mapping = self.mamba.mapping

    def alloc_req(self, req):
        req.req_pool_idx = self.free_slots.pop(0)
        self.mamba.alloc(req.req_pool_idx)

    def free(self, req):
        self.mamba.free(req.req_pool_idx)
        self.free_slots.append(req.req_pool_idx)
        req.req_pool_idx = None


class MambaSlots:
    """sglang's HybridReqToTokenPool's Mamba side (a GPU pool): a request
    slot's Mamba slot in req_index_to_mamba_index_mapping (1-D, as
    sglang's: indexed by one request slot it gives a 0-d tensor), taken from
    a free list in another order than the request slots."""

    def __init__(self):
        self.mapping = torch.zeros(MD_SLOTS * 2 + 1, dtype=torch.int32)
        self.free_list = list(range(1, MAMBA_SLOTS))

    def alloc(self, req_slot):
        self.mapping[req_slot] = self.free_list.pop()

    def free(self, req_slot):
        self.free_list.append(int(self.mapping[req_slot]))
        self.mapping[req_slot] = 0


class HybridDecodeReqToTokenPool(DecodeReqToTokenPool):
    """sglang's DecodeReqToTokenPool with the Mamba slots its hybrid pool
    (HybridMambaDecodeReqToTokenPool: a GPU Mamba pool) gives each request."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.mamba = MambaSlots()
        self.req_index_to_mamba_index_mapping = self.mamba.mapping

    def alloc(self, reqs):
        out = super().alloc(reqs)
        for r in reqs if out is not None else []:
            if int(self.mapping_of(r)) == 0:
                self.mamba.alloc(r.req_pool_idx)
        return out

    def mapping_of(self, r):
        return self.mamba.mapping[r.req_pool_idx]

    def free(self, req):
        self.mamba.free(req.req_pool_idx)
        super().free(req)


class FakeTreeCache:
    """The radix cache. Off (prefix_tokens 0, --disable-radix-cache): it only
    frees a finished or failed request's pages and slot. On (decode,
    prefix11: --disaggregation-decode-enable-radix-cache): it holds the first
    prefix_tokens tokens of each request longer than that, as an earlier
    request with the same prompt prefix left them in decode's pool (fill:
    writes their KV into freshly taken pages), and
    match_prefix_for_req gives them to sglang's DecodePreallocQueue (the
    stand-in of sglang's match_prefix_for_req over a RadixCache, GPU tensors
    and eviction); the request's end frees them with its own pages (the
    cached node evicted at once)."""

    def __init__(self, allocator, req_to_token_pool, prefix_tokens=0, fill=None):
        self.allocator, self.req_to_token_pool = allocator, req_to_token_pool
        self.released = 0
        self.prefix_tokens, self.fill = prefix_tokens, fill
        self.prefix_hits = 0

    def match_prefix_for_req(self, req):
        n = len(req.origin_input_ids)
        p = self.prefix_tokens if n > self.prefix_tokens else 0
        locs = torch.empty((0,), dtype=torch.int64)
        if p:
            locs = self.allocator.alloc_tokens(p)
            self.fill(req, locs)
            self.prefix_hits += 1
        return _Obj(device_indices=locs, host_hit_length=0, last_device_node=req.rid,
                    last_host_node=None)

    def inc_lock_ref(self, *a, **k):
        pass

    def supports_mamba(self):
        return False

    def evictable_size(self):
        return 0

    def protected_size(self):
        return 0

    def dec_lock_ref(self, *a, **k):
        pass

    def release_aborted_request(self, rid):
        pass

    def cache_finished_req(self, req, is_insert=True):
        if req.req_pool_idx is None:
            return
        n = req.kv_len
        self.allocator.free_tokens(self.req_to_token_pool.req_to_token[req.req_pool_idx, :n])
        self.req_to_token_pool.free(req)
        self.released += 1


class RecordingMetadataBuffers(MetadataBuffers):
    """sglang's MetadataBuffers; get_buf also notes the bootstrap_room it
    read (the transfer queue resets the slot after committing)."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.rooms_read = {}

    def get_buf(self, idx):
        out = super().get_buf(idx)
        self.rooms_read.setdefault(idx, []).append(int(out[-1][0]))
        return out


def metadata_buffers():
    return RecordingMetadataBuffers(MD_SLOTS, hidden_size=16, hidden_states_dtype=torch.float32)


def server_args(ip, port, tp, dp, dev, decode=None, pp=1, radix=False):
    """decode (prefill only): decode's (attn TP, DP) sizes, given to prefill
    as sglang's --disaggregation-decode-tp / --disaggregation-decode-dp."""
    extra = {}
    if decode is not None:
        extra = dict(disaggregation_decode_tp=decode[0] * decode[1],
                     disaggregation_decode_dp=decode[1])
    return ServerArgs(host=ip, port=30000, disaggregation_bootstrap_port=port,
                      disaggregation_transfer_backend="kvwire", disaggregation_ib_device=dev,
                      tp_size=tp * dp, dp_size=dp, enable_dp_attention=dp > 1, pp_size=pp,
                      disaggregation_decode_enable_radix_cache=radix, **extra)


class _Sched:
    """What both schedulers share: the attributes the queue code reads."""

    def __init__(self, o, lay, port, group, cp_group, hybrid=False, decode=None, stage=(0, 1),
                 radix=False):
        tp, dp, tp_rank, dp_rank, mla = lay
        self.stage = stage
        self.mla, self.dp_rank, self.heads = mla, dp_rank, heads_of(mla, tp, tp_rank)
        self.hybrid = hybrid
        self.sliding_window_size = WINDOW if hybrid else None
        self.state_checked = 0  # hybrid: the state bytes verify() compared on decode
        self.server_args = server_args(o.ip, port, tp, dp, o.dev, decode, stage[1], radix)
        # a PP stage's TP rank is its attention TP rank (one TP rank a stage here)
        self.tp_rank = o.rank if stage[1] == 1 else tp_rank
        self.ps = _Obj(tp_rank=self.tp_rank, dp_rank=dp_rank, gpu_id=o.rank, pp_rank=stage[0])
        self.model_config = _Obj(num_hidden_layers=LAYERS,
                                 get_total_num_kv_heads=lambda: 1 if mla else MODEL_KV_HEADS)
        self.tp_worker = _Obj(is_hybrid_swa=False)
        self.metrics_reporter = _Obj(enable_metrics=False)
        self.attn_tp_cpu_group, self.attn_cp_cpu_group = group, cp_group
        self.streamed = []  # (rid, finished_reason) of what would go to the client

    def stream_output(self, reqs, return_logprob=False, *a, **k):
        self.streamed.extend((r.rid, r.finished_reason) for r in reqs)


class PrefillSched(_Sched, SchedulerDisaggregationPrefillMixin):
    def __init__(self, o, lay, port, group, cp_group, hybrid=False, decode=None, stage=(0, 1)):
        super().__init__(o, lay, port, group, cp_group, hybrid, decode, stage)
        tp, dp = lay[0], lay[1]
        self.enable_hicache_storage = False
        self.pool = kv_pool(self.mla, tp, hybrid, stage)
        self.token_to_kv_pool_allocator = PagedAllocator(self.pool)
        self.req_to_token_pool = PrefillReqToTokenPool()
        self.tree_cache = FakeTreeCache(self.token_to_kv_pool_allocator, self.req_to_token_pool)
        self.disagg_metadata_buffers = metadata_buffers()
        self.req_to_metadata_buffer_idx_allocator = ReqToMetadataIdxAllocator(MD_SLOTS)
        self.disagg_prefill_inflight_queue = []
        self.disagg_prefill_bootstrap_queue = PrefillBootstrapQueue(
            token_to_kv_pool=self.pool, draft_token_to_kv_pool=None,
            req_to_metadata_buffer_idx_allocator=self.req_to_metadata_buffer_idx_allocator,
            metadata_buffers=self.disagg_metadata_buffers, tp_rank=self.tp_rank,
            tp_size=tp * dp, gpu_id=o.rank, bootstrap_port=port, gloo_group=group,
            max_total_num_tokens=POOL_PAGES * PAGE, scheduler=self, pp_rank=stage[0],
            pp_size=stage[1],
            transfer_backend=BACKEND)

    def forward(self, req, end):
        """The model's forward pass over tokens [len(fill_ids), end): the
        KV of those tokens lands in the pool at the request's slots."""
        start = len(req.fill_ids)
        if req.req_pool_idx is None:
            self.req_to_token_pool.alloc_req(req)
            n = len(req.origin_input_ids)
            locs = self.token_to_kv_pool_allocator.alloc_tokens(n)
            assert locs is not None, "prefill pool full"
            self.req_to_token_pool.req_to_token[req.req_pool_idx, :n] = locs
        locs = self.req_to_token_pool.req_to_token[req.req_pool_idx, start:end].numpy()
        for b, buf in zip(self.pool.buf_ids, self.pool.bufs):
            buf[locs] = kv_content(req.bootstrap_room, self.dp_rank, b,
                                   len(req.origin_input_ids), self.mla, self.heads)[start:end]
        if self.hybrid:  # the SWA layers' KV, and at the end the Mamba state
            n = len(req.origin_input_ids)
            swa = self.token_to_kv_pool_allocator.translate_loc_from_full_to_swa(locs).numpy()
            for b, buf in enumerate(self.pool.swa_bufs):
                buf[swa] = swa_content(req.bootstrap_room, self.dp_rank, b, n,
                                       self.heads)[start:end]
            if end == n:
                slot = int(self.req_to_token_pool.req_index_to_mamba_index_mapping[
                    req.req_pool_idx])
                for j, buf in enumerate(self.pool.mamba_bufs):
                    buf[slot] = mamba_content(req.bootstrap_room, self.dp_rank, j)
        req.fill_ids = req.origin_input_ids[:end]


class DecodeSched(_Sched):
    def cached_prefix(self, req, locs):
        """What the radix cache holds of req (FakeTreeCache, prefix11): the KV
        of its first len(locs) tokens, as prefill's forward pass writes them
        (an earlier request with the same prompt prefix left it here)."""
        n = len(req.origin_input_ids)
        for b, buf in zip(self.pool.buf_ids, self.pool.bufs):
            buf[locs.numpy()] = kv_content(req.bootstrap_room, 0, b, n, self.mla,
                                           self.heads)[:len(locs)]

    def __init__(self, o, lay, port, group, cp_group, hybrid=False, prefix_tokens=0):
        super().__init__(o, lay, port, group, cp_group, hybrid, radix=prefix_tokens > 0)
        tp, dp = lay[0], lay[1]
        self.running_batch = _Obj(reqs=[], batch_is_full=False)
        self.waiting_queue, self.last_batch = [], None
        self.enable_priority_scheduling = self.enable_hisparse = False
        self.enable_decode_hicache = False
        self.spec_algorithm = _Obj(is_none=lambda: True)
        self.output_streamer = self
        self.pool = kv_pool(self.mla, tp, hybrid)
        self.allocator = PagedAllocator(self.pool)
        rtp = HybridDecodeReqToTokenPool if hybrid else DecodeReqToTokenPool
        self.req_to_token_pool = rtp(size=MD_SLOTS, max_context_len=MAX_CTX, device="cpu",
                                     enable_memory_saver=False, pre_alloc_size=MD_SLOTS)
        self.tree_cache = FakeTreeCache(self.allocator, self.req_to_token_pool,
                                        prefix_tokens, self.cached_prefix)
        self.md = metadata_buffers()
        self.md_alloc = ReqToMetadataIdxAllocator(MD_SLOTS)
        self.transfer_queue = DecodeTransferQueue(
            gloo_group=group, req_to_metadata_buffer_idx_allocator=self.md_alloc,
            tp_rank=o.rank, metadata_buffers=self.md, scheduler=self, tree_cache=self.tree_cache)
        self.prealloc_queue = DecodePreallocQueue(
            req_to_token_pool=self.req_to_token_pool, token_to_kv_pool_allocator=self.allocator,
            draft_token_to_kv_pool=None, req_to_metadata_buffer_idx_allocator=self.md_alloc,
            metadata_buffers=self.md, scheduler=self, transfer_queue=self.transfer_queue,
            tree_cache=self.tree_cache, gloo_group=group, tp_rank=o.rank, tp_size=tp * dp,
            dp_size=dp, gpu_id=o.rank, bootstrap_port=port,
            max_total_num_tokens=POOL_PAGES * PAGE, pp_rank=0, num_reserved_decode_tokens=4,
            transfer_backend=BACKEND)


def failed(reason):
    return isinstance(reason, FINISH_ABORT)


# ---------------------------------------------------------------- prefill


def prefill_case(o, case, groups, world_group):
    lay = layout(case, "prefill", o.rank)
    # sglang's bootstrap server runs in its own process (bootstrap_main), as
    # sglang runs it in the HTTP server's process, not in a scheduler's.
    path = os.path.join(o.rendezvous, f"{case}.bootstrap")
    wait_file(path)
    port = int(open(path).read().strip().rsplit(":", 1)[1])
    if lay is None:
        dist.barrier(group=world_group)
        return True
    tp, dp, tp_rank, dp_rank, _ = lay
    set_rank(attn_tp_size=tp, attn_tp_rank=tp_rank, attn_dp_size=dp, attn_dp_rank=dp_rank)
    stage = pp_stage(case, "prefill", o.rank)
    # the attention TP group (a PP stage: its own rank, one TP rank a stage)
    group = groups[tuple(range(dp_rank * tp, dp_rank * tp + tp))] if stage[1] == 1 else \
        groups[(o.rank,)]
    saved = dict(os.environ)
    if case in REFUSALS:  # read when the manager (and its engine) is made
        # decode's refused handshake (the layouts differ: hybrid21's SWA items)
        # names no room: prefill's requests end by sglang's bootstrap timeout
        os.environ["SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT"] = str(REFUSED_BOOTSTRAP_S)
    s = PrefillSched(o, lay, port, group, groups[(o.rank,)], case in HYBRID,
                     decode=None if case in NOFLAG else CASES[case][2], stage=stage)
    os.environ.clear()
    os.environ.update(saved)
    bq = s.disagg_prefill_bootstrap_queue
    fan = CASES[case][2][0] > tp  # decode attn TP > this side's: one sender serves several
    # Each DP rank gets the rooms sglang's router sends it (follow_bootstrap_room).
    reqs = [FakeReq(room, n, o.ip, port) for room, n in requests(case)
            if prefill_dp(room, dp) == dp_rank]
    bq.extend(reqs, s.pool.head_num)
    running, done, sends = [], {}, {}
    frozen = False
    end = time.monotonic() + 180
    while len(done) < len(reqs) and time.monotonic() < end:
        for r in bq.pop_bootstrapped():
            running.append(r)
        if case == "kill22" and not bq.queue:
            return hang(o, s)
        if case in ("kill22", "freeze22") and bq.queue and not frozen:
            # No forward pass before every request is bootstrapped: one that
            # bootstrapped early (a 5-token request is one chunk) would
            # otherwise be sent whole before prefill stalls or dies.
            time.sleep(0.002)
            continue
        if case == "freeze22" and not bq.queue and not frozen:
            # A forward pass that stalls (the test SIGSTOPs this process),
            # then goes on: every rank waits for the same file, no collective.
            say(f"prefill freeze22 rank {o.rank}: all bootstrapped, stalling in the forward pass")
            publish(os.path.join(o.rendezvous, f"freeze22.prefill{o.rank}"), "")
            wait_file(os.path.join(o.rendezvous, "freeze22.release"), 300)
            frozen = True
            end = time.monotonic() + 180
        for r in list(running):  # one chunk of each running request per forward
            n = len(r.origin_input_ids)
            stop = min(len(r.fill_ids) + CHUNK, n)
            s.forward(r, stop)
            if stop < n:
                before = r.start_send_idx
                s.send_kv_chunk(r)  # process_prefill_chunk: a middle chunk
                sends[r.rid] = sends.get(r.rid, 0) + (r.start_send_idx != before)
                if r.bootstrap_room == aborts(case).get("prefill_mid_chunks"):
                    r.disagg_kv_sender.abort()  # abort_request: AbortReq on every TP rank
                continue
            # process_batch_result_disagg_prefill: the sampled token, then the last chunk
            r.output_ids = [first_token(r.bootstrap_room)]
            r.cached_tokens = cached_tokens(r.bootstrap_room)
            s.disagg_prefill_inflight_queue.append(r)
            s.send_kv_chunk(r, last_chunk=True)
            sends[r.rid] = sends.get(r.rid, 0) + 1
            running.remove(r)
        for r in s.process_disagg_prefill_inflight_queue():
            done[r.rid] = r.finished_reason
        for rid, why in s.streamed:
            if failed(why):
                done.setdefault(rid, why)
        time.sleep(0.002)
    ok = True
    for r in reqs:
        why = done.get(r.rid, "stuck")
        good = why != "stuck" and failed(why) != expect_success(case, r.bootstrap_room)
        got = r.time_stats.metric_bytes
        if good and not failed(why):  # sglang's count: pages sent x item bytes; 0 if asked none
            # prefix11: only the pages after decode's cached prefix are sent
            n = len(r.origin_input_ids)
            pages = -(-n // PAGE) - prefix_len(case, n) // PAGE
            full = pages * sum(s.pool.get_contiguous_buf_infos()[2])
            # hybrid: + the state. Fan-out (decode TP > prefill TP): MLA's latent counted
            # once per decode rank (sglang's replica factor), MHA's head slices once.
            copies = CASES[case][2][0] // tp if fan and s.mla else 1
            good &= got == full * copies or (s.mla and got == 0) or (s.hybrid and got >= full)
        ok &= good
        msg = getattr(why, "message", why)
        say(f"prefill {case} rank {o.rank}| room {r.bootstrap_room}: {type(why).__name__} "
            f"{msg + ', ' if failed(why) else ''}{len(r.origin_input_ids)} tokens in "
            f"{sends.get(r.rid, 0)} send()s, sglang's metric {got} bytes"
            f"{'' if good else '  <-- unexpected'}")
    leaks = (POOL_PAGES - len(s.token_to_kv_pool_allocator.free_pages),
             MD_SLOTS - s.req_to_metadata_buffer_idx_allocator.available_size())
    ok &= leaks == (0, 0) and state_leaks(s) == (0, 0)
    multi = sum(1 for v in sends.values() if v > 1)
    if all(expect_success(case, r.bootstrap_room) for r in reqs):  # every request longer
        # than a chunk was chunked
        ok &= multi == sum(1 for r in reqs if len(r.origin_input_ids) > CHUNK)
    say(f"prefill {case} rank {o.rank}: {multi} requests chunked, pages/metadata slots "
        f"still held {leaks}, as expected: {ok}")
    wait_file(os.path.join(o.rendezvous, f"{case}.done"))
    bq.kv_manager.close()
    dist.barrier(group=world_group)
    return ok


# ----------------------------------------------------------------- decode


def decode_case(o, case, groups, world_group):
    lay = layout(case, "decode", o.rank)
    path = os.path.join(o.rendezvous, f"{case}.bootstrap")
    wait_file(path)
    host, port = open(path).read().strip().rsplit(":", 1)
    port = int(port)
    if lay is None:
        dist.barrier(group=world_group)
        return True
    tp, dp, tp_rank, dp_rank, _ = lay
    set_rank(attn_tp_size=tp, attn_tp_rank=tp_rank, attn_dp_size=dp, attn_dp_rank=dp_rank)
    group = groups[tuple(range(dp_rank * tp, dp_rank * tp + tp))]
    saved = dict(os.environ)
    if case in ("freeze22", "kill22"):  # read when the manager (and its engine) is made
        # sglang's heartbeat at its minimum
        os.environ.update(SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL="2",
                          SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE="2")
    if case == "freeze22":
        # The bootstrap server (its own process) keeps answering sglang's
        # heartbeat while the prefill schedulers are frozen: sglang's waiting
        # timeout fails the requests. kvwire would notice a silent peer in
        # 2 s: its timers longer, so that the verdict is sglang's.
        os.environ.update(SGLANG_DISAGGREGATION_WAITING_TIMEOUT=str(FREEZE_WAITING_S),
                          KVW_PEER_TIMEOUT_MS="30000", KVW_IDLE_HEARTBEAT_MS="30000")
    s = DecodeSched(o, lay, port, group, groups[(o.rank,)], case in HYBRID,
                    PREFIX_TOKENS.get(case, 0))
    os.environ.clear()
    os.environ.update(saved)
    pq, tq = s.prealloc_queue, s.transfer_queue
    reqs = [FakeReq(room, n, host, port) for room, n in requests(case)
            if decode_dp(room, dp) == dp_rank]
    ab = aborts(case)
    if "decode_prealloc_queue" in ab:
        reqs.append(FakeReq(ab["decode_prealloc_queue"], 9, host, port))
    for r in reqs:
        pq.add(r)
        if r.bootstrap_room == ab.get("decode_prealloc_queue"):
            pq.queue[-1].kv_receiver.abort()  # abort_request on the prealloc queue
    if case in ("freeze22", "kill22"):
        return decode_lost(o, case, s, reqs, world_group)
    out, wrong_total = {}, 0
    end = time.monotonic() + 180
    while (pq.queue or tq.queue) and time.monotonic() < end:
        pre, _failed = pq.pop_preallocated()
        for d in pre:
            if d.req.bootstrap_room == ab.get("decode_transfer_queue"):
                d.kv_receiver.abort()  # abort_request on the transfer queue
        tq.extend(pre)
        for r in tq.pop_transferred():  # Success: every byte, then free as decode would
            wrong = verify(s, r, prefill_dp(r.bootstrap_room, CASES[case][1][1]))
            wrong_total += wrong
            out[r.rid] = f"Success, {wrong} bytes wrong"
            s.tree_cache.cache_finished_req(r)
        time.sleep(0.002)
    for rid, why in s.streamed:
        if failed(why):
            out.setdefault(rid, f"Failed: {why.message}")
    ok = wrong_total == 0
    if case in PREFIX_TOKENS:  # every request longer than the prefix matched it
        hits = sum(1 for r in reqs if prefix_len(case, len(r.origin_input_ids)))
        ok &= s.tree_cache.prefix_hits == hits > 0
        say(f"decode {case} rank {o.rank}: {s.tree_cache.prefix_hits} of {len(reqs)} requests "
            f"matched a cached prefix of {PREFIX_TOKENS[case]} tokens")
    for r in reqs:
        got = out.get(r.rid, "stuck")
        good = got.startswith("Success" if expect_success(case, r.bootstrap_room) else "Failed")
        if case in REFUSALS:  # refused at once, naming both TP sizes
            good &= REFUSALS[case] in got
        ok &= good
        say(f"decode {case} rank {o.rank}| room {r.bootstrap_room}: {got}"
            f"{'' if good else '  <-- unexpected'}")
    leaks = (POOL_PAGES - len(s.allocator.free_pages), MD_SLOTS - s.md_alloc.available_size(),
             MD_SLOTS * 2 - s.req_to_token_pool.available_size())
    ok &= leaks == (0, 0, 0) and state_leaks(s) == (0, 0)
    if s.hybrid and case not in REFUSALS:  # every request's state was there to check
        ok &= s.state_checked > 0 and len(out) == len(reqs)
        say(f"decode {case} rank {o.rank}: {s.state_checked} state bytes checked (SWA window, "
            f"Mamba slot), SWA pages/Mamba slots still held {state_leaks(s)}")
    say(f"decode {case} rank {o.rank}: {wrong_total} bytes wrong, pages/metadata slots/req "
        f"slots still held {leaks}, as expected: {ok}")
    s.prealloc_queue.kv_manager.close()
    dist.barrier(group=world_group)
    if o.rank == 0:
        publish(os.path.join(o.rendezvous, f"{case}.done"), "")
    return ok


def hang(o, s):
    """kill22 on prefill: every request bootstrapped, then the forward pass
    never returns (the test SIGKILLs this process)."""
    say(f"prefill kill22 rank {o.rank}: all bootstrapped, hanging in the forward pass")
    publish(os.path.join(o.rendezvous, f"kill22.prefill{o.rank}"), "")
    while True:
        time.sleep(1)


def decode_lost(o, case, s, reqs, world_group):
    """freeze22 / kill22 on decode: wait until every request is in the
    transfer queue (send_metadata done), tell the test (CASE.ready), which
    SIGSTOPs / SIGKILLs every prefill rank (CASE.stopped); then sglang's
    transfer queue must fail them all within sglang's heartbeat bound + 10 s
    of slack for a TCG guest: kill22 by the heartbeat or kvwire's own peer
    loss, whichever comes first; freeze22 by the heartbeat (its reason),
    where each GET to the frozen bootstrap server also waits out sglang's
    (2 s connect, 3 s read) timeouts."""
    pq, tq = s.prealloc_queue, s.transfer_queue
    end = time.monotonic() + 180
    while pq.queue and time.monotonic() < end:
        pre, _ = pq.pop_preallocated()
        tq.extend(pre)
        tq.pop_transferred()
        time.sleep(0.01)
    dist.barrier(group=world_group)
    if o.rank == 0:
        publish(os.path.join(o.rendezvous, f"{case}.ready"), "")
    wait_file(os.path.join(o.rendezvous, f"{case}.stopped"))
    t0 = time.monotonic()
    while tq.queue and time.monotonic() - t0 < 180:
        assert not tq.pop_transferred(), f"a request succeeded with prefill stopped ({case})"
        time.sleep(0.02)
    took = time.monotonic() - t0
    mgr = pq.kv_manager
    if case == "freeze22":
        # sglang's waiting timeout (from send_metadata, before the freeze)
        # aborts kvwire's receivers, and the pages are released only once
        # their abort barrier has passed: a frozen prefill never confirms,
        # so the connection is declared dead after kvwire's peer timeout
        # (30 s for this case, read by the engine); + 10 s of slack
        bound = mgr.waiting_timeout + mgr.peer_timeout_ms / 1000 + 10
        limit = f"waiting timeout {mgr.waiting_timeout:g} s + kvwire's peer timeout"
    else:  # the whole prefill server is gone: sglang's heartbeat or kvwire's peer loss
        bound = mgr.heartbeat_interval * mgr.max_failures + 10
        limit = f"heartbeat {mgr.heartbeat_interval:g} s x {mgr.max_failures}"
    whys = [why.message for _, why in s.streamed if failed(why)]
    leaks = (POOL_PAGES - len(s.allocator.free_pages), MD_SLOTS - s.md_alloc.available_size())
    ok = not tq.queue and len(whys) == len(reqs) and took < bound and leaks == (0, 0)
    # sglang's waiting timeout / heartbeat on this rank, or the all-reduce
    # from a rank whose verdict came first
    hb = sum("Lost connection with prefill instance" in w for w in whys)
    timed_out = sum("timed out after" in w for w in whys)
    if case == "freeze22":
        ok &= hb == 0 and all("timed out after" in w or "failed on another rank" in w
                              for w in whys)
    what = "killed" if case == "kill22" else "stopped"
    say(f"decode {case} rank {o.rank}: {hb} by this rank's heartbeat, {timed_out} by its "
        "waiting timeout, the rest by the all-reduce or kvwire")
    say(f"decode {case} rank {o.rank}: {len(whys)}/{len(reqs)} requests Failed {took:.1f} s "
        f"after prefill was {what} (bound {bound:.0f} s: {limit}), pages/metadata slots "
        f"still held {leaks}; first reason: {whys[0] if whys else '-'}")
    say(f"decode {case} rank {o.rank}: as expected: {ok}")
    if case == "freeze22":  # the test resumes prefill (before close: acks of the aborts)
        dist.barrier(group=world_group)
        if o.rank == 0:
            publish(os.path.join(o.rendezvous, "freeze22.failed"), "")
    mgr.close()
    # freeze22: prefill then ends its requests and its case
    dist.barrier(group=world_group)
    if o.rank == 0:
        publish(os.path.join(o.rendezvous, f"{case}.done"), "")
    return ok


def state_leaks(s):
    """A hybrid model's SWA pages and Mamba slots still held (0, 0 if none)."""
    if not s.hybrid:
        return 0, 0
    alloc = getattr(s, "allocator", None) or s.token_to_kv_pool_allocator
    return POOL_PAGES - len(alloc.swa_free), MAMBA_SLOTS - 1 - len(s.req_to_token_pool.mamba.free_list)


def verify(s, req, dp_rank):
    """Every byte of the request's KV in decode's pool, the first token and
    cached-token count from the metadata buffers, and the bootstrap_room
    sglang's transfer queue read for it."""
    n = len(req.origin_input_ids)
    locs = s.req_to_token_pool.req_to_token[req.req_pool_idx, :n].numpy()
    wrong = 0
    for b, buf in zip(s.pool.buf_ids, s.pool.bufs):
        want = kv_content(req.bootstrap_room, dp_rank, b, n, s.mla, s.heads)
        wrong += int((buf[locs] != want).sum())
    room = req.bootstrap_room
    if s.hybrid:  # the SWA window's tokens in decode's SWA pages, the Mamba slot
        w0 = swa_window_start(n)
        swa = s.allocator.translate_loc_from_full_to_swa(locs[w0:]).numpy()
        for b, buf in enumerate(s.pool.swa_bufs):
            want = swa_content(room, dp_rank, b, n, s.heads)[w0:]
            wrong += int((buf[swa] != want).sum())
        slot = int(s.req_to_token_pool.req_index_to_mamba_index_mapping[req.req_pool_idx])
        for j, buf in enumerate(s.pool.mamba_bufs):
            wrong += int((buf[slot] != mamba_content(room, dp_rank, j)).sum())
        s.state_checked += (n - w0) * len(s.pool.swa_bufs) * s.pool.token_bytes + \
            sum(MAMBA_ITEMS)
    wrong += int(req.finished_reason is not None)
    wrong += int(req.output_ids != [first_token(room)])
    wrong += int(req.cached_tokens != cached_tokens(room))
    wrong += int(room not in [x for v in s.md.rooms_read.values() for x in v])
    return wrong


# ------------------------------------------------------------------ common


def free_port(ip):
    import socket

    with socket.socket() as sk:
        sk.bind((ip, 0))
        return sk.getsockname()[1]


def wait_file(path, secs=240):
    end = time.monotonic() + secs
    while not os.path.exists(path):
        if time.monotonic() > end:
            raise TimeoutError(f"no {os.path.basename(path)}")
        time.sleep(0.05)


def publish(path, text):
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.rename(path + ".tmp", path)


def run_rank(o):
    """One rank's scheduler: a gloo world per side (its ranks), every case
    in turn."""
    dist.init_process_group("gloo", init_method=f"file://{o.rendezvous}/{o.role}.gloo",
                            rank=o.rank, world_size=o.world)
    world = dist.new_group(list(range(o.world)))
    # every rank creates every group, in the same order; a rank's own single
    # group is its attention-CP group (cp 1) and, with DP attention, its TP group
    singles = [dist.new_group([r]) for r in range(o.world)]
    groups = {(r,): g for r, g in enumerate(singles)}
    groups[tuple(range(o.world))] = world
    ok = True
    t0 = time.monotonic()
    for c in o.cases.split(","):
        run = prefill_case if o.role == "prefill" else decode_case
        ok &= run(o, c, groups, world)
    say(f"{o.role} rank {o.rank}: all cases done in {time.monotonic() - t0:.1f} s, ok: {ok}")
    dist.destroy_process_group()
    return 0 if ok else 1


def bootstrap_main(o):
    """sglang's bootstrap server in a process of its own, as sglang runs it
    (in the HTTP server's process): one server per case, on prefill's
    address, published as CASE.bootstrap, closed once decode published
    CASE.done. kill22 (last) ends with the test SIGKILLing it beside the
    prefill ranks (the whole prefill server gone)."""
    for case in o.cases.split(","):
        port = free_port(o.ip)
        server = get_kv_class(BACKEND, KVClassType.BOOTSTRAP_SERVER)(host=o.ip, port=port)
        publish(os.path.join(o.rendezvous, f"{case}.bootstrap"), f"{o.ip}:{port}")
        say(f"bootstrap {case}: sglang's bootstrap server on {o.ip}:{port}")
        wait_file(os.path.join(o.rendezvous, f"{case}.done"), 900)
        server.close()
    return 0


def child_main(role, rank, o):
    """A process of the launcher's (started with multiprocessing's spawn,
    as sglang starts its schedulers: it imported this module afresh, so
    install() ran here as the plugin runs it in a spawned scheduler): its
    log in the rendezvous directory, its exit code as run_rank's."""
    code = 1
    try:
        fd = os.open(os.path.join(o.rendezvous, f"{role}{rank}.log"),
                     os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        say(f"{role} rank {rank}: imports took {time.monotonic() - T0:.1f} s (spawned)")
        if role == "bootstrap":
            code = bootstrap_main(o)
        else:
            code = run_rank(argparse.Namespace(role=role, rank=rank, world=o.world, ip=o.ip,
                                               dev=o.dev, rendezvous=o.rendezvous,
                                               cases=o.cases))
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def launch(o):
    """Start one process per rank and side, and sglang's bootstrap server's
    own, with multiprocessing's spawn (sglang's start method: each imports
    this module, hence sglang and kvwire, afresh). Each rank writes ROLE
    RANK.log and, once ended, ROLE RANK.rc in the rendezvous directory; pids
    lists them (the test SIGSTOPs / SIGKILLs prefill's, and the bootstrap
    server's for kill22)."""
    import multiprocessing as mp
    from multiprocessing.connection import wait as mp_wait

    say(f"launcher: imports took {time.monotonic() - T0:.1f} s")
    ctx = mp.get_context("spawn")
    ranks = [("bootstrap", 0, o.ip0, o.dev0)]
    ranks += [("prefill", r, o.ip0, o.dev0) for r in range(o.world)]
    ranks += [("decode", r, o.ip1, o.dev1) for r in range(o.world)]
    procs = {}
    for role, r, ip, dev in ranks:
        # read by the child's imports and its managers (the environment is inherited)
        os.environ.update(KVWIRE_LOCAL_IP=ip, SGLANG_HOST_IP=ip)
        args = argparse.Namespace(world=o.world, ip=ip, dev=dev, rendezvous=o.rendezvous,
                                  cases=o.cases)
        p = ctx.Process(target=child_main, args=(role, r, args), name=f"{role}{r}")
        p.start()
        procs[p.sentinel] = (p, role, r)
    publish(os.path.join(o.rendezvous, "pids"),
            "".join(f"{role} {r} {p.pid}\n" for p, role, r in procs.values()))
    while procs:
        if all(role == "bootstrap" for _, role, _ in procs.values()):
            for p, _, _ in procs.values():  # every rank ended: its cases too
                p.terminate()
        for sentinel in mp_wait(list(procs)):
            p, role, r = procs.pop(sentinel)
            p.join()
            publish(os.path.join(o.rendezvous, f"{role}{r}.rc"), str(p.exitcode))
            say(f"launcher: {role} rank {r} ended ({p.exitcode}) "
                f"{time.monotonic() - T0:.1f} s after start")
    return 0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--ip0", required=True, help="prefill's RDMA address")
    ap.add_argument("--dev0")
    ap.add_argument("--ip1", required=True, help="decode's RDMA address")
    ap.add_argument("--dev1")
    ap.add_argument("--rendezvous", required=True)
    ap.add_argument("--cases", default=",".join(CASES))
    sys.exit(launch(ap.parse_args()))


if __name__ == "__main__":
    main()
