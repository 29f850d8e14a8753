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


def run_layout(scenario, env=None):
    """One scenario of sglang_fake_nic_layouts.py: on the fake NIC unless env
    names the test bed's devices (guest/test_sglang_layouts_on_rxe.py)."""
    if env is None:
        env = dict(os.environ, KVWIRE_LIB=LIB)
        for k in ("KVW_TB_DEV0", "KVW_TB_DEV1", "KVW_TB_IP0", "KVW_TB_IP1"):
            env.pop(k, None)
    env = dict(env)
    env.pop("SGLANG_PP_LAYER_PARTITION", None)
    p = subprocess.run([sys.executable, os.path.join(HERE, "sglang_fake_nic_layouts.py"),
                        scenario], env=env, capture_output=True, text=True, timeout=300)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    assert p.returncode == 0 and lines, p.stdout[-3000:] + p.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


SUCCESS = 4
KV_BYTES = 4 * 2 * 6 * 256  # layers x (K, V) x pages x page bytes


def check_prefix(r):
    """decode_prefix_len = 2 of 6 pages: decode asks for the other 4, prefill
    (which hands over all 6, sglang's pop_decode_prefix_len() being 0 under
    kvwire) writes exactly those: every byte of the 4 equals prefill's last 4
    pages, decode's 2 prefix pages are never written, the metadata arrives."""
    assert r["decode_polls"] == [SUCCESS] and r["prefill_end"] == [SUCCESS], r
    assert r["popped_prefix_len"] == [0], r
    assert r["bytes_checked"] == KV_BYTES and r["bytes_wrong"] == 0, r
    assert r["decode_aux"] == [1000], r


def check_pp21(r):
    """Prefill PP 2 (layers 0-1 and 2-3), decode PP 1: decode gathers both
    stages' layers (sglang's target_pp_ranks), each into the layers of its
    stage; the metadata comes from the last stage (1001), not stage 0."""
    assert r["decode_polls"] == [SUCCESS] and r["prefill_end"] == [SUCCESS] * 2, r
    assert r["bytes_checked"] == KV_BYTES and r["bytes_wrong"] == 0, r
    assert r["decode_aux"] == [1001], r


def check_pp22(r):
    """Prefill PP 2 -> decode PP 2: stage to stage, each its metadata."""
    assert r["decode_polls"] == [SUCCESS] * 2 and r["prefill_end"] == [SUCCESS] * 2, r
    assert r["bytes_checked"] == KV_BYTES and r["bytes_wrong"] == 0, r
    assert r["decode_aux"] == [1000, 1001], r


def check_pp21_tp_mismatch(r):
    """PP gathering with different TP sizes: refused on decode at init,
    the reason naming both PP and both TP sizes."""
    assert r["polls"] == [FAILED], r
    assert "prefill PP size 2, decode PP size 1" in r["reason"], r
    assert "prefill attn TP size 1 != decode attn TP size 2" in r["reason"], r


def check_noflag(r):
    """Served: prefill TP 1 not told decode's TP 2 (no
    --disaggregation-decode-tp) learns from each room's kvwire requests
    that 2 decode ranks read it, and serves both: every byte right on both
    decode ranks (MLA the latent, MHA each its 2 heads), each its own
    metadata, prefill Success."""
    assert r["prefill_decode_receivers"] is None, r
    assert r["decode_polls"] == [SUCCESS] * 2 and r["prefill_end"] == [SUCCESS], r
    assert r["reasons"] == [], r
    want = 4 * 2 * 256 if r["scenario"] == "mla12_noflag" else 4 * 2 * 2 * 128
    assert r["bytes_checked"] == 2 * want and r["bytes_wrong"] == 0, r
    assert r["decode_aux"] == [1000, 1000], r


def check_learned_heads(r, decode_ranks, prefill_ranks):
    """MHA across attention TP sizes with decode's KV args carrying no head
    count (as sglang's): each decode rank described only its page and
    learned its heads from prefill's handshake; the model's config was
    never loaded; every head of every page equals the prefill rank's that
    holds it; the metadata from the rank sending it."""
    assert r["model_config_loads"] == 0, r
    assert r["decode_heads"] == [[0, 0, 0, 0, 1, "NHD"]] * decode_ranks, r
    assert r["decode_polls"] == [SUCCESS] * decode_ranks, r
    assert r["prefill_end"] == [SUCCESS] * prefill_ranks, r
    assert r["bytes_checked"] == 4 * 2 * 6 * 4 * 128 and r["bytes_wrong"] == 0, r
    assert r["decode_aux"] == [1000] * decode_ranks, r


def check_tp21(r):
    """Prefill attn TP 2 -> decode attn TP 1: decode learns all 4 heads and
    takes [0, 2) from prefill rank 0, [2, 4) from rank 1."""
    check_learned_heads(r, 1, 2)


def check_tp12(r):
    """Prefill attn TP 1 -> decode attn TP 2 (--disaggregation-decode-tp 2
    on prefill): decode rank t learns heads [2t, 2t + 2)."""
    check_learned_heads(r, 2, 1)


def check_hybrid12_noflag(r):
    """Hybrid MHA (Mamba state) with prefill attn TP 1 not told decode's TP
    2: refused per room, since kvwire does not slice state items by sglang's
    state_dim_per_tensor. Both decode ranks end Failed at init, the reason
    naming both TP sizes and the missing state slicing. With sglang's
    state (hybrid12_noflag: each rank 1/TP of the item) kvwire's handshake
    refuses the item lengths as well, so no request reaches prefill, whose
    sender ends Failed by sglang's bootstrap timeout (2 s in the scenario,
    300 s by default); with state items of one length on both sides
    (hybrid12_noflag_whole) decode's refused receivers ask prefill for
    nothing and prefill's sender (having learned the room's 2 decode ranks
    from those requests) ends Failed at its init. Either way not one byte of
    decode's KV pages, Mamba slots or aux (a canary) changes, and the next
    room, from a prefill of attn TP 2, lands in the same pages and slot."""
    whole = r["scenario"] == "hybrid12_noflag_whole"
    assert r["prefill_decode_receivers"] is None, r
    assert r["decode_polls"] == [FAILED] * 2 and len(r["reasons"]) == 2, r
    for why in r["reasons"]:
        assert "prefill attn TP size 1, decode attn TP size 2" in why, r
        assert "not sliced across TP sizes" in why and "state_dim_per_tensor" in why, r
    assert r["prefill_end"] == [FAILED], r
    if whole:  # WaitingForInput: both requests came; init failed the room
        assert r["prefill_bootstrapped"] == 2, r
        assert "decode asked nothing of this MHA/GQA prefill rank" in r["prefill_reason"], r
    else:  # never out of Bootstrapping: sglang's bootstrap timeout
        assert r["prefill_bootstrapped"] == FAILED, r
        assert "timed out after" in r["prefill_reason"], r
        assert "in KVPoll.Bootstrapping" in r["prefill_reason"], r
    state = 256 if whole else 128  # a Mamba slot's bytes on a decode rank (conv + ssm)
    # 2 ranks x (4 layers x K, V x 16 pages x 128 B + 4 slots + 4 x 8 B aux)
    assert r["canary_bytes"] == 2 * (4 * 2 * 16 * 128 + 4 * state + 32), r
    assert r["canary_bytes_changed"] == 0, r
    assert r["equal_tp_decode_polls"] == [SUCCESS] * 2, r
    assert r["equal_tp_prefill_end"] == [SUCCESS] * 2, r
    assert r["equal_tp_bytes_checked"] == 2 * (4 * 2 * 2 * 128 + state), r
    assert r["equal_tp_bytes_wrong"] == 0, r
    assert r["equal_tp_decode_aux"] == [2000, 2001], r


LAYOUTS = {"prefix": check_prefix, "pp21": check_pp21, "pp22": check_pp22,
           "pp21_tp_mismatch": check_pp21_tp_mismatch, "mla12_noflag": check_noflag,
           "mha12_noflag": check_noflag, "tp21": check_tp21, "tp12": check_tp12,
           "hybrid12_noflag": check_hybrid12_noflag,
           "hybrid12_noflag_whole": check_hybrid12_noflag}


@pytest.mark.parametrize("scenario", sorted(LAYOUTS))
def test_layout_on_fake_nic(scenario):
    LAYOUTS[scenario](run_layout(scenario))
