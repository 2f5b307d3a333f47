"""Retrain as a Kubernetes batch/v1 Job on the training pool (official ``kubernetes`` client).

``build_job`` and ``interpret_job_status`` are pure functions over the client's model objects, so
the manifest and the status rules are tested without a cluster. The Job:
- runs one pod, never retried by Kubernetes (``backoffLimit: 0``, ``restartPolicy: Never``): the
  scheduler owns retries and their backoff;
- is killed by Kubernetes after ``activeDeadlineSeconds`` (= ``job_timeout_s``; reported as
  ``Failed``/``DeadlineExceeded`` -> timed_out) and deleted ``ttlSecondsAfterFinished`` later;
- lands on the training pool through node selector and tolerations, asks for
  ``k8s_gpu_count`` of ``k8s_gpu_resource`` (``nvidia.com/gpu``, ``amd.com/gpu``, ...);
- carries labels that let a restarted scheduler (or one whose state file was lost) find it;
- writes its summary (status, version, run id, reason, the dataset watermark it read) to its
  termination message, which the scheduler reads from the pod's status once the Job has finished
  (``summary_from_pods``) and records as the outcome's result;
- meets the Pod Security Standard "restricted": non-root (the image's uid 10001), no privilege
  escalation, every capability dropped, seccomp RuntimeDefault, a read-only root filesystem with
  an emptyDir for each folder the retrain writes (``WRITABLE``: /tmp, the work and registry-cache
  folders under TIDE_HOME), and no service-account token (it never calls the Kubernetes API);
- gets credentials only as ``secretKeyRef`` (``schedule.k8s_secret_env``: NAME -> secret/key), so
  no secret value is in the Job spec, the scheduler's memory or its logs; a plain variable whose
  name looks like a credential, or a URL with a password, is refused when the launcher starts;
- reads the dataset table over the network: the scheduler's table URI (``TIDE_INGEST__DATA_DIR``)
  and the store's non-secret settings (endpoint, region) as plain variables, its keys by Secret
  reference (``k8s_secret_env``: ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``); no volume.
The Job's name derives from the job id alone, so a launch interrupted before the scheduler saved
its handle is found again by name.
"""
from __future__ import annotations

import json
import logging
import os
import re
from typing import Any, Mapping

from tide.contracts import JOB_FAILED, JOB_SUCCEEDED, JOB_TIMED_OUT
from tide.redact import has_url_password, looks_secret
from tide.schedule.gpu_job import device_env, ranks_argv, shm_volume
from tide.schedule.launcher import ENV_JOB_ID, JobSpec, Outcome

log = logging.getLogger(__name__)

MANAGED_BY = "tide-scheduler"
LABEL_JOB_ID = "tide.dev/job-id"
CONFIG_MOUNT = "/etc/tide"
RESULT_PATH_IN_POD = "/tmp/tide-retrain-result.json"
# the container's default terminationMessagePath: Kubernetes copies it into the pod's status
TERMINATION_LOG = "/dev/termination-log"
_API_TIMEOUT_S = 30
RUN_AS = 10001  # the image's user (k8s/Dockerfile)
# what a retrain writes, each an emptyDir: name -> path ("{home}" = the Job's TIDE_HOME)
WRITABLE = {"tmp": "/tmp", "work": "{home}/retrain", "registry-cache": "{home}/registry-cache"}
# a Secret's name (DNS subdomain) / a key in it
_STORE_ENV = ("AWS_ENDPOINT_URL", "AWS_REGION", "AWS_ALLOW_HTTP")
_SECRET_REF = re.compile(r"([a-z0-9]([-a-z0-9.]*[a-z0-9])?)/([-._a-zA-Z0-9]+)")


def job_name(prefix: str, job_id: str) -> str:
    """DNS-1123 name: lower case, at most 63 characters."""
    name = f"{prefix}-{job_id}".lower().replace("_", "-")
    return name[:63].rstrip("-")


def parse_toleration(text: str):
    """``key=value:Effect`` (operator Equal) or ``key:Effect`` (operator Exists), as kubectl taint."""
    from kubernetes import client

    key_value, sep, effect = text.rpartition(":")
    if not sep or not key_value or effect not in ("NoSchedule", "PreferNoSchedule", "NoExecute"):
        raise ValueError(f"schedule.k8s_tolerations: {text!r} is not 'key[=value]:Effect'")
    key, eq, value = key_value.partition("=")
    if eq:
        return client.V1Toleration(key=key, operator="Equal", value=value, effect=effect)
    return client.V1Toleration(key=key, operator="Exists", effect=effect)


def job_env(cfg: Any) -> dict[str, str]:
    """Environment for the job's container from the whole TideConfig: bootstrap servers, every
    section's ``tracking_uri``, the dataset table's URI and store settings, then ``schedule.k8s_env``."""
    sc = cfg.schedule
    env = {"TIDE_KAFKA__BOOTSTRAP_SERVERS": cfg.kafka.bootstrap_servers}
    for name, section in cfg.model_dump().items():
        if isinstance(section, dict) and section.get("tracking_uri"):
            env[f"TIDE_{name.upper()}__TRACKING_URI"] = str(section["tracking_uri"])
    if cfg.ingest.data_dir:
        env["TIDE_INGEST__DATA_DIR"] = cfg.ingest.data_dir
    # where the store is (the scheduler's own, from the object-store ConfigMap); keys by Secret only
    env.update({k: os.environ[k] for k in _STORE_ENV if os.environ.get(k)})
    # where the Job writes, so that its emptyDirs (WRITABLE) are exactly there
    env["TIDE_HOME"] = sc.k8s_tide_home
    env["TIDE_REGISTRY__CACHE_DIR"] = WRITABLE["registry-cache"].format(home=sc.k8s_tide_home)
    env.update(device_env(sc))  # the device the Job asks for (tide/schedule/gpu_job.py)
    env.update(sc.k8s_env)
    return env


def plain_env_problems(env: Mapping[str, str]) -> list[str]:
    """Plain variables that would put a credential in the Job spec (names only, never values)."""
    return [f"{name} looks like a credential" if looks_secret(name) else f"{name} holds a URL with a password"
            for name, value in sorted(env.items()) if looks_secret(name) or has_url_password(str(value))]


def secret_env(sc: Any) -> list:
    """``schedule.k8s_secret_env`` as env vars read from Secrets (``NAME: secret-name/key``)."""
    from kubernetes import client

    out = []
    for name, ref in sorted(sc.k8s_secret_env.items()):
        m = _SECRET_REF.fullmatch(ref)
        if not m or len(m.group(1)) > 253:
            raise ValueError(f"schedule.k8s_secret_env.{name}: {ref!r} is not 'secret-name/key'")
        # optional: a missing Secret fails the retrain on what needed it (recorded by the
        # scheduler) instead of leaving the pod unstartable until activeDeadlineSeconds
        out.append(client.V1EnvVar(name=name, value_from=client.V1EnvVarSource(
            secret_key_ref=client.V1SecretKeySelector(name=m.group(1), key=m.group(3), optional=True))))
    return out


def _restricted():
    """Container security context of the Pod Security Standard "restricted"."""
    from kubernetes import client

    return client.V1SecurityContext(
        allow_privilege_escalation=False, run_as_non_root=True, read_only_root_filesystem=True,
        capabilities=client.V1Capabilities(drop=["ALL"]),
        seccomp_profile=client.V1SeccompProfile(type="RuntimeDefault"))


def _writable_volumes(env: Mapping[str, str], home: str) -> tuple[list, list]:
    from kubernetes import client

    paths = {name: path.format(home=env.get("TIDE_HOME") or home) for name, path in WRITABLE.items()}
    paths["registry-cache"] = env.get("TIDE_REGISTRY__CACHE_DIR") or paths["registry-cache"]
    volumes = [client.V1Volume(name=name, empty_dir=client.V1EmptyDirVolumeSource()) for name in paths]
    mounts = [client.V1VolumeMount(name=name, mount_path=path) for name, path in paths.items()]
    return volumes, mounts


def build_job(sc: Any, job_id: str, env: Mapping[str, str]):
    """The V1Job for one retrain (``sc`` is the ScheduleConfig)."""
    from kubernetes import client

    labels = {"app.kubernetes.io/name": "tide-retrain", "app.kubernetes.io/managed-by": MANAGED_BY,
              LABEL_JOB_ID: job_id}
    argv = ranks_argv(["python" if arg == "{python}" else arg for arg in sc.command], sc.k8s_gpu_count)
    problems = plain_env_problems(env)
    if problems:
        raise ValueError("retrain Job env: " + "; ".join(problems) + ": put it in a Kubernetes Secret and "
                         "name it in schedule.k8s_secret_env (NAME: secret-name/key)")
    volumes, mounts = _writable_volumes(env, sc.k8s_tide_home)
    volumes, mounts = [a + b for a, b in zip((volumes, mounts), shm_volume(sc.k8s_gpu_count))]
    if sc.k8s_config_map:
        argv += ["--config", f"{CONFIG_MOUNT}/config.yaml"]
        volumes.append(client.V1Volume(name="config", config_map=client.V1ConfigMapVolumeSource(
            name=sc.k8s_config_map)))
        mounts.append(client.V1VolumeMount(name="config", mount_path=CONFIG_MOUNT, read_only=True))
    argv += ["--result-json", RESULT_PATH_IN_POD, "--summary-json", TERMINATION_LOG]
    limits = {"cpu": sc.k8s_cpu, "memory": sc.k8s_memory}
    if sc.k8s_gpu_count > 0:
        limits[sc.k8s_gpu_resource] = str(sc.k8s_gpu_count)
    container = client.V1Container(
        name="retrain", image=sc.k8s_image, image_pull_policy=sc.k8s_image_pull_policy,
        command=argv,
        # a crash before the summary is written leaves the log's tail as the message instead
        termination_message_policy="FallbackToLogsOnError",
        env=[client.V1EnvVar(name=k, value=str(v))
             for k, v in sorted({**env, ENV_JOB_ID: job_id}.items()) if k not in sc.k8s_secret_env]
        + secret_env(sc),
        resources=client.V1ResourceRequirements(
            limits=limits, requests={"cpu": sc.k8s_cpu, "memory": sc.k8s_memory}),
        security_context=_restricted(), volume_mounts=mounts)
    pod = client.V1PodSpec(
        restart_policy="Never", containers=[container],
        node_selector=dict(sc.k8s_node_selector) or None,
        tolerations=[parse_toleration(t) for t in sc.k8s_tolerations] or None,
        service_account_name=sc.k8s_service_account or None, automount_service_account_token=False,
        security_context=client.V1PodSecurityContext(
            run_as_non_root=True, run_as_user=RUN_AS, run_as_group=RUN_AS, fs_group=RUN_AS,
            seccomp_profile=client.V1SeccompProfile(type="RuntimeDefault")),
        volumes=volumes)
    return client.V1Job(
        api_version="batch/v1", kind="Job",
        metadata=client.V1ObjectMeta(name=job_name(sc.k8s_job_name_prefix, job_id),
                                     namespace=sc.k8s_namespace, labels=labels),
        spec=client.V1JobSpec(
            backoff_limit=0, active_deadline_seconds=max(1, int(sc.job_timeout_s)),
            ttl_seconds_after_finished=sc.k8s_ttl_after_finished_s,
            template=client.V1PodTemplateSpec(metadata=client.V1ObjectMeta(labels=labels),
                                              spec=pod)))


def interpret_job_status(job: Any) -> Outcome | None:
    """None while the Job runs; its outcome once a terminal condition (Complete/Failed) is True.

    Counts alone (``status.succeeded``/``failed``) are not enough: the Job controller sets the
    terminal condition only after the pod's cleanup, and that is when the Job is really over.
    """
    status = job.status
    for cond in (status.conditions or []) if status is not None else []:
        if cond.status != "True":
            continue
        if cond.type == "Complete":
            return Outcome(JOB_SUCCEEDED, "Job Complete")
        if cond.type == "Failed":
            reason = cond.reason or "Failed"
            detail = f"Job Failed: {reason}" + (f" ({cond.message})" if cond.message else "")
            return Outcome(JOB_TIMED_OUT if reason == "DeadlineExceeded" else JOB_FAILED, detail)
    return None


def summary_from_pods(pods: Any) -> tuple[dict, str]:
    """The retrain's summary from its pods (a V1PodList): the newest pod's ``retrain`` container
    termination message, parsed. Returns (summary, '') or ({}, what was found instead)."""
    items = sorted(pods.items or [], key=lambda p: p.metadata.creation_timestamp.timestamp()
                   if p.metadata.creation_timestamp else 0.0)
    for pod in reversed(items):
        for status in (pod.status.container_statuses or []) if pod.status is not None else []:
            terminated = status.state.terminated if status.name == "retrain" and status.state else None
            if terminated is None or not terminated.message:
                continue
            try:
                summary = json.loads(terminated.message)
            except ValueError:
                return {}, f"pod {pod.metadata.name}: {terminated.message.strip()[-300:]}"
            if isinstance(summary, dict) and "status" in summary:
                return summary, ""
            return {}, f"pod {pod.metadata.name}: termination message has no 'status'"
    return {}, "no terminated retrain container found"


class KubernetesLauncher:
    kind = "kubernetes"

    def __init__(self, sc: Any, env: Mapping[str, str], api: Any = None, core: Any = None) -> None:
        self.sc = sc
        self.env = dict(env)
        self._api = api
        self._core = core
        build_job(sc, "config-check", self.env)  # a bad toleration fails at start, not per launch

    @property
    def api(self):
        if self._api is None:
            from kubernetes import client, config

            if self.sc.k8s_in_cluster:
                config.load_incluster_config()
            else:
                config.load_kube_config()
            self._api = client.BatchV1Api()
        return self._api

    @property
    def core(self):
        if self._core is None:
            from kubernetes import client

            _ = self.api  # loads the cluster configuration once
            self._core = client.CoreV1Api()
        return self._core

    def _handle(self, job_id: str) -> dict:
        return {"name": job_name(self.sc.k8s_job_name_prefix, job_id),
                "namespace": self.sc.k8s_namespace}

    def launch(self, spec: JobSpec) -> dict:
        from kubernetes.client.exceptions import ApiException

        job = build_job(self.sc, spec.job_id, {**self.env, **spec.env})
        try:
            self.api.create_namespaced_job(self.sc.k8s_namespace, job,
                                           _request_timeout=_API_TIMEOUT_S)
        except ApiException as exc:
            if exc.status != 409:  # 409: created by an earlier, interrupted launch of this id
                raise
        log.info("created Job %s/%s", self.sc.k8s_namespace, job.metadata.name)
        return self._handle(spec.job_id)

    def _read(self, handle: Mapping[str, Any]):
        from kubernetes.client.exceptions import ApiException

        try:
            return self.api.read_namespaced_job_status(handle["name"], handle["namespace"],
                                                       _request_timeout=_API_TIMEOUT_S)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def poll(self, handle: Mapping[str, Any]) -> Outcome | None:
        job = self._read(handle)
        if job is None:
            return Outcome(JOB_FAILED, "Job disappeared before it was seen finishing")
        outcome = interpret_job_status(job)
        if outcome is None:
            return None
        try:  # version and run id for the scheduler's history; the Job's status decides the outcome
            pods = self.core.list_namespaced_pod(handle["namespace"], label_selector=f"job-name={handle['name']}",
                                                 _request_timeout=_API_TIMEOUT_S)
            summary, found = summary_from_pods(pods)
        except Exception as exc:  # noqa: BLE001 - the outcome stands without its summary
            summary, found = {}, f"pods unreadable ({exc})"
        if found:
            log.warning("retrain Job %s: no result summary (%s)", handle["name"], found)
        detail = summary.get("reason") or found
        return Outcome(outcome.status, outcome.reason + (f"; {detail}" if detail else ""), result=summary)

    def kill(self, handle: Mapping[str, Any]) -> None:
        from kubernetes.client.exceptions import ApiException

        try:
            self.api.delete_namespaced_job(handle["name"], handle["namespace"],
                                           propagation_policy="Background",
                                           _request_timeout=_API_TIMEOUT_S)
        except ApiException as exc:
            if exc.status != 404:
                raise

    def find(self, job_id: str) -> dict | None:
        job = self._read(self._handle(job_id))
        return None if job is None or interpret_job_status(job) is not None else self._handle(job_id)

    def find_active(self) -> list[tuple[str, dict]]:
        jobs = self.api.list_namespaced_job(
            self.sc.k8s_namespace, label_selector=f"app.kubernetes.io/managed-by={MANAGED_BY}",
            _request_timeout=_API_TIMEOUT_S)
        return [(j.metadata.labels[LABEL_JOB_ID], self._handle(j.metadata.labels[LABEL_JOB_ID]))
                for j in jobs.items
                if interpret_job_status(j) is None and LABEL_JOB_ID in (j.metadata.labels or {})]
