"""schedule=harmony_pp's settings: read into the RunSpec, and every combination it does not run
refused before any process group with one line that names the value and the way out."""
from __future__ import annotations

import pytest

from pipedream.config.loading import compose_config
from pipedream.errors import ConfigError
from pipedream.config.run_spec import build_run_spec
from tests.support.training_harness import TINY_GPT

HARMONY = TINY_GPT + ["schedule=harmony_pp", "parallel.pp=2", "train.grad_clip=0", "model.tie_embeddings=false"]


def spec(extra: list[str], world_size: int = 2):
    return build_run_spec(compose_config(HARMONY + extra), world_size)


def test_defaults_one_layer_per_pack_and_every_microbatch_in_one_group():
    harmony = spec([]).harmony
    config = harmony.config
    assert config.forward_packs == config.backward_packs == tuple((i, i + 1) for i in range(8))
    assert (config.forward_group, config.backward_group, config.devices) == (4, 4, 2)
    assert harmony.device_budget_bytes is None


def test_packs_groups_and_budget_are_read():
    harmony = spec(["schedule.forward_packs=[4,4]", "schedule.backward_packs=[2,2,4]", "schedule.forward_group=2",
                    "schedule.backward_group=1", "memory.device_budget_bytes=400000"]).harmony
    assert harmony.config.forward_packs == ((0, 4), (4, 8))
    assert harmony.config.backward_packs == ((0, 2), (2, 4), (4, 8))
    assert (harmony.config.forward_group, harmony.config.backward_group) == (2, 1)
    assert harmony.device_budget_bytes == 400000


def test_bf16_and_checkpoints_are_accepted():
    assert spec(["precision=bf16"]).precision.name == "bf16"
    assert spec(["checkpoint.every=2", "train.resume=auto"]).checkpoint.every == 2
    assert spec(["train.grad_clip=1.0", "schedule.clip_delays_updates=true"]).harmony.delay_updates
    assert not spec([]).harmony.delay_updates


def test_harmony_dp_runs_the_one_device_configuration_on_each_replica():
    cfg = compose_config([o for o in HARMONY if o != "schedule=harmony_pp"] +
                         ["schedule=harmony_dp", "parallel.pp=1", "parallel.dp=2", "train.grad_clip=1.0"])
    harmony = build_run_spec(cfg, 2).harmony
    assert (harmony.replicas, harmony.config.devices, harmony.config.microbatches) == (2, 1, 2)
    assert harmony.delay_updates   # every update waits for both replicas' gradients: clipping needs nothing more
    assert {t.device for t in harmony.config.tasks} == {0}


@pytest.mark.parametrize("extra, message", [
    (["parallel.pp=2"], "parallel.pp = 2 is not supported with schedule=harmony_dp: set parallel.pp=1"),
    (["parallel.pp=1", "parallel.dp=2", "precision=fp16"], "precision=fp16 is not supported with schedule=harmony_dp"),
])
def test_harmony_dp_refusals(extra, message):
    cfg = compose_config([o for o in HARMONY if o not in ("schedule=harmony_pp", "parallel.pp=2")] +
                         ["schedule=harmony_dp"] + extra)
    with pytest.raises(ConfigError) as info:
        build_run_spec(cfg, 2)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_other_schedules_have_no_harmony_section():
    assert build_run_spec(compose_config(TINY_GPT + ["parallel.pp=2"]), 2).harmony is None


@pytest.mark.parametrize("extra, message", [
    (["train.grad_clip=1.0"], "train.grad_clip = 1.0 without schedule.clip_delays_updates=true is not supported with "
                              "schedule=harmony_pp: set schedule.clip_delays_updates=true"),
    (["schedule.clip_delays_updates=yes"], "schedule.clip_delays_updates = 'yes' must be true or false"),
    (["parallel.pp=1", "parallel.dp=2"], "parallel.dp = 2 is not supported with schedule=harmony_pp: set parallel.dp=1 "
                                         "(every device takes part in one wrap-around pipeline) or use schedule=harmony_dp"),
    (["parallel.pp=1", "parallel.tp=2"], "parallel.tp = 2 is not supported"),
    (["parallel.vpp=2"], "needs schedule=interleaved"),
    (["precision=fp16"], "precision=fp16 is not supported with schedule=harmony_pp: use precision=bf16"),
    (["checkpoint.every=5", "schedule.forward_packs=[8]", "schedule.backward_packs=[8]"],
     "checkpoints with schedule=harmony_pp need at least parallel.pp = 2 backward packs"),
    (["schedule.forward_packs=[4,3]"], "forward_packs = [4, 3] sum to 7 layers but the model has 8"),
    (["schedule.forward_packs=[4,4]", "schedule.backward_packs=[4,2,2]"], "must be the same layers"),
    (["schedule.forward_packs=4"], "must be a list of layers per pack"),
    (["schedule.backward_group=5"], "backward_group = 5 exceeds the 4 micro-batches"),
    (["schedule.forward_group=two"], "must be a number of micro-batches or null"),
    (["memory.device_budget_bytes=0"], "memory.device_budget_bytes = 0 must be a positive number of bytes or null"),
    (["memory.device_budget_bytes=50000"], "memory.device_budget_bytes = 50000 is below the 50816 bytes of weights "
                                           "that task 1 (forward, layers [1, 2))"),
    (["schedule.forward_packs=[4,4]", "schedule.backward_packs=[4,4]", "memory.device_budget_bytes=300000"],
     "bytes of weights and gradients that task 1 (forward+backward, layers [4, 8))"),
])
def test_refusals_are_one_line(extra, message):
    world = 1 if "parallel.pp=1" in extra else 2
    with pytest.raises(ConfigError) as info:
        spec(extra, world)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_resnet_and_its_batchnorm_are_refused():
    cfg = compose_config(["model=resnet50_small", "data=synthetic_images", "schedule=harmony_pp", "parallel.pp=2",
                          "train.grad_clip=0"])
    with pytest.raises(ConfigError, match="model=resnet50 is not supported with schedule=harmony_pp"):
        build_run_spec(cfg, 2)
