"""The zero-bubble schedules (zb_h2, zbv) as data: complete, matched, deadlock-free under the
simulator and NCCL's stream rules, with the bubble and memory of Qi et al.'s analysis at unit costs."""
from __future__ import annotations

import pytest

from pipedream.config.loading import compose_config
from pipedream.errors import ConfigError
from pipedream.config.run_spec import build_run_spec
from pipedream.schedules import (SCHEDULES, SPLIT_BACKWARD_SCHEDULES, Action, Kind, Placement, ScheduleError,
                                 build_schedule, parse_action, parse_actions, schedule_placement)
from pipedream.schedules.__main__ import main
from pipedream.schedules.issue_order import issue_order
from pipedream.schedules.channels import check_channel_order
from pipedream.schedules.simulate import Costs, simulate
from pipedream.schedules.stream_model import check_stream_order
from tests.support.schedule_checks import check_compute, check_local_handover

UNIT = Costs(forward=1.0, backward=2.0, weight_grad=1.0)   # F = B = W = 1 per chunk
ZERO_BUBBLE = ("zb_h2", "zbv")


def run(name: str, pp: int, m: int, costs: Costs = UNIT):
    placement = schedule_placement(name, pp)
    schedule = build_schedule(name, pp, m)
    return schedule, placement, simulate(schedule, costs, vpp=placement.vpp, peer=placement.peer,
                                         needs=placement.needs)


@pytest.mark.parametrize("name", ZERO_BUBBLE)
@pytest.mark.parametrize("pp", range(1, 9))
def test_every_size_is_complete_matched_and_as_short_as_the_analysis(name: str, pp: int) -> None:
    for m in range(1, 33):
        where = f"{name} pp={pp} m={m}"
        schedule, placement, result = run(name, pp, m)
        check_compute(schedule, m, placement.vpp)      # F, B and W of every (mb, chunk), in that order
        check_local_handover(schedule, placement)
        check_channel_order(schedule, pp, placement.vpp, placement.peer)
        assert all(actions[-2:] == [Action(Kind.SYNC_GRADS), Action(Kind.STEP)] for actions in schedule), where
        ideal = 3 * m * placement.vpp
        fill = pp - 1                                   # the first input reaches rank p-1 after p-1 chunk forwards
        if name == "zb_h2":
            assert result.iteration_time == max(ideal + fill, 2 * m + 2 * pp - 1), where
            if m >= 2 * pp - 1:
                assert result.steady_bubble_fraction == 0.0, where
            assert result.peak_in_flight == [min(2 * pp - 1, m)] * pp, where   # ~2x 1F1B's p at stage 0
        else:
            if m >= 2 * pp - 1:                        # the paper's hand-made order: exactly the fill
                assert result.iteration_time == ideal + fill, where
            if pp <= 4 and m >= pp:
                assert result.iteration_time == ideal + fill, where
            # 2p (micro-batch, half-stage chunk) pairs = 1F1B's p micro-batches at stage 0, on every rank
            assert result.peak_in_flight == [min(2 * pp, 2 * m)] * pp, where


def test_bubble_against_1f1b_and_the_memory_claims() -> None:
    costs_1f1b = Costs(forward=1.0, backward=2.0)
    for pp in (2, 4, 8):
        for m in (pp, 2 * pp, 32):
            one_f_one_b = simulate(build_schedule("1f1b", pp, m), costs_1f1b)
            _, _, h2 = run("zb_h2", pp, m)
            _, _, v = run("zbv", pp, m)
            assert abs(one_f_one_b.bubble_fraction - (pp - 1) / m) < 1e-9
            assert abs(h2.bubble_fraction - (pp - 1) / (3 * m)) < 1e-9              # a third of 1F1B's
            assert (pp - 1) / (6 * m) - 1e-9 <= v.bubble_fraction <= (pp + 1) / (6 * m)   # about a sixth
            assert max(h2.peak_in_flight) <= 2 * max(one_f_one_b.peak_in_flight)
            assert max(v.peak_in_flight) / 2 <= max(one_f_one_b.peak_in_flight)     # chunks are half stages


def test_stash_bytes_follow_activations_until_w() -> None:
    for name in ZERO_BUBBLE:
        costs = Costs(forward=1.0, backward=2.0, weight_grad=1.0, stash_bytes=10.0)
        _, _, result = run(name, 4, 8, costs)
        assert result.peak_stash_bytes == [10.0 * n for n in result.peak_in_flight]


def test_zbv_keeps_slack_for_a_slower_rank_and_latency() -> None:
    """The hand-made V order runs a rank's first-chunk input gradient a round after its last chunk
    sent one down: a rank 15% slower than the rest, or message latency, costs less than in the
    greedy order at unit costs (which leaves that gradient no slack)."""
    from pipedream.schedules.common import add_communication, flush_update
    from pipedream.schedules.zb_order import zero_bubble_order

    for pp, m in ((2, 8), (4, 8), (4, 16), (8, 16)):
        placement = schedule_placement("zbv", pp)
        greedy = [actions + flush_update() for actions in add_communication(
            zero_bubble_order(placement, m, [2 * pp] * pp), pp, 2, placement)]
        forward = {(r, c): 1.15 if r == 0 else 1.0 for r in range(pp) for c in range(2)}
        for costs in (Costs(forward=1.0, backward=2.0, weight_grad=1.0, latency=0.1),
                      Costs(forward=forward, backward={k: 2 * v for k, v in forward.items()}, weight_grad=forward)):
            built = simulate(build_schedule("zbv", pp, m), costs, vpp=2, peer=placement.peer, needs=placement.needs)
            old = simulate(greedy, costs, vpp=2, peer=placement.peer, needs=placement.needs)
            assert built.iteration_time < old.iteration_time, (pp, m, costs)
            assert built.peak_in_flight == old.peak_in_flight == [2 * pp] * pp


@pytest.mark.parametrize("name", ZERO_BUBBLE)
def test_other_costs_and_latency_never_deadlock(name: str) -> None:
    costs = Costs(forward=1.0, backward=2.5, weight_grad=0.7, latency=0.3, act_bytes=2.0, grad_bytes=2.0,
                  bandwidth=4.0)
    for pp in (2, 3, 4, 8):
        for m in (1, pp, 2 * pp + 1, 32):
            _, placement, result = run(name, pp, m, costs)
            busy = m * placement.vpp * (1.0 + 2.5)
            assert all(abs(b - busy) < 1e-9 for b in result.busy), (pp, m)


def stream_sizes(pp: int) -> list[int]:
    return sorted({1, 2, 3, pp, pp + 1, 2 * pp - 1, 2 * pp, 2 * pp + 1, 3 * pp, 17, 31, 32})


@pytest.mark.parametrize("name", ZERO_BUBBLE)
def test_deadlock_free_under_nccl_stream_rules(name: str) -> None:
    for pp in range(1, 9):
        for m in stream_sizes(pp):
            schedule = build_schedule(name, pp, m)
            placement = schedule_placement(name, pp)
            orders = [issue_order(actions) for actions in schedule]
            for streams in ("direction", "channel"):
                check_stream_order(orders, pp, placement.vpp, streams=streams, peer=placement.peer,
                                   needs=placement.needs)


def test_the_v_placement() -> None:
    v = Placement(4, 2, "vshape")
    assert [[v.virtual_stage(r, c) for c in range(2)] for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert all(v.stage_of(v.virtual_stage(r, c)) == (r, c) for r in range(4) for c in range(2))
    assert v.is_first(0, 0) and v.is_last(0, 1) and not v.is_last(3, 1)
    assert v.peer(1, Action(Kind.SEND_ACT, 0, 1)) == (0, 1)       # chunk 1 goes back up the ranks
    assert v.peer(0, Action(Kind.RECV_ACT, 0, 1)) == (1, 1)
    # the bottom of the V changes chunk on rank 3 without a message
    assert v.sends(3, Action(Kind.FWD, 0, 0)) is None and v.needs(3, Action(Kind.FWD, 0, 1)) is None
    assert v.sends(3, Action(Kind.BWD, 0, 1)) is None and v.needs(3, Action(Kind.BWD, 0, 0)) is None
    assert v.needs(0, Action(Kind.BWD, 0, 1)) is None and v.needs(2, Action(Kind.WEIGHT, 0, 0)) is None
    zbv = build_schedule("zbv", 4, 8)
    assert not any(a.kind in (Kind.SEND_ACT, Kind.SEND_GRAD) and v.peer(3, a)[0] == 3 for a in zbv[3])
    with pytest.raises(ScheduleError):    # round-robin peers do not fit a V
        check_channel_order(zbv, 4, 2)


def test_simulator_runs_explicit_w_and_frees_memory_there() -> None:
    schedule = [parse_actions("F0 F1 B0 B1 W0 W1 SYNC STEP")]
    result = simulate(schedule, Costs(forward=1.0, backward=3.0, weight_grad=1.0, stash_bytes=1.0))
    spans = [(str(i.action), i.start, i.end) for i in result.timelines[0] if i.action.microbatch >= 0]
    assert spans == [("F0", 0, 1), ("F1", 1, 2), ("B0", 2, 4), ("B1", 4, 6), ("W0", 6, 7), ("W1", 7, 8)]
    assert result.peak_in_flight == [2] and result.busy == [8.0]
    with pytest.raises(ScheduleError, match="without an earlier backward"):
        simulate([parse_actions("F0 W0 B0 SYNC STEP")], UNIT)


def test_existing_schedules_keep_their_implicit_weight_gradients() -> None:
    for name in ("gpipe", "1f1b", "interleaved"):
        assert not any(a.kind is Kind.WEIGHT for actions in build_schedule(name, 4, 8) for a in actions)
    assert parse_action("W3.1") == Action(Kind.WEIGHT, 3, 1) and str(Action(Kind.WEIGHT, 3, 1)) == "W3.1"


def test_bad_sizes_are_one_line() -> None:
    with pytest.raises(ScheduleError, match="exactly 2 chunks"):
        build_schedule("zbv", 4, 8, 3)
    with pytest.raises(ScheduleError, match="needs vpp = 1"):
        build_schedule("zb_h2", 4, 8, 2)


def test_training_accepts_them_with_the_v_placement() -> None:
    assert SPLIT_BACKWARD_SCHEDULES <= set(SCHEDULES)
    spec = build_run_spec(compose_config(["schedule=zbv", "parallel.pp=2"]), 2)
    assert (spec.layout.vpp, spec.layout.placement) == (2, "vshape")
    assert [spec.layout.virtual_stage(1, c) for c in (0, 1)] == [1, 2]
    assert build_run_spec(compose_config(["schedule=zb_h2", "parallel.pp=2"]), 2).layout.vpp == 1
    with pytest.raises(ConfigError, match="exactly 2 chunks per rank") as error:
        build_run_spec(compose_config(["schedule=zbv", "parallel.pp=2", "parallel.vpp=3"]), 2)
    assert "\n" not in str(error.value)


def test_cli_prints_w_and_the_v(capsys) -> None:
    assert main(["--schedule", "zbv", "--pp", "4", "--microbatches", "8"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("rank ")]
    assert len(rows) == 4 and all("W7a" in row and "W7b" in row for row in rows)
    assert "iteration time: 51 units" in out and "rank 0: 0,7" in out
    assert main(["--schedule", "zb_h2", "--pp", "4", "--microbatches", "8"]) == 0
    out = capsys.readouterr().out
    assert "steady-state bubble (no synchronisation at the step): 0.0000" in out and "W0" in out
    # a held-back weight gradient of an older schedule is drawn as W too
    assert main(["--schedule", "1f1b", "--pp", "2", "--microbatches", "4", "--weight-grad-cost", "1"]) == 0
    assert "W0" in capsys.readouterr().out


def test_cli_draws_w_boxes(tmp_path, capsys) -> None:
    pytest.importorskip("matplotlib")
    from pipedream.schedules.timeline_plot import spans_from_sim

    _, _, result = run("zbv", 2, 4)
    assert {kind for row in spans_from_sim(result) for _, kind, *_ in row} >= {"F", "B", "W"}
    path = tmp_path / "zbv.png"
    assert main(["--schedule", "zbv", "--pp", "2", "--microbatches", "4", "--png", str(path)]) == 0
    assert path.stat().st_size > 0
