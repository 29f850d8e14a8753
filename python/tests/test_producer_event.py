# SPDX-License-Identifier: Apache-2.0
"""The producer's CUDA event (Sender.send / send_part with event=...), host
only: the C calls are exported and check their arguments, the binding
validates the handle and passes it through unchanged, and an error from the
library (KVW_ERR_UNSUPPORTED when CUDA is not available) raises. A real
engine needs an RDMA device: the transfer itself, and the library's own
"CUDA is not available" refusal, are tested on the fake NIC in
tests/unit/test_producer_event.c and on rxe in python/tests/guest."""
import ctypes

import pytest

import kvwire
from kvwire import _lib


@pytest.fixture
def sender():
    """A Sender whose handle is never given to C: every call below either
    fails before reaching C or reaches a stand-in. Its handle is dropped
    afterwards, so that garbage collection does not destroy it."""
    made = []

    def make(room=1):
        s = kvwire.Sender.__new__(kvwire.Sender)
        s._cell = kvwire._Cell(0x5E7D, "sender")
        s.room = room
        made.append(s)
        return s

    yield make
    for s in made:
        s._cell = None


class _Recorder:
    def __init__(self, status=0):
        self.calls = []
        self.status = status

    def __call__(self, *args):
        self.calls.append(args)
        return self.status


def test_send_after_exported():
    assert kvwire.features()["send_after"]
    for name in ("kvw_sender_send_after", "kvw_sender_send_part_after"):
        assert kvwire._L.has(name)
        assert getattr(kvwire._c, name) is not None  # dlsym: in the version script


def test_c_calls_refuse_a_null_sender():
    ev = 0x1234  # never looked at: the sender is checked first
    st = kvwire._L.optional["kvw_sender_send_after"](None, None, 0, ev)
    assert st == kvwire.Status.ERR_INVALID
    part = _lib.kvw_part_t(None, 0, 0, 0, 0)
    st = kvwire._L.optional["kvw_sender_send_part_after"](None, ctypes.byref(part), ev)
    assert st == kvwire.Status.ERR_INVALID


@pytest.mark.parametrize("bad,exc", [(-1, ValueError), (1 << 64, ValueError), (True, TypeError),
                                     (1.5, TypeError), ("0x10", TypeError)])
def test_bad_event_handles_raise_before_c(sender, bad, exc):
    s = sender()
    with pytest.raises(exc):
        s.send([1, 2], event=bad)
    with pytest.raises(exc):
        s.send_part([1, 2], 0, 0, 1, event=bad)


def test_event_handle_reaches_c(sender, monkeypatch):
    after, part_after = _Recorder(), _Recorder()
    monkeypatch.setitem(kvwire._L.optional, "kvw_sender_send_after", after)
    monkeypatch.setitem(kvwire._L.optional, "kvw_sender_send_part_after", part_after)
    s = sender()
    ev = 0x7F00DEADBEEF
    s.send([3, 4, 5], event=ev)
    (h, pages, n, e), = after.calls
    assert (h, n, e) == (0x5E7D, 3, ev) and [pages[i] for i in range(3)] == [3, 4, 5]
    s.send_part([7, 8], 2, 1, 2, event=ev)
    (h, part, e), = part_after.calls
    p = part._obj
    assert (h, e) == (0x5E7D, ev)
    assert (p.num_pages, p.first_page, p.layer_begin, p.layer_end) == (2, 2, 1, 2)
    assert [p.pages[0], p.pages[1]] == [7, 8]


def test_no_event_is_the_plain_call(sender, monkeypatch):
    plain, part, after, part_after = _Recorder(), _Recorder(), _Recorder(), _Recorder()
    monkeypatch.setattr(kvwire._c, "kvw_sender_send", plain)
    monkeypatch.setitem(kvwire._L.optional, "kvw_sender_send_part", part)
    monkeypatch.setitem(kvwire._L.optional, "kvw_sender_send_after", after)
    monkeypatch.setitem(kvwire._L.optional, "kvw_sender_send_part_after", part_after)
    s = sender()
    for ev in (None, 0):
        s.send([1], event=ev)
        s.send_part([1], 0, event=ev)
    assert len(plain.calls) == 2 and len(part.calls) == 2
    assert not after.calls and not part_after.calls
    assert len(part.calls[0]) == 2  # (sender, part): no event argument


def test_library_refusal_raises(sender, monkeypatch):
    """What the library answers for an event when CUDA is not available."""
    unsupported = _Recorder(int(kvwire.Status.ERR_UNSUPPORTED))
    monkeypatch.setitem(kvwire._L.optional, "kvw_sender_send_after", unsupported)
    monkeypatch.setitem(kvwire._L.optional, "kvw_sender_send_part_after", unsupported)
    s = sender(room=9)
    with pytest.raises(kvwire.Error) as ei:
        s.send([1], event=0x10)
    assert ei.value.status == kvwire.Status.ERR_UNSUPPORTED
    assert "kvw_sender_send_after(room 9)" in str(ei.value)
    with pytest.raises(kvwire.Error) as ei:
        s.send_part([1], 0, event=0x10)
    assert "kvw_sender_send_part_after(room 9)" in str(ei.value)


def test_older_library_disables_only_events(sender, monkeypatch):
    monkeypatch.setitem(kvwire._L.optional, "kvw_sender_send_after", None)
    monkeypatch.setitem(kvwire._L.optional, "kvw_sender_send_part_after", None)
    s = sender()
    for call in (lambda: s.send([1], event=0x10), lambda: s.send_part([1], 0, event=0x10)):
        with pytest.raises(kvwire.Error) as ei:
            call()
        assert ei.value.status == kvwire.Status.ERR_UNSUPPORTED
        assert "_after" in ei.value.reason
    part = _Recorder()
    monkeypatch.setitem(kvwire._L.optional, "kvw_sender_send_part", part)
    s.send_part([1], 0)  # without an event: unaffected
    assert len(part.calls) == 1


def test_closed_sender_raises_closed():
    s = kvwire.Sender.__new__(kvwire.Sender)
    s._cell = kvwire._Cell(None, "sender")
    s.room = 1
    for call in (lambda: s.send([1], event=0x10), lambda: s.send_part([1], 0, event=0x10)):
        with pytest.raises(kvwire.ClosedError):
            call()
