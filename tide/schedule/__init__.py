"""Retrain scheduling: trigger policy, persistent single-flight lease, launchers."""
from tide.schedule.launcher import JobSpec, Outcome
from tide.schedule.policy import Decision, backoff_delay_s, count_new_samples, decide
from tide.schedule.scheduler import RetrainScheduler, build_launcher, default_state_path
from tide.schedule.state import SchedulerState, StateError, StateStore

__all__ = ["Decision", "JobSpec", "Outcome", "RetrainScheduler", "SchedulerState", "StateError",
           "StateStore", "backoff_delay_s", "build_launcher", "count_new_samples", "decide",
           "default_state_path"]
