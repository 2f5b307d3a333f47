"""FakeEngine: a FAKE implementing the Engine interface of tide/engine/base.py without a model,
for the HTTP tests (tests/unit/engine/test_server*.py), plus its byte-level tokenizer."""
from __future__ import annotations

import re
import threading
import time
from typing import Any, Iterator

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

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
