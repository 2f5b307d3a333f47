"""``tide up``: the whole loop on one machine, each part a separate process with its own log.

Start order (each waits healthy before the next; stop is the reverse):
1. broker: tansu (Kafka protocol) on loopback, unless ``--bootstrap-servers`` points elsewhere;
2. MLflow tracking server (SQLite store + served artifacts), unless ``--tracking-uri`` is given;
3. engine: target + drafter following the registry's ``champion`` (static drafter bootstrapped),
   capture on, OpenAI-compatible HTTP, ``/metrics``; with ``engines`` > 1, that many engine
   processes on free ports behind the local front (``tide/services/front.py``: round robin, retries
   requests not started) on the engine port;
4. ingest: Kafka → the dataset's Delta table (a local directory, or with ``dataset_store="s3"``
   a bucket on a local SeaweedFS S3 started first, as in a cluster);
5. scheduler: launches retrains when enough new samples arrived, and is the alias owner
   (``ops.alias_owner_url``: every drafter alias change goes through it, tide/ops/aliases.py);
6. Prometheus (when the ``prometheus`` binary is installed; scripts/install.sh installs it):
   scrapes the three services and evaluates ``dashboards/prometheus-rules.yml``;
7. the page (``tide/services/page.py``): the loop on one local HTML page, read from that
   Prometheus, the scheduler and the registry.
Engine, MLflow, Prometheus and the page listen on fixed default ports (``DEFAULT_PORTS``), each
overridable (``StackOptions.ports``) and replaced by a free port when taken.
The resolved configuration is written to ``<home>/run/tide.yaml`` and passed to every service,
so each part can be pointed at an external service instead by editing one file.
"""
from __future__ import annotations

import logging
import os
import secrets
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from tide import broker, prometheus
from tide.process import ServiceProcess, free_port, port_or_free, python_service
from tide.redact import redact_url

log = logging.getLogger(__name__)

# easy to remember and to bookmark; ingest and scheduler serve only /metrics and /health: free ports
DEFAULT_PORTS = {"engine": 8000, "mlflow": 5000, "prometheus": 9090, "page": 8090}


def _tcp_ready(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def write_private(path: Path, text: str) -> Path:
    """Write ``text`` to ``path`` readable by its owner only from the first byte (it holds the
    control token): a new file made 0600 whatever the umask, filled, then renamed over ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
            os.fchmod(f.fileno(), 0o600)  # the umask could only have removed bits; make it exact
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def mlflow_server(root: Path, port: int, log_path: Path) -> ServiceProcess:
    """An MLflow tracking server on loopback (SQLite store and served artifacts under ``root``),
    not started yet; its process group is its own (``ServiceProcess``)."""
    root.mkdir(parents=True, exist_ok=True)
    return ServiceProcess("mlflow", [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1",
                                     "--port", str(port), "--workers", "1",
                                     "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}",
                                     "--artifacts-destination", str(root / "artifacts")],
                          log_path, env={"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
                          health_url=f"http://127.0.0.1:{port}/health")


@dataclass
class StackOptions:
    home: Path
    bootstrap_servers: str = ""  # empty = start a local broker
    tracking_uri: str = ""  # empty = start a local MLflow server
    data_dir: str = ""
    durable_broker: bool = False
    # local (a directory) | s3 (a bucket on SeaweedFS's S3 on loopback); `tide up` reads TIDE_STACK_DATASET_STORE
    dataset_store: str = field(default_factory=lambda: os.environ.get("TIDE_STACK_DATASET_STORE", "local"))
    overrides: dict = field(default_factory=dict)  # extra config sections (demo settings)
    prometheus: bool = True  # start a local Prometheus when the binary is installed
    ports: dict[str, int] = field(default_factory=dict)  # overrides DEFAULT_PORTS by name
    # the engine service: the reference engine, or tide.services.sglang_engine (+ "--target", PATH)
    engine_module: str = "tide.services.engine"
    engine_args: tuple[str, ...] = ()
    engine_timeout_s: float = 900.0  # model load (SGLang: + CUDA graph capture)
    engines: int = 1  # engine processes; more than one run behind the local front

    def port(self, name: str) -> int:
        """The port ``name`` listens on: the asked or default one, or a free one when taken."""
        return port_or_free(self.ports.get(name) or DEFAULT_PORTS.get(name))


@dataclass
class Stack:
    opts: StackOptions
    services: list[ServiceProcess] = field(default_factory=list)
    endpoints: dict[str, str] = field(default_factory=dict)
    config_path: Path | None = None
    engine_urls: list[str] = field(default_factory=list)  # each engine process (behind the front when several)
    _s3_port: int = 0  # the local object store's, when the dataset is on S3

    def start(self) -> "Stack":
        home = self.opts.home
        logs = home / "logs"
        try:
            bootstrap = self.opts.bootstrap_servers or self._start_broker(logs)
            self._s3_port = self._start_store(logs) if self.opts.dataset_store == "s3" else 0
            tracking = self.opts.tracking_uri or self._start_mlflow(logs)
            ports = {"engine": self.opts.port("engine"), "ingest": free_port(), "scheduler": free_port()}
            token = secrets.token_hex(16)
            cfg = self._config(bootstrap, tracking, ports, token)
            self.config_path = write_private(home / "run" / "tide.yaml", yaml.safe_dump(cfg, sort_keys=True))
            env = {"TIDE_HOME": str(home), **(broker.LOCAL_S3_KEYS if self._s3_port else {})}
            conf = ["--config", str(self.config_path)]
            scraped = self._start_engines(logs, conf, env, ports)
            self._run(python_service("ingest", "tide.services.ingest", conf, logs, env,
                                     f"http://127.0.0.1:{ports['ingest']}/health"))
            self._run(python_service("scheduler", "tide.services.scheduler", conf, logs, env,
                                     f"http://127.0.0.1:{ports['scheduler']}/health"))
            self.endpoints.update({
                "engine": f"http://127.0.0.1:{ports['engine']}",
                "engine metrics": " ".join(f"{url}/metrics" for url in self.engine_urls),
                "ingest metrics": f"http://127.0.0.1:{ports['ingest']}/metrics",
                "scheduler metrics": f"http://127.0.0.1:{ports['scheduler']}/metrics",
                "kafka": bootstrap, "mlflow": tracking,
                "data": str(cfg["ingest"]["data_dir"]), "logs": str(logs),
                "config": str(self.config_path)})
            self._start_prometheus(logs, {**scraped, "ingest": ports["ingest"], "scheduler": ports["scheduler"]})
            self._start_page(logs, conf, env, ports["scheduler"])
            self.control_token = token
        except BaseException:
            self.stop()
            raise
        return self

    def _start_engines(self, logs: Path, conf: list[str], env: dict[str, str], ports: dict[str, int]) -> dict[str, int]:
        """One engine on the engine port, or ``engines`` of them behind the front there; returns
        the engines' ports by Prometheus job name."""
        n, front = self.opts.engines, ports["engine"]
        own = {"engine": front} if n == 1 else {f"engine-{i}": free_port() for i in range(n)}
        started = [python_service(name, self.opts.engine_module, [*conf, *self.opts.engine_args, "--port", str(port)],
                                  logs, env, f"http://127.0.0.1:{port}/health").start() for name, port in own.items()]
        self.services.extend(started)  # loading side by side; each is waited for below
        for svc in started:
            svc.wait_healthy(self.opts.engine_timeout_s)
        self.engine_urls = [f"http://127.0.0.1:{port}" for port in own.values()]
        if n > 1:
            backends = [arg for url in self.engine_urls for arg in ("--backend", url)]
            self._run(python_service("front", "tide.services.front", [*backends, "--port", str(front)], logs, env,
                                     f"http://127.0.0.1:{front}/health"))
            self.endpoints.update({name: url for name, url in zip(own, self.engine_urls)})
        return own

    def _run(self, svc: ServiceProcess, timeout_s: float = 300.0) -> None:
        self.services.append(svc.start())
        svc.wait_healthy(timeout_s)

    def _start_store(self, logs: Path) -> int:
        """SeaweedFS's S3 with the dataset's bucket; returns its port."""
        port = broker.free_port(grpc_offset=True)  # weed also listens on port + 10000 (its S3 gRPC)
        svc = ServiceProcess("object store", [sys.executable, "-m", "tide.broker", "run", "store", "--s3-port",
                                              str(port), "--state-dir", str(self.opts.home / "store"),
                                              "--bucket", broker.DATASET_BUCKET], logs / "store.log")
        self.services.append(svc.start())
        deadline = time.monotonic() + 120
        while "store" not in self.endpoints:
            if svc.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"object store did not start; see {svc.log_path}:\n{svc.tail()}")
            if "bootstrap_servers" in svc.tail():  # its JSON line: weed is up, the bucket exists
                self.endpoints["store"] = f"http://127.0.0.1:{port}"
            time.sleep(0.2)
        return port

    def _start_broker(self, logs: Path) -> str:
        port = free_port()
        mode = "durable" if self.opts.durable_broker else "memory"
        svc = ServiceProcess("broker", [sys.executable, "-m", "tide.broker", "run", mode, "--port",
                                        str(port), "--state-dir", str(self.opts.home / "broker")],
                             logs / "broker.log")
        self.services.append(svc.start())
        deadline = time.monotonic() + 120
        while not _tcp_ready(port):
            if svc.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"broker did not start; see {svc.log_path}:\n{svc.tail()}")
            time.sleep(0.2)
        return f"127.0.0.1:{port}"

    def _start_mlflow(self, logs: Path) -> str:
        port = self.opts.port("mlflow")
        self._run(mlflow_server(self.opts.home / "mlflow", port, logs / "mlflow.log"), timeout_s=180)
        return f"http://127.0.0.1:{port}"

    @property
    def parts(self) -> list[str]:
        """The processes ``start`` launches: the ones this machine and the options allow."""
        return ([] if self.opts.bootstrap_servers else ["broker"]) + ([] if self.opts.tracking_uri else ["MLflow"]) \
            + (["engine"] if self.opts.engines == 1 else [f"{self.opts.engines} engines", "front"]) \
            + ["ingest", "scheduler"] + (["Prometheus"] if self._prometheus_binary() else []) + ["page"]

    def _prometheus_binary(self) -> str | None:
        return prometheus.binary() if self.opts.prometheus else None

    def _start_prometheus(self, logs: Path, ports: dict[str, int]) -> None:
        exe = self._prometheus_binary()
        if exe is None:
            self.endpoints["dashboard"] = ("off (no prometheus binary; scripts/install.sh installs it)"
                                           if self.opts.prometheus else "off")
            return
        try:
            svc, base = prometheus.start(exe, self.opts.home, logs / "prometheus.log",
                                         {f"tide-{name}": f"127.0.0.1:{p}" for name, p in ports.items()},
                                         port=self.opts.port("prometheus"))
        except Exception as exc:  # noqa: BLE001 - the loop runs without its dashboard
            log.warning("prometheus did not start (%s); the dashboard is off", exc)
            self.endpoints["dashboard"] = f"off (prometheus did not start; see {logs / 'prometheus.log'})"
            return
        self.services.append(svc)
        self.endpoints["prometheus"] = base
        self.endpoints["dashboard"] = prometheus.graph_url(base)

    def _start_page(self, logs: Path, conf: list[str], env: dict[str, str], scheduler_port: int) -> None:
        port = self.opts.port("page")
        args = [*conf, "--port", str(port), "--scheduler", f"http://127.0.0.1:{scheduler_port}",
                "--prometheus", self.endpoints.get("prometheus", "")]
        self._run(python_service("page", "tide.services.page", args, logs, env,
                                 f"http://127.0.0.1:{port}/health"))
        self.endpoints["page"] = f"http://127.0.0.1:{port}/"

    def _config(self, bootstrap: str, tracking: str, ports: dict[str, int], token: str) -> dict:
        home = self.opts.home
        data_dir = self.opts.data_dir or (f"s3://{broker.DATASET_BUCKET}/dataset" if self._s3_port
                                          else str(home / "dataset"))
        cfg = {
            "home": str(home),
            "server": {"port": ports["engine"], "control_token": token},
            "kafka": {"bootstrap_servers": bootstrap},  # engine capture and ingest share it
            "capture": {"enabled": True},
            "ingest": {"data_dir": data_dir, "metrics_port": ports["ingest"],
                       **({"storage_options": broker.local_s3_options(self._s3_port)} if self._s3_port else {})},
            # the stack owns its retrains: one left running would report to a stopped MLflow
            # (and, in the demo, compete with the controlled comparison for the CPU)
            "schedule": {"metrics_port": ports["scheduler"], "cancel_on_stop": True},
            "registry": {"tracking_uri": tracking},
            # every alias change goes through the scheduler (the alias owner), whoever asks
            "ops": {"alias_owner_url": f"http://127.0.0.1:{ports['scheduler']}"},
        }
        for section, values in self.opts.overrides.items():
            cfg.setdefault(section, {}).update(values)
        return cfg

    def stop(self) -> None:
        for svc in reversed(self.services):
            svc.stop()
        self.services.clear()

    def describe(self) -> str:
        """The banner: the page and the MLflow UI first (what a user opens), then the rest."""
        first = [("page", self.endpoints.get("page")), ("mlflow UI", self.endpoints.get("mlflow"))]
        rows = [(k, v) for k, v in first if v] + [(k, v) for k, v in self.endpoints.items()
                                                   if k not in ("page", "mlflow")]
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"  {k:<{width}}  {redact_url(v)}" for k, v in rows)  # --tracking-uri may hold a password
