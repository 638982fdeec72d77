"""Elastic settings and the layout of a world of another size (pipedream/config/elastic.py), and the
summary's layouts and recoveries as read from the run's record (pipedream/lifecycle/elastic_run.py)."""
from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from pipedream.config.elastic import ElasticSpec, candidate_degrees, check_elastic, layout_for_world
from pipedream.errors import ConfigError
from pipedream.lifecycle.elastic_run import history


def config(**parallel):
    return OmegaConf.create({"parallel": {"pp": 2, "tp": 1, "cp": 1, "dp": 1, "vpp": 1, "layers_per_stage": None,
                                          "plan": None, "stage_replicas": None, "sequence_parallel": False,
                                          **parallel},
                             "schedule": {"name": "1f1b"}, "preemption": {"signal": "USR1"},
                             "launcher": {"nnodes": 2, "min_nodes": 1}})


def test_min_nodes_unset_is_not_elastic():
    cfg = config()
    cfg.launcher.min_nodes = None
    assert not ElasticSpec.from_config(cfg).enabled


@pytest.mark.parametrize("value", [0, 3, "one", True])
def test_min_nodes_outside_one_to_nnodes_is_refused(value):
    cfg = config()
    cfg.launcher.min_nodes = value
    with pytest.raises(ConfigError, match="launcher.min_nodes = .* must be a node count in 1..launcher.nnodes"):
        ElasticSpec.from_config(cfg)


@pytest.mark.parametrize("schedule", ["pipedream", "2bw", "harmony_pp", "harmony_dp"])
def test_schedules_without_an_exact_resume_across_layouts_are_refused(schedule):
    cfg = config()
    cfg.schedule.name = schedule
    with pytest.raises(ConfigError, match=f"schedule={schedule} is refused"):
        check_elastic(cfg)


def test_the_reform_signal_cannot_be_the_preemption_signal():
    cfg = config()
    cfg.preemption.signal = "USR2"
    with pytest.raises(ConfigError, match="preemption.signal=USR2"):
        check_elastic(cfg)


def test_nearest_layouts_keep_model_parallelism_as_large_as_fits():
    assert candidate_degrees(2, 1, 1, 1) == [(1, 1, 1)]
    assert candidate_degrees(1, 2, 1, 1) == [(1, 1, 1)]
    assert candidate_degrees(2, 2, 1, 2)[:2] == [(1, 2, 1), (2, 1, 1)]   # equal size: the tensor degree kept
    assert candidate_degrees(2, 1, 1, 6)[0] == (2, 1, 3)                 # pp kept, dp fills the rest
    assert candidate_degrees(4, 1, 1, 3)[0] == (3, 1, 1)


def test_layout_for_world_takes_the_first_the_run_accepts_and_drops_a_split_of_another_stage_count():
    cfg = config(pp=2, layers_per_stage=[2, 2])
    tried = []

    def accepts(relaid):
        tried.append((relaid.parallel.pp, relaid.parallel.dp))
        if relaid.parallel.pp == 2:
            raise ConfigError("needs more micro-batches")

    relaid = layout_for_world(cfg, 2, accepts)
    assert tried == [(2, 1), (1, 2)] and relaid.parallel.layers_per_stage is None
    assert cfg.parallel.pp == 2   # the original is untouched


def test_no_layout_that_fits_is_one_line_with_every_reason():
    def refuse(relaid):
        raise ConfigError("train.global_batch_size=8 is not divisible")

    with pytest.raises(ConfigError, match=r"no layout of 1 devices .*pp=1 tp=1 dp=1: train.global_batch_size=8"):
        layout_for_world(config(), 1, refuse)


def test_history_gives_each_layout_its_steps_and_each_recovery_its_time():
    layout2 = {"pp": 2, "tp": 1, "cp": 1, "dp": 1, "world_size": 2}
    layout1 = {**layout2, "pp": 1, "world_size": 1}
    events = [{"event": "start", "resumed_after": 0, "time": 0.0, **layout2},
              {"event": "failure", "after_step": 12, "time": 10.0, "rank": 0},
              {"event": "start", "resumed_after": 10, "time": 14.0, **layout1},
              {"event": "first_step", "step": 11, "time": 15.5},
              {"event": "reform", "after_step": 20, "time": 20.0},
              {"event": "start", "resumed_after": 20, "time": 23.0, **layout2},
              {"event": "first_step", "step": 21, "time": 24.0}]
    found = history(events, 30)
    assert [(l["steps"], l["pp"]) for l in found["layouts"]] == [([1, 12], 2), ([11, 20], 1), ([21, 30], 2)]
    lost, joined = found["recoveries"]
    assert (lost["cause"], lost["steps_redone"], lost["seconds"], lost["world_size"]) == ("failure", 2, 5.5, [2, 1])
    assert (joined["cause"], joined["steps_redone"], joined["seconds"]) == ("node joined", 0, 4.0)


def test_an_in_memory_snapshot_counts_only_when_the_nodes_present_hold_every_rank():
    from pipedream.checkpoint.peer_copies import _choose
    survivor = (0, 0, {(12, 2): [0, 1], (10, 2): [0, 1]})   # node 0 holds its own rank's and its peer's copy
    assert _choose([survivor], newest_disk=10) == ((12, 2), {0: [0, 1]})
    assert _choose([survivor], newest_disk=12) is None                  # the disk is as new: nothing to gain
    assert _choose([(0, 0, {(12, 2): [0]})], newest_disk=10) is None   # rank 1's only copy was lost with its node
    both = [(1, 1, {(12, 2): [1, 0]}), (0, 0, {(12, 2): [0, 1]})]
    assert _choose(both, newest_disk=10) == ((12, 2), {0: [0, 1]})     # each copy read once, by the first node
