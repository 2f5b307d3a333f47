"""What the page shows, gathered server-side: one ``Panel`` per source, never an exception.

Sources: the stack's Prometheus (the recording rules of ``dashboards/prometheus-rules.yml``
and the expressions of ``tide.json``, so the page and the Grafana dashboard agree), the scheduler's
``/health`` and state file (retrain state and history; the workload shift it detected, which
signal, when, and the retrain it triggered: also marked on the chart), the MLflow registry (versions, aliases),
the alias owner's fleet view (every engine replica x the drafter version it serves, tide/ops/fleet.py),
and the marks file under ``<home>/run`` where the demo notes the workload shift (Prometheus has
no series for "the traffic changed"; swaps it does have: ``tide_engine_drafter_info``).
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import httpx

from tide import prometheus

# the Grafana dashboard's expressions (tide.json), read here from the same rules
SERVING_EXPR = "max by (drafter_version) (tide_engine_drafter_info) == 1"
SAMPLES_EXPR = "max(tide_scheduler_new_samples)"
THRESHOLD_EXPR = "max(tide_scheduler_new_samples_threshold)"
PRODUCED_EXPR = "sum(tide_capture_produced_records_total)"
DROPPED_RATE_EXPR = "sum(tide:capture_dropped_records_per_second:5m)"
LAG_EXPR = "sum(tide_ingest_commit_lag_messages)"
FRESHNESS_EXPR = "time() - max(tide_ingest_last_commit_timestamp_seconds)"


@dataclass
class Panel:
    name: str
    title: str
    has_data: bool = False
    reason: str = ""  # why there is nothing to show (a source down, no samples yet)
    rows: list[tuple[str, str]] = field(default_factory=list)  # (label, value) lines
    table: list[dict[str, Any]] = field(default_factory=list)
    series: dict[str, list[tuple[float, float]]] = field(default_factory=dict)  # version -> points
    marks: list[tuple[float, str, str]] = field(default_factory=list)  # (unix_s, kind, label)


@dataclass
class Sources:
    prometheus_url: str = ""  # empty: the stack runs without Prometheus
    scheduler_url: str = ""
    home: Path | None = None
    registry: Callable[[], Any] | None = None  # builds a tide.registry.Registry on demand
    state_path: Path | None = None
    fleet: Callable[[], dict] | None = None  # the alias owner's fleet view (tide/ops/alias_api.py)


def marks_path(home: Path) -> Path:
    return home / "run" / "marks.jsonl"


def write_mark(home: Path, kind: str, label: str, t_s: float | None = None) -> None:
    """Append one event (``kind`` "shift", ...) for the page's chart."""
    path = marks_path(home)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps({"t_s": t_s or time.time(), "kind": kind, "label": label}) + "\n")


def read_marks(home: Path | None) -> list[tuple[float, str, str]]:
    if home is None:
        return []
    try:
        lines = marks_path(home).read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            m = json.loads(line)
            out.append((float(m["t_s"]), str(m["kind"]), str(m["label"])))
        except (ValueError, KeyError, TypeError):
            continue  # a torn last line while the demo writes: skip it
    return out


def _guarded(name: str, title: str, fill: Callable[[Panel], None]) -> Panel:
    """Run ``fill``; a source that is down becomes the panel's reason, never a page error."""
    panel = Panel(name, title)
    try:
        fill(panel)
    except Exception as exc:  # noqa: BLE001 - the page must render whatever one source does
        panel.has_data, panel.reason = False, f"{type(exc).__name__}: {exc}"
    return panel


def _need_prometheus(src: Sources) -> str:
    if not src.prometheus_url:
        raise RuntimeError("no Prometheus in this stack (install the Debian package: scripts/install.sh)")
    return src.prometheus_url


def _scalar(base: str, promql: str) -> float | None:
    result = prometheus.query(base, promql)
    return result[0][1] if result and result[0][1] == result[0][1] else None


def acceptance(src: Sources, window_s: float, now_s: float) -> Panel:
    def fill(p: Panel) -> None:
        base = _need_prometheus(src)
        step_s = max(2.0, window_s / 360)  # 5 s steps over 30 min
        # on a grid of whole steps (as Grafana does): one refresh draws what the last one did
        start_s = (now_s - window_s) // step_s * step_s
        end_s = now_s // step_s * step_s
        for labels, points in prometheus.query_range(base, prometheus.ACCEPT_SERIES, start_s, end_s, step_s):
            if points:
                p.series[labels.get("drafter_version", "?")] = points
        p.marks = _swaps(base, start_s, end_s, step_s) + [m for m in read_marks(src.home) + _detections(src)
                                                           if m[0] >= start_s]
        p.has_data = bool(p.series)
        p.reason = "" if p.has_data else f"no samples of {prometheus.ACCEPT_SERIES} yet (no traffic?)"
    return _guarded("acceptance", "Acceptance length by drafter version (tokens per target forward)", fill)


def _swaps(base: str, start_s: float, end_s: float, step_s: float) -> list[tuple[float, str, str]]:
    """The first point at which each drafter version serves, after the first version seen."""
    firsts = sorted((points[0][0], labels.get("drafter_version", "?"))
                    for labels, points in prometheus.query_range(base, SERVING_EXPR, start_s, end_s, step_s)
                    if points)
    return [(t, "swap", f"swap to v{v}") for t, v in firsts[1:]]


def _detections(src: Sources) -> list[tuple[float, str, str]]:
    """The scheduler's detected shifts as chart marks (its state file)."""
    from tide.schedule.state import StateStore

    if src.state_path is None:
        return []
    return [(s.detected_at_s, "detected", f"shift detected ({s.signal})")
            for s in StateStore(src.state_path).load().shifts]


def shift(src: Sources) -> Panel:
    """The last workload shift the scheduler detected: the signal, when, the time since, what
    changed, and the retrain it triggered (the scheduler's /health)."""
    def fill(p: Panel) -> None:
        if not src.scheduler_url:
            raise RuntimeError("no scheduler address given")
        view = httpx.get(f"{src.scheduler_url}/health", timeout=3.0).json().get("shift")
        p.has_data = True
        if view is None:
            p.rows = [("detected", "no shift detected yet")]
            return
        launched = view.get("launched_after_s")
        p.rows = [("detected", f"{time.strftime('%H:%M:%S', time.localtime(view['detected_at_s']))} "
                               f"by {view['signal'].replace('_', ' ')}"),
                  ("time since", f"{view['since_detected_s']:.0f} s"), ("what changed", view["detail"]),
                  ("retrain it triggered", view.get("retrain_job") or "not launched yet"),
                  ("launched", "-" if launched is None else f"{launched:.0f} s after the detection"),
                  ("retrain state", view["retrain_state"]),
                  ("version it registered", view.get("retrain_version") or "-")]
    return _guarded("shift", "Workload shift: detected, and the retrain it triggered", fill)


def samples(src: Sources) -> Panel:
    def fill(p: Panel) -> None:
        base = _need_prometheus(src)
        new, threshold = _scalar(base, SAMPLES_EXPR), _scalar(base, THRESHOLD_EXPR)
        p.has_data = new is not None and threshold is not None
        if p.has_data:
            p.rows = [("new samples", f"{new:,.0f}"), ("retrain threshold", f"{threshold:,.0f}"),
                      ("progress", f"{100 * new / max(threshold, 1):.0f}%")]
        else:
            p.reason = "the scheduler's metrics are not in Prometheus yet"
    return _guarded("samples", "New samples against the retrain threshold", fill)


def retrain(src: Sources) -> Panel:
    def fill(p: Panel) -> None:
        if not src.scheduler_url:
            raise RuntimeError("no scheduler address given")
        health = httpx.get(f"{src.scheduler_url}/health", timeout=3.0).json()
        p.rows = [(k, str(health.get(k))) for k in
                  ("status", "decision", "running", "launched_total", "consecutive_failures", "last_success_job")]
        if src.state_path is not None:
            p.table = _history(src.state_path)
        p.has_data = True
    return _guarded("retrain", "Retrain state and history", fill)


def _history(state_path: Path) -> list[dict[str, Any]]:
    from tide.schedule.state import StateStore

    jobs = StateStore(state_path).load().history
    return [{"job": j.job_id, "status": j.status, "version": j.version or "-",
             "finished": time.strftime("%H:%M:%S", time.localtime(j.finished_at_s)),
             "wall_s": round(j.finished_at_s - j.started_at_s), "reason": j.reason[:80]}
            for j in reversed(jobs)]


def registry(src: Sources) -> Panel:
    def fill(p: Panel) -> None:
        if src.registry is None:
            raise RuntimeError("no registry configured")
        p.table = [{"version": v.version, "aliases": ", ".join(v.aliases) or "-", "kind": v.kind,
                    "parent": v.parent_version or "-",
                    "sim accept": "-" if v.sim_accept_length is None else f"{v.sim_accept_length:.3f}"}
                   for v in src.registry().list_versions(with_run=True)]
        p.has_data = bool(p.table)
        p.reason = "" if p.has_data else "no drafter registered yet"
    return _guarded("registry", "Registry versions and aliases", fill)


def fleet(src: Sources) -> Panel:
    def fill(p: Panel) -> None:
        from tide.ops.fleet import fleet_rows

        if src.fleet is None:
            raise RuntimeError("no alias owner configured (ops.alias_owner_url): replicas report there")
        view = src.fleet()
        champion = "-" if view["champion"] is None else str(view["champion"])
        p.rows = [("champion", champion), ("replicas", str(len(view["replicas"]))),
                  ("all converged", "yes" if view["converged"] else "no")]
        p.table = fleet_rows(view)
        p.has_data = bool(p.table)
        p.reason = "" if p.has_data else "no engine replica has reported yet"
    return _guarded("fleet", "Engine replicas: the drafter version each serves (rollout)", fill)


def capture(src: Sources) -> Panel:
    def fill(p: Panel) -> None:
        base = _need_prometheus(src)
        produced = _scalar(base, PRODUCED_EXPR)
        # no dropped-records series until a record is dropped: that absence is "none dropped"
        dropped = _scalar(base, DROPPED_RATE_EXPR) or 0.0
        p.has_data = produced is not None
        if p.has_data:
            p.rows = [("records produced", f"{produced:,.0f}"), ("dropped records/s (5m)", f"{dropped:.3f}")]
        else:
            p.reason = "the engine's capture metrics are not in Prometheus yet"
    return _guarded("capture", "Capture (engine -> Kafka): drops", fill)


def ingest(src: Sources) -> Panel:
    def fill(p: Panel) -> None:
        base = _need_prometheus(src)
        lag, age_s = _scalar(base, LAG_EXPR), _scalar(base, FRESHNESS_EXPR)
        p.has_data = lag is not None
        if p.has_data:
            p.rows = [("commit lag (messages)", f"{lag:,.0f}"),
                      ("since last commit", "never" if age_s is None or age_s > 1e9 else f"{age_s:.0f} s")]
        else:
            p.reason = "ingest's metrics are not in Prometheus yet"
    return _guarded("ingest", "Ingest (Kafka -> Parquet): lag", fill)


def gather(src: Sources, window_s: float) -> list[Panel]:
    now_s = time.time()
    return [acceptance(src, window_s, now_s), shift(src), samples(src), retrain(src), registry(src), fleet(src),
            capture(src), ingest(src)]
