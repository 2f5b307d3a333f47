"""The retrain job reports the table version it read: in its result file (what the local launcher
reads) and in its summary (what a Kubernetes Job leaves as its termination message). Both reach the
scheduler's rule for moving its watermark; the job runs for real on a table written by the
dataset's own writer, with a real MLflow store."""
from __future__ import annotations

import datetime
import json

from kubernetes import client
from test_window import T0, make_samples  # beside this file

from tide.config import load_config
from tide.contracts import JOB_SUCCEEDED, RESULT_DATA_WATERMARK
from tide.schedule.kubernetes_launcher import summary_from_pods
from tide.schedule.launcher import Outcome, outcome_from_exit
from tide.schedule.policy import watermark_after_success
from tide.train.capture_log import log_samples
from tide.train.window import WindowSpec, plan_window


def _log(data_dir, n: int, start_s: float, prefix: str, offset: int, model: str = "org/m") -> list[int]:
    return log_samples(data_dir, make_samples(n, 5, length=12), [4] * n, target_model_id=model,
                       aux_layer_ids=(1, 2, 3), start_s=start_s, id_prefix=prefix, first_offset=offset,
                       rows_per_file=4)


def test_plan_reports_the_table_version_it_read(tmp_path):
    data_dir = tmp_path / "dataset"
    assert plan_window(data_dir, WindowSpec()).data_version is None  # no table: nothing read
    first = _log(data_dir, 6, T0, "a", 0)
    plan = plan_window(data_dir, WindowSpec(target_model="org/m"))
    assert plan.data_version == first[-1] and plan.catalog_requests == 6
    # another model's newer commit was read and skipped on purpose: it is not new to this retrain either
    other = _log(data_dir, 2, T0 + 50, "o", 100, model="org/other")
    assert plan_window(data_dir, WindowSpec(target_model="org/m")).data_version == other[-1]
    # a pinned version reads what the table held then
    assert plan_window(data_dir, WindowSpec(version=first[0])).catalog_requests == 4


def _pod_with_message(message: str):
    """A finished retrain pod as the Job controller leaves it (the summary as termination message)."""
    state = client.V1ContainerState(terminated=client.V1ContainerStateTerminated(exit_code=0, message=message))
    return client.V1Pod(
        metadata=client.V1ObjectMeta(name="p", creation_timestamp=datetime.datetime.now(datetime.timezone.utc)),
        status=client.V1PodStatus(container_statuses=[client.V1ContainerStatus(
            name="retrain", state=state, image="i", image_id="", ready=False, restart_count=0)]))


def test_retrain_result_carries_the_version_it_read(tmp_path):
    data_dir = tmp_path / "dataset"
    read = _log(data_dir, 5, T0, "r", 0)[-1]
    cfg = load_config(env={}, overrides={"home": str(tmp_path / "home"), "model": {"model_id": "org/m"},
                                         "train": {"data_dir": str(data_dir), "device": "cpu"}})
    result, summary = tmp_path / "result.json", tmp_path / "termination-log"
    from tide.train.online import run_cli
    assert run_cli(cfg, str(result), summary_json=str(summary)) == 0  # too few requests: nothing to do
    assert json.loads(result.read_text())[RESULT_DATA_WATERMARK] == read
    # the local launcher reads the result file
    local = outcome_from_exit(0, result)
    assert local.succeeded and watermark_after_success(None, None, local.result) == read
    # a Kubernetes Job: the scheduler reads the summary from the pod's termination message
    found, problem = summary_from_pods(client.V1PodList(items=[_pod_with_message(summary.read_text())]))
    job = Outcome(JOB_SUCCEEDED, "Job Complete", result=found)  # what KubernetesLauncher.poll returns
    assert problem == "" and watermark_after_success(None, None, job.result) == read
