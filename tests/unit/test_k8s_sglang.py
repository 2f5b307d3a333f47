"""k8s/overlays/sglang-{nvidia,amd}: the SGLang engine variant, without a cluster or kubectl.

Each overlay's patch applied to the base engine Deployment (strategic merge: containers by name,
env by name) validates against the Kubernetes client's models, runs the SGLang engine service with
the flags it accepts, asks for its vendor's GPU, sets only TIDE_* variables that name config fields
and parse (AMD: --disable-custom-all-reduce reaches the SGLang server command), and mounts volumes
that exist; the Service and the other Deployments stay the base's.
"""
import copy
import importlib

import pytest
import yaml
from kubernetes import client
from test_k8s_manifests import K8S, OBJECTS, _docs, _env, _named

from tide.config import load_config
from tide.drafter.static import PACKAGED
from tide.engine.sglang.server_args import server_command
from tide.schedule import kubernetes_launcher

GPU = {"sglang-nvidia": "nvidia.com/gpu", "sglang-amd": "amd.com/gpu"}


def _patched(overlay: str) -> dict:
    kust = _docs(K8S / "overlays" / overlay / "kustomization.yaml")[0]
    assert kust["resources"] == ["../../base"]
    (p,) = kust["patches"]
    assert p["target"] == {"group": "apps", "version": "v1", "kind": "Deployment", "name": "tide-engine"}
    dep = copy.deepcopy(_named("Deployment")["tide-engine"])
    spec, patch = dep["spec"]["template"]["spec"], yaml.safe_load(p["patch"])["spec"]["template"]["spec"]
    for pc in patch.pop("containers"):
        (c,) = [c for c in spec["containers"] if c["name"] == pc["name"]]
        env = {e["name"]: e for e in c.get("env", [])} | {e["name"]: e for e in pc.pop("env", [])}
        mounts = {m["name"]: m for m in c.get("volumeMounts", [])} | {m["name"]: m for m in pc.pop("volumeMounts", [])}
        c.update(pc, env=list(env.values()), volumeMounts=list(mounts.values()))
    volumes = {v["name"]: v for v in spec.get("volumes", [])} | {v["name"]: v for v in patch.pop("volumes", [])}
    spec.update(patch, volumes=list(volumes.values()))
    return dep


@pytest.mark.parametrize("overlay", sorted(GPU))
def test_the_sglang_overlay_validates_and_runs_the_sglang_engine(overlay, tmp_path):
    dep = _patched(overlay)
    client.V1Deployment.model_validate(dep)
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    python, dash_m, name, *args = c["command"]
    assert (python, dash_m, name) == ("python", "-m", "tide.services.sglang_engine")
    assert importlib.import_module(name).parse_args(args).config == f"{kubernetes_launcher.CONFIG_MOUNT}/config.yaml"
    assert c["resources"]["limits"][GPU[overlay]] == "1" and set(GPU.values()) & set(c["resources"]["limits"]) == {
        GPU[overlay]}
    volumes = {v["name"] for v in dep["spec"]["template"]["spec"]["volumes"]}
    assert {m["name"] for m in c["volumeMounts"]} <= volumes
    env = {k: v for k, v in _env(c).items() if k.startswith("TIDE_")}
    cfg_text = next(d for d in OBJECTS if d["kind"] == "ConfigMap")["data"]["config.yaml"]
    (tmp_path / "config.yaml").write_text(cfg_text)
    cfg = load_config(tmp_path / "config.yaml", env=env)  # ConfigError for an unknown field or bad value
    for key in env:
        section, _, field = key[len("TIDE_"):].lower().partition("__")
        assert field in type(getattr(cfg, section)).model_fields, key
    argv = server_command(cfg, cfg.sglang.target, PACKAGED)
    assert ("--disable-custom-all-reduce" in argv) == (overlay == "sglang-amd")
    assert cfg.sglang.target == "/models/target"
