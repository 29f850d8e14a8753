#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Mutation run: puts a fixed bug back into a copy of the tree and shows
# that the tests meant to catch it do. Not part of `make check` (it builds
# the library's sanitizer objects a second time, a few minutes on 2 cores).
#
#     tests/mutants/run.sh [PATCH ...]     every tests/mutants/*.patch by default
#
# flap-replay.patch: issue 28's bug 1, a flapping rail (fail, rejoin, fail)
# replaying a request decode completed into pages it reused. Expected:
# test_chaos's flap schedules (I9) report violations, and test_rails'
# test_flap_no_replay_after_success fails. Exit 0 when every mutant was
# caught, 1 when one survived.
set -euo pipefail
cd "$(dirname "$0")/../.."
patches=("$@")
[ ${#patches[@]} -gt 0 ] || patches=(tests/mutants/*.patch)
schedules=${KVW_MUTANT_SCHEDULES:-4000}
survived=0
for patch in "${patches[@]}"; do
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
    git ls-files -z | xargs -0 cp --parents -t "$work"
    (cd "$work" && patch -s -p1 <"$OLDPWD/$patch")
    echo "== mutant $(basename "$patch"): building"
    make -C "$work" -s -j"$(nproc)" build/unit/test_chaos build/unit/test_rails >/dev/null
    caught=0
    out=$(cd "$work" && KVW_CHAOS_FLAPS_ONLY=1 KVW_CHAOS_SCHEDULES=$schedules \
        build/unit/test_chaos 2>&1 || true)
    echo "$out" | grep -E '^chaos: [0-9]+ (flap|fault) schedules'
    echo "$out" | grep -qE ': [1-9][0-9]* invariant violations' && caught=$((caught + 1))
    if (cd "$work" && build/unit/test_rails test_flap_no_replay_after_success >/dev/null 2>&1); then
        echo "test_rails test_flap_no_replay_after_success: passed (mutant survived it)"
    else
        echo "test_rails test_flap_no_replay_after_success: failed (mutant caught)"
        caught=$((caught + 1))
    fi
    if [ "$caught" -eq 2 ]; then
        echo "== mutant $(basename "$patch"): caught by both"
    else
        echo "== mutant $(basename "$patch"): SURVIVED ($caught of 2 caught it)"
        survived=1
    fi
    rm -rf "$work"
    trap - EXIT
done
exit "$survived"
