"""The server's OpenAPI 3.0 schema, written out from the same limits the request parser enforces (served at
/openapi.json; the API fuzzing test and `tiergram bench soak` drive schemathesis with it)."""

from __future__ import annotations

from http import HTTPStatus
from typing import Any

from tiergram.server.protocol import CHAT_ROLES, FIELDS, request_fields
from tiergram.settings import ServerSettings

JSON_OBJECT = {"content": {"application/json": {"schema": {"type": "object"}}}}


def _error_responses() -> dict[str, Any]:
    ref = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
    return {str(code): {"description": HTTPStatus(code).phrase, **ref}  # when: docs/serving.md, "Errors"
            for code in (400, 401, 403, 404, 408, 413, 429, 500, 503)}


def openapi_schema(model_name: str, max_model_len: int, vocab_size: int, limits: ServerSettings | None = None
                   ) -> dict[str, Any]:
    """The OpenAPI document of this server for a model of this context and vocabulary, under these limits."""
    lim = limits or ServerSettings()
    chars = lim.prompt_chars(max_model_len)
    schemas = request_fields(max_model_len, vocab_size, lim)
    fields = {name: {**schema, "nullable": True} for name, schema in schemas.items()}
    fields |= {"model": {"type": "string", "enum": [model_name]},
               "stop": {"oneOf": [schemas["stop"]["items"], schemas["stop"]], "nullable": True},
               "stream_options": {"type": "object", "nullable": True, "additionalProperties": False,
                                  "properties": {"include_usage": {"type": "boolean", "nullable": True}}},
               "prompt": {"oneOf": [{"type": "string", "minLength": 1, "maxLength": chars}, schemas["forced_tokens"]]}}
    completion = {"type": "object", "additionalProperties": False, "required": ["prompt"],
                  "properties": {k: v for k, v in fields.items() if k in FIELDS["completion"]}}
    message = {"type": "object", "additionalProperties": False, "required": ["role", "content"],
               "properties": {"role": {"type": "string", "enum": list(CHAT_ROLES)},
                              "content": {"type": "string", "maxLength": chars},
                              "name": {"type": "string", "nullable": True}}}
    fields["messages"] = {**schemas["messages"], "items": message}
    chat = {"type": "object", "additionalProperties": False, "required": ["messages"],
            "properties": {k: v for k, v in fields.items() if k in FIELDS["chat"]}}
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
