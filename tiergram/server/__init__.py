"""The OpenAI-compatible HTTP server (docs/serving.md)."""

from tiergram.server.app import ServerState, create_app, serve, serve_in_thread
from tiergram.server.async_engine import AsyncEngine, EngineDeadError
from tiergram.server.engine_process import EngineProcess, EngineStartError

__all__ = ["AsyncEngine", "EngineDeadError", "EngineProcess", "EngineStartError", "ServerState", "create_app", "serve",
           "serve_in_thread"]
