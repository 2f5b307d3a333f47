"""What the chaos test and soak check (tests/integration/test_chaos.py, bench/chaos_soak.py): the
client's view and the dataset's.

- ``Traffic``: greedy completions through the front from a few clients (every third a stream),
  each answer recorded with the replica that gave it (the front's ``x-tide-replica`` header);
  ``classify`` sorts them into the target's own greedy output, streams cut because their replica
  went away under them (only while that replica was down), and failures;
- ``audit``: the capture chunks the broker acknowledged (the producer's ack log) against the rows
  of the dataset's table: each once, at the acknowledged partition, offset and positions.
"""
from __future__ import annotations

import json
import threading
import time

import httpx

from tide.services.front import REPLICA_HEADER

PROMPTS = ["The quick brown fox", "def fibonacci(n: int)", "Please write a short story", "class Stack:",
           "How do I make a cup of tea?", "import os\nfor name in", "Tell me a joke.", "What is the capital of"]
MAX_TOKENS = 32
REQUEST_TIMEOUT_S = 60.0  # a request still unanswered then has hung


def table_rows(table) -> list[dict]:
    columns = ["request_id", "chunk_index", "chunk_count", "position_start", "num_tokens", "request_num_tokens",
               "kafka_partition", "kafka_offset"]
    return [row for f in table.data_files() for row in table.open_file(f.path).read(columns=columns).to_pylist()]


def audit(acked: list[dict], rows: list[dict]) -> dict:
    """Acknowledged chunks against the table's rows: each acknowledged chunk once, at the offset
    and positions the broker acknowledged; no chunk or offset twice; complete requests contiguous."""
    by_chunk: dict[tuple, list[dict]] = {}
    by_offset: dict[tuple, int] = {}
    for row in rows:
        by_chunk.setdefault((row["request_id"], row["chunk_index"]), []).append(row)
        key = (row["kafka_partition"], row["kafka_offset"])
        by_offset[key] = by_offset.get(key, 0) + 1
    missing, moved = [], []
    for ack in acked:
        found = by_chunk.get((ack["request_id"], ack["chunk_index"]), [])
        # offset -1: the broker acknowledged a resent batch it already held (the idempotent
        # producer's duplicate sequence) without saying where: the partition and positions must match
        where = (ack["partition"], ack["offset"], ack["position_start"], ack["num_tokens"])
        if not found:
            missing.append(ack)
        elif any((r["kafka_partition"], r["kafka_offset"] if ack["offset"] >= 0 else -1, r["position_start"],
                  r["num_tokens"]) != where for r in found):
            moved.append({"ack": ack, "rows": found})
    acked_keys = {(a["request_id"], a["chunk_index"]) for a in acked}
    gaps = []
    for rid in {r["request_id"] for r in rows}:
        chunks = sorted((r for r in rows if r["request_id"] == rid), key=lambda r: r["chunk_index"])
        if len(chunks) == chunks[0]["chunk_count"]:  # complete: its positions follow one another
            ends = [c["position_start"] + c["num_tokens"] for c in chunks]
            if any(c["position_start"] != e for c, e in zip(chunks[1:], ends)) or \
                    ends[-1] - chunks[0]["position_start"] != chunks[0]["request_num_tokens"]:
                gaps.append(rid)
    return {"acked": len(acked), "acked_distinct": len(acked_keys), "rows": len(rows),
            "acked_as_duplicate": sum(1 for a in acked if a["offset"] < 0),
            "missing": missing, "missing_in_topic": [], "moved": moved, "gaps": gaps,
            "chunks_twice": [k for k, v in by_chunk.items() if len(v) > 1],
            "offsets_twice": [k for k, v in by_offset.items() if v > 1],
            "not_acked": len(set(by_chunk) - acked_keys)}


# --- traffic ------------------------------------------------------------------------------------------

def ask(client: httpx.Client, url: str, i: int, stream: bool) -> dict:
    body = {"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": MAX_TOKENS, "temperature": 0, "stream": stream}
    rec = {"prompt": i % len(PROMPTS), "stream": stream, "status": None, "text": "", "done": False,
           "error": None, "replica": None, "t0": time.time(), "t1": None}
    try:
        with client.stream("POST", f"{url}/v1/completions", json=body, timeout=REQUEST_TIMEOUT_S) as resp:
            rec["status"], rec["replica"] = resp.status_code, resp.headers.get(REPLICA_HEADER)
            if not stream or resp.status_code != 200:
                resp.read()
                rec["text"] = resp.json()["choices"][0]["text"] if resp.status_code == 200 else resp.text
                rec["done"] = resp.status_code == 200
            else:
                for line in resp.iter_lines():
                    if line == "data: [DONE]":
                        rec["done"] = True
                    elif line.startswith("data: "):
                        obj = json.loads(line[6:])
                        if "error" in obj:
                            rec["error"] = obj["error"]["message"]
                        else:
                            rec["text"] += obj["choices"][0]["text"]
    except (httpx.HTTPError, ValueError) as exc:  # a timeout is a request that hung to its deadline
        rec["error"] = f"{type(exc).__name__}: {exc}"
    rec["t1"] = time.time()
    return rec


class Traffic:
    """``clients`` threads sending greedy requests (every third a stream) back to back, ``pace_s`` apart."""

    def __init__(self, url: str, clients: int = 4, pace_s: float = 0.2) -> None:
        self.url, self.pace_s = url, pace_s
        self.results: list[dict] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._client, args=(k, clients), daemon=True) for k in range(clients)]

    def _client(self, k: int, clients: int) -> None:
        with httpx.Client() as client:
            i = k
            while not self._stop.is_set():
                self.results.append(ask(client, self.url, i, stream=i % 3 == 0))
                i += clients
                self._stop.wait(self.pace_s)  # the load's rate, not a wait for an event

    def start(self) -> "Traffic":
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(REQUEST_TIMEOUT_S + 10)


def solo_outputs(engine_urls: list[str]) -> dict[int, str]:
    """Each prompt's greedy output, asked of every engine alone; they must agree."""
    with httpx.Client() as client:
        outs = [{i: ask(client, url, i, False)["text"] for i in range(len(PROMPTS))} for url in engine_urls]
    assert all(o == outs[0] for o in outs), outs
    return outs[0]


def classify(results: list[dict], solo: dict[int, str], faults: list, engine_urls: dict[str, str]) -> dict:
    """ok: the solo output; cut: a stream ended with the front's error while its replica was
    down (a started stream cannot be replayed); anything else failed."""
    windows = [(engine_urls[f.victim], f.started_s, f.restarted_s) for f in faults if f.kind == "engine"]
    ok, cut, failed = 0, [], []
    for r in results:
        if r["status"] == 200 and r["done"] and r["text"] == solo[r["prompt"]] and not r["error"]:
            ok += 1
        elif r["stream"] and r["status"] == 200 and "went away" in (r["error"] or "") and any(
                url == r["replica"] and r["t0"] <= start <= r["t1"] for url, start, _ in windows):
            cut.append(r)
        else:
            failed.append(r)
    return {"requests": len(results), "ok": ok, "cut": cut, "failed": failed}


def retried(counts: dict) -> int:
    return sum(v for k, v in counts.items() if k.startswith("retried:"))


def wait_for(predicate, timeout_s: float, what: str, interval_s: float = 0.2):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)  # the polling interval of a bounded wait
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
