"""Schedules as data: every valid size is complete, matched, deadlock-free and hits its bubble.

Pure Python and fast: the full (p in 1..8, m in 1..32, v in 1..4) product runs in seconds.
"""
from __future__ import annotations

import pytest

from pipedream.schedules import (Action, Kind, Placement, ScheduleError, build_schedule, format_actions,
                                 parse_action, parse_actions)
from pipedream.schedules.__main__ import main
from pipedream.schedules.common import peer_stage
from pipedream.schedules.interleaved import warmup_forwards
from pipedream.schedules.channels import check_channel_order
from pipedream.schedules.simulate import Costs, simulate
from tests.support.schedule_checks import check_compute


def valid_sizes(name: str, pp: int):
    """(microbatches, vpp) pairs the schedule accepts for this pp."""
    vpps = [1, 2, 3, 4] if name == "interleaved" and pp > 1 else [1]
    for vpp in vpps:
        for m in range(1, 33):
            if vpp == 1 or m % pp == 0:
                yield m, vpp


def expected_peak(name: str, pp: int, m: int, vpp: int, rank: int) -> int:
    if name == "gpipe":
        return m
    if name == "1f1b" or vpp == 1:
        return min(pp - rank, m)
    # interleaved: the warm-up forwards plus the one forward of the first 1F1B pair
    return min((pp - rank - 1) * 2 + (vpp - 1) * pp + 1, m * vpp)


@pytest.mark.parametrize("pp", range(1, 9))
@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved"])
def test_every_valid_size(name: str, pp: int) -> None:
    for m, vpp in valid_sizes(name, pp):
        where = f"{name} pp={pp} m={m} vpp={vpp}"
        schedule = build_schedule(name, pp, m, vpp)
        assert len(schedule) == pp, where
        check_compute(schedule, m, vpp)  # each (mb, chunk) F and B once per rank, B after F
        check_channel_order(schedule, pp, vpp)  # sends match receives, in order, per (src, dst)
        for rank, actions in enumerate(schedule):
            assert actions[-2:] == [Action(Kind.SYNC_GRADS), Action(Kind.STEP)], where
        expected_bubble = (pp - 1) / (vpp * m)
        for backward in (1.0, 2.0):
            result = simulate(schedule, Costs(forward=1.0, backward=backward), vpp=vpp)
            assert abs(result.bubble_fraction - expected_bubble) < 1e-9, (where, backward)
            assert all(abs(b - expected_bubble) < 1e-9 for b in result.bubble_fractions), (where, backward)
            assert abs(result.iteration_time - (m * vpp + pp - 1) * (1 + backward)) < 1e-9, where
        assert result.peak_in_flight == [expected_peak(name, pp, m, vpp, r) for r in range(pp)], where


def test_interleaved_peak_matches_its_warmup() -> None:
    for pp, m, vpp in [(4, 8, 2), (2, 4, 3), (8, 8, 4)]:
        result = simulate(build_schedule("interleaved", pp, m, vpp))
        assert result.peak_in_flight == [min(warmup_forwards(r, pp, m, vpp) + 1, m * vpp) for r in range(pp)]


def test_interleaved_with_one_chunk_is_1f1b() -> None:
    for pp in range(1, 6):
        for m in range(1, 12):
            assert build_schedule("interleaved", pp, m, 1) == build_schedule("1f1b", pp, m)


def test_interleaved_forward_order_follows_groups_of_pp() -> None:
    schedule = build_schedule("interleaved", 2, 4, 2)
    forwards = [(a.microbatch, a.chunk) for a in schedule[1] if a.kind is Kind.FWD]
    assert forwards == [(0, 0), (1, 0), (0, 1), (1, 1), (2, 0), (3, 0), (2, 1), (3, 1)]
    backwards = [(a.microbatch, a.chunk) for a in schedule[1] if a.kind is Kind.BWD]
    assert backwards == [(0, 1), (1, 1), (0, 0), (1, 0), (2, 1), (3, 1), (2, 0), (3, 0)]
    assert format_actions(schedule[1][:6]) == "RA0 F0 SA0 RA1 F1 SA1"


def test_virtual_stages_and_peers() -> None:
    pp, vpp = 4, 2
    round_robin = Placement(pp, vpp)
    assert [round_robin.virtual_stage(r, c) for c in range(vpp) for r in range(pp)] == list(range(8))
    assert round_robin.is_first(0, 0) and not round_robin.is_first(0, 1)
    assert round_robin.is_last(3, 1) and not round_robin.is_last(3, 0)
    assert peer_stage(3, Action(Kind.SEND_ACT, 0, 0), pp, vpp) == (0, 1)  # wraps to the next chunk
    assert peer_stage(0, Action(Kind.RECV_ACT, 0, 1), pp, vpp) == (3, 0)
    assert peer_stage(0, Action(Kind.SEND_GRAD, 0, 1), pp, vpp) == (3, 0)
    assert peer_stage(1, Action(Kind.RECV_GRAD, 5, 0), pp, vpp) == (2, 0)
    with pytest.raises(ScheduleError):
        peer_stage(0, Action(Kind.RECV_ACT, 0, 0), pp, vpp)


@pytest.mark.parametrize("args, message", [
    (("interleaved", 4, 6, 2), "schedule interleaved needs microbatches (6) to be a multiple of pp (4): "
                               "use 8 or 4 microbatches"),
    (("interleaved", 4, 3, 2), "use 4 microbatches"),
    (("interleaved", 1, 4, 2), "needs pp >= 2"),
    (("gpipe", 2, 4, 2), "schedule gpipe needs vpp = 1, got 2"),
    (("1f1b", 2, 4, 3), "schedule 1f1b needs vpp = 1, got 3"),
    (("1f1b", 0, 4, 1), "pp = 0 must be >= 1"),
    (("gpipe", 2, 0, 1), "microbatches = 0 must be >= 1"),
    (("nope", 2, 4, 1), "schedule='nope' is unknown"),
])
def test_bad_sizes_are_rejected_with_one_line(args, message: str) -> None:
    with pytest.raises(ScheduleError) as info:
        build_schedule(*args)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_compact_string_round_trip() -> None:
    for name, pp, m, vpp in [("gpipe", 3, 4, 1), ("1f1b", 4, 8, 1), ("interleaved", 2, 4, 3)]:
        for actions in build_schedule(name, pp, m, vpp):
            assert parse_actions(format_actions(actions)) == actions
            assert all(parse_action(str(a)) == a for a in actions)
    assert parse_action("F3.1") == Action(Kind.FWD, 3, 1)
    assert str(Action(Kind.RECV_GRAD, 12, 2)) == "RG12.2"
    assert str(Action(Kind.SYNC_GRADS)) == "SYNC"
    with pytest.raises(ValueError):
        parse_action("X3")


def test_cli_grid_shape(capsys) -> None:
    assert main(["--schedule", "1f1b", "--pp", "4", "--microbatches", "8"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = [line for line in lines if line.startswith("rank ")]
    assert len(rows) == 4 and lines[0].startswith("t ")
    assert rows[0].split()[2:7] == ["F0", "F1", "F2", "F3", "."]
    assert rows[3].split()[2:6] == [".", ".", ".", "F0"]
    cells = [row.split()[2:] for row in rows]
    assert [len(c) for c in cells] == [(8 + 4 - 1) * 2] * 4  # one cell per unit slot, idle included
    assert all(row[7 + 3 * i] != " " for row in rows for i in range(22))  # aligned 3-wide columns
    assert sum(c.startswith("F") for c in cells[2]) == 8 and sum(c.startswith("B") for c in cells[2]) == 8
    assert any("bubble fraction" in line and "0.3750" in line for line in lines)
    assert any(line.endswith("4 3 2 1") for line in lines)


def test_cli_interleaved_labels_chunks(capsys) -> None:
    assert main(["--schedule", "interleaved", "--pp", "2", "--vpp", "2", "--microbatches", "4"]) == 0
    out = capsys.readouterr().out
    assert "rank 0 F0a F1a F0b F1b" in out and "0.1250" in out


@pytest.mark.parametrize("argv", [
    ["--schedule", "interleaved", "--pp", "4", "--vpp", "2", "--microbatches", "6"],
    ["--schedule", "nope", "--pp", "2", "--microbatches", "2"],
    ["--schedule", "1f1b", "--pp", "two", "--microbatches", "2"],
    ["--schedule", "1f1b", "--pp", "2"],
])
def test_cli_bad_input_is_one_line_and_exit_2(argv, capsys) -> None:
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.startswith("error: ") and captured.err.count("\n") == 1
