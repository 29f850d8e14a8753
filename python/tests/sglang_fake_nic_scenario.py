# SPDX-License-Identifier: Apache-2.0
"""One prefill and one decode rank of kvwire's sglang backend in one
process, on the fake NIC (libkvwire built with tests/support/fake_nic.c:
`make python-fake-nic`, loaded as KVWIRE_LIB), driven as sglang's
scheduler queues drive them; run by test_sglang_fake_nic.py, one scenario
per process (the fake NIC is process-wide). Prints one JSON line.

    KVWIRE_LIB=build/test/libkvwire-fakenic.so \\
        python3 sglang_fake_nic_scenario.py abort|timeout|hang|other_rank

Real: sglang's CommonKVManager / Sender / Receiver / BootstrapServer from
the pinned snapshot under kvwire's classes (get_kv_class), kvwire's engines.
Stand-ins: the rest of sglang (sglang_stubs), the model's KV pool (numpy
pages), the scheduler (the loop below, in the order of sglang's
DecodePreallocQueue / DecodeTransferQueue: init, send_metadata, poll until
Success or Failed, then failure_exception, release_kv_cache, clear), and
the NIC (the fake one, its writes delayed by the scenario).

Scenarios. Each checks sglang's contract for a Failed poll: the moment the
decode rank reports Failed, sglang frees the request's pages and may hand
them to another request (release_kv_cache); the scenario then fills them
(the new request) and watches them for WATCH_S: no byte may change.
  abort    decode aborts (sglang's AbortReq) while prefill's writes, delayed
           by DELAY_MS, are still on the wire;
  timeout  sglang's waiting timeout (SGLANG_DISAGGREGATION_WAITING_TIMEOUT,
           set to 1 s) fires while prefill's writes, delayed 2.5 s, are
           still on the wire;
  hang     prefill's scheduler stops after bootstrap (it never sends):
           decode must fail by the waiting timeout (2 s here), not wait on;
  other_rank  another TP rank of the request failed: sglang's all-reduced
           poll (poll_and_all_reduce, a minimum) is Failed on this rank too
           while its own writes, delayed DELAY_MS, are on the wire; sglang
           then calls failure_exception() and frees the pages.
  metrics  sglang runs with --enable-metrics (server_args.enable_metrics):
           the request succeeds and both ranks' kvwire_* metrics are in
           prometheus_client's registry, where sglang's /metrics reads.
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
DELAY_MS = {"abort": 300, "timeout": 2500, "hang": 0, "other_rank": 300, "metrics": 0}[SCENARIO]
if SCENARIO == "timeout":
    os.environ["SGLANG_DISAGGREGATION_WAITING_TIMEOUT"] = "1"
elif SCENARIO == "hang":
    os.environ["SGLANG_DISAGGREGATION_WAITING_TIMEOUT"] = "2"
os.environ["KVWIRE_LOCAL_IP"] = "127.0.0.1"

sglang_ref.enter()
nic = ctypes.CDLL(os.environ["KVWIRE_LIB"])  # the library kvwire loads: one instance
nic.kvw_test_fake_nic_outstanding.restype = ctypes.c_ulonglong
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
POOL, ITEM, LAYERS, AUX_SLOTS, ROOM, NPAGES = 16, 1024, 2, 4, 7, 4
WATCH_S = DELAY_MS / 1000 + 0.7


def free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def manager(mode, dev, port, kv, aux):
    a = KVArgs()
    a.engine_rank, a.gpu_id, a.page_size, a.system_dp_rank, a.pp_rank = 0, 0, 1, 0, 0
    a.prefill_start_layer = 0
    a.kv_data_ptrs, a.kv_data_lens = [x.ctypes.data for x in kv], [x.nbytes for x in kv]
    a.kv_item_lens = [ITEM] * len(kv)
    a.aux_data_ptrs, a.aux_data_lens = [x.ctypes.data for x in aux], [x.nbytes for x in aux]
    a.aux_item_lens = [x.nbytes // AUX_SLOTS for x in aux]
    a.state_types, a.state_data_ptrs, a.state_data_lens, a.state_item_lens = [], [], [], []
    a.ib_device = dev
    set_rank()
    sa = ServerArgs(host="127.0.0.1", port=30000, disaggregation_bootstrap_port=port,
                    disaggregation_transfer_backend="kvwire", tp_size=1, dp_size=1)
    sa.enable_metrics = SCENARIO == "metrics"  # sglang's --enable-metrics
    return Manager(a, mode, sa, True)  # MLA: one latent region per layer


def scrape_requests():
    """Each role's kvwire_requests_total{outcome="success"} in the default
    registry's exposition, parsed with prometheus_client's parser."""
    import prometheus_client
    from prometheus_client.parser import text_string_to_metric_families

    text = prometheus_client.generate_latest().decode()
    found = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "kvwire_requests_total" and s.labels.get("outcome") == "success":
                found[s.labels["role"]] = s.value
    return found


def wait(cond, secs, what):
    end = time.monotonic() + secs
    while not cond():
        if time.monotonic() > end:
            raise TimeoutError(what)
        time.sleep(0.001)


def main():
    assert nic.kvw_test_fake_nic_start(2) == 0
    port = free_port()
    server = Server(host="127.0.0.1", port=port)
    addr = f"127.0.0.1:{port}"
    rng = np.random.default_rng(1)
    src = [rng.integers(1, 256, POOL * ITEM, dtype=np.uint8) for _ in range(LAYERS)]
    dst = [np.zeros(POOL * ITEM, dtype=np.uint8) for _ in range(LAYERS)]
    saux, daux = [np.zeros(AUX_SLOTS, dtype=np.int64)], [np.zeros(AUX_SLOTS, dtype=np.int64)]
    pm = manager(DisaggregationMode.PREFILL, "fake0", port, src, saux)
    dm = manager(DisaggregationMode.DECODE, "fake1", 0, dst, daux)
    out = {"scenario": SCENARIO, "delay_ms": DELAY_MS}
    try:
        s = Sender(mgr=pm, bootstrap_addr=addr, bootstrap_room=ROOM, dest_tp_ranks=[0],
                   pp_rank=0)
        r = Receiver(mgr=dm, bootstrap_addr=addr, bootstrap_room=ROOM)
        wait(lambda: dm.try_ensure_parallel_info(addr), 20, "parallel info")
        r.init(0)
        wait(lambda: r.poll() == KVPoll.WaitingForInput, 20, "decode WaitingForInput")
        pages = np.array([3, 9, 4, 12], dtype=np.int64)[:NPAGES]
        r.send_metadata(pages, 1)
        wait(lambda: s.poll() == KVPoll.WaitingForInput, 20, "prefill WaitingForInput")
        s.init(NPAGES, 2)
        if SCENARIO != "hang":
            nic.kvw_test_fake_nic_delay(DELAY_MS * 1000, 0)
            saux[0][2] = 1234
            s.send(np.array([0, 1, 2, 3], dtype=np.int64)[:NPAGES])  # one last chunk
            wait(lambda: nic.kvw_test_fake_nic_outstanding() > 0, 5, "writes posted")
        t0 = time.monotonic()
        if SCENARIO == "abort":
            r.abort()  # sglang's AbortReq on decode
        out["polls_before_failed"] = []
        p = int(KVPoll.Failed)  # other_rank: the all-reduced poll, not this rank's
        while SCENARIO != "other_rank":  # DecodeTransferQueue.pop_transferred
            p = int(r.poll())
            if p in (KVPoll.Failed, KVPoll.Success):
                break
            if not out["polls_before_failed"] or out["polls_before_failed"][-1] != p:
                out["polls_before_failed"].append(p)
            if time.monotonic() - t0 > 30:
                break
            time.sleep(0.001)
        t_end = time.monotonic()
        out["poll"] = p
        if SCENARIO == "metrics":
            wait(lambda: s.poll() == KVPoll.Success, 20, "prefill Success")
            out["kvwire_requests"] = scrape_requests()
        try:
            r.failure_exception()
        except Exception as e:
            out["reason"] = str(e)
        if SCENARIO == "other_rank":
            t_end = time.monotonic()
        out["ms_to_end"] = round((t_end - t0) * 1000)
        out["outstanding_at_end"] = nic.kvw_test_fake_nic_outstanding()
        # release_kv_cache: the pages go back to the allocator; the next
        # request takes them at once and writes its own KV there.
        for d in dst:
            for pg in pages:
                d[pg * ITEM:(pg + 1) * ITEM] = 0xAB
        r.clear()
        time.sleep(WATCH_S)
        out["reused_bytes_overwritten"] = int(sum(
            (d[pg * ITEM:(pg + 1) * ITEM] != 0xAB).sum() for d in dst for pg in pages))
        out["reused_bytes"] = len(dst) * len(pages) * ITEM
        s.clear()
    finally:
        nic.kvw_test_fake_nic_delay(0, 0)
        pm.close()
        dm.close()
        server.close()
        nic.kvw_test_fake_nic_stop()
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
