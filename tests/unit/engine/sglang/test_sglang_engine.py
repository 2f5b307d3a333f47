"""SGLangEngine's requests against SGLang 0.5.23's own request contracts (no server runs here): the
/generate body passes SGLang's JSON contract gate, every swap body validates as the request type
its route takes, and the weight-update body, decoded as SGLang's route decodes it, reaches TIDE's
loader and swaps SGLang's draft model; the plugin's counters read back as EngineStats."""
from __future__ import annotations

import pytest
import torch
from prometheus_client import generate_latest
from test_sglang_weights import build_sglang_draft, sglang_params_of

from tide import metrics
from tide.contracts import VersionAcceptance
from tide.drafter.artifact import save_drafter
from tide.engine.base import GenerationRequest, SamplingParams
from tide.engine.sglang import plugin
from tide.engine.sglang.engine import SGLangEngine
from tide.metrics_text import parse
from tide.train.offline import new_drafter


@pytest.fixture(scope="module")
def engine_and_candidate(tiny_target, tiny_drafter, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sglang-engine")
    serving = save_drafter(tiny_drafter, tmp / "serving")
    other = new_drafter(tiny_target, tiny_drafter.shape.draft_vocab_size, torch.zeros(512), seed=9)
    other.set_vocab_mapping(tiny_drafter.d2t.clone())
    candidate = save_drafter(other.eval(), tmp / "candidate")
    engine = SGLangEngine("http://127.0.0.1:9", serving, "1", target_model_id="tiny", max_seq_len=200, tp_size=2)
    return engine, candidate, other


def test_the_generate_body_passes_sglangs_contract(sglang, engine_and_candidate):
    from sglang.srt.entrypoints.api_contract import generate_contract_error

    engine, _, _ = engine_and_candidate
    for sp in (SamplingParams(max_new_tokens=8), SamplingParams(max_new_tokens=8, temperature=0.7, top_p=0.9,
                                                                 top_k=20, seed=3, stop_token_ids=(2,), ignore_eos=True)):
        body = engine.generate_body(GenerationRequest("r1", (5, 6, 7), sp, workload="code", capture=False))
        assert generate_contract_error(body) is None, body
        assert body["sampling_params"]["custom_params"] == {"tide_workload": "code", "tide_capture": False}
    bad = dict(body, sampling_params={**body["sampling_params"], "seed": 3})  # the check can fail
    assert generate_contract_error(bad) is not None


def test_swap_bodies_are_sglangs_requests_and_the_update_swaps_the_draft(sglang_dist, engine_and_candidate):
    from pydantic import TypeAdapter
    from sglang.srt.managers import io_struct
    from sglang.srt.model_executor.model_runner_components.weight_updater import _unwrap_tensor
    from sglang.srt.utils import MultiprocessingSerializer

    engine, candidate, other = engine_and_candidate
    routes = {"/pause_generation": io_struct.PauseGenerationReqInput,
              "/begin_weight_update": io_struct.BeginWeightUpdateReqInput,
              "/update_weights_from_tensor": io_struct.UpdateWeightsFromTensorReqInput,
              "/end_weight_update": io_struct.EndWeightUpdateReqInput,
              "/continue_generation": io_struct.ContinueGenerationReqInput}
    bodies = engine.swap_bodies(engine.validate_drafter(candidate, [5, 6]), "2")
    assert list(bodies) == list(routes)  # pause, session open, update, session close, continue
    parsed = {}
    for route, body in bodies.items():
        assert set(body) <= set(routes[route].__struct_fields__), route
        parsed[route] = TypeAdapter(routes[route]).validate_python(body)  # what FastAPI does
    update = parsed["/update_weights_from_tensor"]
    assert update.selector == "draft" and parsed["/begin_weight_update"].selector == "draft"
    assert update.flush_cache is False and parsed["/pause_generation"].mode == "in_place"
    assert len(update.serialized_named_tensors) == 2  # one per TP rank
    model = build_sglang_draft(engine.drafter.folder)
    named = [(n, _unwrap_tensor(t, tp_rank=1, device="cpu"))
             for n, t in MultiprocessingSerializer.deserialize(update.serialized_named_tensors[1])]
    plugin.load_draft(model, named)
    got = dict(model.named_parameters())
    assert all(torch.equal(got[k], v) for k, v in sglang_params_of(other).items())


def test_stats_read_the_plugins_counters_back(engine_and_candidate):
    engine, _, _ = engine_and_candidate

    def read() -> dict:
        return engine.acceptance_of(parse(generate_latest().decode(), prefix="tide_engine_"))
    before = read().get("9", VersionAcceptance())
    metrics.ENGINE_TARGET_FORWARDS.labels("9").inc(3)
    metrics.ENGINE_ACCEPTED_TOKENS.labels("9").inc(4)
    for n in (1, 3, 3):
        metrics.ENGINE_ACCEPT_LENGTH.labels("9").observe(n)
    assert read()["9"] - before == VersionAcceptance(forwards=3, accepted=4, committed=7)
