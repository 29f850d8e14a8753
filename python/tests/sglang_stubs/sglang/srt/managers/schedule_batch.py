# SPDX-License-Identifier: Apache-2.0
"""Stub of sglang.srt.managers.schedule_batch: the finish reasons and
ReqKvInfo the disaggregation queues construct; Req and ScheduleBatch are
only type names there (the tests pass duck-typed requests)."""
import dataclasses


class BaseFinishReason:
    def __init__(self, is_error: bool = False):
        self.is_error = is_error


class FINISH_LENGTH(BaseFinishReason):  # noqa: N801 (sglang's name)
    def __init__(self, length: int):
        super().__init__()
        self.length = length


class FINISH_ABORT(BaseFinishReason):  # noqa: N801
    def __init__(self, message=None, status_code=None, err_type=None):
        super().__init__(is_error=True)
        self.message = message or "Aborted"
        self.status_code = status_code
        self.err_type = err_type


@dataclasses.dataclass
class ReqKvInfo:
    kv_allocated_len: int = 0
    swa_evicted_seqlen: int = 0


class NextBatchPlan:
    pass


class Req:
    pass


class ScheduleBatch:
    pass
