#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
# Builds and installs kvwire as a packager would, host only, into a
# temporary directory, and checks:
#  - `make CFLAGS=... LDFLAGS=...` on the command line: the user's flags are
#    used (LDFLAGS' -rpath is in the library and a tool, CFLAGS' -O0 in the
#    recorded command line) and the project's are kept (-std=c11, -fPIC:
#    the shared library links); no -Werror unless WERROR=1;
#  - `make install PREFIX=/opt/kvwire DESTDIR=... LIBDIR=.../lib/x86_64-linux-gnu`:
#    exactly the expected files (man pages aside), kvwire.pc from its
#    template with those directories, a program built with
#    `pkg-config --cflags --libs kvwire` against the staged install runs
#    and reports the installed library's version;
#  - `make uninstall` with the same variables leaves no file behind.
# Usage: tests/install/install_test.sh   (from anywhere; a few minutes of
# one core at most: the library at -O0)
set -eu
cd "$(dirname "$0")/../.."
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail() {
    echo "install_test: FAIL: $*" >&2
    exit 1
}

# Independent of a calling make (make check exports WERROR=1 and its
# jobserver) and of flags in the environment: this is a user's build, with
# the flags given below.
unset MAKEFLAGS MFLAGS MAKELEVEL WERROR CFLAGS CPPFLAGS LDFLAGS LDLIBS
version=$(sed -n 's/^#define KVW_VERSION_\(MAJOR\|MINOR\|PATCH\) \([0-9]*\)$/\2/p' include/kvwire.h |
    paste -sd.)
major=${version%%.*}
build=$tmp/build
dest=$tmp/dest
prefix=/opt/kvwire
libdir=$prefix/lib/x86_64-linux-gnu
probe=/kvw-install-test-rpath
user_cflags="-O0 -g -frecord-gcc-switches"
user_ldflags="-Wl,-rpath,$probe"
mk() {
    make -j2 --no-print-directory BUILD="$build" CFLAGS="$user_cflags" LDFLAGS="$user_ldflags" \
        PREFIX="$prefix" DESTDIR="$dest" LIBDIR="$libdir" "$@"
}

# -Werror: only when asked.
make -n -B --no-print-directory BUILD="$build" "$build/obj/src/common/log.o" | grep -q -- -Werror &&
    fail "a plain make passes -Werror"
make -n -B --no-print-directory BUILD="$build" WERROR=1 "$build/obj/src/common/log.o" |
    grep -q -- -Werror || fail "WERROR=1 does not pass -Werror"

echo "install_test: make install (CFLAGS='$user_cflags' LDFLAGS='$user_ldflags' LIBDIR=$libdir)"
mk install >"$tmp/install.log" 2>&1 || { tail -30 "$tmp/install.log"; fail "make install failed"; }

# The user's flags and the project's, in what was built.
so=$dest$libdir/libkvwire.so.$version
readelf -d "$so" | grep -q "R.*PATH.*$probe" || fail "LDFLAGS' -rpath is not in $so"
readelf -d "$dest$prefix/bin/kvw-keygen" | grep -q "R.*PATH.*$probe" ||
    fail "LDFLAGS' -rpath is not in kvw-keygen"
switches=$(readelf -p .GCC.command.line "$build/obj/src/common/config.o" 2>/dev/null)
for want in -O0 -std=c11 -fPIC -fvisibility=hidden; do
    echo "$switches" | grep -q -- "$want" || fail "config.o was not built with $want"
done

# Exactly these files: a man page for every installed tool.
{
    echo "$prefix/include/kvwire.h"
    for f in libkvwire.a libkvwire.so "libkvwire.so.$major" "libkvwire.so.$version" \
        pkgconfig/kvwire.pc; do
        echo "$libdir/$f"
    done
    for t in tools/*.c; do
        t=${t#tools/}
        echo "$prefix/bin/${t%.c}"
        echo "$prefix/share/man/man1/${t%.c}.1"
    done
    echo "$prefix/bin/kvw-rxe"
    echo "$prefix/share/man/man1/kvw-rxe.1"
    echo "$prefix/share/doc/kvwire/LICENSE"
} | sort >"$tmp/want"
(cd "$dest" && find . ! -type d | sed 's|^\.||' | sort) >"$tmp/got"
if ! cmp -s "$tmp/want" "$tmp/got"; then
    diff "$tmp/want" "$tmp/got" >&2 || true
    fail "installed files differ from the list (< expected, > installed)"
fi
[ "$(readlink "$dest$libdir/libkvwire.so")" = "libkvwire.so.$major" ] || fail "libkvwire.so link"

# kvwire.pc, and a program built with it against the staged install.
pc=$dest$libdir/pkgconfig/kvwire.pc
grep -qx "prefix=$prefix" "$pc" || fail "kvwire.pc: prefix"
# shellcheck disable=SC2016 # ${prefix} is kvwire.pc's text, not the shell's
grep -qx 'libdir=${prefix}/lib/x86_64-linux-gnu' "$pc" || fail "kvwire.pc: libdir"
# shellcheck disable=SC2016
grep -qx 'includedir=${prefix}/include' "$pc" || fail "kvwire.pc: includedir"
export PKG_CONFIG_PATH="$dest$libdir/pkgconfig" PKG_CONFIG_SYSROOT_DIR="$dest"
[ "$(pkg-config --modversion kvwire)" = "$version" ] || fail "pkg-config --modversion"
cat >"$tmp/app.c" <<'EOC'
#include <kvwire.h>
#include <stdio.h>
int main(void)
{
    kvw_config_t cfg;
    if (kvw_config_init(&cfg) != KVW_OK || kvw_config_validate(&cfg) != KVW_OK)
        return 1;
    printf("%s\n", kvw_version_string());
    return 0;
}
EOC
# shellcheck disable=SC2046 # pkg-config's words
cc -std=c11 -Wall -Werror $(pkg-config --cflags kvwire) "$tmp/app.c" -o "$tmp/app" \
    $(pkg-config --libs kvwire) || fail "cannot build against the installed kvwire.pc"
got=$(LD_LIBRARY_PATH="$dest$libdir" "$tmp/app") || fail "the program against the install failed"
[ "$got" = "$version" ] || fail "the installed library says $got, not $version"
unset PKG_CONFIG_PATH PKG_CONFIG_SYSROOT_DIR

# Uninstall: nothing left.
mk uninstall >"$tmp/uninstall.log" 2>&1 || { cat "$tmp/uninstall.log"; fail "make uninstall"; }
left=$(cd "$dest" && find . ! -type d)
[ -z "$left" ] || fail "make uninstall left: $left"
echo "install_test: ok: $(wc -l <"$tmp/want") files installed under $libdir and $prefix," \
    "built against with pkg-config, uninstalled"
