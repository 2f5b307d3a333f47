"""The SGLang server command TIDE runs (``tide serve --engine sglang``), built from the config.

``server_command``: SGLang's ``launch_server`` for the target with EAGLE3 on, the draft model =
the drafter folder the server starts with (the registry's champion, else ``drafter.path``), a chain
draft of ``spec.draft_len`` tokens (``--speculative-eagle-topk 1``, which capture needs), TIDE's
draft-only loader (``--custom-weight-loader``) and ``--enable-metrics`` (the plugin's tide_*
series appear on the server's /metrics). The capture layers are the drafter config's own
``eagle_config.eagle_aux_hidden_state_layer_ids``: SGLang reads them from the draft model and sets
the target's capture layers to match, so a drafter without them is refused here.
``server_env``: the variables that turn the plugin on in SGLang's processes (plugin.py) and keep
``SGLANG_PLUGINS``, when the operator set one, from leaving TIDE out.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Mapping

from tide.drafter.artifact import DrafterError
from tide.engine.sglang.compat import LOADER
from tide.engine.sglang.plugin import CONFIG_ENV, VERSION_ENV

PLUGIN_NAME = "tide"  # the entry point's name in pyproject.toml


def capture_layers(drafter_folder: Path) -> list[int]:
    """The target layers (SGLang's ids) the drafter was trained on, from its config.json."""
    cfg = json.loads((Path(drafter_folder) / "config.json").read_text())
    ids = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if not ids or len(ids) != 3:
        raise DrafterError(f"{drafter_folder}: config.json has no eagle_config.eagle_aux_hidden_state_layer_ids "
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
