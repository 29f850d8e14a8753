# SPDX-License-Identifier: Apache-2.0
"""Page-index conversion: sequences, buffers and numpy arrays."""
import array
import ctypes

import pytest

from kvwire import as_indices


def values(idx):
    return [idx.ptr[i] for i in range(idx.count)]


@pytest.mark.parametrize("seq", [[3, 1, 2], (3, 1, 2), range(3, 0, -1)])
def test_sequences(seq):
    idx = as_indices(seq)
    assert values(idx) == list(seq) and idx.copied


def test_empty_and_none():
    for obj in ([], (), None, array.array("Q")):
        idx = as_indices(obj)
        assert idx.count == 0


def test_array_Q_is_zero_copy():
    a = array.array("Q", [5, 6, 7])
    idx = as_indices(a)
    assert not idx.copied and idx.address == a.buffer_info()[0]
    assert values(idx) == [5, 6, 7]


def test_other_buffers_convert():
    a = array.array("i", [4, 5])
    idx = as_indices(a)
    assert idx.copied and values(idx) == [4, 5]
    with pytest.raises(ValueError):
        as_indices(array.array("q", [1, -1]))
    with pytest.raises(TypeError):
        as_indices(array.array("d", [1.0]))
    ro = memoryview(array.array("Q", [9]).tobytes()).cast("Q")
    assert values(as_indices(ro)) == [9]


@pytest.mark.parametrize("bad", [[1.0], [True], ["1"], "12", b"\x00" * 8, [-1], [1 << 64], 5])
def test_rejects(bad):
    with pytest.raises((TypeError, ValueError)):
        as_indices(bad)


def test_max_value():
    assert values(as_indices([(1 << 64) - 1])) == [(1 << 64) - 1]


np = pytest.importorskip("numpy")


def test_numpy_uint64_contiguous_is_zero_copy():
    a = np.arange(10, dtype=np.uint64)
    idx = as_indices(a)
    assert not idx.copied and idx.address == a.ctypes.data and idx.count == 10
    assert values(idx) == list(range(10))
    ro = np.arange(4, dtype=np.uint64)
    ro.setflags(write=False)
    idx = as_indices(ro)
    assert not idx.copied and idx.address == ro.ctypes.data


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.uint32, np.int16, np.uint8])
def test_numpy_other_ints_convert(dtype):
    a = np.array([7, 0, 3], dtype=dtype)
    idx = as_indices(a)
    assert idx.copied and idx.address != a.ctypes.data and values(idx) == [7, 0, 3]


def test_numpy_noncontiguous_converts():
    a = np.arange(10, dtype=np.uint64)[::2]
    idx = as_indices(a)
    assert idx.copied and values(idx) == [0, 2, 4, 6, 8]


def test_numpy_rejects():
    with pytest.raises(ValueError):
        as_indices(np.array([1, -2], dtype=np.int64))
    with pytest.raises(TypeError):
        as_indices(np.array([1.0]))
    with pytest.raises(TypeError):
        as_indices(np.zeros((2, 2), dtype=np.uint64))
    with pytest.raises(TypeError):
        as_indices(np.array([True]))


def test_numpy_scalars_in_lists():
    assert values(as_indices([np.int64(3), np.uint32(4)])) == [3, 4]
