"""Harmony's wrap-around pipeline as data (harmony_pp): layer packs, input-batch grouping,
just-in-time updates and explicit swaps. No torch.

A configuration is Harmony's four-tuple plus the device count: forward packs P_F and backward
packs P_B (consecutive ``[first, stop)`` layer ranges covering the model), U_F and U_B (the
micro-batches one forward / backward task runs back to back while its pack's weights stay on the
device), and N devices. The last pack is shared by P_F and P_B and runs as one task whose backward
follows each micro-batch's forward straight away (jit-compute), so it keeps its activations and is
not recomputed. The task sequence P_FB = P_F + reverse(P_B without that shared pack) is bound
round the devices, task i on device i mod N, so a device runs different packs forwards and
backwards. Every backward task is followed by its pack's optimizer update (jit-update).

In each device's action list ``Action.chunk`` is the task index i, and:

- ``SI.i`` / ``SO.i``: the pack's weights come onto the device / leave it (a backward task writes
  its gradients to the host tier as they leave); ``PF.i`` starts ``SI.i`` one task early;
- ``F<mb>.i`` / ``B<mb>.i``: the pack's forward / backward (a backward task recomputes its pack
  from the stashed input first); ``U.i``: the pack's update, after its last backward;
- ``SO<mb>.j`` (on the forward device) / ``SI<mb>.j`` (on the backward device): the input of
  backward task j for micro-batch mb, stashed to the host tier and brought back for the recompute
  (after the forward's stashes come its send; the stash is read after ``RG<mb>.j`` has arrived);
- ``SA``/``RA`` and ``SG``/``RG``: a pack's output / input gradient sent device-to-device to task
  i + 1 (none when both tasks share a device, N = 1).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from pipedream.schedules.actions import Action, Kind
from pipedream.schedules.common import add_communication
from pipedream.schedules.actions import ScheduleError
from pipedream.schedules.info import ScheduleInfo

MODES = ("pp",)
FORWARD, JIT, BACKWARD = "forward", "forward+backward", "backward"


def packs_from_sizes(sizes, num_layers: int, name: str = "packs") -> tuple[tuple[int, int], ...]:
    """Layers per pack, e.g. [2, 2, 1], -> ((0, 2), (2, 4), (4, 5)); ScheduleError unless the sizes
    are positive integers summing to ``num_layers``."""
    sizes = list(sizes)
    if not sizes or any(not isinstance(s, int) or isinstance(s, bool) or s < 1 for s in sizes):
        raise ScheduleError(f"{name} = {sizes}: give layers per pack as positive integers, e.g. [2, 2, 1]")
    if sum(sizes) != num_layers:
        raise ScheduleError(f"{name} = {sizes} sum to {sum(sizes)} layers but the model has {num_layers}; "
                            f"make them sum to {num_layers}")
    bounds, first = [], 0
    for size in sizes:
        bounds.append((first, first + size))
        first += size
    return tuple(bounds)


@dataclass(frozen=True)
class Task:
    index: int
    role: str                  # FORWARD, JIT or BACKWARD
    layers: tuple[int, int]    # [first, stop)
    device: int


@dataclass(frozen=True)
class HarmonyConfig:
    num_layers: int
    forward_packs: tuple[tuple[int, int], ...]
    backward_packs: tuple[tuple[int, int], ...]
    microbatches: int
    forward_group: int         # U_F: micro-batches per forward task
    backward_group: int        # U_B: micro-batches per backward task
    devices: int               # N
    mode: str = "pp"

    def __post_init__(self) -> None:
        for name in ("num_layers", "microbatches", "forward_group", "backward_group", "devices"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ScheduleError(f"{name} = {value!r} must be an integer >= 1")
        if self.mode not in MODES:
            raise ScheduleError(f"mode = {self.mode!r} is not supported; choose one of {', '.join(MODES)}")
        for name in ("forward_packs", "backward_packs"):
            packs = getattr(self, name)
            _check_cover(name, packs, self.num_layers)
        if self.forward_packs[-1] != self.backward_packs[-1]:
            raise ScheduleError(f"the last forward pack {list(self.forward_packs[-1])} and the last backward pack "
                                f"{list(self.backward_packs[-1])} must be the same layers (it runs forward and backward "
                                f"in one task); make the packs end alike")
        for name in ("forward_group", "backward_group"):
            if getattr(self, name) > self.microbatches:
                raise ScheduleError(f"{name} = {getattr(self, name)} exceeds the {self.microbatches} micro-batches "
                                    f"of an iteration; use at most {self.microbatches}")

    @cached_property
    def tasks(self) -> tuple[Task, ...]:
        """P_FB in order, task i bound to device i mod N."""
        packs = [(FORWARD, p) for p in self.forward_packs[:-1]] + [(JIT, self.forward_packs[-1])]
        packs += [(BACKWARD, p) for p in reversed(self.backward_packs[:-1])]
        return tuple(Task(i, role, layers, i % self.devices) for i, (role, layers) in enumerate(packs))

    def groups(self, task: Task) -> list[range]:
        """The micro-batch groups a task runs, each with its pack's weights swapped in once."""
        size = self.backward_group if task.role == BACKWARD else self.forward_group
        return [range(first, min(first + size, self.microbatches)) for first in range(0, self.microbatches, size)]

    def stashes(self, task: Task) -> list[Task]:
        """Backward tasks whose pack input forward task ``task`` produces (it stashes those)."""
        if task.role != FORWARD:
            return []
        first, stop = task.layers
        return [t for t in self.tasks if t.role == BACKWARD and first <= t.layers[0] < stop]

    def stash_source(self, task: Task) -> Task:
        """The forward task that stashes backward task ``task``'s input."""
        return next(t for t in self.tasks if task in self.stashes(t))

    def placement(self) -> "HarmonyPlacement":
        return HarmonyPlacement(self)


class HarmonyPlacement:
    """Who talks to whom: every message goes from task i to task i + 1 (activations forwards, then
    gradients backwards along P_FB). ``peer``/``needs``/``sends`` as ``placement.Placement``."""

    def __init__(self, config: HarmonyConfig):
        self.config = config
        self.pp, self.vpp = config.devices, len(config.tasks)

    def _remote(self, task: int, step: int) -> bool:
        tasks = self.config.tasks
        return 0 <= task + step < len(tasks) and tasks[task + step].device != tasks[task].device

    def peer(self, rank: int, action: Action, pp: int | None = None, vpp: int | None = None) -> tuple[int, int]:
        step = {Kind.SEND_ACT: 1, Kind.SEND_GRAD: 1, Kind.RECV_ACT: -1, Kind.RECV_GRAD: -1}.get(action.kind)
        if step is None:
            raise ValueError(f"{action} is not a communication action")
        if not self._remote(action.chunk, step):
            raise ScheduleError(f"device {rank}: {action} has no peer on another device")
        other = self.config.tasks[action.chunk + step]
        return other.device, other.index

    def sends(self, rank: int, action: Action) -> Action | None:
        role = self.config.tasks[action.chunk].role
        if not self._remote(action.chunk, 1):
            return None
        if action.kind is Kind.FWD and role == FORWARD:
            return Action(Kind.SEND_ACT, action.microbatch, action.chunk)
        if action.kind is Kind.BWD:
            return Action(Kind.SEND_GRAD, action.microbatch, action.chunk)
        return None

    def needs(self, rank: int, action: Action) -> Action | None:
        role = self.config.tasks[action.chunk].role
        if not self._remote(action.chunk, -1):
            return None
        if action.kind is Kind.FWD:
            return Action(Kind.RECV_ACT, action.microbatch, action.chunk)
        if action.kind is Kind.BWD and role == BACKWARD:
            return Action(Kind.RECV_GRAD, action.microbatch, action.chunk)
        return None


def _check_cover(name: str, packs, num_layers: int) -> None:
    expected = 0
    for pack in packs:
        first, stop = pack
        if first != expected or stop <= first:
            raise ScheduleError(f"{name} = {[list(p) for p in packs]}: packs must be consecutive, non-empty "
                                f"[first, stop) ranges starting at layer 0")
        expected = stop
    if expected != num_layers:
        raise ScheduleError(f"{name} = {[list(p) for p in packs]} cover {expected} layers but the model has "
                            f"{num_layers}; cover every layer")


def _task_compute(config: HarmonyConfig, task: Task) -> list[list[Action]]:
    """One list of actions per micro-batch group of ``task`` (no messages yet)."""
    i, lists = task.index, []
    for group in config.groups(task):
        actions = [Action(Kind.SWAP_IN, -1, i)]
        for mb in group:
            if task.role == FORWARD:
                actions.append(Action(Kind.FWD, mb, i))
                actions += [Action(Kind.SWAP_OUT, mb, target.index) for target in config.stashes(task)]
            elif task.role == JIT:
                actions += [Action(Kind.FWD, mb, i), Action(Kind.BWD, mb, i)]
            else:
                actions += [Action(Kind.SWAP_IN, mb, i), Action(Kind.BWD, mb, i)]
        actions.append(Action(Kind.SWAP_OUT, -1, i))
        lists.append(actions)
    if task.role != FORWARD:
        lists[-1].append(Action(Kind.UPDATE, -1, i))
    return lists


def _add_prefetch(groups: list[list[Action]]) -> list[Action]:
    """Concatenate one device's groups; before the last compute of each group, start the swap-in
    of the next group's pack if that is another pack (one task ahead)."""
    out: list[Action] = []
    for n, actions in enumerate(groups):
        following = groups[n + 1][0] if n + 1 < len(groups) else None
        if following is not None and following.chunk != actions[0].chunk:
            last = max(k for k, a in enumerate(actions) if a.kind in (Kind.FWD, Kind.BWD))
            if actions[last - 1].kind is Kind.SWAP_IN:   # the compute's stash comes in with it
                last -= 1
            actions = actions[:last] + [Action(Kind.PREFETCH, -1, following.chunk)] + actions[last:]
        out += actions
    return out


def _stash_order(actions: list[Action]) -> list[Action]:
    """A forward's output is sent after its stashes are written, and a backward task reads its
    stash only once the output gradient has arrived: that message ends a chain that starts with
    the send, so the stash is complete when it is read (on any device)."""
    out = list(actions)
    for k in range(len(out) - 1):
        if out[k].kind is Kind.SEND_ACT:
            end = k + 1
            while end < len(out) and out[end].kind is Kind.SWAP_OUT and out[end].microbatch >= 0:
                end += 1
            out[k:end] = out[k + 1:end] + [out[k]]
        elif out[k].kind is Kind.SWAP_IN and out[k].microbatch >= 0 and out[k + 1].kind is Kind.RECV_GRAD:
            out[k], out[k + 1] = out[k + 1], out[k]
    return out


def harmony_pp(config: HarmonyConfig) -> list[list[Action]]:
    """Each device's actions for one iteration (a flush: every update is done at its end)."""
    per_device: list[list[list[Action]]] = [[] for _ in range(config.devices)]
    for task in config.tasks:
        per_device[task.device] += _task_compute(config, task)
    compute = [_add_prefetch(groups) for groups in per_device]
    with_messages = add_communication(compute, config.devices, len(config.tasks), config.placement())
    return [_stash_order(actions) for actions in with_messages]


def describe(config: HarmonyConfig) -> str:
    """The task table: P_FB with each task's role, layers, groups and device."""
    lines = [f"harmony_pp: {config.num_layers} layers, {config.microbatches} micro-batches, {config.devices} "
             f"device(s); U_F = {config.forward_group}, U_B = {config.backward_group} micro-batches per task",
             "task  device  role              layers    groups  stashes for"]
    for task in config.tasks:
        first, stop = task.layers
        stash = ",".join(str(t.index) for t in config.stashes(task)) or "-"
        layers = f"[{first}, {stop})"
        lines.append(f"{task.index:<5} {task.device:<7} {task.role:<17} {layers:<9} {len(config.groups(task)):<7} {stash}")
    return "\n".join(lines)


def harmony_config(num_layers: int, microbatches: int, devices: int, forward_packs=None, backward_packs=None,
                   forward_group: int | None = None, backward_group: int | None = None,
                   mode: str = "pp") -> HarmonyConfig:
    """A configuration from layers-per-pack lists and group sizes; None picks the simple default:
    one layer per pack (the least device memory), every micro-batch of the iteration in one group
    (the fewest swaps). The last packs must agree (``HarmonyConfig``)."""
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
        raise ScheduleError(f"num_layers = {num_layers!r} must be an integer >= 1")
    one_each = [1] * num_layers
    return HarmonyConfig(
        num_layers,
        packs_from_sizes(one_each if forward_packs is None else forward_packs, num_layers, "forward_packs"),
        packs_from_sizes(one_each if backward_packs is None else backward_packs, num_layers, "backward_packs"),
        microbatches,
        microbatches if forward_group is None else forward_group,
        microbatches if backward_group is None else backward_group,
        devices, mode)


INFO = ScheduleInfo(
    name="harmony_pp", build=None, memory_virtualised=True,
    in_flight=lambda stage, p, m, v: m + 0 * stage,   # every micro-batch's stashed inputs wait for its backward task
    not_planned="harmony_pp is planned by planner.algorithm=harmony (layer packs and groups, not pipeline stages)")

# Harmony DP: each of parallel.dp devices runs the one-device list (every pack, forward and backward)
# over its own share of the micro-batches; every layer's gradients meet on the host, then one update.
INFO_DP = ScheduleInfo(
    name="harmony_dp", build=None, memory_virtualised=True, replicated_packs=True,
    in_flight=lambda stage, p, m, v: m + 0 * stage,
    not_planned="harmony_dp is not planned as pipeline stages: give its packs (schedule.forward_packs, "
                "schedule.backward_packs); planner.harmony's estimator prices a configuration")
