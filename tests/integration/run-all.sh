#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
# Runs every integration test inside one test-bed boot; exits non-zero if any
# fails. Usage: run-all.sh BUILD_DIR
set -u
build=${1:-build}
failed=0
for t in "$build"/integration/*_test; do
    echo "== $t"
    if ! "$t"; then
        echo "FAILED: $t"
        failed=$((failed + 1))
    fi
done
[ -x tests/integration/examples_scenarios.sh ] && { tests/integration/examples_scenarios.sh "$build" || failed=$((failed + 1)); }
[ -x tests/integration/engine_scenarios.sh ] && { tests/integration/engine_scenarios.sh "$build" || failed=$((failed + 1)); }
[ -x tests/integration/compat_scenarios.sh ] && { tests/integration/compat_scenarios.sh "$build" || failed=$((failed + 1)); }
[ -x tests/integration/rails_scenarios.sh ] && { tests/integration/rails_scenarios.sh "$build" || failed=$((failed + 1)); }
[ -x tests/integration/rail_flap_scenarios.sh ] && { tests/integration/rail_flap_scenarios.sh "$build" || failed=$((failed + 1)); }
[ -x tests/integration/fault_scenarios.sh ] && { tests/integration/fault_scenarios.sh "$build" || failed=$((failed + 1)); }
[ -x tests/integration/auth_scenarios.sh ] && { tests/integration/auth_scenarios.sh "$build" || failed=$((failed + 1)); }
[ -x tests/integration/etcd_scenarios.sh ] && { tests/integration/etcd_scenarios.sh "$build" || failed=$((failed + 1)); }
[ -x tests/integration/soak_scenarios.sh ] && { tests/integration/soak_scenarios.sh "$build" || failed=$((failed + 1)); }
[ -x tests/integration/tools_scenarios.sh ] && { tests/integration/tools_scenarios.sh "$build" || failed=$((failed + 1)); }
[ -x tests/integration/testbed_scenarios.sh ] && { tests/integration/testbed_scenarios.sh "$build" || failed=$((failed + 1)); }
[ -x tests/integration/python_scenarios.sh ] && { tests/integration/python_scenarios.sh "$build" || failed=$((failed + 1)); }
echo "integration: $failed failed"
[ "$failed" -eq 0 ]
