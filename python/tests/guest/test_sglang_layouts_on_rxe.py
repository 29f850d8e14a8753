# SPDX-License-Identifier: Apache-2.0
"""The layouts of ../sglang_fake_nic_layouts.py (decode prefix reuse,
prefill PP 2 -> decode PP 1 and PP 2, the refused PP gather across TP sizes,
decode TP > prefill TP without --disaggregation-decode-tp, MLA and MHA, served) on the test
bed's real rxe devices (prefill on KVW_TB_DEV0/IP0, decode on
KVW_TB_DEV1/IP1) with the real libkvwire, checked as on the fake NIC
(test_sglang_fake_nic.py's check_* functions)."""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import sglang_ref  # noqa: E402
import test_sglang_fake_nic as fake  # noqa: E402

pytestmark = pytest.mark.skipif(bool(sglang_ref.missing()), reason=sglang_ref.missing() or "-")


@pytest.mark.parametrize("scenario", sorted(fake.LAYOUTS))
def test_layout_on_rxe(scenario):
    assert os.environ.get("KVW_TB_DEV0"), "conftest skips this outside the test bed"
    r = fake.run_layout(scenario, env=os.environ)
    assert r["nic"] != "fake", r
    fake.LAYOUTS[scenario](r)
