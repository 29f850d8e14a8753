# SPDX-License-Identifier: Apache-2.0
"""kvwire's sglang backend on sglang's own connection code, in separate
prefill and decode processes on real rxe (run by test_sglang_common.py).

    sglang_common_harness.py prefill|decode --ip IP --dev DEV --rendezvous DIR
                                            --cases tp22,dpattn,... [--kill-test]

Real (the pinned snapshot, never copied): sglang's CommonKVManager,
CommonKVSender, CommonKVReceiver and CommonKVBootstrapServer (HTTP /route,
/register_dp_rank, /query_dp_ranks, /health), its rank mapping
(try_ensure_parallel_info, prefill_info_table), heartbeat, failure records,
TransferBackend and get_kv_class as patched by kvwire.sglang.install().

Stubbed, each because it is not part of the connection code:
  - the rest of sglang (python/tests/sglang_stubs: ServerArgs fields,
    envs defaults, this rank's attention TP/DP rank, network helpers);
  - the model: KV, metadata and state buffers are numpy arrays (host
    memory) with deterministic contents, their addresses as kv_data_ptrs;
  - the scheduler: the loops below call the backend in the order of
    sglang's PrefillBootstrapQueue / inflight queue and DecodePreallocQueue
    / DecodeTransferQueue (pending -> try_ensure_parallel_info -> init,
    poll until WaitingForInput -> init / send_metadata, chunked send(),
    poll until Success/Failed -> failure_exception -> clear), with the
    all-reduce of the polls over a TP group as a minimum in this process
    (every rank of a side lives in one process here);
  - the allocator: a free list of page indices.

Cases (prefill attn TP x DP -> decode attn TP x DP):
  tp22    MHA, 2x1 -> 2x1
  dpattn  MHA, DP attention: 1x2 -> 1x2 (tp 2, attn_tp 1, dp 2 both sides)
  mla21   MLA, 2x1 -> 1x1 (one prefill rank sends, the other finishes empty)
  mha21   MHA, 2x1 -> 1x1: head slicing (4 KV heads: each prefill rank holds
          2, decode 4; decode's one receiver over both prefill ranks)
  hybrid  MHA 2x1 -> 2x1, a hybrid model: Mamba state (one slot per request)
          and an SWA pool (its own page list, the last SWA_PAGES pages of
          the request, shorter than the KV list), each in its own index
          space, and a StateType without buffers (sglang sends None)
Each: 3 rooms that must succeed (chunked: several send() each), one that
prefill aborts mid-prefill, one that decode aborts after send_metadata,
one that decode aborts before init (prefill never sees it). Every KV byte,
the aux items (first token id, bootstrap_room) and the state are checked.
--kill-test: decode waits in Transferring, the test SIGKILLs prefill, and
decode must reach Failed (sglang's heartbeat or kvwire's connection loss).
"""
import argparse
import logging
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # python/tests
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))  # python/
import sglang_ref  # noqa: E402

logging.basicConfig(level=logging.WARNING, format="%(name)s %(levelname)s: %(message)s")
logging.getLogger("kvwire.sglang").setLevel(logging.INFO)
sglang_ref.enter()
import kvwire.sglang as ks  # noqa: E402

ks.install("kvwire")  # not $KVWIRE_SGLANG_BACKEND: this tests the name
from sglang.srt.disaggregation.base.conn import KVPoll, StateType  # noqa: E402
from sglang.srt.disaggregation.utils import (DisaggregationMode, KVClassType,  # noqa: E402
                                             TransferBackend, get_kv_class)
from sglang.srt.runtime_context import set_rank  # noqa: E402
from sglang.srt.server_args import ServerArgs  # noqa: E402

BACKEND = TransferBackend("kvwire")
KVArgs = get_kv_class(BACKEND, KVClassType.KVARGS)
Manager = get_kv_class(BACKEND, KVClassType.MANAGER)
Sender = get_kv_class(BACKEND, KVClassType.SENDER)
Receiver = get_kv_class(BACKEND, KVClassType.RECEIVER)
BootstrapServer = get_kv_class(BACKEND, KVClassType.BOOTSTRAP_SERVER)

CASES = {  # name: (mla, prefill (tp, dp), decode (tp, dp), state)
    "tp22": (False, (2, 1), (2, 1), False),
    "dpattn": (False, (1, 2), (1, 2), False),
    "mla21": (True, (2, 1), (1, 1), False),
    "mha21": (False, (2, 1), (1, 1), False),
    "hybrid": (False, (2, 1), (2, 1), True),
}
POOL, ITEM, PAGE, AUX_SLOTS, LAYERS = 96, 256, 16, 16, 3
# MHA: 4 KV heads of 8 bytes, token-major (NHD) pages: a TP-2 rank's item is
# ITEM (2 heads), a TP-1 rank's twice that. MLA: ITEM on every rank.
MODEL_KV_HEADS, HEAD_BYTES = 4, 8


def kv_heads(case, tp):
    """A rank's KV heads per token (MLA: its one latent "head")."""
    return 1 if CASES[case][0] else MODEL_KV_HEADS // tp


def kv_item(case, tp):
    return ITEM if CASES[case][0] else PAGE * kv_heads(case, tp) * HEAD_BYTES
STATE_SLOTS, STATE_ITEMS = 8, (96, 160)  # Mamba conv and ssm state, per request
SWA_POOL, SWA_PAGES = 24, 3  # the SWA pool's pages; the window's pages per request
CHUNK = 3
BASE = {c: 1000 * (i + 1) for i, c in enumerate(CASES)}


def rooms(case):
    b = BASE[case]
    return {"ok": [b + 1, b + 2, b + 3], "prefill_abort": b + 4, "decode_abort": b + 5,
            "abort_before_init": b + 6}


def say(*a):
    print(*a, flush=True)


def prefill_dp(room, dp):
    return room % dp  # sglang's follow_bootstrap_room


def decode_dp(room, dp):
    return (room // 7) % dp


def plan(room):
    rng = np.random.default_rng(room)
    n = int(rng.integers(4, 11))
    return n, rng.permutation(POOL)[:n].astype(np.int64), int(room % AUX_SLOTS)


def swa_src(room):
    """Prefill's SWA pages of room (its own pool, its own page ids)."""
    return np.random.default_rng(room + 500).permutation(SWA_POOL)[:SWA_PAGES].astype(np.int64)


def src_memory(case, dp, tp):
    mla = CASES[case][0]
    item = kv_item(case, CASES[case][1][0])
    seed = 77 * BASE[case] + 10 * dp + (0 if mla else tp)  # MLA: replicated across TP ranks
    rng = np.random.default_rng(seed)
    nreg = LAYERS if mla else 2 * LAYERS
    kv = [rng.integers(0, 256, POOL * item, dtype=np.uint8) for _ in range(nreg)]
    # State: Mamba's conv and ssm buffers, the SWA pool's K and V per layer.
    st = ([rng.integers(0, 256, STATE_SLOTS * n, dtype=np.uint8) for n in STATE_ITEMS],
          [rng.integers(0, 256, SWA_POOL * ITEM, dtype=np.uint8) for _ in range(2 * LAYERS)])
    return kv, st


def kv_args(case, engine_rank, dp, kv, aux, st, dev, side, tp):
    a = KVArgs()
    if side == "prefill" and not CASES[case][0]:  # as sglang's prefill sets them (MHA only)
        a.kv_head_num, a.total_kv_head_num = kv_heads(case, tp), MODEL_KV_HEADS
    a.engine_rank = engine_rank
    a.kv_data_ptrs = [x.ctypes.data for x in kv]
    a.kv_data_lens = [x.nbytes for x in kv]
    a.kv_item_lens = [kv_item(case, tp)] * len(kv)
    a.aux_data_ptrs = [x.ctypes.data for x in aux]
    a.aux_data_lens = [x.nbytes for x in aux]
    a.aux_item_lens = [x.nbytes // AUX_SLOTS for x in aux]
    if CASES[case][3]:
        # A hybrid model: Mamba state and an SWA pool, each its own index
        # space, plus a kind this pool has no buffers for (sglang sends None).
        mamba, swa = st
        a.state_types = [StateType.MAMBA, StateType.SWA, StateType.C128_STATE]
        a.state_data_ptrs = [[x.ctypes.data for x in mamba], [x.ctypes.data for x in swa], []]
        a.state_data_lens = [[x.nbytes for x in mamba], [x.nbytes for x in swa], []]
        a.state_item_lens = [list(STATE_ITEMS), [ITEM] * len(swa), []]
    else:
        a.state_types, a.state_data_ptrs, a.state_data_lens, a.state_item_lens = [], [], [], []
    a.ib_device, a.gpu_id, a.page_size = dev, engine_rank, PAGE
    a.system_dp_rank, a.pp_rank, a.prefill_start_layer = 0, 0, 0
    return a


def aux_buffers():
    # sglang's MetadataBuffers in miniature: output token id, bootstrap_room.
    return [np.zeros(AUX_SLOTS, dtype=np.int64), np.zeros(AUX_SLOTS, dtype=np.int64)]


def server_args(ip, port, tp, dp):
    return ServerArgs(host=ip, port=30000, disaggregation_bootstrap_port=port,
                      disaggregation_transfer_backend="kvwire", tp_size=tp * dp, dp_size=dp,
                      enable_dp_attention=dp > 1)


def make_managers(case, side, ip, port, dev, mems):
    mla, ptp, dtp, _ = CASES[case]
    tp, dp = ptp if side == "prefill" else dtp
    mode = DisaggregationMode.PREFILL if side == "prefill" else DisaggregationMode.DECODE
    mgrs = {}
    for d in range(dp):
        for t in range(tp):
            set_rank(attn_tp_size=tp, attn_tp_rank=t, attn_dp_size=dp, attn_dp_rank=d)
            # decode's KV args carry no head count: it learns them from prefill
            kv, aux, st = mems[(d, t)]
            # engine_rank: the global TP rank, as sglang sets it.
            mgrs[(d, t)] = Manager(kv_args(case, d * tp + t, d, kv, aux, st, dev, side, tp), mode,
                                   server_args(ip, port, tp, dp), mla)
    return mgrs


def wait_file(path, secs=120):
    end = time.monotonic() + secs
    while not os.path.exists(path):
        if time.monotonic() > end:
            raise TimeoutError(f"no {os.path.basename(path)}")
        time.sleep(0.05)


def publish(path, text):
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.rename(path + ".tmp", path)


# ---------------------------------------------------------------- prefill


def prefill_case(o, case):
    mla, (tp, dp), _, state = CASES[case]
    port = free_port(o.ip)
    server = BootstrapServer(host=o.ip, port=port)
    mems = {}
    for d in range(dp):
        for t in range(tp):
            kv, st = src_memory(case, d, t)
            mems[(d, t)] = (kv, aux_buffers(), st)
    mgrs = make_managers(case, "prefill", o.ip, port, o.dev, mems)
    publish(os.path.join(o.rendezvous, f"{case}.bootstrap"), f"{o.ip}:{port}")
    rs = rooms(case)
    live = rs["ok"] + [rs["prefill_abort"], rs["decode_abort"]]
    reqs = {}
    for room in live:  # PrefillBootstrapQueue.add: one sender per TP rank of the DP group
        d = prefill_dp(room, dp)
        reqs[room] = {"s": [Sender(mgr=mgrs[(d, t)], bootstrap_addr=f"{o.ip}:{port}",
                                   bootstrap_room=room, dest_tp_ranks=[t], pp_rank=0)
                            for t in range(tp)], "stage": "bootstrap", "sent": 0, "d": d}
    out = {}
    end = time.monotonic() + 150
    while len(out) < len(live) and time.monotonic() < end:
        for room in [r for r in live if r not in out]:
            q = reqs[room]
            st_ = min(int(s.poll()) for s in q["s"])  # poll_and_all_reduce over the TP group
            n, src, aux = plan(room)
            if st_ == KVPoll.Failed:
                why = []
                for s in q["s"]:  # prepare_abort(req, str(e)) on each rank
                    try:
                        s.failure_exception()
                    except Exception as e:
                        why.append(str(e))
                out[room] = "Failed: " + " | ".join(why)
                continue
            if q["stage"] == "bootstrap" and st_ == KVPoll.WaitingForInput:
                for s in q["s"]:
                    s.init(n, aux)  # pop_bootstrapped
                q["stage"] = "forward"
            elif q["stage"] == "forward":
                a, b = q["sent"], min(n, q["sent"] + CHUNK)
                last = b == n
                for t, s in enumerate(q["s"]):
                    state = None
                    if last:  # set_buf: first token and room into the metadata slot
                        _, auxb, _ = mems[(q["d"], t)]
                        auxb[0][aux] = room * 3 + 1
                        auxb[1][aux] = room
                        if CASES[case][3]:  # per StateType: Mamba, SWA, C128 (none)
                            state = [[np.array([room % STATE_SLOTS])], swa_src(room), None]
                    if s.should_send_kv_chunk(b - a, last):
                        s.send(src[a:b], state)
                q["sent"] = b
                if room == rs["prefill_abort"]:
                    for s in q["s"]:
                        s.abort()  # aborted mid-prefill (AbortReq)
                    for s in q["s"]:
                        s.send(src[b:])  # a late chunk to a failed request is ignored
                    b = n
                if b == n:
                    q["stage"] = "inflight"
            elif q["stage"] == "inflight" and st_ == KVPoll.Success:
                m = q["s"][0].get_transfer_metric()
                out[room] = f"Success ({m.transfer_total_bytes} bytes)"
        time.sleep(0.002)
    for q in reqs.values():
        for s in q["s"]:
            s.clear()
    ok = True
    for room in live:
        got = out.get(room, "stuck")
        if room in (rs["prefill_abort"], rs["decode_abort"]):
            good = got.startswith("Failed")
        else:
            good = got.startswith("Success")
        ok &= good
        say(f"prefill {case}| room {room}: {got}{'' if good else '  <-- unexpected'}")
    wait_file(os.path.join(o.rendezvous, f"{case}.done"))
    for m in mgrs.values():
        m.close()
    server.close()
    say(f"prefill {case}: as expected: {ok}")
    return ok


def free_port(ip):
    import socket

    with socket.socket() as s:
        s.bind((ip, 0))
        return s.getsockname()[1]


# ----------------------------------------------------------------- decode


def decode_case(o, case):
    mla, (ptp, pdp), (tp, dp), state = CASES[case]
    path = os.path.join(o.rendezvous, f"{case}.bootstrap")
    wait_file(path)
    addr = open(path).read().strip()
    mems = {}
    for d in range(dp):
        for t in range(tp):
            nreg = LAYERS if mla else 2 * LAYERS
            kv = [np.zeros(POOL * kv_item(case, tp), dtype=np.uint8) for _ in range(nreg)]
            st = ([np.zeros(STATE_SLOTS * n, dtype=np.uint8) for n in STATE_ITEMS],
                  [np.zeros(SWA_POOL * ITEM, dtype=np.uint8) for _ in range(2 * LAYERS)])
            mems[(d, t)] = (kv, aux_buffers(), st)
    mgrs = make_managers(case, "decode", o.ip, 0, o.dev, mems)
    rs = rooms(case)
    live = rs["ok"] + [rs["prefill_abort"], rs["decode_abort"], rs["abort_before_init"]]
    free = {k: list(range(POOL))[::-1] for k in mgrs}
    free_swa = {k: list(range(SWA_POOL))[::-1] for k in mgrs}  # the SWA pool's allocator
    reqs = {}
    for room in live:  # DecodePreallocQueue.add: a receiver per TP rank of the DP group
        d = decode_dp(room, dp)
        reqs[room] = {"r": [Receiver(mgr=mgrs[(d, t)], bootstrap_addr=addr, bootstrap_room=room)
                            for t in range(tp)], "stage": "pending", "d": d}
    ab = reqs[rs["abort_before_init"]]
    for r in ab["r"]:
        r.abort()  # aborted while still pending: Failed without init
    out, wrong_total = {}, 0
    end = time.monotonic() + 150
    while len(out) < len(live) and time.monotonic() < end:
        for room in [r for r in live if r not in out]:
            q = reqs[room]
            if q["stage"] == "pending" and room != rs["abort_before_init"]:
                # _update_pending: ensure parallel info, resolve the dp rank, init
                # (each rank's scheduler asks its own manager)
                if not all([r.kv_mgr.try_ensure_parallel_info(addr) for r in q["r"]]):
                    continue
                info = q["r"][0].kv_mgr.prefill_info_table[addr]
                pdr = 0 if info.dp_size == 1 else room % info.dp_size
                for r in q["r"]:
                    r.init(pdr)
                q["stage"] = "prealloc"
            st_ = min(int(r.poll()) for r in q["r"])
            n, src, aux = plan(room)
            if st_ == KVPoll.Failed:
                why = []
                for r in q["r"]:  # each rank asks its own receiver, as sglang's ranks do
                    try:
                        r.failure_exception()
                    except Exception as e:
                        why.append(str(e))
                out[room] = "Failed: " + " | ".join(why)
                for t, r in enumerate(q["r"]):
                    r.clear()
                    free[(q["d"], t)].extend(q.get("pages", []))
                    free_swa[(q["d"], t)].extend(q.get("swa", []))
                continue
            if q["stage"] == "prealloc" and st_ == KVPoll.WaitingForInput:
                q["pages"] = [free[(q["d"], t)][-n:] for t in range(tp)]
                for t in range(tp):
                    del free[(q["d"], t)][-n:]
                slot = room % AUX_SLOTS
                if state:  # the same SWA pages on every TP rank of the group
                    q["swa"] = free_swa[(q["d"], 0)][-SWA_PAGES:]
                    for t in range(tp):
                        del free_swa[(q["d"], t)][-SWA_PAGES:]
                for t, r in enumerate(q["r"]):
                    # per StateType: Mamba's slot, the SWA page list, C128 (none)
                    st_idx = ([[np.array([(room + 3) % STATE_SLOTS])],
                               np.array(q["swa"], dtype=np.int64), None] if state else None)
                    r.send_metadata(np.array(q["pages"][t], dtype=np.int64), slot, st_idx)
                q["pages"] = q["pages"][0]
                q["stage"] = "transfer"
                if room == rs["decode_abort"]:
                    for r in q["r"]:
                        r.abort()
            elif q["stage"] == "transfer" and st_ == KVPoll.Success:
                wrong = verify(case, q, room, mems, pdp)
                wrong_total += wrong
                out[room] = f"Success, {n} pages x {tp} ranks, {wrong} bytes wrong"
                for t, r in enumerate(q["r"]):
                    r.clear()
                    free[(q["d"], t)].extend(q["pages"])
                    free_swa[(q["d"], t)].extend(q.get("swa", []))
        time.sleep(0.002)
    ok = wrong_total == 0
    for room in live:
        got = out.get(room, "stuck")
        if room not in rs["ok"]:
            good = got.startswith("Failed")
        else:
            good = got.startswith("Success")
        ok &= good
        say(f"decode {case}| room {room}: {got}{'' if good else '  <-- unexpected'}")
    for m in mgrs.values():
        m.close()
    publish(os.path.join(o.rendezvous, f"{case}.done"), "")
    say(f"decode {case}: {wrong_total} bytes wrong, as expected: {ok}")
    return ok


def verify(case, q, room, mems, pdp):
    mla, (ptp, _), (tp, _), state = CASES[case]
    n, src, aux = plan(room)
    slot = room % AUX_SLOTS
    wrong = 0
    for t in range(tp):
        pt = t if ptp == tp else 0  # MLA 2->1: prefill TP rank 0 sends
        skv, sst = src_memory(case, prefill_dp(room, pdp), pt)
        dkv, daux, dst = mems[(q["d"], t)]
        if mla:
            for i in range(len(skv)):
                for s, d in zip(src, q["pages"]):
                    wrong += int((dkv[i][d * ITEM:(d + 1) * ITEM]
                                  != skv[i][s * ITEM:(s + 1) * ITEM]).sum())
        else:  # each head of each token from the prefill rank holding it
            hd, hp = kv_heads(case, tp), kv_heads(case, ptp)
            for h in range(t * hd, (t + 1) * hd):
                p = h // hp
                pkv = skv if p == pt else src_memory(case, prefill_dp(room, pdp), p)[0]
                for i in range(len(pkv)):
                    dv = dkv[i].reshape(POOL, PAGE, hd, HEAD_BYTES)
                    sv = pkv[i].reshape(POOL, PAGE, hp, HEAD_BYTES)
                    for s, d in zip(src, q["pages"]):
                        wrong += int((dv[d, :, h - t * hd] != sv[s, :, h - p * hp]).sum())
        wrong += int(daux[0][slot] != room * 3 + 1) + int(daux[1][slot] != room)
        if state:
            ss, ds = room % STATE_SLOTS, (room + 3) % STATE_SLOTS
            for j, k in enumerate(STATE_ITEMS):  # Mamba: its one slot
                wrong += int((dst[0][j][ds * k:(ds + 1) * k]
                              != sst[0][j][ss * k:(ss + 1) * k]).sum())
            for i in range(len(sst[1])):  # SWA: its own page list, region by region
                for s, d in zip(swa_src(room), q["swa"]):
                    wrong += int((dst[1][i][d * ITEM:(d + 1) * ITEM]
                                  != sst[1][i][s * ITEM:(s + 1) * ITEM]).sum())
    return wrong


# ------------------------------------------------------------ prefill killed


def kill_prefill(o):
    case = "tp22"
    mla, (tp, dp), _, _ = CASES[case]
    port = free_port(o.ip)
    server = BootstrapServer(host=o.ip, port=port)
    mems = {(0, t): (src_memory(case, 0, t)[0], aux_buffers(), []) for t in range(tp)}
    mgrs = make_managers(case, "prefill", o.ip, port, o.dev, mems)
    publish(os.path.join(o.rendezvous, "kill.bootstrap"), f"{o.ip}:{port}")
    senders = [Sender(mgr=mgrs[(0, t)], bootstrap_addr=f"{o.ip}:{port}", bootstrap_room=9001,
                      dest_tp_ranks=[t], pp_rank=0) for t in range(tp)]
    say("prefill kill: waiting to be killed")
    while True:  # a prefill that hangs in its forward pass until killed
        for s in senders:
            s.poll()
        time.sleep(0.05)
    return server


def kill_decode(o):
    case = "tp22"
    _, _, (tp, dp), _ = CASES[case]
    path = os.path.join(o.rendezvous, "kill.bootstrap")
    wait_file(path)
    addr = open(path).read().strip()
    mems = {(0, t): ([np.zeros(POOL * ITEM, dtype=np.uint8) for _ in range(2 * LAYERS)],
                     aux_buffers(), []) for t in range(tp)}
    mgrs = make_managers(case, "decode", o.ip, 0, o.dev, mems)
    recvs = [Receiver(mgr=mgrs[(0, t)], bootstrap_addr=addr, bootstrap_room=9001)
             for t in range(tp)]
    end = time.monotonic() + 60
    while not all([m.try_ensure_parallel_info(addr) for m in mgrs.values()]):
        assert time.monotonic() < end
        time.sleep(0.05)
    for r in recvs:
        r.init(0)
    while min(int(r.poll()) for r in recvs) != KVPoll.WaitingForInput:
        assert time.monotonic() < end, [int(r.poll()) for r in recvs]
        time.sleep(0.02)
    for r in recvs:
        r.send_metadata(np.arange(4, dtype=np.int64), 0)
    publish(os.path.join(o.rendezvous, "kill.ready"), "")
    wait_file(os.path.join(o.rendezvous, "kill.killed"))
    t0 = time.monotonic()
    while min(int(r.poll()) for r in recvs) != KVPoll.Failed and time.monotonic() - t0 < 60:
        time.sleep(0.02)
    took = time.monotonic() - t0
    try:
        recvs[0].failure_exception()
        why = "not failed"
    except Exception as e:
        why = str(e)
    for r in recvs:
        r.clear()
    for m in mgrs.values():
        m.close()
    bound = mgrs[(0, 0)].heartbeat_interval * mgrs[(0, 0)].max_failures + 10
    ok = min(int(r.poll()) for r in recvs) == KVPoll.Failed and took < bound
    say(f"decode kill: Failed {took:.1f} s after prefill was killed (bound {bound:.0f} s): {why}")
    say(f"decode kill: as expected: {ok}")
    return ok


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("role", choices=["prefill", "decode"])
    ap.add_argument("--ip", required=True)
    ap.add_argument("--dev")
    ap.add_argument("--rendezvous", required=True)
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--kill-test", action="store_true")
    o = ap.parse_args()
    if o.kill_test:
        sys.exit(0 if (kill_prefill(o) if o.role == "prefill" else kill_decode(o)) else 1)
    ok = True
    for c in o.cases.split(","):
        ok &= prefill_case(o, c) if o.role == "prefill" else decode_case(o, c)
    sys.exit(0 if ok else 1)
