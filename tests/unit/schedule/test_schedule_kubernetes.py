"""Kubernetes launcher without a cluster: the Job manifest it builds and how it reads Job status.

Both are pure functions over the official client's model objects (pydantic-validated in client
37+); these tests use those real objects, serialised the way the client sends them. Nothing here
talks to an API server, and nothing pretends to be one: create/read/delete/list against a real
cluster is not covered by this suite.
"""
import pytest
from kubernetes import client

from tide.config import ScheduleConfig, load_config
from tide.schedule.kubernetes_launcher import (
    build_job,
    interpret_job_status,
    job_env,
    job_name,
    parse_toleration,
    summary_from_pods,
)


def _sc(**kw) -> ScheduleConfig:
    base = dict(launcher="kubernetes", k8s_namespace="ml", k8s_image="registry/tide:1.2",
                k8s_node_selector={"pool": "training"},
                k8s_tolerations=("gpu=true:NoSchedule", "dedicated:NoExecute"),
                k8s_gpu_resource="amd.com/gpu", k8s_gpu_count=2, k8s_cpu="8", k8s_memory="64Gi",
                k8s_config_map="tide-config",
                job_timeout_s=5400.0, k8s_ttl_after_finished_s=600,
                k8s_service_account="tide-trainer")
    base.update(kw)
    return ScheduleConfig(**base)


def _manifest(sc, env=None) -> dict:
    job = build_job(sc, "20250101-120000-abc123", env or {"MLFLOW": "x"})
    assert isinstance(job, client.V1Job)
    return client.ApiClient().sanitize_for_serialization(job)


def test_manifest_runs_once_on_the_training_pool():
    m = _manifest(_sc())
    assert (m["apiVersion"], m["kind"]) == ("batch/v1", "Job")
    assert m["metadata"]["name"] == "tide-retrain-20250101-120000-abc123"
    assert m["metadata"]["namespace"] == "ml"
    assert m["metadata"]["labels"]["tide.dev/job-id"] == "20250101-120000-abc123"
    spec = m["spec"]
    assert spec["backoffLimit"] == 0
    assert spec["activeDeadlineSeconds"] == 5400
    assert spec["ttlSecondsAfterFinished"] == 600
    pod = spec["template"]["spec"]
    assert pod["restartPolicy"] == "Never"
    assert pod["nodeSelector"] == {"pool": "training"}
    assert pod["serviceAccountName"] == "tide-trainer"
    assert pod["tolerations"] == [
        {"key": "gpu", "operator": "Equal", "value": "true", "effect": "NoSchedule"},
        {"key": "dedicated", "operator": "Exists", "effect": "NoExecute"}]
    assert spec["template"]["metadata"]["labels"] == m["metadata"]["labels"]


def test_container_command_resources_env_and_volumes():
    (c,) = _manifest(_sc())["spec"]["template"]["spec"]["containers"]
    assert c["image"] == "registry/tide:1.2"
    # 2 GPUs: one rank per GPU under torchrun (tide/schedule/gpu_job.py)
    assert c["command"] == ["python", "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                            "-m", "tide.cli", "train", "--online",
                            "--config", "/etc/tide/config.yaml",
                            "--result-json", "/tmp/tide-retrain-result.json",
                            "--summary-json", "/dev/termination-log"]
    assert c["terminationMessagePolicy"] == "FallbackToLogsOnError"
    assert c["resources"]["limits"] == {"cpu": "8", "memory": "64Gi", "amd.com/gpu": "2"}
    assert "amd.com/gpu" not in c["resources"]["requests"]
    env = {e["name"]: e["value"] for e in c["env"]}
    assert env == {"MLFLOW": "x", "TIDE_RETRAIN_JOB_ID": "20250101-120000-abc123"}
    mounts = {v["name"]: v for v in c["volumeMounts"]}
    assert mounts["config"]["mountPath"] == "/etc/tide" and "dataset" not in mounts  # read over S3
    vols = {v["name"]: v for v in _manifest(_sc())["spec"]["template"]["spec"]["volumes"]}
    assert vols["config"]["configMap"]["name"] == "tide-config"
    assert not [v for v in vols.values() if "persistentVolumeClaim" in v]


def test_cpu_only_job_has_no_gpu_and_no_optional_fields():
    m = _manifest(_sc(k8s_gpu_count=0, k8s_gpu_resource="nvidia.com/gpu", k8s_config_map="",
                      k8s_node_selector={}, k8s_tolerations=(),
                      k8s_service_account=""))
    pod = m["spec"]["template"]["spec"]
    assert pod["containers"][0]["resources"]["limits"] == {"cpu": "8", "memory": "64Gi"}
    for absent in ("nodeSelector", "tolerations", "serviceAccountName"):
        assert absent not in pod
    assert {v["name"] for v in pod["volumes"]} == {"tmp", "work", "registry-cache"}  # emptyDirs only
    assert "--config" not in pod["containers"][0]["command"]


def test_job_env_carries_bootstrap_servers_dataset_and_overrides(monkeypatch):
    cfg = load_config(env={}, overrides={
        "kafka": {"bootstrap_servers": "kafka:9092"}, "ingest": {"data_dir": "s3://bucket/dataset"},
        "schedule": {"k8s_env": {"TIDE_HOME": "/cache", "A": "1"}}})
    # the store's address as the scheduler has it (the object-store ConfigMap); never its keys
    monkeypatch.setenv("AWS_ENDPOINT_URL", "https://s3.internal")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "never-copied")
    env = job_env(cfg)
    assert env["TIDE_KAFKA__BOOTSTRAP_SERVERS"] == "kafka:9092"
    assert load_config(env=env).kafka.bootstrap_servers == "kafka:9092"  # a name config reads
    assert env["TIDE_INGEST__DATA_DIR"] == "s3://bucket/dataset"
    assert env["AWS_ENDPOINT_URL"] == "https://s3.internal" and "AWS_SECRET_ACCESS_KEY" not in env
    assert env["TIDE_HOME"] == "/cache" and env["A"] == "1"


def test_secrets_reach_the_job_only_as_secret_key_refs():
    sc = _sc(k8s_secret_env={"MLFLOW_TRACKING_TOKEN": "tide-mlflow/token",
                             "AWS_SECRET_ACCESS_KEY": "s3.creds/secret-key"})
    m = _manifest(sc, {"MLFLOW": "x"})
    env = {e["name"]: e for e in m["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["MLFLOW_TRACKING_TOKEN"] == {"name": "MLFLOW_TRACKING_TOKEN", "valueFrom": {
        "secretKeyRef": {"name": "tide-mlflow", "key": "token", "optional": True}}}
    assert env["AWS_SECRET_ACCESS_KEY"]["valueFrom"]["secretKeyRef"] == {
        "name": "s3.creds", "key": "secret-key", "optional": True}
    assert "value" not in env["MLFLOW_TRACKING_TOKEN"] and env["MLFLOW"]["value"] == "x"
    for bad in ("no-key", "/token", "Upper/key", "a/b/c", "name/"):
        with pytest.raises(ValueError, match="k8s_secret_env.X"):
            build_job(_sc(k8s_secret_env={"X": bad}), "id", {})


@pytest.mark.parametrize("name,value", [("MLFLOW_TRACKING_PASSWORD", "hunter2"), ("HF_TOKEN", "hunter2"),
                                        ("AWS_SECRET_ACCESS_KEY", "hunter2"), ("TIDE_SERVER__CONTROL_TOKEN", "hunter2"),
                                        ("TIDE_REGISTRY__TRACKING_URI", "https://bob:hunter2@mlflow:5000")])
def test_a_plain_credential_is_refused_without_showing_it(name, value):
    from tide.schedule.kubernetes_launcher import KubernetesLauncher

    with pytest.raises(ValueError, match=name) as info:
        KubernetesLauncher(_sc(), {name: value})  # at start, before any launch
    assert "hunter2" not in str(info.value) and "k8s_secret_env" in str(info.value)


def test_plain_settings_that_merely_mention_tokens_pass():
    from tide.schedule.kubernetes_launcher import KubernetesLauncher

    env = {"TIDE_TRAIN__MAX_TRAIN_TOKENS": "32000", "TIDE_ENGINE__MAX_PROMPT_TOKENS": "512",
           "TIDE_REGISTRY__TRACKING_URI": "http://mlflow.tide.svc:5000", "KEYBOARD": "us"}
    KubernetesLauncher(_sc(), env)


def test_the_job_meets_the_restricted_pod_security_standard():
    pod = _manifest(_sc())["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert pod["automountServiceAccountToken"] is False
    assert pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["runAsUser"] == 10001
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert c["securityContext"] == {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
                                    "readOnlyRootFilesystem": True, "runAsNonRoot": True,
                                    "seccompProfile": {"type": "RuntimeDefault"}}
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    assert mounts["/tmp"] == "tmp" and mounts["/var/lib/tide/retrain"] == "work"
    assert mounts["/var/lib/tide/registry-cache"] == "registry-cache"
    # the Job's process writes where its emptyDirs are (its TIDE_HOME and registry cache)
    cfg = load_config(env={}, overrides={"schedule": {"k8s_tide_home": "/home/x"}})
    env = job_env(cfg)
    cmounts = {m["mountPath"] for m in _manifest(cfg.schedule, env)["spec"]["template"]["spec"]["containers"][0]
               ["volumeMounts"]}
    assert {"/home/x/retrain", "/home/x/registry-cache", "/tmp"} <= cmounts
    assert load_config(env=env).registry.cache_dir == "/home/x/registry-cache" and env["TIDE_HOME"] == "/home/x"


def test_names_and_tolerations_are_validated():
    assert len(job_name("x" * 70, "id")) <= 63
    assert job_name("Tide_Retrain", "ID") == "tide-retrain-id"
    for bad in ("gpu=true", "gpu:Sometimes", ":NoSchedule"):
        with pytest.raises(ValueError, match="k8s_tolerations"):
            parse_toleration(bad)


def _job(conditions=None, active=None) -> client.V1Job:
    return client.V1Job(metadata=client.V1ObjectMeta(name="j"),
                        status=client.V1JobStatus(active=active, conditions=conditions))


def _cond(type_, status="True", reason=None, message=None):
    return client.V1JobCondition(type=type_, status=status, reason=reason, message=message)


def test_status_interpretation():
    assert interpret_job_status(_job(active=1)) is None
    assert interpret_job_status(client.V1Job()) is None  # just created: no status yet
    assert interpret_job_status(_job([_cond("Suspended")])) is None
    assert interpret_job_status(_job([_cond("Complete", status="False")])) is None
    done = interpret_job_status(_job([_cond("SuccessCriteriaMet"), _cond("Complete")]))
    assert done.succeeded
    failed = interpret_job_status(_job([_cond("Failed", reason="BackoffLimitExceeded",
                                              message="Job has reached the specified backoff")]))
    assert failed.status == "failed" and "BackoffLimitExceeded" in failed.reason
    late = interpret_job_status(_job([_cond("Failed", reason="DeadlineExceeded")]))
    assert late.status == "timed_out"


def test_launcher_rejects_bad_config_before_any_launch():
    from tide.schedule.kubernetes_launcher import KubernetesLauncher

    with pytest.raises(ValueError, match="k8s_tolerations"):
        KubernetesLauncher(_sc(k8s_tolerations=("gpu",)), {})


def _pod(name, created_s, message=None, container="retrain"):
    import datetime

    state = client.V1ContainerState(terminated=client.V1ContainerStateTerminated(exit_code=0, message=message))
    return client.V1Pod(
        metadata=client.V1ObjectMeta(name=name, creation_timestamp=datetime.datetime.fromtimestamp(
            created_s, datetime.timezone.utc)),
        status=client.V1PodStatus(container_statuses=[client.V1ContainerStatus(
            name=container, state=state, image="i", image_id="", ready=False, restart_count=0)]))


def test_summary_comes_from_the_newest_pods_termination_message():
    ok = '{"status": "registered", "version": 7, "run_id": "abc", "reason": ""}'
    summary, found = summary_from_pods(client.V1PodList(items=[
        _pod("new", 200, ok), _pod("old", 100, '{"status": "failed", "reason": "OOM"}')]))
    assert (summary["version"], summary["run_id"], found) == (7, "abc", "")
    # a crash before the summary: FallbackToLogsOnError put the log's tail there instead
    summary, found = summary_from_pods(client.V1PodList(items=[_pod("p", 1, "Traceback ...\nMemoryError\n")]))
    assert summary == {} and found.endswith("MemoryError")
    summary, found = summary_from_pods(client.V1PodList(items=[_pod("p", 1, None), _pod("q", 2, ok, "sidecar")]))
    assert summary == {} and "no terminated retrain container" in found
    undated = _pod("u", 0, '{"status": "failed"}')
    undated.metadata.creation_timestamp = None  # still being created: sorts first, never fails
    assert summary_from_pods(client.V1PodList(items=[undated, _pod("new", 200, ok)]))[0]["version"] == 7
