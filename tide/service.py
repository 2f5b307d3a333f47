"""What every long-running service does before its own work: the shared start of tide/services/*.py.

Steps (``start``): set up logging → load the config (YAML file, then ``TIDE_<SECTION>__<FIELD>``
environment, then the command line's overrides) → log the resolved config → install SIGTERM and
SIGINT handlers that set the returned ``threading.Event``. A bad config is logged and answered
with ``None`` (the main exits 2), before anything heavy is imported.
"""
from __future__ import annotations

import argparse
import json
import logging
import signal
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tide.config import ConfigError, TideConfig, load_config
from tide.redact import config_as_dict

CONFIG_HELP = "YAML config file (sections as in tide/config/)"


@dataclass(frozen=True)
class Flag:
    """A command-line override of one config field (``--port`` sets ``server.port``)."""

    name: str
    field: str  # "section.key"
    type: Callable[[str], object] = str
    note: str = ""

    @property
    def dest(self) -> str:
        return self.name.lstrip("-").replace("-", "_")


def parse_args(prog: str, description: str, flags: Sequence[Flag], argv: list[str] | None,
               config_help: str = CONFIG_HELP) -> argparse.Namespace:
    """The service's command line: ``--config``, one flag per overridable field, ``--log-level``."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--config", help=config_help)
    for flag in flags:
        parser.add_argument(flag.name, type=flag.type, help=f"override {flag.field}"
                            + (f" ({flag.note})" if flag.note else ""))
    parser.add_argument("--log-level", default="INFO")
    return parser.parse_args(argv)


def flag_overrides(args: argparse.Namespace, flags: Sequence[Flag]) -> dict:
    """{section: {key: value}} from the flags given on the command line (unset ones are None)."""
    out: dict = {}
    for flag in flags:
        section, key = flag.field.split(".", 1)
        out.setdefault(section, {})[key] = getattr(args, flag.dest)
    return out


def start(name: str, config_path: str | None, overrides: dict | None, log_level: str = "INFO",
          stop_note: str = "shutting down") -> tuple[TideConfig, threading.Event] | None:
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log = logging.getLogger(f"tide.services.{name}")
    # command-line flags left unset (None) do not override the file or the environment
    overrides = {section: {k: v for k, v in values.items() if v is not None}
                 for section, values in (overrides or {}).items()}
    overrides = {section: values for section, values in overrides.items() if values}
    try:
        cfg = load_config(config_path, overrides=overrides or None)
    except (ConfigError, OSError) as exc:
        log.error("bad configuration: %s", exc)
        return None
    log.info("resolved config: %s", json.dumps(config_as_dict(cfg), sort_keys=True, default=str))
    stop = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        log.info("received %s: %s", signal.Signals(signum).name, stop_note)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    return cfg, stop
