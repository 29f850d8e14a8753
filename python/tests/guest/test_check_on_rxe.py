# SPDX-License-Identifier: Apache-2.0
"""kvwire.check on the test bed's rxe devices: every check passes (port
ACTIVE, the RoCE v2 GID of the device's IPv4 address, a loopback RDMA write
compared byte for byte), as kvwire-info --check does in
tests/integration/engine_scenarios.sh."""
import os

from kvwire import check


def _tool():
    return os.path.join(os.path.dirname(os.environ["KVWIRE_LIB"]), "kvwire-info")


def test_check_passes_on_rxe():
    dev, ip = os.environ["KVW_TB_DEV0"], os.environ["KVW_TB_IP0"]
    r = check.check(device=dev, ip=ip, tool=_tool())
    assert r.ok, r.output
    mine = [v for v in r.verdicts if v.where == dev]
    assert [v.level for v in mine if v.level == "fail"] == []
    texts = "\n".join(v.text for v in mine)
    assert "port 1: ACTIVE" in texts
    assert "RoCEv2 on " in texts and f"::ffff:{ip}" in texts
    assert "loopback RDMA write: 64 KiB written" in texts and "bytes match" in texts
