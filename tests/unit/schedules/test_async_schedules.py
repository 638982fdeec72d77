"""The asynchronous schedules as data: complete, matched, deadlock-free (collectives included),
the weight-version rules and their memory bounds, the per-step windows, and the config errors.
Pure Python, no processes: every p <= 8 and every replica pattern up to 8 ranks in seconds."""
from __future__ import annotations

import functools
import math

import pytest

from pipedream.schedules.async_segment import build_segment, simulate_topology
from pipedream.errors import ConfigError
from pipedream.config.run_spec import build_run_spec
from pipedream.schedules import (Action, Kind, ReplicatedPipeline, ScheduleError, build_schedule, format_actions,
                                 parse_actions, pipedream_replicated)
from pipedream.schedules.__main__ import main
from pipedream.schedules.versions import (entry_updates, footprint, stash_versions, two_bw_versions,
                                          vertical_versions)
from pipedream.schedules.simulate import Costs, DeadlockError, check_channel_order, simulate
from tests.support.schedule_checks import check_compute
from tests.support.training_harness import compose_config


def compositions(n: int):
    """Every replica pattern of n ranks: (2, 1), (1, 2), (1, 1, 1) for n = 3, ..."""
    if n == 0:
        yield ()
        return
    for first in range(1, n + 1):
        for rest in compositions(n - first):
            yield (first,) + rest


PATTERNS = [p for n in range(1, 9) for p in compositions(n)]
COSTS = [Costs(forward=1.0, backward=1.0), Costs(forward=1.0, backward=2.0),
         Costs(forward=1.0, backward=3.0, latency=0.5)]


def simulate_pipeline(schedule, topology: ReplicatedPipeline, costs: Costs = Costs()):
    return simulate(schedule, costs, vpp=1, peer=topology.peer, needs=topology.needs, sync_groups=topology.sync_group)


@pytest.mark.parametrize("pp", range(1, 9))
def test_pipedream_straight(pp: int) -> None:
    for m, steps in [(1, 1), (1, 2 * pp), (3, 3), (pp, 2)]:
        total = m * steps
        schedule = build_schedule("pipedream", pp, m, 1, steps)
        check_compute(schedule, total, 1)
        check_channel_order(schedule, pp, 1)
        for rank, actions in enumerate(schedule):
            kinds = [a.kind for a in actions]
            assert kinds.count(Kind.STEP) == total  # an update after every micro-batch's backward
            for i, kind in enumerate(kinds):
                if kind is Kind.BWD:
                    rest = [k for k in kinds[i + 1:] if k not in (Kind.SEND_GRAD,)]
                    assert rest[:2] == [Kind.SYNC_GRADS, Kind.STEP]
        for costs in COSTS:
            result = simulate(schedule, costs)
            assert result.peak_in_flight == [min(pp - r, total) for r in range(pp)]
        # steady state is bubble-free: the only idle time is the run's warm-up and drain
        unit = simulate(build_schedule("pipedream", pp, 1, 1, 64), Costs(forward=1.0, backward=1.0))
        assert unit.iteration_time == pytest.approx(2 * (64 + pp - 1))


@pytest.mark.parametrize("pp", range(1, 9))
def test_two_bw(pp: int) -> None:
    for m in (pp, pp + 1, 2 * pp):
        for steps in (1, 2, 4):
            schedule = build_schedule("2bw", pp, m, 1, steps)
            check_compute(schedule, m * steps, 1)
            check_channel_order(schedule, pp, 1)
            for rank, actions in enumerate(schedule):
                assert [a.kind for a in actions].count(Kind.STEP) == steps  # one update per batch
                uses = two_bw_versions(actions, m)
                assert footprint(actions, uses, rank) <= 2
                if steps >= 3:
                    assert footprint(actions, uses, rank) == 2   # current + shadow
            result = simulate(schedule, Costs(forward=1.0, backward=2.0))
            assert result.peak_in_flight == [min(pp - r, m * steps) for r in range(pp)]
        assert build_schedule("2bw", pp, m, 1, 1) == build_schedule("1f1b", pp, m)  # one batch = 1F1B + flush
    with pytest.raises(ScheduleError, match=r"needs microbatches per batch \(m = 1\) >= pp"):
        build_schedule("2bw", 2, 1, 1, 3)


@pytest.mark.parametrize("steps", (1, 4))
@pytest.mark.parametrize("ranks", range(1, 9))
def test_every_replica_pattern_up_to_eight_ranks(ranks: int, steps: int) -> None:
    for replicas in compositions(ranks):
        topology = ReplicatedPipeline(replicas)
        m = functools.reduce(math.lcm, replicas, 1)
        total = m * steps
        schedule = pipedream_replicated(replicas, m, steps)
        for costs in COSTS:
            result = simulate_pipeline(schedule, topology, costs)   # raises on deadlock or bad channels
        for stage in range(topology.pp):
            seen = []
            for rank in topology.ranks(stage):
                forwards = [a.microbatch for a in schedule[rank] if a.kind is Kind.FWD]
                backwards = [a.microbatch for a in schedule[rank] if a.kind is Kind.BWD]
                assert forwards == backwards == list(topology.microbatches_of(rank, total))  # round-robin
                seen += forwards
                assert result.peak_in_flight[rank] == min(topology.in_flight(stage), len(forwards))
                stash = stash_versions(schedule[rank])
                assert footprint(schedule[rank], stash, rank) <= result.peak_in_flight[rank]
                footprint(schedule[rank], vertical_versions(schedule, topology, rank), rank)
            assert sorted(seen) == list(range(total))


def test_noam_and_routing() -> None:
    topology = ReplicatedPipeline((2, 1))
    assert topology.in_flight(0) == 2 and topology.in_flight(1) == 1   # ceil(3 workers / 2 input replicas)
    assert [topology.route(0, k) for k in range(4)] == [0, 1, 0, 1] and topology.route(1, 3) == 2
    assert topology.peer(2, Action(Kind.SEND_GRAD, 3)) == (1, 0)
    assert topology.peer(1, Action(Kind.SEND_ACT, 3)) == (2, 0)
    assert ReplicatedPipeline((1, 1, 1, 1)).in_flight(0) == 4
    assert ReplicatedPipeline((3, 1, 2)).in_flight(1) == 3
    with pytest.raises(ScheduleError, match=r"multiple of 6"):
        pipedream_replicated((2, 3), 4)


def test_staleness_formulas() -> None:
    """Weight stashing on a straight pipeline: stage s computes micro-batch k with its version
    max(0, k - p + s + 1), so W(t+1) = W(t) - lr grad f(W_1(t-p+1), ..., W_p(t)); vertical sync puts
    every stage at the input stage's max(0, k - p + 1)."""
    p, total = 4, 12
    schedule = build_schedule("pipedream", p, 1, 1, total)
    topology = ReplicatedPipeline.straight(p)
    entry = entry_updates(schedule, topology)
    for s in range(p):
        stash, vertical = stash_versions(schedule[s]), vertical_versions(schedule, topology, s)
        for k in range(total):
            for kind in (Kind.FWD, Kind.BWD):
                assert stash[Action(kind, k)] == max(0, k - p + s + 1)
                assert vertical[Action(kind, k)] == entry[k] == max(0, k - p + 1)
        assert footprint(schedule[s], stash) == p - s          # one version per in-flight micro-batch
        assert footprint(schedule[s], vertical) == p           # later stages keep versions for arrivals
    uses = two_bw_versions(build_schedule("2bw", 2, 3, 1, 4)[0], 3)
    assert [uses[Action(Kind.FWD, k)] for k in range(12)] == [0] * 6 + [1] * 3 + [2] * 3


def test_sync_groups_take_part_in_deadlock_detection() -> None:
    topology = ReplicatedPipeline((2,))
    schedule = [parse_actions("F0 B0 SYNC STEP F2 B2 SYNC STEP"), parse_actions("F1 B1 SYNC STEP")]
    with pytest.raises(DeadlockError, match=r"rank 0 blocked at SYNC \(waiting for the other members"):
        simulate_pipeline(schedule, topology)
    schedule[1] += parse_actions("F3 B3 SYNC STEP")
    result = simulate_pipeline(schedule, topology, Costs(forward={(0, 0): 1.0, (1, 0): 2.0}, backward=1.0))
    syncs = [[i.start for i in timeline if i.action.kind is Kind.SYNC_GRADS] for timeline in result.timelines]
    assert syncs[0] == syncs[1] == [3.0, 6.0]   # the faster replica waits for the slower one


@pytest.mark.parametrize("schedule,replicas,m", [
    *[("pipedream", (1,) * p, m) for p in range(1, 9) for m in (1, 2, 5)],
    *[("2bw", (1,) * p, m) for p in range(1, 9) for m in (p, p + 2)],
    *[("pipedream", r, functools.reduce(math.lcm, r, 1)) for r in PATTERNS if sum(r) <= 5],
])
def test_windows_are_closed(schedule: str, replicas: tuple[int, ...], m: int) -> None:
    steps = 4
    topology = ReplicatedPipeline(replicas)
    segment = build_segment(schedule, topology, m, steps)
    for rank in range(topology.world_size):
        windowed = [a for w in segment.windows[rank] for a in w]
        assert sorted(map(str, windowed)) == sorted(map(str, segment.actions[rank]))
    for t in range(steps):  # windows 0..t run on their own (a barrier after each) without deadlock
        simulate_topology([[a for w in rank[:t + 1] for a in w] for rank in segment.windows], topology)
    for rank in topology.ranks(0):  # the input stage forwards exactly step t's micro-batches in window t
        for t, window in enumerate(segment.windows[rank]):
            assert all(t * m <= a.microbatch < (t + 1) * m for a in window if a.kind is Kind.FWD)
            assert any(a.kind is Kind.FWD for a in window)


def test_steady_state_windows_do_not_stall() -> None:
    """Cut along the wavefront: in steady state every rank does m forwards and m backwards per window."""
    segment = build_segment("pipedream", ReplicatedPipeline.straight(4), 4, 8)
    for rank in range(4):
        for window in segment.windows[rank][2:-1]:
            kinds = [a.kind for a in window]
            assert kinds.count(Kind.FWD) == kinds.count(Kind.BWD) == kinds.count(Kind.STEP) == 4


def test_string_round_trip_and_cli(capsys) -> None:
    for actions in build_schedule("2bw", 3, 3, 1, 2) + pipedream_replicated((2, 1, 2), 2, 2):
        assert parse_actions(format_actions(actions)) == actions
    assert main(["--schedule", "pipedream", "--pp", "3", "--microbatches", "1", "--steps", "6"]) == 0
    out = capsys.readouterr().out
    assert "rank 2" in out and "peak in-flight micro-batches per rank: 3 2 1" in out


BASE = ["model=mlp", "data=synthetic", "model.num_layers=4", "train.micro_batch_size=2", "train.global_batch_size=4"]


@pytest.mark.parametrize("overrides,message", [
    (["schedule=2bw", "parallel.pp=4", "train.global_batch_size=6"],
     "schedule 2bw needs microbatches per batch (m = 3) >= pp (4)"),
    (["schedule=pipedream", "parallel.stage_replicas=[2,2]"],
     "parallel.stage_replicas=[2, 2] sums to 4 ranks but WORLD_SIZE = 3"),
    (["schedule=1f1b", "schedule.vertical_sync=true"],
     "schedule.vertical_sync=true applies to schedule=pipedream only (got schedule=1f1b)"),
    (["schedule=gpipe", "parallel.stage_replicas=[2,1]"], "only schedule=pipedream (1F1B-RR) runs"),
    (["schedule=pipedream", "parallel.stage_replicas=[2,1,1]"],
     "has 3 entries but parallel.pp = 2: set parallel.pp=3"),
    (["schedule=pipedream", "parallel.stage_replicas=[2,1]", "train.global_batch_size=6"],
     "needs the micro-batches per step (3) to be a multiple of 2"),
    (["schedule=2bw", "parallel.vpp=2"], "parallel.vpp = 2 needs schedule=interleaved"),
])
def test_config_errors_are_one_line(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        build_run_spec(compose_config(BASE + overrides), world_size=3)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_async_schedules_reject_ties_across_stages() -> None:
    with pytest.raises(ConfigError, match="cannot tie the embedding .* set model.tie_embeddings=false"):
        build_run_spec(compose_config(["schedule=2bw", "model=gpt_tiny", "model.tie_embeddings=true"]))
    build_run_spec(compose_config(["schedule=2bw", "model=gpt_tiny", "parallel.pp=1"]))  # one stage: fine


def test_valid_async_configs() -> None:
    spec = build_run_spec(compose_config(BASE + ["schedule=pipedream", "parallel.stage_replicas=[2,1]"]), 3)
    assert spec.layout.world_size == 3 and spec.layout.stage_replicas == (2, 1) and spec.microbatches == 2
    spec = build_run_spec(compose_config(BASE + ["schedule=pipedream", "schedule.vertical_sync=true"]), 2)
    assert spec.vertical_sync
    spec = build_run_spec(compose_config(BASE + ["schedule=2bw", "parallel.dp=2", "train.global_batch_size=8"]), 4)
    assert spec.microbatches == 2
