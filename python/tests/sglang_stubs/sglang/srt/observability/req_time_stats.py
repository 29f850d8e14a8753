# SPDX-License-Identifier: Apache-2.0
"""Stub of sglang.srt.observability.req_time_stats: timing only."""


def set_schedule_time_batch(*args, **kwargs):
    pass


def set_time_batch(*args, **kwargs):
    pass
