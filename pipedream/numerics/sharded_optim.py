"""The distributed optimizer (``optim.distributed=zero1|zero2|zero3``; ``true`` is zero1): ZeRO
stages 1 to 3, zero1 as Megatron-Core's ``--use-distributed-optimizer``.

A stage's parameters, laid end to end in one flat order (that of ``param_groups``), are cut into
dp contiguous shards, one per data-parallel rank. Each rank keeps optimizer state (AdamW's two
moments, SGD's momentum) for its shard only, so that state takes 1/dp of the memory. The
parameters are fp32 in every precision here (mixed precision autocasts them), so they are the
master weights: a rank's shard of them is updated in place through 1-D views (``pieces``, one
per parameter the shard overlaps) and nothing is copied for it.

Per step: ``reduce_gradients`` (the SYNC) copies the gradients into a flat buffer and
reduce-scatters it over the group, leaving each rank the average of its shard (the full
gradients are dropped: nothing reads an unreduced one); the loss scaler unscales and checks the
shard (``local``), ``GradientSync`` clips by the global norm summed over the shards; ``step``
updates the shard with the inner optimizer and all-gathers the parameters. Element-wise
optimizers make every element's update the one a whole-model optimizer makes.

The all-gather goes bucket by bucket. By default ``step`` waits for it. With
``gather_before(layers)`` (the engine's choice under ``train.overlap_grad_reduce``) ``step`` only
launches the buckets, in the order the forward uses them, and each layer's forward waits for the
buckets that hold its parameters: the gather overlaps the next step's forward, as Megatron-Core's
``--overlap-param-gather``. Whatever reads the parameters outside a layer's forward (the next
``step``, checkpoints, ``drain``) calls ``wait_parameters`` first.

With ``train.overlap_grad_reduce`` the flat order is cut into the gradient buckets of
``grad_buckets`` and every bucket is sharded on its own (rank r owns its r-th 1/dp, padded), so
``ShardedReduction`` reduce-scatters each bucket during the backward, as soon as its gradients
are final, instead of the whole stage at the SYNC.

Checkpoints see a whole-model optimizer (``sharded_state.WholeModelState``).

The levels differ in what a rank holds between steps (docs/design.md, ZeRO-2 and ZeRO-3):

* zero1: whole parameters, the gradient shard (kept allocated) and the state shard; whole
  gradients from the backward to their bucket's reduce-scatter, landed at the SYNC.
* zero2: as zero1, but the gradient shard exists only from the reduce-scatter to the update, and
  with the overlapped reduction a bucket whose reduce-scatter has completed drops its whole
  gradients during the backward (``ShardedReduction``), not at the SYNC.
* zero3: as zero2, but the parameters are sharded at rest: the rank keeps its fp32 shard
  (``_master``, the pieces' storage) and each parameter's storage is freed (resized to 0 bytes,
  so shapes, names and autograd's references stay). A layer's forward pre-hook gathers the
  buckets holding its parameters (and launches the next layer's); they stay whole until the
  SYNC (after the stage's last backward of the step) and are freed there: one all-gather and one
  reduce-scatter per step whatever the micro-batch count. With ``reshard_after_forward``
  (``param_residency.LayerResidency``, fully sharded as FSDP) the buckets are the layers: a
  layer's parameters are whole only around its forward and its backward, and each micro-batch's
  gradients of a layer are reduce-scattered as soon as its backward (its W where split) is done
  and added to the shard (``reduce_into_shard``), so whole gradients exist one layer at a time.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn

from models.tensor_parallel.flat_collectives import reduce_scatter_flat

from pipedream.errors import ConfigError
from pipedream.numerics.param_gathers import ParameterGathers
from pipedream.numerics.sharded_state import WholeModelState


@dataclass(frozen=True)
class ShardedBucket:
    """A contiguous range of the flat order, reduce-scattered as one: rank r owns its r-th 1/dp
    (``per_rank`` elements, the last padded), kept at ``shard_offset`` in the rank's shard."""

    params: list[nn.Parameter]
    begin: int            # where the bucket starts in the flat order
    numel: int
    per_rank: int
    shard_offset: int


@dataclass(frozen=True)
class Piece:
    """The part of one parameter inside this rank's shard."""

    index: int            # the parameter's position in ``param_groups`` order
    param: nn.Parameter   # the whole parameter
    begin: int            # element range within the parameter
    end: int
    shard_offset: int     # where it starts within the shard
    view: nn.Parameter    # a 1-D leaf sharing the parameter's storage (what the inner optimizer updates)


class ShardedOptimizer(ParameterGathers, WholeModelState, torch.optim.Optimizer):
    """``param_groups`` hold the whole parameters (the scheduler and checkpoints use them);
    ``local`` is the optimizer of this rank's pieces. ``buckets`` (lists of parameters) set the
    flat order and cut it into ranges that are sharded one by one, so each can be reduce-scattered
    as soon as its gradients are final (``ShardedReduction``); by default one range, in
    ``param_groups`` order."""

    def __init__(self, groups: list[dict[str, Any]], lr: float, build: Callable[[list[dict[str, Any]]], torch.optim.Optimizer],
                 group: dist.ProcessGroup | None, dp: int, dp_rank: int,
                 buckets: list[list[nn.Parameter]] | None = None, level: int = 1):
        super().__init__(groups, {"lr": lr})
        self.level = level
        self.params = [p for g in self.param_groups for p in g["params"]]
        self.group, self.dp = group, dp
        self.total = sum(p.numel() for p in self.params)
        self.buckets, self.offsets, self.pieces = [], {}, []
        index_of = {id(p): i for i, p in enumerate(self.params)}
        group_of = {id(p): g for g, group_ in enumerate(self.param_groups) for p in group_["params"]}
        views: list[list[nn.Parameter]] = [[] for _ in self.param_groups]
        begin = shard_offset = 0
        for members in buckets if buckets is not None else [self.params]:
            numel = sum(p.numel() for p in members)
            bucket = ShardedBucket(list(members), begin, numel, math.ceil(numel / dp), shard_offset)
            self.buckets.append(bucket)
            lo = begin + dp_rank * bucket.per_rank                  # this rank's range of the flat order
            hi = min(begin + numel, lo + bucket.per_rank)
            offset = begin
            for param in members:
                self.offsets[id(param)] = offset
                a, b = max(lo, offset), min(hi, offset + param.numel())
                if a < b:
                    view = nn.Parameter(param.data.view(-1)[a - offset:b - offset])
                    self.pieces.append(Piece(index_of[id(param)], param, a - offset, b - offset,
                                             shard_offset + a - lo, view))
                    views[group_of[id(param)]].append(view)
                offset += param.numel()
            begin += numel
            shard_offset += bucket.per_rank
        if len(self.offsets) != len(self.params) or begin != self.total:
            raise ValueError("ShardedOptimizer buckets must hold every parameter of param_groups exactly once")
        if not self.pieces:
            raise ConfigError(f"optim.distributed=zero{level}: a stage's {self.total} parameters cannot be shared by "
                              f"dp = {dp} ranks: set optim.distributed=false")
        self.shard_numel = shard_offset
        dtype, device = self.params[0].dtype, self.params[0].device
        self._dtype, self._device = dtype, device
        self._master: torch.Tensor | None = None
        if level == 3:   # the pieces move into the rank's own fp32 shard; the parameters are freed
            _check_own_storage(self.params)
            self._master = torch.zeros(self.shard_numel, dtype=dtype, device=device)
            for piece in self.pieces:
                master = self._master[piece.shard_offset:piece.shard_offset + piece.end - piece.begin]
                master.copy_(piece.view.data)
                piece.view.data = master
        self.local = build([{**{k: v for k, v in g.items() if k != "params"}, "params": mine}
                            for g, mine in zip(self.param_groups, views)])
        # zero1 keeps the gradient shard allocated; zero2/3 only from the reduce-scatter to the update
        self._grad_shard = torch.zeros(self.shard_numel, dtype=dtype, device=device) if level == 1 else None
        # zero1/2: the contiguous copy of the pieces each update all-gathers (zero3 gathers _master)
        self._mine = torch.empty(self.shard_numel, dtype=dtype, device=device) if level < 3 else None
        self._gathers: dict[int, tuple[dist.Work, torch.Tensor]] = {}   # bucket index -> its all-gather in flight
        self._present = set(range(len(self.buckets)))   # buckets whose parameters are whole (zero3: gathered)
        self._overlap_gather = False
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []
        self.observe: Callable[[], Any] | None = None   # samples the bytes held (held_bytes.HeldBytes)
        # LayerResidency: the gradients were reduce-scattered during the backward (the shard sums
        # them, unaveraged); the SYNC reduces what is left and averages; then this is called
        self.after_sync: Callable[[], None] | None = None
        # reduce_into_shard's reduce-scatter in flight: (work, the gradients' copy, the sum, its bucket)
        self._reducing: tuple[dist.Work, torch.Tensor, torch.Tensor, ShardedBucket] | None = None
        if level == 3:
            self.release(range(len(self.buckets)))

    def gradients_reduced(self) -> None:
        """The SYNC is done: the pieces hold the averaged gradients; zero3's parameters have served
        the step's last backward and are freed until the next step's first forward."""
        self.attach_gradients()
        self.release(range(len(self.buckets)))

    def _new_flat(self) -> torch.Tensor:
        """A whole-stage buffer, only while a collective needs it (kept, it would cost more memory
        than SGD's sharded momentum saves)."""
        return torch.empty(self.shard_numel * self.dp, dtype=self._dtype, device=self._device)

    def reduce_gradients(self) -> None:
        """Collective over the group: leaves each piece the average of its gradient over the replicas."""
        if self.after_sync is not None:   # per layer during the backward: the rest, then the average
            self.reduce_into_shard([i for i, b in enumerate(self.buckets) if any(p.grad is not None for p in b.params)])
            self.land_reduction()
            self._grad_shard.div_(self.dp)
            self.after_sync()
            self.gradients_reduced()
            return
        for bucket in self.buckets:
            flat = self.bucket_buffer(bucket)
            for param in bucket.params:
                offset = self.offsets[id(param)] - bucket.begin
                if param.grad is not None:
                    flat[offset:offset + param.numel()].copy_(param.grad.reshape(-1))
            self.reduce_scatter(bucket, flat).wait()
            self.land(bucket)
        self.gradients_reduced()

    @torch.no_grad()   # called from autograd's hooks
    def reduce_into_shard(self, indices: Iterable[int], params: Iterable[nn.Parameter] | None = None) -> None:
        """Collective over the group: adds the sum over the replicas of the gradients of ``params``
        (default: all) in buckets ``indices`` to this rank's gradient shard, and drops them whole. The
        last reduce-scatter stays in flight, under the next layer's backward, until the next call or
        ``land_reduction`` (the SYNC)."""
        wanted = None if params is None else {id(p) for p in params}
        if self._grad_shard is None:
            self._grad_shard = torch.zeros(self.shard_numel, dtype=self._dtype, device=self._device)
        for index in indices:
            self.land_reduction()   # the previous layer's, which ran under this layer's backward
            bucket = self.buckets[index]
            flat = self.bucket_buffer(bucket)
            mine = [p for p in bucket.params if p.grad is not None and (wanted is None or id(p) in wanted)]
            for param in mine:
                offset = self.offsets[id(param)] - bucket.begin
                flat[offset:offset + param.numel()].copy_(param.grad.reshape(-1))
            summed = torch.empty(bucket.per_rank, dtype=self._dtype, device=self._device)
            self._reducing = (reduce_scatter_flat(summed, flat, group=self.group, async_op=True), flat, summed,
                              bucket)
            if self.observe is not None:   # the layer's whole gradients and their copy: where they peak
                self.observe()
            for param in mine:
                param.grad = None

    def land_reduction(self) -> None:
        """Waits for ``reduce_into_shard``'s reduce-scatter in flight, if any, and adds it to the shard."""
        if self._reducing is None:
            return
        work, _, summed, bucket = self._reducing
        work.wait()
        self._reducing = None
        self._grad_shard[bucket.shard_offset:bucket.shard_offset + bucket.per_rank].add_(summed)

    def bucket_buffer(self, bucket: ShardedBucket) -> torch.Tensor:
        """Zeros for ``bucket``'s gradients, padded to dp equal parts."""
        return torch.zeros(bucket.per_rank * self.dp, dtype=self._dtype, device=self._device)

    def reduce_scatter(self, bucket: ShardedBucket, flat: torch.Tensor) -> dist.Work:
        """Sums ``flat`` over the group into this rank's part of the shard, asynchronously."""
        if self._grad_shard is None:
            self._grad_shard = torch.zeros(self.shard_numel, dtype=self._dtype, device=self._device)
        out = self._grad_shard[bucket.shard_offset:bucket.shard_offset + bucket.per_rank]
        return reduce_scatter_flat(out, flat, group=self.group, async_op=True)

    def land(self, bucket: ShardedBucket) -> None:
        """The bucket's reduce-scatter is done: average it and drop the whole gradients (nothing
        reads an unreduced one)."""
        self._grad_shard[bucket.shard_offset:bucket.shard_offset + bucket.per_rank].div_(self.dp)
        for param in bucket.params:
            param.grad = None

    def attach_gradients(self) -> None:
        if self._grad_shard is None:   # no reduce-scatter ran (a stage of no gradient): zeros
            self._grad_shard = torch.zeros(self.shard_numel, dtype=self._dtype, device=self._device)
        for piece in self.pieces:
            piece.view.grad = self._grad_shard[piece.shard_offset:piece.shard_offset + piece.end - piece.begin]

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        """Updates this rank's shard, then all-gathers every parameter. Without reduced gradients
        (DCP's zero-learning-rate step that creates the state) the pieces read their own part of
        the parameters' gradients."""
        for piece in self.pieces:
            if piece.view.grad is None and piece.param.grad is not None:
                piece.view.grad = piece.param.grad.reshape(-1)[piece.begin:piece.end].clone()
        self.wait_parameters()   # the pieces must not be overwritten by a late gather after their update
        for inner, outer in zip(self.local.param_groups, self.param_groups):
            inner["lr"] = outer["lr"]
        self.local.step()
        if self.observe is not None:
            self.observe()
        if self.level < 3:   # zero3's parameters are gathered by the next forward (shard_parameters)
            self._launch_gathers()
            if not self._overlap_gather:
                self.wait_parameters()
        self._drop_grad_shard()
        self._name_state()

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=set_to_none)
        self.local.zero_grad(set_to_none=True)
        self._drop_grad_shard()

    def _drop_grad_shard(self) -> None:
        """zero2/3: no gradient is held between steps (zero1 keeps its shard's buffer)."""
        if self.level >= 2:
            self.local.zero_grad(set_to_none=True)
            self._grad_shard = None

    def state_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for s in self.local.state.values() for t in s.values()
                   if torch.is_tensor(t))

    def held_bytes(self) -> dict[str, int]:
        """Bytes this optimizer holds besides the parameters' and their gradients' own storage:
        the zero3 shard, the gather source and buffers in flight (parameters), the gradient shard
        and a layer's gradients being reduced, the state shard."""
        params = [t for t in (self._master, self._mine) if t is not None]
        params += [gathered for _, gathered in self._gathers.values()]
        grads = [t for t in (self._grad_shard, *(self._reducing or ())[1:3]) if t is not None]
        return {"params": sum(t.numel() * t.element_size() for t in params),
                "grads": sum(t.numel() * t.element_size() for t in grads),
                "optimizer": self.state_bytes()}

    def _land_gather(self, index: int) -> None:
        """Waits for bucket ``index``'s all-gather and writes it into the parameters."""
        pending = self._gathers.pop(index, None)
        if pending is None:
            return
        work, gathered = pending
        work.wait()
        bucket = self.buckets[index]
        for param in bucket.params:
            offset = self.offsets[id(param)] - bucket.begin
            storage = param.untyped_storage()
            if storage.nbytes() == 0:   # zero3: freed since the last gather
                storage.resize_(param.numel() * param.element_size())
            param.data.view(-1).copy_(gathered[offset:offset + param.numel()])
        self._present.add(index)
        if self.observe is not None and self.level == 3:
            self.observe()



def _check_own_storage(params: list[nn.Parameter]) -> None:
    """zero3 frees each parameter's storage: every parameter must be the whole of its own."""
    seen = set()
    for param in params:
        storage = param.untyped_storage()
        if (param.storage_offset() != 0 or not param.is_contiguous()
                or storage.nbytes() != param.numel() * param.element_size() or storage.data_ptr() in seen):
            raise ConfigError(f"optim.distributed=zero3 frees each parameter's storage, but a parameter of shape "
                              f"{tuple(param.shape)} shares its storage: use optim.distributed=zero2")
        seen.add(storage.data_ptr())
