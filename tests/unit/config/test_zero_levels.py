"""``optim.distributed``: false | zero1 | zero2 | zero3 (true is zero1); the levels' refusals are one
``ConfigError`` line each, raised while the config is read (no process starts)."""
from __future__ import annotations

import pytest

from pipedream.config.run_spec import build_run_spec
from pipedream.config.specs import OptimSpec, zero_level
from pipedream.errors import ConfigError
from tests.support.training_harness import TINY_GPT, compose_config


@pytest.mark.parametrize("value, level", [(False, 0), (True, 1), ("false", 0), ("true", 1), ("zero1", 1),
                                          ("zero2", 2), ("zero3", 3), ("ZERO3", 3)])
def test_levels_and_the_old_flag(value, level) -> None:
    assert zero_level(value) == level


@pytest.mark.parametrize("value", ["zero4", "yes", 3, 1.0, None])
def test_a_bad_value_is_one_line(value) -> None:
    with pytest.raises(ConfigError) as error:
        zero_level(value)
    message = str(error.value)
    assert "\n" not in message and repr(value) in message and "zero1, zero2 or zero3" in message


def test_distributed_and_zero_agree() -> None:
    common = dict(name="sgd", weight_decay=0.0, fused=True, impl="torch", momentum=0.9)
    assert OptimSpec(**common, distributed=True).zero == 1
    spec = OptimSpec(**common, distributed=False, zero=3)
    assert spec.distributed and spec.zero == 3
    assert not OptimSpec(**common, distributed=False).distributed


def _spec(*overrides: str):
    return build_run_spec(compose_config(TINY_GPT + ["train.steps=2", "parallel.pp=1", *overrides]), 4)


def test_levels_reach_the_spec() -> None:
    assert _spec("parallel.dp=4", "optim.distributed=zero3").optim.zero == 3
    assert _spec("parallel.dp=4", "optim.distributed=true").optim.zero == 1
    assert _spec("parallel.dp=4").optim.zero == 0


@pytest.mark.parametrize("overrides, expected", [
    (["optim.distributed=zero2", "schedule=pipedream", "model.tie_embeddings=false", "parallel.pp=2",
      "parallel.dp=2"], "optim.distributed=zero2 needs a flush schedule"),
    (["optim.distributed=zero3", "schedule=2bw", "model.tie_embeddings=false", "parallel.pp=2", "parallel.dp=2"],
     "optim.distributed=zero3 needs a flush schedule"),
    (["optim.distributed=zero3", "schedule=harmony_pp", "parallel.pp=4", "parallel.dp=1", "train.grad_clip=0"],
     "optim.distributed=zero3 needs a flush schedule"),
    (["optim.distributed=zero2", "optim.reshard_after_forward=true", "parallel.dp=4"],
     "optim.reshard_after_forward=true applies to sharded parameters, not optim.distributed=zero2"),
    (["optim.distributed=zero3", "train.compile=true", "parallel.dp=4"],
     "optim.distributed=zero3 gathers parameters in forward hooks"),
    (["optim.distributed=zero9", "parallel.dp=4"], "optim.distributed = 'zero9' is not a ZeRO level"),
])
def test_refusals_are_one_line(overrides, expected) -> None:
    with pytest.raises(ConfigError) as error:
        _spec(*overrides)
    assert expected in str(error.value) and "\n" not in str(error.value), str(error.value)
