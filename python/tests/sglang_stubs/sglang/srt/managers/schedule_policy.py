# SPDX-License-Identifier: Apache-2.0
"""Stub of sglang.srt.managers.schedule_policy: only the decode radix
cache calls match_prefix_for_req; the tests run with it off."""


def match_prefix_for_req(*args, **kwargs):
    raise NotImplementedError("decode radix cache is off in these tests")
