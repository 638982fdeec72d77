"""The distributed optimizer (``optim.distributed=true``): ZeRO stage 1, as Megatron-Core's
``--use-distributed-optimizer``.

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

Checkpoints see a whole-model optimizer: ``state_dict`` all-gathers each moment into the
per-parameter form that an undistributed optimizer of the same kind saves, and ``load_state_dict``
takes the own shard from that form, so DCP saves and resumes into any dp degree, distributed or
not (the gathered copy exists only while a checkpoint is written or read). ``state`` lists, per
parameter, the names of its state (the values live in the shard): DCP reads the names.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn

from models.tensor_parallel.flat_collectives import all_gather_flat, reduce_scatter_flat

from pipedream.errors import ConfigError
from pipedream.numerics.grad_buckets import Bucket, BucketedReduction, ReductionRecorder, make_bucket


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


class ShardedOptimizer(torch.optim.Optimizer):
    """``param_groups`` hold the whole parameters (the scheduler and checkpoints use them);
    ``local`` is the optimizer of this rank's pieces. ``buckets`` (lists of parameters) set the
    flat order and cut it into ranges that are sharded one by one, so each can be reduce-scattered
    as soon as its gradients are final (``ShardedReduction``); by default one range, in
    ``param_groups`` order."""

    def __init__(self, groups: list[dict[str, Any]], lr: float, build: Callable[[list[dict[str, Any]]], torch.optim.Optimizer],
                 group: dist.ProcessGroup | None, dp: int, dp_rank: int,
                 buckets: list[list[nn.Parameter]] | None = None):
        super().__init__(groups, {"lr": lr})
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
            raise ConfigError(f"optim.distributed=true: a stage's {self.total} parameters cannot be shared by dp = {dp} "
                              f"ranks: set optim.distributed=false")
        self.shard_numel = shard_offset
        self.local = build([{**{k: v for k, v in g.items() if k != "params"}, "params": mine}
                            for g, mine in zip(self.param_groups, views)])
        dtype, device = self.params[0].dtype, self.params[0].device
        self._grad_shard = torch.zeros(self.shard_numel, dtype=dtype, device=device)
        self._mine = torch.empty(self.shard_numel, dtype=dtype, device=device)
        self._gathers: dict[int, tuple[dist.Work, torch.Tensor]] = {}   # bucket index -> its all-gather in flight
        self._overlap_gather = False
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []

    def gather_before(self, layers: Iterable[nn.Module]) -> None:
        """From now on ``step`` leaves the parameters' all-gather in flight: each of ``layers`` (every
        parameter of the optimizer belongs to one) waits, before its forward, for the buckets holding
        its parameters. The layers' forwards must go through ``Module.__call__`` (hooks)."""
        bucket_of = {id(p): index for index, bucket in enumerate(self.buckets) for p in bucket.params}
        layers = list(layers)
        covered = {id(p) for layer in layers for p in layer.parameters()}
        if any(id(p) not in covered for p in self.params):
            raise ValueError("gather_before: every parameter of the optimizer must belong to one of the layers")
        for layer in layers:
            needed = tuple(sorted({bucket_of[id(p)] for p in layer.parameters() if id(p) in bucket_of}))
            if needed:
                self._hooks.append(layer.register_forward_pre_hook(partial(self._before_forward, needed)))
        self._overlap_gather = True

    def _before_forward(self, needed: tuple[int, ...], module: nn.Module, args: Any) -> None:
        if self._gathers:
            for index in needed:
                self._land_gather(index)

    def wait_parameters(self) -> None:
        """Every parameter holds the last step's update (no all-gather left in flight)."""
        for index in list(self._gathers):
            self._land_gather(index)

    def _new_flat(self) -> torch.Tensor:
        """A whole-stage buffer, only while a collective needs it (kept, it would cost more memory
        than SGD's sharded momentum saves)."""
        return torch.empty(self.shard_numel * self.dp, dtype=self._mine.dtype, device=self._mine.device)

    def reduce_gradients(self) -> None:
        """Collective over the group: leaves each piece the average of its gradient over the replicas."""
        for bucket in self.buckets:
            flat = self.bucket_buffer(bucket)
            for param in bucket.params:
                offset = self.offsets[id(param)] - bucket.begin
                if param.grad is not None:
                    flat[offset:offset + param.numel()].copy_(param.grad.reshape(-1))
            self.reduce_scatter(bucket, flat).wait()
            self.land(bucket)
        self.attach_gradients()

    def bucket_buffer(self, bucket: ShardedBucket) -> torch.Tensor:
        """Zeros for ``bucket``'s gradients, padded to dp equal parts."""
        return torch.zeros(bucket.per_rank * self.dp, dtype=self._mine.dtype, device=self._mine.device)

    def reduce_scatter(self, bucket: ShardedBucket, flat: torch.Tensor) -> dist.Work:
        """Sums ``flat`` over the group into this rank's part of the shard, asynchronously."""
        out = self._grad_shard[bucket.shard_offset:bucket.shard_offset + bucket.per_rank]
        return reduce_scatter_flat(out, flat, group=self.group, async_op=True)

    def land(self, bucket: ShardedBucket) -> None:
        """The bucket's reduce-scatter is done: average it and drop the whole gradients (nothing
        reads an unreduced one)."""
        self._grad_shard[bucket.shard_offset:bucket.shard_offset + bucket.per_rank].div_(self.dp)
        for param in bucket.params:
            param.grad = None

    def attach_gradients(self) -> None:
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
        self._launch_gathers()
        if not self._overlap_gather:
            self.wait_parameters()
        self._name_state()

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=set_to_none)
        self.local.zero_grad(set_to_none=True)

    def state_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for s in self.local.state.values() for t in s.values()
                   if torch.is_tensor(t))

    def state_dict(self) -> dict[str, Any]:
        """Collective over the group: the whole-model form (per parameter, full shapes)."""
        self.wait_parameters()
        self._ensure_local_state()
        states = [self.local.state[piece.view] for piece in self.pieces]
        per_element = [k for k, v in states[0].items() if torch.is_tensor(v) and v.dim() > 0]
        scalars = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in states[0].items() if k not in per_element}
        full = {name: self._gathered(name) for name in per_element}
        state = {}
        for index, param in enumerate(self.params):
            offset = self.offsets[id(param)]
            state[index] = {**{k: (v.clone() if torch.is_tensor(v) else v) for k, v in scalars.items()},
                            **{name: flat[offset:offset + param.numel()].view_as(param).clone()
                               for name, flat in full.items()}}
        groups, index = [], 0
        for inner, outer in zip(self.local.param_groups, self.param_groups):
            count = len(outer["params"])
            groups.append({**{k: v for k, v in inner.items() if k != "params"},
                           **{k: v for k, v in outer.items() if k != "params"},
                           "params": list(range(index, index + count))})
            index += count
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Takes this rank's shard of a whole-model state (keys matched by position, as torch does)."""
        self.wait_parameters()
        self._ensure_local_state()
        saved_groups = state_dict["param_groups"]
        key_of: dict[int, Any] = {}
        for saved, outer, inner in zip(saved_groups, self.param_groups, self.local.param_groups):
            for key, param in zip(saved["params"], outer["params"]):
                key_of[id(param)] = key
            for name, value in saved.items():
                if name == "params":
                    continue
                if name in outer:
                    outer[name] = value
                if name in inner:
                    inner[name] = value
        for piece in self.pieces:
            saved = state_dict["state"].get(key_of[id(piece.param)], {})
            mine = self.local.state[piece.view]
            for name, value in saved.items():
                if torch.is_tensor(value) and value.dim() > 0:
                    mine[name].copy_(value.reshape(-1)[piece.begin:piece.end])
                elif torch.is_tensor(value) and torch.is_tensor(mine.get(name)):
                    mine[name].copy_(value)
                else:
                    mine[name] = value
        self._name_state()

    def _gathered(self, name: str) -> torch.Tensor:
        self._mine.zero_()
        for piece in self.pieces:
            self._mine[piece.shard_offset:piece.shard_offset + piece.end - piece.begin].copy_(
                self.local.state[piece.view][name])
        return self._all_gathered()

    def _launch_gathers(self) -> None:
        """Starts every bucket's all-gather of the updated shards, in the forward's order of use
        (the buckets are cut in reverse order of use)."""
        for piece in self.pieces:
            self._mine[piece.shard_offset:piece.shard_offset + piece.end - piece.begin].copy_(piece.view)
        for index in reversed(range(len(self.buckets))):
            bucket = self.buckets[index]
            gathered = torch.empty(bucket.per_rank * self.dp, dtype=self._mine.dtype, device=self._mine.device)
            mine = self._mine[bucket.shard_offset:bucket.shard_offset + bucket.per_rank]
            self._gathers[index] = (all_gather_flat(gathered, mine, group=self.group, async_op=True), gathered)

    @torch.no_grad()   # called from a forward pre-hook, inside a graph being recorded
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
            param.data.view(-1).copy_(gathered[offset:offset + param.numel()])

    def _all_gathered(self) -> torch.Tensor:
        """Every rank's ``_mine``, in the flat order: rank r's part of each bucket back in its place."""
        gathered = self._new_flat()
        all_gather_flat(gathered, self._mine, group=self.group)
        if len(self.buckets) == 1:   # one range: the ranks' parts are already in order
            return gathered
        per_rank = gathered.view(self.dp, self.shard_numel)
        flat = torch.empty(self.total, dtype=gathered.dtype, device=gathered.device)
        for bucket in self.buckets:
            parts = per_rank[:, bucket.shard_offset:bucket.shard_offset + bucket.per_rank].reshape(-1)
            flat[bucket.begin:bucket.begin + bucket.numel].copy_(parts[:bucket.numel])
        return flat

    def _ensure_local_state(self) -> None:
        """Creates the shard's state as DCP does for a fresh optimizer: one step at learning rate 0
        with zero gradients (local: no collective)."""
        if self.local.state:
            return
        lrs = [g["lr"] for g in self.local.param_groups]
        for g in self.local.param_groups:
            g["lr"] = 0.0
        for piece in self.pieces:
            piece.view.grad = torch.zeros_like(piece.view)
        self.local.step()
        for g, lr in zip(self.local.param_groups, lrs):
            g["lr"] = lr
        self.local.zero_grad(set_to_none=True)
        self._name_state()

    def _name_state(self) -> None:
        names = list(next(iter(self.local.state.values())).keys()) if self.local.state else []
        self.state.clear()
        if names:
            for param in self.params:
                self.state[param] = dict.fromkeys(names)


class ShardedReduction(BucketedReduction):
    """``optim.distributed`` with ``train.overlap_grad_reduce``: each of the optimizer's buckets is
    reduce-scattered into the shard as soon as the step's backwards have finished its gradients
    (``BucketedReduction``'s hooks and launch order), and ``finish`` (the SYNC) waits for all of
    them before the sharded step. Buckets holding ``deferred`` parameters (tied copies, summed
    across stages at the SYNC first) go last, on every replica alike, so the collectives match."""

    def __init__(self, optimizer: ShardedOptimizer, deferred: set[int], recorder: ReductionRecorder | None = None,
                 clock: Callable[[], float] = time.perf_counter):
        self.optimizer = optimizer
        order = sorted(optimizer.buckets, key=lambda b: any(id(p) in deferred for p in b.params))
        self._sharded = {}
        buckets = []
        for sharded in order:
            bucket = make_bucket(sharded.params)
            self._sharded[id(bucket)] = sharded
            buckets.append(bucket)
        super().__init__([p for b in optimizer.buckets for p in b.params], optimizer.group, optimizer.dp, 0,
                         overlap=True, recorder=recorder, clock=clock, buckets=buckets, held=frozenset(deferred))

    def finish(self) -> None:
        super().finish()
        self.optimizer.attach_gradients()

    def _new_buffer(self, bucket: Bucket) -> torch.Tensor:
        return self.optimizer.bucket_buffer(self._sharded[id(bucket)])

    def _collective(self, bucket: Bucket) -> dist.Work:
        return self.optimizer.reduce_scatter(self._sharded[id(bucket)], bucket.buffer)

    def _land(self, bucket: Bucket) -> None:
        self.optimizer.land(self._sharded[id(bucket)])
        bucket.buffer = None   # a gradient-sized buffer only while the buckets are in flight
