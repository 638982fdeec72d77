"""Elastic training through a node's loss and return: the second of two nodes is SIGKILLed after step
12, the first continues alone (pp=1), the second is started again, and at the next step boundary the
job checkpoints, re-forms on both nodes (pp=2) and ends with the loss of a run that never failed.
CPU, Gloo, two launchers as two nodes."""
from __future__ import annotations

import math

from pipedream.lifecycle.elastic_run import read_events
from tests.support.elastic_harness import ElasticJob, last_step, reference_run, wait_until

# long enough for the lost node to start again while the survivor trains alone
STEPS = ["train.steps=160"]


def test_a_returning_node_is_taken_back_at_a_step_boundary(tmp_path):
    job = ElasticJob(tmp_path, ["parallel.pp=2", *STEPS])
    try:
        job.start(0)
        job.start(1)
        wait_until(lambda: last_step(job.run_dir) >= 12, 180, "step 12")
        job.kill(1)
        # once the survivor has re-formed alone: a node joining its rendezvous would leave no span of one node
        wait_until(lambda: [e["world_size"] for e in read_events(job.run_dir) if e["event"] == "start"] == [2, 1],
                   120, "the survivor re-formed alone")
        job.start(1)
        assert job.wait(0, 400) == 0, job.output(0)[-3000:]
        assert job.wait(1) == 0, job.output(1)[-3000:]
    finally:
        job.stop()
    reference = reference_run(tmp_path, ["parallel.pp=1", *STEPS])
    summary = job.summary()
    assert [layout["world_size"] for layout in summary["layouts"]] == [2, 1, 2], summary["layouts"]
    assert [layout["pp"] for layout in summary["layouts"]] == [2, 1, 2]
    lost, joined = summary["recoveries"]
    assert lost["cause"] == "failure" and joined["cause"] == "node joined"
    assert joined["steps_redone"] == 0   # the checkpoint was taken at the step boundary it re-formed at
    assert "elastic: a node joined" in job.output(0)
    assert math.isclose(summary["final_train_loss"], reference["summary"]["final_train_loss"], rel_tol=1e-5)
