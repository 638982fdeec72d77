"""The asynchronous schedules on Gloo match their single-process references update by update.

Each run records, per rank, the weights after every update and the loss of every micro-batch its
last stage completes; both must match ``tests/support/async_reference.py`` (fp32, rtol 1e-5) for at least
2p steps, and so must the final (drained) weights. One run per world size goes through the real
trainer (evaluation between steps, summary.json) and checks the measured weight versions.
"""
from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.support.async_reference import Reference, pipedream_reference, two_bw_reference
from tests.support.workers import run_workers
from tests.support.training_harness import TINY_GPT, compose_config, merge_params

MLP = ["model=mlp", "data=synthetic", "model.num_layers=4", "model.hidden_size=16", "train.global_batch_size=4",
       "train.micro_batch_size=2", "train.lr=0.1", "train.warmup_steps=1", "train.grad_clip=1.0",
       "train.eval_every=0", "train.log_every=1", "train.progress=false", "train.timeout_s=60"]
GPT = TINY_GPT + ["model.tie_embeddings=false", "optim=sgd", "train.lr=0.05"]


def pipedream_run(pp: int, extra: list[str] = (), optim: str = "sgd") -> list[str]:
    return MLP + [f"optim={optim}", "schedule=pipedream", f"parallel.pp={pp}", f"train.steps={2 * pp}", *extra]


def rank_runs(rank: int, world_size: int, runs: list[tuple[list[str], str | int | None]]) -> list[dict[str, Any]]:
    """Each run is (overrides, how): a run directory (through the trainer), a step after which to
    drain (the engine, drained mid-run), or None (the engine)."""
    from pipedream.runtime.distributed import init_distributed, shutdown

    init_distributed("cpu", 60)
    try:
        return [_trainer_run(rank, world_size, o, how) if isinstance(how, str)
                else _engine_run(rank, world_size, o, how) for o, how in runs]
    finally:
        shutdown()


def _engine_run(rank: int, world_size: int, overrides: list[str], drain_after: int | None = None) -> dict[str, Any]:
    """The engine driven step by step like the trainer, recording every update's weights."""
    from models import build_model
    from pipedream.data.datasets import build_datasets
    from pipedream.data.batching import GlobalBatchOrder, microbatches
    from pipedream.runtime.distributed import init_distributed
    from pipedream.runtime.engine import PipelineEngine
    from pipedream.runtime.groups import build_groups
    from pipedream.config.run_spec import build_run_spec

    cfg = compose_config(overrides)
    spec = build_run_spec(cfg, world_size)
    ctx = init_distributed("cpu", 60)
    seed = int(cfg.train.seed)
    torch.manual_seed(seed)
    model = build_model(cfg.model, seed=seed)
    groups = build_groups(spec.layout, rank, "cpu", model, list(spec.bounds))
    engine = PipelineEngine(spec, model, rank, ctx.device, groups, spec.optim, spec.train, ctx.timeout)
    snapshots: list[list[torch.Tensor]] = []
    update = engine.executor.step

    def recording_update() -> None:
        update()
        snapshots.append([p.detach().clone() for p in engine.params])

    engine.executor.step = recording_update
    train_set, _ = build_datasets(cfg.model, cfg.data, seed)
    order = GlobalBatchOrder(len(train_set), spec.global_batch, seed)
    losses, step_losses = {}, []
    for step in range(int(cfg.train.steps)):
        indices = order.shard(step, engine.coords.dp, spec.layout.dp)
        result = engine.train_step(dict(enumerate(microbatches(train_set, indices, spec.micro_batch))))
        step_losses.append(result.loss)
        losses.update({(engine.coords.dp, mb): loss for mb, loss in engine.last_losses.items()})
        if step + 1 == drain_after:
            engine.drain()
            losses.update({(engine.coords.dp, mb): loss for mb, loss in engine.last_losses.items()})
    return {"stage": engine.coords.pp, "snapshots": snapshots, "losses": losses, "step_losses": step_losses,
            "versions": engine.weight_versions, "in_flight": engine.stage.stats.peak_in_flight}


def _trainer_run(rank: int, world_size: int, overrides: list[str], run_dir: str) -> dict[str, Any]:
    from tests.support.training_harness import _train_once

    return _train_once(rank, world_size, overrides, run_dir)


def assert_matches(results: list[dict[str, Any]], ref: Reference) -> None:
    for result in results:
        expected = ref.stages[result["stage"]].versions[1:]
        assert len(result["snapshots"]) == len(expected), (result["stage"], len(result["snapshots"]), len(expected))
        for update, (got, want) in enumerate(zip(result["snapshots"], expected)):
            for g, w in zip(got, want):
                torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6, msg=lambda m: f"stage {result['stage']} "
                                           f"update {update}: {m}")
    losses = {k: v for r in results for k, v in r["losses"].items()}
    assert set(losses) == set(ref.losses)
    for key, value in ref.losses.items():
        assert value == pytest.approx(losses[key], rel=1e-5), key


def assert_versions_bounded(results: list[dict[str, Any]], bound: Any) -> None:
    for result in results:
        limit = bound(result) if callable(bound) else bound
        assert 1 <= result["versions"] <= limit, (result["stage"], result["versions"], limit)


def assert_trainer_matches(per_rank: list[dict[str, Any]], ref: Reference) -> None:
    params = merge_params(per_rank)
    for name, expected in ref.final_params().items():
        torch.testing.assert_close(params[name], expected, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_two_stages(tmp_path) -> None:
    """p = 2: weight stashing (SGD with momentum), vertical sync (AdamW), 2BW with recomputation
    (tiny GPT), pipedream drained mid-run (as before a checkpoint), and pipedream through the
    trainer with evaluation between steps."""
    runs = [pipedream_run(2), pipedream_run(2, ["schedule.vertical_sync=true"], optim="adamw"),
            GPT + ["schedule=2bw", "parallel.pp=2", "train.steps=4", "recompute.granularity=full"],
            pipedream_run(2, ["train.steps=5"])]
    trainer = pipedream_run(2, ["train.eval_every=2"])
    jobs = [(r, None) for r in runs[:3]] + [(runs[3], 2), (trainer, str(tmp_path / "pd"))]
    per_rank = run_workers(rank_runs, 2, jobs, timeout=240)
    stash, vertical, two_bw, drained, trained = ([rank[i] for rank in per_rank] for i in range(5))

    assert_matches(stash, pipedream_reference(compose_config(runs[0]), [1, 1]))
    assert_versions_bounded(stash, lambda r: r["in_flight"])
    assert [r["versions"] for r in stash] == [2, 1]
    assert_matches(vertical, pipedream_reference(compose_config(runs[1]), [1, 1], vertical_sync=True))
    assert_versions_bounded(vertical, 2)
    assert_matches(two_bw, two_bw_reference(compose_config(runs[2]), 1))
    assert [r["versions"] for r in two_bw] == [2, 2]
    assert_matches(drained, pipedream_reference(compose_config(runs[3]), [1, 1], drain_after=2))

    assert_trainer_matches(trained, pipedream_reference(compose_config(trainer), [1, 1]))
    summary = trained[0]["summary"]
    assert [r["weight_versions"] for r in summary["ranks"]] == [2, 1]


@pytest.mark.slow
def test_three_ranks(tmp_path) -> None:
    """p = 3 straight (stashing and vertical sync), 1F1B-RR with stage replicas [2, 1], 2BW with m = p."""
    runs = [pipedream_run(3), pipedream_run(3, ["schedule.vertical_sync=true"]),
            pipedream_run(2, ["parallel.stage_replicas=[2,1]"], optim="adamw"),
            MLP + ["optim=adamw", "schedule=2bw", "parallel.pp=3", "train.global_batch_size=6", "train.steps=6"]]
    per_rank = run_workers(rank_runs, 3, [(r, None) for r in runs], timeout=240)
    stash, vertical, replicated, two_bw = ([rank[i] for rank in per_rank] for i in range(4))

    assert_matches(stash, pipedream_reference(compose_config(runs[0]), [1, 1, 1]))
    assert [r["versions"] for r in stash] == [3, 2, 1] == [r["in_flight"] for r in stash]
    assert_matches(vertical, pipedream_reference(compose_config(runs[1]), [1, 1, 1], vertical_sync=True))
    assert_versions_bounded(vertical, 3)
    assert_matches(replicated, pipedream_reference(compose_config(runs[2]), [2, 1]))
    assert_versions_bounded(replicated, lambda r: r["in_flight"])
    assert [r["in_flight"] for r in replicated] == [2, 2, 1]   # NOAM = ceil(3 / 2) per input replica
    assert_matches(two_bw, two_bw_reference(compose_config(runs[3]), 1))
    assert_versions_bounded(two_bw, 2)


@pytest.mark.slow
def test_four_ranks(tmp_path) -> None:
    """p = 4 with weight stashing, and 2BW on two data-parallel pipelines of two stages (tiny GPT,
    through the trainer as well)."""
    runs = [pipedream_run(4), GPT + ["schedule=2bw", "parallel.pp=2", "parallel.dp=2", "train.steps=4"]]
    trainer = runs[1] + ["train.eval_every=2"]
    per_rank = run_workers(rank_runs, 4, [(r, None) for r in runs] + [(trainer, str(tmp_path / "2bw"))],
                           timeout=300)
    stash, two_bw, trained = ([rank[i] for rank in per_rank] for i in range(3))

    assert_matches(stash, pipedream_reference(compose_config(runs[0]), [1, 1, 1, 1]))
    assert [r["versions"] for r in stash] == [4, 3, 2, 1]
    reference = two_bw_reference(compose_config(runs[1]), 2)
    assert_matches(two_bw, reference)
    assert_versions_bounded(two_bw, 2)
    assert_trainer_matches(trained, reference)
    assert all(r["weight_versions"] == 2 for r in trained[0]["summary"]["ranks"])
