# SPDX-License-Identifier: Apache-2.0
"""Stub of sglang.srt.mem_cache.common: the page helpers with sglang's
semantics (a request's KV token slots are page-aligned, so its page
indices are every page_size-th slot // page_size) and release_kv_cache
handing the request to the tree cache, which frees its slots."""
import numpy as np


def _np(x):
    if hasattr(x, "cpu"):  # a torch tensor
        return x.cpu().numpy()
    return np.asarray(x)


def kv_to_page_indices(kv_indices, page_size: int):
    kv = _np(kv_indices)
    if page_size == 1:
        return kv
    return kv[::page_size] // page_size


def kv_to_page_num(num_kv_indices: int, page_size: int) -> int:
    return (num_kv_indices + page_size - 1) // page_size


def page_align_floor(x: int, page_size: int) -> int:
    return (x // page_size) * page_size


def release_kv_cache(req, tree_cache, is_insert: bool = True) -> None:
    tree_cache.cache_finished_req(req, is_insert=is_insert)


def maybe_cache_unfinished_req(req, tree_cache, chunked: bool = False) -> None:
    tree_cache.cache_unfinished_req(req, chunked=chunked)
