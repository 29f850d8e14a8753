#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
# Checks docs/configuration.md against the code: every field of the
# configuration table in src/common/config.c (FIELD/TEXT lines; the
# variable is KVW_ + the field's name upper-cased) must have a row
# "| `field` | `KVW_FIELD` | default | ..." with the code's default, every
# such row must name a field the table still has, and the variables the
# library reads with getenv() itself (src/, outside config.c) must be the
# rows "| `KVW_NAME` | ..." of the table of variables outside kvw_config_t.
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
sed -n 's/^| `\(KVW_[A-Z0-9_]*\)` |.*/\1/p' "$doc" | sort -u >"$tmp/doc_env"

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

n=$(wc -l <"$tmp/code")
m=$(wc -l <"$tmp/code_env")
if [ $bad -ne 0 ]; then
    echo "check-config-doc: $doc disagrees with $config_c (fix the doc's tables)"
    exit 1
fi
echo "check-config-doc: $doc matches the code: $n kvw_config_t fields, $m other variables"
