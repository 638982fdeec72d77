"""Traced iterations on CUDA are timed with CUDA events (marked gpu: skipped without CUDA; run with
`scripts/test.sh -m gpu`). The event clock times the device's work without waiting for it, and a
real traced run's boxes follow each other on the compute stream and fill its iterations."""
from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pytest
import torch

from tests.support.precision_harness import train_on_cuda
from tests.support.training_harness import TINY_GPT
from tests.support.workers import run_workers

pytestmark = pytest.mark.gpu

TRACED = ["train.steps=6", "trace.enabled=true", "trace.steps=[4,5]", "trace.timeline=false"]
TOLERANCE_US = 1.0     # CUDA event timestamps resolve about 0.5 us; the trace rounds to 1 ns
FILLED = 0.5           # the share of an iteration its boxes cover, at least (the rest is host work between actions)


def test_event_stamps_time_the_device_work_not_its_launches():
    from pipedream.observe.device_clock import clock_for
    clock = clock_for(torch.device("cuda"))
    big = torch.randn(8192, 8192, device="cuda")
    big @ big   # warm-up: cuBLAS handle, workspace
    clock.start_traced()
    origin = clock()
    for _ in range(20):
        big @ big   # 1.1 TFLOP each: far longer on the device than the launch takes on the host
    after = clock()
    seconds = clock.resolver(origin)
    clock.stop_traced()
    device_s = seconds(after) - seconds(origin)
    assert seconds(origin) == origin.host
    assert device_s > 3 * (after - origin).host   # the host did not wait for the GEMMs
    assert seconds(after - origin) == pytest.approx(device_s, abs=1e-6)
    assert isinstance(clock(), float)   # outside traced iterations: the host clock


def iteration_boxes(trace_path: Path) -> dict[tuple[int, int], tuple[dict, list[dict]]]:
    """(rank, step) -> (the iteration's box, the boxes inside it)."""
    events = [e for e in json.loads(trace_path.read_text())["traceEvents"] if e["ph"] == "X"]
    iterations = {(e["pid"], e["args"]["step"]): e for e in events if e["cat"] == "iteration"}
    inside = defaultdict(list)
    for e in events:
        if e["cat"] != "iteration":
            inside[(e["pid"], e["args"]["step"])].append(e)
    return {key: (box, sorted(inside[key], key=lambda e: e["ts"])) for key, box in iterations.items()}


def assert_boxes_tile_iterations(trace_path: Path, ranks: int) -> None:
    boxes = iteration_boxes(trace_path)
    assert sorted(boxes) == [(rank, step) for rank in range(ranks) for step in (4, 5)]
    for (rank, step), (iteration, actions) in boxes.items():
        assert actions, f"rank {rank} step {step}: no actions traced"
        begin, end = iteration["ts"], iteration["ts"] + iteration["dur"]
        for before, after in zip(actions, actions[1:]):   # one compute stream: no two boxes overlap
            assert after["ts"] >= before["ts"] + before["dur"] - TOLERANCE_US, (rank, step, before, after)
        assert actions[0]["ts"] >= begin - TOLERANCE_US and actions[-1]["ts"] + actions[-1]["dur"] <= end + TOLERANCE_US
        covered = sum(a["dur"] for a in actions)
        assert FILLED * iteration["dur"] <= covered <= iteration["dur"] + len(actions) * TOLERANCE_US, \
            (rank, step, covered, iteration["dur"])


def test_a_traced_run_on_cuda_fills_its_iterations_with_non_overlapping_boxes(tmp_path):
    run_dir = tmp_path / "pp1"
    (result,) = run_workers(train_on_cuda, 1, TINY_GPT + TRACED + ["parallel.pp=1"], str(run_dir))
    assert result["device"].startswith("cuda")
    assert_boxes_tile_iterations(run_dir / "trace" / "trace.json", ranks=1)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_a_two_stage_nccl_run_fills_its_iterations_with_non_overlapping_boxes(tmp_path):
    """With pp=2 the stream also waits for messages: those waits are boxes of their own."""
    run_dir = tmp_path / "pp2"
    results = run_workers(train_on_cuda, 2, TINY_GPT + TRACED + ["parallel.pp=2"], str(run_dir))
    assert [r["device"] for r in results] == ["cuda:0", "cuda:1"]
    assert_boxes_tile_iterations(run_dir / "trace" / "trace.json", ranks=2)
