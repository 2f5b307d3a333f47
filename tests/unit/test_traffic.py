"""The demo's live line reads ingest and scheduler state from their real /metrics pages (served
over HTTP here by prometheus_client from the same metric objects the services update)."""
import socket

import pytest
from prometheus_client import REGISTRY, start_http_server

from tide import metrics
from tide.traffic import loop_status, metric_value, scrape


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def metrics_url():
    port = _free_port()
    server, thread = start_http_server(port, addr="127.0.0.1", registry=REGISTRY)
    yield f"http://127.0.0.1:{port}/metrics"
    server.shutdown()
    thread.join(timeout=5)


def test_metric_values_follow_the_services_metrics(metrics_url):
    before = scrape(metrics_url)
    metrics.INGEST_TOKENS.inc(1234)
    metrics.SCHED_RETRAINS_FINISHED.labels("failed").inc()
    after = scrape(metrics_url)
    assert metric_value(after, metrics.INGEST_TOKENS) - (metric_value(before, metrics.INGEST_TOKENS) or 0) == 1234
    failed = metric_value(after, metrics.SCHED_RETRAINS_FINISHED, outcome="failed")
    assert failed - (metric_value(before, metrics.SCHED_RETRAINS_FINISHED, outcome="failed") or 0) == 1
    assert metric_value(after, metrics.SCHED_RETRAINS_FINISHED, outcome="no-such-outcome") is None


def test_loop_status_says_waiting_then_running(metrics_url):
    metrics.SCHED_RUNNING.set(0)
    metrics.SCHED_NEW_SAMPLES.set(9100)
    metrics.SCHED_THRESHOLD.set(16000)
    line = loop_status(metrics_url, metrics_url)
    tokens = metric_value(scrape(metrics_url), metrics.INGEST_TOKENS)
    assert line.startswith(f"{tokens / 1000:.1f}k tokens in Parquet | retrain: waiting 9.1k/16.0k new samples")
    metrics.SCHED_RUNNING.set(1)
    assert "retrain: running" in loop_status(metrics_url, metrics_url)
    metrics.SCHED_RUNNING.set(0)


def test_loop_status_when_services_are_down():
    dead = f"http://127.0.0.1:{_free_port()}/metrics"
    assert loop_status(dead, dead) == "ingest metrics unavailable | scheduler metrics unavailable"
