#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
# Build the previous minor release's kvw-xfer from this repository's own
# history, for the compatibility test (tests/integration/compat_scenarios.sh,
# docs/api-policy.md "Compatibility between releases").
#
# The previous minor release is the last commit at which include/kvwire.h
# had KVW_VERSION_MINOR one below today's (the parent of the commit that
# first set today's minor). Its tree (git archive) is built in
# BUILD/compat/src with its own Makefile, only its static library and
# kvw-xfer; the tool lands at BUILD/compat/kvw-xfer, its version at
# BUILD/compat/version. A build already made from the same commit is kept.
# No history (a shallow clone, an export without .git) is an error saying
# so: the test cannot run without it.
# Usage: scripts/build-prev-release.sh BUILD_DIR
set -eu
build=${1:-build}
out=$build/compat
die() {
    echo "build-prev-release: $*" >&2
    exit 1
}

header=include/kvwire.h
major=$(sed -n 's/^#define KVW_VERSION_MAJOR \([0-9]*\)$/\1/p' "$header")
minor=$(sed -n 's/^#define KVW_VERSION_MINOR \([0-9]*\)$/\1/p' "$header")
[ -n "$major" ] && [ -n "$minor" ] || die "cannot read the version from $header"
[ "$minor" -gt 0 ] || die "$major.$minor is the first minor release of its major: no previous one"
git rev-parse --git-dir >/dev/null 2>&1 ||
    die "not a git checkout: the compatibility test builds $major.$((minor - 1)) from this repository's history"
shallow=""
[ "$(git rev-parse --is-shallow-repository 2>/dev/null)" = true ] &&
    shallow=" (this clone is shallow: git fetch --unshallow)"
bump=$(git log --format=%H -S"#define KVW_VERSION_MINOR $minor" -- "$header" | tail -n 1)
[ -n "$bump" ] || die "no commit in the history sets KVW_VERSION_MINOR $minor$shallow"
prev=$(git rev-parse --verify -q "$bump^") ||
    die "the history ends at $bump, already $major.$minor: release $major.$((minor - 1)) is missing$shallow"
have=$(git show "$prev:$header" | sed -n 's/^#define KVW_VERSION_\(MAJOR\|MINOR\|PATCH\) \([0-9]*\)$/\2/p' | paste -sd.)
case $have in
"$major.$((minor - 1))".*) ;;
*) die "commit $prev (before $bump) is version '$have', not $major.$((minor - 1))" ;;
esac

if [ -x "$out/kvw-xfer" ] && [ "$(cat "$out/commit" 2>/dev/null)" = "$prev" ]; then
    echo "build-prev-release: $have ($prev) already built in $out"
    exit 0
fi
rm -rf "$out"
mkdir -p "$out/src"
git archive "$prev" | tar -x -C "$out/src"
# Its kvw-xfer: tools/ or, before 1.5, tests/tools/.
if [ -f "$out/src/tools/kvw-xfer.c" ] || [ -f "$out/src/tests/tools/kvw-xfer.c" ]; then :; else
    die "release $have ($prev) has no kvw-xfer.c"
fi
echo "build-prev-release: building $have ($prev) in $out/src"
# Only the library and the tool: its own flags, none of the caller's.
env -u CFLAGS -u CPPFLAGS -u LDFLAGS -u LDLIBS -u WERROR -u MAKEFLAGS -u MFLAGS \
    make -C "$out/src" BUILD=build build/kvw-xfer >"$out/build.log" 2>&1 ||
    { tail -n 20 "$out/build.log" >&2; die "building $have failed (log: $out/build.log)"; }
cp "$out/src/build/kvw-xfer" "$out/kvw-xfer"
echo "$have" >"$out/version"
echo "$prev" >"$out/commit"
rm -rf "$out/src/build/obj" "$out/src/build/san"
echo "build-prev-release: $out/kvw-xfer is kvw-xfer $have"
