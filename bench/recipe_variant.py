"""The static recipe's training half on cached answers, with recipe fields overridden: one lever at
the recipe's own compute (its wall cap, its ranks), without regenerating the answers.

The cache is the folder ``tide train --static`` filled (``$TIDE_HOME/train-cache/static``): the
variant trains on exactly the answers the packaged drafter came from, so its held-out figures
(written into ``OUT/tide.json`` as the packaged drafter's are: simulated and replayed accept
length, by position) compare with the packaged drafter's metadata. Train one variant at a time:
the recipe's ranks take every core, and the wall cap turns a slower machine into fewer steps.

    python -m bench.recipe_variant --out /tmp/lr3 lr=3e-3
    python -m bench.recipe_variant --out /tmp/b4096 --cache /tmp/cache batch_tokens=4096
    python -m bench.spec_decode --prompts 24 --max-new-tokens 64 --drafter <packaged> --drafter /tmp/lr3
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from dataclasses import fields, replace
from pathlib import Path

import torch

from tide.config import load_config
from tide.train.static import RECIPES, StaticRecipe, train_static


def parse_overrides(pairs: list[str], recipe: StaticRecipe) -> dict:
    """``key=value`` strings -> recipe fields, each converted to its field's type; an unknown field or a
    value its type does not take is refused with a message naming it."""
    types = {f.name: type(getattr(recipe, f.name)) for f in fields(recipe)}
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or key not in types:
            raise SystemExit(f"not a recipe field override: {pair!r} (fields: {', '.join(sorted(types))})")
        out[key] = _typed(key, value, types[key])
    return out


def recipe_of(name: str, overrides: list[str]) -> tuple[StaticRecipe, str]:
    """(the named recipe with ``overrides`` applied, its folder name): a recipe with overrides (a
    toy size) gets a name of its own, never the figure's. A bad override exits with its reason."""
    import hashlib

    try:  # the recipe checks its own fields when made
        recipe = replace(RECIPES[name], **parse_overrides(overrides, RECIPES[name]))
    except ValueError as e:
        raise SystemExit(str(e)) from None
    return recipe, name + ("-" + hashlib.sha256(" ".join(overrides).encode()).hexdigest()[:8] if overrides else "")


def _typed(key: str, value: str, kind: type):
    if kind is bool:
        if value.lower() not in ("true", "false"):
            raise SystemExit(f"{key} takes true or false, got {value!r}")
        return value.lower() == "true"
    try:  # an optional field the recipe leaves unset (None) takes a number
        return float(value) if kind is type(None) else kind(value)
    except ValueError:
        wanted = "an integer" if kind is int else "a number"
        raise SystemExit(f"{key} takes {wanted}, got {value!r}") from None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="drafter folder to write")
    ap.add_argument("--recipe", default="default", choices=sorted(RECIPES))
    ap.add_argument("--cache", type=Path, default=None,
                    help="cached answers (default: $TIDE_HOME/train-cache/static)")
    ap.add_argument("overrides", nargs="*", help="recipe fields, key=value")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    cfg = load_config(None)
    try:  # the recipe checks its own fields when made (precision, ranks, chunk sizes)
        recipe = replace(RECIPES[args.recipe], **parse_overrides(args.overrides, RECIPES[args.recipe]))
    except ValueError as e:
        raise SystemExit(str(e)) from None
    cache = args.cache or cfg.home_path / "train-cache" / "static"
    if not cache.is_dir():
        raise SystemExit(f"no cached answers at {cache}: run `tide train --static` once (or pass --cache)")
    start = time.monotonic()
    train_static(cfg, recipe, args.out, cache=cache)
    meta = json.loads((args.out / "tide.json").read_text())
    print(json.dumps({"recipe": args.overrides, "wall_s": round(time.monotonic() - start, 1),
                      **{k: v for k, v in meta.items() if k.startswith(("heldout", "train"))}}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
