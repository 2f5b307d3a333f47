"""Write captured requests in SpecForge's offline EAGLE3 format, for training on a GPU pool.

Layout (what SpecForge's ``prepare_hidden_states.py`` writes and its ``OfflineManifestReader``
lists): ``rows_{g}-{g+2000}/data_{idx}.ckpt`` with g = 2000 * (idx // 2000), one ``torch.save``
dict per sample: ``input_ids`` [T] int64, ``loss_mask`` [T] int64, ``aux_hidden_state``
[1, T, 3H] and ``hidden_state`` [1, T, H] (bfloat16, as captured); the draft vocabulary in
``vocab_mapping/vocab_mapping.pt`` (``{"d2t", "t2d"}``, the serving drafter's, which stays
fixed); ``tide_export.json`` lists the request ids and counts.

torch.save (pickle) is SpecForge's format, so it is used here for export only; TIDE itself never
loads pickles. Steps: write everything into a hidden temporary folder next to ``out_dir``,
stream samples one at a time (only one sample in memory), then rename the folder into place.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from tide.train.window import WindowPlan, stream_requests

ROWS_PER_FOLDER = 2000


def sample_path(root: Path, index: int) -> Path:
    group = ROWS_PER_FOLDER * (index // ROWS_PER_FOLDER)
    return root / f"rows_{group}-{group + ROWS_PER_FOLDER}" / f"data_{index}.ckpt"


def export_specforge(data_dir: str | Path, plan: WindowPlan, out_dir: str | Path, d2t: torch.Tensor,
                     t2d: torch.Tensor, all_positions: bool = False, include_heldout: bool = False,
                     max_seq_len: int | None = None) -> dict:
    """Export the plan's training requests (and held-out ones if asked); returns the manifest.

    ``all_positions`` writes a loss mask of ones (as TIDE trains with ``train_on_prompt``);
    otherwise the captured mask (1 on generated positions), SpecForge's usual choice.
    """
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    wanted = plan.train_ids + (plan.heldout if include_heldout else [])
    order = {rid: i for i, rid in enumerate(wanted)}
    written: dict[str, int] = {}
    tokens = 0
    try:
        (tmp / "vocab_mapping").mkdir()
        torch.save({"d2t": d2t.to(torch.int64).clone(), "t2d": t2d.to(torch.bool).clone()},
                   tmp / "vocab_mapping" / "vocab_mapping.pt")
        for sample in stream_requests(data_dir, plan, set(order)):
            if sample.request_id in written:
                continue
            n = int(sample.token_ids.numel()) if max_seq_len is None else min(max_seq_len, int(sample.token_ids.numel()))
            mask = torch.ones(n, dtype=torch.int64) if all_positions else sample.loss_mask[:n].to(torch.int64)
            index = len(written)
            path = sample_path(tmp, index)
            path.parent.mkdir(exist_ok=True)
            torch.save({
                "input_ids": sample.token_ids[:n].to(torch.int64).clone(),
                "loss_mask": mask.clone(),
                "aux_hidden_state": sample.aux_hidden[:n].to(torch.bfloat16).unsqueeze(0).clone(),
                "hidden_state": sample.final_hidden[:n].to(torch.bfloat16).unsqueeze(0).clone(),
            }, path)
            written[sample.request_id] = index
            tokens += n
        manifest = {
            "format": "specforge-offline-eagle3", "samples": len(written), "tokens": tokens,
            "missing": len(order) - len(written), "all_positions": all_positions,
            "request_ids": sorted(written, key=written.get), **plan.summary(),
        }
        (tmp / "tide_export.json").write_text(json.dumps(manifest, indent=1))
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest
