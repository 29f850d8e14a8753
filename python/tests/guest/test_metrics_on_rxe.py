# SPDX-License-Identifier: Apache-2.0
"""A scrape of a live pair on rxe: the engines' OpenMetrics text
(Engine.metrics_text, kvw_engine_metrics_text) parsed with prometheus_client's
own parser, every family present, and every family that a healthy run
moves non-zero after: a transfer, a request decode sends before prefill's
sender exists (an orphan) and then aborts (the abort and its
confirmation), a second decode engine claiming a room already claimed (a
refusal on both sides), and a prefill restart (decode's reconnect). The
families only faults move (lane failures, replays, ...) are checked present."""
import os
import time

import numpy as np
import pytest

import kvwire
from kvwire import Poll

parser = pytest.importorskip("prometheus_client.openmetrics.parser")

DEV0, IP0 = os.environ.get("KVW_TB_DEV0"), os.environ.get("KVW_TB_IP0")
DEV1 = os.environ.get("KVW_TB_DEV1") or DEV0
IP1 = os.environ.get("KVW_TB_IP1") or IP0
L, POOL, ITEM, AUX_ITEM = 2, 32, 1024, 64

FAMILIES = {
    "kvwire_engine", "kvwire_requests", "kvwire_request_failures", "kvwire_requests_in_flight",
    "kvwire_request_bytes", "kvwire_transfer_seconds", "kvwire_request_seconds",
    "kvwire_posted_bytes", "kvwire_writes", "kvwire_doorbells", "kvwire_completions",
    "kvwire_completion_errors", "kvwire_poller_sleeps", "kvwire_caller_passes",
    "kvwire_replays", "kvwire_rail_posted_bytes", "kvwire_rail_writes",
    "kvwire_rail_lanes_failed", "kvwire_rail_lanes_rejoined", "kvwire_rail_lanes_out",
    "kvwire_rail_probes", "kvwire_rail_link_mbps", "kvwire_handshakes",
    "kvwire_requests_refused", "kvwire_reconnects", "kvwire_orphans", "kvwire_aborts",
    "kvwire_abort_confirmations"}
# Moved only by faults, by load, or back to 0 once everything ended.
MAY_BE_ZERO = {"kvwire_completion_errors", "kvwire_replays", "kvwire_rail_lanes_failed",
               "kvwire_rail_lanes_rejoined", "kvwire_rail_lanes_out", "kvwire_rail_probes",
               "kvwire_requests_in_flight", "kvwire_caller_passes", "kvwire_rail_link_mbps"}


def wait(req, want=None, timeout=30.0):
    end = time.monotonic() + timeout
    while True:
        st = req.poll()
        if st in (Poll.SUCCESS, Poll.FAILED) or st == want:
            return st
        assert time.monotonic() < end, f"room {req.room} stuck in {st.name}"
        time.sleep(0.001)


def scrape(engine):
    return {f.name: f for f in parser.text_string_to_metric_families(engine.metrics_text())}


def value(fams, sample, **labels):
    """The value of the sample (e.g. kvwire_requests_total) whose labels
    include these, in whichever family holds it."""
    for fam in fams.values():
        for s in fam.samples:
            if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    raise KeyError((sample, labels))


@pytest.fixture()
def memory():
    rng = np.random.default_rng(3)
    src = [rng.integers(0, 256, POOL * ITEM, dtype=np.uint8) for _ in range(2 * L)]
    dst = [np.zeros(POOL * ITEM, dtype=np.uint8) for _ in range(2 * L)]
    return src, dst, np.zeros(4 * AUX_ITEM, np.uint8), np.zeros(4 * AUX_ITEM, np.uint8)


def transfer(pre, dec, bs, room):
    with dec.receiver(bs.addr, 0, room) as r, pre.sender(room) as s:
        base = room % 16
        r.init([base, base + 1, base + 2], aux_index=1)
        s.init(3, aux_index=2)
        s.send([3, 4, 5])
        assert wait(r) == Poll.SUCCESS and wait(s) == Poll.SUCCESS, r.failure()


def orphan_then_abort(pre, dec, bs, room):
    with dec.receiver(bs.addr, 0, room) as r:
        r.init([room, room + 1])
        end = time.monotonic() + 30
        while value(scrape(pre), "kvwire_orphans_total", event="held") < 1:
            assert time.monotonic() < end, "prefill never held decode's early request"
            time.sleep(0.005)
        with pre.sender(room) as s:
            s.init(2)
            assert wait(s, Poll.WAITING_FOR_INPUT) == Poll.WAITING_FOR_INPUT
            r.abort()
            assert wait(r) == Poll.FAILED and wait(s) == Poll.FAILED
            assert r.failure().status == kvwire.Status.ERR_ABORTED


def second_claim(pre, dec, dec2, bs, room):
    with dec.receiver(bs.addr, 0, room) as r, pre.sender(room) as s:
        r.init([room, room + 1])
        s.init(2)
        assert wait(s, Poll.WAITING_FOR_INPUT) == Poll.WAITING_FOR_INPUT
        with dec2.receiver(bs.addr, 0, room) as r2:
            r2.init([room, room + 1])
            assert wait(r2) == Poll.FAILED
            assert r2.failure().status == kvwire.Status.ERR_EXISTS
        s.send([1, 2])
        assert wait(r) == Poll.SUCCESS and wait(s) == Poll.SUCCESS


def check(fams_by_engine):
    for fams in fams_by_engine:
        assert FAMILIES <= set(fams), FAMILIES - set(fams)
    for name in FAMILIES - MAY_BE_ZERO:
        top = max(s.value for fams in fams_by_engine for s in fams[name].samples
                  if not s.name.endswith("_created"))
        assert top > 0, f"{name}: every sample is 0"


def test_scrape_live_pair_on_rxe(memory):
    src, dst, srcaux, dstaux = memory
    cfg = kvwire.Config(peer_timeout_ms=2000)
    bs = kvwire.Bootstrap(f"{IP0}:0")

    def prefill():
        return kvwire.Engine("prefill", IP0, device=DEV0, bootstrap_addr=bs.addr, config=cfg,
                             kv=[kvwire.Region.of(a, ITEM) for a in src],
                             aux=[kvwire.Region.of(srcaux, AUX_ITEM)])

    def decode():
        return kvwire.Engine("decode", IP1, device=DEV1, config=cfg,
                             kv=[kvwire.Region.of(a, ITEM) for a in dst],
                             aux=[kvwire.Region.of(dstaux, AUX_ITEM)])

    pre, dec, dec2 = prefill(), decode(), decode()
    try:
        transfer(pre, dec, bs, 1)
        orphan_then_abort(pre, dec, bs, 10)
        second_claim(pre, dec, dec2, bs, 20)
        before = scrape(pre)
        assert value(before, "kvwire_requests_total", outcome="success") == 2
        assert value(before, "kvwire_request_failures_total", cause="aborted") == 1
        assert value(before, "kvwire_abort_confirmations_total") == 1
        assert value(before, "kvwire_requests_refused_total") == 1
        assert value(before, "kvwire_transfer_seconds_count") == 2
        pre.close()  # its process exits; a new one takes rank 0
        pre = prefill()
        transfer(pre, dec, bs, 30)
        fams = [before, scrape(dec)]
        check(fams)
        d = fams[1]
        assert value(d, "kvwire_requests_total", outcome="success") == 3
        assert value(d, "kvwire_reconnects_total") >= 1
        assert value(d, "kvwire_handshakes_total", result="accepted") == 2
        assert value(scrape(dec2), "kvwire_requests_refused_total") == 1
        assert d["kvwire_engine"].samples[0].labels["device"] == DEV1
    finally:
        dec2.close()
        dec.close()
        pre.close()
        bs.close()
