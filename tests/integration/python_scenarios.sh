#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
# The Python binding and the sglang backend on real rxe, inside the test bed:
# pytest over python/tests (the host tests again, plus python/tests/guest:
# transfers through the binding, the sglang backend on sglang's own
# connection code (test_sglang_on_rxe.py: separate prefill and decode
# processes, five layouts and a killed prefill), and the older standalone
# sglang harness), then the README's example (python/examples/transfer.py).
# Debian's python3 with python3-pytest and python3-numpy (and, for the
# sglang tests, python3-torch, -zmq, -requests, -aiohttp and the sglang
# reference snapshot). Usage: python_scenarios.sh BUILD_DIR
set -u
. "$(dirname "$0")/common.sh"
py=${PYTHON:-/usr/bin/python3}
[ -x "$py" ] || py=python3
case $build in /*) ;; *) build=$PWD/$build ;; esac
export KVWIRE_LIB="$build/libkvwire.so.1" PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONDONTWRITEBYTECODE=1

echo "[==========] python scenarios on real RDMA (test bed mode ${KVW_TB_MODE:-?}), $("$py" --version 2>&1)"
if ! "$py" -c 'import pytest, numpy' 2>/dev/null; then
    echo "[  FAILED  ] python3-pytest and python3-numpy are needed (scripts/install-deps.sh)"
    exit 1
fi

echo "[ RUN      ] pytest python/tests (binding, sglang backend on sglang's code, harness)"
KVWIRE_TEST_REPORT="$work/report" "$py" -m pytest -q -p no:cacheprovider -rfEs python/tests \
    >"$work/pytest.log" 2>&1
rc=$?
[ -f "$work/report" ] && sed 's/^/    /' "$work/report"
grep -E '^(FAILED|ERROR|SKIPPED)' "$work/pytest.log" | sed 's/^/    /'
[ $rc -eq 0 ] || tail -n 60 "$work/pytest.log" | sed 's/^/    | /'
# The summary line, not the last line: asyncio may print a warning after it
# (sglang's bootstrap server leaves its cleanup task pending at exit).
echo "    pytest: $(grep -E '[0-9]+ (passed|failed|error)' "$work/pytest.log" | tail -n 1)"
result "pytest python/tests" $rc

echo "[ RUN      ] README example: python/examples/transfer.py"
"$py" python/examples/transfer.py "$ip0" "$ip1" "$dev0" "$dev1" >"$work/example.log" 2>&1
rc=$?
sed 's/^/    /' "$work/example.log"
result "README example" "$rc"

rm -rf "$work"
echo "[==========] python scenarios: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
