"""Which weight version every forward and backward of a rank uses, derived from the action lists.

A version is a count of this rank's updates (STEP actions) since the run (or segment) began:
version 0 is the initial weights. Every rank computes the same answers from the same lists, so no
version id travels between ranks. The rules:

- weight stashing (pipedream): a forward uses the newest local version, its backward the same one;
- vertical sync (pipedream): micro-batch k uses, at every stage, the version that was newest at the
  input stage when k entered it, i.e. stage 0's update count before F(k), converted to this stage's
  count (updates x replicas = micro-batches absorbed; equal on a straight pipeline);
- 2BW: micro-batch k (0-indexed) uses max(k // m - 1, 0) (ch. 3.2.1).

``footprint`` replays a rank's list the way the runtime's WeightStore does and returns the peak
number of versions held, so memory bounds are checked without running anything.
"""
from __future__ import annotations

from collections import Counter
from typing import Callable

from pipedream.schedules.actions import Action, Kind
from pipedream.schedules.actions import ScheduleError
from pipedream.schedules.replicated import ReplicatedPipeline

Uses = dict[Action, int]
"""FWD/BWD action -> the version it uses (actions are unique within a run)."""


def stash_versions(actions: list[Action]) -> Uses:
    uses: Uses = {}
    updates = 0
    for action in actions:
        if action.kind is Kind.STEP:
            updates += 1
        elif action.kind is Kind.FWD:
            uses[action] = updates
        elif action.kind is Kind.BWD:
            uses[action] = uses[Action(Kind.FWD, action.microbatch, action.chunk)]
    return uses


def rule_versions(actions: list[Action], version_of: Callable[[int], int]) -> Uses:
    """Both passes of micro-batch k use ``version_of(k)``."""
    return {a: version_of(a.microbatch) for a in actions if a.kind in (Kind.FWD, Kind.BWD)}


def two_bw_versions(actions: list[Action], microbatches: int) -> Uses:
    return rule_versions(actions, lambda k: max(k // microbatches - 1, 0))


def entry_updates(schedule: list[list[Action]], topology: ReplicatedPipeline) -> dict[int, int]:
    """Micro-batch -> updates its input-stage replica had applied when the micro-batch entered."""
    entry: dict[int, int] = {}
    for rank in topology.ranks(0):
        for action, version in stash_versions(schedule[rank]).items():
            if action.kind is Kind.FWD:
                entry[action.microbatch] = version
    return entry


def vertical_versions(schedule: list[list[Action]], topology: ReplicatedPipeline, rank: int) -> Uses:
    entry = entry_updates(schedule, topology)
    stage = topology.stage_of(rank)
    first, mine = topology.replicas[0], topology.replicas[stage]
    return rule_versions(schedule[rank], lambda k: entry[k] * first // mine)


def footprint(actions: list[Action], uses: Uses, rank: int = 0) -> int:
    """Peak versions held when replaying ``actions`` like the runtime: the current weights plus every
    older version some later action still uses. ScheduleError if a version is needed before it
    exists."""
    pending = Counter(uses.values())
    current, retained, peak = 0, set(), 1
    for action in actions:
        if action.kind is Kind.STEP:
            if pending[current] > 0:
                retained.add(current)
            current += 1
        elif action in uses:
            version = uses[action]
            if version > current:
                raise ScheduleError(f"rank {rank}: {action} needs weight version {version} but only {current} "
                                    f"updates have happened there")
            pending[version] -= 1
            if pending[version] == 0:
                retained.discard(version)
        peak = max(peak, 1 + len(retained - {current}))
    return peak
