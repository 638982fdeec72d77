"""Data-parallel gradient reduction in buckets, overlapped with the backward.

A stage's parameters are cut, in reverse order of use (the backward produces the last layers'
gradients first), into buckets of about ``train.grad_bucket_mb`` of one dtype, each with its own
flat buffer. A bucket's all-reduce is launched asynchronously (``async_op=True``) as soon as the
step's last micro-batch has produced every gradient in it, so it runs while the backward of
earlier layers (and of the other micro-batches' weight gradients) goes on; ``finish`` (the
SYNC_GRADS action) launches what is left, waits for every bucket and writes the averages back.
Buckets launch in order on every replica (a bucket waits for the ones before it), so the
collectives of a group always match.

When is a gradient final? A parameter's gradient is accumulated once per backward that reaches
it: by autograd (``register_post_accumulate_grad_hook``) or, for the Linear weights whose GEMM
accumulates it (``models/grad_accumulation.py``), by ``WeightGradQueue.after_accumulate`` --
within the backward, or in the W action of a zero-bubble schedule. How many accumulations make a
step depends on the action list (micro-batches, chunks, a tied weight used twice), which is the
same every step: the first step launches everything at ``finish`` and counts them; later steps
launch a bucket at the last one. A step that accumulates a parameter more often than counted
(its bucket would have left with a partial sum) stops the run instead of training on it, and a
parameter that had a gradient in the first step but was never reported keeps its bucket (and,
since buckets go in order, the later ones) for ``finish``.

The distributed optimizer reuses this machinery with a reduce-scatter per bucket into its shard
(``sharded_reduction.ShardedReduction``).

Without ``overlap`` (``train.overlap_grad_reduce=false``), and for the asynchronous schedules,
whose gradients arrive on weight versions (``runtime/weights.py``) rather than through these
hooks, every bucket is launched at ``finish``, back to back.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch
import torch.distributed as dist
from torch import nn

from pipedream.errors import InvariantError


class ReductionRecorder(Protocol):
    def record_reduction(self, bucket: int, start: float, end: float) -> None: ...


@dataclass
class Bucket:
    params: list[nn.Parameter]
    offsets: list[int]          # where each parameter's gradient starts in the flat buffer
    numel: int
    dtype: torch.dtype
    device: torch.device
    buffer: torch.Tensor | None = None
    work: dist.Work | None = None
    launched_at: float = 0.0
    completed_at: float | None = None
    waiting: set[int] = field(default_factory=set)   # ids of parameters whose gradient is not final
    landed: bool = False        # its result is already in place (a subclass may land before ``finish``)


def make_bucket(params: list[nn.Parameter]) -> Bucket:
    """One bucket of ``params`` (one dtype and device), laid end to end in that order."""
    offsets, total = [], 0
    for param in params:
        offsets.append(total)
        total += param.numel()
    return Bucket(list(params), offsets, total, params[0].dtype, params[0].device)


def assign_buckets(params: list[nn.Parameter], bucket_bytes: int) -> list[Bucket]:
    """Reverse order of use; a bucket closes past ``bucket_bytes`` or where the dtype or device changes."""
    buckets: list[Bucket] = []
    current: list[nn.Parameter] = []

    def close() -> None:
        if current:
            buckets.append(make_bucket(current))
            current.clear()

    size = 0
    for param in reversed(params):
        if current and (param.dtype != current[0].dtype or param.device != current[0].device):
            close()
            size = 0
        current.append(param)
        size += param.numel() * param.element_size()
        if size >= bucket_bytes:
            close()
            size = 0
    close()
    return buckets


class BucketedReduction:
    """Averages a stage's gradients over its data-parallel group, bucket by bucket. ``buckets``
    (launch order) replaces the ones ``bucket_bytes`` would cut; the buckets of ``held`` parameter
    ids wait for ``finish``; a subclass may reduce a bucket by another collective (``_collective``)
    and keep its result elsewhere (``_land``)."""

    def __init__(self, params: list[nn.Parameter], group: dist.ProcessGroup | None, dp: int, bucket_bytes: int,
                 overlap: bool, recorder: ReductionRecorder | None = None,
                 clock: Callable[[], float] = time.perf_counter, buckets: list[Bucket] | None = None,
                 held: frozenset[int] = frozenset()):
        self.params, self.group, self.dp, self.held = params, group, dp, held
        self.buckets = buckets if buckets is not None else assign_buckets(params, max(1, bucket_bytes))
        self.overlap = overlap
        self.recorder, self.clock = recorder, clock
        self._bucket_of = {id(p): i for i, b in enumerate(self.buckets) for p in b.params}
        self._seen: dict[int, int] = {}                 # parameter id -> accumulations this step
        self._expected: dict[int, int] | None = None    # learnt in the first step
        self._unseen: set[int] = set()                  # ids of parameters with gradients but no report
        self._next = 0                                  # the next bucket to launch (they go in order)
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self.observe: Callable[[], object] | None = None   # samples the bytes held (held_bytes.HeldBytes)
        if overlap:
            self._handles = [p.register_post_accumulate_grad_hook(self.accumulated) for p in params
                             if p.requires_grad]
        self._reset()

    def accumulated(self, param: torch.Tensor) -> None:
        """One backward has added to ``param.grad``; the hook of autograd and of the fused Linears."""
        key = id(param)
        if key not in self._bucket_of:
            return
        seen = self._seen[key] = self._seen.get(key, 0) + 1
        if self._expected is None:
            return
        if seen == self._expected.get(key, 0) and key not in self._unseen and key not in self.held:
            bucket = self.buckets[self._bucket_of[key]]
            bucket.waiting.discard(key)
            self._launch_ready()
        self._poll()

    def finish(self) -> None:
        """Launches the buckets not yet launched, waits for all, and leaves each gradient averaged."""
        if self.overlap and self._expected is None:
            # a gradient that arrived by a path no hook reported: its bucket waits for the sync
            self._unseen = {id(p) for p in self.params if p.grad is not None and id(p) not in self._seen}
        self._fill_missing()
        if self._expected is not None:
            self._check_counts()
        while self._next < len(self.buckets):
            self._launch(self.buckets[self._next])
        for index, bucket in enumerate(self.buckets):
            if not bucket.landed:
                bucket.work.wait()
                if bucket.completed_at is None:
                    bucket.completed_at = self.clock()
                self._land(bucket)
                if self.observe is not None:
                    self.observe()
            if self.recorder is not None:
                self.recorder.record_reduction(index, bucket.launched_at, bucket.completed_at)
        if self.overlap and self._expected is None:
            self._expected = dict(self._seen)
        self._reset()

    def _fill_missing(self) -> None:
        for param in self.params:   # parameters that took no part in the loss still sync
            if param.grad is None:
                param.grad = torch.zeros_like(param)

    def _check_counts(self) -> None:
        extra = [p for p in self.params if self._seen.get(id(p), 0) > self._expected.get(id(p), 0)]
        if extra:
            raise InvariantError(f"{len(extra)} parameter(s) received more gradient accumulations this step "
                                 f"than in the first one: their buckets left early; run with "
                                 f"train.overlap_grad_reduce=false")

    def _reset(self) -> None:
        self._seen.clear()
        self._next = 0
        for bucket in self.buckets:
            bucket.work, bucket.completed_at, bucket.landed = None, None, False
            bucket.waiting = {id(p) for p in bucket.params if self._expected is None or self._expected.get(id(p), 0)
                              or id(p) in self._unseen or id(p) in self.held}

    def _launch_ready(self) -> None:
        while self._next < len(self.buckets) and not self.buckets[self._next].waiting:
            self._launch(self.buckets[self._next])

    @torch.no_grad()   # a held-back weight gradient may launch its bucket while the executor records a graph
    def _launch(self, bucket: Bucket) -> None:
        if bucket.buffer is None:
            bucket.buffer = self._new_buffer(bucket)
        for param, offset in zip(bucket.params, bucket.offsets):
            view = bucket.buffer[offset:offset + param.numel()]
            if param.grad is None:
                view.zero_()
            else:
                view.copy_(param.grad.reshape(-1))
        bucket.launched_at = self.clock()
        bucket.work = self._collective(bucket)
        self._next += 1
        if self.observe is not None:
            self.observe()

    def _new_buffer(self, bucket: Bucket) -> torch.Tensor:
        return torch.empty(bucket.numel, dtype=bucket.dtype, device=bucket.device)

    def _collective(self, bucket: Bucket) -> dist.Work:
        return dist.all_reduce(bucket.buffer, group=self.group, async_op=True)

    def _land(self, bucket: Bucket) -> None:
        """The bucket's collective is done: its averages go back into the gradients."""
        bucket.buffer.div_(self.dp)
        for param, offset in zip(bucket.params, bucket.offsets):
            param.grad.copy_(bucket.buffer[offset:offset + param.numel()].view_as(param.grad))

    def _poll(self) -> None:
        """Notes when launched buckets completed (for the trace), at each gradient's arrival."""
        if self.recorder is None:
            return
        for bucket in self.buckets[:self._next]:
            if bucket.completed_at is None and bucket.work.is_completed():
                bucket.completed_at = self.clock()
