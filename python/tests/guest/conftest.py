# SPDX-License-Identifier: Apache-2.0
"""Guest-only tests: they need the test bed's RDMA devices (KVW_TB_DEV0 ...),
so they run inside tests/tools/kvw-testbed (tests/integration/python_scenarios.sh)."""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def pytest_collection_modifyitems(config, items):
    if os.environ.get("KVW_TB_DEV0"):
        return
    skip = pytest.mark.skip(reason="needs the RDMA test bed (KVW_TB_DEV0); see python_scenarios.sh")
    here = os.path.dirname(os.path.abspath(__file__))
    for item in items:
        if str(item.fspath).startswith(here + os.sep):
            item.add_marker(skip)
