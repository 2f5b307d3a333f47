"""The ``tide`` command: each verb is a few lines over the library."""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from dataclasses import replace
from pathlib import Path

from tide.redact import config_as_dict


def _config(args: argparse.Namespace, **overrides):
    from tide.config import load_config  # imported here: pydantic would add ~0.2 s to `tide --help`

    over: dict = {}
    for key, value in overrides.items():
        section, name = key.split("__")
        if value is not None:
            over.setdefault(section, {})[name] = value
    if getattr(args, "home", None):
        over["home"] = args.home
    return load_config(getattr(args, "config", None), overrides=over)


def cmd_train(args: argparse.Namespace) -> int:
    from tide.train.static import RECIPES, train_static

    cfg = _config(args)
    if args.online:
        from tide.train.distributed import exit_rank
        from tide.train.online import run_cli
        # under torchrun a rank leaves through exit_rank: its group must not meet interpreter shutdown
        return exit_rank(run_cli(cfg, args.result_json, progress=sys.stderr.isatty(),
                                 summary_json=args.summary_json))
    if args.export_specforge:
        from tide.train.online import export_window
        manifest = export_window(cfg, Path(args.export_specforge))
        print(json.dumps({k: v for k, v in manifest.items() if k != "request_ids"}, indent=2))
        return 0
    if not args.static:
        print("choose --static, --online or --export-specforge DIR", file=sys.stderr)
        return 2
    recipe = RECIPES[args.recipe]
    if args.quick:
        recipe = replace(recipe, train_prompts=min(recipe.train_prompts, 48), heldout_prompts=8, max_new_tokens=48,
                         epochs=1, vocab_text_conversations=300,
                         teacher_conversations=min(recipe.teacher_conversations, 48), max_train_s=None)
    out = train_static(cfg, recipe, Path(args.out) if args.out else None)
    print(json.dumps(json.loads((out / "tide.json").read_text()), indent=2))
    print(f"static drafter written to {out}")
    return 0


def _service_argv(args: argparse.Namespace) -> list[str]:
    """The service's own command line: the verb's ``--config`` and every flag after the verb that
    tide's parser does not know (``tide serve --port 9000``), which the service's parser checks."""
    return (["--config", args.config] if getattr(args, "config", None) else []) + args.service_flags


def cmd_serve(args: argparse.Namespace) -> int:
    if args.engine == "sglang":
        from tide.services.sglang_engine import main as sglang_main

        return sglang_main(_service_argv(args))
    from tide.services.engine import main as engine_main

    return engine_main(_service_argv(args))


def cmd_ingest(args: argparse.Namespace) -> int:
    from tide.services.ingest import main as ingest_main

    return ingest_main(_service_argv(args))


def cmd_drafter_serve(args: argparse.Namespace) -> int:
    from tide.services.drafter import main as drafter_main

    return drafter_main(_service_argv(args))


def cmd_scheduler(args: argparse.Namespace) -> int:
    from tide.services.scheduler import main as scheduler_main

    return scheduler_main(_service_argv(args))


def cmd_ask(args: argparse.Namespace) -> int:
    """Load the engine in-process and answer one prompt; prints the text and acceptance stats."""
    from tide.engine.base import GenerationRequest, SamplingParams, VersionAcceptance
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
        acc = engine.stats().acceptance.get(engine.drafter_version, VersionAcceptance())
        print(f"\n[drafter {engine.drafter_version}] {len(out)} tokens, {acc.forwards} target forwards, "
              f"{acc.tokens_per_forward:.2f} tokens per forward", file=sys.stderr)
    finally:
        engine.close()
    return 0


def cmd_data(args: argparse.Namespace) -> int:
    from tide.dataset.commands import run_data

    return run_data(args, _config(args))


def cmd_drafters(args: argparse.Namespace) -> int:
    from tide.ops.commands import run_drafters

    return run_drafters(args, _config(args))


def cmd_token(args: argparse.Namespace) -> int:
    """``tide up`` writes its resolved config (0600) with a fresh control token under <home>/run."""
    import yaml

    path = _config(args).home_path / "run" / "tide.yaml"
    try:
        token = (yaml.safe_load(path.read_text()) or {}).get("server", {}).get("control_token")
    except (OSError, yaml.YAMLError) as exc:
        print(f"error: no running `tide up` config at {path}: {exc}", file=sys.stderr)
        return 2
    if not token:
        print(f"error: {path} has no server.control_token", file=sys.stderr)
        return 2
    print(token)
    return 0


def cmd_up(args: argparse.Namespace) -> int:
    """Start the whole loop and keep it running until Ctrl-C / SIGTERM."""
    import signal
    import threading

    from tide.stack import Stack, StackOptions

    cfg = _config(args)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    stack = Stack(StackOptions(cfg.home_path, args.bootstrap_servers or "", args.tracking_uri or "",
                               args.data_dir or "", args.durable_broker, prometheus=not args.no_prometheus,
                               ports=_ports(args), engines=args.engines))
    print(f"starting TIDE ({', '.join(stack.parts)}) ...", flush=True)
    stack.start()
    try:
        print("TIDE is up:\n" + stack.describe() + "\nCtrl-C stops everything.", flush=True)
        stop.wait()
    finally:
        print("stopping ...", flush=True)
        stack.stop()
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    import signal

    from tide.demo import DemoSettings, run_demo

    def interrupt(*_):  # SIGTERM unwinds like Ctrl-C so every started service is stopped
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)
    cfg = _config(args)
    settings = DemoSettings.quick() if args.quick else DemoSettings()
    report = Path(args.report) if args.report else cfg.home_path / "reports" / time.strftime("demo-%Y%m%d-%H%M%S")
    summary = run_demo(cfg.home_path, report, settings, args.before, args.after,
                       args.bootstrap_servers or "", args.tracking_uri or "", _ports(args), args.keep_up,
                       engines=args.engines)
    loop = summary.get("loop", {})
    if not loop.get("closed"):
        print(f"tide demo: the loop did not close: {loop.get('reason') or 'stopped before the shift'}",
              file=sys.stderr)
        return 1
    return 0 if summary.get("traffic", {}).get("after", {}).get("failed", 1) == 0 else 1


def _add_engines_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engines", type=_positive, default=1,
                   help="engine processes (default 1); several run behind a local round-robin front on the engine port")


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be 1 or more")
    return value


def _add_port_flags(p: argparse.ArgumentParser) -> None:
    """Fixed defaults (tide/stack.py DEFAULT_PORTS); a port another process holds is replaced by a free one."""
    for name, default in (("engine", 8000), ("mlflow", 5000), ("prometheus", 9090), ("page", 8090)):
        p.add_argument(f"--{name}-port", type=int, help=f"{name} port (default {default}, or a free one if taken)")


def _ports(args: argparse.Namespace) -> dict[str, int]:
    return {name: getattr(args, f"{name}_port") for name in ("engine", "mlflow", "prometheus", "page")
            if getattr(args, f"{name}_port", None)}


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    parser = argparse.ArgumentParser(prog="tide", description=__doc__)
    parser.add_argument("--config", help="YAML config file (defaults are embedded)")
    parser.add_argument("--home", help="data/cache folder (default $TIDE_HOME or ~/.cache/tide)")
    parser.add_argument("--version", action="version", version=f"tide {_version()}")
    sub = parser.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("train", help="train a drafter: the static one offline, or an online retrain")
    p.add_argument("--static", action="store_true", help="the static pre-trained drafter (ShareGPT English)")
    p.add_argument("--quick", action="store_true", help="a small, fast run (tests)")
    p.add_argument("--recipe", choices=("default", "self-generated", "scaled", "large"), default="default",
                   help="(--static) the recipe: default (= large: 5600 self-generated answers on two generation workers, bf16 training on two processes under a training-time cap, within the 3 CPU-hour budget on a 2-core machine; the packaged drafter's); scaled (3200 answers, one training process: packaged before large); self-generated (the first packaged recipe, for comparisons)")
    p.add_argument("--out", help="output folder (default <home>/drafters/static)")
    p.add_argument("--online", action="store_true",
                   help="one retrain from the captured dataset: warm start from the champion, register a challenger")
    p.add_argument("--result-json", help="(--online) write status/version/run_id/metrics here")
    p.add_argument("--summary-json", help="(--online) also write status/version/run_id/reason here "
                                          "(a Kubernetes Job's termination message)")
    p.add_argument("--export-specforge", metavar="DIR",
                   help="write the current training window in SpecForge's offline format")
    p.set_defaults(fn=cmd_train)

    for name, fn, what in (("serve", cmd_serve, "run the engine's HTTP server (python -m tide.services.engine)"),
                           ("ingest", cmd_ingest, "run ingest: Kafka to Parquet (python -m tide.services.ingest)"),
                           ("scheduler", cmd_scheduler,
                            "run the retrain scheduler (python -m tide.services.scheduler)"),
                           ("drafter-serve", cmd_drafter_serve,
                            "run the drafter service: one drafter for several engines (python -m tide.services.drafter)")):
        # no -h of its own: `tide serve --help` is the service's help, with the service's flags
        p = sub.add_parser(name, help=what + "; takes the service's flags", add_help=False)
        p.set_defaults(fn=fn, passes_flags=True)
        if name == "serve":  # --target and the rest go through to the engine service chosen here
            p.add_argument("--engine", choices=("reference", "sglang"), default="reference",
                           help="sglang: an SGLang server with TIDE's plugin (python -m tide.services.sglang_engine)")

    p = sub.add_parser("ask", help="answer one prompt in-process")
    p.add_argument("prompt")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--no-spec", action="store_true", help="target-only decoding")
    p.set_defaults(fn=cmd_ask)

    p = sub.add_parser("up", help="start broker, MLflow, engine, ingest and scheduler until Ctrl-C")
    p.add_argument("--bootstrap-servers", help="use this Kafka instead of starting a local broker")
    p.add_argument("--tracking-uri", help="use this MLflow instead of starting a local server")
    p.add_argument("--data-dir", help="Parquet dataset folder (default <home>/dataset)")
    p.add_argument("--durable-broker", action="store_true", help="tansu on S3 (SeaweedFS) instead of memory")
    p.add_argument("--no-prometheus", action="store_true", help="do not start the local Prometheus (dashboard)")
    _add_engines_flag(p)
    _add_port_flags(p)
    p.set_defaults(fn=cmd_up)

    p = sub.add_parser("demo", help="the main job: the drafter adapts to a workload shift, end to end")
    p.add_argument("--quick", action="store_true", help="a short run (CI smoke, <= 8 min)")
    p.add_argument("--before", default="chat", help="workload before the shift: chat|code|korean|FILE.jsonl")
    p.add_argument("--after", default="code", help="workload after the shift: chat|code|korean|FILE.jsonl")
    p.add_argument("--report", help="report folder (default <home>/reports/demo-<time>)")
    p.add_argument("--bootstrap-servers", help="use this Kafka instead of a local broker")
    p.add_argument("--tracking-uri", help="use this MLflow instead of a local server")
    p.add_argument("--keep-up", action="store_true",
                   help="leave the stack (and its page) running after the report until Ctrl-C / SIGTERM")
    _add_engines_flag(p)
    _add_port_flags(p)
    p.set_defaults(fn=cmd_demo)

    from tide.ops.commands import add_drafters_parser
    add_drafters_parser(sub, cmd_drafters)
    from tide.dataset.commands import add_data_parser
    add_data_parser(sub, cmd_data)

    p = sub.add_parser("token", help="print the control token of the `tide up` running on this home")
    p.set_defaults(fn=cmd_token)

    _accept_common_options_after_verbs(parser)
    args, args.service_flags = parser.parse_known_args(argv)
    if args.service_flags and not getattr(args, "passes_flags", False):
        parser.error(f"unrecognized arguments: {' '.join(args.service_flags)}")
    return args.fn(args)


def _accept_common_options_after_verbs(parser: argparse.ArgumentParser) -> None:
    """``--config``/``--home`` work after any verb too (the scheduler appends them to ``train``);
    SUPPRESS keeps a value given before the verb."""
    for action in parser._subparsers._group_actions if parser._subparsers else ():
        for child in action.choices.values():
            child.add_argument("--config", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
            child.add_argument("--home", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
            _accept_common_options_after_verbs(child)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("tide")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown (not installed)"


if __name__ == "__main__":
    sys.exit(main())
