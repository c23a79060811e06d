"""AsyncEngine: one thread steps an LLMEngine (and only it touches it) for asyncio handlers (docs/serving.md)."""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tiergram import _native
from tiergram.engine import LLMEngine, QueueFullError, SamplingParams

SNAPSHOT_EVERY_S = 0.02  # engine metrics are snapshotted at most this often while busy (always when idle)
IDLE_WAIT_S = 0.05  # an idle engine thread looks at its inbox this often even when nothing wakes it
RESTART_PAUSE_S = 0.1  # the engine loop waits this long after a failure outside a step before it goes on


class EngineDeadError(RuntimeError):
    """The engine thread stopped (shutdown); no more outputs will come."""


class EngineLoopError(RuntimeError):
    """The engine loop failed outside a step (a snapshot, an abort): the requests open then failed; it went on."""


@dataclass
class AsyncioStream:
    """A request's stream into an event loop: accept(error or None) once, then put(output or exception)."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    accepted: asyncio.Future

    def put(self, item: Any) -> None:
        """Hand an output (or an exception) to the request's event loop."""
        self._call(self.queue.put_nowait, item)

    def accept(self, error: BaseException | None) -> None:
        """Settle the acceptance future."""
        def settle() -> None:
            if self.accepted.done():
                return
            if error is None:
                self.accepted.set_result(None)
            else:
                self.accepted.set_exception(error)
        self._call(settle)

    def _call(self, fn: Any, *args: Any) -> None:
        with contextlib.suppress(RuntimeError):  # a closed event loop: nobody is listening any more
            self.loop.call_soon_threadsafe(fn, *args)


def new_stream() -> AsyncioStream:
    """A request's stream into the running event loop."""
    loop = asyncio.get_running_loop()
    return AsyncioStream(loop, asyncio.Queue(), loop.create_future())


async def accepted(stream: AsyncioStream, abort: Callable[[], None]) -> asyncio.Queue:
    """The request's output queue once the engine took it (its refusal raised here; cancelled: aborted)."""
    try:
        await stream.accepted
    except asyncio.CancelledError:
        abort()
        raise
    return stream.queue


class AsyncEngine:
    """An LLMEngine driven by a background thread, for asyncio callers."""

    def __init__(self, engine: LLMEngine, on_update: Callable[[], None] | None = None) -> None:
        self.engine = engine
        self.on_update = on_update or (lambda: None)  # on the engine thread after each round (and at the end)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, Any] = {}  # engine thread only
        self._stopping = False
        self._closed = False  # set (under _lock) once the engine thread refuses new work
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None  # the exception that stopped the engine thread
        self.snapshot: Any = engine.metrics()  # the latest EngineMetrics (read by /metrics)
        self._snapshot_t = time.perf_counter()
        self._pending_adds = 0  # adds in the inbox, not yet applied: they count against the waiting queue

    @property
    def alive(self) -> bool:
        """Whether the engine thread is running."""
        return self._thread is not None and self._thread.is_alive()

    @property
    def open_requests(self) -> int:
        """Requests this side holds a stream for (0 once every request has finished or been aborted)."""
        return len(self._streams)

    def start(self) -> None:
        """Start the engine thread."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="tiergram-engine", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the engine thread (requests still running are failed) and wait for it."""
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    async def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> asyncio.Queue:
        """Submit a request; its output queue (raises ValueError, QueueFullError or EngineDeadError)."""
        stream = new_stream()
        self.submit(request_id, prompt_token_ids, params, stream)
        return await accepted(stream, lambda: self.abort(request_id))

    def submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, stream: Any) -> None:
        """Queue a request for the engine thread (QueueFullError or EngineDeadError at once when it cannot be)."""
        self.check_capacity()  # a request that will be refused costs nothing: no read-ahead
        self.engine.read_ahead(prompt_token_ids)  # its rows are read while the step in flight runs
        with self._lock:
            if self._thread is None or self._closed or self._stopping:
                raise EngineDeadError(f"the engine is not running ({self.error or 'stopped'})")
            self._pending_adds += 1
            self._inbox.put(("add", request_id, prompt_token_ids, params, stream))
        self._wake.set()

    def check_capacity(self) -> None:
        """QueueFullError if the waiting queue, with the adds not yet applied, is full (cheap: no lock taken)."""
        waiting, limit = len(self.engine.scheduler.waiting) + self._pending_adds, self.engine.config.max_waiting
        if waiting >= limit:
            raise QueueFullError(f"{waiting} requests are waiting (max_waiting {limit}); retry later")

    def abort(self, request_id: str) -> None:
        """Abort a request (its K/V blocks are freed by the engine thread); no-op when it has finished."""
        self._inbox.put(("abort", request_id))
        self._wake.set()

    # ------------------------------------------------------------------------------------- engine thread

    def _handle_inbox(self) -> bool:
        """Apply queued adds and aborts; whether there were any."""
        handled = False
        while True:
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return handled
            handled = True
            if cmd[0] == "add":
                _, rid, ids, params, stream = cmd
                with self._lock:
                    self._pending_adds -= 1
                try:
                    self.engine.add_request(rid, ids, params)
                except Exception as e:  # ValueError, QueueFullError: the handler turns them into 4xx
                    stream.accept(e)
                    continue
                self._streams[rid] = stream
                stream.accept(None)
            else:
                rid = cmd[1]
                if self._streams.pop(rid, None) is not None:
                    self.engine.abort_request(rid)

    def _run(self) -> None:
        _native.name_thread("tiergram-engine")  # the OS's name too: top -H and perf tell the step thread apart
        try:
            while not self._stopping:
                try:
                    self._turn()
                except Exception as e:  # noqa: BLE001 - the supervisor: fail what is open, then go on
                    self._recover(e)
        except BaseException as e:  # (KeyboardInterrupt, SystemExit): every waiting request gets the error
            self.error = e
        finally:
            self._fail_all(self.error)

    def _turn(self) -> None:
        """One round of the loop: the inbox, then a step (or an idle wait)."""
        changed = self._handle_inbox()
        busy = self.engine.has_unfinished()
        if busy:
            try:
                outputs = self.engine.step()
            except Exception as e:  # noqa: BLE001 - outside the engine's own isolation: fail what is open
                self.engine.record_fault(e)
                outputs = self.engine.fail_all(e)
            self._deliver(outputs)
        now = time.perf_counter()
        if changed or not busy or now - self._snapshot_t >= SNAPSHOT_EVERY_S:
            self.snapshot, self._snapshot_t = self.engine.metrics(), now
        self.on_update()
        if not busy:
            self._wake.wait(IDLE_WAIT_S)
            self._wake.clear()

    def _recover(self, error: Exception) -> None:
        """After an exception outside a step: count a fault, fail every open request naming it, pause, go on."""
        err = EngineLoopError(f"the engine loop failed and restarted: {type(error).__name__}: {error}")
        with contextlib.suppress(Exception):  # the engine itself is broken: its streams still get the error
            self.engine.record_fault(error)
            self._deliver(self.engine.fail_all(err))
        for stream in self._streams.values():
            stream.put(err)
        self._streams.clear()
        self.on_update()
        time.sleep(RESTART_PAUSE_S)  # a failure that repeats does not spin

    def _deliver(self, outputs: list[Any]) -> None:
        """Hand each RequestOutput to its request's queue (a finished request's stream is dropped)."""
        for out in outputs:
            stream = self._streams.pop(out.request_id, None) if out.finished else self._streams.get(out.request_id)
            if stream is not None:
                stream.put(out)

    def _fail_all(self, error: BaseException | None) -> None:
        """End every open request (engine stopped) and refuse the queued ones."""
        err = EngineDeadError(f"the engine stopped: {error!r}" if error else "the server is shutting down")
        for rid, stream in list(self._streams.items()):
            with contextlib.suppress(Exception):
                self.engine.abort_request(rid)
            stream.put(err)
        self._streams.clear()
        with self._lock:
            self._closed = True
        while True:
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                break
            if cmd[0] == "add":
                cmd[4].accept(err)
        self.on_update()
