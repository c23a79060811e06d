"""EngineProcess: the engine in a process of its own (`tiergram serve --engine-process`; docs/serving.md).

Messages, HTTP -> engine: ("add", rid, prompt_ids, params), ("abort", rid), ("stop",).
Engine -> HTTP: ("ready", info) or ("failed", text) once; then ("accepted", rid, error or None) per add and
("batch", [(rid, output or exception), ...], snapshot or None) per engine round; ("stopped", error text) last.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import multiprocessing as mp
import signal
import threading
import time
from dataclasses import dataclass
from typing import Any

from tiergram.engine import EngineConfig, LLMEngine, QueueFullError, SamplingParams
from tiergram.server.async_engine import AsyncEngine, AsyncioStream, EngineDeadError, accepted, new_stream

SNAPSHOT_EVERY_S = 0.05  # metrics snapshots sent to the HTTP process at most this often
PR_SET_PDEATHSIG = 1


class EngineStartError(RuntimeError):
    """The engine process could not build its engine (the message is the cause, as the engine raised it)."""


# ------------------------------------------------------------------------------------------ engine process

class _Outbox:
    """Sends on a pipe under a lock; the engine process's: acceptances at once, outputs once per engine round."""

    def __init__(self, conn: Any, core: AsyncEngine | None = None) -> None:
        self.conn, self.core = conn, core
        self.lock = threading.Lock()
        self.outputs: list[tuple[str, Any]] = []
        self.sent_snapshot: Any = None
        self.sent_at = 0.0

    def send(self, msg: tuple) -> None:
        with self.lock, contextlib.suppress(OSError, ValueError):  # the other process gone: its reader sees EOF
            self.conn.send(msg)

    def flush(self) -> None:
        """Send this round's outputs and, at most every SNAPSHOT_EVERY_S, a new metrics snapshot."""
        snap, now = None, time.perf_counter()
        if self.core is not None and self.core.snapshot is not self.sent_snapshot and \
                (now - self.sent_at >= SNAPSHOT_EVERY_S or self.outputs):
            snap = (self.core.snapshot, time.process_time())
            self.sent_snapshot, self.sent_at = self.core.snapshot, now
        if self.outputs or snap is not None:
            outputs, self.outputs = self.outputs, []
            self.send(("batch", outputs, snap))


@dataclass
class _PipeStream:
    """One request's stream in the engine process (engine thread only)."""

    request_id: str
    outbox: _Outbox

    def accept(self, error: BaseException | None) -> None:
        self.outbox.send(("accepted", self.request_id, None if error is None else WireError.of(error)))

    def put(self, item: Any) -> None:
        self.outbox.outputs.append((self.request_id, WireError.of(item) if isinstance(item, BaseException) else item))


@dataclass
class WireError:
    """An exception across the pipe as its type's name and message (any exception pickles this way)."""

    kind: str
    message: str

    KNOWN = {"ValueError": ValueError, "QueueFullError": QueueFullError, "EngineDeadError": EngineDeadError}

    @classmethod
    def of(cls, error: BaseException) -> WireError:
        return cls(type(error).__name__, str(error))

    def rebuild(self) -> BaseException:
        known = self.KNOWN.get(self.kind)
        return known(self.message) if known else RuntimeError(f"{self.kind}: {self.message}")


def _engine_main(config: EngineConfig, conn: Any, torch_threads: int) -> None:
    """The engine process: build the engine, then serve the pipe until told to stop or the HTTP process goes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C and SIGTERM are the HTTP process's to handle: it drains
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # first, then stops us
    with contextlib.suppress(OSError, AttributeError):  # Linux kills this process when the HTTP process dies
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    outbox = _Outbox(conn)
    try:
        import torch

        if torch_threads:
            torch.set_num_threads(torch_threads)
        engine = LLMEngine(config)
    except BaseException as e:  # noqa: BLE001 - reported to the HTTP process, which raises EngineStartError
        outbox.send(("failed", f"{type(e).__name__}: {e}"))
        conn.close()
        return
    core = AsyncEngine(engine, on_update=outbox.flush)
    outbox.core = core
    outbox.send(("ready", (engine.tokenizer, engine.model_name, engine.max_model_len, engine.vocab_size,
                           engine.config.max_waiting, core.snapshot, time.process_time())))
    core.start()
    try:
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                break
            if msg[0] == "add":
                _, rid, ids, params = msg
                stream = _PipeStream(rid, outbox)
                try:
                    core.submit(rid, ids, params, stream)
                except Exception as e:  # noqa: BLE001 - refused (a full queue, a read-ahead that failed): say why
                    stream.accept(e)
            elif msg[0] == "abort":
                core.abort(msg[1])
            else:
                break
    finally:
        core.stop()
        engine.close()
        outbox.send(("stopped", repr(core.error) if core.error else ""))
        conn.close()


# -------------------------------------------------------------------------------------------- HTTP process

class EngineProcess:
    """An LLMEngine in a child process, driven from asyncio like AsyncEngine (create_app takes either)."""

    def __init__(self, config: EngineConfig, *, torch_threads: int = 0, start_timeout_s: float = 1800.0) -> None:
        """Start the engine process and wait until its engine is built; EngineStartError names what failed."""
        ctx = mp.get_context("spawn")  # a fresh interpreter: no fork of torch's threads or of uvicorn's loop
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_engine_main, args=(config, child, torch_threads), name="tiergram-engine",
                                 daemon=True)
        self._proc.start()
        child.close()
        # snapshot: the latest EngineMetrics the engine process sent; engine_cpu_seconds: its CPU seconds (all threads)
        (self.tokenizer, self.model_name, self.max_model_len, self.vocab_size, self.max_waiting, self.snapshot,
         self.engine_cpu_seconds) = self._startup(start_timeout_s)
        self._outbox = _Outbox(self._conn)  # this side sends through it too (no outputs of its own)
        self._lock = threading.Lock()  # guards _streams, _pending and _dead
        self._streams: dict[str, AsyncioStream] = {}
        self._pending = 0  # adds sent, not yet accepted or refused
        self._dead = False
        self.error: BaseException | None = None
        self._reader: threading.Thread | None = None

    def _startup(self, timeout_s: float) -> tuple:
        deadline = time.monotonic() + timeout_s
        while not self._conn.poll(0.2):  # (a process that exits closes its end: poll answers, recv raises EOFError)
            if time.monotonic() > deadline:
                self._proc.kill()
                raise EngineStartError(f"the engine process did not start within {timeout_s:.0f} s")
        try:
            msg = self._conn.recv()
        except EOFError:
            msg = ("failed", None)
        if msg[0] == "failed":
            self._proc.join(10)
            exited = f"the engine process exited with code {self._proc.exitcode} while starting"
            raise EngineStartError(msg[1] or exited)
        return msg[1]

    @property
    def alive(self) -> bool:
        """Whether the engine process is running and answering."""
        return not self._dead and self._proc.is_alive()

    def start(self) -> None:
        """Start the thread that reads the engine process's messages."""
        if self._reader is None:
            self._reader = threading.Thread(target=self._read, name="tiergram-engine-reader", daemon=True)
            self._reader.start()

    def check_capacity(self) -> None:
        """QueueFullError when the waiting queue, as last reported plus the adds in flight, is full."""
        waiting = self.snapshot.num_waiting + self._pending
        if waiting >= self.max_waiting:
            raise QueueFullError(f"{waiting} requests are waiting (max_waiting {self.max_waiting}); retry later")

    async def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> asyncio.Queue:
        """Submit a request; returns the queue its RequestOutputs arrive on (as AsyncEngine.add)."""
        stream = new_stream()
        self.check_capacity()
        with self._lock:
            if self._dead or self._reader is None:
                raise EngineDeadError(f"the engine is not running ({self.error or 'stopped'})")
            self._streams[request_id] = stream
            self._pending += 1
        self._outbox.send(("add", request_id, list(prompt_token_ids), params))
        return await accepted(stream, lambda: self.abort(request_id))

    @property
    def open_requests(self) -> int:
        """Requests this side holds a stream for (0 once every request has finished or been aborted)."""
        return len(self._streams)

    def abort(self, request_id: str) -> None:
        """Abort a request and forget its stream; no-op when it has finished."""
        with self._lock:
            self._streams.pop(request_id, None)
        self._outbox.send(("abort", request_id))

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the engine process (requests still running are failed) and wait for it."""
        self._outbox.send(("stop",))
        self._proc.join(timeout)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5)
        if self._reader is not None:
            self._reader.join(5)
        self._conn.close()

    close = stop

    def _read(self) -> None:
        error: BaseException | None = None
        try:
            while True:
                try:
                    msg = self._conn.recv()
                except (EOFError, OSError):
                    self._proc.join(1)
                    error = EngineDeadError(f"the engine process exited (code {self._proc.exitcode})")
                    break
                if msg[0] == "batch":
                    self._deliver(msg[1], msg[2])
                elif msg[0] == "accepted":
                    self._accepted(msg[1], msg[2])
                elif msg[0] == "stopped":
                    error = EngineDeadError(f"the engine stopped: {msg[1]}" if msg[1] else
                                            "the server is shutting down")
                    break
        finally:
            self._fail_all(error or EngineDeadError("the engine stopped"))

    def _accepted(self, rid: str, wire: WireError | None) -> None:
        error = None if wire is None else wire.rebuild()
        with self._lock:
            self._pending -= 1
            stream = self._streams.get(rid) if error is None else self._streams.pop(rid, None)
        if stream is not None:
            stream.accept(error)

    def _deliver(self, outputs: list[tuple[str, Any]], snapshot: tuple[Any, float] | None) -> None:
        if snapshot is not None:
            self.snapshot, self.engine_cpu_seconds = snapshot
        for rid, out in outputs:
            if isinstance(out, WireError):
                out = out.rebuild()
            with self._lock:
                if isinstance(out, BaseException) or out.finished:
                    stream = self._streams.pop(rid, None)
                else:
                    stream = self._streams.get(rid)
            if stream is not None:
                stream.put(out)

    def _fail_all(self, error: BaseException) -> None:
        with self._lock:
            self._dead = True
            self.error = self.error or error
            streams, self._streams, self._pending = list(self._streams.values()), {}, 0
        for stream in streams:  # a request not yet accepted gets the error from accept, an accepted one from put
            stream.accept(error)
            stream.put(error)
