"""Ticket: the handle of an asynchronous prefetch; `wait()` gives the rows, `cancel()` abandons them."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import CancelledError, Future

import torch


class Ticket:
    """Rows being fetched in the background. Several may be in flight; they run in submission order."""

    def __init__(self, future: Future, cancelled: threading.Event, on_cancel: Callable[[], None]) -> None:
        self._future = future
        self._cancelled = cancelled
        self._on_cancel = on_cancel

    def done(self) -> bool:
        """True once the rows are ready (or the fetch failed or was cancelled)."""
        return self._future.done()

    def wait(self, timeout: float | None = None) -> torch.Tensor:
        """The rows [..., H, D]; raises the fetch's error, CancelledError, or TimeoutError after `timeout` s."""
        return self._future.result(timeout)

    def cancel(self) -> bool:
        """Abandon the fetch: pending ones never run, running ones stop at the next phase. True if stopped."""
        self._cancelled.set()
        if self._future.cancel():
            self._on_cancel()
            return True
        try:
            self._future.result()
        except CancelledError:
            return True
        except Exception:  # the fetch failed before it saw the flag; the error is the caller's to read
            return False
        return False

    @property
    def cancelled(self) -> bool:
        """True once `cancel()` was asked and the fetch did not deliver (False if it finished or failed first)."""
        if not self._cancelled.is_set():
            return False
        f = self._future
        if not f.done():
            return True  # being abandoned
        return f.cancelled() or isinstance(f.exception(), CancelledError)


class NativeTicket:
    """Rows fetched by a native job on the table's C++ worker (`wait()` without the GIL); Ticket's interface."""

    def __init__(self, job: object, value: torch.Tensor | None) -> None:
        self._job = job
        self._value = value
        self._asked = False

    def done(self) -> bool:
        """True once the rows are ready (or the fetch failed or was cancelled)."""
        return self._job.done()

    def wait(self, timeout: float | None = None) -> torch.Tensor | None:
        """The rows [..., H, D]; raises the fetch's error, CancelledError, or TimeoutError after `timeout` s."""
        if not self._job.wait(-1.0 if timeout is None else max(0.0, timeout)):
            raise TimeoutError(f"the fetch did not finish within {timeout} s")
        self._job.result()
        return self._value

    def cancel(self) -> bool:
        """Abandon the fetch: a queued one never runs, a running one stops at its next phase. True if stopped."""
        self._asked = True
        if self._job.cancel():
            return True
        self._job.wait(-1.0)
        return self._job.state == "cancelled"

    @property
    def cancelled(self) -> bool:
        """True once `cancel()` was asked and the fetch did not deliver (False if it finished or failed first)."""
        return self._asked and self._job.state != "done"
