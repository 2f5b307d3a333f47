"""What every config section shares: frozen pydantic models, how a value is read, how an error reads.

Rules:
1. a section refuses keys it does not have; a key that moved names its new place (``MOVED_KEYS``);
2. values are read leniently, the same from a file, the environment or code: a bool from
   1/true/yes/on or 0/false/no/off; a tuple from a comma list ("a, b"); a mapping from JSON; a
   str-typed field takes anything (as ``str(value)``); an int or float field refuses a bool, and
   an int field refuses 1.5;
3. every rule on a value is declared once, on its field (``Field(ge=...)``, ``Literal[...]``);
   a ``model_validator`` only where a rule joins two fields;
4. every refusal is a ``ConfigError`` naming the key as ``config.<section>.<field>`` and the value.
"""
from __future__ import annotations

import collections.abc
import json
import typing
from typing import Any, ClassVar, Mapping

from pydantic import BaseModel, ConfigDict, ValidationError, ValidationInfo, field_validator

TRUE_WORDS, FALSE_WORDS = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


class ConfigError(ValueError):
    """A configuration value or key is wrong; the message names it."""


# keys that moved: a file or environment still setting the old key is an error naming the new one
# (silently ignoring it could point the engine and ingest at different topics)
MOVED_KEYS: dict[str, str] = {
    "capture.bootstrap_servers": "kafka.bootstrap_servers",
    "capture.topic": "kafka.topic",
    "ingest.bootstrap_servers": "kafka.bootstrap_servers",
    "ingest.topic": "kafka.topic",
    "ingest.dead_letter_topic": "kafka.dead_letter_topic",
}


def read_value(value: Any, tp: Any) -> Any:
    """``value`` as rule 2 reads it for a field of type ``tp``; pydantic then checks the type itself."""
    origin = typing.get_origin(tp)
    if tp is bool:
        low = value.strip().lower() if isinstance(value, str) else None
        if isinstance(value, bool) or low in TRUE_WORDS + FALSE_WORDS:
            return value if isinstance(value, bool) else low in TRUE_WORDS
        raise ValueError(f"expected a bool ({'/'.join(TRUE_WORDS)} or {'/'.join(FALSE_WORDS)})")
    if tp is str:
        return value if isinstance(value, str) else str(value)
    if tp in (int, float) and isinstance(value, bool):
        raise ValueError(f"expected {tp.__name__}, not a bool")
    if origin is tuple:
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]  # "a, b" = "a,b"
        (elem,) = {a for a in typing.get_args(tp) if a is not Ellipsis}
        return tuple(read_value(v, elem) for v in value) if isinstance(value, (list, tuple)) else value
    # get_origin(Mapping[...]) is collections.abc.Mapping, not typing.Mapping
    if origin in (dict, collections.abc.Mapping):
        if isinstance(value, str):
            try:
                value = json.loads(value) if value.strip() else {}
            except json.JSONDecodeError as exc:
                raise ValueError("expected a JSON object") from exc
        _, vt = typing.get_args(tp)
        return {str(k): read_value(v, vt) for k, v in value.items()} if isinstance(value, Mapping) else value
    return value


def _field_names(model: type[BaseModel], loc: tuple) -> list[str]:
    """The keys the model (or section) at ``loc`` below ``model`` knows."""
    for part in loc:
        model = model.model_fields[part].annotation
    return sorted(model.model_fields)


def _unknown(model: type[BaseModel], where: str, locs: list[tuple]) -> str:
    base = where.removeprefix("config").lstrip(".")
    moved = []
    for loc in locs:
        key = ".".join([base, *map(str, loc)]).lstrip(".")
        if key in MOVED_KEYS:
            env_name = "TIDE_" + MOVED_KEYS[key].upper().replace(".", "__")
            moved.append(f"config.{key} moved to {MOVED_KEYS[key]} (environment: {env_name}; "
                         "one kafka section is shared by capture and ingest)")
    if moved:
        return "; ".join(moved)
    parents = sorted({loc[:-1] for loc in locs})
    return "; ".join(f"{'.'.join([where, *map(str, parent)])}: unknown key(s) "
                     f"{sorted(str(loc[-1]) for loc in locs if loc[:-1] == parent)}; "
                     f"known: {_field_names(model, parent)}" for parent in parents)


def _describe(where: str, err: Mapping[str, Any]) -> str:
    key = ".".join([where, *map(str, err["loc"])])
    kind, value = err["type"], err.get("input")
    if kind == "value_error":  # a rule of ours
        reason = str(err["ctx"]["error"])
        if reason.startswith("config."):  # a section's own message (a rule across its fields) names the keys
            return reason
    elif kind == "literal_error":
        reason = f"not one of {err['ctx']['expected']}"
    elif kind in ("model_type", "dict_type"):
        reason = "expected a mapping"
    else:
        reason = err["msg"][:1].lower() + err["msg"][1:]
    return f"{key}: {reason}, got {value!r}"


def config_error(exc: ValidationError, model: type[BaseModel], where: str) -> ConfigError:
    """Pydantic's refusal of ``model`` (read at ``where``, e.g. "config.spec") as a ConfigError (rule 4)."""
    errors = exc.errors()
    extra = [tuple(e["loc"]) for e in errors if e["type"] == "extra_forbidden"]
    if extra:
        return ConfigError(_unknown(model, where, extra))
    return ConfigError("; ".join(_describe(where, e) for e in errors))


class Section(BaseModel):
    """One component's settings: frozen, attribute access, no unknown keys (rules above)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    section: ClassVar[str]  # its key under ``config``

    def __init__(self, **values: Any) -> None:
        try:
            super().__init__(**values)
        except ValidationError as exc:
            raise config_error(exc, type(self), f"config.{type(self).section}") from None

    @field_validator("*", mode="before")
    @classmethod
    def _read(cls, value: Any, info: ValidationInfo) -> Any:
        return read_value(value, cls.model_fields[info.field_name].annotation)


def replace(cfg: BaseModel, **changes: Any) -> Any:
    """A copy of a section or whole config with ``changes``, checked like a load (a ConfigError
    names a bad value): ``model_copy(update=...)`` would skip the checks."""
    return type(cfg)(**{**{name: getattr(cfg, name) for name in type(cfg).model_fields}, **changes})
