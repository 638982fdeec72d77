"""Micro-batches whose shape changes (here the sequence length of a GPT, within a step and from
step to step) cross the pipeline without any shape handshake and train exactly like one process;
an asynchronous schedule, which keeps micro-batches in flight across steps, refuses a change."""
from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.support.workers import run_workers
from tests.support.training_harness import TINY_GPT, compose_config

# sequence lengths of each step's 4 micro-batches (the model's context is 16)
LENGTHS = [[16, 8, 12, 16], [5, 5, 16, 9], [16, 16, 16, 16]]
GPT = TINY_GPT + ["model.tie_embeddings=false", "optim=sgd", "train.lr=0.05", "train.grad_clip=0",
                  "train.steps=3"]
LAYOUTS = [["schedule=1f1b", "parallel.pp=2"], ["schedule=interleaved", "parallel.pp=2", "parallel.vpp=2"]]


def step_batches(vocab_size: int, step: int) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(100 + step)   # the same data on every rank
    batches = {}
    for mb, length in enumerate(LENGTHS[step]):
        tokens = torch.randint(vocab_size, (2, length + 1), generator=generator)
        batches[mb] = (tokens[:, :-1], tokens[:, 1:])
    return batches


def rank_run(rank: int, world_size: int, layouts: list[list[str]]) -> list[Any]:
    from models import build_model
    from pipedream.runtime.distributed import init_distributed, shutdown
    from pipedream.runtime.engine import PipelineEngine
    from pipedream.runtime.groups import build_groups
    from pipedream.config.run_spec import build_run_spec

    ctx = init_distributed("cpu", 60)
    results: list[Any] = []
    try:
        for overrides in layouts:
            cfg = compose_config(GPT + overrides)
            spec = build_run_spec(cfg, world_size)
            model = build_model(cfg.model, seed=int(cfg.train.seed))
            groups = build_groups(spec.layout, rank, "cpu", model, list(spec.bounds))
            engine = PipelineEngine(spec, model, rank, ctx.device, groups, spec.optim, spec.train, ctx.timeout)
            try:
                losses = [engine.train_step(step_batches(int(cfg.model.vocab_size), step)).loss for step in range(len(LENGTHS))]
            except ValueError as error:   # the asynchronous schedule refuses the change
                results.append(str(error))
                continue
            params = {}
            for chunk, virtual_stage in zip(engine.stage.chunks, engine.virtual_stages):
                start = spec.bounds[virtual_stage][0]
                for name, param in chunk.named_parameters():
                    local, _, rest = name.partition(".")
                    params[f"{start + int(local)}.{rest}"] = param.detach().clone()
            results.append({"losses": losses, "params": params})
    finally:
        shutdown()
    return results


def reference() -> dict[str, Any]:
    from models import build_model
    from pipedream.numerics.optim import build_optimizer, build_scheduler
    from pipedream.config.run_spec import build_run_spec

    cfg = compose_config(GPT)
    spec = build_run_spec(cfg)
    model = build_model(cfg.model, seed=int(cfg.train.seed))
    network = model.build_sequential()
    optimizer = build_optimizer(spec.optim, list(network.parameters()), spec.train.lr)
    scheduler = build_scheduler(optimizer, spec.train)
    losses = []
    for step in range(len(LENGTHS)):
        optimizer.zero_grad(set_to_none=True)
        parts = list(step_batches(int(cfg.model.vocab_size), step).values())
        total = 0.0
        for inputs, targets in parts:
            loss = model.loss_fn(network(inputs), targets)
            (loss / len(parts)).backward()
            total += float(loss.detach())
        optimizer.step()
        scheduler.step()
        losses.append(total / len(parts))
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in network.named_parameters()}}


@pytest.mark.slow
def test_shapes_change_within_and_across_steps() -> None:
    per_rank = run_workers(rank_run, 2, LAYOUTS + [["schedule=2bw", "parallel.pp=2"]])
    expected = reference()
    for index in range(len(LAYOUTS)):
        losses = per_rank[0][index]["losses"]
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected["losses"]), rtol=1e-5, atol=0)
        params = {name: value for rank in per_rank for name, value in rank[index]["params"].items()}
        assert set(params) == set(expected["params"])
        for name, value in expected["params"].items():
            torch.testing.assert_close(params[name], value, rtol=1e-5, atol=1e-6)
    for rank in per_rank:
        assert "schedule=2bw needs every micro-batch of a run to have the same shape" in rank[-1]
