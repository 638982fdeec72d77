"""The layer-split benchmark's arithmetic and its smoke run (no timing is asserted)."""
from __future__ import annotations

import json

from scripts.bench.layer_split import main, pace


def test_pace_is_the_slowest_rank():
    times = [1.0, 4.0, 4.0, 4.0, 4.0, 2.0]               # embedding, 4 blocks, head
    even, balanced = [(0, 2), (2, 4), (4, 5), (5, 6)], [(0, 2), (2, 3), (3, 4), (4, 6)]
    assert pace(times, even, "one chunk") == 8.0 and pace(times, balanced, "one chunk") == 6.0
    # a V pairs stages 0 and 3 on rank 0, 1 and 2 on rank 1
    assert pace(times, even, "V") == 12.0 and pace(times, balanced, "V") == 11.0


def test_quick_run_writes_json_markdown_and_its_section(tmp_path):
    assert main(["--quick", "--repeats", "1", "--out", str(tmp_path / "bench_layer_split")]) == 0
    report = json.loads((tmp_path / "bench_layer_split.json").read_text())
    assert {row["placement"] for row in report["rows"]} == {"one chunk", "V"}
    assert all(sum(row["balanced"]) == sum(row["even"]) == row["layers"] for row in report["rows"])
    assert "<!-- bench_layer_split:begin -->" in (tmp_path / "benchmarks.md").read_text()
