"""The device-aware trainer on the CPU: today's losses, a bf16-autocast step, a clear error when
``cuda`` is asked for and absent, and the train.device / train.precision config keys."""
import copy
import math
import random

import pytest
import torch

from tests.unit.train.test_trainer import _samples
from tide.config import ConfigError, load_config
from tide.train.device import DeviceError, autocast, resolve_device, resolve_precision
from tide.train.objective import eagle3_loss
from tide.train.trainer import collate, make_batches, prepare, train

KWARGS = dict(epochs=2, lr=3e-3, batch_tokens=80, max_len=256, ttt_length=3, step_weight=0.8)


def _reference_losses(drafter, embed, head, samples, epochs, lr, batch_tokens, max_len, ttt_length, step_weight):
    """The training loop as it was before devices (constant warm-up/cosine schedule included)."""
    torch.manual_seed(0)
    prepare(samples, drafter, head)
    batches = make_batches(samples, batch_tokens, max_len)
    planned = max(1, epochs * len(batches))
    warmup = max(1, planned // 20)
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(1.0, (i + 1) / warmup) * (
        0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, i / planned)))))
    rng, curve = random.Random(0), []
    drafter.train()
    for _ in range(epochs):
        order = list(range(len(batches)))
        rng.shuffle(order)
        for bi in order:
            loss, _, _ = eagle3_loss(drafter, embed, head, collate(batches[bi], max_len), ttt_length, step_weight)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
            curve.append(float(loss.detach()))
    drafter.eval()
    return curve


def test_cpu_device_path_gives_the_losses_of_todays_loop(tiny_target, tiny_drafter):
    samples = _samples(tiny_target)
    embed, head = tiny_target.embed_weight, tiny_target.lm_head_weight
    ref = copy.deepcopy(tiny_drafter)
    expected = _reference_losses(ref, embed, head, copy.deepcopy(samples), **KWARGS)
    ours = copy.deepcopy(tiny_drafter)
    result = train(ours, embed, head, samples, progress=False, device=resolve_device("cpu"), precision="fp32",
                   **KWARGS)
    assert len(expected) >= 6
    torch.testing.assert_close(result.loss_curve, expected, rtol=1e-5, atol=1e-7)
    for (name, a), b in zip(ours.state_dict().items(), ref.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7, msg=name)


def test_bf16_autocast_step_runs_on_cpu_with_fp32_master_weights(tiny_target, tiny_drafter):
    samples = _samples(tiny_target, n=3)
    embed, head = tiny_target.embed_weight, tiny_target.lm_head_weight
    drafter = copy.deepcopy(tiny_drafter)
    prepare(samples, drafter, head)
    batch = collate(samples, 256)
    fp32, _, _ = eagle3_loss(drafter, embed, head, batch, 3)
    with autocast(torch.device("cpu"), "bf16"):
        bf16, _, _ = eagle3_loss(drafter, embed, head, batch, 3)
    assert torch.isfinite(bf16) and abs(float(bf16) - float(fp32)) < 0.05 * float(fp32)
    before = copy.deepcopy(drafter.state_dict())
    result = train(drafter, embed, head, samples, progress=False, precision="bf16", **{**KWARGS, "epochs": 1})
    assert result.steps >= 1 and all(math.isfinite(v) for v in result.loss_curve)
    assert all(p.dtype == torch.float32 for p in drafter.parameters())
    assert any(not torch.equal(before[k], v) for k, v in drafter.state_dict().items())


def test_cuda_without_a_gpu_fails_with_a_clear_message(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # as on the CPU CI, GPU or not
    with pytest.raises(DeviceError, match="train.device is 'cuda' but no GPU is usable"):
        resolve_device("cuda")
    assert resolve_device("auto") == torch.device("cpu")


def test_device_and_precision_keys_are_validated(tmp_path, monkeypatch):
    monkeypatch.setenv("TIDE_TRAIN__DEVICE", "cuda")
    monkeypatch.setenv("TIDE_TRAIN__PRECISION", "bf16")
    cfg = load_config(None)
    assert (cfg.train.device, cfg.train.precision) == ("cuda", "bf16")
    monkeypatch.setenv("TIDE_TRAIN__DEVICE", "gpu")
    with pytest.raises(ConfigError, match="train.device"):
        load_config(None)
    monkeypatch.setenv("TIDE_TRAIN__DEVICE", "cpu")
    monkeypatch.setenv("TIDE_TRAIN__PRECISION", "fp16")
    with pytest.raises(ConfigError, match="train.precision"):
        load_config(None)


def test_auto_precision_is_bf16_only_where_the_cpu_multiplies_bf16_natively(monkeypatch):
    cpu = torch.device("cpu")
    for native, expected in ((True, "bf16"), (False, "fp32")):
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda native=native: native)
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
        assert resolve_precision("auto", cpu) == expected
        x = torch.randn(4, 8)
        with autocast(cpu, "auto"):
            y = torch.nn.functional.linear(x, torch.randn(3, 8))
        assert y.dtype == (torch.bfloat16 if expected == "bf16" else torch.float32)
    assert resolve_precision("fp32", cpu) == "fp32" and resolve_precision("bf16", cpu) == "bf16"
    with pytest.raises(DeviceError, match="train.precision"):
        resolve_precision("fp16", cpu)
    monkeypatch.setenv("TIDE_TRAIN__PRECISION", "auto")
    assert load_config(None).train.precision == "auto"
