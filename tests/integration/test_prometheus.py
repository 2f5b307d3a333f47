"""The local stack's Prometheus (real binary from the Debian package) scrapes a real /metrics
endpoint exporting TIDE's metrics and records acceptance length by drafter version with the rules
in dashboards/ (packaged as tide.dashboards), which is what `tide up` shows as its dashboard and the demo reads back."""
import time

import httpx
import pytest
from prometheus_client import CollectorRegistry, Histogram, start_http_server

from tide import metrics, prometheus
from tide.process import free_port


def test_stack_prometheus_records_acceptance_by_drafter_version(tmp_path):
    exe = prometheus.binary()
    if exe is None:
        pytest.fail("prometheus not installed: scripts/install.sh installs the Debian package")
    # a private registry holding the engine's histogram under its real name
    registry = CollectorRegistry()
    accept = Histogram(metrics.ENGINE_ACCEPT_LENGTH._name, "tokens per forward", ["drafter_version"],
                       buckets=(1, 2, 3, 4, 5), registry=registry)
    port = free_port()
    server, thread = start_http_server(port, addr="127.0.0.1", registry=registry)
    svc, base = prometheus.start(exe, tmp_path, tmp_path / "prometheus.log",
                                 {"tide-engine": f"127.0.0.1:{port}"}, interval_s=1)
    try:
        seen: dict[str, float] = {}
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            for _ in range(5):  # version 1 commits 1 or 2 tokens per forward, version 2 three
                accept.labels("1").observe(1)
                accept.labels("1").observe(2)
                accept.labels("2").observe(3)
            time.sleep(0.5)
            seen = prometheus.accept_length_by_version(base, 60)
            if set(seen) == {"1", "2"}:
                break
        assert seen == {"1": pytest.approx(1.5, abs=0.01), "2": pytest.approx(3.0, abs=0.01)}, seen
        assert httpx.get(prometheus.graph_url(base), timeout=5).status_code == 200
        with pytest.raises(RuntimeError, match="refused|400"):
            try:
                prometheus.query(base, "rate(")
            except httpx.HTTPStatusError as exc:  # a malformed query is a 400 with the parse error
                raise RuntimeError(str(exc)) from exc
    finally:
        svc.stop()
        server.shutdown()
