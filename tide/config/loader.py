"""The whole configuration (``TideConfig``, a pydantic-settings model) and ``load_config``.

Layers, each over the one before: the field defaults (the local loop runs with no file) <- a YAML
file (top-level keys are sections, e.g. ``engine:``) <- environment variables
``TIDE_<SECTION>__<FIELD>`` <- explicit overrides (e.g. CLI flags). pydantic-settings merges the
layers' sections key by key; the fields read and check the values (tide/config/base.py).
"""
from __future__ import annotations

import os
import types
import typing
from pathlib import Path
from typing import Any, Mapping

import yaml
from pydantic import Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, InitSettingsSource, PydanticBaseSettingsSource, SettingsConfigDict

from tide.config.base import ConfigError, config_error, read_value
from tide.config.pipeline import CaptureConfig, IngestConfig, KafkaConfig, ScheduleConfig, TrainConfig
from tide.config.serving import (
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


def default_home() -> Path:
    """Where TIDE keeps caches, data and state unless told otherwise."""
    return Path(os.environ.get("TIDE_HOME", Path.home() / ".cache" / "tide"))


class TideConfig(BaseSettings):
    """All components; each service reads the sections it needs."""

    # built from given values only: ``load_config`` names the layers (settings_customise_sources)
    model_config = SettingsConfigDict(frozen=True, extra="forbid")

    model: ModelConfig = Field(default_factory=ModelConfig)
    spec: SpecConfig = Field(default_factory=SpecConfig)
    drafter: DrafterConfig = Field(default_factory=DrafterConfig)
    engine: EngineConfig = Field(default_factory=EngineConfig)
    server: ServerConfig = Field(default_factory=ServerConfig)
    kafka: KafkaConfig = Field(default_factory=KafkaConfig)
    capture: CaptureConfig = Field(default_factory=CaptureConfig)
    ingest: IngestConfig = Field(default_factory=IngestConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    schedule: ScheduleConfig = Field(default_factory=ScheduleConfig)
    registry: RegistryConfig = Field(default_factory=RegistryConfig)
    ops: OpsConfig = Field(default_factory=OpsConfig)
    sglang: SGLangConfig = Field(default_factory=SGLangConfig)
    drafter_service: DrafterServiceConfig = Field(default_factory=DrafterServiceConfig)
    home: str = ""  # empty = default_home()

    def __init__(self, **values: Any) -> None:
        try:
            super().__init__(**values)
        except ValidationError as exc:
            raise config_error(exc, TideConfig, "config") from None

    @classmethod
    def settings_customise_sources(cls, settings_cls: type[BaseSettings], init_settings: PydanticBaseSettingsSource,
                                   env_settings: PydanticBaseSettingsSource, dotenv_settings: PydanticBaseSettingsSource,
                                   file_secret_settings: PydanticBaseSettingsSource,
                                   ) -> tuple[PydanticBaseSettingsSource, ...]:
        # TideConfig(...) in code is those values over the defaults: the environment is read by load_config only
        return (init_settings,)

    @field_validator("home", mode="before")
    @classmethod
    def _read_home(cls, value: Any) -> Any:
        return read_value(value, str)

    @property
    def home_path(self) -> Path:
        return Path(self.home) if self.home else default_home()


# string fields with a closed set of values (their Literal types): anything else is refused when read
CHOICES: dict[str, tuple[str, ...]] = {
    f"{section}.{name}": typing.get_args(info.annotation)
    for section, section_info in TideConfig.model_fields.items() if section != "home"
    for name, info in section_info.annotation.model_fields.items()
    if typing.get_origin(info.annotation) is typing.Literal}


def _layer(values: Mapping[str, Any]) -> dict[str, Any]:
    """One layer's sections as pydantic-settings merges them: section by section, key by key, and a
    mapping-typed field's value whole (deep merging goes into dicts only: a mapping proxy is a leaf)."""
    return {section: {key: types.MappingProxyType(dict(v)) if isinstance(v, Mapping) else v
                      for key, v in body.items()} if isinstance(body, Mapping) else body
            for section, body in values.items()}


def _env_sections(env: Mapping[str, str]) -> dict[str, dict[str, str]]:
    out: dict[str, dict[str, str]] = {}
    for key, value in env.items():
        if not key.startswith("TIDE_") or key == "TIDE_HOME":
            continue
        parts = key[len("TIDE_"):].lower().split("__")
        if len(parts) == 1:
            # plain TIDE_* names are process markers (e.g. the scheduler's TIDE_RETRAIN_JOB_ID),
            # not configuration: only TIDE_<SECTION>__<FIELD> configures
            continue
        if len(parts) != 2:
            raise ConfigError(f"environment variable {key}: expected TIDE_<SECTION>__<FIELD>")
        out.setdefault(parts[0], {})[parts[1]] = value
    return out


class EnvSource(PydanticBaseSettingsSource):
    """The ``TIDE_<SECTION>__<FIELD>`` variables of one mapping (not necessarily os.environ), as
    sections of strings: an unknown section or key among them is refused like a file's."""

    def __init__(self, settings_cls: type[BaseSettings], env: Mapping[str, str]) -> None:
        super().__init__(settings_cls)
        self.sections = _env_sections(env)

    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:
        return self.sections.get(field_name), field_name, False

    def __call__(self) -> dict[str, Any]:
        return dict(self.sections)


def _read_yaml(path: str | Path) -> dict[str, Any]:
    data = yaml.safe_load(Path(path).read_text()) or {}  # a missing file is an OSError, never "no settings"
    if not isinstance(data, Mapping):
        raise ConfigError(f"{path}: top level must be a mapping of sections")
    return _layer(data)


def load_config(path: str | Path | None = None, env: Mapping[str, str] | None = None,
                overrides: Mapping[str, Any] | None = None) -> TideConfig:
    """Defaults ← YAML file ← environment (``env``; None = os.environ) ← explicit overrides (e.g. CLI flags)."""
    file = InitSettingsSource(TideConfig, _read_yaml(path) if path else {})
    environment = EnvSource(TideConfig, os.environ if env is None else env)
    given = InitSettingsSource(TideConfig, _layer(overrides or {}))
    return TideConfig(_build_sources=((given, environment, file), {}))  # highest priority first
