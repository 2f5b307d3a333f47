"""Which requests get captured: a deterministic per-request decision.

Steps: pick the fraction (the workload's own, else the default) -> hash the request id to a
number in [0, 1) -> capture when it is below the fraction. Hashing (not a random draw) means every
step of a request, and every replica seeing the same id, makes the same decision.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Mapping


def unit_hash(request_id: str) -> float:
    """A request id mapped uniformly onto [0, 1)."""
    digest = hashlib.blake2b(request_id.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0**64


@dataclass(frozen=True)
class SamplingPolicy:
    fraction: float = 1.0
    workload_fractions: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name, value in [("default", self.fraction), *self.workload_fractions.items()]:
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"sampling fraction for {name!r} must be in [0, 1], got {value}")

    def fraction_for(self, workload: str | None) -> float:
        if workload is not None and workload in self.workload_fractions:
            return self.workload_fractions[workload]
        return self.fraction

    def admits(self, request_id: str, workload: str | None) -> bool:
        fraction = self.fraction_for(workload)
        if fraction >= 1.0:
            return True
        if fraction <= 0.0:
            return False
        return unit_hash(request_id) < fraction
