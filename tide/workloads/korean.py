"""Korean chat prompts: chatterbot-corpus dialogues plus ShareGPT's Korean conversations.

Steps:
1. read every ``data/korean/*.yml`` of the ``chatterbot-corpus`` wheel (found with
   ``importlib.util.find_spec``; the package is never imported); each conversation's first line
   is the prompt, its second the reference; ids are ``chatterbot-ko/<file stem>/<index>``; the
   few lines in other languages ("how are you?", "como estas?") are dropped;
2. add ShareGPT's first turns that are mostly Hangul (~15; ``sharegpt.sharegpt(kind="korean")``
   already split);
3. keep each prompt text once (the corpus asks the same question with several answers), then
   select the split.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import yaml

from tide.workloads.prompt import Prompt, WorkloadError, dedupe_by_text, select, user_prompt
from tide.workloads.sharegpt import KOREAN_MIN_HANGUL_RATIO, hangul_ratio, sharegpt

WORKLOAD = "korean"


def chatterbot_korean_dir() -> Path:
    spec = importlib.util.find_spec("chatterbot_corpus")
    if spec is None or not spec.submodule_search_locations:
        raise WorkloadError("the Korean workload needs the chatterbot-corpus wheel: "
                            "pip install --no-deps chatterbot-corpus==1.3.3 (scripts/install.sh)")
    folder = Path(list(spec.submodule_search_locations)[0]) / "data" / "korean"
    if not folder.is_dir():
        raise WorkloadError(f"chatterbot-corpus is installed but {folder} is missing")
    return folder


def chatterbot_prompts() -> list[Prompt]:
    prompts = []
    for path in sorted(chatterbot_korean_dir().glob("*.yml")):
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        for index, conversation in enumerate(data.get("conversations") or []):
            if not isinstance(conversation, list) or not conversation:
                continue
            text = str(conversation[0]).strip()
            if hangul_ratio(text) < KOREAN_MIN_HANGUL_RATIO:
                continue
            reference = str(conversation[1]).strip() if len(conversation) > 1 else None
            prompts.append(user_prompt(f"chatterbot-ko/{path.stem}/{index}", WORKLOAD, text,
                                       reference or None))
    return prompts


def korean(split: str = "train", n: int | None = None, seed: int = 0, home: Path | None = None,
           include_sharegpt: bool = True) -> list[Prompt]:
    """Korean single-turn chat prompts of ``split``, seeded order, at most ``n``."""
    prompts = dedupe_by_text(chatterbot_prompts())
    if include_sharegpt:
        # sharegpt() already returns only ``split``: append everything, select() keeps it.
        prompts += sharegpt(split, None, seed, kind="korean", home=home)
    prompts = dedupe_by_text(prompts)
    return select(prompts, split, n, seed)
