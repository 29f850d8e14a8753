#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
# Checks docs/configuration.md against the code: every field of the
# configuration table in src/common/config.c (FIELD/TEXT lines; the
# variable is KVW_ + the field's name upper-cased) must have a row
# "| `field` | `KVW_FIELD` | default | ..." with the code's default, every
# such row must name a field the table still has, and the variables the
# library reads with getenv() itself (src/, outside config.c) must be the
# rows "| `KVW_NAME` | ..." of the table of variables outside kvw_config_t
# and config.c's library_vars (the names it does not warn about). The test
# bed's and tests' prefixes (config.c's test_prefixes) must be the doc's
# "test prefix" table, and every KVW_* variable that tests/, bench/, tools/,
# scripts/, python/ or the Makefile reads or sets must be the library's or
# carry one of them (else the library would warn about it).
# Host only, no build needed. Exit 0 when they agree, 1 listing each
# difference otherwise.
# Usage: scripts/check-config-doc.sh [CONFIG_C [DOC [SRC_DIR]]]
set -eu
cd "$(dirname "$0")/.."
config_c=${1:-src/common/config.c}
doc=${2:-docs/configuration.md}
src=${3:-src}
for f in "$config_c" "$doc"; do
    [ -f "$f" ] || { echo "check-config-doc: $f not found" >&2; exit 1; }
done
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# Code: "field ENV default", one a line. Text fields default to "".
sed -n 's/^[[:space:]]*FIELD(\([a-z0-9_]*\),[^,]*,[[:space:]]*\([-0-9a-fA-Fx]*\),.*/\1 \2/p; s/^[[:space:]]*TEXT(\([a-z0-9_]*\),.*/\1 ""/p' \
    "$config_c" |
    while read -r name def; do
        echo "$name KVW_$(echo "$name" | tr '[:lower:]' '[:upper:]') $def"
    done | sort >"$tmp/code"
[ -s "$tmp/code" ] || { echo "check-config-doc: no FIELD/TEXT lines in $config_c" >&2; exit 1; }

# Doc: rows "| `field` | `ENV` | default |".
sed -n 's/^| `\([a-z0-9_]*\)` | `\(KVW_[A-Z0-9_]*\)` | \([^|]*\) |.*/\1 \2 \3/p' "$doc" |
    sed 's/[[:space:]]*$//' | sort >"$tmp/doc"

# Variables outside the table: getenv("KVW_...") in the library's sources
# (config.c builds its names from the table) against rows "| `KVW_X` |".
grep -rhoE --include='*.c' --include='*.h' 'getenv\("KVW_[A-Z0-9_]+"\)' "$src" |
    sed 's/getenv("\(.*\)")/\1/' | sort -u >"$tmp/code_env"
# Rows of one "### title" section of the doc.
section() {
    awk -v t="$1" '/^### / { on = index($0, t) > 0; next } on' "$doc"
}
# shellcheck disable=SC2016 # backquotes are the doc's markdown
section 'Outside `kvw_config_t`' | sed -n 's/^| `\(KVW_[A-Z0-9_]*\)` |.*/\1/p' |
    sort -u >"$tmp/doc_env"
# A C string list in config.c: the quoted names between "NAME[] = {" and "};".
c_list() {
    awk -v n="$1" 'index($0, n "[] = {") { on = 1; next } on && /^};/ { on = 0 } on' \
        "$config_c" | grep -oE '"KVW_[A-Z0-9_]*"' | tr -d '"' | sort -u
}
c_list library_vars >"$tmp/lib_list"
c_list test_prefixes >"$tmp/test_list"
# shellcheck disable=SC2016
section 'Test bed, tests and benchmarks' | sed -n 's/^| `\(KVW_[A-Z0-9_]*\)` |$/\1/p' |
    sort -u >"$tmp/doc_test"
# What the tests, tools and scripts read or set (test_config.c and the
# Python config tests spell unknown names on purpose).
grep -rhoE --exclude=test_config.c --exclude='test_config*.py' \
    'getenv\("KVW_[A-Z0-9_]+"|setenv\("KVW_[A-Z0-9_]+"|environ(\.get\(|\[)"KVW_[A-Z0-9_]+"|\$\{?KVW_[A-Z0-9_]+|(^|[[:space:]])KVW_[A-Z0-9_]+=' \
    tests bench tools scripts python Makefile 2>/dev/null |
    grep -oE 'KVW_[A-Z0-9_]+' | sort -u >"$tmp/used_env"

bad=0
while read -r name env def; do
    row=$(awk -v n="$name" '$1 == n' "$tmp/doc")
    if [ -z "$row" ]; then
        echo "check-config-doc: $doc misses field $name ($env, default $def)"
        bad=1
        continue
    fi
    # shellcheck disable=SC2086 # three words: field, variable, default
    set -- $row
    if [ "$2" != "$env" ]; then
        echo "check-config-doc: $doc names $name's variable $2; the code reads $env"
        bad=1
    fi
    if [ "$3" != "$def" ]; then
        echo "check-config-doc: $doc gives $name the default $3; the code's is $def"
        bad=1
    fi
done <"$tmp/code"
while read -r name env def; do
    if ! awk -v n="$name" '$1 == n { f = 1 } END { exit !f }' "$tmp/code"; then
        echo "check-config-doc: $doc lists field $name ($env), which the code no longer has"
        bad=1
    fi
done <"$tmp/doc"
comm -23 "$tmp/code_env" "$tmp/doc_env" | while read -r env; do
    echo "check-config-doc: $doc misses $env, which the library reads"
done | grep . && bad=1
comm -13 "$tmp/code_env" "$tmp/doc_env" | while read -r env; do
    echo "check-config-doc: $doc lists $env, which the library no longer reads"
done | grep . && bad=1

if ! cmp -s "$tmp/code_env" "$tmp/lib_list"; then
    echo "check-config-doc: $config_c's library_vars ($(tr '\n' ' ' <"$tmp/lib_list")) are not" \
        "the variables src/ reads with getenv ($(tr '\n' ' ' <"$tmp/code_env"))"
    bad=1
fi
if ! cmp -s "$tmp/test_list" "$tmp/doc_test"; then
    echo "check-config-doc: $config_c's test_prefixes ($(tr '\n' ' ' <"$tmp/test_list")) are" \
        "not $doc's test prefix table ($(tr '\n' ' ' <"$tmp/doc_test"))"
    bad=1
fi
cut -d' ' -f2 "$tmp/code" | cat - "$tmp/code_env" | sort -u >"$tmp/known"
comm -23 "$tmp/used_env" "$tmp/known" >"$tmp/unknown"
while read -r env; do
    covered=0
    while read -r prefix; do
        case $env in "$prefix"*) covered=1 ;; esac
    done <"$tmp/test_list"
    if [ $covered -eq 0 ]; then
        echo "check-config-doc: $env is used under tests/, bench/, tools/, scripts/ or python/" \
            "but is neither the library's nor under a test prefix of $doc (the library would" \
            "warn about it)"
        bad=1
    fi
done <"$tmp/unknown"
n=$(wc -l <"$tmp/code")
m=$(wc -l <"$tmp/code_env")
if [ $bad -ne 0 ]; then
    echo "check-config-doc: $doc disagrees with $config_c (fix the doc's tables)"
    exit 1
fi
echo "check-config-doc: $doc matches the code: $n kvw_config_t fields, $m other variables," \
    "$(wc -l <"$tmp/test_list") test prefixes"
