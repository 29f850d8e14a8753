#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Compare the public ABI's layout (tests/abi/abi_dump's output, taken from
include/kvwire.h) with the record in tests/abi/kvwire-abi.txt.

Usage: check_abi.py DUMP_BINARY RECORD

Passes when they are the same. Otherwise it fails, saying what changed and
what to do (docs/api-policy.md):
  - members moved, resized or removed, a fixed struct resized, an enum value
    changed or removed: incompatible, needs a MAJOR bump (and so the SONAME);
  - members appended to a sized struct (one with struct_size), new structs,
    new values: additions, need at least a MINOR bump;
  - the version was bumped accordingly: the record is stale, refresh it with
    `make abi-update` and commit it with the change.
"""
import subprocess
import sys

# Sized outputs: the library fills them through a size argument (the _ex
# calls, min(size, its own)) and the older entry points fill their first
# release's fields only, so they may grow at the end like structs with a
# struct_size.
SIZED_OUTPUTS = {"kvw_counters_t", "kvw_req_metrics_t"}


def parse(text):
    version, structs, members, values = None, {}, {}, {}
    for line in text.splitlines():
        f = line.split()
        if not f:
            continue
        if f[0] == "version":
            version = tuple(int(x) for x in f[1].split("."))
        elif f[0] == "struct":
            structs[f[1]] = (int(f[2]), int(f[3]), int(f[4]))
        elif f[0] == "member":
            members[f[1]] = (int(f[2]), int(f[3]))
        elif f[0] == "value":
            values[f[1]] = int(f[2])
    return version, structs, members, values


def main():
    dump, record = sys.argv[1], sys.argv[2]
    now_text = subprocess.run([dump], check=True, capture_output=True, text=True).stdout
    try:
        old_text = open(record).read()
    except FileNotFoundError:
        print(f"abi-check: {record} is missing: record the layout with `make abi-update`")
        return 1
    if now_text == old_text:
        print(f"abi-check: the public layout matches {record}")
        return 0
    old_v, old_s, old_m, old_val = parse(old_text)
    new_v, new_s, new_m, new_val = parse(now_text)

    breaking, additions = [], []
    for name, (size, align, pad) in old_s.items():
        if name not in new_s:
            breaking.append(f"struct {name} removed")
            continue
        nsize, nalign, npad = new_s[name]
        sized = f"{name}.struct_size" in old_m or name in SIZED_OUTPUTS
        if nsize < size or nalign != align:
            breaking.append(f"struct {name}: size {size} -> {nsize}, align {align} -> {nalign}")
        elif nsize > size and not sized:
            breaking.append(f"struct {name} grew {size} -> {nsize}, but it has no struct_size: "
                            "the library writes or reads it whole")
        elif nsize > size:
            additions.append(f"struct {name} grew {size} -> {nsize}")
        elif npad != pad and not any(
                m.startswith(name + ".reserved") and m not in old_m for m in new_m):
            breaking.append(f"struct {name}: padding {pad} -> {npad} at the same size (a member "
                            "added inside the old layout)")
    for name, (off, size) in old_m.items():
        if name not in new_m:
            breaking.append(f"member {name} removed (or renamed)")
        elif new_m[name] != (off, size):
            breaking.append(f"member {name}: offset {off} size {size} -> offset {new_m[name][0]} "
                            f"size {new_m[name][1]}")
    for name, (off, size) in new_m.items():
        if name in old_m:
            continue
        struct = name.split(".")[0]
        reserved = name.split(".")[1].startswith("reserved")
        if struct in old_s and off < old_s[struct][0] and not reserved:
            breaking.append(f"member {name} added at offset {off}, inside the previous layout "
                            f"(size {old_s[struct][0]}), where an older caller may have left "
                            "garbage padding: fill that padding with a reserved_ member (kept "
                            "zero) and append the new one after it")
        else:
            additions.append(f"member {name} added (offset {off}, size {size})")
    for name in new_s:
        if name not in old_s:
            additions.append(f"struct {name} added")
    for name, v in old_val.items():
        if name not in new_val:
            breaking.append(f"value {name} removed")
        elif new_val[name] != v:
            breaking.append(f"value {name}: {v} -> {new_val[name]}")
    for name, v in new_val.items():
        if name not in old_val:
            additions.append(f"value {name} = {v} added")

    def show(v):
        return ".".join(str(x) for x in v) if v else "?"

    for what in breaking:
        print(f"abi-check: incompatible: {what}")
    for what in additions:
        print(f"abi-check: addition: {what}")
    if breaking and new_v[0] == old_v[0]:
        print(f"abi-check: FAILED: incompatible layout change with the major version unchanged "
              f"({show(old_v)} -> {show(new_v)}). Bump KVW_VERSION_MAJOR in include/kvwire.h "
              "(the SONAME follows; docs/api-policy.md lists what else moves with it), or undo "
              "the change (sized structs grow only at the end), then run `make abi-update`.")
    elif additions and not breaking and new_v[:2] == old_v[:2]:
        print(f"abi-check: FAILED: the public layout grew with the version unchanged "
              f"({show(old_v)} -> {show(new_v)}). Bump KVW_VERSION_MINOR in include/kvwire.h "
              "(docs/api-policy.md), then run `make abi-update`.")
    else:
        print(f"abi-check: FAILED: {record} records version {show(old_v)}, the header is "
              f"{show(new_v)}: run `make abi-update` and commit the record with the change.")
    return 1


if __name__ == "__main__":
    sys.exit(main())
