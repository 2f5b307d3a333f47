"""FakeEngine: a FAKE implementing the Engine interface of tide/engine/base.py without a model,
for the HTTP tests (tests/unit/engine/test_server*.py), plus its byte-level tokenizer; and
SwapFakeEngine, the same fake serving drafter versions whose swaps can stall (tests/unit/ops)."""
from __future__ import annotations

import re
import threading
import time
from typing import Any, Iterator

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from tide import metrics
from tide.drafter.artifact import read_shape
from tide.engine.base import Engine, EngineStats, GenerationRequest, TokenEvent

CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# multi-byte characters on purpose: byte-level tokens split them, the server must not
SCRIPT = "The quick brown fox jumps over the lazy dog. Über 한국어 text! "
TOKEN = "s3cret-token"


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level tokenizer with no merges (one token per UTF-8 byte) and a ChatML template."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tk = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>")
    tok.chat_template = CHAT_TEMPLATE
    return tok


class FakeEngine(Engine):
    """A fake satisfying tide.engine.base.Engine, for HTTP tests. Not a model.

    Output of every request: the byte tokens of SCRIPT, cycled, in events of 1, 2, 3, 1, ...
    tokens, ending at max_new_tokens ("length"). Markers in the decoded prompt change that:
    "[eos:N]" emits the eos token as the N-th token ("stop"); "[error-event]" sends an error
    event after two events; "[raise]" / "[reject]" make submit raise RuntimeError / ValueError;
    "[slow]" sleeps 20 ms per event. Every request is recorded; iterators closed before their
    end (the server's cancel path) are recorded in ``cancelled``.
    """

    target_model_id = "fake/tiny-model"
    max_seq_len = 200

    def __init__(self) -> None:
        self.tokenizer = tiny_tokenizer()
        self.script_ids = self.tokenizer.encode(SCRIPT, add_special_tokens=False)
        self.requests: list[GenerationRequest] = []
        self.cancelled: list[str] = []
        self._stats = EngineStats()
        self._lock = threading.Lock()

    @property
    def drafter_version(self) -> str:
        return "fake-v1"

    def expected_ids(self, n: int) -> list[int]:
        return [self.script_ids[i % len(self.script_ids)] for i in range(n)]

    def submit(self, request: GenerationRequest) -> Iterator[TokenEvent]:
        prompt = self.tokenizer.decode(list(request.prompt_ids))
        with self._lock:
            self.requests.append(request)
        if "[raise]" in prompt:
            raise RuntimeError("fake engine exploded")
        if "[reject]" in prompt:
            raise ValueError("fake engine does not like this prompt")
        return self._run(request, prompt)

    def _run(self, request: GenerationRequest, prompt: str) -> Iterator[TokenEvent]:
        eos_at = int(m.group(1)) if (m := re.search(r"\[eos:(\d+)\]", prompt)) else None
        delay_s = 0.02 if "[slow]" in prompt else 0.0
        limit = request.sampling.max_new_tokens
        done, sizes, n_events, ended = 0, (1, 2, 3), 0, False
        try:
            while True:
                if "[error-event]" in prompt and n_events == 2:
                    ended = True
                    yield TokenEvent((), finished=True, finish_reason="error", error="fake step failed")
                    return
                take = min(sizes[n_events % 3], limit - done)
                ids = self.expected_ids(done + take)[done:]
                if eos_at is not None and done + take >= eos_at:
                    ids = ids[:eos_at - done - 1] + [request.sampling.stop_token_ids[0]]
                    done += len(ids)
                    ended = True
                    yield TokenEvent(tuple(ids), finished=True, finish_reason="stop")
                    return
                done += take
                n_events += 1
                time.sleep(delay_s)
                ended = done >= limit
                yield TokenEvent(tuple(ids), finished=ended, finish_reason="length" if ended else None)
                if ended:
                    return
        finally:
            with self._lock:
                if not ended:
                    self.cancelled.append(request.request_id)
                self._stats.requests_finished += 1
                self._stats.tokens_generated += done

    @property
    def drafter(self) -> Any:
        return None

    @property
    def last_swap_pause_s(self) -> float:
        return 0.0

    def validate_drafter(self, folder: Any, smoke_prompt_ids: list[int]) -> Any:
        raise NotImplementedError("the fake engine serves no drafter")

    def health(self) -> dict[str, Any]:
        return {"fake": True}

    def swap_drafter(self, drafter: Any, version: str) -> None:
        raise NotImplementedError

    def set_capture_sink(self, sink: Any) -> None:
        pass

    def stats(self) -> EngineStats:
        with self._lock:
            return self._stats.copy()

    def close(self) -> None:
        pass


class SwapFakeEngine(FakeEngine):
    """A fake satisfying tide.engine.base.Engine that serves drafter versions. Not a model.

    Like a real engine it applies a swap between decode steps and sets ``tide_engine_drafter_info``
    when it does; ``stall()`` stands for a decode loop that takes no step, so swaps stay pending
    (never applied) until ``resume()`` applies the last one asked. ``validate_drafter`` parses the
    folder's config.json (DrafterError when it is not a drafter) and returns the folder as handle.
    Every swap asked is recorded in ``swaps_asked``; ``swap_asked`` is set at each.
    """

    def __init__(self, version: str = "1") -> None:
        super().__init__()
        self._version, self._drafter = version, None
        self._pending: tuple[Any, str] | None = None
        self._stalled = False
        self.swaps_asked: list[str] = []
        self.swap_asked = threading.Event()
        # the engine process it stands for serves one version: earlier engines' labels are gone
        metrics.ENGINE_DRAFTER_INFO.clear()
        metrics.ENGINE_DRAFTER_INFO.labels(version).set(1)

    @property
    def drafter_version(self) -> str:
        return self._version

    @property
    def drafter(self) -> Any:
        return self._drafter

    def validate_drafter(self, folder: Any, smoke_prompt_ids: list[int]) -> Any:
        read_shape(folder)
        return folder

    def swap_drafter(self, drafter: Any, version: str) -> None:
        with self._lock:
            self._pending = (drafter, version)
            self.swaps_asked.append(version)
            stalled = self._stalled
        self.swap_asked.set()
        if not stalled:
            self._apply()

    def stall(self) -> None:
        with self._lock:
            self._stalled = True

    def resume(self) -> None:
        with self._lock:
            self._stalled = False
        self._apply()

    def _apply(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, None
            if pending is None:
                return
            old = self._version
            self._drafter, self._version = pending
        metrics.ENGINE_DRAFTER_INFO.labels(old).set(0)
        metrics.ENGINE_DRAFTER_INFO.labels(self._version).set(1)

    def health(self) -> dict[str, Any]:
        return {"fake": True, "drafter_version": self._version}
