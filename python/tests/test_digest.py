# SPDX-License-Identifier: Apache-2.0
"""The sglang backend's caller digest (kvwire/sglang/digest.py) for verified
transfers over GPU memory kvwire cannot read. The definition is checked in
plain Python (reference_digest), the torch version against it on host
memory where torch is installed, and on a GPU only where one is (not in
the host test run)."""

import random

import pytest

from kvwire.sglang import digest as d

ITEM = 64


def _regions(n_regions=3, pages=8, seed=1):
    rnd = random.Random(seed)
    return [bytearray(rnd.getrandbits(8) for _ in range(pages * ITEM)) for _ in range(n_regions)]


def test_parts_sum_to_the_whole():
    """Prefill sums its parts (positions continue), decode the whole."""
    regs = _regions()
    pages = [5, 1, 7, 2]
    whole = d.reference_digest(regs, ITEM, pages)
    parts = (d.reference_digest(regs, ITEM, pages[:3]) +
             d.reference_digest(regs, ITEM, pages[3:], first=3)) & ((1 << 64) - 1)
    assert parts == whole
    assert 0 < whole < 1 << 64


def test_any_byte_flipped_changes_it():
    regs = _regions()
    pages = [0, 3, 6]
    good = d.reference_digest(regs, ITEM, pages)
    for r in range(len(regs)):
        for p in pages:
            for b in (0, 7, 8, ITEM - 1):
                regs[r][p * ITEM + b] ^= 0x40
                assert d.reference_digest(regs, ITEM, pages) != good
                regs[r][p * ITEM + b] ^= 0x40


def test_pages_swapped_or_moved_change_it():
    regs = _regions()
    good = d.reference_digest(regs, ITEM, [1, 2])
    assert d.reference_digest(regs, ITEM, [2, 1]) != good
    assert d.reference_digest([regs[1], regs[0], regs[2]], ITEM, [1, 2]) != good


def test_odd_item_lengths_use_bytes():
    rnd = random.Random(3)
    regs = [bytearray(rnd.getrandbits(8) for _ in range(4 * 12))]
    good = d.reference_digest(regs, 12, [0, 2])
    regs[0][2 * 12 + 11] ^= 1
    assert d.reference_digest(regs, 12, [0, 2]) != good


def test_empty_request_is_zero():
    """A dummy rank (asked for nothing) gives 0 on both sides."""
    assert d.reference_digest(_regions(), ITEM, []) == 0


def _check_torch(torch, device, dev_index):
    regs = _regions(pages=16)
    bufs = [torch.tensor(list(r), dtype=torch.uint8, device=device) for r in regs]
    k = d.KVDigest([b.data_ptr() for b in bufs], [b.numel() for b in bufs], [ITEM] * len(bufs),
                   dev_index)
    pages = [9, 3, 15, 0]
    assert k.digest(pages) == d.reference_digest(regs, ITEM, pages)
    assert k.digest(pages[2:], first=2) == d.reference_digest(regs, ITEM, pages[2:], first=2)
    assert k.digest([]) == 0
    bufs[1][3 * ITEM + 5] ^= 1  # a flipped byte in a page of the request
    assert k.digest(pages) != d.reference_digest(regs, ITEM, pages)


def test_torch_on_host_memory_matches_the_reference():
    """The torch arithmetic (int64 wrapping) and the DLPack view, on the CPU."""
    torch = pytest.importorskip("torch")
    _check_torch(torch, "cpu", None)


def test_torch_on_the_gpu_matches_the_reference():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    _check_torch(torch, "cuda", torch.cuda.current_device())
