"""One of test_alias_race.py's writer processes: random alias events against one registry, each
through the code path its real writer uses, one JSON line per event.

    python alias_race_worker.py CONFIG.yaml WORKER EVENTS SEED OUT.jsonl

- promote: ``tide drafters promote V`` (validates V, then asks the alias writer, fenced by the
  generation it read first), V any registered version;
- rollback: ``tide drafters rollback``;
- auto-promote: a retrain's end: register a challenger trained from the champion as read now
  (held-out numbers that the policy accepts or refuses), then the retrain's auto-promotion call;
- collapse: a replica's report of a collapse of the champion as it read it (or of any version).
The config decides the path: ``ops.alias_owner_url`` set (the owner's HTTP API) or not (an owner in
this process on the shared lock file). Outcomes: applied, not_applied, conflict (a lost race,
reported as "conflict ... retry"), unexpected (anything else: the test fails on it).
"""
from __future__ import annotations

import io
import json
import random
import sys
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import torch

torch.set_num_threads(1)


def main(config: str, worker: int, events: int, seed: int, out_path: str) -> int:
    from tide.cli import main as cli
    from tide.config import load_config
    from tide.contracts import CHALLENGER, CHAMPION, TAG_PARENT, TAG_PARENT_SIM_ACCEPT, TAG_SIM_ACCEPT
    from tide.ops.alias_api import alias_writer, auto_promote_after_retrain
    from tide.registry import Registry

    cfg = load_config(config, env={})
    registry = Registry.from_config(cfg)
    writer = alias_writer(cfg, registry)
    folder = Path(config).parent / "drafter"
    rng = random.Random(seed)

    def run_cli(*argv: str) -> dict:
        out, err = io.StringIO(), io.StringIO()
        with redirect_stdout(out), redirect_stderr(err):
            code = cli(["--config", config, "drafters", *argv, "--actor", f"w{worker}", "--json"])
        if code == 0:
            body = json.loads(out.getvalue())
            return {"outcome": "applied", "from": body["from"], "to": body["to"], "seq": body["generation"]}
        text = err.getvalue()
        kind = "conflict" if "conflict" in text and "retry" in text else \
            "not_applied" if "no previous champion" in text else "unexpected"
        return {"outcome": kind, "detail": text.strip()[-400:]}

    def auto_promote() -> dict:
        champion = registry.aliases().get(CHAMPION)
        run = registry.start_run(f"race-w{worker}", {"tide.kind": "retrain"})
        parent_sim = 1.5
        sim = parent_sim * rng.choice([1.2, 0.9])
        tags = {TAG_PARENT: str(champion), "tide.kind": "retrain", TAG_SIM_ACCEPT: round(sim, 3),
                TAG_PARENT_SIM_ACCEPT: parent_sim}
        version = registry.register(run.log_drafter(folder), tags, alias=CHALLENGER).version
        run.finish()
        result = auto_promote_after_retrain(registry, cfg)
        if "failed" in result.get("reason", ""):
            return {"outcome": "unexpected", "detail": result["reason"], "registered": version}
        if result.get("applied"):
            return {"outcome": "applied", "from": result["champion"], "to": result["challenger"],
                    "seq": result["generation"], "registered": version}
        return {"outcome": "not_applied", "detail": result["reason"], "registered": version}

    def collapse() -> dict:
        versions = [v.version for v in registry.list_versions(with_run=False)]
        read = registry.aliases().get(CHAMPION)
        version = read if rng.random() < 0.7 or not versions else rng.choice(versions)
        result = writer.report_collapse(version, f"collapse guard: drafter {version}: below floor", f"w{worker}")
        return {"outcome": "applied" if result.applied else "not_applied", "collapsed": version,
                "seq": result.state["generation"], "champion_after": result.state["champion"],
                "from": result.moved[0], "to": result.moved[1], "detail": result.detail}

    with open(out_path, "w") as out:
        for i in range(events):
            kind = rng.choice(["promote", "promote", "rollback", "auto-promote", "collapse"])
            try:
                if kind == "promote":
                    versions = [v.version for v in registry.list_versions(with_run=False)]
                    record = run_cli("promote", str(rng.choice(versions)))
                elif kind == "rollback":
                    record = run_cli("rollback")
                elif kind == "auto-promote":
                    record = auto_promote()
                else:
                    record = collapse()
            except Exception as exc:  # noqa: BLE001 - reported: the test fails on it
                record = {"outcome": "unexpected", "detail": f"{type(exc).__name__}: {exc}"}
            out.write(json.dumps({"worker": worker, "event": i, "kind": kind, **record}) + "\n")
            out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]))
