"""The drafter service's sessions: one per (engine id, request id), each a slot of the drafter's
KV cache, bounded in number and idle time.

A session's cache holds the drafter's keys for the positions the engine fed it. A session the
service does not hold (new, evicted, or every session after a swap: the cache was the old
drafter's) attends from the first position it is fed (``first_pos``), as the engine's own drafter
does after a swap: drafts are verified, so this changes how many are accepted, never the output.
At most ``max_sessions`` exist; a new one past that evicts the least recently used, and sessions
idle for ``idle_s`` are freed (an engine that died never says its requests ended).
"""
from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass

import torch

Key = tuple[str, str]  # (engine id, request id)


@dataclass
class Session:
    slot: int
    first_pos: int  # the drafter attends to keys from here on (it holds nothing before)
    generator: torch.Generator  # draws sampled rows' drafts (seeded by the request's seed)
    used_s: float
    fresh: bool = True  # nothing fed under the serving drafter yet


class SessionTable:
    def __init__(self, max_sessions: int, idle_s: float) -> None:
        if max_sessions < 1:
            raise ValueError(f"max_sessions must be >= 1, got {max_sessions}")
        self.max_sessions, self.idle_s = max_sessions, idle_s
        self._free = list(range(max_sessions - 1, -1, -1))
        self._sessions: OrderedDict[Key, Session] = OrderedDict()
        self.evicted = 0  # sessions freed to make room (cumulative)

    def __len__(self) -> int:
        return len(self._sessions)

    def get(self, key: Key, feed_start: int, seed: int, protect: set[Key]) -> Session:
        """The session of ``key``, made if needed (evicting the least recently used one not in
        ``protect``, the keys of the batch being built)."""
        s = self._sessions.get(key)
        now = time.monotonic()
        if s is None:
            if not self._free:
                self._evict(protect)
            gen = torch.Generator().manual_seed(seed if seed >= 0 else hash(key) & 0x7FFFFFFF)
            s = self._sessions[key] = Session(self._free.pop(), feed_start, gen, now)
        self._sessions.move_to_end(key)
        # this feed rewrites every key from feed_start on: those before are valid only if fed before
        s.first_pos, s.fresh = (feed_start if s.fresh else min(s.first_pos, feed_start)), False
        s.used_s = now
        return s

    def _evict(self, protect: set[Key]) -> None:
        for key in self._sessions:
            if key not in protect:
                self._free.append(self._sessions.pop(key).slot)
                self.evicted += 1
                return
        raise RuntimeError("every session is in the batch: max_sessions is below the batch's rows")

    def close(self, keys) -> int:
        n = 0
        for key in keys:
            s = self._sessions.pop(key, None)
            if s is not None:
                self._free.append(s.slot)
                n += 1
        return n

    def close_engine(self, engine: str) -> int:
        return self.close([k for k in self._sessions if k[0] == engine])

    def expire(self) -> int:
        """Free sessions idle for ``idle_s``."""
        cutoff = time.monotonic() - self.idle_s
        return self.close([k for k, s in self._sessions.items() if s.used_s < cutoff])

    def reset(self) -> None:
        """A new drafter serves: every session's keys are the old drafter's."""
        for s in self._sessions.values():
            s.fresh = True

    def engines(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for engine, _ in self._sessions:
            out[engine] = out.get(engine, 0) + 1
        return out
