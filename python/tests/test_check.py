# SPDX-License-Identifier: Apache-2.0
"""kvwire.check (python3 -m kvwire.check): the self-test from Python failing,
with its reason and exit status: on a host with no RDMA device (as this
project's build machines; skipped elsewhere), and for a device that is not
there (any host). On rxe it passes: python/tests/guest/test_check_on_rxe.py."""
import os
import subprocess
import sys

import pytest

from kvwire import check


def _tool():
    lib = os.environ.get("KVWIRE_LIB")
    built = os.path.join(os.path.dirname(lib), "kvwire-info") if lib else ""
    return built if os.access(built, os.X_OK) else check.find_tool()


@pytest.fixture
def tool(monkeypatch):
    monkeypatch.setenv("KVWIRE_INFO", _tool())


@pytest.fixture
def no_device(tool):
    if os.path.isdir("/sys/class/infiniband") and os.listdir("/sys/class/infiniband"):
        pytest.skip("this host has RDMA devices")


def test_no_device_fails_with_reason(no_device):
    r = check.check()
    assert r.returncode == 1 and not r.ok
    fails = r.failures()
    assert fails and fails[0].where == "RDMA devices"
    assert fails[0].text.startswith("none found")
    assert "kvw-rxe up IFACE" in fails[0].text  # the fix
    assert any(v.where == "this node" and v.text.startswith("memlock limit") for v in r.verdicts)
    assert r.output.rstrip().endswith("warnings)") or r.output.rstrip().endswith("warning)")


def test_named_device_missing(tool):
    r = check.check(device="rxe_nosuch")
    assert r.returncode == 1
    assert [v.text for v in r.failures()] == ["no RDMA device named rxe_nosuch"]


def test_module_entry_point(no_device):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    p = subprocess.run([sys.executable, "-m", "kvwire.check"], env=env, stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, text=True, check=False)
    assert p.returncode == 1
    assert "  [FAIL] none found" in p.stdout
    assert "kvwire-info --check: FAILED" in p.stdout


def test_bad_ip_is_refused(tool):
    r = check.check(ip="banana")
    assert r.returncode == 1
    assert "invalid --ip 'banana': not an IPv4 address" in r.output
