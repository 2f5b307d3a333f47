"""What may be written to a log: secrets taken out of config dumps, URLs and environments.

Rules (every log line and printed dump of configuration goes through ``config_as_dict``):
1. a field whose name says it holds a secret (``*_token``, ``*password*``, ``*secret*``) is
   ``***`` when set; ``schedule.k8s_secret_env`` only names Secrets (``secret/key``) and is kept;
2. ``schedule.k8s_env`` keeps its variable names, never its values (any of them could be a
   credential: secrets belong in Kubernetes Secrets, see tide/schedule/kubernetes_launcher.py);
3. the password of a URL (``scheme://user:password@host``) is ``***`` in any string value.
``looks_secret`` is the name rule the Job builder uses to refuse plain-text secrets.
"""
from __future__ import annotations

import re
from typing import Any

# a credential's name part, between underscores or the ends: HF_TOKEN, AWS_SECRET_ACCESS_KEY,
# GOOGLE_APPLICATION_CREDENTIALS, but not TIDE_TRAIN__MAX_TRAIN_TOKENS
SECRET_NAME = re.compile(r"(^|_)(PASSWORD|PASSWD|SECRET|TOKEN|CREDENTIALS?|PRIVATE_KEY|API_?KEY|ACCESS_?KEY|AUTH)(_|$)",
                         re.I)
_URL_PASSWORD = re.compile(r"(?P<head>[a-z][a-z0-9+.-]*://[^/@\s:]*:)[^/@\s]*@", re.I)
MASK = "***"
REFERENCE_FIELDS = {"k8s_secret_env"}  # names of Secrets, not their values
VALUES_HIDDEN = {"k8s_env"}


def looks_secret(name: str) -> bool:
    """A variable or field name that says it holds a credential."""
    return bool(SECRET_NAME.search(name))


def redact_url(text: str) -> str:
    """``text`` with the password of every ``scheme://user:password@`` replaced by ``***``."""
    return _URL_PASSWORD.sub(lambda m: f"{m.group('head')}{MASK}@", text)


def has_url_password(text: str) -> bool:
    return redact_url(text) != text


def _field(key: str, value: Any) -> Any:
    if key in REFERENCE_FIELDS:
        return value
    if key in VALUES_HIDDEN and isinstance(value, dict):
        return {name: MASK for name in value}
    if key.endswith("_token") or "password" in key or "secret" in key:
        return MASK if value else ""
    return redact_url(value) if isinstance(value, str) else value


def config_as_dict(cfg: Any) -> dict[str, Any]:
    """A whole TideConfig as plain data for logging at start, secrets redacted (rules above)."""
    data = cfg.model_dump()
    for name, section in data.items():
        if isinstance(section, dict):
            data[name] = {key: _field(key, value) for key, value in section.items()}
        elif isinstance(section, str):
            data[name] = redact_url(section)
    return data
