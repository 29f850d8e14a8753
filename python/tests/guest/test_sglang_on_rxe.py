# SPDX-License-Identifier: Apache-2.0
"""kvwire's sglang backend on sglang's own connection code (the pinned
snapshot), separate prefill and decode processes, real rxe: see
sglang_common_harness.py for what is real and what is stubbed."""
import os
import signal
import subprocess
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import sglang_ref  # noqa: E402

HARNESS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sglang_common_harness.py")
pytestmark = pytest.mark.skipif(bool(sglang_ref.missing()), reason=sglang_ref.missing() or "-")


def _sides():
    env = dict(os.environ)
    dev0, ip0 = env["KVW_TB_DEV0"], env["KVW_TB_IP0"]
    dev1, ip1 = env.get("KVW_TB_DEV1", dev0), env.get("KVW_TB_IP1", ip0)
    # sglang's heartbeat at its minimum (2 s x 2 failures) for the kill case.
    env.update(SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL="2",
               SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE="2")
    return (dict(env, KVWIRE_LOCAL_IP=ip0, SGLANG_HOST_IP=ip0), ip0, dev0), \
           (dict(env, KVWIRE_LOCAL_IP=ip1, SGLANG_HOST_IP=ip1), ip1, dev1)


def _start(side, role, tmp_path, extra):
    env, ip, dev = side
    return subprocess.Popen([sys.executable, HARNESS, role, "--ip", ip, "--dev", dev,
                             "--rendezvous", str(tmp_path)] + extra, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _report(text, tag):
    report = os.environ.get("KVWIRE_TEST_REPORT")  # python_scenarios.sh shows these lines
    if report:
        with open(report, "a") as f:
            for line in text.splitlines():
                if "as expected:" in line or line.startswith("decode kill: Failed"):
                    f.write(f"sglang common ({tag}) {line}\n")


CASES = ["tp22", "dpattn", "mla21", "mha21", "hybrid"]


def test_layouts_on_sglangs_connection_code(tmp_path):
    p, d = _sides()
    extra = ["--cases", ",".join(CASES)]
    t0 = time.monotonic()
    pre = _start(p, "prefill", tmp_path, extra)
    dec = _start(d, "decode", tmp_path, extra)
    try:
        dout, _ = dec.communicate(timeout=540)
        pout, _ = pre.communicate(timeout=120)
    finally:
        for x in (pre, dec):
            if x.poll() is None:
                x.kill()
    print(pout)
    print(dout)
    _report(pout + dout, f"{len(CASES)} layouts, {time.monotonic() - t0:.0f} s")
    assert dec.returncode == 0, dout
    assert pre.returncode == 0, pout
    for c in CASES:
        assert f"decode {c}: 0 bytes wrong, as expected: True" in dout, c


def test_prefill_killed_reaches_failed(tmp_path):
    p, d = _sides()
    pre = _start(p, "prefill", tmp_path, ["--kill-test"])
    dec = _start(d, "decode", tmp_path, ["--kill-test"])
    try:
        end = time.monotonic() + 240
        while not (tmp_path / "kill.ready").exists():
            assert time.monotonic() < end and dec.poll() is None and pre.poll() is None
            time.sleep(0.1)
        pre.send_signal(signal.SIGKILL)
        pre.wait()
        (tmp_path / "kill.killed").write_text("")
        dout, _ = dec.communicate(timeout=120)
    finally:
        for x in (pre, dec):
            if x.poll() is None:
                x.kill()
        pout = pre.stdout.read()
    print(pout)
    print(dout)
    _report(dout, "prefill killed")
    assert dec.returncode == 0, dout
    assert "decode kill: as expected: True" in dout
