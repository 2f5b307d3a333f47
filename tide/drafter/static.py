"""Where the static pre-trained drafter lives.

The static drafter is the one TIDE starts from before any retrain: trained offline on ShareGPT
English chat with ``tide train --static`` (tide/train/static.py). A copy produced by that command
is shipped in the package (``tide/assets/drafters/``) so the loop starts without training;
otherwise the command's cached output under ``<home>/drafters/static`` is used.
"""
from __future__ import annotations

from pathlib import Path

from tide.drafter.artifact import DrafterError

STATIC_NAME = "smollm2-static"
PACKAGED = Path(__file__).resolve().parent.parent / "assets" / "drafters" / STATIC_NAME


def cached_static_path(home: Path) -> Path:
    return home / "drafters" / "static"


def static_drafter_path(cfg) -> Path:
    cached = cached_static_path(cfg.home_path)
    if (cached / "config.json").exists():
        return cached
    if cfg.model.target == "smollm2" and (PACKAGED / "config.json").exists():
        return PACKAGED
    raise DrafterError(f"no static drafter at {cached} or {PACKAGED}: run `tide train --static`")
