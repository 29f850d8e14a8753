# SPDX-License-Identifier: Apache-2.0
"""Host-only tests of the binding: no RDMA device needed."""
import ctypes
import os
import subprocess
import sys

import pytest

import kvwire
from kvwire import _lib


def test_import_and_library():
    assert os.path.exists(kvwire.library_path()) or kvwire.library_path().startswith("lib")
    feats = kvwire.features()
    assert set(feats) == {"groups", "init_indices", "send_part", "send_state", "metrics",
                          "send_after", "state_lists", "receiver_ranks", "sender_fanout",
                          "verify_digests", "metrics_text", "sender_learn"}
    assert feats["state_lists"]


def test_status_and_poll_names_match_the_library():
    for st in kvwire.Status:
        assert kvwire._c.kvw_status_name(int(st)).decode() == "KVW_" + st.name
    names = {0: "Failed", 1: "Bootstrapping", 2: "WaitingForInput", 3: "Transferring", 4: "Success"}
    for v, n in names.items():
        assert kvwire._c.kvw_poll_name(v).decode() == n
        assert kvwire.Poll(v) == v


def test_error_attributes():
    e = kvwire.Error(kvwire.Status.ERR_TIMEOUT)
    assert e.status == -10 and e.name == "KVW_ERR_TIMEOUT" and e.reason == "timed out"
    e = kvwire.Error(-8, "page 9 is outside", "kvw_sender_send(room 1)")
    assert "kvw_sender_send(room 1): page 9 is outside (KVW_ERR_OUT_OF_RANGE)" == str(e)
    assert isinstance(kvwire.ClosedError("x"), kvwire.Error)


def test_config_defaults_env_and_overrides(monkeypatch):
    monkeypatch.setenv("KVW_SQ_DEPTH", "1024")
    c = kvwire.Config(peer_timeout_ms=1234, cluster_key_file="/tmp/k")
    assert c.sq_depth == 1024 and c.peer_timeout_ms == 1234 and c.chain_max == 64
    assert c.cluster_key_file == "/tmp/k"
    assert "KVW_SQ_DEPTH" in c.dump() and "1024" in c.dump()
    assert c.as_dict()["gid_index"] == -1
    with pytest.raises(TypeError):
        kvwire.Config(no_such_field=1)
    with pytest.raises(ValueError):
        kvwire.Config(ib_port=256)
    with pytest.raises(ValueError):
        kvwire.Config(sq_depth=-1)
    with pytest.raises(TypeError):
        kvwire.Config(sq_depth="12")
    with pytest.raises(ValueError):
        kvwire.Config(cluster_key="x" * 41)


def test_config_bad_env_raises(monkeypatch):
    monkeypatch.setenv("KVW_SQ_DEPTH", "lots")
    with pytest.raises(kvwire.Error) as ei:
        kvwire.Config()
    assert ei.value.status == kvwire.Status.ERR_INVALID
    assert "KVW_SQ_DEPTH" in ei.value.reason  # the library's own message


def test_bootstrap_create_close_and_use_after_close():
    with kvwire.Bootstrap("127.0.0.1:0") as bs:
        host, port = bs.addr.rsplit(":", 1)
        assert host == "127.0.0.1" and int(port) > 0
    assert bs.closed
    with pytest.raises(kvwire.ClosedError):
        bs.addr
    bs.close()  # idempotent


def test_bootstrap_bad_address_raises():
    with pytest.raises(kvwire.Error) as ei:
        kvwire.Bootstrap("not-an-address")
    assert ei.value.status < 0


def test_bootstrap_many_times_leaks_nothing():
    for _ in range(20):
        kvwire.Bootstrap("127.0.0.1:0").close()
    b = kvwire.Bootstrap("127.0.0.1:0")
    del b  # garbage collection closes it


def _has_rdma():
    return os.path.isdir("/sys/class/infiniband") and bool(os.listdir("/sys/class/infiniband"))


@pytest.mark.skipif(_has_rdma(), reason="this host has an RDMA device")
def test_engine_create_fails_cleanly_without_device():
    mem = bytearray(4 * 1024)
    kv = [kvwire.Region.of(mem, 1024)] * 2
    for _ in range(5):
        with pytest.raises(kvwire.Error) as ei:
            kvwire.Engine("decode", "127.0.0.1", kv=kv)
        assert ei.value.status in (kvwire.Status.ERR_NO_DEVICE, kvwire.Status.ERR_VERBS)
        assert ei.value.reason  # the library's message, e.g. "no RDMA device owns ..."
    with pytest.raises(kvwire.Error) as ei:
        kvwire.Engine("decode", "127.0.0.1", kv=kv, device="nosuchdev0")
    assert ei.value.status < 0


def test_engine_bad_params():
    with pytest.raises(ValueError):
        kvwire.Engine("middle", "127.0.0.1")
    # Refused before the library: no memory at all, an address that is no
    # pointer (test_binding_shapes.py drives every such shape).
    with pytest.raises(ValueError, match="kv has 0 regions"):
        kvwire.Engine("decode", "127.0.0.1")
    with pytest.raises(OverflowError, match=r"kv\[0\]: addr -1 does not fit"):
        kvwire.Engine("decode", "127.0.0.1", kv=[(-1, 10, 1)] * 2)


def test_region_of_buffers():
    mem = bytearray(8192)
    r = kvwire.Region.of(mem, 1024)
    assert r.length == 8192 and r.item_len == 1024 and r.owner is not None
    addr = ctypes.addressof((ctypes.c_char * 8192).from_buffer(mem))
    assert r.addr == addr
    with pytest.raises(ValueError):
        kvwire.Region.of(bytes(16), 8)  # read-only


def _closed(cls, **attrs):
    obj = cls.__new__(cls)
    obj._cell = kvwire._Cell(None, "sender")
    for k, v in attrs.items():
        setattr(obj, k, v)
    return obj


def test_requests_raise_after_close_never_crash():
    s = _closed(kvwire.Sender, room=1, _engine=None)
    for call in (lambda: s.poll(), lambda: s.init(1), lambda: s.send([1]), lambda: s.abort(),
                 lambda: s.failure()):
        with pytest.raises(kvwire.ClosedError):
            call()
    r = _closed(kvwire.Receiver, room=2, _engine=None)
    for call in (lambda: r.poll(), lambda: r.init([1]), lambda: r.abort(), lambda: r.failure()):
        with pytest.raises(kvwire.ClosedError):
            call()
    e = _closed(kvwire.Engine, _lock=__import__("threading").RLock(), _children={})
    for call in (lambda: e.endpoint, lambda: e.counters(), lambda: e.rails(), lambda: e.sender(1),
                 lambda: e.receiver("1.2.3.4:5", 0, 1)):
        with pytest.raises(kvwire.ClosedError):
            call()


def test_missing_symbols_disable_only_their_feature(monkeypatch):
    monkeypatch.setitem(kvwire._L.optional, "kvw_sender_send_part", None)
    s = kvwire.Sender.__new__(kvwire.Sender)
    s._cell = kvwire._Cell(1, "sender")  # never reaches C: the feature check comes first
    s.room = 1
    with pytest.raises(kvwire.Error) as ei:
        s.send_part([1], 0)
    assert ei.value.status == kvwire.Status.ERR_UNSUPPORTED
    assert "kvw_sender_send_part" in ei.value.reason
    s._cell = None


def test_log_handler_routes_and_captures(monkeypatch):
    seen = []
    kvwire.set_log_handler(lambda lvl, msg: seen.append((lvl, msg)))
    try:
        monkeypatch.setenv("KVW_CHAIN_MAX", "x")
        with pytest.raises(kvwire.Error):
            kvwire.Config()
    finally:
        kvwire.set_log_handler(None)
    assert any(l == kvwire.LogLevel.ERROR and "KVW_CHAIN_MAX" in m for l, m in seen)


def test_import_without_numpy():
    code = ("import sys; sys.modules['numpy'] = None; import kvwire; "
            "i = kvwire.as_indices([1, 2, 3]); assert i.count == 3 and i.copied; print('ok')")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_version_matches_the_header():
    header = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__)))), "include", "kvwire.h")
    if not os.path.exists(header):
        pytest.skip("outside the source tree")
    want = {}
    for line in open(header):
        parts = line.split()
        if len(parts) == 3 and parts[0] == "#define" and parts[1] in (
                "KVW_VERSION_MAJOR", "KVW_VERSION_MINOR", "KVW_VERSION_PATCH"):
            want[parts[1]] = int(parts[2])
    info = (want["KVW_VERSION_MAJOR"], want["KVW_VERSION_MINOR"], want["KVW_VERSION_PATCH"])
    assert kvwire.version_info() == info
    assert kvwire.version() == "%d.%d.%d" % info


def test_package_version_is_the_library_version():
    pyproject = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                             "pyproject.toml")
    if not os.path.exists(pyproject):
        pytest.skip("outside the source tree")
    line = next(l for l in open(pyproject) if l.startswith("version = "))
    assert line.split('"')[1] == kvwire.version() == kvwire.__version__
    assert kvwire.version_info()[0] == _lib.ABI_MAJOR
    assert _lib.SONAME == "libkvwire.so.%d" % _lib.ABI_MAJOR


def _live(cls, **attrs):
    """A Sender or Receiver whose calls reach the (monkeypatched) C
    functions without an engine: its handle is a dummy never dereferenced."""
    obj = cls.__new__(cls)
    obj._cell = kvwire._Cell(1, "request")
    for k, v in attrs.items():
        setattr(obj, k, v)
    return obj


def _lists(arr, n):
    return {arr[i].group: [arr[i].indices[j] for j in range(arr[i].count)] for i in range(n)}


def test_state_lists_reach_c_per_group(monkeypatch):
    """Receiver.init(state_lists=) and Sender.send_state(lists=) hand each
    state group its own list (kvw_state_list_t): Mamba's one slot, an SWA
    page list, None skipping a group; the shared list stays beside them."""
    import numpy as np

    seen = {}

    def init_lists(h, ix, arr, n):
        x = ix._obj
        seen["init"] = ([x.pages[i] for i in range(x.num_pages)], x.aux_index,
                        [x.state[i] for i in range(x.num_state)], _lists(arr, n))
        return 0

    def send_lists(h, state, ns, arr, n):
        seen["send"] = ([state[i] for i in range(ns)], _lists(arr, n))
        return 0

    monkeypatch.setitem(kvwire._L.optional, "kvw_receiver_init_lists", init_lists)
    monkeypatch.setitem(kvwire._L.optional, "kvw_sender_send_state_lists", send_lists)
    r = _live(kvwire.Receiver, room=5)
    r.init([4, 5, 6], 2, state=[9], state_lists={2: [3], 3: np.array([0, 1, 11], dtype=np.int64),
                                                  4: None})
    assert seen["init"] == ([4, 5, 6], 2, [9], {2: [3], 3: [0, 1, 11], 4: []})
    s = _live(kvwire.Sender, room=5)
    s.send_state(lists={2: np.array([1], dtype=np.uint64), 3: (4, 5, 9), 4: []})
    assert seen["send"] == ([], {2: [1], 3: [4, 5, 9], 4: []})
    with pytest.raises(TypeError):
        r.init([1], state_lists={"swa": [1]})
    with pytest.raises(TypeError):
        s.send_state(lists={-1: [1]})
    r._cell = s._cell = None


def test_state_lists_refusal_comes_back_as_error(monkeypatch):
    monkeypatch.setitem(kvwire._L.optional, "kvw_sender_send_state_lists",
                        lambda *a: int(kvwire.Status.ERR_MISMATCH))
    s = _live(kvwire.Sender, room=6)
    with pytest.raises(kvwire.Error) as ei:
        s.send_state([1], lists={3: [1, 2]})
    assert ei.value.status == kvwire.Status.ERR_MISMATCH
    monkeypatch.setitem(kvwire._L.optional, "kvw_receiver_init_lists", None)
    r = _live(kvwire.Receiver, room=6)
    with pytest.raises(kvwire.Error) as ei:
        r.init([1], state_lists={3: [1]})
    assert ei.value.status == kvwire.Status.ERR_UNSUPPORTED
    assert "kvw_receiver_init_lists" in ei.value.reason
    s._cell = r._cell = None


def test_group_heads_reach_engine_params(monkeypatch):
    """Engine(group_heads=) fills kvw_engine_params_t.group_heads, one
    entry per group (None: not described), NHD/HND by name."""
    seen = {}

    def create(pp, hp):
        p = pp._obj
        seen["n"] = p.num_groups
        seen["heads"] = [tuple(getattr(p.group_heads[i], f) for f, _ in
                               kvwire._lib.kvw_group_heads_t._fields_)
                         for i in range(max(p.num_groups, 1))]
        return int(kvwire.Status.ERR_NO_DEVICE)

    monkeypatch.setattr(kvwire._c, "kvw_engine_create", create)
    mem = [bytearray(4 * 2 * 8 * 128) for _ in range(4)]
    kv = kvwire.Group(kvwire.GroupKind.KV, 2, 2, [kvwire.Region.of(m, 2 * 8 * 128) for m in mem])
    st = kvwire.Group(kvwire.GroupKind.STATE, 1, 1, [kvwire.Region.of(bytearray(64), 16)])
    with pytest.raises(kvwire.Error):
        kvwire.Engine("decode", "127.0.0.1", groups=[kv, st],
                      group_heads=[kvwire.GroupHeads(4, 2, 2, 128, 8, "HND"), None])
    assert seen["n"] == 2 and seen["heads"] == [(4, 2, 2, 128, 8, 1), (0, 0, 0, 0, 0, 0)]
    with pytest.raises(kvwire.Error):  # the classic layout: one entry, its K/V group
        kvwire.Engine("decode", "127.0.0.1", kv=kv.regions,
                      group_heads=[(4, 0, 2, 128, 8)])
    assert seen["heads"] == [(4, 0, 2, 128, 8, 0)]
    with pytest.raises(ValueError):
        kvwire.Engine("decode", "127.0.0.1", groups=[kv, st], group_heads=[None])
    with pytest.raises(ValueError):
        kvwire.Engine("decode", "127.0.0.1", groups=[kv, st],
                      group_heads=[kvwire.GroupHeads(4, 0, 2, 128, 8, "XYZ"), None])


def test_learned_heads_reach_engine_params(monkeypatch):
    """GroupHeads.learned(page_tokens, order) is the learning entry (only the
    page), and Engine(attn_tp_rank=, attn_tp_size=) fills the params' TP
    place; left out, both are 0 (no group learns)."""
    seen = {}

    def create(pp, hp):
        p = pp._obj
        seen["heads"] = tuple(getattr(p.group_heads[0], f) for f, _ in
                              kvwire._lib.kvw_group_heads_t._fields_)
        seen["tp"] = (p.attn_tp_rank, p.attn_tp_size)
        return int(kvwire.Status.ERR_NO_DEVICE)

    monkeypatch.setattr(kvwire._c, "kvw_engine_create", create)
    assert kvwire.GroupHeads.learned(16) == kvwire.GroupHeads(0, 0, 0, 0, 16, 0)
    mem = [bytearray(4 * 2 * 8 * 128) for _ in range(4)]
    kv = [kvwire.Region.of(m, 2 * 8 * 128) for m in mem]
    with pytest.raises(kvwire.Error):
        kvwire.Engine("decode", "127.0.0.1", kv=kv, attn_tp_rank=1, attn_tp_size=2,
                      group_heads=[kvwire.GroupHeads.learned(8, "HND")])
    assert seen == {"heads": (0, 0, 0, 0, 8, 1), "tp": (1, 2)}
    with pytest.raises(kvwire.Error):
        kvwire.Engine("decode", "127.0.0.1", kv=kv, group_heads=[(4, 0, 2, 128, 8)])
    assert seen["tp"] == (0, 0)
    with pytest.raises(OverflowError):
        kvwire.Engine("decode", "127.0.0.1", kv=kv, attn_tp_rank=-1, attn_tp_size=2,
                      group_heads=[kvwire.GroupHeads.learned(8)])


def test_learned_heads_refused_by_the_library():
    """The real library refuses a TP place without a learning group, and a
    rank outside the size, before opening any device."""
    mem = [bytearray(4 * 2 * 8 * 128) for _ in range(4)]
    kv = [kvwire.Region.of(m, 2 * 8 * 128) for m in mem]
    for rank, size, heads in ((0, 2, None), (2, 2, [kvwire.GroupHeads.learned(8)])):
        with pytest.raises(kvwire.Error) as ei:
            kvwire.Engine("decode", "127.0.0.1", kv=kv, attn_tp_rank=rank, attn_tp_size=size,
                          group_heads=heads)
        assert ei.value.status == kvwire.Status.ERR_INVALID


@pytest.fixture
def fake_engine():
    """An Engine whose calls reach the (monkeypatched) C functions: its
    handle is a dummy never dereferenced, and never destroyed."""
    import threading

    e = kvwire.Engine.__new__(kvwire.Engine)
    e._cell = kvwire._Cell(1, "engine")
    e._lock = threading.Lock()
    e._children = {}
    yield e
    for c in e._children.values():
        c.h = None
    e._cell = None


def test_receiver_ranks_reach_c_in_order(monkeypatch, fake_engine):
    """Engine.receiver_ranks fills kvw_receiver_params_t: struct_size, room,
    each rank by endpoint (tcp://, as sglang's bootstrap server carries it)
    or by bootstrap address, in the order given."""
    seen = {}

    def create(eh, pp, hp):
        p = pp._obj
        seen["p"] = (p.struct_size, p.room, p.num_ranks)
        seen["ranks"] = [(p.ranks[i].bootstrap_addr, p.ranks[i].endpoint, p.ranks[i].rank)
                         for i in range(p.num_ranks)]
        hp._obj.value = 77
        return 0

    monkeypatch.setitem(kvwire._L.optional, "kvw_receiver_create_ranks", create)
    e = fake_engine
    r = e.receiver_ranks([("tcp://10.0.0.2:4100", 0), kvwire.PrefillRank(1, "10.0.0.9:8998"),
                          kvwire.PrefillRank(3, endpoint="tcp://[fe80::1]:5")], room=42)
    assert seen["p"] == (ctypes.sizeof(_lib.kvw_receiver_params_t), 42, 3)
    assert seen["ranks"] == [(None, b"tcp://10.0.0.2:4100", 0), (b"10.0.0.9:8998", None, 1),
                             (None, b"tcp://[fe80::1]:5", 3)]
    assert r._cell.h == 77 and r.room == 42 and r.prefill_rank == 0
    assert [k.rank for k in r.ranks] == [0, 1, 3]
    assert "rank 1 at 10.0.0.9:8998" in r.bootstrap_addr
    r._cell = None  # never destroy the dummy handle (the fixture forgets the engine's)


@pytest.mark.parametrize("ranks, exc", [
    ([], ValueError),                                   # none
    ([("tcp://1.2.3.4:5", i) for i in range(65)], ValueError),  # > KVW_MAX_PREFILL_RANKS
    ("tcp://1.2.3.4:5", TypeError),                     # not a list
    ([("tcp://1.2.3.4:5",)], TypeError),                # not a pair
    ([("tcp://1.2.3.4:5", -1)], ValueError),            # negative rank
    ([("tcp://1.2.3.4:5", 2**32)], ValueError),         # rank beyond uint32
    ([("tcp://1.2.3.4:5", True)], ValueError),          # bool is no rank
    ([kvwire.PrefillRank(0)], ValueError),              # neither address
    ([kvwire.PrefillRank(0, "h:1", "tcp://h:1")], ValueError),  # both
    ([kvwire.PrefillRank(0, endpoint="udp://h:1")], ValueError),
    ([kvwire.PrefillRank(0, endpoint="tcp://")], ValueError),
    ([("@tcp://h:1", 0)], ValueError),                  # "@" is the library's own prefix
])
def test_receiver_ranks_refuses_bad_lists_before_c(monkeypatch, fake_engine, ranks, exc):
    called = []
    monkeypatch.setitem(kvwire._L.optional, "kvw_receiver_create_ranks",
                        lambda *a: called.append(a) or 0)
    with pytest.raises(exc):
        fake_engine.receiver_ranks(ranks, room=1)
    assert called == []


def test_receiver_ranks_errors_come_back(monkeypatch, fake_engine):
    """The library's refusal (e.g. the same rank twice, an engine that does
    not describe its heads) is an Error with its status; an older library
    without the call raises KVW_ERR_UNSUPPORTED naming it."""
    monkeypatch.setitem(kvwire._L.optional, "kvw_receiver_create_ranks",
                        lambda *a: int(kvwire.Status.ERR_UNSUPPORTED))
    e = fake_engine
    with pytest.raises(kvwire.Error) as ei:
        e.receiver_ranks([("tcp://1.2.3.4:5", 0), ("tcp://1.2.3.4:6", 1)], room=9)
    assert ei.value.status == kvwire.Status.ERR_UNSUPPORTED
    assert "kvw_receiver_create_ranks(room 9, 2 ranks)" in str(ei.value)
    assert e._children == {}
    monkeypatch.setitem(kvwire._L.optional, "kvw_receiver_create_ranks", None)
    with pytest.raises(kvwire.Error) as ei:
        e.receiver_ranks([("tcp://1.2.3.4:5", 0)], room=9)
    assert ei.value.status == kvwire.Status.ERR_UNSUPPORTED
    assert "kvw_receiver_create_ranks" in ei.value.reason


def test_receiver_ranks_in_the_real_library():
    """The library this binding loads exports the call."""
    assert kvwire.features()["receiver_ranks"]


def test_sender_fanout_reaches_c(monkeypatch, fake_engine):
    """Engine.sender(room, receivers=n) calls kvw_sender_create_fanout with
    the room and n; receivers=1 is a plain kvw_sender_create; n outside
    1..KVW_MAX_DECODE_RECEIVERS is refused before C; the library's refusal
    comes back as an Error naming the call; an older library without it
    raises KVW_ERR_UNSUPPORTED."""
    seen = []

    def create(eh, room, n, hp):
        seen.append((room, n))
        hp._obj.value = 78
        return 0

    monkeypatch.setitem(kvwire._L.optional, "kvw_sender_create_fanout", create)
    e = fake_engine
    s = e.sender(43, receivers=2)
    assert seen == [(43, 2)] and s._cell.h == 78 and s.receivers == 2
    s._cell = None  # never destroy the dummy handle
    for bad in (0, 65):
        with pytest.raises(ValueError):
            e.sender(1, receivers=bad)
    assert seen == [(43, 2)]
    monkeypatch.setitem(kvwire._L.optional, "kvw_sender_create_fanout",
                        lambda *a: int(kvwire.Status.ERR_EXISTS))
    with pytest.raises(kvwire.Error) as ei:
        e.sender(44, receivers=3)
    assert ei.value.status == kvwire.Status.ERR_EXISTS
    assert "kvw_sender_create_fanout(room 44, 3 receivers)" in str(ei.value)
    monkeypatch.setitem(kvwire._L.optional, "kvw_sender_create_fanout", None)
    with pytest.raises(kvwire.Error) as ei:
        e.sender(45, receivers=2)
    assert ei.value.status == kvwire.Status.ERR_UNSUPPORTED


def test_sender_fanout_in_the_real_library():
    """The library this binding loads exports the call."""
    assert kvwire.features()["sender_fanout"]


def test_sender_learn_reaches_c(monkeypatch, fake_engine):
    """Engine.sender(room, receivers=None) calls kvw_sender_create_learn
    with the room (the count comes from decode's requests); the library's
    refusal comes back as an Error naming the call; an older library
    without it raises KVW_ERR_UNSUPPORTED."""
    seen = []

    def create(eh, room, hp):
        seen.append(room)
        hp._obj.value = 79
        return 0

    monkeypatch.setitem(kvwire._L.optional, "kvw_sender_create_learn", create)
    s = fake_engine.sender(46, receivers=None)
    assert seen == [46] and s._cell.h == 79 and s.receivers is None
    s._cell = None  # never destroy the dummy handle
    monkeypatch.setitem(kvwire._L.optional, "kvw_sender_create_learn",
                        lambda *a: int(kvwire.Status.ERR_EXISTS))
    with pytest.raises(kvwire.Error) as ei:
        fake_engine.sender(47, receivers=None)
    assert ei.value.status == kvwire.Status.ERR_EXISTS
    assert "kvw_sender_create_learn(room 47)" in str(ei.value)
    monkeypatch.setitem(kvwire._L.optional, "kvw_sender_create_learn", None)
    with pytest.raises(kvwire.Error) as ei:
        fake_engine.sender(48, receivers=None)
    assert ei.value.status == kvwire.Status.ERR_UNSUPPORTED


def test_room_receivers_reach_c(monkeypatch, fake_engine):
    """Receiver.set_room_receivers(n) calls kvw_receiver_set_room_receivers
    on the receiver's handle; n above KVW_MAX_DECODE_RECEIVERS is refused
    before C, the library's refusal (after init: KVW_ERR_STATE) comes back
    as an Error naming the call."""
    seen = []

    def create_at(eh, addr, rank, room, hp):
        hp._obj.value = 80
        return 0

    def say(h, n):
        seen.append((h, n))
        return 0

    from kvwire import _sglang_lib

    monkeypatch.setitem(_sglang_lib._fns, "kvw_receiver_create_at", create_at)
    monkeypatch.setitem(kvwire._L.optional, "kvw_receiver_set_room_receivers", say)
    r = _sglang_lib.EndpointReceiver(fake_engine, "tcp://127.0.0.1:1", 0, 49)
    r.set_room_receivers(2)
    assert seen == [(80, 2)]
    with pytest.raises(ValueError):
        r.set_room_receivers(65)
    assert seen == [(80, 2)]
    monkeypatch.setitem(kvwire._L.optional, "kvw_receiver_set_room_receivers",
                        lambda *a: int(kvwire.Status.ERR_STATE))
    with pytest.raises(kvwire.Error) as ei:
        r.set_room_receivers(2)
    assert ei.value.status == kvwire.Status.ERR_STATE
    assert "kvw_receiver_set_room_receivers(room 49, 2)" in str(ei.value)
    r._cell = None  # never destroy the dummy handle


def test_sender_learn_in_the_real_library():
    """The library this binding loads exports both calls."""
    assert kvwire.features()["sender_learn"]


def test_verify_config_and_status():
    """Config.verify (KVW_VERIFY, off by default) and KVW_ERR_CORRUPT."""
    assert kvwire.Config().verify == 0
    assert kvwire.Config(verify=1).verify == 1
    assert "reserved_1_4" not in kvwire.Config.FIELDS
    assert kvwire.Status.ERR_CORRUPT == -19
    assert kvwire.features()["verify_digests"]


def test_caller_digests_reach_c(monkeypatch, fake_engine):
    """Sender.set_digest, Receiver.landed and Receiver.verify pass the
    digest (a 64-bit int) to C; a value outside [0, 2^64) is refused before
    C; the library's refusal comes back as an Error naming the call."""
    seen = []
    monkeypatch.setitem(kvwire._L.optional, "kvw_sender_set_digest",
                        lambda h, d: seen.append(("set", h, d)) or 0)
    monkeypatch.setitem(kvwire._L.optional, "kvw_receiver_landed", lambda h: 1)
    monkeypatch.setitem(kvwire._L.optional, "kvw_receiver_verify",
                        lambda h, d: seen.append(("verify", h, d)) or 0)
    s = kvwire.Sender.__new__(kvwire.Sender)
    s.room, s._cell = 5, kvwire._Cell(80, "sender")
    r = kvwire.Receiver.__new__(kvwire.Receiver)
    r.room, r._cell = 5, kvwire._Cell(81, "receiver")
    s.set_digest(2**64 - 1)
    assert r.landed() is True
    r.verify(0x1234)
    assert seen == [("set", 80, 2**64 - 1), ("verify", 81, 0x1234)]
    for bad in (-1, 2**64, True, 1.5):
        with pytest.raises((ValueError, TypeError)):
            r.verify(bad)
    monkeypatch.setitem(kvwire._L.optional, "kvw_receiver_verify",
                        lambda h, d: int(kvwire.Status.ERR_STATE))
    with pytest.raises(kvwire.Error) as ei:
        r.verify(1)
    assert ei.value.status == kvwire.Status.ERR_STATE
    assert "kvw_receiver_verify(room 5)" in str(ei.value)
    s._cell = r._cell = None  # never destroy the dummy handles
