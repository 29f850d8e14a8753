#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Check each public function's symbol version node against the release
that added it (docs/api-policy.md, "Symbol versions").

Usage: check_symbols.py SHARED_LIBRARY RECORD HEADER

RECORD (tests/abi/kvwire-symbols.txt) names every public function with the
release that added it ("kvw_name 1.2"), and the older nodes where earlier
releases exported it ("compat KVWIRE_1.0"). The check fails when:
  - a KVW_API function of HEADER is not in RECORD (record a new one with
    the release it comes in) or RECORD names one HEADER lacks;
  - the library's default version of a symbol (name@@NODE) is not
    KVWIRE_<its release> (a 1.0 symbol: KVWIRE_1.0), or a compat node is
    missing, or the symbol has a version RECORD does not name;
  - the repository's history is at hand (not a shallow clone) and the
    release RECORD gives differs from the first release whose header
    declared the function (the last commit before each minor bump on the
    first-parent line, from 1.0 on; the header now counts as its own
    version).
"""
import re
import subprocess
import sys


def header_functions(text):
    return set(re.findall(r"KVW_API[^;{]*?\b(kvw_[a-z0-9_]+)\s*\(", text, re.S))


def header_version(text):
    v = re.findall(r"#define KVW_VERSION_(?:MAJOR|MINOR) (\d+)", text)
    return tuple(int(x) for x in v)


def read_record(path):
    record = {}
    for line in open(path):
        f = line.split("#")[0].split()
        if not f:
            continue
        release = tuple(int(x) for x in f[1].split("."))
        compat = f[3:] if len(f) > 3 and f[2] == "compat" else []
        record[f[0]] = (release, compat)
    return record


def library_versions(lib):
    """name -> (default node, [hidden nodes]) from objdump -T."""
    out = subprocess.run(["objdump", "-T", lib], check=True, capture_output=True,
                         text=True).stdout
    syms = {}
    for line in out.splitlines():
        m = re.search(r"\s(\(?)(KVWIRE_[0-9.]+)\)?\s+(kvw_\w+)$", line)
        if not m:
            continue
        hidden, node, name = m.group(1) == "(", m.group(2), m.group(3)
        default, others = syms.get(name, (None, []))
        if hidden:
            others.append(node)
        else:
            default = node
        syms[name] = (default, others)
    return syms


def git(*args):
    return subprocess.run(["git", *args], capture_output=True, text=True)


def history_releases(header_path, now):
    """name -> the first release declaring it, or None without history."""
    if git("rev-parse", "--git-dir").returncode or \
            git("rev-parse", "--is-shallow-repository").stdout.strip() == "true":
        return None
    line = git("log", "--first-parent", "--reverse", "--format=%H", "--",
               header_path).stdout.split()
    releases, prev = [], None
    for c in line:
        text = git("show", f"{c}:{header_path}").stdout
        v = header_version(text)
        if prev and v != prev[1]:
            releases.append((prev[1], prev[2]))
        prev = (c, v, text)
    first = {}
    for v, text in releases + [(now, open(header_path).read())]:
        if v < (1, 0):
            continue  # before 1.0.0: no release, no symbol versions
        for name in header_functions(text):
            first.setdefault(name, v)
    return first


def main():
    lib, record_path, header_path = sys.argv[1:4]
    text = open(header_path).read()
    now = header_version(text)
    funcs = header_functions(text)
    record = read_record(record_path)
    syms = library_versions(lib)
    errors = []

    def show(v):
        return ".".join(str(x) for x in v)

    for name in sorted(funcs - set(record)):
        errors.append(f"{name} is not in {record_path}: add it with the release it comes in "
                      f"({show(now)}) and name it in that release's node of src/kvwire.map")
    for name in sorted(set(record) - funcs):
        errors.append(f"{record_path} names {name}, which {header_path} does not declare")
    for name, (release, compat) in sorted(record.items()):
        if name not in funcs:
            continue
        want = f"KVWIRE_{show(release)}"
        default, others = syms.get(name, (None, []))
        if release > now:
            errors.append(f"{name}: recorded as added in {show(release)}, after {show(now)}")
        if default != want:
            errors.append(f"{name}: the library exports it in {default or 'no node'}, "
                          f"its release {show(release)} wants {want} (src/kvwire.map)")
        if sorted(others) != sorted(compat):
            errors.append(f"{name}: older nodes {sorted(others)}, recorded {sorted(compat)}")
    first = history_releases(header_path, now)
    if first is None:
        print("check-symbols: no full history here (shallow or no git): releases checked "
              f"against {record_path} only")
    else:
        for name in sorted(funcs & set(record)):
            if first.get(name) != record[name][0]:
                errors.append(f"{name}: recorded as added in {show(record[name][0])}, the "
                              f"history's first release declaring it is {show(first[name])}")
    for e in errors:
        print(f"check-symbols: {e}")
    if errors:
        print(f"check-symbols: FAILED ({len(errors)} problem(s))")
        return 1
    print(f"check-symbols: {len(funcs)} public functions, each in the node of the release that "
          "added it")
    return 0


if __name__ == "__main__":
    sys.exit(main())
