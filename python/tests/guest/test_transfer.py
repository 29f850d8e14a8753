# SPDX-License-Identifier: Apache-2.0
"""The binding on real rxe: prefill and decode engines (in this process),
every byte checked, chunked sends, aborts, out-of-range pages, close order."""
import ctypes.util
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


def test_layerwise_send_part(pair):
    bs, pre, dec, src, dst, *_ = pair
    if not kvwire.features()["send_part"]:
        pytest.skip("libkvwire without send_part")
    sp, dp = [0, 1, 2, 3, 9, 10], [20, 21, 22, 23, 24, 2]
    with dec.receiver(bs.addr, 0, 105) as r, pre.sender(105) as s:
        r.init(dp)
        s.init(len(sp))
        s.send_part(sp, 0, 0, 1)              # layer 0, every page
        s.send_part(sp[:4], 0, 1, L)          # layers 1.., the first chunk
        assert r.poll() != Poll.SUCCESS       # not complete before the last part
        s.send_part(np.array(sp[4:], dtype=np.uint64), 4, 1, L)
        assert wait(r) == Poll.SUCCESS and wait(s) == Poll.SUCCESS
        m = r.metrics()
        assert m.bytes == len(sp) * 2 * L * ITEM
    check(src, dst, sp, dp)


def test_event_without_cuda_is_refused(pair):
    """The guest has no CUDA: a producer's event is refused with the
    library's reason, nothing changes, and the same pages go without one."""
    bs, pre, dec, src, dst, *_ = pair
    if not kvwire.features()["send_after"]:
        pytest.skip("libkvwire without producer events")
    if ctypes.util.find_library("cuda"):
        pytest.skip("CUDA is installed here: the made-up event would be queried")
    sp, dp = [4, 5, 6], [25, 26, 27]
    with dec.receiver(bs.addr, 0, 106) as r, pre.sender(106) as s:
        r.init(dp)
        s.init(len(sp))
        for call in (lambda: s.send(sp, event=0x1000),
                     lambda: s.send_part(sp, 0, 0, L, event=0x1000)):
            with pytest.raises(kvwire.Error) as ei:
                call()
            assert ei.value.status == kvwire.Status.ERR_UNSUPPORTED
            assert "CUDA is not available" in ei.value.reason
        s.send_part(sp, 0, 0, L, event=None)
        assert wait(r) == Poll.SUCCESS and wait(s) == Poll.SUCCESS
    check(src, dst, sp, dp)


def test_groups_mla_aux_and_state():
    if not kvwire.features()["groups"]:
        pytest.skip("libkvwire without buffer groups")
    rng = np.random.default_rng(9)
    LAY, SITEM = 3, 256

    def memory(fill):
        mk = (lambda n: rng.integers(0, 256, n, dtype=np.uint8)) if fill else \
            (lambda n: np.zeros(n, dtype=np.uint8))
        kv = [mk(POOL * ITEM) for _ in range(LAY)]          # MLA: one region per layer
        aux = [mk(4 * 64), mk(4 * 128)]                     # two metadata buffers
        state = [mk(8 * SITEM)]                             # e.g. a Mamba state pool
        groups = [kvwire.Group(kvwire.GroupKind.KV, LAY, 1, [kvwire.Region.of(a, ITEM) for a in kv]),
                  kvwire.Group(kvwire.GroupKind.AUX, 1, 2, [kvwire.Region.of(aux[0], 64),
                                                            kvwire.Region.of(aux[1], 128)]),
                  kvwire.Group(kvwire.GroupKind.STATE, 1, 1, [kvwire.Region.of(state[0], SITEM)])]
        return kv, aux, state, groups

    skv, saux, sst, sg = memory(True)
    dkv, daux, dst_, dg = memory(False)
    with kvwire.Bootstrap(f"{IP0}:0") as bs, \
            kvwire.Engine("prefill", IP0, device=DEV0, bootstrap_addr=bs.addr, groups=sg) as pre, \
            kvwire.Engine("decode", IP1, device=DEV1, groups=dg) as dec:
        sp, dp = [4, 5, 6], [7, 8, 30]
        with dec.receiver(bs.addr, 0, 200) as r, pre.sender(200) as s:
            r.init(dp, aux_index=3, state=[6])
            s.init(len(sp), aux_index=1)
            s.send_state([2])
            s.send(sp)
            assert wait(r) == Poll.SUCCESS, r.failure()
            assert wait(s) == Poll.SUCCESS
        for i in range(LAY):
            for a, b in zip(sp, dp):
                assert (dkv[i][b * ITEM:(b + 1) * ITEM] == skv[i][a * ITEM:(a + 1) * ITEM]).all()
        assert (daux[0][3 * 64:4 * 64] == saux[0][64:128]).all()
        assert (daux[1][3 * 128:4 * 128] == saux[1][128:256]).all()
        assert (dst_[0][6 * SITEM:7 * SITEM] == sst[0][2 * SITEM:3 * SITEM]).all()


def test_fanout_two_decode_engines(pair):
    """One prefill sender serving a room to two decode engines
    (kvw_sender_create_fanout: sglang's decode TP > prefill TP, here
    without heads, the replicated MLA case): every byte and the aux item on
    both, chunked; then one decode engine aborts mid-request and the room
    fails on every side."""
    if not kvwire.features().get("sender_fanout"):
        pytest.skip("libkvwire without kvw_sender_create_fanout")
    bs, pre, dec, src, dst, srcaux, dstaux = pair
    dst2 = [np.zeros(POOL * ITEM, dtype=np.uint8) for _ in range(2 * L)]
    dstaux2 = np.zeros(4 * AUX_ITEM, dtype=np.uint8)
    dec2 = kvwire.Engine("decode", IP1, device=DEV1, config=kvwire.Config(peer_timeout_ms=2000),
                         kv=[kvwire.Region.of(a, ITEM) for a in dst2],
                         aux=[kvwire.Region.of(dstaux2, AUX_ITEM)])
    try:
        sp = np.array([4, 9, 10, 11, 25, 26], dtype=np.uint64)
        dp = np.array([12, 13, 3, 20, 21, 2], dtype=np.uint64)
        with pre.sender(300, receivers=2) as s, dec.receiver(bs.addr, 0, 300) as r1, \
                dec2.receiver(bs.addr, 0, 300) as r2:
            r1.init(dp, aux_index=3)
            r2.init(dp, aux_index=3)
            s.init(len(sp), aux_index=0)
            s.send(sp[:3])
            s.send(sp[3:])
            assert wait(r1) == Poll.SUCCESS and wait(r2) == Poll.SUCCESS
            assert wait(s) == Poll.SUCCESS
        check(src, dst, sp, dp)
        check(src, dst2, sp, dp)
        for d in (dstaux, dstaux2):
            assert (d[3 * AUX_ITEM:4 * AUX_ITEM] == srcaux[:AUX_ITEM]).all()
        # One decode engine gives up after the first chunk: all fail.
        with pre.sender(301, receivers=2) as s, dec.receiver(bs.addr, 0, 301) as r1, \
                dec2.receiver(bs.addr, 0, 301) as r2:
            r1.init(dp, aux_index=None)
            r2.init(dp, aux_index=None)
            s.init(len(sp), aux_index=None)
            s.send(sp[:3])
            r2.abort()
            assert wait(r2) == Poll.FAILED and wait(r1) == Poll.FAILED
            assert wait(s) == Poll.FAILED
            assert "of 2" in s.failure().reason
    finally:
        dec2.close()
