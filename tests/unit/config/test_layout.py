from __future__ import annotations

import pytest

from pipedream.errors import ConfigError
from pipedream.config.layout import ParallelLayout, split_layers


def test_tp_fastest_then_dp_then_pp():
    layout = ParallelLayout(pp=2, dp=3, tp=2)
    assert layout.world_size == 12
    assert [tuple(layout.coords(r)) for r in range(4)] == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1)]
    assert tuple(layout.coords(6)) == (1, 0, 0)
    for rank in range(12):
        assert layout.rank_of(*layout.coords(rank)) == rank


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
