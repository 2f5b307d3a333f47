"""Workload shifts the scheduler can see: two signals, read every tick.

1. **Workload mix** (the dataset table, ``WorkloadMix``): tokens by ``workload`` tag of the newest
   captured rows. The log says which files are newest; each file's three small columns (capture
   time, workload, tokens) are read once and cached while they stay among the newest. The newest
   ``shift_recent_tokens`` tokens are compared with three references of up to
   ``shift_reference_tokens`` (each holding at least as many as the recent ones): the rows just
   before them, the newest rows the last look had already read (a commit may hold more new rows
   than both mixes) and the oldest rows read (a first look reads back further: a fast stack's first
   commit can hold the warm-up and more new traffic than both mixes). A total-variation distance of
   ``shift_mix_distance`` or more from any of them is a shift, naming the workloads that grew and
   where their traffic began (the change point). Requests without a tag count as ``untagged``.
2. **Acceptance drop** (the engines' ``/metrics``, ``schedule.shift_metrics_urls``,
   ``AcceptanceWatch``): the serving drafter's tokens per target forward (verified rows) over the
   last ``shift_accept_window_s`` against its own reading before that; a fall by
   ``shift_accept_drop`` or more, each reading over ``shift_accept_min_forwards`` rows or more, is a
   shift. A swap (or an engine restart) starts a new reading, so a new drafter is never judged
   against the old one.
After a detection each signal looks only at what came after it (the mix at rows captured since the
new traffic began, the acceptance at readings taken since the detection): one shift is detected
once. What a detection changes is the policy's (``tide/schedule/policy.py``).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable

from tide import metrics
from tide.contracts import UNTAGGED_WORKLOAD
from tide.traffic import scrape

log = logging.getLogger(__name__)

MIX, ACCEPT = "workload_mix", "acceptance_drop"
SIGNALS = (MIX, ACCEPT)
_ROW_COLUMNS = ["finished_at_s", "workload", "num_tokens"]
_ACCEPT = metrics.ENGINE_ACCEPT_LENGTH.describe()[0].name
_INFO = metrics.ENGINE_DRAFTER_INFO.describe()[0].name
_KEEP_READINGS = 2000  # acceptance readings kept per drafter reading (bounded memory)
_FIRST_LOOK_MIXES = 20  # a first look reads back up to this many times both mixes' tokens (bounded)
Row = tuple[float, str, int, str]  # a captured row: capture time, workload, tokens, its file and index


@dataclass(frozen=True)
class Detection:
    signal: str  # one of SIGNALS
    detail: str  # what changed, in words
    workloads: tuple[str, ...] = ()  # the workloads that grew (mix)
    since_s: float | None = None  # unix time where the new traffic (or the low reading) starts


def mix_of(rows: list[Row]) -> dict[str, float]:
    """Share of tokens by workload."""
    tokens: dict[str, int] = {}
    for _, workload, n, _ in rows:
        tokens[workload] = tokens.get(workload, 0) + n
    total = max(1, sum(tokens.values()))
    return {w: n / total for w, n in tokens.items()}


def distance(a: dict[str, float], b: dict[str, float]) -> float:
    """Total-variation distance of two mixes: 0 the same, 1 nothing in common."""
    return 0.5 * sum(abs(a.get(w, 0.0) - b.get(w, 0.0)) for w in set(a) | set(b))


def split_newest(rows: list[Row], recent_tokens: int,
                 reference_tokens: int) -> tuple[list, list]:
    """(the newest rows holding ``recent_tokens``, up to ``reference_tokens`` of rows before them);
    ``rows`` newest first."""
    recent, reference, seen = [], [], 0
    for row in rows:
        if seen < recent_tokens:
            recent.append(row)
        elif seen < recent_tokens + reference_tokens:
            reference.append(row)
        else:
            break
        seen += row[2]
    return recent, reference


def oldest(rows: list[Row], tokens: int) -> list[Row]:
    """The oldest rows of ``rows`` (newest first) holding ``tokens`` (all of them when they hold fewer)."""
    out, seen = [], 0
    for row in reversed(rows):
        if seen >= tokens:
            break
        out.append(row)
        seen += row[2]
    return out[::-1]


def tokens_of(rows: list[Row]) -> int:
    return sum(r[2] for r in rows)


def change_point(rows: list[Row], grown: set[str]) -> float:
    """Capture time where the grown workloads' traffic began (``rows`` newest first): where the
    cumulative excess of their tokens over their average share peaks (CUSUM)."""
    total = sum(r[2] for r in rows)
    share = sum(r[2] for r in rows if r[1] in grown) / max(1, total)
    best, best_at, excess = 0.0, rows[0][0], 0.0
    for t, workload, tokens, _ in rows:
        excess += (tokens if workload in grown else 0) - share * tokens
        if excess > best:
            best, best_at = excess, t
    return best_at


class WorkloadMix:
    """Signal 1 over a ``DatasetTable`` (only ``version``, ``data_files`` and ``open_file`` are used)."""

    def __init__(self, table: Any, recent_tokens: int, reference_tokens: int, min_distance: float) -> None:
        self.table = table
        self.recent_tokens, self.reference_tokens = recent_tokens, reference_tokens
        self.min_distance = min_distance
        self.shares: dict[str, float] = {}  # the newest rows' mix, as last read
        self._rows: dict[str, list[Row]] = {}  # file path -> its rows
        self._read_at: tuple | None = None  # (table version, after_s, anchor) of the last read
        self._newest: list[Row] = []
        self._anchor_s: float | None = None  # capture time of the newest row the last look read
        self.need_tokens = recent_tokens + reference_tokens  # a look reads this much before its last one

    def check(self, after_s: float | None) -> Detection | None:
        rows = self._newest_rows(after_s)  # newest first
        anchor = self._anchor_s
        self._anchor_s = rows[0][0] if rows else anchor
        recent, reference = split_newest(rows, self.recent_tokens, self.reference_tokens)
        self.shares = mix_of(recent)
        if tokens_of(recent) < self.recent_tokens:
            return None  # too little to compare yet
        older = rows[len(recent):]
        known = [r for r in older if anchor is not None and r[0] <= anchor]  # read by the last look too
        enough = min(self.recent_tokens, self.reference_tokens)  # a reference's fewest tokens
        references = (reference, split_newest(known, self.reference_tokens, 0)[0], oldest(older, enough))
        found = max(((distance(self.shares, mix_of(ref)), ref) for ref in references if tokens_of(ref) >= enough),
                    key=lambda x: x[0], default=None)
        if found is None or found[0] < self.min_distance:
            return None
        gap, reference = found
        new, old = self.shares, mix_of(reference)
        grown = sorted((w for w in new if new[w] > old.get(w, 0.0)), key=lambda w: old.get(w, 0.0) - new[w])
        changes = ", ".join(f"{w} {100 * old.get(w, 0.0):.0f}% -> {100 * new[w]:.0f}%" for w in grown)
        detail = (f"{changes} of the newest {tokens_of(recent)} captured tokens "
                  f"(mix distance {gap:.2f} from the {tokens_of(reference)} before)")
        return Detection(MIX, detail, tuple(grown), change_point(rows, set(grown)))

    def _newest_rows(self, after_s: float | None) -> list[Row]:
        """Rows captured at or after ``after_s``, newest first: all since the last look's newest row
        and both mixes' tokens before it (a first look: up to ``_FIRST_LOOK_MIXES`` times that). Files
        are read newest first; a commit's files overlap in time (one per partition), so reading
        stops only where no file left can hold a row the look needs. Only the files read stay cached."""
        version = self.table.version()
        if version is None:
            return []
        if (version, after_s, self._anchor_s) == self._read_at:  # nothing committed since: the same rows
            return self._newest
        rows: list[Row] = []
        kept: dict[str, list[Row]] = {}
        for f in reversed(self.table.data_files(version)):  # sorted by newest capture
            if (after_s is not None and f.max_time_s < after_s) or self._read_enough(rows, f.max_time_s):
                break
            own = self._rows[f.path] if f.path in self._rows else self._read(f.path)
            kept[f.path] = own
            rows += [r for r in own if after_s is None or r[0] >= after_s]
        self._rows, self._read_at = kept, (version, after_s, self._anchor_s)
        self._newest = self._needed(sorted(rows, key=lambda r: r[0], reverse=True))
        return self._newest

    def _needed(self, rows: list[Row]) -> list[Row]:
        """Of ``rows`` (newest first), what the look needs: a whole file may reach far back (a
        compacted one spans hours), and the oldest rows kept are a reference."""
        kept, total, before = [], 0, 0
        for row in rows:
            if total >= _FIRST_LOOK_MIXES * self.need_tokens or before >= self.need_tokens:
                break
            kept.append(row)
            total += row[2]
            before += row[2] if self._anchor_s is not None and row[0] <= self._anchor_s else 0
        return kept

    def _read_enough(self, rows: list[Row], next_newest_s: float) -> bool:
        """Whether ``rows`` hold what the look needs, the files left holding no row newer than
        ``next_newest_s``."""
        settled = [r for r in rows if r[0] > next_newest_s]
        if tokens_of(settled) >= _FIRST_LOOK_MIXES * self.need_tokens:
            return True
        if self._anchor_s is None:
            return False  # a first look reads back as far as it may: its oldest rows are a reference
        return tokens_of([r for r in settled if r[0] <= self._anchor_s]) >= self.need_tokens

    def _read(self, path: str) -> list[Row]:
        try:
            data = self.table.open_file(path).read(columns=_ROW_COLUMNS)
        except FileNotFoundError:  # vacuumed since the log listed it
            return []
        cols = [data.column(c).to_pylist() for c in _ROW_COLUMNS]
        return [(float(t), w or UNTAGGED_WORKLOAD, int(n), f"{path}#{i}") for i, (t, w, n) in enumerate(zip(*cols))]


@dataclass(frozen=True)
class _Reading:
    t_s: float
    version: str
    sum: float  # tokens committed on verified rows, all engines
    count: float  # verified rows (target forwards), all engines


class AcceptanceWatch:
    """Signal 2 over the engines' ``/metrics`` pages."""

    def __init__(self, urls: tuple[str, ...], window_s: float, drop: float, min_forwards: int,
                 read: Callable[[str], dict] = scrape) -> None:
        self.urls, self.window_s, self.drop, self.min_forwards = tuple(urls), window_s, drop, min_forwards
        self._read = read
        self.readings: list[_Reading] = []  # of the serving drafter since its reading began

    def observe(self, now_s: float) -> None:
        pages = [self._read(url) for url in self.urls]
        served = [s.labels.get("drafter_version") for p in pages for s in p.get(_INFO, []) if s.value == 1]
        if not served:
            return  # no engine answered: nothing read this tick
        version = max(set(served), key=served.count)  # during a rollout: what most engines serve
        total = {"sum": 0.0, "count": 0.0}
        for page in pages:
            for s in page.get(_ACCEPT, []):
                kind = s.name.rsplit("_", 1)[-1]
                if kind in total and s.labels.get("drafter_version") == version:
                    total[kind] += s.value
        reading = _Reading(now_s, version, total["sum"], total["count"])
        last = self.readings[-1] if self.readings else None
        if last is not None and (last.version != version or reading.count < last.count):
            self.readings = []  # a swap, or an engine restarted: a new reading begins
        self.readings = [*self.readings, reading][-_KEEP_READINGS:]

    def check(self, now_s: float, after_s: float | None) -> Detection | None:
        points = [r for r in self.readings if after_s is None or r.t_s >= after_s]
        cut = next((r for r in reversed(points) if r.t_s <= now_s - self.window_s), None)
        if cut is None or cut is points[0]:
            return None
        first, last = points[0], points[-1]
        before_n, recent_n = cut.count - first.count, last.count - cut.count
        if before_n < self.min_forwards or recent_n < self.min_forwards:
            return None
        before, recent = (cut.sum - first.sum) / before_n, (last.sum - cut.sum) / recent_n
        if recent > before * (1.0 - self.drop):
            return None
        return Detection(ACCEPT, f"drafter {last.version}: {before:.2f} -> {recent:.2f} tokens per forward over "
                                 f"the last {now_s - cut.t_s:.0f} s ({100 * (recent / before - 1):+.0f}%)",
                         since_s=cut.t_s)


class ShiftWatch:
    """Both signals, as configured (``cfg`` is the ScheduleConfig); ``check`` returns the first that fires."""

    def __init__(self, cfg: Any, table: Any, read: Callable[[str], dict] = scrape) -> None:
        self.mix = WorkloadMix(table, cfg.shift_recent_tokens, cfg.shift_reference_tokens, cfg.shift_mix_distance)
        self.accept = (AcceptanceWatch(cfg.shift_metrics_urls, cfg.shift_accept_window_s, cfg.shift_accept_drop,
                                       cfg.shift_accept_min_forwards, read) if cfg.shift_metrics_urls else None)

    def check(self, now_s: float, last: Any) -> Detection | None:
        """``last``: the previous detection's ShiftRecord (None: none yet). A signal whose source fails
        is skipped this tick: detection must never stop retrains."""
        found = None
        try:
            found = self.mix.check(None if last is None else last.since_s)
        except Exception as exc:  # noqa: BLE001 - e.g. a file the store would not open
            log.warning("workload mix not read this tick (%s)", exc)
        if self.accept is not None:
            self.accept.observe(now_s)
            found = found or self.accept.check(now_s, None if last is None else last.detected_at_s)
        return found


def retrain_state(state: Any) -> str:
    """Where the last shift's retrain stands: pending | running | its outcome."""
    shift = state.shift
    if shift.pending:
        return "pending"
    if state.running is not None and state.running.job_id == shift.job_id:
        return "running"
    return shift.status or "running"


def shift_view(state: Any, now_s: float) -> dict | None:
    """The last detected shift for ``/health`` and the page: which signal, when, the time since,
    what changed, and the retrain it triggered."""
    shift = state.shift
    if shift is None:
        return None
    return {"signal": shift.signal, "detected_at_s": round(shift.detected_at_s, 3),
            "since_detected_s": round(now_s - shift.detected_at_s, 1), "detail": shift.detail,
            "workloads": list(shift.workloads), "retrain_job": shift.job_id, "retrain_state": retrain_state(state),
            "retrain_version": shift.version,
            "launched_after_s": None if shift.launched_at_s is None else round(shift.launched_at_s - shift.detected_at_s, 1),
            "shifts_detected": len(state.shifts)}


def publish_shift(state: Any, shares: dict[str, float]) -> None:
    """The last shift and the newest workload mix as the scheduler's metrics."""
    metrics.SCHED_SHIFT_INFO.clear()
    shift = state.shift
    if shift is not None:
        metrics.SCHED_SHIFT_INFO.labels(shift.signal, ",".join(shift.workloads), shift.job_id or "",
                                        retrain_state(state)).set(1)
        metrics.SCHED_LAST_SHIFT.set(shift.detected_at_s)
    metrics.SCHED_WORKLOAD_SHARE.clear()
    for workload, share in shares.items():
        metrics.SCHED_WORKLOAD_SHARE.labels(workload).set(round(share, 4))
