"""The server's OpenAPI 3.0 schema, written out from the same limits the request parser enforces (served at
/openapi.json; the API fuzzing test and `tiergram bench soak` drive schemathesis with it)."""

from __future__ import annotations

from typing import Any

from tiergram.server.protocol import CHAT_ROLES
from tiergram.settings import ServerSettings

INT64 = {"type": "integer", "minimum": -(2**63), "maximum": 2**63 - 1}
JSON_OBJECT = {"content": {"application/json": {"schema": {"type": "object"}}}}


def _ids(max_items: int, vocab_size: int, min_items: int = 0) -> dict[str, Any]:
    return {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": vocab_size - 1},
            "minItems": min_items, "maxItems": max_items}


def _error_responses() -> dict[str, Any]:
    ref = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
    return {str(code): {"description": what, **ref} for code, what in (
        (400, "invalid request: a field, a limit, the prompt's length, a Host not allowed"),
        (401, "an API key is needed (serve --api-key)"), (403, "a browser request from an origin not allowed"),
        (404, "unknown model"), (408, "the request's headers or body did not arrive in time"),
        (413, "the request body is too large"),
        (429, "the waiting queue is full, or too many requests are being read (Retry-After)"),
        (500, "the request failed in the engine (a table read, its sampling)"),
        (503, "draining, too many connections (Retry-After), or the engine stopped"))}


def openapi_schema(model_name: str, max_model_len: int, vocab_size: int, limits: ServerSettings | None = None
                   ) -> dict[str, Any]:
    """The OpenAPI document of this server for a model of this context and vocabulary, under these limits."""
    lim = limits or ServerSettings()
    chars = lim.prompt_chars(max_model_len)
    stop = {"oneOf": [{"type": "string", "minLength": 1, "maxLength": lim.max_stop_chars},
                      {"type": "array", "maxItems": lim.max_stop,
                       "items": {"type": "string", "minLength": 1, "maxLength": lim.max_stop_chars}}],
            "nullable": True}
    common = {
        "model": {"type": "string", "enum": [model_name]},
        "max_tokens": {"type": "integer", "minimum": 1, "maximum": max_model_len, "nullable": True},
        "temperature": {"type": "number", "minimum": 0, "maximum": lim.max_temperature, "nullable": True},
        "top_p": {"type": "number", "exclusiveMinimum": True, "minimum": 0, "maximum": 1, "nullable": True},
        "top_k": {"type": "integer", "minimum": 0, "maximum": vocab_size, "nullable": True},
        "seed": {**INT64, "nullable": True},
        "stop": stop,
        "stop_token_ids": {**_ids(lim.max_stop_token_ids, vocab_size), "nullable": True},
        "ignore_eos": {"type": "boolean", "nullable": True},
        "stream": {"type": "boolean", "nullable": True},
        "stream_options": {"type": "object", "nullable": True, "additionalProperties": False,
                           "properties": {"include_usage": {"type": "boolean", "nullable": True}}},
        "forced_tokens": {**_ids(max_model_len - 1, vocab_size, 1), "nullable": True},
        "n": {"type": "integer", "enum": [1], "nullable": True},
        "logprobs": {"type": "boolean", "enum": [False], "nullable": True},
        "presence_penalty": {"type": "number", "enum": [0], "nullable": True},
        "frequency_penalty": {"type": "number", "enum": [0], "nullable": True},
        "user": {"type": "string", "nullable": True},
    }
    completion = {
        "type": "object", "additionalProperties": False, "required": ["prompt"],
        "properties": {**common,
                       "prompt": {"oneOf": [{"type": "string", "minLength": 1, "maxLength": chars},
                                            _ids(max_model_len - 1, vocab_size, 1)]},
                       "best_of": {"type": "integer", "enum": [1], "nullable": True},
                       "echo": {"type": "boolean", "enum": [False], "nullable": True}},
    }
    message = {"type": "object", "additionalProperties": False, "required": ["role", "content"],
               "properties": {"role": {"type": "string", "enum": list(CHAT_ROLES)},
                              "content": {"type": "string", "maxLength": chars},
                              "name": {"type": "string", "nullable": True}}}
    chat = {
        "type": "object", "additionalProperties": False, "required": ["messages"],
        "properties": {**common,
                       "messages": {"type": "array", "items": message, "minItems": 1, "maxItems": lim.max_messages},
                       "max_completion_tokens": {"type": "integer", "minimum": 1, "maximum": max_model_len,
                                                 "nullable": True}},
    }
    choice = {"type": "object", "required": ["index", "finish_reason"],
              "properties": {"index": {"type": "integer"}, "text": {"type": "string"},
                             "token_ids": {"type": "array", "items": {"type": "integer"}},
                             "finish_reason": {"type": "string", "nullable": True,
                                               "enum": ["stop", "length", None]}}}
    generated = {"type": "object", "required": ["id", "object", "created", "model", "choices"],
                 "properties": {"id": {"type": "string"}, "object": {"type": "string"},
                                "created": {"type": "integer"}, "model": {"type": "string"},
                                "choices": {"type": "array", "items": choice},
                                "usage": {"$ref": "#/components/schemas/Usage"}}}
    error = {"type": "object", "required": ["error"], "properties": {"error": {
        "type": "object", "required": ["message", "type", "param", "code"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": "string", "nullable": True}, "code": {"type": "string", "nullable": True}}}}}
    usage = {"type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
             "properties": {k: {"type": "integer", "minimum": 0}
                            for k in ("prompt_tokens", "completion_tokens", "total_tokens")}}

    def generation(schema: str, summary: str) -> dict[str, Any]:
        return {"post": {
            "summary": summary,
            "requestBody": {"required": True, "content": {"application/json": {
                "schema": {"$ref": f"#/components/schemas/{schema}"}}}},
            "responses": {"200": {"description": "the generation (server-sent events when stream is true)",
                                  "content": {"application/json": {"schema": {
                                      "$ref": "#/components/schemas/Generation"}},
                                      "text/event-stream": {"schema": {
                                          "type": "object", "required": ["data"],
                                          "properties": {"data": {"type": "string"}, "event": {"type": "string"}}}}}},
                          **_error_responses()}}}

    return {
        "openapi": "3.0.3",
        "info": {"title": "tiergram", "version": "1", "description": "OpenAI-compatible completions over an Engram "
                 "model (docs/serving.md)"},
        "paths": {
            "/v1/completions": generation("CompletionRequest", "text completion"),
            "/v1/chat/completions": generation("ChatRequest", "chat completion"),
            "/v1/models": {"get": {"summary": "the served model", "responses": {"200": {
                "description": "one model", **JSON_OBJECT}}}},
            "/health": {"get": {"summary": "liveness and fault counts", "responses": {
                "200": {"description": "serving", **JSON_OBJECT},
                "503": {"description": "draining, stopped, or every step failing", **JSON_OBJECT}}}},
            "/metrics": {"get": {"summary": "Prometheus metrics", "responses": {"200": {
                "description": "text exposition format", "content": {"text/plain": {"schema": {"type": "string"}}}}}}},
        },
        "components": {"schemas": {"CompletionRequest": completion, "ChatRequest": chat, "Generation": generated,
                                   "Error": error, "Usage": usage}},
    }
