"""The ``tide`` command: each verb is a few lines over the library."""
from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from tide.config import config_as_dict, load_config


def _config(args: argparse.Namespace, **overrides):
    over: dict = {}
    for key, value in overrides.items():
        section, name = key.split("__")
        if value is not None:
            over.setdefault(section, {})[name] = value
    if getattr(args, "home", None):
        over["home"] = args.home
    return load_config(getattr(args, "config", None), overrides=over)


def cmd_train(args: argparse.Namespace) -> int:
    from tide.train.static import StaticRecipe, train_static

    cfg = _config(args)
    if not args.static:
        print("only `tide train --static` is available offline; online retrains run from the scheduler",
              file=sys.stderr)
        return 2
    recipe = StaticRecipe()
    if args.quick:
        recipe = StaticRecipe(train_prompts=48, heldout_prompts=8, max_new_tokens=48, epochs=1,
                              vocab_text_conversations=300)
    out = train_static(cfg, recipe, Path(args.out) if args.out else None)
    print(json.dumps(json.loads((out / "tide.json").read_text()), indent=2))
    print(f"static drafter written to {out}")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from services.engine.main import main as engine_main

    argv = ["--config", args.config] if args.config else []
    return engine_main(argv)


def cmd_ask(args: argparse.Namespace) -> int:
    """Load the engine in-process and answer one prompt; prints the text and acceptance stats."""
    from tide.engine.base import GenerationRequest, SamplingParams
    from tide.engine.reference import build_engine
    from tide.train.offline import render_prompt

    cfg = _config(args, spec__enabled=False if args.no_spec else None)
    logging.info("config: %s", json.dumps(config_as_dict(cfg)))
    engine = build_engine(cfg)
    try:
        ids = render_prompt(engine.tokenizer, args.prompt, cfg.engine.max_prompt_tokens)
        req = GenerationRequest("ask-1", tuple(ids), SamplingParams(max_new_tokens=args.max_tokens))
        out = [t for ev in engine.submit(req) for t in ev.token_ids]
        print(engine.tokenizer.decode(out, skip_special_tokens=True))
        steps, accepted, committed = engine.stats().acceptance.get(engine.drafter_version, [0, 0, 0])
        print(f"\n[drafter {engine.drafter_version}] {len(out)} tokens, {steps} target forwards, "
              f"{committed / max(1, steps):.2f} tokens per forward", file=sys.stderr)
    finally:
        engine.close()
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from tide.demo import run_sample

    cfg = _config(args)
    run_sample(cfg.home_path, args.prompt)
    return 0


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    parser = argparse.ArgumentParser(prog="tide", description=__doc__)
    parser.add_argument("--config", help="YAML config file (defaults are embedded)")
    parser.add_argument("--home", help="data/cache folder (default $TIDE_HOME or ~/.cache/tide)")
    sub = parser.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("train", help="train the static drafter offline")
    p.add_argument("--static", action="store_true", help="the static pre-trained drafter (ShareGPT English)")
    p.add_argument("--quick", action="store_true", help="a small, fast run (tests)")
    p.add_argument("--out", help="output folder (default <home>/drafters/static)")
    p.set_defaults(fn=cmd_train)

    p = sub.add_parser("serve", help="run the engine's HTTP server")
    p.set_defaults(fn=cmd_serve)

    p = sub.add_parser("ask", help="answer one prompt in-process")
    p.add_argument("prompt")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--no-spec", action="store_true", help="target-only decoding")
    p.set_defaults(fn=cmd_ask)

    p = sub.add_parser("demo", help="the main job: run the engine and serve a sample request")
    p.add_argument("--prompt", default="Explain in three sentences why the sky is blue.")
    p.set_defaults(fn=cmd_demo)

    args = parser.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
