"""OpenAI-compatible response bodies: the completion and chat bodies, their stream chunks and the
final usage chunk, ``usage``, TIDE's per-request extension (``tide``: the drafter that served and
tokens per engine step), and the models list. Pure (no I/O), as the request side in
tide/engine/openai_api.py; tide/engine/generation.py and tide/engine/server.py send them.
"""
from __future__ import annotations

import time
from typing import Any


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def tide_extension(drafter_version: str, completion_tokens: int, steps: int) -> dict[str, Any]:
    """Per-request facts: the drafter that served, and tokens per engine event.

    The engine emits one TokenEvent per decode step that committed tokens for this request, so
    tokens per event approximates accepted-plus-bonus tokens per target forward (the prefill's
    event counts as a step, which biases short requests low).
    """
    per_step = round(completion_tokens / steps, 3) if steps else 0.0
    return {"drafter_version": drafter_version, "steps": steps, "tokens_per_step": per_step}


def completion_body(rid: str, created: int, model: str, text: str, finish_reason: str,
                    use: dict[str, int], tide: dict[str, Any]) -> dict[str, Any]:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}],
            "usage": use, "tide": tide}


def chat_body(rid: str, created: int, model: str, text: str, finish_reason: str,
              use: dict[str, int], tide: dict[str, Any]) -> dict[str, Any]:
    return {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "logprobs": None, "finish_reason": finish_reason}],
            "usage": use, "tide": tide}


def completion_chunk(rid: str, created: int, model: str, text: str | None,
                     finish_reason: str | None) -> dict[str, Any]:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text or "", "logprobs": None,
                         "finish_reason": finish_reason}]}


def chat_chunk(rid: str, created: int, model: str, delta: dict[str, str],
               finish_reason: str | None) -> dict[str, Any]:
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]}


def usage_chunk(rid: str, created: int, model: str, obj: str, use: dict[str, int],
                tide: dict[str, Any]) -> dict[str, Any]:
    """The final chunk OpenAI sends when stream_options.include_usage is true (no choices)."""
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [],
            "usage": use, "tide": tide}


def models_body(model_id: str, created: int | None = None) -> dict[str, Any]:
    return {"object": "list", "data": [{"id": model_id, "object": "model",
                                        "created": created or int(time.time()), "owned_by": "tide"}]}
