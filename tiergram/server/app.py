"""The OpenAI-compatible HTTP server: FastAPI routes, server-sent events, draining on SIGTERM."""

from __future__ import annotations

import asyncio
import json
import logging
import resource
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect

from tiergram.engine import LLMEngine, QueueFullError
from tiergram.server.async_engine import AsyncEngine, EngineDeadError, EngineLoopError
from tiergram.server.edge import REFUSED, RETRY_AFTER_S, Guard, edge_protocol
from tiergram.server.engine_process import EngineProcess
from tiergram.server.metrics import CONTENT_TYPE, ServerMetrics
from tiergram.server.protocol import (
    APIError,
    Detokenizer,
    GenerationRequest,
    bad,
    chunk,
    openapi_schema,
    redact,
    response,
    tokenize,
    validate_request,
)
from tiergram.server.protocol import usage_chunk as make_usage_chunk
from tiergram.settings import ServerSettings

ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics", "/openapi.json")
DISCONNECT_POLL_S = 0.5  # how often a non-streaming request checks whether its client has gone
INLINE_TOKENIZE_CHARS = 2048  # longer prompts are tokenized on a worker thread, off the event loop
FD_RESERVE = 256  # file descriptors kept beside the connection cap: tables, pipes, the engine's own
log = logging.getLogger("uvicorn.error")  # uvicorn's: it follows --log-level


class RequestFailed(RuntimeError):
    """The engine ended this request with an error (its step failed, or its own sampling); the message says why."""


class _ClientGone(Exception):
    """The client closed the connection (or the edge's deadline closed it) before its request was read."""


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


@dataclass
class ServerState:
    """What the routes share: the engine, metrics, the [server] settings, and the drain flag."""

    engine: AsyncEngine
    metrics: ServerMetrics
    model_name: str
    max_model_len: int
    vocab_size: int
    tokenizer: Any
    settings: ServerSettings = field(default_factory=ServerSettings)
    draining: bool = False
    in_flight: int = 0
    reading: int = 0  # requests reading their body or being tokenized
    connections: int = 0  # open HTTP connections
    started: float = 0.0

    def shown(self, text: str) -> str:
        """An error's text as a client sees it: paths cut to their names, unless --debug."""
        return text if self.settings.debug else redact(text)

    def internal(self, e: BaseException, what: str) -> str:
        """Log an unexpected exception with its traceback; the message a client gets (the text only with --debug)."""
        log.error("%s: %s: %s", what, type(e).__name__, e, exc_info=e)
        if self.settings.debug:
            return f"{what}: {type(e).__name__}: {e}\n{''.join(traceback.format_exception(e))}"
        return f"{what}: an internal error (the server log has the details)"


class _CountStatus:
    """ASGI middleware counting answered requests by endpoint and HTTP status."""

    def __init__(self, app: Any, metrics: ServerMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500  # what uvicorn answers an app that sent nothing

        async def send_counting(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_counting)
        finally:
            status = scope.get(REFUSED, status)  # the edge answered it (a deadline), the app saw a disconnect
            path = scope.get("path", "")
            self.metrics.count_request(path if path in ENDPOINTS else "other", status)


class _EventStream(StreamingResponse):
    """A streaming response that always runs its cleanup, even when the client left before the first byte."""

    def __init__(self, body: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(body, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


def sse(obj: Any) -> str:
    """One server-sent event carrying JSON."""
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


class _Generation:
    """One request's life in the server: engine outputs -> text deltas, timing metrics, cleanup."""

    def __init__(self, state: ServerState, req: GenerationRequest, arrival: float) -> None:
        self.state, self.req, self.arrival = state, req, arrival
        self.detok = Detokenizer(state.tokenizer, req.stop)
        self.token_ids: list[int] = []
        self.prompt_tokens = len(req.prompt_token_ids)
        self.cached_tokens = 0  # of the prompt, found in the engine's prefix cache
        self.last_t: float | None = None
        self.finish_reason: str | None = None
        self.closed = False

    def consume(self, out: Any) -> tuple[str, list[int]]:
        """Apply one RequestOutput: (text delta, new token ids); sets finish_reason when it ends."""
        now = time.perf_counter()
        new = list(out.new_token_ids)
        if new:
            if self.last_t is None:
                self.state.metrics.ttft.observe(now - self.arrival)
            else:
                self.state.metrics.observe_tokens(now - self.last_t, len(new))
            self.last_t = now
        self.token_ids += new
        self.cached_tokens = max(self.cached_tokens, out.cached_tokens)
        if out.finished and out.finish_reason == "error":
            self.finish_reason = "error"
            raise RequestFailed(f"the request failed in the engine: {self.state.shown(out.error or '')}")
        text = self.detok.push(new, final=out.finished)
        if out.finished:
            self.finish_reason = out.finish_reason or "stop"
            self.prompt_tokens = out.prompt_tokens or self.prompt_tokens
        elif self.detok.stopped:  # a stop string: end the request here
            self.state.engine.abort(self.req.request_id)
            self.finish_reason = "stop"
        return text, new

    def close(self) -> None:
        """Once: abort the request if it did not finish, record it, release the in-flight slot."""
        if self.closed:
            return
        self.closed = True
        if self.finish_reason is None:
            self.state.engine.abort(self.req.request_id)
        self.state.metrics.observe_finished(self.finish_reason or "abort", time.perf_counter() - self.arrival,
                                            self.prompt_tokens, len(self.token_ids))
        self.state.in_flight -= 1


def _failure(gen: _Generation, e: Exception) -> APIError:
    """The 500 ending a failed request: the engine's message, or (its own failure) an internal error logged."""
    gen.finish_reason = "error"
    engine = isinstance(e, (EngineDeadError, EngineLoopError, RequestFailed))
    return APIError(500, gen.state.shown(str(e)) if engine else gen.state.internal(e, "the request failed"),
                    "server_error")


async def _next(q: asyncio.Queue) -> Any:
    """The next output, re-raising an engine failure."""
    item = await q.get()
    if isinstance(item, BaseException):
        raise item
    return item


async def _stream(gen: _Generation, q: asyncio.Queue) -> AsyncIterator[str]:
    """Server-sent events of one request: chunks, (usage), [DONE]."""
    first = True
    try:
        while gen.finish_reason is None:
            out = await _next(q)
            text, new = gen.consume(out)
            if text or new or gen.finish_reason is not None:
                yield sse(chunk(gen.req, text, new, gen.finish_reason, role=first))
                first = False
        if gen.req.include_usage:
            yield sse(make_usage_chunk(gen.req, gen.prompt_tokens, len(gen.token_ids), gen.cached_tokens))
    except Exception as e:  # noqa: BLE001 - the engine's failure, or this request's own: it alone ends
        yield sse(_failure(gen, e).body())
    finally:
        gen.close()
    yield "data: [DONE]\n\n"


async def _collect(gen: _Generation, q: asyncio.Queue, request: Request) -> dict[str, Any] | None:
    """Wait for the whole generation; None when the client disconnected first (the request is aborted)."""
    getter: asyncio.Future | None = None
    check_at = time.monotonic() + DISCONNECT_POLL_S
    try:
        while gen.finish_reason is None:
            if getter is None:
                getter = asyncio.ensure_future(_next(q))
            done, _ = await asyncio.wait({getter}, timeout=max(0.0, check_at - time.monotonic()))
            if done:
                out, getter = getter.result(), None
                gen.consume(out)
            if time.monotonic() >= check_at:
                if await request.is_disconnected():
                    return None
                check_at = time.monotonic() + DISCONNECT_POLL_S
        return response(gen.req, gen.detok.text(), gen.token_ids, gen.finish_reason, gen.prompt_tokens,
                        gen.cached_tokens)
    except APIError:
        raise
    except Exception as e:  # noqa: BLE001 - the engine's failure, or this request's own: a 500 for it alone
        raise _failure(gen, e) from None
    finally:
        if getter is not None:
            getter.cancel()
        gen.close()


async def _read_body(request: Request, limit: int) -> bytes:
    """The request body, or 413 as soon as it exceeds `limit` bytes (nothing more is read)."""
    too_large = APIError(413, f"the request body exceeds the {limit} bytes this server takes",
                         "invalid_request_error", None, "request_too_large")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large
    parts, size = [], 0
    try:
        async for part in request.stream():
            size += len(part)
            if size > limit:
                raise too_large
            parts.append(part)
    except ClientDisconnect:
        raise _ClientGone from None
    return b"".join(parts)


def _overloaded(message: str, code: str) -> APIError:
    """A 429 telling the client when to retry."""
    return APIError(429, message, "rate_limit_error", code=code, headers={"retry-after": str(RETRY_AFTER_S)})


def _refusal(state: ServerState, e: Exception) -> APIError:
    """The answer to a request refused before it ran: 429 (queue full), 503 (engine stopped), else 400."""
    if isinstance(e, QueueFullError):
        return _overloaded(f"the server is at capacity ({e}); retry later", "queue_full")
    if isinstance(e, EngineDeadError):
        return APIError(503, state.shown(str(e)), "server_error")
    return e if isinstance(e, APIError) else bad(str(e))


def _json(raw: bytes) -> Any:
    """Strict JSON: UTF-8, no NaN / Infinity, bounded nesting; 400 otherwise."""
    try:
        return json.loads(raw.decode("utf-8"), parse_constant=_reject_constant)
    except UnicodeDecodeError as e:
        raise bad(f"the request body is not valid UTF-8 (byte {e.start})") from None
    except RecursionError:
        raise bad("the request body is nested too deeply") from None
    except ValueError as e:  # JSONDecodeError included
        raise bad(f"the request body is not valid JSON: {e}") from None


def create_app(engine: LLMEngine | EngineProcess, settings: ServerSettings | None = None) -> FastAPI:
    """The FastAPI app serving an LLMEngine (on a thread of this process) or an EngineProcess, under `settings`."""
    aengine = engine if isinstance(engine, EngineProcess) else AsyncEngine(engine)
    tok = engine.tokenizer
    settings = settings or ServerSettings()
    state = ServerState(engine=aengine, metrics=ServerMetrics(), model_name=settings.served_model_name or
                        engine.model_name, max_model_len=int(engine.max_model_len),
                        vocab_size=int(getattr(engine, "vocab_size", None) or tok.get_vocab_size()), tokenizer=tok,
                        settings=settings)
    state.metrics = ServerMetrics(lambda: (aengine.snapshot, state.in_flight, state.draining,
                                           (state.connections, state.reading, aengine.open_requests)),
                                  engine_cpu=(lambda: aengine.engine_cpu_seconds)
                                  if isinstance(aengine, EngineProcess) else None)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.started = time.time()
        aengine.start()
        try:
            yield
        finally:
            aengine.stop()

    app = FastAPI(title="tiergram", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.tiergram = state
    app.add_middleware(Guard, settings=settings)  # (the last added runs first: count, CORS, then the guard)
    if settings.cors_origins:  # a browser's preflight is answered before the guard asks for a key
        app.add_middleware(CORSMiddleware, allow_origins=list(settings.cors_origins), allow_methods=["GET", "POST"],
                           allow_headers=["authorization", "content-type"])
    app.add_middleware(_CountStatus, metrics=state.metrics)

    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(_ClientGone)
    async def client_gone(request: Request, _: _ClientGone) -> Response:
        return Response(status_code=request.scope.get(REFUSED, 499))  # nobody reads it; counted as what it was

    @app.exception_handler(Exception)
    async def unexpected(_: Request, e: Exception) -> JSONResponse:
        return JSONResponse(APIError(500, state.internal(e, "the request failed"), "server_error").body(), 500)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        code = "not_found" if e.status_code == 404 else None
        return JSONResponse(APIError(e.status_code, str(e.detail), "invalid_request_error", None, code).body(),
                            status_code=e.status_code)

    @app.get("/health")
    async def health() -> JSONResponse:
        if not aengine.alive:
            return JSONResponse({"status": "error", "error": state.shown(str(aengine.error or "the engine stopped"))},
                                status_code=503)
        if state.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        m = aengine.snapshot
        unhealthy = m.consecutive_faults >= settings.unhealthy_after  # every step fails: a fault that does not go away
        return JSONResponse({"status": "unhealthy" if unhealthy else "ok", "model": state.model_name,
                             "max_model_len": state.max_model_len, "kv_blocks_total": m.kv_blocks_total,
                             "num_running": m.num_running, "num_waiting": m.num_waiting, "faults": m.faults,
                             "consecutive_faults": m.consecutive_faults,
                             "last_fault": m.last_fault and state.shown(m.last_fault),
                             "failed_requests": m.failed_requests}, status_code=503 if unhealthy else 200)

    @app.get("/openapi.json")
    async def openapi() -> JSONResponse:
        return JSONResponse(openapi_schema(state.model_name, state.max_model_len, state.vocab_size, settings))

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": int(state.started),
                                            "owned_by": "tiergram", "max_model_len": state.max_model_len}]}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    async def generate(kind: str, request: Request) -> Response:
        arrival = time.perf_counter()
        if state.draining:
            raise APIError(503, "the server is shutting down and accepts no new requests", "server_error",
                           code="draining")
        try:
            aengine.check_capacity()  # a request that will get 429 costs nothing: not even its body is parsed
            if state.reading >= settings.max_reading:  # bodies held in memory, prompts waiting for a tokenizer
                raise _overloaded(f"{state.reading} requests are being read or tokenized, this server's limit; "
                                  "retry later", "too_many_reading")
        except (QueueFullError, APIError) as e:
            state.metrics.finished.labels(reason="rejected").inc()
            raise _refusal(state, e) from None
        state.reading += 1
        try:
            body = _json(await _read_body(request, settings.max_body_bytes))
            req = validate_request(kind, body, model_name=state.model_name, max_model_len=state.max_model_len,
                                   vocab_size=state.vocab_size, limits=settings)
            if req.prompt_text is not None:
                run = partial(tokenize, req, tok, max_model_len=state.max_model_len, vocab_size=state.vocab_size)
                if len(req.prompt_text) > INLINE_TOKENIZE_CHARS:  # a long prompt would hold up every other request
                    await asyncio.to_thread(run)
                else:
                    run()
        finally:
            state.reading -= 1
        state.in_flight += 1
        gen = _Generation(state, req, arrival)
        try:
            q = await aengine.add(req.request_id, req.prompt_token_ids, req.params)
        except (QueueFullError, ValueError, EngineDeadError) as e:
            gen.finish_reason = "rejected"  # the engine never took it: not in the latency histograms
            gen.close()
            raise _refusal(state, e) from None
        except BaseException:
            gen.finish_reason = "abort"
            gen.close()
            raise
        if req.stream:
            return _EventStream(_stream(gen, q), gen.close)
        result = await _collect(gen, q, request)
        if result is None:
            return Response(status_code=499)  # client closed the request (nobody reads this)
        return JSONResponse(result)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generate("completion", request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generate("chat", request)

    return app


# ------------------------------------------------------------------------------------------- running it

class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose first SIGTERM drains (503 to new requests, in-flight ones finish) then exits 0."""

    def __init__(self, config: Any, state: ServerState, drain_timeout_s: float) -> None:
        super().__init__(config)
        self.state, self.drain_timeout_s = state, drain_timeout_s

    def handle_exit(self, sig: int, frame: Any) -> None:
        if sig == signal.SIGTERM and not self.state.draining and not self.should_exit:
            self.state.draining = True
            threading.Thread(target=self._drain, name="tiergram-drain", daemon=True).start()
            return
        super().handle_exit(sig, frame)

    def _drain(self) -> None:
        deadline = time.monotonic() + self.drain_timeout_s
        while self.state.in_flight > 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        self.should_exit = True


def uvicorn_config(app: FastAPI, **kw: Any) -> uvicorn.Config:
    """uvicorn's Config for an app of create_app's: its own h11 protocol keeps the edge's deadlines and caps."""
    return uvicorn.Config(app, http=edge_protocol(app.state.tiergram), lifespan="on", **kw)


def open_files_for(max_connections: int) -> int:
    """Raise the open-file limit to hold max_connections + FD_RESERVE; the connections it holds then."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = max_connections + FD_RESERVE
    if soft != resource.RLIM_INFINITY and soft < want:
        soft = want if hard == resource.RLIM_INFINITY else min(want, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    return max_connections if soft == resource.RLIM_INFINITY else max(1, min(max_connections, soft - FD_RESERVE))


@contextmanager
def serve_in_thread(app: FastAPI, *, start_timeout_s: float = 60.0) -> Iterator[str]:
    """Serve an app on a free loopback port in a daemon thread; yields its base URL (the engine is the caller's)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)  # so asyncio sets TCP_NODELAY
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn_config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + start_timeout_s
        while not server.started:
            if time.monotonic() > deadline or not thread.is_alive():
                raise RuntimeError(f"the in-process server did not start within {start_timeout_s:.0f} s")
            time.sleep(0.02)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def serve(engine: LLMEngine | EngineProcess, settings: ServerSettings | None = None) -> int:
    """Serve until SIGTERM (drain, then exit) or Ctrl-C, as the [server] settings say (docs/serving.md)."""
    settings = settings or ServerSettings()
    settings, host = settings.for_bind(settings.host), settings.host
    held = open_files_for(settings.max_connections)
    if held < settings.max_connections:
        print(f"tiergram serve: the open-file limit holds {held} connections, not max_connections "
              f"{settings.max_connections}", file=sys.stderr, flush=True)
        settings = replace(settings, max_connections=held)
    app = create_app(engine, settings)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto IPPROTO_TCP (not 0): asyncio only sets TCP_NODELAY on such sockets, and without it Nagle holds
    # each streamed chunk for the client's delayed ACK (~40 ms) on keep-alive connections
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, settings.port))
    sock.listen(2048)  # connections queue from now on, answered once the app has started
    config = uvicorn_config(app, log_level=settings.log_level, timeout_keep_alive=30)
    server = DrainingServer(config, app.state.tiergram, settings.drain_timeout)
    shown = f"[{host}]" if family == socket.AF_INET6 else host
    print(f"tiergram serve: {app.state.tiergram.model_name} on http://{shown}:{sock.getsockname()[1]}", flush=True)
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:
        return 130
    finally:
        sock.close()
        engine.close()
    sys.stdout.flush()
    return 0
