# SPDX-License-Identifier: Apache-2.0
"""kvwire.sglang: the selection patch (install) on stand-in modules that
play sglang/srt/{server_args,disaggregation/utils,prefill}.py, and the
shape of the pinned contract for the standalone (duck-typed) classes. The
Common-based backend is tested against sglang's own code in
test_sglang_common.py and python/tests/guest/test_sglang_common.py."""
import inspect
import sys
import textwrap
import types

import pytest

import kvwire.sglang as ks
import kvwire.sglang.standalone as st


@pytest.fixture
def fake_sglang(tmp_path, monkeypatch):
    """A package tree sglang/srt/disaggregation/{utils,prefill}.py on disk."""
    pkg = tmp_path / "sglang" / "srt" / "disaggregation"
    pkg.mkdir(parents=True)
    for d in (tmp_path / "sglang", tmp_path / "sglang" / "srt", pkg):
        (d / "__init__.py").write_text("")
    (pkg / "utils.py").write_text(textwrap.dedent("""
        import enum
        class TransferBackend(enum.Enum):
            MOONCAKE = "mooncake"
            NIXL = "nixl"
        class KVClassType(enum.Enum):
            KVARGS = "kvargs"
            MANAGER = "manager"
            SENDER = "sender"
            RECEIVER = "receiver"
            BOOTSTRAP_SERVER = "bootstrap_server"
        def get_kv_class(backend, class_type):
            return f"{backend.value}:{class_type.value}"
    """))
    (pkg / "prefill.py").write_text("from sglang.srt.disaggregation.utils import get_kv_class\n")
    (tmp_path / "sglang" / "srt" / "server_args.py").write_text(
        'DISAGG_TRANSFER_BACKEND_CHOICES = ["mooncake", "nixl"]\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    # kvwire's classes need sglang's Common classes: stand-ins here.
    sentinels = {k: type(f"KVWire{k}", (), {}) for k in ("MANAGER", "SENDER", "RECEIVER",
                                                          "BOOTSTRAP_SERVER")}
    monkeypatch.setattr(ks, "_backend_class",
                        lambda ct: sentinels.get(getattr(ct, "name", str(ct)).upper()))
    yield sentinels
    ks.uninstall()
    for name in [n for n in sys.modules if n == "sglang" or n.startswith("sglang.")]:
        del sys.modules[name]


def test_install_before_sglang_is_imported(fake_sglang):
    ks.install("mooncake")
    from sglang.srt.disaggregation import prefill, utils

    T, K = utils.TransferBackend, utils.KVClassType
    for get in (utils.get_kv_class, prefill.get_kv_class):
        for k in ("MANAGER", "SENDER", "RECEIVER", "BOOTSTRAP_SERVER"):
            assert get(T.MOONCAKE, K[k]) is fake_sglang[k]
        assert get(T.MOONCAKE, K.KVARGS) == "mooncake:kvargs"  # sglang's own KVArgs
        assert get(T.NIXL, K.SENDER) == "nixl:sender"
    assert ks.installed_backend() == "mooncake"


def test_install_after_import_patches_existing_names(fake_sglang):
    from sglang.srt.disaggregation import prefill, utils

    ks.install("nixl")
    ks.install("nixl")  # idempotent
    T, K = utils.TransferBackend, utils.KVClassType
    assert prefill.get_kv_class(T.NIXL, K.SENDER) is fake_sglang["SENDER"]
    assert prefill.get_kv_class(T.MOONCAKE, K.SENDER) == "mooncake:sender"
    ks.uninstall()
    assert prefill.get_kv_class(T.NIXL, K.SENDER) == "nixl:sender"


def test_kvwire_is_its_own_backend_name(fake_sglang, monkeypatch):
    """install() with no name: --disaggregation-transfer-backend kvwire
    parses (the choices list gains it), TransferBackend("kvwire") exists,
    and get_kv_class serves it; mooncake stays sglang's."""
    monkeypatch.delenv("KVWIRE_SGLANG_BACKEND", raising=False)
    ks.install()
    import argparse

    from sglang.srt import server_args
    from sglang.srt.disaggregation import prefill, utils

    assert "kvwire" in server_args.DISAGG_TRANSFER_BACKEND_CHOICES
    ap = argparse.ArgumentParser()
    ap.add_argument("--disaggregation-transfer-backend",
                    choices=server_args.DISAGG_TRANSFER_BACKEND_CHOICES)
    ns = ap.parse_args(["--disaggregation-transfer-backend", "kvwire"])
    T, K = utils.TransferBackend, utils.KVClassType
    backend = T(ns.disaggregation_transfer_backend)
    assert backend is T.KVWIRE and backend.value == "kvwire"
    assert prefill.get_kv_class(backend, K.MANAGER) is fake_sglang["MANAGER"]
    assert prefill.get_kv_class(T.MOONCAKE, K.MANAGER) == "mooncake:manager"
    assert not [n for n in sys.modules if "mooncake" in n]  # nothing of it imported


# The pinned base/conn.py (sglang 0094505da741): method -> parameters.
CONTRACT = {
    st.KVWireKVManager: {"__init__": ["args", "disaggregation_mode", "server_args",
                                      "is_mla_backend"],
                         "register_to_bootstrap": []},
    st.KVWireKVSender: {"__init__": ["mgr", "bootstrap_addr", "bootstrap_room", "dest_tp_ranks",
                                     "pp_rank", "req_has_disagg_prefill_dp_rank"],
                        "init": ["num_kv_indices", "aux_index"],
                        "send": ["kv_indices", "state_indices", "token_position_offset"],
                        "pop_decode_prefix_len": [], "should_send_kv_chunk": ["num_pages",
                                                                              "last_chunk"],
                        "get_transfer_metric": [], "poll": [], "failure_exception": [],
                        "clear": [], "abort": []},
    st.KVWireKVReceiver: {"__init__": ["mgr", "bootstrap_addr", "bootstrap_room"],
                          "init": ["prefill_dp_rank"],
                          "send_metadata": ["kv_indices", "aux_index", "state_indices",
                                            "decode_prefix_len"],
                          "poll": [], "failure_exception": [], "clear": [], "abort": []},
    st.KVWireKVBootstrapServer: {"__init__": ["host", "port"]},
}


@pytest.mark.parametrize("cls", list(CONTRACT))
def test_contract_signatures(cls):
    for method, params in CONTRACT[cls].items():
        sig = inspect.signature(getattr(cls, method))
        names = [p.name for p in sig.parameters.values()
                 if p.kind in (p.POSITIONAL_OR_KEYWORD, p.POSITIONAL_ONLY)][1:]
        assert names[:len(params)] == params, f"{cls.__name__}.{method}{sig}"


def test_creation_failures_are_reported_by_poll_not_raised():
    """sglang constructs senders/receivers without expecting errors: a
    failed create (a duplicate room, an unknown rank) shows as KVPoll.Failed
    and failure_exception() says why; later calls are harmless."""
    import kvwire

    class Engine:
        def sender(self, room):
            raise kvwire.Error(kvwire.Status.ERR_EXISTS, "room 5 is taken")

        def receiver(self, *a):
            raise kvwire.Error(kvwire.Status.ERR_NOT_FOUND, "rank 0 is not registered")

    mgr = types.SimpleNamespace(engine=Engine(), chunked_sends=True, prefill_rank=lambda dp: 0)
    s = st.KVWireKVSender(mgr, "10.0.0.1:8998", 5, [0], 0)
    s.init(3, 1)
    s.send([1, 2, 3])
    assert s.poll() == 0
    with pytest.raises(st.KVTransferError, match="room 5 is taken"):
        s.failure_exception()
    assert s.get_transfer_metric().transfer_total_bytes is None
    s.abort()
    s.clear()
    assert s.poll() == 0
    r = st.KVWireKVReceiver(mgr, "10.0.0.1:8998", 6)
    assert r.poll() == 1  # Bootstrapping until init
    r.init(0)
    r.send_metadata([1], 0)
    assert r.poll() == 0
    with pytest.raises(st.KVTransferError, match="not registered") as ei:
        r.failure_exception()
    assert ei.value.error.status == kvwire.Status.ERR_NOT_FOUND
    r.abort()
    r.clear()


def test_uninstall_restores_the_environment(fake_sglang, monkeypatch):
    """install() exports KVWIRE_SGLANG_BACKEND for spawned schedulers;
    uninstall() puts the environment back (a test process must not leak
    the name into the processes it starts later)."""
    import os

    monkeypatch.delenv("KVWIRE_SGLANG_BACKEND", raising=False)
    ks.install("nixl")
    assert os.environ["KVWIRE_SGLANG_BACKEND"] == "nixl"
    ks.uninstall()
    assert "KVWIRE_SGLANG_BACKEND" not in os.environ
