# SPDX-License-Identifier: Apache-2.0
"""kvwire.metrics on the fake NIC: a pair's metrics through prometheus_client,
from a registry (KvwireCollector) and in multiprocess mode (the mirror
thread sglang's --enable-metrics needs), parsed back with prometheus_client's
parser; counts equal to the transfers made. One process per mode
(metrics_fake_nic_scenario.py: the fake NIC is process-wide). Needs
$KVWIRE_FAKE_NIC_LIB (make python-fake-nic; make python-test passes it) and
python3-prometheus-client. Not RDMA: guest/test_metrics_on_rxe.py scrapes rxe."""
import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
LIB = os.environ.get("KVWIRE_FAKE_NIC_LIB", "")

pytest.importorskip("prometheus_client")
pytestmark = pytest.mark.skipif(not LIB or not os.path.exists(LIB),
                                reason="needs $KVWIRE_FAKE_NIC_LIB (make python-fake-nic)")

FAMILIES = sorted([
    "kvwire_engine_info", "kvwire_requests", "kvwire_request_failures",
    "kvwire_requests_in_flight", "kvwire_request_bytes", "kvwire_transfer_seconds",
    "kvwire_request_seconds", "kvwire_posted_bytes", "kvwire_writes", "kvwire_doorbells",
    "kvwire_completions", "kvwire_completion_errors", "kvwire_poller_sleeps",
    "kvwire_caller_passes", "kvwire_replays", "kvwire_rail_posted_bytes", "kvwire_rail_writes",
    "kvwire_rail_lanes_failed", "kvwire_rail_lanes_rejoined", "kvwire_rail_lanes_out",
    "kvwire_rail_probes", "kvwire_rail_link_mbps", "kvwire_handshakes",
    "kvwire_requests_refused", "kvwire_reconnects", "kvwire_orphans", "kvwire_aborts",
    "kvwire_abort_confirmations"])


def run(mode, tmp_path):
    env = dict(os.environ, KVWIRE_LIB=LIB, PYTHONDONTWRITEBYTECODE="1")
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    if mode == "multiprocess":
        env["PROMETHEUS_MULTIPROC_DIR"] = str(tmp_path)
    p = subprocess.run([sys.executable, os.path.join(HERE, "metrics_fake_nic_scenario.py"), mode],
                       env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("mode", ["registry", "multiprocess"])
def test_pair_metrics_through_prometheus_client(mode, tmp_path):
    out = run(mode, tmp_path)
    assert out["families"] == FAMILIES
    assert out["ok"] == {"prefill": 3, "decode": 3}
    assert out["hist_count"] == {"prefill": 3, "decode": 3}
    assert out["posted_bytes"] == out["sent"] > 0
    assert out["handshakes"] == 1
