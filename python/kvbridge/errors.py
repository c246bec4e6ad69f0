"""Exceptions raised by kvbridge.

Every failure of the native library arrives as a :class:`KvbError` subclass named after its
status code (``StalePeerError`` for ``STALE_PEER``, ...). ``err.code`` is the numeric code
(equal to the C++ ``kvbridge::StatusCode`` and the plugin ABI's ``kvb_status_t``), ``err.name``
its name and ``err.message`` the library's message; ``str(err)`` is ``"NAME: message"``.
``err.origin`` says which side of a store call failed, where the store knows: ``"master"``,
``"storage_node"``, or ``""`` (this process, a transfer's peer, or not said).

Batch calls do not raise for a single key or op: they return :class:`kvbridge.Status` values,
and ``Status.raise_if_error()`` turns one into the same exception.
"""

from __future__ import annotations

import enum

__all__ = [
    "StatusCode",
    "KvbError",
    "InvalidArgumentError",
    "NotFoundError",
    "AlreadyExistsError",
    "NotRegisteredError",
    "OutOfBoundsError",
    "StalePeerError",
    "PeerUnreachableError",
    "DeadlineExceededError",
    "ProgressTimeoutError",
    "BackpressureError",
    "CancelledError",
    "ProtocolError",
    "UnauthenticatedError",
    "UnsupportedError",
    "UnavailableError",
    "NoSpaceError",
    "IoError",
    "InternalError",
    "PermissionDeniedError",
    "UnknownMemoryError",
    "from_status",
]


class StatusCode(enum.IntEnum):
    """kvbridge's status codes (values fixed by the plugin ABI,
    csrc/include/kvbridge/plugin/abi.h)."""

    OK = 0
    IN_PROGRESS = 1
    INVALID_ARGUMENT = 2
    NOT_FOUND = 3
    ALREADY_EXISTS = 4
    NOT_REGISTERED = 5
    OUT_OF_BOUNDS = 6
    STALE_PEER = 7
    PEER_UNREACHABLE = 8
    DEADLINE_EXCEEDED = 9
    PROGRESS_TIMEOUT = 10
    BACKPRESSURE = 11
    CANCELLED = 12
    PROTOCOL = 13
    UNAUTHENTICATED = 14
    UNSUPPORTED = 15
    UNAVAILABLE = 16
    NO_SPACE = 17
    IO_ERROR = 18
    IO = 18  # an alias, kept for code that used it; the name is IO_ERROR, as in C++
    INTERNAL = 19
    PERMISSION_DENIED = 20
    UNKNOWN_MEMORY = 21


class KvbError(Exception):
    """A kvbridge failure: ``code`` (int), ``name`` (e.g. ``"STALE_PEER"``), ``message``,
    ``origin`` (``"master"``, ``"storage_node"`` or ``""``)."""

    status_code: StatusCode = StatusCode.INTERNAL

    def __init__(self, message: str = "", code: int | None = None, name: str | None = None,
                 origin: str = ""):
        self.code = int(self.status_code if code is None else code)
        try:
            default_name = StatusCode(self.code).name
        except ValueError:
            default_name = f"UNKNOWN({self.code})"
        self.name = name or default_name
        self.message = message
        self.origin = origin
        super().__init__(f"{self.name}: {message}" if message else self.name)


def _subclass(name: str, code: StatusCode, doc: str) -> type[KvbError]:
    return type(name, (KvbError,), {"status_code": code, "__doc__": doc, "__module__": __name__})


# Python's own exception types are mixed in where the meaning matches, so callers that catch
# ValueError / KeyError / TimeoutError / ... keep working.
class InvalidArgumentError(KvbError, ValueError):
    """A caller passed something malformed (the message names it)."""

    status_code = StatusCode.INVALID_ARGUMENT


class NotFoundError(KvbError, KeyError):
    """Unknown key, peer, segment or batch."""

    status_code = StatusCode.NOT_FOUND

    def __str__(self) -> str:  # KeyError would repr() the message
        return Exception.__str__(self)


class DeadlineExceededError(KvbError, TimeoutError):
    """The operation's deadline passed."""

    status_code = StatusCode.DEADLINE_EXCEEDED


class ProgressTimeoutError(KvbError, TimeoutError):
    """The peer stopped moving bytes for longer than progress_timeout_ms (a frozen peer)."""

    status_code = StatusCode.PROGRESS_TIMEOUT


class PeerUnreachableError(KvbError, ConnectionError):
    """Cannot connect, connection lost, or the peer's circuit breaker is open."""

    status_code = StatusCode.PEER_UNREACHABLE


class PermissionDeniedError(KvbError, PermissionError):
    """Authenticated, but not allowed this call: a destructive store call (remove_all, draining
    another node) without the admin token (KVBRIDGE_ADMIN_TOKEN, docs/security.md)."""

    status_code = StatusCode.PERMISSION_DENIED


class UnknownMemoryError(KvbError, ValueError):
    """Memory to register is not what its kind says: not mapped host memory, or not device memory
    of a CUDA allocation (managed memory, an unknown pointer, a span past the allocation). The
    message names the pointer attributes found (docs/transfer-engine.md, "GPU memory")."""

    status_code = StatusCode.UNKNOWN_MEMORY


class IoError(KvbError, OSError):
    """A storage I/O failure."""

    status_code = StatusCode.IO_ERROR


AlreadyExistsError = _subclass("AlreadyExistsError", StatusCode.ALREADY_EXISTS, "Already exists.")
NotRegisteredError = _subclass(
    "NotRegisteredError", StatusCode.NOT_REGISTERED,
    "Memory (local or remote) is not inside a registered region.")
OutOfBoundsError = _subclass(
    "OutOfBoundsError", StatusCode.OUT_OF_BOUNDS,
    "An offset/length or page index lies outside its region.")
StalePeerError = _subclass(
    "StalePeerError", StatusCode.STALE_PEER,
    "The peer restarted (another incarnation): add its new descriptor.")
BackpressureError = _subclass(
    "BackpressureError", StatusCode.BACKPRESSURE, "A queue bound was reached; retry later.")
CancelledError = _subclass("CancelledError", StatusCode.CANCELLED, "The operation was cancelled.")
ProtocolError = _subclass("ProtocolError", StatusCode.PROTOCOL,
                          "Malformed frame or protocol violation.")
UnauthenticatedError = _subclass(
    "UnauthenticatedError", StatusCode.UNAUTHENTICATED, "Cluster token missing or wrong.")
UnsupportedError = _subclass(
    "UnsupportedError", StatusCode.UNSUPPORTED, "Not implemented by this build or plugin.")
UnavailableError = _subclass(
    "UnavailableError", StatusCode.UNAVAILABLE,
    "Cannot run here (missing library, no device, object closed).")
NoSpaceError = _subclass("NoSpaceError", StatusCode.NO_SPACE, "No space left in the store or tier.")
InternalError = _subclass("InternalError", StatusCode.INTERNAL,
                          "A kvbridge bug or runtime failure.")

_BY_CODE: dict[int, type[KvbError]] = {
    cls.status_code: cls
    for cls in (InvalidArgumentError, NotFoundError, AlreadyExistsError, NotRegisteredError,
                OutOfBoundsError, StalePeerError, PeerUnreachableError, DeadlineExceededError,
                ProgressTimeoutError, BackpressureError, CancelledError, ProtocolError,
                UnauthenticatedError, UnsupportedError, UnavailableError, NoSpaceError, IoError,
                InternalError, PermissionDeniedError, UnknownMemoryError)
}


def from_status(code: int, name: str, message: str, origin: str = "") -> KvbError:
    """The exception for a status (used by the native module)."""
    cls = _BY_CODE.get(int(code), KvbError)
    return cls(message, code=int(code), name=name, origin=origin)
