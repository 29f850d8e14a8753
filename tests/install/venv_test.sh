#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
# The Python package's documented install route on Debian 12, whose python3
# is "externally managed" (PEP 668: a plain `pip install` is refused):
# a fresh venv that sees Debian's packages (python3-venv, python3-pip,
# python3-setuptools), then pip installs ./python from the tree with no
# package index and no build isolation, so nothing is downloaded. Checks
# the installed copy (not the tree's) imports, is the library's version
# (kvwire.__version__), carries py.typed, and works with the built
# library through KVWIRE_LIB. Host only, no network.
# Usage: tests/install/venv_test.sh [BUILD]   (BUILD holds libkvwire.so.1)
set -eu
cd "$(dirname "$0")/../.."
repo=$(pwd -P)
build=${1:-build}
case $build in /*) ;; *) build=$repo/$build ;; esac
python=${PYTHON:-/usr/bin/python3}
lib=$build/libkvwire.so.1
[ -e "$lib" ] || { echo "venv_test: $lib not built (make)" >&2; exit 1; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail() {
    echo "venv_test: FAIL: $*" >&2
    exit 1
}

"$python" -m venv --system-site-packages "$tmp/venv" ||
    fail "python3 -m venv (Debian: apt-get install python3-venv)"
# --no-index: no package index is reachable (or wanted); --no-build-isolation:
# the build backend is Debian's python3-setuptools, seen through
# --system-site-packages. The copy to $tmp keeps build/ files out of the tree.
cp -r python "$tmp/src"
PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    "$tmp/venv/bin/pip" install --no-index --no-build-isolation --no-deps "$tmp/src" \
    >"$tmp/pip.log" 2>&1 || { cat "$tmp/pip.log" >&2; fail "pip install into the venv"; }

want=$(sed -n 's/^#define KVW_VERSION_\(MAJOR\|MINOR\|PATCH\) \([0-9]*\)$/\2/p' include/kvwire.h |
    paste -sd.)
cd "$tmp" # away from the tree: the import must find the installed copy
KVWIRE_LIB=$lib PYTHONPATH='' "$tmp/venv/bin/python" - "$tmp/venv" "$want" <<'EOP' ||
import os, sys
import kvwire
venv, want = sys.argv[1], sys.argv[2]
assert os.path.realpath(kvwire.__file__).startswith(os.path.realpath(venv)), kvwire.__file__
assert kvwire.__version__ == want == kvwire.version(), (kvwire.__version__, want, kvwire.version())
assert os.path.exists(os.path.join(os.path.dirname(kvwire.__file__), "py.typed"))
from importlib import metadata
assert metadata.version("kvwire") == want, metadata.version("kvwire")
c = kvwire.Config(sq_depth=1024)
kvwire.set_log_handler(lambda level, msg: None)  # the refusal below is expected
try:
    kvwire.Config(sq_depth=16)
    raise SystemExit("Config(sq_depth=16) was accepted")
except ValueError:
    pass
print("venv_test: ok: kvwire", kvwire.__version__, "from", os.path.dirname(kvwire.__file__))
EOP
    fail "the installed package"
