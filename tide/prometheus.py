"""The local stack's Prometheus: its scrape config, the dashboard's link, and reading it back.

``tide up`` starts the Debian package's ``prometheus`` binary (when installed) scraping the engine,
ingest and scheduler every few seconds and evaluating ``dashboards/prometheus-rules.yml`` (packaged as
``tide.dashboards``), the same rules a production Prometheus loads; the Grafana dashboard
(``dashboards/tide.json``) plots the same recorded series. The demo reads the acceptance length per
drafter version back from it, which is what an operator's dashboard shows.
"""
from __future__ import annotations

import shutil
import urllib.parse
from importlib import resources
from pathlib import Path

import httpx
import yaml

from tide.process import ServiceProcess, free_port

# package data (the repository's dashboards/): a plain file inside the installed package, which
# Prometheus reads by path
RULES_PATH = Path(str(resources.files("tide.dashboards").joinpath("prometheus-rules.yml")))
# recorded by RULES_PATH: tokens per target forward, 1-minute rate, by drafter_version
ACCEPT_SERIES = "tide:engine_accept_length_tokens:mean1m"


def binary() -> str | None:
    return shutil.which("prometheus")


def scrape_config(targets: dict[str, str], interval_s: float = 5.0) -> dict:
    """prometheus.yml for ``{job name: host:port}`` targets (each serving ``/metrics``)."""
    every = f"{interval_s:g}s"
    return {
        "global": {"scrape_interval": every, "evaluation_interval": every},
        "rule_files": [str(RULES_PATH)],
        "scrape_configs": [{"job_name": job, "static_configs": [{"targets": [target]}]}
                           for job, target in targets.items()],
    }


def start(exe: str, home: Path, log_path: Path, targets: dict[str, str], interval_s: float = 5.0,
          timeout_s: float = 60.0, port: int | None = None) -> tuple[ServiceProcess, str]:
    """Run ``exe`` on loopback ``port`` (default: a free one) with its data under
    ``<home>/prometheus``; returns the process (healthy: ``/-/ready`` answered) and its base URL."""
    port = port or free_port()
    conf = home / "run" / "prometheus.yml"
    conf.parent.mkdir(parents=True, exist_ok=True)
    conf.write_text(yaml.safe_dump(scrape_config(targets, interval_s)))
    base = f"http://127.0.0.1:{port}"
    svc = ServiceProcess("prometheus", [
        exe, f"--config.file={conf}", f"--storage.tsdb.path={home / 'prometheus'}",
        f"--web.listen-address=127.0.0.1:{port}", "--storage.tsdb.retention.time=7d", "--log.level=warn"],
        log_path, health_url=f"{base}/-/ready").start()
    try:
        svc.wait_healthy(timeout_s)
    except BaseException:
        svc.stop()
        raise
    return svc, base


def graph_url(base_url: str, expr: str = ACCEPT_SERIES, range_input: str = "1h") -> str:
    """Prometheus's own graph page for ``expr`` (the local dashboard: no Grafana needed).

    Debian's build ships only the classic UI (``/classic/graph``; its ``/graph`` redirects there and
    drops the query); upstream builds serve ``/graph``."""
    query = urllib.parse.urlencode({"g0.expr": expr, "g0.tab": "0", "g0.range_input": range_input})
    try:
        classic = httpx.get(f"{base_url}/classic/graph", timeout=2.0).status_code == 200
    except httpx.HTTPError:
        classic = False
    return f"{base_url}/{'classic/graph' if classic else 'graph'}?{query}"


def query(base_url: str, promql: str, timeout_s: float = 5.0) -> list[tuple[dict, float]]:
    """Instant query -> [(labels, value)]; raises on HTTP errors or a query Prometheus refused."""
    resp = httpx.get(f"{base_url}/api/v1/query", params={"query": promql}, timeout=timeout_s)
    resp.raise_for_status()
    body = resp.json()
    if body.get("status") != "success":
        raise RuntimeError(f"prometheus refused {promql!r}: {body.get('error')}")
    return [(r["metric"], float(r["value"][1])) for r in body["data"]["result"]]


def query_range(base_url: str, promql: str, start_s: float, end_s: float, step_s: float,
                timeout_s: float = 5.0) -> list[tuple[dict, list[tuple[float, float]]]]:
    """Range query -> [(labels, [(unix_s, value)])], NaN points dropped; raises like ``query``."""
    resp = httpx.get(f"{base_url}/api/v1/query_range", timeout=timeout_s,
                     params={"query": promql, "start": start_s, "end": end_s, "step": step_s})
    resp.raise_for_status()
    body = resp.json()
    if body.get("status") != "success":
        raise RuntimeError(f"prometheus refused {promql!r}: {body.get('error')}")
    return [(r["metric"], [(float(t), float(v)) for t, v in r["values"] if float(v) == float(v)])
            for r in body["data"]["result"]]


def accept_length_by_version(base_url: str, window_s: float) -> dict[str, float]:
    """Mean of the recorded acceptance length over the last ``window_s``, by drafter version."""
    promql = f"avg_over_time({ACCEPT_SERIES}[{max(60, int(window_s))}s])"
    return {labels.get("drafter_version", "?"): round(value, 3)
            for labels, value in query(base_url, promql) if value == value}  # drops NaN (0/0)


def has_accept_sample(base_url: str, version: str) -> bool:
    """Whether the recorded acceptance length has a current value for drafter ``version`` (what the
    dashboard needs to draw it); False while Prometheus cannot be asked."""
    try:
        return bool(query(base_url, f'{ACCEPT_SERIES}{{drafter_version="{version}"}}'))
    except (httpx.HTTPError, RuntimeError, ValueError):
        return False
