"""The two Kafka topics ingest uses, as it creates them: the data topic (``kafka.topic``,
``ingest.topic_partitions`` partitions) and the dead-letter topic (``kafka.dead_letter_topic``, one
partition), both at ``ingest.replication_factor`` and ``ingest.topic_retention_ms`` (0: the broker's).

Ingest creates the missing ones at start when ``ingest.create_topics`` is on (tide/dataset/ingest.py);
under Kubernetes the Strimzi topic operator owns them, and its KafkaTopic specs match these.
"""
from __future__ import annotations

import uuid

from tide.config import IngestConfig, KafkaConfig


def wanted_topics(config: IngestConfig, kafka: KafkaConfig) -> list:
    """The data and dead-letter topics (named by ``kafka``) as ingest creates them (NewTopic specs)."""
    from kafka.admin import NewTopic

    topic_configs = {"retention.ms": str(config.topic_retention_ms)} if config.topic_retention_ms else {}
    return [NewTopic(kafka.topic, config.topic_partitions, config.replication_factor, topic_configs=topic_configs),
            NewTopic(kafka.dead_letter_topic, 1, config.replication_factor, topic_configs=topic_configs)]


class TopicIdUnknown(Exception):
    """The broker could not be asked for a topic's id now: its partitions wait (a guess could key
    their offsets wrongly)."""


def topic_id(kafka: KafkaConfig, topic: str) -> str | None:
    """The topic's id (KIP-516) as the broker reports it; None when it reports none (a broker
    without topic ids: offsets are then keyed by the topic's name). TopicIdUnknown when it cannot
    be asked now."""
    from kafka import KafkaAdminClient

    try:
        admin = KafkaAdminClient(bootstrap_servers=kafka.bootstrap_servers.split(","), client_id="tide-ingest-admin")
        try:
            found = [t for t in admin.describe_topics([topic]) if t.get("name") == topic]
        finally:
            admin.close()
    except Exception as exc:  # noqa: BLE001 - any client or broker error: ask again after a backoff
        raise TopicIdUnknown(f"the broker did not say the id of topic {topic}: {exc}") from exc
    value = found[0].get("topic_id") if found else None
    return None if value is None or uuid.UUID(str(value)).int == 0 else str(value)


def ensure_topics(config: IngestConfig, kafka: KafkaConfig) -> None:
    """Create the data and dead-letter topics if missing (explicitly: auto-created topics get
    whatever partition count and retention the broker likes)."""
    from kafka import KafkaAdminClient
    from kafka.errors import TopicAlreadyExistsError

    admin = KafkaAdminClient(bootstrap_servers=kafka.bootstrap_servers.split(","),
                             client_id="tide-ingest-admin")
    try:
        existing = set(admin.list_topics())
        missing = [t for t in wanted_topics(config, kafka) if t.name not in existing]
        if missing:
            try:
                admin.create_topics(missing)
            except TopicAlreadyExistsError:
                pass  # created concurrently by another ingest replica
    finally:
        admin.close()
