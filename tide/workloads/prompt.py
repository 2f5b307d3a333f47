"""The prompt record every workload yields, the train/held-out split, and operator JSONL files.

Split rule: a prompt is held out when ``sha256(id)`` falls in the first ``HELDOUT_PER_MILLE``
of the hash space. It depends only on the prompt's id, so it is the same on every machine, for
every ``n`` and ``seed``, and a training run can never see a held-out prompt.

Selection steps (``select``): keep the prompts of the requested split, shuffle them with
``random.Random(seed)``, take the first ``n``. A larger ``n`` with the same seed extends a smaller
one's list rather than replacing it.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

SPLITS = ("train", "heldout")
HELDOUT_PER_MILLE = 100  # 10 % of every workload is held out for evaluation
CHAT_ROLES = ("system", "user", "assistant")
JSONL_KEYS = ("id", "prompt", "messages", "workload", "reference")


class WorkloadError(ValueError):
    """A workload file or argument is wrong; the message names the file and line."""


@dataclass(frozen=True)
class Prompt:
    """One request of a workload: chat ``messages`` or a raw completion ``prompt`` (exactly one).

    ``reference`` is a response from the source data (ShareGPT's reply, a canonical solution);
    it is never what the target generates.
    """

    id: str
    workload: str
    messages: list[dict[str, str]] | None = None
    prompt: str | None = None
    reference: str | None = None

    def __post_init__(self) -> None:
        if (self.messages is None) == (self.prompt is None):
            raise WorkloadError(f"prompt {self.id!r}: give exactly one of messages or prompt")

    @property
    def is_chat(self) -> bool:
        return self.messages is not None

    def chat_messages(self) -> list[dict[str, str]]:
        """The request as chat messages (a raw prompt becomes one user turn)."""
        if self.messages is not None:
            return [dict(m) for m in self.messages]
        return [{"role": "user", "content": self.prompt or ""}]

    def to_json(self) -> dict[str, Any]:
        """The JSONL line ``load_jsonl_workload`` reads back."""
        out: dict[str, Any] = {"id": self.id, "workload": self.workload}
        if self.messages is not None:
            out["messages"] = self.messages
        else:
            out["prompt"] = self.prompt
        if self.reference is not None:
            out["reference"] = self.reference
        return out


def user_prompt(id: str, workload: str, text: str, reference: str | None = None) -> Prompt:
    """A single-turn chat prompt, the shape all built-in workloads use."""
    return Prompt(id=id, workload=workload, messages=[{"role": "user", "content": text}],
                  reference=reference)


def split_of(prompt_id: str) -> str:
    """``"heldout"`` or ``"train"``, from the id alone (see the module doc)."""
    digest = hashlib.sha256(prompt_id.encode("utf-8")).digest()
    return "heldout" if int.from_bytes(digest[:8], "big") % 1000 < HELDOUT_PER_MILLE else "train"


def select(prompts: Iterable[Prompt], split: str, n: int | None, seed: int) -> list[Prompt]:
    """The prompts of ``split`` in a seeded random order, at most ``n`` of them (None = all)."""
    if split not in SPLITS:
        raise WorkloadError(f"split must be one of {SPLITS}, got {split!r}")
    if n is not None and n < 0:
        raise WorkloadError(f"n must be >= 0, got {n}")
    chosen = sorted((p for p in prompts if split_of(p.id) == split), key=lambda p: p.id)
    random.Random(seed).shuffle(chosen)
    return chosen if n is None else chosen[:n]


def dedupe_by_text(prompts: Iterable[Prompt]) -> list[Prompt]:
    """Drop later prompts whose request text repeats an earlier one (the corpora repeat questions)."""
    seen: set[str] = set()
    out = []
    for p in prompts:
        key = json.dumps(p.chat_messages(), sort_keys=True, ensure_ascii=False)
        if key not in seen:
            seen.add(key)
            out.append(p)
    return out


def cached_records(path: Path, stamp: dict[str, Any],
                   build: Callable[[], Iterable[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Records from a JSONL cache whose first line is ``{"_cache": stamp}``; rebuilt when stale.

    The rebuilt file is written beside ``path`` and renamed over it, so a reader never sees a
    half-written cache and concurrent builders cannot corrupt it.
    """
    try:
        with open(path, encoding="utf-8") as handle:
            header = json.loads(handle.readline() or "null")
            if isinstance(header, dict) and header.get("_cache") == stamp:
                return [json.loads(line) for line in handle if line.strip()]
    except (OSError, json.JSONDecodeError):
        pass
    records = list(build())
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as handle:
        handle.write(json.dumps({"_cache": stamp}) + "\n")
        for record in records:
            handle.write(json.dumps(record, ensure_ascii=False) + "\n")
    os.replace(tmp, path)
    return records


def _parse_messages(value: Any, where: str) -> list[dict[str, str]]:
    if not isinstance(value, list) or not value:
        raise WorkloadError(f"{where}: 'messages' must be a non-empty list of {{role, content}}")
    messages = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or set(m) != {"role", "content"}:
            raise WorkloadError(f"{where}: messages[{i}] must be an object with exactly "
                                f"'role' and 'content', got {m!r:.80}")
        if m["role"] not in CHAT_ROLES:
            raise WorkloadError(f"{where}: messages[{i}].role {m['role']!r} is not one of {CHAT_ROLES}")
        if not isinstance(m["content"], str):
            raise WorkloadError(f"{where}: messages[{i}].content must be a string")
        messages.append({"role": m["role"], "content": m["content"]})
    if messages[-1]["role"] != "user" or not messages[-1]["content"].strip():
        raise WorkloadError(f"{where}: the last message must be a non-empty 'user' turn")
    return messages


def parse_workload_line(obj: Any, where: str, default_id: str, default_workload: str) -> Prompt:
    """One operator JSONL object → ``Prompt``; any problem raises ``WorkloadError`` naming ``where``."""
    if not isinstance(obj, dict):
        raise WorkloadError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    unknown = sorted(set(obj) - set(JSONL_KEYS))
    if unknown:
        raise WorkloadError(f"{where}: unknown key(s) {unknown}; known: {list(JSONL_KEYS)}")
    if ("prompt" in obj) == ("messages" in obj):
        raise WorkloadError(f"{where}: give exactly one of 'prompt' or 'messages'")
    for key in ("id", "workload", "reference"):
        if key in obj and not (isinstance(obj[key], str) and obj[key].strip()):
            raise WorkloadError(f"{where}: '{key}' must be a non-empty string")
    messages = prompt = None
    if "prompt" in obj:
        prompt = obj["prompt"]
        if not isinstance(prompt, str) or not prompt.strip():
            raise WorkloadError(f"{where}: 'prompt' must be a non-empty string")
    else:
        messages = _parse_messages(obj["messages"], where)
    return Prompt(id=obj.get("id", default_id), workload=obj.get("workload", default_workload),
                  messages=messages, prompt=prompt, reference=obj.get("reference"))


def load_jsonl_workload(path: str | Path, default_workload: str | None = None,
                        n: int | None = None) -> list[Prompt]:
    """An operator's workload file, in file order (replays keep the operator's sequence).

    One JSON object per line: ``prompt`` (string, sent as a completion) or ``messages`` (chat
    turns ending with a user turn), optional ``workload`` tag (default: the file's stem), ``id``
    (default: ``<stem>/<line>``) and ``reference``. Blank lines are skipped. The first bad line
    raises ``WorkloadError`` with its line number; nothing is half-loaded.
    """
    path = Path(path)
    if not path.is_file():
        raise WorkloadError(f"workload file {path} does not exist")
    workload = default_workload or path.stem
    prompts: list[Prompt] = []
    ids: set[str] = set()
    with open(path, encoding="utf-8") as handle:
        for lineno, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise WorkloadError(f"{where}: invalid JSON ({exc.msg} at column {exc.colno})") from exc
            p = parse_workload_line(obj, where, f"{path.stem}/{lineno}", workload)
            if p.id in ids:
                raise WorkloadError(f"{where}: duplicate id {p.id!r}")
            ids.add(p.id)
            prompts.append(p)
    if not prompts:
        raise WorkloadError(f"workload file {path} holds no prompts")
    return prompts if n is None else prompts[:n]


def write_jsonl_workload(prompts: Sequence[Prompt], path: str | Path) -> Path:
    """Write prompts in the format ``load_jsonl_workload`` reads (atomic replace)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as handle:
        for p in prompts:
            handle.write(json.dumps(p.to_json(), ensure_ascii=False) + "\n")
    os.replace(tmp, path)
    return path
