"""The binding on real rxe: prefill and decode engines (in this process),
every byte checked, chunked sends, aborts, out-of-range pages, close order."""
import os
import time

import numpy as np
import pytest

import kvwire
from kvwire import Poll

DEV0, IP0 = os.environ.get("KVW_TB_DEV0"), os.environ.get("KVW_TB_IP0")
DEV1 = os.environ.get("KVW_TB_DEV1") or DEV0
IP1 = os.environ.get("KVW_TB_IP1") or IP0
L, POOL, ITEM, AUX_ITEM = 3, 32, 1024, 64


def wait(req, timeout=30.0):
    end = time.monotonic() + timeout
    while True:
        st = req.poll()
        if st in (Poll.SUCCESS, Poll.FAILED):
            return st
        assert time.monotonic() < end, f"room {req.room} stuck in {st.name}"
        time.sleep(0.001)


@pytest.fixture(scope="module")
def pair():
    rng = np.random.default_rng(7)
    src = [rng.integers(0, 256, POOL * ITEM, dtype=np.uint8) for _ in range(2 * L)]
    srcaux = rng.integers(0, 256, 4 * AUX_ITEM, dtype=np.uint8)
    dst = [np.zeros(POOL * ITEM, dtype=np.uint8) for _ in range(2 * L)]
    dstaux = np.zeros(4 * AUX_ITEM, dtype=np.uint8)
    cfg = kvwire.Config(peer_timeout_ms=2000)
    bs = kvwire.Bootstrap(f"{IP0}:0")
    pre = kvwire.Engine("prefill", IP0, device=DEV0, bootstrap_addr=bs.addr, config=cfg,
                        kv=[kvwire.Region.of(a, ITEM) for a in src],
                        aux=[kvwire.Region.of(srcaux, AUX_ITEM)])
    dec = kvwire.Engine("decode", IP1, device=DEV1, config=cfg,
                        kv=[kvwire.Region.of(a, ITEM) for a in dst],
                        aux=[kvwire.Region.of(dstaux, AUX_ITEM)])
    yield bs, pre, dec, src, dst, srcaux, dstaux
    dec.close()
    pre.close()
    bs.close()


def check(src, dst, sp, dp):
    for r in range(2 * L):
        for s, d in zip(sp, dp):
            s, d = int(s), int(d)
            assert (dst[r][d * ITEM:(d + 1) * ITEM] == src[r][s * ITEM:(s + 1) * ITEM]).all(), (r, s, d)


def test_transfer_every_byte(pair):
    bs, pre, dec, src, dst, srcaux, dstaux = pair
    assert pre.device_name == DEV0 and pre.endpoint.startswith("tcp://")
    sp = np.array([1, 2, 3, 7, 30], dtype=np.uint64)
    dp = np.array([5, 6, 7, 0, 31], dtype=np.int32)  # converted
    with dec.receiver(bs.addr, 0, 100) as r, pre.sender(100) as s:
        r.init(dp, aux_index=2)
        s.init(len(sp), aux_index=1)
        s.send(sp)
        assert wait(r) == Poll.SUCCESS and wait(s) == Poll.SUCCESS
        assert r.failure() is None
        if kvwire.features()["metrics"]:
            m = s.metrics()
            assert m.bytes >= len(sp) * 2 * L * ITEM
    check(src, dst, sp, dp)
    assert (dstaux[2 * AUX_ITEM:3 * AUX_ITEM] == srcaux[AUX_ITEM:2 * AUX_ITEM]).all()
    assert pre.counters().requests_ok >= 1


def test_chunked_send(pair):
    bs, pre, dec, src, dst, *_ = pair
    if not kvwire.features()["send_part"]:
        pytest.skip("libkvwire without chunked sends")
    sp, dp = list(range(10, 22)), list(range(12, 24))
    with dec.receiver(bs.addr, 0, 101) as r, pre.sender(101) as s:
        r.init(dp)
        s.init(len(sp))
        for a, b in ((0, 4), (4, 9), (9, 12)):  # three prefill chunks
            s.send(sp[a:b])
        assert wait(r) == Poll.SUCCESS and wait(s) == Poll.SUCCESS
    check(src, dst, sp, dp)


def test_abort_on_decode_fails_both_sides(pair):
    bs, pre, dec, *_ = pair
    with dec.receiver(bs.addr, 0, 102) as r, pre.sender(102) as s:
        r.init([1, 2])
        r.abort()
        assert wait(r) == Poll.FAILED
        err = r.failure()
        assert isinstance(err, kvwire.Error) and err.status == kvwire.Status.ERR_ABORTED
        with pytest.raises(kvwire.Error) as ei:
            r.abort()
        assert ei.value.status == kvwire.Status.ERR_STATE


def test_out_of_range_pages_raise(pair):
    bs, pre, dec, *_ = pair
    with dec.receiver(bs.addr, 0, 103) as r:
        with pytest.raises(kvwire.Error) as ei:
            r.init([POOL + 5])
        assert ei.value.status == kvwire.Status.ERR_OUT_OF_RANGE
        assert r.poll() == Poll.FAILED


def test_engine_close_closes_requests_then_raises():
    arr = [np.zeros(POOL * ITEM, dtype=np.uint8) for _ in range(2)]
    e = kvwire.Engine("decode", IP1, device=DEV1, kv=[kvwire.Region.of(a, ITEM) for a in arr])
    r = e.receiver(f"{IP0}:1", 0, 104)  # nothing listens there: stays Bootstrapping
    assert r.poll() in (Poll.BOOTSTRAPPING, Poll.FAILED)
    e.close()
    assert r.closed and e.closed
    for call in (r.poll, r.abort, lambda: r.init([1]), lambda: e.sender(1), e.counters):
        with pytest.raises(kvwire.ClosedError):
            call()
    r.close()
    e.close()
