# SPDX-License-Identifier: Apache-2.0
"""Layouts kvwire's sglang backend serves beyond equal TP, all ranks in one
process, on the fake NIC (libkvwire built with tests/support/fake_nic.c:
`make python-fake-nic`, loaded as KVWIRE_LIB; the fake NIC is
process-wide; run by test_sglang_fake_nic.py) or on the test bed's rxe
devices (KVW_TB_DEV0/IP0 prefill, KVW_TB_DEV1/IP1 decode; run by
guest/test_sglang_layouts_on_rxe.py), one scenario per process. Prints one
JSON line.

    KVWIRE_LIB=build/test/libkvwire-fakenic.so \\
        python3 sglang_fake_nic_layouts.py \
            prefix|pp21|pp22|pp21_tp_mismatch|mla12_noflag|mha12_noflag|tp21|tp12|
            hybrid12_noflag|hybrid12_noflag_whole

Real: sglang's CommonKVManager / Sender / Receiver / BootstrapServer from
the pinned snapshot under kvwire's classes (get_kv_class), its rank
mapping (try_ensure_parallel_info: target_pp_ranks, bootstrap_infos) and
kvwire's engines. Stand-ins: the rest of sglang (sglang_stubs), the KV pool
(numpy pages, MHA: K layers then V layers, one page per item), and the
scheduler: the calls below are those of sglang's queues in their order
(prefill: PrefillBootstrapQueue.pop_bootstrapped's poll, then
pop_decode_prefix_len and init with the page count it computes, then
send_kv_chunk's send per chunk from req.start_send_idx; decode:
DecodePreallocQueue's init and send_metadata with the delta pages and
decode_prefix_len as pop_preallocated computes them, then
DecodeTransferQueue's poll).

Scenarios:
  prefix  decode prefix reuse: decode holds the request's first 2 of 6 pages
          (decode_prefix_len = 2 pages of tokens) and asks for the other 4;
          prefill hands over all 6 in 2 chunks; decode's 4 pages get the
          last 4 of prefill's, its 2 prefix pages are never written;
  pp21    prefill PP 2 (stage 0: layers 0-1, stage 1: layers 2-3), decode
          PP 1 (layers 0-3): decode gathers both stages, the aux item
          (metadata) from the last stage only;
  pp22    prefill PP 2 -> decode PP 2: stage to stage;
  pp21_tp_mismatch  prefill PP 2 with attn TP 1 -> decode PP 1 with attn
          TP 2 is refused on decode, the reason naming the sizes;
  mla12_noflag  MLA, prefill TP 1 not told decode's TP (no
          --disaggregation-decode-tp), decode TP 2: each decode rank's
          kvwire request says 2 decode ranks ask (sglang's
          required_dst_info_num), the prefill rank's sender learns it and
          serves the latent whole to both, each its own metadata;
  mha12_noflag  the same for MHA: prefill TP 1 holds the model's 4 KV
          heads, each decode rank of TP 2 gets its 2 (gathered from
          prefill's pages);
  tp21    MHA (4 KV heads of 128 B), prefill attn TP 2 -> decode attn TP 1;
  tp12    MHA, prefill attn TP 1 -> decode attn TP 2 (prefill told decode's
          TP, --disaggregation-decode-tp 2): decode's KV args carry no head
          count, as sglang's: each decode rank learns its heads from
          prefill's handshake, and the model's config is never loaded
          (sglang_stubs' ModelConfig counts and refuses a load); every head
          of every page checked against the prefill rank holding it.
  hybrid12_noflag  a hybrid MHA model (4 KV heads and a Mamba state group,
          one slot per request, each rank 1/TP of a slot as sglang's),
          prefill TP 1 without --disaggregation-decode-tp, decode TP 2:
          refused per room (kvwire has no slicing of state items): both
          decode ranks Failed at init, the reason naming both TP sizes and
          the state slicing; kvwire's handshake refuses the state item
          lengths too, so prefill hears nothing and its sender fails by
          sglang's bootstrap timeout (2 s here); decode's pages, Mamba slots
          and aux (a canary) never change; then a room from a prefill of TP
          2 (its own bootstrap server) lands in them whole;
  hybrid12_noflag_whole  the same with state items of one length on both
          sides: the handshake passes, decode's refused receivers ask
          prefill for nothing, and prefill's sender fails at its init.
"""
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))  # python/
import ctypes  # noqa: E402

import numpy as np  # noqa: E402

import sglang_ref  # noqa: E402

SCENARIO = sys.argv[1]
# The fake NIC (host, make python-test) or the test bed's rxe devices
# (guest/test_sglang_layouts_on_rxe.py: KVW_TB_DEV0/IP0 for prefill,
# KVW_TB_DEV1/IP1 for decode).
FAKE = "KVW_TB_DEV0" not in os.environ
if FAKE:
    DEV_P, IP_P, DEV_D, IP_D = "fake0", "127.0.0.1", "fake1", "127.0.0.1"
else:
    DEV_P, IP_P = os.environ["KVW_TB_DEV0"], os.environ["KVW_TB_IP0"]
    DEV_D = os.environ.get("KVW_TB_DEV1", DEV_P)
    IP_D = os.environ.get("KVW_TB_IP1", IP_P)
sglang_ref.enter()
nic = ctypes.CDLL(os.environ["KVWIRE_LIB"]) if FAKE else None
import kvwire.sglang as ks  # noqa: E402

ks.install("kvwire")
from sglang.srt.disaggregation.base.conn import KVPoll  # noqa: E402
from sglang.srt.disaggregation.utils import (DisaggregationMode, KVClassType,  # noqa: E402
                                             TransferBackend, get_kv_class)
from sglang.srt.runtime_context import set_rank  # noqa: E402
from sglang.srt.server_args import ServerArgs  # noqa: E402

B = TransferBackend("kvwire")
KVArgs, Manager, Sender, Receiver, Server = (get_kv_class(B, k) for k in (
    KVClassType.KVARGS, KVClassType.MANAGER, KVClassType.SENDER, KVClassType.RECEIVER,
    KVClassType.BOOTSTRAP_SERVER))
POOL, ITEM, LAYERS, AUX_SLOTS, ROOM = 16, 256, 4, 4, 11
HEADS, PAGE = 2, 1  # KV heads per rank, tokens per page
# Mamba: request slots; conv and ssm bytes per slot of the whole model
STATE_SLOTS, STATE_ITEMS = 4, (96, 160)
P, D = DisaggregationMode.PREFILL, DisaggregationMode.DECODE


def free_port():
    import socket

    with socket.socket() as s:
        s.bind((IP_P, 0))
        return s.getsockname()[1]


def mk_state(item, fill, rng):
    n = STATE_SLOTS * item
    return rng.integers(1, 256, n, dtype=np.uint8) if fill else np.zeros(n, dtype=np.uint8)


class Rank:
    """One rank's KV pool (K layers then V layers over `layers`) and aux."""

    def __init__(self, mode, layers, fill, pp_size=1, pp_rank=0, attn_tp=1, port=0,
                 tp_rank=0, mla=False, heads=HEADS, item=None, decode_tp=None, state=None):
        self.layers = list(layers)
        # bytes of a page (a token) of one layer: heads of HEAD_B bytes unless given
        self.item = item or ITEM // HEADS * heads
        rng = np.random.default_rng(100 + pp_rank + 10 * tp_rank)
        mk = (lambda: rng.integers(1, 256, POOL * self.item, dtype=np.uint8)) if fill else (
            lambda: np.zeros(POOL * self.item, dtype=np.uint8))
        self.k = [mk() for _ in self.layers]
        self.v = [mk() for _ in self.layers]
        self.aux = [np.zeros(AUX_SLOTS, dtype=np.int64)]
        kv = self.k if mla else self.k + self.v
        a = KVArgs()
        a.engine_rank, a.gpu_id, a.page_size, a.system_dp_rank = 0, 0, PAGE, 0
        a.pp_rank, a.prefill_start_layer = pp_rank, self.layers[0]
        a.engine_rank = tp_rank
        a.kv_data_ptrs, a.kv_data_lens = [x.ctypes.data for x in kv], [x.nbytes for x in kv]
        a.kv_item_lens = [self.item] * len(kv)
        if mode == P and not mla:  # decode's KV args carry no head count (sglang's)
            a.kv_head_num, a.total_kv_head_num = heads, heads * attn_tp
        a.aux_data_ptrs = [x.ctypes.data for x in self.aux]
        a.aux_data_lens = [x.nbytes for x in self.aux]
        a.aux_item_lens = [x.nbytes // AUX_SLOTS for x in self.aux]
        a.state_types, a.state_data_ptrs, a.state_data_lens, a.state_item_lens = [], [], [], []
        # a hybrid model's Mamba state: conv and ssm buffers, one slot per
        # request, sglang's StateType.MAMBA its own kvwire state group;
        # state="split": 1/TP of each item on each rank (sglang's), "whole":
        # each rank the whole item
        items = [n // attn_tp if state == "split" else n for n in STATE_ITEMS]
        self.state = [mk_state(n, fill, rng) for n in items] if state else []
        if state:
            from sglang.srt.disaggregation.base.conn import StateType

            a.state_types = [StateType.MAMBA]
            a.state_data_ptrs = [[x.ctypes.data for x in self.state]]
            a.state_data_lens = [[x.nbytes for x in self.state]]
            a.state_item_lens = [items]
        a.ib_device = DEV_P if mode == P else DEV_D
        # each side's address on the RDMA network (read at manager creation)
        os.environ["KVWIRE_LOCAL_IP"] = IP_P if mode == P else IP_D
        set_rank(attn_tp_size=attn_tp, attn_tp_rank=tp_rank)
        sa = ServerArgs(host=IP_P, port=30000, disaggregation_bootstrap_port=port,
                        disaggregation_transfer_backend="kvwire", tp_size=attn_tp, dp_size=1,
                        pp_size=pp_size, disaggregation_decode_tp=decode_tp)
        self.mgr = Manager(a, mode, sa, mla)

    def page(self, kind, layer, pg):
        buf = (self.k if kind == "k" else self.v)[self.layers.index(layer)]
        return buf[pg * self.item:(pg + 1) * self.item]


def wait(cond, secs, what):
    end = time.monotonic() + secs
    while not cond():
        if time.monotonic() > end:
            raise TimeoutError(what)
        time.sleep(0.001)


def wait_end(xs, secs, what):
    """Poll sglang's senders or receivers until each is Success or Failed."""
    wait(lambda: all(x.poll() in (KVPoll.Success, KVPoll.Failed) for x in xs), secs, what)
    return [int(x.poll()) for x in xs]


def failure_reason(x):
    """What sglang's failure_exception() raises for a Failed sender or receiver."""
    try:
        x.failure_exception()
    except Exception as e:
        return str(e)
    return ""


def end_room(out, recvs, senders):
    """Decode's receivers polled until each ended (up to 20 s; their polls
    recorded either way), then prefill's senders; the reasons of the
    receivers that failed."""
    end = time.monotonic() + 20
    polls = [int(r.poll()) for r in recvs]
    while any(p not in (KVPoll.Success, KVPoll.Failed) for p in polls):
        if time.monotonic() > end:
            break
        time.sleep(0.002)
        polls = [int(r.poll()) for r in recvs]
    out["decode_polls"] = polls
    out["prefill_end"] = wait_end(senders, 20, "prefill ended")
    out["reasons"] = [failure_reason(r) for r, p in zip(recvs, polls) if p == KVPoll.Failed]


def pp_layers(pp_size, rank):
    per = LAYERS // pp_size
    return range(rank * per, LAYERS if rank == pp_size - 1 else (rank + 1) * per)


def run_fanout_noflag(out, port, addr, mla):
    """Prefill TP 1 without --disaggregation-decode-tp, decode TP 2: both
    decode ranks ask the one prefill rank for the room, each request saying
    2 decode ranks ask; the prefill rank's sender learns it and serves both
    (MLA: the latent whole to each; MHA: each decode rank its 2 of the 4
    heads), each its own metadata. Every byte checked on both."""
    npages = 2
    pre = Rank(P, range(LAYERS), True, port=port, mla=mla, heads=2 * HEADS, item=ITEM)
    dec = [Rank(D, range(LAYERS), False, attn_tp=2, tp_rank=t, mla=mla,
                item=ITEM if mla else ITEM // 2) for t in range(2)]
    try:
        pre.aux[0][2] = 1000  # the metadata prefill sends (aux item 2)
        s = Sender(mgr=pre.mgr, bootstrap_addr=addr, bootstrap_room=ROOM, dest_tp_ranks=[0],
                   pp_rank=0)
        out["prefill_decode_receivers"] = pre.mgr.decode_receivers  # None: learned per room
        recvs = [Receiver(mgr=d.mgr, bootstrap_addr=addr, bootstrap_room=ROOM) for d in dec]
        for d in dec:
            wait(lambda: d.mgr.try_ensure_parallel_info(addr), 20, "parallel info")
        dst_pages, src_pages = np.array([1, 2]), np.array([3, 4])
        for r in recvs:
            r.init(0)
            r.send_metadata(dst_pages.astype(np.int64), 1)
        wait(lambda: s.poll() == KVPoll.WaitingForInput, 20, "prefill WaitingForInput")
        s.init(npages, 2)
        s.send(src_pages.astype(np.int64))
        end_room(out, recvs, [s])
        # each decode rank's every page: MLA prefill's whole item, MHA the
        # slice of its heads (NHD, one token a page: heads contiguous)
        bad, checked = 0, 0
        for t, d in enumerate(dec):
            for layer in d.layers:
                for kind in (("k",) if mla else ("k", "v")):
                    for j in range(npages):
                        got = d.page(kind, layer, int(dst_pages[j]))
                        want = pre.page(kind, layer, int(src_pages[j]))
                        if not mla:
                            want = want[t * d.item:(t + 1) * d.item]
                        bad += int((got != want).sum())
                        checked += got.size
        out["bytes_checked"], out["bytes_wrong"] = checked, bad
        out["decode_aux"] = [int(d.aux[0][1]) for d in dec]
        for x in recvs + [s]:
            x.clear()
    finally:
        for r in [pre] + dec:
            r.mgr.close()


def run_tp(out, port, addr, ptp, dtp):
    """MHA, 4 KV heads, prefill attn TP ptp -> decode attn TP dtp: decode
    learns its heads (its KV args carry none), never loading the model
    config; every head of every page against the prefill rank holding it."""
    from sglang.srt.configs import model_config

    total, head_b, npages = 4, ITEM // HEADS, 6
    pre = [Rank(P, range(LAYERS), True, attn_tp=ptp, tp_rank=t, port=port, heads=total // ptp,
                decode_tp=dtp if dtp > ptp else None) for t in range(ptp)]
    dec = [Rank(D, range(LAYERS), False, attn_tp=dtp, tp_rank=t, heads=total // dtp)
           for t in range(dtp)]
    try:
        for t, r in enumerate(pre):
            r.aux[0][2] = 1000 + t
        senders = [Sender(mgr=r.mgr, bootstrap_addr=addr, bootstrap_room=ROOM, dest_tp_ranks=[0],
                          pp_rank=0) for r in pre]
        recvs = [Receiver(mgr=r.mgr, bootstrap_addr=addr, bootstrap_room=ROOM) for r in dec]
        for r in dec:
            wait(lambda: r.mgr.try_ensure_parallel_info(addr), 20, "parallel info")
        for r in recvs:
            r.init(0)
        for r in recvs:
            wait(lambda: r.poll() == KVPoll.WaitingForInput, 20, "decode WaitingForInput")
        dst_pages = np.array([9, 3, 14, 5, 7, 1], dtype=np.int64)
        src_pages = np.array([2, 4, 6, 8, 10, 12], dtype=np.int64)
        for r in recvs:
            r.send_metadata(dst_pages, 1, None)
        for s in senders:
            wait(lambda: s.poll() == KVPoll.WaitingForInput, 20, "prefill WaitingForInput")
            s.init(npages, 2)
        for s in senders:
            s.send(src_pages[:3])
            s.send(src_pages[3:])
        end_room(out, recvs, senders)
        bad, checked = 0, 0
        for t, d in enumerate(dec):
            hd, hp = total // dtp, total // ptp
            for layer in d.layers:
                for kind in ("k", "v"):
                    for j in range(npages):
                        got = d.page(kind, layer, int(dst_pages[j]))
                        for h in range(t * hd, (t + 1) * hd):  # the model's head h
                            k = h // hp  # the prefill rank holding it
                            want = pre[k].page(kind, layer, int(src_pages[j]))
                            o = (h - k * hp) * head_b
                            g = got[(h - t * hd) * head_b:(h - t * hd + 1) * head_b]
                            bad += int((g != want[o:o + head_b]).sum())
                            checked += g.size
        out["bytes_checked"], out["bytes_wrong"] = checked, bad
        out["decode_aux"] = [int(d.aux[0][1]) for d in dec]
        out["decode_heads"] = [list(d.mgr.heads) for d in dec]
        out["model_config_loads"] = model_config.from_server_args_calls
        for x in recvs + senders:
            x.clear()
    finally:
        for r in pre + dec:
            r.mgr.close()


CANARY, AUX_CANARY = 0xA5, 0x5A5A5A5A5A5A5A5A


def hybrid_decode_bytes(dec):
    """Each decode rank's KV pages, Mamba slots and aux, as bytes."""
    return [[bytes(b) for b in d.k + d.v + d.state + d.aux] for d in dec]


def run_hybrid_noflag(out, port, addr, state):
    """Hybrid MHA (4 KV heads and a Mamba state group), prefill attn TP 1
    without --disaggregation-decode-tp, decode attn TP 2: kvwire cannot
    slice state items across TP sizes, so each decode rank refuses the room
    at init. state "whole" (state items of one length on both sides): the
    refused receivers ask prefill for nothing, and prefill's sender, which
    learns the room's decode ranks from their requests, fails at its init.
    state "split" (sglang's: each rank 1/TP of the item): kvwire's
    handshake refuses the item lengths too, the request never reaches
    prefill, whose sender fails by sglang's bootstrap timeout (2 s here).
    Decode's pages, state slots and aux hold a canary that must survive.
    Then a room from a prefill of attn TP 2 (equal sizes, its own bootstrap
    server) lands in the same pages and slot of the same decode ranks."""
    npages, slot = 2, 1
    dst_pages, src_pages = np.array([1, 2], dtype=np.int64), np.array([3, 4], dtype=np.int64)
    timeout_var = "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT"  # read by pre's manager only
    saved = os.environ.get(timeout_var)
    os.environ[timeout_var] = "2"
    pre = Rank(P, range(LAYERS), True, port=port, heads=2 * HEADS, item=ITEM, state=state)
    if saved is None:
        del os.environ[timeout_var]
    else:
        os.environ[timeout_var] = saved
    dec = [Rank(D, range(LAYERS), False, attn_tp=2, tp_rank=t, item=ITEM // 2, state=state)
           for t in range(2)]
    ranks, servers = [pre] + dec, []
    try:
        pre.aux[0][2] = 1000
        for d in dec:
            for b in d.k + d.v + d.state:
                b[:] = CANARY
            d.aux[0][:] = AUX_CANARY
        canary = hybrid_decode_bytes(dec)
        s = Sender(mgr=pre.mgr, bootstrap_addr=addr, bootstrap_room=ROOM, dest_tp_ranks=[0],
                   pp_rank=0)
        out["prefill_decode_receivers"] = pre.mgr.decode_receivers
        recvs = [Receiver(mgr=d.mgr, bootstrap_addr=addr, bootstrap_room=ROOM) for d in dec]
        for d in dec:
            wait(lambda: d.mgr.try_ensure_parallel_info(addr), 20, "parallel info")
        t0 = time.monotonic()
        for r in recvs:  # DecodePreallocQueue: init, then polled until not Bootstrapping
            r.init(0)
        wait(lambda: all(r.poll() != KVPoll.Bootstrapping for r in recvs), 20, "decode init")
        out["decode_polls"], out["reasons"] = [int(r.poll()) for r in recvs], []
        for r in recvs:
            if r.poll() == KVPoll.Failed:  # sglang asks why, then frees the pages
                out["reasons"].append(failure_reason(r))
            else:  # served after all: hand over the pages, as sglang would
                r.send_metadata(dst_pages, 1, [[np.array([slot])]])
        # PrefillBootstrapQueue: polled until not Bootstrapping; WaitingForInput:
        # init, then send_kv_chunk's send and the inflight queue's polls
        wait(lambda: s.poll() != KVPoll.Bootstrapping, 20, "prefill bootstrapped")
        out["prefill_bootstrapped"] = int(s.poll())
        if s.poll() == KVPoll.WaitingForInput:
            s.init(npages, 2)
            s.send(src_pages, [[np.array([slot])]])
        out["prefill_end"] = wait_end([s], 20, "prefill ended")
        out["ms_to_prefill_end"] = round((time.monotonic() - t0) * 1000)  # reported only
        out["prefill_reason"] = failure_reason(s) if out["prefill_end"] == [KVPoll.Failed] else ""
        for x in recvs + [s]:
            x.clear()
        for d in dec:  # the closer thread has destroyed the refused receivers
            d.mgr._closer.drain()
        now = hybrid_decode_bytes(dec)
        out["canary_bytes"] = sum(len(b) for rank in canary for b in rank)
        out["canary_bytes_changed"] = sum(
            sum(x != y for x, y in zip(b0, b1))
            for r0, r1 in zip(canary, now) for b0, b1 in zip(r0, r1))
        hybrid_equal_tp_room(out, dec, ranks, servers, dst_pages, src_pages, slot, state)
    finally:
        for r in ranks:
            r.mgr.close()
        for sv in servers:
            sv.close()


def hybrid_equal_tp_room(out, dec, ranks, servers, dst_pages, src_pages, slot, state):
    """The next room, from a prefill of attn TP 2 (equal sizes) with its own
    bootstrap server, into the same pages and state slot of the same decode
    ranks: each gets its prefill rank's pages, slot and metadata whole."""
    port2 = free_port()
    servers.append(Server(host=IP_P, port=port2))
    addr2 = f"{IP_P}:{port2}"
    pre2 = [Rank(P, range(LAYERS), True, attn_tp=2, tp_rank=t, port=port2, item=ITEM // 2,
                 state=state) for t in range(2)]
    ranks.extend(pre2)
    for t, r in enumerate(pre2):
        r.aux[0][2] = 2000 + t
    senders = [Sender(mgr=r.mgr, bootstrap_addr=addr2, bootstrap_room=ROOM + 1,
                      dest_tp_ranks=[0], pp_rank=0) for r in pre2]
    recvs = [Receiver(mgr=d.mgr, bootstrap_addr=addr2, bootstrap_room=ROOM + 1) for d in dec]
    for d in dec:
        wait(lambda: d.mgr.try_ensure_parallel_info(addr2), 20, "parallel info (TP 2)")
    for r in recvs:
        r.init(0)
    for r in recvs:
        wait(lambda: r.poll() == KVPoll.WaitingForInput, 20, "decode WaitingForInput (TP 2)")
        r.send_metadata(dst_pages, 1, [[np.array([slot])]])
    for s in senders:
        wait(lambda: s.poll() == KVPoll.WaitingForInput, 20, "prefill WaitingForInput (TP 2)")
        s.init(len(src_pages), 2)
        s.send(src_pages, [[np.array([slot + 1])]])
    out["equal_tp_decode_polls"] = wait_end(recvs, 20, "decode ended (TP 2)")
    out["equal_tp_prefill_end"] = wait_end(senders, 20, "prefill ended (TP 2)")
    bad, checked = 0, 0
    for d, p in zip(dec, pre2):
        for layer in d.layers:
            for kind in ("k", "v"):
                for dp, sp in zip(dst_pages, src_pages):
                    got, want = d.page(kind, layer, int(dp)), p.page(kind, layer, int(sp))
                    bad += int((got != want).sum())
                    checked += got.size
        for ds, ps in zip(d.state, p.state):
            n = ds.size // STATE_SLOTS
            got, want = ds[slot * n:(slot + 1) * n], ps[(slot + 1) * n:(slot + 2) * n]
            bad += int((got != want).sum())
            checked += got.size
    out["equal_tp_bytes_checked"], out["equal_tp_bytes_wrong"] = checked, bad
    out["equal_tp_decode_aux"] = [int(d.aux[0][1]) for d in dec]
    for x in recvs + senders:
        x.clear()


def run(out, port, addr):
    if SCENARIO in ("hybrid12_noflag", "hybrid12_noflag_whole"):
        return run_hybrid_noflag(out, port, addr, "whole" if "whole" in SCENARIO else "split")
    if SCENARIO in ("mla12_noflag", "mha12_noflag"):
        return run_fanout_noflag(out, port, addr, SCENARIO == "mla12_noflag")
    if SCENARIO in ("tp21", "tp12"):
        return run_tp(out, port, addr, int(SCENARIO[2]), int(SCENARIO[3]))
    prefix_pages = 2 if SCENARIO == "prefix" else 0
    npages = 6
    pp_p = 1 if SCENARIO == "prefix" else 2
    pp_d = 2 if SCENARIO == "pp22" else 1
    d_tp = 2 if SCENARIO == "pp21_tp_mismatch" else 1
    pre = [Rank(P, pp_layers(pp_p, s), True, pp_p, s, port=port) for s in range(pp_p)]
    dec = [Rank(D, pp_layers(pp_d, s), False, pp_d, s, attn_tp=d_tp) for s in range(pp_d)]
    ranks = pre + dec
    try:
        for s, r in enumerate(pre):  # each stage's metadata: its stage number + 1000
            r.aux[0][2] = 1000 + s
        senders = [Sender(mgr=r.mgr, bootstrap_addr=addr, bootstrap_room=ROOM, dest_tp_ranks=[0],
                          pp_rank=s) for s, r in enumerate(pre)]
        recvs = [Receiver(mgr=r.mgr, bootstrap_addr=addr, bootstrap_room=ROOM) for r in dec]
        for r in dec:
            wait(lambda: r.mgr.try_ensure_parallel_info(addr), 20, "parallel info")
        for r in recvs:
            r.init(0)
        if SCENARIO == "pp21_tp_mismatch":
            out["polls"] = [int(r.poll()) for r in recvs]
            out["reason"] = failure_reason(recvs[0])
            return
        for r in recvs:
            wait(lambda: r.poll() == KVPoll.WaitingForInput, 20, "decode WaitingForInput")
        dst_pages = np.array([9, 3, 14, 5, 7, 1], dtype=np.int64)
        src_pages = np.array([2, 4, 6, 8, 10, 12], dtype=np.int64)
        for r in recvs:  # pop_preallocated: only the pages after decode's prefix
            r.send_metadata(dst_pages[prefix_pages:], 1, None,
                            decode_prefix_len=prefix_pages * PAGE)
        out["popped_prefix_len"] = []
        for s in senders:  # pop_bootstrapped
            wait(lambda: s.poll() == KVPoll.WaitingForInput, 20, "prefill WaitingForInput")
            start = s.pop_decode_prefix_len()
            out["popped_prefix_len"].append(start)
            s.init((npages * PAGE - start + PAGE - 1) // PAGE, 2)
        for s in senders:  # send_kv_chunk from req.start_send_idx, two chunks
            s.send(src_pages[:3])
            s.send(src_pages[3:])
        end_room(out, recvs, senders)
        # every layer's every page on decode, against the prefill stage holding it
        bad, checked = 0, 0
        for d in dec:
            for layer in d.layers:
                src_rank = next(r for r in pre if layer in r.layers)
                for kind in ("k", "v"):
                    for j in range(npages):
                        got = d.page(kind, layer, int(dst_pages[j]))
                        if j < prefix_pages:  # decode's own prefix: never written
                            bad += int((got != 0).sum())
                        else:
                            want = src_rank.page(kind, layer, int(src_pages[j]))
                            bad += int((got != want).sum())
                        checked += got.size
        out["bytes_checked"], out["bytes_wrong"] = checked, bad
        out["decode_aux"] = [int(d.aux[0][1]) for d in dec]
        for x in recvs + senders:
            x.clear()
    finally:
        for r in ranks:
            r.mgr.close()


def main():
    if FAKE:
        assert nic.kvw_test_fake_nic_start(2) == 0
    port = free_port()
    server = Server(host=IP_P, port=port)
    out = {"scenario": SCENARIO, "nic": "fake" if FAKE else f"{DEV_P},{DEV_D}"}
    try:
        run(out, port, f"{IP_P}:{port}")
    finally:
        server.close()
        if FAKE:
            nic.kvw_test_fake_nic_stop()
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
