"""The one check of a request's prompt and output length, used by LLMEngine.add_request and the HTTP server."""

from __future__ import annotations

from typing import Any

import numpy as np


class RequestError(ValueError):
    """Bad request input; `param` names the field and `code` is the OpenAI error code, if any."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param, self.code = param, code


def check_prompt(prompt_token_ids: Any, *, vocab_size: int, max_model_len: int, param: str = "prompt") -> list[int]:
    """The prompt as a list of ints in [0, vocab_size) leaving room for one output token, or RequestError."""
    if isinstance(prompt_token_ids, (str, bytes)) or not hasattr(prompt_token_ids, "__len__"):
        raise RequestError(f"'{param}' must be a list of integer token ids", param)
    prompt = list(prompt_token_ids)
    if any(isinstance(t, bool) or not isinstance(t, (int, np.integer)) for t in prompt):
        raise RequestError(f"'{param}' must be a list of integer token ids", param)
    prompt = [int(t) for t in prompt]
    if not prompt:
        raise RequestError("the prompt is empty; give at least one token", param)
    bad = next((t for t in prompt if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise RequestError(f"the prompt holds token id {bad}, outside the vocabulary [0, {vocab_size})", param)
    if len(prompt) >= max_model_len:
        raise RequestError(f"This model's maximum context length is {max_model_len} tokens; the prompt has "
                           f"{len(prompt)} and at least one is needed for the completion", param,
                           "context_length_exceeded")
    return prompt


def check_max_tokens(max_tokens: Any, param: str = "max_tokens", *, prompt_len: int = 0,
                     max_model_len: int | None = None) -> None:
    """RequestError unless max_tokens is an integer >= 1 and (given max_model_len) prompt_len + max_tokens fits it."""
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, (int, np.integer)) or max_tokens < 1:
        raise RequestError(f"'{param}' must be an integer >= 1, got {max_tokens!r}", param)
    if max_model_len is not None and prompt_len + max_tokens > max_model_len:
        raise RequestError(f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                           f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} in '{param}')",
                           param, "context_length_exceeded")
