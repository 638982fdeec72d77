"""Horizontal fusion: layer i of K models runs as one operator over their parameters stacked along
a leading model dimension, on inputs stacked the same way (``[K, batch, ...]``).

A fused layer holds one ``[K, ...]`` Parameter per parameter of the layer (and one stacked tensor
per buffer), so autograd, the optimizer and gradient clipping work on K models at once and no
forward copies a weight. It runs in one of two ways, decided once per layer:

- folded: every module of the layer that holds state has a batched twin (``twins``), and the
  layer keeps the batch dimension first (checked on the meta device with two batch sizes); the
  model dimension is folded into the batch dimension and the layer's own code runs once, its
  twins computing each model with its own weights (one batched matmul per Linear, one attention
  call over K*B sequences);
- under ``torch.vmap`` over ``functional_call`` of the layer with the stacked state (any other
  layer: a module with no twin, a parameter used directly, an input without the batch dimension).

The edges see K ordinary models: ``per_model_module`` presents model k's parameters under their
own names (``models.<k>.<name>``) as views of the stacks, which checkpoints save and load in place
and the optimizer steps (``training``). The fusion degree splits the K models into groups that run
one after another on slices of the stacks (μ-two's partial fusion); it changes speed and memory
only, never values.
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
from pipedream.multi_model.spec import MultiModelSpec
from pipedream.multi_model.twins import batched_twin, holds_state

MODEL_DIM = 0   # stacked inputs, outputs, parameters: model k at index k of dimension 0
BODY = "body"   # the fused layer's submodule holding the stacked state
PROBE_BATCHES = (7, 11)   # batch sizes of the meta-device check that a layer folds

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


def model_items(value: Any) -> list[Any]:
    """Each model's part, by ``unbind`` (its backward writes all K gradients at once, where K
    indexings would each fill a zero tensor of the whole stack)."""
    if isinstance(value, (tuple, list)):
        return list(zip(*(model_items(v) for v in value)))
    return list(value.unbind(MODEL_DIM))


def _concat(parts: list[Any]) -> Any:
    if len(parts) == 1:
        return parts[0]
    if isinstance(parts[0], tuple):
        return tuple(_concat([p[j] for p in parts]) for j in range(len(parts[0])))
    return torch.cat(parts, MODEL_DIM)


def _owner(root: nn.Module, name: str) -> tuple[nn.Module, str]:
    path, _, attr = name.rpartition(".")
    return (root.get_submodule(path) if path else root), attr


def _stack_state(layers: list[nn.Module]) -> nn.Module:
    """``layers[0]`` with each parameter and buffer replaced by the K layers' values stacked."""
    body = layers[0]
    for name, param in list(body.named_parameters()):
        stacked = torch.stack([layer.get_parameter(name).detach() for layer in layers], MODEL_DIM)
        owner, attr = _owner(body, name)
        setattr(owner, attr, nn.Parameter(stacked, requires_grad=param.requires_grad))
    for name, _ in list(body.named_buffers()):
        owner, attr = _owner(body, name)
        persistent = attr not in owner._non_persistent_buffers_set
        owner.register_buffer(attr, torch.stack([layer.get_buffer(name) for layer in layers], MODEL_DIM),
                              persistent=persistent)
    return body


def _with_twins(body: nn.Module) -> nn.Module | None:
    """``body`` with every module holding state replaced by its batched twin (sharing the stacks),
    or None (and ``body`` unchanged) where one has none."""
    holders = [(name, module) for name, module in body.named_modules() if holds_state(module)]
    twins = [(name, batched_twin(module)) for name, module in holders]
    if any(twin is None for _, twin in twins):
        return None
    for name, twin in twins:
        if not name:
            return twin
        owner, attr = _owner(body, name)
        setattr(owner, attr, twin)
    return body


def model_views(param: torch.Tensor) -> list[nn.Parameter]:
    """Model k's parameter as a Parameter sharing the stack's memory (one list per stack, so a
    stack tied between layers has one set of views)."""
    views = getattr(param, "_model_views", None)
    if views is None or views[0].data_ptr() != param.data_ptr():   # none yet, or the stack has moved (.to)
        views = [nn.Parameter(param.detach()[k], requires_grad=param.requires_grad) for k in range(param.shape[0])]
        param._model_views = views
    return views


def _put(root: nn.Module, name: str, value: torch.Tensor, parameter: bool) -> None:
    owner = root
    *path, attr = name.split(".")
    for part in path:
        if part not in owner._modules:
            owner.add_module(part, nn.Module())
        owner = owner._modules[part]
    if parameter:
        owner.register_parameter(attr, value)
    else:
        owner.register_buffer(attr, value)


def _fold(x: Any) -> Any:
    return x.flatten(0, 1) if isinstance(x, torch.Tensor) else x


def _unfold(y: Any, count: int) -> Any:
    if isinstance(y, (tuple, list)):
        return tuple(_unfold(t, count) for t in y)
    return y.unflatten(0, (count, -1))


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    return [value] if isinstance(value, torch.Tensor) else []


class FusedLayer(nn.Module):
    """Layer i of K models as one module: ``body`` is the layer with its state stacked (its
    stateful modules replaced by batched twins where the layer folds); the forward runs all K
    models at once, ``groups`` at a time."""

    def __init__(self, layers: list[nn.Module], layer_index: int, groups: int = 1):
        super().__init__()
        first = _signature(layers[0])
        for k, layer in enumerate(layers[1:], start=1):
            if type(layer) is not type(layers[0]) or _signature(layer) != first:
                raise NotFusableError(f"layer {layer_index} ({type(layers[0]).__name__}) differs between model 0 "
                                      f"and model {k} (class, parameter names or shapes): only identical "
                                      f"architectures fuse")
        self.count = len(layers)
        self.layer_index = layer_index
        self.groups = groups
        # the layer as one model, for vmap: functional_call replaces every parameter and buffer,
        # so the template holds no data, and it is not a submodule, so it has no state of its own
        self.__dict__["_template"] = meta_copy(layers[0])
        body = _stack_state(layers)
        twinned = _with_twins(body)
        self.body = twinned if twinned is not None else body
        self.__dict__["folds"] = False if twinned is None else None   # None: decided at the first forward

    # --- the edges: K ordinary models ----------------------------------------------------------
    def per_model_module(self) -> nn.Module:
        """``models.<k>.<name>``: model k's parameters and (persistent) buffers by their own names,
        as views of the stacks (saving reads them, loading writes them in place)."""
        view = self.__dict__.get("_per_model")
        if view is None:
            models = nn.ModuleList(nn.Module() for _ in range(self.count))
            for name, param in self.body.named_parameters(remove_duplicate=False):
                for member, alias in zip(models, model_views(param)):
                    _put(member, name, alias, parameter=True)
            for name, buffer in self.body.named_buffers():
                owner, attr = _owner(self.body, name)
                if attr not in owner._non_persistent_buffers_set:
                    for k, member in enumerate(models):
                        _put(member, name, buffer[k], parameter=False)
            view = nn.Module()
            view.models = models
            self.__dict__["_per_model"] = view
        return view

    @property
    def models(self) -> nn.ModuleList:
        return self.per_model_module().models

    # --- the forward ---------------------------------------------------------------------------
    def _state(self, start: int, stop: int) -> dict[str, torch.Tensor]:
        """The stacks, or their slices for a group (all models: the stacks themselves, since a
        slice's backward fills a zero tensor of the whole stack)."""
        whole = start == 0 and stop == self.count
        state = {name: p if whole else p[start:stop] for name, p in self.body.named_parameters()}
        state.update({name: b if whole else b[start:stop] for name, b in self.body.named_buffers()})
        return state

    def _folds(self, inputs: tuple) -> bool:
        """Every input carries the batch dimension, and on the meta device, for two batch sizes,
        every twin receives and the layer returns K*B samples first."""
        if not all(isinstance(x, torch.Tensor) and x.dim() >= 2 for x in inputs):
            return False
        probe = meta_copy(self.body).train(self.training)
        for batch in PROBE_BATCHES:
            seen: list[int] = []
            record = (lambda module, args: seen.append(args[0].shape[0] if args and
                                                       isinstance(args[0], torch.Tensor) else -1))
            hooks = [m.register_forward_pre_hook(record) for m in probe.modules() if holds_state(m)]
            folded = [torch.empty((self.count * batch, *x.shape[2:]), dtype=x.dtype, device="meta") for x in inputs]
            try:
                with torch.no_grad():
                    outputs = _tensors(probe(*folded))
            except Exception:   # noqa: BLE001 - a layer that cannot take folded inputs runs under vmap
                return False
            finally:
                for hook in hooks:
                    hook.remove()
            if not outputs or any(n != self.count * batch for n in seen) or \
                    any(o.dim() == 0 or o.shape[0] != self.count * batch for o in outputs):
                return False
        return True

    def _folded(self, state: dict[str, torch.Tensor] | None, *inputs: Any) -> Any:
        """The layer's own code on the folded batch; ``state``: slices of the stacks (None: all)."""
        folded = tuple(_fold(x) for x in inputs)
        count = inputs[0].shape[MODEL_DIM]
        outputs = self.body(*folded) if state is None else functional_call(self.body, state, folded)
        return _unfold(outputs, count)

    def _vmapped(self, state: dict[str, torch.Tensor], *inputs: Any) -> Any:
        template = self._template
        template.train(self.training)

        def one_model(member_state: dict[str, torch.Tensor], *args: Any) -> Any:
            return functional_call(template, member_state, args)

        # CUDA's memory-efficient attention fails in its backward under vmap ("LSE is not
        # correctly aligned"); the flash and math kernels do not (CPUs have only these two)
        with sdpa_kernel(list(VMAP_SAFE_ATTENTION)):
            return torch.vmap(one_model, in_dims=MODEL_DIM, randomness="different")(state, *inputs)

    def _run_group(self, start: int, stop: int, inputs: tuple) -> Any:
        whole = start == 0 and stop == self.count
        group_inputs = inputs if whole else tuple(model_slice(x, start, stop) for x in inputs)
        run = self._folded if self.folds else self._vmapped
        memory = self.__dict__.get("memory")   # a device budget: pipedream.multi_model.memory
        if memory is None:
            return run(None if whole and self.folds else self._state(start, stop), *group_inputs)
        return memory.run(self.layer_index, start // (stop - start), run, lambda: self._state(start, stop),
                          group_inputs, list(self.parameters()))

    def forward(self, *inputs: Any) -> Any:
        if self.folds is None:
            self.__dict__["folds"] = self._folds(inputs)
        size = self.count // self.groups
        return _concat([self._run_group(s, s + size, inputs) for s in range(0, self.count, size)])


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
        per_model = [loss_fn(o, t) for o, t in zip(model_items(outputs), model_items(targets))]
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

    tied = tuple(tuple((i, f"{BODY}.{name}") for i, name in group) for group in first.tied)
    losses = PerModelLosses(count)
    return FusedLayerModel(name=f"{first.name}x{count}", num_layers=first.num_layers, build_layer=build_layer,
                           loss_fn=fused_loss(first.loss_fn, count, losses), make_batch=make_batch, tied=tied,
                           members=tuple(members), losses=losses, settings=settings)


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
            inner = layer_type_name(layer._template)
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
