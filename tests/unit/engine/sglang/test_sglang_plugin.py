"""The plugin's registration and start-up checks against SGLang 0.5.23's own plugin loader, hook
registry, ServerArgs and LogitsProcessor."""
from __future__ import annotations

import inspect
import json
import pkgutil
from pathlib import Path

import pytest
import torch

from tide.config import TideConfig
from tide.engine.sglang import plugin, server_args

ROOT = Path(__file__).resolve().parents[4]


def test_sglangs_loader_finds_the_tide_entry_point(sglang):
    """pyproject.toml declares it; SGLang's own discovery (what load_plugins runs) finds it."""
    from sglang.srt.plugins import GENERAL_PLUGINS_GROUP, load_plugins_by_group

    assert GENERAL_PLUGINS_GROUP == "sglang.srt.plugins"
    assert '[project.entry-points."sglang.srt.plugins"]\ntide = "tide.engine.sglang.plugin:register"' in \
        (ROOT / "pyproject.toml").read_text()
    found = load_plugins_by_group(GENERAL_PLUGINS_GROUP)
    assert "tide" in found, "reinstall TIDE (pip install -e .) so its entry points are registered"
    func, _dist = found["tide"]
    assert func is plugin.register


def test_hook_targets_exist_with_the_arguments_the_hooks_take(sglang):
    for key, target in plugin.HOOK_TARGETS.items():
        params = list(inspect.signature(pkgutil.resolve_name(target)).parameters)
        assert params[0] == "self", key
    assert list(inspect.signature(pkgutil.resolve_name(plugin.HOOK_TARGETS["startup"])).parameters)[1] == \
        "server_args"
    for key in ("verify", "prefill"):
        assert list(inspect.signature(pkgutil.resolve_name(plugin.HOOK_TARGETS[key])).parameters)[1] == "batch"


def test_register_is_inert_without_tide_and_registers_its_hooks_with_it(sglang, monkeypatch):
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    monkeypatch.delenv(plugin.CONFIG_ENV, raising=False)
    before = {t: list(HookRegistry._hooks.get(t, [])) for t in plugin.HOOK_TARGETS.values()}
    plugin.register()
    assert {t: list(HookRegistry._hooks.get(t, [])) for t in plugin.HOOK_TARGETS.values()} == before
    monkeypatch.setenv(plugin.CONFIG_ENV, "")
    plugin.register()
    try:
        kinds = {t: [(k, h) for k, h, _ in HookRegistry._hooks[t]] for t in plugin.HOOK_TARGETS.values()}
        assert (HookType.BEFORE, plugin.on_scheduler_init) in kinds[plugin.HOOK_TARGETS["startup"]]
        assert (HookType.AFTER, plugin.after_attention_backends) in kinds[plugin.HOOK_TARGETS["final_hidden"]]
        assert (HookType.AFTER, plugin.after_verify) in kinds[plugin.HOOK_TARGETS["verify"]]
        assert (HookType.AROUND, plugin.around_prefill) in kinds[plugin.HOOK_TARGETS["prefill"]]
    finally:
        for t in plugin.HOOK_TARGETS.values():  # not applied: leave SGLang's classes as they are
            HookRegistry._hooks[t] = [e for e in HookRegistry._hooks[t] if e[1].__module__ != plugin.__name__]


def _server_args(**fields):
    from sglang.srt.server_args import ServerArgs

    assert set(fields) <= set(ServerArgs.__struct_fields__)  # the fields the checks read exist
    return ServerArgs(model_path="dummy", **fields)


def test_the_scheduler_refuses_to_start_outside_what_the_plugin_supports(sglang, monkeypatch):
    monkeypatch.setenv(plugin.CONFIG_ENV, "")
    monkeypatch.setenv("TIDE_CAPTURE__ENABLED", "true")  # the plugin reads TIDE's config (file + env)
    good = dict(speculative_algorithm="EAGLE3", speculative_eagle_topk=1, custom_weight_loader=[server_args.LOADER])
    assert server_args.startup_problems(sglang.__version__, _server_args(**good), capture=True) == []
    cases = {"EAGLE3": dict(good, speculative_algorithm="EAGLE"),
             "topk 1": dict(good, speculative_eagle_topk=4),
             "custom-weight-loader": dict(good, custom_weight_loader=[])}
    for needle, fields in cases.items():
        with pytest.raises(server_args.SGLangPluginError, match=needle):
            plugin.on_scheduler_init(None, _server_args(**fields))
    with pytest.raises(server_args.SGLangPluginError, match="outside the supported range"):
        server_args.check_startup("0.5.14", _server_args(**good), capture=True)
    assert server_args.version_supported(sglang.__version__)


def test_the_target_logits_processor_returns_final_hidden_states_once_flagged(sglang_dist, tiny_drafter, tmp_path):
    """SGLang's own LogitsProcessor: with aux states in FULL mode it returns the normed final states
    as ``last_hidden_states`` once the plugin's hook flagged it (what the CUDA graphs record)."""
    from types import SimpleNamespace

    from sglang.srt.layers.logits_processor import LogitsProcessor
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode
    from sglang.srt.model_executor.model_runner_components.spec_aux_hidden_state import SpecAuxHiddenStateConfig
    from transformers import LlamaConfig

    from tide.drafter.artifact import save_drafter

    folder = save_drafter(tiny_drafter, tmp_path / "d")
    lp = LogitsProcessor(LlamaConfig(**json.loads((folder / "config.json").read_text())))
    hidden, aux = torch.randn(5, 8), [torch.randn(5, 8) for _ in range(3)]
    meta = SimpleNamespace(capture_hidden_mode=CaptureHiddenMode.FULL)
    assert lp._get_last_hidden_states_to_store(hidden, aux, meta) is None  # SGLang's default with a draft
    plugin.start_capture(TideConfig(), "tiny", with_tap=False)
    draft = SimpleNamespace(is_draft_worker=True, spec_aux_config=SpecAuxHiddenStateConfig(),
                            model=SimpleNamespace(logits_processor=LogitsProcessor(lp.config)))
    plugin.after_attention_backends(None, draft)
    assert not draft.model.logits_processor.keep_last_hidden_states
    runner = SimpleNamespace(is_draft_worker=False, model=SimpleNamespace(logits_processor=lp),
                             spec_aux_config=SpecAuxHiddenStateConfig(eagle_use_aux_hidden_state=True,
                                                                      eagle_aux_hidden_state_layer_ids=[0, 1, 2]))
    plugin.after_attention_backends(None, runner)
    assert lp._get_last_hidden_states_to_store(hidden, aux, meta) is hidden
    assert plugin.PROCESS.ctx.aux_layer_ids == (1, 2, 3)  # TIDE's convention: the layers they feed


def test_importing_the_plugin_loads_neither_prometheus_client_nor_torch():
    """register() runs in SGLang's main process before it sets PROMETHEUS_MULTIPROC_DIR."""
    import subprocess
    import sys

    code = ("import sys, tide.engine.sglang.plugin; "
            "sys.exit(sorted({'prometheus_client', 'torch'} & set(sys.modules)) or 0)")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).returncode == 0
