# SPDX-License-Identifier: Apache-2.0
"""kvwire under sglang's REAL scheduler queues: PrefillBootstrapQueue,
send_kv_chunk and the prefill inflight queue; DecodePreallocQueue and
DecodeTransferQueue; gloo groups for their all-reduced polls; sglang's HTTP
bootstrap server; kvwire on real rxe. Separate processes, one per rank and
side (2 prefill + 2 decode) and one for sglang's bootstrap server (as sglang
runs it in the HTTP server's process), all started by one launcher with
multiprocessing's spawn (sglang's start method: each imports sglang and
kvwire afresh), shared by the cases; each case is its own test below. What is real and every
stand-in, with why, are listed in sglang_queues_harness.py's docstring:
FakeReq, CpuKVPool, PagedAllocator, PrefillReqToTokenPool, FakeTreeCache,
RecordingMetadataBuffers (records the bootstrap_room read), PrefillSched /
DecodeSched (the scheduler object and its loop), plus the module stubs in
python/tests/sglang_stubs for the rest of sglang."""
import os
import re
import signal
import subprocess
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import sglang_ref  # noqa: E402

HARNESS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sglang_queues_harness.py")
pytestmark = pytest.mark.skipif(bool(sglang_ref.missing()), reason=sglang_ref.missing() or "-")
WORLD = 2


# One set of processes runs every case in turn (torch's import costs seconds
# in a TCG guest); in freeze22 the test SIGSTOPs prefill, then resumes it; in
# kill22, last, it SIGKILLs prefill.
CASES = ("tp11,tp22,abort22,dpattn,mla21,mha21,mha12,mla12,mha12noflag,hybrid22,"
         "hybrid21,prefix11,pp21,freeze22,kill22")


def _report(text, tag):
    report = os.environ.get("KVWIRE_TEST_REPORT")  # python_scenarios.sh shows these lines
    if report:
        with open(report, "a") as f:
            for line in text.splitlines():
                if "as expected:" in line or "after prefill was" in line:
                    f.write(f"sglang queues ({tag}) {line}\n")


def _signal_prefill(tmp, sig, roles=("prefill",)):
    for line in (tmp / "pids").read_text().splitlines():
        role, _, pid = line.split()
        if role in roles:
            os.kill(int(pid), sig)


def _wait(tmp, names, launcher, end):
    while not all((tmp / n).exists() for n in names) and time.monotonic() < end and \
            launcher.poll() is None:
        time.sleep(0.1)
    return all((tmp / n).exists() for n in names)


def _ready(case):
    """decode has every request in its transfer queue, every prefill rank
    is in its stalled forward pass"""
    return [f"{case}.ready"] + [f"{case}.prefill{r}" for r in range(WORLD)]


def _stop_prefill_when_ready(tmp, launcher, secs):
    """freeze22: once decode has every request in its transfer queue,
    SIGSTOP every prefill rank, tell decode; SIGCONT once decode has failed
    them. kill22: then SIGKILL every prefill rank at the same point."""
    end = time.monotonic() + secs
    if _wait(tmp, _ready("freeze22"), launcher, end):
        _signal_prefill(tmp, signal.SIGSTOP)
        (tmp / "freeze22.stopped").write_text("")
        # waiting timeout (12 s) + kvwire's abort barrier (peer timeout, 30 s)
        _wait(tmp, ["freeze22.failed"], launcher, time.monotonic() + 200)
        _signal_prefill(tmp, signal.SIGCONT)
        (tmp / "freeze22.release").write_text("")
    if _wait(tmp, _ready("kill22"), launcher, end):
        # the whole prefill server: its schedulers and its bootstrap server
        _signal_prefill(tmp, signal.SIGKILL, ("prefill", "bootstrap"))
        (tmp / "kill22.stopped").write_text("")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """2 prefill + 2 decode rank processes running CASES in turn."""
    tmp = tmp_path_factory.mktemp("queues")
    env = os.environ
    dev0, ip0 = env["KVW_TB_DEV0"], env["KVW_TB_IP0"]
    dev1, ip1 = env.get("KVW_TB_DEV1", dev0), env.get("KVW_TB_IP1", ip0)
    t0 = time.monotonic()
    launcher = subprocess.Popen(
        [sys.executable, HARNESS, "--world", str(WORLD), "--ip0", ip0, "--dev0", dev0,
         "--ip1", ip1, "--dev1", dev1, "--rendezvous", str(tmp), "--cases", CASES],
        # kvwire declares a peer silent for peer_timeout_ms (2 s) dead: the TCG
        # guest on a loaded host starves a process that long (tp22 failed so
        # once, "prefill rank 0 silent for 2000 ms"); freeze22 sets 60 s itself.
        env=dict(env, GLOO_SOCKET_IFNAME="lo", KVW_PEER_TIMEOUT_MS="10000"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True)
    try:
        _stop_prefill_when_ready(tmp, launcher, 900)  # spawned imports: 130 to 210 s in a TCG guest
        out = launcher.communicate(timeout=240)[0]
    finally:
        if launcher.poll() is None:  # a rank hung: end them all
            for line in (tmp / "pids").read_text().splitlines() if (tmp / "pids").exists() \
                    else []:
                try:
                    os.kill(int(line.split()[2]), signal.SIGKILL)
                except ProcessLookupError:
                    pass
            launcher.kill()
            out = launcher.communicate()[0]
    codes, text = {}, ""
    for role in ("prefill", "decode"):
        for r in range(WORLD):
            log, rc = tmp / f"{role}{r}.log", tmp / f"{role}{r}.rc"
            text += log.read_text() + "\n" if log.exists() else f"{role} rank {r}: no log\n"
            codes[(role, r)] = int(rc.read_text()) if rc.exists() else None
    log = tmp / "bootstrap0.log"
    text += log.read_text() + "\n" if log.exists() else "bootstrap server: no log\n"
    text += out + f"(all ranks ended {time.monotonic() - t0:.1f} s after the launcher started)"
    print(text)
    _report(text, f"{time.monotonic() - t0:.0f} s")
    return codes, text


def _case_ok(run, case, nprefill, ndecode):
    """Every rank of the case on each side said "as expected: True" (its
    requests ended as the case expects, every byte right, nothing held)."""
    codes, text = run
    for (role, r), rc in codes.items():  # prefill ranks end SIGKILLed in kill22
        want = -signal.SIGKILL if role == "prefill" else 0
        assert rc == want, f"{role} rank {r} exited {rc}:\n{text[-4000:]}"
    for role, n in (("prefill", nprefill), ("decode", ndecode)):
        for r in range(n):
            assert f"{role} {case} rank {r}: " in text, (case, role, r)
    for r in range(ndecode):
        assert f"decode {case} rank {r}: 0 bytes wrong" in text, (case, r)
    lines = [x for x in text.splitlines() if f" {case} rank " in x and "as expected:" in x]
    assert len(lines) == nprefill + ndecode, lines
    assert all(x.endswith("as expected: True") for x in lines), lines
    assert not [x for x in text.splitlines() if f" {case} rank " in x and "<-- unexpected" in x]


def test_tp11_chunked(run):
    """TP 1 -> 1, chunked prefill: every byte, first token, cached tokens,
    bootstrap_room; no page or metadata slot left held."""
    _case_ok(run, "tp11", 1, 1)


def test_tp22_chunked(run):
    """TP 2 -> 2, one process per rank, the polls all-reduced over gloo."""
    _case_ok(run, "tp22", 2, 2)


def test_aborts_on_either_side(run):
    """Prefill aborts a request after its first chunk, decode one in its
    transfer queue and one in its prealloc queue: those fail on both sides
    (the last one on decode only), the other three succeed, every page back."""
    _case_ok(run, "abort22", 2, 2)


def test_dp_attention_both_sides(run):
    """tp 2, attn_tp 1, dp 2 on both sides: each prefill DP rank gets the
    rooms follow_bootstrap_room gives it, decode DP ranks others; decode
    resolves the prefill DP rank through sglang's prefill_info_table."""
    _case_ok(run, "dpattn", 2, 2)


def test_mla_2_to_1(run):
    """MLA, prefill TP 2 -> decode TP 1: one prefill rank sends, the other is
    asked for nothing and reaches Success; every byte right on decode. The
    transfer metric sglang's inflight queue observes counts the copy once:
    the rank that sent reports its bytes, the other 0."""
    _case_ok(run, "mla21", 2, 1)
    per_room = {}
    for m in re.finditer(r"prefill mla21 rank (\d)\| room (\d+): FINISH_LENGTH .* "
                         r"sglang's metric (\d+) bytes", run[1]):
        per_room.setdefault(m.group(2), []).append(int(m.group(3)))
    assert len(per_room) == 5, per_room
    for room, got in per_room.items():
        assert len(got) == 2 and min(got) == 0 and max(got) > 0, (room, got)


def test_mha_2_to_1_head_slicing(run):
    """MHA, prefill TP 2 -> decode TP 1 (4 KV heads: each prefill rank holds
    2, decode 4): decode's one kvwire receiver over both prefill ranks takes
    heads 0-1 from rank 0 and 2-3 from rank 1; every byte of every head of
    every token right on decode, first token and bootstrap_room too. Each
    prefill rank's metric is its own pages' bytes (its heads of each token)."""
    _case_ok(run, "mha21", 2, 1)
    per_room = {}
    for m in re.finditer(r"prefill mha21 rank (\d)\| room (\d+): FINISH_LENGTH .* "
                         r"sglang's metric (\d+) bytes", run[1]):
        per_room.setdefault(m.group(2), []).append(int(m.group(3)))
    assert len(per_room) == 5, per_room
    for room, got in per_room.items():
        assert len(got) == 2 and min(got) > 0 and got[0] == got[1], (room, got)


def test_mha_1_to_2_fanout(run):
    """MHA, prefill TP 1 -> decode TP 2 (4 KV heads: prefill holds 4, each
    decode rank 2): the prefill rank's one kvwire sender per room serves
    both decode ranks (kvw_sender_create_fanout, prefill told decode's TP
    through sglang's --disaggregation-decode-tp), each its heads gathered;
    every byte of every head of every token right on each decode rank,
    first token and bootstrap_room too."""
    _case_ok(run, "mha12", 1, 2)


def test_mla_1_to_2_fanout(run):
    """MLA, prefill TP 1 -> decode TP 2: the latent (replicated) whole to
    both decode ranks from the one prefill rank, each its own metadata;
    every byte right on each; sglang's metric counts both copies (the
    harness checks it is twice one copy's pages x item bytes)."""
    _case_ok(run, "mla12", 1, 2)


def test_mha_1_to_2_fanout_without_the_flag(run):
    """mha12 with prefill started without --disaggregation-decode-tp: each
    decode rank's request says how many decode ranks ask (sglang's
    required_dst_info_num), the prefill rank's sender learns it and serves
    both their heads; every byte right on each."""
    _case_ok(run, "mha12noflag", 1, 2)


def test_hybrid_mamba_swa(run):
    """TP 2 -> 2, a hybrid model: Mamba state (one slot per request, from
    sglang's req_index_to_mamba_index_mapping) and an SWA pool (its own page
    ids, the window's pages through translate_loc_from_full_to_swa), each
    StateType its own kvwire state group, the payloads built by sglang's
    send_kv_chunk and pop_preallocated; every KV byte, every state byte of
    the window and of the Mamba slot, first token and bootstrap_room right;
    no page, SWA page or Mamba slot left held."""
    _case_ok(run, "hybrid22", 2, 2)
    for r in range(WORLD):
        m = re.search(f"decode hybrid22 rank {r}: (\\d+) state bytes checked .* still held "
                      r"\(0, 0\)", run[1])
        assert m and int(m.group(1)) > 0, (r, run[1][-4000:])


def test_hybrid_2_to_1_refused_with_the_reason(run):
    """Not served: a hybrid model (Mamba, SWA) with prefill TP 2 -> decode
    TP 1 (sglang slices Mamba's state by state_dim_per_tensor; kvwire writes
    a state item whole from one rank): every request fails at once on
    decode, the reason naming both TP sizes and the missing state slicing;
    on prefill by sglang's bootstrap timeout (10 s here: kvwire's handshake
    refused the layouts, the SWA items differing, and names no room); no
    page, slot or state left held."""
    _case_ok(run, "hybrid21", 2, 1)
    assert len(re.findall(r"decode hybrid21 rank 0\| room \d+: Failed: .*not sliced across "
                          r"TP sizes", run[1])) == 5, run[1][-4000:]


def test_decode_prefix_reuse(run):
    """Decode's radix cache on, holding the first 8 tokens (2 pages) of each
    request longer than that (a stand-in radix cache behind sglang's
    match_prefix_for_req): sglang's DecodePreallocQueue allocates only the
    rest, sends decode_prefix_len 8 and those pages' indices; prefill's own
    queues (pop_decode_prefix_len() is 0 under kvwire) hand over every page
    and kvwire writes only the pages decode asked for: sglang's transfer
    metric on prefill counts exactly those (the harness checks it), and
    every byte of the request on decode, prefix and rest, is right."""
    _case_ok(run, "prefix11", 1, 1)
    m = re.search(r"decode prefix11 rank 0: (\d+) of (\d+) requests matched a cached prefix",
                  run[1])
    assert m and int(m.group(1)) == 4 and int(m.group(2)) == 5, run[1][-4000:]


def test_pp2_prefill_to_pp1_decode(run):
    """Prefill PP 2 (two processes, each its PrefillBootstrapQueue with
    pp_rank 0 / 1 and a KV pool of its one layer, registered with sglang's
    bootstrap server as PP ranks), decode PP 1 (both layers): sglang's
    rank mapping gives decode both stages (target_pp_ranks), kvwire
    gathers each stage's layer into decode's pool; every byte of both
    layers, the first token and bootstrap_room (the last stage's
    metadata) right; nothing left held on either side."""
    _case_ok(run, "pp21", 2, 1)


def test_prefill_frozen_fails_by_sglangs_waiting_timeout(run):
    """Both prefill schedulers SIGSTOPped while decode's requests wait in
    sglang's transfer queue; the bootstrap server (its own process) keeps
    answering sglang's heartbeat, kvwire's own peer timers are set to 30 s:
    each decode rank fails them all by sglang's waiting timeout
    (SGLANG_DISAGGREGATION_WAITING_TIMEOUT, 12 s here; "timed out after")
    and frees their pages once kvwire's abort barrier has passed (a frozen
    prefill never confirms: kvwire's peer timeout declares the connection
    dead); no heartbeat verdict; resumed, prefill fails its side too."""
    codes, text = run
    for r in range(WORLD):
        assert codes[("decode", r)] == 0, text[-4000:]
        assert f"decode freeze22 rank {r}: as expected: True" in text, text[-4000:]
        assert re.search(f"prefill freeze22 rank {r}: .*still held \\(0, 0\\), as expected: True",
                         text), text[-4000:]
    # no heartbeat verdict (the bootstrap server answers); at least one decode
    # rank's waiting timeout fired, the all-reduce fails the rest
    got = re.findall(r"decode freeze22 rank \d: (\d+) by this rank's heartbeat, (\d+) by its "
                     r"waiting timeout", text)
    assert len(got) == WORLD, got
    assert all(int(hb) == 0 for hb, _ in got) and max(int(t) for _, t in got) > 0, got
    assert not [x for x in text.splitlines() if " freeze22 rank " in x and "<-- unexpected" in x]


def test_prefill_killed_reaches_failed(run):
    """The whole prefill server (both scheduler ranks and the bootstrap
    server's process) SIGKILLed while decode's requests wait in sglang's
    transfer queue: each decode rank fails them all within sglang's
    heartbeat bound (2 s x 2 here, + 10 s) and frees their pages (kvwire
    sees the control connection close first)."""
    codes, text = run
    for r in range(WORLD):
        assert codes[("decode", r)] == 0, text[-4000:]
        assert f"decode kill22 rank {r}: as expected: True" in text, text[-4000:]
        assert f"prefill kill22 rank {r}: all bootstrapped" in text
