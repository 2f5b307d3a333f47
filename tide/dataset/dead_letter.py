"""The dead-letter topic: where ingest parks a message it cannot store, with why.

A dead letter keeps the original key and value (both cut to a size the producer accepts, the
original length in a header) and these headers: ``tide-dead-letter-reason`` (a ``DEAD_*``
constant of tide/contracts.py), ``tide-dead-letter-detail``, ``tide-source-topic``,
``tide-source-partition``, ``tide-source-offset``. Delivery is confirmed before the source offset
is committed; a refused or unconfirmed dead letter raises ``DeadLetterFailed`` and ingest
consumes the message again after a backoff.
"""
from __future__ import annotations

import logging
from typing import Any

from kafka import KafkaProducer

from tide.config import IngestConfig, KafkaConfig

log = logging.getLogger(__name__)

_MAX_KEY_BYTES = 4096  # a longer key is cut: key, value and headers must fit one request


class DeadLetterFailed(Exception):
    """The dead-letter producer refused or lost a message: it is neither stored nor parked."""


class DeadLetters:
    def __init__(self, config: IngestConfig, kafka: KafkaConfig) -> None:
        self.config = config
        self.topic = kafka.dead_letter_topic
        self._producer = KafkaProducer(
            bootstrap_servers=kafka.bootstrap_servers.split(","), acks="all", enable_idempotence=True,
            compression_type="zstd", linger_ms=5, client_id="tide-ingest-dead-letter",
            max_request_size=config.dead_letter_max_bytes + 2 * _MAX_KEY_BYTES + 64 * 1024)

    def send(self, message: Any, reason: str, detail: str) -> Any:
        """Queue ``message`` for the dead-letter topic; returns the send future."""
        value, key = message.value or b"", message.key
        headers = [("tide-dead-letter-reason", reason.encode()),
                   ("tide-dead-letter-detail", detail[:500].encode("utf-8", "replace")),
                   ("tide-source-topic", message.topic.encode()),
                   ("tide-source-partition", str(message.partition).encode()),
                   ("tide-source-offset", str(message.offset).encode())]
        if len(value) > self.config.dead_letter_max_bytes:
            headers.append(("tide-dead-letter-truncated-from", str(len(value)).encode()))
            value = value[:self.config.dead_letter_max_bytes]
        if key is not None and len(key) > _MAX_KEY_BYTES:
            headers.append(("tide-dead-letter-key-truncated-from", str(len(key)).encode()))
            key = key[:_MAX_KEY_BYTES]
        log.warning("ingest: dead-lettering %s-%d@%d: %s (%s)", message.topic, message.partition,
                    message.offset, reason, detail[:500])
        try:
            return self._producer.send(self.topic, key=key, value=value, headers=headers)
        except Exception as exc:  # no metadata within max_block_ms, buffer full, ...
            raise DeadLetterFailed(f"dead letter not sent: {exc}") from exc

    def confirm(self, futures: list, timeout_s: float = 30.0) -> None:
        """Wait until every one of ``futures`` is acknowledged; DeadLetterFailed if one is not."""
        if not futures:
            return
        try:
            self._producer.flush(timeout=timeout_s)
        except Exception as exc:
            raise DeadLetterFailed(f"dead letters not acknowledged: {exc}") from exc
        failed = next((f for f in futures if f.failed()), None)
        if failed is not None:
            raise DeadLetterFailed(f"dead letter refused: {failed.exception}")

    def close(self) -> None:
        self._producer.close(timeout=5)
