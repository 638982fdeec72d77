"""Runs one device's harmony_pp action list (pipedream/schedules/harmony.py) on real tensors.

``HarmonyExecutor`` walks the list: swaps through ``harmony_state.PackState`` and the device
tier, forwards without a graph (a forward task keeps nothing but the stashes it writes to the
host tier), backward tasks that first recompute their pack from the stashed input, the shared
last pack that keeps its graph from each forward to the backward right after, updates on the host
tier, and point-to-point messages between the devices of consecutive tasks (tagged by task and
micro-batch). ``HarmonyRunner`` is the engine's runner: one list per step, the loss summed over
every rank, and the swap volume of the step from the tier's counters.
"""
from __future__ import annotations

import math
import time
from contextlib import ExitStack, nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist

from models import boundary
from pipedream.errors import InvariantError
from pipedream.runtime.groups import DirectedGroups
from pipedream.harmony.state import PackState
from pipedream.offload import DeviceTier, SwapCounters, TensorClass
from pipedream.numerics.optim import NonFiniteError
from pipedream.numerics.precision import MixedPrecision
from pipedream.runtime.runner import StepResult
from pipedream.schedules.actions import Action, Kind
from pipedream.schedules.harmony import BACKWARD, FORWARD, JIT, HarmonyConfig
from pipedream.schedules.issue_order import receives_at_group_start
from pipedream.runtime.shapes import BoundaryShapes, input_shapes

_ACT, _GRAD = 0, 1
_MIX = 0x9E3779B97F4A7C15   # odd 64-bit constant: consecutive indices give unrelated seeds


def dropout_seed(seed: int, step: int, microbatch: int, layer: int) -> int:
    """The RNG seed of one layer's forward on one micro-batch of one step (0-based step and
    global micro-batch index): a forward task and the backward task that recomputes the layer,
    on whichever ranks, draw the same dropout masks, whatever the packs and devices."""
    value = seed
    for part in (step, microbatch, layer):
        value = ((value * _MIX) ^ (part + 1)) % (1 << 63)
    return value


@dataclass
class _Iteration:
    batches: dict[int, Any]
    loss_scale: float
    train: bool
    loss_sum: float = 0.0
    loss_count: int = 0
    groups_done: dict[int, int] = field(default_factory=dict)          # task -> groups swapped out
    local: dict[tuple[int, int, int], torch.Tensor] = field(default_factory=dict)   # same-device hand-overs
    outgoing: dict[tuple[int, int, int], torch.Tensor] = field(default_factory=dict)
    incoming: dict[tuple[int, int, int], tuple[Any, torch.Tensor]] = field(default_factory=dict)
    sends: list[tuple[Any, torch.Tensor]] = field(default_factory=list)
    graphs: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)   # jit: mb -> (input, loss)
    held: list[int] = field(default_factory=list)   # layers whose update waits for the global gradient norm
    step: int = 0                                    # 0-based training step (dropout seeds)


class HarmonyExecutor:
    def __init__(self, config: HarmonyConfig, rank: int, state: PackState, loss_fn: Callable, layer_shapes: BoundaryShapes,
                 p2p: DirectedGroups | None, recorder=None, clock: Callable[[], float] = time.perf_counter,
                 precision: MixedPrecision | None = None, delay_updates: bool = False, stash_tag: tuple = (),
                 dropout: tuple[int, int] | None = None):
        """``precision``: bf16 runs every pack's layers under autocast (weights cast on use, so the
        host's fp32 weights and the gradients stay fp32), their outputs, stashes and messages in bf16,
        and the loss on fp32 logits, as ``numerics.precision`` does for the other schedules.
        ``delay_updates``: a ``U`` only holds its layers back (their gradients stay on the host tier);
        the runner updates them all once the global gradient norm is known (clipping, harmony_dp).
        ``stash_tag``: added to the stash files' names (harmony_dp: replicas share the host folder).
        ``dropout``: (seed, this rank's first global micro-batch) when the layers draw dropout masks:
        each layer's training forward then runs on the RNG seeded by ``dropout_seed``.
        """
        self.delay_updates, self.stash_tag, self.dropout = delay_updates, stash_tag, dropout
        self.config, self.rank, self.state, self.p2p = config, rank, state, p2p
        self.precision = precision or MixedPrecision("fp32", state.device.device.type)
        self.loss_fn = self.precision.fp32_loss(loss_fn)
        self.tier: DeviceTier = state.device
        self.layer_shapes = layer_shapes   # bounds: one layer each, so stage_input(shape, l) is layer l's input
        self.placement = config.placement()
        self.recorder, self.clock = recorder, clock
        self.shapes: dict[int, tuple] = {}
        self._orders: dict[int, tuple[list[Action], list[Action]]] = {}

    # --- shapes and keys ---------------------------------------------------------------------
    def _spec(self, microbatch: int, layer: int) -> tuple[torch.Size, torch.dtype]:
        spec = self.precision.on_wire(self.layer_shapes.stage_input(self.shapes[microbatch], layer))
        if isinstance(spec, boundary.TupleSpec):
            raise InvariantError(f"layer {layer} takes a tuple of tensors; schedule=harmony_pp passes one tensor")
        return spec

    def _stash_bytes(self, microbatch: int, task: int) -> int:
        shape, dtype = self._spec(microbatch, self.config.tasks[task].layers[0])
        return shape.numel() * torch.empty((), dtype=dtype).element_size()

    def _tag(self, kind: int, microbatch: int, task: int) -> int:
        return (task * 2 + kind) * self.config.microbatches + microbatch

    def _layers(self, task: int) -> range:
        return range(*self.config.tasks[task].layers)

    def connect(self, schedules: list[list[Action]]) -> None:
        """One small message on every channel the schedule uses, in one global order, before the
        first iteration: NCCL creates its pair communicators where no rank waits on a compute."""
        channels = sorted({(rank, self.placement.peer(rank, a)[0]) for rank, actions in enumerate(schedules)
                           for a in actions if a.kind in (Kind.SEND_ACT, Kind.SEND_GRAD)})
        token = torch.zeros(1, device=self.tier.device)
        for src, dst in channels:
            if self.rank == src:
                dist.send(token, dst, group=self.p2p.carrying(src, dst))
            elif self.rank == dst:
                dist.recv(token, src, group=self.p2p.carrying(src, dst))

    # --- the walk ----------------------------------------------------------------------------
    def run(self, actions: list[Action], batches: dict[int, Any], loss_scale: float, train: bool = True,
            optimizer: torch.optim.Optimizer | None = None, step: int = 0) -> _Iteration:
        self.shapes = input_shapes(batches)
        it = _Iteration(batches, loss_scale, train, step=step)
        actions = self._issue_order(actions)
        for index, action in enumerate(actions):
            start = self.clock()
            wait = self._run(action, index, actions, it, optimizer)
            if self.recorder is not None:
                self.recorder.record(action, start, self.clock(), wait)
        for work, _ in it.sends:
            work.wait()
        if it.local or it.outgoing or it.incoming or it.graphs:
            raise InvariantError(f"rank {self.rank}: tensors left at the end of the iteration")
        return it

    def _issue_order(self, actions: list[Action]) -> list[Action]:
        """On Gloo (CPU) each receive is posted at the start of the group that consumes it
        (``schedules.issue_order.receives_at_group_start``): a message the sender has sent lands
        while this rank computes, instead of after it asks. Not on NCCL: round the wrap-around, a
        receive posted early can block the stream a send to another device waits on (3 devices
        already; ``stream_model``), so there the list's own order, which the stream model checks,
        is the issue order."""
        if self.tier.device.type != "cpu":
            return actions
        cached = self._orders.get(id(actions))
        if cached is None or cached[0] is not actions:
            cached = self._orders[id(actions)] = (actions, receives_at_group_start(actions))
        return cached[1]

    def _run(self, a: Action, index: int, actions: list[Action], it: _Iteration, optimizer) -> float:
        role = self.config.tasks[a.chunk].role
        if a.kind is Kind.SWAP_IN and a.microbatch < 0:
            grads = None
            if it.train and role != FORWARD:
                grads = "host" if it.groups_done.get(a.chunk, 0) else "zero"
            self.state.swap_in(self._layers(a.chunk), grads)
        elif a.kind is Kind.SWAP_OUT and a.microbatch < 0:
            self.state.swap_out(self._layers(a.chunk), grads=it.train and role != FORWARD)
            it.groups_done[a.chunk] = it.groups_done.get(a.chunk, 0) + 1
        elif a.kind is Kind.PREFETCH:
            self._prefetch(a, index, actions)
        elif a.kind is Kind.SWAP_OUT:
            self._stash_out(a)
        elif a.kind is Kind.SWAP_IN:
            return self._stash_in(a, it)
        elif a.kind is Kind.FWD:
            return self._forward(a, role, it)
        elif a.kind is Kind.BWD:
            return self._backward(a, role, it)
        elif a.kind is Kind.UPDATE:
            if it.train and self.delay_updates:
                it.held.extend(self._layers(a.chunk))
            elif it.train:
                self.state.update(self._layers(a.chunk), optimizer)
        elif a.kind in (Kind.SEND_ACT, Kind.SEND_GRAD):
            self._send(a, it)
        elif a.kind in (Kind.RECV_ACT, Kind.RECV_GRAD):
            self._post_receive(a, it)
        else:
            raise InvariantError(f"harmony_pp cannot run {a}")
        return 0.0

    # --- swaps -------------------------------------------------------------------------------
    def _prefetch(self, a: Action, index: int, actions: list[Action]) -> None:
        """Only when the next pack fits beside what the rest of the current group still brings in."""
        current = next(b.chunk for b in reversed(actions[:index]) if b.kind is Kind.SWAP_IN and b.microbatch < 0)
        headroom = 0
        for b in actions[index + 1:]:
            if b.kind is Kind.SWAP_OUT and b.microbatch < 0 and b.chunk == current:
                break
            if b.kind is Kind.SWAP_IN and b.microbatch >= 0:
                headroom = max(headroom, self._stash_bytes(b.microbatch, b.chunk))
            elif b.kind is Kind.FWD and self.config.tasks[b.chunk].role == FORWARD:
                stashes = self.config.stashes(self.config.tasks[b.chunk])
                headroom = max(headroom, sum(self._stash_bytes(b.microbatch, t.index) for t in stashes))
        layers = self._layers(a.chunk)
        if self.tier.fits(self.state.weight_bytes(layers) + headroom):
            self.state.prefetch(layers)

    def _stash_key(self, microbatch: int, task: int) -> tuple:
        shape, dtype = self._spec(microbatch, self.config.tasks[task].layers[0])
        return ("s", task, microbatch, *shape, str(dtype).rpartition(".")[2], *self.stash_tag)

    def _stash_out(self, a: Action) -> None:
        """The stash the forward just adopted goes to the shared host tier. Its file is created once
        per (task, micro-batch, shape) and mapped for the rest of the run, by the writer and by the
        reader, which unlinks it once mapped: every later iteration only copies (the step's loss
        all-reduce orders one iteration's reads before the next one's writes)."""
        key = ("s", a.chunk, a.microbatch)
        host_key = self._stash_key(a.microbatch, a.chunk)
        if host_key not in self.state.host:
            shape, dtype = self._spec(a.microbatch, self.config.tasks[a.chunk].layers[0])
            self.state.host.allocate(host_key, shape, dtype)
            if self.config.tasks[a.chunk].device == self.rank:   # read here too: no other process maps it
                self.state.host.unlink(host_key)
        self.tier.swap_out(key, host_key=host_key)

    def _stash_in(self, a: Action, it: _Iteration) -> float:
        """Read once the output gradient is here (it arrives after the stash was written)."""
        wait = 0.0
        if (_GRAD, a.microbatch, a.chunk) in it.incoming:
            grad, wait = self._take(_GRAD, a.microbatch, a.chunk, it)
            it.local[(_GRAD, a.microbatch, a.chunk)] = grad
        key = ("s", a.chunk, a.microbatch)
        host_key = self._stash_key(a.microbatch, a.chunk)
        if host_key not in self.state.host:   # written by another rank: map its file once
            shape, dtype = self._spec(a.microbatch, self.config.tasks[a.chunk].layers[0])
            self.state.host.allocate(host_key, shape, dtype, create=False)
            self.state.host.unlink(host_key)
        self.tier.swap_in(key, TensorClass.ACTIVATIONS, host_key=host_key)
        return wait

    # --- messages ----------------------------------------------------------------------------
    def _send(self, a: Action, it: _Iteration) -> None:
        kind = _ACT if a.kind is Kind.SEND_ACT else _GRAD
        tensor = it.outgoing.pop((kind, a.microbatch, a.chunk)).contiguous()
        dst, _ = self.placement.peer(self.rank, a)
        work = dist.isend(tensor, dst, group=self.p2p.carrying(self.rank, dst), tag=self._tag(kind, a.microbatch, a.chunk + 1))
        it.sends.append((work, tensor))
        self.tier.record_device_to_device(TensorClass.ACTIVATIONS, tensor.nbytes)

    def _post_receive(self, a: Action, it: _Iteration) -> None:
        kind = _ACT if a.kind is Kind.RECV_ACT else _GRAD
        first, stop = self.config.tasks[a.chunk].layers
        shape, dtype = self._spec(a.microbatch, first if kind == _ACT else stop)
        buffer = torch.empty(shape, dtype=dtype, device=self.tier.device)
        src, _ = self.placement.peer(self.rank, a)
        work = dist.irecv(buffer, src, group=self.p2p.carrying(src, self.rank), tag=self._tag(kind, a.microbatch, a.chunk))
        it.incoming[(kind, a.microbatch, a.chunk)] = (work, buffer)

    def _take(self, kind: int, microbatch: int, task: int, it: _Iteration) -> tuple[torch.Tensor, float]:
        """The tensor task ``task`` consumes (a received message or a same-device hand-over), and
        the seconds spent waiting for it."""
        key = (kind, microbatch, task)
        if key in it.incoming:
            work, buffer = it.incoming.pop(key)
            start = self.clock()
            work.wait()
            return buffer, self.clock() - start
        return it.local.pop(key), 0.0

    def _hand_on(self, kind: int, microbatch: int, task: int, tensor: torch.Tensor, it: _Iteration) -> None:
        """To task + 1: sent by the following SA/SG, or handed over on this device."""
        if self.placement.sends(self.rank, Action(Kind.FWD if kind == _ACT else Kind.BWD, microbatch, task)):
            it.outgoing[(kind, microbatch, task)] = tensor
        elif task + 1 < len(self.config.tasks):
            it.local[(kind, microbatch, task + 1)] = tensor

    # --- compute -----------------------------------------------------------------------------
    def _run_layers(self, layers: range, x: torch.Tensor, it: _Iteration, microbatch: int,
                    stash_at: dict[int, int] | None = None) -> torch.Tensor:
        with self.precision.autocast() if self.precision.enabled else nullcontext():
            for layer in layers:
                if stash_at and layer in stash_at:
                    self.tier.adopt(("s", stash_at[layer], microbatch), x.detach(), TensorClass.ACTIVATIONS)
                with ExitStack() as rng:
                    if self.dropout is not None and it.train:
                        self._seed(rng, it.step, microbatch, layer)
                    x = boundary.call_layer(self.state.modules[layer], x)
        return x

    def _seed(self, stack: ExitStack, step: int, microbatch: int, layer: int) -> None:
        """The layer's masks from its own seed; the run's RNG stream is left as it was."""
        device = self.tier.device
        stack.enter_context(torch.random.fork_rng(devices=[device] if device.type == "cuda" else []))
        seed, first = self.dropout
        torch.manual_seed(dropout_seed(seed, step, first + microbatch, layer))

    def _forward(self, a: Action, role: str, it: _Iteration) -> float:
        mb, task = a.microbatch, a.chunk
        inputs, targets = it.batches[mb]
        x, wait = (inputs, 0.0) if task == 0 else self._take(_ACT, mb, task, it)
        layers = self._layers(task)
        if role == FORWARD:
            stash_at = {t.layers[0]: t.index for t in self.config.stashes(self.config.tasks[task])} if it.train else None
            with torch.no_grad():
                out = self._run_layers(layers, x, it, mb, stash_at)
            self._hand_on(_ACT, mb, task, out, it)
            return wait
        if not it.train:
            with torch.no_grad():
                loss = self.loss_fn(self._run_layers(layers, x, it, mb), targets)
        else:
            x = x.detach().requires_grad_(x.is_floating_point() and task > 0)
            loss = self.loss_fn(self._run_layers(layers, x, it, mb), targets)
            it.graphs[mb] = (x, loss)
        it.loss_sum += float(loss.detach())
        it.loss_count += 1
        return wait

    def _backward(self, a: Action, role: str, it: _Iteration) -> float:
        mb, task = a.microbatch, a.chunk
        first = self.config.tasks[task].layers[0]
        wait = 0.0
        if role == JIT:
            x, loss = it.graphs.pop(mb)
            (loss * it.loss_scale).backward()
        elif role == BACKWARD:
            key = ("s", task, mb)
            stashed = self.tier.get(key)
            x = stashed.detach().requires_grad_(stashed.is_floating_point() and first > 0)
            with torch.enable_grad():
                out = self._run_layers(self._layers(task), x, it, mb)   # the recompute: the forward's masks
            grad_out, wait = self._take(_GRAD, mb, task, it)
            torch.autograd.backward(out, grad_out)
            self.tier.release(key)
        else:
            raise InvariantError(f"{a} is a backward of a forward-only task")
        if first > 0:
            self._hand_on(_GRAD, mb, task, x.grad, it)
        return wait


class HarmonyRunner:
    """The engine's runner for harmony_pp: the same interface as ``runner.FlushRunner``."""

    global_grad_norm = False   # not the pipeline engine's norm group: the runner clips by its own sums
    weight_versions = 1

    @staticmethod
    def updates_per_step(spec: Any, topology: Any, schedule_rank: int) -> int:
        return 1

    def __init__(self, executor: HarmonyExecutor, actions: list[Action], optimizer: torch.optim.Optimizer,
                 scheduler: Any, microbatches: int, global_sums: Callable[..., list[float]], grad_clip: float = 0.0):
        """``grad_clip`` > 0 needs the executor's ``delay_updates``: the norm covers every pack."""
        self.grad_clip = grad_clip
        self.executor, self.actions = executor, actions
        self.optimizer, self.scheduler, self.microbatches = optimizer, scheduler, microbatches
        self.global_sums = global_sums
        self.last_losses: dict[int, float] = {}
        self.last_step_swaps = SwapCounters()
        self.steps = 0

    def run_step(self, batches: dict[int, Any], grad_norm: bool) -> StepResult:
        lr = self.optimizer.param_groups[0]["lr"]
        before = self.executor.tier.counters.snapshot()
        it = self.executor.run(self.actions, batches, 1.0 / self.microbatches, optimizer=self.optimizer,
                               step=self.steps)
        norm = self._held_updates(it.held) if self.executor.delay_updates else math.nan
        # the sum meets every rank after all its updates: no rank reads a pack's host weights for the
        # next forward before the update that owns them wrote them
        loss_sum, count = self.global_sums(it.loss_sum, float(it.loss_count))
        self.scheduler.step()
        self.last_step_swaps = self.executor.tier.counters.since(before)
        self.steps += 1
        loss = loss_sum / count
        if not math.isfinite(loss):
            raise NonFiniteError(f"training loss is {loss}: stopped; lower train.lr or check the data")
        return StepResult(loss=loss, grad_norm=norm, lr=lr)

    def _held_updates(self, layers: list[int]) -> float:
        """Delayed updates: the global norm from every rank's owned final gradients (each layer has
        one owner; harmony_dp sums the replicas' first), the gradients scaled as ``clip_grad_norm_``
        would, then one step of them all."""
        state = self.executor.state
        owned = [layer for layer in dict.fromkeys(layers) if layer in state.owned]
        grads = state.final_gradients(owned)
        (squares,) = self.global_sums(state.gradient_squares(grads))
        norm = math.sqrt(squares)
        if not math.isfinite(norm):
            raise NonFiniteError(f"gradient norm is {norm}: training stopped; lower train.lr and check the data")
        coef = self.grad_clip / (norm + 1e-6)
        if self.grad_clip > 0 and coef < 1.0:
            state.scale_gradients(grads, coef)
        state.update(owned, self.optimizer, grads)
        return norm

    def evaluate(self, actions: list[Action], batches: dict[int, Any]) -> float:
        it = self.executor.run(actions, batches, 1.0, train=False)
        loss_sum, count = self.global_sums(it.loss_sum, float(it.loss_count))
        return loss_sum / count

    def drain(self) -> None:
        return None

    def resume_at(self, step: int) -> None:
        """Nothing is in flight after a step; the step count seeds the dropout masks."""
        self.steps = step
