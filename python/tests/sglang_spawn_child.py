# SPDX-License-Identifier: Apache-2.0
"""The start of an sglang scheduler process, as far as selecting the
transfer backend goes, for test_sglang_plugin.py: a process started with
multiprocessing's spawn method (as sglang starts its schedulers) runs
scheduler(). It imports nothing of kvwire itself: whatever makes sglang
know "kvwire" there must come from the plugin's entry point or from the
launcher that spawned it.

What is sglang's own code: TransferBackend, KVClassType, get_kv_class
(disaggregation/utils.py of the pinned snapshot) and the Common classes.
Stubs (python/tests/sglang_stubs): the plugin loader (the snapshot has
none; see its docstring) and the rest of sglang."""
import sys


def scheduler(q, site_dir=None, plugins=True, enter=True):
    try:
        out = {"kvwire_sglang_before": "kvwire.sglang" in sys.modules}
        import sglang_ref

        if enter:
            sglang_ref.enter()
        else:
            sglang_ref.shim_torch()
        if site_dir:  # an installed distribution, as pip would leave it
            import site

            site.addsitedir(site_dir)
        if plugins:  # upstream's scheduler process calls this at its start
            from sglang.srt.plugins import load_plugins

            load_plugins()
        from importlib.metadata import entry_points

        out["entry_points"] = sorted(f"{ep.name}={ep.value} ({ep.dist.name if ep.dist else None})"
                                     for ep in entry_points(group="sglang.srt.plugins"))
        from sglang.srt.disaggregation.base.conn import KVArgs
        from sglang.srt.disaggregation.common import conn as common
        from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class
        from sglang.srt.server_args import DISAGG_TRANSFER_BACKEND_CHOICES

        out["choices"] = list(DISAGG_TRANSFER_BACKEND_CHOICES)
        # the scheduler's TransferBackend(server_args.disaggregation_transfer_backend)
        backend = TransferBackend("kvwire")
        mgr = get_kv_class(backend, KVClassType.MANAGER)
        out["manager"] = f"{mgr.__module__}.{mgr.__qualname__}"
        out["common"] = all(issubclass(get_kv_class(backend, k), base) for k, base in (
            (KVClassType.MANAGER, common.CommonKVManager),
            (KVClassType.SENDER, common.CommonKVSender),
            (KVClassType.RECEIVER, common.CommonKVReceiver),
            (KVClassType.BOOTSTRAP_SERVER, common.CommonKVBootstrapServer)))
        out["kvargs_sglangs"] = get_kv_class(backend, KVClassType.KVARGS) is KVArgs
        out["ok"] = True
    except Exception as e:  # reported to the parent, which asserts on it
        out["ok"] = False
        out["error"] = f"{type(e).__name__}: {e}"
    q.put(out)
