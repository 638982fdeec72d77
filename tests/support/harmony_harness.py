"""Runs harmony_pp / harmony_dp training on a rank and collects what the tests compare: the losses
(rank 0), the host copies of the layers the rank owns, and its summary record; a killed and
resumed run; and the single-process reference with per-layer dropout seeds."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pipedream.config.loading import compose_config


def _train(world_size: int, overrides: list[str], run_dir: str) -> dict[str, Any]:
    from pipedream.runtime.distributed import init_distributed
    from pipedream.config.run_spec import build_run_spec
    from pipedream.trainer import train

    cfg = compose_config(overrides + [f"train.run_dir={run_dir}"])
    outcome = train(build_run_spec(cfg, world_size), init_distributed("cpu", 60))
    losses = []
    if outcome.engine.rank == 0:
        losses = [json.loads(line)["loss"] for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return {"params": {k: v.clone() for k, v in outcome.engine.host_parameters().items()},
            "losses": losses, "summary": outcome.summary if outcome.engine.rank == 0 else None}


def harmony_train_rank(rank: int, world_size: int, runs: list[tuple[list[str], str]],
                       resume: tuple[list[str], str, int] | None = None) -> list[dict[str, Any]]:
    """Like ``training_harness.train_rank``: every (overrides, run_dir) in one process group. With
    ``resume`` = (overrides, root, stop_after) the last result is ``resumed_runs``'s."""
    from pipedream.runtime.distributed import init_distributed, shutdown

    init_distributed("cpu", 60)
    try:
        results = [_train(world_size, overrides, run_dir) for overrides, run_dir in runs]
        if resume is not None:
            results.append(resumed_runs(world_size, *resume))
    finally:
        shutdown()
    return results


def resumed_runs(world_size: int, overrides: list[str], root: str, stop_after: int) -> dict[str, Any]:
    """In the current process group: an uninterrupted run (``root``/full), a run that stops right
    after its checkpoint of step ``stop_after`` (as if killed), and that run resumed with
    ``train.resume=auto`` (``root``/resumed)."""
    from pipedream.checkpoint.store import RunCheckpoints

    class Interrupted(Exception):
        pass

    original = RunCheckpoints.after_step

    def after_step(self, steps_done: int) -> None:
        original(self, steps_done)
        if steps_done == stop_after:
            raise Interrupted

    full = _train(world_size, overrides, f"{root}/full")
    RunCheckpoints.after_step = after_step
    try:
        _train(world_size, overrides, f"{root}/resumed")
        raise AssertionError("the interrupted run was not interrupted")
    except Interrupted:
        pass
    finally:
        RunCheckpoints.after_step = original
    resumed = _train(world_size, overrides + ["train.resume=auto"], f"{root}/resumed")
    return {"full": full["params"], "resumed": resumed["params"]}


def seeded_dropout_reference(overrides: list[str]) -> dict[str, Any]:
    """Single-process training (fp32, no clipping) whose every layer forward draws its dropout
    masks from ``dropout_seed(seed, step, micro-batch, layer)``, as harmony runs do; no recompute."""
    import torch

    from models import build_model
    from pipedream.config.run_spec import OPTIMIZERS
    from pipedream.config.specs import OptimSpec, TrainSpec
    from pipedream.data.batching import GlobalBatchOrder, microbatches
    from pipedream.data.datasets import build_datasets
    from pipedream.harmony.runner import dropout_seed
    from pipedream.numerics.optim import build_optimizer, build_scheduler

    cfg = compose_config(overrides)
    seed = int(cfg.train.seed)
    model = build_model(cfg.model, seed=seed)
    network = model.build_sequential().train()
    train_set, _ = build_datasets(cfg.model, cfg.data, seed)
    order = GlobalBatchOrder(len(train_set), int(cfg.train.global_batch_size), seed)
    train = TrainSpec.from_config(cfg)
    optimizer = build_optimizer(OptimSpec.from_config(cfg, OPTIMIZERS), list(network.parameters()), train.lr)
    scheduler = build_scheduler(optimizer, train)
    losses = []
    for step in range(int(cfg.train.steps)):
        optimizer.zero_grad(set_to_none=True)
        parts = microbatches(train_set, order.indices(step), int(cfg.train.micro_batch_size))
        total = 0.0
        for index, (x, targets) in enumerate(parts):
            for layer, module in enumerate(network):
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(dropout_seed(seed, step, index, layer))
                    x = module(x)
            loss = model.loss_fn(x, targets)
            (loss / len(parts)).backward()
            total += float(loss.detach())
        optimizer.step()
        scheduler.step()
        losses.append(total / len(parts))
    params = {name: p.detach().clone() for name, p in network.named_parameters(remove_duplicate=False)}
    return {"params": params, "losses": losses}
