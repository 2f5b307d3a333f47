"""k8s/ against the code it deploys, without a cluster or kubectl.

Every YAML document validates against the Kubernetes client's models (a misspelled field fails as
kubectl's strict validation would); the kustomizations list every manifest and keep to kustomize's
loader rules; the ConfigMap's config.yaml passes tide.config's strict loader; every TIDE_* variable
in a manifest or overlay names a config field and parses; containers run the packaged services
(`python -m tide.services.X`) with flags they accept; ports, probes and scrape annotations match
the config and the services' routes; the scheduler's Role grants exactly KubernetesLauncher's API
calls; build_job over the ConfigMap's config (and the AMD overlay's env) asks for the GPU on the
training pool and mounts objects that exist; every tide_* metric named under k8s/ is in
tide/metrics.py; the Dockerfile installs the wheel and keeps the compiler out of the runtime stage.
Security: every pod (the Deployments' and the retrain Job's) meets the Pod Security Standard
"restricted" with a read-only root filesystem and a writable volume for each folder its process
writes; the Job mounts no service-account token and gets credentials only through secretKeyRef;
NetworkPolicies open the engine's control port and the registry only to the pods that need them.
"""
import copy
import importlib
import inspect
import math
import re
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml
from kubernetes import client

from tide.config import ConfigError, TideConfig, load_config
from tide.schedule import kubernetes_launcher
from tide.schedule.kubernetes_launcher import build_job, job_env

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "k8s"
BASE = K8S / "base"


def _docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


KUSTOMIZATION = _docs(BASE / "kustomization.yaml")[0]
OBJECTS = [d for name in KUSTOMIZATION["resources"] for d in _docs(BASE / name)]
AMD = _docs(K8S / "overlays" / "amd" / "kustomization.yaml")[0]
CPU = _docs(K8S / "overlays" / "cpu" / "kustomization.yaml")[0]
CONFIG_TEXT = next(d for d in OBJECTS if d["kind"] == "ConfigMap")["data"]["config.yaml"]


def _named(kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in OBJECTS if d["kind"] == kind}


def _containers(deployments=None):
    for dep in (deployments or _named("Deployment").values()):
        for c in dep["spec"]["template"]["spec"]["containers"]:
            yield dep, c


def _amd_scheduler(overlay=None) -> dict:
    """The overlay's patch applied to the base Deployment (strategic merge: containers and env by name)."""
    (p,) = (overlay or AMD)["patches"]
    dep = copy.deepcopy(_named("Deployment")[p["target"]["name"]])
    for pc in yaml.safe_load(p["patch"])["spec"]["template"]["spec"]["containers"]:
        (c,) = [c for c in dep["spec"]["template"]["spec"]["containers"] if c["name"] == pc["name"]]
        env = {e["name"]: e for e in c.get("env", [])} | {e["name"]: e for e in pc["env"]}
        c["env"] = list(env.values())
    return dep


def _config(tmp_path, env=None, text=None) -> TideConfig:
    f = tmp_path / "config.yaml"
    f.write_text(CONFIG_TEXT if text is None else text)
    return load_config(f, env=env or {})


def _env(container) -> dict[str, str]:
    # a Secret's value is not in the manifests: any string must do for the field's type
    return {e["name"]: e.get("value", "from-a-secret") for e in container.get("env", [])}


def test_manifests_parse_validate_and_are_all_listed():
    assert set(KUSTOMIZATION["resources"]) == {p.name for p in BASE.glob("*.yaml")} - {"kustomization.yaml"}
    assert _docs(K8S / "kustomization.yaml")[0]["resources"] == ["base"]  # kubectl apply -k k8s/
    assert AMD["resources"] == CPU["resources"] == ["../../base"]
    for kfile in K8S.rglob("kustomization.yaml"):
        for name in _docs(kfile)[0]["resources"]:
            # kustomize refuses a base that is the overlay's own folder or one above it (cycle
            # check), and files outside the kustomization's folder (LoadRestrictionsRootOnly)
            path = (kfile.parent / name).resolve()
            assert path.exists() and path not in [kfile.parent, *kfile.parent.parents], (kfile, name)
            assert path.is_dir() or kfile.parent in path.parents, (kfile, name)
    for doc in OBJECTS + [_amd_scheduler(), _amd_scheduler(CPU)]:
        getattr(client, "V1" + doc["kind"]).model_validate(doc)  # pydantic, extra keys forbidden
        assert doc["kind"] == "Namespace" or doc["metadata"]["namespace"] == KUSTOMIZATION["namespace"]


def test_configmap_config_loads_strictly(tmp_path):
    cfg = _config(tmp_path)
    assert cfg.schedule.launcher == "kubernetes" and cfg.schedule.k8s_namespace == KUSTOMIZATION["namespace"]
    assert cfg.server.control_token == ""  # the token comes from the Secret, never the ConfigMap
    mutated = CONFIG_TEXT.replace("k8s_gpu_count:", "k8s_gpu_cont:")
    assert mutated.count("k8s_gpu_cont:") == 1
    with pytest.raises(ConfigError, match="k8s_gpu_cont"):
        _config(tmp_path, text=mutated)


def test_every_tide_env_var_names_a_config_field_and_parses(tmp_path):
    cfg = _config(tmp_path)
    envs = [_env(c) for _, c in _containers([*_named("Deployment").values(), _amd_scheduler(), _amd_scheduler(CPU)])]
    envs.append(dict(cfg.schedule.k8s_env))  # set in the ConfigMap, read by each retrain Job
    names = {n for env in envs for n in env if n.startswith("TIDE_")}
    assert "TIDE_SERVER__CONTROL_TOKEN" in names and "TIDE_SCHEDULE__K8S_NODE_SELECTOR" in names
    for env in envs:
        for name, value in env.items():
            if not name.startswith("TIDE_"):
                continue
            section, _, key = name[len("TIDE_"):].lower().partition("__")
            assert key in type(getattr(cfg, section)).model_fields, name
            _config(tmp_path, env={name: value})  # ConfigError if the value does not parse


def test_containers_run_existing_services_with_accepted_flags():
    configmaps, pvcs = _named("ConfigMap"), _named("PersistentVolumeClaim")
    for dep, c in _containers():
        python, dash_m, name, *args = c["command"]
        assert (python, dash_m) == ("python", "-m") and re.fullmatch(r"tide\.services\.\w+", name)
        module = importlib.import_module(name)  # ImportError: no such service in the package
        # the path the scheduler gives its Jobs too, so Jobs and services read one file
        assert module.parse_args(args).config == f"{kubernetes_launcher.CONFIG_MOUNT}/config.yaml"
        volumes = {v["name"]: v for v in dep["spec"]["template"]["spec"]["volumes"]}
        mounts = {m["mountPath"]: volumes[m["name"]] for m in c["volumeMounts"]}
        assert mounts[kubernetes_launcher.CONFIG_MOUNT]["configMap"]["name"] in configmaps
        assert all(v["persistentVolumeClaim"]["claimName"] in pvcs
                   for v in volumes.values() if "persistentVolumeClaim" in v)
    # retrain Jobs run schedule.k8s_image: the same code as the services that feed them, with
    # PyTorch built for the pool's GPUs (tag suffix -cuda, -rocm in overlays/amd; none in overlays/cpu)
    images = {c["image"] for _, c in _containers()}
    job_images = {yaml.safe_load(CONFIG_TEXT)["schedule"]["k8s_image"]} | {
        _env(_amd_scheduler(o)["spec"]["template"]["spec"]["containers"][0])["TIDE_SCHEDULE__K8S_IMAGE"]
        for o in (AMD, CPU)}
    (image,) = images
    assert job_images == {image + "-cuda", image + "-rocm", image}


def _routes() -> dict[str, set[str]]:
    engine = (ROOT / "tide/engine/server.py").read_text()
    health = (ROOT / "tide/health_server.py").read_text()
    # GET routes, as the server registers them: app.add_api_route("/path", handler, methods=["GET"])
    return {"engine": set(re.findall(r'add_api_route\("([^"]+)", [\w.]+, methods=\["GET"\]', engine)),
            "ingest": set(re.findall(r'path == "(/[^"]*)"', health)),  # the same HealthServer
            "scheduler": set(re.findall(r'path == "(/[^"]*)"', health))}


def test_ports_probes_and_scrape_annotations_match_config_and_routes(tmp_path):
    cfg, routes = _config(tmp_path), _routes()
    assert {"/health", "/metrics"} <= routes["engine"] and {"/health", "/metrics"} <= routes["scheduler"]
    listen = {"engine": (cfg.server.host, cfg.server.port),
              "ingest": (cfg.ingest.metrics_host, cfg.ingest.metrics_port),
              "scheduler": (cfg.schedule.metrics_host, cfg.schedule.metrics_port)}
    seen = set()
    for dep, c in _containers():
        service = c["command"][2].rpartition(".")[2]
        seen.add(service)
        host, port = listen[service]
        assert host == "0.0.0.0", f"{service} binds {host}: kubelet and Prometheus could not reach it"
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        extra = {cfg.server.control_port} if service == "engine" else set()
        assert set(ports.values()) == {port} | extra
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            if probe in c:
                get = c[probe]["httpGet"]
                assert get["path"] in routes[service] and ports.get(get["port"], get["port"]) == port
        ann = dep["spec"]["template"]["metadata"]["annotations"]
        assert ann["prometheus.io/path"] == "/metrics" and int(ann["prometheus.io/port"]) == port
    assert seen == set(listen)
    for svc in _named("Service").values():
        (dep,) = [d for d in _named("Deployment").values()
                  if svc["spec"]["selector"].items() <= d["spec"]["template"]["metadata"]["labels"].items()]
        names = {p["name"] for _, c in _containers([dep]) for p in c["ports"]}
        assert all(p["targetPort"] in names for p in svc["spec"]["ports"])


def test_the_engine_is_a_fleet_that_keeps_serving_and_reports_to_the_alias_owner():
    from urllib.parse import urlsplit

    dep = _named("Deployment")["tide-engine"]
    spec, labels = dep["spec"], dep["spec"]["template"]["metadata"]["labels"]
    assert spec["replicas"] == 2
    # a rolling update adds a ready pod before an old one drains
    assert spec["strategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}}
    (c,) = spec["template"]["spec"]["containers"]
    assert c["readinessProbe"]["httpGet"]["path"] == "/health"  # 503 while draining: out of the Service
    pdb = _named("PodDisruptionBudget")["tide-engine"]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert 1 <= pdb["spec"]["minAvailable"] < spec["replicas"]
    # the alias owner is the scheduler's metrics port, through its Service
    owner = urlsplit(_env(c)["TIDE_OPS__ALIAS_OWNER_URL"])
    svc = _named("Service")[owner.hostname.split(".")[0]]
    assert owner.hostname.split(".")[1] == svc["metadata"]["namespace"] == "tide"
    (port,) = [p for p in svc["spec"]["ports"] if p["port"] == owner.port]
    (sched,) = [d for d in _named("Deployment").values()
                if svc["spec"]["selector"].items() <= d["spec"]["template"]["metadata"]["labels"].items()]
    (sc,) = sched["spec"]["template"]["spec"]["containers"]
    assert sc["command"][:3] == ["python", "-m", "tide.services.scheduler"]
    assert port["targetPort"] in {p["name"] for p in sc["ports"]}
    assert {p["containerPort"] for p in sc["ports"] if p["name"] == port["targetPort"]} == {
        int(sched["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"])}


def test_scheduler_role_grants_exactly_the_launchers_api_calls():
    source = inspect.getsource(kubernetes_launcher)
    calls = {("batch", m) for m in re.findall(r"self\.api\.(\w+)\(", source)}
    calls |= {("", m) for m in re.findall(r"self\.core\.(\w+)\(", source)}
    apis = {"batch": client.BatchV1Api, "": client.CoreV1Api}
    assert calls and all(hasattr(apis[group], m) for group, m in calls)
    needed = set()
    for group, m in calls:
        # a call this pattern does not know (another resource) fails here: extend Role and pattern
        verb, resource, status = re.fullmatch(
            r"(create|read|list|delete|patch|replace)_namespaced_(job|pod)(_status)?", m).groups()
        verb = {"read": "get", "replace": "update"}.get(verb, verb)
        needed.add((group, f"{resource}s" + ("/status" if status else ""), verb))
    (role,) = _named("Role").values()
    granted = {(g, res, v) for r in role["rules"] for g in r["apiGroups"] for res in r["resources"]
               for v in r["verbs"]}
    assert granted == needed
    (binding,) = _named("RoleBinding").values()
    sa = _named("Deployment")["tide-scheduler"]["spec"]["template"]["spec"]["serviceAccountName"]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert sa in _named("ServiceAccount") and binding["subjects"] == [
        {"kind": "ServiceAccount", "name": sa, "namespace": KUSTOMIZATION["namespace"]}]
    spec = _named("Deployment")["tide-scheduler"]["spec"]
    assert (spec["replicas"], spec["strategy"]["type"]) == (1, "Recreate")  # single-flight


@pytest.mark.parametrize("overlay,gpu", [(None, "nvidia.com/gpu"), ("amd", "amd.com/gpu"), ("cpu", None)])
def test_retrain_job_from_the_configmap_lands_on_the_training_pool(tmp_path, overlay, gpu):
    patch = {"amd": AMD, "cpu": CPU}.get(overlay)
    env = _env(_amd_scheduler(patch)["spec"]["template"]["spec"]["containers"][0]) if patch else {}
    cfg = _config(tmp_path, env=env)
    job = client.ApiClient().sanitize_for_serialization(
        build_job(cfg.schedule, "20250101-000000-abc123", job_env(cfg)))
    pod = job["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    limits = c["resources"]["limits"]
    assert [k for k in limits if "gpu" in k] == ([gpu] if gpu else []) and (not gpu or limits[gpu] == "1")
    # the Job trains on what it asks for, in an image whose PyTorch is built for it
    device = {e["name"]: e.get("value") for e in c["env"]}["TIDE_TRAIN__DEVICE"]
    assert device == ("cuda" if gpu else "cpu")
    assert c["image"].endswith({"nvidia.com/gpu": "-cuda", "amd.com/gpu": "-rocm", None: ".0"}[gpu])
    assert pod["nodeSelector"] == dict(cfg.schedule.k8s_node_selector)
    assert pod["nodeSelector"]["tide.dev/pool"] == "training"
    assert {t["key"] for t in pod["tolerations"]} == {gpu, "tide.dev/pool"} - {None}  # no stray spaces in keys
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["config"]["configMap"]["name"] in _named("ConfigMap")
    # no dataset volume anywhere: the Job reads the table on S3 where ingest writes it
    assert not _named("PersistentVolumeClaim").keys() - {"tide-scheduler-state"}
    assert not [v for v in volumes.values() if "persistentVolumeClaim" in v]
    env_of_job = {e["name"]: e for e in c["env"]}
    assert urlsplit(yaml.safe_load(CONFIG_TEXT)["ingest"]["data_dir"]).scheme == "s3"
    if cfg.ingest.data_dir:  # an overlay's env here holds references only the cluster resolves
        assert env_of_job["TIDE_INGEST__DATA_DIR"]["value"] == cfg.ingest.data_dir
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):  # the store's keys, by Secret reference
        assert env_of_job[key]["valueFrom"]["secretKeyRef"]["name"] == "tide-object-store"
    plain = {k: e["value"] for k, e in env_of_job.items() if "value" in e}
    assert load_config(env=plain).model.torch_threads == int(cfg.schedule.k8s_cpu)


def test_metric_names_under_k8s_exist():
    defined = set(re.findall(r'"(tide_[a-z_]+)"', (ROOT / "tide/metrics.py").read_text()))
    mentioned = {re.sub(r"_(bucket|sum|count|created)$", "", m)
                 for p in K8S.rglob("*") if p.is_file() for m in re.findall(r"\btide_[a-z_]+", p.read_text())}
    assert mentioned and mentioned <= defined, sorted(mentioned - defined)


def test_dockerfile_installs_the_wheel_and_its_runtime_stage_has_no_compiler():
    """The image is never built here (no container runtime): its shape is checked as text."""
    text = (K8S / "Dockerfile").read_text()
    stages = re.split(r"^FROM ", text, flags=re.M)[1:]
    assert len(stages) == 2, "a build stage and a runtime stage"
    build, runtime = stages
    assert "pip wheel --no-deps" in build and re.search(r"pip install /dist/tide-\*\.whl\s*$", build, re.M)
    assert "[dev]" not in text and " -e " not in text  # no editable install, no dev extras
    assert "rowkernel import build" in build  # the kernel is compiled where the compiler is
    assert "rehearsal_pool(" in build  # retrain Jobs' home is read-only: the pool is built into the image
    assert not re.search(r"\b(gcc|cc|clang|build-essential|apt-get)\b", runtime), "a compiler in the runtime stage"
    copied = re.findall(r"^COPY --from=build .*?(/\S+) (/\S+)$", runtime, re.M)
    assert ("/opt/venv", "/opt/venv") in copied and ("/var/lib/tide", "/var/lib/tide") in copied
    assert re.search(r"TIDE_HOME=/var/lib/tide", runtime)  # where rowkernel looks for the built .so


def test_engine_and_ingest_share_the_configmap_kafka_section(tmp_path):
    # one address and topic for capture (engine) and ingest: the old per-component copies are gone
    cfg = _config(tmp_path)
    assert cfg.capture.enabled and cfg.kafka.bootstrap_servers == "kafka.tide.svc:9092"
    assert cfg.kafka.topic != cfg.kafka.dead_letter_topic


# --- security: Pod Security Standard "restricted", writable paths, secrets, network ------------------

PSS_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
               "projected", "secret"}  # the volume types the restricted profile allows


def _job(tmp_path, overlay: bool = False) -> dict:
    env = _env(_amd_scheduler()["spec"]["template"]["spec"]["containers"][0]) if overlay else {}
    cfg = _config(tmp_path, env=env)
    return client.ApiClient().sanitize_for_serialization(
        build_job(cfg.schedule, "20250101-000000-abc123", job_env(cfg)))


def _pods(tmp_path) -> dict[str, dict]:
    """Every pod spec that runs: the Deployments' templates and the retrain Jobs built from the ConfigMap."""
    pods = {name: d["spec"]["template"]["spec"] for name, d in _named("Deployment").items()}
    pods["tide-scheduler (amd)"] = _amd_scheduler()["spec"]["template"]["spec"]
    pods["retrain Job"] = _job(tmp_path)["spec"]["template"]["spec"]
    pods["retrain Job (amd)"] = _job(tmp_path, overlay=True)["spec"]["template"]["spec"]
    return pods


def _tide_home() -> str:
    return re.search(r"TIDE_HOME=(\S+)", (K8S / "Dockerfile").read_text().split("AS runtime")[1]).group(1)


def assert_restricted(name: str, pod: dict) -> None:
    """``pod`` (a pod spec) meets the restricted Pod Security Standard, with a read-only root."""
    psc = pod.get("securityContext") or {}
    assert not any(pod.get(k) for k in ("hostNetwork", "hostPID", "hostIPC")), name
    assert {k for v in pod.get("volumes", []) for k in v if k != "name"} <= PSS_VOLUMES, name
    for c in pod["containers"] + pod.get("initContainers", []):
        sc = c.get("securityContext") or {}
        where = f"{name}/{c['name']}"
        assert sc.get("runAsNonRoot", psc.get("runAsNonRoot")) is True, where
        assert sc.get("runAsUser", psc.get("runAsUser", 1)) != 0, where
        assert sc.get("allowPrivilegeEscalation") is False and not sc.get("privileged"), where
        assert sc.get("capabilities", {}).get("drop") == ["ALL"], where
        assert set(sc.get("capabilities", {}).get("add") or []) <= {"NET_BIND_SERVICE"}, where
        seccomp = sc.get("seccompProfile") or psc.get("seccompProfile") or {}
        assert seccomp.get("type") in ("RuntimeDefault", "Localhost"), where
        assert sc.get("readOnlyRootFilesystem") is True, where


def test_every_pod_meets_the_restricted_pod_security_standard(tmp_path):
    for name, pod in _pods(tmp_path).items():
        assert_restricted(name, pod)


def _writable(pod: dict, container: dict) -> set[str]:
    kinds = {v["name"]: v for v in pod.get("volumes", [])}
    out = set()
    for m in container.get("volumeMounts", []):
        volume = kinds[m["name"]]
        if not m.get("readOnly") and ("emptyDir" in volume or "persistentVolumeClaim" in volume) \
                and not (volume.get("persistentVolumeClaim") or {}).get("readOnly"):
            out.add(m["mountPath"])
    return out


def _covered(path: str, writable: set[str]) -> bool:
    return any(path == w or path.startswith(w.rstrip("/") + "/") for w in writable)


def test_every_folder_a_process_writes_is_a_writable_volume(tmp_path, monkeypatch):
    """A read-only root filesystem: what each process writes (from the code's own defaults and the
    ConfigMap) must lie on an emptyDir or a read-write PVC mount."""
    from tide.registry.store import default_cache_dir
    from tide.schedule.scheduler import default_state_path

    cfg, home = _config(tmp_path), Path(_tide_home())
    cache = Path(cfg.registry.cache_dir) if cfg.registry.cache_dir else default_cache_dir(home)
    writes = {  # tempfile's folder everywhere; what each service writes besides
        "engine": ["/tmp", str(cache)],
        "ingest": ["/tmp"],  # the dataset is on S3
        "scheduler": ["/tmp", str(default_state_path(cfg).parent)],  # state file and its job folder
    }
    for dep, c in _containers():
        service = c["command"][2].rpartition(".")[2]
        writable = _writable(dep["spec"]["template"]["spec"], c)
        assert [p for p in writes[service] if not _covered(p, writable)] == [], (service, writable)
    job = _job(tmp_path)["spec"]["template"]["spec"]
    (c,) = job["containers"]
    env = {e["name"]: e.get("value") for e in c["env"]}
    from tide.train.online import _work_root

    monkeypatch.setenv("TIDE_HOME", env["TIDE_HOME"])  # the process reads its home from the environment
    job_cfg = load_config(tmp_path / "config.yaml", env={k: v for k, v in env.items() if v is not None})
    job_writes = [str(Path(kubernetes_launcher.RESULT_PATH_IN_POD).parent), str(_work_root(job_cfg)),
                  job_cfg.registry.cache_dir, "/tmp"]
    assert job_cfg.home_path == home  # the image's TIDE_HOME, where the emptyDirs are
    assert [p for p in job_writes if not _covered(p, _writable(job, c))] == [], _writable(job, c)
    # the dataset stays read-only for retrains
    assert not _covered(cfg.ingest.data_dir, _writable(job, c))
    # mount points under the image's TIDE_HOME exist in the image (its root is read-only)
    made = set(re.findall(r"mkdir -p ([^\n\\]+)", (K8S / "Dockerfile").read_text())[0].split())
    under_home = {w for w in _writable(job, c) if w.startswith(str(home) + "/")}
    under_home |= {w for d, c2 in _containers() for w in _writable(d["spec"]["template"]["spec"], c2)
                   if w.startswith(str(home) + "/")}
    assert under_home and under_home <= made, under_home - made


def test_the_job_mounts_no_service_account_token_and_reads_secrets_by_reference(tmp_path):
    from tide.redact import looks_secret

    job = _job(tmp_path)["spec"]["template"]["spec"]
    assert job["automountServiceAccountToken"] is False  # it never calls the Kubernetes API
    for name in ("tide-engine", "tide-ingest"):  # nor do these
        assert _named("Deployment")[name]["spec"]["template"]["spec"]["automountServiceAccountToken"] is False
    refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in job["containers"][0]["env"] if "valueFrom" in e}
    assert refs, "the ConfigMap names no Secret for retrain Jobs"
    for name, pod in _pods(tmp_path).items():
        for c in pod["containers"]:
            for e in c.get("env", []):
                # a credential is never a plain value in a manifest or a Job
                assert not (looks_secret(e["name"]) and "value" in e), (name, e["name"])
    engine_refs = {e["valueFrom"]["secretKeyRef"]["name"] for _, c in _containers([_named("Deployment")["tide-engine"]])
                   for e in c["env"] if "valueFrom" in e}
    # one Secret for MLflow, documented with tide-control; the object store's keys, as ingest reads them
    ingest_refs = {e["valueFrom"]["secretKeyRef"]["name"] for _, c in _containers([_named("Deployment")["tide-ingest"]])
                   for e in c["env"] if "secretKeyRef" in e.get("valueFrom", {})}
    assert {r["name"] for r in refs.values()} <= engine_refs | ingest_refs


def _policies_for(labels: dict[str, str]) -> list[dict]:
    return [p for p in _named("NetworkPolicy").values()
            if p["spec"]["podSelector"]["matchLabels"].items() <= labels.items() and "Ingress" in p["spec"]["policyTypes"]]


def _allowed_from(policy: dict, port: int) -> list[dict] | None:
    """The peers one policy lets reach ``port`` (None: anyone)."""
    peers: list[dict] = []
    for rule in policy["spec"].get("ingress", []):
        if any(p["port"] == port for p in rule.get("ports", [])) or not rule.get("ports"):
            if not rule.get("from"):
                return None
            peers += rule["from"]
    return peers


def test_network_policies_open_control_and_registry_only_to_the_pods_that_need_them(tmp_path):
    from urllib.parse import urlsplit

    cfg = _config(tmp_path)
    assert cfg.server.control_port and cfg.server.control_port != cfg.server.port  # a port a policy can limit
    engine_labels = _named("Deployment")["tide-engine"]["spec"]["template"]["metadata"]["labels"]
    (policy,) = _policies_for(engine_labels)
    assert _allowed_from(policy, cfg.server.port) is None  # the OpenAI API, probes, Prometheus
    control_peers = _allowed_from(policy, cfg.server.control_port)
    assert control_peers and all(set(p) == {"podSelector"} for p in control_peers)  # this namespace only
    control_labels = [p["podSelector"]["matchLabels"] for p in control_peers]
    for name, dep in _named("Deployment").items():  # no service of the loop is a control client
        labels = dep["spec"]["template"]["metadata"]["labels"]
        assert not any(sel.items() <= labels.items() for sel in control_labels), name
    # the registry: engines follow champion, retrain Jobs register, the scheduler writes aliases (the alias
    # owner); ingest never calls it
    url = urlsplit(cfg.registry.tracking_uri)
    assert url.hostname.split(".")[:2] == ["mlflow", KUSTOMIZATION["namespace"]]
    (registry,) = [p for p in _named("NetworkPolicy").values()
                   if p["spec"]["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "mlflow"}]
    peers = [p["podSelector"]["matchLabels"] for p in _allowed_from(registry, url.port)]
    job_labels = _job(tmp_path)["spec"]["template"]["metadata"]["labels"]
    allowed = lambda labels: any(sel.items() <= labels.items() for sel in peers)  # noqa: E731
    scheduler_labels = _named("Deployment")["tide-scheduler"]["spec"]["template"]["metadata"]["labels"]
    assert allowed(engine_labels) and allowed(job_labels) and allowed(scheduler_labels)
    assert not allowed(_named("Deployment")["tide-ingest"]["spec"]["template"]["metadata"]["labels"])
    # and no one else: every peer is an engine, a retrain Job, the scheduler or a control client
    assert all(sel in control_labels or any(sel.items() <= labels.items()
                                            for labels in (engine_labels, job_labels, scheduler_labels))
               for sel in peers)


def test_the_retrain_jobs_memory_follows_its_stated_rule(tmp_path):
    """The ConfigMap sizes the Job's memory from a measured peak (bench/retrain.py): the figure it
    quotes is the one docs/benchmarks.md records, the request follows the rule it states (twice
    the peak, rounded up to a whole GiB), and the Job asks for exactly that."""
    line = next(x for x in CONFIG_TEXT.splitlines() if x.strip().startswith("k8s_memory:"))
    figure = re.search(r"peak ([0-9.]+) GiB", line)
    assert figure, line
    peak_gib = float(figure.group(1))
    assert f"{figure.group(1)} GiB" in (ROOT / "docs" / "benchmarks.md").read_text()
    cfg = _config(tmp_path)
    assert cfg.schedule.k8s_memory == f"{math.ceil(2 * peak_gib)}Gi"
    job = client.ApiClient().sanitize_for_serialization(
        build_job(cfg.schedule, "20250101-000000-abc123", job_env(cfg)))
    resources = job["spec"]["template"]["spec"]["containers"][0]["resources"]
    assert resources["requests"]["memory"] == resources["limits"]["memory"] == cfg.schedule.k8s_memory
