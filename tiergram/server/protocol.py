"""OpenAI-compatible request validation and /openapi.json (both from request_fields), chat template, responses."""

from __future__ import annotations

import re
import time
import uuid
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

from tiergram.engine import SamplingParams
from tiergram.engine.validate import RequestError, check_max_tokens, check_prompt
from tiergram.settings import ServerSettings

# The chat template: each message as "<Role>: content" and a blank line, then "Assistant:" to continue.
CHAT_ROLES = {"system": "System", "user": "User", "assistant": "Assistant"}


class APIError(Exception):
    """An error answered with an HTTP status and the OpenAI error object (and `headers`, e.g. Retry-After)."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        # a value echoed from the request may hold a lone surrogate, which no UTF-8 encoder takes: escape it
        message, param = (t and t.encode("utf-8", "backslashreplace").decode("utf-8") for t in (message, param))
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        """The JSON error object."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


_PATH = re.compile(r"(?<![\w.~])(?:/[^\s/'\"():,]+)+/([^\s/'\"():,]+)")


def redact(text: str) -> str:
    """An error message for a client: each absolute path cut to its last name (the log keeps the whole text)."""
    return _PATH.sub(r"\1", text)


def bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """A 400 invalid_request_error."""
    return APIError(400, message, "invalid_request_error", param, code)


@dataclass
class GenerationRequest:
    """A validated completion or chat request: token ids in, sampling parameters, response options."""

    kind: str  # "completion" | "chat"
    model: str
    prompt_token_ids: list[int]
    params: SamplingParams
    stream: bool = False
    include_usage: bool = False
    stop: list[str] = field(default_factory=list)
    request_id: str = ""
    created: int = 0
    prompt_text: str | None = None  # set until tokenize() turns it into prompt_token_ids
    max_tokens: int | None = None  # as asked for (None: the default, known once the prompt length is)
    length_param: str = "max_tokens"  # the field max_tokens came from: max_completion_tokens, forced_tokens


def render_chat(messages: list[dict[str, Any]]) -> str:
    """The chat template: "System: ...\\n\\nUser: ...\\n\\nAssistant:" (the model continues after it)."""
    # a message's content is a string, or OpenAI's list of {"type": "text", "text": ...} parts, joined
    parts = [f"{CHAT_ROLES[m['role']]}: " + (m["content"] if isinstance(m["content"], str) else
                                             "".join(part["text"] for part in m["content"])) for m in messages]
    return "\n\n".join(parts) + "\n\nAssistant:"


# Request fields each endpoint knows; anything else is refused (400) rather than silently ignored.
COMMON_FIELDS = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids",
                 "ignore_eos", "stream", "stream_options", "forced_tokens", "n", "logprobs", "presence_penalty",
                 "frequency_penalty", "user", "logit_bias"}
FIELDS = {"completion": COMMON_FIELDS | {"prompt", "prompt_token_ids", "best_of", "echo", "suffix"},
          "chat": COMMON_FIELDS | {"messages", "max_completion_tokens", "top_logprobs"}}
MESSAGE_FIELDS = {"role", "content", "name"}
BOOLEAN = {"type": "boolean", "default": False}
TYPES = {"integer": int, "number": (int, float), "boolean": bool, "string": str, "array": list, "object": dict}


def _text(value: str, param: str) -> str:
    """A string that is valid Unicode (a lone surrogate from a JSON escape is refused, not sent to the tokenizer)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise bad(f"'{param}' is not valid UTF-8 text (it holds a lone surrogate)", param) from None
    return value


def request_fields(max_model_len: int, vocab_size: int, limits: ServerSettings) -> dict[str, dict[str, Any]]:
    """Each request field's JSON schema (but the prompt's): what validate_request enforces, /openapi.json publishes."""
    tokens = {"type": "integer", "minimum": 1, "maximum": max_model_len}
    ids = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": vocab_size - 1}}
    stop = {"type": "string", "minLength": 1, "maxLength": limits.max_stop_chars}
    return {
        "model": {"type": "string"}, "user": {"type": "string"}, "max_tokens": tokens, "max_completion_tokens": tokens,
        "temperature": {"type": "number", "minimum": 0, "maximum": limits.max_temperature, "default": 1.0},
        "top_p": {"type": "number", "exclusiveMinimum": True, "minimum": 0, "maximum": 1, "default": 1.0},
        "top_k": {"type": "integer", "minimum": 0, "maximum": vocab_size, "default": 0},
        "seed": {"type": "integer", "minimum": -(2**63), "maximum": 2**63 - 1},
        "ignore_eos": BOOLEAN, "stream": BOOLEAN,
        "stop": {"type": "array", "maxItems": limits.max_stop, "items": stop, "default": []},  # or one string
        "stop_token_ids": {**ids, "maxItems": limits.max_stop_token_ids, "default": []},
        "forced_tokens": {**ids, "minItems": 1, "maxItems": max_model_len - 1},
        "messages": {"type": "array", "minItems": 1, "maxItems": limits.max_messages, "items": {"type": "object"}},
        "stream_options": {"type": "object", "additionalProperties": False, "default": {},
                           "properties": {"include_usage": {**BOOLEAN, "nullable": True}}},
        # OpenAI options this server does not implement: refused unless neutral, rather than ignored
        "n": {"type": "integer", "enum": [1]}, "best_of": {"type": "integer", "enum": [1]},
        "echo": {"type": "boolean", "enum": [False]}, "logprobs": {"type": "boolean", "enum": [False]},
        "presence_penalty": {"type": "number", "enum": [0]}, "frequency_penalty": {"type": "number", "enum": [0]},
    }


def _field(body: dict[str, Any], name: str, schema: dict[str, Any]) -> Any:
    """body[name] checked against its schema (absent or null: the schema's default)."""
    value = body.get(name)
    return schema.get("default") if value is None else _check(value, name, schema)


def _check(value: Any, name: str, schema: dict[str, Any]) -> Any:
    """A value checked against its JSON schema: type, enum, range, length (a list's before its items), items."""
    kind = schema["type"]
    if not isinstance(value, TYPES[kind]) or isinstance(value, bool) != (kind == "boolean"):
        raise bad(f"'{name}' must be of type {kind}, got {type(value).__name__}", name)
    if kind == "number":
        try:
            value = float(value)
        except OverflowError:  # an integer of hundreds of digits
            raise bad(f"'{name}' is an integer too large for a number", name) from None
    unknown = sorted(set(value) - set(schema["properties"])) if schema.get("additionalProperties") is False else []
    if unknown:
        raise bad(f"'{name}' has unknown field '{unknown[0]}'", name)
    if value not in schema.get("enum", [value]):
        raise bad(f"'{name}' is not supported (only {schema['enum'][0]})", name)
    if "minimum" in schema:
        lo, hi, open_lo = schema["minimum"], schema["maximum"], schema.get("exclusiveMinimum", False)
        if not (lo < value if open_lo else lo <= value) or value > hi:
            raise bad(f"'{name}' must lie in {'(' if open_lo else '['}{lo}, {hi}], got {value!r}", name)
    if kind in ("string", "array"):
        lo, hi = schema.get("minLength", schema.get("minItems", 0)), schema.get("maxLength", schema.get("maxItems"))
        if len(value) < lo or hi is not None and len(value) > hi:
            code = "context_length_exceeded" if name in ("prompt", "prompt_token_ids") else None
            raise bad(f"'{name}' has length {len(value)}, not within [{lo}, {hi}]", name, code)
    if kind == "array":
        for item in value:
            _check(item, name, schema["items"])
    return value


def _completion_prompt(body: dict[str, Any], max_model_len: int) -> str | list[int]:
    """The completion prompt: text to tokenize, or token ids (prompt_token_ids, a list of ids, a batch of one)."""
    ids = {"type": "array", "items": {"type": "integer"}, "maxItems": max_model_len}  # the range: check_prompt's
    if body.get("prompt_token_ids") is not None:
        if body.get("prompt") is not None:
            raise bad("give 'prompt' or 'prompt_token_ids', not both", "prompt_token_ids")
        return _check(body["prompt_token_ids"], "prompt_token_ids", ids)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return _text(prompt, "prompt")
    if isinstance(prompt, list):
        return _check(prompt, "prompt", ids)
    raise bad("'prompt' is required" if prompt is None else
              "'prompt' must be a string, a list of token ids, or a batch of one of them", "prompt")


def _chat_prompt(messages: list[dict[str, Any]] | None) -> str:
    """The chat messages (their number checked by request_fields' schema), checked, through the template."""
    if messages is None:
        raise bad("'messages' is required", "messages")
    for i, m in enumerate(messages):
        if m.get("role") not in CHAT_ROLES:
            raise bad(f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}", f"messages[{i}].role")
        unknown = sorted(set(m) - MESSAGE_FIELDS)
        if unknown:
            raise bad(f"messages[{i}] has unknown field '{unknown[0]}'", f"messages[{i}].{unknown[0]}")
        content = m.get("content")
        if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" and set(p) <=
                                             {"type", "text"} and isinstance(p.get("text"), str) for p in content):
            for p in content:
                _text(p["text"], f"messages[{i}].content")
        elif isinstance(content, str):
            _text(content, f"messages[{i}].content")
        else:
            raise bad(f"messages[{i}].content must be a string or a list of text parts", f"messages[{i}].content")
        if m.get("name") is not None and not isinstance(m["name"], str):
            raise bad(f"messages[{i}].name must be a string", f"messages[{i}].name")
    return render_chat(messages)


def _unsupported(kind: str, body: dict[str, Any]) -> None:
    """400 for unknown fields and for OpenAI options this server does not implement (rather than ignoring them)."""
    unknown = sorted(set(body) - FIELDS[kind])
    if unknown:
        raise bad(f"unknown field '{unknown[0]}'" + (f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else ""),
                  unknown[0])
    for name, neutral in (("top_logprobs", (None,)), ("logit_bias", (None, {})), ("suffix", (None, ""))):
        if body.get(name) not in neutral:
            raise bad(f"{name} is not supported", name)


def validate_request(kind: str, body: Any, *, model_name: str, max_model_len: int, vocab_size: int,
                     limits: ServerSettings | None = None) -> GenerationRequest:
    """Every check of a completion or chat body short of tokenizing (a text prompt waits in prompt_text)."""
    limits = limits or ServerSettings()
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    _unsupported(kind, body)
    if isinstance(body.get("stop"), str):  # one stop string
        body = {**body, "stop": [body["stop"]]}
    values = {name: _field(body, name, schema)
              for name, schema in request_fields(max_model_len, vocab_size, limits).items()}
    for s in values["stop"]:
        _text(s, "stop")
    model = body.get("model", model_name)
    if model is not None and model != model_name:
        raise APIError(404, f"The model '{model}' does not exist; this server serves '{model_name}'",
                       "invalid_request_error", "model", "model_not_found")
    prompt = _completion_prompt(body, max_model_len) if kind == "completion" else _chat_prompt(values["messages"])
    if isinstance(prompt, str) and len(prompt) > limits.prompt_chars(max_model_len):
        raise bad(f"the prompt has {len(prompt)} characters, more than the {limits.prompt_chars(max_model_len)} "
                  "this server takes", "messages" if kind == "chat" else "prompt", "context_length_exceeded")
    # the output length is checked with the prompt's length, in set_prompt; errors name the field it came from
    max_tokens, length_param = values["max_tokens"], "max_tokens"
    if values["max_completion_tokens"] is not None:
        max_tokens, length_param = values["max_completion_tokens"], "max_completion_tokens"
    forced = values["forced_tokens"]
    if forced is not None:
        max_tokens, length_param = len(forced), "forced_tokens"  # a replay produces exactly the forced tokens
    include_usage = _field(values["stream_options"], "include_usage", BOOLEAN)
    try:
        params = SamplingParams(max_tokens=1, temperature=values["temperature"], top_p=values["top_p"],
                                top_k=values["top_k"], seed=values["seed"], stop_token_ids=values["stop_token_ids"],
                                ignore_eos=values["ignore_eos"], forced_tokens=forced)
    except ValueError as e:
        raise bad(str(e)) from None
    prefix = "cmpl" if kind == "completion" else "chatcmpl"
    req = GenerationRequest(kind=kind, model=model_name, prompt_token_ids=[], params=params, stream=values["stream"],
                            include_usage=include_usage, stop=values["stop"], request_id=f"{prefix}-{uuid.uuid4().hex}",
                            created=int(time.time()), max_tokens=max_tokens, length_param=length_param)
    if isinstance(prompt, str):
        req.prompt_text = prompt
    else:
        field_name = "prompt_token_ids" if body.get("prompt_token_ids") is not None else "prompt"
        set_prompt(req, prompt, max_model_len=max_model_len, vocab_size=vocab_size, param=field_name)
    return req


def tokenize(req: GenerationRequest, tokenizer: Any, *, max_model_len: int, vocab_size: int) -> GenerationRequest:
    """Turn a text prompt into token ids and finish the length checks (may run off the event loop)."""
    if req.prompt_text is not None:
        ids = tokenizer.encode(req.prompt_text).ids
        req.prompt_text = None
        set_prompt(req, ids, max_model_len=max_model_len, vocab_size=vocab_size)
    return req


def set_prompt(req: GenerationRequest, ids: list[int], *, max_model_len: int, vocab_size: int,
               param: str | None = None) -> None:
    """Check the prompt and max_tokens against the context (engine.validate, as the engine checks them)."""
    param = param or ("messages" if req.kind == "chat" else "prompt")
    try:
        ids = check_prompt(ids, vocab_size=vocab_size, max_model_len=max_model_len, param=param)
        max_tokens, room = req.max_tokens, max_model_len - len(ids)
        if max_tokens is None:  # the default: 16 for a completion, the rest of the context for chat
            max_tokens = min(16, room) if req.kind == "completion" else room
        check_max_tokens(max_tokens, req.length_param, prompt_len=len(ids), max_model_len=max_model_len)
    except RequestError as e:
        raise bad(str(e), e.param, e.code) from None
    req.prompt_token_ids = list(ids)
    if req.params.forced_tokens is None:
        req.params.max_tokens = max_tokens


# ------------------------------------------------------------------------------------------------ responses

def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """The OpenAI usage object (cached_tokens: prompt tokens the prefix cache held)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def _object(req: GenerationRequest, choices: list[dict[str, Any]], streamed: bool, **extra: Any) -> dict[str, Any]:
    """A response object or streamed chunk around its choices (`extra`: the usage)."""
    obj = "text_completion" if req.kind == "completion" else "chat.completion.chunk" if streamed else "chat.completion"
    return {"id": req.request_id, "object": obj, "created": req.created, "model": req.model, "choices": choices,
            **extra}


def _choice(key: str, value: Any, token_ids: list[int], finish_reason: str | None) -> list[dict[str, Any]]:
    """The one choice: its text (`key` text, message or delta) and token ids."""
    return [{"index": 0, key: value, "logprobs": None, "finish_reason": finish_reason, "token_ids": token_ids}]


def response(req: GenerationRequest, text: str, token_ids: list[int], finish_reason: str | None,
             prompt_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """The complete (non-streamed) response object."""
    key, value = ("text", text) if req.kind == "completion" else ("message", {"role": "assistant", "content": text})
    return _object(req, _choice(key, value, token_ids, finish_reason), False,
                   usage=usage(prompt_tokens, len(token_ids), cached_tokens))


def chunk(req: GenerationRequest, text: str | None, token_ids: list[int], finish_reason: str | None,
          *, role: bool = False) -> dict[str, Any]:
    """One streamed chunk (text delta and its token ids; the finish reason on the last)."""
    if req.kind == "completion":
        return _object(req, _choice("text", text or "", token_ids, finish_reason), True)
    delta: dict[str, Any] = {"role": "assistant"} if role else {}
    if text:
        delta["content"] = text
    return _object(req, _choice("delta", delta, token_ids, finish_reason), True)


def usage_chunk(req: GenerationRequest, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0
                ) -> dict[str, Any]:
    """The last chunk of a stream with stream_options.include_usage: no choices, the usage."""
    return _object(req, [], True, usage=usage(prompt_tokens, completion_tokens, cached_tokens))


class Detokenizer:
    """Incremental text of generated ids: emits only complete characters and stops at a stop string."""

    def __init__(self, tokenizer: Any, stop: list[str]) -> None:
        self.tokenizer, self.stop = tokenizer, stop
        self.ids: list[int] = []
        self.sent = 0  # characters of the text already emitted
        self.stopped = False
        self.holdback = max((len(s) for s in stop), default=1) - 1

    def text(self) -> str:
        """The full decoded text so far (cut at a stop string once one is seen)."""
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        for s in self.stop:
            cut = text.find(s)
            if cut >= 0:
                self.stopped = True
                text = text[:cut]
        return text

    def push(self, ids: list[int], final: bool = False) -> str:
        """Add tokens; the new text that can be sent now (partial characters and stop prefixes held back)."""
        self.ids.extend(ids)
        text = self.text()
        end = len(text)
        if not (final or self.stopped):  # a partial character, and what may begin a stop string, wait
            end = max(self.sent, len(text.rstrip("\ufffd")) - self.holdback)
        delta = text[self.sent:end]
        self.sent = max(self.sent, end)
        return delta


# ------------------------------------------------------------------------------------------------ OpenAPI

JSON_OBJECT = {"content": {"application/json": {"schema": {"type": "object"}}}}


# when each is answered: docs/serving.md, "Errors"
ERROR_RESPONSES = {str(code): {"description": HTTPStatus(code).phrase, "content": {"application/json": {
    "schema": {"$ref": "#/components/schemas/Error"}}}} for code in (400, 401, 403, 404, 408, 413, 429, 500, 503)}


def openapi_schema(model_name: str, max_model_len: int, vocab_size: int, limits: ServerSettings | None = None
                   ) -> dict[str, Any]:
    """The OpenAPI document of this server for a model of this context and vocabulary, under these limits."""
    lim = limits or ServerSettings()
    chars = lim.prompt_chars(max_model_len)
    schemas = request_fields(max_model_len, vocab_size, lim)
    fields = {name: {**schema, "nullable": True} for name, schema in schemas.items()}
    fields |= {"model": {"type": "string", "enum": [model_name]},
               "stop": {"oneOf": [schemas["stop"]["items"], schemas["stop"]], "nullable": True},
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
                          **ERROR_RESPONSES}}}

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
