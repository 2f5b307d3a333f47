"""The plugin's capture conversion against SGLang's own classes (CPU tensors): its records equal the
reference engine's for the same tokens and hidden states.

The reference engine serves three requests and its capture gives, per request, the fed tokens and
the target's aux/final hidden states at every position. The same positions then go through SGLang
objects as SGLang 0.5.23 lays them out: a prefill ``ScheduleBatch`` of ``Req``s with its
``GenerationBatchResult`` (aux [sum(extend), 3H], final [sum(extend), H]), then verify batches with
an ``EagleVerifyInput`` (nd = 4 rows per request: the root, accepted drafts, then rejected rows
filled with noise) and accept lengths that differ by request and step. SGLang's own result code
moves the capture: ``GenerationBatchResult.copy_auxiliary_output_to_cpu`` (its D2H) and
``SchedulerBatchResultProcessor.consume_auxiliary_output`` (the commits it builds from the
requests' output ids). Records are built by the producer's assembler, as the Kafka path does.
"""
from __future__ import annotations

import threading
from array import array
from types import SimpleNamespace

import pytest
import torch

from tide import metrics
from tide.capture.assembler import PendingRequest, build_record
from tide.capture.sampling import SamplingPolicy
from tide.capture.tap import stage
from tide.engine.base import GenerationRequest, SamplingParams, StepCapture
from tide.engine.reference import ReferenceEngine
from tide.engine.sglang import plugin
from tide.engine.sglang.capture import CaptureContext, from_prefill

ND = 4  # SGLang's speculative_num_draft_tokens: the root + 3 drafts
# accept lengths (accepted drafts + the bonus) per request, cycled step by step
SCHEDULES = {"r0": [1, 3, 2, 4], "r1": [4, 4, 1], "r2": [2, 1, 3]}
MAX_NEW = 20


class ListSink:
    def __init__(self) -> None:
        self.seen: list[StepCapture] = []

    def offer(self, captures: list[StepCapture]) -> None:
        self.seen.extend(captures)


def records(steps: list[StepCapture]) -> dict:
    """What the producer makes of each request's steps (tide/capture/producer.py)."""
    pending: dict[str, PendingRequest] = {}
    for s in steps:
        pending.setdefault(s.meta.request_id, PendingRequest(s.meta)).add(stage(s, "bfloat16"), 10_000, 0.0)
    out = {}
    for rid, p in pending.items():
        assert p.complete, rid
        r = build_record(p, "bfloat16", 10_000, finished_at_s=0.0)
        out[rid] = {k: v for k, v in vars(r).items() if k not in ("started_at_s", "finished_at_s")}
    return out


@pytest.fixture(scope="module")
def reference(tiny_target, tiny_drafter):
    """Each request's positions as the reference engine captured them: prompt, then decode."""
    sink = ListSink()
    engine = ReferenceEngine(tiny_target, None, tiny_drafter, "1", target_model_id="tiny", draft_len=3,
                             max_batch_size=4, max_seq_len=200)
    engine.set_capture_sink(sink)
    g = torch.Generator().manual_seed(11)
    prompts = {rid: torch.randint(3, 500, (n,), generator=g).tolist() for rid, n in zip(SCHEDULES, (7, 19, 12))}

    def run(rid):
        req = GenerationRequest(rid, tuple(prompts[rid]), SamplingParams(max_new_tokens=MAX_NEW), workload="code")
        list(engine.submit(req))
    threads = [threading.Thread(target=run, args=(rid,)) for rid in prompts]
    [t.start() for t in threads]
    [t.join(60) for t in threads]
    engine.close()
    return prompts, sink.seen


def _req(rid: str, prompt: list[int], **custom):
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams as SGLangSampling

    req = Req(rid, "", array("q", prompt), SGLangSampling(max_new_tokens=MAX_NEW,
                                                          custom_params={"tide_workload": "code", **custom}))
    req.refresh_fill_ids()
    return req


def _batch(reqs, mode, **fields):
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    return ScheduleBatch(reqs=reqs, device="cpu", forward_mode=mode,
                         spec_algorithm=SpeculativeAlgorithm.from_string("EAGLE3"), **fields)


def _result(aux, final, **fields):
    from sglang.srt.layers.logits_processor import LogitsProcessorOutput
    from sglang.srt.managers.utils import GenerationBatchResult

    lo = LogitsProcessorOutput(next_token_logits=None, hidden_states=aux, last_hidden_states=final)
    return GenerationBatchResult(logits_output=lo, **fields)


def _process(batch, result, commit) -> None:
    """SGLang's scheduler after the forward: D2H, commit the tokens, consume the capture."""
    from sglang.srt.managers.scheduler_components.batch_result_processor import SchedulerBatchResultProcessor as P

    result.copy_auxiliary_output_to_cpu()
    starts = P.snapshot_auxiliary_output_starts(batch, result)
    commit()
    if result.auxiliary_host_output is not None:
        P.consume_auxiliary_output(batch, result.auxiliary_host_output, starts)


def _verify_input(draft_token, positions, bs):
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode
    from sglang.srt.speculative.eagle_info import EagleVerifyInput

    chain = torch.arange(ND).repeat(bs, 1)
    return EagleVerifyInput(draft_token=draft_token, custom_mask=torch.ones(bs * ND * ND, dtype=torch.bool),
                            positions=positions, retrieve_index=chain, retrieve_next_token=chain,
                            retrieve_next_sibling=chain, retrieve_cum_len=None, spec_steps=ND - 1, topk=1,
                            draft_token_num=ND, capture_hidden_mode=CaptureHiddenMode.FULL, seq_lens_sum=None,
                            seq_lens_cpu=None)


WORKER = SimpleNamespace(_draft_worker=object())  # an EAGLEWorkerV2 hosting the draft (last PP rank)


def _through_sglang(ctx, prompts, steps, opt_out=()):
    """Replays the reference's positions through SGLang objects and the plugin's hooks."""
    from sglang.srt.managers.schedule_batch import FINISH_LENGTH
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    plugin.PROCESS.ctx = ctx

    streams = {}
    for rid in prompts:
        mine = [s for s in steps if s.meta.request_id == rid and s.token_ids.numel()]
        streams[rid] = (torch.cat([s.token_ids for s in mine[1:]]), torch.cat([s.aux_hidden for s in mine[1:]]),
                        torch.cat([s.final_hidden for s in mine[1:]]), mine[0])
    reqs = {rid: _req(rid, p, **({"tide_capture": False} if rid in opt_out else {})) for rid, p in prompts.items()}
    order = list(prompts)
    prefill = [streams[r][3] for r in order]
    batch = _batch([reqs[r] for r in order], ForwardMode.EXTEND, prefix_lens=[0] * 3,
                   extend_lens=[len(prompts[r]) for r in order])
    result = _result(torch.cat([s.aux_hidden for s in prefill]), torch.cat([s.final_hidden for s in prefill]))
    # the hook sees the batch before the draft extend rewrites its lengths
    assert plugin.around_prefill(lambda worker, b: result, WORKER, batch) is result
    _process(batch, result, lambda: [reqs[r].output_ids.append(int(streams[r][0][0])) for r in order])

    done, step, noise = {r: 0 for r in order}, 0, torch.Generator().manual_seed(5)
    while live := [r for r in order if done[r] < len(streams[r][0])]:
        blocks = []
        for r in live:
            tokens, aux, final, first = streams[r]
            k, n = done[r], min(SCHEDULES[r][step % len(SCHEDULES[r])], len(tokens) - done[r])
            junk = ND - n
            fed = tokens[k:k + n]
            bonus = tokens[k + n:k + n + 1] if k + n < len(tokens) else torch.tensor([7])
            blocks.append(dict(n=n, draft=torch.cat([fed, torch.randint(3, 500, (junk,), generator=noise)]),
                               predict=torch.cat([fed[1:], bonus, torch.randint(3, 500, (junk,), generator=noise)]),
                               pos=len(prompts[r]) + k + torch.arange(ND),
                               aux=torch.cat([aux[k:k + n], torch.randn(junk, aux.shape[1], generator=noise)]),
                               final=torch.cat([final[k:k + n], torch.randn(junk, final.shape[1], generator=noise)])))
            done[r] += n
        batch = _batch([reqs[r] for r in live], ForwardMode.DECODE,
                       spec_info=_verify_input(torch.cat([b["draft"] for b in blocks]),
                                               torch.cat([b["pos"] for b in blocks]), len(live)))
        result = _result(torch.cat([b["aux"] for b in blocks]), torch.cat([b["final"] for b in blocks]),
                         next_token_ids=torch.cat([b["predict"] for b in blocks]).to(torch.int32),
                         accept_lens=torch.tensor([b["n"] for b in blocks], dtype=torch.int32),
                         speculative_num_draft_tokens=ND)
        plugin.after_verify(result, WORKER, batch)

        def commit(live=live, blocks=blocks):
            for r, b in zip(live, blocks):
                reqs[r].output_ids.extend(b["predict"][:b["n"]].tolist())
                if done[r] == len(streams[r][0]):
                    reqs[r].finished_reason = FINISH_LENGTH(length=MAX_NEW)
        _process(batch, result, commit)
        step += 1


def _ctx(sink, tiny_target, fraction=1.0):
    return CaptureContext(sink=sink, policy=SamplingPolicy(fraction), target_model_id="tiny",
                          aux_layer_ids=tiny_target.aux_layer_ids, version=lambda: "1")


def test_records_equal_the_reference_engines_for_the_same_positions(sglang, reference, tiny_target):
    prompts, steps = reference
    sink = ListSink()
    forwards = metrics.ENGINE_TARGET_FORWARDS.labels("1")._value.get()
    _through_sglang(_ctx(sink, tiny_target), prompts, steps)

    want, got = records(steps), records(sink.seen)
    assert set(got) == set(prompts)
    for rid in prompts:
        assert got[rid].keys() == want[rid].keys()
        for field, value in want[rid].items():
            same = (value == got[rid][field]).all() if hasattr(value, "all") else value == got[rid][field]
            assert same, (rid, field)
        assert got[rid]["workload"] == "code" and got[rid]["position_start"] == 0
    # several accept lengths per request went through, and every verify row was counted
    decode = [s for s in sink.seen if not s.is_prompt and s.token_ids.numel()]
    assert {int(s.token_ids.numel()) for s in decode} == {1, 2, 3, 4}
    assert metrics.ENGINE_TARGET_FORWARDS.labels("1")._value.get() - forwards == len(decode)
    assert [s.finished for s in sink.seen].count(True) == len(prompts)


def test_an_opted_out_request_and_an_unsampled_one_give_nothing(sglang, reference, tiny_target):
    prompts, steps = reference
    sink = ListSink()
    _through_sglang(_ctx(sink, tiny_target), prompts, steps, opt_out=("r1",))
    assert {s.meta.request_id for s in sink.seen} == {"r0", "r2"}
    sink = ListSink()
    _through_sglang(_ctx(sink, tiny_target, fraction=0.0), prompts, steps)
    assert sink.seen == []


def test_a_prompt_whose_start_was_cached_is_not_captured(sglang, tiny_target):
    """A radix-cache hit: the first extend SGLang runs starts past position 0."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    sink = ListSink()
    ctx = _ctx(sink, tiny_target)
    req = _req("cached", list(range(10, 30)))
    h = tiny_target.shape.hidden_size
    batch = _batch([req], ForwardMode.EXTEND, prefix_lens=[16], extend_lens=[4])
    result = _result(torch.randn(4, 3 * h), torch.randn(4, h))
    dropped = metrics.CAPTURE_DROPPED_STEPS.labels("prefix_cached")._value.get()
    assert from_prefill(ctx, batch, result) is None
    assert metrics.CAPTURE_DROPPED_STEPS.labels("prefix_cached")._value.get() == dropped + 1
    assert ctx.meta_for(req) is None  # its later verify steps are not captured either


def test_a_full_tap_queue_drops_and_counts_and_stops_copying_that_request(sglang, tiny_target):
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    sink = ListSink()
    ctx = CaptureContext(sink=sink, policy=SamplingPolicy(1.0), target_model_id="tiny",
                         aux_layer_ids=tiny_target.aux_layer_ids, version=lambda: "1", queue_full=lambda: True)
    req = _req("busy", list(range(10, 20)))
    h = tiny_target.shape.hidden_size
    batch = _batch([req], ForwardMode.EXTEND, prefix_lens=[0], extend_lens=[10])
    dropped = metrics.CAPTURE_DROPPED_STEPS.labels("queue_full")._value.get()
    assert from_prefill(ctx, batch, _result(torch.randn(10, 3 * h), torch.randn(10, h))) is None
    assert metrics.CAPTURE_DROPPED_STEPS.labels("queue_full")._value.get() == dropped + 1
    assert ctx.meta_for(req) is None  # a record with a hole would teach wrong transitions
