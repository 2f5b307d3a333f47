"""The static recipe's own training ranks: two spawned gloo processes end with the weights one
process reaches by accumulating the same batches per step, and leave no scratch files. Run in a
fresh process (``static_ranks_case.py``): the ranks refuse a process that holds a group already."""
import copy
import os
import subprocess
import sys
from pathlib import Path

import torch

from tests.unit.train.test_trainer import _samples
from tide.train.static_ranks import train_ranked
from tide.train.trainer import train

REPO = Path(__file__).resolve().parents[3]
KWARGS = dict(epochs=2, lr=3e-3, batch_tokens=40, max_len=256, ttt_length=3, step_weight=0.8)


def _ranked(tmp_path, drafter, embed, head, samples, world: int) -> dict:
    case, out = tmp_path / "case.pt", tmp_path / "out.pt"
    torch.save({"drafter": copy.deepcopy(drafter), "embed": embed, "head": head, "samples": samples,
                "kwargs": KWARGS, "world": world}, case)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(REPO / "tests/unit/train/static_ranks_case.py"), str(case),
                           str(tmp_path / "scratch"), str(out)], env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(out, weights_only=False)


def test_two_spawned_ranks_match_one_process_accumulating_the_same_batches(tiny_target, tiny_drafter, tmp_path):
    samples = _samples(tiny_target, n=8)
    embed, head = tiny_target.embed_weight, tiny_target.lm_head_weight
    got = _ranked(tmp_path, tiny_drafter, embed, head, samples, world=2)
    single = copy.deepcopy(tiny_drafter)
    want = train(single, embed, head, copy.deepcopy(samples), progress=False, accumulate=2, **KWARGS)
    assert got["steps"] == want.steps >= 4
    assert got["tokens_seen"] == want.tokens_seen  # summed over both ranks
    torch.testing.assert_close(got["loss_curve"], want.loss_curve, rtol=1e-4, atol=1e-6)
    for name, value in got["state"].items():
        torch.testing.assert_close(value, single.state_dict()[name], rtol=1e-4, atol=1e-6, msg=name)
    assert not torch.equal(got["state"]["lm_head.weight"], tiny_drafter.lm_head.weight)  # it trained
    assert not list((tmp_path / "scratch").iterdir())  # the ranks' files are removed


def test_one_rank_trains_in_this_process(tiny_target, tiny_drafter, tmp_path):
    samples = _samples(tiny_target, n=4)
    embed, head = tiny_target.embed_weight, tiny_target.lm_head_weight
    one = copy.deepcopy(tiny_drafter)
    got = train_ranked(one, embed, head, copy.deepcopy(samples), 1, tmp_path / "scratch", progress=False,
                       **KWARGS)
    want = train(copy.deepcopy(tiny_drafter), embed, head, copy.deepcopy(samples), progress=False, **KWARGS)
    assert got.loss_curve == want.loss_curve
    assert not (tmp_path / "scratch").exists()  # nothing written for one rank


def test_a_process_holding_a_group_is_refused_at_once_not_left_waiting(tmp_path):
    code = """
import datetime, socket, sys, torch, torch.distributed as dist
from pathlib import Path
from tide.train.static_ranks import train_ranked
with socket.socket() as s:
    s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
try:
    train_ranked(None, None, None, [], 2, Path(sys.argv[1]))
except RuntimeError as exc:
    print("refused:", exc)
"""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path / "scratch")], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "refused: training ranks need a process without a torch.distributed group" in proc.stdout
    assert not (tmp_path / "scratch").exists()  # refused before anything was made
