"""``parallel.cp``: the degree reaches the layout (world size pp x tp x cp x dp); what a sequence split
over cp ranks cannot run is refused in one ``ConfigError`` line while the config is read."""
from __future__ import annotations

import pytest

from pipedream.config.run_spec import build_run_spec
from pipedream.errors import ConfigError
from tests.support.training_harness import TINY_GPT, compose_config

BASE = TINY_GPT + ["train.steps=2", "parallel.pp=1", "model.dropout=0"]


def test_the_degree_reaches_the_layout_and_the_world_size() -> None:
    spec = build_run_spec(compose_config(BASE + ["parallel.cp=2", "parallel.dp=2", "parallel.tp=2"]), 8)
    assert (spec.layout.cp, spec.layout.world_size, spec.layout.stage_replica_count(0)) == (2, 8, 4)
    # micro-batches per step do not change: each cp rank takes every sample of its dp rank's share
    assert spec.microbatches == build_run_spec(compose_config(BASE + ["parallel.dp=2"]), 2).microbatches
    with pytest.raises(ConfigError, match=r"parallel.pp\*tp\*cp\*dp = 1\*1\*2\*1 = 2 but WORLD_SIZE = 1"):
        build_run_spec(compose_config(BASE + ["parallel.cp=2"]), 1)


@pytest.mark.parametrize("overrides, rule", [
    (["model.dropout=0.1"], "ring attention has no dropout"),
    (["model.seq_len=18"], "not divisible by 2·parallel.cp = 4"),
    (["model=bert_tiny"], "model=bert has no context-parallel form"),
    (["schedule=harmony_pp", "parallel.pp=2"], "Harmony runs whole sequences per device"),
    (["train.models=2"], "train.models (a fused model set) with parallel.cp=2"),
    (["parallel.cp=0"], "parallel.cp = 0 must be a positive integer"),
])
def test_what_cannot_run_is_refused_in_one_line(overrides, rule) -> None:
    cp = [] if any(o.startswith("parallel.cp=") for o in overrides) else ["parallel.cp=2"]
    with pytest.raises(ConfigError) as error:
        build_run_spec(compose_config(BASE + cp + overrides))
    assert rule in str(error.value) and "\n" not in str(error.value)
