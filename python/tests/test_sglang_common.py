# SPDX-License-Identifier: Apache-2.0
"""kvwire.sglang on sglang's own code (host, no RDMA): the pinned
snapshot's disaggregation package with stubs for the rest of sglang
(python/tests/sglang_stubs). Selection by name, the class hierarchy, the
HTTP bootstrap server, and the layouts refused at manager creation, which
fail before any RDMA device is opened. Transfers: python/tests/guest."""
import dataclasses
import sys

import pytest

import sglang_ref

pytestmark = pytest.mark.skipif(bool(sglang_ref.missing()), reason=sglang_ref.missing() or "-")


@pytest.fixture
def sg():
    import kvwire.sglang as ks

    sglang_ref.enter()
    ks.install()
    from sglang.srt.disaggregation import utils

    yield ks, utils
    ks.uninstall()
    sglang_ref.leave_modules()
    for p in (sglang_ref.reference(), sglang_ref.STUBS):
        while p in sys.path:
            sys.path.remove(p)


def test_backend_kvwire_is_sglangs_common_classes(sg):
    ks, utils = sg
    from sglang.srt import server_args
    from sglang.srt.disaggregation.base.conn import KVArgs
    from sglang.srt.disaggregation.common import conn as common

    assert "kvwire" in server_args.DISAGG_TRANSFER_BACKEND_CHOICES
    T, K = utils.TransferBackend, utils.KVClassType
    b = T("kvwire")
    assert utils.get_kv_class(b, K.KVARGS) is KVArgs
    bases = {K.MANAGER: common.CommonKVManager, K.SENDER: common.CommonKVSender,
             K.RECEIVER: common.CommonKVReceiver,
             K.BOOTSTRAP_SERVER: common.CommonKVBootstrapServer}
    for k, base in bases.items():
        assert issubclass(utils.get_kv_class(b, k), base), k
    assert not [n for n in sys.modules if "mooncake" in n or "nixl" in n]


def test_bootstrap_server_is_sglangs_http(sg):
    ks, utils = sg
    import requests

    srv = utils.get_kv_class(utils.TransferBackend.KVWIRE, utils.KVClassType.BOOTSTRAP_SERVER)(
        host="127.0.0.1", port=_free_port())
    try:
        url = f"http://127.0.0.1:{srv.port}"
        for _ in range(100):
            try:
                r = requests.get(url + "/health", timeout=2)
                break
            except requests.ConnectionError:
                import time

                time.sleep(0.05)
        assert r.status_code == 200 and r.text == "OK"
        # Nothing registered yet: sglang's own 503 for the parallel info.
        r = requests.get(url + "/route?prefill_dp_rank=-1&prefill_cp_rank=-1"
                         "&target_tp_rank=-1&target_pp_rank=-1", timeout=2)
        assert r.status_code == 503
        assert requests.post(url + "/query_dp_ranks", json={"bootstrap_rooms": [1]},
                             timeout=2).json() == {}
    finally:
        srv.close()


def _free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _args(**kw):
    from sglang.srt.disaggregation.base.conn import KVArgs

    a = KVArgs()
    a.engine_rank, a.kv_data_ptrs, a.kv_data_lens, a.kv_item_lens = 0, [4096], [4096], [64]
    a.aux_data_ptrs, a.aux_data_lens, a.aux_item_lens = [], [], []
    a.state_types, a.state_data_ptrs, a.state_data_lens, a.state_item_lens = [], [], [], []
    a.ib_device, a.gpu_id, a.page_size, a.system_dp_rank, a.pp_rank = None, 0, 1, 0, 0
    for k, v in kw.items():
        setattr(a, k, v)
    return a


def _make(sg, args, **server):
    ks, utils = sg
    from sglang.srt.server_args import ServerArgs

    mgr = utils.get_kv_class(utils.TransferBackend.KVWIRE, utils.KVClassType.MANAGER)
    sa = dataclasses.replace(ServerArgs(disaggregation_transfer_backend="kvwire"), **server)
    return mgr(args, utils.DisaggregationMode.DECODE, sa, False)


def test_dcp_refused_at_creation(sg):
    with pytest.raises(RuntimeError, match="dcp_size=2.*silently corrupt"):
        _make(sg, _args(dcp_size=2, dcp_rank=1))


def test_pp_not_refused_at_creation(sg, monkeypatch):
    """Pipeline parallelism is served (stage to stage, or decode PP 1
    gathering the stages): a PP 2 manager goes on to make its engine."""
    from kvwire.sglang import conn

    def engine(*a, **kw):
        raise RuntimeError("engine reached")

    monkeypatch.setattr(conn.kvwire, "Engine", engine)
    with pytest.raises(RuntimeError, match="engine reached"):
        _make(sg, _args(), pp_size=2)


def test_prefill_memory_release_refused_at_creation(sg):
    """RL's memory release on prefill (--enable-memory-saver) never reaches
    the backend in sglang: refused at creation with that reason. Decode's
    does (deregister_buffer_to_engine), so decode is not refused."""
    ks, utils = sg
    from sglang.srt.server_args import ServerArgs

    mgr = utils.get_kv_class(utils.TransferBackend.KVWIRE, utils.KVClassType.MANAGER)
    sa = ServerArgs(disaggregation_transfer_backend="kvwire", enable_memory_saver=True)
    with pytest.raises(RuntimeError, match="prefill memory release.*never tells"):
        mgr(_args(), utils.DisaggregationMode.PREFILL, sa, False)


def test_pp_stage_layers_as_sglang_partitions(sg, monkeypatch):
    """Decode's view of each prefill stage's layers: sglang's default split
    (the last stage takes the remainder) or $SGLANG_PP_LAYER_PARTITION;
    MHA's K and V regions of those layers, MLA's one per layer."""
    import kvwire
    from kvwire.sglang import conn

    monkeypatch.delenv("SGLANG_PP_LAYER_PARTITION", raising=False)
    assert [conn._pp_layers(5, r, 2) for r in range(2)] == [(0, 2), (2, 5)]
    assert [conn._pp_layers(8, r, 4) for r in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    monkeypatch.setenv("SGLANG_PP_LAYER_PARTITION", "3,2")
    assert [conn._pp_layers(5, r, 2) for r in range(2)] == [(0, 3), (3, 5)]
    with pytest.raises(ValueError, match="does not split 6 layers into 2 stages"):
        conn._pp_layers(6, 0, 2)
    regs = [kvwire.Region(0x1000 * (i + 1), 64, 16) for i in range(8)]  # K0..K3 V0..V3
    assert conn._layer_slice(regs, 2, 1, 3) == [regs[1], regs[2], regs[5], regs[6]]
    assert conn._layer_slice(regs, 1, 6, 8) == regs[6:8]
    with pytest.raises(ValueError, match="outside the 4 KV layers"):
        conn._layer_slice(regs, 2, 2, 5)


def test_hybrid_state_types_each_their_own_group(sg, monkeypatch):
    """A hybrid model: each StateType with buffers becomes its own kvwire
    state group (its own index space); one without buffers none."""
    import kvwire
    from kvwire.sglang import conn
    from sglang.srt.disaggregation.base.conn import StateType

    seen = {}

    def engine(role, ip, groups=None, **kw):
        seen["groups"] = [(g.kind, g.num_layers, g.regions_per_layer,
                           [(r.length, r.item_len) for r in g.regions]) for g in groups]
        raise RuntimeError("engine captured")

    monkeypatch.setattr(conn.kvwire, "Engine", engine)
    a = _args(state_types=[StateType.MAMBA, StateType.C128_STATE, StateType.SWA],
              state_data_ptrs=[[1, 2], [], [3, 4]], state_data_lens=[[384, 640], [], [4096] * 2],
              state_item_lens=[[96, 160], [], [256] * 2])
    with pytest.raises(RuntimeError, match="engine captured"):
        _make(sg, a)
    K, S = kvwire.GroupKind.KV, kvwire.GroupKind.STATE
    assert seen["groups"] == [(K, 1, 1, [(4096, 64)]),
                              (S, 1, 2, [(384, 96), (640, 160)]),
                              (S, 1, 2, [(4096, 256), (4096, 256)])]


def test_state_indices_map_to_their_own_lists(sg):
    """sglang's per-StateType state_indices as kvwire state lists: Mamba's
    [array([slot])] its one slot, an SWA page array its list, None (or a
    component past the end) nothing for that group."""
    import numpy as np

    from kvwire.sglang.conn import _state_lists

    groups = {0: 1, 2: 2, 3: 3}  # component -> kvwire group (component 1: no buffers)
    got = _state_lists([[np.array([5])], None, np.array([7, 8, 9]), None], groups)
    assert got == {1: [5], 2: [7, 8, 9], 3: []}
    assert _state_lists(None, groups) == {1: [], 2: [], 3: []}
    assert _state_lists([[np.array([5])]], groups) == {1: [5], 2: [], 3: []}
    # sglang's Mamba payload: its 1-D mapping indexed by one request slot,
    # a 0-d array (numpy's 0-d arrays have __len__ but no length)
    assert _state_lists([[np.array(6, dtype=np.int32)]], groups) == {1: [6], 2: [], 3: []}


def test_heads_described_from_sglangs_kv_args(sg):
    """Head slicing's description of a rank's KV heads: prefill's from
    kv_head_num / total_kv_head_num, GQA replication; decode's (no head
    count in its KV args) learned from prefill's handshake: only its page,
    never the model's config; none (different TP sizes then refused) where
    the args cannot say."""
    from sglang.srt.configs import model_config
    from kvwire.sglang import conn

    GH = conn.kvwire.GroupHeads
    item = 4 * 2 * 128  # 4-token pages, 2 heads of 128 bytes
    calls = model_config.from_server_args_calls
    a = _args(kv_item_lens=[item] * 4, page_size=4, kv_head_num=2, total_kv_head_num=4)
    assert conn._heads(a, 4, (2, 1)) == GH(4, 2, 2, 128, 4, "NHD")
    assert conn._heads(_args(kv_item_lens=[item] * 4, page_size=4, kv_head_num=2), 4,
                       (2, 1)) == GH(4, 2, 2, 128, 4, "NHD")  # total: heads x TP
    # decode: learned, whatever its TP place (the engine gets it)
    learned = GH.learned(4, "NHD")
    assert learned == GH(0, 0, 0, 0, 4, "NHD")
    for tp in ((2, 1), (1, 0), (8, 5)):
        assert conn._heads(_args(kv_item_lens=[item] * 4, page_size=4), 4, tp) == learned
    # GQA: 2 heads over 8 ranks, prefill rank 5 holds head 1
    assert conn._heads(_args(kv_item_lens=[4 * 128] * 4, page_size=4, kv_head_num=1,
                             total_kv_head_num=2), 4, (8, 5)) == GH(2, 1, 1, 128, 4, "NHD")
    # a draft model's regions (other item lengths) or a size that does not divide
    assert conn._heads(_args(kv_item_lens=[item, item, 256, 256], page_size=4,
                             kv_head_num=2), 4, (2, 0)) is None
    assert conn._heads(_args(kv_item_lens=[item, item, 256, 256], page_size=4), 4,
                       (2, 0)) is None
    assert conn._heads(_args(kv_item_lens=[100] * 4, page_size=4, kv_head_num=2), 4,
                       (2, 0)) is None
    assert conn._heads(_args(kv_item_lens=[102] * 4, page_size=4), 4, (2, 0)) is None
    assert model_config.from_server_args_calls == calls  # no model config read


def test_tp_refusals_name_both_sizes(sg, monkeypatch):
    """Decode's verdict on a prefill attn TP size (None: served), each
    refusal naming both TP sizes."""
    import types

    from kvwire.sglang import conn

    r = conn.KVWireKVReceiver.__new__(conn.KVWireKVReceiver)
    heads = conn.kvwire.GroupHeads(4, 0, 4, 128, 4, "NHD")
    r.kv_mgr = types.SimpleNamespace(attn_tp_size=1, is_mla_backend=False, heads=heads,
                                     state_groups={})
    assert r._refusal(1) is None and r._refusal(2) is None  # equal; MHA 2 -> 1 served
    r.kv_mgr.heads = None
    assert "prefill attn TP size 2 != decode attn TP size 1" in r._refusal(2)
    r.kv_mgr.heads, r.kv_mgr.state_groups = heads, {0: 2}
    assert "prefill attn TP size 2, decode attn TP size 1: a hybrid" in r._refusal(2)
    r.kv_mgr.state_groups = {}
    monkeypatch.setenv("KVW_GPU_PATH", "staging")
    assert "prefill attn TP size 2, decode attn TP size 1" in r._refusal(2)
    assert "staged" in r._refusal(2)
    monkeypatch.delenv("KVW_GPU_PATH")
    r.kv_mgr.attn_tp_size = 2
    assert r._refusal(1) is None  # MHA 1 -> 2 served: prefill's sender fans out
    r.kv_mgr.heads = None
    assert "prefill attn TP size 1 != decode attn TP size 2" in r._refusal(1)
    r.kv_mgr.heads, r.kv_mgr.state_groups = heads, {0: 2}
    assert "prefill attn TP size 1, decode attn TP size 2: a hybrid" in r._refusal(1)
    r.kv_mgr.state_groups = {}
    r.kv_mgr.is_mla_backend = True
    assert r._refusal(1) is None  # MLA 1 -> 2 served: the latent to each decode rank
    r.kv_mgr.attn_tp_size = 1
    assert r._refusal(2) is None  # MLA 2 -> 1: one prefill rank sends
    r.recvs = []


def test_prefill_decode_receivers_from_sglangs_decode_tp(sg, monkeypatch):
    """Prefill serves each room to decode attn TP / prefill attn TP decode
    ranks, decode's sizes from sglang's --disaggregation-decode-tp / -dp
    (set on prefill only; unset: None, each room's sender learns the count
    from decode's requests, or 1 with a library that cannot); a size that
    is no multiple, or a hybrid MHA model's state with different sizes, is
    refused at creation."""
    import types

    from kvwire.sglang import conn

    m = conn.KVWireKVManager.__new__(conn.KVWireKVManager)
    m.attn_tp_size, m.state_groups, m.is_mla_backend = 1, {}, False
    sa = types.SimpleNamespace
    assert m._decode_receivers(sa()) is None  # learned per room
    with monkeypatch.context() as mp:
        import kvwire

        mp.setitem(kvwire._L.optional, "kvw_sender_create_learn", None)  # a 1.4 library
        assert m._decode_receivers(sa()) == 1
    assert m._decode_receivers(sa(disaggregation_decode_tp=1)) == 1
    assert m._decode_receivers(sa(disaggregation_decode_tp=4)) == 4
    assert m._decode_receivers(sa(disaggregation_decode_tp=4, disaggregation_decode_dp=2)) == 2
    m.attn_tp_size = 2
    assert m._decode_receivers(sa(disaggregation_decode_tp=8)) == 4
    assert m._decode_receivers(sa(disaggregation_decode_tp=2)) == 1
    with pytest.raises(RuntimeError, match="not a multiple"):
        m._decode_receivers(sa(disaggregation_decode_tp=3))
    m.state_groups = {0: 2}
    with pytest.raises(RuntimeError, match="prefill attn TP size 2, decode attn TP size 4"):
        m._decode_receivers(sa(disaggregation_decode_tp=4))
    m.is_mla_backend = True  # MLA's state goes whole to each: not sliced
    assert m._decode_receivers(sa(disaggregation_decode_tp=4)) == 2


def test_caller_digests_verified_transfers(sg):
    """KVW_VERIFY=1 with the caller's digests (GPU memory kvwire cannot
    read): the sender sums its parts (positions continue) and gives the
    sum with its last part; decode gives the digest of its pages once its
    receiver landed (0 for a dummy); where kvwire reads the memory itself
    (set_digest refused with KVW_ERR_STATE) the backend stops summing.
    The digest itself is digest.py's (test_digest.py); torch is not
    exercised here."""
    import kvwire
    from kvwire.sglang import conn

    calls = []

    class Mgr:
        verify, caller_digests = True, None

        def kv_digest(self, pages, first=0):
            calls.append((tuple(pages), first))
            return 1000 * first + len(pages)

    class FakeSender:
        def __init__(self, refuse=False):
            self.given, self.refuse = [], refuse

        def set_digest(self, v):
            if self.refuse:
                raise kvwire.Error(kvwire.Status.ERR_STATE, None, "kvw_sender_set_digest")
            self.given.append(v)

    s = conn.KVWireKVSender.__new__(conn.KVWireKVSender)
    s.kv_mgr, s.sender, s._digest, s._pages_sent = Mgr(), FakeSender(), 0, 0
    s._add_digest([4, 5, 6])
    s._add_digest([7])
    s._give_digest()
    assert calls == [((4, 5, 6), 0), ((7,), 3)]
    assert s.sender.given == [3 + 3001]
    assert s.kv_mgr.caller_digests is True

    s2 = conn.KVWireKVSender.__new__(conn.KVWireKVSender)
    s2.kv_mgr, s2.sender, s2._digest, s2._pages_sent = Mgr(), FakeSender(refuse=True), 0, 0
    s2._add_digest([1])
    s2._give_digest()
    assert s2.kv_mgr.caller_digests is False
    s2._add_digest([2])  # no more summing
    assert calls[-1] == ((1,), 0)

    class FakeRecv:
        closed = False

        def __init__(self, landed):
            self._landed, self.verified = landed, []

        def landed(self):
            return self._landed

        def verify(self, v):
            self.verified.append(v)

    r = conn.KVWireKVReceiver.__new__(conn.KVWireKVReceiver)
    r.kv_mgr, r._pages = Mgr(), [8, 9]
    waiting, landed, dummy = FakeRecv(False), FakeRecv(True), FakeRecv(True)
    r._verify_landed(waiting, False)
    r._verify_landed(landed, False)
    r._verify_landed(dummy, True)
    assert waiting.verified == [] and landed.verified == [2] and dummy.verified == [0]


def test_reason_never_names_room_uint64_max(sg):
    """A write that failed with no request in flight on its lane: the
    library names room UINT64_MAX; sglang's failure reason does not."""
    import kvwire
    from kvwire.sglang import conn

    e = kvwire.Error(kvwire.Status.ERR_PEER, "prefill: RDMA write (room 18446744073709551615) "
                     "completed with remote access error (vendor error 0x0)")
    got = conn._reason(e)
    assert "18446744073709551615" not in got and "(no room in flight)" in got, got
    assert conn._reason(kvwire.Error(kvwire.Status.ERR_PEER, "room 7 failed")).startswith(
        "room 7 failed")


class _FakeRecv:
    """A kvwire receiver's poll / abort / failure, as the backend uses them."""

    def __init__(self, state):
        from kvwire import Poll

        self.state, self.aborts, self.closed, self.bootstrap_addr = Poll(state), 0, False, "x"

    def poll(self):
        return self.state

    def abort(self):
        self.aborts += 1

    def failure(self):
        return None


def _receiver(conn, recvs, pages_given):
    import threading
    import types

    from sglang.srt.disaggregation.base.conn import KVPoll

    mgr = types.SimpleNamespace(request_status={5: KVPoll.Transferring}, failure_records={},
                                failure_lock=threading.Lock(), waiting_timeout=300,
                                peer_timeout_ms=50, where=lambda: "decode",
                                verify=False)
    mgr.record_failure = lambda room, why: mgr.failure_records.setdefault(room, why)
    mgr.update_status = lambda room, st: mgr.request_status.__setitem__(room, st)
    r = conn.KVWireKVReceiver.__new__(conn.KVWireKVReceiver)
    r.kv_mgr, r.bootstrap_room, r.conclude_state, r.init_time = mgr, 5, None, None
    r.recvs, r._deliver, r._pages_given = [(x, False) for x in recvs], False, pages_given
    r._failing, r._aborted, r.abort_notified = False, False, True
    return r


def test_decode_failed_only_after_kvwire_ended(sg):
    """Every path that fails a decode request (abort, sglang's heartbeat
    verdict in request_status, kvwire's failure on one of several prefill
    ranks) answers Transferring while a kvwire receiver holding the pages
    has not ended, and aborts each receiver once; Failed when they have.
    Before send_metadata (kvwire holds no page of sglang's): Failed at once.
    (The data path itself: test_sglang_fake_nic.py.)"""
    from kvwire import Poll
    from kvwire.sglang import conn
    from sglang.srt.disaggregation.base.conn import KVPoll

    a = _FakeRecv(Poll.TRANSFERRING)
    r = _receiver(conn, [a], pages_given=False)
    r.abort()
    assert r.poll() == KVPoll.Failed and a.aborts == 1
    for fail in ("abort", "heartbeat", "kvwire"):
        a, b = _FakeRecv(Poll.TRANSFERRING), _FakeRecv(Poll.TRANSFERRING)
        r = _receiver(conn, [a, b], pages_given=True)
        if fail == "abort":
            r.abort()
            r.abort()  # sglang may abort twice: one abort of each receiver
        elif fail == "heartbeat":
            r.kv_mgr.request_status[5] = KVPoll.Failed
        else:
            a.state = Poll.FAILED
        for _ in range(3):
            assert r.poll() == KVPoll.Transferring, fail
        assert b.aborts == 1 and r.conclude_state is None, fail
        if fail != "kvwire":
            a.state = Poll.FAILED
            assert r.poll() == KVPoll.Transferring, fail  # b still holds the pages
        b.state = Poll.FAILED if fail != "heartbeat" else Poll.SUCCESS
        assert r.poll() == KVPoll.Failed and r.conclude_state == KVPoll.Failed, fail
        with pytest.raises(conn.KVTransferError):
            r.failure_exception()


def test_decode_waiting_timeout_from_send_metadata(sg, monkeypatch):
    """sglang's waiting timeout runs from send_metadata (init_time) and
    fails the request with sglang's reason, after kvwire's receivers end."""
    import time

    from kvwire import Poll
    from kvwire.sglang import conn
    from sglang.srt.disaggregation.base.conn import KVPoll

    a = _FakeRecv(Poll.TRANSFERRING)
    r = _receiver(conn, [a], pages_given=True)
    r.kv_mgr.waiting_timeout = 0.05
    r.init_time = time.time()
    assert r.poll() == KVPoll.Transferring and a.aborts == 0
    time.sleep(0.06)
    assert r.poll() == KVPoll.Transferring and a.aborts == 1  # timed out, kvwire not ended
    a.state = Poll.FAILED
    assert r.poll() == KVPoll.Failed
    assert "timed out after" in r.kv_mgr.failure_records[5]


def test_failure_exception_waits_for_this_ranks_barrier(sg):
    """Another rank's Failed (sglang's all-reduce) while this rank's kvwire
    receiver still transfers: failure_exception aborts it and returns only
    once it has ended, or after 2 x peer_timeout_ms + 1 s."""
    import threading
    import time

    from kvwire import Poll
    from kvwire.sglang import conn

    a = _FakeRecv(Poll.TRANSFERRING)
    r = _receiver(conn, [a], pages_given=True)
    threading.Timer(0.2, lambda: setattr(a, "state", Poll.FAILED)).start()
    t0 = time.monotonic()
    with pytest.raises(conn.KVTransferError, match="failed on another rank"):
        r.failure_exception()
    assert 0.15 < time.monotonic() - t0 < 1.0 and a.aborts == 1
