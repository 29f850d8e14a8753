# SPDX-License-Identifier: Apache-2.0
"""Drive kvwire.sglang exactly as sglang's schedulers drive a transfer
backend (pinned: sglang 0094505da741, disaggregation/prefill.py and
decode.py), with two TP ranks per side whose polls are combined by
minimum (sglang's poll_and_all_reduce), in a prefill and a decode process.

    sglang_harness.py prefill|decode --ip IP --dev DEV --rendezvous DIR [--mla]

Prefill: a KVBootstrapServer, one KVManager per TP rank (PREFILL), per
request one KVSender per rank; bootstrap queue (poll until WaitingForInput,
then init(num_pages, aux_index)), chunked prefill (send() per chunk, one
chunk per scheduler step), inflight queue (poll until Success/Failed,
failure_exception() on Failed). Decode: one KVManager per rank (DECODE),
per request one KVReceiver per rank, init(prefill_dp_rank), prealloc queue
(poll until WaitingForInput, allocate pages, send_metadata), transfer
queue (poll; verify every byte on Success). Faults: prefill aborts one room
mid-prefill, decode aborts another after send_metadata; both sides must see
exactly those rooms Failed. KV buffers are numpy arrays (host memory), their
addresses from arr.ctypes.data as sglang's kv_data_ptrs.
"""
import argparse
import enum
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import kvwire  # noqa: E402
from kvwire.sglang.standalone import (KVWireKVBootstrapServer, KVWireKVManager,  # noqa: E402
                                      KVWireKVReceiver, KVWireKVSender)

# ---- minimal stand-ins for sglang's types (test harness only) ----


class KVPoll:
    Failed = 0
    Bootstrapping = 1
    WaitingForInput = 2
    Transferring = 3
    Success = 4


class DisaggregationMode(enum.Enum):
    NULL = "null"
    PREFILL = "prefill"
    DECODE = "decode"


class KVArgs:  # attribute bag, as sglang's
    pass


class ServerArgs:
    def __init__(self, host, port):
        self.host = host
        self.disaggregation_bootstrap_port = port


# ---- the workload both sides derive from the room number ----
TP, POOL, ITEM, PAGE_TOKENS, AUX_SLOTS = 2, 128, 512, 16, 16
AUX_ITEMS = (64, 256)  # two metadata buffers (e.g. output ids, hidden states)
ROOMS = [7000 + k for k in range(8)]
PREFILL_ABORTS, DECODE_ABORTS = 7003, 7005
CHUNK_PAGES = 4


def layers(mla):
    return 3 if mla else 4


def regions_per_rank(mla):
    return layers(mla) if mla else 2 * layers(mla)  # MLA: one per layer; MHA: K then V


def src_memory(rank, mla):
    rng = np.random.default_rng(1000 + rank)
    kv = [rng.integers(0, 256, POOL * ITEM, dtype=np.uint8) for _ in range(regions_per_rank(mla))]
    aux = [rng.integers(0, 256, AUX_SLOTS * n, dtype=np.uint8) for n in AUX_ITEMS]
    return kv, aux


def plan(room):
    rng = np.random.default_rng(room)
    n = int(rng.integers(5, 15))
    src = rng.permutation(POOL)[:n].astype(np.int64)
    return n, src, int(room % AUX_SLOTS)


def kv_args(rank, kv, aux, dev):
    a = KVArgs()
    a.engine_rank = rank
    a.kv_data_ptrs = [x.ctypes.data for x in kv]
    a.kv_data_lens = [x.nbytes for x in kv]
    a.kv_item_lens = [ITEM] * len(kv)
    a.aux_data_ptrs = [x.ctypes.data for x in aux]
    a.aux_data_lens = [x.nbytes for x in aux]
    a.aux_item_lens = list(AUX_ITEMS)
    a.state_data_ptrs, a.state_data_lens, a.state_item_lens = [], [], []
    a.ib_device = dev
    a.gpu_id = rank
    a.page_size = PAGE_TOKENS
    a.system_dp_rank = 0
    a.pp_rank = 0
    return a


def poll_and_all_reduce(pollers):
    """sglang: MIN all-reduce of every rank's poll, per request."""
    return [min(int(p.poll()) for p in ranks) for ranks in pollers]


def say(*a):
    print(*a, flush=True)


# ---- prefill ----


def prefill(o):
    server = KVWireKVBootstrapServer(host=o.ip, port=0)
    sargs = ServerArgs(o.ip, server.port)
    mems = [src_memory(r, o.mla) for r in range(TP)]
    mgrs = [KVWireKVManager(kv_args(r, *mems[r], o.dev), DisaggregationMode.PREFILL, sargs, o.mla)
            for r in range(TP)]
    with open(os.path.join(o.rendezvous, "bootstrap.tmp"), "w") as f:
        f.write(f"{o.ip}:{server.port}\n")
    os.rename(os.path.join(o.rendezvous, "bootstrap.tmp"), os.path.join(o.rendezvous, "bootstrap"))
    say(f"prefill: bootstrap server {server.addr}, {TP} TP ranks on {mgrs[0].engine.device_name}")

    reqs = {}
    for room in ROOMS:  # PrefillBootstrapQueue.add
        senders = [KVWireKVSender(mgr=mgrs[r], bootstrap_addr=f"{o.ip}:{server.port}",
                                  bootstrap_room=room, dest_tp_ranks=[r], pp_rank=0)
                   for r in range(TP)]
        reqs[room] = {"senders": senders, "stage": "bootstrap", "sent": 0}
    outcome = {}
    deadline = time.monotonic() + 120
    while len(outcome) < len(ROOMS) and time.monotonic() < deadline:
        live = [r for r in ROOMS if r not in outcome]
        polls = poll_and_all_reduce([reqs[r]["senders"] for r in live])  # every step
        for room, st in zip(live, polls):
            q = reqs[room]
            n, src, aux = plan(room)
            if st == KVPoll.Failed:
                try:
                    q["senders"][0].failure_exception()
                except Exception as e:  # sglang: prepare_abort(req, str(e))
                    outcome[room] = f"Failed: {e}"
                continue
            if q["stage"] == "bootstrap" and st == KVPoll.WaitingForInput:
                for s in q["senders"]:  # pop_bootstrapped
                    s.init(n, aux)
                q["stage"] = "forward"
            elif q["stage"] == "forward":
                # send_kv_chunk: one chunk of whole pages per step, the last
                # chunk carries the rest
                a = q["sent"]
                b = min(n, a + CHUNK_PAGES)
                for s in q["senders"]:
                    s.send(src[a:b])
                q["sent"] = b
                if room == PREFILL_ABORTS and a == 0:
                    for s in q["senders"]:  # the request is aborted mid-prefill
                        s.abort()
                    for s in q["senders"]:  # a late chunk to a failed request is ignored
                        s.send(src[b:])
                    q["sent"] = b = n
                if b == n:
                    q["stage"] = "inflight"
            elif q["stage"] == "inflight" and st == KVPoll.Success:
                m = q["senders"][0].get_transfer_metric()
                outcome[room] = f"Success ({m.transfer_total_bytes} bytes)"
        time.sleep(0.001)
    for q in reqs.values():
        for s in q["senders"]:
            s.clear()
    ok = True
    for room in ROOMS:
        got = outcome.get(room, "stuck")
        want_fail = room in (PREFILL_ABORTS, DECODE_ABORTS)
        good = got.startswith("Failed") if want_fail else got.startswith("Success")
        ok &= good
        say(f"prefill| room {room}: {got}{'' if good else '  <-- unexpected'}")
    done = os.path.join(o.rendezvous, "decode-done")
    end = time.monotonic() + 60
    while not os.path.exists(done) and time.monotonic() < end:
        time.sleep(0.05)
    for m in mgrs:
        m.close()
    server.close()
    say(f"prefill: {sum(v.startswith('Success') for v in outcome.values())} ok, "
        f"{sum(v.startswith('Failed') for v in outcome.values())} failed, as expected: {ok}")
    return 0 if ok else 1


# ---- decode ----


def decode(o):
    path = os.path.join(o.rendezvous, "bootstrap")
    end = time.monotonic() + 60
    while not os.path.exists(path):
        assert time.monotonic() < end, "no bootstrap address from prefill"
        time.sleep(0.05)
    bootstrap_addr = open(path).read().strip()
    dst = []
    for _ in range(TP):
        kv = [np.zeros(POOL * ITEM, dtype=np.uint8) for _ in range(regions_per_rank(o.mla))]
        aux = [np.zeros(AUX_SLOTS * n, dtype=np.uint8) for n in AUX_ITEMS]
        dst.append((kv, aux))
    mgrs = [KVWireKVManager(kv_args(r, *dst[r], o.dev), DisaggregationMode.DECODE,
                            ServerArgs(o.ip, None), o.mla) for r in range(TP)]
    free = list(range(POOL))[::-1]
    reqs = {}
    for room in ROOMS:  # DecodePreallocQueue.add -> receivers, then init(prefill_dp_rank)
        recvs = [KVWireKVReceiver(mgr=mgrs[r], bootstrap_addr=bootstrap_addr, bootstrap_room=room)
                 for r in range(TP)]
        for rv in recvs:
            rv.init(0)
        reqs[room] = {"recvs": recvs, "stage": "prealloc"}
    outcome = {}
    bad_bytes = 0
    deadline = time.monotonic() + 120
    while len(outcome) < len(ROOMS) and time.monotonic() < deadline:
        live = [r for r in ROOMS if r not in outcome]
        polls = poll_and_all_reduce([reqs[r]["recvs"] for r in live])
        for room, st in zip(live, polls):
            q = reqs[room]
            n, src, aux = plan(room)
            if st == KVPoll.Failed:
                try:
                    q["recvs"][0].failure_exception()
                except Exception as e:
                    outcome[room] = f"Failed: {e}"
                free.extend(q.get("pages", []))
                continue
            if q["stage"] == "prealloc" and st == KVPoll.WaitingForInput:
                if len(free) < n:
                    continue
                pages = np.array([free.pop() for _ in range(n)], dtype=np.int64)
                q["pages"] = list(pages)
                slot = room % AUX_SLOTS  # metadata_buffer_index
                for rv in q["recvs"]:
                    rv.send_metadata(pages, aux_index=slot)
                q["stage"] = "transfer"
                if room == DECODE_ABORTS:
                    for rv in q["recvs"]:
                        rv.abort()
            elif q["stage"] == "transfer" and st == KVPoll.Success:
                wrong = 0
                for r in range(TP):
                    skv, saux = src_memory(r, o.mla)
                    dkv, daux = dst[r]
                    for i in range(len(skv)):
                        for s, d in zip(src, q["pages"]):
                            wrong += int((dkv[i][d * ITEM:(d + 1) * ITEM]
                                          != skv[i][s * ITEM:(s + 1) * ITEM]).sum())
                    slot = room % AUX_SLOTS
                    for j, n_ in enumerate(AUX_ITEMS):
                        wrong += int((daux[j][slot * n_:(slot + 1) * n_]
                                      != saux[j][aux * n_:(aux + 1) * n_]).sum())
                bad_bytes += wrong
                outcome[room] = f"Success, {n} pages x {TP} ranks, {wrong} bytes wrong"
                for rv in q["recvs"]:
                    rv.clear()
                free.extend(q["pages"])
        time.sleep(0.001)
    ok = bad_bytes == 0
    for room in ROOMS:
        got = outcome.get(room, "stuck")
        want_fail = room in (PREFILL_ABORTS, DECODE_ABORTS)
        good = got.startswith("Failed") if want_fail else got.startswith("Success")
        ok &= good
        say(f"decode | room {room}: {got}{'' if good else '  <-- unexpected'}")
    for q in reqs.values():
        for rv in q["recvs"]:
            rv.clear()
    for m in mgrs:
        m.close()
    open(os.path.join(o.rendezvous, "decode-done"), "w").close()
    say(f"decode: {sum(v.startswith('Success') for v in outcome.values())} ok, "
        f"{sum(v.startswith('Failed') for v in outcome.values())} failed, "
        f"{bad_bytes} bytes wrong, as expected: {ok}")
    return 0 if ok else 1


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("role", choices=["prefill", "decode"])
    ap.add_argument("--ip", required=True)
    ap.add_argument("--dev")
    ap.add_argument("--rendezvous", required=True)
    ap.add_argument("--mla", action="store_true")
    o = ap.parse_args()
    sys.exit(prefill(o) if o.role == "prefill" else decode(o))
