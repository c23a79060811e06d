"""The OpenAI-compatible HTTP server (docs/serving.md)."""

from tiergram.server.app import ServerState, create_app, serve, serve_in_thread
from tiergram.server.async_engine import AsyncEngine, EngineDeadError

__all__ = ["AsyncEngine", "EngineDeadError", "ServerState", "create_app", "serve", "serve_in_thread"]
