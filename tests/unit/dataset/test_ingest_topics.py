"""The topics ingest creates carry a retention: captured hidden states are user data, and the
broker's copy only has to outlive an ingest outage (the Parquet dataset has its own TTL)."""
from tide.config import IngestConfig, KafkaConfig
from tide.dataset.topics import wanted_topics


def test_created_topics_carry_the_configured_retention():
    data, dead = wanted_topics(IngestConfig(topic_partitions=3, topic_retention_ms=3_600_000),
                               KafkaConfig(topic="t", dead_letter_topic="t.dlq"))
    assert (data.name, data.num_partitions, dead.name, dead.num_partitions) == ("t", 3, "t.dlq", 1)
    assert data.topic_configs == dead.topic_configs == {"retention.ms": "3600000"}
    assert all(t.topic_configs == {} for t in wanted_topics(IngestConfig(topic_retention_ms=0), KafkaConfig()))
    assert wanted_topics(IngestConfig(topic_retention_ms=-1), KafkaConfig())[0].topic_configs == {"retention.ms": "-1"}
