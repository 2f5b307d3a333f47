"""``tide drafters ...``: operator commands over the registry (and optionally a running engine).

Verbs: ``list``, ``show V``, ``promote V``, ``rollback``, ``diff V W``, ``history``, ``fleet``.
They read the registry directly (MLflow from ``registry.*`` config), so they work with no engine
running. ``promote`` and ``rollback`` go through the one alias writer (tide/ops/aliases.py): the
alias owner's API at ``--owner`` (default ``ops.alias_owner_url``), else an owner in this process
on the shared lock file; every change is a numbered operation of the ledger (who, when, from, to,
why). They are authorised before anything is written: the owner checks ``--token`` (default
``ops.alias_owner_token``, else ``server.control_token``) on its first call, and with ``--engine``
the engine checks it too; a refusal names the token, not an outage. A change decided on an alias
generation that another operation has since moved fails with "conflict ... retry" and writes nothing.
With ``--engine URL`` the engine is asked to check its alias at once after a change, and
``list``/``show`` add the engine's live acceptance and the version it actually serves. ``fleet``
shows every replica x the version it serves against ``champion`` (from the owner; with only
``--engine``, that engine).

``promote`` first downloads the version (checksum verified) and loads it against the current
champion's shapes and vocab mapping, so a version no engine could serve is refused before the
alias moves; ``--force`` skips that.
"""
from __future__ import annotations

import argparse
import getpass
import json
import sys
from typing import Callable

EXIT_ERROR = 2


class CommandError(RuntimeError):
    """Shown to the operator as ``error: <message>`` with exit status 2."""


def add_drafters_parser(sub, fn: Callable[[argparse.Namespace], int]) -> None:
    p = sub.add_parser("drafters", help="list, inspect, promote and roll back drafter versions")
    p.add_argument("--engine", help="a running engine's URL: check it after changes, show live acceptance")
    p.add_argument("--token", help="the control token of the engine and the alias owner "
                                   "(default: ops.alias_owner_token, else server.control_token)")
    p.add_argument("--owner", help="the alias owner's URL (default: ops.alias_owner_url; none: this process "
                                   "writes under the shared lock file)")
    verbs = p.add_subparsers(dest="verb", required=True)
    v = verbs.add_parser("list", help="versions with aliases, lineage, data window, acceptance")
    v.add_argument("--json", action="store_true")
    v = verbs.add_parser("show", help="everything about one version")
    v.add_argument("version", type=int)
    v.add_argument("--json", action="store_true")
    v = verbs.add_parser("promote", help="make a version champion (the old one becomes previous-champion)")
    v.add_argument("version", type=int)
    v.add_argument("--actor", help="who (default cli:<user>)")
    v.add_argument("--reason", default="")
    v.add_argument("--force", action="store_true", help="skip validating the artifact first")
    v.add_argument("--json", action="store_true")
    v = verbs.add_parser("rollback", help="champion back to previous-champion")
    v.add_argument("--actor")
    v.add_argument("--reason", default="")
    v.add_argument("--json", action="store_true")
    v = verbs.add_parser("diff", help="recorded metrics of two versions side by side")
    v.add_argument("version", type=int)
    v.add_argument("other", type=int)
    v.add_argument("--json", action="store_true")
    v = verbs.add_parser("history", help="recorded promote/rollback operations")
    v.add_argument("--json", action="store_true")
    v = verbs.add_parser("fleet", help="every engine replica x the version it serves, against champion")
    v.add_argument("--json", action="store_true")
    p.set_defaults(fn=fn)


def run_drafters(args: argparse.Namespace, cfg) -> int:
    """Run one verb; registry and engine problems print ``error: ...`` and return 2."""
    from tide.config import replace
    from tide.ops import inventory  # imported here: `tide --help` must not load torch or MLflow
    from tide.ops.alias_api import alias_writer
    from tide.ops.aliases import AliasError
    from tide.registry import Registry, RegistryError

    try:
        registry = Registry.from_config(cfg)
        engine = None
        if args.engine:
            engine = inventory.EngineClient(args.engine, args.token or cfg.server.control_token)
        if args.owner:
            cfg = replace(cfg, ops=replace(cfg.ops, alias_owner_url=args.owner))
        args.writer = alias_writer(cfg, registry, token=args.token)
        verb = {"list": _list, "show": _show, "promote": _promote, "rollback": _rollback,
                "diff": _diff, "history": _history, "fleet": _fleet}[args.verb]
        return verb(args, registry, engine)
    except (RegistryError, CommandError, AliasError, inventory.EngineRefused, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_ERROR


def _live(engine) -> dict[str, float]:
    if engine is None:
        return {}
    try:
        return engine.live_acceptance()
    except Exception as exc:  # noqa: BLE001 - the registry view is still useful
        print(f"warning: no live acceptance from {engine.url}: {exc}", file=sys.stderr)
        return {}


def _served(engine) -> str | None:
    if engine is None:
        return None
    try:
        return engine.serving()
    except Exception as exc:  # noqa: BLE001 - the registry view is still useful
        print(f"warning: no served version from {engine.url}: {exc}", file=sys.stderr)
        return None


def _actor(args: argparse.Namespace) -> str:
    return args.actor or f"cli:{getpass.getuser()}"


def _list(args, registry, engine) -> int:
    from tide.ops import inventory

    live, served = _live(engine), _served(engine)
    records = [inventory.version_record(v, live, served) for v in registry.list_versions()]
    if args.json:
        print(json.dumps(records, indent=1))
        return 0
    if not records:
        print(f"{registry.model_name}: no versions registered at {registry.shown_uri}")
    else:
        print(inventory.versions_table(records))
    if served is not None:
        print(f"engine {engine.url} serves drafter {served}")
    return 0


def _show(args, registry, engine) -> int:
    from tide.ops import inventory

    info = registry.get_version(args.version)
    live, served = _live(engine), _served(engine)
    if args.json:
        print(json.dumps({**inventory.version_record(info, live, served), "tags": dict(info.tags),
                          "metrics": dict(info.metrics), "params": dict(info.params)}, indent=1))
    else:
        print(inventory.show_text(info, live, registry.operations(), served))
    return 0


def _validate(registry, version: int) -> None:
    """Checksum, format and fit against the current champion (shapes, aux layers, vocab mapping)."""
    from tide.contracts import CHAMPION
    from tide.drafter.artifact import DrafterError, TargetSpec, load_drafter
    from tide.drafter.vocab import mapping_digest

    folder = registry.download(version)
    champion = registry.get_alias(CHAMPION)
    spec, vocab = None, None
    if champion is not None and champion.version != version:
        reference = load_drafter(registry.download(champion.version))
        s = reference.shape
        spec = TargetSpec(s.target_hidden_size, s.vocab_size, tuple(s.aux_layer_ids))
        vocab = mapping_digest(reference.d2t)
    try:
        load_drafter(folder, spec, vocab, require_checksum=True)
    except DrafterError as exc:
        raise CommandError(f"version {version} refused (use --force to promote anyway): {exc}") from exc


def _authorised_generation(args, engine) -> int:
    """Before anything is written: the engine accepts the token (with --engine), and the alias
    owner does (its first call); returns the alias generation the change is decided on."""
    if engine is not None:
        engine.ping()
    return args.writer.state()["generation"]


def _promote(args, registry, engine) -> int:
    generation = _authorised_generation(args, engine)
    registry.get_version(args.version)  # unknown versions fail here with a clear message
    if not args.force:
        _validate(registry, args.version)
    result = args.writer.promote(args.version, _actor(args), args.reason, expected_generation=generation)
    if not result.applied:
        raise CommandError(f"not promoted: {result.detail}")
    return _report_change(args, *result.moved, engine, "promoted", result.state.get("generation"))


def _rollback(args, registry, engine) -> int:
    generation = _authorised_generation(args, engine)
    result = args.writer.rollback(_actor(args), args.reason, expected_generation=generation)
    if not result.applied:
        raise CommandError(f"not rolled back: {result.detail}")
    return _report_change(args, *result.moved, engine, "rolled back", result.state.get("generation"))


def _report_change(args, old, new, engine, what: str, generation: int | None) -> int:
    outcome, code = _check_engine(engine)
    if args.json:
        print(json.dumps({"op": what, "from": old, "to": new, "generation": generation, "engine": outcome}, indent=1))
    else:
        print(f"champion: {old if old is not None else '-'} -> {new} ({what}; alias generation {generation})")
        if outcome is not None:
            print(f"engine {engine.url}: {outcome['status']} {outcome.get('version') or ''} "
                  f"{outcome.get('detail') or ''}")
    return code


def _check_engine(engine) -> tuple[dict | None, int]:
    """Ask a running engine to follow the alias now: (its answer, exit status)."""
    if engine is None:
        return None, 0
    import httpx

    from tide.ops.inventory import EngineRefused

    try:
        outcome = engine.check()
    except Exception as exc:  # noqa: BLE001 - the registry change stands; engines poll anyway
        status = "unauthorized" if isinstance(exc, EngineRefused) else \
            "unreachable" if isinstance(exc, httpx.TransportError) else "error"
        print(f"warning: the registry changed but {engine.url} could not be asked to check ({status}): {exc}",
              file=sys.stderr)
        return {"status": status, "detail": str(exc)}, 1
    return outcome, 0 if outcome["status"] in ("swapped", "unchanged") else 1


def _diff(args, registry, engine) -> int:
    from tide.ops import inventory

    rows = inventory.diff_rows(registry.get_version(args.version), registry.get_version(args.other))
    if args.json:
        print(json.dumps([dict(zip(("name", "a", "b", "delta"), row)) for row in rows], indent=1))
    else:
        print(inventory.rows_text(rows))
    return 0


def _fleet(args, registry, engine) -> int:
    from tide.ops.aliases import AliasOwner
    from tide.ops.fleet import Fleet, fleet_text

    if not isinstance(args.writer, AliasOwner):  # the owner's API: every replica reports there
        view = args.writer.fleet()
    elif engine is not None:
        fleet, state = Fleet(), args.writer.state()
        fleet.report(engine.rollout())
        view = fleet.view(state["champion"], state["generation"])
    else:
        raise CommandError("no alias owner (ops.alias_owner_url or --owner) to ask for the fleet, and no --engine")
    print(json.dumps(view, indent=1) if args.json else fleet_text(view))
    return 0


def _history(args, registry, engine) -> int:
    from tide.ops import inventory

    ops = registry.operations()
    if args.json:
        print(json.dumps(ops, indent=1))
    else:
        print("\n".join(inventory.operation_line(op) for op in ops) if ops else "no operations recorded")
    return 0
