"""Both engines implement the one interface the trainer drives (``engine_protocol.Engine``), and
the trainer drives it without asking which engine it holds. The engines are built in a Gloo world
of one process."""
from __future__ import annotations

import ast
import inspect
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from models import build_model
from pipedream.config.run_spec import build_run_spec
from pipedream.harmony.engine import HarmonyEngine
from pipedream.runtime.engine import PipelineEngine
from pipedream.runtime.engine_protocol import Engine
from pipedream.runtime.groups import build_groups
from tests.support.training_harness import TINY_GPT, compose_config
from tests.support.single_process import world_of_one as one_rank_world

MLP = ["model=mlp", "data=synthetic", "model.num_layers=2", "model.hidden_size=8", "parallel.pp=1",
       "train.global_batch_size=8", "train.micro_batch_size=2", "train.steps=2"]
HARMONY = TINY_GPT + ["schedule=harmony_pp", "parallel.pp=1", "train.grad_clip=0", "optim=sgd",
                      "model.tie_embeddings=false"]
TRAINER = Path(__file__).resolve().parents[3] / "pipedream" / "trainer.py"


def protocol_members() -> tuple[set[str], set[str], set[str]]:
    """The protocol's data attributes, properties and methods."""
    own = {name: value for name, value in vars(Engine).items() if not name.startswith("_")}
    properties = {name for name, value in own.items() if isinstance(value, property)}
    methods = {name for name, value in own.items() if inspect.isfunction(value)}
    return set(Engine.__annotations__), properties, methods


def parameters(function) -> list[tuple]:
    """Names, kinds and defaults (annotations may name the engine's own types)."""
    return [(p.name, p.kind, p.default) for p in inspect.signature(function).parameters.values()]


@pytest.mark.parametrize("engine_class", [PipelineEngine, HarmonyEngine])
def test_each_engine_class_has_the_protocols_methods_and_properties(engine_class: type) -> None:
    _, properties, methods = protocol_members()
    assert methods and properties
    for name in properties:
        assert isinstance(inspect.getattr_static(engine_class, name, None), property), name
    for name in methods:
        implementation = inspect.getattr_static(engine_class, name, None)
        assert inspect.isfunction(implementation), name
        assert parameters(implementation) == parameters(getattr(Engine, name)), name


@pytest.fixture(scope="module")
def world_of_one():
    with one_rank_world():
        yield


def _built(overrides: list[str]) -> Engine:
    spec = build_run_spec(compose_config(overrides), world_size=1)
    model = build_model(spec.model_config, seed=spec.train.seed)
    if spec.harmony is not None:
        return HarmonyEngine(spec, model, 0, torch.device("cpu"), spec.optim, spec.train, timedelta(seconds=30))
    groups = build_groups(spec.layout, 0, "cpu", model, list(spec.bounds))
    return PipelineEngine(spec, model, 0, torch.device("cpu"), groups, spec.optim, spec.train, timedelta(seconds=30))


@pytest.mark.parametrize("overrides", [MLP, HARMONY], ids=["pipeline", "harmony"])
def test_a_built_engine_is_an_engine(world_of_one, overrides: list[str]) -> None:
    engine = _built(overrides)
    assert isinstance(engine, Engine)
    attributes, _, _ = protocol_members()
    for name in attributes:
        assert hasattr(engine, name), name
    assert engine.comm_bytes() == (0, 0) and engine.fusion_report() is None and engine.model_val_losses() == []


def test_the_trainer_does_not_probe_its_engine() -> None:
    calls = [node for node in ast.walk(ast.parse(TRAINER.read_text(encoding="utf-8")))
             if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)]
    probes = [ast.unparse(node) for node in calls if node.func.id in ("getattr", "hasattr")
              or (node.func.id == "isinstance" and "engine" in ast.unparse(node.args[0]))]
    assert probes == []
