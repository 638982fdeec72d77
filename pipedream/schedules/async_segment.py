"""An asynchronous run cut into per-step windows: what each rank executes in each ``train_step``.

The pipedream and 2bw schedules never flush, so their action lists span the whole run (a
*segment*: from the start, or from the last drain, to the end). The trainer still calls
``train_step`` once per step with that step's micro-batches, and every call ends with a
collective (the loss all-reduce), so each rank's list is cut into one window per step such that
the ranks can run window t concurrently and all finish it:

- cut by time: window t holds the actions that start, in a simulation with unit costs
  (forward 1, backward 2), before the input stage would start a forward of step t + 1. The input
  stage therefore forwards exactly step t's micro-batches in window t, and the cut follows the
  steady-state wavefront, so the per-call collective costs no pipeline bubble;
- message-closed: a send stays in the window of the compute that produced its tensor, and every
  receive is moved into the window of its send. A message is sent and posted for receipt in the
  same window, so nothing is in flight between calls (evaluation or a checkpoint can run there,
  and Gloo's sends, which wait for the posted receive, complete);
- collectives (the replicas' gradient all-reduce) start at the same simulated time on every
  member, so each lies in one window.

Any cost model gives a valid cut (a consumer starts after its producer); the costs only decide how
well the cut matches the real wavefront. Pure Python, no torch.
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

from pipedream.schedules import Action, Kind, ScheduleError, build_schedule, pipedream_replicated
from pipedream.schedules.replicated import ReplicatedPipeline
from pipedream.schedules.versions import Uses, footprint, stash_versions, two_bw_versions, vertical_versions
from pipedream.schedules.simulate import Costs, simulate

_SEND_OF = {Kind.RECV_ACT: Kind.SEND_ACT, Kind.RECV_GRAD: Kind.SEND_GRAD}
_PRODUCER = {Kind.SEND_ACT: Kind.FWD, Kind.SEND_GRAD: Kind.BWD}


@dataclass(frozen=True)
class Segment:
    """Every rank's actions for ``steps`` steps from ``first_step`` on, cut into per-step windows.

    Micro-batch ids are local to the segment (0 .. steps * microbatches - 1); step
    ``first_step + t`` brings micro-batches ``t * microbatches ..``. Ranks are the topology's: the
    pipeline rank of a straight pipeline, the global rank of a replicated one.
    """

    schedule: str
    topology: ReplicatedPipeline
    microbatches: int
    first_step: int
    steps: int
    vertical_sync: bool
    actions: tuple[tuple[Action, ...], ...]                 # [rank] -> the whole list, in run order
    windows: tuple[tuple[tuple[Action, ...], ...], ...]     # [rank][t] -> window t

    def versions(self, rank: int) -> Uses:
        return version_plan(self.schedule, self.topology, [list(a) for a in self.actions], rank,
                            self.microbatches, self.vertical_sync)

    def peak_versions(self, rank: int) -> int:
        return footprint(list(self.actions[rank]), self.versions(rank), rank)


def segment_schedule(schedule: str, topology: ReplicatedPipeline, microbatches: int, steps: int
                     ) -> list[list[Action]]:
    if schedule == "pipedream":
        return pipedream_replicated(topology.replicas, microbatches, steps)
    if schedule == "2bw":
        if any(r != 1 for r in topology.replicas):
            raise ScheduleError(f"schedule 2bw replicates whole pipelines (parallel.dp), not single stages "
                                f"{list(topology.replicas)}: use schedule=pipedream for stage replicas")
        return build_schedule("2bw", topology.pp, microbatches, 1, steps)
    raise ScheduleError(f"schedule {schedule!r} is not asynchronous: it needs no segment")


def version_plan(schedule: str, topology: ReplicatedPipeline, actions: list[list[Action]], rank: int,
                 microbatches: int, vertical_sync: bool) -> Uses:
    if schedule == "2bw":
        return two_bw_versions(actions[rank], microbatches)
    if vertical_sync:
        return vertical_versions(actions, topology, rank)
    return stash_versions(actions[rank])


def build_segment(schedule: str, topology: ReplicatedPipeline, microbatches: int, steps: int,
                  first_step: int = 0, vertical_sync: bool = False) -> Segment:
    actions = segment_schedule(schedule, topology, microbatches, steps)
    windows = cut_windows(actions, topology, microbatches, steps)
    return Segment(schedule, topology, microbatches, first_step, steps, vertical_sync,
                   tuple(tuple(a) for a in actions), tuple(tuple(tuple(w) for w in rank) for rank in windows))


def simulate_topology(actions: list[list[Action]], topology: ReplicatedPipeline, costs: Costs | None = None):
    return simulate(actions, costs or Costs(forward=1.0, backward=2.0), vpp=1, peer=topology.peer,
                    needs=topology.needs, sync_groups=topology.sync_group)


def cut_windows(actions: list[list[Action]], topology: ReplicatedPipeline, microbatches: int, steps: int
                ) -> list[list[list[Action]]]:
    """[rank][t] -> the actions of window t (see the module docstring); raises if the cut is unsound."""
    starts = simulate_topology(actions, topology).starts
    bounds = [math.inf] * steps  # bounds[t]: window t ends where the input stage would start step t + 1
    for rank in topology.ranks(0):
        for action, start in zip(actions[rank], starts[rank]):
            if action.kind is Kind.FWD and action.microbatch >= microbatches:
                step = action.microbatch // microbatches
                bounds[step - 1] = min(bounds[step - 1], start)
    bounds = bounds[:-1]
    for t in range(len(bounds) - 2, -1, -1):  # a later step's first forward bounds every earlier window
        bounds[t] = min(bounds[t], bounds[t + 1])

    def window_of(start: float) -> int:
        return bisect.bisect_right(bounds, start)

    windows_of = []
    for rank_actions, rank_starts in zip(actions, starts):
        produced: dict[Action, int] = {}  # a send goes with the compute that produced its tensor
        rank_windows = []
        for action, start in zip(rank_actions, rank_starts):
            window = window_of(start)
            if action.kind in _PRODUCER:
                window = produced[Action(_PRODUCER[action.kind], action.microbatch, action.chunk)]
            elif action.kind in (Kind.FWD, Kind.BWD):
                produced[action] = window
            rank_windows.append(window)
        windows_of.append(rank_windows)
    sends = _send_windows(actions, windows_of, topology)
    result = []
    for rank, rank_actions in enumerate(actions):
        keyed = []
        for index, action in enumerate(rank_actions):
            window = windows_of[rank][index]
            if action.kind in _SEND_OF:
                window = sends[(rank, action)]
            keyed.append((window, index, action))
        keyed.sort(key=lambda item: (item[0], item[1]))
        per_window: list[list[Action]] = [[] for _ in range(steps)]
        for window, _, action in keyed:
            per_window[window].append(action)
        result.append(per_window)
    check_windows(result, topology)
    return result


def _send_windows(actions: list[list[Action]], windows_of: list[list[int]], topology: ReplicatedPipeline
                  ) -> dict[tuple[int, Action], int]:
    """(receiving rank, receive) -> the window in which its message is sent."""
    result = {}
    for rank, rank_actions in enumerate(actions):
        for index, action in enumerate(rank_actions):
            if action.kind in (Kind.SEND_ACT, Kind.SEND_GRAD):
                dst, _ = topology.peer(rank, action)
                kind = Kind.RECV_ACT if action.kind is Kind.SEND_ACT else Kind.RECV_GRAD
                result[(dst, Action(kind, action.microbatch, 0))] = windows_of[rank][index]
    return result


def check_windows(windows: list[list[list[Action]]], topology: ReplicatedPipeline) -> None:
    """The windows concatenated are a valid run, and each window is closed: every message is sent
    and received in one window, receives come before their consumers, and each all-reduce has all its
    members in one window. Together these let the ranks run window by window with a barrier between."""
    simulate_topology([[a for w in rank for a in w] for rank in windows], topology)
    sent: dict[tuple[int, Action], int] = {}
    posted: dict[tuple[int, Action], int] = {}
    syncs: dict[tuple[object, int], list[int]] = {}
    for rank, rank_windows in enumerate(windows):
        for t, window in enumerate(rank_windows):
            for action in window:
                if action.kind in (Kind.SEND_ACT, Kind.SEND_GRAD):
                    dst, _ = topology.peer(rank, action)
                    kind = Kind.RECV_ACT if action.kind is Kind.SEND_ACT else Kind.RECV_GRAD
                    sent[(dst, Action(kind, action.microbatch, 0))] = t
                elif action.kind in _SEND_OF:
                    posted[(rank, action)] = t
                elif action.kind is Kind.SYNC_GRADS:
                    syncs.setdefault((topology.sync_group(rank), rank), []).append(t)
    for key, t in posted.items():
        if sent.get(key) != t:
            raise ScheduleError(f"rank {key[0]} posts {key[1]} in window {t} but its message is sent in window "
                                f"{sent.get(key)}: windows must be message-closed")
    per_group: dict[object, list[int]] = {}
    for (group, _), windows_of_syncs in syncs.items():
        if per_group.setdefault(group, windows_of_syncs) != windows_of_syncs:
            raise ScheduleError(f"the all-reduces of stage group {group} fall into different windows on its members")
