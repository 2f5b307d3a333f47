"""Data parallel: two gloo ranks under torchrun end with the weights one process reaches by
accumulating the same batches per step (DDP averages what accumulation averages)."""
import copy
import os
import subprocess
import sys
from pathlib import Path

import torch

from tests.unit.train.test_trainer import _samples
from tide.process import free_port
from tide.train.distributed import Ranks, step_groups
from tide.train.trainer import train

REPO = Path(__file__).resolve().parents[3]
KWARGS = dict(epochs=2, lr=3e-3, batch_tokens=40, max_len=256, ttt_length=3, step_weight=0.8)


def test_step_groups_give_each_rank_its_share_and_drop_the_remainder():
    order = [5, 3, 0, 4, 1, 2, 6]
    assert step_groups(order, Ranks()) == [[5], [3], [0], [4], [1], [2], [6]]
    assert step_groups(order, Ranks(0, 2)) == [[5], [0], [1]]
    assert step_groups(order, Ranks(1, 2)) == [[3], [4], [2]]
    assert step_groups(order, Ranks(), accumulate=2) == [[5, 3], [0, 4], [1, 2]]


EXITING_RANK = """
import atexit, sys, torch, torch.distributed as dist
from tide.train.distributed import exit_rank
dist.init_process_group("gloo", init_method=sys.argv[1], rank=0, world_size=1)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(3, 3))
model(torch.ones(2, 3)).sum().backward()
atexit.register(lambda: open(sys.argv[2], "w").write("handlers ran"))
print("trained", flush=False)
exit_rank(3)
print("not reached")
"""


def test_a_rank_in_a_group_exits_with_its_code_after_the_exit_handlers_and_flushed_output(tmp_path):
    marker = tmp_path / "atexit.txt"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", EXITING_RANK, f"tcp://127.0.0.1:{free_port()}", str(marker)],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert proc.stdout.split() == ["trained"]  # flushed though buffered into a pipe; nothing after
    assert marker.read_text() == "handlers ran"


def test_a_process_without_a_group_gets_its_code_back():
    # in a fresh interpreter: a test worker may hold another test's group (SGLang's), and would exit
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", "import sys; from tide.train.distributed import exit_rank; "
                           "sys.exit(exit_rank(5) + 1)"], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 6, proc.stderr[-2000:]  # returned 5, not exited with it


def test_two_gloo_ranks_match_one_process_accumulating_the_same_batches(tiny_target, tiny_drafter, tmp_path):
    samples = _samples(tiny_target, n=8)
    embed, head = tiny_target.embed_weight, tiny_target.lm_head_weight
    case = tmp_path / "case.pt"
    torch.save({"drafter": copy.deepcopy(tiny_drafter), "embed": embed, "head": head,
                "samples": samples, "kwargs": KWARGS}, case)
    out = tmp_path / "rank0.pt"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                           "2", str(REPO / "tests/unit/train/ddp_rank.py"), str(case), str(out)],
                          env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ddp = torch.load(out, weights_only=False)

    single = copy.deepcopy(tiny_drafter)
    result = train(single, embed, head, copy.deepcopy(samples), progress=False, accumulate=2, **KWARGS)
    assert result.steps == ddp["steps"] >= 4
    assert result.tokens_seen == ddp["tokens_seen"]
    torch.testing.assert_close(ddp["loss_curve"], result.loss_curve, rtol=1e-4, atol=1e-6)
    state = single.state_dict()
    changed = 0
    for name, value in ddp["state"].items():
        torch.testing.assert_close(value, state[name], rtol=1e-4, atol=1e-6, msg=name)
        changed += not torch.equal(value, tiny_drafter.state_dict()[name])
    assert changed > 0  # the weights trained: equality is not of two untouched copies
