"""launcher.bind_cores: the core set of each local rank (auto, false, an explicit list checked in
one line) and the rank side, which pins itself from PIPEDREAM_CORE_SETS before torch starts."""
from __future__ import annotations

import shutil

import pytest
from omegaconf import OmegaConf

from launcher.binding import core_sets, numa_options
from pipedream.errors import ConfigError
from pipedream.runtime import affinity
from pipedream.runtime.affinity import ENV, bind_this_rank, even_sets, format_core_sets, parse_core_sets


def test_auto_gives_each_rank_disjoint_cores_when_there_are_enough():
    assert core_sets("auto", "cpu", 2, [0, 1]) == [(0,), (1,)]
    assert core_sets("auto", "cpu", 2, [0, 1, 2, 3, 4]) == [(0, 1, 2), (3, 4)]
    assert core_sets("auto", "cpu", 4, [0, 1]) is None      # fewer cores than ranks: no binding
    assert core_sets("auto", "cuda", 2, [0, 1]) is None     # GPU ranks: torchrun's NUMA binding, if any
    assert core_sets(False, "cpu", 2, [0, 1]) is None
    assert even_sets([3, 1, 2, 0], 3) == [(0, 1), (2,), (3,)]


def test_an_explicit_list_is_used_as_given():
    assert core_sets(OmegaConf.create([[0, 1], [2]]), "cpu", 2, [0, 1, 2, 3]) == [(0, 1), (2,)]


@pytest.mark.parametrize("setting,message", [
    ([[0]], "launcher.bind_cores=[[0]] has 1 core sets for 2 processes on this node: give one per local rank"),
    ([[0], [7]], "launcher.bind_cores=[[0], [7]]: cores [7] are not available here (cores 0,1)"),
    ([[0], [0]], "launcher.bind_cores=[[0], [0]]: core 0 is in two sets"),
    ([[0], []], "must be auto, false or a list of core lists, one per local rank"),
    ("all", "launcher.bind_cores='all' must be auto, false or a list of core lists"),
    ([["a"], [1]], "must be auto, false or a list of core lists"),
    (True, "launcher.bind_cores=True must be auto, false"),
])
def test_a_bad_setting_is_one_line(setting, message):
    with pytest.raises(ConfigError) as err:
        core_sets(setting, "cpu", 2, [0, 1])
    assert message in str(err.value) and "\n" not in str(err.value)


def test_gpu_ranks_get_numa_binding_only_where_numactl_exists(monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name: "/usr/bin/numactl" if name == "numactl" else None)
    assert numa_options("auto", "cuda") == ["--numa-binding=node"]
    assert numa_options("auto", "cpu") == [] and numa_options(False, "cuda") == []
    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert numa_options("auto", "cuda") == []


def test_a_rank_pins_itself_to_its_local_set(monkeypatch):
    pinned = []
    monkeypatch.setattr(affinity.os, "sched_setaffinity", lambda pid, cores: pinned.append((pid, cores)))
    text = format_core_sets([(0, 1), (2, 3)])
    assert text == "0,1|2,3" and parse_core_sets(text) == [(0, 1), (2, 3)]
    assert bind_this_rank({ENV: text, "LOCAL_RANK": "1"}) == (2, 3) and pinned == [(0, (2, 3))]
    assert bind_this_rank({}) is None and len(pinned) == 1   # plain torchrun: nothing bound
