"""Harmony's runtime estimator: an event-driven simulation of one iteration of the runtime's own
``harmony_pp`` action lists (``pipedream.schedules.harmony``), timed with per-action costs.

Each device walks its list in order on its compute stream. Copies run on two copy streams per
device (host->device ``SI``/``PF``, device->host ``SO``), as the runtime runs swaps on side streams
on CUDA: ``PF.i`` starts pack i's swap-in early and ``SI.i`` waits for it; a stashed input
(``SI<mb>.i``) is waited for at once (the backward needs it next); stash and gradient swap-outs
are waited for only by the pack's update ``U.i``, which runs on the host in list order. With
``Links.synchronous`` (the CPU runtime: "device" and host are both RAM and copies are plain
``copy_`` calls) every copy runs on the compute stream instead. Sends (``SA``/``SG``) occupy the
sender's send stream and the sender goes on; a receive (``RA``/``RG``) waits for the arrival.

Memory per device, as the runtime's tier counts it ("managed"): a pack's weights from its swap-in
(or prefetch) until ``SO.i``, a backward pack's gradients until their copy to the host ends,
stashes while they are on the device; "peak_bytes" adds one micro-batch's activations while a
compute runs (the jit pack's from its forward to its backward).

The runtime's own costs (``HarmonyOverheads``), on the compute stream: each FWD/BWD action adds
``compute_action_s`` and every other action ``action_s`` (the executor's Python between actions);
each send or receive ``message_s`` (posting it; a receive after its message arrived, waiting for
the sender's Gloo thread on CPU); each weight swap (``SI``/``SO``/``PF`` of a pack) ``swap_s``,
each stash copy (``SO<mb>``/``SI<mb>``) ``stash_s`` and each update ``update_s`` beyond their
modelled bytes (allocation, shared-memory files, the optimizer's Python); a forward task's layers
run ``forward_ratio`` times the profile's time, every graph-building pass (the jit pack and the
recomputing backward tasks) ``train_ratio`` times; each iteration adds ``step_s``, the step's
part before its first and after its last action (the batch, the loss, the barrier). Measured from
traced harmony_pp runs (``planner.calibrate.harmony``), or, without those, the flush families'
per-action, per-message and per-step costs (``planner.inputs.runtime_costs``) and nothing else.
Torch-free.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from pipedream.schedules.actions import Action, Kind
from pipedream.schedules.harmony import BACKWARD, FORWARD, HarmonyConfig, harmony_pp

from planner.errors import PlannerError
from planner.inputs.runtime_costs import ScheduleOverheads


@dataclass(frozen=True)
class Links:
    swap_bandwidth: float         # bytes/s host<->device, each direction
    p2p_bandwidth: float          # bytes/s device->device
    p2p_latency: float = 0.0
    swap_latency: float = 0.0
    synchronous: bool = False     # copies block the compute stream (the CPU runtime)
    compute_slots: int | None = None   # devices that can work at once (CPU processes on shared cores); None: all

    def swap_s(self, nbytes: float) -> float:
        return 0.0 if nbytes <= 0 else self.swap_latency + nbytes / self.swap_bandwidth

    def send_s(self, nbytes: float) -> float:
        return 0.0 if nbytes <= 0 else self.p2p_latency + nbytes / self.p2p_bandwidth


@dataclass(frozen=True)
class HarmonyOverheads:
    """The runtime's own costs per action kind (seconds) and its layers' time over the profile's."""
    compute_action_s: float = 0.0   # per FWD/BWD action
    message_s: float = 0.0          # per send or receive
    step_s: float = 0.0             # per iteration
    action_s: float = 0.0           # per other action (swaps, updates, messages)
    swap_s: float = 0.0             # per weight swap-in, swap-out or prefetch, beyond its bytes
    stash_s: float = 0.0            # per stash copy to or from the host tier, beyond its bytes
    update_s: float = 0.0           # per pack update, beyond the optimizer fit
    forward_ratio: float = 1.0      # a forward task's (no-graph) layer time / the profile's
    train_ratio: float = 1.0        # a graph-building pass's (jit, recompute + backward) / the profile's

    @classmethod
    def from_schedule(cls, overheads: ScheduleOverheads) -> "HarmonyOverheads":
        return cls(overheads.compute_action_s, overheads.message_s, overheads.step_s)


class ActionCosts:
    """What the simulation asks of a cost model, per task (pack) and per micro-batch."""

    def forward_s(self, task: int) -> float: ...
    def backward_s(self, task: int) -> float: ...     # recomputation included where the task recomputes
    def weight_bytes(self, task: int) -> float: ...
    def stash_bytes(self, task: int) -> float: ...    # the pack input of backward task ``task``, one micro-batch
    def output_bytes(self, task: int) -> float: ...   # sent to task + 1 in the forward, one micro-batch
    def input_grad_bytes(self, task: int) -> float: ...
    def activation_bytes(self, task: int) -> float: ...
    def update_s(self, task: int) -> float: ...


@dataclass
class Estimate:
    iteration_s: float
    peak_bytes: list[float]            # managed + activations
    peak_managed_bytes: list[float]    # what the runtime's tier accounts
    compute_s: list[float]
    weights_in_bytes: float = 0.0
    gradients_out_bytes: float = 0.0
    stash_bytes: float = 0.0           # each way
    p2p_bytes: float = 0.0


@dataclass
class _Device:
    clock: float = 0.0
    h2d: float = 0.0
    d2h: float = 0.0
    send: float = 0.0
    pos: int = 0
    busy: float = 0.0
    prefetched: dict[int, float] = field(default_factory=dict)
    grads_out: dict[int, float] = field(default_factory=dict)   # task -> when its gradients reach the host
    stash_in: dict[tuple[int, int], float] = field(default_factory=dict)  # (mb, task) -> bytes held
    events: list[tuple[float, float, bool]] = field(default_factory=list)  # (time, delta, managed)


def estimate(config: HarmonyConfig, lists: list[list[Action]], costs: ActionCosts, links: Links,
             overheads: HarmonyOverheads | ScheduleOverheads = HarmonyOverheads()) -> Estimate:
    """Simulate one iteration of ``lists`` (one per device); PlannerError if the lists deadlock."""
    if not isinstance(overheads, HarmonyOverheads):
        overheads = HarmonyOverheads.from_schedule(overheads)
    devices = [_Device() for _ in lists]
    arrivals: dict[tuple[Kind, int, int], float] = {}
    totals = Estimate(0.0, [], [], [])
    slots = [0.0] * links.compute_slots if links.compute_slots else None
    remaining = sum(len(a) for a in lists)
    while remaining:
        moved = 0
        if slots is not None:   # one action at a time, the earliest to start on any device
            d, dev = _earliest(devices, lists, arrivals)
            if dev is not None and _step(config, dev, lists[d][dev.pos], costs, links, arrivals, totals, slots,
                                         overheads):
                dev.pos += 1
                moved = 1
        else:
            for dev, actions in zip(devices, lists):
                while dev.pos < len(actions) and _step(config, dev, actions[dev.pos], costs, links, arrivals, totals,
                                                       None, overheads):
                    dev.pos += 1
                    moved += 1
        if not moved:
            stuck = [f"device {d}: {lists[d][dev.pos]}" for d, dev in enumerate(devices) if dev.pos < len(lists[d])]
            raise PlannerError(f"harmony estimate: the action lists wait on each other ({'; '.join(stuck)})")
        remaining -= moved
    totals.iteration_s = max(max(dev.clock, dev.h2d, dev.d2h, dev.send) for dev in devices) + overheads.step_s
    totals.compute_s = [dev.busy for dev in devices]
    totals.peak_bytes = [_peak(dev.events, managed_only=False) for dev in devices]
    totals.peak_managed_bytes = [_peak(dev.events, managed_only=True) for dev in devices]
    return totals


class _SharedUpdates(ActionCosts):
    """harmony_dp: each replica steps only the layers it owns (1/replicas of every pack's update
    on average); everything else as ``costs``."""

    def __init__(self, costs: ActionCosts, replicas: int):
        self.costs, self.replicas = costs, replicas

    def forward_s(self, task: int) -> float:
        return self.costs.forward_s(task)

    def backward_s(self, task: int) -> float:
        return self.costs.backward_s(task)

    def weight_bytes(self, task: int) -> float:
        return self.costs.weight_bytes(task)

    def stash_bytes(self, task: int) -> float:
        return self.costs.stash_bytes(task)

    def output_bytes(self, task: int) -> float:
        return self.costs.output_bytes(task)

    def input_grad_bytes(self, task: int) -> float:
        return self.costs.input_grad_bytes(task)

    def activation_bytes(self, task: int) -> float:
        return self.costs.activation_bytes(task)

    def update_s(self, task: int) -> float:
        return self.costs.update_s(task) / self.replicas


def estimate_dp(config: HarmonyConfig, replicas: int, costs: ActionCosts, links: Links,
                overheads: HarmonyOverheads | ScheduleOverheads = HarmonyOverheads()) -> Estimate:
    """harmony_dp: ``replicas`` devices each walk the one-device list of ``config`` (every pack,
    over that device's own micro-batches) at once, sharing the compute slots where
    ``links.compute_slots`` is set; each steps 1/replicas of every pack's parameters. Not priced:
    the owners' sum of the replicas' gradient copies on the host and the barrier before it."""
    if config.devices != 1 or replicas < 1:
        raise PlannerError(f"harmony_dp estimate: the configuration is one device's (devices = {config.devices}) "
                           f"and replicas = {replicas} must be >= 1")
    lists = harmony_pp(config)
    return estimate(config, lists * replicas, _SharedUpdates(costs, replicas), links, overheads)


def _earliest(devices: list[_Device], lists: list[list[Action]], arrivals: dict) -> tuple[int, _Device | None]:
    """The device whose next action can start first (a receive only once its message is sent)."""
    best, when = (-1, None), float("inf")
    for d, dev in enumerate(devices):
        if dev.pos >= len(lists[d]):
            continue
        a = lists[d][dev.pos]
        start = dev.clock
        if a.kind in (Kind.RECV_ACT, Kind.RECV_GRAD):
            arrival = arrivals.get((a.kind, a.microbatch, a.chunk))
            start = float("inf") if arrival is None else max(start, arrival)
        if start < when:
            best, when = (d, dev), start
    return best


def _work(dev: _Device, seconds: float, slots: list[float] | None) -> None:
    """``seconds`` of work on the device's stream, in a free compute slot if slots are limited."""
    if slots is not None and seconds > 0:
        k = min(range(len(slots)), key=slots.__getitem__)
        dev.clock = max(dev.clock, slots[k]) + seconds
        slots[k] = dev.clock
    else:
        dev.clock += seconds


def _copy(dev: _Device, nbytes: float, links: Links, inbound: bool, slots: list[float] | None = None) -> float:
    """Start a copy at the compute clock; returns when it ends (the clock moves only if synchronous)."""
    seconds = links.swap_s(nbytes)
    if links.synchronous:
        _work(dev, seconds, slots)
        return dev.clock
    if inbound:
        dev.h2d = max(dev.h2d, dev.clock) + seconds
        return dev.h2d
    dev.d2h = max(dev.d2h, dev.clock) + seconds
    return dev.d2h


def _pack_bytes(config: HarmonyConfig, costs: ActionCosts, task: int) -> float:
    """Weights, and for packs that run a backward their gradients as well."""
    w = costs.weight_bytes(task)
    return w if config.tasks[task].role == FORWARD else 2.0 * w


def _fixed_s(a: Action, overheads: HarmonyOverheads) -> float:
    """The runtime's own seconds for a non-compute action, before (sends, swaps) or after (receives)
    its modelled part."""
    kind = a.kind
    if kind in (Kind.SEND_ACT, Kind.SEND_GRAD, Kind.RECV_ACT, Kind.RECV_GRAD):
        extra = overheads.message_s
    elif kind in (Kind.SWAP_IN, Kind.SWAP_OUT):
        extra = overheads.stash_s if a.microbatch >= 0 else overheads.swap_s
    elif kind is Kind.PREFETCH:
        extra = overheads.swap_s
    elif kind is Kind.UPDATE:
        extra = overheads.update_s
    else:
        extra = 0.0
    return overheads.action_s + extra


def _step(config: HarmonyConfig, dev: _Device, a: Action, costs: ActionCosts, links: Links,
          arrivals: dict, totals: Estimate, slots: list[float] | None, overheads: HarmonyOverheads) -> bool:
    """Run action ``a`` on ``dev``; False if it must wait for a message not yet sent."""
    kind, mb, task = a.kind, a.microbatch, a.chunk
    if kind in (Kind.RECV_ACT, Kind.RECV_GRAD) and (kind, mb, task) not in arrivals:
        return False
    if kind not in (Kind.FWD, Kind.BWD, Kind.RECV_ACT, Kind.RECV_GRAD):
        _work(dev, _fixed_s(a, overheads), slots)
    if kind in (Kind.RECV_ACT, Kind.RECV_GRAD):
        dev.clock = max(dev.clock, arrivals.pop((kind, mb, task)))
        _work(dev, _fixed_s(a, overheads), slots)
    elif kind in (Kind.SEND_ACT, Kind.SEND_GRAD):
        nbytes = costs.output_bytes(task) if kind is Kind.SEND_ACT else costs.input_grad_bytes(task)
        dev.send = max(dev.send, dev.clock) + links.send_s(nbytes)
        receiver = Kind.RECV_ACT if kind is Kind.SEND_ACT else Kind.RECV_GRAD
        arrivals[(receiver, mb, task + 1)] = dev.send
        totals.p2p_bytes += nbytes
    elif kind is Kind.PREFETCH:
        dev.events.append((dev.clock, _pack_bytes(config, costs, task), True))
        totals.weights_in_bytes += costs.weight_bytes(task)
        dev.prefetched[task] = _copy(dev, costs.weight_bytes(task), links, True, slots)
    elif kind is Kind.SWAP_IN and mb < 0:
        if task in dev.prefetched:
            dev.clock = max(dev.clock, dev.prefetched.pop(task))
        else:
            dev.events.append((dev.clock, _pack_bytes(config, costs, task), True))
            totals.weights_in_bytes += costs.weight_bytes(task)
            dev.clock = max(dev.clock, _copy(dev, costs.weight_bytes(task), links, True, slots))
    elif kind is Kind.SWAP_IN:
        nbytes = costs.stash_bytes(task)
        dev.events.append((dev.clock, nbytes, True))
        dev.stash_in[(mb, task)] = nbytes
        totals.stash_bytes += nbytes
        dev.clock = max(dev.clock, _copy(dev, nbytes, links, True, slots))
    elif kind is Kind.SWAP_OUT and mb >= 0:
        nbytes = costs.stash_bytes(task)
        start = dev.clock
        done = _copy(dev, nbytes, links, False, slots)
        dev.events += [(start, nbytes, True), (done, -nbytes, True)]
    elif kind is Kind.SWAP_OUT:
        w = costs.weight_bytes(task)
        if config.tasks[task].role == FORWARD:
            dev.events.append((dev.clock, -w, True))   # unchanged weights are dropped, not copied
        else:
            dev.events.append((dev.clock, -w, True))
            done = _copy(dev, w, links, False, slots)
            dev.events.append((done, -w, True))
            dev.grads_out[task] = done
            totals.gradients_out_bytes += w
    elif kind is Kind.UPDATE:
        dev.clock = max(dev.clock, dev.grads_out.pop(task, dev.clock))
        _work(dev, costs.update_s(task), slots)
    elif kind in (Kind.FWD, Kind.BWD):
        _compute(config, dev, kind, mb, task, costs, slots, overheads)
    else:
        raise PlannerError(f"harmony estimate: action {a} is not part of harmony_pp")
    return True


def _compute(config: HarmonyConfig, dev: _Device, kind: Kind, mb: int, task: int, costs: ActionCosts,
             slots: list[float] | None, overheads: HarmonyOverheads) -> None:
    role = config.tasks[task].role
    if kind is Kind.FWD:
        ratio = overheads.forward_ratio if role == FORWARD else overheads.train_ratio
        seconds = costs.forward_s(task) * ratio
    else:
        seconds = costs.backward_s(task) * overheads.train_ratio
    seconds += overheads.compute_action_s
    _work(dev, seconds, slots)
    start = dev.clock - seconds
    dev.busy += seconds
    acts = costs.activation_bytes(task)
    if kind is Kind.FWD and role != FORWARD:         # the jit pack keeps them for its backward
        dev.events.append((start, acts, False))
    elif kind is Kind.BWD and role != BACKWARD:
        dev.events.append((dev.clock, -acts, False))
    else:
        dev.events += [(start, acts, False), (dev.clock, -acts, False)]
    if kind is Kind.BWD and (mb, task) in dev.stash_in:
        dev.events.append((dev.clock, -dev.stash_in.pop((mb, task)), True))


def _peak(events: list[tuple[float, float, bool]], managed_only: bool) -> float:
    """Largest running sum; at equal times releases come first (the tier frees before it takes)."""
    level = peak = 0.0
    for _, delta, _ in sorted((e for e in events if e[2] or not managed_only), key=lambda e: (e[0], e[1])):
        level += delta
        peak = max(peak, level)
    return peak
