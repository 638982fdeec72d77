"""The calibration's latency + bytes / bandwidth fit (planner.calibrate.fit) on synthetic points: exact
on a clean line, unmoved by one stalled size, and where the times do not rise with the size a stated
bound instead of an infinite bandwidth (the NaN that an impossible cut then became in PipeDream's DP)."""
from __future__ import annotations

import json
import math
import warnings

import pytest

from planner.calibrate.fit import LARGEST_MESSAGE_BOUND, THEIL_SEN, fit_latency_bandwidth
from planner.calibrate.sheet import MESSAGE_SIZES, fit_notes
from planner.config import compose, inputs_from_config
from planner.errors import PlannerError
from planner.search.pipedream_search import pipedream_search
from tests.unit.planner.calibrate.test_calibration import write_sheet

LATENCY, BANDWIDTH = 3e-4, 2e9
# what a calibration on 2 busy cores measured (p2p one-way): 4 MiB faster than 64 KiB and 512 KiB;
# the slope through the two largest sizes was negative, the sheet said 1491 us + infinite bandwidth
RECORDED = [[4096.0, 7.05e-4], [65536.0, 1.793e-3], [524288.0, 1.960e-3], [4194304.0, 1.188e-3]]


def line(sizes=MESSAGE_SIZES):
    return [[float(x), LATENCY + x / BANDWIDTH] for x in sizes]


def good(fit) -> bool:
    return 0 < fit.bandwidth < math.inf and 0 <= fit.latency_s < math.inf


def test_a_clean_line_is_fitted_exactly():
    fit = fit_latency_bandwidth(line(), "p2p")
    assert fit.method == THEIL_SEN and fit.note == "" and "note" not in fit.to_json()
    assert fit.bandwidth == pytest.approx(BANDWIDTH) and fit.latency_s == pytest.approx(LATENCY)


@pytest.mark.parametrize("stalled", range(len(MESSAGE_SIZES)))
def test_one_stalled_size_does_not_move_the_fit_far(stalled):
    points = line()
    points[stalled][1] += 5e-3   # a scheduler stall longer than the largest transfer
    fit = fit_latency_bandwidth(points, "p2p")
    assert fit.method == THEIL_SEN and good(fit)
    assert fit.bandwidth == pytest.approx(BANDWIDTH, rel=0.5)


def test_the_recorded_noisy_calibration_gets_a_finite_bandwidth():
    fit = fit_latency_bandwidth(RECORDED, "p2p one-way")
    assert good(fit) and fit.method == THEIL_SEN


@pytest.mark.parametrize("points", [
    [[4096.0, 1e-3], [4194304.0, 1e-3]],                            # flat
    [[4096.0, 2e-3], [65536.0, 1.5e-3], [4194304.0, 1e-3]],        # falling
    [[4096.0, 2e-3], [65536.0, 2e-3], [524288.0, 2e-3], [4194304.0, 1.9e-3]],
])
def test_times_that_do_not_rise_fall_back_to_a_stated_bound(points):
    fit = fit_latency_bandwidth(points, "p2p one-way")
    assert fit.method == LARGEST_MESSAGE_BOUND and good(fit)
    assert fit.bandwidth == pytest.approx(points[-1][0] / points[-1][1])   # every second of it as transfer
    assert fit.note.startswith("p2p one-way times do not rise with the message size (4 KiB ")
    assert f"{fit.bandwidth / 1e9:.2f} GB/s" in fit.note
    sheet = {"p2p": fit.to_json(), "allreduce": {}, "optimizer": {}}
    assert fit_notes(sheet) == [fit.note]   # printed as a warning by python -m planner.calibrate


@pytest.mark.parametrize("points", [[[4096.0, 1e-3]], [[4096.0, 1e-3], [4096.0, 2e-3]], [[4096.0, 0.0], [8192.0, 1e-3]],
                                    [[4096.0, float("nan")], [8192.0, 1e-3]], [[0.0, 1e-3], [8192.0, 2e-3]]])
def test_points_no_line_can_be_fitted_to_are_refused_in_one_line(points):
    with pytest.raises(PlannerError, match="p2p: cannot fit latency \\+ bytes / bandwidth to .*at least two message"):
        fit_latency_bandwidth(points, "p2p")


def test_a_sheet_from_a_bound_fit_plans_pipedream_without_nan(tmp_path):
    """An infinite bandwidth turned PipeDream's impossible cuts (infinite bytes) into NaN: every
    pipelined split compared false and the DP could only replicate."""
    path = tmp_path / "sheet.json"
    sheet = write_sheet(path)
    fit = fit_latency_bandwidth([[4096.0, 2e-3], [4194304.0, 1e-3]], "p2p one-way")
    sheet["p2p"] = {**fit.to_json(), "points": []}
    path.write_text(json.dumps(sheet))
    inputs = inputs_from_config(compose(["cluster=measured", f"cluster.calibration={path}", "train.global_batch_size=16"]))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        best = pipedream_search(inputs).best
    assert 0 < best.iteration_time < math.inf
