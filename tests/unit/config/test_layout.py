from __future__ import annotations

import pytest

from pipedream.errors import ConfigError
from pipedream.config.layout import ParallelLayout, split_layers


def test_tp_fastest_then_dp_then_pp():
    layout = ParallelLayout(pp=2, dp=3, tp=2)
    assert layout.world_size == 12
    assert [tuple(layout.coords(r))[:3] for r in range(4)] == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1)]
    assert tuple(layout.coords(6)) == (1, 0, 0, 0)
    for rank in range(12):
        assert layout.rank_of(*layout.coords(rank)) == rank


def test_cp_between_tp_and_dp():
    """Context-parallel peers sit next to tensor-parallel ones; a stage's gradients are averaged
    over its dp x cp ranks, each with its own index among them."""
    layout = ParallelLayout(pp=2, dp=2, tp=2, cp=2)
    assert layout.world_size == 16
    assert [layout.coords(r).cp for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert [layout.coords(r).dp for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert layout.coords(8).pp == 1
    for rank in range(16):
        assert layout.rank_of(*layout.coords(rank)) == rank
    assert layout.stage_replica_count(0) == 4
    assert sorted({layout.replica(r) for r in range(0, 8, 2)}) == [0, 1, 2, 3]
    # the next stage's peer holds the same part of the same samples
    assert layout.peer_rank(2, 0, 0, forward=True) == 10
    assert layout.degrees() == "pp=2 tp=2 cp=2 dp=2"
    assert layout.rank_label(2) == "rank 2 (pp 0, tp 0, cp 1, dp 0)"


def test_virtual_stages_round_robin():
    layout = ParallelLayout(pp=4, vpp=2)
    assert layout.virtual_stage(1, 1) == 5
    assert layout.next_virtual_stage(3, 0) == (0, 1)
    assert layout.prev_virtual_stage(0, 1) == (3, 0)


def test_split_layers():
    assert split_layers(6, 4) == [(0, 2), (2, 4), (4, 5), (5, 6)]
    assert split_layers(6, 2, [1, 5]) == [(0, 1), (1, 6)]
    with pytest.raises(ConfigError, match="fewer than"):
        split_layers(3, 4)
    with pytest.raises(ConfigError, match="at least one layer"):
        split_layers(6, 2, [0, 6])
    with pytest.raises(ConfigError, match="2 entries but there are 3"):
        split_layers(6, 3, [3, 3])


def test_bad_degrees():
    with pytest.raises(ConfigError, match="parallel.dp = 0"):
        ParallelLayout(dp=0)
    with pytest.raises(ConfigError, match="WORLD_SIZE = 2"):
        ParallelLayout(pp=4).check_world_size(2)
