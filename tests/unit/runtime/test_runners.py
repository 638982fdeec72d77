"""The runner interface on one stage: a Gloo world of one process, no communicator (pp=1)."""
from __future__ import annotations

from datetime import timedelta

import pytest
import torch

from models import build_model
from pipedream.runtime.async_runner import AsyncRunner
from pipedream.runtime.engine import PipelineEngine, runner_class
from pipedream.errors import DataError, InvariantError
from pipedream.runtime.groups import build_groups
from pipedream.config.run_spec import build_run_spec
from pipedream.runtime.runner import FlushRunner
from pipedream.schedules import schedule_info
from tests.support.training_harness import compose_config
from tests.support.single_process import world_of_one as one_rank_world

MLP = ["model=mlp", "data=synthetic", "model.num_layers=2", "model.hidden_size=8", "parallel.pp=1",
       "train.global_batch_size=8", "train.micro_batch_size=2", "train.steps=4", "train.warmup_steps=1"]


@pytest.fixture(scope="module", autouse=True)
def world_of_one():
    with one_rank_world():
        yield


def _engine(schedule: str) -> PipelineEngine:
    cfg = compose_config(MLP + [f"schedule={schedule}"])
    spec = build_run_spec(cfg, world_size=1)
    model = build_model(cfg.model, seed=spec.train.seed)
    groups = build_groups(spec.layout, 0, "cpu", model, list(spec.bounds))
    return PipelineEngine(spec, model, 0, torch.device("cpu"), groups, spec.optim, spec.train, timedelta(seconds=30))


def _batches(hidden: int = 8, seed: int = 0) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return {mb: (torch.randn(2, hidden, generator=generator), torch.randn(2, hidden, generator=generator))
            for mb in range(4)}


def _counting_updates(engine: PipelineEngine) -> list[int]:
    calls: list[int] = []
    update = engine.executor.step

    def counted() -> None:
        calls.append(1)
        update()
    engine.executor.step = counted
    return calls


def test_the_schedule_picks_the_runner_once() -> None:
    assert runner_class(schedule_info("1f1b")) is FlushRunner and runner_class(schedule_info("gpipe")) is FlushRunner
    assert runner_class(schedule_info("2bw")) is AsyncRunner and runner_class(schedule_info("pipedream")) is AsyncRunner
    assert isinstance(_engine("1f1b").runner, FlushRunner)
    assert isinstance(_engine("2bw").runner, AsyncRunner)


def test_flush_runner_updates_once_per_step_and_leaves_nothing_to_drain() -> None:
    engine = _engine("1f1b")
    updates = _counting_updates(engine)
    losses = [engine.train_step(_batches(seed=s)).loss for s in range(3)]
    assert len(updates) == 3 and all(torch.isfinite(torch.tensor(losses)))
    assert engine.drain() is None and engine.weight_versions == 1
    engine.resume_at(1)   # nothing to do for a flush schedule


def test_async_runner_keeps_the_pipeline_across_steps_and_drains() -> None:
    engine = _engine("2bw")
    updates = _counting_updates(engine)
    engine.train_step(_batches(seed=0))
    with pytest.raises(InvariantError, match="call drain"):
        engine.resume_at(0)
    drained = engine.drain()
    assert drained is not None and len(updates) == 1
    assert engine.runner.store is None and engine.weight_versions >= 1
    engine.resume_at(1)   # an empty pipeline continues at a restored step
    engine.train_step(_batches(seed=1))
    assert engine.runner.steps_done == 2


def test_weight_store_is_passed_to_the_executor_per_run() -> None:
    engine = _engine("pipedream")
    seen = []
    run = engine.executor.run

    def spying(*args, **kwargs):
        seen.append(kwargs.get("weights"))
        return run(*args, **kwargs)
    engine.executor.run = spying
    engine.train_step(_batches())
    assert seen and all(store is not None for store in seen)
    assert not hasattr(engine.executor, "weights")


def test_asynchronous_run_refuses_a_new_shape_as_a_data_error() -> None:
    engine = _engine("2bw")
    engine.train_step(_batches())
    odd = {mb: (x[:1], y[:1]) for mb, (x, y) in _batches(seed=1).items()}
    with pytest.raises(DataError, match="same shape"):
        engine.train_step(odd)


def test_evaluation_between_asynchronous_steps() -> None:
    engine = _engine("pipedream")
    engine.train_step(_batches())
    assert torch.isfinite(torch.tensor(engine.evaluate(_batches(seed=2))))
    engine.train_step(_batches(seed=3))
