"""Shared by the e2e tests: every stack they start listens on free ports, never on the fixed
defaults, so they neither collide with each other (pytest-xdist runs them side by side) nor with
a ``tide up`` someone runs on the same machine."""
from __future__ import annotations

from tide.process import free_port


def stack_port_flags() -> list[str]:
    """``--engine-port N --mlflow-port N ...`` for ``tide up`` / ``tide demo``."""
    return [a for name in ("engine", "mlflow", "prometheus", "page") for a in (f"--{name}-port", str(free_port()))]
