# SPDX-License-Identifier: Apache-2.0
"""Stub of sglang.srt.utils: CPU only; Logger.warning_once as sglang adds it."""
import functools
import logging


def is_hip():
    return False


def is_npu():
    return False


def get_num_new_pages(seq_lens, page_size, prefix_lens=None, decode=False):
    import numpy as np

    seq = np.asarray(seq_lens)
    pre = np.zeros_like(seq) if prefix_lens is None else np.asarray(prefix_lens)
    return int(((seq + page_size - 1) // page_size - (pre + page_size - 1) // page_size).sum())


@functools.lru_cache(None)
def _once(logger, msg):
    logger.warning(msg)


if not hasattr(logging.Logger, "warning_once"):
    logging.Logger.warning_once = lambda self, msg, *a, **k: _once(self, msg)
    logging.Logger.info_once = lambda self, msg, *a, **k: _once(self, msg)
