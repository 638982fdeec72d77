"""Gantt charts of pipeline timelines as PNG, in the style of the papers' schedule figures.

Input is generic so simulated and measured timelines draw the same way: per rank, a list of
spans ``(label, kind, microbatch, chunk, start, end)`` where kind is "F", "B", "W" (weight
gradients: a schedule's W action, or the part of a backward held back after its send) or anything else (drawn grey, e.g. "SYNC", "STEP").
matplotlib is imported lazily, with the Agg canvas and no pyplot, so importing this module (or
the simulator) never needs a display or matplotlib itself.
"""
from __future__ import annotations

from typing import Sequence

from pipedream.schedules.simulate import SimResult

Span = tuple[str, str, int, int, float, float]
"""(label, kind, microbatch, chunk, start, end)."""

# Blue forwards and green backwards as in Megatron's figures; chunk c gets the c-th (lighter) shade.
_SHADES = {"F": ("#1f4e9c", "#4f7fd0", "#8fb0e6", "#c5d6f4"),
           "B": ("#1b7a3a", "#3fa862", "#86cf9b", "#c2e8cc"),
           "W": ("#7a5c1b", "#a8843f", "#cfb586", "#e8dcc2"),   # weight gradients: W actions or held back
           "SI": ("#e08a1e",), "SO": ("#8e44ad",), "PF": ("#f3c27a",), "U": ("#c0392b",)}   # harmony_pp
_OTHER = "#9e9e9e"


def spans_from_sim(result: SimResult) -> list[list[Span]]:
    """SimResult timelines -> spans; F/B boxes are labelled by micro-batch like the papers."""
    spans: list[list[Span]] = []
    for timeline in result.timelines:
        row = []
        for item in timeline:
            a = item.action
            label = str(a.microbatch) if a.microbatch >= 0 else a.kind.value
            kind = "W" if item.weight_grads else a.kind.value
            row.append((label, kind, a.microbatch, a.chunk, item.start, item.end))
        spans.append(row)
    return spans


def span_color(kind: str, chunk: int) -> str:
    shades = _SHADES.get(kind)
    return shades[min(chunk, len(shades) - 1)] if shades else _OTHER


def plot_timeline(timelines: Sequence[Sequence[Span]], path: str, title: str = "", *, xlabel: str = "time",
                  width: float | None = None, row_names: Sequence[str] | None = None) -> None:
    """Draw one row per rank (rank 0 on top); idle time stays white. Writes a PNG to ``path``.
    ``width`` (inches) defaults to one that grows with the time span (unit-cost timelines);
    ``row_names`` label the rows top-down (default ``rank 0``, ``rank 1``, ...)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    ranks = len(timelines)
    start = min((s[4] for row in timelines for s in row), default=0.0)
    end = max((s[5] for row in timelines for s in row), default=1.0)
    length = max(end - start, 1e-12)
    width = width or min(max(6.0, 0.3 * length if length > 4 else 6.0), 30.0)
    fig = Figure(figsize=(width, 0.55 * ranks + 1.4))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    min_text_width = length / (width * 12)  # skip labels on boxes too narrow to hold them
    chunks = set()
    for rank, row in enumerate(timelines):
        y = ranks - 1 - rank
        for label, kind, _mb, chunk, s, e in row:
            if e <= s:
                continue
            chunks.add((kind, chunk))
            ax.barh(y, e - s, left=s - start, height=0.8, color=span_color(kind, chunk),
                    edgecolor="black", linewidth=0.4)
            if e - s >= min_text_width * max(len(label), 1):
                text_color = "white" if chunk < 2 and kind in _SHADES else "black"
                ax.text((s + e) / 2 - start, y, label, ha="center", va="center", fontsize=7, color=text_color)
    names = list(row_names) if row_names is not None else [f"rank {r}" for r in range(ranks)]
    ax.set_yticks(range(ranks), [names[ranks - 1 - y] for y in range(ranks)])
    ax.set_xlim(0, length)
    ax.set_ylim(-0.6, ranks - 0.4)
    ax.set_xlabel(xlabel)
    ax.set_title(title)
    names = {"F": "forward", "B": "backward", "W": "weight gradients (W)", "SI": "swap in", "SO": "swap out",
             "PF": "prefetch", "U": "update"}
    interleaved = any(c > 0 for _, c in chunks)
    handles = [Patch(color=span_color(k, c), label=f"{names[k]}{f' chunk {c}' if interleaved else ''}")
               for k, c in sorted(chunks, key=lambda kc: (list(names).index(kc[0]) if kc[0] in names else 9, kc))
               if k in names]
    others = sorted({k for k, _ in chunks if k not in names})
    if others:   # one grey entry for everything that is not compute
        handles.append(Patch(color=_OTHER, label=", ".join(others)))
    bottom = 0.0
    if handles:
        fig.legend(handles=handles, loc="lower center", ncol=min(len(handles), 6), fontsize=7, frameon=False)
        bottom = 0.35 / fig.get_figheight()
    fig.tight_layout(rect=(0, bottom, 1, 1))
    fig.savefig(path, dpi=120)
