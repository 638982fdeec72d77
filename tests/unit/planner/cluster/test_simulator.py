"""The cluster planner's inputs and simulator: T from the planner, fleets and jobs files, the
synthetic trace, and the discrete-event simulation (planner/cluster/)."""
from __future__ import annotations

import numpy as np
import pytest
import yaml

from pipedream.config.loading import config_dir, config_options
from planner.search.auto import make_plan
from planner.cluster.fleet import Fleet, GpuType, Job, fleet_from_config, load_jobs
from planner.cluster.simulator import simulate
from planner.cluster.throughput import ThroughputTable, server_shape
from planner.cluster.trace import durations_minutes, generate_trace, scale_factors
from planner.config import compose, inputs_from_config
from planner.errors import PlannerError

FLEET = config_dir() / "fleet"


def load_fleet(name: str) -> Fleet:
    return fleet_from_config(yaml.safe_load((FLEET / f"{name}.yaml").read_text()))


@pytest.mark.parametrize("name", config_options("fleet"))
def test_fleet_presets_name_cluster_presets(name):
    fleet = load_fleet(name)
    for gpu in fleet.types:
        assert gpu.preset in config_options("cluster") and gpu.count > 0 and gpu.price_per_hour > 0


def test_the_papers_fleets():
    assert load_fleet("gavel_simulated").counts == [36, 36, 36]
    assert load_fleet("gavel_physical").counts == [8, 16, 24]


def test_server_shape_consolidates():
    assert server_shape(8, 8) == (1, 8)
    assert server_shape(8, 4) == (2, 4)
    assert server_shape(3, 4) == (1, 3)
    assert server_shape(6, 4) == (2, 3)


def test_T_is_the_planners_best_plan():
    """A row of T is the planner's predicted samples/s / batch on the job's GPUs of each type, the
    newer types faster, and 0 where no plan fits."""
    fleet = load_fleet("gavel_simulated")
    table = ThroughputTable(fleet)
    job = Job("a", "gpt_small", 16, 1000, scale_factor=2)
    row = table.row(job)
    for gpu, value in zip(fleet.types, row):
        cfg = compose(["model=gpt_small", f"cluster={gpu.preset}", "cluster.nodes=1", "cluster.devices_per_node=2",
                       "train.global_batch_size=16"])
        plan = make_plan(inputs_from_config(cfg), simulate=False).plan
        assert value == pytest.approx(plan.predicted.samples_per_s / 16)
    assert row[0] > row[1] > row[2] > 0  # V100 > P100 > K80
    big = table.row(Job("b", "gpt_1.7b", 16, 1000, scale_factor=4))
    assert big[2] == 0 and big[0] > 0  # 1.7B on 4 x 12 GB K80s fits no plan; V100s hold it
    assert table.row(Job("c", "gpt_small", 16, 1, 2, throughput={"k80": 5.0}))[2] == 5.0  # measured wins


def test_a_job_that_runs_nowhere_is_one_line():
    table = ThroughputTable(load_fleet("gavel_physical"))
    with pytest.raises(PlannerError, match="runs on no type of gavel_physical"):
        table.row(Job("x", "gpt_1.7b", 16, 1000))
    with pytest.raises(PlannerError, match="throughput names types"):
        table.row(Job("x", "gpt_tiny", 16, 1000, throughput={"tpu": 1.0}))


def test_jobs_file_and_bad_jobs(tmp_path):
    good = tmp_path / "jobs.yaml"
    good.write_text(yaml.safe_dump({"jobs": [{"model": "gpt_tiny", "batch": 16, "steps": 100, "slo_hours": 2},
                                             {"name": "r", "model": "resnet50", "batch": 32, "steps": 5,
                                              "scale_factor": 4, "weight": 2}]}))
    jobs = load_jobs(str(good))
    assert [j.name for j in jobs] == ["job0", "r"] and jobs[1].scale_factor == 4 and jobs[0].slo_hours == 2
    for bad, message in [([{"model": "gpt_tiny", "batch": 0, "steps": 1}], r"jobs\[0\].batch = 0 must be"),
                         ([{"model": "gpt_tiny", "batch": 1}], r"jobs\[0\] has no steps"),
                         ([{"model": "gpt_tiny", "batch": 1, "steps": 1, "gpus": 2}], "unknown keys"),
                         ({"nope": 1}, "holds no list of jobs")]:
        path = tmp_path / "bad.yaml"
        path.write_text(yaml.safe_dump(bad))
        with pytest.raises(PlannerError, match=message):
            load_jobs(str(path))
    with pytest.raises(PlannerError, match="no such file"):
        load_jobs(str(tmp_path / "missing.yaml"))


def test_trace_follows_the_papers_distributions():
    rng = np.random.default_rng(0)
    minutes = durations_minutes(rng, 20000)
    assert minutes.min() >= 10**1.5 * 0.999 and minutes.max() <= 10**4 * 1.001
    assert np.mean(minutes > 1000) == pytest.approx(0.2, abs=0.015)  # x in [3, 4] with probability 0.2
    scales = scale_factors(rng, 20000, multi_gpu=True)
    assert np.mean(scales == 1) == pytest.approx(0.70, abs=0.015)
    assert np.mean((scales >= 2) & (scales <= 4)) == pytest.approx(0.25, abs=0.015)
    assert np.mean(scales == 8) == pytest.approx(0.05, abs=0.01)
    jobs = generate_trace([{"model": "a", "batch": 1}], 4000, 2.0, 1, False, lambda job: 10.0)
    gaps = np.diff([j.arrival_hours for j in jobs])
    assert np.mean(gaps) == pytest.approx(0.5, rel=0.05) and jobs[0].arrival_hours == 0.0
    steps_minutes = np.array([j.steps for j in jobs]) / 10.0 / 60
    assert steps_minutes.min() >= 10**1.5 * 0.999  # steps = minutes on the reference type x its steps/s


def tiny_fleet() -> Fleet:
    return Fleet("tiny", (GpuType("fast", "v100_16gb_x8", 2, 2.0), GpuType("slow", "k80_x8", 2, 0.5)))


def test_simulator_finishes_every_job_no_faster_than_possible():
    rng = np.random.default_rng(4)
    n = 8
    T = rng.uniform(1, 10, (n, 2)) * np.array([3.0, 1.0])
    jobs = [Job(f"j{i}", "m", 1, float(rng.uniform(1e4, 5e4)), arrival_hours=float(i) * 0.5) for i in range(n)]
    for policy in ("max_min_fairness", "fifo", "makespan", "finish_time_fairness", "min_cost"):
        res = simulate(jobs, T, tiny_fleet(), policy, round_s=360, resolve_s=3600)
        fastest_h = np.array([j.steps for j in jobs]) / T.max(axis=1) / 3600
        assert np.all(np.isfinite(res.jct_h))
        assert np.all(res.jct_h >= fastest_h - 1e-9)  # nobody beats its fastest GPU
        assert np.all(res.busy_gpu_h <= res.horizon_h * np.array([2, 2]) + 1e-9)
        assert res.cost == pytest.approx(float(res.busy_gpu_h @ np.array([2.0, 0.5])))


def test_simulator_rounds_track_the_ideal_mechanism():
    """With 6-minute rounds and jobs of hours, Gavel's mechanism ends within a few percent of the
    ideal one that runs every job at exactly its allocation (Fig. 5.15b)."""
    rng = np.random.default_rng(5)
    n = 10
    T = rng.uniform(1, 10, (n, 2)) * np.array([3.0, 1.0])
    jobs = [Job(f"j{i}", "m", 1, float(T[i, 0] * 3600 * rng.uniform(2, 8)), arrival_hours=0.0) for i in range(n)]
    rounds = simulate(jobs, T, tiny_fleet(), "max_min_fairness", mechanism="rounds")
    ideal = simulate(jobs, T, tiny_fleet(), "max_min_fairness", mechanism="ideal")
    assert np.mean(rounds.jct_h) == pytest.approx(np.mean(ideal.jct_h), rel=0.08)


def test_aware_beats_agnostic_on_a_heterogeneous_trace():
    """Two fast and two slow GPUs; jobs 0 and 2 run 10x faster on the fast type, jobs 1 and 3 alike on
    both. Aware: 0 and 2 hold the fast GPUs (1 h each), 1 and 3 the slow ones (10 h). Agnostic:
    every job spreads evenly, so 0 and 2 run at 5.5 steps/s (1.8 h) and 1 and 3 gain nothing."""
    T = np.array([[10.0, 1.0], [1.0, 1.0], [10.0, 1.0], [1.0, 1.0]])
    jobs = [Job(f"j{i}", "m", 1, 36000.0) for i in range(4)]
    aware = simulate(jobs, T, tiny_fleet(), "max_min_fairness", "aware")
    agnostic = simulate(jobs, T, tiny_fleet(), "max_min_fairness", "agnostic")
    np.testing.assert_allclose(aware.jct_h, [1.0, 10.0, 1.0, 10.0], atol=0.1)
    np.testing.assert_allclose(agnostic.jct_h[[0, 2]], 36000 / 5.5 / 3600, rtol=0.05)
    assert np.mean(aware.jct_h) < np.mean(agnostic.jct_h)
