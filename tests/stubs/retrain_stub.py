"""A stand-in for ``tide train --online`` with the same command-line and result-file contract.

Used as the scheduler's launched command in tests, so the tests exercise real process handling
(exit codes, result files, process groups, hangs) without training a model. Stdlib only: it
starts in ~50 ms.

Behaviour comes from ``--mode``/``--sleep-s`` or, when given, the JSON ``--control`` file read at
start (so a test can change what the next launch does while the scheduler keeps running):
  ok       sleep, write status "registered", exit 0
  nothing  sleep, write status "nothing_to_do", exit 0
  fail     sleep, write status "failed", exit 3
  noresult sleep, exit 0 without a result file
  hang     start a grandchild in the same process group, ignore SIGTERM, sleep forever
With ``--data-dir`` (a local Delta table) it reads the table's newest version first, as the real job
pins the version it plans its window on, and a successful result reports that version
(``RESULT_DATA_WATERMARK``). A control
``gate`` folder makes that moment a test's choice: the stub waits for ``<gate>/read`` before
reading, writes ``<gate>/was_read`` after, and waits for ``<gate>/finish`` before it ends.
Every start appends one JSON line (pid, job id, time, argv) to ``--launches``: the tests count
real launches from there, independently of the scheduler's own bookkeeping. ``kill_stubs`` is
the tests' cleanup.
"""
import argparse
import json
import os
import signal
import subprocess
import sys
import time

RESULT_DATA_WATERMARK = "data_table_version"  # tide.contracts' key (stdlib only here; a mismatch fails the tests)
GATE_TIMEOUT_S = 60.0  # a test that never opens a gate fails this job instead of hanging it


def _wait_for(path: str) -> None:
    deadline = time.monotonic() + GATE_TIMEOUT_S
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise SystemExit(f"gate {path} never opened")
        time.sleep(0.02)


def read_watermark(data_dir: str) -> int | None:
    """The newest version of the Delta table at ``data_dir`` (None without one): its newest commit file."""
    log = os.path.join(data_dir, "_delta_log")
    try:
        names = os.listdir(log)
    except OSError:
        return None
    versions = [int(n[:-len(".json")]) for n in names if n.endswith(".json") and n[:-len(".json")].isdigit()]
    return max(versions, default=None)


def _read_dataset(data_dir: str | None, gate: str | None) -> float | None:
    if gate:
        _wait_for(os.path.join(gate, "read"))
    watermark = read_watermark(data_dir) if data_dir else None
    if gate:
        with open(os.path.join(gate, "was_read"), "w") as f:
            json.dump({RESULT_DATA_WATERMARK: watermark}, f)
        _wait_for(os.path.join(gate, "finish"))
    return watermark


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--result-json", required=True)
    p.add_argument("--config")
    p.add_argument("--launches")
    p.add_argument("--control")
    p.add_argument("--mode", default="ok")
    p.add_argument("--sleep-s", type=float, default=0.0)
    p.add_argument("--data-dir")
    args = p.parse_args()
    mode, sleep_s, gate = args.mode, args.sleep_s, None
    if args.control and os.path.exists(args.control):
        with open(args.control) as f:
            control = json.load(f)
        mode, sleep_s = control.get("mode", mode), float(control.get("sleep_s", sleep_s))
        gate = control.get("gate")
    grandchild = None
    if mode == "hang":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    if args.launches:
        line = json.dumps({"pid": os.getpid(), "job_id": os.environ.get("TIDE_RETRAIN_JOB_ID"),
                           "t": time.time(), "mode": mode, "config": args.config,
                           "grandchild": grandchild.pid if grandchild else None}) + "\n"
        fd = os.open(args.launches, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.write(fd, line.encode())
        os.close(fd)
    if mode == "hang":
        while True:
            time.sleep(1)
    watermark = _read_dataset(args.data_dir, gate)
    time.sleep(sleep_s)
    status = {"ok": "registered", "nothing": "nothing_to_do", "fail": "failed"}.get(mode)
    if status is not None:
        tmp = args.result_json + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"status": status, "version": "7" if status == "registered" else None,
                       "run_id": "run-abc" if status == "registered" else None,
                       "metrics": {"acceptance_length": 2.5},
                       # like the job: a failure reports no watermark
                       RESULT_DATA_WATERMARK: None if status == "failed" else watermark}, f)
        os.replace(tmp, args.result_json)
    return 3 if mode == "fail" else 0


def kill_stubs(launched, state_path) -> None:
    """SIGKILL stubs (and their grandchildren) still running: the process groups marked with this
    test's state file (also those that had no time to log their start), then each logged pid
    whose command line is still a stub's (a reused pid is never signalled)."""
    from pathlib import Path

    from tide.schedule.local_launcher import LocalLauncher

    for _, handle in LocalLauncher(["x"], None, state_path).find_active():
        try:
            os.killpg(handle["pgid"], signal.SIGKILL)
        except ProcessLookupError:
            pass
    for rec in launched:
        for pid in (rec["pid"], rec.get("grandchild")):
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            except (OSError, TypeError):
                continue
            if b"retrain_stub.py" in cmd or b"time.sleep(600)" in cmd:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


if __name__ == "__main__":
    sys.exit(main())
