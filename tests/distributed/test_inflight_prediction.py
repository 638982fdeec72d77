"""What a run measures (peak in-flight micro-batches, peak stash bytes per rank) is what the
simulator predicts for the same schedule, fed with the measured bytes of one micro-batch."""
from __future__ import annotations

import pytest

from pipedream.schedules import build_schedule
from pipedream.schedules.simulate import Costs, simulate
from tests.support.workers import run_workers
from tests.support.training_harness import TINY_GPT, train_rank

RUNS = [("gpipe", 1, []), ("1f1b", 1, []), ("interleaved", 2, []), ("1f1b", 1, ["recompute.granularity=full"])]


@pytest.mark.slow
def test_measured_in_flight_and_stash_equal_the_simulation(tmp_path):
    runs = [(TINY_GPT + ["train.steps=2", f"schedule={name}", "parallel.pp=2", f"parallel.vpp={vpp}", *extra],
             str(tmp_path / f"{name}{i}")) for i, (name, vpp, extra) in enumerate(RUNS)]
    per_rank = run_workers(train_rank, 2, runs)
    for index, (name, vpp, _) in enumerate(RUNS):
        summary = per_rank[0][index]["summary"]
        ranks = summary["ranks"]
        per_microbatch = {(s["pp_rank"], chunk): nbytes for s in ranks
                          for chunk, nbytes in s["stash_bytes_per_microbatch"].items()}
        m = summary["batch"]["num_microbatches"]
        predicted = simulate(build_schedule(name, 2, m, vpp), Costs(stash_bytes=per_microbatch))
        for stats in ranks:
            assert stats["peak_in_flight"] == predicted.peak_in_flight[stats["pp_rank"]], (name, stats)
            assert stats["peak_stash_bytes"] == predicted.peak_stash_bytes[stats["pp_rank"]], (name, stats)
        if name == "1f1b":
            assert [s["peak_in_flight"] for s in ranks] == [2, 1]   # p - s at stage s
        if name == "gpipe":
            assert [s["peak_in_flight"] for s in ranks] == [m, m]
