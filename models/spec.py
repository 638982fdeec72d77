"""A model as an ordered list of layers plus a loss: the unit that pipelines split (the public
contract, docs/models.md; ``models.contract`` builds one from modules)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from models.boundary import call_layer


@dataclass(frozen=True)
class LayerModel:
    """Describes a model without building it.

    Layer i takes what layer i - 1 returned: a tensor, or a tuple of tensors unpacked into its
    arguments (e.g. ``forward(self, hidden, mask)`` returning ``(hidden, mask)``); layer 0 takes the
    batch's input the same way, and ``loss_fn(output of the last layer, target)`` returns a scalar.
    ``build_layer(i)`` builds layer i alone, with the same initial weights on every process (each
    layer is initialised from its own seed), so a pipeline stage builds only what it owns and
    still starts from the weights of single-process training.
    ``make_batch(batch_size, generator)`` returns a random (input, target) pair of the right
    shapes and dtypes (either may be a tuple of tensors), for profiling and shape inference.
    ``tied`` lists groups of (layer index, parameter name) that are one parameter in the
    single-process model (e.g. the embedding and the output head); a stage holding several
    members shares one Parameter, stages holding different members all-reduce their gradients.
    ``statistics``: an object the built layers report to and the runtime drives, or None: it sets
    ``statistics.loss_scale`` (what it multiplies each micro-batch's loss by) before every forward,
    and at logged steps reads ``statistics.sums()`` (numbers summed over ranks) into
    ``statistics.report(sums)`` (metrics.jsonl fields). ``models.families.moe.MoEStatistics`` is one.
    """

    name: str
    num_layers: int
    build_layer: Callable[[int], nn.Module]
    loss_fn: Callable[[Any, Any], torch.Tensor]
    make_batch: Callable[[int, torch.Generator], tuple[Any, Any]]
    tied: tuple[tuple[tuple[int, str], ...], ...] = field(default=())
    statistics: Any = None

    def build(self, indices: list[int] | None = None) -> dict[int, nn.Module]:
        """Builds the given layers (all by default) and ties shared parameters among them."""
        indices = list(range(self.num_layers)) if indices is None else list(indices)
        layers = {i: self.build_layer(i) for i in indices}
        for group in self.tied:
            present = [(i, name) for i, name in group if i in layers]
            if len(present) > 1:
                owner_index, owner_name = present[0]
                shared = layers[owner_index].get_parameter(owner_name)
                for i, name in present[1:]:
                    module_path, _, attr = name.rpartition(".")
                    module = layers[i].get_submodule(module_path) if module_path else layers[i]
                    setattr(module, attr, shared)
        return layers

    def build_sequential(self) -> PipelineSequential:
        layers = self.build()
        return PipelineSequential(*(layers[i] for i in range(self.num_layers)))


class PipelineSequential(nn.Sequential):
    """``nn.Sequential`` whose layers may pass tuples: a tuple returned by one layer is unpacked
    into the next layer's arguments. Called with several arguments, the first layer gets them all."""

    def forward(self, *inputs: Any) -> Any:
        value = inputs[0] if len(inputs) == 1 else inputs
        for layer in self:
            value = call_layer(layer, value)
        return value


def seeded(seed: int, build: Callable[[], nn.Module]) -> nn.Module:
    """Runs ``build`` under its own RNG seed without disturbing the caller's RNG stream."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build()
