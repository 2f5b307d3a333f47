"""SGLang's own Python package on CPU, for the plugin's tests (tide/engine/sglang/).

scripts/install_sglang_cpu.sh installs sglang (--no-deps) and the few packages its import path
needs into their own folder; this conftest puts that folder at the end of sys.path for these
tests only (in the main environment a torchvision would break transformers' imports).

PyPI's torchvision is a CUDA build: its C++ extension cannot load beside torch 2.13 CPU, and its
Python package then fails at import registering fake kernels for operators nobody defined
("operator torchvision::nms does not exist"). SGLang only needs ``torchvision.transforms``
(sglang.srt.configs -> multimodal/internvl_utils.py), so ``_define_torchvision_ops`` declares the
extension's operator schemas (no kernels: calling one raises) before torchvision is imported.
The sglang fixture skips when SGLang is missing, which fails under CI=true (tests/conftest.py).
"""
from __future__ import annotations

import importlib.util
import os
import socket
import sys
from pathlib import Path

import pytest
import torch

from tide.config import default_home

SITE = Path(os.environ.get("TIDE_SGLANG_CPU_SITE") or default_home() / "sglang-cpu")
# torchvision 0.28's C++ operators (torchvision/csrc/ops/*.cpp TORCH_LIBRARY_FRAGMENT schemas)
TORCHVISION_OPS = {
    "nms": "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms": "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "roi_align": "(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, SymInt pooled_width, "
                 "int sampling_ratio, bool aligned) -> Tensor",
    "_roi_align_backward": "(Tensor grad, Tensor rois, float spatial_scale, SymInt pooled_height, "
                           "SymInt pooled_width, SymInt batch_size, SymInt channels, SymInt height, SymInt width, "
                           "int sampling_ratio, bool aligned) -> Tensor",
    "roi_pool": "(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, SymInt pooled_width) "
                "-> (Tensor, Tensor)",
    "_roi_pool_backward": "(Tensor grad, Tensor rois, Tensor argmax, float spatial_scale, SymInt pooled_height, "
                          "SymInt pooled_width, SymInt batch_size, SymInt channels, SymInt height, SymInt width) "
                          "-> Tensor",
    "ps_roi_align": "(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, SymInt pooled_width, "
                    "int sampling_ratio) -> (Tensor, Tensor)",
    "_ps_roi_align_backward": "(Tensor grad, Tensor rois, Tensor channel_mapping, float spatial_scale, "
                              "SymInt pooled_height, SymInt pooled_width, int sampling_ratio, SymInt batch_size, "
                              "SymInt channels, SymInt height, SymInt width) -> Tensor",
    "ps_roi_pool": "(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, SymInt pooled_width) "
                   "-> (Tensor, Tensor)",
    "_ps_roi_pool_backward": "(Tensor grad, Tensor rois, Tensor channel_mapping, float spatial_scale, "
                             "SymInt pooled_height, SymInt pooled_width, SymInt batch_size, SymInt channels, "
                             "SymInt height, SymInt width) -> Tensor",
    "deform_conv2d": "(Tensor input, Tensor weight, Tensor offset, Tensor mask, Tensor bias, SymInt stride_h, "
                     "SymInt stride_w, SymInt pad_h, SymInt pad_w, SymInt dilation_h, SymInt dilation_w, "
                     "SymInt groups, SymInt offset_groups, bool use_mask) -> Tensor",
    "_deform_conv2d_backward": "(Tensor grad, Tensor input, Tensor weight, Tensor offset, Tensor mask, "
                               "Tensor bias, SymInt stride_h, SymInt stride_w, SymInt pad_h, SymInt pad_w, "
                               "SymInt dilation_h, SymInt dilation_w, SymInt groups, SymInt offset_groups, "
                               "bool use_mask) -> (Tensor, Tensor, Tensor, Tensor, Tensor)",
}
_LIBS: list = []  # keeps the schema library alive for the session


def _define_torchvision_ops() -> None:
    spec = importlib.util.find_spec("torchvision")
    if spec is None or spec.origin is None or "torchvision" in sys.modules:
        return
    ext = next(Path(spec.origin).parent.glob("_C*.so"), None)
    if ext is not None:
        try:
            torch.ops.load_library(str(ext))
            return  # a torchvision built for this torch: nothing to declare
        except OSError:
            pass
    lib = torch.library.Library("torchvision", "DEF")
    for name, schema in TORCHVISION_OPS.items():
        lib.define(name + schema)
    _LIBS.append(lib)


def _import_sglang():
    if SITE.is_dir() and str(SITE) not in sys.path:
        sys.path.append(str(SITE))
    cached = sys.modules.get("sglang")
    if cached is not None and getattr(cached, "__file__", None) is None:
        # this folder is named sglang too: an import before SITE was on sys.path found it as a
        # namespace package; the real one (a regular package) wins once SITE is there
        del sys.modules["sglang"]
    _define_torchvision_ops()
    try:
        import sglang
        import sglang.srt.managers.schedule_batch  # noqa: F401  (the deep import path)
    except ImportError as exc:
        pytest.skip(f"SGLang is not importable ({exc}); run scripts/install_sglang_cpu.sh")
    return sglang


@pytest.fixture(scope="session")
def sglang():
    return _import_sglang()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def sglang_dist(sglang):
    """SGLang's single-process parallel state (gloo, world size 1): its layers need the groups even
    at TP 1. The same calls sglang/test/layer_ut_utils.py makes (that module imports benchmark deps)."""
    from sglang.srt.distributed import parallel_state as ps
    from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish, reset_context
    from sglang.srt.server_args import ServerArgs

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0")
    if not torch.distributed.is_initialized():
        ps.init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo")
    if not ps.model_parallel_is_initialized():
        reset_context()
        publish(ServerArgs(model_path="dummy", tp_size=1, ep_size=1, pp_size=1), role="test",
                ranks=SpawnRanks(world_rank=0))
        get_parallel().override_permanently(world_group=ps._WORLD)
        ps.initialize_model_parallel(backend="gloo")
    return sglang
