# SPDX-License-Identifier: Apache-2.0
"""kvwire.Config against the library's own rules (kvw_config_validate), the
KVW_* environment as the docs write it, unknown names, and the package's
version. Host only. (check-config-doc.sh skips this file: it spells unknown
KVW_* names on purpose.)"""
import os
import re
import subprocess
import sys

import pytest

import kvwire

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))


@pytest.mark.parametrize("fields, says", [
    ({"sq_depth": 16}, "chain_max"),                      # 64 > 16 / 2
    ({"heartbeat_ms": 2000}, "peer_timeout_ms"),          # not below it
    ({"flow_label": 0x100000}, "flow_label"),             # 21 bits
    ({"qp_retry_cnt": 8}, "qp_retry_cnt"),
    ({"staging_lanes": 0}, "staging_lanes"),
    ({"gpu_path": "fast"}, "gpu_path"),
    ({"cluster_key": "k" * 40, "cluster_key_file": "/k"}, "not both"),
])
def test_config_refuses_what_the_engine_refuses(fields, says):
    with pytest.raises(ValueError) as ei:
        kvwire.Config(**fields)
    assert says in str(ei.value)


def test_config_fields_change_together_or_not_at_all():
    c = kvwire.Config()
    with pytest.raises(ValueError):
        c.sq_depth = 16
    assert c.sq_depth == 512  # unchanged
    c.update(sq_depth=16, chain_max=8, signal_every=8)
    assert (c.sq_depth, c.chain_max, c.signal_every) == (16, 8, 8)
    c2 = kvwire.Config(sq_depth=16, chain_max=8, signal_every=8)
    assert c2.sq_depth == 16
    with pytest.raises(ValueError):
        c.update(chain_max=9, flow_label=5)
    assert c.chain_max == 8 and c.flow_label == -1  # neither applied


def test_env_numbers_as_the_docs_write_them(monkeypatch):
    monkeypatch.setenv("KVW_FLOW_LABEL", "0x10")
    monkeypatch.setenv("KVW_TRAFFIC_CLASS", "0x6a")
    c = kvwire.Config()
    assert c.flow_label == 16 and c.traffic_class == 106


@pytest.mark.parametrize("value", ["0x100000", "1e3", "+5", "0x"])
def test_env_bad_number_is_one_refusal(monkeypatch, value):
    monkeypatch.setenv("KVW_FLOW_LABEL", value)
    seen = []
    kvwire.set_log_handler(lambda lvl, msg: seen.append(msg))
    try:
        with pytest.raises(kvwire.Error) as ei:
            kvwire.Config()
    finally:
        kvwire.set_log_handler(None)
    assert ei.value.status == kvwire.Status.ERR_INVALID
    assert "KVW_FLOW_LABEL" in ei.value.reason and "refused" in ei.value.reason
    assert len([m for m in seen if "KVW_FLOW_LABEL" in m]) == 1
    assert not any("keeping" in m for m in seen)


@pytest.mark.parametrize("name", ["verbose", "trace", "debug", "info", "warning", "WARN", "error"])
def test_log_level_names_accepted(monkeypatch, name):
    monkeypatch.setenv("KVW_LOG_LEVEL", name)
    kvwire.Config()


def test_log_level_unknown_refused(monkeypatch):
    monkeypatch.setenv("KVW_LOG_LEVEL", "loud")
    with pytest.raises(kvwire.Error) as ei:
        kvwire.Config()
    assert "KVW_LOG_LEVEL='loud' refused" in ei.value.reason


def _run(env_extra):
    env = dict(os.environ)
    env.update(env_extra)
    # The binding routes the library's lines to logging (logger "kvwire"):
    # the application's handler, here logging's own to stderr, prints them.
    code = ("import logging, kvwire; logging.basicConfig(level=logging.WARNING); "
            "kvwire.Config(); kvwire.Config(); print('ok')")
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=60)


def test_unknown_variable_warned_once_per_process():
    r = _run({"KVW_SQ_DEPHT": "1024", "KVW_TB_IP0": "10.0.0.1", "KVW_CHAOS_SCHEDULES": "3"})
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr
    lines = [l for l in r.stderr.splitlines() if "unknown variable" in l]
    assert len(lines) == 1, r.stderr
    assert "KVW_SQ_DEPHT ignored (did you mean KVW_SQ_DEPTH?)" in lines[0]


def test_version_and_typing_marker():
    assert kvwire.__version__ == kvwire.version()
    with open(os.path.join(REPO, "include", "kvwire.h")) as f:
        header = dict(re.findall(r"#define KVW_VERSION_(MAJOR|MINOR|PATCH) (\d+)", f.read()))
    assert kvwire.__version__ == "{MAJOR}.{MINOR}.{PATCH}".format(**header)
    assert os.path.exists(os.path.join(os.path.dirname(kvwire.__file__), "py.typed"))
