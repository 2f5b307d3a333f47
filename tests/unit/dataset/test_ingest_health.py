"""Ingest's /health rule: not ready until joined and polling; not ready again once the consume
loop stops polling (stuck) although the process, and its /metrics, are up."""
import time

from tide.config import IngestConfig
from tide.dataset.ingest import Ingestor


def test_health_follows_the_consume_loop(tmp_path):
    ingestor = Ingestor(IngestConfig(poll_timeout_s=0.5), tmp_path)
    ingestor.last_error = "NoBrokersAvailable"
    ok, details = ingestor.health()
    assert not ok and details == {"state": "connecting", "last_error": "NoBrokersAvailable"}

    class Consumer:  # stands in for KafkaConsumer.poll only: nothing arrives
        def poll(self, timeout_ms):
            return {}

    ingestor._consumer = Consumer()
    ingestor.poll_once()
    ok, details = ingestor.health()
    assert ok and details["state"] == "consuming"
    ingestor._last_poll_s = time.monotonic() - 31  # 30 s = max(30 s, 20 polls of 0.5 s)
    ok, details = ingestor.health()
    assert not ok and details["state"] == "stalled"
