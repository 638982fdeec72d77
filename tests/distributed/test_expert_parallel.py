"""Expert parallelism (parallel.ep): model=mixtral_tiny with its 4 experts split over 2 ranks of a
stage's data-parallel replicas, tokens exchanged by all-to-all, equals single-process training
(fp32, sgd with momentum): at pp=1 with dp=4 (two expert-data-parallel replicas of each expert:
their gradients are summed and divided by dp, not by their group's size), at pp=2 with dp=2 (1f1b
and dualpipev), with gated shared experts and a capacity that drops tokens, with the distributed
optimizer (zero1), and at ep=4 over dp=2 x cp=2; per-expert token counts are those of every rank.
A checkpoint saved at ep=2 with zero1 (each rank its experts, under their global names) resumes
at ep=1 and at ep=2 with the losses of an uninterrupted run. One launch of 4 ranks runs the
comparisons (a process group is set up once per launch), three more the checkpoint's."""
from __future__ import annotations

import shutil

import pytest

from tests.distributed.test_moe_training import MIXTRAL, SHARED
from tests.support.checkpoint_harness import losses_across_resume, train_full, train_interrupted
from tests.support.training_harness import assert_matches_reference, merge_params, reference_training, train_rank
from tests.support.workers import run_workers

BASE = [*(o for o in MIXTRAL if not o.startswith("parallel.pp")), "train.global_batch_size=16", "parallel.ep=2"]
RUNS = {"pp1_dp4": ["parallel.pp=1", "parallel.dp=4"],
        "pp2_dp2": ["parallel.pp=2", "parallel.dp=2", "schedule=1f1b"],
        "pp2_dp2_dualpipev": ["parallel.pp=2", "parallel.dp=2", "schedule=dualpipev"],   # two chunks a rank
        "pp2_dp2_shared_capacity": ["parallel.pp=2", "parallel.dp=2", "schedule=1f1b", *SHARED],
        # the dense parameters sharded over dp, the experts (different on ep peers) whole
        "pp1_dp4_zero1": ["parallel.pp=1", "parallel.dp=4", "optim.distributed=zero1"],
        # ep taken from dp x cp: one expert per rank, tokens exchanged across data- and context-parallel
        # ranks (no auxiliary loss: with cp each rank balances its part of the sequence)
        "pp1_dp2_cp2_ep4": ["parallel.pp=1", "parallel.dp=2", "parallel.cp=2", "parallel.ep=4",
                            "model.moe.aux_loss_coef=0"]}
RESUME = [*BASE[:-1], "parallel.pp=1", "parallel.dp=4", "train.steps=4", "checkpoint.every=2"]


@pytest.mark.slow
def test_expert_parallel_matches_single_process(tmp_path):
    runs = [(BASE + extra, str(tmp_path / name)) for name, extra in RUNS.items()]
    per_rank = run_workers(train_rank, 4, runs)
    for index, (name, extra) in enumerate(RUNS.items()):
        result = {"params": merge_params([rank_results[index] for rank_results in per_rank]),
                  "losses": per_rank[0][index]["losses"]}
        assert_matches_reference(result, reference_training(BASE + extra))
    held = [{name.split(".")[3] for name in rank_results[0]["params"] if ".experts." in name} for rank_results in per_rank]
    assert held == [{"0", "1"}, {"2", "3"}] * 2   # ep groups (0, 1) and (2, 3), experts under global names
    slots = 16 * 16 * 2   # global batch x sequence x top_k, per MoE layer and step
    for record in per_rank[0][0]["records"]:
        assert sum(record["moe_tokens_per_expert"]) == 4 * slots and record["moe_tokens_dropped"] == 0
    summary = per_rank[0][0]["summary"]
    assert summary["parallel"]["ep"] == 2
    assert all(r["comm"]["all_to_all_bytes"] > 0 and r["comm"]["all_to_all_s"] > 0 for r in summary["ranks"])
    # saved at ep=2 with zero1 (momentum: the dense shards' and the whole experts'), resumed at ep=1
    # without it and at ep=2 with it
    zero1 = ["parallel.ep=2", "optim.distributed=zero1"]
    assert run_workers(train_interrupted, 4, RESUME + zero1, str(tmp_path / "resume"), 2) == ["stopped"] * 4
    shutil.copytree(tmp_path / "resume", tmp_path / "resume_ep2")
    expected = reference_training(RESUME + ["parallel.ep=1"])["losses"]
    for name, degrees in (("resume", ["parallel.ep=1"]), ("resume_ep2", zero1)):
        run_workers(train_full, 4, RESUME + degrees + ["train.resume=auto"], str(tmp_path / name))
        assert losses_across_resume(tmp_path / name, 2, 4) == pytest.approx(expected, rel=1e-5)


def _exchange_rank(rank: int, world_size: int) -> dict[str, float]:
    """One MoE MLP at ep=2 whose router sends every token to experts 0 and 1 (rank 0's): rank 1
    receives nothing, yet joins both exchanges and their backwards. Returns the largest differences
    from the same layer at ep=1 on this rank's tokens (output, input gradient, expert gradients)."""
    import torch
    import torch.distributed as dist
    from torch import nn

    from models.expert_parallel import ExpertParallel
    from models.families.llama import SwiGLU, _linear
    from models.families.moe import MoEMLP, MoEStatistics
    from models.families.moe_facts import moe_config
    from pipedream.runtime.distributed import init_distributed, shutdown

    class Favouring(nn.Module):   # logits 5, 4, 0, 0 for every token
        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            return torch.tensor([5.0, 4.0, 0.0, 0.0]).expand(tokens.shape[0], 4) + 0 * tokens.sum()

    init_distributed("cpu", 60)
    try:
        moe = moe_config({"ffn_hidden_size": 16, "num_layers": 1, "moe": {"num_experts": 4, "top_k": 2}})
        layers = []
        for ep in (ExpertParallel.from_group(dist.new_group([0, 1])), None):
            torch.manual_seed(0)
            layer = MoEMLP(8, moe, MoEStatistics(4), 1, SwiGLU, _linear, ep=ep)
            layer.router = Favouring()
            layer.eval()
            layers.append(layer)
        x = torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(rank), requires_grad=True)
        results = []
        for layer in layers:
            x.grad = None
            out = layer(x)
            out.square().sum().backward()
            results.append((out.detach(), x.grad.clone(), {n: p.grad for n, p in layer.named_parameters()}))
        (out, grad, params), (out1, grad1, _) = results
        dist.all_reduce(torch.zeros(1))   # both ranks done before the group goes
        return {"out": float((out - out1).abs().max()), "grad": float((grad - grad1).abs().max()),
                "params_with_grads": sum(g is not None for g in params.values()),
                "nonzero_grads": sum(g is not None and bool(g.any()) for g in params.values())}
    finally:
        shutdown()


def test_a_rank_that_receives_no_tokens_still_exchanges():
    rank0, rank1 = run_workers(_exchange_rank, 2)
    assert rank0["out"] == rank1["out"] == 0.0 and rank0["grad"] == rank1["grad"] == 0.0
    # rank 1's experts ran on no rows: each parameter took one gradient, a zero one (the count the
    # overlapped reduction's buckets expect every micro-batch)
    assert rank1["params_with_grads"] == rank0["params_with_grads"] > 0
    assert rank1["nonzero_grads"] == 0 < rank0["nonzero_grads"]
