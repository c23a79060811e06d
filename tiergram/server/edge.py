"""The server's edge: connection deadlines and caps (an h11 protocol) and who may call (ASGI middleware)."""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Callable
from http import HTTPStatus
from typing import Any

import h11
from starlette.responses import Response
from uvicorn.protocols.http.h11_impl import H11Protocol

from tiergram.settings import ServerSettings, is_loopback

REFUSE_GRACE_S = 1.0  # a refused connection is read (and dropped) this long before closing, so the answer is not
# lost to a reset from the client's unread bytes
RETRY_AFTER_S = 1  # what a client refused for overload is told to wait
REFUSED = "tiergram.refused"  # scope key: the status the edge answered for a request whose app then saw a disconnect


def error_body(status: int, message: str, code: str) -> bytes:
    """An OpenAI-shaped error object as JSON bytes."""
    type_ = "server_error" if status >= 500 else "invalid_request_error"
    return json.dumps({"error": {"message": message, "type": type_, "param": None, "code": code}}).encode()


def edge_protocol(state: Any) -> type:
    """uvicorn's h11 protocol with the deadlines and connection cap of an app's ServerState (which counts them)."""
    settings: ServerSettings = state.settings

    class EdgeProtocol(H11Protocol):
        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            super().connection_made(transport)
            state.connections += 1
            self._deadline: Any = None
            self._phase: Any = None  # the h11 state the deadline was armed for
            self._refused = False
            if len(self.connections) > settings.max_connections:
                self._refuse(503, f"the server holds {settings.max_connections} connections, its limit; retry later",
                             "too_many_connections", (("retry-after", str(RETRY_AFTER_S)),))
                return
            self._arm(h11.IDLE)

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel()
            state.connections -= 1
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self._refused:
                return  # read and dropped until the connection closes
            super().data_received(data)
            self._track()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._track()

        def _track(self) -> None:
            """Keep the deadline of the phase the request is in: its headers, its body, or none (the app has it)."""
            if self._refused or self.transport.is_closing():
                return
            state = self.conn.their_state
            if state is h11.IDLE and self.conn.trailing_data[0]:  # the next request's first bytes: its deadline
                self._unset_keepalive_if_required()
            elif state is h11.IDLE and self.timeout_keep_alive_task is not None:
                state = None  # between requests: the keep-alive timeout holds the connection, not a deadline
            if state in (h11.IDLE, h11.SEND_BODY):
                if self._phase is not state:
                    self._arm(state)
            else:
                self._cancel()

        def _arm(self, state: Any) -> None:
            self._cancel()
            self._phase = state
            delay = settings.header_timeout if state is h11.IDLE else settings.body_timeout
            self._deadline = self.loop.call_later(delay, self._expired)

        def _cancel(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
            self._deadline, self._phase = None, None

        def _expired(self) -> None:
            self._deadline = None
            if self._refused or self.transport.is_closing():
                return
            if self._phase is h11.SEND_BODY and self.cycle.response_started:  # answered, the body never came: close
                self.transport.close()
                return
            what = "headers" if self._phase is h11.IDLE else "body"
            limit = settings.header_timeout if self._phase is h11.IDLE else settings.body_timeout
            self._refuse(408, f"the request's {what} did not arrive within {limit:g} s", "request_timeout")

        def _refuse(self, status: int, message: str, code: str, headers: tuple[tuple[str, str], ...] = ()) -> None:
            """Answer `status` past h11, stop listening to the client, close after a grace."""
            self._refused = True
            self._cancel()
            if self.cycle is not None and not self.cycle.response_complete:  # the app waits for a body: release it
                self.cycle.scope[REFUSED] = status  # type: ignore[literal-required]
                self.cycle.disconnected = True
                self.cycle.message_event.set()
            else:
                state.metrics.count_request("other", status)  # no app saw it: count it here
            body = error_body(status, message, code)  # a whole response closing the connection, past h11
            lines = [f"HTTP/1.1 {status} {HTTPStatus(status).phrase}", "content-type: application/json",
                     f"content-length: {len(body)}", "connection: close", *(f"{k}: {v}" for k, v in headers)]
            self.transport.write(("\r\n".join(lines) + "\r\n\r\n").encode() + body)
            if self.transport.can_write_eof():
                self.transport.write_eof()
            self.loop.call_later(REFUSE_GRACE_S, self.transport.close)

    return EdgeProtocol


# ------------------------------------------------------------------------------------------------ who may call

def _host_name(value: str) -> str:
    """The name of a Host header or an origin's authority, without port or brackets."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1:value.find("]")] if "]" in value else value
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


def _digest(text: str | bytes) -> bytes:
    return hashlib.sha256(text.encode("utf-8", "surrogateescape") if isinstance(text, str) else text).digest()


class Guard:
    """ASGI middleware: an allowed Host (no DNS rebinding) and Origin, and the API key off the public paths."""

    def __init__(self, app: Any, settings: ServerSettings) -> None:
        self.app, self.settings = app, settings
        self.key = _digest(settings.api_key) if settings.api_key else None

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        refusal = self.check(scope) if scope["type"] == "http" else None
        if refusal is None:
            await self.app(scope, receive, send)
        else:
            status, message, code, headers = refusal
            await Response(error_body(status, message, code), status, headers, "application/json")(scope, receive, send)

    def check(self, scope: dict) -> tuple[int, str, str, dict[str, str]] | None:
        """(status, message, code, headers) of a refusal, or None when the request may go on."""
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        host = headers.get("host", "")
        if not self.host_allowed(host):
            return 400, "the Host header names no host this server answers to (--allowed-hosts)", "invalid_host", {}
        origin = headers.get("origin")
        if origin is not None and not self.origin_allowed(origin, host):
            return 403, "requests from this origin are not allowed (--cors-origins)", "origin_not_allowed", {}
        if self.key is not None and scope["path"] not in self.settings.public_paths:
            scheme, _, token = headers.get("authorization", "").partition(" ")
            if not (scheme.lower() == "bearer" and hmac.compare_digest(_digest(token.strip()), self.key)):
                return 401, "a valid API key is needed (Authorization: Bearer KEY)", "invalid_api_key", \
                    {"www-authenticate": "Bearer"}
        return None

    def host_allowed(self, host: str) -> bool:
        allowed, name = self.settings.allowed_hosts, _host_name(host)
        if allowed is not None and "*" in allowed:
            return True
        return bool(name) and (is_loopback(name) if allowed is None else name in {_host_name(h) for h in allowed})

    def origin_allowed(self, origin: str, host: str) -> bool:
        cors = self.settings.cors_origins
        if "*" in cors or origin in cors:
            return True
        authority = origin.partition("://")[2]
        return bool(authority) and authority.lower() == host.strip().lower()  # same origin
