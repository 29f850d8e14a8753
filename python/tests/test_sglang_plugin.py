# SPDX-License-Identifier: Apache-2.0
"""Selecting kvwire in sglang's scheduler processes, which sglang starts
with multiprocessing's spawn method (a fresh interpreter: nothing of the
parent's patches survives). Two ways, each tested the way sglang runs:

  - the plugin: kvwire registers `kvwire = kvwire.sglang:plugin` under the
    entry point group sglang.srt.plugins (python/pyproject.toml); upstream
    sglang's load_plugins() runs it in `python -m sglang.launch_server`
    and in every scheduler process. Here the distribution is installed into
    a site directory (its *.dist-info, with entry_points.txt from
    pyproject.toml), found through importlib.metadata, and a spawned
    process calls load_plugins() and then sglang's own TransferBackend /
    get_kv_class resolve "kvwire";
  - the launcher, for an sglang without plugins: `python -m
    kvwire.sglang.launch_server` runs a stand-in sglang.launch_server that
    starts its scheduler with spawn and never calls load_plugins().

Stubs: the plugin loader (sglang_stubs/sglang/srt/plugins: the pinned
snapshot has none) and, for the launcher test, sglang.launch_server
(written below: the snapshot has none; it parses the option against
sglang's choices and spawns the scheduler as sglang's does)."""
import json
import multiprocessing as mp
import os
import subprocess
import sys
import textwrap

import pytest

import sglang_ref

pytestmark = pytest.mark.skipif(bool(sglang_ref.missing()), reason=sglang_ref.missing() or "-")
HERE = os.path.dirname(os.path.abspath(__file__))
PYTHON_DIR = os.path.dirname(HERE)


def _entry_points_txt():
    """pyproject.toml's [project.entry-points.*] tables as setuptools writes
    them into entry_points.txt."""
    import tomllib

    with open(os.path.join(PYTHON_DIR, "pyproject.toml"), "rb") as f:
        proj = tomllib.load(f)["project"]
    out = []
    for group, eps in proj.get("entry-points", {}).items():
        out.append(f"[{group}]")
        out += [f"{k} = {v}" for k, v in eps.items()]
        out.append("")
    return proj, "\n".join(out)


def _install(site_dir):
    """kvwire installed into site_dir as pip's editable install leaves it:
    a .dist-info (METADATA, entry_points.txt, INSTALLER, RECORD) and a .pth
    naming the source tree."""
    proj, eps = _entry_points_txt()
    dist = os.path.join(site_dir, f"{proj['name']}-{proj['version']}.dist-info")
    os.makedirs(dist)
    files = {"METADATA": f"Metadata-Version: 2.1\nName: {proj['name']}\n"
                         f"Version: {proj['version']}\n",
             "entry_points.txt": eps, "INSTALLER": "test\n"}
    for name, text in files.items():
        with open(os.path.join(dist, name), "w") as f:
            f.write(text)
    with open(os.path.join(dist, "RECORD"), "w") as f:
        f.write("".join(f"{os.path.basename(dist)}/{n},,\n" for n in list(files) + ["RECORD"]))
    with open(os.path.join(site_dir, "kvwire.pth"), "w") as f:
        f.write(PYTHON_DIR + "\n")


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    """The spawned process inherits the environment: no plugin whitelist,
    no other backend name, unless a test sets them."""
    monkeypatch.delenv("SGLANG_PLUGINS", raising=False)
    monkeypatch.delenv("KVWIRE_SGLANG_BACKEND", raising=False)


def _spawn(**kw):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    import sglang_spawn_child

    p = ctx.Process(target=sglang_spawn_child.scheduler, args=(q,), kwargs=kw)
    p.start()
    try:
        return q.get(timeout=120)
    finally:
        p.join(30)


def test_pyproject_declares_the_plugin():
    proj, eps = _entry_points_txt()
    assert proj["entry-points"]["sglang.srt.plugins"] == {"kvwire": "kvwire.sglang:plugin"}


def test_spawned_scheduler_without_the_plugin_does_not_know_kvwire():
    """The issue as sglang shows it: a spawned scheduler that nothing told
    about kvwire refuses the name in sglang's own TransferBackend."""
    r = _spawn()
    assert not r["ok"] and "'kvwire' is not a valid TransferBackend" in r["error"], r
    assert not [e for e in r["entry_points"] if e.startswith("kvwire=")], r


def test_spawned_scheduler_loads_the_installed_plugin(tmp_path):
    site_dir = str(tmp_path / "site-packages")
    os.makedirs(site_dir)
    _install(site_dir)
    r = _spawn(site_dir=site_dir)
    assert r["ok"], r
    assert not r["kvwire_sglang_before"], r  # not imported by anything but the plugin
    assert "kvwire=kvwire.sglang:plugin (kvwire)" in r["entry_points"], r
    assert "kvwire" in r["choices"], r
    assert r["manager"] == "kvwire.sglang.conn.KVWireKVManager", r
    assert r["common"] and r["kvargs_sglangs"], r


def test_plugin_honours_sglang_plugins_whitelist(tmp_path, monkeypatch):
    """SGLANG_PLUGINS names the plugins to load: kvwire left out, not loaded."""
    site_dir = str(tmp_path / "site-packages")
    os.makedirs(site_dir)
    _install(site_dir)
    monkeypatch.setenv("SGLANG_PLUGINS", "someone_else")
    r = _spawn(site_dir=site_dir)
    assert not r["ok"] and "not a valid TransferBackend" in r["error"], r


OLD_LAUNCH_SERVER = '''
"""Stand-in for an sglang without plugins' launch_server: parse the
option against sglang's choices, start a scheduler with spawn."""
import argparse
import json
import multiprocessing as mp

from sglang.srt.server_args import DISAGG_TRANSFER_BACKEND_CHOICES

if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--disaggregation-transfer-backend", choices=DISAGG_TRANSFER_BACKEND_CHOICES)
    args = ap.parse_args()
    import sglang_spawn_child

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=sglang_spawn_child.scheduler, args=(q,),
                    kwargs=dict(plugins=False, enter=False))
    p.start()
    print("RESULT " + json.dumps(q.get(timeout=120)), flush=True)
    p.join(30)
'''


def test_launcher_survives_spawn_without_plugins(tmp_path):
    """`python -m kvwire.sglang.launch_server` on an sglang without the
    plugin framework: the scheduler it spawns knows "kvwire" too (spawn
    re-imports the launcher, whose import calls install())."""
    old = tmp_path / "old_sglang" / "sglang"
    old.mkdir(parents=True)
    (old / "launch_server.py").write_text(textwrap.dedent(OLD_LAUNCH_SERVER))
    env = dict(os.environ)
    env.pop("KVWIRE_SGLANG_BACKEND", None)
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path / "old_sglang"), sglang_ref.STUBS,
                                         sglang_ref.reference(), PYTHON_DIR, HERE])
    p = subprocess.run([sys.executable, "-m", "kvwire.sglang.launch_server",
                        "--disaggregation-transfer-backend", "kvwire"], env=env,
                       capture_output=True, text=True, timeout=180)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    assert p.returncode == 0 and lines, p.stdout[-3000:] + p.stderr[-3000:]
    r = json.loads(lines[-1][len("RESULT "):])
    assert r["ok"], r
    assert r["manager"] == "kvwire.sglang.conn.KVWireKVManager" and r["common"], r
