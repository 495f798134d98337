"""The library's exception types: specific ones, each naming what went wrong."""


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
