"""`tide drafters`: list, show, promote, rollback, diff, history and fleet against a real registry, the
alias owner and engines, authorised before anything is written (ops_stack.py: the stack these run on)."""
from __future__ import annotations

import io
import json
import uuid
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import httpx
from ops_stack import (
    TOKEN,
    Stack,
    as_overrides,
    bad_version,
    make_config,
    perturbed,
    register,
)

from tide.config import load_config
from tide.contracts import (
    CHALLENGER,
    CHAMPION,
    TAG_PARENT_SIM_ACCEPT,
    TAG_SIM_ACCEPT,
)
from tide.drafter.artifact import save_drafter
from tide.ops.alias_api import AliasApiServer
from tide.ops.aliases import AliasOwner, default_lock_path
from tide.ops.inventory import live_acceptance_from_metrics
from tide.registry import Registry


def run_cli(cfg_path: Path, *argv: str) -> tuple[int, str, str]:
    from tide.cli import main
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = main(["--config", str(cfg_path), "drafters", *argv])
    return code, out.getvalue(), err.getvalue()


def test_cli_list_show_promote_rollback_diff(make_stack, tiny, tmp_path):
    import yaml

    s = make_stack()
    cfg_path = tmp_path / "tide.yaml"
    cfg_path.write_text(yaml.safe_dump({"home": s.cfg.home, "registry": as_overrides(s.cfg)["registry"]}))
    v2 = register(s.registry, save_drafter(perturbed(tiny, 11), tiny.root / "cli-v2"),
                  {TAG_SIM_ACCEPT: 1.7, TAG_PARENT_SIM_ACCEPT: 1.5, "tide.data_window_start_s": 1.7e9,
                   "tide.data_window_end_s": 1.7e9 + 3600})
    s.traffic()
    code, out, _ = run_cli(cfg_path, "--engine", s.url, "list")
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split()[:4] == ["version", "aliases", "kind", "parent"]
    row2, row1 = lines[1].split(), lines[2].split()
    assert row2[:4] == [str(v2), CHALLENGER, "retrain", "1"] and "1.700" in row2 and "1.500" in row2
    assert row1[:3] == ["1", CHAMPION, "static"] and "2023-11-14" in lines[1]
    # the /metrics page is process-wide here (every test's engine serves a version "1")
    live = live_acceptance_from_metrics(httpx.get(f"{s.url}/metrics").text)["1"]
    assert f"{live:.3f}" in lines[2]
    code, out, _ = run_cli(cfg_path, "--engine", s.url, "--token", TOKEN, "promote", str(v2),
                           "--actor", "dave", "--reason", "better on code")
    assert code == 0 and f"champion: 1 -> {v2}" in out and f"swapped {v2}" in out, out
    assert s.serving() == str(v2)
    code, out, _ = run_cli(cfg_path, "show", str(v2))
    assert code == 0 and "champion" in out and "promote" in out and "by dave" in out
    code, out, _ = run_cli(cfg_path, "diff", "1", str(v2))
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines()}
    assert code == 0 and rows["version"] == ["1", str(v2)] and rows["sim_accept_length"] == ["-", "1.7000"]
    assert rows["parent_sim_accept_length"] == ["-", "1.5000"]
    code, out, _ = run_cli(cfg_path, "--engine", s.url, "--token", TOKEN, "rollback", "--actor", "dave")
    assert code == 0 and f"champion: {v2} -> 1" in out and s.serving() == "1"
    code, out, _ = run_cli(cfg_path, "history")
    assert code == 0 and len(out.splitlines()) == 2 and "rollback" in out.splitlines()[1]
    code, _, err = run_cli(cfg_path, "show", "42")
    assert code == 2 and "no version 42" in err
    code, _, err = run_cli(cfg_path, "promote", "42")
    assert code == 2 and "no version 42" in err
    bad = bad_version("vocab_mapping", tiny, s.registry)
    code, _, err = run_cli(cfg_path, "promote", str(bad))
    assert code == 2 and "refused" in err and "vocab mapping" in err
    assert s.registry.aliases()[CHAMPION] == 1
    code, out, _ = run_cli(cfg_path, "list", "--json")
    assert code == 0 and {r["version"] for r in json.loads(out)} == {1, v2, bad}
    # every verb scripts with --json
    code, out, _ = run_cli(cfg_path, "history", "--json")
    assert code == 0 and [op["op"] for op in json.loads(out)] == ["promote", "rollback"]
    code, out, _ = run_cli(cfg_path, "diff", "1", str(v2), "--json")
    assert code == 0 and {r["name"]: r["b"] for r in json.loads(out)}["sim_accept_length"] == "1.7000"
    code, out, _ = run_cli(cfg_path, "--engine", s.url, "--token", TOKEN, "promote", str(v2), "--json")
    change = json.loads(out)
    assert code == 0 and (change["from"], change["to"]) == (1, v2) and change["engine"]["status"] == "swapped"
    code, out, _ = run_cli(cfg_path, "rollback", "--json")
    assert code == 0 and json.loads(out) == {"op": "rolled back", "from": v2, "to": 1, "engine": None,
                                             "generation": len(s.registry.operations())}


def test_cli_alias_changes_are_authorised_before_anything_is_written(make_stack, tiny, tmp_path):
    """`tide drafters rollback --token wrong` moves nothing and says the token was refused, whether
    the change goes through the alias owner's API or this process checks the engine's token first."""
    import yaml

    s = make_stack()
    cfg_path = tmp_path / "tide.yaml"
    cfg_path.write_text(yaml.safe_dump({"home": s.cfg.home, "registry": as_overrides(s.cfg)["registry"]}))
    v2 = register(s.registry, save_drafter(perturbed(tiny, 15), tiny.root / "auth-v2"))
    s.registry.promote(v2, actor="setup")
    owner = AliasApiServer("127.0.0.1", 0, lambda: (True, {}),
                           lambda: AliasOwner(Registry.from_config(s.cfg), default_lock_path(s.cfg)), TOKEN).start()
    try:
        owner_url = f"http://127.0.0.1:{owner.port}"
        before = (s.registry.aliases(), s.registry.operations())
        for argv in (("--owner", owner_url, "--token", "wrong", "rollback"),
                     ("--owner", owner_url, "--token", "wrong", "promote", "1"),
                     ("--engine", s.url, "--token", "wrong", "rollback"),
                     ("--engine", s.url, "--token", "wrong", "promote", "1")):
            code, out, err = run_cli(cfg_path, *argv)
            assert code == 2 and "token" in err and "401" in err and "unreachable" not in err, (argv, err)
            assert (s.registry.aliases(), s.registry.operations()) == before, argv  # nothing was written
        code, out, err = run_cli(cfg_path, "--owner", owner_url, "--engine", s.url, "--token", TOKEN, "rollback",
                                 "--actor", "erin", "--json")
        assert code == 0 and json.loads(out)["engine"]["status"] in ("swapped", "unchanged"), err
        assert s.registry.aliases() == {CHAMPION: 1} and s.registry.operations()[-1]["actor"] == "erin"
        assert s.serving() == "1"
    finally:
        owner.close()


def test_replicas_report_to_the_fleet_view_through_the_alias_owner(tiny, store, tmp_path, wait):
    """Two engines following one registry through the alias owner's API: each reports the version it
    serves; `tide drafters fleet` shows them converging on a promotion made through one of them, and
    a replica that cannot load a version keeps the old one and says why."""
    import yaml

    owner = AliasApiServer("127.0.0.1", 0, lambda: (True, {}), lambda: AliasOwner(Registry.from_config(cfg)),
                           TOKEN).start()
    url = f"http://127.0.0.1:{owner.port}"
    cfg = make_config(tiny, store, tmp_path / "home", f"ops-{uuid.uuid4().hex[:8]}", alias_owner_url=url,
                      poll_interval_s=0.3)
    stacks: list[Stack] = []
    try:
        for port in (8000, 8001):  # the replica names hostname:server.port; both listen on free ports here
            stacks.append(Stack(load_config(env={}, overrides={**as_overrides(cfg), "server": {
                **as_overrides(cfg)["server"], "port": port}})))
        a, b = stacks
        registry = Registry.from_config(cfg)
        cfg_path = tmp_path / "tide.yaml"
        cfg_path.write_text(yaml.safe_dump({"home": cfg.home, "registry": as_overrides(cfg)["registry"]}))

        def fleet() -> dict:
            code, out, err = run_cli(cfg_path, "--owner", url, "--token", TOKEN, "fleet", "--json")
            assert code == 0, err
            return {r["replica"]: r for r in json.loads(out)["replicas"]}

        wait(lambda: len(fleet()) == 2 and all(r["converged"] for r in fleet().values()), 30,
             what="both replicas to report serving the champion")
        v2 = register(registry, save_drafter(perturbed(tiny, 16), tiny.root / "fleet-v2"))
        resp = a.control("POST", "promote", {"version": v2, "actor": "alice"})  # validated here, written by the owner
        assert resp.status_code == 200 and resp.json()["to"] == v2, resp.text
        wait(lambda: all(r["serving"] == str(v2) and r["converged"] for r in fleet().values()), 30,
             what="the fleet to converge on the promotion")
        assert all(r["converged_at_s"] >= r["serving_since_s"] for r in fleet().values())
        assert registry.operations()[-1]["actor"] == "api:alice"
        bad = bad_version("vocab_mapping", tiny, registry)
        code, _, err = run_cli(cfg_path, "--owner", url, "--token", TOKEN, "promote", str(bad), "--force")
        assert code == 0, err
        wait(lambda: all("vocab mapping" in (r["why_not"] or "") for r in fleet().values()), 30,
             what="both replicas to refuse the version and say why")
        assert {r["serving"] for r in fleet().values()} == {str(v2)} and a.serving() == b.serving() == str(v2)
        code, out, _ = run_cli(cfg_path, "--owner", url, "--token", TOKEN, "fleet")
        assert code == 0 and f"champion {bad}" in out and "cannot load" in out
    finally:
        for stack in stacks:
            stack.close()
        owner.close()
