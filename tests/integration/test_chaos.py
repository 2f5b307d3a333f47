"""The whole local stack under faults (tests/integration/chaos_stack.py, checks in chaos_checks.py): 2 engines of the tiny target
behind the front, 2 ingest replicas, the scheduler (alias owner, local retrains), MLflow and a
durable broker, under steady greedy traffic through the front, with retrains registering and
auto-promoting drafters. Each kind of component is stopped in turn for OUTAGE_S: an engine (SIGKILL,
while requests are in flight on it), an ingest replica (SIGKILL), the scheduler (SIGKILL while a
retrain runs, and down until that retrain has ended: its own auto-promotion finds no alias owner,
so the restarted owner must catch up), MLflow (SIGSTOP: it hangs) and the broker (SIGSTOP: see PLAN),
then restarted or continued. The soak (bench/chaos_soak.py) also kills MLflow and the broker.

Afterwards: every answer is the target's own greedy output, except streams already started on
the engine killed under them (cut with the front's error, traced to that replica by its header);
requests to it were retried by the front and counted; the retrain that ended without its owner
was registered and promoted; within CONVERGE_S of the last recovery every replica serves ``champion`` (engines' own
/health and the owner's fleet view); and every capture chunk the broker acknowledged (the
producer's log) is in the dataset's table exactly once, at the acknowledged offset and positions.
The longer version with several rounds of faults is bench/chaos_soak.py."""
from __future__ import annotations

import signal

import pytest
from chaos_checks import Traffic, classify, retried, solo_outputs, wait_for
from chaos_stack import ChaosStack

OUTAGE_S = 15.0
CONVERGE_S = 60.0  # poll_interval_s 2 + download, validation and smoke decode on two busy cores, with margin
# the broker hangs rather than dies: tansu 0.6 on S3 killed mid-produce can record a batch's offset and
# the producer's sequence without the batch, then acknowledge the resend as a duplicate it does not hold
# (a hole in the partition): a loss inside the broker, which the soak (bench/chaos_soak.py) counts apart
PLAN = [("engine", signal.SIGKILL), ("ingest", signal.SIGKILL), ("scheduler", signal.SIGKILL),
        ("mlflow", signal.SIGSTOP), ("broker", signal.SIGSTOP)]
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]


@pytest.fixture
def chaos(tmp_path):
    from tide import broker

    try:
        broker.find_tansu()
        broker.find_weed()
    except broker.BrokerError as exc:
        pytest.skip(str(exc))
    stack = ChaosStack(tmp_path)
    try:
        yield stack.start()
    finally:
        stack.stop()


def test_faults_of_every_component_lose_no_request_and_no_acknowledged_record(chaos):
    solo = solo_outputs(list(chaos.engine_urls.values()))
    traffic = Traffic(chaos.front_url).start()
    try:
        wait_for(lambda: chaos.table_version() > 0, 120, "ingest's first commit")
        for kind, sig in PLAN:
            if kind != "scheduler":
                fault = chaos.fault(kind, sig, OUTAGE_S)
            else:  # down while a retrain runs and ends: its own auto-promotion finds no owner
                job = wait_for(chaos.job_training, 300, "a retrain to train", interval_s=0.2)
                fault = chaos.fault(kind, sig, OUTAGE_S, until=lambda: chaos.job_exited(job))
                adopted = wait_for(lambda: chaos.finished_job(job), 120, f"the restarted scheduler to record {job}")
                assert adopted.status == "succeeded" and adopted.version, adopted
                assert "auto-promotion failed" in chaos.job_promotion(job).get("reason", ""), chaos.job_promotion(job)
                wait_for(lambda: chaos.auto_promoted(int(adopted.version)), 60,
                         f"version {adopted.version} of the retrain that ended without its owner promoted")
            print(f"{kind} {fault.victim} {fault.sig} for {fault.down_s:.0f} s: healthy {fault.recovery_s:.1f} s after")
        converge_s, state = chaos.wait_converged(CONVERGE_S)
    finally:
        traffic.stop()
    print(f"converged on champion {state['champion']} {converge_s:.1f} s after the last recovery")

    engine_fault = chaos.faults[0]
    before, after = engine_fault.detail["front_counts_before"], engine_fault.detail["front_counts_after"]
    outcome = classify(traffic.results, solo, chaos.faults, chaos.engine_urls)
    print(f"requests {outcome['requests']}: ok {outcome['ok']}, cut {len(outcome['cut'])}, "
          f"failed {len(outcome['failed'])}; front retried {retried(after) - retried(before)} during the engine fault")
    assert not outcome["failed"], outcome["failed"][:5]
    assert retried(after) > retried(before), (before, after)  # requests to the killed engine went elsewhere
    assert after.get("cut", 0) - before.get("cut", 0) == len(outcome["cut"])  # the front counted each cut
    assert after.get("no_backend", 0) == 0

    chaos.drain(180)
    audit = chaos.dataset_audit()
    print({k: (len(v) if isinstance(v, list) else v) for k, v in audit.items()})
    assert audit["acked"] > 0 and audit["acked"] == audit["acked_distinct"]
    assert not audit["missing"], audit["missing"][:5]  # nothing acknowledged is lost ...
    assert not audit["chunks_twice"] and not audit["offsets_twice"]  # ... or stored twice
    assert not audit["moved"] and not audit["gaps"], (audit["moved"][:3], audit["gaps"][:3])
