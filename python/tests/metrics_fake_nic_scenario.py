# SPDX-License-Identifier: Apache-2.0
"""A prefill and a decode engine of the binding on the fake NIC (libkvwire
built with tests/support/fake_nic.c: `make python-fake-nic`, loaded as
KVWIRE_LIB), TRANSFERS transfers, then the engines' metrics scraped through
kvwire.metrics; run by test_metrics.py, one mode per process (the fake NIC
is process-wide). Prints one JSON line. Not RDMA: the scrape of a live pair
on rxe is guest/test_metrics_on_rxe.py.

    KVWIRE_LIB=build/test/libkvwire-fakenic.so python3 metrics_fake_nic_scenario.py \\
        registry|multiprocess
"""
import ctypes
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # python/

import numpy as np  # noqa: E402

MODE = sys.argv[1]
TRANSFERS, L, POOL, ITEM = 3, 2, 16, 512

nic = ctypes.CDLL(os.environ["KVWIRE_LIB"])  # the library kvwire loads: one instance
assert nic.kvw_test_fake_nic_start(2) == 0

import prometheus_client  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

import kvwire  # noqa: E402
import kvwire.metrics  # noqa: E402


def wait(req):
    end = time.monotonic() + 10
    while req.poll() not in (kvwire.Poll.SUCCESS, kvwire.Poll.FAILED):
        assert time.monotonic() < end
        time.sleep(0.001)
    return req.poll()


src = [np.arange(POOL * ITEM, dtype=np.uint8) for _ in range(2 * L)]
dst = [np.zeros(POOL * ITEM, dtype=np.uint8) for _ in range(2 * L)]
bs = kvwire.Bootstrap("127.0.0.1:0")
pre = kvwire.Engine("prefill", "127.0.0.1", device="fake0", bootstrap_addr=bs.addr,
                    kv=[kvwire.Region.of(a, ITEM) for a in src])
dec = kvwire.Engine("decode", "127.0.0.1", device="fake1",
                    kv=[kvwire.Region.of(a, ITEM) for a in dst])
registry = prometheus_client.CollectorRegistry() if MODE == "registry" else None
for e in (pre, dec):
    kvwire.metrics.register(e, registry=registry, interval=0.05)
sent = 0
for room in range(1, TRANSFERS + 1):
    with dec.receiver(bs.addr, 0, room) as r, pre.sender(room) as s:
        r.init([room, room + 5])
        s.init(2)
        s.send([room, room + 1])
        assert wait(r) == kvwire.Poll.SUCCESS and wait(s) == kvwire.Poll.SUCCESS
        sent += s.metrics().bytes

out = {"sent": sent}
if MODE == "registry":
    text = prometheus_client.generate_latest(registry).decode()
else:
    from prometheus_client import multiprocess

    for e in (pre, dec):
        kvwire.metrics.unregister(e)  # the last values, written at once
    reg = prometheus_client.CollectorRegistry()
    multiprocess.MultiProcessCollector(reg)
    text = prometheus_client.generate_latest(reg).decode()
fams = {f.name: f for f in text_string_to_metric_families(text)}


def value(name, sample, **labels):
    for s in fams[name].samples:
        if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()):
            return s.value
    raise KeyError((name, sample, labels))


out["families"] = sorted(n for n in fams if n.startswith("kvwire"))
out["ok"] = {role: value("kvwire_requests", "kvwire_requests_total", role=role,
                         outcome="success") for role in ("prefill", "decode")}
out["hist_count"] = {role: value("kvwire_transfer_seconds", "kvwire_transfer_seconds_count",
                                 role=role) for role in ("prefill", "decode")}
out["posted_bytes"] = value("kvwire_posted_bytes", "kvwire_posted_bytes_total", role="prefill")
out["handshakes"] = value("kvwire_handshakes", "kvwire_handshakes_total", role="decode",
                          result="accepted")
dec.close()
pre.close()
bs.close()
nic.kvw_test_fake_nic_stop()
print(json.dumps(out))
