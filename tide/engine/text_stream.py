"""Token ids → text deltas for streaming, with stop strings.

Two problems make "decode each token and append" wrong:
- byte-level tokens can split a UTF-8 character, and SentencePiece-style decoders drop a word's
  leading space when decoding from a token boundary; so each new piece is decoded *with* the
  previous token window as context and only the difference is emitted, and nothing is emitted
  while the text ends in an incomplete character (U+FFFD);
- a stop string can span several tokens and events; so text that could still become the start of
  a stop string is held back until it either completes the stop string (cut there) or cannot.
"""
from __future__ import annotations

from typing import Any, Sequence

_INCOMPLETE = "\ufffd"


class Detokenizer:
    """Incremental decoding of one request's generated ids.

    Steps per push: append ids; decode ``ids[prefix:read]`` (context already emitted) and
    ``ids[prefix:]``; if the latter ends in U+FFFD wait for more ids; else emit the suffix beyond
    the context's text and slide the window (prefix ← read, read ← len(ids)).
    """

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer
        self._ids: list[int] = []
        self._prefix = 0
        self._read = 0

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)

    def push(self, ids: Sequence[int]) -> str:
        self._ids.extend(int(i) for i in ids)
        return self._emit(final=False)

    def flush(self) -> str:
        """Whatever is left, even an incomplete character (the stream is over)."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        if self._read == len(self._ids):
            return ""
        context = self._decode(self._ids[self._prefix:self._read])
        full = self._decode(self._ids[self._prefix:])
        if full.endswith(_INCOMPLETE) and not final:
            return ""
        if not full.startswith(context):
            # decoders may normalise across the boundary; fall back to a whole-text diff
            before = self._decode(self._ids[:self._read])
            delta = self._decode(self._ids)[len(before):]
        else:
            delta = full[len(context):]
        self._prefix, self._read = self._read, len(self._ids)
        return delta


class StopMatcher:
    """Holds back text that may start a stop string; reports the cut when one completes.

    Invariant: released text never contains the start of a possible stop-string match, so a match
    always begins inside ``pending``.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = tuple(s for s in stops if s)
        self._pending = ""
        self.stopped = False

    def push(self, text: str) -> str:
        """Return the text safe to release now; sets ``stopped`` when a stop string completed."""
        if self.stopped:
            return ""
        if not self._stops:
            return text
        self._pending += text
        cut = min((i for i in (self._pending.find(s) for s in self._stops) if i >= 0), default=-1)
        if cut >= 0:
            out, self._pending, self.stopped = self._pending[:cut], "", True
            return out
        hold = self._held_suffix_len()
        out = self._pending[:len(self._pending) - hold]
        self._pending = self._pending[len(self._pending) - hold:]
        return out

    def flush(self) -> str:
        out, self._pending = self._pending, ""
        return "" if self.stopped else out

    def _held_suffix_len(self) -> int:
        longest = min(len(self._pending), max(len(s) for s in self._stops) - 1)
        for k in range(longest, 0, -1):
            tail = self._pending[-k:]
            if any(s.startswith(tail) for s in self._stops):
                return k
        return 0


class TextStream:
    """Detokenizer + StopMatcher: ``push(ids)`` → text to send; ``stopped`` after a stop string."""

    def __init__(self, tokenizer: Any, stops: Sequence[str] = ()) -> None:
        self._detok = Detokenizer(tokenizer)
        self._stop = StopMatcher(stops)
        self.text = ""  # everything released so far

    @property
    def stopped(self) -> bool:
        return self._stop.stopped

    def push(self, ids: Sequence[int]) -> str:
        return self._release(self._stop.push(self._detok.push(ids)))

    def flush(self) -> str:
        out = self._stop.push(self._detok.flush())
        return self._release(out + self._stop.flush())

    def _release(self, out: str) -> str:
        self.text += out
        return out
