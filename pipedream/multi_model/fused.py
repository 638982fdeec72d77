"""Horizontal fusion: layer i of K models runs as one operator over K stacked copies of its
parameters (``torch.func.functional_call`` under ``torch.vmap``: a Linear becomes a batched
matmul, a convolution a batched one), on inputs stacked along a new leading model dimension.

Each model keeps its own ``Parameter`` leaves (``models.<k>.<name>``): the stacked weights are
built by ``torch.stack`` inside the forward, so autograd hands every model its own gradient, and
the optimizer, clipping, checkpoints and export see K ordinary models. The fusion degree splits
the K models into groups that run one after another (μ-two's partial fusion); it changes speed
and memory only, never values.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn
from torch.func import functional_call
from torch.nn.attention import SDPBackend, sdpa_kernel

from models.contract import layer_type_name, meta_copy
from models.spec import LayerModel

from pipedream.errors import ConfigError
from pipedream.config.multi_model import MultiModelSpec

MODEL_DIM = 0   # stacked inputs, outputs, parameters: model k at index k of dimension 0

VMAP_SAFE_ATTENTION = (SDPBackend.FLASH_ATTENTION, SDPBackend.MATH)


class NotFusableError(ValueError):
    """A layer whose K copies cannot run as one operator; the message says which and why."""


def _signature(module: nn.Module) -> list[tuple[str, str, tuple, torch.dtype]]:
    tensors = [("param", n, p) for n, p in module.named_parameters()] + \
              [("buffer", n, b) for n, b in module.named_buffers()]
    return [(kind, name, tuple(t.shape), t.dtype) for kind, name, t in tensors]


def stack_values(values: list[Any]) -> Any:
    """Stacks K tensors (or K tuples of tensors, member by member) along the model dimension."""
    if isinstance(values[0], (tuple, list)):
        return tuple(stack_values([v[j] for v in values]) for j in range(len(values[0])))
    return torch.stack(values, MODEL_DIM)


def model_slice(value: Any, start: int, stop: int) -> Any:
    if isinstance(value, (tuple, list)):
        return tuple(model_slice(v, start, stop) for v in value)
    return value[start:stop]


def model_item(value: Any, index: int) -> Any:
    if isinstance(value, (tuple, list)):
        return tuple(model_item(v, index) for v in value)
    return value[index]


def _concat(parts: list[Any]) -> Any:
    if len(parts) == 1:
        return parts[0]
    if isinstance(parts[0], tuple):
        return tuple(_concat([p[j] for p in parts]) for j in range(len(parts[0])))
    return torch.cat(parts, MODEL_DIM)


class FusedLayer(nn.Module):
    """Layer i of K models as one module: ``models.<k>`` holds model k's own layer (its state),
    the forward runs all of them at once, ``groups`` at a time."""

    def __init__(self, layers: list[nn.Module], layer_index: int, groups: int = 1):
        super().__init__()
        first = _signature(layers[0])
        for k, layer in enumerate(layers[1:], start=1):
            if type(layer) is not type(layers[0]) or _signature(layer) != first:
                raise NotFusableError(f"layer {layer_index} ({type(layers[0]).__name__}) differs between model 0 "
                                      f"and model {k} (class, parameter names or shapes): only identical "
                                      f"architectures fuse")
        for k, layer in enumerate(layers):
            for param in layer.parameters():
                param.model_index = k   # per-model optimizer groups and clipping (pipedream.multi_model.training)
        self.models = nn.ModuleList(layers)
        self.layer_index = layer_index
        self.groups = groups
        # functional_call replaces every parameter and buffer: the template holds no data, and is
        # not a submodule, so it has no state of its own
        self.__dict__["_template"] = meta_copy(layers[0])

    def _stacked_state(self, start: int, stop: int) -> dict[str, torch.Tensor]:
        members = self.models[start:stop]
        state = {}
        for name, _ in members[0].named_parameters():
            state[name] = torch.stack([m.get_parameter(name) for m in members], MODEL_DIM)
        for name, _ in members[0].named_buffers():
            state[name] = torch.stack([m.get_buffer(name) for m in members], MODEL_DIM)
        return state

    def _run_group(self, start: int, stop: int, inputs: tuple) -> Any:
        template = self._template
        template.train(self.training)

        def one_model(state: dict[str, torch.Tensor], *args: Any) -> Any:
            return functional_call(template, state, args)

        def run(state: dict[str, torch.Tensor], *group_inputs: Any) -> Any:
            # CUDA's memory-efficient attention fails in its backward under vmap ("LSE is not
            # correctly aligned"); the flash and math kernels do not (CPUs have only these two)
            with sdpa_kernel(list(VMAP_SAFE_ATTENTION)):
                outputs = torch.vmap(one_model, in_dims=MODEL_DIM, randomness="different")(state, *group_inputs)
            self._write_back_buffers(state, start, stop)
            return outputs

        group_inputs = tuple(model_slice(x, start, stop) for x in inputs)
        memory = self.__dict__.get("memory")   # a device budget: pipedream.multi_model.memory
        if memory is None:
            return run(self._stacked_state(start, stop), *group_inputs)
        parameters = [p for member in self.models[start:stop] for p in member.parameters()]
        return memory.run(self.layer_index, start // (stop - start), run, lambda: self._stacked_state(start, stop),
                          group_inputs, parameters)

    def _write_back_buffers(self, state: dict[str, torch.Tensor], start: int, stop: int) -> None:
        """A layer that updates its buffers in place (batch-norm running statistics) updated the
        stacked copies: each model keeps its own, as it would alone."""
        with torch.no_grad():
            for name, _ in self.models[start].named_buffers():
                for k, member in enumerate(self.models[start:stop]):
                    member.get_buffer(name).copy_(state[name][k])

    def forward(self, *inputs: Any) -> Any:
        count = len(self.models)
        size = count // self.groups
        return _concat([self._run_group(s, s + size, inputs) for s in range(0, count, size)])


@dataclass
class PerModelLosses:
    """Sums of each model's loss over the micro-batches since ``take``: training (with autograd)
    and evaluation kept apart."""

    count: int
    sums: dict[bool, list[float]] = field(default_factory=dict)
    calls: dict[bool, int] = field(default_factory=dict)

    def add(self, losses: list[torch.Tensor]) -> None:
        training = torch.is_grad_enabled()
        sums = self.sums.setdefault(training, [0.0] * self.count)
        for k, loss in enumerate(losses):
            sums[k] += float(loss.detach())
        self.calls[training] = self.calls.get(training, 0) + 1

    def take(self, training: bool) -> tuple[list[float], int]:
        return self.sums.pop(training, [0.0] * self.count), self.calls.pop(training, 0)


@dataclass(frozen=True)
class FusedLayerModel(LayerModel):
    """K models of one architecture as one ``LayerModel`` whose layers are ``FusedLayer``s; its
    batches are the K models' batches stacked, its loss the sum of theirs."""

    members: tuple[LayerModel, ...] = ()
    losses: PerModelLosses | None = None
    settings: MultiModelSpec | None = None


def fused_loss(loss_fn: Callable[[Any, Any], torch.Tensor], count: int, losses: PerModelLosses
               ) -> Callable[[Any, Any], torch.Tensor]:
    """Model k's loss on its own slice; the sum backpropagates each model's gradient alone."""
    def loss(outputs: Any, targets: Any) -> torch.Tensor:
        per_model = [loss_fn(model_item(outputs, k), model_item(targets, k)) for k in range(count)]
        losses.add(per_model)
        return torch.stack(per_model).sum()
    return loss


def fuse_models(members: list[LayerModel], settings: MultiModelSpec, groups: int = 1) -> FusedLayerModel:
    """The fused model of ``members`` (one architecture, one model per seed or setting)."""
    count, first = len(members), members[0]
    for k, member in enumerate(members[1:], start=1):
        if member.num_layers != first.num_layers:
            raise NotFusableError(f"model {k} has {member.num_layers} layers and model 0 {first.num_layers}: "
                                  f"only identical architectures fuse")

    def build_layer(i: int) -> nn.Module:
        return FusedLayer([member.build_layer(i) for member in members], i, groups)

    def make_batch(batch_size: int, generator: torch.Generator) -> tuple[Any, Any]:
        batches = [member.make_batch(batch_size, generator) for member in members]
        return stack_values([b[0] for b in batches]), stack_values([b[1] for b in batches])

    tied = tuple(tuple((i, f"models.{k}.{name}") for i, name in group) for k in range(count) for group in first.tied)
    losses = PerModelLosses(count)
    return FusedLayerModel(name=f"{first.name}x{count}", num_layers=first.num_layers, build_layer=build_layer,
                           loss_fn=fused_loss(first.loss_fn, count, losses), make_batch=make_batch, tied=tied,
                           members=tuple(members), losses=losses, settings=settings)


def fused_layers(modules: Any) -> list[FusedLayer]:
    return [m for m in modules if isinstance(m, FusedLayer)]


def check_fusable(model: FusedLayerModel, batch_size: int = 2) -> None:
    """Runs the fused layers once on the meta device (forward and backward); a layer that cannot
    run under ``vmap`` (an in-place update of a buffer, data-dependent control flow, ...) raises
    ``NotFusableError`` naming it and the reason."""
    with torch.device("meta"):
        built = model.build()
        value = model.make_batch(batch_size, torch.Generator().manual_seed(0))[0]
    from models.boundary import call_layer
    for i in range(model.num_layers):
        layer = built[i]
        try:
            value = call_layer(layer, value)
        except Exception as error:   # noqa: BLE001 - any failure of the fused call is the reason to refuse
            text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            reason = text.split(". ")[0]
            inner = layer_type_name(layer.models[0])
            raise NotFusableError(f"layer {i} ({inner}) cannot run fused under torch.vmap: {reason}") from None


def build_fused_model(model_cfg: Any, multi: MultiModelSpec) -> Any:
    """The fused ``LayerModel`` of the K variants of the ``model`` section (each built as a run with
    its seed builds it); ``ConfigError`` naming the layer that cannot fuse and why."""
    from models import build_model

    members = [build_model(model_cfg, seed=variant.seed) for variant in multi.variants]
    try:
        fused = fuse_models(members, multi, groups=multi.fusion_groups or 1)
        check_fusable(fused)
    except NotFusableError as error:
        raise ConfigError(f"train.models={multi.count}: {error}: train these models one by one "
                          f"(train.models=null)") from None
    return fused
