"""The one alias writer against a real MLflow SQLite store: the ledger numbers every operation, a
stale writer loses with a conflict and writes nothing, a half-applied operation is rolled forward,
a collapse is rolled back once (to an earlier champion not trained from the collapsed drafter),
auto-promotion decides on the aliases as they are; and the owner's HTTP API refuses a wrong or
missing token before anything is written."""
from __future__ import annotations

import json
import uuid

import httpx
import pytest

from tide.config import RegistryConfig
from tide.contracts import CHALLENGER, CHAMPION, PREVIOUS_CHAMPION, TAG_PARENT, TAG_PARENT_SIM_ACCEPT, TAG_SIM_ACCEPT
from tide.drafter.artifact import save_drafter
from tide.ops.alias_api import AliasApiServer, AliasClient
from tide.ops.aliases import AliasAuthError, AliasConflict, AliasOwner
from tide.ops.fleet import Fleet, fleet_text, replica_record
from tide.registry import Registry, RegistryError
from tide.registry.ledger import APPLIED_TAG, seq_key

TOKEN = "owner-secret"


@pytest.fixture(scope="module")
def folder(tiny_drafter, tmp_path_factory):
    return save_drafter(tiny_drafter, tmp_path_factory.mktemp("drafter") / "d", metadata={"version": "static"})


@pytest.fixture
def registry(store, folder, tmp_path):
    root, uri = store
    cfg = RegistryConfig(tracking_uri=uri, registered_model_name=f"owner-{uuid.uuid4().hex[:8]}",
                         artifact_location=(root / "artifacts").as_uri(), cache_dir=str(tmp_path / "cache"))
    reg = Registry(cfg, tmp_path / "home")
    reg.ensure_bootstrap(folder)  # version 1, champion
    return reg


def register(registry, folder, parent: int | str, sim: float | None = None, parent_sim: float | None = None) -> int:
    run = registry.start_run("test", {"tide.kind": "retrain"})
    tags = {TAG_PARENT: str(parent), "tide.kind": "retrain"}
    if sim is not None:
        tags.update({TAG_SIM_ACCEPT: sim, TAG_PARENT_SIM_ACCEPT: parent_sim})
    version = registry.register(run.log_drafter(folder), tags, alias=CHALLENGER).version
    run.finish()
    return version


def chain(registry) -> list[tuple[int, str, int | None, int | None]]:
    return [(op["seq"], op["op"], op["from"], op["to"]) for op in registry.operations()]


def test_operations_are_one_numbered_sequence_and_a_stale_writer_loses(registry, folder, tmp_path):
    owner = AliasOwner(registry, tmp_path / "alias.lock")
    v2, v3 = register(registry, folder, 1), register(registry, folder, 1)
    seen = owner.state()["generation"]
    assert seen == 0 and owner.promote(v2, "alice", expected_generation=seen).applied
    # bob validated v3 against generation 0; alice's promotion came first
    with pytest.raises(AliasConflict, match="conflict.*retry"):
        owner.promote(v3, "bob", expected_generation=seen)
    with pytest.raises(AliasConflict):
        owner.rollback("bob", expected_generation=seen)
    assert registry.aliases() == {CHAMPION: v2, PREVIOUS_CHAMPION: 1, CHALLENGER: v3}  # nothing written
    done = owner.promote(v3, "bob", expected_generation=owner.state()["generation"])
    assert done.applied and done.moved == (v2, v3) and done.state["generation"] == 2
    back = owner.rollback("carol", "worse")
    assert back.applied and back.moved == (v3, v2) and registry.aliases() == {CHAMPION: v2}
    nothing = owner.rollback("carol")
    assert not nothing.applied and "no previous champion" in nothing.detail
    assert chain(registry) == [(1, "promote", 1, v2), (2, "promote", v2, v3), (3, "rollback", v3, v2)]
    last = registry.operations()[-1]
    assert last["aliases"] == {PREVIOUS_CHAMPION: None, CHAMPION: v2, CHALLENGER: None}
    with pytest.raises(RegistryError, match="no version 99"):
        owner.promote(99, "dave")


def test_an_operation_its_writer_did_not_finish_is_rolled_forward(registry, folder, tmp_path):
    owner = AliasOwner(registry, tmp_path / "alias.lock")
    v2 = register(registry, folder, 1)
    # a writer recorded operation 1 and died before writing the aliases
    record = {"seq": 1, "op": "promote", "actor": "dead", "from": 1, "to": v2, "reason": "", "at_s": 0.0,
              "aliases": {PREVIOUS_CHAMPION: 1, CHAMPION: v2, CHALLENGER: None}}
    registry.client.set_registered_model_tag(registry.model_name, seq_key(1), json.dumps(record))
    assert registry.aliases()[CHAMPION] == 1
    result = owner.rollback("next")  # the next writer applies operation 1 first, then its own
    assert result.applied and result.moved == (v2, 1) and result.state["generation"] == 2
    assert chain(registry) == [(1, "promote", 1, v2), (2, "rollback", v2, 1)]
    assert registry.client.get_registered_model(registry.model_name).tags[APPLIED_TAG] == "2"


def test_a_collapse_rolls_back_once_to_a_champion_not_trained_from_it(registry, folder, tmp_path):
    owner = AliasOwner(registry, tmp_path / "alias.lock")
    v2 = register(registry, folder, 1)
    owner.promote(v2, "op")
    v3 = register(registry, folder, v2, 1.9, 1.5)  # trained from v2, auto-promoted before v2's collapse is known
    assert owner.auto_promote(0.05).applied and registry.aliases()[PREVIOUS_CHAMPION] == v2
    first = owner.report_collapse(v2, "collapse guard: drafter 2: below floor", "replica-a")
    # champion v3 descends from v2; previous-champion is v2 itself: back to v1, the last good one
    assert first.applied and first.moved == (v3, 1) and registry.aliases() == {CHAMPION: 1}
    assert first.record["collapsed"] == v2 and first.record["replica"] == "replica-a"
    again = owner.report_collapse(v2, "collapse guard: drafter 2: below floor", "replica-b")
    assert not again.applied and "nothing to roll back" in again.detail  # decided once
    assert [(op["op"], op["actor"]) for op in registry.operations()] == [
        ("promote", "op"), ("promote", "auto-promotion"), ("rollback", "collapse-guard")]
    assert registry.get_version(v2).tags["tide.rolled_back"] and registry.get_version(v3).tags["tide.rolled_back"]
    # a retrain from the collapsed v2 finishing now is not promoted: the champion is no longer its parent
    v4 = register(registry, folder, v2, 2.5, 1.5)
    late = owner.auto_promote(0.05)
    assert not late.applied and f"trained from {v2}" in late.detail and registry.aliases()[CHALLENGER] == v4


def test_a_collapse_with_nothing_earlier_changes_nothing(registry, tmp_path):
    owner = AliasOwner(registry, tmp_path / "alias.lock")
    result = owner.report_collapse(1, "below floor", "r")
    assert not result.applied and "no earlier champion" in result.detail and registry.operations() == []


@pytest.fixture
def api(registry, tmp_path):
    server = AliasApiServer("127.0.0.1", 0, lambda: (True, {}), lambda: AliasOwner(registry, tmp_path / "alias.lock"),
                            TOKEN).start()
    yield f"http://127.0.0.1:{server.port}"
    server.close()


def test_the_api_refuses_a_wrong_token_before_anything_is_written(api, registry, folder):
    v2 = register(registry, folder, 1)
    for token in ("wrong", ""):
        client = AliasClient(api, token)
        with pytest.raises(AliasAuthError, match="refused the token.*nothing was changed"):
            client.promote(v2, "mallory")
        with pytest.raises(AliasAuthError):
            client.rollback("mallory")
        with pytest.raises(AliasAuthError):
            client.report_collapse(1, "fake", "x")
    assert registry.aliases() == {CHAMPION: 1, CHALLENGER: v2} and registry.operations() == []
    assert httpx.get(f"{api}/health", timeout=5).status_code == 200  # probes need no token
    good = AliasClient(api, TOKEN)
    generation = good.state()["generation"]
    assert good.promote(v2, "api:alice", expected_generation=generation).moved == (1, v2)
    with pytest.raises(AliasConflict, match="retry"):
        good.rollback("api:bob", expected_generation=generation)
    with pytest.raises(RegistryError, match="no version 77"):
        good.promote(77, "api:alice")
    assert [op["actor"] for op in good.operations()] == ["api:alice"]


def test_no_token_configured_refuses_every_change(registry, tmp_path):
    server = AliasApiServer("127.0.0.1", 0, lambda: (True, {}), lambda: AliasOwner(registry), "").start()
    try:
        with pytest.raises(AliasAuthError, match="no token configured"):
            AliasClient(f"http://127.0.0.1:{server.port}", "anything").rollback("x")
    finally:
        server.close()


def test_the_fleet_view_shows_each_replica_against_the_champion(api):
    client = AliasClient(api, TOKEN)
    client.report_replica(replica_record("engine-a:8000", "1", "1", "following", 100.0, 110.0, {}, None, 10.0))
    client.report_replica(replica_record("engine-b:8000", "1", "2", "refused", 100.0, None,
                                         {"2": "vocab mapping differs"}, None, 10.0))
    view = client.fleet()
    rows = {r["replica"]: r for r in view["replicas"]}
    assert view["champion"] == 1 and view["converged"] is True
    assert rows["engine-a:8000"]["converged"] and rows["engine-a:8000"]["converged_at_s"] == 110.0
    text = fleet_text(view)
    assert "engine-a:8000" in text and "engine-b:8000" in text and "champion 1" in text
    fleet = Fleet(clock=lambda: 1000.0)
    fleet.report({**replica_record("b", "1", "2", "refused", 1.0, None, {"2": "vocab mapping differs"}, None, 10.0)})
    row = fleet.view(2)["replicas"][0]
    assert not row["converged"] and row["why_not"] == "cannot load 2: vocab mapping differs"
    stale = Fleet(clock=iter([0.0, 100.0]).__next__)
    stale.report(replica_record("c", "2", "2", "following", 1.0, 1.0, {}, None, 10.0))
    assert stale.view(2)["replicas"][0]["stale"] is True


def test_the_page_shows_the_fleet_from_the_owner(api):
    from tide.services import page_data, page_html

    client = AliasClient(api, TOKEN)
    empty = page_data.fleet(page_data.Sources(fleet=client.fleet))
    assert not empty.has_data and "no engine replica has reported yet" in empty.reason
    client.report_replica(replica_record("engine-a:8000", "1", "1", "following", 100.0, 110.0, {}, None, 10.0))
    client.report_replica(replica_record("engine-b:8000", "2", "1", "following", 100.0, None, {}, None, 10.0))
    panel = page_data.fleet(page_data.Sources(fleet=client.fleet))
    assert panel.has_data and dict(panel.rows)["all converged"] == "no"
    assert [(r["replica"], r["serving"], r["converged"].split(",")[0]) for r in panel.table] == [
        ("engine-a:8000", "1", "yes"), ("engine-b:8000", "2", "no")]
    html = page_html.render([panel], 10, 1800)
    assert 'data-panel="fleet" data-has-data="true"' in html and "engine-b:8000" in html
    down = page_data.fleet(page_data.Sources(fleet=AliasClient(api, "wrong").fleet))
    assert not down.has_data and "refused the token" in down.reason
