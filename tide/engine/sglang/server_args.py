"""What the SGLang server runs with: the releases the plugin supports, the start-up checks, and the
command and environment TIDE starts it with (``tide serve --engine sglang``).

Releases: the plugin hooks SGLang internals by name (plugin.py, HOOK_TARGETS), so it states the releases it
was written and tested against; outside them a scheduler refuses to start with a message saying
why, rather than capturing wrong rows. Rules checked at scheduler start:
- SGLang's version is in [MIN_VERSION, MAX_VERSION);
- speculative decoding is EAGLE3 (the aux states TIDE trains on are EAGLE3's capture layers);
- capture needs a chain draft (``--speculative-eagle-topk 1``): with a tree, the accepted path's
  rows are not contiguous in the verify output;
- swaps need TIDE's loader in ``--custom-weight-loader`` (SGLang raises in its scheduler for an
  unknown load format).

Command: ``server_command``: SGLang's ``launch_server`` for the target with EAGLE3 on, the draft model =
the drafter folder the server starts with (the registry's champion, else ``drafter.path``), a chain
draft of ``spec.draft_len`` tokens (``--speculative-eagle-topk 1``, which capture needs), TIDE's
draft-only loader (``--custom-weight-loader``) and ``--enable-metrics`` (the plugin's tide_*
series appear on the server's /metrics). The capture layers are the drafter config's own
``eagle_config.eagle_aux_hidden_state_layer_ids``: SGLang reads them from the draft model and sets
the target's capture layers to match, so a drafter without them is refused here.
``server_env``: the variables that turn the plugin on in SGLang's processes (plugin.py) and keep
``SGLANG_PLUGINS``, when the operator set one, from leaving TIDE out.
Standard library only: plugin.py imports it in SGLang's main process (see there).
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any, Mapping

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

CONFIG_ENV = "TIDE_SGLANG_CONFIG"  # path of the TIDE config file ("" = defaults); unset = plugin inert
VERSION_ENV = "TIDE_SGLANG_DRAFTER_VERSION"  # the version of the drafter the server starts with


PLUGIN_NAME = "tide"  # the entry point's name in pyproject.toml


def capture_layers(drafter_folder: Path) -> list[int]:
    """The target layers (SGLang's ids) the drafter was trained on, from its config.json."""
    cfg = json.loads((Path(drafter_folder) / "config.json").read_text())
    ids = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if not ids or len(ids) != 3:
        raise ValueError(f"{drafter_folder}: config.json has no eagle_config.eagle_aux_hidden_state_layer_ids "
                           "(three target layers); SGLang would capture its defaults, not the drafter's")
    return [int(i) for i in ids]


def server_command(cfg, target: str, drafter_folder: Path, python: str = sys.executable) -> list[str]:
    """argv of the SGLang server for ``target`` starting with the drafter in ``drafter_folder``."""
    if not target:
        raise ValueError("the SGLang engine needs a target: --target MODEL_PATH or sglang.target")
    capture_layers(drafter_folder)
    sg = cfg.sglang
    return [python, "-m", "sglang.launch_server", "--model-path", target,
            "--host", sg.host, "--port", str(sg.port), "--tp-size", str(sg.tp_size),
            "--context-length", str(cfg.model.max_seq_len),
            "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", str(Path(drafter_folder)),
            "--speculative-num-steps", str(cfg.spec.draft_len), "--speculative-eagle-topk", "1",
            "--speculative-num-draft-tokens", str(cfg.spec.draft_len + 1),
            "--custom-weight-loader", LOADER, "--enable-metrics", *sg.extra_args]


def server_env(config_path: str | None, drafter_version: str, base: Mapping[str, str]) -> dict[str, str]:
    """Environment additions for the server: the plugin's switches (plugin.py)."""
    env = {CONFIG_ENV: config_path or "", VERSION_ENV: str(drafter_version)}
    allowed = base.get("SGLANG_PLUGINS")
    if allowed:
        names = [n.strip() for n in allowed.split(",") if n.strip()]
        if PLUGIN_NAME not in names:
            env["SGLANG_PLUGINS"] = ",".join([*names, PLUGIN_NAME])
    return env
