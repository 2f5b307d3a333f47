"""dashboards/ (package data, tide.dashboards): every metric the Grafana dashboard and the Prometheus rules name is one TIDE
exports (tide/metrics.py), every query parses, and the rules compute what they claim
(``promtool test rules`` over synthetic series). promtool comes with the prometheus Debian
package that scripts/install.sh installs."""
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from prometheus_client import Counter, Gauge, Histogram

import tide.metrics
import tide.prometheus

DASHBOARDS = Path(tide.prometheus.RULES_PATH).parent
SUFFIXES = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}


def exported_series() -> set[str]:
    names = set()
    for obj in vars(tide.metrics).values():
        if isinstance(obj, (Counter, Gauge, Histogram)):
            names.update(obj._name + s for s in SUFFIXES[obj._type])
    return names


def dashboard() -> dict:
    return json.loads((DASHBOARDS / "tide.json").read_text())


def dashboard_exprs() -> list[str]:
    d = dashboard()
    exprs = [t["expr"] for p in d["panels"] for t in p.get("targets", [])]
    return exprs + [a["expr"] for a in d["annotations"]["list"]]


def recorded_series() -> set[str]:
    rules = yaml.safe_load((DASHBOARDS / "prometheus-rules.yml").read_text())
    return {r["record"] for g in rules["groups"] for r in g["rules"] if "record" in r}


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.fail("promtool not found: install the prometheus Debian package (scripts/install.sh does)")
    return path


@pytest.mark.parametrize("name", ["tide.json", "prometheus-rules.yml"])
def test_every_metric_named_is_exported_by_tide(name):
    text = (DASHBOARDS / name).read_text()
    used = set(re.findall(r"(?<![\w:])tide_[a-z0-9_]+", text))
    assert used, "no TIDE metric found: the pattern is wrong"
    assert used - exported_series() == set(), "names not defined in tide/metrics.py"


def test_dashboard_uses_only_recorded_series_that_the_rules_define():
    used = set(re.findall(r"tide:[a-z0-9_:]+", json.dumps(dashboard())))
    assert "tide:engine_accept_length_tokens:mean1m" in used  # the panel operators come for
    assert used <= recorded_series()


def test_dashboard_panels_are_well_formed():
    d = dashboard()
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))
    for p in d["panels"]:
        if p["type"] == "row":
            continue
        assert p["datasource"]["uid"] == "${datasource}", p["title"]  # works with any Prometheus
        assert p["targets"] and all(t["expr"].strip() for t in p["targets"]), p["title"]
        assert p["gridPos"]["x"] + p["gridPos"]["w"] <= 24, p["title"]


def test_every_dashboard_query_parses(tmp_path):
    # promtool parses rule files only: wrap each query as a recording rule
    rules = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"dashboard:query_{i}", "expr": e} for i, e in enumerate(dashboard_exprs())]}]}
    path = tmp_path / "queries.yml"
    path.write_text(yaml.safe_dump(rules))
    out = subprocess.run([promtool(), "check", "rules", str(path)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_rules_compute_acceptance_by_version_and_fire_alerts():
    out = subprocess.run([promtool(), "test", "rules", "prometheus-rules.test.yml"], cwd=DASHBOARDS,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout
