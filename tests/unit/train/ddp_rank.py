"""One rank of the 2-process data-parallel check (run by torchrun from test_distributed.py):
loads the drafter and samples the test saved, trains its share with gloo, rank 0 saves weights."""
import sys

import torch

from tide.train.distributed import exit_rank, init_group, ranks_from_env
from tide.train.trainer import train


def main(case: str, out: str) -> None:
    torch.set_num_threads(1)
    saved = torch.load(case, weights_only=False)
    ranks = ranks_from_env()
    init_group(ranks, torch.device("cpu"))
    drafter = saved["drafter"]
    result = train(drafter, saved["embed"], saved["head"], saved["samples"], progress=False, ranks=ranks,
                   **saved["kwargs"])
    if ranks.is_main:
        torch.save({"state": drafter.state_dict(), "loss_curve": result.loss_curve,
                    "tokens_seen": result.tokens_seen, "steps": result.steps}, out)
    exit_rank(0)  # as tide train --online does under torchrun


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
