"""What Harmony composes with, on two processes in one process group (a module fixture: the runs
share one start-up): bf16, gradient clipping, harmony_dp, tied embeddings, dropout, and a killed
and resumed run. Each equals its single-process reference (fp32 unless bf16; the resume bit for
bit), and each reference is far enough from the plain one that the comparison can fail."""
from __future__ import annotations

import json

import pytest
import torch

from tests.distributed.test_harmony_training import D2H, GPT, H2D, MICROBATCHES, budget_for
from tests.distributed.test_mixed_precision import TOLERANCE
from tests.support.harmony_harness import harmony_train_rank, seeded_dropout_reference
from tests.support.training_harness import assert_matches_reference, merge_params, reference_training
from tests.support.workers import run_workers

PP2 = GPT + ["parallel.pp=2"]
DP2 = [o for o in GPT if o != "schedule=harmony_pp"] + ["schedule=harmony_dp", "parallel.pp=1", "parallel.dp=2"]
PACKS = ["schedule.forward_packs=[2,2,2,2]", "schedule.backward_packs=[1,1,2,2,2]"]
# step 2 traced: each device's forward and backward actions name the micro-batches it ran
TRACED = ["trace.enabled=true", "trace.steps=[2]", "trace.timeline=false"]


def tied(overrides: list[str]) -> list[str]:
    return [o for o in overrides if o != "model.tie_embeddings=false"] + ["model.tie_embeddings=true"]


def dropout(overrides: list[str]) -> list[str]:
    return overrides + ["model.dropout=0.2", "schedule.forward_packs=[3,3,2]", "schedule.backward_packs=[1,2,3,2]"]


RUNS = {
    "bf16": PP2 + ["precision=bf16", "schedule.forward_group=2"],
    "fp32": PP2 + ["schedule.forward_group=2"],   # the bf16 run's scheme and byte baseline
    "clipped": PP2 + ["train.grad_clip=0.5", "schedule.clip_delays_updates=true", "schedule.backward_group=2"],
    "dp_adamw": [o for o in DP2 if not o.startswith("trace.")] + PACKS + TRACED
                + ["optim=adamw", "train.lr=3e-3", "schedule.backward_group=1"],
    "tied_pp": tied(PP2) + ["optim=adamw", "train.lr=3e-3"],
    "tied_dp_clipped": tied(DP2) + ["train.grad_clip=0.5"],
    "dropout_pp": dropout(PP2),
    "dropout_dp": dropout(DP2),
}
# AdamW's step, checkpointed on each layer's owner (the tied head's master copy on the embedding's);
# stopped after step 2 of 4 and resumed
RESUME = tied(PP2) + ["optim=adamw", "train.lr=3e-3", "train.steps=4", "checkpoint.every=2",
                "schedule.forward_packs=[4,2,2]", "schedule.backward_packs=[2,1,1,1,1,2]"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("harmony_features")
    budget = budget_for(GPT, 0.75)   # below the weights plus AdamW's moments: harmony_dp within it
    overrides = {name: o + ([f"memory.device_budget_bytes={budget}"] if name == "dp_adamw" else [])
                 for name, o in RUNS.items()}
    per_rank = run_workers(harmony_train_rank, 2, [(o, str(root / name)) for name, o in overrides.items()],
                           (RESUME, str(root / "resume"), 2), timeout=400)
    results = {name: {"params": merge_params([rank[i] for rank in per_rank]), "losses": per_rank[0][i]["losses"],
                      "summary": per_rank[0][i]["summary"], "overrides": overrides[name], "run_dir": root / name}
               for i, name in enumerate(overrides)}
    results["resume"] = {"root": root / "resume", "ranks": [rank[-1] for rank in per_rank]}
    results["budget"] = budget
    return results


def step_bytes(run: dict, cls: str, direction: str) -> int:
    return sum(r["memory"]["swap_bytes_last_step"][cls][direction] for r in run["summary"]["ranks"])


@pytest.mark.slow
def test_bf16_matches_the_single_process_bf16_scheme(runs):
    """fp32 host weights, gradients and optimizer state, packs under autocast with bf16 outputs,
    stashes and messages: test_mixed_precision's tolerance, which fp32 training is far outside."""
    bf16, fp32 = runs["bf16"], runs["fp32"]
    reference = reference_training(bf16["overrides"])
    torch.testing.assert_close(torch.tensor(bf16["losses"]), torch.tensor(reference["losses"]),
                               rtol=TOLERANCE["loss_rtol"], atol=0)
    assert set(bf16["params"]) == set(reference["params"])
    for name, expected in reference["params"].items():
        assert bf16["params"][name].dtype == torch.float32   # the host's master weights
        torch.testing.assert_close(bf16["params"][name], expected, rtol=TOLERANCE["rtol"], atol=TOLERANCE["atol"],
                                   msg=name)
    assert max((fp32["params"][name] - value).abs().max().item() for name, value in reference["params"].items()) \
        > 10 * TOLERANCE["atol"]
    # stashes travel in bf16 (half of fp32's bytes) but layer 0's (int64 token ids); weights and gradients in fp32
    tokens = MICROBATCHES * 2 * 16 * 8   # micro-batch 2, sequence 16
    assert 2 * (step_bytes(bf16, "activations", D2H) - tokens) == step_bytes(fp32, "activations", D2H) - tokens > 0
    for cls, direction in (("weights", H2D), ("gradients", D2H), ("gradients", H2D)):
        assert step_bytes(bf16, cls, direction) == step_bytes(fp32, cls, direction)


@pytest.mark.slow
def test_clipping_with_delayed_updates_matches_single_process(runs):
    clipped = runs["clipped"]
    reference = reference_training(clipped["overrides"])
    assert_matches_reference(clipped, reference)
    unclipped = reference_training([o for o in clipped["overrides"] if not o.startswith("train.grad_clip")])
    assert unclipped["losses"][1] != pytest.approx(reference["losses"][1], rel=1e-3)   # the norm is above 0.5


def microbatches_run(run_dir) -> dict[tuple[int, str], list[int]]:
    """(rank, "forward" or "backward") -> the micro-batches of that rank's actions in the traced step."""
    events = json.loads((run_dir / "trace" / "trace.json").read_text())["traceEvents"]
    ran: dict[tuple[int, str], set[int]] = {}
    for event in events:
        if event["ph"] == "X" and event["cat"] in ("forward", "backward"):
            ran.setdefault((event["pid"], event["cat"]), set()).add(event["args"]["microbatch"])
    return {key: sorted(microbatches) for key, microbatches in sorted(ran.items())}


@pytest.mark.slow
def test_harmony_dp_matches_single_process(runs):
    """Each device runs every pack over its half of the micro-batches; the layers' gradients
    meet on the host (summed by each layer's owner), then one AdamW update."""
    run = runs["dp_adamw"]
    assert_matches_reference(run, reference_training(run["overrides"]), atol=1e-5)
    # its half, not the whole batch nor none: 4 / 2 micro-batches forward and backward on each device
    half = list(range(MICROBATCHES // 2))
    assert microbatches_run(run["run_dir"]) == {(rank, cat): half for rank in (0, 1) for cat in ("backward", "forward")}
    for memory in (r["memory"] for r in run["summary"]["ranks"]):
        assert 0 < memory["peak_resident_bytes"] <= runs["budget"]
        assert memory["swap_bytes_last_step"]["weights"][H2D] > 0   # every device swaps every pack in


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tied_pp", "tied_dp_clipped"])
def test_tied_embeddings_match_single_process(runs, name):
    """The tie spans the first and the last pack (on different ranks in harmony_pp): both swap in
    one host master copy, whose owner steps it with the sum of both gradients."""
    run = runs[name]
    reference = reference_training(run["overrides"])
    assert "7.weight" in reference["params"] and "0.wte.weight" in reference["params"]
    assert_matches_reference(run, reference, atol=1e-5)
    assert torch.equal(run["params"]["7.weight"], run["params"]["0.wte.weight"])


@pytest.mark.slow
@pytest.mark.parametrize("name", ["dropout_pp", "dropout_dp"])
def test_dropout_masks_are_replayed_by_the_recompute(runs, name):
    """Every layer forward draws from a seed of (step, micro-batch, layer): the backward task's
    recompute replays the forward task's masks on any rank, and the run equals single-process
    training under the same seeds, which plain single-process training (one stream) is far from."""
    run = runs[name]
    reference = seeded_dropout_reference(run["overrides"])
    assert_matches_reference(run, reference)
    torch.manual_seed(0)   # the plain reference draws from the global stream: the same masks every time
    plain = reference_training(run["overrides"])["params"]
    assert max((plain[key] - value).abs().max().item() for key, value in reference["params"].items()) > 1e-4


@pytest.mark.slow
def test_kill_and_resume_equals_the_uninterrupted_run(runs):
    """Host master weights and AdamW's state (on each layer's owner; a tied group's once, by its
    first member's owner) are checkpointed; the run stopped right after its step-2 checkpoint and
    resumed gives the same losses and weights, bit for bit."""
    root = runs["resume"]["root"]

    def losses(name: str) -> list[float]:
        return [json.loads(line)["loss"] for line in (root / name / "metrics.jsonl").read_text().splitlines()]

    assert len(losses("full")) == 4 and losses("resumed") == losses("full")   # steps 1-2, then 3-4 after the resume
    full, resumed = (merge_params([{"params": r[run]} for r in runs["resume"]["ranks"]]) for run in ("full", "resumed"))
    assert set(full) == set(resumed) and "7.weight" in full
    for name, value in full.items():
        assert torch.equal(resumed[name], value), name
