"""Shared output for bench scripts: a plain table on stdout and an optional JSON file."""
from __future__ import annotations

import json
import platform
import time
from pathlib import Path

import torch


def environment() -> dict:
    return {"python": platform.python_version(), "torch": torch.__version__,
            "threads": torch.get_num_threads(), "machine": platform.machine(),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def print_table(title: str, rows: list[tuple]) -> None:
    width = max(len(str(r[0])) for r in rows)
    print(f"\n{title}\n" + "-" * (width + 30))
    for row in rows:
        print(f"{str(row[0]):<{width}}  " + "  ".join(str(c) for c in row[1:]))


def write_json(path: str | None, payload: dict) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps({**payload, "environment": environment()}, indent=2))
        print(f"\nwrote {path}")
