"""The page (tide/services/page.py) over a real Prometheus (Debian package) evaluating the stack's
recording rules, scraping a real /metrics endpoint with TIDE's metric names, and a real
scheduler-style /health server; loaded in headless Chromium (Debian package). Panels whose source
is down or absent say why, with the page still a 200."""
import threading
import time
from http.server import ThreadingHTTPServer

import httpx
import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from tide import metrics, prometheus
from tide.health_server import HealthServer
from tide.process import free_port
from tide.services import page, page_data


def _metric(name: str) -> str:
    return name.describe()[0].name


def _exporter() -> tuple[int, dict, object]:
    """A private registry holding what engine, scheduler, capture and ingest export, by real name."""
    registry = CollectorRegistry()
    m = {"accept": Histogram(_metric(metrics.ENGINE_ACCEPT_LENGTH), "t", ["drafter_version"],
                             buckets=(1, 2, 3, 4), registry=registry),
         "info": Gauge(_metric(metrics.ENGINE_DRAFTER_INFO), "i", ["drafter_version"], registry=registry),
         "new": Gauge(_metric(metrics.SCHED_NEW_SAMPLES), "n", registry=registry),
         "threshold": Gauge(_metric(metrics.SCHED_THRESHOLD), "t", registry=registry),
         "produced": Counter("tide_capture_produced_records", "p", registry=registry),
         "lag": Gauge(_metric(metrics.INGEST_COMMIT_LAG), "l", registry=registry)}
    m["new"].set(1200)
    m["threshold"].set(5000)
    m["produced"].inc(42)
    m["lag"].set(3)
    m["info"].labels("1").set(1)
    port = free_port()
    server, _thread = start_http_server(port, addr="127.0.0.1", registry=registry)
    return port, m, server


def _serve(sources: page_data.Sources) -> tuple[str, ThreadingHTTPServer]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), page.handler_for(sources))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_address[1]}/", server



def test_page_shows_every_prometheus_panel_and_the_marks_in_chromium(tmp_path, chromium_dom):
    exe = prometheus.binary()
    if exe is None:
        pytest.fail("prometheus not installed: scripts/install.sh installs the Debian package")
    port, m, exporter = _exporter()
    sched = HealthServer("127.0.0.1", 0, lambda: (True, {"decision": "waiting", "running": None})).start()
    svc, base = prometheus.start(exe, tmp_path, tmp_path / "prometheus.log",
                                 {"tide-engine": f"127.0.0.1:{port}"}, interval_s=1)
    url, server = _serve(page_data.Sources(base, f"http://127.0.0.1:{sched.port}", tmp_path, None,
                                           tmp_path / "state.json"))
    try:
        page_data.write_mark(tmp_path, "shift", "shift to code")
        swapped, deadline = False, time.monotonic() + 90
        panel = page_data.Panel("acceptance", "")
        while time.monotonic() < deadline and not (swapped and any(k == "swap" for _, k, _ in panel.marks)):
            version = "2" if swapped else "1"
            for _ in range(5):
                m["accept"].labels(version).observe(2 if swapped else 1)
            # swap once the chart's step grid holds version 1 (serving it, too): then there is a swap to mark
            if not swapped and "1" in panel.series:
                m["info"].labels("1").set(0)
                m["info"].labels("2").set(1)
                swapped = True
            time.sleep(0.5)
            panel = page_data.acceptance(page_data.Sources(base, home=tmp_path), 60 * page.DEFAULT_WINDOW_MIN,
                                         time.time())  # the page's own window and steps
        assert {"1", "2"} <= set(panel.series) and {k for _, k, _ in panel.marks} == {"shift", "swap"}, panel
        dom = chromium_dom(url)
        for name in ("acceptance", "samples", "retrain", "capture", "ingest"):
            assert f'data-panel="{name}" data-has-data="true"' in dom, (name, dom[:3000])
        # no MLflow in this test: the panel says so instead of failing the page
        assert 'data-panel="registry" data-has-data="false"' in dom and "no registry configured" in dom
        assert 'data-mark="shift"' in dom and 'data-mark="swap"' in dom and 'http-equiv="refresh"' in dom, dom[:4000]
    finally:
        server.shutdown()
        svc.stop()
        sched.close()
        exporter.shutdown()


def test_page_answers_with_reasons_when_every_source_is_down(tmp_path):
    closed = f"http://127.0.0.1:{free_port()}"
    url, server = _serve(page_data.Sources(closed, closed, tmp_path, None, None))
    try:
        resp = httpx.get(url + "?minutes=bad", timeout=30)
        assert resp.status_code == 200
        for name in ("acceptance", "shift", "samples", "retrain", "registry", "fleet", "capture", "ingest"):
            assert f'data-panel="{name}" data-has-data="false"' in resp.text, name
        assert resp.text.count('class="reason"') == 8 and "ConnectError" in resp.text
        assert "no alias owner configured" in resp.text
        assert httpx.get(url + "health", timeout=5).json() == {"status": "ok"}
    finally:
        server.shutdown()


def test_the_shift_panel_says_which_signal_when_and_the_retrain_it_triggered(tmp_path):
    """The scheduler's record of a detected shift (its state file and /health), as the page shows it."""
    from tide.schedule.shift import shift_view
    from tide.schedule.state import RunningJob, ShiftRecord, StateStore

    store = StateStore(tmp_path / "state.json")
    detected = time.time() - 95
    with store.transaction() as state:
        state.shifts = [ShiftRecord("workload_mix", detected, "code 0% -> 100% of the newest 2000 captured tokens",
                                    ["code"], detected - 20, job_id="job-7", launched_at_s=detected + 12)]
        state.running = RunningJob("job-7", "local", detected + 12, detected + 999, None, 9000)
    sched = HealthServer("127.0.0.1", 0, lambda: (True, {"shift": shift_view(store.load(), time.time())})).start()
    url, server = _serve(page_data.Sources("", f"http://127.0.0.1:{sched.port}", tmp_path, None, store.path))
    try:
        html = httpx.get(url, timeout=30).text
        panel = html.split('data-panel="shift"')[1].split("</section>")[0]
        assert 'data-has-data="true"' in panel and "by workload mix" in panel
        assert "code 0% -&gt; 100%" in panel and "job-7" in panel and "12 s after the detection" in panel
        assert ">running<" in panel
        since = float(panel.split("time since</th><td>")[1].split(" s<")[0])
        assert 95 <= since < 95 + 60  # the time since the detection, not a clock reading
        assert page_data._detections(page_data.Sources(state_path=store.path)) == [
            (detected, "detected", "shift detected (workload_mix)")]  # marked on the chart too
    finally:
        server.shutdown()
        sched.close()
