"""Ingest rate vs the broker's raw consume rate for the same messages, one and two replicas.

Steps:
1. start an in-memory tansu on a free port (or use --bootstrap-servers);
2. produce a backlog of --backlog-mb of capture records (SmolLM2 shape: H=576, bf16, requests of
   100-700 positions, chunked under 900 kB as capture does) into a fresh 4-partition topic;
3. raw consume: a worker process reads every message with plain kafka-python (assign, no group,
   nothing done with the values), once as it comes and once with the ingest process's settings
   (tide/dataset/bulk.py: allocator, socket reads), so the ratio's two sides can be told apart;
4. one replica: a worker process runs the real ``Ingestor`` (group join, decode, Parquet data
   files, Delta commits with application transactions, Kafka commits) into a fresh table (a
   local directory) until its group has committed everything;
5. two replicas: two such workers in one group over the same backlog into one fresh table;
   their combined rate runs from the first one's first batch to the last one's last commit;
6. every worker times from the arrival of its first batch (not counted: a first poll that joins
   the group holds the join's wait) and reports peak RSS (VmHWM); steps 3-5
   alternate for --rounds rounds so load from other processes hits all alike. Results: the
   median ratio one replica / raw (floor 0.8; also given against the raw consume with ingest's
   process settings), two replicas / one with its range over the rounds
   (floor 1.3 on 2 cores with the broker beside them), the ingest peak RSS (floor < 1 GiB). Two over
   one is given end to end (the group's join and rebalance and the durable tail included: fixed
   costs a short backlog makes weigh) and steady (every replica consuming: the throughput a longer
   backlog tends to).
7. where the cores went (Linux /proc, sampled by the parent): the machine's busy cores and the
   broker's over each phase's steady window, CPU-seconds per GB (``cpu_per_gb``), and the steady
   two over one scaled to every core busy (what idle cores cost the ratio, as opposed to the CPU
   the replicas and the broker spend).

    python -m bench.ingest [--backlog-mb 1024] [--json reports/bench/ingest.json]
    python -m bench.ingest --backlog-mb 200       # a short run: the fixed commit tail weighs more
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from bench.cpu import CpuMeter

HIDDEN = 576
MAX_MESSAGE_BYTES = 900_000
PARTITIONS = 4


def _peak_rss_mib() -> float:
    """VmHWM of this process (getrusage's ru_maxrss survives exec: it would report the
    parent's peak)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024.0
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def produce_backlog(bootstrap: str, topic: str, backlog_bytes: int) -> tuple[int, int]:
    """Produce chunked records until ``backlog_bytes`` of values are acked; (messages, bytes)."""
    import numpy as np
    from kafka import KafkaProducer

    from tide.records import Record, encode, split

    rng = np.random.default_rng(0)
    pool = rng.bytes(64 * 1024 * 1024)  # hidden bytes are windows of one random pool
    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all", compression_type="zstd",
                             linger_ms=5, batch_size=1 << 20, max_request_size=2 << 20)
    messages = nbytes = i = 0
    per_token = 4 * HIDDEN * 2
    while nbytes < backlog_bytes:
        t = int(rng.integers(100, 700))
        start = int(rng.integers(0, len(pool) - t * per_token))
        rec = Record(
            request_id=f"bench-{i}", target_model_id="HuggingFaceTB/SmolLM2-135M-Instruct",
            drafter_version="bench", aux_layer_ids=(2, 15, 27), workload=None,
            started_at_s=time.time(), finished_at_s=time.time(), hidden_size=HIDDEN,
            hidden_dtype="bfloat16", token_ids=rng.integers(0, 49152, t).astype(np.int32),
            loss_mask=(np.arange(t) > t // 3).astype(np.uint8),
            aux_hidden=pool[start:start + t * 3 * HIDDEN * 2],
            final_hidden=pool[start:start + t * HIDDEN * 2])
        for chunk in split(rec, MAX_MESSAGE_BYTES):
            value = encode(chunk)
            producer.send(topic, key=rec.request_id.encode(), value=value)
            messages += 1
            nbytes += len(value)
        i += 1
    producer.flush(120)
    producer.close()
    return messages, nbytes


def worker_consume(args: argparse.Namespace) -> dict:
    from kafka import KafkaConsumer, TopicPartition

    from tide.config import IngestConfig

    c = IngestConfig()
    if args.worker == "consume-tuned":
        from tide.dataset.bulk import tune_process

        tune_process(c)
    consumer = KafkaConsumer(bootstrap_servers=args.bootstrap_servers, enable_auto_commit=False,
                             max_poll_records=c.max_poll_records, fetch_max_bytes=c.fetch_max_bytes,
                             max_partition_fetch_bytes=c.max_partition_fetch_bytes)
    parts = consumer.partitions_for_topic(args.topic)
    consumer.assign([TopicPartition(args.topic, p) for p in parts])
    consumer.seek_to_beginning()
    idle_rss = _peak_rss_mib()
    count = nbytes = 0
    first = None
    cpu = time.process_time()
    while count < args.messages:
        batch = consumer.poll(timeout_ms=500)
        for records in batch.values():
            for message in records:
                count += 1
                nbytes += len(message.value) if first is not None else 0
        if batch and first is None:  # timed from the first batch's arrival, which is not counted
            first = time.perf_counter()
    elapsed = time.perf_counter() - first
    cpu = time.process_time() - cpu
    consumer.close()
    return {"messages": count, "bytes": nbytes, "seconds": elapsed, "cpu_seconds": cpu,
            "mb_per_s": nbytes / elapsed / 1e6, "peak_rss_mib": _peak_rss_mib(),
            "rss_after_imports_mib": idle_rss}


def _group_done(consumer, topic: str, ends: dict) -> bool:
    from kafka import TopicPartition

    return all((consumer.committed(TopicPartition(topic, tp.partition)) or 0) >= end for tp, end in ends.items())


def worker_ingest(args: argparse.Namespace) -> dict:
    """One ingest replica of group ``--group``: runs until the whole group has committed the backlog."""
    from kafka import KafkaConsumer, TopicPartition

    from tide import metrics
    from tide.config import IngestConfig, KafkaConfig
    from tide.dataset.bulk import tune_process
    from tide.dataset.ingest import Ingestor

    config = IngestConfig(group_id=args.group, metrics_port=0)
    kafka = KafkaConfig(bootstrap_servers=args.bootstrap_servers, topic=args.topic,
                        dead_letter_topic=args.topic + ".dead-letter")
    tune_process(config)  # as tide/services/ingest.py does
    probe = KafkaConsumer(bootstrap_servers=args.bootstrap_servers, group_id=args.group, enable_auto_commit=False)
    parts = [TopicPartition(args.topic, p) for p in sorted(probe.partitions_for_topic(args.topic))]
    ends = probe.end_offsets(parts)
    ingestor = Ingestor(config, kafka, args.data_dir)
    ingestor.open()
    idle_rss = _peak_rss_mib()
    first = None
    count = polls = 0
    group_checked_s = 0.0
    marks: list[tuple[float, int]] = []  # (after a non-empty poll, messages so far): the steady window
    cpu = time.process_time()
    while True:
        n = ingestor.poll_once()
        count += n
        polls += 1
        if n:
            marks.append((time.time(), count))
        if n == 0 or polls % 10 == 0:
            mine = ingestor.positions()  # all of ours consumed: close commits it (no roll wait)
            if mine and all(p >= ends[tp] for tp, p in mine.items()):
                break
            # partitionless: done once the group is (asked at most every second: a replica polling
            # while it joins is what keeps its join from being dropped, tide/config's join_poll_timeout_s)
            if not mine and n == 0 and time.time() - group_checked_s > 1.0:
                group_checked_s = time.time()
                if _group_done(probe, args.topic, ends):
                    break
    ingestor.close(flush=True)  # commits what is still open (nothing, once the group is done)
    last = time.time()
    cpu = time.process_time() - cpu
    probe.close(autocommit=False)
    # timed from the first batch's arrival (as the raw consume), which is not counted: a first poll
    # that joins the group holds the join's wait
    first, skipped = marks[0] if marks else (last, 0)
    nbytes = args.bytes * (count - skipped) / max(1, args.messages)
    return {"messages": count, "bytes": nbytes, "first_s": first, "first_batch": skipped, "last_s": last,
            "seconds": last - first,
            "cpu_seconds": cpu, "mb_per_s": nbytes / max(1e-9, last - first) / 1e6,
            "peak_rss_mib": _peak_rss_mib(), "rss_after_imports_mib": idle_rss,
            "files": int(metrics.INGEST_FILES._value.get()), "rows": int(metrics.INGEST_ROWS._value.get()),
            "marks": marks}


def _count_at(marks: list, t: float) -> float:
    """Messages a worker had consumed at time t, linear between its polls."""
    before = [(0.0, 0)] + [m for m in marks if m[0] <= t]
    after = [m for m in marks if m[0] > t]
    (t0, c0) = before[-1]
    if not after or len(before) == 1:
        return float(c0 if not after else 0)
    (t1, c1) = after[0]
    return c0 + (c1 - c0) * (t - t0) / (t1 - t0)


def steady_window(workers: list[dict]) -> tuple[float, float]:
    """(start, end): from the last worker's first message to the first one's last."""
    return max(w["marks"][0][0] for w in workers), min(w["marks"][-1][0] for w in workers)


def steady_mb_per_s(workers: list[dict], bytes_per_message: float) -> float:
    """Combined consume rate while every worker was consuming: from the last one's first message to the
    first one's last (a group's join and rebalance before, and the durable tail after, are fixed
    costs the end-to-end rate carries)."""
    start, end = steady_window(workers)
    if end <= start:
        return float("nan")
    messages = sum(_count_at(w["marks"], end) - _count_at(w["marks"], start) for w in workers)
    return messages * bytes_per_message / (end - start) / 1e6


def cpu_per_gb(one: dict, two: dict, gb: float) -> dict:
    """CPU-seconds per GB consumed: the replicas' (whole run), the broker's and the machine's (steady
    window) with one replica and with two. With the broker on the same cores, two replicas run at
    most at cores / (machine's per GB) while one replica is held to one core by its GIL: a cheaper
    replica speeds both up but narrows the gap between them."""
    out = {"replica_one": one["cpu_seconds"] / gb, "replicas_two": sum(w["cpu_seconds"] for w in two["replicas"]) / gb}
    for name, phase in (("one", one), ("two", two)):
        gb_per_s = phase["steady_mb_per_s"] / 1e3
        out[f"broker_{name}"] = phase["broker_cores"] / gb_per_s
        out[f"machine_{name}"] = phase["machine_busy_cores"] / gb_per_s
    return out


def _worker_cmd(kind: str, bootstrap: str, topic: str, messages: int, nbytes: int, data_dir: str,
                group: str = "") -> list[str]:
    return [sys.executable, "-m", "bench.ingest", "--worker", kind, "--bootstrap-servers", bootstrap,
            "--topic", topic, "--messages", str(messages), "--bytes", str(nbytes), "--data-dir", data_dir,
            "--group", group]


def _run_workers(cmds: list[list[str]]) -> list[dict]:
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for cmd in cmds]
    out = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=3600)
        if proc.returncode != 0:
            raise RuntimeError(f"bench worker failed: {stderr[-2000:]}")
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return out


def _run_worker(kind: str, bootstrap: str, topic: str, messages: int, nbytes: int,
                data_dir: str, group: str = "") -> dict:
    return _run_workers([_worker_cmd(kind, bootstrap, topic, messages, nbytes, data_dir, group)])[0]


def _two_replicas(bootstrap: str, topic: str, messages: int, nbytes: int, data_dir: str) -> dict:
    group = f"bench-{uuid.uuid4().hex[:8]}"
    a, b = _run_workers([_worker_cmd("ingest", bootstrap, topic, messages, nbytes, data_dir, group)
                         for _ in range(2)])
    earliest = min((a, b), key=lambda w: w["first_s"])
    seconds = max(a["last_s"], b["last_s"]) - earliest["first_s"]
    counted = nbytes * (messages - earliest["first_batch"]) / messages
    return {"replicas": [a, b], "messages": a["messages"] + b["messages"], "seconds": seconds,
            "mb_per_s": counted / seconds / 1e6, "steady_mb_per_s": steady_mb_per_s([a, b], nbytes / messages),
            "peak_rss_mib": max(a["peak_rss_mib"], b["peak_rss_mib"])}


def _round(r: int, bootstrap: str, topic: str, messages: int, nbytes: int, tmp: str, meter: CpuMeter) -> dict:
    """Raw consume twice, one replica, two replicas; the ratios and where the cores went."""
    raw = _run_worker("consume", bootstrap, topic, messages, nbytes, tmp)
    raw_tuned = _run_worker("consume-tuned", bootstrap, topic, messages, nbytes, tmp)
    one = _run_worker("ingest", bootstrap, topic, messages, nbytes, str(Path(tmp) / f"one-{r}"),
                      f"bench-{uuid.uuid4().hex[:8]}")
    one.update(meter.window(*steady_window([one])))
    shutil.rmtree(Path(tmp) / f"one-{r}", ignore_errors=True)
    two = _two_replicas(bootstrap, topic, messages, nbytes, str(Path(tmp) / f"two-{r}"))
    two.update(meter.window(*steady_window(two["replicas"])))
    shutil.rmtree(Path(tmp) / f"two-{r}", ignore_errors=True)
    assert one["messages"] == messages and two["messages"] >= messages, (one, two)
    one["steady_mb_per_s"] = steady_mb_per_s([one], nbytes / messages)
    return {"raw_consume": raw, "raw_consume_tuned": raw_tuned, "ingest": one, "two_replicas": two,
            "ratio": one["mb_per_s"] / raw["mb_per_s"],
            "ratio_same_settings": one["mb_per_s"] / raw_tuned["mb_per_s"],
            "scale_out": two["mb_per_s"] / one["mb_per_s"],
            "scale_out_steady": two["steady_mb_per_s"] / one["steady_mb_per_s"],
            "cpu_s_per_gb": cpu_per_gb(one, two, nbytes / 1e9),
            # the steady ratio had two replicas kept every core busy: what idle cores cost it
            "scale_out_full_cores": two["steady_mb_per_s"] / one["steady_mb_per_s"]
            * len(os.sched_getaffinity(0)) / two["machine_busy_cores"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backlog-mb", type=float, default=1024.0,
                        help="backlog to ingest (default 1 GB; at 200 MB the fixed durable "
                             "tail, the last files' fsync + commit, weighs ~0.5 s against ~2 s of consuming)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating raw/ingest rounds")
    parser.add_argument("--bootstrap-servers", default="")
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument("--worker", choices=["consume", "consume-tuned", "ingest"], help=argparse.SUPPRESS)
    parser.add_argument("--topic", help=argparse.SUPPRESS)
    parser.add_argument("--messages", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--bytes", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--data-dir", help=argparse.SUPPRESS)
    parser.add_argument("--group", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        result = worker_ingest(args) if args.worker == "ingest" else worker_consume(args)
        print(json.dumps(result))
        return 0

    from bench.report import print_table, write_json
    from tide import broker
    from tide.config import IngestConfig, KafkaConfig
    from tide.dataset.topics import ensure_topics

    with tempfile.TemporaryDirectory(prefix="tide-bench-ingest-") as tmp:
        stack = None
        bootstrap = args.bootstrap_servers
        if not bootstrap:
            stack = broker.BrokerStack("memory", broker.free_port(), Path(tmp) / "broker").start()
            bootstrap = stack.bootstrap_servers
        try:
            topic = f"tide.bench.{uuid.uuid4().hex[:8]}"
            ensure_topics(IngestConfig(topic_partitions=PARTITIONS), KafkaConfig(bootstrap_servers=bootstrap, topic=topic,
                                                      dead_letter_topic=topic + ".dead-letter"))
            t = time.perf_counter()
            messages, nbytes = produce_backlog(bootstrap, topic, int(args.backlog_mb * 1e6))
            produce_s = time.perf_counter() - t
            rounds = []
            with CpuMeter(stack.tansu.pid if stack is not None else None) as meter:
                for r in range(args.rounds):  # alternate, so load from elsewhere hits all alike
                    rounds.append(_round(r, bootstrap, topic, messages, nbytes, tmp, meter))
        finally:
            if stack is not None:
                stack.stop()
    rows = [("", "MB/s", "seconds", "CPU s", "peak RSS MiB", "RSS after start MiB")]
    for r, result in enumerate(rounds):
        for name, key in (("raw consume (kafka-python)", "raw_consume"),
                          ("raw consume, ingest's process settings", "raw_consume_tuned"),
                          ("ingest, 1 replica (Delta)", "ingest")):
            x = result[key]
            rows.append((f"round {r + 1}: {name}", f"{x['mb_per_s']:.1f}", f"{x['seconds']:.1f}",
                         f"{x['cpu_seconds']:.1f}", f"{x['peak_rss_mib']:.0f}", f"{x['rss_after_imports_mib']:.0f}"))
        two = result["two_replicas"]
        rows.append((f"round {r + 1}: ingest, 2 replicas combined", f"{two['mb_per_s']:.1f}", f"{two['seconds']:.1f}",
                     "", f"{two['peak_rss_mib']:.0f}", ""))
        rows.append((f"round {r + 1}: steady MB/s, 1 replica; 2 replicas",
                     f"{result['ingest']['steady_mb_per_s']:.1f}; {two['steady_mb_per_s']:.1f}", "", "", "", ""))
        one, per_gb = result["ingest"], result["cpu_s_per_gb"]
        rows.append((f"round {r + 1}: steady busy cores (machine; broker), 1 replica; 2 replicas",
                     f"{one['machine_busy_cores']:.2f}; {one['broker_cores']:.2f}; {two['machine_busy_cores']:.2f}; "
                     f"{two['broker_cores']:.2f}", "", "", "", ""))
        rows.append((f"round {r + 1}: CPU-s per GB (replicas; broker; machine), 1 replica; 2 replicas",
                     f"{per_gb['replica_one']:.2f}; {per_gb['broker_one']:.2f}; {per_gb['machine_one']:.2f}; "
                     f"{per_gb['replicas_two']:.2f}; {per_gb['broker_two']:.2f}; {per_gb['machine_two']:.2f}",
                     "", "", "", ""))
        rows.append((f"round {r + 1}: 1 replica / raw; / raw same settings; 2 replicas / 1 (end to end; steady)",
                     f"{result['ratio']:.2f}; {result['ratio_same_settings']:.2f}; {result['scale_out']:.2f}; "
                     f"{result['scale_out_steady']:.2f}", "", "", "", ""))
    ratio = statistics.median(r["ratio"] for r in rounds)
    ratio_same = statistics.median(r["ratio_same_settings"] for r in rounds)
    scale = [r["scale_out"] for r in rounds]
    steady = [r["scale_out_steady"] for r in rounds]
    peak = max(max(r["ingest"]["peak_rss_mib"], r["two_replicas"]["peak_rss_mib"]) for r in rounds)
    rows.append(("median 1 replica / raw (floor 0.8)", f"{ratio:.2f}", "", "", "", ""))
    rows.append(("median 1 replica / raw with ingest's process settings", f"{ratio_same:.2f}", "", "", "", ""))
    rows.append(("2 replicas / 1, end to end: median [min, max] (floor 1.3)",
                 f"{statistics.median(scale):.2f} [{min(scale):.2f}, {max(scale):.2f}]", "", "", "", ""))
    rows.append(("2 replicas / 1, steady: median [min, max] (floor 1.3)",
                 f"{statistics.median(steady):.2f} [{min(steady):.2f}, {max(steady):.2f}]", "", "", "", ""))
    full = [r["scale_out_full_cores"] for r in rounds]
    rows.append((f"2 replicas / 1, steady, had two replicas kept all {len(os.sched_getaffinity(0))} cores busy: median",
                 f"{statistics.median(full):.2f} [{min(full):.2f}, {max(full):.2f}]", "", "", "", ""))
    rows.append(("ingest peak RSS (floor < 1024 MiB at 1 GB)", f"{peak:.0f}", "", "", "", ""))
    print_table(f"Ingest vs raw consume: {messages} messages, {nbytes / 1e6:.0f} MB backlog on {PARTITIONS} partitions "
                f"(produced in {produce_s:.1f} s), {args.rounds} alternating rounds", rows)
    write_json(args.json, {"backlog_bytes": nbytes, "messages": messages, "rounds": rounds,
                           "median_ratio": ratio, "median_ratio_same_settings": ratio_same,
                           "scale_out_median": statistics.median(scale),
                           "scale_out_range": [min(scale), max(scale)],
                           "scale_out_steady_median": statistics.median(steady),
                           "scale_out_steady_range": [min(steady), max(steady)], "ingest_peak_rss_mib": peak,
                           "scale_out_full_cores_median": statistics.median(full),
                           "floors": {"ratio": 0.8, "scale_out": 1.3, "peak_rss_mib_at_1gb": 1024}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
