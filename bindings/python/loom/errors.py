"""Loom's status codes as Python exceptions.

Every failed libloom call raises the subclass of :class:`LoomError` for its code, with
Loom's own message (for a manifest, one ``FILE:LINE:COL: message`` per line). The classes
also derive from the closest built-in exception, so ``except ValueError`` catches an
invalid argument and ``except NotImplementedError`` an unimplemented request.
"""

from typing import Dict, Type

from . import _abi


class LoomError(Exception):
    """A failed Loom call.

    Attributes:
        code (int): the loom_code (``loom.errors.INVALID_ARGUMENT`` ...).
        message (str): Loom's message, as ``loom_last_error()`` gave it.
    """

    code: int = -1

    def __init__(self, message: str, code: int = -1) -> None:
        super().__init__(message)
        self.message = message
        if code != -1:
            self.code = code

    def __str__(self) -> str:
        return self.message


class InvalidArgumentError(LoomError, ValueError):
    """LOOM_ERR_INVALID_ARGUMENT: the caller passed something wrong (a bad manifest, a
    tensor of the wrong dtype, shape or layout)."""
    code = _abi.INVALID_ARGUMENT


class NotFoundError(LoomError, LookupError):
    """LOOM_ERR_NOT_FOUND: no such instance, plugin or file."""
    code = _abi.NOT_FOUND


class OutOfRangeError(LoomError, ValueError):
    """LOOM_ERR_OUT_OF_RANGE: a value or buffer outside what is allowed."""
    code = _abi.OUT_OF_RANGE


class UnimplementedError(LoomError, NotImplementedError):
    """LOOM_ERR_UNIMPLEMENTED: a valid request this build, plugin or device cannot serve."""
    code = _abi.UNIMPLEMENTED


class FailedPreconditionError(LoomError, RuntimeError):
    """LOOM_ERR_FAILED_PRECONDITION: the call is not allowed in the current state."""
    code = _abi.FAILED_PRECONDITION


class UnavailableError(LoomError, RuntimeError):
    """LOOM_ERR_UNAVAILABLE: a peer, device or library is not there."""
    code = _abi.UNAVAILABLE


class DeadlineExceededError(LoomError, TimeoutError):
    """LOOM_ERR_DEADLINE_EXCEEDED: a peer did not answer in time."""
    code = _abi.DEADLINE_EXCEEDED


class ResourceExhaustedError(LoomError, MemoryError):
    """LOOM_ERR_RESOURCE_EXHAUSTED: out of memory or another resource."""
    code = _abi.RESOURCE_EXHAUSTED


class DataLossError(LoomError, ValueError):
    """LOOM_ERR_DATA_LOSS: corrupt or truncated data (a foreign or damaged state blob)."""
    code = _abi.DATA_LOSS


class AbiMismatchError(LoomError, RuntimeError):
    """LOOM_ERR_ABI_MISMATCH: a plugin built for an ABI this libloom does not speak."""
    code = _abi.ABI_MISMATCH


class InternalError(LoomError, RuntimeError):
    """LOOM_ERR_INTERNAL: a bug, or an exception caught at the plugin boundary."""
    code = _abi.INTERNAL


BY_CODE: Dict[int, Type[LoomError]] = {
    cls.code: cls
    for cls in (InvalidArgumentError, NotFoundError, OutOfRangeError, UnimplementedError,
                FailedPreconditionError, UnavailableError, DeadlineExceededError,
                ResourceExhaustedError, DataLossError, AbiMismatchError, InternalError)
}


def error_for(code: int, message: str) -> LoomError:
    """The exception for a loom_code (a plain LoomError for a code this package does not
    know, which a newer libloom may return)."""
    cls = BY_CODE.get(code)
    if cls is None:
        return LoomError(f"{message} (loom code {code})", code)
    return cls(message)


def check(code: int) -> None:
    """Raises the exception for a libloom return code (nothing for LOOM_OK), with
    loom_last_error()'s message."""
    if code == _abi.OK:
        return
    from ._lib import lib

    raw = lib().loom_last_error()
    message = raw.decode("utf-8", errors="replace") if raw else ""
    raise error_for(code, message or f"loom call failed with code {code} and no message")
