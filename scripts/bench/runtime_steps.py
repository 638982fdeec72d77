"""One training step of each runtime that scripts/bench/runtime.py compares, built once per case:
ours (PipelineEngine), torch.distributed.pipelining's schedules on the same blocks, and the whole
model in one process."""
from __future__ import annotations

import datetime
from typing import Any, Callable

import torch

from pipedream.schedules import schedule_info
from scripts.bench.runtime_cases import BOTH_CORES, OURS_FOR, PP, V_PLACED, VARIANTS, Case, Workload


def compose(workload: Workload, case: Case) -> Any:
    from pipedream.config.loading import compose_config

    ours = OURS_FOR.get(case.schedule, case.schedule) if case.schedule != '-' else '1f1b'
    overrides = list(workload.overrides) + list(VARIANTS.get(case.variant, ())) + [
        f"train.micro_batch_size={workload.micro_batch}", f"train.global_batch_size={workload.global_batch}",
        f"schedule={ours}",
        f"parallel.pp={PP}",
        f"parallel.vpp={case.vpp}", "parallel.dp=1", "train.timeout_s=300",
        # asynchronous schedules build the whole run's action list up front: keep the run short
        f"train.steps={200 if schedule_info(ours).asynchronous else 1000}"]
    return compose_config(overrides)


def microbatches(model, workload: Workload) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)   # the same data on every rank
    return [model.make_batch(workload.micro_batch, generator) for _ in range(workload.microbatches)]


def ours(workload: Workload, case: Case, rank: int, groups_cache: dict, recorder=None) -> Callable[[], None]:
    from models import build_model
    from pipedream.runtime.engine import PipelineEngine
    from pipedream.runtime.groups import build_groups
    from pipedream.config.run_spec import build_run_spec

    cfg = compose(workload, case)
    spec = build_run_spec(cfg, PP)
    model = build_model(cfg.model, seed=1)
    if "groups" not in groups_cache:   # one mesh serves every case (pp=2, dp=tp=1, nothing tied)
        groups_cache["groups"] = build_groups(spec.layout, rank, "cpu", model, list(spec.bounds))
    engine = PipelineEngine(spec, model, rank, torch.device("cpu"), groups_cache["groups"], spec.optim, spec.train,
                            datetime.timedelta(seconds=300), recorder=recorder)
    batches = dict(enumerate(microbatches(model, workload)))
    # no gradient norm: torch's loop computes none, and the trainer computes it only on logged steps
    return lambda: engine.train_step(batches, grad_norm=False)


def theirs(workload: Workload, case: Case, rank: int) -> Callable[[], None]:
    """torch.distributed.pipelining's schedule of the same name, on the same layers and placement."""
    from torch import nn
    from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleDualPipeV, ScheduleGPipe,
                                              ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble,
                                              ScheduleZBVZeroBubble)

    from models import build_model
    from pipedream.numerics.optim import build_optimizer
    from pipedream.config.run_spec import build_run_spec

    cfg = compose(workload, case)
    spec = build_run_spec(cfg, PP)
    model = build_model(cfg.model, seed=1)
    stages_total = PP * case.vpp
    bounds = spec.bounds   # ours: the same layers on every stage
    mine = [chunk * PP + rank for chunk in range(case.vpp)]   # round-robin, as ours
    if case.schedule in V_PLACED:
        mine = [rank, 2 * PP - 1 - rank]
    built = model.build([i for vs in mine for i in range(*bounds[vs])])
    modules = [nn.Sequential(*(built[i] for i in range(*bounds[vs]))) for vs in mine]
    stages = [PipelineStage(m, vs, stages_total, torch.device("cpu")) for m, vs in zip(modules, mine)]
    multi = {"interleaved": ScheduleInterleaved1F1B, "interleaved_zb": ScheduleInterleavedZeroBubble,
             "zbv": ScheduleZBVZeroBubble, "dualpipev": ScheduleDualPipeV}
    if case.schedule in multi:
        schedule = multi[case.schedule](stages, n_microbatches=workload.microbatches, loss_fn=model.loss_fn)
    else:
        cls = Schedule1F1B if case.schedule == "1f1b" else ScheduleGPipe
        schedule = cls(stages[0], n_microbatches=workload.microbatches, loss_fn=model.loss_fn)
    optimizer = build_optimizer(spec.optim, [p for m in modules for p in m.parameters()], spec.train.lr)
    parts = microbatches(model, workload)
    inputs, targets = torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts])
    first, last = 0 in mine, stages_total - 1 in mine

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        losses: list[torch.Tensor] = []
        if first and last:
            schedule.step(inputs, target=targets, losses=losses)
        elif first:
            schedule.step(inputs)
        else:
            schedule.step(target=targets, losses=losses)
        optimizer.step()
    return step


def single(workload: Workload, case: Case, rank: int) -> Callable[[], None]:
    """The whole model in one process: the same micro-batches, gradients accumulated, one update
    (on rank 0; with BOTH_CORES rank 1 runs its own copy at the same time)."""
    from models import build_model
    from pipedream.numerics.optim import build_optimizer
    from pipedream.config.specs import OptimSpec, TrainSpec

    cfg = compose(workload, Case("pipedream", "1f1b"))
    model = build_model(cfg.model, seed=1)
    network = model.build_sequential()
    optimizer = build_optimizer(OptimSpec.from_config(cfg, (cfg.optim.name,)), list(network.parameters()),
                                TrainSpec.from_config(cfg).lr)
    parts = microbatches(model, workload)
    scale = 1.0 / len(parts)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        for x, y in parts:
            (model.loss_fn(network(x), y) * scale).backward()
        optimizer.step()
    return step if rank == 0 or case.variant == BOTH_CORES else (lambda: None)
