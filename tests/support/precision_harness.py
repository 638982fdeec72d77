"""Worker for the fp16 overflow test: drives a real rank's engine step by step and, on one rank
only, turns one gradient element into inf after the gradient sync of one step."""
from __future__ import annotations

from typing import Any

import torch


def overflow_run(rank: int, world_size: int, runs: list[tuple[list[str], int, int]]) -> list[dict[str, Any]]:
    """Per (overrides, inject_rank, inject_step): the loss scale after each step, whether this
    rank's weights changed in each step, and the losses."""
    from pipedream.config.loading import compose_config
    from pipedream.runtime.distributed import init_distributed, shutdown
    from pipedream.config.run_spec import build_run_spec
    from pipedream.observe.trace import TraceRecorder
    from pipedream.trainer import ShardedData, _build_engine

    ctx = init_distributed("cpu", 60)
    results = []
    try:
        for overrides, inject_rank, inject_step in runs:
            cfg = compose_config(overrides)
            spec = build_run_spec(cfg, world_size)
            engine = _build_engine(spec, ctx, TraceRecorder())
            data = ShardedData(spec, engine.coords.dp)
            step_now = [0]
            sync = engine.executor.sync_grads

            def sync_then_inject() -> None:
                sync()
                if rank == inject_rank and step_now[0] == inject_step:
                    engine.params[0].grad.view(-1)[0] = float("inf")

            engine.executor.sync_grads = sync_then_inject
            scales, changed, losses = [], [], []
            for step in range(1, spec.train.steps + 1):
                step_now[0] = step
                before = [p.detach().clone() for p in engine.params]
                losses.append(engine.train_step(data.train_batches(step - 1)).loss)
                changed.append([not torch.equal(b, p) for b, p in zip(before, engine.params)])
                scales.append(engine.parts.scaler.scale)
            results.append({"scales": scales, "changed": changed, "losses": losses,
                            "skipped": engine.parts.scaler.skipped_steps})
    finally:
        shutdown()
    return results


def train_on_cuda(rank: int, world_size: int, overrides: list[str], run_dir: str) -> dict[str, Any]:
    """One real training run on CUDA (NCCL): its summary and, for fp16, the loss scaler's state."""
    from pipedream.config.loading import compose_config
    from pipedream.runtime.distributed import init_distributed, shutdown
    from pipedream.config.run_spec import build_run_spec
    from pipedream.trainer import train

    ctx = init_distributed("cuda", 60)
    try:
        cfg = compose_config(overrides + ["cluster.device=cuda", f"train.run_dir={run_dir}"])
        outcome = train(build_run_spec(cfg, world_size), ctx)
        scaler = outcome.engine.parts.scaler
        return {"summary": outcome.summary, "device": str(outcome.engine.device),
                "loss_scaler": scaler.state_dict() if scaler is not None else None}
    finally:
        shutdown()
