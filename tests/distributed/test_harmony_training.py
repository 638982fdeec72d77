"""harmony_pp trains like one process: on 1, 2 and 4 devices, GPT and VGG-16, every step's loss
and the final weights equal single-process training (fp32), with a device budget smaller than the
weights plus optimizer state; the swap volume of a step equals the analysis, from the runtime's
counters, and no rank's managed resident bytes ever exceeded the budget."""
from __future__ import annotations

import math

import pytest
import torch

from pipedream.offload import Direction, TensorClass
from tests.support.harmony_harness import harmony_resume_rank, harmony_train_rank, seeded_dropout_reference
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
def test_bf16_and_clipping_match_their_single_process_references(tmp_path):
    """bf16: fp32 host weights, gradients and optimizer state, packs computed under autocast with
    bf16 outputs, stashes and messages; the tolerance of test_mixed_precision's pipelines (the same
    operations on the same tensors), which fp32 training is far outside of. Clipping: every update
    waits for the global norm, and the run equals single-process training with clip_grad_norm_."""
    import torch

    from tests.distributed.test_mixed_precision import TOLERANCE

    overrides = GPT + ["parallel.pp=2", "precision=bf16", "schedule.forward_group=2"]
    clipped = GPT + ["parallel.pp=2", "train.grad_clip=0.5",
                     "schedule.clip_delays_updates=true", "schedule.backward_group=2"]
    per_rank = run_workers(harmony_train_rank, 2, [(overrides, str(tmp_path / "bf16")),
                                                   (overrides + ["precision=fp32"], str(tmp_path / "fp32")),
                                                   (clipped, str(tmp_path / "clipped"))])
    reference = reference_training(clipped)
    assert_matches_reference({"params": merge_params([rank[2] for rank in per_rank]),
                              "losses": per_rank[0][2]["losses"]}, reference)
    unclipped = reference_training(clipped[:-1] + ["train.grad_clip=0"])   # the norm is above 0.5: clipping shows
    assert unclipped["losses"][1] != pytest.approx(reference["losses"][1], rel=1e-3)

    reference = reference_training(overrides)
    torch.testing.assert_close(torch.tensor(per_rank[0][0]["losses"]), torch.tensor(reference["losses"]),
                               rtol=TOLERANCE["loss_rtol"], atol=0)
    params = merge_params([rank[0] for rank in per_rank])
    assert set(params) == set(reference["params"])
    for name, expected in reference["params"].items():
        assert params[name].dtype == torch.float32   # the host's master weights
        torch.testing.assert_close(params[name], expected, rtol=TOLERANCE["rtol"], atol=TOLERANCE["atol"], msg=name)
    fp32 = merge_params([rank[1] for rank in per_rank])
    assert max((fp32[name] - value).abs().max().item() for name, value in reference["params"].items()) \
        > 10 * TOLERANCE["atol"]
    # stashes travel in bf16 (half of fp32's bytes) but layer 0's (int64 token ids); weights and gradients stay fp32
    def step_bytes(index: int, cls: str, direction: str) -> int:
        return sum(r["memory"]["swap_bytes_last_step"][cls][direction] for r in per_rank[0][index]["summary"]["ranks"])

    tokens = MICROBATCHES * 2 * 16 * 8   # micro-batch 2, sequence 16
    assert 2 * (step_bytes(0, "activations", D2H) - tokens) == step_bytes(1, "activations", D2H) - tokens > 0
    for cls, direction in (("weights", H2D), ("gradients", D2H), ("gradients", H2D)):
        assert step_bytes(0, cls, direction) == step_bytes(1, cls, direction)


@pytest.mark.slow
def test_kill_and_resume_equals_the_uninterrupted_run(tmp_path):
    """Host master weights and AdamW's state (on each layer's owner) are checkpointed; a run stopped
    right after its step-2 checkpoint and resumed gives the same losses and weights, bit for bit."""
    import json

    import torch

    overrides = GPT + ["parallel.pp=2", "optim=adamw", "train.lr=3e-3", "train.steps=4", "checkpoint.every=2",
                       "schedule.backward_packs=[2,1,1,1,1,2]", "schedule.forward_packs=[4,2,2]"]
    per_rank = run_workers(harmony_resume_rank, 2, overrides, str(tmp_path), 2)

    def losses(name: str) -> list[float]:
        return [json.loads(line)["loss"] for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]

    assert len(losses("full")) == 4 and losses("resumed") == losses("full")   # steps 1-2, then 3-4 after the resume
    full, resumed = (merge_params([{"params": r[run]} for r in per_rank]) for run in ("full", "resumed"))
    assert set(full) == set(resumed) and len(full) > 0
    for name, value in full.items():
        assert torch.equal(resumed[name], value), name


@pytest.mark.slow
def test_harmony_dp_on_two_devices_matches_single_process(tmp_path):
    """harmony_dp: each device runs every pack over its half of the micro-batches; the layers'
    gradients meet on the host (summed by each layer's owner) and one update follows. With
    AdamW (state on the owners) and with clipping (the norm over the summed gradients)."""
    budget = budget_for(GPT, 0.75)
    dp = [o for o in GPT if o != "schedule=harmony_pp"] + [
        "schedule=harmony_dp", "parallel.pp=1", "parallel.dp=2", f"memory.device_budget_bytes={budget}",
        "schedule.forward_packs=[2,2,2,2]", "schedule.backward_packs=[1,1,2,2,2]"]
    adamw = dp + ["optim=adamw", "train.lr=3e-3", "schedule.backward_group=1"]
    clipped = dp + ["train.grad_clip=0.5"]
    per_rank = run_workers(harmony_train_rank, 2, [(adamw, str(tmp_path / "adamw")),
                                                   (clipped, str(tmp_path / "clipped"))])
    for index, overrides in enumerate((adamw, clipped)):
        merged = merge_params([rank_results[index] for rank_results in per_rank])
        assert_matches_reference({"params": merged, "losses": per_rank[0][index]["losses"]},
                                 reference_training(overrides), atol=1e-5)
        for memory in (r["memory"] for r in per_rank[0][index]["summary"]["ranks"]):
            assert 0 < memory["peak_resident_bytes"] <= budget
            # each device swaps the whole model in for its forward and its backward tasks
            assert memory["swap_bytes_last_step"]["weights"][H2D] > 0


@pytest.mark.slow
def test_dropout_masks_are_replayed_by_the_recompute(tmp_path):
    """Dropout 0.2: every layer forward draws from a seed of (step, micro-batch, layer), so the
    backward task's recompute, on another rank, replays the forward task's masks; harmony_pp on 2
    devices and harmony_dp on 2 equal single-process training under the same seeds, which plain
    single-process training (one RNG stream) is far from."""
    dropout = GPT + ["model.dropout=0.2", "schedule.forward_packs=[3,3,2]", "schedule.backward_packs=[1,2,3,2]"]
    pp = dropout + ["parallel.pp=2"]
    dp = [o for o in dropout if o != "schedule=harmony_pp"] + ["schedule=harmony_dp", "parallel.pp=1", "parallel.dp=2"]
    per_rank = run_workers(harmony_train_rank, 2, [(pp, str(tmp_path / "pp")), (dp, str(tmp_path / "dp"))])
    reference = seeded_dropout_reference(pp)
    for index in range(2):
        merged = merge_params([rank_results[index] for rank_results in per_rank])
        assert_matches_reference({"params": merged, "losses": per_rank[0][index]["losses"]}, reference)
    assert reference_training(pp)["losses"][0] != pytest.approx(reference["losses"][0], rel=1e-3)


@pytest.mark.slow
def test_tied_embeddings_match_single_process(tmp_path):
    """The tie spans the first and the last pack (on different ranks in harmony_pp): both swap in
    one host master copy, whose owner steps it with the sum of both gradients once the iteration's
    backward is over. harmony_pp with AdamW, harmony_dp with clipping."""
    tied = [o for o in GPT if o != "model.tie_embeddings=false"] + ["model.tie_embeddings=true"]
    pp = tied + ["parallel.pp=2", "optim=adamw", "train.lr=3e-3"]
    dp = [o for o in tied if o != "schedule=harmony_pp"] + ["schedule=harmony_dp", "parallel.pp=1", "parallel.dp=2",
                                                            "train.grad_clip=0.5"]
    per_rank = run_workers(harmony_train_rank, 2, [(pp, str(tmp_path / "pp")), (dp, str(tmp_path / "dp"))])
    for index, overrides in enumerate((pp, dp)):
        merged = merge_params([rank_results[index] for rank_results in per_rank])
        reference = reference_training(overrides)
        assert "7.weight" in reference["params"] and "0.wte.weight" in reference["params"]
        assert_matches_reference({"params": merged, "losses": per_rank[0][index]["losses"]}, reference, atol=1e-5)
        assert torch.equal(merged["7.weight"], merged["0.wte.weight"])


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
