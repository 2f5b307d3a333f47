"""The retrain scheduler: an APScheduler interval job that runs one policy tick at a time.

One tick, inside the state file's lock (``StateStore.transaction``):
1. if a retrain is recorded as running: poll it through its launcher; past its deadline, kill it
   (timed_out); once it has ended, record the outcome (success resets the failure streak and
   moves the data watermark to what the job reports to have read; failure or timeout extends the
   streak, which sets the backoff, and leaves the watermark where it was);
   a "launching" record without a handle (scheduler died mid-launch) is resolved by job id;
2. on the first tick of this process, with nothing recorded as running: ask the launcher for jobs
   it can find without the state file (local: processes carrying this state file's marker;
   Kubernetes: Jobs with our labels) and adopt one, so even a lost state file does not double-run;
3. watch for a workload shift (``tide/schedule/shift.py``: the captured workload mix, the
   engines' live acceptance) and record one when it is detected;
4. count new samples from the dataset table's log (commit metadata after the watermark version;
   for a recorded shift whose retrain has not launched, only commits since its new traffic began),
   apply the policy (such a shift asks fewer), and launch when
   it says so; a shift's retrain is launched with its own environment and recorded on the shift.
APScheduler runs ticks with ``max_instances=1, coalesce=True`` on one worker thread, so ticks never
overlap and a slow tick does not queue a burst. The dataset's maintenance (retention DELETE +
VACUUM, compaction: tide/dataset/retention.py), when given, runs as a second job on its own thread
every ``maintenance_interval_s``: one scheduler replica does it, never the ingest replicas. APScheduler's own job stores would persist the
schedule, not which retrain runs; the lease is the state file, so the in-memory store suffices.
"""
from __future__ import annotations

import logging
import secrets
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

from tide import metrics
from tide.contracts import JOB_CANCELLED, JOB_FAILED, JOB_SUCCEEDED, JOB_TIMED_OUT, RETRAIN_NOTHING_TO_DO
from tide.schedule.kubernetes_launcher import KubernetesLauncher, job_env
from tide.schedule.launcher import JobSpec, Launcher, Outcome
from tide.schedule.local_launcher import LocalLauncher
from tide.schedule.policy import (
    Decision,
    check_config,
    count_new_samples,
    decide,
    newest_version,
    shift_env,
    shift_samples_since_s,
    watermark_after_success,
    watermark_of,
)
from tide.schedule.shift import SIGNALS, ShiftWatch, publish_shift, shift_view
from tide.schedule.state import FinishedJob, RunningJob, SchedulerState, ShiftRecord, StateStore

log = logging.getLogger(__name__)
# Kubernetes enforces activeDeadlineSeconds itself and reports DeadlineExceeded; the scheduler
# deletes the Job only if that did not happen within this margin
_K8S_DEADLINE_MARGIN_S = 120.0


class RetrainScheduler:
    def __init__(self, cfg: Any, table: Any, store: StateStore, launcher: Launcher,
                 clock: Callable[[], float] = time.time, maintenance: Callable[[], Any] | None = None,
                 maintenance_interval_s: float = 300.0, shift_watch: ShiftWatch | None = None) -> None:
        """``cfg`` is the ScheduleConfig; ``table`` a DatasetTable (version/counts_since, and for the
        workload mix data_files/open_file); ``shift_watch`` defaults to one built from ``cfg``."""
        check_config(cfg)
        self.cfg = cfg
        self.table = table
        self.store = store
        self.launcher = launcher
        self.clock = clock
        self.maintenance = maintenance
        self.maintenance_interval_s = maintenance_interval_s
        self.jobs_dir = store.path.parent / "jobs"
        self._orphans_checked = False
        self._aps = None
        self._snapshot_lock = threading.Lock()
        self._started_s = clock()
        self._snapshot: dict[str, Any] = {"last_tick_s": None, "last_error": None}
        self._last_success_s: float | None = None
        self.shift_watch = shift_watch or (ShiftWatch(cfg, table) if cfg.shift_detection else None)
        self._last_shift_s: float | None = None
        metrics.SCHED_THRESHOLD.set(cfg.min_new_samples)
        for signal in SIGNALS:
            metrics.SCHED_SHIFTS.labels(signal)  # exported as 0 before any shift
        metrics.SCHED_LAST_SHIFT.set(0)
        metrics.SCHED_SECONDS_SINCE_SHIFT.set_function(
            lambda: -1.0 if self._last_shift_s is None else time.time() - self._last_shift_s)
        metrics.SCHED_RETRAINS_LAUNCHED.labels(launcher.kind)  # exported as 0 before any launch
        for outcome in (JOB_SUCCEEDED, JOB_FAILED, JOB_TIMED_OUT):
            metrics.SCHED_RETRAINS_FINISHED.labels(outcome)
        metrics.SCHED_SECONDS_SINCE_SUCCESS.set_function(
            lambda: time.time() - (self._last_success_s or self._started_s))

    # --- one tick ---------------------------------------------------------------------------
    def tick(self) -> Decision:
        now = self.clock()
        with self.store.transaction() as state:
            if state.running is not None:
                self._check_running(state, now)
                self._orphans_checked = True
            elif not self._orphans_checked:
                self._adopt_orphans(state, now)
            self._watch_shift(state, now)
            watermark = watermark_of(state)
            new = count_new_samples(self.table, watermark, self.cfg.sample_unit, self.cfg.target_model,
                                    shift_samples_since_s(self.cfg, state))
            decision = decide(state, new, now, self.cfg)
            if decision.launch:
                self._launch(state, now, new, watermark)
            self._publish(state, decision, now)
        metrics.SCHED_TICKS.labels(decision.reason).inc()
        return decision

    def safe_tick(self) -> None:
        """The APScheduler job: a failing tick is logged and counted, and the next one retries."""
        try:
            self.tick()
        except Exception as exc:  # noqa: BLE001 - the service must keep ticking
            log.exception("scheduler tick failed")
            metrics.SCHED_TICKS.labels("error").inc()
            with self._snapshot_lock:
                self._snapshot.update(last_error=f"{type(exc).__name__}: {exc}",
                                      last_tick_s=self.clock())

    def _safe_maintenance(self) -> None:
        try:
            log.info("dataset maintenance: %s", self.maintenance())
        except Exception:  # noqa: BLE001 - tried again next interval
            log.exception("dataset maintenance failed; trying again in %.0f s", self.maintenance_interval_s)

    def _watch_shift(self, state: SchedulerState, now: float) -> None:
        """Record a shift the first time a signal sees it (tide/schedule/shift.py)."""
        if self.shift_watch is None:
            return
        found = self.shift_watch.check(now, state.shift)
        if found is None:
            return
        if state.shift is not None and state.shift.pending:
            return  # its retrain has not even launched: the same shift, seen again
        record = ShiftRecord(found.signal, now, found.detail, list(found.workloads), found.since_s)
        state.shifts = [*state.shifts, record][-max(1, self.cfg.history_max_jobs):]
        metrics.SCHED_SHIFTS.labels(found.signal).inc()
        log.warning("workload shift detected (%s): %s; the next retrain launches at %d new %s",
                    found.signal, found.detail, self.cfg.shift_min_new_samples, self.cfg.sample_unit)

    def _check_running(self, state: SchedulerState, now: float) -> None:
        job = state.running
        assert job is not None
        if job.launcher != self.launcher.kind:  # its handle means nothing to this launcher
            raise RuntimeError(
                f"{self.store.path} records a running {job.launcher} retrain ({job.job_id}) but "
                f"schedule.launcher is {self.launcher.kind}: switch back until it has finished")
        if job.handle is None:
            job.handle = self.launcher.find(job.job_id)
            if job.handle is None:
                self._finish(state, Outcome(JOB_FAILED, "launch interrupted; no job found"), now)
                return
            log.warning("retrain %s: found the job of an interrupted launch", job.job_id)
        try:
            outcome = self.launcher.poll(job.handle)
        except Exception as exc:  # noqa: BLE001 - e.g. API server unreachable: ask next tick
            log.warning("retrain %s: cannot poll (%s)", job.job_id, exc)
            outcome = None
        if outcome is None and now >= job.deadline_s:
            log.error("retrain %s: still running at its deadline; killing it", job.job_id)
            self.launcher.kill(job.handle)
            outcome = Outcome(JOB_TIMED_OUT, f"ran longer than job_timeout_s="
                                           f"{self.cfg.job_timeout_s:g}; killed")
        if outcome is not None:
            self._finish(state, outcome, now)

    def _finish(self, state: SchedulerState, outcome: Outcome, now: float) -> None:
        job = state.running
        assert job is not None
        result = outcome.result or {}
        watermark = (watermark_after_success(watermark_of(state), job.watermark_version, result)
                     if outcome.succeeded else job.watermark_version)
        record = FinishedJob(
            job.job_id, job.launcher, job.started_at_s, now, outcome.status, outcome.reason,
            watermark, job.new_samples, outcome.exit_code,
            version=None if result.get("version") is None else str(result["version"]),
            run_id=None if result.get("run_id") is None else str(result["run_id"]))
        state.running = None
        state.history = [*state.history, record][-max(1, self.cfg.history_max_jobs):]
        shift = state.shift
        if shift is not None and shift.job_id == job.job_id:
            if outcome.succeeded and result.get("status") == RETRAIN_NOTHING_TO_DO:
                # its window held too little of the new traffic yet (fewer requests than a retrain
                # trains on): the next launch is the shift's again
                shift.job_id = shift.launched_at_s = None
                log.info("retrain %s had too little since the shift (%s); the shift's retrain launches "
                         "again at %d new %s", job.job_id, outcome.reason, self.cfg.shift_min_new_samples,
                         self.cfg.sample_unit)
            else:
                shift.status, shift.version = outcome.status, record.version
        if outcome.status == JOB_CANCELLED:  # stopped on purpose: no backoff for the next one
            log.warning("retrain %s cancelled (%s)", job.job_id, outcome.reason)
        elif outcome.succeeded:
            state.last_success = record
            state.consecutive_failures = 0
            state.last_failure_at_s = None
            log.info("retrain %s succeeded (%s); data watermark %s", job.job_id, outcome.reason, watermark)
        else:
            state.consecutive_failures += 1
            state.last_failure_at_s = now
            log.error("retrain %s %s (%s); %d failure(s) in a row", job.job_id, outcome.status,
                      outcome.reason, state.consecutive_failures)
        metrics.SCHED_RETRAINS_FINISHED.labels(outcome.status).inc()
        if outcome.succeeded and result.get("status") == RETRAIN_NOTHING_TO_DO:
            metrics.SCHED_RETRAINS_NOTHING_TO_DO.inc()
        metrics.SCHED_RETRAIN_SECONDS.observe(max(0.0, now - job.started_at_s))

    def _launch(self, state: SchedulerState, now: float, new: int,
                watermark: float | None) -> None:
        job_id = f"{time.strftime('%Y%m%d-%H%M%S', time.gmtime(now))}-{secrets.token_hex(3)}"
        shift = state.shift if state.shift is not None and state.shift.pending else None
        if shift is not None:  # this launch is the shift's retrain
            shift.job_id, shift.launched_at_s = job_id, now
        margin = _K8S_DEADLINE_MARGIN_S if self.launcher.kind == "kubernetes" else 0.0
        state.running = RunningJob(
            job_id, self.launcher.kind, now, now + self.cfg.job_timeout_s + margin,
            newest_version(self.table, watermark), new)
        state.launched_total += 1
        self.store.checkpoint(state)  # the intent survives a crash during launch
        spec = JobSpec(job_id, self.jobs_dir / f"{job_id}.result.json",
                       self.jobs_dir / f"{job_id}.log", shift_env(self.cfg, shift) if shift else {})
        try:
            state.running.handle = self.launcher.launch(spec)
        except Exception as exc:  # noqa: BLE001 - recorded as a failure; backoff applies
            log.exception("retrain %s: launch failed", job_id)
            self._finish(state, Outcome(JOB_FAILED, f"launch failed: {type(exc).__name__}: {exc}"),
                         now)
            return
        metrics.SCHED_RETRAINS_LAUNCHED.labels(self.launcher.kind).inc()
        log.info("retrain %s launched (%d new %s%s)", job_id, new, self.cfg.sample_unit,
                 f"; the shift's: {spec.env}" if shift else "")

    def _adopt_orphans(self, state: SchedulerState, now: float) -> None:
        try:
            active = self.launcher.find_active()
        except Exception as exc:  # noqa: BLE001 - try again next tick
            log.warning("cannot look for running retrain jobs (%s)", exc)
            return
        self._orphans_checked = True
        if not active:
            return
        if len(active) > 1:
            log.error("%d retrain jobs found running; adopting %s only", len(active), active[0][0])
        job_id, handle = active[0]
        log.warning("adopting running retrain %s not recorded in %s", job_id, self.store.path)
        state.running = RunningJob(job_id, self.launcher.kind, now, now + self.cfg.job_timeout_s,
                                   watermark_of(state), 0, handle)

    def _publish(self, state: SchedulerState, decision: Decision, now: float) -> None:
        last = state.last_success
        self._last_success_s = last.finished_at_s if last is not None else None
        metrics.SCHED_NEW_SAMPLES.set(decision.new_samples)
        metrics.SCHED_THRESHOLD.set(decision.threshold)
        metrics.SCHED_RUNNING.set(1 if state.running is not None else 0)
        self._last_shift_s = state.shift.detected_at_s if state.shift is not None else None
        publish_shift(state, self.shift_watch.mix.shares if self.shift_watch is not None else {})
        metrics.SCHED_CONSECUTIVE_FAILURES.set(state.consecutive_failures)
        metrics.SCHED_LAST_SUCCESS.set(last.finished_at_s if last is not None else 0)
        with self._snapshot_lock:
            self._snapshot = {
                "last_tick_s": now, "last_error": None, "decision": decision.reason,
                "new_samples": decision.new_samples, "threshold": decision.threshold,
                "shift": shift_view(state, now),
                "wait_s": round(decision.wait_s, 3),
                "running": state.running.job_id if state.running is not None else None,
                "consecutive_failures": state.consecutive_failures,
                "last_success_job": last.job_id if last is not None else None,
                "launched_total": state.launched_total}

    # --- service plumbing -------------------------------------------------------------------
    def health(self) -> tuple[bool, dict]:
        """Healthy while ticks succeed and the last one is recent (3 intervals + 30 s)."""
        with self._snapshot_lock:
            snap = dict(self._snapshot)
        last = snap.get("last_tick_s") or self._started_s
        stale = self.clock() - last > 3 * self.cfg.interval_s + 30
        return (snap.get("last_error") is None and not stale), snap

    def start(self) -> None:
        from apscheduler.executors.pool import ThreadPoolExecutor
        from apscheduler.schedulers.background import BackgroundScheduler
        from apscheduler.triggers.interval import IntervalTrigger

        self._aps = BackgroundScheduler(executors={"default": ThreadPoolExecutor(1),
                                                   "maintenance": ThreadPoolExecutor(1)},
                                        timezone=timezone.utc)
        self._aps.add_job(self.safe_tick, IntervalTrigger(seconds=self.cfg.interval_s),
                          id="retrain-policy", max_instances=1, coalesce=True,
                          misfire_grace_time=None, next_run_time=datetime.now(timezone.utc))
        if self.maintenance is not None:
            self._aps.add_job(self._safe_maintenance, IntervalTrigger(seconds=self.maintenance_interval_s),
                              id="dataset-maintenance", executor="maintenance", max_instances=1,
                              coalesce=True, misfire_grace_time=None)
        self._aps.start()

    def stop(self, cancel_running: bool = False) -> None:
        """Stop scheduling; waits for a tick in progress. A running retrain is left running (the
        next scheduler adopts it) unless ``cancel_running``: then it is killed and recorded."""
        if self._aps is not None:
            self._aps.shutdown(wait=True)
            self._aps = None
        if not cancel_running:
            return
        with self.store.transaction() as state:
            job = state.running
            if job is None or job.launcher != self.launcher.kind:
                return
            try:
                # a crash mid-launch leaves no handle: the job may still exist under its id
                handle = job.handle if job.handle is not None else self.launcher.find(job.job_id)
                if handle is not None:
                    log.warning("retrain %s: cancelling it (schedule.cancel_on_stop)", job.job_id)
                    self.launcher.kill(handle)
            except Exception:  # noqa: BLE001 - stopping must finish; the next scheduler adopts it
                log.exception("retrain %s: cannot cancel it; left recorded as running", job.job_id)
                return
            self._finish(state, Outcome(JOB_CANCELLED, "scheduler stopped with cancel_on_stop"), self.clock())


def default_state_path(cfg: Any) -> Path:
    """``schedule.state_path`` or ``<home>/scheduler/state.json`` (cfg is the whole TideConfig)."""
    return Path(cfg.schedule.state_path) if cfg.schedule.state_path else (
        cfg.home_path / "scheduler" / "state.json")


def build_launcher(cfg: Any, config_path: str | None, state_path: Path) -> Launcher:
    """The launcher named by ``cfg.schedule.launcher`` (cfg is the whole TideConfig)."""
    kind = cfg.schedule.launcher
    if kind == "local":
        return LocalLauncher(cfg.schedule.command, config_path, state_path,
                             kill_grace_s=cfg.schedule.kill_grace_s, cpus=cfg.schedule.local_cpus,
                             nice=cfg.schedule.local_nice)
    if kind == "kubernetes":
        return KubernetesLauncher(cfg.schedule, job_env(cfg))
    raise ValueError(f"schedule.launcher: unknown launcher {kind!r}; known: local, kubernetes")
