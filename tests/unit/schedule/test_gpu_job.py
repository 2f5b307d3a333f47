"""A retrain Job uses the GPUs it asks for: the device variables, one torchrun rank per GPU, and
a memory-backed /dev/shm for NCCL; a CPU Job (0 GPUs) trains on the CPU."""
import pytest
from kubernetes import client

from tide.config import ScheduleConfig, load_config
from tide.schedule.gpu_job import ranks_argv
from tide.schedule.kubernetes_launcher import build_job, job_env


def _pod(gpus: int, **kw) -> dict:
    cfg = load_config(env={}, overrides={"schedule": {"launcher": "kubernetes", "k8s_gpu_count": gpus, **kw}})
    job = build_job(cfg.schedule, "20250101-120000-abc123", job_env(cfg))
    return client.ApiClient().sanitize_for_serialization(job)["spec"]["template"]["spec"]


def _env(pod: dict) -> dict:
    return {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}


@pytest.mark.parametrize("gpus, device, ranks", [(0, "cpu", None), (1, "cuda", None), (4, "cuda", "4")])
def test_the_job_trains_on_the_device_it_asks_for(gpus, device, ranks):
    pod = _pod(gpus)
    env, command = _env(pod), pod["containers"][0]["command"]
    assert env["TIDE_TRAIN__DEVICE"] == device
    assert load_config(env=env).train.device == device  # a value the Job's config accepts
    assert (env.get("TIDE_TRAIN__PRECISION") == "bf16") == (gpus > 0)
    if ranks:
        assert command[:7] == ["python", "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                               ranks, "-m"]
        assert command[7:10] == ["tide.cli", "train", "--online"]
        shm = {v["name"]: v for v in pod["volumes"]}["dshm"]
        assert shm["emptyDir"] == {"medium": "Memory"}
    else:
        assert command[:3] == ["python", "-m", "tide.cli"] and "dshm" not in {v["name"] for v in pod["volumes"]}


def test_k8s_env_overrides_the_device_and_a_custom_command_needs_a_module():
    env = _env(_pod(1, k8s_env={"TIDE_TRAIN__DEVICE": "auto"}))
    assert env["TIDE_TRAIN__DEVICE"] == "auto"
    with pytest.raises(ValueError, match="python -m MODULE"):
        ranks_argv(["/usr/bin/retrain"], 2)
    assert ranks_argv(["/usr/bin/retrain"], 1) == ["/usr/bin/retrain"]
    assert ScheduleConfig().k8s_gpu_count == 1
