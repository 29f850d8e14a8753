"""The ctypes structures match include/kvwire.h: compile the header with the
host's C compiler and compare every size and field offset (skipped without
a compiler or outside the source tree)."""
import ctypes
import os
import shutil
import subprocess

import pytest

from kvwire import _lib

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HEADER = os.path.join(REPO, "include", "kvwire.h")
CC = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")


@pytest.mark.skipif(not (CC and os.path.exists(HEADER)), reason="needs cc and include/kvwire.h")
def test_struct_layout_matches_header(tmp_path):
    text = open(HEADER).read()
    lines = ['#include <stdio.h>', '#include <stddef.h>', '#include "kvwire.h"', "int main(void) {"]
    checked = []
    for name, st in _lib.STRUCTS.items():
        if f"}} {name};" not in text:
            continue  # not in this header yet
        checked.append(name)
        lines.append(f'printf("{name} %zu\\n", sizeof({name}));')
        for field, _ in st._fields_:
            lines.append(f'printf("{name}.{field} %zu\\n", offsetof({name}, {field}));')
    lines.append("return 0; }")
    src = tmp_path / "abi.c"
    src.write_text("\n".join(lines))
    exe = tmp_path / "abi"
    subprocess.run([CC, "-std=c11", "-I", os.path.dirname(HEADER), str(src), "-o", str(exe)],
                   check=True)
    got = dict(l.rsplit(" ", 1) for l in subprocess.run([str(exe)], capture_output=True, text=True,
                                                       check=True).stdout.split("\n") if l)
    assert "kvw_config_t" in checked and "kvw_engine_params_t" in checked
    for name in checked:
        st = _lib.STRUCTS[name]
        assert int(got[name]) == ctypes.sizeof(st), name
        for field, _ in st._fields_:
            assert int(got[f"{name}.{field}"]) == getattr(st, field).offset, f"{name}.{field}"


@pytest.mark.skipif(not os.path.exists(HEADER), reason="needs include/kvwire.h")
def test_every_public_struct_is_mirrored():
    """Every struct of the header has its ctypes mirror (the layout test above
    then checks it), and the sized ones start with struct_size."""
    import re
    text = open(HEADER).read()
    names = re.findall(r"typedef\s+struct\s*\w*\s*\{[^{}]*\}\s*(kvw_\w+)\s*;", text)
    assert names and sorted(names) == sorted(_lib.STRUCTS)
    for name in ("kvw_config_t", "kvw_engine_params_t", "kvw_bootstrap_params_t"):
        assert _lib.STRUCTS[name]._fields_[0][0] == "struct_size", name
