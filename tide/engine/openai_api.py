"""OpenAI-compatible request models, their validation, and the error body of a refused request
(the other response bodies are in tide/engine/openai_responses.py).

Validation happens in two stages:
1. shape and types: :func:`parse_body` validates the raw JSON against a strict pydantic model
   (unknown fields, wrong types, out-of-range sampling values are rejected with an
   OpenAI-style ``{"error": {"message", "type", "param"}}`` body naming the offending field);
2. engine limits: :func:`check_limits` compares the tokenized prompt and ``max_tokens`` with the
   engine's context and the configured limits, once the prompt length is known.

Everything here is pure (no I/O), so the server module keeps only routing and streaming.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

from tide.contracts import GREEDY_TEMPERATURE

MAX_STOP_STRINGS = 4
MAX_STOP_CHARS = 256
MAX_STOP_IDS = 16
# Workload tags become capture-record fields and may be used as metric labels: keep them short
# and free of characters that need escaping anywhere.
WORKLOAD_PATTERN = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")


class APIError(Exception):
    """A request the server refuses; rendered as an OpenAI-style error body."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.headers = headers  # e.g. Retry-After on a 503

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param)


def error_body(message: str, type_: str, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": None}}


class _Strict(BaseModel):
    # strict: "10" is not an integer and "true" is not a boolean; clients get told, not guessed at.
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False
    # vLLM's extension, sent by guidellm and other load tools: usage so far on every chunk
    continuous_usage_stats: bool = False


# Fields of OpenAI's schema that TIDE accepts only at their "does nothing" value; anything else is
# a 400 naming the field (silently ignoring e.g. tools would return something the client did not ask).
_INERT_VALUES: dict[str, tuple[Any, ...]] = {
    "frequency_penalty": (None, 0, 0.0), "presence_penalty": (None, 0, 0.0),
    "repetition_penalty": (None, 1, 1.0), "logprobs": (None, False, 0), "top_logprobs": (None, 0),
    "echo": (None, False), "best_of": (None, 1), "suffix": (None, ""),
    "tools": (None, []), "tool_choice": (None, "none", "auto"), "functions": (None, []),
    "function_call": (None, "none", "auto"), "parallel_tool_calls": (None, True, False),
    "response_format": (None, {"type": "text"}), "modalities": (None, ["text"]),
    "audio": (None,), "prediction": (None,), "web_search_options": (None,),
    "reasoning_effort": (None,),
}


class _GenerationFields(_Strict):
    """Fields shared by /v1/completions and /v1/chat/completions (plus TIDE extensions).

    Honoured: max_tokens / max_completion_tokens, temperature, top_p, top_k, seed, stop (strings
    or token ids), stop_token_ids, ignore_eos, stream, stream_options.include_usage and
    .continuous_usage_stats (vLLM's: usage on every chunk). Accepted
    because they do not change generation: user, metadata, store, service_tier. Accepted only at
    their inert value (else 400): the keys of _INERT_VALUES, n=1, logit_bias={}.
    """

    model: str | None = None
    max_tokens: int | None = None  # range depends on engine config: checked in check_limits
    max_completion_tokens: int | None = None  # OpenAI's current name for max_tokens
    temperature: float = Field(1.0, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int = Field(0, ge=-1, le=2**31 - 1)  # 0 or -1: no top-k filter (vLLM/SGLang convention)
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: str | list[str] | list[int] | None = None
    stop_token_ids: list[int] | None = None  # vLLM extension
    ignore_eos: bool = False  # vLLM/SGLang extension: generate max_tokens whatever the model says
    min_tokens: int = Field(0, ge=0)  # vLLM extension; honoured only where it is moot (see below)
    n: int = 1
    logit_bias: dict[str, float] | None = None
    user: str | None = Field(None, max_length=256)
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = Field(None, max_length=32)
    stream: bool = False
    stream_options: StreamOptions | None = None
    # inert-only fields: typed loosely here, value-checked in _inert_only
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0, allow_inf_nan=False)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0, allow_inf_nan=False)
    repetition_penalty: float | None = Field(None, allow_inf_nan=False)
    logprobs: bool | int | None = None
    top_logprobs: int | None = None
    echo: bool | None = None
    best_of: int | None = None
    suffix: str | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    modalities: list[str] | None = None
    audio: Any = None
    prediction: Any = None
    web_search_options: Any = None
    reasoning_effort: Any = None
    # TIDE extensions: a workload tag carried into capture records, and a capture opt-out.
    workload: str | None = None
    capture: bool = True

    @field_validator(*_INERT_VALUES)
    @classmethod
    def _inert_only(cls, v: Any, info: ValidationInfo) -> Any:
        if not any(v == ok and type(v) is type(ok) or (v is ok) for ok in _INERT_VALUES[info.field_name]):
            raise ValueError(f"'{info.field_name}' is not supported by this engine; "
                             f"accepted values: {_INERT_VALUES[info.field_name]}")
        return v

    @field_validator("n")
    @classmethod
    def _only_one_choice(cls, v: int) -> int:
        if v != 1:
            raise ValueError(f"only n=1 is supported, got {v}")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _no_logit_bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        if v:
            raise ValueError("logit_bias is not supported by this engine (only an empty map)")
        return v

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, v: str | list[str] | list[int] | None) -> str | list[str] | list[int] | None:
        items = [v] if isinstance(v, str) else (v or [])
        if len(items) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(items)}")
        for s in items:
            if isinstance(s, str) and (not s or len(s) > MAX_STOP_CHARS):
                raise ValueError(f"each stop string must have 1..{MAX_STOP_CHARS} characters")
        return v

    @field_validator("stop_token_ids")
    @classmethod
    def _few_stop_ids(cls, v: list[int] | None) -> list[int] | None:
        if v is not None and len(v) > MAX_STOP_IDS:
            raise ValueError(f"at most {MAX_STOP_IDS} stop token ids, got {len(v)}")
        return v

    @field_validator("workload")
    @classmethod
    def _workload_tag(cls, v: str | None) -> str | None:
        if v is not None and not WORKLOAD_PATTERN.match(v):
            raise ValueError("workload must be 1-64 characters from [A-Za-z0-9_.:-]")
        return v

    # cross-field checks as field validators (fields validate in declaration order), so the
    # error names the field
    @field_validator("max_completion_tokens")
    @classmethod
    def _one_budget(cls, v: int | None, info: ValidationInfo) -> int | None:
        given = info.data.get("max_tokens")
        if v is not None and given is not None and v != given:
            raise ValueError(f"differs from max_tokens ({given}); send one of them")
        return v

    @field_validator("min_tokens")
    @classmethod
    def _min_tokens_moot(cls, v: int, info: ValidationInfo) -> int:
        # honouring min_tokens needs eos masked inside verification; with ignore_eos it is moot
        if v > 1 and (not info.data.get("ignore_eos") or info.data.get("stop") or info.data.get("stop_token_ids")):
            raise ValueError("min_tokens > 1 is supported only with ignore_eos=true and no stop")
        return v

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_tokens if self.max_tokens is not None else self.max_completion_tokens

    @property
    def greedy_temperature(self) -> float:
        """The temperature to sample at: 0 (greedy) below GREEDY_TEMPERATURE."""
        return 0.0 if self.temperature < GREEDY_TEMPERATURE else self.temperature

    @property
    def stop_strings(self) -> tuple[str, ...]:
        if isinstance(self.stop, str):
            return (self.stop,)
        return tuple(s for s in self.stop or () if isinstance(s, str))

    @property
    def stop_ids(self) -> tuple[int, ...]:
        ids = [s for s in self.stop or () if isinstance(s, int)] + list(self.stop_token_ids or ())
        return tuple(dict.fromkeys(ids))

    @property
    def include_usage_chunk(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def usage_on_every_chunk(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.continuous_usage_stats)


class CompletionRequest(_GenerationFields):
    """``prompt`` is text or token ids; a list of one prompt is accepted too (n prompts are not)."""

    prompt: str | list[int] | list[str] | list[list[int]]

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v: Any) -> str | list[int]:
        if isinstance(v, list) and v and isinstance(v[0], (str, list)):
            if len(v) != 1:
                raise ValueError(f"only one prompt per request is supported, got {len(v)}")
            v = v[0]
        if not v:
            raise ValueError("prompt must not be empty")
        return v


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]  # developer: OpenAI's new "system"
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(_GenerationFields):
    messages: list[ChatMessage]

    @field_validator("messages")
    @classmethod
    def _non_empty(cls, v: list[ChatMessage]) -> list[ChatMessage]:
        if not v:
            raise ValueError("messages must contain at least one message")
        return v

    def template_messages(self) -> list[dict[str, str]]:
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                for m in self.messages]


def _param(loc: tuple[Any, ...]) -> str | None:
    # pydantic adds union-member tags ("str", "list[str]") to locations; users never typed those.
    parts = [str(p) for p in loc
             if isinstance(p, int) or (str(p).isidentifier() and p not in ("str", "int", "float", "bool"))]
    return ".".join(parts) or None


def parse_body(model: type[_GenerationFields], raw: bytes) -> Any:
    """Validate raw JSON bytes; raise APIError(400) naming the first problem."""
    if not raw.strip():
        raise APIError(400, "request body is empty; expected a JSON object")
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        raise _validation_error(exc) from None


def _validation_error(exc: ValidationError) -> APIError:
    errors = exc.errors()
    # an unknown field usually explains the rest (e.g. "prompt" sent to the chat endpoint)
    err = next((e for e in errors if e["type"] == "extra_forbidden"), errors[0])
    kind, param = err["type"], _param(err["loc"])
    more = len(errors) - 1
    suffix = f" ({more} more problem(s) in this request)" if more else ""
    if kind == "json_invalid":
        return APIError(400, f"request body is not valid JSON: {err['msg']}")
    if kind == "model_type":
        return APIError(400, "request body must be a JSON object")
    if kind == "extra_forbidden":
        return APIError(400, f"unrecognized request argument: '{param}'{suffix}", param=param)
    if kind == "missing":
        return APIError(400, f"missing required parameter: '{param}'{suffix}", param=param)
    msg = err["msg"].removeprefix("Value error, ")
    return APIError(400, f"invalid value for '{param}': {msg}{suffix}", param=param)


@dataclass(frozen=True)
class Limits:
    """The numbers check_limits compares a request against."""

    max_seq_len: int
    max_prompt_tokens: int
    max_new_tokens_limit: int
    default_max_new_tokens: int


def check_limits(req: _GenerationFields, prompt_len: int, limits: Limits) -> int:
    """Return the max_new_tokens to use; raise APIError(400) when the request cannot fit.

    Without an explicit max_tokens the default is shortened to fit the context; an explicit one
    that does not fit is an error (silently generating less than asked would hide it).
    """
    if prompt_len > limits.max_prompt_tokens:
        raise APIError(400, f"prompt has {prompt_len} tokens; the limit is {limits.max_prompt_tokens}",
                       param="prompt" if isinstance(req, CompletionRequest) else "messages")
    room = limits.max_seq_len - prompt_len
    asked = req.max_new_tokens
    name = "max_tokens" if req.max_tokens is not None else "max_completion_tokens"
    if asked is None:
        if room < 1:
            raise APIError(400, f"prompt has {prompt_len} tokens and leaves no room in the "
                                f"model's context of {limits.max_seq_len} tokens")
        return min(limits.default_max_new_tokens, limits.max_new_tokens_limit, room)
    if not 1 <= asked <= limits.max_new_tokens_limit:
        raise APIError(400, f"invalid value for '{name}': {asked}; must be in "
                            f"[1, {limits.max_new_tokens_limit}]", param=name)
    if asked > room:
        raise APIError(400, f"prompt ({prompt_len} tokens) + {name} ({asked}) exceeds "
                            f"the model's context of {limits.max_seq_len} tokens", param=name)
    return asked


def check_token_ids(ids: Any, vocab_size: int, param: str) -> None:
    """Token ids from the client (a prompt or stop ids) must index the vocabulary."""
    bad = next((i for i in ids if not 0 <= i < vocab_size), None)
    if bad is not None:
        raise APIError(400, f"invalid value for '{param}': token id {bad} is outside the "
                            f"vocabulary [0, {vocab_size})", param=param)
