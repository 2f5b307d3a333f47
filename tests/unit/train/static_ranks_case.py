"""The static recipe's ranks in a process of their own (run by test_static_ranks.py): a test
worker may hold another test's torch.distributed group, which the ranks refuse to share."""
import sys
from pathlib import Path

import torch

from tide.train.static_ranks import train_ranked


def main(case: str, scratch: str, out: str) -> None:
    torch.set_num_threads(1)
    saved = torch.load(case, weights_only=False)
    drafter = saved["drafter"]
    result = train_ranked(drafter, saved["embed"], saved["head"], saved["samples"], saved["world"], Path(scratch),
                          progress=False, **saved["kwargs"])
    torch.save({"state": drafter.state_dict(), "loss_curve": result.loss_curve,
                "tokens_seen": result.tokens_seen, "steps": result.steps}, out)


if __name__ == "__main__":
    main(*sys.argv[1:4])
