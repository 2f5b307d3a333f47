"""Drafter versions as records and tables: what ``tide drafters`` and GET /control/drafters show.

A version's record joins what the registry knows (aliases, lineage, data window, simulated
acceptance on its retrain's held-out slice, rollback marks) with what an engine measured live
(mean tokens committed per target forward, by drafter version label) and whether that engine
serves it. Live numbers come from the engine's own counters in-process, or from its ``/metrics``
page over HTTP for the CLI; the served version from the engine itself (its ``/health`` for the
CLI), never from the alias it was asked to follow.
"""
from __future__ import annotations

import time
from typing import Mapping

import httpx

from tide.contracts import (
    TAG_PARENT_SIM_ACCEPT,
    TAG_ROLLED_BACK,
    TAG_WINDOW_END,
    TAG_WINDOW_START,
    VersionAcceptance,
)
from tide.metrics import ENGINE_ACCEPT_LENGTH
from tide.metrics_text import by_label, parse
from tide.registry import VersionInfo

ACCEPT_METRIC = ENGINE_ACCEPT_LENGTH.describe()[0].name  # histogram of tokens per forward, by version


def _float(value: object) -> float | None:
    try:
        return float(value) if value not in (None, "") else None
    except (TypeError, ValueError):
        return None


def _utc(ts: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.gmtime(ts)) if ts else "-"


def version_record(info: VersionInfo, live: Mapping[str, float] | None = None, serving: str | None = None) -> dict:
    """One version as a JSON-ready dict; ``serving``: the version an engine serves (None: no engine asked)."""
    start, end = _float(info.tags.get(TAG_WINDOW_START)), _float(info.tags.get(TAG_WINDOW_END))
    return {"version": info.version, "aliases": list(info.aliases), "kind": info.kind,
            "parent": info.parent_version or None, "created_at_s": info.created_at_s,
            "data_window_s": [start, end] if start is not None or end is not None else None,
            "sim_accept_length": info.sim_accept_length,
            "parent_sim_accept_length": _float(info.tags.get(TAG_PARENT_SIM_ACCEPT)),
            "live_accept_length": (live or {}).get(str(info.version)),
            "rolled_back": info.tags.get(TAG_ROLLED_BACK) or None,
            "served_by_engine": None if serving is None else serving == str(info.version),
            "run_id": info.run_id, "checksum": info.checksum, "description": info.description}


def live_acceptance_from_stats(acceptance: Mapping[str, VersionAcceptance]) -> dict[str, float]:
    """EngineStats.acceptance -> tokens per forward, by version (versions with no forward left out)."""
    return {v: c.tokens_per_forward for v, c in acceptance.items() if c.forwards}


def live_acceptance_from_metrics(text: str) -> dict[str, float]:
    """The engine's /metrics page -> tokens per forward by drafter version (histogram sum/count);
    MetricsTextError (a ValueError) when the page is not Prometheus text."""
    families = parse(text)
    sums = by_label(families, f"{ACCEPT_METRIC}_sum", "drafter_version")
    counts = by_label(families, f"{ACCEPT_METRIC}_count", "drafter_version")
    return {v: sums[v] / counts[v] for v in sums if counts.get(v)}


def _num(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def versions_table(records: list[dict]) -> str:
    """Plain-text table of ``version_record`` dicts, newest first."""
    header = ("version", "aliases", "kind", "parent", "data window (UTC)", "sim accept", "parent sim",
              "live accept", "notes")
    rows = [header]
    for r in records:
        window = r["data_window_s"]
        rows.append((str(r["version"]), ",".join(r["aliases"]) or "-", r["kind"] or "-", r["parent"] or "-",
                     f"{_utc(window[0])} .. {_utc(window[1])}" if window else "-",
                     _num(r["sim_accept_length"]), _num(r["parent_sim_accept_length"]),
                     _num(r["live_accept_length"]), _notes(r)))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows)


def _notes(record: dict) -> str:
    notes = ("served by engine" if record.get("served_by_engine") else "",
             "rolled back" if record["rolled_back"] else "")
    return ", ".join(n for n in notes if n)


def show_text(info: VersionInfo, live: Mapping[str, float] | None, operations: list[dict],
              serving: str | None = None) -> str:
    """Everything about one version: record, tags, run metrics and params, its operations."""
    rec = version_record(info, live, serving)
    lines = [f"version {info.version} of {info.name}"]
    lines += [f"  {k}: {v}" for k, v in rec.items() if k != "version" and v not in (None, "", [])]
    lines.append(f"  source: {info.source}")
    for title, items in (("tags", info.tags), ("run metrics", info.metrics), ("run params", info.params)):
        if items:
            lines.append(f"{title}:")
            lines += [f"  {k} = {items[k]}" for k in sorted(items)]
    mine = [op for op in operations if info.version in (op.get("from"), op.get("to"))]
    if mine:
        lines.append("operations:")
        lines += [operation_line(op) for op in mine]
    return "\n".join(lines)


def operation_line(op: dict) -> str:
    seq = f"g{op['seq']:<4} " if op.get("seq") is not None else ""  # the alias generation it made
    return (f"  {seq}{_utc(op.get('at_s'))}  {op.get('op'):<8} {op.get('from')} -> {op.get('to')}  "
            f"by {op.get('actor')}" + (f"  ({op['reason']})" if op.get("reason") else ""))


def diff_rows(a: VersionInfo, b: VersionInfo) -> list[tuple[str, str, str, str]]:
    """(name, a, b, b - a) for the recorded numbers of two versions: sim acceptance tags first,
    then every run metric either has (latest value)."""
    def numbers(info: VersionInfo) -> dict[str, float]:
        out = {"sim_accept_length": info.sim_accept_length,
               "parent_sim_accept_length": _float(info.tags.get(TAG_PARENT_SIM_ACCEPT))}
        out.update({f"run.{k}": v for k, v in info.metrics.items()})
        return {k: v for k, v in out.items() if v is not None}

    na, nb = numbers(a), numbers(b)
    keys = [k for k in ("sim_accept_length", "parent_sim_accept_length") if k in na or k in nb]
    keys += sorted(k for k in set(na) | set(nb) if k not in keys)
    rows = [("version", str(a.version), str(b.version), ""),
            ("parent", a.parent_version or "-", b.parent_version or "-", ""),
            ("aliases", ",".join(a.aliases) or "-", ",".join(b.aliases) or "-", "")]
    for k in keys:
        va, vb = na.get(k), nb.get(k)
        delta = f"{vb - va:+.4f}" if va is not None and vb is not None else ""
        rows.append((k, _num(va, 4), _num(vb, 4), delta))
    return rows


def rows_text(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


class EngineRefused(RuntimeError):
    """The engine answered 401: the control token is wrong (the engine is reachable)."""


class EngineClient:
    """A running engine's control API and /metrics, for the CLI."""

    def __init__(self, url: str, token: str = "", timeout_s: float = 120.0) -> None:
        self.url = url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.timeout_s = timeout_s

    def _control(self, method: str, path: str) -> dict:
        resp = httpx.request(method, f"{self.url}/control/{path}", headers=self.headers, timeout=self.timeout_s)
        if resp.status_code == 401:
            raise EngineRefused(f"engine {self.url} refused the control token (401): wrong or missing --token")
        if resp.status_code != 200:
            raise RuntimeError(f"engine {self.url}: {method} /control/{path} answered {resp.status_code}: "
                               f"{resp.text[:300]}")
        return resp.json()

    def ping(self) -> None:
        """Authenticate before anything is written: EngineRefused on a wrong token."""
        self._control("POST", "ping")

    def check(self) -> dict:
        return self._control("POST", "check")

    def rollout(self) -> dict:
        """This replica's fleet record (tide/ops/fleet.py) from its /control/health."""
        ops = self._control("GET", "health").get("ops")
        if not ops:
            raise RuntimeError(f"engine {self.url} follows no registry (ops.follow_registry is off)")
        return ops["rollout"]

    def serving(self) -> str:
        """The drafter version the engine serves now, as its unauthenticated /health reports it."""
        resp = httpx.get(f"{self.url}/health", timeout=self.timeout_s)
        version = resp.json().get("drafter_version")
        if version is None:  # a failed engine answers 503 without it
            raise RuntimeError(f"engine {self.url}: /health answered {resp.status_code}: {resp.text[:300]}")
        return str(version)

    def live_acceptance(self) -> dict[str, float]:
        resp = httpx.get(f"{self.url}/metrics", timeout=self.timeout_s)
        resp.raise_for_status()
        return live_acceptance_from_metrics(resp.text)
