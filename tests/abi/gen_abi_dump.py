#!/usr/bin/env python3
"""Write a C program that prints the layout of kvwire's public ABI, one fact
a line, for tests/abi/check_abi.py to compare with the record in
tests/abi/kvwire-abi.txt (make abi-check; make abi-update rewrites it):

    version MAJOR.MINOR.PATCH
    struct NAME SIZE ALIGN PADDING     PADDING: bytes no member covers
    member NAME.FIELD OFFSET SIZE
    value NAME NUMBER                  enum values and constants

The structs, their members and the enums are read from the preprocessed
header (every `typedef struct ... { } kvw_*;` and `typedef enum { } kvw_*;`),
so a member added to the header is in the dump without anyone listing it.

Usage: gen_abi_dump.py CC HEADER_DIR OUT.c
"""
import re
import subprocess
import sys

# Constants of the ABI that are macros, not enumerators.
CONSTANTS = ["KVW_NO_AUX"]


def main():
    cc, incdir, out = sys.argv[1], sys.argv[2], sys.argv[3]
    text = subprocess.run(
        cc.split() + ["-std=c11", "-E", "-P", "-I", incdir, "-x", "c", "-"],
        input='#include "kvwire.h"\n', capture_output=True, text=True, check=True).stdout
    lines = [
        "#include <stdalign.h>",
        "#include <stddef.h>",
        "#include <stdio.h>",
        '#include "kvwire.h"',
        "static size_t covered;",
        "int main(void)",
        "{",
        '    printf("version %d.%d.%d\\n", KVW_VERSION_MAJOR, KVW_VERSION_MINOR, '
        "KVW_VERSION_PATCH);",
    ]
    structs = re.findall(r"typedef\s+struct\s*\w*\s*\{([^{}]*)\}\s*(kvw_\w+)\s*;", text)
    if not structs:
        sys.exit("gen_abi_dump: no kvw_ struct found in the header")
    for body, name in structs:
        lines.append("    covered = 0;")
        for decl in body.split(";"):
            decl = re.sub(r"\[[^\]]*\]", "", decl).strip()
            if not decl:
                continue
            parts = decl.split(",")
            fields = [re.findall(r"\w+", parts[0])[-1]]
            fields += [p.strip().lstrip("*").strip() for p in parts[1:]]
            for f in fields:
                size = f"sizeof((({name} *)0)->{f})"
                lines.append(f'    printf("member {name}.{f} %zu %zu\\n", '
                             f"offsetof({name}, {f}), {size});")
                lines.append(f"    covered += {size};")
        lines.append(f'    printf("struct {name} %zu %zu %zu\\n", sizeof({name}), '
                     f"alignof({name}), sizeof({name}) - covered);")
    for body, name in re.findall(r"typedef\s+enum\s*\w*\s*\{([^{}]*)\}\s*(kvw_\w+)\s*;", text):
        lines.append(f'    printf("value sizeof({name}) %zu\\n", sizeof({name}));')
        for item in body.split(","):
            item = item.split("=")[0].strip()
            if item:
                lines.append(f'    printf("value {item} %lld\\n", (long long){item});')
    for c in CONSTANTS:
        lines.append(f'    printf("value {c} %lld\\n", (long long){c});')
    lines += ["    return 0;", "}", ""]
    with open(out, "w") as f:
        f.write("\n".join(lines))


if __name__ == "__main__":
    main()
