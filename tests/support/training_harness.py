"""Shared pieces of the end-to-end tests: composing configs, a rank's training run that returns
its parameters by global layer index, and the plain single-process reference loop."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from pipedream.config.loading import compose_config

TINY_GPT = ["model=gpt_tiny", "model.num_layers=6", "model.hidden_size=32", "model.num_heads=2",
            "model.seq_len=16", "train.global_batch_size=8", "train.micro_batch_size=2",
            "train.warmup_steps=1", "train.eval_every=0", "train.eval_batches=1", "train.log_every=1",
            "train.progress=false", "train.timeout_s=60"]


def train_rank(rank: int, world_size: int, runs: list[tuple[list[str], str]]) -> list[dict[str, Any]]:
    """Runs the real trainer once per (overrides, run_dir) in one process group (starting processes
    costs more than these tiny runs); returns per run {"params": {"layer.name": tensor}, "losses"}."""
    from pipedream.runtime.distributed import init_distributed, shutdown

    init_distributed("cpu", 60)
    try:
        return [_train_once(rank, world_size, overrides, run_dir) for overrides, run_dir in runs]
    finally:
        shutdown()


def _train_once(rank: int, world_size: int, overrides: list[str], run_dir: str) -> dict[str, Any]:
    from pipedream.runtime.distributed import init_distributed
    from pipedream.config.run_spec import build_run_spec
    from models.tensor_parallel import gather_tensor, shard_spec
    from pipedream.trainer import train

    cfg = compose_config(overrides + [f"train.run_dir={run_dir}"])
    spec = build_run_spec(cfg, world_size)
    outcome = train(spec, init_distributed("cpu", 60))
    engine = outcome.engine
    params = {}
    for chunk, virtual_stage in zip(engine.stage.chunks, engine.virtual_stages):
        start = spec.bounds[virtual_stage][0]
        for name, param in chunk.named_parameters(remove_duplicate=False):
            local, _, rest = name.partition(".")
            value = param.detach()
            if engine.tp is not None and shard_spec(param) is not None:  # tensor-parallel shard
                value = gather_tensor(value, shard_spec(param), engine.tp)
            params[f"{start + int(local)}.{rest}"] = value.clone()
    losses, records = [], []
    if rank == 0:
        metrics = Path(run_dir) / "metrics.jsonl"
        records = [json.loads(line) for line in metrics.read_text().splitlines()]
        losses = [record["loss"] for record in records]
    scaler = engine.parts.scaler
    return {"params": params, "losses": losses, "records": records, "summary": outcome.summary if rank == 0 else None,
            "loss_scaler": scaler.state_dict() if scaler is not None else None,
            # the elements of this rank's own parameters (tensor-parallel shards as held): what an
            # unsharded optimizer keeps state for
            "local_param_numel": sum(p.numel() for p in engine.params)}


def reference_training(overrides: list[str]) -> dict[str, Any]:
    """Single-process training of the whole model on the same global batches: the gold standard."""
    from models import build_model
    from pipedream.data.datasets import build_datasets
    from pipedream.data.batching import GlobalBatchOrder, microbatches
    from pipedream.numerics.optim import build_optimizer, build_scheduler
    from pipedream.numerics.precision import MixedPrecision
    from pipedream.config.run_spec import OPTIMIZERS
    from pipedream.config.specs import OptimSpec, TrainSpec

    cfg = compose_config(overrides)
    seed = int(cfg.train.seed)
    model = build_model(cfg.model, seed=seed)
    network = model.build_sequential()
    statistics = model.statistics
    if statistics is not None:   # MoE: the layers hand over their auxiliary objective, added to the loss below
        statistics.collected = []
    precision = MixedPrecision(str(cfg.precision.name), "cpu")   # the runtime's scheme, in one process
    precision.apply(list(network))
    loss_fn = precision.fp32_loss(model.loss_fn)
    scaler = None
    if cfg.precision.name == "fp16":
        p = cfg.precision
        scaler = torch.amp.GradScaler("cpu", init_scale=p.initial_scale, growth_factor=p.growth_factor,
                                      backoff_factor=p.backoff_factor, growth_interval=p.growth_interval)
    train_set, _ = build_datasets(cfg.model, cfg.data, seed)
    batch, micro = int(cfg.train.global_batch_size), int(cfg.train.micro_batch_size)
    order = GlobalBatchOrder(len(train_set), batch, seed)
    train = TrainSpec.from_config(cfg)
    optimizer = build_optimizer(OptimSpec.from_config(cfg, OPTIMIZERS), list(network.parameters()), train.lr)
    scheduler = build_scheduler(optimizer, train)
    losses = []
    for step in range(int(cfg.train.steps)):
        optimizer.zero_grad(set_to_none=True)
        parts = microbatches(train_set, order.indices(step), micro)
        total = 0.0
        for inputs, targets in parts:
            with precision.autocast():
                outputs = network(inputs)
            loss = loss_fn(outputs, targets)
            objective = loss
            if statistics is not None:   # the mean over micro-batches of (loss + auxiliary objective)
                objective = loss + sum(statistics.collected)
                statistics.collected.clear()
            scaled = objective / len(parts)   # m and the loss scale are powers of two: exact in any order
            (scaler.scale(scaled) if scaler is not None else scaled).backward()
            total += float(loss.detach())
        if scaler is not None:
            scaler.unscale_(optimizer)
        if float(cfg.train.grad_clip) > 0:
            torch.nn.utils.clip_grad_norm_(network.parameters(), float(cfg.train.grad_clip))
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        scheduler.step()
        losses.append(total / len(parts))
    params = {name: p.detach().clone() for name, p in network.named_parameters(remove_duplicate=False)}
    return {"params": params, "losses": losses}


def merge_params(results: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    merged: dict[str, torch.Tensor] = {}
    for result in results:
        for name, tensor in result["params"].items():
            if name in merged:  # another data-parallel replica (or a tied copy): must agree exactly
                torch.testing.assert_close(tensor, merged[name], rtol=0, atol=0)
            merged[name] = tensor
    return merged


def assert_matches_reference(result: dict, reference: dict, atol: float = 1e-6) -> None:
    """Losses and parameters of a distributed run (``merge_params``) equal ``reference_training``'s."""
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(reference["losses"]), rtol=1e-5, atol=0)
    assert set(result["params"]) == set(reference["params"])
    for name, expected in reference["params"].items():
        torch.testing.assert_close(result["params"][name], expected, rtol=1e-5, atol=atol)
