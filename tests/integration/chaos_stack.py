"""The whole local stack under faults: what tests/integration/test_chaos.py and bench/chaos_soak.py run.

Parts, each a real process: a durable broker (tansu on SeaweedFS's S3: messages and committed
offsets outlive a broker restart), then the stack ``tide up --engines 2`` starts (tide/stack.py: MLflow, two engines
of the tiny target behind the local front, ingest, the scheduler as alias owner launching local
retrains, the page) and a second ingest replica in the same consumer group. The tiny target (H=64,
4 layers) keeps a retrain to seconds on two busy cores; the faults are about processes, not models.
Every acknowledged capture chunk is logged by the producer (tide/capture/producer.py ``ACK_LOG_ENV``).

``fault(kind, sig, outage_s)`` stops one component of a kind (engine, ingest, scheduler, mlflow,
broker) with SIGKILL or SIGSTOP, keeps it down for ``outage_s`` (the injected fault), then restarts
or continues it and waits for it to be healthy again (bounded); ``drain`` stops the engines cleanly
and waits until ingest has committed everything on the topic; ``dataset_audit`` compares the
acknowledged chunks with the table's rows (chaos_checks.py), and for any missing one whether the
topic holds it (lost by the broker or after it).
"""
from __future__ import annotations

import json
import os
import random
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from chaos_checks import audit, table_rows, wait_for

from tide.broker import BrokerStack, free_port
from tide.capture.producer import ACK_LOG_ENV
from tide.config import load_config
from tide.ops.alias_api import AliasClient
from tide.process import ServiceProcess, python_service
from tide.stack import Stack, StackOptions

HEALTHY_TIMEOUT_S = 240.0  # a restarted component is healthy again within this
KINDS = ("engine", "ingest", "scheduler", "mlflow", "broker")


def tiny_parts(root: Path) -> tuple[Path, Path]:
    """The tiny target's checkpoint and a drafter for it (untrained: its drafts are rarely accepted,
    and the greedy output is the target's whatever the drafter)."""
    import torch

    from tide.drafter.artifact import save_drafter
    from tide.models.llama import LlamaTarget
    from tide.models.tiny import tiny_llama_checkpoint
    from tide.train.offline import new_drafter

    folder = tiny_llama_checkpoint(root / "target")
    target = LlamaTarget.from_folder(folder, aux_layer_ids=(1, 2, 3), max_seq_len=256)
    static = save_drafter(new_drafter(target, 256, torch.arange(512).flip(0), seed=1).eval(), root / "static",
                          metadata={"version": "static"})
    return folder, static


def overrides(target: Path, static: Path, min_new_tokens: int, cooldown_s: float) -> dict:
    return {
        "model": {"target": str(target), "model_id": "tiny", "aux_layer_ids": [1, 2, 3], "max_seq_len": 256,
                  "torch_threads": 1},
        "drafter": {"path": str(static)},
        "engine": {"max_batch_size": 4, "max_new_tokens_limit": 64},
        "capture": {"staging_bytes": 4 * 1024 * 1024},  # a SIGKILLed engine leaves its ring in /dev/shm
        "ingest": {"roll_interval_s": 1.0, "session_timeout_ms": 6000, "heartbeat_interval_ms": 2000},
        "schedule": {"interval_s": 2, "min_new_samples": min_new_tokens, "sample_unit": "tokens",
                     "cooldown_s": cooldown_s, "backoff_base_s": 5, "backoff_max_s": 20, "job_timeout_s": 300},
        # passes enough to train for seconds: the scheduler's fault kills the owner while a retrain trains,
        # and one pass over this window ends (and auto-promotes) in less time than noticing it started
        "train": {"epochs": 30, "batch_tokens": 1024, "max_seq_len": 128, "ttt_length": 2, "window_samples": 48,
                  "replay_ratio": 0.25, "heldout_fraction": 0.2, "min_samples": 8, "max_train_s": 10,
                  "max_train_tokens": 4000, "rehearsal_prompts": 0},
        # every retrain's challenger is promoted (margin -1): faults, not drafter quality, are tested; the
        # guard is off because an untrained tiny drafter's ~1 token per forward reads as a collapse
        "ops": {"poll_interval_s": 2, "registry_retry_s": 2, "guard_enabled": False, "auto_promote": True,
                "auto_promote_margin": -1.0},
        "registry": {"http_timeout_s": 5},
    }


@dataclass
class Fault:
    kind: str
    victim: str
    sig: str
    outage_s: float
    started_s: float = 0.0
    restarted_s: float = 0.0  # restarted (SIGKILL) or continued (SIGSTOP)
    recovered_s: float = 0.0  # back up and healthy
    detail: dict = field(default_factory=dict)

    @property
    def down_s(self) -> float:
        return self.restarted_s - self.started_s

    @property
    def recovery_s(self) -> float:
        """From the end of the outage to healthy."""
        return self.recovered_s - self.restarted_s


class ChaosStack:
    def __init__(self, root: Path, min_new_tokens: int = 1500, cooldown_s: float = 20.0, seed: int = 0) -> None:
        self.root, self.rng = root, random.Random(seed)
        self.acks_dir = root / "acks"
        self.scheduler_dir = root / "home" / "scheduler"  # the stack's default state path lies there
        self.broker = BrokerStack("durable", free_port(), root / "broker")
        self.min_new_tokens, self.cooldown_s = min_new_tokens, cooldown_s
        self.stack: Stack | None = None
        self.extra: list[ServiceProcess] = []
        self.faults: list[Fault] = []

    # --- start / stop ---------------------------------------------------------------------------
    def start(self) -> "ChaosStack":
        os.environ[ACK_LOG_ENV] = str(self.acks_dir)  # the engines' capture workers inherit it
        target, static = tiny_parts(self.root / "models")
        self.broker.start()
        ports = {name: free_port() for name in ("engine", "mlflow", "page")}
        self.stack = Stack(StackOptions(self.root / "home", bootstrap_servers=self.broker.bootstrap_servers,
                                        prometheus=False, ports=ports, engines=2,
                                        overrides=overrides(target, static, self.min_new_tokens, self.cooldown_s)))
        self.stack.start()
        self.cfg = load_config(self.stack.config_path, env={})
        port = free_port()
        self.extra.append(python_service(
            "ingest-2", "tide.services.ingest", ["--config", str(self.stack.config_path)], self.root / "home" / "logs",
            {"TIDE_HOME": str(self.root / "home"), "TIDE_INGEST__METRICS_PORT": str(port)},
            f"http://127.0.0.1:{port}/health").start())
        self.extra[-1].wait_healthy(HEALTHY_TIMEOUT_S)
        self.owner = AliasClient(self.cfg.ops.alias_owner_url, self.stack.control_token, timeout_s=10)
        return self

    def stop(self) -> None:
        for svc in self.extra:
            if svc.proc is not None and svc.proc.poll() is None:
                os.killpg(svc.proc.pid, signal.SIGCONT)
            svc.stop()
        if self.stack is not None:
            for svc in self.stack.services:  # a component left stopped must hear SIGTERM
                if svc.proc is not None and svc.proc.poll() is None:
                    os.killpg(svc.proc.pid, signal.SIGCONT)
            self.stack.stop()
        if self.broker.tansu is not None and self.broker.tansu.poll() is None:
            os.kill(self.broker.tansu.pid, signal.SIGCONT)
        self.broker.stop_tansu(signal.SIGKILL)
        if self.broker.weed is not None and self.broker.weed.poll() is None:
            self.broker.weed.kill()  # a graceful weed stop takes ~15 s; the store is thrown away
            self.broker.weed.wait(timeout=30)
        os.environ.pop(ACK_LOG_ENV, None)

    # --- where things are -----------------------------------------------------------------------
    def service(self, name: str) -> ServiceProcess:
        return next(s for s in [*self.stack.services, *self.extra] if s.name == name)

    @property
    def front_url(self) -> str:
        return self.stack.endpoints["engine"]

    @property
    def engine_urls(self) -> dict[str, str]:
        return {f"engine-{i}": url for i, url in enumerate(self.stack.engine_urls)}

    def victims(self, kind: str) -> list[str]:
        return {"engine": list(self.engine_urls), "ingest": ["ingest", "ingest-2"], "scheduler": ["scheduler"],
                "mlflow": ["mlflow"], "broker": ["broker"]}[kind]

    def front_health(self) -> dict:
        return httpx.get(f"{self.front_url}/health", timeout=5).json()

    def engine_health(self, name: str) -> dict:
        try:
            return httpx.get(f"{self.engine_urls[name]}/health", timeout=5).json()
        except (httpx.HTTPError, ValueError):
            return {}

    def scheduler_health(self) -> dict:
        try:
            return httpx.get(f"{self.cfg.ops.alias_owner_url}/health", timeout=5).json()
        except (httpx.HTTPError, ValueError):
            return {}

    # --- faults -----------------------------------------------------------------------------------
    def fault(self, kind: str, sig: int, outage_s: float, victim: str | None = None, until=None) -> Fault:
        """One component of ``kind`` down for ``outage_s`` (and then until ``until()``, if given),
        then back and healthy."""
        victim = victim or self.rng.choice(self.victims(kind))
        fault = Fault(kind, victim, signal.Signals(sig).name, outage_s)
        if kind == "engine":  # while requests are in flight on it: they must be retried elsewhere
            wait_for(lambda: self.engine_health(victim).get("inflight_requests", 0) >= 1, 60,
                     f"requests in flight on {victim}", interval_s=0.02)
        if kind == "scheduler":
            fault.detail["running"] = self.scheduler_health().get("running")
        fault.detail["front_counts_before"] = self.front_health()["counts"]
        fault.started_s = time.time()
        if kind == "broker":
            fault.restarted_s = self._broker_down(sig, outage_s, until)
        else:
            fault.restarted_s = self._service_down(self.service(victim), sig, outage_s, until)
        if kind == "engine":  # the front uses it again
            wait_for(lambda: all(b["up"] for b in self.front_health()["backends"]), HEALTHY_TIMEOUT_S,
                     f"the front to see {victim} up")
        fault.recovered_s = time.time()
        fault.detail["front_counts_after"] = self.front_health()["counts"]
        self.faults.append(fault)
        return fault

    def _service_down(self, svc: ServiceProcess, sig: int, outage_s: float, until=None) -> float:
        os.killpg(svc.proc.pid, sig)  # the whole process group, as a pod's containers go
        if sig == signal.SIGKILL:
            svc.proc.wait(timeout=30)
        self._outage(outage_s, until)
        restarted_s = time.time()
        if sig == signal.SIGKILL:
            svc.start()
        else:
            os.killpg(svc.proc.pid, signal.SIGCONT)
        svc.wait_healthy(HEALTHY_TIMEOUT_S)
        return restarted_s

    def _broker_down(self, sig: int, outage_s: float, until=None) -> float:
        if sig == signal.SIGKILL:
            self.broker.stop_tansu(signal.SIGKILL)
        else:
            os.kill(self.broker.tansu.pid, sig)
        self._outage(outage_s, until)
        restarted_s = time.time()
        if sig == signal.SIGKILL:
            self.broker.start_tansu(HEALTHY_TIMEOUT_S)
        else:
            os.kill(self.broker.tansu.pid, signal.SIGCONT)
        return restarted_s

    @staticmethod
    def _outage(outage_s: float, until=None) -> None:
        time.sleep(outage_s)  # the outage: the injected fault itself
        if until is not None:
            wait_for(until, HEALTHY_TIMEOUT_S, "the event the outage lasts until")

    # --- the loop's progress ------------------------------------------------------------------------
    def table(self):
        from tide.dataset.location import Location
        from tide.dataset.table import DatasetTable

        return DatasetTable(Location.from_config(self.cfg))

    def table_version(self) -> int:
        table = self.table()
        return (table.version() or 0) if table.exists() else 0

    def retrain_running(self) -> bool:
        return bool(self.scheduler_health().get("running"))

    def operations(self) -> list[dict]:
        return self.owner.operations()

    def job_training(self) -> str | None:
        """The running retrain's id once it trains and has not ended: its training (the chaos config's
        train.max_train_s) and evaluation still lie ahead. A job the scheduler still reports running
        may have ended already (it is reaped at the next tick)."""
        job = self.scheduler_health().get("running")
        if not job or self.job_exited(job):
            return None
        log = self.scheduler_dir / "jobs" / f"{job}.log"
        return job if log.exists() and "retrain: training" in log.read_text(errors="replace") else None

    def job_exited(self, job_id: str) -> bool:
        """The retrain wrote its result: it has ended (it writes the file last)."""
        return (self.scheduler_dir / "jobs" / f"{job_id}.result.json").exists()

    def job_promotion(self, job_id: str) -> dict:
        """What the retrain's own auto-promotion call got (its result file)."""
        result = json.loads((self.scheduler_dir / "jobs" / f"{job_id}.result.json").read_text())
        return result.get("metrics", {}).get("auto_promotion", {})

    def finished_job(self, job_id: str):
        """The scheduler's record of retrain ``job_id`` once it has recorded its outcome, else None."""
        from tide.schedule import StateStore

        return next((j for j in StateStore(self.scheduler_dir / "state.json").load().history
                     if j.job_id == job_id), None)

    def auto_promoted(self, version: int) -> bool:
        return any(op["op"] == "promote" and op["actor"] == "auto-promotion" and op["to"] == version
                   for op in self.operations())

    def converged(self) -> dict | None:
        """The champion and every replica's served version, once all of them serve it (else None):
        from each engine itself and from the owner's fleet view."""
        try:
            champion = self.owner.state()["champion"]
            fleet = self.owner.fleet()
        except Exception:  # noqa: BLE001 - the owner or the registry is still coming back
            return None
        serving = {name: self.engine_health(name).get("drafter_version") for name in self.engine_urls}
        ok = champion is not None and all(v == str(champion) for v in serving.values()) and fleet["converged"]
        return {"champion": champion, "serving": serving} if ok else None

    def wait_converged(self, timeout_s: float) -> tuple[float, dict]:
        t0 = time.monotonic()
        state = wait_for(self.converged, timeout_s, "every replica to serve champion", interval_s=0.5)
        return time.monotonic() - t0, state

    # --- drain and audit ---------------------------------------------------------------------------------
    def drain(self, timeout_s: float) -> None:
        """Engines stopped cleanly (their capture flushes), then ingest has committed the whole topic."""
        for name in self.engine_urls:
            self.service(name).stop()
        wait_for(self.ingest_caught_up, timeout_s, "ingest to commit everything on the topic", interval_s=1.0)

    def ingest_caught_up(self) -> bool:
        from kafka import KafkaConsumer, TopicPartition

        # never subscribes: reads the group's offsets without joining (or rebalancing) it
        consumer = KafkaConsumer(bootstrap_servers=self.broker.bootstrap_servers, group_id=self.cfg.ingest.group_id,
                                 enable_auto_commit=False)
        try:
            topic = self.cfg.kafka.topic
            parts = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic) or ())]
            ends = consumer.end_offsets(parts)
            return bool(parts) and all((consumer.committed(tp) or 0) >= ends[tp] for tp in parts)
        finally:
            consumer.close(autocommit=False)

    def acked(self) -> list[dict]:
        lines = [line for path in sorted(self.acks_dir.glob("acks-*.jsonl"))
                 for line in path.read_text().splitlines() if line.strip()]
        return [json.loads(line) for line in lines]

    def dataset_audit(self) -> dict:
        result = audit(self.acked(), table_rows(self.table()))
        if result["missing"]:  # lost by the broker (not in the topic) or after it (in the topic, not the table)
            keys = self.topic_keys()
            result["missing_in_topic"] = [a for a in result["missing"] if (a["request_id"], a["partition"]) in keys]
        return result

    def topic_keys(self, quiet_s: float = 10.0) -> set[tuple[str, int]]:
        """(key, partition) of every message on the topic, read until ``quiet_s`` passes without one."""
        from kafka import KafkaConsumer, TopicPartition

        consumer = KafkaConsumer(bootstrap_servers=self.broker.bootstrap_servers, enable_auto_commit=False,
                                 consumer_timeout_ms=int(quiet_s * 1000))
        try:
            topic = self.cfg.kafka.topic
            parts = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic) or ())]
            consumer.assign(parts)
            consumer.seek_to_beginning(*parts)
            return {(m.key.decode(), m.partition) for m in consumer if m.key}
        finally:
            consumer.close(autocommit=False)
