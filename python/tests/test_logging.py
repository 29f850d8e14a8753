# SPDX-License-Identifier: Apache-2.0
"""Where libkvwire's log lines go from Python: the `logging` logger "kvwire"
by default (nothing on stderr unless the application configures logging:
the error reaches it in the exception), with the line's subsystem; stderr
again, in the C library's format, with kvwire.log_to_stderr(). Each case in
a fresh interpreter (the routing is process-wide)."""
import json
import os
import re
import subprocess
import sys

PY = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(code):
    env = dict(os.environ, KVW_CHAIN_MAX="x", PYTHONPATH=PY, PYTHONDONTWRITEBYTECODE="1")
    for name in ("KVW_LOG_FILE", "KVW_LOG_LEVEL", "KVW_LOG_SUBSYS"):
        env.pop(name, None)  # the defaults are what is tested
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=60)


FAIL_CONFIG = """
import kvwire
try:
    kvwire.Config()
except kvwire.Error as e:
    print("raised:", e.reason)
"""


def test_default_routes_to_logging_and_prints_nothing():
    out = run(FAIL_CONFIG)
    assert out.returncode == 0, out.stderr
    assert out.stderr == ""
    assert "raised:" in out.stdout and "KVW_CHAIN_MAX" in out.stdout


def test_logging_gets_the_record_with_its_subsystem():
    code = """
import logging
seen = []
class Keep(logging.Handler):
    def emit(self, record):
        seen.append((record.levelname, record.getMessage(), record.kvw_subsystem))
logging.getLogger("kvwire").addHandler(Keep())
""" + FAIL_CONFIG + """
import json
print(json.dumps(seen))
"""
    out = run(code)
    assert out.returncode == 0 and out.stderr == "", out.stderr
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert [level for level, _, _ in seen] == ["ERROR"], seen
    _, message, subsystem = seen[0]
    assert subsystem == "INIT" and message.startswith("INIT: ") and "KVW_CHAIN_MAX" in message


def test_log_to_stderr_writes_the_c_format():
    out = run("import kvwire; kvwire.log_to_stderr()\n" + FAIL_CONFIG)
    assert out.returncode == 0, out.stderr
    assert re.match(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z kvwire\[\d+\.\d+\] ERROR INIT: "
                    r".*KVW_CHAIN_MAX", out.stderr), out.stderr
