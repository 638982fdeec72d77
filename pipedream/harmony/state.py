"""Where harmony_pp keeps the model state, and how a pack's state comes onto a device and leaves.

Every layer's fp32 weights live once, in a host tier in shared memory that every rank of the
server maps (``offload.HostTier`` with a folder under /dev/shm): any rank can swap in any pack,
and the rank that updates a layer writes its new weights there in place, so no weights travel
between ranks. A layer's gradients and optimizer state belong to its owner, the rank that runs
its backward (and update): gradients go to the owner's host tier as a backward group ends,
the optimizer (torch's, over parameters that alias the host weights) steps there, and its state
never moves. The modules a rank builds keep empty parameters except while their pack is on the
device (``swap_in`` points them at the device copies).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable, Iterable

import torch
from torch import nn

from pipedream.errors import InvariantError
from pipedream.offload import DeviceTier, HostTier, TensorClass

_EMPTY = torch.empty(0)


def weight_key(layer: int, name: str) -> tuple:
    return ("w", layer, name)


def grad_key(layer: int, name: str, replica: int | None = None) -> tuple:
    """A layer's gradient on the host; harmony_dp keeps one per replica (device) until the update."""
    return ("g", layer, name) if replica is None else ("g", layer, name, replica)


@dataclass(frozen=True)
class Replicas:
    """harmony_dp: ``count`` devices each run every pack; this one is ``index``."""
    count: int
    index: int


class PackState:
    """This rank's layers (``modules``: layer -> module, built from the per-layer seeds) over the
    shared host tier ``host`` and the device tier ``device``. ``owned``: the layers it updates.
    With ``replicas`` (harmony_dp) every replica writes its gradients of every layer to a file of
    its own that the layer's owner maps, and the owner sums them before the update."""

    def __init__(self, modules: dict[int, nn.Module], owned: set[int], host: HostTier, device: DeviceTier,
                 barrier: Callable[[], None], replicas: Replicas | None = None,
                 tied: Iterable[Iterable[tuple[int, str]]] = ()):
        """``tied``: groups of (layer, name) that are one parameter (``LayerModel.tied``): every
        member swaps in the first member's host weights, and the first member's owner updates them
        with the sum of every member's gradients."""
        self.modules, self.owned, self.host, self.device = modules, owned, host, device
        self.barrier, self.replicas = barrier, replicas
        self.tied = {member: group[0] for group in map(tuple, tied) for member in group[1:]}
        self.collective = replicas is not None or bool(self.tied)   # final_gradients meets every rank
        self.params = {layer: list(module.named_parameters()) for layer, module in modules.items()}
        published = [(layer, name) for layer in sorted(owned) for name, _ in self.params[layer]
                     if (layer, name) not in self.tied]
        for layer, name in published:   # the owner publishes the initial weights ...
            host.put(weight_key(layer, name), dict(self.params[layer])[name].detach())
        barrier()
        for layer, named in self.params.items():   # ... every other user maps them
            for name, param in named:
                if self._weight_key(layer, name) not in host:
                    host.allocate(self._weight_key(layer, name), param.shape, param.dtype, create=False)
        barrier()
        for layer, name in published:
            host.unlink(weight_key(layer, name))   # mapped everywhere: the file can go
        for named in self.params.values():
            for _, param in named:
                param.data = _EMPTY
        # trainable (requires_grad) as the model's own: checkpoints save optimizer state only for those
        self.host_params = {(layer, name): nn.Parameter(host.get(weight_key(layer, name))) for layer, name in published}
        if self.collective:
            self._share_gradients(barrier)

    def _weight_key(self, layer: int, name: str) -> tuple:
        """Where the weights of (layer, name) live on the host: a tied member's are its group's first."""
        return weight_key(*self.tied.get((layer, name), (layer, name)))

    def _grad_key(self, layer: int, name: str, replica: int | None = None) -> tuple:
        if self.replicas is None:
            return grad_key(layer, name)
        return grad_key(layer, name, self.replicas.index if replica is None else replica)

    def _replicas(self) -> range:
        return range(self.replicas.count) if self.replicas is not None else range(1)

    def _summed(self, layer: int, name: str) -> list[tuple[int, str]]:
        """The gradients an owned master parameter's update sums: its own and its tied members'."""
        return [(layer, name)] + [member for member, first in self.tied.items() if first == (layer, name)]

    def _share_gradients(self, barrier: Callable[[], None]) -> None:
        """Gradient files that another rank reads: harmony_dp's per-replica gradients of every
        layer (read by its owner), and a tied member's (read by its group's first member's owner).
        Each writer creates its files, the readers map them, and the files go once mapped."""
        shapes = {(layer, name): param.shape for layer, named in self.params.items() for name, param in
                  ((n, self.host.get(self._weight_key(layer, n))) for n, _ in named)}
        writes = [(layer, name) for layer, named in self.params.items() for name, _ in named
                  if self.replicas is not None or (layer in self.owned and (layer, name) in self.tied)]
        for layer, name in writes:
            self.host.allocate(self._grad_key(layer, name), shapes[(layer, name)])
        barrier()
        for layer, name in self.host_params:
            for member in self._summed(layer, name):
                if self.replicas is None and member == (layer, name):
                    continue   # harmony_pp: its own gradients are its own backward's (created at their first swap-out)
                for replica in self._replicas():
                    key = grad_key(*member, replica) if self.replicas is not None else grad_key(*member)
                    if key not in self.host:
                        self.host.allocate(key, shapes.get(member, shapes[(layer, name)]), create=False)
        barrier()
        for layer, name in writes:
            self.host.unlink(self._grad_key(layer, name))

    def final_gradients(self, layers: Iterable[int]) -> dict[tuple[int, str], torch.Tensor]:
        """The host gradients the update of ``layers`` (owned) uses, by master parameter. With
        replicas or ties it is collective (every rank calls it once per step, after its backward):
        the sum over the replicas (in replica order; each scaled its loss by one over the
        micro-batches of all replicas) and over a tied group's members."""
        layers = list(layers)
        if not self.collective:
            return {(layer, name): self.host.get(grad_key(layer, name)) for layer in layers
                    for name, _ in self.params[layer]}
        self.barrier()   # every rank's gradients are on the host
        sums = {}
        for layer in layers:
            for name, _ in self.params[layer]:
                if (layer, name) in self.tied:
                    continue   # summed into its group's first member
                total = None
                for member in self._summed(layer, name):
                    for replica in self._replicas():
                        key = grad_key(*member, replica) if self.replicas is not None else grad_key(*member)
                        total = self.host.get(key).clone() if total is None else total.add_(self.host.get(key))
                sums[(layer, name)] = total
        return sums

    def weight_bytes(self, layers: Iterable[int]) -> int:
        return sum(p.numel() * p.element_size() for layer in layers for _, p in self._named_host(layer))

    def _named_host(self, layer: int) -> list[tuple[str, torch.Tensor]]:
        return [(name, self.host.get(self._weight_key(layer, name))) for name, _ in self.params[layer]]

    def prefetch(self, layers: Iterable[int]) -> None:
        for layer in layers:
            for name, _ in self.params[layer]:
                self.device.prefetch(weight_key(layer, name), TensorClass.WEIGHTS, host_key=self._weight_key(layer, name))

    def swap_in(self, layers: Iterable[int], grads: str | None = None) -> None:
        """The pack's weights onto the device; ``grads``: "zero" (a backward task's first group)
        or "host" (a later group continues the sum) gives every parameter a device gradient."""
        for layer in layers:
            for name, param in self.params[layer]:
                param.data = self.device.swap_in(weight_key(layer, name), TensorClass.WEIGHTS,
                                                 host_key=self._weight_key(layer, name))
                if grads == "zero":
                    param.grad = self.device.allocate(self._grad_key(layer, name), param.shape, param.dtype,
                                                      TensorClass.GRADIENTS)
                elif grads == "host":
                    param.grad = self.device.swap_in(self._grad_key(layer, name), TensorClass.GRADIENTS)

    def swap_out(self, layers: Iterable[int], grads: bool) -> None:
        """The pack leaves the device: weights are dropped (the host copy is current); with
        ``grads`` the accumulated gradients are written to the host tier first."""
        for layer in layers:
            for name, param in self.params[layer]:
                if grads:
                    key = self._grad_key(layer, name)
                    if param.grad is not self.device.get(key):
                        raise InvariantError(f"layer {layer} {name}: autograd replaced the gradient buffer")
                    created = key not in self.host
                    self.device.swap_out(key)
                    if created:
                        self.host.unlink(key)   # only this rank reads it: no file needed
                    param.grad = None
                param.data = _EMPTY
                self.device.swap_out(weight_key(layer, name), write_back=False)

    def update(self, layers: Iterable[int], optimizer: torch.optim.Optimizer,
               grads: dict[tuple[int, str], torch.Tensor] | None = None) -> None:
        """The optimizer step of ``layers`` on the host tier with ``grads`` (default: their host
        gradients, ``final_gradients``); the other parameters have no gradient, so the step leaves
        them alone."""
        layers = list(layers)
        if grads is None:
            grads = self.final_gradients(layers)
        stepped = []
        for layer in layers:
            if layer not in self.owned:
                raise InvariantError(f"layer {layer} is updated on a rank that does not own it")
            for name, _ in self.params[layer]:
                if (layer, name) in self.tied:
                    continue   # stepped as its group's first member
                host_param = self.host_params[(layer, name)]
                host_param.grad = grads[(layer, name)]
                stepped.append(host_param)
        if stepped:
            optimizer.step()
        for host_param in stepped:
            host_param.grad = None

    @staticmethod
    def gradient_squares(grads: dict[tuple[int, str], torch.Tensor]) -> float:
        """Sum of the squared per-tensor L2 norms (fp64)."""
        return sum(float(torch.linalg.vector_norm(g).double()) ** 2 for g in grads.values())

    @staticmethod
    def scale_gradients(grads: dict[tuple[int, str], torch.Tensor], factor: float) -> None:
        for g in grads.values():
            g.mul_(factor)

    def owned_modules(self) -> dict[int, nn.Module]:
        """The layers this rank owns, as modules whose parameters are the host master weights the
        optimizer steps (checkpoints save and load through them: a load writes the shared host
        tier in place, so every rank that maps a layer sees it)."""
        mirrors = {}
        for layer in sorted(self.owned):
            mirror = copy.deepcopy(self.modules[layer])   # the structure and names; its own weights are empty
            for name, _ in self.params[layer]:
                owner, _, leaf = name.rpartition(".")
                master = self.host_params.get(self.tied.get((layer, name), (layer, name)))
                if master is None:   # a tied member whose group's first member another rank owns (and saves)
                    del mirror.get_submodule(owner)._parameters[leaf]
                else:
                    mirror.get_submodule(owner)._parameters[leaf] = master
            mirrors[layer] = mirror
        return mirrors

    def parameters_by_name(self) -> dict[str, torch.Tensor]:
        """``{"<layer>.<name>": tensor}`` of the layers this rank owns (host copies), with the
        tied members of the groups whose first member it owns."""
        named = {f"{layer}.{name}": p.detach() for (layer, name), p in self.host_params.items()}
        for member, first in self.tied.items():
            if first in self.host_params:
                named[f"{member[0]}.{member[1]}"] = self.host_params[first].detach()
        return named
