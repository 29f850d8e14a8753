# SPDX-License-Identifier: Apache-2.0
"""The binding's constructors against random shapes (hypothesis): every
call either works or raises a Python error, and none reaches libkvwire
with a length or an integer it was not given.

Engines are created for real, on a device that does not exist: the
library validates every parameter (its count checks included, 1.4) before
it looks for the device, so a shape it accepts ends in KVW_ERR_NO_DEVICE.
kvw_engine_create is wrapped to see the params the binding built; the
library's own count check (num_kv_regions, group_num_regions,
num_group_heads) must never be the one that refuses: the binding refuses
first. Requests (Sender, Receiver) use a dummy handle and stand-in C
functions that record what they were given."""

import contextlib
import ctypes
import threading

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context

import kvwire
from kvwire import _core, _engine

NO_DEVICE = "kvw-no-such-device0"
SIZE_MAX = (1 << (8 * ctypes.sizeof(ctypes.c_size_t))) - 1
PTR_MAX = (1 << (8 * ctypes.sizeof(ctypes.c_void_p))) - 1
U32_MAX = (1 << 32) - 1
U64_MAX = (1 << 64) - 1
PY_ERRORS = (TypeError, ValueError, OverflowError)
# What the library logs when a count refuses a shape (src/engine/engine.c).
COUNT_LINES = ("num_kv_regions is", "num_group_heads is", "group_num_regions")

# Deterministic (a failure reproduces), and nothing written to the tree.
SHAPES = settings(max_examples=300, derandomize=True, database=None, deadline=None,
                  suppress_health_check=[HealthCheck.too_slow])

# Real memory for the regions meant to be good (the library never touches
# it here, but a shape it accepts names memory that exists).
POOL = bytearray(1 << 20)
POOL_BASE = ctypes.addressof((ctypes.c_char * len(POOL)).from_buffer(POOL))

# ------------------------------------------------------------ strategies

# Integers around every edge a C type has, and values that are no integer.
EDGES = [0, 1, -1, U32_MAX, U32_MAX + 1, 1 << 63, SIZE_MAX, SIZE_MAX + 1, (1 << 64) + 8192,
         -(1 << 64)]
ints = st.one_of(st.integers(0, 4096), st.integers(-(1 << 70), 1 << 70), st.sampled_from(EDGES))
junk = st.sampled_from([None, 2.0, 0.5, "8", b"8", True, False, [], (1,)])
fields = st.one_of(ints, junk)


@st.composite
def good_region(draw):
    item = draw(st.integers(1, 4096))
    items = draw(st.integers(1, 16))
    off = draw(st.integers(0, len(POOL) // 2))
    return kvwire.Region(POOL_BASE + off, item * items, item)


any_region = st.one_of(
    good_region(),
    st.tuples(fields, fields, fields),
    st.tuples(ints, ints, ints),
    st.tuples(ints, ints),                      # too few fields
    st.tuples(ints, ints, ints, ints),          # too many
    st.builds(lambda a, n: (a, n * 3 + 1, 3), st.integers(1, 1 << 40), st.integers(0, 100)),
    st.builds(lambda n: (PTR_MAX - n, 2 * n + 2, 1), st.integers(0, 1 << 20)),  # past the end
    junk,
)


def _mutate(draw, regs, layers):
    """Most often nothing; else a region dropped or added, one replaced by
    anything, or the layer count replaced by anything."""
    how = draw(st.sampled_from(["none"] * 5 + ["drop", "extra", "region", "layers"]))
    regs = list(regs)
    if how == "drop" and regs:
        del regs[draw(st.integers(0, len(regs) - 1))]
    elif how == "extra":
        regs += draw(st.lists(good_region(), min_size=1, max_size=3))
    elif how == "region" and regs:
        regs[draw(st.integers(0, len(regs) - 1))] = draw(any_region)
    elif how == "layers":
        layers = draw(fields)
    return regs, layers


@st.composite
def classic_shapes(draw):
    layers = draw(st.integers(1, 3))
    kv = draw(st.lists(good_region(), min_size=2 * layers, max_size=2 * layers))
    kv, num_layers = _mutate(draw, kv, draw(st.sampled_from([layers, None])))
    aux = draw(st.lists(st.one_of(good_region(), good_region(), any_region), max_size=2))
    return kv, num_layers, aux


@st.composite
def group_shapes(draw):
    layers, per = draw(st.integers(1, 3)), draw(st.integers(1, 2))
    regs = draw(st.lists(good_region(), min_size=layers * per, max_size=layers * per))
    regs, layers = _mutate(draw, regs, layers)
    kind = draw(st.sampled_from([0, 0, 1, 2]))
    # (sampled_from, not one_of: hypothesis favours one_of's odd branches)
    spoil = draw(st.sampled_from(["kind", "per", "tuple"] + ["none"] * 9))
    if spoil == "kind":
        kind = draw(fields)
    elif spoil == "per":
        per = draw(fields)
    g = (kind, layers, per, regs)
    return g[:3] if spoil == "tuple" else draw(st.sampled_from([kvwire.Group(*g), g]))


heads_entry = st.sampled_from(["none", "none", "heads", "junk"]).flatmap(
    lambda k: st.none() if k == "none" else junk if k == "junk" else
    st.builds(kvwire.GroupHeads, ints, ints, ints, ints, ints,
              st.sampled_from(["NHD", "HND", 0, 1, 2, "XYZ", True])))

# ---------------------------------------------------------------- oracle
#
# What the binding must accept, said independently of its code: every
# integer fits its C type, every region is one the library accepts, and
# every array has the length its layout reads.


def _int(v, hi, lo=0):
    return not isinstance(v, bool) and isinstance(v, int) and lo <= v <= hi


def region_ok(r):
    if isinstance(r, kvwire.Region):
        r = tuple(r[:3])
    if not isinstance(r, (tuple, list)) or len(r) != 3 or not all(_int(v, U64_MAX) for v in r):
        return False
    addr, length, item = r
    return (0 < addr and addr + length - 1 <= PTR_MAX and 0 < length <= SIZE_MAX and
            0 < item and length % item == 0)


def classic_ok(kv, num_layers, aux):
    if not all(region_ok(r) for r in kv + aux):
        return False
    if num_layers is None:
        return len(kv) > 0 and len(kv) % 2 == 0
    return _int(num_layers, U32_MAX // 2, 1) and len(kv) == 2 * num_layers


def group_ok(g):
    if not isinstance(g, (tuple, list)) or len(g) != 4:
        return False
    kind, layers, per, regs = g
    return (_int(kind, 2) and _int(layers, U32_MAX) and _int(per, U32_MAX) and
            len(regs) == layers * per > 0 and all(region_ok(r) for r in regs))


def heads_ok(heads, want):
    if heads is None:
        return True
    if len(heads) != want:
        return False
    for h in heads:
        if h is None:
            continue
        if not isinstance(h, kvwire.GroupHeads) or not all(_int(v, U32_MAX) for v in h[:5]):
            return False
        if h.page_order not in ("NHD", "HND") and not (_int(h.page_order, 1)):
            return False
    return True


# ------------------------------------------------------------ the library


@contextlib.contextmanager
def reaching_c():
    """kvw_engine_create wrapped: each call's params (a copy of what the
    binding built, the arrays read through its counts) are recorded, then
    the real library answers. The library's log lines are kept too."""
    real = _core._c.kvw_engine_create
    seen, lines = [], []

    def wrapped(pp, hp):
        p = pp._obj
        seen.append({
            "num_layers": p.num_layers, "num_kv_regions": p.num_kv_regions,
            "num_aux": p.num_aux, "num_groups": p.num_groups,
            "group_shapes": [(p.groups[i].num_layers, p.groups[i].regions_per_layer)
                             for i in range(p.num_groups)],
            "group_num_regions": ([p.group_num_regions[i] for i in range(p.num_groups)]
                                  if p.group_num_regions else None),
            "has_heads": bool(p.group_heads), "num_group_heads": p.num_group_heads,
        })
        return real(pp, hp)

    level = _core._log_level
    _core._c.kvw_engine_create = wrapped
    kvwire.set_log_handler(lambda lvl, msg: lines.append(msg), kvwire.LogLevel.ERROR)
    try:
        yield seen, lines
    finally:
        _core._c.kvw_engine_create = real
        kvwire.set_log_handler(None, level)


def _event(what):
    """What a shape came to (--hypothesis-show-statistics counts them)."""
    if currently_in_test_context():
        event(what)


def create(expect_ok, **kw):
    """Engine(**kw) on no device: the binding refuses a bad shape (a
    Python error, the library never called), and hands a good one to the
    library, which (its counts checked) gets as far as the device. Returns
    the params the library saw (None when refused)."""
    with reaching_c() as (seen, lines):
        try:
            kvwire.Engine("decode", "127.0.0.1", device=NO_DEVICE, **kw).close()
            raise AssertionError("an engine on a device that does not exist")
        except PY_ERRORS as e:
            assert seen == [], f"refused after reaching C: {e}"
            assert not expect_ok, f"a good shape refused: {e!r}"
            assert str(e)  # names the problem
            _event(f"refused: {type(e).__name__}")
            return None
        except kvwire.Error as e:
            assert expect_ok, f"a bad shape reached the library: {kw}"
            assert len(seen) == 1
            assert not [ln for ln in lines if any(c in ln for c in COUNT_LINES)], lines
            status = e.status
    _event(f"reached the library: {kvwire.Status(status).name}")
    return seen[0], status


@SHAPES
@given(classic_shapes(), st.one_of(st.none(), st.lists(heads_entry, max_size=2)))
def test_engine_classic_shapes(shape, heads):
    kv, num_layers, aux = shape
    ok = classic_ok(kv, num_layers, aux) and heads_ok(heads, 1)
    got = create(ok, kv=kv, num_layers=num_layers, aux=aux, group_heads=heads)
    if got is None:
        return
    p, status = got
    # The counts are the lengths of the lists given, and the layout's own.
    assert p["num_kv_regions"] == len(kv) == 2 * p["num_layers"]
    assert p["num_aux"] == len(aux) and p["num_groups"] == 0
    assert p["group_num_regions"] is None
    assert p["num_group_heads"] == (0 if heads is None else 1) and p["has_heads"] == (
        heads is not None)
    # Regions the library accepts: with no heads described (a heads
    # description may still disagree with the item lengths) only the
    # device is missing.
    if not heads or all(h is None for h in heads):
        assert status == kvwire.Status.ERR_NO_DEVICE
    else:
        assert status in (kvwire.Status.ERR_NO_DEVICE, kvwire.Status.ERR_INVALID)


@SHAPES
@given(st.lists(group_shapes(), min_size=1, max_size=3),
       st.sampled_from([None, None, None, "list"]).flatmap(
           lambda k: st.none() if k is None else st.lists(heads_entry, max_size=3)))
def test_engine_group_shapes(groups, heads):
    ok = all(group_ok(tuple(g)) for g in groups) and heads_ok(heads, len(groups))
    got = create(ok, groups=groups, group_heads=heads)
    if got is None:
        return
    p, status = got
    assert p["num_groups"] == len(groups) and p["num_kv_regions"] == 0
    assert p["group_num_regions"] == [len(g[3]) for g in groups]
    assert [a * b for a, b in p["group_shapes"]] == p["group_num_regions"]
    assert p["num_group_heads"] == (0 if heads is None else len(groups))
    # The layout's own rules (a KV group needed, AUX one layer, ...) may
    # still refuse it: then as KVW_ERR_INVALID, never for a count.
    assert status in (kvwire.Status.ERR_NO_DEVICE, kvwire.Status.ERR_INVALID)


# The shapes, by name.
@pytest.mark.parametrize("kw, exc, words", [
    (dict(kv=[(POOL_BASE, 4096, 8)] * 2, num_layers=4), ValueError, "num_layers 4 needs 2 x 4"),
    (dict(kv=[(POOL_BASE, 4096, 8)] * 3, num_layers=1), ValueError, "kv has 3 regions"),
    (dict(kv=[(POOL_BASE, 4096, 8)] * 3), ValueError, "kv has 3 regions"),
    (dict(kv=[(POOL_BASE, (1 << 64) + 8192, 8192)] * 2), OverflowError, "length 1844674407370955"),
    (dict(kv=[(POOL_BASE, 4096, 0)] * 2), ValueError, "item_len 0"),
    (dict(kv=[(POOL_BASE, 4097, 8)] * 2), ValueError, "not a multiple of item_len 8"),
    (dict(kv=[(PTR_MAX - 10, 4096, 8)] * 2), OverflowError, "past the end of the address"),
    (dict(kv=[(POOL_BASE, 4096, 8.0)] * 2), TypeError, "item_len must be an int"),
    (dict(kv=[(POOL_BASE, 4096, 8)] * 2, num_layers=2 ** 32 + 1), OverflowError, "num_layers"),
    (dict(kv=[(POOL_BASE, 4096, 8)] * 2, engine_rank=-1), OverflowError, "engine_rank -1"),
    (dict(groups=[(0, 2, 2, [(POOL_BASE, 4096, 8)] * 3)]), ValueError, "group 0 has 3 regions"),
    (dict(groups=[]), ValueError, "kv has 0 regions"),
    (dict(groups=[(5, 1, 1, [(POOL_BASE, 4096, 8)])]), ValueError, "kind 5 is not"),
    (dict(groups=[(0, 1, 2, [(POOL_BASE, 4096, 8)] * 2)] * 65), ValueError, "at most 64"),
    (dict(kv=[(POOL_BASE, 4096, 8)] * 2, group_heads=[None, None]), ValueError,
     "one per group (1)"),
    (dict(kv=[(POOL_BASE, 4096, 8)] * 2, group_heads=[(2 ** 32, 0, 1, 8, 1)]), OverflowError,
     "total_heads"),
    (dict(kv=[(POOL_BASE, 4096, 8)] * 2, device="fake\0dev"), ValueError, "NUL"),
])
def test_engine_refuses_named_shapes(kw, exc, words):
    kw.setdefault("device", NO_DEVICE)
    with reaching_c() as (seen, _):
        with pytest.raises(exc) as ei:
            kvwire.Engine("decode", "127.0.0.1", **kw)
    assert words in str(ei.value)
    assert seen == []


def test_library_count_stands_behind_the_binding(monkeypatch):
    """With the binding's own layer check taken away, the shape of the
    issue (2 regions for 4 layers) still never gets read past its end: the
    count the binding fills makes the library refuse it, naming the field."""
    monkeypatch.setattr(_engine, "_kv_layers", lambda n, layers: layers)
    with reaching_c() as (seen, lines):
        with pytest.raises(kvwire.Error) as ei:
            kvwire.Engine("decode", "127.0.0.1", kv=[(POOL_BASE, 4096, 8)] * 2, num_layers=4,
                          device=NO_DEVICE)
    assert ei.value.status == kvwire.Status.ERR_INVALID
    assert "num_kv_regions is 2, but 2 x num_layers needs 8" in ei.value.reason
    assert seen[0]["num_kv_regions"] == 2 and seen[0]["num_layers"] == 4


def test_counts_left_zero_for_an_older_library(monkeypatch):
    """A 1.3 library refuses a struct whose bytes past its own end are set:
    against one, the binding leaves the counts 0 ("implied") and its own
    checks stand alone."""
    monkeypatch.setattr(_engine, "_HAS_COUNTS", False)
    for kw in (dict(kv=[(POOL_BASE, 4096, 8)] * 2, group_heads=[None]),
               dict(groups=[(0, 1, 2, [(POOL_BASE, 4096, 8)] * 2)], group_heads=[None])):
        p, status = create(True, **kw)
        assert status == kvwire.Status.ERR_NO_DEVICE
        assert (p["num_kv_regions"], p["num_group_heads"], p["group_num_regions"]) == (0, 0, None)
    with pytest.raises(ValueError):
        kvwire.Engine("decode", "127.0.0.1", kv=[(POOL_BASE, 4096, 8)] * 3, device=NO_DEVICE)


# -------------------------------------------------------------- requests


class _Fake:
    """Stand-ins for C functions: each records its arguments and returns
    0, writing a dummy handle where the call creates one."""

    def __init__(self):
        self.calls = []

    def __call__(self, *args):
        self.calls.append(args)
        if args and hasattr(args[-1], "_obj") and isinstance(args[-1]._obj, ctypes.c_void_p):
            args[-1]._obj.value = 77
        return 0


@contextlib.contextmanager
def fake_c(*names):
    saved = {n: getattr(_core._c, n) for n in names}
    fakes = {n: _Fake() for n in names}
    for n, f in fakes.items():
        setattr(_core._c, n, f)
    try:
        yield fakes
    finally:
        for n, f in saved.items():
            setattr(_core._c, n, f)


def fake_engine():
    e = kvwire.Engine.__new__(kvwire.Engine)
    e._cell = kvwire._Cell(1, "engine")
    e._lock = threading.RLock()
    e._children = {}
    return e


@SHAPES
@given(fields, fields, st.one_of(st.just("10.0.0.1:5000"), junk, st.just("a\0b")))
def test_request_constructors(room, rank, addr):
    e = fake_engine()
    try:
        _request_constructors(e, room, rank, addr)
    finally:
        e._cell = None  # the dummy handle is never destroyed


def _request_constructors(e, room, rank, addr):
    with fake_c("kvw_sender_create", "kvw_receiver_create") as f:
        try:
            s = e.sender(room)
        except PY_ERRORS:
            assert not _int(room, U64_MAX) and not f["kvw_sender_create"].calls
        else:
            assert _int(room, U64_MAX)
            assert f["kvw_sender_create"].calls[0][1] == room  # not wrapped
            s._cell.h = None  # nor the request's
        try:
            r = e.receiver(addr, rank, room)
        except PY_ERRORS:
            assert not (_int(room, U64_MAX) and _int(rank, U32_MAX) and
                        isinstance(addr, str) and "\0" not in addr)
            assert not f["kvw_receiver_create"].calls
        else:
            _, a, k, rm, _ = f["kvw_receiver_create"].calls[0]
            assert (a, k, rm) == (addr.encode(), rank, room)
            r._cell.h = None


@SHAPES
@given(fields, fields, st.sampled_from(["tcp://10.0.0.1:5000", "tcp://a\0b", None, 5]))
def test_endpoint_receiver(room, rank, endpoint):
    """The sglang backend's receiver (kvw_receiver_create_at) checks as
    kvwire.Receiver does."""
    from kvwire import _sglang_lib

    e, fake = fake_engine(), _Fake()
    saved = _sglang_lib._fns["kvw_receiver_create_at"]
    _sglang_lib._fns["kvw_receiver_create_at"] = fake
    try:
        r = _sglang_lib.EndpointReceiver(e, endpoint, rank, room)
    except PY_ERRORS:
        assert not (_int(room, U64_MAX) and _int(rank, U32_MAX) and isinstance(endpoint, str)
                    and "\0" not in endpoint)
        assert not fake.calls
    else:
        assert fake.calls[0][1:4] == (endpoint.encode(), rank, room)
        r._cell.h = None
    finally:
        _sglang_lib._fns["kvw_receiver_create_at"] = saved
        e._cell = None


@SHAPES
@given(fields, fields, fields, fields)
def test_sender_counts(num_pages, first_page, layer_begin, layer_end):
    s = kvwire.Sender.__new__(kvwire.Sender)
    s._cell, s.room = kvwire._Cell(1, "sender"), 1
    part = _Fake()
    saved = _core._L.optional["kvw_sender_send_part"]
    _core._L.optional["kvw_sender_send_part"] = part
    try:
        with fake_c("kvw_sender_init") as f:
            try:
                s.init(num_pages)
                assert f["kvw_sender_init"].calls[0][1] == num_pages
            except PY_ERRORS:
                assert not _int(num_pages, SIZE_MAX) and not f["kvw_sender_init"].calls
        try:
            s.send_part([1, 2], first_page, layer_begin, layer_end)
        except PY_ERRORS:
            assert not (_int(first_page, SIZE_MAX) and _int(layer_begin, U32_MAX) and
                        _int(layer_end, U32_MAX))
            assert not part.calls
        else:
            p = part.calls[0][1]._obj
            assert (p.num_pages, p.first_page, p.layer_begin, p.layer_end) == (
                2, first_page, layer_begin, layer_end)
    finally:
        _core._L.optional["kvw_sender_send_part"] = saved
        s._cell = None


DTYPES = ["uint8", "int16", "int32", "int64", "uint64", ">u8", "<i8", "float32", "bool",
          "object", "complex64"]


@SHAPES
@given(st.lists(st.integers(-5, 300), max_size=8), st.sampled_from(DTYPES),
       st.sampled_from(["1d", "2d", "strided", "scalar"]))
def test_index_arrays(values, dtype, layout):
    """Receiver.init's pages: a C call gets exactly the values given, as
    many as given, or the array is refused (2-D, a scalar, a non-integer
    dtype, a negative index) before C."""
    dt = np.dtype(dtype)
    if dt.kind in "iu":  # values the dtype holds (numpy would wrap the others)
        values = [v for v in values if np.iinfo(dt).min <= v <= np.iinfo(dt).max]
    arr = np.array(values, dtype=dt)
    if layout == "2d":
        arr = arr.reshape(len(values), 1)
    elif layout == "strided":
        arr = np.repeat(arr, 2)[::2]
    elif layout == "scalar":
        arr = np.array(values[0] if values else 3, dtype=dt)  # 0-d
    want = [int(v) for v in np.asarray(arr).ravel().tolist()] if arr.dtype.kind in "iu" else None
    ok = (arr.ndim == 1 and arr.dtype.kind in "iu" and all(v >= 0 for v in want))
    r = kvwire.Receiver.__new__(kvwire.Receiver)
    r._cell, r.room = kvwire._Cell(1, "receiver"), 1
    with fake_c("kvw_receiver_init") as f:
        try:
            r.init(arr)
        except PY_ERRORS:
            assert not ok and not f["kvw_receiver_init"].calls
        else:
            assert ok
            _, ptr, n, _ = f["kvw_receiver_init"].calls[0]
            assert n == len(want) and [ptr[i] for i in range(n)] == want
    r._cell = None
