"""Context parallelism (``parallel.cp``) inside the pipeline runtime: every sequence split over cp
ranks in zigzag chunks trains exactly like single-process training of whole sequences (fp32;
gpt_tiny and llama_tiny at seq_len 128), with pp (1f1b and zbv), tp with sequence parallelism, dp,
ZeRO-2 and ZeRO-3 over the dp x cp ranks, clipping, full and selective recomputation, and in bf16
close to the bf16 scheme; 2BW at cp = 2 makes the updates 2BW makes at cp = 1; each rank stashes about half the activations of cp = 1 at the same
global batch; a cp = 2 checkpoint resumes at cp = 1."""
from __future__ import annotations

import pytest
import torch

from tests.support.checkpoint_harness import losses_across_resume, train_full, train_interrupted
from tests.support.stash_checks import stash_bytes_per_microbatch
from tests.support.training_harness import TINY_GPT, assert_matches_reference, merge_params, reference_training, train_rank
from tests.support.workers import run_workers

SEQ = ["model.seq_len=128", "model.dropout=0"]
# SGD, as the other equality tests: AdamW divides each gradient by its own root mean square, so a
# near-zero one's last-bit rounding (summation order) becomes a visible step
GPT = TINY_GPT + SEQ + ["train.steps=3", "train.grad_clip=0.5", "optim=sgd", "train.lr=0.05"]
LLAMA = ["model=llama_tiny", "model.num_layers=4", "model.hidden_size=32", "model.num_heads=4",
         "model.num_kv_heads=2", "model.ffn_hidden_size=64", "model.seq_len=128",
         *[o for o in GPT if o.startswith(("train.", "optim="))]]
PP2_CP2 = ["parallel.pp=2", "parallel.cp=2"]
RUNS = {   # on 4 ranks; each compared with single-process training of the whole sequences
    "gpt_pp2_cp2_1f1b": GPT + PP2_CP2 + ["schedule=1f1b"],
    "gpt_pp2_cp2_zbv": GPT + PP2_CP2 + ["schedule=zbv"],
    "gpt_pp2_cp2_selective": GPT + PP2_CP2 + ["recompute.granularity=selective"],
    "gpt_pp2_cp2_full": GPT + PP2_CP2 + ["recompute.granularity=full"],
    "gpt_pp1_cp2_dp2": GPT + ["parallel.pp=1", "parallel.cp=2", "parallel.dp=2"],
    "gpt_pp1_cp4_untied": GPT + ["parallel.pp=1", "parallel.cp=4", "model.tie_embeddings=false"],
    "llama_pp2_cp2_1f1b": LLAMA + PP2_CP2,
    "gpt_tp2_cp2_sequence_parallel": GPT + ["parallel.pp=1", "parallel.tp=2", "parallel.cp=2",
                                            "parallel.sequence_parallel=true"],
    "llama_tp2_cp2_sequence_parallel": LLAMA + ["parallel.pp=1", "parallel.tp=2", "parallel.cp=2",
                                                "parallel.sequence_parallel=true"],
    "gpt_cp2_dp2_zero3": GPT + ["parallel.pp=1", "parallel.cp=2", "parallel.dp=2", "optim.distributed=zero3"],
    "gpt_pp2_cp2_zero2_zbv": GPT + PP2_CP2 + ["schedule=zbv", "optim.distributed=zero2"],
}
# the asynchronous schedules: no single-process training to equal, so cp = 2 must keep cp = 1's updates
TWO_BW = GPT + ["parallel.pp=2", "schedule=2bw", "train.steps=4", "model.tie_embeddings=false"]
STASH_BASELINE = GPT + ["parallel.pp=2", "parallel.dp=2"]   # cp = 1 at the same global batch and layout size
BF16 = LLAMA + PP2_CP2 + ["precision=bf16"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[list[str], list[list[dict]]]:
    root = tmp_path_factory.mktemp("cp")
    names = [*RUNS, "stash_baseline", "bf16", "2bw_cp2"]
    overrides = [*RUNS.values(), STASH_BASELINE, BF16, TWO_BW + ["parallel.cp=2"]]
    per_rank = run_workers(train_rank, 4, [(o, str(root / n)) for n, o in zip(names, overrides)], timeout=600)
    return names, per_rank


def result_of(trained, name: str) -> dict:
    names, per_rank = trained
    index = names.index(name)
    return {"params": merge_params([rank_results[index] for rank_results in per_rank]),
            "losses": per_rank[0][index]["losses"], "summary": per_rank[0][index]["summary"]}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RUNS))
def test_context_parallel_matches_single_process(trained, name):
    assert_matches_reference(result_of(trained, name), reference_training(RUNS[name]))


@pytest.mark.slow
def test_context_parallel_in_bf16_matches_the_bf16_scheme(trained):
    """The ring's matmuls run in float32 where the reference's attention runs in bf16, so the run is
    not bitwise the reference (half of the bf16 rounding is the attention's): its weights must be
    clearly closer to bf16 training than fp32 training's are."""
    result, bf16 = result_of(trained, "bf16"), reference_training(BF16)
    fp32 = reference_training([o for o in BF16 if o != "precision=bf16"])

    def distance(a: dict, b: dict) -> float:
        return max((a[name] - b[name]).abs().max().item() for name in b)

    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(bf16["losses"]), rtol=1e-4, atol=0)
    assert distance(result["params"], bf16["params"]) < 0.75 * distance(fp32["params"], bf16["params"])


@pytest.mark.slow
def test_2bw_at_cp2_makes_the_updates_of_cp1(trained, tmp_path):
    per_rank = run_workers(train_rank, 2, [(TWO_BW, str(tmp_path / "2bw_cp1"))], timeout=300)
    cp1 = {"params": merge_params([r[0] for r in per_rank]), "losses": per_rank[0][0]["losses"]}
    cp2 = result_of(trained, "2bw_cp2")
    torch.testing.assert_close(torch.tensor(cp2["losses"]), torch.tensor(cp1["losses"]), rtol=1e-5, atol=0)
    assert cp1["params"].keys() == cp2["params"].keys()
    for name, value in cp1["params"].items():
        torch.testing.assert_close(cp2["params"][name], value, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.slow
def test_each_rank_stashes_about_half_of_cp1(trained):
    cp2 = stash_bytes_per_microbatch(result_of(trained, "gpt_pp2_cp2_1f1b"))
    cp1 = stash_bytes_per_microbatch(result_of(trained, "stash_baseline"))
    ranks = result_of(trained, "gpt_pp2_cp2_1f1b")["summary"]["ranks"]
    baseline_ranks = result_of(trained, "stash_baseline")["summary"]["ranks"]
    for rank, (mine, baseline) in enumerate(zip(cp2, cp1)):
        assert 0 < mine <= 0.55 * baseline, f"rank {rank}: {mine} vs {baseline} bytes per micro-batch"
        # the same peak count of micro-batches in flight (1F1B), so the peaks keep the ratio
        assert ranks[rank]["peak_stash_bytes"] <= 0.55 * baseline_ranks[rank]["peak_stash_bytes"]


@pytest.mark.slow
def test_summary_and_layout_name_cp(trained):
    summary = result_of(trained, "gpt_pp1_cp2_dp2")["summary"]
    assert summary["parallel"] == {"pp": 1, "dp": 2, "tp": 1, "vpp": 1, "cp": 2}


@pytest.mark.slow
def test_a_cp2_checkpoint_resumes_at_cp1(tmp_path):
    steps, stop = 4, 2
    base = GPT + ["parallel.pp=1", f"train.steps={steps}", "checkpoint.every=2"]
    run_dir = tmp_path / "resharded"
    assert run_workers(train_interrupted, 2, base + ["parallel.cp=2"], str(run_dir), stop) == ["stopped"] * 2
    per_rank = run_workers(train_full, 1, base + ["parallel.cp=1", "train.resume=auto"], str(run_dir))
    assert_matches_reference({"params": merge_params(per_rank), "losses": losses_across_resume(run_dir, stop, steps)},
                             reference_training(base))
