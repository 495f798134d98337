"""The Horovod API's int handles: each async call registers the runtime's handles of
its operation (``register``) and gets an int for ``poll`` and ``synchronize``, which waits
for every handle and maps a failure to Horovod's errors; and the names of operations
(``op_name``: the caller's, or the set's next of its kind)."""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Callable

from ..errors import CollectiveTimeout, InaError, OperationError, OperationTimeout
from ..runtime import world as _world
from ..runtime.background import Handle
from ..runtime.handle_group import HandleGroup
from ..runtime.world import SetMember
from .staging import (
    SUPPORTED_DTYPES,  # noqa: F401 - a public name of this module, as before
    )

# -- handles -------------------------------------------------------------------------------

@dataclass
class Pending:
    handles: list[Handle]
    complete: Callable[[list[Any]], Any]   # the runtime's results -> what synchronize returns
    what: str


_handles: dict[int, Pending] = {}
_handle_ids = itertools.count(1)


def clear() -> None:
    """Forget every handle (the runtime has shut down)."""
    _handles.clear()


def register(handles: list[Handle], complete: Callable[[list[Any]], Any], what: str) -> int:
    handle_id = next(_handle_ids)
    _handles[handle_id] = Pending(handles, complete, what)
    return handle_id


def poll(handle: int) -> bool:
    """True once the operation of ``handle`` has finished (synchronize will not wait)."""
    try:
        pending = _handles[handle]
    except KeyError:
        raise ValueError(f"unknown handle {handle!r} (already synchronized?)") from None
    return all(h.done() for h in pending.handles)


def synchronize(handle: int) -> Any:
    """Wait for the operation of ``handle`` and return its output. Raises the operation's
    error (RuntimeError: ranks disagreed, it stalled, a peer died) on every rank."""
    try:
        pending = _handles.pop(handle)
    except KeyError:
        raise ValueError(f"unknown handle {handle!r} (already synchronized?)") from None
    runtime = _world.require().runtime
    try:  # every handle waited on, so that each name is free again
        results = HandleGroup(pending.handles, pending.what).wait(runtime.wait_seconds())
    except OperationError:
        raise
    except InaError as exc:
        # Horovod raises HorovodInternalError for every failure of an operation.
        kind = OperationTimeout if isinstance(exc, CollectiveTimeout) else OperationError
        raise kind(f"{pending.what} failed: {exc}") from exc
    return pending.complete(results)


# -- names ---------------------------------------------------------------------------------

def op_name(kind: str, name: str | None, member: SetMember) -> str:
    if name is None:
        return member.next_name(kind)
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty string, got {name!r}")
    return name
