"""Errors raised by tf_ipu when the device (server) says no.

Every error carries the gRPC status code (``code``, e.g. ``"INVALID_ARGUMENT"``, and the
number ``grpc_code``, which is also the TF/absl status code, so the op library fails a
device call with the matching ``tf.errors`` class), the server's message, the address of
the server that said it, and the server's refinement of the code (``kind``, e.g.
``"unknown-session"``, ``"no-free-ipus"``, ``"shutting-down"``; "" if none).

    DeviceError
     |- DeviceUnavailableError      server unreachable, gone, or not answering (UNAVAILABLE)
     |- DeadlineExceededError       a call ran past its deadline
     |- InvalidArgumentError        bad program or arguments (wrong dtype/shape/arity, ...)
     |   '- FloatingPointExceptionError  a floating-point exception check fired (inv, div0,
     |                              oflo in IPUConfig.floating_point_behaviour)
     |- NotFoundError               unknown session, executable handle or variable key
     |- ResourceExhaustedError      no free IPUs, too many queued calls, message too large
     |   '- OutOfMemoryError        the program does not fit in tile memory
     |- UnsupportedOpError          an opcode the emulator does not (or is told not to) run
     |                              (UNIMPLEMENTED from a server without the method: DeviceError)
     |- FailedPreconditionError     calls in the wrong order (e.g. Compile before AttachIpus)
     |- UnauthenticatedError        the server wants a token and got none or a wrong one
 |- DeviceStateLostError        a lost session took device-resident values the host had not
 |                              read back yet (DATA_LOSS); names the step the host holds
     '- InternalError               a fault inside the server
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator

# gRPC status codes by name (the same numbers as TF/absl status codes).
GRPC_CODES: dict[str, int] = {
    "OK": 0, "CANCELLED": 1, "UNKNOWN": 2, "INVALID_ARGUMENT": 3, "DEADLINE_EXCEEDED": 4,
    "NOT_FOUND": 5, "ALREADY_EXISTS": 6, "PERMISSION_DENIED": 7, "RESOURCE_EXHAUSTED": 8,
    "FAILED_PRECONDITION": 9, "ABORTED": 10, "OUT_OF_RANGE": 11, "UNIMPLEMENTED": 12,
    "INTERNAL": 13, "UNAVAILABLE": 14, "DATA_LOSS": 15, "UNAUTHENTICATED": 16,
}


class DeviceError(Exception):
    """An error reported by (or about) the device server.

    Args:
        code: gRPC status code name, e.g. ``"INVALID_ARGUMENT"``.
        message: what the server (or the transport) said.
        address: ``host:port`` of the server, when known.
        kind: the server's refinement of the code (trailing metadata ``tf-ipu-error-kind``).

    Example:
        >>> try:
        ...     client.execute(exe_id, [x])
        ... except DeviceError as e:
        ...     print(e.code, e.message, e.address)
    """

    #: Raised while a user's ``tf.function`` is traced (a program lowered, compiled or refused
    #: inside it), it reaches the user as it is: autograph would otherwise re-raise it as a
    #: ``StagingError`` carrying only its text.
    ag_pass_through = True

    def __init__(self, code: str, message: str, address: str = "", kind: str = "") -> None:
        self.code = code
        self.message = message
        self.address = address
        self.kind = kind
        super().__init__(str(self))

    @property
    def grpc_code(self) -> int:
        """The numeric status code (2 = UNKNOWN for a name gRPC does not have)."""
        return GRPC_CODES.get(self.code, 2)

    def __str__(self) -> str:
        where = f" (device server at {self.address})" if self.address else ""
        return f"{self.code}: {self.message}{where}"

    def __repr__(self) -> str:
        return f"{type(self).__name__}(code={self.code!r}, message={self.message!r}, address={self.address!r})"

    def __reduce__(self) -> tuple:
        return (_rebuild, (type(self), self.code, self.message, self.address, self.kind))


def _rebuild(cls: type, code: str, message: str, address: str, kind: str = "") -> DeviceError:
    err = Exception.__new__(cls)
    DeviceError.__init__(err, code, message, address, kind)
    return err


class _CodedError(DeviceError):
    """A DeviceError whose code is fixed by its class: ``Cls(message, address="", kind="")``."""

    CODE = "UNKNOWN"

    def __init__(self, message: str, address: str = "", kind: str = "") -> None:
        super().__init__(self.CODE, message, address, kind)


class DeviceUnavailableError(_CodedError):
    """The server cannot be reached, went away, or did not answer in time."""

    CODE = "UNAVAILABLE"


class DeadlineExceededError(_CodedError):
    """A call did not complete within its deadline."""

    CODE = "DEADLINE_EXCEEDED"


class CancelledError(_CodedError):
    """A device call was cancelled (Ctrl-C, ``DeviceClient.cancel_running``, its session
    closing): the device stopped it at its next step and holds the variables of the last
    completed one (TF raises ``tf.errors.CancelledError``)."""

    CODE = "CANCELLED"


class InvalidArgumentError(_CodedError):
    """The server refused the program or the arguments of a call."""

    CODE = "INVALID_ARGUMENT"


class FloatingPointExceptionError(InvalidArgumentError):
    """A floating-point exception check (``IPUConfig.floating_point_behaviour`` ``inv``,
    ``div0`` or ``oflo``) stopped the step; the message names the flag, the instruction, its
    opcode, the TF op and the Keras layer. Kind ``"floating-point-exception"``."""


class NotFoundError(_CodedError):
    """A session, executable handle or variable key the server does not have."""

    CODE = "NOT_FOUND"


class ResourceExhaustedError(_CodedError):
    """Not enough of something: free IPUs, queue slots, message size."""

    CODE = "RESOURCE_EXHAUSTED"


class OutOfMemoryError(ResourceExhaustedError):
    """The program does not fit in the IPUs' tile memory."""


class UnsupportedOpError(_CodedError):
    """The program uses an opcode the emulator does not run (or was told to refuse)."""

    CODE = "UNIMPLEMENTED"


class FailedPreconditionError(_CodedError):
    """A call made in the wrong state (e.g. Compile before AttachIpus)."""

    CODE = "FAILED_PRECONDITION"


class UnauthenticatedError(_CodedError):
    """The server wants a token (``IPUConfig.server_token``) and got none or a wrong one."""

    CODE = "UNAUTHENTICATED"


class DeviceStateLostError(_CodedError):
    """The session on the device server was lost (the server died or restarted, or the
    lease ran out) while the device held newer values of variables than the host: the
    message names them and the last step whose weights the host holds. Raised once; from
    then on the host's copies are the truth."""

    CODE = "DATA_LOSS"


class InternalError(_CodedError):
    """A fault inside the device server."""

    CODE = "INTERNAL"


_BY_CODE: dict[str, type[_CodedError]] = {
    cls.CODE: cls
    for cls in (DeviceUnavailableError, DeadlineExceededError, CancelledError, InvalidArgumentError,
                NotFoundError, ResourceExhaustedError, UnsupportedOpError,
                FailedPreconditionError, UnauthenticatedError, DeviceStateLostError,
                InternalError)
}


def from_status(code: str, message: str, address: str = "", kind: str = "") -> DeviceError:
    """The ``DeviceError`` subclass for a gRPC status.

    Args:
        code: status code name, e.g. ``"RESOURCE_EXHAUSTED"``.
        message: the status details.
        address: the server's address.
        kind: the server's refinement (trailing metadata ``tf-ipu-error-kind``), e.g.
            ``"out-of-memory"``.

    Returns:
        An instance of the most specific class (``DeviceError`` itself for other codes).
    """
    if code == "RESOURCE_EXHAUSTED" and kind == "out-of-memory":
        return OutOfMemoryError(message, address, kind)
    if code == "INVALID_ARGUMENT" and kind == "floating-point-exception":
        return FloatingPointExceptionError(message, address, kind)
    if code == "UNIMPLEMENTED" and kind != "unsupported-op":
        # The server does not have the method at all: not an opcode the program uses.
        return DeviceError(code, f"{message} (does the server speak this protocol version?)",
                           address, kind)
    cls = _BY_CODE.get(code)
    if cls is None:
        return DeviceError(code, message, address, kind)
    return cls(message, address, kind)


__all__ = [
    "CancelledError", "DeadlineExceededError", "DeviceError", "DeviceStateLostError", "DeviceUnavailableError",
    "FailedPreconditionError",
    "FloatingPointExceptionError",
    "InternalError", "InvalidArgumentError", "NotFoundError", "OutOfMemoryError",
    "ResourceExhaustedError", "UnauthenticatedError", "UnsupportedOpError", "from_status",
]


# What the IpuExecute kernel says when the runtime's device call failed (ops/cc/kernels).
_KERNEL_FAILURE = re.compile(
    r"IpuExecute: (?:the device failed to run the program|could not register the program "
    r"with the device): (?P<device>.*?)(?:\n\t \[\[|\s*\[Op:|$)", re.DOTALL)


@contextlib.contextmanager
def plain_device_errors() -> Iterator[None]:
    """Re-raises a ``tf.errors.OpError`` from a failed IpuExecute as the same TF error class
    with the device's message alone: without TensorFlow's "Graph execution error" and the
    traceback of where the op was defined, which point at tf_ipu's code, not the user's."""
    import tensorflow as tf

    try:
        yield
    except tf.errors.OpError as e:
        found = _KERNEL_FAILURE.search(e.message or "")
        if found is None:
            raise
        raise type(e)(e.node_def, e.op, found.group("device").strip()) from None
