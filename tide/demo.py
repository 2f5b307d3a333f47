"""``tide demo``: the main job — the drafter adapts to a workload shift, on real parts.

Steps:
1. ``tide up`` with demo settings: auto-promotion on, a retrain threshold sized to the run;
2. phase "before": replay the first workload (ShareGPT English chat) through the HTTP API;
3. shift: replay the second workload (code: HumanEval + stdlib prompts); capture → Kafka →
   Parquet feeds the scheduler, which detects the shift from the captured workload mix (and the
   engine's live acceptance) and launches a short retrain on what came since it, with the chat
   as replay; the retrain registers a challenger, auto-promotion makes it champion, the engine
   swaps it in (the first swap); the next retrain, at the full threshold, trains on more of the
   new traffic and replaces it (the final swap); traffic keeps flowing until the final drafter
   has served enough requests and forwards and the dashboard has recorded it (``LoopWatch``, in
   tide/demo_watch.py: each wait is bounded, and a wait that runs out says why in the report);
4. stop everything, then a controlled comparison in one process with nothing else running:
   the same held-out prompts of each workload, target-only vs static drafter vs the first and the
   final adapted drafter;
5. write the report folder: acceptance-over-time PNG (shift and swaps marked) + summary JSON;
6. with ``keep_up``, the stack is not stopped in step 4 (the comparison then shares the CPU with the
   idle stack, and with a retrain should the scheduler launch another) and runs on after the report,
   its page showing the run, until Ctrl-C / SIGTERM.
Every run starts over in ``<home>/demo`` (``fresh_state``): no dataset, registry, broker log or
scheduler state from a previous run, so the static drafter serves first whatever ran before; the
home's caches (converted target, kernel, workload prompts, a locally trained static drafter) are
linked in, not rebuilt. The shift is written to the page's marks file (``<state>/run/marks.jsonl``):
nothing else knows it.
With ``engines`` > 1 the stack runs that many engine processes behind its local front: traffic goes
through the front, the live acceptance sums every engine's counters, and a swap counts once every
engine serves the new drafter (the front reports ``mixed`` while a rollout is under way).
"""
from __future__ import annotations

import dataclasses
import itertools
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from tide import prometheus
from tide.comparison import SERVED_SCHEDULER, comparison, download, load_prompts, say, workload_names
from tide.config import load_config
from tide.demo_watch import LoopWatch, retrains_finished, serving_version
from tide.process import port_or_free
from tide.report import plot_acceptance, speculation_timeline, timeline_lines, write_summary
from tide.schedule.scheduler import default_state_path
from tide.schedule.state import jobs_report
from tide.services import page_data
from tide.stack import DEFAULT_PORTS, Stack, StackOptions
from tide.traffic import AcceptanceSampler, TrafficResult, loop_status, replay


@dataclass(frozen=True)
class DemoSettings:
    before_requests: int = 48
    # after the swap, traffic goes on until the adapted drafter has served this many requests and
    # this many target forwards, and the dashboard has a sample of it (events, not request counts).
    # Served forwards count every row, drafted or not: the demo's engine runs the cost scheduler,
    # which at this concurrency on a small CPU runs most steps target-only (a verify of 6 rows x
    # (1 + drafts) costs several passes over the weights), so drafted forwards, what the live
    # acceptance reading is made of, come slowly: ask only for enough of them to read it
    after_requests: int = 32
    after_min_forwards: int = 1500
    after_min_drafted_forwards: int = 100
    concurrency: int = 6
    max_tokens: int = 64
    # the first retrain triggers once ~100 code requests follow the 48 chat ones: on held-out code
    # the challenger's simulated acceptance grew with the code requests it trained on, while passes
    # saturate (docs/benchmarks.md, "Demo")
    retrain_min_tokens: int = 28_000
    retrain_max_train_tokens: int = 32_000
    retrain_max_s: float = 420.0  # the retrain's training cap (its LR schedule shrinks to fit)
    # prompt-to-prompt spread dominates the comparison's noise: fewer prompts under-measured the
    # ratios by about their own interval's width; the report carries the 90% intervals
    compare_prompts: int = 24
    compare_max_tokens: int = 32
    # bounds on the waits: past one, the demo stops and says which event did not come and why
    swap_timeout_s: float = 20 * 60  # shift -> the engine serves a retrained drafter
    after_timeout_s: float = 5 * 60  # swap -> enough live and dashboard evidence of it
    not_promoted_grace_s: float = 30.0  # a finished retrain's challenger may still be swapping in
    # a challenger the policy refused is not the end of the loop: the next retrain sees more of the
    # new traffic; the demo gives up after this many finished retrains without a swap (or the timeout)
    max_unpromoted_retrains: int = 2
    # the challenger must beat the champion's held-out sim accept length by this fraction to go in
    # (the default policy asks 5%, which a short demo's retrain can fall just short of)
    promote_margin: float = 0.02
    # the scheduler detects the shift from the captured workload mix; its first retrain launches
    # once shift_min_tokens of the new traffic were committed and trains briefly (shift_train:
    # train.* overrides) on what came since the shift, the chat replayed beside it. On a window of a
    # few dozen requests the data decides, not the optimizer steps (bench/retrain_variants.py;
    # docs/benchmarks.md, "Retrain settings on a demo window"), so it waits for more of the new
    # traffic and takes few passes; shorter TTT chains on smaller batches, and it keeps
    # more of its change than the default. Its cap bounds the first swap, not the passes (the swap
    # must come within 3 minutes of the shift)
    shift_min_tokens: int = 11_000
    shift_recent_tokens: int = 2000  # the newest captured tokens whose mix is compared with those before
    shift_reference_tokens: int = 4000
    shift_train: dict = dataclasses.field(default_factory=lambda: {
        "max_train_s": "100", "epochs": "5", "ttt_length": "2", "batch_tokens": "512", "update_fraction": "0.8"})
    # the first swap -> the full-threshold retrain after it has swapped in (or was refused) and its
    # drafter has shown the evidence above; 0: the loop closes on the first swap
    final_timeout_s: float = 20 * 60

    @classmethod
    def quick(cls) -> "DemoSettings":
        # the retrain triggers on 6k tokens of the new traffic (~4k left a minority of code among the
        # training requests, and a challenger no better)
        # the live reading after the swap is a mean over verified rows: a few dozen are too few to
        # compare with the static drafter's, so wait for ~100 (an event, bounded by after_timeout_s)
        return cls(before_requests=8, after_requests=12, after_min_forwards=600, after_min_drafted_forwards=100,
                   concurrency=6,
                   max_tokens=48, retrain_min_tokens=7_500, retrain_max_train_tokens=8_000, retrain_max_s=120.0,
                   compare_prompts=4, compare_max_tokens=32, swap_timeout_s=12 * 60, after_timeout_s=5 * 60,
                   # a handful of held-out requests: a 2% margin on them is within their noise, so the
                   # quick run promotes any challenger that is not worse
                   promote_margin=0.0,
                   # 8 chat requests hold ~1.2k tokens: the mix is read over fewer; the shift's retrain is the
                   # only one (the loop closes on its swap)
                   shift_min_tokens=6_000, shift_recent_tokens=500, shift_reference_tokens=1000,
                   shift_train={"max_train_s": "120"}, final_timeout_s=0)


# what a demo reuses from the home: built once, and the same for every run
SHARED_CACHES = ("models", "kernels", "workloads", "drafters", "train-cache")


def fresh_state(home: Path) -> Path:
    """``<home>/demo``, emptied, with the home's caches linked in: the state a demo runs on."""
    state = home / "demo"
    if state.exists():
        shutil.rmtree(state)  # removes the links, never what they point to
    state.mkdir(parents=True)
    for name in SHARED_CACHES:
        (home / name).mkdir(parents=True, exist_ok=True)  # a first run fills it through the link
        (state / name).symlink_to((home / name).resolve(), target_is_directory=True)
    return state


def run_demo(home: Path, report_dir: Path, settings: DemoSettings, before: str = "chat", after: str = "code",
             bootstrap_servers: str = "", tracking_uri: str = "", ports: dict[str, int] | None = None,
             keep_up: bool = False, engines: int = 1) -> dict:
    t_start = time.monotonic()
    home = fresh_state(home)
    ports = dict(ports or {})
    # the scheduler reads the engine's live acceptance as a second shift signal (one engine: its port)
    ports["engine"] = port_or_free(ports.get("engine") or DEFAULT_PORTS["engine"])
    overrides = {
        "schedule": {"interval_s": 5, "min_new_samples": settings.retrain_min_tokens, "sample_unit": "tokens",
                     "cooldown_s": 60, "backoff_base_s": 10, "shift_min_new_samples": settings.shift_min_tokens,
                     "shift_recent_tokens": settings.shift_recent_tokens,
                     "shift_reference_tokens": settings.shift_reference_tokens,
                     "shift_train": dict(settings.shift_train), "shift_accept_window_s": 60,
                     "shift_accept_min_forwards": 150,
                     "shift_metrics_urls": [f"http://127.0.0.1:{ports['engine']}/metrics"] if engines == 1 else []},
        "train": {"max_train_tokens": settings.retrain_max_train_tokens, "max_train_s": settings.retrain_max_s},
        "ops": {"auto_promote": True, "auto_promote_margin": settings.promote_margin, "poll_interval_s": 3,
                "guard_window_forwards": 100},
        "ingest": {"roll_interval_s": 10},
        # speculation only where it pays, per workload; the report says when it was on or off and why
        "spec": {"scheduler": SERVED_SCHEDULER},
    }
    stack = Stack(StackOptions(home, bootstrap_servers, tracking_uri, overrides=overrides, ports=ports,
                               engines=engines))
    page_data.marks_path(home).unlink(missing_ok=True)  # a previous run's shift is not this one's
    say(f"starting {', '.join(stack.parts)} ...")
    stack.start()
    try:
        if settings.final_timeout_s > 0:  # a full retrain will follow the shift's patch
            _warm_rehearsal(stack)
        summary = _run_loop(stack, home, report_dir, settings, before, after, tracking_uri, t_start, keep_up)
    except BaseException:
        stack.stop()
        raise
    if keep_up:
        _keep_up(stack)
    return summary


def _warm_rehearsal(stack: Stack) -> None:
    """Build the full retrain's rehearsal pool before the traffic (once per home: the cache is shared
    between runs), so the retrain after the shift does not generate it on its share of a core."""
    from tide.config import load_config
    from tide.train.rehearsal import pool_path, rehearsal_pool

    cfg = load_config(stack.config_path, env={})
    if cfg.train.rehearsal_prompts > 0 and not pool_path(cfg).exists():
        say(f"generating the retrains' rehearsal pool ({cfg.train.rehearsal_prompts} {cfg.train.rehearsal_workload} "
            "prompts, once per home) ...")
        rehearsal_pool(cfg)


def _keep_up(stack: Stack) -> None:
    """Leave the stack serving (its page shows the run) until Ctrl-C / SIGTERM (``tide demo``
    turns SIGTERM into KeyboardInterrupt)."""
    try:  # the line a script waits for: a SIGTERM from then on is a clean stop
        say("the stack stays up (--keep-up); Ctrl-C stops it:\n" + stack.describe())
        threading.Event().wait()
    except KeyboardInterrupt:
        say("stopping ...")
    finally:
        stack.stop()


def _run_loop(stack: Stack, home: Path, report_dir: Path, settings: DemoSettings, before: str, after: str,
              tracking_uri: str, t_start: float, keep_up: bool) -> dict:
    say("TIDE is up:\n" + stack.describe())
    url = stack.endpoints["engine"]
    names = workload_names(before, after)  # as people name them: a file by its records' tag or its stem
    static_version = serving_version(url)
    sampler = AcceptanceSampler([f"{u}/metrics" for u in stack.engine_urls], interval_s=5).start()
    summary: dict = {"settings": settings.__dict__, "endpoints": stack.endpoints, "static_version": static_version}
    swaps: list[tuple[float, str]] = []  # (t_s on the sampler's clock, version)
    try:
        before_prompts = load_prompts(before, "heldout", settings.before_requests + settings.compare_prompts, 11)
        after_prompts = load_prompts(after, "train", None, 12)  # cycled: phase 2 ends on events
        printed: dict[int, int] = {}  # per traffic phase: the request count last reported
        printed_lock = threading.Lock()

        def status(res: TrafficResult, version: str) -> None:
            """Every 10 requests: traffic, live acceptance of the serving drafter, capture, retrain."""
            with printed_lock:  # requests finish on several threads: report each tenth once
                if res.sent // 10 <= printed.get(id(res), 0) // 10:
                    return
                printed[id(res)] = sent = res.sent
            live = sampler.recent(version)
            accept = f"{live:.2f} tokens/forward" if live is not None else "-"
            refused = f", {res.rejected} refused as bad input" if res.rejected else ""
            say(f"  {sent} requests, {res.failed} failed{refused} | drafter {version}: {accept} (last 30 s) | "
                 + loop_status(stack.endpoints["ingest metrics"], stack.endpoints["scheduler metrics"]))

        say(f"phase 1: {settings.before_requests} '{names[0]}' requests (drafter {static_version})")
        r1 = replay(url, before_prompts[settings.compare_prompts:], settings.concurrency, settings.max_tokens,
                    on_done=lambda res: status(res, static_version))
        sampler.sample()
        sampler.mark(f"shift to {names[1]}")
        page_data.write_mark(home, "shift", f"shift to {names[1]}")
        t_shift, summary["shift_at_unix_s"] = time.monotonic(), time.time()
        say(f"phase 2: shift to '{names[1]}'; waiting for retrain + swap")
        watch = LoopWatch(stack, sampler, static_version, settings, t_shift)
        r2 = replay(url, itertools.cycle(after_prompts), settings.concurrency, settings.max_tokens,
                    until=watch.done, on_done=lambda res: status(res, watch.on_done()))
        swaps = watch.swaps
        summary["loop"] = watch.outcome()
        say("loop closed: " + watch.evidence() if watch.closed else f"loop NOT closed: {watch.reason}")
        summary["traffic"] = {"before": _traffic(r1), "after": _traffic(r2)}
        summary["retrains_finished"] = retrains_finished(stack)
        summary["registry_versions"] = _versions(stack)
        summary["retrain_s_after_shift"] = swaps[0][0] - (t_shift - sampler.t0) if swaps else None
        summary["shift"] = _scheduler_health(stack).get("shift")  # what the scheduler detected, and when
    finally:
        sampler.stop()
        adapted = serving_version(url) if stack.services else static_version
        summary["speculation"] = _speculation(stack, time.time() - (time.monotonic() - sampler.t0))
        summary["dashboard"] = _dashboard(stack, time.monotonic() - t_start)
        mlflow = stack.endpoints.get("mlflow", tracking_uri)
        adapted_folder = (download(home, mlflow, adapted)
                          if adapted != static_version else None)  # no swap happened: nothing adapted to compare
        first = swaps[0][1] if swaps else adapted
        first_folder = download(home, mlflow, first) if first not in (adapted, static_version) else None
        if not keep_up:
            stack.stop()
    # each retrain: when it ran after the shift, its wall and training time, its share of the machine
    summary["retrains"] = jobs_report(default_state_path(load_config(stack.config_path, env={})),
                                      summary.get("shift_at_unix_s"))
    summary["swaps"] = swaps
    summary["adapted_version"] = adapted
    summary["live"] = _live(sampler, static_version, adapted)
    summary["first_version"] = first
    plot_acceptance(sampler, report_dir / "acceptance.png", f"TIDE demo: '{names[0]}' then '{names[1]}'")
    say("controlled comparison " + ("(the kept-up stack runs beside it: tokens/s are shared) ..." if keep_up
                                     else "(nothing else running) ..."))
    summary["comparison"] = comparison(home, adapted_folder, before, after, settings, first_folder)
    summary["wall_s"] = round(time.monotonic() - t_start, 1)
    write_summary(report_dir / "summary.json", summary)
    say(f"report: {report_dir}/summary.json, {report_dir}/acceptance.png")
    return summary


def _scheduler_health(stack: Stack) -> dict:
    """The scheduler's /health body ({} when it does not answer)."""
    try:
        return httpx.get(stack.endpoints["scheduler metrics"].removesuffix("/metrics") + "/health", timeout=5).json()
    except (httpx.HTTPError, ValueError):
        return {}


def _versions(stack: Stack) -> list[dict]:
    """Registered drafter versions with aliases and held-out metrics (what the retrains produced)."""
    from tide.config import load_config
    from tide.registry import Registry

    cfg = load_config(stack.config_path, env={})
    try:
        return [{"version": v.version, "aliases": v.aliases, "kind": v.kind, "tags": dict(v.tags)}
                for v in Registry.from_config(cfg).list_versions(with_run=False)]
    except Exception as exc:  # reported, not fatal: the report still gets written
        return [{"error": str(exc)}]


def _dashboard(stack: Stack, window_s: float) -> dict:
    """What the operator's dashboard showed: acceptance length by drafter version, as recorded by
    the stack's Prometheus over the run (``dashboards/prometheus-rules.yml``)."""
    base = stack.endpoints.get("prometheus")
    if base is None:
        return {"prometheus": stack.endpoints.get("dashboard", "off")}
    try:
        by_version = prometheus.accept_length_by_version(base, window_s)
    except Exception as exc:  # reported, not fatal: the report still gets written
        return {"prometheus": base, "error": str(exc)}
    return {"prometheus": base, "series": prometheus.ACCEPT_SERIES, "accept_length_by_version": by_version}


def _speculation(stack: Stack, t0_unix: float) -> dict:
    """Per workload, when the serving engine's speculation was on or off and why (its gate's
    changes, timed from traffic start), from the engine's control health view."""
    try:
        body = httpx.get(f"{stack.engine_urls[0]}/control/health", timeout=10,
                         headers={"Authorization": f"Bearer {stack.control_token}"}).json()["engine"]
    except Exception as exc:  # reported, not fatal: the report still gets written
        return {"error": f"{type(exc).__name__}: {exc}"}
    timeline = speculation_timeline(body.get("speculation_events", []), t0_unix)
    say("speculation by workload (seconds from traffic start):\n  " + "\n  ".join(timeline_lines(timeline)))
    return {"scheduler": body.get("scheduler"), "now": body.get("speculation"), "timeline": timeline}


def _traffic(r: TrafficResult) -> dict:
    return {"sent": r.sent, "ok": r.ok, "failed": r.failed, "rejected": r.rejected,
            "completion_tokens": r.completion_tokens, "errors": r.errors[:5]}


def _live(sampler: AcceptanceSampler, static_version: str, adapted: str) -> dict:
    shift_t = next((t for t, label in sampler.marks if label.startswith("shift")), None)
    end = sampler.points[-1].t_s if sampler.points else 0.0
    return {
        "before_shift_static": sampler.mean_between(0, shift_t or 0, static_version),
        "after_shift_static": sampler.mean_between(shift_t or 0, end, static_version),
        "after_shift_adapted": sampler.mean_between(shift_t or 0, end, adapted) if adapted != static_version else None,
        "points": [p.__dict__ for p in sampler.points],
    }
