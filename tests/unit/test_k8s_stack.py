"""Every k8s/ variant as ``kubectl kustomize`` renders it, and the stack's components against the code.

Each kustomization that is not a component (k8s/, k8s/overlays/*) renders offline; every document
validates strictly: core kinds against the Kubernetes client's models (unknown fields refused),
custom resources against their operators' CRD schemas vendored in tests/data/crds (unknown fields
refused, as the API server's strict field validation does). Every pod meets the restricted Pod
Security Standard and every TIDE_* variable names a config field and parses. The components agree
with the ConfigMap's config: the Strimzi topics are those ingest would create and each KafkaUser's
ACLs name the config's topics and group; the MLflow Service is the tracking URI and the server
admits its Host; ServiceMonitors reach each service's /metrics port; the PrometheusRule and the
Grafana ConfigMap are dashboards/ (k8s/generate.py's output is current); the page's flags reach the
scheduler's Service; the object store settings reach ingest and the scheduler by reference.
"""
from __future__ import annotations

import functools
import importlib.util
import json
import shutil
import subprocess
from urllib.parse import urlsplit

import jsonschema
import pytest
import yaml
from kubernetes import client
from test_k8s_manifests import CONFIG_TEXT, K8S, ROOT, assert_restricted

from tide.config import TideConfig, load_config

CRDS = ROOT / "tests" / "data" / "crds"
DASHBOARDS = ROOT / "dashboards"
VARIANTS = sorted(str(p.parent.relative_to(ROOT)) for p in K8S.rglob("kustomization.yaml")
                  if yaml.safe_load(p.read_text())["kind"] == "Kustomization")
COMPONENTS = sorted(str(p.parent.relative_to(ROOT)) for p in K8S.rglob("kustomization.yaml")
                    if yaml.safe_load(p.read_text())["kind"] == "Component")


def kubectl() -> str:
    path = shutil.which("kubectl")
    if path is None:  # a failure, not a skip: every variant must be rendered by kustomize
        pytest.fail("kubectl not found: install kubectl (1.27 or later: kustomize v5 with components)")
    return path


@functools.cache
def render(variant: str) -> tuple[dict, ...]:
    out = subprocess.run([kubectl(), "kustomize", str(ROOT / variant)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, f"kubectl kustomize {variant}:\n{out.stderr}"
    return tuple(d for d in yaml.safe_load_all(out.stdout) if d)


def named(variant: str, kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in render(variant) if d["kind"] == kind}


def _strict(schema: dict) -> dict:
    """A CRD schema that refuses fields it does not declare, except where it keeps unknown fields."""
    s = dict(schema)
    if "properties" in s:
        s["properties"] = {k: _strict(v) for k, v in s["properties"].items()}
        if s.get("type") == "object" and "additionalProperties" not in s \
                and not s.get("x-kubernetes-preserve-unknown-fields"):
            s["additionalProperties"] = False
    for key in ("items", "additionalProperties", "not"):
        if isinstance(s.get(key), dict):
            s[key] = _strict(s[key])
    for key in ("allOf", "anyOf", "oneOf"):
        if key in s:
            s[key] = [_strict(x) for x in s[key]]
    return s


@functools.cache
def crd_validators() -> dict[tuple[str, str], jsonschema.Draft7Validator]:
    out = {}
    for path in CRDS.glob("*.json"):
        group, version, kind = path.stem.split("_")
        out[(f"{group}/{version}", kind)] = jsonschema.Draft7Validator(_strict(json.loads(path.read_text())))
    return out


def validate(doc: dict) -> None:
    """Raises (pydantic or jsonschema) when ``doc`` would not pass strict validation."""
    validator = crd_validators().get((doc["apiVersion"], doc["kind"]))
    if validator is not None:
        client.V1ObjectMeta.model_validate(doc["metadata"])
        validator.validate(doc)
    else:
        group = doc["apiVersion"].rpartition("/")[0]
        built_in = "." not in group or group.endswith(".k8s.io")  # "", apps, batch, networking.k8s.io, ...
        assert built_in, f"no vendored CRD schema for {doc['apiVersion']} {doc['kind']}"
        getattr(client, "V1" + doc["kind"]).model_validate(doc)  # pydantic, extra keys forbidden


def config(tmp_path, env: dict[str, str] | None = None) -> TideConfig:
    path = tmp_path / "config.yaml"
    path.write_text(CONFIG_TEXT)
    return load_config(path, env=env or {})


def containers(variant: str):
    for dep in named(variant, "Deployment").values():
        for c in dep["spec"]["template"]["spec"]["containers"]:
            yield dep, c


def env_of(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


def test_the_variants_and_components_are_all_there():
    assert {"k8s", "k8s/overlays/stack", "k8s/overlays/stack-external", "k8s/overlays/sglang-nvidia"} <= set(VARIANTS)
    used = {str((ROOT / v / c).resolve().relative_to(ROOT)) for v in VARIANTS
            for c in yaml.safe_load((ROOT / v / "kustomization.yaml").read_text()).get("components", [])}
    assert set(COMPONENTS) <= used, f"components no variant renders: {set(COMPONENTS) - used}"
    assert {"k8s/components/strimzi-kafka", "k8s/components/mlflow", "k8s/components/monitoring",
            "k8s/components/page", "k8s/components/object-store"} <= set(COMPONENTS)


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_variant_renders_and_validates_strictly(variant, tmp_path):
    docs = render(variant)
    keys = [(d["kind"], d["metadata"]["name"]) for d in docs]
    assert len(keys) == len(set(keys)), "an object rendered twice"
    for doc in docs:
        validate(doc)
        assert doc["kind"] == "Namespace" or doc["metadata"]["namespace"] == "tide", doc["metadata"]
    for name, dep in named(variant, "Deployment").items():
        assert_restricted(f"{variant}: {name}", dep["spec"]["template"]["spec"])
    fields = {name: set(section) for name, section in TideConfig().model_dump().items() if isinstance(section, dict)}
    for _, c in containers(variant):
        for name, e in env_of(c).items():
            if "__" in name and name.startswith("TIDE_"):
                section, _, key = name[len("TIDE_"):].lower().partition("__")
                assert key in fields[section], name
                config(tmp_path, {name: e.get("value", "from-a-reference")})  # ConfigError if it does not parse


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_variant_runs_two_engine_replicas_under_a_disruption_budget(variant):
    dep = named(variant, "Deployment")["tide-engine"]
    pdb = named(variant, "PodDisruptionBudget")["tide-engine"]
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert dep["spec"]["replicas"] == 2 and dep["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert pdb["spec"]["minAvailable"] < dep["spec"]["replicas"]


def test_strict_validation_refuses_what_the_api_server_would():
    """The validator is not vacuous: a misspelled field fails in a custom resource and a core kind."""
    docs = render("k8s/overlays/stack")
    cases = [("Kafka", lambda d: d["spec"]["kafka"]["listeners"][0].update(tsl=False)),
             ("KafkaTopic", lambda d: d["spec"].update(partition=4)),
             ("ServiceMonitor", lambda d: d["spec"]["endpoints"][0].update(paths="/metrics")),
             ("PrometheusRule", lambda d: d["spec"]["groups"][0].update(rule=[])),
             ("Deployment", lambda d: d["spec"]["template"]["spec"]["containers"][0].update(imagePolicy="x"))]
    for kind, mutate in cases:
        doc = json.loads(json.dumps(next(d for d in docs if d["kind"] == kind)))
        validate(doc)
        mutate(doc)
        with pytest.raises((jsonschema.ValidationError, ValueError)):  # pydantic's error is a ValueError
            validate(doc)


def test_the_strimzi_topics_and_users_are_the_ones_tide_uses(tmp_path):
    from tide.dataset.topics import wanted_topics

    variant = "k8s/overlays/stack"
    (kafka,) = named(variant, "Kafka").values()
    cluster = kafka["metadata"]["name"]
    for kind in ("KafkaNodePool", "KafkaTopic", "KafkaUser"):
        assert all(d["metadata"]["labels"]["strimzi.io/cluster"] == cluster for d in named(variant, kind).values())
    # the engine and ingest reach the plain listener through the bootstrap Service Strimzi makes
    plain = next(lst for lst in kafka["spec"]["kafka"]["listeners"] if "authentication" not in lst)
    bootstrap = f"{cluster}-kafka-bootstrap.tide.svc:{plain['port']}"
    deps = named(variant, "Deployment")
    kafka_clients = {"tide-engine", "tide-ingest"}
    for name in kafka_clients:
        (c,) = deps[name]["spec"]["template"]["spec"]["containers"]
        assert env_of(c)["TIDE_KAFKA__BOOTSTRAP_SERVERS"]["value"] == bootstrap, name
    # Strimzi's NetworkPolicy for that listener admits exactly those pods
    peers = [p["podSelector"]["matchLabels"] for p in plain["networkPolicyPeers"]]
    admitted = {n for n, d in deps.items() if any(s.items() <= d["spec"]["template"]["metadata"]["labels"].items()
                                                for s in peers)}
    assert admitted == kafka_clients
    # the topics as ingest would create them; the topic operator owns them, so ingest does not
    (ingest,) = deps["tide-ingest"]["spec"]["template"]["spec"]["containers"]
    cfg = config(tmp_path, {k: e["value"] for k, e in env_of(ingest).items() if "value" in e})
    assert cfg.ingest.create_topics is False
    topics = {t["spec"]["topicName"]: t["spec"] for t in named(variant, "KafkaTopic").values()}
    wanted = {t.name: t for t in wanted_topics(cfg.ingest, cfg.kafka)}
    assert set(topics) == set(wanted) == {cfg.kafka.topic, cfg.kafka.dead_letter_topic}
    for name, spec in topics.items():
        assert (spec["partitions"], spec["replicas"]) == (wanted[name].num_partitions, wanted[name].replication_factor)
        assert str(spec["config"]["retention.ms"]) == wanted[name].topic_configs["retention.ms"]
        assert spec["config"]["max.message.bytes"] > cfg.capture.max_message_bytes
    (pool,) = named(variant, "KafkaNodePool").values()
    assert "broker" in pool["spec"]["roles"] and pool["spec"]["replicas"] >= cfg.ingest.replication_factor
    assert kafka["spec"]["kafka"]["config"]["min.insync.replicas"] < cfg.ingest.replication_factor
    # each user's ACLs: what its service does with the config's topics and group, nothing else
    acls = {name: {(a["resource"]["type"], a["resource"]["name"], op) for a in u["spec"]["authorization"]["acls"]
                   for op in a["operations"]} for name, u in named(variant, "KafkaUser").items()}
    topic, dead, group = cfg.kafka.topic, cfg.kafka.dead_letter_topic, cfg.ingest.group_id
    assert acls == {
        "tide-engine": {("topic", topic, "Write"), ("topic", topic, "Describe")},
        "tide-ingest": {("topic", topic, "Read"), ("topic", topic, "Describe"), ("group", group, "Read"),
                        ("topic", dead, "Write"), ("topic", dead, "Describe")}}


def test_the_mlflow_server_is_the_configmaps_registry_and_admits_its_host(tmp_path):
    from mlflow.server.security_utils import is_allowed_host_header

    cfg, variant = config(tmp_path), "k8s/overlays/stack"
    url = urlsplit(cfg.registry.tracking_uri)
    name, namespace = url.hostname.split(".")[:2]
    service = named(variant, "Service")[name]
    assert namespace == "tide" and url.port in {p["port"] for p in service["spec"]["ports"]}
    dep = named(variant, "Deployment")[name]
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    registry_policy = named(variant, "NetworkPolicy")["tide-registry"]
    assert registry_policy["spec"]["podSelector"]["matchLabels"].items() <= labels.items()
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    argv = c["command"]
    allowed = argv[argv.index("--allowed-hosts") + 1].split(",")
    assert is_allowed_host_header(allowed, url.netloc)  # MLflow's own Host check
    assert not is_allowed_host_header(allowed, "attacker.example:5000")
    # mlflow-artifacts:/ resolves only on a server that serves artifacts
    assert cfg.registry.artifact_location.startswith("mlflow-artifacts:") and "--serve-artifacts" in argv
    refs = {n: e["valueFrom"]["secretKeyRef"] for n, e in env_of(c).items() if "secretKeyRef" in e.get("valueFrom", {})}
    for flag, var in (("--backend-store-uri", "MLFLOW_BACKEND_STORE_URI"),
                      ("--artifacts-destination", "MLFLOW_ARTIFACTS_DESTINATION")):
        assert argv[argv.index(flag) + 1] == f"$({var})" and refs[var]["name"] == "tide-mlflow-store"
        assert not refs[var].get("optional")  # no server on a store nobody named
    claims = {v["persistentVolumeClaim"]["claimName"] for v in dep["spec"]["template"]["spec"]["volumes"]
              if "persistentVolumeClaim" in v}
    assert claims <= set(named(variant, "PersistentVolumeClaim"))


def _load_generator():
    spec = importlib.util.spec_from_file_location("k8s_generate", K8S / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("variant", ["k8s/overlays/stack", "k8s/overlays/stack-external"])
def test_monitoring_scrapes_every_metrics_port_and_carries_the_dashboards(variant):
    services, deps = named(variant, "Service"), named(variant, "Deployment")
    scraped = set()
    for sm in named(variant, "ServiceMonitor").values():
        selector = sm["spec"]["selector"]["matchLabels"]
        (svc,) = [s for s in services.values() if selector.items() <= s["metadata"]["labels"].items()]
        (dep,) = [d for d in deps.values()
                  if svc["spec"]["selector"].items() <= d["spec"]["template"]["metadata"]["labels"].items()]
        (c,) = dep["spec"]["template"]["spec"]["containers"]
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        for ep in sm["spec"]["endpoints"]:
            (sp,) = [p for p in svc["spec"]["ports"] if p["name"] == ep["port"]]
            # the port the Deployment says its /metrics is on
            annotations = dep["spec"]["template"]["metadata"]["annotations"]
            assert ports[sp["targetPort"]] == int(annotations["prometheus.io/port"]) and ep["path"] == "/metrics"
        scraped.add(dep["metadata"]["name"])
    assert scraped == {"tide-engine", "tide-ingest", "tide-scheduler"}
    (rule,) = named(variant, "PrometheusRule").values()
    assert rule["spec"]["groups"] == yaml.safe_load((DASHBOARDS / "prometheus-rules.yml").read_text())["groups"]
    dashboard = named(variant, "ConfigMap")["tide-grafana-dashboard"]
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert dashboard["data"]["tide.json"] == (DASHBOARDS / "tide.json").read_text()
    stale = [str(p) for p, text in _load_generator().render().items() if p.read_text() != text]
    assert not stale, "run python3 k8s/generate.py"


def test_the_page_reads_the_stacks_scheduler_and_registry():
    from tide.services import page

    variant = "k8s/overlays/stack"
    dep = named(variant, "Deployment")["tide-page"]
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    python, dash_m, module, *args = c["command"]
    assert (python, dash_m, module) == ("python", "-m", "tide.services.page")
    flags = page.parse_args(args)
    assert flags.host == "0.0.0.0" and flags.port == c["ports"][0]["containerPort"]
    url = urlsplit(flags.scheduler)
    svc = named(variant, "Service")[url.hostname.split(".")[0]]
    assert url.port in {p["port"] for p in svc["spec"]["ports"]}
    assert svc["spec"]["selector"] == {"app.kubernetes.io/name": "tide-scheduler"}
    assert urlsplit(flags.prometheus).scheme == "http"
    labels = dep["spec"]["template"]["metadata"]["labels"]
    registry = named(variant, "NetworkPolicy")["tide-registry"]
    peers = [p["podSelector"]["matchLabels"] for rule in registry["spec"]["ingress"] for p in rule["from"]]
    assert any(p.items() <= labels.items() for p in peers)  # the registry panel reaches MLflow


def test_object_store_settings_reach_the_dataset_services_by_reference():
    from tide.redact import looks_secret

    for variant in ("k8s/overlays/stack", "k8s/overlays/stack-external"):
        store = named(variant, "ConfigMap")["tide-object-store"]["data"]
        for name in ("tide-ingest", "tide-scheduler"):
            (c,) = named(variant, "Deployment")[name]["spec"]["template"]["spec"]["containers"]
            env = env_of(c)
            for var in ("AWS_ENDPOINT_URL", "AWS_REGION", "TIDE_INGEST__DATA_DIR"):
                ref = env[var]["valueFrom"]["configMapKeyRef"]
                assert ref["name"] == "tide-object-store" and ref["key"] in store, (name, var)
            for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
                assert looks_secret(var) and env[var]["valueFrom"]["secretKeyRef"]["name"] == "tide-object-store"
        assert urlsplit(store["dataset-uri"]).scheme == "s3"
    for variant in VARIANTS:  # no credential is ever a plain value
        for dep, c in containers(variant):
            assert not [n for n, e in env_of(c).items() if looks_secret(n) and "value" in e], (variant, dep["metadata"])
