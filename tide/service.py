"""What every long-running service does before its own work: the shared start of tide/services/*.py.

Steps (``start``): set up logging → load the config (YAML file, then ``TIDE_<SECTION>__<FIELD>``
environment, then the command line's overrides) → log the resolved config → install SIGTERM and
SIGINT handlers that set the returned ``threading.Event``. A bad config is logged and answered
with ``None`` (the main exits 2), before anything heavy is imported.
"""
from __future__ import annotations

import json
import logging
import signal
import threading

from tide.config import ConfigError, TideConfig, load_config
from tide.redact import config_as_dict


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
