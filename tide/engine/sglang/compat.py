"""Which SGLang the plugin runs in, and the start-up checks that refuse anything else.

The plugin hooks SGLang internals by name (plugin.py, HOOK_TARGETS), so it states the releases it
was written and tested against; outside them a scheduler refuses to start with a message saying
why, rather than capturing wrong rows. Rules checked at scheduler start:
- SGLang's version is in [MIN_VERSION, MAX_VERSION);
- speculative decoding is EAGLE3 (the aux states TIDE trains on are EAGLE3's capture layers);
- capture needs a chain draft (``--speculative-eagle-topk 1``): with a tree, the accepted path's
  rows are not contiguous in the verify output;
- swaps need TIDE's loader in ``--custom-weight-loader`` (SGLang raises in its scheduler for an
  unknown load format).
"""
from __future__ import annotations

import re
from typing import Any

MIN_VERSION, MAX_VERSION = "0.5.23", "0.5.24"  # pyproject's tide[sglang] extra says the same
LOADER = "tide.engine.sglang.plugin.load_draft"  # the --custom-weight-loader TIDE's swaps use


class SGLangPluginError(RuntimeError):
    """SGLang or its arguments are not what the plugin supports; the message says what to change."""


def _release(version: str) -> tuple[int, ...]:
    """The numeric release of a version string (0.5.23.post1 and 0.5.23rc1 compare as 0.5.23)."""
    match = re.match(r"(\d+)\.(\d+)\.(\d+)", version)
    return tuple(int(g) for g in match.groups()) if match else (0,)


def version_supported(version: str) -> bool:
    return _release(MIN_VERSION) <= _release(version) < _release(MAX_VERSION)


def startup_problems(version: str, server_args: Any, capture: bool) -> list[str]:
    """Everything that stops the plugin from working in this server (empty when fine)."""
    problems = []
    if not version_supported(version):
        problems.append(f"SGLang {version} is outside the supported range [{MIN_VERSION}, {MAX_VERSION}); "
                        f"install tide[sglang] or sglang=={MIN_VERSION}")
    algorithm = getattr(server_args, "speculative_algorithm", None)
    if str(algorithm).upper() != "EAGLE3":
        problems.append(f"speculative decoding must be EAGLE3 (--speculative-algorithm EAGLE3), got {algorithm!r}")
    topk = getattr(server_args, "speculative_eagle_topk", None)
    if capture and topk not in (None, 1):
        problems.append(f"capture needs a chain draft (--speculative-eagle-topk 1), got {topk}")
    loaders = getattr(server_args, "custom_weight_loader", None) or []
    if LOADER not in loaders:
        problems.append(f"drafter swaps need --custom-weight-loader {LOADER}")
    return problems


def check_startup(version: str, server_args: Any, capture: bool) -> None:
    problems = startup_problems(version, server_args, capture)
    if problems:
        raise SGLangPluginError("TIDE's SGLang plugin cannot run here: " + "; ".join(problems))
