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


def test_rows_carry_their_names_top_down(tmp_path, monkeypatch) -> None:
    """A pp=2 tp=2 run's rows are its ranks with their coordinates (``ParallelLayout.rank_label``)."""
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    from pipedream.config.layout import ParallelLayout
    from pipedream.schedules.timeline_plot import plot_timeline

    drawn = []
    monkeypatch.setattr(Figure, "savefig", lambda fig, *args, **kwargs: drawn.append(fig))
    layout = ParallelLayout(pp=2, tp=2)
    names = [layout.rank_label(rank) for rank in range(4)]
    plot_timeline([[("0", "F", 0, 0, 0.0, 1.0)]] * 4, str(tmp_path / "t.png"), f"1f1b {layout.degrees()}",
                  row_names=names)
    axes = drawn[0].axes[0]
    assert axes.get_title() == "1f1b pp=2 tp=2 dp=1"
    top_down = [label.get_text() for label in axes.get_yticklabels()][::-1]
    assert top_down == ["rank 0 (pp 0, tp 0, dp 0)", "rank 1 (pp 0, tp 1, dp 0)", "rank 2 (pp 1, tp 0, dp 0)",
                        "rank 3 (pp 1, tp 1, dp 0)"]
