"""The SGLang server command TIDE builds, parsed by SGLang 0.5.23's own argument parser, passes the
plugin's start-up checks; the plugin's switches reach the server's environment."""
from __future__ import annotations

import argparse
import json

import pytest

from tide.config import TideConfig, replace
from tide.drafter.artifact import save_drafter
from tide.engine.sglang import plugin, server_args


def _parsed(argv: list[str]):
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return ServerArgs.from_cli_args(parser.parse_args(argv))


def test_the_server_command_is_what_sglang_parses_and_the_plugin_accepts(sglang, tiny_drafter, tmp_path):
    folder = save_drafter(tiny_drafter, tmp_path / "d")
    cfg = TideConfig()
    cfg = replace(cfg, sglang=replace(cfg.sglang, extra_args=("--disable-custom-all-reduce",)))
    argv = server_args.server_command(cfg, "/models/target", folder)
    assert argv[1:3] == ["-m", "sglang.launch_server"]
    args = _parsed(argv[3:])
    assert args.model_path == "/models/target" and args.speculative_draft_model_path == str(folder)
    assert args.speculative_num_steps == cfg.spec.draft_len and args.speculative_num_draft_tokens == cfg.spec.draft_len + 1
    assert args.enable_metrics and args.disable_custom_all_reduce and args.port == cfg.sglang.port
    assert server_args.startup_problems(sglang.__version__, args, capture=True) == []


def test_a_drafter_without_capture_layers_is_refused(tiny_drafter, tmp_path):
    folder = save_drafter(tiny_drafter, tmp_path / "d")
    assert server_args.capture_layers(folder) == [i - 1 for i in tiny_drafter.shape.aux_layer_ids]
    cfg = json.loads((folder / "config.json").read_text())
    del cfg["eagle_config"]
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="eagle_aux_hidden_state_layer_ids"):
        server_args.server_command(TideConfig(), "/models/target", folder)
    with pytest.raises(ValueError, match="target"):
        server_args.server_command(TideConfig(), "", folder)


def test_the_server_env_turns_the_plugin_on_and_keeps_it_in_sglang_plugins():
    env = server_args.server_env("/etc/tide/config.yaml", "7", {})
    assert env == {plugin.CONFIG_ENV: "/etc/tide/config.yaml", plugin.VERSION_ENV: "7"}
    assert server_args.server_env(None, "7", {"SGLANG_PLUGINS": "other"})["SGLANG_PLUGINS"] == "other,tide"
    assert "SGLANG_PLUGINS" not in server_args.server_env(None, "7", {"SGLANG_PLUGINS": "tide,other"})
