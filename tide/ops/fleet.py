"""The fleet view: every engine replica x the drafter version it serves, against ``champion``.

Each replica's drafter follower reports itself to the alias owner at every poll
(``replica_record``): the version it serves and since when, the version its alias names, when it
converged on it, its follower state, and the versions it refused with why (a replica that cannot
load a version keeps serving the old one and says so here). The owner keeps the newest report per
replica (``Fleet``); ``view`` joins them with the champion as the owner reads it, so one table
shows a rollout converging: ``tide drafters fleet`` prints it, the page shows it.
A replica not heard from for three of its report intervals is marked stale (it may be gone).
"""
from __future__ import annotations

import threading
import time

STALE_AFTER_REPORTS = 3


def replica_record(replica: str, serving: str, followed: str | None, state: str, serving_since_s: float | None,
                   converged_at_s: float | None, refused: dict[str, str], last_error: str | None,
                   report_every_s: float) -> dict:
    """What one replica reports (the follower builds it; the owner stores it as sent)."""
    return {"replica": replica, "serving": serving, "followed": followed, "state": state,
            "serving_since_s": serving_since_s, "converged_at_s": converged_at_s, "refused": dict(refused),
            "last_error": last_error, "report_every_s": report_every_s, "reported_at_s": time.time()}


class Fleet:
    """The newest report of each replica, kept by the alias owner (in memory: replicas report again
    within one poll interval after the owner restarts)."""

    def __init__(self, clock=time.time) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._replicas: dict[str, tuple[float, dict]] = {}

    def report(self, record: dict) -> None:
        replica = str(record.get("replica") or "")
        if not replica:
            raise ValueError("a replica report needs 'replica'")
        with self._lock:
            self._replicas[replica] = (self._clock(), dict(record))

    def view(self, champion: int | None, generation: int | None = None) -> dict:
        now = self._clock()
        with self._lock:
            items = sorted(self._replicas.items())
        rows = [_row(name, received_s, record, champion, now) for name, (received_s, record) in items]
        return {"champion": champion, "generation": generation, "replicas": rows,
                "converged": bool(rows) and all(r["converged"] for r in rows if not r["stale"])}


def _row(name: str, received_s: float, record: dict, champion: int | None, now: float) -> dict:
    every_s = float(record.get("report_every_s") or 10.0)
    serving = record.get("serving")
    refused = record.get("refused") or {}
    converged = champion is not None and serving == str(champion)
    why = None
    if not converged and champion is not None:
        why = refused.get(str(champion)) and f"cannot load {champion}: {refused[str(champion)]}"
        why = why or record.get("last_error") or f"{record.get('state')}: not yet on {champion}"
    return {"replica": name, "serving": serving, "followed": record.get("followed"), "state": record.get("state"),
            "converged": converged, "converged_at_s": record.get("converged_at_s") if converged else None,
            "serving_since_s": record.get("serving_since_s"), "why_not": why, "refused": refused,
            "last_report_s_ago": round(now - received_s, 1),
            "stale": now - received_s > STALE_AFTER_REPORTS * every_s}


def _clock(ts: float | None) -> str:
    return time.strftime("%H:%M:%S", time.localtime(ts)) if ts else "-"


def fleet_rows(view: dict) -> list[dict]:
    """Rows for a table (CLI, page): replica, serving, converged when, why not."""
    return [{"replica": r["replica"], "serving": r["serving"] or "-",
             "converged": f"yes, at {_clock(r['converged_at_s'])}" if r["converged"] else "no",
             "serving since": _clock(r["serving_since_s"]),
             "last report": f"{r['last_report_s_ago']:.0f} s ago" + (" (stale)" if r["stale"] else ""),
             "why not": r["why_not"] or ""} for r in view["replicas"]]


def fleet_text(view: dict) -> str:
    head = f"champion {view['champion'] if view['champion'] is not None else '-'} " \
           f"(alias generation {view.get('generation')})"
    rows = fleet_rows(view)
    if not rows:
        return head + "\nno replica has reported yet"
    keys = list(rows[0])
    table = [keys] + [[str(r[k]) for k in keys] for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(keys))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in table]
    return "\n".join([head, *lines])
