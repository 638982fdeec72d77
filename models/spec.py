"""A model as an ordered list of layers plus a loss: the unit that pipelines split."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn


@dataclass(frozen=True)
class LayerModel:
    """Describes a model without building it.

    ``build_layer(i)`` builds layer i alone, with the same initial weights on every process (each
    layer is initialised from its own seed), so a pipeline stage builds only what it owns and
    still starts from the weights of single-process training.
    ``make_batch(batch_size, generator)`` returns a random (input, target) pair of the right
    shapes and dtypes, for profiling and shape inference.
    ``tied`` lists groups of (layer index, parameter name) that are one parameter in the
    single-process model (e.g. the embedding and the output head); a stage holding several
    members shares one Parameter, stages holding different members all-reduce their gradients.
    """

    name: str
    num_layers: int
    build_layer: Callable[[int], nn.Module]
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    make_batch: Callable[[int, torch.Generator], tuple[torch.Tensor, torch.Tensor]]
    tied: tuple[tuple[tuple[int, str], ...], ...] = field(default=())

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

    def build_sequential(self) -> nn.Sequential:
        layers = self.build()
        return nn.Sequential(*(layers[i] for i in range(self.num_layers)))


def seeded(seed: int, build: Callable[[], nn.Module]) -> nn.Module:
    """Runs ``build`` under its own RNG seed without disturbing the caller's RNG stream."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build()
