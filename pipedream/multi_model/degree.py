"""The fusion degree: K models as G fused groups of K/G (μ-two's partial fusion). Given, or chosen
at start-up by timing this rank's own layers for every G that divides K (values do not depend on
G, so ranks need not agree)."""
from __future__ import annotations

import time
from typing import Any

import torch

from models import boundary
from models.boundary import TupleSpec

from pipedream.multi_model.fused import FusedLayer


def divisors(count: int) -> list[int]:
    return [g for g in range(1, count + 1) if count % g == 0]


def set_fusion_groups(layers: list[FusedLayer], groups: int) -> None:
    for layer in layers:
        layer.groups = groups


def _random_like_spec(spec: Any, generator: torch.Generator, device: torch.device) -> boundary.Boundary:
    if isinstance(spec, TupleSpec):
        return tuple(_random_like_spec(member, generator, device) for member in spec.members)
    shape, dtype = spec
    if dtype.is_floating_point:
        return torch.randn(shape, generator=generator, dtype=dtype).to(device).requires_grad_()
    return torch.zeros(shape, dtype=dtype, device=device)


def stage_inputs(engine: Any) -> list[boundary.Boundary]:
    """A training micro-batch for each of ``engine``'s chunks: a real one for the first stage,
    random values of the boundary's shapes for the others."""
    generator = torch.Generator().manual_seed(0)
    example = engine.model.make_batch(engine.spec.micro_batch, generator)[0]
    key = boundary.shape_key(example)
    inputs = []
    for virtual_stage in engine.virtual_stages:
        if virtual_stage == 0:
            inputs.append(boundary.to_device(example, engine.device))
        else:
            inputs.append(_random_like_spec(engine.boundaries.stage_input(key, virtual_stage), generator,
                                            engine.device))
    return inputs


def _time_once(chunks: list[torch.nn.Module], inputs: list[boundary.Boundary]) -> float:
    started = time.perf_counter()
    for chunk, value in zip(chunks, inputs):
        output = chunk(*value) if isinstance(value, tuple) else chunk(value)
        floats = [t for t in boundary.tensors(output) if t.is_floating_point() and t.requires_grad]
        if floats:
            torch.autograd.backward([t.sum() for t in floats])
    return time.perf_counter() - started


def measure_fusion_groups(chunks: list[torch.nn.Module], inputs: list[boundary.Boundary], count: int,
                          repeats: int = 2) -> dict[int, float]:
    """Seconds of one forward and backward of ``chunks`` per candidate G (best of ``repeats``
    after one warm-up); gradients it leaves are cleared."""
    layers = [layer for chunk in chunks for layer in chunk.modules() if isinstance(layer, FusedLayer)]
    params = [p for chunk in chunks for p in chunk.parameters()]
    timings = {}
    for groups in divisors(count):
        set_fusion_groups(layers, groups)
        _time_once(chunks, inputs)
        timings[groups] = min(_time_once(chunks, inputs) for _ in range(repeats))
    for param in params:
        param.grad = None
    return timings


def choose_fusion_groups(engine: Any, count: int, given: int | None) -> dict[int, float]:
    """Sets every fused layer of ``engine``'s stage to the given G, or to the fastest measured one
    on a training micro-batch's shapes; returns the timings (empty when given)."""
    layers = [layer for chunk in engine.stage.chunks for layer in chunk.modules() if isinstance(layer, FusedLayer)]
    if given is not None:
        set_fusion_groups(layers, given)
        return {}
    timings = measure_fusion_groups(list(engine.stage.chunks), stage_inputs(engine), count)
    set_fusion_groups(layers, min(timings, key=timings.get))
    return timings
