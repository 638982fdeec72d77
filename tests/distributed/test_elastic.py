"""Elastic training through the loss of a node: two launchers as two nodes (one process each, pp=2),
the second one SIGKILLed with its rank after step 12; the first re-forms alone, re-lays the run as
pp=1, resumes from the newest checkpoint and ends with the loss of a run that never failed; with
checkpoint.in_memory_every=1 it resumes from the copies the peer node kept in memory instead, losing no
step. CPU, Gloo."""
from __future__ import annotations

import math

import pytest

from pipedream.checkpoint.memory_folders import memory_root
from tests.support.elastic_harness import JOB, ElasticJob, records, reference_run

STEPS = 30


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return reference_run(tmp_path_factory.mktemp("reference"), ["parallel.pp=1", f"train.steps={STEPS}"])


def test_a_lost_node_leaves_the_other_training_alone_with_the_same_losses(tmp_path, reference):
    job = ElasticJob(tmp_path, ["parallel.pp=2", f"train.steps={STEPS}"])
    killed_at = job.lose_node_after(12)
    summary = job.summary()
    assert math.isclose(summary["final_train_loss"], reference["summary"]["final_train_loss"], rel_tol=1e-5)
    (before, after) = summary["layouts"]
    assert (before["pp"], before["world_size"]) == (2, 2) and (after["pp"], after["world_size"]) == (1, 1)
    assert after["steps"][1] == STEPS and after["steps"][0] % 5 == 1   # resumed after a checkpoint (every 5)
    (recovery,) = summary["recoveries"]
    assert recovery["cause"] == "failure" and recovery["world_size"] == [2, 1]
    assert recovery["resumed_after_step"] >= 10 and 0 < recovery["seconds"] < recovery["first_step_at"] - killed_at + 1
    assert "resume: continuing after step" in job.output(0)
    by_step = {}
    for record in records(job.run_dir):   # the last record of each step: the one the finished run kept
        by_step[record["step"]] = record
    assert {r["layout"]["pp"] for r in by_step.values()} == {1, 2}
    for step, loss in reference["losses"].items():
        assert math.isclose(by_step[step]["loss"], loss, rel_tol=1e-5), step


def test_in_memory_copies_on_the_peer_node_spare_the_steps_since_the_disk_checkpoint(tmp_path, reference):
    job = ElasticJob(tmp_path, ["parallel.pp=2", f"train.steps={STEPS}", "checkpoint.in_memory_every=1"])
    job.lose_node_after(12)
    summary = job.summary()
    (recovery,) = summary["recoveries"]
    # the copies of the step being exchanged when the node died are incomplete: at most that step is redone
    resumed = recovery["resumed_after_step"]
    assert recovery["interrupted_after_step"] - resumed in (0, 1) and resumed % 5   # newer than the disk's
    output = job.output(0)
    assert f"elastic: step {resumed} recovered from in-memory copies on nodes [0]" in output
    assert f"resume: continuing after step {resumed} from" in output
    assert math.isclose(summary["final_train_loss"], reference["summary"]["final_train_loss"], rel_tol=1e-5)
    assert not memory_root(job.run_dir).exists()   # no copy left in host memory after the run


def test_a_run_from_a_plan_file_trains_the_planners_plan_for_the_devices_left(tmp_path, reference):
    """parallel.plan: the launcher plans each world the job may re-form into (1 and 2 nodes) with the
    run's model, the plan's cluster sheet and its global batch; the survivor trains the 1-device plan."""
    from planner.__main__ import main as planner_main

    model = [o for o in JOB if o.startswith("model")]
    plan = tmp_path / "plan.json"
    assert planner_main([*model, "cluster=local_cpu", "cluster.devices_per_node=1", "cluster.nodes=2",
                         "train.global_batch_size=8", f"planner.out={plan}"]) == 0
    job = ElasticJob(tmp_path, [f"parallel.plan={plan}", f"train.steps={STEPS}"])
    job.lose_node_after(8)
    assert "elastic: planned 1 node(s) (1 devices)" in job.output(0)
    summary = job.summary()
    (before, after) = summary["layouts"]
    assert before["world_size"] == 2 and (after["world_size"], after["pp"], after["dp"]) == (1, 1, 1)
    assert math.isclose(summary["final_train_loss"], reference["summary"]["final_train_loss"], rel_tol=1e-5)
