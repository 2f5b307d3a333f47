"""Training data for an online retrain, chosen from the dataset table without loading it.

``plan_window`` decides which captured requests train and which evaluate, reading only small
columns (ids, times, token counts; never hidden states):
1. pin one table version (``WindowSpec.version``, else the newest): the retrain reads that
   version and nothing else, reports it (the scheduler's watermark: commits after it count as
   new) and registers it as lineage, so a re-run on it selects the same requests. List that
   version's files for the target model (from the log) and catalog every request whose chunks are
   all present (capture time, tokens, generated tokens, files holding it), less requests
   ``tide data delete`` tombstoned since (deletion wins over reproducibility);
2. the recent window = the requests captured since ``window_since_s`` (the scheduler's first
   retrain after a workload shift: the new traffic), else the newest ``window_samples`` requests,
   else those captured within ``window_s`` of the newest one, else everything;
3. held out = requests whose id hashes below ``heldout_fraction`` (``is_heldout``: a fixed
   partition of the whole dataset, so a held-out request is never trained on by any retrain);
   if the window has fewer than ``min_heldout_samples`` of them, the newest held-out requests
   before the window top it up (never a training request: that would leak between retrains);
   the newest ``heldout_max_samples`` of them are evaluated;
4. recent training requests = the rest of the window, newest first up to ``max_train_tokens``;
5. replay = ``replay_ratio`` x that many requests drawn from every not-held-out request older
   than the recent ones (before the window, or in it past the token cap) by a seeded hash, a few
   files at a time (``_replay_sample``: loading them reads a bounded number of files, not the whole
   past; deterministic for a given seed). With ``replay_by_workload`` the replay is shared evenly
   among the workload tags of those older requests (``replay_quotas``; a tag holding less than its
   share gives all it has and the rest goes to the others): after a shift, the old workload's short
   history is not outnumbered in the replay by the new traffic the token cap left out.
``load_window`` then streams only the files holding chosen requests through ``DatasetReader``
and keeps the chosen ones as trainer ``Sample``s in bfloat16 (what was stored); with a
``spill_dir`` (online retrains) their hidden states go to a local file instead of memory and are
read back per batch (``tide/train/spill.py``), so memory does not grow with the window. The same
plan can be written in SpecForge's offline format (``tide/train/specforge_export.py``).
"""
from __future__ import annotations

import hashlib
import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from tide.contracts import UNTAGGED_WORKLOAD
from tide.dataset.location import Location
from tide.dataset.reader import DatasetReader
from tide.dataset.reader import Sample as DatasetSample
from tide.dataset.table import DataFile, DatasetTable
from tide.dataset.tombstones import Tombstones
from tide.train.spill import StateFile
from tide.train.trainer import Sample

_CATALOG_COLUMNS = ["request_id", "target_model_id", "finished_at_s", "num_tokens", "chunk_index",
                    "chunk_count", "loss_mask", "workload"]


def unit_hash(key: str, salt: str) -> float:
    """A uniform number in [0, 1) fixed by (salt, key)."""
    digest = hashlib.sha256(f"{salt}\0{key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def heldout_score(request_id: str) -> float:
    """Requests scoring below ``heldout_fraction`` are held out everywhere, in every retrain."""
    return unit_hash(request_id, "tide-heldout")


def is_heldout(request_id: str, heldout_fraction: float) -> bool:
    """The one rule: a property of the request id alone, never of the window it falls in."""
    return heldout_score(request_id) < heldout_fraction


@dataclass(frozen=True)
class WindowSpec:
    """What to select; built from ``TrainConfig`` by ``WindowSpec.from_config``."""

    window_samples: int = 0
    window_s: float = 0.0
    window_since_s: float = 0.0
    replay_ratio: float = 0.25
    replay_by_workload: bool = False  # TrainConfig turns it on
    heldout_fraction: float = 0.1
    heldout_max_samples: int = 64
    min_heldout_samples: int = 2
    max_train_tokens: int = 0
    max_seq_len: int = 512
    seed: int = 0
    target_model: str | None = None
    until_s: float | None = None  # ignore requests captured at or after this
    version: int | None = None  # the table version to read; None = the newest

    @classmethod
    def from_config(cls, train_cfg, target_model: str | None = None,
                    until_s: float | None = None, version: int | None = None) -> "WindowSpec":
        return cls(window_samples=train_cfg.window_samples, window_s=train_cfg.window_s,
                   window_since_s=train_cfg.window_since_s,
                   replay_ratio=train_cfg.replay_ratio, replay_by_workload=train_cfg.replay_by_workload,
                   heldout_fraction=train_cfg.heldout_fraction,
                   heldout_max_samples=train_cfg.heldout_max_samples,
                   min_heldout_samples=train_cfg.min_heldout_samples,
                   max_train_tokens=train_cfg.max_train_tokens, max_seq_len=train_cfg.max_seq_len,
                   seed=train_cfg.seed, target_model=target_model, until_s=until_s,
                   version=version if version is not None else
                   (train_cfg.data_version if train_cfg.data_version >= 0 else None))


@dataclass
class RequestEntry:
    """One captured request as the catalog sees it (no hidden states)."""

    request_id: str
    finished_at_s: float
    tokens: int = 0
    generated: int = 0
    chunk_count: int = 1
    workload: str = UNTAGGED_WORKLOAD
    chunks: set[int] = field(default_factory=set)
    files: set[DataFile] = field(default_factory=set)


@dataclass
class WindowPlan:
    """Chosen request ids by role, and the facts lineage records about them."""

    recent: list[str]
    replay: list[str]
    heldout: list[str]
    window_start_s: float | None
    window_end_s: float | None
    catalog_requests: int
    window_requests: int
    heldout_in_window: int
    recent_tokens: int
    replay_tokens: int
    heldout_tokens: int
    heldout_generated: int
    files: dict[str, list[DataFile]] = field(default_factory=dict, repr=False)
    replay_workloads: str = ""  # "code:147,chat:43": replayed requests by workload tag (describe_counts)
    heldout_workloads: dict[str, str] = field(default_factory=dict, repr=False)  # held-out id -> workload tag
    data_version: int | None = None  # the table version read (None: no table yet)
    data_uri: str = ""
    # samples of the drafter's training workload added to the training set (tide/train/rehearsal.py);
    # set from the config after planning, so a re-run on the same table version adds the same
    rehearsal: int = 0

    @property
    def train_ids(self) -> list[str]:
        return self.recent + self.replay

    def summary(self) -> dict:
        """Flat facts for MLflow params and version tags."""
        return {
            "window_start_s": self.window_start_s, "window_end_s": self.window_end_s,
            "catalog_requests": self.catalog_requests, "window_requests": self.window_requests,
            "recent_requests": len(self.recent), "replay_requests": len(self.replay),
            "heldout_requests": len(self.heldout), "heldout_in_window": self.heldout_in_window,
            "replay_workloads": self.replay_workloads, "rehearsal_requests": self.rehearsal,
            "recent_tokens": self.recent_tokens, "replay_tokens": self.replay_tokens,
            "heldout_tokens": self.heldout_tokens, "heldout_generated_tokens": self.heldout_generated,
            "data_table_version": self.data_version, "data_table_uri": self.data_uri,
        }


def _list_sums(column) -> list[int]:
    """Per-row sums of a list<uint8> column without building Python lists."""
    arr = column.combine_chunks()
    if len(arr) == 0:
        return []
    offsets = arr.offsets.to_numpy().astype(np.int64)
    values = arr.values.to_numpy(zero_copy_only=False).astype(np.int64)
    cumulative = np.concatenate(([0], np.cumsum(values)))
    return (cumulative[offsets[1:]] - cumulative[offsets[:-1]]).tolist()


def catalog(table: DatasetTable, version: int | None, target_model: str | None = None,
            until_s: float | None = None) -> list[RequestEntry]:
    """Complete requests of a table version, oldest first (reads only small columns)."""
    entries: dict[str, RequestEntry] = {}
    if version is None:
        return []
    for data_file in table.data_files(version, until_s=until_s, target_model=target_model):
        try:
            data = table.open_file(data_file.path).read(columns=_CATALOG_COLUMNS)
        except FileNotFoundError:  # vacuumed after this version: its rows are gone
            continue
        columns = {name: data.column(name).to_pylist() for name in _CATALOG_COLUMNS if name != "loss_mask"}
        generated = _list_sums(data.column("loss_mask"))
        for i, rid in enumerate(columns["request_id"]):
            if target_model is not None and columns["target_model_id"][i] != target_model:
                continue
            t = columns["finished_at_s"][i]
            if until_s is not None and t >= until_s:
                continue
            entry = entries.setdefault(rid, RequestEntry(rid, t, chunk_count=columns["chunk_count"][i],
                                                         workload=columns["workload"][i] or UNTAGGED_WORKLOAD))
            chunk = columns["chunk_index"][i]
            entry.files.add(data_file)
            if chunk in entry.chunks:  # a duplicate delivery: count its tokens once
                continue
            entry.chunks.add(chunk)
            entry.finished_at_s = max(entry.finished_at_s, t)
            entry.tokens += columns["num_tokens"][i]
            entry.generated += generated[i]
    complete = [e for e in entries.values() if len(e.chunks) == e.chunk_count]
    return sorted(complete, key=lambda e: (e.finished_at_s, e.request_id))


def plan_window(data_dir: str | Path | Location, spec: WindowSpec) -> WindowPlan:
    """Choose recent, replay and held-out requests (steps in the module docstring)."""
    table = DatasetTable(data_dir if isinstance(data_dir, Location) else Location.from_uri(data_dir))
    version = spec.version if spec.version is not None else table.version()
    deleted = Tombstones(table.location).ids() if version is not None else set()
    entries = [e for e in catalog(table, version, spec.target_model, spec.until_s) if e.request_id not in deleted]
    if spec.window_since_s > 0:
        start = next((i for i, e in enumerate(entries) if e.finished_at_s >= spec.window_since_s), len(entries))
    elif spec.window_samples > 0:
        start = max(0, len(entries) - spec.window_samples)
    elif spec.window_s > 0 and entries:
        cutoff = entries[-1].finished_at_s - spec.window_s
        start = next((i for i, e in enumerate(entries) if e.finished_at_s >= cutoff), len(entries))
    else:
        start = 0
    older, window = entries[:start], entries[start:]
    held = {e.request_id for e in entries if is_heldout(e.request_id, spec.heldout_fraction)}
    held_entries = [e for e in window if e.request_id in held]
    in_window = len(held_entries)
    if in_window < spec.min_heldout_samples:
        # top up with the newest older held-out requests: still held out in every retrain
        older_held = [e for e in older if e.request_id in held]
        take = min(len(older_held), spec.min_heldout_samples - in_window)
        held_entries = older_held[len(older_held) - take:] + held_entries
    evaluated = held_entries[-spec.heldout_max_samples:] if spec.heldout_max_samples > 0 else []

    def cost(e: RequestEntry) -> int:
        return min(e.tokens, spec.max_seq_len)

    recent, recent_tokens, first_recent = [], 0, len(entries)
    for i in range(len(entries) - 1, start - 1, -1):
        e = entries[i]
        if e.request_id in held:
            continue
        if spec.max_train_tokens and recent and recent_tokens + cost(e) > spec.max_train_tokens:
            break
        recent.append(e)
        recent_tokens += cost(e)
        first_recent = i
    recent.reverse()
    # everything older than the recent requests may be replayed: a window the token cap cut keeps
    # its older part as replay instead of dropping it (a code-only recent set still sees the chat)
    pool = [e for e in entries[:first_recent] if e.request_id not in held]
    n_replay = min(len(pool), int(math.floor(spec.replay_ratio * len(recent) + 0.5)))
    replay = _replay_by_workload(pool, n_replay, spec.seed) if spec.replay_by_workload else \
        _replay_sample(pool, n_replay, spec.seed)
    chosen = {"recent": recent, "replay": replay, "heldout": evaluated}
    return WindowPlan(
        recent=[e.request_id for e in recent], replay=[e.request_id for e in replay],
        heldout=[e.request_id for e in evaluated],
        window_start_s=window[0].finished_at_s if window else None,
        window_end_s=window[-1].finished_at_s if window else None,
        catalog_requests=len(entries), window_requests=len(window), heldout_in_window=in_window,
        recent_tokens=recent_tokens, replay_tokens=sum(cost(e) for e in replay),
        heldout_tokens=sum(cost(e) for e in evaluated),
        heldout_generated=sum(e.generated for e in evaluated),
        replay_workloads=describe_counts(Counter(e.workload for e in replay)),
        heldout_workloads={e.request_id: e.workload for e in evaluated},
        files={role: sorted({f for e in group for f in e.files}, key=lambda f: f.path)
               for role, group in chosen.items()},
        data_version=version, data_uri=table.uri)


def replay_quotas(available: dict[str, int], n: int) -> dict[str, int]:
    """``n`` replayed requests shared evenly among workloads, none given more than it holds.

    Water-filling: the smallest workloads are served first; what one cannot fill goes to the rest.
    ``{"chat": 43, "code": 400}, 190 -> {"chat": 43, "code": 147}``.
    """
    quotas, left = {}, min(n, sum(available.values()))
    ordered = sorted(available, key=lambda w: (available[w], w))
    for i, workload in enumerate(ordered):
        share = -(-left // (len(ordered) - i))  # ceil: the remainder goes to the smaller workloads first
        quotas[workload] = min(available[workload], share)
        left -= quotas[workload]
    return quotas


def describe_counts(counts: dict[str, int], max_chars: int = 500) -> str:
    """``"code:142,chat:45"``, largest first, cut to ``max_chars`` with how many tags it left out
    (a lineage parameter: MLflow refuses long values, and a retrain must not fail on many tags)."""
    text, parts = "", sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    for i, (workload, n) in enumerate(parts):
        item = f"{',' if text else ''}{workload}:{n}"
        if len(text) + len(item) > max_chars - 16:
            return f"{text}{',' if text else ''}+{len(parts) - i} more"
        text += item
    return text


def _replay_by_workload(pool: list[RequestEntry], n: int, seed: int) -> list[RequestEntry]:
    """``n`` older requests, each workload tag's quota drawn from its own requests as ``_replay_sample``
    draws (so a load reads up to 4 files per tag with requests in the replay, not 4 in all)."""
    by_workload: dict[str, list[RequestEntry]] = {}
    for e in pool:
        by_workload.setdefault(e.workload, []).append(e)
    quotas = replay_quotas({w: len(es) for w, es in by_workload.items()}, n)
    chosen = [e for w, es in by_workload.items() for e in _replay_sample(es, quotas[w], seed)]
    return sorted(chosen, key=lambda e: (e.finished_at_s, e.request_id))


def _replay_sample(pool: list[RequestEntry], n: int, seed: int) -> list[RequestEntry]:
    """``n`` older requests by a seeded hash, drawn file by file (files in hash order, at most
    a quarter of ``n`` from each) so that loading them reads a few files, not all of the past."""
    salt = f"tide-replay-{seed}"
    by_file: dict[str, list[RequestEntry]] = {}
    for e in pool:
        by_file.setdefault(min(f.path for f in e.files), []).append(e)
    per_file = max(1, math.ceil(n / 4))
    chosen: list[RequestEntry] = []
    for name in sorted(by_file, key=lambda f: unit_hash(f, salt)):
        if len(chosen) >= n:
            break
        ranked = sorted(by_file[name], key=lambda e: unit_hash(e.request_id, salt))
        chosen += ranked[:min(per_file, n - len(chosen))]
    if len(chosen) < n:  # few files: fill from what is left, still in hash order
        taken = {e.request_id for e in chosen}
        rest = sorted((e for e in pool if e.request_id not in taken), key=lambda e: unit_hash(e.request_id, salt))
        chosen += rest[:n - len(chosen)]
    return sorted(chosen, key=lambda e: (e.finished_at_s, e.request_id))


def to_trainer_sample(sample: DatasetSample, all_positions: bool, max_seq_len: int,
                      store: StateFile | None = None) -> Sample:
    """A dataset sample as the trainer takes it: bfloat16 states (as stored), truncated; in
    ``store`` instead of memory when one is given.

    ``all_positions`` trains on prompt positions too (loss mask of ones); evaluation keeps the
    captured mask (generated positions only: where a drafter is actually used).
    """
    n = min(int(sample.token_ids.numel()), max_seq_len)
    mask = torch.ones(n) if all_positions else sample.loss_mask[:n].float()
    if store is not None:
        return Sample(tokens=sample.token_ids[:n].clone(), loss_mask=mask, aux=None, final=None,
                      spill=store.put(sample.aux_hidden[:n], sample.final_hidden[:n]))
    return Sample(tokens=sample.token_ids[:n].clone(), loss_mask=mask,
                  aux=sample.aux_hidden[:n].to(torch.bfloat16),
                  final=sample.final_hidden[:n].to(torch.bfloat16))


def stream_requests(data_dir: str | Path | Location, plan: WindowPlan, ids: set[str]):
    """Yield the dataset samples of ``ids``, reading only the files (of the plan's version) that hold them."""
    files = sorted({f for group in plan.files.values() for f in group}, key=lambda f: f.path)
    location = data_dir if isinstance(data_dir, Location) else Location.from_uri(data_dir)
    reader = DatasetReader(location, version=plan.data_version)
    for sample in reader.samples(files=files):
        if sample.request_id in ids:
            yield sample


@dataclass
class WindowData:
    train: list[Sample]
    heldout: list[Sample]
    train_tokens: int
    heldout_tokens: int
    missing: int  # planned requests that could not be read (e.g. deleted by retention meanwhile)
    store: StateFile | None = None  # where the samples' states are, when spilled
    heldout_workloads: list[str] = field(default_factory=list)  # each held-out sample's workload tag

    def close(self) -> None:
        if self.store is not None:
            self.store.close()


def load_window(data_dir: str | Path | Location, plan: WindowPlan, train_on_prompt: bool, max_seq_len: int,
                spill_dir: str | Path | None = None) -> WindowData:
    """Materialise the plan's samples (train = recent + replay, in plan order; held-out); their
    states in a file under ``spill_dir`` when given, else in memory."""
    train_ids, held_ids = set(plan.train_ids), set(plan.heldout)
    store = StateFile(spill_dir) if spill_dir is not None else None
    found: dict[str, Sample] = {}
    for sample in stream_requests(data_dir, plan, train_ids | held_ids):
        if sample.request_id in found:
            continue
        held = sample.request_id in held_ids
        found[sample.request_id] = to_trainer_sample(sample, train_on_prompt and not held, max_seq_len, store)
    train = [found[r] for r in plan.train_ids if r in found]
    read = [r for r in plan.heldout if r in found]
    heldout = [found[r] for r in read]
    return WindowData(train=train, heldout=heldout, train_tokens=sum(len(s) for s in train),
                      heldout_tokens=sum(len(s) for s in heldout),
                      missing=len(train_ids | held_ids) - len(found), store=store,
                      heldout_workloads=[plan.heldout_workloads.get(r, UNTAGGED_WORKLOAD) for r in read])
