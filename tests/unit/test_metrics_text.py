"""Reading /metrics pages: one parser over prometheus_client's, on real exposition text (counters,
gauges and histograms with labels, as ``generate_latest`` writes them), and what it and each of its
readers (the demo's sampler and scrape, the CLI's live acceptance, the SGLang engine's stats and
check) do with a missing metric or text that is not an exposition."""
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from tide.contracts import VersionAcceptance
from tide.engine.sglang.engine import SGLangEngine
from tide.metrics_text import MetricsTextError, by_label, parse
from tide.ops.inventory import live_acceptance_from_metrics
from tide.services.sglang_check import acceptance as sglang_acceptance
from tide.traffic import AcceptanceSampler, acceptance_counts, scrape, served_forwards

MALFORMED = 'tide_engine_target_forwards_total{drafter_version="1" 5.0\n'  # the labels' brace is missing


def engine_page() -> str:
    """An engine's /metrics text: the series the engines export, for two drafter versions."""
    reg = CollectorRegistry()
    forwards = Counter("tide_engine_target_forwards", "rows", ["drafter_version"], registry=reg)
    accepted = Counter("tide_engine_accepted_draft_tokens", "drafts", ["drafter_version"], registry=reg)
    length = Histogram("tide_engine_accept_length_tokens", "tokens per forward", ["drafter_version"],
                       buckets=(1, 2, 4), registry=reg)
    info = Gauge("tide_engine_drafter_info", "serving", ["drafter_version"], registry=reg)
    Gauge("tide_engine_queue_depth", "no labels", registry=reg).set(7)
    Counter("tide_ingest_tokens", "another service's", registry=reg).inc(11)
    info.labels("1").set(0)
    info.labels("2").set(1)
    for version, lengths, drafts in (("1", [1, 2, 3], 3), ("2", [3, 4], 5)):
        forwards.labels(version).inc(len(lengths) + 1)  # one row ran target-only
        accepted.labels(version).inc(drafts)
        for n in lengths:
            length.labels(version).observe(n)
    return generate_latest(reg).decode()


def test_parse_reads_counters_gauges_and_histograms_with_their_labels():
    families = parse(engine_page())
    assert families["tide_engine_target_forwards"][0].name == "tide_engine_target_forwards_total"
    assert "tide_engine_target_forwards_created" in families  # a family of its own: never summed in
    assert {s.name for s in families["tide_engine_accept_length_tokens"]} == {
        "tide_engine_accept_length_tokens_bucket", "tide_engine_accept_length_tokens_sum",
        "tide_engine_accept_length_tokens_count"}
    assert families["tide_engine_queue_depth"][0].value == 7.0 and families["tide_ingest_tokens"]
    assert by_label(families, "tide_engine_target_forwards_total", "drafter_version") == {"1": 4.0, "2": 3.0}
    assert by_label(families, "tide_engine_accept_length_tokens_sum", "drafter_version") == {"1": 6.0, "2": 7.0}
    assert by_label(families, "tide_engine_drafter_info", "drafter_version") == {"1": 0.0, "2": 1.0}
    # the le label of the buckets, summed over both versions
    assert by_label(families, "tide_engine_accept_length_tokens_bucket", "le") == {
        "1.0": 1.0, "2.0": 2.0, "4.0": 5.0, "+Inf": 5.0}
    only = parse(engine_page(), prefix="tide_engine_")
    assert "tide_ingest_tokens" not in only and set(only) < set(families)


def test_missing_metrics_and_labels_read_as_nothing():
    families = parse(engine_page())
    assert by_label(families, "tide_engine_no_such_total", "drafter_version") == {}
    assert by_label(families, "tide_engine_queue_depth", "drafter_version") == {}  # a sample without the label
    assert parse("") == {}


def test_text_that_is_not_an_exposition_is_refused_whole():
    for bad in (engine_page() + MALFORMED, "<html>502 Bad Gateway</html>\n"):
        with pytest.raises(MetricsTextError) as err:
            parse(bad)
        assert isinstance(err.value, ValueError)  # callers that caught the parser's ValueError still do


def test_the_acceptance_readers_agree_on_one_page():
    page = engine_page()
    families = parse(page)
    assert acceptance_counts(families) == {"1": (6.0, 3.0), "2": (7.0, 2.0)}
    assert served_forwards(families) == {"1": 4.0, "2": 3.0}
    assert live_acceptance_from_metrics(page) == {"1": 2.0, "2": 3.5}
    assert SGLangEngine.acceptance_of(parse(page, prefix="tide_engine_")) == {
        "1": VersionAcceptance(forwards=4, accepted=3, committed=6),
        "2": VersionAcceptance(forwards=3, accepted=5, committed=7)}
    assert acceptance_counts(parse("")) == {} and SGLangEngine.acceptance_of({}) == {}


@pytest.fixture
def page_server():
    """An HTTP endpoint serving whatever text ``body[0]`` holds as /metrics."""
    body = [""]

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            data = body[0].encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *_):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield body, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    thread.join(timeout=5)


def test_readers_over_http_on_a_good_and_a_malformed_page(page_server):
    body, base = page_server
    body[0] = engine_page()
    assert scrape(f"{base}/metrics")["tide_engine_drafter_info"]
    assert sglang_acceptance(base) == {"1": 2.0, "2": 3.5}
    sampler = AcceptanceSampler(f"{base}/metrics")
    sampler.sample()
    assert sampler.served_forwards_since(0.0, "1") == 4.0 and sampler.served_forwards_since(0.0, "2") == 3.0
    body[0] = engine_page() + MALFORMED
    assert scrape(f"{base}/metrics") == {}  # as an unreadable page
    with pytest.raises(ValueError):
        sglang_acceptance(base)
    sampler.sample()  # a page it cannot read is skipped, like an engine that did not answer
    assert sampler.served_forwards_since(0.0, "1") == 4.0 and sampler.served_forwards_since(0.0, "2") == 3.0
