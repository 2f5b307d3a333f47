"""Traffic generator and live acceptance sampler for the demo (real HTTP against the engine).

``replay`` sends workload prompts to ``/v1/chat/completions`` at a fixed concurrency until the
prompts run out or ``until()`` says stop; every request is checked (status, finish reason) and
counted. ``AcceptanceSampler`` scrapes ``/metrics`` every few seconds (of every engine, summed,
when several serve behind a front) and turns the counter deltas into a time series of tokens
per target forward by drafter version. ``loop_status`` is the
demo's live line: what ingest has made durable and where the scheduler's retrain stands, read
from those services' own ``/metrics``.
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Callable, Iterable

import httpx

from tide.metrics_text import Families, MetricsTextError, by_label, parse
from tide.workloads import Prompt

# answers that refuse the prompt itself (over the engine's prompt or body limits, malformed): the
# engine working as it should on input it cannot serve, counted apart from failures
REFUSED_INPUT = (400, 413, 422)
WAIT_SLICE_S = 0.2  # how often the caller's thread wakes while workers replay (see replay)


@dataclass
class TrafficResult:
    sent: int = 0
    ok: int = 0
    failed: int = 0
    completion_tokens: int = 0
    rejected: int = 0  # prompts the engine refused as bad input (REFUSED_INPUT), with its reason in errors
    errors: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)


def replay(base_url: str, prompts: Iterable[Prompt], concurrency: int, max_tokens: int,
           until: Callable[[], bool] = lambda: False, result: TrafficResult | None = None,
           on_done: Callable[[TrafficResult], None] | None = None, timeout_s: float = 600.0) -> TrafficResult:
    """Send ``prompts`` (endless iterables included) from ``concurrency`` workers until they run out
    or ``until()`` says stop; each worker takes the next prompt only when its last one finished."""
    result = result or TrafficResult()
    client = httpx.Client(base_url=base_url, timeout=timeout_s)
    model = client.get("/health").json().get("target_model", "")
    source = iter(prompts)
    take = threading.Lock()

    def one(p: Prompt) -> None:
        body = {"model": model, "messages": p.chat_messages(), "max_tokens": max_tokens,
                "temperature": 0, "workload": p.workload}
        try:
            resp = client.post("/v1/chat/completions", json=body)
            ok = resp.status_code == 200 and resp.json()["choices"][0]["finish_reason"] in ("stop", "length")
            tokens = resp.json()["usage"]["completion_tokens"] if ok else 0
            err = None if ok else f"{resp.status_code}: {resp.text[:200]}"
            refused = resp.status_code in REFUSED_INPUT
        except (httpx.HTTPError, ValueError, KeyError) as exc:
            ok, tokens, err, refused = False, 0, repr(exc), False
        with result.lock:
            result.sent += 1
            result.ok += ok
            result.rejected += refused
            result.failed += not ok and not refused
            result.completion_tokens += tokens
            if err:
                result.errors.append(err)
        if on_done:
            on_done(result)

    abort = threading.Event()  # one worker failed: the others stop too

    def worker() -> None:
        try:
            while not abort.is_set() and not until():
                with take:  # iterators are not thread-safe
                    p = next(source, None)
                if p is None:
                    return
                one(p)
        except BaseException:
            abort.set()
            raise

    try:
        with ThreadPoolExecutor(concurrency) as pool:
            try:
                pending = {pool.submit(worker) for _ in range(concurrency)}
                while pending:
                    # a bounded wait: a signal (Ctrl-C) the kernel hands to a worker thread runs its
                    # handler in this thread only when this thread next runs, and an unbounded wait
                    # on workers replaying an endless source never returns to run it
                    done, pending = wait(pending, timeout=WAIT_SLICE_S, return_when=FIRST_EXCEPTION)
                    for f in done:
                        f.result()  # a worker's exception (from on_done or until) reaches the caller
            except BaseException:
                abort.set()  # the caller stops (Ctrl-C, a worker's error): every worker ends its request and stops
                raise
    finally:
        client.close()
    return result


def acceptance_counts(families: Families) -> dict[str, tuple[float, float]]:
    """{drafter_version: (sum of committed tokens, drafted target forwards)} from a parsed /metrics page."""
    sums = by_label(families, "tide_engine_accept_length_tokens_sum", "drafter_version")
    counts = by_label(families, "tide_engine_accept_length_tokens_count", "drafter_version")
    return {v: (sums.get(v, 0.0), counts.get(v, 0.0)) for v in set(sums) | set(counts)}


def served_forwards(families: Families) -> dict[str, float]:
    """{drafter_version: target forwards of every row served under it}: drafted rows and the rows
    the scheduler or the workload gate ran target-only alike."""
    return by_label(families, "tide_engine_target_forwards_total", "drafter_version")


@dataclass
class AcceptancePoint:
    t_s: float
    version: str
    tokens_per_forward: float
    forwards: float


class AcceptanceSampler:
    """Background scraper: one point per interval per version whose drafted rows ran target
    forwards in it, and the running count of all target forwards served under each version."""

    def __init__(self, metrics_url: str | list[str], interval_s: float = 5.0):
        self.metrics_urls = [metrics_url] if isinstance(metrics_url, str) else list(metrics_url)
        self.interval_s = interval_s
        self.points: list[AcceptancePoint] = []
        self.marks: list[tuple[float, str]] = []  # (t_s, label): shift, swaps
        self.t0 = time.monotonic()
        self._last: dict[str, tuple[float, float]] = {}
        self._served: list[tuple[float, dict[str, float]]] = []  # (t_s, counters) per scrape
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> "AcceptanceSampler":
        self._thread.start()
        return self

    def mark(self, label: str) -> None:
        self.marks.append((time.monotonic() - self.t0, label))

    def sample(self) -> None:
        try:  # all engines or none: a missing one would read as counters going backwards
            pages = [parse(httpx.get(url, timeout=5).text) for url in self.metrics_urls]
        except (httpx.HTTPError, MetricsTextError):
            return
        now: dict[str, tuple[float, float]] = {}
        served: dict[str, float] = {}
        for page in pages:
            for version, (total, count) in acceptance_counts(page).items():
                was = now.get(version, (0.0, 0.0))
                now[version] = (was[0] + total, was[1] + count)
            for version, forwards in served_forwards(page).items():
                served[version] = served.get(version, 0.0) + forwards
        t = time.monotonic() - self.t0
        self._served.append((t, served))
        for version, (s, c) in now.items():
            ls, lc = self._last.get(version, (0.0, 0.0))
            if c > lc:
                self.points.append(AcceptancePoint(t, version, (s - ls) / (c - lc), c - lc))
        self._last = now

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self.sample()

    def forwards_since(self, start_s: float, version: str) -> float:
        """Target forwards of rows ``version`` drafted since ``start_s`` (as sampled so far)."""
        return sum(p.forwards for p in self.points if p.t_s >= start_s and p.version == version)

    def served_forwards_since(self, start_s: float, version: str) -> float:
        """Target forwards of all rows served under ``version`` since ``start_s``: a workload the
        cost gate runs target-only adds here, not to ``forwards_since``."""
        before = [c.get(version, 0.0) for t, c in self._served if t < start_s]
        last = self._served[-1][1].get(version, 0.0) if self._served else 0.0
        return last - (before[-1] if before else 0.0)

    def recent(self, version: str, window_s: float = 30.0) -> float | None:
        """Tokens per target forward of ``version`` over the last ``window_s`` of samples."""
        end = time.monotonic() - self.t0
        return self.mean_between(end - window_s, end, version)

    def mean_between(self, start_s: float, end_s: float, version: str | None = None) -> float | None:
        pts = [p for p in self.points if start_s <= p.t_s <= end_s and (version is None or p.version == version)]
        forwards = sum(p.forwards for p in pts)
        return sum(p.tokens_per_forward * p.forwards for p in pts) / forwards if forwards else None


def scrape(metrics_url: str, timeout_s: float = 5.0) -> Families:
    """{metric family name: [samples]} of a /metrics page; {} when it cannot be read or parsed."""
    try:
        return parse(httpx.get(metrics_url, timeout=timeout_s).text)
    except (httpx.HTTPError, ValueError):  # a MetricsTextError is a ValueError
        return {}


def metric_value(families: dict[str, list], metric, **labels) -> float | None:
    """Sum of ``metric``'s samples (its ``_total`` for counters) matching ``labels``."""
    name = metric.describe()[0].name
    wanted = {name, f"{name}_total"}
    values = [s.value for s in families.get(name, [])
              if s.name in wanted and all(s.labels.get(k) == v for k, v in labels.items())]
    return sum(values) if values else None


def loop_status(ingest_metrics_url: str, scheduler_metrics_url: str) -> str:
    """'12.3k tokens in Parquet | retrain: waiting 9.1k/16.0k new samples (1 succeeded)', or 'running'."""
    from tide import metrics

    ingest = scrape(ingest_metrics_url)
    sched = scrape(scheduler_metrics_url)
    tokens = metric_value(ingest, metrics.INGEST_TOKENS)
    parts = [f"{tokens / 1000:.1f}k tokens in Parquet" if tokens is not None else "ingest metrics unavailable"]
    if not sched:
        return " | ".join(parts + ["scheduler metrics unavailable"])
    # "2 succeeded (1 with nothing to do), 1 failed": a success that registered no version is one of them
    empty = metric_value(sched, metrics.SCHED_RETRAINS_NOTHING_TO_DO)
    names = {"succeeded": f"succeeded ({int(empty)} with nothing to do)" if empty else "succeeded",
             "failed": "failed", "timed_out": "timed_out"}
    done = {name: metric_value(sched, metrics.SCHED_RETRAINS_FINISHED, outcome=o) for o, name in names.items()}
    done_text = ", ".join(f"{int(v)} {o}" for o, v in done.items() if v)
    if metric_value(sched, metrics.SCHED_RUNNING):
        state = "running"
    else:
        new = metric_value(sched, metrics.SCHED_NEW_SAMPLES)
        need = metric_value(sched, metrics.SCHED_THRESHOLD)
        state = f"waiting {(new or 0) / 1000:.1f}k/{(need or 0) / 1000:.1f}k new samples"
    return " | ".join(parts + [f"retrain: {state}" + (f" ({done_text})" if done_text else "")])
