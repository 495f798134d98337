"""The library's exception types, all defined here and all under ``InaError``.

Each failure of the library's own machinery (peers, the aggregator, the controller, the
launcher, a system call) raises a subclass of InaError; where callers already catch a
builtin type for the same failure, the class keeps that builtin as a second base
(``except TimeoutError`` still catches CollectiveTimeout). A wrong argument (an
unsupported dtype or op, a malformed address or setting) is the builtin TypeError or
ValueError, as in NumPy and mpi4py.

    InaError (RuntimeError)
    ├── AgreementError (ValueError)         ranks made different calls
    ├── CollectiveTimeout (TimeoutError)    a peer never arrived
    ├── CommunicatorBroken                  an earlier call failed midway
    ├── OperationError                      a named Horovod-API operation failed
    │   └── OperationTimeout (CollectiveTimeout)   ... because a peer never arrived
    ├── AggregatorUnavailable (ConnectionError)
    ├── SystemCallError (OSError)           a socket call of the fast path failed
    ├── ControlError                        the P4Runtime target refused or failed
    │   ├── TargetUnavailable               no target answered
    │   └── P4RuntimeError                  the software switch's P4Runtime answer
    └── LaunchError                         ina-run cannot start the job
"""
from __future__ import annotations


class InaError(RuntimeError):
    """Base of the errors raised by ina_collectives itself."""


class AgreementError(InaError, ValueError):
    """Ranks called the same collective with different lengths, dtypes or ops.

    Raised on every rank of the call, with every rank's arguments in the message.
    """


class CollectiveTimeout(InaError, TimeoutError):
    """A collective waited longer than the ``timeout`` setting for its peers.

    The message names what it waited for. The communicator is unusable afterwards:
    messages of the abandoned operation may still be in flight.
    """


class CommunicatorBroken(InaError):
    """An earlier collective on this communicator failed midway; no further calls are safe."""


class OperationError(InaError):
    """A named operation failed: its ranks disagreed, it stalled, or the runtime stopped.

    The Horovod API's ``HorovodInternalError``: every failure of an operation is one."""


class OperationTimeout(OperationError, CollectiveTimeout):
    """A named operation failed because a peer never arrived (also a CollectiveTimeout)."""


class AggregatorUnavailable(InaError, ConnectionError):
    """The aggregator did not answer, or refused the job; the message says which."""


class SystemCallError(InaError, OSError):
    """A socket call of the compiled data path failed; ``errno`` and the message say why.

    Built as ``SystemCallError(errno, "sendto to 127.0.0.1:47474")``: the message then
    reads ``[Errno 111] Connection refused: sendto to 127.0.0.1:47474``.
    """

    def __new__(cls, errno: int, what: str) -> "SystemCallError":
        return OSError.__new__(cls, errno, _strerror(errno, what))

    def __init__(self, errno: int, what: str):
        OSError.__init__(self, errno, _strerror(errno, what))


def _strerror(errno: int, what: str) -> str:
    import os

    return f"{os.strerror(errno)}: {what}" if errno else what


class ControlError(InaError):
    """The P4Runtime target refused a request or failed; the message names its error."""


class TargetUnavailable(ControlError):
    """No P4Runtime target answered at the address within the bound."""


class P4RuntimeError(ControlError):
    """A P4Runtime request to the software switch failed with a google.rpc code
    (``code``, from code_pb2) and a message: the server's answer to its client, never
    raised to a caller of the library."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code


class TopologyError(InaError, ValueError):
    """A topology file (INA_TOPOLOGY, ina-run --topology) that cannot be a job's
    aggregation tree: the message names the file, the aggregator and what is wrong."""


class LaunchError(InaError):
    """ina-run cannot start the job: the launcher, the command or the switch is missing."""


__all__ = ["InaError", "AgreementError", "CollectiveTimeout", "CommunicatorBroken",
           "OperationError", "OperationTimeout", "AggregatorUnavailable", "SystemCallError",
           "ControlError", "TargetUnavailable", "P4RuntimeError", "TopologyError", "LaunchError"]
