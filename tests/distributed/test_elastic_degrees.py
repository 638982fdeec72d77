"""Elastic training re-lays tensor and data parallelism: a tp=2 or a dp=2 job on two nodes (one
process each) loses its second node after step 7 and continues alone as tp=1 / dp=1, the global
batch kept by gradient accumulation (twice the micro-batches per step), with the losses of a run that
never failed. CPU, Gloo, two launchers as two nodes."""
from __future__ import annotations

import math

import pytest

from tests.support.elastic_harness import ElasticJob, records, reference_run

STEPS = 12


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return reference_run(tmp_path_factory.mktemp("reference"), ["parallel.pp=1", f"train.steps={STEPS}"])


@pytest.mark.parametrize("degree", ["tp", "dp"])
def test_half_the_devices_lost_continue_at_degree_one_with_accumulation(tmp_path, reference, degree):
    job = ElasticJob(tmp_path, ["parallel.pp=1", f"parallel.{degree}=2", f"train.steps={STEPS}"])
    job.lose_node_after(7)
    summary = job.summary()
    before, after = summary["layouts"]
    assert before[degree] == 2 and after[degree] == 1 and after["world_size"] == 1
    assert summary["batch"] == {"global": 8, "micro": 2, "num_microbatches": 4}   # 2 per step per replica before
    by_step = {r["step"]: r for r in records(job.run_dir)}
    for step, loss in reference["losses"].items():
        assert math.isclose(by_step[step]["loss"], loss, rel_tol=1e-5), (step, by_step[step]["layout"])
