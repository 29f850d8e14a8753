# SPDX-License-Identifier: Apache-2.0
"""The loaded library and what every other module needs: the library
handle, version and feature queries, the enums, the exceptions, the log
trampoline and the call helper. Internal: the public names are re-exported
by kvwire/__init__.py."""

from __future__ import annotations

import atexit
import enum
import os
import threading
from typing import Any, Callable, Dict, Optional, Tuple

from . import _lib

_L = _lib.load()
_c = _L.c
NO_AUX = _lib.NO_AUX


def library_path() -> str:
    """Path of the libkvwire this process loaded."""
    return _L.path


def version() -> str:
    """Version of the loaded libkvwire, "MAJOR.MINOR.PATCH" (kvw_version_string)."""
    return _s(_c.kvw_version_string())


def version_info() -> Tuple[int, int, int]:
    """The same as numbers, (MAJOR, MINOR, PATCH), from kvw_version()."""
    v = int(_c.kvw_version())
    return (v // 10000, v // 100 % 100, v % 100)


def features() -> Dict[str, bool]:
    """Which newer C calls the loaded library has: groups (buffer groups in
    Engine), init_indices (Receiver.init with state), send_part, send_state,
    metrics, send_after (the event= argument of Sender.send and
    Sender.send_part), state_lists (an index list per state group:
    Receiver.init(state_lists=...), Sender.send_state(lists=...)),
    receiver_ranks (Engine.receiver_ranks: decode over several prefill
    ranks, head slicing), sender_fanout, verify_digests (the caller's
    digests of a verified transfer: Sender.set_digest, Receiver.landed,
    Receiver.verify), metrics_text (Engine.metrics_text and the
    prometheus_client collector, kvwire.metrics), sender_learn
    (Engine.sender(receivers=None) and Receiver.set_room_receivers: the
    decode receiver count from decode's requests). A
    missing one makes only the method that needs it
    raise Error(KVW_ERR_UNSUPPORTED)."""
    return {
        "groups": _L.has(_lib.GROUPS_MARKER),
        "init_indices": _L.has("kvw_receiver_init_indices"),
        "send_part": _L.has("kvw_sender_send_part"),
        "send_state": _L.has("kvw_sender_send_state"),
        "metrics": _L.has("kvw_sender_metrics") and _L.has("kvw_receiver_metrics"),
        "send_after": _L.has("kvw_sender_send_after") and _L.has("kvw_sender_send_part_after"),
        "state_lists": _L.has("kvw_receiver_init_lists") and _L.has("kvw_sender_send_state_lists"),
        "receiver_ranks": _L.has("kvw_receiver_create_ranks"),
        "sender_fanout": _L.has("kvw_sender_create_fanout"),
        "sender_learn": (_L.has("kvw_sender_create_learn")
                         and _L.has("kvw_receiver_set_room_receivers")),
        "verify_digests": (_L.has("kvw_sender_set_digest") and _L.has("kvw_receiver_landed")
                           and _L.has("kvw_receiver_verify")),
        "metrics_text": _L.has("kvw_engine_metrics_text"),
    }


# ------------------------------------------------------------------ enums


class Status(enum.IntEnum):
    """kvw_status_t (include/kvwire.h KVW_STATUS_MAP)."""
    OK = 0
    ERR_INVALID = -1
    ERR_NO_MEMORY = -2
    ERR_NO_DEVICE = -3
    ERR_VERBS = -4
    ERR_REGISTER = -5
    ERR_CONTROL = -6
    ERR_PROTOCOL = -7
    ERR_OUT_OF_RANGE = -8
    ERR_MISMATCH = -9
    ERR_TIMEOUT = -10
    ERR_PEER = -11
    ERR_TRANSFER = -12
    ERR_STATE = -13
    ERR_NOT_FOUND = -14
    ERR_EXISTS = -15
    ERR_UNSUPPORTED = -16
    ERR_ABORTED = -17
    ERR_LIMIT = -18
    ERR_CORRUPT = -19


class Poll(enum.IntEnum):
    """Request states; same numbers as sglang's KVPoll (Failed=0 .. Success=4),
    so min() over ranks keeps Failed winning."""
    FAILED = 0
    BOOTSTRAPPING = 1
    WAITING_FOR_INPUT = 2
    TRANSFERRING = 3
    SUCCESS = 4


class Role(enum.IntEnum):
    PREFILL = 0
    DECODE = 1


class GroupKind(enum.IntEnum):
    """kvw_group_kind_t: which request indices address a group's items."""
    KV = 0     # the request's pages
    AUX = 1    # the request's aux index
    STATE = 2  # the request's state indices


class LogLevel(enum.IntEnum):
    ERROR = 0
    WARN = 1
    INFO = 2
    DEBUG = 3


# ----------------------------------------------------------------- errors


def _s(p: Optional[bytes]) -> str:
    return p.decode("utf-8", "replace") if p else ""


class Error(Exception):
    """A kvwire call failed. status: the kvw_status_t value (int; compare
    with Status); name: its C name; reason: why, in words."""

    def __init__(self, status: int, reason: Optional[str] = None, what: Optional[str] = None):
        self.status = int(status)
        self.name = _s(_c.kvw_status_name(self.status))
        self.reason = reason or _s(_c.kvw_strerror(self.status))
        self.what = what
        msg = f"{self.reason} ({self.name})"
        super().__init__(f"{what}: {msg}" if what else msg)


class ClosedError(Error):
    """The object was closed (or its engine was); status KVW_ERR_STATE."""

    def __init__(self, what: str):
        super().__init__(Status.ERR_STATE, f"{what} is closed", None)


def _unsupported(symbol: str, what: str) -> Error:
    return Error(Status.ERR_UNSUPPORTED,
                 f"{what} needs {symbol}(), which {_L.path} does not export (an older libkvwire)")


# ---------------------------------------------------------------- logging
#
# One trampoline is installed for the life of the process. It remembers the
# last ERROR logged on each thread, so a failed call can say why in its
# exception, and hands every line to one sink: the `logging` logger
# "kvwire" (the default: a library's errors then reach the application
# once, in the exception, unless it configures logging to show them too),
# the user's handler, or stderr as the C library writes it. It runs on
# library threads too, under the library's log lock: it never calls back
# into kvwire. With a libkvwire that has kvw_set_log_record_handler (1.5)
# it gets each line's subsystem and engine as well.

_tls = threading.local()
_TAGS = ("ERROR", "WARN", "INFO", "DEBUG")
_user_handler: Optional[Callable[[int, str], None]] = None
_SINK_LOGGING, _SINK_HANDLER, _SINK_STDERR = "logging", "handler", "stderr"
_sink = _SINK_LOGGING
_logger: Any = None
_PY_LEVELS = {0: 40, 1: 30, 2: 20, 3: 10}  # logging.ERROR, WARNING, INFO, DEBUG


def _deliver(level: int, msg: str, line: str, subsystem: str, engine: str) -> None:
    if level == LogLevel.ERROR:
        _tls.last_error = msg
    h = _user_handler
    if _sink == _SINK_HANDLER and h is not None:
        h(level, msg)
    elif _sink == _SINK_LOGGING and _logger is not None:
        where = f"{subsystem} {engine}" if engine else subsystem
        _logger.log(_PY_LEVELS.get(level, 20), "%s", f"{where}: {msg}" if where else msg,
                    extra={"kvw_subsystem": subsystem, "kvw_engine": engine})
    else:
        os.write(2, f"{line}\n".encode())


def _trampoline(_arg: Any, level: int, msg: Optional[bytes]) -> None:
    try:
        text = _s(msg)
        tag = _TAGS[level] if 0 <= level < 4 else str(level)
        _deliver(level, text, f"kvwire {tag}: {text}", "", "")
    except BaseException:  # a callback must not raise into C
        pass


def _record_trampoline(_arg: Any, rec: Any) -> None:
    try:
        r = rec.contents
        _deliver(r.level, _s(r.msg), _s(r.line), _s(r.subsystem), _s(r.engine))
    except BaseException:  # a callback must not raise into C
        pass


_trampoline_c = _lib.LOG_FN(_trampoline)
_record_trampoline_c = _lib.LOG_RECORD_FN(_record_trampoline)


def _env_level() -> int:
    names = {"error": 0, "warn": 1, "info": 2, "debug": 3}
    return names.get(os.environ.get("KVW_LOG_LEVEL", "").lower(), int(LogLevel.WARN))


_log_level = _env_level()


def _install() -> None:
    if _L.has("kvw_set_log_record_handler"):
        _c.kvw_set_log_record_handler(_record_trampoline_c, None, _log_level)
    else:
        _c.kvw_set_log_handler(_trampoline_c, None, _log_level)


def _set_sink(sink: str, handler: Optional[Callable[[int, str], None]], logger: Any,
              level: Optional[int]) -> None:
    global _sink, _user_handler, _logger, _log_level
    _user_handler, _logger, _sink = handler, logger, sink
    if level is not None:
        _log_level = int(LogLevel(level))
    _install()


def set_log_handler(handler: Optional[Callable[[int, str], None]],
                    level: Optional[int] = None) -> None:
    """Route libkvwire's log lines to handler(level, message) (None: stderr,
    as the C library writes them; see log_to_stderr), delivering levels up
    to `level` (None: keep the current, initially KVW_LOG_LEVEL or WARN).
    The handler runs on library threads, possibly concurrently, must be
    quick, and must not call kvwire; whatever it raises is ignored.
    Process-wide; thread-safe. The default, at import, is log_to_python()."""
    if handler is None:
        _set_sink(_SINK_STDERR, None, None, level)
    else:
        _set_sink(_SINK_HANDLER, handler, None, level)


def log_to_python(logger: Any = None, level: Optional[int] = None) -> None:
    """Route libkvwire's log lines to the `logging` module (logger "kvwire"
    by default), the default at import. Each record's message starts with
    the line's subsystem and engine ("CTRL prefill r0 <id>: ..."), also
    given as the record attributes kvw_subsystem and kvw_engine. The
    "kvwire" logger has a NullHandler, so that nothing is printed unless
    the application configures logging (errors reach it in the
    exceptions anyway)."""
    import logging

    _set_sink(_SINK_LOGGING, None, logger or logging.getLogger("kvwire"), level)


def log_to_stderr(level: Optional[int] = None) -> None:
    """Write libkvwire's log lines to stderr as the C library does (time,
    pid.tid, level, subsystem, engine, message): set_log_handler(None)."""
    set_log_handler(None, level)


def _restore_default_log() -> None:
    # Library threads may outlive the interpreter's finalisation; from here
    # on they log through the C default and never enter Python again.
    _c.kvw_set_log_handler(_lib.LOG_FN(), None, _log_level)


def _default_log() -> None:
    import logging

    lg = logging.getLogger("kvwire")
    if not any(isinstance(h, logging.NullHandler) for h in lg.handlers):
        lg.addHandler(logging.NullHandler())
    log_to_python(lg)


_default_log()
atexit.register(_restore_default_log)


def _call(fn: Any, what: str, *args: Any) -> None:
    """Call a status-returning C function; raise Error on failure."""
    _tls.last_error = None
    st = fn(*args)
    if st != 0:
        raise Error(st, getattr(_tls, "last_error", None), what)
