"""Timeline spans from the simulator, and the PNG Gantt chart."""
from __future__ import annotations

import pytest

from pipedream.schedules import build_schedule
from pipedream.schedules.__main__ import main
from pipedream.schedules.simulate import Costs, simulate
from pipedream.schedules.timeline_plot import span_color, spans_from_sim

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_spans_from_sim() -> None:
    result = simulate(build_schedule("interleaved", 2, 2, 2), Costs(forward=1.0, backward=2.0))
    spans = spans_from_sim(result)
    assert len(spans) == 2
    assert spans[0][0] == ("0", "F", 0, 0, 0.0, 1.0)
    assert spans[1][0] == ("0", "F", 0, 0, 1.0, 2.0)
    assert {s[1] for s in spans[0]} == {"F", "B", "SYNC", "STEP"}
    assert sum(1 for s in spans[0] if s[1] == "B" and s[3] == 1) == 2
    assert span_color("F", 0) != span_color("F", 1) != span_color("B", 1)
    assert span_color("SYNC", 0) == span_color("wait", 3)


def test_held_weight_gradients_become_w_spans() -> None:
    result = simulate(build_schedule("1f1b", 2, 4), Costs(forward=1.0, backward=2.0, weight_grad=1.0))
    last = [s for s in spans_from_sim(result)[1] if s[1] == "W"]
    assert [(label, mb) for label, _, mb, _, _, _ in last] == [(str(k), k) for k in range(4)]
    assert all(end - start == 1.0 for *_, start, end in last)
    # the first stage sends no gradient: only the backwards followed by a forward's send hold W
    first = [s for s in spans_from_sim(result)[0] if s[1] == "W"]
    assert [mb for _, _, mb, _, _, _ in first] == [0, 1]


def test_plot_timeline_writes_png(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    from pipedream.schedules.timeline_plot import plot_timeline

    path = tmp_path / "timeline.png"
    plot_timeline(spans_from_sim(simulate(build_schedule("1f1b", 3, 4))), str(path), "1f1b")
    assert path.read_bytes()[:8] == PNG_MAGIC
    measured = [[("fwd", "F", 0, 0, 10.0, 10.5), ("bwd", "B", 0, 0, 11.0, 12.2)], []]  # generic spans
    plot_timeline(measured, str(tmp_path / "measured.png"), "measured")
    assert (tmp_path / "measured.png").stat().st_size > 1000


def test_cli_png(tmp_path, capsys) -> None:
    pytest.importorskip("matplotlib")
    path = tmp_path / "grid.png"
    assert main(["--schedule", "interleaved", "--pp", "2", "--vpp", "2", "--microbatches", "2",
                 "--png", str(path)]) == 0
    assert f"wrote {path}" in capsys.readouterr().out
    assert path.read_bytes()[:8] == PNG_MAGIC
