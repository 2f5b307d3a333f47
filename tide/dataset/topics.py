"""The two Kafka topics ingest uses, as it creates them: the data topic (``kafka.topic``,
``ingest.topic_partitions`` partitions) and the dead-letter topic (``kafka.dead_letter_topic``, one
partition), both at ``ingest.replication_factor`` and ``ingest.topic_retention_ms`` (0: the broker's).

Ingest creates the missing ones at start when ``ingest.create_topics`` is on (tide/dataset/ingest.py);
under Kubernetes the Strimzi topic operator owns them, and its KafkaTopic specs match these.
"""
from __future__ import annotations

from tide.config import IngestConfig, KafkaConfig


def wanted_topics(config: IngestConfig, kafka: KafkaConfig) -> list:
    """The data and dead-letter topics (named by ``kafka``) as ingest creates them (NewTopic specs)."""
    from kafka.admin import NewTopic

    topic_configs = {"retention.ms": str(config.topic_retention_ms)} if config.topic_retention_ms else {}
    return [NewTopic(kafka.topic, config.topic_partitions, config.replication_factor, topic_configs=topic_configs),
            NewTopic(kafka.dead_letter_topic, 1, config.replication_factor, topic_configs=topic_configs)]


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
