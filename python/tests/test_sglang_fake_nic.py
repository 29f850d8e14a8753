# SPDX-License-Identifier: Apache-2.0
"""kvwire's sglang backend moving data on the fake NIC (host): every path
that reports Failed to sglang must wait for kvwire's receiver to be Failed
(its abort barrier passed), because sglang frees and reuses the pages on
that Failed; and decode's waiting timeout must fire. Each scenario runs in
its own process (sglang_fake_nic_scenario.py, which says what is real and
what stands in) with libkvwire built on the fake NIC (`make
python-fake-nic`; make python-test passes it as $KVWIRE_FAKE_NIC_LIB)."""
import json
import os
import subprocess
import sys

import pytest

import sglang_ref

HERE = os.path.dirname(os.path.abspath(__file__))
LIB = os.environ.get("KVWIRE_FAKE_NIC_LIB", "")
pytestmark = [
    pytest.mark.skipif(bool(sglang_ref.missing()), reason=sglang_ref.missing() or "-"),
    pytest.mark.skipif(not os.path.isfile(LIB),
                       reason="needs $KVWIRE_FAKE_NIC_LIB (make python-fake-nic)"),
]
FAILED, TRANSFERRING = 0, 3


def run(scenario):
    env = dict(os.environ, KVWIRE_LIB=LIB)
    env.pop("SGLANG_DISAGGREGATION_WAITING_TIMEOUT", None)
    p = subprocess.run([sys.executable, os.path.join(HERE, "sglang_fake_nic_scenario.py"),
                        scenario], env=env, capture_output=True, text=True, timeout=120)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    assert p.returncode == 0 and lines, p.stdout[-3000:] + p.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


def test_abort_keeps_pages_until_kvwire_failed():
    """sglang's AbortReq on decode while prefill's writes (delayed 300 ms)
    are on the wire: the receiver stays Transferring until kvwire's abort
    barrier has passed (prefill confirmed its writes), then Failed; the
    pages sglang frees on that Failed, reused at once, never change. (The
    old backend reported Failed at abort() and 8159 of the 8192 reused
    bytes were overwritten.)"""
    r = run("abort")
    assert r["poll"] == FAILED, r
    assert r["polls_before_failed"] == [TRANSFERRING], r
    assert r["ms_to_end"] >= 200, r  # the writes were still on the wire for ~300 ms
    assert r["outstanding_at_end"] == 0, r  # no write of the room left at Failed
    assert "Aborted" in r["reason"], r
    assert r["reused_bytes_overwritten"] == 0, r


def test_waiting_timeout_keeps_pages_until_kvwire_failed():
    """sglang's waiting timeout (1 s) fires while prefill's writes, delayed
    2.5 s, are still on the wire: Failed with sglang's reason, and not
    before kvwire's receiver failed, so the reused pages never change."""
    r = run("timeout")
    assert r["poll"] == FAILED, r
    assert "timed out" in r["reason"], r
    assert r["ms_to_end"] >= 900, r
    assert r["outstanding_at_end"] == 0, r
    assert r["reused_bytes_overwritten"] == 0, r


def test_waiting_timeout_fails_a_hung_prefill():
    """Prefill's scheduler stops after bootstrap (it never sends): decode
    fails the request by SGLANG_DISAGGREGATION_WAITING_TIMEOUT (2 s here)
    instead of holding its pages for ever."""
    r = run("hang")
    assert r["poll"] == FAILED, r
    assert "timed out" in r["reason"], r
    assert 1500 <= r["ms_to_end"] < 10000, r


def test_failed_on_another_rank_waits_in_failure_exception():
    """Another TP rank failed the request: sglang's all-reduced poll is
    Failed on this rank while its writes (delayed 300 ms) are on the wire.
    sglang calls failure_exception() right before it frees the pages, so
    that is where this rank aborts its kvwire receivers and waits for their
    barrier: when it returns, nothing more lands in the reused pages."""
    r = run("other_rank")
    assert r["ms_to_end"] >= 200, r
    assert r["outstanding_at_end"] == 0, r
    assert r["reused_bytes_overwritten"] == 0, r


def test_enable_metrics_registers_the_engines():
    """sglang's --enable-metrics (server_args.enable_metrics): the backend
    registers each rank's engine with prometheus_client (kvwire.metrics),
    and after one transfer both roles count it."""
    pytest.importorskip("prometheus_client")
    r = run("metrics")
    assert r["poll"] == 4, r  # Success
    assert r["kvwire_requests"] == {"prefill": 1.0, "decode": 1.0}, r
