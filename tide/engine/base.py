"""The engine contract: the one base class ops, the HTTP server and the demo rely on.

The reference engine (tide/engine/reference.py) implements it and the SGLang plugin will, so
ops/ and the server do not care which engine runs; they never reach past it. Capture never imports
the engine: what it is offered (``StepCapture``) is defined in tide/contracts.py.
"""
from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Protocol

# what capture consumes and the acceptance counters are contracts; engines take them from here
from tide.contracts import CaptureMeta, StepCapture, VersionAcceptance  # noqa: F401


class EngineFailed(ConnectionError):
    """The engine can no longer serve (its decode loop died); callers answer 503 and retry elsewhere."""


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding parameters; validated by the caller (the server) before submit."""

    max_new_tokens: int = 64
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    top_k: int = 0  # <= 0: no top-k filter
    ignore_eos: bool = False  # the model's eos ids do not end the request (stop_token_ids still do)


@dataclass(frozen=True)
class GenerationRequest:
    request_id: str
    prompt_ids: tuple[int, ...]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    workload: str | None = None  # free-form tag carried into capture records
    capture: bool = True  # per-request opt-out of hidden-state capture


@dataclass(frozen=True)
class TokenEvent:
    """One chunk of a request's output stream (a decode step may yield several tokens)."""

    token_ids: tuple[int, ...]
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "error"
    error: str | None = None


class CaptureSink(Protocol):
    """Receives committed positions once per step; must only enqueue, never block or raise."""

    def offer(self, captures: list[StepCapture]) -> None: ...


@dataclass
class EngineStats:
    """Cumulative counters since start, per drafter version where it matters."""

    requests_finished: int = 0
    requests_failed: int = 0
    target_forwards: int = 0
    tokens_generated: int = 0
    # drafter version -> its counters (tide.contracts.VersionAcceptance says what each counts)
    acceptance: dict[str, VersionAcceptance] = field(default_factory=dict)

    def copy(self) -> "EngineStats":
        return dataclasses.replace(self, acceptance=dict(self.acceptance))  # the values are frozen


class Engine(ABC):
    """Everything capture, ops, the HTTP server and the demo use of an engine; nothing else is touched.

    ``submit`` is thread-safe and returns a blocking iterator. Drafters are opaque handles to
    callers: they come from ``validate_drafter`` and go back to ``swap_drafter`` (a rollback
    re-serves the handle ``drafter`` returned before). The contract tests every engine must pass
    live in tests/unit/engine/test_contract.py.
    """

    tokenizer: Any  # a transformers tokenizer (chat template included), or None for token-id-only engines
    target_model_id: str
    max_seq_len: int

    @property
    @abstractmethod
    def drafter_version(self) -> str:
        """The version serving now ("none" without a drafter)."""

    @property
    @abstractmethod
    def drafter(self) -> Any:
        """The serving drafter's handle (None without one): what a rollback swaps back in."""

    @property
    @abstractmethod
    def last_swap_pause_s(self) -> float:
        """How long the last applied swap paused decoding (0.0 before the first)."""

    @property
    def failure(self) -> str | None:
        """Why this engine can no longer serve (e.g. its decode loop died), else None. Once set it stays:
        health answers 503 with it, ``submit`` raises EngineFailed, and the service exits non-zero."""
        return None

    @abstractmethod
    def submit(self, request: GenerationRequest) -> Iterator[TokenEvent]: ...

    @abstractmethod
    def validate_drafter(self, folder: Path, smoke_prompt_ids: list[int]) -> Any:
        """Load the drafter in ``folder`` off the serving path and check it fits this target: checksum,
        shapes and aux layers, the serving vocab mapping, and a smoke decode of ``smoke_prompt_ids``
        equal to target-only output. Returns a handle for ``swap_drafter``; raises DrafterError."""

    @abstractmethod
    def swap_drafter(self, drafter: Any, version: str) -> None:
        """Serve ``drafter`` from the next decode step on. The caller validated it already."""

    @abstractmethod
    def set_capture_sink(self, sink: CaptureSink | None) -> None: ...

    @abstractmethod
    def stats(self) -> EngineStats: ...

    @abstractmethod
    def health(self) -> dict[str, Any]:
        """Engine-specific facts for the authenticated health view (JSON-serialisable)."""

    @abstractmethod
    def close(self) -> None: ...
