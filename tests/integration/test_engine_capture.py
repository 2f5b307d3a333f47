"""N requests through the reference engine (tiny model) with capture on, real broker, real ingest:
exactly the expected rows in Parquet, tensors bit-identical to what the engine computed (bf16 cast)."""
import threading

import torch

from tide.capture.tap import CaptureTap
from tide.config import CaptureConfig, IngestConfig, KafkaConfig
from tide.dataset import DatasetReader, DatasetTable
from tide.dataset.topics import ensure_topics
from tide.engine.base import GenerationRequest, SamplingParams
from tide.engine.reference import ReferenceEngine
from tide.models.llama import LlamaTarget
from tide.models.tiny import tiny_llama_checkpoint
from tide.train.offline import new_drafter


class Tee:
    """Forwards to the real tap and keeps what the engine offered, to compare bit for bit."""

    def __init__(self, tap):
        self.tap, self.seen = tap, []

    def offer(self, captures):
        self.seen.extend(captures)
        self.tap.offer(captures)


def test_engine_requests_land_in_parquet_bit_identical(memory_broker, topic_name, tmp_path, capture_kit, wait):
    torch.set_num_threads(1)
    target = LlamaTarget.from_folder(tiny_llama_checkpoint(tmp_path / "tiny"), aux_layer_ids=(1, 2, 3), max_seq_len=256)
    drafter = new_drafter(target, 256, torch.arange(512).flip(0), seed=1).eval()
    engine = ReferenceEngine(target, None, drafter, "v1", target_model_id="tiny-test", draft_len=3,
                             max_batch_size=4, max_seq_len=256)
    bs = memory_broker.bootstrap_servers
    kafka = KafkaConfig(bootstrap_servers=bs, topic=topic_name, dead_letter_topic=topic_name + ".dl")
    tap = CaptureTap(CaptureConfig(enabled=True, queue_max_items=10_000), kafka)
    tee = Tee(tap)
    engine.set_capture_sink(tee)
    n = 12
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 500, (int(torch.randint(4, 40, (1,), generator=g)),), generator=g).tolist()
               for _ in range(n)]
    outputs = {}

    def one(i):
        req = GenerationRequest(f"eng-{i}", tuple(prompts[i]), SamplingParams(max_new_tokens=20),
                                workload="chat" if i % 2 else "code", capture=(i != 0))
        outputs[i] = [t for ev in engine.submit(req) for t in ev.token_ids]
    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    [t.start() for t in threads]
    [t.join(timeout=120) for t in threads]
    engine.close()
    tap.close(timeout_s=30)

    icfg = IngestConfig(roll_interval_s=1.0, metrics_port=0)
    ensure_topics(icfg, kafka)
    data_dir = tmp_path / "data"
    with capture_kit.IngestThread(icfg, kafka, data_dir):
        wait(lambda: DatasetTable(data_dir).summary()["requests"] >= n - 1, 60, what="requests in Parquet")
        wait(lambda: capture_kit.caught_up(kafka, icfg.group_id), 60, what="ingest committed the whole topic")
    reader = DatasetReader(data_dir)
    samples = {s.request_id: s for s in reader.samples()}
    assert reader.duplicates == 0 and reader.incomplete == 0
    assert set(samples) == {f"eng-{i}" for i in range(1, n)}  # request 0 opted out
    for i in range(1, n):
        s = samples[f"eng-{i}"]
        steps = [c for c in tee.seen if c.meta.request_id == f"eng-{i}" and c.token_ids.numel()]
        # every fed token: the prompt, then all generated tokens but the last (never fed)
        assert s.token_ids.tolist() == prompts[i] + outputs[i][:len(s.token_ids) - len(prompts[i])]
        assert len(s.token_ids) == len(prompts[i]) + len(outputs[i]) - 1
        assert torch.equal(s.aux_hidden, torch.cat([c.aux_hidden for c in steps]).to(torch.bfloat16).float())
        assert torch.equal(s.final_hidden, torch.cat([c.final_hidden for c in steps]).to(torch.bfloat16).float())
        assert s.loss_mask.tolist() == [0] * len(prompts[i]) + [1] * (len(s.token_ids) - len(prompts[i]))
        assert s.workload == ("chat" if i % 2 else "code") and s.drafter_version == "v1"


class GatedTee(Tee):
    """Holds the decode loop inside the first generated step's capture until ``released``, so the
    test requests a swap at a known point of a running request."""

    def __init__(self, tap):
        super().__init__(tap)
        self.held, self.released = threading.Event(), threading.Event()

    def offer(self, captures):
        super().offer(captures)
        if not self.held.is_set() and any(not c.is_prompt and c.token_ids.numel() for c in captures):
            self.held.set()
            self.released.wait(30)


def test_a_request_spanning_a_swap_names_both_versions_in_parquet(memory_broker, topic_name, tmp_path, capture_kit,
                                                                    wait):
    """Lineage end to end: positions drafted after a swap are tagged with the new version in the dataset."""
    torch.set_num_threads(1)
    target = LlamaTarget.from_folder(tiny_llama_checkpoint(tmp_path / "tiny"), aux_layer_ids=(1, 2, 3), max_seq_len=256)
    drafter = new_drafter(target, 256, torch.arange(512).flip(0), seed=1).eval()
    engine = ReferenceEngine(target, None, drafter, "v1", target_model_id="tiny-test", draft_len=3,
                             max_batch_size=2, max_seq_len=256)
    kafka = KafkaConfig(bootstrap_servers=memory_broker.bootstrap_servers, topic=topic_name,
                        dead_letter_topic=topic_name + ".dl")
    tap = CaptureTap(CaptureConfig(enabled=True, queue_max_items=10_000), kafka)
    tee = GatedTee(tap)
    engine.set_capture_sink(tee)
    try:
        stream = engine.submit(GenerationRequest("spans-swap", tuple(range(5, 25)), SamplingParams(max_new_tokens=30)))
        assert tee.held.wait(60)
        engine.swap_drafter(new_drafter(target, 256, torch.arange(512).flip(0), seed=2).eval(), "v2")
        tee.released.set()
        out = [t for ev in stream for t in ev.token_ids]
    finally:
        tee.released.set()
        engine.close()
        tap.close(timeout_s=30)
    first_v2 = next(c.start_position for c in tee.seen if c.meta.drafter_version == "v2" and c.token_ids.numel())

    icfg = IngestConfig(roll_interval_s=1.0, metrics_port=0)
    ensure_topics(icfg, kafka)
    data_dir = tmp_path / "data"
    with capture_kit.IngestThread(icfg, kafka, data_dir):
        wait(lambda: capture_kit.caught_up(kafka, icfg.group_id), 60, what="ingest committed the whole topic")
    (sample,) = DatasetReader(data_dir).samples()
    assert len(sample.token_ids) == 20 + len(out) - 1
    assert sample.drafter_version == "v1" and sample.version_changes == ((first_v2, "v2"),)
    assert sample.drafter_version_at(first_v2 - 1) == "v1" and sample.drafter_version_at(first_v2) == "v2"
