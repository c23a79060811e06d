"""OpenAI-compatible request parsing and validation, the chat template, and response objects.

Request bodies are parsed by hand (not by pydantic) so every bad field gets an OpenAI-shaped error:
`{"error": {"message", "type", "param", "code"}}`. tiergram extensions in a request body:
  prompt_token_ids: [ids]   the prompt as token ids (completions; `prompt` may also be a list of ids)
  forced_tokens: [ids]      the output is these tokens, in order (replaying a trace); sampling resumes after
  top_k: int                sample among the k most likely tokens (0: all)
  stop_token_ids: [ids]     stop at any of these tokens
  ignore_eos: bool          do not stop at the end-of-text token
Responses carry `token_ids` in each choice (and each streamed chunk) besides the text.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from tiergram.engine import SamplingParams

# The chat template: each message as "<Role>: content" and a blank line, then "Assistant:" to continue.
CHAT_ROLES = {"system": "System", "user": "User", "assistant": "Assistant"}


class APIError(Exception):
    """An error answered with an HTTP status and the OpenAI error object."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict[str, Any]:
        """The JSON error object."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


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


def render_chat(messages: list[dict[str, str]]) -> str:
    """The chat template: "System: ...\\n\\nUser: ...\\n\\nAssistant:" (the model continues after it)."""
    parts = [f"{CHAT_ROLES[m['role']]}: {m['content']}" for m in messages]
    return "\n\n".join(parts) + "\n\nAssistant:"


def _int_list(value: Any, param: str) -> list[int]:
    """A list of non-negative ints, or a 400 naming the field."""
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise bad(f"'{param}' must be a list of integer token ids", param)
    if any(v < 0 for v in value):
        raise bad(f"'{param}' holds a negative token id", param)
    return value


def _number(body: dict[str, Any], name: str, default: float | None) -> float | None:
    """An optional number field."""
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad(f"'{name}' must be a number, got {value!r}", name)
    return float(value)


def _int(body: dict[str, Any], name: str, default: int | None) -> int | None:
    """An optional integer field."""
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad(f"'{name}' must be an integer, got {value!r}", name)
    return value


def _prompt_ids(body: dict[str, Any], tokenizer: Any) -> list[int]:
    """The completion prompt as token ids: prompt_token_ids, a list of ids, or a string."""
    if body.get("prompt_token_ids") is not None:
        return _int_list(body["prompt_token_ids"], "prompt_token_ids")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return tokenizer.encode(prompt).ids
    if isinstance(prompt, list):
        return _int_list(prompt, "prompt")
    if prompt is None:
        raise bad("'prompt' is required", "prompt")
    raise bad("'prompt' must be a string, a list of token ids, or a batch of one of them", "prompt")


def _chat_ids(body: dict[str, Any], tokenizer: Any) -> list[int]:
    """The chat messages through the template, as token ids."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("'messages' must be a non-empty list", "messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in CHAT_ROLES:
            raise bad(f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}", f"messages[{i}].role")
        if not isinstance(m.get("content"), str):
            raise bad(f"messages[{i}].content must be a string", f"messages[{i}].content")
    return tokenizer.encode(render_chat(messages)).ids


def _stop(body: dict[str, Any]) -> list[str]:
    """`stop`: null, a string, or a list of up to 4 non-empty strings."""
    stop = body.get("stop")
    if stop is None:
        return []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
        raise bad("'stop' must be a non-empty string or a list of up to 4 of them", "stop")
    return stop


def _unsupported(body: dict[str, Any]) -> None:
    """400 for OpenAI options this server does not implement (rather than silently ignoring them)."""
    if body.get("n", 1) != 1:
        raise bad("only n = 1 is supported", "n")
    if body.get("best_of", 1) not in (1, None):
        raise bad("best_of is not supported", "best_of")
    if body.get("echo"):
        raise bad("echo is not supported", "echo")
    if body.get("logprobs") not in (None, False) or body.get("top_logprobs") is not None:
        raise bad("logprobs are not supported", "logprobs")
    for name in ("presence_penalty", "frequency_penalty"):
        if body.get(name) not in (None, 0, 0.0):
            raise bad(f"{name} is not supported (only 0)", name)


def parse_request(kind: str, body: Any, *, model_name: str, tokenizer: Any, max_model_len: int,
                  vocab_size: int) -> GenerationRequest:
    """Validate a /v1/completions (kind "completion") or /v1/chat/completions ("chat") body."""
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    model = body.get("model", model_name)
    if model != model_name:
        raise APIError(404, f"The model '{model}' does not exist; this server serves '{model_name}'",
                       "invalid_request_error", "model", "model_not_found")
    _unsupported(body)
    ids = _prompt_ids(body, tokenizer) if kind == "completion" else _chat_ids(body, tokenizer)
    if not ids:
        raise bad("the prompt is empty; give at least one token", "prompt")
    if max(ids) >= vocab_size:
        raise bad(f"the prompt holds token id {max(ids)}, outside the vocabulary of {vocab_size}", "prompt")
    if len(ids) >= max_model_len:
        raise bad(f"This model's maximum context length is {max_model_len} tokens; the prompt has {len(ids)} "
                  "and at least one is needed for the completion", "prompt", "context_length_exceeded")
    room = max_model_len - len(ids)
    max_tokens = _int(body, "max_tokens", None)
    if kind == "chat":
        max_tokens = _int(body, "max_completion_tokens", max_tokens)
    forced = body.get("forced_tokens")
    if forced is not None:
        forced = _int_list(forced, "forced_tokens")
        if not forced:
            raise bad("'forced_tokens' is empty: give at least one token, or leave it out", "forced_tokens")
        if max(forced) >= vocab_size:
            raise bad(f"'forced_tokens' holds token id {max(forced)}, outside the vocabulary of {vocab_size}",
                      "forced_tokens")
        max_tokens = len(forced)  # a replay produces exactly the forced tokens
    if max_tokens is None:
        max_tokens = min(16, room) if kind == "completion" else room
    if max_tokens < 1:
        raise bad(f"'max_tokens' must be at least 1, got {max_tokens}", "max_tokens")
    if len(ids) + max_tokens > max_model_len:
        raise bad(f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                  f"{len(ids) + max_tokens} tokens ({len(ids)} in the prompt, {max_tokens} for the completion)",
                  "max_tokens", "context_length_exceeded")
    temperature = _number(body, "temperature", 1.0)
    if temperature < 0:
        raise bad(f"'temperature' must be >= 0, got {temperature}", "temperature")
    top_p = _number(body, "top_p", 1.0)
    if not 0 < top_p <= 1:
        raise bad(f"'top_p' must be in (0, 1], got {top_p}", "top_p")
    top_k = _int(body, "top_k", 0)
    if top_k < 0:
        raise bad(f"'top_k' must be >= 0, got {top_k}", "top_k")
    seed = _int(body, "seed", None)
    stop_ids = _int_list(body.get("stop_token_ids") or [], "stop_token_ids")
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise bad("'ignore_eos' must be a boolean", "ignore_eos")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad("'stream' must be a boolean", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise bad("'stream_options' must be an object", "stream_options")
    if any(t >= vocab_size for t in stop_ids):
        raise bad(f"'stop_token_ids' holds an id outside the vocabulary of {vocab_size}", "stop_token_ids")
    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                                seed=seed, stop_token_ids=stop_ids, ignore_eos=ignore_eos, forced_tokens=forced)
    except ValueError as e:
        raise bad(str(e)) from None
    prefix = "cmpl" if kind == "completion" else "chatcmpl"
    return GenerationRequest(kind=kind, model=model_name, prompt_token_ids=list(ids), params=params, stream=stream,
                             include_usage=bool(options.get("include_usage")), stop=_stop(body),
                             request_id=f"{prefix}-{uuid.uuid4().hex}", created=int(time.time()))


# ------------------------------------------------------------------------------------------------ responses

def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """The OpenAI usage object."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def response(req: GenerationRequest, text: str, token_ids: list[int], finish_reason: str | None,
             prompt_tokens: int) -> dict[str, Any]:
    """The complete (non-streamed) response object."""
    if req.kind == "completion":
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason, "token_ids": token_ids}
        obj = "text_completion"
    else:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": finish_reason, "token_ids": token_ids}
        obj = "chat.completion"
    return {"id": req.request_id, "object": obj, "created": req.created, "model": req.model, "choices": [choice],
            "usage": usage(prompt_tokens, len(token_ids))}


def chunk(req: GenerationRequest, text: str | None, token_ids: list[int], finish_reason: str | None,
          *, role: bool = False) -> dict[str, Any]:
    """One streamed chunk (text delta and its token ids; the finish reason on the last)."""
    if req.kind == "completion":
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason,
                  "token_ids": token_ids}
        obj = "text_completion"
    else:
        delta: dict[str, Any] = {"role": "assistant"} if role else {}
        if text:
            delta["content"] = text
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason,
                  "token_ids": token_ids}
        obj = "chat.completion.chunk"
    return {"id": req.request_id, "object": obj, "created": req.created, "model": req.model, "choices": [choice]}


def usage_chunk(req: GenerationRequest, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    """The last chunk of a stream with stream_options.include_usage: no choices, the usage."""
    obj = "text_completion" if req.kind == "completion" else "chat.completion.chunk"
    return {"id": req.request_id, "object": obj, "created": req.created, "model": req.model, "choices": [],
            "usage": usage(prompt_tokens, completion_tokens)}


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
        if not (final or self.stopped):
            end = len(text.rstrip("\ufffd")) if text.endswith("\ufffd") else end
            end = max(self.sent, end - self.holdback)
        delta = text[self.sent:end]
        self.sent = max(self.sent, end)
        return delta
