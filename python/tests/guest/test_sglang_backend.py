# SPDX-License-Identifier: Apache-2.0
"""kvwire.sglang driven as sglang's schedulers drive it: separate prefill
and decode processes (sglang_harness.py), two TP ranks each, real rxe."""
import os
import subprocess
import sys

import pytest

import kvwire

HARNESS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sglang_harness.py")


@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla-3-layers"])
def test_prefill_decode_processes(tmp_path, mla):
    if mla and not kvwire.features()["groups"]:
        pytest.skip("an odd number of MLA layers needs buffer groups")
    env = dict(os.environ)
    dev0, ip0 = env["KVW_TB_DEV0"], env["KVW_TB_IP0"]
    dev1, ip1 = env.get("KVW_TB_DEV1", dev0), env.get("KVW_TB_IP1", ip0)
    extra = ["--mla"] if mla else []
    pre = subprocess.Popen([sys.executable, HARNESS, "prefill", "--ip", ip0, "--dev", dev0,
                            "--rendezvous", str(tmp_path)] + extra, env=dict(env, KVWIRE_LOCAL_IP=ip0),
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    dec = subprocess.Popen([sys.executable, HARNESS, "decode", "--ip", ip1, "--dev", dev1,
                            "--rendezvous", str(tmp_path)] + extra, env=dict(env, KVWIRE_LOCAL_IP=ip1),
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        dout, _ = dec.communicate(timeout=300)
        pout, _ = pre.communicate(timeout=120)
    finally:
        for p in (pre, dec):
            if p.poll() is None:
                p.kill()
    print(pout)
    print(dout)
    report = os.environ.get("KVWIRE_TEST_REPORT")  # python_scenarios.sh shows these lines
    if report:
        with open(report, "a") as f:
            for line in (pout + dout).splitlines():
                if line.startswith(("prefill:", "decode:")):
                    f.write(f"sglang harness ({'mla' if mla else 'mha'}) {line}\n")
    assert dec.returncode == 0, dout
    assert pre.returncode == 0, pout
    assert "0 bytes wrong, as expected: True" in dout
