"""services/: each deployable service's service.yaml against the code and every deployment of it.

Each services/<name>/service.yaml is complete; its command runs a module of the package with flags
that module accepts, and its `tide` verb runs the same module; the ports it names are the config
fields' values (the Kubernetes ConfigMap's and compose's). Every container the Kubernetes variants
render (``kubectl kustomize``) and every TIDE container of services/compose.yaml matches its
service.yaml in command, image, ports, probes (compose: the readiness probe as healthcheck) and
environment; the retrain Job the scheduler builds runs the retrain's command. compose.yaml
validates against the Compose Specification's schema (tests/data/compose: no Docker engine here),
its config loads strictly, its addresses are its own services, its Prometheus scrapes each
service's metrics port and loads dashboards/prometheus-rules.yml. The services' metric prefixes
cover every metric tide/metrics.py defines.
"""
from __future__ import annotations

import importlib
import json
import re
import shlex
import subprocess
from pathlib import Path
from urllib.parse import urlsplit

import jsonschema
import pytest
import yaml
from kubernetes import client
from test_k8s_manifests import CONFIG_TEXT, ROOT
from test_k8s_stack import VARIANTS, containers, env_of

import tide.cli
import tide.metrics
from tide.config import load_config

SERVICES = ROOT / "services"
SPECS = {p.parent.name: yaml.safe_load(p.read_text()) for p in sorted(SERVICES.glob("*/service.yaml"))}
COMPOSE = yaml.safe_load((SERVICES / "compose.yaml").read_text())
KEYS = {"name", "build", "entrypoint", "ports", "probes", "environment", "metrics", "reads", "writes",
        "kubernetes", "compose"}
INFRA = {"mlflow"}  # Deployments that run no TIDE service (MLflow's own server)


def _config(tmp_path, text: str):
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return load_config(path, env={})


def _field(cfg, dotted: str):
    section, key = dotted.split(".")
    return getattr(getattr(cfg, section), key)


def _parses(command: list[str], entry: list[str]) -> None:
    """``command`` is ``entry`` plus flags its module accepts (a deployment may add its own)."""
    assert command[:len(entry)] == entry, (command, entry)
    python, dash_m, module, *_ = entry
    assert (python, dash_m) == ("python", "-m")
    args = command[3:]
    if module == "tide.cli":
        return  # the retrain: its verb is checked through tide's own parser below
    importlib.import_module(module).parse_args(args)  # SystemExit on a flag it does not take


def test_the_top_level_folders_hold_what_they_promise():
    assert set(SPECS) == {"engine", "engine-sglang", "ingest", "scheduler", "retrain", "page", "drafter"}
    assert sorted(p.name for p in (ROOT / "schemas").glob("*.json")) == ["parquet.schema.json",
                                                                         "record_value.schema.json"]
    assert {"tide.json", "prometheus-rules.yml", "prometheus-rules.test.yml"} <= {
        p.name for p in (ROOT / "dashboards").iterdir()}
    for name, spec in SPECS.items():
        assert set(spec) == KEYS and spec["name"] == name, name
        assert (ROOT / spec["build"]["dockerfile"]).is_file(), name


@pytest.mark.parametrize("name", sorted(SPECS))
def test_each_services_verb_and_command_run_the_same_module(name, tmp_path, capsys):
    spec = SPECS[name]
    entry = spec["entrypoint"]["command"]
    module = entry[2]
    _parses(entry, entry)
    verb = spec["entrypoint"]["verb"]
    if verb is not None:
        words = shlex.split(verb)
        assert words[0] == "tide"
        with pytest.raises(SystemExit) as done:
            tide.cli.main(words[1:] + ["--help"])
        assert done.value.code == 0
        usage = capsys.readouterr().out
        # a service verb prints its module's own help; a plain verb (train) its own options
        assert (f"usage: python -m {module} " in usage) if module != "tide.cli" else all(
            w in usage for w in words[1:])
    # each port the config sets has that value in the ConfigMap and in compose's config
    k8s_cfg = _config(tmp_path, CONFIG_TEXT)
    compose_cfg = _config(tmp_path, (SERVICES / "compose.d" / "config.yaml").read_text())
    for port in spec["ports"].values():
        if "config" in port:
            assert _field(k8s_cfg, port["config"]) == _field(compose_cfg, port["config"]) == port["port"]
    for probe in spec["probes"].values():
        assert probe["port"] in spec["ports"] and probe["path"].startswith("/")


def _matching(dep: dict, c: dict) -> list[str]:
    return [n for n, s in SPECS.items() if s["kubernetes"]["name"] == dep["metadata"]["name"]
            and c["command"][:len(s["entrypoint"]["command"])] == s["entrypoint"]["command"]]


def _check_container(spec: dict, c: dict) -> None:
    _parses(c["command"], spec["entrypoint"]["command"])
    assert c["name"] == spec["kubernetes"]["container"]
    assert c["image"].rpartition(":")[0] == spec["build"]["image"].rpartition(":")[0]
    assert {p["name"]: p["containerPort"] for p in c.get("ports", [])} == {
        n: p["port"] for n, p in spec["ports"].items()}
    probes = {k.removesuffix("Probe"): v["httpGet"] for k, v in c.items() if k.endswith("Probe")}
    assert probes == {k: {"path": v["path"], "port": v["port"]} for k, v in spec["probes"].items()}
    env = env_of(c)
    for var, want in spec["environment"].items():
        got = env[var]
        if "secret" in want:
            ref = got["valueFrom"]["secretKeyRef"]
            assert f"{ref['name']}/{ref['key']}" == want["secret"] and ref.get("optional", False) == want.get(
                "optional", False), var
        else:
            assert got["value"] == want["value"], var


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_kubernetes_container_matches_its_service_yaml(variant):
    for dep, c in containers(variant):
        if dep["metadata"]["name"] in INFRA:
            continue
        (name,) = _matching(dep, c)  # exactly one service.yaml describes it
        assert SPECS[name]["kubernetes"]["kind"] == "Deployment"
        _check_container(SPECS[name], c)


def test_every_deployable_service_is_deployed_somewhere():
    deployed = {n for v in VARIANTS for dep, c in containers(v) if dep["metadata"]["name"] not in INFRA
                for n in _matching(dep, c)}
    assert deployed == {n for n, s in SPECS.items() if s["kubernetes"]["kind"] == "Deployment"}


def test_the_retrain_job_the_scheduler_builds_runs_the_retrain_command(tmp_path):
    from tide.schedule.kubernetes_launcher import build_job, job_env

    spec = SPECS["retrain"]
    cfg = _config(tmp_path, CONFIG_TEXT)
    job = client.ApiClient().sanitize_for_serialization(build_job(cfg.schedule, "20250101-000000-abc123", job_env(cfg)))
    assert spec["kubernetes"]["kind"] == job["kind"] == "Job"
    assert job["metadata"]["name"].startswith(spec["kubernetes"]["name"] + "-")
    (c,) = job["spec"]["template"]["spec"]["containers"]
    assert c["image"] == cfg.schedule.k8s_image == spec["build"]["image"]
    _check_container(spec, c)
    assert c["command"] == spec["entrypoint"]["command"]
    # a local launch (compose) runs the same command line: the configured one
    assert [("python" if a == "{python}" else a) for a in cfg.schedule.command] == c["command"][:5]


def _compose_tide_services() -> dict[str, dict]:
    return {n: s for n, s in COMPOSE["services"].items() if s.get("command", [None])[:2] == ["python", "-m"]
            and s["command"][2].startswith("tide.")}


def test_compose_validates_against_the_compose_specification():
    schema = json.loads((ROOT / "tests" / "data" / "compose" / "compose-spec.json").read_text())
    jsonschema.Draft7Validator(schema).validate(COMPOSE)
    bad = json.loads(json.dumps(COMPOSE))
    bad["services"]["engine"]["helthcheck"] = {}
    with pytest.raises(jsonschema.ValidationError):  # the schema refuses unknown keys
        jsonschema.Draft7Validator(schema).validate(bad)
    for svc in COMPOSE["services"].values():  # every bind-mounted file exists
        for volume in svc.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (SERVICES / source).resolve().is_file(), volume


def test_compose_runs_each_service_as_its_service_yaml_says():
    tide_services = _compose_tide_services()
    assert set(tide_services) == {s["compose"] for s in SPECS.values() if s["compose"]}
    for name, spec in SPECS.items():
        if not spec["compose"]:
            continue
        svc = tide_services[spec["compose"]]
        _parses(svc["command"], spec["entrypoint"]["command"])
        assert svc["image"] == spec["build"]["image"] and svc["read_only"] and svc["user"] == "10001:10001"
        assert {int(p) for p in svc.get("expose", [])} == {p["port"] for p in spec["ports"].values()}, name
        ready = spec["probes"]["readiness"]
        test = " ".join(svc["healthcheck"]["test"])
        assert f"http://127.0.0.1:{spec['ports'][ready['port']]['port']}{ready['path']}'" in test, name
        mounts = {v.split(":")[1]: v.split(":")[0] for v in svc.get("volumes", [])}
        assert mounts.get("/etc/tide/config.yaml") == "./compose.d/config.yaml", name
        for var, want in spec["environment"].items():
            assert want.get("optional") or var in svc.get("environment", {}), (name, var)


def test_compose_addresses_are_its_own_services(tmp_path):
    from mlflow.server.security_utils import is_allowed_host_header

    cfg = _config(tmp_path, (SERVICES / "compose.d" / "config.yaml").read_text())
    host, _, port = cfg.kafka.bootstrap_servers.partition(":")
    broker = COMPOSE["services"][host]["environment"]
    assert f"PLAINTEXT://{host}:{port}" in broker["KAFKA_ADVERTISED_LISTENERS"].split(",")
    assert cfg.ingest.replication_factor == 1  # one broker
    url = urlsplit(cfg.registry.tracking_uri)
    argv = COMPOSE["services"][url.hostname]["command"]
    assert f"--port {url.port} " in " ".join(argv) + " "
    assert is_allowed_host_header(argv[argv.index("--allowed-hosts") + 1].split(","), url.netloc)
    # the dataset and the scheduler's state on volumes, as on Kubernetes
    volumes = {n: {v.split(":")[1] for v in s.get("volumes", [])} for n, s in COMPOSE["services"].items()}
    assert cfg.ingest.data_dir in volumes["ingest"] & volumes["scheduler"]
    assert str(Path(cfg.schedule.state_path).parent) in volumes["scheduler"]
    page = COMPOSE["services"]["page"]["command"]
    scheduler_url = urlsplit(page[page.index("--scheduler") + 1])
    assert scheduler_url.hostname in COMPOSE["services"] and scheduler_url.port == cfg.schedule.metrics_port


def test_compose_prometheus_scrapes_every_metrics_port_and_loads_the_rules(tmp_path):
    from test_dashboards import promtool

    prom = yaml.safe_load((SERVICES / "compose.d" / "prometheus.yml").read_text())
    targets = {t for job in prom["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]}
    want = {f"{s['compose']}:{s['ports'][s['metrics']['port']]['port']}" for s in SPECS.values()
            if s["metrics"] and s["compose"]}
    assert targets == want
    mounts = {v.split(":")[1]: v.split(":")[0] for v in COMPOSE["services"]["prometheus"]["volumes"]}
    (rule_file,) = prom["rule_files"]
    assert (SERVICES / mounts[rule_file]).resolve() == ROOT / "dashboards" / "prometheus-rules.yml"
    # promtool checks the config with the rule file where this checkout has it
    prom["rule_files"] = [str(ROOT / "dashboards" / "prometheus-rules.yml")]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(prom))
    out = subprocess.run([promtool(), "check", "config", str(tmp_path / "prometheus.yml")], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_services_metric_prefixes_cover_every_tide_metric():
    defined = set(re.findall(r'"(tide_[a-z_]+)"', Path(tide.metrics.__file__).read_text()))
    families = {f: n for n, s in SPECS.items() if s["metrics"] and n != "engine-sglang"
                for f in s["metrics"]["families"]}
    assert SPECS["engine-sglang"]["metrics"]["families"] == SPECS["engine"]["metrics"]["families"]
    for metric in defined:
        assert [f for f in families if metric.startswith(f)], f"{metric}: no service exports it"
    for family in families:
        assert [m for m in defined if m.startswith(family)], f"{family}: no such metrics"
