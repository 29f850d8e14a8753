# SPDX-License-Identifier: Apache-2.0
"""The operator's self-test before the first transfer, from Python.

``python3 -m kvwire.check [--dev NAME] [--ip IPV4]`` and :func:`check` run
``kvwire-info --check`` (one implementation: the tool opens each device
with the library's own code, so what it says is what a transfer does) and
give back its verdicts: per device, the port state, the GID kvwire uses
and why, the MTU and a loopback RDMA write; for the node, the memlock
limit and each GPU's memory path. The exit status is the tool's: 0 when
nothing will fail, 1 otherwise.

The tool is looked for in ``$KVWIRE_INFO`` (a file), then in the source
tree's build directory (running from python/ in a checkout), then on PATH.
"""
import dataclasses
import os
import re
import shutil
import subprocess
import sys
from typing import List, Optional, Sequence

_LINE = re.compile(r"^  \[(?P<level> OK |WARN|FAIL)\] (?P<text>.*)$")
_LEVELS = {" OK ": "ok", "WARN": "warn", "FAIL": "fail"}


@dataclasses.dataclass
class Verdict:
    """One check: where ("rxe0", "this node", "RDMA devices"), "ok", "warn"
    or "fail", and what it found (with the fix, when it failed)."""

    where: str
    level: str
    text: str


@dataclasses.dataclass
class CheckResult:
    returncode: int
    verdicts: List[Verdict]
    output: str  # the tool's text, as an operator would read it

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    def failures(self) -> List[Verdict]:
        return [v for v in self.verdicts if v.level == "fail"]


def find_tool() -> str:
    """The kvwire-info to run; FileNotFoundError says where it looked."""
    env = os.environ.get("KVWIRE_INFO")
    if env:
        return env
    here = os.path.dirname(os.path.abspath(__file__))
    repo = os.path.dirname(os.path.dirname(here))
    tried = []
    if os.path.exists(os.path.join(repo, "include", "kvwire.h")):
        built = os.path.join(repo, "build", "kvwire-info")
        if os.access(built, os.X_OK):
            return built
        tried.append(built)
    found = shutil.which("kvwire-info")
    if found:
        return found
    tried.append("PATH")
    raise FileNotFoundError(
        "kvwire.check: kvwire-info not found (looked in " + ", ".join(tried) + "); "
        "install kvwire's tools (make install) or set KVWIRE_INFO=/path/to/kvwire-info")


def parse(text: str) -> List[Verdict]:
    """The verdict lines of `kvwire-info --check`'s output."""
    verdicts, where = [], ""
    for line in text.splitlines():
        m = _LINE.match(line)
        if m:
            verdicts.append(Verdict(where, _LEVELS[m.group("level")], m.group("text")))
        elif line.endswith(":") and not line.startswith(" "):
            where = line[:-1]
    return verdicts


def check(device: Optional[str] = None, ip: Optional[str] = None,
          tool: Optional[str] = None) -> CheckResult:
    """Run the self-test (every device, or `device`); never raises for a
    failed check: see .ok and .failures()."""
    cmd = [tool or find_tool(), "--check"]
    if device:
        cmd += ["--dev", device]
    if ip:
        cmd += ["--ip", ip]
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       check=False)
    return CheckResult(p.returncode, parse(p.stdout), p.stdout)


def main(argv: Optional[Sequence[str]] = None) -> int:
    import argparse
    ap = argparse.ArgumentParser(prog="python3 -m kvwire.check",
                                 description="kvwire's self-test (kvwire-info --check)")
    ap.add_argument("--dev", help="check only this RDMA device")
    ap.add_argument("--ip", help="the local IPv4 address an engine will use")
    args = ap.parse_args(argv)
    try:
        r = check(args.dev, args.ip)
    except FileNotFoundError as e:
        print(e, file=sys.stderr)
        return 1
    sys.stdout.write(r.output)
    return r.returncode


if __name__ == "__main__":
    sys.exit(main())
