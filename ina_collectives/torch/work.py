"""The torch.distributed backend's Work objects (distributed.py): ``Work``, a collective
in flight (its handles as one ``HandleGroup``, its future completed from the runtime's
thread), and ``PeerWork``, a send or receive (runtime/p2p.py); both raise torch's
DistBackendError as gloo's do, and wait in short slices so that Ctrl-C interrupts them."""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist

from ..errors import InaError
from ..runtime.handle_group import HandleGroup
from ..runtime.p2p import Transfer


class Work(dist._Work):
    """A collective in flight: wait() raises torch's DistBackendError if it failed."""

    def __init__(self, future: torch.futures.Future, group: HandleGroup, seconds: float):
        super().__init__()
        self._future, self._group, self._seconds = future, group, seconds

    def wait(self, timeout: Any = None) -> bool:
        """Until the collective is done; DistBackendError after the group's timeout, or
        after ``timeout`` (a timedelta; zero or None: the group's) where it is shorter,
        as gloo's. The call goes on meanwhile: a later wait may still see it done."""
        seconds = self._seconds
        given = (timeout.total_seconds() if hasattr(timeout, "total_seconds")
                 else float(timeout or 0))
        if given > 0:
            seconds = min(seconds, given)
        try:
            self._group.wait(seconds)  # in short slices: Ctrl-C interrupts
        except Exception:  # noqa: BLE001 - a failure is the future's, as torch's error
            if not self._group.done():
                raise dist.DistBackendError(f"backend 'ina': waited {seconds:g} s "
                                            f"for {self._group.what}") from None
        self._future.wait()  # set by the runtime's thread; raises the failure
        return True

    def is_completed(self) -> bool:
        return self._future.done()

    def get_future(self) -> torch.futures.Future:
        return self._future

    def result(self) -> list[torch.Tensor]:
        """The call's output tensors, as gloo's Work gives them (waits for them)."""
        self.wait()
        return self._future.value()

    def exception(self) -> BaseException | None:
        """The failure of a call that has ended (None while it runs, or if it did not)."""
        if not self._future.done():
            return None
        try:
            self._future.value()
        except Exception as exc:  # noqa: BLE001 - the failure is the answer
            return exc
        return None

    def is_success(self) -> bool:
        """Whether the call has ended without failing."""
        return self._future.done() and self.exception() is None


class PeerWork(dist._Work):
    """A send or receive in flight (runtime/p2p.py): its future completes once the
    transfer ends (``finish()``, its result, copies what came into place); wait()
    raises DistBackendError if it failed or timed out."""

    def __init__(self, transfer: Transfer, finish: Callable[[], list[torch.Tensor]]):
        super().__init__()
        self._transfer, self._finish = transfer, finish
        self._future: torch.futures.Future = torch.futures.Future()
        transfer.add_done_callback(self._ended)

    def _ended(self, transfer: Transfer) -> None:
        if transfer.error is not None:
            self._future.set_exception(dist.DistBackendError(f"backend 'ina', "
                                                             f"{transfer.error}"))
            return
        try:
            self._future.set_result(self._finish())
        except Exception as exc:  # noqa: BLE001 - reaches the waiter
            self._future.set_exception(dist.DistBackendError(
                f"backend 'ina', {transfer.what} failed: {exc}"))

    def wait(self, timeout: Any = None) -> bool:
        try:
            self._transfer.wait()  # its own bound, in short slices: Ctrl-C interrupts
        except InaError as exc:
            if not self._transfer.done():
                raise dist.DistBackendError(f"backend 'ina', {exc}") from None
        self._future.wait()  # raises the failure
        return True

    def is_completed(self) -> bool:
        return self._future.done()

    def get_future(self) -> torch.futures.Future:
        return self._future

    def _source_rank(self) -> int:
        return self._transfer.source


def torch_error(error: BaseException, what: str) -> BaseException:
    if isinstance(error, InaError):
        return dist.DistBackendError(f"backend 'ina', {what}: {error}")
    return error
