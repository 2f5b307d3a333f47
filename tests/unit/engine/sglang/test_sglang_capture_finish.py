"""The plugin's capture where a request ends and where SGLang's prefix cache serves a prompt start,
against SGLang's own classes: its ``Req`` finish check (``update_finish_state``: a verify may accept
drafts past an EOS or ``max_new_tokens``; SGLang keeps them in ``output_ids`` and marks
``finished_len``), its commit bookkeeping (``_process``, from test_sglang_capture) and its
``RadixCache`` prefix match. Each hidden row holds its own position, so a row captured at the wrong
position shows."""
from __future__ import annotations

from array import array

import pytest
import torch
from prometheus_client import REGISTRY
from test_sglang_capture import WORKER, ListSink, _batch, _process, _result, _verify_input, records

from tide.capture.sampling import SamplingPolicy
from tide.drafter.artifact import save_drafter
from tide.engine.base import GenerationRequest, SamplingParams
from tide.engine.sglang import plugin
from tide.engine.sglang.capture import CaptureContext
from tide.engine.sglang.engine import SGLangEngine

ND, H, EOS = 4, 8, 2  # draft tokens per verify (root + 3), hidden size, the stop token
PROMPT = list(range(10, 16))
SKIPPED = "tide_capture_prefix_cached_positions_total"


def _req(rid: str, prompt: list[int], max_new: int, stop: tuple[int, ...] = (), salt: str | None = None, **custom):
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams as SGLangSampling

    sp = SGLangSampling(max_new_tokens=max_new, stop_token_ids=list(stop) or None,
                        custom_params={"tide_workload": "code", **custom})
    sp.normalize(None)  # SGLang's tokenizer manager does this before the scheduler sees the request
    req = Req(rid, "", array("q", prompt), sp, cache_salt=salt)
    req.refresh_fill_ids()
    return req


def _ctx(sink: ListSink, fraction: float = 1.0) -> CaptureContext:
    ctx = CaptureContext(sink=sink, policy=SamplingPolicy(fraction), target_model_id="tiny", aux_layer_ids=(1, 2, 3),
                         version=lambda: "1")
    plugin.PROCESS.ctx = ctx
    return ctx


def _rows_at(positions) -> tuple[torch.Tensor, torch.Tensor]:
    pos = torch.as_tensor(list(positions), dtype=torch.float32)[:, None]
    return pos.expand(-1, 3 * H).clone(), pos.expand(-1, H).clone()


def _prefill(req, prefix: int = 0) -> None:
    """One prefill through the plugin's hook; SGLang commits the first output token."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    n = len(req.origin_input_ids) - prefix
    batch = _batch([req], ForwardMode.EXTEND, prefix_lens=[prefix], extend_lens=[n])
    result = _result(*_rows_at(range(prefix, prefix + n)))
    plugin.around_prefill(lambda worker, b: result, WORKER, batch)
    _process(batch, result, lambda: (req.output_ids.append(OUTPUTS[0]), req.update_finish_state()))


def _verify(req, accept: int) -> None:
    """One verify whose drafts the target agrees with up to ``accept`` tokens (drafts + bonus)
    committed as SGLang's decode result processor does; a finished request's row is the overlap
    scheduler's overshoot: nothing committed."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    done, k = req.finished(), len(req.output_ids)
    p = len(req.origin_input_ids) + k - 1  # the root: the last output token
    draft = torch.tensor([req.output_ids[-1], *OUTPUTS[k:k + ND - 1]])
    batch = _batch([req], ForwardMode.DECODE, spec_info=_verify_input(draft, torch.arange(p, p + ND), 1))
    result = _result(*_rows_at(range(p, p + ND)), next_token_ids=torch.tensor(OUTPUTS[k:k + ND], dtype=torch.int32),
                     accept_lens=torch.tensor([accept], dtype=torch.int32), speculative_num_draft_tokens=ND)
    plugin.after_verify(result, WORKER, batch)

    def commit():
        if not done:
            req.output_ids.extend(OUTPUTS[k:k + accept])
            req.update_finish_state(accept)
    _process(batch, result, commit)


OUTPUTS = [100 + k for k in range(40)]
OUTPUTS[6] = EOS  # the target's continuation: a stop token inside the second verify's accepted run
ENDINGS = {"eos_mid_draft": dict(max_new=20, stop=(EOS,), visible=7),
           "max_tokens_mid_draft": dict(max_new=6, stop=(), visible=6),
           "max_tokens_at_prefill": dict(max_new=1, stop=(EOS,), visible=1)}


@pytest.mark.parametrize("ending", list(ENDINGS))
def test_sglang_capture_stops_at_finish(sglang, ending):
    """Captured positions = prompt + output - 1, output = what SGLang lets the client see."""
    case = ENDINGS[ending]
    sink = ListSink()
    _ctx(sink)
    req = _req("r", PROMPT, case["max_new"], case["stop"])
    _prefill(req)
    while True:
        finished = req.finished()
        _verify(req, accept=ND)  # every draft accepted: runs cross the stop
        if finished:
            break
    visible = list(req.output_ids_through_stop)
    assert len(visible) == case["visible"] and req.finished()
    want = PROMPT + visible[:-1]

    steps = [s for s in sink.seen if not s.finished]
    positions = [s.start_position + i for s in steps for i in range(s.token_ids.numel())]
    assert positions == list(range(len(want)))
    assert torch.cat([s.token_ids for s in steps]).tolist() == want
    assert torch.cat([s.aux_hidden for s in steps])[:, 0].tolist() == positions  # each row its own position's
    ends = [s for s in sink.seen if s.finished]
    assert len(ends) == 1 and sink.seen[-1] is ends[0] and ends[0].start_position == len(want)
    assert records(sink.seen)["r"]["token_ids"].tolist() == want  # the record the producer builds


def test_prefix_cache_skips_counted(sglang):
    """A sampled request whose prompt start SGLang's cache served: nothing captured, and the positions
    it would have given (prompt + output - 1) counted; an opted-out one is not counted."""
    sink = ListSink()
    _ctx(sink)
    cached = _req("cached", list(range(10, 30)), max_new=5)
    opted_out = _req("opted-out", list(range(10, 30)), max_new=5, tide_capture=False)
    skipped = REGISTRY.get_sample_value(SKIPPED) or 0.0
    for req in (cached, opted_out):
        _prefill(req, prefix=16)
        while not req.finished():
            _verify(req, accept=3)
    assert sink.seen == []
    want = len(cached.origin_input_ids) + len(cached.output_ids_through_stop) - 1
    assert REGISTRY.get_sample_value(SKIPPED) - skipped == want


def test_full_capture_share_bypasses_the_prefix_cache(sglang, tiny_drafter, tmp_path):
    """``full_capture_fraction`` of the captured requests carry a cache salt of their own: SGLang
    accepts it on /generate, its radix cache then matches none of their prompt, and the plugin
    captures them from position 0; the others still hit the cache and are not captured."""
    from pydantic import TypeAdapter
    from sglang.srt.entrypoints.api_contract import generate_contract_error
    from sglang.srt.managers.io_struct import GenerateReqInput
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams
    from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    serving = save_drafter(tiny_drafter, tmp_path / "serving")
    engine = SGLangEngine("http://127.0.0.1:9", serving, "1", target_model_id="tiny", max_seq_len=200,
                          capture_policy=SamplingPolicy(1.0), full_capture_fraction=0.25)
    prompt = tuple(range(10, 30))
    bodies = {f"r{i}": engine.generate_body(GenerationRequest(f"r{i}", prompt, SamplingParams(max_new_tokens=4)))
              for i in range(400)}
    salted = {rid for rid, b in bodies.items() if "cache_salt" in b}
    assert 0.15 < len(salted) / len(bodies) < 0.35
    assert len({bodies[r]["cache_salt"] for r in salted}) == len(salted)  # one namespace per request
    rid = min(salted)
    assert not engine.captured_in_full(GenerationRequest(rid, prompt, capture=False))  # opted out
    assert not SGLangEngine("http://127.0.0.1:9", serving, "1", target_model_id="tiny", max_seq_len=200,
                            capture_policy=SamplingPolicy(0.0), full_capture_fraction=1.0).captured_in_full(
        GenerationRequest(rid, prompt))  # not sampled: nothing to capture in full
    assert generate_contract_error(bodies[rid]) is None
    salt = TypeAdapter(GenerateReqInput).validate_python(bodies[rid]).cache_salt  # what /generate parses

    tree = RadixCache.create_simulated()  # an earlier request with the same prompt left it cached
    tree.insert(InsertParams(key=RadixKey(array("q", prompt)), value=torch.arange(len(prompt))))
    sink = ListSink()
    _ctx(sink)
    reqs = {"plain": _req("plain", list(prompt), max_new=4), rid: _req(rid, list(prompt), max_new=4, salt=salt)}
    for req in reqs.values():
        req.init_next_round_input(tree)  # SGLang's admission: the prefix match
        batch = _batch([req], ForwardMode.EXTEND, prefix_lens=[req.prefix_len],
                       extend_lens=[len(prompt) - req.prefix_len])
        result = _result(*_rows_at(range(req.prefix_len, len(prompt))))
        plugin.around_prefill(lambda worker, b, result=result: result, WORKER, batch)
        _process(batch, result, lambda: None)
    assert reqs["plain"].prefix_len > 0 and reqs[rid].prefix_len == 0
    assert [(s.meta.request_id, s.start_position, s.token_ids.numel()) for s in sink.seen] == [(rid, 0, len(prompt))]
