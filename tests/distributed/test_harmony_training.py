"""harmony_pp trains like one process: on 1, 2 and 4 devices, GPT and VGG-16, every step's loss
and the final weights equal single-process training (fp32), with a device budget smaller than the
weights plus optimizer state; the swap volume of a step equals the analysis, from the runtime's
counters, and no rank's managed resident bytes ever exceeded the budget."""
from __future__ import annotations

import math

import pytest

from pipedream.offload import Direction, TensorClass
from tests.support.harmony_harness import harmony_train_rank
from tests.support.training_harness import TINY_GPT, assert_matches_reference, merge_params, reference_training
from tests.support.workers import run_workers

HARMONY = ["schedule=harmony_pp", "train.grad_clip=0", "train.steps=3", "trace.enabled=false"]
SGD = ["optim=sgd", "train.lr=0.05"]
GPT = TINY_GPT + HARMONY + SGD + ["model.tie_embeddings=false"]
VGG = ["model=vgg16_small", "data=synthetic_images", "data.num_samples=64", "train.global_batch_size=8",
       "train.micro_batch_size=2", "train.warmup_steps=1", "train.eval_every=0", "train.eval_batches=1",
       "train.log_every=1", "train.progress=false", "train.timeout_s=60"] + HARMONY + SGD
MICROBATCHES = 4   # 8 / 2 in both
H2D, D2H = Direction.HOST_TO_DEVICE.value, Direction.DEVICE_TO_HOST.value


def weight_bytes(params: dict) -> dict[int, int]:
    """Bytes of each layer's parameters (single-process names are "<layer>.<name>")."""
    sizes: dict[int, int] = {}
    for name, tensor in params.items():
        layer = int(name.split(".")[0])
        sizes[layer] = sizes.get(layer, 0) + tensor.numel() * tensor.element_size()
    return sizes


def expected_weight_swaps(sizes: dict[int, int], last_pack: range, forward_group: int, backward_group: int) -> dict:
    """Harmony-PP's analysis for one step: every pack comes in once per forward group and once per
    backward group, except the shared last pack (forward and backward in one task, once per forward
    group); gradients leave once per backward group and come back for each group after the first.
    With one group each: weights 2|W| - |W_last| in, gradients |W| out (3|W| - |W_last| in all)."""
    total, last = sum(sizes.values()), sum(sizes[i] for i in last_pack)
    f_groups, b_groups = math.ceil(MICROBATCHES / forward_group), math.ceil(MICROBATCHES / backward_group)
    return {"weights_in": f_groups * total + b_groups * (total - last),
            "grads_out": b_groups * (total - last) + f_groups * last,
            "grads_in": (b_groups - 1) * (total - last) + (f_groups - 1) * last}


def check_run(per_rank: list, index: int, overrides: list[str], budget: int, last_pack: range,
              groups: tuple[int, int] = (MICROBATCHES, MICROBATCHES), atol: float = 1e-6) -> None:
    reference = reference_training(overrides)
    merged = merge_params([rank_results[index] for rank_results in per_rank])
    assert_matches_reference({"params": merged, "losses": per_rank[0][index]["losses"]}, reference, atol=atol)
    ranks = [r["memory"] for r in per_rank[0][index]["summary"]["ranks"]]
    for memory in ranks:
        assert memory["device_budget_bytes"] == budget
        assert 0 < memory["peak_resident_bytes"] <= budget
    step = {cls.value: {d.value: sum(m["swap_bytes_last_step"][cls.value][d.value] for m in ranks) for d in Direction}
            for cls in TensorClass}
    expected = expected_weight_swaps(weight_bytes(reference["params"]), last_pack, *groups)
    assert step["weights"][H2D] == expected["weights_in"]
    assert step["weights"][D2H] == 0                       # weights only change on the host tier
    assert step["gradients"][D2H] == expected["grads_out"]
    assert step["gradients"][H2D] == expected["grads_in"]
    assert set(step["optimizer_state"].values()) == {0}   # the update runs where the state lives
    assert step["activations"][H2D] == step["activations"][D2H] > 0   # each stash written once, read once
    devices = len(ranks)   # pack outputs and input gradients go device-to-device, unless one device holds all
    assert (step["activations"][Direction.DEVICE_TO_DEVICE.value] > 0) == (devices > 1)


def budget_for(overrides: list[str], fraction: float) -> int:
    """``fraction`` of the weights' bytes, below 2|W|: under the weights plus the optimizer state
    (SGD's momentum is |W|, AdamW's moments 2|W|), so the model could not sit on one device."""
    assert fraction < 2
    reference = reference_training(overrides[:])
    return int(sum(weight_bytes(reference["params"]).values()) * fraction)


@pytest.mark.slow
def test_one_device_matches_single_process(tmp_path):
    budget = budget_for(GPT, 0.75)
    overrides = GPT + ["parallel.pp=1", f"memory.device_budget_bytes={budget}"]
    per_rank = run_workers(harmony_train_rank, 1, [(overrides, str(tmp_path / "run"))])
    check_run(per_rank, 0, overrides, budget, range(7, 8))


@pytest.mark.slow
def test_two_devices_with_packs_and_groups_match_single_process(tmp_path):
    budget = budget_for(GPT, 0.75)
    packed = GPT + ["parallel.pp=2", f"memory.device_budget_bytes={budget}", "schedule.forward_packs=[2,2,2,2]",
                    "schedule.backward_packs=[1,1,2,2,2]", "schedule.backward_group=2"]
    adamw = GPT + ["parallel.pp=2", f"memory.device_budget_bytes={budget}", "optim=adamw", "train.lr=3e-3",
                   "schedule.forward_group=1"]
    per_rank = run_workers(harmony_train_rank, 2, [(packed, str(tmp_path / "packed")), (adamw, str(tmp_path / "adamw"))])
    check_run(per_rank, 0, packed, budget, range(6, 8), groups=(MICROBATCHES, 2))
    check_run(per_rank, 1, adamw, budget, range(7, 8), groups=(1, MICROBATCHES), atol=1e-5)


@pytest.mark.slow
def test_four_devices_match_single_process(tmp_path):
    budget = budget_for(GPT, 0.75)
    overrides = GPT + ["parallel.pp=4", f"memory.device_budget_bytes={budget}"]
    per_rank = run_workers(harmony_train_rank, 4, [(overrides, str(tmp_path / "run"))], timeout=400)
    check_run(per_rank, 0, overrides, budget, range(7, 8))


@pytest.mark.slow
@pytest.mark.parametrize("devices", [1, 2, 4])
def test_vgg16_matches_single_process(tmp_path, devices):
    budget = budget_for(VGG, 1.9)   # its first classifier layer holds 3/4 of the weights
    overrides = VGG + [f"parallel.pp={devices}", f"memory.device_budget_bytes={budget}"]
    per_rank = run_workers(harmony_train_rank, devices, [(overrides, str(tmp_path / "run"))], timeout=400)
    check_run(per_rank, 0, overrides, budget, range(15, 16))


@pytest.mark.slow
def test_trace_records_swaps_and_updates(tmp_path):
    import json

    traced = GPT + ["parallel.pp=2", "trace.enabled=true", "train.steps=2", "trace.steps=[2]"]
    per_rank = run_workers(harmony_train_rank, 2, [(traced, str(tmp_path / "traced"))])
    events = json.loads((tmp_path / "traced" / "trace" / "trace.json").read_text())["traceEvents"]
    names = {e["name"] for e in events if e.get("ph") == "X"}
    assert {"SI", "SO.1", "F0", "SA0", "B0.7", "U.7", "SO0.14", "SI0.14"} <= names   # swaps, computes, messages, updates
    assert {e["cat"] for e in events if e["name"].startswith(("SI", "SO", "PF"))} == {"swap"}
    assert (tmp_path / "traced" / "trace" / "timeline.png").stat().st_size > 0
    assert per_rank[0][0]["summary"]["trace"] is not None



@pytest.mark.slow
def test_a_budget_that_holds_each_pack_but_not_its_stash_stops_with_one_line(tmp_path):
    """The launcher admits a budget of exactly the largest backward pack's weights and gradients
    (each pack fits); the stash that pack recomputes from does not, so the run stops at that
    allocation with one line and the final-error exit code, never passing the budget."""
    import torch

    from models import build_model
    from pipedream.config.loading import compose_config
    from tests.support.processes import run_cli

    job = ["schedule=harmony_pp", "parallel.pp=2", "train.grad_clip=0", "model.tie_embeddings=false",
           "train.steps=2", "train.progress=false", f"train.run_dir={tmp_path}/run"]
    with torch.device("meta"):
        layers = build_model(compose_config(job).model, seed=0).build()
    budget = 2 * max(sum(p.numel() * p.element_size() for p in layer.parameters()) for layer in layers.values())
    done = run_cli("launcher", job + [f"memory.device_budget_bytes={budget}"], tmp_path)
    assert done.code == 3, done.stderr_lines
    errors = [line for line in done.stderr_lines if line.startswith("error: ")]
    assert any(f"bytes of activations for ('s'," in line and f"exceed the device budget of {budget} bytes; raise "
               f"memory.device_budget_bytes" in line for line in errors), done.stderr_lines
