"""Configuration: one frozen pydantic model per component section, loaded in one place.

Loading steps (``load_config``, tide/config/loader.py):
1. start from the field defaults (embedded defaults: the local loop runs with no file);
2. overlay a YAML file (top-level keys are component sections, e.g. ``engine:``);
3. overlay environment variables ``TIDE_<SECTION>__<FIELD>`` (e.g. ``TIDE_KAFKA__BOOTSTRAP_SERVERS``);
4. overlay explicit overrides (e.g. CLI flags);
5. reject unknown sections and keys with an error naming them (a key that moved to another
   section names its new place, see ``MOVED_KEYS``), read values to the field's type and check
   each field's rules (tide/config/base.py), every refusal a ``ConfigError`` naming the key.

This package imports nothing else from ``tide`` so every component can depend on it.
"""
from tide.config.base import MOVED_KEYS, ConfigError, replace
from tide.config.loader import CHOICES, TideConfig, default_home, load_config
from tide.config.pipeline import CaptureConfig, IngestConfig, KafkaConfig, ScheduleConfig, TrainConfig
from tide.config.serving import (
    MAX_DRAFT_SIBLINGS,
    DrafterConfig,
    DrafterServiceConfig,
    EngineConfig,
    ModelConfig,
    OpsConfig,
    RegistryConfig,
    ServerConfig,
    SGLangConfig,
    SpecConfig,
)

__all__ = [
    "CHOICES", "MAX_DRAFT_SIBLINGS", "MOVED_KEYS", "CaptureConfig", "ConfigError", "DrafterConfig",
    "DrafterServiceConfig", "EngineConfig", "IngestConfig", "KafkaConfig", "ModelConfig", "OpsConfig",
    "RegistryConfig", "SGLangConfig", "ScheduleConfig", "ServerConfig", "SpecConfig", "TideConfig",
    "TrainConfig", "default_home", "load_config", "replace",
]
