"""Window + replay + held-out selection over real Parquet files written by the dataset writer."""
from __future__ import annotations

import pytest
import torch

from tide.train.capture_log import log_samples
from tide.train.trainer import Sample
from tide.train.window import WindowSpec, describe_counts, heldout_score, load_window, plan_window, replay_quotas

H = 8
T0 = 1_700_000_000.0


def make_samples(n: int, seed: int, length: int = 20) -> list[Sample]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        t = length + i % 7
        out.append(Sample(tokens=torch.randint(0, 500, (t,), generator=g), loss_mask=torch.ones(t),
                          aux=torch.randn(t, 3 * H, generator=g), final=torch.randn(t, H, generator=g)))
    return out


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    """100 old 'chat' requests, then 60 recent 'code' requests an hour later (chunked records)."""
    data_dir = tmp_path_factory.mktemp("dataset")
    old, new = make_samples(100, 1), make_samples(60, 2)
    log_samples(data_dir, old, [8] * len(old), target_model_id="org/m", aux_layer_ids=(1, 2, 3),
                start_s=T0, workload="chat", id_prefix="chat", rows_per_file=40)
    log_samples(data_dir, new, [8] * len(new), target_model_id="org/m", aux_layer_ids=(1, 2, 3),
                start_s=T0 + 3600, workload="code", id_prefix="code", first_offset=1000,
                max_message_bytes=2000, rows_per_file=50)
    log_samples(data_dir, make_samples(5, 3), [4] * 5, target_model_id="org/other",
                aux_layer_ids=(1, 2, 3), start_s=T0 + 7200, id_prefix="other", first_offset=5000)
    return data_dir, old, new


def test_window_replay_and_heldout_partition(dataset):
    data_dir, _, _ = dataset
    spec = WindowSpec(window_samples=60, replay_ratio=0.5, heldout_fraction=0.2, target_model="org/m")
    plan = plan_window(data_dir, spec)
    assert plan.catalog_requests == 160 and plan.window_requests == 60  # other model excluded
    assert all(r.startswith("code") for r in plan.recent + plan.heldout)
    assert all(r.startswith("chat") for r in plan.replay)
    assert len(plan.replay) == int(0.5 * len(plan.recent) + 0.5)  # half rounds up
    assert all(heldout_score(r) < 0.2 for r in plan.heldout)
    assert all(heldout_score(r) >= 0.2 for r in plan.recent + plan.replay)  # never trained on
    assert len(plan.recent) + plan.heldout_in_window == 60
    assert plan.window_start_s == T0 + 3600 and plan.window_end_s == T0 + 3600 + 59
    assert plan == plan_window(data_dir, spec)  # deterministic
    other_seed = plan_window(data_dir, WindowSpec(window_samples=60, replay_ratio=0.5, heldout_fraction=0.2,
                                                  target_model="org/m", seed=1))
    assert other_seed.recent == plan.recent and other_seed.replay != plan.replay


def test_time_window_token_cap_and_until(dataset):
    data_dir, _, _ = dataset
    plan = plan_window(data_dir, WindowSpec(window_s=1800, replay_ratio=0.0, target_model="org/m"))
    assert plan.window_requests == 60 and plan.replay == []
    capped = plan_window(data_dir, WindowSpec(window_s=1800, max_train_tokens=200, target_model="org/m"))
    assert capped.recent_tokens <= 200 and capped.recent == plan.recent[-len(capped.recent):]
    early = plan_window(data_dir, WindowSpec(window_samples=10, target_model="org/m", until_s=T0 + 50))
    assert early.catalog_requests == 50 and early.window_end_s == T0 + 49


def test_a_window_since_a_shift_replays_the_traffic_before_it(dataset):
    """The first retrain after a workload shift: recent = what came since the shift, replay = before."""
    data_dir, _, _ = dataset
    plan = plan_window(data_dir, WindowSpec(window_since_s=T0 + 3600 + 30, replay_ratio=1.0, heldout_fraction=0.2,
                                            target_model="org/m"))
    assert plan.window_start_s == T0 + 3630 and plan.window_requests == 30
    assert plan.recent and all(r.startswith("code") and int(r.split("-")[1]) >= 30 for r in plan.recent)
    assert len(plan.replay) == len(plan.recent) and not set(plan.replay) & set(plan.recent + plan.heldout)
    assert all(r.startswith("chat") or int(r.split("-")[1]) < 30 for r in plan.replay)


def test_a_window_cut_by_the_token_cap_replays_its_older_part(dataset):
    """A window holding everything (window_s 2 h) cut to its newest 200 tokens: the rest is replayed,
    never dropped (a code-only recent set still sees the chat before it)."""
    data_dir, _, _ = dataset
    plan = plan_window(data_dir, WindowSpec(window_s=7200, max_train_tokens=200, replay_ratio=2.0,
                                            heldout_fraction=0.2, target_model="org/m"))
    assert plan.window_requests == 160 and plan.recent_tokens <= 200
    assert len(plan.replay) == 2 * len(plan.recent) and not set(plan.replay) & set(plan.recent)
    assert any(r.startswith("chat") for r in plan.replay)
    assert all(heldout_score(r) >= 0.2 for r in plan.replay)


def test_replay_by_workload_shares_the_replay_evenly_among_older_workloads(dataset):
    """Older than the newest 12 code requests: 100 chat and 48 code; a replay of twice the recent
    requests by workload is half chat, half code, whatever their numbers in the pool."""
    data_dir, _, _ = dataset
    spec = WindowSpec(window_samples=12, replay_ratio=2.0, heldout_fraction=0.2, target_model="org/m",
                      replay_by_workload=True)
    plan = plan_window(data_dir, spec)
    chat = [r for r in plan.replay if r.startswith("chat")]
    code = [r for r in plan.replay if r.startswith("code")]
    assert len(plan.replay) == 2 * len(plan.recent) and abs(len(chat) - len(code)) <= 1
    assert plan.replay_workloads == describe_counts({"chat": len(chat), "code": len(code)})
    assert not set(plan.replay) & set(plan.recent) and all(heldout_score(r) >= 0.2 for r in plan.replay)
    assert plan == plan_window(data_dir, spec)  # deterministic


def test_replay_quotas_give_a_small_workload_all_it_has_and_the_rest_to_the_others():
    assert replay_quotas({"chat": 43, "code": 400}, 190) == {"chat": 43, "code": 147}
    assert replay_quotas({"a": 10, "b": 10}, 5) in ({"a": 3, "b": 2}, {"a": 2, "b": 3})
    assert replay_quotas({"a": 3, "b": 50, "c": 50}, 30) == {"a": 3, "b": 14, "c": 13}
    assert replay_quotas({"a": 3, "b": 4}, 100) == {"a": 3, "b": 4}  # the pool is smaller than asked
    assert replay_quotas({}, 10) == {} and replay_quotas({"a": 5}, 0) == {"a": 0}


def test_replayed_workloads_are_described_largest_first_within_a_bound():
    assert describe_counts({"chat": 45, "code": 142}) == "code:142,chat:45"
    many = describe_counts({f"tenant-{i:03d}": 1000 - i for i in range(200)})
    assert len(many) <= 500 and many.startswith("tenant-000:1000,") and many.endswith(" more")
    assert describe_counts({"a-long-tag-name": 3}, max_chars=20) == "+1 more" and describe_counts({}) == ""


def test_heldout_topped_up_from_older_heldout_requests(dataset):
    data_dir, _, _ = dataset
    plan = plan_window(data_dir, WindowSpec(window_samples=6, heldout_fraction=0.1, min_heldout_samples=4,
                                            target_model="org/m"))
    assert plan.heldout_in_window == 2 and len(plan.heldout) == 4 and len(plan.recent) == 4
    assert all(heldout_score(r) < 0.1 for r in plan.heldout)  # the top-up holds out no training request
    older_held = [f"code-{i:06d}" for i in range(54) if heldout_score(f"code-{i:06d}") < 0.1]
    assert plan.heldout[:2] == older_held[-2:]  # the newest ones before the window
    none = plan_window(data_dir, WindowSpec(window_samples=6, heldout_fraction=0.0, target_model="org/m"))
    assert none.heldout == [] and len(none.recent) == 6  # nothing held out: the job has nothing to do


def _ids(prefix: str, n: int, held_at: set[int], fraction: float) -> list[str]:
    """``n`` request ids whose hash holds out exactly those at positions ``held_at``."""
    out, i = [], 0
    while len(out) < n:
        rid, i = f"{prefix}-{i:05d}", i + 1
        if (heldout_score(rid) < fraction) == (len(out) in held_at):
            out.append(rid)
    return out


def test_heldout_never_trained_across_retrains(tmp_path):
    """Three retrains on a growing dataset, each choosing its data as the job does (``plan_for``):
    no request is held out by one of them and trained on (window or replay) by any."""
    from tide.config import load_config
    from tide.train.online import plan_for

    data_dir = tmp_path / "dataset"
    cfg = load_config(env={}, overrides={"home": str(tmp_path / "home"), "model": {"model_id": "org/m"}, "train": {
        "data_dir": str(data_dir), "window_samples": 10, "window_s": 0, "heldout_fraction": 0.1,
        "min_heldout_samples": 2,
        # every older training request is replayed: one held out by an earlier retrain would be trained on
        "replay_ratio": 2.0}})
    # each window of 10 has one request held out by its id: fewer than min_heldout_samples
    batches = [_ids("b0", 16, {1, 4, 12}, 0.1), _ids("b1", 10, {4}, 0.1), _ids("b2", 10, {6}, 0.1)]
    trained, held, offset = set(), set(), 0
    for k, ids in enumerate(batches):
        log_samples(data_dir, make_samples(len(ids), 10 + k, length=12), [4] * len(ids), target_model_id="org/m",
                    aux_layer_ids=(1, 2, 3), start_s=T0 + 1000 * k, first_offset=offset, rows_per_file=8,
                    request_ids=ids)
        offset += 10 * len(ids)
        plan = plan_for(cfg)
        assert len(plan.heldout) >= 2 and len(plan.recent) >= 8  # each one trains and evaluates
        trained |= set(plan.train_ids)
        held |= set(plan.heldout)
    assert not trained & held, sorted(trained & held)


def test_load_window_joins_chunks_and_keeps_values(dataset):
    data_dir, _, new = dataset
    plan = plan_window(data_dir, WindowSpec(window_samples=60, replay_ratio=0.25, heldout_fraction=0.2,
                                            target_model="org/m"))
    data = load_window(data_dir, plan, train_on_prompt=False, max_seq_len=512)
    assert data.missing == 0 and len(data.train) == len(plan.train_ids) and len(data.heldout) == len(plan.heldout)
    by_id = dict(zip(plan.train_ids, data.train))
    rid = plan.recent[0]
    original = new[int(rid.split("-")[1])]
    got = by_id[rid]
    assert torch.equal(got.tokens, original.tokens)
    assert got.aux.dtype == torch.bfloat16 and torch.equal(got.aux, original.aux.to(torch.bfloat16))
    assert torch.equal(got.final, original.final.to(torch.bfloat16))
    assert got.loss_mask[:8].sum() == 0 and got.loss_mask[8:].min() == 1  # captured mask: generated only
    trained = load_window(data_dir, plan, train_on_prompt=True, max_seq_len=16)
    assert all(len(s) <= 16 and s.loss_mask.min() == 1 for s in trained.train)
    assert all(s.loss_mask[:8].sum() == 0 for s in trained.heldout)  # evaluation: generated positions only
    assert data.train_tokens == sum(len(s) for s in data.train)


def test_spilled_window_reads_back_the_same_states_and_batches(dataset, tmp_path):
    """Online retrains keep states in a file (tide/train/spill.py): the same bf16 values, the same
    collated batches, nothing held in the samples, and the file is gone once closed."""
    from tide.train.trainer import collate

    data_dir, _, _ = dataset
    plan = plan_window(data_dir, WindowSpec(window_samples=60, replay_ratio=0.25, heldout_fraction=0.2,
                                            target_model="org/m"))
    held = load_window(data_dir, plan, train_on_prompt=False, max_seq_len=24)
    spilled = load_window(data_dir, plan, train_on_prompt=False, max_seq_len=24, spill_dir=tmp_path)
    assert all(s.aux is None and s.final is None for s in spilled.train + spilled.heldout)
    assert spilled.store.nbytes == sum(len(s) * 4 * H * 2 for s in spilled.train + spilled.heldout)
    assert list(tmp_path.iterdir()) == []  # unlinked: a killed retrain leaves nothing behind
    for a, b in zip(held.train + held.heldout, spilled.train + spilled.heldout):
        aux, final = b.states()
        assert aux.dtype == torch.bfloat16 and torch.equal(aux, a.aux) and torch.equal(final, a.final)
        assert torch.equal(b.states(5)[0], a.aux[:5])
    for s in held.train + spilled.train:  # collate needs the trainer's per-position fields
        s.in_vocab = torch.ones(len(s), dtype=torch.bool)
        s.target_top = torch.zeros(len(s), dtype=torch.long)
    x, y = collate(held.train[:5], 16), collate(spilled.train[:5], 16)
    assert torch.equal(x.aux, y.aux) and torch.equal(x.final, y.final) and torch.equal(x.tokens, y.tokens)
    spilled.close()
    with pytest.raises(ValueError):
        spilled.train[0].states()


def test_heldout_requests_keep_their_workload_tags_through_loading(dataset):
    data_dir, _, _ = dataset
    plan = plan_window(data_dir, WindowSpec(heldout_fraction=0.2, heldout_max_samples=64,
                                            target_model="org/m"))
    tags = {r.split("-")[0] for r in plan.heldout}
    assert tags == {"chat", "code"}  # both workloads held out: the evaluation reports each
    assert plan.heldout_workloads == {r: r.split("-")[0] for r in plan.heldout}
    data = load_window(data_dir, plan, train_on_prompt=False, max_seq_len=64)
    try:
        assert len(data.heldout) == len(plan.heldout)
        assert data.heldout_workloads == [r.split("-")[0] for r in plan.heldout]  # aligned with the samples
    finally:
        data.close()
