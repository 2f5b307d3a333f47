"""What every launcher shares: the job spec, the outcome of a finished job, the result-file contract.

The retrain command (``tide train --online ... --result-json PATH``) exits 0 when it registered a
version or found nothing to do, non-zero on failure, and writes a JSON object with ``status``
(tide.contracts RETRAIN_*), ``version``, ``run_id``, ``metrics`` and the dataset watermark it read
(``RESULT_DATA_WATERMARK``; the scheduler's watermark moves there on success). A job counts as
succeeded only when both agree: exit code 0 (where the launcher can know it) and a success status.
Every launcher hands that object (or, for a Job, its summary with the same keys) back as ``Outcome.result``.
A launcher's handle is a JSON-serialisable dict, so the scheduler can persist it in its state file
and a restarted scheduler can poll or kill a job it did not start.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Protocol

from tide.contracts import JOB_FAILED, JOB_SUCCEEDED, RETRAIN_SUCCESS_STATUSES

# environment markers a launched job carries: they let a restarted scheduler find its own jobs
ENV_JOB_ID = "TIDE_RETRAIN_JOB_ID"
ENV_STATE_PATH = "TIDE_RETRAIN_STATE_PATH"


@dataclass(frozen=True)
class JobSpec:
    """One retrain to launch: its id, where its log and result file go (local launches), and
    environment of its own (a shift's retrain: ``TIDE_TRAIN__*`` overrides) over the launcher's."""

    job_id: str
    result_path: Path
    log_path: Path
    env: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Outcome:
    """How a job ended. ``status``: one of tide.contracts.JOB_OUTCOMES."""

    status: str
    reason: str
    exit_code: int | None = None
    result: Mapping[str, Any] = field(default_factory=dict)

    @property
    def succeeded(self) -> bool:
        return self.status == JOB_SUCCEEDED


class Launcher(Protocol):
    kind: str

    def launch(self, spec: JobSpec) -> dict:
        """Start the job; return its handle (JSON-serialisable)."""

    def poll(self, handle: Mapping[str, Any]) -> Outcome | None:
        """None while the job runs; its outcome once it has ended."""

    def kill(self, handle: Mapping[str, Any]) -> None:
        """Stop the job and everything it started; returns once it is gone (or deletion is asked)."""

    def find(self, job_id: str) -> dict | None:
        """Handle of a running job with this id (a launch interrupted before its handle was saved)."""

    def find_active(self) -> list[tuple[str, dict]]:
        """(job id, handle) of running jobs this scheduler launched, found without the state file."""


def read_result(path: str | Path | None) -> tuple[dict, str]:
    """The job's result JSON and a problem description ('' when it was read fine)."""
    if not path:
        return {}, "no result file expected"
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        return {}, "no result file"
    except (OSError, ValueError) as exc:
        return {}, f"unreadable result file ({exc})"
    if not isinstance(data, dict) or "status" not in data:
        return {}, "result file has no 'status'"
    return data, ""


def outcome_from_exit(exit_code: int | None, result_path: str | Path | None) -> Outcome:
    """Judge a finished local job from its exit code (None = unknown: not our child) and result."""
    result, problem = read_result(result_path)
    status = str(result.get("status", ""))
    code_text = "exit code unknown" if exit_code is None else f"exit {exit_code}"
    if exit_code not in (None, 0):
        detail = f", result status {status!r}" if status else f", {problem}"
        return Outcome(JOB_FAILED, code_text + detail, exit_code, result)
    if problem:
        return Outcome(JOB_FAILED, f"{code_text}, {problem}", exit_code, result)
    if status not in RETRAIN_SUCCESS_STATUSES:
        return Outcome(JOB_FAILED, f"{code_text}, result status {status!r}", exit_code, result)
    return Outcome(JOB_SUCCEEDED, f"{code_text}, {status}", exit_code, result)
